"""The adaptive worst case: an Optuna search over attacks on one defense (`robustbn attack-search`).

A search file is a scenario file with one value per field and a `[search]` table declaring
the attack space: per channel (grad, bn_mean, bn_var) the attacks allowed and ranges of their
parameters (DESIGN.md, "Verdicts"):

    [search]
    trials = 40          # --trials overrides
    seed = 0             # the sampler's seed; the runs keep the scenario's own `seed`
    [search.grad]
    attacks = ["alie", "minmax", "scale"]
    [search.grad.scale]  # [low, high], [low, high, "log"], a list of names (choices) or one value
    factor = [-1000.0, 1.0]

Each trial is one attack point run on each of its seeds (`seeds = [...]`, default the
scenario's own `seed`), every seed an ordinary run in the results store (its scenario's hash,
checkpoints, resume). Optuna's TPE sampler proposes the attack point; the objective, minimized,
is the trial's mean over its seeds of the final test accuracy (the last evaluation, at round
`rounds`: what the worst-case table and every result view read; a diverged run counts at chance).

A search reports the worst of what it tried. Accuracy before the last evaluation does not
bound the final one under attack (over the store's 623 attacked 150-round runs, the final fell
up to 0.41 below the accuracy at half the rounds, 0.33 at five sixths), so no run is stopped on
its curve by default. A trial stops early only when a lower bound of its objective exceeds the
worst objective found so far: the seeds already run plus 0 for the others (exact), and, with
`prune_margin` < 1, the running seed's accuracy minus the margin at an evaluation from
`prune_from` x rounds on (an assumption the user takes on). The worst only falls, so a trial
stopped early could never have become the worst; it is kept (status `pruned`, with its bound).

Trials are distinct: a proposal equal to a trial already tried is counted as a repeat and the
sampler asked again; a finite space smaller than `trials` stops when it is exhausted.

The store is the study. Trial k's proposals are drawn by samplers seeded from (seed, k) given
the outcomes of trials 0..k-1, so a search is a function of its file, its seed and those
outcomes; running it again reads every seed run that is finished or was stopped back from the
store instead of running it, and resumes an interrupted run from its checkpoint. A killed
search, run again, therefore continues where it stopped, and a fixed seed gives the same
search. Trials run one after another: a trial's bound reads the trials before it.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import attacks
from aggregators.checks import as_float, is_integer

from .channels import CHANNELS, expand_channels
from .matrix import FIELDS, MatrixError, alternatives, expand, parse_override, read
from .scenario import RESERVED_PARAMS, Scenario, type_names
from .stats import accuracy
from .store import FINISHED, Store, finite_history, same_runs, scenario_hash

SEARCH_KEYS = ("trials", "seed", "seeds", "prune_from", "prune_margin", *CHANNELS)
OBJECTIVE = ("the trial's mean over its seeds of the final test accuracy (the last evaluation); a diverged run "
             "counts at chance, 1 / classes")
TPE_ATTEMPTS = 3  # proposals from TPE for one trial before untried points are drawn uniformly
MAX_ATTEMPTS = 200  # proposals for one trial before the search gives up on finding an untried point
MAX_ENUMERATED = 100_000  # a finite space up to this size is listed to draw its untried points
SIGNIFICANT = 6  # sampled numbers are rounded to this many significant digits (readable, stable hashes)


class SearchError(MatrixError):
    """A bad search file or a search that cannot go on: one line naming the file, the key and
    what is allowed."""


@dataclass(frozen=True)
class Range:
    """How one attack parameter is searched: `kind` "float" or "int" between low and high
    (log-uniform with `log`), "choice" among `choices`, or "fixed" at `value`."""

    kind: str
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    choices: tuple = ()
    value: Any = None

    def ends(self) -> tuple[Any, Any]:
        """Its two extreme values (the first and last choice; the fixed value twice)."""
        if self.kind == "fixed":
            return self.value, self.value
        if self.kind == "choice":
            return self.choices[0], self.choices[-1]
        return self.low, self.high


@dataclass
class Space:
    """The searched channels, each with its attacks in file order and their parameters' ranges."""

    channels: dict[str, dict[str, dict[str, Range]]]
    trials: int
    seed: int
    seeds: tuple[int, ...] = (0,)   # every trial runs on each
    prune_from: float = 0.5         # share of the rounds before which no run stops on its curve
    prune_margin: float = 1.0       # a run's final >= its accuracy then - margin (1: no assumption)


@dataclass
class SeedRun:
    seed: int
    hash: str
    scenario: dict[str, Any]
    status: str                     # done, diverged, pruned, failed
    final_acc: float | None         # diverged: chance, 1 / classes; None if pruned or failed
    rounds_done: int
    ran: bool                       # run (or resumed) by this search, not read back from the store
    bound: float | None = None      # pruned: the trial's lower bound that stopped it


@dataclass
class Trial:
    number: int                     # 1-based
    hash: str                       # its first seed's run
    scenario: dict[str, Any]        # its first seed's scenario
    status: str                     # done, diverged (a seed diverged), pruned (stopped early), failed
    final_acc: float | None         # the objective: mean over seeds of the final accuracy; None if pruned or failed
    rounds_done: int                # over all its seeds
    ran: bool                       # a seed run (or resumed) by this search, not read back from the store
    runs: list[SeedRun] = field(default_factory=list)  # the seeds run, in order (a pruned trial may skip some)
    bound: float | None = None      # pruned: its objective is at least this, above the worst found before it
    given: str | None = None        # the --try file whose attack it is; None: the sampler's

    def as_json(self) -> dict[str, Any]:
        from .labels import attack_words
        return {"trial": self.number, "attack": attack_words(self.scenario), "status": self.status,
                "final_acc": self.final_acc, "bound": self.bound, "given": self.given,
                "seeds": [{"seed": r.seed, "hash": r.hash, "status": r.status, "final_acc": r.final_acc,
                           "rounds_done": r.rounds_done} for r in self.runs]}


