import os

from hypothesis import HealthCheck, settings

# `ci`: the thorough profile .ci/run uses (>= 500 examples per property).
settings.register_profile("ci", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
