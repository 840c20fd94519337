"""Centralized BN: one client holding the union of the honest mini-batches each round, the
reference every BN protocol is measured against; attack-free (f = 0)."""

from ..errors import ScenarioError
from .base import Protocol


class Central(Protocol):
    name = "central"
    label = "centralized BN"
    union_batch = True

    @classmethod
    def check(cls, sc) -> None:
        if sc.f != 0:
            raise ScenarioError("f", "norm = 'central' is the attack-free reference: it admits f = 0 only")

    def server_update(self, shared_mean, shared_var, msg_mean, msg_var, count, n, beta, agg_mean, agg_var,
                      together=None):
        """The one client's running statistics are the shared ones."""
        return msg_mean[0], msg_var[0]
