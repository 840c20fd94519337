"""The server: `RobustStrategy` (robustbn's per-channel robust aggregation as a Flower
strategy) and `SimulatedAttacks` (the omniscient attacks, simulated from the honest replies)."""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from logging import WARNING
from typing import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from ..channels import BN_CHANNELS
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

    The BN channels follow `grad_agg` (and its params) unless `bn_agg`, `bn_mean_agg` or
    `bn_var_agg` is given: replacing FedMedian by `grad_agg="median"` keeps the statistics
    robust too. A model without BN layers runs under naive, gn, none and fedwon. A reply
    that cannot be one of the model's states (not one ArrayRecord; a key missing or not the
    model's; a shape or dtype not the model's; NaN or inf) is left out with one warning line,
    and the round aggregates the others (pipelines built for as many messages); a
    num_batches_tracked advances by the lower median of the increments the kept honest
    replies carry (never below the count sent).
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
        if not any(fields.get(k) is not None for k in ("bn_agg", *(f"{c}_agg" for c in BN_CHANNELS))):
            # the BN channels as robust as the updates unless told otherwise
            fields["bn_agg"] = fields.get("grad_agg", "mean")
            fields["bn_agg_params"] = fields.get("grad_agg_params") or {}
        self.fields, self.model, self.example_input = dict(fields), model, example_input
        if not self.simulated:  # every reply is a message; the pipelines are built for f of them Byzantine
            fields = {**fields, "f": 0, "agg_f": fields.get("agg_f", fields.get("f", 0))}
        self.sc = Scenario.from_dict({"algorithm": "fedavg", **fields})
        if any(self.sc.needs_reference(c) for c in ("grad", "bn_mean", "bn_var")):
            raise ScenarioError("grad_agg", "a pipeline that needs the server's root set (FLTrust) is not in the "
                                            "Flower bridge")
        self.protocol = get_protocol(self.sc.norm).for_scenario(self.sc)
        self.layout = Layout(model, self.protocol)
        _check_norm_fits_model(self.sc.norm, type(self.protocol), self.layout)
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
        server = {k: values[k] for k in SERVER_FIELDS if k in values and not k.startswith("bn_agg")}
        for channel in BN_CHANNELS:  # spelled out: the engine's mean where the scenario names none
            server[f"{channel}_agg"], server[f"{channel}_agg_params"] = (sc.value_of(channel, part)
                                                                         for part in ("agg", "agg_params"))
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
        sends = bool(self.layout.layers) and self.protocol.sends(server_round) and not self.protocol.local_statistics
        need = self.layout.weights + (self.layout.means + self.layout.variances if sends else [])
        kept = []
        for m in valid:
            state = self._reply_state(m, need)
            if isinstance(state, str):
                log(WARNING, "RobustStrategy: round %s: the reply of node %s is left out: %s", server_round,
                    m.metadata.src_node_id, state)
            else:
                kept.append((m, state))
        honest = [(m, s) for m, s in kept if not self.simulated or _partition(m) < self.sc.honest]
        byzantine = [(m, s) for m, s in kept if self.simulated and _partition(m) >= self.sc.honest] \
            if self.server.byzantine_rows else []
        if not honest:
            log(WARNING, "RobustStrategy: round %s: no reply to aggregate: the global model stays", server_round)
            return None, None
        states = [s for _, s in honest + byzantine]
        if not self.simulated and len(states) < self.sc.n:
            log(WARNING, "RobustStrategy: round %s: aggregating %s replies of n = %s (the others lost or left out)",
                server_round, len(states), self.sc.n)
        g = self._global
        weights = {k: g[k].to(self.server.device) for k in self.layout.weights}
        rows = {k: torch.stack([s[k].to(weights[k]) for s in states]) for k in self.layout.weights}
        deltas = _flat(rows, 1) - _flat(weights, 0)
        stats = None
        if sends:
            pairs = [self.layout.statistics(s) for s in states]
            stats = (torch.stack([p[0] for p in pairs]).to(self.server.shared_mean),
                     torch.stack([p[1] for p in pairs]).to(self.server.shared_var))
        try:
            with self._pipelines_for(len(honest), len(byzantine)):
                update = self.server._exchange(deltas, stats, len(honest))
        except ValueError as e:  # a rule that cannot run on this few messages
            log(WARNING, "RobustStrategy: round %s: %s replies kept: %s; the global model stays", server_round,
                len(states), e)
            return None, None
        new = _unflat(_flat(weights, 0) + torch.nan_to_num(update, nan=0.0, posinf=0.0, neginf=0.0), weights, 0)
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
                out[k] = _counter(g[k], [s[k] for _, s in honest if k in s])
        return _record(out), self._train_metrics([m for m, _ in honest])

    def _reply_state(self, message: Message, need: list[str]) -> "OrderedDict[str, torch.Tensor] | str":
        """The reply's state, or why it cannot be one of the model's states."""
        records = list(message.content.array_records.values())
        if len(records) != 1:
            return f"{len(records)} ArrayRecords, one expected"
        try:
            state = _state(records[0])
        except Exception as e:  # whatever a hostile record holds: never the server's crash
            return f"its ArrayRecord is not a torch state ({type(e).__name__}: {e})".replace("\n", " ")
        return self.layout.problem(state, need) or state

    @contextlib.contextmanager
    def _pipelines_for(self, k: int, b: int):
        """Each channel's pipeline for the messages it gets this round (k honest replies, b
        Byzantine rows, the forged ones): the pipelines built for n unless replies were lost."""
        channels = (self.server.grad_channel, self.server.mean_channel, self.server.var_channel)
        built = [c.pipeline for c in channels]
        wanted = [c.pipeline_for(k + (b if c.holds_data else c.f if c.sends else 0), self.sc.n) for c in channels]
        for c, p in zip(channels, wanted):
            c.pipeline = p
        try:
            yield
        finally:
            for c, p in zip(channels, built):
                c.pipeline = p

    def _train_metrics(self, honest: list[Message]) -> MetricRecord | None:
        """The honest replies' training loss (robustbn's clients), else their own metrics as
        FedAvg aggregates them (the forged replies' left out). A reply's metrics are the
        client's: ones that cannot be aggregated are logged, never the server's crash."""
        try:
            self.last_losses = [list(_metric(m, LOSSES)) for m in honest if _metric(m, LOSSES) is not None]
            if self.last_losses:
                return MetricRecord({"train_loss": float(torch.tensor(self.last_losses).mean())})
            if honest and all(_metric(m, self.weighted_by_key) is not None for m in honest):
                metrics = self.train_metrics_aggr_fn([m.content for m in honest], self.weighted_by_key)
                metrics.pop(PARTITION, None)  # an identity, not a metric
                return metrics
        except Exception as e:
            self.last_losses = []
            log(WARNING, "RobustStrategy: the replies' metrics are not aggregated: %s", e)
        return None


