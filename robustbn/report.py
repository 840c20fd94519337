"""The leaderboard: which defense to use with which BN protocol, and how bad it can get, in
RobustBench's manner (clean accuracy beside robust accuracy).

One row per (BN protocol, defense) at one gamma (0 by default), from the worst-case matrix's
runs, the confirmation runs of attack searches and the clean runs (`DEFAULT_MATRICES`):

- clean accuracy: the setting's no-attack baseline (every Byzantine channel `honest`: the same
  protocol, defense, f, data split and seeds), or, where none ran, the setting with f = 0 and
  the same other fields; `clean_kind` says which;
- worst-case accuracy: the lowest seed-pooled mean over the catalogue's attacks and the
  confirmed searched ones (robustbn.worst), its 95% Student-t interval and its seeds;
- the worst attack in words, naming each message it touched (gradients, BN mean, BN
  variance), and whether it is the catalogue's or a search's (`worst_kind`, `worst_source`);
- the threat model (`server_data`: None, or the trusted data the defense uses, FLTrust's root
  set), whether an attack search reached the row (`searched`: its confirmation file), how many
  attacks its worst case is the worst of (`attacks_run`) and how many of the worst attack's
  runs diverged (`diverged`: they count at chance, robustbn.stats.accuracy);
- the verdict within the protocol and threat model (robustbn.worst: best, tied for best, or
  worse, paired over seeds under each defense's worst attack), or "n seeds, no verdict" where
  fewer than robustbn.stats.MIN_PAIRS seeds were paired.

Above it, per protocol and threat model (root-free, trusted server data), the pick the verdict
supports: "use Y" only where Y is best; where the best is tied, every tied defense and no pick.
`render_html` writes it as one self-contained page (CSS, JS and images inline; no network),
`rows_json` as the JSON of `robustbn report --format json`.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .channels import NOT_ATTACKS
from .labels import (CHANNEL_WORDS, attack_short, attack_words, channels, compact_defense, hashable, is_attack,
                     label_sorted_words, norm_order, norm_words, text)
from .stats import CLIPPED_PERCENT_WORDS, DIVERGED_WORDS, MIN_PAIRS, PAIRED_WORDS, accuracy, number, too_few
from .stats import chance as chance_of
from .worst import (BEST, DEFENSE_FIELDS, SEARCHED, SEARCHED_PREFIX, TIED, WORSE, SettingsDiffer, matrix_rows,
                    protocol_map, setting_groups, worst_case)

CATALOGUE_MATRIX = "scenarios/worst_case_fmnist.toml"
CLEAN_MATRIX = "scenarios/clean_worst_case_fmnist.toml"
SEARCHED_GLOB = "searched_worst_*.toml"
COLUMNS = ("protocol", "defense", "server data", "clean accuracy", "worst-case accuracy", "95% CI", "seeds",
           "worst attack", "searched", "verdict")
KEYS = ("norm", "defense", "clean_acc", "worst_acc", "ci_low", "ci_high", "seeds", "worst_attack", "verdict",
        "server_data", "searched", "attacks_run", "diverged")
EXTRA_KEYS = ("clean_low", "clean_high", "clean_seeds", "clean_kind", "worst_kind", "worst_source", "gap", "gap_low",
              "gap_high", "gap_pairs")
ROOT_FREE = "root-free"  # the threat model of a defense that needs nothing from the server
TRUSTED = "trusted server data"
# protocols a practitioner may ask about that the project's worst-case matrix leaves out, and why
# (said of any store: these are not among its runs either)
ABSENT = {
    "fedbn": "BN layers stay local: each client's model is evaluated on its own test split (a personalized "
             "accuracy, not comparable with a global model's); not among these runs, nor in robustbn's "
             "worst-case matrix",
    "silobn": "BN statistics stay local (personalized evaluation, as FedBN); not among these runs, nor in "
              "robustbn's worst-case matrix",
    "fedwon": "no BN statistics to attack or defend (weight standardization); not among these runs, nor in "
              "robustbn's worst-case matrix",
    "fbn-scale": "not among these runs, nor in robustbn's worst-case matrix (run only undefended, "
                 "docs/results.md's scale-only FBN table)",
}
SETUP_FIELDS = ("dataset", "model", "n", "f", "rounds", "batch_size", "lr", "momentum", "partition", "gamma",
                "algorithm")


def is_search_file(source: Any) -> bool:
    """Whether a run came from an attack search's file (a trial, on the search's tuning seeds):
    the file has a [search] table, or, gone, was named search_*.toml."""
    if not source:
        return False
    path = Path(str(source))
    try:
        import tomllib
        return "search" in tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return path.name.startswith("search_")


def unreported(source: Any) -> bool:
    """Whether a run is one no report reads unless asked by its file: an attack search's trial
    or a tuning run (robustbn tune), both on seeds picked to be kept out of reports."""
    from .tune import is_tuning_file

    if not str(source or "").endswith(".toml"):  # an imported CSV, say: no file of either kind
        return False
    return is_search_file(source) or is_tuning_file(source)


def default_matrices(root: str | Path = ".") -> list[str]:
    """The catalogue's matrix, the clean runs and every confirmation file of an attack search
    (`scenarios/searched_worst_*.toml`), those of them that exist under `root`."""
    root = Path(root)
    files = [CATALOGUE_MATRIX, CLEAN_MATRIX,
             *sorted(str(p.relative_to(root)) for p in (root / "scenarios").glob(SEARCHED_GLOB))]
    return [f for f in files if (root / f).is_file()]


@dataclass
class Board:
    """The leaderboard: `rows` (dicts with KEYS, EXTRA_KEYS and `runs`), the recommendations (per
    protocol, threat model and setting: `recommendations`, dicts with norm, threat, setting, pick and text;
    `lines`, their texts), the protocols left out with the reason, and the setting the rows share (`setup`:
    field -> its values)."""

    rows: list[dict[str, Any]]
    recommendations: list[dict[str, Any]] = field(default_factory=list)
    absent: list[tuple[str, str]] = field(default_factory=list)
    gamma: float = 0.0
    setup: dict[str, list] = field(default_factory=dict)
    protocols: list[dict[str, Any]] | None = None  # robustbn.worst.protocol_map's cells; None: several settings
    chance: float | None = None  # 1 / classes

    @property
    def lines(self) -> list[str]:
        return [r["text"] for r in self.recommendations]


def _same_but_f(t: dict[str, Any], keys: list[str]) -> tuple:
    return tuple(hashable(t.get(k)) for k in keys if k not in ("f", "agg_f"))


def threat(r: dict[str, Any]) -> str:
    """A row's threat model: ROOT_FREE, or TRUSTED where its defense uses trusted server data."""
    return TRUSTED if r.get("server_data") else ROOT_FREE


