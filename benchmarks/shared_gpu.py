"""Seconds per round of one run when K runs share the device, per aggregation rule: what a
matrix's `--jobs K` pays. On one H100 with eight jobs, FixBN's runs with DnC on every channel
took 20 times the other defenses' (docs/performance.md, the 2026-11-28 lease). Those runs all
had bn-kl on the BN statistics, which scores 47 candidate message sets a round through the
rule, then one at a time for DnC (a random rule): 47 of its eigendecompositions where SF costs
one, each a host sync on CUDA (`torch.linalg.eigh`), and a sync may wait longer while
processes time-slice the GPU. DnC draws nothing on the statistics (d <= b), so the candidates
are now scored in one vmapped call; this measures what is left.
`--eigh` picks where the rules' small eigendecompositions are solved: `host` (the default since
2026-11-28: one copy to the CPU and back, aggregators.catalogue.HOST_EIGH_MAX_ENTRIES), or on
the GPU with torch's `cusolver` or `magma` (MAGMA's hybrid solver uses host threads, which eight
processes would oversubscribe).

    python benchmarks/shared_gpu.py [--device cuda] [--rules nnm+trmean dnc] [--bn-attacks sf bn-kl]
                                    [--procs 1 8] [--norm fixbn] [--eigh host cusolver magma]

Each of K spawned processes builds the same federation (Simple-CNN, n = 10, f = 3, ALIE on
the gradients, the BN attack on the statistics, the rule on every channel), waits at a
barrier, runs 3 rounds, then times `--rounds` rounds with one sync at the end (a run syncs no
more often between its evaluations). Per rule, BN attack and K: the median over the processes
of seconds a round, the rounds a second of all K together, and the slowdown of a process
against the smallest K (side by side in one run).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402


def one_process(rule: str, norm: str, bn_attack: str, device: str, rounds: int, threads: int, eigh: str, barrier,
                results) -> None:
    """Time `rounds` rounds once every process is ready; the seconds a round, or the error,
    go on `results` (a failure breaks the barrier: the others stop too, not wait)."""
    try:
        results.put(("ok", _timed_rounds(rule, norm, bn_attack, device, rounds, threads, eigh, barrier)))
    except BaseException as e:  # noqa: BLE001 (the parent reports it)
        barrier.abort()
        results.put(("error", f"{type(e).__name__}: {e}"))


def _timed_rounds(rule, norm, bn_attack, device, rounds, threads, eigh, barrier) -> float:
    torch.set_num_threads(threads)
    if eigh != "host":
        from aggregators import catalogue

        catalogue.HOST_EIGH_MAX_ENTRIES = 0  # every eigendecomposition on the device, as before 2026-11-28
        torch.backends.cuda.preferred_linalg_library(eigh)
    from robustbn.data import DataError, load_dataset, partition
    from robustbn.engine import Federation
    from robustbn.protocols import get
    from robustbn.scenario import Scenario

    dev = torch.device(device)
    try:
        data = load_dataset("fashion-mnist", device=dev)
    except DataError:
        data = load_dataset("synthetic-images", device=dev)
    sends = get(norm).sends_statistics
    sc = Scenario.from_dict(dict(dataset=data.name, model="simple-cnn", norm=norm, n=10, f=3, batch_size=32,
                                 momentum=0.9, rounds=10**6, grad_attack="alie", bn_attack=bn_attack if sends else "none",
                                 grad_agg=rule, bn_agg=rule, partition="gamma", gamma=0.0, device=device))
    fed = Federation(sc, data, partition(data.y_train.cpu().numpy(), sc.honest, "gamma", 0.0, seed=0))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        fed.step()
    sync()
    barrier.wait(timeout=600)
    start = time.perf_counter()
    for _ in range(rounds):
        fed.step()
    sync()
    return (time.perf_counter() - start) / rounds


def measure(rule: str, bn_attack: str, k: int, eigh: str, args) -> list[float]:
    """Each of k processes' seconds a round; SystemExit naming the first failure (the others
    are stopped)."""
    ctx = mp.get_context("spawn")  # CUDA and forked processes do not mix
    barrier, results = ctx.Barrier(k), ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // k)
    procs = [ctx.Process(target=one_process, args=(rule, args.norm, bn_attack, args.device, args.rounds, threads, eigh,
                                                    barrier, results), daemon=True) for _ in range(k)]
    for p in procs:
        p.start()
    out = []
    while len(out) < k:
        try:
            status, value = results.get(timeout=5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead and results.empty():  # died without a word (killed, out of memory)
                status, value = "error", f"a process exited with {dead[0]}"
            else:
                continue
        if status == "error":
            for p in procs:
                p.terminate()
            raise SystemExit(f"shared_gpu: {rule} against {bn_attack} (eigh on {eigh}), {k} processes: {value}")
        out.append(value)
    for p in procs:
        p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rules", nargs="+", default=["nnm+trmean", "dnc"])
    ap.add_argument("--procs", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--norm", default="fixbn")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--bn-attacks", nargs="+", default=["sf", "bn-kl"],
                    help="the attacks on the BN statistics (bn-kl scores 47 candidates a round through the rule)")
    ap.add_argument("--eigh", nargs="+", default=["host"], choices=["host", "cusolver", "magma"],
                    help="where small eigendecompositions are solved: the host, or the GPU with this library")
    args = ap.parse_args()
    if any(k < 1 for k in args.procs) or args.rounds < 1:
        ap.error("--procs and --rounds take integers >= 1")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{os.cpu_count()} CPU cores"
    print(f"# torch {torch.__version__}, {name}; {args.norm}, Simple-CNN, n = 10, f = 3, batch 32; "
          f"{args.rounds} rounds timed per process")
    print("\n| rule on every channel | BN attack | eigendecompositions | processes | s a round (median over them) | "
          "rounds a second, all | slowdown against the fewest |")
    print("|---|---|---|---|---|---|---|")
    for rule in args.rules:
        for bn_attack in args.bn_attacks:
            for eigh in args.eigh:
                alone = None
                for k in sorted(set(args.procs)):
                    per = measure(rule, bn_attack, k, eigh, args)
                    mid = statistics.median(per)
                    alone = mid if alone is None else alone
                    print(f"| {rule} | {bn_attack} | {eigh} | {k} | {mid:.4f} | {sum(1 / s for s in per):.1f} | "
                          f"{mid / alone:.2f} |", flush=True)


if __name__ == "__main__":
    main()
