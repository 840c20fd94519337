"""A robustbn FedAvg scenario as a Flower simulation (`robustbn flower`): its ServerApp and
ClientApp, the clients computing with the engine's own client half."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ..engine import Federation
from ..errors import ScenarioError
from ..protocols import get as get_protocol
from ..scenario import Scenario
from .layout import LOCAL_MEAN, LOCAL_VAR, LOSSES, PARTITION, Layout, _metric, _partition, _record, _state
from .strategy import RobustStrategy

def check_scenario(sc: Scenario) -> None:
    """One-line errors for what the Flower bridge does not run."""
    if sc.algorithm != "fedavg":
        raise ScenarioError("algorithm", f"{sc.algorithm!r}: robustbn flower runs FedAvg scenarios only "
                                         f"(a Flower round is local training, then aggregation)")
    if sc.participation != 1.0:
        raise ScenarioError("participation", f"{sc.participation}: robustbn flower trains every node every round "
                                             f"(participation = 1)")
    protocol = get_protocol(sc.norm)
    if protocol.exchanges_in_forward or protocol.union_batch:
        raise ScenarioError("norm", f"{sc.norm!r} does not map onto Flower rounds")
    if sc.root_size is not None:
        raise ScenarioError("root_size", "the server's root set (FLTrust) is not in the Flower bridge")
    if sc.partition == "feature-shift" or sc.augment:
        field = "partition" if sc.partition == "feature-shift" else "augment"
        raise ScenarioError(field, "per-client transforms draw from the engine's shared generator: not in the "
                                   "Flower bridge")


_CACHE: dict[str, Any] = {}


def _federation(sc: Scenario, fresh: bool = False) -> Federation:
    """This process's view of the scenario (its data, partitions and model: what a client
    computes with, on the per-client loop), built once per process and scenario (`fresh`: a
    new one, on the cached data)."""
    from ..data import load_dataset
    from ..runner import federation_parts
    from ..store import scenario_hash
    key = scenario_hash(sc.to_dict())
    if _CACHE.get("key") != key or fresh:
        data = _CACHE["data"] if _CACHE.get("data_key") == (sc.dataset, sc.data_dir, sc.device) else \
            load_dataset(sc.dataset, sc.data_dir, sc.device)
        fed = Federation(sc, data, federation_parts(sc, data.y_train.cpu().numpy()), vectorized=False)
        if fresh:
            return fed
        initial = {f"local:{k}": v.clone() for k, v in fed.local.items()}
        if fed.protocol.local_statistics:
            initial.update(local_mean=fed.local_mean.clone(), local_var=fed.local_var.clone())
        _CACHE.update(key=key, fed=fed, initial=initial, data=data, data_key=(sc.dataset, sc.data_dir, sc.device))
    return _CACHE["fed"]


def _restore(fed: Federation, pid: int, context: Context) -> None:
    """Client `pid`'s state between rounds, from its node's context.state (round 1: as the
    engine starts): the data generator, its local parameters and statistics."""
    saved = context.state.array_records.get("robustbn")
    if saved is None:
        fed.gen.manual_seed(fed.sc.seed)
        for k, v in _CACHE["initial"].items():
            target = fed.local[k.partition(":")[2]] if k.startswith("local:") else getattr(fed, k)
            target[pid] = v[pid]
        return
    mine = _state(saved)
    fed.gen.set_state(mine.pop("generator"))
    for k, v in mine.items():
        kind, _, name = k.partition(":")
        target = fed.local[name] if kind == "local" else getattr(fed, kind)
        target[pid] = v.to(fed.device)


def client_app(sc: Scenario) -> ClientApp:
    """The ClientApp of a scenario: node `partition-id` i computes client i's round with the
    engine's client half (`Federation.local_round(only=i)`: its own mini-batches, drawn by
    replaying the engine's one data generator, kept in the node's context.state between
    rounds). The Byzantine nodes compute only under label flipping (their rows of the engine);
    otherwise they reply what they received (SimulatedAttacks replaces their replies)."""
    app = ClientApp()
    values = sc.to_dict()

    def node(msg: Message, context: Context) -> tuple[Scenario, int, Federation, dict]:
        """(the scenario, this node's partition id, the process's Federation, the arrays received)."""
        torch.set_num_threads(1)
        scenario = Scenario.from_dict(values)
        return scenario, int(context.node_config[PARTITION]), _federation(scenario), _state(msg.content["arrays"])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        scenario, pid, fed, received = node(msg, context)
        if pid >= fed.h:  # a Byzantine node without data: its reply is replaced
            return Message(RecordDict({"arrays": ArrayRecord(received),
                                       "metrics": MetricRecord({PARTITION: pid, "num-examples": 0})}), reply_to=msg)
        layout = Layout(fed.model, fed.protocol)
        fed.t = int(msg.content["config"]["server-round"])
        fed.set_phase(fed.protocol.phase(fed.t))
        fed.theta = {k: received[k].to(fed.device) for k in fed.theta}
        if not fed.protocol.local_statistics and all(k in received for k in layout.means):
            fed.shared_mean, fed.shared_var = (s.to(fed.device) for s in layout.statistics(received))
        _restore(fed, pid, context)
        torch.manual_seed(scenario.seed * 1_000_003 + fed.t * 1009 + pid)  # dropout: this node's own draws
        theta, local, run_mean, run_var, stats, losses = fed.local_round(None, only=pid)
        reply = OrderedDict((k, v[0]) for k, v in theta.items())
        if stats is not None:
            for name, m, v in zip(fed.layer_names, stats[0][0].split(fed.channels_per_layer),
                                  stats[1][0].split(fed.channels_per_layer)):
                reply[f"{name}.running_mean"], reply[f"{name}.running_var"] = m, v
        keep = OrderedDict([("generator", fed.gen.get_state())])
        keep.update((f"local:{k}", v[0]) for k, v in local.items())
        if fed.protocol.local_statistics:
            keep["local_mean"], keep["local_var"] = run_mean[0], run_var[0]
        context.state["robustbn"] = _record(keep)
        metrics = MetricRecord({PARTITION: pid, "num-examples": scenario.batch_size * scenario.local_steps,
                                LOSSES: [float(l[0]) for l in losses]})
        return Message(RecordDict({"arrays": _record(reply), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """A personalized protocol's evaluation (FedBN): this client's model on its own test split."""
        scenario, pid, fed, received = node(msg, context)
        fed.theta = {k: received[k].to(fed.device) for k in fed.theta}
        _restore(fed, pid, context)
        fed.set_phase("eval")
        x, y = fed.client_test[0][pid], fed.client_test[1][pid]
        from torch.func import functional_call
        fed.model.eval()  # dropout off, as the engine evaluates
        try:
            with torch.no_grad():
                out = functional_call(fed.model, {**fed.theta, **{k: v[pid] for k, v in fed.local.items()},
                                                  **fed._buffers(fed.local_mean[pid], fed.local_var[pid])}, (x,))
        finally:
            fed.model.train()
        acc, loss = (out.argmax(1) == y).float().mean(), F.cross_entropy(out, y)
        metrics = MetricRecord({PARTITION: pid, "num-examples": len(y), "test_acc": float(acc), "test_loss": float(loss)})
        if pid == 0:  # a run's final statistics, where kept on the clients, are client 0's (runner.run's)
            metrics.update({LOCAL_MEAN: fed.local_mean[pid].tolist(), LOCAL_VAR: fed.local_var[pid].tolist()})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


class _Evaluations:
    """The engine's history from a Flower run: the evaluations every eval_every rounds (the
    server's, of the global model; FedBN's: the mean over the honest clients of their own),
    and the honest clients' training loss since the last one, summed as the engine sums it."""

    def __init__(self, sc: Scenario, fed: Federation, strategy: RobustStrategy):
        self.sc, self.fed, self.strategy = sc, fed, strategy
        self.history: list[dict] = []
        self.loss_sum = torch.zeros((), device=fed.device)
        self.loss_rounds = 0

    def due(self, t: int) -> bool:
        return t > 0 and (t % self.sc.eval_every == 0 or t == self.sc.rounds)

    def trained(self) -> None:
        if self.strategy.last_losses:
            losses = torch.tensor(self.strategy.last_losses, device=self.fed.device)  # (honest, steps)
            for step in losses.T:
                self.loss_sum += step.mean() / self.sc.local_steps
        self.loss_rounds += 1

    def record(self, t: int, acc: float, loss: float) -> None:
        from ..runner import filter_rates
        train_loss = (self.loss_sum / max(1, self.loss_rounds)).item()
        self.loss_sum, self.loss_rounds = torch.zeros((), device=self.fed.device), 0
        self.history.append({"round": t, "test_acc": acc, "test_loss": loss, "train_loss": train_loss,
                             **filter_rates(self.strategy.server, self.sc.f)})


