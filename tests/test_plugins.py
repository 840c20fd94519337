"""An open testbed: a user's rule, attack, protocol, model and dataset, named `module:Name` in
a scenario file beside their module or registered in Python, run like the built-ins, in this
process, in `--jobs` workers and in Ray tasks; every bad reference is one line and exit 2."""

import importlib
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import aggregators
import attacks
import robustbn
from aggregators import plugins
from robustbn import data, models, protocols
from robustbn.cli import main

from matrices import TINY_RUN, torch_threads
from test_cluster import histories, local_ray  # noqa: F401  (a fixture)

RULES = '''
import torch
import aggregators


class MyTrimmedMean(aggregators.Rule):
    """Drop the f largest and f smallest values per coordinate: the built-in trmean, by hand."""
    name = "my-trmean"

    def __init__(self, f: int):
        self.f = f

    def rows_out(self, n):
        if 2 * self.f >= n:
            raise ValueError(f"my-trmean: needs 2f < n, got f={self.f}, n={n}")
        return 1

    def apply(self, x):
        n = x.shape[0]
        return torch.sort(x, dim=0).values[self.f : n - self.f].mean(0)


class NotARule:
    pass
'''

ATTACKS = '''
import attacks


class Shift(attacks.Attack):
    """Every Byzantine client sends the honest mean plus `delta` on every coordinate."""
    name = "shift"

    def __init__(self, delta: float = 1.0):
        self.delta = float(delta)

    def forge(self, honest, f):
        return (honest.mean(0) + self.delta).repeat(f, 1)
'''

MATRIX = TINY_RUN + """norm = "fbn"
f = 1
grad_attack = "{attack}"
grad_attack_params = {{ delta = 0.5 }}
grad_agg = "{agg}"
bn_attack = "sf"
bn_agg = "median"
seed = [0, 1]
"""


@pytest.fixture
def user_dir(tmp_path, clean_search_path):
    """A directory holding the user's modules (names unique to the test) and a scenario file
    beside them; the search path, sys.path and sys.modules are restored afterwards."""
    suffix = tmp_path.name.replace("-", "_")
    rules, atks = f"myrules_{suffix}", f"myattacks_{suffix}"
    (tmp_path / f"{rules}.py").write_text(RULES)
    (tmp_path / f"{atks}.py").write_text(ATTACKS)
    return tmp_path, rules, atks


def matrix(path, attack, agg):
    path.write_text(MATRIX.format(attack=attack, agg=agg))
    return str(path)


def by_seed(db) -> list:
    return [history for _, history in sorted(histories(db).values(), key=lambda r: str(r[1]))]


def run(*args) -> int:
    return main(["run", *map(str, args), "--quiet"])


def test_a_users_rule_and_attack_run_alike_in_process_in_workers_and_as_registered(user_dir, capsys):
    tmp, rules, atks = user_dir
    file = matrix(tmp / "mine.toml", f"{atks}:Shift", f"nnm+{rules}:MyTrimmedMean")
    with torch_threads(1):
        assert run(file, "--db", tmp / "here.sqlite") == 0
    assert run(file, "--db", tmp / "jobs.sqlite", "--jobs", "2") == 0
    assert "2 runs: 2 ran" in capsys.readouterr().out
    # the same classes registered in Python, named as built-ins
    aggregators.register(importlib.import_module(rules).MyTrimmedMean)
    attacks.register(importlib.import_module(atks).Shift)
    try:
        named = matrix(tmp / "named.toml", "shift", "nnm+my-trmean")
        with torch_threads(1):
            assert run(named, "--db", tmp / "named.sqlite") == 0
    finally:
        del aggregators.AGGREGATORS["my-trmean"], attacks.ATTACKS["shift"]
    here = by_seed(tmp / "here.sqlite")
    assert len(here) == 2 and here == by_seed(tmp / "jobs.sqlite") == by_seed(tmp / "named.sqlite")
    # and it is the built-in trimmed mean
    with torch_threads(1):
        assert run(matrix(tmp / "builtin.toml", f"{atks}:Shift", "nnm+trmean"), "--db", tmp / "builtin.sqlite") == 0
    assert by_seed(tmp / "builtin.sqlite") == here


