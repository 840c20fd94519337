"""Seconds per round of one Fashion-MNIST FedAvg scenario through robustbn's engine
(robustbn.run) and through a Flower simulation of it (robustbn.flower.run_scenario, the
`robustbn flower` path), side by side.

    python benchmarks/flower.py [--rounds 8] [--repeats 3] [--n 10] [--norm fbn] [--cpus 2]

Both sides run the same scenario (simple-cnn, n clients, batch 32, 2 local steps, mean
pipelines, no attack, one evaluation after the last round), interleaved (engine, Flower,
engine, Flower, ...) so that drifting load on a shared machine hits both alike. A round is
timed from the end of one aggregation to the end of the next (every client's local steps,
the messages, the server step); round 1 is the warm-up (Flower's actors start and load the
data then) and is not counted. The fixed cost is a run's wall time minus its rounds (round 1
at the run's median rate): Ray and actor start, data loading, model building, the final
evaluation.
The engine runs twice per cycle: on its default torch threads and on one (a Flower node's).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import robustbn  # noqa: E402
from robustbn.engine import Federation  # noqa: E402


def stamped(cls, name: str, stamps: list[float]):
    """Replace cls.name by a version that appends the time after each call; returns the original."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        stamps.append(time.perf_counter())
        return out
    setattr(cls, name, wrapper)
    return original


def timed(run, cls, name: str) -> tuple[float, list[float]]:
    """(wall seconds, the durations of rounds 2...) of run(), a round ending at each cls.name call."""
    stamps: list[float] = []
    original = stamped(cls, name, stamps)
    start = time.perf_counter()
    try:
        run()
    finally:
        setattr(cls, name, original)
    return time.perf_counter() - start, [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--norm", default="fbn")
    ap.add_argument("--model", default="simple-cnn")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs of the Flower simulation")
    args = ap.parse_args()

    from flwr import __version__ as flwr_version
    from ray import __version__ as ray_version

    from robustbn.flower import RobustStrategy, run_scenario
    sc = robustbn.Scenario.from_dict(dict(
        dataset="fashion-mnist", model=args.model, algorithm="fedavg", n=args.n, f=0, batch_size=32, local_steps=2,
        rounds=args.rounds, eval_every=args.rounds, norm=args.norm, device="cpu")).validated()
    threads = torch.get_num_threads()
    print(f"# torch {torch.__version__}, flwr {flwr_version}, ray {ray_version}, {platform.machine()}, "
          f"{os.cpu_count()} CPU cores, engine on {threads} torch threads")
    print(f"# python benchmarks/flower.py {' '.join(sys.argv[1:])}")
    def engine_on(n_threads: int):
        def run():
            torch.set_num_threads(n_threads)
            try:
                robustbn.run(sc)
            finally:
                torch.set_num_threads(threads)
        return run
    # the engine on its default threads and on one (a Flower node's; the equivalence tests'):
    # on a loaded machine, two threads that wait for each other suffer most
    runs = {"engine": (engine_on(threads), Federation, "step"), "engine-1": (engine_on(1), Federation, "step"),
            "flower": (lambda: run_scenario(sc, cpus=args.cpus), RobustStrategy, "aggregate_train")}
    sides = {side: ([], []) for side in runs}  # (fixed seconds per run, round durations)
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for side, (run, cls, name) in runs.items():
            wall, rounds = timed(run, cls, name)
            sides[side][0].append(wall - sum(rounds) - statistics.median(rounds))  # round 1 as a steady one
            sides[side][1].extend(rounds)
            load.append(os.getloadavg()[0])
    print(f"\n## cpu, fashion-mnist, {args.model}, n={args.n}, batch 32, 2 local steps, FedAvg, {args.norm}, mean "
          f"pipelines, no attack; {args.rounds} rounds (round 1 the warm-up) x {args.repeats} runs per side, "
          f"interleaved; 1-minute load average {min(load):.1f} to {max(load):.1f} on {os.cpu_count()} cores\n")
    print("| path | seconds per round (median) | min - max | fixed cost per run (s) | Flower's round / this one |")
    print("|---|---|---|---|---|")
    labels = {"engine": f"robustbn engine (`robustbn run`: per-client loop, {threads} torch threads)",
              "engine-1": "robustbn engine, 1 torch thread",
              "flower": f"Flower simulation (`robustbn flower`: {args.n} nodes, 1 CPU and 1 torch thread each, "
                        f"{args.cpus} CPUs)"}
    flower_round = statistics.median(sides["flower"][1])
    for side, (fixed_costs, rounds) in sides.items():
        per_round, fixed = statistics.median(rounds), statistics.median(fixed_costs)
        ratio = "-" if side == "flower" else f"{flower_round / per_round:.2f}"
        print(f"| {labels[side]} | {per_round:.3f} | {min(rounds):.3f} - {max(rounds):.3f} | {fixed:.1f} | {ratio} |",
              flush=True)


if __name__ == "__main__":
    main()
