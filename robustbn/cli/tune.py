"""`robustbn tune MATRIX --grid lr=[...]`: each defense's hyperparameters chosen by ByzFL's rule
(robustbn.tune) on tuning seeds, and a file per defense at its chosen point."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

from .common import DEFAULT_DB, RAW, UsageError, check_device_here, fail_cleanly, key_values, text_table


def register(sub) -> None:
    p = sub.add_parser("tune", help="tune each defense before it is attacked (ByzFL's rule)", formatter_class=RAW,
                       description="MATRIX is a scenario matrix of defenses and attacks at one setting (the board's "
                                   "catalogue, a user's own). Each --grid field's values (their cross product with "
                                   "several) run the whole matrix on tuning seeds (--seeds, default 10 and 11, which "
                                   "no report uses; each evaluated once, at its last round: the rule reads final accuracies only), "
                                   "written to DIR/tune_<matrix>.toml (DIR: --out, default "
                                   "tune/<matrix> beside the store). A defense's score at a grid point is its worst "
                                   "case over the matrix's attacks (lowest mean over seeds; diverged: chance); its "
                                   "chosen point is the highest score (ties: the first in grid order), the max over "
                                   "the grid of the min over attacks. Then, per defense (and per point of the setting where MATRIX varies gamma, f, ...), DIR/tuned_<norm>_<defense>[_<point>].toml: "
                                   "the matrix at its chosen point on --report-seeds (default 0-4), for robustbn run. "
                                   "Pruned (the default; --full runs the whole grid), best first: each point of a "
                                   "defense runs its most harmful attack, then, wave by wave, the point whose finished "
                                   "attacks leave it the highest score runs its next attack, until that point has "
                                   "run them all; a point whose finished attacks put it below a finished point can "
                                   "no longer be chosen and stops, so the choice is the full grid's. Clean runs are "
                                   "left out (the rule reads attacked runs). "
                                   "Every run is in --db: the same command resumes.",
                       epilog="examples:\n  robustbn tune scenarios/worst_case_fmnist.toml --grid 'lr=[0.01,0.05,0.1]' "
                              "--set norm=fbn --jobs 2\n"
                              "  robustbn tune my_matrix.toml --grid 'lr=[0.02,0.1]' --grid 'momentum=[0.0,0.9]' "
                              "--format json\n"
                              "  robustbn run results/tune/my_matrix/tuned_*.toml --jobs 2")
    p.add_argument("matrix")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=[V1,V2,...]",
                   help="a field and the values to try (repeatable: their cross product)")
    p.add_argument("--seeds", default=None, help="tuning seeds, comma-separated (default 10,11)")
    p.add_argument("--report-seeds", default=None, help="the seeds of the tuned files (default 0,1,2,3,4)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a field of MATRIX first")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results store (default {DEFAULT_DB})")
    p.add_argument("--out", default=None, metavar="DIR", help="where the tuning and tuned files go")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="run on this device (the files keep their own; a run finished on any device counts)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--plan", action="store_true", help="write the tuning file and count its runs, run nothing")
    p.add_argument("--full", action="store_true", help="run every run of the tuning file (no pruning, clean runs too)")
    p.add_argument("--first", default=None, metavar="KEY=[V1,...]",
                   help="tune the defenses and points whose KEY is V1 first, then V2, ..., then the rest (e.g. "
                        "--first norm=fbn: one protocol's tuned files sooner); the choices are the same")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_tune)


def _seeds(text: str, flag: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: comma-separated integers, e.g. {flag} 10,11") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) < len(seeds):
        raise UsageError(f"{flag} {text!r}: distinct integers >= 0, e.g. {flag} 10,11")
    return seeds


def _pruned(plan, by_hash: dict, alias: dict, store, source: str, args, after_wave, rank: dict | None = None):
    """Run the tuning in waves (robustbn.tune.Tuning) until every defense's choice is settled,
    calling after_wave(finished runs by hash; `alias`: store.device_aliases) before each wave; `rank`
    (robustbn.tune.first_ranks): each wave cut to its first runs. Runs another process holds are
    waited for; a run that fails here is not retried."""
    import dataclasses
    import time

    from .. import tune
    from ..execute import Summary, run_matrix

    summary, failed, wave_no = Summary(), set(), 0
    while True:
        finished = _finished(store, alias)
        after_wave(finished)
        wave = plan.next_wave(finished, frozenset(failed))
        if rank:
            wave = tune.first_runs(wave, rank, tune.MIN_WAVE * args.jobs)
        if not wave:
            return summary
        wave_no += 1
        if not args.quiet:
            print(f"tune: wave {wave_no}, {len(wave)} runs", file=sys.stderr)
        s = run_matrix([by_hash[h] for h in wave], store, source=source, jobs=args.jobs, device=args.device,
                       progress=not args.quiet)
        for f in dataclasses.fields(Summary):  # the waves' summaries added up
            setattr(summary, f.name, getattr(summary, f.name) + getattr(s, f.name))
        failed |= {h for h, _ in s.failed}
        if s.taken and not s.done and not s.failed:
            time.sleep(30)  # another process shares the store and holds this wave's runs


def _finished(store, alias: dict[str, str]) -> dict[str, dict]:
    """The tuning file's finished runs, on whichever device each ran, each under its hash in the
    file (the grid points are found by it): what the pruning and the choices read."""
    from ..store import FINISHED

    return {alias[r["hash"]]: {**r, "hash": alias[r["hash"]]} for r in store.rows(status=FINISHED)
            if r["hash"] in alias}


def _check_quickly(values: dict, points: list[dict], matrix: str) -> None:
    """MATRIX's every scenario, and each grid point's keys and values on a first scenario, checked
    before anything is written: errors name MATRIX, not the tuning file made from it."""
    from ..matrix import MatrixError, expand, first_scenario

    expand(values, matrix)
    for point in points:
        try:
            first_scenario({**values, **point}, matrix)
        except MatrixError as e:
            raise UsageError(f"--grid {', '.join(f'{k}={v!r}' for k, v in point.items())}: {e}") from None


def _first_groups(plan, rank: dict, wanted: list) -> str:
    """How many defenses (each at each point of the setting) --first puts in each group, in order."""
    counts = [0] * (len(wanted) + 1)
    for by_point in plan.defenses.values():
        counts[rank[next(h for attacks in by_point for hashes in attacks.values() for h in hashes)]] += 1
    names = [repr(v) for v in wanted] + ["then the rest"]
    return ", ".join(f"{name} {n} defense{'s' * (n != 1)}" for name, n in zip(names, counts) if n or name != names[-1])


def _milestones_note(matrix: str, values: dict, grid: dict) -> None:
    """lr_milestones set absolute rates from their first round on: a grid of lr tunes the rounds before."""
    from ..matrix import alternatives

    schedules = alternatives("lr_milestones", values.get("lr_milestones", []))
    starts = [min(m[0] for m in sched) for sched in schedules if isinstance(sched, list) and sched
              and all(isinstance(m, list) and m and isinstance(m[0], int) for m in sched)]
    if "lr" not in grid or not starts:
        return
    first = min(starts)
    rounds = "no round at all" if first <= 1 else f"the learning rate of rounds 1-{first - 1} only"
    print(f"tune: note: {matrix} sets lr_milestones = {values['lr_milestones']!r}, so --grid lr changes {rounds}; "
          f"to tune the whole schedule, grid lr_milestones instead, or --set 'lr_milestones=[]'", file=sys.stderr)


def _score_text(score: dict) -> str:
    """A grid point's cell: its worst case (%), seeds, and for a pruned point '<=' and its attacks."""
    if score["worst_acc"] is None:
        return "-"
    seeds = f"{score['seeds']} seed{'s' * (score['seeds'] != 1)}"
    if score["pruned"]:
        return f"<= {100 * score['worst_acc']:.1f} ({seeds}, pruned after {score['attacks']} attack{'s' * (score['attacks'] != 1)})"
    return f"{100 * score['worst_acc']:.1f} ({seeds})"


