"""What the server does beyond one pipeline per channel: Byzantine clients holding data (label
flipping), the server's own reference gradient on a root set (FLTrust), the cross-channel
client filter (BNGuard) and the BN-aware statistics search (bn-kl)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import aggregators
import attacks
from attacks.statistics import StatisticsSearch, gaussian_kl
from robustbn.data import load_dataset, sample_batches
from robustbn.engine import Federation
from robustbn.filters import BNGuard, ClientFilter, register, two_means
from robustbn.runner import federation_parts
from robustbn.scenario import Scenario, ScenarioError

BASE = dict(dataset="synthetic-images", model="simple-cnn", norm="fbn", n=6, f=2, rounds=4, eval_every=2,
            batch_size=8, lr=0.05, partition="gamma", gamma=0.0, seed=5)


def federation(**values):
    sc = Scenario.from_dict({**BASE, **values})
    data = load_dataset("synthetic-images")
    return Federation(sc, data, federation_parts(sc, data.y_train.numpy()), vectorized=False)


def capture(fed):
    """Record what `_exchange` receives each round: (rows, stats, k)."""
    seen = []
    original = fed._exchange

    def spy(rows, stats, k):
        seen.append((rows.clone(), None if stats is None else tuple(s.clone() for s in stats), k))
        return original(rows, stats, k)
    fed._exchange = spy
    return seen


def sampled(fed):
    """The mini-batches the next round will draw (x, y as the clients see them, and the data's
    own labels); the generator is put back."""
    state = fed.gen.get_state()
    x, y = fed._sample()
    fed.gen.set_state(state)
    true = fed.data.y_train[sample_batches(fed.table, fed.lengths, fed.sc.batch_size, fed.gen)]
    fed.gen.set_state(state)
    return x, y, true


def gradient(fed, x, y):
    """A client's gradient by plain autograd, through the model in training mode."""
    theta = {k: v.detach().clone().requires_grad_() for k, v in fed.theta.items()}
    fed.set_phase("train")
    out = functional_call(fed.model, {**theta, **fed._buffers(fed.shared_mean, fed.shared_var)}, (x,))
    grads = torch.autograd.grad(F.cross_entropy(out, y), list(theta.values()))
    return torch.cat([g.reshape(-1) for g in grads])


# ---- label flipping ---------------------------------------------------------------------------

def test_labelflip_partitions_the_data_among_all_n_clients():
    sc = Scenario.from_dict({**BASE, "grad_attack": "labelflip"})
    parts = federation_parts(sc, load_dataset("synthetic-images").y_train.numpy())
    assert len(parts) == sc.n  # 4 honest, then the 2 Byzantine clients' own data
    assert len(np.unique(np.concatenate(parts))) == sum(map(len, parts))


def test_labelflip_byzantine_gradients_are_honest_gradients_on_flipped_labels():
    fed = federation(grad_attack="labelflip")
    seen = capture(fed)
    x, y, true = sampled(fed)
    k, n = fed.honest, fed.sc.n
    assert torch.equal(y[:k], true[:k]) and torch.equal(y[k:], fed.data.num_classes - 1 - true[k:])
    # the gradients at the weights the round starts from: by plain autograd, before the step
    want = [gradient(fed, x[i], fed.data.num_classes - 1 - true[i] if i >= k else true[i]) for i in range(n)]
    fed.step()
    rows, _, got_k = seen[0]
    assert got_k == k and rows.shape[0] == n
    for i in range(n):
        torch.testing.assert_close(rows[i], want[i], rtol=1e-4, atol=1e-6)


def test_labelflip_on_the_statistics_sends_the_byzantine_clients_own_statistics():
    fed = federation(grad_attack="labelflip", bn_attack="labelflip")
    received = []
    original = fed._server_stats
    fed._server_stats = lambda m, v, keep=None: (received.append((m.clone(), v.clone())), original(m, v, keep))[1]
    seen = capture(fed)
    fed.step()
    _, (mean, var), k = seen[0]
    torch.testing.assert_close(received[0][0], mean)  # every row: each client's own report
    torch.testing.assert_close(received[0][1], var)


# ---- FLTrust's root set ---------------------------------------------------------------------

def test_root_set_is_drawn_from_the_training_set_and_kept_from_the_clients():
    sc = Scenario.from_dict({**BASE, "grad_agg": "fltrust", "root_size": 30})
    parts = federation_parts(sc, load_dataset("synthetic-images").y_train.numpy())
    *clients, root = parts
    assert len(clients) == sc.honest and len(root) == 30
    assert not set(root) & set(np.concatenate(clients))
    again = federation_parts(sc, load_dataset("synthetic-images").y_train.numpy())[-1]
    assert np.array_equal(root, again)  # one seed, one root set


