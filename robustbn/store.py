"""The results store: one SQLite file, one row per run keyed by a stable hash of its scenario.

Each run's result is written in one transaction, and a run is marked `running` in its own
transaction before it starts, so a crash (or kill -9) loses at most the runs in flight:
their rows stay `running` and are run again next time, while `done` runs are skipped.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import platform
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Iterable

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    hash TEXT PRIMARY KEY,
    scenario TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed')),
    history TEXT,
    bn_stats TEXT,
    error TEXT,
    source TEXT,
    started REAL,
    finished REAL,
    wall_time_s REAL,
    device TEXT,
    versions TEXT
)
"""
# the CSV/JSON/table view of a run: scenario fields, then these
RESULT_COLUMNS = ("final_acc", "best_acc", "final_loss", "rounds_done", "status", "wall_time_s", "device", "hash")


class StoreError(Exception):
    """A store that cannot be read or written as asked (a user error: named path, no traceback)."""


def _same(a: Any, b: Any) -> bool:
    """Filter equality: numbers by value (gamma=0 matches 0.0), anything else as text."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return float(a) == float(b) if number(a) and number(b) else str(a) == str(b)


def scenario_hash(scenario: dict[str, Any]) -> str:
    """Stable across processes and machines: sha256 of the scenario's canonical JSON."""
    canonical = json.dumps(scenario, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def versions() -> dict[str, str]:
    import numpy
    import torch

    from . import __version__
    return {"robustbn": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "python": platform.python_version()}


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=60)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def __len__(self) -> int:
        return self.db.execute("SELECT count(*) FROM runs").fetchone()[0]

    def status(self, run_hash: str) -> str | None:
        row = self.db.execute("SELECT status FROM runs WHERE hash = ?", (run_hash,)).fetchone()
        return row[0] if row else None

    def start(self, run_hash: str, scenario: dict[str, Any], source: str = "") -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO runs (hash, scenario, status, source, started) VALUES (?, ?, 'running', ?, ?) "
                "ON CONFLICT(hash) DO UPDATE SET status = 'running', error = NULL, started = excluded.started",
                (run_hash, json.dumps(scenario, sort_keys=True), source, time.time()))

    def finish(self, run_hash: str, scenario: dict[str, Any], history: list[dict], bn_stats: dict,
               wall_time_s: float, device: str, source: str = "") -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO runs (hash, scenario, status, history, bn_stats, source, finished, wall_time_s, device, versions) "
                "VALUES (?, ?, 'done', ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(hash) DO UPDATE SET status = 'done', "
                "history = excluded.history, bn_stats = excluded.bn_stats, error = NULL, finished = excluded.finished, "
                "wall_time_s = excluded.wall_time_s, device = excluded.device, versions = excluded.versions",
                (run_hash, json.dumps(scenario, sort_keys=True), json.dumps(history), json.dumps(bn_stats), source,
                 time.time(), wall_time_s, device, json.dumps(versions())))

    def fail(self, run_hash: str, error: str) -> None:
        with self.db:
            self.db.execute("UPDATE runs SET status = 'failed', error = ?, finished = ? WHERE hash = ?",
                            (error, time.time(), run_hash))

    def merge(self, source: str | Path) -> dict[str, int]:
        """Copy the runs of another store into this one, in one transaction, deduplicating by
        run hash: a run new here is added; a finished run replaces an unfinished one; otherwise
        this store's row stays. Returns counts: added, replaced, kept, and `differing` (runs done
        in both whose histories differ, e.g. made on different devices; this store's is kept)."""
        source = Path(source)
        if not source.is_file():
            raise StoreError(f"merge: no results store at {source}")
        try:
            with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as other:
                columns = [c[1] for c in other.execute("PRAGMA table_info(runs)")]
                if "hash" not in columns or "status" not in columns:
                    raise StoreError(f"merge: {source} is not a robustbn results store (it has no runs table)")
                incoming = [dict(zip(columns, r)) for r in other.execute(f"SELECT {', '.join(columns)} FROM runs")]
        except sqlite3.DatabaseError as e:
            raise StoreError(f"merge: cannot read {source} as a results store: {e}") from None
        mine = [c[1] for c in self.db.execute("PRAGMA table_info(runs)")]
        counts = {"added": 0, "replaced": 0, "kept": 0, "differing": 0}
        with self.db:
            for row in incoming:
                row = {k: v for k, v in row.items() if k in mine}
                here = self.db.execute("SELECT status, history FROM runs WHERE hash = ?", (row["hash"],)).fetchone()
                if here is not None and not (here[0] != "done" and row["status"] == "done"):
                    counts["kept"] += 1
                    counts["differing"] += here[0] == row["status"] == "done" and here[1] != row["history"]
                    continue
                counts["replaced" if here else "added"] += 1
                self.db.execute(f"INSERT OR REPLACE INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                                tuple(row.values()))
        return counts

    def rows(self, where: dict[str, Any] | None = None, status: str | None = None) -> list[dict[str, Any]]:
        """Every run as a flat dict (scenario fields, summary columns, history), filtered by
        scenario fields (`where`) and status."""
        out = []
        for (run_hash, scenario, st, history, wall, device, error) in self.db.execute(
                "SELECT hash, scenario, status, history, wall_time_s, device, error FROM runs ORDER BY rowid"):
            sc = json.loads(scenario)
            if status and st != status:
                continue
            if where and not all(_same(sc.get(k), v) for k, v in where.items()):
                continue
            hist = json.loads(history) if history else []
            accs = [h["test_acc"] for h in hist]
            out.append({**sc, "final_acc": accs[-1] if accs else None, "best_acc": max(accs) if accs else None,
                        "final_loss": hist[-1]["test_loss"] if hist else None,
                        "rounds_done": hist[-1]["round"] if hist else 0, "status": st, "wall_time_s": wall,
                        "device": device, "hash": run_hash, "history": hist, "error": error})
        return out


def export(rows: Iterable[dict[str, Any]], fmt: str, columns: list[str]) -> str:
    rows = list(rows)
    if fmt == "json":
        return json.dumps(rows, indent=1)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})
    return buf.getvalue()
