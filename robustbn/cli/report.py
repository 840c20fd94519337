"""`robustbn report`: the leaderboard (robustbn.report) as one self-contained web page, as
JSON or as markdown."""

from __future__ import annotations

import math

from .common import DEFAULT_DB, RAW, WHERE_HELP, UsageError, fail_cleanly


def register(sub) -> None:
    p = sub.add_parser("report", help="the leaderboard: which defense for which BN protocol (web page, JSON)",
                       formatter_class=RAW,
                       description="One row per (BN protocol, defense) at one gamma: clean accuracy (every Byzantine "
                                   "channel honest, or f = 0), worst-case accuracy over the catalogue's attacks and "
                                   "the confirmed searched ones (lowest mean over seeds), its 95% CI (Student t over "
                                   "seeds), seeds, the worst attack (the messages it touched, catalogue or searched, "
                                   "and the file), the server data a defense uses (FLTrust's root set: another "
                                   "threat model, ranked apart), whether an attack search reached it, and the "
                                   "verdict within the protocol and threat model (best, tied for best, worse: paired "
                                   "over seeds). A diverged run counts at chance, 1 / classes. Above it, per protocol, "
                                   "a root-free pick and a trusted-data pick in the words of the verdict (\"use Y\" "
                                   "only where Y is best; a tie names every tied defense). --out DIR writes "
                                   "DIR/index.html, one page with its CSS, script and images inline (no network): "
                                   "the setup and threat model, the picks, the sortable table (header buttons), each "
                                   "row opening to its runs, the worst-case heatmap (a table, in %) and curves. "
                                   "The runs are every finished run of the store, each with the file it came from "
                                   "(an attack search's trials left out); --matrix FILE keeps the runs of those "
                                   "files (the board's: scenarios/worst_case_fmnist.toml, "
                                   "scenarios/clean_worst_case_fmnist.toml, scenarios/searched_worst_*.toml).",
                       epilog="examples:\n  robustbn report --db results/paper.sqlite --out site\n"
                              "  robustbn report --db results/paper.sqlite --format json\n"
                              "  robustbn report --db results/paper.sqlite --format markdown --gamma 1.0\n"
                              "  robustbn report --db my.sqlite --matrix my_matrix.toml --matrix "
                              "my_searched_worst.toml --out site")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--out", metavar="DIR", default=None, help="write DIR/index.html")
    p.add_argument("--format", choices=["json", "markdown"], default=None,
                   help="print the rows (json: keys norm, defense, clean_acc, worst_acc, ci_low, ci_high, seeds, "
                        "worst_attack, verdict, server_data, searched, attacks_run, diverged, then the clean "
                        "interval, the worst attack's file and the gap) or the leaderboard in markdown")
    p.add_argument("--matrix", metavar="FILE", action="append", default=[],
                   help="keep the runs of this scenario file, at any seed (repeatable; default: every run of "
                        "the store); an attack search's confirmation file (searched_worst_*.toml) holds searched "
                        "attacks")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help=WHERE_HELP + "; e.g. --where 'seed=[0,1,2,3,4]' keeps every attack of a cell on the same seeds")
    p.add_argument("--gamma", type=float, default=0.0, help="the heterogeneity of the leaderboard (default 0)")
    p.set_defaults(run=cmd_report)


@fail_cleanly
def cmd_report(args) -> int:
    import json

    from ..report import leaderboard, markdown, rows_json, write_page
    from ..store import FINISHED, Store, strict_json
    from .results import selected_rows

    if args.out is None and args.format is None:
        raise UsageError("nothing to do: give --out DIR (the web page) or --format json|markdown")
    if not math.isfinite(args.gamma):
        raise UsageError(f"--gamma {args.gamma}: a finite number, e.g. 0.0")
    with Store(args.db, readonly=True) as store:
        rows = selected_rows(store, args.where, FINISHED, args.matrix, unreported_out=True)
        if not args.matrix:  # the store alone: its runs, each from its own file (selected_rows: no trials)
            source = dict(store.db.execute("SELECT hash, source FROM runs"))
            rows = [{**r, "source": source.get(r["hash"]) or None} for r in rows]
    board = leaderboard(rows, args.gamma)
    if not board.rows:
        of = f" of {', '.join(args.matrix)}" if args.matrix else ""
        gammas = sorted({r["gamma"] for r in rows if r.get("f") and r.get("gamma") is not None})
        there = f" (it has gamma {', '.join(f'{g:g}' for g in gammas)}: --gamma G)" if gammas else ""
        raise UsageError(f"no finished attacked runs{of} at gamma = {args.gamma} in {args.db}{there}")
    if args.out is not None:
        print(write_page(rows, args.out, args.gamma))
    if args.format == "json":
        print(json.dumps(strict_json(rows_json(board)), indent=1, allow_nan=False))
    elif args.format == "markdown":
        print(markdown(board), end="")
    return 0
