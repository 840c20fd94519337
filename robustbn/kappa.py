"""An empirical (f, kappa) for any rule or pipeline spec, declared or not.

(f, kappa)-robustness (Allouah et al., AISTATS 2023): for every choice of the f Byzantine rows,

    ||F(x) - mean_H||^2 <= kappa * mean_{i in H} ||x_i - mean_H||^2,     H the n - f honest rows,

and no rule beats kappa = f / (n - 2f). `measure_kappa(spec, n, f)` searches for the largest
ratio of the two sides and keeps the worst case it found, with its honest rows, its Byzantine
rows and the attack that started it:

1. honest sets drawn from five distributions (isotropic, anisotropic, heavy-tailed, clustered,
   and two points in exact arithmetic, k rows at one and h - k at the other, k = f first: the
   configuration of the lower bound; their scale, 1e-2 to 1e2, and offset drawn too, since
   not every rule is scale or translation equivariant), `trials` of each; on every one, every
   registered attack (built-in and a user's, except those whose messages the engine computes
   from data, `holds_data`) aimed at the rule (`needs_pipeline` attacks get it), plus copies
   of each honest row (mimic on every target) and a line search of shifts of the honest mean
   along three directions;
2. a direct search from the worst cases of the `starts` worst honest sets: a (1 + lambda)
   evolution strategy over the f Byzantine rows (and, less often, the honest rows and, for a
   rule whose order matters, the Byzantine rows' positions), `steps` generations of
   `offspring` candidates, its step size adapted to successes;
3. "unbounded": the worst case of every honest set and of every attack, and the search's
   results, are swept over t = 10^0 .. 10^6, the Byzantine rows' offset from the honest mean
   times t. A bounded rule levels off; the mean grows as t^2. The verdict is "unbounded" when
   the ratio still grows at least tenfold per decade over the last two decades (at least
   linearly in t) to a thousand times where it started (rounding noise grows too, from
   ~1e-20), or when the output is not finite. A second sweep shrinks the honest spread by
   1/t instead (the same sweep for a scale-equivariant rule): a rule with a scale of its own
   (cc's tau, geomed's nu, a clipping radius, FLTrust's reference) grows there; that is
   reported apart (`shrinking`), and kappa is measured at the honest scales drawn.

Everything runs in float64 on the CPU. The honest rows come first and the Byzantine rows
last, as robustbn stacks them; for a rule that declares its order matters
(`permutation_invariant = False`, or a random one) the Byzantine rows also sit anywhere but
row 0 (MoNNA trusts row 0). Each evaluation builds a fresh pipeline, so that a stateful
rule's state never leaks from one evaluation to the next (it is measured on its first call);
a random rule gets one seed per honest set, so its worst case is over its draws too (stricter
than the in-expectation bounds of bucketing). A rule that needs the server's reference
message gets one more draw of the honest distribution. One `seed` gives the same measurement:
every draw comes from explicit numpy generators and seeded rules and attacks.

This is a search: a lower estimate of the true kappa, which can show a declared bound false
but never prove one.

Why here, in robustbn: the measurement aims every registered attack at a rule, so it needs
both `aggregators` and `attacks`. `attacks` imports `aggregators` (its attacks aim at
pipelines), so inside `aggregators` this could only be an import running back up the house;
and measuring a rule is not an attack, so it does not belong in `attacks` either. robustbn is
the package above both. The module imports nothing else of robustbn (importing it loads
neither the engine nor the store); the definition it measures against, `kappa_of`,
`lower_bound` and `ratio`, stays in `aggregators.robustness`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import attacks
from aggregators.checks import integer
from aggregators.pipeline import Pipeline, build
from aggregators.robustness import kappa_of, lower_bound, ratio

DISTRIBUTIONS = ("isotropic", "anisotropic", "heavy-tailed", "clustered", "two-point")
# the common pipelines of `kappa_table`, beside every registered aggregator
PIPELINES = ("nnm+median", "nnm+trmean", "nnm+krum", "nnm+geomed", "bucketing+median", "bucketing+trmean",
             "bucketing+krum", "arc+median", "arc+trmean", "arc+krum")
DECADES = 6  # the scale sweep: t = 10^0 .. 10^DECADES
GROWTH = 10.0  # per decade, over the sweep's last two decades: "unbounded"
TOLERANCE = 1e-6  # relative: a declared bound exceeded by less is float rounding


@dataclass
class KappaMeasurement:
    """What `measure_kappa` found. `kappa`: the largest ratio, or inf when `unbounded` (it
    grows without limit with the attack's scale); `largest`: the largest ratio met (for an
    unbounded rule, at its sweep's end); `attack` the attack (or construction) whose Byzantine
    rows started the worst case and `refined` how it was pushed further ("" as the attack made
    it, "search", "scale sweep"); `honest`, `byzantine`, `reference`, `positions`: the worst
    case itself (`positions`: the Byzantine rows' indices among the n, the last f unless the
    rule's order matters);
    `per_attack`: each attack's worst ratio before the search; `growth`: the ratios along the
    sweep that showed it unbounded; `shrinking`: the ratios along a sweep where they grow
    without limit as the honest spread shrinks (a rule with an absolute scale: cc's tau,
    geomed's nu; such configurations are not in `kappa`, measured at honest spreads of 1e-2
    to 1e2); `skipped`: attacks that cannot run at these sizes, and why."""

    spec: str
    n: int
    f: int
    d: int
    seed: int
    kappa: float
    largest: float
    unbounded: bool
    shrinking: list[float]
    attack: str
    refined: str
    distribution: str
    declared: float | None
    lower_bound: float
    honest: torch.Tensor
    byzantine: torch.Tensor
    reference: torch.Tensor | None
    positions: list[int]
    per_attack: dict[str, float] = field(default_factory=dict)
    growth: list[float] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    evaluations: int = 0

    @property
    def exceeds_declared(self) -> bool:
        """The rule declares a kappa(n, f) and the measurement is above it: its claim is false."""
        return self.declared is not None and self.kappa > self.declared * (1 + TOLERANCE) + 1e-12

    def how(self) -> str:
        """Which attack reached it, on which honest rows, refined how: one phrase."""
        more = {"": "", "search": ", then the search", "scale sweep": ", then scaled up"}[self.refined]
        return f"{self.attack} on {self.distribution} honest rows{more}"

    def summary(self) -> str:
        """One line: the measured kappa, how it was reached, the declared and the lower bound."""
        if self.unbounded:
            value = f"unbounded (ratio {self.growth[-1]:.3g} and growing with the attack's scale)" \
                if self.growth and math.isfinite(self.growth[-1]) else "unbounded (non-finite output)"
        else:
            value = f"{self.kappa:.4g}"
        declared = "none declared" if self.declared is None else f"declared {self.declared:.4g}"
        small = "; grows without limit as the honest spread shrinks (a scale of the rule's own: kappa is measured " \
                "at honest scales 1e-2 to 1e2)" if self.shrinking and not self.unbounded else ""
        return (f"kappa {value} at n={self.n}, f={self.f}, d={self.d} ({self.how()}); {declared}; "
                f"lower bound f/(n-2f) = {self.lower_bound:.4g}{small}")


# ---- honest sets ----------------------------------------------------------------------------

def _honest_set(kind: str, h: int, d: int, f: int, trial: int, rng: np.random.Generator):
    """(h + 1, d) float64 rows of one distribution: h honest rows and one more draw (the
    server's reference message for a rule that needs one). The scale is log-uniform in
    [1e-2, 1e2] and the mean sits 0, 0.3, 3 or 30 spreads from the origin, in turn."""
    scale = 10.0 ** rng.uniform(-2.0, 2.0)
    offset = (0.0, 0.3, 3.0, 30.0)[trial % 4] * rng.standard_normal(d)
    m = h + 1
    if kind == "isotropic":
        z = rng.standard_normal((m, d))
    elif kind == "anisotropic":
        z = rng.standard_normal((m, d)) * 10.0 ** rng.uniform(-1.5, 1.0, d)
        if trial % 2:  # rotated: not aligned with the coordinates a coordinate-wise rule sees
            z = z @ np.linalg.qr(rng.standard_normal((d, d)))[0]
    elif kind == "heavy-tailed":
        z = rng.standard_t((1.5, 2.5, 4.0)[trial % 3], (m, d))
    elif kind == "two-point":
        # k honest rows at one point, h - k at another; k = f first (the lower bound's
        # configuration), then every other split in turn (the median's worst is another one)
        splits = [*range(max(f, 1), h), *range(1, f)] or [0]
        return _two_points(h, d, splits[trial % len(splits)], rng)
    elif kind == "clustered":
        sizes = np.bincount(rng.integers(0, int(rng.integers(2, 4)), h), minlength=2)
        sizes = [int(s) for s in sizes if s]
        centers = rng.standard_normal((len(sizes), d))
        labels = np.append(np.repeat(np.arange(len(sizes)), sizes), rng.integers(0, len(sizes)))
        z = centers[labels] + (0.0, 0.1, 0.3)[trial % 3] * rng.standard_normal((m, d))
    else:
        raise ValueError(f"unknown honest distribution {kind!r}; allowed: {', '.join(DISTRIBUTIONS)}")
    return torch.from_numpy(scale * (z + offset))


def _two_points(h: int, d: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """k honest rows at a point a, h - k at b (and the reference at one of them), in exact
    arithmetic. With k = f and Byzantine rows at b, n - f rows are alike and a rule cannot
    tell which f are Byzantine: the lower bound f/(n - 2f), and trimmed mean's sup, reached only
    there. a = o, b = o + h c s (o a multiple of c, c a power of two, s signs): the mean
    o + (h - k) c s, the spread k (h - k) c^2 d and an output b give the ratio k/(h - k) with no
    rounding at all."""
    c = 2.0 ** int(rng.integers(-7, 8))
    a = rng.integers(-8, 9, d) * c
    b = a + rng.choice([-1.0, 1.0], d) * h * c
    rows = np.stack([a] * k + [b] * (h - k) + [b if rng.random() < 0.5 else a])
    return torch.from_numpy(rows)


# ---- the rule under measurement -----------------------------------------------------------

class _Target:
    """The rule for one honest set: a fresh pipeline for every call (a stateful rule's state
    never leaks between calls), this set's seed for a random rule and this set's reference
    for a rule that needs one. Also what an attack that `needs_pipeline` aims at: a callable
    (n, d) -> (d,) with `stacked` and the aggregator step (`agg`) it may read attributes of."""

    def __init__(self, spec: str, f: int, seed: int, reference: torch.Tensor | None, params: dict):
        self.spec, self.f, self.seed, self.params = spec, f, seed, params
        first = self.make()
        self.agg, self.pre = first.agg, first.pre
        # where the Byzantine rows sit matters only to a rule that says so
        steps = first.pre + [first.agg]
        self.ordered = first.random or not all(getattr(s, "permutation_invariant", True) for s in steps)
        self.reference = reference if first.needs_reference else None
        self.calls = 0

    def make(self) -> Pipeline:
        return build(self.spec, f=self.f, seed=self.seed, **self.params)

    def __call__(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        p = self.make()
        if self.reference is None:
            return p(x)
        return p(x, reference=(self.reference if reference is None else reference).to(x.dtype))

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self(messages) for messages in x])

    def ratio(self, honest: torch.Tensor, byzantine: torch.Tensor, reference: torch.Tensor | None = None,
              positions: tuple[int, ...] | None = None) -> float:
        return ratio(self(_place(honest, byzantine, positions), reference), honest)


def _place(honest: torch.Tensor, byzantine: torch.Tensor, positions: tuple[int, ...] | None) -> torch.Tensor:
    """The n messages: the Byzantine rows at `positions` (None: last, as robustbn stacks them),
    the honest rows in order in the others."""
    x = torch.cat([honest, byzantine])
    if positions is None:
        return x
    n = x.shape[0]
    order = [i for i in range(n) if i not in positions]
    index = torch.empty(n, dtype=torch.long)
    index[order + list(positions)] = torch.arange(n)
    return x[index]


@dataclass
class _Case:
    """One configuration: honest rows, Byzantine rows, the reference (None: the target's), the
    Byzantine rows' positions (None: last), its ratio and where it came from."""

    value: float
    honest: torch.Tensor
    byzantine: torch.Tensor
    target: _Target
    attack: str
    distribution: str
    refined: str = ""
    reference: torch.Tensor | None = None
    positions: tuple[int, ...] | None = None

    def moved(self, value: float, honest: torch.Tensor, byzantine: torch.Tensor, refined: str,
              reference: torch.Tensor | None = None, positions: tuple[int, ...] | None = None) -> _Case:
        return _Case(value, honest, byzantine, self.target, self.attack, self.distribution, refined,
                     self.reference if reference is None else reference,
                     self.positions if positions is None else positions)


def _candidates(honest: torch.Tensor, f: int, target: _Target, seed: int, skipped: dict):
    """(label, Byzantine rows (f, d)) of every registered attack aimed at `target`, copies of
    each honest row, and shifts of the honest mean (attacks that cannot run at these sizes go
    into `skipped`, with why)."""
    for name, cls in attacks.ATTACKS.items():
        if cls.holds_data:
            continue
        try:
            attack = attacks.build(name, seed=seed, pipeline=target if cls.needs_pipeline else None)
            rows = attack(honest, f)
        except Exception as e:  # noqa: BLE001 (sizes it cannot forge for: alie's z, mimic's target; a user's bug)
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        yield name, torch.nan_to_num(rows.double(), nan=0.0, posinf=0.0, neginf=0.0)  # as the pipeline sanitizes
    for i in range(honest.shape[0]):
        yield f"copies of honest row {i}", honest[i].repeat(f, 1)
    center = honest.mean(0)
    spread = float(((honest - center) ** 2).sum(1).mean().sqrt()) or 1.0
    vh = torch.linalg.svd(honest - center, full_matrices=False).Vh
    rnd = torch.from_numpy(np.random.default_rng(seed).standard_normal(honest.shape[1]))
    # a line search on each of three directions, t = 1/4 .. 64 spreads: a rule that selects rows
    # (Krum) is hurt most just before it stops selecting the Byzantine ones
    for label, u in (("the top principal direction", vh[0]), ("the last principal direction", vh[-1]),
                     ("a random direction", rnd / rnd.norm())):
        for k in range(-4, 13):
            t = 2.0 ** (k / 2)
            yield f"shift of {t:.3g} spreads along {label}", (center + t * spread * u).repeat(f, 1)


def _family(label: str) -> str:
    """An attack's name, or the family of a candidate of `_candidates`' own."""
    return "copies of an honest row" if label.startswith("copies of") else \
        "shifts of the honest mean" if label.startswith("shift of") else label


def _search(case: _Case, steps: int, offspring: int, rng: np.random.Generator) -> tuple[_Case, int]:
    """(1 + offspring) evolution strategy from `case`: each candidate moves the Byzantine rows
    (all alike or each its own way), scales their offset from the honest mean, or moves the
    honest rows; the best candidate replaces the case when it is worse for the rule, and the
    step size (in honest spreads) grows after a success and shrinks after a failure."""
    best, sigma, evaluations = case, 0.3, 0
    f, d = case.byzantine.shape
    for _ in range(steps):
        top = None
        h = best.honest
        center = h.mean(0)
        spread = float(((h - center) ** 2).sum(1).mean().sqrt() / math.sqrt(d)) or 1.0
        for _ in range(offspring):
            honest, byz, positions = h, best.byzantine, best.positions
            move = rng.random()
            if best.target.ordered and rng.random() < 0.15:  # one Byzantine row trades places with an honest one
                positions = _swap(positions, h.shape[0] + f, f, rng)
            if move < 0.35:  # all Byzantine rows alike: most attacks send one message f times
                byz = byz + sigma * spread * torch.from_numpy(rng.standard_normal(d))
            elif move < 0.6:
                byz = byz + sigma * spread * torch.from_numpy(rng.standard_normal((f, d)))
            elif move < 0.8:
                byz = center + math.exp(rng.normal(0.0, 2.0)) * (byz - center)
            else:
                honest = h + sigma * spread * torch.from_numpy(rng.standard_normal(h.shape)) \
                    * torch.from_numpy((rng.random((h.shape[0], 1)) < 0.3).astype(np.float64))
            value = best.target.ratio(honest, byz, best.reference, positions)
            evaluations += 1
            if not math.isnan(value) and (top is None or value > top[0]):
                top = (value, honest, byz, positions)
        if top is not None and top[0] > best.value:
            best = best.moved(top[0], top[1], top[2], "search", positions=top[3])
            sigma = min(sigma * 1.5, 1e3)
        else:
            sigma = max(sigma * 0.7, 1e-4)
    return best, evaluations


def _swap(positions: tuple[int, ...] | None, n: int, f: int, rng: np.random.Generator) -> tuple[int, ...]:
    """The Byzantine positions with one of them moved to a random honest position other than
    row 0 (a rule such as MoNNA trusts row 0: robustbn puts an honest message there)."""
    positions = list(range(n - f, n)) if positions is None else list(positions)
    free = [i for i in range(1, n) if i not in positions]
    if free:
        positions[int(rng.integers(len(positions)))] = free[int(rng.integers(len(free)))]
    return tuple(sorted(positions))


def _sweep(case: _Case, shrink: bool = False) -> tuple[list[float], _Case | None]:
    """The case's ratio at t = 10^0 .. 10^DECADES, the Byzantine rows' offset from the honest
    mean scaled by t (with `shrink`: the honest rows' spread around their mean, and the
    reference's offset, shrunk by 1/t instead), and the worst configuration of the sweep."""
    honest, byz = case.honest, case.byzantine
    reference = case.reference if case.reference is not None else case.target.reference
    center = honest.mean(0)
    values, worst = [], None
    for k in range(DECADES + 1):
        t = 10.0 ** k
        if shrink:
            h, b = center + (honest - center) / t, byz
            ref = None if reference is None else center + (reference - center) / t
        else:
            h, b, ref = honest, center + t * (byz - center), reference
        value = case.target.ratio(h, b, ref, case.positions)
        values.append(value)
        if not math.isnan(value) and (worst is None or value >= worst.value):
            worst = case.moved(value, h, b, "scale sweep", ref)
    return values, worst


def _grows(values: list[float], floor: float) -> bool:
    """Still growing at least GROWTH-fold per decade over the last two decades, and to a
    thousand times the sweep's start and `floor` (rounding noise grows too as the honest
    spread shrinks, but from ~1e-20), or not finite."""
    if any(not math.isfinite(v) for v in values):
        return any(math.isinf(v) for v in values)
    a, b, c = values[-3:]
    return a > 0 and b >= GROWTH * a and c >= GROWTH * b and c >= GROWTH ** 3 * max(floor, values[0], 1e-3)


def _worse(case: _Case, than: _Case) -> bool:
    """A larger ratio (NaN counts as none)."""
    return not math.isnan(case.value) and (math.isnan(than.value) or case.value > than.value)


def measure_kappa(spec: str, n: int, f: int, d: int = 50, trials: int = 10, steps: int = 200, offspring: int = 8,
                  starts: int = 5, seed: int = 0, **params) -> KappaMeasurement:
    """The empirical (f, kappa) of `spec` (built with `params`) on n messages, f of them
    Byzantine, of d coordinates: see the module. Budget: `trials` honest sets of each of the
    five distributions, every attack on each; then `steps` generations of `offspring`
    candidates of the search from each of the `starts` worst cases; then the scale sweeps.
    A ValueError for a spec that cannot be built or run on n messages with this f. Runs on one
    torch thread (restored after): its tensors hold a few hundred numbers, where more threads
    only cost (measured: 3 to 80 times slower with 2 threads on this busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(spec, n, f, d, trials, steps, offspring, starts, seed, params)
    finally:
        torch.set_num_threads(threads)


def _measure(spec, n, f, d, trials, steps, offspring, starts, seed, params) -> KappaMeasurement:
    who = "measure_kappa"
    n, f, d = integer(who, "n", n, 1), integer(who, "f", f, 0), integer(who, "d", d, 1)
    trials, steps = integer(who, "trials", trials, 1), integer(who, "steps", steps, 0)
    offspring, starts = integer(who, "offspring", offspring, 1), integer(who, "starts", starts, 1)
    integer(who, "seed", seed, 0)
    if 2 * f >= n:
        raise ValueError(f"{who}: needs n > 2f (an honest majority), got f={f}, n={n}")
    probe = build(spec, f=f, n=n, seed=seed, **params)  # a bad spec or size: one error before anything runs
    h = n - f
    rng = np.random.default_rng(seed)
    cases, per_attack, skipped, evaluations = [], {}, {}, 0
    for kind in DISTRIBUTIONS:
        for trial in range(trials):
            rows = _honest_set(kind, h, d, f, trial, rng)
            honest, reference = rows[:h], rows[h]
            trial_seed = int(rng.integers(0, 2**31))
            target = _Target(spec, f, trial_seed, reference, params)
            # a rule for which the order matters: the Byzantine rows last in the first honest set of
            # each distribution, anywhere but row 0 in the others
            positions = tuple(sorted(rng.choice(np.arange(1, n), f, replace=False).tolist())) \
                if target.ordered and trial and f else None
            for label, byz in _candidates(honest, f, target, trial_seed, skipped):
                value = target.ratio(honest, byz, positions=positions)
                cases.append(_Case(value, honest, byz, target, label, kind, positions=positions))
                per_attack[_family(label)] = max(per_attack.get(_family(label), -math.inf), value)
            evaluations += target.calls
    growth, shrinking = [], []

    def sweep(case: _Case) -> _Case:
        """The case's scale sweeps: the worst configuration met as the attack's scale grows
        (`growth`: the first sweep that grows without limit, and where it ends); `shrinking`:
        the first that grows as the honest spread shrinks."""
        nonlocal evaluations
        values, top = _sweep(case)
        evaluations += len(values)
        if not growth and _grows(values, lower_bound(n, f)):
            growth.extend([values, top])
        if not shrinking:
            small, _ = _sweep(case, shrink=True)
            evaluations += len(small)
            if _grows(small, lower_bound(n, f)):
                shrinking.append(small)
        return top if top is not None and top.value > case.value else case

    # every honest set's worst case and every attack's, swept; the search starts from the
    # worst cases of distinct honest sets, swept again at its end
    best = {}
    for case in cases:
        for key in (id(case.target), _family(case.attack)):
            if key not in best or _worse(case, best[key]):
                best[key] = case
    pool = cases + [sweep(case) for case in {id(c): c for c in best.values()}.values()]
    pool.sort(key=lambda c: -c.value if not math.isnan(c.value) else math.inf)
    firsts, seen = [], set()
    for case in pool:
        if id(case.target) not in seen:
            seen.add(id(case.target))
            firsts.append(case)
    found = []
    for case in firsts[:starts]:
        searched, used = _search(case, steps, offspring, np.random.default_rng([seed, len(found)])) if f else (case, 0)
        found.append(sweep(searched))
        evaluations += used
    worst = max(found + pool[:1], key=lambda c: -math.inf if math.isnan(c.value) else c.value)
    unbounded = bool(growth)
    if unbounded:
        worst = growth[1]
    largest = worst.value
    declared = kappa_of(probe, n, f)
    return KappaMeasurement(
        spec=probe.spec, n=n, f=f, d=d, seed=seed, kappa=math.inf if unbounded else worst.value, largest=largest,
        unbounded=unbounded, shrinking=shrinking[0] if shrinking else [], attack=worst.attack,
        refined=worst.refined, distribution=worst.distribution, declared=declared, lower_bound=lower_bound(n, f),
        honest=worst.honest, byzantine=worst.byzantine,
        reference=worst.reference if worst.reference is not None else worst.target.reference,
        positions=list(worst.positions) if worst.positions is not None else list(range(n - f, n)),
        per_attack=per_attack, growth=growth[0] if growth else [], skipped=skipped,
        evaluations=evaluations)


def kappa_table(specs=None, n: int = 10, f: int = 3, **budget):
    """(spec, measurement, seconds) for every registered aggregator and the common
    `PIPELINES` (or the given specs), one at a time as each is measured; a spec that cannot
    run on n messages with this f gives the reason (a string) in place of a measurement."""
    from aggregators.pipeline import AGGREGATORS  # at call time, as registered then

    for spec in specs if specs is not None else [*AGGREGATORS, *PIPELINES]:
        try:
            build(spec, f=f, n=n, **{k: v for k, v in budget.items() if k == "seed"})
        except ValueError as e:
            yield spec, str(e).splitlines()[0], 0.0
            continue
        start = time.perf_counter()
        m = measure_kappa(spec, n, f, **budget)
        yield spec, m, time.perf_counter() - start


TABLE_HEADER = ("| rule | measured kappa | reached by | declared kappa | declared / measured | measured / lower bound "
                "| as the honest spread shrinks | seconds |\n|---|---|---|---|---|---|---|---|")


def table_row(spec: str, m: KappaMeasurement | str, seconds: float = 0.0) -> str:
    """One Markdown row of the kappa table (see `TABLE_HEADER`); `m` a reason: a row saying so."""
    if isinstance(m, str):
        return f"| {spec} | not measured: {m} | | | | | | |"
    measured = "unbounded" if m.unbounded else f"{m.kappa:.3g}"
    declared = "" if m.declared is None else f"{m.declared:.3g}"
    looseness = "" if m.declared is None else \
        "**false**" if m.exceeds_declared else f"{m.declared / m.kappa:.3g}" if m.kappa > 0 else ""
    over = "" if m.unbounded or not m.lower_bound else f"{m.kappa / m.lower_bound:.3g}"
    small = "grows without limit" if m.shrinking else "bounded"
    return f"| {spec} | {measured} | {m.how()} | {declared} | {looseness} | {over} | {small} | {seconds:.0f} |"


__all__ = ["DISTRIBUTIONS", "KappaMeasurement", "PIPELINES", "TABLE_HEADER", "kappa_table", "measure_kappa",
           "table_row"]
