"""Plots in words (legend labels, colors per norm mode, line styles per defense, pooled seeds)
and `robustbn import` (a store rebuilt from CSV exports, hash for hash)."""

import csv
import json
import re
import sqlite3
from pathlib import Path

import matplotlib.colors as mcolors
import pytest
from scipy.stats import sem
from scipy.stats import t as t_dist

from robustbn.cli import main
from robustbn.labels import attack_short, attack_words, defense_words, group
from robustbn.plots import figure, plot
from robustbn.scenario import Scenario
from robustbn.channels import expand_channels
from robustbn.store import Store, read_export, scenario_hash

ROOT = Path(__file__).parent.parent
RESULTS_CSV = ROOT / "docs" / "results.csv"
BASE = dict(dataset="synthetic-images", model="simple-cnn", partition="gamma", n=10, rounds=6, batch_size=8,
            eval_every=3, lr_milestones=[[4, 0.05]])


def history(offset: float, rounds=(3, 6)) -> list[dict]:
    return [{"round": t, "test_acc": round(offset + t / 100, 6), "test_loss": 1.0 / t, "train_loss": 2.0 / t}
            for t in rounds]


def add_run(store: Store, offset: float, rounds=(3, 6), **fields) -> str:
    sc = Scenario(**{**BASE, **fields}).validated().to_dict()
    run_hash = scenario_hash(sc)
    store.finish(run_hash, sc, history(offset, rounds), {}, 1.5, "cpu")
    return run_hash


def two_seed_store(path) -> Store:
    """naive and FBN at f = 0 (no attack) and f = 3 under SF on both BN statistics, undefended
    and defended by nnm+median, two seeds each; one run with SF on the mean only."""
    store = Store(path)
    for seed in (0, 1):
        for i, norm in enumerate(("naive", "fbn")):
            add_run(store, 0.5 + i / 10 + seed / 100, norm=norm, seed=seed)
            for j, agg in enumerate(("mean", "nnm+median")):
                add_run(store, 0.2 + i / 10 + j / 5 + seed / 100, norm=norm, seed=seed, f=3, bn_attack="sf", bn_agg=agg)
        add_run(store, 0.3 + seed / 100, norm="fbn", seed=seed, f=3, bn_mean_attack="sf", bn_var_attack="honest",
                bn_agg="nnm+median")
    return store


CI2 = "(95% CI over 2 seeds)"  # what a pooled legend says


def curves_by_label(fig):
    ax = fig.axes[0]
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


# ---- words -----------------------------------------------------------------------------------

ROW = dict(norm="fbn", n=10, f=3, grad_attack="none", grad_agg="mean", bn_attack="none", bn_agg="mean")


@pytest.mark.parametrize("fields, attack, defense", [
    (dict(bn_attack="sf"), "SF on the mean and variance", "mean"),
    (dict(bn_attack="sf", bn_agg="nnm+median"), "SF on the mean and variance", "nnm+median"),
    # per channel: the other BN channel honest (or silent) is not an attack
    (dict(bn_attack=None, bn_mean_attack="sf", bn_var_attack="honest", bn_agg="nnm+median"), "SF on the mean",
     "nnm+median"),
    (dict(bn_mean_attack="foe", bn_var_attack="none"), "FOE on the mean", "mean"),
    (dict(bn_var_attack="scale", bn_var_attack_params={"factor": 1e-06}, bn_var_agg="nnm+trmean"),
     "variance scaling (factor=1e-06)", "nnm+trmean"),
    (dict(bn_mean_attack="scale"), "scaling on the mean", "mean"),
    (dict(grad_attack="alie", grad_agg="nnm+trmean"), "ALIE on the gradients", "nnm+trmean"),
    (dict(grad_attack="alie", grad_agg="nnm+trmean", bn_attack="sf", bn_agg="nnm+median"),
     "ALIE on the gradients + SF on the mean and variance", "nnm+trmean on the gradients, nnm+median on the mean and variance"),
    (dict(bn_attack="sf", bn_agg=None, bn_mean_agg="nnm+median", bn_var_agg="mean"), "SF on the mean and variance",
     "nnm+median on the mean, mean on the variance"),
    (dict(bn_attack="sf", bn_agg="trmean", agg_f=2), "SF on the mean and variance", "trmean (built for f=2)"),
    (dict(), "no attack (7 honest)", "mean"),
    (dict(bn_attack="honest"), "no attack (7 honest)", "mean"),
    (dict(f=0), "no attack", "mean"),
    (dict(norm="gn", grad_attack="foe", grad_agg="median"), "FOE on the gradients", "median"),
    # cc's radius is shown at its default too: the board holds bucketing+cc at tau 10 and at tau 1
    (dict(norm="gn", grad_attack="ipm", grad_agg="bucketing+cc", grad_agg_params={"center": "previous"}),
     "IPM on the gradients", "bucketing+cc (center=previous, tau=10.0)"),
    (dict(norm="gn", grad_attack="ipm", grad_agg="bucketing+cc", grad_agg_params={"center": "previous", "tau": 1.0}),
     "IPM on the gradients", "bucketing+cc (center=previous, tau=1.0)"),
    (dict(norm="gn", grad_attack="ipm", grad_agg="cc", grad_agg_params={"center": "median"}),
     "IPM on the gradients", "cc (center=median, tau=1.0)"),
    # a run stored before `center` was written meant the stateless rule: no default is guessed for it
    (dict(norm="gn", grad_attack="ipm", grad_agg="cc"), "IPM on the gradients", "cc"),
])
def test_attack_and_defense_in_words(fields, attack, defense):
    row = {**ROW, **fields}
    assert attack_words(row) == attack and defense_words(row) == defense


