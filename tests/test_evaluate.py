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


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """A board root: its two matrix files and the published CSV of their runs."""
    root = tmp_path_factory.mktemp("board")
    (root / "scenarios").mkdir()
    (root / "docs").mkdir()
    (root / "scenarios" / "worst_case_fmnist.toml").write_text(toml_text(BOARD))
    (root / "scenarios" / "clean_worst_case_fmnist.toml").write_text(toml_text(CLEAN))
    db = root / "published.sqlite"
    for name in ("worst_case_fmnist", "clean_worst_case_fmnist"):
        assert main(["run", str(root / "scenarios" / f"{name}.toml"), "--db", str(db), "--quiet"]) == 0
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["results", "--db", str(db), "--format", "csv"]) == 0
    (root / "docs" / "results.csv").write_text(out.getvalue())
    (root / "mine.py").write_text(MEAN_IN_DISGUISE)
    return root


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
    (c,) = got["comparisons"]
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


def test_the_search_space_is_the_boards():
    from pathlib import Path
    shipped = tomllib.loads((Path(__file__).resolve().parent.parent / "scenarios" / "search_fbn_cc.toml").read_text())
    assert {c: shipped["search"][c] for c in ("grad", "bn_mean", "bn_var")} == SPACE


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
