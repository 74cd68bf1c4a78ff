"""The FedAvg baseline: deterministic MLP, local SGD, and Flower's FedAvg through the in-process Grid.

Oracle: FedAvg's global model after one round is the example-weighted average of the clients' locally
trained models, which we recompute here by calling the client's training directly with the same seeds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Error, Message

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
    # finite in float64 but not in the network's float32: it became inf (checked before the cast)
    with pytest.raises(ValueError, match="'layers.1.weight' has non-finite entries"):
        m.set_arrays({**good, "layers.1.weight": np.full(good["layers.1.weight"].shape, 1e39)})
    assert bool(torch.isfinite(m.layers[1].weight).all())


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


@pytest.mark.parametrize("bad", [{"lr": 0.0}, {"momentum": 1.0}, {"weight_decay": -1.0}, {"epochs": 0},
                                 {"weight_decay": float("inf")}, {"epochs": 2.5}, {"batch_size": 10.5},
                                 {"epochs": True}, {"seed": 1.5}])
def test_sgd_config_guards(bad):
    with pytest.raises(ValueError, match="SGDConfig"):
        SGDConfig(**bad)


@pytest.mark.parametrize("y, match", [(np.array([0.6, 1.0, 0.2, 1.9]), "integer-valued"),
                                      (np.array([0, 1, 2, 1]), r"class indices in \[0, 2\)"),
                                      (np.array([0, 1, 1]), "3 labels for 4 inputs")])
def test_sgd_refuses_labels_the_bnn_path_refuses(y, match):
    """Float labels were truncated by the cast (0.6 -> class 0) and trained on; an out-of-range one failed inside
    cross_entropy."""
    with pytest.raises(ValueError, match=match):
        sgd_epochs(DeterministicMLP(2, [], 2), np.ones((4, 2), np.float32), y, SGDConfig(epochs=1, batch_size=2))


def test_sgd_reads_bool_labels_as_classes_0_and_1_like_the_bnn_path():
    """Problem.tensors reads False / True as classes 0 / 1; sgd_epochs refused them (dtype torch.bool)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2)).astype(np.float32)
    y = x[:, 0] > 0
    traces = []
    for labels in (y, y.astype(np.int64)):
        torch.manual_seed(0)
        traces.append(sgd_epochs(DeterministicMLP(2, [], 2), x, labels, SGDConfig(epochs=3, batch_size=8, seed=1)))
    assert traces[0] == traces[1]


def test_predictions_of_no_points_have_the_class_dimension():
    assert predict_probs(DeterministicMLP(2, [3], 5), np.zeros((0, 2), np.float32)).shape == (0, 5)


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


def test_fedavg_run_is_reproducible_whatever_order_the_replies_come_back_in(tmp_path):
    """Replies come back in whatever order the clients finish; the sum must not depend on it."""
    raw = {**RAW, "num-clients": 4, "min-clients": 4, "num-server-rounds": 2}
    cfg = parse_run_config(raw)
    data = load_full_data(cfg)
    finals, orders = [], set()
    for perm_seed in range(4):
        grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 4} for m in range(4)], raw)
        received: list[int] = []
        rng = np.random.default_rng(perm_seed)

        def shuffled(messages, *, timeout=None, send=grid.send_and_receive, rng=rng, received=received):
            replies = list(send(messages, timeout=timeout))
            replies = [replies[i] for i in rng.permutation(len(replies))]
            received.extend(r.metadata.src_node_id for r in replies)
            return replies

        grid.send_and_receive = shuffled
        run_fedavg(grid, cfg, data, tmp_path / str(perm_seed))
        orders.add(tuple(received))
        with np.load(tmp_path / str(perm_seed) / "model.npz") as z:
            finals.append({k: z[k] for k in z.files})
    assert len(orders) > 1, "the test needs runs whose replies came back in different orders"
    for other in finals[1:]:
        for k, v in finals[0].items():
            np.testing.assert_array_equal(v, other[k])


# --- a round whose clients all failed stops the run (as PGVI's AllClientsFailed) --------------------------------------

def _fail_train_of_round(rnd: int, how: str, nodes: set[int] | None = None):
    """A reply hook: round ``rnd``'s train messages (to ``nodes``, default all) fail as ``how``."""

    def hook(req, reply):
        if (req.metadata.message_type.startswith("train") and int(req.content["config"]["server-round"]) == rnd
                and (nodes is None or req.metadata.dst_node_id in nodes)):
            return [] if how == "lost" else [Message(Error(code=0, reason="Traceback ...\nValueError: client crashed"),
                                                     reply_to=req)]
        return [reply]

    return hook


