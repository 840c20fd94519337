"""`robustbn run FILE`: every scenario of a scenario or matrix file into the results store
(locally in processes, or as Ray tasks); its options and report are shared with `demo`."""

from __future__ import annotations

import math
import os
import signal
import sys

from .common import DEFAULT_DB, RAW, UsageError, check_device_here, fail_cleanly

BIG_MATRIX = 2000  # runs: more needs --yes


def register(sub) -> None:
    p = sub.add_parser("run", help="run scenario or matrix files into the results store", formatter_class=RAW,
                       description="Run every scenario of each FILE (a TOML scenario or matrix), one file after "
                                   "another (one pool of --jobs workers for them all), each with its own report "
                                   "line; every file is read and checked before "
                                   "any runs. Finished runs already in the store are skipped, unfinished ones run "
                                   "again.",
                       epilog="examples:\n  robustbn run scenarios/fbn_fig3_fmnist.toml\n"
                              "  robustbn run scenarios/fbn_fig4_fmnist.toml --set rounds=100 --set 'seed=[0,1]' --jobs 2\n"
                              "  robustbn run my.toml --db results/mine.sqlite --device cuda\n"
                              "  robustbn run results/tune/my_matrix/tuned_*.toml --jobs 2\n"
                              "  robustbn run scenarios/fbn_fig4_fmnist.toml --shard $SLURM_ARRAY_TASK_ID/8 "
                              "--db results/shard$SLURM_ARRAY_TASK_ID.sqlite\n"
                              "  robustbn run scenarios/fbn_fig4_cifar10.toml --executor ray --address auto "
                              "--device cuda --gpus-per-run 0.25")
    p.add_argument("file", nargs="+")
    add_run_options(p)
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


def run_and_report(values_scenarios, source, args, label: str = "", checked: bool = False) -> int:
    """Run a file's scenarios and print one summary line (after `label`). `checked`: the size
    check was made on every file's runs together (run with several files)."""
    from ..checkpoint import Interrupted, checkpoint_dir
    from ..execute import MAX_JOBS, RayOptions, parse_shard, run_matrix, sends_gpu_tasks
    from ..store import Store

    _, scenarios = values_scenarios
    if not 1 <= args.jobs <= MAX_JOBS:
        raise UsageError(f"--jobs must be between 1 and {MAX_JOBS} (processes at once; this machine has "
                         f"{os.cpu_count()} cores), got {args.jobs}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    if len(scenarios) > BIG_MATRIX and not args.yes and not checked:
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
    sent = sends_gpu_tasks(executor, getattr(args, "gpus_per_run", 0))
    if executor == "ray" and args.device == "cuda" and not sent:
        raise UsageError("--device cuda with --executor ray needs --gpus-per-run > 0 (e.g. 0.25 runs four at once "
                         "on each GPU)")
    if not sent:  # else each Ray worker checks its own GPU
        check_device_here(args.device)
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
    print(f"{label}{where}{summary.total} runs: {summary.done} ran{resumed}, {summary.skipped} already done{others}, "
          f"{len(summary.failed)} failed; results in {args.db}")
    if code >= 128:
        print(f"robustbn {args.command}: stopped by {signal.Signals(code - 128).name}: "
              f"{summary.interrupted} unfinished runs checkpointed in {checkpoint_dir(args.db)}; "
              f"the same command resumes them", file=sys.stderr)
    for run_hash, error in summary.failed:
        print(f"  failed {run_hash}: {error}", file=sys.stderr)
    _warn_nonfinite(args.db, scenarios, args.device)
    return code


def _warn_nonfinite(db: str, scenarios, device: str | None) -> None:
    """One line for the matrix's runs whose aggregated update was not finite in some round (a
    rule that returned NaN or inf: the engine kept those weights, so the run says so)."""
    import json

    from ..execute import on_device
    from ..store import Store, scenario_hash

    hashes = {scenario_hash(on_device(sc, device).to_dict()) for sc in scenarios}  # the runs as stored
    store = Store(db)
    try:  # the text search first: a store holds thousands of runs, and these are rare
        found = store.db.execute("SELECT hash, history FROM runs WHERE history LIKE '%nonfinite_update_rounds%'")
        bad = [(h, last["nonfinite_update_rounds"], last.get("round", 0)) for h, text in found if h in hashes
               for last in [json.loads(text)[-1]] if last.get("nonfinite_update_rounds")]
    finally:
        store.close()
    if bad:
        h, k, rounds = bad[0]
        print(f"warning: {len(bad)} run{'s' * (len(bad) > 1)} had a non-finite aggregated update (NaN or inf from "
              f"the pipeline; those weights kept their values), e.g. {h} in {k} of {rounds} rounds: "
              f"docs/guide/engine.md", file=sys.stderr)


@fail_cleanly
def cmd_run(args) -> int:
    from contextlib import nullcontext

    from ..execute import sends_gpu_tasks, shared_workers
    from ..scenario import devices_checked_where_they_run

    # Ray tasks given GPUs: a CUDA device is checked by the worker that runs it, not by this head node
    sent = sends_gpu_tasks(args.executor, args.gpus_per_run)
    with devices_checked_where_they_run() if sent else nullcontext(), shared_workers():  # spawned once for every file
        return _run_files(args)


def _run_files(args) -> int:
    from ..matrix import load

    files = list(dict.fromkeys(args.file))  # a file named twice runs once
    loaded = [load(f, args.set) for f in files]  # a bad file stops everything before a run starts
    if len(files) == 1:
        return run_and_report(loaded[0], str(files[0]), args)
    total = sum(len(scenarios) for _, scenarios in loaded)
    if total > BIG_MATRIX and not args.yes:
        raise UsageError(f"the {len(files)} files expand to {total} runs; pass --yes to run them all "
                         f"(or --shard I/N to run a slice; `robustbn list` shows each file's)")
    code = 0
    for i, (path, values_scenarios) in enumerate(zip(files, loaded)):
        code = max(code, run_and_report(values_scenarios, str(path), args, f"{path} ({i + 1} of {len(files)}): ",
                                        checked=True))
        if code >= 128:  # stopped by a signal: the files left are not started
            break
    return code


def add_run_options(p, db=DEFAULT_DB):
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
