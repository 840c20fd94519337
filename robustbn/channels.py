"""The message channels and what each has, shared by scenarios, the store and plots (no
torch here: reading a results store should not need it)."""

from __future__ import annotations

import copy
from typing import Any

CHANNELS = ("grad", "bn_mean", "bn_var")
BN_CHANNELS = ("bn_mean", "bn_var")
# what each channel has: an attack and a pipeline, each with its parameters; unset values
PARTS = {"attack": "none", "attack_params": {}, "agg": "mean", "agg_params": {}}
# what Byzantine clients may send on a channel without attacking it: nothing, or what an honest
# client would
NOT_ATTACKS = ("none", "honest")
# the per-channel fields of the BN channels; `bn_*` (bn_attack, ...) set both at once
BN_CHANNEL_KEYS = tuple(f"{c}_{p}" for c in BN_CHANNELS for p in PARTS)


def expand_channels(row: dict[str, Any]) -> dict[str, Any]:
    """A run's fields with every BN channel spelled out: `bn_mean_attack`, `bn_var_attack`,
    `bn_mean_agg`, `bn_var_agg` and their `*_params`, each from its own field, else from the
    `bn_*` shorthand (rows of old stores have only that), else unset (no attack, the mean);
    the shorthand then holds the value both BN channels share, or None where they differ.
    A new dict; idempotent."""
    out = dict(row)
    for part, unset in PARTS.items():
        shorthand = row.get(f"bn_{part}")
        values = []
        for channel in BN_CHANNELS:
            key = f"{channel}_{part}"
            if out.get(key) is None:
                out[key] = copy.deepcopy(unset if shorthand is None else shorthand)
            values.append(out[key])
        out[f"bn_{part}"] = copy.deepcopy(values[0]) if values[0] == values[1] else None
    return out
