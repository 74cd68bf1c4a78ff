"""The FedAvg baseline after a review (stop-30): malformed and duplicated train replies, the number of clients a
round trains, and the network of each model.

Oracle for the reply checks: a run in which one client's reply was tampered with must end with exactly the model of
a run in which that reply was simply lost (the honest clients' average, summed by Flower's own code), and record
the reply as rejected and its node as failed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from client.fedavg_app import app as fedavg_client_app
from common.config import ConfigError, parse_run_config
from common.problem import load_full_data
from strategies import fedavg_baseline
from strategies.fedavg_baseline import run_fedavg
from strategies.inprocess import InProcessGrid
from strategies.pgvi import AllClientsFailed

ROOT = Path(__file__).resolve().parents[1]
RAW = {"model": "bnn", "hidden": "16", "dataset": "digits", "num-clients": 3, "min-clients": 3,
       "num-server-rounds": 2, "fedavg-local-epochs": 1, "fedavg-lr": 0.05, "fedavg-batch-size": 64,
       "label-noise": 0.0, "seed": 3, "torch-threads": 1}


def _run(out: Path, raw: dict | None = None, hook=None) -> list[dict]:  # noqa: ANN001
    raw = raw or RAW
    cfg = parse_run_config(raw)
    n = cfg.num_clients
    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": n} for m in range(n)], raw,
                         reply_hook=hook)
    return run_fedavg(grid, cfg, load_full_data(cfg), out)


def _model(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "model.npz") as z:
        return {k: z[k].copy() for k in z.files}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _tamper(kind: str, bad: int):
    """A reply hook: node ``bad``'s (``-1``: every node's) train replies are rebuilt with the defect ``kind`` (as
    the review's reproduction, malformed.py)."""

    def hook(req: Message, reply: Message) -> list[Message]:
        if reply.has_error() or (bad != -1 and reply.metadata.src_node_id != bad):
            return [reply]
        c = reply.content
        arrs = {k: v.numpy().copy() for k, v in c["arrays"].items()}
        met = dict(c["metrics"])
        extra_records: dict = {}
        if kind == "nan-array":
            arrs["layers.0.weight"][0, 0] = np.nan
        elif kind == "inf-array":
            arrs["layers.1.weight"][3, 2] = -np.inf
        elif kind == "bias-shape1":  # the last layer's bias (10,) -> (1,)
            arrs["layers.1.bias"] = arrs["layers.1.bias"][:1]
        elif kind == "transposed":
            arrs["layers.1.weight"] = np.ascontiguousarray(arrs["layers.1.weight"].T)
        elif kind == "missing-array":
            arrs.pop("layers.0.bias")
        elif kind == "extra-array":
            arrs["layers.2.weight"] = np.zeros((3, 3), np.float32)
        elif kind == "int-array":
            arrs["layers.0.bias"] = arrs["layers.0.bias"].astype(np.int64)
        elif kind == "two-arrayrecords":
            extra_records["more"] = ArrayRecord({"x": Array(np.zeros(2, np.float32))})
        elif kind == "missing-weight":
            met.pop("num-examples")
        elif kind == "missing-loss":
            met.pop("train-loss")
        elif kind == "extra-metric":
            met["extra"] = 1.0
        elif kind in ("neg-weight", "zero-weight", "huge-weight", "fractional-weight", "nan-weight"):
            met["num-examples"] = {"neg-weight": -100, "zero-weight": 0, "huge-weight": 1e300,
                                   "fractional-weight": 2.5, "nan-weight": float("nan")}[kind]
        elif kind == "nan-seconds":
            met["client-seconds"] = float("nan")
        elif kind == "nan-epochs":
            met["epochs"] = float("nan")
        elif kind == "inf-epochs":
            met["epochs"] = float("inf")
        elif kind == "nan-loss":
            met["train-loss"] = float("nan")
        else:
            raise AssertionError(kind)
        new = Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrs.items()}),
                                  "metrics": MetricRecord(met), **extra_records}), reply_to=req)
        new.metadata.__dict__["_src_node_id"] = reply.metadata.src_node_id
        return [new]

    return hook


