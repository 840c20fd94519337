"""`robustbn import FILE.csv...`: rebuild a results store from CSV exports (the module's
name has an underscore: `import` is a Python keyword)."""

from __future__ import annotations

from .common import DEFAULT_DB, RAW, fail_cleanly, report_added


def register(sub) -> None:
    p = sub.add_parser("import", help="rebuild a results store from CSV exports (robustbn results --format csv)",
                       formatter_class=RAW,
                       description="Add the runs of each FILE, a CSV written by `robustbn results --format csv`, to "
                                   "--db. Every cell is read back to its scenario field's type and each row's scenario "
                                   "must hash to the row's hash column. Runs already in --db are deduplicated as by "
                                   "merge (a finished run replaces an unfinished one; otherwise the store's row stays). "
                                   "All files are checked first and added in one transaction: on any error nothing is "
                                   "written. Imported runs have no final BN statistics.",
                       epilog="examples:\n  robustbn import docs/results.csv --db results/paper.sqlite\n"
                              "  robustbn import a.csv b.csv --db results/all.sqlite\n"
                              "  robustbn results --db results/robustbn.sqlite --format csv > backup.csv  # and back:\n"
                              "  robustbn import backup.csv --db results/restored.sqlite")
    p.add_argument("files", nargs="+", metavar="FILE.csv", help="CSV written by `robustbn results --format csv`")
    p.add_argument("--db", default=DEFAULT_DB, help=f"the store imported into, created if absent (default {DEFAULT_DB})")
    p.set_defaults(run=cmd_import)


@fail_cleanly
def cmd_import(args) -> int:
    from ..store import Store, read_export

    batches = [read_export(path) for path in args.files]  # every file read and checked before the store is touched
    store = Store(args.db)
    try:
        report_added(args.db, store, list(zip(args.files, store.add(batches))))
    finally:
        store.close()
    return 0
