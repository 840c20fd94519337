"""The `robustbn` command."""

from __future__ import annotations

import argparse
import sys

from . import __version__

DEMO_HELP = """\
Attack x defense on synthetic messages (n = 10 clients, f = 3 Byzantine): the relative
distance between each pipeline's output and the honest mean. 0 is a perfect defense; mean
under any attack shows what an undefended server gets.

examples:
  robustbn demo
  robustbn demo --n 20 --f 4 --spread 2.0 --seed 1
"""


def _demo(args) -> int:
    from .messages import attack_defense_table, format_table

    if not 0 <= 2 * args.f + 2 < args.n:
        print(f"robustbn demo: --f must satisfy 0 <= f and n > 2f + 2 (Krum's bound), "
              f"got n={args.n}, f={args.f}", file=sys.stderr)
        return 2
    print(f"relative error |aggregate - honest mean| / |honest mean|, n={args.n}, f={args.f}, "
          f"d={args.d}, spread={args.spread}, seed={args.seed}\n")
    print(format_table(attack_defense_table(args.n, args.f, args.d, args.spread, args.seed)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="robustbn",
        description="A testbed for Byzantine-robust federated learning with batch normalization.",
        epilog="examples:\n  robustbn demo\n  robustbn --version",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"robustbn {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="attack x defense table on synthetic messages",
                          description=DEMO_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--n", type=int, default=10, help="clients in all (default 10)")
    demo.add_argument("--f", type=int, default=3, help="Byzantine clients (default 3)")
    demo.add_argument("--d", type=int, default=10_000, help="message dimension (default 10000)")
    demo.add_argument("--spread", type=float, default=1.0, help="heterogeneity of honest messages (default 1.0)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
