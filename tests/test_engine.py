"""The federated engine: fast path = reference loop, FBN exactness end to end, protocol
plumbing (what travels, what stays on the client), hostile messages, and a short real run."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import functional_call, vmap

import robustbn
from robustbn.data import load_dataset, partition
from robustbn.engine import Federation, _flat
from robustbn.models import MaxPool2d
from robustbn.norm import collect_batch_stats, set_phase
from robustbn.protocols import get, names
from robustbn.scenario import Scenario

MODES, NO_BN_MODES = names(), names(uses_bn=False)


@functools.lru_cache(maxsize=1)
def synthetic():
    return load_dataset("synthetic-images")


def federation(vectorized=True, client_chunk=None, **overrides):
    values = dict(dataset="synthetic-images", model="simple-cnn", norm="fbn", n=4, f=1, rounds=6, batch_size=8,
                  lr=0.05, momentum=0.5, weight_decay=1e-3, partition="gamma", gamma=0.0, grad_attack="alie",
                  bn_attack="sf", grad_agg="nnm+trmean", bn_agg="nnm+median", seed=3)
    values.update(overrides)
    protocol = get(values["norm"])
    if protocol.union_batch:  # the attack-free reference
        values.update(f=0, grad_attack="none", bn_attack="none")
    if not protocol.sends_statistics:
        values.update(bn_attack="none")
    if values.get("algorithm") == "fedavg":
        values.setdefault("local_steps", 2)
    sc = Scenario.from_dict(values)
    data = synthetic() if sc.device == "cpu" else load_dataset("synthetic-images", device=sc.device)
    parts = partition(data.y_train.cpu().numpy(), sc.honest, sc.partition, sc.gamma, sc.alpha, sc.seed)
    return Federation(sc, data, parts, vectorized=vectorized, client_chunk=client_chunk)


@pytest.mark.parametrize("algorithm", ["dsgd", "fedavg"])
@pytest.mark.parametrize("norm", ["fbn", "hbn"])
def test_chunked_client_axis_changes_nothing(norm, algorithm):
    whole, chunked = (federation(True, chunk, norm=norm, algorithm=algorithm, n=8, f=1) for chunk in (None, 3))
    assert_same_runs(whole, chunked, rounds=3, tol=1e-5)


def test_default_path_is_the_loop_on_the_cpu():
    sc = Scenario.from_dict(dict(dataset="synthetic-images", n=3))
    parts = partition(synthetic().y_train.numpy(), sc.honest, sc.partition, sc.gamma, sc.alpha, sc.seed)
    assert Federation(sc, synthetic(), parts).vectorized is False


def state(fed):
    out = {f"theta.{k}": v for k, v in fed.theta.items()}
    out.update({f"local.{k}": v for k, v in fed.local.items()})
    out["shared_mean"], out["shared_var"] = fed.shared_mean, fed.shared_var
    if fed.protocol.local_statistics:
        out["local_mean"], out["local_var"] = fed.local_mean, fed.local_var
    return out


def assert_same_runs(a, b, rounds, tol):
    """Step two federations side by side, then compare their whole state."""
    for _ in range(rounds):
        a.step()
        b.step()
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("algorithm", ["dsgd", "fedavg"])
@pytest.mark.parametrize("norm", MODES)
def test_vectorized_engine_equals_reference_loop(norm, algorithm):
    extra = {"participation": 0.67} if algorithm == "fedavg" else {}
    fast, slow = (federation(v, norm=norm, algorithm=algorithm, fixbn_switch=2, **extra) for v in (True, False))
    assert_same_runs(fast, slow, rounds=4, tol=1e-5)
    torch.testing.assert_close(fast.evaluate()[0], slow.evaluate()[0])


@pytest.mark.parametrize("norm", ["naive", "fbn", "hbn", "fedbn", "gn", "none"])
def test_per_client_gradients_and_statistics_match_the_loop(norm):
    fast, slow = federation(True, norm=norm), federation(False, norm=norm)
    x, y = fast._sample()
    fast.set_phase("train")
    slow.set_phase("train")
    buffers = fast._buffers(fast.shared_mean, fast.shared_var) if norm != "fedbn" else fast._buffers(fast.local_mean, fast.local_var)
    args = (fast.theta, fast.local, buffers, x, y)
    (ga, la), aux_a = fast._client_grads(*args, theta_batched=False, buffers_batched=norm == "fedbn")
    (gb, lb), aux_b = slow._client_grads(*args, theta_batched=False, buffers_batched=norm == "fedbn")
    torch.testing.assert_close(_flat(ga, 1), _flat(gb, 1), rtol=1e-5, atol=1e-5)
    assert len(aux_a) == len(aux_b) == (1 if norm in NO_BN_MODES else 3)
    for u, v in zip(aux_a, aux_b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
    assert _flat(ga, 1).shape[0] == fast.h and not torch.allclose(_flat(ga, 1)[0], _flat(ga, 1)[1])


def test_fbn_shared_statistics_equal_centralized_bn_on_the_union_batch():
    """Appendix A, end to end: each round the server's statistics equal the running update of
    centralized BN fed with the union of the clients' per-layer inputs."""
    fed = federation(norm="fbn", f=0, grad_attack="none", bn_attack="none", grad_agg="mean", bn_agg="mean", n=5)
    beta = fed.sc.bn_momentum
    for _ in range(4):
        state_before = fed.gen.get_state()
        x, _ = fed._sample()
        fed.gen.set_state(state_before)
        set_phase(fed.model, "train")
        with torch.no_grad():
            functional_call(fed.model, {**fed.theta, **fed._buffers(fed.shared_mean, fed.shared_var)},
                            (x.reshape(-1, *x.shape[2:]),))
        union_mean, union_var = collect_batch_stats(fed.layers)
        kn = fed.count * fed.sc.n
        want_mean = (1 - beta) * fed.shared_mean + beta * union_mean
        want_var = (1 - beta) * fed.shared_var + beta * kn / (kn - 1) * union_var
        fed.step()
        torch.testing.assert_close(fed.shared_mean, want_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fed.shared_var, want_var, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["dsgd", "fedavg"])
