"""The results store: one SQLite file, one row per run keyed by a stable hash of its scenario.

Several processes (and machines sharing a file system) can run one matrix into one store: a
run is claimed in one transaction by one process, with a lease its owner renews while it lives
(`claim`, `renew`); a run whose owner died is claimed again once the lease expired, and
resumes from its last checkpoint (robustbn.checkpoint). A running run's row holds its history
so far (`progress`); a finished one is `done`, or `diverged` when its final evaluation is not
finite (its non-finite numbers stored as null), or `failed` with the error; `pruned`: stopped
early by the attack search (robustbn.search), never a finished run. Reading commands
open the store read-only (`Store(path, readonly=True)`): they never write.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import platform
import re
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any, Iterable

from .channels import BN_CHANNEL_KEYS, expand_channels

STATUSES = ("running", "done", "diverged", "failed", "pruned")
FINISHED = ("done", "diverged")  # never run again
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    hash TEXT PRIMARY KEY,
    scenario TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ({", ".join(f"'{s}'" for s in STATUSES)})),
    history TEXT,
    bn_stats TEXT,
    error TEXT,
    source TEXT,
    started REAL,
    finished REAL,
    wall_time_s REAL,
    device TEXT,
    versions TEXT,
    code_version TEXT,
    engine TEXT,
    rounds_done INTEGER,
    resumed_from INTEGER,
    owner TEXT,
    lease_until REAL
)
"""
# the CSV/JSON/table view of a run: scenario fields, then these
RESULT_COLUMNS = ("final_acc", "best_acc", "final_loss", "rounds_done", "resumed_from", "status", "wall_time_s",
                  "device", "code_version", "engine", "hash")
OPTIONAL_EXPORT_COLUMNS = {"resumed_from", "code_version", "engine"}  # exports written before they existed lack them
# the CSV/JSON export's column for a run's `source` (the file it was recorded from): an import keeps
# it, so a tuning's runs and a search's trials stay out of reports after the round trip
RECORDED_FROM = "recorded_from"
# where a run can have run; the same scenario on two of them is one run (worst.py averages the
# two into its seed), done wherever it finished
DEVICES = ("cpu", "cuda", *(f"cuda:{i}" for i in range(8)))
ENGINES = ("robustbn", "flower")  # what computed a run: robustbn's engine, or a Flower simulation (robustbn flower)
LEASE_S = 120.0  # a claim's lifetime; its owner renews it every LEASE_S / 4 (`execute.Lease`)
LOCK_WAIT_S = 60.0  # how long a write waits for another process's lock on the store


class StoreError(Exception):
    """A store that cannot be read or written as asked (a user error: named path, no traceback)."""


