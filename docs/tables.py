"""Every table, number and verdict of docs/results.md, from the runs of docs/results.csv (or a
store): the cog blocks of results.md call the functions below (`./dev.sh docs` runs cog; `./dev.sh
docs --check` fails where the file differs from what the runs give).

A cell is "mean [low, high] (n seeds)": the mean over seeds of the final test accuracy (%) and its
95% interval (Student t over seeds, clipped to [0, 100]: robustbn.stats), "mean (1 seed)" where
one seed ran. A comparison of B against A pairs the seeds both ran: "B - A = +x [low, high] (n
pairs)" and a verdict: "higher" or "lower" where the paired interval excludes 0, "tied" where it
does not, and "n seeds, no verdict" below `MIN_PAIRS` pairs (robustbn.stats), whatever the interval.
Each table says which BN message the attack touched: the mean only (seed 002's attack; the
variance messages `honest`), both statistics alike (`bn_attack`), or the variance only.

    python docs/tables.py                      # every section, from docs/results.csv
    python docs/tables.py results/paper.sqlite # from a store
    ROBUSTBN_DOCS_RUNS=results/paper.sqlite ./dev.sh docs
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from contextlib import chdir
from functools import cache
from pathlib import Path
from typing import Any

from robustbn.channels import NOT_ATTACKS, expand_channels
from robustbn.labels import attack_short, attack_words, setting_defense_words
from robustbn.stats import MIN_PAIRS, Estimate, by_seed, ci_text, distinct, paired, seeds_interval, too_few
from robustbn.store import FINISHED, Store, device_aliases, read_export
from robustbn.worst import AT_CHANCE, ATTACK_KEYS, NOT_SETTING, SEARCHED_PREFIX

ROOT = Path(__file__).resolve().parent.parent
SOURCE = os.environ.get("ROBUSTBN_DOCS_RUNS", str(ROOT / "docs" / "results.csv"))
SOURCE_NAME = os.path.relpath(SOURCE, ROOT) if os.path.isabs(SOURCE) else SOURCE
WORST_CASE_MATRIX = "scenarios/worst_case_fmnist.toml"
SEARCHED = ("fbn_nnm_trmean", "fbn_dnc", "naive_dnc")


# ---- the runs -------------------------------------------------------------------------------

def load(path: str) -> list[dict]:
    """The finished runs (done, and diverged: they count at chance, 1 / classes) of a store or a CSV export,
    as `Store.rows()` gives them (a CSV is imported into a temporary store first)."""
    if not path.endswith(".csv"):
        with Store(path, readonly=True) as store:
            return store.rows(status=FINISHED)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "runs.sqlite")
        try:
            store.add([read_export(path)])
            return store.rows(status=FINISHED)
        finally:
            store.close()


@cache
def rows() -> tuple[dict, ...]:
    return tuple(load(SOURCE))


def sel(pred=lambda r: True, **eq) -> list[dict]:
    """The runs where `pred` holds and every field equals its value (numbers as floats)."""
    def same(a, b):
        return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))
    return [r for r in rows() if pred(r) and all(same(r.get(k), v) for k, v in eq.items())]


def cpu_schedule(r) -> bool:
    """The scaled-down DSGD setting of fbn_fig3_fmnist.toml and fbn_fig4_fmnist.toml."""
    return (r["algorithm"] == "dsgd" and r["partition"] == "gamma" and r["model"] == "simple-cnn"
            and r["rounds"] == 200 and r["n"] == 10 and r["batch_size"] == 50 and r["bn_momentum"] == 0.1)


def touched(r) -> str:
    """Which BN messages the Byzantine clients attack: "mean" (the variance honest or silent),
    "variance", "both" (the same attack on each), "none", or "other"."""
    mean, var = r["bn_mean_attack"], r["bn_var_attack"]
    if mean in NOT_ATTACKS and var in NOT_ATTACKS:
        return "none"
    if var in NOT_ATTACKS:
        return "mean"
    if mean in NOT_ATTACKS:
        return "variance"
    return "both" if (mean, r["bn_mean_attack_params"]) == (var, r["bn_var_attack_params"]) else "other"


# ---- cells, comparisons ---------------------------------------------------------------------

def interval_cell(e: Estimate) -> str:
    """ "75.3 [62.7, 87.9] (2 seeds)", "76.3 (1 seed)", "-" for none."""
    if not e.n:
        return "-"
    ci = f" {ci_text(e.low, e.high, e.n, scale=100, digits=1)}" if e.has_interval else ""
    return f"{100 * e.mean:.1f}{ci} ({e.n} seed{'s' * (e.n != 1)})"


def cell(runs) -> str:
    return interval_cell(seeds_interval(runs))


def verdict(d: Estimate, higher: str = "higher", lower: str = "lower", min_pairs: int = MIN_PAIRS) -> str:
    """The word a paired difference supports: `higher`, `lower`, "tied", or "n seeds, no verdict"."""
    if d.n < min_pairs:
        return f"{d.n} seed{'s' * (d.n != 1)}, no verdict"
    return (higher if d.low > 0 else lower) if distinct(d) else "tied"


def diff(b_runs, a_runs, higher="higher", lower="lower", min_pairs: int = MIN_PAIRS) -> str:
    """B - A paired over seeds, in points: "+1.5 [1.4, 1.6] (2 pairs; 2 seeds, no verdict)"."""
    return seeds_diff(by_seed(b_runs), by_seed(a_runs), higher, lower, min_pairs)


def seeds_diff(b: dict, a: dict, higher="higher", lower="lower", min_pairs: int = MIN_PAIRS) -> str:
    """`diff` of two {seed: accuracy}."""
    d = paired(a, b)
    if not d.n:
        return "no seed in common"
    ci = ci_text(d.low, d.high, d.n, scale=100, digits=1, unit="pair")
    ci = f" {ci}" if d.has_interval else ""
    return f"{_gain(d.mean)}{ci} ({d.n} pair{'s' * (d.n != 1)}; {verdict(d, higher, lower, min_pairs)})"


# the paper's schedule (T = 1500) costs 7.5x a T = 200 run: issue 30 lets its findings stand on 3 seeds
LONG_MIN_PAIRS = 3
_cut: list[str] = []  # the comparisons of the block being generated that stand on too few seeds


def compare(what: str, b_runs, a_runs, higher="higher", lower="lower", min_pairs: int = MIN_PAIRS) -> None:
    """One generated line: "- what: cell B against cell A; B - A = ... (verdict)". A comparison on
    fewer than `min_pairs` paired seeds is not quoted: `findings` lists it as cut."""
    n = paired(by_seed(a_runs), by_seed(b_runs)).n
    if n < min_pairs:
        _cut.append(f"{what} ({n} of {min_pairs} seeds run)")
        return
    print(f"- {what}: {cell(b_runs)} against {cell(a_runs)}; difference "
          f"{diff(b_runs, a_runs, higher, lower, min_pairs)}")


def findings(block):
    """A cog block of comparisons, ending with the ones cut for too few seeds (named, not quoted)."""
    def run() -> None:
        _cut.clear()
        block()
        if _cut:
            print(f"- Not quoted until they stand on enough seeds (`docs/reproduce.sh` makes the rest): "
                  f"{'; '.join(_cut)}.")
        _cut.clear()
    run.__name__, run.__doc__ = block.__name__, block.__doc__
    return run


def pivot(runs, row_key, col_key) -> None:
    table = defaultdict(list)
    for r in runs:
        table[row_key(r), col_key(r)].append(r)
    if not table:
        print("\n(no runs)\n")
        return
    rows_ = sorted({k[0] for k in table}, key=str)
    cols = sorted({k[1] for k in table}, key=str)
    print("| | " + " | ".join(map(str, cols)) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows_:
        print(f"| {r} | " + " | ".join(cell(table[r, c]) for c in cols) + " |")
    print()


def attack_cell(r, channel) -> str:
    """'no attack (10 honest)', 'no attack (7 honest)' or 'attack / defense' of one BN channel."""
    if r["f"] == 0:
        return "no attack (10 honest)"
    if touched(r) == "none":
        return "no attack (7 honest)"
    attack, params = r[f"{channel}_attack"], r[f"{channel}_attack_params"]
    return f"{attack}{json.dumps(params) if params else ''} / {r[f'{channel}_agg']}"


# ---- the leaderboard and the worst case ------------------------------------------------------

@cache
def file_runs(path: str) -> tuple[dict, ...]:
    """The finished runs of one scenario file, each with `source` (expanding a file is the slow
    part: once per file)."""
    from robustbn.report import read_rows

    with chdir(ROOT):  # the files' paths as the page and the tables print them: relative to the repository
        return tuple(read_rows(list(rows()), [path]))


@cache
def matrix_runs(files: tuple[str, ...]) -> tuple[dict, ...]:
    """The runs of any of the files, each once, with the first file that holds it (as
    robustbn.worst.matrix_rows)."""
    out = {}
    for path in files:
        for r in file_runs(path):
            out.setdefault(r["hash"], r)
    return tuple(out.values())


# The leaderboard's and worst-case tables' seeds: the catalogue's, so that every attack of a cell,
# searched or not, stands on the same seeds (a search's own trial seeds are its tuning data).
BOARD_SEEDS = range(5)


def board_runs() -> list[dict]:
    return [r for r in matrix_runs(board_files()) if r["seed"] in BOARD_SEEDS]


def board_files() -> tuple[str, ...]:
    from robustbn.report import default_matrices

    return tuple(default_matrices(ROOT))


def leaderboard() -> None:
    from robustbn.report import leaderboard as board, markdown

    print(markdown(board(board_runs())))


def board_protocols() -> None:
    """Which BN protocol on the board, per gamma (robustbn.report's leaderboard: its protocol_map
    cells, and the same threat models and searches as the page's)."""
    from robustbn.labels import norm_order
    from robustbn.report import board_protocol_parts
    from robustbn.report import leaderboard as board
    from robustbn.stats import chance as chance_of

    runs = board_runs()
    seeds = {g: len({r["seed"] for r in runs if r["gamma"] == g}) for g in sorted({r["gamma"] for r in runs})}
    print("Each protocol at its highest row of the board (lr 0.05), the protocols compared by the same paired rule "
          "over seeds (a seed fixes the data split and the initial model); the verdict on the first row, under it "
          "each other protocol, \"lower by\" its paired gap where the interval excludes 0, else \"tied\". Each "
          "protocol's row is chosen on the seeds it is compared on. \"searched\": a confirmed search's attack is "
          "among its attacks; a verdict a search could still turn (its leader, or a protocol tied with it, "
          "unsearched) is provisional. Seeds per gamma: "
          + ", ".join(f"gamma = {g:g}: {n}" for g, n in seeds.items()) + f" (no verdict below {MIN_PAIRS}).\n")
    boards = {g: board(runs, g) for g in seeds}
    parts = {g: board_protocol_parts(b) for g, b in boards.items()}
    planned = {t: sorted({n for p, _ in parts.values() for n in p[t]}, key=norm_order) for t in (False, True)}
    found = lambda c, t: parts[c["gamma"]][1](c, t)
    protocol_tables([c for b in boards.values() for c in b.protocols or []], chance_of(runs[0]), planned,
                    lambda c, t: ", searched" if found(c, t) else "", found)


# ---- robustness curves (issue 40) ------------------------------------------------------------

ROBUSTNESS_MATRIX = "scenarios/robustness_fmnist.toml"
TUNED_DIR = "scenarios/tuned/robustness_fmnist"  # robustbn tune ROBUSTNESS_MATRIX ... --out TUNED_DIR
# 0.005 and 0.2 widened the first grid (0.01, 0.05, 0.1), where 56 of 66 choices sat at an end;
# 0.002 then, where bucketing+cc's every choice but one sat at 0.005 and a pilot found 0.002 ten
# points higher (0.001 and 0.4 lower or level: docs/performance.md, "The lr grid's second widening").
# New values come last so that ties (every lr at chance) still go to the earlier grid's values
LR_GRID = (0.01, 0.05, 0.1, 0.005, 0.2, 0.002)
GRID_OPTION = f"--grid 'lr=[{','.join(map(str, LR_GRID))}]'"
TUNE_COMMAND = f"robustbn tune {ROBUSTNESS_MATRIX} {GRID_OPTION} --db results/board.sqlite --out {TUNED_DIR} --jobs 2"
SWEEPS = {"gamma": ("f", 3), "f": ("gamma", 0.1)}  # along x, the other field held at
TUNED = ("lr",)


def tuning_rule() -> None:
    """The tuning rule as the lanes run it: LR_GRID's values, its tie order, the seeds."""
    from robustbn.tune import REPORT_SEEDS, TUNING_SEEDS

    def words(seeds):
        if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[-1] + 1)):
            return f"{seeds[0]}-{seeds[-1]}"
        return ", ".join(map(str, seeds[:-1])) + f" and {seeds[-1]}"
    print(f"Each defense's learning rate is tuned at each point, under the catalogue's attacks, before its reported "
          f"runs, by ByzFL's rule (the max "
          f"over lr in {{{', '.join(f'{v:g}' for v in sorted(LR_GRID))}}} of the worst case over the attacks; a "
          f"tie goes to the one listed first in {', '.join(f'{v:g}' for v in LR_GRID)}, the order they joined the grid "
          f"in) on seeds {words(TUNING_SEEDS)}; it is then run on seeds {words(REPORT_SEEDS)}.")


def tuning_file() -> str:
    return f"{TUNED_DIR}/tune_{Path(ROBUSTNESS_MATRIX).stem}.toml"


def own_seed_runs(path: str) -> list[dict]:
    """A file's runs on the seeds it names (`file_runs` matches a file's cells at any seed: an
    attack search's trial of the same setting on seed 10 is no run of a seeds-0-4 file)."""
    from robustbn.matrix import read

    seeds = read(ROOT / path)["seed"]
    return [r for r in file_runs(path) if r["seed"] in (seeds if isinstance(seeds, list) else [seeds])]


def tuning_runs() -> list[dict]:
    """The tuning file's runs on its tuning seeds: the reported seeds never enter a choice."""
    return own_seed_runs(tuning_file())


def curve_cell(row: dict) -> tuple:
    """A run's or a defense's point and threat model: (norm, gamma, f, server data)."""
    from robustbn.worst import server_data

    return row["norm"], row["gamma"], row["f"], server_data(row)


@cache
def planned_defenses() -> dict[tuple, dict[tuple, str]]:
    """The defenses the tuning plans per curve_cell (a map cell's full set): {identity: its name
    in the worst-case tables' words}."""
    plan, _, by_hash = tuning_plan()
    planned = defaultdict(dict)
    for h in sorted(plan.hashes):  # a set: its order would change with each process's string hashing
        row = expand_channels(by_hash[h].to_dict())
        planned[curve_cell(row)][plan.identity(row)] = setting_defense_words(row)
    return dict(planned)


def expected_defenses(norm, threat, gamma, f) -> int | None:
    """defense_map's `expected`: how many defenses the cell plans (None where the tuning is not written)."""
    if not (ROOT / tuning_file()).is_file():
        return None
    return len(planned_defenses().get((norm, float(gamma), int(f), threat), {})) or None


@cache
def tuning_plan():
    """The tuning as `robustbn tune` runs it: its plan (robustbn.tune.Tuning), each run's grid
    point, and the file's runs by hash."""
    from robustbn.matrix import read
    from robustbn.tune import Tuning, expand_grid

    grid = {"lr": read(ROOT / tuning_file())["lr"]}  # the grid as the tuning ran it, in its order
    with chdir(ROOT):
        by_hash, point_of = expand_grid(Path(tuning_file()), grid)
    return Tuning([(h, sc.to_dict()) for h, sc in by_hash.items()], grid, point_of), point_of, by_hash


def tuned_files() -> tuple[str, ...]:
    return tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / TUNED_DIR).glob("tuned_*.toml")))


def curve_confirmations() -> tuple[str, ...]:
    """The confirmation files of the searches at the curves' points (curve_searches)."""
    return tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / TUNED_DIR).glob(f"{SEARCHED_PREFIX}*.toml")))


def all_finished(path: str) -> bool:
    """Whether every run of a file has finished (a tuned file half run has a worst case over
    some of its attacks only: the curves wait for the rest)."""
    done = {r["hash"] for r in own_seed_runs(path)}
    return all(not done.isdisjoint(hashes) for hashes in planned_run_hashes(path))


_RUN_HASHES: dict[str, tuple] = {}  # path -> (its planned scenarios, their hashes on every device)


def planned_run_hashes(path: str) -> tuple[list[str], ...]:
    """Each planned run's hashes on every device (robustbn.store.same_run_hashes), hashed once per
    `planned_scenarios` answer: the curves ask for every file's many times over."""
    from robustbn.store import same_run_hashes

    scenarios = planned_scenarios(path)
    kept = _RUN_HASHES.get(path)
    if kept is None or kept[0] is not scenarios:  # another answer (a test's, a file read again)
        kept = _RUN_HASHES[path] = (scenarios, tuple(same_run_hashes(sc) for sc in scenarios))
    return kept[1]


