import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# `ci`: the thorough profile .ci/run uses (500 examples per property; the property kit's sweep
# over the registry caps it at 200: tests/test_aggregator_kit.py).
settings.register_profile("ci", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# every Ray the tests start (test_cluster's, and Flower's simulation runtime) is of this machine
# only, on 127.0.0.1: ray reads this once, when it is first imported, whichever test that is
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # ./dev.sh test runs a worker per core: one torch thread each, and in the processes tests
    # start (a CLI run, a Flower node), or OpenMP threads spin against the other worker's
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)


@pytest.fixture
def clean_search_path(monkeypatch):
    """A test that adds `module:Name` search directories and imports a user's modules leaves
    the search path, sys.path and sys.modules as it found them."""
    import os

    from aggregators import plugins
    monkeypatch.setattr(plugins, "_SEARCH", [])
    before = list(sys.path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules = set(sys.modules)
    yield
    # only the user's modules, from the directories the test added: a library first imported
    # during the test (scipy, say) stays, since its C extensions cannot load twice in a process
    added = tuple(os.path.abspath(d) + os.sep for d in {*sys.path, *plugins._SEARCH} - set(before) if d)
    for name in set(sys.modules) - modules:
        path = getattr(sys.modules[name], "__file__", None)
        if path and os.path.abspath(path).startswith(added):
            del sys.modules[name]


@pytest.fixture(autouse=True)
def close_figures():
    """Tests that inspect `plots.figure(...)` leave no figure open for the next test."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
