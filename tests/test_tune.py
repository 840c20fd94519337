"""`robustbn tune`: ByzFL's rule (the max over a grid of the worst case over attacks) on tuning
seeds, recomputed from the store; the tuned files; bad input in one line."""

import json
import statistics
import tomllib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from robustbn.channels import expand_channels
from robustbn.cli import main
from robustbn.evaluate import toml_text
from robustbn.matrix import expand, read
from robustbn.store import scenario_hash
from robustbn.tune import Tuning, choose, settled_choices

from matrices import as_if_run_on_cuda, one_line_error

# gamma 1 and 8 rounds: at lr 0.1 the model learns, at lr 1e-4 it cannot move off chance
MATRIX = {"dataset": "synthetic-images", "model": "simple-cnn", "partition": "gamma", "gamma": 1.0, "n": 7, "f": 2,
          "rounds": 8, "batch_size": 8, "eval_every": 4, "norm": "fbn", "grad_agg": ["mean", "median"],
          "bn_agg": "median", "grad_attack": ["inf", "nan"], "bn_mean_attack": "honest", "bn_var_attack": "honest",
          "seed": 0}


@pytest.fixture
def matrix(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(toml_text(MATRIX))
    return path


def test_tune_takes_the_max_over_the_grid_of_the_worst_case_over_attacks(matrix, tmp_path, capsys):
    db = tmp_path / "t.sqlite"
    argv = ["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--db", str(db), "--jobs", "2", "--quiet",
            "--format", "json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert "2 grid points x 8 runs on seeds 10, 11: 16 runs, of which the rule reads the 16 attacked" in out.err
    assert len(got["defenses"]) == 2
    # recomputed from the store: per defense and lr, the lowest mean over the seeds of an attack's final accuracy
    import sqlite3
    with sqlite3.connect(db) as con:
        runs = [(json.loads(s), json.loads(h)[-1]["test_acc"]) for s, h in
                con.execute("SELECT scenario, history FROM runs WHERE status = 'done'")]
    assert {sc["seed"] for sc, _ in runs} == {10, 11}
    for d in got["defenses"]:
        agg = "mean" if d["defense"].startswith("mean") else "median"
        worst = {}
        for lr in (0.0001, 0.1):
            by_attack = {}
            for sc, acc in runs:
                if sc["grad_agg"] == agg and sc["lr"] == lr:
                    by_attack.setdefault(sc["grad_attack"], []).append(acc)
            worst[lr] = min(statistics.fmean(v) for v in by_attack.values())
        assert [s["worst_acc"] for s in d["scores"]] == pytest.approx([worst[0.0001], worst[0.1]], abs=1e-9)
        chosen = max(worst, key=worst.get)
        assert d["chosen"] == {"lr": chosen} and d["chosen_acc"] == pytest.approx(worst[chosen], abs=1e-9)
        # its tuned file: this defense alone, at its chosen lr, on the reporting seeds 0-4, every attack
        values = read(d["file"])
        assert values["lr"] == chosen and values["seed"] == [0, 1, 2, 3, 4] and values["grad_agg"] == agg
        assert len(expand(values, d["file"])) == 2 * 5
    # the median learns at lr 0.1 under these attacks (the server drops non-finite messages); at 1e-4 nothing does
    median = next(d for d in got["defenses"] if d["defense"].startswith("median"))
    assert median["chosen"] == {"lr": 0.1}

    # the same command again: nothing runs, the same answer
    assert main(argv) == 0
    again = capsys.readouterr()
    assert json.loads(again.out) == got
    assert main(argv[:-2]) == 0  # the table: no choice here is at chance
    assert "(at chance)" not in capsys.readouterr().out
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == len(runs)

    # runs of the same file on other seeds, in the same store, are no part of this tuning's answer
    assert main([*argv, "--seeds", "12"]) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == got

    # the whole grid (--full) chooses the same for every defense
    assert main([*argv, "--full"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert [(d["defense"], d["chosen"]) for d in full["defenses"]] == [(d["defense"], d["chosen"]) for d in got["defenses"]]


def test_the_table_marks_a_choice_among_broken_points(tmp_path, capsys):
    """Where every grid point of a defense stands within AT_CHANCE of chance under some attack,
    the rule still picks one (the highest, ties the first), and the table says it is at chance."""
    path = tmp_path / "broken.toml"
    path.write_text(toml_text({**MATRIX, "grad_agg": "mean", "grad_attack": "scale",
                               "grad_attack_params": {"factor": -1e4}}))
    assert main(["tune", str(path), "--grid", "lr=[0.05,0.1]", "--db", str(tmp_path / "t.sqlite"), "--quiet",
                 "--format", "json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)["defenses"]
    assert all(s["worst_acc"] <= 0.1 + 0.01 for s in d["scores"]), d["scores"]  # the setting breaks the mean
    assert main(["tune", str(path), "--grid", "lr=[0.05,0.1]", "--db", str(tmp_path / "t.sqlite"), "--quiet"]) == 0
    table = capsys.readouterr().out
    (row,) = [line for line in table.splitlines() if line.startswith("fbn")]
    assert row.endswith("lr=0.05 (at chance)")
    assert "1 choice (at chance): every grid point within 1 point of chance" in table
    # the grid given the other way round: the same runs, the columns still in increasing lr, the tie to its first
    assert main(["tune", str(path), "--grid", "lr=[0.1,0.05]", "--db", str(tmp_path / "t.sqlite"), "--quiet"]) == 0
    table = capsys.readouterr().out
    (head,) = [line for line in table.splitlines() if line.startswith("norm")]
    assert head.index("lr=0.05") < head.index("lr=0.1")
    (row,) = [line for line in table.splitlines() if line.startswith("fbn")]
    assert row.endswith("lr=0.1 (at chance)") and "(ties: the first in the grid's order, lr=0.1; lr=0.05)" in table


@pytest.mark.parametrize("args, words", [
    ([], ["give --grid"]),
    (["--grid", "seed=[1,2]"], ["--grid seed", "not a field to tune"]),
    (["--grid", "lr=0.1"], ["--grid lr: '0.1' is not a list", "at least 2 values", "e.g. --grid lr=[0.01,0.05,0.1]"]),
    (["--grid", "grad_agg_params=[{tau=2.0}]"], ["--grid grad_agg_params: one value;",
                                                "e.g. --grid grad_agg_params=[{tau=1.0},{tau=10.0}]"]),
    (["--grid", "grad_agg=[mean,median]"], ["--grid grad_agg", "picks the defense itself"]),
    (["--grid", "client_filter=[none,bnguard]"], ["--grid client_filter", "grid their parameters"]),
    (["--grid", "lr=[0.1,0.2]", "--set", "lr=[0.1,0.2]"], ["--grid lr", "already varies it"]),
    (["--grid", "lr=[0.1,0.2]", "--seeds", "0,1"], ["--seeds 0,1", "must not be reported"]),
    (["--grid", "lr=[0.1,0.2]", "--seeds", "a"], ["--seeds 'a'", "comma-separated integers"]),
])
def test_bad_tune_input_gets_one_line(matrix, tmp_path, capsys, args, words):
    code = main(["tune", str(matrix), "--db", str(tmp_path / "t.sqlite"), *args])
    one_line_error(capsys, code, *words)


def test_an_lr_grid_under_absolute_milestones_says_which_rounds_it_tunes(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, "lr_milestones": [[5, 0.01]]}))
    assert main(["tune", str(path), "--db", str(tmp_path / "t.sqlite"), "--grid", "lr=[0.1,0.2]", "--plan"]) == 0
    assert "lr_milestones = [[5, 0.01]], so --grid lr changes the learning rate of rounds 1-4 only" in \
        capsys.readouterr().err
    assert main(["tune", str(path), "--db", str(tmp_path / "t.sqlite"), "--grid", "momentum=[0.0,0.9]", "--plan"]) == 0
    assert "lr_milestones" not in capsys.readouterr().err
    assert not (tmp_path / "t.sqlite").exists()  # a plan runs nothing and makes no store


def test_the_tuning_file_evaluates_once_on_the_whole_test_set(tmp_path, capsys):
    """One evaluation a run, the last (on every test example): a matrix's eval_subset would
    change only the tuning runs' hashes, so the tuning file leaves it out and its tuned files
    keep it."""
    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, "eval_subset": 40}))
    out = tmp_path / "out"
    assert main(["tune", str(path), "--db", str(tmp_path / "t.sqlite"), "--grid", "lr=[0.1,0.2]", "--plan", "--out",
                 str(out)]) == 0
    tuning = tomllib.loads((out / "tune_m.toml").read_text())
    assert tuning["eval_every"] == MATRIX["rounds"] and "eval_subset" not in tuning


def test_a_rules_parameter_is_tuned_as_the_runs_hold_it(tmp_path, capsys):
    """CC's tau (issue 38: a knob that decides a defense): the grid's `{tau = 1}` is stored with
    cc's defaults filled in; the runs find their point, the defense is one row whatever its tau,
    and its tuned file holds the chosen parameters as the grid spells them."""
    path = tmp_path / "cc.toml"
    path.write_text(toml_text({**MATRIX, "grad_agg": "cc"}))
    argv = ["tune", str(path), "--grid", "grad_agg_params=[{tau=0.01},{tau=10}]", "--db", str(tmp_path / "t.sqlite"),
            "--quiet", "--format", "json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["defenses"]
    assert len(got) == 1 and got[0]["defense"] == "cc on the gradients, median on the mean and variance"
    points = [s["point"]["grad_agg_params"] for s in got[0]["scores"]]
    assert points == [{"tau": 0.01}, {"tau": 10}]  # as the grid gives them
    assert all(s["seeds"] == 2 for s in got[0]["scores"])
    tuned = tomllib.loads(open(got[0]["file"]).read())
    assert tuned["grad_agg_params"] == got[0]["chosen"]["grad_agg_params"] and tuned["seed"] == [0, 1, 2, 3, 4]
    # two spellings of one value, once cc's defaults are filled in
    code = main(["tune", str(path), "--grid", "grad_agg_params=[{tau=1},{tau=1.0,center=\"previous\"}]", "--db",
                 str(tmp_path / "t.sqlite"), "--plan"])
    one_line_error(capsys, code, "--grid", "are the same runs")


@pytest.mark.parametrize("grid, set_", [
    ("agg_f=[1,2]", []),                                   # f = 2: agg_f = 2 is stored as no value
    ("root_size=[20,40]", ["--set", "grad_agg=fltrust"]),  # a defense field its label spells out
])
def test_any_field_of_a_defense_is_tuned_as_one_defense_and_its_file_loads(tmp_path, capsys, grid, set_):
    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, "grad_agg": "median"}))
    argv = ["tune", str(path), "--grid", grid, *set_, "--db", str(tmp_path / "t.sqlite"), "--quiet", "--format",
            "json", "--seeds", "10"]
    assert main(argv) == 0
    (d,) = json.loads(capsys.readouterr().out)["defenses"]
    key = grid.split("=")[0]
    assert d["complete"] and d["chosen"][key] in tomllib.loads(f"v = {grid.split('=', 1)[1]}")["v"]
    scenarios = expand(read(d["file"]), d["file"])  # the tuned file loads, at the chosen point only
    assert len(scenarios) == 5 * 2 and len({repr(getattr(sc, key)) for sc in scenarios}) == 1


