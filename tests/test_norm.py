"""The norm protocols' formulas: FBN's exactness (seed 002, Appendix A) and direct transcriptions."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from robustbn.models import MODELS, build_model, make_norm
from robustbn.norm import FedBatchNorm, batch_moments, keep_finite, norm_layers
from robustbn.protocols import get
from robustbn.protocols.base import one_by_one
from robustbn.protocols.fbn import fbn_server_stats
from robustbn.protocols.hbn import HybridNorm, hbn_server_stats


def client_running_stats(mode, prev_mean, prev_var, batch_mean, batch_var, count, n, beta):
    return get(mode)().client_report(prev_mean, prev_var, batch_mean, batch_var, count, n, beta)


def server_stats(mode, shared_mean, shared_var, msg_mean, msg_var, count, n, beta, agg_mean, agg_var,
                 hbn_lambda=0.01, together=one_by_one):
    return get(mode)(hbn_lambda=hbn_lambda).server_stats(shared_mean, shared_var, msg_mean, msg_var, count, n, beta,
                                                         agg_mean, agg_var, together)


def variance_factor(mode, count, n):
    return get(mode)().variance_factor(count, n)


mean_agg = lambda m: m.mean(0)


@given(n=st.integers(1, 8), k=st.integers(2, 12), c=st.integers(1, 4), beta=st.floats(0.01, 0.99),
       rounds=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 100))
def test_fbn_server_statistics_equal_centralized_bn_on_the_union(n, k, c, beta, rounds, seed, scale):
    """Appendix A: with a mean pipeline, FBN's shared statistics equal the running statistics
    of centralized BN (torch's own BatchNorm1d) on the union of the batches, round after round."""
    g = torch.Generator().manual_seed(seed)
    central = torch.nn.BatchNorm1d(c, momentum=beta, dtype=torch.float64).train()
    mean, var = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    count = torch.full((c,), float(k), dtype=torch.float64)
    for _ in range(rounds):
        shift = scale * torch.randn(n, 1, c, generator=g, dtype=torch.float64)  # heterogeneous clients
        batches = shift + torch.randn(n, k, c, generator=g, dtype=torch.float64) * torch.rand(n, 1, c, generator=g, dtype=torch.float64)
        central(batches.reshape(n * k, c))
        m_i, v_i = client_running_stats("fbn", mean, var, batches.mean(1), batches.var(1, correction=0), count, n, beta)
        mean, var = fbn_server_stats(m_i, v_i, count, n, beta, mean_agg, mean_agg)
        torch.testing.assert_close(mean, central.running_mean, rtol=1e-9, atol=1e-9 * scale)
        torch.testing.assert_close(var, central.running_var, rtol=1e-9, atol=1e-9 * scale**2)


def test_naive_averaging_underestimates_the_variance_under_heterogeneity():
    # the bias FBN's correction removes: two clients with far-apart means
    batches = torch.stack([torch.full((10, 1), -5.0), torch.full((10, 1), 5.0)]) + torch.linspace(-1, 1, 10)[None, :, None]
    count = torch.tensor([10.0])
    args = (torch.zeros(1), torch.ones(1), batches.mean(1), batches.var(1, correction=0), count, 2, 0.1)
    naive = server_stats("naive", torch.zeros(1), torch.ones(1), *client_running_stats("naive", *args), count, 2, 0.1, mean_agg, mean_agg)
    fbn = server_stats("fbn", torch.zeros(1), torch.ones(1), *client_running_stats("fbn", *args), count, 2, 0.1, mean_agg, mean_agg)
    assert fbn[1] > naive[1] + 2.0  # 0.1 * 25 of between-client variance recovered


def test_client_running_stats_transcription():
    prev_m, prev_v = 0.5, 2.0
    bm, bv, k, n, beta = 1.5, 3.0, 7, 4, 0.2
    for mode, factor in [("naive", k / (k - 1)), ("fixbn", k / (k - 1)), ("fbn", k * n / (k * n - 1))]:
        m, v = client_running_stats(mode, torch.tensor([prev_m]), torch.tensor([prev_v]), torch.tensor([[bm]]),
                                    torch.tensor([[bv]]), torch.tensor([float(k)]), n, beta)
        assert m.item() == pytest.approx((1 - beta) * prev_m + beta * bm)
        assert v.item() == pytest.approx((1 - beta) * prev_v + beta * factor * bv)
    assert variance_factor("central", torch.tensor(200.0), 10).item() == pytest.approx(200 / 199)


@given(n=st.integers(2, 8), k=st.integers(2, 10), seed=st.integers(0, 10**6))
def test_hbn_pooling_equals_the_pooled_sample_variance(n, k, seed):
    """Seed 003, Eq. 8 with N_k = K: the pooled statistics of all n*K values."""
    x = torch.randn(n, k, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = x + 3 * torch.arange(n, dtype=torch.float64)[:, None, None]
    mean, var = hbn_server_stats(x.mean(1), x.var(1, correction=0), torch.full((3,), float(k), dtype=torch.float64),
                                 mean_agg, mean_agg)
    union = x.reshape(-1, 3)
    torch.testing.assert_close(mean, union.mean(0))
    torch.testing.assert_close(var, union.var(0, correction=1))
    # and a literal transcription of sum_k N_k (var_k + (mu_k - mu)^2) / (N - 1)
    mu = sum(k * x[i].mean(0) for i in range(n)) / (n * k)
    literal = sum(k * (x[i].var(0, correction=0) + (x[i].mean(0) - mu) ** 2) for i in range(n)) / (n * k - 1)
    torch.testing.assert_close(var, literal)


def test_hbn_server_takes_an_ema_with_lambda():
    msg_mean, msg_var = torch.full((3, 1), 2.0), torch.full((3, 1), 1.0)
    mean, var = server_stats("hbn", torch.zeros(1), torch.ones(1), msg_mean, msg_var, torch.tensor([4.0]), 3, 0.1,
                             mean_agg, mean_agg, hbn_lambda=0.25)
    assert mean.item() == pytest.approx(0.25 * 2.0)
    assert var.item() == pytest.approx(0.75 + 0.25 * 12 / 11 * 1.0)


def test_server_keeps_old_values_for_non_finite_aggregates_and_floors_variances():
    old_m, old_v = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    assert keep_finite(torch.tensor([float("nan"), 5.0]), old_m).tolist() == [1.0, 5.0]
    assert keep_finite(torch.tensor([float("inf"), -2.0]), old_v, floor=0.0).tolist() == [3.0, 0.0]
    m, v = server_stats("naive", old_m, old_v, torch.tensor([[float("inf"), 1.0]]), torch.tensor([[-1.0, float("nan")]]),
                        torch.tensor([5.0, 5.0]), 1, 0.1, mean_agg, mean_agg)
    assert m.tolist() == [1.0, 1.0] and v.tolist() == [0.0, 4.0]


@pytest.mark.parametrize("mode", ["naive", "fbn", "hbn", "fedbn"])
def test_layer_normalizes_with_its_modes_statistics(mode):
    layer = make_norm(mode, 3)
    layer.running_mean.fill_(1.0)
    layer.running_var.fill_(4.0)
    x = torch.randn(16, 3, 5, 5, generator=torch.Generator().manual_seed(0)) * 3 + 2
    out = layer(x)
    bm, bv = x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0)
    if mode == "fbn":
        want = (x - 1.0) / math.sqrt(4.0 + layer.eps)
    elif mode == "hbn":  # alpha = 0: s = 1/2
        m, v = 0.5 * bm + 0.5, 0.5 * bv + 2.0
        want = (x - m.view(1, 3, 1, 1)) / torch.sqrt(v.view(1, 3, 1, 1) + layer.eps)
    else:
        want = torch.nn.functional.batch_norm(x, None, None, training=True, eps=layer.eps)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.batch_stats[0], bm)
    torch.testing.assert_close(layer.batch_stats[1], bv)
    assert layer.count == 16 * 25
    # evaluation (and fixbn's frozen stage) use the running statistics
    layer.phase = "eval"
    torch.testing.assert_close(layer(x), (x - 1.0) / math.sqrt(4.0 + layer.eps))


