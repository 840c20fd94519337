"""The ServerApp: robustbn's RobustStrategy where FedMedian was, and an evaluation of the
global model on the server's test images after every round."""

from __future__ import annotations

import json
import math

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from robustbn.flower import RobustStrategy

from .task import Net, load_all, test

app = ServerApp()

# what the clients read from every train and evaluate message
CLIENT_KEYS = ("data-dir", "per-client", "local-epochs", "batch-size", "lr", "byzantine")


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = context.run_config
    n, f, norm = int(settings["num-clients"]), int(settings["byzantine"]), str(settings["norm"])
    model = Net()
    # strategy = FedMedian()  # before: the median of every array, BN statistics and counters included
    strategy = RobustStrategy(
        model, n=n, f=f, norm=norm,
        grad_agg="nnm+trmean",  # NNM, then the trimmed mean: the updates and (by default) both BN statistics
        example_input=torch.zeros(int(settings["batch-size"]), 1, 28, 28),  # one client batch: fbn's K
        min_train_nodes=n - f, min_available_nodes=n - f,  # a node that died: the next rounds go on without it
        fraction_evaluate=float(settings["fraction-evaluate"]), min_evaluate_nodes=0)
    config = ConfigRecord({k: settings[k] for k in CLIENT_KEYS})
    _, _, x_test, y_test = load_all(str(settings["data-dir"]))
    x_test, y_test = x_test[: int(settings["test-size"])], y_test[: int(settings["test-size"])]
    rounds: list[dict] = []

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if norm in ("fedbn", "silobn"):  # BN statistics stay on the clients: they evaluate
            return None
        model.load_state_dict(arrays.to_torch_state_dict())  # fbn: BN normalizes with the shared statistics
        loss, accuracy = test(model, x_test, y_test)
        if server_round > 0:
            rounds.append({"round": server_round, "accuracy": accuracy, "loss": loss})
            log(20, "robust_app: round %d: the server's test accuracy %.4f, loss %.4f", server_round, accuracy, loss)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=int(settings["num-server-rounds"]), timeout=float(settings["round-timeout"]),
                            train_config=config, evaluate_config=ConfigRecord(dict(config)),
                            evaluate_fn=central_evaluate)
    clients = result.evaluate_metrics_clientapp
    for entry in rounds:
        entry["clients_accuracy"] = clients.get(entry["round"], {}).get("eval_acc", math.nan)
    if settings["result-file"]:
        with open(str(settings["result-file"]), "w") as out:
            json.dump({"rounds": rounds, "train_loss": {r: m.get("train_loss") for r, m in
                                                         result.train_metrics_clientapp.items()}}, out)
