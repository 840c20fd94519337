"""Hybrid BN (seed 003): before local training each client measures the statistics of its data
under the global weights (forward only); the server pools them and takes an EMA with lambda;
during training each client normalizes with (1 - s) batch + s global statistics,
s = sigmoid(alpha), alpha a learnable per-channel parameter that stays on the client."""

import torch
import torch.nn.functional as F
from torch import nn

from ..norm import batch_moments
from .base import Protocol, one_by_one


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


def hbn_server_stats(msg_mean, msg_var, count, agg_mean, agg_var, together=one_by_one):
    """Seed 003, Eq. 8 for equal client sizes N_k = K (N = K m, m the mean messages received):
    mu = Agg_mean(mu_k), var = N/(N-1) (Agg_var(var_k) + Agg_mean((mu_k - mu)^2))."""
    mean = agg_mean(msg_mean)
    total = count * msg_mean.shape[0]
    var, spread = together([(agg_var, msg_var), (agg_mean, (msg_mean - mean) ** 2)])
    return mean, total / (total - 1) * (var + spread)


class HBN(Protocol):
    name = "hbn"
    label = "HBN"
    report_each_step = False  # the measurement is the round's first forward pass

    def init_layer(self, layer):
        layer.alpha = nn.Parameter(torch.zeros(layer.weight.shape[0]))

    def is_local(self, param, bn_layers):
        return param.endswith(".alpha")

    def normalize(self, layer, x):
        out, batch_mean, batch_var, *_ = HybridNorm.apply(x, layer.weight, layer.bias, layer.alpha,
                                                          layer.running_mean.detach(), layer.running_var.detach(),
                                                          layer.eps)
        return out, batch_mean, batch_var

    def client_report(self, prev_mean, prev_var, batch_mean, batch_var, count, n, beta):
        """The statistics of the client's data measured under the weights it received."""
        return batch_mean, batch_var

    def server_update(self, shared_mean, shared_var, msg_mean, msg_var, count, n, beta, agg_mean, agg_var,
                      together=one_by_one):
        """Pooling (Eq. 8), then the EMA with lambda."""
        mean, var = hbn_server_stats(msg_mean, msg_var, count, agg_mean, agg_var, together)
        lam = self.hbn_lambda
        return (1 - lam) * shared_mean + lam * mean, (1 - lam) * shared_var + lam * var