def curve_files() -> tuple[str, ...]:
    """The files the curves read: the tuned files and search confirmations whose runs have all finished."""
    return tuple(f for f in tuned_files() + current_confirmations() if all_finished(f))


def curve_runs(x: str | None = None) -> list[dict]:
    """The reported runs of the curves (seeds 0-4 of the tuned files and of the confirmations of
    the searches at their points, each once all its runs have finished), along `x` where given."""
    files = curve_files()
    runs = [r for r in matrix_runs(files) if r["seed"] in BOARD_SEEDS] if files else []
    if x is None:
        return runs
    held, value = SWEEPS[x]
    return [r for r in runs if float(r[held]) == value]


def planned_scenarios(path: str) -> tuple[dict, ...]:
    """A file's runs, each as the scenario dict `robustbn run` hashes (expanded again only once
    the file changes)."""
    return _planned_scenarios(ROOT, path, (ROOT / path).stat().st_mtime_ns)


@cache
def _planned_scenarios(root: Path, path: str, mtime_ns: int) -> tuple[dict, ...]:
    from robustbn.matrix import expand, read

    with chdir(root):
        return tuple(sc.to_dict() for sc in expand(read(path), path))


def planned_hashes(path: str) -> frozenset[str]:
    """The hashes of a file's runs (on this machine's device, as `robustbn run` stores them)."""
    return frozenset(hashes[0] for hashes in planned_run_hashes(path))


def runs_planned(path: str, attacked: bool = False) -> int:
    from robustbn.matrix import planned

    with chdir(ROOT):  # as file_runs reads it: the same file, expanded once
        return planned(path, attacked)


@cache  # four sections print it: the tuning file is expanded once
def tuning_status() -> str:
    """How far the tuning and the tuned runs are, in one sentence (the curves' coverage)."""
    from robustbn.matrix import expand, read

    if not (ROOT / tuning_file()).is_file():
        values = read(ROOT / ROBUSTNESS_MATRIX)
        reported = len(expand(values, ROBUSTNESS_MATRIX))
        tuning = len(expand({**values, "seed": [10, 11]}, ROBUSTNESS_MATRIX))
        return (f"Not run yet: each point's defenses are tuned first (`{TUNE_COMMAND}`: seeds 10 and 11, "
                f"{tuning} runs a grid value, {len(LR_GRID) * tuning} in all), then their tuned files run on seeds 0-4 "
                f"({reported} runs) "
                f"(`robustbn run {TUNED_DIR}/tuned_*.toml`). Until then the curves and the map stand on no run.")
    from robustbn.labels import is_attack

    done = {r["hash"] for r in tuning_runs() if is_attack(r)}
    total, attacked = runs_planned(tuning_file()), runs_planned(tuning_file(), attacked=True)  # expanded once
    def count(files):  # (finished, planned) runs on seeds 0-4
        return (len({r["hash"] for f in files for r in own_seed_runs(f)}),
                len({h for f in files for h in planned_hashes(f)}))

    (reported, planned), (searched, confirming) = count(tuned_files()), count(current_confirmations())
    return (f"Tuning ran {len(done)} of at most {attacked} attacked runs (`{tuning_file()}`: {total} runs, of which "
            f"the rule reads the attacked ones; pruning skipped the rest of a point's attacks once it could not be "
            f"chosen); tuned points: {len(tuned_files())} of {len(tuning_plan()[0].defenses)} files written, "
            f"{reported} of their {planned} runs on seeds 0-4 (and {searched} of the {confirming} runs of the "
            f"searches' confirmations at the tuned lr); the curves and the map read the "
            f"{sum(map(all_finished, tuned_files()))} tuned files whose runs have all finished.")


def _digest(drawn) -> str:
    """A digest of what a figure draws (the text prints it, the PNG carries it): `--check` fails
    where a number changes."""
    import hashlib

    return hashlib.sha256(json.dumps(drawn, default=str).encode()).hexdigest()[:16]


def _curve_digest(lines: dict) -> str:
    """A digest of the numbers a robustness figure draws: the figure is stale where it differs."""
    drawn = [(norm, t["defense"], t.get("server_data"), *(t.get(k) for k in (*SWEEPS, *TUNED)),
              *(None if t.get(k) is None else round(t[k], 6) for k in ("worst_acc", "ci_low", "ci_high", "no_attack_acc")),
              t["seeds"], t["worst_diverged"], t["searched"]) for norm, mine in lines.items() for pts in mine.values()
             for t in pts]
    return _digest(drawn)


def _map_digest(cells: list[dict]) -> str:
    """A digest of what the map figure draws: each cell's verdict and picks."""
    drawn = [(c["norm"], c["threat"], c["gamma"], c["f"], c["verdict"],
              [(p["defense"], round(p["worst_acc"], 6), *(p.get(k) for k in TUNED)) for p in c["picks"]])
             for c in cells]
    return _digest(drawn)


def robustness_table(x: str) -> None:
    """Per protocol, a row per defense and point along `x` (narrow enough for a phone): the worst
    case over the attacks run (95% interval, seeds), whether a confirmed search's attack is among
    them, the tuned lr, the clean accuracy; then the figure, its digest in the text, so that
    `./dev.sh docs --check` fails where the figure is stale (the PNG carries the same digest:
    tests/test_docs.py)."""
    from robustbn.labels import compact_defense, norm_words
    from robustbn.matrix import read
    from robustbn.plots import plot, robustness_lines

    runs = curve_runs(x)
    held, value = SWEEPS[x]
    if not runs:
        print(f"No reported run along {x} (at {held} = {value}) yet. {tuning_status()}")
        return
    lines = robustness_lines(runs, x, TUNED)
    xs = sorted({t[x] for mine in lines.values() for pts in mine.values() for t in pts})
    # the matrix's protocols, or their planned defenses, with no finished point yet: said, not left to be missed
    norms = read(ROOT / ROBUSTNESS_MATRIX)["norm"] if (ROOT / ROBUSTNESS_MATRIX).is_file() else []
    planned = planned_defenses() if (ROOT / tuning_file()).is_file() else {}
    missing = []
    for n in norms:
        drawn = defaultdict(set)  # defense: the points along x it has finished
        for pts in lines.get(n, {}).values():
            drawn[pts[0]["defense"]].update(t[x] for t in pts)
        want = defaultdict(set)  # defense: the points along x it is planned at
        for (norm, *at, _), ds in planned.items():
            point = dict(zip(("gamma", "f"), at))
            if norm == n and point[held] == value:
                for w in ds.values():
                    want[w].add(point[x])
        left = [compact_defense(w) + ("" if not drawn[w] else f" at {x} = {', '.join(f'{v:g}' for v in sorted(lack))}")
                for w in sorted(want) if (lack := want[w] - drawn[w])]
        if n not in lines:
            missing.append(norm_words(n))
        elif left:
            missing.append(f"{norm_words(n)}'s {' and '.join(left)}")
        elif not planned and all(pts[0].get("server_data") for pts in lines[n].values()):
            missing.append(f"{norm_words(n)}'s root-free defenses")
    print(f"{held} = {value}. A row per defense and {x}: the worst case over the attacks run (%) [95% CI] (seeds; a "
          f"diverged run is scored at chance, and the diverged runs are counted), \"searched\" where a confirmed attack search's attack is "
          f"among them (elsewhere the catalogue's only: such a point can still fall), the lr tuned at that point, "
          f"the clean accuracy. (grad): on the gradients, (BN): on the BN mean and variance. {tuning_status()}"
          + (f" Not here yet (tuning, or their tuned files' runs, not finished): {'; '.join(missing)}." if missing
             else "")
          + "\n")
    for norm, mine in lines.items():
        print(f"{norm_words(norm)}:\n")
        print(f"| defense | {x} | worst case (%) | searched | lr | clean (%) |")
        print("|---|---|---|---|---|---|")
        data = sorted({pts[0]["server_data"] for pts in mine.values() if pts[0].get("server_data")})
        for pts in mine.values():
            at = {t[x]: t for t in pts}
            words = compact_defense(pts[0]["defense"]) + (" (trusted)" if pts[0].get("server_data") else "")
            for v in xs:
                t = at.get(v)
                if t is None or t["worst_acc"] is None:
                    print(f"| {words} | {v:g} | - |  |  |  |")
                    continue
                e = Estimate(t["seeds"], t["worst_acc"], t["ci_low"], t["ci_high"], t["worst_std"])
                dv = f", {t['worst_diverged']} diverged" if t["worst_diverged"] else ""
                clean = "-" if t["no_attack_acc"] is None else interval_cell(
                    Estimate(t["no_attack_seeds"], t["no_attack_acc"], t["no_attack_low"], t["no_attack_high"], None))
                print(f"| {words} | {v:g} | {interval_cell(e)}{dv} | {'yes' if t['searched'] else ''} | "
                      f"{t['lr']:g} | {clean} |")
        print("".join(f"\n(trusted): the server's data, {d}." for d in data) + "\n")
    digest = _curve_digest(lines)
    image = ROOT / "docs" / "img" / f"robustness_{x}.png"
    if not os.environ.get("ROBUSTBN_DOCS_CHECK"):
        plot(runs, "robustness", str(image), x=x, tuned=TUNED, metadata={"robustbn-data": digest},
             title=f"Fashion-MNIST, n = 10, {held} = {value}; each defense at its tuned lr")
    print(f"![worst case along {x}](img/robustness_{x}.png) <!-- data {digest} -->")


NEAR_CHANCE = 0.1  # a curve starting this close to chance has too little room to fall along f


def f_sweep_level() -> None:
    """Why the f sweep holds gamma at SWEEPS["f"]: each protocol's best root-free worst case at
    f = 3, on the board (gamma = 0, the matrix's lr) and on the curves at gamma = 0 and at the
    sweep's level (each defense at its tuned lr), against chance."""
    from robustbn.data import num_classes
    from robustbn.labels import label_sorted_words, norm_words
    from robustbn.matrix import read
    from robustbn.plots import robustness_lines
    from robustbn.report import leaderboard as board
    from robustbn.stats import chance as chance_of

    held = SWEEPS["f"][1]
    f = SWEEPS["gamma"][1]
    values = read(ROOT / ROBUSTNESS_MATRIX)
    chance = chance_of(values)
    lr = values["lr"]

    def best(table, planned=None):  # planned: how many root-free defenses the point is to have
        free = [t for t in table if not t.get("server_data") and t["worst_acc"] is not None]
        if planned and 0 < len(free) < planned:  # the highest of some is no pick: the rest may stand above it
            return None, f"{len(free)} of {planned} finished", False
        e = max(free, key=lambda t: t["worst_acc"], default=None)
        if e is None:
            return None, "-", False
        est = Estimate(e["seeds"], e["worst_acc"], e["ci_low"], e["ci_high"], e.get("worst_std"))
        holds = e["ci_low"] is not None and e["ci_low"] <= chance <= e["ci_high"]
        return e["worst_acc"], f"{interval_cell(est)}, {e['defense']}" + (f", lr {e['lr']:g}" if "lr" in e else ""), holds

    on_board = defaultdict(list)
    for r in board(board_runs()).rows:
        on_board[r["norm"]].append(r)
    runs = curve_runs("gamma")
    curve = robustness_lines(runs, "gamma", TUNED) if runs else {}
    at = lambda norm, g: [t for pts in curve.get(norm, {}).values() for t in pts if t["gamma"] == g]
    on_curve = lambda norm, g: best(at(norm, g), expected_defenses(norm, None, g, f))[:2]
    spread = label_sorted_words(num_classes(values["dataset"]), [values["n"] - f])
    print(f"Why gamma = {held:g}: at gamma = 0 {spread}, and a curve along f "
          f"means something only where the defenses stand above chance ({100 * chance:.0f}%) at f = {f}. Each "
          f"protocol's highest root-free worst case at f = {f} (the board: lr {lr:g}; the curves: each defense at its "
          f"tuned lr, finished points only):\n")
    print(f"| protocol | the board, gamma = 0 | the curves, gamma = 0 | the curves, gamma = {held:g} |")
    print("|---|---|---|---|")
    low, lifted, board_best = [], [], {}
    for norm in values["norm"]:
        board_acc, board_text, holds_chance = best(on_board.get(norm, []))
        board_best[norm] = board_acc
        if board_acc is not None and board_acc - chance < NEAR_CHANCE:
            low.append(f"{norm_words(norm)}'s best stands {100 * (board_acc - chance):.1f} points above chance"
                       + (" (its interval holding chance)" if holds_chance else ""))
            if (tuned_acc := on_curve(norm, 0.0)[0]) is not None and tuned_acc - chance >= NEAR_CHANCE:
                lifted.append((norm_words(norm), tuned_acc))
        print(f"| {norm_words(norm)} | {board_text} | {on_curve(norm, 0.0)[1]} | {on_curve(norm, held)[1]} |")
    print()
    possessive = [(f"{n}'s", acc) for n, acc in lifted]
    roomy_board = [f"{norm_words(n)}'s {100 * (acc - chance):.1f}" for n, acc in board_best.items()
                   if acc is not None and acc - chance >= NEAR_CHANCE]
    if low:
        print(f"On the board at gamma = 0, {', '.join(low)}: a sweep of f there would have almost no room to "
              f"fall" + (f" (the level was not chosen for {' and '.join(roomy_board)} points above chance)"
                         if roomy_board else "") +
              f", so the f sweep holds gamma = {held:g}, the smallest gamma above 0 that the gamma sweep runs "
              f"(the most heterogeneous level after gamma = 0). That was chosen before the curves ran."
              + (f" On the curves, each defense at its tuned lr, gamma = 0 has more room than that: "
                 f"{', '.join(n + f' best stands at {100 * acc:.1f}' for n, acc in possessive)}. For "
                 f"{' and '.join(n for n, _ in lifted)} the premise held at the board's lr {lr:g}, not at the tuned "
                 f"ones; the level was kept, since its runs had started." if lifted else ""))
    else:
        print(f"No protocol's best root-free row on the board stands within {100 * NEAR_CHANCE:.0f} points of chance "
              f"at gamma = 0 now; "
              f"the f sweep holds gamma = {held:g} as the file was set.")
    # the same test on the curves, at the sweep's level and along gamma: where the choice held, and where not
    near = [(norm, acc) for norm in values["norm"] if (acc := on_curve(norm, held)[0]) is not None
            and acc - chance < NEAR_CHANCE]
    if near:
        roomy = [g for g in sorted(values["gamma"]) if g > held and all(
            (acc := on_curve(norm, g)[0]) is not None and acc - chance >= NEAR_CHANCE for norm, _ in near)]
        from robustbn.worst import BEST, TIED, defense_map

        # the f values where the map's root-free pick (or tied set) stands above chance: where the f curve says anything
        apart = defaultdict(set)  # per protocol
        for c in defense_map(curve_runs("f"), "gamma", "f", TUNED):
            if c["threat"] is None and c["verdict"] in (BEST, TIED) and all(
                    p["worst_acc"] > chance + ABOVE_CHANCE for p in c["picks"]):  # none tied with chance
                apart[c["norm"]].add(c["f"])
        where = ", ".join(f"{norm_words(norm)}'s " + (f"at f = {', '.join(map(str, sorted(apart[norm])))} only"
                                                       if apart[norm] else "at no f") for norm, _ in near)
        lower = [f"{norm_words(norm)} ({100 * acc:.1f} against {100 * zero:.1f})" for norm, acc in near
                 if (zero := on_curve(norm, 0.0)[0]) is not None and acc <= zero]
        # near chance at gamma = 0 too, where the board stood higher: the tuned lr and the searches lost that
        # room, not the level
        flat = [f"{norm_words(norm)} {100 * zero:.1f} against the board's {100 * board_best[norm]:.1f}"
                for norm, _ in near if (zero := on_curve(norm, 0.0)[0]) is not None and zero - chance < NEAR_CHANCE
                and board_best.get(norm) is not None and board_best[norm] - chance >= NEAR_CHANCE]
        print(f"\nMeasured on the curves (each defense at its tuned lr, the searches' attacks included): at gamma = "
              f"{held:g}, f = {f}, " + " and ".join(f"{norm_words(norm)}'s best stands {100 * (acc - chance):.1f} "
                                                   f"points above chance" for norm, acc in near)
              + (f", no higher than at gamma = 0: {', '.join(lower)}" if lower else "")
              + (f". At gamma = 0 the curves stand within {100 * NEAR_CHANCE:.0f} points of chance too, where the "
                 f"board (lr {lr:g}) stands higher ({', '.join(flat)}): that room is on neither level of the "
                 f"curves, so it was not the level that lost it" if flat else "")
              + f". Along f, the map's root-free pick stands above chance: {where}. "
              + (f"At gamma = {roomy[0]:g} {' and '.join(norm_words(n) for n, _ in near)} "
                 f"{'stands' if len(near) == 1 else 'stand'} {100 * NEAR_CHANCE:.0f} points or more above "
                 f"chance at f = {f}: an f sweep there would keep its room (not run: another {len(values['f']) - 1} "
                 f"points per defense and protocol)." if roomy else
                 f"No finished gamma level of the curves keeps {' and '.join(norm_words(n) for n, _ in near)} "
                 f"{100 * NEAR_CHANCE:.0f} points above chance yet."))


