"""Transient Runtime API errors (fault suite, Finding 2a) and SuperLink-generated error replies (Finding 5).

A SuperLink under load answers ``push-messages`` / ``pull-messages`` with HTTP 500 (SQLite ``database is
locked``) or lets an object-push session expire.  The strategy retries such calls until the round deadline and
only then treats the messages as failed; other errors still stop the run.  A retried push must never lead to
an update being applied twice: the oracles are the ledger (one update per client per round), the closed-form
posterior of the ledger and every client's own site.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from flwr.app import Error, Message
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

from client.app import app as client_app
from common import protocol as P
from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import SERVER_NODE_ID, InProcessGrid
from strategies.pgvi import PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_faults import ledger_matches_clients
from tests.test_inprocess import BASE

ROUNDS = 3
ErrorRule = Callable[[int, list[Message]], Exception | None]  # (call number from 1, messages) -> error to raise


def http_error(code: int, call: str = "pull-messages") -> httpx.HTTPStatusError:
    request = httpx.Request("POST", f"https://127.0.0.1:9091/v1/runtime/{call}")
    response = httpx.Response(code, request=request)
    return httpx.HTTPStatusError(f"Server error '{code}' for url '{request.url}'", request=request, response=response)


def session_expired() -> ObjectPushError:
    return ObjectPushError("0f" * 32, 1, "session-1")


def _train_round(msgs: list[Message]) -> int | None:
    rounds = {int(m.content[P.CONFIG]["server-round"]) for m in msgs if m.metadata.message_type == "train"}
    return rounds.pop() if len(rounds) == 1 else None


class FlakyGrid(InProcessGrid):
    """An ``InProcessGrid`` whose push/pull calls fail like a SuperLink under load.

    ``push_error(n, msgs)`` / ``pull_error(n, [])`` return the error the n-th call raises (or ``None``).
    ``deliver_first``: a failing push stores and delivers the messages, then fails (the response is lost).
    ``idempotent``: like the SuperLink, a re-pushed message (same message id) is neither stored nor delivered
    again.  Otherwise a re-push is delivered again and the replies to the first delivery are returned with
    those to the second (the worst case: the server sees both).
    """

    def __init__(self, *args, push_error: ErrorRule | None = None, pull_error: ErrorRule | None = None,
                 deliver_first: bool = False, idempotent: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.push_error, self.pull_error = push_error, pull_error
        self.deliver_first, self.idempotent = deliver_first, idempotent
        self.pushes = self.pulls = 0
        self.errors_raised = 0
        self.executions: Counter = Counter()  # (client id, server round) -> train messages the ClientApp ran
        self.runs: Counter = Counter()  # train message (content hash, as the SuperLink's id) -> times it ran
        self._stored: set[str] = set()
        self._orphans: dict[int, str] = {}  # node -> id of a delivered message whose push failed
        self._alias: dict[str, str] = {}  # id of a re-pushed message -> id of its first delivery
        inner = self.client_app

        def counting_app(msg: Message, ctx):  # noqa: ANN001, ANN202
            if msg.metadata.message_type == "train":
                cfg = msg.content[P.CONFIG]
                self.executions[(str(cfg["client-id"]), int(cfg["server-round"]))] += 1
                self.runs[(str(cfg["client-id"]), msg.object_id)] += 1
            return inner(msg, ctx)

        self.client_app = counting_app

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        msgs = list(messages)
        self.pushes += 1
        err = self.push_error(self.pushes, msgs) if self.push_error else None
        if err is not None and not self.deliver_first:
            self.errors_raised += 1
            raise err
        new = [m for m in msgs if not (self.idempotent and m.metadata.message_id in self._stored)]
        super().push_messages(new)
        self._stored.update(m.metadata.message_id for m in new)
        for m in new:
            old = self._orphans.pop(m.metadata.dst_node_id, None)
            if old is not None:
                self._alias[m.metadata.message_id] = old
        if err is not None:
            self._orphans.update({m.metadata.dst_node_id: m.metadata.message_id for m in new})
            self.errors_raised += 1
            raise err
        return [m.metadata.message_id for m in msgs]

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        ids = list(message_ids)
        self.pulls += 1
        err = self.pull_error(self.pulls, []) if self.pull_error else None
        if err is not None:
            self.errors_raised += 1
            raise err
        return super().pull_messages(ids + [self._alias[i] for i in ids if i in self._alias])


def _run(schedule: str = "synchronous", overrides: dict | None = None, **grid_kwargs):
    raw = {**BASE, "num-server-rounds": ROUNDS, "schedule": schedule, **(overrides or {})}
    if schedule == "asynchronous":
        raw.update({"damping": 0.5})
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"} for m in range(cfg.num_clients)]
    grid = FlakyGrid(client_app, nodes, raw, **grid_kwargs)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, retry_backoff=0.0, resend_first=0.0, resend_max=0.0)
    strategy.start(grid)
    return cfg, strategy, grid


def _consistent(cfg, strategy, grid) -> None:
    """The posterior is the closed form of the ledger and every client's own site is the ledger's."""
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    ledger_matches_clients(cfg, strategy, grid)


def _fail_each_nodes_first_round2_push() -> Callable[[int, list[Message]], Exception | None]:
    """A push rule: the first push of round 2 to each node answers HTTP 500 (after delivery, if the grid
    delivers first); later pushes succeed."""
    failed: set[int] = set()

    def rule(n: int, msgs: list[Message]) -> Exception | None:
        nodes = {m.metadata.dst_node_id for m in msgs}
        if _train_round(msgs) == 2 and not nodes & failed:
            failed.update(nodes)
            return http_error(500, "push-messages")
        return None

    return rule


def _retries_logged(caplog, call: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"Runtime API {call} failed" in r.getMessage()]


@pytest.fixture(autouse=True)
def _capture_flwr_warnings(caplog):
    caplog.set_level(logging.WARNING, logger="flwr")


SCHEDULES = ["synchronous", "sequential", "asynchronous"]
TRANSIENT = {"http-500": lambda: http_error(500), "http-502": lambda: http_error(502),
             "http-429": lambda: http_error(429), "session-expired": session_expired}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["http-500", "http-429"])
def test_transient_pull_errors_are_retried_and_lose_nothing(schedule, kind, caplog):
    """Every other pull-messages call fails: the run completes with every update applied once."""
    cfg, strategy, grid = _run(schedule, pull_error=lambda n, _: TRANSIENT[kind]() if n % 2 == 1 else None)
    assert grid.errors_raised > ROUNDS
    assert len(_retries_logged(caplog, "pull-messages")) == grid.errors_raised
    assert not strategy.rejections
    if schedule != "asynchronous":
        assert strategy.ledger_versions == {f"site-{m}": ROUNDS for m in range(3)}
    assert all(v >= ROUNDS for v in strategy.ledger_versions.values())
    assert all(row["failed"] == 0 for row in strategy.history)
    _consistent(cfg, strategy, grid)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["http-500", "session-expired"])
def test_transient_push_errors_are_retried_and_each_message_runs_once(schedule, kind, caplog):
    """The first push of every train batch fails before the SuperLink stored anything."""
    first = set()

    def rule(n: int, msgs: list[Message]) -> Exception | None:
        key = (_train_round(msgs), tuple(m.metadata.dst_node_id for m in msgs))
        if key[0] is not None and key not in first:
            first.add(key)
            return TRANSIENT[kind]()
        return None

    cfg, strategy, grid = _run(schedule, push_error=rule)
    assert grid.errors_raised >= ROUNDS
    assert len(_retries_logged(caplog, "push-messages")) == grid.errors_raised
    assert not strategy.rejections
    assert set(grid.runs.values()) == {1}
    if schedule != "asynchronous":
        assert strategy.ledger_versions == {f"site-{m}": ROUNDS for m in range(3)}
        assert set(grid.executions.values()) == {1}
    _consistent(cfg, strategy, grid)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_retried_push_whose_first_attempt_was_delivered_is_not_delivered_again(schedule):
    """The push of round 2 is stored and delivered, then answers 500; the retry re-sends the same messages,
    which the SuperLink (here: the idempotent grid) recognises by their id, so each runs once."""
    rule = _fail_each_nodes_first_round2_push()
    cfg, strategy, grid = _run(schedule, deliver_first=True, idempotent=True, push_error=rule)
    assert grid.errors_raised >= 1
    assert set(grid.runs.values()) == {1}, grid.runs
    assert not strategy.rejections
    if schedule != "asynchronous":  # one message per client and round, and it ran once
        assert set(grid.executions.values()) == {1}, grid.executions
        assert strategy.ledger_versions == {f"site-{m}": ROUNDS for m in range(3)}
    _consistent(cfg, strategy, grid)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_message_executed_twice_after_a_retried_push_is_applied_once(schedule):
    """Worst case: the failed push of round 2 was delivered, the retry is delivered again, and the server
    receives the replies of both executions.  The site versions let exactly one of them through."""
    rule = _fail_each_nodes_first_round2_push()
    cfg, strategy, grid = _run(schedule, deliver_first=True, idempotent=False, push_error=rule)
    twice = [cid for (cid, _), v in grid.runs.items() if v == 2]
    assert twice, grid.runs  # the duplicate delivery did happen
    assert set(grid.runs.values()) == {1, 2}
    # the reply of one of the two executions was rejected each time, and no other reply
    assert sorted(r["client-id"] for r in strategy.rejections) == sorted(twice)
    assert all(r["round"] == 2 for r in strategy.rejections)
    if schedule != "asynchronous":
        assert strategy.ledger_versions == {f"site-{m}": ROUNDS for m in range(3)}
    # no more updates applied than distinct messages sent to the client
    for cid, v in strategy.ledger_versions.items():
        assert v <= sum(1 for (c, _) in grid.runs if c == cid)
    _consistent(cfg, strategy, grid)


@pytest.mark.parametrize("error", [lambda: http_error(404), lambda: http_error(401), lambda: ValueError("bug")],
                         ids=["http-404", "http-401", "ValueError"])
@pytest.mark.parametrize("call", ["push", "pull"])
def test_non_transient_errors_still_stop_the_run(error, call):
    """HTTP 4xx other than 408/429 and programming errors raised in round 2 propagate at once."""
    round2 = {"on": False}

    def push_rule(n: int, msgs: list[Message]) -> Exception | None:
        if _train_round(msgs) == 2:
            round2["on"] = True
            return error() if call == "push" else None
        return None

    def pull_rule(n: int, _msgs: list[Message]) -> Exception | None:
        return error() if call == "pull" and round2["on"] else None

    t0 = time.time()
    with pytest.raises(type(error())):
        _run("synchronous", push_error=push_rule, pull_error=pull_rule)
    assert time.time() - t0 < BASE["round-timeout-s"]  # not retried until the deadline


def test_persistent_transient_error_fails_the_messages_at_the_round_deadline(caplog):
    """Pushes to site-1 in round 2 keep failing: after round-timeout-s the message counts as failed, site-1
    keeps its site and the run goes on."""
    timeout = 1.0

    def rule(n: int, msgs: list[Message]) -> Exception | None:
        if _train_round(msgs) == 2 and any(str(m.content[P.CONFIG]["client-id"]) == "site-1" for m in msgs):
            return http_error(503, "push-messages")
        return None

    raw = {**BASE, "num-server-rounds": ROUNDS, "schedule": "sequential", "round-timeout-s": timeout}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    grid = FlakyGrid(client_app, nodes, raw, push_error=rule)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, retry_backoff=0.05)
    t0 = time.time()
    strategy.start(grid)
    assert time.time() - t0 >= timeout  # retried until the round deadline
    assert grid.errors_raised >= 3
    assert strategy.ledger_versions == {"site-0": ROUNDS, "site-1": ROUNDS - 1, "site-2": ROUNDS}
    row2 = next(r for r in strategy.history if r["round"] == 2)
    assert row2["failed"] == 1 and row2["applied"] == 2
    assert ("site-1", 2) not in grid.executions
    messages = [r.getMessage() for r in caplog.records]
    assert sum("Runtime API push-messages failed" in m and "retry" in m for m in messages) == grid.errors_raised - 1
    assert any("giving up" in m for m in messages)
    assert not strategy.rejections
    _consistent(cfg, strategy, grid)


# =================================================================================================
# Finding 5: error replies generated by the SuperLink carry the SuperLink's node id
def _superlink_error(victim: str, rnd: int, reason: str = "Node Unavailable"):
    def hook(request: Message, reply: Message) -> list[Message]:
        cfg = request.content[P.CONFIG] if P.CONFIG in request.content else {}
        if request.metadata.message_type == "train" and cfg.get("client-id") == victim and cfg.get("server-round") == rnd:
            err = Message(Error(code=0, reason=reason), reply_to=request)
            err.metadata.__dict__["_src_node_id"] = SERVER_NODE_ID  # as the SuperLink builds it
            return [err]
        return [reply]

    return hook


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_superlink_error_reply_is_attributed_to_the_client_the_message_went_to(schedule, caplog):
    reason = "Reply message objects are unavailable. The object-push session expired."
    cfg, strategy, grid = _run(schedule, reply_hook=_superlink_error("site-1", 2, reason))
    failures = [r.getMessage() for r in caplog.records if "failed:" in r.getMessage() and "Runtime API" not in r.getMessage()]
    assert failures == [f"round 2: client 'site-1' failed: {reason}"]
    assert "<node" not in strategy._last_failure and "site-1" in strategy._last_failure
    assert next(r for r in strategy.history if r["round"] == 2)["failed"] == 1
    assert not strategy.rejections
    if schedule != "asynchronous":
        assert strategy.ledger_versions == {"site-0": ROUNDS, "site-1": ROUNDS - 1, "site-2": ROUNDS}
    _consistent(cfg, strategy, grid)


def test_run_that_fails_on_superlink_errors_names_the_clients():
    """Every message of round 1 comes back as a SuperLink error: the run stops naming a client, not node 1."""
    from strategies.pgvi import AllClientsFailed

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type != "train":
            return [reply]
        err = Message(Error(code=0, reason="Node Unavailable"), reply_to=request)
        err.metadata.__dict__["_src_node_id"] = SERVER_NODE_ID
        return [err]

    with pytest.raises(AllClientsFailed) as ei:
        _run("synchronous", reply_hook=hook)
    assert "client 'site-" in str(ei.value) and "<node" not in str(ei.value)
