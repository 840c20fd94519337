"""A hypothesis kit for aggregation rules: strategies for message sets (honest rows and up to f
hostile ones: NaN, +-inf, 1e38, or adversarial finite values) and the properties that define
a robust rule. Any spec runs through it (built-in names, `module:Name` steps, pipelines):

    >>> from aggregators.testing import check
    >>> [p.status for p in check("nnm+median", f=2, examples=20)]  # doctest: +SKIP
    ['held', 'held', ...]

Which properties apply is read from the steps' class attributes (`Rule`): a rule opts into
translation and positive-scale equivariance (`translation_equivariant`,
`scale_equivariant`), the honest coordinate range (`coordinatewise`) and an (f, kappa)
bound (`kappa(n, f)`), and opts out of permutation invariance or identity on identical rows
(`permutation_invariant`, `identity_on_identical`); a random rule (`random`) is exempt from
the properties that compare two calls. A rule that needs the server's reference message
(`needs_reference`, FLTrust) gets one with every message set (the honest mean plus a small
perturbation), and every transformation applies to it too: the same shift, the same scale,
and for identity on identical rows, a reference equal to that row. `robustbn check-aggregator
SPEC` prints the report.

What needs the attack catalogue too sits above both packages: an attack's own checks
(`robustbn.attack_kit.check_attack`) and a rule's measured (f, kappa) (`robustbn.kappa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from .base import is_stateful, sanitize
from .pipeline import Pipeline, build
from .robustness import kappa_of, lower_bound

HOSTILE = (float("nan"), float("inf"), -float("inf"), 1e38, -1e38)


@dataclass
class Messages:
    """One message set: x (n, d), the f the rule is built for, which rows are hostile, and the
    server's reference message (d,) (drawn for a rule that `needs_reference`, else None)."""

    x: torch.Tensor
    f: int
    hostile: tuple[int, ...]
    reference: torch.Tensor | None = None

    @property
    def finite(self) -> torch.Tensor:
        """x in float64 with every hostile entry (non-finite or beyond 1e30) set to 0: the same
        number of rows, for the properties stated on ordinary values."""
        x = self.x.double()
        return torch.where(torch.isfinite(x) & (x.abs() < 1e30), x, torch.zeros_like(x))

    @property
    def honest(self) -> torch.Tensor:
        keep = [i for i in range(self.x.shape[0]) if i not in self.hostile]
        return self.x[keep]

    def __repr__(self) -> str:
        ref = "" if self.reference is None else \
            f", reference={np.array2string(self.reference.numpy(), precision=4, threshold=60)}"
        return (f"Messages(f={self.f}, hostile rows {list(self.hostile)}, x={self.x.dtype} "
                f"{np.array2string(self.x.numpy(), precision=4, threshold=60)}{ref})")


@st.composite
def message_sets(draw, n=None, f=None, d=None, dtypes=(torch.float32, torch.float64), hostile=True,
                 exactly_f=False, reference=False) -> Messages:
    """Message sets with n > 2f rows (n, f, d drawn unless given), honest values in
    [-1e3, 1e3] in general position, and up to f hostile rows (exactly f with `exactly_f`) in random places: each
    hostile entry NaN, +-inf, +-1e38, or the honest mean pushed along one direction by 1 to
    1e6 times the honest spread (the attacks that move a rule the most). With `reference`, also
    a reference message: the honest mean plus up to 0.5 honest spreads per coordinate."""
    n = draw(n) if isinstance(n, st.SearchStrategy) else n
    if f is None:
        f = draw(st.integers(0, 3 if n is None else (n - 1) // 2))
    n = draw(st.integers(2 * f + 1, 2 * f + 7)) if n is None else n
    d = draw(st.integers(1, 6)) if d is None else d
    dtype = draw(st.sampled_from(dtypes))
    values = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    x = torch.tensor(draw(st.lists(st.lists(values, min_size=d, max_size=d), min_size=n, max_size=n)),
                     dtype=torch.float64)
    # general position: no exact ties between values or distances, so that a selection by rank
    # or distance has one answer (hypothesis shrinks towards equal values otherwise)
    x += 1e-2 * torch.sqrt(torch.arange(1, n * d + 1, dtype=torch.float64) * 2.0 + 1.0).reshape(n, d)
    x = x.to(dtype)
    bad = 0
    if hostile and f:
        bad = f if exactly_f else draw(st.integers(0, f))
    rows = tuple(sorted(draw(st.permutations(range(n)))[:bad]))
    ref = None
    if reference:
        honest = x[[i for i in range(n) if i not in rows]]
        spread = honest.std(0, correction=0).norm() + 1.0
        shift = torch.tensor(draw(st.lists(st.sampled_from([-0.5, -0.1, 0.0, 0.1, 0.5]), min_size=d, max_size=d)),
                             dtype=dtype)
        ref = honest.mean(0) + spread * shift
    if bad:
        honest = x[[i for i in range(n) if i not in rows]]
        center, spread = honest.mean(0), honest.std(0, correction=0).norm() + 1.0
        direction = torch.tensor(draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=d, max_size=d)),
                                 dtype=dtype)
        direction = direction if direction.any() else torch.ones(d, dtype=dtype)
        for i in rows:
            kind = draw(st.sampled_from(["shift", "shift", "hostile", "mixed"]))
            push = center + draw(st.sampled_from([1.0, 3.0, 10.0, 1e3, 1e6])) * spread * direction
            if kind == "shift":
                x[i] = push
            elif kind == "hostile":
                x[i] = draw(st.sampled_from(HOSTILE))
            else:
                x[i] = torch.tensor([draw(st.sampled_from(HOSTILE)) if draw(st.booleans()) else float(v)
                                     for v in push], dtype=dtype)
    return Messages(x, f, rows, ref)


