"""Cross-channel client filters: each round, before any pipeline runs, a filter reads the BN
statistics every client sent and flags clients; a flagged client's messages are dropped on
every channel (gradients, BN means, BN variances), and the channels' pipelines run on the rest.

This is where the statistics channel helps the defense: what a client's statistics reveal
about it decides whether its gradient is heard. Messages of one client stay aligned across
channels (row i of every channel is client i), which is what makes dropping them together
possible. A filter returns a boolean mask over clients; reading it is a host sync, the one
a filter costs per round.
"""

from __future__ import annotations

import inspect

import torch

from aggregators.checks import iterations
from aggregators.plugins import resolve


class ClientFilter:
    """Subclasses implement `keep(mean, var, channels_per_layer)`: the (m, C) bn_mean and
    bn_var messages of m clients (C = every BN layer's channels, flat) -> a (m,) bool mask
    of the clients whose messages are kept."""

    name = "filter"

    def keep(self, mean: torch.Tensor, var: torch.Tensor, channels_per_layer: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def two_means(points: torch.Tensor, iters: int = 50) -> torch.Tensor:
    """Lloyd's 2-means on (m, p) points, deterministic: started from the two points farthest
    apart, a fixed number of iterations (no host sync). Returns (m,) labels in {0, 1}."""
    dist = torch.cdist(points, points)
    far = dist.flatten().argmax()
    centers = torch.stack([points[far // len(points)], points[far % len(points)]])
    labels = torch.zeros(len(points), dtype=torch.long, device=points.device)
    for _ in range(iters):
        labels = torch.cdist(points, centers).argmin(1)
        member = torch.nn.functional.one_hot(labels, 2).to(points.dtype)  # (m, 2)
        count = member.sum(0)
        means = (member.T @ points) / count.clamp_min(1)[:, None]
        centers = torch.where(count[:, None] > 0, means, centers)  # an empty cluster keeps its center
    return labels


def _spread(t: torch.Tensor) -> torch.Tensor:
    """Per row, the unbiased variance across the columns (0 for a single column)."""
    return t.var(1) if t.shape[1] >= 2 else torch.zeros_like(t[:, 0])


class BNGuard(ClientFilter):
    """BNGuard (Xu et al. 2025, arXiv 2509.13219, the authors' code): per client, four
    features of one BN layer's statistics (the first layer by default, as the paper; `layers =
    "all"` concatenates the features of every layer): the mean and the variance (unbiased)
    across channels of its running variances, and of its running means. 2-means on these
    features (the paper uses scikit-learn's KMeans; here Lloyd's from the farthest pair,
    deterministic); the larger cluster is kept. A tie in size keeps the cluster whose center
    is nearer the coordinate-wise median of the features (order of clients does not matter).
    Non-finite features (hostile statistics) are set to +-1e30: those clients are far away."""

    name = "bnguard"

    def __init__(self, layers: str = "first", iters: int = 50):
        if layers not in ("first", "all"):
            raise ValueError(f"bnguard: layers must be 'first' or 'all', got {layers!r}")
        self.layers, self.iters = layers, iterations("bnguard", "iters", iters)

    def features(self, mean: torch.Tensor, var: torch.Tensor, channels_per_layer: list[int]) -> torch.Tensor:
        """(m, 4 x layers used) features, float64."""
        blocks = list(zip(mean.double().split(channels_per_layer, 1), var.double().split(channels_per_layer, 1)))
        if self.layers == "first":
            blocks = blocks[:1]
        x = torch.stack([feature for m, v in blocks for feature in (v.mean(1), _spread(v), m.mean(1), _spread(m))], 1)
        return torch.nan_to_num(x, nan=1e30, posinf=1e30, neginf=-1e30).clamp(-1e30, 1e30)

    def keep(self, mean, var, channels_per_layer):
        x = self.features(mean, var, channels_per_layer)
        if len(x) < 3:
            return torch.ones(len(x), dtype=torch.bool, device=x.device)
        labels = two_means(x, self.iters)
        size = torch.stack([(labels == 0).sum(), (labels == 1).sum()])
        median = x.median(0).values
        centers = torch.stack([x[labels == c].mean(0) if bool(size[c]) else median + 1e300 for c in (0, 1)])
        nearer = torch.linalg.vector_norm(centers - median, dim=1).argmin()
        winner = torch.where(size[0] == size[1], nearer, size.argmax())
        return labels == winner


FILTERS: dict[str, type[ClientFilter]] = {}


def register(cls: type[ClientFilter]) -> type[ClientFilter]:
    """Add a filter class under its `name` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, ClientFilter)):
        raise TypeError(f"register: {cls!r} is not a subclass of robustbn.filters.ClientFilter")
    FILTERS[cls.name] = cls
    return cls


register(BNGuard)


def get(name: str) -> type[ClientFilter]:
    """The filter class of a registered name or a `module:Name` reference."""
    return resolve(name, FILTERS, ClientFilter, "client filter")


def build(name: str, **params) -> ClientFilter:
    """The filter `name` with its parameters; a ValueError names what is allowed."""
    cls = get(name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(f"client filter {cls.name!r} does not take {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(accepted)) or 'no parameters'}")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"client filter {cls.name!r}: {e}") from None