def test_lr_milestones_is_one_value_of_a_matrix_and_can_be_the_grid(tmp_path, capsys):
    """A plain lr_milestones is one schedule: no setting of its own (tuned files are not named by
    it) and it can be gridded; starting at round 1, an lr grid changes no round, and tune says so."""
    from robustbn.tune import setting_fields

    assert setting_fields({**MATRIX, "lr_milestones": [[5, 0.01]]}) == []
    assert setting_fields({**MATRIX, "lr_milestones": [[[5, 0.01]], [[6, 0.01]]]}) == ["lr_milestones"]
    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, "lr_milestones": [[1, 0.01]]}))
    db = str(tmp_path / "t.sqlite")
    assert main(["tune", str(path), "--db", db, "--grid", "lr=[0.1,0.2]", "--plan"]) == 0
    assert "so --grid lr changes no round at all" in capsys.readouterr().err
    assert main(["tune", str(path), "--db", db, "--grid", "lr_milestones=[[[4,0.01]],[[4,0.02]]]", "--plan"]) == 0
    assert "2 grid points" in capsys.readouterr().err


def test_a_matrix_over_settings_is_tuned_point_by_point(tmp_path, capsys):
    """gamma takes two values: each (defense, gamma) gets its own choice and its own tuned file,
    at that gamma only (one file per defense would let one point's choice overwrite another's)."""
    path = tmp_path / "curve.toml"
    # an exclude list (as scenarios/robustness_fmnist.toml has) is no setting to tune apart
    path.write_text(toml_text({**MATRIX, "gamma": [0.0, 1.0], "grad_agg": "median", "grad_attack": ["nan", "inf"],
                               "exclude": [{"grad_attack": "inf"}]}))
    argv = ["tune", str(path), "--grid", "lr=[0.0001,0.1]", "--db", str(tmp_path / "t.sqlite"), "--jobs", "2",
            "--quiet", "--format", "json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert sorted(d["at"]["gamma"] for d in got["defenses"]) == [0.0, 1.0]
    assert all(set(d["at"]) == {"gamma"} for d in got["defenses"])
    files = [d["file"] for d in got["defenses"]]
    assert len(files) == 2 and len(set(files)) == 2
    gammas = set()
    for d in got["defenses"]:
        values = read(d["file"])
        gammas.add(values["gamma"])
        assert values["gamma"] == d["at"]["gamma"]
        assert values["lr"] == d["chosen"]["lr"] and f"gamma_{str(values['gamma']).replace('.', '_')}" in d["file"]
        assert {s.gamma for s in expand(values, d["file"])} == {values["gamma"]}
        assert len(expand(values, d["file"])) == 5
    assert gammas == {0.0, 1.0}


# --- pruning: the same choice as the full grid, from fewer runs -------------------------------------------
GRID = {"lr": [0.01, 0.05, 0.1]}
SMALL = {"dataset": "synthetic-images", "model": "simple-cnn", "n": 7, "f": 2, "rounds": 8, "norm": "fbn",
         "grad_agg": ["mean", "median", "trmean"], "bn_agg": "median", "grad_attack": ["alie", "ipm", "honest"],
         "bn_mean_attack": ["honest", "sf"], "bn_var_attack": "honest", "seed": [10, 11], "lr": GRID["lr"]}
PLANNED = [(scenario_hash(sc.to_dict()), expand_channels(sc.to_dict())) for sc in expand(SMALL, "small")]
# None: the run diverged (counts at chance, 0.1); 10% also as float32 spells it, off in the last bits
F32_TENTH_UP, F32_TENTH_DOWN = 0.10000000149011612, 0.09999999403953552
ACCS = [0.1, F32_TENTH_UP, F32_TENTH_DOWN, 0.3, 0.5, 0.7, None]


def _row(sc, acc):
    return {**sc, "status": "diverged" if acc is None else "done", "final_acc": acc}


@settings(max_examples=150, deadline=None)
@given(accs=st.lists(st.sampled_from(ACCS), min_size=len(PLANNED), max_size=len(PLANNED)))
def test_pruning_chooses_what_the_full_grid_chooses(accs):
    """Whatever the runs give (few distinct values, so ties are common, and diverged runs): the
    waves end with every point finished or pruned, and choose() on the runs they ran picks for
    every defense the point it picks on every run of the grid. Best first: every run went to a
    point whose finished attacks left it at or above the score finally chosen."""
    oracle = {h: _row(sc, acc) for (h, sc), acc in zip(PLANNED, accs)}
    plan = Tuning(PLANNED, GRID)
    where = {h: (ident, i) for ident, by_point in plan.defenses.items() for i, attacks in enumerate(by_point)
             for hashes in attacks.values() for h in hashes}
    full = {(d["defense"], d["chosen"]["lr"]) for d in choose(list(oracle.values()), GRID)}
    finished, waves, bounds = {}, 0, []
    while wave := plan.next_wave(finished):
        assert not set(wave) & set(finished) and set(wave) <= plan.hashes
        # mid-tuning, a defense counts as chosen (its tuned file is written) only once settled, and then for good
        settled = plan.settled(finished)
        for d in settled_choices(finished, GRID, plan):
            assert d["complete"] == settled[plan.identity(d["setting"])]
            assert not d["complete"] or (d["defense"], d["chosen"]["lr"]) in full
        states = plan.state(finished)
        bounds += [(where[h][0], states[where[h][0]][where[h][1]]["bound"]) for h in wave]
        finished.update({h: oracle[h] for h in wave})
        waves += 1
        assert waves <= len(PLANNED)
    assert all(plan.settled(finished).values())
    chosen = choose(list(finished.values()), GRID, plan.pruned(finished))
    assert {(d["defense"], d["chosen"]["lr"]) for d in chosen} == full
    score = {}
    for d in chosen:  # complete, and the chosen point is never one that was pruned
        assert d["complete"] and not next(s for s in d["scores"] if s["point"] == d["chosen"])["pruned"]
        score[plan.identity(d["setting"])] = d["chosen_acc"]
    # a diverged run is at chance in both: the bound's means and the worst case
    assert all(bound is None or bound >= score[ident] - 1e-6 for ident, bound in bounds)
    # the clean runs never run
    assert not any(oracle[h]["grad_attack"] == "honest" and oracle[h]["bn_mean_attack"] == "honest" for h in finished)


def _mean_defense():
    planned = [(h, sc) for h, sc in PLANNED if sc["grad_agg"] == "mean" and sc["bn_mean_attack"] == "honest"]
    return planned, Tuning(planned, GRID)


def test_best_first_runs_each_point_once_then_the_highest():
    """Wave 1: every point's first attack (ALIE: nothing is known yet, so file order). Then the
    point left highest runs its next attack (IPM) until it has run them all; a point below it
    is not run again. Level with a finished point, the earlier point runs on: ties go to it."""
    def tune(acc):
        planned, plan = _mean_defense()
        oracle = {h: _row(sc, acc[sc["lr"]].get(sc["grad_attack"])) for h, sc in planned}
        finished, waves = {}, []
        while wave := plan.next_wave(finished):
            waves.append(sorted((oracle[h]["lr"], oracle[h]["grad_attack"]) for h in wave))
            finished.update({h: oracle[h] for h in wave})
        assert all(plan.settled(finished).values())
        (d,) = choose(list(finished.values()), GRID, plan.pruned(finished))
        pruned = [s["pruned"] for s in next(iter(plan.state(finished).values()))]
        assert [s["pruned"] for s in d["scores"]] == pruned  # what the command prints
        return waves, pruned, d["chosen"]

    first = [(0.01, "alie")] * 2 + [(0.05, "alie")] * 2 + [(0.1, "alie")] * 2
    waves, pruned, chosen = tune({0.01: {"alie": 0.3, "ipm": 0.9}, 0.05: {"alie": 0.5, "ipm": 0.5},
                                  0.1: {"alie": 0.7, "ipm": 0.6}})
    assert waves == [first, [(0.1, "ipm")] * 2] and pruned == [True, True, False] and chosen == {"lr": 0.1}
    # 0.05 level with 0.1's finished 0.6 after ALIE: it comes first in the grid, so it runs on, and wins the tie
    waves, pruned, chosen = tune({0.01: {"alie": 0.3, "ipm": 0.9}, 0.05: {"alie": 0.6, "ipm": 0.6},
                                  0.1: {"alie": 0.7, "ipm": 0.6}})
    assert waves == [first, [(0.1, "ipm")] * 2, [(0.05, "ipm")] * 2] and chosen == {"lr": 0.05}
    assert pruned == [True, False, False]


def test_a_run_that_failed_is_not_offered_again_and_its_point_goes_on():
    planned, plan = _mean_defense()
    lr = {h: sc["lr"] for h, sc in planned}
    first = plan.next_wave({})
    failed = frozenset(h for h in first if lr[h] == 0.1)
    again = plan.next_wave({h: _row({}, 0.5) for h in first if h not in failed}, skip=failed)
    assert not set(again) & failed and {lr[h] for h in again} == {0.1} and len(again) == 2  # its other attack


def test_a_point_with_nothing_left_to_run_is_passed_over():
    planned, plan = _mean_defense()
    sc = {h: s for h, s in planned}
    alie = {h: _row(s, {0.01: 0.5, 0.05: 0.9, 0.1: 0.7}[s["lr"]]) for h, s in planned if s["grad_attack"] == "alie"}
    failed = frozenset(h for h, s in planned if s["lr"] == 0.05 and s["grad_attack"] == "ipm")
    wave = plan.next_wave(alie, skip=failed)
    assert {(sc[h]["lr"], sc[h]["grad_attack"]) for h in wave} == {(0.1, "ipm")}


def test_integer_grid_values_match_the_stored_floats():
    """--grid 'lr=[1,0.1]': the scenarios hold 1.0; the grid's 1 is the same point."""
    planned = [(scenario_hash(sc.to_dict()), expand_channels(sc.to_dict()))
               for sc in expand({**SMALL, "lr": [1, 0.1]}, "ints")]
    plan = Tuning(planned, {"lr": [1, 0.1]})
    assert all(len(points) == 2 and all(points) for points in plan.defenses.values())
    finished = {h: _row(sc, 0.5) for h, sc in planned if h in plan.hashes}
    assert plan.next_wave(finished) == []
    assert all(d["complete"] and d["chosen"] == {"lr": 1} for d in choose(list(finished.values()), {"lr": [1, 0.1]}))


def test_the_curve_pipeline_tune_run_search_on_a_tuned_file_and_confirm(tmp_path, capsys):
    """End to end, as the robustness curves run: tune a matrix over gamma, run the tuned files,
    search one tuned defense where it stands (attack-search --on) and run its confirmation. The
    confirmation's runs join the tuned file's cell: one worst-case row per point, at the tuned
    lr, whose attacks are the catalogue's and the searched one."""
    db = str(tmp_path / "t.sqlite")
    curve = tmp_path / "curve.toml"
    curve.write_text(toml_text({**MATRIX, "gamma": [0.0, 1.0], "grad_agg": "median", "grad_attack": ["alie", "honest"],
                                "eval_subset": 20}))
    out = tmp_path / "tuned"
    assert main(["tune", str(curve), "--grid", "lr=[0.0001,0.1]", "--db", db, "--out", str(out), "--jobs", "2",
                 "--quiet", "--format", "json"]) == 0
    files = sorted(str(p) for p in out.glob("tuned_*.toml"))
    assert len(files) == 2
    capsys.readouterr()
    assert main(["run", *files, "--db", db, "--jobs", "2", "--quiet"]) == 0
    space = tmp_path / "space.toml"
    space.write_text('norm = "naive"\ngrad_agg = "mean"\n[search]\ntrials = 2\nseed = 0\nseeds = [10, 11]\n'
                     '[search.grad]\nattacks = ["scale"]\n[search.grad.scale]\nfactor = [-1e4, -1e3]\n')
    at = next(f for f in files if "gamma_1" in f)
    confirm = out / "searched_worst_at_gamma_1.toml"
    assert main(["attack-search", str(space), "--on", at, "--db", db, "--quiet", "--confirm", str(confirm)]) == 0
    assert main(["run", str(confirm), "--db", db, "--quiet"]) == 0
    capsys.readouterr()
    matrices = [a for f in [*files, str(confirm)] for a in ("--matrix", f)]
    assert main(["results", "--worst-case", "--tuned", "lr", *matrices, "--db", db, "--format", "json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["f"]]
    assert sorted(r["gamma"] for r in rows) == [0.0, 1.0]
    lrs = {read(f)["gamma"]: read(f)["lr"] for f in files}
    for r in rows:
        assert r["lr"] == lrs[r["gamma"]] and r["seeds"] == 5 and r["norm"] == "fbn" and r["grad_agg"] == "median"
        assert r["attacks"] == (2 if r["gamma"] == 1.0 else 1)


def test_a_defense_s_tuned_file_is_written_once_it_settles_and_then_never_changes(tmp_path, monkeypatch, capsys):
    """`robustbn tune` writes a tuned file after every wave, for each defense whose choice is
    settled: the mean, with one attack, settles in the first wave and its file is there before
    the median (two attacks) runs its second; no wave runs a settled defense again, and no file
    changes once written."""
    import robustbn.execute as execute

    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, "exclude": [{"grad_agg": "mean", "grad_attack": "nan"}]}))
    out = tmp_path / "tuned"
    seen, real = [], execute.run_matrix

    def recording(scenarios, *args, **kwargs):
        files = {p.name: p.read_text() for p in out.glob("tuned_*.toml")}
        seen.append((files, {sc.grad_agg for sc in scenarios}))
        return real(scenarios, *args, **kwargs)

    monkeypatch.setattr(execute, "run_matrix", recording)
    assert main(["tune", str(path), "--grid", "lr=[0.0001,0.1]", "--db", str(tmp_path / "t.sqlite"), "--out",
                 str(out), "--jobs", "1", "--quiet", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    final = {p.name: p.read_text() for p in out.glob("tuned_*.toml")}
    assert len(final) == 2 and len(seen) >= 2
    mean_file = next(name for name in final if "mean" in name)
    assert seen[0][0] == {}  # nothing is settled before the first wave
    assert all(mean_file in files for files, _ in seen[1:])  # the mean settled in the first wave ...
    assert any(aggs == {"median"} for _, aggs in seen[1:])  # ... while the median still ran
    for files, aggs in seen:
        assert not {"mean" if "mean" in name else "median" for name in files} & aggs  # a settled defense never runs
        assert all(final[name] == text for name, text in files.items())  # nor does its file change
    assert {Path(d["file"]).name for d in got["defenses"]} == set(final)


def test_a_stopped_tune_writes_the_choices_its_last_runs_settled(tmp_path, monkeypatch, capsys):
    """A tune stopped (SIGTERM, a lane halted) just after a wave's runs landed writes the tuned
    files those runs settled, as the next wave would have: an export that follows the stop finds
    each settled choice in its file, not the one before it."""
    import signal

    import robustbn.execute as execute
    from robustbn.checkpoint import Interrupted

    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, "exclude": [{"grad_agg": "mean", "grad_attack": "nan"}]}))
    out, real = tmp_path / "tuned", execute.run_matrix

    def stopped_after_its_runs(scenarios, *args, **kwargs):
        real(scenarios, *args, **kwargs)
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(execute, "run_matrix", stopped_after_its_runs)
    argv = ["tune", str(path), "--grid", "lr=[0.0001,0.1]", "--db", str(tmp_path / "t.sqlite"), "--out", str(out),
            "--jobs", "1", "--quiet"]
    assert main(argv) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in capsys.readouterr().err
    # the first wave ran each point's most harmful attack: the mean's only one (settled), the median's first
    settled = "tuned_fbn_mean_on_the_gradients_median_on_the_mean_and_variance.toml"
    assert [p.name for p in out.glob("tuned_*")] == [settled]  # and no partial file
    monkeypatch.setattr(execute, "run_matrix", real)
    assert main([*argv, "--format", "json"]) == 0  # resumed to the end: the stop's file was the choice
    mean = next(d for d in json.loads(capsys.readouterr().out)["defenses"] if d["defense"].startswith("mean"))
    assert read(mean["file"])["lr"] == mean["chosen"]["lr"]


