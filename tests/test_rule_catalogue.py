"""The catalogue's rules (aggregators/catalogue.py, aggregators/clustering.py): each against a
plain numpy reference written from its paper (loops, itertools, numpy.linalg, a naive
average-linkage clustering), behaviour that can fail (far rows excluded, FLTrust's weights,
CAF's weights, the errors), the reference message through pipelines, `stacked` for the rules
that run on the host, and the property kit on a rule that needs a reference."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aggregators as A
from aggregators.testing import check

seeds = st.integers(0, 2**31 - 1)
SLOW = settings(max_examples=60, deadline=None)  # subset searches: explicit counts, whatever the profile
MEDIUM = settings(max_examples=100, deadline=None)


def randn(seed, n, d, dtype=torch.float64):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def with_far_rows(x, f, seed, distance=1e3):
    """x with its first f rows moved far away, each in its own random direction."""
    x = x.clone()
    if f:
        directions = randn(seed + 1, f, x.shape[1])
        x[:f] = distance * directions / directions.norm(dim=1, keepdim=True)
    return x


@st.composite
def sets(draw, min_f=0, max_f=3, extra=(1, 5), d=(1, 8), far=True):
    """(x float64 numpy (n, d), f): f < n/2, the first f rows far away or not."""
    f = draw(st.integers(min_f, max_f))
    n = draw(st.integers(2 * f + extra[0], 2 * f + extra[1]))
    x = randn(draw(seeds), n, draw(st.integers(*d)))
    if far and draw(st.booleans()):
        x = with_far_rows(x, f, draw(seeds), draw(st.sampled_from([10.0, 1e3, 1e6])))
    return x, f


def close(got, want, tol=1e-9):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


# ---- numpy references, from the papers -----------------------------------------------------

def sq(a, b):
    return float(np.sum((a - b) ** 2))


def ref_mda(x, f):
    """El Mhamdi et al. 2018: the subset of n - f rows of smallest diameter; equal diameters:
    the smaller sum of squared pairwise distances, then the first subset."""
    n = len(x)
    best = None
    for subset in itertools.combinations(range(n), n - f):
        pairs = [sq(x[i], x[j]) for i, j in itertools.combinations(subset, 2)]
        key = (max(pairs, default=0.0), sum(pairs))
        if best is None or key < best[0]:
            best = (key, subset)
    return x[list(best[1])].mean(0)


def ref_smea(x, f):
    """Allouah et al. 2023: the subset of n - f rows whose covariance has the smallest top
    eigenvalue (then the smaller trace), averaged."""
    n = len(x)
    best = None
    for subset in itertools.combinations(range(n), n - f):
        rows = x[list(subset)]
        centered = rows - rows.mean(0)
        cov = centered.T @ centered / len(rows)
        key = (np.linalg.eigvalsh(cov)[-1], np.trace(cov))
        if best is None or key < best[0]:
            best = (key, subset)
    return x[list(best[1])].mean(0)


def ref_caf(x, f):
    """ByzFL's CAF loop with an exact top eigenpair of the d x d weighted covariance and max tau
    over the rows still weighted (a tau within 16 ulps of it counting as it); returns the weighted mean of smallest top eigenvalue."""
    n = len(x)
    c = np.ones(n)
    best_lam, best_mu = np.inf, x.mean(0)
    while c.sum() > n - 2 * f:
        mu = (c[:, None] * x).sum(0) / c.sum()
        diffs = x - mu
        cov = (c[:, None] * diffs).T @ diffs / c.sum()
        evals, evecs = np.linalg.eigh(cov)
        lam, v = evals[-1], evecs[:, -1]
        if lam < best_lam:
            best_lam, best_mu = lam, mu
        tau = (diffs @ v) ** 2
        tau_max = tau[c > 0].max()
        if tau_max == 0:
            break
        ratio = tau / tau_max
        ratio[ratio >= 1 - 16 * np.finfo(x.dtype).eps] = 1.0  # near-max taus tie, as CAF's (5)
        c = np.maximum(c * (1 - ratio), 0.0)
    return best_mu


def ref_bulyan(x, f):
    """El Mhamdi et al. 2018: theta = n - 2f rows by iterated Krum (r remaining rows: score =
    sum of squared distances to the r - f - 2 nearest others; ties: the max(r - f - 2, 1) + 1
    nearest, then the first row), then per coordinate the mean of the theta - 2f selected
    values nearest the median (of two equally near, the smaller)."""
    n = len(x)
    remaining, selected = list(range(n)), []
    for _ in range(n - 2 * f):
        r = len(remaining)
        k, k2 = max(r - f - 2, 0), min(max(r - f - 2, 1) + 1, r - 1)
        keys = []
        for i in remaining:
            dists = sorted(sq(x[i], x[j]) for j in remaining if j != i)
            keys.append((sum(dists[:k]), sum(dists[:k2]), i))
        winner = min(keys)[2]
        selected.append(winner)
        remaining.remove(winner)
    chosen = x[selected]
    beta = len(selected) - 2 * f
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        column = chosen[:, j]
        median = np.median(column)
        nearest = sorted(column, key=lambda v: (abs(v - median), v))[:beta]
        out[j] = np.mean(nearest)
    return out


def ref_dnc(x, f, columns, c=1.0):
    """Shejwalkar & Houmansadr 2021, Algorithm 2, with the sampled coordinates given: per round,
    center, top right singular vector, scores, keep the n - ceil(c f) smallest; intersect."""
    n = len(x)
    keep = n - math.ceil(c * f)
    good, first = set(range(n)), None
    for cols in columns:
        sub = x[:, cols]
        centered = sub - sub.mean(0)
        v = np.linalg.svd(centered, full_matrices=False)[2][0]
        scores = (centered @ v) ** 2
        kept = set(np.argsort(scores, kind="stable")[:keep].tolist())
        first = kept if first is None else first
        good &= kept
    return x[sorted(good or first)].mean(0)


def ref_fltrust(x, g0):
    """Cao et al. 2021: sum_i ReLU(cos(g_i, g0)) ||g0|| / ||g_i|| g_i / sum_i ReLU(cos)."""
    norm0 = np.linalg.norm(g0)
    total, out = 0.0, np.zeros_like(g0)
    for g in x:
        norm = np.linalg.norm(g)
        trust = max(0.0, g @ g0 / (norm * norm0)) if norm > 0 and norm0 > 0 else 0.0
        total += trust
        if trust > 0:
            out += trust * norm0 / norm * g
    return out / total if total > 0 else out


def average_linkage_two_groups(dist):
    """Naive agglomerative clustering, average linkage, until two groups remain (list of index
    lists); None when the last merge is at distance 0 (one group)."""
    groups = [[i] for i in range(len(dist))]
    if len(groups) == 1:
        return None
    last = None
    while len(groups) > 2:
        best = None
        for a, b in itertools.combinations(range(len(groups)), 2):
            avg = np.mean([dist[i, j] for i in groups[a] for j in groups[b]])
            if best is None or avg < best[0]:
                best = (avg, a, b)
        _, a, b = best
        groups[a] = groups[a] + groups[b]
        del groups[b]
    last = np.mean([dist[i, j] for i in groups[0] for j in groups[1]])
    return None if last <= 0 else groups


def pick_group(groups, points):
    """The larger group; equal sizes: mean nearer the coordinate-wise median, then shorter mean,
    then lexicographically first mean (ties within a relative 1e-6)."""
    if groups is None:
        return list(range(len(points)))
    a, b = groups
    if len(a) != len(b):
        return a if len(a) > len(b) else b
    ma, mb = points[a].mean(0), points[b].mean(0)
    median = np.median(points, axis=0)
    for ka, kb in ((np.linalg.norm(ma - median), np.linalg.norm(mb - median)), (np.linalg.norm(ma), np.linalg.norm(mb))):
        if abs(ka - kb) > 1e-6 * max(ka, kb):
            return a if ka < kb else b
    return a if tuple(ma) < tuple(mb) else b


def clip_to(x, threshold):
    norms = np.linalg.norm(x, axis=1)
    factor = np.where(norms > threshold, threshold / np.where(norms > 0, norms, 1.0), 1.0)
    return x * factor[:, None]


def ref_cclust(x, threshold=None):
    """Li et al. 2023 (Blades' ClippedClustering): clip to `threshold` (None: this round's median
    norm), average-linkage clustering on cosine distances into two, mean of the larger group."""
    clipped = clip_to(x, np.median(np.linalg.norm(x, axis=1)) if threshold is None else threshold)
    n = len(x)
    dist = np.zeros((n, n))
    for i, j in itertools.combinations(range(n), 2):
        ni, nj = np.linalg.norm(x[i]), np.linalg.norm(x[j])
        cos = x[i] @ x[j] / (ni * nj) if ni > 0 and nj > 0 else 0.0
        dist[i, j] = dist[j, i] = 1 - np.clip(cos, -1, 1)
    return clipped[pick_group(average_linkage_two_groups(dist), clipped)].mean(0)


def ref_cclust_rounds(rounds):
    """Li et al.'s threshold: round t clips at the median of every norm of rounds 1 to t."""
    seen, out = [], []
    for x in rounds:
        seen.extend(np.linalg.norm(x, axis=1))
        out.append(ref_cclust(x, np.median(seen)))
    return out


