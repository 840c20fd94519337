"""Seed 002's normalization experiment (Figures 1 and 2): one BN layer on 2-D Gaussian data.

n clients, client i holding class i, whose points follow N(mu_i, s^2 I) with the means on a
circle of radius 10. Each round every client draws a batch; with heterogeneity gamma a
gamma fraction of each batch comes from uniformly random classes (gamma-similarity), the
rest from the client's own class. The modes normalize their clients' batches, and are
compared with centralized BN on the union of the batches.
"""

from __future__ import annotations

import math

import torch

from .protocols import FBN, Naive
from .protocols.fbn import fbn_server_stats

EPS = 1e-5
TOY_MODES = ("naive", "fbn", "fixbn")


def circle_means(n: int, radius: float = 10.0) -> torch.Tensor:
    angles = 2 * math.pi * torch.arange(n, dtype=torch.float64) / n
    return radius * torch.stack([angles.cos(), angles.sin()], 1)


def client_batches(n: int, batch: int, gamma: float, s2: float, generator: torch.Generator) -> torch.Tensor:
    """(n, batch, 2) points: round(gamma * batch) from random classes, the rest from class i."""
    shared = round(gamma * batch)
    own = torch.arange(n, dtype=torch.int64)[:, None].expand(n, batch - shared)
    other = torch.randint(0, n, (n, shared), generator=generator)
    classes = torch.cat([other, own], 1)
    noise = torch.randn(n, batch, 2, generator=generator, dtype=torch.float64)
    return circle_means(n)[classes] + math.sqrt(s2) * noise


def _normalize(x, mean, var):
    return (x - mean) / torch.sqrt(var + EPS)


def normalization_experiment(gamma: float, rounds: int = 100, batch: int = 30, beta: float = 0.1, n: int = 10,
                             seed: int = 0, s2: float = 1.0, fixbn_switch: int | None = None,
                             keep_points: bool = False) -> dict[str, dict]:
    """For each of naive, fbn, fixbn: `norm_error`, the mean Euclidean distance between the
    mode's normalized points and centralized BN's, averaged over rounds (Figure 2c), and
    `stats_gap`, the largest absolute difference between the mode's shared running statistics
    and centralized BN's after the last round. With keep_points, also the last round's
    normalized points ("points", (n, batch, 2)), and "central" with the reference's."""
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    g = torch.Generator().manual_seed(seed)
    switch = rounds // 2 if fixbn_switch is None else fixbn_switch
    k = batch
    count = torch.tensor(float(k), dtype=torch.float64)
    stats = {m: (torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)) for m in (*TOY_MODES, "central")}
    errors = {m: 0.0 for m in TOY_MODES}
    last = {}
    for t in range(1, rounds + 1):
        x = client_batches(n, batch, gamma, s2, g)
        union = x.reshape(-1, 2)
        u_mean, u_var = union.mean(0), union.var(0, correction=0)
        reference = _normalize(x, u_mean, u_var)
        b_mean, b_var = x.mean(1), x.var(1, correction=0)  # per client (n, 2)

        mean, var = stats["central"]
        total = k * n
        stats["central"] = ((1 - beta) * mean + beta * u_mean, (1 - beta) * var + beta * total / (total - 1) * u_var)

        outputs = {}
        # naive, and fixbn before its switch: local batch statistics; server averages running stats
        for mode in ("naive", "fixbn"):
            mean, var = stats[mode]
            if mode == "fixbn" and t > switch:
                outputs[mode] = _normalize(x, mean, var)
                continue
            outputs[mode] = _normalize(x, b_mean[:, None], b_var[:, None])
            m_i, v_i = Naive().client_report(mean, var, b_mean, b_var, count, n, beta)
            stats[mode] = (m_i.mean(0), v_i.mean(0))
        # fbn: shared running statistics, server correction
        mean, var = stats["fbn"]
        outputs["fbn"] = _normalize(x, mean, var)
        m_i, v_i = FBN().client_report(mean, var, b_mean, b_var, count, n, beta)
        stats["fbn"] = fbn_server_stats(m_i, v_i, count, n, beta, lambda m: m.mean(0), lambda v: v.mean(0))

        for mode in TOY_MODES:
            errors[mode] += torch.linalg.vector_norm(outputs[mode] - reference, dim=-1).mean().item() / rounds
        if keep_points:
            last = {**outputs, "central": reference, "raw": x}
    c_mean, c_var = stats["central"]
    result = {}
    for mode in TOY_MODES:
        mean, var = stats[mode]
        gap = torch.cat([(mean - c_mean).abs(), (var - c_var).abs()]).max().item()
        result[mode] = {"norm_error": errors[mode], "stats_gap": gap}
        if keep_points:
            result[mode]["points"] = last[mode]
    if keep_points:
        result["central"] = {"points": last["central"], "raw": last["raw"]}
    return result
