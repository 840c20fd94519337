"""The words, colors and orderings that tables, plots and the worst case share: a run's attack
and defense in words ("SF on the mean", "nnm+median"), which channels its clients send, the
norm protocols' colors and order, and how a field's value is keyed, printed and sorted. Below
plots and worst (they import it, never the reverse); it reads results only."""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from typing import Any

import aggregators

from .channels import BN_CHANNELS, CHANNELS, NOT_ATTACKS, PARTS, expand_channels
from .protocols import PROTOCOLS

# fields of a store row that are no scenario field: results, where it ran, its records
NOT_SCENARIO = frozenset({"device", "data_dir", "final_acc", "best_acc", "final_loss", "rounds_done",
                          "resumed_from", "status", "wall_time_s", "hash", "history", "error", "bn_stats",
                          "source", "versions", "code_version", "engine"})

NORM_COLORS = {"naive": "tab:red", "fbn": "tab:blue", "fixbn": "tab:green", "hbn": "tab:purple",
               "fedbn": "tab:brown", "central": "black", "gn": "tab:olive", "none": "tab:gray"}
OTHER_COLORS = ("tab:orange", "tab:cyan", "tab:pink", "gold", "teal", "navy", "lime", "maroon")
ATTACK_WORDS = {"sf": "SF", "foe": "FOE", "alie": "ALIE", "opt-foe": "opt-FOE", "opt-alie": "opt-ALIE",
                "gaussian": "Gaussian noise", "nan": "NaN", "inf": "inf", "mimic": "mimic", "scale": "scaling",
                "ipm": "IPM"}
CHANNEL_WORDS = {"grad": "the gradients", "bn_mean": "the mean", "bn_var": "the variance"}
BN_WORDS = "the mean and variance"
NO_ATTACK = "no attack"
SHORT_CHANNELS = {"grad": "grad", "bn_mean": "mean", "bn_var": "var"}


def hashable(v: Any) -> Any:
    """A value as a dict key: dicts and lists (the *_params tables, lr_milestones) as canonical
    JSON, NaN as one value (NaN != NaN)."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (dict, list)) else v


def text(v: Any) -> str:
    return str(hashable(v))


def varying(rows: list[dict[str, Any]], exclude: set[str] = frozenset()) -> list[str]:
    """Scenario fields that take more than one value among the rows (a field some rows lack
    counts as None there)."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in NOT_SCENARIO | {"seed"} | set(exclude)]
    return [k for k in keys if len({repr(r.get(k)) for r in rows}) > 1]


def group(rows, keys):
    """Rows by their values of `keys` (dict- and list-valued fields by canonical JSON)."""
    groups = defaultdict(list)
    for r in rows:
        groups[tuple(hashable(r.get(k)) for k in keys)].append(r)
    return groups


def params_words(params: Any) -> str:
    """ " (k=v, ...)" for a parameters table, "" for none."""
    return f" ({', '.join(f'{k}={text(v)}' for k, v in sorted(params.items()))})" if params else ""


def channels(row: dict[str, Any]) -> dict[str, tuple[str, dict, str, dict]]:
    """(attack, attack params, pipeline, pipeline params) of each channel that a run's clients
    send: the gradients, and the BN statistics where the norm mode shares them. Old rows (only
    `bn_attack` / `bn_agg`) read as both BN channels set alike."""
    row = expand_channels(row)
    protocol = PROTOCOLS.get(row.get("norm"))  # a protocol this installation lacks: read as sending statistics
    names = ["grad"] + (list(BN_CHANNELS) if protocol is None or protocol.sends_statistics else [])
    return {c: tuple(row.get(f"{c}_{p}") if row.get(f"{c}_{p}") is not None else unset
                     for p, unset in PARTS.items()) for c in names}


def by_channel(values: dict[str, str]) -> list[tuple[str, list[str]]]:
    """Channels grouped by a shared value (e.g. the same attack), in channel order."""
    out: dict[str, list[str]] = {}
    for channel, value in values.items():
        out.setdefault(value, []).append(channel)
    return list(out.items())


def _on(names: list[str]) -> str:
    """ "on the mean", "on the mean and variance", "on the gradients and the variance", ..."""
    if set(CHANNEL_WORDS) <= set(names):
        return "on every channel"
    if set(BN_CHANNELS) <= set(names):
        return "on " + " and ".join([CHANNEL_WORDS[c] for c in names if c not in BN_CHANNELS] + [BN_WORDS])
    return "on " + " and ".join(CHANNEL_WORDS[c] for c in names)


def attack_words(row: dict[str, Any]) -> str:
    """The attack in words: "SF on the mean", "ALIE on the gradients", "SF on the mean and
    variance", "variance scaling", "ALIE on the gradients + SF on the mean and variance";
    without an attack on any channel "no attack", or "no attack (7 honest)" where f > 0."""
    attacked = {c: (a, ap) for c, (a, ap, _, _) in channels(row).items() if a not in NOT_ATTACKS}
    if not attacked or not row.get("f"):
        f, n = row.get("f") or 0, row.get("n")
        return f"{NO_ATTACK} ({n - f} honest)" if f and n is not None else NO_ATTACK
    phrases = []
    for (name, params), names in by_channel({c: (a, text(ap)) for c, (a, ap) in attacked.items()}):
        params = json.loads(params)
        if name == "scale" and names == ["bn_var"]:
            phrases.append("variance scaling" + params_words(params))
        else:
            phrases.append(f"{ATTACK_WORDS.get(name, name)}{params_words(params)} {_on(names)}")
    return " + ".join(phrases)


