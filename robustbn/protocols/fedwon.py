"""FedWon (Zhuang and Lyu, ICLR 2024): no normalization layers; every convolution standardizes
its weights (scaled weight standardization, Brock et al. 2021): per output channel,
W_hat = gain * gamma * (W - mean(W)) / (std(W) sqrt(fan_in)), gain learnable (init 1), gamma
= sqrt(2 / (1 - 1/pi)) the ReLU's constant. Nothing but weights travels, so it is immune to
attacks on statistics by construction: the normalization-free baseline beside `none`.
FedWon also clips gradients adaptively for batch sizes of 1-4; that client optimizer is not
part of this protocol (the testbed's batch sizes are 32-64)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .none import NoNorm

RELU_GAMMA = math.sqrt(2 / (1 - 1 / math.pi))


class WSConv2d(nn.Conv2d):
    """A convolution with scaled weight standardization and a learnable gain per output channel."""

    def __init__(self, *args, eps: float = 1e-4, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.eps = eps

    def standardized_weight(self) -> torch.Tensor:
        fan_in = self.weight[0].numel()
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, correction=0)
        return (self.weight - mean) * torch.rsqrt(var * fan_in + self.eps) * (self.gain * RELU_GAMMA)

    def forward(self, x):
        return F.conv2d(x, self.standardized_weight(), self.bias, self.stride, self.padding, self.dilation, self.groups)


class FedWon(NoNorm):
    name = "fedwon"
    label = "FedWon (WS, no norm)"

    def conv_layer(self, *args, **kwargs) -> nn.Module:
        return WSConv2d(*args, **kwargs)
