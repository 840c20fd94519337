"""Composition: pre-aggregators then one aggregator, and `build` from a spec like "nnm+median"."""

from __future__ import annotations

import inspect

import torch

from .base import Rule, check_messages, sanitize
from .plugins import is_reference, load
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

AGGREGATORS: dict[str, type[Rule]] = {}
PRE_AGGREGATORS: dict[str, type[Rule]] = {}


def register(cls: type[Rule]) -> type[Rule]:
    """Add a rule class under its `name` (usable as a decorator): a pre-aggregator when its
    class attribute `pre` is true, else an aggregator. Its name is then a step of any spec."""
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise TypeError(f"register: {cls!r} is not a subclass of aggregators.Rule")
    if not isinstance(cls.name, str) or not cls.name or "+" in cls.name or ":" in cls.name or cls.name != cls.name.lower():
        raise ValueError(f"register: {cls.__name__}.name must be a lower-case name without '+' or ':', got {cls.name!r}")
    (PRE_AGGREGATORS if cls.pre else AGGREGATORS)[cls.name] = cls
    return cls


for _cls in (Mean, CoordinateWiseMedian, TrimmedMean, Krum, MultiKrum, GeometricMedian, CenteredClipping, Meamed,
             MoNNA, NNM, Bucketing, Clipping, ARC):
    register(_cls)


def step_class(name: str) -> type[Rule] | None:
    """The class of one spec step, a registered name or a `module:Name` reference (None: no
    such name registered)."""
    if is_reference(name):
        return load(name, Rule, "aggregation step")
    key = name.strip().lower()
    return AGGREGATORS.get(key) or PRE_AGGREGATORS.get(key)


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


def build(spec: str, f: int = 0, n: int | None = None, seed: int | None = None, **params) -> Pipeline:
    """Build a pipeline from a spec: pre-aggregator steps then one aggregator step, joined by
    '+', e.g. "median", "nnm+trmean", "bucketing+krum", "nnm+myrules:MyTrimmedMean". A step
    is a registered name or a `module:Name` reference to a `Rule` subclass (a pre-aggregator
    when its class attribute `pre` is true).

    `f` goes to every step that takes it; each keyword in `params` goes to every step whose
    constructor takes it (e.g. `s=2` to bucketing, `tau=0.5` to cc). `seed` goes to every
    step that draws random numbers (`random = True`) and takes a seed, unless `params` sets
    one. With `n` given, the pipeline is checked for n messages right away. Anything unknown
    or impossible raises a ValueError saying what is allowed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"aggregation spec must be a non-empty string like 'nnm+median', got {spec!r}")
    names = [s.strip() for s in spec.split("+")]
    classes = [step_class(name) for name in names]
    *pre, last = classes
    if last is None or last.pre:
        hint = " (it is a pre-aggregator: end the spec with an aggregator)" if last is not None else ""
        raise ValueError(f"unknown aggregator {names[-1]!r} in spec {spec!r}{hint}; "
                         f"allowed: {', '.join(sorted(AGGREGATORS))} or 'module:Name'")
    for name, cls in zip(names, pre):
        if cls is None or not cls.pre:
            hint = " (an aggregator: only the last step may be one)" if cls is not None else ""
            raise ValueError(f"unknown pre-aggregator {name!r} in spec {spec!r}{hint}; "
                             f"allowed: {', '.join(sorted(PRE_AGGREGATORS))} or 'module:Name'")
    accepted = set().union(*(_accepted(c) for c in classes))
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(f"parameter(s) {', '.join(sorted(unknown))} not taken by any step of {spec!r}; "
                         f"allowed: {', '.join(sorted(accepted - {'f'})) or 'none'}")
    given = {"f": f, **params}
    steps = []
    for cls in classes:
        kwargs = {k: v for k, v in given.items() if k in _accepted(cls)}
        if cls.random and seed is not None and "seed" in _accepted(cls):
            kwargs.setdefault("seed", seed)
        try:
            steps.append(cls(**kwargs))
        except TypeError as e:  # a user's constructor that does not take what it declares
            raise ValueError(f"{cls.name}: {e}") from None
    pipeline = Pipeline(steps[:-1], steps[-1])
    if n is not None:
        pipeline.check(n)
    return pipeline