def ref_signguard(x, columns, lower=0.1, upper=3.0):
    """Xu et al. 2022: median-norm filter, larger cluster of (positive, zero, negative)
    fractions on the given coordinates, mean of the intersection clipped to the median norm."""
    norms = np.linalg.norm(x, axis=1)
    m = np.median(norms)
    s1 = {i for i in range(len(x)) if lower * m <= norms[i] <= upper * m}
    sub = x[:, columns]
    feats = np.stack([(sub > 0).mean(1), (sub == 0).mean(1), (sub < 0).mean(1)], axis=1)
    dist = np.linalg.norm(feats[:, None, :] - feats[None, :, :], axis=2)
    s2 = set(pick_group(average_linkage_two_groups(dist), feats))
    keep = sorted(s1 & s2) or sorted(s1)
    return clip_to(x, m)[keep].mean(0)


# ---- against the references ------------------------------------------------------------------

@SLOW
@given(case=sets())
def test_mda_matches_reference(case):
    x, f = case
    close(A.build("mda", f=f)(x), ref_mda(x.numpy(), f))


@SLOW
@given(case=sets())
def test_smea_matches_reference(case):
    x, f = case
    close(A.build("smea", f=f)(x), ref_smea(x.numpy(), f), tol=1e-7)


@MEDIUM
@given(case=sets(d=(1, 12)))
def test_caf_matches_reference(case):
    x, f = case
    # a weight 1 - tau_i / max tau of two nearly coincident far rows is a difference of nearly
    # equal squared projections: both computations lose digits there (seen: 1.7e-6 relative)
    close(A.build("caf", f=f)(x), ref_caf(x.numpy(), f), tol=1e-5)


