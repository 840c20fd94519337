"""GroupNorm in place of BN (the usual FL workaround): no statistics at all."""

from torch import nn

from .base import WithoutBN


class GroupNormProtocol(WithoutBN):
    name = "gn"
    label = "GroupNorm"

    def norm_layer(self, channels, gn_groups=2):
        return nn.GroupNorm(min(gn_groups, channels), channels)
