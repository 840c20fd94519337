"""Robustness plots from the results store: accuracy curves, accuracy vs heterogeneity,
attack x defense heatmaps, and worst-case (over attacks) defense x norm mode heatmaps, in the
papers' style: a color per norm mode, a line style per defense, a marker per attack, and
legends in words ("FBN, SF on the mean, nnm+median"). Runs that differ only in `seed` are
pooled: the mean, and its 95% confidence interval as the band (Student t over seeds, clipped to
[0, 1]: robustbn.stats); legends say over how many seeds, "1 seed, no interval" where one."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from typing import Any, Callable, Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .channels import BN_CHANNEL_KEYS, PARTS  # noqa: E402
from .labels import (  # noqa: E402
    NO_ATTACK,
    NORM_COLORS,
    NOT_SCENARIO,
    OTHER_COLORS,
    attack_words,
    compact_defense,
    defense_words,
    group,
    hashable,
    norm_order,
    norm_words,
    setting_defense_words,
    sort_key,
    text,
    varying,
)
from .stats import ACCURACY, CLIPPED_PERCENT_WORDS, MIN_PAIRS, accuracy, bands, ci_text, interval  # noqa: E402
from .stats import chance as chance_of  # noqa: E402
from .worst import (  # noqa: E402
    AT_CHANCE,
    ATTACK_FIELDS,
    BEST,
    DEFENSE_FIELDS,
    RESULT,
    SEARCHED,
    TIED,
    defense_map,
    pick_head,
    protocol_map,
    setting_groups,
    source_kind,
    worst_case,
)

KINDS = ("curves", "heterogeneity", "heatmap", "worst-case", "robustness", "map", "protocols")
ROBUSTNESS_X = ("gamma", "f", "alpha")  # the axes of a robustness curve
X_PARTITION = {"gamma": "gamma", "alpha": "dirichlet"}  # an axis of heterogeneity means something under its partition
LINE_COLORS = (*plt.get_cmap("tab10").colors, *plt.get_cmap("Dark2").colors)  # a color per defense, 18 apart
# the pipeline of the attacked channels: "mean" (undefended) solid, each other a dash pattern
DEFENSE_STYLES = ((0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (2, 2)), (0, (8, 2, 1, 2, 1, 2)),
                  (0, (3, 1, 1, 1)), (0, (10, 3)), (0, (1, 3)))
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")

# fields the words say (robustbn.labels): where the words tell two groups apart, no "key=value" for them
WORDED = {"norm", "f", "agg_f", "grad_attack", "grad_attack_params", "grad_agg", "grad_agg_params",
          "client_filter", "client_filter_params", "root_size", *(f"bn_{p}" for p in PARTS), *BN_CHANNEL_KEYS}


class Legend:
    """Runs grouped for plotting, and each group's words and style.

    Runs are grouped by every field that varies among them but the seed (and `exclude`, e.g.
    the x axis); runs differing only in seed pool into one group. A group's label names its
    norm mode, attack and defense in words where these vary among the groups (the parts all
    groups share are `common`, for the title), then `key=value` for every other varying field
    (gamma, rounds, ...) and for a worded field the words do not tell apart (f=2 against f=3
    under one attack). Style: a color per norm mode, a line style per defense ("mean" solid),
    a marker per attack (and other varying fields) where these vary."""

    def __init__(self, rows: list[dict[str, Any]], exclude: set[str] = frozenset()):
        self.keys = varying(rows, set(exclude))
        self.groups = dict(sorted(group(rows, self.keys).items(), key=lambda kv: self._order(kv[1][0])))
        # a defense in the papers' words, its attacked channels' pipeline; the whole of it (every channel's
        # pipeline, the client filter) where those words would give one defense two names, or two defenses one
        short = {k: defense_words(rs[0]) for k, rs in self.groups.items()}
        full = {k: setting_defense_words(rs[0]) for k, rs in self.groups.items()}
        named = {(short[k], full[k]) for k in self.groups}
        defense = short if len(named) == len(set(short.values())) == len(set(full.values())) else full
        self.words = {k: (norm_words(rs[0]["norm"]), attack_words(rs[0]), defense[k]) for k, rs in self.groups.items()}
        shown = [i for i in range(3) if len({w[i] for w in self.words.values()}) > 1]
        first = next(iter(self.words.values()), ("", "", ""))
        self.common = [first[i] for i in range(3) if i not in shown
                       and not (i == 2 and first[1].startswith(NO_ATTACK) and first[2] == "mean")]
        by_words = defaultdict(set)
        for k, w in self.words.items():
            by_words[w].add(k)
        extra = [j for j, key in enumerate(self.keys)
                 if key not in WORDED or any(len({k[j] for k in ks}) > 1 for ks in by_words.values())]
        self.parts, rest = {}, {}
        for k, w in self.words.items():
            parts = [w[i] for i in shown]
            if 2 in shown and w[1].startswith(NO_ATTACK) and w[2] == "mean":
                parts.remove(w[2])  # undefended and not attacked: "no attack" says it all
            self.parts[k] = parts + [f"{self.keys[j]}={text(k[j])}" for j in extra]
            rest[k] = (w[1], tuple(k[j] for j in extra))
        norms = sorted({rs[0]["norm"] for rs in self.groups.values()} - set(NORM_COLORS))
        defenses = sorted({w[2] for w in self.words.values()} - {"mean"})
        kinds = sorted(set(rest.values()), key=lambda r: (not r[0].startswith(NO_ATTACK), r[0], repr(r[1])))
        self.style, self.points = {}, {}
        for k, rs in self.groups.items():
            norm, defense = rs[0]["norm"], self.words[k][2]
            index = kinds.index(rest[k])
            self.style[k] = {
                "color": NORM_COLORS.get(norm) or OTHER_COLORS[norms.index(norm) % len(OTHER_COLORS)],
                "linestyle": "-" if defense == "mean" else DEFENSE_STYLES[defenses.index(defense) % len(DEFENSE_STYLES)],
                "marker": None if index == 0 else MARKERS[(index - 1) % len(MARKERS)]}
            self.points[k] = MARKERS[index % len(MARKERS)]  # where every line needs a marker (error bars)

    @staticmethod
    def _order(row):
        attack = attack_words(row)
        return (norm_order(row["norm"]),
                not attack.startswith(NO_ATTACK), attack, defense_words(row) != "mean", defense_words(row),
                repr(sorted((k, text(v)) for k, v in row.items() if k not in NOT_SCENARIO)))

    def label(self, key: tuple, runs: list[dict[str, Any]], pooled: bool, suffix: str = "") -> str:
        words = ", ".join(self.parts[key] + ([suffix] if suffix else [])) or "all runs"
        if not pooled:
            return words
        seeds = len({r.get("seed") for r in runs})
        return f"{words} ({over(seeds, seeds) if seeds == len(runs) else over(len(runs), len(runs), 'run')})"

    def title(self) -> str:
        return ", ".join(self.common)


def over(low: int, high: int, unit: str = "seed") -> str:
    """What a band or error bar is: "95% CI over 2 seeds", "... over 2-3 seeds", "1 seed, no interval"."""
    if high == 1:
        return f"1 {unit}, no interval"
    return f"95% CI over {low if low == high else f'{low}-{high}'} {unit}s"


def _pools(runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Runs split by the rounds of their histories (runs cut short, or made with another
    evaluation schedule, cannot be averaged round by round): the commonest first."""
    by_rounds = defaultdict(list)
    for r in runs:
        by_rounds[tuple(h["round"] for h in r["history"])].append(r)
    return sorted(by_rounds.values(), key=lambda rs: (-len(rs), -len(rs[0]["history"])))


