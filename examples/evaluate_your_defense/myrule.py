"""A defense of one's own: drop the f messages farthest from the coordinate-wise median, and
average the rest.

An `aggregators.Rule` subclass: `apply` takes sanitized (n, d) messages and returns one (d,)
vector; the class attributes declare what it promises, and `robustbn check-aggregator`
holds it to them."""

import torch

import aggregators


class DropFarthest(aggregators.Rule):
    name = "drop-farthest"
    translation_equivariant = scale_equivariant = True

    def __init__(self, f: int):
        self.f = f

    def rows_out(self, n):
        if n <= self.f:
            raise ValueError(f"{self.name}: needs more than f = {self.f} messages, got {n}")
        return 1

    def apply(self, x):
        n = x.shape[0]
        distance = torch.linalg.vector_norm(x - x.median(0).values, dim=1)
        # ranks by a stable sort: equal distances keep the same rows whatever their order
        keep = distance.argsort(stable=True).argsort() < n - self.f
        return (x * keep[:, None]).sum(0) / (n - self.f)
