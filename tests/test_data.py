import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from robustbn.data import (
    DataError,
    client_test_splits,
    index_table,
    label_histograms,
    load_dataset,
    partition,
    sample_batches,
)

labels_strategy = st.integers(0, 2**31 - 1).map(lambda s: np.random.default_rng(s).integers(0, 10, 600))


@given(labels=labels_strategy, n=st.integers(1, 12), kind=st.sampled_from(["iid", "gamma", "dirichlet"]),
       gamma=st.floats(0, 1), seed=st.integers(0, 10**6))
def test_partitions_are_disjoint_and_reproducible(labels, n, kind, gamma, seed):
    parts = partition(labels, n, kind, gamma=gamma, alpha=1.0, seed=seed)
    joined = np.concatenate(parts)
    assert len(parts) == n and len(joined) == len(set(joined.tolist())) and joined.max() < len(labels)
    if kind in ("iid", "gamma"):
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
