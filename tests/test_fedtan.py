"""FedTAN (exact federated BN) and FedWon (scaled weight standardization): the exactness
identity against centralized BN, per-client gradients against a lockstep reference written
with plain autograd, attacks on the per-layer messages inside the forward, and FedWon's
standardized convolutions."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import aggregators
import attacks
from robustbn.engine import _flat
from robustbn.models import make_norm
from robustbn.norm import FedBatchNorm, norm_layers
from robustbn.protocols.fedwon import RELU_GAMMA, WSConv2d
from test_engine import federation, state


def test_fedtan_with_mean_pipelines_and_no_attack_is_centralized_bn():
    """Same batches, mean pipelines, f = 0: every round of FedTAN is centralized BN on the
    union of the clients' batches (the mean of the clients' gradients of the summed loss is
    the union batch's gradient; the pooled statistics are the union's)."""
    values = dict(f=0, grad_attack="none", bn_attack="none", grad_agg="mean", bn_agg="mean", n=4, gamma=0.5)
    tan, central = federation(norm="fedtan", **values), federation(norm="central", **values)
    for _ in range(5):
        tan.step()
        central.step()
    a, b = state(tan), state(central)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    torch.testing.assert_close(tan.evaluate()[1], central.evaluate()[1], rtol=1e-4, atol=1e-5)


def test_a_fedtan_layer_outside_a_vmap_is_one_client_with_its_own_statistics():
    """Alone (no vmap over clients), the pooled statistics are the batch's own: training-mode
    BN, values and gradients, with the batch statistics reported."""
    layer = make_norm("fedtan", 3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = (torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(1)) * 2 + 1).requires_grad_()
    out = layer(x)
    want = F.batch_norm(x, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (x, layer.weight), g),
                               torch.autograd.grad(want, (x, layer.weight), g))
    torch.testing.assert_close(layer.batch_stats[1], x.detach().var((0, 2, 3), unbiased=False))


def lockstep(fed, params: list[dict], x, y, pool):
    """The reference: every client's forward layer by layer in a Python loop, with its own
    parameter copies; at each BN layer the clients' batch statistics (biased variance) are
    pooled by `pool`, and every client normalizes with the pooled ones. Returns the honest
    clients' summed loss and the pooled statistics of every layer."""
    model = fed.model
    acts, pooled = list(x), []
    for name, module in model.features.named_children():
        prefix = f"features.{name}."
        if isinstance(module, FedBatchNorm):
            means = torch.stack([a.mean((0, 2, 3)) for a in acts])
            variances = torch.stack([a.var((0, 2, 3), unbiased=False) for a in acts])
            mean, var = pool(means, variances)
            pooled.append((mean.detach(), var.detach()))
            c = (1, -1, 1, 1)
            acts = [(a - mean.view(c)) / torch.sqrt(var + module.eps).view(c) * p[prefix + "weight"].view(c)
                    + p[prefix + "bias"].view(c) for a, p in zip(acts, params)]
        else:
            acts = [functional_call(module, {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}, (a,))
                    for a, p in zip(acts, params)]
    head = lambda p: {k[len("classifier."):]: v for k, v in p.items() if k.startswith("classifier.")}
    loss = sum(F.cross_entropy(functional_call(model.classifier, head(p), (a,)), yi)
               for a, p, yi in zip(acts, params, y))
    return loss, pooled


@pytest.mark.parametrize("bn_attack, bn_agg", [("none", "mean"), ("sf", "mean"), ("foe", "nnm+median"),
                                               ("alie", "trmean")])
