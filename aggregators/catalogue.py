"""The field's stronger aggregators, on the device: subset searches (MDA, SMEA), spectral
filters (CAF, DnC), Bulyan, and FLTrust (which needs the server's reference message). The
clustering rules (SignGuard, clipped clustering) are in `aggregators.clustering`.

Like the rules of `aggregators.rules`, these keep the input's dtype and device, never write
into their input, and make every data-dependent choice with tensor ops (masks, `torch.where`,
argmins), never with a Python branch on a value. One exception: `torch.linalg.eigh` /
`eigvalsh` (SMEA, CAF, DnC) synchronize a CUDA device with the host to check for errors, as
PyTorch documents; everything else stays queued on the device. Row-count conditions depend
on shapes only and are checked on the host before any kernel runs.

Numerical policy (as in `aggregators.base`): distances and Gram matrices are computed on the
rows minus their coordinate-wise median (translation-exact, and no cancellation between
large norms), in float32 at least; a row whose squared norm overflows counts as infinitely
far; outputs are convex combinations of the input rows (FLTrust: of rescaled rows), so a
1e38 row never makes the output overflow.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from .base import (
    Generated,
    Rule,
    check_f,
    pairwise_sq_distances,
    smallest,
    with_diagonal,
    working_dtype,
)
from .checks import integer, iterations, real
from .rules import Meamed, _require

INF = float("inf")
MAX_SUBSETS = 10**7  # mda/smea: C(n, f) subsets enumerated and scored every round
CHUNK_ELEMENTS = 1 << 22  # subsets are scored in chunks of at most this many gathered matrix entries


# ---- shared helpers ------------------------------------------------------------------------

def _centered(x: torch.Tensor) -> torch.Tensor:
    """x minus its coordinate-wise (lower) median, in the working dtype (float32 at least): a
    robust center, so that distances of huge rows do not swamp the others' by cancellation.
    torch.median selects, several times faster than a full sort."""
    xw = working_dtype(x)
    return xw - xw.median(dim=0).values


def _average(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w_i x_i for weights w (n,) summing to 1, in x's dtype: every term is scaled before
    the sum, so no partial sum of 1e38 rows overflows."""
    return w.to(x.dtype) @ x


def _mean_of_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the rows of x where mask (n,) bool is true (at least one must be)."""
    w = mask.to(working_dtype(x).dtype)
    return _average(x, w / w.sum())


def _gram(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, far): K (n, n) the symmetric Gram matrix of the median-centered rows, and far (n,)
    bool the rows whose squared norm overflows; their rows and columns of K are 0."""
    xc = _centered(x)
    k = xc @ xc.T
    k = (k + k.T) / 2
    far = ~torch.isfinite(torch.diagonal(k))
    k = torch.where(far[:, None] | far[None, :], torch.zeros_like(k), k)
    return torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0), far


def _sq_distances(x: torch.Tensor) -> torch.Tensor:
    """Symmetric (n, n) squared distances of the median-centered rows (zero diagonal, +inf
    where they overflow)."""
    d = pairwise_sq_distances(_centered(x))
    return (d + d.T) / 2