def initial_arrays(fed: Federation) -> ArrayRecord:
    """The engine's initial global model as the ServerApp's first arrays: the weights and the
    shared statistics in the model's keys."""
    buffers = fed._buffers(fed.shared_mean, fed.shared_var)
    return ArrayRecord(OrderedDict((k, fed.theta[k] if k in fed.theta else buffers.get(k, v))
                                   for k, v in fed.model.state_dict().items()))


def server_app(sc: Scenario, out: dict) -> ServerApp:
    """The ServerApp of a scenario: the scenario's strategy (`RobustStrategy.from_scenario`,
    with the engine's model, initial weights and K), the engine's evaluation of the global
    model every eval_every rounds; the history and final statistics go into `out`."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        fed = _federation(sc, fresh=True)
        personalized = fed.protocol.personalized
        strategy = RobustStrategy.from_scenario(sc, model=fed.model, count=fed.count,
                                                fraction_evaluate=1.0 if personalized else 0.0,
                                                min_evaluate_nodes=sc.honest if personalized else 0)
        evaluations = _Evaluations(sc, fed, strategy)
        local_stats: list[torch.Tensor] = []  # client 0's own statistics at the last evaluation (fedbn, silobn)
        strategy_train = strategy.aggregate_train

        def aggregate_train(server_round, replies):
            result = strategy_train(server_round, replies)
            evaluations.trained()
            return result
        strategy.aggregate_train = aggregate_train
        if personalized:
            configure = strategy.configure_evaluate
            strategy.configure_evaluate = lambda r, *a: configure(r, *a) if evaluations.due(r) else []

            def aggregate_evaluate(server_round, replies):
                if not evaluations.due(server_round):  # Flower calls it every round, with no replies
                    return None
                honest = sorted((m for m in replies if not m.has_error() and _partition(m) < sc.honest),
                                key=_partition)
                acc = torch.tensor([_metric(m, "test_acc") for m in honest]).mean().item()
                loss = torch.tensor([_metric(m, "test_loss") for m in honest]).mean().item()
                evaluations.record(server_round, acc, loss)
                if honest and _metric(honest[0], LOCAL_MEAN) is not None:
                    local_stats[:] = [torch.tensor(_metric(honest[0], k)) for k in (LOCAL_MEAN, LOCAL_VAR)]
                return MetricRecord({"test_acc": acc, "test_loss": loss})
            strategy.aggregate_evaluate = aggregate_evaluate

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if personalized or not evaluations.due(server_round):
                return None
            state = _state(arrays)
            fed.theta = {k: state[k].to(fed.device) for k in fed.theta}
            if fed.layer_names and not fed.protocol.local_statistics:
                fed.shared_mean, fed.shared_var = (s.to(fed.device) for s in strategy.layout.statistics(state))
            acc, loss = fed.evaluate(subset=sc.eval_subset if server_round < sc.rounds else None)
            evaluations.record(server_round, acc.item(), loss.item())
            return MetricRecord({"test_acc": acc.item(), "test_loss": loss.item()})

        result = strategy.start(grid=grid, initial_arrays=initial_arrays(fed), num_rounds=sc.rounds,
                                evaluate_fn=evaluate)
        final = _state(result.arrays)
        mean, var = (strategy.layout.statistics(final) if fed.layer_names and not fed.protocol.local_statistics
                     else local_stats if local_stats else (fed.shared_mean, fed.shared_var))
        out["history"] = evaluations.history
        out["bn_stats"] = {name: {"mean": m.tolist(), "var": v.tolist()} for name, m, v in
                           zip(fed.layer_names, mean.split(fed.channels_per_layer), var.split(fed.channels_per_layer))}

    return app


@contextlib.contextmanager
def _quiet_flower(verbose: bool):
    """Flower logs every round at INFO (and run_simulation's deprecation): kept to warnings."""
    logger = logging.getLogger("flwr")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_scenario(sc: Scenario | dict, cpus: int | None = None, verbose: bool = False):
    """One FedAvg scenario as a Flower simulation (flwr.simulation.run_simulation: n nodes,
    one CPU and one torch thread each): a runner.Result like `robustbn run`'s."""
    from flwr.simulation import run_simulation

    from ..execute import ray_workers_at_normal_priority
    from ..runner import Result
    sc = (sc if isinstance(sc, Scenario) else Scenario.from_dict(sc)).validated()
    check_scenario(sc)
    start = time.perf_counter()
    out: dict = {}
    cpus = cpus or os.cpu_count() or 1
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "include_dashboard": False, "logging_level": logging.ERROR,
                             "log_to_driver": verbose}}
    threads, pythonpath = torch.get_num_threads(), os.environ.get("PYTHONPATH")
    torch.set_num_threads(1)
    try:
        with _quiet_flower(verbose), ray_workers_at_normal_priority():
            run_simulation(server_app(sc, out), client_app(sc), num_supernodes=sc.n, backend_config=backend,
                           verbose_logging=verbose)
    finally:
        torch.set_num_threads(threads)
        # Flower's Ray backend appends this process's sys.path to PYTHONPATH, run after run
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
    if "history" not in out:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return Result(sc.to_dict(), out["history"], out["bn_stats"], time.perf_counter() - start, str(sc.device),
                  {"engine": "flower"})