def curves(rows, ax) -> Legend:
    legend = Legend(rows)
    pooled = any(len(rs) > 1 for rs in legend.groups.values())
    for key, runs in legend.groups.items():
        pools = _pools(runs)
        for i, pool in enumerate(pools):
            rounds = [h["round"] for h in pool[0]["history"]]
            accs = np.array([[h["test_acc"] for h in r["history"]] for r in pool], dtype=float)
            mean, low, high = bands(accs)
            suffix = f"to round {rounds[-1]}" if len(pools) > 1 else ""
            style = legend.style[key]
            ax.plot(rounds, mean, label=legend.label(key, pool, pooled, suffix), **style,
                    markevery=max(1, len(rounds) // 12), markersize=5, linewidth=1.6)
            if len(pool) > 1:
                ax.fill_between(rounds, low, high, color=style["color"], alpha=0.15, linewidth=0)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    return legend


def heterogeneity(rows, ax, x="gamma") -> Legend:
    legend = Legend(rows, {x})
    pooled = any(len(rs) > 1 for k, runs in legend.groups.items() for rs in group(runs, [x]).values())
    for key, runs in legend.groups.items():
        by_x = group(runs, [x])
        xs = sorted(by_x, key=lambda v: (v[0] is None, v[0] if isinstance(v[0], (int, float)) else repr(v[0])))
        cells = [interval([r["final_acc"] for r in by_x[v]], ACCURACY) for v in xs]
        counts = [e.n for e in cells]
        label = legend.label(key, runs, False)
        if pooled:
            label += f" ({over(min(counts), max(counts))})"
        means = np.array([e.mean for e in cells])
        lows = np.array([e.mean if e.low is None else e.low for e in cells])
        highs = np.array([e.mean if e.high is None else e.high for e in cells])
        ax.errorbar([v[0] for v in xs], means, yerr=[means - lows, highs - means], capsize=3,
                    label=label, **{**legend.style[key], "marker": legend.points[key]})
    ax.set_xlabel(x)
    ax.set_ylabel("final test accuracy")
    return legend


def heatmap_figure(rows):
    """Final accuracy (mean over the runs of a cell: seeds and any other field, with its 95%
    interval over those runs and their number) by attack (in words, with the channel it hits)
    and defense (the attacked channels' pipeline), one panel per norm mode; the attacks named
    once, left of the first panel (the panels' rows align)."""
    attack_of = {id(r): attack_words(r) for r in rows}
    defense_of = {id(r): defense_words(r) for r in rows}
    norms = sorted({r["norm"] for r in rows}, key=norm_order)
    attacks = sorted(set(attack_of.values()), key=lambda a: (not a.startswith(NO_ATTACK), a))
    defenses = sorted(set(defense_of.values()), key=lambda d: (d != "mean", d))
    fig = plt.figure(figsize=(len(norms) * (0.3 + 1.25 * len(defenses)) + 3.5, 2.2 + 0.5 * len(attacks)),
                     layout="constrained")
    axes = fig.subplots(1, len(norms), squeeze=False)[0]
    for n, (ax, norm) in enumerate(zip(axes, norms)):
        grid = np.full((len(attacks), len(defenses)), np.nan)
        words = {}
        for i, a in enumerate(attacks):
            for j, d in enumerate(defenses):
                e = interval([r["final_acc"] for r in rows
                              if r["norm"] == norm and attack_of[id(r)] == a and defense_of[id(r)] == d], ACCURACY)
                if e.n:
                    grid[i, j] = e.mean
                    runs = f"{e.n} run{'s' * (e.n != 1)}"
                    words[i, j] = f"{e.mean:.2f}\n" + (f"{e.text(digits=2)} ({runs})" if e.has_interval else
                                                       e.text(digits=2, unit="run"))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), text_ in words.items():
            ax.text(j, i, text_, ha="center", va="center", color="white" if grid[i, j] < 0.6 else "black",
                    fontsize=6.5)
        ax.set_xticks(range(len(defenses)), defenses, rotation=30, ha="right")
        ax.set_yticks(range(len(attacks)), attacks if n == 0 else [""] * len(attacks))
        ax.set_title(norm_words(norm))
        ax.set_xlabel("defense (pipeline of\nthe attacked channels)")
        if n == 0:
            ax.set_ylabel("attack")
    fig.colorbar(im, ax=list(axes), label="final test accuracy: mean over the cell's runs, 95% CI (Student t)")
    return fig


def worst_case_figure(rows, title: str | None = None):
    """ByzFL-style worst-case heatmap (robustbn.worst has the definition): a row per defense
    (every sent channel's pipeline, in words), a column per norm mode, one panel per
    combination of the other setting fields that vary (f, gamma, ...). A cell is colored by
    the worst accuracy over attacks (seeds pooled) and annotated with it, its 95% interval over
    seeds, the number of seeds (one: no interval) and the worst attack with the channels it hit ("SF (mean)");
    "no attack" where f = 0, "no attack run" where f > 0 but no attack was run. A frame marks
    the best defense of its norm protocol, or those tied for best (paired over seeds); "(searched)"
    where the worst attack is a searched one (rows with `source`: robustbn.worst.matrix_rows).
    Defenses whose words read alike in one panel and norm mode (e.g. agg_f unset and agg_f =
    f) are told apart by key=value."""
    table = worst_case(rows)
    panel_keys = varying(table, set(RESULT) | {"norm", "defense", "server_data"} | DEFENSE_FIELDS)
    panel_of = lambda t: tuple(hashable(t.get(k)) for k in panel_keys)
    label = {id(t): t["defense"] for t in table}
    for alike in group(table, [*panel_keys, "defense", "norm"]).values():
        for key in (varying(alike, set(RESULT) | {"norm", "defense"}) if len(alike) > 1 else []):
            for t in alike:
                label[id(t)] += f", {key}={text(t.get(key))}"
    cells = {(panel_of(t), label[id(t)], t["norm"]): t for t in table}
    norms = sorted({t["norm"] for t in table}, key=norm_order)
    defenses = sorted(set(label.values()), key=lambda d: (d != "mean", d))
    panels = sorted({k[0] for k in cells}, key=lambda p: [sort_key(v) for v in p])
    # a panel's columns: the norm modes it has; its rows: every defense, so rows align across panels
    columns = {p: [m for m in norms if any(k[0] == p and k[2] == m for k in cells)] for p in panels}
    # a cell holds up to six short lines (value, interval, a mixed attack, "searched")
    widths = [max(1.6, 2.2 * len(columns[p])) for p in panels]
    fig = plt.figure(figsize=(sum(widths) + 4.5, 2.8 + 0.9 * len(defenses)), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    im = None
    for n, (ax, panel) in enumerate(zip(axes, panels)):
        norms = columns[panel]
        grid = np.full((len(defenses), len(norms)), np.nan)
        for i, d in enumerate(defenses):
            for j, norm in enumerate(norms):
                t = cells.get((panel, d, norm))
                if t is None:
                    continue
                if t["worst_acc"] is None:
                    ax.text(j, i, "no attack\nrun", ha="center", va="center", color="gray", fontsize=7)
                    continue
                v = t["worst_acc"]
                grid[i, j] = 100 * v
                seeds = f"{t['seeds']} seed{'s' * (t['seeds'] != 1)}"
                ci = f"{ci_text(t['ci_low'], t['ci_high'], t['seeds'], scale=100, digits=1)} ({seeds})" \
                    if t["ci_low"] is not None else seeds  # one seed: no interval
                attack = t["worst_short"].replace(" + ", "\n+ ")  # a mixed attack, one channel a line
                if t.get("worst_kind") == SEARCHED:
                    attack += "\n(searched)"
                ax.text(j, i, f"{100 * v:.1f}%\n{ci}\n{attack}", ha="center",
                        va="center", color="white" if v < 0.6 else "black", fontsize=7)
                if t["verdict"] in (BEST, TIED) and t["seeds"] >= MIN_PAIRS:  # fewer: no verdict, as the docs
                    ax.add_patch(plt.Rectangle((j - 0.47, i - 0.47), 0.94, 0.94, fill=False, edgecolor="red",
                                               linewidth=1.5 if t["verdict"] == BEST else 0.8))
        ax.set_facecolor("0.93")  # not run
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(norms)), [norm_words(m) for m in norms], rotation=30, ha="right")
        ax.set_yticks(range(len(defenses)), [textwrap.fill(d, 42) for d in defenses] if n == 0 else
                      [""] * len(defenses), fontsize=8)
        ax.set_title("\n".join(f"{k}={text(v)}" for k, v in zip(panel_keys, panel)) or "worst case over attacks",
                     fontsize=9)
        ax.set_xlabel("norm protocol")
        if n == 0:
            ax.set_ylabel("defense")
    fig.colorbar(im, ax=list(axes), label="worst-case accuracy (%)")
    caption = (f"final test accuracy (%) under the worst attack run (mean over seeds; {CLIPPED_PERCENT_WORDS}; seeds), and "
               "that attack; a diverged run counts at chance (1 / classes)\nframed: the best defense per norm protocol (thick), or those tied for best (thin; "
               f"paired over seeds; no frame on fewer than {MIN_PAIRS} seeds: no verdict)")
    if any(t.get("worst_kind") == SEARCHED for t in table):
        caption += "\n(searched): the worst attack is an attack search's, confirmed as ordinary runs (searched_worst_*.toml)"
    fig.suptitle(f"{title}\n{caption}" if title else caption, fontsize=9)
    return fig


