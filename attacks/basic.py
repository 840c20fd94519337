"""The classic attacks of the Byzantine ML literature, and hostile values."""

from __future__ import annotations

from statistics import NormalDist

import torch

from .base import Attack, Generated, integer, mean_and_std, real, repeat


class SignFlipping(Attack):
    """SF (Allen-Zhu et al. 2020): every Byzantine client sends -mean(honest)."""

    name = "sf"

    def forge(self, honest, f):
        return repeat(-honest.mean(0), f)


class Honest(Attack):
    """A Byzantine client that behaves honestly on this channel: it holds no data of its own,
    so it sends the mean of the honest messages. Seed 002's SF on the statistics is SF on the
    BN means with `honest` on the BN variances ("only modify the mean")."""

    name = "honest"

    def forge(self, honest, f):
        return repeat(honest.mean(0), f)


class FallOfEmpires(Attack):
    """FOE / inner-product manipulation (Xie et al. 2020): -eps * mean(honest)."""

    name = "foe"

    def __init__(self, eps: float = 0.1):
        self.eps = real(self.name, "eps", eps)

    def forge(self, honest, f):
        return repeat(-self.eps * honest.mean(0), f)


class InnerProductManipulation(FallOfEmpires):
    """IPM, inner-product manipulation (Xie, Koyejo & Gupta, "Fall of Empires: Breaking
    Byzantine-tolerant SGD by Inner Product Manipulation", UAI 2019, PMLR 115, 2020): ByzFL's
    name for FOE, the same message -eps * mean(honest), eps = 0.1. With a small eps > 0 the
    aggregate's inner product with the true gradient turns negative while every Byzantine
    message stays close to the honest ones."""

    name = "ipm"


def alie_z(n: int, f: int) -> float:
    """Baruch et al. (2019): s = floor(n/2 + 1) - f, z = Phi^-1((n - s) / n)."""
    s = n // 2 + 1 - f
    p = (n - s) / n
    if not 0.0 < p < 1.0:
        raise ValueError(f"alie: z = Phi^-1((n - s)/n) is undefined for n={n}, f={f} "
                         f"(s = floor(n/2 + 1) - f = {s}); pass z explicitly")
    return NormalDist().inv_cdf(p)


class ALittleIsEnough(Attack):
    """ALIE (Baruch et al. 2019): mean(honest) - z * std(honest), per coordinate.

    std is the sample standard deviation (Bessel-corrected, divisor h - 1; divisor 1 when
    h = 1, where it is 0). Without z, it is Baruch et al.'s with n = h + f: see `alie_z`.
    """

    name = "alie"

    def __init__(self, z: float | None = None):
        self.z = None if z is None else real(self.name, "z", z)

    def check(self, h, f):
        if self.z is None:
            alie_z(h + f, f)

    def forge(self, honest, f):
        h = honest.shape[0]
        z = alie_z(h + f, f) if self.z is None else self.z
        mean, std = mean_and_std(honest)
        return repeat(mean - z * std, f)


class Gaussian(Attack, Generated):
    """Byzantine messages drawn from N(mean, sigma^2 I); sigma = 200 as in Blanchard et al. 2017."""

    name = "gaussian"
    random = True

    def __init__(self, sigma: float = 200.0, mean: float = 0.0, seed: int = 0,
                 generator: torch.Generator | None = None):
        self.sigma, self.mean = real(self.name, "sigma", sigma, 0.0), real(self.name, "mean", mean)
        self._init_generator(seed, generator)

    def forge(self, honest, f):
        g = self.generator_for(honest.device)
        noise = torch.randn((f, honest.shape[1]), generator=g, device=g.device, dtype=honest.dtype)
        return (self.mean + self.sigma * noise).to(honest.device)


class NaNAttack(Attack):
    """Messages made only of NaN."""

    name = "nan"

    def forge(self, honest, f):
        return torch.full((f, honest.shape[1]), float("nan"), device=honest.device, dtype=honest.dtype)


class InfAttack(Attack):
    """Messages made only of +inf (sign=-1: -inf)."""

    name = "inf"

    def __init__(self, sign: int = 1):
        if isinstance(sign, bool) or sign not in (1, -1):
            raise ValueError(f"inf: sign must be 1 or -1, got {sign!r}")
        self.sign = int(sign)

    def forge(self, honest, f):
        return torch.full((f, honest.shape[1]), self.sign * float("inf"), device=honest.device, dtype=honest.dtype)


class Mimic(Attack):
    """Mimic (Karimireddy et al. 2022): every Byzantine client copies honest message `target`,
    over-weighting one client's data (harmful under heterogeneity)."""

    name = "mimic"

    def __init__(self, target: int = 0):
        self.target = integer(self.name, "target", target, 0)

    def check(self, h, f):
        if self.target >= h:
            raise ValueError(f"{self.name}: target must be the index of an honest message, in [0, h={h}), "
                             f"got {self.target}")

    def forge(self, honest, f):
        return repeat(honest[self.target], f)


class Scaling(Attack):
    """factor * mean(honest). On the `bn_var` channel this is variance deflation (factor << 1:
    every activation of the next layer blows up) or inflation (factor >> 1)."""

    name = "scale"

    def __init__(self, factor: float = 1e-6):
        self.factor = real(self.name, "factor", factor)

    def forge(self, honest, f):
        return repeat(self.factor * honest.mean(0), f)


class LabelFlipping(Attack):
    """Label flipping: the Byzantine clients hold data of their own and send the honest
    message computed on their batch with every label y replaced by C - 1 - y (C classes).

    The messages are computed by the engine from the Byzantine clients' own data
    (`holds_data`): `forge` cannot build them from the honest messages and raises. Outside
    robustbn, compute the gradients on `flip(labels, C)` yourself.
    """

    name = "labelflip"
    holds_data = True

    @staticmethod
    def flip(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """C - 1 - y, elementwise, a new tensor of the labels' dtype and device (no range
        check on the values: that would synchronize with the host)."""
        integer(LabelFlipping.name, "num_classes", num_classes, 1)
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
                or labels.dtype == torch.bool:
            got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ValueError(f"{LabelFlipping.name}: labels must be an integer tensor, got {got}")
        return (num_classes - 1) - labels

    def forge(self, honest, f):
        raise ValueError(f"{self.name}: the Byzantine messages of label flipping are computed by the engine from the "
                         f"Byzantine clients' own data (robustbn does it: gradients on flipped labels), not from the "
                         f"honest messages; outside robustbn, compute the gradients on "
                         f"{type(self).__name__}.flip(labels, num_classes) yourself")
