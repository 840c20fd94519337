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

Each trial is an ordinary run in the results store (its scenario's hash, checkpoints,
resume). Optuna's TPE sampler proposes the attack point; the objective, minimized, is the
run's final test accuracy (a diverged run counts 0.0, as in every result view). Optuna's
successive-halving pruner reads the evaluations the run makes every `eval_every` rounds and
stops a run whose accuracy at a rung (eval_every x 3^k rounds) is not among the lowest third
of the trials that reached it: the run is stored as `pruned`, never a finished run.

The store is the study. Trial k is drawn by a sampler seeded from (seed, k) given the outcomes
of trials 0..k-1, so a search is a function of its file, its seed and those outcomes; running
it again reads every trial whose run is finished or pruned back from the store instead of
running it, and resumes an interrupted run from its checkpoint. A killed search, run again,
therefore continues where it stopped, and a fixed seed gives the same search. Trials run one
after another: a trial's pruning reads the trials before it.
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
from .matrix import FIELDS, MatrixError, alternatives, expand, read
from .scenario import RESERVED_PARAMS, Scenario, type_names
from .stats import accuracy
from .store import FINISHED, Store, finite_history, scenario_hash

SEARCH_KEYS = ("trials", "seed", *CHANNELS)
REDUCTION = 3  # the pruner's reduction factor: a third of the trials go on at each rung
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


@dataclass
class Trial:
    number: int                     # 1-based
    hash: str
    scenario: dict[str, Any]
    status: str                     # done, diverged, pruned, failed
    final_acc: float | None         # what the search minimized (diverged: 0.0); None if pruned or failed
    rounds_done: int
    ran: bool                       # run (or resumed) by this search, not read back from the store


@dataclass
class Outcome:
    trials: list[Trial] = field(default_factory=list)

    @property
    def worst(self) -> Trial | None:
        """The finished trial of lowest accuracy (the first of equals)."""
        finished = [t for t in self.trials if t.final_acc is not None]
        return min(finished, key=lambda t: t.final_acc) if finished else None

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.trials)

    def as_json(self) -> dict[str, Any]:
        """DESIGN.md's object: `worst` (its final_acc and the trial's scenario fields), `trials`,
        `pruned`; and `failed`."""
        w = self.worst
        worst = None if w is None else {"final_acc": w.final_acc, "trial": w.number, "hash": w.hash,
                                        "status": w.status, **expand_channels(w.scenario)}
        return {"worst": worst, "trials": len(self.trials), "pruned": self.count("pruned"),
                "failed": self.count("failed")}


# ---- the search file -------------------------------------------------------------------------

def load(path: str | Path, overrides: list[str] = ()) -> tuple[dict[str, Any], Space]:
    """(the file's scenario values, the attack space), every value checked: a SearchError (or
    MatrixError) names the file, the key and what is allowed."""
    values = read(path, overrides)
    src = str(path)
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
    base = expand(values, src)[0]
    space = _space(table, values, base, src)
    _check_corners(values, space, src)
    return values, space


def _space(table: dict, values: dict, base: Scenario, src: str) -> Space:
    unknown = sorted(set(table) - set(SEARCH_KEYS))
    if unknown:
        raise SearchError(f"{src}: [search] unknown key {unknown[0]!r}; allowed: {', '.join(SEARCH_KEYS)}")
    trials, seed = table.get("trials", 40), table.get("seed", 0)
    if not is_integer(trials) or trials < 1:
        raise SearchError(f"{src}: [search] trials must be an integer >= 1, got {trials!r}")
    if not is_integer(seed) or not 0 <= seed < 2**63:
        raise SearchError(f"{src}: [search] seed must be an integer in [0, 2**63 - 1], got {seed!r}")
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
    return Space(channels, trials, seed)


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
    def __init__(self, history: list[dict]):
        super().__init__("pruned")
        self.history = history


def _accuracy(evaluation: dict, status: str = "done") -> float:
    """An evaluation's accuracy as every result view counts it (robustbn.stats.accuracy): a
    diverged run's, or one not finite, is 0.0."""
    return accuracy({"status": status, "final_acc": evaluation.get("test_acc")})[0]


class _Reporter:
    """Feeds a run's evaluations to its Optuna trial, one step per evaluation round, asking the
    pruner after each one but the last (a finished run is never pruned). The same calls for a
    run watched live, resumed or read back from the store: the pruner's state depends on them."""

    def __init__(self, trial, rounds: int):
        self.trial, self.rounds, self.last = trial, rounds, 0

    def __call__(self, history: list[dict]) -> bool:
        history, _ = finite_history(history)
        pruned = False
        for evaluation in history:
            t = evaluation["round"]
            if t <= self.last:
                continue
            self.last = t
            self.trial.report(_accuracy(evaluation), t)
            pruned = t < self.rounds and self.trial.should_prune()
        return pruned

    def watch(self, history: list[dict]) -> None:
        """runner.run's on_evaluation: stop the run when the pruner says so."""
        if self(history):
            raise _Pruned(history)


def _trial_seed(seed: int, number: int) -> int:
    import numpy as np
    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


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


def _row(store: Store, run_hash: str) -> tuple[str, list[dict], str | None] | None:
    """(status, history, owner) of a run in the store, or None."""
    row = store.db.execute("SELECT status, history, owner FROM runs WHERE hash = ?", (run_hash,)).fetchone()
    return None if row is None else (row[0], json.loads(row[1]) if row[1] else [], row[2])


