"""`robustbn evaluate`: a user's defense on the board by the board's own procedure, and beside
the published rows.

For each protocol asked (default: every protocol of the board), at the board's setting (the
scalar fields of the board's catalogue matrix, gamma 0):

1. the clean runs (every Byzantine channel honest) on the board's seeds 0-4;
2. every catalogue attack of the board's matrix on seeds 0-4 (FLTrust's adaptive attack only
   against a rule that uses the server's reference, as on the board);
3. an attack search (robustbn.search) over the board's search space (`SPACE`, that of
   scenarios/search_*.toml), `TRIALS` trials of the tuning seeds 10 and 11, which the board
   does not report;
4. the found attack confirmed on seeds 0-4 (`searched_worst_*.toml`, as the board's).

Each stage is a scenario file written to the work folder (beside the store: re-running them
by hand gives the same runs), and every run goes into the store: an interrupted evaluation
resumes where it stopped. Then the defense's row is computed by robustbn.report over the
published runs (the board's CSV, read into a store of their own once) and the user's, and
compared, paired over seeds, with the protocol's published best in the same threat model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .matrix import MatrixError, carried_search_path, expand, read
from .report import (CATALOGUE_MATRIX, CLEAN_MATRIX, ROOT_FREE, TRUSTED, Board, default_matrices, leaderboard, read_rows,
                     threat)
from .stats import distinct, paired, too_few
from .worst import BEST, TIED, server_data

BOARD_SEEDS = [0, 1, 2, 3, 4]
TUNING_SEEDS = [10, 11]
TRIALS = 10
SAMPLER_SEED = 0
PUBLISHED_CSV = "docs/results.csv"
# the board's search space: the [search] channel tables of scenarios/search_*.toml (a test keeps them equal)
SPACE = {
    "grad": {"attacks": ["honest", "alie", "minmax", "ipm", "scale"], "alie": {"z": [0.0, 5.0]},
             "minmax": {"direction": ["unit", "std", "sign"]}, "ipm": {"eps": [0.01, 10.0, "log"]},
             "scale": {"factor": [-1000.0, 1.0]}},
    "bn_mean": {"attacks": ["honest", "sf", "alie", "bn-kl", "scale"], "alie": {"z": [0.0, 5.0]},
                "scale": {"factor": [-1000.0, 1000.0]}},
    "bn_var": {"attacks": ["honest", "bn-kl", "scale"], "scale": {"factor": [1e-06, 1000.0, "log"]}},
}
# a scenario field the board varies, left to each stage (the rest of its matrix is the setting)
AXES = ("norm", "grad_agg", "bn_agg", "client_filter", "grad_attack", "bn_mean_attack", "bn_var_attack", "seed",
        "gamma")


class EvaluateError(MatrixError):
    """A user error in what to evaluate: the message names the option and what is allowed."""


@dataclass
class Defense:
    """What runs on each channel: the gradients' pipeline and the BN statistics' (by default the same)."""

    grad: str
    bn: str

    @property
    def name(self) -> str:
        return self.grad if self.bn == self.grad else f"{self.grad} / {self.bn}"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", self.name).strip("_").lower() or "defense"


@dataclass
class UserAttack:
    """A user's attack: its spec (a catalogue name or `module:Name`), its parameters and the
    channels it corrupts (the others stay honest)."""

    spec: str
    params: dict[str, Any]
    channels: tuple[str, ...]

    @property
    def name(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"{self.spec}{f' ({params})' if params else ''} on {', '.join(self.channels)}"

    @property
    def slug(self) -> str:
        words = re.sub(r"[^A-Za-z0-9]+", "_", f"{self.spec} {' '.join(self.channels)}").strip("_").lower()
        tag = hashlib.sha256(json.dumps(self.params, sort_keys=True, default=str).encode()).hexdigest()[:8]
        return f"attack_{words}" + (f"_{tag}" if self.params else "")


@dataclass
class Stage:
    """One step of the plan: a scenario (or search) file and the runs it holds (to do / in all);
    an attack's stage names the board row it runs against (`row`)."""

    name: str
    norm: str
    path: Path
    runs: int
    todo: int
    row: dict[str, Any] | None = None


@dataclass
class Plan:
    subject: Defense | UserAttack  # what is evaluated
    protocols: list[str]
    root: Path
    workdir: Path
    gamma: float = 0.0
    stages: list[Stage] = field(default_factory=list)
    cut_down: dict[str, Any] = field(default_factory=dict)  # --set values the board's setting lacks


    @property
    def todo(self) -> int:
        return sum(s.todo for s in self.stages)