def test_hbn_server_pools_statistics_measured_under_the_received_weights(algorithm):
    """Seed 003: each client measures its data's statistics under the weights it received
    (forward only, its own alpha, the global statistics), before any local update; the server
    pools them with N/(N-1) and takes an EMA with lambda. The measurement is the round's first
    forward pass, so it sees the round's first mini-batch."""
    fed = federation(norm="hbn", algorithm=algorithm, f=0, grad_attack="none", bn_attack="none", grad_agg="mean",
                     bn_agg="mean", n=4, hbn_lambda=0.3)
    for _ in range(3):
        state_before = fed.gen.get_state()
        x, _ = fed._sample()
        fed.gen.set_state(state_before)
        set_phase(fed.model, "train")
        buffers = fed._buffers(fed.shared_mean, fed.shared_var)
        with torch.no_grad():
            measured = []
            for i in range(fed.h):
                functional_call(fed.model, {**fed.theta, **{k: v[i] for k, v in fed.local.items()}, **buffers}, (x[i],))
                measured.append(collect_batch_stats(fed.layers))
        means, variances = (torch.stack(m) for m in zip(*measured))
        total = fed.count * fed.h
        pooled_mean = means.mean(0)
        pooled_var = total / (total - 1) * (variances.mean(0) + ((means - pooled_mean) ** 2).mean(0))
        want_mean = 0.7 * fed.shared_mean + 0.3 * pooled_mean
        want_var = 0.7 * fed.shared_var + 0.3 * pooled_var
        fed.step()
        torch.testing.assert_close(fed.shared_mean, want_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fed.shared_var, want_var, rtol=1e-4, atol=1e-5)


def record_messages(fed):
    seen = {"grad": [], "bn": []}
    for name, channel in (("grad", fed.grad_channel), ("bn", fed.mean_channel), ("bn", fed.var_channel)):
        original = channel.messages
        def spy(honest, *own, original=original, name=name):
            seen[name].append(honest.shape)
            return original(honest, *own)
        channel.messages = spy
    return seen