@settings(max_examples=200, deadline=None)
@given(ranks=st.lists(st.integers(0, 3), max_size=40), min_runs=st.integers(0, 20))
def test_a_wave_cut_to_its_first_runs_keeps_whole_ranks_best_first(ranks, min_runs):
    from robustbn.tune import first_runs

    wave = [f"h{i}" for i in range(len(ranks))]
    rank = dict(zip(wave, ranks))
    kept = first_runs(wave, rank, min_runs)
    assert kept == sorted(kept, key=lambda h: (rank[h], wave.index(h)))  # best rank first, the wave's order within
    held = sorted(set(ranks))
    taken = sorted({rank[h] for h in kept})
    assert taken == held[:len(taken)]  # the best ranks, none skipped
    assert all(sum(rank[h] == r for h in kept) == ranks.count(r) for r in taken)  # each rank whole
    # as few ranks as reach min_runs (all of them where the wave is smaller)
    assert len(kept) >= min(min_runs, len(wave)) or not wave
    if len(taken) > 1:
        assert len([h for h in kept if rank[h] != taken[-1]]) < min_runs
    assert bool(kept) == bool(wave)


def test_first_tunes_one_group_of_defenses_before_the_rest_and_chooses_the_same(matrix, tmp_path, monkeypatch,
                                                                                 capsys):
    """--first grad_agg=median: every wave runs the median's runs while it has any, the mean's only
    after; the choices and files are those of the tuning without --first."""
    import robustbn.execute as execute
    import robustbn.tune as tune

    waves, real = [], execute.run_matrix
    monkeypatch.setattr(execute, "run_matrix", lambda scs, *a, **k: (waves.append({sc.grad_agg for sc in scs}),
                                                                       real(scs, *a, **k))[1])
    monkeypatch.setattr(tune, "MIN_WAVE", 1)  # the tiny matrix's waves are all shorter than the default
    answers = {}
    for name, extra in (("plain", []), ("first", ["--first", "grad_agg=median"])):
        waves.clear()
        assert main(["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--db", str(tmp_path / f"{name}.sqlite"),
                     "--out", str(tmp_path / name), "--jobs", "1", "--quiet", "--format", "json", *extra]) == 0
        out = capsys.readouterr()
        answers[name] = [(d["defense"], d["chosen"], d["chosen_acc"]) for d in json.loads(out.out)["defenses"]]
        if name == "first":
            assert "tune: --first grad_agg: 'median' 1 defense, then the rest 1 defense" in out.err
            assert all(len(w) == 1 for w in waves)
            assert waves.index({"mean"}) > max(i for i, w in enumerate(waves) if w == {"median"})
        else:
            assert waves[0] == {"mean", "median"}
    assert answers["first"] == answers["plain"]
    assert sorted(p.read_text() for p in (tmp_path / "first").glob("tuned_*.toml")) == \
        sorted(p.read_text() for p in (tmp_path / "plain").glob("tuned_*.toml"))


