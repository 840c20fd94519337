"""The property kit for attacks: on any honest message set, an attack forges f rows of the
honest rows' width, dtype and device, and never writes into the honest messages
(`robustbn check-aggregator NAME --attack` prints the report).

Why here, in robustbn: the checks draw message sets with the aggregators' kit
(`aggregators.testing`) and build attacks from the catalogue, some aimed at a pipeline (a
median), so they need both packages; `aggregators` must not import `attacks` (which imports
`aggregators`), and robustbn is the package above both. Nothing else of robustbn is imported.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import attacks
from aggregators.pipeline import build
from aggregators.testing import Messages, Outcome, message_sets, reproducible


def check_attack(name: str, f: int = 2, examples: int = 50, **params) -> list[Outcome]:
    """The properties an attack must have on any honest message set: f rows of the honest
    rows' width, dtype and device, and no writes into the honest messages."""
    params.setdefault("pipeline", build("median", f=f))  # for an attack that line-searches against one
    attack = attacks.build(name, **params)
    if attack is None:
        return [Outcome("an attack", "not applicable")]
    outcomes = []

    def forged_shape(m: Messages):
        out = attack(m.x, f)
        if out.shape != (f, m.x.shape[1]) or out.dtype != m.x.dtype or out.device != m.x.device:
            raise AssertionError(f"{tuple(out.shape)} {out.dtype} for honest {tuple(m.x.shape)} {m.x.dtype}")

    def honest_not_written(m: Messages):
        before = m.x.clone()
        attack(m.x, f)
        if not torch.equal(m.x, before):
            raise AssertionError("the attack wrote into the honest messages")

    for label, prop in (("f messages of the honest shape, dtype and device", forged_shape),
                        ("honest messages never written", honest_not_written)):
        seen = {}

        @reproducible(examples)
        @given(m=message_sets(n=st.integers(1, 12), f=0, hostile=False))
        def run(m):
            try:
                attack(m.x, f)
            except ValueError:
                assume(False)  # too few honest messages for this attack and f: another draw
            seen["last"] = m
            prop(m)

        try:
            run()
            outcomes.append(Outcome(label, "held"))
        except AssertionError as e:
            outcomes.append(Outcome(label, "failed", repr(seen["last"]), str(e)[:300]))
    return outcomes


__all__ = ["check_attack"]
