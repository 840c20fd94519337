"""Datasets as device tensors, and partitions of the training set among honest clients.

Sampling a mini-batch is index arithmetic on the device (no DataLoader in the round).
"""

from __future__ import annotations

import gzip
import inspect
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from aggregators.plugins import resolve

PARTITIONS = ("iid", "gamma", "dirichlet", "shards", "feature-shift")
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "robustbn"

# channel mean and std of each training set (inputs are standardized with them)
STATS = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class DataError(RuntimeError):
    """A dataset cannot be found or read; the message says where it looked and what to do."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor  # (N, C, H, W) float, standardized
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def in_channels(self) -> int:
        return self.x_train.shape[1]

    @property
    def image_size(self) -> int:
        return self.x_train.shape[-1]


def _standardize(x_uint8: torch.Tensor, name: str) -> torch.Tensor:
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in STATS[name])
    return (x_uint8.float() / 255.0 - mean) / std


def _candidate_dirs(data_dir: str | os.PathLike | None) -> list[Path]:
    """The directories a dataset is read from (or downloaded into, the first): a given
    `data_dir` alone, which must exist; else $ROBUSTBN_DATA if set. A given directory is never
    replaced by a default location: that would run on other data than the one asked for."""
    if data_dir is None:
        return [Path(os.environ["ROBUSTBN_DATA"])] if os.environ.get("ROBUSTBN_DATA") else []
    if not isinstance(data_dir, (str, os.PathLike)) or not str(data_dir) or not Path(data_dir).is_dir():
        raise DataError(f"data_dir: no such directory: {data_dir!r} (leave data_dir out for the default locations)")
    return [Path(data_dir)]


def _mnist_like_root(folder: str, search: list[Path]) -> Path | None:
    """A torchvision root (ROOT/<folder>/raw/<files>) holding the four idx files, made from
    the first searched directory that has them (gzipped or not, flat or torchvision-style)."""
    for d in search:
        for raw in (d, d / folder / "raw"):
            if all((raw / f).exists() for f in MNIST_FILES):
                return raw.parent.parent if raw.name == "raw" else _mirror(raw, folder, gz=False)
            if all((raw / f"{f}.gz").exists() for f in MNIST_FILES):
                return _mirror(raw, folder, gz=True)
    return None


def _mirror(src: Path, folder: str, gz: bool) -> Path:
    """Uncompressed copies in the cache (one folder per source directory), laid out as
    torchvision's loader expects."""
    import hashlib

    key = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:16]
    raw = cache_dir() / "torchvision" / key / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for f in MNIST_FILES:
        if not (raw / f).exists():
            # a temporary file of this process's own, then an atomic replace: `--jobs` workers
            # may fill the same cache at the same time
            with (gzip.open(src / f"{f}.gz") if gz else open(src / f, "rb")) as fin, \
                    tempfile.NamedTemporaryFile("wb", dir=raw, prefix=f"{f}.", suffix=".tmp", delete=False) as fout:
                shutil.copyfileobj(fin, fout)
            os.replace(fout.name, raw / f)
    return raw.parent.parent


def _load_torchvision(name: str, data_dir) -> tuple[torch.Tensor, ...]:
    import torchvision

    cls = {"fashion-mnist": torchvision.datasets.FashionMNIST, "mnist": torchvision.datasets.MNIST,
           "cifar10": torchvision.datasets.CIFAR10}[name]
    chosen = _candidate_dirs(data_dir)
    # Debian's copy is a default location: read only when no data_dir is given
    search = chosen + ([DEBIAN_FASHION_MNIST] if name == "fashion-mnist" and data_dir is None else [])
    if name == "cifar10":
        root = next((d for d in search if (d / "cifar-10-batches-py").is_dir()), None)
    else:
        root = _mnist_like_root(cls.__name__, search)
    if root is None:
        root = chosen[0] if chosen else cache_dir() / "torchvision"
        try:
            train, test = cls(root, train=True, download=True), cls(root, train=False, download=True)
        except Exception as e:  # offline, or a broken file
            looked = ", ".join(str(p) for p in (search or [root]))
            hint = " or `apt-get install dataset-fashion-mnist`" if name == "fashion-mnist" else ""
            raise DataError(f"dataset {name!r}: not found in {looked}, and the download into {root} failed "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}). "
                            f"Put the torchvision files there, or point --data-dir / $ROBUSTBN_DATA at "
                            f"a directory holding them{hint}.") from None
    else:
        try:
            train, test = cls(root, train=True, download=False), cls(root, train=False, download=False)
        except Exception as e:
            raise DataError(f"dataset {name!r}: the files in {root} cannot be read ({type(e).__name__}: {e}). "
                            f"Replace them with torchvision's files.") from None
    def tensors(ds):
        x = torch.as_tensor(np.asarray(ds.data))
        x = x.permute(0, 3, 1, 2) if x.dim() == 4 else x.unsqueeze(1)
        return _standardize(x, name), torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
    return (*tensors(train), *tensors(test))


