"""Worst-case evaluation: each defense judged by its worst accuracy over the attacks tried
against it, as users choose a defense (and as ByzFL's benchmark heatmaps report it).

The definition, exactly (`worst_case`):

- Only finished runs count (status `done` or `diverged`; rows without a status are taken as
  finished).
- A run's accuracy is its final test accuracy. A run that diverged (status `diverged`, or a
  final accuracy missing or not finite) counts as 0.0, and is counted in the `diverged` column.
- A **setting** is everything but the attack and the seed: the norm protocol, f, the
  pipeline of every channel and its parameters, `agg_f`, `client_filter` (and its
  parameters), gamma, and every other scenario field that takes more than one value among the
  rows (alpha, model, algorithm, rounds, ...). `device` and `data_dir` do not make settings.
- The **attack** of a run is its attack fields: `grad_attack`, `bn_mean_attack`,
  `bn_var_attack` and their `*_params` (old rows' `bn_attack` shorthand read as both BN
  channels). A run with f > 0 attacks when some channel its clients send (`labels.channels`:
  the BN channels only where the norm protocol shares statistics) carries an attack other
  than `none` or `honest`. A run with f > 0 and no such channel is the setting's **no-attack
  baseline**, not an attack. A run with f = 0 has no attacker: it belongs to a setting of its
  own (f differs) whose only outcome is its no-attack accuracy.
- Seeds are pooled first: for one (setting, attack), the mean over seeds of the accuracy
  (runs repeating a seed, e.g. on another device, are averaged into that seed first), with
  the number of seeds and the spread (sample std over the seeds, 0 for one seed).
- The **worst case** of a setting is the minimum over its attacks of that pooled mean, and
  the **worst attack** the attack achieving it (ties: the first by its words). `attacks` is
  how many distinct attacks the setting was run under. `no_attack_acc` is the pooled mean of
  the baseline runs (several baselines, e.g. Byzantine clients `honest` or silent, pool
  together), None where the store has none. With f = 0 the worst case is the no-attack
  accuracy (no attacker, nothing else can happen), with `attacks` = 0; with f > 0 and no
  attack run the worst case is unknown: None.

Words, orderings and value keys come from robustbn.labels (shared with the tables and plots).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

from .channels import CHANNELS, PARTS, expand_channels
from .labels import (
    NO_ATTACK,
    attack_short,
    attack_words,
    hashable,
    is_attack,
    norm_order,
    setting_defense_words,
    sort_key,
    varying,
)

# the attack fields of every channel (attack and its parameters), and the BN shorthands
ATTACK_PARTS = tuple(p for p in PARTS if p.startswith("attack"))
ATTACK_FIELDS = tuple(f"{c}_{p}" for c in CHANNELS for p in ATTACK_PARTS)
ATTACK_KEYS = frozenset(ATTACK_FIELDS) | {f"bn_{p}" for p in ATTACK_PARTS}
# fields that make no setting: the seed (pooled), where a run ran, and results
NOT_SETTING = frozenset({"seed", "device", "data_dir", "final_acc", "best_acc", "final_loss", "rounds_done",
                         "resumed_from", "status", "wall_time_s", "hash", "history", "error", "bn_stats", "source", "versions",
                         "code_version"})
# fields the defense words say (with norm and f, the first columns)
DEFENSE_FIELDS = frozenset({f"{c}_{p}" for c in CHANNELS for p in PARTS if not p.startswith("attack")}
                           | {f"bn_{p}" for p in PARTS if not p.startswith("attack")}
                           | {"agg_f", "client_filter", "client_filter_params", "root_size"})
RESULT = ("worst_acc", "worst_std", "worst_attack", "worst_short", *(f"worst_{k}" for k in ATTACK_FIELDS),
          "attacks", "seeds", "diverged", "no_attack_acc", "no_attack_seeds")


def accuracy(row: dict[str, Any]) -> tuple[float, bool]:
    """(the accuracy the worst case reads, whether the run diverged): a missing or non-finite
    final accuracy is 0.0."""
    acc = row.get("final_acc")
    if row.get("status") == "diverged":
        return 0.0, True
    try:
        acc = float(acc)
    except (TypeError, ValueError):
        return 0.0, True
    return (acc, False) if math.isfinite(acc) else (0.0, True)


def _filled(row: dict[str, Any]) -> dict[str, Any]:
    """Every channel spelled out, unset parts as their defaults (rows of old stores, and rows
    that left a field None, read alike)."""
    row = expand_channels(row)
    for c in CHANNELS:
        for p, unset in PARTS.items():
            if row.get(f"{c}_{p}") is None:
                row[f"{c}_{p}"] = unset
    return row


def _pool(runs: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(mean over seeds, std over seeds, seeds) of runs' accuracies; runs repeating a seed
    are averaged into it first."""
    by_seed = defaultdict(list)
    for r in runs:
        by_seed[hashable(r.get("seed"))].append(accuracy(r)[0])
    means = [sum(a) / len(a) for a in by_seed.values()]
    mean = sum(means) / len(means)
    # the sample std (divisor seeds - 1, 0 for one seed), as every table of docs/results.md
    return mean, math.sqrt(sum((m - mean) ** 2 for m in means) / max(len(means) - 1, 1)), len(means)