@dataclass
class Outcome:
    trials: list[Trial] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    prune_from: float = 0.5
    prune_margin: float = 1.0
    wanted: int = 0                 # trials asked for
    space_size: int | None = None   # distinct points of a finite space
    proposals: int = 0              # the sampler's proposals, repeats included
    repeats: int = 0                # proposals equal to a trial already tried: not counted
    stopped: str | None = None      # why the search ended before `wanted` trials

    @property
    def worst(self) -> Trial | None:
        """The finished trial of lowest accuracy (the first of equals)."""
        finished = [t for t in self.trials if t.final_acc is not None]
        return min(finished, key=lambda t: t.final_acc) if finished else None

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.trials)

    def as_json(self) -> dict[str, Any]:
        """DESIGN.md's object: `worst` (its final_acc, the objective, and the trial's scenario
        fields, with its seeds and their runs), `trials` (distinct), `pruned`; and `failed`,
        `objective`, `proposals`, `repeats`, `pruning` and every trial (`tried`)."""
        w = self.worst
        worst = None if w is None else {**expand_channels(w.scenario), "final_acc": w.final_acc, "trial": w.number,
                                        "hash": w.hash, "status": w.status, "seeds": [r.seed for r in w.runs],
                                        "hashes": [r.hash for r in w.runs], "given": w.given,
                                        "final_accs": [r.final_acc for r in w.runs]}
        return {"objective": OBJECTIVE, "seeds": self.seeds, "worst": worst, "trials": len(self.trials),
                "proposals": self.proposals, "repeats": self.repeats, "pruned": self.count("pruned"),
                "failed": self.count("failed"), "stopped": self.stopped,
                "pruning": {"prune_from": self.prune_from, "prune_margin": self.prune_margin,
                            "rule": "a trial stops early only when a lower bound of its objective exceeds the worst "
                                    "found before it: its seeds run plus 0 for the others, and the running seed's "
                                    "accuracy minus prune_margin from prune_from x rounds on (prune_margin 1: no "
                                    "assumption)"},
                "tried": [t.as_json() for t in self.trials]}


# ---- the search file -------------------------------------------------------------------------

def load(path: str | Path, overrides: list[str] = (), on: str | Path | None = None,
         sampler_seed: int | None = None) -> tuple[dict[str, Any], Space]:
    """(the file's scenario values, the attack space), every value checked: a SearchError (or
    MatrixError) names the file, the key and what is allowed. `on`: a matrix file of one
    defense at one setting (a tuned file of robustbn tune) whose fields replace the search
    file's, its attacks and seeds aside: the search file then gives the [search] space and the
    attacks it fixes; a channel neither searches nor fixes keeps MATRIX's attack where it has one.
    `sampler_seed` replaces [search] seed."""
    values = read(path, overrides)
    src = str(path)
    on_seeds = None
    if on is not None:
        defense, on_seeds = defense_of(on)
        # user modules: where either file looks for them, MATRIX's own folder included
        dirs = [*values.get("search_path", []), *defense.pop("search_path", []), str(Path(on).resolve().parent)]
        # a channel neither [search] nor the search file sets keeps MATRIX's attack where it has one
        from .worst import ATTACK_KEYS

        own = {k: v for k, v in values.items() if k in ATTACK_KEYS}
        searched = values.get("search") if isinstance(values.get("search"), dict) else {}
        mine = {c for c in CHANNELS if f"{c}_attack" in own or (c != "grad" and "bn_attack" in own) or c in searched}
        kept = {k: v for k, v in _single_attacks(read(on)).items() if k.split("_attack")[0] not in mine}
        values = {**{k: v for k, v in values.items() if k not in FIELDS and k != "search_path"}, **own, **kept,
                  **defense, "search_path": list(dict.fromkeys(dirs))}
        for text in overrides:  # --set still has the last word
            key, value = parse_override(text)
            values[key] = value
    table = values.pop("search", None)
    if not isinstance(table, dict):
        raise SearchError(f"{src}: no [search] table; a search file is a scenario file with a [search] table "
                          f"(trials, seed, and a table per searched channel: {', '.join(CHANNELS)})")
    if "exclude" in values:
        raise SearchError(f"{src}: 'exclude': a search file fixes one scenario; nothing to exclude")
    for key, value in values.items():
        if key in FIELDS and len(alternatives(key, value)) > 1:
            raise SearchError(f"{src}: key {key!r} is a list ({value!r}); a search file gives one value per field "
                              f"(the search varies only the attacks of [search]; `robustbn run` runs a matrix)")
    # the fixed fields checked with the searched channels sent honestly (a client filter wants
    # statistics); 'honest' needs f >= 1, which the search's own check below words
    honest = {f"{c}_attack": "honest" for c in CHANNELS if isinstance(table.get(c), dict)}
    no_byzantine = is_integer(values.get("f", 0)) and values.get("f", 0) < 1
    base = expand(values if no_byzantine else {**values, **honest}, src)[0]
    space = _space(table, values, base, src)
    if sampler_seed is not None:
        if not is_integer(sampler_seed) or not 0 <= sampler_seed < 2**63:
            raise SearchError(f"--sampler-seed must be an integer in [0, 2**63 - 1], got {sampler_seed!r}")
        space.seed = int(sampler_seed)
    if on_seeds and set(space.seeds) & set(on_seeds):
        raise SearchError(f"{src}: [search] seeds {list(space.seeds)} share a seed with --on {on}'s seeds "
                          f"{on_seeds}; a search runs on seeds held out from those it is confirmed on")
    _check_corners(values, space, src)
    return values, space


