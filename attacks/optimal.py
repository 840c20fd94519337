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


__all__ = ["OptimalFOE", "OptimalALIE", "alie_z"]