def leaderboard(rows: list[dict[str, Any]], gamma: float = 0.0) -> Board:
    """The leaderboard of `rows` (as `Store.rows()`, with `source` where read through
    `matrix_rows`) at `gamma`: see the module's docstring."""
    rows = [r for r in rows if r.get("gamma") is not None and math.isclose(float(r["gamma"]), gamma)]
    table = worst_case(rows)
    keys, groups = setting_groups(rows)
    clean_f0 = {_same_but_f(t, keys): t for t in table if not t.get("f")}
    # a store of several settings (other n, rounds, a user's code): each row names its own
    values = defaultdict(set)
    for t in table:
        for k in keys:
            if t.get("f") and k not in DEFENSE_FIELDS | {"norm", "gamma", "defense", "server_data"}:
                values[t["norm"], t["defense"], k].add(hashable(t.get(k)))
    apart = sorted({k for (_, _, k), v in values.items() if len(v) > 1}, key=keys.index)
    out = []
    for t in table:
        if not t.get("f"):
            continue
        clean, kind = (t["no_attack_acc"], t["no_attack_low"], t["no_attack_high"], t["no_attack_seeds"]), "honest"
        if clean[0] is None:
            c = clean_f0.get(_same_but_f(t, keys))
            clean, kind = ((c["worst_acc"], c["ci_low"], c["ci_high"], c["seeds"]), "f = 0") if c else \
                ((None, None, None, 0), None)
        runs = sorted(groups.get(tuple(hashable(t.get(k)) for k in keys), []),
                      key=lambda r: (attack_short(r), str(r.get("seed"))))
        runs = [{"seed": r.get("seed"), "hash": r.get("hash"), "code_version": r.get("code_version"),
                 "status": r.get("status"), "attack": attack_short(r), "final_acc": r.get("final_acc"),
                 "acc": accuracy(r)[0], "diverged": accuracy(r)[1], "source": r.get("source"),
                 "worst": is_attack(r) and attack_words(r) == t["worst_attack"]} for r in runs]
        searched = sorted({str(r["source"]) for r in runs if SEARCHED_PREFIX in str(r.get("source") or "")})
        setting = ", ".join(f"{k}={text(t.get(k))}" for k in apart)
        out.append({"norm": t["norm"], "defense": t["defense"] + (f" ({setting})" if apart else ""), "setting": setting,
                    "rule": t["defense"], "f": t.get("f"),  # as robustbn.worst names it, and its f: the page's own keys
                    "clean_acc": clean[0], "worst_acc": t["worst_acc"],
                    "ci_low": t["ci_low"], "ci_high": t["ci_high"], "seeds": t["seeds"],
                    "worst_attack": t["worst_attack"], "verdict": t["verdict"], "server_data": t["server_data"],
                    "searched": ", ".join(searched) or None, "attacks_run": t["attacks"],
                    "diverged": sum(r["worst"] and r["diverged"] for r in runs),
                    "clean_low": clean[1], "clean_high": clean[2], "clean_seeds": clean[3], "clean_kind": kind,
                    **{k: t[k] for k in ("worst_kind", "worst_source", "gap", "gap_low", "gap_high", "gap_pairs")},
                    "runs": runs})
    for r in out:  # a verdict on fewer than MIN_PAIRS paired seeds is none (the best's: its group's fewest pairs)
        pairs = r["gap_pairs"] if r["gap_pairs"] is not None else min(
            (o["gap_pairs"] for o in out if (o["norm"], threat(o)) == (r["norm"], threat(r))
             and o["gap_pairs"] is not None), default=None)
        if r["verdict"] is not None and too_few(pairs):
            r["verdict"] = too_few(pairs)
    # within a protocol, the highest worst case first (the page's default order)
    out.sort(key=lambda r: (norm_order(r["norm"]), r["worst_acc"] is None, -(r["worst_acc"] or 0.0), r["defense"]))
    norms = sorted({r["norm"] for r in out}, key=norm_order)
    # a pick compares the defenses of one setting (its verdicts do): one per protocol, threat model and setting
    settings = list(dict.fromkeys(r["setting"] for r in out))
    mine = lambda norm, model, at: [r for r in out if r["norm"] == norm and threat(r) == model and r["setting"] == at]
    picks = [{"norm": norm, "threat": model, "setting": at, "pick": pick(mine(norm, model, at)),
              "text": recommendation(norm, mine(norm, model, at), model, at)}
             for norm in norms for at in settings if any(r["norm"] == norm and r["setting"] == at for r in out)
             for model in (ROOT_FREE, TRUSTED)]
    setup = {k: sorted({hashable(r.get(k)) for r in rows if r.get("f")}, key=str) for k in SETUP_FIELDS}
    # the messages the runs' attacks forged, and whether any defense used server data: the page says no more
    setup["attacked"] = [c for c in CHANNEL_WORDS if any(
        chans.get(c, ("none",))[0] not in NOT_ATTACKS for r in rows if r.get("f") for chans in [channels(r)])]
    setup["server_data"] = sorted({r["server_data"] for r in out if r.get("server_data")})
    try:  # which BN protocol: each at its highest row, paired across protocols (one setting per cell)
        protocols = protocol_map(rows) if out else []
    except SettingsDiffer:
        protocols = None
    return Board(out, picks, [(p, reason) for p, reason in ABSENT.items() if p not in norms], gamma, setup,
                 protocols, chance_of(rows[0]) if rows else None)


