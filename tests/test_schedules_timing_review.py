"""Stop-30 review of the schedules' timing and of reply accounting, each against the real ClientApp through the
in-process Grid (each test failed on the code before its fix):

(1) synchronous with ``pipeline-evaluation``: the previous round's evaluation, record and checkpoint, done after
    the push, were taken from the replies' round-timeout-s, and no pull was made once it was spent, so replies
    already in were counted as timeouts and the run stopped ("all 3 client messages failed");
(2) asynchronous: a message was timed out by the clock after the server's own work, without a pull, though its
    reply was waiting; and the server's work counted against the run's deadline (round-timeout-s x rounds), which
    ended healthy runs early;
(3) one invalid reply delivered twice counted as two bad replies (and, asynchronously, a reply to no message in
    flight was charged before being recognised as one);
(4) when every push failed, the stop reason said the clients had not replied in time;
(5) a node that kept its node id but came back with another client-id was never identified again, and each of
    its replies was charged to the old client as a bad reply.
"""

from __future__ import annotations

import logging
import time

import httpx
import numpy as np
import torch
import pytest
from flwr.app import Context, RecordDict

from common import protocol as P
from strategies.pgvi import AllClientsFailed
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_schedules_review import _RecGrid, _rows, _setup
from tests.wire import record_arrays, set_record_arrays


def _slow_evaluation(seconds: float):
    def evaluate(posterior):
        time.sleep(seconds)
        return {"x": 0.0}
    return evaluate


class _ReadyAfter(_RecGrid):
    """A reply becomes visible ``delay[client-id]`` seconds after its push."""

    def __init__(self, *args, delay: dict[str, float] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay, self.ready_at = delay or {}, {}

    def push_messages(self, messages):
        messages = list(messages)
        before = set(self._replies)
        ids = super().push_messages(messages)
        for key in set(self._replies) - before:
            cid = self.contexts[self._replies[key].metadata.src_node_id].node_config.get("client-id")
            self.ready_at[key] = time.time() + self.delay.get(cid, 0.0)
        return ids

    def pull_messages(self, message_ids):
        wanted, now = set(message_ids), time.time()
        ready = [k for k in self._replies if k.split("#")[0] in wanted and self.ready_at.get(k, 0.0) <= now]
        return [self._replies.pop(k) for k in ready]


def _exact(cfg, strategy) -> float:
    return max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions))


# ============================================================================================ (1)
@pytest.mark.parametrize("pipeline", [False, True])
def test_the_previous_rounds_evaluation_does_not_eat_the_replies_timeout(pipeline):
    cfg, strategy, grid = _setup({"num-server-rounds": 4, "round-timeout-s": 0.3, "pipeline-evaluation": pipeline},
                                 server_evaluate=_slow_evaluation(0.45))
    strategy.start(grid)
    assert [(r["sent"], r["applied"], r["failed"]) for r in _rows(strategy)] == [(3, 3, 0)] * 4
    assert strategy.ledger_versions == {f"site-{m}": 4 for m in range(3)} and not grid._replies
    assert _exact(cfg, strategy) < 1e-9


def test_a_reply_already_in_is_pulled_even_when_the_push_took_the_whole_timeout():
    class SlowPush(_RecGrid):
        def push_messages(self, messages):
            ids = super().push_messages(messages)
            time.sleep(0.35)
            return ids

    cfg, strategy, grid = _setup({"schedule": "sequential", "num-server-rounds": 2, "round-timeout-s": 0.3},
                                 grid_cls=SlowPush)
    strategy.start(grid)
    assert [(r["applied"], r["failed"]) for r in _rows(strategy)] == [(3, 0)] * 2


# ============================================================================================ (2)
def test_asynchronous_ready_replies_are_pulled_before_their_messages_time_out():
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-server-rounds": 4, "round-timeout-s": 0.3,
                                  "damping": 0.5}, grid_cls=_ReadyAfter, server_evaluate=_slow_evaluation(0.45),
                                 resend_first=0.01, resend_max=0.02)
    grid.delay = {"site-2": 0.05}
    strategy.start(grid)
    assert [r["failed"] for r in _rows(strategy)] == [0] * 4
    assert strategy.round_completed == 4 and _exact(cfg, strategy) < 1e-9


def test_asynchronous_deadline_does_not_count_the_servers_own_work():
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-server-rounds": 6, "round-timeout-s": 0.5,
                                  "damping": 0.5}, server_evaluate=_slow_evaluation(0.6))
    strategy.start(grid)  # 6 x 0.6 s of evaluation > the 3-s budget for waiting on clients
    assert strategy.round_completed == 6 and sum(r["failed"] for r in _rows(strategy)) == 0


