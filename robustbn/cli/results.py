"""`robustbn results`: the results store as a table, CSV or JSON, a run per row; or one of its
views: --worst-case (robustbn.worst), --pooled and --compare (robustbn.stats)."""

from __future__ import annotations

from .common import (DEFAULT_DB, RAW, WHERE_HELP, UsageError, channel_columns, check_tuned, fail_cleanly,
                     matching_rows, parse_where, text_table)

MATRICES_HELP = ("keep only the runs of this scenario or matrix file, at any seed, on any device and by either "
                 "engine (an attack search's trials and a tuning's runs that share its settings left out, unless "
                 "their own file is a --matrix too); repeatable, and a quoted pattern ('tuned/tuned_*.toml') names "
                 "every file it matches: the runs of any of the files, each with the file it came from. The runs "
                 "of an attack search's confirmation file (searched_worst_*.toml) are searched attacks: "
                 "--worst-case takes the lower of the catalogue's worst and theirs, and says which file it came from")


def add_matrix_option(p) -> None:
    p.add_argument("--matrix", metavar="FILE", action="append", default=[], help=MATRICES_HELP)


def selected_rows(store, where: list[str], status=None, matrices: list[str] = (), unreported_out: bool | None = None,
                  note: bool = False) -> list[dict]:
    """The store's runs that every `--where` keeps; with `--matrix FILE ...` only the runs of
    those files, each with `source`, its file (robustbn.worst.matrix_rows). `unreported_out`
    (default: with --matrix): an attack search's trials and a tuning's runs
    (robustbn.report.unreported) left out, unless their own file is a --matrix (a confirmation
    file's settings are its search's, and a tuned file's its tuning's, on other seeds). `note`
    (the views: worst cases, comparisons, plots): without --matrix, a tuning's runs left out
    (a pruned point's worst case is a bound, not a result; `--matrix` its tuning file reads
    them), a search's trials kept (each a whole run), and either said on stderr."""
    import glob
    import sys
    from pathlib import Path

    from ..matrix import MatrixError
    from ..report import unreported
    from ..tune import is_tuning_file
    from ..worst import matrix_rows

    # a quoted pattern (--matrix 'tuned/tuned_*.toml') names every file it matches
    matrices = [p for m in matrices for p in ((sorted(glob.glob(m)) or [m]) if glob.has_magic(m) else [m])]
    if unreported_out is None:
        unreported_out = bool(matrices)
    asked = {Path(m).resolve() for m in matrices}
    sources = {s for (s,) in store.db.execute("SELECT DISTINCT source FROM runs") if s}
    theirs = {s for s in sources if Path(s).resolve() not in asked and unreported(s)}
    recorded = dict(store.db.execute("SELECT hash, source FROM runs")) if theirs else {}
    rows = matching_rows(store, where, status)
    if unreported_out:
        rows = [r for r in rows if recorded.get(r["hash"]) not in theirs]
    elif note:
        tunings = {s for s in theirs if is_tuning_file(s)}
        kept = [r for r in rows if recorded.get(r["hash"]) not in tunings]
        if len(kept) < len(rows):
            print(f"note: {len(rows) - len(kept)} runs of a tuning left out (seeds no report uses; a pruned point's "
                  f"worst case is a bound): --matrix its tune_*.toml reads them", file=sys.stderr)
        if n := sum(recorded.get(r["hash"]) in theirs for r in kept):
            print(f"note: {n} of these {len(kept)} runs are an attack search's trials (seeds no report uses); "
                  f"--matrix FILE keeps the runs of your files only", file=sys.stderr)
        rows = kept
    try:
        return matrix_rows(matrices, rows) if matrices else rows
    except MatrixError as e:
        raise UsageError(f"--matrix {e}") from None