def given_point(path: str | Path, values: dict[str, Any], space: Space) -> dict[str, tuple[str, dict]]:
    """--try FILE: the attack of a scenario file of one attack per channel (a confirmation file
    of another search, e.g. at another point of the same defense's curve) as a point of `space`,
    every parameter in its range; a channel the space does not search must carry the search's
    own attack."""
    try:
        attacks = _single_attacks(read(path))
    except MatrixError as e:
        raise SearchError(f"--try {e}") from None
    point = {}
    for channel, options in space.channels.items():
        name = attacks.get(f"{channel}_attack", "honest")
        params = dict(attacks.get(f"{channel}_attack_params") or {})
        if name not in options:
            raise SearchError(f"--try {path}: its {channel} attack {name!r} is not in the search space "
                              f"([search.{channel}] attacks: {', '.join(options)})")
        ranges = options[name]
        if set(params) - set(ranges):
            raise SearchError(f"--try {path}: its {channel} attack {name!r} sets {sorted(set(params) - set(ranges))}, "
                              f"which the search space does not (it has: {', '.join(ranges) or 'none'})")
        for key, r in ranges.items():
            where = f"--try {path}: {channel} attack {name!r}, parameter {key!r}"
            if key not in params:
                if r.kind == "value":
                    params[key] = r.value
                    continue
                raise SearchError(f"{where}: not given; the search space ranges it, so the file must give its value")
            v = params[key]
            inside = (v in r.choices if r.kind == "choice" else v == r.value if r.kind == "value" else
                      isinstance(v, (int, float)) and not isinstance(v, bool) and r.low <= v <= r.high)
            if not inside:
                allowed = (f"one of {list(r.choices)}" if r.kind == "choice" else f"{r.value!r}" if r.kind == "value"
                           else f"in [{r.low:g}, {r.high:g}]")
                raise SearchError(f"{where}: {v!r} is outside the search space ({allowed})")
        point[channel] = (name, params)
    point = _point_of(_params_of(point, space), space)  # as the sampler would spell it (significant digits)
    kept = expand_channels(expand(trial_values(values, point), f"--try {path}")[0].to_dict())
    for key in (k for k in attacks if k.endswith("_attack") and k.removesuffix("_attack") not in space.channels):
        params = f"{key}_params"
        if attacks[key] != kept[key] or params in attacks and attacks[params] != (kept.get(params) or {}):
            raise SearchError(f"--try {path}: {key} = {attacks[key]!r}, but the search keeps that channel at "
                              f"{kept[key]!r} (it does not search it)")
    return point


def _params_of(point: dict[str, tuple[str, dict]], space: Space) -> dict[str, Any]:
    """The Optuna parameters that propose `point` (_suggest's names)."""
    params = {}
    for channel, (name, values) in point.items():
        params[f"{channel}.attack"] = name
        params.update({f"{channel}.{name}.{k}": v for k, v in values.items()
                       if space.channels[channel][name][k].kind != "value"})
    return params


def _single_attacks(values: dict[str, Any]) -> dict[str, Any]:
    """The attack (name, and parameters where given) of each channel a file holds one of:
    `<channel>_attack[_params]`, or `bn_attack[_params]` for both BN channels."""
    out = {}
    for c in CHANNELS:
        key = next((k for k in (f"{c}_attack", *(["bn_attack"] if c != "grad" else [])) if k in values), None)
        if key is None or len(names := alternatives(key, values[key])) != 1:
            continue
        out[f"{c}_attack"] = names[0]
        if f"{key}_params" in values and len(params := alternatives(f"{key}_params", values[f"{key}_params"])) == 1:
            out[f"{c}_attack_params"] = params[0]
    return out


def defense_of(path: str | Path) -> tuple[dict[str, Any], list[int]]:
    """(the one defense and setting of a matrix file: its values but its attacks, seeds and
    excludes; its seeds). A SearchError where any other field has several values."""
    from .worst import ATTACK_KEYS

    values = read(path)
    seeds = alternatives("seed", values.get("seed", 0))
    if not all(is_integer(s) and 0 <= s < 2**63 for s in seeds):
        raise SearchError(f"--on {path}: key 'seed' must be an integer or a list of integers >= 0, got "
                          f"{values.get('seed')!r}")
    kept = {k: v for k, v in values.items()
            if k not in {"seed", "exclude", "description", "search", *ATTACK_KEYS}}
    several = [k for k, v in kept.items() if k in FIELDS and len(alternatives(k, v)) > 1]
    if several:
        raise SearchError(f"--on {path}: key {several[0]!r} has several values ({kept[several[0]]!r}); --on takes a "
                          f"file of one defense at one setting (a tuned file of robustbn tune), its attacks and "
                          f"seeds aside")
    # its fields checked under its own name, every client sending (as its runs do): a rule that
    # needs 2f < n holds for n messages, not for the n - f of Byzantine clients that send nothing
    expand({**kept, **_sending(kept), "seed": seeds[0]}, str(path))
    return kept, [int(s) for s in seeds]


