"""The server: `RobustStrategy` (robustbn's per-channel robust aggregation as a Flower
strategy) and `SimulatedAttacks` (the omniscient attacks, simulated from the honest replies)."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from ..engine import Federation, _flat, _unflat
from ..errors import ScenarioError
from ..protocols import get as get_protocol
from ..protocols.base import Protocol
from ..scenario import Scenario
from .layout import (ATTACK_FIELDS, CONFIG_MOMENTUM, CONFIG_N, CONFIG_NORM, CONFIG_PHASE, LOSSES, PARTITION,
                     SERVER_FIELDS, Layout, _metric, _partition, _record, _state, _values_per_channel)

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
            from ..models import build_model
            from ..scenario import IMAGE_SHAPES
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