# ============================================================================================ (3)
def _bad_reply_twice(kind: str):
    done = {"n": 0}

    def hook(request, reply):
        if request.metadata.message_type != "train" or reply.has_error() or done["n"]:
            return [reply]
        if reply.content[P.CONFIG].get("client-id") != "site-1":
            return [reply]
        done["n"] += 1
        delta = record_arrays(reply, P.DELTA)
        key = next(k for k in delta if k.startswith("eta2"))
        delta[key][...] = 1e6 if kind == "improper" else np.nan
        set_record_arrays(reply.content, P.DELTA, delta)
        return [reply, reply]  # one bad reply, delivered twice

    return hook


@pytest.mark.parametrize("schedule", ["synchronous", "asynchronous"])
@pytest.mark.parametrize("kind", ["nan", "improper"])
def test_one_bad_reply_delivered_twice_is_one_bad_reply(schedule, kind):
    cfg, strategy, grid = _setup({"schedule": schedule, "num-server-rounds": 3, "max-bad-replies": 2},
                                 reply_hook=_bad_reply_twice(kind))
    strategy.start(grid)
    assert strategy.bad_replies == {"site-1": 1} and not strategy._excluded("site-1")
    assert _exact(cfg, strategy) < 1e-9


# ============================================================================================ (4)
@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_when_every_push_fails_the_stop_reason_names_the_push(schedule):
    class PushFails(_RecGrid):
        def push_messages(self, messages):
            messages = list(messages)
            if any(m.metadata.message_type == "train" for m in messages):
                raise httpx.ConnectError("connection refused (injected)")
            return super().push_messages(messages)

    cfg, strategy, grid = _setup({"schedule": schedule, "num-server-rounds": 2, "round-timeout-s": 0.2},
                                 grid_cls=PushFails, retry_backoff=0.05)
    with pytest.raises(AllClientsFailed) as exc:
        strategy.start(grid)
    assert "push-messages kept failing" in str(exc.value) and "did not reply" not in str(exc.value)


# ============================================================================================ (5)
def test_a_node_that_comes_back_with_another_client_id_is_asked_again_refused_and_nobody_is_charged(caplog):
    """Same node id, new client-id while the ledger holds num-clients sites: the node's partition already stands behind
    'site-0', so the new id is not admitted (it would count the partition twice); nobody is charged a bad reply."""
    cfg, strategy, grid = _setup({"num-server-rounds": 5, "max-bad-replies": 1, "exclusion-removes-site": True})

    def rename_after_round_2(rnd, row):
        if rnd == 2:
            node = next(n for n, c in grid.contexts.items() if c.node_config["client-id"] == "site-0")
            config = dict(grid.contexts[node].node_config, **{"client-id": "site-0-renamed"})
            grid.contexts[node] = Context(1, node, config, RecordDict(), grid.run_config)  # same node id

    strategy.on_round_end = rename_after_round_2
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(grid)
    assert strategy.bad_replies == {}
    assert sorted(strategy.node_client.values()) == ["site-1", "site-2"]  # asked again, and refused
    assert "site-0-renamed" not in strategy.ledger_versions
    assert strategy.ledger_versions["site-0"] == 2 and strategy.ledger_versions["site-1"] == 5
    assert strategy.state.check_invariant() < 1e-12
    text = caplog.text
    assert "is not in the ledger, which already holds num-clients=3" in text
    assert "is not admitted while the ledger holds num-clients" in text  # the rename warning says what follows


# ============================================================================================ client seeds
def test_asynchronous_updates_of_one_client_in_one_round_draw_different_seeds(monkeypatch):
    """A round closes after M outcomes, so a fast client computes several updates with the same server-round, each
    against another posterior: they used one local seed (identical Monte Carlo draws and minibatch order)."""
    import common.client_update as cu

    seeds: list[tuple[int, int]] = []
    real = cu.local_seed
    monkeypatch.setattr(cu, "local_seed", lambda seed, step, stream: seeds.append((stream, step)) or real(seed, step, stream))
    lost = {"n": 0}

    def lose_site_2_once(request, reply):
        if request.metadata.message_type == "train" and request.content["config"].get("client-id") == "site-2" \
                and not lost["n"]:
            lost["n"] += 1
            return []
        return [reply]

    cfg, strategy, grid = _setup({"schedule": "asynchronous", "family": "mean_field", "conjugate": False,
                                  "divergence": "alpha_renyi", "divergence-alpha": 2.0, "local-epochs": 3,
                                  "num-server-rounds": 3, "round-timeout-s": 1.0}, reply_hook=lose_site_2_once)
    strategy.start(grid)
    rounds = [(stream, step >> 32 if step >= 1 << 32 else step) for stream, step in seeds]
    assert len(rounds) > len(set(rounds))  # some client did compute two updates in one round
    assert len(seeds) == len(set(seeds)), seeds


