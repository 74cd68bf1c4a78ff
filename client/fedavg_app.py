"""FedAvg baseline ClientApp: the deterministic counterpart of the run's model, trained with local SGD.

The network is :func:`common.deterministic_mlp.baseline_hidden_sizes`'s: the BNN's hidden sizes for ``model =
"bnn"``, none (multinomial logistic regression) for ``"logistic_regression"``; other models are refused.

Same run config, same data path (``common.problem.client_shard``: partitioner, label noise) and same
node config (``partition-id``, ``torch-threads``) as the PGVI ClientApp, so the baseline differs from
PVI/FedGVI only in the method.  Served by Flower's own ``FedAvg`` strategy (``server/fedavg_app.py``).
"""

from __future__ import annotations

import time
from functools import lru_cache

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.node_request import node_partition_id, whole_number
from common.config import RunConfig, parse_run_config
from common.deterministic_mlp import DeterministicMLP, SGDConfig, baseline_hidden_sizes, predict_log_probs, sgd_epochs
from common.metrics import classification_metrics_from_log_probs
from common.problem import ArraysSplit, client_shard
from common.protocol import FEDAVG_TRAIN_METRICS
from common.runtime import configure_threads, subnormals_flushed

app = ClientApp()


@lru_cache(maxsize=8)
def _shard(cfg: RunConfig, partition_id: int) -> ArraysSplit:
    return client_shard(cfg, partition_id)


def _setup(msg: Message, context: Context) -> tuple[RunConfig, int, ArraysSplit, DeterministicMLP]:
    cfg = parse_run_config(dict(context.run_config))
    nc = context.node_config
    # as the PGVI client (client/node_request.py): a federation of the wrong size would silently drop partitions
    # (whole numbers: int() alone read 1.9 as partition 1 and a TOML bool as 1 / 0)
    if "num-partitions" in nc and whole_number(nc, "num-partitions", 0) != cfg.num_clients:
        raise ValueError(f"node config num-partitions={nc['num-partitions']} disagrees with run config "
                         f"num-clients={cfg.num_clients}")
    partition_id = node_partition_id(nc, cfg.num_clients)
    configure_threads(whole_number(nc, "torch-threads", cfg.torch_threads or 1))
    hidden = baseline_hidden_sizes(cfg)  # ConfigError for a model that is not a classifier
    shard = _shard(cfg, partition_id)
    model = DeterministicMLP(shard.x_train.shape[1], hidden, shard.num_classes)
    model.set_arrays({k: v.numpy() for k, v in msg.content["arrays"].to_torch_state_dict().items()})
    return cfg, partition_id, shard, model


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, partition_id, shard, model = _setup(msg, context)
    rnd = int(msg.content["config"].get("server-round", 0)) if "config" in msg.content else 0  # set by FedAvg
    sgd = SGDConfig(lr=cfg.fedavg_lr, momentum=cfg.fedavg_momentum, weight_decay=cfg.fedavg_weight_decay,
                    epochs=cfg.fedavg_local_epochs, batch_size=cfg.fedavg_batch_size,
                    seed=cfg.seed * 100_003 + partition_id * 1_009 + rnd)
    start = time.perf_counter()
    with subnormals_flushed():
        trace = sgd_epochs(model, shard.x_train, shard.y_train, sgd)
    seconds = time.perf_counter() - start
    values = {"num-examples": len(shard.y_train), "train-loss": trace[-1], "client-seconds": seconds,
              "epochs": float(len(trace))}
    metrics = MetricRecord({k: values[k] for k in FEDAVG_TRAIN_METRICS})  # exactly the keys the server accepts
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, shard, model = _setup(msg, context)
    out = {"num-examples": float(len(shard.y_test))}
    if len(shard.y_test):
        with subnormals_flushed():
            # the exact NLL from the log-probabilities (the server's metrics): not floored at 1e-12
            out.update(classification_metrics_from_log_probs(predict_log_probs(model, shard.x_test), shard.y_test))
    return Message(RecordDict({"metrics": MetricRecord(out)}), reply_to=msg)