@MEDIUM
@given(f=st.integers(0, 2), extra=st.integers(0, 3), d=st.integers(1, 8), seed=seeds, far=st.booleans())
def test_bulyan_matches_reference(f, extra, d, seed, far):
    x = randn(seed, 4 * f + 3 + extra, d)
    if far:
        x = with_far_rows(x, f, seed)
    close(A.build("bulyan", f=f)(x), ref_bulyan(x.numpy(), f))


@MEDIUM
@given(case=sets(d=(2, 40)), niters=st.integers(1, 3), b=st.integers(1, 50), c=st.sampled_from([0.5, 1.0, 1.5]),
       seed=seeds)
def test_dnc_matches_reference_with_the_same_coordinates(case, niters, b, c, seed):
    x, f = case  # n >= 2f + 1, so n - ceil(c f) >= 1 for c <= 1.5
    d = x.shape[1]
    g = torch.Generator().manual_seed(seed)
    columns = [torch.randperm(d, generator=g)[:b].numpy() if d > b else np.arange(d) for _ in range(niters)]
    got = A.build("dnc", f=f, niters=niters, b=b, c=c, seed=seed)(x)
    close(got, ref_dnc(x.numpy(), f, columns, c), tol=1e-8)


@given(case=sets(max_f=4), seed=seeds, scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_fltrust_matches_reference(case, seed, scale):
    x, _ = case
    g0 = scale * randn(seed, 1, x.shape[1])[0]
    close(A.build("fltrust")(x, reference=g0), ref_fltrust(x.numpy(), g0.numpy()))


@MEDIUM
@given(case=sets(max_f=3, d=(2, 8)))
def test_cclust_matches_reference(case):
    x, _ = case
    close(A.build("cclust")(x), ref_cclust(x.numpy()))  # a first round: the history is this round's norms


@st.composite
def rounds_of_sets(draw):
    """2 to 4 rounds of message sets of one width, each at its own scale (so that the norms of
    the earlier rounds move the threshold)."""
    d = draw(st.integers(2, 6))
    out = []
    for _ in range(draw(st.integers(2, 4))):
        x, _ = draw(sets(max_f=2, d=(d, d)))
        out.append(x * draw(st.sampled_from([0.1, 1.0, 10.0])))
    return out


@settings(max_examples=40, deadline=None)
@given(rounds=rounds_of_sets())
def test_cclust_history_and_round_thresholds_match_their_references_over_rounds(rounds):
    history, per_round = A.build("cclust"), A.build("cclust", threshold="round")
    for x, want in zip(rounds, ref_cclust_rounds([x.numpy() for x in rounds])):
        close(history(x), want)
        close(per_round(x), ref_cclust(x.numpy()))  # the option: this round's median, as before
    close(history.agg.seen, sorted(torch.cat(rounds).norm(dim=1).tolist()))
    assert len(per_round.agg.seen) == 0 and not per_round.agg.stateful


def test_cclust_clips_at_the_median_of_the_norms_seen_by_hand():
    x = torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64)
    history, per_round = A.build("cclust"), A.build("cclust", threshold="round")
    close(history(x), [1.0, 0.0])
    close(per_round(x), [1.0, 0.0])
    # norms seen: three 1s and three 10s, median 5.5; this round's alone: 10
    close(history(10 * x), [5.5, 0.0])
    close(per_round(10 * x), [10.0, 0.0])


def test_cclust_trial_calls_see_the_history_and_leave_it():
    rounds = [randn(s, 7, 3) * c for s, c in ((0, 1.0), (1, 10.0), (2, 0.1))]
    p, twin = A.build("nnm+cclust", f=2), A.build("nnm+cclust", f=2)
    for x in rounds[:2]:
        p(x), twin(x)
    seen = p.agg.seen.clone()
    with A.trials(p):
        with A.trials(p, p.agg):  # nested: the outer one's setting comes back
            trial = p(rounds[2])
        assert not p.agg.recording
        p(rounds[2] * 1e3)
    assert p.agg.recording and torch.equal(p.agg.seen, seen)
    close(trial, twin(rounds[2]), tol=0)  # what the server's call gives, which records
    close(p(rounds[2]), trial, tol=0)
    assert torch.equal(p.agg.seen, twin.agg.seen) and len(seen) == 14 and len(twin.agg.seen) == 21
    assert not A.is_stateful(A.build("cclust", threshold="round")) and A.is_stateful(p) and not A.is_stateful(len)


