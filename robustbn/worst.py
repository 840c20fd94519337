"""Worst-case evaluation: each defense judged by its worst accuracy over the attacks tried
against it, as users choose a defense (and as ByzFL's benchmark heatmaps report it).

The definition, exactly (`worst_case`):

- Only finished runs count (status `done` or `diverged`; rows without a status are taken as
  finished).
- A run's accuracy is its final test accuracy. A run that diverged (status `diverged`, or a
  final accuracy missing or not finite) counts at chance, 1 / the dataset's classes
  (robustbn.stats.accuracy), and is counted in the `diverged` column.
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
  the number of seeds, the 95% confidence interval of that mean (Student t over the seeds,
  clipped to [0, 1]; none for one seed: robustbn.stats) and the sample std over the seeds
  (0 for one seed).
- The **worst case** of a setting is the minimum over its attacks of that pooled mean, and
  the **worst attack** the attack achieving it (ties: the first by its words). `attacks` is
  how many distinct attacks the setting was run under. `no_attack_acc` is the pooled mean of
  the baseline runs (several baselines, e.g. Byzantine clients `honest` or silent, pool
  together), None where the store has none. With f = 0 the worst case is the no-attack
  accuracy (no attacker, nothing else can happen), with `attacks` = 0; with f > 0 and no
  attack run the worst case is unknown: None. `ci_low`, `ci_high` are the interval of
  `worst_acc` (over the seeds of the worst attack), `no_attack_low`, `no_attack_high` that
  of `no_attack_acc`.
- The worst case **per seed** (for comparing defenses): the worst attack is chosen once per
  setting, on the seed-pooled mean as above; a seed's worst case is then that seed's accuracy
  under that attack (not the minimum over attacks within the seed, which would pick another
  attack per seed and bias every worst case low). With f = 0, the seed's no-attack accuracy.
- **Where an attack came from**: rows may carry `source`, the scenario file they were read
  from (`matrix_rows`: the catalogue's matrix, and the confirmation files of attack searches,
  `scenarios/searched_worst_*.toml`, whose runs are ordinary runs of a searched attack).
  `source` makes no setting: a searched attack is one more attack of the settings it shares.
  `worst_source` names the file(s) of the worst attack's runs, `worst_kind` says "searched"
  where they all come from confirmation files, "own" where a channel's attack is a user's
  class (`module:Name`), else "catalogue" (None without sources). The
  worst case is thus the lower of the catalogue's worst and the confirmed searched worst, with
  the seeds and interval of the attack that achieved it.
- **Threat models**: `server_data` says what a defense needs from the server beyond the
  messages: None (root-free), or the trusted data a channel's rule uses where it
  `needs_reference` (FLTrust's root set: "root set of 100, drawn uniformly (about
  class-balanced)"). Defenses of different threat models are ranked apart.
- **Verdicts**: settings that differ only in the defense (the channels' pipelines, `agg_f`,
  the client filter and its parameters, `root_size`) are compared within each norm protocol,
  threat model (`server_data`) and value of every other setting field (f, gamma, ...). The
  best is the highest worst case (pooled mean; ties: the first in the table's order). Every other setting is paired with the
  best over the seeds both ran: `gap` is the mean of (best - this) per seed, `gap_low`,
  `gap_high` its 95% Student-t interval, `gap_pairs` the number of seeds paired. A setting is
  "worse" where that interval excludes 0, else "tied for best" (one shared seed: no
  interval, so "1 seed, no verdict"). The best is "best" where every other is worse, else
  "tied for best" (or, with no tie but a setting of one shared seed, no verdict). A
  setting alone in its group, or without a worst case, has no verdict (None).

Words, orderings and value keys come from robustbn.labels (shared with the tables and plots).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

from .channels import CHANNELS, PARTS, expand_channels
from .labels import (
    NO_ATTACK,
    NOT_SCENARIO,
    attack_short,
    attack_words,
    channels,
    hashable,
    is_attack,
    norm_order,
    norm_words,
    setting_defense_words,
    sort_key,
    text,
    varying,
)
from .stats import (ACCURACY, Estimate, accuracy, by_seed, code_versions, distinct, interval, no_verdict, paired,
                    scenario_fields, too_few)

# the attack fields of every channel (attack and its parameters), and the BN shorthands
ATTACK_PARTS = tuple(p for p in PARTS if p.startswith("attack"))
ATTACK_FIELDS = tuple(f"{c}_{p}" for c in CHANNELS for p in ATTACK_PARTS)
ATTACK_KEYS = frozenset(ATTACK_FIELDS) | {f"bn_{p}" for p in ATTACK_PARTS}
# fields that make no setting: the seed (pooled), where a run ran, and results
NOT_SETTING = NOT_SCENARIO | {"seed"}
# fields the defense words say (with norm and f, the first columns)
DEFENSE_FIELDS = frozenset({f"{c}_{p}" for c in CHANNELS for p in PARTS if not p.startswith("attack")}
                           | {f"bn_{p}" for p in PARTS if not p.startswith("attack")}
                           | {"agg_f", "client_filter", "client_filter_params", "root_size"})
RESULT = ("worst_acc", "ci_low", "ci_high", "worst_std", "worst_attack", "worst_short", "worst_kind",
          "worst_source", *(f"worst_{k}" for k in ATTACK_FIELDS), "attacks", "seeds", "diverged",
          "verdict", "gap", "gap_low", "gap_high", "gap_pairs",
          "no_attack_acc", "no_attack_low", "no_attack_high", "no_attack_seeds", "worst_by_seed")
BEST, TIED, WORSE = "best", "tied for best", "worse"
SEARCHED_PREFIX = "searched_worst_"  # a confirmation file of an attack search: its runs are searched attacks
CATALOGUE, SEARCHED, OWN = "catalogue", "searched", "own"


def source_kind(path: Any) -> str | None:
    """"searched" for a confirmation file (`searched_worst_*.toml`), "catalogue" for any other
    file, None for no file."""
    if not path:
        return None
    return SEARCHED if Path(str(path)).name.startswith(SEARCHED_PREFIX) else CATALOGUE


def matrix_rows(paths: Iterable[str | Path], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that are runs of any of the scenario files `paths` (robustbn.matrix.runs_of: at
    any seed, device or engine), each with `source`, the first of the files that holds it (a
    run counts once)."""
    from .matrix import runs_of

    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        for r in runs_of(path, rows):
            key = r.get("hash") or id(r)
            if key not in out:
                out[key] = {**r, "source": str(path)}
    return list(out.values())


