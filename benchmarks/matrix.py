"""Runs per hour for a scenario matrix: one run at a time against several at once on the
same device (`--jobs N`, spawned processes sharing the CPU cores or the one GPU).

    python benchmarks/matrix.py [FILE] [--set rounds=40 ...] [--jobs 1 2 4] [--every K] [--limit 8] [--device cuda]

Each --jobs value runs the same runs (every K-th run of the expanded matrix, a sample that
spans its norms, defenses and attacks, then the first --limit of those; default all)
into its own fresh store, wall clock from the first run started to the last one committed,
process start-up and data loading included. Default FILE: seed 002's Figure 4 matrix on
Fashion-MNIST (scenarios/fbn_fig4_fmnist.toml), shortened with --set rounds=... for a quick
measure; runs per hour then counts short runs, so compare the columns, not the absolutes,
with other round counts.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from robustbn.execute import run_matrix  # noqa: E402
from robustbn.matrix import load  # noqa: E402
from robustbn.store import Store  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", default=os.path.join(HERE, "..", "scenarios", "fbn_fig4_fmnist.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    ap.add_argument("--jobs", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--every", type=int, default=1, help="every K-th run of the expanded matrix (default 1: all)")
    ap.add_argument("--limit", type=int, default=None, help="only the first LIMIT runs (of those --every keeps)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    _, scenarios = load(args.file, args.overrides)
    if args.every < 1:
        ap.error(f"--every must be >= 1, got {args.every}")
    scenarios = scenarios[:: args.every][: args.limit]
    print(f"# torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    print(f"\n## {args.device}: {len(scenarios)} runs of {os.path.basename(args.file)} "
          f"{' '.join('--set ' + o for o in args.overrides)} --every {args.every}\n")
    print("| jobs | runs | wall (s) | runs per hour | vs one at a time |")
    print("|---|---|---|---|---|")
    baseline = None
    for jobs in args.jobs:
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(os.path.join(tmp, "bench.sqlite"))
            start = time.perf_counter()
            summary = run_matrix(scenarios, store, source=args.file, jobs=jobs, device=args.device, progress=False)
            wall = time.perf_counter() - start
            store.close()
        if summary.failed:
            raise SystemExit(f"jobs={jobs}: {len(summary.failed)} runs failed, first: {summary.failed[0][1]}")
        per_hour = len(scenarios) / wall * 3600
        baseline = baseline or per_hour
        print(f"| {jobs} | {len(scenarios)} | {wall:.1f} | {per_hour:.0f} | {per_hour / baseline:.2f} |", flush=True)


if __name__ == "__main__":
    main()
