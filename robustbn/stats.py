"""The statistics every result view reports, in one place: tables (`robustbn results`,
docs/tables.py), plots and the worst case read their numbers from here.

- A **cell** (runs that differ only in their seed) reports the number of seeds n, the mean
  over seeds, and a 95% confidence interval for that mean: Student t over the seeds,
  mean ± t(0.975, n - 1) · s / √n with s the sample std (divisor n - 1). Accuracies clip the
  interval to [0, 1] (`ACCURACY`), and the outputs say so. One seed has no interval: its bounds
  are None and the text says "1 seed, no interval". Values without spread (all equal) give
  the interval [mean, mean] (scipy's t.interval is NaN there).
- A **paired comparison** of B against A (two settings that differ in one field) takes the
  seeds both ran, the difference B - A per seed, and reports the mean difference, the number
  of pairs and the same Student-t interval over the differences (not clipped): what
  `scipy.stats.ttest_rel(b, a).confidence_interval()` gives. Seeds move both settings alike,
  so pairing removes their shared luck. Two settings are told apart only where that interval
  excludes 0 (`distinct`); the published pages also want `MIN_PAIRS` paired seeds (`too_few`).
- **Seeds first**: runs repeating a seed (another device, a rerun) are averaged into that
  seed, so a seed counts once. A run's accuracy is its final test accuracy; a run that
  diverged (status `diverged`, or a final accuracy missing or not finite) counts at chance,
  1 / the dataset's classes (`chance`): the accuracy of a model collapsed to one class.

Over runs: `pooled` (the cells of `robustbn results --pooled`) and `compare` (the paired
differences of `robustbn results --compare`). scipy.stats does the math.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
from scipy import stats as st

from .labels import NOT_SCENARIO, hashable

LEVEL = 0.95
MIN_PAIRS = 5  # the published pages (docs/results.md, robustbn report) give no verdict on fewer paired seeds
ACCURACY = (0.0, 1.0)  # accuracies' intervals are clipped to this range
CI_WORDS = "95% CI: Student t over seeds"
CLIPPED_WORDS = f"{CI_WORDS}, clipped to [0, 1]"
CLIPPED_PERCENT_WORDS = f"{CI_WORDS}, clipped to [0, 100]"  # the same, where accuracies print in %
PAIRED_WORDS = "95% CI: Student t over the paired differences"


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its 95% Student-t interval (low, high: None below 2 values);
    std is the sample std (0.0 for one value, None for none)."""

    n: int
    mean: float | None
    low: float | None
    high: float | None
    std: float | None

    @property
    def has_interval(self) -> bool:
        return self.low is not None

    def text(self, scale: float = 1.0, digits: int = 4, unit: str = "seed") -> str:
        return ci_text(self.low, self.high, self.n, scale, digits, unit)


def ci_text(low: float | None, high: float | None, n: int | None, scale: float = 1.0, digits: int = 4,
            unit: str = "seed") -> str:
    """An interval in words: "[low, high]" (times `scale`), "1 seed, no interval", or "" for
    no values."""
    if not n:
        return ""
    if low is None or high is None:
        return f"{n} {unit}{'s' * (n != 1)}, no interval"
    return f"[{number(low, digits, scale)}, {number(high, digits, scale)}]"


def number(v: float, digits: int = 1, scale: float = 1.0, sign: bool = False) -> str:
    """`scale * v` to `digits` places ("+" before it with `sign`); one that rounds to zero reads
    0, unsigned or "+": "-0.0" is a rounding of float32 means, not a sign."""
    x = scale * v
    x = 0.0 if round(x, digits) == 0 else x
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def half_width(std: Any, n: Any) -> Any:
    """t(0.975, n - 1) · std / √n, elementwise; n >= 2."""
    n = np.asarray(n, dtype=float)
    return st.t.ppf((1 + LEVEL) / 2, n - 1) * np.asarray(std, dtype=float) / np.sqrt(n)


