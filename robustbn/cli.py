"""The `robustbn` command: run scenario matrices, inspect and plot results, the demo."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from . import __version__

DEFAULT_DB = "results/robustbn.sqlite"
BIG_MATRIX = 2000  # runs: more needs --yes

DEMO_TOML = """\
description = "robustbn demo: FBN vs naive BN on Fashion-MNIST under extreme heterogeneity (gamma = 0). 3 of 10 clients flip the sign of their BN mean messages and send honest-looking variances (seed 002's attack); the server averages (no defense) or runs nnm+median on the statistics"
dataset = "fashion-mnist"
model = "simple-cnn"
partition = "gamma"
gamma = 0.0
norm = ["naive", "fbn"]
n = 10
f = [0, 3]
bn_mean_attack = ["none", "sf"]
bn_var_attack = ["none", "honest"]
bn_agg = ["mean", "nnm+median"]
grad_attack = "none"
grad_agg = "mean"
rounds = 150
batch_size = 32
lr = 0.05
momentum = 0.9
eval_every = 25
seed = 0

[[exclude]]   # no attackers: no attack, and nothing to defend
f = 0
bn_mean_attack = "sf"
[[exclude]]
f = 0
bn_var_attack = "honest"
[[exclude]]
f = 0
bn_agg = "nnm+median"
[[exclude]]   # attackers present: SF on the mean, honest on the variance
f = 3
bn_mean_attack = "none"
[[exclude]]
f = 3
bn_var_attack = "none"
"""


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's own usage errors (an unknown option, a missing argument, a bad choice) as one
    line pointing at --help, not the whole usage block; exit status 2. Subparsers are made of
    the same class."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _fail_cleanly(fn):
    def wrapper(args):
        import sqlite3

        from .data import DataError
        from .execute import ExecutorError
        from .matrix import MatrixError
        from .scenario import ScenarioError
        from .store import StoreError
        try:
            return fn(args)
        except (UsageError, MatrixError, ScenarioError, DataError, ExecutorError, StoreError) as e:
            print(f"robustbn {args.command}: {e}", file=sys.stderr)
            return 2
        except sqlite3.Error as e:  # a store that broke after it opened: truncated, full disk, locked
            print(f"robustbn {args.command}: {getattr(args, 'db', 'the results store')}: {e}", file=sys.stderr)
            return 2
    return wrapper


WHERE_HELP = ("keep the runs whose scenario field KEY equals VALUE; a list is any of its values "
              "(--where 'n=[4,5]', --where 'norm=[fbn,naive]'); repeatable, every filter must hold")
MATRIX_HELP = ("keep only the runs of this scenario or matrix file, at any seed, on any device and by either "
               "engine (e.g. the matrix's worst case without an attack search's trials that share its settings)")


def _where(pairs: list[str], flag: str = "--where") -> list[tuple[str, list]]:
    """`--where key=value` filters as (key, the values accepted), a list being any of its values:
    scenario fields only (an unknown key, a typo, would match nothing and read as "no runs")."""
    from .matrix import FIELDS, alternatives, parse_override

    where = [(key, alternatives(key, value)) for key, value in (parse_override(p, flag, "norm=fbn") for p in pairs)]
    for key, values in where:
        if key not in FIELDS:
            raise UsageError(f"{flag} {key}: not a scenario field; allowed: {', '.join(sorted(FIELDS))}")
        if not values:
            raise UsageError(f"{flag} {key}=[]: an empty list matches no run; give at least one value")
    return where


def _rows(store, pairs: list[str], status=None, matrix: str | None = None) -> list[dict]:
    """The store's runs (`Store.rows`) that every `--where` of `pairs` keeps, and with
    `--matrix FILE` only the runs of that scenario file (any seed)."""
    from .matrix import MatrixError, runs_of
    from .store import _same

    where = _where(pairs)
    rows = [r for r in store.rows(status=status) if all(any(_same(r.get(k), v) for v in values) for k, values in where)]
    try:
        return runs_of(matrix, rows) if matrix else rows
    except MatrixError as e:
        raise UsageError(f"--matrix {e}") from None


def _params(pairs: list[str], reserved: dict[str, str]) -> dict:
    """`--param key=value` of check-aggregator; `reserved`: keys that are options of their own."""
    from .matrix import parse_override

    params = dict(parse_override(p, "--param", "s=2") for p in pairs)
    for key, option in reserved.items():
        if key in params:
            raise UsageError(f"--param {key}: not a parameter of SPEC; {option}")
    return params


def _image_path(out: str, flag: str = "--out") -> None:
    """A file matplotlib can write: a name with an image format's extension, not a directory."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    path = Path(out)
    if not out or path.is_dir():
        raise UsageError(f"{flag} {out!r}: {'an empty path' if not out else 'a directory'}; give an image file, "
                         f"e.g. results/plot.png")
    if path.suffix.lstrip(".").lower() not in formats:
        raise UsageError(f"{flag} {out}: the extension names the image format; allowed: "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[("" if r.get(c) is None else f"{r[c]:.4f}" if isinstance(r.get(c), float) else str(r[c])) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _channel_columns(rows: list[dict], columns: list[str]) -> list[str]:
    """Table columns without repeats: per part (attack, pipeline, their params), the bn_*
    shorthand where every row's two BN channels agree, else the per-channel columns."""
    from .channels import BN_CHANNELS, PARTS

    drop = set()
    for part in PARTS:
        alike = all(r.get(f"bn_{part}") is not None for r in rows)
        drop |= {f"{c}_{part}" for c in BN_CHANNELS} if alike else {f"bn_{part}"}
    return [c for c in dict.fromkeys(columns) if c not in drop]


def _run_and_report(values_scenarios, source, args) -> int:
    from .checkpoint import Interrupted, checkpoint_dir
    from .execute import MAX_JOBS, RayOptions, parse_shard, run_matrix
    from .store import Store

    _, scenarios = values_scenarios
    if not 1 <= args.jobs <= MAX_JOBS:
        raise UsageError(f"--jobs must be between 1 and {MAX_JOBS} (processes at once; this machine has "
                         f"{os.cpu_count()} cores), got {args.jobs}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    if len(scenarios) > BIG_MATRIX and not args.yes:
        raise UsageError(f"{source} expands to {len(scenarios)} runs; pass --yes to run them all "
                         f"(or --shard I/N to run a slice; `robustbn list` shows them)")
    executor = getattr(args, "executor", "local")
    shard = parse_shard(args.shard) if getattr(args, "shard", None) is not None else None
    ckpt = checkpoint_dir(args.db) if args.db else None  # an empty --db: Store names it
    # a file or a dangling link there: every run failed at its first checkpoint, or after it ended
    if ckpt is not None and (ckpt.is_symlink() and not ckpt.exists() or ckpt.exists() and not ckpt.is_dir()):
        raise UsageError(f"{ckpt}: not a directory; the checkpoints of {args.db} go there (move it away)")
    ray_options = None
    if executor == "ray":
        if args.jobs != 1:
            raise UsageError("--jobs is for the local executor; with --executor ray, size tasks with "
                             "--cpus-per-run and --gpus-per-run")
        if not (0 < args.cpus_per_run < math.inf and 0 <= args.gpus_per_run < math.inf) or args.retries < 0:
            raise UsageError("--cpus-per-run must be > 0, --gpus-per-run >= 0 and --retries >= 0")
        ray_options = RayOptions(args.address, args.cpus_per_run, args.gpus_per_run, args.retries)
    elif getattr(args, "address", None):
        raise UsageError("--address is for --executor ray")
    store = Store(args.db)
    try:
        summary = run_matrix(scenarios, store, source=source, jobs=args.jobs, device=args.device,
                             progress=not args.quiet, executor=executor, shard=shard, ray_options=ray_options,
                             checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints)
        code = 1 if summary.failed else 0
    except Interrupted as e:
        summary, code = e.summary, 128 + e.signum
    finally:
        store.close()
    where = f"shard {args.shard} of {len(scenarios)} runs: " if shard else ""
    others = f", {summary.taken} being run by another process" if summary.taken else ""
    resumed = f" ({summary.resumed} resumed from checkpoints)" if summary.resumed else ""
    print(f"{where}{summary.total} runs: {summary.done} ran{resumed}, {summary.skipped} already done{others}, "
          f"{len(summary.failed)} failed; results in {args.db}")
    if code >= 128:
        print(f"robustbn {args.command}: stopped by {signal.Signals(code - 128).name}: "
              f"{summary.interrupted} unfinished runs checkpointed in {checkpoint_dir(args.db)}; "
              f"the same command resumes them", file=sys.stderr)
    for run_hash, error in summary.failed:
        print(f"  failed {run_hash}: {error}", file=sys.stderr)
    return code


@_fail_cleanly
def cmd_run(args) -> int:
    from .matrix import load
    return _run_and_report(load(args.file, args.set), str(args.file), args)


@_fail_cleanly
def cmd_flower(args) -> int:
    from .matrix import load
    from .store import FINISHED, Store, scenario_hash
    if not 1 <= args.jobs <= (os.cpu_count() or 1):
        raise UsageError(f"--jobs must be between 1 and {os.cpu_count()} (Flower nodes computing at once, one "
                         f"CPU each), got {args.jobs}")
    _, scenarios = load(args.file, args.set)
    try:
        from . import flower
    except ImportError as e:
        raise UsageError(f"the Flower bridge needs flwr: pip install 'robustbn[flower]' ({e})") from None
    for sc in scenarios:  # every scenario checked before any runs
        flower.check_scenario(sc)
    store = Store(args.db)
    done = skipped = 0
    failed = []
    try:
        for sc in scenarios:
            values = sc.to_dict()
            run_hash = scenario_hash(values, "flower")
            if store.status(run_hash) in FINISHED:
                skipped += 1
                continue
            store.claim(run_hash, values, str(args.file), engine="flower")
            try:
                result = flower.run_scenario(sc, cpus=args.jobs, verbose=args.verbose)
            except Exception as e:  # noqa: BLE001 (a failed run is recorded, the others go on)
                failed.append((run_hash, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
                store.fail(run_hash, failed[-1][1])
                continue
            store.finish(run_hash, values, result.history, result.bn_stats, result.wall_time_s, result.device,
                         str(args.file), engine="flower")
            done += 1
            if not args.quiet:
                print(f"{run_hash} {sc.norm} {sc.attacks_in_brief()}: final accuracy "
                      f"{result.final_accuracy:.4f} ({result.wall_time_s:.1f} s, Flower)")
    finally:
        store.close()
    print(f"{len(scenarios)} runs through Flower: {done} ran, {skipped} already done, {len(failed)} failed; "
          f"results in {args.db}")
    for run_hash, error in failed:
        print(f"  failed {run_hash}: {error}", file=sys.stderr)
    return 1 if failed else 0


@_fail_cleanly
def cmd_attack_search(args) -> int:
    """An Optuna search for the worst attack on one defense (robustbn.search)."""
    import json

    from .checkpoint import Interrupted, checkpoint_dir
    from .labels import attack_words
    from .search import load, search
    from .store import Store, strict_json

    if args.jobs != 1:
        raise UsageError(f"--jobs {args.jobs}: attack-search runs one trial at a time (a trial's pruning reads the "
                         f"trials before it): --jobs 1; run several searches at once to use more cores")
    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials must be >= 1, got {args.trials}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    values, space = load(args.file, args.set + ([f"device={args.device}"] if args.device else []))
    store = Store(args.db)
    try:
        outcome, code = search(values, space, store, str(args.file), args.trials, progress=not args.quiet,
                               checkpoint_every=args.checkpoint_every), 0
    except Interrupted as e:
        outcome, code = e.summary, 128 + e.signum
    finally:
        store.close()
    if code:
        print(f"robustbn {args.command}: stopped by {signal.Signals(code - 128).name} after {len(outcome.trials)} "
              f"trials; the running one checkpointed in {checkpoint_dir(args.db)}; the same command resumes the "
              f"search", file=sys.stderr)
        return code
    failed = outcome.count("failed")
    if args.format == "json":
        print(json.dumps(strict_json(outcome.as_json()), indent=1, allow_nan=False))
        return 1 if failed else 0
    order = {"done": 0, "diverged": 0, "pruned": 1, "failed": 2}
    trials = sorted(outcome.trials, key=lambda t: (order[t.status], t.final_acc or 0.0, t.number))
    print(_table([{"trial": t.number, "attack": attack_words(t.scenario), "status": t.status, "final_acc": t.final_acc,
                   "rounds_done": t.rounds_done, "run": "here" if t.ran else "in the store", "hash": t.hash}
                  for t in trials], ["trial", "attack", "status", "final_acc", "rounds_done", "run", "hash"]))
    worst = outcome.worst
    print(f"{len(outcome.trials)} trials: {len(outcome.trials) - outcome.count('pruned') - failed} finished, "
          f"{outcome.count('pruned')} pruned, {failed} failed; results in {args.db}")
    if worst is None:
        print("worst attack found: none (no trial finished)")
    else:
        print(f"worst attack found: {attack_words(worst.scenario)}: final accuracy {worst.final_acc:.4f} "
              f"(trial {worst.number}, run {worst.hash})")
    return 1 if failed else 0


@_fail_cleanly
def cmd_merge(args) -> int:
    from .store import Store

    if os.path.realpath(args.db) in {os.path.realpath(p) for p in args.stores}:  # no error on a symlink loop
        raise UsageError(f"--db {args.db} is also a store to merge; give a different target")
    store = Store(args.db)
    try:
        _report_added(args.db, store, [(path, store.merge(path)) for path in args.stores])
    finally:
        store.close()
    return 0


def _report_added(db: str, store, counts: list[tuple[str, dict]]) -> None:
    """What merge or import did, a line per source, then the store's size."""
    for path, c in counts:
        print(f"{path}: {c['added']} added, {c['replaced']} replaced unfinished runs, {c['kept']} already here"
              + (f" ({c['differing']} done in both with different histories: kept this store's)"
                 if c["differing"] else ""))
    print(f"{len(store)} runs in {db}")


@_fail_cleanly
def cmd_list(args) -> int:
    from .channels import expand_channels
    from .matrix import load
    from .labels import varying
    from .store import scenario_hash

    values, scenarios = load(args.file, args.set)
    rows = [{**expand_channels(sc.to_dict()), "hash": scenario_hash(sc.to_dict())} for sc in scenarios]
    columns = _channel_columns(rows, (varying(rows) if len(rows) > 1 else []) + ["seed", "hash"])
    if values.get("description"):
        print(values["description"])
    print(_table(rows, columns))
    print(f"{len(rows)} scenarios")
    return 0


@_fail_cleanly
def cmd_results(args) -> int:
    from .labels import varying
    from .store import FINISHED, RESULT_COLUMNS, Store, export

    views = [flag for flag, on in (("--worst-case", args.worst_case), ("--pooled", args.pooled),
                                   ("--compare", args.compare)) if on]
    if len(views) > 1:
        raise UsageError(f"{' and '.join(views)}: one view at a time; give one of them")
    if views and args.status not in (None, "done", "diverged"):
        raise UsageError(f"{views[0]} reads finished runs only (leave out --status)")
    compared = _compared(args.compare) if args.compare else None
    with Store(args.db, readonly=True) as store:
        rows = _rows(store, args.where, FINISHED if views else args.status, args.matrix)
    if args.worst_case:
        return _print_worst_case(rows, args.format)
    if args.pooled:
        return _print_pooled(rows, args.format)
    if compared:
        return _print_compare(rows, *compared, args.format)
    if args.format == "table":
        shown = _channel_columns(rows, (varying(rows) if len(rows) > 1 else ["norm"]) + ["seed", *RESULT_COLUMNS])
        print(_table(rows, shown))
        print(f"{len(rows)} runs")
    else:
        # every scenario field of any row (runs made before a field existed lack it)
        scenario_keys = sorted({k for r in rows for k in r} - set(RESULT_COLUMNS) - {"history", "error"})
        print(export(rows, args.format, scenario_keys + list(RESULT_COLUMNS) + ["history"]), end="")
    return 0


def _intervals(rows: list[dict], columns: list[str], spans: dict[str, tuple[str, str, str]]) -> tuple[list, list]:
    """Rows and columns for a printed table where each (low, high) column pair becomes one text
    column: spans maps low to (high, the new column's name, the column counting seeds or pairs)."""
    from .stats import ci_text

    shown, out = [], [dict(r) for r in rows]
    for c in columns:
        if c in spans:
            high, name, count = spans[c]
            unit = "pair" if count.endswith("pairs") else "seed"
            for r, o in zip(rows, out):
                o[name] = ci_text(r.get(c), r.get(high), r.get(count), unit=unit)
            shown.append(name)
        elif c not in {h for h, _, _ in spans.values()}:
            shown.append(c)
    return out, shown


def _compared(pairs: list[str]) -> tuple[str, object, object]:
    """`--compare FIELD=A FIELD=B` as (field, A, B): one scenario field, two different values."""
    from .store import _same

    (field, a), (other, b) = _where(pairs, "--compare")  # argparse gave two
    if field != other:
        raise UsageError(f"--compare {' '.join(pairs)}: two values of one field, not {field} and {other}")
    if field == "seed":
        raise UsageError("--compare seed: runs are paired by seed; compare another scenario field")
    if len(a) != 1 or len(b) != 1:
        raise UsageError(f"--compare {' '.join(pairs)}: one value on each side, not a list")
    if _same(a[0], b[0]):
        raise UsageError(f"--compare {' '.join(pairs)}: the same value twice; give two different values of {field}")
    return field, a[0], b[0]


def _print_compare(rows: list[dict], field: str, a, b, fmt: str) -> int:
    """`results --compare`: paired differences B - A per setting (robustbn.stats.compare)."""
    import json

    from .labels import text, varying
    from .stats import COMPARED, PAIRED_WORDS, compare
    from .store import _same, export, strict_json

    present = sorted({text(r.get(field)) for r in rows})
    for side in (a, b):
        if not any(_same(r.get(field), side) for r in rows):
            raise UsageError(f"--compare {field}={text(side)}: no finished run matches; {field} takes "
                             f"{', '.join(present) or 'no value'} in the runs (after --where)")
    table, counts = compare(rows, field, a, b, _same)
    head = {"field": field, "a": a, "b": b}
    if fmt == "json":
        print(json.dumps(strict_json([{**head, **t} for t in table]), indent=1, allow_nan=False))
        return 0
    if fmt == "csv":
        fields = [k for k in dict.fromkeys(k for t in table for k in t) if k not in COMPARED]
        print(export([{**head, **t} for t in table], "csv", ["field", "a", "b", *fields, *COMPARED]), end="")
        return 0
    print(f"paired by seed: B - A, A = {field}={text(a)} ({counts['a']} runs), B = {field}={text(b)} "
          f"({counts['b']} runs); {PAIRED_WORDS}")
    if not table:
        print(f"no pairs: no run of A has a run of B with the same seed and every other field equal")
    else:
        columns = [*_channel_columns(table, varying(table, set(COMPARED))), *COMPARED]
        shown, columns = _intervals(table, columns, {"ci_low": ("ci_high", "95% CI", "pairs")})
        print(_table(shown, columns))
        print(f"{len(table)} settings, {sum(t['pairs'] for t in table)} pairs; a_acc, b_acc: mean final accuracy "
              "over the paired seeds (diverged runs count 0.0); verdict: B or A higher where the interval excludes 0, "
              "else tied")
    if counts["unpaired"]:
        print(f"{counts['unpaired']} run{'s' * (counts['unpaired'] != 1)} had no partner (left out)")
    return 0


def _print_pooled(rows: list[dict], fmt: str) -> int:
    """`results --pooled`: a row per group of runs differing only in seed (robustbn.stats.pooled)."""
    from .labels import varying
    from .stats import CLIPPED_WORDS, POOLED, pooled
    from .store import export

    cells = pooled(rows)
    if fmt != "table":
        keys = sorted({k for c in cells for k in c} - set(POOLED))
        print(export(cells, fmt, keys + list(POOLED)), end="")
        return 0
    columns = _channel_columns(cells, varying(cells, set(POOLED)) if len(cells) > 1 else ["norm"])
    shown, columns = _intervals(cells, columns + ["seeds", "mean_acc", "ci_low", "ci_high", "diverged"],
                                {"ci_low": ("ci_high", "95% CI", "seeds")})
    print(_table(shown, columns))
    print(f"{len(cells)} cells from {len(rows)} finished runs; mean_acc: mean final accuracy over seeds "
          f"(diverged runs count 0.0); {CLIPPED_WORDS}")
    return 0


def _print_worst_case(rows: list[dict], fmt: str) -> int:
    """`results --worst-case`: a row per setting, its worst accuracy over attacks (robustbn.worst)."""
    import json

    from .stats import CLIPPED_WORDS
    from .store import export, strict_json
    from .worst import shown_columns, worst_case

    table = worst_case(rows)
    if fmt == "json":
        print(json.dumps(strict_json(table), indent=1, allow_nan=False))
    elif fmt == "csv":
        print(export(table, "csv", list(dict.fromkeys(k for t in table for k in t)) or shown_columns([])), end="")
    elif not table:
        print("no finished runs match: no worst case to report (see `robustbn results`)")
    else:
        shown, columns = _intervals(table, shown_columns(table), {"ci_low": ("ci_high", "95% CI", "seeds"),
                                                                  "gap_low": ("gap_high", "gap 95% CI", "gap_pairs")})
        print(_table(shown, columns))
        notes = [f"{len(table)} settings from {len(rows)} finished runs; worst_acc: the lowest mean over seeds "
                 f"among the attacks run, with its {CLIPPED_WORDS} of that attack",
                 "verdict: per norm protocol (and f, gamma, ...), the defense with the highest worst_acc is best only "
                 "where every other's gap (best - it, paired over seeds under each one's worst attack) has an "
                 "interval excluding 0, else tied for best"]
        if any(t["diverged"] for t in table):
            notes.append("diverged: runs whose final accuracy is NaN or missing, counted as 0.0")
        if any(t["worst_acc"] is None for t in table):
            notes.append("no worst_acc: f > 0 but no attack was run in that setting")
        print("\n".join(notes))
    return 0


@_fail_cleanly
def cmd_import(args) -> int:
    from .store import Store, read_export

    batches = [read_export(path) for path in args.files]  # every file read and checked before the store is touched
    store = Store(args.db)
    try:
        _report_added(args.db, store, list(zip(args.files, store.add(batches))))
    finally:
        store.close()
    return 0


@_fail_cleanly
def cmd_plot(args) -> int:
    from .matrix import FIELDS
    from .plots import plot
    from .store import Store

    _image_path(args.out)
    if args.kind == "heterogeneity" and args.x not in FIELDS:
        raise UsageError(f"--x {args.x}: not a scenario field; allowed: {', '.join(sorted(FIELDS))}")
    with Store(args.db, readonly=True) as store:
        rows = _rows(store, args.where, matrix=args.matrix)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(rows, args.kind, args.out, args.title, args.x)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(args.out)
    return 0


@_fail_cleanly
def cmd_check_aggregator(args) -> int:
    """The property kit (aggregators.testing) on a spec: one line per property, the shrunk
    counterexample of each failure; exit 0 when every applicable property holds, 1 if not."""
    from aggregators.plugins import add_search_path
    from aggregators.testing import check, check_attack

    add_search_path(".")  # `module:Name` steps beside the working directory first
    if args.max_kappa is not None and not args.max_kappa >= 0:  # NaN too
        raise UsageError(f"--max-kappa must be a number >= 0, got {args.max_kappa}")
    for flag, value, low, high in (("--d", args.d, 1, 100_000), ("--trials", args.trials, 1, None),
                                   ("--steps", args.steps, 0, None), ("--seed", args.seed, 0, 2**64 - 1)):
        if value < low or high is not None and value > high:
            raise UsageError(f"{flag} must be an integer {'>= ' + str(low) if high is None else f'in [{low}, {high}]'}"
                             f", got {value}")
    if args.table:
        return _kappa_table(args)
    if args.spec is None:
        raise UsageError("give SPEC (a rule, a pipeline or, with --attack, an attack), or --table")
    if args.f is not None and args.f < 0 or args.n is not None and args.n < 1 or args.examples < 1:
        raise UsageError("--f must be >= 0, --n >= 1 and --examples >= 1")
    if args.f is not None and args.n is not None and 2 * args.f >= args.n:
        raise UsageError(f"--n must be > 2 --f (an honest majority), got f={args.f}, n={args.n}")
    from hypothesis.errors import HypothesisException

    reserved = {"f": "use --f", "examples": "use --examples",
                **({"name": "the attack is SPEC", "pipeline": "the kit attacks a median"} if args.attack else
                   {"n": "use --n", "spec": "the spec is SPEC", "seed": "use --seed", "d": "use --d",
                    "trials": "use --trials", "steps": "use --steps"})}
    params = _params(args.param, reserved)
    try:
        if args.attack:
            outcomes = check_attack(args.spec, f=args.f or 2, examples=args.examples, **params)
        else:
            outcomes = check(args.spec, f=args.f, n=args.n, examples=args.examples, seed=args.seed, **params)
    except HypothesisException as e:  # sizes the kit cannot draw message sets of
        raise UsageError(f"--f {args.f}, --n {args.n}: the property kit cannot draw message sets of this size "
                         f"({type(e).__name__}); try smaller values") from None
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    width = max(len(o.name) for o in outcomes)
    for o in outcomes:
        print(f"{o.name:<{width}}  {o.status}")
        if o.status == "failed":
            print(f"{'':<{width}}    {o.error}")
            print("\n".join(f"{'':<{width}}    {line}" for line in o.counterexample.splitlines()))
    failed = any(o.status == "failed" for o in outcomes)
    if not args.attack:
        failed = not _kappa_line(args, params, width) or failed
    return 1 if failed else 0


def _kappa_sizes(args, spec: str, params: dict) -> tuple[int, int]:
    """n and f of the kappa measurement: as given, else f = 3 (fewer for a small n) and the
    smallest n >= 10 the spec runs on."""
    from aggregators import build

    f = args.f if args.f is not None else 3 if args.n is None else min(3, (args.n - 1) // 2)
    if args.n is not None:
        return args.n, f
    for n in range(max(10, 2 * f + 1), max(10, 2 * f + 1) + 64):
        try:
            build(spec, f=f, n=n, **params)
            return n, f
        except ValueError:
            continue
    return max(10, 2 * f + 1), f


def _kappa_line(args, params: dict, width: int) -> bool:
    """The measured (f, kappa) line of check-aggregator; False when it is a failure (a declared
    kappa below the measured one, a measurement above --max-kappa, or none possible with
    --max-kappa)."""
    from aggregators.robustness import measure_kappa

    n, f = _kappa_sizes(args, args.spec, params)
    label = f"{'measured (f, kappa)':<{width}}  "
    try:
        m = measure_kappa(args.spec, n, f, d=args.d, trials=args.trials, steps=args.steps, seed=args.seed, **params)
    except ValueError as e:
        print(f"{label}not measured: {str(e).splitlines()[0]}")
        return args.max_kappa is None
    print(label + m.summary())
    problems = []
    if m.exceeds_declared:
        problems.append(f"failed: the declared kappa({n}, {f}) = {m.declared:.6g} is below the measured "
                        f"{'unbounded' if m.unbounded else f'{m.kappa:.6g}'}: the claim is false")
    if args.max_kappa is not None and m.kappa > args.max_kappa:
        problems.append(f"failed: above --max-kappa {args.max_kappa:g}")
    for line in problems:
        print(f"{'':<{width}}    {line}")
    if problems:
        import numpy as np
        for name, rows in (("honest rows", m.honest), (f"Byzantine rows (rows {m.positions} of {n})", m.byzantine)):
            print(f"{'':<{width}}    {name}: {np.array2string(rows.numpy(), precision=4, threshold=60)}")
    return not problems


def _kappa_table(args) -> int:
    """check-aggregator --table: the measured kappa of every registered rule and the common
    pipelines, one Markdown row each as it is measured; exit 1 when a declared kappa is below
    the measured one (or a measurement is above --max-kappa)."""
    from aggregators.robustness import TABLE_HEADER, kappa_table, table_row

    if args.spec is not None or args.attack or args.param:
        raise UsageError("--table measures every registered rule: give no SPEC, --attack or --param")
    n = 10 if args.n is None else args.n
    f = (3 if n >= 7 else (n - 1) // 2) if args.f is None else args.f
    if f < 0 or 2 * f >= n:
        raise UsageError(f"--n must be > 2 --f (an honest majority) and --f >= 0, got f={f}, n={n}")
    print(f"n = {n}, f = {f}, d = {args.d}, seed {args.seed}; budget: {args.trials} honest sets per distribution, "
          f"{args.steps} search steps\n")
    print(TABLE_HEADER, flush=True)
    ok = True
    try:
        for spec, m, seconds in kappa_table(n=n, f=f, d=args.d, trials=args.trials, steps=args.steps, seed=args.seed):
            print(table_row(spec, m, seconds), flush=True)
            ok = ok and (isinstance(m, str) or not m.exceeds_declared and
                         (args.max_kappa is None or m.kappa <= args.max_kappa))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0 if ok else 1


@_fail_cleanly
def cmd_toy(args) -> int:
    from .plots import toy_figure
    from .scenario import MAX_SEED

    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be an integer >= 0 and <= {MAX_SEED}, got {args.seed}")
    _image_path(args.out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    errors = toy_figure(args.out, seed=args.seed)
    print("normalization error vs centralized BN (seed 002, Figure 2c):")
    print("gamma   " + "".join(f"{g:>8}" for g in errors["gammas"]))
    for mode, values in errors["norm_error"].items():
        print(f"{mode:<8}" + "".join(f"{v:>8.3f}" for v in values))
    print(args.out)
    return 0


@_fail_cleanly
def cmd_demo(args) -> int:
    import dataclasses
    import tomllib

    from .matrix import expand, parse_override
    from .plots import plot
    from .store import Store, scenario_hash

    if args.show:
        print(DEMO_TOML)
        return 0
    values = tomllib.loads(DEMO_TOML)
    for text in args.set:
        key, value = parse_override(text)
        values[key] = value
    print(values["description"] + "\n")
    scenarios = [dataclasses.replace(s, device=args.device).validated() if args.device else s
                 for s in expand(values, "demo")]
    code = _run_and_report((values, scenarios), "demo", args)
    hashes = {scenario_hash(s.to_dict()) for s in scenarios}
    with Store(args.db, readonly=True) as store:
        rows = [r for r in store.rows(status="done") if r["hash"] in hashes]
    print()
    print(_table(sorted(rows, key=lambda r: (r["norm"], r["f"], r["bn_agg"])),
                 ["norm", "f", "bn_mean_attack", "bn_var_attack", "bn_agg", "final_acc", "best_acc", "wall_time_s"]))
    out = Path(args.db).with_name("demo.png")
    plot(rows, "curves", str(out), "FBN vs naive BN at gamma = 0; 3 of 10 clients flip the sign of their BN means")
    print(f"\nplot: {out}")
    return code


def _add_run_options(p, db=DEFAULT_DB):
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (TOML value; a list makes an axis), repeatable")
    p.add_argument("--db", default=db, help=f"results store (default {db})")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="override every scenario's device")
    p.add_argument("--jobs", type=int, default=1,
                   help="scenarios run at once, in separate processes (default 1; demo: 2 where there are 2 cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="write each run's checkpoint every K rounds, beside the store (default: every 2 minutes "
                        "of a run; 0: never); an interrupted run resumes from it")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoints of finished runs")
    p.add_argument("--yes", action="store_true", help=f"run a matrix of more than {BIG_MATRIX} runs")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = _Parser(
        prog="robustbn", formatter_class=raw,
        description="A testbed for Byzantine-robust federated learning with batch normalization.",
        epilog="examples:\n  robustbn demo\n  robustbn list scenarios/fbn_fig4_fmnist.toml\n"
               "  robustbn run scenarios/fbn_fig4_fmnist.toml --set seed=[0,1] --jobs 2\n"
               "  robustbn results --format csv > results.csv\n"
               "  robustbn import results.csv --db results/copy.sqlite\n"
               "  robustbn plot heatmap --out results/heatmap.png\n  robustbn toy --out results/toy.png")
    ap.add_argument("--version", action="version", version=f"robustbn {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    ap.commands = sub.choices  # name -> subparser: an unknown option is reported by its command's

    p = sub.add_parser("run", help="run a scenario or matrix file into the results store", formatter_class=raw,
                       description="Run every scenario of FILE (a TOML scenario or matrix); finished runs already in the "
                                   "store are skipped, unfinished ones run again.",
                       epilog="examples:\n  robustbn run scenarios/fbn_fig3_fmnist.toml\n"
                              "  robustbn run scenarios/fbn_fig4_fmnist.toml --set rounds=100 --set 'seed=[0,1]' --jobs 2\n"
                              "  robustbn run my.toml --db results/mine.sqlite --device cuda\n"
                              "  robustbn run scenarios/fbn_fig4_fmnist.toml --shard $SLURM_ARRAY_TASK_ID/8 "
                              "--db results/shard$SLURM_ARRAY_TASK_ID.sqlite\n"
                              "  robustbn run scenarios/fbn_fig4_cifar10.toml --executor ray --address auto "
                              "--device cuda --gpus-per-run 0.25")
    p.add_argument("file")
    _add_run_options(p)
    p.add_argument("--shard", metavar="I/N", default=None,
                   help="run only slice I of N (0 <= I < N) of the matrix, sliced by run hash (array jobs)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: this machine (--jobs); ray: one Ray task per run (pip install 'robustbn[ray]')")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (e.g. auto or HOST:6379); default: start a local Ray instance")
    p.add_argument("--cpus-per-run", type=float, default=1.0, help="Ray: CPUs per task, also its torch threads (default 1)")
    p.add_argument("--gpus-per-run", type=float, default=0.0,
                   help="Ray: GPUs per task, a fraction shares a GPU (default 0; needed for --device cuda)")
    p.add_argument("--retries", type=int, default=3, help="Ray: re-runs of a task whose worker died (default 3)")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("flower", help="run a scenario or matrix file as Flower simulations (robustbn[flower])",
                       formatter_class=raw,
                       description="Run every scenario of FILE (FedAvg scenarios) as a Flower simulation "
                                   "(flwr.simulation.run_simulation, RobustStrategy on the server, robustbn's data and "
                                   "models on n nodes) into the results store, in rows marked engine = flower.",
                       epilog="examples:\n  robustbn flower my_fedavg.toml --db results/flower.sqlite --jobs 2\n"
                              "  robustbn results --db results/flower.sqlite")
    p.add_argument("file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (TOML value; a list makes an axis), repeatable")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--jobs", type=int, default=1, help="Flower nodes computing at once, one CPU each (default 1)")
    p.add_argument("--quiet", action="store_true", help="no line per run")
    p.add_argument("--verbose", action="store_true", help="Flower's and Ray's own logs")
    p.set_defaults(run=cmd_flower)

    p = sub.add_parser("attack-search", help="search for the worst attack on one defense (Optuna)",
                       formatter_class=raw,
                       description="FILE is a scenario file with one value per field (the defense: norm, pipelines, "
                                   "filter, ...) and a [search] table: trials, seed (the sampler's), and per searched "
                                   "channel (grad, bn_mean, bn_var) `attacks = [...]` with ranges of their parameters, "
                                   "[search.CHANNEL.ATTACK] PARAM = [low, high], [low, high, \"log\"], a list of "
                                   "names or one value. Optuna's TPE sampler proposes attacks; the search minimizes "
                                   "the final test accuracy (diverged: 0.0); a successive-halving pruner stops a run "
                                   "whose accuracy at eval_every x 3^k rounds is not among the lowest third of the "
                                   "trials there (status `pruned`, never a finished run). Every trial is a run in "
                                   "--db (results --worst-case counts it); the same command again reads finished "
                                   "and pruned trials back and resumes an interrupted one, and a larger --trials "
                                   "continues a search. A fixed seed gives the same search. Exit 1: a trial's run "
                                   "failed.",
                       epilog="examples:\n  robustbn attack-search scenarios/search_fbn_nnm_trmean.toml "
                              "--db results/search.sqlite\n"
                              "  robustbn attack-search my_search.toml --trials 10 --format json\n"
                              "  robustbn results --worst-case --db results/search.sqlite")
    p.add_argument("file")
    p.add_argument("--trials", type=int, default=None, help="trials in all (default: [search] trials)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--jobs", type=int, default=1, help="1 only: trials run one after another (a trial's pruning "
                                                       "reads the trials before it)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (TOML value, one value), repeatable")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="override the scenario's device")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="write the running trial's checkpoint every K rounds (default: every 2 minutes; 0: never)")
    p.set_defaults(run=cmd_attack_search)

    p = sub.add_parser("merge", help="merge results stores into one, deduplicating by run hash", formatter_class=raw,
                       description="Copy every run of each STORE into --db. A run already there is kept, unless it "
                                   "is unfinished and the incoming one is done. The merged stores are only read.",
                       epilog="examples:\n  robustbn merge --db results/all.sqlite results/shard*.sqlite")
    p.add_argument("stores", nargs="+", metavar="STORE")
    p.add_argument("--db", default=DEFAULT_DB, help=f"the store merged into, created if absent (default {DEFAULT_DB})")
    p.set_defaults(run=cmd_merge)

    p = sub.add_parser("import", help="rebuild a results store from CSV exports (robustbn results --format csv)",
                       formatter_class=raw,
                       description="Add the runs of each FILE, a CSV written by `robustbn results --format csv`, to "
                                   "--db. Every cell is read back to its scenario field's type and each row's scenario "
                                   "must hash to the row's hash column. Runs already in --db are deduplicated as by "
                                   "merge (a finished run replaces an unfinished one; otherwise the store's row stays). "
                                   "All files are checked first and added in one transaction: on any error nothing is "
                                   "written. Imported runs have no final BN statistics.",
                       epilog="examples:\n  robustbn import docs/results.csv --db results/paper.sqlite\n"
                              "  robustbn import a.csv b.csv --db results/all.sqlite\n"
                              "  robustbn results --db results/robustbn.sqlite --format csv > backup.csv  # and back:\n"
                              "  robustbn import backup.csv --db results/restored.sqlite")
    p.add_argument("files", nargs="+", metavar="FILE.csv", help="CSV written by `robustbn results --format csv`")
    p.add_argument("--db", default=DEFAULT_DB, help=f"the store imported into, created if absent (default {DEFAULT_DB})")
    p.set_defaults(run=cmd_import)

    p = sub.add_parser("list", help="print the expanded matrix without running it", formatter_class=raw,
                       epilog="examples:\n  robustbn list scenarios/fbn_fig4_fmnist.toml\n"
                              "  robustbn list scenarios/fbn_fig3_fmnist.toml --set 'seed=[0,1,2]'")
    p.add_argument("file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("results", help="show or export the results store", formatter_class=raw,
                       description="A row per run (table, csv or json). --worst-case: a row per setting (every "
                                   "field but the attack and the seed: norm mode, defense, f, gamma, ...) with its "
                                   "worst final accuracy over the attacks run against it, seeds pooled first (mean "
                                   "over seeds), the attack that achieved it and the accuracy without attack. "
                                   "f > 0 runs whose every channel is none or honest are the no-attack baseline, "
                                   "not attacks; diverged runs (NaN accuracy) count as 0.0. --pooled: a row per "
                                   "group of runs differing only in seed, with the mean over seeds and its 95% "
                                   "confidence interval (Student t). --compare: paired differences between two "
                                   "values of one field, seed by seed.",
                       epilog="examples:\n  robustbn results\n  robustbn results --where norm=fbn --where f=3\n"
                              "  robustbn results --format json > results.json\n"
                              "  robustbn results --worst-case --where gamma=0.0\n"
                              "  robustbn results --worst-case --matrix scenarios/worst_case_fmnist.toml\n"
                              "  robustbn results --worst-case --format csv > worst.csv\n"
                              "  robustbn results --pooled --where gamma=0.0\n"
                              "  robustbn results --compare bn_agg=mean bn_agg=nnm+median --where norm=fbn")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help=WHERE_HELP)
    p.add_argument("--matrix", metavar="FILE", default=None, help=MATRIX_HELP)
    p.add_argument("--status", choices=["done", "diverged", "running", "failed", "pruned"], default=None,
                   help="running runs show their rounds_done and history so far")
    p.add_argument("--worst-case", action="store_true",
                   help="per setting, the worst accuracy over attacks (seeds pooled, 95%% CI), the attack achieving "
                        "it, and a verdict per norm protocol: best, tied for best (paired over seeds), worse")
    p.add_argument("--pooled", action="store_true",
                   help="a row per group of runs that differ only in seed: seeds, mean final accuracy, its 95%% CI "
                        "(Student t over seeds, clipped to [0, 1]; none for 1 seed), diverged runs")
    p.add_argument("--compare", nargs=2, metavar=("FIELD=A", "FIELD=B"),
                   help="pair runs that differ only in FIELD (same seed, every other field equal): per setting, the "
                        "mean paired difference B - A of the final accuracy, its 95%% CI and the number of pairs")
    p.set_defaults(run=cmd_results)

    p = sub.add_parser("plot", help="plot results: curves, heterogeneity, heatmap, worst-case", formatter_class=raw,
                       description="curves: accuracy vs round, one line per combination of the fields that vary "
                                   "(seed 002, Figure 4); heterogeneity: final accuracy vs --x (Figure 3a); heatmap: "
                                   "attack x defense final accuracy, one panel per norm mode. Seeds are pooled: the "
                                   "mean, its 95% CI (Student t over seeds) as band, error bar or cell text, and "
                                   "the number of seeds. Lines: a color per norm mode, a line style "
                                   "per defense (mean: solid), a marker per attack; legends in words (\"FBN, SF on the "
                                   "mean, nnm+median (2 seeds)\"), with key=value for any other field that varies. "
                                   "worst-case: defense x norm mode, one panel per other varying setting (f, gamma, ...), each "
                                   "cell the worst accuracy over attacks (seeds pooled) and the worst attack with the "
                                   "channels it hit (\"SF (mean)\"); see `robustbn results --worst-case`.",
                       epilog="examples:\n  robustbn plot curves --where gamma=0.0 --out results/fig4.png\n"
                              "  robustbn plot heterogeneity --where f=0 --out results/fig3a.png\n"
                              "  robustbn plot heatmap --where gamma=0.0 --out results/heatmap.png\n"
                              "  robustbn plot worst-case --out results/worst.png")
    p.add_argument("kind", choices=["curves", "heterogeneity", "heatmap", "worst-case"])  # plots.KINDS
    p.add_argument("--out", required=True)
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help=WHERE_HELP)
    p.add_argument("--matrix", metavar="FILE", default=None, help=MATRIX_HELP)
    p.add_argument("--x", default="gamma", help="x axis of the heterogeneity plot (default gamma; e.g. alpha)")
    p.add_argument("--title", default=None)
    p.set_defaults(run=cmd_plot)

    p = sub.add_parser("check-aggregator", help="hold an aggregation rule (or an attack) to the property kit",
                       formatter_class=raw,
                       description="Runs aggregators.testing on SPEC (built-in names, module:Name steps found in the "
                                   "working directory then on sys.path, pipelines like nnm+mymodule:MyRule) over "
                                   "hypothesis-drawn message sets with up to f hostile rows: one line per property "
                                   "(held, failed, not applicable) and the shrunk counterexample of each failure. "
                                   "Then the measured (f, kappa) (aggregators.robustness.measure_kappa): the largest "
                                   "||F(x) - honest mean||^2 / honest spread found by every registered attack on "
                                   "honest sets of five distributions and a search over the Byzantine rows, "
                                   "'unbounded' when it grows without limit with the attack's scale; the attack that "
                                   "reached it, the rule's declared kappa(n, f) and the lower bound f/(n-2f). "
                                   "Exit 0: every applicable property holds; 1: one failed, the declared kappa is "
                                   "below the measured one, or the measured one is above --max-kappa; 2: a usage "
                                   "error.",
                       epilog="examples:\n  robustbn check-aggregator nnm+median\n"
                              "  robustbn check-aggregator myrules:MyTrimmedMean --f 2 --n 9\n"
                              "  robustbn check-aggregator bucketing+krum --param s=2\n"
                              "  robustbn check-aggregator alie --attack\n"
                              "  robustbn check-aggregator myrules:MidRange --max-kappa 10\n"
                              "  robustbn check-aggregator --table --n 10 --f 3")
    p.add_argument("spec", nargs="?")
    p.add_argument("--f", type=int, default=None, help="Byzantine rows the rule is built for (default: drawn, 0-3; "
                                                      "the kappa measurement: 3)")
    p.add_argument("--n", type=int, default=None, help="messages per set (default: drawn, n > 2f; the kappa "
                                                      "measurement: the smallest n >= 10 the rule runs on)")
    p.add_argument("--examples", type=int, default=100, help="message sets per property (default 100)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a parameter of the spec's steps")
    p.add_argument("--attack", action="store_true", help="SPEC is an attack: check its shape, dtype and device, "
                                                        "and that it never writes into the honest messages")
    p.add_argument("--max-kappa", type=float, default=None, metavar="K",
                   help="exit 1 when the measured (f, kappa) is above K (unbounded is above every K)")
    p.add_argument("--table", action="store_true", help="measure every registered rule and the common pipelines "
                                                       "(at --n, --f: default 10, 3): a Markdown table")
    p.add_argument("--d", type=int, default=50, help="coordinates of the kappa measurement's messages (default 50)")
    p.add_argument("--trials", type=int, default=10, help="kappa: honest sets drawn per distribution, every attack "
                                                         "on each (default 10)")
    p.add_argument("--steps", type=int, default=200, help="kappa: generations of the search over the Byzantine "
                                                         "rows, from each of the 5 worst cases (default 200)")
    p.add_argument("--seed", type=int, default=0, help="the seed of a random rule and of every draw of the kappa "
                                                      "measurement (default 0)")
    p.set_defaults(run=cmd_check_aggregator)

    p = sub.add_parser("toy", help="seed 002's Figures 1 and 2: the normalization experiment", formatter_class=raw,
                       epilog="examples:\n  robustbn toy --out results/toy.png")
    p.add_argument("--out", default="results/toy.png")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_toy)

    p = sub.add_parser("demo", help="the main job: FBN vs naive BN under attack on Fashion-MNIST (under 3 minutes, CPU)",
                       formatter_class=raw,
                       description="Runs a small matrix (robustbn demo --show prints it) on Fashion-MNIST on the CPU, "
                                   "prints a table of final accuracies and writes a plot next to the store.",
                       epilog="examples:\n  robustbn demo\n  robustbn demo --set rounds=100\n  robustbn demo --show")
    _add_run_options(p, db="results/demo.sqlite")
    p.add_argument("--show", action="store_true", help="print the demo's matrix file and exit")
    # two runs at once: 0.82 of the 3-minute budget on 2 cores, one at a time 1.02 (benchmarks/demo.py)
    p.set_defaults(run=cmd_demo, jobs=min(2, os.cpu_count() or 1))
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:  # --help, --version and usage errors end parsing with SystemExit: their status is ours
        args, unknown = ap.parse_known_args(argv)
        if unknown:
            ap.commands.get(args.command, ap).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    if args.command is None:
        ap.print_help()
        return 0
    try:
        return args.run(args)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a run: stop at once, quietly
        print(f"robustbn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `robustbn results | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
