"""What an evaluation costs in a run, and what `eval_subset` saves, side by side in one process.

    python benchmarks/evaluation.py [--rounds 50] [--eval-every 5] [--subset 2000] [--repeats 2]

Runs one board scenario (Fashion-MNIST, simple CNN, FBN, nnm+trmean, ALIE, 10 clients of which
3 Byzantine, one torch thread) with every evaluation on the whole test set and with
`eval_subset`, alternating, --repeats times each; prints the median wall times, their ratio,
whether the final evaluations are equal, and the time of a round and of an evaluation of each
kind, from which a board run's (150 rounds, an evaluation every 25) saving is projected.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import robustbn  # noqa: E402
from robustbn.data import load_dataset  # noqa: E402
from robustbn.engine import Federation  # noqa: E402
from robustbn.runner import federation_parts  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402

BOARD = dict(dataset="fashion-mnist", model="simple-cnn", partition="gamma", gamma=0.0, n=10, f=3, norm="fbn",
             grad_agg="nnm+trmean", bn_agg="nnm+trmean", grad_attack="alie", batch_size=32, lr=0.05, seed=0)
BOARD_ROUNDS, BOARD_EVERY = 150, 25


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--subset", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sc = {**BOARD, "rounds": args.rounds, "eval_every": args.eval_every}
    robustbn.run({**sc, "rounds": 1, "eval_every": 1})  # data loaded, code warm
    times = {"whole test set": [], f"eval_subset = {args.subset}": []}
    finals = {}
    for _ in range(args.repeats):
        for name, extra in (("whole test set", {}), (f"eval_subset = {args.subset}", {"eval_subset": args.subset})):
            start = time.perf_counter()
            result = robustbn.run({**sc, **extra})
            times[name].append(time.perf_counter() - start)
            finals[name] = result.history[-1]
    # a round and an evaluation of each kind, timed on one federation
    board = Scenario(**{**sc, "rounds": BOARD_ROUNDS}).validated()
    data = load_dataset(board.dataset, board.data_dir, board.device)
    fed = Federation(board, data, federation_parts(board, data.y_train.cpu().numpy()))
    step, full, part = [], [], []
    for _ in range(5):
        t = time.perf_counter(); fed.step(); step.append(time.perf_counter() - t)  # noqa: E702
        t = time.perf_counter(); fed.evaluate(); full.append(time.perf_counter() - t)  # noqa: E702
        t = time.perf_counter(); fed.evaluate(subset=args.subset); part.append(time.perf_counter() - t)  # noqa: E702
    r, e, s = (statistics.median(v) for v in (step, full, part))
    evals = BOARD_ROUNDS // BOARD_EVERY
    before, after = BOARD_ROUNDS * r + evals * e, BOARD_ROUNDS * r + (evals - 1) * s + e
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, one torch thread; {args.rounds} rounds, an evaluation "
          f"every {args.eval_every}; median of {args.repeats}\n")
    print("| evaluations | wall (s) | ratio |\n|---|---|---|")
    base = statistics.median(times["whole test set"])
    for name, v in times.items():
        print(f"| {name} | {statistics.median(v):.1f} | {statistics.median(v) / base:.2f} |")
    same = finals["whole test set"] == finals[f"eval_subset = {args.subset}"]
    print(f"\nfinal evaluations equal: {same}")
    print(f"a round {r * 1000:.0f} ms, an evaluation on the whole test set {e * 1000:.0f} ms, on {args.subset} "
          f"examples {s * 1000:.0f} ms")
    print(f"a board run ({BOARD_ROUNDS} rounds, {evals} evaluations), projected: {before:.1f} s -> {after:.1f} s "
          f"({after / before:.2f})")


if __name__ == "__main__":
    main()