def test_cclust_history_takes_finite_norms_only():
    x = randn(3, 7, 4)
    x[0] = 1e308  # finite entries, an infinite norm even in float64
    x[1] = float("nan")  # sanitized to a zero row: norm 0
    rule = A.build("cclust")
    assert torch.isfinite(rule(x)).all()
    assert len(rule.agg.seen) == 6 and torch.isfinite(rule.agg.seen).all() and rule.agg.seen[0] == 0
    x32 = randn(4, 7, 4, dtype=torch.float32)
    x32[0] = 1e38  # a float32 row whose norm overflows float32, not the float64 history
    out = rule(x32)
    assert torch.isfinite(out).all() and out.abs().max() < 1e3
    assert len(rule.agg.seen) == 13 and rule.agg.seen[-1] == pytest.approx(2e38)
    only_infinite = A.build("cclust")
    close(only_infinite(torch.full((3, 4), 1e308, dtype=torch.float64)), [1e308] * 4)  # nothing to clip at
    assert len(only_infinite.agg.seen) == 0


@pytest.mark.parametrize("value", ["past", "", 1, None, ["round"]])
def test_cclust_threshold_is_checked_in_one_line(value):
    message = f"cclust: threshold must be one of 'history', 'round', got {value!r}"
    with pytest.raises(ValueError) as e:
        A.build("nnm+cclust", f=1, threshold=value)
    assert str(e.value) == message
    from robustbn.scenario import Scenario, ScenarioError
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict(dict(dataset="synthetic-images", n=5, f=1, grad_agg="cclust",
                                grad_agg_params={"threshold": value}))
    assert str(e.value) == f"grad_agg_params: {message}"


def test_the_kit_holds_cclust_to_its_declarations_either_way():
    history = {o.name: o.status for o in check("cclust", examples=20)}
    per_round = {o.name: o.status for o in check("cclust", examples=20, threshold="round")}
    assert "failed" not in history.values() and "failed" not in per_round.values()
    # the kit builds a fresh rule for each call it compares: a history of the same scale
    assert per_round["positive-scale equivariance"] == history["positive-scale equivariance"] == "held"


# ---- cclust's history in runs: trials, channels, checkpoints ------------------------------------

RUN = dict(dataset="synthetic-images", model="simple-cnn", norm="fbn", partition="iid", n=5, f=1, rounds=4,
           batch_size=8, eval_every=2, lr=0.05, seed=3)


def test_a_run_records_the_servers_calls_only_each_channel_in_its_own_history():
    from robustbn.data import load_dataset
    from robustbn.engine import Federation
    from robustbn.runner import federation_parts
    from robustbn.scenario import Scenario
    # attacks that call the pipelines: a line search on grad, bn-kl's candidates through both BN pipelines
    sc = Scenario.from_dict({**RUN, "grad_attack": "opt-alie", "grad_attack_params": {"steps": 3},
                             "grad_agg": "cclust", "bn_mean_attack": "bn-kl",
                             "bn_mean_attack_params": {"z_steps": 3, "scale_steps": 2}, "bn_var_attack": "sf",
                             "bn_agg": "cclust"})
    data = load_dataset("synthetic-images")
    fed = Federation(sc, data, federation_parts(sc, data.y_train.numpy()), vectorized=False)
    for _ in range(2):
        fed.step()
    seen = [len(c.pipeline.agg.seen) for c in (fed.grad_channel, fed.mean_channel, fed.var_channel)]
    # n messages a round; FBN's spreads go through the bn_mean pipeline as a trial: its history is the means'
    assert seen == [2 * 5, 2 * 5, 2 * 5]


def test_a_resumed_cclust_run_carries_the_history(tmp_path):
    import signal

    from robustbn.checkpoint import Checkpointer, Interrupted, clear_stop, request_stop
    from robustbn.runner import run
    from robustbn.scenario import Scenario
    sc = Scenario.from_dict({**RUN, "grad_attack": "sf", "grad_agg": "cclust"})
    whole = run(sc)
    path = tmp_path / "2.pt"
    try:
        with pytest.raises(Interrupted):
            run(sc, progress=lambda t: t == 2 and request_stop(signal.SIGTERM), checkpoint=Checkpointer(path, "h"))
    finally:
        clear_stop()
    components = torch.load(path, weights_only=True)["federation"]["components"]
    assert len(components["/channels/0/pipeline/agg/_seen"]["tensor"]) == 2 * 5
    assert run(sc, checkpoint=Checkpointer(path, "h", every=0)).history == whole.history


def test_cclust_history_survives_the_checkpoint_walk():
    from robustbn.checkpoint import component_state, load_component_state
    rounds = [randn(s, 9, 4) * c for s, c in ((0, 1.0), (1, 30.0), (2, 30.0), (3, 1.0))]
    p = A.build("cclust")
    for x in rounds[:3]:
        p(x)
    state = component_state({"pipeline": p})
    fresh, blank = A.build("cclust"), A.build("cclust")
    load_component_state({"pipeline": fresh}, state)
    assert torch.equal(fresh.agg.seen, p.agg.seen) and len(fresh.agg.seen) == 27
    close(fresh(rounds[3]), p(rounds[3]), tol=0)
    assert not torch.allclose(blank(rounds[3]), p(rounds[3]))  # the history is what decides


