"""`run(scenario) -> Result`: one scenario, start to end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .checkpoint import Checkpointer, Interrupted, stop_requested
from .data import Dataset, load_dataset, partition, split_root
from .engine import Federation
from .scenario import Scenario


@dataclass
class Result:
    scenario: dict[str, Any]
    history: list[dict[str, float]]     # one row per evaluation: round, test_acc, test_loss, train_loss
    bn_stats: dict[str, dict[str, list[float]]]  # BN layer -> {"mean": [...], "var": [...]} (shared; where kept on the clients: client 0's)
    wall_time_s: float
    device: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_accuracy(self) -> float:
        return self.history[-1]["test_acc"]


def federation_parts(sc: Scenario, labels: np.ndarray) -> list[np.ndarray]:
    """Training indices of every row that computes: the honest clients, then the Byzantine
    clients where they hold data (label flipping: the data is then split among all n clients,
    the last f parts theirs), then the server's root set (FLTrust: `root_size` examples drawn
    from the training set and kept from the clients)."""
    pool = np.arange(len(labels))
    root = None
    if sc.root_size is not None:
        root, pool = split_root(len(labels), sc.root_size, sc.seed)
    clients = sc.honest + (sc.f if sc.byzantine_hold_data else 0)
    parts = [pool[p] for p in partition(labels[pool], clients, sc.partition, sc.gamma, sc.alpha, sc.seed, sc.shards)]
    return parts + ([root] if root is not None else [])


def filter_rates(fed: Federation, f: int) -> dict[str, float]:
    """With a client filter: the fractions of honest and of Byzantine messages it dropped since
    the last evaluation (the Byzantine clients are the last f rows of each mask)."""
    if fed.client_filter is None or not fed.kept_history:
        return {}
    masks, fed.kept_history = fed.kept_history, []
    dropped = [(~m).float() for m in masks]
    honest = torch.stack([d[: len(d) - f].mean() for d in dropped]).mean().item()
    byzantine = torch.stack([d[len(d) - f :].mean() for d in dropped]).mean().item() if f else 0.0
    return {"honest_dropped": honest, "byzantine_dropped": byzantine}


def run(scenario: Scenario | dict[str, Any], data: Dataset | None = None, progress=None,
        vectorized: bool | None = None, checkpoint: Checkpointer | None = None, on_evaluation=None) -> Result:
    """Run one scenario. `data` reuses an already loaded dataset (same name, on the scenario's
    device); `progress(round)` is called after each round (e.g. a progress bar's update);
    `vectorized` picks vmap (True) or the per-client loop (False), default by device.
    `checkpoint`: resume from its file when there is one, write it as it says, and on a stop
    request (SIGINT, SIGTERM: robustbn.checkpoint) write it and raise Interrupted.
    `on_evaluation(history)` is called with the history so far (host numbers) after each
    evaluation, and once on resuming from a checkpoint with evaluations; whatever it raises
    ends the run (the attack search's pruner)."""
    sc = scenario if isinstance(scenario, Scenario) else Scenario.from_dict(scenario)
    sc.validated()
    sc.check_user_code()  # a module edited since the run was planned is not the code it records
    start = time.perf_counter()
    data = data or load_dataset(sc.dataset, sc.data_dir, sc.device)
    parts = federation_parts(sc, data.y_train.cpu().numpy())
    fed = Federation(sc, data, parts, vectorized=vectorized)
    evaluations, resumed_from, earlier_s = [], None, 0.0
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is not None:
        fed.load_state_dict(saved["federation"])
        evaluations, resumed_from, earlier_s = saved["history"], fed.t, saved["wall_time_s"]

    def history():  # device tensors are read here only: no host sync inside the rounds
        return [{k: v.item() if isinstance(v, torch.Tensor) else v for k, v in h.items()} for h in evaluations]

    if on_evaluation is not None and saved is not None and evaluations:
        on_evaluation(history())

    def save():
        nonlocal evaluations
        evaluations = history()
        checkpoint.save({"round": fed.t, "federation": fed.state_dict(), "history": evaluations,
                         "wall_time_s": earlier_s + time.perf_counter() - start, "resumed_from": resumed_from})

    for t in range(fed.t + 1, sc.rounds + 1):
        fed.step()
        if t % sc.eval_every == 0 or t == sc.rounds:
            subset = sc.eval_subset if t < sc.rounds else None  # the final evaluation: the whole test set
            acc, loss = fed.evaluate(subset=subset)
            evaluations.append({"round": t, "test_acc": acc, "test_loss": loss, "train_loss": fed.pop_train_loss(),
                                **({"test_examples": min(subset, len(fed.eval_y))} if subset else {}),
                                **filter_rates(fed, sc.f)})
            if on_evaluation is not None:  # a host sync, for the hook's caller only
                on_evaluation(history())
        if progress is not None:
            progress(t)
        if checkpoint is not None and (checkpoint.due(t, sc.rounds) or stop_requested() and t < sc.rounds):
            save()
        if stop_requested() and t < sc.rounds:
            raise Interrupted(stop_requested())
    nonfinite = int(fed.nonfinite_rounds)  # one host sync, at the end
    if nonfinite:  # the pipeline returned NaN or inf: survived (those weights kept), and said
        evaluations = history()
        evaluations[-1]["nonfinite_update_rounds"] = nonfinite
    local = fed.protocol.local_statistics
    mean, var = (fed.local_mean[0], fed.local_var[0]) if local else (fed.shared_mean, fed.shared_var)
    stats = {name: {"mean": m.tolist(), "var": v.tolist()}
             for name, m, v in zip(fed.layer_names, mean.split(fed.channels_per_layer), var.split(fed.channels_per_layer))}
    return Result(sc.to_dict(), history(), stats, earlier_s + time.perf_counter() - start, str(fed.device),
                  {"resumed_from": resumed_from})
