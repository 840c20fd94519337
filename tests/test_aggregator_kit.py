"""The public property kit (aggregators.testing) over the whole registry: every registered
rule, built-in or a user's, is held to the properties it declares; a rule that breaks one
is caught, with a counterexample; and `robustbn check-aggregator` reports it with the
documented exit codes."""

import re

import pytest
import torch
from hypothesis import settings

import aggregators
import attacks
from aggregators.testing import PROPERTIES, check
from robustbn.attack_kit import check_attack
from robustbn.cli import main

EXAMPLES = 30
SWEEP_EXAMPLES = 200
# The first rules and the common pipelines run as many examples as the hypothesis profile asks,
# up to SWEEP_EXAMPLES (the sweep checks about 14 properties of 45 specs: at CI's 500 it was a
# fifth of the suite's time; each rule's numpy reference runs the profile's 500 in
# test_aggregators); the catalogue's slower rules (MDA's subsets, host-side clustering) run EXAMPLES.
CATALOGUE = {"mda", "smea", "caf", "bulyan", "dnc", "signguard", "cclust", "fltrust"}
PIPELINES = ["nnm+median", "nnm+trmean", "nnm+krum", "bucketing+cc", "clipping+mean", "arc+trmean", "nnm+geomed",
             "arc+nnm+meamed"]
SPECS = sorted(aggregators.AGGREGATORS) + [f"{p}+mean" for p in sorted(aggregators.PRE_AGGREGATORS)] + PIPELINES
# NNM's rows satisfy exact linear identities, so the neighbours, Krum's scores or meamed's window
# after it can rest on a tie that rounding decides: the order of the rows may then change the
# output, or a shift or scale change it (docs/guide/aggregators.md, the property kit). These comparisons can fail on
# such draws (whether one does depends on the rounding of the machine's BLAS), so they are not run
# there (a failure would be shrunk for tens of seconds and tell nothing); every other property must hold.
TIES = {"permutation invariance", "translation equivariance", "positive-scale equivariance",
        "stacked (vmap) equals one call per set"}
# DnC's Gram matrix is float32: beside a row of about 1e6 its errors (1e5) swamp the honest rows'
# score differences, so which honest rows it keeps is rounding, which differs between the batched
# call and single calls. A known defect, pinned below (test_dnc_keeps_rows_by_rounding_beside_a_huge_row);
# the fix (a float64 Gram) changes stored dnc runs, so it waits for its own change.
NOT_RUN = {"nnm+krum": TIES, "arc+nnm+meamed": TIES, "dnc": {"stacked (vmap) equals one call per set"}}


def failures(outcomes):
    return {o.name: (o.error, o.counterexample) for o in outcomes if o.status == "failed"}


@pytest.mark.parametrize("spec", SPECS)
def test_every_registered_rule_holds_every_property_it_declares(spec):
    examples = EXAMPLES if spec in CATALOGUE else min(SWEEP_EXAMPLES, max(EXAMPLES, settings().max_examples))
    run = [name for name in PROPERTIES if name not in NOT_RUN.get(spec, set())]
    outcomes = check(spec, examples=examples, properties=run)
    assert [o.name for o in outcomes] == run
    assert not failures(outcomes), failures(outcomes)
    held = {o.name for o in outcomes if o.status != "not applicable"}
    pipeline = aggregators.build(spec, f=1)
    # a rule that declares otherwise (cc as published: its first call starts from zeros) is exempt
    identity = {"identity on identical rows"} if all(getattr(step, "identity_on_identical", True)
                                                     for step in [*pipeline.pre, pipeline.agg]) else set()
    assert {"output shape, dtype and device kept", "input never written", "finite under up to f hostile rows",
            *({"one answer per input (no undeclared state)"} if not (pipeline.random or pipeline.stateful) else ()),
            "stacked (vmap) equals one call per set", *identity} - NOT_RUN.get(spec, set()) <= held
    if "+" in spec:
        assert "a spec is its steps in turn" in held
    status = {o.name: o.status for o in outcomes}
    for attribute, name in (("permutation_invariant", "permutation invariance"),
                            ("translation_equivariant", "translation equivariance"),
                            ("scale_equivariant", "positive-scale equivariance")):
        if name not in status:
            continue
        declared = not pipeline.random and all(getattr(s, attribute) for s in pipeline.pre + [pipeline.agg])
        assert (status[name] != "not applicable") == declared, (name, status[name])


def test_declared_robustness_is_checked_where_a_bound_is_claimed():
    status = {spec: {o.name: o.status for o in check(spec, examples=EXAMPLES)}["(f, kappa)-robustness"]
              for spec in ("median", "trmean", "krum", "nnm+median", "mean", "cc")}
    assert status == {"median": "held", "trmean": "held", "krum": "held", "nnm+median": "held",
                      "mean": "not applicable", "cc": "not applicable"}


class FirstMessage(aggregators.Rule):
    """Returns the first message: the rule every property kit must reject."""
    name = "first"

    def apply(self, x):
        return x[0].clone()


class ClaimsTooMuch(aggregators.Rule):
    """The plain mean, claiming to be a robust coordinate-wise rule."""
    name = "claims-too-much"
    coordinatewise = True

    def kappa(self, n, f):
        return 1.0

    def apply(self, x):
        return x.mean(0)


class HiddenState(aggregators.Rule):
    """The mean plus the number of calls so far, undeclared: one input gets two answers."""
    name = "hidden-state"

    def __init__(self, f: int = 0):
        self.calls = 0

    def apply(self, x):
        self.calls += 1
        return x.mean(0) + (self.calls - 1)


