"""Norm protocols: how a BN layer normalizes on a client, what statistics a client sends,
and how the server combines them (DESIGN.md, "The norm protocols").

The layer only normalizes and reports its batch statistics; every update of running
statistics is a pure function below, called by the engine, so no mode mutates buffers
behind the engine's back. Statistics of all BN layers travel flattened and concatenated:
one vector of C_total channels per client and channel (`bn_mean`, `bn_var`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("naive", "fbn", "fixbn", "hbn", "fedbn", "central", "gn", "none")
NO_BN_MODES = ("gn", "none")  # GroupNorm, or no normalization layer at all
STAT_MODES = ("naive", "fbn", "fixbn", "hbn", "central")  # modes whose statistics reach the server

Aggregate = Callable[[torch.Tensor], torch.Tensor]


class FedBatchNorm(nn.Module):
    """Batch normalization whose statistics source depends on the norm mode and phase.

    phase "train": naive, fixbn (first stage), fedbn, central normalize with the batch
    statistics; fbn with the shared running statistics (constants, no gradient); hbn with
    (1 - s) batch + s global, s = sigmoid(alpha), alpha a per-channel client-local parameter.
    phase "frozen" (fixbn's second stage) and "eval": the running statistics.
    In "train" the layer stores its (detached) batch mean and biased variance and the count
    K of values per channel in `batch_stats` and `count` for the engine to read.
    """

    def __init__(self, num_features: int, mode: str, eps: float = 1e-5):
        super().__init__()
        if mode not in MODES or mode in NO_BN_MODES:
            raise ValueError(f"FedBatchNorm: mode must be one of {', '.join(m for m in MODES if m not in NO_BN_MODES)}, "
                             f"got {mode!r}")
        self.mode, self.eps, self.phase = mode, eps, "train"
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        if mode == "hbn":
            self.alpha = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.batch_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.phase in ("eval", "frozen"):
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        self.count = x.numel() // x.shape[1]
        if self.mode == "hbn":  # a mix of batch and global statistics
            out, batch_mean, batch_var, *_ = HybridNorm.apply(x, self.weight, self.bias, self.alpha, self.running_mean.detach(),
                                                              self.running_var.detach(), self.eps)
            self.batch_stats = (batch_mean, batch_var)
            return out
        if self.mode == "fbn":  # the shared running statistics, constants
            self.batch_stats = batch_moments(x)
            return F.batch_norm(x, self.running_mean.detach(), self.running_var.detach(), self.weight, self.bias,
                                False, 0.0, self.eps)
        # batch statistics; with momentum 1 the kernel also writes the client's report, the batch
        # mean and unbiased variance, into these fresh buffers: free, where a separate pass is not
        batch_mean, unbiased_var = x.new_zeros(x.shape[1]), x.new_zeros(x.shape[1])
        out = F.batch_norm(x, batch_mean, unbiased_var, self.weight, self.bias, True, 1.0, self.eps)
        self.batch_stats = (batch_mean, unbiased_var * ((self.count - 1) / self.count))
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


class HybridNorm(torch.autograd.Function):
    """HBN's normalization (seed 003, Eqs. 9-10): with s = sigmoid(alpha),
    m = (1-s) mu_b + s mu_g, v = (1-s) var_b + s var_g, y = (x - m) w / sqrt(v + eps) + b,
    mu_b and var_b the batch statistics (gradient flows through them), mu_g and var_g the
    global ones (constants). Outputs (y, mu_b, var_b, s, m, v), the last three for the
    backward. Forward and backward reuse torch's fused inference batch norm with (m, v) as
    its statistics: its backward gives g w r, sum(g (x - m)) r and sum(g) in one pass
    (r = 1/sqrt(v + eps)), and one more elementwise pass adds the terms of m's and v's
    dependence on x. Autograd through the formula costs about 3x a batch norm; tests compare
    the two. Per-channel arithmetic is folded into few ops: on small layers each op's
    overhead, not its size, is the cost."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, alpha, global_mean, global_var, eps):
        batch_mean, batch_var = batch_moments(x)
        s = torch.sigmoid(alpha)
        mean, var = torch.lerp(batch_mean, global_mean, s), torch.lerp(batch_var, global_var, s)
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps), batch_mean, batch_var, s, mean, var

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, _, global_mean, global_var, eps = inputs
        ctx.save_for_backward(x, weight, global_mean, global_var, *output[1:])
        ctx.eps = eps
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, grad, *_):
        x, weight, global_mean, global_var, batch_mean, batch_var, s, mean, var = ctx.saved_tensors
        shape = (1, -1) + (1,) * (x.dim() - 2)
        count = x.numel() // x.shape[1]
        r = torch.rsqrt(var + ctx.eps)
        # Eval-mode backward with (m, v) as running statistics; its vmap rule also wants them as
        # the saved (mean, invstd). It takes no gradient through statistics, and under
        # torch.func.grad a backward records a graph, so they go in detached (HBN has no
        # double backward).
        mean, var, r = mean.detach(), var.detach(), r.detach()
        d_x, d_weight, d_bias = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, mean, var, mean, r, False, ctx.eps, [True, True, True])
        # With d_bias = sum g and r d_weight = r^2 sum g (x - m): dL/dm = -w r d_bias,
        # dL/dv = -w r (r d_weight) / 2, and dx = g w r + (1-s)/K (dL/dm + 2 (x - mu_b) dL/dv)
        rd = r * d_weight
        wr = weight * r
        # per-channel ops stay out of place: vmap may batch any operand, and in place needs a batched target
        neg_c = (s - 1) * wr / count  # -(1-s) w r / K
        slope = neg_c * rd
        offset = torch.addcmul(d_bias, rd, batch_mean, value=-1) * neg_c
        d_x = torch.addcmul(d_x, x, slope.view(shape)).add_(offset.view(shape))  # vmap lacks addcmul_
        # dL/dalpha = s (1-s) (dL/dm (mu_g - mu_b) + dL/dv (var_g - var_b))
        d_alpha = torch.addcmul(d_bias * (global_mean - batch_mean), rd, global_var - batch_var, value=0.5)
        d_alpha = d_alpha * neg_c * (s * count)
        return d_x, d_weight, d_bias, d_alpha, None, None, None