def curve_findings() -> None:
    """What the curves say, paired over seeds (each point's worst attack, its per-seed accuracy):
    how each defense's worst case moves from one end of a sweep to the other, and at each point
    what the server's clean data buys, the trusted defense against the root-free pick."""
    from robustbn.labels import compact_defense, norm_order, norm_words
    from robustbn.matrix import read
    from robustbn.plots import robustness_lines
    from robustbn.stats import chance as chance_of

    searched, confirmed = search_notes(), confirmed_points()

    def est(t) -> str:  # its worst case, and whether its search is confirmed or could still lower it
        e = Estimate(t["seeds"], t["worst_acc"], t["ci_low"], t["ci_high"], t["worst_std"])
        note = searched.get((t["norm"], t.get("server_data"), t["gamma"], t["f"], t["defense"]), "") or \
            (SEARCHED_WORDS if (t["norm"], t["defense"], t["gamma"], t["f"]) in confirmed else "")
        return interval_cell(e) + note

    def named(t) -> str:  # short enough for a phone: the server's data is said once, under the tables
        return compact_defense(t["defense"]) + (" (trusted)" if t.get("server_data") else "")

    runs = curve_runs()
    if not runs:
        print(f"Nothing to compare yet. {tuning_status()}")
        return
    chance, values = chance_of(runs[0]), read(ROOT / ROBUSTNESS_MATRIX)
    print("How each defense's worst case moves from one end of a sweep to the other, each end at its tuned lr "
          "(difference: the far end - the near end, paired over the seeds both ran; \"both at or below chance\" where "
          "neither stands a point above it). \"searched\": an attack search's confirmed attack is among those run "
          "there; \"not searched yet\": a pick whose attack search has not run, which can still fall (\"Which "
          "defense to use where\"). (grad): on the gradients, (BN): on the BN mean and "
          "variance; (trusted): with the server's data, named under the tables.\n")
    print("| protocol | defense | along | near end | far end | difference |")
    print("|---|---|---|---|---|---|")
    points = {}  # (norm, gamma, f) -> its finished points, by defense
    for x, (held, value) in SWEEPS.items():
        if not (mine := curve_runs(x)):
            continue
        near, far = min(values[x]), max(values[x])
        for norm, lines in robustness_lines(mine, x, TUNED).items():
            for pts in lines.values():
                at = {t[x]: t for t in pts if t["worst_acc"] is not None}
                for t in at.values():
                    points.setdefault((norm, t["gamma"], t["f"]), {})[named(t)] = t
                a, b = at.get(near), at.get(far)
                cells = [f"{x} = {v:g}: {est(t)}" if t else f"{x} = {v:g}: not finished"
                         for v, t in ((near, a), (far, b))]
                print(f"| {norm_words(norm)} | {named(pts[0])} | {x} ({held} = {value:g}) | {' | '.join(cells)} | "
                      f"{worst_diff(b, a, chance) if a and b else '-'} |")
    print("\nWhat the server's clean data buys at each point: the trusted defense against the root-free pick (the "
          "highest pooled worst case of the root-free defenses run there, chosen on the same seeds it is compared "
          "on, so the difference leans a little its way; difference: trusted - root-free, paired over seeds). The "
          "trusted defense is alone in its threat model, so no search could change its map cell: it is searched "
          "only where it decides which protocol stands highest (the searches below); elsewhere its worst case is "
          "over the catalogue's attacks only, and a difference in its favour may shrink.\n")
    print("| protocol | gamma | f | trusted | highest root-free | difference |")
    print("|---|---|---|---|---|---|")
    for (norm, gamma, f), here in sorted(points.items(), key=lambda kv: (norm_order(kv[0][0]), kv[0][1:])):
        free = [t for t in here.values() if not t.get("server_data")]
        if not free:
            continue
        pick = max(free, key=lambda t: t["worst_acc"])
        planned = expected_defenses(norm, None, gamma, f)
        waiting = planned and len(free) < planned  # the highest of some is no pick: the rest may stand above it
        for trusted in (t for t in here.values() if t.get("server_data")):
            root_free = f"{len(free)} of {planned} finished, no pick yet" if waiting else f"{named(pick)}: {est(pick)}"
            print(f"| {norm_words(norm)} | {gamma:g} | {f} | {named(trusted)}: {est(trusted)} | {root_free} | "
                  f"{'-' if waiting else worst_diff(trusted, pick, chance)} |")
    data = sorted({t["server_data"] for here in points.values() for t in here.values() if t.get("server_data")})
    print("".join(f"\n(trusted): the server's data, {d}." for d in data))


SEARCHED_WORDS, NOT_SEARCHED = ", searched", ", not searched yet"
NOT_TRIED = ", searched, not yet its other points' attacks"
PARTLY = "its own; not yet its other points' attacks"
MAP_SEARCH_WORDS = {NOT_TRIED: f", searched ({PARTLY})"}  # after a map pick's lr; other notes as they are


def search_notes() -> dict[tuple, str]:
    """The words after each pick a search could change, by (norm, threat, gamma, f, defense):
    searched (confirmed) or not yet."""
    return {(c["norm"], c["threat"], c["gamma"], c["f"], p["defense"]):
            SEARCHED_WORDS if done else NOT_TRIED if searched else NOT_SEARCHED
            for c, p, done, searched in curve_search_rows()[0]}


def pick_notes() -> dict[tuple, str]:
    """The words after a pick's lr, by (norm, threat, gamma, f, defense): search_notes' for the
    picks a search could change, and ", searched" for any other defense at a point whose search
    is confirmed (a pick at chance may still have one); the map, the protocol table and the page
    read the same."""
    confirmed = {(norm, t.get("server_data"), g, f, d): SEARCHED_WORDS for (norm, d, g, f), t in confirmed_points().items()}
    return {**confirmed, **search_notes()}


def robustness_map() -> None:
    """Which defense to use where, per protocol and threat model: the paired rule's pick (or the
    tied set) at each (f, gamma) point of the curves, each at its tuned lr."""
    from robustbn.labels import compact_defense, norm_words
    from robustbn.plots import plot
    from robustbn.stats import chance as chance_of
    from robustbn.worst import defense_map, map_panels, pick_head

    runs = curve_runs()
    if not runs:
        print(f"No map yet: it needs the curves' runs. {tuning_status()}")
        return
    xs, ys, panels = map_panels(defense_map(runs, "gamma", "f", TUNED, expected_defenses))
    chance = chance_of(runs[0])
    # the picks a search could change: searched (confirmed) or not yet; and every point with a confirmed search
    notes = pick_notes()
    # a row per pick in three columns, not a grid of cells naming several defenses each: a phone's width
    print("Each point's verdict is on its first row; the rows under it are the defenses tied with it (the gap: the "
          "first - it, paired over seeds, its interval holding 0), then the closest defense outside the pick or the "
          "tied set, \"next\", and how much lower than the first it stands (paired over seeds; no \"next\" where "
          "the closest stands above a tied defense: told apart from the first on tighter seeds, it is not below the "
          "set). Each defense: its "
          "worst case (%) [95% interval] (seeds; its tuned lr, and \"searched\" where an attack search's confirmed "
          "attack is among those run there; with neither \"searched\" nor \"not searched yet\", the catalogue's "
          "attacks only, where no search could change the verdict). (grad): on the gradients, (BN): on the BN mean "
          "and variance.\n")
    for norm, threat, here in panels:
        print(f"{norm_words(norm)}, {'root-free' if threat is None else 'trusted server data (' + threat + ')'}:\n")
        print("| gamma, f | verdict | defense: worst case |")
        print("|---|---|---|")
        for g in xs:
            for f in ys:
                c = here.get((f, g))
                # the picks' margin: the closest other defense on the next row, with its paired gap
                after = [c["runner_up"]] if c and c.get("runner_up") else []
                for i, p in enumerate([*c["picks"], *after] if c else ()):
                    note = notes.get((norm, threat, g, f, p["defense"]), "")
                    head = pick_head(c, chance) if i == 0 else f"next, lower by {gap_cell(p)}" if p in after else \
                        f"tied, gap {gap_cell(p)}" if p.get("gap_pairs") else ""
                    words = estimate_cell(p)[:-1] + f"; lr {p['lr']:g}{MAP_SEARCH_WORDS.get(note, note)})"
                    print(f"| {f'{g:g}, {f}' if i == 0 else ''} | {head} | {compact_defense(p['defense'])}: {words} |")
        print()
    cells = defense_map(runs, "gamma", "f", TUNED, expected_defenses)  # as the figure draws them
    digest = _map_digest(cells)
    image = ROOT / "docs" / "img" / "robustness_map.png"
    if not os.environ.get("ROBUSTBN_DOCS_CHECK"):
        image.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, "map", str(image), x="gamma", y="f", tuned=TUNED, metadata={"robustbn-data": digest},
             title="Fashion-MNIST, n = 10; each defense at its tuned lr", expected=expected_defenses)
    print(f"![which defense to use where](img/robustness_map.png) <!-- data {digest} -->\n")
    if any(state == NOT_TRIED for state in notes.values()):
        print(f"A pick \"searched ({PARTLY})\" has its own search confirmed, but not yet tried the attacks confirmed "
              f"against the same defense at its other points, the board's included (listed below): they can still "
              f"lower it.\n")
    if any(state == NOT_SEARCHED for state in notes.values()):
        print("A pick \"not searched yet\" stands on the catalogue's attacks only: its search (listed below) can "
              "still lower it and change the cell, or which protocol stands highest.\n")


def protocol_map() -> None:
    """Which BN protocol where (robustbn.worst.protocol_map): at each point and threat model, each
    protocol at its highest defense there, compared by the board's paired rule over seeds 0-4;
    then the protocols under one defense each, chosen by no one (seed 002's comparison)."""
    from robustbn.matrix import read
    from robustbn.stats import chance as chance_of
    from robustbn.worst import protocol_map as ranked

    runs = curve_runs()
    if not runs:
        print(f"No comparison yet: it needs the curves' runs. {tuning_status()}")
        return
    chance, planned = chance_of(runs[0]), read(ROOT / ROBUSTNESS_MATRIX)["norm"]
    notes = pick_notes()
    print("Each protocol at its highest defense at that point (the top of its cell in the map above, once every "
          "defense planned there has finished), the protocols compared by the same paired rule over seeds 0-4 (a "
          "seed fixes the data split and the initial model, so the protocols pair by seed). The verdict is on the "
          "first row; under it, each other protocol, \"lower by\" its paired gap where the interval excludes 0, "
          "else \"tied\" (not told apart on 5 seeds, which is not the same as equal). Each interval is 95% for "
          "its own comparison, not jointly over the table: among this many comparisons a stray \"lower by\" is to "
          "be expected. Each protocol's defense is chosen on the same seeds it is compared on, and each worst "
          "case is the lowest of a dozen attacks on those seeds, so a protocol whose seeds scatter more is pulled "
          "down more. A verdict is \"provisional\" where a pick that decides it (the leader, or one tied with it, above "
          "chance) stands on the catalogue's attacks only (no search confirmed against it: one could lower it and "
          "turn the verdict). Each row: the worst case "
          "(%) [95% interval] (seeds; tuned lr, \"searched\" where a confirmed search's attack is among those run; "
          "clean: the same defense and lr without attack, to tell \"trains worse\" from \"is attacked worse\"; worst: the attack that reached the worst case and the messages it touched, (grad) the gradients, (BN) the BN mean and variance).\n")
    note = lambda c, t: notes.get((t["norm"], c["threat"], c["gamma"], c["f"], t["defense"]), "")
    protocol_tables(ranked(runs, "gamma", "f", TUNED, expected_defenses), chance, {False: planned, True: planned},
                    lambda c, t: f"; lr {t['lr']:g}{MAP_SEARCH_WORDS.get(note(c, t), note(c, t))}",
                    lambda c, t: note(c, t) == SEARCHED_WORDS, lambda c, t: note(c, t) == NOT_TRIED)
    protocol_figures()
    same_defense(runs, planned)


def protocol_figures() -> None:
    """The protocol comparison along each sweep as a figure (`robustbn plot protocols`), its
    digest in the text as the curves' figures carry theirs."""
    from robustbn.plots import plot
    from robustbn.worst import protocol_map as ranked

    for x, (held, value) in SWEEPS.items():
        if not (mine := curve_runs(x)):
            continue
        cells = ranked(mine, "gamma", "f", TUNED, expected_defenses)  # as the figure draws them
        drawn = [(c["threat"], c["gamma"], c["f"], [(p["norm"], p["defense"], round(p["worst_acc"], 6),
                                                     *(p.get(k) for k in TUNED)) for p in c["protocols"]])
                 for c in cells]
        digest = _digest(drawn)
        image = ROOT / "docs" / "img" / f"protocols_{x}.png"
        if not os.environ.get("ROBUSTBN_DOCS_CHECK"):
            image.parent.mkdir(parents=True, exist_ok=True)
            plot(mine, "protocols", str(image), x=x, tuned=TUNED, metadata={"robustbn-data": digest},
                 title=f"Fashion-MNIST, n = 10, {held} = {value:g}; each defense at its tuned lr",
                 expected=expected_defenses)
        print(f"![which BN protocol along {x}](img/protocols_{x}.png) <!-- data {digest} -->\n")


def protocol_tables(cells: list[dict], chance: float, planned: dict[bool, list[str]], words, searched,
                    partly=lambda c, t: False) -> None:
    """protocol_map's cells as a table per threat model, a row per protocol (a phone's width):
    `planned[trusted]` the protocols meant to be in that threat model, `words(cell, pick)` after
    each worst case's seeds (its lr, whether searched), `searched(cell, pick)` whether its attack
    search is confirmed (else the verdict is provisional), `partly(cell, pick)` whether it is
    but has not yet tried the other points' attacks. Where the cell has no verdict (too few
    pairs), the rows give the gap alone."""
    from robustbn.labels import compact_defense, norm_words
    from robustbn.report import pick_tail
    from robustbn.worst import gap_words, protocol_head, provisional

    for trusted in (False, True):
        here = [c for c in cells if (c["threat"] is not None) == trusted]
        if not here:
            continue
        planned_here = planned[trusted]
        data = sorted({c["threat"] for c in here if c["threat"]})
        print(f"{'Trusted server data (' + ', '.join(data) + ')' if trusted else 'Root-free'}:\n")
        print("| gamma, f | verdict | protocol (its defense): worst case |")
        print("|---|---|---|")
        for c in here:
            for i, t in enumerate(c["protocols"]):
                verdict = protocol_head(c, chance, planned_here) + provisional(
                    c, lambda p: searched(c, p), chance, lambda p: partly(c, p)) if i == 0 else gap_words(c, t)
                point = f"{c['gamma']:g}, {c['f']}" if i == 0 else ""
                print(f"| {point} | {verdict} | {norm_words(t['norm'])} "
                      f"({compact_defense(t['defense'])}): {estimate_cell(t)[:-1]}{words(c, t)}{pick_tail(t)}) |")
        print()


def curve_points(runs: list[dict]) -> list[dict]:
    """Every finished point of the curves of `runs` (robustness_lines' rows, each at its tuned lr)."""
    from robustbn.plots import robustness_lines

    return [t for lines in robustness_lines(runs, "gamma", TUNED).values() for pts in lines.values() for t in pts
            if t["worst_acc"] is not None]


