"""The worked examples run as documented (on synthetic data and a few rounds)."""

from pathlib import Path

from robustbn.cli import main

from test_cluster import histories

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "bring_your_own_defense"


def test_bring_your_own_defense_runs_its_matrix_and_passes_the_kit(tmp_path, clean_search_path, capsys,
                                                                    monkeypatch):
    small = ["--set", "dataset=synthetic-images", "--set", "rounds=4", "--set", "eval_every=2",
             "--set", "batch_size=8", "--set", "lr_milestones=[]"]
    db = tmp_path / "r.sqlite"
    assert main(["run", str(EXAMPLE / "matrix.toml"), "--db", str(db), "--jobs", "2", "--quiet", *small]) == 0
    assert "8 runs: 8 ran" in capsys.readouterr().out
    rows = list(histories(db).values())
    assert len(rows) == 8 and all(status == "done" and len(history) == 2 for status, history in rows)
    monkeypatch.chdir(EXAMPLE)  # check-aggregator finds the modules beside the working directory
    assert main(["check-aggregator", "mydefense:ClipToMedianNorm+mydefense:MedianOfMeans", "--f", "3", "--n", "10",
                 "--examples", "15"]) == 0
    assert main(["check-aggregator", "myattack:MeanMinusZStd", "--attack", "--examples", "10"]) == 0


# every folder under examples/ and the test that runs it at a small size
RUN_BY = {"bring_your_own_defense": "test_examples.py::test_bring_your_own_defense_runs_its_matrix_and_passes_the_kit",
          "evaluate_your_defense": "test_evaluate.py::test_the_worked_example_evaluates_its_rule_and_its_attack",
          "flower": "test_flower_app.py::test_flwr_run_in_the_simulation_runtime"}


def test_every_example_folder_is_run_by_a_test():
    """A new folder under examples/ comes with a test that runs it, named in RUN_BY."""
    examples = EXAMPLE.parent
    assert {p.name for p in examples.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))} == set(RUN_BY)
    for folder, test in RUN_BY.items():
        file, name = test.split("::")
        assert f"def {name}(" in (Path(__file__).parent / file).read_text(), f"examples/{folder}: {test} is gone"