def setting_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The fields that make a setting: every field of the rows but the attack, the seed and
    the results."""
    return [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ATTACK_KEYS | NOT_SETTING]


def worst_case(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worst-case table of `rows` (as `Store.rows()` returns them; unfinished runs are
    left out): one dict per setting, sorted by norm mode (the plots' order), defense ("mean"
    first), then f and the other fields. Each has the setting's fields (norm, defense in
    words, f, every other non-attack scenario field), then the columns of `RESULT`:
    worst_acc, worst_std (spread over the seeds of the worst attack), worst_attack (in words),
    worst_short (a few characters: "SF (mean)"), worst_<channel>_attack[_params] (the raw
    fields), attacks (how many), seeds (of the worst attack), diverged (runs of the setting
    counted as 0.0), no_attack_acc, no_attack_seeds. See the module's docstring for the
    definition."""
    rows = [_filled(r) for r in rows if r.get("status", "done") in ("done", "diverged")]
    keys = setting_keys(rows)
    settings: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        settings[tuple(hashable(r.get(k)) for k in keys)].append(r)
    table = []
    for runs in settings.values():
        first = runs[0]
        attacked, baseline = defaultdict(list), []
        for r in runs:
            if is_attack(r):
                attacked[tuple(hashable(r[k]) for k in ATTACK_FIELDS)].append(r)
            else:
                baseline.append(r)
        record = {"norm": first.get("norm"), "defense": setting_defense_words(first), "f": first.get("f")}
        record.update({k: first.get(k) for k in keys if k not in record})
        no_attack = _pool(baseline) if baseline else None
        pooled = []
        for pool in attacked.values():
            mean, std, seeds = _pool(pool)
            pooled.append((mean, attack_words(pool[0]), std, seeds, pool[0]))
        if pooled:
            tie = lambda p: repr([hashable(p[4][k]) for k in ATTACK_FIELDS])
            mean, words, std, seeds, r = min(pooled, key=lambda p: (p[0], p[1], tie(p)))
            worst = {"worst_acc": mean, "worst_std": std, "worst_attack": words, "worst_short": attack_short(r),
                     **{f"worst_{k}": r[k] for k in ATTACK_FIELDS}, "seeds": seeds}
        elif not first.get("f") and no_attack:
            worst = {"worst_acc": no_attack[0], "worst_std": no_attack[1], "worst_attack": NO_ATTACK,
                     "worst_short": NO_ATTACK, **{f"worst_{k}": None for k in ATTACK_FIELDS}, "seeds": no_attack[2]}
        else:
            worst = {"worst_acc": None, "worst_std": None, "worst_attack": None, "worst_short": None,
                     **{f"worst_{k}": None for k in ATTACK_FIELDS}, "seeds": 0}
        record.update(worst)
        record.update({"attacks": len(pooled), "diverged": sum(accuracy(r)[1] for r in runs),
                       "no_attack_acc": no_attack[0] if no_attack else None,
                       "no_attack_seeds": no_attack[2] if no_attack else 0})
        table.append({k: record[k] for k in [*(k for k in record if k not in RESULT), *RESULT]})
    return sorted(table, key=lambda t: (norm_order(t["norm"]), t["defense"] != "mean", t["defense"],
                                        [sort_key(t.get(k)) for k in ["f", *keys]]))


def shown_columns(table: list[dict[str, Any]]) -> list[str]:
    """The columns of the printed table: norm, defense, f, every other setting field that
    varies (a field the defense words say only where the words do not tell settings apart),
    then the results (the raw attack fields and worst_short left to csv / json)."""
    if not table:
        return ["norm", "defense", "f", "worst_acc", "worst_attack", "attacks", "seeds", "no_attack_acc"]
    fields = [k for k in varying(table, set(RESULT) | {"norm", "defense", "f"})]
    columns = ["norm", "defense", "f"] + [k for k in fields if k not in DEFENSE_FIELDS]
    if len({tuple(hashable(t.get(k)) for k in columns) for t in table}) < len(table):
        columns += [k for k in fields if k in DEFENSE_FIELDS]
    return columns + ["worst_acc", "worst_std", "worst_attack", "attacks", "seeds", "diverged", "no_attack_acc"]

