"""`robustbn check-aggregator SPEC`: a rule, a pipeline or an attack held to the property kit
(aggregators.testing), then the rule's measured (f, kappa); `--table` measures every rule."""

from __future__ import annotations

from .common import RAW, UsageError, fail_cleanly


def register(sub) -> None:
    p = sub.add_parser("check-aggregator", help="hold an aggregation rule (or an attack) to the property kit",
                       formatter_class=RAW,
                       description="Runs aggregators.testing on SPEC (built-in names, module:Name steps found in the "
                                   "working directory then on sys.path, pipelines like nnm+mymodule:MyRule) over "
                                   "hypothesis-drawn message sets with up to f hostile rows: one line per property "
                                   "(held, failed, not applicable) and the shrunk counterexample of each failure. "
                                   "Then the measured (f, kappa) (robustbn.kappa.measure_kappa): the largest "
                                   "||F(x) - honest mean||^2 / honest spread found by every registered attack on "
                                   "honest sets of five distributions and a search over the Byzantine rows, "
                                   "'unbounded' when it grows without limit with the attack's scale; the attack that "
                                   "reached it, the rule's declared kappa(n, f) and the lower bound f/(n-2f). "
                                   "Exit 0: every applicable property holds; 1: one failed, the declared kappa is "
                                   "below the measured one, or the measured one is above --max-kappa; 2: a usage "
                                   "error.",
                       epilog="examples:\n  robustbn check-aggregator nnm+median\n"
                              "  robustbn check-aggregator myrules:MyTrimmedMean --f 2 --n 9\n"
                              "  robustbn check-aggregator bucketing+krum --param s=2\n"
                              "  robustbn check-aggregator alie --attack\n"
                              "  robustbn check-aggregator myrules:MidRange --max-kappa 10\n"
                              "  robustbn check-aggregator --table --n 10 --f 3")
    p.add_argument("spec", nargs="?")
    p.add_argument("--f", type=int, default=None, help="Byzantine rows the rule is built for (default: drawn, 0-3; "
                                                      "the kappa measurement: 3)")
    p.add_argument("--n", type=int, default=None, help="messages per set (default: drawn, n > 2f; the kappa "
                                                      "measurement: the smallest n >= 10 the rule runs on)")
    p.add_argument("--examples", type=int, default=100, help="message sets per property (default 100)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a parameter of the spec's steps")
    p.add_argument("--attack", action="store_true", help="SPEC is an attack: check its shape, dtype and device, "
                                                        "and that it never writes into the honest messages")
    p.add_argument("--max-kappa", type=float, default=None, metavar="K",
                   help="exit 1 when the measured (f, kappa) is above K (unbounded is above every K)")
    p.add_argument("--table", action="store_true", help="measure every registered rule and the common pipelines "
                                                       "(at --n, --f: default 10, 3): a Markdown table")
    p.add_argument("--d", type=int, default=50, help="coordinates of the kappa measurement's messages (default 50)")
    p.add_argument("--trials", type=int, default=10, help="kappa: honest sets drawn per distribution, every attack "
                                                         "on each (default 10)")
    p.add_argument("--steps", type=int, default=200, help="kappa: generations of the search over the Byzantine "
                                                         "rows, from each of the 5 worst cases (default 200)")
    p.add_argument("--seed", type=int, default=0, help="the seed of a random rule and of every draw of the kappa "
                                                      "measurement (default 0)")
    p.set_defaults(run=cmd_check_aggregator)


def _params(pairs: list[str], reserved: dict[str, str]) -> dict:
    """`--param key=value` of check-aggregator; `reserved`: keys that are options of their own."""
    from ..matrix import parse_override

    params = dict(parse_override(p, "--param", "s=2") for p in pairs)
    for key, option in reserved.items():
        if key in params:
            raise UsageError(f"--param {key}: not a parameter of SPEC; {option}")
    return params


