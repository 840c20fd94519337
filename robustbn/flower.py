"""robustbn in Flower (flwr >= 1.42, Message API): per-channel robust aggregation with correct BN
handling as a Flower strategy, and any FedAvg scenario run as a Flower simulation.

- `RobustStrategy`: a `flwr.serverapp.strategy.FedAvg` whose `aggregate_train` splits every
  reply's ArrayRecord by key into robustbn's channels (the model update, the BN running means,
  the BN running variances; `num_batches_tracked` passed through), from the model and the norm
  protocol (its `is_local`, the BN layers), and runs the engine's own server step on them
  (`Federation.server_only(...)._exchange`: each channel's pipeline, the client filter, the
  protocol's `server_stats`). One implementation of each rule and protocol.
- `SimulatedAttacks`: a simulation of the threat model, not something a real client could do:
  the Byzantine nodes' replies are replaced by each channel's omniscient attack computed from
  the honest replies, as robustbn's engine does.
- `LabelFlipping`: a ClientApp train function wrapper: Byzantine nodes train on flipped labels.
- `ClientBN`: the client's half of the strategy's protocol on a user's plain torch model
  (fbn: normalize with the shared statistics, report Algorithm 2's; fedbn: BN kept in
  context.state).
- `run_scenario(sc)`: a robustbn FedAvg scenario as a Flower simulation (`robustbn flower`),
  the clients computing with the engine's own client half (`Federation.local_round`).

Nothing else in robustbn imports flwr: `pip install 'robustbn[flower]'`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning on CPU-only nodes

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from torch import nn  # noqa: E402

import attacks  # noqa: E402

from .channels import BN_CHANNEL_KEYS, NOT_ATTACKS  # noqa: E402
from .engine import Federation, _flat, _unflat  # noqa: E402
from .errors import ScenarioError  # noqa: E402
from .norm import FedBatchNorm  # noqa: E402
from .protocols import get as get_protocol  # noqa: E402
from .protocols.base import Protocol  # noqa: E402
from .scenario import Scenario  # noqa: E402

# the scenario fields the server reads: what RobustStrategy is built from
SERVER_FIELDS = ("norm", "n", "f", "agg_f", "grad_agg", "grad_agg_params", "bn_agg", "bn_agg_params",
                 *(k for k in BN_CHANNEL_KEYS if "_agg" in k), "client_filter", "client_filter_params",
                 "bn_momentum", "fixbn_switch", "hbn_lambda", "rounds", "seed", "device")
ATTACK_FIELDS = ("grad_attack", "grad_attack_params", "bn_attack", "bn_attack_params",
                 *(k for k in BN_CHANNEL_KEYS if "_attack" in k))
PARTITION = "partition-id"  # the reply metric (and node_config key) that orders the replies
LOSSES = "train-losses"     # the reply metric: the client's loss at each local step
LOCAL_MEAN, LOCAL_VAR = "local-mean", "local-var"  # client 0's evaluation metrics: its own BN statistics
# what RobustStrategy tells the clients in every train/evaluate config, for ClientBN
CONFIG_NORM, CONFIG_N, CONFIG_MOMENTUM, CONFIG_PHASE = "robustbn-norm", "robustbn-n", "robustbn-bn-momentum", \
    "robustbn-phase"
LOCAL_STATE = "robustbn-bn"  # ClientBN's context.state record: the keys the protocol keeps on the client


class Layout:
    """Which keys of a model's state_dict go to which channel under a norm protocol, read from
    the model (its parameters and BN layers) and the protocol (`is_local`, `local_statistics`),
    never from key names: `weights` (the update channel), `means` / `variances` (the BN
    running statistics, one key per BN layer), `counters` (num_batches_tracked: passed
    through), `local` (never leave the client)."""

    def __init__(self, model: nn.Module, protocol: Protocol):
        layers = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, (FedBatchNorm, nn.modules.batchnorm._BatchNorm))]
        for name, m in layers:
            if getattr(m, "running_mean", None) is None:
                raise ValueError(f"RobustStrategy: BN layer {name!r} keeps no running statistics "
                                 f"(track_running_stats=False): nothing for the BN channels to carry")
        self.layers = [name for name, _ in layers]
        self.widths = [m.running_mean.shape[0] for _, m in layers]
        params = [k for k, _ in model.named_parameters()]
        local_stats = protocol.local_statistics
        state = model.state_dict()
        stats = {f"{L}.{b}" for L in self.layers for b in ("running_mean", "running_var", "num_batches_tracked")}
        other = [k for k in state if k not in params and k not in stats]
        if other:
            raise ValueError(f"RobustStrategy: buffer {other[0]!r} is neither a parameter nor a BN layer's running "
                             f"statistics: no channel carries it")
        self.keys = list(state)
        self.weights = [k for k in params if not protocol.is_local(k, self.layers)]
        self.means = [f"{L}.running_mean" for L in self.layers]
        self.variances = [f"{L}.running_var" for L in self.layers]
        self.counters = [f"{L}.num_batches_tracked" for L in self.layers if f"{L}.num_batches_tracked" in state]
        self.shared = set(self.weights) | (set() if local_stats else {*self.means, *self.variances, *self.counters})
        self.local = [k for k in self.keys if k not in self.shared]

    def check(self, state: dict, where: str, need: Iterable[str]) -> None:
        """One-line errors for a record whose keys are not the model's, or lack `need`."""
        unknown = [k for k in state if k not in self.keys]
        if unknown:
            raise ValueError(f"RobustStrategy: {where}: key {unknown[0]!r} is not in the model's state_dict")
        missing = [k for k in need if k not in state]
        if missing:
            raise ValueError(f"RobustStrategy: {where}: key {missing[0]!r} is missing")

    def statistics(self, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(C,) running means and variances of every BN layer, flat in layer order."""
        return torch.cat([state[k].reshape(-1) for k in self.means]), torch.cat([state[k].reshape(-1) for k in self.variances])


def _values_per_channel(model: nn.Module, layout: Layout, example_input: torch.Tensor) -> torch.Tensor:
    """K per BN channel (values a BN layer normalizes per channel in one client's batch), by
    one forward of a copy of the model in training mode (the model itself is not touched)."""
    import copy
    model = copy.deepcopy(model).train()
    seen: dict[str, int] = {}
    modules = dict(model.named_modules())
    hooks = [modules[L].register_forward_pre_hook(lambda m, a, L=L: seen.__setitem__(L, a[0].numel() // a[0].shape[1]))
             for L in layout.layers]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        model(example_input)
    for h in hooks:
        h.remove()
    return torch.cat([torch.full((w,), float(seen[L])) for L, w in zip(layout.layers, layout.widths)])


def _state(record: ArrayRecord) -> "OrderedDict[str, torch.Tensor]":
    return record.to_torch_state_dict()


def _record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord(OrderedDict((k, v.detach().cpu().contiguous()) for k, v in tensors.items()))


class RobustStrategy(FedAvg):
    """FedAvg's Message-API strategy with robustbn's server: every reply's ArrayRecord split
    into channels by key (`Layout`), each channel aggregated by its robustbn pipeline, the BN
    statistics combined by the norm protocol's server hook. Built from a scenario's server
    fields (norm, n, f, agg_f, grad_agg, bn_mean_agg, bn_var_agg, bn_agg, their *_params,
    client_filter, bn_momentum, seed, ...): bad ones are one-line ScenarioErrors.

    model: the model the clients train (its keys and BN layers; a plain torch model with
    nn.BatchNorm2d works, its clients running `ClientBN` around their training: the strategy
    sends the protocol in every train and evaluate config). The update channel carries model
    deltas: reply weights minus the weights this strategy sent.
    example_input: one client's training batch, for the protocols whose server update needs
    K, the values per BN channel of a client's batch (fbn, hbn); `count` gives K directly.
    The rest of the keywords go to FedAvg (fraction_train defaults to 1: every node, every
    round; min_train_nodes and min_available_nodes to n).
    """

    simulated = False  # SimulatedAttacks: the Byzantine nodes' replies replaced by attacks

    def __init__(self, model: nn.Module, *, example_input: torch.Tensor | None = None,
                 count: torch.Tensor | None = None, **kwargs):
        fedavg = set(inspect.signature(FedAvg.__init__).parameters) - {"self"}
        allowed = SERVER_FIELDS + (ATTACK_FIELDS if self.simulated else ())
        for key in kwargs:
            if key in ATTACK_FIELDS and not self.simulated:
                raise ScenarioError(key, "an omniscient attack is simulated by SimulatedAttacks(strategy, ...) "
                                         "(a simulation of the threat model), not set on RobustStrategy")
            if key not in fedavg and key not in allowed:
                raise ScenarioError(key, f"not a field RobustStrategy takes; allowed: {', '.join(allowed)} "
                                         f"and FedAvg's own ({', '.join(sorted(fedavg))})")
        fields = {k: v for k, v in kwargs.items() if k in allowed}
        if "n" not in fields:
            raise ScenarioError("n", "required: the number of clients that reply each round")
        fields.setdefault("norm", "naive")
        protocol_class = get_protocol(fields["norm"]) if isinstance(fields["norm"], str) else None
        if protocol_class is not None and (protocol_class.exchanges_in_forward or protocol_class.union_batch):
            why = "exchanges statistics inside every forward pass" if protocol_class.exchanges_in_forward else \
                "is one client holding the union of the batches"
            raise ScenarioError("norm", f"{fields['norm']!r} {why}: it does not map onto Flower rounds")
        self.fields, self.model, self.example_input = dict(fields), model, example_input
        if not self.simulated:  # every reply is a message; the pipelines are built for f of them Byzantine
            fields = {**fields, "f": 0, "agg_f": fields.get("agg_f", fields.get("f", 0))}
        self.sc = Scenario.from_dict({"algorithm": "fedavg", **fields})
        if any(self.sc.needs_reference(c) for c in ("grad", "bn_mean", "bn_var")):
            raise ScenarioError("grad_agg", "a pipeline that needs the server's root set (FLTrust) is not in the "
                                            "Flower bridge")
        self.protocol = get_protocol(self.sc.norm).for_scenario(self.sc)
        self.layout = Layout(model, self.protocol)
        if count is None:
            uses_count = type(self.protocol).server_update is not Protocol.server_update
            if example_input is not None:
                count = _values_per_channel(model, self.layout, example_input)
            elif uses_count and self.layout.layers:
                raise ScenarioError("example_input", f"norm {self.sc.norm!r} needs K, the values per BN channel of "
                                                     f"one client's batch: give a batch as a client trains on")
            else:  # a server update that never reads K
                count = torch.ones(sum(self.layout.widths))
        self.count = count
        self.server = Federation.server_only(self.sc, self.layout.widths, count)
        fedavg_kwargs = {"fraction_train": 1.0, "min_train_nodes": self.sc.n, "min_available_nodes": self.sc.n,
                         **{k: v for k, v in kwargs.items() if k in fedavg}}
        self.fedavg_kwargs = fedavg_kwargs
        super().__init__(**fedavg_kwargs)
        self._global: OrderedDict[str, torch.Tensor] | None = None
        self.last_losses: list[list[float]] = []  # the honest replies' per-step losses, last round

    @classmethod
    def from_scenario(cls, sc: Scenario, model: nn.Module | None = None, count: torch.Tensor | None = None,
                      example_input: torch.Tensor | None = None, **fedavg) -> "RobustStrategy":
        """The strategy of a robustbn scenario's server; a scenario with attacks gives the
        `SimulatedAttacks` of it. `model`: robustbn's model of the scenario by default."""
        sc = sc if isinstance(sc, Scenario) else Scenario.from_dict(sc)
        if model is None:
            from .models import build_model
            from .scenario import IMAGE_SHAPES
            channels, side, classes = IMAGE_SHAPES[sc.dataset]
            model = build_model(sc.model, get_protocol(sc.norm).for_scenario(sc), channels, side, classes,
                                sc.gn_groups, sc.dropout)
            if count is None and example_input is None:
                example_input = torch.zeros(sc.batch_size, channels, side, side)
        values = sc.to_dict()
        server = {k: values[k] for k in SERVER_FIELDS if k in values}
        attack = {k: values[k] for k in ATTACK_FIELDS if k in values and values[k] is not None}
        strategy = cls(model, example_input=example_input, count=count, **server, **fedavg)
        if sc.f > 0:  # Byzantine nodes: their replies are the engine's (none, an attack, label flipping)
            return SimulatedAttacks(strategy, **attack)
        return strategy

    # ---- the Flower hooks ---------------------------------------------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.sent(arrays)
        config.update(self.client_config(server_round))
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        config.update(self.client_config(server_round))
        return super().configure_evaluate(server_round, arrays, config, grid)

    def client_config(self, server_round: int) -> dict:
        """What a client's ClientBN needs of the protocol: its name, n, the momentum and the
        round's phase (FixBN: "frozen" after its switch)."""
        return {CONFIG_NORM: self.sc.norm, CONFIG_N: self.sc.n, CONFIG_MOMENTUM: float(self.sc.bn_momentum),
                CONFIG_PHASE: self.protocol.phase(server_round)}

    def sent(self, arrays: ArrayRecord) -> None:
        """The global arrays of this round: the updates are computed from them; the shared
        statistics are theirs."""
        self._global = _state(arrays)
        self.layout.check(self._global, "the global arrays", self.layout.weights)
        if all(k in self._global for k in (*self.layout.means, *self.layout.variances)) and \
                not self.protocol.local_statistics:
            mean, var = self.layout.statistics(self._global)
            self.server.shared_mean, self.server.shared_var = mean.to(self.server.device), var.to(self.server.device)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        if not valid:
            return None, None
        if self._global is None:
            raise ValueError("RobustStrategy: aggregate_train before configure_train: no global arrays to "
                             "compute the updates from")
        valid.sort(key=_partition)
        honest = [m for m in valid if not self.simulated or _partition(m) < self.sc.honest]
        byzantine = [m for m in valid if self.simulated and _partition(m) >= self.sc.honest] \
            if self.server.byzantine_rows else []
        messages = honest + byzantine
        sends = bool(self.layout.layers) and self.protocol.sends(server_round) and not self.protocol.local_statistics
        need = self.layout.weights + (self.layout.means + self.layout.variances if sends else [])
        states = []
        for m in messages:
            records = list(m.content.array_records.values())
            if len(records) != 1:
                raise ValueError(f"RobustStrategy: the reply of node {m.metadata.src_node_id} has "
                                 f"{len(records)} ArrayRecords; one expected")
            state = _state(records[0])
            self.layout.check(state, f"the reply of node {m.metadata.src_node_id}", need)
            states.append(state)
        g = self._global
        weights = {k: g[k].to(self.server.device) for k in self.layout.weights}
        rows = {k: torch.stack([s[k].to(weights[k]) for s in states]) for k in self.layout.weights}
        deltas = _flat(rows, 1) - _flat(weights, 0)
        stats = None
        if sends:
            pairs = [self.layout.statistics(s) for s in states]
            stats = (torch.stack([p[0] for p in pairs]).to(self.server.shared_mean),
                     torch.stack([p[1] for p in pairs]).to(self.server.shared_var))
        update = torch.nan_to_num(self.server._exchange(deltas, stats, len(honest)), nan=0.0, posinf=0.0, neginf=0.0)
        new = _unflat(_flat(weights, 0) + update, weights, 0)
        out = OrderedDict()
        shared = dict(zip(self.layout.means + self.layout.variances,
                          [*self.server.shared_mean.split(self.layout.widths),
                           *self.server.shared_var.split(self.layout.widths)]))
        for k in self.layout.keys:
            if k in new:
                out[k] = new[k]
            elif k in shared and k in self.layout.shared:
                out[k] = shared[k]
            elif k in self.layout.counters and k in self.layout.shared and k in g:
                out[k] = g[k]  # passed through as sent: a counter, never averaged
        self.last_losses = [list(m.content.metric_records[next(iter(m.content.metric_records))][LOSSES])
                            for m in honest if _metric(m, LOSSES) is not None]
        if self.last_losses:
            metrics = MetricRecord({"train_loss": float(torch.tensor(self.last_losses).mean())})
        elif honest and all(_metric(m, self.weighted_by_key) is not None for m in honest):
            # a user's own metrics, as FedAvg aggregates them (the forged replies' left out)
            metrics = self.train_metrics_aggr_fn([m.content for m in honest], self.weighted_by_key)
            metrics.pop(PARTITION, None)  # an identity, not a metric
        else:
            metrics = None
        return _record(out), metrics


def _metric(message: Message, key: str):
    for record in message.content.metric_records.values():
        if key in record:
            return record[key]
    return None


def _partition(message: Message) -> int:
    """A reply's partition id (the metric `partition-id`), else its node id: replies are taken
    in this order, whatever order they arrived in."""
    pid = _metric(message, PARTITION)
    return int(pid) if pid is not None else int(message.metadata.src_node_id)


class SimulatedAttacks(RobustStrategy):
    """Simulation of the threat model (not something real clients could do): the nodes of
    partition ids n - f ... n - 1 are Byzantine; their replies are dropped and each channel's
    omniscient attack (sf, alie, minmax, the BN-channel attacks, ...: the scenario's *_attack
    fields) forges the f Byzantine messages from the honest replies, per channel, with the
    engine's own server step. Under label flipping (an attack that holds data) the Byzantine
    replies are kept: they trained on flipped labels (`LabelFlipping`)."""

    simulated = True

    def __init__(self, strategy: RobustStrategy, **attack_fields):
        for key in attack_fields:
            if key not in ATTACK_FIELDS:
                raise ScenarioError(key, f"not an attack field; allowed: {', '.join(ATTACK_FIELDS)}")
        super().__init__(strategy.model, example_input=strategy.example_input, count=strategy.count,
                         **strategy.fields, **attack_fields,
                         **{k: v for k, v in strategy.fedavg_kwargs.items()})


class LabelFlipping:
    """A ClientApp train function wrapper (data attack): on a Byzantine node (`byzantine(context)`,
    by default partition ids n - f ... n - 1 of the node_config's num-partitions and the given
    f) every cross-entropy the train function computes sees the labels y flipped to C - 1 - y
    (`attacks` labelflip). Honest nodes run the function unchanged."""

    def __init__(self, train: Callable[[Message, Context], Message], f: int, num_classes: int,
                 byzantine: Callable[[Context], bool] | None = None):
        self.train, self.f, self.num_classes = train, f, num_classes
        self.byzantine = byzantine or (lambda ctx: int(ctx.node_config[PARTITION])
                                       >= int(ctx.node_config["num-partitions"]) - f)

    def __call__(self, msg: Message, context: Context) -> Message:
        if not self.byzantine(context):
            return self.train(msg, context)
        with flipped_labels(self.num_classes):
            return self.train(msg, context)


@contextlib.contextmanager
def flipped_labels(num_classes: int):
    """Within the block, torch's cross-entropy (F.cross_entropy, nn.CrossEntropyLoss) flips
    its integer targets y to C - 1 - y."""
    original = F.cross_entropy
    flip = attacks.build("labelflip").flip

    def flipped(input, target, *args, **kwargs):
        if isinstance(target, torch.Tensor) and not target.is_floating_point():
            target = flip(target, num_classes)
        return original(input, target, *args, **kwargs)
    F.cross_entropy = flipped
    try:
        yield
    finally:
        F.cross_entropy = original


# ---- the client's half of the protocol, on a user's plain torch model ------------------------------

def _plain_layer_protocol(cls: type[Protocol]) -> bool:
    """Whether a protocol runs on torch's own BN layers: no extra parameters (HBN's alpha),
    evaluation as torch's BN in eval mode (not scale-only FBN's), a report that follows every
    step, nothing pooled inside the forward pass."""
    return (cls.uses_bn and not cls.exchanges_in_forward and not cls.union_batch and cls.report_each_step
            and cls.init_layer is Protocol.init_layer and cls.normalize_with_running is Protocol.normalize_with_running)


class ClientBN:
    """A Flower client's half of RobustStrategy's norm protocol, on the client's own torch model
    (nn.BatchNorm1d/2d/3d layers with running statistics):

        bn = ClientBN(model, msg, context)  # the global arrays, and this node's own BN state, loaded
        with bn:                            # the BN layers normalize and report as the protocol says
            train(model, loader)            # the client's own loop, one forward per step
        reply = bn.arrays()                 # what the protocol sends (fedbn: no BN keys)

    The strategy's config in `msg` names the protocol, n, the momentum b and the round's
    phase. Within the block a BN layer in training mode normalizes with the protocol's
    `normalize` (fbn: the shared statistics the server sent, as constants; naive, fixbn's
    first stage, fedbn, silobn: the batch's own), and each forward updates this client's report
    with the protocol's `client_report` (fbn, seed 002 Algorithm 2 lines 5-6: mean (1-b) mu + b
    mean_batch, variance (1-b) var + b Kn/(Kn-1) var_batch, K the values per channel of the
    batch); b is the strategy's bn_momentum, not the layer's own. The running buffers hold what
    the server sent until the block ends, then the report. FixBN after its switch: the layers
    normalize with the frozen statistics and report nothing. Keys the protocol keeps on the
    client (fedbn: the BN weights and statistics; silobn: the statistics) live in
    `context.state` between rounds. Protocols that need robustbn's own layers (hbn, fbn-scale,
    fedtan) are refused with a one-line error naming `norm`.
    """

    def __init__(self, model: nn.Module, msg: Message, context: Context | None = None):
        config = next((c for c in msg.content.config_records.values() if CONFIG_NORM in c), None)
        if config is None:
            raise ValueError(f"ClientBN: the message's config has no {CONFIG_NORM!r}: the server's strategy is not a "
                             f"robustbn.flower.RobustStrategy")
        norm = str(config[CONFIG_NORM])
        cls = get_protocol(norm)
        if not _plain_layer_protocol(cls):
            from .protocols import PROTOCOLS
            plain = ", ".join(n for n, c in PROTOCOLS.items() if _plain_layer_protocol(c))
            raise ScenarioError("norm", f"{norm!r} needs robustbn's own BN layers (robustbn.models); on a plain torch "
                                        f"model ClientBN runs {plain}")
        self.model, self.context, self.protocol = model, context, cls()
        self.n, self.beta = int(config[CONFIG_N]), float(config[CONFIG_MOMENTUM])
        self.phase = str(config.get(CONFIG_PHASE, "train"))
        self.layout = Layout(model, self.protocol)
        records = list(msg.content.array_records.values())
        if len(records) != 1:
            raise ValueError(f"ClientBN: the message has {len(records)} ArrayRecords; one expected")
        received = _state(records[0])
        self.layout.check(received, "the received arrays", self.layout.weights)
        saved = context.state.array_records.get(LOCAL_STATE) if context is not None else None
        if self.layout.local and context is None:
            raise ValueError(f"ClientBN: norm {norm!r} keeps {self.layout.local[0]!r} on the client between rounds: "
                             f"pass the ClientApp's context")
        if saved is not None:  # this client's own: never the server's
            received = OrderedDict((k, v) for k, v in received.items() if k not in self.layout.local)
            received.update(_state(saved))
        model.load_state_dict(received, strict=False)
        modules = dict(model.named_modules())
        self.layers = {name: modules[name] for name in self.layout.layers}
        self.report: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __enter__(self) -> "ClientBN":
        self.report = {name: (m.running_mean.detach().clone(), m.running_var.detach().clone())
                       for name, m in self.layers.items()}
        for name, layer in self.layers.items():
            layer.forward = self._forward(name, layer)
        return self

    def __exit__(self, *exc) -> None:
        for name, layer in self.layers.items():
            del layer.forward  # the class's own again
            if self.phase == "train":
                with torch.no_grad():
                    layer.running_mean.copy_(self.report[name][0])
                    layer.running_var.copy_(self.report[name][1])
        if self.context is not None and self.layout.local:
            state = self.model.state_dict()
            self.context.state[LOCAL_STATE] = _record({k: state[k] for k in self.layout.local})

    def _forward(self, name: str, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if hasattr(layer, "_check_input_dim"):
                layer._check_input_dim(x)
            if not layer.training or self.phase != "train":
                return self.protocol.normalize_with_running(layer, x)
            out, batch_mean, batch_var = self.protocol.normalize(layer, x)
            count = float(x.numel() // x.shape[1])
            self.report[name] = self.protocol.client_report(*self.report[name], batch_mean, batch_var, count, self.n,
                                                            self.beta)
            if getattr(layer, "num_batches_tracked", None) is not None:
                layer.num_batches_tracked.add_(1)
            return out
        return forward

    def arrays(self) -> ArrayRecord:
        """The model's keys that this protocol sends the server (the report in the running
        buffers; fedbn: no BN keys), as the reply's ArrayRecord."""
        state = self.model.state_dict()
        return _record(OrderedDict((k, v) for k, v in state.items() if k in self.layout.shared))


# ---- a robustbn scenario as a Flower simulation ----------------------------------------------------

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
    from .data import load_dataset
    from .runner import federation_parts
    from .store import scenario_hash
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
        from .runner import filter_rates
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
            acc, loss = fed.evaluate()
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

    from .runner import Result
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
        with _quiet_flower(verbose):
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
