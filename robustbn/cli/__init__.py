"""The `robustbn` command: run scenario matrices, inspect and plot results, the demo.

One module per command, beside this entry point: `robustbn/cli/<name>.py` holds the
command's parser (help, description, examples) and the function it runs. The contract:

- the module defines `register(sub)`, which adds its parser with `sub.add_parser(NAME, ...,
  formatter_class=common.RAW)` and ends with `p.set_defaults(run=FUNCTION)`; FUNCTION takes
  the parsed arguments and returns the exit status, and is wrapped in `common.fail_cleanly`
  so that a user error prints one line, `robustbn NAME: ...`, and returns 2;
- the module imports torch, the store and the engine inside FUNCTION, not at its top:
  `robustbn --help` stays quick;
- its name goes into COMMANDS below, which is the order of `robustbn --help`.

Shared helpers (the usage error, the parser class, `--where`, the text table) are in `common`.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from .. import __version__
from .common import Parser
from .demo import DEMO_TOML

__all__ = ["COMMANDS", "DEMO_TOML", "build_parser", "main"]

# module names under robustbn/cli/ (`import_`: `import` is a keyword), in the order of --help
COMMANDS = ("run", "flower", "attack_search", "evaluate", "tune", "merge", "import_", "list", "results", "plot", "report", "check_aggregator",
            "toy", "demo")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="robustbn", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A testbed for Byzantine-robust federated learning with batch normalization.",
        epilog="examples:\n  robustbn demo\n  robustbn list scenarios/fbn_fig4_fmnist.toml\n"
               "  robustbn run scenarios/fbn_fig4_fmnist.toml --set seed=[0,1] --jobs 2\n"
               "  robustbn results --format csv > results.csv\n"
               "  robustbn import results.csv --db results/copy.sqlite\n"
               "  robustbn plot heatmap --out results/heatmap.png\n  robustbn toy --out results/toy.png")
    ap.add_argument("--version", action="version", version=f"robustbn {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    ap.commands = sub.choices  # name -> subparser: main() reports an unknown option by its command's parser
    for name in COMMANDS:
        import_module(f"{__name__}.{name}").register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:  # --help, --version and usage errors end parsing with SystemExit: their status is ours
        args, unknown = ap.parse_known_args(argv)
        if unknown:
            ap.commands.get(args.command, ap).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    if args.command is None:
        ap.print_help()
        return 0
    try:
        return args.run(args)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a run: stop at once, quietly
        print(f"robustbn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `robustbn results | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
