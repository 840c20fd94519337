"""Each norm protocol, under DSGD and FedAvg, gives the history recorded in
tests/data/protocol_histories.json (tests/protocol_histories.py writes it): the guard for
refactoring the protocols. Compared to float32 rounding across machines (one test sample
of 500 may flip), not bit for bit."""

import json

import pytest

from protocol_histories import PATH, record

RECORDED = json.loads(PATH.read_text())


@pytest.fixture(scope="module")
def now():
    from matrices import torch_threads
    with torch_threads(1):
        return record(only=set(RECORDED))


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_protocol_history_is_as_recorded(name, now):
    want, got = RECORDED[name], now[name]
    assert [h["round"] for h in got["history"]] == [h["round"] for h in want["history"]]
    for g, w in zip(got["history"], want["history"]):
        assert g["test_acc"] == pytest.approx(w["test_acc"], abs=0.0041)
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-3)
        assert g["train_loss"] == pytest.approx(w["train_loss"], rel=1e-3)
    assert got["bn_stats"].keys() == want["bn_stats"].keys()
    for layer, stats in want["bn_stats"].items():
        for k, v in stats.items():
            assert got["bn_stats"][layer][k] == pytest.approx(v, rel=1e-3, abs=1e-4)