def test_fltrust_gets_the_servers_gradient_on_its_root_set():
    fed = federation(grad_agg="fltrust", root_size=40, grad_attack="sf")
    assert fed.h == fed.honest + 1 and fed.has_root
    calls = []
    pipeline = fed.grad_channel.pipeline
    original = pipeline.__call__
    fed.grad_channel.pipeline = lambda x, reference=None: (calls.append((x.clone(), reference)), original(x, reference=reference))[1]
    fed.grad_channel.pipeline.needs_reference = True
    seen = capture(fed)
    x, y, _ = sampled(fed)
    want = gradient(fed, x[-1], y[-1])
    fed.step()
    rows, _, k = seen[0]
    messages, reference = calls[0]
    assert messages.shape[0] == fed.sc.n  # honest and Byzantine; the server's row is not a message
    torch.testing.assert_close(reference, rows[-1])
    torch.testing.assert_close(reference, want, rtol=1e-4, atol=1e-6)
    root = set(federation_parts(fed.sc, fed.data.y_train.numpy())[-1].tolist())
    table_row = fed.table[-1, : int(fed.lengths[-1])].tolist()
    assert set(table_row) == root


def test_fltrust_scenarios_get_the_papers_root_size_and_others_none():
    assert Scenario.from_dict({**BASE, "grad_agg": "fltrust"}).root_size == 100
    plain = Scenario.from_dict({**BASE, "root_size": 50})
    assert plain.root_size is None and "root_size" not in plain.to_dict()  # unused: the same run without it
    with pytest.raises(ScenarioError, match="bn_agg.*gradients only"):
        Scenario.from_dict({**BASE, "bn_agg": "fltrust"})
    with pytest.raises(ScenarioError, match="root_size"):
        Scenario.from_dict({**BASE, "grad_agg": "fltrust", "root_size": 0})
    with pytest.raises(ScenarioError, match="norm"):
        Scenario.from_dict({**BASE, "grad_agg": "fltrust", "norm": "central", "f": 0})
    with pytest.raises(ScenarioError, match="norm"):
        Scenario.from_dict({**BASE, "grad_attack": "labelflip", "norm": "fedtan"})


# ---- the client filter ------------------------------------------------------------------------

class DropFirstAndLast(ClientFilter):
    """Drops client 0 and the last client, whatever they sent."""
    name = "drop-first-and-last"

    def keep(self, mean, var, channels_per_layer):
        keep = torch.ones(len(mean), dtype=torch.bool)
        keep[0] = keep[-1] = False
        return keep


@pytest.fixture
def drop_first_and_last():
    register(DropFirstAndLast)
    yield
    from robustbn.filters import FILTERS
    del FILTERS["drop-first-and-last"]


class Recorded:
    """A pipeline that records every message set it aggregates."""

    def __init__(self, pipeline, log):
        self.pipeline, self.log = pipeline, log

    def __call__(self, x, **kw):
        self.log.append(x.clone())
        return self.pipeline(x, **kw)

    def __getattr__(self, name):
        return getattr(self.pipeline, name)


def spy_pipelines(fed):
    """Every message set a pipeline of each channel aggregates after the filter, by channel."""
    got = {"grad": [], "bn_mean": [], "bn_var": []}
    for name, channel in (("grad", fed.grad_channel), ("bn_mean", fed.mean_channel), ("bn_var", fed.var_channel)):
        original = channel.pipeline_for
        channel.pipeline_for = lambda m, n, original=original, name=name: Recorded(original(m, n), got[name])
    return got


def test_a_stateful_rule_keeps_one_state_per_channel_whatever_a_filter_leaves(drop_first_and_last):
    """cc's center is the previous aggregate of its channel: the pipeline built for the messages
    a client filter kept shares the channel's cc, so the state goes on from round to round."""
    fed = federation(client_filter="drop-first-and-last", grad_attack="sf", bn_mean_attack="sf",
                     bn_var_attack="honest", grad_agg="nnm+cc")
    fed.step()
    n = fed.sc.n
    kept = fed.grad_channel.pipeline_for(n - 2, n)
    assert kept is not fed.grad_channel.pipeline and kept.agg is fed.grad_channel.pipeline.agg
    first = kept.agg.previous.clone()
    fed.step()
    assert not torch.equal(kept.agg.previous, first)  # the second round started from the first's
    assert kept.pre[0].f <= fed.sc.f  # NNM itself is built for the messages kept


