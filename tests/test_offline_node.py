"""A client that dies mid-run while it stays listed (``InProcessGrid.kill_node``), as a SIGKILLed SuperNode does:
the SuperLink keeps listing it for some 40-60 s and accepts messages to it that are never answered.

For each schedule: the run is not stopped, every message to the dead node counts as failed only after
round-timeout-s, and the other clients' updates are applied: the posterior equals the independent closed form
(strategies/reference.py) of the ledger the run reached.  (test_inprocess's offline test removes the node from
the grid instead, so the server never sends it anything and no message ever fails.)
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Message

from client.app import app as client_app
from common import protocol as P
from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_inprocess import BASE, client_sites

TIMEOUT = 0.3  # round-timeout-s: small, so that each test takes seconds
VICTIM = "site-2"


class _Run:
    """One in-process run whose node of ``VICTIM`` can be killed from a round-end or reply hook."""

    def __init__(self, overrides: dict, reply_delay: float = 0.0) -> None:
        self.raw = {**BASE, "round-timeout-s": TIMEOUT, **overrides}
        self.cfg = parse_run_config(self.raw)
        nodes = [{"partition-id": m, "num-partitions": self.cfg.num_clients, "client-id": f"site-{m}"}
                 for m in range(self.cfg.num_clients)]
        self.reply_delay = reply_delay
        self.kill_on_round_end: int | None = None  # kill the victim when this round ends
        self.kill_after_reply: tuple[int, str] | None = None  # ... or when this (round, client)'s reply is delivered
        self.killed_at: float | None = None
        self.ledger_at_kill: dict[str, int] = {}
        self.round_end: dict[int, float] = {0: time.time()}
        self.grid = InProcessGrid(client_app, nodes, self.raw, reply_hook=self._reply_hook)
        self.strategy = PGVIStrategy(build_problem(self.cfg), poll_interval=0.005, poll_max=0.02,
                                     on_round_end=self._on_round_end, resend_first=0.1, resend_max=0.2)
        self.victim = next(n for n, ctx in self.grid.contexts.items() if ctx.node_config["client-id"] == VICTIM)

    def _kill(self) -> None:
        if self.killed_at is None:
            self.grid.kill_node(self.victim)
            self.killed_at = time.time()
            self.ledger_at_kill = dict(self.strategy.ledger_versions)

    def _on_round_end(self, rnd: int, row: dict) -> None:
        self.round_end[rnd] = time.time()
        if rnd == self.kill_on_round_end:
            self._kill()

    def _reply_hook(self, request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == "train":
            if self.reply_delay:
                time.sleep(self.reply_delay)  # the client's compute time
            config = request.content[P.CONFIG]
            if self.kill_after_reply == (int(config["server-round"]), str(config["client-id"])):
                self._kill()
        return [reply]

    def start(self) -> None:
        t0 = time.time()
        self.strategy.start(self.grid)
        self.seconds = time.time() - t0

    # what the tests check ------------------------------------------------------------------------
    def rows(self) -> dict[int, dict]:
        return {int(r["round"]): r for r in self.strategy.history if r["round"] >= 1}

    def dead_train_messages(self) -> list[tuple[float, Message]]:
        return [(t, m) for t, m in self.grid.dead_messages if m.metadata.message_type == "train"]

    def check_common(self) -> None:
        cfg, s, grid = self.cfg, self.strategy, self.grid
        assert self.killed_at is not None
        # the run went to its end: every round recorded, nothing raised
        assert sorted(self.rows()) == list(range(1, cfg.num_server_rounds + 1))
        # dead but listed: the server still saw the node and sent it messages, none of which was answered
        assert self.victim in grid.get_node_ids() and self.victim not in grid.offline
        assert self.dead_train_messages(), "the server sent the dead node nothing: it was not listed"
        assert all(int(m.metadata.dst_node_id) == self.victim for _, m in grid.dead_messages)
        # the victim's site is what it was when it died; the others' updates were applied
        assert s.ledger_versions[VICTIM] == self.ledger_at_kill[VICTIM] >= 1
        for cid in ("site-0", "site-1"):
            assert s.ledger_versions[cid] > self.ledger_at_kill[cid]
        # nothing rejected, except in the asynchronous schedule a live client's reply that came in the same pull as
        # the outcome closing the last round, or after it: rejected by design (its client's pending update is then
        # resolved against the ledger, which client_sites below checks); which replies do is down to timing
        late = [x for x in s.rejections
                if x["reason"] == "arrived after the last round" and x["round"] == cfg.num_server_rounds + 1
                and x["client-id"] != VICTIM]
        assert s.rejections == (late if cfg.schedule == "asynchronous" else []), s.rejections
        # the posterior is the independent closed form of the ledger reached
        expected = expected_posterior(cfg, s.ledger_versions)
        assert max_natural_diff(s.state.posterior, expected) < 1e-9
        assert s.state.check_invariant() < 1e-10
        for cid, site in client_sites(grid, s).items():  # the live clients' own sites agree with the ledger
            if cid != VICTIM:
                for k, v in s.state.sites[cid].to_numpy().items():
                    np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)
        assert self.seconds < 60  # bounded: no wait on the dead node beyond its timeouts


def _check_round_by_round(r: _Run, first_dead_round: int) -> None:
    """Synchronous / sequential: every round from ``first_dead_round`` on sends the dead node one message, which
    fails, the other two clients' updates being applied; the round waits round-timeout-s for it."""
    rows = r.rows()
    for rnd, row in rows.items():
        if rnd < first_dead_round:
            assert (row["sent"], row["applied"], row["failed"]) == (3, 3, 0), (rnd, row)
        else:
            assert (row["sent"], row["applied"], row["failed"]) == (3, 2, 1), (rnd, row)
    pushed = {int(m.content[P.CONFIG]["server-round"]): t for t, m in r.dead_train_messages()}
    assert sorted(pushed) == list(range(first_dead_round, r.cfg.num_server_rounds + 1))
    for rnd, t in pushed.items():  # failed only after the timeout: the round waited round-timeout-s for it
        assert r.round_end[rnd] - r.round_end[rnd - 1] >= TIMEOUT, (rnd, r.round_end)
        # the timeout starts just before the round's push, which runs the live in-process clients first
        assert r.round_end[rnd] - t >= 0.9 * TIMEOUT, (rnd, r.round_end[rnd] - t)
    assert r.strategy.ledger_versions == {"site-0": r.cfg.num_server_rounds, "site-1": r.cfg.num_server_rounds,
                                          VICTIM: first_dead_round - 1}