@st.composite
def sign_groups(draw):
    """Two well-separated groups of sign statistics: n - f rows mostly positive, f mostly
    negative, some entries 0, norms from 0.01x to 30x: the norm filter and the clustering both
    bite, and the top split of the clustering is the two groups."""
    f = draw(st.integers(1, 4))
    n = draw(st.integers(2 * f + 1, 2 * f + 6))
    d = draw(st.integers(30, 80))
    rng = np.random.default_rng(draw(seeds))
    signs = np.where(rng.random((n, d)) < 0.9, 1.0, -1.0)
    signs[:f] *= -1
    x = signs * rng.random((n, d)) * (rng.random((n, d)) > 0.05)
    x *= rng.choice([0.01, 1.0, 1.0, 1.0, 2.0, 30.0], size=(n, 1))
    return torch.from_numpy(x), f


@MEDIUM
@given(case=sign_groups(), fraction=st.sampled_from([0.5, 1.0]), seed=seeds)
def test_signguard_matches_reference_with_the_same_coordinates(case, fraction, seed):
    x, _ = case
    d = x.shape[1]
    b = math.ceil(fraction * d)
    columns = torch.randperm(d, generator=torch.Generator().manual_seed(seed))[:b].numpy() if b < d else np.arange(d)
    got = A.build("signguard", fraction=fraction, seed=seed)(x)
    close(got, ref_signguard(x.numpy(), columns))


# ---- behaviour ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["mda", "smea"])
@given(f=st.integers(1, 3), extra=st.integers(1, 4), d=st.integers(2, 10), seed=seeds)
@MEDIUM
def test_subset_searches_drop_far_rows_and_return_the_honest_mean(spec, f, extra, d, seed):
    x = with_far_rows(randn(seed, 2 * f + extra, d), f, seed)
    close(A.build(spec, f=f)(x), x[f:].mean(0), tol=1e-9)


@given(f=st.integers(1, 3), extra=st.integers(1, 4), d=st.integers(2, 10), seed=seeds, c=st.sampled_from([1.0, 1.5]))
@MEDIUM
def test_dnc_drops_a_coordinated_far_group(f, extra, d, seed, c):
    n = 2 * f + extra
    x = randn(seed, n, d)
    direction = randn(seed + 1, 1, d)[0]
    x[:f] = x[:f] + 100.0 * direction / direction.norm()  # the attack DnC targets: one shared direction
    good = A.DnC(f, c=c).good(x)
    assert not good[:f].any() and good.sum() == n - math.ceil(c * f)
    if c == 1.0:
        close(A.build("dnc", f=f)(x), x[f:].mean(0), tol=1e-9)


@given(f=st.integers(1, 3), extra=st.integers(1, 4), d=st.integers(2, 10), seed=seeds)
@MEDIUM
def test_caf_gives_far_rows_weight_zero(f, extra, d, seed):
    x = with_far_rows(randn(seed, 2 * f + extra, d), f, seed)
    weights = A.CAF(f).weights(x)
    assert torch.all(weights[:f] == 0) and torch.all(weights >= 0)
    close(weights.sum(), 1.0, tol=1e-12)
    out, honest = A.build("caf", f=f)(x), x[f:]
    assert torch.all(out >= honest.min(0).values - 1e-12) and torch.all(out <= honest.max(0).values + 1e-12)


@given(f=st.integers(1, 3), extra=st.integers(0, 4), d=st.integers(2, 10), seed=seeds)
@MEDIUM
def test_bulyan_selects_no_far_row_and_stays_in_the_honest_range(f, extra, d, seed):
    n = 4 * f + 3 + extra
    x = with_far_rows(randn(seed, n, d), f, seed)
    selection = A.Bulyan(f).selection(x)
    assert len(selection) == n - 2 * f and len(set(selection.tolist())) == n - 2 * f
    assert min(selection.tolist()) >= f
    out = A.build("bulyan", f=f)(x)
    honest = x[f:]
    assert torch.all(out >= honest.min(0).values) and torch.all(out <= honest.max(0).values)