def register(sub) -> None:
    p = sub.add_parser("results", help="show or export the results store", formatter_class=RAW,
                       description="A row per run (table, csv or json). --worst-case: a row per setting (every "
                                   "field but the attack and the seed: norm mode, defense, f, gamma, ...) with its "
                                   "worst final accuracy over the attacks run against it, seeds pooled first (mean "
                                   "over seeds), the attack that achieved it and the accuracy without attack. "
                                   "f > 0 runs whose every channel is none or honest are the no-attack baseline, "
                                   "not attacks; diverged runs (NaN accuracy) count at chance, 1 / classes. "
                                   "--pooled: a row per group of runs differing only in seed, with the mean over "
                                   "seeds and its 95% "
                                   "confidence interval (Student t). --compare: paired differences between two "
                                   "values of one field, seed by seed.",
                       epilog="examples:\n  robustbn results\n  robustbn results --where norm=fbn --where f=3\n"
                              "  robustbn results --format json > results.json\n"
                              "  robustbn results --worst-case --where gamma=0.0\n"
                              "  robustbn results --worst-case --matrix scenarios/worst_case_fmnist.toml\n"
                              "  robustbn results --worst-case --matrix scenarios/worst_case_fmnist.toml "
                              "--matrix scenarios/searched_worst_fbn_dnc.toml\n"
                              "  robustbn results --worst-case --format csv > worst.csv\n"
                              "  robustbn results --worst-case --by-protocol --tuned lr\n"
                              "  robustbn results --pooled --where gamma=0.0\n"
                              "  robustbn results --compare bn_agg=mean bn_agg=nnm+median --where norm=fbn")
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help=WHERE_HELP)
    add_matrix_option(p)
    p.add_argument("--status", choices=["done", "diverged", "running", "failed", "pruned"], action="append",
                   default=None, help="only runs of this status, repeatable (running runs show their rounds_done and "
                                      "history so far)")
    p.add_argument("--worst-case", action="store_true",
                   help="per setting, the worst accuracy over attacks (seeds pooled, 95%% CI), the attack achieving "
                        "it, and a verdict per norm protocol: best, tied for best (paired over seeds), worse")
    p.add_argument("--by-protocol", action="store_true",
                   help="with --worst-case: which BN protocol at each (gamma, f) point and threat model, each "
                        "protocol at its highest defense there, the protocols compared by the same paired rule")
    p.add_argument("--tuned", action="append", default=[], metavar="FIELD",
                   help="with --worst-case: a field each defense ran at its own tuned value of (robustbn tune; e.g. "
                        "--tuned lr): defenses at different values are compared with each other")
    p.add_argument("--pooled", action="store_true",
                   help="a row per group of runs that differ only in seed: seeds, mean final accuracy, its 95%% CI "
                        "(Student t over seeds, clipped to [0, 1]; none for 1 seed), diverged runs")
    p.add_argument("--compare", nargs=2, metavar=("FIELD=A", "FIELD=B"),
                   help="pair runs that differ only in FIELD (same seed, every other field equal): per setting, the "
                        "mean paired difference B - A of the final accuracy, its 95%% CI and the number of pairs")
    p.set_defaults(run=cmd_results)


@fail_cleanly
def cmd_results(args) -> int:
    from ..labels import varying
    from ..store import FINISHED, RECORDED_FROM, RESULT_COLUMNS, Store, export

    views = [flag for flag, on in (("--worst-case", args.worst_case), ("--pooled", args.pooled),
                                   ("--compare", args.compare)) if on]
    if len(views) > 1:
        raise UsageError(f"{' and '.join(views)}: one view at a time; give one of them")
    if views and not set(args.status or ()) <= {"done", "diverged"}:
        raise UsageError(f"{views[0]} reads finished runs only (leave out --status)")
    check_tuned(args.tuned, args.worst_case, "--worst-case")
    if args.by_protocol and not args.worst_case:
        raise UsageError("--by-protocol is for --worst-case: robustbn results --worst-case --by-protocol")
    compared = _compared(args.compare) if args.compare else None
    with Store(args.db, readonly=True) as store:
        rows = selected_rows(store, args.where, FINISHED if views else args.status, args.matrix, note=bool(views))
        recorded = dict(store.db.execute("SELECT hash, source FROM runs")) if args.format != "table" else {}
    if args.worst_case:
        if args.by_protocol:
            return _print_by_protocol(rows, args.format, args.tuned)
        return _print_worst_case(rows, args.format, args.tuned)
    rows = [{k: v for k, v in r.items() if k != "source"} for r in rows]  # the file: a worst case's column only
    if args.pooled:
        return _print_pooled(rows, args.format)
    if compared:
        return _print_compare(rows, *compared, args.format)
    if args.format == "table":
        shown = channel_columns(rows, (varying(rows) if len(rows) > 1 else ["norm"]) + ["seed", *RESULT_COLUMNS])
        print(text_table(rows, shown))
        print(f"{len(rows)} runs")
    else:
        # every scenario field of any row (runs made before a field existed lack it)
        scenario_keys = sorted({k for r in rows for k in r} - set(RESULT_COLUMNS) - {"history", "error"})
        rows = [{**r, RECORDED_FROM: recorded.get(r["hash"]) or None} for r in rows]  # `import` keeps it
        print(export(rows, args.format, scenario_keys + list(RESULT_COLUMNS) + [RECORDED_FROM, "history"]), end="")
    return 0