def _sending(values: dict[str, Any]) -> dict[str, str]:
    """Honest attacks on the channels the protocol of `values` sends, where it has Byzantine
    clients (none otherwise: 'honest' needs f >= 1)."""
    from .protocols import get as get_protocol

    f = values.get("f", Scenario.f)
    if not is_integer(f) or f < 1:
        return {}
    try:
        sends = get_protocol(values.get("norm", Scenario.norm)).sends_statistics
    except Exception:  # noqa: BLE001 (an unknown norm, a user's module that fails: expand names it)
        return {}
    return {"grad_attack": "honest", **({"bn_attack": "honest"} if sends else {})}


def _space(table: dict, values: dict, base: Scenario, src: str) -> Space:
    unknown = sorted(set(table) - set(SEARCH_KEYS))
    if unknown:
        raise SearchError(f"{src}: [search] unknown key {unknown[0]!r}; allowed: {', '.join(SEARCH_KEYS)}")
    trials, seed = table.get("trials", 40), table.get("seed", 0)
    if not is_integer(trials) or trials < 1:
        raise SearchError(f"{src}: [search] trials must be an integer >= 1, got {trials!r}")
    if not is_integer(seed) or not 0 <= seed < 2**63:
        raise SearchError(f"{src}: [search] seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    seeds = _seeds(table, values, base, src)
    shares = {}
    for key, default in (("prune_from", 0.5), ("prune_margin", 1.0)):
        x = table.get(key, default)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
            raise SearchError(f"{src}: [search] {key} must be a number in [0, 1], got {x!r}")
        shares[key] = float(x)
    searched = [c for c in CHANNELS if c in table]
    if not searched:
        raise SearchError(f"{src}: [search] declares no channel; give a table per searched channel: "
                          f"{', '.join(f'[search.{c}]' for c in CHANNELS)}")
    if base.f < 1:
        raise SearchError(f"{src}: key 'f': an attack search needs f >= 1 Byzantine clients, got {base.f}")
    from .protocols import get as get_protocol
    sends = get_protocol(base.norm).sends_statistics
    channels = {}
    for c in searched:
        where = f"{src}: [search.{c}]"
        if c != "grad" and not sends:
            raise SearchError(f"{where}: norm = {base.norm!r} sends no BN statistics; allowed channel: grad")
        for key in (f"{c}_attack", f"{c}_attack_params", *(("bn_attack", "bn_attack_params") if c != "grad" else ())):
            if key in values:
                raise SearchError(f"{src}: key {key!r}: the search chooses the attack of {c} ([search.{c}]); "
                                  f"leave {key} out of the file")
        channels[c] = _channel(table[c], where)
    return Space(channels, trials, seed, seeds, **shares)


def _seeds(table: dict, values: dict, base: Scenario, src: str) -> tuple[int, ...]:
    """[search] seeds: the seeds every trial runs on (default the scenario's own `seed`)."""
    if "seeds" not in table:
        return (base.seed,)
    seeds = table["seeds"]
    if not isinstance(seeds, list) or not seeds or not all(is_integer(s) and 0 <= s < 2**63 for s in seeds):
        raise SearchError(f"{src}: [search] seeds must be a non-empty list of integers in [0, 2**63 - 1] (the seeds "
                          f"every trial runs on), got {seeds!r}")
    if len(set(seeds)) < len(seeds):
        raise SearchError(f"{src}: [search] seeds: {next(s for s in seeds if seeds.count(s) > 1)} is listed twice")
    if "seed" in values:
        raise SearchError(f"{src}: key 'seed': [search] seeds sets the seeds of the runs; leave seed out of the file")
    return tuple(int(s) for s in seeds)


def _channel(table: Any, where: str) -> dict[str, dict[str, Range]]:
    if not isinstance(table, dict):
        raise SearchError(f"{where}: must be a table (attacks = [...], and a table of ranges per attack), "
                          f"got {table!r}")
    names = table.get("attacks")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise SearchError(f"{where} attacks: must be a non-empty list of attack names, got {names!r}")
    if len(set(names)) < len(names):
        raise SearchError(f"{where} attacks: {next(n for n in names if names.count(n) > 1)!r} is listed twice")
    out = {}
    for name in names:
        try:
            cls = attacks.get(name)
        except (ValueError, TypeError) as e:
            raise SearchError(f"{where} attacks: {e}") from None
        ranges = table.get(name, {})
        if not isinstance(ranges, dict):
            raise SearchError(f"{where} {name!r}: must be a table of parameter ranges ([search.<channel>.{name}]), "
                              f"got {ranges!r}")
        accepted = _parameters(cls)
        for param, spec in ranges.items():
            if param not in accepted:
                why = RESERVED_PARAMS["attack_params"].get(param)
                raise SearchError(f"{where.rstrip(']')}.{name}] {param}: attack {name!r} does not take {param}"
                                  + (f" ({why})" if why else "")
                                  + f"; allowed: {', '.join(sorted(accepted)) or 'no parameters'}")
        out[name] = {p: _range(f"{where.rstrip(']')}.{name}] {p}", spec, accepted[p]) for p, spec in ranges.items()}
    extra = sorted(set(table) - {"attacks"} - set(names))
    if extra:
        raise SearchError(f"{where} {extra[0]!r}: not one of its attacks ({', '.join(names)}); allowed keys: "
                          f"'attacks' and a table of ranges per attack listed there")
    return out


def _parameters(cls) -> dict[str, set[str]]:
    """The parameters an attack class takes, with their annotated type names (empty: any)."""
    if cls is None or cls.__init__ is object.__init__:
        return {}
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {k: type_names(p.annotation) - {"None"} if p.annotation is not inspect.Parameter.empty else set()
            for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind in plain and k not in ("self", *RESERVED_PARAMS["attack_params"])}


def _range(where: str, spec: Any, types: set[str]) -> Range:
    """A parameter's range: [low, high], [low, high, "log"], a list of names or one value."""
    allowed = '[low, high], [low, high, "log"], a list of names (choices) or one value'
    if not isinstance(spec, list):
        if isinstance(spec, dict):
            raise SearchError(f"{where}: expected {allowed}, got a table")
        return Range("fixed", value=spec)
    numeric = len(spec) in (2, 3) and all(not math.isnan(as_float(v)) for v in spec[:2])
    if numeric:
        if len(spec) == 3 and spec[2] != "log":
            raise SearchError(f"{where}: the third item of a range can only be \"log\", got {spec[2]!r}")
        low, high, log = as_float(spec[0]), as_float(spec[1]), len(spec) == 3
        if not (math.isfinite(low) and math.isfinite(high)):
            raise SearchError(f"{where}: the bounds must be finite numbers, got {spec[:2]!r}")
        if low > high:
            raise SearchError(f"{where}: low {spec[0]!r} > high {spec[1]!r}; give [low, high] with low <= high")
        if log and low <= 0:
            raise SearchError(f"{where}: a log range needs low > 0, got {spec[0]!r}")
        if types and not types & {"int", "float"}:
            raise SearchError(f"{where}: the attack takes {' or '.join(sorted(types))} here, not a number; "
                              f"give a list of choices or one value")
        if types == {"int"}:
            if not (is_integer(spec[0]) and is_integer(spec[1])):
                raise SearchError(f"{where}: the attack takes an integer here: give integer bounds, got {spec[:2]!r}")
            return Range("int", spec[0], spec[1], log)
        return Range("float", low, high, log)
    if spec and all(isinstance(v, (str, bool)) for v in spec):
        if len({repr(v) for v in spec}) < len(spec):
            raise SearchError(f"{where}: a choice is listed twice in {spec!r}")
        return Range("choice", choices=tuple(spec))
    raise SearchError(f"{where}: expected {allowed}, got {spec!r}")


def trial_values(values: dict[str, Any], point: dict[str, tuple[str, dict]]) -> dict[str, Any]:
    """The scenario values of an attack point ({channel: (attack, params)})."""
    out = dict(values)
    for channel, (name, params) in point.items():
        out[f"{channel}_attack"], out[f"{channel}_attack_params"] = name, dict(params)
    return out


def _check_corners(values: dict, space: Space, src: str) -> None:
    """Every attack of every channel at both ends of its ranges (the other channels at their
    first attack's low end) makes a valid scenario: a range the attack or the defense refuses
    is a file error now, not a failed trial later."""
    lows = {c: (next(iter(a)), {p: r.ends()[0] for p, r in next(iter(a.values())).items()})
            for c, a in space.channels.items()}
    for c, options in space.channels.items():
        for name, ranges in options.items():
            for end, label in ((0, "low"), (1, "high")):
                params = {p: r.ends()[end] for p, r in ranges.items()}
                at = f" at the {label} end of its ranges ({', '.join(f'{k}={v!r}' for k, v in params.items())})" \
                    if params else ""
                expand(trial_values(values, {**lows, c: (name, params)}), f"{src}: [search.{c}] {name!r}{at}")


# ---- the search ------------------------------------------------------------------------------

class _Pruned(Exception):
    def __init__(self, history: list[dict], bound: float):
        super().__init__("pruned")
        self.history, self.bound = history, bound


def _accuracy(evaluation: dict, status: str = "done", dataset: str | None = None) -> float:
    """An evaluation's accuracy as every result view counts it (robustbn.stats.accuracy): a
    diverged run's, or one not finite, is chance for `dataset` (1 / classes; without it 0.0,
    which keeps a pruning bound a lower bound)."""
    return accuracy({"status": status, "final_acc": evaluation.get("test_acc"), "dataset": dataset})[0]


@dataclass
class _Bound:
    """When a trial's seed run may stop: the trial's objective is at least (`banked` + the run's
    final + 0 for the seeds not run) / `seeds`, and a run's final is at least its accuracy at an
    evaluation from `prune_from` x rounds on, minus `margin`. A run stops at the first evaluation
    where that lower bound exceeds `worst` (the lowest objective of the trials before): the
    trial cannot end below it. The worst only falls as the search goes on, so no stopped trial
    could have become the worst later."""

    worst: float | None
    banked: float         # the finals of the trial's seeds already run
    seeds: int
    rounds: int
    prune_from: float
    margin: float

    def of(self, acc: float) -> float:
        return (self.banked + max(0.0, acc - self.margin)) / self.seeds

    def stops(self, evaluation: dict) -> float | None:
        """The bound at this evaluation if it stops the run there, else None."""
        t = evaluation["round"]
        if self.worst is None or t >= self.rounds or t < self.prune_from * self.rounds:
            return None
        bound = self.of(_accuracy(evaluation))
        return bound if bound > self.worst else None

    def first_stop(self, history: list[dict]) -> tuple[int, float] | None:
        """(index, bound) of the first evaluation of `history` that stops the run, or None."""
        for i, evaluation in enumerate(finite_history(history)[0]):
            bound = self.stops(evaluation)
            if bound is not None:
                return i, bound
        return None

    def watch(self, history: list[dict]) -> None:
        """runner.run's on_evaluation: stop the run where the bound says so."""
        hit = self.first_stop(history)
        if hit is not None:
            raise _Pruned(finite_history(history)[0][:hit[0] + 1], hit[1])


def _trial_seed(seed: int, number: int, attempt: int = 0) -> int:
    import numpy as np
    return int(np.random.SeedSequence([seed, number] + ([attempt] if attempt else [])).generate_state(1)[0])


def _suggest(trial, space: Space) -> dict[str, tuple[str, dict]]:
    """The trial's attack point: per channel an attack, then that attack's parameters."""
    point = {}
    for channel, options in space.channels.items():
        name = trial.suggest_categorical(f"{channel}.attack", list(options))
        params = {}
        for p, r in options[name].items():
            key = f"{channel}.{name}.{p}"
            if r.kind == "float":
                x = trial.suggest_float(key, r.low, r.high, log=r.log)
                params[p] = float(f"{x:.{SIGNIFICANT}g}")
            elif r.kind == "int":
                params[p] = trial.suggest_int(key, int(r.low), int(r.high), log=r.log)
            elif r.kind == "choice":
                params[p] = trial.suggest_categorical(key, list(r.choices))
            else:
                params[p] = r.value
        point[channel] = (name, params)
    return point


def _point_key(point: dict[str, tuple[str, dict]]) -> str:
    return json.dumps(point, sort_keys=True, default=repr)


def space_size(space: Space) -> int | None:
    """How many distinct attack points the space holds; None where a float range makes it
    unbounded."""
    total = 1
    for options in space.channels.values():
        count = 0
        for ranges in options.values():
            points = 1
            for r in ranges.values():
                if r.kind == "float" and r.low != r.high:
                    return None
                points *= int(r.high) - int(r.low) + 1 if r.kind == "int" else len(r.choices) if r.kind == "choice" else 1
            count += points
        total *= count
    return total


def _enumerate(space: Space) -> list[dict[str, Any]]:
    """Every point of a finite space, as the Optuna parameters that propose it."""
    import itertools

    per_channel = []
    for channel, options in space.channels.items():
        rows = []
        for name, ranges in options.items():
            axes = []
            for p, r in ranges.items():
                key = f"{channel}.{name}.{p}"
                if r.kind == "float":
                    axes.append([(key, r.low)])
                elif r.kind == "int":
                    axes.append([(key, v) for v in range(int(r.low), int(r.high) + 1)])
                elif r.kind == "choice":
                    axes.append([(key, v) for v in r.choices])
            rows += [{f"{channel}.attack": name, **dict(combo)} for combo in itertools.product(*axes)]
        per_channel.append(rows)
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*per_channel)]