def _write_tuned(finished: dict[str, dict], grid: dict, plan, point_of: dict, values: dict, out: Path,
                 report_seeds: list[int]) -> tuple[list[dict], list[str]]:
    """The choices over the finished tuning runs (by hash), and out/tuned_<slug>.toml of every
    defense whose choice is settled (rewritten only where its text changed)."""
    from ..evaluate import toml_text
    from ..tune import setting_fields, settled_choices, slug, tuned_values

    choices, written = settled_choices(finished, grid, plan, point_of), []
    at_keys = setting_fields(values)  # gamma, f, ... where the matrix varies them: each point tuned apart
    for c in choices:
        c["at"] = {k: c["setting"].get(k) for k in at_keys}
        c["file"] = None
        if c["complete"]:
            path = out / f"tuned_{slug(c, values)}.toml"
            text = toml_text(tuned_values(values, c, report_seeds))
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                partial = path.with_suffix(".toml.partial")  # a stop mid-write leaves the old file whole
                partial.write_text(text, encoding="utf-8")
                partial.replace(path)
            written.append(str(path))
            c["file"] = str(path)
    return choices, written


@fail_cleanly
def cmd_tune(args) -> int:
    import json

    from ..checkpoint import Interrupted, checkpoint_dir
    from ..evaluate import toml_text
    from ..execute import pending, run_matrix, shared_workers
    from ..matrix import carried_search_path, parse_override
    from ..store import Store, device_aliases, strict_json
    from ..tune import (REPORT_SEEDS, TUNING_SEEDS, TUNING_WORDS, Tuning, check_matrix, expand_grid, first_ranks,
                        grid_points, setting_fields, varies)

    if not 1 <= args.jobs <= 512:
        raise UsageError(f"--jobs must be between 1 and 512, got {args.jobs}")
    if args.first is not None and args.full:
        raise UsageError("--first orders the pruned waves; --full runs every run at once: give one of them")
    if not args.grid:
        raise UsageError("give --grid KEY=[V1,V2,...], e.g. --grid 'lr=[0.01,0.05,0.1]'")
    if not args.plan:  # a plan runs nothing
        check_device_here(args.device)
    seeds = _seeds(args.seeds, "--seeds") if args.seeds is not None else TUNING_SEEDS
    report_seeds = _seeds(args.report_seeds, "--report-seeds") if args.report_seeds is not None else REPORT_SEEDS
    if set(seeds) & set(report_seeds):
        raise UsageError(f"--seeds {','.join(map(str, seeds))}: tuning seeds must not be reported; --report-seeds "
                         f"is {','.join(map(str, report_seeds))}")
    values = check_matrix(args.matrix)
    for text in args.set:
        key, value = parse_override(text)
        values[key] = value
    grid = key_values(args.grid, "--grid", "lr=[0.01,0.05,0.1]")
    points = grid_points(grid)
    clash = [k for k in grid if varies(values, k)]
    if clash:
        raise UsageError(f"--grid {clash[0]}: {args.matrix} already varies it ({values[clash[0]]!r}); tune a field "
                         f"it holds one value of (or --set {clash[0]}=... first)")
    _check_quickly(values, points, args.matrix)
    _milestones_note(args.matrix, values, grid)
    out = Path(args.out) if args.out else Path(args.db).parent / "tune" / Path(args.matrix).stem
    out.mkdir(parents=True, exist_ok=True)
    values = carried_search_path(values, Path(args.matrix).resolve().parent, out)  # a user's modules, from out
    tuning = out / f"tune_{Path(args.matrix).stem}.toml"
    tuning_values = {**values, **grid, "seed": seeds}
    if isinstance(values.get("rounds"), int) and not isinstance(values.get("eval_every"), list):
        # the rule reads final accuracies only: one evaluation a run, at its last round (a fifth of a run saved),
        # on the whole test set, so an eval_subset would change nothing but the runs' hashes
        tuning_values["eval_every"] = values["rounds"]
        tuning_values.pop("eval_subset", None)
    tuning_values["description"] = (f"{TUNING_WORDS}{args.matrix} at every point of the grid "
                                    f"({', '.join(f'{k} = {v}' for k, v in grid.items())}) on the tuning seeds "
                                    f"{', '.join(map(str, seeds))}")
    text = toml_text(tuning_values)
    if not tuning.is_file() or tuning.read_text(encoding="utf-8") != text:
        tuning.write_text(text, encoding="utf-8")
    by_hash, point_of = expand_grid(tuning, grid)
    scenarios = list(by_hash.values())
    rank = None
    if args.first is not None:
        ((key, wanted),) = key_values([args.first], "--first", "norm=fbn").items()
        wanted = wanted if isinstance(wanted, list) else [wanted]
        rank = first_ranks(by_hash, key, wanted)
    # a plan runs nothing and makes no store: it counts against an empty one where there is none
    empty = tempfile.TemporaryDirectory() if args.plan and not Path(args.db).is_file() else None
    store = Store(Path(empty.name) / "plan.sqlite") if empty else Store(args.db, readonly=args.plan)
    try:
        todo, _, total = pending(scenarios, store, None, None)  # the file's hashes, as the plan holds them
        plan = Tuning([(h, sc.to_dict()) for h, sc in by_hash.items()], grid, point_of)
        head = f"tune: {len(points)} grid points x {total // len(points)} runs on seeds {', '.join(map(str, seeds))}"
        if args.full:
            print(f"{head}: {total} runs, {len(todo)} to do ({tuning})", file=sys.stderr)
        else:
            left = sum(1 for h, _ in todo if h in plan.hashes)
            print(f"{head}: {total} runs, of which the rule reads the {plan.attacked} attacked ones (clean runs are "
                  f"left out); {left} of those not run yet, and pruning runs only what a choice still needs "
                  f"({tuning})", file=sys.stderr)
        if rank:
            print(f"tune: --first {key}: {_first_groups(plan, rank, wanted)}", file=sys.stderr)
        if args.plan:
            return 0
        alias = device_aliases(by_hash)
        try:
            if args.full:
                summary = run_matrix(scenarios, store, source=str(tuning), jobs=args.jobs, device=args.device,
                                     progress=not args.quiet)
            else:  # each defense's tuned file is written once its choice is settled, wave by wave
                after_wave = lambda finished: _write_tuned(finished, grid, plan, point_of, values, out,
                                                           report_seeds)
                with shared_workers():  # spawned once for every wave
                    summary = _pruned(plan, by_hash, alias, store, str(tuning), args, after_wave, rank)
        except Interrupted as e:
            if not args.full:  # the choices the last runs settled, as the next wave would have written them
                _write_tuned(_finished(store, alias), grid, plan, point_of, values, out, report_seeds)
            print(f"robustbn tune: stopped by {signal.Signals(e.signum).name}; the running runs are checkpointed in "
                  f"{checkpoint_dir(args.db)}; the same command resumes", file=sys.stderr)
            return 128 + e.signum
        finished = _finished(store, alias)  # exactly the tuning file's runs: what the pruning read
    finally:
        store.close()
        if empty:
            empty.cleanup()
    choices, written = _write_tuned(finished, grid, plan, point_of, values, out, report_seeds)
    for h, e in summary.failed:
        print(f"  failed {h}: {e}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(strict_json({"grid": grid, "seeds": seeds, "rule": "max over the grid of the worst case over "
                                      "the attacks (ties: the first point)", "defenses": [
                                          {k: v for k, v in c.items() if k != "setting"} for c in choices]}),
                         indent=1, allow_nan=False))
    else:
        from ..stats import chance as chance_of
        from ..worst import AT_CHANCE

        words = lambda p: ", ".join(f"{k}={v}" for k, v in p.items())
        table, at_chance = [], 0
        for c in choices:
            row = {"norm": c["norm"], "defense": c["defense"], **c["at"]}
            for s in c["scores"]:
                row[words(s["point"])] = _score_text(s)
            row["chosen"] = words(c["chosen"]) if c["complete"] else "incomplete"
            # a choice among broken points is the rule's, not a working lr
            if c["complete"] and c["chosen_acc"] is not None and c["chosen_acc"] <= chance_of(c["setting"]) + AT_CHANCE:
                row["chosen"] += " (at chance)"
                at_chance += 1
            table.append(row)
        # a numeric grid's columns in increasing order, whatever order it was given in (new values last, say)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for p in points for v in p.values())
        shown = sorted(points, key=lambda p: tuple(p.values())) if numeric else points
        print(text_table(table, ["norm", "defense", *setting_fields(values), *(words(p) for p in shown), "chosen"]))
        ties = "" if shown == points else f" (ties: the first in the grid's order, {'; '.join(words(p) for p in points)})"
        print(f"\nworst case over the attacks (%), mean over the tuning seeds {', '.join(map(str, seeds))}; "
              f"chosen: the max over the grid{ties}")
        if at_chance:
            print(f"{at_chance} choice{'s' * (at_chance != 1)} (at chance): every grid point within "
                  f"{100 * AT_CHANCE:g} point of chance under some attack; the rule still picks the highest, but no "
                  f"point of the grid makes that defense work")
        if written:
            print(f"tuned files ({len(written)}): {out}/tuned_*.toml; run them with robustbn run")
    return 1 if summary.failed else 0
