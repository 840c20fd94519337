import pytest

import robustbn
from robustbn.scenario import Scenario, ScenarioError


@pytest.mark.parametrize("change, field, message", [
    ({"norm": "batchnorm"}, "norm", "allowed: naive, fbn, fixbn, hbn, fedbn, central, gn, none"),
    ({"rounds": -5}, "rounds", "must be an integer >= 1"),
    ({"rounds": 2.5}, "rounds", "must be an integer >= 1"),
    ({"f": 5, "grad_agg": "median"}, "grad_agg", "needs f < n/2"),
    ({"n": 8, "f": 4, "grad_attack": "sf", "grad_agg": "nnm+trmean"}, "grad_agg", "trmean: needs 2f < n, got f=4, n=8"),
    ({"n": 8, "f": 4, "grad_agg": "nnm+trmean"}, "grad_agg", "the server receives n - f = 4 messages"),
    ({"f": 10}, "f", "must be < n = 10"),
    ({"norm": "fedbn", "f": 2, "bn_attack": "sf"}, "bn_attack", "sends no BN statistics; allowed: 'none'"),
    ({"norm": "gn", "f": 2, "bn_attack": "alie"}, "bn_attack", "sends no BN statistics"),
    ({"norm": "none", "f": 2, "bn_attack": "sf"}, "bn_attack", "sends no BN statistics"),
    ({"norm": "central", "f": 2}, "f", "admits f = 0 only"),
    ({"grad_attack": "sf"}, "grad_attack", "needs f >= 1"),
    ({"f": 2, "grad_attack": "bogus"}, "grad_attack", "unknown attack 'bogus'"),
    ({"f": 2, "grad_attack": "foe", "grad_attack_params": {"z": 1}}, "grad_attack_params", "does not take z; allowed: eps"),
    ({"algorithm": "sgd"}, "algorithm", "allowed: dsgd, fedavg"),
    ({"local_steps": 5}, "local_steps", "use algorithm = 'fedavg'"),
    ({"batch_size": 1}, "batch_size", "must be an integer >= 2"),
    ({"lr": 0}, "lr", "must be a number in (0, inf)"),
    ({"momentum": 1.0}, "momentum", "[0, 1)"),
    ({"gamma": 1.5}, "gamma", "[0, 1]"),
    ({"dataset": "imagenet"}, "dataset", "allowed: fashion-mnist, mnist, cifar10, synthetic-images"),
    ({"device": "tpu"}, "device", "allowed: 'cpu', 'cuda', 'cuda:N'"),
    ({"lr_milestones": [[10]]}, "lr_milestones", "[round, lr] pairs"),
    ({"colour": "blue"}, "colour", "unknown field; allowed:"),
])
def test_bad_values_name_the_field_and_what_is_allowed(change, field, message):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict({"dataset": "synthetic-images", **change})
    assert err.value.field == field and message in str(err.value)
    with pytest.raises(ScenarioError):  # the entry point validates too, before loading anything
        robustbn.run({"dataset": "synthetic-images", **change})


def test_lr_schedule_follows_the_milestones():
    sc = Scenario.from_dict({"lr": 0.1, "lr_milestones": [[2000, 0.033], [1000, 0.05]]})
    assert [sc.lr_at(t) for t in (1, 999, 1000, 1999, 2000, 3000)] == [0.1, 0.1, 0.05, 0.05, 0.033, 0.033]


def test_defaults_are_valid_and_round_trip():
    sc = Scenario().validated()
    assert Scenario.from_dict(sc.to_dict()) == sc and sc.switch_round == sc.rounds // 2


def test_shipped_scenario_files_keep_their_run_hashes(clean_search_path):
    """Every scenario of the files in scenarios/ and examples/ and of the demo hashes as it did
    when recorded (tests/data/scenario_file_hashes.json): stores hold hours of those runs. A
    file may grow (new rows of the board): its recorded runs must all still be among its runs.
    A search's confirmation may hold a worse attack a later search found: the attack it held is
    then kept beside it (<stem>_earlier_<k>.toml), whose runs count for it."""
    import json
    import tomllib
    from pathlib import Path

    from robustbn.cli import DEMO_TOML
    from robustbn.evaluate import EARLIER
    from robustbn.matrix import expand, load
    from robustbn.store import scenario_hash

    root = Path(__file__).resolve().parent.parent
    recorded = json.loads((root / "tests/data/scenario_file_hashes.json").read_text())
    assert len(recorded) >= 20 and "demo" in recorded
    for name, hashes in recorded.items():
        scenarios = expand(tomllib.loads(DEMO_TOML), "demo") if name == "demo" else load(root / name)[1]
        # a user's module's runs also record its file's digest (user_code), which an edit changes on purpose;
        # a scenario of built-ins records none
        assert all((s.user_code is None) == (s.current_user_code() is None) for s in scenarios), name
        spelled = lambda scs: [scenario_hash({k: v for k, v in s.to_dict().items() if k != "user_code"}) for s in scs]
        now = spelled(scenarios)
        assert len(set(now)) == len(now), name
        kept = [h for p in sorted((root / name).parent.glob(f"{Path(name).stem}{EARLIER}*.toml"))
                for h in spelled(load(p)[1])] if Path(name).name.startswith("searched_worst_") else []
        assert not set(hashes) - set(now) - set(kept), name


def test_cc_runs_stored_before_keep_their_hash_and_meaning_and_a_new_cc_run_gets_its_own():
    """cc's default changed (the previous aggregate as its center, tau 10). A run stored with
    `cc` and no `center` was the stateless rule from the median: its row keeps its hash (the
    export's check reads it as it is), a scenario file's `cc` now writes center = "previous" and
    hashes apart, and center = "median" builds the old rule again."""
    import aggregators
    from robustbn.store import scenario_dict, scenario_hash

    base = {"dataset": "synthetic-images", "f": 2, "grad_attack": "alie"}
    stored = {**Scenario(**base, grad_agg="cc").canonical().to_dict(), "grad_agg_params": {}}
    assert scenario_dict(stored) == stored
    new = Scenario.from_dict({**base, "grad_agg": "cc"}).to_dict()
    assert new["grad_agg_params"] == {"center": "previous"} and scenario_hash(new) != scenario_hash(stored)
    assert Scenario.from_dict(new).to_dict() == new  # validating again changes nothing
    old = Scenario.from_dict({**base, "grad_agg": "cc", "grad_agg_params": {"center": "median"}}).to_dict()
    rule = aggregators.build(old["grad_agg"], f=2, **old["grad_agg_params"]).agg
    assert (rule.center, rule.tau, rule.iters, rule.stateful) == ("median", 1.0, 3, False)
    # both BN channels through the shorthand, and one BN channel alone: each spelled where it applies
    both = Scenario.from_dict({**base, "bn_agg": "cc"}).to_dict()
    assert both["bn_agg_params"] == {"center": "previous"}
    one = Scenario.from_dict({**base, "bn_mean_agg": "cc", "bn_var_agg": "mean"}).to_dict()
    assert one["bn_mean_agg_params"] == {"center": "previous"} and one["bn_var_agg_params"] == {}