def test_an_edited_module_is_another_run_never_the_stale_one(user_dir, capsys):
    """A run records the digest of each user's module it names: editing the module (a default,
    the arithmetic) makes the next `robustbn run` run again, a file that records the old digest
    is refused, and a run planned before the edit refuses to start after it."""
    import json
    import sqlite3

    from robustbn.errors import ScenarioError
    from robustbn.matrix import load
    from robustbn.runner import run as run_scenario

    tmp, rules, atks = user_dir
    file = matrix(tmp / "mine.toml", f"{atks}:Shift", f"nnm+{rules}:MyTrimmedMean")
    planned = load(file)[1][0]
    assert set(planned.user_code) == {rules, atks}
    db = tmp / "s.sqlite"
    with torch_threads(1):
        assert run(file, "--db", db) == 0
        module = tmp / f"{atks}.py"
        module.write_text(module.read_text().replace("delta: float = 1.0", "delta: float = 2.50"))
        # this process still holds the old module: it refuses rather than run it under the new digest
        assert run(file, "--db", db) == 2
        assert "changed on disk after this process imported it" in capsys.readouterr().err
        del sys.modules[atks]  # what a new process does: import the edited file
        assert run(file, "--db", db) == 0
    assert "2 runs: 2 ran, 0 already done" in capsys.readouterr().out.splitlines()[-1]
    with sqlite3.connect(db) as con:
        codes = [json.loads(c) for (c,) in con.execute("SELECT json_extract(scenario, '$.user_code') FROM runs")]
    assert len(codes) == 4 and len({c[atks] for c in codes}) == 2 and len({c[rules] for c in codes}) == 1
    with pytest.raises(ScenarioError, match=f"module '{atks}' has changed since this run was planned"):
        run_scenario(planned)
    # a file written with the old digest (a confirmation file, say) is refused in one line
    (tmp / "old.toml").write_text(MATRIX.format(attack=f"{atks}:Shift", agg=f"nnm+{rules}:MyTrimmedMean")
                                  + f"user_code = {{ {rules} = \"{planned.user_code[rules]}\", "
                                    f"{atks} = \"{planned.user_code[atks]}\" }}\n")
    assert run(tmp / "old.toml", "--db", db) == 2
    err = capsys.readouterr().err
    assert "user_code" in err and "a module changed since the file was written" in err and "Traceback" not in err