def test_fbn_layer_sends_no_gradient_through_the_shared_statistics():
    layer = make_norm("fbn", 2)
    x = torch.randn(8, 2, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x) / math.sqrt(1 + layer.eps))


@pytest.mark.parametrize("mode", ["naive", "fbn", "hbn"])
@given(n=st.integers(5, 12), c=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_server_statistics_batched_equal_one_by_one(mode, n, c, seed):
    """The engine's batched call of the independent BN aggregations changes nothing."""
    import aggregators
    g = torch.Generator().manual_seed(seed)
    msg_mean, msg_var = torch.randn(n, c, generator=g, dtype=torch.float64), torch.rand(n, c, generator=g, dtype=torch.float64)
    agg = aggregators.build("nnm+median", f=2)
    together = lambda calls: list(agg.stacked(torch.stack([x for _, x in calls])))
    args = (mode, torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64), msg_mean, msg_var,
            torch.full((c,), 50.0, dtype=torch.float64), n, 0.1, agg, agg)
    for batched, plain in zip(server_stats(*args, together=together), server_stats(*args)):
        torch.testing.assert_close(batched, plain, rtol=1e-12, atol=1e-12)


def hybrid_formula(x, weight, bias, alpha, global_mean, global_var, eps):
    """Seed 003, Eqs. 9-10, left to autograd: the reference for HybridNorm's hand-derived backward."""
    dims, shape = [0] + list(range(2, x.dim())), (1, -1) + (1,) * (x.dim() - 2)
    batch_var, batch_mean = torch.var_mean(x, dims, correction=0)
    s = torch.sigmoid(alpha)
    mean = (1 - s) * batch_mean + s * global_mean
    var = (1 - s) * batch_var + s * global_var
    return (x - mean.view(shape)) * (weight * torch.rsqrt(var + eps)).view(shape) + bias.view(shape)


