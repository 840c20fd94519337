"""robustbn.stats against scipy, and the views that use it (`results --pooled`, `results
--compare`, the worst case's intervals and verdicts) on hand-made stores: no training."""

import csv
import io
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from scipy.stats import sem, ttest_rel
from scipy.stats import t as t_dist

from robustbn.cli import main
from robustbn.stats import ACCURACY, FLOAT_NOISE, bands, distinct, interval, paired
from robustbn.store import RESULT_COLUMNS, Store
from robustbn.worst import worst_case
from test_worst_case import add, add_raw

NAN = float("nan")
ACC = hs.floats(0.0, 1.0, allow_nan=False)


def scipy_interval(values):
    values = np.asarray(values, dtype=float)
    return t_dist.interval(0.95, len(values) - 1, loc=values.mean(), scale=sem(values))


# ---- the formulas ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(hs.lists(ACC, min_size=2, max_size=9).filter(lambda v: np.std(v) > 1e-6))
def test_interval_is_scipy_student_t_over_seeds_clipped_for_accuracies(values):
    e = interval(values)
    low, high = scipy_interval(values)
    assert (e.n, e.mean, e.std) == (len(values), pytest.approx(np.mean(values)), pytest.approx(np.std(values, ddof=1)))
    assert (e.low, e.high) == pytest.approx((low, high))
    clipped = interval(values, ACCURACY)
    assert (clipped.low, clipped.high) == pytest.approx((max(low, 0.0), min(high, 1.0)))
    assert 0.0 <= clipped.low <= clipped.mean <= clipped.high <= 1.0


def test_one_seed_has_no_interval_and_says_so():
    e = interval([0.7], ACCURACY)
    assert (e.n, e.mean, e.low, e.high, e.std) == (1, 0.7, None, None, 0.0)
    assert not e.has_interval and e.text() == "1 seed, no interval"
    assert interval([]).text() == "" and interval([]).mean is None
    assert interval([0.2, 0.4]).text(scale=100, digits=1) == "[{:.1f}, {:.1f}]".format(*(100 * v for v in scipy_interval([0.2, 0.4])))
    # no spread: the interval is the mean itself (scipy gives NaN for a zero scale)
    assert (interval([0.5, 0.5]).low, interval([0.5, 0.5]).high) == (0.5, 0.5)


@settings(max_examples=60, deadline=None)
@given(hs.dictionaries(hs.integers(0, 9), hs.tuples(ACC, ACC, hs.booleans()), min_size=2))
def test_paired_difference_is_scipy_ttest_rel_over_the_shared_seeds(draw):
    a = {s: x for s, (x, _, _) in draw.items()}
    b = {s: y for s, (_, y, both) in draw.items() if both or s == min(draw)}  # some seeds ran for A only
    shared = sorted(set(a) & set(b))
    d = paired(a, b)
    assert d.n == len(shared)
    diffs = [b[s] - a[s] for s in shared]
    assert d.mean == pytest.approx(np.mean(diffs), abs=1e-12)
    if len(shared) < 2:
        assert not d.has_interval and not distinct(d)
    elif np.std(diffs) > 1e-6:
        ci = ttest_rel([b[s] for s in shared], [a[s] for s in shared]).confidence_interval(0.95)
        assert (d.low, d.high) == pytest.approx((ci.low, ci.high))
        assert distinct(d) == (ci.low > FLOAT_NOISE or ci.high < -FLOAT_NOISE)


def test_float32_chance_against_a_diverged_run_at_chance_is_no_difference():
    """An evaluated model at chance stores float32(0.1) = 0.10000000149; a diverged run counts at
    0.1 exactly. Paired over 5 seeds the difference is the same on every seed, so its interval
    has no width and, without the noise band, would exclude 0: "lower by 0.0 [0.0, 0.0]"."""
    import torch

    evaluated = {s: float(torch.tensor(0.1, dtype=torch.float32)) for s in range(5)}
    diverged = {s: 0.1 for s in range(5)}
    d = paired(evaluated, diverged)
    assert d.has_interval and d.high < 0  # the artifact: a zero-width interval just below 0
    assert not distinct(d)
    # one test example in 10,000 on every seed is a difference, however small
    assert distinct(paired(diverged, {s: 0.1001 for s in range(5)}))


def test_bands_are_the_interval_at_every_point():
    curves = np.array([[0.1, 0.5, 0.9], [0.2, 0.4, 1.0], [0.3, 0.45, 0.97]])
    mean, low, high = bands(curves)
    for j in range(3):
        e = interval(curves[:, j], ACCURACY)
        assert (mean[j], low[j], high[j]) == pytest.approx((e.mean, e.low, e.high))
    assert high[2] == 1.0  # clipped
    one = bands(curves[:1])
    assert list(one[1]) == list(one[2]) == list(curves[0])