def _lose(bad: int):
    return lambda req, reply: [] if reply.metadata.src_node_id == bad else [reply]


@pytest.fixture(scope="module")
def lost_runs(tmp_path_factory) -> dict[int, dict[str, np.ndarray]]:
    """The final model of a run in which node ``bad``'s every train reply was lost, by ``bad`` (computed once)."""

    class Lazy(dict):
        def __missing__(self, bad: int) -> dict[str, np.ndarray]:
            out = tmp_path_factory.mktemp(f"lost-{bad}")
            _run(out, hook=_lose(bad))
            self[bad] = _model(out)
            return self[bad]

    return Lazy()


@pytest.fixture
def warnings_logged(monkeypatch) -> list[str]:
    got: list[str] = []
    original = fedavg_baseline.log

    def spy(level, msg, *args):  # noqa: ANN001
        if level >= 30:
            got.append(msg % args if args else msg)
        original(level, msg, *args)

    monkeypatch.setattr(fedavg_baseline, "log", spy)
    return got


MALFORMED = [("nan-array", 1000), ("inf-array", 1001), ("bias-shape1", 1002), ("transposed", 1000),
             ("missing-array", 1000), ("extra-array", 1001), ("int-array", 1000), ("two-arrayrecords", 1000),
             ("missing-weight", 1000), ("missing-loss", 1001), ("extra-metric", 1000), ("neg-weight", 1000),
             ("zero-weight", 1000), ("huge-weight", 1000), ("fractional-weight", 1001), ("nan-weight", 1000),
             ("nan-seconds", 1000), ("nan-epochs", 1002), ("inf-epochs", 1000), ("nan-loss", 1001)]


@pytest.mark.parametrize(("kind", "bad"), MALFORMED)
def test_a_malformed_reply_is_left_out_as_if_it_had_been_lost(tmp_path, lost_runs, warnings_logged, kind, bad):
    """Before: NaN/inf arrays were averaged in (the server then died in its own evaluation), a wrong shape, a
    missing or extra array or metric crashed the run in Flower's aggregation, num-examples -100 / 1e300 / 2.5
    weighted the average with it, and NaN seconds/epochs/loss went into metrics.jsonl (as null: ``experiments.py
    report`` then crashed)."""
    from scripts.experiments import summarise

    rows = _run(tmp_path, hook=_tamper(kind, bad))
    got, want = _model(tmp_path), lost_runs[bad]
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert got[k].dtype == want[k].dtype
    recorded = _rows(tmp_path)
    assert recorded == rows and [r["round"] for r in rows] == [0.0, 1.0, 2.0]
    for r in rows[1:]:
        assert (r["sent"], r["replied"], r["applied"], r["rejected"], r["failed"]) == (3, 3, 2, 1, 1)
        assert r["client-epochs-mean"] == r["client-epochs-max"] == 1.0
    for r in recorded:  # nothing non-finite (NaN is written as null) reaches the records
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in r.values() if not isinstance(v, str)), r
    assert summarise(tmp_path) is not None  # the experiment report reads the run
    mine = [w for w in warnings_logged if f"node {bad} rejected" in w]
    assert [w.split(":")[0] for w in mine] == ["round 1", "round 2"], warnings_logged


def test_every_reply_malformed_stops_the_run_with_the_rejection_as_reason(tmp_path):
    with pytest.raises(AllClientsFailed, match=r"round 1: all 3 client messages failed \(last reason: node 1002: "
                                               r"reply rejected: array 'layers.0.weight' has non-finite entries\)"):
        _run(tmp_path, hook=_tamper("nan-array", -1))
    rows = _rows(tmp_path)
    assert (rows[1]["applied"], rows[1]["rejected"], rows[1]["failed"]) == (0.0, 3.0, 3.0)
    assert not any(k.startswith("client-") for k in rows[1])
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("second", ["same", "tampered"])
def test_a_duplicated_reply_is_averaged_once(tmp_path, second):
    """Before: Flower's FedAvg averaged both copies, giving that client twice its weight."""
    _run(tmp_path / "plain")

    def dup(req, reply):  # noqa: ANN001
        if reply.metadata.src_node_id != 1001:
            return [reply]
        if second == "same":
            return [reply, reply]
        return [reply, _tamper("nan-array", 1001)(req, reply)[0]]

    rows = _run(tmp_path / "dup", hook=dup)
    plain, got = _model(tmp_path / "plain"), _model(tmp_path / "dup")
    for k in plain:
        np.testing.assert_array_equal(got[k], plain[k], err_msg=k)
    for r in rows[1:]:
        assert (r["sent"], r["replied"], r["applied"], r["rejected"], r["failed"]) == (3, 4, 3, 1, 0)


