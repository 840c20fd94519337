import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aggregators as A
from aggregators.rules import NETWORK_MAX_ROWS, NETWORK_MIN_COLUMNS, _sorted, batcher_pairs
import reference as ref

# Row counts: n, and f with n > 2f + 2 so that every rule (Krum's bound is the strictest) applies.
n_f = st.integers(1, 6).flatmap(lambda f: st.tuples(st.integers(2 * f + 3, 2 * f + 9), st.just(f)))
seeds = st.integers(0, 2**31 - 1)
dims = st.integers(1, 12)


def randn(seed, n, d, dtype=torch.float64):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def aggregator(name, f):
    """Every aggregator (a bare rule, as users build them), by spec name."""
    return A.build(name, f=f).agg if name != "mean" else A.Mean()


# The rules of aggregators/catalogue.py and aggregators/clustering.py (MDA, SMEA, CAF, Bulyan,
# DnC, SignGuard, clipped clustering, FLTrust) have their references and tests in
# test_rule_catalogue.py; the property kit holds every registered rule to its declarations.
CATALOGUE = {"mda", "smea", "caf", "bulyan", "dnc", "signguard", "cclust", "fltrust"}
ALL = sorted(set(A.AGGREGATORS) - CATALOGUE)
PIPELINES = ["nnm+median", "nnm+trmean", "nnm+krum", "bucketing+cc", "clipping+mean",
             "arc+trmean", "nnm+geomed", "arc+nnm+meamed"]


# ---- against the numpy references ------------------------------------------------------

REFERENCES = {
    "mean": lambda x, f: ref.mean(x),
    "median": lambda x, f: ref.median(x),
    "trmean": ref.trmean,
    "krum": ref.krum,
    "multikrum": ref.multikrum,
    "geomed": lambda x, f: ref.geomed(x),
    "cc": lambda x, f: ref.cc(x, tau=10.0, start=np.zeros(x.shape[1])),  # a first call: from zeros
    "meamed": ref.meamed,
    "monna": ref.monna,
}


@pytest.mark.parametrize("name", ALL)
@given(nf=n_f, d=dims, seed=seeds)
def test_aggregator_matches_numpy_reference(name, nf, d, seed):
    n, f = nf
    x = randn(seed, n, d)
    got = aggregator(name, f)(x)
    np.testing.assert_allclose(got.numpy(), REFERENCES[name](x.numpy(), f), rtol=1e-9, atol=1e-9)


@given(nf=n_f, d=dims, seed=seeds)
def test_nnm_matches_reference(nf, d, seed):
    n, f = nf
    x = randn(seed, n, d)
    np.testing.assert_allclose(A.NNM(f)(x).numpy(), ref.nnm(x.numpy(), f), rtol=1e-9, atol=1e-9)


@given(n=st.integers(1, 20), s=st.integers(1, 6), d=dims, seed=seeds, bucket_seed=seeds)
def test_bucketing_matches_reference(n, s, d, seed, bucket_seed):
    x = randn(seed, n, d)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(bucket_seed)).numpy()
    got = A.Bucketing(s, seed=bucket_seed)(x)
    assert got.shape == (math.ceil(n / s), d)
    np.testing.assert_allclose(got.numpy(), ref.bucketing(x.numpy(), s, perm), rtol=1e-9, atol=1e-9)


@given(n=st.integers(1, 20), d=dims, seed=seeds, c=st.one_of(st.none(), st.floats(0.01, 10)))
def test_clipping_matches_reference(n, d, seed, c):
    x = randn(seed, n, d)
    np.testing.assert_allclose(A.Clipping(c)(x).numpy(), ref.clipping(x.numpy(), c), rtol=1e-6, atol=1e-9)


@given(nf=n_f, d=dims, seed=seeds)
def test_arc_matches_reference(nf, d, seed):
    n, f = nf
    x = randn(seed, n, d)
    np.testing.assert_allclose(A.ARC(f)(x).numpy(), ref.arc(x.numpy(), f), rtol=1e-6, atol=1e-9)


