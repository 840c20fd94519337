"""An attack of one's own: every Byzantine client sends the honest mean pushed along the
honest messages' per-coordinate standard deviation, `z` of them (ALIE with a fixed z, and
flipped)."""

import attacks


class MeanMinusZStd(attacks.Attack):
    name = "mean-minus-z-std"

    def __init__(self, z: float = 1.5):
        self.z = float(z)

    def forge(self, honest, f):
        std = honest.std(0, correction=1) if honest.shape[0] > 1 else honest.new_zeros(honest.shape[1])
        return (honest.mean(0) - self.z * std).repeat(f, 1)
