"""Running a matrix of scenarios into the results store: in this process, in local worker
processes (`--jobs N`), or as Ray tasks (`--executor ray`).

Whatever the executor, the driver (this process) is the only writer of the store: executors
only yield outcomes, and each outcome is committed as it arrives.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Callable, Iterator

from tqdm.auto import tqdm

from aggregators.plugins import search_path

from .scenario import Scenario
from .store import Store, scenario_hash

_DATA_CACHE: dict = {}
Todo = list[tuple[str, Scenario]]
Outcomes = Iterator[tuple[str, Scenario, dict]]  # (hash, scenario, {"ok": result} or {"error": text})


class ExecutorError(Exception):
    """A user error in choosing or configuring an executor (bad shard, Ray missing, ...)."""


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


def _worker_init(threads: int, search: list[str] = ()) -> None:
    """A worker's setup: its torch threads, and the driver's search path for `module:Name`
    references (the scenario files' directories), so they resolve as in the driver."""
    import torch

    from aggregators.plugins import add_search_path
    torch.set_num_threads(threads)
    add_search_path(*search)


def _run_in_worker(values: dict) -> dict:
    try:
        return {"ok": run_one(values)}
    except Exception:
        return {"error": traceback.format_exc(limit=4)}


def _run_as_ray_task(values: dict, threads: int, search: list[str] = ()) -> dict:
    _worker_init(threads, search)
    return _run_in_worker(values)


@dataclass
class Summary:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N (0-based, as Slurm and Kubernetes array indices usually are)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ExecutorError(f"--shard must be I/N with integers, 0 <= I < N (e.g. 0/4), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ExecutorError(f"--shard {text}: need N >= 1 and 0 <= I < N (e.g. 0/4 ... 3/4)")
    return index, count


def in_shard(run_hash: str, shard: tuple[int, int] | None) -> bool:
    """Stable slicing by run hash: the same run lands in the same shard on every machine."""
    return shard is None or int(run_hash, 16) % shard[1] == shard[0]


def pending(scenarios: list[Scenario], store: Store, device: str | None = None,
            shard: tuple[int, int] | None = None) -> tuple[Todo, int, int]:
    """(hash, scenario) of the runs of this shard still to do, how many of the shard are done
    already, and how many runs the shard has."""
    todo, skipped, in_this_shard = [], 0, 0
    for sc in scenarios:
        if device:
            sc = dataclasses.replace(sc, device=device).validated()
        run_hash = scenario_hash(sc.to_dict())
        if not in_shard(run_hash, shard):
            continue
        in_this_shard += 1
        if store.status(run_hash) == "done":
            skipped += 1
        else:
            todo.append((run_hash, sc))
    return todo, skipped, in_this_shard


def _in_this_process(todo: Todo, started: Callable, progress: bool) -> Outcomes:
    for run_hash, sc in todo:
        started(run_hash, sc)
        with tqdm(total=sc.rounds, desc=f"{sc.norm} {sc.attacks_in_brief()}", unit="round",
                  leave=False, disable=not progress) as run_bar:
            try:
                out = {"ok": run_one(sc.to_dict(), progress=lambda t: run_bar.update(1))}
            except Exception:
                out = {"error": traceback.format_exc(limit=4)}
        yield run_hash, sc, out


def _in_processes(todo: Todo, started: Callable, jobs: int) -> Outcomes:
    threads = max(1, (os.cpu_count() or 1) // jobs)
    ctx = get_context("spawn")  # CUDA and forked processes do not mix
    queue = iter(todo)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init,
                             initargs=(threads, search_path())) as pool:
        futures = {}
        def submit_next():  # one run per free worker, so the store's `running` rows are the runs in flight
            item = next(queue, None)
            if item is not None:
                started(*item)
                futures[pool.submit(_run_in_worker, item[1].to_dict())] = item
        for _ in range(jobs):
            submit_next()
        while futures:
            future = next(as_completed(futures))
            yield *futures.pop(future), future.result()
            submit_next()  # after the driver committed the finished run


@dataclass
class RayOptions:
    address: str | None = None      # None: connect to the Ray instance this process has, or start a local one
    cpus_per_run: float = 1.0
    gpus_per_run: float = 0.0
    retries: int = 3                # re-runs of a task whose worker died (crash, kill, lost node)


def _on_ray(todo: Todo, started: Callable, opts: RayOptions) -> Outcomes:
    try:
        import ray
    except ImportError:
        raise ExecutorError("--executor ray needs Ray, an optional extra: pip install 'robustbn[ray]'") from None
    if any(sc.device == "cuda" for _, sc in todo) and opts.gpus_per_run <= 0:
        raise ExecutorError("scenarios on cuda need --gpus-per-run > 0 with --executor ray "
                            "(e.g. 0.25 runs four at once on each GPU)")
    owns_connection = not ray.is_initialized()
    if owns_connection:
        ray.init(address=opts.address, include_dashboard=False, log_to_driver=False)
    try:
        # A task's own exceptions come back as {"error": ...} (deterministic: no retry); Ray
        # retries only tasks whose worker died.
        task = ray.remote(_run_as_ray_task).options(
            num_cpus=opts.cpus_per_run, num_gpus=opts.gpus_per_run, max_retries=opts.retries,
            retry_exceptions=False)
        threads = max(1, int(opts.cpus_per_run))
        waiting = {}
        for run_hash, sc in todo:
            started(run_hash, sc)
            waiting[task.remote(sc.to_dict(), threads, search_path())] = (run_hash, sc)
        while waiting:
            (ref,), _ = ray.wait(list(waiting), num_returns=1)
            try:
                out = ray.get(ref)
            except Exception as e:  # the worker died more often than `retries`
                out = {"error": f"{type(e).__name__}: {e}"}
            yield *waiting.pop(ref), out
    finally:
        if owns_connection:
            ray.shutdown()


def run_matrix(scenarios: list[Scenario], store: Store, source: str = "", jobs: int = 1,
               device: str | None = None, progress: bool = True, executor: str = "local",
               shard: tuple[int, int] | None = None, ray_options: RayOptions | None = None) -> Summary:
    """Run the scenarios of `shard` (all by default) not yet done in `store`, committing each
    outcome as it arrives. executor "local": in this process (jobs = 1) or in `jobs` spawned
    processes; "ray": one Ray task per scenario."""
    todo, skipped, total = pending(scenarios, store, device, shard)
    summary = Summary(total=total, skipped=skipped)
    started = lambda run_hash, sc: store.start(run_hash, sc.to_dict(), source)
    if executor == "ray":
        outcomes = _on_ray(todo, started, ray_options or RayOptions())
    elif executor == "local":
        outcomes = _in_this_process(todo, started, progress) if jobs <= 1 else _in_processes(todo, started, jobs)
    else:
        raise ExecutorError(f"executor must be 'local' or 'ray', got {executor!r}")
    with tqdm(total=len(todo), desc="matrix", unit="run", disable=not progress) as bar:
        for run_hash, sc, out in outcomes:
            if "ok" in out:
                store.finish(run_hash, sc.to_dict(), source=source, **out["ok"])
                summary.done += 1
            else:
                store.fail(run_hash, out["error"])
                summary.failed.append((run_hash, out["error"].strip().splitlines()[-1]))
            bar.update(1)
    return summary