def test_arc_uses_exact_integer_count():
    # 2 * (3/9) * 6 = 4 exactly; in floats it is 3.999..., which would clip one row too few.
    x = torch.arange(1.0, 10.0, dtype=torch.float64)[:, None]
    out = A.ARC(3)(x)[:, 0]
    torch.testing.assert_close(out, torch.tensor([1, 2, 3, 4, 5, 5, 5, 5, 5], dtype=torch.float64))


def test_geometric_median_beats_every_input_on_its_objective():
    x = randn(3, 15, 4)
    z = A.GeometricMedian(iters=200)(x)
    objective = lambda p: torch.linalg.vector_norm(x - p, dim=1).sum()
    assert all(objective(z) <= objective(x[i]) for i in range(len(x)))
    assert objective(z) <= objective(x.mean(0))


# ---- the CPU sorting network -------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 17))
def test_batcher_network_sorts_every_zero_one_input(n):
    """By the zero-one principle, a comparator network that sorts all 2^n inputs of 0s and 1s
    sorts every input."""
    columns = torch.tensor(list(itertools.product((0, 1), repeat=n)), dtype=torch.int8).T
    rows = list(columns.unbind(0))
    for i, j in batcher_pairs(n):
        assert 0 <= i < j < n
        rows[i], rows[j] = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
    assert torch.equal(torch.stack(rows), columns.sort(0).values)


# A long-row example is 4096 or more columns, each its own sort: 100 of them (the ci profile's
# 500 elsewhere) already compare hundreds of thousands of columns against the reference.
LONG_ROWS = settings(max_examples=min(100, settings().max_examples))


@LONG_ROWS
@given(n=st.integers(1, 80) | st.sampled_from([NETWORK_MAX_ROWS]), seed=seeds, ties=st.booleans(),
       extremes=st.booleans())
def test_long_rows_sort_through_the_network_exactly_as_torch_sort(n, seed, ties, extremes):
    x = randn(seed, n, NETWORK_MIN_COLUMNS, dtype=torch.float32)
    if ties:  # many equal values, and -0.0 next to 0.0
        x = x.round()
    if extremes:
        x[:, :4] = torch.tensor([float("inf"), -float("inf"), 3e38, -3e38])
    assert torch.equal(_sorted(x), torch.sort(x, dim=0).values)


@pytest.mark.parametrize("name", ["median", "trmean", "meamed", "geomed", "cc"])
@LONG_ROWS
@given(nf=n_f, seed=seeds)
def test_coordinate_rules_on_long_rows_match_numpy_reference(name, nf, seed):
    """Rows of NETWORK_MIN_COLUMNS values take the sorting-network path on the CPU."""
    n, f = nf
    x = randn(seed, n, NETWORK_MIN_COLUMNS)
    got = aggregator(name, f)(x)
    np.testing.assert_allclose(got.numpy(), REFERENCES[name](x.numpy(), f), rtol=1e-9, atol=1e-9)


@given(nf=n_f, d=dims | st.just(NETWORK_MIN_COLUMNS), seed=seeds, spread=st.integers(1, 3))
def test_meamed_breaks_ties_by_value_whatever_the_row_order(nf, d, seed, spread):
    """Small integers make values equally far from the median on both sides: the window of
    sorted values Meamed averages must equal the reference's (distance, value) order, and a
    permutation of the rows must not change which values count."""
    n, f = nf
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-spread, spread + 1, (n, d), generator=g).double()
    got = A.Meamed(f)(x)
    np.testing.assert_allclose(got.numpy(), ref.meamed(x.numpy(), f), rtol=1e-12, atol=1e-12)
    assert torch.equal(A.Meamed(f)(x[torch.randperm(n, generator=g)]), got)