# ---- the worst case: intervals, the per-seed worst case, verdicts --------------------------------

def test_worst_case_intervals_one_seed_and_a_diverged_run(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    for seed, acc in enumerate((0.40, 0.55, 0.46)):
        add(store, acc, norm="fbn", f=3, seed=seed, bn_attack="sf")
    for seed, acc in enumerate((0.80, NAN)):  # the diverged run counts at chance, 1 / 10 classes
        add(store, acc, norm="fbn", f=3, seed=seed, bn_attack="sf", bn_agg="median")
    add(store, 0.6, norm="naive", f=3, seed=0, bn_attack="sf")  # one seed
    table = {(t["norm"], t["defense"]): t for t in worst_case(store.rows())}
    store.close()
    t = table["fbn", "mean"]
    assert (t["seeds"], t["worst_acc"]) == (3, pytest.approx(0.47))
    assert (t["ci_low"], t["ci_high"]) == pytest.approx(scipy_interval([0.40, 0.55, 0.46]))
    t = table["fbn", "mean on the gradients, median on the mean and variance"]
    assert (t["worst_acc"], t["diverged"], t["seeds"]) == (pytest.approx(0.45), 1, 2)
    assert t["ci_low"] == 0.0 and t["ci_high"] == 1.0 and scipy_interval([0.8, 0.1])[0] < 0
    t = table["naive", "mean"]
    assert (t["seeds"], t["ci_low"], t["ci_high"], t["worst_std"], t["verdict"]) == (1, None, None, 0.0, None)
    assert main(["results", "--db", str(tmp_path / "s.sqlite"), "--worst-case", "--where", "norm=naive"]) == 0


def test_the_per_seed_worst_case_is_the_seed_under_the_pooled_worst_attack(tmp_path, capsys):
    """Defense X's worst attack (on the seed-pooled mean) is ALIE: 0.30, 0.50, 0.40 (mean 0.40);
    SF is lower on seed 1 (0.35) but higher on average (0.4167). Y's only attack: 0.33, 0.52,
    0.43 (0.4267), the best. Paired: Y - X under each one's worst attack, 0.03, 0.02, 0.03, not
    the per-seed minimum (0.03, 0.17, 0.03)."""
    store = Store(tmp_path / "s.sqlite")
    x = dict(norm="fbn", f=3, bn_agg="median")
    for seed, (alie, sf, y) in enumerate(((0.30, 0.45, 0.33), (0.50, 0.35, 0.52), (0.40, 0.45, 0.43))):
        add(store, alie, **x, seed=seed, grad_attack="alie")
        add(store, sf, **x, seed=seed, bn_attack="sf")
        add(store, y, norm="fbn", f=3, bn_agg="nnm+median", seed=seed, bn_attack="sf")
        add(store, 0.9, norm="naive", f=3, bn_agg="median", seed=seed, bn_attack="sf")  # another protocol: no rival
    (naive,), (tx, ty) = [[t for t in worst_case(store.rows()) if t["norm"] == n] for n in ("naive", "fbn")]
    store.close()
    assert tx["worst_attack"] == "ALIE on the gradients" and tx["worst_acc"] == pytest.approx(0.40)
    ci = ttest_rel([0.33, 0.52, 0.43], [0.30, 0.50, 0.40]).confidence_interval(0.95)
    assert (tx["gap"], tx["gap_low"], tx["gap_high"], tx["gap_pairs"]) == \
        (pytest.approx(0.08 / 3), pytest.approx(ci.low), pytest.approx(ci.high), 3)
    assert ci.low > 0 and (tx["verdict"], ty["verdict"]) == ("worse", "best")
    assert naive["verdict"] is None and naive["gap"] is None  # alone in its protocol
    assert main(["results", "--db", str(tmp_path / "s.sqlite"), "--worst-case", "--format", "csv"]) == 0
    records = {r["defense"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out)) if r["norm"] == "fbn"}
    assert records["mean on the gradients, median on the mean and variance"]["verdict"] == "worse"
    assert float(records["mean on the gradients, median on the mean and variance"]["gap_low"]) == pytest.approx(ci.low)


# ---- results --compare -------------------------------------------------------------------------

# final accuracy per (norm, bn_agg) for seeds 0, 1, 2
COMPARE = {("naive", "mean"): (0.30, 0.42, 0.35), ("naive", "nnm+median"): (0.55, 0.61, 0.52),
           ("fbn", "mean"): (0.70, 0.66, 0.73), ("fbn", "nnm+median"): (0.71, 0.64, NAN)}