def _counter(sent: torch.Tensor, replies: list[torch.Tensor]) -> torch.Tensor:
    """num_batches_tracked after a round: the count sent plus the lower median of the replies'
    increments (one client's huge or negative count cannot move it), never below what was sent."""
    if not replies:
        return sent
    steps = torch.stack([r.reshape(()).to(torch.int64) - sent.to(torch.int64) for r in replies]).sort().values
    return (sent.to(torch.int64) + steps[(len(steps) - 1) // 2].clamp(min=0)).reshape(sent.shape)


def _check_norm_fits_model(norm: str, protocol: type[Protocol], layout: Layout) -> None:
    """A model without BN layers runs under naive and the protocols without BN; a BN protocol
    needs BN layers, and a protocol without BN a model without them."""
    from ..protocols import PROTOCOLS
    if not layout.layers and protocol.uses_bn and norm != "naive":
        plain = ", ".join(["naive", *(n for n, c in PROTOCOLS.items() if not c.uses_bn)])
        raise ScenarioError("norm", f"{norm!r} needs BN layers and the model has none; a model without BN runs "
                                    f"under {plain}")
    if layout.layers and not protocol.uses_bn:
        raise ScenarioError("norm", f"{norm!r} is for models without BN layers; the model has BN layer "
                                    f"{layout.layers[0]!r}")


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
