"""The protocol interface: a BN protocol's client half and server half side by side, as named
hooks the engine calls (as a Flower Strategy keeps the server's decisions in one object).

Statistics travel flat over all BN layers: (C,) per client and channel, C the channels of
every BN layer together. `count` is K per channel (batch x H x W of one client's batch).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..norm import FedBatchNorm, client_running_stats, keep_finite

Aggregate = Callable[[torch.Tensor], torch.Tensor]


def one_by_one(calls: list[tuple[Aggregate, torch.Tensor]]) -> list[torch.Tensor]:
    """Run independent aggregations [(pipeline, messages), ...]; an engine may pass a
    `together` that batches them into one call instead."""
    return [agg(messages) for agg, messages in calls]


class Protocol:
    """Naive BN's behaviour is the default of every hook; a protocol overrides what differs.

    Class attributes say what a protocol is, hooks what it does:
    - `uses_bn`: the model has FedBatchNorm layers (False: GroupNorm, no normalization);
    - `sends_statistics`: BN statistics can reach the server (the bn_mean / bn_var channels);
    - `local_statistics`: each client keeps running statistics of its own, never sent;
    - `union_batch`: one client computes on the union of the honest clients' batches;
    - `personalized`: evaluation is each client's model on its own test split;
    - `report_each_step`: under FedAvg the client's report follows every local step (False:
      the first local step's measurement is the report);
    - `exchanges_in_forward`: the clients' forward passes pool their statistics layer by layer
      (FedTAN): the engine runs them as one vmap and each client's gradient is that of the
      honest clients' summed loss; the BN channels are attacked and aggregated inside that
      forward (`attach`), and the clients' reports are its pooled statistics.
    """

    name = "naive"
    label = "naive BN"  # in words, for legends and tables
    uses_bn = True
    sends_statistics = True
    local_statistics = False
    union_batch = False
    personalized = False
    report_each_step = True
    exchanges_in_forward = False

    def __init__(self, switch_round: int | None = None, hbn_lambda: float = 0.01):
        self.switch_round, self.hbn_lambda = switch_round, hbn_lambda

    @classmethod
    def for_scenario(cls, sc) -> "Protocol":
        return cls(switch_round=sc.switch_round, hbn_lambda=sc.hbn_lambda)

    # ---- scenario ---------------------------------------------------------------------------

    @classmethod
    def check(cls, sc) -> None:
        """Raise a ScenarioError for a scenario this protocol cannot run (fields it needs,
        statistics it does not send, ...). Called by validation, after the common checks."""

    # ---- model ------------------------------------------------------------------------------

    def conv_layer(self, *args, **kwargs) -> nn.Module:
        """A convolution of the model (nn.Conv2d's arguments); FedWon standardizes its weights."""
        return nn.Conv2d(*args, **kwargs)

    def norm_layer(self, channels: int, gn_groups: int = 2) -> nn.Module:
        """The normalization layer after a convolution of `channels` outputs."""
        return FedBatchNorm(channels, self)

    def init_layer(self, layer: nn.Module) -> None:
        """Extra parameters of a FedBatchNorm layer (HBN's alpha)."""

    def is_local(self, param: str, bn_layers: list[str]) -> bool:
        """Whether parameter `param` stays on each client (never aggregated)."""
        return False

    def attach(self, mean_channel, var_channel) -> None:
        """The engine's bn_mean and bn_var channels (attack and pipeline each), for a protocol
        that aggregates statistics inside the forward pass."""

    # ---- client -----------------------------------------------------------------------------

    def phase(self, t: int) -> str:
        """How BN layers run in round t: "train" (normalize per `normalize`, report batch
        statistics) or "frozen" (normalize with the running statistics, report nothing)."""
        return "train"

    def normalize(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A training forward of `layer` on x (N, C, ...): (output, batch mean, biased batch
        variance), the statistics without gradient. Default: the batch's own statistics."""
        count = x.numel() // x.shape[1]
        # with momentum 1 the kernel also writes the batch mean and unbiased variance into
        # these fresh buffers: free, where a separate pass is not
        batch_mean, unbiased_var = x.new_zeros(x.shape[1]), x.new_zeros(x.shape[1])
        out = F.batch_norm(x, batch_mean, unbiased_var, layer.weight, layer.bias, True, 1.0, layer.eps)
        return out, batch_mean, unbiased_var * ((count - 1) / count)

    def normalize_with_running(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A forward of `layer` with its running statistics: evaluation, and FixBN's frozen
        stage. Default: BN in evaluation mode."""
        return F.batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0, layer.eps)

    def variance_factor(self, count: torch.Tensor, n: int) -> torch.Tensor:
        """Bessel factor of a client's running-variance update: K/(K-1), as PyTorch does."""
        return count / (count - 1)

    def client_report(self, prev_mean, prev_var, batch_mean, batch_var, count, n: int, beta: float):
        """What a client reports from its batch statistics (h, C): its running statistics after
        one step from (prev_mean, prev_var), (1-b) prev + b batch, the variance with the
        protocol's Bessel factor. prev_* broadcast against batch_*."""
        return client_running_stats(prev_mean, prev_var, batch_mean, batch_var, self.variance_factor(count, n), beta)

    def sends(self, t: int) -> bool:
        """Whether clients send statistics to the server in round t."""
        return self.sends_statistics and self.phase(t) == "train"

    # ---- server -----------------------------------------------------------------------------

    def server_update(self, shared_mean, shared_var, msg_mean, msg_var, count, n: int, beta: float,
                      agg_mean: Aggregate, agg_var: Aggregate, together=one_by_one):
        """New shared statistics from the received messages (m, C) of each BN channel, each
        channel's pipeline in place of every average (before the engine's sanitizing).
        Default: mu = Agg_mean(mu_i), var = Agg_var(var_i)."""
        mean, var = together([(agg_mean, msg_mean), (agg_var, msg_var)])
        return mean, var

    def server_stats(self, shared_mean, shared_var, msg_mean, msg_var, count, n: int, beta: float,
                     agg_mean: Aggregate, agg_var: Aggregate, together=one_by_one):
        """`server_update`, sanitized: a coordinate whose update is not finite keeps its old
        value; variances are floored at 0 (hostile statistics never reach the model)."""
        mean, var = self.server_update(shared_mean, shared_var, msg_mean, msg_var, count, n, beta, agg_mean,
                                       agg_var, together)
        return keep_finite(mean, shared_mean), keep_finite(var, shared_var, floor=0.0)


class WithoutBN(Protocol):
    """A network without BN layers (GroupNorm, no normalization): no statistics to measure or send."""

    uses_bn = False
    sends_statistics = False