@pytest.mark.parametrize("args, words", [
    (["--first", "norm=naive"], ["--first norm='naive'", "no run of the tuning has it", "norm in 'fbn'"]),
    (["--first", "colour=red"], ["--first colour", "not a field"]),
    (["--first", "seed=10"], ["--first seed", "not a field"]),
    (["--first", "norm=fbn", "--full"], ["--first", "--full", "give one of them"]),
])
def test_bad_first_gets_one_line(matrix, tmp_path, capsys, args, words):
    code = main(["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--db", str(tmp_path / "t.sqlite"), "--plan",
                 *args])
    one_line_error(capsys, code, *words)


def test_tuning_runs_and_search_trials_stay_out_of_what_the_tuned_and_confirmed_files_report(tmp_path, capsys):
    """A tuned file's cell at its lr is its tuning's cell on other seeds (here eval_every = rounds,
    as a tuning sets it), and a confirmation's cell its search trial's: --matrix FILE reads the
    file's seeds 0-4, not the tuning's 10 and 11 nor the trial's, which chose what they report;
    the report leaves both out; the store's own views leave the tuning's out and say so."""
    db = str(tmp_path / "t.sqlite")
    matrix = tmp_path / "m.toml"
    matrix.write_text(toml_text({**MATRIX, "grad_agg": "median", "grad_attack": "alie", "eval_every": 8}))
    out = tmp_path / "tuned"
    assert main(["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--db", db, "--out", str(out), "--quiet"]) == 0
    (tuned,) = [str(p) for p in out.glob("tuned_*.toml")]
    space = tmp_path / "space.toml"
    space.write_text('norm = "naive"\ngrad_agg = "mean"\n[search]\ntrials = 1\nseed = 0\nseeds = [20]\n'
                     '[search.grad]\nattacks = ["scale"]\n[search.grad.scale]\nfactor = -1e4\n')
    confirm = out / "searched_worst_median.toml"
    assert main(["attack-search", str(space), "--on", tuned, "--db", db, "--quiet", "--confirm", str(confirm)]) == 0
    assert main(["run", tuned, str(confirm), "--db", db, "--quiet"]) == 0
    capsys.readouterr()
    # the channels the search left alone keep the tuned file's attack (honest), not the search file's default
    spelled = [expand_channels(sc.to_dict()) for sc in expand(read(confirm), str(confirm))]
    assert {(d["grad_attack"], d["bn_mean_attack"], d["bn_var_attack"]) for d in spelled} == \
        {("scale", "honest", "honest")}

    def worst(*args):
        assert main(["results", "--worst-case", "--tuned", "lr", "--db", db, "--format", "json", *args]) == 0
        got = capsys.readouterr()
        return {(r["grad_attack"] if "grad_attack" in r else r["worst_grad_attack"]): r for r in json.loads(got.out)
                if r["f"]}, got.err

    for files in ([tuned], [confirm], [tuned, confirm]):
        rows, _ = worst(*[a for f in files for a in ("--matrix", str(f))])
        assert rows and all(r["seeds"] == 5 for r in rows.values())
    assert worst("--matrix", str(out / "tuned_*.toml"), "--matrix", str(out / "searched_*.toml"))[0] == rows
    # the store's view: the tuning's runs (seeds 10, 11, another eval_every) out; the search's trial (seed 20) in
    rows, err = worst()
    assert "runs of a tuning left out (seeds no report uses; a pruned point's worst case is a bound)" in err
    assert "are an attack search's trials" in err
    (row,) = rows.values()
    assert row["seeds"] == 6  # seeds 0-4 and the trial's 20; with the tuning's 10 and 11 it would be 8
    assert main(["report", "--db", db, "--format", "json", "--gamma", "1"]) == 0
    (row,) = json.loads(capsys.readouterr().out)  # the tuned file's attack and the confirmed one, on seeds 0-4
    assert row["seeds"] == 5 and row["attacks_run"] == 2
    from robustbn.tune import is_tuning_file
    assert is_tuning_file(out / "tune_m.toml") and not is_tuning_file(tuned) and not is_tuning_file(confirm)

    # a CSV export and import keep where each run was recorded from: the same answers from the copy
    both = worst("--matrix", str(tuned), "--matrix", str(confirm))[0]
    assert main(["results", "--db", db, "--format", "csv"]) == 0
    (tmp_path / "all.csv").write_text(capsys.readouterr().out)
    db = str(tmp_path / "imported.sqlite")
    assert main(["import", str(tmp_path / "all.csv"), "--db", db]) == 0
    capsys.readouterr()
    assert worst("--matrix", str(tuned), "--matrix", str(confirm))[0] == both
    assert "runs of a tuning left out" in worst()[1]