# --- the number of clients a round trains: PGVI's rule ----------------------------------------------------------------

class _Nodes:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_node_ids(self) -> list[int]:
        return self.ids


@pytest.mark.parametrize(("fraction", "n", "min_clients", "k"),
                         [(0.5, 3, 1, 2), (0.5, 5, 1, 3), (0.2, 5, 3, 1), (0.34, 3, 1, 1), (1.0, 4, 2, 4)])
def test_a_round_samples_clients_per_round_of_the_connected_nodes(fraction, n, min_clients, k):
    """Flower's FedAvg samples int(n f) floored, at least min_train_nodes: 0.5 of 3 trained 1 client where PGVI
    trains 2, and min-clients 3 made fraction-train 0.2 of 5 train 3."""
    from common.config import clients_per_round
    from strategies.fedavg_baseline import OrderedFedAvg

    assert clients_per_round(fraction, n) == k
    strategy = OrderedFedAvg(fraction_train=fraction, min_train_nodes=min_clients, min_available_nodes=min_clients,
                             seed=0, wait_for_clients_s=0.0)
    sampled, connected = strategy.sample_train_nodes(_Nodes(list(range(10, 10 + n))), 1)
    assert len(sampled) == k and len(connected) == n


def test_min_clients_still_gates_the_round(tmp_path):
    from strategies.fedavg_baseline import OrderedFedAvg

    strategy = OrderedFedAvg(fraction_train=0.2, min_train_nodes=4, min_available_nodes=4, seed=0,
                             wait_for_clients_s=0.0)
    with pytest.raises(AllClientsFailed, match="only 3 of the 4 nodes"):
        strategy.sample_train_nodes(_Nodes([1, 2, 3]), 1)


def test_fraction_train_half_of_three_trains_two_clients_per_round(tmp_path):
    sent: list[tuple[int, int]] = []

    def hook(req, reply):  # noqa: ANN001
        sent.append((int(req.content["config"]["server-round"]), req.metadata.dst_node_id))
        return [reply]

    rows = _run(tmp_path, {**RAW, "fraction-train": 0.5, "min-clients": 1}, hook=hook)
    assert [r for r, _ in sent] == [1, 1, 2, 2]
    assert [(r["sent"], r["applied"]) for r in rows[1:]] == [(2, 2), (2, 2)]


# --- the network: the deterministic counterpart of the run's model ----------------------------------------------------

def test_logistic_regression_trains_a_linear_model(tmp_path):
    """Before: the baseline built an MLP from `hidden` whatever the model (pyproject's hidden = 50 gave
    64-50-10 for model logistic_regression)."""
    from common.deterministic_mlp import baseline_hidden_sizes

    raw = {**RAW, "model": "logistic_regression", "num-server-rounds": 1}
    assert baseline_hidden_sizes(parse_run_config(raw)) == []
    assert baseline_hidden_sizes(parse_run_config(RAW)) == [16]
    rows = _run(tmp_path, raw)
    assert {k: v.shape for k, v in _model(tmp_path).items()} == {"layers.0.weight": (10, 64), "layers.0.bias": (10,)}
    assert rows[1]["test-accuracy"] > 0.5  # chance is 0.1


REGRESSION = [("linear_regression", "synthetic_linear_regression"),
              ("gaussian_location", "synthetic_gaussian_location")]


