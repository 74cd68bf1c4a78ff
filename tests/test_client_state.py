"""Tests of common.client_state: the exactly-once site protocol (ClientState.reconcile / stage) against a tiny
fake server ledger that applies a Delta only when its base version matches (as strategies/pgvi.py does), the
scenarios of common/protocol.py (lost reply, duplicate delivery, restart with and without disk), and the
atomic, path-safe persistence."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from common import client_state as cs_mod
from common.client_state import ClientState
from common.protocol import UNKNOWN_VERSION

KEYS = {"eta1/layer.weight": (3, 2), "eta2/layer.weight": (3, 2), "eta1/b": (4,), "eta2/b": (4,)}


def arrays(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: scale * rng.standard_normal(s) for k, s in KEYS.items()}


def zeros() -> dict[str, np.ndarray]:
    return {k: np.zeros(s) for k, s in KEYS.items()}


def add(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: a[k] + b[k] for k in a}


def assert_arrays_equal(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray] | None) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype


# ===================================================================================================
# reconcile / stage: the unit rules
def test_fresh_state():
    s = ClientState()
    assert s.site is None and s.version == 0 and s.pending_site is None and s.pending_version is None
    assert s.reconcile(0, None) is True
    assert s.site is None and s.version == 0


def test_stage_keeps_a_copy_at_version_plus_one():
    rng = np.random.default_rng(0)
    s = ClientState()
    new = arrays(rng)
    s.stage(new)
    assert s.pending_version == 1 and s.version == 0 and s.site is None
    assert_arrays_equal(s.pending_site, new)
    new["eta1/b"][0] = 99.0
    assert s.pending_site["eta1/b"][0] != 99.0


def test_commit_when_ledger_has_pending_version():
    rng = np.random.default_rng(1)
    s = ClientState(site=arrays(rng), version=4)
    new = arrays(rng)
    s.stage(new)
    assert s.reconcile(5, None) is True
    assert s.version == 5 and s.pending_site is None and s.pending_version is None
    assert_arrays_equal(s.site, new)


def test_rollback_when_ledger_has_committed_version():
    rng = np.random.default_rng(2)
    old = arrays(rng)
    s = ClientState(site={k: v.copy() for k, v in old.items()}, version=4)
    s.stage(arrays(rng))
    assert s.reconcile(4, None) is True
    assert s.version == 4 and s.pending_site is None and s.pending_version is None
    assert_arrays_equal(s.site, old)


def test_adopt_ledger_site_drops_pending():
    rng = np.random.default_rng(3)
    s = ClientState(site=arrays(rng), version=4)
    s.stage(arrays(rng))
    ledger = arrays(rng)
    assert s.reconcile(9, ledger) is True
    assert s.version == 9 and s.pending_site is None and s.pending_version is None
    assert_arrays_equal(s.site, ledger)
    ledger["eta2/b"][1] = 42.0  # the state owns a copy
    assert s.site["eta2/b"][1] != 42.0


def test_unknown_ledger_version():
    rng = np.random.default_rng(4)
    s = ClientState(site=arrays(rng), version=2)
    assert s.reconcile(UNKNOWN_VERSION, None) is True  # nothing pending: safe
    assert s.version == 2
    s.stage(arrays(rng))
    assert s.reconcile(UNKNOWN_VERSION, None) is False  # pending: cannot tell whether it was applied
    assert s.pending_version == 3  # nothing is dropped while undecided


@pytest.mark.parametrize("ledger_version", [1, 3, 7, 100])
def test_inconsistent_version_without_site_asks_resync(ledger_version):
    rng = np.random.default_rng(5)
    site = arrays(rng)
    s = ClientState(site={k: v.copy() for k, v in site.items()}, version=5)
    s.stage(arrays(rng))  # pending version 6
    before = (s.version, s.pending_version)
    assert s.reconcile(ledger_version, None) is False
    assert (s.version, s.pending_version) == before
    assert_arrays_equal(s.site, site)
    # without a pending update as well
    t = ClientState(site=site, version=5)
    assert t.reconcile(ledger_version if ledger_version != 5 else 6, None) is False


# ===================================================================================================
# a tiny fake server ledger (the server half of the protocol, as in strategies/pgvi.py)
@dataclass
class Reply:
    client_id: str
    status: str
    base_version: int
    delta: dict[str, np.ndarray] | None = None


@dataclass
class FakeLedger:
    versions: dict[str, int] = field(default_factory=dict)
    sites: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    resync: set[str] = field(default_factory=set)
    applied: list[tuple[str, int]] = field(default_factory=list)
    rejected: list[tuple[str, int]] = field(default_factory=list)

    def register(self, cid: str) -> None:
        self.versions.setdefault(cid, 0)
        self.sites.setdefault(cid, zeros())

    def message(self, cid: str) -> tuple[int, dict[str, np.ndarray] | None]:
        site = {k: v.copy() for k, v in self.sites[cid].items()} if cid in self.resync else None
        return self.versions.get(cid, UNKNOWN_VERSION), site

    def receive(self, reply: Reply) -> bool:
        cid = reply.client_id
        if reply.status == "resync":
            self.resync.add(cid)
            return False
        if reply.base_version != self.versions.get(cid):
            self.resync.add(cid)
            self.rejected.append((cid, reply.base_version))
            return False
        self.sites[cid] = add(self.sites[cid], reply.delta)
        self.versions[cid] += 1
        self.resync.discard(cid)
        self.applied.append((cid, reply.base_version))
        return True


@dataclass
class FakeClient:
    cid: str
    rng: np.random.Generator
    state: ClientState = field(default_factory=ClientState)

    def committed_site(self) -> dict[str, np.ndarray]:
        return zeros() if self.state.site is None else self.state.site

    def train(self, ledger_version: int, ledger_site) -> Reply:
        """What client/app.py's fit does, minus the GVI step: reconcile, compute a Delta, stage t * Delta."""
        if not self.state.reconcile(ledger_version, ledger_site):
            return Reply(self.cid, "resync", self.state.version)
        delta = arrays(self.rng, 0.1)
        self.state.stage(add(self.committed_site(), delta))
        return Reply(self.cid, "ok", self.state.version, delta)


