"""FedTAN (Wang et al. 2023): exact federated BN. Every BN layer normalizes each client's batch
with statistics pooled across the clients *during* the forward pass, and the gradient flows
back through them: with mean pipelines and f = 0 a round is centralized BN on the union of
the clients' batches. Under attack the per-layer messages (each client's batch mean and
biased variance) go through the bn_mean / bn_var channels, attacked and robustly aggregated
inside the forward, and the gradient flows through the robust aggregate (robust exact BN).

The clients' forwards are one torch.func.vmap whose BN layers pool across the vmapped
dimension (`PooledNorm`'s vmap rule); each client's `grad` message is the gradient of the
honest clients' summed loss with respect to its own copy of the weights, as FedTAN's clients
compute it by exchanging the gradients of the statistics. Evaluation uses running statistics
updated from the pooled ones, as centralized BN's are.
"""

import torch

from ..norm import keep_finite
from .base import Protocol


def pooled_normalize(x, weight, bias, running_mean, running_var, eps: float, pool):
    """Normalize clients' activations x (h, N, C, ...) with statistics pooled across the h
    clients: (y, pooled mean, pooled biased variance). `pool(mean_i, var_i)` turns the
    clients' (h, C) batch statistics into one (C,) mean and variance (None: the plain union
    statistics). weight and bias are (C,) or one per client (h, C). A coordinate whose pooled
    statistic is not finite falls back on the running one: hostile messages never reach the
    activations as NaN."""
    dims = [1] + list(range(3, x.dim()))
    shape = (x.shape[0], 1, -1) + (1,) * (x.dim() - 3)
    mean_i = x.mean(dims)
    deviation = x - mean_i.view(shape)
    var_i = (deviation * deviation).mean(dims)
    if pool is None:
        mean = mean_i.mean(0)
        var = var_i.mean(0) + ((mean_i - mean) ** 2).mean(0)
    else:
        mean, var = pool(mean_i, var_i)
    mean = keep_finite(mean, running_mean)
    var = keep_finite(var, running_var, floor=0.0)
    scale = weight * torch.rsqrt(var + eps)
    shift = bias - mean * scale
    scale, shift = scale.expand(x.shape[0], -1), shift.expand(x.shape[0], -1)
    return torch.addcmul(shift.reshape(shape), x, scale.reshape(shape)), mean.detach(), var.detach()


class PooledNorm(torch.autograd.Function):
    """`pooled_normalize` as a layer op. Under torch.func.vmap over clients its vmap rule sees
    every client's activations at once and pools across them; called outside a vmap it sees
    one client (its own batch statistics). Either way the gradient is autograd's through the
    plain formula (the vmap rule runs ordinary differentiable ops; the unbatched backward
    recomputes the formula)."""

    @staticmethod
    def forward(x, weight, bias, running_mean, running_var, eps, pool):
        y, mean, var = pooled_normalize(x.unsqueeze(0), weight, bias, running_mean, running_var, eps, None)
        return y[0], mean, var

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, running_mean, running_var, eps, _ = inputs
        ctx.save_for_backward(x, weight, bias, running_mean, running_var)
        ctx.eps = eps
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, grad, *_):
        x, weight, bias, running_mean, running_var = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (x, weight, bias)]
            y = pooled_normalize(inputs[0].unsqueeze(0), *inputs[1:], running_mean, running_var, ctx.eps, None)[0]
            return (*torch.autograd.grad(y[0], inputs, grad), None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, running_mean, running_var, eps, pool):
        def front(t, dim):  # the clients' dimension first, or none
            return t if dim is None else t.movedim(dim, 0)
        x, weight, bias, running_mean, running_var = (
            front(t, d) for t, d in zip((x, weight, bias, running_mean, running_var), in_dims))
        return pooled_normalize(x, weight, bias, running_mean, running_var, eps, pool), (0, None, None)


class FedTAN(Protocol):
    name = "fedtan"
    label = "FedTAN (exact BN)"
    exchanges_in_forward = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mean_channel = self.var_channel = None

    def attach(self, mean_channel, var_channel) -> None:
        self.mean_channel, self.var_channel = mean_channel, var_channel

    def pool(self, mean_i, var_i):
        """The server's half, inside the forward: the honest clients' (h, C) batch statistics
        and the Byzantine clients' messages on each BN channel, robustly aggregated like FBN's
        (mu = Agg_mean(mu_i), var = Agg_var(var_i) + Agg_mean((mu_i - mu)^2), here with biased
        variances: the union batch's). Byzantine messages are computed from the honest ones
        but carry no gradient: an honest client cannot differentiate an attacker."""
        h = mean_i.shape[0]
        byz_mean = self.mean_channel.messages(mean_i.detach())[h:]
        byz_var = self.var_channel.messages(var_i.detach())[h:]
        mean = self.mean_channel.pipeline(torch.cat([mean_i, byz_mean]))
        # (a NaN message's spread times its zero weight would be a NaN gradient: detached)
        spread = torch.cat([(mean_i - mean) ** 2, (byz_mean - mean.detach()) ** 2])
        return mean, self.var_channel.pipeline(torch.cat([var_i, byz_var])) + self.mean_channel.pipeline(spread)

    def normalize(self, layer, x):
        pool = None if self.mean_channel is None else self.pool
        return PooledNorm.apply(x, layer.weight, layer.bias, layer.running_mean.detach(),
                                layer.running_var.detach(), layer.eps, pool)

    def variance_factor(self, count, n):
        """Kn/(Kn-1): the pooled variance is the union batch's, as centralized BN's running
        variance is unbiased over the union."""
        return count * n / (count * n - 1)

    def server_update(self, shared_mean, shared_var, msg_mean, msg_var, count, n, beta, agg_mean, agg_var,
                      together=None):
        """Every client reports the same running statistics, updated from the statistics
        pooled (and attacked) inside the forward: they are the shared ones."""
        return msg_mean[0], msg_var[0]
