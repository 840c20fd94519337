"""Aggregators that cluster the messages on the host (scipy.cluster.hierarchy): SignGuard and
clipped clustering. Their clustering copies an (n, n) or (n, 3) matrix to the host and runs
there, so they synchronize with the device once per call and torch.vmap cannot batch them
(`vmappable = False`: `Pipeline.stacked` calls them once per message set). Everything of
size d (norms, clipping, the final average) stays on the device. scipy is imported when a
rule first runs.

Clustering into two groups is agglomerative with average linkage, cut at its last merge (as
scikit-learn's AgglomerativeClustering(n_clusters=2) does), and the larger group is kept; a
last merge at distance 0 (every point alike) leaves one group. The points are clustered in a
canonical order, so that equal distances are merged alike whatever the order of the
messages. Groups of equal size: the one whose mean is nearer the coordinate-wise median of all
the points clustered, then the one whose mean is shorter, then the one whose mean comes
first in lexicographic order (all three independent of the order and the scale).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Generated, Rule, working_dtype
from .catalogue import _directions
from .checks import choice, real
from .rules import _median


def _two_groups(order: np.ndarray, points: np.ndarray | None = None, distances: np.ndarray | None = None) -> np.ndarray:
    """Labels 0/1 (n,) of the two groups of an average-linkage clustering of `points` (n, p)
    (Euclidean) or of a symmetric `distances` (n, n) matrix, cut at the last merge. The
    clustering runs on the points taken in `order`, a canonical order (a function of the
    points, not of their positions), so that its ties are broken alike whatever the order of
    the messages. One group when n = 1 or when the last merge is at distance 0 (all points
    alike: nothing to separate)."""
    from scipy.cluster.hierarchy import cut_tree, linkage
    from scipy.spatial.distance import squareform

    n = len(order)
    labels = np.zeros(n, dtype=np.int64)
    if n == 1:
        return labels
    if points is not None:
        z = linkage(points[order], method="average", metric="euclidean")
    else:
        z = linkage(squareform(distances[np.ix_(order, order)], checks=False), method="average")
    if not z[-1, 2] > 0:
        return labels
    labels[order] = cut_tree(z, n_clusters=2).reshape(-1)
    return labels


def _canonical_order(unit: torch.Tensor) -> np.ndarray:
    """An order of the unit rows that depends on their values only: by their projection on a
    fixed pseudo-random direction. Rows of equal projection are (but for a null set) parallel:
    at cosine distance 0, they share a group whatever their order."""
    g = torch.Generator(device=unit.device).manual_seed(0x5EED)
    direction = torch.randn(unit.shape[1], generator=g, device=unit.device, dtype=unit.dtype)
    return (unit @ direction).sort(stable=True).indices.cpu().numpy()


def _kept_group(labels: np.ndarray, points) -> np.ndarray:
    """Mask (n,) of the group to keep: the larger one. Of two equally large (e.g. two single
    messages), the one whose mean point is nearer the coordinate-wise median of the points
    clustered (`points()`: (n, p), on any device), then the one whose mean is shorter -- each
    compared to a relative 1e-6, below which rounding would decide -- then the one whose mean
    comes first lexicographically."""
    sizes = np.bincount(labels, minlength=2)
    if sizes[0] != sizes[1]:
        return labels == int(np.argmax(sizes))
    points = points()
    onehot = torch.tensor(np.stack([labels == 0, labels == 1]), dtype=points.dtype, device=points.device)
    means = (onehot / onehot.sum(1, keepdim=True)) @ points
    for key in (torch.linalg.vector_norm(means - _median(points), dim=1), torch.linalg.vector_norm(means, dim=1)):
        a, b = key.tolist()
        if abs(a - b) > 1e-6 * max(abs(a), abs(b)):
            return labels == (0 if a < b else 1)
    diff = means[0] - means[1]
    nonzero = diff != 0
    if not bool(nonzero.any()):
        return labels == 0  # two groups of the same mean: either gives the same output
    first = int(nonzero.to(torch.uint8).argmax())
    return labels == (0 if float(diff[first]) < 0 else 1)


def _clip_factors(scale: torch.Tensor, length: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """min(1, threshold / ||x_i||) for ||x_i|| = scale_i * length_i, without dividing by the norm
    (which may overflow): a 1e38 row clipped to the median norm keeps its direction."""
    one = torch.ones_like(scale)
    s, l = torch.where(scale > 0, scale, one), torch.where(length > 0, length, one)
    factor = torch.where(scale * length > threshold, (threshold / s) / l, one)
    return torch.nan_to_num(factor, nan=0.0, posinf=1.0)


def _median_norm(norm: torch.Tensor) -> torch.Tensor:
    """The median of the row norms (mean of the two middle ones for even n), +inf allowed."""
    return _median(norm[:, None])[0]


class SignGuard(Rule, Generated):
    """SignGuard (Xu, Huang, Song and Lan, ICDCS 2022; Blades' and FLPoison's SignGuard):

    1. norm filter: M = the median row norm; S1 = rows with `lower` <= ||g_i|| / M <= `upper`
       (0.1 and 3.0);
    2. sign clustering: on a random subset of ceil(`fraction` d) coordinates (10%; all of them
       with fraction = 1), each row's fractions of positive, zero and negative entries; these
       (n, 3) features are clustered into two groups (average linkage, Euclidean; the paper
       uses mean-shift, Blades 2-means, FLPoison DBSCAN) and S2 is the larger group;
    3. the mean over S = S1 & S2 of the rows clipped to norm M (S1 alone if S is empty, which
       the paper leaves open; S1 is never empty).

    The filter uses the raw norms, as the paper and FLPoison do (Blades clips first, so that its
    upper bound never bites); the coordinates are a random subset (FLPoison: a random
    contiguous block; Blades: all) and the features plain fractions (FLPoison divides each by
    its largest value). The coordinates are drawn from an explicit generator (`generator`, or
    one per device seeded with `seed`). Runs its clustering on the host (see the module)."""

    name = "signguard"
    random = True
    vmappable = False
    scale_equivariant = True  # for a given draw of coordinates

    def __init__(self, lower: float = 0.1, upper: float = 3.0, fraction: float = 0.1, seed: int = 0,
                 generator: torch.Generator | None = None):
        self.lower = real(self.name, "lower", lower, 0.0, high=1.0)
        self.upper = real(self.name, "upper", upper, 1.0, finite=False)  # inf: no upper filter
        self.fraction = real(self.name, "fraction (of coordinates)", fraction, 0.0, low_open=True, high=1.0)
        self._init_generator(seed, generator)

    def columns(self, d: int, device: torch.device) -> torch.Tensor | None:
        """The coordinates the sign statistics use (None: all), drawn from the generator."""
        b = min(d, max(1, math.ceil(self.fraction * d)))
        if b == d:
            return None
        g = self.generator_for(device)
        return torch.randperm(d, generator=g, device=g.device)[:b].to(device)

    @staticmethod
    def features(x: torch.Tensor) -> torch.Tensor:
        """(n, 3) float64: each row's fractions of positive, zero and negative entries."""
        return torch.stack([(x > 0).double().mean(1), (x == 0).double().mean(1), (x < 0).double().mean(1)], dim=1)

    def kept(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask (n,) bool of the rows averaged, clip factors (n,))."""
        xw = working_dtype(x)
        _, scale, length = _directions(xw)
        norm = scale * length
        m = _median_norm(norm)
        s1 = ((norm >= self.lower * m) & (norm <= self.upper * m)).cpu().numpy()
        cols = self.columns(x.shape[1], x.device)
        feats = self.features(x if cols is None else x.index_select(1, cols))
        points = feats.cpu().numpy()
        order = np.lexsort(points.T[::-1])  # rows of equal features share a group (merged at distance 0)
        s2 = _kept_group(_two_groups(order, points=points), lambda: feats)
        keep = s1 & s2 if (s1 & s2).any() else s1
        return torch.from_numpy(keep).to(x.device), _clip_factors(scale, length, m)

    def apply(self, x):
        keep, factor = self.kept(x)
        w = keep.to(factor.dtype) * factor / keep.sum()
        return (w @ working_dtype(x)).to(x.dtype)


def _merged(seen: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The ascending values of `seen` (ascending) and `new` together: one merge, no sort of
    the whole."""
    new = new.sort().values
    k, m = len(seen), len(new)
    out = torch.empty(k + m, dtype=seen.dtype, device=seen.device)
    # each value's place: its index among its own plus the other's values before it (new first on ties)
    out[torch.searchsorted(new, seen, right=True) + torch.arange(k, device=seen.device)] = seen
    out[torch.searchsorted(seen, new) + torch.arange(m, device=seen.device)] = new
    return out


