"""A client-state file that cannot be read is moved aside and the client starts from a fresh state.

Before, ``ClientState.load`` raised on a torn/corrupt ``<client-id>.npz`` on every query and train message, for
good (the node never identified itself; numpy's "pickled data" error did not even name the file).  The server's
ledger is the source of truth: a fresh state (version 0) makes the client ask for its ledger site (resync)."""

from __future__ import annotations

import errno
import io
import json
import logging
import zipfile

import numpy as np
import pytest

from common import client_state
from common.client_state import ClientState


def _site(v: float) -> dict[str, np.ndarray]:
    return {"eta1": np.full(3, float(v)), "eta2": np.full(3, -float(v))}


def _valid_bytes(tmp_path) -> bytes:
    st = ClientState(site=_site(1), version=4, tag="A")
    st.stage(_site(2))
    return st.save(tmp_path / "src", "x").read_bytes()


def _npz_bytes(**members: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _meta(obj) -> bytes:
    return _npy(np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8))


CORRUPT = {
    "not-a-zip": lambda tp: b"not a zip",  # numpy: "contains pickled (object) data"
    "torn-zip-header": lambda tp: b"PK\x03\x04 torn",  # BadZipFile
    "empty": lambda tp: b"",  # EOFError / ValueError
    "truncated": lambda tp: _valid_bytes(tp)[: len(_valid_bytes(tp)) // 2],  # a half-written file
    "bit-flipped": lambda tp: (lambda b: b[:200] + bytes([b[200] ^ 0xFF]) + b[201:])(_valid_bytes(tp)),
    "no-meta": lambda tp: _npz_bytes(**{"site:eta1.npy": _npy(np.ones(3))}),  # KeyError
    "meta-not-json": lambda tp: _npz_bytes(**{"__meta__.npy": _npy(np.frombuffer(b"{nope", dtype=np.uint8))}),
    "meta-not-utf8": lambda tp: _npz_bytes(**{"__meta__.npy": _npy(np.frombuffer(b"\xff\xfe", dtype=np.uint8))}),
    "meta-a-list": lambda tp: _npz_bytes(**{"__meta__.npy": _meta([1, 2])}),  # AttributeError in from_arrays
    "meta-bad-version": lambda tp: _npz_bytes(**{"__meta__.npy": _meta({"version": "seven"})}),  # ValueError
    "truncated-npy-member": lambda tp: _npz_bytes(**{"__meta__.npy": _meta({"version": 1, "has-site": True}),
                                                     "site:eta1.npy": _npy(np.ones(3))[:-8]}),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_state_file_is_moved_aside_and_load_gives_fresh_state(tmp_path, caplog, kind):
    data = CORRUPT[kind](tmp_path)
    path = tmp_path / "state" / "site-0.npz"
    path.parent.mkdir()
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING):
        st = ClientState.load(tmp_path / "state", "site-0")
    assert st == ClientState() and st.version == 0 and st.site is None and st.pending_site is None
    assert not path.exists()
    aside = path.with_name("site-0.npz.corrupt")
    assert aside.read_bytes() == data  # kept for inspection, not deleted
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and str(aside) in warnings[0], warnings
    # the fresh state asks the server for its ledger site (resync) unless the ledger is still uniform
    assert st.reconcile(3, None, "T") is False
    assert ClientState.load(tmp_path / "state", "site-0").reconcile(0, None, "") is True
    # the node goes on: the next save and load work
    st.reconcile(3, _site(5), "T")
    st.save(tmp_path / "state", "site-0")
    t = ClientState.load(tmp_path / "state", "site-0")
    assert t.version == 3 and t.tag == "T" and np.array_equal(t.site["eta1"], _site(5)["eta1"])


def test_corrupt_state_file_that_cannot_be_moved_aside_still_gives_fresh_state(tmp_path, caplog, monkeypatch):
    import common.client_state as cs_mod

    path = tmp_path / "site-0.npz"
    path.write_bytes(b"PK\x03\x04 torn")

    def no_rename(src, dst):
        raise PermissionError("read-only directory")

    monkeypatch.setattr(cs_mod.os, "replace", no_rename)
    with caplog.at_level(logging.WARNING):
        st = ClientState.load(tmp_path, "site-0")
    monkeypatch.undo()
    assert st == ClientState()
    assert path.exists() and not path.with_name("site-0.npz.corrupt").exists()
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(path) in text and "read-only directory" in text


def test_valid_and_missing_state_files_load_without_warning(tmp_path, caplog):
    st = ClientState(site=_site(1), version=4, tag="A")
    tag = st.stage(_site(2))
    st.save(tmp_path, "a")
    with caplog.at_level(logging.WARNING):
        t = ClientState.load(tmp_path, "a")
        fresh = ClientState.load(tmp_path, "nobody")
    assert t.version == 4 and t.pending_version == 5 and t.pending_tag == tag and t.tag == "A"
    assert fresh == ClientState()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]


def test_a_client_id_the_node_refuses_still_raises(tmp_path):
    with pytest.raises(ValueError, match="client-id"):
        ClientState.load(tmp_path, "a\nb")


@pytest.mark.parametrize("err", [PermissionError(errno.EACCES, "Permission denied"),
                                 OSError(errno.EMFILE, "Too many open files")])
def test_environment_errors_are_raised_and_the_file_is_kept(tmp_path, monkeypatch, err):
    """No permission or no file descriptors says nothing about the file's bytes: not moved aside, raised."""
    state = ClientState()
    state.save(tmp_path, "c0")
    path = ClientState.path_for(tmp_path, "c0")

    def fail(*_a, **_k):
        raise err

    monkeypatch.setattr(client_state, "load_npz", fail)
    with pytest.raises(OSError) as got:
        ClientState.load(tmp_path, "c0")
    assert got.value is err and path.exists() and not path.with_name(path.name + ".corrupt").exists()


def test_a_save_killed_mid_write_leaves_no_temp_file_after_the_next_load(tmp_path):
    """Each client kill mid-save left a state-sized temp file for good; the next load removes the old ones and
    spares one a save in progress may be writing."""
    import os
    import time

    ClientState(site={"eta1": np.ones(2), "eta2": -np.ones(2)}, version=2).save(tmp_path, "site-0")
    old_tmp, fresh_tmp = tmp_path / ".site-0.abcd1234.tmp", tmp_path / ".site-0.efgh5678.tmp"
    for t in (old_tmp, fresh_tmp):
        t.write_bytes(b"partial")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    assert ClientState.load(tmp_path, "site-0").version == 2
    assert not old_tmp.exists() and fresh_tmp.exists()