@pytest.mark.parametrize("how", ["error", "lost"])
def test_a_round_whose_clients_all_failed_stops_the_run_after_recording_it(tmp_path, how):
    """FedAvg.aggregate_train returns (None, None) when no reply is valid: the round was recorded with the previous
    round's client-seconds and epochs, the run went on and wrote summary.json as if every round had trained."""
    from strategies.pgvi import AllClientsFailed

    raw = {**RAW, "num-server-rounds": 3, "round-timeout-s": 1.0}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 2} for m in range(2)], raw,
                         reply_hook=_fail_train_of_round(2, how))
    reason = "client crashed" if how == "error" else "did not reply within round-timeout-s"
    with pytest.raises(AllClientsFailed, match=f"round 2: all 2 client messages failed .*{reason}"):
        run_fedavg(grid, cfg, load_full_data(cfg), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0.0, 1.0, 2.0]
    assert (rows[1]["sent"], rows[1]["applied"], rows[1]["failed"]) == (2.0, 2.0, 0.0)
    assert (rows[2]["sent"], rows[2]["applied"], rows[2]["failed"]) == (2.0, 0.0, 2.0)
    assert not any(k.startswith("client-") for k in rows[2]), rows[2]  # nothing trained: no client figures
    assert rows[2]["test-accuracy"] == rows[1]["test-accuracy"]  # the model is unchanged
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "model.npz").exists()


def test_a_partly_failed_round_counts_its_failures_and_averages_the_valid_replies(tmp_path):
    raw = {**RAW, "num-server-rounds": 2}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 2} for m in range(2)], raw,
                         reply_hook=_fail_train_of_round(2, "error", nodes={1001}))
    rows = run_fedavg(grid, cfg, load_full_data(cfg), tmp_path)
    assert [(r["sent"], r["replied"], r["applied"], r["failed"]) for r in rows[1:]] == [(2, 2, 2, 0), (2, 2, 1, 1)]
    assert rows[2]["client-epochs-mean"] == 2.0 and rows[2]["client-seconds-mean"] == rows[2]["client-seconds-max"]
    assert rows[2]["test-accuracy"] != rows[1]["test-accuracy"]
    assert json.loads((tmp_path / "summary.json").read_text())["final"]["round"] == 2.0


def test_too_few_connected_clients_stop_the_run_after_wait_for_clients_s(tmp_path, monkeypatch):
    """Flower's sample_nodes waits forever for min-clients nodes; the baseline waits wait-for-clients-s."""
    import flwr.serverapp.strategy.strategy_utils as strategy_utils

    from strategies.pgvi import AllClientsFailed

    class WaitedForever(Exception):
        pass

    def sleep(_seconds):  # Flower's waiting loop: it would never end
        raise WaitedForever

    monkeypatch.setattr(strategy_utils, "sleep", sleep)
    raw = {**RAW, "wait-for-clients-s": 0.3}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 2} for m in range(2)], raw)
    grid.remove_node(1001)
    with pytest.raises(AllClientsFailed, match=r"only 1 of the 2 nodes .* wait-for-clients-s=0.3s"):
        run_fedavg(grid, cfg, load_full_data(cfg), tmp_path)
    assert not (tmp_path / "summary.json").exists()


# --- client sampling is reproducible under the run config's seed -----------------------------------------------------

_SAMPLING_RUN = """
import json, sys
from client.fedavg_app import app
from common.config import parse_run_config
from common.problem import load_full_data
from strategies.fedavg_baseline import run_fedavg
from strategies.inprocess import InProcessGrid

raw = json.loads(sys.argv[1])
sent = []
def hook(req, reply):
    if req.metadata.message_type.startswith("train"):
        sent.append([int(req.content["config"]["server-round"]), req.metadata.dst_node_id])
    return [reply]
cfg = parse_run_config(raw)
n = cfg.num_clients
grid = InProcessGrid(app, [{"partition-id": m, "num-partitions": n} for m in range(n)], raw, reply_hook=hook)
rows = run_fedavg(grid, cfg, load_full_data(cfg), sys.argv[2])
print("RESULT " + json.dumps({"sent": sorted(sent), "final": {k: v for k, v in rows[-1].items()
                                                                  if k.startswith("test-")}}))
"""


def _run_in_fresh_interpreter(raw: dict, out, hash_seed: str) -> dict:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONHASHSEED": hash_seed,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SAMPLING_RUN, json.dumps(raw), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_client_sampling_follows_the_run_seed_in_fresh_interpreters(tmp_path):
    """With fraction-train < 1 Flower's FedAvg samples with the OS-seeded ``random`` module: two runs of one run
    config trained different clients and ended at different accuracies."""
    raw = {**RAW, "num-clients": 6, "min-clients": 2, "fraction-train": 0.5, "num-server-rounds": 2,
           "fedavg-local-epochs": 1}
    a = _run_in_fresh_interpreter(raw, tmp_path / "a", "1")
    b = _run_in_fresh_interpreter(raw, tmp_path / "b", "2")
    assert [r for r, _ in a["sent"]] == [1, 1, 1, 2, 2, 2]  # 3 of the 6 clients per round
    assert a == b
    c = _run_in_fresh_interpreter({**raw, "seed": 4}, tmp_path / "c", "1")
    assert c["sent"] != a["sent"]  # another seed, another sample (for these two seeds)