@pytest.mark.parametrize("n", [NETWORK_MAX_ROWS + 1, NETWORK_MAX_ROWS + 2])
@given(seed=seeds, d=dims, ties=st.booleans())
def test_median_of_many_rows_selects_as_the_reference(n, seed, d, ties):
    """More rows than the sorting network takes: the CPU median selects (torch.median), in a
    plain call and batched (torch.vmap), and equals the sorted reference."""
    x = randn(seed, n, d)
    if ties:
        x = x.round()
    np.testing.assert_allclose(A.build("median")(x).numpy(), ref.median(x.numpy()), rtol=1e-12, atol=1e-12)
    stacked = torch.stack([x, -x])
    np.testing.assert_allclose(A.build("median").stacked(stacked).numpy(),
                               np.stack([ref.median(x.numpy()), ref.median(-x.numpy())]), rtol=1e-12, atol=1e-12)


# ---- properties ------------------------------------------------------------------------
# Permutation invariance, translation and scale equivariance, identity on identical rows, the
# honest coordinate range, finiteness under hostile rows, inputs never written, NNM's
# permutation equivariance, a spec equal to its steps and stacked (vmap) equal to one call per
# set: the property kit holds every rule and the common pipelines to them
# (tests/test_aggregator_kit.py). Here: what is particular to one rule.

@given(nf=n_f, d=dims, seed=seeds)
def test_nnm_rows_are_convex_combinations(nf, d, seed):
    n, f = nf
    x = randn(seed, n, d)
    dist = A.pairwise_sq_distances(x)
    dist.fill_diagonal_(-1.0)
    nearest = dist.topk(n - f, dim=1, largest=False).indices
    out = A.NNM(f)(x)
    for i in range(n):
        # row i is the uniform convex combination of its n - f nearest rows, itself included
        assert i in nearest[i].tolist()
        torch.testing.assert_close(out[i], x[nearest[i]].mean(0), rtol=1e-9, atol=1e-9)
        assert torch.all(out[i] <= x.max(0).values + 1e-12) and torch.all(out[i] >= x.min(0).values - 1e-12)


def test_stacked_needs_three_dimensions():
    with pytest.raises(ValueError, match=r"nnm\+median: stacked messages must be a 3-D \(b, n, d\) tensor"):
        A.build("nnm+median", f=1).stacked(torch.zeros(5, 3))


# ---- hostile input ---------------------------------------------------------------------

BIG = float(np.float32(9.9e37))
HOSTILE = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e38, -1e38])
hostile_values = st.one_of(HOSTILE, st.floats(-BIG, BIG, width=32))


@st.composite
def attacked(draw, strict=False):
    """(x, honest, f): float32 messages with up to f hostile rows in random places."""
    f = draw(st.integers(1, 4))
    n = draw(st.integers(2 * f + 3 if strict else 2 * f + 1, 2 * f + 8))
    d = draw(st.integers(1, 6))
    n_bad = draw(st.integers(0, f))
    honest = draw(hnp.arrays(np.float32, (n - n_bad, d), elements=st.floats(-1e6, 1e6, width=32)))
    bad = draw(hnp.arrays(np.float32, (n_bad, d), elements=hostile_values))
    order = draw(st.permutations(range(n)))
    x = torch.from_numpy(np.concatenate([honest, bad])[list(order)])
    return x, torch.from_numpy(honest), f


def assert_in_honest_range(out, honest):
    lo, hi = honest.min(0).values, honest.max(0).values
    slack = 1e-6 * torch.maximum(lo.abs(), hi.abs()) + 1e-30
    assert torch.isfinite(out).all()
    assert torch.all(out >= lo - slack) and torch.all(out <= hi + slack), (out, lo, hi)


@given(case=attacked())
def test_bare_rules_survive_hostile_rows_too(case):
    x, honest, f = case
    assert_in_honest_range(A.CoordinateWiseMedian(f)(x), honest)
    assert_in_honest_range(A.TrimmedMean(f)(x), honest)


def test_mean_alone_is_the_plain_average_and_propagates_nan():
    x = torch.tensor([[1.0], [float("nan")]])
    assert torch.isnan(A.Mean()(x)).all()
    assert A.build("mean")(x).item() == 0.5  # a pipeline sanitizes: NaN -> 0


