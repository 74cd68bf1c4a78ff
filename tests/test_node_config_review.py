"""Node-config findings of a review (each test failed on the code before its fix).

The identity query (``client.app.query``) exists so that a bad node config fails before round 1, naming the key.
Node-config values that broke every train message passed it, and the run finished without that client:

(1) ``partition-id`` outside ``[0, num-clients)`` while ``num-partitions`` agrees with ``num-clients`` (every train
    message: "partition-id 3 is outside [0, num-clients=3)");
(2) ``torch-threads`` that is not a positive whole number (every train message: "threads must be a positive
    integer, got 0");
(3) a non-integral ``partition-id`` / ``num-partitions`` was truncated (1.9 ran as partition 1, 3.7 as 3) and a
    TOML bool was a number (``partition-id=true`` ran as partition 1);
(4) a ``fault`` (test-only) whose round list is not whole numbers failed every train message, and an unknown mode
    (``fllip``) or a ``scale:`` without a number ran an honest client under the fault's name.

Whole numbers written as floats (``2.0``) and the values every script passes stay accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from client.app import app as client_app
from client.node_request import node_run_config
from common import protocol as P
from common.errors import PGVIError
from strategies.inprocess import InProcessGrid

REPO = Path(__file__).resolve().parents[1]
RAW = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "num-clients": 3, "min-clients": 2,
       "num-server-rounds": 1, "evaluate-clients": False, "checkpoint": False, "wait-for-clients-s": 0,
       "round-timeout-s": 5}


def _query(node_config: dict) -> Message:
    """The identity query's reply from one node with ``node_config``, through the real ClientApp."""
    grid = InProcessGrid(client_app, [node_config], RAW)
    (node_id,) = list(grid.contexts)
    msg = Message(RecordDict({P.CONFIG: ConfigRecord({"request": "identity"})}), dst_node_id=node_id,
                  message_type=MessageType.QUERY)
    (reply,) = grid.send_and_receive([msg])
    return reply


def _query_error(node_config: dict) -> str:
    reply = _query(node_config)
    assert reply.has_error(), dict(reply.content[P.CONFIG])
    return reply.error.reason


# (1) partition-id in range


@pytest.mark.parametrize("pid", [3, 7, -1])
def test_a_partition_id_outside_the_federation_fails_the_identity_query(pid):
    nc = {"partition-id": pid, "num-partitions": 3, "client-id": "site-X"}
    with pytest.raises(PGVIError, match=rf"node config partition-id {pid} is outside \[0, num-clients=3\)"):
        node_run_config(RAW, nc)
    assert f"node config partition-id {pid} is outside [0, num-clients=3)" in _query_error(nc)


def test_a_partition_id_outside_the_federation_fails_without_num_partitions():
    with pytest.raises(PGVIError, match=r"partition-id 3 is outside \[0, num-clients=3\)"):
        node_run_config(RAW, {"partition-id": 3})


def test_num_partitions_that_disagree_are_still_named_first():
    with pytest.raises(PGVIError, match="num-partitions=4 disagrees with run config num-clients=3"):
        node_run_config(RAW, {"partition-id": 3, "num-partitions": 4})


# (2) torch-threads


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, False, "two", "", None, float("nan"), float("inf"), 2**31, 1025,
                                     "2147483648", 1e10])
def test_torch_threads_that_every_train_message_refuses_fail_the_identity_query(threads):
    nc = {"partition-id": 2, "num-partitions": 3, "torch-threads": threads}
    with pytest.raises(PGVIError, match="node config torch-threads must be a whole number in \\[1, 1024\\]") as err:
        node_run_config(RAW, nc)
    assert repr(threads) in str(err.value)
    if threads is not None:  # a ConfigRecord holds no None
        assert "node config torch-threads must be a whole number in [1, 1024]" in _query_error(nc)


@pytest.mark.parametrize("threads", [1, 2, 4.0, "3"])
def test_torch_threads_that_the_train_path_takes_pass(threads):
    node_run_config(RAW, {"partition-id": 0, "num-partitions": 3, "torch-threads": threads})


# (3) whole numbers, not bools


@pytest.mark.parametrize("key,value", [("partition-id", 1.9), ("partition-id", 0.5), ("partition-id", True),
                                       ("partition-id", False), ("partition-id", "one"), ("partition-id", "1.0"),
                                       ("partition-id", float("nan")), ("partition-id", float("inf")),
                                       ("num-partitions", 3.7), ("num-partitions", True), ("num-partitions", "three")])
def test_partition_keys_must_be_whole_numbers(key, value):
    nc = {"partition-id": 1, "num-partitions": 3, key: value}
    with pytest.raises(PGVIError, match=f"node config {key} must be a whole number") as err:
        node_run_config(RAW, nc)
    assert repr(value) in str(err.value)
    if isinstance(value, bool):
        assert "TOML bool" in str(err.value)
    assert f"node config {key} must be a whole number" in _query_error(nc)


@pytest.mark.parametrize("pid,parts", [(2.0, 3), (1, 3.0), ("2", 3), (0, None)])
def test_whole_numbers_are_accepted_with_the_default_client_id(pid, parts):
    nc = {"partition-id": pid} | ({"num-partitions": parts} if parts is not None else {})
    _, partition_id, client_id = node_run_config(RAW, nc)
    assert (partition_id, client_id) == (int(pid), f"site-{int(pid)}")
    reply = _query(nc)  # the query's reply names the same default id
    assert not reply.has_error(), reply.error.reason
    assert reply.content[P.CONFIG]["client-id"] == f"site-{int(pid)}"