@pytest.mark.parametrize("matrix_values, grid, words, absent", [
    ({"gama": 0.5}, "lr=[0.1,0.2]", ["m.toml: unknown key 'gama' (did you mean 'gamma'?)"], "tune_m.toml"),
    ({}, "lr=[-0.1,0.1]", ["--grid lr=-0.1: ", "m.toml: key 'lr': must be a number in (0, inf)"],
     "one defense at a time"),
    ({}, "momentum=[0.0,1.5]", ["--grid momentum=1.5: ", "m.toml: key 'momentum'"], "tune_m.toml"),
    # a bad name past the first scenario: still MATRIX's, before the tuning file is written
    ({"grad_agg": ["mean", "nnm+medain"]}, "lr=[0.1,0.2]", ["m.toml", "nnm+medain"], "tune_m.toml"),
])
def test_a_bad_matrix_or_grid_value_names_the_user_s_file_and_writes_nothing(tmp_path, capsys, matrix_values, grid,
                                                                               words, absent):
    path = tmp_path / "m.toml"
    path.write_text(toml_text({**MATRIX, **matrix_values}))
    out = tmp_path / "out"
    line = one_line_error(capsys, main(["tune", str(path), "--grid", grid, "--db", str(tmp_path / "t.sqlite"),
                                        "--out", str(out)]), *words)
    assert absent not in line and not out.exists()