def _check_in_sync(client: FakeClient, ledger: FakeLedger) -> None:
    assert client.state.version == ledger.versions[client.cid]
    for k, v in ledger.sites[client.cid].items():
        np.testing.assert_allclose(client.committed_site()[k], v, rtol=0, atol=1e-12)


def test_scenario_normal_rounds():
    ledger, c = FakeLedger(), FakeClient("a", np.random.default_rng(10))
    ledger.register("a")
    for rnd in range(4):
        r = c.train(*ledger.message("a"))
        assert r.status == "ok" and r.base_version == rnd
        assert ledger.receive(r)
    assert c.state.reconcile(*ledger.message("a")) is True
    _check_in_sync(c, ledger)
    assert c.state.version == 4


def test_scenario_reply_lost_after_client_updated_rolls_back():
    ledger, c = FakeLedger(), FakeClient("a", np.random.default_rng(11))
    ledger.register("a")
    ledger.receive(c.train(*ledger.message("a")))  # version 1 applied
    before = {k: v.copy() for k, v in ledger.sites["a"].items()}
    c.train(*ledger.message("a"))  # client stages version 2 ...
    assert c.state.pending_version == 2  # ... and the reply is lost
    r = c.train(*ledger.message("a"))  # next message still says version 1
    assert r.status == "ok" and r.base_version == 1  # rolled back, then computed against version 1
    assert c.state.version == 1
    assert_arrays_equal(c.state.site, before)
    assert ledger.receive(r)
    assert c.state.reconcile(*ledger.message("a"))
    _check_in_sync(c, ledger)


def test_scenario_duplicate_delivery_is_applied_once():
    ledger, c = FakeLedger(), FakeClient("a", np.random.default_rng(12))
    ledger.register("a")
    r = c.train(*ledger.message("a"))
    assert ledger.receive(r) is True
    assert ledger.receive(r) is False  # the duplicate: base version 0 != ledger version 1
    np.testing.assert_array_equal(ledger.sites["a"]["eta1/b"], r.delta["eta1/b"])  # once, not twice
    assert ledger.applied == [("a", 0)] and ledger.rejected == [("a", 0)]
    # the server also asks for a resync after the duplicate; the client adopts the (identical) ledger site
    assert c.state.reconcile(*ledger.message("a")) is True
    _check_in_sync(c, ledger)
    assert c.state.pending_site is None