def test_fixbn_switches_at_t_star():
    fed = federation(norm="fixbn", fixbn_switch=3)
    seen = record_messages(fed)
    snapshots = []
    for t in range(1, 7):
        fed.step()
        snapshots.append(fed.shared_var.clone())
        assert {l.phase for l in fed.layers} == {"frozen" if t > 3 else "train"}
    assert not torch.equal(snapshots[1], snapshots[2])  # statistics still move up to T*
    assert all(torch.equal(snapshots[2], s) for s in snapshots[3:])  # then the server accepts none
    assert len(seen["bn"]) == 2 * 3  # two BN channels, rounds 1..T* only


def test_hbn_mixing_factor_stays_on_the_client():
    fed = federation(norm="hbn", gamma=0.0)
    seen = record_messages(fed)
    alpha0 = {k: v.clone() for k, v in fed.local.items()}
    for _ in range(5):
        fed.step()
    assert alpha0 and all(k.endswith(".alpha") for k in fed.local) and not any(k.endswith(".alpha") for k in fed.theta)
    assert seen["grad"][0][1] == sum(v.numel() for v in fed.theta.values())
    for k, v in fed.local.items():
        assert v.shape[0] == fed.h and not torch.equal(v, alpha0[k])  # trained locally...
        assert not torch.allclose(v[0], v[1])  # ...by each client on its own data


def test_fedbn_bn_tensors_never_enter_a_message():
    fed = federation(norm="fedbn")
    seen = record_messages(fed)
    for _ in range(3):
        fed.step()
    bn_names = {f"{l}.{p}" for l in fed.layer_names for p in ("weight", "bias")}
    assert set(fed.local) == bn_names and not bn_names & set(fed.theta)
    assert seen["bn"] == [] and seen["grad"][0][1] == sum(v.numel() for v in fed.theta.values())
    assert torch.equal(fed.shared_mean, torch.zeros_like(fed.shared_mean))
    assert not torch.allclose(fed.local_mean[0], fed.local_mean[1])  # statistics stay per client


@pytest.mark.parametrize("norm", [n for n in names(sends_statistics=True) if not get(n).union_batch])
@pytest.mark.parametrize("bn_attack, params", [("nan", {}), ("inf", {}), ("scale", {"factor": 1e38}),
                                               ("scale", {"factor": -1.0})])
def test_hostile_statistics_never_make_the_model_nan(norm, bn_attack, params):
    """NaN, inf, 1e38 and negative variances on both BN channels, against an undefended mean
    and against nnm+median: weights, momenta, client-local state and shared statistics stay
    finite (variances >= 0) with every protocol that sends statistics; defended, the loss too.
    (Undefended, 1e38 statistics are finite, accepted, and overflow the model's outputs: the
    test loss may then be inf or NaN, an honest measurement of a destroyed model.)"""
    for agg in ("mean", "nnm+median"):
        fed = federation(norm=norm, n=7, f=2, grad_attack="none", bn_attack=bn_attack, bn_attack_params=params,
                         grad_agg=agg, bn_agg=agg, fixbn_switch=3)
        for _ in range(5):
            fed.step()
        assert all(torch.isfinite(v).all() for v in state(fed).values()) and (fed.shared_var >= 0).all()
        assert torch.isfinite(fed.momentum_buf).all()
        if agg != "mean":
            assert torch.isfinite(fed.evaluate()[1])


@pytest.mark.parametrize("norm", ["naive", "fbn", "hbn"])
@pytest.mark.parametrize("grad_attack, bn_attack, agg", [("nan", "inf", "nnm+median"), ("inf", "nan", "nnm+median"),
                                                          ("nan", "inf", "mean")])
def test_hostile_messages_never_make_the_model_nan(norm, grad_attack, bn_attack, agg):
    sc = dict(dataset="synthetic-images", norm=norm, n=6, f=2, rounds=20, batch_size=16, lr=0.05, momentum=0.5,
              grad_attack=grad_attack, bn_attack=bn_attack, grad_agg=agg, bn_agg=agg, partition="iid", eval_every=5)
    result = robustbn.run(sc, data=synthetic())
    values = [v for row in result.history for v in row.values()]
    values += [x for layer in result.bn_stats.values() for x in layer["mean"] + layer["var"]]
    assert all(torch.isfinite(torch.tensor(values)))
    if agg == "nnm+median":  # defended: it still learns (chance is 0.1)
        assert result.final_accuracy > 0.2 and result.history[-1]["train_loss"] < result.history[0]["train_loss"]


