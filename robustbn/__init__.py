"""robustbn: when some clients of a federation lie, which way of handling batch
normalization, and which aggregation rule, keep the model accurate?"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("robustbn")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

from .runner import Result, run  # noqa: E402
from .scenario import Scenario, ScenarioError  # noqa: E402

__all__ = ["Result", "Scenario", "ScenarioError", "run", "__version__"]
