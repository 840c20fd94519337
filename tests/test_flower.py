"""The Flower bridge (robustbn.flower): RobustStrategy on hand-made replies (keys to channels,
protocols, sanitizing, one-line errors), the simulated attacks and label flipping, and the
equivalence of `robustbn flower` with `robustbn run` (bit for bit)."""

from __future__ import annotations

import json
import math
import sqlite3
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

flwr = pytest.importorskip("flwr")
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict  # noqa: E402

import aggregators  # noqa: E402
import attacks  # noqa: E402
from robustbn import flower, runner  # noqa: E402
from robustbn.cli import main  # noqa: E402
from robustbn.errors import ScenarioError  # noqa: E402
from robustbn.protocols import FBN  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402


def plain_model() -> nn.Module:
    """What a Flower user has: a torch model with nn.BatchNorm2d."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))


def reply(state: dict, pid: int, **metrics) -> Message:
    meta = Metadata(run_id=0, message_id="", src_node_id=100 + pid, dst_node_id=0, reply_to_message_id="",
                    group_id="", created_at=0.0, ttl=60.0, message_type="train")
    record = ArrayRecord(OrderedDict((k, v.detach().clone()) for k, v in state.items()))
    return Message(RecordDict({"arrays": record, "metrics": MetricRecord({flower.PARTITION: pid, **metrics})}),
                   metadata=meta)


def replies_of(model: nn.Module, n: int, seed: int = 1) -> list[dict]:
    """n clients' states: the model's weights and statistics moved at random."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        state = OrderedDict((k, v + torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 5)
                            for k, v in model.state_dict().items())
        for k in state:
            if k.endswith("running_var"):
                state[k] = state[k].abs()
        out.append(state)
    return out


def aggregate(strategy: flower.RobustStrategy, model: nn.Module, states: list[dict], order=None, round_=1):
    """configure_train with the model's state, then aggregate_train of the replies (in `order`)."""
    strategy.sent(ArrayRecord(model.state_dict()))  # what configure_train records
    messages = [reply(s, i) for i, s in enumerate(states)]
    order = order or range(len(messages))
    arrays, _ = strategy.aggregate_train(round_, [messages[i] for i in order])
    return arrays.to_torch_state_dict()


