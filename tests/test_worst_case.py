"""Worst-case evaluation (robustbn.worst, `robustbn results --worst-case`, `robustbn plot
worst-case`) on hand-made stores: no training."""

import csv
import io
import json
import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import sem, ttest_rel
from scipy.stats import t as t_dist

from robustbn.cli import build_parser, main
from robustbn.plots import KINDS, figure
from robustbn.scenario import Scenario
from robustbn.store import Store, scenario_hash
from robustbn.worst import worst_case

BASE = dict(dataset="synthetic-images", model="simple-cnn", partition="gamma", n=10, rounds=6, batch_size=8,
            eval_every=3)
DEFENSES = {"mean": dict(bn_agg="mean"), "nnm+median": dict(bn_agg="nnm+median")}
ATTACKS = {"sf-mean": dict(bn_mean_attack="sf", bn_var_attack="honest"), "foe-bn": dict(bn_attack="foe"),
           "alie-grad": dict(grad_attack="alie")}
NAN = float("nan")
# final accuracy of (norm, defense, attack) for seeds 0 and 1
ACC = {
    ("naive", "mean", "sf-mean"): (0.20, 0.22), ("naive", "mean", "foe-bn"): (0.40, 0.42),
    ("naive", "mean", "alie-grad"): (0.30, 0.34),
    # the lowest single run is FOE's 0.10, but its seed mean (0.50) is above ALIE's (0.47)
    ("naive", "nnm+median", "sf-mean"): (0.50, 0.52), ("naive", "nnm+median", "foe-bn"): (0.10, 0.90),
    ("naive", "nnm+median", "alie-grad"): (0.46, 0.48),
    ("fbn", "mean", "sf-mean"): (0.30, 0.32), ("fbn", "mean", "foe-bn"): (0.60, 0.62),
    ("fbn", "mean", "alie-grad"): (0.70, 0.72),
    # a diverged run (NaN) counts at chance, 1 / 10 classes: SF's mean is 0.45 (0.80 if it were left out, above
    # ALIE's 0.61; 0.40 if it counted 0, below the 10% of a model collapsed to one class)
    ("fbn", "nnm+median", "sf-mean"): (NAN, 0.80), ("fbn", "nnm+median", "foe-bn"): (0.65, 0.67),
    ("fbn", "nnm+median", "alie-grad"): (0.60, 0.62),
}
NO_ATTACK = {("naive", "mean"): (0.80, 0.82), ("fbn", "nnm+median"): (0.85, 0.87)}  # f = 3, every channel none/honest
CLEAN = {"naive": (0.90, 0.92), "fbn": (0.93, 0.95)}  # f = 0
MEAN_DEFENSE = "mean"
ROBUST_DEFENSE = "mean on the gradients, nnm+median on the mean and variance"


def history(acc: float) -> list[dict]:
    return [{"round": 3, "test_acc": 0.1, "test_loss": 2.0, "train_loss": 2.0},
            {"round": 6, "test_acc": acc, "test_loss": 1.0, "train_loss": 1.0}]


def add(store: Store, acc: float, **fields) -> str:
    sc = Scenario(**{**BASE, **fields}).validated().to_dict()
    return add_raw(store, acc, sc)


def add_raw(store: Store, acc: float, sc: dict) -> str:
    """A scenario dict as it is (old stores, fields this version does not know)."""
    run_hash = scenario_hash(sc)
    store.finish(run_hash, sc, history(acc), {}, 1.0, "cpu")
    return run_hash


def matrix_store(path) -> Store:
    store = Store(path)
    for seed in (0, 1):
        for (norm, defense, attack), accs in ACC.items():
            add(store, accs[seed], norm=norm, f=3, seed=seed, **DEFENSES[defense], **ATTACKS[attack])
        for (norm, defense), accs in NO_ATTACK.items():
            # seed 1 of FBN's baseline: the Byzantine clients behave honestly, which is no attack either
            honest = dict(bn_attack="honest") if norm == "fbn" and seed == 1 else {}
            add(store, accs[seed], norm=norm, f=3, seed=seed, **DEFENSES[defense], **honest)
        for norm, accs in CLEAN.items():
            add(store, accs[seed], norm=norm, f=0, seed=seed)
    sc = Scenario(**{**BASE, "norm": "fbn", "f": 3, "seed": 2, "bn_attack": "sf"}).validated().to_dict()
    store.start(scenario_hash(sc), sc)  # unfinished: left out
    return store


def by_setting(table):
    return {(t["norm"], t["defense"], t["f"]): t for t in table}


def strict_json(text):
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def db(tmp_path):
    matrix_store(tmp_path / "s.sqlite").close()
    return tmp_path / "s.sqlite"


def test_worst_case_pools_seeds_then_takes_the_minimum_over_attacks(db):
    store = Store(db)
    table = worst_case(store.rows())
    store.close()
    rows = by_setting(table)
    assert list(rows) == [("naive", MEAN_DEFENSE, 0), ("naive", MEAN_DEFENSE, 3), ("naive", ROBUST_DEFENSE, 3),
                          ("fbn", MEAN_DEFENSE, 0), ("fbn", MEAN_DEFENSE, 3), ("fbn", ROBUST_DEFENSE, 3)]
    t = rows["naive", MEAN_DEFENSE, 3]
    assert t["worst_acc"] == pytest.approx(0.21) and t["worst_std"] == pytest.approx(0.01 * 2 ** 0.5)
    assert (t["ci_low"], t["ci_high"]) == pytest.approx(t_dist.interval(0.95, 1, loc=0.21, scale=sem([0.20, 0.22])))
    # naive: nnm+median's worst case (ALIE, 0.46 and 0.48) beats the mean's (SF, 0.20 and 0.22) by 0.26 on both seeds
    assert (t["verdict"], t["gap"], t["gap_pairs"]) == ("worse", pytest.approx(0.26), 2)
    assert rows["naive", ROBUST_DEFENSE, 3]["verdict"] == "best" and rows["naive", ROBUST_DEFENSE, 3]["gap"] is None
    assert t["worst_attack"] == "SF on the mean" and t["worst_short"] == "SF (mean)"
    assert (t["worst_grad_attack"], t["worst_bn_mean_attack"], t["worst_bn_var_attack"]) == ("none", "sf", "honest")
    assert (t["attacks"], t["seeds"], t["diverged"]) == (3, 2, 0)
    assert t["no_attack_acc"] == pytest.approx(0.81) and t["no_attack_seeds"] == 2
    # seeds pooled first: ALIE's mean 0.47, not FOE's single 0.10 run
    t = rows["naive", ROBUST_DEFENSE, 3]
    assert t["worst_acc"] == pytest.approx(0.47) and t["worst_attack"] == "ALIE on the gradients"
    assert t["worst_short"] == "ALIE (grad)" and t["worst_grad_attack"] == "alie"
    assert t["worst_bn_mean_attack"] == t["worst_bn_var_attack"] == "none"
    assert t["no_attack_acc"] is None and t["no_attack_seeds"] == 0
    # the diverged run counts at chance (0.1) and is flagged
    t = rows["fbn", ROBUST_DEFENSE, 3]
    assert t["worst_acc"] == pytest.approx(0.45) and t["worst_attack"] == "SF on the mean" and t["diverged"] == 1
    assert t["worst_std"] == pytest.approx(0.35 * 2 ** 0.5)  # the sample std of 0.8 and 0.1
    assert (t["ci_low"], t["ci_high"]) == (0.0, 1.0)  # clipped: t.interval gives about [-4.7, 5.5]
    # FBN: nnm+median's worst (SF: 0.1, 0.80) against the mean's (SF: 0.30, 0.32): per seed 0.20 and -0.48
    assert t["verdict"] == "tied for best" == rows["fbn", MEAN_DEFENSE, 3]["verdict"]
    d = ttest_rel([0.1, 0.80], [0.30, 0.32])
    assert rows["fbn", MEAN_DEFENSE, 3]["gap"] == pytest.approx(0.45 - 0.31)
    assert (rows["fbn", MEAN_DEFENSE, 3]["gap_low"], rows["fbn", MEAN_DEFENSE, 3]["gap_high"]) == \
        pytest.approx(tuple(d.confidence_interval(0.95)))
    assert t["no_attack_acc"] == pytest.approx(0.86) and t["attacks"] == 3  # honest is a baseline, not an attack
    assert rows["fbn", MEAN_DEFENSE, 3]["worst_acc"] == pytest.approx(0.31)
    # f = 0: no attacker, the worst case is the clean accuracy
    t = rows["fbn", MEAN_DEFENSE, 0]
    assert t["worst_acc"] == pytest.approx(0.94) == t["no_attack_acc"] and t["attacks"] == 0
    assert t["worst_attack"] == "no attack"
    assert all(t["gamma"] == 0.0 and t["dataset"] == "synthetic-images" for t in table)
    assert not any("seed" in t or "bn_attack" in t or "hash" in t for t in table)


