"""Several files' runs with `--jobs N`: a pool of worker processes per file (each run_matrix
call spawns its own, as `robustbn run A B C` and each tuning wave did before), against one
pool for them all (`robustbn.execute.shared_workers`, what `run` and `tune` use now).

    python benchmarks/pool.py [--files 6] [--runs 4] [--rounds 10] [--jobs 2] [--repeats 2] [--device cuda]

Each file is the curves' setting (Fashion-MNIST, Simple-CNN, n = 10, f = 3, gamma = 0.1, FBN,
nnm+trmean, ALIE on the gradients) with its own lr, `--runs` seeds each, `--rounds` rounds:
short runs, so that a run costs about what a 150-round run costs on a GPU (2-5 s). Both ways run
the same runs into fresh stores, interleaved (a, b, a, b, ...), wall clock from the first spawn
to the last run committed. A pool per file pays, per file, each worker's start (imports, the
dataset, CUDA) and the idle tail while the file's last runs end.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from contextlib import nullcontext

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from robustbn.execute import run_matrix, shared_workers  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402
from robustbn.store import Store  # noqa: E402


def files(n_files: int, runs: int, rounds: int, device: str) -> list[list[Scenario]]:
    base = dict(dataset="fashion-mnist", model="simple-cnn", partition="gamma", gamma=0.1, n=10, f=3, rounds=rounds,
                batch_size=32, momentum=0.9, eval_every=rounds, norm="fbn", grad_agg="nnm+trmean",
                bn_agg="nnm+trmean", grad_attack="alie", device=device)
    return [[Scenario(**base, lr=0.01 + 0.01 * i, seed=s).validated() for s in range(runs)] for i in range(n_files)]


def timed(groups: list[list[Scenario]], jobs: int, shared: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(os.path.join(tmp, "s.sqlite"))
        start = time.perf_counter()
        with shared_workers() if shared else nullcontext():
            for scenarios in groups:
                summary = run_matrix(scenarios, store, jobs=jobs, progress=False, checkpoint_every=0)
                assert summary.done == len(scenarios), summary
        wall = time.perf_counter() - start
        store.close()
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=6)
    p.add_argument("--runs", type=int, default=4, help="runs per file (seeds)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    groups = files(args.files, args.runs, args.rounds, args.device)
    total = args.files * args.runs
    per_file, one_pool = [], []
    for _ in range(args.repeats):
        per_file.append(timed(groups, args.jobs, shared=False))
        one_pool.append(timed(groups, args.jobs, shared=True))
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"### {args.device} ({name}, {os.cpu_count()} cores), torch {torch.__version__}: {args.files} files x "
          f"{args.runs} runs of {args.rounds} rounds, --jobs {args.jobs}; best of {args.repeats}\n")
    print("| pools | wall (s) | runs per hour | per file, against one pool |")
    print("|---|---|---|---|")
    a, b = min(per_file), min(one_pool)
    print(f"| a pool per file | {a:.1f} | {total * 3600 / a:,.0f} | {a / b:.2f} |")
    print(f"| one pool | {b:.1f} | {total * 3600 / b:,.0f} | 1.00 |")
    print(f"\nall walls (s): a pool per file {', '.join(f'{w:.1f}' for w in per_file)}; "
          f"one pool {', '.join(f'{w:.1f}' for w in one_pool)}")


if __name__ == "__main__":
    main()