# (4) fault (test only)


@pytest.mark.parametrize("fault", ["lose-reply@x", "nan@2.5", "flip@", "flip@0", "fllip", "scale10", "scale:",
                                   "scale:abc", "nan@2@3", "", 5])
def test_a_fault_the_client_cannot_run_fails_the_identity_query(fault):
    nc = {"partition-id": 0, "num-partitions": 3, "fault": fault}
    if fault == "":  # no fault: fine
        assert not _query(nc).has_error()
        return
    reason = _query_error(nc)
    assert "node config fault" in reason and repr(str(fault)) in reason, reason


@pytest.mark.parametrize("fault", ["nan@2", "wrong-shape@2", "improper@2", "huge@2", "lose-reply@1,2",
                                   "crash-before-reply", "crash-before-reply@2", "scale:10@2", "scale:-0.5", "flip"])
def test_the_faults_the_suites_use_pass_the_identity_query(fault):
    reply = _query({"partition-id": 0, "num-partitions": 3, "fault": fault})
    assert not reply.has_error(), reply.error.reason


def test_the_fault_round_list_selects_the_rounds():
    from client.app import _fault_mode

    ctx = Context(run_id=1, node_id=1, node_config={"fault": "lose-reply@1,3"}, state=RecordDict(), run_config={})
    assert [_fault_mode(ctx, r) for r in (1, 2, 3)] == ["lose-reply", "", "lose-reply"]
    ctx = Context(run_id=1, node_id=1, node_config={"fault": "scale:10"}, state=RecordDict(), run_config={})
    assert _fault_mode(ctx, 5) == "scale:10"


def test_a_train_message_still_skips_the_config_models():
    """The node-config checks a train message's ClientApp process runs (the default client id, the fault) import
    no pydantic models: that process stays cheap; a query's builds them."""
    code = ("import sys; from flwr.app import Context, RecordDict; import client.app as a; "
            "ctx = Context(run_id=1, node_id=1, node_config={'partition-id': 2.0, 'fault': 'nan@2'}, "
            "state=RecordDict(), run_config={}); "
            "assert a._ids(ctx) == ('site-2', None), a._ids(ctx); assert a._fault_mode(ctx, 2) == 'nan'; "
            "assert 'common.config' not in sys.modules and 'torch' not in sys.modules")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env=env)


def test_the_server_warns_about_a_node_whose_identity_query_fails(monkeypatch):
    """A refused node config answers the identity query with an error; the server used to keep the reason only
    for a later 'waiting for clients' timeout, so the run went on without the node and without a word."""
    from common.config import parse_run_config
    from common.problem import build_problem
    from strategies import pgvi
    from strategies.pgvi import PGVIStrategy

    warnings: list[str] = []
    monkeypatch.setattr(pgvi, "log", lambda level, fmt, *args: warnings.append(fmt % args))
    grid = InProcessGrid(client_app, [{"partition-id": 0, "num-partitions": 3}, {"partition-id": 7}], RAW)
    strategy = PGVIStrategy(build_problem(parse_run_config(RAW)), poll_interval=0.0)
    strategy._discover(grid, list(grid.contexts))
    bad = [n for n, ctx in grid.contexts.items() if ctx.node_config["partition-id"] == 7]
    failed = [w for w in warnings if "identity query" in w]
    assert len(failed) == 1 and f"node {bad[0]}" in failed[0] and "partition-id 7" in failed[0], warnings
    assert sorted(strategy.node_client.values()) == ["site-0"]


# stop 30: a state-dir every train message refuses


def test_a_state_dir_the_client_cannot_write_fails_the_identity_query(tmp_path):
    """A path below a regular file (or a directory the SuperExec's user cannot write) passed the query; then every
    train message failed at ClientState.save with NotADirectoryError and the run went on without the node."""
    (tmp_path / "afile").write_text("x")
    nc = {"partition-id": 0, "num-partitions": 3, "client-id": "site-0", "state-dir": str(tmp_path / "afile" / "state")}
    err = _query_error(nc)
    assert "node config state-dir" in err and "is not a directory this client can write" in err, err
    fine = {**nc, "state-dir": str(tmp_path / "new" / "state")}  # created by the query, and left empty
    reply = _query(fine)
    assert not reply.has_error() and dict(reply.content[P.CONFIG])["client-id"] == "site-0"
    assert (tmp_path / "new" / "state").is_dir() and list((tmp_path / "new" / "state").iterdir()) == []


def test_a_node_without_partition_id_fails_the_identity_query_when_the_run_has_several_clients():
    """Without partition-id a node trained partition 0, whatever its client-id: two such nodes (or one with
    client-id site-3) held the same data without a word (stop 30). With one client, partition 0 is the only one."""
    nc = {"client-id": "site-3", "num-partitions": 3}
    with pytest.raises(PGVIError, match="node config partition-id is missing: with num-clients=3"):
        node_run_config(RAW, nc)
    assert "node config partition-id is missing" in _query_error(nc)
    one = {**RAW, "num-clients": 1, "min-clients": 1}
    assert node_run_config(one, {"client-id": "solo"})[1] == 0


def test_a_fedavg_node_without_partition_id_is_refused_when_the_run_has_several_clients():
    from client import fedavg_app

    msg = SimpleNamespace(content={})
    context = SimpleNamespace(run_config=RAW, node_config={"num-partitions": 3})
    with pytest.raises(ValueError, match="node config partition-id is missing"):
        fedavg_app._setup(msg, context)
