"""Update tags: the server names the staged update that produced each client's ledger site, so a client never
commits a staged update the server did not apply (common/client_state.py, strategies/pgvi.py).

The defect: two train messages for one node may execute at once (Flower starts a ClientApp process per message:
the server times message A out and sends B at the same site version while A still runs), or one message may be
executed twice.  Both stage ``site * Delta`` as version v + 1, the last save wins, and the server applied the
other one: with versions alone the client then commits a site the ledger does not have, silently.  With tags the
client sees that the server applied another of its updates, drops its pending one and asks for its ledger site.

Also: a train config with ``has-site`` but no (or a malformed) site record, and a rho outside (0, 1].
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

import client.app as app_module
from client.app import app as client_app
from client.node_request import Request
from common import protocol as P
from common.atomic_io import atomic_save_npz, load_npz
from common.client_state import ClientState
from common.config import parse_run_config
from common.problem import build_problem
from strategies.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy, RoundStats
from tests.test_inprocess import BASE

# non-conjugate (alpha-Renyi local step, MC-seeded by the server round): the new site depends on the message, so
# two updates staged against the same site version differ (in the conjugate model both would be the same site)
RAW = {**BASE, "num-server-rounds": 1, "divergence": "alpha_renyi", "divergence-alpha": 2.0, "local-epochs": 2}
CID = "site-0"


def _warm(state_dir: Path | None) -> tuple[PGVIStrategy, InProcessGrid, int]:
    """The real strategy and ClientApp after one synchronous round (every ledger version 1)."""
    cfg = parse_run_config(RAW)
    extra = {"state-dir": str(state_dir)} if state_dir is not None else {}
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}", **extra}
             for m in range(cfg.num_clients)]
    grid = InProcessGrid(client_app, nodes, RAW)
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    s.start(grid)
    assert s.ledger_versions == {"site-0": 1, "site-1": 1, "site-2": 1} and not s.rejections
    node = next(n for n, c in s.node_client.items() if c == CID)
    return s, grid, node


def _call(grid: InProcessGrid, node: int, msg: Message) -> Message:
    """Execute a train message on ``node`` (as a SuperNode does: one ClientApp call per execution)."""
    msg.metadata.__dict__["_message_id"] = f"m{id(msg)}-{threading.get_ident()}"
    reply = client_app(msg, grid.contexts[node])
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


def _deliver(s: PGVIStrategy, rnd: int, replies: list[Message]) -> RoundStats:
    stats = RoundStats()
    s._apply_batch(rnd, s._decode_replies(rnd, replies, stats), stats)
    return stats


def _client_state(grid: InProcessGrid, node: int, state_dir: Path | None) -> ClientState:
    if state_dir is not None:
        return ClientState.load(state_dir, CID)
    ctx = grid.contexts[node]
    arrays = {k: a.numpy() for k, a in ctx.state["pgvi-site"].items()}
    return ClientState.from_arrays(arrays, dict(ctx.state["pgvi-meta"]))


def _status(reply: Message) -> str:
    assert not reply.has_error(), reply.error.reason
    return str(reply.content[P.CONFIG]["status"])


def _max_diff(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> float:
    assert a is not None and a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in b)


def _next_messages_agree_with_the_ledger(s: PGVIStrategy, grid: InProcessGrid, node: int, state_dir: Path | None,
                                         first_round: int) -> None:
    """The next messages: the client computes only on its ledger site (after a resync if it must ask), and once
    its update is applied its site and the ledger's agree."""
    for i in range(3):
        rnd = first_round + i
        ledger_site = s.state.sites[CID].to_numpy()
        reply = _call(grid, node, s._train_message(node, rnd))
        status = _status(reply)
        if i == 0:  # the server applied another update of this client than the one it staged: it must ask
            assert status == P.STATUS_RESYNC and not _client_state(grid, node, state_dir).pending_site
        if status == P.STATUS_RESYNC:
            assert _deliver(s, rnd, [reply]).resync == 1 and CID in s.resync
            continue
        assert status == P.STATUS_OK, reply.content[P.CONFIG].get("reason")
        st = _client_state(grid, node, state_dir)
        assert _max_diff(st.site, ledger_site) <= 1e-12, "the client computed on a site the ledger does not have"
        assert _deliver(s, rnd, [reply]).applied == 1
        st.reconcile(s.ledger_versions[CID], None, s.ledger_tags[CID])
        assert _max_diff(st.site, s.state.sites[CID].to_numpy()) <= 1e-12
        return
    pytest.fail("the client never got back in line with the ledger")


