"""Golden histories of short runs, one per norm protocol and algorithm, so that a refactor of
the protocols (one file each) can be checked to change nothing. Written by running this file
(`python tests/protocol_histories.py`, which overwrites tests/data/protocol_histories.json),
compared within float32 rounding by tests/test_protocol_histories.py, and bit for bit on the
machine that recorded them by `python tests/protocol_histories.py --check`. Recorded on the
project's CPU machine with the torch its pip constraint installs (2.14.1): other builds differ
in the last float32 digits."""

import json
from pathlib import Path

import torch

import robustbn
from robustbn.protocols import PROTOCOLS

PATH = Path(__file__).parent / "data" / "protocol_histories.json"


def scenarios():
    for norm, protocol in PROTOCOLS.items():
        for algorithm in ("dsgd", "fedavg"):
            values = dict(dataset="synthetic-images", model="simple-cnn", norm=norm, algorithm=algorithm, n=5, f=1,
                          rounds=6, eval_every=3, batch_size=8, lr=0.05, momentum=0.5, weight_decay=1e-3,
                          partition="gamma", gamma=0.0, grad_attack="alie", grad_agg="nnm+trmean",
                          bn_mean_attack="sf", bn_var_attack="honest", bn_agg="nnm+median", seed=3,
                          fixbn_switch=3)
            if algorithm == "fedavg":
                values.update(local_steps=2, participation=0.75)
            if protocol.union_batch:  # the attack-free reference
                values.update(f=0, grad_attack="none", bn_mean_attack="none", bn_var_attack="none")
            if not protocol.sends_statistics:
                values.update(bn_mean_attack="none", bn_var_attack="none")
            yield f"{norm}-{algorithm}", values


def record(only=None) -> dict:
    """{protocol-algorithm: history and per-layer sums of the final statistics}, of `only` those names."""
    torch.set_num_threads(1)
    out = {}
    for name, values in scenarios():
        if only is not None and name not in only:
            continue
        result = robustbn.run(values)
        out[name] = {"history": result.history,
                     "bn_stats": {layer: {k: sum(v) for k, v in stats.items()} for layer, stats in result.bn_stats.items()}}
    return out


if __name__ == "__main__":
    import sys

    if "--check" in sys.argv:  # the recorded protocols only
        recorded = json.loads(PATH.read_text())
        now = json.loads(json.dumps(record(only=set(recorded))))
        differ = sorted(name for name in recorded if now.get(name) != recorded[name])
        print(f"differ from {PATH}: {', '.join(differ)}" if differ else "bit for bit as recorded")
        sys.exit(1 if differ else 0)
    PATH.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
    print(PATH)
