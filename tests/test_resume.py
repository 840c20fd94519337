"""Runs that survive: checkpoints and resume (bit for bit), kill -9 of a run, of a worker and of
the driver, SIGINT and SIGTERM, and several processes sharing one store."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from robustbn import checkpoint as ckpt
from robustbn.checkpoint import Checkpointer, Interrupted, checkpoint_dir, clear_stop, request_stop
from robustbn.runner import run
from robustbn.scenario import Scenario
from robustbn.store import Store

from matrices import TINY_RUN

SMALL = dict(dataset="synthetic-images", model="simple-cnn", partition="iid", n=5, f=1, rounds=6, batch_size=8,
             eval_every=2, lr=0.05, seed=3)
# each draws randomness or keeps state a resume must restore: random attacks and rules (their
# own generators), dropout (torch's global one), partial participation, worker and local
# momenta, client-local statistics and parameters, label flipping, the root set, a client
# filter, FixBN's switch, FedTAN's statistics pooled in the forward
CONFIGS = {
    "fbn-random-rules": dict(momentum=0.5, grad_attack="gaussian", grad_agg="bucketing+median", bn_attack="sf",
                             bn_agg="nnm+median"),
    "cnn-dropout-fedavg-hbn": dict(model="cnn", norm="hbn", algorithm="fedavg", participation=0.5, local_steps=2,
                                   momentum=0.9, grad_attack="alie", grad_agg="trmean", bn_attack="gaussian",
                                   bn_agg="median"),
    "fedbn-labelflip": dict(norm="fedbn", momentum=0.9, grad_attack="labelflip", grad_agg="cc"),
    "fltrust-bnguard": dict(grad_attack="sf", grad_agg="fltrust", root_size=20, bn_attack="sf",
                            client_filter="bnguard"),
    "fixbn-switch": dict(norm="fixbn", fixbn_switch=3, grad_attack="foe", grad_agg="nnm+krum", bn_attack="honest"),
    "fedtan": dict(norm="fedtan", grad_attack="ipm", grad_agg="median", bn_attack="sf", bn_agg="median"),
}


def _interrupted_at(sc, k: int, path: Path) -> None:
    """Run `sc` until round k, as if SIGTERM arrived then: the checkpoint is written."""
    def at(t):
        if t == k:
            request_stop(signal.SIGTERM)
    try:
        with pytest.raises(Interrupted):
            run(sc, progress=at, checkpoint=Checkpointer(path, "h", every=0 if k % 2 else 1000))
    finally:
        clear_stop()


@pytest.mark.parametrize("name", CONFIGS)
def test_resuming_at_every_round_gives_the_uninterrupted_history(name, tmp_path):
    """Checkpoint completeness: stopped at any round and resumed, a run ends as it would have."""
    sc = Scenario.from_dict({**SMALL, **CONFIGS[name]})
    whole = run(sc)
    for k in range(1, sc.rounds):
        path = tmp_path / f"{k}.pt"
        _interrupted_at(sc, k, path)
        assert torch_load(path)["round"] == k
        resumed = run(sc, checkpoint=Checkpointer(path, "h", every=0))
        assert resumed.extra["resumed_from"] == k
        assert resumed.history == whole.history, f"resumed at round {k}"
        assert resumed.bn_stats == whole.bn_stats


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["fbn-random-rules", "cnn-dropout-fedavg-hbn"])
def test_resuming_on_cuda_gives_the_uninterrupted_history(name, tmp_path):
    """On a GPU: the CUDA generators (dropout, the rules' own) are in the checkpoint too."""
    sc = Scenario.from_dict({**SMALL, **CONFIGS[name], "device": "cuda"})
    whole = run(sc)
    for k in (1, 4):
        _interrupted_at(sc, k, tmp_path / f"{k}.pt")
        assert run(sc, checkpoint=Checkpointer(tmp_path / f"{k}.pt", "h", every=0)).history == whole.history


def torch_load(path):
    import torch
    return torch.load(path, weights_only=True)


def test_a_checkpoint_without_the_components_state_resumes_differently(tmp_path, monkeypatch):
    """The comparison above can fail: drop what the walk finds in the attacks and rules (their
    generators) and the resumed run draws other noise."""
    sc = Scenario.from_dict({**SMALL, **CONFIGS["fbn-random-rules"]})
    whole = run(sc)
    monkeypatch.setattr(ckpt, "component_state", lambda root: {})
    _interrupted_at(sc, 3, tmp_path / "c.pt")
    assert run(sc, checkpoint=Checkpointer(tmp_path / "c.pt", "h", every=0)).history != whole.history


def test_the_walk_finds_a_users_state_and_lazily_made_generators():
    """A user's rule with memory (a tensor, a counter) and a generator made on first use are
    checkpointed without any code for them."""
    import torch

    from aggregators.base import device_generator
    obj = type("Rule", (), {})()
    obj.memory, obj.count, obj.cache = torch.arange(3.0), 7, {}
    device_generator(obj.cache, 5, torch.device("cpu")).manual_seed(5)
    torch.rand(4, generator=obj.cache[torch.device("cpu")])
    state = ckpt.component_state({"rule": obj})
    fresh = type("Rule", (), {})()
    fresh.memory, fresh.count, fresh.cache = torch.zeros(3), 0, {}
    ckpt.load_component_state({"rule": fresh}, state)
    assert fresh.count == 7 and torch.equal(fresh.memory, obj.memory)
    g = fresh.cache[torch.device("cpu")]  # made by the restore, with the state the original had
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=obj.cache[torch.device("cpu")]))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "foreign-format", "other-run"])
def test_an_unusable_checkpoint_warns_in_one_line_and_the_run_starts_over(damage, tmp_path, capsys):
    sc = Scenario.from_dict({**SMALL, **CONFIGS["fbn-random-rules"]})
    path = tmp_path / "c.pt"
    _interrupted_at(sc, 3, path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "garbage":
        path.write_bytes(os.urandom(500))
    else:
        import torch
        state = torch_load(path)
        state["format" if damage == "foreign-format" else "hash"] = 99 if damage == "foreign-format" else "x"
        torch.save(state, path)
    result = run(sc, checkpoint=Checkpointer(path, "h", every=0))
    assert result.extra["resumed_from"] is None and result.history == run(sc).history
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ignoring the checkpoint" in err[0] and "starts over" in err[0]


def test_a_folder_in_the_checkpoints_place_costs_a_warning_not_the_run(tmp_path, capsys):
    sc = Scenario.from_dict({**SMALL, **CONFIGS["fbn-random-rules"]})
    (tmp_path / "c.pt").mkdir()
    result = run(sc, checkpoint=Checkpointer(tmp_path / "c.pt", "h", every=2))
    assert result.history == run(sc).history and result.extra["resumed_from"] is None
    err = capsys.readouterr().err
    assert "not a regular file" in err and "could not write the checkpoint" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left behind


# ---- real processes ---------------------------------------------------------------------

LONG_ROUNDS = 120  # long enough to be killed at round 60 (checkpoints every 10) with rounds left
LONG = TINY_RUN.replace("n = 4", "n = 6").replace("rounds = 6", f"rounds = {LONG_ROUNDS}").replace(
    "eval_every = 3", "eval_every = 25") + """
norm = "fbn"
f = 1
grad_attack = "gaussian"
grad_agg = "bucketing+median"
bn_attack = "sf"
bn_agg = "median"
momentum = 0.5
"""


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch):
    """The runs these tests start are compared bit for bit across --jobs 1 (the driver's torch
    threads) and --jobs 2 (a worker's one): one thread each, as under ./dev.sh test's workers,
    also where pytest runs alone on a machine of several cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "robustbn.cli", *map(str, args)]


def start(args, **kw) -> subprocess.Popen:
    return subprocess.Popen(cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def rows(db) -> dict:
    """hash -> (status, rounds_done, resumed_from, history), read-only."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as con:
            return {h: (s, r, f, json.loads(hist or "[]")) for h, s, r, f, hist in
                    con.execute("SELECT hash, status, rounds_done, resumed_from, history FROM runs")}
    except sqlite3.Error:
        return {}


