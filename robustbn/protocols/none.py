"""No normalization layer at all: the same network, the control for how much a BN protocol's
normalization helps or costs."""

from torch import nn

from .base import WithoutBN


class NoNorm(WithoutBN):
    name = "none"
    label = "no normalization"

    def norm_layer(self, channels, gn_groups=2):
        return nn.Identity()