def interval(values: Iterable[float], clip: tuple[float, float] | None = None) -> Estimate:
    """The mean of `values` and its 95% Student-t interval (clipped to `clip`, e.g. `ACCURACY`)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return Estimate(0, None, None, None, None)
    mean = math.fsum(values) / n
    if n == 1:
        return Estimate(1, mean, None, None, 0.0)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    h = float(half_width(std, n))
    low, high = mean - h, mean + h
    if clip is not None:
        low, high = max(low, clip[0]), min(high, clip[1])
    return Estimate(n, mean, low, high, std)


def bands(values: Any, clip: tuple[float, float] | None = ACCURACY) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) over the rows of a 2-D array (seeds x points, e.g. a curve per seed):
    the interval of `interval` at every point; one row gives low = high = mean."""
    values = np.asarray(values, dtype=float)
    mean = values.mean(0)
    if len(values) < 2:
        return mean, mean, mean
    h = half_width(values.std(0, ddof=1), len(values))
    low, high = mean - h, mean + h
    return (mean, low, high) if clip is None else (mean, np.maximum(low, clip[0]), np.minimum(high, clip[1]))


def paired(a: dict[Any, float], b: dict[Any, float]) -> Estimate:
    """B - A over the keys (seeds) both have: the mean paired difference, its 95% interval, the
    number of pairs (n)."""
    return interval(b[k] - a[k] for k in a if k in b)


# Accuracies are stored in float32: chance on a 10-class test set is 0.10000000149 for a model that
# evaluated and 0.1 for a diverged run counted at chance. A difference within this of 0 is that noise,
# never a verdict (an accuracy's resolution is 1 / the test set, at least 1e-5 here).
FLOAT_NOISE = 1e-6


def distinct(d: Estimate) -> bool:
    """Whether a paired difference is told apart from 0: its interval excludes 0 (and float32's
    noise around it, FLOAT_NOISE)."""
    return d.has_interval and (d.low > FLOAT_NOISE or d.high < -FLOAT_NOISE)


def no_verdict(n: int) -> str:
    """"1 seed, no verdict": what a comparison of too few paired seeds says."""
    return f"{n} seed{'s' * (n != 1)}, no verdict"


def too_few(n: int | None) -> str | None:
    """"n seeds, no verdict" where fewer than MIN_PAIRS seeds were paired, else None."""
    if n is None or n >= MIN_PAIRS:
        return None
    return no_verdict(n)


# ---- over runs ---------------------------------------------------------------------------------

DIVERGED_WORDS = ("a diverged run (non-finite loss or accuracy) counts at chance, 1 / classes (10% with ten "
                  "classes): the accuracy of a model collapsed to one class")


def chance(row: dict[str, Any]) -> float:
    """1 / the classes of the run's dataset (robustbn.data.num_classes); 0.0 where unknown."""
    from .data import num_classes

    k = num_classes(row.get("dataset"))
    return 1.0 / k if k else 0.0


def accuracy(row: dict[str, Any]) -> tuple[float, bool]:
    """(the accuracy a run counts for, whether it diverged): a diverged run (status `diverged`,
    or a final accuracy missing or not finite) counts at chance, 1 / classes (`chance`): a
    model that collapsed predicts one class, and no view may rank a diverged run below it."""
    if row.get("status") == "diverged":
        return chance(row), True
    try:
        acc = float(row.get("final_acc"))
    except (TypeError, ValueError):
        return chance(row), True
    return (acc, False) if math.isfinite(acc) else (chance(row), True)


def by_seed(runs: Iterable[dict[str, Any]], value: Callable[[dict], float] = lambda r: accuracy(r)[0]) -> dict:
    """{seed: value}, the runs repeating a seed averaged into it first."""
    seeds = defaultdict(list)
    for r in runs:
        seeds[hashable(r.get("seed"))].append(value(r))
    return {s: math.fsum(v) / len(v) for s, v in seeds.items()}


def seeds_interval(runs: Iterable[dict[str, Any]]) -> Estimate:
    """The cell's accuracy over seeds (`by_seed`), clipped to [0, 1]."""
    return interval(by_seed(runs).values(), ACCURACY)


