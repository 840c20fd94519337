"""Naive BN, what FL libraries do: normalize with the client's batch statistics; clients
update running statistics from the shared ones and the server averages them."""

from .base import Protocol


class Naive(Protocol):
    name = "naive"
    label = "naive BN"