def _same(a: Any, b: Any) -> bool:
    """Filter equality: numbers by value (gamma=0 matches 0.0), anything else as text."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return float(a) == float(b) if number(a) and number(b) else str(a) == str(b)


def scenario_hash(scenario: dict[str, Any], engine: str = "robustbn") -> str:
    """Stable across processes and machines: sha256 of the scenario's canonical JSON. A run of
    another engine than robustbn's (a Flower simulation) hashes with its engine's name, so
    the two runs of one scenario are two rows; robustbn's runs keep the hash they had."""
    if engine != "robustbn":
        scenario = {**scenario, "engine": engine}
    canonical = json.dumps(scenario, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def same_runs(scenario: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's scenario on every device in DEVICES, its own device's first."""
    own = scenario.get("device", "cpu")
    return [{**scenario, "device": d} for d in dict.fromkeys((own, *DEVICES))]


def same_run_hashes(scenario: dict[str, Any], engine: str = "robustbn") -> list[str]:
    """The hashes of one run on every device in DEVICES, its own device's first."""
    return [scenario_hash(sc, engine) for sc in same_runs(scenario)]


def device_aliases(by_hash: dict) -> dict[str, str]:
    """Each planned run's hash on every device -> its hash in the plan (`by_hash`: hash ->
    Scenario): a run finished on any device counts as the plan's."""
    return {alt: h for h, sc in by_hash.items() for alt in same_run_hashes(sc.to_dict())}


def versions() -> dict[str, str]:
    import numpy
    import torch

    from . import __version__
    return {"robustbn": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "python": platform.python_version(), "cpu": cpu_model()}


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The processor's name ("AMD EPYC 7B13", "Intel(R) Xeon(R) Processor"): CPU kernels round
    differently across processors, so a run repeats bit for bit only on the same one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Which code makes a run: `git describe --always --dirty` of the checkout robustbn is
    imported from ("4c1658f", "4c1658f-dirty" with uncommitted changes), or "robustbn
    VERSION" where it is not a git checkout (an installed package) or git is missing."""
    from . import __version__
    source = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=source, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip() and (source / ".git").exists():
        return out.stdout.strip()
    return f"robustbn {__version__}"


def new_owner() -> str:
    """A claim's owner: this host and process, and a random part (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_gone(owner: str | None) -> bool:
    """Whether a claim's owner is a process of this host that no longer exists (killed): its
    claim need not wait for the lease to expire. Owners on other hosts: unknown (False)."""
    host, _, rest = (owner or "").partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    return False


def finite_history(history: list[dict]) -> tuple[list[dict], bool]:
    """(the history with non-finite numbers as None, whether its last evaluation had one):
    a run whose final model evaluates to NaN or inf diverged. Where the test loss is NaN the
    model's outputs are, and the argmax of NaN outputs is no accuracy: None too."""
    def clean(h):
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in h.items()}
        if isinstance(h.get("test_loss"), float) and math.isnan(h["test_loss"]):
            out["test_acc"] = None
        return out
    cleaned = [clean(h) for h in history]
    return cleaned, bool(history) and cleaned[-1] != history[-1]


def _uri(path: Path, mode: str) -> str:
    """A SQLite URI of `path` taken literally (`%`, `?` and `#` are quoted, not URI syntax)."""
    return f"file:{urllib.parse.quote(str(path.resolve()))}?mode={mode}"


def connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    """A connection to a results store (created if absent, unless read-only), or StoreError
    naming the path: an empty path, a directory, a file that is not SQLite, a foreign SQLite
    file (no runs table, other tables), a store that cannot be written."""
    if str(path) == "":
        raise StoreError("--db: an empty path; give a results store file, e.g. results/robustbn.sqlite")
    path = Path(path)
    try:
        path.resolve(strict=False)
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise StoreError(f"{path}: cannot resolve the path ({e})") from None
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a results store file")
    if readonly and not path.is_file():
        raise StoreError(f"{path}: no results store there (run `robustbn run FILE --db {path}` first)")
    try:
        if not readonly:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(_uri(path, "ro" if readonly else "rwc"), uri=True, timeout=LOCK_WAIT_S)
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except (sqlite3.Error, OSError) as e:
        raise StoreError(f"{path}: cannot read it as a results store ({e})") from None
    if "runs" not in tables and (tables or readonly):
        db.close()
        raise StoreError(f"{path}: not a robustbn results store (it has no runs table"
                         + (f"; it has {', '.join(sorted(tables))})" if tables else ")"))
    return db


class Store:
    """A results store. Writable (the default) creates or upgrades the file; `readonly` only
    reads (reading commands). SQLite errors later on (a truncated file, a full disk) surface as
    sqlite3.Error; the CLI reports them in one line naming the store."""

    def __init__(self, path: str | Path, readonly: bool = False):
        self.path, self.readonly = Path(path), readonly
        self.db = connect(path, readonly)
        if readonly:
            return
        try:
            self._wal()
            if self._upgrades():
                # one transaction holding the write lock from the start: an upgrade (rename,
                # copy, drop) is all or nothing, and a second process waits for it instead of
                # failing; inside it the schema is read again (that process may have done it)
                with self.db:
                    self.db.execute("BEGIN IMMEDIATE")
                    for statement in self._upgrades():
                        self.db.execute(statement)
        except sqlite3.Error as e:
            self.db.close()
            raise StoreError(f"{self.path}: cannot write to it ({e})") from None

    def _wal(self) -> None:
        """WAL mode (kept in the file). Switching a new store to it takes a lock SQLite does not
        wait for when another process opens the store at the same moment: retried for as long as
        the connection would wait for a lock."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _upgrades(self) -> list[str]:
        """The statements that create the runs table, or bring one written by an older robustbn
        to this schema: new columns added; a status constraint without one of STATUSES rebuilt
        (rows kept). Empty for a store of this version."""
        row = self.db.execute("SELECT sql FROM sqlite_master WHERE name = 'runs'").fetchone()
        if row is None:
            return [SCHEMA]
        have = [c[1] for c in self.db.execute("PRAGMA table_info(runs)")]
        if any(f"'{s}'" not in row[0] for s in STATUSES):  # rebuilt with every column of SCHEMA
            columns = ", ".join(have)
            return ["ALTER TABLE runs RENAME TO runs_old", SCHEMA,
                    f"INSERT INTO runs ({columns}) SELECT {columns} FROM runs_old", "DROP TABLE runs_old"]
        return [f"ALTER TABLE runs ADD COLUMN {definition}"
                for definition in re.findall(r"^ {4}(\w+ [A-Z]+[^,\n]*),?$", SCHEMA, re.M)
                if definition.split()[0] not in have]

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.db.execute("SELECT count(*) FROM runs").fetchone()[0]

    def status(self, run_hash: str) -> str | None:
        row = self.db.execute("SELECT status FROM runs WHERE hash = ?", (run_hash,)).fetchone()
        return row[0] if row else None

    def claim(self, run_hash: str, scenario: dict[str, Any], source: str = "", owner: str | None = None,
              lease_s: float = LEASE_S, engine: str = "robustbn") -> bool:
        """Take the run for `owner`, atomically: False when it is finished, or running under
        another owner's unexpired lease. A failed run, an unclaimed one and one whose owner
        died (its lease expired, or it was a process of this host that is gone) are taken; the
        row keeps its history so far."""
        now = time.time()
        self.db.execute("BEGIN IMMEDIATE")  # the read and the write below: one writer at a time
        try:
            row = self.db.execute("SELECT status, owner, lease_until FROM runs WHERE hash = ?", (run_hash,)).fetchone()
            held = row is not None and row[0] == "running" and row[1] and row[1] != owner
            if row is not None and (row[0] in FINISHED or held and (row[2] or 0) > now and not owner_gone(row[1])):
                self.db.rollback()
                return False
            self.db.execute(
                "INSERT INTO runs (hash, scenario, status, source, started, owner, lease_until, engine) "
                "VALUES (?, ?, 'running', ?, ?, ?, ?, ?) ON CONFLICT(hash) DO UPDATE SET status = 'running', "
                "error = NULL, started = excluded.started, owner = excluded.owner, lease_until = excluded.lease_until",
                (run_hash, json.dumps(scenario, sort_keys=True), source, now, owner, now + lease_s, engine))
            self.db.commit()
            return True
        except BaseException:
            self.db.rollback()
            raise

    start = claim  # an unowned claim: what single-process code and tests call

    def renew(self, owner: str, lease_s: float = LEASE_S) -> None:
        """Extend the leases of every run `owner` holds (its heartbeat)."""
        with self.db:
            self.db.execute("UPDATE runs SET lease_until = ? WHERE owner = ? AND status = 'running'",
                            (time.time() + lease_s, owner))

    def release(self, owner: str, run_hash: str | None = None) -> None:
        """Give up `owner`'s claim on a run (all its runs without `run_hash`), unfinished: the
        row stays `running` with its history so far, and any process may claim it at once."""
        with self.db:
            self.db.execute("UPDATE runs SET owner = NULL, lease_until = NULL WHERE owner = ? AND status = 'running'"
                            + (" AND hash = ?" if run_hash else ""), (owner, run_hash) if run_hash else (owner,))

    def progress(self, run_hash: str, history: list[dict], rounds_done: int, resumed_from: int | None = None,
                 owner: str | None = None) -> None:
        """A running run's history so far (written with each checkpoint), while `owner` holds it."""
        history, _ = finite_history(history)
        with self.db:
            self.db.execute("UPDATE runs SET history = ?, rounds_done = ?, resumed_from = ? "
                            "WHERE hash = ? AND status = 'running' AND owner IS ?",
                            (json.dumps(history), rounds_done, resumed_from, run_hash, owner))

    def finish(self, run_hash: str, scenario: dict[str, Any], history: list[dict], bn_stats: dict,
               wall_time_s: float, device: str, source: str = "", resumed_from: int | None = None,
               engine: str = "robustbn") -> str:
        """Store a finished run: `done`, or `diverged` when its final evaluation is not finite;
        `engine`: what computed it (ENGINES). Returns the status written."""
        history, diverged = finite_history(history)
        status = "diverged" if diverged else "done"
        error = f"diverged: the evaluation at round {history[-1]['round']} is not finite" if diverged else None
        with self.db:
            self.db.execute(
                "INSERT INTO runs (hash, scenario, status, history, bn_stats, error, source, finished, wall_time_s, "
                "device, versions, code_version, engine, rounds_done, resumed_from) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(hash) DO UPDATE SET status = excluded.status, history = excluded.history, "
                "bn_stats = excluded.bn_stats, error = excluded.error, finished = excluded.finished, "
                "wall_time_s = excluded.wall_time_s, device = excluded.device, versions = excluded.versions, "
                "code_version = excluded.code_version, engine = excluded.engine, "
                "rounds_done = excluded.rounds_done, resumed_from = excluded.resumed_from, owner = NULL, "
                "lease_until = NULL",
                (run_hash, json.dumps(scenario, sort_keys=True), status, json.dumps(history), json.dumps(bn_stats),
                 error, source, time.time(), wall_time_s, device, json.dumps(versions()), code_version(), engine,
                 history[-1]["round"] if history else 0, resumed_from))
        return status

    def prune(self, run_hash: str, history: list[dict], reason: str) -> None:
        """Store a run the attack search stopped early: `pruned`, its history so far, `reason`."""
        history, _ = finite_history(history)
        with self.db:
            self.db.execute("UPDATE runs SET status = 'pruned', history = ?, error = ?, finished = ?, code_version = ?, "
                            "rounds_done = ?, owner = NULL, lease_until = NULL WHERE hash = ?",
                            (json.dumps(history), reason, time.time(), code_version(),
                             history[-1]["round"] if history else 0, run_hash))

    def fail(self, run_hash: str, error: str) -> None:
        with self.db:
            self.db.execute("UPDATE runs SET status = 'failed', error = ?, finished = ?, code_version = ?, owner = NULL, "
                            "lease_until = NULL WHERE hash = ?", (error, time.time(), code_version(), run_hash))

    def merge(self, source: str | Path) -> dict[str, int]:
        """Copy the runs of another store into this one, in one transaction, deduplicating by
        run hash: a run new here is added; a finished run replaces an unfinished one; otherwise
        this store's row stays. Returns counts: added, replaced, kept, and `differing` (runs done
        in both whose histories differ, e.g. made on different devices; this store's is kept).
        The source path is taken literally and only read."""
        source = Path(source)
        try:
            with closing(connect(source, readonly=True)) as other:
                columns = [c[1] for c in other.execute("PRAGMA table_info(runs)")]
                if "hash" not in columns or "status" not in columns:
                    raise StoreError(f"{source}: not a robustbn results store (its runs table has no hash)")
                incoming = [dict(zip(columns, r)) for r in other.execute(f"SELECT {', '.join(columns)} FROM runs")]
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{source}: cannot read it as a results store ({e})") from None
        with self.db:
            return self._add(incoming)

    def add(self, batches: list[list[dict[str, Any]]]) -> list[dict[str, int]]:
        """Add batches of rows of the runs table (dicts of its columns), all in one transaction,
        by the rules of `merge`; returns `merge`'s counts for each batch."""
        with self.db:
            return [self._add(rows) for rows in batches]

    def _add(self, incoming: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Insert runs by the dedup rules of `merge`, inside the caller's transaction. Claims do
        not travel: an incoming unfinished run is unowned here."""
        mine = [c[1] for c in self.db.execute("PRAGMA table_info(runs)")]
        counts = {"added": 0, "replaced": 0, "kept": 0, "differing": 0}
        for row in incoming:
            row = {k: v for k, v in row.items() if k in mine and k not in ("owner", "lease_until")}
            here = self.db.execute("SELECT status, history FROM runs WHERE hash = ?", (row["hash"],)).fetchone()
            if here is not None and not (here[0] not in FINISHED and row["status"] in FINISHED):
                counts["kept"] += 1
                counts["differing"] += here[0] == row["status"] == "done" and here[1] != row.get("history")
                continue
            counts["replaced" if here else "added"] += 1
            self.db.execute(f"INSERT OR REPLACE INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                            tuple(row.values()))
        return counts

    def rows(self, where: dict[str, Any] | None = None, status: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every run as a flat dict (scenario fields, summary columns, history), filtered by
        scenario fields (`where`) and status (one or several). Every BN channel is spelled out
        (`expand_channels`), for old runs too. A store of an older robustbn lacks some columns:
        they read as None."""
        statuses = None if status is None else {status} if isinstance(status, str) else set(status)
        have = {c[1] for c in self.db.execute("PRAGMA table_info(runs)")}
        wanted = ("hash", "scenario", "status", "history", "wall_time_s", "device", "code_version", "engine", "error",
                  "rounds_done", "resumed_from")
        select = ", ".join(c if c in have else f"NULL AS {c}" for c in wanted)
        out = []
        for (run_hash, scenario, st, history, wall, device, code, engine, error, rounds_done, resumed_from) in self.db.execute(
                f"SELECT {select} FROM runs ORDER BY rowid"):
            if statuses and st not in statuses:
                continue
            sc = dict(sorted(expand_channels(json.loads(scenario)).items()))
            if where and not all(_same(sc.get(k), v) for k, v in where.items()):
                continue
            hist = json.loads(history) if history else []
            accs = [h["test_acc"] for h in hist if h.get("test_acc") is not None]
            last = hist[-1] if hist else {}
            out.append({**sc, "final_acc": last.get("test_acc"), "best_acc": max(accs) if accs else None,
                        "final_loss": last.get("test_loss"),
                        "rounds_done": rounds_done if rounds_done is not None else last.get("round", 0),
                        "resumed_from": resumed_from, "status": st, "wall_time_s": wall, "device": device,
                        "code_version": code, "engine": engine or "robustbn", "hash": run_hash, "history": hist, "error": error})
        return out


def strict_json(value: Any) -> Any:
    """`value` with non-finite floats as None: what strict JSON parsers accept."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def export(rows: Iterable[dict[str, Any]], fmt: str, columns: list[str]) -> str:
    """Rows as JSON (strict: non-finite numbers as null) or CSV (with `columns`)."""
    rows = list(rows)
    if fmt == "json":
        return json.dumps(strict_json(rows), indent=1, allow_nan=False)
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


def scenario_dict(values: dict[str, Any]) -> dict[str, Any]:
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
    (source: its RECORDED_FROM cell, as it is, where it has the column, else the path), each
    scenario checked against the row's hash. Raises StoreError naming the file (and the row) on
    anything else."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: not a regular file" if path.exists() else f"{path}: no such file")
    limit = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # histories are long cells
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:  # -sig: a spreadsheet's byte-order mark
            reader = csv.reader(fh)
            header = next(reader, None)
            records = list(reader)
    except (UnicodeDecodeError, csv.Error) as e:
        raise StoreError(f"{path}: not a robustbn CSV export (cannot read it as CSV: {e})") from None
    finally:
        csv.field_size_limit(limit)
    if not header:
        raise StoreError(f"{path}: not a robustbn CSV export (empty file)")
    missing = [c for c in (*RESULT_COLUMNS, "history") if c not in header and c not in OPTIONAL_EXPORT_COLUMNS]
    if missing:
        raise StoreError(f"{path}: not a robustbn CSV export (`robustbn results --format csv`): "
                         f"missing column{'s' * (len(missing) > 1)} {', '.join(missing)}")
    duplicated = sorted({c for c in header if header.count(c) > 1})
    if duplicated:
        raise StoreError(f"{path}: column {duplicated[0]} appears twice in the header")
    types = _column_types()
    summary = set(RESULT_COLUMNS) - {"device"} | {"history", RECORDED_FROM}
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
        if status not in STATUSES:
            raise StoreError(f"{where}: status {status!r} is not one of {', '.join(STATUSES)}")
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
            resumed_from = int(cells["resumed_from"]) if cells.get("resumed_from") else None
        except ValueError:
            raise StoreError(f"{where}: columns wall_time_s and resumed_from: expected numbers, got "
                             f"{cells['wall_time_s']!r} and {cells.get('resumed_from')!r}") from None
        device = cells["device"] or None
        # the device column is the device a run ended on; an unfinished run's is unknown
        devices = [device] if device else DEVICES
        try:
            candidates = [scenario_dict({**values, "device": d}) for d in devices]
        except ValueError as e:
            raise StoreError(f"{where}: {e}") from None
        engine = cells.get("engine") or "robustbn"
        if engine not in ENGINES:
            raise StoreError(f"{where}: column engine: {engine!r} is not one of {', '.join(ENGINES)}")
        scenario = next((sc for sc in candidates if scenario_hash(sc, engine) == run_hash), None)
        if scenario is None:
            raise StoreError(f"{where}: the scenario read back from its cells hashes to "
                             f"{scenario_hash(candidates[0], engine)}, not {run_hash}: an edited cell, "
                             f"or an export from a robustbn version with other scenario fields")
        runs.append({"hash": run_hash, "scenario": json.dumps(scenario, sort_keys=True), "status": status,
                     "history": json.dumps(history) if history or status == "done" else None,
                     "source": cells[RECORDED_FROM] if RECORDED_FROM in cells else str(path),
                     "wall_time_s": wall, "device": device,
                     "resumed_from": resumed_from,
                     "code_version": cells.get("code_version") or None, "engine": engine})
    return runs