@pytest.fixture
def compare_db(tmp_path):
    store = Store(tmp_path / "c.sqlite")
    for (norm, agg), accs in COMPARE.items():
        for seed, acc in enumerate(accs):
            add(store, acc, norm=norm, f=3, bn_attack="sf", bn_agg=agg, seed=seed)
    add(store, 0.9, norm="naive", f=3, bn_attack="sf", bn_agg="mean", seed=7)  # seed 7: A only, no partner
    add(store, 0.3, norm="fbn", f=3, bn_attack="foe", bn_agg="nnm+median", seed=0)  # FOE: B only, no partner
    # seed 0 of naive's mean again on another device: averaged into seed 0 first (0.30 and 0.40: 0.35)
    store_row = next(r for r in store.rows() if r["norm"] == "naive" and r["bn_agg"] == "mean" and r["seed"] == 0)
    sc = {k: store_row[k] for k in store_row if k not in RESULT_COLUMNS + ("history", "error")}
    add_raw(store, 0.40, {**sc, "device": "cuda:1"})
    store.close()
    return str(tmp_path / "c.sqlite")


def expected(norm):
    a = list(COMPARE[norm, "mean"])
    b = [0.1 if math.isnan(v) else v for v in COMPARE[norm, "nnm+median"]]  # the diverged run counts at chance
    if norm == "naive":
        a[0] = 0.35
    ci = ttest_rel(b, a).confidence_interval(0.95)
    diffs = np.subtract(b, a)
    assert (ci.low, ci.high) == pytest.approx(t_dist.interval(0.95, 2, loc=diffs.mean(), scale=sem(diffs)))
    return np.mean(a), np.mean(b), diffs.mean(), ci


