"""`robustbn merge STORE...`: copy results stores into one, deduplicated by run hash."""

from __future__ import annotations

import os

from .common import DEFAULT_DB, RAW, UsageError, fail_cleanly, report_added


def register(sub) -> None:
    p = sub.add_parser("merge", help="merge results stores into one, deduplicating by run hash", formatter_class=RAW,
                       description="Copy every run of each STORE into --db. A run already there is kept, unless it "
                                   "is unfinished and the incoming one is done. The merged stores are only read.",
                       epilog="examples:\n  robustbn merge --db results/all.sqlite results/shard*.sqlite")
    p.add_argument("stores", nargs="+", metavar="STORE")
    p.add_argument("--db", default=DEFAULT_DB, help=f"the store merged into, created if absent (default {DEFAULT_DB})")
    p.set_defaults(run=cmd_merge)


@fail_cleanly
def cmd_merge(args) -> int:
    from ..store import Store

    if os.path.realpath(args.db) in {os.path.realpath(p) for p in args.stores}:  # no error on a symlink loop
        raise UsageError(f"--db {args.db} is also a store to merge; give a different target")
    store = Store(args.db)
    try:
        report_added(args.db, store, [(path, store.merge(path)) for path in args.stores])
    finally:
        store.close()
    return 0
