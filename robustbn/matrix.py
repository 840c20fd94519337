"""Scenario files (TOML) and their expansion into a matrix of scenarios.

A file sets scenario fields at the top level; a field given as a list becomes an axis, and the
file expands into the cartesian product of its axes. `exclude` rules (an array of tables)
drop combinations: a combination is dropped when it matches every key of a rule, a list in
a rule meaning "any of". `description` is free text. Fields whose value is itself a list
(lr_milestones) or a table (*_params) become axes when given as a list of such values.
`module:Name` references (a user's rule, attack, protocol, model or dataset) are found beside
the file first, then in the directories of `search_path` (relative to the file), then on
sys.path; a file that robustbn writes from another (tune's, attack-search's, evaluate's) names
where its source found them.

    description = "FBN vs naive BN under attack"
    dataset = "fashion-mnist"
    norm = ["naive", "fbn"]
    f = [0, 3]
    bn_attack = ["none", "sf"]
    [[exclude]]
    f = 0
    bn_attack = ["sf"]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Iterator

from aggregators.plugins import add_search_path

from .channels import BN_CHANNELS, PARTS, expand_channels
from .labels import is_attack
from .scenario import Scenario, ScenarioError
from .store import scenario_dict

FIELDS = {f.name: f for f in dataclasses.fields(Scenario)}
LIST_VALUED = {"lr_milestones"}  # a plain value of these is already a list
TABLE_VALUED = {name for name in FIELDS if name.endswith("_params")}
SPECIAL = {"description", "exclude", "search_path"}


class MatrixError(ValueError):
    """A bad scenario file or override: the message names the file, the key and what is allowed."""


def parse_override(text: str, flag: str = "--set", example: str = "rounds=100") -> tuple[str, Any]:
    """`key=value`, value in TOML syntax (`f=3`, `norm=["fbn","naive"]`, `lr=0.05`); a value
    that is not valid TOML is taken as a string (`norm=fbn`), and a flat list of such values as
    a list of them (`norm=[fbn,naive]`). `flag` names the option in messages (--set, --where,
    --param)."""
    if "=" not in text:
        raise MatrixError(f"{flag} {text!r}: expected key=value, e.g. {flag} {example}")
    key, raw = (part.strip() for part in text.split("=", 1))
    if not key:
        raise MatrixError(f"{flag} {text!r}: no key before '='; expected key=value, e.g. {flag} {example}")
    value = _toml_or_text(raw)
    if isinstance(value, str) and raw[:1] in "[{" and raw.count("[") + raw.count("{") != raw.count("]") + raw.count("}"):
        raise MatrixError(f"{flag} {key}: {raw!r} is not a TOML value (its brackets do not close), e.g. {flag} {example}")
    return key, value


def _toml_or_text(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    items = [item.strip() for item in raw[1:-1].split(",")] if re.fullmatch(r"\[[^\[\]'\"]*\]", raw) else []
    if items and all(items):  # [fbn, naive]: bare words in a list, as a shell makes typing quotes a chore
        return [_toml_or_text(item) for item in items]
    return raw


def alternatives(key: str, value: Any) -> list:
    """The values a `key = value` filter accepts (an exclude rule's, a --where's): a list means
    any of them, except a single value of a list-valued field (lr_milestones), as in a file's axes."""
    return value if _is_axis(key, value) else [value]


def _is_axis(key: str, value: Any) -> bool:
    if key in LIST_VALUED:
        return isinstance(value, list) and bool(value) and isinstance(value[0], list) and (
            not value[0] or isinstance(value[0][0], list))
    return isinstance(value, list)


def _rule_value(sc: Scenario, key: str) -> Any:
    """What a rule compares with: the field's value; for the BN channels, the value as it
    applies (a per-channel field falls back on its bn_* shorthand; a shorthand names the value
    both BN channels share, else None)."""
    for part in PARTS:
        if key in (f"bn_mean_{part}", f"bn_var_{part}"):
            return sc.value_of(key[: -len(part) - 1], part)
        if key == f"bn_{part}":
            mean, var = (sc.value_of(channel, part) for channel in BN_CHANNELS)
            return mean if mean == var else None
    return getattr(sc, key)


def _matches(rule: dict[str, Any], sc: Scenario) -> bool:
    return all(_rule_value(sc, key) in alternatives(key, wanted) for key, wanted in rule.items())


def _plain(key: str) -> bool:
    """A rule's key whose value is the field's own (not a BN channel's, read through its shorthand)."""
    return not any(key in (f"bn_mean_{part}", f"bn_var_{part}", f"bn_{part}") for part in PARTS)


