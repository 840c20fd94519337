"""`robustbn evaluate SPEC`: a user's defense on the board by the board's own procedure
(robustbn.evaluate), its row printed beside the published rows with a paired verdict."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

from .common import RAW, UsageError, fail_cleanly, text_table

DEFAULT_DB = "results/evaluate.sqlite"


def register(sub) -> None:
    p = sub.add_parser("evaluate", help="put your defense on the board: the board's attacks, a search, a paired verdict",
                       formatter_class=RAW,
                       description="SPEC is a defense: a pipeline spec as in a scenario file (median, nnm+trmean, "
                                   "mymodule:MyRule, bucketing+mymodule:MyRule), run on the gradients and the BN "
                                   "statistics (--bn SPEC for another rule on the statistics). For each protocol "
                                   "(--protocol, default every protocol of the board) at the board's setting and "
                                   "seeds 0-4: the clean runs, every catalogue attack of the board, an attack search "
                                   "(10 trials on tuning seeds 10 and 11, which the board does not report) and the "
                                   "found attack confirmed on seeds 0-4. The stages are scenario files in a work "
                                   "folder beside the store; every run goes into --db, so the same command resumes an "
                                   "interrupted evaluation. Then the defense's row (as robustbn report gives it) "
                                   "beside the published rows of its protocol (read from docs/results.csv), and a "
                                   "paired comparison with the protocol's published best in the same threat model. "
                                   "Before it starts it prints the runs it will do and their CPU hours, measured here.",
                       epilog="examples:\n  robustbn evaluate mymodule:MyRule --protocol fbn\n"
                              "  robustbn evaluate bucketing+cc --bn nnm+trmean --protocol fbn --protocol naive "
                              "--jobs 2\n"
                              "  robustbn evaluate mymodule:MyRule --budget 2 --format json\n"
                              "  robustbn evaluate median --protocol fbn --plan")
    p.add_argument("spec", help="the defense's pipeline spec (its rule on every channel)")
    p.add_argument("--bn", default=None, metavar="SPEC", help="another pipeline for the BN statistics")
    p.add_argument("--protocol", action="append", default=[], metavar="NORM",
                   help="a protocol of the board (repeatable; default: all of them)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--jobs", type=int, default=1, help="runs at once in the matrices (the search runs one at a time)")
    p.add_argument("--format", choices=["text", "json", "markdown"], default="text")
    p.add_argument("--out", metavar="DIR", default=None, help="write the board with your row to DIR/index.html")
    p.add_argument("--budget", type=float, default=None, metavar="HOURS",
                   help="refuse a plan of more CPU hours than this, naming what to cut")
    p.add_argument("--trials", type=int, default=10, help="the attack search's trials per protocol (default 10, "
                                                          "the board's)")
    p.add_argument("--plan", action="store_true", help="print the plan and its cost, run nothing")
    p.add_argument("--root", default=".", metavar="DIR",
                   help="where the board's files are (scenarios/worst_case_fmnist.toml, docs/results.csv; default .)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change the board's setting (a cut-down check: no published row shares it then)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="write each run's checkpoint every K rounds (default: every 2 minutes; 0: never)")
    p.set_defaults(run=cmd_evaluate)


@fail_cleanly
def cmd_evaluate(args) -> int:
    import json

    from ..checkpoint import Interrupted, checkpoint_dir
    from ..evaluate import (Defense, compare, comparison_line, cost_line, execute, make_plan, over_budget,
                            published_store, seconds_per_run)
    from ..matrix import FIELDS, parse_override
    from ..report import COLUMNS, Board, cells, markdown, rows_json, write_page
    from ..store import FINISHED, Store, strict_json

    if not 1 <= args.jobs <= 512:
        raise UsageError(f"--jobs must be between 1 and 512, got {args.jobs}")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise UsageError(f"--budget must be a positive number of CPU hours, got {args.budget}")
    if args.trials < 1:
        raise UsageError(f"--trials must be >= 1, got {args.trials}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    overrides = {}
    for text in args.set:
        key, value = parse_override(text)
        if key not in FIELDS or key in ("norm", "grad_agg", "bn_agg", "client_filter") or key.endswith("_attack"):
            raise UsageError(f"--set {key}: not a field of the setting (the defense is SPEC and --bn, the protocols "
                             f"--protocol, the attacks the board's)")
        overrides[key] = value
    from aggregators.plugins import add_search_path
    add_search_path(Path.cwd())  # SPEC's `module:Name`: a module of the current directory, as python finds it
    _check_spec(args.spec, "SPEC")
    if args.bn is not None:
        _check_spec(args.bn, "--bn")
    defense = Defense(args.spec, args.bn or args.spec)
    root = Path(args.root)
    workdir = Path(args.db).parent / "evaluate" / defense.slug
    store = Store(args.db)
    try:
        plan = make_plan(root, workdir, defense, args.protocol, store, overrides, args.trials)
        seconds = seconds_per_run(plan, store) if plan.todo else 0.0
        refusal = over_budget(plan, seconds, args.budget) if args.budget is not None else None
        if refusal:
            raise UsageError(refusal)
        print(cost_line(plan, seconds, args.jobs), file=sys.stderr)
        if args.plan:
            for s in plan.stages:
                print(f"{s.norm}\t{s.name}\t{s.todo} of {s.runs} runs to do\t{s.path}")
            return 0
        try:
            failures = execute(plan, store, args.jobs, progress=not args.quiet, checkpoint_every=args.checkpoint_every,
                               log=lambda line: print(line, file=sys.stderr))
        except Interrupted as e:
            print(f"robustbn {args.command}: stopped by {signal.Signals(e.signum).name}; the running runs are "
                  f"checkpointed in {checkpoint_dir(args.db)}; the same command resumes", file=sys.stderr)
            return 128 + e.signum
        mine = store.rows(status=FINISHED)
    finally:
        store.close()
    with published_store(root, workdir) as published:
        board, own, comparisons, rows = compare(plan, mine, published.rows(status=FINISHED))
    for line in failures:
        print(line, file=sys.stderr)
    if args.out is not None:
        print(write_page(rows, args.out, plan.gamma), file=sys.stderr)
    mine_norms = {r["norm"] for r in own}
    shown = [r for r in board.rows if r["norm"] in mine_norms]
    yours = [any(r is o for o in own) for r in shown]
    part = Board(shown, [], [], board.gamma, board.setup)
    if args.format == "json":
        rows = [{**r, "yours": y} for r, y in zip(rows_json(part), yours)]
        print(json.dumps(strict_json({"defense": defense.name, "rows": rows, "comparisons": comparisons}),
                         indent=1, allow_nan=False))
    else:
        if args.format == "markdown":
            print(markdown(part), end="")
        else:
            table = [dict(zip(COLUMNS, cells(r)), yours="<- yours" if y else "") for r, y in zip(shown, yours)]
            print(text_table(table, [*COLUMNS, "yours"]))
        print()
        for c in comparisons:
            print(comparison_line(c))
    return 1 if failures else 0


def _check_spec(spec: str, flag: str) -> None:
    """One line naming the flag where the spec is no pipeline this installation can build."""
    import aggregators

    try:
        aggregators.build(spec, f=1)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        raise UsageError(f"{flag} {spec!r}: {e}") from None