def test_synchronous_node_dying_after_round_1():
    r = _Run({"schedule": "synchronous", "num-server-rounds": 4})
    r.kill_on_round_end = 1
    r.start()
    r.check_common()
    _check_round_by_round(r, first_dead_round=2)


def test_sequential_node_dying_mid_round():
    """Killed while round 2 runs (after site-0's update, before its own turn); damping 0.5 so that the number of
    updates each site received shows in the posterior."""
    r = _Run({"schedule": "sequential", "num-server-rounds": 4, "damping": 0.5})
    r.kill_after_reply = (2, "site-0")
    r.start()
    r.check_common()
    _check_round_by_round(r, first_dead_round=2)


def test_asynchronous_node_dying_after_round_1():
    """The live clients take 40 ms per update (at least 19 live updates after the kill: over 0.75 s), so the dead
    node's message times out while the run goes on; its failure counts in the round in which it timed out, at least
    round-timeout-s after it was pushed."""
    r = _Run({"schedule": "asynchronous", "num-server-rounds": 8, "damping": 0.5}, reply_delay=0.04)
    r.kill_on_round_end = 1
    r.start()
    r.check_common()
    rows = r.rows()
    assert rows[1]["failed"] == 0 and rows[1]["applied"] == 3
    failed = sum(int(row["failed"]) for row in rows.values())
    dead = r.dead_train_messages()
    assert 1 <= failed <= len(dead)  # a message still in flight when the run ends is not counted
    first_failed_round = min(rnd for rnd, row in rows.items() if row["failed"] > 0)
    assert r.round_end[first_failed_round] - dead[0][0] >= TIMEOUT
    for rnd, row in rows.items():  # a round is 3 outcomes: live clients' applied updates and the dead node's timeouts
        assert row["applied"] + row["failed"] == 3, (rnd, row)
    assert sum(int(row["applied"]) for row in rows.values()) == sum(r.strategy.ledger_versions.values())