# what robustness_lines adds to each worst-case row: no setting field
POINT_EXTRAS = ("worst_diverged", "searched")


def robustness_lines(rows: list[dict[str, Any]], x: str, tuned: Iterable[str] = ()
                     ) -> dict[str, dict[tuple, list[dict[str, Any]]]]:
    """{norm: {a defense's line key: its worst-case table rows (robustbn.worst) along `x`}}: a
    line is a defense with every setting field but `x` (and the `tuned` fields, each point's
    own: `robustbn tune`) fixed; each point carries `worst_diverged`, the runs of its worst
    attack that diverged (counted at chance), `searched`, whether a confirmed attack search's
    runs are among its attacks (their `source`: searched_worst_*.toml); `worst_by_seed` (from
    robustbn.worst) is what a paired comparison of two points pairs."""
    if x not in ROBUSTNESS_X:
        raise ValueError(f"--x {x}: a robustness curve runs along one of {', '.join(ROBUSTNESS_X)}")
    tuned = tuple(tuned)
    if x in X_PARTITION:
        rows = [r for r in rows if r.get("partition", "gamma") == X_PARTITION[x]]
        if not rows:
            raise ValueError(f"--x {x}: no run has partition = {X_PARTITION[x]!r}, whose heterogeneity {x} sets")
    if x in tuned:
        raise ValueError(f"--x {x} --tuned {x}: a curve runs along {x}; its points cannot each be tuned on it")
    table = [t for t in worst_case(rows, tuned) if t.get(x) is not None]
    if not table:
        raise ValueError(f"no finished run has {x}: nothing to plot along it")
    keys, settings = setting_groups(rows)
    for t in table:
        runs = settings.get(tuple(hashable(t.get(k)) for k in keys), [])
        worst = [r for r in runs if t["worst_attack"] not in (None, NO_ATTACK)
                 and all(hashable(r.get(k)) == hashable(t[f"worst_{k}"]) for k in ATTACK_FIELDS)]
        t["worst_diverged"] = sum(accuracy(r)[1] for r in worst)
        t["searched"] = any(source_kind(r["source"]) == SEARCHED for r in runs if r.get("source"))
    fixed = varying(table, set(RESULT) | {"norm", x, *POINT_EXTRAS, *tuned})
    out: dict[str, dict[tuple, list[dict[str, Any]]]] = {}
    for norm in sorted({t["norm"] for t in table}, key=norm_order):
        lines = group([t for t in table if t["norm"] == norm], fixed)
        out[norm] = {k: sorted(pts, key=lambda t: sort_key(t[x])) for k, pts in
                     sorted(lines.items(), key=lambda kv: (kv[1][0]["defense"] != "mean", kv[1][0]["defense"],
                                                           repr(kv[0])))}
    return out


