"""Bad stores and bad run options: each a one-line error (exit 2) naming the path or option,
no traceback, and no file written; reading commands never write."""

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from robustbn.cli import main
from robustbn.store import Store, StoreError

from matrices import TINY_RUN, one_line_error

READS = [["results"], ["results", "--format", "json"], ["results", "--worst-case"],
         ["plot", "curves", "--out", "{tmp}/p.png"]]


def snapshot(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def matrix(tmp_path) -> Path:
    path = tmp_path / "m.toml"
    path.write_text(TINY_RUN + 'norm = "fbn"\n')
    return path


def make_foreign(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE people (name TEXT)")
        con.execute("INSERT INTO people VALUES ('ada')")


def make_store(path: Path) -> None:
    with Store(path) as store:
        store.claim("x", {"k": 1})


BAD_STORES = {
    "a directory": (lambda p: p.mkdir(), "is a directory"),
    "garbage": (lambda p: p.write_bytes(os.urandom(3000)), "cannot read it"),
    "a foreign SQLite file": (make_foreign, "not a robustbn results store"),
    "a truncated store": (lambda p: (make_store(p), p.write_bytes(p.read_bytes()[:1500])), ""),
}


@pytest.mark.parametrize("kind", BAD_STORES)
@pytest.mark.parametrize("command", [["run", "{matrix}", "--quiet"], *READS, ["merge", "{tmp}/other.sqlite"]])
def test_a_bad_store_is_one_line_naming_it_and_is_left_untouched(kind, command, tmp_path, capsys):
    make, words = BAD_STORES[kind]
    db = tmp_path / "store" / "bad.sqlite"
    db.parent.mkdir()
    make(db)
    make_store(tmp_path / "other.sqlite")
    before = snapshot(db.parent)
    args = [a.format(tmp=tmp_path, matrix=matrix(tmp_path)) for a in command]
    line = one_line_error(capsys, main([*args, "--db", str(db)]), str(db))
    assert words in line
    after = snapshot(db.parent)  # nothing written, no table added, no WAL switched on
    if kind == "a truncated store":  # a WAL store: SQLite's lock files beside it may appear
        after = {k: v for k, v in after.items() if not k.endswith(("-wal", "-shm"))}
    assert after == before


def test_an_empty_db_path_is_named(tmp_path, capsys):
    one_line_error(capsys, main(["run", str(matrix(tmp_path)), "--db", "", "--quiet"]), "--db", "empty")
    one_line_error(capsys, main(["results", "--db", ""]), "--db", "empty")


def test_a_missing_store_is_named_by_reading_commands_and_not_created(tmp_path, capsys):
    db = tmp_path / "none.sqlite"
    one_line_error(capsys, main(["results", "--db", str(db)]), str(db), "no results store")
    assert not db.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_a_read_only_store_is_named_for_run(tmp_path, capsys):
    db = tmp_path / "ro.sqlite"
    make_store(db)
    db.chmod(0o444)
    one_line_error(capsys, main(["run", str(matrix(tmp_path)), "--db", str(db), "--quiet"]), str(db))


def test_reading_our_own_store_does_not_change_it(tmp_path, capsys):
    db = tmp_path / "s.sqlite"
    assert main(["run", str(matrix(tmp_path)), "--db", str(db), "--quiet"]) == 0
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    for command in READS:
        assert main([a.format(tmp=tmp_path) for a in command] + ["--db", str(db)]) == 0
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("name", ["shard%31.sqlite", "shard#1.sqlite", "sh?ard.sqlite", "with space.sqlite"])
def test_merge_takes_source_paths_literally(name, tmp_path, capsys):
    make_store(tmp_path / "shard1.sqlite")  # what 'shard%31' decodes to as a URI
    with Store(tmp_path / name) as store:
        store.claim("mine", {"k": 2})
    before = set(os.listdir(tmp_path))
    target = tmp_path / "out.sqlite"
    assert main(["merge", "--db", str(target), str(tmp_path / name)]) == 0
    with Store(target, readonly=True) as store:
        assert [r["hash"] for r in store.rows()] == ["mine"]
    made = set(os.listdir(tmp_path)) - before  # no stray file from a name cut at '#' or '?'
    assert made <= {"out.sqlite", "out.sqlite-wal", "out.sqlite-shm", f"{name}-wal", f"{name}-shm"}, made


def test_an_old_store_is_read_as_is_and_upgraded_by_run(tmp_path, capsys):
    """A store written before claims, progress and `diverged` existed."""
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE runs (hash TEXT PRIMARY KEY, scenario TEXT NOT NULL, status TEXT NOT NULL CHECK "
                    "(status IN ('running', 'done', 'failed')), history TEXT, bn_stats TEXT, error TEXT, source TEXT, "
                    "started REAL, finished REAL, wall_time_s REAL, device TEXT, versions TEXT)")
        con.execute("""INSERT INTO runs (hash, scenario, status, history) VALUES ('old', '{"norm": "fbn"}', 'done',
                       '[{"round": 5, "test_acc": 0.5, "test_loss": 1.0}]')""")
    before = db.read_bytes()
    assert main(["results", "--db", str(db)]) == 0
    assert db.read_bytes() == before and "0.5000" in capsys.readouterr().out
    assert main(["run", str(matrix(tmp_path)), "--db", str(db), "--quiet"]) == 0
    with Store(db, readonly=True) as store:
        rows = {r["hash"]: r for r in store.rows()}
    assert rows["old"]["final_acc"] == 0.5 and rows["old"]["rounds_done"] == 5 and len(rows) == 2
    with sqlite3.connect(db) as con:  # the status constraint now admits diverged runs
        con.execute("UPDATE runs SET status = 'diverged' WHERE hash = 'old'")


def test_jobs_out_of_range_and_a_huge_matrix_need_words(tmp_path, capsys):
    db = tmp_path / "s.sqlite"
    one_line_error(capsys, main(["run", str(matrix(tmp_path)), "--db", str(db), "--jobs", "1000000000"]), "--jobs")
    one_line_error(capsys, main(["run", str(matrix(tmp_path)), "--db", str(db), "--checkpoint-every", "-1"]),
                   "--checkpoint-every")
    big = tmp_path / "big.toml"
    big.write_text(TINY_RUN + 'norm = "fbn"\nseed = [' + ", ".join(map(str, range(2001))) + "]\n")
    line = one_line_error(capsys, main(["run", str(big), "--db", str(db), "--quiet"]), "2001 runs", "--yes")
    assert not db.exists(), line


def test_a_symlink_loop_as_the_store_is_one_line(tmp_path, capsys):
    loop = tmp_path / "loop.sqlite"
    os.symlink(loop, loop)
    for command in (["run", str(matrix(tmp_path)), "--quiet"], ["results"], ["merge", str(tmp_path / "x.sqlite")]):
        one_line_error(capsys, main([*command, "--db", str(loop)]), str(loop))


def test_import_reads_a_spreadsheets_byte_order_mark_and_names_a_folder(tmp_path, capsys):
    db = tmp_path / "s.sqlite"
    assert main(["run", str(matrix(tmp_path)), "--db", str(db), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["results", "--db", str(db), "--format", "csv"]) == 0
    exported = tmp_path / "excel.csv"
    exported.write_text("\ufeff" + capsys.readouterr().out, encoding="utf-8")
    assert main(["import", str(exported), "--db", str(tmp_path / "copy.sqlite")]) == 0
    assert "1 added" in capsys.readouterr().out
    one_line_error(capsys, main(["import", str(tmp_path), "--db", str(tmp_path / "copy.sqlite")]),
                   "not a regular file")


def _open_store(path, barrier, results):
    barrier.wait()  # both processes open the new store at the same moment
    try:
        Store(path).close()
        results.put("ok")
    except Exception as e:  # reported to the test, which names it
        results.put(f"{type(e).__name__}: {e}")


def test_processes_creating_one_store_at_once_all_open_it(tmp_path):
    """Two `robustbn run` on a new store start together (tests/test_resume.py does): switching
    the new file to WAL took a lock SQLite does not wait for, and one of the two failed with
    "database is locked" in about one start in eight here. 2 processes, 40 new stores."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for i in range(40):
        barrier, results = context.Barrier(2), context.Queue()
        procs = [context.Process(target=_open_store, args=(tmp_path / f"s{i}.sqlite", barrier, results))
                 for _ in range(2)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join()
        assert outcomes == ["ok"] * 2, outcomes


class _LockedAtFirst:
    """A store connection whose first `times` switches to WAL fail as SQLite's do when another
    process is switching the same new file."""

    def __init__(self, db, times):
        self.db, self.times = db, times

    def execute(self, sql, *args):
        if sql.startswith("PRAGMA journal_mode") and self.times:
            self.times -= 1
            raise sqlite3.OperationalError("database is locked")
        return self.db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)

    def __enter__(self):
        return self.db.__enter__()

    def __exit__(self, *exc):
        return self.db.__exit__(*exc)


def test_the_switch_to_wal_is_retried_while_another_process_holds_it(tmp_path, monkeypatch):
    from robustbn import store as store_module

    real = store_module.connect
    monkeypatch.setattr(store_module, "connect", lambda *a, **k: _LockedAtFirst(real(*a, **k), 3))
    with Store(tmp_path / "s.sqlite") as store:
        assert store.db.times == 0 and len(store) == 0
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 0.0)  # no time left to wait: the lock is named
    monkeypatch.setattr(store_module, "connect", lambda *a, **k: _LockedAtFirst(real(*a, **k), 10**6))
    with pytest.raises(StoreError, match="cannot write to it .database is locked"):
        Store(tmp_path / "t.sqlite")


def test_opening_a_current_store_takes_no_write_lock(tmp_path, monkeypatch):
    """A store of this version is opened without writing: another process's long write does not
    hold it up (an upgrade, when one is due, takes the lock)."""
    from robustbn import store as store_module

    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 1.0)  # a wait for the lock fails in a second
    Store(tmp_path / "s.sqlite").close()
    writer = sqlite3.connect(tmp_path / "s.sqlite", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with Store(tmp_path / "s.sqlite") as store:
            assert len(store) == 0
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_a_run_records_the_processor_it_ran_on(tmp_path):
    """CPU kernels round differently across processors, so a stored run says which one made it
    (its `versions`: the processor's name beside torch's version), as well as its device."""
    import json

    from robustbn.store import cpu_model, versions

    with Store(tmp_path / "r.sqlite") as store:
        store.finish("h", {"seed": 0}, [{"round": 1, "test_acc": 0.5}], {}, 1.0, "cpu")
        (stored,) = store.db.execute("SELECT versions FROM runs WHERE hash = 'h'").fetchone()
    recorded = json.loads(stored)
    assert recorded == versions() and recorded["cpu"] == cpu_model() != ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: the name /proc/cpuinfo gives
        names = [line.partition(":")[2].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        assert not names or recorded["cpu"] == names[0]
