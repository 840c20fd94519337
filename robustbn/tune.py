"""`robustbn tune`: each defense's hyperparameters chosen before it is attacked, by ByzFL's rule.

For a matrix file (defenses x attacks at one setting) and a grid (`lr = [0.01, 0.05, 0.1]`, or
several fields: their cross product), every grid point runs the matrix on tuning seeds that no
report uses (default 10 and 11). A defense's score at a point is its worst case over the
matrix's attacks (robustbn.worst: the lowest mean over seeds, a diverged run at chance); its
chosen point is the highest score (ties: the first point of the grid), the max over the grid
of the min over attacks. `tuned_files` writes, per defense, the matrix with its chosen point
on the reporting seeds, which `robustbn run` then runs like any other file.

Pruning (`Tuning`) runs fewer runs for the same choice. A point's score is the minimum over its
attacks, so the attacks it has finished bound it from above: once that bound is below a
finished point's score (or level with an earlier finished point's, which wins ties), it cannot
be chosen and its other attacks are not run. The tuning runs in waves, best first: each point
of a defense runs its most harmful attack, then, wave after wave, the point with the highest
bound (ties: the first) runs its next attack, until that point has finished every attack. Every
run then went to a point that could still have been chosen. Attacks go most harmful first (by
their mean accuracy at the defense's other points, else at other defenses, else in file order).
The clean runs are never run: the rule reads attacked runs only. The chosen point is the one
the full grid gives (tested against it).
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any, Callable

from .channels import expand_channels
from .labels import hashable, is_attack, setting_defense_words, text
from .matrix import FIELDS, MatrixError, alternatives, canonical, expand, read
from .stats import by_seed, scenario_fields
from .worst import ATTACK_FIELDS, ATTACK_KEYS, DEFENSE_FIELDS, RESULT, worst_case

TUNING_SEEDS = [10, 11]
TUNING_WORDS = "robustbn tune: "  # how a tuning file's description begins: its runs are no report's
REPORT_SEEDS = [0, 1, 2, 3, 4]
# the fields of a defense's row that are not its identity (results, and the raw worst attack)
_NOT_IDENTITY = set(RESULT) | {"seed"}


RULE_FIELDS = ("grad_agg", "bn_agg", "bn_mean_agg", "bn_var_agg", "client_filter")  # which defense, not how


class TuneError(MatrixError):
    """A user error in what to tune: the message names the option and what is allowed."""


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The grid's points: the cross product of its fields' values, in the order given."""
    for key, values in grid.items():
        if key not in FIELDS or key in ("seed", "norm") or key.endswith(("_attack", "_attack_params")):
            raise TuneError(f"--grid {key}: not a field to tune; a scalar field of the setting or of a defense, e.g. "
                            f"lr, momentum, grad_agg_params")
        if key in RULE_FIELDS:
            raise TuneError(f"--grid {key}: picks the defense itself, not a setting of it; list the choices in the "
                            f"matrix (each is tuned on its own) and grid their parameters ({key}_params)")
        if not isinstance(values, list) or len(values) < 2:
            example = f"{key}=[{{tau=1.0}},{{tau=10.0}}]" if key.endswith("_params") else f"{key}=[0.01,0.05,0.1]"
            got = "one value" if isinstance(values, list) else f"{text(values)!r} is not a list"
            raise TuneError(f"--grid {key}: {got}; give a list of at least 2 values (TOML), e.g. --grid {example}")
        if len({repr(hashable(v)) for v in values}) < len(values):
            raise TuneError(f"--grid {key}: a value is listed twice")
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def score(acc: float) -> float:
    """A worst case as the rule compares it: accuracies are counts over a test set, so two means
    that differ only in float32's last bits (10.000000149% and 9.999999404%: chance at every lr)
    are equal, and the first point of the grid wins, not rounding noise."""
    return round(acc, 6)