@dataclass
class _Proposer:
    """Distinct attack points, reproducibly: trial k's first proposal comes from TPE seeded from
    (seed, k); a proposal equal to a trial already run is counted as a repeat, told to the study
    as failed (it teaches the sampler nothing new) and asked again with another seed, TPE for
    the first TPE_ATTEMPTS, then uniformly among the untried points of a finite space, or from a
    random sampler."""

    study: Any
    space: Space
    seen: set = field(default_factory=set)
    proposals: int = 0
    repeats: int = 0
    _points: list | None = None

    def next(self, number: int):
        import optuna

        for attempt in range(MAX_ATTEMPTS):
            if attempt < TPE_ATTEMPTS:
                with warnings.catch_warnings():  # `group` (conditional spaces) is marked experimental
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    self.study.sampler = optuna.samplers.TPESampler(
                        seed=_trial_seed(self.space.seed, number, attempt), multivariate=True, group=True)
            else:
                self.study.sampler = optuna.samplers.RandomSampler(seed=_trial_seed(self.space.seed, number, attempt))
                untried = self._untried()
                if untried:
                    import numpy as np
                    rng = np.random.default_rng(_trial_seed(self.space.seed, number, attempt))
                    self.study.enqueue_trial(untried[int(rng.integers(len(untried)))])
            trial = self.study.ask()
            point = _suggest(trial, self.space)
            self.proposals += 1
            if _point_key(point) not in self.seen:
                self.seen.add(_point_key(point))
                return trial, point
            self.repeats += 1
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return None

    def _untried(self) -> list[dict]:
        size = space_size(self.space)
        if size is None or size > MAX_ENUMERATED:
            return []
        if self._points is None:
            self._points = _enumerate(self.space)
        return [p for p in self._points if _point_key(_point_of(p, self.space)) not in self.seen]


