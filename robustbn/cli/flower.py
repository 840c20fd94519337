"""`robustbn flower FILE`: every scenario of a file as a Flower simulation (robustbn.flower),
into the results store in rows marked engine = flower."""

from __future__ import annotations

import os
import sys

from .common import DEFAULT_DB, RAW, UsageError, fail_cleanly


def register(sub) -> None:
    p = sub.add_parser("flower", help="run a scenario or matrix file as Flower simulations (robustbn[flower])",
                       formatter_class=RAW,
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


@fail_cleanly
def cmd_flower(args) -> int:
    from ..matrix import load
    from ..store import FINISHED, Store, scenario_hash
    if not 1 <= args.jobs <= (os.cpu_count() or 1):
        raise UsageError(f"--jobs must be between 1 and {os.cpu_count()} (Flower nodes computing at once, one "
                         f"CPU each), got {args.jobs}")
    _, scenarios = load(args.file, args.set)
    try:
        from .. import flower
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
