"""(f, kappa)-robustness, the definition: what a rule declares and the ratio that checks it.

(f, kappa)-robustness (Allouah et al., AISTATS 2023): for every choice of the f Byzantine rows,

    ||F(x) - mean_H||^2 <= kappa * mean_{i in H} ||x_i - mean_H||^2,     H the n - f honest rows,

and no rule beats kappa = f / (n - 2f). `kappa_of` reads a pipeline's declared bound, `ratio`
the two sides' quotient for one message set. The property kit (`aggregators.testing`) checks
the declared bound on drawn message sets; measuring a rule's kappa against every registered
attack needs the attack catalogue too, and lives above both packages, in `robustbn.kappa`.
"""

from __future__ import annotations

import math

import torch

from .pipeline import Pipeline


def lower_bound(n: int, f: int) -> float:
    """f / (n - 2f): no rule has a smaller kappa (Allouah et al. 2023, Proposition 6)."""
    return f / (n - 2 * f)


def kappa_of(p: Pipeline, n: int, f: int) -> float | None:
    """The pipeline's declared (f, kappa) bound for n messages: its aggregator's `kappa(n, f)`,
    through NNM as Allouah et al. (2023, Lemma 2) bound it (8f/(n-f) (kappa + 1)); None when a
    step declares none."""
    kappa = getattr(p.agg, "kappa", lambda n, f: None)(n, f)
    if kappa is None:
        return None
    for step in reversed(p.pre):
        if step.name != "nnm":
            return None
        kappa = 8 * f / (n - f) * (kappa + 1)
    return kappa


def ratio(out: torch.Tensor, honest: torch.Tensor) -> float:
    """||out - mean_H||^2 / mean_{i in H} ||x_i - mean_H||^2 in float64 (inf for a non-finite
    output or an error over honest rows all alike)."""
    honest, out = honest.double(), out.double()
    center = honest.mean(0)
    spread = float(((honest - center) ** 2).sum(1).mean())
    error = float(((out - center) ** 2).sum())
    if not math.isfinite(error):
        return math.inf
    if spread == 0.0:
        return 0.0 if error == 0.0 else math.inf
    return error / spread


__all__ = ["kappa_of", "lower_bound", "ratio"]
