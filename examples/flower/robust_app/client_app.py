"""The ClientApp: the user's training, with robustbn's ClientBN around it (the client's half of
the strategy's BN protocol: for fbn, normalize with the shared statistics and report Algorithm 2's)."""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from robustbn.flower import ClientBN, LabelFlipping

from .task import Net, load_partition, test, train

app = ClientApp()


def _data(msg: Message, context: Context):
    config = msg.content["config"]
    pid = int(context.node_config["partition-id"])
    return pid, load_partition(pid, int(context.node_config["num-partitions"]), str(config["data-dir"]),
                               int(config["per-client"]))


def local_train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    model = Net()
    bn = ClientBN(model, msg, context)  # the global arrays in, and this node's own BN state (fedbn)
    pid, (x, y, _, _) = _data(msg, context)
    with bn:  # BN layers normalize and update their statistics as the strategy's protocol says
        loss = train(model, x, y, int(config["local-epochs"]), int(config["batch-size"]), float(config["lr"]),
                     seed=1000 * int(config["server-round"]) + pid)
    # partition-id: RobustStrategy takes the replies in this order (a deterministic aggregation)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y), "partition-id": pid})
    return Message(RecordDict({"arrays": bn.arrays(), "metrics": metrics}), reply_to=msg)


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    # the simulation's data attack: the last `byzantine` partitions train on flipped labels
    byzantine = int(msg.content["config"]["byzantine"])
    return LabelFlipping(local_train, f=byzantine, num_classes=10)(msg, context)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    model = Net()
    ClientBN(model, msg, context)  # the global model with this client's BN state where the protocol keeps one
    pid, (_, _, x_test, y_test) = _data(msg, context)
    loss, accuracy = test(model, x_test, y_test)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(y_test)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
