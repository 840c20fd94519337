"""`robustbn evaluate`: a user's defense through the board's procedure on a cut-down board (a
root of its own: synthetic data, 7 clients of which 2 Byzantine, a few rounds), its row
recomputed from the store, compared paired with the published best, resumed, and refused
in one line where the input is wrong."""

import json
import statistics
import tomllib

import pytest

from robustbn.cli import main
from robustbn.evaluate import SPACE, toml_text

from matrices import one_line_error

# gamma 1 (iid) and 8 rounds: the model learns, so a defense's worst case is more than chance
SETTING = {"dataset": "synthetic-images", "model": "simple-cnn", "partition": "gamma", "gamma": 1.0, "n": 7, "f": 2,
           "rounds": 8, "batch_size": 8, "eval_every": 4, "lr": 0.1}
BOARD = {**SETTING, "seed": [0, 1, 2, 3, 4], "norm": ["fbn"], "grad_agg": ["median"], "bn_agg": ["median"],
         "client_filter": ["none"], "grad_attack": ["inf", "honest"], "bn_mean_attack": ["honest", "sf"],
         "bn_var_attack": "honest",
         "exclude": [{"grad_attack": "honest", "bn_mean_attack": "honest"},
                     {"grad_attack": "inf", "bn_mean_attack": "sf"}]}
CLEAN = {**{k: v for k, v in BOARD.items() if k != "exclude"},
         "grad_attack": "honest", "bn_mean_attack": "honest"}
MEAN_IN_DISGUISE = '''
import torch
from aggregators import Rule

class Average(Rule):
    """The mean, under another name."""
    name = "average"
    translation_equivariant = scale_equivariant = True

    def rows_out(self, n):
        return 1

    def apply(self, x):
        return x.mean(0)
'''


def make_board(root, catalogue, clean, module, text):
    """A board root: its two matrix files, the published CSV of their runs, and a user's module."""
    import contextlib
    import io

    (root / "scenarios").mkdir()
    (root / "docs").mkdir()
    (root / "scenarios" / "worst_case_fmnist.toml").write_text(toml_text(catalogue))
    (root / "scenarios" / "clean_worst_case_fmnist.toml").write_text(toml_text(clean))
    db = root / "published.sqlite"
    for name in ("worst_case_fmnist", "clean_worst_case_fmnist"):
        assert main(["run", str(root / "scenarios" / f"{name}.toml"), "--db", str(db), "--quiet"]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["results", "--db", str(db), "--format", "csv"]) == 0
    (root / "docs" / "results.csv").write_text(out.getvalue())
    (root / f"{module}.py").write_text(text)
    return root


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    return make_board(tmp_path_factory.mktemp("board"), BOARD, CLEAN, "mine", MEAN_IN_DISGUISE)