@given(n=st.integers(1, 6), c=st.integers(1, 4), side=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       offset=st.floats(-30, 30), spread=st.floats(0.01, 10))
def test_hybrid_norm_equals_autograd_of_the_formula(n, c, side, seed, offset, spread):
    if n * side * side < 2:
        n = 2
    g = torch.Generator().manual_seed(seed)
    def draw(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()
    x = draw(n, c, side, side, scale=spread, shift=offset)
    weight, bias, alpha = draw(c), draw(c), draw(c, scale=2.0)
    global_mean, global_var = torch.randn(c, generator=g, dtype=torch.float64), torch.rand(c, generator=g, dtype=torch.float64) + 0.1
    upstream = torch.randn(n, c, side, side, generator=g, dtype=torch.float64)
    inputs = (x, weight, bias, alpha)

    out, batch_mean, batch_var, *_ = HybridNorm.apply(*inputs, global_mean, global_var, 1e-5)
    want = hybrid_formula(*inputs, global_mean, global_var, 1e-5)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    want_var, want_mean = torch.var_mean(x.detach(), (0, 2, 3), correction=0)
    torch.testing.assert_close((batch_mean, batch_var), (want_mean, want_var), rtol=1e-9, atol=1e-9)
    got_grads = torch.autograd.grad((out * upstream).sum(), inputs)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    for name, got, expected in zip(("x", "weight", "bias", "alpha"), got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-7 * (1 + spread), msg=name)


def test_hybrid_norm_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    x, weight, bias, alpha = (torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
                              for shape in ((4, 3, 2, 2), (3,), (3,), (3,)))
    stats = torch.randn(3, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    assert torch.autograd.gradcheck(lambda *a: HybridNorm.apply(*a, *stats, 1e-5)[0], (x, weight, bias, alpha))


def test_batch_moments_are_the_batch_mean_and_biased_variance():
    x = torch.randn(5, 3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 7
    mean, var = batch_moments(x)
    want_var, want_mean = torch.var_mean(x, (0, 2, 3), correction=0)
    torch.testing.assert_close((mean, var), (want_mean, want_var), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["naive", "fbn", "hbn"])
def test_layer_on_cuda_reports_and_normalizes_as_on_the_cpu(mode):
    """The reported statistics come from the batch-norm kernel's running buffers (naive) or
    from batch_moments, and cuDNN is a different kernel: same numbers, same gradients."""
    x = torch.randn(16, 3, 5, 5, generator=torch.Generator().manual_seed(0)) * 3 + 2
    outs = {}
    for device in ("cpu", "cuda"):
        layer = make_norm(mode, 3).to(device)
        layer.running_mean.fill_(1.0)
        layer.running_var.fill_(4.0)
        xd = x.detach().to(device).requires_grad_()  # a leaf on both devices: its .grad is kept
        out = layer(xd)
        out.square().sum().backward()
        outs[device] = [t.cpu() for t in (out.detach(), *layer.batch_stats, xd.grad, layer.weight.grad)]
    want_var, want_mean = torch.var_mean(x, (0, 2, 3), correction=0)
    torch.testing.assert_close(outs["cuda"][1:3], [want_mean, want_var], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["cuda"], outs["cpu"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", MODELS)
def test_norm_none_is_the_same_network_without_its_normalization_layers(model):
    plain, with_bn = (build_model(model, norm, 3, 32, 10) for norm in ("none", "naive"))
    assert not any(isinstance(m, (FedBatchNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)) for m in plain.modules())
    norm_params = sum(p.numel() for _, layer in norm_layers(with_bn) for p in layer.parameters())
    assert norm_params > 0
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in with_bn.parameters()) - norm_params
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert plain(x).shape == (2, 10)

