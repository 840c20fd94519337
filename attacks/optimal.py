"""Line-searched attacks: pick the factor that hurts the attacked pipeline most.

For each candidate factor the Byzantine messages are built, the pipeline aggregates honest
and Byzantine messages together, and the candidate whose output lies farthest (Euclidean)
from the honest mean wins. The choice stays on the device (argmax, no host sync).
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import Attack, iterations, mean_and_std, pipeline_of, real, repeat
from .basic import alie_z

Aggregate = Callable[[torch.Tensor], torch.Tensor]


class _LineSearch(Attack):
    needs_pipeline = True

    def __init__(self, pipeline: Aggregate, low: float, high: float, steps: int):
        low, high = real(self.name, "low", low), real(self.name, "high", high)
        self.steps = iterations(self.name, "steps", steps, 2)
        if not high > low:
            raise ValueError(f"{self.name}: needs high > low, got low={low}, high={high}")
        self.pipeline, self.low, self.high = pipeline_of(self.name, pipeline), low, high

    def direction(self, honest: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(base, dir): the Byzantine message for factor t is base + t * dir."""
        raise NotImplementedError

    def forge(self, honest, f):
        base, direction = self.direction(honest, f)
        target = honest.mean(0)
        factors = torch.linspace(self.low, self.high, self.steps, device=honest.device, dtype=honest.dtype)
        damage = torch.stack([
            torch.linalg.vector_norm(self.pipeline(torch.cat([honest, repeat(base + t * direction, f)])) - target)
            for t in factors
        ])
        best = torch.nan_to_num(damage, nan=-1.0).argmax()
        self.last_factor = factors[best]  # a tensor: reading it is the caller's sync, not ours
        return repeat(base + factors[best] * direction, f)


class OptimalFOE(_LineSearch):
    """FOE with eps line-searched over [low, high]: Byzantine message -eps * mean(honest)."""

    name = "opt-foe"

    def __init__(self, pipeline: Aggregate, low: float = 0.0, high: float = 20.0, steps: int = 21):
        super().__init__(pipeline, low, high, steps)

    def direction(self, honest, f):
        mean = honest.mean(0)
        return torch.zeros_like(mean), -mean


class OptimalALIE(_LineSearch):
    """ALIE with z line-searched over [low, high]: mean(honest) - z * std(honest) (sample std)."""

    name = "opt-alie"

    def __init__(self, pipeline: Aggregate, low: float = 0.0, high: float = 10.0, steps: int = 21):
        super().__init__(pipeline, low, high, steps)

    def direction(self, honest, f):
        mean, std = mean_and_std(honest)
        return mean, -std


class Adaptive(Attack):
    """The adaptive attack of FLTrust's paper (Cao, Fang, Liu and Gong, NDSS 2021), for any
    pipeline: f identical Byzantine messages b chosen against the aggregate the server computes,
    with everything the server uses (FLTrust: this round's reference, which Cao et al.'s attacker
    knows). The objective is theirs (Fang et al.'s directed deviation): minimize s . F(honest, b,
    ..., b), s = sign(mean(honest)), so the server's step goes against the honest direction.
    Cao et al. solve it with their own approximation; here `steps` steps of normalized gradient
    descent through the pipeline (torch autograd), from the honest mean, each of length `lr` x
    ||mean(honest)||, the best iterate kept. Needs a pipeline torch can differentiate: a rule that
    works on the host (cclust, signguard) raises at its first round."""

    name = "adaptive"
    needs_pipeline = True

    def __init__(self, pipeline: Aggregate, steps: int = 10, lr: float = 0.2):
        self.pipeline = pipeline_of(self.name, pipeline)
        self.steps = iterations(self.name, "steps", steps)
        self.lr = real(self.name, "lr", lr, 0.0, low_open=True)

    def forge(self, honest, f):
        honest = honest.detach()
        mean = honest.mean(0)
        sign = torch.sign(mean)
        step = self.lr * torch.linalg.vector_norm(mean)
        directed = lambda b: sign @ self.pipeline(torch.cat([honest, b.expand(f, -1)]))
        b, best, best_value = mean.clone(), None, None
        for i in range(self.steps + 1):
            if i < self.steps:
                with torch.enable_grad():
                    b.requires_grad_(True)
                    value = directed(b)
                    (grad,) = torch.autograd.grad(value, b)
            else:  # the last iterate is only scored: no backward pass (the pipeline's costliest part)
                with torch.no_grad():
                    value = directed(b)
            with torch.no_grad():
                better = value < best_value if best_value is not None else torch.ones((), dtype=torch.bool)
                best = torch.where(better, b, best) if best is not None else b.detach()  # on the device: no host sync
                best_value = torch.where(better, value, best_value) if best_value is not None else value.detach()
                if i < self.steps:
                    length = torch.linalg.vector_norm(grad)
                    b = b - step * grad / torch.where(length > 0, length, torch.ones_like(length))
        return repeat(best.detach(), f)


__all__ = ["Adaptive", "OptimalFOE", "OptimalALIE", "alie_z"]