def _intervals(rows: list[dict], columns: list[str], spans: dict[str, tuple[str, str, str]]) -> tuple[list, list]:
    """Rows and columns for a printed table where each (low, high) column pair becomes one text
    column: spans maps low to (high, the new column's name, the column counting seeds or pairs)."""
    from ..stats import ci_text

    shown, out = [], [dict(r) for r in rows]
    for c in columns:
        if c in spans:
            high, name, count = spans[c]
            unit = "pair" if count.endswith("pairs") else "seed"
            for r, o in zip(rows, out):
                o[name] = ci_text(r.get(c), r.get(high), r.get(count), unit=unit)
            shown.append(name)
        elif c not in {h for h, _, _ in spans.values()}:
            shown.append(c)
    return out, shown


def _compared(pairs: list[str]) -> tuple[str, object, object]:
    """`--compare FIELD=A FIELD=B` as (field, A, B): one scenario field, two different values."""
    from ..store import _same

    (field, a), (other, b) = parse_where(pairs, "--compare")  # argparse gave two
    if field != other:
        raise UsageError(f"--compare {' '.join(pairs)}: two values of one field, not {field} and {other}")
    if field == "seed":
        raise UsageError("--compare seed: runs are paired by seed; compare another scenario field")
    if len(a) != 1 or len(b) != 1:
        raise UsageError(f"--compare {' '.join(pairs)}: one value on each side, not a list")
    if _same(a[0], b[0]):
        raise UsageError(f"--compare {' '.join(pairs)}: the same value twice; give two different values of {field}")
    return field, a[0], b[0]


def _print_compare(rows: list[dict], field: str, a, b, fmt: str) -> int:
    """`results --compare`: paired differences B - A per setting (robustbn.stats.compare)."""
    import json

    from ..labels import text, varying
    from ..stats import COMPARED, PAIRED_WORDS, compare
    from ..store import _same, export, strict_json

    present = sorted({text(r.get(field)) for r in rows})
    for side in (a, b):
        if not any(_same(r.get(field), side) for r in rows):
            raise UsageError(f"--compare {field}={text(side)}: no finished run matches; {field} takes "
                             f"{', '.join(present) or 'no value'} in the runs (after --where)")
    table, counts = compare(rows, field, a, b, _same)
    head = {"field": field, "a": a, "b": b}
    if fmt == "json":
        print(json.dumps(strict_json([{**head, **t} for t in table]), indent=1, allow_nan=False))
        return 0
    if fmt == "csv":
        fields = [k for k in dict.fromkeys(k for t in table for k in t) if k not in COMPARED]
        print(export([{**head, **t} for t in table], "csv", ["field", "a", "b", *fields, *COMPARED]), end="")
        return 0
    print(f"paired by seed: B - A, A = {field}={text(a)} ({counts['a']} runs), B = {field}={text(b)} "
          f"({counts['b']} runs); {PAIRED_WORDS}")
    if not table:
        print("no pairs: no run of A has a run of B with the same seed and every other field equal")
    else:
        columns = [*channel_columns(table, varying(table, set(COMPARED))), *COMPARED]
        shown, columns = _intervals(table, columns, {"ci_low": ("ci_high", "95% CI", "pairs")})
        print(text_table(shown, columns))
        print(f"{len(table)} settings, {sum(t['pairs'] for t in table)} pairs; a_acc, b_acc: mean final accuracy "
              "over the paired seeds (diverged runs count at chance, 1 / classes); verdict: B or A higher where the interval excludes 0, "
              "else tied; one pair has no interval and no verdict")
    if counts["unpaired"]:
        print(f"{counts['unpaired']} run{'s' * (counts['unpaired'] != 1)} had no partner (left out)")
    return 0


def _print_pooled(rows: list[dict], fmt: str) -> int:
    """`results --pooled`: a row per group of runs differing only in seed (robustbn.stats.pooled)."""
    from ..labels import varying
    from ..stats import CLIPPED_WORDS, POOLED, pooled
    from ..store import export

    cells = pooled(rows)
    if fmt != "table":
        keys = sorted({k for c in cells for k in c} - set(POOLED))
        print(export(cells, fmt, keys + list(POOLED)), end="")
        return 0
    columns = channel_columns(cells, varying(cells, set(POOLED)) if len(cells) > 1 else ["norm"])
    shown, columns = _intervals(cells, columns + ["seeds", "mean_acc", "ci_low", "ci_high", "diverged"],
                                {"ci_low": ("ci_high", "95% CI", "seeds")})
    print(text_table(shown, columns))
    print(f"{len(cells)} cells from {len(rows)} finished runs; mean_acc: mean final accuracy over seeds "
          f"(diverged runs count at chance, 1 / classes); {CLIPPED_WORDS}")
    return 0


