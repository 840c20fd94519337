"""Checkpoints: the complete state of a run, written atomically beside the results store and
keyed by the run hash, so that a run killed at any point resumes from its last checkpoint and
ends with the history an uninterrupted run has, bit for bit (same machine, same threads).

The engine's own state is explicit (`Federation.state_dict`). The state of the components a
user may bring (attacks, aggregation steps, client filters, protocols) is found by walking
them: every tensor, random generator (torch, numpy) and number they hold, so that a stateful
rule of one's own is checkpointed without writing anything for it.

Stopping: SIGINT and SIGTERM set a flag (`request_stop`) that the round loop reads at the end of
each round: it writes a checkpoint and raises `Interrupted`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

FORMAT = 1  # bump when the checkpoint layout changes: older files are then ignored, with a warning
AUTO_SECONDS = 120.0  # the default: a checkpoint at the first round end 2 minutes after the last one


class Interrupted(Exception):
    """A run stopped by SIGINT or SIGTERM after its checkpoint was written."""

    def __init__(self, signum: int, summary: Any = None):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum, self.summary = signum, summary  # run_matrix: what the matrix had done


_stop: list[int] = []  # the signal that asked to stop, if any


def request_stop(signum: int = signal.SIGTERM) -> None:
    _stop.append(signum)


def stop_requested() -> int | None:
    return _stop[0] if _stop else None


def clear_stop() -> None:
    _stop.clear()


def install_stop_handlers() -> Callable[[], None]:
    """SIGINT and SIGTERM ask the running rounds to stop (checkpoint, then `Interrupted`); a
    second signal stops at once (KeyboardInterrupt). Returns a function restoring the old ones."""
    def handler(signum, frame):
        if _stop:
            raise KeyboardInterrupt
        request_stop(signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in old.items()] and None


# ---- the state of components, found by walking them ------------------------------------------

_SKIP = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, type, torch.nn.Module,
         torch.device, torch.dtype, str, bytes)


def _key(k: Any) -> str:
    return str(k)


def _items(obj: Any):
    if isinstance(obj, dict):
        return list(obj.items())
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    if hasattr(obj, "__dict__") and not isinstance(obj, _SKIP):
        return list(vars(obj).items())
    return []


def component_state(root: Any) -> dict[str, Any]:
    """{path: state} of every tensor, generator and number reachable from `root` through
    attributes, dicts, lists and tuples (functions, modules and nn.Modules are not entered)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj, path):
        if id(obj) in seen or isinstance(obj, _SKIP):
            return
        seen.add(id(obj))
        for k, v in _items(obj):
            p = f"{path}/{_key(k)}"
            if isinstance(v, torch.Generator):
                out[p] = {"generator": str(v.device), "state": v.get_state()}
            elif isinstance(v, np.random.Generator):
                out[p] = {"numpy": v.bit_generator.state}
            elif isinstance(v, torch.Tensor):
                out[p] = {"tensor": v.detach().clone()}
            elif isinstance(v, (bool, int, float)) or v is None:
                out[p] = {"value": v}
            else:
                walk(v, p)
    walk(root, "")
    return out


def load_component_state(root: Any, state: dict[str, Any]) -> None:
    """Put `component_state`'s states back into a freshly built `root`. A generator created on
    first use (one per device) that the fresh object has not made yet is made here."""
    for path, saved in state.items():
        *steps, last = path.strip("/").split("/")
        obj = root
        for step in steps:
            obj = dict(_items(obj)).get(_lookup(obj, step))
        key = _lookup(obj, last)
        current = dict(_items(obj)).get(key) if key is not None else None
        if "generator" in saved:
            if current is None:  # a per-device generator not drawn from yet in this process
                current = torch.Generator(device=saved["generator"])
                _assign(obj, torch.device(last) if isinstance(obj, dict) else last, current)
            current.set_state(saved["state"])
        elif "numpy" in saved:
            current.bit_generator.state = saved["numpy"]
        elif "tensor" in saved:
            value = saved["tensor"].to(current.device) if isinstance(current, torch.Tensor) else saved["tensor"]
            if isinstance(obj, tuple):
                current.copy_(value)
            else:
                _assign(obj, key if key is not None else last, value)
        elif not isinstance(obj, tuple):
            _assign(obj, key if key is not None else last, saved["value"])


def _lookup(obj: Any, step: str) -> Any:
    """The key or attribute of `obj` whose text is `step` (None if it has none)."""
    for k, _ in _items(obj):
        if _key(k) == step:
            return k
    return None


def _assign(obj: Any, key: Any, value: Any) -> None:
    if isinstance(obj, (dict, list)):
        obj[key] = value
    else:
        setattr(obj, key, value)


# ---- files -------------------------------------------------------------------------------

def rng_state(device: torch.device) -> dict[str, Any]:
    """The global generators a run draws from (dropout under vmap: torch's default ones)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class Checkpointer:
    """Where and how often one run writes its checkpoint, and who hears of it.

    every: rounds between checkpoints; None: the first round end AUTO_SECONDS after the last
    one; 0: never. `on_save(state)`: called after each checkpoint (the store's row gets the
    history so far)."""

    path: Path
    run_hash: str
    every: int | None = None
    on_save: Callable[[dict[str, Any]], None] | None = None
    _last: float = 0.0

    def __post_init__(self):
        self._last = time.monotonic()

    def due(self, t: int, rounds: int) -> bool:
        if self.every == 0 or t == rounds:
            return False
        if self.every is None:
            return time.monotonic() - self._last >= AUTO_SECONDS
        return t % self.every == 0

    def save(self, state: dict[str, Any]) -> None:
        """Write atomically: a temporary file beside it, flushed to disk, then renamed over."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                torch.save({"format": FORMAT, "hash": self.run_hash, **state}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk, a folder in the file's place: the run goes on without
            tmp.unlink(missing_ok=True)
            print(f"robustbn: could not write the checkpoint {self.path} ({e}); the run goes on", file=sys.stderr)
            return
        self._last = time.monotonic()
        if self.on_save is not None:
            self.on_save(state)

    def load(self) -> dict[str, Any] | None:
        """The last checkpoint, or None (none, or one that cannot be used: a one-line warning,
        and the run starts over)."""
        if not self.path.exists():
            return None
        if not self.path.is_file():  # a folder or a fifo (open would block) in the file's place
            print(f"robustbn: ignoring the checkpoint {self.path} (not a regular file); the run starts over",
                  file=sys.stderr)
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("hash") != self.run_hash:
                why = f"format {state.get('format')!r}, this robustbn writes {FORMAT}" if isinstance(state, dict) \
                    and state.get("format") != FORMAT else "not this run's checkpoint"
                raise ValueError(why)
        except Exception as e:  # truncated, unreadable, foreign: never worth losing the run over
            print(f"robustbn: ignoring the checkpoint {self.path} ({type(e).__name__}: {str(e)[:120]}); "
                  f"the run starts over", file=sys.stderr)
            return None
        return state


def checkpoint_dir(db: str | Path) -> Path:
    """Checkpoints live beside the store: results/robustbn.sqlite -> results/robustbn.sqlite.checkpoints/"""
    db = Path(db)
    return db.with_name(db.name + ".checkpoints")
