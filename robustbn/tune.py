"""`robustbn tune`: each defense's hyperparameters chosen before it is attacked, by ByzFL's rule.

For a matrix file (defenses x attacks at one setting) and a grid (`lr = [0.01, 0.05, 0.1]`, or
several fields: their cross product), every grid point runs the matrix on tuning seeds that no
report uses (default 10 and 11). A defense's score at a point is its worst case over the
matrix's attacks (robustbn.worst: the lowest mean over seeds, a diverged run at chance); its
chosen point is the highest score (ties: the first point of the grid), the max over the grid
of the min over attacks. `tuned_files` writes, per defense, the matrix with its chosen point
on the reporting seeds, which `robustbn run` then runs like any other file.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from .labels import hashable
from .matrix import FIELDS, MatrixError, read
from .worst import ATTACK_KEYS, DEFENSE_FIELDS, RESULT, worst_case

TUNING_SEEDS = [10, 11]
REPORT_SEEDS = [0, 1, 2, 3, 4]
# the fields of a defense's row that are not its identity (results, and the raw worst attack)
_NOT_IDENTITY = set(RESULT) | {"seed"}


class TuneError(MatrixError):
    """A user error in what to tune: the message names the option and what is allowed."""


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The grid's points: the cross product of its fields' values, in the order given."""
    for key, values in grid.items():
        if key not in FIELDS or key in ("seed", "norm") or key.endswith(("_attack", "_attack_params")):
            raise TuneError(f"--grid {key}: not a field to tune; a scalar field of the setting or of a defense, e.g. "
                            f"lr, momentum, grad_agg_params")
        if not isinstance(values, list) or len(values) < 2:
            raise TuneError(f"--grid {key}: give a list of at least 2 values, e.g. --grid {key}=[0.01,0.05,0.1]")
        if len({repr(hashable(v)) for v in values}) < len(values):
            raise TuneError(f"--grid {key}: a value is listed twice")
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def choose(rows: list[dict[str, Any]], grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Per defense (a row of the worst-case table, the grid's fields aside): its worst case at
    each grid point and the chosen point, the max over the grid of the worst case over
    attacks. Each: norm, defense, server_data, scores ([{point, worst_acc, ci_low, ci_high,
    seeds, worst_attack}] in grid order), chosen (the point), chosen_acc, setting (the
    defense's fields, to write its tuned file)."""
    points = grid_points(grid)
    table = worst_case(rows)
    keys = list(grid)
    defenses: dict[tuple, dict[str, Any]] = {}
    for t in table:
        if not t.get("f"):
            continue
        ident = tuple((k, repr(hashable(v))) for k, v in t.items() if k not in _NOT_IDENTITY and k not in keys
                      and not k.startswith("no_attack") and not k.startswith("gap") and k != "verdict")
        d = defenses.setdefault(ident, {"norm": t["norm"], "defense": t["defense"], "server_data": t["server_data"],
                                        "by_point": {}, "setting": t})
        d["by_point"][tuple(repr(hashable(t.get(k))) for k in keys)] = t
    out = []
    for d in defenses.values():
        scores = []
        for point in points:
            t = d["by_point"].get(tuple(repr(hashable(point[k])) for k in keys))
            scores.append({"point": point, "worst_acc": t and t["worst_acc"], "ci_low": t and t["ci_low"],
                           "ci_high": t and t["ci_high"], "seeds": t["seeds"] if t else 0,
                           "worst_attack": t and t["worst_attack"]})
        known = [s for s in scores if s["worst_acc"] is not None]
        best = max(known, key=lambda s: s["worst_acc"]) if known else None  # max keeps the first of equals
        out.append({"norm": d["norm"], "defense": d["defense"], "server_data": d["server_data"], "scores": scores,
                    "chosen": best and best["point"], "chosen_acc": best and best["worst_acc"],
                    "complete": len(known) == len(points), "setting": d["setting"]})
    return out


def tuned_values(values: dict[str, Any], choice: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """The matrix restricted to one defense at its chosen point, on the reporting seeds."""
    setting = choice["setting"]
    narrowed = {}
    for k, v in values.items():
        if isinstance(v, list) and k in setting and k != "seed" and not k.endswith(("_attack", "_attack_params")):
            narrowed[k] = setting[k]
    at = "".join(f", {k} = {setting.get(k)}" for k in setting_fields(values))
    return {**values, **narrowed, **choice["chosen"], "seed": seeds,
            "description": f"robustbn tune: {choice['defense']} under {choice['norm']}{at}, at its chosen "
                           f"{', '.join(f'{k} = {v}' for k, v in choice['chosen'].items())} (the max over the grid "
                           f"of the worst case over the attacks, on the tuning seeds), on the reporting seeds"}


def setting_fields(values: dict[str, Any]) -> list[str]:
    """The fields a matrix varies that are neither the protocol, the defense, the attack nor the
    seed (gamma, f, ...): each of their points is tuned on its own."""
    return [k for k, v in values.items() if isinstance(v, list) and k not in ("seed", "norm")
            and k not in DEFENSE_FIELDS and k not in ATTACK_KEYS]


def slug(choice: dict[str, Any], values: dict[str, Any] | None = None) -> str:
    """A file name for a defense's tuned file: its protocol, its defense and, where the matrix
    varies the setting (gamma, f, ...), the point's values, so that points never share a file."""
    point = " ".join(f"{k} {choice['setting'].get(k)}" for k in setting_fields(values or {}))
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{choice['norm']} {choice['defense']} {point}").strip("_").lower()[:120]


def check_matrix(path: str | Path) -> dict[str, Any]:
    values = read(path)
    if "search" in values:
        raise TuneError(f"{path}: a search file; tune a matrix of defenses and attacks")
    return values
