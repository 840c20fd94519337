"""The measured (f, kappa) (robustbn.kappa, against aggregators.robustness's definition): the
mean and a user's MidRange are unbounded, the rules with a published bound measure within it,
no built-in rule measures below the lower bound f/(n - 2f), a declared bound below the
measurement is a failure, one seed gives one measurement, and check-aggregator's kappa line,
--max-kappa and --table. Small budgets: the search's strength is the default budget's, these
check what it finds and reports."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aggregators
import attacks
from aggregators import robustness
from aggregators.robustness import lower_bound
from robustbn import kappa
from robustbn.kappa import measure_kappa
from robustbn.cli import main

SMALL = dict(trials=1, steps=4, starts=1)


class MidRange(aggregators.Rule):
    """(max + min) / 2 per coordinate: one Byzantine row moves it anywhere."""
    name = "midrange"
    translation_equivariant = scale_equivariant = True

    def apply(self, x):
        return (x.amax(0) + x.amin(0)) / 2


class Underclaims(aggregators.CoordinateWiseMedian):
    """The median, claiming a kappa below its own (4/3 at n = 10, f = 3) yet above the lower bound."""
    name = "underclaims"

    def kappa(self, n, f):
        return 1.0


class ClaimsTooMuch(aggregators.Rule):
    """The mean, claiming to be robust."""
    name = "claims-too-much"

    def kappa(self, n, f):
        return 1.0

    def apply(self, x):
        return x.mean(0)


class GroupMedian(aggregators.Rule):
    """The coordinate-wise median of the means of 3 consecutive groups of rows: robust when the
    Byzantine rows all sit in one group (the last rows: where robustbn stacks them), not when
    they sit in two."""
    name = "group-median"
    permutation_invariant = False

    def apply(self, x):
        return torch.stack([g.mean(0) for g in x.tensor_split(3)]).median(0).values


RULES = (MidRange, Underclaims, ClaimsTooMuch, GroupMedian)


@pytest.fixture
def registered():
    for cls in RULES:
        aggregators.register(cls)
    yield
    for cls in RULES:
        del aggregators.AGGREGATORS[cls.name]


@pytest.mark.parametrize("spec", ["mean", "midrange"])
def test_the_mean_and_midrange_are_unbounded(registered, spec):
    m = measure_kappa(spec, 10, 3, **SMALL)
    assert m.unbounded and m.kappa == math.inf and m.exceeds_declared is False
    # the sweep that shows it grows about a hundredfold per tenfold scale (the ratio ~ t^2)
    assert len(m.growth) == kappa.DECADES + 1
    assert all(b >= 50 * a for a, b in zip(m.growth[-3:], m.growth[-2:]))
    assert "unbounded" in m.summary() and m.attack in m.summary()


@pytest.mark.parametrize("spec", ["median", "trmean", "krum", "geomed", "nnm+median", "nnm+trmean"])
def test_rules_with_a_published_bound_measure_within_it(spec):
    m = measure_kappa(spec, 10, 3, **SMALL)
    assert m.declared is not None and not m.unbounded
    assert lower_bound(10, 3) <= m.kappa <= m.declared and not m.exceeds_declared


def test_median_and_trimmed_mean_reach_their_one_dimensional_sup():
    """At n = 10, f = 3 the median's sup is 4/3 (4 honest values at one point, 3 at another,
    the Byzantine rows beyond) and the trimmed mean's is the lower bound 3/4 itself: the search
    finds both, exactly."""
    assert measure_kappa("median", 10, 3, **SMALL).kappa == pytest.approx(4 / 3, rel=1e-12)
    assert measure_kappa("trmean", 10, 3, **SMALL).kappa == 0.75


@pytest.mark.parametrize("spec", sorted(aggregators.AGGREGATORS))
def test_every_builtin_rule_measures_at_least_the_lower_bound(spec):
    n = 15 if spec == "bulyan" else 10  # bulyan needs n >= 4f + 3
    m = measure_kappa(spec, n, 3, **SMALL)
    assert m.kappa >= lower_bound(n, 3) == 3 / (n - 6)


def test_where_the_byzantine_rows_sit_is_searched_when_the_order_matters(registered):
    m = measure_kappa("group-median", 10, 3, trials=2, steps=4, starts=1)
    assert m.unbounded and m.positions != [7, 8, 9] and 0 not in m.positions
    x = torch.empty(10, 50, dtype=torch.float64)
    x[m.positions] = m.byzantine
    x[[i for i in range(10) if i not in m.positions]] = m.honest
    assert robustness.ratio(aggregators.build("group-median")(x), m.honest) == pytest.approx(m.largest, rel=1e-12)
    assert measure_kappa("median", 10, 3, trials=2, steps=4, starts=1).positions == [7, 8, 9]


def test_the_worst_case_reported_is_real():
    """The reported honest and Byzantine rows give the reported ratio on a fresh pipeline."""
    for spec in ("krum", "nnm+median"):
        m = measure_kappa(spec, 10, 3, **SMALL)
        out = aggregators.build(spec, f=3)(torch.cat([m.honest, m.byzantine]))
        assert robustness.ratio(out, m.honest) == pytest.approx(m.kappa, rel=1e-12)
        assert m.honest.shape == (7, 50) and m.byzantine.shape == (3, 50)


@pytest.mark.parametrize("spec", ["nnm+krum", "dnc", "signguard", "fltrust"])
def test_one_seed_gives_one_measurement(spec):
    a, b = (measure_kappa(spec, 10, 3, seed=5, **SMALL) for _ in range(2))
    assert (a.kappa, a.attack, a.refined, a.distribution, a.per_attack) == \
        (b.kappa, b.attack, b.refined, b.distribution, b.per_attack)
    assert torch.equal(a.honest, b.honest) and torch.equal(a.byzantine, b.byzantine)
    c = measure_kappa(spec, 10, 3, seed=6, **SMALL)
    assert not torch.equal(a.honest, c.honest)  # the seed is used


def test_a_declared_kappa_below_the_measured_one_is_a_failure(registered):
    liar = measure_kappa("underclaims", 10, 3, **SMALL)
    assert not liar.unbounded and liar.kappa > 1.0 and liar.exceeds_declared
    assert measure_kappa("claims-too-much", 10, 3, **SMALL).exceeds_declared


def test_registered_attacks_are_run_and_a_broken_one_is_skipped_with_why():
    class Far(attacks.Attack):
        name = "far"

        def forge(self, honest, f):
            return (honest.mean(0) + 1e3 * honest.std(0)).repeat(f, 1)

    class Broken(attacks.Attack):
        name = "broken"

        def forge(self, honest, f):
            raise RuntimeError("a user's bug")

    for cls in (Far, Broken):
        attacks.register(cls)
    try:
        m = measure_kappa("mean", 10, 3, **SMALL)
    finally:
        del attacks.ATTACKS["far"], attacks.ATTACKS["broken"]
    assert m.per_attack["far"] > 1e5 and m.skipped == {"broken": "RuntimeError: a user's bug"}
    assert {"alie", "minmax", "fang", "opt-foe", "mimic"} <= set(m.per_attack) and "labelflip" not in m.per_attack


def test_measure_kappa_refuses_bad_sizes_and_budgets():
    for kwargs, word in ((dict(n=6, f=3), "n > 2f"), (dict(n=10, f=3, trials=0), "trials"),
                         (dict(n=10, f=3, d=0), "d"), (dict(n=5, f=2, spec="krum"), "krum")):
        spec = kwargs.pop("spec", "median")
        with pytest.raises(ValueError, match=word):
            measure_kappa(spec, **kwargs)


@settings(max_examples=30, deadline=None)
@given(h=st.integers(1, 8), f=st.integers(1, 4), d=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_the_ratio_of_the_mean_is_its_closed_form(h, f, d, seed):
    """||mean(x) - mean_H||^2 = (f/n)^2 ||mean_B - mean_H||^2, over the honest spread."""
    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(h, d, generator=g, dtype=torch.float64)
    byz = torch.randn(f, d, generator=g, dtype=torch.float64)
    spread = ((honest - honest.mean(0)) ** 2).sum(1).mean()
    expected = (f / (h + f)) ** 2 * ((byz.mean(0) - honest.mean(0)) ** 2).sum() / spread if spread > 0 else math.inf
    got = robustness.ratio(torch.cat([honest, byz]).mean(0), honest)
    assert got == pytest.approx(float(expected), rel=1e-9)


FAST = ["--examples", "5", "--trials", "1", "--steps", "4"]


def test_check_aggregator_prints_the_kappa_line_and_max_kappa_sets_the_exit(registered, capsys):
    assert main(["check-aggregator", "median", "--f", "3", "--n", "10", *FAST]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("measured (f, kappa)")]
    assert len(line) == 1 and "kappa 1.333" in line[0] and "declared 12.25" in line[0] and "0.75" in line[0]
    assert main(["check-aggregator", "median", *FAST, "--max-kappa", "2"]) == 0
    capsys.readouterr()
    assert main(["check-aggregator", "median", *FAST, "--max-kappa", "1.3"]) == 1
    assert "above --max-kappa 1.3" in capsys.readouterr().out
    assert main(["check-aggregator", "midrange", *FAST]) == 0  # declares nothing, claims nothing: no failure
    assert "unbounded" in capsys.readouterr().out
    assert main(["check-aggregator", "midrange", *FAST, "--max-kappa", "1e300"]) == 1
    capsys.readouterr()
    assert main(["check-aggregator", "underclaims", *FAST]) == 1
    out = capsys.readouterr().out
    assert "the claim is false" in out and "Byzantine rows" in out
    for bad in (["median", "--max-kappa", "-1"], ["median", "--max-kappa", "nan"], ["median", "--d", "0"],
                ["median", "--trials", "0"], ["median", "--param", "seed=1"], [], ["median", "--table"],
                ["--table", "--n", "6", "--f", "3"]):
        assert main(["check-aggregator", *bad]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_check_aggregator_table(monkeypatch, capsys):
    monkeypatch.setattr(aggregators.pipeline, "AGGREGATORS", {"median": aggregators.CoordinateWiseMedian,
                                                              "mean": aggregators.Mean})
    monkeypatch.setattr(kappa, "PIPELINES", ("nnm+median", "bucketing+median"))
    assert main(["check-aggregator", "--table", "--trials", "1", "--steps", "2"]) == 0
    rows = {r.split("|")[1].strip(): r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")}
    assert set(rows) == {"rule", "median", "mean", "nnm+median", "bucketing+median"}
    assert "| 1.33 |" in rows["median"] and "| 12.2 |" in rows["median"] and "| 1.78 |" in rows["median"]
    assert "| unbounded |" in rows["mean"]
    assert "not measured: median: needs f < n/2" in rows["bucketing+median"]
