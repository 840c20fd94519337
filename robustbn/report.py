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
- the verdict within the protocol (robustbn.worst: best, tied for best, or worse, paired
  over seeds under each defense's worst attack), or "n seeds, no verdict" where fewer than
  robustbn.stats.MIN_PAIRS seeds were paired.

Under it, one line per protocol: "with X, use Y (worst known Z% [a, b]); tied: ...", where Y
is the best defense (highest pooled worst case) and "tied" lists every defense the paired
comparison cannot tell from it. `render_html` writes it as one self-contained page (CSS, JS
and images inline; no network), `rows_json` as the JSON of `robustbn report --format json`.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .labels import attack_short, attack_words, hashable, is_attack, norm_order, norm_words
from .stats import CLIPPED_PERCENT_WORDS, MIN_PAIRS, PAIRED_WORDS, too_few
from .worst import BEST, SEARCHED, TIED, matrix_rows, setting_groups, worst_case

CATALOGUE_MATRIX = "scenarios/worst_case_fmnist.toml"
CLEAN_MATRIX = "scenarios/clean_worst_case_fmnist.toml"
SEARCHED_GLOB = "searched_worst_*.toml"
COLUMNS = ("protocol", "defense", "clean accuracy", "worst-case accuracy", "95% CI", "seeds", "worst attack",
           "verdict")
KEYS = ("norm", "defense", "clean_acc", "worst_acc", "ci_low", "ci_high", "seeds", "worst_attack", "verdict")
EXTRA_KEYS = ("clean_low", "clean_high", "clean_seeds", "clean_kind", "worst_kind", "worst_source", "attacks",
              "gap", "gap_low", "gap_high", "gap_pairs")
# protocols a practitioner may ask about that the worst-case matrix leaves out, and why
ABSENT = {
    "fedbn": "BN layers stay local: each client's model is evaluated on its own test split (a personalized "
             "accuracy, not comparable with a global model's); not in the worst-case matrix",
    "silobn": "BN statistics stay local (personalized evaluation, as FedBN); not in the worst-case matrix",
    "fedwon": "no BN statistics to attack or defend (weight standardization); not in the worst-case matrix",
    "fbn-scale": "not in the worst-case matrix (run only undefended, docs/results.md's scale-only FBN table)",
}


def default_matrices(root: str | Path = ".") -> list[str]:
    """The catalogue's matrix, the clean runs and every confirmation file of an attack search
    (`scenarios/searched_worst_*.toml`), those of them that exist under `root`."""
    root = Path(root)
    files = [CATALOGUE_MATRIX, CLEAN_MATRIX,
             *sorted(str(p.relative_to(root)) for p in (root / "scenarios").glob(SEARCHED_GLOB))]
    return [f for f in files if (root / f).is_file()]


@dataclass
class Board:
    """The leaderboard: `rows` (dicts with KEYS, EXTRA_KEYS and `runs`), one recommendation
    line per protocol, and the protocols left out with the reason."""

    rows: list[dict[str, Any]]
    lines: list[str] = field(default_factory=list)
    absent: list[tuple[str, str]] = field(default_factory=list)
    gamma: float = 0.0


def _same_but_f(t: dict[str, Any], keys: list[str]) -> tuple:
    return tuple(hashable(t.get(k)) for k in keys if k not in ("f", "agg_f"))


def leaderboard(rows: list[dict[str, Any]], gamma: float = 0.0) -> Board:
    """The leaderboard of `rows` (as `Store.rows()`, with `source` where read through
    `matrix_rows`) at `gamma`: see the module's docstring."""
    rows = [r for r in rows if r.get("gamma") is not None and math.isclose(float(r["gamma"]), gamma)]
    table = worst_case(rows)
    keys, groups = setting_groups(rows)
    clean_f0 = {_same_but_f(t, keys): t for t in table if not t.get("f")}
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
        out.append({"norm": t["norm"], "defense": t["defense"], "clean_acc": clean[0], "worst_acc": t["worst_acc"],
                    "ci_low": t["ci_low"], "ci_high": t["ci_high"], "seeds": t["seeds"],
                    "worst_attack": t["worst_attack"], "verdict": t["verdict"],
                    "clean_low": clean[1], "clean_high": clean[2], "clean_seeds": clean[3], "clean_kind": kind,
                    **{k: t[k] for k in ("worst_kind", "worst_source", "attacks", "gap", "gap_low", "gap_high",
                                         "gap_pairs")},
                    "runs": [{"seed": r.get("seed"), "hash": r.get("hash"), "code_version": r.get("code_version"),
                              "status": r.get("status"), "attack": attack_short(r), "final_acc": r.get("final_acc"),
                              "source": r.get("source"),
                              "worst": is_attack(r) and attack_words(r) == t["worst_attack"]} for r in runs]})
    for r in out:  # a verdict on fewer than MIN_PAIRS paired seeds is none (the best's: its fewest pairs)
        pairs = r["gap_pairs"] if r["gap_pairs"] is not None else min(
            (o["gap_pairs"] for o in out if o["norm"] == r["norm"] and o["gap_pairs"] is not None), default=None)
        if r["verdict"] is not None and too_few(pairs):
            r["verdict"] = too_few(pairs)
    norms = sorted({r["norm"] for r in out}, key=norm_order)
    board = Board(out, [recommendation(norm, [r for r in out if r["norm"] == norm]) for norm in norms],
                  [(p, reason) for p, reason in ABSENT.items() if p not in norms], gamma)
    return board


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def ci(low: float | None, high: float | None, n: int | None) -> str:
    """"[a, b]" in percent, "1 seed, no interval", "" for no values."""
    if not n:
        return ""
    if low is None or high is None:
        return f"{n} seed{'s' * (n != 1)}, no interval"
    return f"[{pct(low)}, {pct(high)}]"


def recommendation(norm: str, rows: list[dict[str, Any]]) -> str:
    """"with X, use Y (worst known Z% [a, b]); tied: ..." for one protocol's rows."""
    ranked = [r for r in rows if r["worst_acc"] is not None]
    if not ranked:
        return f"with {norm_words(norm)}: no worst case known (no attack run)"
    best = max(ranked, key=lambda r: r["worst_acc"])
    tied = [r["defense"] for r in ranked if r is not best and r["verdict"] == TIED]
    seeds = f", {best['seeds']} seeds" if best["seeds"] else ""
    known = f"{pct(best['worst_acc'])}% {ci(best['ci_low'], best['ci_high'], best['seeds'])}{seeds}"
    if best["verdict"] not in (BEST, TIED) and len(ranked) > 1:  # too few paired seeds for a verdict
        return f"with {norm_words(norm)}, the highest worst case is {best['defense']} ({known}); {best['verdict']}"
    line = f"with {norm_words(norm)}, use {best['defense']} (worst known {known}); tied: {', '.join(tied) or 'none'}"
    return line if len(ranked) > 1 else line.replace("; tied: none", "; the only defense run")


def clean_text(r: dict[str, Any]) -> str:
    """The clean accuracy cell: "74.9 [72.0, 77.8] (5 seeds)", "not run"."""
    if r["clean_acc"] is None:
        return "not run"
    n = r["clean_seeds"]
    interval_ = f" {ci(r['clean_low'], r['clean_high'], n)}" if r["clean_low"] is not None else ""
    kind = ", f = 0" if r["clean_kind"] == "f = 0" else ""
    return f"{pct(r['clean_acc'])}{interval_} ({n} seed{'s' * (n != 1)}{kind})"


def attack_text(r: dict[str, Any]) -> str:
    """The worst attack in words, where it came from, and of how many attacks run."""
    if r["worst_attack"] is None:
        return "no attack run"
    where = (f"searched: {r['worst_source']}" if r["worst_kind"] == SEARCHED
             else "catalogue" if r["worst_kind"] else "")
    return f"{r['worst_attack']} ({where + '; ' if where else ''}worst of {r['attacks']} attacks run)"


def cells(r: dict[str, Any]) -> list[str]:
    """A row's eight cells as text, in `COLUMNS` order."""
    return [norm_words(r["norm"]), r["defense"], clean_text(r), pct(r["worst_acc"]),
            ci(r["ci_low"], r["ci_high"], r["seeds"]), str(r["seeds"] or 0), attack_text(r), r["verdict"] or "-"]


def rows_json(board: Board) -> list[dict[str, Any]]:
    """The rows of `robustbn report --format json`: KEYS, then EXTRA_KEYS."""
    return [{k: r[k] for k in (*KEYS, *EXTRA_KEYS)} for r in board.rows]


PAIRED = PAIRED_WORDS.replace("95% CI: ", "the 95% interval, ")
NOTE = (f"Final test accuracy (%). Worst-case accuracy: the lowest mean over seeds among the catalogue's attacks "
        f"and the confirmed searched ones; {CLIPPED_PERCENT_WORDS}. Clean accuracy: the same setting with every "
        f"Byzantine channel honest (or f = 0 where marked). Verdict within the protocol: best only where every "
        f"other defense is worse paired over seeds under its own worst attack ({PAIRED}, excludes 0), "
        f"else tied for best; no verdict on fewer than {MIN_PAIRS} paired seeds.")


def markdown(board: Board) -> str:
    """The leaderboard as a markdown table, the recommendation lines and the absent protocols."""
    out = [f"| {' | '.join(COLUMNS)} |", "|" + "---|" * len(COLUMNS)]
    for r in board.rows:
        text = cells(r)
        if r["verdict"] == BEST:
            text = [f"**{c}**" for c in text]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in text) + " |")
    out += ["", f"gamma = {board.gamma}. {NOTE}", ""]
    out += [f"- {line}" for line in board.lines]
    out += ["", "Not on the leaderboard (no runs at this setting):", ""]
    out += [f"- {norm_words(p)} (`{p}`): {reason}" for p, reason in board.absent]
    return "\n".join(out) + "\n"


