import os
import subprocess
import sys
import tomllib
from pathlib import Path

from robustbn.cli import DEMO_TOML, build_parser, main
from robustbn.matrix import expand


def test_demo_matrix_is_fbn_vs_naive_under_the_papers_attack_with_and_without_defense():
    scenarios = expand(tomllib.loads(DEMO_TOML))
    cells = {(s.norm, s.f, s.channel("grad")[0], s.channel("bn_mean")[0], s.channel("bn_var")[0], s.bn_agg)
             for s in scenarios}
    assert cells == {(norm, f, "none", mean, var, agg) for norm in ("naive", "fbn")
                     for f, mean, var, agg in [(0, "none", "none", "mean"), (3, "sf", "honest", "mean"),
                                               (3, "sf", "honest", "nnm+median")]}
    assert all(s.dataset == "fashion-mnist" and s.gamma == 0.0 and s.device == "cpu" for s in scenarios)
    assert build_parser().parse_args(["demo"]).jobs == min(2, os.cpu_count())  # 2 at once: under 3 minutes


def test_demo_prints_its_table_and_plot(tmp_path, capsys):
    db = tmp_path / "demo.sqlite"
    assert main(["demo", "--db", str(db), "--quiet", "--jobs", "1", "--set", "dataset=\"synthetic-images\"", "--set", "rounds=4",
                 "--set", "eval_every=2", "--set", "batch_size=8"]) == 0
    out = capsys.readouterr().out
    table = out.split("final_acc", 1)[1]
    assert table.count("naive") == 3 and table.count("fbn") == 3
    assert (tmp_path / "demo.png").stat().st_size > 10_000 and f"plot: {tmp_path / 'demo.png'}" in out


def test_version_and_help():
    p = subprocess.run([sys.executable, "-m", "robustbn.cli", "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("robustbn ")
    for command in ("run", "merge", "import", "list", "results", "plot", "toy", "demo"):
        p = subprocess.run([sys.executable, "-m", "robustbn.cli", command, "--help"], capture_output=True, text=True)
        assert p.returncode == 0 and "examples:" in p.stdout, command


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`robustbn list ... | head`: more output than a pipe holds, and the reader goes away."""
    seeds = "seed=[" + ",".join(map(str, range(30))) + "]"
    p = subprocess.Popen([sys.executable, "-m", "robustbn.cli", "list", "scenarios/fbn_fig4_cifar10.toml", "--set", seeds],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    p.stdout.readline()
    p.stdout.close()
    assert p.wait(timeout=60) == 0 and p.stderr.read() == b""


def test_one_module_per_command():
    """robustbn/cli/ holds the entry point, `common` and one module per command: each module is
    in COMMANDS and registers exactly its own command, which runs a function of that module."""
    import argparse
    from importlib import import_module

    from robustbn import cli

    modules = {p.stem for p in Path(cli.__file__).parent.glob("*.py")} - {"__init__", "__main__", "common"}
    assert modules == set(cli.COMMANDS)
    for name in cli.COMMANDS:
        module = import_module(f"robustbn.cli.{name}")
        sub = argparse.ArgumentParser().add_subparsers()
        module.register(sub)
        command = name.rstrip("_").replace("_", "-")
        assert list(sub.choices) == [command], name
        assert sub.choices[command].get_default("run").__module__ == module.__name__, name
    assert list(build_parser().commands) == [n.rstrip("_").replace("_", "-") for n in cli.COMMANDS]


def test_the_parser_loads_no_torch():
    """Every command module imports torch, the store and the engine inside its function, so that
    `robustbn --help` and a usage error stay quick."""
    code = "import sys, robustbn.cli; robustbn.cli.build_parser(); print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
