"""FedBN (seed 004): BN weights and statistics never leave the client; each client keeps its
own running statistics; evaluation is personalized (each client's model on its own test split)."""

from .base import Protocol


class FedBN(Protocol):
    name = "fedbn"
    label = "FedBN"
    sends_statistics = False
    local_statistics = True
    personalized = True

    def is_local(self, param, bn_layers):
        return any(param in (f"{layer}.weight", f"{layer}.bias") for layer in bn_layers)
