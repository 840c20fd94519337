"""Running a matrix of scenarios into the results store: in this process, in local worker
processes (`--jobs N`), or as Ray tasks (`--executor ray`).

The driver (this process) claims each run in the store before it starts (several drivers can
share one store: each run is claimed by one), renews its claims while it lives, and commits
each outcome as it arrives. Runs write checkpoints beside the store (robustbn.checkpoint) and
their history so far into their row; a run that is started again resumes from its checkpoint.
A local worker that dies (killed, out of memory) is replaced and its run retried; workers die
with their driver; SIGINT and SIGTERM stop every run at its next round end, checkpointed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter, deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Iterator

from tqdm.auto import tqdm

from aggregators.plugins import search_path

from .checkpoint import (Checkpointer, Interrupted, checkpoint_dir, clear_stop, install_stop_handlers, request_stop,
                         stop_requested)
from .scenario import Scenario, devices_checked_where_they_run
from .store import FINISHED, LEASE_S, Store, new_owner, same_run_hashes

_DATA_CACHE: dict = {}
Todo = list[tuple[str, Scenario]]
# (hash, scenario, outcome): {"ok": result}, {"error": text}, {"interrupted": signum}, {"taken": True}
Outcomes = Iterator[tuple[str, Scenario, dict]]
MAX_ATTEMPTS = 3  # starts of a run whose worker died, before it is marked failed
MAX_JOBS = 512


class ExecutorError(Exception):
    """A user error in choosing or configuring an executor (bad shard, Ray missing, ...)."""


@dataclass
class Checkpointing:
    """How runs checkpoint: beside the store `db` (checkpoint.checkpoint_dir), whose rows get
    the history so far while `owner` holds them; every `every` rounds (None: every few
    minutes; 0: never); `keep` keeps the checkpoints of finished runs."""

    db: str
    every: int | None = None
    keep: bool = False
    owner: str | None = None

    def for_run(self, run_hash: str) -> Checkpointer | None:
        if self.every == 0:
            return None
        def progress(state):  # the row's history so far; never worth failing the run over
            try:
                with Store(self.db) as store:
                    store.progress(run_hash, state["history"], state["round"], state["resumed_from"], self.owner)
            except Exception as e:
                print(f"robustbn: could not record the progress of {run_hash} in {self.db}: {e}", file=sys.stderr)
        return Checkpointer(self.path(run_hash), run_hash, self.every, progress)

    def path(self, run_hash: str) -> Path:
        return checkpoint_dir(self.db) / f"{run_hash}.pt"

    def done_with(self, run_hash: str) -> None:
        if not self.keep:
            self.path(run_hash).unlink(missing_ok=True)


def _data_for(sc: Scenario):
    from .data import load_dataset

    key = (sc.dataset, sc.data_dir, sc.device)
    if key not in _DATA_CACHE:
        _DATA_CACHE.clear()  # one dataset at a time: they can be large
        _DATA_CACHE[key] = load_dataset(sc.dataset, sc.data_dir, sc.device)
    return _DATA_CACHE[key]


def run_one(values: dict, progress=None, checkpoint: Checkpointer | None = None) -> dict:
    """Run one scenario (its dict), returning what the store keeps."""
    from .runner import run

    sc = Scenario.from_dict(values)
    result = run(sc, data=_data_for(sc), progress=progress, checkpoint=checkpoint)
    return {"history": result.history, "bn_stats": result.bn_stats, "wall_time_s": result.wall_time_s,
            "device": result.device, "resumed_from": result.extra["resumed_from"]}


def _attempt(values: dict, run_hash: str, checkpointing: Checkpointing | None, progress=None) -> dict:
    """One run's outcome: {"ok": ...}, {"interrupted": signum} or {"error": traceback}."""
    try:
        checkpoint = checkpointing.for_run(run_hash) if checkpointing else None
        return {"ok": run_one(values, progress, checkpoint)}
    except Interrupted as e:
        return {"interrupted": e.signum}
    except Exception as e:  # the traceback for the store, the exception's first line for the terminal
        return {"error": traceback.format_exc(limit=4),
                "brief": "".join(traceback.format_exception_only(e)).strip().splitlines()[0]}


def _worker_init(threads: int, search: list[str] = ()) -> None:
    """A worker's setup: its torch threads, and the driver's search path for `module:Name`
    references (the scenario files' directories), so they resolve as in the driver."""
    import torch

    from aggregators.plugins import add_search_path
    torch.set_num_threads(threads)
    add_search_path(*search)