def same_defense(runs: list[dict], planned: list[str]) -> None:
    """The protocols under the same defense at each point, each at its own tuned lr, paired with
    FBN (seed 002's comparison: FBN against the others, one aggregation rule for all): no
    defense chosen on the seeds compared, so no selection leans either way."""
    from robustbn.labels import compact_defense, norm_words

    by_point: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for t in curve_points(runs):
        by_point[(t["defense"], t.get("server_data"), t["gamma"], t["f"])][t["norm"]] = t
    if not planned:
        return
    from robustbn.stats import chance as chance_of

    chance = chance_of(runs[0])
    reference = planned[0]  # the matrix's first protocol: FBN, seed 002's own
    others = [n for n in planned if n != reference]
    rows = [(key, here) for key, here in by_point.items() if reference in here and any(n in here for n in others)]
    print(f"The same defense for every protocol, each at its own tuned lr: the difference against "
          f"{norm_words(reference)} (other - {norm_words(reference)}, paired over seeds; \"higher\" or \"lower\" "
          f"only where the interval excludes 0; \"both at or below chance\" where neither stands a point above it). "
          f"No defense is chosen here, so no selection leans either way; but "
          f"where one side is \"searched\" (a confirmed attack search's attack among those it ran) and the other "
          f"is not, the searched side's worst case is over more attacks. A defense and point where only "
          f"{norm_words(reference)} has finished is left out.\n")
    if not rows:
        print(f"No defense has finished at the same point under {norm_words(reference)} and another protocol yet.\n")
        return
    print(f"| defense | gamma, f | {norm_words(reference)} | protocol: worst case, difference |")
    print("|---|---|---|---|")
    order = {"mean": 0}
    marked = lambda t: estimate_cell(t) + (" searched" if t["searched"] else "")
    for (defense, data, g, f), here in sorted(rows, key=lambda kv: (order.get(kv[0][0], 1), kv[0][0],
                                                                     kv[0][1] or "", kv[0][2], kv[0][3])):
        ref = here[reference]
        for i, n in enumerate(n for n in others if n in here):
            t = here[n]
            name = compact_defense(defense) + (" (trusted)" if data else "")
            print(f"| {name if i == 0 else ''} | {f'{g:g}, {f}' if i == 0 else ''} | "
                  f"{marked(ref) if i == 0 else ''} | {norm_words(n)}: {marked(t)}, "
                  f"{worst_diff(t, ref, chance)} |")
    data = sorted({k[1] for k, _ in rows if k[1]})
    print("".join(f"\n(trusted): the server's data, {d}." for d in data) + "\n")


ABOVE_CHANCE = AT_CHANCE  # a pick within it of chance is broken: no search changes the map there


def worst_diff(b: dict, a: dict, chance: float) -> str:
    """b's worst case - a's, paired over seeds; "both at or below chance" where neither stands ABOVE_CHANCE
    above it (a gap of hundredths of a point between two broken models is no verdict)."""
    if max(a["worst_acc"], b["worst_acc"]) - chance < ABOVE_CHANCE:
        return "both at or below chance"
    return seeds_diff(b["worst_by_seed"], a["worst_by_seed"])


def _search_space(norm: str, defense: str) -> str:
    """The board's search file of this protocol and defense on seeds 10 and 11 (its [search]
    space), else the first of the protocol's: the spaces differ in trials and sampler seed only."""
    files = [(setting_defense_words(expand_channels(values)) == defense, p)
             for p, values in board_search_files() if values.get("norm") == norm]
    if not files:
        raise SystemExit(f"no search file of norm {norm!r} on seeds 10 and 11 in scenarios/")
    return next((p for same, p in files if same), files[0][1])


def board_search_files() -> list[tuple[str, dict]]:
    """The board's search files on seeds 10 and 11 (scenarios/search_*.toml), with their values."""
    from robustbn.matrix import read

    found = [(p, read(p)) for p in sorted((ROOT / "scenarios").glob("search_*.toml"))]
    return [(str(p.relative_to(ROOT)), values) for p, values in found
            if values.get("search", {}).get("seeds") == [10, 11]]


def search_candidates(runs: list[dict], chance: float) -> list[tuple[dict, dict]]:
    """The picks a search could turn, as (cell, pick), the cell with the pick's "norm" and
    "decides" (what its search could turn: "the map", "the protocol verdict" or both): each pick
    of a map cell with two defenses or more (the best, or each tied for it), and each pick that
    decides a protocol verdict (the leader, or one tied with it, above chance: `provisional`'s)."""
    from robustbn.worst import AT_CHANCE, BEST, TIED, defense_map, protocol_map

    found: dict[tuple, tuple[dict, dict, list[str]]] = {}

    def add(c: dict, p: dict, why: str) -> None:
        key = (c["norm"], p["defense"], c["gamma"], c["f"])
        found.setdefault(key, (c, p, []))[2].append(why)

    for c in defense_map(runs, "gamma", "f", TUNED, expected_defenses):
        if c["verdict"] in (BEST, TIED) and c["defenses"] >= 2:
            for p in c["picks"]:
                add(c, p, "the map")
    for c in protocol_map(runs, "gamma", "f", TUNED, expected_defenses):
        if c["verdict"] in (BEST, TIED):
            for i, p in enumerate(c["protocols"]):
                if (i == 0 or p["verdict"] == TIED) and p["worst_acc"] > chance + AT_CHANCE:
                    add({**c, "norm": p["norm"]}, p, "the protocol verdict")
    return [({**c, "decides": " and ".join(why)}, p) for c, p, why in found.values()]


def curve_search_rows() -> tuple[tuple, tuple]:
    """(rows, left) of curve_searches: each pick a search could change (`search_candidates`) as
    (cell, pick, whether its search is done, whether searched), and the commands of the searches
    left."""
    import hashlib

    from robustbn.stats import chance as chance_of

    runs = curve_runs()
    if not runs:
        return (), ()
    chance = chance_of(runs[0])
    tuned = tuned_points()
    # a confirmation counts once every run of it has finished (a found attack that is one of the
    # catalogue's has the tuned file's runs, which count for it too)
    current = set(current_confirmations())
    confirmed = {f for f in current if all_finished(f)}
    tried_here = given_attacks(confirmed)
    rows, left, waiting = [], [], unsettled_points()
    for c, p in search_candidates(runs, chance):
        point = (c["norm"], p["defense"], c["gamma"], c["f"])
        path = tuned.get(point)
        if path is None:
            continue
        confirm = confirmation_of(path)
        # every attack confirmed against this defense is tried here (--try), at its other points
        # and at an lr the grid has since left: a short search must not miss what broke the same
        # defense next door. Its own confirmed one too: it may have come from a --try, and a rerun
        # without it would confirm another and the next listing flip it back. Each from another
        # file where one holds it, else from the file the search rewrites (read before it is)
        others = [min(files, key=lambda q: q == confirm)
                  for files in tried_here.get((c["norm"], p["defense"]), {}).values()]
        searched = confirm in confirmed
        done = searched and all(tried_in(confirm, other) for other in others)
        if not done and p["worst_acc"] <= chance + ABOVE_CHANCE:
            continue  # broken already: nothing a search finds changes the map
        rows.append((c, p, done, searched))
        if not done and point not in waiting:
            sampler = 1000 + int(hashlib.sha256(Path(path).stem.encode()).hexdigest(), 16) % 10**6
            tries = "".join(f" --try {other}" for other in sorted(others))
            left.append(f"robustbn attack-search {_search_space(c['norm'], p['defense'])} --on {path} "
                        f"--sampler-seed {sampler}{tries} --db results/board.sqlite --confirm {confirm} && "
                        f"robustbn run {confirm} --db results/board.sqlite")
    return tuple(rows), tuple(left)


def given_attacks(confirmed: set[str]) -> dict[tuple, dict[str, list[str]]]:
    """The attacks a search of each (norm, defense) tries (--try), each with every file that holds
    it: the curves' (`attack_files`), then those of the same defense's board search."""
    out = attack_files(confirmed)
    for (norm, defense), files in board_confirmations().items():  # the same defense's board point
        for f in files:
            out[(norm, defense)][attack_of(f)].append(f)
    return {k: dict(v) for k, v in out.items()}


def attack_files(confirmed: set[str] | None = None) -> defaultdict[tuple, defaultdict[str, list[str]]]:
    """The curves' confirmation files by (norm, defense), by the attack each holds: the `confirmed`
    ones (current, finished; by default every such), then those confirmed at an lr the point no
    longer runs or kept when a later search replaced them, whose runs have all finished."""
    current = set(current_confirmations())
    if confirmed is None:
        confirmed = {f for f in current if all_finished(f)}
    out: defaultdict[tuple, defaultdict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(confirmed) + sorted(set(curve_confirmations()) - current):
        if f in confirmed or all_finished(f):
            (norm, defense, *_), _ = point_of_file(f)
            out[(norm, defense)][attack_of(f)].append(f)
    return out


def curve_attacks(confirmed: set[str] | None = None) -> dict[tuple, dict[str, str]]:
    """`attack_files`, one file per attack (the first)."""
    return {k: {attack: files[0] for attack, files in v.items()} for k, v in attack_files(confirmed).items()}


def board_searches() -> dict[tuple, tuple[str, str]]:
    """The board's searches on seeds 10 and 11 that have confirmed an attack, by (norm, defense):
    (search file, its confirmation file)."""
    out = {}
    for search, _ in board_search_files():
        confirm = str(Path(search).with_name(SEARCHED_PREFIX + Path(search).name.removeprefix("search_")))
        if (ROOT / confirm).is_file():
            (norm, defense, *_), _ = point_of_file(confirm)
            out.setdefault((norm, defense), (search, confirm))
    return out


def board_try_rows() -> tuple[tuple, tuple]:
    """(rows, left): each board search of a defense the curves searched too, as (norm, defense,
    search file, the curves' attack files, those in its space, those it has not tried), and the
    commands left: the board's worst case is the worst of every attack tried against the same
    defense, whichever search found it. A search is listed while an attack in its space is
    untried or its confirmation has runs left (a chain cut before `robustbn run`). Its command
    tries (--try) every such attack, tried or not: a confirmation names only the tries of its own
    command, and the earlier ones replay from the store. The search replays its trials, runs the
    new ones on seeds 10 and 11, and confirms its worst on seeds 0-4 (an attack it replaces is
    kept beside it: robustbn.evaluate.keep_earlier_confirmation)."""
    searches, curves = board_searches(), curve_attacks()
    rows, left = [], []
    for (norm, defense), (search, confirm) in sorted(searches.items()):
        files = tuple(sorted(curves.get((norm, defense), {}).values()))
        if not files:
            continue
        mtimes = lambda fs: tuple((f, (ROOT / f).stat().st_mtime_ns) for f in fs)
        offered = _in_space(ROOT, mtimes((search,))[0], mtimes(files))
        untried = [f for f in offered if not tried_in(confirm, f)]
        rows.append((norm, defense, search, files, offered, untried))
        if untried or offered and not all_finished(confirm):
            report = f"docs/{Path(search).stem}.json"
            # $$: the shell's own, so that two lanes running the same search do not share a file
            left.append(f"robustbn attack-search {search}{''.join(f' --try {f}' for f in offered)} "
                        f"--db results/board.sqlite --quiet --format json --confirm {confirm} > {report}.$$.tmp && "
                        f"mv {report}.$$.tmp {report} && robustbn run {confirm} --db results/board.sqlite --quiet --yes")
    return tuple(rows), tuple(left)


@cache
def _in_space(root: Path, search: tuple, files: tuple) -> tuple[str, ...]:
    """The files whose attack a search's space holds (`--try` takes them; the others it refuses);
    each file with its mtime, so that a changed one is read again."""
    with chdir(root):
        return tuple(attacks_in_space(search[0], [f for f, _ in files]))


def attacks_in_space(search: str, files: list[str], on: str | None = None) -> list[str]:
    """The files whose attack a search's space holds, at MATRIX `on`'s setting where given (as
    `attack-search --on`); relative to the working directory."""
    from robustbn.matrix import MatrixError
    from robustbn.search import SearchError, given_point, load

    values, space = load(search, [], on=on, sampler_seed=None)
    out = []
    for f in files:
        try:
            given_point(f, values, space)
        except (SearchError, MatrixError):
            continue
        out.append(f)
    return out


def board_confirmations() -> dict[tuple, list[str]]:
    """The board's confirmed searches by (norm, defense), of the defenses the curves run: the
    same defense at another point, so a curve search tries their attacks too, those in its
    search space (the board's searches ran the same spaces; a few of their files ran others)."""
    files = tuple((f, (ROOT / f).stat().st_mtime_ns) for f in board_files() if Path(f).name.startswith(SEARCHED_PREFIX))
    on = {}  # a tuned file of each defense: the search's --on, whose setting the attack is checked in
    for (norm, defense, *_), path in sorted(tuned_points().items(), key=lambda kv: kv[1]):
        on.setdefault((norm, defense), path)
    return _board_confirmations(ROOT, files, tuple(sorted(on.items())))


@cache
def _board_confirmations(root: Path, files: tuple, on: tuple) -> dict[tuple, list[str]]:
    from robustbn.matrix import MatrixError
    from robustbn.search import SearchError

    by_defense, on = defaultdict(list), dict(on)
    for f, _ in files:
        (norm, defense, *_), _ = point_of_file(f)
        if (norm, defense) in on:
            by_defense[(norm, defense)].append(f)
    out = {}
    with chdir(root):
        for key, fs in by_defense.items():
            try:
                out[key] = attacks_in_space(_search_space(*key), fs, on=on[key])
            except (SearchError, MatrixError, SystemExit):  # no space, or a bad --on: the search says so
                continue
    return {k: v for k, v in out.items() if v}


def point_of_file(path: str) -> tuple[tuple, Any]:
    """A tuned or confirmation file's point and defense, (norm, defense, gamma, f), and its lr
    (read again only once the file changes: every section reads it)."""
    return _point_of_file(ROOT, path, (ROOT / path).stat().st_mtime_ns)


@cache
def _point_of_file(root: Path, path: str, mtime_ns: int) -> tuple[tuple, Any]:
    from robustbn.matrix import expand, read

    with chdir(root):
        d = expand_channels(expand(read(path), path)[0].to_dict())
    return (d["norm"], setting_defense_words(d), d["gamma"], d["f"]), d["lr"]


@cache
def tuning_choices() -> tuple[dict[str, dict], list[dict]]:
    """The tuning's finished runs (by the plan's hash) and every defense's choice over them
    (robustbn.tune.settled_choices: `complete` once its pruning has settled)."""
    from robustbn.matrix import read
    from robustbn.tune import settled_choices

    plan, point_of, by_hash = tuning_plan()
    alias = device_aliases(by_hash)  # a run finished on a GPU is the plan's run, as `robustbn tune` reads it
    finished = {alias[r["hash"]]: {**r, "hash": alias[r["hash"]]} for r in tuning_runs() if r["hash"] in alias}
    return finished, settled_choices(finished, {"lr": read(ROOT / tuning_file())["lr"]}, plan, point_of)


def unsettled_points() -> set[tuple]:
    """The (norm, defense, gamma, f) whose lr the tuning has not settled (a grid value still
    running): its tuned file may still move, so its search waits."""
    if not (ROOT / tuning_file()).is_file():
        return set()
    return {(c["norm"], c["defense"], c["setting"]["gamma"], c["setting"]["f"]) for c in tuning_choices()[1]
            if not c["complete"]}


def tuned_points() -> dict[tuple, str]:
    """Each tuned file by the point and defense it holds: (norm, defense, gamma, f) -> path."""
    return {point_of_file(path)[0]: path for path in tuned_files()}


def current_confirmations() -> tuple[str, ...]:
    """The confirmations the curves read: each at its point's tuned lr. One made before its
    point's choice moved (the grid widened) ran another setting: its runs count as spent (the
    time table), not in the curves, and the point's search is listed again."""
    lr = dict(point_of_file(path) for path in tuned_files())
    return tuple(f for f in curve_confirmations() if (at := point_of_file(f))[0] in lr and lr[at[0]] == at[1])


def confirmation_of(tuned_path: str) -> str:
    """The confirmation file of the search at a tuned file's point."""
    return f"{TUNED_DIR}/{SEARCHED_PREFIX}{Path(tuned_path).stem.removeprefix('tuned_')}.toml"


def attack_of(path: str) -> str:
    """The attack a confirmation file holds, in words (one attack per file)."""
    from robustbn.labels import attack_words

    return attack_words(planned_scenarios(path)[0])


def tried_in(confirm: str, other: str) -> bool:
    """Whether the search that wrote `confirm` tried the attack `other` holds now: it is the
    attack it confirmed, or its description names it with a --try file
    (robustbn.evaluate.confirmation_values). By the attack, not the file: several points'
    files hold the same attack, and which of them a search was given does not matter."""
    from robustbn.matrix import read

    with chdir(ROOT):
        description = read(confirm).get("description", "")
    return attack_of(other) == attack_of(confirm) or f"({attack_of(other)})" in description


def curve_searches() -> None:
    """Where a search could change the map or the protocol verdict (`search_candidates`): each
    such pick above chance is searched at its tuned lr and the attack found is confirmed on
    seeds 0-4 (a tied pick at chance has nothing left to lose; one whose search is complete, its
    own and every try, stays listed). A confirmation can change the pick; the next run of this section then
    lists the new pick's search."""
    from robustbn.labels import compact_defense, norm_words

    if not curve_runs():
        print(f"No search yet: the searches follow the curves' picks. {tuning_status()}")
        return
    rows, left = curve_search_rows()
    done, partly = sum(row[2] for row in rows), sum(row[3] and not row[2] for row in rows)
    print(f"The picks a search could change: at points with two defenses or more, each pick of the map; at points "
          f"with two protocols or more, each pick that decides which protocol stands highest (the leader, or one "
          f"tied with it); each standing more than {100 * ABOVE_CHANCE:g} point above chance, or fully searched "
          f"already (a pick at chance has nothing left to lose). "
          + (f"Of these {len(rows)}, {done} are fully searched and confirmed, {partly} have their own search "
             f"confirmed but not yet the attacks confirmed against the same defense at its other points, and "
             f"{len(rows) - done - partly} are not searched yet. " if rows else "There is none now. ")
          + f"Each search runs on seeds 10 and 11 at the defense's tuned lr "
          f"and then tries (`--try`) the attacks confirmed against the same defense at its other points, at an "
          f"lr its point has since left, and by the board's searches (gamma = 0, f = {SWEEPS['gamma'][1]}, the "
          f"matrix's lr; those in the search's space), one file per attack, so that a short search does not miss "
          f"what broke it next door; its attack is confirmed on seeds 0-4, which the "
          f"curves and the map then count. A search that ends on one of the catalogue's attacks confirms runs the "
          f"tuned file has made already (the same runs): the point reads searched, and its worst attack stays "
          f"a catalogue one.\n")
    if rows:
        print("| protocol | threat model | gamma | f | pick | worst case now | its search could turn | searched |")
        print("|---|---|---|---|---|---|---|---|")
        waiting = unsettled_points()
        for c, p, done, searched in rows:
            status = "yes" if done else PARTLY if searched else "not yet"
            if not done and (c["norm"], p["defense"], c["gamma"], c["f"]) in waiting:
                status += " (its lr is being tuned again: the search waits for it)"
            print(f"| {norm_words(c['norm'])} | {'root-free' if c['threat'] is None else 'trusted'} | {c['gamma']:g} | "
                  f"{c['f']} | {compact_defense(p['defense'])} (lr {p['lr']:g}) | {estimate_cell(p)} | {c['decides']} | "
                  f"{status} |")
    picked = {(c["norm"], p["defense"], c["gamma"], c["f"]) for c, p, *_ in rows}
    elsewhere = [(key, t) for key, t in confirmed_points().items() if key not in picked]
    if elsewhere:
        print("\nSearches confirmed at a defense and point the table above does not list (its search moved the pick, "
              "another defense rose above it, the defense now stands at chance, where no search changes the map, or, for a "
              "trusted defense, no other protocol has finished there to be compared with); their attacks count in "
              "the curves all the same:\n")
        print("| protocol | gamma | f | defense | worst case now | its worst attack |")
        print("|---|---|---|---|---|---|")
        for (norm, defense, gamma, f), t in elsewhere:
            print(f"| {norm_words(norm)} | {gamma:g} | {f} | {compact_defense(defense)} (lr {t['lr']:g}) | {estimate_cell(t)} | "
                  f"{t['worst_attack']} |")
    command_block("The searches left, each with its confirmation:", left)


def command_block(title: str, commands) -> None:
    """The commands left, as a code block under its title (nothing where none is left)."""
    if commands:
        print(f"\n{title}\n\n```\n" + "\n".join(commands) + "\n```")


def gap_cell(t: dict) -> str:
    """A paired gap as "5.6 [0.3, 10.8] (5 pairs)"."""
    return interval_cell(Estimate(t["gap_pairs"], t["gap"], t["gap_low"], t["gap_high"], None)).replace(
        " seed", " pair")


def estimate_cell(t: dict) -> str:
    """A worst case as "10.8 [6.5, 15.0] (5 seeds)"."""
    return interval_cell(Estimate(t["seeds"], t["worst_acc"], t["ci_low"], t["ci_high"], t.get("worst_std")))


def confirmed_points() -> dict[tuple, dict]:
    """The curves' points whose search is confirmed (every run of its confirmation finished), by
    (norm, defense, gamma, f): the point as robustness_lines gives it, at its tuned lr."""
    from robustbn.plots import robustness_lines

    confirmed = {f for f in current_confirmations() if all_finished(f)}
    keys = {key for key, path in tuned_points().items() if confirmation_of(path) in confirmed}
    points = {}
    for x in SWEEPS:
        if runs := curve_runs(x):
            for norm, lines in robustness_lines(runs, x, TUNED).items():
                for pts in lines.values():
                    for t in pts:
                        if (key := (norm, t["defense"], t["gamma"], t["f"])) in keys and t["worst_acc"] is not None:
                            points[key] = t
    return dict(sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3], kv[0][1])))