@functools.lru_cache(maxsize=256)
def _needs_reference(spec: str) -> bool:
    """Whether a spec's aggregator takes the server's trusted reference (`needs_reference`)."""
    import aggregators

    try:
        return bool(getattr(aggregators.step_class(spec.split("+")[-1].strip()), "needs_reference", False))
    except (ValueError, TypeError):  # a user's rule this installation cannot find: no claim
        return False


def server_data(row: dict[str, Any]) -> str | None:
    """What a run's defense needs from the server beyond the clients' messages: None (root-free),
    or the trusted data a channel's rule uses (`needs_reference`: FLTrust's root set)."""
    if not any(_needs_reference(spec) for _, _, spec, _ in channels(row).values()):
        return None
    size = row.get("root_size")
    return f"root set of {size if size is not None else 'unknown size'}, drawn uniformly (about class-balanced)"


def _source(runs: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """(worst_kind, worst_source) of one attack's runs."""
    files = sorted({str(r["source"]) for r in runs if r.get("source")})
    if not files:
        return None, None
    from aggregators.plugins import is_reference

    if all(source_kind(f) == SEARCHED for f in files):
        kind = SEARCHED
    elif any(is_reference(attack) for attack, _, _, _ in channels(runs[0]).values()):
        kind = OWN  # a user's attack class: no catalogue's
    else:
        kind = CATALOGUE
    return kind, ", ".join(files)


def _filled(row: dict[str, Any]) -> dict[str, Any]:
    """Every channel spelled out, unset parts as their defaults (rows of old stores, and rows
    that left a field None, read alike)."""
    row = expand_channels(row)
    for c in CHANNELS:
        for p, unset in PARTS.items():
            if row.get(f"{c}_{p}") is None:
                row[f"{c}_{p}"] = unset
    return row


def _pool(runs: list[dict[str, Any]]) -> tuple[Estimate, dict]:
    """(the runs' accuracy over seeds, clipped to [0, 1]; {seed: accuracy}): runs repeating a
    seed are averaged into it first."""
    seeds = by_seed(runs)
    return interval(seeds.values(), ACCURACY), seeds


def setting_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The fields that make a setting: every field of the rows but the attack, the seed and
    the results."""
    return scenario_fields(rows, ATTACK_KEYS)


def setting_groups(rows: list[dict[str, Any]]) -> tuple[list[str], dict[tuple, list[dict[str, Any]]]]:
    """(the fields that make a setting, {a setting's values of them: its finished runs}), as
    `worst_case` groups them; a table row `t` is the setting `tuple(hashable(t.get(k)) for k in
    keys)`."""
    rows = [_filled(r) for r in code_versions(rows) if r.get("status", "done") in ("done", "diverged")]
    keys = setting_keys(rows)
    settings: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        settings[tuple(hashable(r.get(k)) for k in keys)].append(r)
    return keys, settings


def worst_case(rows: list[dict[str, Any]], tuned: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The worst-case table of `rows` (as `Store.rows()` returns them; unfinished runs are
    left out): one dict per setting, sorted by norm mode (the plots' order), defense ("mean"
    first), then f and the other fields. Each has the setting's fields (norm, defense in
    words, f, every other non-attack scenario field), then the columns of `RESULT`:
    worst_acc, ci_low, ci_high (its 95% interval over the seeds of the worst attack; None for
    one seed), worst_std (the spread over those seeds), worst_attack (in words), worst_short
    (a few characters: "SF (mean)"), worst_kind and worst_source (catalogue or searched, and
    the file: rows with `source`, see `matrix_rows`), worst_<channel>_attack[_params] (the raw fields),
    attacks (how many), seeds (of the worst attack), diverged (runs of the setting counted at
    chance), verdict, gap, gap_low, gap_high, gap_pairs (against the best defense, paired over
    seeds), no_attack_acc, no_attack_low, no_attack_high, no_attack_seeds, worst_by_seed ({seed:
    accuracy} of the worst attack, at f = 0 of the clean runs: what a paired comparison pairs). See the module's
    docstring for the definition. `tuned`: fields each defense ran at its own tuned value of
    (`robustbn tune`: lr): they belong to the defense, so defenses at different values compete."""
    keys, settings = setting_groups(rows)
    table = []
    for runs in settings.values():
        first = runs[0]
        attacked, baseline = defaultdict(list), []
        for r in runs:
            if is_attack(r):
                attacked[tuple(hashable(r[k]) for k in ATTACK_FIELDS)].append(r)
            else:
                baseline.append(r)
        record = {"norm": first.get("norm"), "defense": setting_defense_words(first), "server_data": server_data(first),
                  "f": first.get("f")}
        record.update({k: first.get(k) for k in keys if k not in record})
        no_attack = _pool(baseline) if baseline else None
        pooled = [(*_pool(pool), attack_words(pool[0]), pool[0]) for pool in attacked.values()]
        seeds = None
        if pooled:
            tie = lambda p: repr([hashable(p[3][k]) for k in ATTACK_FIELDS])
            e, seeds, words, r = min(pooled, key=lambda p: (p[0].mean, p[2], tie(p)))
            kind, source = _source(attacked[tuple(hashable(r[k]) for k in ATTACK_FIELDS)])
            worst = {"worst_attack": words, "worst_short": attack_short(r), "worst_kind": kind,
                     "worst_source": source, **{f"worst_{k}": r[k] for k in ATTACK_FIELDS}}
        elif not first.get("f") and no_attack:
            e, seeds = no_attack
            worst = {"worst_attack": NO_ATTACK, "worst_short": NO_ATTACK, "worst_kind": None, "worst_source": None,
                     **{f"worst_{k}": None for k in ATTACK_FIELDS}}
        else:
            e = Estimate(0, None, None, None, None)
            worst = {"worst_attack": None, "worst_short": None, "worst_kind": None, "worst_source": None,
                     **{f"worst_{k}": None for k in ATTACK_FIELDS}}
        na = no_attack[0] if no_attack else Estimate(0, None, None, None, None)
        record.update({"worst_acc": e.mean, "ci_low": e.low, "ci_high": e.high, "worst_std": e.std, **worst,
                       "attacks": len(pooled), "seeds": e.n, "diverged": sum(accuracy(r)[1] for r in runs),
                       "no_attack_acc": na.mean, "no_attack_low": na.low, "no_attack_high": na.high,
                       "no_attack_seeds": na.n, "verdict": None, "gap": None, "gap_low": None, "gap_high": None,
                       "gap_pairs": None, "worst_by_seed": seeds or {}})
        table.append({k: record[k] for k in [*(k for k in record if k not in RESULT), *RESULT]})
    table.sort(key=lambda t: (norm_order(t["norm"]), t["defense"] != "mean", t["defense"],
                              [sort_key(t.get(k)) for k in ["f", *keys]]))
    _verdicts(table, tuned)
    return table


def _verdicts(table: list[dict[str, Any]], tuned: Iterable[str] = ()) -> None:
    """Fill verdict and gap* of the settings that differ only in the defense (the module's
    docstring; with the `tuned` fields): the best by pooled worst case, the others paired with
    it over seeds."""
    others = [k for k in dict.fromkeys(k for t in table for k in t)  # server_data stays: threat models apart
              if k not in set(RESULT) | DEFENSE_FIELDS | {"defense", *tuned}]
    groups = defaultdict(list)
    for t in table:
        if t["worst_acc"] is not None:
            groups[tuple(hashable(t.get(k)) for k in others)].append(t)
    for group in groups.values():
        if len(group) >= 2:
            paired_rank(group, lambda t: t["worst_by_seed"])


def paired_rank(group: list[dict[str, Any]], seeds_of: Callable[[dict[str, Any]], dict]) -> None:
    """The board's paired rule over `group` (two or more dicts with worst_acc; `seeds_of(t)`:
    its accuracy per seed): the highest worst_acc (the first of equals) is BEST where every
    other's gap (best - it, paired over seeds) has an interval above 0, else TIED; each other is
    WORSE or TIED. Fills verdict, gap, gap_low, gap_high and gap_pairs in place."""
    best = max(group, key=lambda t: t["worst_acc"])
    for t in group:
        if t is not best:
            d = paired(seeds_of(t), seeds_of(best))
            verdict = (WORSE if distinct(d) and d.low > 0 else TIED) if d.has_interval else no_verdict(d.n)
            t.update({"verdict": verdict, "gap": d.mean, "gap_low": d.low, "gap_high": d.high, "gap_pairs": d.n})
    rest = [t["verdict"] for t in group if t is not best]
    # one pair has no interval: neither "tied" nor "worse" can be said of it, so no verdict
    best["verdict"] = BEST if all(v == WORSE for v in rest) else TIED if TIED in rest else \
        next(v for v in rest if v != WORSE)
    best.update({"gap": None, "gap_low": None, "gap_high": None, "gap_pairs": None})


def shown_columns(table: list[dict[str, Any]], tuned: Iterable[str] = ()) -> list[str]:
    """The columns of the printed table: norm, defense, f, the `tuned` fields (each defense's
    own value, shown even where they agree), every other setting field that varies (a field the
    defense words say only where the words do not tell settings apart), then the results (the
    raw attack fields and worst_short left to csv / json)."""
    if not table:
        return ["norm", "defense", "f", "worst_acc", "ci_low", "ci_high", "seeds", "verdict", "worst_attack",
                "attacks", "no_attack_acc"]
    tuned = [k for k in tuned if any(k in t for t in table)]
    fields = [k for k in varying(table, set(RESULT) | {"norm", "defense", "f", *tuned})]
    columns = ["norm", "defense", "f", *tuned] + [k for k in fields if k not in DEFENSE_FIELDS and k != "server_data"]
    if len({tuple(hashable(t.get(k)) for k in columns) for t in table}) < len(table):
        columns += [k for k in fields if k in DEFENSE_FIELDS]
    sourced = ["worst_kind", "worst_source"] if any(t.get("worst_source") for t in table) else []
    trusted = ["server_data"] if any(t.get("server_data") for t in table) else []
    return columns + trusted + ["worst_acc", "ci_low", "ci_high", "seeds", "verdict", "gap", "gap_low", "gap_high",
                      "worst_attack", *sourced, "attacks", "diverged", "no_attack_acc"]



class SettingsDiffer(ValueError):
    """Runs that a map cell (or a protocol comparison) would mix differ in another setting field."""


ONLY = "the only defense run"
NO_PICK_YET = "no pick yet"


def defense_map(rows: list[dict[str, Any]], x: str = "gamma", y: str = "f", tuned: Iterable[str] = (),
                expected: Callable[[str, str | None, Any, Any], int | None] | None = None) -> list[dict[str, Any]]:
    """Which defense to use where, ByzFL style: per norm protocol, threat model and (y, x) cell
    (every other setting field as it is), the defenses the paired rule of `worst_case` picks:
    the best, or every one tied for best, or ONLY where one defense ran there. A cell of f = 0
    has no attacker and is left out. Each cell: norm, threat (the server data, None for
    root-free), x, y, verdict (BEST, TIED, ONLY, or "n seeds, no verdict" where fewer than
    MIN_PAIRS seeds pair, the highest worst case its pick, as on the leaderboard), picks
    (the defenses: defense, worst_acc, ci_low, ci_high, seeds, worst_attack, worst_by_seed,
    no_attack_acc, no_attack_low, no_attack_high, no_attack_seeds; in a tied set also gap,
    gap_low, gap_high, gap_pairs: the highest - it, paired), defenses (how
    many ran there) and runner_up (where one defense is best, or a set tied for best, and another
    ran below every pick: the closest other, as a pick, with its gap, best - it, and the gap's
    interval and pairs; else None). `tuned` (as `worst_case`): each pick carries its values of them.
    `expected(norm, threat, x value, y value)`: how many defenses the cell is to have; where
    fewer have run, the cell picks none ("k of m defenses run, no pick yet")."""
    tuned = tuple(tuned)
    table = [t for t in worst_case(rows, tuned) if t.get("f") and t.get(x) is not None and t.get(y) is not None]
    others = [k for k in dict.fromkeys(k for t in table for k in t)
              if k not in set(RESULT) | DEFENSE_FIELDS | {"defense", "server_data", "norm", x, y, *tuned}]
    cells: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for t in table:
        if t["worst_acc"] is not None:
            cells[(t["norm"], t.get("server_data"), hashable(t[x]), hashable(t[y]),
                   *(hashable(t.get(k)) for k in others))].append(t)
    _one_setting_a_cell(cells, others, x, y)
    out = []
    for (norm, data, xv, yv, *_), ts in cells.items():
        best = [t for t in ts if t["verdict"] == BEST]
        tied = [t for t in ts if t["verdict"] == TIED]
        few = too_few(min((t["gap_pairs"] for t in ts if t["gap_pairs"] is not None), default=None))
        picks, verdict = ([max(ts, key=lambda t: t["worst_acc"])], few) if few else (best, BEST) if best else \
            (tied, TIED) if tied else (ts, ONLY)
        want = expected(norm, data, ts[0][x], ts[0][y]) if expected else None
        if want is not None and len(ts) < want:  # a pick among some of the defenses is no pick
            picks, verdict = ts, f"{len(ts)} of {want} defenses run, {NO_PICK_YET}"
        picks = sorted(picks, key=lambda t: -t["worst_acc"])
        # the picks' margin: the closest defense outside them, its gap (the first - it) paired over seeds
        rest = [t for t in ts if t not in picks and t["gap"] is not None]
        close = min(rest, key=lambda t: t["gap"], default=None) if verdict in (BEST, TIED) else None
        if close and close["worst_acc"] >= min(t["worst_acc"] for t in picks):
            close = None  # told apart from the first on tighter seeds than a wide tied pick: not below the set
        shown = lambda t: {**{k: t[k] for k in ("defense", "worst_acc", "ci_low", "ci_high", "seeds", "worst_attack",
                                                "worst_by_seed", "no_attack_acc", "no_attack_low", "no_attack_high",
                                                "no_attack_seeds")},
                           **{k: t[k] for k in ("gap", "gap_low", "gap_high", "gap_pairs") if verdict == TIED},
                           **{k: t.get(k) for k in tuned}}
        out.append({"norm": norm, "threat": data, x: ts[0][x], y: ts[0][y], "verdict": verdict, "defenses": len(ts),
                    "setting": {k: ts[0].get(k) for k in others},
                    "picks": [shown(t) for t in picks],
                    "runner_up": close and {**shown(close), **{k: close[k] for k in ("gap", "gap_low", "gap_high",
                                                                                     "gap_pairs")}}})
    out.sort(key=lambda c: (norm_order(c["norm"]), c["threat"] is not None, sort_key(c[y]), sort_key(c[x])))
    return out


def protocol_map(rows: list[dict[str, Any]], x: str = "gamma", y: str = "f", tuned: Iterable[str] = (),
                 expected: Callable[[str, str | None, Any, Any], int | None] | None = None) -> list[dict[str, Any]]:
    """Which BN protocol where: per threat model and (y, x) cell, each protocol at its highest
    defense there (the top pick of its `defense_map` cell; a protocol whose cell still waits for
    defenses, NO_PICK_YET, is left out), the protocols ranked by the paired rule (`paired_rank`,
    over the seeds of each one's worst attack: a seed fixes the data split and the initial
    model, whatever the protocol). Each cell: threat, x, y, verdict (BEST, TIED, "n seeds, no
    verdict" where fewer than MIN_PAIRS seeds pair, or None where one protocol is there),
    protocols (highest first: norm, the pick's fields, verdict, gap, gap_low, gap_high,
    gap_pairs: best - it, paired). A protocol's defense is chosen on the seeds it is compared
    on: one with several defenses near its top gains a little from it."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    settings: dict[tuple, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for c in defense_map(rows, x, y, tuned, expected):
        if not c["verdict"].endswith(NO_PICK_YET):
            at = (c["threat"], hashable(c[x]), hashable(c[y]))
            groups[at].append({"norm": c["norm"], **c["picks"][0], "verdict": None, "gap": None, "gap_low": None,
                               "gap_high": None, "gap_pairs": None, x: c[x], y: c[y]})
            for k, v in c["setting"].items():
                settings[at][k].add(hashable(v))
    for (_, xv, yv), fields in settings.items():  # protocols are compared within one setting only
        differ = {k: sorted(vs, key=sort_key) for k, vs in fields.items() if len(vs) > 1}
        if differ:
            words = "; ".join(f"{k} ({', '.join(text(v) for v in vs)})" for k, vs in differ.items())
            k, vs = next(iter(differ.items()))
            raise SettingsDiffer(f"the protocols at {x} = {text(xv)}, {y} = {text(yv)} ran in different settings, "
                                 f"{words}: compare one with --where (e.g. --where {k}={text(vs[-1])})")
    out = []
    for (threat, _, _), ps in groups.items():
        ps.sort(key=lambda p: norm_order(p["norm"]))  # the first of equals: the protocols' own order
        if len(ps) >= 2:
            paired_rank(ps, lambda p: p["worst_by_seed"])
        ps.sort(key=lambda p: (-p["worst_acc"], norm_order(p["norm"])))
        few = too_few(min((p["gap_pairs"] for p in ps if p["gap_pairs"] is not None), default=None))
        out.append({"threat": threat, x: ps[0][x], y: ps[0][y], "verdict": few or ps[0]["verdict"],
                    "protocols": [{k: v for k, v in p.items() if k not in (x, y)} for p in ps]})
    out.sort(key=lambda c: (c["threat"] is not None, sort_key(c[x]), sort_key(c[y])))
    return out


def _one_setting_a_cell(cells: dict[tuple, list[dict[str, Any]]], others: list[str], x: str, y: str) -> None:
    """A map cell holds one setting: where runs at the same point differ in another field (a
    tuning's eval_every, a second lr, ...), a ValueError names the fields and their values."""
    at: dict[tuple, list[tuple]] = defaultdict(list)
    for norm, data, xv, yv, *rest in cells:
        at[(norm, data, xv, yv)].append(tuple(rest))
    for (norm, _, xv, yv), settings in at.items():
        if len(settings) > 1:
            differ = {k: sorted({s[i] for s in settings}, key=sort_key) for i, k in enumerate(others)
                      if len({s[i] for s in settings}) > 1}
            fields = "; ".join(f"{k} ({', '.join(text(v) for v in vs)})" for k, vs in differ.items())
            raise SettingsDiffer(f"the runs at {x} = {text(xv)}, {y} = {text(yv)} ({norm}) differ in {fields}: a map cell "
                             f"holds one setting; keep one with --where (e.g. --where {next(iter(differ))}="
                             f"{text(next(iter(differ.values()))[-1])}) or --matrix your files (a tuning's own runs "
                             f"are left out then)")


def map_panels(cells: list[dict[str, Any]], x: str = "gamma", y: str = "f"
               ) -> tuple[list, list, list[tuple[str, str | None, dict[tuple, dict[str, Any]]]]]:
    """`defense_map`'s cells laid out: (the x values, the y values, a panel per protocol and
    threat model: (norm, threat, {(y value, x value): cell}))."""
    xs = sorted({hashable(c[x]) for c in cells}, key=sort_key)
    ys = sorted({hashable(c[y]) for c in cells}, key=sort_key)
    panels = []
    for norm in dict.fromkeys(c["norm"] for c in cells):
        for threat in dict.fromkeys(c["threat"] for c in cells if c["norm"] == norm):
            panels.append((norm, threat, {(hashable(c[y]), hashable(c[x])): c for c in cells
                                          if c["norm"] == norm and c["threat"] == threat}))
    return xs, ys, panels


# a worst case within a point of chance is broken, whatever its interval: no search can lower
# it much (a diverged run counts at chance), and no one would deploy it
AT_CHANCE = 0.01


def pick_head(cell: dict[str, Any], chance: float | None = None) -> str:
    """A map cell's verdict in a few words: "use", "3 tied", "the only defense run", or why none;
    with `chance` (1 / classes), "none works (at chance)" where every pick is within AT_CHANCE
    of it, and a tied set that holds such a pick says so (none of it is shown above chance)."""
    picks, verdict = cell["picks"], cell["verdict"]
    at_chance = [chance is not None and p["worst_acc"] <= chance + AT_CHANCE for p in picks]
    if verdict in (BEST, TIED, ONLY) and picks and all(at_chance):
        return "none works (at chance)"
    head = {BEST: "use", TIED: f"{len(picks)} tied", ONLY: ONLY}.get(verdict, verdict)
    if verdict == TIED and any(at_chance):
        head += f", {'one' if sum(at_chance) == 1 else sum(at_chance)} of them at chance: none is shown above chance"
    return head


def protocol_head(cell: dict[str, Any], chance: float | None = None, planned: Iterable[str] = ()) -> str:
    """A `protocol_map` cell's verdict in a few words: "use FBN", "2 tied", "none works (at
    chance)", "only FBN run" ("finished" where others are planned); `planned`: the protocols meant to be there, those missing
    named ("FBN above (of those finished; FixBN not yet)": the missing may stand above it)."""
    ps, verdict = cell["protocols"], cell["verdict"]
    lead = norm_words(ps[0]["norm"])
    missing = [norm_words(n) for n in planned if n not in {p["norm"] for p in ps}]
    later = f"{', '.join(missing)} not yet"
    at_chance = chance is not None and all(p["worst_acc"] <= chance + AT_CHANCE for p in ps)
    if len(ps) == 1:
        # "finished" where others are to come; "run" where it is all there is
        return f"only {lead} {'finished' if missing else 'run'}" + (", at chance" if at_chance else "") + \
            (f" ({later})" if missing else "")
    if verdict in (BEST, TIED) and at_chance:
        head = "none works (at chance)"
    else:
        head = {BEST: f"use {lead}" if not missing else f"{lead} above",
                TIED: f"{sum(p['verdict'] == TIED for p in ps)} tied"}.get(verdict, verdict)
    return head + (f" (of those finished; {later})" if missing else "")


def provisional(cell: dict[str, Any], searched: Callable[[dict[str, Any]], bool], chance: float | None = None,
                partly: Callable[[dict[str, Any]], bool] = lambda p: False) -> str:
    """Words after a `protocol_map` verdict that a search could still turn: "; provisional: no
    attack search confirmed against FBN", naming the picks no attack search has confirmed
    (`searched(pick)`) among those that decide it (the leader and those tied with it, above
    chance: lowering a protocol already lower, or one at chance, changes nothing), and those
    whose own search is confirmed but has not yet tried the attacks confirmed at the defense's
    other points (`partly(pick)`); "" otherwise, and where there is no verdict (too few pairs)
    to hold back."""
    ps = cell["protocols"]
    if cell["verdict"] not in (BEST, TIED):
        return ""
    deciding = [p for i, p in enumerate(ps) if (i == 0 or p["verdict"] == TIED)
                and (chance is None or p["worst_acc"] > chance + AT_CHANCE)]
    open_ = [norm_words(p["norm"]) for p in deciding if not searched(p) and not partly(p)]
    half = [norm_words(p["norm"]) for p in deciding if not searched(p) and partly(p)]
    words = [f"no attack search confirmed against {', '.join(open_)}"] * bool(open_) + \
        [f"the search against {', '.join(half)} has not yet tried the attacks confirmed at its other points"] * bool(half)
    return f"; provisional: {'; '.join(words)}" if words else ""


def gap_words(cell: dict[str, Any], pick: dict[str, Any]) -> str:
    """A compared protocol's words under a `protocol_map` cell's first: "lower by 5.6 [0.3, 10.8]
    (5 pairs)", "tied, gap ...", or the bare "gap ..." where the cell has no verdict (too few
    pairs)."""
    n = pick["gap_pairs"] or 0
    if not n:
        return "no seed in common"
    gap = f"{100 * pick['gap']:.1f} " + (f"[{100 * pick['gap_low']:.1f}, {100 * pick['gap_high']:.1f}] ({n} pairs)"
                                          if pick["gap_low"] is not None else f"({n} pair, no interval)")
    if cell["verdict"] not in (BEST, TIED):
        return f"gap {gap}"
    return {WORSE: f"lower by {gap}", TIED: f"tied, gap {gap}"}.get(pick["verdict"], pick["verdict"])
