"""Attack x defense on synthetic messages: how far each pipeline's output lands from the
honest mean. The message-level core of every experiment, runnable in a second."""

from __future__ import annotations

import torch

import aggregators
import attacks

ATTACKS = ["none", "sf", "foe", "alie", "opt-alie", "gaussian", "nan", "inf"]
DEFENSES = ["mean", "median", "trmean", "nnm+median", "nnm+trmean", "krum", "geomed", "cc"]


def honest_messages(h: int, d: int, spread: float, generator: torch.Generator) -> torch.Tensor:
    """h clients' messages: a common signal (mean norm about 1 per coordinate), each client's
    own offset (heterogeneity, `spread`) and noise."""
    signal = torch.ones(d)
    offsets = spread * torch.randn(h, 1, generator=generator) * torch.randn(1, d, generator=generator)
    return signal + offsets + 0.5 * torch.randn(h, d, generator=generator)


def attack_defense_table(n: int = 10, f: int = 3, d: int = 10_000, spread: float = 1.0,
                         seed: int = 0) -> dict[tuple[str, str], float]:
    """{(attack, defense): relative error |agg - honest mean| / |honest mean|}."""
    everyone = honest_messages(n, d, spread, torch.Generator().manual_seed(seed))
    table = {}
    for defense in DEFENSES:
        pipeline = aggregators.build(defense, f=f, n=n)
        for name in ATTACKS:
            attack = attacks.build(name, pipeline=pipeline) if name.startswith("opt-") else attacks.build(name)
            # "none": all n clients honest; otherwise the last f turn Byzantine.
            honest = everyone if attack is None else everyone[: n - f]
            sent = honest if attack is None else torch.cat([honest, attack(honest, f)])
            target = honest.mean(0)
            error = torch.linalg.vector_norm(pipeline(sent) - target) / torch.linalg.vector_norm(target)
            table[name, defense] = error.item()
    return table


def format_table(table: dict[tuple[str, str], float]) -> str:
    width = max(map(len, DEFENSES)) + 2
    lines = ["attack".ljust(10) + "".join(d.rjust(width) for d in DEFENSES)]
    for a in ATTACKS:
        cells = []
        for d in DEFENSES:
            v = table[a, d]
            cells.append(("nan" if v != v else "inf" if v == float("inf") else f"{v:.3g}").rjust(width))
        lines.append(a.ljust(10) + "".join(cells))
    return "\n".join(lines)
