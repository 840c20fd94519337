"""Scale-only FBN: FBN's statistics, messages and server, but each layer divides by the shared
standard deviation and subtracts no mean, in training and in evaluation. The test of what
docs/results.md found SF on both statistics doing to FBN: its shared means pushed towards 0,
FBN scaled each channel by a shared sigma without centering it."""

import torch.nn.functional as F

from ..norm import batch_moments
from .fbn import FBN


class ScaleOnlyFBN(FBN):
    name = "fbn-scale"
    label = "scale-only FBN"

    def normalize(self, layer, x):
        batch_mean, batch_var = batch_moments(x)
        return self.normalize_with_running(layer, x), batch_mean, batch_var

    def normalize_with_running(self, layer, x):
        zero = layer.running_mean.new_zeros(layer.running_mean.shape)
        return F.batch_norm(x, zero, layer.running_var.detach(), layer.weight, layer.bias, False, 0.0, layer.eps)