def toml_text(values: dict[str, Any]) -> str:
    """A scenario or search file's values as TOML (strings, numbers, lists, inline tables; the
    `search` table as [search] sections)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(f"cannot write {v!r} as TOML")

    def section(name: str, table: dict) -> list[str]:
        flat = [f"{json.dumps(k) if not re.fullmatch(r'[A-Za-z0-9_-]+', k) else k} = {value(v)}"
                for k, v in table.items() if not isinstance(v, dict) or name == ""]
        out = [f"[{name}]"] * bool(name) + flat
        for k, v in table.items():
            if isinstance(v, dict) and name:
                out += section(f"{name}.{k}" if re.fullmatch(r"[A-Za-z0-9_-]+", k) else f'{name}."{k}"', v)
        return out

    search = values.get("search")
    lines = section("", {k: v for k, v in values.items() if k != "search"})
    if search is not None:
        lines += section("search", search)
    return "\n".join(lines) + "\n"


def board_matrix(root: Path) -> dict[str, Any]:
    """The values of the board's catalogue matrix under `root`."""
    path = root / CATALOGUE_MATRIX
    if not path.is_file():
        raise EvaluateError(f"{path}: no such file; run from the repository root (or give --root DIR), where the "
                            f"board's files are ({CATALOGUE_MATRIX}, {CLEAN_MATRIX}, {PUBLISHED_CSV})")
    return read(path)


def board_setting(root: Path) -> dict[str, Any]:
    """The scalar fields of the board's catalogue matrix (the setting every row shares)."""
    values = board_matrix(root)
    return {k: v for k, v in values.items() if k not in AXES and k not in ("description", "exclude")
            and not k.endswith(("_attack_params", "_agg_params"))}  # a defense's parameters are the board's rows


def cut_down(root: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides that change the board's setting: no published row shares it then."""
    setting = {**board_setting(root), "gamma": board_gamma(root)}
    return {k: v for k, v in overrides.items() if k not in setting or setting[k] != v}


def work_folder(base: Path, slug: str, root: Path, overrides: dict[str, Any]) -> Path:
    """`base`/`slug` at the board's setting; a cut-down check gets a folder of its own, so that
    its files and their runs never stand for the full evaluation's."""
    changed = cut_down(root, overrides)
    if not changed:
        return base / slug
    digest = hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]
    return base / f"{slug}-set-{digest}"


def board_gamma(root: Path, overrides: dict[str, Any] | None = None) -> float:
    """The board's heterogeneity: its matrix's gamma where it gives one, else 0 (the leaderboard's)."""
    gamma = (overrides or {}).get("gamma", board_matrix(root).get("gamma", 0.0))
    return float(gamma) if isinstance(gamma, (int, float)) and not isinstance(gamma, bool) else 0.0


def board_protocols(root: Path) -> list[str]:
    values = board_matrix(root)
    norms = values.get("norm", [])
    return list(norms) if isinstance(norms, list) else [norms]


def _uses_reference(spec: str) -> bool:
    return server_data({"grad_agg": spec, "bn_agg": spec, "root_size": 1}) is not None


def stage_values(root: Path, defense: Defense, norm: str, overrides: dict[str, Any], trials: int = TRIALS
                 ) -> dict[str, dict[str, Any]]:
    """{stage name: its file's values} for one protocol: clean, catalogue and search."""
    setting = {**board_setting(root), **overrides}
    catalogue = board_matrix(root)
    defense_fields = {"norm": norm, "grad_agg": defense.grad, "bn_agg": defense.bn, "client_filter": "none",
                      "gamma": board_gamma(root, overrides)}
    attacks = {k: v for k, v in catalogue.items() if k.endswith("_attack") or k.endswith("_attack_params")}
    if not _uses_reference(defense.grad) and isinstance(attacks.get("grad_attack"), list):
        attacks["grad_attack"] = [a for a in attacks["grad_attack"] if a != "adaptive"]
    # the catalogue's exclusions of attacks (those naming no defense field), for this protocol
    attack_keys = {"grad_attack", "bn_mean_attack", "bn_var_attack"}
    exclude = [{k: v for k, v in rule.items() if k != "norm"} for rule in catalogue.get("exclude", [])
               if set(rule) <= attack_keys | {"norm"} and set(rule) & attack_keys
               and norm in (rule["norm"] if isinstance(rule.get("norm"), list) else [rule.get("norm", norm)])]
    setting.pop("seed", None)
    honest = {"grad_attack": "honest", "bn_mean_attack": "honest", "bn_var_attack": "honest"}
    from .protocols import get as get_protocol
    sends = get_protocol(norm).sends_statistics
    space = {c: t for c, t in SPACE.items() if c == "grad" or sends}
    words = f"{defense.name} under {norm}"
    return {
        "clean": {"description": f"robustbn evaluate: {words}, every Byzantine channel honest, the board's seeds",
                  **setting, **defense_fields, "seed": BOARD_SEEDS, **honest},
        "catalogue": {"description": f"robustbn evaluate: {words} against every catalogue attack of the board, the "
                                     f"board's seeds", **setting, **defense_fields, "seed": BOARD_SEEDS, **attacks,
                      **({"exclude": exclude} if exclude else {})},
        "search": {"description": f"robustbn evaluate: the attack search against {words}, on tuning seeds the board "
                                  f"does not report", **setting, **defense_fields,
                   "search": {"trials": trials, "seed": SAMPLER_SEED, "seeds": TUNING_SEEDS, **space}},
    }


