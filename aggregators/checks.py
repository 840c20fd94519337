"""Parameter checks shared by every rule and attack: each returns the value (a float for a
real parameter) or raises a ValueError naming the component, the parameter, what is allowed
and what was given. A bool is not a number here (True would pass as 1). robustbn's scenario
checks read numbers alike (`is_integer`, `as_float`)."""

from __future__ import annotations

import math
import numbers

import torch

# what torch.Generator.manual_seed accepts, and numpy's generators (which refuse negative seeds)
MAX_SEED = 2**64 - 1
# loop counts inside a round (cc's and geomed's iters, dnc's niters, line-search steps): the
# literature uses at most a few hundred; 10_000 leaves room and still ends a round in minutes
MAX_ITERATIONS = 10_000


def is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_float(value) -> float:
    """A real number (not a bool) as a float (+-inf beyond the float range); NaN for anything else."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int beyond 1.8e308
        return math.inf if value > 0 else -math.inf


def real(who: str, param: str, value, low: float | None = None, low_open: bool = False,
         high: float | None = None, high_open: bool = False, finite: bool = True) -> float:
    """`value` as a float, at least `low` and at most `high` (strictly with `*_open`), finite
    unless `finite` is false (then +-inf pass the bounds like any number; NaN never does)."""
    x = as_float(value)
    ok = not math.isnan(x) and (not finite or math.isfinite(x)) and (
        low is None or (x > low if low_open else x >= low)) and (high is None or (x < high if high_open else x <= high))
    if not ok:
        bounds = [f"{'>' if low_open else '>='} {low:g}" if low is not None else "",
                  f"{'<' if high_open else '<='} {high:g}" if high is not None else ""]
        bound = " and ".join(b for b in bounds if b)
        raise ValueError(f"{who}: {param} must be a {'finite ' if finite else ''}number"
                         f"{' ' + bound if bound else ''}, got {value!r}")
    return x


def integer(who: str, param: str, value, low: int, high: int | None = None, why: str = "") -> int:
    """`value` as an int in [low, high] (high None: no upper bound); `why` explains the bounds."""
    if not is_integer(value) or value < low or (high is not None and value > high):
        span = (f">= {low}" if high is None else f"in [{low}, {high}]") + (f" ({why})" if why else "")
        raise ValueError(f"{who}: {param} must be an integer {span}, got {value!r}")
    return int(value)


def iterations(who: str, param: str, value, low: int = 1, high: int = MAX_ITERATIONS) -> int:
    """A loop count or search budget run inside every round (iterations, search steps): an
    integer in [low, high]. A stop request is honoured at round end only, so an unbounded
    count would hold a round, and the stop, practically forever."""
    return integer(who, param, value, low, high, "a loop run every round; a stop request waits for the round's end")


def choice(who: str, param: str, value, allowed: tuple[str, ...]) -> str:
    """`value` if it is one of `allowed`."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{who}: {param} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def seed(who: str, value) -> int:
    """A seed for torch's and numpy's generators: an integer in [0, 2**64 - 1]."""
    return integer(who, "seed", value, 0, MAX_SEED)


def generator(who: str, value) -> torch.Generator | None:
    """An explicit torch.Generator, or None (one per device, from the seed)."""
    if value is not None and not isinstance(value, torch.Generator):
        raise ValueError(f"{who}: generator must be a torch.Generator or None, got {value!r}")
    return value
