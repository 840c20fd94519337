"""A hostile user's inputs (issue 16's probe): each refused with exit status 2 and one stderr
line naming the option, path or field, no traceback, and nothing written where nothing should be."""

import os
from pathlib import Path

import pytest

from robustbn.cli import main

from matrices import TINY_RUN, one_line_error


@pytest.fixture
def scenario(tmp_path) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(TINY_RUN + 'norm = "fbn"\n')
    return path


@pytest.fixture
def db(tmp_path, scenario, capsys) -> Path:
    """A store with one finished tiny run."""
    path = tmp_path / "r.sqlite"
    assert main(["run", str(scenario), "--db", str(path), "--quiet"]) == 0
    capsys.readouterr()
    return path


# ---- --where: a typo matched nothing and read as "no runs"; the message said --set --------

@pytest.mark.parametrize("argv", [["results"], ["results", "--worst-case"], ["plot", "curves", "--out", "{tmp}/p.png"]])
def test_where_on_an_unknown_key_is_refused(db, tmp_path, capsys, argv):
    argv = [a.format(tmp=tmp_path) for a in argv]
    one_line_error(capsys, main([*argv, "--db", str(db), "--where", "nrom=fbn"]), "--where nrom", "not a scenario field",
                   "allowed:", "norm")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("text, words", [("norm", ["--where 'norm'", "expected key=value"]),
                                         ("=fbn", ["--where '=fbn'", "no key before '='"])])
def test_malformed_where_names_where_not_set(db, capsys, text, words):
    one_line_error(capsys, main(["results", "--db", str(db), "--where", text]), *words)


def test_where_on_a_scenario_field_still_filters(db, capsys):
    assert main(["results", "--db", str(db), "--where", "norm=fbn", "--where", "bn_mean_attack=none"]) == 0
    assert capsys.readouterr().out.strip().endswith("1 runs")


def test_empty_set_key_is_refused(scenario, tmp_path, capsys):
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--set", "=3"]),
                   "--set '=3'", "no key before '='")
    assert not (tmp_path / "n.sqlite").exists()


# ---- plot and toy outputs: matplotlib appended .png to a name without a format, silently -------

@pytest.mark.parametrize("out, words", [("", ["--out ''", "an empty path"]),
                                        ("{tmp}", ["a directory"]),
                                        ("{tmp}/plot", ["the extension names the image format", ".png"]),
                                        ("{tmp}/plot.unknownext", ["--out", "allowed:", ".pdf"])])
def test_plot_out_must_name_an_image_file(db, tmp_path, capsys, out, words):
    before = set(tmp_path.iterdir())
    one_line_error(capsys, main(["plot", "curves", "--db", str(db), "--out", out.format(tmp=tmp_path)]), *words)
    assert set(tmp_path.iterdir()) == before and not Path(".png").exists()


def test_heterogeneity_x_must_be_a_scenario_field(db, tmp_path, capsys):
    one_line_error(capsys, main(["plot", "heterogeneity", "--db", str(db), "--out", str(tmp_path / "h.png"),
                                 "--x", "gama"]), "--x gama", "not a scenario field", "gamma")
    assert not (tmp_path / "h.png").exists()


def test_toy_seed_and_out(tmp_path, capsys):
    one_line_error(capsys, main(["toy", "--out", str(tmp_path / "t.png"), "--seed", str(10**23)]), "--seed", "<=")
    one_line_error(capsys, main(["toy", "--out", ""]), "--out ''", "an empty path")
    assert list(tmp_path.iterdir()) == []


# ---- run options ----------------------------------------------------------------------------

def test_an_empty_shard_is_refused_not_ignored(scenario, tmp_path, capsys):
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--shard", ""]),
                   "--shard", "I/N")
    assert not (tmp_path / "n.sqlite").exists()


@pytest.mark.parametrize("option, value", [("--cpus-per-run", "nan"), ("--cpus-per-run", "inf"),
                                           ("--gpus-per-run", "nan"), ("--gpus-per-run", "inf")])
def test_ray_resources_must_be_finite(scenario, tmp_path, capsys, option, value):
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--executor", "ray",
                                 option, value]), option.split("-per")[0])
    assert not (tmp_path / "n.sqlite").exists()