def _point_of(params: dict[str, Any], space: Space) -> dict[str, tuple[str, dict]]:
    """The attack point that Optuna parameters propose (what _suggest returns for them)."""
    class Fixed:
        def suggest_categorical(self, key, choices):
            return params[key]
        suggest_float = suggest_int = lambda self, key, *a, **k: params[key]
    return _suggest(Fixed(), space)


def _row(store: Store, run_hash: str) -> tuple[str, list[dict], str | None] | None:
    """(status, history, owner) of a run in the store, or None."""
    row = store.db.execute("SELECT status, history, owner FROM runs WHERE hash = ?", (run_hash,)).fetchone()
    return None if row is None else (row[0], json.loads(row[1]) if row[1] else [], row[2])


def search(values: dict[str, Any], space: Space, store: Store, source: str = "", trials: int | None = None,
           progress: bool = True, checkpoint_every: int | None = None,
           log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
           given: list[tuple[str, dict]] = ()) -> Outcome:
    """Run (or resume) the search into `store`: `trials` (default the file's) distinct trials,
    each seed run read back from the store where it is finished or was stopped, else run; then
    each `given` attack ((file, point): --try) not tried yet, as one more trial, so that an
    attack known to hurt this defense elsewhere is never missed by a short search. On SIGINT or
    SIGTERM the running trial stops at its next round end, checkpointed, and Interrupted is
    raised."""
    import optuna
    from tqdm.auto import tqdm

    from .checkpoint import Interrupted, clear_stop, install_stop_handlers, stop_requested
    from .execute import Checkpointing, _Heartbeat
    from .store import new_owner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.NopPruner())
    wanted = trials or space.trials
    size = space_size(space)
    outcome = Outcome(seeds=list(space.seeds), prune_from=space.prune_from, prune_margin=space.prune_margin,
                      wanted=wanted, space_size=size)
    if size is not None and size < wanted:
        outcome.stopped = (f"the space holds {size} distinct attack{'s' * (size != 1)}: the search stops after "
                           f"{size} trials, not {wanted}")
        log(f"{source}: [search] {outcome.stopped}")
    proposer = _Proposer(study, space)
    owner = new_owner()
    ctx = _Context(values, space, store, source, owner, Checkpointing(str(store.path.resolve()), checkpoint_every,
                                                                        False, owner), progress, log)
    clear_stop()
    restore = install_stop_handlers() if threading.current_thread() is threading.main_thread() else (lambda: None)
    try:
        with _Heartbeat(store.path, owner), tqdm(total=min(wanted, size or wanted), desc="attack search",
                                                 unit="trial", disable=not progress) as bar:
            while len(outcome.trials) < min(wanted, size or wanted):
                if stop_requested():
                    raise Interrupted(stop_requested(), outcome)
                number = len(outcome.trials)
                proposed = proposer.next(number)
                outcome.proposals, outcome.repeats = proposer.proposals, proposer.repeats
                if proposed is None:
                    outcome.stopped = (f"no untried attack in {MAX_ATTEMPTS} proposals for trial {number + 1}: "
                                       f"the search stops after {number} trials")
                    log(f"{source}: {outcome.stopped}")
                    break
                trial, point = proposed
                _tell(study, trial, _next_trial(ctx, outcome, point))
                bar.set_postfix(repeats=outcome.repeats, refresh=False)
                bar.update(1)
            for path, point in given:  # after the sampler's: a search run before with fewer reads them all back
                if _point_key(point) in proposer.seen:
                    continue  # the sampler (or an earlier file) tried it already
                if stop_requested():
                    raise Interrupted(stop_requested(), outcome)
                proposer.seen.add(_point_key(point))
                study.enqueue_trial(_params_of(point, space))
                trial = study.ask()
                _suggest(trial, space)  # its parameters registered, so a longer search learns from it
                result = _next_trial(ctx, outcome, point)
                result.given = str(path)
                _tell(study, trial, result)
    except Interrupted as e:
        raise Interrupted(e.signum, outcome) from None
    finally:
        store.release(owner)
        restore()
        clear_stop()
    return outcome


