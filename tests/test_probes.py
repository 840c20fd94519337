"""A hostile user's inputs (issue 16's probe): each refused with exit status 2 and one stderr
line naming the option, path or field, no traceback, and nothing written where nothing should be."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from robustbn.cli import main

from matrices import TINY_RUN, one_line_error, shipped_matrix_files


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
    one_line_error(capsys, main([*argv, "--db", str(db), "--where", "nrom=fbn"]), "--where nrom",
                   "not a scenario field (did you mean 'norm'?); allowed:")
    assert not (tmp_path / "p.png").exists()


def test_tuned_on_an_unknown_field_names_the_closest(db, capsys):
    one_line_error(capsys, main(["results", "--worst-case", "--tuned", "lrr", "--db", str(db)]),
                   "--tuned lrr: a scenario field the defenses were tuned on (did you mean 'lr'?)")


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


# ---- loop counts inside a round: a stop request waits for the round's end (issue 22) --------

@pytest.mark.parametrize("agg, params, words", [
    ("cc", "{iters=100000000000}", ["cc: iters must be an integer in [1, 10000]", "stop request"]),
    ("cc", "{iters=1e20}", ["cc: iters must be an integer in [1, 10000]", "got 1e+20"]),
    ("geomed", "{iters=10001}", ["geomed: iters must be an integer in [1, 10000]"]),
    ("dnc", "{niters=10001}", ["dnc: niters must be an integer in [1, 10000]"]),
    ("mda", "{max_subsets=100000000000}", ["mda: max_subsets must be an integer in [1, 10000000]"]),
])
def test_an_endless_round_is_refused_before_it_runs(scenario, tmp_path, capsys, agg, params, words):
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--set", "f=1",
                                 "--set", f"grad_agg={agg}", "--set", f"grad_agg_params={params}"]),
                   "'grad_agg_params'", *words)
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--set", "f=1",
                                 "--set", "grad_attack=opt-alie", "--set", "grad_attack_params={steps=100000}"]),
                   "'grad_attack_params'", "opt-alie: steps must be an integer in [2, 10000]")
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--set", "algorithm=fedavg",
                                 "--set", "local_steps=1000000"]), "'local_steps'", "<= 10000", "stop request")
    assert not (tmp_path / "n.sqlite").exists()


def _loop_counts():
    """(kind, name, parameter) of every built-in rule, attack and client filter parameter that
    counts a loop or a search run each round, found by name."""
    import inspect
    import re

    import aggregators
    import attacks
    from robustbn import filters

    kinds = {"agg": {**aggregators.AGGREGATORS, **aggregators.PRE_AGGREGATORS}, "attack": attacks.ATTACKS,
             "filter": filters.FILTERS}
    found = [(kind, name, p) for kind, classes in kinds.items() for name, cls in classes.items()
             for p in inspect.signature(cls.__init__).parameters if re.search(r"iter|steps|subsets|halvings", p)]
    assert {("agg", "cc", "iters"), ("agg", "geomed", "iters"), ("attack", "bn-kl", "z_steps"),
            ("filter", "bnguard", "iters")} <= set(found)
    return found


@pytest.mark.parametrize("kind, name, param", _loop_counts())
def test_every_loop_count_has_an_upper_bound(kind, name, param):
    import aggregators
    import attacks
    from robustbn import filters

    build = {"agg": lambda **p: aggregators.build(name, f=1, **p), "attack": lambda **p: attacks.build(name, pipeline=len, **p),
             "filter": lambda **p: filters.build(name, **p)}[kind]
    with pytest.raises(ValueError, match=rf"{param} must be an integer in \[\d+, \d+\]"):
        build(**{param: 10**12})


# ---- a round far beyond the machine's memory: refused with the estimate, not OOM-killed ------

GIB = 2**30


def test_a_round_beyond_the_machine_memory_is_refused(scenario, tmp_path, capsys):
    one_line_error(capsys, main(["run", str(scenario), "--db", str(tmp_path / "n.sqlite"), "--set", "model=cnn",
                                 "--set", "batch_size=1000000000"]),
                   "'batch_size': this scenario needs about", "GiB for one round", "through 'cnn' on 1x16x16 images",
                   "the machine has")
    assert not (tmp_path / "n.sqlite").exists()


def test_the_memory_estimate_and_its_bound(scenario, capsys, monkeypatch):
    """On a machine of 8 GiB: simple-cnn on 1x16x16 images leaves 23,818 values per example, and
    the 4 clients' inputs 4 x 256 more: 4 bytes x 100,000 x 24,842 = 9.25 GiB is refused, half
    of it taken; the parameters once per client and per message refuse a large n alike."""
    monkeypatch.setattr("robustbn.scenario.device_memory", lambda device: 8 * GIB)
    one_line_error(capsys, main(["list", str(scenario), "--set", "batch_size=100000"]),
                   "'batch_size': this scenario needs about 9.3 GiB for one round (batch_size=100000 through "
                   "'simple-cnn' on 1x16x16 images, 4 clients one by one), the machine has 8.0 GiB")
    assert main(["list", str(scenario), "--set", "batch_size=50000"]) == 0
    monkeypatch.setattr("robustbn.scenario.device_memory", lambda device: GIB)
    one_line_error(capsys, main(["list", str(scenario), "--set", "model=cnn", "--set", "n=300"]),
                   "'n': this scenario needs about 1.2 GiB", "522,570 parameters of 'cnn' for each of n=300 clients",
                   "the machine has 1.0 GiB")
    assert main(["list", str(scenario), "--set", "model=cnn", "--set", "n=200"]) == 0


def test_every_shipped_scenario_fits_a_small_machine(monkeypatch):
    """The estimate refuses only what is clearly beyond: every shipped scenario validates on a
    machine of 2 GiB (the largest needs about 1.3), and would on a GPU of 2 GiB."""
    import dataclasses

    from robustbn.matrix import load
    from robustbn.scenario import _model_size

    monkeypatch.setattr("robustbn.scenario.device_memory", lambda device: 2 * GIB)
    files = shipped_matrix_files()
    assert len(files) >= 8
    scenarios = [sc for path in files for sc in load(path)[1]]
    assert max(dataclasses.replace(sc, device="cuda").memory_estimate()[0] for sc in scenarios) <= 2 * GIB
    misses = _model_size.cache_info().misses
    for path in files:  # validated again: the models' sizes come from the cache
        load(path)
    assert _model_size.cache_info().misses == misses


def test_sizing_a_model_imports_no_compiler_and_draws_nothing():
    """Validation sizes the model by a forward of uninitialized parameters on the CPU: a forward
    on the meta device would import torch's compiler stack (2-4 s in every process that
    validates), and initializing the parameters would draw from the global generator."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from robustbn.models import model_class\n"
            "from robustbn.scenario import _model_size\n"
            "torch.manual_seed(0); before = torch.random.get_rng_state()\n"
            "print(_model_size(model_class('cnn'), 3, 32, 10))\n"
            "assert torch.equal(torch.random.get_rng_state(), before)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False"
    assert "".join(out[:-1]) == "(647434,1310154)"  # the values the meta device gave


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_round_beyond_the_gpu_memory_is_refused(scenario, tmp_path, capsys):
    one_line_error(capsys, main(["list", str(scenario), "--set", "device=cuda", "--set", "batch_size=10000000"]),
                   "'batch_size'", "4 clients x batch_size=10000000 through 'simple-cnn' on 1x16x16 images at once",
                   "cuda has")
    assert main(["list", str(scenario), "--set", "device=cuda", "--set", "batch_size=1000"]) == 0