# ---- what a pipeline declares ------------------------------------------------------------

def _steps(p: Pipeline):
    return p.pre + [p.agg]


def _all(p: Pipeline, attribute: str, default: bool) -> bool:
    return all(getattr(step, attribute, default) for step in _steps(p))


# ---- properties ----------------------------------------------------------------------------

class NotApplicable(Exception):
    """The property does not apply to this pipeline (it declares no such behaviour)."""


def _close(a, b, what, rtol=1e-4, atol=1e-6):
    # rounding of sums and iterations (geomed) only: the numpy references test each rule's numbers
    scale = max(1.0, float(torch.nan_to_num(b.abs(), posinf=0.0, neginf=0.0).max()) if b.numel() else 1.0)
    if not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol * scale, equal_nan=False):
        raise AssertionError(f"{what}: {a.tolist()} != {b.tolist()}")


def _run(p: Pipeline, x: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """p on messages x, given the reference (in x's dtype) when p needs one."""
    if p.needs_reference:
        return p(x, reference=reference.to(x.dtype))
    return p(x)


def _finite_reference(m: Messages) -> torch.Tensor | None:
    """The reference in float64, like `Messages.finite`."""
    return None if m.reference is None else m.reference.double()


def one_answer_per_input(make, m: Messages):
    """Two calls of one pipeline on the same messages agree: a rule that keeps state across
    calls without declaring `stateful` fails here (a random or declared stateful one is exempt)."""
    p = make(m)
    if p.random or is_stateful(p):
        raise NotApplicable
    first = _run(p, m.x, m.reference).clone()
    _close(_run(p, m.x, m.reference), first, "a second call of one pipeline on the same messages (state kept "
                                             "across calls must be declared: stateful = True)")


def shape_dtype_device(make, m: Messages):
    out = _run(make(m), m.x, m.reference)
    if out.shape != m.x.shape[1:] or out.dtype != m.x.dtype or out.device != m.x.device:
        raise AssertionError(f"output {tuple(out.shape)} {out.dtype} on {out.device}, "
                             f"input rows {tuple(m.x.shape[1:])} {m.x.dtype} on {m.x.device}")


def input_not_written(make, m: Messages):
    before = m.x.clone()
    reference = None if m.reference is None else m.reference.clone()
    _run(make(m), m.x, m.reference)
    if not torch.equal(torch.nan_to_num(m.x, nan=7.0), torch.nan_to_num(before, nan=7.0)):
        raise AssertionError("the rule wrote into its input")
    if reference is not None and not torch.equal(m.reference, reference):
        raise AssertionError("the rule wrote into the reference message")


def finite_under_hostile_rows(make, m: Messages):
    out = _run(make(m), m.x, m.reference)
    if not torch.isfinite(out).all():
        raise AssertionError(f"non-finite output {out.tolist()} with {len(m.hostile)} <= f hostile rows")


def permutation_invariant(make, m: Messages):
    p = make(m)
    if p.random or not _all(p, "permutation_invariant", True):
        raise NotApplicable
    perm = torch.arange(m.x.shape[0] - 1, -1, -1)
    ref = _finite_reference(m)
    _close(_run(make(m), m.finite[perm], ref), _run(make(m), m.finite, ref), "rows reversed")


def _on_grid(x: torch.Tensor | None) -> torch.Tensor | None:
    """x rounded to multiples of 2^-16: such values plus integers are exact in float64, so a
    shifted set is exactly the set shifted and no near-tie of ranks or distances flips by
    rounding (a rule that selects would then pick another value: a tie, not a broken rule)."""
    return None if x is None else torch.round(x * 2.0**16) / 2.0**16


def translation_equivariant(make, m: Messages):
    p = make(m)
    if p.random or not _all(p, "translation_equivariant", False):
        raise NotApplicable
    x, ref = _on_grid(m.finite), _on_grid(_finite_reference(m))  # a shift of inf is not a shift
    t = torch.linspace(-50, 50, x.shape[1], dtype=x.dtype).round()
    _close(_run(make(m), x + t, None if ref is None else ref + t), _run(make(m), x, ref) + t, "shifted by t")


def scale_equivariant(make, m: Messages):
    p = make(m)
    if p.random or not _all(p, "scale_equivariant", False):
        raise NotApplicable
    x, ref = m.finite, _finite_reference(m)
    for c in (2.0**-10, 8.0, 2.0**10):  # powers of two scale exactly: no near-tie flips by rounding
        _close(_run(make(m), c * x, None if ref is None else c * ref), c * _run(make(m), x, ref), f"scaled by {c}")


def pre_aggregation_permutes_with_input(make, m: Messages):
    """A pre-aggregator that declares permutation invariance maps its rows one to one (NNM,
    clipping, ARC): reversing the input rows reverses its output rows."""
    p = make(m)
    steps = [s for s in p.pre if not s.random and s.permutation_invariant and s.rows_out(m.x.shape[0]) == m.x.shape[0]]
    if not steps:
        raise NotApplicable
    x, perm = m.finite, torch.arange(m.x.shape[0] - 1, -1, -1)
    for step in steps:
        _close(step(x[perm]), step(x)[perm], f"{step.name}: rows reversed")


def pipeline_equals_its_steps(make, m: Messages):
    """A spec is its steps applied in turn to the sanitized messages, each on the last one's
    output (two builds with the same seed: a random step draws alike)."""
    p, steps = make(m), make(m)
    if not p.pre:
        raise NotApplicable
    rows = sanitize(m.x)
    for step in steps.pre:
        rows = step(rows)
    ref = None if m.reference is None else sanitize(m.reference)
    _close(_run(p, m.x, m.reference), _run(Pipeline([], steps.agg), rows, ref), "the steps in turn")


def identity_on_identical_rows(make, m: Messages):
    """n copies of one row give that row (for a rule that needs a reference: the reference
    equal to that row too, every client agreeing with the server)."""
    p = make(m)
    if not _all(p, "identity_on_identical", True):
        raise NotApplicable
    row = m.finite[0]
    _close(_run(p, row.repeat(m.x.shape[0], 1), row), row, "n copies of one row")


def honest_coordinate_range(make, m: Messages):
    p = make(m)
    if p.pre or not getattr(p.agg, "coordinatewise", False):
        raise NotApplicable
    out, honest = _run(p, m.x, m.reference), m.honest.double()
    lo, hi = honest.min(0).values, honest.max(0).values
    slack = 1e-5 * torch.maximum(lo.abs(), hi.abs()) + 1e-6
    if not (torch.all(out.double() >= lo - slack) and torch.all(out.double() <= hi + slack)):
        raise AssertionError(f"output {out.tolist()} outside the honest range [{lo.tolist()}, {hi.tolist()}]")


def f_kappa_robust(make, m: Messages):
    """Allouah et al. (2023): ||F(x) - mean_H||^2 <= kappa * mean_{i in H} ||x_i - mean_H||^2,
    H the n - f honest rows (message sets with exactly f hostile, finite rows)."""
    p = make(m)
    n = m.x.shape[0]
    kappa = kappa_of(p, n, m.f)
    if kappa is None or p.random:
        raise NotApplicable
    if len(m.hostile) != m.f or not torch.isfinite(m.x).all():
        return  # the bound is stated for exactly f Byzantine rows, finite
    honest = m.honest.double()
    center = honest.mean(0)
    spread = ((honest - center) ** 2).sum(1).mean()
    error = ((_run(p, m.x, m.reference).double() - center) ** 2).sum()
    if error > kappa * spread * (1 + 1e-4) + 1e-6 * (1 + center.norm() ** 2):
        raise AssertionError(f"||F(x) - honest mean||^2 = {float(error):.6g} > kappa {kappa:.4g} x honest spread "
                             f"{float(spread):.6g}")


def stacked_equals_calls(make, m: Messages):
    """The batched call equals one call per set (two builds with one seed: a random pipeline
    draws for the sets in turn, as separate calls of one pipeline would)."""
    p, calls = make(m), make(m)
    sets = torch.stack([m.x, m.x.flip(0)])
    if p.needs_reference:
        refs = torch.stack([m.reference, m.reference])
        got, expected = p.stacked(sets, refs), torch.stack([calls(s, reference=r) for s, r in zip(sets, refs)])
    else:
        got, expected = p.stacked(sets), torch.stack([calls(s) for s in sets])
    _close(got, expected, "stacked (vmap) against one call per set")


PROPERTIES: dict[str, Callable] = {
    "output shape, dtype and device kept": shape_dtype_device,
    "one answer per input (no undeclared state)": one_answer_per_input,
    "input never written": input_not_written,
    "finite under up to f hostile rows": finite_under_hostile_rows,
    "permutation invariance": permutation_invariant,
    "translation equivariance": translation_equivariant,
    "positive-scale equivariance": scale_equivariant,
    "identity on identical rows": identity_on_identical_rows,
    "pre-aggregation permutes with its input": pre_aggregation_permutes_with_input,
    "a spec is its steps in turn": pipeline_equals_its_steps,
    "honest coordinate range": honest_coordinate_range,
    "(f, kappa)-robustness": f_kappa_robust,
    "stacked (vmap) equals one call per set": stacked_equals_calls,
}


def reproducible(examples: int):
    """Reproducible runs (derandomized, no example database) that stop at the first failure."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


@dataclass
class Outcome:
    name: str
    status: str  # "held", "failed" or "not applicable"
    counterexample: str = ""
    error: str = ""


def check(spec: str, f: int | None = None, n: int | None = None, examples: int = 100, seed: int = 0,
          properties: Iterable[str] | None = None, **params) -> list[Outcome]:
    """Run every property (or those named in `properties`, keys of PROPERTIES) on `spec`
    (built with `params`) over hypothesis-drawn message sets (f and n drawn unless given,
    n > 2f); each property's outcome, with the shrunk counterexample of a failure. Raises
    ValueError for a spec that cannot be built or an unknown property.

    Every drawn set goes through every property (one draw serves them all); the first failure
    is shrunk, reported for the property failing on the shrunk set, and the properties left
    run again on fresh draws. The pipeline is built afresh for every call a property compares,
    so that state a rule keeps (declared or not) never carries from one draw to the next."""
    # a bad spec or property: one clear error before anything runs
    first = build(spec, f=f or 0, **params)
    needs_reference = first.needs_reference
    chosen = list(PROPERTIES) if properties is None else list(properties)
    unknown = [name for name in chosen if name not in PROPERTIES]
    if unknown:
        raise ValueError(f"unknown propert{'ies' if len(unknown) > 1 else 'y'} {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(map(repr, PROPERTIES))}")

    def make(m: Messages) -> Pipeline:
        return build(spec, f=m.f, seed=seed, **params)

    sizes = st.just(n) if n is not None else st.none()
    outcomes: dict[str, Outcome] = {}
    while len(outcomes) < len(chosen):
        left = {name: PROPERTIES[name] for name in chosen if name not in outcomes}
        seen = {"applicable": set(), "last": None, "failed": None}

        @reproducible(examples)
        @given(data=st.data())
        def run(data):
            # (f, kappa)-robustness is stated for exactly f hostile rows: half the draws have them
            m = data.draw(message_sets(n=data.draw(sizes), f=f, exactly_f=data.draw(st.booleans()),
                                       reference=needs_reference))
            try:
                make(m).check(m.x.shape[0])
            except ValueError:
                assume(False)  # more rows than the rule needs for this f: another draw
            seen["last"] = m
            for name, prop in left.items():
                try:
                    prop(make, m)
                    seen["applicable"].add(name)
                except NotApplicable:
                    pass
                except Exception as e:  # noqa: BLE001 (a user's rule may raise anything)
                    seen["failed"] = name
                    raise AssertionError(f"{type(e).__name__}: {e}") from None

        try:
            run()
        except AssertionError as e:
            name = seen["failed"]
            outcomes[name] = Outcome(name, "failed", repr(seen["last"]), str(e).splitlines()[0][:300])
            continue
        except Unsatisfiable:
            pass
        for name in left:
            outcomes[name] = Outcome(name, "held" if name in seen["applicable"] else "not applicable")
    return [outcomes[name] for name in chosen]


__all__ = ["HOSTILE", "Messages", "NotApplicable", "Outcome", "PROPERTIES", "check", "kappa_of", "lower_bound",
           "message_sets", "reproducible"]
