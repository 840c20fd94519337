"""References to a user's classes, `module:Name`, for every catalogue (aggregators, attacks,
and robustbn's protocols, models and datasets): the module is found in the directories on
the search path first (a scenario file's own directory, added by whoever reads the file),
then on sys.path. Worker processes get the same search path (`search_path()`, then
`add_search_path(...)` in the worker) so a reference resolves alike everywhere."""

from __future__ import annotations

import hashlib
import importlib
import os
import sys

_SEARCH: list[str] = []


def add_search_path(*dirs: str | os.PathLike) -> None:
    """Search these directories, in this order, before those added earlier and sys.path."""
    for d in reversed([os.path.abspath(d) for d in dirs]):
        if d in _SEARCH:
            _SEARCH.remove(d)
        _SEARCH.insert(0, d)
        if d in sys.path:
            sys.path.remove(d)
        sys.path.insert(0, d)
    importlib.invalidate_caches()


def search_path() -> list[str]:
    """The directories added so far, first searched first (for a worker's `add_search_path`)."""
    return list(_SEARCH)


def is_reference(name) -> bool:
    return isinstance(name, str) and ":" in name


def modules_named(spec) -> list[str]:
    """The modules of the `module:Name` references in a name or pipeline spec ("nnm+mine:Rule")."""
    if not isinstance(spec, str):
        return []
    return [step.partition(":")[0].strip() for step in spec.split("+") if is_reference(step.strip())]


_LOADED: dict[str, tuple[object, str]] = {}  # module name -> (the module object, its file's digest when first read)


def module_digest(module_name: str) -> str:
    """A short sha256 of the module's own file (a package: its __init__.py) as this process
    loaded it: what a run of a user's class runs here. Read at the first call for the module
    object in sys.modules, and kept while that object is the one loaded (a file edited since
    is `file_digest`'s). Files it imports are not covered."""
    module = importlib.import_module(module_name)
    seen = _LOADED.get(module_name)
    if seen is not None and seen[0] is module:
        return seen[1]
    digest = file_digest(module_name)
    _LOADED[module_name] = (module, digest)
    return digest


def file_digest(module_name: str) -> str:
    """A short sha256 of the module's file as it is on disk now."""
    path = getattr(importlib.import_module(module_name), "__file__", None)
    if path is None:
        return "no file"
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def _load(reference: str, base, what: str):
    """The object `Name` of module `module` for the reference "module:Name", checked against
    `base` (see `resolve`). A ValueError says what is wrong: the form, a missing module or
    name, an import that failed, or an object of the wrong kind."""
    module_name, _, attr = reference.partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"{what} {reference!r}: a reference to your own class is written 'module:Name'")
    # the directories added: a scenario file's, or the working directory where there is none
    where = f"in {', '.join(_SEARCH)} or on sys.path" if _SEARCH else "on sys.path"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise ValueError(f"{what} {reference!r}: no module {module_name!r} {where}") from None
        raise ValueError(f"{what} {reference!r}: importing {module_name!r} failed: {e}") from None
    except Exception as e:  # the user's module raised while importing
        raise ValueError(f"{what} {reference!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {reference!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                             f"has no {attr!r}")
        obj = getattr(obj, part)
    if isinstance(base, (type, tuple)):
        if not (isinstance(obj, type) and issubclass(obj, base)):
            bases = base if isinstance(base, tuple) else (base,)
            kinds = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in bases)
            raise ValueError(f"{what} {reference!r}: {attr} is not a subclass of {kinds}")
    elif (why := base(obj)) is not None:
        raise ValueError(f"{what} {reference!r}: {attr} {why}")
    return obj


def resolve(name, registry: dict, base, what: str):
    """The entry of a catalogue named by `name`: a key of `registry` (matched as written, then
    without surrounding spaces and case), or the object a `module:Name` reference names.

    `base` says what a user's object must be: a class or tuple of classes (the object must be a
    subclass), or a function object -> None (acceptable) or the reason it is not ("is not a
    function data_dir -> Dataset"). `what` names the catalogue in errors ("attack", "norm
    protocol"). Every failure is one ValueError line naming `name` and what is allowed."""
    if is_reference(name):
        return _load(name, base, what)
    if isinstance(name, str):
        for key in (name, name.strip().lower()):
            if key in registry:
                return registry[key]
    raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(registry)} or 'module:Name'")
