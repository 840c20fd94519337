"""What the matrix, store and cluster tests share: small scenario settings (seconds per run
on a CPU) and a fixed torch thread count for bit-for-bit comparisons."""

import json
import sqlite3
from contextlib import contextmanager
from pathlib import Path

import torch

from robustbn.store import scenario_hash

SCENARIOS = Path(__file__).parent.parent / "scenarios"


def shipped_matrix_files() -> list[Path]:
    """The shipped scenario and matrix files; search files (a [search] table, run by `robustbn
    attack-search`) are tests/test_attack_search.py's."""
    return [p for p in sorted(SCENARIOS.glob("*.toml")) if "[search]" not in p.read_text()]

TINY_RUN = """
dataset = "synthetic-images"
model = "simple-cnn"
partition = "iid"
n = 4
rounds = 6
batch_size = 8
eval_every = 3
"""


@contextmanager
def torch_threads(n: int):
    """Bit-for-bit equality between executors needs the same torch thread count on both
    sides (CPU reductions split by thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_line_error(capsys, code: int, *words: str) -> str:
    """A user error as the CLI must give it: exit status 2, one stderr line holding `words`,
    no traceback anywhere. Returns the line."""
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out.err + out.out, out
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def as_if_run_on_cuda(db) -> int:
    """Rewrite every run of the store as a GPU's run of the same scenario (its hash, scenario
    and device), as a store filled on a GPU machine holds it; the number of runs."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT hash, scenario FROM runs").fetchall()
        for run_hash, text in rows:
            sc = {**json.loads(text), "device": "cuda"}
            con.execute("UPDATE runs SET hash = ?, scenario = ?, device = 'cuda' WHERE hash = ?",
                        (scenario_hash(sc), json.dumps(sc, sort_keys=True), run_hash))
    return len(rows)
