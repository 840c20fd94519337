"""Federated BatchNorm (seed 002, Algorithm 2): normalize with the shared running statistics
(constants, no gradient through them); the server combines the clients' running statistics
with the law-of-total-variance correction, so with mean pipelines the shared statistics are
exactly centralized BN's on the union of the batches (Appendix A)."""

import torch.nn.functional as F

import aggregators

from ..norm import batch_moments
from .base import Protocol, one_by_one


def fbn_server_stats(msg_mean, msg_var, count, n: int, beta: float, agg_mean, agg_var, together=one_by_one):
    """Seed 002, Algorithm 2 lines 9-10, with the channels' pipelines in place of each average:
    mu = Agg_mean(mu_i), var = Agg_var(var_i) + Kn/((Kn-1) beta) Agg_mean((mu_i - mu)^2). The
    correction term is built from the bn_mean messages, so it goes through the bn_mean pipeline:
    as a trial for a stateful one (`aggregators.trials`), whose state follows the means alone."""
    mean = agg_mean(msg_mean)
    kn = count * n
    with aggregators.trials(*([agg_mean] if agg_mean is not agg_var else [])):
        var, spread = together([(agg_var, msg_var), (agg_mean, (msg_mean - mean) ** 2)])
    return mean, var + kn / ((kn - 1) * beta) * spread


class FBN(Protocol):
    name = "fbn"
    label = "FBN"

    def normalize(self, layer, x):
        batch_mean, batch_var = batch_moments(x)
        out = F.batch_norm(x, layer.running_mean.detach(), layer.running_var.detach(), layer.weight, layer.bias,
                           False, 0.0, layer.eps)
        return out, batch_mean, batch_var

    def variance_factor(self, count, n):
        """Kn/(Kn-1) (Algorithm 2, line 6): the unbiased variance of the union batch."""
        return count * n / (count * n - 1)

    def server_update(self, shared_mean, shared_var, msg_mean, msg_var, count, n, beta, agg_mean, agg_var,
                      together=one_by_one):
        return fbn_server_stats(msg_mean, msg_var, count, n, beta, agg_mean, agg_var, together)
