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
    assert protocols.names() == ("naive", "fbn", "fixbn", "hbn", "fedbn", "central", "gn", "none")
    assert protocols.names(uses_bn=False) == ("gn", "none")
    assert protocols.names(sends_statistics=True) == ("naive", "fbn", "fixbn", "hbn", "central")
    assert protocols.names(local_statistics=True) == ("fedbn",)
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
    want = {"fbn": 36 / 35}.get(name, 9 / 8)
    assert protocol.variance_factor(count, n).item() == pytest.approx(want)
    assert protocol.phase(3) == ("frozen" if name == "fixbn" else naive.phase(3))
    assert protocol.sends(1) == protocol.sends_statistics