# ===================================================================================================
# the race: two train messages for one node at the same site version, executing at once
@pytest.mark.parametrize("storage", ["state-dir", "in-memory"])
def test_concurrent_train_messages_never_leave_the_client_on_a_site_the_ledger_lacks(tmp_path, monkeypatch, storage):
    state_dir = tmp_path / "state" if storage == "state-dir" else None
    s, grid, node = _warm(state_dir)
    msg_a = s._train_message(node, 2)  # A: the server times it out ...
    other = next(n for n, c in s.node_client.items() if c == "site-1")  # ... meanwhile another client updates
    assert _deliver(s, 2, [_call(grid, other, s._train_message(other, 2))]).applied == 1
    msg_b = s._train_message(node, 3)  # B: a newer posterior, the same site version
    assert msg_a.content[P.CONFIG]["site-version"] == msg_b.content[P.CONFIG]["site-version"] == 1

    real_compute = app_module._compute
    a_loaded, release_a = threading.Event(), threading.Event()

    def slow_a(request, context):  # A has loaded the client state, then is slow (hung worker, big shard, ...)
        if request.config["server-round"] == 2:
            a_loaded.set()
            assert release_a.wait(60)
        return real_compute(request, context)

    monkeypatch.setattr(app_module, "_compute", slow_a)
    out: dict[str, Message] = {}
    thread = threading.Thread(target=lambda: out.__setitem__("A", _call(grid, node, msg_a)))
    thread.start()
    assert a_loaded.wait(60)
    reply_b = _call(grid, node, msg_b)  # B runs to completion: stages and saves its update
    release_a.set()
    thread.join(60)
    assert _status(out["A"]) == _status(reply_b) == P.STATUS_OK  # A saved its own staged update over B's
    monkeypatch.setattr(app_module, "_compute", real_compute)

    assert _deliver(s, 3, [reply_b]).applied == 1  # the server applies B; A's reply is never pulled
    st = _client_state(grid, node, state_dir)
    assert st.pending_version == 2 and _max_diff(st.pending_site, s.state.sites[CID].to_numpy()) > 1e-6
    _next_messages_agree_with_the_ledger(s, grid, node, state_dir, first_round=4)


@pytest.mark.parametrize("storage", ["state-dir", "in-memory"])
def test_re_executed_message_whose_first_reply_is_applied(tmp_path, monkeypatch, storage):
    state_dir = tmp_path / "state" if storage == "state-dir" else None
    s, grid, node = _warm(state_dir)
    msg = s._train_message(node, 2)
    first = _call(grid, node, msg)
    # the same message executed again (a re-delivery): its computation need not repeat the first bit for bit (warm
    # worker vs ClientApp process, thread counts, a BNN's MC noise, ...); another damping stands for that here
    real_compute = app_module._compute

    def other_run(request, context):
        request.config["rho"] = 0.5 * float(request.config["rho"])
        return real_compute(request, context)

    monkeypatch.setattr(app_module, "_compute", other_run)
    second = _call(grid, node, msg)
    monkeypatch.setattr(app_module, "_compute", real_compute)
    assert _status(first) == _status(second) == P.STATUS_OK

    assert _deliver(s, 2, [first]).applied == 1  # the first reply is applied, the second one is never pulled
    st = _client_state(grid, node, state_dir)
    assert _max_diff(st.pending_site, s.state.sites[CID].to_numpy()) > 1e-6  # the client staged the second one
    _next_messages_agree_with_the_ledger(s, grid, node, state_dir, first_round=3)


