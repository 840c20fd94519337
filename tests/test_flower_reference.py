"""Flower's own strategies as RobustStrategy's reference (issue 31), on the same hand-made
replies, as Flower's strategy tests build them (one ArrayRecord and a num-examples metric):

- like for like they agree, per channel (Flower run on one channel's keys): FedMedian with
  median, FedTrimmedAvg with trmean (beta giving f), Krum, MultiKrum (the same m), Bulyan's
  coordinate step (given Flower's selection) with robustbn's; clean, 1e6 and sign-flipped
  Byzantine replies, n/f = 7/1 and 11/2, a model without BN and one with two BatchNorm1d;
- where Flower's fail, RobustStrategy holds: a NaN reply (np.median), Krum's float32 distances
  on raw weights, BN counters and statistics in Krum's distance, FedTrimmedAvg's int(beta n).

`python tests/test_flower_reference.py` prints the measured table of docs/guide/flower.md."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flwr")
from flwr.app import ArrayRecord  # noqa: E402
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum  # noqa: E402
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights  # noqa: E402
from flwr.serverapp.strategy.multikrum import select_multikrum  # noqa: E402

from aggregators.catalogue import Bulyan as CatalogueBulyan  # noqa: E402
from aggregators.rules import Meamed  # noqa: E402
from robustbn import flower  # noqa: E402

from test_flower import reply  # noqa: E402


def no_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def two_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(),
                         nn.Linear(4, 3))


def replies(model: nn.Module, n: int, f: int, hostile: str, seed: int = 0) -> list[OrderedDict]:
    """n states: n - f honest (the model moved at random), then f Byzantine ones: honest,
    1e6 everywhere, or the honest mean's move sign-flipped and scaled by 3."""
    gen = torch.Generator().manual_seed(seed)
    g = model.state_dict()
    honest = []
    for _ in range(n - f):
        state = OrderedDict((k, v + torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 5)
                            for k, v in g.items())
        for k in state:
            if k.endswith("running_var"):
                state[k] = state[k].abs()
        honest.append(state)
    byzantine = []
    for i in range(f):
        if hostile == "1e6":
            byzantine.append(OrderedDict((k, torch.full_like(v, 1e6) if v.is_floating_point() else v)
                                         for k, v in g.items()))
        elif hostile == "sign-flip":
            mean = {k: torch.stack([s[k] for s in honest]).float().mean(0) for k in g if g[k].is_floating_point()}
            byzantine.append(OrderedDict((k, (g[k] - 3 * (mean[k] - g[k])).abs() if k.endswith("running_var") else
                                          g[k] - 3 * (mean[k] - g[k]) if k in mean else g[k]) for k in g))
        else:
            byzantine.append(honest[i])
    return honest + byzantine


def messages(states, keys=None):
    """Flower's replies: one ArrayRecord (only `keys`, for one channel) and num-examples 1."""
    return [reply(OrderedDict((k, v) for k, v in s.items() if keys is None or k in keys), i, **{"num-examples": 1})
            for i, s in enumerate(states)]


def flower_on(strategy, states, keys) -> dict:
    arrays, _ = strategy.aggregate_train(1, messages(states, keys))
    return arrays.to_torch_state_dict()


def ours(model, states, n, f, spec, **params) -> dict:
    strategy = flower.RobustStrategy(model, n=n, f=f, grad_agg=spec, grad_agg_params=params)
    strategy.sent(ArrayRecord(model.state_dict()))
    arrays, _ = strategy.aggregate_train(1, messages(states))
    return arrays.to_torch_state_dict()


def channels(model) -> list[list[str]]:
    layout = flower.Layout(model, flower.get_protocol("naive")())
    return [c for c in (layout.weights, layout.means, layout.variances) if c]