def test_a_users_rule_and_attack_share_a_setting_with_the_built_ins(user_dir, capsys):
    """user_code tells versions of a module apart, not a user's class from a built-in: the
    worst case is over both attacks, the two defenses are compared, and --compare pairs them."""
    import json

    tmp, rules, atks = user_dir
    (tmp / "both.toml").write_text(TINY_RUN + f'''norm = "fbn"
f = 1
grad_attack = ["{atks}:Shift", "sf"]
grad_agg = ["nnm+{rules}:MyTrimmedMean", "median"]
bn_attack = "sf"
bn_agg = "median"
seed = [0, 1]
''')
    db = tmp / "b.sqlite"
    with torch_threads(1):
        assert run(tmp / "both.toml", "--db", db) == 0
    capsys.readouterr()
    assert main(["results", "--db", str(db), "--worst-case", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert len(table) == 2 and all(t["attacks"] == 2 and t["verdict"] is not None for t in table), table
    assert main(["results", "--db", str(db), "--compare", "grad_agg=median", f"grad_agg=nnm+{rules}:MyTrimmedMean",
                 "--format", "json"]) == 0
    assert sum(t["pairs"] for t in json.loads(capsys.readouterr().out)) == 4  # 2 attacks x 2 seeds


BROKEN_RULES = '''
import torch
import aggregators
import attacks


class NaNOut(aggregators.Rule):
    """A bug that returns NaN: the server survives it, and the run says so."""
    name = "nan-out"

    def apply(self, x):
        return torch.full_like(x[0], float("nan"))


class TwoValues(aggregators.Rule):
    """A bug that returns the wrong shape: the error names the rule."""
    name = "two-values"

    def apply(self, x):
        return x[:, :2].mean(0)


class OneMessage(attacks.Attack):
    """A bug that returns one message for all f: the error names the attack and the shape."""
    name = "one-message"

    def forge(self, honest, f):
        return -honest.mean(0)
'''


def test_a_rule_returning_nan_is_survived_and_said_and_a_wrong_shape_names_the_rule(tmp_path, clean_search_path,
                                                                                     capsys):
    import json
    import sqlite3

    module = f"broken_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(BROKEN_RULES)
    file = tmp_path / "m.toml"
    file.write_text(TINY_RUN + f'''norm = "fbn"
f = 1
grad_attack = "sf"
grad_agg = ["{module}:NaNOut", "median"]
seed = 0
''')
    db = tmp_path / "s.sqlite"
    with torch_threads(1):
        assert run(file, "--db", db) == 0
    err = capsys.readouterr().err
    assert "warning: 1 run had a non-finite aggregated update" in err and "in 6 of 6 rounds" in err
    with sqlite3.connect(db) as con:
        last = {json.loads(sc)["grad_agg"]: json.loads(h)[-1] for sc, h in con.execute("SELECT scenario, history "
                                                                                         "FROM runs")}
    assert last[f"{module}:NaNOut"]["nonfinite_update_rounds"] == 6 and "nonfinite_update_rounds" not in last["median"]
    with torch_threads(1):
        assert run(file, "--db", db, "--set", f'grad_agg="nnm+{module}:TwoValues"') == 1
    err = capsys.readouterr().err
    assert "nnm+two-values: aggregator 'two-values' returned (2,)" in err and "returns one (" in err
    with torch_threads(1):
        assert run(file, "--db", db, "--set", f'grad_attack="{module}:OneMessage"', "--set", 'grad_agg="median"') == 1
    err = capsys.readouterr().err
    assert "attack 'one-message' returned (" in err and "a tensor of shape (f, d) = (1, " in err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA"))])
def test_a_nan_rule_is_counted_on_the_runs_device_and_its_updates_never_applied(tmp_path, clean_search_path,
                                                                               device):
    module = f"broken_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(BROKEN_RULES)
    plugins.add_search_path(tmp_path)
    # GroupNorm: no BN statistics, so a model whose updates are never applied evaluates alike every round
    sc = dict(dataset="synthetic-images", norm="gn", n=4, f=1, rounds=4, batch_size=8, eval_every=1,
              grad_attack="sf", grad_agg=f"{module}:NaNOut", device=device)
    with torch_threads(1):
        result = robustbn.run(sc)
    assert result.device.startswith(device)
    assert result.history[-1]["nonfinite_update_rounds"] == 4
    losses = {h["test_loss"] for h in result.history}
    assert len(result.history) == 4 and len(losses) == 1 and all(math.isfinite(v) for v in losses)


def test_a_users_rule_and_attack_run_alike_in_ray_tasks(user_dir, local_ray, capsys):  # noqa: F811
    tmp, rules, atks = user_dir
    file = matrix(tmp / "mine.toml", f"{atks}:Shift", f"nnm+{rules}:MyTrimmedMean")
    with torch_threads(1):
        assert run(file, "--db", tmp / "here.sqlite") == 0
    assert run(file, "--db", tmp / "ray.sqlite", "--executor", "ray") == 0
    assert by_seed(tmp / "ray.sqlite") == by_seed(tmp / "here.sqlite")


def test_a_files_search_path_finds_a_users_modules_in_another_directory(user_dir, capsys):
    """`search_path` (relative to the file): the modules live elsewhere, in-process and in workers."""
    tmp, rules, atks = user_dir
    (tmp / "runs").mkdir()
    file = tmp / "runs" / "mine.toml"
    file.write_text(MATRIX.format(attack=f"{atks}:Shift", agg=f"nnm+{rules}:MyTrimmedMean") + 'search_path = ".."\n')
    assert run(file, "--db", tmp / "jobs.sqlite", "--jobs", "2") == 0
    assert "2 runs: 2 ran" in capsys.readouterr().out
    file.write_text(file.read_text().replace('search_path = ".."', 'search_path = ["../nowhere"]'))
    assert run(file, "--db", tmp / "bad.sqlite") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mine.toml: search_path '../nowhere': no such directory" in err, err


def test_files_tune_writes_elsewhere_find_the_users_modules_from_any_directory(user_dir, capsys):
    """A user's defense gets the same treatment: tune's tuning file and tuned files, written in
    another directory, name where the matrix found its modules (a fresh process, run from /,
    resolves them: nothing is imported already)."""
    tmp, rules, atks = user_dir
    file = Path(matrix(tmp / "mine.toml", f"{atks}:Shift", f"nnm+{rules}:MyTrimmedMean"))
    file.write_text(file.read_text().replace("seed = [0, 1]\n", "seed = 0\n"))
    out = tmp / "tuned" / "deep"
    with torch_threads(1):
        assert main(["tune", str(file), "--grid", "lr=[0.05,0.1]", "--seeds", "7", "--report-seeds", "0",
                     "--db", str(tmp / "t.sqlite"), "--out", str(out), "--quiet"]) == 0
    written = sorted(out.glob("*.toml"))
    assert [p.name.split("_")[0] for p in written] == ["tune", "tuned"]
    for path in written:
        assert tomllib.loads(path.read_text())["search_path"] == ["../.."]
        listed = subprocess.run([sys.executable, "-m", "robustbn.cli", "list", str(path)], capture_output=True,
                                text=True, cwd="/")
        assert listed.returncode == 0 and "scenario" in listed.stdout, listed.stderr  # resolved: listed
    # modules found on sys.path, not beside the matrix: no search_path to go stale
    from robustbn.matrix import carried_search_path
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    assert "search_path" not in carried_search_path({"grad_agg": "nnm+onpath:Rule"}, elsewhere, out)
    assert carried_search_path({"grad_agg": f"nnm+{rules}:MyTrimmedMean"}, tmp, out)["search_path"] == ["../.."]
    # a matrix of built-ins only carries no search_path
    plain = tmp / "plain.toml"
    plain.write_text(MATRIX.format(attack="alie", agg="nnm+trmean").replace("grad_attack_params = { delta = 0.5 }\n", ""))
    assert main(["tune", str(plain), "--grid", "lr=[0.05,0.1]", "--db", str(tmp / "p.sqlite"), "--out",
                 str(out / "plain"), "--plan"]) == 0
    assert "search_path" not in (out / "plain" / "tune_plain.toml").read_text()


@pytest.mark.parametrize("key, value, says", [
    ("grad_agg", "nnm+nosuchmodule:Rule", "no module 'nosuchmodule' in "),
    ("grad_agg", "nnm+{rules}:Missing", "has no 'Missing'"),
    ("grad_agg", "nnm+{rules}:NotARule", "NotARule is not a subclass of aggregators.base.Rule"),
    ("grad_agg", "{rules}:MyTrimmedMean+median", "an aggregator: only the last step may be one"),
    ("grad_agg", "nnm+{rules}:", "written 'module:Name'"),
    ("grad_attack", "{atks}:Nope", "has no 'Nope'"),
    ("grad_attack", "{rules}:MyTrimmedMean", "not a subclass of attacks.base.Attack"),
    ("grad_attack_params", "{{ delta = 1, sigma = 2 }}", "does not take sigma"),
    ("norm", "{rules}:MyTrimmedMean", "not a subclass of robustbn.protocols.base.Protocol"),
    ("model", "broken:Net", "importing 'broken' failed: ZeroDivisionError"),
    ("dataset", "{rules}:Nothing", "has no 'Nothing'"),
    ("dataset", "{rules}:MyTrimmedMean", "MyTrimmedMean is not a function data_dir -> robustbn.data.Dataset"),
    ("dataset", "shutil:copyfile", "cannot be called with one argument, data_dir"),
    ("norm", "batchnorm", "unknown norm protocol 'batchnorm'; allowed: naive, fbn"),
    ("model", "resnet18", "unknown model 'resnet18'; allowed: cnn, simple-cnn, resnet20 or 'module:Name'"),
])
def test_every_bad_reference_is_one_line_naming_the_file_and_key(user_dir, capsys, key, value, says):
    tmp, rules, atks = user_dir
    (tmp / "broken.py").write_text("1 / 0\n")
    text = MATRIX.format(attack=f"{atks}:Shift", agg="nnm+trmean")
    value = value.format(rules=rules, atks=atks)
    line = f"{key} = {value}" if key.endswith("_params") else f'{key} = "{value}"'
    text = "\n".join(l for l in text.splitlines() if not l.startswith(f"{key} =")) + "\n" + line + "\n"
    (tmp / "bad.toml").write_text(text)
    assert run(tmp / "bad.toml", "--db", tmp / "r.sqlite") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.toml" in err and f"key {key!r}" in err and says in err, err
    assert not (tmp / "r.sqlite").exists() or histories(tmp / "r.sqlite") == {}


PROTOCOL_MODEL_DATASET = '''
import torch
from torch import nn

from robustbn.data import Dataset, synthetic_images
from robustbn.models import make_conv, make_norm
from robustbn.protocols import FBN


class HalfFBN(FBN):
    """FBN whose server keeps half of its old statistics."""
    name = "half-fbn"
    label = "FBN, half kept"

    def server_update(self, shared_mean, shared_var, *args, **kwargs):
        mean, var = super().server_update(shared_mean, shared_var, *args, **kwargs)
        return (mean + shared_mean) / 2, (var + shared_var) / 2


class TinyNet(nn.Module):
    name = "tiny"

    def __init__(self, norm, in_channels, image_size, num_classes, gn_groups=2, dropout=0.0):
        super().__init__()
        self.body = nn.Sequential(make_conv(norm, in_channels, 8, 3, padding=1), make_norm(norm, 8, gn_groups),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.body(x)


def four_classes(data_dir):
    x, y, xt, yt = synthetic_images(n_train=400, n_test=100, num_classes=4, size=8)
    return Dataset("four-classes", x, y, xt, yt, num_classes=4)
'''


def test_a_users_protocol_model_and_dataset_run_in_a_matrix(user_dir, capsys):
    tmp, _, _ = user_dir
    (tmp / "mine_pmd.py").write_text(PROTOCOL_MODEL_DATASET)
    text = TINY_RUN.replace('model = "simple-cnn"', 'model = "mine_pmd:TinyNet"').replace(
        'dataset = "synthetic-images"', 'dataset = "mine_pmd:four_classes"')
    (tmp / "m.toml").write_text(text + 'norm = ["mine_pmd:HalfFBN", "fbn"]\nf = 1\nbn_attack = "sf"\n'
                                       'bn_agg = "median"\n')
    assert run(tmp / "m.toml", "--db", tmp / "r.sqlite", "--jobs", "2") == 0
    rows = list(histories(tmp / "r.sqlite").values())
    assert len(rows) == 2 and all(status == "done" and history for status, history in rows)
    assert rows[0][1] != rows[1][1]  # the user's server half ran
    from robustbn.labels import norm_words
    assert norm_words("mine_pmd:HalfFBN") == "FBN, half kept"  # its own label in tables and plots, not FBN's


def test_register_decorators_put_a_users_classes_in_every_catalogue(user_dir):
    tmp, _, _ = user_dir
    (tmp / "mine_pmd2.py").write_text(PROTOCOL_MODEL_DATASET)
    plugins.add_search_path(tmp)
    mod = importlib.import_module("mine_pmd2")
    protocols.register(mod.HalfFBN)
    models.register(mod.TinyNet)
    data.register_dataset("four-classes")(mod.four_classes)
    try:
        result = robustbn.run(dict(dataset="four-classes", model="tiny", norm="half-fbn", n=4, f=1, rounds=4,
                                   batch_size=8, eval_every=2, bn_attack="sf", bn_agg="median"))
        assert [h["round"] for h in result.history] == [2, 4] and list(result.bn_stats) == ["body.1"]
    finally:
        del protocols.PROTOCOLS["half-fbn"], models.MODELS["tiny"], data.DATASETS["four-classes"]
    with pytest.raises(TypeError, match="not a subclass of aggregators.Rule"):
        aggregators.register(int)
    with pytest.raises(ValueError, match="lower-case name without"):
        attacks.register(type("Bad", (attacks.Attack,), {"name": "none"}))


def test_resolve_is_one_rule_for_every_catalogue():
    """A registered name as written, then without spaces and case; a reference checked against
    a class or a predicate; every failure one line naming the name and what is allowed."""
    from aggregators.plugins import resolve

    registry = {"alpha": 1, "beta": 2}
    assert resolve("alpha", registry, int, "thing") == 1 and resolve(" BETA ", registry, int, "thing") == 2
    for bad in ("gamma", None, 3, ["alpha"]):
        with pytest.raises(ValueError, match=r"^unknown thing .*; allowed: alpha, beta or 'module:Name'$"):
            resolve(bad, registry, int, "thing")
    assert resolve("json:JSONDecoder", registry, object, "thing").__name__ == "JSONDecoder"
    with pytest.raises(ValueError, match="^thing 'json:dumps': dumps is not a subclass of builtins.int$"):
        resolve("json:dumps", registry, int, "thing")
    assert resolve("json:dumps", registry, lambda obj: None, "thing").__name__ == "dumps"
    with pytest.raises(ValueError, match="^thing 'json:dumps': dumps is no good$"):
        resolve("json:dumps", registry, lambda obj: "is no good", "thing")
