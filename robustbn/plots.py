"""Robustness plots from the results store: accuracy curves, accuracy vs heterogeneity, and
attack x defense heatmaps. Runs that differ only in `seed` are pooled: mean and spread."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

KINDS = ("curves", "heterogeneity", "heatmap")
IGNORED = {"seed", "device", "data_dir"}
SUMMARY = {"final_acc", "best_acc", "final_loss", "rounds_done", "status", "wall_time_s", "hash", "history", "error"}


def varying(rows: list[dict[str, Any]], exclude: set[str] = frozenset()) -> list[str]:
    """Scenario fields that take more than one value among the rows."""
    keys = [k for k in rows[0] if k not in SUMMARY | IGNORED | set(exclude)]
    return [k for k in keys if len({repr(r.get(k)) for r in rows}) > 1]


def group(rows, keys):
    groups = defaultdict(list)
    for r in rows:
        groups[tuple(r.get(k) for k in keys)].append(r)
    return groups


def label(keys, values) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(keys, values)) or "all runs"


def curves(rows, ax):
    keys = varying(rows)
    for values, runs in sorted(group(rows, keys).items(), key=lambda kv: repr(kv[0])):
        rounds = [h["round"] for h in runs[0]["history"]]
        accs = np.array([[h["test_acc"] for h in r["history"]] for r in runs if len(r["history"]) == len(rounds)])
        mean, std = accs.mean(0), accs.std(0)
        (line,) = ax.plot(rounds, mean, label=f"{label(keys, values)} (x{len(accs)})")
        if len(accs) > 1:
            ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")


def heterogeneity(rows, ax, x="gamma"):
    keys = varying(rows, {x})
    for values, runs in sorted(group(rows, keys).items(), key=lambda kv: repr(kv[0])):
        by_x = group(runs, [x])
        xs = sorted(k[0] for k in by_x)
        accs = [[r["final_acc"] for r in by_x[(v,)]] for v in xs]
        ax.errorbar(xs, [np.mean(a) for a in accs], yerr=[np.std(a) for a in accs], marker="o", capsize=3,
                    label=label(keys, values))
    ax.set_xlabel(x)
    ax.set_ylabel("final test accuracy")


def heatmap(rows, fig):
    attack = "bn_attack" if len({r["bn_attack"] for r in rows}) > 1 else "grad_attack"
    defense = "bn_agg" if len({r["bn_agg"] for r in rows}) > 1 else "grad_agg"
    norms = sorted({r["norm"] for r in rows})
    attacks = sorted({r[attack] for r in rows}, key=lambda a: (a != "none", a))
    defenses = sorted({r[defense] for r in rows})
    axes = fig.subplots(1, len(norms), squeeze=False)[0]
    for ax, norm in zip(axes, norms):
        grid = np.full((len(attacks), len(defenses)), np.nan)
        for i, a in enumerate(attacks):
            for j, d in enumerate(defenses):
                accs = [r["final_acc"] for r in rows if r["norm"] == norm and r[attack] == a and r[defense] == d]
                if accs:
                    grid[i, j] = np.mean(accs)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.6 else "black", fontsize=8)
        ax.set_xticks(range(len(defenses)), defenses, rotation=30, ha="right")
        ax.set_yticks(range(len(attacks)), attacks)
        ax.set_title(f"norm = {norm}")
        ax.set_xlabel(defense)
        ax.set_ylabel(attack)
    fig.colorbar(im, ax=list(axes), label="final test accuracy (mean over seeds)")


def plot(rows: list[dict[str, Any]], kind: str, out: str, title: str | None = None, x: str = "gamma") -> None:
    rows = [r for r in rows if r["status"] == "done" and r["history"]]
    if not rows:
        raise ValueError("no finished runs match: nothing to plot (see `robustbn results`)")
    if kind == "heatmap":
        fig = plt.figure(figsize=(4.5 * len({r["norm"] for r in rows}) + 1.5, 4.2), layout="constrained")
        heatmap(rows, fig)
    else:
        fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
        curves(rows, ax) if kind == "curves" else heterogeneity(rows, ax, x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=120)
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