def pct(v: float | None) -> str:
    return "-" if v is None else number(v, 1, 100)


def ci(low: float | None, high: float | None, n: int | None) -> str:
    """"[a, b]" in percent, "1 seed, no interval", "" for no values."""
    if not n:
        return ""
    if low is None or high is None:
        return f"{n} seed{'s' * (n != 1)}, no interval"
    return f"[{pct(low)}, {pct(high)}]"


def known(r: dict[str, Any]) -> str:
    """A row's worst case with its evidence: "A (57.9% [51.4, 64.3], 5 seeds)"."""
    seeds = f", {r['seeds']} seeds" if r["seeds"] else ""
    return f"{r['defense']} ({pct(r['worst_acc'])}% {ci(r['ci_low'], r['ci_high'], r['seeds'])}{seeds})"


def pick(rows: list[dict[str, Any]]) -> str:
    """The pick among one protocol's rows of one threat model, in the words of the generated
    verdict: "use Y" only where Y is best (every other row lower, paired); a tie names every
    tied row and picks none; too few paired seeds say so."""
    ranked = [r for r in rows if r["worst_acc"] is not None]
    if not ranked:
        return "no defense run" if not rows else "no worst case known (no attack run)"
    best = max(ranked, key=lambda r: r["worst_acc"])
    if len(ranked) == 1:
        return f"{known(best)}, the only such defense run"
    if best["verdict"] == BEST:
        return f"use {known(best)}; every other defense is lower, paired over seeds"
    if best["verdict"] == TIED:
        tied = [best] + [r for r in ranked if r is not best and r["verdict"] == TIED]
        return f"no single pick, {len(tied)} tied for best: " + "; ".join(known(r) for r in tied)
    tied = [r for r in ranked if r is not best and r["verdict"] == TIED]
    if tied:  # the rows paired on enough seeds tie with the highest; a row with too few says so apart
        few = [r for r in ranked if r is not best and r["verdict"] not in (TIED, WORSE)]
        unsure = "; ".join(f"{r['defense']}: {r['verdict']}" for r in few)
        return (f"no single pick, {len(tied) + 1} tied for best: " + "; ".join(known(r) for r in [best, *tied])
                + (f" (not yet compared: {unsure})" if unsure else ""))
    if best["verdict"] is None:  # nothing it was compared with (another setting, or an lr of its own)
        return f"the highest worst case is {known(best)}; not compared with the others (not one setting)"
    return f"the highest worst case is {known(best)}; {best['verdict']}"


def recommendation(norm: str, rows: list[dict[str, Any]], model: str = ROOT_FREE, setting: str = "") -> str:
    """"with X, root-free: <pick>" (`pick`), the trusted data named for the other model, and the
    setting where the board holds several ("with X at f=1, root-free: ...")."""
    data = f" ({rows[0]['server_data']})" if model == TRUSTED and rows else ""
    return f"with {norm_words(norm)}{f' at {setting}' if setting else ''}, {model}{data}: {pick(rows)}"


def clean_text(r: dict[str, Any]) -> str:
    """The clean accuracy cell: "74.9 [72.0, 77.8] (5 seeds)", "not run"."""
    if r["clean_acc"] is None:
        return "not run"
    n = r["clean_seeds"]
    interval_ = f" {ci(r['clean_low'], r['clean_high'], n)}" if r["clean_low"] is not None else ""
    kind = ", f = 0" if r["clean_kind"] == "f = 0" else ""
    return f"{pct(r['clean_acc'])}{interval_} ({n} seed{'s' * (n != 1)}{kind})"


def attack_text(r: dict[str, Any]) -> str:
    """The worst attack in words (it names each message it touched) and where it came from."""
    if r["worst_attack"] is None:
        return "no attack run"
    where = f"searched: {r['worst_source']}" if r["worst_kind"] == SEARCHED else r["worst_kind"]
    return f"{r['worst_attack']}" + (f" ({where})" if where else "")


def searched_text(r: dict[str, Any]) -> str:
    """Whether an attack search reached the row (its confirmation file), and how many attacks
    its worst case is the worst of."""
    n = r["attacks_run"]
    return f"{'yes' if r['searched'] else 'no'}; worst of {n} attack{'s' * (n != 1)}"


def worst_text(r: dict[str, Any]) -> str:
    """The worst-case cell: "57.9", "10.0 (5 of 5 runs diverged)"."""
    d = r["diverged"]
    return pct(r["worst_acc"]) + (f" ({d} of {r['seeds']} runs diverged)" if d else "")


def server_text(r: dict[str, Any]) -> str:
    return r["server_data"] or f"none ({ROOT_FREE})"


def cells(r: dict[str, Any]) -> list[str]:
    """A row's cells as text, in `COLUMNS` order."""
    return [norm_words(r["norm"]), r["defense"], server_text(r), clean_text(r), worst_text(r),
            ci(r["ci_low"], r["ci_high"], r["seeds"]), str(r["seeds"] or 0), attack_text(r), searched_text(r),
            r["verdict"] or "-"]