def test_client_sampling_draws_from_the_sorted_node_ids_with_a_per_round_seed():
    from strategies.fedavg_baseline import OrderedFedAvg

    class Nodes:
        def __init__(self, ids):
            self.ids = ids

        def get_node_ids(self):
            return self.ids

    strategy = OrderedFedAvg(fraction_train=0.5, min_train_nodes=2, min_available_nodes=2, seed=7,
                             wait_for_clients_s=0.0)
    ids = [17, 3, 99, 42, 8, 61]
    picks = [strategy.sample_train_nodes(Nodes(ids), r)[0] for r in (1, 2, 3)]
    assert all(len(p) == 3 and p == sorted(p) and set(p) <= set(ids) for p in picks)
    assert [strategy.sample_train_nodes(Nodes(list(reversed(ids))), r)[0] for r in (1, 2, 3)] == picks
    assert len({tuple(p) for p in picks}) > 1  # the rounds draw differently


# --- client-side evaluation: the exact NLL --------------------------------------------------------------------------

def test_client_evaluation_reports_the_exact_nll_not_the_floored_one():
    """The FedAvg client scored its NLL from probabilities floored at 1e-12 (at most 27.6 nats a point), unlike the
    server's log-probability metrics."""
    from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict

    from common.deterministic_mlp import predict_log_probs
    from common.metrics import classification_metrics_from_log_probs

    cfg = parse_run_config(RAW)
    shard = client_shard(cfg, 0)
    torch.manual_seed(0)
    net = DeterministicMLP(shard.x_train.shape[1], cfg.hidden_sizes, shard.num_classes)
    arrays = net.get_arrays()
    last = [k for k in arrays if k.endswith(".weight")][-1]
    net.set_arrays({**arrays, last: arrays[last] * 1e4})  # over-confident: wrong classes get log p << log 1e-12
    expected = classification_metrics_from_log_probs(predict_log_probs(net, shard.x_test), shard.y_test)
    assert expected["nll"] > 100.0

    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 2} for m in range(2)], RAW)
    msg = Message(content=RecordDict({"arrays": ArrayRecord(net.state_dict()), "config": ConfigRecord({})}),
                  dst_node_id=1000, message_type=MessageType.EVALUATE)
    (reply,) = grid.send_and_receive([msg])
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    got = reply.content["metrics"]
    assert got["num-examples"] == len(shard.y_test)
    assert got["nll"] == pytest.approx(expected["nll"], rel=1e-12)
    for k in ("accuracy", "ece", "brier"):
        assert got[k] == pytest.approx(expected[k], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("node_config", "key"), [({"partition-id": 1.9}, "partition-id"),
                                                  ({"partition-id": True}, "partition-id"),
                                                  ({"partition-id": 0, "num-partitions": 2.5}, "num-partitions"),
                                                  ({"partition-id": 0, "torch-threads": 1.5}, "torch-threads")])
def test_a_fractional_or_bool_node_setting_is_refused_not_truncated(node_config, key):
    """As the PGVI client (client/node_request.whole_number): int() alone ran partition 1 for 1.9 and read a
    TOML bool as 1."""
    from types import SimpleNamespace

    from client import fedavg_app
    from common.errors import PGVIError

    context = SimpleNamespace(run_config=dict(RAW), node_config=node_config)
    with pytest.raises(PGVIError, match=f"node config {key} must be a whole number"):
        fedavg_app._setup(None, context)  # the message is read only after the node settings


def test_a_last_step_that_overflows_the_weights_raises_instead_of_sending_them():
    """Each batch's loss is measured before its step: one step of lr 1e37 left inf/NaN weights behind a finite
    loss trace, the server averaged them in and died in its own evaluation (from a review)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32) * 1e3
    y = rng.integers(0, 3, 64)
    torch.manual_seed(0)
    m = DeterministicMLP(5, [4], 3)
    with pytest.raises(FloatingPointError, match="non-finite parameters after the last step: layers.0.weight"):
        sgd_epochs(m, x, y, SGDConfig(lr=1e37, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=64, seed=0))


def test_fedavg_evaluation_reads_bool_labels_like_training():
    """Review of stop 35: sgd_epochs took bool labels, the evaluation metrics refused them (dtype bool)."""
    from common.metrics import classification_metrics_from_log_probs

    lp = torch.log_softmax(torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), dim=-1).numpy()
    y = np.array([False, True, True])
    assert classification_metrics_from_log_probs(lp, y) == classification_metrics_from_log_probs(lp, y.astype(int))