def test_fedtan_gradients_and_pooled_statistics_match_the_lockstep_reference(bn_attack, bn_agg):
    """Each client's gradient is the gradient of the honest clients' summed loss with respect
    to its own copy of the weights, through the robustly aggregated (and attacked) statistics;
    the Byzantine messages are forged from the honest ones and carry no gradient."""
    fed = federation(norm="fedtan", n=5, f=1, bn_attack=bn_attack, bn_agg=bn_agg)
    f = fed.sc.f
    agg = aggregators.build(bn_agg, f=f)
    attack = attacks.build(bn_attack)

    def pool(means, variances):
        forged = (lambda m: attack(m.detach(), f)) if attack is not None else (lambda m: m[:0])
        byz_mean, byz_var = forged(means), forged(variances)
        mean = agg(torch.cat([means, byz_mean]))
        spread = agg(torch.cat([(means - mean) ** 2, (byz_mean - mean.detach()) ** 2]))
        return mean, agg(torch.cat([variances, byz_var])) + spread

    for _ in range(2):  # the second round from trained weights and statistics
        fed.step()
    x, y = fed._sample()
    fed.set_phase("train")
    buffers = fed._buffers(fed.shared_mean, fed.shared_var)
    (grads, _), aux = fed._client_grads(fed.theta, fed.local, buffers, x, y, theta_batched=False,
                                        buffers_batched=False)

    copies = [{k: v.detach().clone().requires_grad_() for k, v in fed.theta.items()} for _ in range(fed.h)]
    params = [{**c, **buffers} for c in copies]
    loss, pooled = lockstep(fed, params, x, y, pool)
    flat = torch.autograd.grad(loss, [p for c in copies for p in c.values()])
    want = torch.cat([g.reshape(-1) for g in flat]).reshape(fed.h, -1)
    torch.testing.assert_close(_flat(grads, 1), want, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(want[0], want[1])  # one gradient per client, not one for all
    torch.testing.assert_close(aux[1][0], torch.cat([m for m, _ in pooled]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux[2][0], torch.cat([v for _, v in pooled]), rtol=1e-5, atol=1e-6)


def test_attacks_on_fedtans_per_layer_messages_reach_the_forward_pass():
    """SF on the means moves the statistics every client normalizes with, hence the loss and
    the gradients of the honest clients; a robust pipeline takes most of that back."""
    def first_round(**values):
        fed = federation(norm="fedtan", n=6, f=2, grad_attack="none", grad_agg="mean", **values)
        x, y = fed._sample()
        fed.set_phase("train")
        buffers = fed._buffers(fed.shared_mean, fed.shared_var)
        (grads, _), aux = fed._client_grads(fed.theta, fed.local, buffers, x, y, False, False)
        return aux
    clean = first_round(bn_attack="none", bn_agg="mean")
    attacked = first_round(bn_attack=None, bn_mean_attack="sf", bn_var_attack="honest", bn_agg="mean")
    defended = first_round(bn_attack=None, bn_mean_attack="sf", bn_var_attack="honest", bn_agg="median")
    error = lambda aux: (aux[1][0] - clean[1][0]).abs().max()
    assert error(attacked) > 4 * error(defended)
    assert (attacked[0] - clean[0]).abs().max() > 1e-3  # the honest clients' losses moved


def test_fedwon_standardizes_every_convolution_and_has_no_norm_layer():
    fed = federation(norm="fedwon")
    convs = [m for m in fed.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(isinstance(m, WSConv2d) for m in convs) and not norm_layers(fed.model)
    assert {k for k in fed.theta if k.endswith(".gain")} == {f"features.{i}.gain" for i in (0, 4, 8)}


@settings(max_examples=25, deadline=None)
@given(cin=st.integers(1, 4), cout=st.integers(1, 4), k=st.sampled_from([1, 3]), scale=st.floats(1e-3, 1e3),
       shift=st.floats(-10, 10), seed=st.integers(0, 2**16))
def test_scaled_weight_standardization(cin, cout, k, scale, shift, seed):
    """Per output channel the standardized weight has mean 0 and variance
    gamma^2 / fan_in * v / (v + eps), v = fan_in x the raw weights' variance (gamma^2 / fan_in:
    He-like signal propagation through a ReLU); it ignores a shift of the raw weights."""
    torch.manual_seed(seed)
    conv = WSConv2d(cin, cout, k).double()
    with torch.no_grad():
        conv.weight.mul_(scale)
    fan_in = cin * k * k
    w = conv.standardized_weight().detach()
    v = conv.weight.detach().var((1, 2, 3), unbiased=False) * fan_in
    zeros = torch.zeros(cout, dtype=w.dtype)
    torch.testing.assert_close(w.mean((1, 2, 3)), zeros, atol=1e-9, rtol=0)
    torch.testing.assert_close(w.var((1, 2, 3), unbiased=False) * fan_in, RELU_GAMMA ** 2 * v / (v + conv.eps))
    with torch.no_grad():
        conv.weight.add_(shift)
    torch.testing.assert_close(conv.standardized_weight().detach(), w)