@given(f=st.integers(1, 4), extra=st.integers(1, 5), d=st.integers(2, 10), seed=seeds)
@MEDIUM
def test_cclust_drops_rows_pointing_away(f, extra, d, seed):
    n = 2 * f + extra
    x = randn(seed, n, d) + 5.0  # honest rows share a direction
    x[:f] = -20.0 * (1.0 + torch.rand(f, d, generator=torch.Generator().manual_seed(seed), dtype=x.dtype))
    median = x.norm(dim=1).median() if n % 2 else x.norm(dim=1).sort().values[n // 2 - 1: n // 2 + 1].mean()
    clipped = x[f:] * torch.clamp(median / x[f:].norm(dim=1), max=1.0)[:, None]
    close(A.build("cclust")(x), clipped.mean(0))


@given(f=st.integers(1, 4), extra=st.integers(1, 5), d=st.integers(20, 60), seed=seeds)
@MEDIUM
def test_signguard_drops_large_norms_and_flipped_signs(f, extra, d, seed):
    n = 2 * f + extra
    x = randn(seed, n, d).abs() + 0.1  # honest: positive entries
    x[0] = -x[0]  # flipped signs, honest norm: only the sign clustering drops it
    x[1:f] *= 100.0  # 100x the norm: the norm filter drops them (signs alike)
    m = x.norm(dim=1).median() if n % 2 else x.norm(dim=1).sort().values[n // 2 - 1: n // 2 + 1].mean()
    clipped = x[f:] * torch.clamp(m / x[f:].norm(dim=1), max=1.0)[:, None]
    close(A.build("signguard", fraction=1.0)(x), clipped.mean(0))


@given(case=sets(max_f=4), seed=seeds)
def test_fltrust_trusts_no_row_opposite_the_reference_and_keeps_its_norm(case, seed):
    x, _ = case
    g0 = randn(seed, 1, x.shape[1])[0]
    agg = A.build("fltrust")
    out = agg(x, reference=g0)
    assert out.norm() <= g0.norm() * (1 + 1e-12)
    opposite = torch.where((x @ g0 < 0)[:, None], x, -x)  # every row at an obtuse angle with g0
    assert torch.equal(agg(opposite, reference=g0), torch.zeros_like(g0))
    x2 = x.clone()
    x2[0] = -1e6 * g0  # one row opposite the reference: weight 0, whatever its norm
    close(agg(x2, reference=g0), ref_fltrust(np.delete(x2.numpy(), 0, axis=0), g0.numpy()))
    same = agg(g0.repeat(3, 1), reference=g0)  # every client agreeing with the server
    close(same, g0)


def test_caf_weights_follow_the_filter_by_hand():
    # 1-D: weights (1,1,1,1,1) -> mean 2.4, tau = (x - 2.4)^2, max at 8: the row 8 is zeroed,
    # the others keep 1 - tau_i / tau_max; f = 1 stops as soon as sum c <= 3.
    x = torch.tensor([[0.0], [1.0], [2.0], [1.0], [8.0]], dtype=torch.float64)
    c = torch.ones(5, dtype=torch.float64)
    mu = 12.0 / 5
    tau = (x[:, 0] - mu) ** 2
    c1 = c * (1 - tau / tau.max())
    assert c1[4] == 0 and c1.sum() > 3  # a second round runs
    p1 = c1 / c1.sum()
    mu1 = float(p1 @ x[:, 0])
    tau1 = (x[:, 0] - mu1) ** 2
    c2 = c1 * (1 - tau1 / tau1[c1 > 0].max())  # the max over rows still weighted: row 0, not row 4
    assert c2[0] == 0 and c2.sum() <= 3  # and no third round
    lam0, lam1 = float(((x[:, 0] - mu) ** 2).mean()), float(p1 @ (x[:, 0] - mu1) ** 2)
    assert lam1 < lam0  # the second round's mean is returned
    close(A.CAF(1).weights(x), p1)
    close(A.CAF(1)(x), [mu1])


def test_caf_equal_rows_tie_whatever_their_order():
    # found by the kit in CI: float32 matrix products gave the two equal rows taus one ulp
    # apart, so one kept a weight of 4e-8, a fourth round ran, and reversing rows moved the output
    x = torch.tensor([[-1.3669], [-1.3669], [0.0577], [0.53], [-0.4668]])
    weights = A.CAF(2).weights(x)
    # the same rounds whatever the order: equal weights to float32's precision (a CPU with
    # AVX-512 sums the products in another order than one with AVX2: 2e-7 apart here)
    close(A.CAF(2).weights(x.flip(0)), weights.flip(0), tol=1e-6)
    assert weights[:2].tolist() == [0.0, 0.0] and A.CAF(2).weights(x.flip(0))[-2:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("spec, f, n, message", [
    ("bulyan", 2, 10, r"bulyan: needs n >= 4f \+ 3, got f=2, n=10"),
    ("bulyan", 1, 6, r"bulyan: needs n >= 4f \+ 3, got f=1, n=6"),
    ("mda", 3, 6, r"mda: needs 2f < n, got f=3, n=6"),
    ("smea", 2, 4, r"smea: needs 2f < n, got f=2, n=4"),
    ("caf", 2, 4, r"caf: needs 2f < n, got f=2, n=4"),
    ("dnc", 4, 4, r"dnc: needs n > c\*f"),
])
def test_row_count_conditions_are_clear_errors(spec, f, n, message):
    with pytest.raises(ValueError, match=message):
        A.build(spec, f=f, n=n)
    with pytest.raises(ValueError, match=message):
        A.build(spec, f=f)(torch.zeros(n, 3))


def test_subset_searches_refuse_more_subsets_than_the_cap():
    with pytest.raises(ValueError, match=r"mda: C\(n, n - f\) = C\(30, 20\) = 30045015 subsets .* max_subsets=1000000"):
        A.build("mda", f=10, n=30)
    with pytest.raises(ValueError, match=r"smea: C\(n, n - f\) = C\(12, 9\) = 220 subsets .* max_subsets=100"):
        A.build("smea", f=3, max_subsets=100)(torch.zeros(12, 2))
    A.build("mda", f=3, max_subsets=220, n=12)  # exactly at the cap


def test_parameters_are_checked():
    for spec, params, message in [("dnc", {"niters": 0}, "niters"), ("dnc", {"b": 0}, "b"), ("dnc", {"c": -1.0}, "c"),
                                  ("signguard", {"fraction": 0.0}, "fraction"), ("signguard", {"lower": 2.0}, "lower"),
                                  ("mda", {"max_subsets": 0}, "max_subsets")]:
        with pytest.raises(ValueError, match=f"{spec}: .*{message}"):
            A.build(spec, f=1, **params)


# ---- the reference message through pipelines ---------------------------------------------

def test_a_rule_that_needs_a_reference_says_so():
    x, g0 = randn(0, 7, 4), randn(1, 1, 4)[0]
    for agg in (A.build("fltrust"), A.build("nnm+fltrust", f=1), A.FLTrust()):
        with pytest.raises(ValueError, match="fltrust: needs the server's reference message"):
            agg(x)
        with pytest.raises(ValueError, match=r"the reference must have shape \(4,\)"):
            agg(x, reference=g0[:3])
    assert A.build("nnm+fltrust", f=1).needs_reference and not A.build("nnm+median", f=1).needs_reference
    close(A.build("median")(x, reference=g0), A.build("median")(x))  # a rule without one ignores it


def test_the_reference_is_sanitized_and_pre_aggregators_never_see_it():
    x, g0 = randn(0, 7, 4), randn(1, 1, 4)[0]
    seen = []

    class Spy(A.Rule):
        name = "spy"
        pre = True

        def rows_out(self, n):
            return n

        def apply(self, x, *rest):
            seen.append(len(rest))
            return x

    pipeline = A.Pipeline([Spy(), A.NNM(1)], A.FLTrust())
    close(pipeline(x, reference=g0), A.FLTrust()(A.NNM(1)(x), reference=g0))
    assert seen == [0]
    poisoned = g0.clone()
    poisoned[0] = float("nan")
    clean = g0.clone()
    clean[0] = 0.0
    out = pipeline(x, reference=poisoned)
    assert torch.isfinite(out).all()
    close(out, pipeline(x, reference=clean))
    assert torch.isnan(poisoned[0])  # never written

    class NeedsOne(Spy):
        name = "needs-one"
        needs_reference = True

    with pytest.raises(ValueError, match="needs-one: a pre-aggregator cannot take the reference message"):
        A.Pipeline([NeedsOne()], A.FLTrust())


@given(b=st.integers(1, 4), seed=seeds)
@settings(max_examples=20, deadline=None)
def test_stacked_with_references_equals_one_call_per_set(b, seed):
    x = randn(seed, b * 7, 5).reshape(b, 7, 5)
    refs = randn(seed + 1, b, 5)
    pipeline = A.build("nnm+fltrust", f=2)
    close(pipeline.stacked(x, refs), torch.stack([pipeline(m, reference=r) for m, r in zip(x, refs)]), tol=1e-12)
    with pytest.raises(ValueError, match=r"need a \(%d, 5\) reference" % b):
        pipeline.stacked(x)


@pytest.mark.parametrize("spec, params", [("cclust", {}), ("signguard", {"fraction": 0.5}), ("nnm+cclust", {}),
                                          ("dnc", {"b": 3, "niters": 2})])
def test_host_and_random_rules_are_stacked_as_one_call_per_set(spec, params):
    x = randn(3, 4 * 9, 6).reshape(4, 9, 6)
    x[1, :2] = float("nan")
    stacked, one_by_one = A.build(spec, f=2, seed=7, **params), A.build(spec, f=2, seed=7, **params)
    assert not (stacked.vmappable and not stacked.draws(6))
    close(stacked.stacked(x), torch.stack([one_by_one(m) for m in x]), tol=0)


@given(b=st.integers(1, 4), niters=st.integers(1, 3), seed=seeds)
@settings(max_examples=20, deadline=None)
def test_dnc_at_most_b_coordinates_wide_draws_nothing_and_is_batched_as_its_calls(b, niters, seed):
    """dnc samples b coordinates only when d > b; narrower messages (the BN statistics) use all
    of them, draw nothing, and vmap batches the sets (bn-kl scores 47 a round through it)."""
    x = randn(seed, b * 9 * 6, 1).reshape(b, 9, 6)
    x[0, :2] = float("nan")
    g = torch.Generator().manual_seed(seed)
    state = g.get_state()
    pipeline = A.build("dnc", f=2, niters=niters, b=6, generator=g)
    assert not pipeline.draws(6) and pipeline.draws(7) and not A.build("mean").draws(7)
    calls = torch.stack([pipeline(m) for m in x])
    close(pipeline.stacked(x), calls, tol=1e-12)
    assert torch.equal(g.get_state(), state)


def test_a_rule_that_draws_at_this_width_is_not_given_to_vmap(monkeypatch):
    batched = []
    real = torch.vmap
    monkeypatch.setattr(torch, "vmap", lambda fn, *a, **k: batched.append(fn) or real(fn, *a, **k))
    x = randn(2, 3 * 9 * 6, 1).reshape(3, 9, 6)
    narrow, wide = A.build("dnc", f=2, b=6, seed=1), A.build("dnc", f=2, b=5, seed=1)
    narrow.stacked(x)
    assert batched == [narrow]
    wide.stacked(x)
    assert batched == [narrow]


@pytest.mark.parametrize("spec", ["mda", "smea", "caf", "bulyan", "fltrust"])
def test_vmappable_rules_are_batched_by_vmap(spec):
    x = randn(5, 3 * 11, 4).reshape(3, 11, 4)
    refs = randn(6, 3, 4)
    pipeline = A.build(spec, f=2)
    assert pipeline.vmappable and not pipeline.random
    calls = torch.stack([pipeline(m, reference=r) for m, r in zip(x, refs)])
    close(pipeline.stacked(x, refs) if pipeline.needs_reference else pipeline.stacked(x), calls, tol=1e-10)


# ---- declared properties the kit cannot check (random rules), dtypes, hostile rows ---------------

@given(case=sets(max_f=3, d=(1, 8)), c=st.sampled_from([1e-3, 7.0, 1e3]), perm_seed=seeds)
@MEDIUM
def test_signguard_and_dnc_are_permutation_invariant_and_scale_equivariant_for_a_given_draw(case, c, perm_seed):
    x, f = case
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(perm_seed))
    for spec, params in (("signguard", {"fraction": 0.5}), ("dnc", {"b": 2})):
        base = A.build(spec, f=f, seed=3, **params)(x)
        close(A.build(spec, f=f, seed=3, **params)(x[perm]), base, tol=1e-7)
        close(A.build(spec, f=f, seed=3, **params)(c * x), c * base, tol=1e-7)
    t = torch.linspace(-5, 5, x.shape[1], dtype=x.dtype)
    close(A.build("dnc", f=f, seed=3, b=2)(x + t), A.build("dnc", f=f, seed=3, b=2)(x) + t, tol=1e-7)


CATALOGUE = ["mda", "smea", "caf", "bulyan", "dnc", "signguard", "cclust", "fltrust"]


def call(spec, x, f=2):
    agg = A.build(spec, f=f)
    if agg.needs_reference:
        return agg(x, reference=x[-1].clone())
    return agg(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("spec", CATALOGUE)
def test_dtype_is_kept(dtype, spec):
    x = randn(0, 11, 5, dtype=dtype)
    out = call(spec, x)
    assert out.dtype == dtype and out.shape == (5,) and torch.isfinite(out).all()


@pytest.mark.parametrize("spec", CATALOGUE)
@pytest.mark.parametrize("value", [1e38, -3e38, float("nan"), float("inf")])
def test_huge_and_non_finite_rows_give_a_finite_output(spec, value):
    x = randn(1, 11, 6, dtype=torch.float32)
    x[0] = value
    x[1, :3] = value
    before = x.clone()
    out = call(spec, x)
    assert torch.isfinite(out).all() and out.dtype == torch.float32
    assert torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(before, nan=7.0))
    if spec not in ("fltrust",):
        assert out.abs().max() < 1e3  # the huge rows did not get through


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", CATALOGUE)
def test_cuda_matches_cpu(spec):
    x = randn(1, 11, 300, dtype=torch.float32)
    cpu = call(spec, x)
    gpu = call(spec, x.cuda())
    assert gpu.device.type == "cuda"
    if spec not in ("dnc", "signguard"):  # CPU and CUDA generators draw different coordinates
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dnc_without_a_draw_is_batched_as_its_calls(monkeypatch):
    """bn-kl's candidates through dnc on the BN statistics (d <= b): vmap on the GPU, its
    eigendecompositions on the host, as the calls one by one (to rounding)."""
    x = randn(4, 47 * 10 * 16, 1, dtype=torch.float32).reshape(47, 10, 16).cuda()
    pipeline = A.build("dnc", f=3)
    batched, real = [], torch.vmap
    monkeypatch.setattr(torch, "vmap", lambda fn, *a, **k: batched.append(fn) or real(fn, *a, **k))
    out = pipeline.stacked(x)
    assert batched == [pipeline] and out.device.type == "cuda"
    torch.testing.assert_close(out, torch.stack([pipeline(m) for m in x]), rtol=1e-5, atol=1e-6)


# ---- the kit on rules that need a reference --------------------------------------------------

class ReturnsReference(A.Rule):
    """The reference itself: every property holds."""
    name = "returns-reference"
    needs_reference = True
    translation_equivariant = scale_equivariant = True

    def apply(self, x, reference):
        return reference.clone()


class FirstPlusReference(A.Rule):
    """The first row plus the reference: order-dependent, not the identity on identical rows,
    and not translation equivariant though it says so."""
    name = "first-plus-reference"
    needs_reference = True
    translation_equivariant = True

    def apply(self, x, reference):
        return x[0] + reference


@pytest.fixture
def reference_rules():
    for cls in (ReturnsReference, FirstPlusReference):
        A.register(cls)
    yield
    for cls in (ReturnsReference, FirstPlusReference):
        del A.AGGREGATORS[cls.name]


def test_the_kit_passes_the_reference_and_transforms_it(reference_rules):
    outcomes = {o.name: o for o in check("returns-reference", examples=20)}
    assert all(o.status in ("held", "not applicable") for o in outcomes.values())
    assert outcomes["translation equivariance"].status == "held"
    assert outcomes["identity on identical rows"].status == "held"
    bad = {o.name: o for o in check("first-plus-reference", examples=20)}
    assert bad["permutation invariance"].status == "failed"
    assert "reference=" in bad["permutation invariance"].counterexample  # the counterexample shows it
    assert bad["identity on identical rows"].status == "failed"  # row + row != row
    assert bad["translation equivariance"].status == "failed"  # shifted twice
    assert bad["stacked (vmap) equals one call per set"].status == "held"
