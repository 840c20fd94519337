"""Bad input never gives a traceback: every wrong value of a scenario file is refused before
anything runs, by `robustbn run` and `robustbn list` alike, with one line naming the field and
what is allowed; and a value spelled with another type of the same number is the same run."""

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import aggregators
import attacks
from robustbn.cli import main
from robustbn.matrix import load
from robustbn.scenario import NUMBERS, Scenario, ScenarioError
from robustbn.store import scenario_hash

TINY = {"dataset": "synthetic-images", "rounds": 1, "n": 4, "batch_size": 4, "eval_every": 1}


def toml(value) -> str:
    """A value in TOML syntax (inline tables for dicts; TOML has no null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"


def scenario_file(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text("".join(f"{k} = {toml(v)}\n" for k, v in {**TINY, **fields}.items()))
    return path


def refused(tmp_path: Path, capsys, path: Path, command: str) -> str:
    """The one stderr line of `robustbn COMMAND path` (exit status 2, no store written)."""
    db = tmp_path / "never.sqlite"
    capsys.readouterr()
    argv = ["run", str(path), "--db", str(db), "--quiet"] if command == "run" else ["list", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not db.exists()
    return err


BAD = [
    # (fields, the field named, words of the message)
    ({"lr_milestones": [[2, math.inf]]}, "lr_milestones", "lr a finite number > 0"),
    ({"lr_milestones": [[2, math.nan]]}, "lr_milestones", "[round, lr] pairs"),
    ({"lr_milestones": [[0, 0.1]]}, "lr_milestones", "round an integer >= 1"),
    ({"lr_milestones": [[True, 0.1]]}, "lr_milestones", "round an integer >= 1"),
    ({"lr_milestones": [[2, -0.1]]}, "lr_milestones", "lr a finite number > 0"),
    ({"seed": 2**64}, "seed", "<= 9223372036854774783"),
    ({"seed": -1}, "seed", "must be an integer >= 0"),
    ({"n": 3000}, "n", "one example at least: the 2000 training examples of 'synthetic-images' allow n <= 2000 "),
    ({"n": 2001, "partition": "shards", "shards": 2}, "n", "allow n <= 1000 (f = 0), got 2001"),
    ({"n": 1001, "partition": "shards", "shards": 2}, "shards", "must be <= 1"),
    ({"n": 1001, "partition": "dirichlet"}, "n", "2 examples at least: the 2000 training examples"),
    ({"n": 5, "f": 1, "grad_agg": "fltrust", "root_size": 1997}, "n", "the 3 training examples of 'synthetic-images' "
     "left by the root set allow n <= 4 (f = 1), got 5"),
    ({"n": 400, "partition": "shards", "shards": 6}, "shards", "must be <= 5"),
    ({"n": 4, "f": 1, "grad_agg": "fltrust", "root_size": 2000}, "root_size", "must be < 2000"),
    ({"norm": "gn", "gn_groups": 3}, "gn_groups", "allowed: 1, 2, 4, 8, 16, 32, 64, got 3"),
    ({"f": 1, "grad_attack": "mimic", "grad_attack_params": {"target": 3}}, "grad_attack_params", "in [0, h=3)"),
    ({"f": 1, "bn_attack": "mimic", "bn_attack_params": {"target": -1}}, "bn_attack_params", "integer >= 0"),
    ({"data_dir": 5}, "data_dir", "must be a path (a string) or absent"),
    ({"data_dir": "/no/such/robustbn/data"}, "data_dir", "no such directory"),
    ({"f": 1, "grad_agg": "bucketing+median", "grad_agg_params": {"seed": "abc"}}, "grad_agg_params",
     "bucketing: seed must be an integer"),
    ({"f": 1, "grad_agg": "cc", "grad_agg_params": {"tau": "1"}}, "grad_agg_params", "tau must be a finite number > 0"),
    ({"f": 1, "grad_agg": "geomed", "grad_agg_params": {"iters": True}}, "grad_agg_params", "iters must be an integer"),
    ({"f": 1, "grad_attack": "scale", "grad_attack_params": {"factor": "1e38"}}, "grad_attack_params",
     "factor must be a finite number"),
    ({"f": 1, "grad_attack": "gaussian", "grad_attack_params": {"sigma": True}}, "grad_attack_params",
     "sigma must be a finite number >= 0"),
    ({"f": 1, "grad_attack": "gaussian", "grad_attack_params": {"sigma": -1.0}}, "grad_attack_params",
     "sigma must be a finite number >= 0"),
    ({"f": 1, "grad_attack": "inf", "grad_attack_params": {"sign": True}}, "grad_attack_params",
     "sign must be 1 or -1"),
    ({"device": 3}, "device", "allowed: 'cpu', 'cuda', 'cuda:N'"),
    ({"device": "cudaX"}, "device", "allowed: 'cpu', 'cuda', 'cuda:N'"),
    ({"augment": "yes"}, "augment", "must be true, false or absent"),
    ({"norm": 5}, "norm", "must be a name (a string)"),
    ({"dropout": "0.1"}, "dropout", "must be a number in [0, 1)"),
    ({"grad_agg_params": "x"}, "grad_agg_params", "must be a table of parameters"),
    ({"n": 10.0}, "n", "must be an integer >= 1, got 10.0"),
    ({"f": True}, "f", "must be an integer >= 0, got True"),
    ({"fixbn_switch": "half"}, "fixbn_switch", "must be an integer or absent"),
    ({"client_filter": 3}, "client_filter", "must be a name (a string) or absent"),
    ({"lr": 10**400}, "lr", "must be a number in (0, inf)"),
]


@pytest.mark.parametrize("command", ["run", "list"])
@pytest.mark.parametrize("fields, field, words", BAD)
def test_bad_values_are_one_line_naming_the_field(tmp_path, capsys, command, fields, field, words):
    err = refused(tmp_path, capsys, scenario_file(tmp_path, **fields), command)
    assert f"key {field!r}: " in err and words in err, err


def test_bad_values_are_scenario_errors_in_python_too():
    for fields, field, words in BAD:
        with pytest.raises(ScenarioError) as e:
            Scenario.from_dict({**TINY, **fields})
        assert e.value.field == field and words in str(e.value)


@pytest.mark.parametrize("content, words", [
    (None, "a directory, not a scenario file"),
    (b"\xff\xfe\x00\x81garbage", "not a text file"),
    (bytes(range(256)), "not a text file"),
    ("caf\u00e9 = 1".encode("latin-1"), "not a text file"),
    (b"n = 3\x00\x01", "not valid TOML"),
])
@pytest.mark.parametrize("command", ["run", "list"])
def test_a_scenario_file_that_is_no_text_is_one_line(tmp_path, capsys, content, words, command):
    path = tmp_path / "s.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    err = refused(tmp_path, capsys, path, command)
    assert str(path) in err and words in err


def test_data_dir_given_is_the_only_place_looked(tmp_path, monkeypatch):
    """An explicit data_dir is never replaced by the defaults (Debian's Fashion-MNIST, the
    cache): a directory that is not there is an error, and it is not created."""
    from robustbn.data import DataError, load_dataset

    missing = tmp_path / "nowhere"
    for name in ("fashion-mnist", "mnist"):
        with pytest.raises(DataError, match="data_dir: no such directory"):
            load_dataset(name, data_dir=missing)
    assert not missing.exists()
    assert Scenario.from_dict({**TINY, "data_dir": str(tmp_path)}).data_dir == str(tmp_path)
    assert Scenario.from_dict({**TINY, "data_dir": tmp_path}).data_dir == str(tmp_path)  # a Path, as its text


def test_a_registered_dataset_size_bounds_the_clients(monkeypatch):
    from robustbn import data

    monkeypatch.setattr(data, "DATASETS", dict(data.DATASETS))
    monkeypatch.setattr(data, "TRAIN_SIZES", dict(data.TRAIN_SIZES))
    data.register_dataset("tiny-set", train_size=12)(lambda data_dir: None)
    assert data.train_size("tiny-set") == 12 and data.train_size("mod:Name") is None
    Scenario.from_dict({**TINY, "dataset": "tiny-set", "n": 12})
    with pytest.raises(ScenarioError, match="allow n <= 12 .f = 0., got 13"):
        Scenario.from_dict({**TINY, "dataset": "tiny-set", "n": 13})
    data.register_dataset("tiny-set")(lambda data_dir: None)  # registered again, without a size: unknown
    assert data.train_size("tiny-set") is None
    with pytest.raises(ValueError, match="train_size must be an integer >= 1 or None, got 0"):
        data.register_dataset("other", train_size=0)


# ---- every field, every wrong type ------------------------------------------------------

# what each field takes; the table must name every field, so a new one gets checked too
KINDS = {
    "dataset": "str", "data_dir": "str?", "partition": "str", "gamma": "num", "alpha": "num", "shards": "int",
    "augment": "bool?", "model": "str", "dropout": "num", "norm": "str", "gn_groups": "int", "bn_momentum": "num",
    "fixbn_switch": "int?", "hbn_lambda": "num", "algorithm": "str", "n": "int", "f": "int", "rounds": "int",
    "batch_size": "int", "lr": "num", "lr_milestones": "list", "momentum": "num", "weight_decay": "num",
    "local_steps": "int", "participation": "num", "grad_attack": "str", "bn_attack": "str?",
    "grad_attack_params": "dict", "bn_attack_params": "dict?", "grad_agg": "str", "bn_agg": "str?",
    "grad_agg_params": "dict", "bn_agg_params": "dict?", "agg_f": "int?", "root_size": "int?",
    "client_filter": "str?", "client_filter_params": "dict?", "eval_every": "int", "eval_subset": "int?", "seed": "int", "device": "str",
    "user_code": "digests?",  # {module: digest}: of the sample values only None (the {"a": 1} table is no digests)
    **{f"{c}_{p}": "dict?" if p.endswith("params") else "str?"
       for c in ("bn_mean", "bn_var") for p in ("attack", "attack_params", "agg", "agg_params")},
}
VALUES = {"int": 3, "float": 2.5, "str": "x", "bool": True, "None": None, "list": [1, "x"], "dict": {"a": 1},
          "nested": [[1, "x"], {"a": [None]}]}
TAKES = {"str": {"str"}, "str?": {"str", "None"}, "int": {"int"}, "int?": {"int", "None"}, "num": {"int", "float"},
         "bool?": {"bool", "None"}, "dict": {"dict"}, "dict?": {"dict", "None"}, "list": {"list", "nested"},
         "digests?": {"None"}}


def test_the_kind_table_names_every_field():
    assert set(KINDS) == {f.name for f in dataclasses.fields(Scenario)}


@pytest.mark.parametrize("field", sorted(KINDS))
@pytest.mark.parametrize("kind", sorted(VALUES))
def test_a_value_of_the_wrong_type_is_a_scenario_error_naming_the_field(field, kind):
    """Any value of any type gives a scenario or a ScenarioError, never another exception;
    a value of a type the field does not take names that field."""
    try:
        Scenario.from_dict({**TINY, "f": 1, field: VALUES[kind]})
    except ScenarioError as e:
        if kind not in TAKES[KINDS[field]]:
            assert e.field == field, e
    else:
        assert kind in TAKES[KINDS[field]], f"{field} = {VALUES[kind]!r} was accepted"


# ---- one run, one hash, however its numbers are written ------------------------------------

def outcome(fields: dict):
    """(to_dict, hash) of a valid scenario, or the field its ScenarioError names."""
    try:
        sc = Scenario.from_dict({**TINY, **fields}).to_dict()
    except ScenarioError as e:
        return "error", e.field
    return sc, scenario_hash(sc)


@given(field=st.sampled_from(sorted(NUMBERS)), v=st.integers(-3, 10**6))
def test_an_integer_in_a_float_field_is_the_float_it_equals(field, v):
    fields = {"algorithm": "fedavg"} if field == "participation" else {}
    assert outcome({**fields, field: v}) == outcome({**fields, field: float(v)})


@given(start=st.integers(1, 10**6), lr=st.integers(1, 10**6))
def test_an_integer_learning_rate_in_a_milestone_is_the_float_it_equals(start, lr):
    same = outcome({"lr_milestones": [[start, lr]]})
    assert same == outcome({"lr_milestones": [[start, float(lr)]]}) and same[0]["lr_milestones"] == [[start, float(lr)]]


@given(case=st.sampled_from([("foe", "eps"), ("scale", "factor"), ("gaussian", "sigma"), ("gaussian", "mean"),
                             ("alie", "z")]), v=st.integers(0, 10**6))
def test_an_integer_for_a_float_parameter_is_the_float_it_equals(case, v):
    attack, param = case
    written = [{"f": 1, "grad_attack": attack, "grad_attack_params": {param: value}} for value in (v, float(v))]
    assert outcome(written[0]) == outcome(written[1]) and outcome(written[0])[0] != "error"
    cc = [{"grad_agg": "cc", "grad_agg_params": {"tau": value}} for value in (v + 1, float(v + 1))]
    assert outcome(cc[0]) == outcome(cc[1])


def test_integer_parameters_and_set_overrides_keep_their_type(tmp_path):
    base = {"f": 1, "grad_attack": "mimic", "grad_attack_params": {"target": 2}}
    assert outcome(base)[0]["grad_attack_params"] == {"target": 2}  # an int parameter stays an int
    path = scenario_file(tmp_path, lr=1.0, momentum=0)
    (_, [given_int]), (_, [set_int]) = load(path), load(path, ["lr=1", "momentum=0.0"])
    assert given_int.to_dict() == set_int.to_dict() and given_int.lr == 1.0 and given_int.momentum == 0.0
    assert isinstance(given_int.lr, float) and isinstance(given_int.momentum, float)


# ---- components check their own parameters ---------------------------------------------------

@pytest.mark.parametrize("name, params, words", [
    ("gaussian", {"sigma": -1.0}, "gaussian: sigma must be a finite number >= 0, got -1.0"),
    ("gaussian", {"mean": float("nan")}, "gaussian: mean must be a finite number, got nan"),
    ("gaussian", {"seed": "abc"}, "gaussian: seed must be an integer in [0, 18446744073709551615], got 'abc'"),
    ("gaussian", {"generator": 3}, "gaussian: generator must be a torch.Generator or None"),
    ("scale", {"factor": "1e38"}, "scale: factor must be a finite number, got '1e38'"),
    ("alie", {"z": True}, "alie: z must be a finite number, got True"),
    ("mimic", {"target": 1.0}, "mimic: target must be an integer >= 0, got 1.0"),
    ("inf", {"sign": 1.5}, "inf: sign must be 1 or -1"),
    ("opt-foe", {"steps": 1}, "opt-foe: steps must be an integer in [2, 10000]"),
    ("opt-alie", {"low": "0"}, "opt-alie: low must be a finite number"),
    ("opt-alie", {"low": 2.0, "high": 1.0}, "opt-alie: needs high > low"),
    ("bn-kl", {"z_max": -1.0}, "bn-kl: z_max must be a finite number >= 0"),
])
def test_attacks_check_their_parameters(name, params, words):
    with pytest.raises(ValueError) as e:
        attacks.build(name, pipeline=len, **params)
    assert words in str(e.value)


def test_mimic_and_alie_check_the_sizes_before_forging():
    import torch
    with pytest.raises(ValueError, match=r"mimic: target must be the index of an honest message, in \[0, h=3\)"):
        attacks.build("mimic", target=3)(torch.zeros(3, 2), 1)
    attacks.build("mimic", target=2).check(3, 1)
    with pytest.raises(ValueError, match="pass z explicitly"):
        attacks.build("alie").check(4, 6)


@pytest.mark.parametrize("spec, params, words", [
    ("bucketing+median", {"seed": "abc"}, "bucketing: seed must be an integer"),
    ("bucketing+median", {"s": 2.0}, "bucketing: s (bucket size) must be an integer >= 1, got 2.0"),
    ("bucketing+median", {"generator": "g"}, "bucketing: generator must be a torch.Generator or None"),
    ("clipping+mean", {"c": "big"}, "c (the clipping radius; None: the median norm) must be a finite number > 0"),
    ("geomed", {"nu": True}, "geomed: nu must be a finite number > 0, got True"),
    ("geomed", {"iters": 2.5}, "geomed: iters must be an integer in [1, 10000]"),
    ("cc", {"tau": -1.0}, "cc: tau must be a finite number > 0"),
    ("multikrum", {"m": "3"}, "multikrum: m must be an integer >= 1"),
    ("monna", {"idx": True}, "monna: idx must be an integer >= 0"),
    ("dnc", {"c": "1"}, "dnc: c (filtering fraction) must be a finite number >= 0"),
    ("dnc", {"seed": -1}, "dnc: seed must be an integer in [0, 18446744073709551615], got -1"),
    ("signguard", {"upper": 0.5}, "signguard: upper must be a number >= 1"),
    ("signguard", {"fraction": 1.5}, "signguard: fraction (of coordinates) must be a finite number > 0 and <= 1"),
    ("mda", {"max_subsets": True}, "mda: max_subsets must be an integer in [1, 10000000]"),
])
def test_aggregation_steps_check_their_parameters(spec, params, words):
    with pytest.raises(ValueError) as e:
        aggregators.build(spec, f=1, **params)
    assert words in str(e.value)
    assert aggregators.build("signguard", upper=float("inf")).agg.upper == float("inf")  # no upper filter


# ---- plots with table- and list-valued axes ----------------------------------------------------

def stored_row(i: int, **fields) -> dict:
    """A finished run as `Store.rows` gives it (every BN channel spelled out)."""
    from robustbn.channels import expand_channels

    sc = expand_channels(Scenario.from_dict({**TINY, "n": 7, "f": 2, "rounds": 6, **fields}).to_dict())
    history = [{"round": t, "test_acc": 0.1 * i + t / 100, "test_loss": 1.0} for t in (3, 6)]
    return {**sc, "status": "done", "history": history, "final_acc": history[-1]["test_acc"], "best_acc": None,
            "final_loss": 1.0, "rounds_done": 6, "resumed_from": None, "wall_time_s": 1.0, "device": "cpu",
            "hash": str(i), "error": None}


@pytest.mark.parametrize("axis, values", [
    ("lr_milestones", [[[2, 0.05]], [[3, 0.01]]]),
    ("grad_attack_params", [{"z": 1.0}, {"z": 2.0}]),
    ("grad_agg_params", [{"tau": 1.0}, {"tau": 2.0}]),
    ("bn_mean_attack_params", [{"eps": 0.1}, {"eps": 0.2}]),
])
def test_plots_take_table_and_list_valued_axes(axis, values):
    from robustbn.plots import figure

    fixed = {"grad_attack": "alie", "grad_agg": "cc", "bn_mean_attack": "foe", "bn_var_attack": "honest"}
    rows = [stored_row(i, **fixed, **{axis: v}, seed=seed, gamma=gamma)
            for i, (v, seed, gamma) in enumerate((v, s, g) for v in values for s in (0, 1) for g in (0.0, 0.5))]
    curves = figure(rows, "curves").axes[0]
    assert len(curves.get_lines()) == 4  # one per value and gamma, the seeds pooled
    for x in ("gamma", axis):
        (legend,) = figure(rows, "heterogeneity", x=x).legends  # below the axes, whole
        assert len(legend.get_texts()) == 2  # a line per value of the other axis