def _print_by_protocol(rows: list[dict], fmt: str, tuned: list[str] = ()) -> int:
    """`results --worst-case --by-protocol`: a row per protocol at each (gamma, f) point and
    threat model (robustbn.worst.protocol_map), the point's verdict on its first row."""
    import json

    from ..stats import chance
    from ..store import export, strict_json
    from ..worst import BEST, TIED, protocol_head, protocol_map

    x = "gamma" if any(r.get("gamma") is not None for r in rows) else "alpha"
    try:
        cells = protocol_map(rows, x, "f", tuned) if rows else []
    except ValueError as e:
        raise UsageError(str(e)) from None
    # point: the cell's verdict in words, on its first row; verdict: each protocol's, as --worst-case gives a
    # defense's (none where the cell has too few pairs for one)
    columns = ["server_data", x, "f", "point", "norm", "defense", *tuned, "worst_acc", "ci_low", "ci_high",
               "seeds", "verdict", "gap", "gap_low", "gap_high", "gap_pairs", "worst_attack"]
    table = [{"server_data": c["threat"], x: c[x], "f": c["f"], "point": protocol_head(c, chance(rows[0])) if i == 0
              else "", **{k: p.get(k) for k in columns if k in p and k != "verdict"},
              "verdict": p["verdict"] if c["verdict"] in (BEST, TIED) else None}
             for c in cells for i, p in enumerate(c["protocols"])]
    if fmt != "table":
        table = [{k: t.get(k) for k in columns} for t in table]
        print(json.dumps(strict_json(table), indent=1, allow_nan=False) if fmt == "json"
              else export(table, "csv", columns), end="\n" if fmt == "json" else "")
    elif not table:
        print("no attacked run has both gamma (or alpha) and f: no protocol to compare (see robustbn results "
              "--worst-case)")
    else:
        shown, names = _intervals(table, [c for c in columns if c != "server_data" or any(t[c] for t in table)],
                                  {"ci_low": ("ci_high", "95% CI", "seeds"),
                                   "gap_low": ("gap_high", "gap 95% CI", "gap_pairs")})
        print(text_table(shown, names))
        print("point: per threat model (server_data: the trusted data its defense uses; blank: root-free) and "
              "point, each protocol at its highest defense there, compared with the highest by the paired rule "
              "over seeds (verdict, gap: highest - it); the defense is chosen on the seeds it is compared on")
    return 0


def _print_worst_case(rows: list[dict], fmt: str, tuned: list[str] = ()) -> int:
    """`results --worst-case`: a row per setting, its worst accuracy over attacks (robustbn.worst)."""
    import json

    from ..stats import CLIPPED_WORDS, MIN_PAIRS
    from ..store import export, strict_json
    from ..worst import shown_columns, worst_case

    table = worst_case(rows, tuned)
    if fmt == "json":
        print(json.dumps(strict_json(table), indent=1, allow_nan=False))
    elif fmt == "csv":
        print(export(table, "csv", list(dict.fromkeys(k for t in table for k in t)) or shown_columns([])), end="")
    elif not table:
        print("no finished runs match: no worst case to report (see `robustbn results`)")
    else:
        shown, columns = _intervals(table, shown_columns(table, tuned), {"ci_low": ("ci_high", "95% CI", "seeds"),
                                                                  "gap_low": ("gap_high", "gap 95% CI", "gap_pairs")})
        print(text_table(shown, columns))
        notes = [f"{len(table)} settings from {len(rows)} finished runs; worst_acc: the lowest mean over seeds "
                 f"among the attacks run, with its {CLIPPED_WORDS} of that attack",
                 "verdict: per norm protocol and threat model (server_data: the trusted data a rule uses; blank: "
                 "root-free) and value of f, gamma, ..., the defense with the highest worst_acc is best only where "
                 "every other's gap (best - it, paired over seeds under each one's worst attack) has an interval "
                 "excluding 0, else tied for best"]
        if any(t["diverged"] for t in table):
            notes.append("diverged: runs whose final accuracy is NaN or missing, counted at chance, 1 / classes")
        if any(t.get("worst_source") for t in table):
            notes.append("worst_kind, worst_source: whether the worst attack is the catalogue's, a searched one "
                         "(its runs from an attack search's confirmation file, searched_worst_*.toml) or a user's "
                         "own class (module:Name), and the file")
        if any(t["worst_acc"] is None for t in table):
            notes.append("no worst_acc: f > 0 but no attack was run in that setting")
        if any(t.get("gap_pairs") is not None and t["gap_pairs"] < MIN_PAIRS for t in table):
            notes.append(f"a verdict on fewer than {MIN_PAIRS} paired seeds stands on a wide interval: "
                         f"docs/results.md and robustbn report give none there")
        print("\n".join(notes))
    return 0
