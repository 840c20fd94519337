"""Composition: pre-aggregators then one aggregator, and `build` from a spec like "nnm+median"."""

from __future__ import annotations

import inspect

import torch

from .base import Rule, check_messages, sanitize
from .pre import ARC, NNM, Bucketing, Clipping
from .rules import (
    CenteredClipping,
    CoordinateWiseMedian,
    GeometricMedian,
    Krum,
    Mean,
    Meamed,
    MoNNA,
    MultiKrum,
    TrimmedMean,
)

AGGREGATORS = {c.name: c for c in (Mean, CoordinateWiseMedian, TrimmedMean, Krum, MultiKrum,
                                   GeometricMedian, CenteredClipping, Meamed, MoNNA)}
PRE_AGGREGATORS = {c.name: c for c in (NNM, Bucketing, Clipping, ARC)}


class Pipeline:
    """Pre-aggregators, then an aggregator: (n, d) -> (d,). The input is sanitized once, up
    front (see `aggregators.base`), whatever the steps are, so a plain "mean" pipeline never
    lets a NaN or inf through either."""

    def __init__(self, pre: list[Rule], agg: Rule):
        self.pre, self.agg = list(pre), agg
        self.spec = "+".join([p.name for p in self.pre] + [agg.name])

    def check(self, n: int) -> None:
        """Raise a ValueError unless every step can run on n messages."""
        for step in self.pre:
            n = step.rows_out(n)
        self.agg.rows_out(n)

    @property
    def random(self) -> bool:
        """Whether a step draws random numbers (bucketing)."""
        return any(step.random for step in self.pre + [self.agg])

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """(b, n, d) -> (b, d): the pipeline on each of b stacked message sets, in one batched
        call (torch.vmap). A random pipeline runs them one after another instead, each drawing
        from its generator in turn, because vmap cannot draw from an explicit generator."""
        if x.dim() != 3:
            raise ValueError(f"{self.spec}: stacked messages must be a 3-D (b, n, d) tensor, got shape {tuple(x.shape)}")
        if self.random:
            return torch.stack([self(messages) for messages in x])
        return torch.vmap(self)(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_messages(x, self.spec)
        self.check(x.shape[0])
        x = sanitize(x)
        for step in self.pre:
            x = step.apply(x)
        return self.agg.apply(x)

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(map(repr, self.pre + [self.agg]))})"


def _accepted(cls) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def build(spec: str, f: int = 0, n: int | None = None, **params) -> Pipeline:
    """Build a pipeline from a spec: pre-aggregator names then one aggregator name, joined by
    '+', e.g. "median", "nnm+trmean", "bucketing+krum".

    `f` goes to every step that takes it; each keyword in `params` goes to every step whose
    constructor takes it (e.g. `s=2` to bucketing, `tau=0.5` to cc). With `n` given, the
    pipeline is checked for n messages right away. Anything unknown or impossible raises a
    ValueError saying what is allowed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"aggregation spec must be a non-empty string like 'nnm+median', got {spec!r}")
    names = [s.strip().lower() for s in spec.split("+")]
    *pre_names, agg_name = names
    if agg_name not in AGGREGATORS:
        hint = " (it is a pre-aggregator: end the spec with an aggregator)" if agg_name in PRE_AGGREGATORS else ""
        raise ValueError(f"unknown aggregator {agg_name!r} in spec {spec!r}{hint}; "
                         f"allowed: {', '.join(sorted(AGGREGATORS))}")
    for p in pre_names:
        if p not in PRE_AGGREGATORS:
            raise ValueError(f"unknown pre-aggregator {p!r} in spec {spec!r}; "
                             f"allowed: {', '.join(sorted(PRE_AGGREGATORS))}")
    classes = [PRE_AGGREGATORS[p] for p in pre_names] + [AGGREGATORS[agg_name]]
    accepted = set().union(*(_accepted(c) for c in classes))
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(f"parameter(s) {', '.join(sorted(unknown))} not taken by any step of {spec!r}; "
                         f"allowed: {', '.join(sorted(accepted - {'f'})) or 'none'}")
    given = {"f": f, **params}
    steps = [c(**{k: v for k, v in given.items() if k in _accepted(c)}) for c in classes]
    pipeline = Pipeline(steps[:-1], steps[-1])
    if n is not None:
        pipeline.check(n)
    return pipeline