def _gain(d: float) -> str:
    """A difference in points, "+0.0" where it rounds to zero (tuning's choice is the max, so
    at its own lr a defense never loses: "-0.0" is a rounding of float32 means)."""
    from robustbn.stats import number

    return number(d, 1, 100, sign=True)


def _tuning_gain(chosen: dict, base: dict) -> str:
    """A defense's gain from tuning, "+5.2 [-3.1, 13.5] (2 pairs; lr 0.1)": its worst case at its
    tuned lr - at the matrix's, paired over the tuning seeds (an interval, no verdict: two seeds
    carry none; clipped to what accuracies allow). Where the matrix's lr was pruned its worst
    case is a bound, so the gain is a bound too, with no interval."""
    from robustbn.stats import ci_text, paired

    gain, lr = _gain(chosen["worst_acc"] - base["worst_acc"]), f"lr {chosen['point']['lr']:g}"
    if base["pruned"]:
        return f"at least {gain} ({base['seeds']} seeds, a bound; {lr})"
    if chosen["point"] == base["point"]:
        return f"{gain} ({lr}, the matrix's)"
    d = paired(base["worst_by_seed"], chosen["worst_by_seed"])
    ci = ci_text(max(d.low, -1.0), min(d.high, 1.0), d.n, scale=100, digits=1, unit="pair") if d.has_interval else ""
    return f"{gain}{f' {ci}' if ci else ''} ({d.n} pair{'s' * (d.n != 1)}; {lr})"


def tuning_moved() -> None:
    """How far tuning moved each point's pick, on the tuning seeds: per protocol, point and
    threat model, the highest worst case at the matrix's lr and at each defense's tuned lr."""
    from robustbn.labels import compact_defense, norm_order, norm_words
    from robustbn.matrix import read
    from robustbn.stats import chance as chance_of

    if not (ROOT / tuning_file()).is_file():
        print(f"No tuning run yet. {tuning_status()}")
        return
    values = read(ROOT / tuning_file())
    base = read(ROOT / ROBUSTNESS_MATRIX)["lr"]
    finished, choices = tuning_choices()
    # every defense the tuning plans, per point and threat model; one whose pruning has not settled
    # has no choice yet, whatever its points have run
    planned = planned_defenses()
    points = defaultdict(list)
    for c in choices:
        if c["complete"]:
            points[curve_cell(c["setting"])].append(c)
    done = {k: cs for k, cs in points.items() if len(cs) == len(planned[k])}
    if not done:
        settled = sum(len(cs) for cs in points.values())
        print(f"No point fully tuned yet ({settled} of {len(tuning_plan()[0].defenses)} defenses' choices settled). "
              f"{tuning_status()}")
        return
    print(f"On the tuning seeds ({', '.join(map(str, values['seed']))}) and the catalogue's attacks only: two "
          f"seeds carry no verdict, and the searches above are not in these numbers, so where this table's highest "
          f"differs from the map's pick, the map (seeds 0-4, searches confirmed) is the verdict. Per point and threat model whose every defense is tuned ({len(done)} of "
          f"{len(planned)} so far), the defense with the highest worst case at the matrix's lr ({base:g}) and at each "
          f"defense's own tuned lr, and how much tuning gained each (paired over the tuning seeds). \"<=\": lr {base:g} was "
          f"pruned, so its worst case is at most that (its attacks not run could only lower it), and a gain over it "
          f"is a bound.\n")
    print("| protocol | gamma | f | threat model | highest at lr " + f"{base:g}" + " | highest tuned | moved | gain per defense (points) |")
    print("|---|---|---|---|---|---|---|---|")
    at_base = lambda c: next(sc for sc in c["scores"] if sc["point"]["lr"] == base)
    at_chosen = lambda c: next(sc for sc in c["scores"] if sc["point"] == c["chosen"])
    # a pruned point's score bounds its worst case (attacks left out): the bound, its seeds, no interval
    score = lambda sc: f"<= {100 * sc['worst_acc']:.1f} ({sc['seeds']} seeds, pruned)" if sc["pruned"] else \
        interval_cell(Estimate(sc["seeds"], sc["worst_acc"], sc["ci_low"], sc["ci_high"], None))
    for (norm, gamma, f, data), cs in sorted(done.items(), key=lambda kv: (norm_order(kv[0][0]), kv[0][1], kv[0][2],
                                                                          kv[0][3] or "")):  # the figures' order
        untuned = max(cs, key=lambda c: at_base(c)["worst_acc"])
        tuned = max(cs, key=lambda c: c["chosen_acc"])
        gains = "; ".join(f"{compact_defense(c['defense'])} {_tuning_gain(at_chosen(c), at_base(c))}" for c in cs)
        # a pruned bound on top may stand above a defense that is truly higher at lr 0.05
        moved = ("not known (lr " + f"{base:g} pruned)" if at_base(untuned)["pruned"] and len(cs) > 1
                 else "yes" if tuned is not untuned else "no")
        print(f"| {norm_words(norm)} | {gamma:g} | {f} | {'root-free' if data is None else 'trusted'} | "
              f"{compact_defense(untuned['defense'])} {score(at_base(untuned))} | "
              f"{compact_defense(tuned['defense'])} {score(at_chosen(tuned))[:-1]}; lr {tuned['chosen']['lr']:g}) | "
              f"{moved} | {gains} |")
    grid_edge(values["lr"], [c for cs in points.values() for c in cs], chance_of(next(iter(finished.values()))))


def tuning_at_board_point() -> None:
    """What tuning did on the reported seeds, searches included, at the one point the curves share
    with the board (gamma = 0, f = SWEEPS["gamma"][1]): each curve defense at the matrix's lr (the
    board's runs) against its tuned lr (the curves' runs), paired over seeds 0-4."""
    from robustbn.labels import compact_defense, norm_order, norm_words
    from robustbn.matrix import read
    from robustbn.stats import chance as chance_of

    values = read(ROOT / ROBUSTNESS_MATRIX)
    lr, f = values["lr"], SWEEPS["gamma"][1]
    at_point = lambda runs: [r for r in runs if float(r["gamma"]) == 0.0 and r["f"] == f]
    curve, board = at_point(curve_runs("gamma")), at_point(board_runs())
    points = lambda runs: {(t["norm"], t["defense"], t.get("server_data")): t for t in curve_points(runs)} \
        if runs else {}
    tuned, untuned = points(curve), points(board)
    pairs = sorted(((k, untuned[k], t) for k, t in tuned.items() if k in untuned),
                   key=lambda kv: (norm_order(kv[0][0]), kv[0][2] or "", kv[0][1] != "mean", kv[0][1]))
    print(f"The table above reads the tuning seeds and the catalogue only. On the reported seeds, with the searches, "
          f"one point can say what tuning did: gamma = 0, f = {f}, where the board ran each defense at the matrix's lr "
          f"({lr:g}) and the curves at its tuned lr. Each worst case is over the attacks its own side ran (the "
          f"catalogue, and the searches confirmed at that lr): a search confirmed on one side need not have run on "
          f"the other (each side's search tries the other's confirmed attacks on its own search seeds, and runs one "
          f"on seeds 0-4 only where it is the worst there), so a difference is the lr's and the attacks' together. ByzFL's rule over "
          f"every attack would run each side's searched attacks at the other's lr, on seeds 0-4 (not run). Difference: tuned - lr {lr:g}, paired over "
          f"seeds 0-4; \"both at or below chance\" where neither stands a point above it.\n")
    if not pairs:
        print(f"No defense has finished at gamma = 0, f = {f} on both the board and the curves yet.\n")
        return
    chance = chance_of(curve[0])
    cell = lambda t: f"{estimate_cell(t)}{', searched' if t['searched'] else ''}; worst: {t['worst_short']}"
    print(f"| protocol | defense | lr {lr:g} (the board) | tuned lr (the curves) | difference |")
    print("|---|---|---|---|---|")
    for (norm, defense, data), base, mine in pairs:
        # a side searched against one that is not: the unsearched worst case can still fall
        lopsided = "" if base["searched"] == mine["searched"] else \
            f"; the {'tuned' if base['searched'] else 'board'} side not searched yet"
        print(f"| {norm_words(norm)} | {compact_defense(defense)}{' (trusted)' if data else ''} | {cell(base)} | "
              f"lr {mine['lr']:g}: {cell(mine)} | {worst_diff(mine, base, chance)}{lopsided} |")
    print()


def grid_edge(grid: list[float], choices: list[dict], chance: float = 0.1) -> None:
    """How many settled choices sit at an end of the lr grid, where a wider grid could find a
    better lr (ByzFL's rule is the max over the grid given), and which defenses they are."""
    from robustbn.labels import compact_defense, norm_words

    low, high = min(grid), max(grid)
    at = {edge: [c for c in choices if c["chosen"]["lr"] == edge] for edge in (low, high)}
    def which(cs):  # the defenses at an edge: a wider grid is worth trying for those
        counts = Counter(compact_defense(c["defense"]) for c in cs)
        return "".join(f"; {d} {k}" for d, k in counts.most_common())
    edge_words = " and ".join(f"{len(cs)} at lr {edge:g} (its {'lowest' if edge == low else 'highest'}{which(cs)})"
                              for edge, cs in at.items())
    broken = sum(1 for cs in at.values() for c in cs if c["chosen_acc"] <= chance + ABOVE_CHANCE)
    by_norm = defaultdict(lambda: [0, 0])
    for c in choices:
        by_norm[c["norm"]][c["chosen"]["lr"] in (low, high)] += 1
    print(f"\nThe grid's edges: of the {len(choices)} choices settled, {edge_words}"
          + (f"; {broken} of those at chance, where every lr is" if broken else "")
          + ". Per protocol, at an edge: "
          + ", ".join(f"{norm_words(n)} {at_edge} of {inside + at_edge}" for n, (inside, at_edge) in by_norm.items())
          + ". A choice at an edge is the best of this grid, not necessarily the defense's best: a wider grid "
            "could raise it, and with it the point's worst case; the curves report each defense at the best of "
            "this grid.")


def catalogue_coverage(gamma=0.0) -> None:
    """How many attacks the catalogue's file lists per cell, against how many each cell ran."""
    from robustbn.labels import hashable
    from robustbn.matrix import load
    from robustbn.worst import ATTACK_FIELDS, ATTACK_KEYS, NOT_SETTING, worst_case

    _, scenarios = load(ROOT / WORST_CASE_MATRIX)
    listed = defaultdict(set)
    for sc in scenarios:
        d = expand_channels(sc.to_dict())
        if d["gamma"] == gamma:
            key = tuple((k, hashable(v)) for k, v in sorted(d.items()) if k not in ATTACK_KEYS and k not in NOT_SETTING)
            listed[key].add(tuple(hashable(d.get(k)) for k in ATTACK_FIELDS))
    runs = [r for r in matrix_runs((WORST_CASE_MATRIX,)) if r["gamma"] == gamma]
    ran = [t["attacks"] for t in worst_case(runs) if t["f"]]
    sizes = sorted({len(v) for v in listed.values()})
    print(f"The catalogue's file lists {'-'.join(map(str, sizes))} attacks per cell at gamma = {gamma}; the runs in "
          f"the store cover {min(ran)}-{max(ran)} of them per cell (the leaderboard's worst attack column says how "
          f"many), so a cell's worst case is over the attacks run.")


def curve_defenses() -> None:
    """The curves' root-free defense per protocol (ROBUSTNESS_MATRIX), against the board as it
    stands: the file runs the highest worst case among the protocol's root-free rows that are
    best or tied for best. Where the board has moved since the file was written, this says so."""
    from robustbn.labels import norm_words, setting_defense_words
    from robustbn.matrix import expand, read
    from robustbn.report import leaderboard as board

    values = read(ROOT / ROBUSTNESS_MATRIX)
    one_point = {**values, "seed": 0, "gamma": 0.0, "f": 3}  # every defense of the file, once per attack
    in_file = defaultdict(set)
    for sc in expand(one_point, ROBUSTNESS_MATRIX):
        d = expand_channels(sc.to_dict())
        if d.get("root_size") is None:
            in_file[d["norm"]].add(setting_defense_words(d))
    rows = board(board_runs()).rows
    always = {"nnm+trmean", "mean"}  # seed 002's rule and the undefended mean run for every protocol
    print("| protocol | the curves' root-free row from the board (beside nnm+trmean and the mean) | the board's "
          "highest best or tied root-free row now | agrees |")
    print("|---|---|---|---|")
    for norm, defenses in in_file.items():
        defenses = defenses - always or defenses
        ranked = [r for r in rows if r["norm"] == norm and not r["server_data"] and r["worst_acc"] is not None
                  and r["verdict"] in ("best", "tied for best")]
        top = max(ranked, key=lambda r: r["worst_acc"], default=None)
        now = f"{top['defense']} ({100 * top['worst_acc']:.1f}, {top['verdict']})" if top else "none yet"
        print(f"| {norm_words(norm)} | {'; '.join(sorted(defenses))} | {now} | "
              f"{'yes' if top and top['defense'] in defenses else 'no' if top else '-'} |")


