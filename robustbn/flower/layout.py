"""What the strategy and the clients share: which keys of a model's state_dict go to which
channel (`Layout`), the names carried in messages and configs, and ArrayRecord <-> tensors."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterable

import torch
from flwr.app import ArrayRecord, Message
from torch import nn

from ..channels import BN_CHANNEL_KEYS
from ..norm import FedBatchNorm
from ..protocols.base import Protocol

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
    running statistics, one key per BN layer), `counters` (num_batches_tracked: each
    advanced by the median increment), `local` (never leave the client)."""

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
        self.like = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}  # what a reply's tensors must be
        self.weights = [k for k in params if not protocol.is_local(k, self.layers)]
        self.means = [f"{L}.running_mean" for L in self.layers]
        self.variances = [f"{L}.running_var" for L in self.layers]
        self.counters = [f"{L}.num_batches_tracked" for L in self.layers if f"{L}.num_batches_tracked" in state]
        self.shared = set(self.weights) | (set() if local_stats else {*self.means, *self.variances, *self.counters})
        self.local = [k for k in self.keys if k not in self.shared]

    def problem(self, state: dict, need: Iterable[str]) -> str | None:
        """Why `state` cannot be one of the model's states (a key not the model's, one of `need`
        missing, a shape or dtype not the model's, NaN or inf), or None."""
        unknown = [k for k in state if k not in self.like]
        if unknown:
            return f"key {unknown[0]!r} is not in the model's state_dict"
        missing = [k for k in need if k not in state]
        if missing:
            return f"key {missing[0]!r} is missing"
        for k, v in state.items():
            shape, dtype = self.like[k]
            if tuple(v.shape) != shape:
                return f"key {k!r} has shape {tuple(v.shape)}, the model's is {shape}"
            if v.dtype != dtype:
                return f"key {k!r} has dtype {v.dtype}, the model's is {dtype}"
            if v.is_floating_point() and not torch.isfinite(v).all():
                return f"key {k!r} holds NaN or inf"
        return None

    def check(self, state: dict, where: str, need: Iterable[str]) -> None:
        """A one-line ValueError where `state` cannot be one of the model's states."""
        problem = self.problem(state, need)
        if problem:
            raise ValueError(f"RobustStrategy: {where}: {problem}")

    def statistics(self, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(C,) running means and variances of every BN layer, flat in layer order."""
        if not self.layers:
            return torch.zeros(0), torch.ones(0)
        return torch.cat([state[k].reshape(-1) for k in self.means]), torch.cat([state[k].reshape(-1) for k in self.variances])


def _values_per_channel(model: nn.Module, layout: Layout, example_input: torch.Tensor) -> torch.Tensor:
    """K per BN channel (values a BN layer normalizes per channel in one client's batch), by
    one forward of a copy of the model in training mode (the model itself is not touched)."""
    import copy
    if not layout.layers:  # no BN layer, nothing to count
        return torch.zeros(0)
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


def _metric(message: Message, key: str):
    for record in message.content.metric_records.values():
        if key in record:
            return record[key]
    return None


def _partition(message: Message) -> int:
    """A reply's partition id (the metric `partition-id`), else its node id: replies are taken
    in this order, whatever order they arrived in."""
    pid = _metric(message, PARTITION)
    return int(pid) if isinstance(pid, (int, float)) and math.isfinite(pid) else int(message.metadata.src_node_id)