def test_a_search_on_a_tuned_file_keeps_the_attacks_the_search_file_fixes(tmp_path):
    """--on MATRIX: the search file's own attack fields win over MATRIX's; a channel neither
    sets nor searches keeps MATRIX's one attack; MATRIX's varied attacks are no part of it."""
    from robustbn.search import load

    tuned = tmp_path / "tuned.toml"
    tuned.write_text(toml_text({**MATRIX, "grad_agg": "median", "grad_attack": ["alie", "ipm"], "bn_mean_attack": "sf",
                                "bn_var_attack": "honest", "seed": [0, 1, 2, 3, 4]}))
    space = ('[search]\ntrials = 1\nseeds = [20]\n[search.grad]\nattacks = ["scale"]\n'
             '[search.grad.scale]\nfactor = -1.0\n')
    plain, fixed = tmp_path / "plain.toml", tmp_path / "fixed.toml"
    plain.write_text(space)
    fixed.write_text('bn_var_attack = "none"\n' + space)
    values, _ = load(plain, on=tuned)
    assert (values.get("grad_attack"), values["bn_mean_attack"], values["bn_var_attack"]) == (None, "sf", "honest")
    values, _ = load(fixed, on=tuned)
    assert (values["bn_mean_attack"], values["bn_var_attack"]) == ("sf", "none")


