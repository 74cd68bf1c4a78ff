"""Review of the schedules (synchronous, sequential, asynchronous) and their run-config keys.

(1) With partial participation (``fraction-train`` < 1) a round whose few sampled clients all failed does not stop
    the run while other clients are healthy: the run stops only once every usable client failed in its latest
    attempt with nothing applied since (the asynchronous rule); with full participation nothing changes.
(2) Asynchronous: a client whose updates are rejected as stale again and again is warned about (once a streak).
(3) Asynchronous: a round is as many outcomes as there are usable clients when it opens (clients that join later
    make the later rounds larger).
(4) Asynchronous: messages that could not be pushed are counted one outcome at a time (no round overshoots).
(5) ``fraction-train``: the number of clients sampled rounds halves up (``0.5 x 5 -> 3``), also in the config's
    aggregator warning.
(6) ``max-staleness``: a bool is refused, not read as 0 / 1.
"""

from __future__ import annotations

import httpx
import pytest
from flwr.app import Message

import strategies.pgvi as pgvi_module
from client.app import app as client_app
from common.config import ConfigError, clients_per_round, parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import AllClientsFailed, PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff

BASE = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "family": "full_covariance",
        "loss": "nll", "divergence": "kl", "num-clients": 3, "min-clients": 3, "num-server-rounds": 4,
        "evaluate-clients": False, "wait-for-clients-s": 0, "round-timeout-s": 5}


