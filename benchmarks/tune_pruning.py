"""How many runs `robustbn tune`'s pruning saves, side by side: every run of the grid, the
pruned waves of `robustbn.tune.Tuning` (best first), and optionally an older `robustbn/tune.py`
(its `Tuning`, e.g. the anchor-first waves of 43887a9), all on the same grids.

    python benchmarks/tune_pruning.py [--csv docs/results.csv] [--grids 200] [--old /tmp/old_tune.py]
    git show 43887a9:robustbn/tune.py > /tmp/old_tune.py   # the anchor-first waves

The grids: every defense that `robustbn tune` has tuned in the exported store (runs on the
tuning seeds 10 and 11, evaluated once at their last round), each attack's mean accuracy per
grid point; an attack a strategy never ran there (pruned) is taken as 100%, which can only make
the simulated strategies run more. Then `--grids` perturbed copies of them (the grid points'
columns shuffled, each mean moved by N(0, 8 points), seeded), since one tuned defense is one
shape. Only run counts are simulated: nothing is trained.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import random
import statistics
import sys

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from robustbn import tune  # noqa: E402
from robustbn.worst import ATTACK_FIELDS  # noqa: E402

SEEDS = ("10", "11")


def tuned_grids(path: str) -> list[dict[tuple, dict[float, float]]]:
    """Per tuned defense: {attack: {lr: mean accuracy over the tuning seeds}} (diverged: 0.1)."""
    grids: dict[tuple, dict[tuple, dict[float, list[float]]]] = {}
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            if r["seed"] not in SEEDS or r["eval_every"] != r["rounds"] or r["f"] in ("", "0"):
                continue
            attack = tuple(r.get(k, "") for k in ATTACK_FIELDS)
            if all(a in ("", "honest", "none") for a in attack[::2]):
                continue  # a clean run: the rule reads attacked runs
            defense = tuple(r[k] for k in ("norm", "grad_agg", "bn_agg", "client_filter", "gamma", "f"))
            acc = 0.1 if r["status"] == "diverged" else float(r["final_acc"])
            grids.setdefault(defense, {}).setdefault(attack, {}).setdefault(float(r["lr"]), []).append(acc)
    out = []
    for attacks in grids.values():
        lrs = sorted({lr for by_lr in attacks.values() for lr in by_lr})
        if len(lrs) >= 2:
            out.append({a: {lr: statistics.fmean(by_lr[lr]) if lr in by_lr else 1.0 for lr in lrs}
                        for a, by_lr in attacks.items()})
    return out


def perturbed(grid, rng: random.Random):
    lrs = sorted(next(iter(grid.values())))
    shuffled = dict(zip(lrs, rng.sample(lrs, len(lrs))))
    return {a: {lr: min(1.0, max(0.0, by_lr[shuffled[lr]] + rng.gauss(0, 0.08))) for lr in lrs}
            for a, by_lr in grid.items()}


def planned(grid):
    """(hash, scenario) of every attacked run of one defense's grid, and the oracle's rows."""
    runs, oracle = [], {}
    for i, (attack, by_lr) in enumerate(grid.items()):
        for lr, acc in by_lr.items():
            for seed in SEEDS:
                sc = {"norm": "fbn", "grad_agg": "mean", "f": 3, "lr": lr, "seed": int(seed),
                      **{k: (v or "honest") for k, v in zip(ATTACK_FIELDS, attack) if not k.endswith("_params")}}
                h = f"{i}-{lr}-{seed}"
                runs.append((h, sc))
                oracle[h] = {**sc, "status": "done", "final_acc": acc}
    return runs, oracle


def runs_to_choose(module, grid) -> tuple[int, int, float]:
    """(runs, waves, chosen lr) of one strategy on one grid."""
    runs, oracle = planned(grid)
    lrs = sorted(next(iter(grid.values())))
    kwargs = {"anchor": {"lr": 0.05}} if "anchor" in module.Tuning.__init__.__code__.co_varnames else {}
    plan = module.Tuning(runs, {"lr": lrs}, **kwargs)
    finished, waves = {}, 0
    while wave := plan.next_wave(finished):
        finished.update({h: oracle[h] for h in wave})
        waves += 1
    (choice,) = module.choose(list(finished.values()), {"lr": lrs}, plan.pruned(finished))
    return len(finished), waves, choice["chosen"]["lr"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default="docs/results.csv")
    ap.add_argument("--grids", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--old", help="an older robustbn/tune.py to compare (its Tuning and choose)")
    args = ap.parse_args()
    strategies = {"best first (now)": tune}
    if args.old:
        spec = importlib.util.spec_from_file_location("robustbn._old_tune", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        strategies = {"older (--old)": old, **strategies}
    measured = tuned_grids(args.csv)
    if not measured:
        sys.exit(f"{args.csv}: no tuning runs (seeds 10 and 11, one evaluation) of two grid points or more")
    rng = random.Random(args.seed)
    sets = {"measured": measured, f"perturbed x{args.grids}": [perturbed(rng.choice(measured), rng)
                                                               for _ in range(args.grids)]}
    print(f"# {len(measured)} tuned defense(s) in {args.csv}; runs per defense (mean), waves (mean), "
          f"and the share of the full grid's runs")
    print("\n| grids | strategy | runs | waves | / full grid | same choice as the full grid |")
    print("|---|---|---|---|---|---|")
    for name, grids in sets.items():
        full = [len(planned(g)[0]) for g in grids]
        truth = [max(sorted(next(iter(g.values()))), key=lambda lr: (min(by[lr] for by in g.values()), -lr))
                 for g in grids]
        print(f"| {name} | every run | {statistics.fmean(full):.1f} | 1 | 1.00 | yes |")
        for label, module in strategies.items():
            got = [runs_to_choose(module, g) for g in grids]
            same = sum(lr == t for (_, _, lr), t in zip(got, truth))
            print(f"| {name} | {label} | {statistics.fmean(r for r, _, _ in got):.1f} | "
                  f"{statistics.fmean(w for _, w, _ in got):.1f} | "
                  f"{sum(r for r, _, _ in got) / sum(full):.2f} | {same} of {len(grids)} |", flush=True)


if __name__ == "__main__":
    main()