def search_coverage() -> None:
    """Which leaderboard rows an attack search reached (a confirmation file's runs in the cell),
    above all the rows a practitioner would pick: best, tied for best, or the highest where
    there is no verdict yet."""
    from robustbn.labels import norm_words
    from robustbn.report import leaderboard as board

    rows = board(board_runs()).rows
    model = lambda r: (r["norm"], bool(r["server_data"]))  # a protocol's threat model: ranked apart
    top = {m: max(r["worst_acc"] for r in rows if model(r) == m and r["worst_acc"] is not None)
           for m in {model(r) for r in rows if r["worst_acc"] is not None}}

    def searched(r):
        return any(SEARCHED_PREFIX in str(run.get("source") or "") for run in r["runs"])

    picked = [r for r in rows if r["verdict"] in ("best", "tied for best") or r["worst_acc"] == top.get(model(r))]
    missing = [f"{norm_words(r['norm'])} with {r['defense']}" for r in picked if not searched(r)]
    print(f"Searched (a confirmation file's runs in the cell): {sum(map(searched, picked))} of the {len(picked)} "
          f"rows that are best, tied for best or highest of their protocol and threat model"
          + (f"; not searched: {'; '.join(missing)}" if missing else "")
          + f". Of the other rows, {sum(searched(r) for r in rows if r not in picked)} of "
          f"{len(rows) - len(picked)} were searched.")


def board_tries() -> None:
    """Whether the board's searches have tried the attacks the curves' searches confirmed against
    the same defense (`board_try_rows`), and the commands left."""
    from robustbn.labels import compact_defense, norm_words

    rows, left = board_try_rows()
    some = [row for row in rows if row[4]]
    done = sum(not untried for *_, untried in some)
    print("A search at the curves' points (the robustness curves below) can find an attack that the board's search "
          "of the same defense did not: the board's search then tries it too (`--try`, at the board's setting, on "
          "its own seeds 10 and 11) and confirms its worst on seeds 0-4; where that worst is another attack, the one "
          "it confirmed before is kept beside it (`searched_worst_*_earlier_*.toml`): a cell's worst case is the "
          "worst of every attack tried against its defense, whichever search found it. "
          + (f"Of the {len(some)} board searches with such an attack in their space, {done} have tried every one, "
             f"{len(some) - done} not yet" + (f"; {len(rows) - len(some)} more have only attacks outside their space "
                                              f"(`--try` refuses them)" if len(rows) > len(some) else "") + "."
             if rows else "No defense of the board has a confirmed curve search yet."))
    if rows:
        print("\n| protocol | defense | the curves' attacks in its space | tried by the board's search | "
              "outside its space |")
        print("|---|---|---|---|---|")
        for norm, defense, search, files, offered, untried in rows:
            print(f"| {norm_words(norm)} | {compact_defense(defense)} | {len(offered)} | "
                  f"{len(offered) - len(untried)} | {len(files) - len(offered)} |")
    command_block("The tries left, each with its confirmation:", left)


def judged(t: dict, table: list[dict]) -> bool:
    """Whether a worst-case cell's verdict stands on MIN_PAIRS paired seeds (the best's: every
    other defense of its protocol paired with it on as many)."""
    if t["verdict"] is None:
        return False
    if t["gap_pairs"] is not None:
        return not too_few(t["gap_pairs"])
    others = [o["gap_pairs"] for o in table if (o["norm"], bool(o["server_data"])) == (t["norm"], bool(t["server_data"]))
              and o is not t and o["gap_pairs"] is not None]
    return bool(others) and not too_few(min(others))


def worst_case_tables(gammas=(0.0, 1.0)) -> None:
    """Per gamma: defense x norm protocol, each cell the worst case (robustbn.worst) over the
    catalogue's attacks and the confirmed searched ones, on BOARD_SEEDS."""
    from robustbn.worst import BEST, SEARCHED as FOUND, TIED, worst_case

    runs = board_runs()
    for gamma in gammas:
        table = [t for t in worst_case([r for r in runs if r["gamma"] == gamma]) if t["f"]]
        norms = list(dict.fromkeys(t["norm"] for t in table))
        defenses = sorted({t["defense"] for t in table})
        print(f"\n**Worst case, gamma = {gamma}: final test accuracy (%) under the worst attack (the catalogue's "
              f"or a searched one, marked *), mean [95% CI, Student t over seeds, clipped to [0, 100]] (that "
              f"attack, seeds); bold: the best defense of its protocol, every other worse paired over seeds; "
              f"italic: tied for best; neither where fewer than {MIN_PAIRS} seeds were paired (no verdict)**\n")
        print("| defense | " + " | ".join(norms) + " |")
        print("|---|" + "---|" * len(norms))
        for defense in defenses:
            cells = []
            for norm in norms:
                t = next((t for t in table if t["defense"] == defense and t["norm"] == norm), None)
                if t is None or t["worst_acc"] is None:
                    cells.append("-")
                    continue
                e = Estimate(t["seeds"], t["worst_acc"], t["ci_low"], t["ci_high"], t["worst_std"])
                mark = "*" if t["worst_kind"] == FOUND else ""
                text = interval_cell(e).replace(" (", f" ({t['worst_short']}{mark}, ", 1)
                cells.append({BEST: f"**{text}**", TIED: f"*{text}*"}.get(t["verdict"], text) if judged(t, table)
                             else text)
            print(f"| {defense} | " + " | ".join(cells) + " |")
        print()


def worst_case_verdicts(gamma=0.0) -> None:
    """The verdicts of the worst-case table in words: per protocol the defenses worse than its
    best (with the paired gap), and the attack that decides each cell."""
    from robustbn.labels import norm_words
    from robustbn.report import ROOT_FREE, TRUSTED
    from robustbn.worst import WORSE, worst_case

    table = [t for t in worst_case([r for r in board_runs() if r["gamma"] == gamma]) if t["f"]]
    for norm in dict.fromkeys(t["norm"] for t in table):
        for model, trusted in ((ROOT_FREE, False), (TRUSTED, True)):
            group = [t for t in table if t["norm"] == norm and bool(t["server_data"]) == trusted
                     and t["worst_acc"] is not None]
            if not group:
                continue
            best = max(group, key=lambda t: t["worst_acc"])
            where = f"{norm_words(norm)}, {model}"
            if len(group) == 1:
                print(f"- {where}: {best['defense']} ({100 * best['worst_acc']:.1f}), the only such defense run.")
                continue
            if not judged(best, table):
                pairs = min((t["gap_pairs"] for t in group if t["gap_pairs"] is not None), default=1)
                print(f"- {where}: highest worst case {best['defense']} ({100 * best['worst_acc']:.1f}); "
                      f"{too_few(pairs)}.")
                continue
            worse = [t for t in group if t["verdict"] == WORSE]
            text = "; ".join(f"{t['defense']} ({100 * t['worst_acc']:.1f}, gap "
                             f"{100 * t['gap']:.1f} {ci_text(t['gap_low'], t['gap_high'], t['gap_pairs'], 100, 1, 'pair')}"
                             f", {t['gap_pairs']} pairs)" for t in worse)
            print(f"- {where}: highest worst case {best['defense']} ({100 * best['worst_acc']:.1f}, "
                  f"{best['verdict']}); worse than it, paired over seeds: {text or 'none'}.")
    grads = sum(1 for t in table if t["worst_grad_attack"] not in NOT_ATTACKS)
    mixed = sum(1 for t in table if t["worst_grad_attack"] not in NOT_ATTACKS
                and t["worst_bn_mean_attack"] not in NOT_ATTACKS)
    print(f"- The worst attack touches the gradients in {grads} of {len(table)} cells ({mixed} of them the BN means "
          f"too); in the other {len(table) - grads} it touches the BN statistics alone.")


def statistics_attacks_table(gamma=0.0) -> None:
    """The worst case over the attacks on the BN statistics alone (gradients honest)."""
    from robustbn.worst import BEST, TIED, worst_case

    runs = [r for r in matrix_runs((WORST_CASE_MATRIX,)) if r["gamma"] == gamma and r["grad_attack"] in NOT_ATTACKS
            and r["seed"] in range(5)]
    table = [t for t in worst_case(runs) if t["f"] and t["worst_acc"] is not None]
    norms = list(dict.fromkeys(t["norm"] for t in table))
    print("| defense | " + " | ".join(norms) + " |")
    print("|---|" + "---|" * len(norms))
    for defense in sorted({t["defense"] for t in table}):
        cells = []
        for norm in norms:
            t = next((t for t in table if t["defense"] == defense and t["norm"] == norm), None)
            if t is None:
                cells.append("-")
                continue
            text = interval_cell(Estimate(t["seeds"], t["worst_acc"], t["ci_low"], t["ci_high"], t["worst_std"]))
            text = text.replace(" (", f" ({t['worst_short']}, ", 1)
            cells.append({BEST: f"**{text}**", TIED: f"*{text}*"}.get(t["verdict"], text) if judged(t, table)
                         else text)
        print(f"| {defense} | " + " | ".join(cells) + " |")
    print()


def bn_aware_against_sf(gamma=0.0) -> None:
    """bn-kl (means and variances) against SF (means) per cell of the matrix, paired over seeds."""
    from robustbn.labels import group

    runs = [r for r in matrix_runs((WORST_CASE_MATRIX,)) if r["gamma"] == gamma and r["grad_attack"] in NOT_ATTACKS
            and r["seed"] in range(5)]
    cells = group(runs, ["norm", "grad_agg", "bn_mean_agg", "client_filter"])
    lower = higher = tied = 0
    spans = []
    for runs_ in cells.values():
        kl = [r for r in runs_ if r["bn_mean_attack"] == "bn-kl"]
        sf = [r for r in runs_ if r["bn_mean_attack"] == "sf"]
        if not kl or not sf:
            continue
        d = paired(by_seed(sf), by_seed(kl))
        word = verdict(d)
        lower += word == "lower"
        higher += word == "higher"
        tied += word not in ("lower", "higher")
        spans.append(abs(d.mean))
    print(f"- bn-kl on both BN messages against SF on the means, per (protocol, defense) cell, paired over "
          f"seeds: bn-kl lower in {lower}, higher in {higher}, no verdict or tied in {tied} of {lower + higher + tied} "
          f"cells; the mean differences are at most {100 * max(spans):.1f} points.")


def attacks_table(gamma) -> None:
    """Every catalogue attack of the worst-case matrix side by side (seeds 0-4)."""
    runs = [r for r in matrix_runs((WORST_CASE_MATRIX,)) if r["gamma"] == gamma and r["seed"] in range(5)]
    pivot(runs, lambda r: f"{r['norm']}, {setting_defense_words(r)}", attack_short)


_SETTINGS: dict[str, str] = {}  # a stored run's hash -> its setting: the search tables compare every run per search


def setting(r) -> str:
    """A run's setting: its scenario without the attack fields and the seed."""
    from robustbn.matrix import FIELDS
    from robustbn.worst import ATTACK_KEYS, NOT_SETTING

    if r.get("hash") in _SETTINGS:
        return _SETTINGS[r["hash"]]
    words = json.dumps({k: v for k, v in r.items() if k in FIELDS and k not in ATTACK_KEYS and k not in NOT_SETTING},
                       sort_keys=True, default=str)
    if r.get("hash"):
        _SETTINGS[r["hash"]] = words
    return words


def same_attack(r, t) -> bool:
    """Whether run `r` ran the worst attack of worst-case cell `t`."""
    from robustbn.labels import hashable
    from robustbn.worst import ATTACK_FIELDS

    return all(hashable(r[k]) == hashable(t[f"worst_{k}"]) for k in ATTACK_FIELDS)


def searched_against_catalogue() -> None:
    """Per searched cell: the catalogue's worst attack against the searched one, both on seeds
    0-9, paired; the verdict from seeds 1-9, which the search never saw."""
    from robustbn.worst import worst_case

    every_seed = list(matrix_runs((WORST_CASE_MATRIX,)))
    print("| defense | catalogue worst (attack) | searched attack | searched - catalogue, seeds 1-9 | "
          "searched - catalogue, seeds 5-9 |")
    print("|---|---|---|---|---|")
    for name in SEARCHED:
        searched = list(matrix_runs((f"scenarios/searched_worst_{name}.toml",)))
        if not searched:
            continue
        table = worst_case([r for r in every_seed if setting(r) == setting(searched[0]) and r["seed"] in range(5)])
        if not table:
            continue
        (t,) = table
        worst = [r for r in every_seed if setting(r) == setting(searched[0]) and same_attack(r, t)]
        held_out = diff(searched, [r for r in worst if r["seed"] != 0], "searched higher", "searched lower")
        fresh = diff(searched, [r for r in worst if r["seed"] >= 5], "searched higher", "searched lower")
        cat = cell(worst).replace(" (", f" ({t['worst_short']}, ", 1)
        print(f"| {searched[0]['norm']}, {setting_defense_words(searched[0])} | {cat} | {cell(searched)}: "
              f"{attack_words(searched[0])} | {held_out} | {fresh} |")
    print()


def held_out_searches() -> None:
    """Per search tuned on seeds of its own (issue 29: every defense best or tied for best): what
    it found, that attack confirmed on the held-out seeds 0-4, and the catalogue's worst on the
    same seeds, paired; the search's cost is its trial runs' CPU time."""
    from robustbn.labels import norm_words
    from robustbn.worst import worst_case

    catalogue = [r for r in matrix_runs((WORST_CASE_MATRIX,)) if r["seed"] in BOARD_SEEDS]
    cpu = {r["hash"]: r["wall_time_s"] or 0.0 for r in rows()}
    print("| protocol, defense | trials (proposals), + tries | CPU hours | worst found on the search's seeds | "
          "confirmed on seeds 0-4 | catalogue's worst on seeds 0-4 | searched - catalogue, paired | the cell's worst |")
    print("|---|---|---|---|---|---|---|---|")
    for path in sorted((ROOT / "scenarios").glob("searched_worst_*.toml")):
        name = path.stem.removeprefix("searched_worst_")
        report = ROOT / "docs" / f"search_{name}.json"
        searched = [r for r in matrix_runs((f"scenarios/{path.name}",)) if r["seed"] in BOARD_SEEDS]
        if name in SEARCHED or not searched or not report.is_file():
            continue
        found = json.loads(report.read_text())
        hashes = [s["hash"] for t in found["tried"] for s in t["seeds"]]
        hours = math.fsum(cpu.get(h, 0.0) for h in hashes) / 3600
        table = worst_case([r for r in catalogue if setting(r) == setting(searched[0])])
        if not table:
            continue
        (t,) = table
        worst = [r for r in catalogue if setting(r) == setting(searched[0]) and same_attack(r, t)]
        seeds = " and ".join(map(str, found["seeds"]))
        lower = seeds_interval(searched).mean < seeds_interval(worst).mean
        tries = sum(1 for t in found["tried"] if t.get("given"))  # --try: the curves' attacks (board_tries)
        print(f"| {norm_words(searched[0]['norm'])}, {setting_defense_words(searched[0])} | {found['trials'] - tries} "
              f"({found['proposals']}){f' + {tries}' if tries else ''} | {hours:.2f} | {100 * found['worst']['final_acc']:.1f} (seeds {seeds}) | "
              f"{cell(searched)}: {attack_words(searched[0])} | {cell(worst)}: {t['worst_short']} | "
              f"{diff(searched, worst, 'searched higher', 'searched lower')} | "
              f"{'searched' if lower else 'catalogue'} |")
    print()


# ---- Figure 4, Figure 3 and the gap ----------------------------------------------------------

FIG4 = dict(pred=lambda r: cpu_schedule(r) and r["grad_attack"] == "none"
            and (r["f"] == 3 or r["bn_mean_agg"] == "mean"))


def fig4_table(kind: str) -> None:
    """Figure 4's cells: the BN means only (`mean`), both statistics alike (`both`), or the variance only."""
    channel = "bn_var" if kind == "variance" else "bn_mean"
    runs = [r for r in sel(**FIG4) if r["norm"] in ("naive", "fbn", "fedtan") and r["gamma"] in (0.0, 0.01)
            and touched(r) in (kind, "none")]
    pivot(runs, lambda r: f"{r['norm']}, gamma = {r['gamma']}", lambda r: attack_cell(r, channel))


def control(norm, gamma):
    """f = 3 sending nothing, undefended: the runs an attack on those 7 honest clients is compared with."""
    return sel(lambda r: cpu_schedule(r) and touched(r) == "none" and r["grad_attack"] == "none", norm=norm,
               gamma=gamma, f=3, bn_mean_agg="mean")


def mean_attack(norm, gamma, attack, agg="mean"):
    return sel(cpu_schedule, norm=norm, gamma=gamma, f=3, grad_attack="none", bn_mean_attack=attack,
               bn_var_attack="honest", bn_mean_agg=agg)


