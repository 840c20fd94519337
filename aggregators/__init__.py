"""Robust aggregation on (n, d) tensors. Depends on torch only.

>>> import torch, aggregators
>>> agg = aggregators.build("nnm+median", f=2)
>>> agg(torch.randn(10, 1000)).shape
torch.Size([1000])
"""

from .base import Rule, draws, is_stateful, pairwise_sq_distances, sanitize, trials
from .catalogue import CAF, SMEA, Bulyan, DnC, FLTrust, MinimumDiameterAveraging
from .clustering import ClippedClustering, SignGuard
from .pipeline import AGGREGATORS, PRE_AGGREGATORS, Pipeline, build, register, shown_params, step_class
from .plugins import add_search_path, search_path
from .pre import ARC, NNM, Bucketing, Clipping
from .rules import (
    CenteredClipping,
    CoordinateWiseMedian,
    GeometricMedian,
    Krum,
    Mean,
    Meamed,
    MoNNA,
    MultiKrum,
    TrimmedMean,
)

__all__ = [
    "AGGREGATORS", "PRE_AGGREGATORS", "Pipeline", "Rule", "build", "register", "shown_params", "step_class", "add_search_path",
    "search_path", "sanitize", "pairwise_sq_distances", "trials", "is_stateful", "draws",
    "Mean", "CoordinateWiseMedian", "TrimmedMean", "Krum", "MultiKrum", "GeometricMedian",
    "CenteredClipping", "Meamed", "MoNNA", "NNM", "Bucketing", "Clipping", "ARC",
    "MinimumDiameterAveraging", "SMEA", "CAF", "Bulyan", "DnC", "SignGuard", "ClippedClustering", "FLTrust",
]