def make_plan(root: Path, workdir: Path, defense: Defense, protocols: list[str] | None, store,
              overrides: dict[str, Any] | None = None, trials: int = TRIALS) -> Plan:
    """Write the stages' files under `workdir` and count their runs (to do: not finished in
    `store`). Raises EvaluateError (or MatrixError) naming what is wrong."""
    from .execute import pending

    board = board_protocols(root)
    protocols = protocols or board
    unknown = [p for p in protocols if p not in board]
    if unknown:
        raise EvaluateError(f"--protocol {unknown[0]!r}: not a protocol of the board; allowed: {', '.join(board)}")
    plan = Plan(defense, list(dict.fromkeys(protocols)), root, workdir, board_gamma(root, overrides),
                cut_down=cut_down(root, overrides or {}))
    workdir.mkdir(parents=True, exist_ok=True)
    for norm in plan.protocols:
        for name, values in stage_values(root, defense, norm, overrides or {}, trials).items():
            path = workdir / f"{name}_{norm}.toml"
            text = toml_text(carried_search_path(values, Path.cwd(), workdir))
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
            if name == "search":
                from .search import load as load_search
                _, space = load_search(path)
                runs = space.trials * len(space.seeds)
                ended = store.db.execute("SELECT COUNT(*) FROM runs WHERE source = ? AND status IN "
                                         "('done', 'diverged', 'pruned')", (str(path),)).fetchone()[0]
                # at most: a trial that one seed settles never runs its other
                search_todo = 0 if _search_finished(path, space.trials) else max(0, runs - ended)
                plan.stages.append(Stage(name, norm, path, runs, search_todo))
                confirm = workdir / f"searched_worst_{norm}.toml"
                todo = len(pending(expand(read(confirm), str(confirm)), store, None, None)[0]) \
                    if confirm.is_file() and not search_todo else len(BOARD_SEEDS)
                plan.stages.append(Stage("confirm", norm, confirm, len(BOARD_SEEDS), todo))
            else:
                scenarios = expand(read(path), str(path))
                todo, _, total = pending(scenarios, store, None, None)
                plan.stages.append(Stage(name, norm, path, total, len(todo)))
    return plan


def _search_finished(path: Path, trials: int) -> bool:
    """Whether the search file's outcome (its .json, written after the file) holds every trial."""
    found = path.with_suffix(".json")
    if not found.is_file() or found.stat().st_mtime < path.stat().st_mtime:
        return False
    try:
        data = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(data.get("stopped")) or data.get("trials", 0) >= trials


def seconds_per_run(plan: Plan, store=None) -> float:
    """A board run's seconds on this machine: the median wall time of the store's finished runs
    at the plan's setting where it holds 3 or more, else `calibrate` (a few rounds timed here)."""
    if store is not None:
        from .matrix import runs_of
        from .store import FINISHED
        rows = store.rows(status=FINISHED)
        walls = [r["wall_time_s"] for s in plan.stages if s.name in MATRIX_STAGES
                 for r in runs_of(s.path, rows) if r.get("wall_time_s")]
        if len(walls) >= 3:
            return statistics.median(walls)
    return calibrate(plan)


CALIBRATION_ROUNDS = 8
MATRIX_STAGES = ("catalogue", "against")  # the stages whose runs time a run of the plan


def calibrate(plan: Plan) -> float:
    """Time `CALIBRATION_ROUNDS` rounds and one evaluation of the plan's first catalogue run,
    on one torch thread as a --jobs worker runs: rounds x a round's median time + evaluations
    x an evaluation's."""
    import torch

    from .data import load_dataset
    from .runner import run
    from .scenario import Scenario

    path = next(s.path for s in plan.stages if s.name in MATRIX_STAGES)
    scenarios = expand(read(path), str(path))
    # ALIE alone: a middling attack's cost (min-max searches each round, honest is cheaper)
    sc = next((x for x in scenarios if x.grad_attack == "alie" and x.bn_mean_attack in (None, "honest")), scenarios[0])
    short = Scenario.from_dict({**sc.to_dict(), "rounds": CALIBRATION_ROUNDS, "eval_every": CALIBRATION_ROUNDS})
    load_dataset(short.dataset, short.data_dir)  # the data's first load is no run's cost
    stamps = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        run(short, progress=lambda t: stamps.append(time.perf_counter()))
    finally:
        torch.set_num_threads(threads)
    steps = [b - a for a, b in zip([start, *stamps[:-1]], stamps)]
    round_s = statistics.median(steps[1:-1] or steps)
    eval_s = max(0.0, steps[-1] - round_s)
    return sc.rounds * round_s + math.ceil(sc.rounds / sc.eval_every) * eval_s + steps[0]


