import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from robustbn.data import (
    DataError,
    FeatureShift,
    augment_crop_flip,
    partition_summary,
    client_test_splits,
    index_table,
    label_histograms,
    load_dataset,
    partition,
    sample_batches,
)

labels_strategy = st.integers(0, 2**31 - 1).map(lambda s: np.random.default_rng(s).integers(0, 10, 600))


@given(labels=labels_strategy, n=st.integers(1, 12), kind=st.sampled_from(["iid", "gamma", "dirichlet", "feature-shift"]),
       gamma=st.floats(0, 1), seed=st.integers(0, 10**6))
def test_partitions_are_disjoint_and_reproducible(labels, n, kind, gamma, seed):
    parts = partition(labels, n, kind, gamma=gamma, alpha=1.0, seed=seed)
    joined = np.concatenate(parts)
    assert len(parts) == n and len(joined) == len(set(joined.tolist())) and joined.max() < len(labels)
    if kind in ("iid", "gamma", "feature-shift"):
        assert {len(p) for p in parts} == {len(labels) // n}  # equal-sized, as seed 002 says
    else:
        assert len(joined) == len(labels)
    again = partition(labels, n, kind, gamma=gamma, alpha=1.0, seed=seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_gamma_extremes():
    labels = np.repeat(np.arange(10), 600)
    np.random.default_rng(0).shuffle(labels)
    hist = label_histograms(partition(labels, 10, "gamma", gamma=0.0), labels, 10)
    assert ((hist > 0).sum(1) <= 2).all()  # gamma = 0: one or two labels per client
    hist = label_histograms(partition(labels, 10, "gamma", gamma=1.0), labels, 10)
    assert hist.min() > 0.7 * hist.mean()  # gamma = 1: near uniform


def test_dirichlet_concentrates_as_alpha_shrinks():
    labels = np.repeat(np.arange(10), 500)
    def top_share(alpha):
        hist = label_histograms(partition(labels, 10, "dirichlet", alpha=alpha, seed=1), labels, 10)
        return (hist.max(1) / hist.sum(1)).mean()
    assert top_share(0.05) > top_share(1.0) > top_share(100.0)


def test_sampling_stays_inside_each_clients_data():
    parts = [np.arange(0, 5), np.arange(100, 103)]
    table, lengths = index_table(parts, "cpu")
    idx = sample_batches(table, lengths, 50, torch.Generator().manual_seed(0))
    assert set(idx[0].tolist()) == set(range(5)) and set(idx[1].tolist()) == {100, 101, 102}


def test_client_test_splits_follow_the_label_distribution():
    train = np.repeat(np.arange(10), 100)
    test = np.repeat(np.arange(10), 50)
    parts = partition(train, 5, "gamma", gamma=0.0)
    splits = client_test_splits(parts, train, test, 10)
    for part, split in zip(parts, splits):
        assert set(test[split]) <= set(train[part])


def test_fashion_mnist_from_the_debian_location():
    pytest.importorskip("torchvision")
    data = load_dataset("fashion-mnist")
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(data.y_train.numpy()).tolist() == [6000] * 10
    assert abs(data.x_train.mean().item()) < 0.01 and abs(data.x_train.std().item() - 1) < 0.01


def test_missing_cifar10_offline_is_a_clear_error(tmp_path, monkeypatch):
    import torchvision

    def offline(*args, **kwargs):
        raise RuntimeError("network unreachable")
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", offline)
    monkeypatch.delenv("ROBUSTBN_DATA", raising=False)
    with pytest.raises(DataError, match=f"'cifar10': not found in {tmp_path}.*--data-dir"):
        load_dataset("cifar10", data_dir=tmp_path)


def test_shards_give_each_client_about_that_many_classes():
    labels = np.repeat(np.arange(10), 100)
    parts = partition(labels, 5, "shards", shards=2, seed=3)
    hist = label_histograms(parts, labels, 10)
    assert {len(p) for p in parts} == {200} and ((hist > 0).sum(1) <= 2).all()
    assert len(np.unique(np.concatenate(parts))) == 1000


@given(n=st.integers(1, 10), shards=st.integers(1, 4), seed=st.integers(0, 1000))
def test_shards_are_disjoint_equal_and_bounded_in_classes(n, shards, seed):
    labels = np.random.default_rng(seed).integers(0, 10, 400)
    parts = partition(labels, n, "shards", shards=shards, seed=seed)
    joined = np.concatenate(parts)
    assert len(set(joined.tolist())) == len(joined) and len({len(p) for p in parts}) == 1
    # shards are runs of label-sorted data: only the 9 class boundaries can split a shard in two labels
    assert (label_histograms(parts, labels, 10) > 0).sum() <= n * shards + 9


def test_partition_summary_shows_each_client_row():
    hist = np.array([[3, 0], [1, 2]])
    text = partition_summary(hist)
    assert text.splitlines()[1].split() == ["0", "3", "0", "3"] and text.splitlines()[2].split() == ["1", "1", "2", "3"]


def test_feature_shift_is_a_fixed_transform_per_client():
    shift = FeatureShift(clients=3, channels=3, seed=0, noise=(0.0, 0.0))
    x = torch.randn(1, 4, 3, 12, 12).repeat(3, 1, 1, 1, 1)  # the same images for every client
    g = torch.Generator().manual_seed(0)
    a, b = shift(x, g), shift(x, g)
    torch.testing.assert_close(a, b)  # fixed: no randomness without noise
    assert not torch.allclose(a[0], a[1]) and not torch.allclose(a[1], a[2])  # but its own per client
    picked = shift(x[:1], g, clients=torch.tensor([2]))
    torch.testing.assert_close(picked[0], a[2])
    assert len(set(shift.angle.tolist())) == 3


def test_augmentation_crops_and_flips_on_the_device():
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6) + 1
    out = augment_crop_flip(x, torch.Generator().manual_seed(0), pad=2)
    assert out.shape == x.shape
    for img, src in zip(out, x):
        vals = set(img.flatten().tolist()) - {0.0}
        assert vals <= set(src.flatten().tolist())  # pixels moved or padded, never invented
    same = augment_crop_flip(x, torch.Generator().manual_seed(0), pad=2)
    assert torch.equal(out, same)


def write_idx(path, array, magic):
    import gzip
    import struct

    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_mnist_loads_from_files_in_a_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)), 2051)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10, 2049)
    data = load_dataset("mnist", data_dir=tmp_path)
    assert data.x_train.shape == (30, 1, 28, 28) and data.x_test.shape == (10, 1, 28, 28)
    assert data.y_test.tolist() == list(range(10))
    assert (tmp_path / "cache").exists()  # uncompressed copies went to the cache, not next to the data


def _load_mnist_in_a_process(data_dir: str) -> tuple:
    return tuple(load_dataset("mnist", data_dir=data_dir).x_train.shape)


def test_processes_filling_the_data_cache_at_once_all_load(tmp_path, monkeypatch):
    """`--jobs` workers start together and each fills the uncompressed cache on first use
    (a shared temporary name made one of them fail on its rename)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 3000), ("t10k", 10)):  # big enough that the copies overlap in time
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)), 2051)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10, 2049)
    with ProcessPoolExecutor(4, mp_context=get_context("spawn")) as pool:
        shapes = list(pool.map(_load_mnist_in_a_process, [str(tmp_path)] * 8))
    assert shapes == [(3000, 1, 28, 28)] * 8
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_cifar10_loads_from_files_in_a_data_dir(tmp_path, monkeypatch):
    import pickle

    import torchvision

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "labels": [0, 1, 2, 3]}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))
    # these files are not torchvision's (their checksums differ): skip only the checksum
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    data = load_dataset("cifar10", data_dir=tmp_path)
    assert data.x_train.shape == (20, 3, 32, 32) and data.x_test.shape == (4, 3, 32, 32)
    assert data.y_train.tolist() == [0, 1, 2, 3] * 5