def _combinations(axes: dict[str, list], rules: list[dict]) -> Iterator[dict[str, Any]]:
    """itertools.product of the axes in its order, less the combinations a rule excludes. A rule
    on plain fields that are all axes prunes a partial combination as soon as its last field is
    set (a large matrix is mostly excluded: its full product would be millions); the others are
    checked on the whole combination."""
    keys = list(axes)
    early: dict[int, list[list[tuple[int, list]]]] = {}  # the last axis a rule names -> its (axis, values)
    late = []
    for rule in rules:
        if all(_plain(k) and k in axes for k in rule):
            level = max((keys.index(k) for k in rule), default=-1)
            early.setdefault(level, []).append([(keys.index(k), alternatives(k, v)) for k, v in rule.items()])
        else:
            late.append(rule)
    if -1 in early:  # an empty rule excludes everything
        return
    partials: list[tuple] = [()]
    for level, key in enumerate(keys):
        kills = early.get(level, [])
        partials = [combo for p in partials for combo in (p + (option,) for option in axes[key])
                    if not any(all(combo[i] in ok for i, ok in kill) for kill in kills)]
    for combo in partials:
        chosen = dict(zip(keys, combo))
        if late:
            sc = Scenario(**chosen)
            if any(_matches(rule, sc) for rule in late):
                continue
        yield chosen


def expand(values: dict[str, Any], source: str = "<scenario>") -> list[Scenario]:
    """The validated scenarios of one file's values (after overrides), in file order."""
    axes, rules = _axes(values, source)
    scenarios, on_disk = [], {}
    for chosen in _combinations(axes, rules):
        scenarios.append(_scenario(chosen, axes, source, on_disk))
    if not scenarios:
        raise MatrixError(f"{source}: every combination is excluded; nothing to run")
    return scenarios


def first_scenario(values: dict[str, Any], source: str = "<scenario>") -> Scenario:
    """The first scenario of one file's values, validated with expand's checks of the file: a
    quick check of a large matrix (each scenario's validation sizes its model)."""
    axes, rules = _axes(values, source)
    chosen = next(iter(_combinations(axes, rules)), None)
    if chosen is None:
        raise MatrixError(f"{source}: every combination is excluded; nothing to run")
    return _scenario(chosen, axes, source, {})


