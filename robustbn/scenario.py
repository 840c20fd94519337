"""A scenario: one fully specified run, validated before anything runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import aggregators
import attacks

from .data import DATASETS, PARTITIONS
from .models import MODELS
from .norm import NO_BN_MODES, MODES

ALGORITHMS = ("dsgd", "fedavg")


class ScenarioError(ValueError):
    """A bad scenario value; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class Scenario:
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    partition: str = "gamma"
    gamma: float = 0.0              # gamma partition: fraction shared iid (0 = extreme non-iid)
    alpha: float = 0.5              # dirichlet partition concentration
    shards: int = 2                 # shards partition: shards (about classes) per client
    augment: bool | None = None     # random crop + flip on the device; None = on for cifar10 only
    model: str = "simple-cnn"
    dropout: float = 0.25           # Table-1 CNN only
    norm: str = "fbn"
    gn_groups: int = 2
    bn_momentum: float = 0.1        # beta: running-statistics momentum
    fixbn_switch: int | None = None  # FixBN's T*; None = half the rounds
    hbn_lambda: float = 0.01        # HBN's EMA of global statistics
    algorithm: str = "dsgd"
    n: int = 10
    f: int = 0
    rounds: int = 100
    batch_size: int = 50
    lr: float = 0.1
    lr_milestones: list = field(default_factory=list)  # [[round, lr], ...]: lr from that round on
    momentum: float = 0.0           # DSGD: worker momentum m <- mu m + (1 - mu) g; FedAvg: local SGD momentum
    weight_decay: float = 0.0
    local_steps: int = 1            # FedAvg only
    participation: float = 1.0      # FedAvg: fraction of honest clients per round
    grad_attack: str = "none"
    bn_attack: str = "none"
    grad_attack_params: dict = field(default_factory=dict)
    bn_attack_params: dict = field(default_factory=dict)
    grad_agg: str = "mean"
    bn_agg: str = "mean"
    grad_agg_params: dict = field(default_factory=dict)
    bn_agg_params: dict = field(default_factory=dict)
    eval_every: int = 10
    seed: int = 0
    device: str = "cpu"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Scenario":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ScenarioError(unknown[0], f"unknown field; allowed: {', '.join(sorted(known))}")
        return cls(**values).validated()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def honest(self) -> int:
        return self.n - self.f

    @property
    def switch_round(self) -> int:
        return self.rounds // 2 if self.fixbn_switch is None else self.fixbn_switch

    def lr_at(self, t: int) -> float:
        lr = self.lr
        for start, value in sorted(self.lr_milestones):
            if t >= start:
                lr = value
        return lr

    def validated(self) -> "Scenario":
        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                raise ScenarioError(name, f"{getattr(self, name)!r} is not allowed; allowed: {', '.join(allowed)}")

        def integer(name, low, high=None):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                bound = f">= {low}" + (f" and <= {high}" if high is not None else "")
                raise ScenarioError(name, f"must be an integer {bound}, got {v!r}")

        def number(name, low, high, low_open=False, high_open=False):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            ok = ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
            if not ok:
                raise ScenarioError(name, f"must be a number in {'(' if low_open else '['}{low}, {high}"
                                          f"{')' if high_open else ']'}, got {v!r}")

        choice("dataset", DATASETS)
        choice("partition", PARTITIONS)
        choice("model", MODELS)
        choice("norm", MODES)
        choice("algorithm", ALGORITHMS)
        number("gamma", 0, 1)
        number("alpha", 0, float("inf"), low_open=True, high_open=True)
        number("dropout", 0, 1, high_open=True)
        number("bn_momentum", 0, 1, low_open=True)
        number("hbn_lambda", 0, 1, low_open=True)
        integer("gn_groups", 1)
        integer("shards", 1)
        if self.augment not in (None, True, False):
            raise ScenarioError("augment", f"must be true, false or absent (on for cifar10 only), got {self.augment!r}")
        integer("n", 1)
        integer("f", 0)
        integer("rounds", 1)
        integer("batch_size", 1 if self.norm in NO_BN_MODES else 2)
        integer("local_steps", 1)
        integer("eval_every", 1)
        integer("seed", 0)
        number("lr", 0, float("inf"), low_open=True, high_open=True)
        number("momentum", 0, 1, high_open=True)
        number("weight_decay", 0, float("inf"), high_open=True)
        number("participation", 0, 1, low_open=True)
        if self.fixbn_switch is not None:
            integer("fixbn_switch", 0, self.rounds)
        if not isinstance(self.lr_milestones, list) or not all(
                isinstance(m, (list, tuple)) and len(m) == 2 and isinstance(m[0], int) and m[1] > 0
                for m in self.lr_milestones):
            raise ScenarioError("lr_milestones", f"must be a list of [round, lr] pairs with lr > 0, got {self.lr_milestones!r}")
        if self.f >= self.n:
            raise ScenarioError("f", f"must be < n = {self.n} (at least one honest client), got {self.f}")
        if self.algorithm == "dsgd" and self.local_steps != 1:
            raise ScenarioError("local_steps", "DSGD takes one step per round; use algorithm = 'fedavg' for local steps")
        if self.algorithm == "dsgd" and self.participation != 1.0:
            raise ScenarioError("participation", "partial participation is for algorithm = 'fedavg'")
        if self.norm == "central" and self.f != 0:
            raise ScenarioError("f", "norm = 'central' is the attack-free reference: it admits f = 0 only")
        if self.norm in ("fedbn", *NO_BN_MODES) and self.bn_attack != "none":
            raise ScenarioError("bn_attack", f"norm = {self.norm!r} sends no BN statistics; allowed: 'none'")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ScenarioError("device", f"allowed: 'cpu', 'cuda', 'cuda:N'; got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                raise ScenarioError("device", "CUDA is not available on this machine; use device = 'cpu'")
        for channel in ("grad", "bn"):
            name, params = getattr(self, f"{channel}_attack"), getattr(self, f"{channel}_attack_params")
            if name != "none" and self.f == 0:
                raise ScenarioError(f"{channel}_attack", f"{name!r} needs f >= 1 Byzantine clients (f = 0); use 'none'")
            try:
                # line-searched attacks get their pipeline from the engine; a stand-in checks the rest
                extra = {"pipeline": len} if isinstance(name, str) and name.startswith("opt-") else {}
                attacks.build(name, **params, **extra)
            except (ValueError, TypeError) as e:
                raise ScenarioError(f"{channel}_attack", str(e)) from None
            spec, params = getattr(self, f"{channel}_agg"), getattr(self, f"{channel}_agg_params")
            # without an attack on the channel, the Byzantine clients send nothing on it
            received = self.n if name != "none" else self.n - self.f
            try:
                aggregators.build(spec, f=self.f, n=received, **params)
            except (ValueError, TypeError) as e:
                why = (f" (with {channel}_attack = 'none' the Byzantine clients send nothing on this channel: "
                       f"the server receives n - f = {received} messages)") if received != self.n else ""
                raise ScenarioError(f"{channel}_agg", f"{e}{why}") from None
        return self
