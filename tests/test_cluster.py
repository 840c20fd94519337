"""Scaling out: shards of a matrix, merging stores, and the Ray executor (on a local Ray
instance bound to loopback)."""

import contextvars
import os
import signal
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from robustbn.cli import main
from robustbn.execute import RayOptions, in_shard, run_matrix
from robustbn.matrix import load
from robustbn.store import Store, scenario_hash

from matrices import TINY_RUN, torch_threads

TINY = TINY_RUN + """norm = ["naive", "fbn"]
f = 1
bn_attack = "sf"
bn_agg = ["mean", "median"]
seed = [0, 1]
"""


def write(tmp_path, text=TINY):
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


@pytest.fixture
def one_thread():
    """Ray tasks run with --cpus-per-run = 1 thread, so the local side does too."""
    with torch_threads(1):
        yield


def histories(db) -> dict:
    store = Store(db)
    out = {r["hash"]: (r["status"], r["history"]) for r in store.rows()}
    store.close()
    return out


@given(st.lists(st.text(min_size=1), min_size=1, max_size=40, unique=True), st.integers(1, 7))
def test_shards_are_disjoint_and_cover_every_run(names, count):
    hashes = [scenario_hash({"name": name}) for name in names]
    owners = [[i for i in range(count) if in_shard(h, (i, count))] for h in hashes]
    assert all(len(o) == 1 for o in owners)  # each run in exactly one shard


def test_shards_then_merge_equal_one_local_run_bit_for_bit(tmp_path, capsys):
    matrix = write(tmp_path)
    assert main(["run", str(matrix), "--db", str(tmp_path / "all.sqlite"), "--quiet"]) == 0
    shards = [tmp_path / f"shard{i}.sqlite" for i in range(3)]
    for i, db in enumerate(shards):
        assert main(["run", str(matrix), "--db", str(db), "--quiet", "--shard", f"{i}/3"]) == 0
    parts = [set(histories(db)) for db in shards]
    assert sum(map(len, parts)) == 8 and set().union(*parts) == set(histories(tmp_path / "all.sqlite"))
    capsys.readouterr()
    assert main(["merge", "--db", str(tmp_path / "merged.sqlite"), *map(str, shards)]) == 0
    assert "8 runs in" in capsys.readouterr().out
    assert histories(tmp_path / "merged.sqlite") == histories(tmp_path / "all.sqlite")
    # merging again adds nothing: deduplicated by run hash
    assert main(["merge", "--db", str(tmp_path / "merged.sqlite"), str(shards[0])]) == 0
    assert "0 added" in capsys.readouterr().out
    with sqlite3.connect(tmp_path / "merged.sqlite") as con:
        assert con.execute("SELECT count(*), count(DISTINCT hash) FROM runs").fetchone() == (8, 8)


def test_merge_keeps_finished_runs_and_replaces_unfinished_ones(tmp_path):
    a, b = Store(tmp_path / "a.sqlite"), Store(tmp_path / "b.sqlite")
    done = dict(history=[{"round": 1, "test_acc": 0.5, "test_loss": 1.0}], bn_stats={}, wall_time_s=1.0, device="cpu")
    a.start("x", {"k": 1}); a.finish("x", {"k": 1}, **done)
    a.start("y", {"k": 2})                                  # unfinished in a
    b.start("x", {"k": 1})                                  # unfinished in b: must not replace a's
    b.start("y", {"k": 2}); b.finish("y", {"k": 2}, **done)
    b.start("z", {"k": 3}); b.fail("z", "boom")
    b.close()
    assert a.merge(tmp_path / "b.sqlite") == {"added": 1, "replaced": 1, "kept": 1, "differing": 0}
    assert {r["hash"]: r["status"] for r in a.rows()} == {"x": "done", "y": "done", "z": "failed"}
    a.close()


def test_cluster_errors_are_one_line_and_exit_2(tmp_path, capsys):
    matrix = write(tmp_path)
    db = str(tmp_path / "r.sqlite")
    for args, says in [(["--shard", "3/3"], "0 <= I < N"), (["--shard", "a/b"], "I/N with integers"),
                       (["--shard", "0/0"], "N >= 1"),
                       (["--executor", "ray", "--jobs", "2"], "--cpus-per-run"),
                       (["--address", "auto"], "--executor ray")]:
        assert main(["run", str(matrix), "--db", db, "--quiet", *args]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    (tmp_path / "junk.sqlite").write_text("not a database")
    sqlite3.connect(tmp_path / "empty.sqlite").execute("CREATE TABLE t (a)").connection.commit()
    for source, says in [("junk.sqlite", "cannot read"), ("empty.sqlite", "not a robustbn results store"),
                         ("missing.sqlite", "no results store")]:
        assert main(["merge", "--db", db, str(tmp_path / source)]) == 2
        assert says in capsys.readouterr().err
    assert main(["merge", "--db", db, db]) == 2 and "different target" in capsys.readouterr().err
    assert not any(histories(db).values())  # nothing written by any of them


def test_ray_executor_without_ray_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["run", str(write(tmp_path)), "--db", str(tmp_path / "r.sqlite"), "--quiet", "--executor", "ray"]) == 2
    assert "pip install 'robustbn[ray]'" in capsys.readouterr().err