@pytest.mark.parametrize("algorithm", ["dsgd", "fedavg"])
def test_the_filter_drops_the_same_clients_on_every_channel(drop_first_and_last, algorithm):
    fed = federation(client_filter="drop-first-and-last", grad_attack="sf", bn_mean_attack="sf",
                     bn_var_attack="honest", algorithm=algorithm)
    seen = capture(fed)
    got = spy_pipelines(fed)
    fed.step()
    rows, (mean, var), k = seen[0]
    n = fed.sc.n
    grad = torch.cat([rows[:k], -rows[:k].mean(0).expand(fed.sc.f, -1)])
    torch.testing.assert_close(got["grad"][0], grad[1 : n - 1])  # clients 1 .. n-2, on each channel
    means = torch.cat([mean[:k], -mean[:k].mean(0).expand(fed.sc.f, -1)])
    torch.testing.assert_close(got["bn_mean"][0], means[1 : n - 1])
    variances = torch.cat([var[:k], var[:k].mean(0).expand(fed.sc.f, -1)])
    torch.testing.assert_close(got["bn_var"][0], variances[1 : n - 1])


def test_bnguard_drops_clients_whose_statistics_are_outliers():
    fed = federation(client_filter="bnguard", bn_mean_attack="scale", bn_var_attack="scale",
                     bn_attack_params={"factor": 50.0}, grad_attack="sf")
    for _ in range(3):
        fed.step()
    kept = torch.stack(fed.kept_history)
    assert kept[:, : fed.honest].all() and not kept[:, fed.honest :].any()


def test_a_filtered_run_records_what_it_dropped():
    import robustbn
    result = robustbn.run({**BASE, "client_filter": "bnguard", "bn_attack": "scale", "bn_attack_params": {"factor": 50.0}})
    assert all(h["byzantine_dropped"] == 1.0 and h["honest_dropped"] == 0.0 for h in result.history)


def test_filter_scenarios_are_checked():
    with pytest.raises(ScenarioError, match="bn_attack.*every client must send"):
        Scenario.from_dict({**BASE, "client_filter": "bnguard", "grad_attack": "sf"})
    with pytest.raises(ScenarioError, match="client_filter.*sends none"):
        Scenario.from_dict({**BASE, "client_filter": "bnguard", "norm": "gn", "f": 0})
    with pytest.raises(ScenarioError, match="client_filter_params.*does not take"):
        Scenario.from_dict({**BASE, "client_filter": "bnguard", "client_filter_params": {"k": 3}, "f": 0})
    with pytest.raises(ScenarioError, match="client_filter.*allowed: bnguard"):
        Scenario.from_dict({**BASE, "client_filter": "nope", "f": 0})
    sc = Scenario.from_dict({**BASE, "client_filter": "bnguard", "client_filter_params": {}, "f": 0})
    assert sc.client_filter_params is None  # empty parameters: the same run as none


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(0, 2**31 - 1), st.integers(4, 12), st.integers(1, 3))
def test_bnguard_is_permutation_invariant_and_keeps_a_majority(seed, n, f):
    g = torch.Generator().manual_seed(seed)
    mean, var = torch.randn(n, 16, generator=g), torch.rand(n, 16, generator=g) + 0.5
    mean[:f] += 20.0
    keep = BNGuard().keep(mean, var, [8, 8])
    perm = torch.randperm(n, generator=g)
    assert torch.equal(BNGuard().keep(mean[perm], var[perm], [8, 8]), keep[perm])
    assert int(keep.sum()) >= (n + 1) // 2
    if 2 * f < n:
        assert not keep[:f].any()


def test_two_means_against_a_brute_force_split():
    g = torch.Generator().manual_seed(0)
    points = torch.cat([torch.randn(5, 4, generator=g), torch.randn(4, 4, generator=g) + 6.0]).double()
    labels = two_means(points)
    best, best_cost = None, float("inf")
    for i in range(1, 2**9 - 1):  # every split into two non-empty clusters
        m = torch.tensor([(i >> j) & 1 for j in range(9)], dtype=torch.bool)
        cost = float(((points[m] - points[m].mean(0)) ** 2).sum() + ((points[~m] - points[~m].mean(0)) ** 2).sum())
        if cost < best_cost:
            best, best_cost = m, cost
    assert torch.equal(labels == labels[0], best == best[0])


# ---- the BN-aware attack ----------------------------------------------------------------------

def test_gaussian_kl_is_the_divergence_of_two_normals():
    g = torch.Generator().manual_seed(1)
    mu_h, mu_s = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    var_h, var_s = torch.rand(7, generator=g, dtype=torch.float64) + 0.1, torch.rand(7, generator=g, dtype=torch.float64) + 0.1
    want = torch.distributions.kl_divergence(torch.distributions.Normal(mu_h, (var_h + 1e-5).sqrt()),
                                             torch.distributions.Normal(mu_s, (var_s + 1e-5).sqrt())).sum()
    torch.testing.assert_close(gaussian_kl(mu_h, var_h, mu_s, var_s), want)


