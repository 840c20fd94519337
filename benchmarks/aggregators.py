"""Time of every aggregation rule on (n, d) messages, on the CPU and on CUDA when present.

    python benchmarks/aggregators.py [--n 10 50 100] [--d 100000 1000000 10000000] [--repeats 3]

Prints a markdown table (milliseconds, median of --repeats timed calls after one warm-up),
with the ratio to the plain mean on the same input, and, on CUDA, the peak memory of each
call as a multiple of the input's size. Sizes whose estimated peak does not fit in
--max-gib are skipped and shown as "skip".
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

# This file is named like the package it measures: keep its folder off the import path.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import aggregators  # noqa: E402

SPECS = ["mean", "median", "trmean", "krum", "multikrum", "geomed", "cc", "meamed", "monna",
         "nnm+median", "nnm+trmean", "bucketing+krum", "clipping+mean", "arc+trmean"]
PEAK_FACTOR = 6  # sanitize copy + sort values + int64 sort indices, with headroom


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device, repeats):
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_ratio(fn, x):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / (x.numel() * x.element_size())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--d", type=int, nargs="+", default=[10**5, 10**6, 10**7])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rules", nargs="+", default=SPECS, help="pipeline specs (default: the table's fourteen)")
    ap.add_argument("--max-gib", type=float, default=None,
                    help="skip sizes whose estimated peak exceeds this (default: half the device's memory)")
    ap.add_argument("--device", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    args = ap.parse_args()

    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    for dev in map(torch.device, args.device):
        if dev.type == "cuda":
            limit = args.max_gib or torch.cuda.get_device_properties(dev).total_memory / 2**30 / 2
        else:
            limit = args.max_gib or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / 2
        sizes = [(n, d) for n in args.n for d in args.d]
        print(f"\n## {dev.type}: milliseconds per call (ratio to mean)"
              + ("; peak memory / input size" if dev.type == "cuda" else "") + "\n")
        print("| rule | " + " | ".join(f"n={n}, d={d:.0e}" for n, d in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        rows = {spec: [] for spec in args.rules}
        for n, d in sizes:
            if n * d * 4 * PEAK_FACTOR / 2**30 > limit:
                for spec in args.rules:
                    rows[spec].append("skip")
                continue
            x = torch.randn(n, d, device=dev, generator=torch.Generator(dev).manual_seed(0))
            f = max(1, n // 10)  # 10% Byzantine: Krum after bucketing (s=2) still has n/2 > 2f + 2
            mean_s = None
            for spec in args.rules:
                rule = aggregators.build(spec, f=f, n=n)
                s = time_call(lambda: rule(x), dev, args.repeats)
                mean_s = mean_s or s
                cell = f"{s * 1e3:.1f} ({s / mean_s:.1f}x)"
                if dev.type == "cuda":
                    cell += f"; {peak_ratio(lambda: rule(x), x):.1f}x mem"
                rows[spec].append(cell)
                # one line per cell as it is measured: a run stopped at a time limit keeps them
                print(f"# n={n} d={d:.0e} {spec}: {cell}", file=sys.stderr, flush=True)
            del x
        for spec in args.rules:
            print(f"| {spec} | " + " | ".join(rows[spec]) + " |")


if __name__ == "__main__":
    main()
