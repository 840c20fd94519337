"""The attack interface: `attack(honest, f)`, honest messages (h, d) -> f Byzantine messages (f, d).

Attackers are omniscient: they see every honest message of the round. Output keeps the
honest messages' device and dtype. Randomness comes only from an explicit
`torch.Generator` (given, or one per device seeded with `seed`).
"""

from __future__ import annotations

import torch

from aggregators.base import Generated  # noqa: F401 (random attacks: a seed or a generator)
from aggregators.checks import choice, integer, iterations, real  # noqa: F401 (the attacks' parameter checks)


class Attack:
    """Subclasses implement `forge`. Class attributes say what an attack needs from whoever
    builds it (`attacks.build`): `random`, a `seed` (it draws random numbers);
    `needs_pipeline`, the pipeline of the channel it attacks (`pipeline=`); `holds_data`, the
    Byzantine clients' own training data (the engine computes their messages)."""

    name = "attack"
    random = False
    needs_pipeline = False
    holds_data = False
    """True: the Byzantine messages on this channel are computed by the engine from the Byzantine clients' own data."""

    def __call__(self, honest: torch.Tensor, f: int) -> torch.Tensor:
        if not isinstance(honest, torch.Tensor) or honest.dim() != 2 or not honest.is_floating_point():
            got = tuple(honest.shape) if isinstance(honest, torch.Tensor) else type(honest).__name__
            raise ValueError(f"{self.name}: honest messages must be a floating (h, d) tensor, got {got}")
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"{self.name}: f (number of Byzantine messages) must be an integer >= 0, got {f!r}")
        if honest.shape[0] < 1:
            raise ValueError(f"{self.name}: needs at least one honest message, got shape {tuple(honest.shape)}")
        if f == 0:
            return honest.new_empty((0, honest.shape[1]))
        self.check(honest.shape[0], f)
        out = self.forge(honest, f)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (f, honest.shape[1]):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"attack {self.name!r} returned {got}; an attack returns the f Byzantine messages, a "
                             f"tensor of shape (f, d) = ({f}, {honest.shape[1]})")
        return out

    def check(self, h: int, f: int) -> None:
        """Raise a ValueError unless the attack can forge f messages from h honest ones: its
        parameters against the sizes alone (e.g. mimic's target), so that a scenario is
        refused before it runs."""

    def forge(self, honest: torch.Tensor, f: int) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def mean_and_std(honest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-coordinate mean and sample standard deviation (divisor h - 1; 0 when h = 1).

    Two passes by hand: on the CPU, torch.std along the client axis of an (h, d) tensor runs
    about 7x slower (measured at h = 7, d = 99k), and it sat on every round's critical path.
    Half-precision inputs are computed in float32, as torch.std does.
    """
    x = honest.float() if honest.dtype in (torch.float16, torch.bfloat16) else honest
    mean = x.mean(0)
    deviation = x - mean
    var = deviation.mul_(deviation).sum(0) / max(x.shape[0] - 1, 1)  # mul_: vmap batches it, square_ not
    return mean.to(honest.dtype), var.sqrt_().to(honest.dtype)


def working(x: torch.Tensor) -> torch.Tensor:
    """Half-precision messages promoted to float32 for an attack's arithmetic (distances and
    sums overflow at 6.5e4 in float16); other dtypes as they are. Outputs go back with `.to`."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def pipeline_of(attack: str, pipeline):
    """The pipeline an attack aims at: a callable (n, d) -> (d,)."""
    if not callable(pipeline):
        raise ValueError(f"{attack}: pipeline must be a callable (n, d) -> (d,), got {pipeline!r}")
    return pipeline


def repeat(row: torch.Tensor, f: int) -> torch.Tensor:
    """f identical Byzantine messages (a fresh tensor: callers may write into it)."""
    return row.unsqueeze(0).repeat(f, 1)