@fail_cleanly
def cmd_check_aggregator(args) -> int:
    """The property kit (aggregators.testing) on a spec: one line per property, the shrunk
    counterexample of each failure; exit 0 when every applicable property holds, 1 if not."""
    from aggregators.plugins import add_search_path
    from aggregators.testing import check

    from ..attack_kit import check_attack

    add_search_path(".")  # `module:Name` steps beside the working directory first
    if args.max_kappa is not None and not args.max_kappa >= 0:  # NaN too
        raise UsageError(f"--max-kappa must be a number >= 0, got {args.max_kappa}")
    for flag, value, low, high in (("--d", args.d, 1, 100_000), ("--trials", args.trials, 1, None),
                                   ("--steps", args.steps, 0, None), ("--seed", args.seed, 0, 2**64 - 1)):
        if value < low or high is not None and value > high:
            raise UsageError(f"{flag} must be an integer {'>= ' + str(low) if high is None else f'in [{low}, {high}]'}"
                             f", got {value}")
    if args.table:
        return _kappa_table(args)
    if args.spec is None:
        raise UsageError("give SPEC (a rule, a pipeline or, with --attack, an attack), or --table")
    if args.f is not None and args.f < 0 or args.n is not None and args.n < 1 or args.examples < 1:
        raise UsageError("--f must be >= 0, --n >= 1 and --examples >= 1")
    if args.f is not None and args.n is not None and 2 * args.f >= args.n:
        raise UsageError(f"--n must be > 2 --f (an honest majority), got f={args.f}, n={args.n}")
    from hypothesis.errors import HypothesisException

    reserved = {"f": "use --f", "examples": "use --examples",
                **({"name": "the attack is SPEC", "pipeline": "the kit attacks a median"} if args.attack else
                   {"n": "use --n", "spec": "the spec is SPEC", "seed": "use --seed", "d": "use --d",
                    "trials": "use --trials", "steps": "use --steps"})}
    params = _params(args.param, reserved)
    try:
        if args.attack:
            outcomes = check_attack(args.spec, f=args.f or 2, examples=args.examples, **params)
        else:
            outcomes = check(args.spec, f=args.f, n=args.n, examples=args.examples, seed=args.seed, **params)
    except HypothesisException as e:
        if "Flaky" in type(e).__name__:  # one input, two answers: state the rule keeps without saying so
            raise UsageError(f"{args.spec}: gave two answers to one input on two calls (hypothesis: "
                             f"{type(e).__name__}); a rule that keeps state across calls declares stateful = True "
                             f"(docs/guide/extending.md), and a random one random = True") from None
        # sizes the kit cannot draw message sets of
        raise UsageError(f"--f {args.f}, --n {args.n}: the property kit cannot draw message sets of this size "
                         f"({type(e).__name__}); try smaller values") from None
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    width = max(len(o.name) for o in outcomes)
    for o in outcomes:
        print(f"{o.name:<{width}}  {o.status}")
        if o.status == "failed":
            print(f"{'':<{width}}    {o.error}")
            print("\n".join(f"{'':<{width}}    {line}" for line in o.counterexample.splitlines()))
    failed = any(o.status == "failed" for o in outcomes)
    if not args.attack:
        import aggregators

        if aggregators.is_stateful(aggregators.build(args.spec, f=args.f or 0, **params)):
            print(f"{'stateful':<{width}}  every property and kappa ran from a fresh state (a first round); its "
                  f"behaviour across rounds, which its state decides, is not measured here")
        failed = not _kappa_line(args, params, width) or failed
    return 1 if failed else 0


def _kappa_sizes(args, spec: str, params: dict) -> tuple[int, int]:
    """n and f of the kappa measurement: as given, else f = 3 (fewer for a small n) and the
    smallest n >= 10 the spec runs on."""
    from aggregators import build

    f = args.f if args.f is not None else 3 if args.n is None else min(3, (args.n - 1) // 2)
    if args.n is not None:
        return args.n, f
    for n in range(max(10, 2 * f + 1), max(10, 2 * f + 1) + 64):
        try:
            build(spec, f=f, n=n, **params)
            return n, f
        except ValueError:
            continue
    return max(10, 2 * f + 1), f


def _kappa_line(args, params: dict, width: int) -> bool:
    """The measured (f, kappa) line of check-aggregator; False when it is a failure (a declared
    kappa below the measured one, a measurement above --max-kappa, or none possible with
    --max-kappa)."""
    from ..kappa import measure_kappa

    n, f = _kappa_sizes(args, args.spec, params)
    label = f"{'measured (f, kappa)':<{width}}  "
    try:
        m = measure_kappa(args.spec, n, f, d=args.d, trials=args.trials, steps=args.steps, seed=args.seed, **params)
    except ValueError as e:
        print(f"{label}not measured: {str(e).splitlines()[0]}")
        return args.max_kappa is None
    except Exception as e:  # a user's rule may raise anything: a failure in one line, never a traceback
        print(f"{label}failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        return False
    print(label + m.summary())
    problems = []
    if m.exceeds_declared:
        problems.append(f"failed: the declared kappa({n}, {f}) = {m.declared:.6g} is below the measured "
                        f"{'unbounded' if m.unbounded else f'{m.kappa:.6g}'}: the claim is false")
    if args.max_kappa is not None and m.kappa > args.max_kappa:
        problems.append(f"failed: above --max-kappa {args.max_kappa:g}")
    for line in problems:
        print(f"{'':<{width}}    {line}")
    if problems:
        import numpy as np
        for name, rows in (("honest rows", m.honest), (f"Byzantine rows (rows {m.positions} of {n})", m.byzantine)):
            print(f"{'':<{width}}    {name}: {np.array2string(rows.numpy(), precision=4, threshold=60)}")
    return not problems


def _kappa_table(args) -> int:
    """check-aggregator --table: the measured kappa of every registered rule and the common
    pipelines, one Markdown row each as it is measured; exit 1 when a declared kappa is below
    the measured one (or a measurement is above --max-kappa)."""
    from ..kappa import TABLE_HEADER, kappa_table, table_row

    if args.spec is not None or args.attack or args.param:
        raise UsageError("--table measures every registered rule: give no SPEC, --attack or --param")
    n = 10 if args.n is None else args.n
    f = (3 if n >= 7 else (n - 1) // 2) if args.f is None else args.f
    if f < 0 or 2 * f >= n:
        raise UsageError(f"--n must be > 2 --f (an honest majority) and --f >= 0, got f={f}, n={n}")
    print(f"n = {n}, f = {f}, d = {args.d}, seed {args.seed}; budget: {args.trials} honest sets per distribution, "
          f"{args.steps} search steps\n")
    print(TABLE_HEADER, flush=True)
    ok = True
    try:
        for spec, m, seconds in kappa_table(n=n, f=f, d=args.d, trials=args.trials, steps=args.steps, seed=args.seed):
            print(table_row(spec, m, seconds), flush=True)
            ok = ok and (isinstance(m, str) or not m.exceeds_declared and
                         (args.max_kappa is None or m.kappa <= args.max_kappa))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0 if ok else 1