def test_short_end_to_end_run_learns():
    result = robustbn.run(dict(dataset="synthetic-images", norm="fbn", n=5, f=0, rounds=40, batch_size=16, lr=0.05,
                               momentum=0.5, partition="gamma", gamma=0.2, eval_every=10), data=synthetic())
    assert [row["round"] for row in result.history] == [10, 20, 30, 40]
    assert result.history[0]["test_acc"] < result.final_accuracy and result.final_accuracy > 0.9
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert set(result.bn_stats) == {"features.1", "features.5", "features.9"}


def test_same_seed_same_run_other_seed_other_run():
    sc = dict(dataset="synthetic-images", norm="naive", n=4, f=1, rounds=5, batch_size=8, grad_attack="gaussian",
              grad_agg="median", partition="dirichlet", alpha=0.5, eval_every=5)
    a, b = robustbn.run(sc, data=synthetic()), robustbn.run(sc, data=synthetic())
    c = robustbn.run({**sc, "seed": 1}, data=synthetic())
    assert a.history == b.history and a.bn_stats == b.bn_stats
    assert a.bn_stats != c.bn_stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", MODES)
def test_cuda_vectorized_engine_equals_reference_loop(norm, monkeypatch):
    """The GPU's default path (vmap over clients, cuDNN kernels) against the per-client loop
    on the same GPU, in full float32 (PyTorch lets cuDNN convolutions use TF32 by default)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    fast, slow = (federation(v, norm=norm, device="cuda", fixbn_switch=2) for v in (True, False))
    assert fast.vectorized and fast.theta[next(iter(fast.theta))].is_cuda
    assert_same_runs(fast, slow, rounds=4, tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("norm", ["fbn", "hbn", "fedbn"])
def test_cuda_run_learns_and_stays_on_the_device(norm):
    # CPU and CUDA generators draw different batches, so the runs are compared by outcome
    sc = dict(dataset="synthetic-images", norm=norm, n=5, f=0, rounds=40, batch_size=16, lr=0.05, momentum=0.5,
              partition="gamma", gamma=0.2, eval_every=10, device="cuda")
    result = robustbn.run(sc)
    assert result.device.startswith("cuda") and result.final_accuracy > 0.5


@pytest.mark.parametrize("model,norm", [("simple-cnn", "fbn"), ("cnn", "naive"), ("resnet20", "gn")])
def test_evaluation_in_forward_chunks_gives_the_numbers_of_one_forward_per_batch(model, norm):
    """The CPU's default evaluation forwards 100 test images at a time: each example's logits
    in evaluation mode do not depend on the others, so accuracy and loss are those of one
    forward per summed batch, bit for bit (stored runs keep their histories)."""
    fed = federation(vectorized=False, model=model, norm=norm)
    for _ in range(2):
        fed.step()
    whole = fed.evaluate(batch=200, forward_batch=200)
    for chunk in (7, 64, None):
        assert all(torch.equal(a, b) for a, b in zip(fed.evaluate(batch=200, forward_batch=chunk), whole)), chunk


@given(n=st.integers(1, 6), c=st.integers(1, 9), h=st.integers(1, 13), w=st.integers(1, 13),
       kind=st.sampled_from(["normal", "relu", "ties", "hostile"]), seed=st.integers(0, 2**31 - 1))
def test_the_cpus_channels_last_max_pool_gives_nn_max_pool2ds_values_bit_for_bit(n, c, h, w, kind, seed):
    """robustbn.models.MaxPool2d pools through the channels-last kernel in evaluation: the same
    values as nn.MaxPool2d's NCHW kernel, odd sides, ties (a ReLU's zeros, equal values) and
    NaN / inf included, and an NCHW output; inside vmap too (where it falls back), and the
    same gradients in training (where it is nn.MaxPool2d)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen)
    if kind == "relu":
        x = x.clamp_min(0)
    elif kind == "ties":
        x = x.round().clamp(-1, 1)
    elif kind == "hostile":
        x.view(-1)[torch.randint(0, x.numel(), (3,), generator=gen)] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    ours, reference = MaxPool2d(2), torch.nn.MaxPool2d(2)
    if min(h, w) < 2:  # nothing to pool: both refuse alike
        with pytest.raises(RuntimeError):
            reference(x)
        with pytest.raises(RuntimeError), torch.no_grad():
            ours(x)
        return
    with torch.no_grad():
        out, want = ours(x), reference(x)
    assert out.is_contiguous() and torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(0.5), want.nan_to_num(0.5))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    up = torch.randn(want.shape, generator=gen)
    (ours(a).nan_to_num(0.5) * up).sum().backward()
    (reference(b).nan_to_num(0.5) * up).sum().backward()
    assert a.grad.is_contiguous() and torch.equal(a.grad, b.grad)
    with torch.no_grad():
        per_sample = [vmap(pool)(x.unsqueeze(1)).nan_to_num(0.5) for pool in (ours, reference)]
    assert torch.equal(*per_sample)