class _RayStandIn:
    """Just enough of Ray's API for the driver: each task "runs on a worker" when its result is
    asked for, in this process but in a fresh context, and is recorded with the resources it
    asked for."""

    def __init__(self, node_gpus: tuple[float, ...] = (0,)):
        self.tasks, self.node_gpus = [], node_gpus

    def cluster_resources(self):
        gpus = sum(self.node_gpus)
        return {"CPU": 2.0 * len(self.node_gpus), **({"GPU": gpus} if gpus else {})}

    def nodes(self):
        return [{"NodeManagerAddress": "127.0.0.1", "Alive": True, "Resources": {"CPU": 2.0, **({"GPU": g} if g else {})}}
                for g in self.node_gpus]
    def is_initialized(self): return False
    def init(self, **kw): pass
    def shutdown(self): pass
    def cancel(self, ref, force=False): pass
    def wait(self, refs, num_returns=1, timeout=None): return refs[:1], refs[1:]
    def get(self, ref): return ref()

    def remote(self, fn):
        ray = self

        class Task:
            def options(self, **resources):
                self.resources = resources
                return self

            def remote(self, *args):
                ray.tasks.append((args[0], self.resources))
                return lambda: contextvars.Context().run(fn, *args)  # a worker: none of the driver's context
        return Task()


def test_a_cpu_only_head_sends_cuda_runs_to_gpu_workers_which_check_their_own(tmp_path, capsys, monkeypatch):
    """With --gpus-per-run > 0 the driver need have no GPU: each run goes out on cuda, and the
    worker that builds it checks its device (here a worker without CUDA, whose runs fail)."""
    import sys

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = _RayStandIn(node_gpus=(2,))
    monkeypatch.setitem(sys.modules, "ray", ray)
    matrix, db = str(write(tmp_path)), str(tmp_path / "r.sqlite")
    cluster = ["--executor", "ray", "--address", "head:6379", "--device", "cuda"]
    assert main(["run", matrix, "--db", db, "--quiet", *cluster]) == 2
    assert "needs --gpus-per-run > 0" in capsys.readouterr().err and not ray.tasks
    assert main(["run", matrix, "--db", db, "--quiet", *cluster, "--gpus-per-run", "0.5"]) == 1
    assert len(ray.tasks) == 8
    assert all(values["device"] == "cuda" and resources["num_gpus"] == 0.5 for values, resources in ray.tasks)
    err = capsys.readouterr().err
    assert err.count("CUDA is not available on this machine") == 8 and "Traceback" not in err
    assert {status for status, _ in histories(db).values()} == {"failed"}
    # two GPUs in all, but one a node: a run asking for two waits for a node that has them
    ray.node_gpus, ray.tasks = (1, 1), []
    assert main(["run", matrix, "--db", str(tmp_path / "split.sqlite"), "--quiet", *cluster,
                 "--gpus-per-run", "2"]) == 1
    assert "the largest node of the Ray cluster has 1 (2 in all)" in capsys.readouterr().err and len(ray.tasks) == 8
    # a cluster without a GPU now: said, and the runs wait for one (an autoscaler may add it)
    ray.node_gpus, ray.tasks = (0,), []
    assert main(["run", matrix, "--db", str(tmp_path / "wait.sqlite"), "--quiet", *cluster,
                 "--gpus-per-run", "0.5"]) == 1
    assert "the Ray cluster has 0 GPUs now" in capsys.readouterr().err and len(ray.tasks) == 8
    # a Ray instance of this machine, which has none: refused, nothing sent
    ray.tasks = []
    assert main(["run", matrix, "--db", str(tmp_path / "none.sqlite"), "--quiet", "--executor", "ray",
                 "--device", "cuda", "--gpus-per-run", "0.5"]) == 2
    assert "the Ray instance of this machine has 0 GPUs" in capsys.readouterr().err and not ray.tasks
    # ... unless RAY_ADDRESS names a cluster (a job Ray submitted): said, and sent
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert main(["run", matrix, "--db", str(tmp_path / "job.sqlite"), "--quiet", "--executor", "ray",
                 "--device", "cuda", "--gpus-per-run", "0.5"]) == 1
    assert "the Ray cluster has 0 GPUs now" in capsys.readouterr().err and len(ray.tasks) == 8
    monkeypatch.delenv("RAY_ADDRESS")
    # without Ray, this machine is where the runs run: refused before anything is stored
    assert main(["run", matrix, "--db", str(tmp_path / "local.sqlite"), "--quiet", "--device", "cuda"]) == 2
    assert "CUDA is not available on this machine; use --device cpu" in capsys.readouterr().err


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this machine only: every Ray socket on 127.0.0.1 (conftest sets
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before any test imports ray, which makes Ray pick the
    loopback address, as it does on macOS and Windows)."""
    ray = pytest.importorskip("ray")
    from robustbn.execute import ray_workers_at_normal_priority
    with ray_workers_at_normal_priority():  # as robustbn's own local instance
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    node, = ray.nodes()
    # the fields _check_gpus reads (ray.nodes is a DeveloperAPI)
    assert node["NodeManagerAddress"] == "127.0.0.1" and node["Alive"] and node["Resources"]["CPU"] == 2
    yield ray
    ray.shutdown()


def test_ray_workers_of_a_local_instance_run_at_the_starting_process_priority(local_ray, monkeypatch):
    """Ray's default worker niceness is 15 (a run beside busy processes starves): robustbn's
    local instances start theirs at the driver's, unless the user set RAY_worker_niceness."""
    from robustbn.execute import RAY_NICENESS, ray_workers_at_normal_priority
    assert local_ray.get(local_ray.remote(lambda: os.nice(0)).remote()) == os.nice(0)
    monkeypatch.delenv(RAY_NICENESS, raising=False)
    with ray_workers_at_normal_priority():
        assert os.environ[RAY_NICENESS] == "0"
    assert RAY_NICENESS not in os.environ
    monkeypatch.setenv(RAY_NICENESS, "7")
    with ray_workers_at_normal_priority():
        assert os.environ[RAY_NICENESS] == "7"
    assert os.environ[RAY_NICENESS] == "7"