def like_for_like(name: str, model, n: int, f: int, hostile: str) -> float:
    """The largest difference, over every channel and key, between Flower's strategy `name`
    and RobustStrategy with its rule, on the same replies."""
    states = replies(model, n, f, hostile)
    rule = {"FedMedian": ("median", {}), "FedTrimmedAvg": ("trmean", {}), "Krum": ("krum", {}),
            "MultiKrum": ("multikrum", {"m": n - f - 1})}[name]
    mine = ours(model, states, n, f, rule[0], **rule[1])
    worst = 0.0
    for keys in channels(model):
        strategy = {"FedMedian": lambda: FedMedian(), "FedTrimmedAvg": lambda: FedTrimmedAvg(beta=(f + 0.5) / n),
                    "Krum": lambda: Krum(num_malicious_nodes=f),
                    "MultiKrum": lambda: MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f - 1)}[name]()
        theirs = flower_on(strategy, states, keys)
        worst = max(worst, *(float((theirs[k].double() - mine[k].double()).abs().max()) for k in keys))
    return worst


def bulyan_step(model, n: int, f: int, hostile: str) -> float:
    """Bulyan's coordinate step given Flower's selection (MultiKrum's theta = n - 2f rows):
    Flower's beta = theta - 2f values nearest the median, averaged, against robustbn's
    (Meamed(2f), what aggregators' Bulyan applies to its selection)."""
    states = replies(model, n, f, hostile)
    worst = 0.0
    for keys in channels(model):
        contents = [m.content for m in messages(states, keys)]
        chosen = select_multikrum(contents, f, n - 2 * f)
        rows = [[np.asarray(a) for a in c["arrays"].to_numpy_ndarrays()] for c in chosen]
        median = [np.median(np.stack(layer), axis=0) for layer in zip(*rows)]
        theirs = aggregate_n_closest_weights(median, rows, n - 4 * f)
        for i, layer in enumerate(zip(*rows)):
            mine = Meamed(2 * f).apply(torch.from_numpy(np.stack(layer)).reshape(len(layer), -1))
            worst = max(worst, float(np.abs(mine.numpy().reshape(theirs[i].shape) - theirs[i]).max()))
    assert Bulyan(num_malicious_nodes=f).selection_rule is select_multikrum  # Flower's own selection, as used here
    return worst


CASES = [(model, n, f, hostile) for model in (no_bn, two_bn) for n, f in ((7, 1), (11, 2))
         for hostile in ("clean", "1e6", "sign-flip")]


@pytest.mark.parametrize("name", ["FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum"])
@pytest.mark.parametrize("model,n,f,hostile", CASES)
def test_like_for_like_robust_strategy_equals_flowers(name, model, n, f, hostile):
    assert like_for_like(name, model(), n, f, hostile) < 1e-5  # float32 rounding of g + (x - g) on values up to 1e6


@pytest.mark.parametrize("model,n,f,hostile", CASES)
def test_bulyans_coordinate_step_equals_flowers_given_the_same_selection(model, n, f, hostile):
    assert bulyan_step(model(), n, f, hostile) < 1e-6


# ---- where Flower's strategies fail -------------------------------------------------------------

def nan_reply(n: int = 7) -> tuple[int, int]:
    """One reply with a NaN weight: NaN coordinates (FedMedian's, RobustStrategy's median)."""
    model = no_bn()
    states = replies(model, n, 1, "clean")
    states[-1]["0.weight"][0, 0] = float("nan")
    keys = channels(model)[0]
    theirs = flower_on(FedMedian(), states, keys)
    mine = ours(model, states, n, 1, "median")
    count = lambda out: sum(int(torch.isnan(out[k]).sum()) for k in keys)
    return count(theirs), count(mine)