class DeclaredState(HiddenState):
    """The same, declared as the docs say, with the base class's `recording` (no own attribute)."""
    name = "declared-state"
    stateful = True

    def apply(self, x):
        out = x.mean(0) + self.calls
        if self.recording:
            self.calls += 1
        return out


class Raises(aggregators.Rule):
    """Raises what a user's bug raises, not a ValueError."""
    name = "raises"

    def __init__(self, f: int = 0):
        pass

    def apply(self, x):
        raise RuntimeError("my bug")


USER_RULES = (HiddenState, DeclaredState, Raises)


def test_a_users_stateful_rule_needs_only_stateful_and_undeclared_state_is_named(capsys):
    for cls in USER_RULES:
        aggregators.register(cls)
    try:
        pipeline = aggregators.build("declared-state")
        rule, x = pipeline.agg, torch.arange(6.0).view(3, 2)
        assert torch.equal(pipeline(x), x.mean(0))
        with aggregators.trials(pipeline):  # a trial call leaves the state as it was
            pipeline(x + 10)
        assert rule.recording and rule.calls == 1 and torch.equal(pipeline(x), x.mean(0) + 1)
        assert main(["check-aggregator", "declared-state", "--examples", "10", "--trials", "1", "--steps", "5"]) == 0
        assert "stateful" in capsys.readouterr().out
        assert main(["check-aggregator", "hidden-state", "--examples", "10", "--trials", "1", "--steps", "5"]) == 1
        out = capsys.readouterr().out
        assert "one answer per input (no undeclared state)  failed" in out and "stateful = True" in out
        assert main(["check-aggregator", "raises", "--examples", "10", "--trials", "1", "--steps", "5"]) == 1
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err and "failed: RuntimeError: my bug" in out.out
    finally:
        for cls in USER_RULES:
            del aggregators.AGGREGATORS[cls.name]


@pytest.fixture
def registered():
    for cls in (FirstMessage, ClaimsTooMuch):
        aggregators.register(cls)
    yield
    for cls in (FirstMessage, ClaimsTooMuch):
        del aggregators.AGGREGATORS[cls.name]


def test_broken_rules_fail_with_a_shrunk_counterexample(registered):
    first = failures(check("first", examples=EXAMPLES))
    assert set(first) == {"permutation invariance"} and "Messages(" in first["permutation invariance"][1]
    liar = failures(check("claims-too-much", f=1, examples=EXAMPLES))
    assert {"honest coordinate range", "(f, kappa)-robustness"} <= set(liar)


def test_check_aggregator_command_exit_codes(registered, capsys):
    assert main(["check-aggregator", "nnm+trmean", "--examples", "10"]) == 0
    out = capsys.readouterr().out
    assert "permutation invariance" in out and "held" in out and "failed" not in out and "stateful" not in out
    # a stateful rule: the report says what the kit measured of it (a first round) and what not
    assert main(["check-aggregator", "cc", "--examples", "10", "--trials", "1", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^translation equivariance +not applicable$", out, re.M)
    assert "stateful" in out and "its behaviour across rounds, which its state decides, is not measured" in out
    assert main(["check-aggregator", "first", "--examples", "10"]) == 1
    out = capsys.readouterr().out
    assert "permutation invariance" in out and "failed" in out and "Messages(" in out
    for bad in (["bogus"], ["median", "--f", "3", "--n", "5"], ["median", "--examples", "0"],
                ["bucketing+mean", "--param", "tau=1"], ["nosuch:Rule"]):
        assert main(["check-aggregator", *bad]) == 2
        assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("name", [n for n, cls in attacks.ATTACKS.items() if not cls.holds_data])
def test_every_registered_attack_keeps_shape_and_never_writes(name):
    assert not failures(check_attack(name, examples=15))


def test_an_attack_that_writes_into_the_honest_messages_is_caught():
    class Writes(attacks.Attack):
        name = "writes"

        def forge(self, honest, f):
            honest.mul_(2)
            return honest[:f].clone()
    attacks.register(Writes)
    try:
        assert set(failures(check_attack("writes", f=1, examples=10))) == {"honest messages never written"}
    finally:
        del attacks.ATTACKS["writes"]


def test_a_chosen_subset_of_properties_runs_and_an_unknown_one_is_named():
    outcomes = check("median", examples=EXAMPLES, properties=["honest coordinate range", "input never written"])
    assert [(o.name, o.status) for o in outcomes] == [("honest coordinate range", "held"),
                                                       ("input never written", "held")]
    with pytest.raises(ValueError, match="unknown property 'symmetry'; allowed: 'output shape"):
        check("median", properties=["symmetry"])


@pytest.mark.xfail(strict=True, reason="known defect: DnC's float32 Gram matrix beside a row of about 1e6 "
                                       "(its fix changes stored dnc runs); strict, so a fix shows here")
def test_dnc_keeps_rows_by_rounding_beside_a_huge_row():
    """Six rows, one at -1e6, f = 2: DnC keeps the 4 rows of smallest score; the honest rows'
    scores differ by about 1e-6 of their size, below float32's Gram resolution. In float64 the
    batched call and single calls agree (-0.0529); in float32 they keep different rows."""
    x = torch.tensor([[-2.5148e-02], [-1.0555e-01], [-5.5926e-02], [-1.1971e-02], [-1.0168e+06], [-2.5046e-02]])
    sets = torch.stack([x, x.flip(0)])
    assert float(aggregators.build("dnc", f=2)(x.double())) == pytest.approx(-0.0529, abs=1e-4)
    stacked = aggregators.build("dnc", f=2).stacked(sets)
    calls = torch.stack([aggregators.build("dnc", f=2)(s) for s in sets])
    torch.testing.assert_close(stacked, calls)