def _die_with(parent: int) -> None:
    """End this process as soon as its parent has gone (killed: it could not stop us)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _worker_main(conn, threads: int, search: list[str], parent: int) -> None:
    """A local worker: runs the tasks its driver sends until it sends None."""
    for s in (signal.SIGINT, signal.SIGTERM):  # stop at the next round end, checkpointed
        signal.signal(s, lambda signum, frame: request_stop(signum))
    _die_with(parent)
    _worker_init(threads, search)
    while True:
        try:
            while not conn.poll(0.5):
                if stop_requested():  # signalled while idle: it ends, and is dropped, not sent runs it would refuse
                    return
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send(_attempt(*task))
        if stop_requested():  # the signal was for this worker: its run is checkpointed, it ends
            return


def _run_as_ray_task(values: dict, threads: int, search: list[str], run_hash: str,
                     checkpointing: Checkpointing | None) -> dict:
    _worker_init(threads, search)
    return _attempt(values, run_hash, checkpointing)


@dataclass
class Summary:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    taken: int = 0                  # claimed by another process sharing the store
    interrupted: int = 0            # stopped by a signal, checkpointed: they resume next time
    resumed: int = 0


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


def on_device(sc: Scenario, device: str | None) -> Scenario:
    """The scenario as it runs and is stored under `--device` (None: its own device)."""
    return dataclasses.replace(sc, device=device).validated() if device else sc


def pending(scenarios: list[Scenario], store: Store, device: str | None = None,
            shard: tuple[int, int] | None = None) -> tuple[Todo, int, int]:
    """(hash, scenario) of the runs of this shard still to do, how many of the shard are done
    already, and how many runs the shard has. A run finished on another device is done: a GPU's
    runs and a CPU's fill one store."""
    todo, skipped, in_this_shard = [], 0, 0
    for sc in scenarios:
        sc = on_device(sc, device)
        hashes = same_run_hashes(sc.to_dict())
        run_hash = hashes[0]  # on its own device: the hash it is stored under
        if not in_shard(run_hash, shard):
            continue
        in_this_shard += 1
        if any(store.status(h) in FINISHED for h in hashes):
            skipped += 1
        else:
            todo.append((run_hash, sc))
    return todo, skipped, in_this_shard


Claim = Callable[[str, Scenario], bool]  # take a run in the store before starting it; False: someone has it


def _in_this_process(todo: Todo, claim: Claim, progress: bool, checkpointing: Checkpointing | None) -> Outcomes:
    for run_hash, sc in todo:
        if stop_requested():
            return
        if not claim(run_hash, sc):
            yield run_hash, sc, {"taken": True}
            continue
        with tqdm(total=sc.rounds, desc=f"{sc.norm} {sc.attacks_in_brief()}", unit="round",
                  leave=False, disable=not progress) as run_bar:
            out = _attempt(sc.to_dict(), run_hash, checkpointing, progress=lambda t: run_bar.update(t - run_bar.n))
        yield run_hash, sc, out


@dataclass
class _Worker:
    process: object
    conn: object
    task: tuple[str, Scenario] | None = None


# The worker processes kept between run_matrix calls inside `shared_workers`: {"key": (threads,
# search path), "workers": [...]}; None outside
_shared: dict | None = None


@contextmanager
def shared_workers() -> Iterator[None]:
    """Inside, run_matrix's local worker processes outlive each call: a command that runs several
    files, or tuning waves, spawns its workers once. Each spawn imports torch, loads the dataset
    (onto the GPU) and starts CUDA; a pool per file or wave also idles while its last runs end."""
    global _shared
    if _shared is not None:  # an outer scope owns them
        yield
        return
    _shared = {"key": None, "workers": []}
    try:
        yield
    finally:
        pool, _shared = _shared, None
        _close(pool["workers"])