def defense_words(row: dict[str, Any]) -> str:
    """The pipeline of the attacked channels (of every channel the clients send, without an
    attack): "nnm+median", or per channel where they differ ("nnm+median on the mean, mean on
    the variance"); "(built for f=2)" where `agg_f` differs from f."""
    chans = channels(row)
    attacked = [c for c, (a, *_) in chans.items() if a not in NOT_ATTACKS] if row.get("f") else []
    pipelines = {c: _pipeline_words(spec, hashable(params)) for c, (_, _, spec, params) in chans.items()
                 if c in attacked or not attacked}
    grouped = by_channel(pipelines)
    words = grouped[0][0] if len(grouped) == 1 else ", ".join(f"{p} {_on(names)}" for p, names in grouped)
    agg_f = row.get("agg_f")
    return words + (f" (built for f={agg_f})" if agg_f is not None and agg_f != row.get("f") else "")


def compact_defense(defense: str) -> str:
    """A defense's words as a map cell (or a phone's screen) has room for: each channel in a word,
    "nnm+trmean (grad), mean (BN)"."""
    for long, short in ((" on the gradients", " (grad)"), (" on the mean and variance", " (BN)"),
                        (" on the mean", " (BN mean)"), (" on the variance", " (BN var)")):
        defense = defense.replace(long, short)
    return defense


@functools.cache  # a board's thousands of rows share a few pipelines
def _pipeline_words(spec: str, params_key: Any) -> str:
    """ "bucketing+cc (center=previous, tau=10.0)": the spec, its parameters and the defaults
    its steps show (`aggregators.shown_params`)."""
    params = json.loads(params_key) if isinstance(params_key, str) else params_key
    if isinstance(params, dict) and isinstance(spec, str):
        params = aggregators.shown_params(spec, params)
    return f"{spec}{params_words(params)}"


def label_sorted_words(classes: int | None, honest: list[int]) -> str:
    """gamma = 0 in words: each honest client's label-sorted slice, in classes' worth of data
    (seed 002's split cuts the data among the n - f honest clients, so 7 of them hold about
    1.4 classes each, 2 or 3 labels; one class each only where there are as many as classes)."""
    words = "each honest client holds a label-sorted slice of the training set"
    honest = sorted(set(honest))
    if not classes or not honest or honest[0] < 1:
        return words
    share = lambda h: f"{classes / h:.2g}"
    if len(honest) == 1:
        each = f"{share(honest[0])} class" + ("es'" if classes != honest[0] else "'s")
        return f"{words}, about {each} worth of data ({classes} classes over {honest[0]} honest clients)"
    return (f"{words}, from about {share(honest[-1])} to {share(honest[0])} classes' worth of data ({classes} "
            f"classes over {honest[0]} to {honest[-1]} honest clients)")


def norm_words(norm: str) -> str:
    """A protocol's `label`; a user's protocol (`module:Name`) by the label its own class sets
    (one it inherits would name the protocol it changes), else by its reference."""
    if norm in PROTOCOLS:
        return PROTOCOLS[norm].label
    if isinstance(norm, str) and ":" in norm:
        from .protocols import get
        try:
            cls = get(norm)
        except ValueError:  # a run of a module not on this machine's path: its reference
            return norm
        return cls.__dict__.get("label", norm)
    return norm


def norm_order(norm: Any) -> tuple:
    """Norm protocols in the papers' order (the colors' order), others after them by name."""
    order = list(NORM_COLORS)
    return (order.index(norm) if norm in order else len(order), str(norm))


def sort_key(v: Any) -> tuple:
    """A sort key for a field's values: numbers by value, then anything else by its text, None last."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v)):
        return (0, v, "")
    return (1 if v is not None else 2, 0, str(hashable(v)))


def is_attack(row: dict[str, Any]) -> bool:
    """f > 0 and some channel the clients send carries an attack (not `none` / `honest`)."""
    return bool(row.get("f")) and any(a not in NOT_ATTACKS for a, *_ in channels(row).values())


def setting_defense_words(row: dict[str, Any]) -> str:
    """The defense of a setting in words: the pipeline of every channel the clients send
    (`defense_words` of the run without its attack), and the client filter."""
    words = defense_words({**row, **{f"{c}_attack": "none" for c in CHANNELS}, "bn_attack": "none"})
    flt = row.get("client_filter")
    if flt not in (None, "", "none"):
        words += f" + {flt} filter{params_words(row.get('client_filter_params') or {})}"
    return words


def attack_short(row: dict[str, Any]) -> str:
    """The attack in a few characters, for a heatmap cell: "SF (mean)", "ALIE (grad)",
    "SF (mean, var)", "ALIE (grad) + SF (mean, var)"; "no attack". Channels share a bracket only
    where the attack's parameters are the same too: "ALIE (mean) + ALIE (var)" is two attacks."""
    attacked = ({c: (a, text(ap)) for c, (a, ap, *_) in channels(row).items() if a not in NOT_ATTACKS}
                if row.get("f") else {})
    if not attacked:
        return NO_ATTACK
    return " + ".join(f"{ATTACK_WORDS.get(a, a)} ({', '.join(SHORT_CHANNELS.get(c, c) for c in names)})"
                      for (a, _), names in by_channel(attacked))
