"""RobustStrategy as a Flower user meets it (issue 31): any model (no BN layers under naive,
none, gn and fedwon), BN channels as robust as the updates by default, num_batches_tracked
advanced robustly, and hostile or missing replies left out with one log line, never a crash."""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("flwr")
from flwr.app import ArrayRecord, Error, Message, Metadata  # noqa: E402

from robustbn import flower  # noqa: E402
from robustbn.errors import ScenarioError  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402

from test_flower import aggregate, plain_model, replies_of, reply  # noqa: E402


def mlp() -> nn.Module:
    """A model without BatchNorm, as many Flower apps have."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_the_issues_repro_a_model_without_bn_no_longer_crashes():
    flower.RobustStrategy(nn.Linear(2, 2), n=3).sent(ArrayRecord(nn.Linear(2, 2).state_dict()))


@pytest.mark.parametrize("example_input", [None, torch.zeros(2, 4)], ids=["no-example", "example-input"])
@pytest.mark.parametrize("norm", ["naive", "none", "gn", "fedwon"])
def test_a_model_without_bn_aggregates_its_updates(norm, example_input):
    # the shipped server app always passes example_input: a model without BN has nothing to count
    model = mlp()
    states = replies_of(model, 5)
    strategy = flower.RobustStrategy(model, n=5, f=1, norm=norm, grad_agg="median", example_input=example_input)
    out = aggregate(strategy, model, states)
    g = model.state_dict()
    assert list(out) == list(g)
    for k in g:
        expected = g[k] + (torch.stack([s[k] for s in states]) - g[k]).median(0).values
        assert torch.allclose(out[k], expected, atol=1e-6), k


def test_protocols_that_need_bn_layers_are_refused_on_a_model_without_them_and_back():
    for norm in ("fbn", "fixbn", "fedbn", "silobn", "hbn"):
        with pytest.raises(ScenarioError) as e:
            flower.RobustStrategy(mlp(), n=3, norm=norm, example_input=torch.zeros(2, 4))
        assert e.value.field == "norm" and "\n" not in str(e.value)
        assert str(e.value).endswith("needs BN layers and the model has none; a model without BN runs under "
                                     "naive, gn, none, fedwon")
    with pytest.raises(ScenarioError, match=r"'gn' is for models without BN layers; the model has BN layer '1'$"):
        flower.RobustStrategy(plain_model(), n=3, norm="gn")


def hostile_var(states: list[dict], value: float = 1e6) -> list[dict]:
    """The last client's statistics (means and variances) all `value`."""
    states[-1] = {k: torch.full_like(v, value) if "running" in k else v for k, v in states[-1].items()}
    return states


def test_bn_statistics_follow_grad_agg_by_default():
    """FedMedian swapped for grad_agg="median" alone: one client at 1e6 of 7 cannot move
    running_var (the issue measured 1.4e5 through the old default mean); bn_agg="mean" given
    explicitly still means the mean."""
    model = plain_model()
    states = hostile_var(replies_of(model, 7))
    honest = torch.stack([s["1.running_var"] for s in states[:-1]])
    out = aggregate(flower.RobustStrategy(model, n=7, f=1, grad_agg="median"), model, states)
    assert (out["1.running_var"] >= honest.min(0).values).all() and (out["1.running_var"] <= honest.max(0).values).all()
    assert torch.equal(out["1.running_var"], torch.stack([s["1.running_var"] for s in states]).median(0).values)
    mean = aggregate(flower.RobustStrategy(model, n=7, f=1, grad_agg="median", bn_agg="mean"), model, states)
    assert (mean["1.running_var"] > 1e5).all()
    strategy = flower.RobustStrategy(model, n=7, f=1, grad_agg="nnm+trmean", bn_var_agg="median")
    assert (strategy.server.mean_channel.spec, strategy.server.var_channel.spec) == ("mean", "median")


def test_a_scenario_keeps_the_engines_bn_channels():
    """from_scenario runs the engine's server: a scenario that names no BN rule has the mean there."""
    sc = Scenario.from_dict({"dataset": "synthetic-images", "algorithm": "fedavg", "n": 4, "grad_agg": "median"})
    strategy = flower.RobustStrategy.from_scenario(sc)
    assert (strategy.server.grad_channel.spec, strategy.server.mean_channel.spec,
            strategy.server.var_channel.spec) == ("median", "mean", "mean")


def test_num_batches_tracked_advances_by_the_median_increment():
    model = plain_model()
    g = model.state_dict()["1.num_batches_tracked"]
    states = replies_of(model, 7)
    for state, steps in zip(states, [3, 4, 4, 5, 4, 10**12, -10**12]):  # two hostile counters
        state["1.num_batches_tracked"] = g + steps
    out = aggregate(flower.RobustStrategy(model, n=7, f=2), model, states)
    assert out["1.num_batches_tracked"].dtype == torch.int64 and out["1.num_batches_tracked"] == g + 4
    for state in states:
        state["1.num_batches_tracked"] = g - 7  # all behind: never below what was sent
    assert aggregate(flower.RobustStrategy(model, n=7, f=2), model, states)["1.num_batches_tracked"] == g


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.integers(0, 50), min_size=5, max_size=5),
       hostile=st.lists(st.integers(-2**62, 2**62), min_size=2, max_size=2))
