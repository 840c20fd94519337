import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

import aggregators
import attacks

h_f = st.tuples(st.integers(1, 12), st.integers(0, 6))
seeds = st.integers(0, 2**31 - 1)


def honest_messages(seed, h, d=5, dtype=torch.float64):
    return torch.randn(h, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def all_attacks():
    pipeline = aggregators.build("nnm+median", f=2)
    return [attacks.build(name, pipeline=pipeline) for name, cls in attacks.ATTACKS.items() if not cls.holds_data]


@pytest.mark.parametrize("attack", all_attacks(), ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shape_device_dtype_and_no_input_mutation(attack, dtype):
    honest = honest_messages(0, 8, dtype=dtype)
    before = honest.clone()
    out = attack(honest, 2)
    assert out.shape == (2, 5) and out.dtype == dtype and out.device == honest.device
    assert torch.equal(honest, before)
    assert attack(honest, 0).shape == (0, 5)


@given(hf=h_f, seed=seeds)
def test_closed_form_attacks(hf, seed):
    h, f = hf
    x = honest_messages(seed, h)
    mean = x.numpy().mean(0)
    for out, want in [
        (attacks.SignFlipping()(x, f), -mean),
        (attacks.Honest()(x, f), mean),
        (attacks.FallOfEmpires()(x, f), -0.1 * mean),
        (attacks.FallOfEmpires(eps=3.0)(x, f), -3.0 * mean),
        (attacks.Scaling(1e-6)(x, f), 1e-6 * mean),
        (attacks.ALittleIsEnough(z=1.5)(x, f), mean - 1.5 * x.numpy().std(0, ddof=1 if h > 1 else 0)),
        (attacks.Mimic(target=h - 1)(x, f), x.numpy()[h - 1]),
    ]:
        assert out.shape == (f, 5)
        np.testing.assert_allclose(out.numpy(), np.broadcast_to(want, (f, 5)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, f", [(10, 3), (25, 5), (50, 10), (50, 24), (7, 1)])
def test_alie_z_is_baruch_et_al(n, f):
    s = math.floor(n / 2 + 1) - f
    assert attacks.alie_z(n, f) == pytest.approx(norm.ppf((n - s) / n), rel=1e-12)


def test_alie_default_z_uses_n_equal_h_plus_f():
    x = honest_messages(1, 7)
    z = attacks.alie_z(10, 3)
    torch.testing.assert_close(attacks.ALittleIsEnough()(x, 3)[0], x.mean(0) - z * x.std(0))


def test_alie_z_undefined_is_a_clear_error():
    with pytest.raises(ValueError, match="undefined for n=10, f=6.*pass z explicitly"):
        attacks.ALittleIsEnough()(honest_messages(0, 4), 6)


def test_hostile_value_attacks():
    x = honest_messages(0, 4)
    assert torch.isnan(attacks.NaNAttack()(x, 3)).all()
    assert (attacks.InfAttack()(x, 3) == float("inf")).all()
    assert (attacks.InfAttack(sign=-1)(x, 3) == -float("inf")).all()


def test_gaussian_is_reproducible_from_seed_and_has_its_moments():
    x = honest_messages(0, 4, d=20000)
    a, b = attacks.Gaussian(sigma=200.0, seed=3)(x, 2), attacks.Gaussian(sigma=200.0, seed=3)(x, 2)
    assert torch.equal(a, b)
    assert not torch.equal(a, attacks.Gaussian(sigma=200.0, seed=4)(x, 2))
    assert abs(a.mean().item()) < 5 and abs(a.std().item() - 200) < 5
    g = torch.Generator().manual_seed(9)
    first = attacks.Gaussian(generator=g)(x, 1)
    assert not torch.equal(first, attacks.Gaussian(generator=g)(x, 1))  # shared generator advances


@given(seed=seeds)
def test_optimal_foe_is_at_least_as_harmful_as_every_grid_factor(seed):
    pipeline = aggregators.build("trmean", f=3)
    x = honest_messages(seed, 7, d=4)
    attack = attacks.OptimalFOE(pipeline, low=0.0, high=10.0, steps=11)
    damage = lambda byz: torch.linalg.vector_norm(pipeline(torch.cat([x, byz])) - x.mean(0))
    best = damage(attack(x, 3))
    for eps in np.linspace(0, 10, 11):
        assert best >= damage(attacks.FallOfEmpires(eps=float(eps))(x, 3)) - 1e-12
    assert 0.0 <= attack.last_factor.item() <= 10.0


@given(seed=seeds)
def test_optimal_alie_is_at_least_as_harmful_as_every_grid_factor(seed):
    pipeline = aggregators.build("nnm+median", f=3)
    x = honest_messages(seed, 7, d=4)
    attack = attacks.OptimalALIE(pipeline, low=0.0, high=4.0, steps=9)
    damage = lambda byz: torch.linalg.vector_norm(pipeline(torch.cat([x, byz])) - x.mean(0))
    best = damage(attack(x, 3))
    for z in np.linspace(0, 4, 9):
        assert best >= damage(attacks.ALittleIsEnough(z=float(z))(x, 3)) - 1e-12


def test_optimal_attack_beats_fixed_one_against_mean():
    # Against a plain mean the damage grows with eps: the search must pick the largest.
    x = honest_messages(0, 7) + 1.0
    attack = attacks.OptimalFOE(aggregators.build("mean"), low=0.0, high=5.0, steps=6)
    attack(x, 3)
    assert attack.last_factor.item() == 5.0


@given(seed=seeds, h=st.integers(2, 9), f=st.integers(1, 4))
def test_the_adaptive_attack_turns_fltrust_against_the_honest_direction(seed, h, f):
    """Cao et al.'s attacker knows the server's reference: its f messages lower the aggregate's
    directed component s . F (s = sign of the honest mean) at least as far as any iterate it
    tried, the honest mean (its start) included, so never above FLTrust on the honest rows alone
    with copies of their mean; and it leaves the honest messages as they were."""
    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(h, 40, generator=g, dtype=torch.float64) + 0.3
    reference = honest.mean(0) + 0.2 * torch.randn(40, generator=g, dtype=torch.float64)
    rule = aggregators.build("fltrust")
    pipeline = lambda x: rule(x, reference=reference)
    before = honest.clone()
    attack = attacks.build("adaptive", pipeline=pipeline)
    byzantine = attack(honest, f)
    s = torch.sign(honest.mean(0))
    start = s @ pipeline(torch.cat([honest, honest.mean(0).expand(f, -1)]))
    assert s @ pipeline(torch.cat([honest, byzantine])) <= start + 1e-9
    assert torch.equal(honest, before) and byzantine.shape == (f, 40)
    assert torch.equal(byzantine[0], byzantine[-1])  # f identical messages


def adaptive_reference(pipeline, honest, f, steps=10, lr=0.2):
    """The adaptive attack as first written: a backward pass at every iterate, the last included."""
    mean = honest.mean(0)
    sign, step = torch.sign(mean), lr * torch.linalg.vector_norm(mean)
    b, best, best_value = mean.clone(), None, None
    for _ in range(steps + 1):
        b.requires_grad_(True)
        value = sign @ pipeline(torch.cat([honest, b.expand(f, -1)]))
        (grad,) = torch.autograd.grad(value, b)
        with torch.no_grad():
            if best_value is None or value < best_value:
                best, best_value = b.clone(), value
            b = b - step * grad / (torch.linalg.vector_norm(grad) if torch.linalg.vector_norm(grad) > 0 else 1.0)
    return best.detach().expand(f, -1)


@settings(max_examples=20)
@given(seed=seeds, h=st.integers(2, 9), f=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.float64]),
       spec=st.sampled_from(["fltrust", "mean", "nnm+trmean"]))
def test_the_adaptive_attack_forges_what_its_first_version_forged_bit_for_bit(seed, h, f, dtype, spec):
    """Skipping the last iterate's backward pass is a saving, not a change: the same messages."""
    g = torch.Generator().manual_seed(seed)
    honest = (torch.randn(h, 30, generator=g) + 0.3).to(dtype)
    reference = honest.mean(0) + (0.2 * torch.randn(30, generator=g)).to(dtype)
    rule = aggregators.build(spec, f=0 if spec == "fltrust" else 1)
    pipeline = (lambda x: rule(x, reference=reference)) if spec == "fltrust" else rule
    assert torch.equal(attacks.build("adaptive", pipeline=pipeline)(honest, f), adaptive_reference(pipeline, honest, f))


def test_the_adaptive_attack_finds_what_a_sign_flip_cannot_against_fltrust():
    """SF's message has a negative cosine with the reference: FLTrust gives it no weight. The
    adaptive attack keeps a positive one and still pulls the step against the honest direction."""
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(7, 200, generator=g, dtype=torch.float64) * 0.5 + 1.0
    reference = honest.mean(0) + 0.1 * torch.randn(200, generator=g, dtype=torch.float64)
    rule = aggregators.build("fltrust")
    pipeline = lambda x: rule(x, reference=reference)
    s = torch.sign(honest.mean(0))
    directed = lambda byz: float(s @ pipeline(torch.cat([honest, byz])))
    sf = directed(attacks.build("sf")(honest, 3))
    assert sf == pytest.approx(float(s @ pipeline(honest)))  # no weight
    assert directed(attacks.build("adaptive", pipeline=pipeline)(honest, 3)) < 0.9 * sf


def test_build_errors_are_clear():
    assert attacks.build("none") is None
    with pytest.raises(ValueError, match="unknown attack 'bogus'; allowed: none, honest, sf, foe, alie"):
        attacks.build("bogus")
    with pytest.raises(ValueError, match="'foe' does not take sigma; allowed: eps"):
        attacks.build("foe", sigma=1.0)
    with pytest.raises(ValueError, match="needs pipeline="):
        attacks.build("opt-foe")
    with pytest.raises(ValueError, match="'sf' does not take eps; allowed: no parameters"):
        attacks.build("sf", eps=1.0)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        attacks.build("sf")(honest_messages(0, 3), -1)
    with pytest.raises(ValueError, match="floating \\(h, d\\) tensor"):
        attacks.build("sf")(torch.ones(3), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attack", all_attacks(), ids=repr)
def test_cuda_output_stays_on_cuda(attack):
    out = attack(honest_messages(0, 8, dtype=torch.float32).cuda(), 2)
    assert out.device.type == "cuda" and out.shape == (2, 5)


def test_packages_do_not_import_robustbn():
    import pathlib
    import re

    root = pathlib.Path(aggregators.__file__).parent.parent
    for package in ("aggregators", "attacks"):
        for path in (root / package).glob("*.py"):
            assert not re.search(r"^\s*(from|import)\s+robustbn", path.read_text(), re.M), path