@pytest.mark.parametrize("fields, short", [
    (dict(bn_attack="sf"), "SF (mean, var)"),
    (dict(grad_attack="alie", bn_attack="sf"), "ALIE (grad) + SF (mean, var)"),
    (dict(grad_attack="alie", bn_attack="alie"), "ALIE (grad, mean, var)"),
    # the same attack at two strengths is two attacks: a shared bracket would say one
    (dict(bn_mean_attack="alie", bn_mean_attack_params={"z": 1.0}, bn_var_attack="alie",
          bn_var_attack_params={"z": 2.0}), "ALIE (mean) + ALIE (var)"),
    (dict(bn_attack="honest"), "no attack"),
])
def test_the_short_attack_shares_a_bracket_only_between_channels_attacked_alike(fields, short):
    assert attack_short({**ROW, **fields}) == short


def test_a_users_rule_shows_the_defaults_it_declares_and_nothing_else(tmp_path, monkeypatch):
    (tmp_path / "radius_rules.py").write_text(
        "import torch\nfrom aggregators import Rule\n"
        "class Radius(Rule):\n"
        "    name = 'radius'\n"
        "    shown_defaults = ('radius',)\n"
        "    def __init__(self, radius=2.5, iters=4):\n"
        "        self.radius, self.iters = radius, iters\n"
        "    def apply(self, x):\n"
        "        return x.mean(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    row = {**ROW, "grad_attack": "alie", "grad_agg": "radius_rules:Radius"}
    assert defense_words(row) == "radius_rules:Radius (radius=2.5)"
    assert defense_words({**row, "grad_agg_params": {"iters": 1}}) == "radius_rules:Radius (iters=1, radius=2.5)"
    assert defense_words({**row, "grad_agg_params": {"radius": 1}}) == "radius_rules:Radius (radius=1)"


def test_expand_channels_fills_old_rows_from_the_shorthand_and_is_idempotent():
    old = {"bn_attack": "sf", "bn_agg": "nnm+median", "bn_attack_params": {}, "bn_agg_params": {}}
    new = expand_channels(old)
    assert (new["bn_mean_attack"], new["bn_var_attack"], new["bn_mean_agg"], new["bn_var_agg"]) == \
           ("sf", "sf", "nnm+median", "nnm+median") and new["bn_attack"] == "sf"
    assert expand_channels(new) == new and old == {"bn_attack": "sf", "bn_agg": "nnm+median", "bn_attack_params": {},
                                                   "bn_agg_params": {}}
    split = expand_channels({"bn_attack": None, "bn_mean_attack": "sf", "bn_var_attack": "none", "bn_agg": "mean"})
    assert split["bn_attack"] is None and split["bn_mean_attack"] == "sf" and split["bn_var_attack"] == "none"
    assert split["bn_var_agg"] == "mean" and split["bn_mean_attack_params"] == {}  # unset: the defaults


# ---- plots -----------------------------------------------------------------------------------

def test_a_defense_under_attacks_on_different_channels_is_named_whole(tmp_path):
    """The papers' words name a defense by its attacked channels' pipeline; where that would give
    one defense two names (fltrust under a gradient attack, fltrust + nnm+trmean under a BN
    attack) or two defenses one (the mean with and without a client filter), each line names the
    whole defense, every channel and the filter, and no field reads "=None"."""
    store = Store(tmp_path / "w.sqlite")
    trusted = dict(grad_agg="fltrust", bn_agg="nnm+trmean", root_size=50)
    for seed in (0, 1):
        add_run(store, 0.5 + seed / 100, norm="fbn", seed=seed, f=3, grad_attack="alie", **trusted)
        add_run(store, 0.4 + seed / 100, norm="naive", seed=seed, f=3, bn_attack="sf", **trusted)
        add_run(store, 0.3 + seed / 100, norm="naive", seed=seed, f=3, grad_attack="alie", bn_attack="honest",
                client_filter="bnguard")
        add_run(store, 0.2 + seed / 100, norm="naive", seed=seed, f=3, grad_attack="alie")
    labels = set(curves_by_label(figure(store.rows(), "curves")))
    store.close()
    whole = "fltrust on the gradients, nnm+trmean on the mean and variance"
    assert labels == {f"FBN, ALIE on the gradients, {whole} {CI2}", f"naive BN, SF on the mean and variance, {whole} {CI2}",
                      f"naive BN, ALIE on the gradients, mean + bnguard filter {CI2}",
                      f"naive BN, ALIE on the gradients, mean {CI2}"}


def test_curves_read_like_the_papers_figures(tmp_path):
    store = two_seed_store(tmp_path / "s.sqlite")
    rows = store.rows()
    fig = figure(rows, "curves")
    lines = curves_by_label(fig)
    assert set(lines) == {
        f"naive BN, no attack {CI2}", f"naive BN, SF on the mean and variance, mean {CI2}",
        f"naive BN, SF on the mean and variance, nnm+median {CI2}",
        f"FBN, no attack {CI2}", f"FBN, SF on the mean and variance, mean {CI2}",
        f"FBN, SF on the mean and variance, nnm+median {CI2}", f"FBN, SF on the mean, nnm+median {CI2}"}
    color = {label: mcolors.to_hex(line.get_color()) for label, line in lines.items()}
    assert len({c for label, c in color.items() if label.startswith("FBN")}) == 1
    assert len({c for label, c in color.items() if label.startswith("naive")}) == 1
    assert color[f"FBN, no attack {CI2}"] != color[f"naive BN, no attack {CI2}"]
    undefended = lines[f"FBN, SF on the mean and variance, mean {CI2}"]
    defended = lines[f"FBN, SF on the mean and variance, nnm+median {CI2}"]
    assert undefended.get_linestyle() == "-" and defended.get_linestyle() not in ("-", "None")
    assert defended.get_linestyle() == lines[f"naive BN, SF on the mean and variance, nnm+median {CI2}"].get_linestyle()
    # the two attacks under one defense: told apart by marker
    assert lines[f"FBN, SF on the mean, nnm+median {CI2}"].get_marker() != defended.get_marker()
    # pooled: the mean of the two seeds, and a band per line: the 95% Student-t interval over them
    assert list(undefended.get_ydata()) == pytest.approx([0.33 + 0.005, 0.36 + 0.005])
    assert len(fig.axes[0].collections) == len(lines)
    band = fig.axes[0].collections[fig.axes[0].get_lines().index(undefended)]
    at_6 = sorted(y for x, y in band.get_paths()[0].vertices if x == 6)
    low, high = t_dist.interval(0.95, 1, loc=0.365, scale=sem([0.36, 0.37]))
    assert (at_6[0], at_6[-1]) == pytest.approx((low, high)) and high - low > 0.1
    out = tmp_path / "curves.png"
    plot(rows, "curves", str(out))
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    store.close()


def test_only_varying_words_appear_and_the_rest_titles_the_plot(tmp_path):
    store = two_seed_store(tmp_path / "s.sqlite")
    rows = [r for r in store.rows() if r["norm"] == "fbn" and r["bn_attack"] == "sf"]
    fig = figure(rows, "curves")
    assert set(curves_by_label(fig)) == {f"mean {CI2}", f"nnm+median {CI2}"}
    assert fig.axes[0].get_title() == "FBN, SF on the mean and variance"
    store.close()


def test_other_varying_fields_become_key_value(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    for gamma in (0.0, 0.5):
        for f in (2, 3):
            add_run(store, gamma / 2 + f / 100, norm="fbn", gamma=gamma, f=f, bn_attack="sf")
    labels = set(curves_by_label(figure(store.rows(), "curves")))
    # f is in no word here (same attack): it is named, as gamma is
    assert labels == {f"f={f}, gamma={g}" for g in (0.0, 0.5) for f in (2, 3)}
    store.close()


def test_heterogeneity_and_heatmap_use_the_words(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    for seed in (0, 1):
        for gamma in (0.0, 0.5):
            for norm in ("naive", "fbn"):
                add_run(store, gamma + seed / 100, norm=norm, gamma=gamma, seed=seed)
                add_run(store, gamma / 2, norm=norm, gamma=gamma, seed=seed, f=3, bn_mean_attack="sf",
                        bn_mean_agg="nnm+median")
    rows = store.rows()
    fig = figure(rows, "heterogeneity")
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert set(labels) == {f"naive BN, no attack {CI2}", f"FBN, no attack {CI2}",
                           f"naive BN, SF on the mean, nnm+median {CI2}", f"FBN, SF on the mean, nnm+median {CI2}"}
    bars = {label: handle.lines[0] for label, handle in zip(labels, handles)}
    assert mcolors.to_hex(bars[f"FBN, no attack {CI2}"].get_color()) == \
           mcolors.to_hex(bars[f"FBN, SF on the mean, nnm+median {CI2}"].get_color()) != \
           mcolors.to_hex(bars[f"naive BN, no attack {CI2}"].get_color())
    clean, attacked = bars[f"FBN, no attack {CI2}"], bars[f"FBN, SF on the mean, nnm+median {CI2}"]
    assert clean.get_linestyle() == "-" != attacked.get_linestyle()
    assert clean.get_marker() != attacked.get_marker()
    assert list(clean.get_ydata()) == pytest.approx([0.065, 0.565])
    # the error bars are the 95% Student-t interval over the two seeds (0.06 and 0.07 at gamma 0)
    (container,) = [h for label, h in zip(labels, handles) if label == f"FBN, no attack {CI2}"]
    low, high = (container.lines[2][0].get_segments()[0][:, 1])
    expected = t_dist.interval(0.95, 1, loc=0.065, scale=sem([0.06, 0.07]))
    assert (low, high) == pytest.approx((max(expected[0], 0.0), expected[1]))
    heat = figure(rows, "heatmap")
    panels = [a for a in heat.axes if a.get_title()]
    assert [a.get_title() for a in panels] == ["naive BN", "FBN"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["no attack", "SF on the mean"]
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["mean", "nnm+median"]
    assert all(a.images[0].get_clim() == (0, 1) for a in panels)  # accuracies in [0, 1], the colors' scale
    # each cell: the mean, its 95% interval over the cell's runs and how many runs
    cells = [t.get_text() for a in panels for t in a.texts]
    assert cells and all(re.fullmatch(r"\d\.\d\d\n(\[\d\.\d\d, \d\.\d\d\] \(\d+ runs\)|1 run, no interval)", c)
                         for c in cells), cells
    assert any("runs)" in c for c in cells)
    # naive BN without attack: 4 runs (2 seeds x 2 gammas), against scipy
    accs = [r["final_acc"] for r in rows if r["norm"] == "naive" and r["f"] == 0]
    mean = sum(accs) / 4
    low, high = t_dist.interval(0.95, 3, loc=mean, scale=sem(accs))
    naive = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in panels[0].texts}
    assert naive[0, 0] == f"{mean:.2f}\n[{max(low, 0.0):.2f}, {min(high, 1.0):.2f}] (4 runs)"
    for kind in ("heterogeneity", "heatmap"):
        plot(rows, kind, str(tmp_path / f"{kind}.png"))
        assert (tmp_path / f"{kind}.png").read_bytes()[:4] == b"\x89PNG"
    store.close()


def test_dict_valued_axes_group_and_label(tmp_path):
    rows = [{**ROW, "seed": 0, "bn_attack": "alie", "lr_milestones": m, "bn_attack_params": p, "status": "done",
             "history": history(0.1 * i), "final_acc": 0.5}
            for i, (m, p) in enumerate([([[4, 0.05]], {}), ([[5, 0.01]], {}), ([[4, 0.05]], {"z": 1.0})])]
    groups = group(rows, ["lr_milestones", "bn_attack_params"])
    assert sorted(len(g) for g in groups.values()) == [1, 1, 1]
    # the attack's parameters are in its words; lr_milestones is named
    assert set(curves_by_label(figure(rows, "curves"))) == {
        "ALIE on the mean and variance, lr_milestones=[[4, 0.05]]",
        "ALIE on the mean and variance, lr_milestones=[[5, 0.01]]",
        "ALIE (z=1.0) on the mean and variance, lr_milestones=[[4, 0.05]]"}


def test_seeds_with_histories_of_different_lengths_do_not_pool(tmp_path):
    rows = [{"norm": "fbn", "seed": s, "status": "done", "history": history(0.5, rounds), "final_acc": 0.5}
            for s, rounds in ((0, (3, 6)), (1, (3, 6)), (2, (3,)))]
    lines = curves_by_label(figure(rows, "curves"))
    assert set(lines) == {f"to round 6 {CI2}", "to round 3 (1 seed, no interval)"}
    assert len(lines[f"to round 6 {CI2}"].get_xdata()) == 2


# ---- import ----------------------------------------------------------------------------------

def export(db, capsys) -> str:
    capsys.readouterr()
    assert main(["results", "--db", str(db), "--format", "csv"]) == 0
    return capsys.readouterr().out


def test_import_round_trip_is_exact(tmp_path, capsys):
    store = two_seed_store(tmp_path / "a.sqlite")
    add_run(store, 0.4, norm="fbn", f=3, bn_var_attack="scale", bn_var_attack_params={"factor": 1e-06}, gamma=0.25,
            agg_f=2, bn_agg="trmean", momentum=0.9, lr=0.05)
    sc = Scenario(**{**BASE, "norm": "naive", "seed": 7}).validated().to_dict()
    store.start(scenario_hash(sc), sc)  # unfinished: no device, no history
    sc = Scenario(**{**BASE, "norm": "hbn", "seed": 8, "fixbn_switch": 3}).validated().to_dict()
    store.start(scenario_hash(sc), sc)
    store.fail(scenario_hash(sc), "boom")
    store.close()
    with sqlite3.connect(tmp_path / "a.sqlite") as a:  # one run recorded from a tuning's file
        a.execute("UPDATE runs SET source = 'tune/m/tune_m.toml' WHERE rowid = 1")
    text = export(tmp_path / "a.sqlite", capsys)
    (tmp_path / "a.csv").write_text(text)
    assert main(["import", str(tmp_path / "a.csv"), "--db", str(tmp_path / "b.sqlite")]) == 0
    assert f"{tmp_path / 'a.csv'}: 17 added, 0 replaced unfinished runs, 0 already here" in capsys.readouterr().out
    assert export(tmp_path / "b.sqlite", capsys) == text
    with sqlite3.connect(tmp_path / "a.sqlite") as a, sqlite3.connect(tmp_path / "b.sqlite") as b:
        query = "SELECT hash, scenario, status, history FROM runs ORDER BY hash"
        assert a.execute(query).fetchall() == b.execute(query).fetchall()  # the stored scenarios, byte for byte
        # where each run was recorded from, as it was (an export's recorded_from column)
        query = "SELECT hash, source FROM runs ORDER BY hash"
        assert a.execute(query).fetchall() == b.execute(query).fetchall()
    # again: every run already there
    assert main(["import", str(tmp_path / "a.csv"), "--db", str(tmp_path / "b.sqlite")]) == 0
    assert "0 added, 0 replaced unfinished runs, 17 already here" in capsys.readouterr().out


def test_import_follows_merge_rules(tmp_path, capsys):
    store = Store(tmp_path / "a.sqlite")
    done = add_run(store, 0.5, norm="fbn")
    sc = Scenario(**{**BASE, "norm": "naive"}).validated().to_dict()
    store.start(scenario_hash(sc), sc)
    store.close()
    (tmp_path / "a.csv").write_text(export(tmp_path / "a.sqlite", capsys))
    target = Store(tmp_path / "b.sqlite")
    target.start(done, Scenario(**{**BASE, "norm": "fbn"}).validated().to_dict())  # unfinished here: replaced
    target.finish(scenario_hash(sc), sc, history(0.9), {}, 2.0, "cpu")  # finished here: kept
    target.close()
    assert main(["import", str(tmp_path / "a.csv"), "--db", str(tmp_path / "b.sqlite")]) == 0
    assert "1 added" not in capsys.readouterr().out
    rows = {r["hash"]: r for r in Store(tmp_path / "b.sqlite").rows()}
    assert rows[done]["status"] == "done" and rows[done]["history"] == history(0.5)
    assert rows[scenario_hash(sc)]["history"] == history(0.9)


def test_docs_results_csv_imports_with_every_hash_matching(tmp_path, capsys):
    with RESULTS_CSV.open(newline="") as fh:
        cells = list(csv.DictReader(fh))
    runs = read_export(RESULTS_CSV)
    assert len(runs) == len(cells) > 100
    for run, row in zip(runs, cells):
        assert run["hash"] == row["hash"] == scenario_hash(json.loads(run["scenario"]))
    assert main(["import", str(RESULTS_CSV), "--db", str(tmp_path / "r.sqlite")]) == 0
    assert f"{len(cells)} added" in capsys.readouterr().out
    rows = Store(tmp_path / "r.sqlite").rows()
    sample = {r["hash"]: r for r in rows}[cells[0]["hash"]]
    assert sample["lr_milestones"] == [[67, 0.05], [133, 0.033]] and isinstance(sample["gamma"], float)
    assert sample["final_acc"] == float(cells[0]["final_acc"]) and sample["wall_time_s"] == float(cells[0]["wall_time_s"])


def bad_csvs(tmp_path):
    """(name, path, what the message says) of CSVs that must not import."""
    lines = RESULTS_CSV.read_text().splitlines(keepends=True)
    header = next(csv.reader([lines[0]]))
    first = dict(zip(header, next(csv.reader([lines[1]]))))
    yield "missing", tmp_path / "missing.csv", "no such file"
    (tmp_path / "store.csv").write_bytes(b"SQLite format 3\x00\xff\xfe\x00" * 10)
    yield "binary", tmp_path / "store.csv", "not a robustbn CSV export"
    (tmp_path / "empty.csv").write_text("")
    yield "empty", tmp_path / "empty.csv", "not a robustbn CSV export (empty file)"
    (tmp_path / "columns.csv").write_text("".join(lines[:3]).replace(",hash,", ",run,", 1))
    yield "columns", tmp_path / "columns.csv", "missing column hash"

    def write(name, *rows):
        with (tmp_path / name).open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=header, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return tmp_path / name
    where = f"row 2 (hash {first['hash']})"
    yield "history", write("history.csv", first, {**first, "history": "[{not json"}), f"{where}: column history: bad JSON"
    yield "number", write("number.csv", first, {**first, "n": "ten"}), f"{where}: column n: expected a number, got 'ten'"
    yield "params", write("params.csv", first, {**first, "bn_agg_params": "{"}), f"{where}: column bn_agg_params: bad JSON"
    yield "hash", write("hash.csv", first, {**first, "gamma": "0.5"}), \
        f"{where}: the scenario read back from its cells hashes to"
    yield "type", write("type.csv", first, {**first, "gamma": "0"}), f"{where}: the scenario read back"  # int, not 0.0


def test_bad_csv_gives_one_line_exit_2_and_leaves_the_store_alone(tmp_path, capsys):
    target = tmp_path / "t.sqlite"
    store = Store(target)
    add_run(store, 0.5, norm="fbn")
    store.close()
    before = sqlite3.connect(target).execute("SELECT * FROM runs").fetchall()
    for name, path, message in bad_csvs(tmp_path):
        capsys.readouterr()
        # a good file first: it is not imported either
        assert main(["import", str(RESULTS_CSV), str(path), "--db", str(target)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"robustbn import: {path}") and message in err and err.count("\n") == 1, (name, err)
        assert sqlite3.connect(target).execute("SELECT * FROM runs").fetchall() == before
        assert main(["import", str(path), "--db", str(tmp_path / "new.sqlite")]) == 2
        assert not (tmp_path / "new.sqlite").exists()  # nothing created either
