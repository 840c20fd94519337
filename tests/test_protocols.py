"""Protocols as objects: the registry, a user's own protocol run by the engine like a built-in,
and an engine that names no protocol."""

import re
from pathlib import Path

import pytest
import torch

import robustbn
from robustbn import protocols
from robustbn.protocols import FBN, PROTOCOLS, Protocol, register
from robustbn.scenario import Scenario, ScenarioError

ROOT = Path(__file__).resolve().parent.parent


def test_the_engine_names_no_protocol():
    for path in ("robustbn/engine.py", "robustbn/runner.py", "robustbn/norm.py"):  # (scenario.py: the default norm)
        source = (ROOT / path).read_text()
        named = {name for name in set(PROTOCOLS) - {"none"}  # "none" is also the attack that sends nothing
                 if re.search(rf"""["']{re.escape(name)}["']""", source)}
        assert not named, f"{path} names {named}"


def test_registry_lists_the_built_in_protocols_with_what_they_are():
    assert protocols.names() == ("naive", "fbn", "fixbn", "hbn", "fedbn", "central", "gn", "none", "fbn-scale",
                                 "silobn", "fedtan", "fedwon")
    assert protocols.names(uses_bn=False) == ("gn", "none", "fedwon")
    assert protocols.names(sends_statistics=True) == ("naive", "fbn", "fixbn", "hbn", "central", "fbn-scale",
                                                      "fedtan")
    assert protocols.names(exchanges_in_forward=True) == ("fedtan",)
    assert protocols.names(local_statistics=True) == ("fedbn", "silobn")
    with pytest.raises(ValueError, match="unknown norm protocol 'bn'; allowed: naive, fbn"):
        protocols.get("bn")
    with pytest.raises(TypeError, match="not a subclass"):
        register(int)


@pytest.fixture
def half_momentum_fbn():
    @register
    class HalfFBN(FBN):
        """FBN whose server keeps half of its old statistics: a user's protocol."""
        name = "half-fbn"
        label = "half FBN"

        def server_update(self, shared_mean, shared_var, *args, **kwargs):
            mean, var = super().server_update(shared_mean, shared_var, *args, **kwargs)
            return (mean + shared_mean) / 2, (var + shared_var) / 2
    yield HalfFBN
    del PROTOCOLS["half-fbn"]


def test_a_registered_protocol_runs_like_a_built_in(half_momentum_fbn):
    values = dict(dataset="synthetic-images", n=4, f=1, rounds=4, batch_size=8, eval_every=2,
                  bn_mean_attack="sf", bn_var_attack="honest", bn_agg="median")
    mine, fbn = (robustbn.run({**values, "norm": norm}) for norm in ("half-fbn", "fbn"))
    assert [h["round"] for h in mine.history] == [2, 4] and mine.bn_stats.keys() == fbn.bn_stats.keys()
    assert mine.bn_stats != fbn.bn_stats  # its own server half ran
    assert Scenario.from_dict({**values, "norm": "half-fbn"}).norm == "half-fbn"


def test_protocol_checks_reject_what_it_cannot_run():
    with pytest.raises(ScenarioError, match="admits f = 0 only"):
        Scenario.from_dict(dict(dataset="synthetic-images", norm="central", f=1))
    for norm in ("fedbn", "gn", "none"):
        with pytest.raises(ScenarioError, match="sends no BN statistics"):
            Scenario.from_dict(dict(dataset="synthetic-images", norm=norm, f=1, bn_var_attack="sf"))


@pytest.mark.parametrize("name", protocols.names(uses_bn=True))
def test_default_hooks_are_naive_bn_unless_overridden(name):
    """The hooks a protocol does not override behave as naive BN's: checked on plain values."""
    protocol, naive = PROTOCOLS[name](switch_round=2), Protocol(switch_round=2)
    count, n = torch.tensor([9.0]), 4
    want = {"fbn": 36 / 35, "fbn-scale": 36 / 35, "fedtan": 36 / 35}.get(name, 9 / 8)
    assert protocol.variance_factor(count, n).item() == pytest.approx(want)
    assert protocol.phase(3) == ("frozen" if name == "fixbn" else naive.phase(3))
    assert protocol.sends(1) == protocol.sends_statistics


def test_scale_only_fbn_divides_by_the_shared_std_and_centers_nothing():
    from robustbn.models import make_norm
    layer = make_norm("fbn-scale", 3)
    layer.running_mean.fill_(1.0)
    layer.running_var.fill_(4.0)
    x = (torch.randn(16, 3, 5, 5, generator=torch.Generator().manual_seed(0)) * 3 + 2).requires_grad_()
    want = x.detach() / (4.0 + layer.eps) ** 0.5
    out = layer(x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(layer.batch_stats[0], x.detach().mean((0, 2, 3)))  # it measures as FBN does
    out.sum().backward()  # no gradient through the statistics: a constant scale
    torch.testing.assert_close(x.grad, torch.full_like(x, (4.0 + layer.eps) ** -0.5))
    layer.phase = "eval"
    torch.testing.assert_close(layer(x.detach()), want)  # evaluation does not center either


def test_silobn_shares_the_affine_parameters_and_keeps_the_statistics_local():
    from test_engine import federation
    fed = federation(False, norm="silobn", bn_attack="none")
    bn_affine = {f"{l}.{p}" for l in fed.layer_names for p in ("weight", "bias")}
    assert bn_affine <= set(fed.theta) and not fed.local  # aggregated with the weights
    sent = []
    fed.mean_channel.messages = lambda honest: sent.append(honest) or honest
    for _ in range(3):
        fed.step()
    assert sent == [] and torch.equal(fed.shared_mean, torch.zeros_like(fed.shared_mean))
    assert not torch.allclose(fed.local_mean[0], fed.local_mean[1])  # each client's own statistics
    acc, _ = fed.evaluate()
    assert fed.protocol.personalized and 0 <= acc.item() <= 1
