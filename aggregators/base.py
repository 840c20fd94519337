"""Shared machinery of every rule: input checks, the hostile-input policy, distances.

Hostile-input policy (applies to every rule that sanitizes, i.e. all but `Mean` used alone,
and to every `Pipeline`): each non-finite entry (NaN, +inf, -inf) is replaced by 0 before
the rule runs. A row that carried such entries stays what it was, a Byzantine row, now
finite, and the rule's robustness argument covers it like any other Byzantine row. Huge
finite values (1e38) are left as they are; distances that overflow count as +inf, so such
rows are simply "far" and never overflow the output, which is always built from
convex combinations or order statistics of the inputs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .checks import generator as check_generator
from .checks import integer
from .checks import seed as check_seed


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` with NaN and +-inf entries replaced by 0 (never modifies `x`)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def check_messages(x: torch.Tensor, rule: str) -> None:
    """Raise a ValueError unless `x` is a floating (n, d) tensor with n >= 1."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{rule}: messages must be a torch.Tensor of shape (n, d), got {type(x).__name__}")
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"{rule}: messages must have shape (n, d) with n >= 1, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{rule}: messages must be a floating-point tensor, got {x.dtype}")


def check_f(f: int, rule: str) -> int:
    return integer(rule, "f (number of Byzantine messages)", f, 0)


def check_reference(reference, x: torch.Tensor, rule: str) -> torch.Tensor:
    """The server's reference message for messages `x` (n, d): a floating (d,) tensor on x's
    device, returned in x's dtype (a ValueError naming `rule` otherwise, or when it is missing)."""
    if reference is None:
        raise ValueError(f"{rule}: needs the server's reference message: call it as {rule}(messages, reference=g0) "
                         f"with g0 a ({x.shape[-1]},) tensor")
    if not isinstance(reference, torch.Tensor) or not reference.is_floating_point():
        raise ValueError(f"{rule}: the reference must be a floating-point torch.Tensor, got "
                         f"{getattr(reference, 'dtype', type(reference).__name__)}")
    if tuple(reference.shape) != tuple(x.shape[1:]):
        raise ValueError(f"{rule}: the reference must have shape {tuple(x.shape[1:])} (one message), "
                         f"got {tuple(reference.shape)}")
    if reference.device != x.device:
        raise ValueError(f"{rule}: the reference is on {reference.device}, the messages on {x.device}")
    return reference.to(x.dtype)


