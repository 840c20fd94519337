"""`robustbn attack-search FILE`: an Optuna search for the worst attack on one defense
(robustbn.search), a table or JSON of its trials."""

from __future__ import annotations

import signal
import sys

from .common import DEFAULT_DB, RAW, UsageError, check_device_here, fail_cleanly, text_table


def register(sub) -> None:
    p = sub.add_parser("attack-search", help="search for the worst attack on one defense (Optuna)",
                       formatter_class=RAW,
                       description="FILE is a scenario file with one value per field (the defense: norm, pipelines, "
                                   "filter, ...) and a [search] table: trials, seed (the sampler's), and per searched "
                                   "channel (grad, bn_mean, bn_var) `attacks = [...]` with ranges of their parameters, "
                                   "[search.CHANNEL.ATTACK] PARAM = [low, high], [low, high, \"log\"], a list of "
                                   "names or one value; seeds = [...] (every trial runs on each; default the "
                                   "scenario's seed). Optuna's TPE sampler proposes attacks; the search minimizes the "
                                   "trial's mean over its seeds of the final test accuracy (the last evaluation; "
                                   "diverged: chance, 1 / classes). Trials are distinct attacks: a proposal equal to a tried one is a "
                                   "repeat, counted apart. No run stops on its accuracy curve unless prune_margin < 1; "
                                   "a trial stops early (status `pruned`, kept with its bound, never a finished run) "
                                   "only when its seeds run already put its objective above the worst found. Every "
                                   "seed of a trial is a run in --db (results --worst-case counts it); the same command "
                                   "again reads finished and stopped runs back and resumes an interrupted one, and a "
                                   "larger --trials continues a search. A fixed seed gives the same search. Exit 1: a "
                                   "trial's run failed.",
                       epilog="examples:\n  robustbn attack-search scenarios/search_fbn_nnm_trmean.toml "
                              "--db results/search.sqlite\n"
                              "  robustbn attack-search my_search.toml --trials 10 --format json\n"
                              "  robustbn attack-search scenarios/search_fbn_mean.toml --on tuned/tuned_fbn_mean.toml "
                              "--confirm tuned/searched_worst_fbn_mean.toml\n"
                              "  robustbn attack-search scenarios/search_fbn_mean.toml --on tuned/tuned_fbn_mean_f_4.toml "
                              "--try tuned/searched_worst_fbn_mean_f_3.toml --confirm tuned/searched_worst_fbn_mean_f_4.toml\n"
                              "  robustbn results --worst-case --db results/search.sqlite")
    p.add_argument("file")
    p.add_argument("--trials", type=int, default=None, help="trials in all (default: [search] trials)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--jobs", type=int, default=1, help="1 only: trials run one after another (a trial's bound "
                                                       "reads the trials before it)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (TOML value, one value), repeatable")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="run the trials on this device (the confirmation file keeps the scenario's; a run "
                        "finished on any device counts)")
    p.add_argument("--on", metavar="MATRIX", default=None,
                   help="search the defense of MATRIX at its setting (a file of one defense, its attacks and seeds "
                        "aside: a tuned file of robustbn tune); FILE then gives only the [search] space, whose seeds "
                        "must be apart from MATRIX's")
    p.add_argument("--sampler-seed", type=int, default=None, metavar="N",
                   help="the sampler's seed in place of [search] seed (one space, searches of its own)")
    p.add_argument("--confirm", metavar="FILE", default=None,
                   help="once the search is done, write FILE: its worst attack at the search's setting on seeds 0-4 "
                        "(held out from its trials), a scenario file for robustbn run (the board's "
                        "scenarios/searched_worst_*.toml)")
    p.add_argument("--try", dest="tries", action="append", default=[], metavar="FILE",
                   help="after the sampler's trials, try FILE's attack too (a scenario file of one attack per "
                        "channel, in the search space: e.g. the confirmation file of a search at another point of the "
                        "same defense); repeatable")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="write the running trial's checkpoint every K rounds (default: every 2 minutes; 0: never)")
    p.set_defaults(run=cmd_attack_search)


