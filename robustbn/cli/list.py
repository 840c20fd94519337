"""`robustbn list FILE`: the expanded matrix of a scenario file, without running it."""

from __future__ import annotations

from .common import RAW, channel_columns, fail_cleanly, text_table


def register(sub) -> None:
    p = sub.add_parser("list", help="print the expanded matrix without running it", formatter_class=RAW,
                       epilog="examples:\n  robustbn list scenarios/fbn_fig4_fmnist.toml\n"
                              "  robustbn list scenarios/fbn_fig3_fmnist.toml --set 'seed=[0,1,2]'")
    p.add_argument("file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(run=cmd_list)


@fail_cleanly
def cmd_list(args) -> int:
    from ..channels import expand_channels
    from ..matrix import load
    from ..labels import varying
    from ..store import scenario_hash

    values, scenarios = load(args.file, args.set)
    rows = [{**expand_channels(sc.to_dict()), "hash": scenario_hash(sc.to_dict())} for sc in scenarios]
    columns = channel_columns(rows, (varying(rows) if len(rows) > 1 else []) + ["seed", "hash"])
    if values.get("description"):
        print(values["description"])
    print(text_table(rows, columns))
    print(f"{len(rows)} scenarios")
    return 0