def evaluate(capsys, root, db, *extra):
    """`robustbn evaluate mine:Average` in the board's root, where the user's module is."""
    code = main(["evaluate", "mine:Average", "--root", str(root), "--db", str(db), "--trials", "2", "--quiet",
                 "--format", "json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out), out.err


def test_the_mean_in_disguise_is_worse_than_the_published_best_paired(board, tmp_path, capsys, clean_search_path,
                                                                       monkeypatch):
    monkeypatch.chdir(board)
    db = tmp_path / "e.sqlite"
    got, err = evaluate(capsys, board, db)
    assert "runs to do" in err and "CPU hours" in err
    mine = [r for r in got["rows"] if r["yours"]]
    assert [r["norm"] for r in mine] == ["fbn"] and mine[0]["seeds"] == 5
    assert mine[0]["searched"] and "searched_worst_fbn.toml" in mine[0]["searched"]
    c, other = got["comparisons"]  # the best in its threat model, then in the other (none on this board)
    assert (c["threat"], c["against_threat"], other["against_threat"]) == ("root-free", "root-free", "trusted server data")
    assert other["against"] is None and other["verdict"] == "no published row to compare with"
    assert c["against"] == "median" and c["pairs"] == 5 and c["verdict"] == "worse" and c["high"] < 0
    # the row's worst case, recomputed from the store: the lowest mean over seeds of an attack's accuracies
    import sqlite3
    with sqlite3.connect(db) as con:
        runs = [(json.loads(s), st, json.loads(h)) for s, st, h in
                con.execute("SELECT scenario, status, history FROM runs WHERE status IN ('done', 'diverged')")]
    by_attack = {}
    for sc, status, history in runs:
        if sc["seed"] not in range(5) or sc["grad_agg"] != "mine:Average":
            continue
        attack = json.dumps([sc.get(k) for k in ("grad_attack", "grad_attack_params", "bn_mean_attack",
                                                  "bn_mean_attack_params", "bn_var_attack", "bn_var_attack_params")])
        acc = history[-1]["test_acc"] if status == "done" else 0.1
        if "honest" != sc["grad_attack"] or sc.get("bn_mean_attack") not in (None, "honest"):
            by_attack.setdefault(attack, {})[sc["seed"]] = acc
    worst = min(statistics.fmean(v.values()) for v in by_attack.values() if len(v) == 5)
    assert mine[0]["worst_acc"] == pytest.approx(worst, abs=1e-9)
    # the published rows are the CSV's, untouched: median's worst case as the board has it
    published = [r for r in got["rows"] if not r["yours"]]
    assert [r["defense"] for r in published] == ["median"]

    # the same command again: nothing runs, the same answer
    again, err = evaluate(capsys, board, db)
    assert "nothing to run" in err and again == got


def test_a_cut_down_check_is_compared_with_no_published_row(board, tmp_path, capsys, clean_search_path,
                                                            monkeypatch):
    """--set rounds=4 changes the setting: the board's 8-round rows share none of it, so they are
    neither shown nor compared with, and the check's files stand in a folder of their own."""
    monkeypatch.chdir(board)
    db = tmp_path / "e.sqlite"
    got, _ = evaluate(capsys, board, db, "--set", "rounds=4", "--protocol", "fbn")
    assert all(r["yours"] for r in got["rows"]) and len(got["rows"]) == 1
    assert {c["against"] for c in got["comparisons"]} == {None}
    assert {c["verdict"] for c in got["comparisons"]} == {"no published row at this setting (--set rounds=4 changes "
                                                          "the board's)"}
    from robustbn.evaluate import Defense, cut_down, work_folder
    slug = Defense("mine:Average", "mine:Average").slug
    assert [p.name for p in (tmp_path / "evaluate").iterdir()] == [
        work_folder(tmp_path / "evaluate", slug, board, {"rounds": 4}).name]
    assert work_folder(tmp_path / "evaluate", slug, board, {"rounds": 4}).name.startswith(f"{slug}-set-")
    # the board's own value is no cut-down: --set rounds=8 is the full evaluation, in the plain folder
    assert cut_down(board, {"rounds": 8, "gamma": 1.0}) == {}
    assert work_folder(tmp_path / "evaluate", slug, board, {"rounds": 8}) == tmp_path / "evaluate" / slug

def test_the_search_space_is_the_boards():
    from pathlib import Path
    shipped = tomllib.loads((Path(__file__).resolve().parent.parent / "scenarios" / "search_fbn_cc.toml").read_text())
    assert {c: shipped["search"][c] for c in ("grad", "bn_mean", "bn_var")} == SPACE


def test_the_boards_rows_parameters_stay_the_boards_and_a_users_defense_runs_once_per_attack():
    """The shipped catalogue gives one of its rules a parameter axis (bucketing+cc at two
    radii); a user's defense inherits the setting and the attacks, never those parameters."""
    from pathlib import Path

    from robustbn.evaluate import Defense, stage_values
    from robustbn.matrix import expand

    root = Path(__file__).resolve().parent.parent
    assert isinstance(tomllib.loads((root / "scenarios" / "worst_case_fmnist.toml").read_text())["grad_agg_params"],
                      list)
    stages = stage_values(root, Defense("median", "median"), "fbn", {})
    for values in stages.values():
        assert not [k for k in values if k.endswith("_agg_params")]
    catalogue = expand({k: v for k, v in stages["catalogue"].items() if k != "description"})
    assert len(set(map(repr, catalogue))) == len(catalogue) == 55  # 11 attacks x 5 seeds, each once
    assert {sc.grad_agg for sc in catalogue} == {"median"} and not any(sc.grad_agg_params for sc in catalogue)


@pytest.mark.parametrize("args, words", [
    (["nosuch"], ["SPEC 'nosuch'", "unknown aggregation step", "allowed"]),
    (["median", "--protocol", "naive"], ["--protocol 'naive'", "not a protocol of the board", "allowed: fbn"]),
    (["bulyan"], ["bulyan", "n >= 4f + 3"]),
    (["median", "--set", "grad_attack=sf"], ["--set grad_attack", "not a field of the setting"]),
    (["median", "--trials", "0"], ["--trials must be >= 1"]),
    (["median", "--budget", "0.0001"], ["--budget 0.0001", "CPU hours", "cut protocols", "--trials"]),
])
def test_bad_input_gets_one_line(board, tmp_path, capsys, args, words, clean_search_path):
    code = main(["evaluate", *args, "--root", str(board), "--db", str(tmp_path / "e.sqlite"), "--quiet"])
    one_line_error(capsys, code, *words)


def test_outside_the_repository_it_says_where_the_board_is(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["evaluate", "median", "--db", str(tmp_path / "e.sqlite")])
    one_line_error(capsys, code, "scenarios/worst_case_fmnist.toml", "no such file", "--root")


# `robustbn evaluate --attack`: a board whose recommended rows are the mean and the median
ATTACK_BOARD = {**BOARD, "grad_agg": ["mean", "median"], "bn_agg": ["median"], "grad_attack": ["honest", "inf"],
                "bn_mean_attack": "honest", "exclude": [{"grad_attack": "honest"}]}
ATTACK_CLEAN = {**{k: v for k, v in ATTACK_BOARD.items() if k != "exclude"}, "grad_attack": "honest"}
THEIR_ATTACKS = '''
import attacks

class Flip(attacks.Attack):
    """The honest mean, flipped and scaled: what the mean cannot survive."""
    name = "flip"

    def __init__(self, scale: float = 10.0):
        self.scale = float(scale)

    def forge(self, honest, f):
        return (-self.scale * honest.mean(0)).repeat(f, 1)
'''


@pytest.fixture(scope="module")
def attack_board(tmp_path_factory):
    return make_board(tmp_path_factory.mktemp("attack_board"), ATTACK_BOARD, ATTACK_CLEAN, "theirs", THEIR_ATTACKS)


def evaluate_attack(capsys, root, db, *extra):
    code = main(["evaluate", "--attack", "theirs:Flip", "--root", str(root), "--db", str(db), "--quiet",
                 "--format", "json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out), out.err


def test_a_users_attack_names_the_rows_it_lowers_paired(attack_board, tmp_path, capsys, clean_search_path,
                                                        monkeypatch):
    from robustbn.evaluate import NEW_WORST

    monkeypatch.chdir(attack_board)
    db = tmp_path / "a.sqlite"
    got, err = evaluate_attack(capsys, attack_board, db, "--attack-param", "scale=10")
    assert "runs to do" in err and "against 2 rows of fbn" in err
    rows = {r["defense"]: r for r in got["rows"]}
    assert set(rows) == {"mean on the gradients, median on the mean and variance", "median"}
    mean = rows["mean on the gradients, median on the mean and variance"]
    # the flipped mean, ten times over, takes the mean down: a new worst case, paired over 5 seeds
    assert mean["verdict"] == NEW_WORST and mean["pairs"] == 5 and mean["high"] < 0
    assert "lowers 1 of the 2 rows" in got["summary"] or "lowers 2 of the 2 rows" in got["summary"]
    assert "fbn mean on the gradients" in got["summary"]
    # each number recomputed from the store: the attack's runs, and the row's worst from the published CSV
    import sqlite3
    with sqlite3.connect(db) as con:
        mine = {json.loads(s)["seed"]: json.loads(h)[-1]["test_acc"] for s, h in con.execute(
            "SELECT scenario, history FROM runs WHERE status = 'done' AND source LIKE '%mean_on_the_gradients%'")}
    with sqlite3.connect(attack_board / "published.sqlite") as con:
        published = [(json.loads(s), json.loads(h)[-1]["test_acc"]) for s, h in con.execute(
            "SELECT scenario, history FROM runs WHERE status = 'done'")]
    worst = {s["seed"]: a for s, a in published if s["grad_agg"] == "mean" and s["grad_attack"] == "inf"}
    assert sorted(mine) == [0, 1, 2, 3, 4]
    assert mean["attack_acc"] == pytest.approx(statistics.fmean(mine.values()), abs=1e-9)
    assert mean["worst_acc"] == pytest.approx(statistics.fmean(worst.values()), abs=1e-9)
    assert mean["diff"] == pytest.approx(statistics.fmean(mine[s] - worst[s] for s in mine), abs=1e-9)
    # the same command again: nothing runs, the same answer
    again, err = evaluate_attack(capsys, attack_board, db, "--attack-param", "scale=10")
    assert "nothing to run" in err and again == got


def test_an_attack_that_changes_nothing_lowers_no_row(attack_board, tmp_path, capsys, clean_search_path, monkeypatch):
    from robustbn.evaluate import NEW_WORST

    monkeypatch.chdir(attack_board)
    # scale 0: every Byzantine client sends zeros, a message of no size
    got, _ = evaluate_attack(capsys, attack_board, tmp_path / "a.sqlite", "--attack-param", "scale=0",
                             "--protocol", "fbn")
    assert got["rows"] and all(r["verdict"] != NEW_WORST for r in got["rows"])
    assert "lowers 0 of the 2 rows" in got["summary"]


@pytest.mark.parametrize("args, words", [
    (["--attack", "nosuch"], ["--attack 'nosuch'", "unknown attack", "allowed"]),
    (["--attack", "median"], ["--attack 'median'", "a defense, not an attack", "robustbn evaluate median"]),
    (["alie"], ["SPEC 'alie'", "an attack, not a defense", "--attack alie"]),
    (["median", "--attack", "alie"], ["not both"]),
    ([], ["give a defense", "--attack SPEC"]),
    (["--attack", "alie", "--attack-param", "nosuch=1"], ["--attack-param", "does not take nosuch", "allowed: z"]),
    (["--attack", "alie", "--bn", "median"], ["--bn is for a defense"]),
    (["median", "--channel", "bn_mean"], ["--channel is for --attack"]),
    (["--attack", "alie", "--protocol", "naive"], ["--protocol 'naive'", "not a protocol of the board"]),
])
def test_bad_attack_input_gets_one_line(attack_board, tmp_path, capsys, args, words, clean_search_path):
    code = main(["evaluate", *args, "--root", str(attack_board), "--db", str(tmp_path / "e.sqlite"), "--quiet"])
    one_line_error(capsys, code, *words)


def test_the_worked_example_evaluates_its_rule_and_its_attack(attack_board, tmp_path, capsys, clean_search_path,
                                                              monkeypatch):
    """examples/evaluate_your_defense: its README's two commands, on the cut-down board."""
    from pathlib import Path

    from robustbn.evaluate import HIGHER, NEW_WORST, TIED_WORST

    example = Path(__file__).resolve().parent.parent / "examples" / "evaluate_your_defense"
    readme = (example / "README.md").read_text()
    assert "robustbn evaluate myrule:DropFarthest --protocol fbn" in readme
    assert "robustbn evaluate --attack myattack:NormMatchedFlip --protocol fbn" in readme
    monkeypatch.chdir(example)  # where the user's modules are
    db = tmp_path / "e.sqlite"
    code = main(["evaluate", "myrule:DropFarthest", "--protocol", "fbn", "--root", str(attack_board), "--db", str(db),
                 "--jobs", "2", "--trials", "2", "--quiet", "--format", "json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    got = json.loads(out.out)
    (mine,) = [r for r in got["rows"] if r["yours"]]
    assert mine["defense"] == "myrule:DropFarthest" and mine["seeds"] == 5 and mine["searched"]
    assert mine["attacks_run"] == 2  # inf and the searched attack (the catalogue's honest row is its clean run)
    c = got["comparisons"][0]
    assert c["threat"] == c["against_threat"] == "root-free" and c["pairs"] == 5 and c["verdict"] in ("better", "worse", "tied")
    assert c["against"] in {r["defense"] for r in got["rows"] if not r["yours"]}

    code = main(["evaluate", "--attack", "myattack:NormMatchedFlip", "--protocol", "fbn", "--root", str(attack_board),
                 "--db", str(db), "--jobs", "2", "--quiet"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "NormMatchedFlip on grad lowers" in out.out and "of the 2 rows the board recommends" in out.out
    assert sum(out.out.count(w) for w in (NEW_WORST, TIED_WORST, HIGHER)) >= 2