def test_the_statistics_search_picks_the_best_candidate():
    g = torch.Generator().manual_seed(2)
    honest = torch.randn(5, 9, generator=g, dtype=torch.float64)
    attack = StatisticsSearch(pipeline=aggregators.build("median", f=2))
    target = torch.linspace(-3, 3, 9, dtype=torch.float64)
    objective = lambda sets: torch.stack([((s[-1] - target) ** 2).sum() for s in sets]) * -1.0
    byzantine = attack.forge_against(honest, 2, objective)
    scores = [float(objective(torch.cat([honest, c.expand(2, -1)])[None])) for c in attack.candidates(honest)]
    assert torch.equal(byzantine[0], attack.candidates(honest)[int(np.argmax(scores))])
    assert torch.equal(byzantine[0], byzantine[1])


@pytest.mark.parametrize("norm", ["naive", "fbn", "hbn"])
def test_bn_kl_does_at_least_the_damage_of_the_classic_attacks_on_the_statistics(norm):
    fed = federation(norm=norm, bn_mean_attack="bn-kl", bn_var_attack="honest", bn_agg="nnm+median")
    for _ in range(2):
        fed.step()
    mean_ch = fed.mean_channel
    calls = []
    original = mean_ch.attack.forge_against
    mean_ch.attack.forge_against = lambda honest, f, objective: (calls.append((honest, objective)), original(honest, f, objective))[1]
    fed.step()
    honest, objective = calls[0]
    f = fed.sc.f
    chosen = mean_ch.attack.candidates(honest)[mean_ch.attack.last_candidate]
    classic = {name: attacks.build(name)(honest, f) for name in ("sf", "alie", "foe", "honest")}
    best = objective(torch.cat([honest, chosen.expand(f, -1)])[None])[0]
    for name, byz in classic.items():
        assert best >= objective(torch.cat([honest, byz])[None])[0] - 1e-6, name
    assert best > 0


def test_matrix_friendly_spellings_are_the_runs_they_mean():
    gn = Scenario.from_dict({**BASE, "norm": "gn", "grad_attack": "alie", "bn_attack": "honest"})
    assert gn.to_dict() == Scenario.from_dict({**BASE, "norm": "gn", "grad_attack": "alie"}).to_dict()
    with pytest.raises(ScenarioError, match="sends no BN statistics"):  # a real attack there is still an error
        Scenario.from_dict({**BASE, "norm": "gn", "bn_mean_attack": "sf"})
    unfiltered = Scenario.from_dict({**BASE, "client_filter": "none", "grad_attack": "sf"})
    assert unfiltered.to_dict() == Scenario.from_dict({**BASE, "grad_attack": "sf"}).to_dict()


@pytest.mark.parametrize("norm", ["fbn", "fixbn"])
def test_bn_kl_scores_dncs_candidates_in_one_batch_and_the_run_is_the_same(norm, monkeypatch):
    """dnc draws nothing on the BN statistics (d <= b), so bn-kl's candidates are scored in one
    vmapped call: the run is the one that scored them one at a time, bit for bit."""
    from aggregators import catalogue

    values = dict(norm=norm, bn_attack="bn-kl", grad_agg="dnc", bn_agg="dnc", n=6, f=2)
    vmapped, real_vmap = [], torch.vmap
    monkeypatch.setattr(torch, "vmap", lambda fn, *a, **k: vmapped.append(fn) or real_vmap(fn, *a, **k))
    batched = federation(**values)
    for _ in range(3):
        batched.step()
    # _together batches the two channels' calls too: the candidates' scoring is `update`
    assert any(getattr(fn, "__name__", "") == "update" for fn in vmapped), "the candidates were not batched"
    monkeypatch.setattr(torch, "vmap", real_vmap)
    monkeypatch.setattr(catalogue.DnC, "draws", lambda self, d: True)  # the one-at-a-time path
    looped = federation(**values)
    scored = []
    real = looped._damage
    monkeypatch.setattr(looped, "_damage", lambda *a, **k: scored.append(a[0].dim()) or real(*a, **k))
    for _ in range(3):
        looped.step()
    assert scored, "bn-kl never scored its candidates"
    for a, b in zip([*batched.model.parameters(), *batched.model.buffers()],
                    [*looped.model.parameters(), *looped.model.buffers()]):
        assert torch.equal(a, b)