def working_dtype(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are promoted for distance arithmetic (their range overflows at 6.5e4)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def sq_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances (n, m) between rows of x (n, d) and y (m, d).

    One matrix product (|a|^2 + |b|^2 - 2 a.b), never an (n, m, d) intermediate. Entries that
    overflow (inf - inf = NaN) become +inf; cancellation noise below 0 becomes 0.
    """
    xw, yw = working_dtype(x), working_dtype(y)
    d = (xw * xw).sum(1)[:, None] + (yw * yw).sum(1)[None, :] - 2.0 * (xw @ yw.T)
    return torch.nan_to_num(d, nan=float("inf"), posinf=float("inf")).clamp_min_(0.0)


def with_diagonal(d: torch.Tensor, value: float) -> torch.Tensor:
    """Square `d` with its diagonal set to `value`, out of place (so torch.vmap batches it)."""
    eye = torch.eye(d.shape[-1], dtype=torch.bool, device=d.device)
    return d.masked_fill(eye, value)


def pairwise_sq_distances(x: torch.Tensor) -> torch.Tensor:
    """(n, n) squared distances with an exact zero diagonal."""
    return with_diagonal(sq_distances(x, x), 0.0)


def smallest(x: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Indices of the k smallest entries along `dim`, ties broken by position: a stable sort,
    because topk breaks ties differently on each device and under torch.vmap."""
    return x.sort(dim=dim, stable=True).indices.narrow(dim, 0, k)


def nearest_mean_weights(dist: torch.Tensor, k: int) -> torch.Tensor:
    """Row-stochastic (r, n) weights: 1/k on each row's k nearest columns by `dist` (r, n),
    ties broken by column order (`smallest`)."""
    idx = smallest(dist, k, dim=1)
    return torch.zeros_like(dist).scatter(1, idx, 1.0 / k)


def device_generator(cache: dict, seed: int, device: torch.device) -> torch.Generator:
    """One explicit generator per device, created from `seed` on first use."""
    if device not in cache:
        cache[device] = torch.Generator(device=device).manual_seed(seed)
    return cache[device]


class Generated:
    """Mixin of a rule or attack that draws random numbers: from an explicit generator, or
    from one per device seeded with `seed` (both checked, named by the class's `name`)."""

    def _init_generator(self, seed: int, generator: torch.Generator | None) -> None:
        self.seed = check_seed(self.name, seed)
        self._generator, self._per_device = check_generator(self.name, generator), {}

    def generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is not None:
            return self._generator
        return device_generator(self._per_device, self.seed, device)


class Rule:
    """A step of a pipeline. Subclasses implement `apply` (on sanitized input) and `rows_out`.

    `rows_out(n)` validates that the rule can run on n messages (ValueError otherwise) and
    returns how many rows it outputs (1 for an aggregator's single vector). An aggregator with
    `needs_reference = True` (FLTrust) implements `apply(x, reference)` instead: the reference is
    a (d,) message the server trusts (e.g. its own gradient), sanitized like the messages.
    """

    name = "rule"
    sanitizes = True
    random = False  # draws random numbers (then torch.vmap cannot batch it; `build` gives it a seed)
    vmappable = True  # torch.vmap can batch it (False: its work runs on the host, e.g. scipy clustering)
    needs_reference = False  # an aggregator that takes the server's reference message: `apply(x, reference)`
    pre = False  # a pre-aggregator: (n, d) -> (m, d) rows, placed before the aggregator of a spec
    # what the rule promises, checked by aggregators.testing (a pre-aggregator: that it keeps
    # the promise of the aggregator after it)
    permutation_invariant = True  # the order of the messages does not matter
    identity_on_identical = True  # n copies of one message give that message (with a reference: equal to it too)
    translation_equivariant = False  # F(x + t) = F(x) + t
    scale_equivariant = False  # F(c x) = c F(x), c > 0
    coordinatewise = False  # each output coordinate lies in the honest messages' range
    selects_by_score = False  # outputs rows chosen by a distance score (Krum): what Fang's Krum attack targets
    stateful = False  # keeps state across calls (cclust's norms seen), left as it was while `recording` is False
    recording = True  # a stateful rule updates its state only while True (`trials` sets it False)
    shown_defaults = ()  # parameters a label shows even at their default (cc's tau: it decides whether cc holds)

    def draws(self, d: int) -> bool:
        """Whether a call on messages of width d draws random numbers (then torch.vmap cannot
        batch it): `random`, unless the rule says when (dnc samples coordinates only when d > b)."""
        return self.random

    def kappa(self, n: int, f: int) -> float | None:
        """The (f, kappa)-robustness constant the rule is proven to have for n messages
        (Allouah et al. 2023): ||F(x) - mean_H||^2 <= kappa mean_{i in H} ||x_i - mean_H||^2
        for every n - f honest rows H; None: no such bound is claimed."""
        return None

    def rows_out(self, n: int) -> int:
        return 1

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        """The rule on messages x (n, d); `reference` (d,) is required by a rule that
        `needs_reference` and ignored by the others."""
        check_messages(x, self.name)
        self.rows_out(x.shape[0])
        clean = sanitize if self.sanitizes else (lambda t: t)
        if self.needs_reference:
            return self.apply(clean(x), clean(check_reference(reference, x, self.name)))
        return self.apply(clean(x))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def _stateful_steps(aggregate) -> list:
    """The `stateful` steps of a pipeline or rule (anything else callable: none)."""
    steps = [*aggregate.pre, aggregate.agg] if hasattr(aggregate, "agg") else [aggregate]  # a pipeline or not
    return [s for s in steps if getattr(s, "stateful", False)]


def is_stateful(aggregate) -> bool:
    """Whether a pipeline or rule has a step whose state its calls change: one such pipeline
    cannot stand in for another, equal one."""
    return bool(_stateful_steps(aggregate))


def draws(aggregate, d: int) -> bool:
    """Whether a pipeline or rule draws random numbers on messages of width d (then torch.vmap
    cannot batch it): its `draws(d)`, or for a callable without one, its `random` flag."""
    if hasattr(aggregate, "draws"):
        return bool(aggregate.draws(d))
    return bool(getattr(aggregate, "random", False))


@contextmanager
def trials(*aggregates):
    """Calls within are trials (an attack searching against the pipelines, candidates scored):
    the `stateful` steps of these pipelines or rules aggregate with their state and leave it as
    it was (`recording = False`), so that only the server's own calls change it."""
    steps = list({id(s): s for a in aggregates for s in _stateful_steps(a)}.values())
    before = [s.recording for s in steps]
    for s in steps:
        s.recording = False
    try:
        yield
    finally:
        for s, b in zip(steps, before):
            s.recording = b