def rows_json(board: Board) -> list[dict[str, Any]]:
    """The rows of `robustbn report --format json`: KEYS, then EXTRA_KEYS."""
    return [{k: r[k] for k in (*KEYS, *EXTRA_KEYS)} for r in board.rows]


PAIRED = PAIRED_WORDS.replace("95% CI: ", "the 95% interval, ")
NOTE = (f"Final test accuracy (%). Worst-case accuracy: the lowest mean over seeds among the catalogue's attacks "
        f"and the confirmed searched ones; {CLIPPED_PERCENT_WORDS}; {DIVERGED_WORDS}, and a cell says how many of "
        f"its runs diverged. Clean accuracy: the same setting with every Byzantine channel honest (or f = 0 where "
        f"marked). Threat models are ranked apart: a defense that uses trusted server data (server data: a root "
        f"set) assumes more than a {ROOT_FREE} one. Verdict within the protocol and threat model: best only where "
        f"every other defense is worse paired over seeds under its own worst attack ({PAIRED}, excludes 0), else "
        f"tied for best; no verdict on fewer than {MIN_PAIRS} paired seeds.")


def markdown(board: Board) -> str:
    """The recommendations, the rule of the table, the leaderboard as a markdown table, and the
    absent protocols."""
    out = [f"- {line}" for line in board.lines]
    out += ["", f"gamma = {board.gamma}. {NOTE}", ""]
    out += [f"| {' | '.join(COLUMNS)} |", "|" + "---|" * len(COLUMNS)]
    for r in board.rows:
        text = cells(r)
        if r["verdict"] == BEST:
            text = [f"**{c}**" for c in text]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in text) + " |")
    if board.absent:
        out += ["", "Not on the leaderboard (no runs at this setting):", ""]
        out += [f"- {norm_words(p)} (`{p}`): {reason}" for p, reason in board.absent]
    return "\n".join(out) + "\n"


# ---- the page ----------------------------------------------------------------------------------

CSS = """body{font:15px/1.5 system-ui,sans-serif;margin:1em auto;max-width:80em;padding:0 12px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.5em}
.box{background:#f6f7fb;border:1px solid #dde;border-radius:6px;padding:8px 14px;margin:1em 0}
.box dt{font-weight:600}.box dd{margin:0 0 6px 0}
.scroll{overflow-x:auto;max-width:100%;-webkit-overflow-scrolling:touch}
table{border-collapse:collapse}th,td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}caption{text-align:left;padding:4px 0;color:#555;font-size:13px}
.scroll>table>caption{position:sticky;left:0;max-width:calc(100vw - 24px);box-sizing:border-box}
#leaderboard{min-width:60em}#leaderboard>thead th button{font:inherit;font-weight:600;background:none;border:0;
padding:0;cursor:pointer;text-align:left;color:inherit}
#leaderboard>thead th button:focus-visible{outline:2px solid #36c}
#leaderboard>thead th[aria-sort=ascending] button:after{content:" \\25B2"}
#leaderboard>thead th[aria-sort=descending] button:after{content:" \\25BC"}
tr.entry:hover{background:#f7f7ff}tr.best{font-weight:bold}td.num{text-align:right;white-space:nowrap}
tr.runs td{padding:0 8px;border:0}details table{font-size:12px;margin:0 0 8px 1em}
table.heat td{text-align:center;min-width:5.5em}table.heat td small{display:block;color:#333;font-size:11px}
img{max-width:100%;height:auto}code{font-size:13px;overflow-wrap:anywhere}
.map th{white-space:nowrap}.map td>div{font-size:13px}.map td>div+div{margin-top:4px}
#recommendations td,table.protocols td{overflow-wrap:anywhere}table.protocols th{white-space:normal}
@media (max-width:600px){img.zoom{max-width:none;width:760px}}"""

JS = """(function(){
  var table = document.getElementById('leaderboard');
  var heads = Array.prototype.slice.call(table.tHead.rows[0].cells);
  heads.forEach(function(th, col){
    th.querySelector('button').addEventListener('click', function(){
      var up = th.getAttribute('aria-sort') !== 'ascending';
      heads.forEach(function(h){ h.setAttribute('aria-sort', 'none'); });
      th.setAttribute('aria-sort', up ? 'ascending' : 'descending');
      var bodies = Array.prototype.slice.call(table.tBodies);
      function key(b){ var c = b.rows[0].cells[col]; return c.dataset.v !== undefined ? c.dataset.v : c.textContent; }
      bodies.sort(function(a, b){
        var x = key(a), y = key(b), nx = parseFloat(x), ny = parseFloat(y);
        var d = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : String(x).localeCompare(String(y));
        return up ? d : -d;
      });
      bodies.forEach(function(b){ table.appendChild(b); });
    });
  });
})();"""


