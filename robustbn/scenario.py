"""A scenario: one fully specified run, validated before anything runs."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import aggregators
import attacks
from aggregators.checks import MAX_ITERATIONS, as_float, is_integer

from .channels import BN_CHANNEL_KEYS, BN_CHANNELS, CHANNELS, PARTS
from .data import PARTITIONS, dataset_loader, train_size
from .errors import ScenarioError
from .models import model_class, norm_widths
from .protocols import get as get_protocol

ALGORITHMS = ("dsgd", "fedavg")
# Fields left out of `to_dict` while unused, so that a scenario which does not use them keeps
# the run hash it had before they existed (stores hold hours of finished runs).
UNUSED_WHEN_NONE = (*BN_CHANNEL_KEYS, "agg_f", "root_size", "client_filter", "client_filter_params", "eval_subset",
                    "user_code")
# the fields that may name a user's class (`module:Name`), whose module's file a run records
REFERENCE_FIELDS = ("dataset", "model", "norm", "client_filter", "grad_agg", "bn_agg", "bn_mean_agg", "bn_var_agg",
                    "grad_attack", "bn_attack", "bn_mean_attack", "bn_var_attack")
FLTRUST_ROOT_SIZE = 100  # Cao et al. 2021: a root set of 100 examples
INF = float("inf")
# room for the seeds derived from a scenario's (seed + k) within a signed 64-bit integer, which
# torch's and numpy's generators and SQLite all take
MAX_SEED = 2**63 - 1 - 1024
INT64_MAX = 2**63 - 1
# keywords the engine passes to aggregators.build / attacks.build itself: never parameters
RESERVED_PARAMS = {"agg_params": {"spec": "the spec is the channel's *_agg field", "f": "the scenario's f, or agg_f, sets it",
                                  "n": "the number of messages is the scenario's"},
                   "attack_params": {"name": "the attack is the channel's *_attack field",
                                     "pipeline": "the attacked pipeline is the channel's *_agg"}}
# Each field on its own. Integer fields: (low[, high]); they take integers only (n = 10.0 is
# refused, not rounded). Float fields: (low, high[, low_open[, high_open]]); an integer there is
# taken as the float it equals (lr = 1 and lr = 1.0 are one run, with one hash).
INTEGERS = {"shards": (1,), "gn_groups": (1,), "n": (1,), "f": (0,), "rounds": (1,), "batch_size": (1,),
            "local_steps": (1, MAX_ITERATIONS, "steps run every round; a stop request waits for the round's end"),
            "eval_every": (1,),
            "seed": (0, MAX_SEED, "2**63 - 1025: the seeds derived from it, seed + k, stay 64-bit integers")}
NUMBERS = {"gamma": (0, 1), "alpha": (0, INF, True, True), "dropout": (0, 1, False, True),
           "bn_momentum": (0, 1, True), "hbn_lambda": (0, 1, True), "lr": (0, INF, True, True),
           "momentum": (0, 1, False, True), "weight_decay": (0, INF, False, True), "participation": (0, 1, True)}
# how the other fields' annotated types read in messages
TYPE_WORDS = {"str": "a name (a string)", "int": "an integer", "bool": "true, false", "dict": "a table of parameters",
              "list": "a list", "None": "absent"}
TYPES = {"str": str, "int": int, "bool": bool, "dict": dict, "list": list, "None": type(None)}
# the built-in datasets' images (channels, side, classes), for the memory estimate; data.py loads
# them; a dataset not here is not estimated
IMAGE_SHAPES = {"fashion-mnist": (1, 28, 10), "mnist": (1, 28, 10), "cifar10": (3, 32, 10),
                "synthetic-images": (1, 16, 10)}
GIB = 2**30


def type_names(annotation) -> frozenset[str]:
    """The type names of an annotation, written or evaluated: {"str", "None"} for `str | None`."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or repr(annotation)
    return _names_in(text)


