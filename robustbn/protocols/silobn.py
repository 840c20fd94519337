"""SiloBN (Andreux et al. 2020): BN statistics stay on each client (local running statistics,
never sent), the BN affine parameters are shared and aggregated with the weights; evaluation
is personalized, each client's model with its own statistics on its own test split."""

from .fedbn import FedBN


class SiloBN(FedBN):
    name = "silobn"
    label = "SiloBN"

    def is_local(self, param, bn_layers):
        return False