@findings
def fig4_findings() -> None:
    for gamma in (0.0, 0.01):
        for attack in ("sf", "foe", "alie"):
            compare(f"naive BN, gamma = {gamma}, {attack.upper()} on the means, undefended, against no attack (7 honest)",
                    mean_attack("naive", gamma, attack), control("naive", gamma))
        compare(f"naive BN, gamma = {gamma}, SF on the means under nnm+median, against no attack (7 honest)",
                mean_attack("naive", gamma, "sf", "nnm+median"), control("naive", gamma))
        compare(f"FBN, gamma = {gamma}, SF on the means, undefended, against no attack (7 honest)",
                mean_attack("fbn", gamma, "sf"), control("fbn", gamma))
        compare(f"FBN against naive BN, gamma = {gamma}, no attack (7 honest)", control("fbn", gamma),
                control("naive", gamma))
    compare("FedTAN, gamma = 0.0, SF on the means, undefended, against no attack (7 honest)",
            mean_attack("fedtan", 0.0, "sf"), control("fedtan", 0.0))


def stats_attack(norm, kind, attack, agg="mean"):
    """gamma = 0, f = 3 attacking both BN messages alike (`both`) or the variances alone, each
    BN channel aggregated by `agg`."""
    return sel(lambda r: cpu_schedule(r) and touched(r) == kind, norm=norm, gamma=0.0, f=3, grad_attack="none",
               bn_var_attack=attack, bn_mean_agg=agg, bn_var_agg=agg)


@findings
def fig4_extension_findings() -> None:
    """The testbed's extension of Figure 4: both BN messages attacked alike, or the variances alone."""
    for norm, name in (("naive", "naive BN"), ("fbn", "FBN")):
        for attack in ("sf", "foe", "alie"):
            compare(f"{name}, gamma = 0.0, {attack.upper()} on both statistics, undefended, against no attack "
                    "(7 honest)", stats_attack(norm, "both", attack), control(norm, 0.0))
        compare(f"{name}, gamma = 0.0, SF on both statistics under nnm+median, against no attack (7 honest)",
                stats_attack(norm, "both", "sf", "nnm+median"), control(norm, 0.0))
        for attack, words in (("sf", "SF"), ("scale", "deflation (scale, factor 1e-6)")):
            compare(f"{name}, gamma = 0.0, {words} on the variances, undefended, against no attack (7 honest)",
                    stats_attack(norm, "variance", attack), control(norm, 0.0))
            compare(f"{name}, gamma = 0.0, {words} on the variances under nnm+median, against no attack (7 honest)",
                    stats_attack(norm, "variance", attack, "nnm+median"), control(norm, 0.0))


def fig3(norm, gamma):
    return sel(cpu_schedule, norm=norm, gamma=gamma, f=0, bn_mean_agg="mean")


def fig3_table() -> None:
    runs = sel(cpu_schedule, f=0, bn_mean_agg="mean")
    pivot(runs, lambda r: r["norm"], lambda r: f"gamma = {r['gamma']}")


def fbn_central() -> tuple[list, list]:
    """FBN and centralized BN at gamma 0 and 1 (Figure 3), a pair being the same gamma and seed."""
    pool = lambda norm: [{**r, "seed": (r["gamma"], r["seed"])} for g in (0.0, 1.0) for r in fig3(norm, g)]
    return pool("fbn"), pool("central")


@findings
def fig3_findings() -> None:
    compare("naive BN at gamma = 0 against gamma = 1", fig3("naive", 0.0), fig3("naive", 1.0))
    compare("FBN at gamma = 0 against gamma = 1", fig3("fbn", 0.0), fig3("fbn", 1.0))
    compare("FBN against naive BN, gamma = 0, no attack (10 honest)", fig3("fbn", 0.0), fig3("naive", 0.0))
    for gamma in (0.1, 0.5, 1.0):  # seed 002's Figure 3: naive BN catches up as the clients' data mix
        compare(f"FBN against naive BN, gamma = {gamma}", fig3("fbn", gamma), fig3("naive", gamma))
    compare("HBN against centralized BN, gamma = 0", fig3("hbn", 0.0), fig3("central", 0.0))
    print("- FBN against centralized BN: under \"Where this disagrees with seed 002\" below.")


@findings
def disagreements() -> None:
    """Seed 002 claims FBN matches centralized BN under extreme heterogeneity; seed 002 reports
    FixBN at 75% on CIFAR-10 at gamma = 0, and the algorithms alike at gamma >= 0.3; seed 003 finds FBN
    below plain BN under FedAvg."""
    for gamma in (0.0, 1.0):
        compare(f"FBN against centralized BN (seed 002: FBN matches it), T = 200, gamma = {gamma}",
                fig3("fbn", gamma), fig3("central", gamma))
    compare("the same, gamma = 0 and 1 pooled (a pair: one gamma and seed)", *fbn_central())
    fbn, central = "fbn, n = 10 x batch 50, beta = 0.1", "central, n = 10 x batch 50, beta = 0.1"
    compare("the same at the paper's schedule (T = 1500, momentum 0.99), gamma = 0", gap(fbn, 1500), gap(central, 1500),
            min_pairs=LONG_MIN_PAIRS)
    compare("FBN against naive BN at gamma = 0.5, T = 200 (seed 002: at gamma >= 0.3 the algorithms perform alike)",
            fig3("fbn", 0.5), fig3("naive", 0.5))
    long_f0 = lambda norm: sel(lambda r: r["rounds"] == 1500 and r["n"] == 10 and r["batch_size"] == 50, norm=norm,
                               gamma=0.5, f=0, bn_mean_agg="mean")
    compare("the same at the paper's schedule (T = 1500, momentum 0.99), gamma = 0.5", long_f0("fbn"),
            long_f0("naive"), min_pairs=LONG_MIN_PAIRS)
    compare("FixBN against centralized BN at gamma = 0, T = 200 (seed 002: FixBN loses accuracy under extreme "
            "heterogeneity)", fig3("fixbn", 0.0), fig3("central", 0.0))
    compare("seed 003's setting (FedAvg, Dirichlet): FBN against plain BN (seed 002: FBN \"outperforms existing "
            "BatchNorm mechanisms\", shown under DSGD, most under strong heterogeneity; seed 003 finds FBN below "
            "plain BN under FedAvg, as here)",
            sel(algorithm="fedavg", partition="dirichlet", norm="fbn"),
            sel(algorithm="fedavg", partition="dirichlet", norm="naive"))
    curve_disagreements()


SEED_002_DEFENSE = "nnm+trmean"  # its robust pipeline on every message (seed 002, section 5)


def curve_disagreements() -> None:
    """Seed 002 finds FBN under NNM and a robust rule defending better than naive BN. Its attacks
    touch the BN means alone; the curves attack every message, so a curve point where naive BN
    stands above FBN under that same pipeline is a disagreement outside the paper's setting,
    said so in its line. The other root-free points are counted by verdict in one line."""
    from robustbn.labels import compact_defense
    from robustbn.stats import chance as chance_of

    runs = curve_runs()
    if not runs:
        return
    chance = chance_of(runs[0])
    here: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for t in curve_points(runs):
        if compact_defense(t["defense"]) == SEED_002_DEFENSE and not t.get("server_data"):
            here[(t["gamma"], t["f"])][t["norm"]] = t
    others: dict[str, list[str]] = defaultdict(list)
    for (g, f), pair in sorted(here.items()):
        if not {"fbn", "naive"} <= pair.keys():
            continue
        fbn, naive = pair["fbn"], pair["naive"]
        at_chance = max(fbn["worst_acc"], naive["worst_acc"]) - chance < ABOVE_CHANCE  # as worst_diff words it
        kind = "both at or below chance" if at_chance else verdict(paired(naive["worst_by_seed"], fbn["worst_by_seed"]))
        if kind != "lower":
            others[kind].append(f"({g:g}, {f})")
            continue
        words, lr = worst_diff(fbn, naive, chance), lambda t: f"lr {t['lr']:g}" + (", searched" if t["searched"] else "")
        print(f"- the robustness curves, root-free, gamma = {g:g}, f = {f}, {SEED_002_DEFENSE} on every message (seed "
              f"002: FBN defends better than naive BN; not its setting, which Figure 4's section above runs: its "
              f"attacks touch the BN means alone, here the worst "
              f"case is over the attacks run on the gradients and the statistics, each protocol at its tuned lr): "
              f"FBN {estimate_cell(fbn)[:-1]}; {lr(fbn)}) against naive BN {estimate_cell(naive)[:-1]}; "
              f"{lr(naive)}); difference {words}")
    if others:
        print(f"- the curves' other root-free points under {SEED_002_DEFENSE}, FBN against naive BN, at (gamma, f): "
              + "; ".join(f"{k} at {', '.join(v)}" for k, v in others.items()))


@findings
def seed003_findings() -> None:
    part = lambda norm: sel(algorithm="fedavg", partition="dirichlet", norm=norm)
    for norm in ("fixbn", "hbn", "gn"):
        compare(f"FBN against {norm}", part("fbn"), part(norm))


@findings
def seed004_findings() -> None:
    part = lambda norm: sel(algorithm="fedavg", partition="feature-shift", norm=norm)
    for norm in ("naive", "fbn", "gn"):
        compare(f"FedBN against {norm} (FedBN's accuracy is personalized: each client's own test split)",
                part("fedbn"), part(norm))


def paper_schedule_table() -> None:
    runs = sel(lambda r: r["rounds"] == 1500 and r["norm"] in ("naive", "fbn") and r["f"] == 3 and r["n"] == 10
               and r["batch_size"] == 50 and r["gamma"] == 0.0)
    pivot(runs, lambda r: r["norm"],
          lambda r: {"mean": "SF on the mean", "both": "SF on mean and variance", "none": "no attack (7 honest)"}
          .get(touched(r), touched(r)) + ("" if touched(r) == "none" else f" / {r['bn_mean_agg']}"))


def paper_schedule(norm, kind, agg="mean"):
    """The paper's schedule's f = 3 runs (T = 1500): the BN means attacked with SF (`mean`), or none."""
    return sel(lambda r: r["rounds"] == 1500 and r["n"] == 10 and r["batch_size"] == 50 and touched(r) == kind
               and (kind == "none" or r["bn_mean_attack"] == "sf"), norm=norm, gamma=0.0, f=3, bn_mean_agg=agg)


@findings
def paper_schedule_findings() -> None:
    for norm, name in (("naive", "naive BN"), ("fbn", "FBN")):
        for agg, words in (("mean", "undefended"), ("nnm+median", "under nnm+median")):
            compare(f"T = 1500: {name}, SF on the means, {words}, against no attack (7 honest)",
                    paper_schedule(norm, "mean", agg), paper_schedule(norm, "none"), min_pairs=LONG_MIN_PAIRS)
    compare("T = 1500: FBN against naive BN, no attack (7 honest)", paper_schedule("fbn", "none"),
            paper_schedule("naive", "none"), min_pairs=LONG_MIN_PAIRS)


def gap_rows():
    return sel(lambda r: r["algorithm"] == "dsgd" and r["partition"] == "gamma" and r["gamma"] == 0.0
               and r["norm"] in ("fbn", "central", "none", "fedtan") and r["bn_agg"] == "mean"
               and r["model"] == "simple-cnn"
               and (r["rounds"] == 1500 or (r["rounds"] == 200 and (r["f"] == 0 or r["norm"] == "none"))))


def gap_label(r) -> str:
    extra = ("" if not r["f"] else f", f = {r['f']} sending nothing" if touched(r) == "none"
             else f", SF on the {'statistics' if touched(r) == 'both' else touched(r)} by f = {r['f']}, undefended")
    return f"{r['norm']}, n = {r['n']} x batch {r['batch_size']}, beta = {r['bn_momentum']}" + extra


def gap_table() -> None:
    pivot(gap_rows(), gap_label,
          lambda r: "T = 200, momentum 0.9" if r["rounds"] == 200 else "T = 1500, momentum 0.99 (paper)")


def gap(label, rounds):
    return [r for r in gap_rows() if gap_label(r) == label and r["rounds"] == rounds]


@findings
def gap_findings() -> None:
    fbn, central = "fbn, n = 10 x batch 50, beta = 0.1", "central, n = 10 x batch 50, beta = 0.1"
    one = "fbn, n = 1 x batch 500, beta = 0.1"
    for rounds in (200, 1500):
        pairs = LONG_MIN_PAIRS if rounds == 1500 else MIN_PAIRS
        compare(f"T = {rounds}: FBN against centralized BN", gap(fbn, rounds), gap(central, rounds), min_pairs=pairs)
        compare(f"T = {rounds}: FBN with one client holding the union batch against FBN with 10 clients",
                gap(one, rounds), gap(fbn, rounds), min_pairs=pairs)
    for beta in (0.5, 1.0):
        compare(f"T = 200: FBN with beta = {beta} against beta = 0.1",
                gap(f"fbn, n = 10 x batch 50, beta = {beta}", 200), gap(fbn, 200))
    both = sel(lambda r: cpu_schedule(r) and touched(r) == "both", norm="fbn", gamma=0.0, f=3, bn_mean_attack="sf",
               bn_agg="mean")
    compare("T = 200: FBN, SF on both statistics by f = 3 (undefended), against the same 7 honest clients", both,
            control("fbn", 0.0))
    compare("T = 200: FBN against no normalization, the same 7 honest clients", control("fbn", 0.0),
            control("none", 0.0))
    honest = "fbn, n = 10 x batch 50, beta = 0.1, f = 3 sending nothing"
    compare("T = 1500: FBN, SF on both statistics by f = 3 (undefended), against the same 7 honest clients",
            gap("fbn, n = 10 x batch 50, beta = 0.1, SF on the statistics by f = 3, undefended", 1500),
            gap(honest, 1500), min_pairs=LONG_MIN_PAIRS)
    compare("T = 1500: FBN against no normalization, the same 7 honest clients", gap(honest, 1500),
            gap("none, n = 10 x batch 50, beta = 0.1, f = 3 sending nothing", 1500), min_pairs=LONG_MIN_PAIRS)


@findings
def fedtan_findings() -> None:
    for gamma in (0.0, 1.0):
        compare(f"FedTAN against centralized BN, gamma = {gamma}, T = 200", fig3("fedtan", gamma),
                fig3("central", gamma))
        compare(f"FedTAN against FBN, gamma = {gamma}, T = 200", fig3("fedtan", gamma), fig3("fbn", gamma))
    long = lambda norm: [r for r in gap_rows() if r["rounds"] == 1500 and r["norm"] == norm and r["f"] == 0
                         and r["n"] == 10]
    compare("FedTAN against centralized BN, gamma = 0, T = 1500", long("fedtan"), long("central"),
            min_pairs=LONG_MIN_PAIRS)
    compare("FedWon against centralized BN, gamma = 0, T = 200", fig3("fedwon", 0.0), fig3("central", 0.0))


# ---- centered clipping against its paper (issue 38) ---------------------------------------------

CC_CHECK = "scenarios/cc_paper_setting_fmnist.toml"
CC_ATTACKS = {"honest": "no attack", "alie": "ALIE", "ipm": "IPM (eps 0.1)", "minmax": "min-max (unit)"}


def cc_tau(r) -> float:
    return float((r["grad_agg_params"] or {}).get("tau", 10.0))


def cc_check_runs() -> list[dict]:
    return own_seed_runs(CC_CHECK)


def cc_check(grad_agg: str, tau: float, f: int, attack: str) -> list[dict]:
    return [r for r in cc_check_runs() if r["grad_agg"] == grad_agg and cc_tau(r) == tau and r["f"] == f
            and r["grad_attack"] == attack]


def cc_check_table() -> None:
    """Rows: the rule at a radius; columns: f and the gradient attack (statistics honest)."""
    pivot(cc_check_runs(), lambda r: f"{r['grad_agg']}, tau {cc_tau(r):g}",
          lambda r: f"f = {r['f']}, {CC_ATTACKS[r['grad_attack']]}")


@findings
def cc_check_findings() -> None:
    for agg in ("bucketing+cc", "cc"):
        for f in (2, 3):
            for attack in ("minmax", "alie", "ipm"):
                compare(f"{agg}, f = {f}, {CC_ATTACKS[attack]}: tau 1 (the authors' radius) against tau 10 (the "
                        f"board's)", cc_check(agg, 1.0, f, attack), cc_check(agg, 10.0, f, attack))
    for tau in (1.0, 10.0):
        compare(f"bucketing+cc, tau {tau:g}, min-max (unit): f = 2 (the paper's fraction) against f = 3",
                cc_check("bucketing+cc", tau, 2, "minmax"), cc_check("bucketing+cc", tau, 3, "minmax"))
        compare(f"f = 3, tau {tau:g}, min-max (unit): bucketing+cc against cc alone",
                cc_check("bucketing+cc", tau, 3, "minmax"), cc_check("cc", tau, 3, "minmax"))