@functools.lru_cache(maxsize=4096)  # every field of every scenario a matrix expands asks again
def _names_in(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[A-Za-z_]+", text))


def _copied(v):
    """`v` with its lists and dicts copied (dataclasses.asdict's copy, for a scenario's plain
    values, at a tenth of its cost: matrices and the docs make thousands)."""
    if isinstance(v, dict):
        return {k: _copied(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copied(x) for x in v)
    return v


def _integer(name: str, v, low: int, high: int | None = None, why: str = "") -> int:
    """`v`, an integer in [low, high]; without a `high`, at most a signed 64-bit integer (what
    torch's sizes and SQLite's integers hold), named only when exceeded."""
    if high is None and is_integer(v) and v > INT64_MAX:
        high, why = INT64_MAX, "2**63 - 1: a signed 64-bit integer"
    if not is_integer(v) or v < low or (high is not None and v > high):
        bound = f">= {low}" + (f" and <= {high}" if high is not None else "") + (f" ({why})" if why else "")
        raise ScenarioError(name, f"must be an integer {bound}, got {v!r}")
    return v


def _number(name: str, v, low: float, high: float, low_open: bool = False, high_open: bool = False) -> float:
    x = as_float(v)
    if not ((x > low if low_open else x >= low) and (x < high if high_open else x <= high)):  # NaN fails both
        raise ScenarioError(name, f"must be a number in {'(' if low_open else '['}{low}, {high}"
                                  f"{')' if high_open else ']'}, got {v!r}")
    return x


def _choice(name: str, v, allowed) -> None:
    if v not in allowed:
        raise ScenarioError(name, f"{v!r} is not allowed; allowed: {', '.join(allowed)}")


def _typed(name: str, v, annotation) -> None:
    """`v` of one of the annotated types (a bool is no integer)."""
    names = [t for t in TYPES if t in type_names(annotation)]
    if names and not any(is_integer(v) if t == "int" else isinstance(v, TYPES[t]) for t in names):
        words = [TYPE_WORDS[t] for t in names]
        either = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
        raise ScenarioError(name, f"must be {either}, got {v!r}")


# False where the runs go to other machines that check their own devices (Ray tasks given GPUs,
# sent from a head node that may have none)
_DEVICES_RUN_HERE = contextvars.ContextVar("devices_run_here", default=True)


@contextlib.contextmanager
def devices_checked_where_they_run():
    """Scenarios made inside check their device's form only: a CUDA device is checked by the
    worker that runs the scenario (it builds it again there), not by this machine."""
    token = _DEVICES_RUN_HERE.set(False)
    try:
        yield
    finally:
        _DEVICES_RUN_HERE.reset(token)


def _device(v) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", v):
        raise ScenarioError("device", f"allowed: 'cpu', 'cuda', 'cuda:N'; got {v!r}")
    if v != "cpu" and _DEVICES_RUN_HERE.get():
        if not torch.cuda.is_available():
            raise ScenarioError("device", "CUDA is not available on this machine; use device = 'cpu'")
        count, index = torch.cuda.device_count(), int(v.partition(":")[2] or 0)
        if index >= count:
            raise ScenarioError("device", f"{v!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return v


def _data_dir(v) -> str | None:
    """An existing directory, as a string; None: the default locations (robustbn.data). A
    directory that is not there is an error, never a fall back on other data."""
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise ScenarioError("data_dir", f"must be a path (a string) or absent, got {v!r}")
    if not Path(v).is_dir():
        raise ScenarioError("data_dir", f"no such directory: {str(v)!r} (leave data_dir out for the default locations)")
    return str(v)


def _milestones(v) -> list:
    """[[round, lr], ...]: rounds integers >= 1, rates finite numbers > 0, taken as floats."""
    def pair(m):
        return isinstance(m, (list, tuple)) and len(m) == 2 and is_integer(m[0]) and m[0] >= 1 \
            and 0 < as_float(m[1]) < INF
    if not isinstance(v, (list, tuple)) or not all(pair(m) for m in v):
        raise ScenarioError("lr_milestones", f"must be a list of [round, lr] pairs (round an integer >= 1, lr a "
                                             f"finite number > 0), got {v!r}")
    return [[start, as_float(lr)] for start, lr in v]


# fields of a form of their own: checked, and returned in canonical form
FORMS = {"device": _device, "data_dir": _data_dir, "lr_milestones": _milestones}


def _as_declared(params: dict, classes) -> dict:
    """`params` with each integer given for a parameter that every class taking it declares a
    float (`eps = 1` and `eps = 1.0` are one run), read from the constructors' annotations; the
    rest as given."""
    def declared_float(key):
        annotations = [p.annotation for cls in classes
                       for k, p in inspect.signature(cls.__init__).parameters.items() if k == key]
        return bool(annotations) and all(type_names(a) - {"None"} == {"float"} for a in annotations)
    return {k: as_float(v) if is_integer(v) and declared_float(k) else v for k, v in params.items()}


@functools.lru_cache(maxsize=256)  # scenario files validate the same few hundreds of times
def _norm_layers_build(protocol: type, widths: tuple[int, ...], gn_groups: int) -> bool:
    """Whether `protocol` makes normalization layers of these widths with gn_groups (on the
    meta device: no memory)."""
    try:
        with torch.device("meta"):
            for width in widths:
                protocol().norm_layer(width, gn_groups)
    except (ValueError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=64)  # per model class and input: scenario files validate hundreds of times
def _model_size(cls: type, in_channels: int, image_size: int, num_classes: int) -> tuple[int, int] | None:
    """(values every layer outputs for one example, parameters) of a model, measured by one
    forward of one example on the CPU, with uninitialized parameters (`to_empty`: no random draw,
    no initialization). Not on the meta device: its first forward imports torch's compiler
    stack, 2-4 s in every process that validates a scenario. None where the model cannot be
    made or run so."""
    from torch import nn

    from .protocols.base import Protocol

    class Plain(Protocol):  # a normalization's output has its input's shape, whatever the protocol
        def norm_layer(self, channels, gn_groups=2):
            return nn.Identity()

    values = 0
    def count(module, inputs, output):
        nonlocal values
        values += output.numel() if isinstance(output, torch.Tensor) else 0
    try:
        with torch.device("meta"):
            model = cls(Plain(), in_channels, image_size, num_classes, gn_groups=1, dropout=0.0)
        model = model.to_empty(device="cpu")
        for m in model.modules():
            if not any(m.children()):
                m.register_forward_hook(count)
        with torch.no_grad():
            model(torch.zeros(1, in_channels, image_size, image_size))
    except Exception:  # noqa: BLE001 (a user's model that fails here is checked when the run builds it)
        return None
    return values, sum(p.numel() for p in model.parameters())


@functools.cache
def device_memory(device: str) -> int | None:
    """Bytes of memory of `device` (the machine's for the CPU); None where unknown."""
    if device != "cpu":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that tells
        return None


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
    # Each channel (grad, bn_mean, bn_var) has its own attack and pipeline, with parameters.
    # bn_* set both BN channels; bn_mean_* / bn_var_* set one. Validation puts a scenario in
    # canonical form: bn_* hold the value both BN channels share, the per-channel fields are
    # None unless the two channels differ (then bn_* is None).
    grad_attack: str = "none"
    bn_attack: str | None = None
    grad_attack_params: dict = field(default_factory=dict)
    bn_attack_params: dict | None = None
    grad_agg: str = "mean"
    bn_agg: str | None = None
    grad_agg_params: dict = field(default_factory=dict)
    bn_agg_params: dict | None = None
    bn_mean_attack: str | None = None
    bn_mean_attack_params: dict | None = None
    bn_mean_agg: str | None = None
    bn_mean_agg_params: dict | None = None
    bn_var_attack: str | None = None
    bn_var_attack_params: dict | None = None
    bn_var_agg: str | None = None
    bn_var_agg_params: dict | None = None
    agg_f: int | None = None        # the f the pipelines are built for; None = the real f
    # the server's clean root set (FLTrust): examples drawn from the training set and kept from
    # the clients; only with a pipeline that needs a reference (default then 100), else None
    root_size: int | None = None
    # a cross-channel filter (robustbn.filters, e.g. "bnguard"): clients whose BN statistics it
    # flags are dropped on every channel before the pipelines run
    client_filter: str | None = None
    client_filter_params: dict | None = None
    eval_every: int = 10
    # intermediate evaluations on this many test examples (a fixed draw), the final one on all
    # of them: the final accuracy, what every table reports, is unchanged and the run cheaper
    eval_subset: int | None = None
    seed: int = 0
    device: str = "cpu"
    # {module: digest of its file} for every user's module the scenario names (`module:Name`),
    # filled in where a file is expanded (robustbn.matrix): an edited module is another run
    user_code: dict | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Scenario":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ScenarioError(unknown[0], f"unknown field; allowed: {', '.join(sorted(known))}")
        return cls(**values).validated()

    def to_dict(self) -> dict[str, Any]:
        """The scenario's fields, without the optional ones it does not use (`UNUSED_WHEN_NONE`):
        of a validated scenario, the canonical dict its run hash is computed from."""
        values = {f.name: _copied(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items() if not (k in UNUSED_WHEN_NONE and v is None)}

    @property
    def honest(self) -> int:
        return self.n - self.f

    @property
    def pipeline_f(self) -> int:
        """The number of Byzantine clients the pipelines are built for (`agg_f`, default f)."""
        return self.f if self.agg_f is None else self.agg_f

    def key_of(self, channel: str, part: str) -> str:
        """The field that sets `part` (attack, attack_params, agg, agg_params) of `channel`:
        the per-channel field if given, else the bn_* shorthand."""
        if channel == "grad" or getattr(self, f"{channel}_{part}") is not None:
            return f"{channel}_{part}"
        return f"bn_{part}"

    def value_of(self, channel: str, part: str) -> Any:
        """`part` of `channel` as it applies: the per-channel field, else the shorthand, else
        the default (no attack, the mean)."""
        value = getattr(self, self.key_of(channel, part))
        return PARTS[part] if value is None else value

    def channel(self, name: str) -> tuple[str, dict, str, dict]:
        """(attack, attack params, pipeline spec, pipeline params) of channel `name`."""
        return tuple(self.value_of(name, part) for part in PARTS)

    def attacks_in_brief(self) -> str:
        """e.g. "bn_mean:sf/nnm+median bn_var:honest/mean", or "no attack"."""
        parts = [f"{c}:{self.value_of(c, 'attack')}/{self.value_of(c, 'agg')}" for c in CHANNELS
                 if self.value_of(c, "attack") != "none"]
        return " ".join(parts) or "no attack"

    def canonical(self) -> "Scenario":
        """Write the scenario in canonical form, in place, so that one run has one dict and one
        hash however it was spelled: the BN channels as the field comments above say, and agg_f
        equal to f as None. Raises ScenarioError where a shorthand and a per-channel field
        disagree. Part of `validated`; on its own for rows read back from exports."""
        if self.agg_f == self.f:
            self.agg_f = None  # the default, spelled out: the same run
        for part in PARTS:
            shorthand = getattr(self, f"bn_{part}")
            for channel in BN_CHANNELS:
                specific = getattr(self, f"{channel}_{part}")
                if shorthand is not None and specific is not None and specific != shorthand:
                    raise ScenarioError(f"{channel}_{part}", f"{specific!r} conflicts with bn_{part} = {shorthand!r}, "
                                                             f"which sets both BN channels; give one or the other")
            mean, var = (self.value_of(channel, part) for channel in BN_CHANNELS)
            shared = mean == var
            setattr(self, f"bn_{part}", mean if shared else None)
            setattr(self, f"bn_mean_{part}", None if shared else mean)
            setattr(self, f"bn_var_{part}", None if shared else var)
        return self

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
        """The scenario, checked and put in canonical form, in place: each field on its own
        first (its type and range; numbers of float fields become floats), then the fields
        together. Anything wrong raises a ScenarioError naming the field and what is allowed."""
        self._check_fields()
        self._resolved("dataset", dataset_loader)
        _choice("partition", self.partition, PARTITIONS)
        self._resolved("model", model_class)
        protocol = self._resolved("norm", get_protocol)
        _choice("algorithm", self.algorithm, ALGORITHMS)
        _integer("batch_size", self.batch_size, 2 if protocol.uses_bn else 1)  # batch statistics need two values
        if self.fixbn_switch is not None:
            _integer("fixbn_switch", self.fixbn_switch, 0, self.rounds)
        if self.f >= self.n:
            raise ScenarioError("f", f"must be < n = {self.n} (at least one honest client), got {self.f}")
        if self.algorithm == "dsgd" and self.local_steps != 1:
            raise ScenarioError("local_steps", "DSGD takes one step per round; use algorithm = 'fedavg' for local steps")
        if self.algorithm == "dsgd" and self.participation != 1.0:
            raise ScenarioError("participation", "partial participation is for algorithm = 'fedavg'")
        if self.agg_f is not None:
            _integer("agg_f", self.agg_f, 0, self.n - 1)
        if self.user_code is not None and not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in self.user_code.items()):
            raise ScenarioError("user_code", f"a table of module names to file digests (strings), got {self.user_code!r}")
        if self.eval_subset is not None:
            _integer("eval_subset", self.eval_subset, 1)
            if protocol.personalized:
                raise ScenarioError("eval_subset", f"{self.norm} evaluates each client on its own test split; leave "
                                                   f"eval_subset out")
        if not protocol.sends_statistics:  # nothing is sent there: behaving honestly is sending nothing
            for key in ("bn_attack", "bn_mean_attack", "bn_var_attack"):
                if getattr(self, key) == "honest":
                    setattr(self, key, "none")
        self.canonical()
        for channel in CHANNELS:
            self._validate_channel(channel)
        self.canonical()  # a channel may have spelled out a default (`_spell_defaults`)
        self._validate_server_side(protocol)
        self._check_data_size()
        self._check_norm_layers(protocol)
        protocol.check(self)
        self._check_memory()
        return self

    def current_user_code(self) -> dict[str, str] | None:
        """{module: digest of its file now} for the user's modules this scenario names, or None."""
        from aggregators.plugins import module_digest, modules_named

        names = sorted({m for key in REFERENCE_FIELDS for m in modules_named(getattr(self, key))})
        return {m: module_digest(m) for m in names} or None

    def check_user_code(self) -> None:
        """A ScenarioError where a module this scenario recorded has changed since."""
        if self.user_code is None:
            return
        now = self.current_user_code() or {}
        changed = [m for m in self.user_code if now.get(m) != self.user_code[m]]
        if changed:
            m = changed[0]
            raise ScenarioError("user_code", f"module {m!r} has changed since this run was planned (file digest "
                                             f"{self.user_code[m]}, now {now.get(m, 'not named')}); its runs are "
                                             f"of the code as it was: plan them again (robustbn run FILE)")

    def _resolved(self, name: str, find):
        """`find` of field `name`: a registered name or a `module:Name` reference."""
        try:
            return find(getattr(self, name))
        except (ValueError, TypeError) as e:
            raise ScenarioError(name, str(e)) from None

    def _check_fields(self) -> None:
        """Each field on its own, so that no later check meets a value of the wrong type: the
        numbers' ranges (`INTEGERS`, `NUMBERS`), a few fields' own forms (`FORMS`), the
        others' types as annotated."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in INTEGERS:
                _integer(f.name, value, *INTEGERS[f.name])
            elif f.name in NUMBERS:
                setattr(self, f.name, _number(f.name, value, *NUMBERS[f.name]))
            elif f.name in FORMS:
                setattr(self, f.name, FORMS[f.name](value))
            else:
                _typed(f.name, value, f.type)

    @property
    def byzantine_hold_data(self) -> bool:
        """Whether the Byzantine clients compute messages from data of their own (an attack with
        `holds_data`, label flipping): then the training data is split among all n clients."""
        return any(getattr(attacks.get(self.value_of(c, "attack")), "holds_data", False) for c in CHANNELS)

    def needs_reference(self, channel: str = "grad") -> bool:
        """Whether the channel's pipeline needs the server's reference message (FLTrust)."""
        _, _, spec, params = self.channel(channel)
        return bool(getattr(aggregators.build(spec, f=self.pipeline_f, **params), "needs_reference", False))

    @property
    def honest_per_round(self) -> int:
        """The honest messages of a channel each round: every honest client's, or under partial
        participation (FedAvg) those of the clients taking part."""
        return max(1, round(self.participation * self.honest))

    def _declared(self, channel: str, part: str, classes) -> dict:
        """The `part` parameters of `channel` with integers given for float parameters as
        floats (`_as_declared`), written back to the field that sets them."""
        key = self.key_of(channel, part)
        if getattr(self, key) is None:
            return self.value_of(channel, part)
        setattr(self, key, _as_declared(getattr(self, key), classes))
        return getattr(self, key)

    def _spell_defaults(self, channel: str, spec: str, params: dict) -> dict:
        """The channel's pipeline parameters with the defaults its steps declare explicit
        (`explicit_defaults`: a default that changed, such as cc's center) written into the field
        that sets them, so that the run hash differs from a stored run's that meant the old one."""
        missing = {k: v for cls in self._step_classes(spec) for k, v in getattr(cls, "explicit_defaults", {}).items()
                   if k not in params}
        if not missing:
            return params
        key = self.key_of(channel, "agg_params")
        if key == "bn_agg_params":  # the shorthand sets both BN channels: split it (canonical() merges again)
            for c in BN_CHANNELS:
                setattr(self, f"{c}_agg_params", dict(self.value_of(c, "agg_params")))
            self.bn_agg_params, key = None, f"{channel}_agg_params"
        setattr(self, key, {**params, **missing})
        return getattr(self, key)

    @staticmethod
    def _step_classes(spec: str) -> list:
        """The classes of a pipeline spec's steps that resolve (`aggregators.build` names the others)."""
        try:
            return [c for c in (aggregators.step_class(step) for step in spec.split("+")) if c is not None]
        except (ValueError, TypeError):
            return []

    def _pipeline(self, channel: str, spec: str, params: dict) -> aggregators.Pipeline:
        """The channel's pipeline, not yet checked for a number of messages. A ScenarioError
        names the spec's field where the spec does not build on its own, else the parameters'."""
        try:  # a seed in the parameters wins over the scenario's
            return aggregators.build(spec, f=self.pipeline_f, **{"seed": self.seed, **params})
        except (ValueError, TypeError) as e:
            error = e
        try:
            aggregators.build(spec, f=self.pipeline_f, seed=self.seed)
        except (ValueError, TypeError) as e:
            raise ScenarioError(self.key_of(channel, "agg"), str(e)) from None
        raise ScenarioError(self.key_of(channel, "agg_params"), str(error))

    def _check_data_size(self) -> None:
        """Every client that holds data (and the root set) gets examples of the training set,
        whose size is known for registered datasets without loading them (`data.train_size`)."""
        size = train_size(self.dataset)
        if size is None:
            return
        pool = size - (self.root_size or 0)
        if pool < 1:
            raise ScenarioError("root_size", f"must be < {size}, the training examples of {self.dataset!r} "
                                             f"(the clients need the rest), got {self.root_size}")
        where = f"the {pool} training examples of {self.dataset!r}" + (
            " left by the root set" if self.root_size else "")
        holders = self.honest + (self.f if self.byzantine_hold_data else 0)
        each = {"shards": self.shards, "dirichlet": 2}.get(self.partition, 1)
        if holders <= pool // each:
            return
        if self.partition == "shards" and holders <= pool:
            raise ScenarioError("shards", f"{holders} clients x {self.shards} shards need {holders * self.shards} of "
                                          f"{where}, a shard one at least: must be <= {pool // holders}, "
                                          f"got {self.shards}")
        need = {"shards": f"{self.shards} shards of one example at least",
                "dirichlet": "2 examples at least"}.get(self.partition, "one example at least")
        most = pool // each + (0 if self.byzantine_hold_data else self.f)
        raise ScenarioError("n", f"every client holding data needs {need}: {where} allow n <= {most} "
                                 f"(f = {self.f}), got {self.n}")

    def memory_estimate(self) -> tuple[int, str, str] | None:
        """(bytes, the field that drives them, what they hold): a lower bound of one round's
        memory, in float32: the layers' outputs of the examples computed at once (every client's
        batch under vmap on an accelerator, one client's on the CPU, where clients run one by
        one), every client's inputs, and the parameters once per computing client (gradients or
        FedAvg's copies) and once per client's message. None for a dataset or model not sized."""
        shape = IMAGE_SHAPES.get(self.dataset)
        size = shape and _model_size(model_class(self.model), *shape)
        if not size:
            return None
        (channels, side, _), (activations, params) = shape, size
        union = get_protocol(self.norm).union_batch
        clients = (1 if union else self.honest_per_round) + (self.f if self.byzantine_hold_data else 0)
        batch = self.batch_size * (self.honest if union else 1)
        at_once = clients if self.device != "cpu" else 1
        examples = 4 * batch * (activations * at_once + channels * side * side * clients)
        copies = 4 * params * (clients + self.n)
        if copies > examples:
            return examples + copies, "n", f"{params:,} parameters of {self.model!r} for each of n={self.n} clients"
        through = f"through {self.model!r} on {channels}x{side}x{side} images"
        what = (f"the {self.honest} clients' batches as one of {batch} {through}" if union else
                f"{clients} clients x batch_size={batch} {through} at once" if at_once > 1 else
                f"batch_size={batch} {through}, {clients} clients one by one")
        return examples + copies, "batch_size", what

    def _check_memory(self) -> None:
        """Refuse a round that clearly cannot fit in the device's memory (it would be killed
        mid-run): only where even `memory_estimate`'s lower bound exceeds it."""
        if self.device != "cpu" and not _DEVICES_RUN_HERE.get():
            return  # a worker's GPU: checked there
        estimate, total = self.memory_estimate(), device_memory(self.device)
        if estimate is not None and total is not None and estimate[0] > total:
            need, name, what = estimate
            where = "the machine" if self.device == "cpu" else self.device
            raise ScenarioError(name, f"this scenario needs about {need / GIB:,.1f} GiB for one round ({what}), "
                                      f"{where} has {total / GIB:,.1f} GiB")

    def _check_norm_layers(self, protocol) -> None:
        """The protocol's normalization layers build for the model's widths with gn_groups
        (GroupNorm splits each layer's channels into groups of equal size)."""
        widths = norm_widths(self.model)
        if widths and not _norm_layers_build(protocol, widths, self.gn_groups):
            allowed = [g for g in range(1, max(widths) + 1) if _norm_layers_build(protocol, widths, g)]
            raise ScenarioError("gn_groups", f"norm = {self.norm!r} cannot split into {self.gn_groups} groups the "
                                             f"channels of the normalized layers of model {self.model!r} "
                                             f"({', '.join(map(str, widths))}); "
                                             f"allowed: {', '.join(map(str, allowed))}, got {self.gn_groups}")

    def _validate_server_side(self, protocol) -> None:
        """The root set, data-holding Byzantine clients and the client filter: what they need
        from the protocol and the channels. Unused, root_size and the filter's params are None."""
        for channel in BN_CHANNELS:
            if self.needs_reference(channel):
                raise ScenarioError(self.key_of(channel, "agg"), "needs the server's reference message, which "
                                    "robustbn computes for the gradients only (use it in grad_agg)")
        if self.needs_reference("grad"):
            if self.root_size is None:
                self.root_size = FLTRUST_ROOT_SIZE
            if isinstance(self.root_size, bool) or not isinstance(self.root_size, int) or self.root_size < 1:
                raise ScenarioError("root_size", f"must be an integer >= 1 (the server's root examples), "
                                                 f"got {self.root_size!r}")
        else:
            self.root_size = None  # only a pipeline with a reference uses it: the same run without
        computed = [what for what, used in (("a root set (root_size)", self.root_size is not None),
                                            ("data-holding Byzantine clients", self.byzantine_hold_data)) if used]
        if computed and (protocol.union_batch or protocol.exchanges_in_forward):
            raise ScenarioError("norm", f"norm = {self.norm!r} computes its clients together (one union batch or "
                                        f"statistics pooled inside the forward): {' and '.join(computed)} not "
                                        f"supported with it")
        if self.client_filter == "none":
            self.client_filter = None  # as with attacks: "none" spells the default in a list-valued axis
        if self.client_filter is None:
            if self.client_filter_params:
                raise ScenarioError("client_filter_params", "parameters without a client_filter")
            self.client_filter_params = None
            return
        from .filters import build as build_filter
        params = self.client_filter_params or {}
        if not isinstance(params, dict):
            raise ScenarioError("client_filter_params", f"must be a table of parameters, got {params!r}")
        try:
            build_filter(self.client_filter, **params)
        except (ValueError, TypeError) as e:
            raise ScenarioError("client_filter_params" if params else "client_filter", str(e)) from None
        self.client_filter_params = params or None
        if not protocol.sends_statistics or protocol.exchanges_in_forward:
            raise ScenarioError("client_filter", f"reads the BN statistics every client sends each round; norm = "
                                                 f"{self.norm!r} sends none it could read")
        silent = [self.key_of(c, "attack") for c in BN_CHANNELS if self.value_of(c, "attack") == "none"]
        if self.f > 0 and silent:
            raise ScenarioError(silent[0], f"with client_filter = {self.client_filter!r} every client must send "
                                           f"statistics ('none': the Byzantine clients send nothing there); "
                                           f"use 'honest' for statistics that look honest")

    def _validate_channel(self, channel: str) -> None:
        name, params, spec, agg_params = self.channel(channel)
        attack_key, agg_key = self.key_of(channel, "attack"), self.key_of(channel, "agg")
        if channel != "grad" and not get_protocol(self.norm).sends_statistics and name != "none":
            raise ScenarioError(attack_key, f"norm = {self.norm!r} sends no BN statistics; allowed: 'none'")
        if name != "none" and self.f == 0:
            raise ScenarioError(attack_key, f"{name!r} needs f >= 1 Byzantine clients (f = 0); use 'none'")
        try:
            attack_class = attacks.get(name)
        except (ValueError, TypeError) as e:
            raise ScenarioError(attack_key, str(e)) from None
        params = self._declared(channel, "attack_params", [attack_class] if attack_class else [])
        agg_params = self._spell_defaults(channel, spec, self._declared(channel, "agg_params", self._step_classes(spec)))
        for part, given in (("attack_params", params), ("agg_params", agg_params)):
            for key, why in RESERVED_PARAMS[part].items():
                if key in given:
                    raise ScenarioError(self.key_of(channel, part), f"{key!r} is not a parameter ({why}); "
                                                                    f"got {key} = {given[key]!r}")
        try:
            # an attack that needs its pipeline gets it from the engine; a stand-in checks the rest
            attack = attacks.build(name, pipeline=len, **{"seed": self.seed, **params})  # a seed in params wins
            if attack is not None:
                attack.check(self.honest_per_round, self.f)
        except (ValueError, TypeError) as e:  # its parameters: the params table's key, if given
            raise ScenarioError(self.key_of(channel, "attack_params") if params else attack_key, str(e)) from None
        pipeline = self._pipeline(channel, spec, agg_params)
        # without an attack on the channel, the Byzantine clients send nothing on it
        received = self.n if name != "none" else self.n - self.f
        try:
            pipeline.check(received)
        except ValueError as e:
            why = (f" (with {attack_key} = 'none' the Byzantine clients send nothing on this channel: "
                   f"the server receives n - f = {received} messages)") if received != self.n else ""
            assumed = f" (agg_f = {self.agg_f}: the pipelines are built for that many Byzantine clients)" \
                if self.agg_f is not None else ""
            raise ScenarioError(agg_key, f"{e}{why}{assumed}") from None
