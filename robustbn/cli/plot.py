"""`robustbn plot KIND`: curves, heterogeneity, heatmap, worst-case, robustness, map or protocols figures of the results
store (robustbn.plots)."""

from __future__ import annotations

from pathlib import Path

from .common import DEFAULT_DB, RAW, WHERE_HELP, UsageError, check_image_path, check_tuned, fail_cleanly
from .results import add_matrix_option, selected_rows


def register(sub) -> None:
    p = sub.add_parser("plot", help="plot results: curves, heterogeneity, heatmap, worst-case, robustness, map, "
                                    "protocols",
                       formatter_class=RAW,
                       description="curves: accuracy vs round, one line per combination of the fields that vary "
                                   "(seed 002, Figure 4); heterogeneity: final accuracy vs --x (Figure 3a); heatmap: "
                                   "attack x defense final accuracy, one panel per norm mode. Seeds are pooled: the "
                                   "mean, its 95% CI (Student t over seeds) as band, error bar or cell text, and "
                                   "the number of seeds. Lines: a color per norm mode, a line style "
                                   "per defense (mean: solid), a marker per attack; legends in words (\"FBN, SF on the "
                                   "mean, nnm+median (2 seeds)\"), with key=value for any other field that varies. "
                                   "worst-case: defense x norm mode, one panel per other varying setting (f, gamma, ...), each "
                                   "cell the worst accuracy over attacks (seeds pooled) and the worst attack with the "
                                   "channels it hit (\"SF (mean)\"), \"(searched)\" where it came from an attack search's "
                                   "confirmation file (--matrix); see `robustbn results --worst-case`. robustness: "
                                   "one panel per norm mode, a line per defense along --x (gamma, f or alpha): its "
                                   "worst case over the attacks run with its 95% band over seeds, its clean accuracy "
                                   "dashed, a cross where the worst attack's runs diverged. map: which defense to "
                                   "use where, one panel per norm mode and threat model, a cell per (--y, --x): the "
                                   "best defense, or every one tied for best (paired over seeds). protocols: which "
                                   "BN protocol along --x (gamma or f), a panel per threat model, a line per "
                                   "protocol at its highest defense at each point (named where it changes).",
                       epilog="examples:\n  robustbn plot curves --where gamma=0.0 --out results/fig4.png\n"
                              "  robustbn plot heterogeneity --where f=0 --out results/fig3a.png\n"
                              "  robustbn plot heatmap --where gamma=0.0 --out results/heatmap.png\n"
                              "  robustbn plot worst-case --out results/worst.png\n"
                              "  robustbn plot robustness --x gamma --where 'norm=[fbn,naive]' --out results/gamma.png\n"
                              "  robustbn plot map --x gamma --y f --out results/map.png\n"
                              "  robustbn plot protocols --x gamma --tuned lr --out results/protocols.png\n"
                              "  robustbn plot worst-case --matrix scenarios/worst_case_fmnist.toml --matrix "
                              "scenarios/searched_worst_fbn_dnc.toml --where gamma=0.0 --out results/worst.png")
    p.add_argument("kind", choices=["curves", "heterogeneity", "heatmap", "worst-case", "robustness", "map",
                                    "protocols"])  # KINDS
    p.add_argument("--out", required=True)
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help=WHERE_HELP)
    add_matrix_option(p)
    p.add_argument("--x", default="gamma", help="x axis of the heterogeneity plot (default gamma; e.g. alpha) and of "
                                                "the robustness plot (gamma, f or alpha)")
    p.add_argument("--y", default="f", help="y axis of the map (gamma, f or alpha; default f)")
    p.add_argument("--title", default=None)
    p.add_argument("--tuned", action="append", default=[], metavar="FIELD",
                   help="robustness and map: a field each defense ran at its own tuned value of (robustbn tune; "
                        "e.g. --tuned lr): it belongs to the defense, and each point is labelled with it")
    p.set_defaults(run=cmd_plot)


@fail_cleanly
def cmd_plot(args) -> int:
    from ..matrix import FIELDS
    from ..plots import ROBUSTNESS_X, plot
    from ..store import Store

    check_image_path(args.out)
    if args.kind == "heterogeneity" and args.x not in FIELDS:
        raise UsageError(f"--x {args.x}: not a scenario field; allowed: {', '.join(sorted(FIELDS))}")
    if args.kind == "robustness" and args.x not in ROBUSTNESS_X:
        raise UsageError(f"--x {args.x}: a robustness curve runs along one of {', '.join(ROBUSTNESS_X)}")
    if args.kind == "map" and (args.x not in ROBUSTNESS_X or args.y not in ROBUSTNESS_X or args.x == args.y):
        raise UsageError(f"--x {args.x} --y {args.y}: the map's axes are two different fields of "
                         f"{', '.join(ROBUSTNESS_X)}")
    if args.kind == "protocols" and args.x not in ("gamma", "f"):
        raise UsageError(f"--x {args.x}: protocols are compared along gamma or f")
    check_tuned(args.tuned, args.kind in ("robustness", "map", "protocols"), "robustness, map and protocols plots")
    with Store(args.db, readonly=True) as store:
        rows = selected_rows(store, args.where, matrices=args.matrix, note=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(rows, args.kind, args.out, args.title, args.x, args.y, args.tuned)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(args.out)
    return 0