def test_scenario_duplicate_without_resync_commits():
    ledger, c = FakeLedger(), FakeClient("a", np.random.default_rng(13))
    ledger.register("a")
    r = c.train(*ledger.message("a"))
    ledger.receive(r)
    ledger.receive(r)
    ledger.resync.clear()  # even if the server did not resend the site, the version confirms the commit
    assert c.state.reconcile(*ledger.message("a")) is True
    _check_in_sync(c, ledger)


def test_scenario_client_restart_without_disk_resyncs_then_adopts():
    ledger, c = FakeLedger(), FakeClient("a", np.random.default_rng(14))
    ledger.register("a")
    for _ in range(3):
        ledger.receive(c.train(*ledger.message("a")))
    c.state = ClientState()  # restart, state lost
    r = c.train(*ledger.message("a"))  # ledger says version 3, client knows version 0 and nothing pending
    assert r.status == "resync"
    assert ledger.receive(r) is False and "a" in ledger.resync
    r = c.train(*ledger.message("a"))  # the site comes along now: adopt, then update
    assert r.status == "ok" and r.base_version == 3
    assert ledger.receive(r)
    assert c.state.reconcile(*ledger.message("a"))
    _check_in_sync(c, ledger)


@pytest.mark.parametrize("server_applied", [True, False])
def test_scenario_client_restart_with_disk_keeps_pending(tmp_path, server_applied):
    ledger, c = FakeLedger(), FakeClient("a", np.random.default_rng(15))
    ledger.register("a")
    ledger.receive(c.train(*ledger.message("a")))
    r = c.train(*ledger.message("a"))
    c.state.save(tmp_path, "a")  # what client/app.py does before replying
    if server_applied:
        ledger.receive(r)
    c.state = ClientState.load(tmp_path, "a")  # SuperNode restart
    assert c.state.pending_version == 2
    assert c.state.reconcile(*ledger.message("a")) is True  # commit or roll back, no resync needed
    _check_in_sync(c, ledger)


@pytest.mark.parametrize("seed", range(5))
def test_random_faults_keep_client_and_ledger_consistent(seed, tmp_path):
    """Lost replies, duplicates, restarts with and without disk, in random order: whenever a client is allowed to
    compute a Delta its committed site is exactly the ledger's, and every Delta is applied at most once."""
    rnd = random.Random(seed)
    ledger = FakeLedger()
    clients = {cid: FakeClient(cid, np.random.default_rng(100 * seed + i)) for i, cid in enumerate("abc")}
    for cid in clients:
        ledger.register(cid)
    sent: dict[tuple[str, int, int], dict[str, np.ndarray]] = {}
    applied_ids: list[int] = []
    n_ok = 0
    for step in range(120):
        cid = rnd.choice("abc")
        c = clients[cid]
        event = rnd.random()
        if event < 0.1:
            c.state = ClientState()  # restart without disk
            continue
        if event < 0.2:
            c.state.save(tmp_path, cid)
            c.state = ClientState.load(tmp_path, cid)  # restart with disk
            continue
        version, site = ledger.message(cid)
        if not c.state.reconcile(version, site):
            ledger.receive(Reply(cid, "resync", c.state.version))
            continue
        _check_in_sync(c, ledger)  # the invariant the protocol exists for
        delta = arrays(c.rng, 0.1)
        c.state.stage(add(c.committed_site(), delta))
        reply = Reply(cid, "ok", c.state.version, delta)
        sent[(cid, c.state.version, step)] = delta
        fate = rnd.random()
        if fate < 0.2:
            continue  # reply lost
        copies = 2 if fate > 0.85 else 1  # duplicate delivery
        for _ in range(copies):
            if ledger.receive(reply):
                applied_ids.append(step)
                n_ok += 1
    assert n_ok > 20
    assert len(applied_ids) == len(set(applied_ids))  # exactly once
    # each ledger site is exactly the sum of its applied Deltas
    for cid in clients:
        total = zeros()
        for (c_id, _, step), d in sent.items():
            if c_id == cid and step in applied_ids:
                total = add(total, d)
        for k in total:
            np.testing.assert_allclose(ledger.sites[cid][k], total[k], rtol=0, atol=1e-12)
        assert ledger.versions[cid] == sum(1 for (c_id, _, s) in sent if c_id == cid and s in applied_ids)


# ===================================================================================================
# persistence
def _full_state(seed: int = 20) -> ClientState:
    rng = np.random.default_rng(seed)
    s = ClientState(site=arrays(rng), version=7)
    s.stage(arrays(rng))
    s.site["eta1/b"] = s.site["eta1/b"].astype(np.float32)  # dtypes are preserved
    return s


