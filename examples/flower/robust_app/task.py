"""The Flower user's own code, untouched by robustbn: a small CNN with nn.BatchNorm2d,
Fashion-MNIST loading and partitioning, and the train and test loops."""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist: the gzipped idx files


class Net(nn.Module):
    """Two convolutions, each followed by BatchNorm, then a linear classifier (28 x 28 grey images)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def _idx(path: Path) -> np.ndarray:
    """An idx file (MNIST's format): a header with the dimensions, then uint8 values."""
    with gzip.open(path) as f:
        raw = f.read()
    ndim = raw[3]
    shape = np.frombuffer(raw, ">u4", ndim, offset=4)
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


@lru_cache(maxsize=2)
def load_all(data_dir: str) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): standardized images (N, 1, 28, 28) and int64 labels.
    data_dir "": synthetic images instead (each class a fixed pattern plus noise), to run anywhere."""
    if not data_dir:
        g = torch.Generator().manual_seed(0)
        patterns = F.interpolate(torch.randn(10, 1, 7, 7, generator=g), size=(28, 28), mode="bilinear")

        def draw(n):
            y = torch.randint(0, 10, (n,), generator=g)
            return patterns[y] + torch.randn(n, 1, 28, 28, generator=g), y
        return (*draw(6000), *draw(1000))
    folder = Path(data_dir)

    def images(split):
        x = torch.from_numpy(_idx(folder / f"{split}-images-idx3-ubyte.gz").copy()).float().div(255).unsqueeze(1)
        return (x - 0.2860) / 0.3530

    def labels(split):
        return torch.from_numpy(_idx(folder / f"{split}-labels-idx1-ubyte.gz").astype(np.int64))
    return images("train"), labels("train"), images("t10k"), labels("t10k")


def load_partition(partition_id: int, num_partitions: int, data_dir: str, size: int) -> tuple[torch.Tensor, ...]:
    """Client `partition_id`'s share (IID) of the training and test sets, at most `size` of each."""
    x, y, x_test, y_test = load_all(data_dir)
    part = slice(partition_id, None, num_partitions)
    return x[part][:size], y[part][:size], x_test[part][:size], y_test[part][:size]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int, lr: float,
          seed: int) -> float:
    """SGD with momentum over the client's data; the mean training loss."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            if len(idx) < batch_size:  # full batches only: FBN's server assumes K values per channel
                continue
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return sum(losses) / max(1, len(losses))


def test(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of the model in evaluation mode."""
    model.eval()
    with torch.no_grad():
        out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()