def test_the_channels_last_pool_runs_in_evaluation_only(monkeypatch):
    """The fast path is taken where it is meant to be (evaluation on a CPU), and nowhere else."""
    seen = []
    forward = torch.nn.MaxPool2d.forward

    def spy(self, x):
        seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return forward(self, x)
    monkeypatch.setattr(torch.nn.MaxPool2d, "forward", spy)
    x = torch.randn(4, 8, 6, 6)
    with torch.no_grad():
        MaxPool2d(2)(x)
        MaxPool2d(2, return_indices=True)(x)  # indices asked for: nn.MaxPool2d's own
        MaxPool2d(2, padding=1)(x)
    MaxPool2d(2)(x.requires_grad_())  # training
    assert seen == [True, False, False, False]


@pytest.mark.parametrize("model,norm", [("simple-cnn", "fbn"), ("cnn", "naive"), ("simple-cnn", "fedbn")])
def test_evaluation_with_the_channels_last_pool_equals_nn_max_pool2d(model, norm):
    """The engine's evaluation (global, and FedBN's per-client one under vmap) gives the
    numbers of the same model with nn.MaxPool2d, bit for bit."""
    fed = federation(vectorized=False, model=model, norm=norm)
    fed.step()
    ours = fed.evaluate()
    for parent in fed.model.modules():
        for name, child in parent.named_children():
            if isinstance(child, MaxPool2d):
                setattr(parent, name, torch.nn.MaxPool2d(child.kernel_size))
    assert not any(isinstance(m, MaxPool2d) for m in fed.model.modules())
    assert all(torch.equal(a, b) for a, b in zip(fed.evaluate(), ours))


def test_dropout_is_off_in_evaluation_and_on_again_in_training():
    """Seed 002's CNN has dropout 0.25: evaluation draws no mask (the same numbers twice, the
    global generator untouched), and the rounds after it train with dropout again."""
    fed = federation(vectorized=False, model="cnn", norm="fbn", dropout=0.25)
    fed.step()
    rng = torch.get_rng_state()
    first = fed.evaluate()
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(fed.evaluate(), first))
    assert fed.model.training and all(m.training for m in fed.model.modules())
    fed.step()
    assert not torch.equal(torch.get_rng_state(), rng)  # the round drew dropout masks


def test_an_evaluation_subset_leaves_training_and_the_final_evaluation_as_they_were():
    base = dict(dataset="synthetic-images", model="simple-cnn", partition="gamma", gamma=0.5, n=5, f=1, norm="fbn",
                grad_attack="alie", bn_mean_attack="sf", rounds=6, batch_size=8, eval_every=2, seed=3)
    full = robustbn.run(base)
    cheap = robustbn.run({**base, "eval_subset": 37})
    # evaluation draws from no generator of the run: the training, and so the final evaluation, are the same
    assert cheap.history[-1] == full.history[-1] and "test_examples" not in cheap.history[-1]
    assert cheap.bn_stats == full.bn_stats
    for entry in cheap.history[:-1]:
        assert entry["test_examples"] == 37
        assert round(entry["test_acc"] * 37, 4) == round(entry["test_acc"] * 37)  # a count of 37 examples
    assert "eval_subset" not in Scenario(**base).validated().to_dict()  # old runs keep their hashes
    with pytest.raises(ValueError, match="eval_subset"):
        Scenario(**{**base, "norm": "fedbn", "eval_subset": 10}).validated()
    with pytest.raises(ValueError, match="eval_subset"):
        Scenario(**{**base, "eval_subset": 0}).validated()