def make_norm(mode: str, channels: int, gn_groups: int = 2) -> nn.Module:
    """The norm layer of a mode: GroupNorm for "gn", none (identity) for "none", FedBatchNorm otherwise."""
    if mode == "gn":
        return nn.GroupNorm(min(gn_groups, channels), channels)
    if mode == "none":
        return nn.Identity()
    return FedBatchNorm(channels, mode)


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


# ---- client side ---------------------------------------------------------------------------

def variance_factor(mode: str, count: torch.Tensor, n: int) -> torch.Tensor:
    """Bessel factor of a client's running-variance update: K/(K-1) (what PyTorch does, for
    naive, fixbn, fedbn, central), Kn/(Kn-1) for fbn (seed 002, Algorithm 2, line 6)."""
    k = count * n if mode == "fbn" else count
    return k / (k - 1)


def client_running_stats(mode: str, prev_mean, prev_var, batch_mean, batch_var, count, n: int, beta: float):
    """A client's running statistics after one step: (1-b) prev + b batch, variance with the
    mode's Bessel factor. prev_* broadcast against the per-client batch_* (h, C)."""
    mean = (1 - beta) * prev_mean + beta * batch_mean
    var = (1 - beta) * prev_var + beta * variance_factor(mode, count, n) * batch_var
    return mean, var


# ---- server side ---------------------------------------------------------------------------

def keep_finite(new: torch.Tensor, old: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """The server's last line of defense: a coordinate whose aggregate is not finite keeps its
    old value; variances are floored at 0."""
    out = torch.where(torch.isfinite(new), new, old)
    return out.clamp_min(floor) if floor is not None else out


def one_by_one(calls: list[tuple[Aggregate, torch.Tensor]]) -> list[torch.Tensor]:
    """Run independent aggregations [(pipeline, messages), ...]; an engine may pass a
    `together` that batches them into one call instead."""
    return [agg(messages) for agg, messages in calls]


def fbn_server_stats(msg_mean, msg_var, count, n: int, beta: float, agg_mean: Aggregate, agg_var: Aggregate,
                     together=one_by_one):
    """Seed 002, Algorithm 2 lines 9-10, with the channels' pipelines in place of each average:
    mu = Agg(mu_i), var = Agg(var_i) + Kn/((Kn-1) beta) Agg((mu_i - mu)^2). The correction
    term is built from the bn_mean messages, so it goes through the bn_mean pipeline."""
    mean = agg_mean(msg_mean)
    kn = count * n
    var, spread = together([(agg_var, msg_var), (agg_mean, (msg_mean - mean) ** 2)])
    return mean, var + kn / ((kn - 1) * beta) * spread


def hbn_server_stats(msg_mean, msg_var, count, agg_mean: Aggregate, agg_var: Aggregate, together=one_by_one):
    """Seed 003, Eq. 8 for equal client sizes N_k = K (N = K n): mu = Agg(mu_k),
    var = N/(N-1) (Agg(var_k) + Agg((mu_k - mu)^2))."""
    mean = agg_mean(msg_mean)
    total = count * msg_mean.shape[0]
    var, spread = together([(agg_var, msg_var), (agg_mean, (msg_mean - mean) ** 2)])
    return mean, total / (total - 1) * (var + spread)


def server_stats(mode: str, shared_mean, shared_var, msg_mean, msg_var, count, n: int, beta: float,
                 agg_mean: Aggregate, agg_var: Aggregate, hbn_lambda: float = 0.01, together=one_by_one):
    """New shared statistics from the n stacked messages (n, C) of each BN channel.
    `together` runs aggregations that do not depend on each other (default: one by one)."""
    if mode == "fbn":
        mean, var = fbn_server_stats(msg_mean, msg_var, count, n, beta, agg_mean, agg_var, together)
    elif mode == "hbn":
        mean, var = hbn_server_stats(msg_mean, msg_var, count, agg_mean, agg_var, together)
        mean = (1 - hbn_lambda) * shared_mean + hbn_lambda * mean
        var = (1 - hbn_lambda) * shared_var + hbn_lambda * var
    elif mode in ("naive", "fixbn", "central"):
        mean, var = together([(agg_mean, msg_mean), (agg_var, msg_var)])
    else:
        raise ValueError(f"mode {mode!r} sends no statistics to the server")
    return keep_finite(mean, shared_mean), keep_finite(var, shared_var, floor=0.0)