def cc_check_summary() -> None:
    """What the check says, from its paired comparisons (no verdict on fewer than MIN_PAIRS)."""
    def word(b, a) -> str:
        d = paired(by_seed(a), by_seed(b))
        return verdict(d) if d.n else "not run"

    def radius(agg, f, attack) -> str:
        return word(cc_check(agg, 1.0, f, attack), cc_check(agg, 10.0, f, attack))

    fraction = {tau: word(cc_check("bucketing+cc", tau, 2, "minmax"), cc_check("bucketing+cc", tau, 3, "minmax"))
                for tau in (1.0, 10.0)}
    print(f"- Under min-max (unit), bucketing+cc at tau 1 against tau 10: {radius('bucketing+cc', 2, 'minmax')} at "
          f"f = 2, {radius('bucketing+cc', 3, 'minmax')} at f = 3. The fraction alone (f = 2 against f = 3): "
          f"{fraction[1.0]} at tau 1, {fraction[10.0]} at tau 10.")
    lowest = min(((seeds_interval(cc_check("bucketing+cc", 1.0, 2, a)), CC_ATTACKS[a]) for a in ("alie", "ipm", "minmax")
                  if cc_check("bucketing+cc", 1.0, 2, a)), key=lambda e: e[0].mean)
    print(f"- At the authors' radius and fraction (tau 1, f = 2), bucketing+cc's lowest of the three attacks: "
          f"{interval_cell(lowest[0])}, {lowest[1]} (no attack: {cell(cc_check('bucketing+cc', 1.0, 2, 'honest'))}). "
          f"At f = 3, under ALIE, tau 1 against tau 10: {radius('bucketing+cc', 3, 'alie')}.")
    words = [radius("cc", f, a) for f in (2, 3) for a in ("alie", "ipm", "minmax")]
    counts = ", ".join(f"{words.count(w)} {w}" for w in dict.fromkeys(sorted(words)))
    print(f"- cc alone at tau 1 against tau 10, over its six cells (f = 2 and 3, three attacks): {counts}.")


def scale_table() -> None:
    runs = sel(lambda r: cpu_schedule(r) and r["norm"] in ("fbn", "fbn-scale") and touched(r) in ("none", "both", "mean")
               and r["bn_mean_attack"] in ("sf", "none"), gamma=0.0, f=3, grad_attack="none", bn_agg="mean")
    pivot(runs, lambda r: r["norm"], lambda r: {"none": "no attack (7 honest)", "both": "SF on both statistics",
                                                 "mean": "SF on the means"}[touched(r)])


@findings
def scale_findings() -> None:
    both = lambda norm: sel(lambda r: cpu_schedule(r) and touched(r) == "both" and r["bn_mean_attack"] == "sf",
                            norm=norm, gamma=0.0, f=3, bn_agg="mean")
    compare("scale-only FBN against FBN, no attack (7 honest)", control("fbn-scale", 0.0), control("fbn", 0.0))
    compare("scale-only FBN against FBN, SF on both statistics", both("fbn-scale"), both("fbn"))
    compare("FBN, SF on both statistics against no attack (7 honest)", both("fbn"), control("fbn", 0.0))


def other_settings_table(partition: str) -> None:
    pivot(sel(algorithm="fedavg", partition=partition), lambda r: r["norm"], lambda r: "final accuracy")


def toy_table() -> None:
    from robustbn.toy import TOY_MODES, normalization_experiment

    gammas = (0.0, 0.01, 0.1, 0.3, 0.5, 1.0)
    errors = {g: normalization_experiment(g, seed=0) for g in gammas}
    print("| gamma | " + " | ".join(f"{g:g}" for g in gammas) + " |")
    print("|---|" + "---|" * len(gammas))
    for m in TOY_MODES:
        print(f"| {m} | " + " | ".join(f"{errors[g][m]['norm_error']:.3f}" for g in gammas) + " |")
    print()


# ---- time --------------------------------------------------------------------------------------

def _setting_but_attack(r: dict) -> tuple:
    return tuple(sorted((k, json.dumps(v, sort_keys=True, default=str)) for k, v in r.items()
                        if k not in NOT_SETTING and k not in ATTACK_KEYS and k != "recorded_from"))


@cache
def curve_hashes() -> frozenset:
    """The robustness curves' runs: the tuning's (seeds 10, 11), the tuned and confirmation files'
    (seeds 0-4), and the curve searches' trials (a tuned point's setting, another attack, off the
    reported seeds; a board search at the same setting and lr would count here too), at any lr
    of the grid (a point's choice may have moved since), finished or not: no other section's
    accounting counts them."""
    files = (tuning_file(), *tuned_files(), *curve_confirmations())
    own = {r["hash"] for f in files if (ROOT / f).is_file() for r in own_seed_runs(f)}
    # and those a tuned file or a confirmation made at an lr its point has since moved from
    own |= {r["hash"] for r in rows() if str(r.get("source") or "").startswith(f"{TUNED_DIR}/")}
    at_any_lr = lambda r: _setting_but_attack({k: v for k, v in r.items() if k != "lr"})
    points = {at_any_lr(r) for f in files[1:] if (ROOT / f).is_file() for r in own_seed_runs(f)}
    trials = {r["hash"] for r in rows() if r["seed"] not in BOARD_SEEDS and r.get("lr") in LR_GRID
              and at_any_lr(r) in points}
    return frozenset(own | trials)


FAMILIES = (
    ("the robustness curves: tuning (seeds 10, 11), the tuned files (seeds 0-4) and the curve searches",
     lambda r: r["hash"] in curve_hashes()),
    ("the worst-case matrix and its clean runs (150 rounds, batch 32)", lambda r: r["rounds"] == 150),
    ("the paper's schedule (T = 1500)", lambda r: r["rounds"] == 1500),
    ("Figures 3 and 4 and the gap at T = 200 (DSGD)", lambda r: r["rounds"] == 200 and r["algorithm"] == "dsgd"),
    ("seeds 003 and 004's settings (FedAvg)", lambda r: r["algorithm"] == "fedavg"),
)


def _hours(runs, gpu: bool) -> tuple[int, float]:
    """How many of the runs ran on a GPU (or on the CPU), and their wall hours: on the CPU one
    torch thread a run; on a GPU each run's own wall time, eight sharing one GPU."""
    mine = [r for r in runs if str(r.get("device") or "cpu").startswith("cuda") == gpu]
    return len(mine), math.fsum(r["wall_time_s"] or 0 for r in mine) / 3600


def time_table() -> None:
    print("| runs | finished runs | diverged | CPU hours (one thread a run) | on a GPU: runs, run-hours |")
    print("|---|---|---|---|---|")

    def line(name, runs):
        _, cpu = _hours(runs, gpu=False)
        gpu_runs, gpu = _hours(runs, gpu=True)
        on_gpu = f"{gpu_runs}, {gpu:.1f}" if gpu_runs else "-"
        print(f"| {name} | {len(runs)} | {sum(r['status'] == 'diverged' for r in runs)} | {cpu:.1f} | {on_gpu} |")

    left = list(rows())
    for name, pred in FAMILIES:
        line(name, [r for r in left if pred(r)])
        left = [r for r in left if not pred(r)]
    if left:
        line("other", left)
    line("**all**", list(rows()))
    print()


def curve_cost_table() -> None:
    """Per protocol and curve, the runs finished at its points so far and their hours: the
    tuning (seeds 10, 11), the tuned files' and confirmations' reported runs (seeds 0-4), and
    the searches' trials; with how many of its tuned points have all their runs."""
    from robustbn.labels import norm_order, norm_words

    tuning = {r["hash"] for r in tuning_runs()}
    reported = {r["hash"] for f in tuned_files() + curve_confirmations() for r in own_seed_runs(f)}
    mine = [r for r in rows() if r["hash"] in curve_hashes()]
    finished = [own_seed_runs(f)[0] for f in curve_files() if Path(f).name.startswith("tuned_") and own_seed_runs(f)]
    print("| protocol | along | tuned points with every run | tuning runs | reported runs | search trials | "
          "CPU hours (runs) | GPU run-hours (runs) |")
    print("|---|---|---|---|---|---|---|---|")
    for norm in sorted({cell[0] for cell in planned_defenses()}, key=norm_order):  # the figures' order
        for x, (held, value) in SWEEPS.items():
            def on(r):
                return r["norm"] == norm and float(r[held]) == value
            runs = [r for r in mine if on(r)]
            planned = sum(len(v) for cell, v in planned_defenses().items()
                          if cell[0] == norm and float(cell[1 if held == "gamma" else 2]) == value)
            done = sum(on(r) for r in finished)
            cpu_runs, cpu = _hours(runs, gpu=False)
            gpu_runs, gpu = _hours(runs, gpu=True)
            print(f"| {norm_words(norm)} | {x} ({held} = {value:g}) | {done} of {planned} | "
                  f"{sum(r['hash'] in tuning for r in runs)} | {sum(r['hash'] in reported for r in runs)} | "
                  f"{sum(r['hash'] not in tuning and r['hash'] not in reported for r in runs)} | "
                  f"{cpu:.1f} ({cpu_runs}) | {gpu:.1f} ({gpu_runs}) |")
    print()


# the board's rows before issue 38, and the rows it added (root-free defenses as published, the mean)
ISSUE30_DEFENSES = ("nnm+trmean", "dnc", "fltrust", "mean")
ISSUE38_DEFENSES = ("cc", "bucketing+cc", "arc+nnm+trmean")


def clean_board_run(r) -> bool:
    return r["rounds"] == 150 and r["f"] == 3 and touched(r) == "none" and r["grad_attack"] in NOT_ATTACKS


def issue38_row(r) -> bool:
    """A run of a board row issue 38 added: cc, bucketing+cc, ARC, or the mean without a filter."""
    return r["rounds"] == 150 and r["grad_agg"] in ISSUE38_DEFENSES + ("mean",) and (
        r["grad_agg"] != "mean" or r.get("client_filter") in (None, "", "none"))


ISSUE30 = (
    ("the leaderboard's clean runs", lambda r: clean_board_run(r) and r["seed"] in (1, 2, 3, 4)
     and not issue38_row(r)),
    ("seeds 1-4 of Figures 3 and 4 and the gap at T = 200", lambda r: cpu_schedule(r) and r["seed"] in (1, 2, 3, 4)),
    ("seeds 1-2 at the paper's schedule (T = 1500)", lambda r: r["rounds"] == 1500 and r["seed"] in (1, 2)),
    ("seeds 1-4 of seeds 003 and 004's settings", lambda r: r["algorithm"] == "fedavg" and r["seed"] in (1, 2, 3, 4)),
)


@cache
def cc_check_only() -> frozenset:
    """The hashes of the centered-clipping check's runs that are not the board's."""
    board = {r["hash"] for r in matrix_runs(board_files())}
    return frozenset(r["hash"] for r in cc_check_runs() if r["hash"] not in board)


ISSUE38 = (
    ("the new rows' clean runs", lambda r: clean_board_run(r) and issue38_row(r) and r["hash"] not in cc_check_only()),
    ("the new rows' attacked runs", lambda r: r["rounds"] == 150 and r["gamma"] == 0.0 and not clean_board_run(r)
     and issue38_row(r) and r["seed"] in BOARD_SEEDS and r["hash"] not in cc_check_only()),
    ("IPM against the earlier rows", lambda r: r["rounds"] == 150 and r["gamma"] == 0.0 and r["grad_attack"] == "ipm"
     and not r.get("grad_attack_params") and not issue38_row(r) and r["seed"] in BOARD_SEEDS),
    ("centered clipping against its paper (its runs beyond the board's)", lambda r: r["hash"] in cc_check_only()),
)


def issue38_time() -> None:
    """The runs issue 38 added, and their CPU hours."""
    parts = []
    for name, pred in ISSUE38:
        mine = [r for r in rows() if pred(r) and r["hash"] not in curve_hashes()]
        parts.append(f"{name}: {len(mine)} runs, {math.fsum(r['wall_time_s'] or 0 for r in mine) / 3600:.1f} CPU hours")
    print("The runs issue 38 added (the root-free defenses as published, the undefended mean, and IPM in the "
          "catalogue): " + "; ".join(parts) + ".")


def ipm_share() -> None:
    """How many of the confirmed searched attacks have IPM as their gradient half."""
    files = [f for f in board_files() if "searched_worst_" in f]
    attacks = {}
    for f in files:
        r = next(iter(file_runs(f)), None)
        if r is not None:
            attacks[f] = r["grad_attack"]
    ipm = sum(a == "ipm" for a in attacks.values())
    print(f"IPM is the gradient half of {ipm} of the {len(attacks)} confirmed searched attacks "
          f"(`scenarios/searched_worst_*.toml`).")


def issue30_time() -> None:
    """The runs issue 30 added, and their CPU hours."""
    parts = []
    for name, pred in ISSUE30:
        mine = [r for r in rows() if pred(r) and r["hash"] not in curve_hashes()]
        parts.append(f"{name}: {len(mine)} runs, {math.fsum(r['wall_time_s'] or 0 for r in mine) / 3600:.1f} CPU hours")
    print("The runs beyond seed 0 (issue 30's, and a few seeds 1 made before it): " + "; ".join(parts) + ".")


def count() -> str:
    return str(len(rows()))


SECTIONS = ("leaderboard", "worst_case_tables", "worst_case_verdicts", "searched_against_catalogue",
            "fig4_findings", "fig4_extension_findings", "paper_schedule_findings", "fig3_table", "fig3_findings", "gap_table", "gap_findings", "fedtan_findings",
            "scale_table", "scale_findings", "seed003_findings", "seed004_findings", "disagreements", "time_table", "curve_cost_table")


RESULTS_MD = ROOT / "docs" / "results.md"
PAGE = ROOT / "docs" / "report"


def cog(check: bool, paths: list[Path] = (RESULTS_MD,)) -> int:
    """Run the cog blocks of `paths` (results.md): rewrite them, or with `check` only say whether
    they are what the runs give (non-zero where one is stale; cog names it "(changed)")."""
    from cogapp import Cog

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if check:  # the figures are compared by the digest the text carries, not redrawn
        os.environ["ROBUSTBN_DOCS_CHECK"] = "1"
    args = ["cog", "-P", "-p", "import tables", "--verbosity=1"]
    args += ["--check", "--diff", "--check-fail-msg=the file marked (changed) is stale: run ./dev.sh docs"] \
        if check else ["-r"]
    return Cog().main([*args, *map(str, paths)])


def page(out: Path = PAGE) -> Path:
    """The leaderboard page (robustbn report) of the runs, written to OUT/index.html."""
    from robustbn.matrix import read
    from robustbn.report import robustness_html, write_page

    curves = curve_runs()
    planned = read(ROOT / ROBUSTNESS_MATRIX)["norm"]
    notes = pick_notes()
    return write_page(board_runs(), out, robustness=robustness_html(
        curves, TUNED, SWEEPS, tuning_status(), expected_defenses, notes, planned,
        searched=lambda key: notes.get(key) == SEARCHED_WORDS, partly=lambda key: notes.get(key) == NOT_TRIED))


def page_check(outs: list[Path] = (PAGE,)) -> int:
    """0 where each OUT/index.html is the page the runs give, its images aside (their pixels
    follow the machine's fonts and matplotlib, not the runs); 1 and a message per stale one."""
    def text(path: Path) -> str:
        return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:image/png;base64,...",
                      path.read_text(encoding="utf-8"))

    with tempfile.TemporaryDirectory() as tmp:
        given = text(page(Path(tmp)))
    stale = [out / "index.html" for out in outs
             if not (out / "index.html").is_file() or text(out / "index.html") != given]
    for shipped in stale:
        print(f"{shipped} is stale: run ./dev.sh docs", file=sys.stderr)
    return 1 if stale else 0


USAGE = """usage: python docs/tables.py [RUNS]                     every section, printed (RUNS: a store or CSV)
       python docs/tables.py --cog [--check] [FILE...]   results.md's cog blocks: rewrite, or check
       python docs/tables.py --page [--check] [DIR...]   the leaderboard page (docs/report/index.html): write, or check"""


def main(argv) -> int:
    global SOURCE
    if argv[:1] in (["--cog"], ["--page"]):
        check = "--check" in argv[1:]
        paths = [a for a in argv[1:] if a != "--check"]
        if any(a.startswith("-") for a in paths) or (len(paths) > 1 and not check and argv[0] == "--page"):
            print(USAGE, file=sys.stderr)
            return 2
        if argv[0] == "--cog":
            return cog(check, [Path(p) for p in paths] or [RESULTS_MD])
        if check:
            return page_check([Path(p) for p in paths] or [PAGE])
        print(page(Path(paths[0]) if paths else PAGE))
        return 0
    if len(argv) > 1 or any(a.startswith("-") for a in argv):
        print(USAGE, file=sys.stderr)
        return 2
    if argv:
        SOURCE = argv[0]
    for name in SECTIONS:
        print(f"\n## {name}\n")
        globals()[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