def test_foe_on_both_statistics_and_other_axes_make_separate_settings(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    for gamma in (0.0, 0.5):
        for seed in (0, 1):
            add(store, 0.3 + gamma, norm="fbn", f=3, gamma=gamma, seed=seed, bn_attack="foe")
            add(store, 0.5 + gamma, norm="fbn", f=3, gamma=gamma, seed=seed, bn_mean_attack="sf",
                bn_var_attack="none")
    table = worst_case(store.rows())
    assert [(t["gamma"], t["worst_attack"], t["worst_short"]) for t in table] == [
        (0.0, "FOE on the mean and variance", "FOE (mean, var)"),
        (0.5, "FOE on the mean and variance", "FOE (mean, var)")]
    assert [t["worst_acc"] for t in table] == pytest.approx([0.3, 0.8]) and {t["attacks"] for t in table} == {2}
    store.close()


def test_old_rows_unknown_fields_and_client_filters(tmp_path):
    """Rows of an old store (only the bn_attack / bn_agg shorthands), a field this version does
    not know, NaN in a field, and a client filter: a setting of its own, named in the defense."""
    store = Store(tmp_path / "s.sqlite")
    old = dict(norm="fbn", n=10, f=3, grad_attack="none", grad_agg="mean", bn_attack="sf", bn_agg="median",
               mystery={"a": 1}, odd=NAN)
    for seed, acc in ((0, 0.4), (1, 0.5)):
        add_raw(store, acc, {**old, "seed": seed})
        add_raw(store, acc + 0.2, {**old, "seed": seed, "bn_attack": "alie", "bn_attack_params": {"z": math.inf}})
        add_raw(store, acc + 0.3, {**old, "seed": seed, "bn_attack": "sf", "client_filter": "bnguard",
                                   "client_filter_params": {"k": 2}})
    add_raw(store, NAN, {**old, "seed": 0, "bn_attack": "none"})  # a diverged baseline
    table = worst_case(store.rows())
    assert len(table) == 2
    plain, filtered = table
    assert plain["defense"] == "mean on the gradients, median on the mean and variance"
    assert filtered["defense"] == plain["defense"] + " + bnguard filter (k=2)"
    assert plain["worst_attack"] == "SF on the mean and variance" and plain["worst_acc"] == pytest.approx(0.45)
    assert plain["attacks"] == 2 and plain["no_attack_acc"] == 0.0 and plain["diverged"] == 1
    assert plain["mystery"] == {"a": 1} and filtered["worst_acc"] == pytest.approx(0.75)
    store.close()


def test_results_worst_case_table_csv_json_and_where(db, capsys):
    assert main(["results", "--db", str(db), "--worst-case"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[0].split()
    assert header[:3] == ["norm", "defense", "f"] and "worst_acc" in header and "no_attack_acc" in header
    assert "attacks" in header and "seeds" in header and "diverged" in header
    assert lines[2].startswith("naive ") and "6 settings from 32 finished runs" in out
    assert "diverged: runs whose final accuracy is NaN or missing, counted at chance, 1 / classes" in out
    robust_naive = next(line for line in lines if line.startswith("naive") and "nnm+median" in line)
    assert "0.4700" in robust_naive and "ALIE on the gradients" in robust_naive
    assert "[0.3429, 0.5971]" in robust_naive and " best " in robust_naive
    assert "95% CI" in lines[0] and "verdict" in header and "gap" in header
    assert "95% CI: Student t over seeds, clipped to [0, 1]" in out and "tied for best" in out

    assert main(["results", "--db", str(db), "--worst-case", "--format", "json", "--where", "norm=fbn"]) == 0
    table = strict_json(capsys.readouterr().out)
    assert [(t["norm"], t["defense"], t["f"]) for t in table] == [
        ("fbn", MEAN_DEFENSE, 0), ("fbn", MEAN_DEFENSE, 3), ("fbn", ROBUST_DEFENSE, 3)]
    assert table[2]["worst_acc"] == pytest.approx(0.45) and table[2]["worst_bn_mean_attack"] == "sf"
    assert table[2]["worst_bn_mean_attack_params"] == {} and table[1]["no_attack_acc"] is None

    assert main(["results", "--db", str(db), "--worst-case", "--format", "csv", "--where", "f=3"]) == 0
    records = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(records) == 4 and all(r["f"] == "3" for r in records)
    worst = {(r["norm"], r["defense"]): r for r in records}
    assert float(worst["naive", MEAN_DEFENSE]["worst_acc"]) == pytest.approx(0.21)
    assert worst["naive", MEAN_DEFENSE]["worst_attack"] == "SF on the mean"
    assert worst["naive", ROBUST_DEFENSE]["no_attack_acc"] == ""  # none in the store

    p = main(["results", "--db", str(db), "--worst-case", "--status", "failed"])
    assert p == 2 and "finished runs only" in capsys.readouterr().err


def test_json_is_strict_with_non_finite_values_in_fields(tmp_path, capsys):
    store = Store(tmp_path / "s.sqlite")
    sc = dict(norm="fbn", n=10, f=3, grad_attack="none", grad_agg="mean", bn_attack="scale", bn_agg="median",
              bn_attack_params={"factor": math.inf}, odd=NAN, seed=0)
    add_raw(store, NAN, sc)
    store.close()
    assert main(["results", "--db", str(tmp_path / "s.sqlite"), "--worst-case", "--format", "json"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    (t,) = strict_json(text)
    assert t["worst_acc"] == 0.0 and t["diverged"] == 1 and t["odd"] is None
    assert t["worst_bn_mean_attack_params"] == {"factor": None}


def test_empty_store_and_only_no_attack_runs(tmp_path, capsys):
    Store(tmp_path / "e.sqlite").close()
    assert main(["results", "--db", str(tmp_path / "e.sqlite"), "--worst-case"]) == 0
    assert capsys.readouterr().out.strip() == "no finished runs match: no worst case to report (see `robustbn results`)"
    assert main(["results", "--db", str(tmp_path / "e.sqlite"), "--worst-case", "--format", "json"]) == 0
    assert strict_json(capsys.readouterr().out) == []
    assert main(["plot", "worst-case", "--db", str(tmp_path / "e.sqlite"), "--out", str(tmp_path / "w.png")]) == 2
    assert "nothing to plot" in capsys.readouterr().err

    store = Store(tmp_path / "n.sqlite")
    for seed in (0, 1):
        add(store, 0.7 + seed / 10, norm="fbn", f=3, seed=seed)
    store.close()
    assert main(["results", "--db", str(tmp_path / "n.sqlite"), "--worst-case"]) == 0
    out = capsys.readouterr().out
    assert "no worst_acc: f > 0 but no attack was run in that setting" in out
    assert main(["results", "--db", str(tmp_path / "n.sqlite"), "--worst-case", "--format", "json"]) == 0
    (t,) = strict_json(capsys.readouterr().out)
    assert t["worst_acc"] is None and t["attacks"] == 0 and t["no_attack_acc"] == pytest.approx(0.75)


def test_plot_worst_case_heatmap(db, tmp_path, capsys, monkeypatch):
    import robustbn.plots

    store = Store(db)
    rows = store.rows()
    store.close()
    unframed = figure(rows, "worst-case")  # two seeds: no verdict, as docs/results.md has it (MIN_PAIRS)
    assert not [p for a in unframed.axes for p in a.patches]
    monkeypatch.setattr(robustbn.plots, "MIN_PAIRS", 2)  # the frames' logic, on these two seeds
    fig = figure(rows, "worst-case")
    panels = [a for a in fig.axes if a.get_title()]
    assert [a.get_title() for a in panels] == ["f=0", "f=3"]
    f3 = panels[1]
    assert [t.get_text() for t in f3.get_xticklabels()] == ["naive BN", "FBN"]
    assert [t.get_text().replace("\n", " ") for t in panels[0].get_yticklabels()] == [MEAN_DEFENSE, ROBUST_DEFENSE]
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in f3.texts}
    # each cell, in %: the worst case, its 95% interval over the two seeds (clipped to [0, 100]) and their number,
    # the attack
    assert cells == {(0, 0): "21.0%\n[8.3, 33.7] (2 seeds)\nSF (mean)", (1, 0): "47.0%\n[34.3, 59.7] (2 seeds)\nALIE (grad)",
                     (0, 1): "31.0%\n[18.3, 43.7] (2 seeds)\nSF (mean)", (1, 1): "45.0%\n[0.0, 100.0] (2 seeds)\nSF (mean)"}
    clean = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in panels[0].texts}
    assert clean == {(0, 0): "91.0%\n[78.3, 100.0] (2 seeds)\nno attack", (0, 1): "94.0%\n[81.3, 100.0] (2 seeds)\nno attack"}
    # framed: naive's best (thick); FBN's two tied for best (thin)
    frames = {(round(p.get_y() + 0.47), round(p.get_x() + 0.47)): p.get_linewidth() for p in f3.patches}
    assert frames == {(1, 0): 1.5, (0, 1): 0.8, (1, 1): 0.8}
    assert f3.images[0].get_array()[1, 0] == pytest.approx(47.0)

    out = tmp_path / "plots" / "worst.png"
    assert main(["plot", "worst-case", "--db", str(db), "--out", str(out), "--where", "f=3"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    assert "worst-case" in KINDS
    plot_parser = build_parser()._subparsers._group_actions[0].choices["plot"]
    kind = next(a for a in plot_parser._actions if a.dest == "kind")
    assert tuple(kind.choices) == KINDS


def test_a_worst_case_plots_title_keeps_the_caption_that_says_what_a_cell_is(db):
    with Store(db, readonly=True) as store:
        rows = store.rows()
    untitled, titled = figure(rows, "worst-case"), figure(rows, "worst-case", "gamma = 0, f = 3 of 10")
    caption = untitled.get_suptitle()
    assert "95% CI" in caption and "seeds" in caption and "framed" in caption
    assert titled.get_suptitle() == f"gamma = 0, f = 3 of 10\n{caption}"


def test_settings_whose_defense_words_read_alike_are_told_apart(tmp_path, capsys):
    """agg_f unset and agg_f = f read alike in words: the table shows agg_f, the heatmap says it."""
    store = Store(tmp_path / "s.sqlite")
    sc = dict(norm="fbn", n=10, f=3, grad_attack="none", grad_agg="median", bn_attack="sf", bn_agg="median", seed=0)
    add_raw(store, 0.6, sc)
    add_raw(store, 0.7, {**sc, "agg_f": 3})
    store.close()
    assert main(["results", "--db", str(tmp_path / "s.sqlite"), "--worst-case"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[:4] == ["norm", "defense", "f", "agg_f"]
    fig = figure(Store(tmp_path / "s.sqlite").rows(), "worst-case")
    (panel,) = [a for a in fig.axes if a.get_title()]
    assert panel.get_title() == "worst case over attacks"
    assert [t.get_text() for t in panel.get_yticklabels()] == ["median, agg_f=3", "median, agg_f=None"]
    assert sorted(t.get_text() for t in panel.texts) == ["60.0%\n1 seed\nSF (mean, var)", "70.0%\n1 seed\nSF (mean, var)"]


# ---- the searched attacks: confirmation files' runs are attacks like the catalogue's ----------

def toml_text(values: dict) -> str:
    """A scenario file's text for `values` (lists become axes)."""
    def value(v):
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)
    return "".join(f"{k} = {value(v)}\n" for k, v in values.items())


def toml_file(path, values: dict) -> str:
    path.write_text(toml_text(values))
    return str(path)


SEARCH_SETTING = dict(norm="fbn", f=3, bn_agg="nnm+median")
CATALOGUE = {"sf-mean": dict(grad_attack="none", bn_mean_attack="sf", bn_var_attack="honest"),
             "alie-grad": dict(grad_attack="alie", bn_mean_attack="honest", bn_var_attack="honest")}
CATALOGUE_ACC = {"sf-mean": (0.50, 0.52, 0.48), "alie-grad": (0.40, 0.44, 0.42)}  # seeds 0-2
SEARCHED_ATTACK = dict(grad_attack="ipm", grad_attack_params={"eps": 1.5}, bn_mean_attack="sf",
                       bn_var_attack="honest")


def searched_store(tmp_path, searched_acc):
    """A catalogue of two attacks on seeds 0-2 and a searched attack on seeds 0-3, in one store,
    with the two files that list them."""
    store = Store(tmp_path / "s.sqlite")
    for name, accs in CATALOGUE_ACC.items():
        for seed, acc in enumerate(accs):
            add(store, acc, seed=seed, **SEARCH_SETTING, **CATALOGUE[name])
    for seed, acc in enumerate(searched_acc):
        add(store, acc, seed=seed, **SEARCH_SETTING, **SEARCHED_ATTACK)
    add(store, 0.05, seed=0, **SEARCH_SETTING, grad_attack="ipm", grad_attack_params={"eps": 9.0})  # a trial: no file
    store.close()
    base = {**BASE, **SEARCH_SETTING, "seed": [0, 1, 2]}
    catalogue = toml_file(tmp_path / "worst_case.toml",
                          {**base, "bn_mean_attack": ["sf", "honest"], "bn_var_attack": "honest",
                           "grad_attack": ["none", "alie"],
                           "exclude": None})
    # the exclude rules by hand (toml_file writes flat values only)
    text = open(catalogue).read().replace("exclude = None\n", "") + \
        '[[exclude]]\ngrad_attack = "none"\nbn_mean_attack = "honest"\n' \
        '[[exclude]]\ngrad_attack = "alie"\nbn_mean_attack = "sf"\n'
    open(catalogue, "w").write(text)
    searched = toml_file(tmp_path / "searched_worst_fbn.toml", {**BASE, **SEARCH_SETTING, **SEARCHED_ATTACK,
                                                                 "seed": [0, 1, 2, 3]})
    return tmp_path / "s.sqlite", catalogue, searched


def test_the_worst_case_takes_a_confirmed_searched_attack_where_it_is_lower(tmp_path):
    from robustbn.worst import matrix_rows

    db, catalogue, searched = searched_store(tmp_path, (0.20, 0.30, 0.10, 0.24))
    with Store(db, readonly=True) as store:
        rows = matrix_rows([catalogue, searched], store.rows())
    assert len(rows) == 3 * 2 + 4  # the trial is in no file
    assert {r["source"] for r in rows if r["grad_attack"] == "ipm"} == {searched}
    (t,) = worst_case(rows)
    # the searched attack's own seeds (0-3) and interval, not the catalogue's
    accs = [0.20, 0.30, 0.10, 0.24]
    assert t["worst_acc"] == pytest.approx(sum(accs) / 4) and t["seeds"] == 4
    assert (t["ci_low"], t["ci_high"]) == pytest.approx(t_dist.interval(0.95, 3, loc=sum(accs) / 4, scale=sem(accs)))
    assert (t["worst_kind"], t["worst_source"]) == ("searched", searched)
    assert t["worst_attack"] == "IPM (eps=1.5) on the gradients + SF on the mean" and t["attacks"] == 3
    # without the confirmation file the catalogue's worst stands: ALIE's 0.42 over seeds 0-2
    with Store(db, readonly=True) as store:
        (t,) = worst_case(matrix_rows([catalogue], store.rows()))
    assert t["worst_acc"] == pytest.approx(0.42) and t["seeds"] == 3
    assert (t["worst_kind"], t["worst_source"]) == ("catalogue", catalogue)


def test_a_searched_attack_above_the_catalogues_worst_leaves_it_and_a_run_counts_once(tmp_path):
    from robustbn.worst import matrix_rows

    db, catalogue, searched = searched_store(tmp_path, (0.60, 0.62, 0.64, 0.66))
    with Store(db, readonly=True) as store:
        rows = store.rows()
    (t,) = worst_case(matrix_rows([searched, catalogue], rows))
    assert (t["worst_acc"], t["worst_kind"], t["worst_source"]) == (pytest.approx(0.42), "catalogue", catalogue)
    # a run listed by two files counts once, under the first file
    both = matrix_rows([catalogue, catalogue, searched], rows)
    assert len(both) == 10 and len({r["hash"] for r in both}) == 10
    # no files: no sources, no kind
    (t,) = worst_case([r for r in rows if r["grad_attack"] != "ipm" or r["grad_attack_params"] == {"eps": 1.5}])
    assert t["worst_kind"] is None and t["worst_source"] is None


def test_a_users_own_attack_is_named_own_where_it_is_the_worst(tmp_path):
    """worst_kind: "own" for a user's attack class (module:Name), whatever file lists it; a
    catalogue attack in the same file stays "catalogue"."""
    store = Store(tmp_path / "s.sqlite")
    base = Scenario(**{**BASE, **SEARCH_SETTING, **CATALOGUE["alie-grad"]}).validated().to_dict()
    for seed, acc in enumerate(CATALOGUE_ACC["alie-grad"]):
        add_raw(store, acc, {**base, "seed": seed})
        add_raw(store, acc - 0.3, {**base, "seed": seed, "grad_attack": "myattacks:Shift"})
    rows = [{**r, "source": "mine.toml"} for r in store.rows()]
    store.close()
    (t,) = worst_case(rows)
    assert (t["worst_kind"], t["worst_source"]) == ("own", "mine.toml") and "myattacks:Shift" in t["worst_attack"]
    (t,) = worst_case([r for r in rows if r["grad_attack"] == "alie"])
    assert t["worst_kind"] == "catalogue"


def test_results_and_plot_worst_case_read_several_matrix_files(tmp_path, capsys):
    db, catalogue, searched = searched_store(tmp_path, (0.20, 0.30, 0.10, 0.24))
    assert main(["results", "--db", str(db), "--worst-case", "--format", "json", "--matrix", catalogue,
                 "--matrix", searched]) == 0
    (t,) = strict_json(capsys.readouterr().out)
    assert (t["worst_kind"], t["worst_source"], t["seeds"]) == ("searched", searched, 4)
    assert main(["results", "--db", str(db), "--worst-case", "--matrix", catalogue, "--matrix", searched]) == 0
    out = capsys.readouterr().out
    assert "worst_kind" in out.splitlines()[0] and "searched_worst_fbn.toml" in out
    # a plain view of the same runs: no source column (a CSV stays importable)
    assert main(["results", "--db", str(db), "--format", "csv", "--matrix", catalogue, "--matrix", searched]) == 0
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert "source" not in header
    with Store(db, readonly=True) as store:
        from robustbn.worst import matrix_rows
        fig = figure(matrix_rows([catalogue, searched], store.rows()), "worst-case")
    (panel,) = [a for a in fig.axes if a.get_title()]
    assert [t.get_text().splitlines()[-3:] for t in panel.texts] == [["IPM (grad)", "+ SF (mean)", "(searched)"]]
    assert "(searched): the worst attack is an attack search's" in fig.get_suptitle()
    assert main(["plot", "worst-case", "--db", str(db), "--out", str(tmp_path / "w.png"), "--matrix", catalogue,
                 "--matrix", searched]) == 0
    assert main(["results", "--db", str(db), "--worst-case", "--matrix", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("robustbn results: --matrix ") and "no such scenario file" in err


def robustness_store(path) -> Store:
    """Two protocols x two defenses along gamma (0, 0.5, 1), two attacks, seeds 0-1, a no-attack
    baseline; at FBN + mean, gamma 0.5, the worst attack's seed 1 diverged (NaN: at chance)."""
    store = Store(path)
    for seed in (0, 1):
        for norm in ("naive", "fbn"):
            for d, defense in enumerate(DEFENSES):
                for g, gamma in enumerate((0.0, 0.5, 1.0)):
                    base = 0.2 + 0.15 * g + 0.1 * d + 0.05 * (norm == "fbn") + 0.01 * seed
                    sf = NAN if (norm, defense, gamma, seed) == ("fbn", "mean", 0.5, 1) else base
                    add(store, sf, norm=norm, f=3, seed=seed, gamma=gamma, **DEFENSES[defense],
                        **ATTACKS["sf-mean"])
                    add(store, base + 0.1, norm=norm, f=3, seed=seed, gamma=gamma, **DEFENSES[defense],
                        **ATTACKS["alie-grad"])
                    add(store, base + 0.2, norm=norm, f=3, seed=seed, gamma=gamma, **DEFENSES[defense])
    return store


def test_robustness_curves_draw_the_worst_case_along_x_with_clean_dashed_and_divergence_marked(tmp_path, capsys):
    from robustbn.plots import robustness_lines

    with robustness_store(tmp_path / "r.sqlite") as store:
        rows = store.rows()
    lines = robustness_lines(rows, "gamma")
    assert list(lines) == ["naive", "fbn"]
    fbn = {pts[0]["defense"]: pts for pts in lines["fbn"].values()}
    assert list(fbn) == [MEAN_DEFENSE, ROBUST_DEFENSE]
    # the worst case at each gamma: SF's mean over seeds 0 and 1, a diverged run at 1 / 10 classes
    expect = {0.0: (0.25 + 0.26) / 2, 0.5: (0.40 + 0.1) / 2, 1.0: (0.55 + 0.56) / 2}
    assert {t["gamma"]: t["worst_acc"] for t in fbn[MEAN_DEFENSE]} == pytest.approx(expect)
    assert [t["worst_diverged"] for t in fbn[MEAN_DEFENSE]] == [0, 1, 0]
    assert [t["no_attack_acc"] for t in fbn[MEAN_DEFENSE]] == pytest.approx([0.455, 0.605, 0.755])
    assert [t["no_attack_acc"] for t in fbn[ROBUST_DEFENSE]] == pytest.approx([0.555, 0.705, 0.855])

    fig = figure(rows, "robustness", x="gamma")
    panels = [a for a in fig.axes if a.get_title()]
    assert [a.get_title() for a in panels] == ["naive BN", "FBN"]
    solid = [ln for ln in panels[1].get_lines() if ln.get_linestyle() == "-"]
    dashed = [ln for ln in panels[1].get_lines() if ln.get_linestyle() == "--"]
    assert len(solid) == len(dashed) == 2
    assert list(solid[0].get_xdata()) == [0.0, 0.5, 1.0]
    assert list(solid[0].get_ydata()) == pytest.approx([100 * expect[g] for g in (0.0, 0.5, 1.0)])  # in %
    crosses = lambda ax: [c.get_offsets().tolist() for c in ax.collections if c.get_gid() == "diverged"]
    (cross,) = crosses(panels[1])
    assert cross[0] == pytest.approx([0.5, 100 * expect[0.5]]) and len(cross) == 1 and crosses(panels[0]) == []
    chance = [ln for ln in panels[1].get_lines() if ln.get_gid() == "chance"]
    assert [list(ln.get_ydata()) for ln in chance] == [[10.0, 10.0]]
    # a point not run breaks its line (and its clean line) rather than being bridged; the other line is whole
    gap = [r for r in rows if not (r["norm"] == "fbn" and r["bn_agg"] == "nnm+median" and r["gamma"] == 0.5)]
    fbn_panel = [a for a in figure(gap, "robustness", x="gamma").axes if a.get_title() == "FBN"][0]
    drawn = [[str(v) for v in ln.get_xdata()] for ln in fbn_panel.get_lines() if ln.get_linestyle() in ("-", "--")]
    assert sorted(drawn) == [["0.0", "0.5", "1.0"], ["0.0", "0.5", "1.0"], ["0.0", "nan", "1.0"], ["0.0", "nan", "1.0"]]

    out = tmp_path / "r.png"
    assert main(["plot", "robustness", "--x", "gamma", "--db", str(tmp_path / "r.sqlite"), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["plot", "robustness", "--x", "seed", "--db", str(tmp_path / "r.sqlite"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--x seed" in err and "gamma, f, alpha" in err


def test_each_point_carries_its_worst_attacks_accuracy_per_seed_and_at_f_0_its_clean_runs(tmp_path):
    """worst_by_seed (what curve_findings pairs): per seed, the accuracy of the point's worst
    attack (its mean over seeds is worst_acc); at f = 0, where no attack runs, the clean runs'."""
    from robustbn.plots import robustness_lines

    store = Store(tmp_path / "r.sqlite")
    for seed, (sf, alie, clean) in enumerate([(0.30, 0.50, 0.90), (0.34, 0.20, 0.92)]):
        add(store, sf, norm="fbn", f=1, seed=seed, **ATTACKS["sf-mean"])
        add(store, alie, norm="fbn", f=1, seed=seed, **ATTACKS["alie-grad"])
        add(store, clean, norm="fbn", f=0, seed=seed)
    rows = store.rows()
    store.close()
    (points,) = robustness_lines(rows, "f")["fbn"].values()
    at = {t["f"]: t for t in points}
    assert at[1]["worst_by_seed"] == pytest.approx({0: 0.30, 1: 0.34})  # SF: the lower mean, not each seed's lowest
    assert at[1]["worst_acc"] == pytest.approx(0.32)
    assert at[0]["worst_by_seed"] == pytest.approx({0: 0.90, 1: 0.92})


def test_a_point_with_a_confirmed_search_is_marked_searched_and_ringed(tmp_path):
    """A searched attack's runs (source searched_worst_*.toml) at one point: that point is
    `searched` and ringed in the figure, the others are not (their worst case is over the
    catalogue's attacks only), whether or not the search's attack is the worst there."""
    from robustbn.plots import robustness_lines

    with robustness_store(tmp_path / "r.sqlite") as store:
        found = {add(store, 0.9, norm="fbn", f=3, seed=seed, gamma=1.0, **DEFENSES["mean"], grad_attack="sf")
                 for seed in (0, 1)}
        # each row with the file that holds it, as robustbn.worst.matrix_rows gives them
        rows = [{**r, "source": "scenarios/tuned/searched_worst_fbn_mean_gamma_1_0.toml" if r["hash"] in found
                 else "scenarios/tuned/tuned_fbn_mean.toml"} for r in store.rows()]
    lines = robustness_lines(rows, "gamma")
    marked = {(norm, pts[0]["defense"], t["gamma"]) for norm, mine in lines.items() for pts in mine.values()
              for t in pts if t["searched"]}
    assert marked == {("fbn", MEAN_DEFENSE, 1.0)}
    fig = figure(rows, "robustness", x="gamma")
    panels = [a for a in fig.axes if a.get_title()]
    rings = lambda ax: [c.get_offsets().tolist() for c in ax.collections if c.get_gid() == "searched"]
    fbn_mean = next(pts for pts in lines["fbn"].values() if pts[0]["defense"] == MEAN_DEFENSE)
    assert rings(panels[1]) == [[[1.0, pytest.approx(100 * fbn_mean[-1]["worst_acc"])]]] and rings(panels[0]) == []
    assert any("a confirmed attack search ran" in t.get_text() for t in fig.legends[0].get_texts())


def test_the_map_names_the_best_or_the_tied_set_per_cell_by_the_paired_rule(tmp_path, capsys):
    from robustbn.worst import BEST, ONLY, TIED, defense_map

    noise = [0.00, 0.03, -0.02, 0.01, -0.01]
    accs = {  # (f, gamma): (mean's, nnm+median's) accuracy at seed s
        (3, 0.0): lambda s: (0.10 + noise[s], 0.50 + noise[(s + 2) % 5]),        # nnm+median best
        (3, 1.0): lambda s: (0.60 + noise[s], 0.60 + noise[(s + 1) % 5]),        # tied
        (1, 0.0): lambda s: (0.70 + noise[s], 0.55 + noise[(s + 3) % 5]),        # the mean best
        (1, 1.0): lambda s: (0.80, 0.70),                                         # two seeds: no verdict
        (4, 0.0): lambda s: (0.10, 0.13 + 0.04 * (-1) ** s),                      # tied, the mean at chance
    }
    store = Store(tmp_path / "m.sqlite")
    for (f, gamma), acc in accs.items():
        for seed in range(5 if (f, gamma) != (1, 1.0) else 2):
            for defense, a in zip(DEFENSES, acc(seed)):
                add(store, a, norm="fbn", f=f, gamma=gamma, seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"])
    add(store, 0.3, norm="naive", f=3, gamma=0.0, seed=0, **ATTACKS["sf-mean"])  # alone in its cell
    rows = store.rows()
    store.close()
    cells = {(c["norm"], c["f"], c["gamma"]): c for c in defense_map(rows, "gamma", "f")}
    picks = lambda key: [p["defense"] for p in cells[key]["picks"]]
    assert cells[("fbn", 3, 0.0)]["verdict"] == BEST and picks(("fbn", 3, 0.0)) == [ROBUST_DEFENSE]
    assert cells[("fbn", 3, 1.0)]["verdict"] == TIED and set(picks(("fbn", 3, 1.0))) == {MEAN_DEFENSE, ROBUST_DEFENSE}
    assert cells[("fbn", 1, 0.0)]["verdict"] == BEST and picks(("fbn", 1, 0.0)) == [MEAN_DEFENSE]
    assert cells[("fbn", 1, 1.0)]["verdict"] == "2 seeds, no verdict" and picks(("fbn", 1, 1.0)) == [MEAN_DEFENSE]
    assert cells[("naive", 3, 0.0)]["verdict"] == ONLY and cells[("naive", 3, 0.0)]["defenses"] == 1
    assert cells[("fbn", 3, 0.0)]["picks"][0]["worst_acc"] == pytest.approx(0.50 + statistics.fmean(noise))
    # a lone best carries its margin: the closest other defense and the paired gap, best - it, over the 5 seeds
    nxt = cells[("fbn", 3, 0.0)]["runner_up"]
    gaps = [(0.50 + noise[(s + 2) % 5]) - (0.10 + noise[s]) for s in range(5)]
    assert nxt["defense"] == MEAN_DEFENSE and nxt["gap_pairs"] == 5 and nxt["gap"] == pytest.approx(statistics.fmean(gaps))
    assert nxt["gap_low"] > 0 and cells[("fbn", 3, 1.0)]["runner_up"] is None  # both tied: none outside the set

    fig = figure(rows, "map", x="gamma", y="f")
    fbn = next(a for a in fig.axes if a.get_title() == "FBN, root-free")
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fbn.texts}
    # f = 3 (row 1), gamma 0 (column 0): the defense, each channel in a word, its worst case in %
    p = cells[("fbn", 3, 0.0)]["picks"][0]
    band = f"[{100 * p['ci_low']:.0f}, {100 * p['ci_high']:.0f}]"
    assert texts[(1, 0)].replace("\n", " ") == f"use mean (grad), nnm+median (BN) {100 * p['worst_acc']:.0f}% {band}"
    assert texts[(1, 1)].startswith("2 tied\n") and texts[(0, 1)].startswith("2 seeds, no verdict\n")
    # a tied pick at chance is counted in the verdict, not drawn: the cell names the pick above it alone
    assert texts[(2, 0)].replace("\n", " ").startswith("2 tied, one of them at chance: none is shown above chance mean (grad), "
                                                       "nnm+median (BN) 14% [") and texts[(2, 0)].count("%") == 1
    assert "[95% interval], on 1-5 seeds" in fig.get_suptitle().replace("\n", " ")
    # a cell still waiting for a planned defense picks none in the figure, as in the tables (defense_map's expected)
    waiting = lambda norm, threat, gamma, f: 3 if (norm, gamma, f) == ("fbn", 0.0, 3) else None
    fbn = next(a for a in figure(rows, "map", x="gamma", y="f", expected=waiting).axes
               if a.get_title() == "FBN, root-free")
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fbn.texts}
    assert texts[(1, 0)].replace("\n", " ").startswith("2 of 3 defenses run, no pick yet ")
    assert texts[(1, 1)].startswith("2 tied\n")  # the other cells as before
    # a second setting at one point (another eval_every): the map names the field, it does not overlay them
    store = Store(tmp_path / "m.sqlite")
    add(store, 0.4, norm="fbn", f=3, gamma=0.0, seed=0, eval_every=6, **ATTACKS["sf-mean"])
    mixed = store.rows()
    store.close()
    with pytest.raises(ValueError, match=r"gamma = 0\.0, f = 3 \(fbn\) differ in eval_every \(3, 6\)"):
        defense_map(mixed, "gamma", "f")
    capsys.readouterr()
    assert main(["plot", "map", "--db", str(tmp_path / "m.sqlite"), "--out", str(tmp_path / "mixed.png")]) == 2
    assert "differ in eval_every (3, 6): a map cell holds one setting; keep one with --where" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["plot", "map", "--x", "f", "--y", "f", "--db", str(tmp_path / "m.sqlite"),
                 "--out", str(tmp_path / "m.png")]) == 2
    assert "two different fields" in capsys.readouterr().err


def test_the_table_shows_a_tuned_field_even_where_every_defense_chose_the_same(tmp_path, capsys):
    store = Store(tmp_path / "t.sqlite")
    for seed in range(2):
        for d, defense in enumerate(DEFENSES):
            add(store, 0.3 + 0.2 * d + 0.01 * seed, norm="fbn", f=3, lr=0.05, seed=seed, **DEFENSES[defense],
                **ATTACKS["sf-mean"])
    store.close()
    for tuned, shown in (([], False), (["--tuned", "lr"], True)):
        assert main(["results", "--worst-case", "--db", str(tmp_path / "t.sqlite"), *tuned]) == 0
        out = capsys.readouterr().out
        assert ("lr" in out.splitlines()[0].split()) == shown
        # 2 paired seeds: the CLI gives its verdict, and says the pages would not
        assert "fewer than 5 paired seeds stands on a wide interval" in out


def test_tuned_fields_belong_to_the_defense_in_verdicts_curves_and_the_map(tmp_path, capsys):
    """Each defense ran at its own tuned lr at each gamma (robustbn tune): `tuned=("lr",)` compares
    them with each other (without it, each stands alone: no verdict), keeps one line per
    defense across points of different lr, and writes each point's lr beside it."""
    from robustbn.plots import robustness_lines
    from robustbn.worst import BEST, defense_map

    lrs = {("mean", 0.0): 0.1, ("mean", 1.0): 0.01, ("nnm+median", 0.0): 0.01, ("nnm+median", 1.0): 0.05}
    noise = [0.00, 0.02, -0.01, 0.01, -0.02]
    store = Store(tmp_path / "t.sqlite")
    for (defense, gamma), lr in lrs.items():
        for seed in range(5):
            acc = (0.2 if defense == "mean" else 0.6) + 0.1 * gamma + noise[(seed + len(defense)) % 5]
            add(store, acc, norm="fbn", f=3, gamma=gamma, lr=lr, seed=seed, **DEFENSES[defense], **ATTACKS["sf-mean"])
    rows = store.rows()
    store.close()
    assert {t["verdict"] for t in worst_case(rows)} == {None}  # every (defense, lr) alone at its point
    table = worst_case(rows, tuned=("lr",))
    verdicts = {(t["defense"], t["gamma"]): (t["verdict"], t["lr"]) for t in table}
    assert verdicts[(ROBUST_DEFENSE, 0.0)] == (BEST, 0.01) and verdicts[(MEAN_DEFENSE, 0.0)] == ("worse", 0.1)
    assert verdicts[(ROBUST_DEFENSE, 1.0)] == (BEST, 0.05)

    lines = robustness_lines(rows, "gamma", tuned=("lr",))
    assert [[(t["gamma"], t["lr"]) for t in pts] for pts in lines["fbn"].values()] == \
        [[(0.0, 0.1), (1.0, 0.01)], [(0.0, 0.01), (1.0, 0.05)]]
    cells = defense_map(rows, "gamma", "f", tuned=("lr",))
    assert [(c["gamma"], c["verdict"], c["picks"][0]["lr"]) for c in cells] == [(0.0, BEST, 0.01), (1.0, BEST, 0.05)]
    fig = figure(rows, "robustness", x="gamma", tuned=("lr",))
    (panel,) = [a for a in fig.axes if a.get_title()]
    assert sorted(t.get_text() for t in panel.texts if t.get_gid() == "tuned") == \
        ["lr 0.01", "lr 0.01", "lr 0.05", "lr 0.1"]

    db = str(tmp_path / "t.sqlite")
    assert main(["results", "--db", db, "--worst-case", "--tuned", "lr", "--format", "json"]) == 0
    assert sorted(t["verdict"] for t in json.loads(capsys.readouterr().out)) == [BEST, BEST, "worse", "worse"]
    for argv, words in ((["results", "--db", db, "--tuned", "lr"], "--tuned is for --worst-case"),
                        (["results", "--db", db, "--worst-case", "--tuned", "seed"], "--tuned seed")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err


def test_curve_labels_are_short_in_percent_and_lines_at_the_same_height_keep_their_lr_apart(tmp_path):
    """Two defenses both at chance at gamma 0 (at different tuned lr): their lr labels stand apart
    (at least the gap, in % of the axis), not on top of each other; the legend names each defense
    by its channels' short words and says what (grad) and (BN) mean; the axis is in %."""
    from robustbn.plots import robustness_figure

    lrs = {("mean", 0.0): 0.1, ("mean", 1.0): 0.01, ("nnm+median", 0.0): 0.01, ("nnm+median", 1.0): 0.05}
    with Store(tmp_path / "t.sqlite") as store:
        for (defense, gamma), lr in lrs.items():
            for seed in range(2):
                acc = 0.1 if gamma == 0.0 else 0.5 + 0.2 * (defense == "mean")
                add(store, acc, norm="fbn", f=3, gamma=gamma, lr=lr, seed=seed, **DEFENSES[defense],
                    **ATTACKS["sf-mean"])
        rows = store.rows()
    fig = robustness_figure(rows, "gamma", tuned=("lr",))
    (panel,) = [a for a in fig.axes if a.get_title()]
    at_0 = sorted(t.xyann[1] for t in panel.texts if t.get_gid() == "tuned" and t.xy[0] == 0.0)
    assert len(at_0) == 2 and at_0[0] == pytest.approx(10.0) and at_0[1] - at_0[0] >= 4.5
    at_1 = sorted(t.xyann[1] for t in panel.texts if t.get_gid() == "tuned" and t.xy[0] == 1.0)
    assert at_1 == pytest.approx([50.0, 70.0])  # far apart already: each beside its point
    words = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "mean (grad), nnm+median (BN)" in words
    assert "(grad): on the gradients; (BN): on the BN mean and variance" in words
    assert panel.get_ylim() == (0, 100) and "(%)" in panel.get_ylabel()


def test_a_curve_per_value_of_another_setting_is_named_by_it_and_an_axis_needs_its_partition(tmp_path):
    """Along gamma with f = 1 and f = 3 in the store: a defense draws a line per f, each in its
    own color with its f in the legend, never two alike; --x alpha on gamma-partitioned runs and
    --tuned on the axis itself are refused."""
    from robustbn.plots import robustness_figure

    with Store(tmp_path / "r.sqlite") as store:
        for seed in (0, 1):
            for f in (1, 3):
                for gamma in (0.0, 1.0):
                    add(store, 0.5 - 0.1 * f + 0.2 * gamma + 0.01 * seed, norm="fbn", f=f, seed=seed, gamma=gamma,
                        **DEFENSES["mean"], **ATTACKS["sf-mean"])
        rows = store.rows()
    fig = robustness_figure(rows, "gamma")
    words = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    # every line on 2 seeds: said once, in the caption
    assert [w for w in words if w.startswith(MEAN_DEFENSE)] == [f"{MEAN_DEFENSE} (f=1)", f"{MEAN_DEFENSE} (f=3)"]
    assert "band: 95% CI over 2 seeds (Student t)" in fig.get_suptitle().replace("\n", " ")
    solid = [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() == "-"]
    assert len(solid) == 2 and solid[0].get_color() != solid[1].get_color()
    with pytest.raises(ValueError, match="partition = 'dirichlet'"):
        robustness_figure(rows, "alpha")
    with pytest.raises(ValueError, match="--tuned gamma"):
        robustness_figure(rows, "gamma", tuned=("gamma",))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 90), st.integers(0, 90)), min_size=2, max_size=5))
def test_protocols_are_ranked_by_the_same_paired_rule_as_defenses(accs):
    """protocol_map over FBN and naive BN (one defense each, accuracies per seed drawn) gives
    the verdicts and gaps that worst_case gives the same accuracies as two defenses of one
    protocol: one rule, whatever is compared."""
    import tempfile

    from robustbn.worst import defense_map, protocol_map

    with tempfile.TemporaryDirectory() as tmp:
        with Store(f"{tmp}/a.sqlite") as protocols, Store(f"{tmp}/b.sqlite") as defenses:
            for seed, pair in enumerate(accs):
                for norm, defense, acc in zip(("naive", "fbn"), DEFENSES, pair):
                    add(protocols, acc / 100, norm=norm, f=3, gamma=0.0, seed=seed, **DEFENSES["nnm+median"],
                        **ATTACKS["sf-mean"])
                    add(defenses, acc / 100, norm="fbn", f=3, gamma=0.0, seed=seed, **DEFENSES[defense],
                        **ATTACKS["sf-mean"])
            by_protocol, by_defense = protocols.rows(), defenses.rows()
    (cell,) = protocol_map(by_protocol)
    as_defenses = {"naive" if t["defense"] == MEAN_DEFENSE else "fbn": t for t in worst_case(by_defense)}
    assert [p["norm"] for p in cell["protocols"]] == sorted(
        as_defenses, key=lambda n: (-as_defenses[n]["worst_acc"], n != "naive"))
    for p in cell["protocols"]:
        t = as_defenses[p["norm"]]
        assert (p["verdict"], p["gap_pairs"]) == (t["verdict"], t["gap_pairs"])
        assert p["gap"] == pytest.approx(t["gap"]) if t["gap"] is not None else p["gap"] is None
    (as_cell,) = defense_map(by_defense)  # the cell's verdict too: "n seeds, no verdict" below MIN_PAIRS seeds
    assert cell["verdict"] == as_cell["verdict"]


def test_results_by_protocol_ranks_the_protocols_at_each_point(tmp_path, capsys):
    """`results --worst-case --by-protocol`: a row per protocol at each point, its highest
    defense, the point's verdict on the first; csv/json give the gap paired over seeds; without
    --worst-case, one line of error."""
    db = str(tmp_path / "p.sqlite")
    with Store(db) as store:
        for seed in range(5):
            for norm, level in (("naive", 0.3), ("fbn", 0.5)):
                for defense, extra in (("mean", 0.0), ("nnm+median", 0.05)):  # each protocol's top: nnm+median
                    add(store, level + extra + 0.01 * seed, norm=norm, f=3, gamma=0.0, seed=seed,
                        **DEFENSES[defense], **ATTACKS["sf-mean"])
    assert main(["results", "--worst-case", "--by-protocol", "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:5] == ["0.0000", "3", "use", "FBN", "fbn"] and f"fbn    {ROBUST_DEFENSE}" in lines[2]
    assert lines[3].split()[2] == "naive" and f"naive  {ROBUST_DEFENSE}" in lines[3] and " worse " in lines[3]
    assert main(["results", "--worst-case", "--by-protocol", "--db", db, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["norm"], r["defense"], r["point"], r["verdict"]) for r in rows] == \
        [("fbn", ROBUST_DEFENSE, "use FBN", "best"), ("naive", ROBUST_DEFENSE, "", "worse")]
    assert rows[1]["gap"] == pytest.approx(0.2) and rows[1]["gap_pairs"] == 5
    assert main(["results", "--by-protocol", "--db", db]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--by-protocol is for --worst-case" in err


def test_protocol_words_hold_back_only_what_a_search_could_turn_and_survive_seeds_apart():
    """provisional names the unsearched picks that decide a verdict (the leader and those tied
    with it, above chance), never one already lower or at chance; gap_words says "no seed in
    common" for protocols run on different seeds, and no interval for one pair."""
    from robustbn.worst import BEST, TIED, WORSE, gap_words, provisional

    pick = lambda norm, acc, verdict, **gap: {"norm": norm, "worst_acc": acc, "verdict": verdict,
                                              **{"gap": None, "gap_low": None, "gap_high": None, "gap_pairs": None,
                                                 **gap}}
    cell = {"verdict": BEST, "protocols": [pick("fbn", 0.6, BEST), pick("naive", 0.3, WORSE, gap=0.3, gap_low=0.2,
                                                                        gap_high=0.4, gap_pairs=5)]}
    never = lambda p: False
    assert provisional(cell, never, 0.1) == "; provisional: no attack search confirmed against FBN"  # naive BN: lower
    assert provisional(cell, lambda p: p["norm"] == "fbn", 0.1) == ""
    at_chance = {"verdict": TIED, "protocols": [pick("fbn", 0.105, TIED), pick("naive", 0.1, TIED)]}
    assert provisional(at_chance, never, 0.1) == ""  # at chance: no search lowers them
    tied = {"verdict": TIED, "protocols": [pick("fbn", 0.6, TIED), pick("naive", 0.55, TIED)]}
    assert provisional(tied, never, 0.1) == "; provisional: no attack search confirmed against FBN, naive BN"
    assert provisional({**tied, "verdict": "2 seeds, no verdict"}, never, 0.1) == ""
    # a pick whose own search is confirmed but not yet over its other points' attacks is named as such, not as unsearched
    fbn_partly = lambda p: p["norm"] == "fbn"
    assert provisional(tied, never, 0.1, fbn_partly) == (
        "; provisional: no attack search confirmed against naive BN; the search against FBN has not yet tried the "
        "attacks confirmed at its other points")
    assert provisional(tied, lambda p: p["norm"] == "naive", 0.1, fbn_partly) == (
        "; provisional: the search against FBN has not yet tried the attacks confirmed at its other points")
    assert gap_words(cell, cell["protocols"][1]) == "lower by 30.0 [20.0, 40.0] (5 pairs)"
    apart = pick("naive", 0.3, None, gap=None, gap_pairs=0)
    assert gap_words(cell, apart) == "no seed in common"
    one = pick("naive", 0.3, "1 seed, no verdict", gap=0.3, gap_pairs=1)
    assert gap_words({"verdict": "1 seed, no verdict"}, one) == "gap 30.0 (1 pair, no interval)"


def test_the_protocols_figure_draws_each_protocols_top_defense_along_x(tmp_path, capsys):
    """plot protocols: a panel per threat model, a line per protocol in its own color through
    its highest defense's worst case (%) at each gamma, the defense written where it changes;
    --x alpha is refused in one line."""
    from robustbn.labels import NORM_COLORS
    from robustbn.plots import protocol_figure
    from robustbn.worst import protocol_map

    db = str(tmp_path / "p.sqlite")
    with Store(db) as store:
        for seed in range(2):
            for gamma in (0.0, 1.0):
                for norm, level in (("naive", 0.3), ("fbn", 0.5)):
                    for defense, extra in (("mean", 0.1 * (gamma == 1.0)), ("nnm+median", 0.05)):
                        add(store, level + extra + 0.01 * seed, norm=norm, f=3, gamma=gamma, seed=seed,
                            **DEFENSES[defense], **ATTACKS["sf-mean"])
        rows = store.rows()
    fig = protocol_figure(rows, "gamma")
    (panel,) = [a for a in fig.axes if a.get_title()]
    assert panel.get_title() == "root-free"
    lines = {mcolor(ln.get_color()): ln for ln in panel.get_lines() if ln.get_linestyle() == "-"}
    top = {(p["norm"], c["gamma"]): p for c in protocol_map(rows) for p in c["protocols"]}
    for norm in ("naive", "fbn"):
        line = lines[mcolor(NORM_COLORS[norm])]
        assert list(line.get_ydata()) == pytest.approx([100 * top[(norm, g)]["worst_acc"] for g in (0.0, 1.0)])
    # at gamma 0 nnm+median is each protocol's top, at gamma 1 the mean: written at both points
    texts = sorted(t.get_text().replace("\n", " ") for t in panel.texts)  # a long label wraps
    assert texts == sorted([ROBUST_DEFENSE.replace(" on the gradients", " (grad)").replace(
        " on the mean and variance", " (BN)")] * 2 + [MEAN_DEFENSE] * 2)
    # naive BN still waiting for a third defense at gamma 0: its line starts at gamma 1, FBN's is whole
    waiting = lambda norm, threat, gamma, f: 3 if (norm, gamma) == ("naive", 0.0) else None
    (panel,) = [a for a in protocol_figure(rows, "gamma", expected=waiting).axes if a.get_title()]
    lines = {mcolor(ln.get_color()): ln for ln in panel.get_lines() if ln.get_linestyle() == "-"}
    assert list(lines[mcolor(NORM_COLORS["naive"])].get_xdata()) == [1.0]
    assert list(lines[mcolor(NORM_COLORS["fbn"])].get_xdata()) == [0.0, 1.0]
    # one defense at every point of the panel, its lr tuned per point: the defense in the panel's title, the labels
    # the lr alone, where it moves
    with Store(tmp_path / "lr.sqlite") as store:
        for seed in range(2):
            for gamma, lr in ((0.0, 0.05), (0.5, 0.05), (1.0, 0.1)):
                add(store, 0.5 + 0.01 * seed, norm="fbn", f=3, gamma=gamma, seed=seed, lr=lr, **DEFENSES["mean"],
                    **ATTACKS["sf-mean"])
        tuned_rows = store.rows()
    (panel,) = [a for a in protocol_figure(tuned_rows, "gamma", tuned=("lr",)).axes if a.get_title()]
    assert panel.get_title() == f"root-free\nevery point: {MEAN_DEFENSE}"
    assert sorted((t.xy[0], t.get_text()) for t in panel.texts) == [(0.0, "lr 0.05"), (1.0, "lr 0.1")]
    # a second defense at one point: no title names a defense, the labels do (written once, then the lr alone)
    with Store(tmp_path / "lr.sqlite") as store:
        for seed in range(2):
            add(store, 0.6 + 0.01 * seed, norm="fbn", f=3, gamma=1.0, seed=seed, lr=0.1, **DEFENSES["nnm+median"],
                **ATTACKS["sf-mean"])
        tuned_rows = store.rows()
    (panel,) = [a for a in protocol_figure(tuned_rows, "gamma", tuned=("lr",)).axes if a.get_title()]
    assert panel.get_title() == "root-free"
    assert sorted((t.xy[0], t.get_text().replace("\n", " ")) for t in panel.texts) == [
        (0.0, f"{MEAN_DEFENSE}, lr 0.05"), (1.0, "mean (grad), nnm+median (BN), lr 0.1")]
    out = tmp_path / "p.png"
    assert main(["plot", "protocols", "--x", "gamma", "--db", db, "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["plot", "protocols", "--x", "alpha", "--db", db, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "along gamma or f" in err


def mcolor(c) -> str:
    from matplotlib import colors

    return colors.to_hex(c)


def test_protocols_of_different_settings_are_not_paired(tmp_path, capsys):
    """FBN with 150 rounds and naive BN with 100 at the same point: no comparison, one line
    naming the field and how to keep one setting."""
    from robustbn.worst import SettingsDiffer, protocol_map

    db = str(tmp_path / "d.sqlite")
    with Store(db) as store:
        for seed in range(2):
            add(store, 0.5, norm="fbn", f=3, gamma=0.0, seed=seed, rounds=6, **ATTACKS["sf-mean"])
            add(store, 0.4, norm="naive", f=3, gamma=0.0, seed=seed, rounds=9, **ATTACKS["sf-mean"])
        rows = store.rows()
    with pytest.raises(SettingsDiffer, match=r"rounds \(6, 9\)"):
        protocol_map(rows)
    assert main(["results", "--worst-case", "--by-protocol", "--db", db]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rounds (6, 9)" in err and "--where rounds=9" in err


def test_a_map_cell_at_chance_says_none_works_and_a_tied_set_names_its_picks_at_chance():
    """pick_head: every pick within AT_CHANCE of chance reads "none works (at chance)", whatever
    the verdict; a tied set holding one such pick says none of it is shown above chance; without
    `chance` (a dataset of unknown classes) the verdict alone."""
    from robustbn.worst import AT_CHANCE, BEST, ONLY, TIED, pick_head

    pick = lambda acc: {"defense": "d", "worst_acc": acc}
    chance = 0.1
    assert pick_head({"verdict": TIED, "picks": [pick(0.105), pick(0.1)]}, chance) == "none works (at chance)"
    assert pick_head({"verdict": ONLY, "picks": [pick(chance + AT_CHANCE)]}, chance) == "none works (at chance)"
    assert pick_head({"verdict": TIED, "picks": [pick(0.145), pick(0.14), pick(0.1)]}, chance) == \
        "3 tied, one of them at chance: none is shown above chance"
    assert pick_head({"verdict": TIED, "picks": [pick(0.3), pick(0.1), pick(0.1)]}, chance) == \
        "3 tied, 2 of them at chance: none is shown above chance"
    assert pick_head({"verdict": BEST, "picks": [pick(0.111)]}, chance) == "use"
    assert pick_head({"verdict": ONLY, "picks": [pick(0.58)]}, chance) == ONLY == "the only defense run"
    assert pick_head({"verdict": TIED, "picks": [pick(0.1), pick(0.1)]}) == "2 tied"
    assert pick_head({"verdict": "2 of 3 defenses run, no pick yet", "picks": [pick(0.1)]}, chance) == \
        "2 of 3 defenses run, no pick yet"


def test_a_tied_set_carries_its_margin_over_the_closest_defense_below_it(tmp_path):
    """defense_map: a cell whose two highest defenses tie, with a third below them, names that
    third as its runner_up, with the gap (the first - it) paired over seeds, its interval above 0:
    a defense left out of the tied set is shown, not missing."""
    from robustbn.worst import TIED, defense_map

    noise = [0.00, 0.03, -0.02, 0.01, -0.01]
    three = {**DEFENSES, "median": dict(bn_agg="median")}
    with Store(tmp_path / "t.sqlite") as store:
        for seed in range(5):
            for defense, acc in zip(three, (0.30 + noise[seed], 0.30 + noise[(seed + 2) % 5], 0.12 + noise[seed])):
                add(store, acc, norm="fbn", f=3, gamma=0.0, seed=seed, **three[defense], **ATTACKS["sf-mean"])
        rows = store.rows()
    (cell,) = defense_map(rows, "gamma", "f")
    assert cell["verdict"] == TIED and len(cell["picks"]) == 2
    nxt = cell["runner_up"]
    first = max(cell["picks"], key=lambda p: p["worst_acc"])
    gaps = [first["worst_by_seed"][s] - nxt["worst_by_seed"][s] for s in range(5)]
    assert "median" in nxt["defense"] and nxt["gap_pairs"] == 5 and nxt["gap_low"] > 0
    assert nxt["gap"] == pytest.approx(statistics.fmean(gaps))


def test_a_defense_told_apart_from_the_first_but_above_a_tied_pick_is_no_next_row(tmp_path):
    """A tied pick with widely spread seeds (tied with the first on a wide interval) can stand
    below a defense that tight seeds tell apart from the first: that defense is not below the
    set, so the cell names no runner_up rather than a "next, lower" that stands higher."""
    from robustbn.worst import TIED, defense_map

    accs = {"nnm+median": [0.50] * 5, "mean": [0.30, 0.60, 0.35, 0.55, 0.45],
            "median": [0.47, 0.47, 0.471, 0.469, 0.47]}
    three = {**DEFENSES, "median": dict(bn_agg="median")}
    with Store(tmp_path / "t.sqlite") as store:
        for defense, by_seed in accs.items():
            for seed, acc in enumerate(by_seed):
                add(store, acc, norm="fbn", f=3, gamma=0.0, seed=seed, **three[defense], **ATTACKS["sf-mean"])
        rows = store.rows()
    (cell,) = defense_map(rows, "gamma", "f")
    assert cell["verdict"] == TIED and len(cell["picks"]) == 2
    assert all(" median (BN)" not in p["defense"] for p in cell["picks"])  # told apart from the first
    assert min(p["worst_acc"] for p in cell["picks"]) == pytest.approx(0.45)
    assert cell["runner_up"] is None