class _RecGrid(InProcessGrid):
    """Records every train push as (client-id, posterior-version, server-round)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pushes: list[tuple[str, int, int]] = []

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train":
                c = m.content["config"]
                self.pushes.append((c["client-id"], c["posterior-version"], c["server-round"]))
        return super().push_messages(messages)


def _setup(over=None, *, n=None, faults=None, grid_cls=_RecGrid, reply_hook=None, **strategy_kw):
    raw = {**BASE, **(over or {})}
    cfg = parse_run_config(raw)
    n = cfg.num_clients if n is None else n
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}",
              **({"fault": faults[m]} if faults and m in faults else {})} for m in range(n)]
    grid = grid_cls(client_app, nodes, raw, reply_hook=reply_hook)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, poll_max=0.002, **strategy_kw)
    return cfg, strategy, grid


def _rows(strategy):
    return [r for r in strategy.history if r["round"] >= 1]


def _warnings(monkeypatch) -> list[str]:
    logged: list[str] = []
    real = pgvi_module.log

    def record(level, msg, *args):
        if level == pgvi_module.WARNING:
            logged.append(msg % args if args else msg)
        real(level, msg, *args)

    monkeypatch.setattr(pgvi_module, "log", record)
    return logged


# ============================================================================================ (1)
def _lose_site_1_in_round_2(request: Message, reply: Message) -> list[Message]:
    cfg = request.content["config"] if request.metadata.message_type == "train" else None
    if cfg is not None and cfg["client-id"] == "site-1" and cfg["server-round"] == 2:
        return []  # the reply never arrives: a timeout
    return [reply]


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
@pytest.mark.parametrize("how", ["crash", "timeout"])
def test_partial_participation_one_failure_of_the_only_sampled_client_does_not_stop_the_run(schedule, how):
    """fraction-train 0.34 of 3 clients: one client a round.  site-1 (sampled in rounds 1 and 2 with seed 0)
    fails once in round 2; site-0 and site-2 are healthy.  The run must complete (a failing client keeps its site)."""
    over = {"schedule": schedule, "fraction-train": 0.34, "num-server-rounds": 8, "seed": 0, "round-timeout-s": 0.5}
    if how == "crash":
        cfg, strategy, grid = _setup(over, faults={1: "crash-before-reply@2"})
    else:
        cfg, strategy, grid = _setup(over, reply_hook=_lose_site_1_in_round_2)
    strategy.start(grid)
    rows = _rows(strategy)
    assert len(rows) == 8
    assert [r["sent"] for r in rows] == [1.0] * 8
    assert sum(r["failed"] for r in rows) == 1 and sum(r["applied"] for r in rows) == 7
    assert rows[1]["failed"] == 1.0  # round 2 did fail, and the run went on
    assert sum(strategy.ledger_versions.values()) == 7
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_partial_participation_stops_once_every_client_failed_in_its_latest_attempt(schedule):
    """Every client always fails: the run stops at the first round by which every client has been tried (not at
    round 1, where one of three failed), naming the clients."""
    over = {"schedule": schedule, "fraction-train": 0.34, "num-server-rounds": 40, "seed": 0, "max-bad-replies": 0}
    cfg, strategy, grid = _setup(over, faults={m: "crash-before-reply" for m in range(3)})
    with pytest.raises(AllClientsFailed, match=r"site-0, site-1, site-2.*crashed before staging") as ei:
        strategy.start(grid)
    tried: set[str] = set()
    first_all = None
    for cid, _, rnd in grid.pushes:
        tried.add(cid)
        if len(tried) == 3:
            first_all = rnd
            break
    assert first_all is not None and first_all > 1
    assert f"round {first_all}:" in str(ei.value)
    assert max(r for _, _, r in grid.pushes) == first_all  # nothing was sent after the stop
    assert sum(strategy.ledger_versions.values()) == 0


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_partial_participation_an_applied_update_forgives_earlier_failures(schedule):
    """site-1 and site-2 always fail, site-0 is healthy: the run never stops (each of site-0's updates is
    progress), however often the other two fail in a row."""
    over = {"schedule": schedule, "fraction-train": 0.34, "num-server-rounds": 12, "seed": 0, "max-bad-replies": 0}
    cfg, strategy, grid = _setup(over, faults={1: "crash-before-reply", 2: "crash-before-reply"})
    strategy.start(grid)
    assert len(_rows(strategy)) == 12
    assert strategy.ledger_versions["site-1"] == strategy.ledger_versions["site-2"] == 0
    assert strategy.ledger_versions["site-0"] >= 1


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_full_participation_still_stops_in_the_first_round_every_client_failed(schedule):
    cfg, strategy, grid = _setup({"schedule": schedule, "num-server-rounds": 4, "max-bad-replies": 0},
                                 faults={0: "crash-before-reply@2", 1: "crash-before-reply@2", 2: "crash-before-reply@2"})
    with pytest.raises(AllClientsFailed, match=r"round 2: all 3 client messages failed \(last reason: .*crashed"):
        strategy.start(grid)
    assert [int(r["round"]) for r in strategy.history] == [0, 1, 2]
    assert max(r for _, _, r in grid.pushes) == 2


def test_full_participation_a_round_with_an_excluded_client_and_failures_does_not_stop_the_run():
    """Round 2: site-0 sends an invalid Delta (excluded at once, max-bad-replies 1) while site-1 and site-2 fail.
    Not every message of the round failed, so the run goes on (as before): site-1 and site-2 update in round 3."""
    cfg, strategy, grid = _setup({"num-server-rounds": 3, "max-bad-replies": 1},
                                 faults={0: "nan@2", 1: "crash-before-reply@2", 2: "crash-before-reply@2"})
    strategy.start(grid)
    rows = _rows(strategy)
    assert [(r["rejected"], r["failed"]) for r in rows] == [(0.0, 0.0), (1.0, 2.0), (0.0, 0.0)]
    assert strategy.ledger_versions == {"site-0": 1, "site-1": 2, "site-2": 2}


# ============================================================================================ (2)
def test_a_client_always_rejected_as_stale_is_warned_about_once(monkeypatch):
    """max-staleness 1 with 3 equally fast clients: site-2's update is always the third of a burst (staleness 2)
    and is rejected every round.  One warning names it, the staleness and the bound (not one per message)."""
    logged = _warnings(monkeypatch)
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-server-rounds": 8, "max-staleness": 1,
                                  "damping": 0.5})
    strategy.start(grid)
    assert strategy.ledger_versions["site-2"] == 0  # the spec's rule is unchanged: stale updates are rejected
    assert len([r for r in strategy.rejections if "stale update" in str(r["reason"])]) == 8
    streak = [w for w in logged if "max-staleness" in w and "in a row" in w]
    assert len(streak) == 1, logged
    assert "'site-2'" in streak[0] and "staleness up to 2 >" in streak[0] and "max-staleness 1" in streak[0]
    assert "larger max-staleness" in streak[0]


def test_the_stale_streak_is_reset_by_an_applied_update(monkeypatch):
    logged = _warnings(monkeypatch)
    cfg, strategy, grid = _setup({"schedule": "asynchronous"})
    for _ in range(2):
        strategy._note_stale(1, "site-0", 5, 3)
    strategy._note_applied("site-0")
    for _ in range(2):
        strategy._note_stale(1, "site-0", 6, 3)
    assert not [w for w in logged if "in a row" in w]
    strategy._note_stale(2, "site-0", 7, 3)  # the third in a row since the applied one
    strategy._note_stale(2, "site-0", 7, 3)  # no second warning for the same streak
    streak = [w for w in logged if "in a row" in w]
    assert len(streak) == 1 and "'site-0'" in streak[0] and "staleness up to 7 > max-staleness 3" in streak[0]


def test_default_asynchronous_run_warns_about_no_stale_streak(monkeypatch):
    logged = _warnings(monkeypatch)
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-server-rounds": 6})
    strategy.start(grid)
    assert strategy.rejections == [] and not [w for w in logged if "in a row" in w]


# ============================================================================================ (3)
def test_asynchronous_rounds_grow_with_clients_that_join_later():
    """num-clients 4, min-clients 2: two nodes at the start, two more join after round 1.  From the round after
    they were identified, a round is 4 outcomes (it was 2 for the whole run)."""
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-clients": 4, "min-clients": 2,
                                  "num-server-rounds": 6, "damping": 0.25}, n=2)

    def join(rnd, row):
        if rnd == 1:
            for m in (2, 3):
                grid.add_node({"partition-id": m, "num-partitions": 4, "client-id": f"site-{m}"})

    strategy.on_round_end = join
    strategy.start(grid)
    rows = _rows(strategy)
    outcomes = [r["applied"] + r["rejected"] + r["failed"] for r in rows]
    assert outcomes == [2.0] + [4.0] * 5
    assert sum(strategy.ledger_versions.values()) == 22
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


def test_asynchronous_round_size_ignores_clients_that_never_connect():
    """num-clients 4 but only 2 ever connect (min-clients 2): rounds of 2 outcomes, and the run completes."""
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-clients": 4, "min-clients": 2,
                                  "num-server-rounds": 3, "damping": 0.25}, n=2)
    strategy.start(grid)
    assert [r["applied"] for r in _rows(strategy)] == [2.0, 2.0, 2.0]


# ============================================================================================ (4)
class _FailSecondPush(_RecGrid):
    """The replies come two per pull; the second train push (the two nodes those replies freed) fails with a
    transient error at every attempt until the round deadline; every other push succeeds."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.train_pushes = 0
        self.doomed: list[int] | None = None

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" for m in messages):
            if self.doomed is None:
                self.train_pushes += 1
                if self.train_pushes == 2:
                    self.doomed = [id(m) for m in messages]
            if self.doomed == [id(m) for m in messages]:  # a retry re-sends the same Message objects
                raise httpx.ConnectError("injected")
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        wanted = set(message_ids)
        keys = [k for k in self._replies if k.split("#")[0] in wanted][:2]
        return [self._replies.pop(k) for k in keys]


