"""Attacks on one message channel: honest (h, d) -> Byzantine (f, d). Depends on torch only.

>>> import torch, attacks
>>> attacks.build("alie")(torch.randn(7, 100), 3).shape
torch.Size([3, 100])
"""

from __future__ import annotations

import inspect

from .base import Attack
from .basic import (
    ALittleIsEnough,
    FallOfEmpires,
    Gaussian,
    Honest,
    InfAttack,
    Mimic,
    NaNAttack,
    Scaling,
    SignFlipping,
    alie_z,
)
from .optimal import OptimalALIE, OptimalFOE

ATTACKS = {c.name: c for c in (Honest, SignFlipping, FallOfEmpires, ALittleIsEnough, Gaussian, NaNAttack,
                               InfAttack, Mimic, Scaling, OptimalFOE, OptimalALIE)}
NAMES = ("none", *ATTACKS)


def build(name: str, **params) -> Attack | None:
    """The attack called `name` with its parameters; "none" gives None (no attack).

    Line-searched attacks ("opt-foe", "opt-alie") need `pipeline=`, the aggregation they
    attack. Unknown names or parameters raise a ValueError saying what is allowed.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "none":
        if params:
            raise ValueError(f"attack 'none' takes no parameters, got {', '.join(sorted(params))}")
        return None
    if key not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; allowed: {', '.join(NAMES)}")
    cls = ATTACKS[key]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"} if cls.__init__ is not object.__init__ else set()
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(f"attack {key!r} does not take {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(accepted)) or 'no parameters'}")
    if "pipeline" in accepted and "pipeline" not in params:
        raise ValueError(f"attack {key!r} needs pipeline=<the aggregation it attacks>")
    return cls(**params)


__all__ = ["ATTACKS", "NAMES", "Attack", "build", "alie_z", "SignFlipping", "FallOfEmpires",
           "ALittleIsEnough", "Gaussian", "Honest", "NaNAttack", "InfAttack", "Mimic", "Scaling",
           "OptimalFOE", "OptimalALIE"]
