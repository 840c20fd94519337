"""robustbn in Flower (flwr >= 1.42, Message API): per-channel robust aggregation with correct BN
handling as a Flower strategy, and any FedAvg scenario run as a Flower simulation.

- `RobustStrategy` (strategy.py): a `flwr.serverapp.strategy.FedAvg` whose `aggregate_train`
  splits every reply's ArrayRecord by key into robustbn's channels (the model update, the BN
  running means, the BN running variances; `num_batches_tracked` advanced by the median
  step), from the model and the norm protocol (`layout.py`), and runs the engine's own server
  step on them (`Federation.server_only(...)._exchange`: each channel's pipeline, the client
  filter, the protocol's `server_stats`). One implementation of each rule and protocol. Any
  model (no BN layers: naive, none, gn, fedwon); the BN channels follow grad_agg by default;
  a reply that is not one of the model's states is left out with one log line.
- `SimulatedAttacks` (strategy.py): a simulation of the threat model, not something a real client could do:
  the Byzantine nodes' replies are replaced by each channel's omniscient attack computed from
  the honest replies, as robustbn's engine does.
- `LabelFlipping` (client.py): a ClientApp train function wrapper: Byzantine nodes train on flipped labels.
- `ClientBN` (client.py): the client's half of the strategy's protocol on a user's plain torch model
  (fbn: normalize with the shared statistics, report Algorithm 2's; fedbn: BN kept in
  context.state).
- `run_scenario(sc)` (simulation.py): a robustbn FedAvg scenario as a Flower simulation (`robustbn flower`),
  the clients computing with the engine's own client half (`Federation.local_round`).

Nothing else in robustbn imports flwr: `pip install 'robustbn[flower]'`.
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning on CPU-only nodes

from ..protocols import get as get_protocol  # noqa: E402,F401  (kept: robustbn.flower.get_protocol)
from .client import ClientBN, LabelFlipping, flipped_labels  # noqa: E402
from .layout import (ATTACK_FIELDS, CONFIG_MOMENTUM, CONFIG_N, CONFIG_NORM, CONFIG_PHASE, LOCAL_MEAN,  # noqa: E402
                     LOCAL_STATE, LOCAL_VAR, LOSSES, PARTITION, SERVER_FIELDS, Layout)
from .simulation import _federation, check_scenario, client_app, initial_arrays, run_scenario, server_app  # noqa: E402
from .strategy import RobustStrategy, SimulatedAttacks  # noqa: E402

__all__ = ["ATTACK_FIELDS", "CONFIG_MOMENTUM", "CONFIG_N", "CONFIG_NORM", "CONFIG_PHASE", "ClientBN", "LOCAL_MEAN",
           "LOCAL_STATE", "LOCAL_VAR", "LOSSES", "LabelFlipping", "Layout", "PARTITION", "RobustStrategy",
           "SERVER_FIELDS", "SimulatedAttacks", "check_scenario", "client_app", "flipped_labels", "initial_arrays",
           "run_scenario", "server_app"]
