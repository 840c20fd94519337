"""Fang et al.'s full-knowledge attacks (Fang, Cao, Jia & Gong, "Local Model Poisoning Attacks
to Byzantine-Robust Federated Learning", USENIX Security 2020), in gradient space.

The paper crafts local *models*; here messages are gradients and the server steps
theta - lr * aggregate, so "the direction the global parameter would change without attack"
(the paper's s_j) is -sign(mean honest gradient). Both variants below are written with
s = sign(sum of the honest messages) = sign(mean honest) and push against it.

Checked against the MXNet `trim_attack` found in many public copies of the authors' group's
FLTrust code (gradients; direction = sign(sum), directed_dim = min where direction > 0, max
where < 0, values directed_dim / r where direction * directed_dim > 0, directed_dim * r where
< 0, r ~ U[1, 2]: the same case analysis) and against the ports by Shejwalkar & Houmansadr
(github.com/vrt1shjwlkr/NDSS21-Model-Poisoning, cifar10/release-fedsgd-alexnet-trmean.ipynb
`get_malicious_updates_fang_trmean`; cifar10/release-fedsgd-alexnet-mkrum.ipynb
`compute_lambda_fang`, `get_malicious_updates_fang`) and Blades
(lishenghui/blades, `FangattackAdversary`), which draw uniformly in the paper's intervals, as
done here.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .base import Attack, Generated, choice, integer, pipeline_of, real, repeat, working

Aggregate = Callable[[torch.Tensor], torch.Tensor]
RULES = ("auto", "trim", "krum")
# elements (candidates x n x d) evaluated in one stacked pipeline call; more go in chunks
STACK_BUDGET = 1 << 26


def auto_rule(pipeline) -> str:
    """"krum" when the pipeline's aggregator step selects rows by a distance score (its class
    attribute `selects_by_score`: krum, multikrum), else "trim" (a plain function: "trim")."""
    return "krum" if getattr(getattr(pipeline, "agg", None), "selects_by_score", False) else "trim"


class Fang(Attack, Generated):
    """Fang et al. (USENIX Security 2020), full knowledge, gradient space; s = sign(sum_i g_i)
    per coordinate over the h honest messages g.

    rule="trim" (their attack on trimmed mean and median): per coordinate j, let e_j be the
    honest extreme opposite to s_j (the minimum where s_j > 0, the maximum where s_j < 0).
    Each of the f Byzantine values is drawn uniformly (its own draw per message and
    coordinate, from the seeded generator) between e_j and
        e_j / b   where s_j * e_j > 0   (e_j on s_j's side of 0: shrink towards 0),
        e_j * b   where s_j * e_j < 0   (grow away from 0),
    b = 2; every value lies beyond the honest extreme, against s, within the factor b. Where
    s_j = 0 or e_j = 0 the value is 0 (the authors' code gives 0 there).

    rule="krum" (their attack on Krum): all f Byzantine clients send m = -lambda * s, with
    lambda the largest of lambda_0 / 2^k, k = 0..`halvings` (20), for which the attacked
    pipeline's output equals m (max_j |out_j - m_j| <= 1e-3 * lambda); if none does, the
    smallest. All candidates are aggregated in one stacked call, no data-dependent loop.
    lambda_0 is the paper's upper bound translated to gradients (a local model is
    theta - lr * g_i, so D(w_i, w_Re) = lr * ||g_i||):
        lambda_0 = min_i sum_{l in N_i} ||g_l - g_i|| / ((h - f - 1) sqrt(d))
                   + max_i ||g_i|| / sqrt(d),
    N_i the h - f - 2 honest messages nearest g_i (the paper's m - 2c - 2 with m = h + f,
    c = f); the first term is 0 when h - f - 2 < 1. (Shejwalkar & Houmansadr's and Blades'
    ports measure the second term from the honest mean, max_i ||g_i - mean||.) The chosen
    lambda is `last_factor`. Success means the output *is* m: against Krum that is Krum
    picking a Byzantine message; against Multi-Krum (an average of several rows) or a pipeline
    whose pre-aggregators mix rows it rarely holds, and the attack falls back to the smallest
    lambda.

    rule="auto" (default): "krum" when the pipeline's aggregator step selects rows by a score
    (`selects_by_score`: krum, multikrum), else "trim"; a plain function as pipeline means "trim".
    """

    name = "fang"
    random = True
    needs_pipeline = True

    def __init__(self, pipeline: Aggregate, rule: str = "auto", b: float = 2.0, halvings: int = 20, seed: int = 0,
                 generator: torch.Generator | None = None):
        self.pipeline = pipeline_of(self.name, pipeline)
        self.rule = choice(self.name, "rule", rule, RULES)
        self.b = real(self.name, "b", b, 1.0)
        self.halvings = integer(self.name, "halvings", halvings, 0, 64)
        self._init_generator(seed, generator)
        self._rule = auto_rule(pipeline) if rule == "auto" else rule

    def forge(self, honest, f):
        return self._trim(honest, f) if self._rule == "trim" else self._krum(honest, f)

    def _trim(self, honest, f):
        x = working(honest)
        s = torch.sign(x.sum(0))
        low, high = torch.aminmax(x, dim=0)
        extreme = torch.where(s > 0, low, high)
        far = torch.where(s * extreme > 0, extreme / self.b, extreme * self.b)
        g = self.generator_for(honest.device)
        u = torch.rand((f, x.shape[1]), generator=g, device=g.device, dtype=x.dtype).to(x.device)
        out = extreme + u * (far - extreme)
        return torch.where(s == 0, torch.zeros_like(out), out).to(honest.dtype)

    def lambda_0(self, x: torch.Tensor, f: int) -> torch.Tensor:
        """The paper's upper bound on lambda (see the class docstring), a 0-dim tensor."""
        h, d = x.shape
        k = h - f - 2
        second = torch.linalg.vector_norm(x, dim=1).max() / math.sqrt(d)
        if k < 1:
            return second
        centered = x - x.mean(0)  # distances do not change; less cancellation in the Gram form
        sq = (centered * centered).sum(1)
        dist = (sq[:, None] + sq[None, :] - 2.0 * (centered @ centered.T)).clamp_min(0.0).sqrt()
        dist = dist.masked_fill(torch.eye(h, dtype=torch.bool, device=x.device), float("inf"))
        nearest = dist.sort(dim=1).values[:, :k].sum(1)
        return nearest.min() / ((h - f - 1) * math.sqrt(d)) + second

    def _aggregate(self, batch: torch.Tensor) -> torch.Tensor:
        stacked = getattr(self.pipeline, "stacked", None)
        if callable(stacked):
            return stacked(batch)
        return torch.stack([self.pipeline(messages) for messages in batch])

    def _krum(self, honest, f):
        x = working(honest)
        h, d = x.shape
        s = torch.sign(x.mean(0))
        lambdas = self.lambda_0(x, f) * torch.pow(
            torch.tensor(0.5, dtype=x.dtype, device=x.device),
            torch.arange(self.halvings + 1, dtype=x.dtype, device=x.device))
        crafted = (-lambdas[:, None] * s).to(honest.dtype)                   # (K + 1, d)
        chunk = max(1, STACK_BUDGET // max(1, (h + f) * d))
        outputs = []
        for start in range(0, self.halvings + 1, chunk):                    # sizes only, no data
            c = crafted[start:start + chunk]
            batch = torch.cat([honest.unsqueeze(0).expand(c.shape[0], h, d),
                               c.unsqueeze(1).expand(c.shape[0], f, d)], dim=1)
            outputs.append(self._aggregate(batch))
        out = torch.cat(outputs)
        gap = (working(out) - working(crafted)).abs().amax(dim=1)
        ok = gap <= 1e-3 * lambdas
        last = torch.full((), self.halvings, dtype=torch.long, device=x.device)
        best = torch.where(ok.any(), ok.int().argmax(), last)    # first success = largest lambda
        self.last_factor = lambdas[best]  # a tensor: reading it is the caller's sync, not ours
        return repeat(crafted[best], f)


__all__ = ["Fang", "auto_rule"]