@fail_cleanly
def cmd_attack_search(args) -> int:
    """An Optuna search for the worst attack on one defense (robustbn.search)."""
    import json

    from ..checkpoint import Interrupted, checkpoint_dir
    from ..search import TABLE_COLUMNS, given_point, load, search, summary, table_rows, worst_line
    from ..store import Store, strict_json

    if args.jobs != 1:
        raise UsageError(f"--jobs {args.jobs}: attack-search runs one trial at a time (a trial's bound reads the "
                         f"trials before it): --jobs 1; run several searches at once to use more cores")
    if args.trials is not None and args.trials < 1:
        raise UsageError(f"--trials must be >= 1, got {args.trials}")
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0 rounds (0: no checkpoints), got {args.checkpoint_every}")
    check_device_here(args.device)
    values, space = load(args.file, args.set + ([f"device={args.device}"] if args.device else []), on=args.on,
                         sampler_seed=args.sampler_seed)
    given = [(path, given_point(path, values, space)) for path in args.tries]
    store = Store(args.db)
    try:
        outcome, code = search(values, space, store, str(args.file), args.trials, progress=not args.quiet,
                               checkpoint_every=args.checkpoint_every, given=given), 0
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
    if args.confirm:
        _write_confirmation(args, values, outcome.as_json(), given)
    if args.format == "json":
        print(summary(outcome), file=sys.stderr)
        print(json.dumps(strict_json(outcome.as_json()), indent=1, allow_nan=False))
        return 1 if failed else 0
    print(text_table(table_rows(outcome), TABLE_COLUMNS))
    print(f"{summary(outcome)}; results in {args.db}")
    print(worst_line(outcome))
    return 1 if failed else 0


def _write_confirmation(args, values: dict, outcome_json: dict, given: list) -> None:
    """--confirm FILE: the found attack on the held-out seeds (robustbn.evaluate.confirmation_values),
    naming each --try file and its attack."""
    from pathlib import Path

    from ..evaluate import confirmation_values, drop_earlier_copies, keep_earlier_confirmation, toml_text
    from ..labels import attack_words
    from ..matrix import carried_search_path, expand
    from ..search import defense_of, trial_values

    if args.device:  # --device reached the runs; the file keeps the setting's own (a run is the same on any)
        own = _setting_device(args)
        values = {**{k: v for k, v in values.items() if k != "device"}, **({"device": own} if own else {})}
    # --on MATRIX: confirmed on MATRIX's seeds, so that its runs join MATRIX's cells
    seeds = defense_of(args.on)[1] if args.on else None
    tried = [(Path(path).name, attack_words(expand(trial_values(values, point), path)[0].to_dict()))
             for path, point in given]
    confirm = confirmation_values(Path(args.file), outcome_json, values, seeds, tried)
    if confirm is None:
        raise UsageError(f"--confirm {args.confirm}: the search has no finished trial, so no attack to confirm")
    Path(args.confirm).parent.mkdir(parents=True, exist_ok=True)
    confirm = carried_search_path(confirm, Path(args.file).resolve().parent, Path(args.confirm).parent)
    if kept := keep_earlier_confirmation(Path(args.confirm), confirm):
        print(f"the attack {args.confirm} confirmed before is kept in {kept}: its runs still count", file=sys.stderr)
    for copy in drop_earlier_copies(Path(args.confirm), confirm):
        print(f"{copy} removed: it held the attack confirmed again in {args.confirm}", file=sys.stderr)
    Path(args.confirm).write_text(toml_text(confirm), encoding="utf-8")
    print(f"confirmation file: {args.confirm} (robustbn run it)", file=sys.stderr)


def _setting_device(args) -> str | None:
    """The device the search's setting names without --device: a --set's, else --on MATRIX's
    (its fields replace the search file's), else the search file's; None where none does. Read
    unchecked: this machine need not have it."""
    import tomllib
    from pathlib import Path

    from ..matrix import parse_override

    for text in reversed(args.set):
        key, value = parse_override(text)
        if key == "device":
            return value
    return tomllib.loads(Path(args.on or args.file).read_text(encoding="utf-8")).get("device")