def _next_trial(ctx: _Context, outcome: Outcome, point: dict) -> Trial:
    w = outcome.worst
    result = _trial(ctx, point, len(outcome.trials) + 1, None if w is None else w.final_acc)
    outcome.trials.append(result)
    return result


def _tell(study, trial, result: Trial) -> None:
    import optuna

    if result.status == "pruned":
        trial.report(result.bound, 0)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    elif result.status == "failed":
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    else:
        study.tell(trial, result.final_acc)


@dataclass
class _Context:
    values: dict[str, Any]
    space: Space
    store: Store
    source: str
    owner: str
    checkpointing: Any
    progress: bool
    log: Callable[[str], None]


def _trial(ctx: _Context, point: dict, number: int, worst: float | None) -> Trial:
    """One trial: its seeds one after another, each read back from the store or run here, until
    they are all done or the bound shows the trial cannot end below `worst`."""
    seeds = ctx.space.seeds
    runs: list[SeedRun] = []
    banked = 0.0
    for k, seed in enumerate(seeds):
        sc = expand({**trial_values(ctx.values, point), "seed": seed}, f"{ctx.source}: trial {number}")[0]
        bound = _Bound(worst, banked, len(seeds), sc.rounds, ctx.space.prune_from, ctx.space.prune_margin)
        if worst is not None and banked / len(seeds) > worst:  # the seeds run already settle it
            return _trial_of(number, sc, runs, "pruned", None, banked / len(seeds))
        run = _seed_run(ctx, sc, number, bound)
        runs.append(run)
        if run.status in ("failed", "pruned"):
            return _trial_of(number, sc, runs, run.status, None, run.bound)
        banked += run.final_acc
    status = "diverged" if any(r.status == "diverged" for r in runs) else "done"
    return _trial_of(number, sc, runs, status, banked / len(seeds), None)


def _trial_of(number: int, sc: Scenario, runs: list[SeedRun], status: str, objective: float | None,
              bound: float | None) -> Trial:
    first = runs[0] if runs else None
    scenario = first.scenario if first else sc.to_dict()
    return Trial(number, first.hash if first else scenario_hash(scenario), scenario, status, objective,
                 sum(r.rounds_done for r in runs), any(r.ran for r in runs), runs, bound)


