import pytest
import torch

from robustbn.toy import circle_means, client_batches, normalization_experiment


def test_data_is_the_papers():
    means = circle_means(10)
    torch.testing.assert_close(means.norm(dim=1), torch.full((10,), 10.0, dtype=torch.float64))
    torch.testing.assert_close(means[0], torch.tensor([10.0, 0.0], dtype=torch.float64))
    x = client_batches(10, 30, 0.0, 1.0, torch.Generator().manual_seed(0))
    assert x.shape == (10, 30, 2)
    assert (x.mean(1) - means).norm(dim=1).max() < 1.0  # each client holds its own class


def test_fbn_tracks_centralized_bn_and_the_others_degrade_with_heterogeneity():
    iid, niid = normalization_experiment(1.0), normalization_experiment(0.0)
    assert niid["fbn"]["stats_gap"] < 1e-9 and iid["fbn"]["stats_gap"] < 1e-9  # Appendix A: exact
    assert niid["naive"]["stats_gap"] > 10 and niid["fixbn"]["stats_gap"] > 10  # averaged variance is biased
    for mode in ("naive", "fixbn"):
        assert niid[mode]["norm_error"] > 3 * niid["fbn"]["norm_error"]
        assert niid[mode]["norm_error"] > 3 * iid[mode]["norm_error"]
    assert niid["fbn"]["norm_error"] < 0.5  # close to centralized at every heterogeneity level


def test_reproducible_and_validated():
    assert normalization_experiment(0.3, rounds=10, seed=4) == normalization_experiment(0.3, rounds=10, seed=4)
    with pytest.raises(ValueError, match="gamma must be in"):
        normalization_experiment(1.5)