def test_a_failed_push_of_several_messages_does_not_overfill_a_round():
    cfg, strategy, grid = _setup({"schedule": "asynchronous", "num-server-rounds": 4, "round-timeout-s": 0.2,
                                  "damping": 0.5}, grid_cls=_FailSecondPush, retry_backoff=0.01,
                                 resend_first=0.01, resend_max=0.02)
    strategy.start(grid)
    assert grid.doomed is not None and len(grid.doomed) == 2
    rows = _rows(strategy)
    assert len(rows) == 4
    assert [r["applied"] + r["rejected"] + r["failed"] for r in rows] == [3.0] * 4
    assert sum(r["failed"] for r in rows) == 2
    assert rows[0]["failed"] == 1.0 and rows[1]["failed"] == 1.0  # the second failure opens round 2


# ============================================================================================ (5)
@pytest.mark.parametrize(("fraction", "n", "k"), [
    (0.5, 5, 3), (0.625, 4, 3), (0.7, 5, 4), (0.3, 5, 2), (0.1, 3, 1), (0.34, 3, 1), (0.67, 3, 2), (1.0, 2, 2),
    (0.5, 1, 1), (0.5, 2, 1), (0.5, 6, 3), (0.05, 1000, 50), (0.5, 9, 5), (0.25, 10, 3),
])
def test_clients_per_round_rounds_halves_up(fraction, n, k):
    from common.config import clients_per_round

    assert clients_per_round(fraction, n) == k