def _close(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        w.process.join(timeout=10)
        if w.process.is_alive():
            w.process.kill()


def _pool(threads: int) -> list[_Worker]:
    """The workers to start from: those `shared_workers` kept, where they run as these would
    (the same torch threads and search path), else none (the kept ones are closed)."""
    if _shared is None:
        return []
    key = (threads, tuple(search_path()))
    if _shared["key"] != key:
        _close(_shared["workers"])
        _shared.update(key=key, workers=[])
    _drop_ended_idle(_shared["workers"])
    return _shared["workers"]


def _drop_ended_idle(workers: list[_Worker]) -> None:
    """Idle workers that ended (killed, out of memory, signalled) are dropped, not charged to
    the run sent next."""
    for w in [w for w in workers if w.task is None and not w.process.is_alive()]:
        workers.remove(w)
        w.process.join()
        w.conn.close()


def _in_processes(todo: Todo, claim: Claim, jobs: int, threads: int, checkpointing: Checkpointing | None,
                  died: Callable[[str, int | None], bool]) -> Outcomes:
    """`jobs` spawned worker processes of `threads` torch threads, one run each at a time. A
    worker that dies is replaced; `died(hash, exitcode)` says whether its run is retried (it
    resumes from its checkpoint). Inside `shared_workers`, the workers idle at the end are kept
    for the next call."""
    ctx = get_context("spawn")  # CUDA and forked processes do not mix

    def spawn() -> _Worker:
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_worker_main, args=(theirs, threads, search_path(), os.getpid()), daemon=True)
        # born ignoring SIGINT (kept across exec): a Ctrl-C while it imports cannot end it with a
        # traceback; _worker_main then turns SIGINT into a checkpointed stop
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, old)
        theirs.close()
        return _Worker(process, ours)

    queue, workers, forwarded = deque(todo), _pool(threads), False
    free = lambda: sum(w.task is not None for w in workers) < jobs
    try:
        while True:
            while not stop_requested() and queue and free():
                run_hash, sc = queue.popleft()
                if not claim(run_hash, sc):
                    yield run_hash, sc, {"taken": True}
                    continue
                _drop_ended_idle(workers)
                worker = next((w for w in workers if w.task is None), None)
                if worker is None:
                    worker = spawn()
                    workers.append(worker)
                try:
                    worker.conn.send((sc.to_dict(), run_hash, checkpointing))
                    worker.task = (run_hash, sc)
                except OSError:  # it died while idle or starting: as a death in the run
                    workers.remove(worker)
                    worker.process.join()
                    if died(run_hash, worker.process.exitcode):
                        queue.appendleft((run_hash, sc))
                    else:
                        yield run_hash, sc, {"error": f"its worker process died {MAX_ATTEMPTS} times "
                                                      f"({_death(worker.process.exitcode)})"}
            busy = [w for w in workers if w.task is not None]
            if not busy:
                return
            if stop_requested() and not forwarded:  # a terminal's Ctrl-C reached them already; kill(1) did not
                forwarded = True
                for w in busy:
                    try:
                        os.kill(w.process.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=1.0))
            for w in busy:
                if w.conn not in ready and w.process.sentinel not in ready:
                    continue
                try:
                    out = w.conn.recv() if w.conn.poll() else None
                except (EOFError, OSError):
                    out = None
                run_hash, sc = w.task
                w.task = None
                if out is None:  # the worker died mid-run
                    w.process.join()
                    workers.remove(w)
                    code = w.process.exitcode
                    if not stop_requested() and died(run_hash, code):
                        queue.appendleft((run_hash, sc))
                        continue
                    out = {"interrupted": stop_requested()} if stop_requested() else \
                        {"error": f"its worker process died {MAX_ATTEMPTS} times ({_death(code)})"}
                yield run_hash, sc, out
    finally:
        # kept only when every worker is idle and alive: a stop, or a caller that left mid-way, ends them
        _drop_ended_idle(workers)
        if _shared is None or _shared["workers"] is not workers or stop_requested() or \
                any(w.task is not None or not w.process.is_alive() for w in workers):
            _close(workers)
            workers.clear()


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"killed by {name}" + (": by the out-of-memory killer or kill -9" if name == "SIGKILL" else "")
    return f"exit code {exitcode}"


@dataclass
class RayOptions:
    address: str | None = None      # None: connect to the Ray instance this process has, or start a local one
    cpus_per_run: float = 1.0
    gpus_per_run: float = 0.0
    retries: int = 3                # re-runs of a task whose worker died (crash, kill, lost node): they resume


RAY_NICENESS = "RAY_worker_niceness"  # read by the raylet when it starts