# ---- --where with a list: any of its values ----------------------------------------------

def test_where_with_a_list_keeps_any_of_its_values(scenario, tmp_path, capsys):
    import json

    db = str(tmp_path / "r.sqlite")
    assert main(["run", str(scenario), "--db", db, "--quiet", "--set", "n=[4,5,6]", "--set", "rounds=2",
                 "--set", "eval_every=2"]) == 0
    capsys.readouterr()
    for where, ns in [("n=[4,5]", [4, 5]), ("n=[6]", [6]), ("n=5", [5]), ("n=[5, 7]", [5]),
                      ("norm=[fbn, naive]", [4, 5, 6]), ('norm=["naive"]', [])]:
        assert main(["results", "--db", db, "--format", "json", "--where", where]) == 0
        assert sorted(r["n"] for r in json.loads(capsys.readouterr().out)) == ns, where
    assert main(["results", "--db", db, "--where", "n=[4,5]", "--where", "n=[5,6]"]) == 0  # every filter holds
    assert capsys.readouterr().out.strip().endswith("1 runs")
    one_line_error(capsys, main(["results", "--db", db, "--where", "n=[]"]), "--where n=[]", "matches no run")
    for command in (["results"], ["plot", "curves", "--out", "x.png"]):
        assert main([*command, "--help"]) == 0
        assert "a list is any of its values" in " ".join(capsys.readouterr().out.split())


# ---- argparse's own usage errors: one line, not the usage block --------------------------

@pytest.mark.parametrize("argv, words", [
    (["rn"], ["robustbn: argument COMMAND: invalid choice: 'rn'", "(see robustbn --help)"]),
    (["--bogus"], ["robustbn: unrecognized arguments: --bogus (see robustbn --help)"]),
    (["run"], ["robustbn run: the following arguments are required: file (see robustbn run --help)"]),
    (["run", "s.toml", "--bogus", "1"], ["robustbn run: unrecognized arguments: --bogus 1 (see robustbn run --help)"]),
    (["run", "s.toml", "--jobs", "two"], ["robustbn run: argument --jobs: invalid int value: 'two'"]),
    (["results", "--format", "xml"], ["robustbn results: argument --format: invalid choice: 'xml'",
                                      "(see robustbn results --help)"]),
    (["plot", "curves"], ["robustbn plot: the following arguments are required: --out (see robustbn plot --help)"]),
    (["check-aggregator", "median", "--f"], ["robustbn check-aggregator: argument --f: expected one argument"]),
])
def test_usage_errors_are_one_line(capsys, argv, words):
    one_line_error(capsys, main(argv), *words)


def test_a_usage_error_exits_2_from_the_shell():
    p = subprocess.run([sys.executable, "-m", "robustbn.cli", "list"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr == "robustbn list: the following arguments are required: file " \
                                             "(see robustbn list --help)\n" and p.stdout == ""