@pytest.mark.parametrize(("fraction", "n", "k"), [(0.5, 5, 3), (0.625, 4, 3), (0.3, 5, 2), (0.4, 5, 2)])
def test_the_strategy_samples_clients_per_round_clients(fraction, n, k):
    cfg, strategy, grid = _setup({"num-clients": n, "min-clients": n, "fraction-train": fraction,
                                  "num-server-rounds": 2})
    strategy.start(grid)
    assert [r["sent"] for r in _rows(strategy)] == [float(k)] * 2


def test_the_aggregator_warning_counts_the_clients_the_strategy_samples():
    """A median over 3 Deltas (0.5 x 5 rounded half up) does bound a client; over 2 (round half to even) not."""
    cfg = parse_run_config({**BASE, "num-clients": 5, "min-clients": 2, "fraction-train": 0.5, "aggregator": "median"})
    assert cfg.aggregator_warning() is None
    cfg = parse_run_config({**BASE, "num-clients": 5, "min-clients": 2, "fraction-train": 0.3, "aggregator": "median"})
    assert "median of 2" in (cfg.aggregator_warning() or "")


# ============================================================================================ (6)
@pytest.mark.parametrize("value", [True, False])
def test_max_staleness_refuses_a_bool(value):
    with pytest.raises(ConfigError, match=r"max-staleness: .*integer >= 0 or 'auto'.*got (True|False)"):
        parse_run_config({**BASE, "max-staleness": value})


@pytest.mark.parametrize(("value", "bound"), [(0, 0), (1, 1), (7, 7), ("auto", 3)])
def test_max_staleness_still_takes_integers_and_auto(value, bound):
    assert parse_run_config({**BASE, "max-staleness": value}).staleness_bound() == bound


@pytest.mark.parametrize("value", [-1, 1.5, "never"])
def test_max_staleness_still_refuses_other_values(value):
    with pytest.raises(ConfigError, match="max-staleness"):
        parse_run_config({**BASE, "max-staleness": value})


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_a_run_whose_every_message_failed_ends_as_a_failure(schedule):
    """fraction-train 0.34 of 3 clients, every client always fails, 2 rounds: the samples need not cover every
    client, so no round stops the run; it still must not end as if it had completed: the last round raises."""
    over = {"schedule": schedule, "fraction-train": 0.34, "num-server-rounds": 2, "seed": 0, "max-bad-replies": 0}
    cfg, strategy, grid = _setup(over, faults={m: "crash-before-reply" for m in range(3)})
    with pytest.raises(AllClientsFailed, match=r"round 2: no update was applied in rounds 1-2: all 2 client messages"):
        strategy.start(grid)
    assert [int(r["round"]) for r in strategy.history] == [0, 1, 2]
    assert sum(strategy.ledger_versions.values()) == 0


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_a_run_with_one_applied_update_is_not_a_failure(schedule):
    over = {"schedule": schedule, "fraction-train": 0.34, "num-server-rounds": 6, "seed": 0, "max-bad-replies": 0}
    cfg, strategy, grid = _setup(over, faults={1: "crash-before-reply", 2: "crash-before-reply"})
    strategy.start(grid)
    assert len(_rows(strategy)) == 6 and strategy.ledger_versions["site-0"] >= 1


@pytest.mark.parametrize(("fraction", "n", "k"), [(0.58, 25, 15), (0.7, 45, 32), (0.29, 50, 15), (0.145, 100, 15)])
def test_clients_per_round_rounds_decimal_halves_up_exactly(fraction, n, k):
    """fraction x n is an exact half in decimal but just below it in floats (0.58 x 25 = 14.4999...)."""
    assert clients_per_round(fraction, n) == k