@contextmanager
def ray_workers_at_normal_priority() -> Iterator[None]:
    """Around the start of a Ray instance on this machine (ray.init without an address, Flower's
    simulation runtime): its workers run at the priority of the process that starts them. Ray's
    default niceness for workers is 15, and beside any busy process they starve: a matrix took
    11-15x as long beside two to four (benchmarks/ray_priority.py). A user's own RAY_worker_niceness stands,
    and a cluster's workers are its own."""
    given = os.environ.get(RAY_NICENESS)
    os.environ[RAY_NICENESS] = given if given is not None else "0"
    try:
        yield
    finally:
        if given is None:
            os.environ.pop(RAY_NICENESS, None)


def _check_gpus(ray, opts: RayOptions, local: bool) -> None:
    """Tasks that ask for more GPUs than the cluster has would wait: refused on a lone Ray node of
    this machine that no --address or RAY_ADDRESS named (no GPU joins it later), said on a
    cluster (an autoscaler may add GPU nodes)."""
    if opts.gpus_per_run <= 0:
        return
    # a task's GPUs are all on one node: the largest node decides, not the cluster's total
    largest = max((node.get("Resources", {}).get("GPU", 0) for node in ray.nodes() if node.get("Alive", True)),
                  default=0)
    if largest >= opts.gpus_per_run:
        return
    total = ray.cluster_resources().get("GPU", 0)
    if local:
        raise ExecutorError(f"--gpus-per-run {opts.gpus_per_run:g}: the Ray instance of this machine has {total:g} "
                            f"GPUs; give the cluster's --address, or run on the CPU (--device cpu --gpus-per-run 0)")
    if total >= opts.gpus_per_run:
        print(f"robustbn: each run asks for {opts.gpus_per_run:g} GPUs, and the largest node of the Ray cluster has "
              f"{largest:g} ({total:g} in all): a run's GPUs must be on one node, so the runs wait until such a node "
              f"joins (or ask for fewer: --gpus-per-run 1)", file=sys.stderr)
        return
    print(f"robustbn: the Ray cluster has {total:g} GPUs now and each run asks for {opts.gpus_per_run:g}: the runs "
          f"wait until a GPU node joins", file=sys.stderr)


def _on_ray(todo: Todo, claim: Claim, opts: RayOptions, checkpointing: Checkpointing | None) -> Outcomes:
    try:
        import ray
    except ImportError:
        raise ExecutorError("--executor ray needs Ray, an optional extra: pip install 'robustbn[ray]'") from None
    if any(sc.device == "cuda" for _, sc in todo) and opts.gpus_per_run <= 0:
        raise ExecutorError("scenarios on cuda need --gpus-per-run > 0 with --executor ray "
                            "(e.g. 0.25 runs four at once on each GPU)")
    owns_connection = not ray.is_initialized()
    if owns_connection:
        with ray_workers_at_normal_priority() if opts.address is None else nullcontext():
            ray.init(address=opts.address, include_dashboard=False, log_to_driver=False)
    try:
        # a lone node of this machine, reached without --address or RAY_ADDRESS: the instance
        # ray.init started (or one `ray start` left here); no GPU node is on its way
        _check_gpus(ray, opts, local=owns_connection and opts.address is None and not os.environ.get("RAY_ADDRESS")
                    and len(ray.nodes()) == 1)
        # A task's own exceptions come back as {"error": ...} (deterministic: no retry); Ray
        # retries only tasks whose worker died, and a retried task resumes from its checkpoint.
        task = ray.remote(_run_as_ray_task).options(
            num_cpus=opts.cpus_per_run, num_gpus=opts.gpus_per_run, max_retries=opts.retries,
            retry_exceptions=False)
        threads = max(1, int(opts.cpus_per_run))
        waiting = {}
        for run_hash, sc in todo:
            if not claim(run_hash, sc):
                yield run_hash, sc, {"taken": True}
                continue
            waiting[task.remote(sc.to_dict(), threads, search_path(), run_hash, checkpointing)] = (run_hash, sc)
        while waiting:
            if stop_requested():  # the tasks keep their last checkpoints
                for ref, (run_hash, sc) in waiting.items():
                    ray.cancel(ref, force=True)
                    yield run_hash, sc, {"interrupted": stop_requested()}
                return
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    out = ray.get(ref)
                except Exception as e:  # the worker died more often than `retries`
                    out = {"error": f"{type(e).__name__}: {e}"}
                yield *waiting.pop(ref), out
    finally:
        if owns_connection:
            ray.shutdown()