def x_positions(values) -> tuple[list, Callable[[Any], float], bool]:
    """(the values sorted, each value's position on the axis, whether they stand at their own
    values): points far from evenly spaced (gamma 0, 0.1, 0.5, 1) stand at even steps, labelled
    with their values; else the first two crowd into one."""
    at_x = sorted(values)
    gaps = np.diff(at_x)
    even = len(at_x) < 3 or gaps.min() >= 0.5 * gaps.max()
    return at_x, (lambda v: v) if even else (lambda v: float(at_x.index(v))), even


def _tuned_labels(ax, x: float, labels: list[tuple[float, str, str]], gap: float = 4.5) -> None:
    """Each line's label at one x (its tuned values, or its defense), beside its point, pushed
    apart vertically (`gap`: % of the axis a line of text takes) so that lines ending close
    together (at chance, say) stay readable; a long label wraps rather than cross the plot."""
    top, lines_before = -gap, 0
    for y, words, color in sorted(labels):
        words = textwrap.fill(words, 24)  # narrower than the space between two points
        lines = words.count("\n") + 1
        y_at = max(y, top + gap * (lines_before + lines) / 2)  # centre to centre: half of each label's height
        top, lines_before = y_at, lines
        # beside its point, lifted where the label below it would overlap
        # a translucent backing: a label that lands on another line's stroke stays readable
        ax.annotate(words, (x, y), xytext=(7, y_at), textcoords=("offset points", "data"), fontsize=6,
                    color=color, va="center", gid="tuned", annotation_clip=False,
                    bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.75))


def _gapped(ticks: list[float], xs: list[float], *ys: list[float]) -> tuple[list[float], ...]:
    """A line's points (xs ascending) with a NaN wherever it skips one of the axis' `ticks`:
    matplotlib breaks the line there rather than joining across a value it has no point at (a
    point not run yet, or not run for this line)."""
    out_x, out_ys = [], [[] for _ in ys]
    for i, v in enumerate(xs):
        if i and any(xs[i - 1] < t < v for t in ticks):
            out_x.append(float("nan"))
            for o in out_ys:
                o.append(float("nan"))
        out_x.append(v)
        for o, y in zip(out_ys, ys):
            o.append(y[i])
    return (out_x, *out_ys)


