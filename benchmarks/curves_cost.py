"""What issue 40's robustness curves cost: every finished run at the curves' points in a store,
by kind and by curve and protocol, with the hours of run time its rows record (`wall_time_s`).

    python benchmarks/curves_cost.py [results/board.sqlite]

Runs are told apart by their scenario, not their `source` (rows imported from a CSV export
carry none): tuning runs are on seeds 10 and 11, evaluated once (eval_every = rounds); search
trials on seeds 10 and 11 with the curves' eval_subset; reporting runs and confirmations on
seeds 0-4 with it, a confirmation recorded from a searched_worst_*.toml file."""
import json
import sqlite3
import sys
from collections import defaultdict

CURVES = {"gamma (f = 3)": lambda g, f: f == 3 and g in (0, 0.1, 0.5, 1),
          "f (gamma = 0.1)": lambda g, f: g == 0.1 and f in (1, 2, 3, 4)}
SUBSET = 2000  # scenarios/robustness_fmnist.toml's eval_subset: the board's runs have none


def kind(s: dict, source: str) -> str | None:
    seed, subset = s.get("seed"), s.get("eval_subset")
    if seed in (10, 11) and s.get("eval_every") == s.get("rounds") and not subset:
        return "tuning (seeds 10, 11; evaluated once)"
    if seed in (10, 11) and subset == SUBSET:
        return "search trials at the tuned lr (seeds 10, 11)"
    if seed in range(5) and subset == SUBSET:
        return "search confirmations (seeds 0-4)" if "searched_worst" in source else "reporting (seeds 0-4)"
    return None


def main(db: str) -> None:
    by_kind, by_curve, by_device = (defaultdict(lambda: [0, 0.0]) for _ in range(3))
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT scenario, source, wall_time_s, device FROM runs "
                           "WHERE status IN ('done', 'diverged', 'pruned')").fetchall()
    for scenario, source, wall, device in rows:
        s = json.loads(scenario)
        if (s.get("dataset"), s.get("partition"), s.get("n")) != ("fashion-mnist", "gamma", 10):
            continue
        curves = [c for c, on in CURVES.items() if on(s.get("gamma"), s.get("f"))]
        if not curves or not (k := kind(s, source or "")):
            continue
        hours = (wall or 0.0) / 3600
        for tally, key in [(by_kind, k), (by_device, device or "?")] + [(by_curve, (c, s["norm"])) for c in curves]:
            tally[key][0] += 1
            tally[key][1] += hours
    print("| kind | runs | hours of run time | s a run |\n|---|---|---|---|")
    for k, (n, h) in sorted(by_kind.items()):
        print(f"| {k} | {n:,} | {h:.1f} | {3600 * h / n:.1f} |")
    print(f"| **all** | **{sum(n for n, _ in by_kind.values()):,}** | **{sum(h for _, h in by_kind.values()):.1f}** | |")
    print("\n| device | runs | hours |\n|---|---|---|")
    for d, (n, h) in sorted(by_device.items()):
        print(f"| {d} | {n:,} | {h:.1f} |")
    print("\n| curve | protocol | runs | hours |\n|---|---|---|---|")
    for (c, norm), (n, h) in sorted(by_curve.items()):
        print(f"| {c} | {norm} | {n:,} | {h:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/board.sqlite")
