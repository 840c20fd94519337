"""`robustbn demo`: the main job, FBN vs naive BN under attack on Fashion-MNIST in under 3
minutes on a CPU (the matrix below), then a table of final accuracies and a plot."""

from __future__ import annotations

import os
from pathlib import Path

from .common import RAW, fail_cleanly, text_table
from .run import add_run_options, run_and_report

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


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job: FBN vs naive BN under attack on Fashion-MNIST (under 3 minutes, CPU)",
                       formatter_class=RAW,
                       description="Runs a small matrix (robustbn demo --show prints it) on Fashion-MNIST on the CPU, "
                                   "prints a table of final accuracies and writes a plot next to the store.",
                       epilog="examples:\n  robustbn demo\n  robustbn demo --set rounds=100\n  robustbn demo --show")
    add_run_options(p, db="results/demo.sqlite")
    p.add_argument("--show", action="store_true", help="print the demo's matrix file and exit")
    # two runs at once: 0.82 of the 3-minute budget on 2 cores, one at a time 1.02 (benchmarks/demo.py)
    p.set_defaults(run=cmd_demo, jobs=min(2, os.cpu_count() or 1))


@fail_cleanly
def cmd_demo(args) -> int:
    import dataclasses
    import importlib
    import threading
    import tomllib

    from ..matrix import expand, parse_override
    from ..plots import plot
    from ..store import Store, scenario_hash

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
    # matplotlib's import (2-3 s) overlaps the runs, which wait on their worker processes
    plots_imported = threading.Thread(target=importlib.import_module, args=("robustbn.plots",), daemon=True)
    plots_imported.start()
    code = run_and_report((values, scenarios), "demo", args)
    plots_imported.join()
    hashes = {scenario_hash(s.to_dict()) for s in scenarios}
    with Store(args.db, readonly=True) as store:
        rows = [r for r in store.rows(status="done") if r["hash"] in hashes]
    print()
    print(text_table(sorted(rows, key=lambda r: (r["norm"], r["f"], r["bn_agg"])),
                     ["norm", "f", "bn_mean_attack", "bn_var_attack", "bn_agg", "final_acc", "best_acc", "wall_time_s"]))
    out = Path(args.db).with_name("demo.png")
    plot(rows, "curves", str(out), "FBN vs naive BN at gamma = 0; 3 of 10 clients flip the sign of their BN means")
    print(f"\nplot: {out}")
    return code
