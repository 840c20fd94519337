"""`robustbn evaluate SPEC`: a user's defense on the board by the board's own procedure
(robustbn.evaluate), its row printed beside the published rows with a paired verdict."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

from .common import RAW, UsageError, fail_cleanly, key_values, text_table

DEFAULT_DB = "results/evaluate.sqlite"
CHANNEL_CHOICES = ("grad", "bn_mean", "bn_var")


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
                                   "Before it starts it prints the runs it will do and their CPU hours, measured here. "
                                   "--attack SPEC evaluates an attack instead: every row the board recommends (best "
                                   "or tied for best, else the highest, per protocol and threat model) runs under it "
                                   "on seeds 0-4, and each is paired with its current worst case: a new worst, tied "
                                   "or higher.",
                       epilog="examples:\n  robustbn evaluate mymodule:MyRule --protocol fbn\n"
                              "  robustbn evaluate bucketing+cc --bn nnm+trmean --protocol fbn --protocol naive "
                              "--jobs 2\n"
                              "  robustbn evaluate mymodule:MyRule --budget 2 --format json\n"
                              "  robustbn evaluate median --protocol fbn --plan\n"
                              "  robustbn evaluate --attack mymodule:MyAttack --attack-param z=1.5 --protocol fbn\n"
                              "  robustbn evaluate --attack alie --channel bn_mean --channel bn_var --jobs 2")
    p.add_argument("spec", nargs="?", help="the defense's pipeline spec (its rule on every channel)")
    p.add_argument("--attack", default=None, metavar="SPEC",
                   help="evaluate an attack instead (a catalogue name or module:Name): against every row the board "
                        "recommends (best or tied for best, per protocol and threat model) on seeds 0-4, paired "
                        "with each row's current worst case")
    p.add_argument("--attack-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --attack (repeatable; TOML values: z=1.5, direction=\"std\")")
    p.add_argument("--channel", action="append", default=[], choices=CHANNEL_CHOICES,
                   help="a message channel --attack corrupts (repeatable; default grad; the others stay honest)")
    p.add_argument("--bn", default=None, metavar="SPEC", help="another pipeline for the BN statistics")
    p.add_argument("--protocol", action="append", default=[], metavar="NORM",
                   help="a protocol of the board (repeatable; default: all of them)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--jobs", type=int, default=1, help="runs at once in the matrices (the search runs one at a time)")
    p.add_argument("--format", choices=["text", "json", "markdown"], default="text")
    p.add_argument("--out", metavar="DIR", default=None, help="write the board with your runs to DIR/index.html")
    p.add_argument("--budget", type=float, default=None, metavar="HOURS",
                   help="refuse a plan of more CPU hours than this, naming what to cut")
    p.add_argument("--trials", type=int, default=None, help="the attack search's trials per protocol (default 10, "
                                                            "the board's)")
    p.add_argument("--plan", action="store_true", help="print the plan and its cost, run nothing")
    p.add_argument("--root", default=".", metavar="DIR",
                   help="where the board's files are (scenarios/worst_case_fmnist.toml, docs/results.csv; default .)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change the board's setting: a cut-down check, in a work folder of its own and compared with "
                        "no published row (none shares its setting)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="write each run's checkpoint every K rounds (default: every 2 minutes; 0: never)")
    p.set_defaults(run=cmd_evaluate)


@fail_cleanly
def cmd_evaluate(args) -> int:
    from ..matrix import FIELDS, parse_override

    if not 1 <= args.jobs <= 512:
        raise UsageError(f"--jobs must be between 1 and 512, got {args.jobs}")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise UsageError(f"--budget must be a positive number of CPU hours, got {args.budget}")
    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials must be >= 1, got {args.trials}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    overrides = {}
    for text in args.set:
        key, value = parse_override(text)
        if key not in FIELDS or key in ("norm", "grad_agg", "bn_agg", "client_filter", "seed", "user_code") or \
                key.endswith("_attack"):
            raise UsageError(f"--set {key}: not a field of the setting (the defense is SPEC and --bn, the protocols "
                             f"--protocol, the attacks and seeds the board's)")
        overrides[key] = value
    from aggregators.plugins import add_search_path
    add_search_path(Path.cwd())  # `module:Name`: a module of the current directory, as python finds it
    if args.attack is not None:
        return _evaluate_attack(args, overrides)
    if args.spec is None:
        raise UsageError("give a defense (robustbn evaluate SPEC) or an attack (robustbn evaluate --attack SPEC)")
    for flag, given in (("--attack-param", args.attack_param), ("--channel", args.channel)):
        if given:
            raise UsageError(f"{flag} is for --attack SPEC; a defense meets the board's attacks")
    _check_spec(args.spec, "SPEC")
    if args.bn is not None:
        _check_spec(args.bn, "--bn")
    return _evaluate_defense(args, overrides)


def _evaluate_defense(args, overrides) -> int:
    import json

    from ..evaluate import TRIALS, Defense, compare, comparison_line, execute, make_plan, published_store, work_folder
    from ..report import COLUMNS, Board, cells, markdown, rows_json, write_page
    from ..store import FINISHED, Store, strict_json

    defense = Defense(args.spec, args.bn or args.spec)
    root = Path(args.root)
    workdir = work_folder(Path(args.db).parent / "evaluate", defense.slug, root, overrides)
    store = Store(args.db)
    try:
        plan = make_plan(root, workdir, defense, args.protocol, store, overrides, args.trials or TRIALS)
        done = _carry_out(args, plan, store, execute)
        if isinstance(done, int):
            return done
        failures, mine = done
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


ATTACK_COLUMNS = ("protocol", "threat model", "defense", "worst case now", "its worst attack", "your attack",
                  "yours - worst, paired", "verdict")


def _evaluate_attack(args, overrides) -> int:
    import json

    from ..evaluate import (UserAttack, attack_plan, attack_summary, attack_verdicts, board_files, execute_attack,
                            published_store)
    from ..report import ci, pct, read_rows, write_page
    from ..store import FINISHED, Store, strict_json

    if args.spec is not None:
        raise UsageError(f"give SPEC (a defense) or --attack SPEC (an attack), not both: got {args.spec!r} and "
                         f"--attack {args.attack!r}")
    for flag, given in (("--bn", args.bn), ("--trials", args.trials), ("--set", args.set)):
        if given:
            raise UsageError(f"{flag} is for a defense; --attack runs at the board's setting against its rows")
    attack = UserAttack(args.attack, key_values(args.attack_param, "--attack-param", "z=1.5"), tuple(dict.fromkeys(args.channel or ["grad"])))
    _check_attack(attack)
    root = Path(args.root)
    workdir = Path(args.db).parent / "evaluate" / attack.slug
    store = Store(args.db)
    try:
        from ..evaluate import board_matrix
        board_matrix(root)  # the board's files are there, or one line says where they should be
        with published_store(root, workdir) as published:
            plan, skipped = attack_plan(root, workdir, attack, args.protocol, store, published)
            published_rows = published.rows(status=FINISHED) if args.out is not None else []
        for line in skipped:
            print(line, file=sys.stderr)
        if not plan.stages:
            raise UsageError(f"--attack {attack.spec}: no row of {', '.join(args.protocol) or 'the board'} receives "
                             f"{', '.join(attack.channels)}; add --channel grad")
        done = _carry_out(args, plan, store, execute_attack)
        if isinstance(done, int):
            return done
        failures, mine = done
    finally:
        store.close()
    verdicts = attack_verdicts(plan, mine)
    for line in failures:
        print(line, file=sys.stderr)
    if args.out is not None:
        files = board_files(root) + [str(s.path) for s in plan.stages]
        seen = {r["hash"] for r in published_rows}
        rows = read_rows(published_rows + [r for r in mine if r["hash"] not in seen], files)
        print(write_page(rows, args.out, plan.gamma), file=sys.stderr)
    if args.format == "json":
        print(json.dumps(strict_json({"attack": attack.spec, "params": attack.params, "channels": list(attack.channels),
                                      "rows": verdicts, "summary": attack_summary(attack, verdicts)}),
                         indent=1, allow_nan=False))
        return 1 if failures else 0
    table = [dict(zip(ATTACK_COLUMNS, (
        v["norm"], v["threat"], v["defense"], f"{pct(v['worst_acc'])} {ci(v['worst_low'], v['worst_high'], v['worst_seeds'])}",
        v["worst_attack"], f"{pct(v['attack_acc'])} {ci(v['attack_low'], v['attack_high'], v['seeds'])}",
        "-" if v["diff"] is None else f"{100 * v['diff']:+.1f} {_signed_ci(v)} ({v['pairs']} seeds)", v["verdict"])))
        for v in verdicts]
    if args.format == "markdown":
        print("| " + " | ".join(ATTACK_COLUMNS) + " |\n|" + "---|" * len(ATTACK_COLUMNS))
        for t in table:
            print("| " + " | ".join(str(t[c]).replace("|", "\\|") for c in ATTACK_COLUMNS) + " |")
    else:
        print(text_table(table, list(ATTACK_COLUMNS)))
    print()
    print(attack_summary(attack, verdicts))
    return 1 if failures else 0


def _signed_ci(v) -> str:
    return "(no interval)" if v["low"] is None else f"[{100 * v['low']:+.1f}, {100 * v['high']:+.1f}]"


def _check_attack(attack) -> None:
    """One line where --attack names no attack this installation can build with its parameters."""
    import aggregators
    import attacks

    try:
        cls = attacks.get(attack.spec)
    except (ValueError, ImportError, AttributeError) as e:
        try:
            aggregators.build(attack.spec, f=1)
        except (ValueError, TypeError, ImportError, AttributeError):
            raise UsageError(f"--attack {attack.spec!r}: {e}") from None
        raise UsageError(f"--attack {attack.spec!r}: a defense, not an attack; evaluate it with "
                         f"robustbn evaluate {attack.spec}") from None
    if cls is None or attack.spec in ("honest",):
        raise UsageError(f"--attack {attack.spec!r}: no attack; name one the board does not hold yet")
    try:
        attacks.build(attack.spec, seed=0, pipeline=lambda x: x.mean(0), **attack.params)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--attack-param: {e}") from None


def _carry_out(args, plan, store, execute) -> tuple[list[str], list[dict]] | int:
    """Print the plan's cost (refusing it over --budget), then run it: (its failures, the
    store's finished runs), or the exit status where --plan or a signal stops there."""
    from ..checkpoint import Interrupted, checkpoint_dir
    from ..evaluate import cost_line, over_budget, seconds_per_run
    from ..store import FINISHED

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
    return failures, store.rows(status=FINISHED)


def _check_spec(spec: str, flag: str) -> None:
    """One line naming the flag where the spec is no pipeline this installation can build."""
    import aggregators

    import attacks

    try:
        aggregators.build(spec, f=1)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        try:
            is_attack = attacks.get(spec) is not None
        except (ValueError, ImportError, AttributeError):
            is_attack = False
        if is_attack:
            raise UsageError(f"{flag} {spec!r}: an attack, not a defense; evaluate it with robustbn evaluate "
                             f"--attack {spec}") from None
        raise UsageError(f"{flag} {spec!r}: {e}") from None

