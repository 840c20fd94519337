"""`robustbn toy`: seed 002's Figures 1 and 2, the normalization experiment (robustbn.toy)."""

from __future__ import annotations

from pathlib import Path

from .common import RAW, UsageError, check_image_path, fail_cleanly


def register(sub) -> None:
    p = sub.add_parser("toy", help="seed 002's Figures 1 and 2: the normalization experiment", formatter_class=RAW,
                       epilog="examples:\n  robustbn toy --out results/toy.png")
    p.add_argument("--out", default="results/toy.png")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_toy)


@fail_cleanly
def cmd_toy(args) -> int:
    from ..plots import toy_figure
    from ..scenario import MAX_SEED

    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be an integer >= 0 and <= {MAX_SEED}, got {args.seed}")
    check_image_path(args.out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    errors = toy_figure(args.out, seed=args.seed)
    print("normalization error vs centralized BN (seed 002, Figure 2c):")
    print("gamma   " + "".join(f"{g:>8}" for g in errors["gammas"]))
    for mode, values in errors["norm_error"].items():
        print(f"{mode:<8}" + "".join(f"{v:>8.3f}" for v in values))
    print(args.out)
    return 0
