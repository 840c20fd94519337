"""Every rule, attack and filter of the catalogue runs in a matrix, through `robustbn run`,
on every protocol family that can take it: each run finishes with a finite model, and the
worst-case table reads the store."""

import json
import math

import pytest

import aggregators
import attacks
from robustbn.cli import main
from robustbn.store import Store

SMALL = """
dataset = "synthetic-images"
model = "simple-cnn"
partition = "gamma"
gamma = 0.5
n = 7
f = 1
rounds = 3
batch_size = 8
eval_every = 3
"""

RULES = ["mda", "smea", "caf", "bulyan", "dnc", "signguard", "cclust", "fltrust"]
ATTACKS = ["ipm", "minmax", "minsum", "fang", "labelflip", "adaptive"]


def run_matrix(tmp_path, text, db="m.sqlite"):
    path = tmp_path / "m.toml"
    path.write_text(text)
    code = main(["run", str(path), "--db", str(tmp_path / db), "--quiet"])
    store = Store(tmp_path / db)
    rows = store.rows()
    store.close()
    return code, rows


def test_the_catalogue_is_registered():
    assert set(RULES) <= set(aggregators.AGGREGATORS)
    assert set(ATTACKS) | {"bn-kl"} <= set(attacks.ATTACKS)


@pytest.mark.parametrize("norm", ["fbn", "hbn"])
def test_every_new_rule_defends_every_channel_it_can_in_a_matrix(tmp_path, norm):
    text = SMALL + f"""norm = "{norm}"
grad_agg = {json.dumps(RULES)}
bn_agg = "median"
grad_attack = "alie"
bn_mean_attack = "sf"
bn_var_attack = "honest"
"""
    code, rows = run_matrix(tmp_path, text)
    assert code == 0 and len(rows) == len(RULES)
    assert all(r["status"] == "done" and math.isfinite(r["final_acc"]) for r in rows)
    assert {r.get("root_size") for r in rows if r["grad_agg"] == "fltrust"} == {100}


def test_every_new_rule_aggregates_statistics_in_a_matrix(tmp_path):
    text = SMALL + f"""norm = ["naive", "fbn"]
bn_agg = {json.dumps([r for r in RULES if r != "fltrust"])}
bn_attack = "bn-kl"
"""
    code, rows = run_matrix(tmp_path, text)
    assert code == 0 and len(rows) == 2 * (len(RULES) - 1)
    assert all(r["status"] == "done" and math.isfinite(r["final_acc"]) for r in rows)


@pytest.mark.parametrize("algorithm, norms", [("dsgd", ["naive", "fbn", "hbn", "fedbn"]), ("fedavg", ["fbn", "fedbn"])])
def test_every_new_attack_and_the_filter_run_in_a_matrix(tmp_path, algorithm, norms):
    text = SMALL + f"""algorithm = "{algorithm}"
norm = {json.dumps(norms)}
grad_agg = ["trmean", "krum", "fltrust"]
grad_attack = {json.dumps(ATTACKS)}
bn_attack = "honest"
client_filter = ["none", "bnguard"]
[[exclude]]
norm = "fedbn"
client_filter = "bnguard"
[[exclude]]   # the filter drops clients before any rule: one rule shows it
client_filter = "bnguard"
grad_agg = ["krum", "fltrust"]
"""
    code, rows = run_matrix(tmp_path, text)
    assert code == 0 and len(rows) == len(ATTACKS) * (3 * len(norms) + len(norms) - 1)
    assert all(r["status"] == "done" and math.isfinite(r["final_acc"]) for r in rows)
    filtered = [r for r in rows if r.get("client_filter") == "bnguard"]
    assert filtered and all({"honest_dropped", "byzantine_dropped"} <= set(r["history"][-1]) for r in filtered)
    code = main(["results", "--db", str(tmp_path / "m.sqlite"), "--worst-case", "--format", "json"])
    assert code == 0