def test_compare_pairs_by_seed_and_matches_scipy(compare_db, capsys):
    assert main(["results", "--db", compare_db, "--compare", "bn_agg=mean", "bn_agg=nnm+median",
                 "--format", "json"]) == 0
    rows = {r["norm"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"naive", "fbn"}  # FOE has no run of A: no setting
    for norm, r in rows.items():
        a_acc, b_acc, diff, ci = expected(norm)
        assert (r["field"], r["a"], r["b"], r["pairs"]) == ("bn_agg", "mean", "nnm+median", 3)
        assert (r["a_acc"], r["b_acc"], r["diff"]) == pytest.approx((a_acc, b_acc, diff))
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((ci.low, ci.high))
        assert r["verdict"] == ("B higher" if ci.low > 0 else "tied")
    assert rows["naive"]["verdict"] == "B higher" and rows["fbn"]["verdict"] == "tied"

    assert main(["results", "--db", compare_db, "--compare", "bn_agg=mean", "bn_agg=nnm+median"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("paired by seed: B - A, A = bn_agg=mean (8 runs), B = bn_agg=nnm+median (7 runs)")
    naive = next(line for line in lines if line.startswith("naive"))
    _, _, diff, ci = expected("naive")
    assert f"{diff:.4f}" in naive and f"[{ci.low:.4f}, {ci.high:.4f}]" in naive and "B higher" in naive
    assert "2 runs had no partner (left out)" in out  # seed 7 of A, FOE of B

    # reversed: A - B, the same pairs
    assert main(["results", "--db", compare_db, "--compare", "bn_agg=nnm+median", "bn_agg=mean",
                 "--where", "norm=naive", "--format", "csv"]) == 0
    (record,) = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert float(record["diff"]) == pytest.approx(-expected("naive")[2]) and record["verdict"] == "A higher"
    assert record["pairs"] == "3" and float(record["ci_high"]) == pytest.approx(-expected("naive")[3].low)


def test_compare_with_one_pair_has_no_interval_and_no_verdict(compare_db, capsys):
    assert main(["results", "--db", compare_db, "--compare", "bn_agg=mean", "bn_agg=nnm+median",
                 "--where", "seed=1", "--where", "norm=naive"]) == 0
    out = capsys.readouterr().out
    assert "1 pair, no interval" in out and "1 pair, no verdict" in out and " tied" not in out.splitlines()[2]
    # the worst-case view says the same of one seed: no verdict, where it once said "tied for best"
    assert main(["results", "--db", compare_db, "--worst-case", "--where", "seed=1", "--where", "norm=naive",
                 "--format", "json"]) == 0
    verdicts = {t["verdict"] for t in json.loads(capsys.readouterr().out)}
    assert verdicts == {"1 seed, no verdict"}, verdicts


@pytest.mark.parametrize("argv, words", [
    (["--compare", "bn_agg=mean"], "--compare: expected 2 arguments"),
    (["--compare", "bogus=1", "bogus=2"], "bogus: not a scenario field"),
    (["--compare", "bn_agg=mean", "bn_agg=mean"], "the same value twice"),
    (["--compare", "f=3", "f=3.0"], "the same value twice"),
    (["--compare", "norm=fbn", "norm=gn"], "norm=gn: no finished run matches; norm takes fbn, naive"),
    (["--compare", "f=3", "f=0"], "f=0: no finished run matches; f takes 3"),  # f does not vary
    (["--compare", "norm=fbn", "f=3"], "two values of one field, not norm and f"),
    (["--compare", "norm=[fbn,naive]", "norm=gn"], "one value on each side"),
    (["--compare", "seed=0", "seed=1"], "paired by seed"),
    (["--compare", "norm=fbn", "norm=naive", "--worst-case"], "one view at a time"),
    (["--compare", "norm=fbn", "norm=naive", "--status", "running"], "finished runs only"),
    (["--compare", "norm", "norm=fbn"], "--compare 'norm': expected key=value"),
])
def test_bad_compare_is_one_line_exit_2(compare_db, capsys, argv, words):
    assert main(["results", "--db", compare_db, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and words in captured.err
    assert "Traceback" not in captured.err


# ---- results --pooled ----------------------------------------------------------------------------

def test_pooled_cells_and_the_per_run_export_unchanged(compare_db, capsys):
    assert main(["results", "--db", compare_db, "--pooled", "--format", "json"]) == 0
    cells = {(c["norm"], c["bn_agg"], c["bn_attack"]): c for c in json.loads(capsys.readouterr().out)}
    c = cells["fbn", "nnm+median", "sf"]
    assert (c["seeds"], c["runs"], c["diverged"]) == (3, 3, 1)
    assert c["mean_acc"] == pytest.approx((0.71 + 0.64 + 0.1) / 3)
    assert (c["ci_low"], c["ci_high"]) == (0.0, 1.0) and scipy_interval([0.71, 0.64, 0.1])[1] > 1  # clipped
    c = cells["naive", "mean", "sf"]  # seeds 0 (two runs: 0.35), 1, 2, 7
    assert (c["seeds"], c["runs"]) == (4, 5)
    assert (c["ci_low"], c["ci_high"]) == pytest.approx(scipy_interval([0.35, 0.42, 0.35, 0.9]))
    c = cells["fbn", "nnm+median", "foe"]
    assert (c["seeds"], c["ci_low"], c["ci_high"]) == (1, None, None)
    assert not any("seed" in c for c in cells.values())

    assert main(["results", "--db", compare_db, "--pooled"]) == 0
    out = capsys.readouterr().out
    foe = next(line for line in out.splitlines() if " foe " in line)
    assert "1 seed, no interval" in foe and "95% CI: Student t over seeds, clipped to [0, 1]" in out
    assert "5 cells from 15 finished runs" in out

    assert main(["results", "--db", compare_db, "--pooled", "--format", "csv"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert header[-7:] == ["seeds", "runs", "mean_acc", "ci_low", "ci_high", "std", "diverged"]
    # the per-run export (read back by `robustbn import`) keeps its columns
    assert main(["results", "--db", compare_db, "--format", "csv"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert header[-len(RESULT_COLUMNS) - 2:] == [*RESULT_COLUMNS, "recorded_from", "history"]
    assert "ci_low" not in header
    assert "seed" in header


def test_too_few_pairs_for_a_verdict():
    from robustbn.stats import MIN_PAIRS, too_few

    assert MIN_PAIRS == 5
    assert [too_few(n) for n in (None, 0, 1, 4, 5, 9)] == [None, "0 seeds, no verdict", "1 seed, no verdict",
                                                           "4 seeds, no verdict", None, None]


def test_an_interval_that_rounds_to_zero_reads_without_a_minus_sign():
    """ci_text: float32 means give ends of -1e-9; "[-0.0, -0.0]" would read as an interval that
    excludes its own estimate of +0.0. A negative end that does not round to zero keeps its sign."""
    from robustbn.stats import ci_text

    assert ci_text(-1e-9, -2e-9, 2, scale=100, digits=1, unit="pair") == "[0.0, 0.0]"
    assert ci_text(-0.0004, 0.0004, 5, scale=100, digits=1) == "[0.0, 0.0]"
    assert ci_text(-0.012, 0.5, 3, scale=100, digits=1) == "[-1.2, 50.0]"
    assert ci_text(-0.00004, 0.1, 3) == "[0.0000, 0.1000]"