def png_uri(fig) -> str:
    """A matplotlib figure as a data: URI (and closed); the whole figure, legends included."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _sort_value(r: dict[str, Any], col: int) -> str | None:
    """The number a numeric column sorts by (missing values last when ascending)."""
    value = {3: r["clean_acc"], 4: r["worst_acc"], 5: r["ci_low"], 6: r["seeds"]}.get(col, "text")
    if value == "text":
        return None
    return f"{value:.6g}" if value is not None else "1e9"


def heatmap_html(board: Board) -> str:
    """The worst-case heatmap as an HTML table: a row per defense, a column per protocol; a
    cell is the worst case in % (its color), its interval, seeds, diverged runs and worst attack."""
    e = html.escape
    norms = list(dict.fromkeys(r["norm"] for r in board.rows))
    defenses = sorted({r["defense"] for r in board.rows}, key=lambda d: (d != "mean", d))
    cell = {(r["norm"], r["defense"]): r for r in board.rows}
    head = "".join(f'<th scope="col">{e(norm_words(n))}</th>' for n in norms)
    body = []
    for d in defenses:
        tds = []
        for n in norms:
            r = cell.get((n, d))
            if r is None or r["worst_acc"] is None:
                tds.append("<td>-</td>" if r is None else "<td>no attack run</td>")
                continue
            v = r["worst_acc"]
            color = f"hsl({round(120 * v)},70%,{round(88 - 20 * (1 - v))}%)"  # red (0%) to green (100%)
            mark = f" ({r['diverged']} of {r['seeds']} diverged)" if r["diverged"] else ""
            tds.append(f'<td style="background:{color}">{pct(v)}{mark}<small>{e(ci(r["ci_low"], r["ci_high"], r["seeds"]))}'
                       f'</small><small>{e(attack_short_of(r))}</small></td>')
        body.append(f'<tr><th scope="row">{e(d)}</th>{"".join(tds)}</tr>')
    return (f'<div class="scroll"><table class="heat"><caption>Worst case over the attacks run (%), 95% interval '
            f'over seeds, and the worst attack (the messages it touched in brackets)</caption><thead><tr>'
            f'<th scope="col">defense</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')


def attack_short_of(r: dict[str, Any]) -> str:
    """The worst attack of a board row in a few characters (its runs know it)."""
    return next((run["attack"] for run in r["runs"] if run["worst"]), r["worst_attack"] or "")


def figures(rows: list[dict[str, Any]], board: Board) -> list[tuple[str, str]]:
    """(caption, data URI): the curves of each protocol's recommended defenses (root-free and
    trusted-data) under their worst attack."""
    from .plots import figure

    picked = []
    for norm in dict.fromkeys(r["norm"] for r in board.rows):
        for model in (ROOT_FREE, TRUSTED):
            ranked = [r for r in board.rows if r["norm"] == norm and threat(r) == model and r["worst_acc"] is not None]
            if ranked:
                best = max(ranked, key=lambda r: r["worst_acc"])
                worst_hashes = {run["hash"] for run in best["runs"] if run["worst"]}
                picked += [r for r in rows if r.get("hash") in worst_hashes and r.get("history")]
    if not picked:
        return []
    return [("The highest worst case of each protocol and threat model under its worst attack: accuracy over "
             "rounds (mean over seeds, 95% CI band)", png_uri(figure(picked, "curves")))]


def setup_html(board: Board) -> str:
    """The setting and the threat model, in words, from the rows' own fields."""
    from .data import num_classes  # as stats.chance: the page's import stays light

    e = html.escape
    v = lambda k: ", ".join(str(x) for x in board.setup.get(k, [])) or "?"
    gamma = board.gamma
    ns, fs = board.setup.get("n", []), board.setup.get("f", [])
    honest = [n - f for n in ns for f in fs if isinstance(n, int) and isinstance(f, int)] if len(ns) == 1 else []
    classes = {num_classes(d) for d in board.setup.get("dataset", [])}
    spread = (label_sorted_words(classes.pop() if len(classes) == 1 else None, honest) +
              " (the extreme heterogeneity of the FBN paper, Guerraoui et al. 2024)" if gamma == 0 else
              "the data is iid across clients" if gamma == 1 else
              f"a fraction {gamma} of each client's data is iid, the rest sorted by class")
    items = [
        ("Task", f"{v('dataset')}, model {v('model')}, {v('algorithm')} for {v('rounds')} rounds (batch {v('batch_size')}, "
                 f"lr {v('lr')}, worker momentum {v('momentum')})"),
        ("Clients", f"n = {v('n')}, of which f = {v('f')} are Byzantine; partition {v('partition')}, gamma = {gamma}: "
                    f"{spread}"),
        ("What attackers control", "the Byzantine clients are omniscient (they see every honest message of the round) "
                                   "and send what the attack forges on the messages these runs attack: "
                                   f"{_attacked_words(board.setup.get('attacked', []))}; each message channel (the "
                                   "gradients, the BN running means, the BN running variances) is aggregated by its "
                                   "own rule, and a channel an attack leaves alone carries honest values. GroupNorm "
                                   "sends gradients only." + _phased_words(board)),
    ]
    if board.setup.get("server_data"):
        data = "; ".join(board.setup["server_data"])
        items.append(("Trusted server data", f"a defense marked with its server data ({data}) also uses clean "
                                             f"training examples the server holds, while {spread}: a stronger "
                                             "assumption, ranked apart from the root-free defenses."))
    return '<dl class="box">' + "".join(f"<dt>{e(k)}</dt><dd>{e(t)}</dd>" for k, t in items) + "</dl>"


def _phased_words(board: Board) -> str:
    """ " FixBN sends statistics in its first phase only: ..." for the board's protocols whose
    statistics stop at a switch round (a `phase` of their own), where a BN attack acts only
    before it."""
    from .protocols import PROTOCOLS, Protocol

    phased = [norm_words(n) for n in dict.fromkeys(r["norm"] for r in board.rows)
              if (cls := PROTOCOLS.get(n)) and cls.sends_statistics and cls.phase is not Protocol.phase]
    return (f" {' and '.join(phased)} {'sends' if len(phased) == 1 else 'send'} statistics in the first phase only "
            f"(up to the switch round): an attack on the BN messages acts in those rounds.") if phased else ""


def _attacked_words(attacked: list[str]) -> str:
    """ "the gradients (worker momentum) and the BN running means", or "none" (no attacked run)."""
    words = {"grad": "the gradients (worker momentum)", "bn_mean": "the BN running means",
             "bn_var": "the BN running variances"}
    named = [words[c] for c in attacked]
    return ", ".join(named[:-1]) + f" and {named[-1]}" if len(named) > 1 else named[0] if named else "none"