def search(values: dict[str, Any], space: Space, store: Store, source: str = "", trials: int | None = None,
           progress: bool = True, checkpoint_every: int | None = None,
           log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Outcome:
    """Run (or resume) the search into `store`: `trials` (default the file's) trials, each read
    back from the store where its run is finished or pruned, else run. On SIGINT or SIGTERM the
    running trial stops at its next round end, checkpointed, and Interrupted is raised."""
    import optuna
    from tqdm.auto import tqdm

    from .checkpoint import Interrupted, clear_stop, install_stop_handlers, stop_requested
    from .execute import Checkpointing, _Heartbeat
    from .store import new_owner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    eval_every = expand(values, source)[0].eval_every
    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.SuccessiveHalvingPruner(
        min_resource=eval_every, reduction_factor=REDUCTION, min_early_stopping_rate=0))
    owner = new_owner()
    checkpointing = Checkpointing(str(store.path.resolve()), checkpoint_every, False, owner)
    outcome = Outcome()
    clear_stop()
    restore = install_stop_handlers() if threading.current_thread() is threading.main_thread() else (lambda: None)
    try:
        with _Heartbeat(store.path, owner), tqdm(total=trials or space.trials, desc="attack search", unit="trial",
                                                 disable=not progress) as bar:
            for number in range(trials or space.trials):
                if stop_requested():
                    raise Interrupted(stop_requested(), outcome)
                with warnings.catch_warnings():  # `group` (conditional spaces) is marked experimental
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    study.sampler = optuna.samplers.TPESampler(seed=_trial_seed(space.seed, number),
                                                               multivariate=True, group=True)
                trial = study.ask()
                sc = expand(trial_values(values, _suggest(trial, space)), f"{source}: trial {number + 1}")[0]
                result = _trial(trial, sc, number + 1, store, source, owner, checkpointing, progress, log)
                outcome.trials.append(result)
                if result.status == "pruned":
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                elif result.status == "failed":
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(trial, result.final_acc)
                bar.update(1)
    except Interrupted as e:
        raise Interrupted(e.signum, outcome) from None
    finally:
        store.release(owner)
        restore()
        clear_stop()
    return outcome


def _trial(trial, sc: Scenario, number: int, store: Store, source: str, owner: str, checkpointing, progress: bool,
           log) -> Trial:
    """One trial: its run read back from the store when finished or pruned, else run here."""
    values = sc.to_dict()
    run_hash = scenario_hash(values)
    reporter = _Reporter(trial, sc.rounds)
    row = _row(store, run_hash)
    if row is None or row[0] not in (*FINISHED, "pruned"):
        if store.claim(run_hash, values, source, owner):
            return _run(reporter, sc, number, run_hash, store, source, owner, checkpointing, progress, log)
        row = _row(store, run_hash)
        if row[0] not in (*FINISHED, "pruned"):
            raise SearchError(f"trial {number}: its run {run_hash} is being run by another process ({row[2]}); "
                              f"run the search again once it is done")
    status, history = row[0], row[1]
    reporter(history)  # the pruner's calls, as when it ran
    return Trial(number, run_hash, values, status, None if status == "pruned" else _final(status, history),
                 history[-1]["round"] if history else 0, False)


def _run(reporter: _Reporter, sc: Scenario, number: int, run_hash: str, store: Store, source: str, owner: str,
         checkpointing, progress: bool, log) -> Trial:
    """Run a claimed trial (resuming it from its checkpoint) into the store: done or diverged,
    pruned, or failed (its error stored, the search goes on)."""
    from tqdm.auto import tqdm

    from . import runner
    from .checkpoint import Interrupted
    from .execute import _data_for

    values = sc.to_dict()
    with tqdm(total=sc.rounds, desc=f"trial {number}: {sc.attacks_in_brief()}", unit="round", leave=False,
              disable=not progress) as bar:
        try:
            result = runner.run(sc, data=_data_for(sc), progress=lambda t: bar.update(t - bar.n),
                                checkpoint=checkpointing.for_run(run_hash), on_evaluation=reporter.watch)
        except _Pruned as p:
            history, _ = finite_history(p.history)
            store.prune(run_hash, history, f"pruned at round {history[-1]['round']} by the attack search")
            checkpointing.done_with(run_hash)
            return Trial(number, run_hash, values, "pruned", None, history[-1]["round"], True)
        except Interrupted:
            store.release(owner, run_hash)
            raise
        except Exception as e:  # noqa: BLE001 (the run's own error)
            store.fail(run_hash, traceback.format_exc(limit=4))
            log(f"trial {number}: run {run_hash} failed: "
                f"{''.join(traceback.format_exception_only(e)).strip().splitlines()[0]}")
            return Trial(number, run_hash, values, "failed", None, 0, True)
    status = store.finish(run_hash, values, result.history, result.bn_stats, result.wall_time_s, result.device,
                          source=source, resumed_from=result.extra["resumed_from"])
    checkpointing.done_with(run_hash)
    history, _ = finite_history(result.history)
    return Trial(number, run_hash, values, status, _final(status, history), history[-1]["round"], True)


def _final(status: str, history: list[dict]) -> float:
    return _accuracy(history[-1] if history else {}, status)
