"""The FedAvg baseline: deterministic MLP, local SGD, and Flower's FedAvg through the in-process Grid.

Oracle: FedAvg's global model after one round is the example-weighted average of the clients' locally
trained models, which we recompute here by calling the client's training directly with the same seeds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from client.fedavg_app import app as fedavg_client_app
from common.config import parse_run_config
from common.deterministic_mlp import DeterministicMLP, SGDConfig, predict_probs, sgd_epochs
from common.models import BayesianMLP
from common.problem import client_shard, load_full_data
from strategies.fedavg_baseline import run_fedavg
from strategies.inprocess import InProcessGrid

RAW = {"model": "bnn", "hidden": "16", "dataset": "digits", "num-clients": 2, "min-clients": 2,
       "num-server-rounds": 1, "fedavg-local-epochs": 2, "fedavg-lr": 0.05, "fedavg-batch-size": 64,
       "label-noise": 0.0, "seed": 3}


def test_parameter_names_and_shapes_match_the_bnn():
    det = DeterministicMLP(64, [16, 8], 10)
    bnn = BayesianMLP(64, [16, 8], 10)
    assert {k: tuple(v.shape) for k, v in det.state_dict().items()} == bnn.param_shapes


def test_set_arrays_rejects_wrong_names_shapes_and_non_finite():
    m = DeterministicMLP(4, [3], 2)
    good = m.get_arrays()
    with pytest.raises(ValueError, match="names differ"):
        m.set_arrays({k: v for k, v in good.items() if k != "layers.0.bias"})
    with pytest.raises(ValueError, match="shape"):
        m.set_arrays({**good, "layers.0.bias": np.zeros(4, np.float32)})
    bad = {**good, "layers.1.weight": np.full_like(good["layers.1.weight"], np.nan)}
    with pytest.raises(ValueError, match="non-finite"):
        m.set_arrays(bad)


def test_sgd_learns_and_is_deterministic_under_a_seed():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 5)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        m = DeterministicMLP(5, [8], 2)
        trace = sgd_epochs(m, x, y, SGDConfig(lr=0.1, epochs=15, batch_size=32, seed=7))
        runs.append((trace, m.get_arrays()))
    assert runs[0][0][-1] < 0.5 * runs[0][0][0]
    assert (predict_probs(m, x).argmax(1) == y).mean() > 0.95
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][k], runs[1][1][k])


def test_a_diverging_client_raises_instead_of_sending_nan():
    x = np.ones((10, 2), np.float32) * 1e3
    y = np.zeros(10, np.int64)
    m = DeterministicMLP(2, [], 2)  # w <- w - lr (grad + wd w) with lr * wd >> 1 explodes to inf, then NaN
    with pytest.raises(FloatingPointError, match="loss became"):
        sgd_epochs(m, x, y, SGDConfig(lr=1e30, momentum=0.0, weight_decay=1.0, epochs=3, batch_size=5))


@pytest.mark.parametrize("bad", [{"lr": 0.0}, {"momentum": 1.0}, {"weight_decay": -1.0}, {"epochs": 0}])
def test_sgd_config_guards(bad):
    with pytest.raises(ValueError):
        SGDConfig(**bad)


def test_fedavg_round_is_the_weighted_average_of_the_clients_local_models(tmp_path):
    cfg = parse_run_config(RAW)
    data = load_full_data(cfg)
    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 2} for m in range(2)], RAW)
    history = run_fedavg(grid, cfg, data, tmp_path)

    torch.manual_seed(cfg.seed)
    init = DeterministicMLP(data.x_train.shape[1], cfg.hidden_sizes, data.num_classes).get_arrays()
    models, weights = [], []
    for m in range(2):
        shard = client_shard(cfg, m)
        net = DeterministicMLP(data.x_train.shape[1], cfg.hidden_sizes, data.num_classes)
        net.set_arrays(init)
        sgd_epochs(net, shard.x_train, shard.y_train,
                   SGDConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, epochs=2, batch_size=64,
                             seed=cfg.seed * 100_003 + m * 1_009 + 1))
        models.append(net.get_arrays())
        weights.append(len(shard.y_train))
    with np.load(tmp_path / "model.npz") as z:
        for k in init:
            expected = sum(w * mdl[k].astype(np.float64) for w, mdl in zip(weights, models)) / sum(weights)
            np.testing.assert_allclose(z[k], expected, rtol=1e-5, atol=1e-6)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0.0, 1.0] and history[-1] == rows[-1]
    assert rows[1]["test-accuracy"] > rows[0]["test-accuracy"] + 0.3  # chance is 0.1
    # the clients' local-update time and epochs, under the same column names as the PGVI rows
    assert "client-seconds-mean" not in rows[0]
    assert 0 < rows[1]["client-seconds-mean"] <= rows[1]["client-seconds-max"]
    assert rows[1]["client-epochs-mean"] == rows[1]["client-epochs-max"] == 2.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["method"] == "fedavg" and summary["final"]["round"] == 1.0


def test_fedavg_run_is_reproducible_whatever_order_the_clients_are_sampled_in(tmp_path):
    """Flower's FedAvg samples clients with the unseeded ``random`` module; the sum must not depend on it."""
    import random

    raw = {**RAW, "num-clients": 4, "min-clients": 4, "num-server-rounds": 2}
    cfg = parse_run_config(raw)
    data = load_full_data(cfg)
    finals, orders = [], set()
    for py_seed in range(4):
        random.seed(py_seed)  # changes the order in which FedAvg samples (and so returns) the nodes
        grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 4} for m in range(4)], raw)
        sent = []
        push = grid.push_messages
        grid.push_messages = lambda msgs, push=push, sent=sent: push([sent.append(m.metadata.dst_node_id) or m
                                                                      for m in msgs])
        run_fedavg(grid, cfg, data, tmp_path / str(py_seed))
        orders.add(tuple(sent))
        with np.load(tmp_path / str(py_seed) / "model.npz") as z:
            finals.append({k: z[k] for k in z.files})
    assert len(orders) > 1, "the test needs runs whose clients were sampled in different orders"
    for other in finals[1:]:
        for k, v in finals[0].items():
            np.testing.assert_array_equal(v, other[k])