def krum_misses(draws: int = 20, n: int = 7, f: int = 1, ratio: float = 1e-4) -> tuple[int, int]:
    """Draws where Krum's pick is not exact Krum's (float64, on the updates): Flower's (float32
    |x|^2 + |y|^2 - 2 x.y on raw weights of size 1, updates `ratio` of that) and RobustStrategy's."""
    theirs = mine = 0
    for draw in range(draws):
        gen = torch.Generator().manual_seed(draw)
        model = nn.Linear(40, 50)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        g = model.state_dict()
        states = [OrderedDict((k, v + ratio * torch.randn(v.shape, generator=gen)) for k, v in g.items())
                  for _ in range(n)]
        deltas = torch.stack([torch.cat([(s[k].double() - g[k].double()).reshape(-1) for k in g]) for s in states])
        d = torch.cdist(deltas, deltas) ** 2
        exact = int(d.sort(1).values[:, 1:n - f - 1].sum(1).argmin())
        pick = lambda out: closest(out, states)
        theirs += pick(flower_on(Krum(num_malicious_nodes=f), states, list(g))) != exact
        mine += pick(ours(model, states, n, f, "krum")) != exact
    return theirs, mine


def closest(out: dict, states: list[dict]) -> int:
    """The reply a selected result is (nearest in L1, in float64)."""
    return int(torch.tensor([sum(float((out[k].double() - s[k].double()).abs().sum()) for k in out)
                             for s in states]).argmin())


def bn_spread(by: str, n: int = 7, f: int = 1) -> tuple[nn.Module, list[dict], flower.Layout]:
    """Honest clients whose BN counters (or running variances) differ widely, as clients with
    different amounts of data have, and f Byzantine replies shifted by 1 in every weight, with
    the counters (variances) at the honest ones' centre."""
    model = two_bn()
    g = model.state_dict()
    gen = torch.Generator().manual_seed(0)
    layout = flower.Layout(model, flower.get_protocol("naive")())
    states = []
    for i in range(n):
        state = OrderedDict((k, v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v)
                            for k, v in g.items())
        spread = 1000.0 * (i if i < n - f else (n - f - 1) / 2)
        for k in layout.counters if by == "counters" else layout.variances:
            state[k] = g[k] + int(spread) if by == "counters" else g[k] + spread
        if i >= n - f:
            for k in layout.weights:
                state[k] = state[k] + 1.0
        states.append(state)
    return model, states, layout


def swayed(name: str, by: str, n: int = 7, f: int = 1) -> tuple[float, float]:
    """How far the result's weights move towards the Byzantine reply of `bn_spread`, as a share
    of its shift, through Flower's Krum or MultiKrum on whole replies and RobustStrategy's."""
    model, states, layout = bn_spread(by, n, f)
    strategy = Krum(num_malicious_nodes=f) if name == "Krum" else \
        MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f - 1)
    theirs = flower_on(strategy, states, None)
    mine = ours(model, states, n, f, name.lower(), **({} if name == "Krum" else {"m": n - f - 1}))
    honest = {k: torch.stack([s[k] for s in states[:n - f]]).mean(0) for k in layout.weights}
    moved = lambda out: max(float((out[k] - honest[k]).mean()) for k in layout.weights)
    return moved(theirs), moved(mine)


def bulyan_selects_the_byzantine(by: str, n: int = 7, f: int = 1) -> tuple[bool, bool]:
    """Whether Bulyan's selection (n - 2f replies) takes the Byzantine reply of `bn_spread`:
    Flower's (MultiKrum on whole replies) and robustbn's (iterated Krum on the updates, what
    RobustStrategy's bulyan runs)."""
    model, states, layout = bn_spread(by, n, f)
    chosen = select_multikrum([m.content for m in messages(states)], f, n - 2 * f)
    theirs = any(closest(c["arrays"].to_torch_state_dict(), states) >= n - f for c in chosen)
    g = model.state_dict()
    deltas = torch.stack([torch.cat([(s[k] - g[k]).reshape(-1) for k in layout.weights]) for s in states])
    mine = bool((CatalogueBulyan(f).selection(deltas) >= n - f).any())
    return theirs, mine


def trimmed_pairs(limit: int = 1000) -> list[tuple[int, int]]:
    """(n, f), n <= limit, f < n/2, where FedTrimmedAvg(beta=f/n) trims int(beta n) < f per side."""
    return [(n, f) for n in range(1, limit + 1) for f in range(1, n) if f / n < 0.5 and int(f / n * n) < f]


