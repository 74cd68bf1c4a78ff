"""The ServerApp's pulls for replies back off while nothing arrives and start again fast after an arrival
(common/backoff.py, strategies/pgvi.py ``_reply_poll``), for the synchronous wait (``_collect``) and the
asynchronous schedule's loop; the results of a run do not depend on it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from common.backoff import GeometricBackoff
from common.config import parse_run_config
from common.problem import build_problem
from strategies import pgvi
from strategies.pgvi import POLL_FACTOR, PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_inprocess import BASE


def test_geometric_backoff_grows_caps_and_resets():
    b = GeometricBackoff(0.1, 1.0, 2.0)
    assert [b.next_wait() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    b.reset()
    assert b.next_wait() == 0.1
    flat = GeometricBackoff(0.5, 0.5, 1.0)
    assert [flat.next_wait() for _ in range(3)] == [0.5, 0.5, 0.5]
    busy = GeometricBackoff(0.0, 1.0, 1.5)  # in-process tests poll without waiting
    assert [busy.next_wait() for _ in range(3)] == [0.0, 0.0, 0.0]
    b.configure(0.3, 0.6, 3.0)
    assert [b.next_wait() for _ in range(3)] == pytest.approx([0.3, 0.6, 0.6])


@pytest.mark.parametrize(("args", "match"), [
    ((0.2, 0.1, 1.5), "first wait must be in"), ((-0.1, 1.0, 1.5), "first wait must be in"),
    ((0.1, 1.0, 0.5), "factor must be >= 1"), ((0.1, math.inf, 1.5), "cap must be a finite number"),
    ((math.nan, 1.0, 1.5), "first must be a finite number"), ((0.1, 1.0, True), "factor must be a finite number"),
])  # fmt: skip
def test_geometric_backoff_refuses_bad_settings(args, match):
    with pytest.raises(ValueError, match=match):
        GeometricBackoff(*args)


def test_strategy_refuses_a_poll_max_below_the_poll_interval():
    problem = build_problem(parse_run_config(BASE))
    with pytest.raises(ValueError, match="first wait must be in"):
        PGVIStrategy(problem, poll_interval=0.5, poll_max=0.2)


class ScriptedGrid:
    """``pull_messages`` answers from a script: one list of reply-to ids per call (missing: nothing)."""

    def __init__(self, script: list[list[str]]) -> None:
        self.script = list(script)
        self.pulls = 0

    def pull_messages(self, message_ids):
        self.pulls += 1
        ids = self.script.pop(0) if self.script else []
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i, src_node_id=7), has_error=lambda: False)
                for i in ids if i in message_ids]


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr(pgvi.time, "sleep", waits.append)
    return waits


def test_collect_backs_off_until_a_reply_then_starts_again(slept):
    strategy = PGVIStrategy(build_problem(parse_run_config(BASE)), poll_interval=0.1, poll_max=1.0)
    # 9 empty pulls, then 'a', 2 empty pulls, then 'b' and 'c' together
    grid = ScriptedGrid([[]] * 9 + [["a"]] + [[]] * 2 + [["b", "c"]])
    got = strategy._collect(grid, {"a": 1, "b": 2, "c": 3}, timeout=60)
    assert sorted(m.metadata.reply_to_message_id for m in got) == ["a", "b", "c"]
    growing = [min(1.0, 0.1 * POLL_FACTOR**k) for k in range(9)]
    assert slept == pytest.approx(growing + [0.1, 0.1 * POLL_FACTOR])  # reset by 'a'; no wait after the last
    assert grid.pulls == 13
    assert max(slept) == 1.0 and sum(1 for w in slept if w == 1.0) == 3  # capped at poll_max


def test_collect_pulls_again_at_once_after_a_partial_batch(slept):
    strategy = PGVIStrategy(build_problem(parse_run_config(BASE)), poll_interval=0.1, poll_max=1.0)
    grid = ScriptedGrid([["a"], ["b"], [], ["c"]])
    strategy._collect(grid, {"a": 1, "b": 2, "c": 3}, timeout=60)
    assert slept == [0.1] and grid.pulls == 4


class FakeClock:
    """``time`` for the strategy module: ``sleep`` advances ``time()`` instead of waiting."""

    def __init__(self) -> None:
        import time as real

        self._real, self.now, self.slept = real, 1_000_000.0, []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_collect_never_sleeps_past_its_timeout(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(pgvi, "time", clock)
    strategy = PGVIStrategy(build_problem(parse_run_config(BASE)), poll_interval=0.1, poll_max=1.0)
    start = clock.now
    assert strategy._collect(ScriptedGrid([]), {"a": 1}, timeout=2.0) == []
    assert clock.now - start == pytest.approx(2.0)  # the back-off alone would have slept 3.08 s by then
    assert clock.slept[-1] < 1.0 and sum(clock.slept) == pytest.approx(2.0)


def test_asynchronous_schedule_backs_off_between_replies_and_matches_the_exact_posterior(slept):
    """Replies held back for some pulls: the loop's waits grow by POLL_FACTOR while nothing arrives, up to
    ``poll_max``, and start again at ``poll_interval`` after a reply or a push; the posterior is the exact one."""
    from client.app import app as client_app
    from strategies.inprocess import InProcessGrid

    class Slow(InProcessGrid):
        """Each reply becomes visible only on the 7th pull that asks for it."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.age: dict[str, int] = {}

        def pull_messages(self, message_ids):
            out = []
            for k in [k for k in list(self._replies) if k.split("#")[0] in set(message_ids)]:
                self.age[k] = self.age.get(k, 0) + 1
                if self.age[k] >= 7:
                    out.append(self._replies.pop(k))
            return out

    raw = {**BASE, "schedule": "asynchronous", "num-server-rounds": 3}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    first, cap = 0.01, 0.04
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=first, poll_max=cap)
    strategy.start(Slow(client_app, nodes, raw))
    assert sum(strategy.ledger_versions.values()) >= 9
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    assert slept and all(w <= cap for w in slept)  # no other wait of the loop in this run
    assert slept[0] == first and cap in slept  # it starts fast and reaches the cap
    for prev, w in zip(slept, slept[1:]):
        assert w == first or w == pytest.approx(min(cap, prev * POLL_FACTOR)), (prev, w)
    assert sum(1 for w in slept if w == first) >= 3  # started again after replies
