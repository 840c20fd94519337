"""Errors that modules at every level raise: kept at the bottom of the import graph, so that a
protocol's scenario check does not import the scenario module that calls it."""

from __future__ import annotations


class ScenarioError(ValueError):
    """A bad scenario value; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