def test_keys_go_to_their_channel_from_the_model_and_protocol():
    model = plain_model()
    naive = flower.Layout(model, flower.get_protocol("naive")())
    assert naive.layers == ["1"] and naive.widths == [3]
    assert naive.weights == ["0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias"]
    assert naive.means == ["1.running_mean"] and naive.variances == ["1.running_var"]
    assert naive.counters == ["1.num_batches_tracked"] and naive.local == []
    fedbn = flower.Layout(model, flower.get_protocol("fedbn")())
    assert fedbn.weights == ["0.weight", "0.bias", "4.weight", "4.bias"]
    assert set(fedbn.local) == {"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    # a layer named like anything: found as a BN layer by its type, never by its name
    renamed = nn.Sequential(OrderedDict(conv=nn.Conv2d(1, 2, 3), norm_x=nn.BatchNorm2d(2)))
    assert flower.Layout(renamed, flower.get_protocol("naive")()).means == ["norm_x.running_mean"]


def test_naive_mean_is_fedavg_of_the_updates_and_counters_advance_by_the_median_step():
    model = plain_model()
    states = replies_of(model, 4)
    strategy = flower.RobustStrategy(model, n=4, norm="naive")
    out = aggregate(strategy, model, states, order=[2, 0, 3, 1])  # any arrival order: sorted by partition id
    g = model.state_dict()
    for k in strategy.layout.weights:
        deltas = torch.stack([s[k] for s in states]) - g[k]
        assert torch.equal(out[k], g[k] + deltas.mean(0)), k
    for k in ("1.running_mean", "1.running_var"):
        assert torch.allclose(out[k], torch.stack([s[k] for s in states]).mean(0))
    assert out["1.num_batches_tracked"].dtype == torch.int64  # every reply counted 5 more batches
    assert out["1.num_batches_tracked"] == g["1.num_batches_tracked"] + 5


def test_fedbn_returns_no_bn_keys():
    model = plain_model()
    out = aggregate(flower.RobustStrategy(model, n=3, norm="fedbn"), model, replies_of(model, 3))
    assert set(out) == {"0.weight", "0.bias", "4.weight", "4.bias"}


def test_fbn_returns_the_protocols_shared_statistics():
    model = plain_model()
    states = replies_of(model, 5)
    x = torch.zeros(8, 1, 6, 6)
    strategy = flower.RobustStrategy(model, n=5, norm="fbn", example_input=x)
    out = aggregate(strategy, model, states)
    count = torch.full((3,), 8 * 4 * 4.0)  # K: batch x H x W after the 3x3 convolution
    assert torch.equal(strategy.count, count)
    mean = aggregators.build("mean")
    expected = FBN().server_stats(torch.zeros(3), torch.ones(3), torch.stack([s["1.running_mean"] for s in states]),
                                  torch.stack([s["1.running_var"] for s in states]), count, 5, 0.1, mean, mean)
    assert torch.equal(out["1.running_mean"], expected[0]) and torch.equal(out["1.running_var"], expected[1])


@settings(max_examples=25, deadline=None)
@given(bad=st.lists(st.sampled_from([math.nan, math.inf, -math.inf, 1e38, -1e38]), min_size=2, max_size=2),
       spec=st.sampled_from(["trmean", "median", "nnm+trmean"]), norm=st.sampled_from(["naive", "fbn"]))
def test_hostile_replies_never_give_a_non_finite_record(bad, spec, norm):
    model = plain_model()
    states = replies_of(model, 6)
    for state, value in zip(states[-2:], bad):  # two replies full of one hostile value
        for k, v in state.items():
            if v.is_floating_point():
                state[k] = torch.full_like(v, value)
    strategy = flower.RobustStrategy(model, n=6, f=2, norm=norm, grad_agg=spec, bn_agg=spec,
                                     example_input=torch.zeros(4, 1, 6, 6))
    out = aggregate(strategy, model, states)
    assert all(torch.isfinite(v.double()).all() for v in out.values())


def test_bad_specs_and_fields_are_one_line_errors():
    model = plain_model()
    cases = [(dict(n=4, grad_agg="nope"), "grad_agg"), (dict(n=4, norm="fedtan"), "norm"),
             (dict(n=4, norm="central"), "norm"), (dict(n=4, lr=0.1), "lr"), (dict(grad_agg="mean"), "n"),
             (dict(n=4, grad_attack="sf"), "grad_attack"), (dict(n=4, norm="fbn"), "example_input"),
             (dict(n=4, f=2, grad_agg="trmean"), "grad_agg")]
    for kwargs, field in cases:
        with pytest.raises(ScenarioError) as e:
            flower.RobustStrategy(model, **kwargs)
        assert e.value.field == field and "\n" not in str(e.value), kwargs

    class Buffered(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(1))
    with pytest.raises(ValueError, match="buffer 'scale' is neither a parameter nor"):
        flower.RobustStrategy(Buffered(), n=2)


def test_simulated_attacks_replace_the_byzantine_replies():
    """n = 4, f = 1, SF on the update: the last node's reply is dropped and -mean(honest) sent."""
    model = plain_model()
    states = replies_of(model, 4)
    states[3] = {k: torch.full_like(v, 1e6) if v.is_floating_point() else v for k, v in states[3].items()}
    strategy = flower.SimulatedAttacks(flower.RobustStrategy(model, n=4, f=1), grad_attack="sf")
    out = aggregate(strategy, model, states)
    g = model.state_dict()
    for k in strategy.layout.weights:
        honest = torch.stack([s[k] for s in states[:3]]) - g[k]
        expected = g[k] + torch.cat([honest, -honest.mean(0, keepdim=True)]).mean(0)
        assert torch.allclose(out[k], expected, atol=1e-6), k


def test_label_flipping_wraps_a_train_function():
    logits, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 1, 0])
    seen = []

    def train(msg, context):
        seen.append(nn.CrossEntropyLoss()(logits, y))
        return None

    class Ctx:
        def __init__(self, pid):
            self.node_config = {"partition-id": pid, "num-partitions": 4}
    wrapped = flower.LabelFlipping(train, f=1, num_classes=4)
    wrapped(None, Ctx(0))
    wrapped(None, Ctx(3))
    assert torch.equal(seen[0], nn.functional.cross_entropy(logits, y))
    assert torch.equal(seen[1], nn.functional.cross_entropy(logits, 3 - y))


