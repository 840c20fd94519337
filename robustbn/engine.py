"""The federated round: honest clients computed together, three message channels (grad,
bn_mean, bn_var), each attacked and robustly aggregated on its own.

`Federation` holds the server state (weights theta, shared BN statistics), the honest
clients' state (worker momentum, client-local parameters and statistics) and runs DSGD or
FedAvg rounds. Honest clients are computed with one `torch.func.vmap` over
`functional_call` + `grad(..., has_aux=True)` (`vectorized=True`), or with a plain Python
loop over clients (`vectorized=False`), the reference that tests compare against. The
default picks per device: vmap on accelerators, the loop on the CPU, where per-client
weight gradients under vmap run slower than ordinary convolutions (docs/performance.md).
No host synchronization happens inside a round.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import aggregators
import attacks
from attacks.statistics import gaussian_kl

from .data import Dataset, FeatureShift, augment_crop_flip, client_test_splits, index_table, sample_batches
from .filters import build as build_filter
from .models import build_model
from .norm import FedBatchNorm, collect_batch_stats, norm_layers, set_phase
from .protocols import get as get_protocol
from .scenario import Scenario


def _flat(tensors: dict[str, torch.Tensor], lead: int) -> torch.Tensor:
    """Concatenate tensors with `lead` leading batch dims into (..., d)."""
    return torch.cat([t.reshape(*t.shape[:lead], -1) for t in tensors.values()], dim=-1)


def _unflat(vec: torch.Tensor, like: dict[str, torch.Tensor], lead: int) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for k, t in like.items():
        size = math.prod(t.shape[lead:])
        out[k] = vec[..., start : start + size].reshape(*vec.shape[:-1], *t.shape[lead:])
        start += size
    return out


_MEAN = aggregators.build("mean")  # the honest clients' own statistics: the target a BN-aware attack moves away from


def _finite(g: torch.Tensor) -> torch.Tensor:
    """An honest client's gradient with non-finite coordinates zeroed: statistics a hostile
    server state pushed to overflow never reach its momentum or its weights."""
    return torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)


def _sharing_state(pipeline: aggregators.Pipeline, main: aggregators.Pipeline) -> aggregators.Pipeline:
    """`pipeline` with the stateful steps of `main` in place of its own (the same rule at the
    same place): a channel keeps one state (cc's center, cclust's norms) whatever number of
    messages a client filter leaves."""
    def settings(step):  # its public plain values, but f (built for fewer messages) and recording
        return {k: v for k, v in vars(step).items() if not k.startswith("_") and k not in ("f", "recording")
                and isinstance(v, (bool, int, float, str, type(None)))}

    ours, theirs = [*pipeline.pre, pipeline.agg], [*main.pre, main.agg]
    shared = [t if getattr(t, "stateful", False) and type(t) is type(o) and settings(t) == settings(o) else o
              for o, t in zip(ours, theirs)]
    return aggregators.Pipeline(shared[:-1], shared[-1])


class Channel:
    """One message channel: its attack and its robust pipeline. `f` Byzantine clients send on
    it (none when the attack is "none"); the pipeline is built for `agg_f` of them."""

    def __init__(self, attack: str, attack_params: dict, spec: str, agg_params: dict, f: int, seed: int,
                 agg_f: int | None = None):
        self.spec, self.agg_params, self.seed = spec, agg_params, seed
        self.agg_f = f if agg_f is None else agg_f
        # a step or attack that draws random numbers gets this channel's seed unless its
        # parameters set one; an attack that needs the pipeline it attacks gets it
        self.pipeline = aggregators.build(spec, f=self.agg_f, **{"seed": seed, **agg_params})
        # channels with equal keys have interchangeable pipelines (unless they draw random numbers)
        self.key = (spec, repr(sorted(agg_params.items())), self.agg_f)
        # an attack that evaluates the pipeline it attacks sees what the server will run: with
        # FLTrust, the pipeline and this round's reference (`reference`, set by the engine)
        self.reference: torch.Tensor | None = None
        attacked = self.pipeline if not self.pipeline.needs_reference else \
            (lambda x: self.pipeline(x, reference=self.reference))
        self.attack = attacks.build(attack, pipeline=attacked, **{"seed": seed, **attack_params})
        self.f = f
        # the Byzantine messages are computed by the engine from the Byzantine clients' own data
        self.holds_data = bool(getattr(self.attack, "holds_data", False))
        self.searches = bool(getattr(self.attack, "needs_objective", False))  # takes the engine's objective
        self._filtered: dict[int, aggregators.Pipeline] = {}

    @property
    def sends(self) -> bool:
        """Whether the Byzantine clients send on this channel."""
        return self.f > 0 and self.attack is not None

    def messages(self, honest: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
        """What the server receives: the honest messages first, then the f Byzantine ones (`own`:
        what the Byzantine clients computed from their own data, for an attack that holds data).
        With no attack on this channel the Byzantine clients send nothing on it."""
        if not self.sends:
            return honest
        with aggregators.trials(self.pipeline):  # the attack's calls of the pipeline leave its state as it was
            byzantine = own if self.holds_data else self.attack(honest, self.f)
        return torch.cat([honest, byzantine.to(honest.dtype)])

    def pipeline_for(self, m: int, n: int) -> aggregators.Pipeline:
        """The pipeline for m of the n messages left after a client filter: built for agg_f
        Byzantine clients where the rule can run on m messages, else for the most it can."""
        if m == n:
            return self.pipeline
        if m not in self._filtered:
            for f in range(self.agg_f, -1, -1):
                try:
                    params = {"seed": self.seed, **self.agg_params}
                    self._filtered[m] = _sharing_state(aggregators.build(self.spec, f=f, n=m, **params), self.pipeline)
                    break
                except ValueError:
                    continue
            else:
                raise ValueError(f"{self.spec}: cannot aggregate the {m} messages a client filter kept")
        return self._filtered[m]


class Federation:
    def __init__(self, sc: Scenario, data: Dataset, parts: list[np.ndarray], vectorized: bool | None = None,
                 client_chunk: int | None = None):
        """`client_chunk`: vmap over at most that many clients at a time (bounds activation
        memory for hundreds or thousands of clients; the results do not change)."""
        self.sc, self.data, self.client_chunk = sc, data, client_chunk
        self.device = torch.device(sc.device)
        if self.device.type == "cuda":  # one seed, one run: cuDNN's default convolution backward sums with atomics
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        self.vectorized = self.device.type != "cpu" if vectorized is None else vectorized
        self.protocol = get_protocol(sc.norm).for_scenario(sc)
        # rows that compute, in this order: the honest clients (one union-batch client for the
        # centralized reference), the Byzantine clients where they hold data of their own
        # (label flipping), the server on its root set (FLTrust's reference gradient)
        self.honest = 1 if self.protocol.union_batch else sc.honest
        self.byzantine_rows = sc.f if sc.byzantine_hold_data else 0
        self.has_root = sc.root_size is not None
        self.h = self.honest + self.byzantine_rows + int(self.has_root)
        expected = sc.honest if self.protocol.union_batch else self.h
        if len(parts) != expected:
            raise ValueError(f"Federation: {len(parts)} client partitions for {expected} computing clients "
                             f"(robustbn.runner.federation_parts makes them)")
        self.t = 0
        self.measuring = False  # this round's forward passes report BN batch statistics
        torch.manual_seed(sc.seed)  # dropout draws from the global generator (under vmap too)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sc.seed)
            model = build_model(sc.model, self.protocol, data.in_channels, data.image_size, data.num_classes,
                                sc.gn_groups, sc.dropout)
        self.model = model.to(self.device)
        named = norm_layers(self.model)
        self.layers: list[FedBatchNorm] = [m for _, m in named]
        self.layer_names = [name for name, _ in named]
        self.channels_per_layer = [m.weight.shape[0] for m in self.layers]

        params = {k: v.detach() for k, v in self.model.named_parameters()}
        is_local = lambda k: self.protocol.is_local(k, self.layer_names)
        self.theta = {k: v.clone() for k, v in params.items() if not is_local(k)}
        self.local = {k: v.unsqueeze(0).repeat(self.h, *[1] * v.dim()) for k, v in params.items() if is_local(k)}

        # data: padded index tables of the honest clients, sampled on the device
        self.table, self.lengths = index_table(parts, self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(sc.seed)
        self.augment = data.name == "cifar10" if sc.augment is None else sc.augment
        self.shift = FeatureShift(len(parts), data.in_channels, sc.seed) if sc.partition == "feature-shift" else None
        # evaluation data: the global test set, or each client's own test split (FedBN's
        # personalized evaluation; under feature shift, seen through the client's transform)
        self.eval_x, self.eval_y = data.x_test, data.y_test
        self._subset = None  # (size, x, y): eval_subset's examples, gathered once
        if self.protocol.personalized or self.shift is not None:
            splits = torch.as_tensor(client_test_splits(parts[: self.honest], data.y_train.cpu().numpy(),
                                                        data.y_test.cpu().numpy(), data.num_classes, sc.seed),
                                     device=self.device)
            x, y = data.x_test[splits], data.y_test[splits]
            if self.shift is not None:
                x = self.shift(x, torch.Generator(device=self.device).manual_seed(sc.seed + 7))
            self.client_test = (x, y)
            self.eval_x, self.eval_y = x.reshape(-1, *x.shape[2:]), y.reshape(-1)

        # shared statistics (and client-local ones, where the protocol keeps them), flat over all BN layers
        c = sum(self.channels_per_layer)
        self.shared_mean = torch.zeros(c, device=self.device)
        self.shared_var = torch.ones(c, device=self.device)
        if self.protocol.local_statistics:
            self.local_mean = torch.zeros(self.h, c, device=self.device)
            self.local_var = torch.ones(self.h, c, device=self.device)
        self.count = self._values_per_channel()

        self._init_server()
        self.momentum_buf: torch.Tensor | None = None
        self.local_momentum: dict[str, torch.Tensor] = {k: torch.zeros_like(v) for k, v in self.local.items()}
        self.train_loss_sum = torch.zeros((), device=self.device)
        self.train_loss_rounds = 0
        # rounds whose aggregated update had a non-finite coordinate (kept at its old value): a
        # pipeline that returns NaN or inf is survived, and counted so that the run says so
        self.nonfinite_rounds = torch.zeros((), dtype=torch.long, device=self.device)

    def _init_server(self) -> None:
        """The server's channels (attack and pipeline each) and client filter."""
        sc = self.sc
        self.grad_channel, self.mean_channel, self.var_channel = (
            Channel(*sc.channel(name), sc.f, sc.seed + offset, sc.pipeline_f)
            for offset, name in enumerate(("grad", "bn_mean", "bn_var")))
        self.protocol.attach(self.mean_channel, self.var_channel)
        channels = (self.grad_channel, self.mean_channel, self.var_channel)
        self.poison = next((c.attack for c in channels if c.holds_data), None)  # its labels for the Byzantine rows
        self.client_filter = None if sc.client_filter is None else \
            build_filter(sc.client_filter, **(sc.client_filter_params or {}))
        self.kept_history: list[torch.Tensor] = []  # per filtered round, the (n,) mask of clients kept

    @classmethod
    def server_only(cls, sc: Scenario, channels_per_layer: list[int], count: torch.Tensor) -> "Federation":
        """The server half alone, without model or data, for clients that compute elsewhere
        (robustbn.flower): shared statistics, channels, client filter and the server step
        `_exchange`; `count` is K per BN channel. Only the server's methods work on it."""
        self = cls.__new__(cls)
        self.sc, self.device = sc, torch.device(sc.device)
        self.protocol = get_protocol(sc.norm).for_scenario(sc)
        self.byzantine_rows = sc.f if sc.byzantine_hold_data else 0
        self.has_root = sc.root_size is not None
        self.channels_per_layer, self.count = list(channels_per_layer), count.to(self.device)
        self.shared_mean = torch.zeros(sum(self.channels_per_layer), device=self.device)
        self.shared_var = torch.ones(sum(self.channels_per_layer), device=self.device)
        self._init_server()
        return self

    # ---- building blocks -------------------------------------------------------------------

    def _values_per_channel(self) -> torch.Tensor:
        """K per channel (batch x H x W of one client's batch), measured by one dry forward."""
        if not self.layers:
            return torch.zeros(0, device=self.device)
        batch = self.sc.batch_size * (self.sc.honest if self.protocol.union_batch else 1)
        self.set_phase("train")
        with torch.no_grad():
            self.model(torch.zeros(batch, *self.data.x_train.shape[1:], device=self.device))
        for l in self.layers:
            l.batch_stats = None
        return torch.cat([torch.full((c,), float(l.count), device=self.device)
                          for c, l in zip(self.channels_per_layer, self.layers)])

    def _buffers(self, mean: torch.Tensor, var: torch.Tensor) -> dict[str, torch.Tensor]:
        """Running-statistics buffers from flat (..., C) statistics."""
        out = {}
        for name, m, v in zip(self.layer_names, mean.split(self.channels_per_layer, -1),
                              var.split(self.channels_per_layer, -1)):
            out[f"{name}.running_mean"], out[f"{name}.running_var"] = m, v
        return out

    def _forward_loss(self, theta, local, buffers, x, y):
        out = functional_call(self.model, {**theta, **local, **buffers}, (x,))
        loss = F.cross_entropy(out, y)
        if self.measuring:
            return loss, (loss.detach(), *collect_batch_stats(self.layers))
        return loss, (loss.detach(),)

    def _client_grads(self, theta, local, buffers, x, y, theta_batched: bool, buffers_batched: bool):
        """Per-client gradients of the global and local parameters, and the aux outputs."""
        if self.protocol.exchanges_in_forward:
            return self._pooled_grads(theta, local, buffers, x, y, theta_batched, buffers_batched)
        if self.vectorized:
            fn = grad(self._forward_loss, argnums=(0, 1), has_aux=True)
            in_dims = (0 if theta_batched else None, 0, 0 if buffers_batched else None, 0, 0)
            return vmap(fn, in_dims=in_dims, randomness="different", chunk_size=self.client_chunk)(
                theta, local, buffers, x, y)
        results = []
        for i in range(x.shape[0]):
            th = {k: (v[i] if theta_batched else v).detach().requires_grad_() for k, v in theta.items()}
            lo = {k: v[i].detach().requires_grad_() for k, v in local.items()}
            bu = {k: v[i] if buffers_batched else v for k, v in buffers.items()}
            loss, aux = self._forward_loss(th, lo, bu, x[i], y[i])
            g = torch.autograd.grad(loss, list(th.values()) + list(lo.values()), allow_unused=True)
            g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, list(th.values()) + list(lo.values()))]
            results.append((dict(zip(th, g[: len(th)])), dict(zip(lo, g[len(th):])), aux))
        stack = lambda dicts: {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]} if dicts[0] else {}
        grads_theta, grads_local = stack([r[0] for r in results]), stack([r[1] for r in results])
        aux = tuple(torch.stack([r[2][j] for r in results]) for j in range(len(results[0][2])))
        return (grads_theta, grads_local), aux

    def _pooled_grads(self, theta, local, buffers, x, y, theta_batched: bool, buffers_batched: bool):
        """Clients whose forwards pool statistics layer by layer (FedTAN): one vmap over their
        forwards (the BN layers pool across the vmapped dimension; no loop and no chunks, the
        clients are computed together), and one backward of the honest clients' summed loss;
        each client's gradient is with respect to its own copy of the parameters."""
        h = x.shape[0]
        copies = {k: (v if theta_batched else v.expand(h, *v.shape)).detach().clone().requires_grad_()
                  for k, v in theta.items()}
        own = {k: v.detach().requires_grad_() for k, v in local.items()}
        in_dims = (0, 0, 0 if buffers_batched else None, 0, 0)
        losses, aux = vmap(self._forward_loss, in_dims=in_dims, randomness="different")(copies, own, buffers, x, y)
        params = [*copies.values(), *own.values()]
        g = torch.autograd.grad(losses.sum(), params, allow_unused=True)
        g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params)]
        return (dict(zip(copies, g[: len(copies)])), dict(zip(own, g[len(copies):]))), aux

    def _sample(self, clients: torch.Tensor | None = None):
        """(h, batch, ...) inputs and labels: each honest client's mini-batch, through its
        feature-shift transform and the augmentation when those are on."""
        table, lengths = (self.table, self.lengths) if clients is None else (self.table[clients], self.lengths[clients])
        idx = sample_batches(table, lengths, self.sc.batch_size, self.gen)
        x, y = self.data.x_train[idx], self.data.y_train[idx]
        if self.poison is not None:  # the Byzantine clients' rows follow this round's honest ones
            first = len(idx) - self.h + self.honest
            y = torch.cat([y[:first], self.poison.flip(y[first : first + self.byzantine_rows], self.data.num_classes),
                           y[first + self.byzantine_rows :]])
        if self.shift is not None:
            x = self.shift(x, self.gen, clients)
        if self.augment:
            x = augment_crop_flip(x.reshape(-1, *x.shape[2:]), self.gen).reshape(x.shape)
        if self.protocol.union_batch:  # one client holding the union of the honest mini-batches
            x, y = x.reshape(1, -1, *x.shape[2:]), y.reshape(1, -1)
        return x, y

    # ---- the server ------------------------------------------------------------------------

    def _exchange(self, rows: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None, k: int) -> torch.Tensor:
        """One round at the server, from the computed rows (k honest clients first, then the
        Byzantine clients' own rows where they hold data, then the server's on its root set)
        and the clients' statistics reports (None: none sent this round): each channel's
        received messages, the client filter, the aggregated update (returned) and the new
        shared statistics."""
        b = self.byzantine_rows
        reference = self.grad_channel.reference = rows[-1] if self.has_root else None
        grad = self.grad_channel.messages(rows[:k], rows[k : k + b])
        keep = None
        if stats is not None and self.protocol.exchanges_in_forward:  # FedTAN: attacked and pooled in the forward
            self._server_stats(*stats)
        elif stats is not None:
            mean, var = stats
            mean, var = self._bn_messages(mean[:k], var[:k], mean[k : k + b], var[k : k + b])
            if self.client_filter is not None:
                keep = self.client_filter.keep(mean, var, self.channels_per_layer)
                self.kept_history.append(keep)
            self._server_stats(mean, var, keep)
        return self._aggregate(self.grad_channel, grad, keep, reference)

    def _aggregate(self, channel: Channel, messages: torch.Tensor, keep: torch.Tensor | None = None,
                   reference: torch.Tensor | None = None) -> torch.Tensor:
        """The channel's pipeline on the messages a client filter kept (all without one), with the
        server's reference message for a pipeline that needs one (FLTrust)."""
        pipeline = channel.pipeline
        if keep is not None:
            n = len(messages)
            messages = messages[keep[:n]]  # the filter's host sync: how many are kept decides the pipeline
            pipeline = channel.pipeline_for(len(messages), n)
        if reference is not None and getattr(pipeline, "needs_reference", False):
            return pipeline(messages, reference=reference)
        return pipeline(messages)

    def _bn_messages(self, honest_mean, honest_var, own_mean, own_var) -> tuple[torch.Tensor, torch.Tensor]:
        """What the server receives on the two BN channels: each channel's attack on its honest
        messages. An attack that searches statistics (bn-kl) is given the damage its candidates
        do through the pipelines and the protocol's server update; when both channels carry
        one, the means are searched first (the variances honest-looking), then the variances
        given those means."""
        mean_channel, var_channel = self.mean_channel, self.var_channel
        searching = [c for c in (mean_channel, var_channel) if c.searches and c.sends]
        if not searching:
            return mean_channel.messages(honest_mean, own_mean), var_channel.messages(honest_var, own_var)
        f = self.sc.f
        target = self.protocol.server_stats(self.shared_mean, self.shared_var, honest_mean, honest_var, self.count,
                                            self.sc.n, self.sc.bn_momentum, _MEAN, _MEAN)
        var = var_channel.messages(honest_var, own_var) if var_channel not in searching else \
            torch.cat([honest_var, honest_var.mean(0).expand(f, -1)])
        if mean_channel in searching:
            damage = lambda sets: self._damage(sets, var, target, vary="mean")
            mean = torch.cat([honest_mean, mean_channel.attack.forge_against(honest_mean, f, damage)])
        else:
            mean = mean_channel.messages(honest_mean, own_mean)
        if var_channel in searching:
            damage = lambda sets: self._damage(mean, sets, target, vary="var")
            var = torch.cat([honest_var, var_channel.attack.forge_against(honest_var, f, damage)])
        return mean, var

    def _damage(self, mean: torch.Tensor, var: torch.Tensor, target, vary: str) -> torch.Tensor:
        """(G,) divergence of the shared statistics from `target` (the honest clients' own) for
        G candidate message sets of one BN channel (`vary`: (G, m, C)), the other channel's
        messages fixed: attacks.statistics.gaussian_kl, through the real pipelines and update."""
        def update(msg_mean, msg_var):
            with aggregators.trials(self.mean_channel.pipeline, self.var_channel.pipeline):  # candidates: trials
                return self.protocol.server_stats(self.shared_mean, self.shared_var, msg_mean, msg_var, self.count,
                                                  self.sc.n, self.sc.bn_momentum, self.mean_channel.pipeline,
                                                  self.var_channel.pipeline)
        in_dims = (0, None) if vary == "mean" else (None, 0)
        width = mean.shape[-1]  # a rule that draws only at some widths (dnc: d > b) is batched at the others
        channels = (self.mean_channel, self.var_channel)
        if all(c.pipeline.vmappable and not aggregators.draws(c.pipeline, width) for c in channels):
            shared_mean, shared_var = torch.vmap(update, in_dims=in_dims)(mean, var)
        else:  # a pipeline that draws random numbers here or works on the host: one candidate at a time
            sets = mean if vary == "mean" else var
            outs = [update(x, var) if vary == "mean" else update(mean, x) for x in sets]
            shared_mean, shared_var = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
        return gaussian_kl(target[0], target[1], shared_mean, shared_var)

    def _server_stats(self, msg_mean: torch.Tensor, msg_var: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Update the shared statistics by the protocol from the received BN messages (those a
        client filter kept); a coordinate whose update is not finite keeps its old value."""
        agg_mean, agg_var = self.mean_channel.pipeline, self.var_channel.pipeline
        if keep is not None:
            n = len(msg_mean)
            msg_mean, msg_var = msg_mean[keep], msg_var[keep]
            agg_mean = self.mean_channel.pipeline_for(len(msg_mean), n)
            agg_var = self.var_channel.pipeline_for(len(msg_var), n)
        self.shared_mean, self.shared_var = self.protocol.server_stats(
            self.shared_mean, self.shared_var, msg_mean, msg_var, self.count, self.sc.n, self.sc.bn_momentum,
            agg_mean, agg_var, self._together)

    def _together(self, calls):
        """Independent aggregations of the BN channels [(pipeline, messages), ...], in one
        batched call when their pipelines are interchangeable and their message sets have one
        shape; otherwise (different pipelines, a channel whose Byzantine clients send nothing,
        or a pipeline that draws at this width, each from its own generator) one by one."""
        key = {id(c.pipeline): c.key for c in (self.mean_channel, self.var_channel)}
        kind = lambda agg: key.get(id(agg), id(agg))  # a filtered pipeline is interchangeable with itself only
        (first, x0), *_ = calls
        if aggregators.draws(first, x0.shape[-1]) or aggregators.is_stateful(first) or \
                any(kind(agg) != kind(first) or x.shape != x0.shape for agg, x in calls):
            return [agg(x) for agg, x in calls]
        return list(first.stacked(torch.stack([x for _, x in calls])))

    def set_phase(self, phase: str) -> None:
        """Put the BN layers in `phase` ("train", "frozen", "eval"); forward passes report
        their batch statistics (as aux) exactly when the model has BN layers in training."""
        set_phase(self.model, phase)
        self.measuring = bool(self.layers) and phase == "train"

    def _finite_update(self, update: torch.Tensor) -> torch.Tensor:
        """The aggregated update with non-finite coordinates zeroed (their weights stay), counted
        in `nonfinite_rounds` on the device (no host sync)."""
        self.nonfinite_rounds = self.nonfinite_rounds + (~torch.isfinite(update)).any()
        return torch.nan_to_num(update, nan=0.0, posinf=0.0, neginf=0.0)

    def _apply_local(self, grads_local, lr) -> None:
        """DSGD: client-local parameters (FedBN's BN affine, HBN's alpha) take their own
        momentum SGD step, like the weights but without leaving the client."""
        wd, mom = self.sc.weight_decay, self.sc.momentum
        for k, g in grads_local.items():
            g = _finite(g) + wd * self.local[k]
            self.local_momentum[k] = mom * self.local_momentum[k] + (1 - mom) * g
            self.local[k] = self.local[k] - lr * self.local_momentum[k]

    # ---- rounds ----------------------------------------------------------------------------

    def step(self) -> None:
        """One federated round."""
        self.t += 1
        self.set_phase(self.protocol.phase(self.t))
        if self.sc.algorithm == "dsgd":
            self._dsgd_round()
        else:
            self._fedavg_round()
        self.train_loss_rounds += 1

    def _dsgd_round(self) -> None:
        sc, lr = self.sc, self.sc.lr_at(self.t)
        x, y = self._sample()
        local = self.protocol.local_statistics
        buffers = self._buffers(self.local_mean, self.local_var) if local else self._buffers(self.shared_mean, self.shared_var)
        (g_theta, g_local), aux = self._client_grads(self.theta, self.local, buffers, x, y,
                                                     theta_batched=False, buffers_batched=local)
        self.train_loss_sum += aux[0][: self.honest].mean()

        flat_theta = _flat(self.theta, 0)
        g = _finite(_flat(g_theta, 1)) + sc.weight_decay * flat_theta
        if sc.momentum > 0:  # worker momentum, m_0 = 0
            prev = torch.zeros_like(g) if self.momentum_buf is None else self.momentum_buf
            self.momentum_buf = sc.momentum * prev + (1 - sc.momentum) * g
            g = self.momentum_buf
        stats = None
        if self.measuring and local:
            self.local_mean, self.local_var = self.protocol.client_report(
                self.local_mean, self.local_var, aux[1], aux[2], self.count, sc.n, sc.bn_momentum)
        elif self.measuring and self.protocol.sends(self.t):
            stats = self.protocol.client_report(self.shared_mean, self.shared_var, aux[1], aux[2], self.count, sc.n,
                                                sc.bn_momentum)
        update = self._finite_update(self._exchange(g, stats, self.honest))
        self.theta = _unflat(flat_theta - lr * update, self.theta, 0)
        self._apply_local(g_local, lr)

    def _fedavg_round(self) -> None:
        m = max(1, round(self.sc.participation * self.honest))  # honest clients this round; the other rows always
        clients = None
        if m != self.honest:
            clients = torch.randperm(self.honest, generator=self.gen, device=self.device)[:m]
            if self.h > self.honest:
                clients = torch.cat([clients, torch.arange(self.honest, self.h, device=self.device)])
        theta, local, run_mean, run_var, stats, losses = self.local_round(clients)
        for loss in losses:
            self.train_loss_sum += loss[:m].mean() / self.sc.local_steps
        deltas = _flat(theta, 1) - _flat(self.theta, 0)
        update = self._finite_update(self._exchange(deltas, stats, m))
        self.theta = _unflat(_flat(self.theta, 0) + update, self.theta, 0)
        for k, v in local.items():
            if clients is None:
                self.local[k] = v
            else:
                self.local[k][clients] = v
        if self.protocol.local_statistics:
            if clients is None:
                self.local_mean, self.local_var = run_mean, run_var
            else:
                self.local_mean[clients], self.local_var[clients] = run_mean, run_var

    def local_round(self, clients: torch.Tensor | None = None, only: int | None = None):
        """FedAvg's client half: sc.local_steps momentum-SGD steps of the rows `clients` (all:
        None) from the global weights. `only`: compute row `only` alone (a client computing on
        its own, robustbn.flower), every step still drawing all rows' mini-batches so that the
        data generator advances as in the engine. Returns the rows' (weights, local parameters,
        running mean, running var, statistics report or None, [per-step (rows,) losses])."""
        sc, lr = self.sc, self.sc.lr_at(self.t)
        rows = (len(clients) if clients is not None else self.h) if only is None else 1
        pick = (lambda v: v[only : only + 1]) if only is not None else \
            (lambda v: v) if clients is None else (lambda v: v[clients])
        local_stats, sends = self.protocol.local_statistics, self.protocol.sends(self.t)
        theta = {k: v.unsqueeze(0).repeat(rows, *[1] * v.dim()) for k, v in self.theta.items()}
        local = {k: pick(v) for k, v in self.local.items()}
        if local_stats:
            run_mean, run_var = pick(self.local_mean), pick(self.local_var)
        else:
            run_mean = self.shared_mean.expand(rows, -1)
            run_var = self.shared_var.expand(rows, -1)
        shared_buffers = self._buffers(self.shared_mean, self.shared_var)
        measured, losses = None, []
        velocity = {k: torch.zeros_like(v) for k, v in {**theta, **local}.items()}
        for _ in range(sc.local_steps):
            x, y = self._sample(clients)
            if only is not None:
                x, y = x[only : only + 1], y[only : only + 1]
            buffers = self._buffers(run_mean, run_var) if local_stats else shared_buffers
            (g_theta, g_local), aux = self._client_grads(theta, local, buffers, x, y,
                                                         theta_batched=True, buffers_batched=local_stats)
            losses.append(aux[0])
            if self.measuring and not self.protocol.report_each_step and measured is None:
                # a report measured once, under the weights received (HBN): the first local
                # step's forward is that very pass, on a fresh mini-batch
                measured = self.protocol.client_report(run_mean, run_var, aux[1], aux[2], self.count, sc.n,
                                                       sc.bn_momentum)
            for params, grads in ((theta, g_theta), (local, g_local)):
                for k, g in grads.items():
                    velocity[k] = sc.momentum * velocity[k] + _finite(g) + sc.weight_decay * params[k]
                    params[k] = params[k] - lr * velocity[k]
            if self.measuring and self.protocol.report_each_step and (local_stats or sends):
                run_mean, run_var = self.protocol.client_report(run_mean, run_var, aux[1], aux[2], self.count, sc.n,
                                                                sc.bn_momentum)
        stats = None if local_stats or not sends else (measured if measured is not None else (run_mean, run_var))
        return theta, local, run_mean, run_var, stats, losses

    # ---- checkpoints -----------------------------------------------------------------------

    STATE = ("t", "theta", "local", "local_momentum", "momentum_buf", "shared_mean", "shared_var", "local_mean",
             "local_var", "train_loss_sum", "train_loss_rounds", "kept_history", "nonfinite_rounds")

    def _components(self) -> dict[str, object]:
        """What the user may bring, whose state `checkpoint.component_state` finds by walking."""
        return {"channels": [self.grad_channel, self.mean_channel, self.var_channel],
                "filter": self.client_filter, "protocol": self.protocol}

    def state_dict(self) -> dict:
        """Everything a round reads and writes (see checkpoint.py): the weights, momenta,
        client-local parameters and statistics, shared statistics, the round, the data
        generator, every generator and tensor the channels, filter and protocol hold, and
        torch's global generators (dropout draws from them)."""
        from .checkpoint import component_state, rng_state
        return {**{k: getattr(self, k, None) for k in self.STATE}, "gen": self.gen.get_state(),
                "filtered": {i: sorted(c._filtered) for i, c in enumerate(self._components()["channels"])},
                "components": component_state(self._components()), "rng": rng_state(self.device)}

    def load_state_dict(self, state: dict) -> None:
        from .checkpoint import load_component_state, set_rng_state
        to_device = lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else \
            {k: to_device(x) for k, x in v.items()} if isinstance(v, dict) else \
            [to_device(x) for x in v] if isinstance(v, list) else v
        for k in self.STATE:
            if k in state and (state[k] is not None or hasattr(self, k)):
                setattr(self, k, to_device(state[k]))
        self.gen.set_state(state["gen"])
        channels = self._components()["channels"]
        for i, sizes in state["filtered"].items():  # pipelines a client filter needed: built again first
            for m in sizes:
                channels[int(i)].pipeline_for(m, m + 1)
        load_component_state(self._components(), state["components"])
        set_rng_state(state["rng"], self.device)

    # ---- evaluation ------------------------------------------------------------------------

    def evaluate(self, batch: int = 2000, forward_batch: int | None = None, subset: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(test accuracy, test loss) of the global model in evaluation mode (BN layers in their
        eval phase, dropout off), as device tensors; a personalized protocol (FedBN): the mean
        over clients of each client's model on its own test split; under feature shift, on the
        clients' transformed test splits. The loss is summed per `batch` test examples; the
        forward runs `forward_batch` at a time (default: 250 on a CPU, where the activations of
        2000 images overflow the caches and cost 2.4x; the whole batch elsewhere). Each example's
        logits do not depend on the others; the chunks change them by float rounding at most
        (not at all for the models tested: tests/test_engine.py). `subset`: the first `subset`
        examples of a permutation of the test set drawn once from seed 0, the same for every run
        (a global evaluation only)."""
        self.set_phase("eval")
        self.model.eval()  # dropout: the model trains with it and is evaluated without
        try:
            with torch.no_grad():
                if self.protocol.personalized:
                    return self._evaluate_personalized()
                return self._evaluate_global(batch, forward_batch or (100 if self.device.type == "cpu" else batch),
                                             subset)
        finally:
            self.model.train()

    def _evaluate_personalized(self) -> tuple[torch.Tensor, torch.Tensor]:
        def client_eval(lo, bu, x, y):
            out = functional_call(self.model, {**self.theta, **lo, **bu}, (x,))
            return (out.argmax(1) == y).float().mean(), F.cross_entropy(out, y)
        honest = lambda v: v[: self.honest]  # the Byzantine and server rows are not evaluated
        acc, loss = vmap(client_eval)({k: honest(v) for k, v in self.local.items()},
                                      self._buffers(honest(self.local_mean), honest(self.local_var)), *self.client_test)
        return acc.mean(), loss.mean()

    def _evaluate_global(self, batch: int, chunk: int, subset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        params = {**self.theta, **{k: v[0] for k, v in self.local.items()}, **self._buffers(self.shared_mean, self.shared_var)}
        correct = torch.zeros((), device=self.device)
        total_loss = torch.zeros((), device=self.device)
        eval_x, eval_y = self.eval_x, self.eval_y
        if subset is not None and subset < len(eval_y):
            eval_x, eval_y = self._eval_subset(subset)
        for start in range(0, len(eval_y), batch):
            x, y = eval_x[start : start + batch], eval_y[start : start + batch]
            out = torch.cat([functional_call(self.model, params, (x[i : i + chunk],)) for i in range(0, len(x), chunk)])
            correct += (out.argmax(1) == y).sum()
            total_loss += F.cross_entropy(out, y, reduction="sum")
        return correct / len(eval_y), total_loss / len(eval_y)

    def _eval_subset(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `size` test examples of a permutation drawn once from seed 0: gathered at
        the first evaluation that asks, kept for the others."""
        if self._subset is None or self._subset[0] != size:
            pick = torch.randperm(len(self.eval_y), generator=torch.Generator().manual_seed(0))[:size].to(self.device)
            self._subset = (size, self.eval_x[pick], self.eval_y[pick])
        return self._subset[1], self._subset[2]

    def pop_train_loss(self) -> torch.Tensor:
        loss = self.train_loss_sum / max(1, self.train_loss_rounds)
        self.train_loss_sum = torch.zeros((), device=self.device)
        self.train_loss_rounds = 0
        return loss
