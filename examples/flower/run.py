"""Run the example as a Flower simulation on this machine (offline; no `flwr new`, no network):

    python examples/flower/run.py [--rounds 5] [--clients 10] [--byzantine 2] [--norm fbn] [--synthetic]

n clients train the CNN of task.py; the last --byzantine of them flip their labels; the server
aggregates with robustbn's RobustStrategy (NNM + trimmed mean on the updates and on both BN
statistics, under the BN protocol --norm). Prints the accuracy after every round.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.simulation import run_simulation  # noqa: E402

from client_app import app as client_app  # noqa: E402
from server_app import server_app  # noqa: E402
from task import FASHION_MNIST  # noqa: E402


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--byzantine", type=int, default=2, help="label-flipping clients (the last ones)")
    ap.add_argument("--norm", default="fbn", choices=["naive", "fbn", "fixbn", "fedbn", "silobn"])
    ap.add_argument("--per-client", type=int, default=512, help="training (and test) examples per client")
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--test-size", type=int, default=2000, help="the server's test images")
    ap.add_argument("--data-dir", default=FASHION_MNIST)
    ap.add_argument("--synthetic", action="store_true", help="synthetic images instead of Fashion-MNIST")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs for the simulation (1 per client)")
    args = ap.parse_args(argv)
    settings = {k.replace("_", "-"): v for k, v in vars(args).items()}
    if args.synthetic:
        settings["data-dir"] = ""
    elif not os.path.isdir(args.data_dir):
        sys.exit(f"run.py: --data-dir: no such directory {args.data_dir!r} (apt-get install dataset-fashion-mnist, "
                 f"or --synthetic)")
    results: dict = {}
    run_simulation(server_app=server_app(settings, results), client_app=client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.cpus, "include_dashboard": False}})
    result = results["result"]
    print("\n| round | train loss | clients' test accuracy | server's test accuracy |\n|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        train = result.train_metrics_clientapp.get(r, {}).get("train_loss", float("nan"))
        clients = result.evaluate_metrics_clientapp.get(r, {}).get("eval_acc", float("nan"))
        server = result.evaluate_metrics_serverapp.get(r, {}).get("accuracy", float("nan"))
        print(f"| {r} | {train:.4f} | {clients:.4f} | {server:.4f} |")
    return result


if __name__ == "__main__":
    main()