def wait_for(predicate, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def progressed(db, rounds):
    return lambda: any(s == "running" and (r or 0) >= rounds for s, r, _, _ in rows(db).values())


def histories(db) -> dict:
    return {h: (s, hist) for h, (s, _, _, hist) in rows(db).items()}


def children(pid: int) -> list[int]:
    """The worker processes of a driver (not multiprocessing's resource tracker)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [int(c) for c in path.read_text().split()] if path.exists() else []
    def is_worker(c):
        try:
            return b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            return False
    return [c for c in pids if is_worker(c)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted runs of LONG (two seeds), made once for every pytest-xdist worker (the
    first to come runs them, under a lock); --jobs 1 and 2 give the same histories
    (test_matrix_store_cli), so one run serves both."""
    import fcntl
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, under xdist
    d = shared / "resume-reference"
    with open(shared / "resume-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / "done").exists():
            d.mkdir(exist_ok=True)
            (d / "m.toml").write_text(LONG + "seed = [0, 1]\n")
            subprocess.run(cli("run", d / "m.toml", "--db", d / "runs.sqlite", "--quiet", "--jobs", 2), check=True)
            (d / "done").touch()
    expected = histories(d / "runs.sqlite")
    return d / "m.toml", {1: expected, 2: expected}


@pytest.mark.parametrize("jobs", [1, 2])
def test_kill_9_mid_run_then_the_same_command_resumes_bit_for_bit(jobs, reference, tmp_path):
    matrix, expected = reference
    db = tmp_path / "s.sqlite"
    args = ("run", matrix, "--db", db, "--quiet", "--jobs", jobs, "--checkpoint-every", 10)
    p = start(args)
    wait_for(progressed(db, 60))
    workers = children(p.pid)
    assert len(workers) == (0 if jobs == 1 else jobs)
    os.kill(p.pid, signal.SIGKILL)  # the driver only: its workers must notice and go
    p.wait()
    wait_for(lambda: not any(alive(w) for w in workers), timeout=10)
    cut = rows(db)
    assert any(s == "running" and r >= 60 for s, r, _, _ in cut.values())  # the store says how far it got
    assert list((checkpoint_dir(db)).glob("*.pt"))
    done = subprocess.run(cli(*args), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resumed from checkpoints" in done.stdout
    assert histories(db) == expected[jobs]
    resumed = [f for _, _, f, _ in rows(db).values() if f is not None]
    assert resumed and max(resumed) >= 60
    assert not list(checkpoint_dir(db).glob("*.pt"))  # removed once the runs finished


def test_a_killed_worker_is_replaced_and_its_run_resumes(reference, tmp_path):
    matrix, expected = reference
    db = tmp_path / "s.sqlite"
    p = start(("run", matrix, "--db", db, "--quiet", "--jobs", 2, "--checkpoint-every", 10))
    wait_for(progressed(db, 60))
    victim = children(p.pid)[0]
    os.kill(victim, signal.SIGKILL)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert "Traceback" not in err and "2 ran" in out
    assert histories(db) == expected[2]
    assert any(f is not None for _, _, f, _ in rows(db).values())  # the killed worker's run resumed


@pytest.mark.parametrize("how, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_sigint_and_sigterm_checkpoint_and_exit_cleanly(how, code, reference, tmp_path):
    """SIGTERM (kill, Slurm's preemption) to one process running a run: it checkpoints at the
    round it stopped (no periodic checkpoint before it); Ctrl-C (SIGINT to the whole process
    group) with --jobs 2 stops both workers' runs, checkpointed."""
    matrix, expected = reference
    db = tmp_path / "s.sqlite"
    jobs, every = (2, 10) if how == "SIGINT" else (1, 1000)
    args = ("run", matrix, "--db", db, "--quiet", "--jobs", jobs, "--checkpoint-every", every)
    p = start(args)
    if jobs == 1:
        wait_for(lambda: any(s == "running" for s, _, _, _ in rows(db).values()))
        time.sleep(3)  # mid-run, no checkpoint yet
    else:  # both workers under way
        wait_for(lambda: sum(s == "running" and (r or 0) >= 10 for s, r, _, _ in rows(db).values()) == 2)
    if how == "SIGINT":  # a terminal's Ctrl-C: the whole process group
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code
    assert "Traceback" not in err and f"stopped by {how}" in err
    stopped = {h: r for h, (s, r, _, _) in rows(db).items() if s == "running"}
    assert len(stopped) == jobs and all(r is not None and 0 < r < LONG_ROUNDS for r in stopped.values())
    done = subprocess.run(cli(*args), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert histories(db) == expected[jobs]
    assert all(f == stopped[h] for h, (_, _, f, _) in rows(db).items() if h in stopped)  # resumed where stopped


def test_two_invocations_on_one_store_run_each_run_once(tmp_path):
    (tmp_path / "m.toml").write_text(LONG.replace(f"rounds = {LONG_ROUNDS}", "rounds = 40") + "seed = [0, 1, 2, 3]\n")
    db = tmp_path / "s.sqlite"
    args = ("run", tmp_path / "m.toml", "--db", db, "--quiet")
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # two processes on two cores, not oversubscribed
    procs = [start(args, env=one_thread) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ran = [int(out.split(" ran")[0].split()[-1]) for out, _ in outs]
    assert sum(ran) == 4, outs  # each run executed by exactly one of them
    assert {s for s, _ in histories(db).values()} == {"done"} and len(histories(db)) == 4


def test_a_claim_never_demotes_a_finished_run_and_waits_for_a_live_owner(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    done = dict(history=[{"round": 1, "test_acc": 0.5, "test_loss": 1.0}], bn_stats={}, wall_time_s=1.0, device="cpu")
    assert store.claim("x", {"k": 1}, owner="a")
    store.finish("x", {"k": 1}, **done)
    assert not store.claim("x", {"k": 1}, owner="b") and store.status("x") == "done"
    assert store.claim("y", {"k": 2}, owner="elsewhere:1:a")       # another host's live claim
    assert not store.claim("y", {"k": 2}, owner="b")
    assert store.claim("y", {"k": 2}, owner="elsewhere:1:a")       # its owner may claim again
    store.db.execute("UPDATE runs SET lease_until = 0 WHERE hash = 'y'")
    store.db.commit()
    assert store.claim("y", {"k": 2}, owner="b")                   # the lease expired
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket
    assert store.claim("z", {"k": 3}, owner=f"{socket.gethostname()}:{dead.pid}:x")
    store.db.execute("UPDATE runs SET lease_until = 1e12 WHERE hash = 'z'")
    store.db.commit()
    assert store.claim("z", {"k": 3}, owner="b")                   # a dead process of this host
    store.close()


def test_a_diverged_run_is_marked_and_exports_strict_json(tmp_path):
    (tmp_path / "m.toml").write_text(TINY_RUN + 'norm = "fbn"\nlr = 1e30\n')
    db = tmp_path / "s.sqlite"
    assert subprocess.run(cli("run", tmp_path / "m.toml", "--db", db, "--quiet")).returncode == 0
    ((status, _, _, history),) = rows(db).values()
    assert status == "diverged"
    assert history[-1]["test_loss"] is None  # no NaN stored as a number
    out = subprocess.run(cli("results", "--db", db, "--format", "json"), capture_output=True, text=True).stdout
    def reject(token):
        raise ValueError(token)
    (row,) = json.loads(out, parse_constant=reject)
    assert row["status"] == "diverged" and row["final_acc"] is None
