"""BN protocols, one file each: how a BN layer normalizes on a client, which parameters stay
there, what statistics a client sends, how the server combines them, what evaluation uses
(robustbn/protocols/base.py has the hooks). A registry maps names to classes; a new protocol
is one file and one line below, or `@register` on a class of one's own."""

from __future__ import annotations

from aggregators.plugins import resolve

from .base import Protocol
from .central import Central
from .fbn import FBN
from .fbn_scale import ScaleOnlyFBN
from .fedbn import FedBN
from .fedtan import FedTAN
from .fedwon import FedWon
from .fixbn import FixBN
from .gn import GroupNormProtocol
from .hbn import HBN
from .naive import Naive
from .none import NoNorm
from .silobn import SiloBN

PROTOCOLS: dict[str, type[Protocol]] = {}


def register(cls: type[Protocol]) -> type[Protocol]:
    """Add a protocol class to the registry under its `name` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Protocol)):
        raise TypeError(f"register: {cls!r} is not a subclass of robustbn.protocols.Protocol")
    PROTOCOLS[cls.name] = cls
    return cls


for _cls in (Naive, FBN, FixBN, HBN, FedBN, Central, GroupNormProtocol, NoNorm, ScaleOnlyFBN, SiloBN, FedTAN, FedWon):
    register(_cls)


def get(name: str) -> type[Protocol]:
    """The protocol class of a registered name or a `module:Name` reference."""
    return resolve(name, PROTOCOLS, Protocol, "norm protocol")


def names(**having) -> tuple[str, ...]:
    """Registered protocol names, those whose class attributes equal `having` (e.g. uses_bn=False)."""
    return tuple(n for n, c in PROTOCOLS.items() if all(getattr(c, k) == v for k, v in having.items()))


__all__ = ["PROTOCOLS", "Protocol", "get", "names", "register", "Naive", "FBN", "FixBN", "HBN", "FedBN", "Central",
           "GroupNormProtocol", "NoNorm", "ScaleOnlyFBN", "SiloBN", "FedTAN", "FedWon"]