def recommendations_html(board: Board) -> str:
    e = html.escape
    heads = list(dict.fromkeys((r["norm"], r.get("setting", "")) for r in board.recommendations))
    text = {(r["norm"], r.get("setting", ""), r["threat"]): r["pick"] for r in board.recommendations}
    body = "".join(f'<tr><th scope="row">{e(norm_words(n) + (f" at {at}" if at else ""))}</th>'
                   f"<td>{e(text[n, at, ROOT_FREE])}</td><td>{e(text[n, at, TRUSTED])}</td></tr>" for n, at in heads)
    return (f'<div class="scroll"><table id="recommendations"><caption>Per protocol and threat model: the pick where '
            f'the paired verdict supports one, else every tied defense</caption><thead><tr><th scope="col">protocol'
            f'</th><th scope="col">{ROOT_FREE}</th><th scope="col">{TRUSTED}</th></tr></thead><tbody>{body}</tbody>'
            f"</table></div>")


def _map_pick(p: dict[str, Any], tuned: tuple[str, ...], note: str) -> str:
    """A map cell's pick: "nnm+trmean (grad), mean (BN) 52.0 [48.4, 57.5] (5 seeds; lr 0.05)"."""
    n = p["seeds"]
    interval = f" [{pct(p['ci_low'])}, {pct(p['ci_high'])}]" if p["ci_low"] is not None and p["ci_high"] is not None \
        else ""
    return (f"{compact_defense(p['defense'])} {pct(p['worst_acc'])}{interval} ({n} seed{'s' * (n != 1)}"
            f"{'' if interval else ', no interval'}; {', '.join(f'{k} {p[k]}' for k in tuned)}{note})")


def board_protocol_parts(board: Board) -> tuple[dict[bool, list[str]], Callable[[dict, dict], bool]]:
    """What the board's protocol comparison needs beside its cells: the protocols of each threat
    model (those with a row in it: FedTAN has no trusted one, so none is waited for), and
    whether a cell's pick has a confirmed attack search (a confirmation file's runs among its
    attacks)."""
    searched = {(r["norm"], r["rule"], r["server_data"], r["f"]) for r in board.rows if r["searched"]}
    planned = {t: sorted({r["norm"] for r in board.rows if bool(r["server_data"]) == t}, key=norm_order)
               for t in (False, True)}
    return planned, lambda c, p: (p["norm"], p["defense"], c["threat"], c["f"]) in searched


def board_protocols_html(board: Board) -> str:
    """Which BN protocol on the board: protocols_html over the board's protocol_map cells."""
    if board.protocols is None:
        return ("<p>The rows hold several settings at one point: compare protocols within one with <code>robustbn "
                "results --worst-case --by-protocol --where FIELD=VALUE</code>.</p>")
    if not board.protocols:
        return "<p>No attacked row yet.</p>"
    planned, found = board_protocol_parts(board)
    lrs = ", ".join(str(v) for v in board.setup.get("lr", []))
    return protocols_html(board.protocols, board.chance, planned,
                          lambda c, p: ", searched" if found(c, p) else "", found,
                          scope=f"every defense at the board's lr {lrs}" if lrs else "")


def _protocol_pick(p: dict[str, Any], words: str) -> str:
    """A protocol's pick: "dnc 44.7 [8.1, 81.3] (5 seeds, searched; clean 76.4; worst: ALIE (grad))",
    the worst attack with the messages it touched."""
    interval = "" if p["ci_low"] is None or p["ci_high"] is None else f" [{pct(p['ci_low'])}, {pct(p['ci_high'])}]"
    return (f"{compact_defense(p['defense'])} {pct(p['worst_acc'])}{interval} ({p['seeds']} "
            f"seed{'s' * (p['seeds'] != 1)}{'' if interval else ', no interval'}{words}{pick_tail(p)})")


def pick_tail(p: dict[str, Any]) -> str:
    """What follows a protocol's pick in the page and results.md alike: "; clean 76.4 [75.0,
    77.8] (5 seeds); worst: ALIE (grad)", its clean accuracy (its interval and seeds where
    known) and its worst attack with the messages it touched."""
    n = p.get("no_attack_seeds")
    interval = f" [{pct(p['no_attack_low'])}, {pct(p['no_attack_high'])}]" \
        if p.get("no_attack_low") is not None and p.get("no_attack_high") is not None else ""
    seeds = f" ({n} seed{'s' * (n != 1)}{'' if interval else ', no interval'})" if n else ""
    return ("" if p.get("no_attack_acc") is None else f"; clean {pct(p['no_attack_acc'])}{interval}{seeds}") + \
        (f"; worst: {compact_defense(p['worst_attack'])}" if p.get("worst_attack") else "")


