"""The BN layer every BN protocol shares, and the pure functions of running statistics.

The layer normalizes as its protocol says (robustbn/protocols/) and reports its batch
statistics; every update of running statistics is a pure function, called by the engine
through the protocol's hooks, so no protocol mutates buffers behind the engine's back.
Statistics of all BN layers travel flattened and concatenated: one vector of C_total
channels per client and channel (`bn_mean`, `bn_var`).
"""

from __future__ import annotations

import torch
from torch import nn


class FedBatchNorm(nn.Module):
    """Batch normalization whose forward is its protocol's.

    phase "train": the protocol's `normalize`; the layer keeps the (detached) batch mean and
    biased variance and the count K of values per channel in `batch_stats` and `count` for
    the engine to read. Phase "frozen" (FixBN's second stage) and "eval": the protocol's
    `normalize_with_running`. `protocol` is a robustbn.protocols.Protocol (the layer lies below
    the protocols: `robustbn.models.make_norm` builds one from a protocol's name).
    """

    def __init__(self, num_features: int, protocol, eps: float = 1e-5):
        super().__init__()
        self.protocol, self.mode, self.eps, self.phase = protocol, protocol.name, eps, "train"
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        protocol.init_layer(self)
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.batch_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.phase in ("eval", "frozen"):
            return self.protocol.normalize_with_running(self, x)
        self.count = x.numel() // x.shape[1]
        out, batch_mean, batch_var = self.protocol.normalize(self, x)
        self.batch_stats = (batch_mean, batch_var)
        return out

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, mode={self.mode}, eps={self.eps}"


def batch_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel batch mean and biased variance of x (N, C, ...), without gradient, in two
    passes (the mean, then the mean squared deviation from it). On the CPU torch.var_mean
    over (N, H, W) runs 5-15x slower than this at the Simple-CNN's layer shapes."""
    dims, shape = [0] + list(range(2, x.dim())), (1, -1) + (1,) * (x.dim() - 2)
    with torch.no_grad():
        mean = x.mean(dims)
        deviation = x - mean.view(shape)
        return mean, deviation.mul_(deviation).mean(dims)  # mul_, not square_: vmap batches it


def norm_layers(model: nn.Module) -> list[tuple[str, FedBatchNorm]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FedBatchNorm)]


def set_phase(model: nn.Module, phase: str) -> None:
    for _, layer in norm_layers(model):
        layer.phase = phase


def collect_batch_stats(layers: list[FedBatchNorm]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated (mean, biased var) of the last forward pass, and clear them."""
    means = torch.cat([l.batch_stats[0] for l in layers])
    variances = torch.cat([l.batch_stats[1] for l in layers])
    for l in layers:
        l.batch_stats = None
    return means, variances


def client_running_stats(prev_mean, prev_var, batch_mean, batch_var, factor, beta: float):
    """A client's running statistics after one step: (1-b) prev + b batch, the variance times
    its Bessel `factor` (a protocol's `variance_factor`). prev_* broadcast against batch_* (h, C)."""
    mean = (1 - beta) * prev_mean + beta * batch_mean
    var = (1 - beta) * prev_var + beta * factor * batch_var
    return mean, var


def keep_finite(new: torch.Tensor, old: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """The server's last line of defense: a coordinate whose aggregate is not finite keeps its
    old value; variances are floored at 0."""
    out = torch.where(torch.isfinite(new), new, old)
    return out.clamp_min(floor) if floor is not None else out