def test_runs_finished_on_another_device_count_for_the_tuning_and_its_tuned_files(matrix, tmp_path, capsys):
    """A store whose tuning ran on a GPU (tune --device cuda) resumes on a CPU: nothing runs
    again, the choices and tuned files are the same, and the tuned files' runs are done too."""
    import sqlite3

    db, out = tmp_path / "t.sqlite", tmp_path / "tuned"
    argv = ["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--db", str(db), "--out", str(out), "--quiet",
            "--format", "json"]
    assert main(argv) == 0
    before = json.loads(capsys.readouterr().out)
    files = {p.name: p.read_text() for p in out.glob("tuned_*.toml")}
    median = next(d["file"] for d in before["defenses"] if d["defense"].startswith("median"))
    assert main(["run", median, "--db", str(db), "--quiet"]) == 0
    runs = as_if_run_on_cuda(db)
    assert runs > 0
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == before
    assert {p.name: p.read_text() for p in out.glob("tuned_*.toml")} == files
    assert main(["run", median, "--db", str(db), "--quiet"]) == 0
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == runs
        assert {d for (d,) in con.execute("SELECT device FROM runs")} == {"cuda"}


def test_tune_device_runs_elsewhere_and_writes_device_free_files(matrix, tmp_path, monkeypatch, capsys):
    """--device reaches every run; the tuning and tuned files keep the matrix's device."""
    import robustbn.execute as execute

    devices, real = [], execute.run_matrix

    def recording(scenarios, *args, **kwargs):
        devices.append(kwargs.get("device"))
        return real(scenarios, *args, **{**kwargs, "device": None})  # this machine has no GPU

    monkeypatch.setattr(execute, "run_matrix", recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda is checked first
    out = tmp_path / "tuned"
    assert main(["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--db", str(tmp_path / "t.sqlite"), "--out",
                 str(out), "--quiet", "--device", "cuda"]) == 0
    assert devices and set(devices) == {"cuda"}
    assert all("device" not in read(p) for p in out.glob("*.toml"))


@pytest.mark.parametrize("command", ["tune", "run"])
def test_a_device_this_machine_lacks_is_refused_before_anything_is_written(command, matrix, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    db, out = tmp_path / "t.sqlite", tmp_path / "tuned"
    argv = (["tune", str(matrix), "--grid", "lr=[0.0001,0.1]", "--out", str(out)] if command == "tune" else
            ["run", str(matrix)]) + ["--db", str(db), "--quiet", "--device", "cuda"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"robustbn {command}: --device cuda: CUDA is not available on this "
                                               f"machine; use --device cpu")
    assert not db.exists() and not out.exists()
    if command == "tune":  # a plan runs nothing: it needs no GPU
        assert main([*argv, "--plan"]) == 0


def test_worst_cases_equal_but_for_float_noise_are_a_tie_and_the_first_grid_point_wins():
    """Chance at every lr, written 9.999999404% at lr 0.01 and 10.000000149% at lr 0.1 (float32's
    last bits): a tie, so lr 0.01 (the grid's first) is chosen, not the rounding noise's pick."""
    accs = {0.01: F32_TENTH_DOWN, 0.05: F32_TENTH_DOWN, 0.1: F32_TENTH_UP}
    rows = [_row(sc, accs[sc["lr"]]) for _, sc in PLANNED if sc["grad_agg"] == "mean"]
    (d,) = choose(rows, GRID)
    assert d["chosen"] == {"lr": 0.01}
    rows = [_row(sc, accs[sc["lr"]] + (0.0001 if sc["lr"] == 0.1 else 0)) for _, sc in PLANNED if sc["grad_agg"] == "mean"]
    assert choose(rows, GRID)[0]["chosen"] == {"lr": 0.1}  # one test example in 10,000 is a difference


def test_a_defense_is_one_whatever_other_defenses_ran_at_each_grid_point():
    """A worst-case table lists a field where any of its rows has it (None elsewhere): where only
    one grid point has run a filtered defense, the other defenses' rows there carry client_filter
    None and its key order differs. Each defense is still one, with a score at every point."""
    rows = [_row(sc, 0.5) for _, sc in PLANNED if sc["grad_agg"] == "mean"]
    filtered = [_row({**sc, "client_filter": "bnguard"}, 0.4) for _, sc in PLANNED
                if sc["grad_agg"] == "median" and sc["lr"] == 0.01]
    chosen = choose(rows + filtered, GRID)
    mean = [d for d in chosen if d["defense"].startswith("mean")]
    assert len(mean) == 1 and mean[0]["complete"] and [s["worst_acc"] for s in mean[0]["scores"]] == [0.5] * 3