def protocols_html(cells: list[dict[str, Any]], chance: float | None, planned: dict[bool, Iterable[str]],
                   words: Callable[[dict, dict], str], searched: Callable[[dict, dict], bool] | None = None,
                   partly: Callable[[dict, dict], bool] = lambda c, p: False, scope: str = "") -> str:
    """`robustbn.worst.protocol_map`'s cells as a table per threat model: a row per point, its
    verdict, then each protocol at its highest defense (`words(cell, pick)` after its seeds: its
    tuned values, whether searched), each below the first with its paired gap ("lower by" or
    "tied" only where the cell has a verdict). `planned[trusted]`: the protocols meant to be in
    that threat model; `searched(cell, pick)`: whether a pick's attack search is confirmed (a
    verdict over others is provisional), `partly(cell, pick)`: whether it is but has not yet
    tried the attacks confirmed at the defense's other points; `scope`: at which lr the defenses
    ran, in the caption (the board's one lr and the curves' tuned ones give one point two tables)."""
    from .worst import gap_words, protocol_head, provisional

    e = html.escape
    out = []
    for trusted in (False, True):
        rows = []
        for c in (c for c in cells if (c["threat"] is not None) == trusted):
            shown = "".join(f"<div>{'' if i == 0 else e(gap_words(c, p)) + ': '}<b>{e(norm_words(p['norm']))}</b> "
                            f"{e(_protocol_pick(p, words(c, p)))}</div>" for i, p in enumerate(c["protocols"]))
            head = protocol_head(c, chance, planned[trusted]) + ("" if searched is None else provisional(
                c, lambda p: searched(c, p), chance, lambda p: partly(c, p)))
            rows.append(f'<tr><td>{c["gamma"]:g}</td><td>{c["f"]}</td><td><b>{e(head)}</b></td><td>{shown}</td></tr>')
        if rows:
            data = sorted({c["threat"] for c in cells if c["threat"]})
            model = f"{TRUSTED} ({', '.join(data)})" if trusted else ROOT_FREE
            out.append(f'<div class="scroll"><table class="map protocols"><caption>Which BN protocol, {e(model)}'
                       f'{", " + e(scope) if scope else ""}: each protocol at its highest defense at the point, compared by the same paired rule over seeds '
                       f'(the defense chosen on the seeds it is compared on); clean: the same defense without attack'
                       f'</caption><thead><tr><th scope="col">gamma</th><th scope="col">f</th><th scope="col">verdict'
                       f'</th><th scope="col">protocol: its defense</th></tr></thead><tbody>{"".join(rows)}</tbody>'
                       f'</table></div>')
    return "".join(out)


def robustness_html(curves: list[dict[str, Any]] | None, tuned: tuple[str, ...] = ("lr",),
                    sweeps: dict[str, tuple[str, Any]] | None = None, pending: str = "",
                    expected=None, notes: dict[tuple, str] | None = None, planned: Iterable[str] = (),
                    searched: Callable[[tuple], bool] | None = None,
                    partly: Callable[[tuple], bool] = lambda key: False) -> str:
    """The robustness section: per protocol and threat model, which defense to use at each (f,
    gamma) point (robustbn.worst.defense_map, each pick at its tuned values) as an HTML table,
    then the worst case along each sweep (x: the other field held), as figures. `pending`: what
    to say where there is no run yet; `expected`: defense_map's (how many defenses a cell is to
    have); `notes`: words after a pick's tuned values, by (norm, threat, gamma, f, defense)
    (whether its attack search is confirmed). Then which BN protocol at each point
    (robustbn.worst.protocol_map; `planned`: the protocols meant to run, those missing named;
    `searched(key)`: whether a pick's attack search is confirmed, key as `notes`', where given a
    verdict over unsearched picks reads provisional; `partly(key)`: confirmed, but not yet over
    the attacks confirmed at the defense's other points)."""
    from .plots import figure
    from .worst import defense_map, map_panels, pick_head, protocol_map

    e = html.escape
    if not curves:  # the sentence is markdown: its `commands` and paths as code, which may wrap anywhere
        text = re.sub(r"`([^`]+)`", r"<code>\1</code>", e(pending or "No robustness curve run yet."))
        return f"<p>{text}</p>"
    xs, ys, panels = map_panels(defense_map(curves, "gamma", "f", tuned, expected))
    chance = chance_of(curves[0])
    norms = sorted({r["norm"] for r in curves}, key=norm_order)
    out = [f"<p>The protocols {e(', '.join(norm_words(n) for n in norms))} along heterogeneity (gamma) and the "
           f"number of Byzantine clients (f). Each defense runs at each point at its own tuned "
           f"{e(', '.join(tuned))}, chosen before its reported runs, where the board above runs every defense at "
           f"one: at the board's point the two read differently.</p>"]
    for norm, data, here in panels:  # a row per point that ran (the sweeps are not a full grid): a phone's width
        model = ROOT_FREE if data is None else f"{TRUSTED} ({data})"
        rows = []
        for g in xs:
            for f in ys:
                if (c := here.get((f, g))) is None:
                    continue
                note = lambda p: (notes or {}).get((norm, data, g, f, p["defense"]), "")
                gap = lambda p: f"{pct(p['gap'])} [{pct(p['gap_low'])}, {pct(p['gap_high'])}] ({p['gap_pairs']} pairs)"
                tied = lambda p: f"tied, gap {gap(p)}: " if p.get("gap_low") is not None else ""
                picks = "".join(f"<div>{e(tied(p) if i else '')}{e(_map_pick(p, tuned, note(p)))}</div>"
                                for i, p in enumerate(c["picks"]))
                if nxt := c.get("runner_up"):  # the picks' margin over the closest other, paired over seeds
                    picks += f"<div>next, lower by {gap(nxt)}: {e(_map_pick(nxt, tuned, note(nxt)))}</div>"
                rows.append(f'<tr><td>{g:g}</td><td>{f}</td><td><b>{e(pick_head(c, chance))}</b></td>'
                            f'<td>{picks}</td></tr>')
        out.append(f'<div class="scroll"><table class="map"><caption>{e(norm_words(norm))}, {e(model)}: the '
                   f'defense to use at each point (paired over seeds), or every one tied for best, with its '
                   f'worst case (%, 95% interval over seeds) and tuned {e(", ".join(tuned))}; "next": the closest '
                   f'other defense below them, lower by its paired gap (none where the closest stands above a tied '
                   f'defense: told apart from the first on tighter seeds, it is not below the set); (grad): on the '
                   f'gradients, (BN): on the BN mean and variance</caption><thead><tr><th scope="col">gamma</th>'
                   f'<th scope="col">f</th><th scope="col">verdict</th><th scope="col">defense</th></tr></thead>'
                   f'<tbody>{"".join(rows)}</tbody></table></div>')
    key = lambda c, p: (p["norm"], c["threat"], c["gamma"], c["f"], p["defense"])
    planned = tuple(planned)
    out.append(protocols_html(protocol_map(curves, "gamma", "f", tuned, expected), chance, {False: planned, True: planned},
                              lambda c, p: "; " + ", ".join(f"{k} {p[k]}" for k in tuned) + (notes or {}).get(key(c, p), ""),
                              None if searched is None else lambda c, p: searched(key(c, p)),
                              lambda c, p: partly(key(c, p)), scope=f"each defense at its tuned {', '.join(tuned)}"))
    for x, (held, value) in (sweeps or {}).items():
        along = [r for r in curves if r.get(held) == value]
        if len({r.get(x) for r in along}) > 1:
            caption = f"Worst case along {x} at {held} = {value}, each defense at its tuned {', '.join(tuned)}"
            out.append(f'<figure><div class="scroll"><img class="zoom" alt="{e(caption)}" '
                       f'src="{png_uri(figure(along, "robustness", x=x, tuned=tuned))}"></div>'
                       f"<figcaption>{e(caption)}</figcaption></figure>")
            if x in ("gamma", "f") and len({r.get("norm") for r in along}) > 1:  # the protocols side by side
                caption = f"Which BN protocol along {x} at {held} = {value}: each at its highest defense"
                out.append(f'<figure><div class="scroll"><img class="zoom" alt="{e(caption)}" '
                           f'src="{png_uri(figure(along, "protocols", x=x, tuned=tuned, expected=expected))}"></div>'
                           f"<figcaption>{e(caption)}</figcaption></figure>")
    return "".join(out)


