"""A defense of one's own: the coordinate-wise median of the messages' nearest neighbours'
means, with an extra step that clips each message to three times the median norm first.

Any `aggregators.Rule` subclass works: `apply` takes sanitized (n, d) messages and returns
one (d,) vector; `rows_out` checks n; the class attributes declare the properties the kit
(`robustbn check-aggregator`) holds it to."""

import torch

import aggregators


class ClipToMedianNorm(aggregators.Rule):
    """Pre-aggregator: scale every message whose norm exceeds `factor` x the median norm down to it."""

    name = "clip-median-norm"
    pre = True
    scale_equivariant = True

    def __init__(self, factor: float = 3.0):
        if not factor > 0:
            raise ValueError(f"{self.name}: factor must be > 0, got {factor!r}")
        self.factor = float(factor)

    def rows_out(self, n):
        return n

    def apply(self, x):
        norms = torch.linalg.vector_norm(x, dim=1)
        limit = self.factor * norms.median()
        scale = torch.where(norms > limit, limit / norms.clamp_min(1e-30), torch.ones_like(norms))
        return x * scale[:, None]


class MedianOfMeans(aggregators.Rule):
    """Aggregator: split the messages into `groups` consecutive groups, average each, take the
    coordinate-wise median of the group means."""

    name = "median-of-means"
    translation_equivariant = scale_equivariant = True
    permutation_invariant = False  # the groups follow the message order

    def __init__(self, f: int, groups: int = 3):
        self.f, self.groups = f, groups

    def rows_out(self, n):
        if self.groups > n:
            raise ValueError(f"{self.name}: needs at least groups = {self.groups} messages, got {n}")
        return 1

    def apply(self, x):
        means = torch.stack([chunk.mean(0) for chunk in x.tensor_split(self.groups)])
        return means.median(0).values