def test_ray_executor_gives_the_local_results_bit_for_bit(tmp_path, local_ray, capsys, one_thread):
    matrix = str(write(tmp_path))
    assert main(["run", matrix, "--db", str(tmp_path / "local.sqlite"), "--quiet"]) == 0
    assert main(["run", matrix, "--db", str(tmp_path / "ray.sqlite"), "--quiet", "--executor", "ray"]) == 0
    assert "8 runs: 8 ran" in capsys.readouterr().out
    assert histories(tmp_path / "ray.sqlite") == histories(tmp_path / "local.sqlite")


def _kill_first_task_worker(killed: list, stop: threading.Event, db: Path) -> None:
    """SIGKILL a Ray worker running a robustbn task (Ray titles it ray::<function>) as soon as
    every running run has checkpointed, so the retried task has a checkpoint to resume. The
    workers are found while the runs reach their first checkpoint and the kill comes right
    after it, most of a run ahead of its end: a loaded machine must not finish the runs first."""
    def checkpointed() -> bool:
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as con:
                running = [done for (done,) in con.execute("SELECT rounds_done FROM runs WHERE status = 'running'")]
        except sqlite3.Error:
            return False
        return bool(running) and min(done or 0 for done in running) >= 10

    def runs_a_task(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::_run_as_ray_task")
        except OSError:  # the process is gone
            return False

    workers = []
    while not stop.is_set() and not killed:
        workers = workers or [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if runs_a_task(int(pid))]
        if workers and checkpointed():
            for pid in filter(runs_a_task, workers):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
                return
            workers = []  # their tasks ended: look again
        time.sleep(0.01)


def test_ray_retries_a_killed_task_which_resumes_and_stores_each_run_once(tmp_path, local_ray, one_thread):
    long_runs = TINY.replace("rounds = 6", "rounds = 120").replace("eval_every = 3", "eval_every = 60")
    _, scenarios = load(write(tmp_path, long_runs), ["norm=fbn", "bn_agg=median"])  # 2 runs (seeds)
    killed, stop = [], threading.Event()
    killer = threading.Thread(target=_kill_first_task_worker, args=(killed, stop, tmp_path / "ray.sqlite"))
    killer.start()
    store = Store(tmp_path / "ray.sqlite")
    try:
        summary = run_matrix(scenarios, store, progress=False, executor="ray", ray_options=RayOptions(retries=2),
                             checkpoint_every=10)
    finally:
        stop.set()
        killer.join()
    store.close()
    assert killed, "no Ray task was seen running"
    assert summary.done == 2 and not summary.failed
    assert summary.resumed >= 1  # the retried task went on from its checkpoint
    with sqlite3.connect(tmp_path / "ray.sqlite") as con:
        assert con.execute("SELECT count(*), count(DISTINCT hash), min(status), max(status) FROM runs").fetchone() \
            == (2, 2, "done", "done")
    local = Store(tmp_path / "local.sqlite")
    run_matrix(scenarios, local, progress=False)
    local.close()
    assert histories(tmp_path / "ray.sqlite") == histories(tmp_path / "local.sqlite")
