"""FixBN (seeds 000/001): naive BN until round T* (`fixbn_switch`, default half the rounds),
then normalize with the statistics frozen at T* (eval-mode BN while training; the affine
parameters stay trainable); after T* the server accepts no statistics."""

from .base import Protocol


class FixBN(Protocol):
    name = "fixbn"
    label = "FixBN"

    def phase(self, t):
        return "frozen" if t > self.switch_round else "train"  # rounds 1..T* run as naive
