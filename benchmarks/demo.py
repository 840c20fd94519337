"""Wall time of `robustbn demo` (the README's first command, once set up) against its budget of
3 minutes alone on 2 CPU cores, for each --jobs value side by side.

    python benchmarks/demo.py [--jobs 1 2] [--set rounds=150 ...]

Each --jobs value runs the whole demo into its own fresh store, as a user would (a new
process: start-up, data loading, every run, the table and the plot), then prints the wall
time, its ratio to the budget, and the demo's final accuracies, so that a faster demo is
seen to keep its point (naive BN falls under SF on the BN means, nnm+median restores it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time

BUDGET_S = 180.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    args = ap.parse_args()
    robustbn = os.path.join(os.path.dirname(sys.executable), "robustbn")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; budget {BUDGET_S:.0f} s")
    print(f"{'jobs':>4}  {'wall s':>7}  {'/ budget':>8}  final accuracy per run")
    for jobs in args.jobs:
        with tempfile.TemporaryDirectory() as tmp:
            db = os.path.join(tmp, "demo.sqlite")
            command = [robustbn, "demo", "--db", db, "--jobs", str(jobs), "--quiet",
                       *(x for o in args.overrides for x in ("--set", o))]
            start = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - start
            with sqlite3.connect(db) as con:
                rows = con.execute("SELECT scenario, history FROM runs WHERE status = 'done'").fetchall()
        cells = []
        for scenario, history in rows:
            sc, hist = json.loads(scenario), json.loads(history)
            attack = sc.get("bn_mean_attack") or sc.get("bn_attack")
            cells.append(f"{sc['norm']}/f={sc['f']}/{attack}/{sc['bn_agg']}: {100 * hist[-1]['test_acc']:.1f}")
        print(f"{jobs:>4}  {wall:>7.1f}  {wall / BUDGET_S:>8.2f}  " + "; ".join(sorted(cells)))


if __name__ == "__main__":
    main()
