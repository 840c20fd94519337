"""Does a stored run come out the same when it is run again, here and now?

    python benchmarks/rerun.py --db results/board.sqlite [--limit 2] [--where norm=fixbn grad_agg=dnc ...]

Picks finished CPU runs from the store (none resumed from a checkpoint), the --limit last stored
with recorded versions (made since versions were recorded) and the --limit first stored without
them (older, imported from docs/results.csv), reruns each scenario exactly as stored (same fields,
same seed, one torch thread, on the CPU) and prints the stored and the new final accuracy side by
side and whether they are equal bit for bit. Nothing is written to the store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import robustbn  # noqa: E402
from robustbn.store import Store, scenario_dict  # noqa: E402


def value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--limit", type=int, default=2, help="runs of each kind (recorded machine, imported)")
    ap.add_argument("--where", nargs="*", default=["grad_attack=alie", "seed=0"],
                    help="scenario fields the runs must have, FIELD=VALUE (JSON values)")
    ap.add_argument("--rounds", type=int, help="only runs of this many rounds")
    args = ap.parse_args()
    where = {}
    for item in args.where:
        field, sep, text = item.partition("=")
        if not sep:
            sys.exit(f"--where {item}: expected FIELD=VALUE")
        where[field] = value(text)
    torch.set_num_threads(1)
    with Store(args.db) as store:  # rows() keeps the store's order: the order the runs were stored in
        runs = [r for r in store.rows(where, status="done") if args.rounds in (None, r.get("rounds"))
                and r.get("device") == "cpu" and r.get("resumed_from") is None  # a resumed run may differ
                and r.get("engine") in (None, "robustbn")]
        versions = dict(store.db.execute("SELECT hash, versions FROM runs"))
    recorded = [r for r in runs if versions.get(r["hash"])][-args.limit:]
    imported = [r for r in runs if not versions.get(r["hash"])][:args.limit]
    from robustbn.store import cpu_model

    print(f"Rerun here: {cpu_model()}, torch {torch.__version__}, one thread.\n")
    print("| run | stored by | stored acc | now | the same final accuracy, bit for bit | s |")
    print("|---|---|---|---|---|---|")
    for kind, r in [("recorded", r) for r in recorded] + [("imported", r) for r in imported]:
        scenario = scenario_dict(r)
        t = time.perf_counter()
        now = robustbn.run(scenario).history[-1]["test_acc"]
        stored = r["history"][-1]["test_acc"]
        words = ", ".join(f"{k}={scenario[k]}" for k in ("norm", "grad_agg", "bn_agg", "grad_attack", "bn_mean_attack",
                                                         "bn_var_attack", "gamma", "f", "lr", "eval_subset", "seed")
                          if scenario.get(k) is not None)
        cpu = json.loads(versions[r["hash"]]).get("cpu", "processor not recorded") if kind == "recorded" else \
            "imported from the CSV: processor not recorded"
        by = f"{r.get('code_version') or '?'} ({cpu})"  # the code that made it; '?': not recorded
        print(f"| {words} | {by} | {100 * stored:.2f} | {100 * now:.2f} | {'yes' if now == stored else 'no'} | "
              f"{time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