def cost_line(plan: Plan, seconds: float, jobs: int) -> str:
    what = (f"{plan.subject.name} against {len(plan.stages)} rows of {', '.join(plan.protocols)}"
            if isinstance(plan.subject, UserAttack) else f"{plan.subject.name} on {', '.join(plan.protocols)}")
    if not plan.todo:
        return f"plan: nothing to run for {what}: its {sum(s.runs for s in plan.stages)} runs are in the store"
    hours = plan.todo * seconds / 3600
    searches = any(s.name == "search" for s in plan.stages)
    search = (", a search one trial at a time" + " in a process beside them" * (jobs >= 2)) if searches else ""
    return (f"plan: {plan.todo} runs to do ({sum(s.runs for s in plan.stages)} in all) for {what}; about "
            f"{seconds:.0f} s a run here, so {hours:.1f} CPU hours (the matrices run --jobs {jobs} at a time{search})")


def over_budget(plan: Plan, seconds: float, budget: float) -> str | None:
    """None, or the one line refusing the plan and naming what to cut."""
    hours = plan.todo * seconds / 3600
    if hours <= budget:
        return None
    per_norm = hours / max(1, len(plan.protocols))
    fit = int(budget // per_norm) if per_norm > 0 else 0
    search = sum(s.todo for s in plan.stages if s.name == "search") * seconds / 3600
    trials = f" or search trials (--trials: the searches are {search:.1f} h of it)" if search else ""
    return (f"--budget {budget:g}: the plan needs about {hours:.1f} CPU hours ({plan.todo} runs); cut protocols "
            f"(--protocol: {fit} of the {len(plan.protocols)} fit, about {per_norm:.1f} h each){trials}")


def confirmation_values(search_path: Path, outcome_json: dict[str, Any], values: dict[str, Any] | None = None,
                        seeds: list[int] | None = None, tried: list[tuple[str, str]] = ()) -> dict[str, Any] | None:
    """The confirmation file of a finished search: the found attack on `seeds` (default the
    board's), at the search file's setting (or `values`, the setting as the search ran it).
    `tried`: (file name, attack in words) of each --try, named in its description (what a
    search with those files has tried; robustbn's docs read it back)."""
    worst = outcome_json.get("worst")
    if not worst:
        return None
    values = dict(values) if values is not None else read(search_path)
    values.pop("search", None)
    attack = {k: worst[k] for k in ("grad_attack", "grad_attack_params", "bn_mean_attack", "bn_mean_attack_params",
                                    "bn_var_attack", "bn_var_attack_params") if worst.get(k) not in (None, {})}
    from .labels import attack_words
    seeds = list(BOARD_SEEDS) if seeds is None else seeds
    given = f" given by --try {Path(worst['given']).name}" if worst.get("given") else ""
    values["description"] = (f"The worst attack that robustbn attack-search {search_path.name} found (trial "
                             f"{worst['trial']}{given}, {attack_words(worst)}), on the seeds {', '.join(map(str, seeds))}, "
                             f"held out from the search's trials"
                             + "".join(f"; it tried too {name} ({words})" for name, words in tried))
    return {**values, "seed": seeds, **attack}


EARLIER = "_earlier_"  # searched_worst_<point>_earlier_<k>.toml: an attack confirmed there before


def keep_earlier_confirmation(path: Path, new_values: dict[str, Any]) -> Path | None:
    """Before `path`, a confirmation file, is rewritten with another attack at the same setting,
    its attack is kept beside it as <stem>_earlier_<k>.toml (returned): its runs on the held-out
    seeds are an attack tried there, and a worst case is the worst of every attack tried (a
    later search can find a worse attack on its own seeds that is milder on these). Nothing is
    kept where the file is missing, is no confirmation, holds the same attacks, or another
    setting (a defense tuned anew: its old attack was on another defense), or where an earlier
    file kept there holds its attacks at its setting already (its runs count through that one)."""
    from .store import scenario_hash
    from .worst import ATTACK_KEYS, NOT_SETTING

    if not path.is_file():
        return None
    try:
        old = read(path)
        before, after = expand(old, str(path)), expand(new_values, str(path))
    except MatrixError:
        return None
    # the board's first confirmations were written by hand, the command in backticks
    if not str(old.get("description", "")).replace("`", "").startswith("The worst attack that robustbn attack-search"):
        return None
    attacks = lambda scs: {scenario_hash({k: v for k, v in sc.to_dict().items() if k in ATTACK_KEYS}) for sc in scs}
    settings = lambda scs: {scenario_hash({k: v for k, v in sc.to_dict().items()
                                           if k not in ATTACK_KEYS and k not in NOT_SETTING}) for sc in scs}
    if attacks(before) <= attacks(after) or settings(before) != settings(after):
        return None
    for earlier in path.parent.glob(f"{path.stem}{EARLIER}*.toml"):
        try:
            kept = expand(read(earlier), str(earlier))
        except MatrixError:
            continue
        if attacks(kept) == attacks(before) and settings(kept) == settings(before):
            return None
    k = 1
    while (kept := path.with_name(f"{path.stem}{EARLIER}{k}.toml")).exists():
        k += 1
    old["description"] = (f"{old['description']}. Kept when a later search confirmed another attack at this point "
                          f"({path.name}): every attack confirmed here counts in its worst case")
    kept.write_text(toml_text(old), encoding="utf-8")
    return kept


def drop_earlier_copies(path: Path, new_values: dict[str, Any]) -> list[Path]:
    """The <stem>_earlier_<k>.toml files beside `path` that plan exactly the runs `new_values`
    (the confirmation about to be written there) plans: a search that confirms again an attack
    kept earlier makes that file a copy of `path`, whose runs count through `path` itself. They
    are removed and returned."""
    from .store import scenario_hash

    runs = lambda scs: {scenario_hash({k: v for k, v in sc.to_dict().items() if k != "description"}) for sc in scs}
    try:
        now = runs(expand(new_values, str(path)))
    except MatrixError:
        return []
    copies = []
    for earlier in sorted(path.parent.glob(f"{path.stem}{EARLIER}*.toml")):
        try:
            if runs(expand(read(earlier), str(earlier))) == now:
                copies.append(earlier)
        except MatrixError:
            continue
    for earlier in copies:
        earlier.unlink()
    return copies


def published_store(root: Path, workdir: Path):
    """A store of the board's published runs (the CSV read once into workdir/published.sqlite)."""
    from .store import Store, read_export

    csv = root / PUBLISHED_CSV
    if not csv.is_file():
        raise EvaluateError(f"{csv}: no such file; the published runs of the board are read from it")
    path = workdir / "published.sqlite"
    stamp = workdir / "published.stamp"
    key = f"{csv.stat().st_size} {csv.stat().st_mtime_ns}"
    if not path.is_file() or not stamp.is_file() or stamp.read_text() != key:
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            p.unlink(missing_ok=True)
        store = Store(path)
        try:
            store.add([read_export(csv)])
        finally:
            store.close()
        stamp.write_text(key)
    return Store(path, readonly=True)


def board_files(root: Path, plan: Plan | None = None) -> list[str]:
    """The published board's files, then the plan's own (clean, catalogue, confirmation)."""
    files = [str(root / f) for f in default_matrices(root)]
    if plan is not None:
        files += [str(s.path) for s in plan.stages if s.name in ("clean", "catalogue", "confirm") and s.path.is_file()]
    return files


def seed_worst(row: dict[str, Any]) -> dict[Any, float]:
    """{seed: the accuracy under the row's worst attack} (repeated seeds averaged)."""
    by: dict[Any, list[float]] = {}
    for r in row["runs"]:
        if r["worst"]:
            by.setdefault(r["seed"], []).append(r["acc"])
    return {s: statistics.fmean(v) for s, v in by.items()}


def verdict_word(d) -> str:
    """B - A paired: "better" / "worse" where the interval excludes 0, else "tied"."""
    few = too_few(d.n)
    if few:
        return few
    if distinct(d):
        return "better" if d.low > 0 else "worse"
    return "tied"


def compare(plan: Plan, mine: list[dict[str, Any]], published: list[dict[str, Any]]
            ) -> tuple[Board, list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(the board with the user's rows, the user's rows, one comparison per user row, the runs
    behind the board): each paired over seeds with the protocol's published best in its threat
    model."""
    files = board_files(plan.root, plan)
    # the board's seeds (a search's trials, on tuning seeds, are runs of its confirmation file's cells too)
    mine = [r for r in mine if r.get("seed") in BOARD_SEEDS]
    # a cut-down check (--set changing the setting) shares no published row: it is compared with none
    published = [] if plan.cut_down else [r for r in published if r.get("seed") in BOARD_SEEDS]
    mine_hashes = {r["hash"] for r in mine}
    pub_rows = read_rows(published, board_files(plan.root))
    pub_board = leaderboard(pub_rows, plan.gamma)
    seen = {r["hash"] for r in published}
    rows = read_rows(published + [r for r in mine if r["hash"] not in seen], files)
    board = leaderboard(rows, plan.gamma)
    own = [r for r in board.rows if r["norm"] in plan.protocols
           and any(run["hash"] in mine_hashes for run in r["runs"])]
    comparisons = []
    for r in own:
        mine_model = threat(r)
        for model in (mine_model, *(m for m in (ROOT_FREE, TRUSTED) if m != mine_model)):
            rivals = [p for p in pub_board.rows if p["norm"] == r["norm"] and threat(p) == model
                      and p["worst_acc"] is not None and p["defense"] != r["defense"]]
            base = {"norm": r["norm"], "defense": r["defense"], "threat": mine_model, "against_threat": model}
            if not rivals or r["worst_acc"] is None:
                none = (f"no published row at this setting ({', '.join(f'--set {k}={v!r}' for k, v in plan.cut_down.items())}"
                        f" changes the board's)" if plan.cut_down else "no published row to compare with")
                comparisons.append({**base, "against": None, "diff": None, "low": None, "high": None, "pairs": 0,
                                    "verdict": none if not rivals else "no worst case"})
                continue
            best = max(rivals, key=lambda p: p["worst_acc"])
            theirs = next((b for b in board.rows if (b["norm"], b["defense"], threat(b)) ==
                           (best["norm"], best["defense"], model)), best)
            d = paired(seed_worst(theirs), seed_worst(r))
            comparisons.append({**base, "against": best["defense"], "against_verdict": best["verdict"],
                                "against_server_data": best["server_data"], "diff": d.mean, "low": d.low,
                                "high": d.high, "pairs": d.n, "verdict": verdict_word(d)})
    return board, own, comparisons, rows


def comparison_line(c: dict[str, Any]) -> str:
    """"with fbn, root-free: drop-farthest - nnm+trmean (the published best) = -3.1 points
    [-5.0, -1.2], paired over 5 seeds: worse"; against the other threat model's best, that
    model named (a rule of trusted server data answers another question)."""
    where = c["threat"] if c["against_threat"] == c["threat"] else \
        f"{c['threat']} against the best with {c['against_threat']}" if c["against_threat"] == TRUSTED else \
        f"{c['threat']} against the best {c['against_threat']} row"
    if c["against"] is None:
        return f"with {c['norm']}, {where}: {c['defense']}: {c['verdict']}"
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}"
    interval_ = f" [{pct(c['low'])}, {pct(c['high'])}]" if c["low"] is not None else " (no interval)"
    kind = "published best" if c.get("against_verdict") == BEST else (
        "highest published worst case, tied for best" if c.get("against_verdict") == TIED else "highest published worst case")
    data = f", {c['against_server_data']}" if c.get("against_server_data") else ""
    return (f"with {c['norm']}, {where}: {c['defense']} - {c['against']} ({kind}{data}) = {pct(c['diff'])} points"
            f"{interval_}, paired over {c['pairs']} seed{'s' * (c['pairs'] != 1)}: {c['verdict']}")


def execute(plan: Plan, store, jobs: int = 1, progress: bool = True, checkpoint_every: int | None = None,
            log: Callable[[str], None] = print) -> list[str]:
    """Run the plan's stages into `store`, protocol by protocol (finished runs are read back,
    an interrupted one resumes); returns the failures, one line each. With jobs >= 2 a
    protocol's attack search runs in a process of its own beside the clean and catalogue runs
    (it needs neither; a search is one trial after another, which would leave cores idle).
    Raises Interrupted on SIGINT or SIGTERM, every running run checkpointed."""
    from .execute import run_matrix, shared_workers

    failures = []
    with shared_workers():  # spawned once for every protocol's matrices
        for norm in plan.protocols:
            stages = {s.name: s for s in plan.stages if s.norm == norm}
            s = stages["search"]
            about = (f"{norm}: attack search ({s.runs} runs at most: {s.runs // len(TUNING_SEEDS)} trials of seeds "
                     f"{', '.join(map(str, TUNING_SEEDS))}): {s.path}")
            beside = _SearchProcess(s.path, store.path, checkpoint_every) if jobs >= 2 and s.todo else None
            try:
                if beside is not None:
                    log(f"{about}, in a process beside the matrices")
                for name in ("clean", "catalogue"):
                    m = stages[name]
                    log(f"{norm}: {name} ({m.runs} runs, {m.todo} to do): {m.path}")
                    summary = run_matrix(expand(read(m.path), str(m.path)), store, source=str(m.path), jobs=jobs,
                                         progress=progress, checkpoint_every=checkpoint_every)
                    failures += [f"{m.path}: run {h} failed: {e}" for h, e in summary.failed]
                if beside is not None:
                    found = beside.wait(store, progress)
                else:
                    log(about)
                    found = run_search(s.path, store, progress, checkpoint_every, log)
            finally:
                if beside is not None:
                    beside.stop()
            if found is None:
                failures.append(f"{s.path}: the search stopped with an error (above); run the same command again")
                continue
            confirm = stages["confirm"]
            values = confirmation_values(s.path, found)
            if values is None:
                failures.append(f"{s.path}: no trial finished, so no attack to confirm")
                continue
            confirm.path.write_text(toml_text(carried_search_path(values, s.path.parent, confirm.path.parent)),
                                    encoding="utf-8")
            log(f"{norm}: the found attack on seeds {', '.join(map(str, BOARD_SEEDS))}: {confirm.path}")
            summary = run_matrix(expand(values, str(confirm.path)), store, source=str(confirm.path), jobs=jobs,
                                 progress=progress, checkpoint_every=checkpoint_every)
            failures += [f"{confirm.path}: run {h} failed: {e}" for h, e in summary.failed]
    return failures


def run_search(path: Path, store, progress: bool, checkpoint_every: int | None,
               log: Callable[[str], None]) -> dict[str, Any]:
    """Run (or resume) the search file `path` into `store`; its outcome's JSON, also written
    beside it (`search_<norm>.json`)."""
    from .search import load as load_search
    from .search import search
    from .store import strict_json

    values, space = load_search(path)
    found = strict_json(search(values, space, store, str(path), progress=progress, checkpoint_every=checkpoint_every,
                               log=log).as_json())
    path.with_suffix(".json").write_text(json.dumps(found, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return found


class _SearchProcess:
    """A search file run by `run_search` in a spawned process of one torch thread, into the
    same store (its claims keep the runs apart). Stopped by SIGTERM: it checkpoints its run."""

    def __init__(self, path: Path, db: Path, checkpoint_every: int | None):
        import os
        import signal
        from multiprocessing import get_context

        from aggregators.plugins import search_path

        self.path = path
        self.process = get_context("spawn").Process(
            target=_search_main, args=(str(path), str(db), checkpoint_every, search_path(), os.getpid()))
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # born ignoring Ctrl-C until its handlers are set
        try:
            self.process.start()
        finally:
            signal.signal(signal.SIGINT, old)

    def wait(self, store, progress: bool) -> dict[str, Any] | None:
        """Its outcome once it ends (a bar over its runs meanwhile); None if it failed. Raises
        Interrupted on SIGINT or SIGTERM here."""
        from tqdm.auto import tqdm

        from .checkpoint import Interrupted, install_stop_handlers, stop_requested

        restore = install_stop_handlers()
        try:
            with tqdm(desc="attack search (its runs)", unit="run", disable=not progress) as bar:
                while True:
                    if stop_requested():
                        raise Interrupted(stop_requested())
                    n = store.db.execute("SELECT COUNT(*) FROM runs WHERE source = ? AND status IN "
                                         "('done', 'diverged', 'pruned', 'failed')", (str(self.path),)).fetchone()[0]
                    bar.update(n - bar.n)
                    if not self.process.is_alive():
                        break
                    self.process.join(2.0)
        finally:
            restore()
        if self.process.exitcode != 0:
            return None
        return json.loads(self.path.with_suffix(".json").read_text(encoding="utf-8"))

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(120)


def _search_main(path: str, db: str, checkpoint_every: int | None, search: list[str], parent: int) -> None:
    import sys

    import torch

    from aggregators.plugins import add_search_path

    from .checkpoint import Interrupted
    from .execute import _die_with
    from .store import Store

    _die_with(parent)
    torch.set_num_threads(1)
    add_search_path(*search)
    store = Store(db)
    try:
        run_search(Path(path), store, False, checkpoint_every, lambda line: print(line, file=sys.stderr))
    except Interrupted as e:
        sys.exit(128 + e.signum)
    finally:
        store.close()


# `robustbn evaluate --attack SPEC`: a user's attack against the rows the board recommends

CHANNELS = ("grad", "bn_mean", "bn_var")
NEW_WORST, TIED_WORST, HIGHER = "new worst", "tied with the worst", "higher than the worst"


def published_board(root: Path, published: list[dict[str, Any]], gamma: float) -> Board:
    """The board of the published runs (seeds 0-4), as docs/results.md has it."""
    return leaderboard(read_rows([r for r in published if r.get("seed") in BOARD_SEEDS], board_files(root)), gamma)


def recommended(board: Board, protocols: list[str]) -> list[dict[str, Any]]:
    """Per protocol and threat model, the rows a practitioner would deploy: every row best or
    tied for best, else (no verdict) the highest worst case."""
    out = []
    for norm in protocols:
        for model in (ROOT_FREE, TRUSTED):
            ranked = [r for r in board.rows if r["norm"] == norm and threat(r) == model and r["worst_acc"] is not None]
            top = [r for r in ranked if r["verdict"] in (BEST, TIED)]
            out += top or ranked[:1]  # board.rows: the highest worst case first within a protocol
    return out


def against_values(scenario: dict[str, Any], attack: UserAttack, norm: str, defense: str) -> dict[str, Any] | None:
    """A row's scenario (one of its runs') with the user's attack on its channels, the others
    honest, on the board's seeds; None where the protocol sends none of those channels."""
    from .protocols import get as get_protocol
    sends = get_protocol(norm).sends_statistics
    channels = [c for c in attack.channels if c == "grad" or sends]
    if not channels:
        return None
    base = {k: v for k, v in scenario.items()
            if v is not None and k != "seed" and not k.endswith("_attack") and not k.endswith("_attack_params")}
    attacks = {}
    for c in CHANNELS:
        attacks[f"{c}_attack"] = attack.spec if c in channels else "honest"
        if c in channels and attack.params:
            attacks[f"{c}_attack_params"] = dict(attack.params)
    return {"description": f"robustbn evaluate --attack: {attack.name} against {defense} under {norm} (a row the "
                           f"board recommends), the board's seeds", **base, "seed": BOARD_SEEDS, **attacks}