def test_sanitize_replaces_non_finite_by_zero_and_copies():
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 2.0]])
    out = A.sanitize(x)
    assert out.tolist() == [[0.0, 0.0, 0.0, 2.0]] and out.data_ptr() != x.data_ptr()


# ---- dtypes, devices, errors -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("spec", ALL + PIPELINES)
def test_dtype_is_kept(dtype, spec):
    x = randn(0, 11, 5, dtype=dtype)
    out = A.build(spec, f=2)(x)
    assert out.dtype == dtype and out.shape == (5,) and torch.isfinite(out).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ALL + PIPELINES)
def test_cuda_matches_cpu(spec):
    x = randn(1, 11, 300, dtype=torch.float32)
    cpu = A.build(spec, f=2)(x)
    gpu = A.build(spec, f=2)(x.cuda())
    assert gpu.device.type == "cuda"
    if not spec.startswith("bucketing"):  # CPU and CUDA generators draw different shuffles
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(10, 10), (120, 7, 7)])
def test_cuda_eigh_on_the_host_matches_cusolver(shape, monkeypatch):
    """A small matrix on a GPU is solved on the host (one copy, not cuSOLVER's round trips):
    the same eigenvalues and top eigenvector (up to sign) as on the device, returned there."""
    from aggregators import catalogue

    a = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).cuda()
    m = a @ a.mT
    host_vals, host_vecs = catalogue._eigh(m)
    monkeypatch.setattr(catalogue, "HOST_EIGH_MAX_ENTRIES", 0)
    dev_vals, dev_vecs = catalogue._eigh(m)
    assert host_vals.device.type == host_vecs.device.type == "cuda"
    torch.testing.assert_close(host_vals, dev_vals, rtol=1e-9, atol=1e-9)
    top = lambda v: v[..., -1] * torch.sign(v[..., :1, -1])
    torch.testing.assert_close(top(host_vecs), top(dev_vecs), rtol=1e-6, atol=1e-6)
    monkeypatch.undo()  # under torch.vmap too (the engine batches the BN layers' rules)
    batched = torch.vmap(lambda g: catalogue._eigh(g, vectors=False))(m.reshape(-1, *shape[-2:])[:, None])
    torch.testing.assert_close(batched[:, 0], dev_vals.reshape(-1, shape[-1]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spec, f, n, message", [
    ("trmean", 5, 10, "needs 2f < n"),
    ("median", 5, 10, "needs f < n/2"),
    ("nnm+median", 10, 10, "nnm: needs f < n"),
    ("krum", 4, 10, r"needs n > 2f \+ 2"),
    ("bucketing+median", 3, 9, r"median: needs f < n/2, got f=3, n=5"),
    ("bogus", 1, 10, "spec 'bogus': unknown aggregation step 'bogus'; allowed: nnm, bucketing"),
    ("median+nnm", 1, 10, "'nnm' is a pre-aggregator: end the spec with an aggregator; aggregators: mean"),
    ("foo+median", 1, 10, "unknown aggregation step 'foo'"),
    ("median+mean", 1, 10, "'median' is an aggregator: only the last step may be one; pre-aggregators: nnm"),
    ("", 1, 10, "non-empty string"),
])
def test_impossible_settings_are_clear_errors(spec, f, n, message):
    with pytest.raises(ValueError, match=message):
        A.build(spec, f=f, n=n)


