"""``pipeline-evaluation``: round r's server evaluation runs while the clients work on round r+1.

(a) same records (apart from the timing keys), same posterior, same ledger as the unpipelined run;
(b) the order of events: pipelined, round r's evaluation overlaps round r+1's clients and its row follows their
    start; unpipelined, the row comes before any client of round r+1;
(c) when it applies (synchronous schedule, no client-side evaluation, a server evaluation) and when not;
(d) an evaluation that raises stops the run with that error, with the earlier rounds recorded;
(e) a round in which every client failed is recorded and stops the run before any further message;
(f) through the ServerApp's ``run_strategy``: ``metrics.jsonl`` and the checkpoint hold every round.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from flwr.app import Error, Message

from common.config import parse_run_config
from common.evaluation import evaluate_posterior
from common.problem import build_problem, load_full_data
from strategies.inprocess import InProcessGrid
from strategies.pgvi import AllClientsFailed, PGVIStrategy
from tests.test_inprocess import BASE, client_app

TIMING_KEYS = {"round-seconds", "started-at", "recorded-at", "client-seconds-max", "client-seconds-mean"}


def _nodes(cfg):
    return [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"}
            for m in range(cfg.num_clients)]


def _run(overrides=None, *, reply_hook=None, evaluate=None, on_round_end=None):
    raw = {**BASE, "num-server-rounds": 4, **(overrides or {})}
    cfg = parse_run_config(raw)
    problem = build_problem(cfg)
    data = load_full_data(cfg)

    def server_evaluate(q):
        return evaluate_posterior(problem, q, data.x_test, data.y_test, cfg.eval_samples, seed=cfg.seed)

    strategy = PGVIStrategy(problem, poll_interval=0.0, server_evaluate=evaluate or server_evaluate,
                            on_round_end=on_round_end)
    grid = InProcessGrid(client_app, _nodes(cfg), raw, reply_hook=reply_hook)
    strategy.start(grid)
    return strategy


def _untimed(row):
    return {k: v for k, v in row.items() if k not in TIMING_KEYS and not k.startswith("server-seconds-")}


# --------------------------------------------------------------------------------------------- (a)


@pytest.mark.parametrize("extra", [{}, {"loss": "score_matching", "divergence": "weighted_kl"},
                                   {"fraction-train": 0.67, "num-clients": 3}])
def test_pipelined_run_records_and_posterior_equal_the_unpipelined(extra):
    on = _run({"pipeline-evaluation": True, **extra})
    off = _run({"pipeline-evaluation": False, **extra})
    assert on.pipelines_evaluation() and not off.pipelines_evaluation()
    assert [_untimed(r) for r in on.history] == [_untimed(r) for r in off.history]
    assert all("test-nll" in r for r in on.history)
    assert on.ledger_versions == off.ledger_versions
    a, b = on.state.posterior.to_numpy(), off.state.posterior.to_numpy()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------- (b)


def _event_log(pipelined: bool):
    events: list[tuple[str, int, float]] = []
    lock = threading.Lock()

    def note(kind, rnd):
        with lock:
            events.append((kind, rnd, time.perf_counter()))

    def hook(request, reply):
        if request.metadata.message_type == "train":
            note("client", int(request.metadata.group_id))
            time.sleep(0.02)
        return [reply]

    evaluated = {"n": 0}

    def slow_evaluate(q):
        rnd = evaluated["n"]
        evaluated["n"] += 1
        note("eval-start", rnd)
        time.sleep(0.3)  # long against the clients' 3 x 0.02 s
        note("eval-end", rnd)
        return {"accuracy": 0.5}

    _run({"pipeline-evaluation": pipelined, "num-server-rounds": 3}, reply_hook=hook, evaluate=slow_evaluate,
         on_round_end=lambda r, row: note("row", r))
    return events


def test_pipelined_evaluation_overlaps_the_next_rounds_clients():
    ev = _event_log(pipelined=True)
    at = {(k, r): t for k, r, t in ev if k != "client"}
    first_client = {r: min(t for k, rr, t in ev if k == "client" and rr == r) for r in (1, 2, 3)}
    for r in (1, 2):  # round r's evaluation runs while round r+1's clients work; its row comes after their start
        assert first_client[r + 1] < at[("eval-end", r)]  # (which thread starts first is the scheduler's choice)
        assert at[("row", r)] > first_client[r + 1]
    assert [r for k, r, _ in ev if k == "row"] == [0, 1, 2, 3]  # every round recorded once, in order


def test_unpipelined_rows_come_before_the_next_rounds_clients():
    ev = _event_log(pipelined=False)
    at = {(k, r): t for k, r, t in ev if k != "client"}
    first_client = {r: min(t for k, rr, t in ev if k == "client" and rr == r) for r in (1, 2, 3)}
    for r in (1, 2):
        assert at[("eval-end", r)] < at[("row", r)] < first_client[r + 1]


# --------------------------------------------------------------------------------------------- (c)


@pytest.mark.parametrize("overrides,expected", [
    ({}, True),
    ({"pipeline-evaluation": False}, False),
    ({"evaluate-clients": True}, False),
    ({"schedule": "sequential"}, False),
    ({"schedule": "asynchronous", "damping": 0.5}, False),
])
def test_when_the_evaluation_is_pipelined(overrides, expected):
    cfg = parse_run_config({**BASE, **overrides})
    assert PGVIStrategy(build_problem(cfg), server_evaluate=lambda q: {}).pipelines_evaluation() is expected
    assert PGVIStrategy(build_problem(cfg)).pipelines_evaluation() is False  # nothing to evaluate


# --------------------------------------------------------------------------------------------- (d)


def test_an_evaluation_error_stops_the_run_with_that_error():
    calls = {"n": 0}

    def failing(q):
        calls["n"] += 1
        if calls["n"] == 3:  # round 2's evaluation (round 0 is the prior's)
            raise FloatingPointError("evaluation blew up")
        return {"accuracy": 0.5}

    rows = []
    with pytest.raises(FloatingPointError, match="evaluation blew up"):
        _run({"pipeline-evaluation": True}, evaluate=failing, on_round_end=lambda r, row: rows.append(r))
    assert rows == [0, 1]


# --------------------------------------------------------------------------------------------- (e)


def test_a_round_where_every_client_failed_is_recorded_and_stops_the_run():
    sent_rounds: list[int] = []

    def fail_round_2(request, reply):
        if request.metadata.message_type != "train":
            return [reply]
        sent_rounds.append(int(request.metadata.group_id))
        if request.metadata.group_id == "2":
            return [Message(Error(code=0, reason="node lost"), reply_to=request)]
        return [reply]

    rows = []
    with pytest.raises(AllClientsFailed, match="round 2"):
        _run({"pipeline-evaluation": True}, reply_hook=fail_round_2, on_round_end=lambda r, row: rows.append(r))
    assert rows == [0, 1, 2]
    assert max(sent_rounds) == 2  # no message of round 3 went out


# --------------------------------------------------------------------------------------------- (f)


def test_server_app_records_every_round_with_the_pipeline(tmp_path):
    from server.app import run_strategy
    from strategies.checkpoint import load_checkpoint

    raw = {**BASE, "num-server-rounds": 3}
    cfg = parse_run_config(raw)
    strategy = run_strategy(InProcessGrid(client_app, _nodes(cfg), raw), cfg, build_problem(cfg), tmp_path)
    assert strategy.pipelines_evaluation()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3] and all("test-nll" in r for r in rows)
    done = PGVIStrategy(build_problem(cfg))
    load_checkpoint(done, tmp_path)
    assert done.round_completed == 3 and [int(r["round"]) for r in done.history] == [0, 1, 2, 3]
    assert done.history == strategy.history