# ============================================================================================ after the last round
def test_an_invalid_reply_after_the_last_round_changes_nothing_recorded():
    """Asynchronous: a malformed reply collected after the last round was charged, so with max-bad-replies 1 and
    exclusion-removes-site its client's site was divided out of the posterior after the last round's row and
    checkpoint: posterior.npz and the summary then disagreed with metrics.jsonl (stop-30 diff review)."""
    over = {"schedule": "asynchronous", "num-server-rounds": 2, "round-timeout-s": 5.0, "damping": 0.5,
            "max-bad-replies": 1, "max-staleness": 10, "exclusion-removes-site": True}
    cfg, strategy, grid = _setup(over, grid_cls=_ReadyAfter, faults={2: "nan@2"}, resend_first=0.01, resend_max=0.02)
    grid.delay = {"site-0": 0.1, "site-1": 0.1, "site-2": 0.25}
    recorded = {}
    strategy.on_round_end = lambda rnd, row: recorded.update(
        {rnd: {k: v.clone() for k, v in strategy.state.posterior.params.items()}})
    strategy.start(grid)
    final = strategy.state.posterior.params
    assert strategy.round_completed == 2 and strategy.bad_replies == {}
    assert all(torch.equal(recorded[2][k], final[k]) for k in final)


@pytest.mark.parametrize("nodes, new_id", [(3, "site-0-renamed"), (2, "site-0-renamed"), (3, "site-1")])
def test_a_renamed_nodes_old_client_keeping_its_site_is_warned_about(monkeypatch, nodes, new_id):
    """3 nodes for num-clients=3: the ledger is full and the new id is refused (the warning says how to continue); 2
    nodes: the new id is admitted as a third client, and the warning says the partition may count twice; renamed
    to an id already in the ledger (admitted once its node is gone, here refused since it is connected): the
    warning says 'counts twice', not that the id is refused for a full ledger."""
    import strategies.pgvi as pgvi_module

    logged: list[str] = []
    monkeypatch.setattr(pgvi_module, "log", lambda level, msg, *a: logged.append(msg % a if a else msg))
    cfg, strategy, grid = _setup({"num-server-rounds": 3, "min-clients": 2}, n=nodes)

    def rename_after_round_1(rnd, row):
        if rnd == 1:
            node = next(n for n, c in grid.contexts.items() if c.node_config["client-id"] == "site-0")
            config = dict(grid.contexts[node].node_config, **{"client-id": new_id})
            grid.contexts[node] = Context(1, node, config, RecordDict(), grid.run_config)

    strategy.on_round_end = rename_after_round_1
    strategy.start(grid)
    mine = [w for w in logged if "client 'site-0'" in w and "keeps its site (1 applied updates)" in w]
    assert len(mine) == 1, logged
    if new_id == "site-1":
        assert "counts twice" in mine[0] and "not admitted" not in mine[0]
    elif nodes == 3:
        assert "not admitted while the ledger holds num-clients=3" in mine[0] and "client-id 'site-0'" in mine[0]
        assert "site-0-renamed" not in strategy.node_client.values()
    else:
        assert "counts twice" in mine[0]
        assert "site-0-renamed" in strategy.node_client.values()


def test_a_reply_whose_client_id_is_not_a_string_is_one_rejection_after_an_applied_update():
    """CI fuzz of stop 35: a reply claiming client id ['x'] (a list) from a client with applied updates made the
    rename warning test the list for membership in the ledger (TypeError): the reply was rejected twice."""
    done = {"n": 0}

    def hook(request, reply):
        if request.metadata.message_type != "train" or reply.has_error() or done["n"]:
            return [reply]
        cfg = reply.content[P.CONFIG]
        if cfg.get("client-id") != "site-1" or request.content[P.CONFIG].get("server-round", 0) < 2:
            return [reply]
        done["n"] += 1
        cfg["client-id"] = ["x"]
        return [reply]

    cfg, strategy, grid = _setup({"num-server-rounds": 3, "min-clients": 2}, reply_hook=hook)
    strategy.start(grid)
    assert done["n"] == 1
    row = next(r for r in strategy.history if r["round"] == 2)
    assert row["rejected"] == 1 and row["applied"] == 2, row