def test_errors_at_call_time_and_for_parameters():
    with pytest.raises(ValueError, match="needs 2f < n"):
        A.build("trmean", f=3)(torch.randn(6, 2))
    with pytest.raises(ValueError, match="shape \\(n, d\\)"):
        A.build("median")(torch.randn(6))
    with pytest.raises(ValueError, match="floating-point"):
        A.build("median")(torch.ones(6, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="f \\(number of Byzantine messages\\) must be an integer >= 0"):
        A.build("trmean", f=-1)
    with pytest.raises(ValueError, match="not taken by any step.*allowed: generator, s, seed"):
        A.build("bucketing+median", f=1, tau=2.0)
    assert A.build("bucketing+cc", f=1, s=3, tau=2.0).agg.tau == 2.0


def test_bucketing_is_reproducible_from_its_seed():
    x = randn(0, 10, 3)
    assert torch.equal(A.Bucketing(2, seed=5)(x), A.Bucketing(2, seed=5)(x))
    assert not torch.equal(A.Bucketing(2, seed=5)(x), A.Bucketing(2, seed=6)(x))


def test_distances_of_huge_rows_overflow_to_inf_not_nan():
    x = torch.tensor([[1e38, 1e38], [0.0, 1.0], [0.0, 2.0]])
    d = A.pairwise_sq_distances(x)
    assert torch.isinf(d[0, 1:]).all() and d[1, 2] == 1.0 and not torch.isnan(d).any()


# ---- centered clipping as published: a rule with state across rounds ----------------------

@given(rounds=st.integers(1, 6), n=st.integers(1, 9), d=dims, seed=seeds,
       tau=st.floats(0.05, 20.0), iters=st.integers(1, 4), scale=st.sampled_from([0.1, 1.0, 30.0]))
def test_cc_over_rounds_matches_the_published_algorithm(rounds, n, d, seed, tau, iters, scale):
    """Each round starts from the previous round's aggregate, the first from zeros
    (Karimireddy, He and Jaggi 2021, and their code), whatever the messages' scale."""
    xs = [scale * randn(seed + r, n, d) + r for r in range(rounds)]
    rule = A.build("cc", tau=tau, iters=iters)
    for x, want in zip(xs, ref.cc_rounds([x.numpy() for x in xs], tau, iters)):
        np.testing.assert_allclose(rule(x).numpy(), want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rule.agg.previous.numpy(), want, rtol=1e-9, atol=1e-9)


def test_cc_defaults_are_the_papers_and_center_median_is_the_old_stateless_rule():
    published = A.build("cc").agg
    assert (published.tau, published.iters, published.center) == (10.0, 3, "previous") and A.is_stateful(published)
    old = A.build("cc", center="median")
    assert (old.agg.tau, old.agg.iters) == (1.0, 3) and not A.is_stateful(old)
    x = randn(3, 7, 5)
    for _ in range(3):  # stateless: every call from the median, as robustbn's cc did before
        np.testing.assert_allclose(old(x).numpy(), ref.cc(x.numpy()), rtol=1e-12)
    with pytest.raises(ValueError, match="cc: center must be one of 'previous', 'median', got 'last'"):
        A.build("cc", center="last")


def test_cc_trial_calls_read_the_state_and_leave_it():
    p, twin = A.build("cc", tau=0.5), A.build("cc", tau=0.5)
    first, second = randn(0, 8, 4), randn(1, 8, 4) * 100
    p(first), twin(first)
    with A.trials(p):
        trial = p(second)
    assert torch.equal(p.agg.previous, twin.agg.previous)  # the trial left the state
    assert torch.equal(trial, twin(second))  # it started from the recorded state
    assert torch.equal(p(second), trial) and torch.equal(p.agg.previous, trial)  # the next server call records


def test_cc_state_moves_at_most_tau_per_iteration_under_huge_messages():
    """A clipped step moves the center by at most tau per iteration: hostile rows of 1e38 (or
    sanitized NaN/inf) never make the state non-finite."""
    rule = A.build("cc", f=2, tau=1.0, iters=2)
    x = randn(0, 6, 3)
    x[:2] = torch.tensor([[1e38, float("nan"), float("inf")]] * 2, dtype=x.dtype)
    for _ in range(5):
        before = rule.agg.previous if rule.agg.previous is not None else torch.zeros(3, dtype=x.dtype)
        out = rule(x)
        assert torch.isfinite(out).all() and torch.linalg.vector_norm(out - before) <= 2.0 + 1e-9


def test_cc_refuses_a_second_channel_of_another_size():
    rule = A.build("cc")
    rule(randn(0, 5, 3))
    with pytest.raises(ValueError, match="cc: messages of 4 values after 3; one rule object serves one channel"):
        rule(randn(0, 5, 4))
