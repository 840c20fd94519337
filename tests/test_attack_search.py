"""`robustbn attack-search`: an Optuna search for the worst attack, every trial a run in the store."""

import json
import signal
import sqlite3
import tomllib
from pathlib import Path

import pytest

from robustbn import runner
from robustbn import search as attack_search
from robustbn.checkpoint import checkpoint_dir, request_stop
from robustbn.cli import main
from robustbn.store import FINISHED, Store, finite_history
from robustbn.stats import accuracy

from matrices import as_if_run_on_cuda, one_line_error, torch_threads

ROOT = Path(__file__).parent.parent

BASE = """
dataset = "synthetic-images"
model = "simple-cnn"
partition = "iid"
norm = "fbn"
n = 5
f = 1
rounds = 6
batch_size = 8
eval_every = 2
grad_agg = "mean"
"""
SPACE = """
[search]
trials = 6
seed = {seed}
[search.grad]
attacks = ["none", "alie", "scale"]
[search.grad.alie]
z = [0.0, 3.0]
[search.grad.scale]
factor = [-1e4, -1e3]
"""


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):  # bit-for-bit runs (and fast ones on a shared 2-core machine)
        yield


def write(tmp_path, text, name="search.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def search(capsys, path, db, *extra) -> dict:
    code = main(["attack-search", str(path), "--db", str(db), "--quiet", "--format", "json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def trials_of(db) -> list[tuple]:
    """(hash, status, history) of every run, in the order the search stored them."""
    with Store(db, readonly=True) as store:
        return [(r["hash"], r["status"], r["history"]) for r in store.rows()]


@pytest.fixture
def counted(monkeypatch):
    """The scenarios runner.run is called with (a trial read back from the store is not run)."""
    calls, real = [], runner.run

    def run(sc, **kw):
        calls.append(sc)
        return real(sc, **kw)
    monkeypatch.setattr(runner, "run", run)
    return calls


def test_a_fixed_seed_gives_the_same_search_and_another_seed_another(tmp_path, capsys):
    path = write(tmp_path, BASE + SPACE.format(seed=0))
    a, b = (search(capsys, path, tmp_path / f"{name}.sqlite") for name in "ab")
    assert a == b and a["trials"] == 6
    assert trials_of(tmp_path / "a.sqlite") == trials_of(tmp_path / "b.sqlite")
    other = search(capsys, write(tmp_path, BASE + SPACE.format(seed=1), "other.toml"), tmp_path / "c.sqlite")
    assert {h for h, *_ in trials_of(tmp_path / "c.sqlite")} != {h for h, *_ in trials_of(tmp_path / "a.sqlite")}
    assert other["trials"] == 6


def test_a_devastating_attack_against_the_mean_is_found(tmp_path, capsys):
    """A huge negative scaling of one gradient out of five wrecks a plain mean: near chance (10
    classes) or diverged (counted at chance, 0.1), while the run without attack learns."""
    out = search(capsys, write(tmp_path, BASE + SPACE.format(seed=0)), tmp_path / "s.sqlite")
    worst = out["worst"]
    assert worst["grad_attack"] == "scale" and -1e4 <= worst["grad_attack_params"]["factor"] <= -1e3
    assert worst["final_acc"] <= 0.15 and worst["grad_agg"] == "mean" and worst["norm"] == "fbn"
    with Store(tmp_path / "s.sqlite", readonly=True) as store:
        run = [r for r in store.rows() if r["hash"] == worst["hash"]][0]
    assert run["status"] in FINISHED and accuracy(run)[0] == worst["final_acc"]
    clean = runner.run(tomllib.loads(BASE))  # the same defense, no attack
    assert clean.final_accuracy > worst["final_acc"] + 0.1


LATE = """
import attacks

class Late(attacks.Attack):
    \"\"\"Honest for its first `after` rounds, then -factor x the honest mean: a trial whose
    accuracy looks harmless until the end.\"\"\"
    name = "late"

    def __init__(self, after: int = 0, factor: float = 1.0):
        self.after, self.factor, self.calls = after, factor, 0

    def forge(self, honest, f):
        self.calls += 1
        mean = honest.mean(0, keepdim=True)
        return (mean if self.calls <= self.after else -self.factor * mean).repeat(f, 1)
"""
MISLEADING = BASE.replace("rounds = 6", "rounds = 12").replace("eval_every = 2", "eval_every = 3") + """lr = 0.1
[search]
trials = 5
seed = 0
[search.grad]
attacks = ["honest", "scale", "lateattack:Late"]
[search.grad.scale]
factor = [-2.0, -1.0]
[search.grad."lateattack:Late"]
after = 9
factor = 1e4
"""


def run_to_the_end(scenario: dict) -> list[float]:
    """A trial's scenario run on its own, to its last round: its accuracy at every evaluation
    (a diverged run ends at chance, 1 / 10 classes, as the search and every result view count it)."""
    history, diverged = finite_history(runner.run(scenario).history)
    return [h["test_acc"] or 0.0 for h in history[:-1]] + [0.1 if diverged else history[-1]["test_acc"]]


def test_a_search_reports_the_worst_of_its_trials_where_early_accuracy_misleads(tmp_path, capsys,
                                                                                clean_search_path):
    """The late attack is harmless to the accuracy until round 9 (above another trial there)
    and the worst at round 12: every trial runs to its end, and the reported worst is the
    lowest final accuracy of the trials, each run again on its own to the end."""
    (tmp_path / "lateattack.py").write_text(LATE)
    out = search(capsys, write(tmp_path, MISLEADING), tmp_path / "s.sqlite")
    assert out["trials"] == 5 and out["pruned"] == 0 and len(out["tried"]) == 5
    curves = {t["trial"]: run_to_the_end(trials_scenario(tmp_path / "s.sqlite", t["seeds"][0]["hash"]))
              for t in out["tried"]}
    assert {t["trial"]: t["final_acc"] for t in out["tried"]} == {k: c[-1] for k, c in curves.items()}
    assert out["worst"]["final_acc"] == min(c[-1] for c in curves.values())
    assert out["worst"]["grad_attack"] == "lateattack:Late"
    late = curves[out["worst"]["trial"]]
    assert any(late[2] > c[2] for c in curves.values())  # at round 9 another trial looked worse
    assert out["objective"].startswith("the trial's mean over its seeds of the final test accuracy")


def trials_scenario(db, run_hash) -> dict:
    with Store(db, readonly=True) as store:
        return json.loads(store.db.execute("SELECT scenario FROM runs WHERE hash = ?", (run_hash,)).fetchone()[0])


def test_a_trials_objective_is_the_mean_over_its_seeds_and_a_stopped_trial_could_not_win(tmp_path, capsys):
    """seeds = [0, 1, 2]: a finished trial's objective is the mean of its three runs' final
    accuracies; a trial stopped early is kept with its bound, and its seeds not run, run now,
    confirm it: its objective is at least the bound, above the worst found before it."""
    text = BASE + SPACE.format(seed=0).replace("trials = 6", "trials = 5\nseeds = [0, 1, 2]")
    db = tmp_path / "s.sqlite"
    out = search(capsys, write(tmp_path, text), db)
    with Store(db, readonly=True) as store:
        rows = {r["hash"]: r for r in store.rows()}
    finished = [t for t in out["tried"] if t["status"] in FINISHED]
    assert finished and out["trials"] == 5 and out["seeds"] == [0, 1, 2]
    for t in finished:
        assert [s["seed"] for s in t["seeds"]] == [0, 1, 2]
        finals = [accuracy(rows[s["hash"]])[0] for s in t["seeds"]]
        assert [rows[s["hash"]]["seed"] for s in t["seeds"]] == [0, 1, 2]
        assert t["final_acc"] == pytest.approx(sum(finals) / 3)
    stopped = [t for t in out["tried"] if t["status"] == "pruned"]
    assert stopped and out["pruned"] == len(stopped)
    for t in stopped:
        before = min(u["final_acc"] for u in finished if u["trial"] < t["trial"])
        assert t["bound"] > before and len(t["seeds"]) < 3
        scenario = trials_scenario(db, t["seeds"][0]["hash"])
        objective = sum(run_to_the_end({**scenario, "seed": seed})[-1] for seed in (0, 1, 2)) / 3
        assert objective >= t["bound"] - 1e-9 and objective > out["worst"]["final_acc"]
    assert out["worst"]["final_acc"] == min(t["final_acc"] for t in finished)
    assert out["worst"]["seeds"] == [0, 1, 2] and len(out["worst"]["hashes"]) == 3


def test_a_run_stopped_on_its_curve_is_stored_pruned_and_never_counted_as_finished(tmp_path, capsys):
    """prune_margin < 1 trusts the curve from prune_from x rounds on: a run whose accuracy
    minus the margin is above the worst stops there, stored `pruned` with its reason."""
    text = BASE + SPACE.format(seed=0).replace("seed = 0", "seed = 0\nprune_from = 0.5\nprune_margin = 0.0")
    db = tmp_path / "s.sqlite"
    out = search(capsys, write(tmp_path, text), db)
    with Store(db, readonly=True) as store:
        rows = {r["hash"]: r for r in store.rows()}
        finished = {r["hash"] for r in store.rows(status=FINISHED)}
    pruned = {h for h, r in rows.items() if r["status"] == "pruned"}
    assert pruned and {t["seeds"][0]["hash"] for t in out["tried"] if t["status"] == "pruned"} == pruned
    assert out["pruning"]["prune_margin"] == 0.0 and out["pruned"] == len(pruned)
    for run_hash in pruned:
        row = rows[run_hash]
        assert run_hash not in finished and 3 <= row["rounds_done"] < 6
        assert row["error"].startswith(f"pruned at round {row['rounds_done']} by the attack search")
    assert len(finished) + len(pruned) == len(rows) == 6
    assert main(["results", "--db", str(db), "--status", "pruned", "--format", "json"]) == 0
    assert {r["hash"] for r in json.loads(capsys.readouterr().out)} == pruned


def test_repeated_proposals_are_not_counted(tmp_path, capsys):
    """`trials = 6` is six distinct attacks; the sampler's repeats are counted apart, in the
    JSON and on stderr."""
    path, db = write(tmp_path, BASE + SPACE.format(seed=0)), tmp_path / "s.sqlite"
    code = main(["attack-search", str(path), "--db", str(db), "--quiet", "--format", "json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0 and out["trials"] == 6 == len(trials_of(db)) == len({t["attack"] for t in out["tried"]})
    assert out["repeats"] == out["proposals"] - 6 >= 1
    assert f"6 distinct attacks from {out['proposals']} proposals, {out['repeats']} repeat" in captured.err


def test_a_finite_space_smaller_than_trials_stops_when_it_is_exhausted(tmp_path, capsys):
    text = BASE + '[search]\ntrials = 6\n[search.grad]\nattacks = ["none", "sf", "alie"]\n[search.grad.alie]\nz = 1.0\n'
    path, db = write(tmp_path, text), tmp_path / "s.sqlite"
    code = main(["attack-search", str(path), "--db", str(db), "--quiet", "--format", "json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0 and out["trials"] == 3 == len(trials_of(db))
    assert len({t["attack"] for t in out["tried"]}) == 3 and out["proposals"] == 3 + out["repeats"]
    assert "holds 3 distinct attacks" in out["stopped"] and "holds 3 distinct attacks" in captured.err


def test_trials_appear_in_results_worst_case(tmp_path, capsys):
    db = tmp_path / "s.sqlite"
    out = search(capsys, write(tmp_path, BASE + SPACE.format(seed=0)), db)
    assert main(["results", "--db", str(db), "--worst-case", "--format", "json"]) == 0
    captured = capsys.readouterr()
    (setting,) = json.loads(captured.out)
    assert "are an attack search's trials (seeds no report uses)" in captured.err
    with Store(db, readonly=True) as store:
        attacked = {r["hash"] for r in store.rows(status=FINISHED) if r["grad_attack"] != "none"}
    assert setting["worst_acc"] == out["worst"]["final_acc"] and setting["attacks"] == len(attacked) >= 1


def test_matrix_keeps_a_files_runs_at_any_seed_and_leaves_the_trials_out(tmp_path, capsys):
    """--matrix FILE: the worst case (and plot) of a matrix file's runs alone, seeds added with
    --set included, though an attack search's trials share the matrix's settings."""
    db = tmp_path / "s.sqlite"
    out = search(capsys, write(tmp_path, BASE + SPACE.format(seed=0)), db)
    matrix = write(tmp_path, BASE + 'seed = [0, 1]\ngrad_attack = "alie"\ngrad_attack_params = { z = 1.0 }\n',
                   "matrix.toml")
    for extra in ([], ["--set", "seed=2"]):
        assert main(["run", str(matrix), "--db", str(db), "--quiet", *extra]) == 0
    capsys.readouterr()
    assert main(["results", "--db", str(db), "--worst-case", "--format", "json", "--matrix", str(matrix)]) == 0
    (setting,) = json.loads(capsys.readouterr().out)
    with Store(db, readonly=True) as store:
        alie = [r for r in store.rows(status=FINISHED) if r["grad_attack_params"] == {"z": 1.0}]
    assert len(alie) == 3 and setting["seeds"] == 3 and setting["attacks"] == 1
    assert setting["worst_acc"] == pytest.approx(sum(r["final_acc"] for r in alie) / 3)
    assert main(["results", "--db", str(db), "--worst-case", "--format", "json"]) == 0
    (everything,) = json.loads(capsys.readouterr().out)
    assert everything["worst_acc"] == out["worst"]["final_acc"] < setting["worst_acc"]
    assert main(["results", "--db", str(db), "--format", "json", "--matrix", str(matrix)]) == 0
    assert sorted(r["seed"] for r in json.loads(capsys.readouterr().out)) == [0, 1, 2]
    assert main(["plot", "worst-case", "--db", str(db), "--out", str(tmp_path / "w.png"), "--matrix", str(matrix)]) == 0
    assert (tmp_path / "w.png").stat().st_size > 0


@pytest.mark.parametrize("name, words", [("none.toml", "--matrix"), ("search.toml", "a search file")])
def test_matrix_refuses_what_is_no_matrix_in_one_line(tmp_path, capsys, name, words):
    write(tmp_path, BASE + SPACE.format(seed=0))
    Store(tmp_path / "s.sqlite").close()
    for argv in (["results", "--worst-case"], ["plot", "worst-case", "--out", str(tmp_path / "w.png")]):
        code = main([*argv, "--db", str(tmp_path / "s.sqlite"), "--matrix", str(tmp_path / name)])
        one_line_error(capsys, code, "--matrix", words)


def test_a_larger_trials_continues_a_search_without_repeating_finished_trials(tmp_path, capsys, counted):
    path = write(tmp_path, BASE + SPACE.format(seed=0))
    first = search(capsys, path, tmp_path / "a.sqlite", "--trials", "3")
    ran_first = len(counted)
    resumed = search(capsys, path, tmp_path / "a.sqlite", "--trials", "6")
    ran_then = len(counted) - ran_first
    fresh = search(capsys, path, tmp_path / "b.sqlite", "--trials", "6")
    assert resumed == fresh and first["trials"] == 3
    assert trials_of(tmp_path / "a.sqlite") == trials_of(tmp_path / "b.sqlite")
    assert ran_first + ran_then == len(counted) - ran_first - ran_then  # every run once, as in one go
    assert 1 <= ran_then <= 3
    search(capsys, path, tmp_path / "a.sqlite", "--trials", "6")  # all read back from the store
    assert len(counted) == 2 * (ran_first + ran_then)


def test_a_search_killed_mid_trial_resumes_it_from_its_checkpoint(tmp_path, capsys, monkeypatch):
    """SIGINT during trial 1 (round 3, after an evaluation): the run is checkpointed, the command
    ends with 130; run again, the trial resumes from round 3 and the search ends as one run in
    one go does."""
    path, db = write(tmp_path, BASE + SPACE.format(seed=0)), tmp_path / "a.sqlite"
    real = runner.run

    def interrupted(sc, **kw):
        progress = kw["progress"]
        def stop_at_3(t):
            progress(t)
            if t == 3:
                request_stop(signal.SIGINT)
        return real(sc, **{**kw, "progress": stop_at_3})
    monkeypatch.setattr(runner, "run", interrupted)
    assert main(["attack-search", str(path), "--db", str(db), "--quiet", "--checkpoint-every", "100"]) == 130
    assert "the same command resumes" in capsys.readouterr().err
    ((run_hash, status, history),) = trials_of(db)
    assert status == "running" and [h["round"] for h in history] == [2]
    assert (checkpoint_dir(db) / f"{run_hash}.pt").exists()
    monkeypatch.setattr(runner, "run", real)
    resumed = search(capsys, path, db)
    with Store(db, readonly=True) as store:
        assert [r["resumed_from"] for r in store.rows() if r["hash"] == run_hash] == [3]
    assert resumed == search(capsys, path, tmp_path / "b.sqlite")
    assert [(h, s, hist) for h, s, hist in trials_of(db)] == trials_of(tmp_path / "b.sqlite")


BOOM = """
import attacks

class Boom(attacks.Attack):
    \"\"\"Fine at a small factor; above 5 it fails mid-run (a broken attack of a user's).\"\"\"
    name = "boom"

    def __init__(self, factor: float = 1.0):
        self.factor = factor

    def forge(self, honest, f):
        if self.factor > 5:
            raise RuntimeError("boom")
        return -self.factor * honest.mean(0, keepdim=True).repeat(f, 1)
"""


def test_a_users_attack_is_searched_and_a_failing_trial_is_stored_failed(tmp_path, capsys, clean_search_path):
    """`module:Name` attacks resolve beside the file; a trial whose run fails is stored `failed`
    with its error, counted, and the search goes on (exit 1)."""
    (tmp_path / "boomattack.py").write_text(BOOM)
    path = write(tmp_path, BASE + '[search]\ntrials = 6\n[search.grad]\nattacks = ["boomattack:Boom"]\n'
                           '[search.grad."boomattack:Boom"]\nfactor = [0.0, 10.0]\n')
    db = tmp_path / "s.sqlite"
    confirm = tmp_path / "found" / "worst.toml"
    code = main(["attack-search", str(path), "--db", str(db), "--quiet", "--format", "json", "--confirm", str(confirm)])
    out = capsys.readouterr()
    result = json.loads(out.out)
    # written elsewhere, the confirmation file says where the user's attack module is
    assert tomllib.loads(confirm.read_text())["search_path"] == [".."] and "boomattack:Boom" in confirm.read_text()
    with Store(db, readonly=True) as store:
        rows = store.rows()
    failed = [r for r in rows if r["status"] == "failed"]
    assert code == 1 and result["failed"] == len(failed) >= 1 and result["trials"] == 6
    assert all(r["grad_attack_params"]["factor"] > 5 and "boom" in r["error"] for r in failed)
    assert all(r["grad_attack"] == "boomattack:Boom" for r in rows) and "failed: RuntimeError: boom" in out.err
    assert result["worst"]["grad_attack_params"]["factor"] <= 5


def test_the_evaluation_hook_leaves_a_run_unchanged(tmp_path):
    """runner.run's on_evaluation (the pruner's feed) sees each evaluation once, as the history
    ends up, and changes nothing in the run."""
    values = dict(dataset="synthetic-images", model="simple-cnn", norm="fbn", n=5, f=1, rounds=6, batch_size=8,
                  eval_every=2, grad_attack="alie", bn_mean_attack="sf", bn_var_attack="honest", bn_agg="median")
    seen = []
    plain, hooked = runner.run(values), runner.run(values, on_evaluation=lambda h: seen.append(h))
    assert hooked.history == plain.history and hooked.bn_stats == plain.bn_stats
    assert seen == [plain.history[:k] for k in (1, 2, 3)]


@pytest.mark.parametrize("text, words", [
    (BASE, ["no [search] table"]),
    (BASE + SPACE.format(seed=0).replace("trials = 6", "trials = 0"), ["[search] trials", ">= 1"]),
    (BASE + SPACE.format(seed=0).replace("seed = 0", "seed = -1"), ["[search] seed"]),
    (BASE + "[search]\ntrials = 2\n", ["declares no channel", "[search.grad]"]),
    (BASE + SPACE.format(seed=0).replace("trials = 6", "trials = 6\nseeds = []"), ["[search] seeds",
                                                                                  "non-empty list"]),
    (BASE + SPACE.format(seed=0).replace("trials = 6", "trials = 6\nseeds = [0, 1.5]"), ["[search] seeds",
                                                                                        "integers"]),
    (BASE + SPACE.format(seed=0).replace("trials = 6", "trials = 6\nseeds = [1, 2, 1]"), ["[search] seeds",
                                                                                         "1 is listed twice"]),
    (BASE + "seed = 3\n" + SPACE.format(seed=0).replace("trials = 6", "trials = 6\nseeds = [1, 2]"),
     ["key 'seed'", "[search] seeds", "leave seed out"]),
    (BASE + SPACE.format(seed=0).replace("trials = 6", "trials = 6\nprune_from = 1.5"), ["[search] prune_from",
                                                                                        "[0, 1]"]),
    (BASE + SPACE.format(seed=0).replace("trials = 6", 'trials = 6\nprune_margin = "no"'),
     ["[search] prune_margin", "[0, 1]"]),
    (BASE + "[search]\nbn_avg = {}\n", ["unknown key 'bn_avg'", "seeds", "grad, bn_mean, bn_var"]),
    (BASE.replace('norm = "fbn"', 'norm = ["fbn", "naive"]') + SPACE.format(seed=0), ["'norm' is a list",
                                                                                     "one value per field"]),
    (BASE.replace("f = 1", "f = 0") + SPACE.format(seed=0), ["key 'f'", "f >= 1"]),
    (BASE + 'grad_attack = "sf"\n' + SPACE.format(seed=0), ["'grad_attack'", "leave grad_attack out"]),
    (BASE + SPACE.format(seed=0).replace('"alie", "scale"', '"alie", "nosuch"'), ["[search.grad] attacks",
                                                                                  "nosuch", "allowed"]),
    (BASE + SPACE.format(seed=0).replace('attacks = ["none", "alie", "scale"]', "attacks = []"),
     ["[search.grad] attacks", "non-empty list"]),
    (BASE + SPACE.format(seed=0).replace("z = [0.0, 3.0]", "zz = [0.0, 3.0]"),
     ["[search.grad.alie] zz", "does not take zz", "allowed: z"]),
    (BASE + SPACE.format(seed=0).replace("[-1e4, -1e3]", "[-1e3, -1e4]"), ["[search.grad.scale] factor",
                                                                           "low -1000.0 > high -10000.0"]),
    (BASE + SPACE.format(seed=0).replace("[-1e4, -1e3]", '[-1e4, -1e3, "log"]'), ["factor", "log range",
                                                                                  "low > 0"]),
    (BASE + SPACE.format(seed=0).replace("[-1e4, -1e3]", '[1, 2, "lin"]'), ["factor", "can only be \"log\""]),
    (BASE + SPACE.format(seed=0).replace("[-1e4, -1e3]", "[1, 2, 3, 4]"), ["factor", "expected [low, high]"]),
    (BASE + SPACE.format(seed=0) + "[search.grad.sf]\n", ["[search.grad] 'sf'", "not one of its attacks"]),
    (BASE.replace('norm = "fbn"', 'norm = "gn"') + SPACE.format(seed=0).replace("[search.grad]", "[search.bn_mean]")
     .replace("search.grad.", "search.bn_mean."), ["[search.bn_mean]", "sends no BN statistics"]),
    (BASE + SPACE.format(seed=0).replace("z = [0.0, 3.0]", "[search.grad.alie.z]\nlow = 0"),
     ["[search.grad.alie] z", "got a table"]),
    (BASE + "[search]\ngrad = 3\n",
     ["[search.grad]", "must be a table"]),
    (BASE + SPACE.format(seed=0).replace('"alie", "scale"', '"alie", "scale", "inf"') + "[search.grad.inf]\n"
     "sign = [0.5, 1.0]\n", ["[search.grad.inf] sign", "integer"]),
    (BASE + SPACE.format(seed=0).replace('"alie", "scale"', '"alie", "scale", "minmax"') + "[search.grad.minmax]\n"
     'direction = ["std", "nosuch"]\n', ["[search.grad] 'minmax' at the high end", "direction"]),
])
def test_bad_search_files_get_one_line_errors(tmp_path, capsys, text, words):
    db = tmp_path / "s.sqlite"
    one_line_error(capsys, main(["attack-search", str(write(tmp_path, text)), "--db", str(db), "--quiet"]), *words)
    assert not db.exists()


def test_bad_options_get_one_line_errors(tmp_path, capsys):
    path, db = write(tmp_path, BASE + SPACE.format(seed=0)), tmp_path / "s.sqlite"
    one_line_error(capsys, main(["attack-search", str(path), "--db", str(db), "--jobs", "2"]), "--jobs 2", "--jobs 1")
    one_line_error(capsys, main(["attack-search", str(path), "--db", str(db), "--trials", "0"]), "--trials", ">= 1")
    one_line_error(capsys, main(["attack-search", str(tmp_path / "none.toml"), "--db", str(db)]), "no such")
    one_line_error(capsys, main(["attack-search", str(path), "--db", str(db), "--set", "n=[4,5]"]), "'n' is a list")
    assert not db.exists()


def test_an_older_store_is_upgraded_to_take_pruned_runs(tmp_path):
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as con:  # the status constraint before `pruned`
        con.execute("CREATE TABLE runs (hash TEXT PRIMARY KEY, scenario TEXT NOT NULL, status TEXT NOT NULL CHECK "
                    "(status IN ('running', 'done', 'diverged', 'failed')), history TEXT)")
        con.execute("""INSERT INTO runs VALUES ('old', '{"norm": "fbn"}', 'done', '[]')""")
    with Store(db) as store:
        store.claim("new", {"norm": "fbn"})
        store.prune("new", [{"round": 2, "test_acc": 0.5, "test_loss": 1.0}], "pruned at round 2 by the attack search")
        assert {r["hash"]: (r["status"], r["rounds_done"]) for r in store.rows()} == {
            "old": ("done", 0), "new": ("pruned", 2)}


def test_every_shipped_search_file_is_valid_and_no_matrix(capsys):
    files = [p for p in sorted((ROOT / "scenarios").glob("*.toml")) if "[search]" in p.read_text()]
    assert files
    for path in files:
        values, space = attack_search.load(path)
        assert values.get("description") and space.channels and space.trials >= 1
        one_line_error(capsys, main(["list", str(path)]), "a search file", "robustbn attack-search")


@pytest.mark.parametrize("worst, banked, acc, t, stops", [
    (None, 0.9, 0.9, 8, False),      # nothing finished yet: nothing to compare with
    (0.3, 0.5, 0.0, 8, False),       # (0.5 + 0) / 3 = 0.17: could still end below 0.3
    (0.3, 0.5, 0.65, 8, True),       # (0.5 + 0.65 - 0.2) / 3 = 0.317 > 0.3
    (0.3, 0.5, 0.6, 8, False),       # (0.5 + 0.6 - 0.2) / 3 = 0.3: a tie could still be the worst
    (0.3, 0.5, 0.6, 4, False),       # before prune_from x rounds = 5
    (0.3, 0.5, 0.9, 10, False),      # the last evaluation: the run is finished, never stopped
    (0.3, 0.95, 0.0, 8, True),       # the seeds run already settle it
])
def test_a_run_stops_only_where_its_trials_lower_bound_exceeds_the_worst(worst, banked, acc, t, stops):
    bound = attack_search._Bound(worst, banked, seeds=3, rounds=10, prune_from=0.5, margin=0.2)
    at = bound.stops({"round": t, "test_acc": acc})
    assert (at is not None) == stops
    if stops:
        assert at == pytest.approx((banked + max(0.0, acc - 0.2)) / 3) and at > worst


def test_a_defense_with_a_client_filter_is_searched(tmp_path, capsys):
    """BNGuard reads every client's statistics, so a scenario that leaves a BN channel's attack
    out is refused by `robustbn run`; a search file leaves out the attacks it searches, and its
    trials on the BN channels are what the filter reads (issue 38: the BNGuard rows searched)."""
    text = BASE.replace('grad_agg = "mean"', 'grad_agg = "mean"\nbn_agg = "mean"\nclient_filter = "bnguard"') + """
[search]
trials = 2
seed = 0
[search.grad]
attacks = ["honest", "alie"]
[search.bn_mean]
attacks = ["honest", "sf"]
[search.bn_var]
attacks = ["honest"]
"""
    out = search(capsys, write(tmp_path, text), tmp_path / "s.sqlite")
    assert out["trials"] and out["worst"]["client_filter"] == "bnguard"
    with Store(tmp_path / "s.sqlite", readonly=True) as store:
        rows = store.rows()
    assert rows and all(r["client_filter"] == "bnguard" and r["bn_var_attack"] == "honest" for r in rows)


def test_confirm_writes_the_found_attack_on_the_held_out_seeds(tmp_path, capsys):
    """--confirm FILE: the search's setting (its --set overrides included) with its worst trial's
    attack, on seeds 0-4; running the file runs that attack there."""
    from robustbn.matrix import expand, read

    path = write(tmp_path, BASE + SPACE.format(seed=0))
    confirm = tmp_path / "searched_worst_x.toml"
    out = search(capsys, path, tmp_path / "s.sqlite", "--set", "lr=0.02", "--confirm", str(confirm))
    worst = out["worst"]
    values = read(confirm)
    assert values["seed"] == [0, 1, 2, 3, 4] and values["lr"] == 0.02 and "search" not in values
    assert values["grad_attack"] == worst["grad_attack"] and values["grad_attack_params"] == worst["grad_attack_params"]
    scenarios = expand(values, str(confirm))
    assert len(scenarios) == 5 and {s.seed for s in scenarios} == {0, 1, 2, 3, 4}
    searched = read(path)
    assert all(getattr(scenarios[0], k) == v for k, v in searched.items()
               if k not in ("search", "seed", "lr", "description") and not k.endswith(("_attack", "_attack_params")))


def test_a_confirmation_rewritten_with_another_attack_keeps_the_earlier_one(tmp_path, capsys):
    """A later search at the same point (here: another space) can confirm another attack: the
    attack confirmed before stays beside it (<stem>_earlier_1.toml, the same runs), since the
    worst case is the worst of every attack tried; the same attack again, or another setting
    (another lr), keeps nothing."""
    from robustbn.evaluate import keep_earlier_confirmation, toml_text
    from robustbn.matrix import expand, read

    db, confirm = tmp_path / "s.sqlite", tmp_path / "searched_worst_x.toml"
    one = lambda attack: BASE + f'[search]\ntrials = 1\nseed = 0\n[search.grad]\nattacks = ["{attack}"]\n'
    search(capsys, write(tmp_path, one("sf"), "a.toml"), db, "--confirm", str(confirm))
    first = expand(read(confirm), str(confirm))
    search(capsys, write(tmp_path, one("sf"), "a.toml"), db, "--confirm", str(confirm))  # the same attack
    assert sorted(p.name for p in tmp_path.glob("searched_worst_*")) == ["searched_worst_x.toml"]
    assert main(["attack-search", str(write(tmp_path, one("ipm"), "b.toml")), "--db", str(db), "--quiet",
                 "--confirm", str(confirm)]) == 0
    assert "its runs still count" in capsys.readouterr().err
    kept = tmp_path / "searched_worst_x_earlier_1.toml"
    assert [s.to_dict() for s in expand(read(kept), str(kept))] == [s.to_dict() for s in first]  # the same runs
    assert read(confirm)["grad_attack"] == "ipm" and "every attack confirmed here counts" in read(kept)["description"]
    assert keep_earlier_confirmation(confirm, {**read(confirm), "grad_attack": "sf", "lr": 0.5}) is None
    assert keep_earlier_confirmation(tmp_path / "missing.toml", read(confirm)) is None
    # sf confirmed there again: ipm is kept (earlier_2), and earlier_1, sf's copy now, removed; ipm and sf again:
    # each attack in one file, never a second copy of the confirmation file
    assert main(["attack-search", str(write(tmp_path, one("sf"), "a.toml")), "--db", str(db), "--quiet",
                 "--confirm", str(confirm)]) == 0
    assert "searched_worst_x_earlier_1.toml removed: it held the attack confirmed again" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("searched_worst_x_*")) == ["searched_worst_x_earlier_2.toml"]
    assert read(tmp_path / "searched_worst_x_earlier_2.toml")["grad_attack"] == "ipm"
    for attack in ("ipm", "sf"):
        search(capsys, write(tmp_path, one(attack), f"{attack}.toml"), db, "--confirm", str(confirm))
        (kept,) = tmp_path.glob("searched_worst_x_*")
        assert read(confirm)["grad_attack"] == attack and read(kept)["grad_attack"] == {"ipm": "sf", "sf": "ipm"}[attack]
    # at another lr, an earlier file of the same attack does not stand for this one: its runs are other runs
    kept.write_text(toml_text({**read(confirm), "lr": 0.5}), encoding="utf-8")
    assert keep_earlier_confirmation(confirm, {**read(confirm), "grad_attack": "ipm"}).name == \
        "searched_worst_x_earlier_1.toml"


def test_a_search_tries_the_confirmation_file_it_rewrites(tmp_path, capsys):
    """--try FILE --confirm FILE: FILE's attack is read before the search rewrites it, tried, and
    named in the new description (the curves give a search its own confirmed attack that way where
    no other file holds it: robustbn's docs, curve_search_rows)."""
    from robustbn.labels import attack_words
    from robustbn.matrix import expand, read

    db, confirm = tmp_path / "s.sqlite", tmp_path / "searched_worst_x.toml"
    one = lambda attack: BASE + f'[search]\ntrials = 1\nseed = 0\n[search.grad]\nattacks = ["{attack}"]\n'
    search(capsys, write(tmp_path, one("sf"), "a.toml"), db, "--confirm", str(confirm))
    before = attack_words(expand(read(confirm), str(confirm))[0].to_dict())
    both = BASE + '[search]\ntrials = 1\nseed = 2\n[search.grad]\nattacks = ["ipm", "sf"]\n'
    out = search(capsys, write(tmp_path, both, "b.toml"), db, "--try", str(confirm), "--confirm", str(confirm))
    # seed 2: the sampler's one trial is IPM, then the file's SF is tried
    assert [(t["attack"], t["given"]) for t in out["tried"]] == [("IPM on the gradients", None), (before, str(confirm))]
    assert f"it tried too {confirm.name} ({before})" in read(confirm)["description"]


def test_a_hand_written_board_confirmation_is_kept_too(tmp_path, capsys):
    """The board's first confirmations were written by hand ("The worst attack that `robustbn
    attack-search ...` found"): a search that --try's another attack and confirms it there keeps
    them as well, or their runs would drop out of the board's worst case."""
    from robustbn.evaluate import toml_text
    from robustbn.matrix import read

    db, confirm = tmp_path / "s.sqlite", tmp_path / "searched_worst_x.toml"
    one = lambda attack: BASE + f'[search]\ntrials = 1\nseed = 0\n[search.grad]\nattacks = ["{attack}"]\n'
    search(capsys, write(tmp_path, one("sf"), "a.toml"), db, "--confirm", str(confirm))
    by_hand = {**read(confirm), "description": "The worst attack that `robustbn attack-search a.toml` found"}
    confirm.write_text(toml_text(by_hand), encoding="utf-8")
    assert main(["attack-search", str(write(tmp_path, one("ipm"), "b.toml")), "--db", str(db), "--quiet",
                 "--confirm", str(confirm)]) == 0
    kept = tmp_path / "searched_worst_x_earlier_1.toml"
    assert read(kept)["grad_attack"] == "sf" and read(confirm)["grad_attack"] == "ipm"


def test_a_search_run_on_another_device_resumes_here_and_its_confirmation_is_device_free(tmp_path, capsys, counted):
    """A search whose runs a GPU made (their hashes the GPU's) is read back on this machine:
    nothing runs again, the same outcome. --device reaches the runs, not the confirmation file
    (a run is the same run on any device): a file set for a GPU is searched here on the CPU,
    and its confirmation file still names the GPU."""
    path = write(tmp_path, BASE + 'device = "cuda"\n' + SPACE.format(seed=0))
    db, confirm = tmp_path / "s.sqlite", tmp_path / "searched_worst_x.toml"
    before = search(capsys, path, db, "--device", "cpu", "--confirm", str(confirm))
    assert tomllib.loads(confirm.read_text())["device"] == "cuda"
    with sqlite3.connect(db) as con:
        assert {d for (d,) in con.execute("SELECT device FROM runs")} == {"cpu"}
    ran = len(counted)
    assert ran > 0 and as_if_run_on_cuda(db) == ran
    again = search(capsys, path, db, "--device", "cpu", "--confirm", str(confirm))
    assert len(counted) == ran  # every seed run read back from the GPU's rows

    def unhashed(o):  # the outcome names its runs by hash and device: here the GPU's
        if isinstance(o, dict):
            return {k: unhashed(v) for k, v in o.items() if k not in ("hash", "hashes", "device")}
        return [unhashed(v) for v in o] if isinstance(o, list) else o
    assert unhashed(again) == unhashed(before)
    assert (before["worst"]["device"], again["worst"]["device"]) == ("cpu", "cuda")


def test_a_search_reads_back_the_runs_another_device_stopped_early(tmp_path, capsys, counted):
    """A trial run stopped on its curve on a GPU (stored `pruned`) is read back here with its
    bound, as a finished one is: nothing runs again."""
    text = BASE + SPACE.format(seed=0).replace("seed = 0", "seed = 0\nprune_from = 0.5\nprune_margin = 0.0")
    db = tmp_path / "s.sqlite"
    before = search(capsys, write(tmp_path, text), db)
    assert before["pruned"] > 0
    ran = len(counted)
    as_if_run_on_cuda(db)
    again = search(capsys, write(tmp_path, text), db)
    assert len(counted) == ran
    assert [(t["status"], t.get("bound"), t.get("final_acc")) for t in again["tried"]] == \
        [(t["status"], t.get("bound"), t.get("final_acc")) for t in before["tried"]]


def test_a_device_this_machine_lacks_is_refused_before_the_store_is_made(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    db = tmp_path / "s.sqlite"
    path = write(tmp_path, BASE + SPACE.format(seed=0))
    assert main(["attack-search", str(path), "--db", str(db), "--quiet", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == ("robustbn attack-search: --device cuda: CUDA is not available on this "
                                               "machine; use --device cpu")
    assert not db.exists()


ON = BASE.replace('grad_agg = "mean"', 'grad_agg = "median"') + """lr = 0.03
momentum = 0.5
seed = [5, 6, 7]
grad_attack = ["alie", "honest"]
exclude = [{ grad_attack = "honest", seed = 7 }]
"""


def test_on_searches_the_defense_of_a_tuned_file_at_its_setting(tmp_path, capsys):
    """--on MATRIX: the trials run MATRIX's defense and setting (not the search file's), on the
    [search] seeds; the confirmation file is MATRIX's setting with the found attack on MATRIX's
    seeds, so its runs join MATRIX's cells. --sampler-seed gives a search of its own."""
    from robustbn.matrix import expand, read

    template = write(tmp_path, (BASE + SPACE.format(seed=0)).replace("[search]\n", "[search]\nseeds = [10, 11]\n"))
    on = write(tmp_path, ON, "tuned.toml")
    confirm = tmp_path / "searched_worst_on.toml"
    db = tmp_path / "s.sqlite"
    out = search(capsys, template, db, "--on", str(on), "--trials", "2", "--confirm", str(confirm))
    assert out["trials"] == 2
    with Store(db, readonly=True) as store:
        runs = store.rows()
    assert {r["seed"] for r in runs} == {10, 11}
    assert all(r["grad_agg"] == "median" and r["lr"] == 0.03 and r["momentum"] == 0.5 for r in runs)
    values = read(confirm)
    assert values["seed"] == [5, 6, 7] and "exclude" not in values
    assert values["grad_attack"] == out["worst"]["grad_attack"]
    tuned = expand(read(on), str(on))[0].to_dict()
    for sc in expand(values, str(confirm)):
        d = sc.to_dict()
        assert {k: v for k, v in d.items() if not k.startswith("grad_attack") and k != "seed"} == \
            {k: v for k, v in tuned.items() if not k.startswith("grad_attack") and k != "seed"}
    other = tmp_path / "other.sqlite"
    search(capsys, template, other, "--on", str(on), "--trials", "2", "--sampler-seed", "7")
    assert {h for h, *_ in trials_of(other)} != {h for h, *_ in trials_of(db)}


def test_on_checks_the_tuned_file_with_every_client_sending(tmp_path, capsys):
    """A tuned file whose rule needs 2f < n of the messages it gets (trmean, n = 6, f = 2) holds
    with every client sending, as its runs do; checked as if the Byzantine clients sent nothing
    (4 messages), it was refused and the search never started."""
    space = SPACE.format(seed=0).replace('attacks = ["none", "alie", "scale"]', 'attacks = ["alie", "scale"]')
    template = write(tmp_path, (BASE + space).replace("[search]\n", "[search]\nseeds = [10, 11]\n"))
    on = write(tmp_path, ON.replace('grad_agg = "median"', 'grad_agg = "trmean"').replace("n = 5", "n = 6")
               .replace("f = 1", "f = 2"), "tuned.toml")
    out = search(capsys, template, tmp_path / "s.sqlite", "--on", str(on), "--trials", "1")
    assert out["trials"] == 1
    with Store(tmp_path / "s.sqlite", readonly=True) as store:
        assert {(r["grad_agg"], r["n"], r["f"]) for r in store.rows()} == {("trmean", 6, 2)}


def test_on_takes_one_defense_and_held_out_seeds_in_one_line(tmp_path, capsys):
    db = tmp_path / "s.sqlite"
    template = write(tmp_path, (BASE + SPACE.format(seed=0)).replace("[search]\n", "[search]\nseeds = [10, 11]\n"))
    two = write(tmp_path, ON.replace('grad_agg = "median"', 'grad_agg = ["median", "mean"]'), "two.toml")
    one_line_error(capsys, main(["attack-search", str(template), "--db", str(db), "--on", str(two)]),
                   "--on", "'grad_agg' has several values")
    shared = write(tmp_path, (BASE + SPACE.format(seed=0)).replace("[search]\n", "[search]\nseeds = [6, 10]\n"),
                   "shared.toml")
    one_line_error(capsys, main(["attack-search", str(shared), "--db", str(db), "--on",
                                 str(write(tmp_path, ON, "tuned.toml"))]), "share a seed", "held out")
    one_line_error(capsys, main(["attack-search", str(template), "--db", str(db), "--sampler-seed", "-1"]),
                   "--sampler-seed", "[0, 2**63 - 1]")
    bad = write(tmp_path, ON.replace("lr = 0.03", "lr = -1.0"), "bad.toml")  # MATRIX's error names MATRIX
    one_line_error(capsys, main(["attack-search", str(template), "--db", str(db), "--on", str(bad)]), "bad.toml", "lr")
    seeds = write(tmp_path, ON.replace("seed = [5, 6, 7]", 'seed = "5"'), "seeds.toml")
    one_line_error(capsys, main(["attack-search", str(template), "--db", str(db), "--on", str(seeds)]),
                   "--on", "'seed'")
    assert not db.exists()


def test_on_looks_for_user_modules_beside_both_files(tmp_path):
    """--on: a user's module beside MATRIX (a tuned file in its own folder) stays found, so the
    confirmation file written elsewhere carries its folder."""
    from robustbn.search import load

    (tmp_path / "tuned").mkdir()
    template = write(tmp_path, (BASE + SPACE.format(seed=0)).replace("[search]\n", "[search]\nseeds = [10, 11]\n"))
    on = write(tmp_path / "tuned", ON, "tuned.toml")
    values, _ = load(template, on=on)
    assert str((tmp_path / "tuned").resolve()) in values["search_path"] and values["grad_agg"] == "median"


def test_try_adds_a_known_attack_after_the_samplers_trials_once(tmp_path, capsys, counted):
    """--try FILE: after the sampler's trials (read back from the store where a shorter search ran
    them), FILE's attack is one more trial, run only where no trial tried it; here it is the
    worst, and its confirmation file says where it came from. A point the sampler tried already
    is not tried again."""
    path, db = write(tmp_path, BASE + SPACE.format(seed=0)), tmp_path / "s.sqlite"
    sampled = tmp_path / "searched_worst_sampled.toml"  # the sampler's worst, as a confirmation file holds it
    first = search(capsys, path, db, "--trials", "1", "--confirm", str(sampled))
    assert first["worst"]["grad_attack"] == "alie" and first["worst"]["final_acc"] > 0.2
    ran = len(counted)
    known = write(tmp_path, BASE + 'grad_attack = "scale"\ngrad_attack_params = { factor = -9000.0 }\n', "known.toml")
    confirm = tmp_path / "searched_worst_x.toml"
    out = search(capsys, path, db, "--trials", "1", "--try", str(known), "--confirm", str(confirm))
    assert out["trials"] == 2 and [t["given"] for t in out["tried"]] == [None, str(known)]
    assert out["tried"][0] == first["tried"][0]  # the sampler's trial, read back
    assert len(counted) == ran + 1  # the given attack's one seed, and nothing else
    given = out["tried"][1]
    assert given["attack"].startswith("scaling (factor=-9000") and given["final_acc"] <= 0.15
    assert out["worst"]["trial"] == 2 and out["worst"]["given"] == str(known)
    description = tomllib.loads(confirm.read_text())["description"]
    assert "(trial 2 given by --try known.toml, scaling" in description
    assert description.endswith("; it tried too known.toml (scaling (factor=-9000.0) on the gradients)")
    assert read_confirmed(confirm) == ("scale", {"factor": -9000.0})
    # the same command again: everything read back
    assert search(capsys, path, db, "--trials", "1", "--try", str(known)) == out and len(counted) == ran + 1
    # a --try of the attack the sampler tried: no trial added
    again = search(capsys, path, db, "--trials", "1", "--try", str(sampled))
    assert again["trials"] == 1 and len(counted) == ran + 1


def read_confirmed(path) -> tuple:
    values = tomllib.loads(Path(path).read_text())
    return values["grad_attack"], values.get("grad_attack_params")


def test_try_files_outside_the_space_get_one_line_errors(tmp_path, capsys):
    path, db = write(tmp_path, BASE + SPACE.format(seed=0)), tmp_path / "s.sqlite"
    for name, attack, words in [("a", 'grad_attack = "ipm"\n', ("--try", "'ipm' is not in the search space", "alie")),
                                ("b", 'grad_attack = "scale"\ngrad_attack_params = { factor = 5.0 }\n',
                                 ("--try", "'factor'", "5.0 is outside the search space", "[-10000, -1000]")),
                                ("c", 'grad_attack = "alie"\n', ("--try", "'z'", "not given")),
                                ("d", 'grad_attack = "alie"\ngrad_attack_params = { z = 1.0 }\nbn_attack = "sf"\n',
                                 ("--try", "bn_mean_attack = 'sf'", "does not search it"))]:
        known = write(tmp_path, BASE + attack, f"{name}.toml")
        one_line_error(capsys, main(["attack-search", str(path), "--db", str(db), "--try", str(known)]), *words)
    one_line_error(capsys, main(["attack-search", str(path), "--db", str(db), "--try", str(tmp_path / "none.toml")]),
                   "--try", "none.toml", "no such")
    assert not db.exists()