class _Heartbeat:
    """Renews the driver's claims every LEASE_S / 4 seconds from a thread with its own
    connection, so that they expire only when the driver is gone."""

    def __init__(self, db: str | Path, owner: str):
        self.db, self.owner, self.stop = db, owner, threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self):
        while not self.stop.wait(LEASE_S / 4):
            try:
                with Store(self.db) as store:
                    store.renew(self.owner)
            except Exception:  # a busy or vanished store: the next beat tries again
                pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def sends_gpu_tasks(executor: str, gpus_per_run: float) -> bool:
    """Ray tasks given GPUs: each worker checks its own CUDA device when it builds its scenario,
    so the driver (a CPU-only head node, say) need have none."""
    return executor == "ray" and gpus_per_run > 0


def run_matrix(scenarios: list[Scenario], store: Store, source: str | Callable[[Scenario], str] = "", jobs: int = 1,
               device: str | None = None, progress: bool = True, executor: str = "local",
               shard: tuple[int, int] | None = None, ray_options: RayOptions | None = None,
               checkpoint_every: int | None = None, keep_checkpoints: bool = False) -> Summary:
    """Run the scenarios of `shard` (all by default) not yet finished in `store`, committing each
    outcome as it arrives. executor "local": in this process (jobs = 1) or in `jobs` spawned
    processes; "ray": one Ray task per scenario. Runs checkpoint every `checkpoint_every`
    rounds (None: every few minutes; 0: never) and resume from their checkpoints. On SIGINT or
    SIGTERM every run stops at its next round end, checkpointed, and Interrupted is raised
    once the outcomes are in. `source`: the file the runs come from, or a function giving a
    scenario's (runs of several files in one pool of workers)."""
    source_of = source if callable(source) else (lambda sc: source)
    with devices_checked_where_they_run() if sends_gpu_tasks(executor, (ray_options or RayOptions()).gpus_per_run) \
            else nullcontext():
        todo, skipped, total = pending(scenarios, store, device, shard)
    summary = Summary(total=total, skipped=skipped)
    clear_stop()
    if not todo:
        return summary
    owner = new_owner()
    # absolute: Ray's workers run elsewhere
    checkpointing = Checkpointing(str(store.path.resolve()), checkpoint_every, keep_checkpoints, owner)
    claim = lambda run_hash, sc: store.claim(run_hash, sc.to_dict(), source_of(sc), owner)

    deaths = Counter()

    def died(run_hash, exitcode):  # a local worker died: retried until MAX_ATTEMPTS starts
        deaths[run_hash] += 1
        return deaths[run_hash] < MAX_ATTEMPTS

    if executor == "ray":
        outcomes = _on_ray(todo, claim, ray_options or RayOptions(), checkpointing)
    elif executor == "local":
        # each worker's threads follow --jobs, not how many runs are left: the same command runs
        # each run with the same threads, and a short call keeps a shared pool
        threads = max(1, (os.cpu_count() or 1) // jobs)
        jobs = min(jobs, len(todo))
        outcomes = _in_this_process(todo, claim, progress, checkpointing) if jobs <= 1 else \
            _in_processes(todo, claim, jobs, threads, checkpointing, died)
    else:
        raise ExecutorError(f"executor must be 'local' or 'ray', got {executor!r}")
    restore = install_stop_handlers() if threading.current_thread() is threading.main_thread() else (lambda: None)
    try:
        with _Heartbeat(store.path, owner), tqdm(total=len(todo), desc="matrix", unit="run",
                                                disable=not progress) as bar:
            for run_hash, sc, out in outcomes:
                if "ok" in out:
                    store.finish(run_hash, sc.to_dict(), source=source_of(sc), **out["ok"])
                    checkpointing.done_with(run_hash)
                    summary.done += 1
                    summary.resumed += out["ok"]["resumed_from"] is not None
                elif "error" in out:
                    store.fail(run_hash, out["error"])
                    summary.failed.append((run_hash, out.get("brief") or out["error"].strip().splitlines()[-1]))
                elif "taken" in out:
                    summary.taken += 1
                else:
                    store.release(owner, run_hash)
                    summary.interrupted += 1
                bar.update(1)
    finally:
        outcomes.close()  # the executor's own cleanup now (its workers: kept idle, or ended), not at collection
        store.release(owner)  # runs not finished here: claimable at once by the next `robustbn run`
        restore()
    signum = stop_requested()
    clear_stop()
    if signum:
        raise Interrupted(signum, summary)
    return summary