def _axes(values: dict[str, Any], source: str) -> tuple[dict[str, list], list[dict]]:
    """A file's keys and exclude rules checked: its axes (every value of each field) and rules."""
    unknown = sorted(set(values) - set(FIELDS) - SPECIAL)
    if "search" in unknown:
        raise MatrixError(f"{source}: a search file (its [search] table); run it with `robustbn attack-search`")
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], [*FIELDS, *SPECIAL], n=1)
        raise MatrixError(f"{source}: unknown key {unknown[0]!r}{f' (did you mean {near[0]!r}?)' if near else ''}; "
                          f"allowed: {', '.join(sorted(FIELDS))}, and 'description', 'exclude', 'search_path'")
    rules = values.get("exclude", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise MatrixError(f"{source}: 'exclude' must be an array of tables ([[exclude]] blocks)")
    for rule in rules:
        bad = sorted(set(rule) - set(FIELDS))
        if bad:
            raise MatrixError(f"{source}: exclude rule names unknown key {bad[0]!r}; allowed: scenario fields")
        _check_rule_names(rule, source)
    fields = {k: v for k, v in values.items() if k not in SPECIAL}
    axes = {k: alternatives(k, v) for k, v in fields.items()}
    for key, options in axes.items():
        if not options:
            raise MatrixError(f"{source}: key {key!r} is an empty list; give at least one value")
    return axes, rules


def _scenario(chosen: dict[str, Any], axes: dict[str, list], source: str, on_disk: dict) -> Scenario:
    try:
        sc = Scenario.from_dict(chosen)
        _record_user_code(sc, on_disk)
        return sc
    except ScenarioError as e:
        where = ", ".join(f"{k}={v!r}" for k, v in chosen.items() if k in axes and len(axes[k]) > 1)
        raise MatrixError(f"{source}: key {e.field!r}: {str(e).split(': ', 1)[1]}"
                          + (f" (in the combination {where})" if where else "")) from None
    except TypeError as e:
        raise MatrixError(f"{source}: {e}") from None


def _check_rule_names(rule: dict[str, Any], source: str) -> None:
    """An exclude rule's attack, pipeline and protocol names exist (a misspelt one would match
    nothing and exclude nothing, silently)."""
    import attacks
    from aggregators.pipeline import step_class

    from .filters import get as get_filter
    from .protocols import get as get_protocol

    for key, wanted in rule.items():
        find = attacks.get if key.endswith("_attack") else get_protocol if key == "norm" else \
            (lambda spec: [step_class(s.strip()) for s in spec.split("+")]) if key.endswith("_agg") else \
            (lambda name: name == "none" or get_filter(name)) if key == "client_filter" else None
        for value in (alternatives(key, wanted) if find else []):
            if isinstance(value, str):
                try:
                    find(value)
                except ValueError as e:
                    raise MatrixError(f"{source}: exclude rule {key} = {value!r}: {e}") from None


def _record_user_code(sc: Scenario, on_disk: dict[str, str]) -> None:
    """The digests of the user's modules the scenario names, as this process loaded them: a
    file that records others (written before a module changed) is refused rather than run as
    the old code, and so is a module edited after this process imported it (its runs would
    run the old code under the new file's name). `on_disk`: the files' digests, read once
    per expansion."""
    from aggregators.plugins import file_digest

    now = sc.current_user_code()
    for module, loaded in (now or {}).items():
        if on_disk.setdefault(module, file_digest(module)) != loaded:
            raise ScenarioError("user_code", f"module {module!r} changed on disk after this process imported it: "
                                             f"start a new process (or importlib.reload it) to run the edited code")
    if sc.user_code is not None and sc.user_code != now:
        raise ScenarioError("user_code", f"the file records {sc.user_code}, and your modules' files are now {now}: "
                                         f"a module changed since the file was written; delete its user_code "
                                         f"line to run the code as it is now")
    sc.user_code = now


def load(path: str | Path, overrides: list[str] = ()) -> tuple[dict[str, Any], list[Scenario]]:
    """(the file's values with overrides applied, its expanded scenarios)."""
    values = read(path, overrides)
    return values, expand(values, str(path))


def read(path: str | Path, overrides: list[str] = ()) -> dict[str, Any]:
    """A scenario file's values with overrides applied, not yet expanded; its directory is
    searched first for its `module:Name` references."""
    if str(path) == "":
        raise MatrixError("an empty path; give a scenario file (a TOML file)")
    path = Path(path)
    try:  # a fifo or a device would block the read or read as an empty file: neither is a scenario file
        if path.exists() and not path.is_dir() and not path.is_file():
            raise MatrixError(f"{path}: not a regular file (a fifo, a socket or a device); give a scenario file "
                              f"(a TOML file)")
    except OSError:
        pass  # a symlink loop and the like: the read below names it
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MatrixError(f"{path}: no such scenario file") from None
    except IsADirectoryError:
        raise MatrixError(f"{path}: a directory, not a scenario file (a TOML file)") from None
    except UnicodeDecodeError as e:
        raise MatrixError(f"{path}: not a text file (a TOML file is UTF-8; byte {e.start} is not)") from None
    except OSError as e:
        raise MatrixError(f"{path}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise MatrixError(f"{path}: not valid TOML: {e}") from None
    for text in overrides:
        key, value = parse_override(text)
        if key not in FIELDS:
            raise MatrixError(f"--set {key}: unknown key; allowed: {', '.join(sorted(FIELDS))}")
        values[key] = value
    dirs = _search_dirs(values.get("search_path", []), path)
    if dirs:
        values["search_path"] = [str(d) for d in dirs]
    add_search_path(path.resolve().parent, *dirs)  # `module:Name` references: beside the file first
    return values


def _search_dirs(given: Any, path: Path) -> list[Path]:
    """A file's `search_path`: one directory or a list, each relative to the file, each existing."""
    dirs = [given] if isinstance(given, str) else given
    if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
        raise MatrixError(f"{path}: 'search_path' must be a directory or a list of directories (strings, relative "
                          f"to the file), got {given!r}")
    out = []
    for d in dirs:
        full = (path.resolve().parent / d).resolve()
        if not full.is_dir():
            raise MatrixError(f"{path}: search_path {d!r}: no such directory ({full})")
        out.append(full)
    return out


def _modules_named(value: Any) -> set[str]:
    """The top-level modules of the `module:Name` references in a value (pipelines split at '+')."""
    if isinstance(value, str):
        return {part.partition(":")[0].strip().split(".")[0] for part in value.split("+") if ":" in part}
    if isinstance(value, list):
        return set().union(*map(_modules_named, value)) if value else set()
    if isinstance(value, dict):
        return set().union(*map(_modules_named, value.values())) if value else set()
    return set()


def _holds(directory: Path, module: str) -> bool:
    return (directory / f"{module}.py").is_file() or (directory / module).is_dir()


def carried_search_path(values: dict[str, Any], found_in: str | Path, target_dir: str | Path) -> dict[str, Any]:
    """`values` for a file to be written in `target_dir`, whose `module:Name` references were
    found in `found_in` (the source file's directory, or the working directory) and in its
    `search_path`: those of them that hold a named module, relative to `target_dir` (absolute
    where they share only the root). Values whose modules are on sys.path (or that name none)
    carry no `search_path`."""
    named = {k: v for k, v in values.items() if (k in FIELDS or k == "exclude") and k not in ("device", "data_dir")}
    modules = set().union(*map(_modules_named, named.values()))
    target = Path(target_dir).resolve()
    dirs = [Path(found_in).resolve(), *map(Path, values.get("search_path", []))]
    # only where a named module is (one found on sys.path needs none); relative where the two
    # share more than the root (a repository moves whole), else absolute
    rel = [os.path.relpath(d, target) if os.path.commonpath([d, target]) != d.anchor else str(d)
           for d in dict.fromkeys(dirs) if d != target and any(_holds(d, m) for m in modules)]
    carried = {k: v for k, v in values.items() if k != "search_path"}
    return {**carried, "search_path": rel} if rel else carried


# the fields in which a run may differ from a scenario of a file and still be one of the
# file's runs: the seeds users add (--set 'seed=[0, 1, 2, 3, 4]') and where it ran
ANY_RUN_OF = ("seed", "device", "data_dir")


# a row's scenario fields -> its cell, a file's values -> (its cells, its number of runs): the
# docs read every row once per file
_CELLS: dict[str, str | None] = {}
_FILE_CELLS: dict[str, tuple[set, int, int]] = {}
# a row (by identity, the row kept alive beside it) -> its cell: reading 150 files' runs out of
# 15,000 rows spelled each row's fields as JSON 150 times
_ROW_CELLS: dict[int, tuple[dict, str | None]] = {}


def _row_cell(row: dict[str, Any]) -> str | None:
    """`_cell` of a store row, once per row object (rows are read, not changed in place)."""
    hit = _ROW_CELLS.get(id(row))
    if hit is not None and hit[0] is row:
        return hit[1]
    if len(_ROW_CELLS) > 500_000:
        _ROW_CELLS.clear()
    cell = _cell(row)
    _ROW_CELLS[id(row)] = (row, cell)
    return cell


def _cell(fields: dict[str, Any]) -> str | None:
    """A scenario's fields but `ANY_RUN_OF`, canonical (one spelling per run), as JSON; None
    for a row that is no scenario."""
    given = {k: v for k, v in fields.items() if k in FIELDS}
    try:
        key = json.dumps(given, sort_keys=True)
    except (TypeError, ValueError):
        key = None
    if key is not None and key in _CELLS:
        return _CELLS[key]
    try:
        values = scenario_dict(fields)
    except (ValueError, TypeError):
        cell = None
    else:
        cell = json.dumps({k: canonical(v) for k, v in values.items() if k not in ANY_RUN_OF}, sort_keys=True,
                          default=str)
    if key is not None:
        if len(_CELLS) > 100_000:
            _CELLS.clear()
        _CELLS[key] = cell
    return cell


def canonical(value: Any) -> Any:
    """Numbers as floats, in parameters too: a row read back with gamma = 0 is the file's 0.0."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def runs_of(path: str | Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows (`Store.rows()`) that are runs of the scenario file `path`, at any seed, on any
    device and by either engine (robustbn's, a Flower simulation's): what the file's worst case
    or plot is about, without the store's other runs (an attack search's trials, say) that
    share its settings."""
    values = read(path)
    if "search" in values:
        raise MatrixError(f"{path}: a search file, whose trials are no matrix's runs; give a scenario or matrix file")
    cells = _file_cells(values, path)[0]
    return [r for r in rows if _row_cell(r) in cells]


def planned(path: str | Path, attacked: bool = False) -> int:
    """The number of runs scenario file `path` expands to (read once per process, with `runs_of`);
    `attacked`: only those some attack touches (robustbn.labels.is_attack), not the clean ones."""
    return _file_cells(read(path), path)[2 if attacked else 1]


def _file_cells(values: dict[str, Any], path: str | Path) -> tuple[set, int, int]:
    key = json.dumps(values, sort_keys=True, default=str)
    if key not in _FILE_CELLS:
        dicts = [sc.to_dict() for sc in expand(values, str(path))]
        _FILE_CELLS[key] = ({_cell(d) for d in dicts}, len(dicts), sum(is_attack(expand_channels(d)) for d in dicts))
    return _FILE_CELLS[key]