def _seed_run(ctx: _Context, sc: Scenario, number: int, bound: _Bound) -> SeedRun:
    """One seed of a trial: read back when finished, or stopped where the bound still stops it;
    else claimed and run here."""
    values = sc.to_dict()
    run_hash = scenario_hash(values)
    row = _row(ctx.store, run_hash)
    if row is None or row[0] not in FINISHED:  # the same run on another device: read back as it ran there
        there = [(v, h, r) for v in same_runs(values)[1:] if (r := _row(ctx.store, h := scenario_hash(v)))]
        done = [o for o in there if o[2][0] in FINISHED]
        stopped = [o for o in there if o[2][0] == "pruned" and bound.first_stop(o[2][1]) is not None]
        if done or stopped and (row is None or row[0] != "pruned"):
            values, run_hash, row = (done or stopped)[0]
    if row is not None and row[0] == "pruned" and bound.first_stop(row[1]) is None:
        row = None  # stopped under other settings: this search runs it on
    if row is None or row[0] not in (*FINISHED, "pruned"):
        if ctx.store.claim(run_hash, values, ctx.source, ctx.owner):
            return _run(ctx, sc, number, run_hash, bound)
        row = _row(ctx.store, run_hash)
        if row[0] not in (*FINISHED, "pruned"):
            raise SearchError(f"trial {number}: its run {run_hash} is being run by another process ({row[2]}); "
                              f"run the search again once it is done")
    status, history = row[0], row[1]
    history, _ = finite_history(history)
    done = history[-1]["round"] if history else 0
    if status == "pruned":
        return SeedRun(sc.seed, run_hash, values, status, None, done, False, bound.first_stop(history)[1])
    return SeedRun(sc.seed, run_hash, values, status, _final(status, history, values), done, False)


def _run(ctx: _Context, sc: Scenario, number: int, run_hash: str, bound: _Bound) -> SeedRun:
    """Run a claimed seed run (resuming it from its checkpoint) into the store: done or
    diverged, pruned, or failed (its error stored, the search goes on)."""
    from tqdm.auto import tqdm

    from . import runner
    from .checkpoint import Interrupted
    from .execute import _data_for

    values, store, checkpointing = sc.to_dict(), ctx.store, ctx.checkpointing
    with tqdm(total=sc.rounds, desc=f"trial {number}, seed {sc.seed}: {sc.attacks_in_brief()}", unit="round",
              leave=False, disable=not ctx.progress) as bar:
        try:
            result = runner.run(sc, data=_data_for(sc), progress=lambda t: bar.update(t - bar.n),
                                checkpoint=checkpointing.for_run(run_hash), on_evaluation=bound.watch)
        except _Pruned as p:
            t = p.history[-1]["round"]
            store.prune(run_hash, p.history, f"pruned at round {t} by the attack search: its trial's objective is "
                                             f"at least {p.bound:.4f}, above the worst found ({bound.worst:.4f})")
            checkpointing.done_with(run_hash)
            return SeedRun(sc.seed, run_hash, values, "pruned", None, t, True, p.bound)
        except Interrupted:
            store.release(ctx.owner, run_hash)
            raise
        except Exception as e:  # noqa: BLE001 (the run's own error)
            store.fail(run_hash, traceback.format_exc(limit=4))
            ctx.log(f"trial {number}: run {run_hash} failed: "
                    f"{''.join(traceback.format_exception_only(e)).strip().splitlines()[0]}")
            return SeedRun(sc.seed, run_hash, values, "failed", None, 0, True)
    status = store.finish(run_hash, values, result.history, result.bn_stats, result.wall_time_s, result.device,
                          source=ctx.source, resumed_from=result.extra["resumed_from"])
    checkpointing.done_with(run_hash)
    history, _ = finite_history(result.history)
    return SeedRun(sc.seed, run_hash, values, status, _final(status, history, values), history[-1]["round"], True)


def _final(status: str, history: list[dict], values: dict) -> float:
    return _accuracy(history[-1] if history else {}, status, values.get("dataset"))


def summary(outcome: Outcome) -> str:
    """One line: the trials, the proposals that repeated one, and what was stopped early."""
    n = len(outcome.trials)
    given = sum(t.given is not None for t in outcome.trials)
    line = (f"{n} trial{'s' * (n != 1)} ({n - given} distinct attacks from {outcome.proposals} proposals, "
            f"{outcome.repeats} repeat{'s' * (outcome.repeats != 1)} not counted"
            f"{f', and {given} given by --try' if given else ''}): "
            f"{n - outcome.count('pruned') - outcome.count('failed')} finished, {outcome.count('pruned')} stopped "
            f"early (could not end below the worst), {outcome.count('failed')} failed")
    return line + (f"; {outcome.stopped}" if outcome.stopped else "")


TABLE_COLUMNS = ["trial", "attack", "status", "final_acc", "bound", "seeds", "rounds_done", "run", "hash"]


def table_rows(outcome: Outcome) -> list[dict[str, Any]]:
    """The trials as `attack-search` prints them: finished ones from the worst, then those
    stopped early, then the failed; final_acc is the objective, `seeds` each seed's final."""
    from .labels import attack_words

    order = {"done": 0, "diverged": 0, "pruned": 1, "failed": 2}
    trials = sorted(outcome.trials, key=lambda t: (order[t.status], t.final_acc or t.bound or 0.0, t.number))
    return [{"trial": t.number if t.given is None else f"{t.number} (--try)", "attack": attack_words(t.scenario), "status": t.status, "final_acc": t.final_acc,
             "bound": t.bound, "seeds": ", ".join(f"{r.seed}: " + ("-" if r.final_acc is None else f"{r.final_acc:.4f}")
                                                  for r in t.runs),
             "rounds_done": t.rounds_done, "run": "here" if t.ran else "in the store", "hash": t.hash} for t in trials]


def worst_line(outcome: Outcome) -> str:
    from .labels import attack_words

    w = outcome.worst
    if w is None:
        return "worst attack found: none (no trial finished)"
    seeds = ", ".join(str(r.seed) for r in w.runs)
    return (f"worst attack found: {attack_words(w.scenario)}: final accuracy {w.final_acc:.4f} "
            f"({'mean over seeds ' + seeds if len(w.runs) > 1 else 'seed ' + seeds}; trial {w.number}"
            f"{f' (--try {w.given})' if w.given else ''}, "
            f"run{'s' * (len(w.runs) > 1)} {', '.join(r.hash for r in w.runs)})")
