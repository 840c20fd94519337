"""examples/flower as Flower users run it: `flwr run` on the Flower App (its pyproject's
[tool.flwr.app]), in the Simulation Runtime and under the Deployment Runtime (a SuperLink and
SuperNodes as real processes on loopback ports), through a connection in a Flower
Configuration under a temporary FLWR_HOME. Two rounds of RobustStrategy with one node of
three or four flipping its labels, on synthetic images; every process started is stopped,
pass or fail."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

pytest.importorskip("flwr")

APP = Path(__file__).resolve().parent.parent / "examples" / "flower"
BIN = Path(sys.executable).parent  # flwr, flower-superlink, flower-supernode, flower-superexec
SMALL = "num-server-rounds=2 byzantine=1 data-dir='' per-client=192 test-size=300 batch-size=32"


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


class Processes:
    """The Flower processes a test starts, each in its own session; `stop` ends them and
    every process they started (SuperExec, ServerApp, ClientApps: their own sessions too)."""

    def __init__(self, home: Path):
        self.home, self.started = home, []
        self.env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": ""}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "w")
        process = subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=log, stderr=subprocess.STDOUT,
                                   env=self.env, cwd=self.home, start_new_session=True)
        log.close()
        self.started.append(process)
        return process

    def stop(self, only: subprocess.Popen | None = None, signals=(signal.SIGTERM, signal.SIGKILL)) -> None:
        """End the processes started (or `only` that one) and all their descendants."""
        started = [only] if only else self.started
        tree, todo, everyone = _children(), [p.pid for p in started], []
        while todo:
            pid = todo.pop()
            everyone.append(pid)
            todo += tree.get(pid, [])
        for sig in signals:
            for pid in everyone:
                try:
                    os.killpg(os.getpgid(pid), sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(p.poll() is None for p in started):
                time.sleep(0.1)
        for p in started:
            p.wait(timeout=5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.home.glob("*.log")))


@pytest.fixture
def flower_home(tmp_path):
    """FLWR_HOME for one test (a user's ~/.flwr is never read or written) and the processes it starts."""
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.stop()


def wait_for_superlink(port: int, processes: Processes, limit: float = 60.0) -> None:
    import httpx
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if processes.started[0].poll() is not None:
            pytest.fail(f"flower-superlink exited with {processes.started[0].returncode}\n{processes.logs()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"flower-superlink did not answer on 127.0.0.1:{port} within {limit:.0f} s\n{processes.logs()}")


def flwr_run(processes: Processes, port: int, run_config: str, *extra: str, meanwhile=None) -> tuple[list, str]:
    """`flwr run` of the example against the SuperLink on `port`, named in the Flower
    Configuration (`meanwhile()` called every 0.2 s while it runs): the ServerApp's
    per-round results and the run's streamed log."""
    (processes.home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    result, log = processes.home / "result.json", processes.home / "flwr-run.log"
    with open(log, "w") as out:
        run = subprocess.Popen([str(BIN / "flwr"), "run", str(APP), "test", "--stream", "--run-config",
                                f"{SMALL} {run_config} result-file='{result}'", *extra],
                               env=processes.env, cwd=processes.home, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    processes.started.append(run)
    deadline = time.monotonic() + 420  # a round may wait out its timeout
    while run.poll() is None and time.monotonic() < deadline:
        if meanwhile:
            meanwhile()
        time.sleep(0.2)
    assert run.poll() == 0 and result.exists(), f"flwr run: {run.poll()}\n{processes.logs()}"
    return json.loads(result.read_text())["rounds"], log.read_text()


def check_rounds(rounds: list[dict]) -> None:
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(math.isfinite(r["accuracy"]) and 0 <= r["accuracy"] <= 1 for r in rounds)
    assert rounds[-1]["accuracy"] > 0.2, rounds  # chance is 0.1: the global model learned under label flipping


@pytest.mark.slow
def test_flwr_run_in_the_simulation_runtime(flower_home):
    """What `flwr run .` does with the default local connection (flwr 1.42 starts a SuperLink in
    simulation mode), with the SuperLink started here on a free port."""
    port = free_port()
    flower_home.start("superlink", "flower-superlink", "--insecure", "--simulation",
                      "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port))
    wait_for_superlink(port, flower_home)
    rounds, _ = flwr_run(flower_home, port, "num-clients=4 fraction-evaluate=0.0 round-timeout=120.0",
                         "--federation-config", "num-supernodes=4 client-resources-num-cpus=1")
    check_rounds(rounds)


@pytest.mark.slow
def test_flwr_run_against_a_superlink_and_supernodes_one_dying_mid_round(flower_home):
    """The Deployment Runtime on localhost: flower-superlink --insecure, four flower-supernode
    --insecure --node-config "partition-id=I num-partitions=4" (the last flips its labels),
    then flwr run; SuperNode 2 is killed, with its ClientApp, once round 2's train message
    reached it. The server waits until the SuperLink, missing the node's heartbeats, answers
    for it (or the round's timeout), aggregates the three replies it got with one log line
    saying so, and finishes the run. The timeout is long: on a loaded machine the ClientApps'
    first start (torch's import) took round 1 past 45 s, and a round without replies keeps
    the model."""
    port = free_port()
    flower_home.start("superlink", "flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                      "--host", "127.0.0.1", "--port", str(port))
    wait_for_superlink(port, flower_home)
    nodes = [flower_home.start(f"supernode{i}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                               "--host", "127.0.0.1", "--port", str(free_port()),
                               "--node-config", f"partition-id={i} num-partitions=4") for i in range(4)]
    log = flower_home.home / "supernode2.log"

    def kill_node_2_mid_round():
        if nodes[2].poll() is None and log.read_text().count("Receiving: train message") == 2:
            flower_home.stop(only=nodes[2], signals=(signal.SIGKILL,))
    rounds, out = flwr_run(flower_home, port, "num-clients=4 fraction-evaluate=0.0 round-timeout=150.0",
                           meanwhile=kill_node_2_mid_round)
    check_rounds(rounds)
    assert nodes[2].poll() is not None and all(node.poll() is None for i, node in enumerate(nodes) if i != 2)
    assert "RobustStrategy: round 2: aggregating 3 replies of n = 4 (the others lost or left out)" in out
    assert "Traceback" not in out