@pytest.mark.parametrize(("model", "dataset"), REGRESSION)
def test_a_regression_model_is_a_config_error_naming_model(tmp_path, model, dataset):
    raw = {**RAW, "model": model, "dataset": dataset}
    cfg = parse_run_config(raw)
    with pytest.raises(ConfigError, match="model: the FedAvg baseline trains a classifier"):
        run_fedavg(InProcessGrid(fedavg_client_app, [], raw), cfg, load_full_data(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    from client import fedavg_app

    context = SimpleNamespace(run_config=raw, node_config={"partition-id": 0, "num-partitions": 3})
    with pytest.raises(ConfigError, match="model"):
        fedavg_app._setup(None, context)


def test_run_inprocess_refuses_a_regression_model_in_one_line(tmp_path):
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_inprocess.py"), "--method", "fedavg",
                           "-c", 'model="linear_regression"', "-c", 'dataset="synthetic_linear_regression"',
                           "-c", "label-noise=0.0", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode in (1, 2), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("run_inprocess.py: invalid run config: model:"), proc.stderr


def test_experiments_refuses_a_fedavg_plan_with_a_regression_model_before_any_run(tmp_path, monkeypatch, capsys):
    from scripts import experiments as E
    from tests.test_experiments_robustness import _stand_in

    monkeypatch.setattr(E, "RUNS", tmp_path / "runs")
    calls: list[str] = []
    monkeypatch.setattr(E.subprocess, "call", _stand_in(calls))
    with pytest.raises(SystemExit, match="invalid run config.*nothing was run"):
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "--methods", "pvi", "fedavg",
                "-c", 'model="linear_regression"', "-c", 'dataset="synthetic_linear_regression"'])
    assert calls == []
    err = capsys.readouterr().err
    assert "model: the FedAvg baseline trains a classifier" in err and "(run fedavg-noise40-seed0)" in err
    assert "pvi-noise40-seed0" not in err  # PGVI runs regression models
    runs = E.fmnist_noise_runs(["fedavg"], [0.4], [0])
    runs[0].config["model"] = "logistic_regression"
    assert E.invalid_configs(runs) == []


def test_a_float64_reply_is_not_averaged_in(tmp_path, lost_runs):
    """A float64 reply first in node order made the round's average (and the next round's model) float64."""
    def as_float64(req, reply):
        if reply.has_error() or reply.metadata.src_node_id != 1000:
            return [reply]
        new = Message(RecordDict({"arrays": ArrayRecord({k: Array(v.numpy().astype(np.float64))
                                                         for k, v in reply.content["arrays"].items()}),
                                  "metrics": reply.content["metrics"]}), reply_to=req)
        new.metadata.__dict__["_src_node_id"] = 1000
        return [new]

    _run(tmp_path, hook=as_float64)
    final, lost = _model(tmp_path), lost_runs[1000]
    assert all(final[k].dtype == np.float32 and np.array_equal(final[k], lost[k]) for k in lost)


def test_a_reply_from_a_node_the_round_did_not_sample_is_not_averaged_in(tmp_path):
    """fraction-train 0.5 of 3: 2 nodes sampled; a copy of a sampled node's reply posing as the third node's was
    averaged in as if that node had been asked."""
    raw = {**RAW, "fraction-train": 0.5, "min-clients": 1}
    sampled: list[int] = []

    def pose_as_another_node(req, reply):
        sampled.append(reply.metadata.src_node_id)
        if reply.has_error() or len(sampled) % 2:
            return [reply]
        other = next(n for n in (1000, 1001, 1002) if n not in sampled[-2:])
        forged = Message(RecordDict({"arrays": reply.content["arrays"], "metrics": reply.content["metrics"]}),
                         reply_to=req)
        forged.metadata.__dict__["_src_node_id"] = other
        return [reply, forged]

    _run(tmp_path, raw, hook=pose_as_another_node)
    rows = [r for r in _rows(tmp_path) if r["round"] >= 1]
    assert [(r["sent"], r["applied"], r["rejected"]) for r in rows] == [(2, 2, 1)] * 2