def train_message(strategy: flower.RobustStrategy, state: dict, round_: int = 1) -> Message:
    """What configure_train sends a node: the global arrays and the strategy's config."""
    meta = Metadata(run_id=0, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="",
                    created_at=0.0, ttl=60.0, message_type="train")
    config = ConfigRecord({**strategy.client_config(round_), "server-round": round_})
    return Message(RecordDict({"arrays": ArrayRecord(OrderedDict(state)), "config": config}), metadata=meta)


def node_context() -> Context:
    return Context(run_id=0, node_id=1, node_config={}, state=RecordDict(), run_config={})


def sgd_steps(model: nn.Module, batches, lr: float = 0.1) -> list[tuple]:
    """The user's loop; returns, per step, the first BN layer's (input, output, weight, bias)."""
    seen = []
    hook = model[1].register_forward_hook(lambda m, a, out: seen.append(
        (a[0].detach(), out.detach(), m.weight.detach().clone(), m.bias.detach().clone())))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    hook.remove()
    return seen


def batches_of(seed: int, steps: int = 2, shift: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 6, 6, generator=gen) + shift, torch.randint(0, 2, (8,), generator=gen))
            for _ in range(steps)]


def test_client_bn_fbn_normalizes_with_the_shared_statistics_and_reports_algorithm_2():
    """Seed 002, Algorithm 2 on a plain nn.BatchNorm2d: every training forward normalizes with
    the shared (mu, var) the server sent; the report is (1-b) prev + b batch mean and
    (1-b) prev + b Kn/(Kn-1) biased batch variance, step after step, computed here by hand."""
    model, n, beta = plain_model(), 5, 0.1
    strategy = flower.RobustStrategy(model, n=n, norm="fbn", example_input=torch.zeros(8, 1, 6, 6))
    shared_mean, shared_var = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2.0, 0.5, 3.0])
    sent = {**model.state_dict(), "1.running_mean": shared_mean, "1.running_var": shared_var}
    client = plain_model()
    bn = flower.ClientBN(client, train_message(strategy, sent), node_context())
    with bn:
        seen = sgd_steps(client, batches_of(3))
        assert torch.equal(client[1].running_mean, shared_mean)  # the buffers keep the shared statistics meanwhile
    mean, var, kn = shared_mean, shared_var, 8 * 4 * 4 * n
    for x, out, weight, bias in seen:
        assert torch.allclose(out, nn.functional.batch_norm(x, shared_mean, shared_var, weight, bias, False, 0.0, 1e-5),
                              atol=1e-6)
        mean = (1 - beta) * mean + beta * x.mean((0, 2, 3))
        var = (1 - beta) * var + beta * kn / (kn - 1) * x.var((0, 2, 3), unbiased=False)
    assert not torch.equal(seen[0][2], seen[1][2])  # the BN weights trained
    assert torch.allclose(client[1].running_mean, mean, atol=1e-6)
    assert torch.allclose(client[1].running_var, var, atol=1e-6)
    reply = bn.arrays().to_torch_state_dict()
    assert list(reply) == list(model.state_dict()) and torch.equal(reply["1.running_var"], client[1].running_var)
    assert type(client[1]).forward is client[1].forward.__func__  # the layer's own forward again after the block


def test_client_bn_and_the_strategy_give_centralized_bn_statistics_of_the_union_batch():
    """Seed 002, Appendix A, end to end on a plain model: three clients of different data, one
    step each through ClientBN, the strategy's fbn server with mean pipelines: the shared
    statistics are those of torch's BatchNorm on the union of the three batches."""
    model, beta = plain_model(), 0.1
    strategy = flower.RobustStrategy(model, n=3, norm="fbn", example_input=torch.zeros(8, 1, 6, 6))
    xs = [batches_of(10 + i, steps=1, shift=float(i))[0] for i in range(3)]
    states = []
    for x in xs:
        client = plain_model()
        with flower.ClientBN(client, train_message(strategy, model.state_dict()), node_context()):
            sgd_steps(client, [x])
        states.append(client.state_dict())
    out = aggregate(strategy, model, states)
    central = nn.BatchNorm2d(3, momentum=beta).train()
    with torch.no_grad():
        central(model[0](torch.cat([x for x, _ in xs])))  # the union batch at the first BN layer
    assert torch.allclose(out["1.running_mean"], central.running_mean, atol=1e-6)
    assert torch.allclose(out["1.running_var"], central.running_var, rtol=1e-5)
    naive_var = torch.stack([s["1.running_var"] for s in states]).mean(0)  # what averaging would give: biased
    assert not torch.allclose(naive_var, central.running_var, rtol=1e-2)