# ===================================================================================================
# the tag on the wire and in the ledger
def test_train_messages_carry_the_tag_of_the_applied_update(tmp_path):
    s, grid, node = _warm(None)
    reply = _call(grid, node, s._train_message(node, 2))
    tag = reply.content[P.CONFIG][P.UPDATE_TAG]
    assert isinstance(tag, str) and tag
    assert _deliver(s, 2, [reply]).applied == 1
    assert s.ledger_tags[CID] == tag and s._train_message(node, 3).content[P.CONFIG][P.SITE_TAG] == tag
    # a second execution of the next message: two replies with their own tags against the same site version
    msg = s._train_message(node, 3)
    first, second = _call(grid, node, msg), _call(grid, node, msg)
    tag2, tag3 = first.content[P.CONFIG][P.UPDATE_TAG], second.content[P.CONFIG][P.UPDATE_TAG]
    assert len({tag, tag2, tag3}) == 3
    assert _deliver(s, 3, [first]).applied == 1 and s.ledger_tags[CID] == tag2
    # the other one is rejected (stale base version): the ledger's tag stays, the client will get its site
    stats = _deliver(s, 3, [second])
    assert stats.rejected == 1 and s.ledger_tags[CID] == tag2 and CID in s.resync
    # a resent site carries the tag; the client adopts both
    resend = s._train_message(node, 4)
    assert resend.content[P.CONFIG]["has-site"] and resend.content[P.CONFIG][P.SITE_TAG] == tag2
    # removing the site (exclusion) resets the tag
    s._remove_site(CID)
    assert s.ledger_versions[CID] == 0 and s.ledger_tags.get(CID, "") == ""
    assert s._train_message(node, 5).content[P.CONFIG][P.SITE_TAG] == ""


def test_checkpoint_keeps_the_tags_and_an_old_checkpoint_loads(tmp_path):
    s, grid, node = _warm(None)
    assert all(s.ledger_tags.get(c) for c in s.ledger_versions)  # round 1's replies carried tags
    save_checkpoint(s, tmp_path)
    resumed = PGVIStrategy(build_problem(parse_run_config(RAW)), poll_interval=0.0)
    load_checkpoint(resumed, tmp_path)
    assert resumed.ledger_tags == s.ledger_tags
    # a checkpoint written before tags existed: it loads, every tag unknown (the clients commit by version)
    arrays, meta = load_npz(tmp_path / CHECKPOINT_FILE)
    del meta["ledger-tags"]
    atomic_save_npz(tmp_path / CHECKPOINT_FILE, arrays, meta)
    old = PGVIStrategy(build_problem(parse_run_config(RAW)), poll_interval=0.0)
    load_checkpoint(old, tmp_path)
    assert old.ledger_tags == {} and old.ledger_versions == s.ledger_versions
    old.node_client = dict(s.node_client)
    msg = old._train_message(node, 2)
    assert msg.content[P.CONFIG][P.SITE_TAG] == "" and msg.content[P.CONFIG]["site-version"] == 1
    assert _status(_call(grid, node, msg)) == P.STATUS_OK  # the client's pending version 1 is committed by version


def test_an_old_server_without_tags_still_commits_by_version(tmp_path):
    s, grid, node = _warm(tmp_path / "state")
    msg = s._train_message(node, 2)
    del msg.content[P.CONFIG][P.SITE_TAG]  # what a server before tags sends
    reply = _call(grid, node, msg)
    assert _status(reply) == P.STATUS_OK and reply.content[P.CONFIG][P.UPDATE_TAG]
    st = ClientState.load(tmp_path / "state", CID)
    assert st.version == 1 and st.pending_version == 2 and st.pending_tag == reply.content[P.CONFIG][P.UPDATE_TAG]
    assert _deliver(s, 2, [reply]).applied == 1
    nxt = s._train_message(node, 3)
    del nxt.content[P.CONFIG][P.SITE_TAG]
    assert _status(_call(grid, node, nxt)) == P.STATUS_OK
    st = ClientState.load(tmp_path / "state", CID)
    assert st.version == 2 and _max_diff(st.site, s.state.sites[CID].to_numpy()) <= 1e-12


