"""Asynchronous schedule: a node whose message failed is re-sent only after a back-off.

A client that fails at once (a crash on every message) used to be re-sent at every poll; each failure is an
outcome of a round, so it filled the remaining rounds while a slower, healthy client was still computing, whose
updates then "arrived after the last round".  Now its next message waits ``resend_first`` seconds, doubling per
further failure up to ``resend_max``, and any other outcome resets the wait.
"""

from __future__ import annotations

import time

import pytest
from flwr.app import Error, Message

from client.app import app as client_app
from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_inprocess import BASE


class _TimedGrid(InProcessGrid):
    """Records when each node is sent a train message; the reply of a node in ``slow`` becomes visible
    ``slow[node]`` seconds after its push (a client that computes), every other reply at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow: dict[int, float] = {}
        self.sends: dict[int, list[float]] = {}
        self._visible_at: dict[str, float] = {}

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        now = time.monotonic()
        for mid, m in zip(ids, messages):
            if m.metadata.message_type != "train":
                continue
            node = m.metadata.dst_node_id
            self.sends.setdefault(node, []).append(now)
            self._visible_at[mid] = now + self.slow.get(node, 0.0)
        return ids

    def pull_messages(self, message_ids):
        now = time.monotonic()
        return super().pull_messages([m for m in message_ids if self._visible_at.get(m, 0.0) <= now])


def _setup(n: int, rounds: int):
    raw = {**BASE, "schedule": "asynchronous", "num-clients": n, "min-clients": n, "num-server-rounds": rounds,
           "max-bad-replies": 0, "damping": 0.5}
    nodes = [{"partition-id": m, "num-partitions": n, "client-id": f"site-{m}"} for m in range(n)]
    return raw, parse_run_config(raw), nodes


def test_an_instantly_failing_client_does_not_fill_the_rounds_of_a_slow_healthy_one():
    raw, cfg, nodes = _setup(2, rounds=6)  # 12 outcomes in all
    nodes[0]["fault"] = "crash-before-reply"  # site-0: every message errors at once
    grid = _TimedGrid(client_app, nodes, raw)
    failing, healthy = sorted(grid.contexts)
    grid.slow[healthy] = 0.25
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, poll_max=0.002, resend_first=0.05, resend_max=0.2)
    strategy.start(grid)
    # before the back-off: site-0 failed ~12 times within the first 0.25 s, every round closed on its failures and
    # site-1's first update "arrived after the last round" (ledger 0)
    assert strategy.ledger_versions["site-0"] == 0
    assert strategy.ledger_versions["site-1"] >= 3, strategy.ledger_versions
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    gaps = [b - a for a, b in zip(grid.sends[failing], grid.sends[failing][1:])]
    assert len(gaps) >= 2
    waits = [0.05 * 2**k for k in range(len(gaps))]
    for gap, wait in zip(gaps, waits):  # 0.05, 0.1, 0.2, then the cap
        assert gap >= min(wait, 0.2) - 0.01, (gaps, waits)
    rows = [r for r in strategy.history if r["round"] >= 1]
    assert len(rows) == 6 and sum(r["applied"] for r in rows) == strategy.ledger_versions["site-1"]


def test_a_reply_resets_the_back_off():
    """A client that fails its first two messages and then works is sent the message after its first good reply
    at once, not after the grown back-off."""
    raw, cfg, nodes = _setup(2, rounds=5)
    grid = _TimedGrid(client_app, nodes, raw)
    flaky, other = sorted(grid.contexts)
    grid.slow[other] = 0.1
    errors = {"left": 2}

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == "train" and request.metadata.dst_node_id == flaky and errors["left"]:
            errors["left"] -= 1
            err = Message(Error(code=0, reason="InjectedFault: flaky"), reply_to=request)
            err.metadata.__dict__["_src_node_id"] = flaky
            return [err]
        return [reply]

    grid.reply_hook = hook
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, poll_max=0.002, resend_first=0.15, resend_max=1.0)
    strategy.start(grid)
    sends = grid.sends[flaky]
    gaps = [b - a for a, b in zip(sends, sends[1:])]
    assert gaps[0] >= 0.14 and gaps[1] >= 0.29, gaps  # two failures: 0.15 s, then 0.3 s
    assert len(gaps) >= 3 and max(gaps[2:]) < 0.1, gaps  # after the first good reply: re-sent at the next poll
    assert strategy.ledger_versions["site-0"] >= 2 and strategy.ledger_versions["site-1"] >= 1


@pytest.mark.parametrize("first, cap", [(-1.0, 1.0), (2.0, 1.0), (float("nan"), 1.0)])
def test_bad_resend_back_off_is_refused_at_construction(first, cap):
    raw, cfg, _ = _setup(2, rounds=1)
    with pytest.raises(ValueError, match="back-off"):
        PGVIStrategy(build_problem(cfg), resend_first=first, resend_max=cap)


@pytest.mark.parametrize("mode", ["resync", "other-site-version"])
def test_instant_non_failures_do_not_fill_the_rounds_of_a_slow_healthy_client(mode):
    """A client that answers every train message at once with a resync request, or with a Delta against another site
    version (neither charged as a bad reply), was re-sent at once (the back-off was for failures only): its instant
    outcomes closed every round, the healthy client's updates arrived after the last one and the run 'completed'
    with nothing applied (review of 2026-11-28)."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    from common import protocol as P

    raw, cfg, nodes = _setup(2, rounds=6)
    grid = _TimedGrid(client_app, nodes, raw)
    flooding, healthy = sorted(grid.contexts)
    grid.slow[healthy] = 0.25

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type != "train" or request.metadata.dst_node_id != flooding:
            return [reply]
        if mode == "resync":
            config = ConfigRecord({"client-id": request.content[P.CONFIG]["client-id"], "status": P.STATUS_RESYNC,
                                   "reason": "", "base-site-version": 0})
            return [Message(RecordDict({P.CONFIG: config, P.METRICS: MetricRecord({})}), reply_to=request)]
        reply.content[P.CONFIG]["base-site-version"] = 10**6
        return [reply]

    grid.reply_hook = hook
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, poll_max=0.002, resend_first=0.05, resend_max=0.2)
    strategy.start(grid)
    # was: ledger {site-0: 0, site-1: 0}, 12 messages to the flooding client against 1 to the healthy one
    assert strategy.ledger_versions[strategy.node_client[healthy]] >= 3, strategy.ledger_versions
    assert sum(int(r["applied"]) for r in strategy.history[1:]) >= 3
    assert len(grid.sends[flooding]) <= 3 * len(grid.sends[healthy]), (grid.sends[flooding], grid.sends[healthy])