def choose(rows: list[dict[str, Any]], grid: dict[str, list[Any]],
           pruned: Callable[[dict[str, Any], int], bool] | None = None,
           point_of: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Per defense (a row of the worst-case table, the grid's fields aside): its worst case at
    each grid point and the chosen point, the max over the grid of the worst case over
    attacks. Each: norm, defense, server_data, scores ([{point, worst_acc, ci_low, ci_high,
    seeds, worst_attack, attacks, pruned}] in grid order), chosen (the point), chosen_acc, setting (the
    defense's fields, to write its tuned file). `pruned(setting, i)`: whether grid point i of
    a defense (a worst-case row) was pruned (Tuning.pruned): its score is the worst case over
    the attacks it ran, and it is never chosen. `point_of`: each run's grid point (by hash), where
    the runs hold a point's values in another spelling than the grid's (a rule's parameters with
    its defaults filled in, "none" as no value); else a run's point is the grid value it holds."""
    points = grid_points(grid)
    keys = list(grid)
    point = _point_finder(points, point_of)
    at_point: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        i = point(r.get("hash"), r)
        if i is not None:
            at_point.setdefault(i, []).append(r)
    defenses: dict[tuple, dict[str, Any]] = {}
    for i in sorted(at_point):
        for t in worst_case(at_point[i]):
            if not t.get("f"):
                continue
            # labels made of the fields, the grid's included (a rule's parameters, a root set's size), are no identity;
            # a worst-case table lists a field (as None) where any of its rows has it, so an absent field and a None
            # are the same, and the order of a row's fields is no identity either
            ident = tuple(sorted((k, repr(hashable(v))) for k, v in t.items() if v is not None
                                 and k not in _NOT_IDENTITY and k not in keys and not k.startswith("no_attack")
                                 and not k.startswith("gap") and k not in ("verdict", "defense", "server_data")))
            label = setting_defense_words({k: v for k, v in t.items() if k not in keys})
            d = defenses.setdefault(ident, {"norm": t["norm"], "defense": label, "by_point": {}, "setting": t})
            d["by_point"][i] = t
    out = []
    for d in defenses.values():
        scores = []
        for i, point in enumerate(points):
            t = d["by_point"].get(i)
            scores.append({"point": point, "worst_acc": t and t["worst_acc"], "ci_low": t and t["ci_low"],
                           "ci_high": t and t["ci_high"], "seeds": t["seeds"] if t else 0,
                           "worst_attack": t and t["worst_attack"], "attacks": t["attacks"] if t else 0,
                           "worst_by_seed": t["worst_by_seed"] if t else {},
                           "pruned": bool(t and pruned and pruned(t, i))})
        known = [s for s in scores if s["worst_acc"] is not None]
        candidates = [s for s in known if not s["pruned"]]
        best = max(candidates, key=lambda s: score(s["worst_acc"])) if candidates else None  # max keeps the first of equals
        shown = d["by_point"][points.index(best["point"])] if best else d["setting"]
        out.append({"norm": d["norm"], "defense": d["defense"], "server_data": shown["server_data"], "scores": scores,
                    "chosen": best and best["point"], "chosen_acc": best and best["worst_acc"],
                    "complete": len(known) == len(points), "setting": d["setting"]})
    return out


def _point_finder(points: list[dict[str, Any]], point_of: dict[str, int] | None) -> Callable[[str, dict], int | None]:
    """(hash, row) -> the run's grid point: by `point_of` where given, else by the grid value it holds."""
    if point_of is not None:
        return lambda run_hash, row: point_of.get(run_hash)
    keys = list(points[0])
    index = {_key(p, keys): i for i, p in enumerate(points)}
    return lambda run_hash, row: index.get(_key(row, keys))


def varies(values: dict[str, Any], key: str) -> bool:
    """Whether a matrix gives several values of `key` (a plain lr_milestones is one value)."""
    return key in values and len(alternatives(key, values[key])) > 1


def tuned_values(values: dict[str, Any], choice: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """The matrix restricted to one defense at its chosen point (as the grid spells it), on the
    reporting seeds. A field the matrix varies and the defense leaves unset ("none" filter, no
    root set) is left out: its default is that."""
    setting = choice["setting"]
    narrowed = {}
    for k in values:
        if varies(values, k) and k in FIELDS and k != "seed" and k not in ATTACK_KEYS:
            narrowed[k] = setting.get(k)
    at = "".join(f", {k} = {setting.get(k)}" for k in setting_fields(values))
    kept = {k: v for k, v in {**values, **narrowed}.items() if v is not None}
    return {**kept, **choice["chosen"], "seed": seeds,
            "description": f"robustbn tune: {choice['defense']} under {choice['norm']}{at}, at its chosen "
                           f"{', '.join(f'{k} = {v}' for k, v in choice['chosen'].items())} (the max over the grid "
                           f"of the worst case over the attacks, on the tuning seeds), on the reporting seeds"}


def setting_fields(values: dict[str, Any]) -> list[str]:
    """The fields a matrix varies that are neither the protocol, the defense, the attack nor the
    seed (gamma, f, ...): each of their points is tuned on its own. A file's `exclude` list is
    no field."""
    return [k for k in values if varies(values, k) and k in FIELDS and k not in ("seed", "norm")
            and k not in DEFENSE_FIELDS and k not in ATTACK_KEYS]


def slug(choice: dict[str, Any], values: dict[str, Any] | None = None) -> str:
    """A file name for a defense's tuned file: its protocol, its defense and, where the matrix
    varies the setting (gamma, f, ...), the point's values, so that points never share a file."""
    point = " ".join(f"{k} {choice['setting'].get(k)}" for k in setting_fields(values or {}))
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{choice['norm']} {choice['defense']} {point}").strip("_").lower()[:120]


def is_tuning_file(source: Any) -> bool:
    """Whether a run came from a tuning file that `robustbn tune` wrote (its runs are on tuning
    seeds, which no report uses): named tune_<matrix>.toml (its tuned files are tuned_*.toml,
    whose runs are reported), with the description tune writes, or gone."""
    if not source or not Path(str(source)).name.startswith("tune_"):
        return False
    try:
        import tomllib
        text = Path(str(source)).read_text(encoding="utf-8")
        return str(tomllib.loads(text).get("description", "")).startswith(TUNING_WORDS)
    except (OSError, ValueError):
        return True


def check_matrix(path: str | Path) -> dict[str, Any]:
    values = read(path)
    if "search" in values:
        raise TuneError(f"{path}: a search file; tune a matrix of defenses and attacks")
    return values


def expand_grid(tuning: Path, grid: dict[str, list[Any]]) -> tuple[dict[str, Any], dict[str, int]]:
    """The tuning file's scenarios at every grid point, by hash, and each run's grid point (a run
    may spell its point otherwise: a rule's defaults filled in, "none" as no value)."""
    from .store import scenario_hash

    file_values, by_hash, point_of = read(tuning), {}, {}
    points = grid_points(grid)
    words = lambda p: ", ".join(f"{k}={v!r}" for k, v in p.items())
    for i, point in enumerate(points):
        try:
            expanded = expand({**file_values, **point}, str(tuning))
        except MatrixError as e:
            if not any(f"key {k!r}" in str(e) for k in point):
                raise
            advice = ("; tune a parameter one defense at a time (--set grad_agg=... first) where the matrix's "
                      "defenses do not all take it") if any(k.endswith("_params") for k in point) else ""
            raise TuneError(f"--grid {words(point)}: {e}{advice}") from None
        for sc in expanded:
            h = scenario_hash(sc.to_dict())
            if point_of.setdefault(h, i) != i:
                raise TuneError(f"--grid: {words(points[point_of[h]])} and {words(point)} are the same runs; give "
                                f"each value once")
            by_hash[h] = sc
    return by_hash, point_of


def settled_choices(finished: dict[str, dict[str, Any]], grid: dict[str, list[Any]], plan: Tuning,
                    point_of: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """choose() over a tuning's finished runs (by hash), each defense `complete` only once the
    pruning has settled it: every grid point finished or pruned. A point still running has a
    worst case over the attacks it has finished, which is no score yet."""
    settled = plan.settled(finished)
    choices = choose(list(finished.values()), grid, plan.pruned(finished), point_of)
    for c in choices:
        c["complete"] = c["complete"] and settled.get(plan.identity(c["setting"]), False)
    return choices


MIN_WAVE = 16  # a wave cut to --first's defenses still has this many runs a job: lanes sharing a store stay busy


def first_ranks(by_hash: dict[str, Any], key: str, wanted: list[Any]) -> dict[str, int]:
    """Each run's priority (by hash) for `robustbn tune --first KEY=[V1,...]`: the index of its
    KEY in `wanted`, and len(wanted) for every other value. A value no run has is an error."""
    if key not in FIELDS or key == "seed":
        raise TuneError(f"--first {key}: not a field of the matrix's defenses or settings, e.g. --first norm=fbn")
    held = [canonical(getattr(sc, key, None)) for sc in by_hash.values()]
    have = list(dict.fromkeys(repr(hashable(v)) for v in held))
    ranks_of = {repr(hashable(canonical(v))): i for i, v in reversed(list(enumerate(wanted)))}
    missing = [v for v in wanted if repr(hashable(canonical(v))) not in have]
    if missing:
        raise TuneError(f"--first {key}={missing[0]!r}: no run of the tuning has it; its runs have "
                        f"{key} in {', '.join(have)}")
    return {h: ranks_of.get(repr(hashable(v)), len(wanted)) for h, v in zip(by_hash, held)}


def first_runs(wave: list[str], rank: dict[str, int], min_runs: int | None = None) -> list[str]:
    """A wave cut to its highest-priority runs (`first_ranks`): the runs of the best rank it
    holds, then of the next, until it has at least `min_runs` (default MIN_WAVE: one job's). Every run kept
    is one the pruning asked for, so the choices are the same; only their order changes."""
    min_runs = MIN_WAVE if min_runs is None else min_runs
    kept: list[str] = []
    for r in sorted({rank[h] for h in wave}):
        kept += [h for h in wave if rank[h] == r]
        if len(kept) >= min_runs:
            break
    return kept


def _key(row: dict[str, Any], fields) -> tuple:
    """Values as the store holds them (1 and 1.0 alike), hashable."""
    return tuple(repr(hashable(canonical(row.get(k)))) for k in fields)


class Tuning:
    """The attacked runs of a tuning file as the rule reads them, and how far they are.

    `planned`: (hash, scenario dict) of every run of the tuning file; `grid`: the tuned fields'
    values. Runs group by defense (every field but the grid's, the attack's and the seed), then
    grid point, then attack; each attack's seeds are its runs."""

    def __init__(self, planned: list[tuple[str, dict[str, Any]]], grid: dict[str, list[Any]],
                 point_of: dict[str, int] | None = None):
        """`point_of`: each run's grid point (by hash), as choose() takes it."""
        self.points = grid_points(grid)
        self.keys = keys = list(grid)
        point = _point_finder(self.points, point_of)
        self.defenses: dict[tuple, list[dict[tuple, list[str]]]] = {}
        # every channel's attack spelled out, as the store's rows; clean runs left out: the rule
        # reads attacked runs only
        attacked = [(h, sc) for h, sc in ((h, expand_channels(sc)) for h, sc in planned) if is_attack(sc)]
        self.hashes = {h for h, _ in attacked}
        # a defense's fields: those of any planned run (a field at its default may be left out)
        # (user_code follows the rule and attack names: a user's attack is no other defense; one
        # tuning expands its file once, so one version of each module)
        self.fields = [k for k in scenario_fields([sc for _, sc in attacked], ATTACK_KEYS)
                       if k not in keys and k != "user_code"]
        for run_hash, sc in attacked:
            ident = self.identity(sc)
            by_point = self.defenses.setdefault(ident, [{} for _ in self.points])
            by_point[point(run_hash, sc)].setdefault(_key(sc, ATTACK_FIELDS), []).append(run_hash)
        self.file_order = {a: i for i, a in enumerate(dict.fromkeys(_key(sc, ATTACK_FIELDS) for _, sc in attacked))}

    def identity(self, row: dict[str, Any]) -> tuple:
        """A defense: the fields robustbn.worst makes a setting of (every scenario field but the
        attack's and the seed), the grid's aside. Works on a store row and a worst-case row."""
        return _key(row, self.fields)

    def pruned(self, finished: dict[str, dict[str, Any]]) -> Callable[[dict[str, Any], int], bool]:
        """choose()'s `pruned`: whether point i of the defense of a worst-case row is pruned."""
        states = self.state(finished)
        return lambda row, i: bool(states.get(self.identity(row), [{}] * len(self.points))[i].get("pruned"))

    @property
    def attacked(self) -> int:
        return len(self.hashes)

    @staticmethod
    def _mean(hashes: list[str], finished: dict[str, dict[str, Any]]) -> float | None:
        """An attack's mean accuracy over its seeds (as robustbn.worst pools it), None until every
        seed has finished."""
        if any(h not in finished for h in hashes):
            return None
        values = list(by_seed(finished[h] for h in hashes).values())
        return math.fsum(values) / len(values)  # robustbn.stats.interval's mean, to the last bit

    def state(self, finished: dict[str, dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
        """Per defense, per grid point: means ({attack: mean} of its finished attacks), bound
        (the lowest of them: the point's score can only fall below it), complete, pruned."""
        out = {}
        for ident, by_point in self.defenses.items():
            states = []
            for attacks in by_point:
                means = {a: m for a, hashes in attacks.items() if (m := self._mean(hashes, finished)) is not None}
                states.append({"means": means, "bound": min(means.values()) if means else None,
                               "complete": len(means) == len(attacks), "attacks": len(attacks), "pruned": False})
            complete = [(i, st) for i, st in enumerate(states) if st["complete"] and st["bound"] is not None]
            for i, st in enumerate(states):
                if st["complete"] or st["bound"] is None:
                    continue
                # a finished point q wins over i whatever i's other attacks give: i's score <= bound
                st["pruned"] = any(score(q["bound"]) > score(st["bound"]) or
                                   (score(q["bound"]) == score(st["bound"]) and j < i) for j, q in complete)
            out[ident] = states
        return out

    def next_wave(self, finished: dict[str, dict[str, Any]], skip: frozenset[str] = frozenset()) -> list[str]:
        """The runs to do next, best first, per defense: each point without a finished attack
        runs its most harmful attack; then the point with the highest bound (ties: the first
        point), unless it has finished every attack, runs its next. Empty when every choice is
        settled. `skip`: runs not to offer again (they failed): their point goes on with its
        other attacks, and one that has none left is passed over."""
        states_all = self.state(finished)
        elsewhere = self._harm(states_all.values())
        wave = []
        for ident, states in states_all.items():
            by_point = self.defenses[ident]
            todo = lambda hashes: [h for h in hashes if h not in finished and h not in skip]
            left = lambda i: [a for a, hashes in by_point[i].items() if todo(hashes)]
            here = self._harm([states])
            # an attack half run first; then the most harmful here, then elsewhere, then file order
            harm = lambda i: lambda a: (not any(h in finished for h in by_point[i][a]),
                                        *((0, here[a]) if a in here else (1, elsewhere[a]) if a in elsewhere
                                          else (2, 0.0)), self.file_order[a])
            open_points = [i for i, st in enumerate(states) if not st["complete"] and not st["pruned"] and left(i)]
            fresh = [i for i in open_points if states[i]["bound"] is None]
            if fresh:  # no bound yet: any of them may score highest
                for i in fresh:
                    wave += todo(by_point[i][min(left(i), key=harm(i))])
                continue
            contenders = [i for i, st in enumerate(states) if st["bound"] is not None and not st["pruned"]
                          and (st["complete"] or i in open_points)]
            if not contenders:
                continue
            leader = max(contenders, key=lambda i: (score(states[i]["bound"]), -i))
            if not states[leader]["complete"]:
                wave += todo(by_point[leader][min(left(leader), key=harm(leader))])
        return wave

    @staticmethod
    def _harm(states_of_defenses) -> dict[tuple, float]:
        """Each attack's mean accuracy over the points (of these defenses) that finished it."""
        seen: dict[tuple, list[float]] = {}
        for states in states_of_defenses:
            for st in states:
                for a, m in st["means"].items():
                    seen.setdefault(a, []).append(m)
        return {a: math.fsum(ms) / len(ms) for a, ms in seen.items()}

    def settled(self, finished: dict[str, dict[str, Any]]) -> dict[tuple, bool]:
        """Per defense: whether every grid point has finished or been pruned."""
        return {ident: all(st["complete"] or st["pruned"] for st in states)
                for ident, states in self.state(finished).items()}