def test_client_state_reconcile_with_tags():
    site = {"eta1/x": np.ones(2), "eta2/x": -np.ones(2)}
    st = ClientState(site=site, version=3, tag="t3")
    tag = st.stage({k: 2 * v for k, v in site.items()})
    assert tag and st.pending_tag == tag and st.pending_version == 4
    other = ClientState.from_arrays(*st.to_arrays())
    assert (other.tag, other.pending_tag) == ("t3", tag)
    # the server applied another update of this client at version 4: drop the pending one, ask for the site
    assert not other.reconcile(4, None, "someone-else")
    assert other.pending_site is None and other.version == 3
    # the server applied this one: commit
    c = ClientState.from_arrays(*st.to_arrays())
    assert c.reconcile(4, None, tag) and c.version == 4 and c.tag == tag and c.pending_site is None
    # old server (no tag): commit by version
    c = ClientState.from_arrays(*st.to_arrays())
    assert c.reconcile(4, None, "") and c.version == 4
    # the ledger is still at version 3 with the committed site's tag: roll back
    c = ClientState.from_arrays(*st.to_arrays())
    assert c.reconcile(3, None, "t3") and c.version == 3 and c.pending_site is None
    # the ledger's version-3 site is not the one this client committed: ask for it
    c = ClientState.from_arrays(*st.to_arrays())
    assert not c.reconcile(3, None, "not-t3")
    # a resent site is adopted with its tag
    assert c.reconcile(3, site, "ledger-tag") and c.tag == "ledger-tag" and c.version == 3
    # a state saved before tags existed loads with empty tags
    arrays, meta = st.to_arrays()
    meta = {k: v for k, v in meta.items() if "tag" not in k}
    old = ClientState.from_arrays(arrays, meta)
    assert (old.tag, old.pending_tag) == ("", "")


# ===================================================================================================
# malformed train configs: has-site without a site, rho outside (0, 1]
SIMPLE = {k: v for k, v in BASE.items()}


def _request(config: dict, state: ClientState, site=None) -> Request:
    prior = build_problem(parse_run_config(SIMPLE)).prior.to_numpy()
    return Request(kind="train", run_config=SIMPLE, node_config={"partition-id": 0, "num-partitions": 3},
                   posterior=prior, config={"server-round": 1, "posterior-version": 0, **config}, site=site,
                   state=state)


@pytest.mark.parametrize("site", ["absent", "empty", "wrong-name", "wrong-shape", "non-finite"])
def test_has_site_without_a_valid_site_asks_for_the_site_and_keeps_the_state(site):
    from client.pgvi_client import handle

    prior = build_problem(parse_run_config(SIMPLE)).prior.to_numpy()
    arrays = {
        "absent": None,
        "empty": {},
        "wrong-name": {("x" + k): v for k, v in prior.items()},
        "wrong-shape": {k: np.zeros(v.size + 1) for k, v in prior.items()},
        "non-finite": {k: np.full_like(v, np.nan) for k, v in prior.items()},
    }[site]
    state = ClientState(site={k: np.zeros_like(v) for k, v in prior.items()}, version=2, tag="t2")
    res = handle(_request({"site-version": 3, "has-site": True}, state, arrays))
    assert res.metrics["status"] == P.STATUS_RESYNC and "site" in str(res.metrics["reason"])
    assert res.state.version == 2 and res.state.tag == "t2" and res.state.site is not None
    assert res.state.site.keys() == prior.keys() and not res.delta


def test_has_site_without_a_site_makes_the_server_resend_it(tmp_path):
    s, grid, node = _warm(tmp_path / "state")
    before = ClientState.load(tmp_path / "state", CID)
    msg = s._train_message(node, 2)
    msg.content[P.CONFIG]["has-site"] = True  # ... but no site record
    reply = _call(grid, node, msg)
    assert _status(reply) == P.STATUS_RESYNC
    _deliver(s, 2, [reply])
    assert CID in s.resync
    st = ClientState.load(tmp_path / "state", CID)  # unchanged: no empty site adopted and saved
    assert (st.site, st.version, st.pending_version, st.pending_tag) == (None, 0, 1, before.pending_tag)
    resend = s._train_message(node, 3)
    assert resend.content[P.CONFIG]["has-site"] and P.SITE in resend.content
    assert _status(_call(grid, node, resend)) == P.STATUS_OK


@pytest.mark.parametrize("rho", [1.5, 0.0, -0.5, float("nan"), float("inf"), "abc"])
def test_rho_outside_the_unit_interval_is_a_failed_reply(rho):
    from client.pgvi_client import handle

    res = handle(_request({"site-version": 0, "rho": rho}, ClientState()))
    assert res.metrics["status"] == P.STATUS_FAILED and "rho" in str(res.metrics["reason"])
    assert res.state.pending_site is None and not res.delta