def attack_plan(root: Path, workdir: Path, attack: UserAttack, protocols: list[str] | None, store, published
                ) -> tuple[Plan, list[str]]:
    """Write one scenario file per recommended row of the asked protocols under `workdir`,
    count their runs (to do: not finished in `store`); returns the plan and a line for each
    protocol left out (it sends none of the attack's channels). `published` is the store of the
    board's runs."""
    from .execute import pending

    board = board_protocols(root)
    protocols = list(dict.fromkeys(protocols or board))
    unknown = [p for p in protocols if p not in board]
    if unknown:
        raise EvaluateError(f"--protocol {unknown[0]!r}: not a protocol of the board; allowed: {', '.join(board)}")
    gamma = board_gamma(root)
    plan = Plan(attack, protocols, root, workdir, gamma)
    workdir.mkdir(parents=True, exist_ok=True)
    skipped, names = [], set()
    for row in recommended(published_board(root, published.rows(status=("done", "diverged")), gamma), protocols):
        run_hash = row["runs"][0]["hash"]
        scenario = json.loads(published.db.execute("SELECT scenario FROM runs WHERE hash = ?", (run_hash,)).fetchone()[0])
        values = against_values(scenario, attack, row["norm"], row["defense"])
        if values is None:
            skipped.append(f"{row['norm']}: sends no BN statistics, so {attack.name} has nothing to corrupt there")
            continue
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{row['norm']} {threat(row)} {row['defense']}").strip("_").lower()[:80]
        while name in names:
            name += "_"
        names.add(name)
        path = workdir / f"{name}.toml"
        text = toml_text(carried_search_path(values, Path.cwd(), workdir))
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        todo, _, total = pending(expand(read(path), str(path)), store, None, None)
        plan.stages.append(Stage("against", row["norm"], path, total, len(todo), row))
    plan.protocols = [p for p in protocols if any(s.norm == p for s in plan.stages)]
    return plan, list(dict.fromkeys(skipped))


