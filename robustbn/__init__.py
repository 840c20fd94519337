"""robustbn: when some clients of a federation lie, which way of handling batch
normalization, and which aggregation rule, keep the model accurate?"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("robustbn")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["Result", "Scenario", "ScenarioError", "run", "__version__"]
# imported on first use (torch takes seconds): `robustbn --help` is quick, and a Ctrl-C while
# the command line starts is caught by robustbn.cli.main, not a traceback from an import
_LAZY = {"Result": ".runner", "run": ".runner", "Scenario": ".scenario", "ScenarioError": ".scenario"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'robustbn' has no attribute {name!r}")