class ClippedClustering(Rule):
    """Clipped clustering (Li, Ngai and Voigt 2023, "An Experimental Study of Byzantine-Robust
    Aggregation Schemes in Federated Learning"; Blades' ClippedClustering): rows are clipped to
    a threshold (below); the clipped rows are clustered into two groups by agglomerative
    clustering with average linkage on cosine distances 1 - cos(g_i, g_j) (a zero row has
    cosine 0 with every row); the output is the mean of the larger group's clipped rows (equal
    sizes: see the module). Runs its clustering on the host.

    threshold = "history" (default, the paper's): the median of every row norm this rule has
    aggregated, in all calls so far and this one (held in `seen`, ascending float64, so that
    checkpoints carry it). Only finite norms enter it (after sanitizing, only a float64 row
    near its limit has an infinite one): an infinite norm, once kept, would count against the
    honest norms in every later round. If none has been seen, this call's median norm. Blades
    caps the threshold at 1e5; here it is not capped: a fixed cap is in the messages' units (it
    would break scale equivariance, and never binds at a gradient's scale), and the median
    needs none while fewer than half the norms seen are Byzantine (it then lies between two
    honest ones). Memory grows by n values a call (10^4 rounds of 100 clients: 8 MB), which the
    paper's scale affords: a median over all the values seen needs them all. The calls of an
    attack searching against the pipeline are trials: inside `aggregators.trials` (`recording =
    False`) they use the history and leave it as it was. threshold = "round": this call's
    median row norm, stateless."""

    name = "cclust"
    vmappable = False
    scale_equivariant = True  # scaling every round's messages scales the norms seen too

    def __init__(self, threshold: str = "history"):
        self.threshold = choice(self.name, "threshold", threshold, ("history", "round"))
        self.stateful = self.recording = threshold == "history"
        self._seen = torch.zeros(0, dtype=torch.float64)

    @property
    def seen(self) -> torch.Tensor:
        """The finite row norms aggregated so far, ascending (float64)."""
        return self._seen

    def clip_threshold(self, scale: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """The norm the rows are clipped to, in the rows' dtype; "history": adds this call's
        finite norms to those seen, when recording."""
        if self.threshold == "round":
            return _median_norm(scale * length)
        norm = scale.double() * length.double()  # exact for float32 rows: no overflow at 1e38
        seen = _merged(self._seen.to(norm.device), norm[torch.isfinite(norm)])
        if self.recording:
            self._seen = seen
        if not len(seen):  # nothing finite yet
            return _median_norm(scale * length)
        k = len(seen)
        return ((seen[(k - 1) // 2] + seen[k // 2]) / 2).to(scale.dtype)

    def kept(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask (n,) bool of the group kept, clip factors (n,))."""
        xw = working_dtype(x)
        unit, scale, length = _directions(xw)
        factor = _clip_factors(scale, length, self.clip_threshold(scale, length))
        cos = (unit @ unit.T).clamp(-1.0, 1.0)
        distances = (1.0 - cos).double().cpu().numpy()
        distances = (distances + distances.T) / 2
        np.fill_diagonal(distances, 0.0)
        labels = _two_groups(_canonical_order(unit), distances=distances)
        keep = _kept_group(labels, lambda: xw * factor[:, None])  # groups of equal size: their clipped rows
        return torch.from_numpy(keep).to(x.device), factor

    def apply(self, x):
        keep, factor = self.kept(x)
        w = keep.to(factor.dtype) * factor / keep.sum()
        return (w @ working_dtype(x)).to(x.dtype)