def lexargmin(primary: torch.Tensor, secondary: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Index (0-d tensor) of the smallest `primary` among the `valid` entries, equal primaries
    going to the smallest `secondary`, then to the first position. No host sync; vmappable."""
    inf = primary.new_tensor(INF)
    if valid is None:
        valid = torch.ones_like(primary, dtype=torch.bool)
    p = torch.where(valid, torch.nan_to_num(primary, nan=INF), inf)
    candidates = valid & (p == p.min())
    q = torch.where(candidates, torch.nan_to_num(secondary.to(p.dtype), nan=INF), inf)
    return (candidates & (q == q.min())).to(torch.uint8).argmax()


# Up to this many entries, a GPU's eigendecomposition is solved on the host: for the (n, n) Gram
# matrices of a federation one copy costs less than cuSOLVER's several host round trips, which
# wait the longest where other processes share the GPU (benchmarks/shared_gpu.py). 0: never.
HOST_EIGH_MAX_ENTRIES = 1 << 16


def _eigh(m: torch.Tensor, vectors: bool = True):
    """Eigenvalues (ascending) and, with `vectors`, eigenvectors of the symmetric matrices m
    (..., k, k), on m's device. LAPACK's solvers fail to converge on some matrices of tiny or
    huge entries with repeated eigenvalues (e.g. duplicated rows after NNM), so each matrix is
    symmetrized, divided by its largest |entry| and solved in float64; the eigenvalues are
    scaled back. Small matrices on a GPU are solved on the host (HOST_EIGH_MAX_ENTRIES)."""
    m = torch.nan_to_num(((m + m.mT) / 2).double(), nan=0.0, posinf=0.0, neginf=0.0)  # NaN: LAPACK raises
    scale = m.abs().amax(dim=(-2, -1), keepdim=True)
    m = m / torch.where(scale > 0, scale, torch.ones_like(scale))
    device = m.device
    if device.type != "cpu" and m.numel() <= HOST_EIGH_MAX_ENTRIES:
        m = m.cpu()
    if vectors:
        evals, evecs = torch.linalg.eigh(m)
        return evals.to(device) * scale[..., 0], evecs.to(device)
    return torch.linalg.eigvalsh(m).to(device) * scale[..., 0]


@functools.lru_cache(maxsize=4)  # up to C(n, f) x (n - f) indices each, kept on the device
def _subsets(n: int, k: int, device: torch.device) -> torch.Tensor:
    """All C(n, k) subsets of range(n) of size k, as rows of a (C(n, k), k) index tensor."""
    rows = list(itertools.combinations(range(n), k))
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), k).to(device)


def _blocks(m: torch.Tensor, subsets: torch.Tensor):
    """The (c, k, k) principal submatrices of m (n, n) for the subsets, chunk by chunk."""
    k = subsets.shape[1]
    step = max(1, CHUNK_ELEMENTS // max(1, k * k))
    for start in range(0, subsets.shape[0], step):
        idx = subsets[start : start + step]
        yield idx, m[idx[:, :, None], idx[:, None, :]]


class _SubsetSearch(Rule):
    """Shared by MDA and SMEA: every subset of n - f rows is scored, the best one averaged."""

    translation_equivariant = scale_equivariant = True

    def __init__(self, f: int, max_subsets: int = 1_000_000):
        self.f = check_f(f, self.name)
        self.max_subsets = iterations(self.name, "max_subsets", max_subsets, high=MAX_SUBSETS)

    def rows_out(self, n):
        _require(2 * self.f < n, self.name, f"needs 2f < n, got f={self.f}, n={n}")
        count = math.comb(n, self.f)
        _require(count <= self.max_subsets, self.name,
                 f"C(n, n - f) = C({n}, {n - self.f}) = {count} subsets of n - f rows to search, above "
                 f"max_subsets={self.max_subsets} (raise max_subsets, or use fewer messages or a smaller f)")
        return 1

    def scores(self, x: torch.Tensor, subsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(primary, secondary) scores of every subset, smallest best."""
        raise NotImplementedError

    def apply(self, x):
        n = x.shape[0]
        subsets = _subsets(n, n - self.f, x.device)
        primary, secondary = self.scores(x, subsets)
        best = subsets.index_select(0, lexargmin(primary, secondary).reshape(1))[0]
        rows = x.index_select(0, best)
        return _mean_of_rows(rows, torch.ones(rows.shape[0], dtype=torch.bool, device=x.device))


class MinimumDiameterAveraging(_SubsetSearch):
    """Minimum diameter averaging (El Mhamdi et al. 2018; ByzFL's MDA): among all subsets of
    n - f rows, the one of smallest diameter (largest pairwise Euclidean distance), averaged.

    Equal diameters (frequent: a diameter is one pair's distance, shared by every subset that
    holds that pair and nothing farther) go to the subset with the smallest sum of squared
    pairwise distances, then to the first in itertools.combinations order; ByzFL takes the
    first, which depends on the order of the messages. All C(n, f) subsets are scored with
    tensor ops on the (n, n) distance matrix, in chunks; a ValueError names their number when
    it exceeds `max_subsets` (1e6). Requires 2f < n."""

    name = "mda"

    def scores(self, x, subsets):
        d = _sq_distances(x)
        diameter, spread = [], []
        for _, block in _blocks(d, subsets):
            diameter.append(block.amax(dim=(1, 2)))
            spread.append(block.sum(dim=(1, 2)))
        return torch.cat(diameter), torch.cat(spread)


class SMEA(_SubsetSearch):
    """Smallest maximum eigenvalue averaging (Allouah et al. 2023, "On the Privacy-Robustness-
    Utility Trilemma"; ByzFL's SMEA): among all subsets S of n - f rows, the one whose empirical
    covariance (1/|S|) sum_{i in S} (x_i - mean_S)(x_i - mean_S)^T has the smallest largest
    eigenvalue, averaged.

    The eigenvalue is exact (batched eigvalsh; ByzFL takes one power-method step from a random
    vector): the covariance's nonzero eigenvalues are those of the centered (n-f) x (n-f) Gram
    matrix H K_SS H / (n - f), H = I - 11^T/(n-f), so d can be large. Equal eigenvalues go to
    the smaller trace, then to the first subset. A subset holding a row whose squared norm
    overflows scores +inf. Requires 2f < n; `max_subsets` as for `mda`.

    kappa(n, f) = 4f/(n-2f), derived here rather than copied from a table. Let lambda_A be the
    top eigenvalue of the covariance of a set A of n - f rows. A subset B of A with |A - B| =
    k <= f rows removed has ||mean_B - mean_A||^2 <= k/(n-f-k) lambda_A <= f/(n-2f) lambda_A
    (project on mean_B - mean_A: the k removed rows balance the rest around mean_A). Take H the
    honest rows, S the chosen subset (lambda_S <= lambda_H: H is a candidate) and B = S & H,
    at most f rows short of each: ||mean_S - mean_H|| <= 2 sqrt(f/(n-2f) lambda_H), and
    lambda_H <= trace = mean_{i in H} ||x_i - mean_H||^2. This is the spectral argument
    Allouah et al. (2023) use for SMEA; the kit checks the bound on every rule it holds."""

    name = "smea"

    def kappa(self, n, f):
        return 4 * f / (n - 2 * f)

    def scores(self, x, subsets):
        k, far = _gram(x)
        size = subsets.shape[1]
        top, trace = [], []
        for idx, block in _blocks(k, subsets):
            g = block - block.mean(1, keepdim=True) - block.mean(2, keepdim=True) + block.mean((1, 2), keepdim=True)
            overflow = far[idx].any(1)
            lam = (_eigh(g, vectors=False)[:, -1] / size).to(g.dtype)
            top.append(torch.where(overflow, lam.new_tensor(INF), lam))
            tr = torch.diagonal(g, dim1=1, dim2=2).sum(1) / size
            trace.append(torch.where(overflow, tr.new_tensor(INF), tr))
        return torch.cat(top), torch.cat(trace)


class CAF(Rule):
    """Covariance-bound agnostic filter (Allouah, Guerraoui and Stephan, ICML 2025; ByzFL's CAF).

    Weights c_i = 1. While sum c > n - 2f: p = c / sum c; mu = sum p_i x_i; Sigma = sum p_i
    (x_i - mu)(x_i - mu)^T; (lambda, v) its top eigenpair; if lambda is the smallest so far,
    remember mu; tau_i = ((x_i - mu).v)^2; c_i <- c_i (1 - tau_i / max tau). Returns the
    remembered mu: the weighted mean of smallest top eigenvalue met (as ByzFL does).

    Where this differs from ByzFL's code: (1) the top eigenpair is exact, from the n x n
    weighted Gram matrix (eigh; ByzFL: one power-method step from a random vector); (2) max tau
    is taken over the rows whose weight is still positive (ByzFL: over all rows, so that a
    zeroed far row can keep the maximum and stall the loop); then each round zeroes at least
    one positive weight, the loop ends within 2f rounds, and it runs as a fixed 2f rounds that
    freeze (torch.where) once sum c <= n - 2f: no host sync; (3) f = 0 gives the plain mean
    (ByzFL: no round runs and it returns None); (4) a row whose squared norm overflows counts
    as infinitely far: a round where it still has weight only zeroes it (the limit of the exact
    update) and its mean is never remembered; (5) a tau within 16 ulps of max tau counts as the
    max, since equal rows can come out of the matrix products some ulps apart. Requires 2f < n."""

    name = "caf"
    translation_equivariant = scale_equivariant = True

    def __init__(self, f: int):
        self.f = check_f(f, self.name)

    def rows_out(self, n):
        _require(2 * self.f < n, self.name, f"needs 2f < n, got f={self.f}, n={n}")
        return 1

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """The weights p (n,) of the returned mean, in the working dtype."""
        n, f = x.shape[0], self.f
        k, far = _gram(x)
        c = torch.ones(n, dtype=k.dtype, device=x.device)
        best_p, best_lam = c / n, k.new_tensor(INF)
        for _ in range(2 * f):
            total = c.sum()
            active = total > n - 2 * f
            p = c / torch.where(total > 0, total, 1.0)  # all weights can vanish at once (equal tau)
            kp = k @ p
            g = k - kp[:, None] - kp[None, :] + p @ kp  # (x_i - mu).(x_j - mu)
            r = p.sqrt()
            evals, evecs = _eigh(r[:, None] * g * r[None, :])  # the nonzero spectrum of Sigma
            lam, u = evals[-1].to(k.dtype), evecs[:, -1].to(k.dtype)
            # x_i - mu projected on v = D^T diag(r) u / ||.||, and ||D^T diag(r) u||^2 = lambda
            proj = (g @ (r * u)) / lam.clamp_min(torch.finfo(k.dtype).tiny).sqrt()
            tau = torch.where(lam > 0, proj * proj, torch.zeros_like(proj))
            tau_max = torch.where(c > 0, tau, torch.zeros_like(tau)).max()
            ratio = tau / torch.where(tau_max > 0, tau_max, 1.0)
            # equal rows can get taus some ulps apart (BLAS rounds rows differently); they tie
            ratio = torch.where(ratio >= 1 - 16 * torch.finfo(k.dtype).eps, torch.ones_like(ratio), ratio)
            shrunk = (c * (1 - ratio)).clamp_min(0.0)
            shrunk = torch.where(tau_max > 0, shrunk, c)
            overflow = (far & (c > 0)).any()
            shrunk = torch.where(overflow, torch.where(far, torch.zeros_like(c), c), shrunk)
            lam = torch.where(overflow, lam.new_tensor(INF), lam)
            better = active & (lam < best_lam)
            best_lam = torch.where(better, lam, best_lam)
            best_p = torch.where(better, p, best_p)
            c = torch.where(active, shrunk, c)
        return best_p

    def apply(self, x):
        return _average(x, self.weights(x))


class Bulyan(Rule):
    """Bulyan over Krum (El Mhamdi, Guerraoui and Rouault, ICML 2018), the paper's form:
    theta = n - 2f rows are selected by iterated Krum -- Krum on the rows not yet selected R
    (r of them), the winner moves to the selection -- then, per coordinate, the average of the
    beta = theta - 2f selected values closest to the coordinate-wise median of the selection
    (of two values equally far, the smaller counts first, as `meamed`).

    Krum on R with the same f: the score of a row is the sum of squared distances to its
    r - f - 2 nearest other rows of R (0 terms once r - f - 2 <= 0, for f = 1 at the last
    selection); equal scores -- structural when r - f - 2 <= 1, a mutual nearest pair sharing
    its distance -- go to the smaller sum of squared distances to the max(r - f - 2, 1) + 1
    nearest others of R, then to the first row. Selected rows are masked with +inf distances
    (no host sync). f = 0 gives the mean. Requires n >= 4f + 3."""

    name = "bulyan"
    translation_equivariant = scale_equivariant = True

    def __init__(self, f: int):
        self.f = check_f(f, self.name)

    def rows_out(self, n):
        _require(n >= 4 * self.f + 3, self.name, f"needs n >= 4f + 3, got f={self.f}, n={n}")
        return 1

    def selection(self, x: torch.Tensor) -> torch.Tensor:
        """Indices (theta,) of the rows iterated Krum selects, in selection order."""
        n, f = x.shape[0], self.f
        d = with_diagonal(_sq_distances(x), INF)  # a row is never its own neighbour
        selected = torch.zeros(n, dtype=torch.bool, device=x.device)
        order = torch.arange(n, device=x.device)
        picks = []
        for t in range(n - 2 * f):
            r = n - t
            k = max(r - f - 2, 0)
            k2 = min(max(r - f - 2, 1) + 1, r - 1)
            near = d.masked_fill(selected[None, :], INF).sort(dim=1).values
            pick = lexargmin(near[:, :k].sum(1), near[:, :k2].sum(1), ~selected)
            picks.append(pick)
            selected = selected | (order == pick)
        return torch.stack(picks)

    def apply(self, x):
        if self.f == 0:
            return _mean_of_rows(x, torch.ones(x.shape[0], dtype=torch.bool, device=x.device))
        chosen = x.index_select(0, self.selection(x))
        return Meamed(2 * self.f).apply(chosen)  # the theta - 2f values nearest the median


def _dnc_scores(x: torch.Tensor) -> torch.Tensor:
    """s_i = ((x_i - mu).v)^2, mu the mean and v the top right singular vector of the centered
    rows: with C the centered rows, C v = sigma u for u the top eigenvector of C C^T, so s_i =
    lambda u_i^2 (lambda = sigma^2). Rows whose squared norm overflows score +inf; the others
    are centered and scored among themselves."""
    k, far = _gram(x)
    p = (~far).to(k.dtype)
    p = p / p.sum().clamp_min(1.0)
    kp = k @ p
    g = k - kp[:, None] - kp[None, :] + p @ kp
    g = torch.where(far[:, None] | far[None, :], torch.zeros_like(g), g)
    evals, evecs = _eigh(g)
    scores = (evals[-1].clamp_min(0.0) * evecs[:, -1] ** 2).to(k.dtype)
    return torch.where(far, scores.new_tensor(INF), scores)


class DnC(Rule, Generated):
    """Divide-and-conquer (Shejwalkar and Houmansadr, NDSS 2021, Algorithm 2): `niters` times,
    sample `b` coordinates (all of them when d <= b), center the sampled rows at their mean,
    take the top right singular vector v, score s_i = ((x_i - mu).v)^2 and keep the
    n - ceil(c f) rows of smallest score; the good set is the intersection over the rounds
    (the first round's set if that intersection is empty, which the paper leaves open);
    returns the mean of the good set. Equal scores keep the first row. The coordinates are
    drawn from an explicit generator (`generator`, or one per device seeded with `seed`).
    Requires n - ceil(c f) >= 1."""

    name = "dnc"
    random = True
    translation_equivariant = scale_equivariant = True  # for a given draw of coordinates

    def __init__(self, f: int, niters: int = 1, b: int = 10000, c: float = 1.0, seed: int = 0,
                 generator: torch.Generator | None = None):
        self.f = check_f(f, self.name)
        self.niters = iterations(self.name, "niters", niters)
        self.b = integer(self.name, "b (coordinates sampled)", b, 1)
        self.c = real(self.name, "c (filtering fraction)", c, 0.0)
        self._init_generator(seed, generator)

    def draws(self, d):
        return d > self.b  # at most b coordinates: all of them, no draw

    def _keep(self, n):
        return n - math.ceil(self.c * self.f)

    def rows_out(self, n):
        _require(self._keep(n) >= 1, self.name,
                 f"needs n > c*f (it keeps the n - ceil(c*f) rows of smallest score), got c={self.c}, f={self.f}, n={n}")
        return 1

    def good(self, x: torch.Tensor) -> torch.Tensor:
        """The good set (n,) bool."""
        n, d = x.shape
        keep = self._keep(n)
        g = self.generator_for(x.device)
        good = first = None
        for _ in range(self.niters):
            sub = x
            if d > self.b:
                cols = torch.randperm(d, generator=g, device=g.device)[: self.b].to(x.device)
                sub = x.index_select(1, cols)
            kept = torch.zeros(n, dtype=torch.bool, device=x.device)
            kept = kept.scatter(0, smallest(_dnc_scores(sub), keep, dim=0), True)
            good, first = (kept, kept) if good is None else (good & kept, first)
        return torch.where(good.any(), good, first)

    def apply(self, x):
        return _mean_of_rows(x, self.good(x))


def _directions(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unit, scale, length) of the rows of x (working dtype): x_i = scale_i * length_i * unit_i,
    scale_i the largest |entry| of row i, so that no step overflows (the norm scale * length
    may: it is then +inf). A zero row has unit 0 and length 0."""
    scale = x.abs().amax(dim=1)
    u = x / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    length = torch.linalg.vector_norm(u, dim=1)
    unit = u / torch.where(length > 0, length, torch.ones_like(length))[:, None]
    return unit, scale, length


class FLTrust(Rule):
    """FLTrust (Cao, Fang, Liu and Gong, NDSS 2021): given the server's reference message g0
    (its gradient on a small clean dataset), trust scores TS_i = ReLU(cos(g_i, g0)), every row
    rescaled to ||g0||, and the output sum_i TS_i (||g0|| / ||g_i||) g_i / sum_i TS_i; the zero
    vector when every trust score is 0 (a zero row or a zero reference has cosine 0).

    Call it as `rule(messages, reference=g0)`; in a spec it is the aggregator and receives the
    pipeline's reference. Norms and cosines are computed on rows divided by their largest
    |entry|, so a 1e38 row is rescaled like any other. Every row has norm ||g0|| after
    rescaling, so the output has norm at most ||g0||. (When every score is 0 the paper's formula
    is 0/0: here the zero vector, no step; FLPoison falls back to uniform weights.)"""

    name = "fltrust"
    needs_reference = True
    scale_equivariant = True  # messages and reference scaled alike
    # identity on identical rows holds when the reference is that row too (then every TS_i = 1)

    def apply(self, x, reference):
        xw, ref = working_dtype(x), working_dtype(reference)
        unit, _, _ = _directions(xw)
        ref_unit, ref_scale, ref_length = _directions(ref[None, :])
        trust = torch.relu(unit @ ref_unit[0])
        total = trust.sum()
        w = torch.where(total > 0, trust / torch.where(total > 0, total, 1.0), torch.zeros_like(trust))
        return (ref_scale[0] * ((w @ unit) * ref_length[0])).to(x.dtype)
