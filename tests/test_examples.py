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
          "flower": "test_flower_app.py::test_flwr_run_in_the_simulation_runtime"}


def test_every_example_folder_is_run_by_a_test():
    """A new folder under examples/ comes with a test that runs it, named in RUN_BY."""
    examples = EXAMPLE.parent
    assert {p.name for p in examples.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))} == set(RUN_BY)
    for folder, test in RUN_BY.items():
        file, name = test.split("::")
        assert f"def {name}(" in (Path(__file__).parent / file).read_text(), f"examples/{folder}: {test} is gone"


FLOWER = Path(__file__).resolve().parent.parent / "examples" / "flower"


def test_flower_example_runs_offline_with_robust_strategy(monkeypatch, capsys):
    """examples/flower/run.py as documented, small: 4 clients (one flipping its labels), 2 rounds,
    synthetic images, fbn with NNM + trimmed mean: the global model learns, and the returned
    arrays carry the shared BN statistics with the counters passed through."""
    import os
    import sys

    import pytest
    pytest.importorskip("flwr")
    import torch
    monkeypatch.syspath_prepend(str(FLOWER))  # Flower's Ray backend hands sys.path to its workers
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # ... by appending it here: restored after
    try:
        import run
        from task import Net
        keys = list(Net().state_dict())
        result = run.main(["--rounds", "2", "--clients", "4", "--byzantine", "1", "--synthetic", "--per-client", "128",
                           "--test-size", "500", "--cpus", "2"])
    finally:
        for name in ("run", "task", "client_app", "server_app"):
            sys.modules.pop(name, None)
    table = capsys.readouterr().out.split("| round |")[1].splitlines()
    assert [line.split("|")[1].strip() for line in table[2:4]] == ["1", "2"]
    assert result.evaluate_metrics_serverapp[2]["accuracy"] > 0.5  # chance: 0.1
    assert 0 <= result.evaluate_metrics_clientapp[2]["eval_acc"] <= 1
    final = result.arrays.to_torch_state_dict()
    assert list(final) == keys  # fbn shares every key: the BN statistics are the server's
    for layer in ("features.1", "features.5"):
        assert not torch.equal(final[f"{layer}.running_var"], torch.ones_like(final[f"{layer}.running_var"]))
        assert final[f"{layer}.num_batches_tracked"].dtype == torch.int64
        assert final[f"{layer}.num_batches_tracked"].item() == 0  # the initial counter, passed through