@pytest.mark.parametrize("kind", ["full", "site-only", "pending-only", "empty"])
def test_save_load_round_trip(tmp_path, kind):
    s = _full_state()
    if kind == "site-only":
        s.pending_site, s.pending_version = None, None
    elif kind == "pending-only":
        s = ClientState()
        s.stage(arrays(np.random.default_rng(1)))
    elif kind == "empty":
        s = ClientState()
    path = s.save(tmp_path / "state", "site-0")
    assert path == tmp_path / "state" / "site-0.npz" and path.exists()
    t = ClientState.load(tmp_path / "state", "site-0")
    assert t.version == s.version and t.pending_version == s.pending_version
    assert_arrays_equal(t.site, s.site)
    assert_arrays_equal(t.pending_site, s.pending_site)
    a1, m1 = s.to_arrays()
    a2, m2 = t.to_arrays()
    assert m1 == m2
    assert_arrays_equal(a1, a2)
    assert os.listdir(tmp_path / "state") == ["site-0.npz"]


def test_to_from_arrays_round_trip():
    s = _full_state()
    a, m = s.to_arrays()
    t = ClientState.from_arrays(a, m)
    assert t.version == s.version and t.pending_version == s.pending_version
    assert_arrays_equal(t.site, s.site)
    assert_arrays_equal(t.pending_site, s.pending_site)


def test_load_missing_file_gives_fresh_state(tmp_path):
    s = ClientState.load(tmp_path, "nobody")
    assert s.site is None and s.version == 0 and s.pending_site is None


def test_save_overwrites(tmp_path):
    _full_state(1).save(tmp_path, "a")
    s2 = _full_state(2)
    s2.version = 8
    s2.save(tmp_path, "a")
    t = ClientState.load(tmp_path, "a")
    assert t.version == 8
    assert_arrays_equal(t.site, s2.site)
    assert os.listdir(tmp_path) == ["a.npz"]


def test_save_is_atomic(tmp_path, monkeypatch):
    old = _full_state(1)
    old.save(tmp_path, "a")
    new = _full_state(2)
    new.version = 99

    def boom(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(cs_mod.os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        new.save(tmp_path, "a")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["a.npz"]  # no temp file left behind
    t = ClientState.load(tmp_path, "a")
    assert t.version == 7
    assert_arrays_equal(t.site, old.site)
    assert_arrays_equal(t.pending_site, old.pending_site)


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cs_mod.np, "savez", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        _full_state().save(tmp_path, "a")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", ["", "x" * 129, "a\nb", "a\x00b"])
def test_ids_the_node_refuses_are_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="client-id"):
        ClientState().save(tmp_path / "d", bad)
    with pytest.raises(ValueError, match="client-id"):
        ClientState.load(tmp_path / "d", bad)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("odd", ["../x", "a/b", "/abs", "a\\b", "a b", "..", "."])
def test_ids_with_path_characters_stay_inside_the_state_dir(tmp_path, odd):
    path = ClientState().save(tmp_path / "d", odd)
    assert path.parent == tmp_path / "d" and os.listdir(tmp_path) == ["d"]
    assert ClientState.load(tmp_path / "d", odd).version == 0
    assert not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize("good", ["site-0", "client_7", "a.b", "X" * 128])
def test_safe_client_ids_are_accepted(tmp_path, good):
    path = ClientState().save(tmp_path, good)
    assert path.parent == tmp_path and path.name == f"{good}.npz"


# ===================================================================================================
# the wire names and the transport-free core
def test_protocol_constants():
    from common import protocol as P

    assert P.UNKNOWN_VERSION == -1
    names = [P.POSTERIOR, P.SITE, P.DELTA, P.CONFIG, P.METRICS]
    assert len(set(names)) == len(names)
    statuses = [P.STATUS_OK, P.STATUS_RESYNC, P.STATUS_FAILED]
    assert len(set(statuses)) == len(statuses)


@pytest.mark.parametrize("module", ["families", "factors", "config", "client_state", "protocol", "errors"])
def test_core_module_does_not_import_flwr(module):
    import ast
    from pathlib import Path

    src = (Path(cs_mod.__file__).parent / f"{module}.py").read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "flwr" for a in node.names), module
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "flwr", module
