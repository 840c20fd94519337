"""Models of the papers, each with a `norm` switch: a BN protocol (robustbn/protocols/) or its name."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from aggregators.plugins import resolve

from .protocols import Protocol, get


def _protocol(norm) -> Protocol:
    return get(norm)() if isinstance(norm, str) else norm


def make_norm(norm, channels: int, gn_groups: int = 2) -> nn.Module:
    """The normalization layer a protocol (or a registered protocol's name) puts after a
    convolution of `channels` outputs."""
    return _protocol(norm).norm_layer(channels, gn_groups)


def make_conv(norm, *args, **kwargs) -> nn.Module:
    """A convolution (nn.Conv2d's arguments) as the protocol builds it."""
    return _protocol(norm).conv_layer(*args, **kwargs)


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d; in evaluation on a CPU through the channels-last kernel, 4-8x faster than
    the NCHW one on these models' activations (docs/performance.md), with the same values bit
    for bit: a max rounds nothing, and both kernels take a window's first maximum and let NaN
    win alike (tests/test_engine.py). The output is NCHW again, so the next layer runs as
    before. Not in training: with the gradient converted back to NCHW a run was only 2-5%
    faster, not worth a custom backward (measured). Not inside vmap (FedTAN, personalized
    evaluation), which has no memory formats, nor with padding, dilation, ceil_mode or indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = (self.padding in (0, (0, 0)) and self.dilation in (1, (1, 1)) and not self.ceil_mode
                 and not self.return_indices)
        if x.device.type != "cpu" or x.dim() != 4 or not plain or torch.is_grad_enabled():
            return super().forward(x)
        try:
            x = x.contiguous(memory_format=torch.channels_last)
        except RuntimeError:  # inside vmap
            return super().forward(x)
        return super().forward(x).contiguous()


class TableOneCNN(nn.Module):
    """Seed 002, Table 1: four 3x3 convolutions (64, 64, 128, 128), each followed by ReLU then
    the norm layer, max-pooling and dropout 0.25 after the second and fourth, then
    Linear(., 128), ReLU, Linear(128, classes). Sized from the input's channels and side."""

    name = "cnn"

    def __init__(self, norm, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                 gn_groups: int = 2, dropout: float = 0.25):
        super().__init__()
        def block(cin, cout):
            return [make_conv(norm, cin, cout, 3, padding=1), nn.ReLU(), make_norm(norm, cout, gn_groups)]
        self.features = nn.Sequential(
            *block(in_channels, 64), *block(64, 64), MaxPool2d(2), nn.Dropout(dropout),
            *block(64, 128), *block(128, 128), MaxPool2d(2), nn.Dropout(dropout),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * side * side, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class SimpleCNN(nn.Module):
    """Seed 003, Table 7: three blocks Conv(3x3; 16, 32, 64) -> norm -> ReLU -> MaxPool(2),
    then FC(., 128), ReLU, FC(128, classes). No dropout (`dropout` is ignored)."""

    name = "simple-cnn"

    def __init__(self, norm, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                 gn_groups: int = 2, dropout: float = 0.0):
        super().__init__()
        layers, cin = [], in_channels
        for cout in (16, 32, 64):
            layers += [make_conv(norm, cin, cout, 3, padding=1), make_norm(norm, cout, gn_groups), nn.ReLU(),
                       MaxPool2d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        side = image_size // 8
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * side * side, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm, gn_groups: int):
        super().__init__()
        self.conv1 = make_conv(norm, cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(norm, cout, gn_groups)
        self.conv2 = make_conv(norm, cout, cout, 3, padding=1, bias=False)
        self.norm2 = make_norm(norm, cout, gn_groups)
        self.pad = cout - cin  # option A shortcut (He et al. 2016, CIFAR): subsample, zero-pad channels
        self.stride = stride

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    """ResNet-20 for small images (He et al. 2016; seeds 000/001): 3 stages of 3 basic blocks,
    16/32/64 channels, parameter-free shortcuts. No dropout (`dropout` is ignored)."""

    name = "resnet20"

    def __init__(self, norm, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                 gn_groups: int = 2, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(make_conv(norm, in_channels, 16, 3, padding=1, bias=False),
                                  make_norm(norm, 16, gn_groups), nn.ReLU())
        blocks, cin = [], 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(3):
                blocks.append(BasicBlock(cin, cout, 2 if (stage > 0 and i == 0) else 1, norm, gn_groups))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


MODELS: dict[str, type[nn.Module]] = {}


def register(cls: type[nn.Module]) -> type[nn.Module]:
    """Add a model class under its `name` (usable as a decorator). A model is built as
    cls(norm, in_channels, image_size, num_classes, gn_groups=..., dropout=...), and puts its
    normalization layers and convolutions through `make_norm` and `make_conv` so that every
    norm protocol applies to it."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register: {cls!r} is not a subclass of torch.nn.Module")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register: {cls.__name__} needs a class attribute `name` without ':', got {name!r}")
    MODELS[name] = cls
    return cls


for _cls in (TableOneCNN, SimpleCNN, ResNet20):
    register(_cls)


def model_class(name: str) -> type[nn.Module]:
    """The model class of a registered name or a `module:Name` reference."""
    return resolve(name, MODELS, nn.Module, "model")


def build_model(name: str, norm, in_channels: int, image_size: int, num_classes: int,
                gn_groups: int = 2, dropout: float = 0.25) -> nn.Module:
    return model_class(name)(norm, in_channels, image_size, num_classes, gn_groups=gn_groups, dropout=dropout)


def norm_widths(name: str, in_channels: int = 3, image_size: int = 32, num_classes: int = 10) -> tuple[int, ...] | None:
    """The channels of model `name`'s normalization layers (distinct, ascending), read without
    building a layer: the model is made on the meta device (no memory) with a protocol that
    records each width. None when it cannot be made for these input sizes (a user's model may
    need others: its layers are then checked when the run builds it)."""
    return _norm_widths(model_class(name), in_channels, image_size, num_classes)


@functools.lru_cache(maxsize=64)  # per class: scenario files validate the same model hundreds of times
def _norm_widths(cls: type[nn.Module], in_channels: int, image_size: int, num_classes: int) -> tuple[int, ...] | None:
    widths = set()

    class Recorder(Protocol):
        def norm_layer(self, channels, gn_groups=2):
            widths.add(channels)
            return nn.Identity()

    try:
        with torch.device("meta"):
            cls(Recorder(), in_channels, image_size, num_classes, gn_groups=2, dropout=0.0)
    except Exception:  # noqa: BLE001 (any failure of a user's model means: unknown here)
        return None
    return tuple(sorted(widths))