def robustness_figure(rows: list[dict[str, Any]], x: str = "gamma", title: str | None = None,
                      tuned: Iterable[str] = ()):
    """One panel per norm protocol; a line per defense: its worst-case accuracy (%) over the
    attacks run (catalogue and confirmed searched) along `x`, the 95% band over the worst
    attack's seeds, its clean accuracy dashed, chance dotted, a ring where an attack search was
    confirmed (the point's worst case is over more attacks), and a cross at a point whose worst
    attack made runs diverge. A defense keeps its color and marker in every panel, and its
    short name (labels.compact_defense). `tuned` (lr): each point's own value is written beside
    it where it differs from the line's point before (the tables give every point's)."""
    tuned = tuple(tuned)
    lines = robustness_lines(rows, x, tuned)
    # a defense with a line per value of another setting (f along gamma, say): each line names it
    points = [t for mine in lines.values() for pts in mine.values() for t in pts]
    apart = [k for k in varying(points, set(RESULT) | {"norm", x, *POINT_EXTRAS, *tuned})
             if k not in DEFENSE_FIELDS | {"defense", "server_data"}]
    server_data = sorted({t["server_data"] for t in points if t.get("server_data")})
    # one kind of server data: "(trusted)", named once in the legend; several: each its own
    trusted = lambda t: ("" if not t.get("server_data") else " (trusted)" if len(server_data) == 1
                         else f" (trusted: {t['server_data']})")
    name = lambda t: compact_defense(t["defense"]) + "".join(f" ({k}={text(t.get(k))})" for k in apart) + trusted(t)
    names = sorted({name(pts[0]) for mine in lines.values() for pts in mine.values()}, key=lambda n: (n != "mean", n))
    seeds = {n: [t["seeds"] for mine in lines.values() for pts in mine.values() for t in pts
                 if name(t) == n and t["worst_acc"] is not None] for n in names}
    pct = lambda v: 100 * v
    at_x, where, even = x_positions({t[x] for t in points})
    ticks = [where(v) for v in at_x]
    span = (ticks[-1] - ticks[0]) or 1.0
    chance = 100 * chance_of(rows[0])
    width = max(4.6 * len(lines) + 1, 8.0)  # one panel: room for the caption and the legend
    fig, axes = plt.subplots(1, len(lines), figsize=(width, 4.8), sharey=True, squeeze=False, layout="constrained")
    handles = {}
    for ax, (norm, mine) in zip(axes[0], lines.items()):
        labels: dict[Any, list[tuple[float, str, str]]] = defaultdict(list)
        if chance > 0:  # a dataset of unknown classes has none to draw
            ax.axhline(chance, color="0.5", linestyle=":", linewidth=1.0, gid="chance")
        for pts in mine.values():
            n = name(pts[0])
            i = names.index(n)
            color = LINE_COLORS[i % len(LINE_COLORS)]
            known = sorted((t for t in pts if t["worst_acc"] is not None), key=lambda t: where(t[x]))
            xs = [where(t[x]) for t in known]
            worst = [pct(t["worst_acc"]) for t in known]
            low = [pct(t["worst_acc"] if t["ci_low"] is None else t["ci_low"]) for t in known]
            high = [pct(t["worst_acc"] if t["ci_high"] is None else t["ci_high"]) for t in known]
            gx, gworst, glow, ghigh = _gapped(ticks, xs, worst, low, high)
            handles[n], = ax.plot(gx, gworst, color=color, marker=MARKERS[i % len(MARKERS)], markersize=5,
                                  linewidth=1.6)
            ax.fill_between(gx, glow, ghigh, color=color, alpha=0.15, linewidth=0)
            # the interval as a bar too: a band between points shows nothing at a lone point
            ax.errorbar(xs, worst, yerr=[[w - lo for w, lo in zip(worst, low)], [hi - w for w, hi in zip(worst, high)]],
                        fmt="none", ecolor=color, elinewidth=0.8, capsize=2, alpha=0.6)
            clean = sorted((t for t in pts if t["no_attack_acc"] is not None), key=lambda t: where(t[x]))
            ax.plot(*_gapped(ticks, [where(t[x]) for t in clean], [pct(t["no_attack_acc"]) for t in clean]), color=color,
                    linestyle="--", linewidth=1.0, marker="o", markersize=4, markerfacecolor="none")  # a lone point shows too
            said = None
            for t in known if tuned else ():  # each point's own tuned values beside it, where they change
                words = " ".join(f"{k} {t.get(k):g}" if isinstance(t.get(k), float) else f"{k} {t.get(k)}" for k in tuned)
                if words != said:
                    labels[where(t[x])].append((pct(t["worst_acc"]), words, color))
                said = words
            searched = [t for t in known if t["searched"]]  # its worst case is over more attacks than a bare point's
            if searched:
                ax.scatter([where(t[x]) for t in searched], [pct(t["worst_acc"]) for t in searched], marker="o", s=110,
                           facecolors="none", edgecolors="black", linewidths=1.0, zorder=4, gid="searched")
            bad = [t for t in known if t["worst_diverged"]]
            if bad:
                ax.scatter([where(t[x]) for t in bad], [pct(t["worst_acc"]) for t in bad], marker="x", s=70, color="black",
                           zorder=5, gid="diverged")
        for at, here in labels.items():
            _tuned_labels(ax, at, here)
        ax.set_title(norm_words(norm), fontsize=10)
        ax.set_xlabel(x if even else f"{x} (its points at even steps)")
        ax.set_xticks(ticks, [text(v) for v in at_x])  # the points' values, never 1.2 of f
        ax.set_xlim(ticks[0] - 0.05 * span, ticks[-1] + 0.12 * span)  # the same in every panel, room for the lr
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 100)
    axes[0][0].set_ylabel("worst-case test accuracy (%)")
    handles = {n: handles[n] for n in names if n in handles}
    counts = {over(min(seeds[n]), max(seeds[n])) for n in handles if seeds[n]}
    once = len(counts) == 1 and all(seeds[n] for n in handles)  # every line on the same seeds: said once, below
    words = [f"{n} ({over(min(seeds[n]), max(seeds[n]))})" if seeds[n] and not once else n for n in handles]
    legend = list(handles.values())
    if any(t["no_attack_acc"] is not None for t in points):
        legend.append(plt.Line2D([], [], color="gray", linestyle="--", marker="o", markerfacecolor="none"))
        words.append("clean accuracy (no attack) at the same tuned lr, the defense's color" if tuned else
                     "clean accuracy (no attack), the defense's color")
    if chance > 0:
        legend.append(plt.Line2D([], [], color="0.5", linestyle=":"))
        words.append(f"chance ({chance:g}%)")
    if any(t["searched"] for t in points):
        legend.append(plt.Line2D([], [], color="black", marker="o", markersize=9, markerfacecolor="none",
                                 linestyle="none"))
        words.append("ringed: a confirmed attack search ran at this point (elsewhere the catalogue's attacks only)")
    if any(t["worst_diverged"] for t in points):
        legend.append(plt.Line2D([], [], color="black", marker="x", linestyle="none"))
        words.append("the worst attack's runs diverged (counted at chance)")
    if len(server_data) == 1:
        legend.append(plt.Line2D([], [], linestyle="none"))
        words.append(f"(trusted): the server's data, {server_data[0]}")
    if any("(grad)" in n or "(BN" in n for n in handles):
        legend.append(plt.Line2D([], [], linestyle="none"))
        words.append("(grad): on the gradients; (BN): on the BN mean and variance")
    columns = 2 if max(map(len, words)) <= 6 * width else 1  # about 12 characters an inch at 7 points
    words = [textwrap.fill(w, width=int(12 * width / columns) - 4) for w in words]
    fig.set_size_inches(fig.get_size_inches()[0],
                        4.8 + 0.2 * (sum(w.count("\n") + 1 for w in words) + 1) // columns)
    fig.legend(legend, words, fontsize=7, loc="outside lower center", ncols=columns)
    band = next(iter(counts)) if once else None
    caption = ("worst case over the attacks run (catalogue and confirmed searched): mean over seeds, "
               + (f"band: {CLIPPED_PERCENT_WORDS}" if not once else f"no band ({band})" if "no interval" in band
                  else f"band: {band} (Student t), clipped to [0, 100]"))
    caption = textwrap.fill(caption, width=int(15 * width))  # about 15 characters an inch at 9 points
    fig.suptitle(f"{title}\n{caption}" if title else caption, fontsize=9)
    return fig


def protocol_figure(rows: list[dict[str, Any]], x: str = "gamma", title: str | None = None,
                    tuned: Iterable[str] = (), expected=None):
    """Which BN protocol along `x` (gamma or f): a panel per threat model, a line per protocol
    (robustbn.worst.protocol_map): at each point its highest defense's worst case (%), the 95%
    interval as a bar, the defense and the `tuned` values written where they change along the
    line (the values alone where the defense stays; a panel with one defense at every point names
    it in its title), chance dotted. A protocol's color is its color in every plot."""
    if x not in ("gamma", "f"):
        raise ValueError(f"--x {x}: protocols are compared along gamma or f")
    other = "f" if x == "gamma" else "gamma"
    tuned = tuple(tuned)
    cells = protocol_map(rows, "gamma", "f", tuned, expected)
    if not cells:
        raise ValueError("no attacked run has both gamma and f: no protocol to compare")
    held = sorted({c[other] for c in cells}, key=sort_key)  # a line per protocol and value of the other axis
    models = [m for m in (False, True) if any((c["threat"] is not None) == m for c in cells)]
    at_x, where, even = x_positions({c[x] for c in cells})
    ticks = [where(v) for v in at_x]
    span = (ticks[-1] - ticks[0]) or 1.0
    chance = 100 * chance_of(rows[0])
    norms = sorted({p["norm"] for c in cells for p in c["protocols"]}, key=norm_order)
    others = [n for n in norms if n not in NORM_COLORS]
    color = lambda n: NORM_COLORS.get(n) or OTHER_COLORS[others.index(n) % len(OTHER_COLORS)]
    fig, axes = plt.subplots(1, len(models), figsize=(max(5.2 * len(models), 8.0), 5.2), sharey=True, squeeze=False,
                             layout="constrained")
    handles, seeds = {}, defaultdict(set)
    for ax, trusted in zip(axes[0], models):
        labels: dict[Any, list[tuple[float, str, str]]] = defaultdict(list)
        if chance > 0:
            ax.axhline(chance, color="0.5", linestyle=":", linewidth=1.0)
        # one defense at every point of the panel: named once in its title, the labels carry the rest
        mine = {compact_defense(p["defense"]) for c in cells if (c["threat"] is not None) == trusted
                for p in c["protocols"]}
        shared = next(iter(mine)) if len(mine) == 1 else None
        for i, (norm, h) in enumerate((n, h) for n in norms for h in held):
            pts = sorted(((c, p) for c in cells if (c["threat"] is not None) == trusted and c[other] == h
                          for p in c["protocols"] if p["norm"] == norm), key=lambda cp: sort_key(cp[0][x]))
            if not pts:
                continue
            name = norm_words(norm) + (f" ({other}={text(h)})" if len(held) > 1 else "")
            xs = [where(c[x]) for c, _ in pts]
            ys = [100 * p["worst_acc"] for _, p in pts]
            low = [100 * (p["worst_acc"] if p["ci_low"] is None else p["ci_low"]) for _, p in pts]
            high = [100 * (p["worst_acc"] if p["ci_high"] is None else p["ci_high"]) for _, p in pts]
            handles[name], = ax.plot(*_gapped(ticks, xs, ys), color=color(norm),
                                     marker=MARKERS[norms.index(norm) % len(MARKERS)],
                                     linestyle=("-", "--", ":", "-.")[held.index(h) % 4], markersize=5, linewidth=1.6)
            ax.errorbar(xs, ys, yerr=[[y - lo for y, lo in zip(ys, low)], [hi - y for y, hi in zip(ys, high)]],
                        fmt="none", ecolor=color(norm), elinewidth=0.8, capsize=2, alpha=0.6)
            said = None
            for (c, p), xv, y in zip(pts, xs, ys):
                seeds[name].add(p["seeds"])
                now = ("" if shared else compact_defense(p["defense"]), ", ".join(f"{k} {text(p.get(k))}" for k in tuned))
                if now != said:  # the defense again where only its tuned values changed: one label fewer to crowd
                    words = now[1] if said and said[0] == now[0] and now[1] else ", ".join(filter(None, now))
                    labels[xv].append((y, words, color(norm)))
                said = now
        for xv, here in labels.items():
            _tuned_labels(ax, xv, here)
        ax.set_title(("trusted server data" if trusted else "root-free") + (f"\nevery point: {shared}" if shared else ""),
                     fontsize=10)
        ax.set_xlabel(x if even else f"{x} (its points at even steps)")
        ax.set_xticks(ticks, [text(v) for v in at_x])
        ax.set_xlim(ticks[0] - 0.05 * span, ticks[-1] + 0.3 * span)  # room for the defenses' names
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("worst-case test accuracy (%)")
    words = [f"{n} ({over(min(seeds[n]), max(seeds[n]))})" for n in handles]
    fig.legend(list(handles.values()), words, fontsize=7, loc="outside lower center", ncols=min(3, len(words)))
    held_words = "" if len(held) > 1 else f" at {other} = {text(held[0])}"
    alone = f", {', '.join(tuned)} alone where only that changes" if tuned else ""
    caption = textwrap.fill(f"each protocol at its highest defense at each point{held_words} (written where it "
                            f"changes{alone}): its worst case over the attacks run, mean over seeds, bar: "
                            f"{CLIPPED_PERCENT_WORDS}; chance dotted", width=int(15 * fig.get_size_inches()[0]))
    fig.suptitle(f"{title}\n{caption}" if title else caption, fontsize=9)
    return fig


def map_figure(rows: list[dict[str, Any]], x: str = "gamma", y: str = "f", title: str | None = None,
               tuned: Iterable[str] = (), expected=None):
    """Which defense to use where (robustbn.worst.defense_map): a panel per norm protocol and
    threat model, a cell per (y, x), colored by the highest worst case there and naming the best
    defense, or those tied for best, with their worst cases (%); `expected`: defense_map's (a
    cell that waits for defenses picks none)."""
    if x not in ROBUSTNESS_X or y not in ROBUSTNESS_X or x == y:
        raise ValueError(f"--x {x} --y {y}: the map's axes are two different fields of {', '.join(ROBUSTNESS_X)}")
    tuned = tuple(tuned)
    cells = defense_map(rows, x, y, tuned, expected)
    if not cells:
        raise ValueError(f"no attacked run has both {x} and {y}: nothing to map")
    norms = list(dict.fromkeys(c["norm"] for c in cells))
    chance = chance_of(rows[0])
    # a panel per protocol and threat model (root-free, then trusted server data, where any protocol
    # ran it), one above the other: side by side, a page's width shrank their words past reading
    models = [m for m in (False, True) if any((c["threat"] is not None) == m for c in cells)]
    xs = sorted({hashable(c[x]) for c in cells}, key=sort_key)
    ys = sorted({hashable(c[y]) for c in cells}, key=sort_key)
    panels = [(n, m) for n in norms for m in models]
    at = lambda p: "".join(f" {k} {p[k]}" for k in tuned)
    band = lambda p: "" if p["ci_low"] is None or p["ci_high"] is None else \
        f" [{100 * p['ci_low']:.0f}, {100 * p['ci_high']:.0f}]"
    broken = lambda p: p["worst_acc"] <= chance + AT_CHANCE

    def words(c: dict[str, Any]) -> str:
        """The cell's verdict, then each pick (those at chance left out where the verdict counts
        them): its defense, then its numbers on a line of their own (the map's table names them all)."""
        head = pick_head(c, chance)
        up = [p for p in c["picks"] if not broken(p)] if "chance" in head else c["picks"]
        lines = textwrap.wrap(head, 24)
        for p in up[:3]:
            lines += [*textwrap.wrap(compact_defense(p["defense"]), 24), f"{100 * p['worst_acc']:.0f}%{band(p)}{at(p)}"]
        more = [f"+{len(up) - 3} more"] * (len(up) > 3)  # those at chance: the verdict counts them
        return "\n".join(lines + [", ".join(more)] * bool(more))

    texts = {id(c): words(c) for c in cells}
    row = max(0.95, 0.13 * max(t.count("\n") + 1 for t in texts.values()) + 0.15)  # inches: the fullest cell fits
    fig, axes = plt.subplots(len(panels), 1, figsize=(1.75 * len(xs) + 2.2, len(panels) * (row * len(ys) + 0.8) + 1),
                             squeeze=False, layout="constrained")
    im = None
    for ax, (norm, trusted) in zip(axes.flat, panels):
        here = [c for c in cells if c["norm"] == norm and (c["threat"] is not None) == trusted]
        grid = np.full((len(ys), len(xs)), np.nan)
        for c in here:
            i, j = ys.index(hashable(c[y])), xs.index(hashable(c[x]))
            top = max(p["worst_acc"] for p in c["picks"])
            grid[i, j] = 100 * top
            ax.text(j, i, texts[id(c)], ha="center", va="center", fontsize=7, linespacing=1.05,
                    color="white" if top < 0.6 else "black")
        ax.set_facecolor("0.93")  # not run
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(xs)), [text(v) for v in xs])
        ax.set_yticks(range(len(ys)), [text(v) for v in ys])
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"{norm_words(norm)}, {'trusted server data' if trusted else 'root-free'}"
                     + ("" if here else ": no run of this threat model among these"), fontsize=9)
    fig.colorbar(im, ax=list(axes.flat), label="the best worst-case accuracy (%)", fraction=0.04, aspect=12 * len(panels))
    seeds = sorted({p["seeds"] for c in cells for p in c["picks"]})
    on = f"{seeds[0]} seeds" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]} seeds (robustbn results --worst-case)"
    caption = textwrap.fill("per cell: the best defense (use), or every one tied for best, paired over seeds; "
                            f"worst-case accuracy (%) over the attacks run [95% interval], on {on}",
                            width=int(15 * fig.get_size_inches()[0]))
    fig.suptitle(f"{title}\n{caption}" if title else caption, fontsize=9)
    return fig


