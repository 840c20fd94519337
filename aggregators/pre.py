"""Pre-aggregators: (n, d) messages -> (m, d) messages, applied before an aggregator."""

from __future__ import annotations

import math

import torch

from .base import Generated, Rule, check_f, nearest_mean_weights, sq_distances, with_diagonal, working_dtype
from .checks import integer, real


class NNM(Rule):
    """Nearest-neighbour mixing (Allouah et al. 2023): each row becomes the mean of its n - f
    nearest rows (Euclidean, itself included). Output rows are convex combinations of the
    inputs. Requires f < n. Distances: one matrix product; mixing: one more."""

    name = "nnm"
    pre = True
    translation_equivariant = scale_equivariant = True

    def __init__(self, f: int):
        self.f = check_f(f, self.name)

    def rows_out(self, n):
        if self.f >= n:
            raise ValueError(f"{self.name}: needs f < n, got f={self.f}, n={n}")
        return n

    def apply(self, x):
        dist = with_diagonal(sq_distances(x, x), -1.0)  # each row always mixes itself in, even among exact duplicates
        w = nearest_mean_weights(dist, x.shape[0] - self.f)
        return w.to(x.dtype) @ x


class Bucketing(Rule, Generated):
    """Bucketing (Karimireddy et al. 2022): shuffle the rows, average consecutive groups of s
    (the last group may be smaller): ceil(n / s) output rows. The shuffle draws from an
    explicit generator (`generator`, or one per device seeded with `seed`)."""

    name = "bucketing"
    pre = True
    random = True

    def __init__(self, s: int = 2, seed: int = 0, generator: torch.Generator | None = None):
        self.s = integer(self.name, "s (bucket size)", s, 1)
        self._init_generator(seed, generator)

    def rows_out(self, n):
        return math.ceil(n / self.s)

    def apply(self, x):
        n, s = x.shape[0], self.s
        g = self.generator_for(x.device)
        perm = torch.randperm(n, generator=g, device=g.device).to(x.device)
        bucket = torch.arange(n, device=x.device) // s
        sizes = torch.full((math.ceil(n / s),), float(s), device=x.device, dtype=x.dtype)
        sizes[-1] = n - s * (len(sizes) - 1)
        w = torch.zeros(len(sizes), n, device=x.device, dtype=x.dtype)
        w[bucket, perm] = (1.0 / sizes)[bucket]
        return w @ x


def _scale_rows(x: torch.Tensor, norms: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Scale rows whose norm exceeds `threshold` down to it (inf norms go to 0)."""
    scale = torch.where(norms > threshold, threshold / norms, torch.ones_like(norms))
    return x * torch.nan_to_num(scale, nan=0.0, posinf=1.0).to(x.dtype)[:, None]


class Clipping(Rule):
    """Static clipping: rows with norm above c are scaled to norm c. c=None clips at the
    median row norm of the round (adaptive, scale-equivariant)."""

    name = "clipping"
    pre = True

    def __init__(self, c: float | None = None):
        radius = "c (the clipping radius; None: the median norm)"
        self.c = None if c is None else real(self.name, radius, c, 0.0, low_open=True)
        # a fixed radius clips n copies of a long row and does not scale; the median norm does neither
        self.identity_on_identical = self.scale_equivariant = c is None

    def rows_out(self, n):
        return n

    def apply(self, x):
        norms = torch.linalg.vector_norm(working_dtype(x), dim=1)
        threshold = norms.median() if self.c is None else torch.tensor(self.c, device=x.device)
        return _scale_rows(x, norms, threshold)


class ARC(Rule):
    """Adaptive robust clipping (Allouah et al. 2024): the k = floor(2 (f/n) (n - f)) rows of
    largest norm are clipped to the norm of the (k+1)-th largest. Requires 2f < n."""

    name = "arc"
    pre = True
    scale_equivariant = True

    def __init__(self, f: int):
        self.f = check_f(f, self.name)

    def rows_out(self, n):
        if 2 * self.f >= n:
            raise ValueError(f"{self.name}: needs 2f < n, got f={self.f}, n={n}")
        return n

    def apply(self, x):
        n = x.shape[0]
        k = 2 * self.f * (n - self.f) // n
        if k == 0:
            return x.clone()
        norms = torch.linalg.vector_norm(working_dtype(x), dim=1)
        threshold = norms.sort(descending=True).values[k]
        return _scale_rows(x, norms, threshold)