# ---- the page ----------------------------------------------------------------------------------

CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:80em;color:#222}
table{border-collapse:collapse;width:100%}th,td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;
vertical-align:top}th{background:#f4f4f4}#leaderboard>thead th{cursor:pointer;user-select:none}
#leaderboard>thead th:after{content:" \\2195";color:#aaa}
tr.entry{cursor:pointer}tr.entry:hover{background:#f7f7ff}tr.best{font-weight:bold}td.num{text-align:right}
tr.runs td{padding:0 8px;border:0}details table{width:auto;font-size:12px;margin:0 0 8px 2em}
img{max-width:100%}code{font-size:13px}"""

JS = """document.querySelectorAll('#leaderboard th').forEach(function(th, col){
  th.addEventListener('click', function(){
    var table = document.getElementById('leaderboard');
    var up = th.dataset.dir !== 'asc';
    table.querySelectorAll('th').forEach(function(h){ delete h.dataset.dir; });
    th.dataset.dir = up ? 'asc' : 'desc';
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
document.querySelectorAll('#leaderboard tr.entry').forEach(function(tr){
  tr.addEventListener('click', function(){ var d = tr.parentNode.querySelector('details'); d.open = !d.open; });
});"""


def png_uri(fig) -> str:
    """A matplotlib figure as a data: URI (and closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _sort_value(r: dict[str, Any], col: int) -> str | None:
    """The number a numeric column sorts by (missing values last when ascending)."""
    value = {2: r["clean_acc"], 3: r["worst_acc"], 4: r["ci_low"], 5: r["seeds"]}.get(col, "text")
    if value == "text":
        return None
    return f"{value:.6g}" if value is not None else "1e9"


def figures(rows: list[dict[str, Any]], board: Board) -> list[tuple[str, str]]:
    """(caption, data URI): the worst-case heatmap of the board's runs, and the curves of each
    protocol's recommended defense under its worst attack."""
    from .plots import figure

    attacked = [r for r in rows if r.get("f") and math.isclose(float(r.get("gamma", -1)), board.gamma)]
    out = []
    if attacked:
        out.append(("Worst case over the catalogue's and the searched attacks",
                    png_uri(figure(attacked, "worst-case", title=f"f = 3 of 10, gamma = {board.gamma}"))))
    picked = []
    for norm in dict.fromkeys(r["norm"] for r in board.rows):
        ranked = [r for r in board.rows if r["norm"] == norm and r["worst_acc"] is not None]
        if ranked:
            best = max(ranked, key=lambda r: r["worst_acc"])
            worst_hashes = {run["hash"] for run in best["runs"] if run["worst"]}
            picked += [r for r in rows if r.get("hash") in worst_hashes and r.get("history")]
    if picked:
        out.append(("Each protocol's recommended defense under its worst attack: accuracy over rounds "
                    "(mean over seeds, 95% CI band)", png_uri(figure(picked, "curves"))))
    return out


def render_html(board: Board, images: list[tuple[str, str]] = (), title: str = "robustbn leaderboard") -> str:
    """The page: the leaderboard (`<table id="leaderboard">`, sortable, each row opening to its
    runs), the recommendation lines, the absent protocols and the figures, all inline."""
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in COLUMNS)
    bodies = []
    for r in board.rows:
        tds = []
        for col, text in enumerate(cells(r)):
            v = _sort_value(r, col)
            attrs = (f' data-v="{v}"' if v is not None else "") + (' class="num"' if v is not None else "")
            tds.append(f"<td{attrs}>{e(text)}</td>")
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
    lines = "".join(f"<li>{e(line)}</li>" for line in board.lines)
    absent = "".join(f"<li><b>{e(norm_words(p))}</b> (<code>{e(p)}</code>): {e(reason)}</li>" for p, reason in board.absent)
    imgs = "".join(f'<figure><img alt="{e(c)}" src="{uri}"><figcaption>{e(c)}</figcaption></figure>'
                   for c, uri in images)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{e(title)}</h1>"
            f"<p>Which defense to use with which BN protocol, and how bad it can get. gamma = {board.gamma}. "
            f"{e(NOTE)} Click a header to sort, a row to see its runs.</p>"
            f'<table id="leaderboard"><thead><tr>{head}</tr></thead>{"".join(bodies)}</table>'
            f"<h2>Recommendation per protocol</h2><ul>{lines}</ul>"
            f"<h2>Not on the leaderboard</h2><ul>{absent}</ul>{imgs}<script>{JS}</script></body></html>")


def write_page(rows: list[dict[str, Any]], out: str | Path, gamma: float = 0.0) -> Path:
    """DIR/index.html for the rows (see `leaderboard`); returns its path."""
    board = leaderboard(rows, gamma)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    page = out / "index.html"
    page.write_text(render_html(board, figures(rows, board)), encoding="utf-8")
    return page


def read_rows(store_rows: list[dict[str, Any]], matrices: list[str]) -> list[dict[str, Any]]:
    """The finished runs of the matrix files, each with its `source` file."""
    return [r for r in matrix_rows(matrices, store_rows) if r.get("status", "done") in ("done", "diverged")]