def trimmed_leak(n: int = 49, f: int = 1) -> tuple[float, float]:
    """The largest coordinate of FedTrimmedAvg(beta=f/n) and of RobustStrategy(trmean, f) with
    f replies at 1e6 (the honest values are of size 1)."""
    model = no_bn()
    states = replies(model, n, f, "1e6")
    keys = channels(model)[0]
    theirs = flower_on(FedTrimmedAvg(beta=f / n), states, keys)
    mine = ours(model, states, n, f, "trmean")
    return max(float(theirs[k].abs().max()) for k in keys), max(float(mine[k].abs().max()) for k in keys)


def test_a_nan_reply_makes_fedmedians_coordinate_nan_not_robust_strategys():
    theirs, mine = nan_reply()
    assert theirs == 1 and mine == 0


def test_flowers_float32_krum_on_raw_weights_picks_another_client_robust_strategy_does_not():
    theirs, mine = krum_misses()
    assert theirs >= 5 and mine == 0


@pytest.mark.parametrize("name", ["Krum", "MultiKrum"])
@pytest.mark.parametrize("by", ["counters", "variances"])
def test_bn_counters_and_statistics_sway_flowers_choice_not_robust_strategys(name, by):
    theirs, mine = swayed(name, by)
    assert theirs > 0.1 and abs(mine) < 0.05  # the Byzantine shift is 1


@pytest.mark.parametrize("by", ["counters", "variances"])
def test_bn_counters_and_statistics_put_the_byzantine_in_flowers_bulyan_selection(by):
    assert bulyan_selects_the_byzantine(by) == (True, False)


def test_fedtrimmedavg_trims_one_fewer_than_f_over_n_intends():
    pairs = trimmed_pairs()
    assert len(pairs) == 9291 and (49, 1) in pairs
    theirs, mine = trimmed_leak()
    assert theirs > 1e4 and mine < 10


def table() -> str:
    """The measured table of docs/guide/flower.md."""
    rows = ["| comparison | Flower | RobustStrategy |", "|---|---|---|"]
    for name in ("FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum"):
        worst = max(like_for_like(name, model(), n, f, hostile) for model, n, f, hostile in CASES)
        rows.append(f"| like for like: {name}, largest difference over {len(CASES)} cases | - | {worst:.1e} |")
    worst = max(bulyan_step(model(), n, f, hostile) for model, n, f, hostile in CASES)
    rows.append(f"| like for like: Bulyan's coordinate step given the same selection | - | {worst:.1e} |")
    theirs, mine = nan_reply()
    rows.append(f"| one NaN reply of 7: NaN coordinates out | {theirs} | {mine} |")
    theirs, mine = krum_misses()
    rows.append(f"| Krum, updates 1e-4 the weights' size: picks not exact Krum's, of 20 draws | {theirs} | {mine} |")
    for by in ("counters", "variances"):
        for name in ("Krum", "MultiKrum"):
            theirs, mine = swayed(name, by)
            rows.append(f"| {name}, honest BN {by} spread, a Byzantine at their centre shifted in its weights: "
                        f"the result moved towards it (share of its shift) | {theirs:.2f} | {mine:.2f} |")
        theirs, mine = bulyan_selects_the_byzantine(by)
        rows.append(f"| Bulyan, the same: the Byzantine in the selection | {'yes' if theirs else 'no'} | "
                    f"{'yes' if mine else 'no'} |")
    theirs, mine = trimmed_leak()
    rows.append(f"| FedTrimmedAvg(beta = f/n): (n, f) pairs with n <= 1000 trimming f - 1 | {len(trimmed_pairs())} | 0 |")
    rows.append(f"| n = 49, f = 1 at 1e6: largest coordinate out (honest: about 1) | {theirs:.3g} | {mine:.3g} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