def synthetic_images(n_train: int = 2000, n_test: int = 500, num_classes: int = 10, size: int = 16,
                     channels: int = 1, noise: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Small learnable image data for fast tests: each class a fixed random smooth template,
    each image its class's template plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, size // 4, size // 4, generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    def draw(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        return templates[y] + noise * torch.randn(n, channels, size, size, generator=g), y
    return (*draw(n_train), *draw(n_test))


def _not_a_loader(obj) -> str | None:
    """Why `obj` is not a dataset loader (a function data_dir -> Dataset), or None. A class is
    one only as a Dataset subclass built from data_dir (a model class is a common slip)."""
    reason = "is not a function data_dir -> robustbn.data.Dataset"
    if not callable(obj) or (isinstance(obj, type) and not issubclass(obj, Dataset)):
        return reason
    try:
        inspect.signature(obj).bind(None)
    except TypeError:
        return f"{reason} (it cannot be called with one argument, data_dir)"
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return None


DATASETS: dict[str, Callable] = {}
TRAIN_SIZES: dict[str, int] = {}  # training examples of a registered dataset, where known
CLASSES: dict[str, int] = {}  # classes of a registered dataset, where known: a diverged run counts at chance


def register_dataset(name: str, train_size: int | None = None, num_classes: int | None = None):
    """Decorator: register `load(data_dir) -> Dataset` (tensors anywhere; standardized images
    (N, C, H, W) float, labels int64) under `name`, a valid `dataset` from then on. With
    `train_size` (its training examples), scenarios that cannot give every client data are
    refused before loading it; with `num_classes`, a diverged run of it counts at chance,
    1 / num_classes, in every result view (robustbn.stats.accuracy; unknown: 0)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_dataset: the name must be a non-empty string without ':', got {name!r}")
    if train_size is not None and (isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 1):
        raise ValueError(f"register_dataset: train_size must be an integer >= 1 or None, got {train_size!r}")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2):
        raise ValueError(f"register_dataset: num_classes must be an integer >= 2 or None, got {num_classes!r}")
    def add(load):
        if (why := _not_a_loader(load)) is not None:
            raise TypeError(f"register_dataset: {load!r} {why}")
        DATASETS[name] = load
        TRAIN_SIZES.pop(name, None)
        CLASSES.pop(name, None)
        if train_size is not None:
            TRAIN_SIZES[name] = train_size
        if num_classes is not None:
            CLASSES[name] = num_classes
        return load
    return add


for _name, _size in (("fashion-mnist", 60000), ("mnist", 60000), ("cifar10", 50000)):
    register_dataset(_name, _size, num_classes=10)(lambda data_dir, _name=_name: Dataset(_name, *_load_torchvision(_name, data_dir),
                                                                         num_classes=10))
register_dataset("synthetic-images", 2000, num_classes=10)(
    lambda data_dir: Dataset("synthetic-images", *synthetic_images(), num_classes=10))


def num_classes(name: str) -> int | None:
    """The classes of dataset `name` without loading it; None where unknown."""
    return CLASSES.get(name) if isinstance(name, str) else None


def train_size(name: str) -> int | None:
    """The number of training examples of dataset `name` without loading it; None where
    unknown (a `module:Name` dataset, one registered without a size)."""
    return TRAIN_SIZES.get(name) if isinstance(name, str) else None


def dataset_loader(name: str) -> Callable:
    """The loader of a registered dataset name or of a `module:Name` reference (a callable
    data_dir -> Dataset)."""
    return resolve(name, DATASETS, _not_a_loader, "dataset")


def load_dataset(name: str, data_dir=None, device: str | torch.device = "cpu") -> Dataset:
    data = dataset_loader(name)(data_dir)
    if not isinstance(data, Dataset):
        raise DataError(f"dataset {name!r}: its loader returned {type(data).__name__}, not a robustbn.data.Dataset")
    return Dataset(data.name, *(t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test)),
                   num_classes=data.num_classes)


# ---- partitions ----------------------------------------------------------------------------

def partition(labels: np.ndarray, clients: int, kind: str = "iid", gamma: float = 0.0, alpha: float = 0.5,
              seed: int = 0, shards: int = 2) -> list[np.ndarray]:
    """Disjoint index arrays, one per honest client, reproducible from `seed`.

    iid: a shuffle cut in equal parts. gamma (seed 002): a gamma fraction of the data is shared
    iid, the rest is sorted by label and cut into consecutive chunks; clients are equal-sized
    (the remainder is dropped); gamma = 0 is the extreme non-iid case. dirichlet (Hsu et al.
    2019): each class is split among clients by proportions drawn from Dir(alpha), redrawn
    until every client holds at least 2 examples. shards (McMahan et al. 2017, seed 000): the
    label-sorted data cut into clients x `shards` equal shards, `shards` random ones per
    client, so each client holds about `shards` classes. feature-shift (seed 004): labels iid;
    each client's images then go through its own fixed transform (`FeatureShift`).
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    n = len(labels)
    if kind in ("iid", "feature-shift"):
        per = n // clients
        return list(rng.permutation(n)[: per * clients].reshape(clients, per))
    if kind == "gamma":
        perm = rng.permutation(n)
        per = n // clients
        shared_per = int(round(gamma * per))
        shared = perm[: shared_per * clients].reshape(clients, shared_per)
        rest = perm[shared_per * clients :]
        rest = rest[np.argsort(labels[rest], kind="stable")][: (per - shared_per) * clients]
        sorted_chunks = rest.reshape(clients, per - shared_per)
        return [np.concatenate([shared[i], sorted_chunks[i]]) for i in range(clients)]
    if kind == "dirichlet":
        classes = np.unique(labels)
        for _ in range(1000):
            parts = [[] for _ in range(clients)]
            for c in classes:
                idx = rng.permutation(np.flatnonzero(labels == c))
                cuts = (np.cumsum(rng.dirichlet(np.full(clients, alpha)))[:-1] * len(idx)).astype(int)
                for i, chunk in enumerate(np.split(idx, cuts)):
                    parts[i].append(chunk)
            out = [np.concatenate(p) for p in parts]
            if min(map(len, out)) >= 2:
                return out
        raise ValueError(f"dirichlet partition: alpha={alpha} leaves some of {clients} clients nearly empty "
                         f"after 1000 draws; use a larger alpha or fewer clients")
    if kind == "shards":
        total = clients * shards
        per = n // total
        if per < 1:
            raise ValueError(f"shards partition: {n} examples cannot make {clients} x {shards} shards")
        order = rng.permutation(n)
        order = order[np.argsort(labels[order], kind="stable")][: per * total].reshape(total, per)
        owners = rng.permutation(total).reshape(clients, shards)
        return [order[o].ravel() for o in owners]
    raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, got {kind!r}")


def split_root(n: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(root, rest): `size` indices of n drawn uniformly without replacement for the server's
    root set (FLTrust), and the others, both sorted; reproducible from `seed`."""
    if not 1 <= size < n:
        raise DataError(f"root_size = {size}: must be at least 1 and leave data to the clients "
                        f"(the training set has {n} examples)")
    perm = np.random.default_rng([seed, 2021]).permutation(n)
    return np.sort(perm[:size]), np.sort(perm[size:])


def partition_summary(hist: np.ndarray) -> str:
    """A per-client class histogram as text (rows: clients, columns: classes)."""
    width = max(5, len(str(hist.max())) + 1)
    lines = ["client" + "".join(f"{c:>{width}}" for c in range(hist.shape[1])) + f"{'total':>{width + 2}}"]
    for i, row in enumerate(hist):
        lines.append(f"{i:>6}" + "".join(f"{v:>{width}}" for v in row) + f"{row.sum():>{width + 2}}")
    return "\n".join(lines)


def label_histograms(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(clients, classes) counts: the summary of a partition."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def client_test_splits(parts, train_labels, test_labels, num_classes: int, seed: int = 0) -> np.ndarray:
    """(clients, m) test indices, each client's drawn without replacement with probability
    proportional to its training label distribution (FedBN's personalized evaluation)."""
    rng = np.random.default_rng(seed + 1)
    test_labels = np.asarray(test_labels)
    m = len(test_labels) // len(parts)
    test_counts = np.bincount(test_labels, minlength=num_classes).clip(min=1)
    splits = []
    for hist in label_histograms(parts, np.asarray(train_labels), num_classes):
        weight = (hist / hist.sum() / test_counts)[test_labels]
        splits.append(rng.choice(len(test_labels), size=m, replace=False, p=weight / weight.sum()))
    return np.stack(splits)


def index_table(parts: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (clients, max_len) index table and lengths, for sampling on the device."""
    lengths = torch.tensor([len(p) for p in parts])
    table = torch.zeros(len(parts), int(lengths.max()), dtype=torch.int64)
    for i, p in enumerate(parts):
        table[i, : len(p)] = torch.as_tensor(p)
    return table.to(device), lengths.to(device)


def sample_batches(table: torch.Tensor, lengths: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    """(clients, batch) dataset indices, each drawn uniformly from its client's data (with
    replacement), entirely on the device."""
    u = torch.rand(table.shape[0], batch, generator=generator, device=table.device)
    pos = (u * lengths[:, None]).long().clamp_max_(lengths[:, None] - 1)
    return table.gather(1, pos)


# ---- on-device transforms ------------------------------------------------------------------

def augment_crop_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding `pad`, the standardized mean) and horizontal flip of a batch
    (B, C, H, W), vectorized on the device."""
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]
    out = padded[torch.arange(b, device=x.device)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)
    flip = torch.rand(b, generator=generator, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


class FeatureShift:
    """Each client's own fixed image transform (FedBN's feature-shift setting, seed 004):
    a rotation, a contrast factor, additive Gaussian noise, and for RGB a per-channel color
    scale. Client i's parameters are spread over the ranges, in an order shuffled by `seed`."""

    def __init__(self, clients: int, channels: int, seed: int = 0, max_angle: float = 45.0,
                 contrast: tuple[float, float] = (0.5, 1.5), noise: tuple[float, float] = (0.0, 0.5)):
        rng = np.random.default_rng(seed + 2)
        spread = lambda lo, hi: torch.tensor(rng.permutation(np.linspace(lo, hi, clients)), dtype=torch.float32)
        self.angle = spread(-max_angle, max_angle) * math.pi / 180
        self.contrast = spread(*contrast)
        self.noise = spread(*noise)
        self.color = torch.tensor(rng.uniform(0.6, 1.4, (clients, channels)) if channels == 3 else np.ones((clients, channels)),
                                  dtype=torch.float32)

    def __call__(self, x: torch.Tensor, generator: torch.Generator, clients: torch.Tensor | None = None) -> torch.Tensor:
        """x: (h, b, C, H, W), client i's images in row i (`clients` picks the rows' clients)."""
        pick = (lambda t: t.to(x.device)) if clients is None else (lambda t: t.to(x.device)[clients])
        h, b, c, hh, ww = x.shape
        angle, contrast, noise, color = pick(self.angle), pick(self.contrast), pick(self.noise), pick(self.color)
        cos, sin = angle.cos(), angle.sin()
        zero = torch.zeros_like(cos)
        theta = torch.stack([torch.stack([cos, -sin, zero], -1), torch.stack([sin, cos, zero], -1)], -2)  # (h, 2, 3)
        theta = theta.repeat_interleave(b, 0)
        flat = x.reshape(h * b, c, hh, ww)
        grid = torch.nn.functional.affine_grid(theta, flat.shape, align_corners=False)
        out = torch.nn.functional.grid_sample(flat, grid, align_corners=False).reshape(h, b, c, hh, ww)
        mean = out.mean((2, 3, 4), keepdim=True)
        out = (out - mean) * contrast[:, None, None, None, None] + mean
        out = out * color[:, None, :, None, None]
        return out + noise[:, None, None, None, None] * torch.randn(out.shape, generator=generator, device=x.device)