def figure(rows: list[dict[str, Any]], kind: str, title: str | None = None, x: str = "gamma", y: str = "f",
           tuned: Iterable[str] = (), expected=None):
    """The figure of `kind` for the finished runs among `rows` (not saved; see `plot`); `tuned`:
    the fields each defense ran at its own tuned value of (robustness and map); `expected`
    (map and protocols): robustbn.worst.defense_map's, how many defenses a cell is to have."""
    if kind not in KINDS:
        raise ValueError(f"unknown plot kind {kind!r}; allowed: {', '.join(KINDS)}")
    # worst-case counts diverged runs (and finished runs without a history) at chance (robustbn.worst),
    # as its table does; the other plots draw accuracies, which a diverged run has not
    judged = kind in ("worst-case", "robustness", "map", "protocols")
    finished = ("done", "diverged") if judged else ("done",)
    rows = [r for r in rows if r["status"] in finished and (r["history"] or judged)]
    if not rows:
        raise ValueError("no finished runs match: nothing to plot (see `robustbn results`)")
    if kind in ("worst-case", "robustness", "map", "protocols"):  # the title above the caption that says what is drawn
        fig = worst_case_figure(rows, title) if kind == "worst-case" else robustness_figure(rows, x, title, tuned) \
            if kind == "robustness" else protocol_figure(rows, x, title, tuned, expected) if kind == "protocols" \
            else map_figure(rows, x, y, title, tuned, expected)
        title = None
    elif kind == "heatmap":
        fig = heatmap_figure(rows)
    else:
        fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
        legend = curves(rows, ax) if kind == "curves" else heterogeneity(rows, ax, x)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        fig.set_size_inches(8, 5 + 0.16 * len(labels))  # the legend below the axes, whole, however many lines
        fig.legend(handles, labels, fontsize=7, loc="outside lower center")
        if legend.title():
            ax.set_title(legend.title(), fontsize=9)
    if title:
        fig.suptitle(title)
    return fig


