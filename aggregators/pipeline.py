"""Composition: pre-aggregators then one aggregator, and `build` from a spec like "nnm+median"."""

from __future__ import annotations

import functools
import inspect

import torch

from .base import Rule, check_messages, check_reference, draws, is_stateful, sanitize
from .catalogue import CAF, SMEA, Bulyan, DnC, FLTrust, MinimumDiameterAveraging
from .clustering import ClippedClustering, SignGuard
from .plugins import resolve
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
             MoNNA, NNM, Bucketing, Clipping, ARC, MinimumDiameterAveraging, SMEA, CAF, Bulyan, DnC, SignGuard,
             ClippedClustering, FLTrust):
    register(_cls)


def step_class(name: str) -> type[Rule]:
    """The class of one spec step, a registered name or a `module:Name` reference."""
    return resolve(name, {**PRE_AGGREGATORS, **AGGREGATORS}, Rule, "aggregation step")


class Pipeline:
    """Pre-aggregators, then an aggregator: (n, d) -> (d,). The input is sanitized once, up
    front (see `aggregators.base`), whatever the steps are, so a plain "mean" pipeline never
    lets a NaN or inf through either. An aggregator that `needs_reference` (FLTrust) gets the
    server's reference message, sanitized alike; pre-aggregators never see it."""

    def __init__(self, pre: list[Rule], agg: Rule):
        self.pre, self.agg = list(pre), agg
        self.spec = "+".join([p.name for p in self.pre] + [agg.name])
        for step in self.pre:
            if getattr(step, "needs_reference", False):
                raise ValueError(f"{step.name}: a pre-aggregator cannot take the reference message "
                                 f"(only the aggregator of a spec gets it)")

    def check(self, n: int) -> None:
        """Raise a ValueError unless every step can run on n messages."""
        for step in self.pre:
            n = step.rows_out(n)
        self.agg.rows_out(n)

    @property
    def random(self) -> bool:
        """Whether a step draws random numbers (bucketing, dnc, signguard)."""
        return any(step.random for step in self.pre + [self.agg])

    def draws(self, d: int) -> bool:
        """Whether a call on (n, d) messages draws random numbers: a random step may not at
        every width (dnc samples coordinates only when d > b), and then vmap can batch it."""
        return any(draws(step, d) for step in self.pre + [self.agg])

    @property
    def stateful(self) -> bool:
        """Whether a step keeps state across calls (cc's previous output, cclust's norms seen)."""
        return is_stateful(self)

    @property
    def vmappable(self) -> bool:
        """Whether torch.vmap can batch every step (False: one runs on the host, e.g. cclust)."""
        return all(getattr(step, "vmappable", True) for step in self.pre + [self.agg])

    @property
    def needs_reference(self) -> bool:
        """Whether the aggregator takes the server's reference message (call it as
        `pipeline(messages, reference=g0)`)."""
        return bool(getattr(self.agg, "needs_reference", False))

    def stacked(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        """(b, n, d) -> (b, d): the pipeline on each of b stacked message sets, in one batched
        call (torch.vmap); `reference` (b, d): one reference message per set, for a pipeline
        that `needs_reference`. A pipeline that draws at this width runs them one after another
        instead, each drawing from its generator in turn, because vmap cannot draw from an
        explicit generator;
        so do a stateful pipeline (each set sees the state the one before left, as in separate
        calls) and one with a step that runs on the host (`vmappable = False`)."""
        if x.dim() != 3:
            raise ValueError(f"{self.spec}: stacked messages must be a 3-D (b, n, d) tensor, got shape {tuple(x.shape)}")
        if not self.needs_reference:
            if self.draws(x.shape[2]) or self.stateful or not self.vmappable:
                return torch.stack([self(messages) for messages in x])
            return torch.vmap(self)(x)
        if not isinstance(reference, torch.Tensor) or reference.shape != (x.shape[0], x.shape[2]):
            got = tuple(reference.shape) if isinstance(reference, torch.Tensor) else reference
            raise ValueError(f"{self.spec}: stacked messages {tuple(x.shape)} need a ({x.shape[0]}, {x.shape[2]}) "
                             f"reference, one message per set, got {got}")
        if self.draws(x.shape[2]) or self.stateful or not self.vmappable:
            return torch.stack([self(messages, ref) for messages, ref in zip(x, reference)])
        return torch.vmap(self)(x, reference)

    def __call__(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        """The pipeline on messages x (n, d). `reference` (d,): the server's reference message,
        required when the aggregator `needs_reference`, ignored otherwise."""
        check_messages(x, self.spec)
        self.check(x.shape[0])
        if self.needs_reference:
            reference = sanitize(check_reference(reference, x, self.spec))
        x, d = sanitize(x), x.shape[1:]
        for step in self.pre:
            x = step.apply(x)
            if x.dim() != 2 or x.shape[1:] != d:
                raise ValueError(f"{self.spec}: pre-aggregator {step.name!r} returned shape {tuple(x.shape)}; a "
                                 f"pre-aggregator returns (rows, {d[0]}) rows")
        out = self.agg.apply(x, reference) if self.needs_reference else self.agg.apply(x)
        if not isinstance(out, torch.Tensor) or out.shape != d:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{self.spec}: aggregator {self.agg.name!r} returned {got} for {x.shape[0]} messages of "
                             f"{d[0]} values; an aggregator returns one ({d[0]},) vector")
        return out

    def __repr__(self) -> str:
        return f"Pipeline({', '.join(map(repr, self.pre + [self.agg]))})"


def shown_params(spec: str, params: dict) -> dict:
    """`params` plus, for each step of `spec` that declares `shown_defaults`, those parameters at
    the value the step takes from `params`: what a label shows, so that two rows of one rule
    that differ only by a default (cc at tau 10 and at tau 1) do not read alike. A step whose
    `explicit_defaults` are not all in `params` adds nothing: such a stored run meant an older
    default, which a new instance would misstate."""
    shown = dict(params)
    try:
        classes = [step_class(step.strip()) for step in spec.split("+")]
    except (ValueError, TypeError, AttributeError):
        return shown
    for cls in classes:
        names = [k for k in getattr(cls, "shown_defaults", ()) if k not in shown]
        if not names or not set(getattr(cls, "explicit_defaults", {})) <= set(params):
            continue
        try:
            step = cls(**{k: v for k, v in params.items() if k in _accepted(cls)})
        except (TypeError, ValueError):
            continue
        shown.update({k: getattr(step, k) for k in names})
    return shown


@functools.cache  # inspect.signature is most of a build's time, and builds are many (kit, filters)
def _accepted(cls) -> frozenset[str]:
    """The keywords a step's constructor names (not `*args`, `**kwargs`: a step without a
    constructor of its own has object's, which takes nothing)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(k for k, p in inspect.signature(cls.__init__).parameters.items() if p.kind in named) - {"self"}


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
    try:
        classes = [step_class(name) for name in names]
    except ValueError as e:
        raise ValueError(f"spec {spec!r}: {e}") from None
    *pre, last = classes
    if last.pre:
        raise ValueError(f"spec {spec!r}: {names[-1]!r} is a pre-aggregator: end the spec with an aggregator; "
                         f"aggregators: {', '.join(AGGREGATORS)} or 'module:Name'")
    for name, cls in zip(names, pre):
        if not cls.pre:
            raise ValueError(f"spec {spec!r}: {name!r} is an aggregator: only the last step may be one; "
                             f"pre-aggregators: {', '.join(PRE_AGGREGATORS)} or 'module:Name'")
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
        except (TypeError, ValueError) as e:  # a user's constructor may say neither its name nor what it was given
            text = str(e)
            if not text.startswith(f"{cls.name}:"):  # the built-ins name themselves and the parameter
                given_words = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "f") or "no parameters"
                text = f"{cls.name} ({given_words}): {text}"
            raise ValueError(text) from None
    pipeline = Pipeline(steps[:-1], steps[-1])
    if n is not None:
        pipeline.check(n)
    return pipeline
