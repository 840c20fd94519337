"""Seconds per federated round: the engine on its default path for the device (vmap over
clients on GPUs, the per-client loop on the CPU), the other path, and one centralized SGD
step on the same union batch (the physical floor), side by side.

    python benchmarks/round.py [--models simple-cnn cnn] [--norms naive fbn ...] [--n 10] [--batch 50]

Every norm's round of one model is timed interleaved with the others, so the last column
(the round against FBN's) is a side-by-side ratio. `central` runs the n - f honest clients'
union batch with f = 0 (it is the attack-free reference).

The engine's time includes everything a round does: sampling, the honest clients' forward
and backward, worker momentum, an attack and the nnm+median pipeline on every channel
(ALIE on gradients, SF on BN statistics), and the server updates. The centralized step is a
plain torch model with nn.BatchNorm2d, forward + backward + SGD step on n x batch samples.
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
from torch import nn  # noqa: E402

from robustbn.data import DataError, load_dataset, partition  # noqa: E402
from robustbn.engine import Federation  # noqa: E402
from robustbn.models import build_model  # noqa: E402
from robustbn.norm import FedBatchNorm  # noqa: E402
from robustbn.protocols import get  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def seconds(fns, device, warmup, repeats):
    """Median seconds of each function, timed interleaved (a, b, a, b, ...) so that drifting
    load on a shared machine hits every column of a row alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    sync(device)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync(device)
            bucket.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def torch_bn(model: nn.Module) -> nn.Module:
    """The same network with torch's own BatchNorm2d in place of FedBatchNorm."""
    for name, child in model.named_children():
        if isinstance(child, FedBatchNorm):
            setattr(model, name, nn.BatchNorm2d(child.weight.shape[0]))
        else:
            torch_bn(child)
    return model


def centralized_step(model_name, data, n, batch, device):
    model = torch_bn(build_model(model_name, "central", data.in_channels, data.image_size, data.num_classes)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device=device).manual_seed(0)
    def step():
        idx = torch.randint(0, len(data.y_train), (n * batch,), generator=gen, device=device)
        loss = nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["simple-cnn", "cnn"])
    ap.add_argument("--norms", nargs="+", default=["naive", "fbn", "fixbn", "hbn", "fedbn", "gn", "none", "fbn-scale",
                                                    "silobn", "fedtan", "fedwon", "central"])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--agg", default="nnm+median", help="the pipeline on every channel")
    ap.add_argument("--f", type=int, default=3)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-other", action="store_true", help="skip the other path")
    ap.add_argument("--device", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    args = ap.parse_args()

    print(f"# torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    for dev in map(torch.device, args.device):
        try:
            data = load_dataset("fashion-mnist", device=dev)
        except DataError:
            data = load_dataset("synthetic-images", device=dev)
        print(f"\n## {dev.type}, {data.name}, n={args.n} (f={args.f} Byzantine), batch {args.batch} per client, "
              f"DSGD; seconds per round (median of {args.repeats})\n")
        default = "vmap" if dev.type != "cpu" else "loop"
        other = {"vmap": "loop", "loop": "vmap"}[default]
        print(f"| model | norm | engine ({default}) | {other} | centralized step | engine / centralized | "
              f"{other} / engine | engine / FBN's |")
        print("|---|---|---|---|---|---|---|---|")
        for model in args.models:
            # every norm's round of one model timed interleaved: the ratios are side by side
            fns, labels = [centralized_step(model, data, args.n - args.f, args.batch, dev)], []
            for norm in dict.fromkeys(["fbn", *args.norms]):
                protocol = get(norm)
                f = 0 if protocol.union_batch else args.f
                sc = Scenario.from_dict(dict(
                    dataset=data.name, model=model, norm=norm, n=args.n - args.f + f, f=f, batch_size=args.batch,
                    momentum=0.9, rounds=10**6, grad_attack="alie" if f else "none",
                    bn_attack="sf" if protocol.sends_statistics and f else "none",
                    grad_agg=args.agg, bn_agg=args.agg, partition="gamma", gamma=0.0, device=str(dev)))
                parts = partition(data.y_train.cpu().numpy(), sc.honest, "gamma", 0.0, seed=0)
                fns.append(Federation(sc, data, parts).step)
                # a protocol whose forwards pool statistics runs one path on every device
                same = protocol.exchanges_in_forward
                fns.append(None if args.no_other or same else Federation(sc, data, parts, vectorized=other == "vmap").step)
                labels.append((norm, same))
            times = seconds([fn for fn in fns if fn is not None], dev, 2, args.repeats)
            it = iter(times)
            central_s = next(it)
            timed = {}
            for (norm, same), fn in zip(labels, fns[2::2]):
                engine = next(it)
                alt = next(it) if fn is not None else None
                timed[norm] = (engine, alt, same)
            for norm in args.norms:
                engine, alt, same = timed[norm]
                alternative, ratio = ((f"{alt:.4f}", f"{alt / engine:.2f}") if alt is not None else
                                      ("same path", "-") if same else ("not run", "not run"))
                print(f"| {model} | {norm} | {engine:.4f} | {alternative} | {central_s:.4f} | "
                      f"{engine / central_s:.2f} | {ratio} | {engine / timed['fbn'][0]:.2f} |", flush=True)

if __name__ == "__main__":
    main()