def code_versions(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with `user_code` kept only for the modules the rows hold at two or more digests
    (None where no such module is named): a user's rule or attack is one setting with the
    built-ins, which record none, and two versions of one module stay apart."""
    digests = defaultdict(set)
    for r in rows:
        for module, digest in (r.get("user_code") or {}).items():
            digests[module].add(digest)
    several = {m for m, d in digests.items() if len(d) > 1}
    if not digests:
        return rows
    out = []
    for r in rows:
        kept = {m: d for m, d in (r.get("user_code") or {}).items() if m in several}
        out.append({**r, "user_code": kept or None})
    return out


def scenario_fields(rows: list[dict[str, Any]], without: Iterable[str] = ()) -> list[str]:
    """Every scenario field of the rows but the seed and `without`."""
    drop = NOT_SCENARIO | {"seed"} | set(without)
    return [k for k in dict.fromkeys(k for r in rows for k in r) if k not in drop]


POOLED = ("seeds", "runs", "mean_acc", "ci_low", "ci_high", "std", "diverged")


def pooled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per group of runs that differ only in their seed (`robustbn results --pooled`):
    the scenario fields, then seeds, runs, mean_acc (the mean over seeds of the final
    accuracy), ci_low, ci_high (its 95% interval, clipped to [0, 1]; None for one seed), std
    (over seeds) and diverged (runs counted at chance). In the order the rows come."""
    rows = code_versions(rows)
    fields = scenario_fields(rows)
    cells = defaultdict(list)
    for r in rows:
        cells[tuple(hashable(r.get(k)) for k in fields)].append(r)
    out = []
    for runs in cells.values():
        e = seeds_interval(runs)
        out.append({**{k: runs[0].get(k) for k in fields}, "seeds": e.n, "runs": len(runs), "mean_acc": e.mean,
                    "ci_low": e.low, "ci_high": e.high, "std": e.std,
                    "diverged": sum(accuracy(r)[1] for r in runs)})
    return out


def related(field: str) -> set[str]:
    """A field and the fields that spell the same thing: a BN shorthand (`bn_agg`) and its two
    channels (`bn_mean_agg`, `bn_var_agg`), either way."""
    for channel in ("bn_mean_", "bn_var_"):
        if field.startswith(channel):
            part = field[len(channel):]
            return {field, f"bn_{part}"}
    if field.startswith("bn_"):
        part = field[3:]
        return {field, f"bn_mean_{part}", f"bn_var_{part}"}
    return {field}


COMPARED = ("pairs", "a_acc", "b_acc", "diff", "ci_low", "ci_high", "verdict")


def compare(rows: list[dict[str, Any]], field: str, a: Any, b: Any,
            same: Callable[[Any, Any], bool]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Paired differences B - A of the runs whose `field` is `a` (A) or `b` (B): a run of A and
    one of B pair when every other scenario field is equal, the seed included (a BN shorthand
    and its channels count as one field). Per setting (the other fields but the seed): the
    setting's fields, pairs, a_acc and b_acc (the means over the paired seeds), diff (the mean
    of B - A), ci_low, ci_high (its 95% interval; None below 2 pairs) and verdict ("B higher",
    "A higher", "tied": the interval includes 0; "1 pair, no verdict": there is none). Accuracies as
    `accuracy`. Also {"a": runs of A, "b": runs of B, "unpaired": runs of either with no
    partner}."""
    rows = code_versions(rows)
    sides = {"a": [r for r in rows if same(r.get(field), a)], "b": [r for r in rows if same(r.get(field), b)]}
    fields = scenario_fields(sides["a"] + sides["b"], related(field))
    settings: dict[tuple, dict[str, list]] = defaultdict(lambda: {"a": [], "b": []})
    for side, runs in sides.items():
        for r in runs:
            settings[tuple(hashable(r.get(k)) for k in fields)][side].append(r)
    out, paired_runs = [], 0
    for runs in settings.values():
        sa, sb = by_seed(runs["a"]), by_seed(runs["b"])
        shared = [s for s in sa if s in sb]
        if not shared:
            continue
        paired_runs += sum(hashable(r.get("seed")) in sb for r in runs["a"])
        paired_runs += sum(hashable(r.get("seed")) in sa for r in runs["b"])
        d = paired(sa, sb)
        verdict = ("B higher" if d.low > 0 else "A higher") if distinct(d) else "tied" if d.has_interval else \
            f"{d.n} pair, no verdict"
        first = (runs["a"] + runs["b"])[0]
        out.append({**{k: first.get(k) for k in fields}, "pairs": d.n,
                    "a_acc": math.fsum(sa[s] for s in shared) / d.n, "b_acc": math.fsum(sb[s] for s in shared) / d.n,
                    "diff": d.mean, "ci_low": d.low, "ci_high": d.high, "verdict": verdict})
    counts = {"a": len(sides["a"]), "b": len(sides["b"]), "unpaired": len(sides["a"]) + len(sides["b"]) - paired_runs}
    return out, counts
