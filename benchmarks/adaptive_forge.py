"""The adaptive attack's forge (FLTrust's adaptive attack, attacks/optimal.py) against its first
version (tests/test_attacks.py: adaptive_reference, a backward pass at every iterate, the last
included), interleaved, on the gradient sizes of the project's models; the messages are checked
equal bit for bit before anything is timed.

    python benchmarks/adaptive_forge.py [--models simple-cnn resnet20] [--repeats 10] [--device cpu]

The forge is where a run under the adaptive attack spends most of its time on the CPU: about 11
passes through the pipeline, forward and backward, every round.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# benchmarks/aggregators.py would shadow the package of that name: keep this folder off the path.
here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here] + [os.path.join(here, "..", "tests")]

import torch  # noqa: E402

import aggregators  # noqa: E402
import attacks  # noqa: E402
from robustbn.models import model_class  # noqa: E402
from test_attacks import adaptive_reference  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["simple-cnn", "resnet20"])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--f", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {args.device}; fltrust, n = {args.n}, f = {args.f}, float32; ms per forge, median of "
          f"{args.repeats}")
    print("| model | d | forge (ms) | first version (ms) | ratio |\n|---|---|---|---|---|")
    for name in args.models:
        in_channels, side = (1, 28) if name == "simple-cnn" else (3, 32)
        model = model_class(name)("fbn", in_channels=in_channels, image_size=side)
        d = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(0)
        honest = (torch.randn(args.n - args.f, d, generator=g) + 0.1).to(device)
        reference = (torch.randn(d, generator=g) + 0.1).to(device)
        rule = aggregators.build("fltrust")
        pipeline = lambda x: rule(x, reference=reference)  # noqa: E731
        forge = attacks.build("adaptive", pipeline=pipeline)
        if not torch.equal(forge(honest, args.f), adaptive_reference(pipeline, honest, args.f)):
            sys.exit(f"{name}: the forge's messages differ from its first version's")
        times = {"new": [], "old": []}
        for _ in range(args.repeats):  # interleaved: the machine's load falls on both alike
            for key, call in (("new", lambda: forge(honest, args.f)),
                              ("old", lambda: adaptive_reference(pipeline, honest, args.f))):
                sync(device)
                t = time.perf_counter()
                call()
                sync(device)
                times[key].append(time.perf_counter() - t)
        new, old = (sorted(times[k])[len(times[k]) // 2] * 1e3 for k in ("new", "old"))
        print(f"| {name} | {d:,} | {new:.0f} | {old:.0f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