def execute_attack(plan: Plan, store, jobs: int = 1, progress: bool = True, checkpoint_every: int | None = None,
                   log: Callable[[str], None] = print) -> list[str]:
    """Run every row's file into `store`, in one pool of `jobs` workers (each run stored with
    its row's file as source); returns the failures, one line each. Raises Interrupted on
    SIGINT or SIGTERM, every running run checkpointed."""
    from .execute import run_matrix
    from .store import scenario_hash

    scenarios, source = [], {}
    for s in plan.stages:
        log(f"{s.norm}: against {s.row['defense']} ({s.runs} runs, {s.todo} to do): {s.path}")
        for sc in expand(read(s.path), str(s.path)):
            scenarios.append(sc)
            source[scenario_hash(sc.to_dict())] = str(s.path)
    summary = run_matrix(scenarios, store, source=lambda sc: source[scenario_hash(sc.to_dict())], jobs=jobs,
                         progress=progress, checkpoint_every=checkpoint_every)
    files = {h: source[h] for h, _ in summary.failed}
    return [f"{files[h]}: run {h} failed: {e}" for h, e in summary.failed]


def attack_verdicts(plan: Plan, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per row attacked: the user's attack's accuracy over seeds against the row's
    current worst case, B - A paired over seeds: NEW_WORST (lower, the interval below 0),
    TIED_WORST or HIGHER."""
    from .matrix import runs_of
    from .stats import ACCURACY, accuracy, interval

    out = []
    for s in plan.stages:
        row = s.row
        yours = {}
        for r in runs_of(s.path, mine):
            if r.get("seed") in BOARD_SEEDS and r.get("status") in ("done", "diverged"):
                yours[r["seed"]] = accuracy(r)[0]
        est = interval(yours.values(), ACCURACY)
        d = paired(seed_worst(row), yours)
        verdict = too_few(d.n) or (HIGHER if distinct(d) and d.low > 0 else NEW_WORST if distinct(d) else TIED_WORST)
        out.append({"norm": row["norm"], "defense": row["defense"], "threat": threat(row),
                    "server_data": row["server_data"], "board_verdict": row["verdict"], "worst_acc": row["worst_acc"],
                    "worst_low": row["ci_low"], "worst_high": row["ci_high"], "worst_seeds": row["seeds"],
                    "worst_attack": row["worst_attack"],
                    "attack_acc": est.mean if yours else None, "attack_low": est.low, "attack_high": est.high,
                    "seeds": len(yours), "diff": d.mean if d.n else None, "low": d.low, "high": d.high, "pairs": d.n,
                    "verdict": verdict, "file": str(s.path)})
    return out


def attack_summary(attack: UserAttack, verdicts: list[dict[str, Any]]) -> str:
    """"norm-matched-flip on grad lowers 2 of the 9 recommended rows: ...; tied with the worst
    of 5; higher than the worst of 2"."""
    lowered = [v for v in verdicts if v["verdict"] == NEW_WORST]
    counts = {w: sum(v["verdict"] == w for v in verdicts) for w in (TIED_WORST, HIGHER)}
    rest = "; ".join(f"{w} of {n}" for w, n in counts.items() if n)
    other = len(verdicts) - len(lowered) - sum(counts.values())
    rest += f"{'; ' if rest else ''}no verdict on {other}" if other else ""
    named = ": " + ", ".join(f"{v['norm']} {v['defense']} ({v['threat']})" for v in lowered) if lowered else ""
    return (f"{attack.name} lowers {len(lowered)} of the {len(verdicts)} rows the board recommends{named}"
            f"{'; ' + rest if rest else ''}")