def plot(rows: list[dict[str, Any]], kind: str, out: str, title: str | None = None, x: str = "gamma",
         y: str = "f", tuned: Iterable[str] = (), metadata: dict[str, str] | None = None, expected=None) -> None:
    """Save the figure (`figure`) to `out`; `metadata`: PNG text chunks (docs/tables.py writes
    there a digest of the numbers drawn, which `./dev.sh docs --check` compares)."""
    fig = figure(rows, kind, title, x, y, tuned, expected)
    fig.savefig(out, dpi=120, metadata=metadata)
    plt.close(fig)


def toy_figure(out: str, gammas=(0.0, 0.01, 0.1, 0.3, 0.5, 1.0), seed: int = 0) -> dict:
    """Seed 002's Figures 1 and 2: the points normalized by each mode at gamma = 0, and the
    normalization error against centralized BN vs heterogeneity."""
    from .toy import TOY_MODES, normalization_experiment

    fig, axes = plt.subplots(1, 5, figsize=(22, 4.5), layout="constrained")
    shown = normalization_experiment(0.0, seed=seed, keep_points=True)
    raw = shown["central"]["raw"]
    colors = plt.cm.tab10(np.arange(raw.shape[0]))
    panels = [("centralized BN", shown["central"]["points"])] + [(m, shown[m]["points"]) for m in TOY_MODES]
    for ax, (name, pts) in zip(axes, panels):
        for i in range(raw.shape[0]):
            ax.scatter(pts[i, :, 0], pts[i, :, 1], s=6, color=colors[i])
        ax.set_title(f"{name}, gamma = 0 (last round)")
        ax.set_aspect("equal", adjustable="datalim")
    errors = {m: [] for m in TOY_MODES}
    for g in gammas:
        res = normalization_experiment(g, seed=seed)
        for m in TOY_MODES:
            errors[m].append(res[m]["norm_error"])
    for m in TOY_MODES:
        axes[-1].plot(gammas, errors[m], marker="o", label=m)
    axes[-1].set_xlabel("gamma (heterogeneity: 0 = extreme)")
    axes[-1].set_ylabel("normalization error vs centralized BN")
    axes[-1].legend()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"gammas": list(gammas), "norm_error": errors}