def render_html(board: Board, images: list[tuple[str, str]] = (), title: str = "robustbn leaderboard",
                robustness: str | None = None) -> str:
    """The page: the setup and threat model, the recommendations, the leaderboard (`<table
    id="leaderboard">`, sortable by its header buttons, each row opening to its runs), the
    heatmap, the absent protocols and the figures, all inline."""
    e = html.escape
    head = "".join(f'<th scope="col" aria-sort="none"><button type="button">{e(c)}</button></th>' for c in COLUMNS)
    bodies = []
    for r in board.rows:
        tds = []
        for col, words in enumerate(cells(r)):
            v = _sort_value(r, col)
            attrs = (f' data-v="{v}"' if v is not None else "") + (' class="num"' if v is not None else "")
            tds.append(f"<td{attrs}>{e(words)}</td>")
        runs = "".join(
            f"<tr><td>{e(str(run['seed']))}</td><td><code>{e(str(run['hash']))}</code></td>"
            f"<td>{e(run['code_version'] or 'not recorded')}</td><td>{e(str(run['status']))}</td><td>{e(run['attack'])}</td>"
            f"<td>{pct(run['final_acc'])}</td><td>{e(str(run['source'] or ''))}</td></tr>" for run in r["runs"])
        details = (f"<details><summary>{len(r['runs'])} runs</summary><table><tr><th>seed</th><th>hash</th>"
                   f"<th>code_version</th><th>status</th><th>attack</th><th>final accuracy (%)</th><th>file</th></tr>"
                   f"{runs}</table></details>")
        cls = "entry best" if r["verdict"] == BEST else "entry"
        bodies.append(f'<tbody><tr class="{cls}">{"".join(tds)}</tr>'
                      f'<tr class="runs"><td colspan="{len(COLUMNS)}">{details}</td></tr></tbody>')
    absent = "".join(f"<li><b>{e(norm_words(p))}</b> (<code>{e(p)}</code>): {e(reason)}</li>" for p, reason in board.absent)
    imgs = "".join(f'<figure><div class="scroll"><img class="zoom" alt="{e(c)}" src="{uri}"></div>'
                   f'<figcaption>{e(c)}</figcaption></figure>'
                   for c, uri in images)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{e(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{e(title)}</h1>"
            f"<p>Which defense to use with which BN protocol, and how bad it can get.</p>{setup_html(board)}"
            f"<h2>Which defense to use</h2>{recommendations_html(board)}"
            f"<h2>Which BN protocol</h2>{board_protocols_html(board)}"
            f"<h2>The leaderboard</h2><p>gamma = {board.gamma}. {e(NOTE)}</p>"
            f'<div class="scroll"><table id="leaderboard"><caption>One row per protocol and defense; rows by protocol, '
            f"then the highest worst case first. Sort by a column with its header button; open a row's runs below "
            f'it.</caption><thead><tr>{head}</tr></thead>{"".join(bodies)}</table></div>'
            f"<h2>Worst case per defense and protocol</h2>{heatmap_html(board)}"
            + (f"<h2>Across heterogeneity and f</h2>{robustness}" if robustness is not None else "") +
            f"<h2>Not on the leaderboard</h2><ul>{absent}</ul>{imgs}<script>{JS}</script></body></html>")


def write_page(rows: list[dict[str, Any]], out: str | Path, gamma: float = 0.0, robustness: str | None = None
               ) -> Path:
    """DIR/index.html for the rows (see `leaderboard`); returns its path. `robustness`: the
    section `robustness_html` makes, where there are curves to show."""
    board = leaderboard(rows, gamma)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    page = out / "index.html"
    page.write_text(render_html(board, figures(rows, board), robustness=robustness), encoding="utf-8")
    return page


def read_rows(store_rows: list[dict[str, Any]], matrices: list[str]) -> list[dict[str, Any]]:
    """The finished runs of the matrix files, each with its `source` file."""
    return [r for r in matrix_rows(matrices, store_rows) if r.get("status", "done") in ("done", "diverged")]