def test_num_batches_tracked_stays_within_the_honest_increments(steps, hostile):
    """Two of seven replies with any counter: the step lies between the honest clients' least
    and greatest (the lower median of seven with at most two outside)."""
    model = plain_model()
    g = model.state_dict()["1.num_batches_tracked"]
    states = replies_of(model, 7)
    for state, step in zip(states, steps + hostile):
        state["1.num_batches_tracked"] = g + step
    out = aggregate(flower.RobustStrategy(model, n=7, f=2), model, states)["1.num_batches_tracked"]
    assert g + min(steps) <= out <= g + max(steps)


def malformed(kind: str, state: dict) -> dict:
    """One of the hostile replies a SuperNode could send."""
    state = OrderedDict(state)
    if kind == "nan":
        state["0.weight"] = state["0.weight"].clone().index_fill_(0, torch.tensor([0]), float("nan"))
    elif kind == "inf":
        state["1.running_var"] = torch.full_like(state["1.running_var"], float("inf"))
    elif kind == "shape":
        state["4.bias"] = torch.zeros(3)
    elif kind == "missing":
        del state["4.weight"]
    elif kind == "extra":
        state["extra.weight"] = torch.zeros(1)
    elif kind == "dtype":
        state["0.bias"] = state["0.bias"].double()
    return state


WHY = {"nan": "key '0.weight' holds NaN or inf", "inf": "key '1.running_var' holds NaN or inf",
       "shape": "key '4.bias' has shape (3,), the model's is (2,)", "missing": "key '4.weight' is missing",
       "extra": "key 'extra.weight' is not in the model's state_dict",
       "dtype": "key '0.bias' has dtype torch.float64, the model's is torch.float32"}


@pytest.mark.parametrize("kind", list(WHY))
def test_a_malformed_reply_is_left_out_with_one_log_line(kind, caplog):
    """The server goes on with the other replies: the round equals one without the hostile
    node (its pipelines built for the replies left), and one warning line says why."""
    model = plain_model()
    states = replies_of(model, 6)
    strategy = flower.RobustStrategy(model, n=6, f=1, grad_agg="nnm+trmean")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        out = aggregate(strategy, model, states[:5] + [malformed(kind, states[5])])
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == [f"RobustStrategy: round 1: the reply of node 105 is left out: {WHY[kind]}",
                     "RobustStrategy: round 1: aggregating 5 replies of n = 6 (the others lost or left out)"]
    without = flower.RobustStrategy(model, n=5, f=1, grad_agg="nnm+trmean")
    expected = aggregate(without, model, states[:5])
    assert all(torch.allclose(out[k], expected[k], atol=1e-6) for k in expected)
    assert all(torch.isfinite(v.double()).all() for v in out.values())


def test_a_reply_with_two_array_records_or_an_error_is_left_out(caplog):
    model = plain_model()
    states = replies_of(model, 4)
    strategy = flower.RobustStrategy(model, n=4, f=1, grad_agg="median")
    strategy.sent(ArrayRecord(model.state_dict()))
    two = reply(states[2], 2)
    two.content["more"] = ArrayRecord(OrderedDict(states[2]))
    meta = Metadata(run_id=0, message_id="", src_node_id=103, dst_node_id=0, reply_to_message_id="", group_id="",
                    created_at=0.0, ttl=60.0, message_type="train")
    died = Message(error=Error(code=0, reason="the SuperNode died"), metadata=meta)  # what a lost node gives
    with caplog.at_level(logging.INFO, logger="flwr"):
        arrays, _ = strategy.aggregate_train(1, [reply(states[0], 0), reply(states[1], 1), two, died])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "the reply of node 102 is left out: 2 ArrayRecords, one expected" in text
    assert "Received 3 results and 1 failures" in text
    out, g = arrays.to_torch_state_dict(), model.state_dict()
    for k in strategy.layout.weights:  # the median of the two replies kept: their mean
        assert torch.allclose(out[k], g[k] + (states[0][k] + states[1][k]) / 2 - g[k], atol=1e-6)


def test_no_reply_left_keeps_the_global_model(caplog):
    model = plain_model()
    strategy = flower.RobustStrategy(model, n=3)
    strategy.sent(ArrayRecord(model.state_dict()))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert strategy.aggregate_train(2, [reply(malformed("nan", replies_of(model, 1)[0]), 0)]) == (None, None)
    assert caplog.records[-1].getMessage() == "RobustStrategy: round 2: no reply to aggregate: the global model stays"


def test_too_few_replies_for_the_rule_keep_the_global_model(caplog):
    """Krum needs n > 2f + 2 even at f = 0: two replies of five cannot be aggregated by it."""
    model = plain_model()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = flower.RobustStrategy(model, n=5, f=1, grad_agg="krum")
        strategy.sent(ArrayRecord(model.state_dict()))
        assert strategy.aggregate_train(1, [reply(s, i) for i, s in enumerate(replies_of(model, 2))]) == (None, None)
    assert caplog.records[-1].getMessage().startswith("RobustStrategy: round 1: 2 replies kept: krum")
    assert caplog.records[-1].getMessage().endswith("; the global model stays")


def test_metrics_a_client_made_up_are_logged_not_a_crash(caplog):
    model = plain_model()
    strategy = flower.RobustStrategy(model, n=3)
    strategy.sent(ArrayRecord(model.state_dict()))
    bad = [reply(s, i, **{flower.LOSSES: [0.5, 0.4][: i + 1]}) for i, s in enumerate(replies_of(model, 3))]  # ragged
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, bad)
    assert arrays is not None and metrics is None
    assert caplog.records[-1].getMessage().startswith("RobustStrategy: the replies' metrics are not aggregated: ")
