"""Review of what crosses the network (2026-11-28), each test failing on the code before its fix: a failed
client's reason forged log lines; a client's evaluation metric named like a server statistic replaced it in the
round's row; a finite client RMSE pooled to inf; an integer metric beyond float's range rejected a valid update."""

from __future__ import annotations

import logging
import math

import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from common import protocol as P
from tests.test_inprocess import run

FORGED = "local step failed\n\x1b[92mINFO \x1b[0m:      PGVI finished in 0.01s: 99 updates applied, 0 rejected"


def test_a_failed_clients_reason_cannot_forge_a_log_line(caplog):
    def hook(request, reply):
        if request.metadata.message_type == "train" and reply.content[P.CONFIG].get("client-id") == "site-1":
            config = ConfigRecord({"client-id": "site-1", "status": P.STATUS_FAILED, "base-site-version": 0,
                                   "reason": FORGED})
            return [Message(RecordDict({P.CONFIG: config, P.METRICS: MetricRecord({})}), reply_to=request)]
        return [reply]

    caplog.set_level(logging.INFO, logger="flwr")
    _, strategy, _ = run({"num-server-rounds": 1}, reply_hook=hook)
    assert "\n" not in strategy._last_failure and "\x1b" not in strategy._last_failure
    assert strategy._last_failure.startswith("local step failed\\n\\x1b[92mINFO")
    logged = [r.getMessage() for r in caplog.records if "could not update" in r.getMessage()]
    assert logged and all("\n" not in line and "\x1b" not in line for line in logged), logged


def test_client_evaluation_metrics_do_not_replace_the_servers_statistics(caplog):
    def hook(request, reply):
        if request.metadata.message_type == "evaluate" and not reply.has_error():
            reply.content[P.METRICS]["seconds-max"] = 123456.0
            reply.content[P.METRICS]["epochs-mean"] = 7777.0
        return [reply]

    caplog.set_level(logging.WARNING, logger="flwr")
    _, strategy, _ = run({"num-server-rounds": 2, "evaluate-clients": True}, reply_hook=hook)
    for row in strategy.history[1:]:
        assert row["client-seconds-max"] < 100.0 and row["client-epochs-mean"] != 7777.0, row
    assert "named like the server's own statistics left out: client-epochs-mean, client-seconds-max" in caplog.text


def test_a_finite_client_rmse_pools_to_a_finite_rmse():
    examples = {}

    def hook(request, reply):
        if request.metadata.message_type == "evaluate" and not reply.has_error():
            metrics = reply.content[P.METRICS]
            examples[request.metadata.dst_node_id] = metrics["num-examples"]
            if request.metadata.dst_node_id == 1001:
                metrics["rmse"] = 1e200
        return [reply]

    _, strategy, _ = run({"num-server-rounds": 1, "evaluate-clients": True, "model": "linear_regression",
                          "dataset": "synthetic_linear_regression", "family": "mean_field"}, reply_hook=hook)
    pooled = strategy.history[-1]["client-rmse"]
    expected = 1e200 * math.sqrt(examples[1001] / sum(examples.values()))  # the others' RMSEs vanish beside it
    assert math.isfinite(pooled) and pooled == pytest.approx(expected, rel=1e-12)  # was inf


def test_an_integer_metric_beyond_floats_range_leaves_the_update_applied():
    def hook(request, reply):
        if (request.metadata.message_type == "train" and not reply.has_error()
                and reply.content[P.CONFIG].get("client-id") == "site-1"):
            reply.content[P.METRICS]["num-examples"] = 10**400  # the in-process grid carries it; Flower's wire not
        return [reply]

    _, strategy, _ = run({"num-server-rounds": 2, "max-bad-replies": 2}, reply_hook=hook)
    assert strategy.ledger_versions["site-1"] == 2 and not strategy.bad_replies  # was: rejected, then excluded