def test_client_bn_naive_is_torchs_own_batchnorm():
    model = plain_model()
    strategy = flower.RobustStrategy(model, n=4, norm="naive")
    mine, torchs = plain_model(), plain_model()
    with flower.ClientBN(mine, train_message(strategy, model.state_dict()), node_context()):
        sgd_steps(mine, batches_of(5, steps=3))
    sgd_steps(torchs, batches_of(5, steps=3))
    for k, v in torchs.state_dict().items():
        assert torch.allclose(mine.state_dict()[k], v, atol=1e-6), k


def test_client_bn_fedbn_keeps_the_bn_layers_on_the_client():
    model = plain_model()
    strategy = flower.RobustStrategy(model, n=2, norm="fedbn")
    context, client = node_context(), plain_model()
    bn = flower.ClientBN(client, train_message(strategy, model.state_dict()), context)
    with bn:
        sgd_steps(client, batches_of(7))
    assert set(bn.arrays()) == {"0.weight", "0.bias", "4.weight", "4.bias"}  # BN never leaves the client
    own = {k: v.clone() for k, v in client.state_dict().items() if k.startswith("1.")}
    assert not torch.equal(own["1.running_var"], torch.ones(3)) and not torch.equal(own["1.weight"], torch.ones(3))
    round_2 = aggregate(strategy, model, [dict(client.state_dict())] * 2)  # the server's arrays: no BN keys
    fresh = plain_model()  # a new model object, as a ClientApp builds every round
    flower.ClientBN(fresh, train_message(strategy, round_2, 2), context)
    state = fresh.state_dict()
    assert all(torch.equal(state[k], v) for k, v in own.items())
    assert all(torch.equal(state[k], v) for k, v in round_2.items())
    with pytest.raises(ValueError, match=r"^ClientBN: norm 'fedbn' keeps '1.weight' on the client between rounds: "
                                         r"pass the ClientApp's context$"):
        flower.ClientBN(plain_model(), train_message(strategy, round_2, 2))


def test_client_bn_fixbn_frozen_phase_reports_nothing():
    model = plain_model()
    strategy = flower.RobustStrategy(model, n=2, norm="fixbn", fixbn_switch=1, rounds=4)
    assert strategy.client_config(1)[flower.CONFIG_PHASE] == "train"
    client = plain_model()
    with flower.ClientBN(client, train_message(strategy, model.state_dict(), 2), node_context()):
        seen = sgd_steps(client, batches_of(8))
    assert torch.equal(client[1].running_mean, torch.zeros(3)) and torch.equal(client[1].running_var, torch.ones(3))
    x, out, weight, bias = seen[1]
    assert torch.allclose(out, nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), weight, bias, False, 0.0,
                                                        1e-5), atol=1e-6)


def test_client_bn_refuses_in_one_line():
    model = plain_model()
    msg = train_message(flower.RobustStrategy(model, n=2), model.state_dict())
    for norm in ("hbn", "fbn-scale"):
        msg.content["config"][flower.CONFIG_NORM] = norm
        with pytest.raises(ScenarioError) as e:
            flower.ClientBN(plain_model(), msg)
        assert e.value.field == "norm" and "\n" not in str(e.value)
        assert "needs robustbn's own BN layers" in str(e.value) and "naive, fbn, fixbn, fedbn, silobn" in str(e.value)
    del msg.content["config"][flower.CONFIG_NORM]
    with pytest.raises(ValueError, match=r"^ClientBN: the message's config has no 'robustbn-norm': the server's "
                                         r"strategy is not a robustbn.flower.RobustStrategy$"):
        flower.ClientBN(plain_model(), msg)


EQUIVALENCE = dict(dataset="synthetic-images", algorithm="fedavg", local_steps=2, rounds=4, eval_every=2,
                   batch_size=16, lr=0.05)


