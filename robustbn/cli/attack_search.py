"""`robustbn attack-search FILE`: an Optuna search for the worst attack on one defense
(robustbn.search), a table or JSON of its trials."""

from __future__ import annotations

import signal
import sys

from .common import DEFAULT_DB, RAW, UsageError, fail_cleanly, text_table


def register(sub) -> None:
    p = sub.add_parser("attack-search", help="search for the worst attack on one defense (Optuna)",
                       formatter_class=RAW,
                       description="FILE is a scenario file with one value per field (the defense: norm, pipelines, "
                                   "filter, ...) and a [search] table: trials, seed (the sampler's), and per searched "
                                   "channel (grad, bn_mean, bn_var) `attacks = [...]` with ranges of their parameters, "
                                   "[search.CHANNEL.ATTACK] PARAM = [low, high], [low, high, \"log\"], a list of "
                                   "names or one value. Optuna's TPE sampler proposes attacks; the search minimizes "
                                   "the final test accuracy (diverged: 0.0); a successive-halving pruner stops a run "
                                   "whose accuracy at eval_every x 3^k rounds is not among the lowest third of the "
                                   "trials there (status `pruned`, never a finished run). Every trial is a run in "
                                   "--db (results --worst-case counts it); the same command again reads finished "
                                   "and pruned trials back and resumes an interrupted one, and a larger --trials "
                                   "continues a search. A fixed seed gives the same search. Exit 1: a trial's run "
                                   "failed.",
                       epilog="examples:\n  robustbn attack-search scenarios/search_fbn_nnm_trmean.toml "
                              "--db results/search.sqlite\n"
                              "  robustbn attack-search my_search.toml --trials 10 --format json\n"
                              "  robustbn results --worst-case --db results/search.sqlite")
    p.add_argument("file")
    p.add_argument("--trials", type=int, default=None, help="trials in all (default: [search] trials)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--jobs", type=int, default=1, help="1 only: trials run one after another (a trial's pruning "
                                                       "reads the trials before it)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (TOML value, one value), repeatable")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="override the scenario's device")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="write the running trial's checkpoint every K rounds (default: every 2 minutes; 0: never)")
    p.set_defaults(run=cmd_attack_search)


@fail_cleanly
def cmd_attack_search(args) -> int:
    """An Optuna search for the worst attack on one defense (robustbn.search)."""
    import json

    from ..checkpoint import Interrupted, checkpoint_dir
    from ..labels import attack_words
    from ..search import load, search
    from ..store import Store, strict_json

    if args.jobs != 1:
        raise UsageError(f"--jobs {args.jobs}: attack-search runs one trial at a time (a trial's pruning reads the "
                         f"trials before it): --jobs 1; run several searches at once to use more cores")
    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials must be >= 1, got {args.trials}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    values, space = load(args.file, args.set + ([f"device={args.device}"] if args.device else []))
    store = Store(args.db)
    try:
        outcome, code = search(values, space, store, str(args.file), args.trials, progress=not args.quiet,
                               checkpoint_every=args.checkpoint_every), 0
    except Interrupted as e:
        outcome, code = e.summary, 128 + e.signum
    finally:
        store.close()
    if code:
        print(f"robustbn {args.command}: stopped by {signal.Signals(code - 128).name} after {len(outcome.trials)} "
              f"trials; the running one checkpointed in {checkpoint_dir(args.db)}; the same command resumes the "
              f"search", file=sys.stderr)
        return code
    failed = outcome.count("failed")
    if args.format == "json":
        print(json.dumps(strict_json(outcome.as_json()), indent=1, allow_nan=False))
        return 1 if failed else 0
    order = {"done": 0, "diverged": 0, "pruned": 1, "failed": 2}
    trials = sorted(outcome.trials, key=lambda t: (order[t.status], t.final_acc or 0.0, t.number))
    rows = [{"trial": t.number, "attack": attack_words(t.scenario), "status": t.status, "final_acc": t.final_acc,
             "rounds_done": t.rounds_done, "run": "here" if t.ran else "in the store", "hash": t.hash} for t in trials]
    print(text_table(rows, ["trial", "attack", "status", "final_acc", "rounds_done", "run", "hash"]))
    worst = outcome.worst
    print(f"{len(outcome.trials)} trials: {len(outcome.trials) - outcome.count('pruned') - failed} finished, "
          f"{outcome.count('pruned')} pruned, {failed} failed; results in {args.db}")
    if worst is None:
        print("worst attack found: none (no trial finished)")
    else:
        print(f"worst attack found: {attack_words(worst.scenario)}: final accuracy {worst.final_acc:.4f} "
              f"(trial {worst.number}, run {worst.hash})")
    return 1 if failed else 0
