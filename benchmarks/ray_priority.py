"""Wall time of a matrix under `robustbn run --executor ray` (a local Ray instance) with Ray's
default worker niceness (15) and with robustbn's (0, the starting process's), idle and beside
busy processes, side by side.

    python benchmarks/ray_priority.py [--rounds 20] [--busy 2] [--repeats 1]

The matrix: Fashion-MNIST, simple-cnn, n = 10, batch 32, DSGD, fbn, mean pipelines, no attack,
one run per core (seeds 0, 1, ...), one evaluation after the last round; each measurement a
fresh store and a fresh Ray instance. "busy": that many processes spinning at niceness 0, as
another job, a test worker or a second run lane on the same machine would be. The busy
processes are this benchmark's own: the load average printed says what else was running.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import robustbn  # noqa: E402
from robustbn.execute import RAY_NICENESS, RayOptions, run_matrix  # noqa: E402
from robustbn.store import Store  # noqa: E402


def spin() -> None:
    while True:
        pass


def matrix_seconds(scenarios, niceness: int, busy: int) -> float:
    """Wall seconds of the scenarios on a fresh Ray instance whose workers run at `niceness`,
    beside `busy` spinning processes."""
    spinners = [mp.get_context("spawn").Process(target=spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    os.environ[RAY_NICENESS] = str(niceness)  # a user's own setting: robustbn keeps it
    try:
        with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "r.sqlite") as store:
            start = time.perf_counter()
            summary = run_matrix(scenarios, store, progress=False, executor="ray", ray_options=RayOptions())
            seconds = time.perf_counter() - start
        assert summary.done == len(scenarios), summary
        return seconds
    finally:
        os.environ.pop(RAY_NICENESS, None)
        for p in spinners:
            p.kill()
            p.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes beside the runs")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    from ray import __version__ as ray_version

    cores = os.cpu_count() or 1
    scenarios = [robustbn.Scenario.from_dict(dict(
        dataset="fashion-mnist", model="simple-cnn", n=10, f=0, batch_size=32, rounds=args.rounds,
        eval_every=args.rounds, norm="fbn", seed=seed, device="cpu")).validated() for seed in range(cores)]
    print(f"# torch {torch.__version__}, ray {ray_version}, {platform.machine()}, {cores} CPU cores")
    print(f"# python benchmarks/ray_priority.py {' '.join(sys.argv[1:])}")
    load = [os.getloadavg()[0]]
    seconds: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.repeats):
        for busy in (0, args.busy):
            for niceness in (15, 0):  # Ray's default, robustbn's
                seconds.setdefault((busy, niceness), []).append(matrix_seconds(scenarios, niceness, busy))
                load.append(os.getloadavg()[0])
    print(f"\n## {len(scenarios)} runs (fashion-mnist, simple-cnn, n=10, batch 32, DSGD, fbn, {args.rounds} rounds), "
          f"one Ray task each, 1 CPU each; {args.repeats} repeat(s); 1-minute load average {min(load):.1f} to "
          f"{max(load):.1f}, the busy processes included\n")
    print("| beside | workers at niceness 15 (Ray's default) (s) | at 0 (robustbn's) (s) | 15 / 0 |")
    print("|---|---|---|---|")
    for busy in (0, args.busy):
        slow, fast = min(seconds[(busy, 15)]), min(seconds[(busy, 0)])
        what = "nothing (idle)" if busy == 0 else f"{busy} busy processes"
        print(f"| {what} | {slow:.1f} | {fast:.1f} | {slow / fast:.1f} |", flush=True)


if __name__ == "__main__":
    main()