def test_robustbn_flower_reproduces_robustbn_run_naive_mean(tmp_path):
    """(a) mean pipelines, no attack, naive BN: through both CLIs into one store, the same
    history bit for bit, in two rows told apart by their engine."""
    path, db = tmp_path / "a.toml", tmp_path / "s.sqlite"
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in {**EQUIVALENCE, "n": 4, "norm": "naive"}.items()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one torch thread, as every Flower node has
    try:
        assert main(["run", str(path), "--db", str(db), "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert main(["flower", str(path), "--db", str(db), "--jobs", "2", "--quiet"]) == 0
    rows = sqlite3.connect(db).execute("SELECT engine, hash, history FROM runs ORDER BY engine").fetchall()
    assert [r[0] for r in rows] == ["flower", "robustbn"] and rows[0][1] != rows[1][1]
    assert json.loads(rows[0][2]) == json.loads(rows[1][2]) and len(json.loads(rows[0][2])) == 2
    assert main(["flower", str(path), "--db", str(db), "--quiet"]) == 0  # finished: skipped


def one_thread(fn, *args, **kwargs):
    """fn(...) with one torch thread, as every Flower node has (then the process's own again)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def test_robustbn_flower_reproduces_robustbn_run_fbn_under_attack():
    """(b) fbn, nnm+trmean on every channel, ALIE on the updates and SF on the BN means."""
    sc = Scenario.from_dict({**EQUIVALENCE, "n": 6, "f": 2, "norm": "fbn", "grad_agg": "nnm+trmean",
                             "bn_agg": "nnm+trmean", "grad_attack": "alie", "bn_mean_attack": "sf",
                             "bn_var_attack": "honest"})
    engine = one_thread(runner.run, sc, vectorized=False)
    bridge = flower.run_scenario(sc, cpus=2)
    assert bridge.history == engine.history and bridge.bn_stats == engine.bn_stats


LABELFLIP_FEDBN = {**EQUIVALENCE, "n": 4, "f": 1, "norm": "fedbn", "gamma": 1.0, "grad_attack": "labelflip",
                   "grad_agg": "trmean"}


def test_robustbn_flower_reproduces_robustbn_run_fedbn_under_label_flipping():
    """(c) FedBN's client-side path (each node's BN layers and statistics in its context.state;
    the personalized evaluation, each honest client's model on its own test split, averaged)
    and label flipping (the Byzantine node computes on flipped labels; its reply is kept and
    aggregated by trmean): the history and client 0's final statistics, bit for bit."""
    sc = Scenario.from_dict(LABELFLIP_FEDBN)
    engine = one_thread(runner.run, sc, vectorized=False)
    bridge = flower.run_scenario(sc, cpus=2)
    assert bridge.history == engine.history and bridge.bn_stats == engine.bn_stats
    assert [h["round"] for h in bridge.history] == [2, 4]  # evaluations only where due


def test_robustbn_flower_byzantine_nodes_train_on_flipped_labels(monkeypatch):
    """The scenario's ClientApp called in this process (no Ray), round 1: the Byzantine node's
    reply changes when label flipping is made the identity, an honest node's does not."""
    sc = Scenario.from_dict(LABELFLIP_FEDBN).validated()
    app = flower.client_app(sc)
    arrays = flower.initial_arrays(flower._federation(sc, fresh=True))
    meta = Metadata(run_id=0, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="",
                    created_at=0.0, ttl=60.0, message_type="train")

    def reply(pid: int) -> dict:
        msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}), metadata=meta)
        context = Context(run_id=0, node_id=pid, node_config={"partition-id": pid, "num-partitions": sc.n},
                          state=RecordDict(), run_config={})
        return one_thread(app, msg, context).content["arrays"].to_torch_state_dict()
    flipped = {pid: reply(pid) for pid in (0, 3)}
    monkeypatch.setattr(attacks.get("labelflip"), "flip", staticmethod(lambda labels, num_classes: labels))
    plain = {pid: reply(pid) for pid in (0, 3)}
    assert all(torch.equal(flipped[0][k], plain[0][k]) for k in plain[0])
    assert not all(torch.equal(flipped[3][k], plain[3][k]) for k in plain[3])


def test_robustbn_flower_refuses_what_it_does_not_run(tmp_path, capsys):
    path = tmp_path / "d.toml"
    path.write_text('dataset = "synthetic-images"\nalgorithm = "dsgd"\nn = 4\nrounds = 1\n')
    assert main(["flower", str(path), "--db", str(tmp_path / "s.sqlite")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("robustbn flower: algorithm: 'dsgd'") and "\n" not in err
    for field, value in (("participation", "0.5"), ("norm", '"fedtan"')):
        assert main(["flower", str(path), "--set", "algorithm=\"fedavg\"", "--set", f"{field}={value}",
                     "--db", str(tmp_path / "s.sqlite")]) == 2
        assert capsys.readouterr().err.startswith(f"robustbn flower: {field}:")
