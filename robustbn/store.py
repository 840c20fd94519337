"""The results store: one SQLite file, one row per run keyed by a stable hash of its scenario.

Each run's result is written in one transaction, and a run is marked `running` in its own
transaction before it starts, so a crash (or kill -9) loses at most the runs in flight:
their rows stay `running` and are run again next time, while `done` runs are skipped.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import platform
import re
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Iterable

from .channels import BN_CHANNEL_KEYS, expand_channels

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
        with self.db:
            return self._add(incoming)

    def add(self, batches: list[list[dict[str, Any]]]) -> list[dict[str, int]]:
        """Add batches of rows of the runs table (dicts of its columns), all in one transaction,
        by the rules of `merge`; returns `merge`'s counts for each batch."""
        with self.db:
            return [self._add(rows) for rows in batches]

    def _add(self, incoming: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Insert runs by the dedup rules of `merge`, inside the caller's transaction."""
        mine = [c[1] for c in self.db.execute("PRAGMA table_info(runs)")]
        counts = {"added": 0, "replaced": 0, "kept": 0, "differing": 0}
        for row in incoming:
            row = {k: v for k, v in row.items() if k in mine}
            here = self.db.execute("SELECT status, history FROM runs WHERE hash = ?", (row["hash"],)).fetchone()
            if here is not None and not (here[0] != "done" and row["status"] == "done"):
                counts["kept"] += 1
                counts["differing"] += here[0] == row["status"] == "done" and here[1] != row.get("history")
                continue
            counts["replaced" if here else "added"] += 1
            self.db.execute(f"INSERT OR REPLACE INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                            tuple(row.values()))
        return counts

    def rows(self, where: dict[str, Any] | None = None, status: str | None = None) -> list[dict[str, Any]]:
        """Every run as a flat dict (scenario fields, summary columns, history), filtered by
        scenario fields (`where`) and status. Every BN channel is spelled out (`expand_channels`),
        for old runs too."""
        out = []
        for (run_hash, scenario, st, history, wall, device, error) in self.db.execute(
                "SELECT hash, scenario, status, history, wall_time_s, device, error FROM runs ORDER BY rowid"):
            sc = dict(sorted(expand_channels(json.loads(scenario)).items()))
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


def _column_types() -> dict[str, set[str]]:
    """The type names of every scenario field (from `Scenario`'s annotations), and of the BN
    channel columns that `expand_channels` writes, by column name."""
    from .scenario import Scenario

    types = {f.name: set(re.findall(r"[A-Za-z_]+", f.type if isinstance(f.type, str) else repr(f.type)))
             for f in dataclasses.fields(Scenario)}
    for key in BN_CHANNEL_KEYS:
        types.setdefault(key, {"dict", "None"} if key.endswith("_params") else {"str", "None"})
    return types


def _cell(text: str, types: set[str]) -> Any:
    """A CSV cell back to its scenario value. The export writes None as an empty cell,
    dicts and lists as JSON, anything else with str(): so a number is an int exactly when its
    text is an integer (str() of a float always has '.', 'e', 'inf' or 'nan')."""
    if text == "":
        return "" if types <= {"str"} else None
    if types & {"dict", "list"}:
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"bad JSON ({e}): {text[:60]!r}") from None
    if "bool" in types and text in ("True", "False"):
        return text == "True"
    if types & {"int", "float"}:
        try:
            return int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
        except ValueError:
            if "str" not in types:
                raise ValueError(f"expected a number, got {text!r}") from None
    if types & {"str", "bool", "int", "float"}:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _scenario_dict(values: dict[str, Any]) -> dict[str, Any]:
    """The canonical scenario dict (what run hashes are computed from) of a row's fields; not
    validated: a run made on another machine (a GPU, other data paths) is still a run."""
    from .scenario import Scenario, ScenarioError

    known = {f.name for f in dataclasses.fields(Scenario)}
    try:
        return Scenario(**{k: v for k, v in values.items() if k in known}).canonical().to_dict()
    except ScenarioError as e:
        raise ValueError(str(e)) from None


def read_export(path: str | Path) -> list[dict[str, Any]]:
    """The runs of a CSV written by `robustbn results --format csv`, as rows of the runs table
    (source = the path), each scenario checked against the row's hash. Raises StoreError naming
    the file (and the row) on anything else."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: no such file")
    limit = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # histories are long cells
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            records = list(reader)
    except (UnicodeDecodeError, csv.Error) as e:
        raise StoreError(f"{path}: not a robustbn CSV export (cannot read it as CSV: {e})") from None
    finally:
        csv.field_size_limit(limit)
    if not header:
        raise StoreError(f"{path}: not a robustbn CSV export (empty file)")
    missing = [c for c in (*RESULT_COLUMNS, "history") if c not in header]
    if missing:
        raise StoreError(f"{path}: not a robustbn CSV export (`robustbn results --format csv`): "
                         f"missing column{'s' * (len(missing) > 1)} {', '.join(missing)}")
    duplicated = sorted({c for c in header if header.count(c) > 1})
    if duplicated:
        raise StoreError(f"{path}: column {duplicated[0]} appears twice in the header")
    types = _column_types()
    summary = set(RESULT_COLUMNS) - {"device"} | {"history"}
    unknown = [c for c in header if c not in types and c not in summary]
    if unknown:
        raise StoreError(f"{path}: unknown column{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                         f"(not scenario fields of this robustbn version)")
    runs = []
    for number, record in enumerate(records, 1):
        where = f"{path} row {number}"
        if not record:
            continue
        if len(record) != len(header):
            raise StoreError(f"{where}: {len(record)} cells, the header has {len(header)}")
        cells = dict(zip(header, record))
        run_hash, status = cells["hash"], cells["status"]
        if not run_hash:
            raise StoreError(f"{where}: no hash")
        where += f" (hash {run_hash})"
        if status not in ("running", "done", "failed"):
            raise StoreError(f"{where}: status {status!r} is not one of running, done, failed")
        values = {}
        for column in header:
            if column in types:
                try:
                    values[column] = _cell(cells[column], types[column])
                except ValueError as e:
                    raise StoreError(f"{where}: column {column}: {e}") from None
        try:
            history = json.loads(cells["history"] or "[]")
        except json.JSONDecodeError as e:
            raise StoreError(f"{where}: column history: bad JSON ({e})") from None
        if not isinstance(history, list) or not all(
                isinstance(h, dict) and {"round", "test_acc", "test_loss"} <= set(h) for h in history):
            raise StoreError(f"{where}: column history: not a list of evaluations (round, test_acc, test_loss)")
        try:
            wall = float(cells["wall_time_s"]) if cells["wall_time_s"] else None
        except ValueError:
            raise StoreError(f"{where}: column wall_time_s: expected a number, got {cells['wall_time_s']!r}") from None
        device = cells["device"] or None
        # the device column is the device a run ended on; an unfinished run's is unknown
        devices = [device] if device else ["cpu", "cuda", *(f"cuda:{i}" for i in range(8))]
        try:
            candidates = [_scenario_dict({**values, "device": d}) for d in devices]
        except ValueError as e:
            raise StoreError(f"{where}: {e}") from None
        scenario = next((sc for sc in candidates if scenario_hash(sc) == run_hash), None)
        if scenario is None:
            raise StoreError(f"{where}: the scenario read back from its cells hashes to "
                             f"{scenario_hash(candidates[0])}, not {run_hash}: an edited cell, "
                             f"or an export from a robustbn version with other scenario fields")
        runs.append({"hash": run_hash, "scenario": json.dumps(scenario, sort_keys=True), "status": status,
                     "history": json.dumps(history) if history or status == "done" else None,
                     "source": str(path), "wall_time_s": wall, "device": device})
    return runs
