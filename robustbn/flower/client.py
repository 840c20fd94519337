"""The client's half: `ClientBN` (the strategy's BN protocol on a user's plain torch model)
and `LabelFlipping` (a data attack wrapping a ClientApp train function)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.functional as F
from flwr.app import Context, Message
from torch import nn

import attacks

from ..errors import ScenarioError
from ..protocols import get as get_protocol
from ..protocols.base import Protocol
from .layout import CONFIG_MOMENTUM, CONFIG_N, CONFIG_NORM, CONFIG_PHASE, LOCAL_STATE, PARTITION, Layout, _record, _state

class LabelFlipping:
    """A ClientApp train function wrapper (data attack): on a Byzantine node (`byzantine(context)`,
    by default partition ids n - f ... n - 1 of the node_config's num-partitions and the given
    f) every cross-entropy the train function computes sees the labels y flipped to C - 1 - y
    (`attacks` labelflip). Honest nodes run the function unchanged."""

    def __init__(self, train: Callable[[Message, Context], Message], f: int, num_classes: int,
                 byzantine: Callable[[Context], bool] | None = None):
        self.train, self.f, self.num_classes = train, f, num_classes
        self.byzantine = byzantine or (lambda ctx: int(ctx.node_config[PARTITION])
                                       >= int(ctx.node_config["num-partitions"]) - f)

    def __call__(self, msg: Message, context: Context) -> Message:
        if not self.byzantine(context):
            return self.train(msg, context)
        with flipped_labels(self.num_classes):
            return self.train(msg, context)


@contextlib.contextmanager
def flipped_labels(num_classes: int):
    """Within the block, torch's cross-entropy (F.cross_entropy, nn.CrossEntropyLoss) flips
    its integer targets y to C - 1 - y."""
    original = F.cross_entropy
    flip = attacks.build("labelflip").flip

    def flipped(input, target, *args, **kwargs):
        if isinstance(target, torch.Tensor) and not target.is_floating_point():
            target = flip(target, num_classes)
        return original(input, target, *args, **kwargs)
    F.cross_entropy = flipped
    try:
        yield
    finally:
        F.cross_entropy = original


def _plain_layer_protocol(cls: type[Protocol]) -> bool:
    """Whether a protocol runs on torch's own BN layers: no extra parameters (HBN's alpha),
    evaluation as torch's BN in eval mode (not scale-only FBN's), a report that follows every
    step, nothing pooled inside the forward pass."""
    return (cls.uses_bn and not cls.exchanges_in_forward and not cls.union_batch and cls.report_each_step
            and cls.init_layer is Protocol.init_layer and cls.normalize_with_running is Protocol.normalize_with_running)


class ClientBN:
    """A Flower client's half of RobustStrategy's norm protocol, on the client's own torch model
    (nn.BatchNorm1d/2d/3d layers with running statistics):

        bn = ClientBN(model, msg, context)  # the global arrays, and this node's own BN state, loaded
        with bn:                            # the BN layers normalize and report as the protocol says
            train(model, loader)            # the client's own loop, one forward per step
        reply = bn.arrays()                 # what the protocol sends (fedbn: no BN keys)

    The strategy's config in `msg` names the protocol, n, the momentum b and the round's
    phase. Within the block a BN layer in training mode normalizes with the protocol's
    `normalize` (fbn: the shared statistics the server sent, as constants; naive, fixbn's
    first stage, fedbn, silobn: the batch's own), and each forward updates this client's report
    with the protocol's `client_report` (fbn, seed 002 Algorithm 2 lines 5-6: mean (1-b) mu + b
    mean_batch, variance (1-b) var + b Kn/(Kn-1) var_batch, K the values per channel of the
    batch); b is the strategy's bn_momentum, not the layer's own. The running buffers hold what
    the server sent until the block ends, then the report. FixBN after its switch: the layers
    normalize with the frozen statistics and report nothing. Keys the protocol keeps on the
    client (fedbn: the BN weights and statistics; silobn: the statistics) live in
    `context.state` between rounds. Protocols that need robustbn's own layers (hbn, fbn-scale,
    fedtan) are refused with a one-line error naming `norm`.
    """

    def __init__(self, model: nn.Module, msg: Message, context: Context | None = None):
        config = next((c for c in msg.content.config_records.values() if CONFIG_NORM in c), None)
        if config is None:
            raise ValueError(f"ClientBN: the message's config has no {CONFIG_NORM!r}: the server's strategy is not a "
                             f"robustbn.flower.RobustStrategy")
        norm = str(config[CONFIG_NORM])
        cls = get_protocol(norm)
        if not _plain_layer_protocol(cls):
            from ..protocols import PROTOCOLS
            plain = ", ".join(n for n, c in PROTOCOLS.items() if _plain_layer_protocol(c))
            raise ScenarioError("norm", f"{norm!r} needs robustbn's own BN layers (robustbn.models); on a plain torch "
                                        f"model ClientBN runs {plain}")
        self.model, self.context, self.protocol = model, context, cls()
        self.n, self.beta = int(config[CONFIG_N]), float(config[CONFIG_MOMENTUM])
        self.phase = str(config.get(CONFIG_PHASE, "train"))
        self.layout = Layout(model, self.protocol)
        records = list(msg.content.array_records.values())
        if len(records) != 1:
            raise ValueError(f"ClientBN: the message has {len(records)} ArrayRecords; one expected")
        received = _state(records[0])
        self.layout.check(received, "the received arrays", self.layout.weights)
        saved = context.state.array_records.get(LOCAL_STATE) if context is not None else None
        if self.layout.local and context is None:
            raise ValueError(f"ClientBN: norm {norm!r} keeps {self.layout.local[0]!r} on the client between rounds: "
                             f"pass the ClientApp's context")
        if saved is not None:  # this client's own: never the server's
            received = OrderedDict((k, v) for k, v in received.items() if k not in self.layout.local)
            received.update(_state(saved))
        model.load_state_dict(received, strict=False)
        modules = dict(model.named_modules())
        self.layers = {name: modules[name] for name in self.layout.layers}
        self.report: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __enter__(self) -> "ClientBN":
        self.report = {name: (m.running_mean.detach().clone(), m.running_var.detach().clone())
                       for name, m in self.layers.items()}
        for name, layer in self.layers.items():
            layer.forward = self._forward(name, layer)
        return self

    def __exit__(self, *exc) -> None:
        for name, layer in self.layers.items():
            del layer.forward  # the class's own again
            if self.phase == "train":
                with torch.no_grad():
                    layer.running_mean.copy_(self.report[name][0])
                    layer.running_var.copy_(self.report[name][1])
        if self.context is not None and self.layout.local:
            state = self.model.state_dict()
            self.context.state[LOCAL_STATE] = _record({k: state[k] for k in self.layout.local})

    def _forward(self, name: str, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if hasattr(layer, "_check_input_dim"):
                layer._check_input_dim(x)
            if not layer.training or self.phase != "train":
                return self.protocol.normalize_with_running(layer, x)
            out, batch_mean, batch_var = self.protocol.normalize(layer, x)
            count = float(x.numel() // x.shape[1])
            self.report[name] = self.protocol.client_report(*self.report[name], batch_mean, batch_var, count, self.n,
                                                            self.beta)
            if getattr(layer, "num_batches_tracked", None) is not None:
                layer.num_batches_tracked.add_(1)
            return out
        return forward

    def arrays(self) -> ArrayRecord:
        """The model's keys that this protocol sends the server (the report in the running
        buffers; fedbn: no BN keys), as the reply's ArrayRecord."""
        state = self.model.state_dict()
        return _record(OrderedDict((k, v) for k, v in state.items() if k in self.layout.shared))

