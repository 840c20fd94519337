"""Scenario matrices, the results store, and the CLI that ties them together."""

import dataclasses
import itertools
import json
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import example, given, strategies as st

from robustbn.cli import main
from robustbn.execute import run_matrix
from robustbn.matrix import MatrixError, expand, load, parse_override
from robustbn.scenario import ScenarioError
from robustbn.store import Store, scenario_hash

from matrices import TINY_RUN, shipped_matrix_files, torch_threads

ROOT = Path(__file__).parent.parent
TINY = TINY_RUN + """norm = ["naive", "fbn"]
f = [0, 1]
bn_attack = ["none", "sf"]
bn_agg = "median"
[[exclude]]
f = 0
bn_attack = "sf"
[[exclude]]
f = 1
bn_attack = "none"
"""


def write(tmp_path, text, name="m.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_matrix_expands_the_cartesian_product_minus_exclusions(tmp_path):
    _, scenarios = load(write(tmp_path, TINY))
    assert [(s.norm, s.f, s.bn_attack) for s in scenarios] == [
        ("naive", 0, "none"), ("naive", 1, "sf"), ("fbn", 0, "none"), ("fbn", 1, "sf")]


def test_overrides_replace_values_and_lists_make_axes(tmp_path):
    _, scenarios = load(write(tmp_path, TINY), ["rounds=9", "seed=[0, 1]", "norm=gn", "bn_attack=none", "f=0"])
    assert len(scenarios) == 2 and {s.seed for s in scenarios} == {0, 1}
    assert all(s.rounds == 9 and s.norm == "gn" for s in scenarios)
    assert parse_override("norm=fbn") == ("norm", "fbn") and parse_override("lr=0.5") == ("lr", 0.5)
    milestones = expand({"lr_milestones": [[10, 0.05], [20, 0.01]]})
    assert len(milestones) == 1 and milestones[0].lr_milestones == [[10, 0.05], [20, 0.01]]
    assert len(expand({"lr_milestones": [[[10, 0.05]], [[20, 0.01]]]})) == 2


def test_exclusion_reads_list_valued_fields_as_the_axes_do():
    """An exclude rule's lr_milestones is one schedule, or a list of schedules meaning any of."""
    schedules = [[[10, 0.05]], [[20, 0.01]], [[30, 0.02]]]
    one = expand({"lr_milestones": schedules, "exclude": [{"lr_milestones": [[10, 0.05]]}]})
    assert [s.lr_milestones for s in one] == [[[20, 0.01]], [[30, 0.02]]]
    any_of = expand({"lr_milestones": schedules, "exclude": [{"lr_milestones": [[[10, 0.05]], [[30, 0.02]]]}]})
    assert [s.lr_milestones for s in any_of] == [[[20, 0.01]]]


# axes a matrix varies (some combinations are no valid scenario: f = 0 under attack)
AXES = {"norm": ["naive", "fbn", "fixbn"], "f": [0, 1, 2], "gamma": [0.0, 0.5], "grad_agg": ["mean", "nnm+trmean"],
        "bn_mean_attack": ["honest", "sf", "bn-kl"], "bn_var_attack": ["honest", "bn-kl"],
        "seed": [0, 1], "lr_milestones": [[[10, 0.05]], [[20, 0.01]]]}


def reference_expand(values: dict) -> list[dict]:
    """expand as written: the whole product, a combination dropped where a rule holds for the
    scenario it would be (a BN channel's field read through its shorthand)."""
    from robustbn.matrix import _rule_value, alternatives
    from robustbn.scenario import Scenario
    axes = {k: alternatives(k, v) for k, v in values.items() if k != "exclude"}
    kept = []
    for combo in itertools.product(*axes.values()):
        sc = Scenario(**dict(zip(axes, combo)))
        if not any(all(_rule_value(sc, k) in alternatives(k, v) for k, v in rule.items()) for rule in values["exclude"]):
            kept.append(sc.validated().to_dict())
    return kept


@st.composite
def matrices(draw):
    keys = draw(st.lists(st.sampled_from(sorted(AXES)), min_size=1, max_size=6, unique=True))
    values = {"n": 6, "f": 1, "rounds": 2, "dataset": "synthetic-images",
              **{k: draw(st.lists(st.sampled_from(AXES[k]), min_size=2, max_size=3, unique_by=json.dumps)) for k in keys}}
    # a rule names the matrix's axes (a value, or a list meaning any of) and now and then a field
    # left at its default, or a BN channel's field read through its shorthand
    fields = st.sampled_from(keys * 3 + ["n", "bn_agg", "momentum", "bn_attack", "bn_mean_attack", "bn_var_attack"])
    options = {**AXES, "n": [6, 10], "bn_agg": ["mean", "median"], "momentum": [0.0, 0.9],
               "bn_attack": ["honest", "sf", "bn-kl", None]}
    rule = fields.flatmap(lambda k: st.tuples(st.just(k), st.one_of(
        st.sampled_from(options[k]), st.lists(st.sampled_from(options[k]), min_size=1, max_size=2, unique_by=json.dumps))))
    rule = st.lists(rule, min_size=1, max_size=3).map(dict)
    values["exclude"] = draw(st.lists(rule, max_size=4))
    return values


@given(matrices())
@example({"n": 6, "f": [1, 2], "norm": ["naive", "fbn"], "gamma": [0.0, 0.5], "seed": [0, 1],
          "exclude": [{"norm": "fbn", "f": 1}, {"gamma": 0.5, "bn_mean_attack": "honest"}, {"seed": 1, "norm": "naive"}]})
def test_pruned_expansion_equals_the_whole_product_filtered(values):
    """expand prunes a partial combination as soon as a rule on plain axes holds for it: the
    same scenarios, in the same order, as filtering the whole product."""
    try:
        wanted = reference_expand(values)
    except ScenarioError:  # a combination the rules keep is no valid scenario: expand says so too
        with pytest.raises(MatrixError, match="in the combination|key"):
            expand(values)
        return
    try:
        got = [s.to_dict() for s in expand(values)]
    except MatrixError as e:
        assert not wanted and "every combination is excluded" in str(e)
        return
    assert got == wanted


@pytest.mark.parametrize("text, message", [
    ('colour = "blue"', "m.toml: unknown key 'colour'; allowed:"),
    ('rounds = "many"', "m.toml: key 'rounds': must be an integer >= 1, got 'many'"),
    ('norm = ["fbn", "batchnorm"]', "key 'norm': unknown norm protocol 'batchnorm'; allowed: naive, fbn"),
    ('f = 5\nn = 10\ngrad_agg = "median"\ngrad_attack = "sf"', "key 'grad_agg': median: needs f < n/2"),
    ('rounds = [', "not valid TOML"),
    ('norm = []', "key 'norm' is an empty list"),
    ('[[exclude]]\nbogus = 1', "exclude rule names unknown key 'bogus'"),
])
def test_bad_files_give_one_clear_message(tmp_path, text, message):
    with pytest.raises(MatrixError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load(write(tmp_path, text))


def run_cli(*args, check_rc=None):
    p = subprocess.run([sys.executable, "-m", "robustbn.cli", *args], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check_rc is not None:
        assert p.returncode == check_rc, p.stderr
    return p


def test_invalid_file_exits_2_without_traceback(tmp_path):
    p = run_cli("run", str(write(tmp_path, 'norm = "bogus"')), "--db", str(tmp_path / "r.sqlite"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "m.toml: key 'norm': unknown norm protocol 'bogus'; allowed:" in p.stderr
    assert not (tmp_path / "r.sqlite").exists()  # nothing ran, nothing written
    p = run_cli("list", str(tmp_path / "missing.toml"))
    assert p.returncode == 2 and "no such scenario file" in p.stderr
    p = run_cli("run", str(write(tmp_path, TINY)), "--set", "bogus=1")
    assert p.returncode == 2 and "--set bogus: unknown key" in p.stderr


def test_run_list_results_plot_round_trip(tmp_path, capsys):
    matrix, db = write(tmp_path, TINY), str(tmp_path / "r.sqlite")
    assert main(["list", str(matrix)]) == 0
    assert "4 scenarios" in capsys.readouterr().out
    assert main(["run", str(matrix), "--db", db, "--quiet"]) == 0
    assert "4 runs: 4 ran, 0 already done, 0 failed" in capsys.readouterr().out
    assert main(["run", str(matrix), "--db", db, "--quiet"]) == 0  # finished runs are skipped
    assert "4 runs: 0 ran, 4 already done" in capsys.readouterr().out

    assert main(["results", "--db", db, "--format", "json", "--where", "norm=fbn"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and {r["norm"] for r in rows} == {"fbn"}
    assert all(r["status"] == "done" and [h["round"] for h in r["history"]] == [3, 6] for r in rows)
    assert main(["results", "--db", db, "--format", "json", "--where", "f=1", "--where", "lr=0.1"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2  # numbers match by value: lr=0.1, f=1
    assert main(["results", "--db", db, "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and "final_acc" in lines[0].split(",")

    for kind in ("curves", "heatmap"):
        out = tmp_path / f"{kind}.png"
        assert main(["plot", kind, "--db", db, "--out", str(out)]) == 0
        assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000


def test_run_takes_several_files_and_checks_them_all_before_a_run(tmp_path, capsys, monkeypatch):
    """`robustbn run a.toml b.toml` (a shell glob of tuned files): each file's runs with its own
    line and its own source; a bad file among them stops everything before the first run."""
    a, db = write(tmp_path, TINY), str(tmp_path / "r.sqlite")
    b = write(tmp_path, TINY.replace('norm = ["naive", "fbn"]', 'norm = "fbn"\nlr = 0.05'), "b.toml")
    bad = write(tmp_path, 'norm = "bogus"', "bad.toml")
    assert main(["run", str(a), str(bad), str(b), "--db", db, "--quiet"]) == 2
    assert "bad.toml: key 'norm'" in capsys.readouterr().err and not Path(db).exists()
    assert main(["run", str(a), str(b), str(a), "--db", db, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{a} (1 of 2): 4 runs: 4 ran" in out and f"{b} (2 of 2): 2 runs: 2 ran" in out
    with sqlite3.connect(db) as con:
        sources = Counter(source for (source,) in con.execute("SELECT source FROM runs"))
    assert sources == {str(a): 4, str(b): 2}
    monkeypatch.setattr("robustbn.cli.run.BIG_MATRIX", 5)  # the size check counts every file's runs together
    assert main(["run", str(a), str(b), "--db", db, "--quiet"]) == 2
    assert "the 2 files expand to 6 runs; pass --yes" in capsys.readouterr().err


def test_store_keys_by_stable_hash_and_commits_each_run(tmp_path):
    sc = {"b": 1, "a": [1, 2]}
    assert scenario_hash(sc) == scenario_hash({"a": [1, 2], "b": 1})
    store = Store(tmp_path / "s.sqlite")
    store.start("h1", sc)
    store.finish("h2", sc, [{"round": 1, "test_acc": 0.5, "test_loss": 1.0, "train_loss": 1.0}], {}, 1.0, "cpu")
    store.close()
    with sqlite3.connect(tmp_path / "s.sqlite") as db:  # another connection sees both, committed
        assert dict(db.execute("SELECT hash, status FROM runs").fetchall()) == {"h1": "running", "h2": "done"}


def test_jobs_run_scenarios_in_parallel_processes_with_the_same_results(tmp_path, capsys):
    matrix = write(tmp_path, TINY)
    serial, parallel = str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite")
    with torch_threads(max(1, (os.cpu_count() or 1) // 2)):  # what each of the 2 workers gets
        assert main(["run", str(matrix), "--db", serial, "--quiet"]) == 0
    assert main(["run", str(matrix), "--db", parallel, "--quiet", "--jobs", "2"]) == 0
    rows = lambda path: {r["hash"]: r["history"] for r in Store(path).rows()}
    assert rows(serial) == rows(parallel)


def test_jobs_mark_a_run_running_only_when_a_worker_takes_it(tmp_path):
    """With --jobs 2, the store's `running` rows are the runs in flight, never the queue."""
    _, scenarios = load(write(tmp_path, TINY))

    class Watched(Store):
        already_running: list[int] = []

        def claim(self, run_hash, scenario, source="", owner=None):
            self.already_running.append(len(self.rows(status="running")))
            return super().claim(run_hash, scenario, source, owner)

    store = Watched(tmp_path / "s.sqlite")
    summary = run_matrix(scenarios, store, jobs=2, progress=False)
    assert summary.done == len(scenarios) == 4
    assert len(store.already_running) == 4 and max(store.already_running) <= 1
    store.close()


def test_shared_workers_outlive_each_call_and_end_with_the_scope(tmp_path, monkeypatch):
    """Inside shared_workers, a second run_matrix reuses the first's worker processes (their
    dataset loaded, CUDA started) with the same results as fresh ones; a call whose workers
    would start otherwise (another search path) replaces them; the scope's end, or a run
    without the scope, leaves none alive."""
    from robustbn import execute
    from robustbn.execute import shared_workers

    _, scenarios = load(write(tmp_path, TINY))  # 4 runs
    alone = Store(tmp_path / "alone.sqlite")
    assert run_matrix(scenarios, alone, jobs=2, progress=False).done == 4
    assert execute._shared is None
    store = Store(tmp_path / "s.sqlite")
    with shared_workers():
        assert run_matrix(scenarios[:2], store, jobs=2, progress=False).done == 2
        first = list(execute._shared["workers"])
        assert len(first) == 2 and all(w.process.is_alive() for w in first)
        assert run_matrix(scenarios[2:], store, jobs=2, progress=False).done == 2
        assert [w.process.pid for w in execute._shared["workers"]] == [w.process.pid for w in first]
        # a user's module directory added since: workers that import as this process now
        short = [dataclasses.replace(sc, rounds=2) for sc in scenarios[:2]]
        monkeypatch.setattr(execute, "search_path", lambda: [str(tmp_path / "mine")])
        assert run_matrix(short, store, jobs=2, progress=False).done == 2
        assert not any(w.process.is_alive() for w in first)
        second = list(execute._shared["workers"])
        assert {w.process.pid for w in second}.isdisjoint(w.process.pid for w in first)
    assert execute._shared is None and not any(w.process.is_alive() for w in first + second)
    rows = lambda st: {r["hash"]: r["history"] for r in st.rows() if r["rounds"] == 6}
    assert rows(store) == rows(alone)
    store.close(), alone.close()


def test_shared_workers_drop_those_killed_while_idle_and_keep_through_a_short_call(tmp_path, monkeypatch):
    """Workers killed while idle between calls are dropped, not charged to the next runs (each
    run has MAX_ATTEMPTS worker deaths before it fails); a call with fewer runs than --jobs
    keeps the pool: each worker's threads follow --jobs (6 cores, --jobs 3: 2 threads), not the
    runs left."""
    import signal

    from robustbn import execute
    from robustbn.execute import shared_workers

    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    _, scenarios = load(write(tmp_path, TINY))  # 4 runs
    more = lambda k: [dataclasses.replace(sc, rounds=k) for sc in scenarios[:2]]
    store = Store(tmp_path / "s.sqlite")
    with shared_workers():
        assert run_matrix(scenarios[:3], store, jobs=3, progress=False).done == 3
        first = list(execute._shared["workers"])
        for w in first:
            os.kill(w.process.pid, signal.SIGKILL)
            w.process.join()
        summary = run_matrix([scenarios[3], *more(2)], store, jobs=3, progress=False)
        assert (summary.done, summary.failed) == (3, [])
        second = [w.process.pid for w in execute._shared["workers"]]
        assert len(second) == 3 and not set(second) & {w.process.pid for w in first}
        assert run_matrix(more(3), store, jobs=3, progress=False).done == 2  # 2 runs: the same 3 workers
        assert [w.process.pid for w in execute._shared["workers"]] == second
    store.close()


def test_a_shared_worker_signalled_while_idle_ends_and_the_next_runs_go_to_the_others(tmp_path):
    """A SIGTERM to one idle worker of a kept pool (someone's kill(1)) ends that worker; it is
    not sent the next runs to refuse as "interrupted" until the command ends."""
    import signal

    from robustbn import execute
    from robustbn.execute import shared_workers

    _, scenarios = load(write(tmp_path, TINY))  # 4 runs
    store = Store(tmp_path / "s.sqlite")
    with shared_workers():
        assert run_matrix(scenarios[:2], store, jobs=2, progress=False).done == 2
        signalled, other = execute._shared["workers"]
        os.kill(signalled.process.pid, signal.SIGTERM)
        signalled.process.join(timeout=30)
        assert signalled.process.exitcode == 0  # it ended by itself, cleanly
        summary = run_matrix(scenarios[2:], store, jobs=2, progress=False)
        assert (summary.done, summary.interrupted, summary.failed) == (2, 0, [])
        pids = [w.process.pid for w in execute._shared["workers"]]
        assert other.process.pid in pids and signalled.process.pid not in pids
    assert {r["status"] for r in store.rows()} == {"done"}
    store.close()


def test_every_shipped_scenario_file_is_valid():
    files = shipped_matrix_files()
    assert len(files) >= 8
    for path in files:
        values, scenarios = load(path)
        assert values.get("description") and scenarios


def test_planned_counts_a_files_runs_seeds_included_and_follows_an_edit(tmp_path):
    """`planned` (the docs' run counts) counts runs, not the seed-free cells `runs_of` matches,
    and a changed file is expanded again."""
    from robustbn.matrix import planned

    path = tmp_path / "m.toml"
    path.write_text('dataset = "synthetic-images"\nn = 6\nf = 1\nrounds = 2\ngrad_agg = ["mean", "median"]\n'
                    'seed = [0, 1, 2]\n')
    assert planned(path) == len(load(path)[1]) == 6
    path.write_text(path.read_text().replace("seed = [0, 1, 2]", "seed = [0, 1]"))
    assert planned(path) == 4 and planned(path, attacked=True) == 0  # f = 1, but nobody attacks
    path.write_text(path.read_text() + 'grad_attack = ["alie", "none"]\n')
    assert planned(path) == 8 and planned(path, attacked=True) == 4


def test_toy_command_draws_the_figure(tmp_path, capsys):
    out = tmp_path / "toy.png"
    assert main(["toy", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fbn" in text and out.stat().st_size > 20_000


def test_every_run_records_the_code_that_made_it(tmp_path, capsys, monkeypatch):
    """`git describe --always --dirty` of this checkout, in the store and in every export; a
    failed run too; where git cannot tell (not a checkout, no git), the package's version."""
    import robustbn.store as store

    described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
    assert described
    file = write(tmp_path, TINY_RUN + 'norm = "fbn"\n')
    db = tmp_path / "r.sqlite"
    with torch_threads(1):
        assert main(["run", str(file), "--db", str(db), "--quiet"]) == 0
    with Store(db) as s:
        [row] = s.rows()
    assert row["code_version"] == described
    for fmt in ("csv", "json"):
        assert main(["results", "--db", str(db), "--format", fmt]) == 0
        assert described in capsys.readouterr().out
    assert main(["results", "--db", str(db)]) == 0
    assert described in capsys.readouterr().out
    with Store(db) as s:
        s.fail(row["hash"], "boom")
    assert sqlite3.connect(db).execute("SELECT code_version FROM runs").fetchone() == (described,)

    store.code_version.cache_clear()
    monkeypatch.setattr(store.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    try:
        from robustbn import __version__
        assert store.code_version() == f"robustbn {__version__}"
    finally:
        store.code_version.cache_clear()


def test_a_store_without_the_code_version_column_reads_and_upgrades(tmp_path):
    db = tmp_path / "old.sqlite"
    with Store(db) as s:
        pass
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE runs DROP COLUMN code_version")
    con.execute("INSERT INTO runs (hash, scenario, status, history) VALUES ('h', '{\"norm\": \"fbn\"}', 'done', '[]')")
    con.commit()
    con.close()
    with Store(db, readonly=True) as s:
        assert s.rows()[0]["code_version"] is None
    with Store(db) as s:
        assert "code_version" in {c[1] for c in s.db.execute("PRAGMA table_info(runs)")}
