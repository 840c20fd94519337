"""Where a GPU round's time goes, and what capturing it could give: the groundwork for the
CUDA target (round <= 1.15 centralized steps), which eager execution misses because a round
is bound by kernel launches and host syncs (docs/performance.md, "Round vs centralized").

    python benchmarks/capture.py [--device cuda] [--norms fbn none] [--model simple-cnn] [--repeats 20]

Per norm, side by side in one process (FBN's scenario of benchmarks/round.py: n = 10, f = 3,
ALIE on gradients, SF on statistics, nnm+median on every channel, batch 50 per client):
- `round`: one eager federated round, `Federation.step`;
- `client grads`: its vmap'd forward and backward alone, on the round's inputs;
- `host syncs`: how many times a round waits for the device (CUDA's sync debug mode);
- `compiled grads`: the same forward and backward under `torch.compile` (mode
  reduce-overhead: inductor kernels replayed as CUDA graphs), its compile seconds, and its
  largest difference from eager;
- `graph`: a CUDA graph captured around the eager client grads, replayed on fixed inputs;
- `round graph`: whether a whole round can be captured as it is, with the engine's generator
  registered (the first error if not), and its replay on the captured inputs.
Nothing here changes the engine: it measures what a capture would be worth and what stands
in its way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
import warnings

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from robustbn.data import DataError, load_dataset, partition  # noqa: E402
from robustbn.engine import Federation  # noqa: E402
from robustbn.protocols import get  # noqa: E402
from robustbn.scenario import Scenario  # noqa: E402


def timed(fn, device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def federation(norm: str, model: str, data, device, n=10, f=3, batch=50) -> Federation:
    protocol = get(norm)
    sc = Scenario.from_dict(dict(
        dataset=data.name, model=model, norm=norm, n=n, f=f, batch_size=batch, momentum=0.9, rounds=10**6,
        grad_attack="alie", bn_attack="sf" if protocol.sends_statistics else "none",
        grad_agg="nnm+median", bn_agg="nnm+median", partition="gamma", gamma=0.0, device=str(device)))
    parts = partition(data.y_train.cpu().numpy(), sc.honest, "gamma", 0.0, seed=0)
    return Federation(sc, data, parts)


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:160].replace("|", "/")


def syncs_in_a_round(fed: Federation) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fed.step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def grads_inputs(fed: Federation):
    x, y = fed._sample()
    local = fed.protocol.local_statistics
    buffers = fed._buffers(fed.local_mean, fed.local_var) if local else fed._buffers(fed.shared_mean, fed.shared_var)
    return (fed.theta, fed.local, buffers, x, y), local


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--norms", nargs="+", default=["fbn", "none"])
    ap.add_argument("--model", default="simple-cnn")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compiling takes a while)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    try:
        data = load_dataset("fashion-mnist", device=device)
    except DataError:
        data = load_dataset("synthetic-images", device=device)
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu'}, {data.name}, "
          f"{args.model}, n=10 f=3 batch 50, ms (median of {args.repeats})\n")
    print("| norm | round | client grads | rest of round | host syncs | compiled grads (compile s, max diff) "
          "| graph of grads | round graph |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for norm in args.norms:
        fed = federation(norm, args.model, data, device)
        round_s = timed(fed.step, device, 3, args.repeats)
        inputs, local = grads_inputs(fed)
        eager = lambda: fed._client_grads(*inputs, theta_batched=False, buffers_batched=local)
        grads_s = timed(eager, device, 3, args.repeats)
        syncs = syncs_in_a_round(fed) if cuda else "-"

        compiled = "skipped"
        if not args.no_compile:
            try:
                fn = torch.compile(lambda th, lo, bu, x, y: fed._client_grads(th, lo, bu, x, y, theta_batched=False,
                                                                             buffers_batched=local),
                                   mode="reduce-overhead" if cuda else "default")
                start = time.perf_counter()
                got = fn(*inputs)
                got = fn(*inputs)
                compile_s = time.perf_counter() - start
                want = eager()
                diff = max((a - b).abs().max().item() for a, b in
                           zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))
                           if a.is_floating_point())
                comp_s = timed(lambda: fn(*inputs), device, 3, args.repeats)
                compiled = f"{comp_s * 1e3:.2f} ({compile_s:.0f} s, {diff:.1e})"
            except Exception as exc:  # a measurement: say what failed, go on
                compiled = "fails: " + first_line(exc)

        graph = "-"
        if cuda:
            try:
                static = eager()  # warm-up on a side stream, as torch.cuda.graphs asks
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        eager()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    static = eager()
                graph = f"{timed(g.replay, device, 3, args.repeats) * 1e3:.2f}"
            except Exception as exc:
                graph = "fails: " + first_line(exc)

        whole = "-"
        if cuda:
            try:
                g = torch.cuda.CUDAGraph()
                g.register_generator_state(fed.gen)  # the engine's own generator, not the default one
                with torch.cuda.graph(g):
                    fed.step()
                whole = f"captured; replay {timed(g.replay, device, 3, args.repeats) * 1e3:.2f}"
            except Exception as exc:
                whole = "fails: " + first_line(exc)
                tb = traceback.extract_tb(exc.__traceback__)
                ours = [f for f in tb if "robustbn" in f.filename or "aggregators" in f.filename or "attacks" in f.filename]
                if ours:
                    whole += f" (at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno})"
        print(f"| {norm} | {round_s * 1e3:.2f} | {grads_s * 1e3:.2f} | {(round_s - grads_s) * 1e3:.2f} | {syncs} "
              f"| {compiled} | {graph} | {whole} |", flush=True)


if __name__ == "__main__":
    main()
