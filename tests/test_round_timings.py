"""Every round's record carries the server's wall time by phase (``server-seconds-<phase>``), the whole round
(``round-seconds``) and when it was recorded (``recorded-at``), for all three schedules.

The in-process Grid runs the ClientApp inside ``push_messages``, so a reply hook that sleeps shows up in the
``push`` phase; a server evaluation that sleeps shows up in ``evaluate``.
"""

from __future__ import annotations

import time

import pytest

from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import SERVER_PHASES, PGVIStrategy, RoundStats
from tests.test_inprocess import BASE, client_app

CLIENT_SLEEP = 0.02
EVAL_SLEEP = 0.03


def _slow_train(request, reply):
    if request.metadata.message_type == "train":
        time.sleep(CLIENT_SLEEP)
    return [reply]


def _run(schedule: str, evaluate: bool):
    raw = {**BASE, "schedule": schedule, "num-server-rounds": 3}
    if schedule == "asynchronous":
        raw["damping"] = 0.5
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"}
             for m in range(cfg.num_clients)]
    grid = InProcessGrid(client_app, nodes, raw, reply_hook=_slow_train)

    def server_evaluate(q):
        time.sleep(EVAL_SLEEP)
        return {"accuracy": 1.0}

    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0,
                            server_evaluate=server_evaluate if evaluate else None)
    t0 = time.time()
    strategy.start(grid)
    return cfg, strategy, t0, time.time()


@pytest.mark.parametrize("schedule", ["synchronous", "sequential", "asynchronous"])
def test_rows_carry_the_server_phases_and_the_round_time(schedule):
    cfg, strategy, t0, t1 = _run(schedule, evaluate=True)
    rows = strategy.history
    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3]
    stamps = [r["recorded-at"] for r in rows]
    assert t0 <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= t1
    starts = [r["started-at"] for r in rows]
    assert starts == sorted(starts) and all(a <= b for a, b in zip(starts, stamps))
    for r in rows:
        phases = {k.removeprefix("server-seconds-"): v for k, v in r.items() if k.startswith("server-seconds-")}
        assert set(phases) <= set(SERVER_PHASES)
        assert all(v >= 0.0 for v in phases.values())
        assert phases["evaluate"] >= EVAL_SLEEP
        # the phases are parts of the round (the round also holds sampling, encoding and bookkeeping)
        assert r["round-seconds"] >= sum(phases.values()) - 1e-9
    for r in rows[1:]:
        # the clients ran inside push (in-process Grid): at least one sleeping client per message pushed
        assert r["server-seconds-push"] >= CLIENT_SLEEP * r["sent"] - 1e-3, r
        assert r["server-seconds-apply"] > 0.0
        assert "server-seconds-wait" in r
    assert "client-evaluate" not in {k.removeprefix("server-seconds-") for r in rows for k in r}


def test_no_evaluate_phase_without_a_server_evaluation():
    _, strategy, _, _ = _run("synchronous", evaluate=False)
    assert all("server-seconds-evaluate" not in r for r in strategy.history)
    assert all(r["round-seconds"] >= 0.0 for r in strategy.history)


def test_client_evaluation_is_its_own_phase():
    raw = {**BASE, "num-server-rounds": 2, "evaluate-clients": True}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"}
             for m in range(cfg.num_clients)]

    def slow_evaluate(request, reply):
        if request.metadata.message_type == "evaluate":
            time.sleep(CLIENT_SLEEP)
        return [reply]

    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(InProcessGrid(client_app, nodes, raw, reply_hook=slow_evaluate))
    for r in strategy.history[1:]:
        assert r["server-seconds-client-evaluate"] >= CLIENT_SLEEP * cfg.num_clients - 1e-3
        assert r["server-seconds-push"] < r["server-seconds-client-evaluate"]  # evaluate's push is not train's


def test_timed_adds_up_and_rejects_unknown_phases():
    stats = RoundStats()
    for _ in range(2):
        with stats.timed("apply"):
            time.sleep(0.01)
    assert stats.phase_seconds["apply"] >= 0.02
    assert stats.as_metrics()["server-seconds-apply"] == stats.phase_seconds["apply"]
    with pytest.raises(AssertionError):
        with stats.timed("nap"):
            pass