@pytest.mark.parametrize("make", ["file", "dangling link"])
@pytest.mark.parametrize("every", [[], ["--checkpoint-every", "0"], ["--checkpoint-every", "2"]])
def test_a_checkpoint_folder_that_is_no_folder_is_refused_before_running(scenario, tmp_path, capsys, make, every):
    store = tmp_path / "c.sqlite"
    folder = tmp_path / "c.sqlite.checkpoints"
    if make == "file":
        folder.write_text("not a folder")
    else:
        folder.symlink_to(tmp_path / "nowhere")
    one_line_error(capsys, main(["run", str(scenario), "--db", str(store), "--quiet", *every]),
                   "c.sqlite.checkpoints", "not a directory")
    assert not store.exists()


# ---- scenario files that are no regular files --------------------------------------------

@pytest.mark.parametrize("command", ["run", "list"])
def test_a_fifo_or_device_is_no_scenario_file(tmp_path, capsys, command):
    fifo = tmp_path / "f.toml"
    os.mkfifo(fifo)
    for path in (str(fifo), os.devnull):  # the fifo blocked the read; /dev/null read as a default scenario
        argv = [command, path] + (["--db", str(tmp_path / "n.sqlite")] if command == "run" else [])
        one_line_error(capsys, main(argv), path, "not a regular file")
    one_line_error(capsys, main([command, ""] + (["--db", str(tmp_path / "n.sqlite")] if command == "run" else [])),
                   "an empty path")
    assert not (tmp_path / "n.sqlite").exists()


# ---- scenario values ------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("batch_size", "99999999999999999999", ["'batch_size'", "<= 9223372036854775807"]),  # failed in torch
    ("rounds", str(2**63), ["'rounds'", "64-bit"]),
    ("eval_every", str(2**64), ["'eval_every'", "64-bit"]),
    ("grad_agg_params", "{f=1}", ["'grad_agg_params'", "'f' is not a parameter"]),  # "build() got multiple values"
    ("grad_agg_params", '{spec="x"}', ["'grad_agg_params'", "'spec' is not a parameter"]),
    ("grad_agg_params", "{n=3}", ["'grad_agg_params'", "'n' is not a parameter"]),  # was silently taken
    ("grad_agg_params", "{n=[1]}", ["'grad_agg_params'", "'n' is not a parameter"]),
    ("grad_attack_params", "{pipeline=1}", ["'grad_attack_params'", "'pipeline' is not a parameter"]),
    ("grad_attack_params", '{name="x"}', ["'grad_attack_params'", "'name' is not a parameter"]),
])
def test_out_of_range_and_reserved_values_are_refused(scenario, tmp_path, capsys, key, value, words):
    extra = ["--set", "f=1", "--set", "grad_attack=alie", "--set", "grad_agg=median"] if "params" in key else []
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), *extra,
                                 "--set", f"{key}={value}"]), *words)
    assert not (tmp_path / "n.sqlite").exists()


def test_a_step_without_a_constructor_takes_no_parameters(scenario, tmp_path, capsys):
    """mean has object's constructor: its allowed parameters read 'none', not 'args, kwargs'."""
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"),
                                 "--set", "grad_agg_params={args=1}"]), "'grad_agg_params'", "allowed: none")


# ---- check-aggregator -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["median", "--param", "f=1"], ["--param f", "use --f"]),  # "check() got multiple values for 'f'"
    (["median", "--param", "n=3"], ["--param n", "use --n"]),
    (["median", "--param", "zz"], ["--param 'zz'", "expected key=value"]),  # the message said --set
    (["alie", "--attack", "--param", "name=1"], ["--param name"]),
    (["alie", "--attack", "--f", str(10**20)], ["--f", "cannot draw"]),  # hypothesis' Unsatisfiable traceback
    (["median", "--n", str(10**20)], ["--n", "cannot draw"]),
    (["mean", "--param", "args=1"], ["args", "allowed: none"]),  # "Mean() takes no arguments"
])
def test_check_aggregator_bad_options(capsys, argv, words):
    one_line_error(capsys, main(["check-aggregator", *argv, "--examples", "2"]), *words)
