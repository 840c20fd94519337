"""The ServerApp: robustbn's RobustStrategy where FedMedian was, and an evaluation of the
global model on the server's test images after every round."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from robustbn.flower import RobustStrategy
from task import Net, load_all, test


def server_app(settings: dict, results: dict) -> ServerApp:
    """The ServerApp of `settings` (run.py's options); Flower's Result goes into results["result"]."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        model = Net()
        # strategy = FedMedian()  # before: the median of every array, BN statistics and counters included
        strategy = RobustStrategy(
            model, n=settings["clients"], f=settings["byzantine"], norm=settings["norm"],
            grad_agg="nnm+trmean", bn_agg="nnm+trmean",  # NNM, then the trimmed mean: updates and BN statistics
            example_input=torch.zeros(settings["batch-size"], 1, 28, 28))  # one client batch: fbn's K
        config = ConfigRecord({k: settings[k] for k in
                               ("data-dir", "per-client", "local-epochs", "batch-size", "lr", "byzantine")})
        _, _, x_test, y_test = load_all(settings["data-dir"])
        x_test, y_test = x_test[: settings["test-size"]], y_test[: settings["test-size"]]

        def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if settings["norm"] in ("fedbn", "silobn"):  # BN statistics stay on the clients: they evaluate
                return None
            model.load_state_dict(arrays.to_torch_state_dict())  # fbn: BN normalizes with the shared statistics
            loss, accuracy = test(model, x_test, y_test)
            return MetricRecord({"accuracy": accuracy, "loss": loss})

        results["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                           num_rounds=settings["rounds"], train_config=config,
                                           evaluate_config=ConfigRecord(dict(config)), evaluate_fn=central_evaluate)
    return app
