"""An attack of one's own: every Byzantine client sends the honest mean flipped, rescaled to
the median norm of the honest messages, so that a norm test or a clipping radius sees a
message of ordinary size."""

import torch

import attacks


class NormMatchedFlip(attacks.Attack):
    name = "norm-matched-flip"

    def __init__(self, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"{self.name}: scale must be > 0, got {scale!r}")
        self.scale = float(scale)

    def forge(self, honest, f):
        mean = honest.mean(0)
        size = torch.linalg.vector_norm(honest, dim=1).median()
        flipped = -mean * (self.scale * size / torch.linalg.vector_norm(mean).clamp_min(1e-30))
        return flipped.repeat(f, 1)
