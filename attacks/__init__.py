"""Attacks on one message channel: honest (h, d) -> Byzantine (f, d). Depends on torch only.

>>> import torch, attacks
>>> attacks.build("alie")(torch.randn(7, 100), 3).shape
torch.Size([3, 100])
"""

from __future__ import annotations

import inspect

from aggregators.plugins import resolve

from .base import Attack
from .basic import (
    ALittleIsEnough,
    FallOfEmpires,
    Gaussian,
    Honest,
    InfAttack,
    InnerProductManipulation,
    LabelFlipping,
    Mimic,
    NaNAttack,
    Scaling,
    SignFlipping,
    alie_z,
)
from .fang import Fang
from .optimal import Adaptive, OptimalALIE, OptimalFOE
from .search import MinMax, MinSum
from .statistics import StatisticsSearch

ATTACKS: dict[str, type[Attack]] = {}


def register(cls: type[Attack]) -> type[Attack]:
    """Add an attack class under its `name` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Attack)):
        raise TypeError(f"register: {cls!r} is not a subclass of attacks.Attack")
    if not isinstance(cls.name, str) or not cls.name or ":" in cls.name or cls.name != cls.name.lower() \
            or cls.name == "none":
        raise ValueError(f"register: {cls.__name__}.name must be a lower-case name without ':' and not 'none', "
                         f"got {cls.name!r}")
    ATTACKS[cls.name] = cls
    return cls


for _cls in (Honest, SignFlipping, FallOfEmpires, ALittleIsEnough, Gaussian, NaNAttack, InfAttack, Mimic, Scaling,
             OptimalFOE, OptimalALIE, Adaptive, InnerProductManipulation, MinMax, MinSum, Fang, LabelFlipping,
             StatisticsSearch):
    register(_cls)


def names() -> tuple[str, ...]:
    return ("none", *ATTACKS)


def get(name: str) -> type[Attack] | None:
    """The class of the attack `name` (a registered name or a `module:Name` reference); None
    for "none". A ValueError names what is allowed."""
    return resolve(name, {"none": None, **ATTACKS}, Attack, "attack")


def build(name: str, seed: int | None = None, pipeline=None, **params) -> Attack | None:
    """The attack called `name` with its parameters; "none" gives None (no attack).

    `seed` and `pipeline` are offered, taken only by the attacks that declare a use for them:
    one that draws random numbers (`random`) gets `seed` unless `params` sets one; one that
    needs the pipeline it attacks (`needs_pipeline`, e.g. "opt-foe") gets `pipeline`, and
    without it is an error. Unknown names or parameters raise a ValueError saying what is
    allowed.
    """
    cls = get(name)
    if cls is None:
        if params:
            raise ValueError(f"attack 'none' takes no parameters, got {', '.join(sorted(params))}")
        return None
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"} if cls.__init__ is not object.__init__ else set()
    unknown = set(params) - accepted
    if unknown:
        raise ValueError(f"attack {cls.name!r} does not take {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(accepted - {'pipeline'})) or 'no parameters'}")
    if cls.needs_pipeline:
        if pipeline is None:
            raise ValueError(f"attack {cls.name!r} needs pipeline=<the aggregation it attacks>")
        params["pipeline"] = pipeline
    if cls.random and seed is not None and "seed" in accepted:
        params.setdefault("seed", seed)
    try:
        return cls(**params)
    except TypeError as e:  # a user's constructor that does not take what it declares
        raise ValueError(f"attack {cls.name!r}: {e}") from None


__all__ = ["ATTACKS", "Attack", "StatisticsSearch", "build", "get", "names", "register", "alie_z", "SignFlipping", "FallOfEmpires",
           "ALittleIsEnough", "Gaussian", "Honest", "NaNAttack", "InfAttack", "Mimic", "Scaling",
           "OptimalFOE", "OptimalALIE", "Adaptive", "InnerProductManipulation", "MinMax", "MinSum", "Fang",
           "LabelFlipping"]
