"""Running a matrix of scenarios into the results store, one at a time or several at once."""

from __future__ import annotations

import dataclasses
import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context

from tqdm.auto import tqdm

from .scenario import Scenario
from .store import Store, scenario_hash

_DATA_CACHE: dict = {}


def _data_for(sc: Scenario):
    from .data import load_dataset

    key = (sc.dataset, sc.data_dir, sc.device)
    if key not in _DATA_CACHE:
        _DATA_CACHE.clear()  # one dataset at a time: they can be large
        _DATA_CACHE[key] = load_dataset(sc.dataset, sc.data_dir, sc.device)
    return _DATA_CACHE[key]


def run_one(values: dict, progress=None) -> dict:
    """Run one scenario (its dict), returning what the store keeps."""
    from .runner import run

    sc = Scenario.from_dict(values)
    result = run(sc, data=_data_for(sc), progress=progress)
    return {"history": result.history, "bn_stats": result.bn_stats, "wall_time_s": result.wall_time_s,
            "device": result.device}


def _worker_init(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def _run_in_worker(values: dict) -> dict:
    try:
        return {"ok": run_one(values)}
    except Exception:
        return {"error": traceback.format_exc(limit=4)}


@dataclass
class Summary:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)


def pending(scenarios: list[Scenario], store: Store, device: str | None = None) -> tuple[list[tuple[str, Scenario]], int]:
    """(hash, scenario) of the runs still to do, and how many are already done."""
    todo, skipped = [], 0
    for sc in scenarios:
        if device:
            sc = dataclasses.replace(sc, device=device).validated()
        run_hash = scenario_hash(sc.to_dict())
        if store.status(run_hash) == "done":
            skipped += 1
        else:
            todo.append((run_hash, sc))
    return todo, skipped


def run_matrix(scenarios: list[Scenario], store: Store, source: str = "", jobs: int = 1,
               device: str | None = None, progress: bool = True) -> Summary:
    todo, skipped = pending(scenarios, store, device)
    summary = Summary(total=len(scenarios), skipped=skipped)
    bar = tqdm(total=len(todo), desc="matrix", unit="run", disable=not progress)
    if jobs <= 1:
        for run_hash, sc in todo:
            store.start(run_hash, sc.to_dict(), source)
            with tqdm(total=sc.rounds, desc=f"{sc.norm} {sc.bn_attack}/{sc.bn_agg}", unit="round",
                      leave=False, disable=not progress) as run_bar:
                try:
                    out = run_one(sc.to_dict(), progress=lambda t: run_bar.update(1))
                except Exception:
                    store.fail(run_hash, traceback.format_exc(limit=4))
                    summary.failed.append((run_hash, traceback.format_exc(limit=1).strip().splitlines()[-1]))
                else:
                    store.finish(run_hash, sc.to_dict(), source=source, **out)
                    summary.done += 1
            bar.update(1)
    else:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        ctx = get_context("spawn")  # CUDA and forked processes do not mix
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(threads,)) as pool:
            futures = {}
            for run_hash, sc in todo:
                store.start(run_hash, sc.to_dict(), source)
                futures[pool.submit(_run_in_worker, sc.to_dict())] = (run_hash, sc)
            for future in as_completed(futures):
                run_hash, sc = futures[future]
                out = future.result()
                if "ok" in out:  # the driver is the only writer
                    store.finish(run_hash, sc.to_dict(), source=source, **out["ok"])
                    summary.done += 1
                else:
                    store.fail(run_hash, out["error"])
                    summary.failed.append((run_hash, out["error"].strip().splitlines()[-1]))
                bar.update(1)
    bar.close()
    return summary
