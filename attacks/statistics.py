"""BN-aware attacks: statistics searched for the most damage to the normalized activations.

A BN layer normalizes x with the shared statistics (mu_S, var_S). If the honest clients'
statistics describe x ~ N(mu_H, var_H) (what the server would hold from honest messages
alone), the normalized activations are N((mu_H - mu_S) / sigma_S, var_H / var_S) instead of
N(0, 1): the damage is KL(N(mu_H, var_H) || N(mu_S, var_S)) per channel,

    0.5 (var_H / var_S + (mu_S - mu_H)^2 / var_S - 1 + log(var_S / var_H)),

with BN's eps added to both variances, summed over every channel of every layer. The search
runs against what the server really does: the engine offers an `objective` that pushes each
candidate message set through the channel's pipeline and the protocol's server update (FBN's
and HBN's spread term included, the other BN channel's messages as they are) and returns
this divergence. Without it (an attack used on its own), the damage is the distance of the
attacked pipeline's output from the honest mean, as the line-searched attacks use.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import Attack, iterations, mean_and_std, pipeline_of, real, repeat

Objective = Callable[[torch.Tensor], torch.Tensor]  # (G, n, d) candidate message sets -> (G,) damage


def gaussian_kl(mu_h: torch.Tensor, var_h: torch.Tensor, mu_s: torch.Tensor, var_s: torch.Tensor,
                eps: float = 1e-5) -> torch.Tensor:
    """sum over channels of KL(N(mu_h, var_h + eps) || N(mu_s, var_s + eps)); variances floored at 0
    first, as the server floors them. Broadcasts over leading dims; the last dim is summed."""
    vh, vs = var_h.clamp_min(0) + eps, var_s.clamp_min(0) + eps
    return 0.5 * (vh / vs + (mu_s - mu_h) ** 2 / vs - 1 + torch.log(vs / vh)).sum(-1)


class StatisticsSearch(Attack):
    """bn-kl: every Byzantine client sends the one candidate that maximizes the damage,
    searched over two families of statistics built from the honest messages of the channel
    (mean m and sample std s per coordinate):
    - ALIE's direction, m - z s, for `z_steps` values of z in [-z_max, z_max];
    - scaling, c m, for c = +-10^e, e over `scale_steps` values in [-scale_exp, scale_exp]
      (c = -1: SF; c = -0.1: FOE; 10^-6: variance deflation; 10^6: inflation).
    The candidates are evaluated together (one objective call) and the best is picked on the
    device (argmax, no host sync); `last_candidate` keeps its index.

    On the bn_mean and bn_var channels the engine offers the objective above (`needs_objective`).
    When both BN channels carry this attack, the means are searched first (with the variances
    honest-looking), then the variances given those means: one pass of coordinate ascent."""

    name = "bn-kl"
    needs_pipeline = True  # the fallback objective, and what the engine offers besides
    needs_objective = True

    def __init__(self, pipeline: Callable[[torch.Tensor], torch.Tensor], z_max: float = 10.0, z_steps: int = 21,
                 scale_exp: float = 6.0, scale_steps: int = 13):
        self.pipeline = pipeline_of(self.name, pipeline)
        self.z_max, self.z_steps = real(self.name, "z_max", z_max, 0.0), iterations(self.name, "z_steps", z_steps)
        self.scale_exp = real(self.name, "scale_exp", scale_exp, 0.0)
        self.scale_steps = iterations(self.name, "scale_steps", scale_steps)

    def candidates(self, honest: torch.Tensor) -> torch.Tensor:
        """(G, d): every candidate Byzantine message."""
        mean, std = mean_and_std(honest)
        z = torch.linspace(-self.z_max, self.z_max, self.z_steps, device=honest.device, dtype=honest.dtype)
        e = torch.linspace(-self.scale_exp, self.scale_exp, self.scale_steps, device=honest.device, dtype=honest.dtype)
        c = torch.cat([10.0 ** e, -(10.0 ** e)])
        return torch.cat([mean - z[:, None] * std, c[:, None] * mean])

    def distance_objective(self, honest: torch.Tensor) -> Objective:
        target = honest.mean(0)
        return lambda sets: torch.stack([torch.linalg.vector_norm(self.pipeline(s) - target) for s in sets])

    def search(self, honest: torch.Tensor, f: int, objective: Objective) -> torch.Tensor:
        """The f Byzantine messages maximizing `objective` over the candidates."""
        cands = self.candidates(honest)
        sets = torch.cat([honest.expand(len(cands), *honest.shape), cands[:, None, :].expand(-1, f, -1)], 1)
        damage = torch.nan_to_num(objective(sets).double(), nan=-1.0, posinf=torch.finfo(torch.float64).max)
        best = damage.argmax()
        self.last_candidate = best  # a tensor: reading it is the caller's sync
        return repeat(cands[best], f)

    def forge(self, honest, f):
        return self.search(honest, f, self.distance_objective(honest))

    def forge_against(self, honest: torch.Tensor, f: int, objective: Objective) -> torch.Tensor:
        """Byzantine messages searched against `objective`, which scores (G, n, d) candidate
        message sets (honest rows first, then the f Byzantine ones)."""
        if f == 0:
            return honest.new_empty((0, honest.shape[1]))
        return self.search(honest, f, objective)


__all__ = ["StatisticsSearch", "gaussian_kl"]
