"""Markdown tables of final accuracies for docs/results.md, from results stores or their CSV
exports (`robustbn results --format csv`), pooled; a run in several sources counts once.

    python docs/tables.py results/paper.sqlite
    python docs/tables.py docs/results.csv
"""

import csv
import json
import statistics
import sys
from collections import defaultdict

from robustbn.store import Store


def cell(values):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def pivot(rows, row_key, col_key, title):
    table = defaultdict(list)
    for r in rows:
        table[row_key(r), col_key(r)].append(r["final_acc"])
    rows_ = sorted({k[0] for k in table}, key=str)
    cols = sorted({k[1] for k in table}, key=str)
    print(f"\n{title}\n")
    print("| | " + " | ".join(map(str, cols)) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows_:
        print(f"| {r} | " + " | ".join(cell(table[r, c]) for c in cols) + " |")


def cpu_schedule(r) -> bool:
    """The scaled-down DSGD setting of fbn_fig3_fmnist.toml and fbn_fig4_fmnist.toml."""
    return (r["algorithm"] == "dsgd" and r["partition"] == "gamma" and r["model"] == "simple-cnn"
            and r["rounds"] == 200 and r["n"] == 10 and r["batch_size"] == 50 and r["bn_momentum"] == 0.1)


def typed(text: str):
    """A CSV cell back to the number (or list) it was exported from; other text as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def done_rows(path: str) -> list[dict]:
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            return [{k: typed(v) for k, v in r.items()} for r in csv.DictReader(f) if r["status"] == "done"]
    store = Store(path)
    try:
        return store.rows(status="done")
    finally:
        store.close()


def main(paths):
    rows = list({r["hash"]: r for path in paths for r in done_rows(path)}.values())
    fig3 = [r for r in rows if cpu_schedule(r) and r["f"] == 0 and r["bn_agg"] == "mean"]
    pivot(fig3, lambda r: r["norm"], lambda r: f"gamma = {r['gamma']}",
          "Figure 3 (Fashion-MNIST): final test accuracy (%), no attack")
    fig4 = [r for r in rows if cpu_schedule(r) and r["norm"] in ("naive", "fbn") and r["gamma"] in (0.0, 0.01)
            and (r["f"] == 3 or (r["f"] == 0 and r["bn_agg"] == "mean"))]
    pivot(fig4, lambda r: f"{r['norm']}, gamma = {r['gamma']}",
          lambda r: "no attack (10 honest)" if r["f"] == 0 else "no attack (7 honest)" if r["bn_attack"] == "none"
          else f"{r['bn_attack']} / {r['bn_agg']}",
          "Figure 4 and C.3 (Fashion-MNIST): final test accuracy (%), f = 3 of 10 attack the BN statistics (attack / defense)")
    gap = [r for r in rows if r["algorithm"] == "dsgd" and r["partition"] == "gamma" and r["gamma"] == 0.0
           and r["norm"] in ("fbn", "central", "none") and r["bn_agg"] == "mean" and r["model"] == "simple-cnn"
           and (r["rounds"] == 1500 or (r["rounds"] == 200 and (r["f"] == 0 or r["norm"] == "none")))]
    pivot(gap, lambda r: f"{r['norm']}, n = {r['n']} x batch {r['batch_size']}, beta = {r['bn_momentum']}"
          + ("" if not r["f"] else f", f = {r['f']} sending nothing" if r["bn_attack"] == "none"
             else f", {r['bn_attack'].upper()} on the statistics by f = {r['f']}, undefended"),
          lambda r: "T = 200, momentum 0.9" if r["rounds"] == 200 else "T = 1500, momentum 0.99 (paper)",
          "FBN against centralized BN at gamma = 0: final test accuracy (%)")
    for partition, title in (("dirichlet", "Seed 003's setting (FedAvg, Dirichlet 0.6, batch 8)"),
                             ("feature-shift", "Feature shift (seed 004's setting)")):
        part = [r for r in rows if r["algorithm"] == "fedavg" and r["partition"] == partition]
        pivot(part, lambda r: r["norm"], lambda r: "final accuracy", f"{title}: final test accuracy (%)")
    wall = sum(r["wall_time_s"] or 0 for r in rows)
    print(f"\n{len(rows)} runs, {wall / 60:.0f} minutes of run time in all")


if __name__ == "__main__":
    main(sys.argv[1:])
