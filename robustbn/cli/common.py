"""What the commands of `robustbn` share: the one-line usage error, the parser class, the
`--where` filters, the plain-text table and the store's default path."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

DEFAULT_DB = "results/robustbn.sqlite"
RAW = argparse.RawDescriptionHelpFormatter  # every command's help keeps its examples' line breaks


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""

class Parser(argparse.ArgumentParser):
    """argparse's own usage errors (an unknown option, a missing argument, a bad choice) as one
    line pointing at --help, not the whole usage block; exit status 2. Subparsers are made of
    the same class."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def check_device_here(device: str | None, flag: str = "--device") -> None:
    """A --device this machine has, checked before a store or a file is written (each
    scenario checks its own device only when it runs)."""
    if device is not None and device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {device}: CUDA is not available on this machine; use {flag} cpu")


def fail_cleanly(fn):
    """A command function whose user errors (and a store that broke after it opened) print one
    line, `robustbn COMMAND: ...`, and return 2."""
    @functools.wraps(fn)
    def wrapper(args):
        import sqlite3

        from ..data import DataError
        from ..execute import ExecutorError
        from ..matrix import MatrixError
        from ..scenario import ScenarioError
        from ..store import StoreError
        try:
            return fn(args)
        except (UsageError, MatrixError, ScenarioError, DataError, ExecutorError, StoreError) as e:
            print(f"robustbn {args.command}: {e}", file=sys.stderr)
            return 2
        except sqlite3.Error as e:  # a store that broke after it opened: truncated, full disk, locked
            print(f"robustbn {args.command}: {getattr(args, 'db', 'the results store')}: {e}", file=sys.stderr)
            return 2
    return wrapper


WHERE_HELP = ("keep the runs whose scenario field KEY equals VALUE; a list is any of its values "
              "(--where 'n=[4,5]', --where 'norm=[fbn,naive]'); repeatable, every filter must hold")


def did_you_mean(word: str, allowed) -> str:
    """ " (did you mean 'gamma'?)" for the closest allowed word, "" for none close."""
    import difflib

    near = difflib.get_close_matches(word, list(allowed), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def parse_where(pairs: list[str], flag: str = "--where") -> list[tuple[str, list]]:
    """`--where key=value` filters as (key, the values accepted), a list being any of its values:
    scenario fields only (an unknown key, a typo, would match nothing and read as "no runs")."""
    from ..matrix import FIELDS, alternatives, parse_override

    where = [(key, alternatives(key, value)) for key, value in (parse_override(p, flag, "norm=fbn") for p in pairs)]
    for key, values in where:
        if key not in FIELDS:
            raise UsageError(f"{flag} {key}: not a scenario field{did_you_mean(key, FIELDS)}; allowed: "
                             f"{', '.join(sorted(FIELDS))}")
        if not values:
            raise UsageError(f"{flag} {key}=[]: an empty list matches no run; give at least one value")
    return where


def matching_rows(store, pairs: list[str], status=None) -> list[dict]:
    """The store's runs (`Store.rows`) that every `--where` of `pairs` keeps (`--matrix`:
    results.selected_rows)."""
    from ..store import _same

    where = parse_where(pairs)
    return [r for r in store.rows(status=status) if all(any(_same(r.get(k), v) for v in values) for k, values in where)]


def check_image_path(out: str, flag: str = "--out") -> None:
    """A file matplotlib can write: a name with an image format's extension, not a directory."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    path = Path(out)
    if not out or path.is_dir():
        raise UsageError(f"{flag} {out!r}: {'an empty path' if not out else 'a directory'}; give an image file, "
                         f"e.g. results/plot.png")
    if path.suffix.lstrip(".").lower() not in formats:
        raise UsageError(f"{flag} {out}: the extension names the image format; allowed: "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def text_table(rows: list[dict], columns: list[str]) -> str:
    """Rows as left-aligned columns under a header; floats with 4 decimals, None as blank."""
    cells = [[("" if r.get(c) is None else f"{r[c]:.4f}" if isinstance(r.get(c), float) else str(r[c])) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def channel_columns(rows: list[dict], columns: list[str]) -> list[str]:
    """Table columns without repeats: per part (attack, pipeline, their params), the bn_*
    shorthand where every row's two BN channels agree, else the per-channel columns."""
    from ..channels import BN_CHANNELS, PARTS

    drop = set()
    for part in PARTS:
        alike = all(r.get(f"bn_{part}") is not None for r in rows)
        drop |= {f"{c}_{part}" for c in BN_CHANNELS} if alike else {f"bn_{part}"}
    return [c for c in dict.fromkeys(columns) if c not in drop]


def report_added(db: str, store, counts: list[tuple[str, dict]]) -> None:
    """What merge or import did, a line per source, then the store's size."""
    for path, c in counts:
        print(f"{path}: {c['added']} added, {c['replaced']} replaced unfinished runs, {c['kept']} already here"
              + (f" ({c['differing']} done in both with different histories: kept this store's)"
                 if c["differing"] else ""))
    print(f"{len(store)} runs in {db}")


def key_values(texts: list[str], flag: str, example: str) -> dict:
    """`KEY=VALUE` options (TOML values, robustbn.matrix.parse_override) as a dict; a key given
    twice is a usage error."""
    from ..matrix import parse_override

    out = {}
    for text in texts:
        key, value = parse_override(text, flag, example)
        if key in out:
            raise UsageError(f"{flag} {key}: given twice")
        out[key] = value
    return out


def check_tuned(fields: list[str], allowed: bool, where: str) -> None:
    """--tuned FIELD: a scenario field that is neither the protocol, the seed nor an attack's."""
    from ..matrix import FIELDS

    if fields and not allowed:
        raise UsageError(f"--tuned is for {where}")
    for field in fields:
        if field not in FIELDS or field in ("norm", "seed") or field.endswith(("_attack", "_attack_params")):
            tunable = [k for k in FIELDS if k not in ("norm", "seed") and not k.endswith(("_attack", "_attack_params"))]
            raise UsageError(f"--tuned {field}: a scenario field the defenses were tuned on"
                             f"{did_you_mean(field, tunable)}, e.g. --tuned lr or --tuned momentum")
