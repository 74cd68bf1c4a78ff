"""Checkpoint, codec and resume findings of a review (each test failed on the code before its fix).

(1) a node's ``client-id`` is a bounded printable string: the server ignores an identity reply with any other (a
    NUL made every checkpoint unloadable, an id of 70,000 characters crashed the first checkpoint), the node
    refuses to start with one, and a checkpoint refuses to write a member name a zip cannot hold;
(2) an excluded client's site is taken out by recomputing the product of the other sites: the rounding its large
    contributions left in the running global site no longer makes the checkpoint's ledger "inconsistent";
(3) a reply's own strings (a false client id, an unknown status, a failed client's reason, a malformed field) are
    cut short before they go into rejections, logs and checkpoints;
(4) a train reply's ``num-examples`` / ``seconds`` / ``epochs`` enter the round's row only as finite numbers in
    [0, 2^53] (the update is still applied), so the checkpoint's header stays strict JSON;
(5) a checkpoint temp file a killed server left is removed when a strategy starts in that directory;
(6) resume: a key the checkpoint predates matches at its default, evaluation and thread keys may change, and a
    damaged checkpoint is a ``CheckpointMismatch`` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

import strategies.pgvi as pgvi_module
from client.app import app as client_app
from common import protocol as P
from common.atomic_io import atomic_save_npz, load_npz
from common.config import parse_run_config
from common.errors import PGVIError
from common.factors import PGVIServerState, UpdateRejected, product_of_sites
from common.families import MeanFieldGaussian
from common.problem import build_problem
from strategies.checkpoint import CHECKPOINT_FILE, CheckpointMismatch, load_checkpoint, save_checkpoint
from strategies.inprocess import InProcessGrid
from strategies.pgvi import AllClientsFailed, PGVIStrategy
from tests.test_inprocess import BASE
from tests.test_server_step_review import _ckpt_problem, _ckpt_strategy, _same, _snapshot
from tests.wire import record_arrays, set_record_arrays

REPO = Path(__file__).resolve().parents[1]


def _setup(overrides: dict | None = None, ids: list[str] | None = None):
    raw = {**BASE, "num-server-rounds": 2, **(overrides or {})}
    cfg = parse_run_config(raw)
    ids = ids or [f"site-{m}" for m in range(cfg.num_clients)]
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": ids[m]}
             for m in range(cfg.num_clients)]
    return raw, cfg, nodes


def _run(tmp_path: Path, overrides: dict | None = None, reply_hook=None, **kwargs) -> PGVIStrategy:
    raw, cfg, nodes = _setup(overrides)
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path, **kwargs)
    s.start(InProcessGrid(client_app, nodes, raw, reply_hook=reply_hook))
    return s


def _is_train_reply_of(request, reply, cid: str) -> bool:
    return (request.metadata.message_type == "train" and not reply.has_error()
            and request.content[P.CONFIG]["client-id"] == cid)


class _LogRecorder:
    """Records the strategy module's own log calls (a handler on Flower's logger may see nothing in a full run)."""

    def __init__(self, real):
        self.real, self.lines = real, []

    def __call__(self, level, msg, *args):
        self.lines.append(msg % args if args else msg)
        self.real(level, msg, *args)


# ============================================================================================ (1)
@pytest.mark.parametrize("bad", ["site-1\x00evil", "s" * 70_000, "site\n1", "x" * 129, "\u2028"],
                         ids=["nul", "70k-chars", "newline", "129-chars", "line-separator"])
def test_the_server_ignores_an_identity_reply_with_a_bad_client_id(tmp_path, bad, monkeypatch):
    """A node whose identity reply holds an id the checkpoint (or the log) cannot hold is never identified: the run
    goes on with the others, its checkpoints load, and the warning and the stop reason quote the id cut short.
    (The node itself refuses such an id, test below; this is a node that does not.)"""

    def hook(request, reply):
        if (request.metadata.message_type == "query" and not reply.has_error()
                and reply.content[P.CONFIG]["client-id"] == "site-1"):
            reply.content[P.CONFIG]["client-id"] = bad
        return [reply]

    recorder = _LogRecorder(pgvi_module.log)
    monkeypatch.setattr(pgvi_module, "log", recorder)
    s = _run(tmp_path, {"min-clients": 2}, reply_hook=hook)
    assert sorted(s.ledger_versions) == ["site-0", "site-2"]
    assert s.round_completed == 2
    loaded = PGVIStrategy(build_problem(s.cfg))
    load_checkpoint(loaded, tmp_path)
    assert loaded.ledger_versions == s.ledger_versions
    warnings = [ln for ln in recorder.lines if "identity reply" in ln and "client-id" in ln]
    assert warnings and all(len(ln) < 400 for ln in warnings), warnings
    assert "client-id" in s._last_failure and len(s._last_failure) < 300


@pytest.mark.parametrize("bad", ["site-1\x00evil", "s" * 129, "a\tb", "\x1b[31mred"])
def test_a_node_refuses_a_bad_client_id_before_round_1(bad):
    from client.node_request import node_run_config

    with pytest.raises(PGVIError, match="client-id") as err:
        node_run_config({**BASE}, {"partition-id": 0, "num-partitions": 3, "client-id": bad})
    assert len(str(err.value)) < 300


@pytest.mark.parametrize("good", ["site-0", "Ünïcode site", "a|b", "x" * 128, "dept/lab\\node 3", "ends.npy"])
def test_a_node_accepts_a_bounded_printable_client_id(good):
    from client.node_request import node_run_config

    assert node_run_config({**BASE}, {"partition-id": 0, "num-partitions": 3, "client-id": good})[2] == good


def test_client_id_problem_names_what_is_wrong():
    from common.protocol import client_id_problem

    assert client_id_problem(5) == "must be a string, not int"
    assert client_id_problem("") == "must not be empty"
    assert "129 characters, more than 128" in client_id_problem("x" * 129)
    assert "U+0000" in client_id_problem("a\x00b") and "U+000A" in client_id_problem("a\nb")
    assert client_id_problem("x" * 128) is None and client_id_problem("Ünïcode site|3") is None


def test_every_accepted_client_id_survives_a_checkpoint(tmp_path):
    from common.protocol import client_id_problem

    prior, delta = _ckpt_problem()
    ids = ["a", "a|x", "|c", "b|", "Ünïcode 😀", "x" * 128, "/abs/path", "..", "back\\slash", "q'\"", "ends.npy",
           "__meta__", "site|site-0"]
    assert all(client_id_problem(c) is None for c in ids)
    written = _ckpt_strategy(ids, prior, delta)
    save_checkpoint(written, tmp_path)
    fresh = _ckpt_strategy([], prior, delta)
    load_checkpoint(fresh, tmp_path)
    assert list(fresh.state.sites) == sorted(ids)
    for cid in ids:
        assert fresh.state.sites[cid].max_abs_diff(written.state.sites[cid]) == 0.0


def test_a_checkpoint_refuses_to_write_a_client_id_a_zip_member_name_cannot_hold(tmp_path):
    """Defence in depth (the server never admits such an id): a clear error, not a checkpoint that every resume
    refuses ('site|site-1' read back for 'site|site-1\\x00evil') or a struct.error from the zip layer."""
    prior, delta = _ckpt_problem()
    for bad in ("site-1\x00evil", "s" * 70_000):
        with pytest.raises(PGVIError, match="cannot checkpoint client id"):
            save_checkpoint(_ckpt_strategy(["site-0", bad], prior, delta), tmp_path)
        assert not (tmp_path / CHECKPOINT_FILE).exists()


# ============================================================================================ (2)
def _mf(eta1, eta2, dtype):
    return MeanFieldGaussian({"w": torch.tensor(eta1, dtype=dtype)}, {"w": torch.tensor(eta2, dtype=dtype)})


def test_removing_a_large_site_leaves_the_product_of_the_other_sites_float32():
    """float32: a site of eta1 ~ 1e9 added to and divided out of the running global site left a residue of the
    order of its rounding (eps * 1e9 ~ 100); recomputed, the global site is the others' product to rounding."""
    f32 = torch.float32
    prior = MeanFieldGaussian.isotropic({"w": (3,)}, 0.0, 1.0).to(f32)
    st = PGVIServerState(prior=prior)
    honest = _mf([0.3, -0.2, 0.1], [-0.25, -0.25, -0.25], f32)
    st.apply({"a": honest, "b": honest, "bad": _mf([1.234567e9, -7.654321e9, 3.3e9], [-0.1, -0.1, -0.1], f32)})
    for _ in range(3):
        st.apply({"a": honest, "b": honest})
    st.remove_site("bad")
    expected = st.prior.zeros_like().to(torch.float64)
    for cid in ("a", "b"):
        expected = expected * st.sites[cid].to(torch.float64)
    assert st.global_site.dtype == f32
    assert st.global_site.to(torch.float64).max_abs_diff(expected) < 1e-6
    assert st.check_invariant() < 1e-6
    assert st.posterior.max_abs_diff(st.server_step(st.prior, st.global_site)) == 0.0
    assert st.sites["bad"].max_abs_diff(prior.zeros_like()) == 0.0 and st.version == 5


def test_remove_site_changes_nothing_when_it_is_rejected():
    f64 = torch.float64
    prior = MeanFieldGaussian.isotropic({"w": (2,)}, 0.0, 1.0)
    st = PGVIServerState(prior=prior)
    st.apply({"neg": _mf([0.0, 0.0], [1.0, 1.0], f64), "pos": _mf([0.0, 0.0], [-1.5, -1.5], f64)})  # precision 1-2+3
    before = (st.global_site, st.posterior, dict(st.sites), st.version)
    with pytest.raises(UpdateRejected, match="removing its site"):
        st.remove_site("pos")  # leaves precision 1 - 2 < 0
    assert (st.global_site, st.posterior, dict(st.sites), st.version) == before


def test_a_checkpoint_written_after_an_excluded_clients_site_was_removed_resumes(tmp_path):
    """The review's case: float32, a Byzantine client whose first Delta pushes eta1 by 1e9 (still proper), then
    invalid replies until it is excluded and its site divided out.  The checkpoint was refused on resume."""

    def hook(request, reply):
        if _is_train_reply_of(request, reply, "site-1") and P.DELTA in reply.content:
            arrays = record_arrays(reply, P.DELTA)
            if request.content[P.CONFIG]["server-round"] == 1:
                arrays = {k: v * 1e9 if k.startswith("eta1") else v for k, v in arrays.items()}
            else:
                arrays = {k: np.full_like(v, np.nan) for k, v in arrays.items()}
            set_record_arrays(reply.content, P.DELTA, arrays)
        return [reply]

    s = _run(tmp_path, {"num-server-rounds": 4, "max-bad-replies": 2, "exclusion-removes-site": True,
                        "dtype": "float32"}, reply_hook=hook)
    assert s.ledger_versions == {"site-0": 4, "site-1": 0, "site-2": 4}
    assert s.state.check_invariant() < 1e-3  # was 61.3
    loaded = PGVIStrategy(build_problem(s.cfg))
    load_checkpoint(loaded, tmp_path)
    assert loaded.state.posterior.max_abs_diff(s.state.posterior) == 0.0


# ============================================================================================ (3)
_BIG = 100_000


@pytest.mark.parametrize("forge", ["client-id", "status", "config-array-record", "base-site-version"])
def test_a_replys_own_strings_are_cut_short_in_rejections_and_checkpoints(tmp_path, forge):
    def hook(request, reply):
        if _is_train_reply_of(request, reply, "site-1"):
            if forge == "config-array-record":
                del reply.content[P.CONFIG]
                reply.content[P.CONFIG] = ArrayRecord({"status": Array(np.zeros(_BIG // 8))})
            else:
                reply.content[P.CONFIG][forge] = "x" * _BIG
        return [reply]

    s = _run(tmp_path, reply_hook=hook)
    reasons = [r["reason"] for r in s.rejections]
    assert len(reasons) == 2 and all(r["client-id"] == "site-1" for r in s.rejections)
    assert all(len(r) < 400 for r in reasons), [len(r) for r in reasons]
    assert os.path.getsize(tmp_path / CHECKPOINT_FILE) < _BIG // 2


def test_a_failed_clients_reason_is_cut_short(tmp_path):
    def hook(request, reply):
        if request.metadata.message_type == "train" and not reply.has_error():
            cfg = reply.content[P.CONFIG]
            cfg["status"], cfg["reason"] = P.STATUS_FAILED, "r" * _BIG
        return [reply]

    with pytest.raises(AllClientsFailed) as err:
        _run(tmp_path, reply_hook=hook)
    assert "rrrr" in str(err.value) and len(str(err.value)) < 1000


# ============================================================================================ (4)
def _strict_json(text: str):
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("bad", [{"num-examples": float("nan"), "seconds": 1e308, "epochs": -5.0},
                                 {"num-examples": 2.0**60, "seconds": float("inf"), "epochs": [1.0, 2.0]},
                                 {"num-examples": 40.5, "seconds": -1.0, "epochs": float("-inf")}])
def test_nonsense_train_metrics_are_left_out_of_the_row_and_the_update_applied(tmp_path, bad, monkeypatch):
    def hook(request, reply):
        if _is_train_reply_of(request, reply, "site-1"):
            m = reply.content[P.METRICS]
            for k, v in bad.items():
                m[k] = v
        return [reply]

    recorder = _LogRecorder(pgvi_module.log)
    monkeypatch.setattr(pgvi_module, "log", recorder)
    s = _run(tmp_path, reply_hook=hook)
    clean = _run(tmp_path / "clean")
    for row, ref in zip(s.history[1:], clean.history[1:]):
        assert row["applied"] == 3.0 and row["rejected"] == 0.0  # the update is judged by its Delta
        n = row["num-examples"]  # the two honest clients' examples
        assert math.isfinite(n) and n.is_integer() and 0 < n < ref["num-examples"], (n, ref["num-examples"])
        for k in ("client-seconds-max", "client-seconds-mean", "client-epochs-max", "client-epochs-mean"):
            assert k not in row or (math.isfinite(row[k]) and 0.0 <= row[k] < 1e6), (k, row.get(k))
    assert s.ledger_versions == clean.ledger_versions
    warned = [ln for ln in recorder.lines if "left out of the round's row" in ln]
    assert len(warned) == 2 and all("site-1" in ln and "node" in ln for ln in warned)
    with zipfile.ZipFile(tmp_path / CHECKPOINT_FILE) as z:
        header = bytes(np.lib.format.read_array(z.open("__meta__.npy"))).decode()
    _strict_json(header)  # NaN / Infinity are not JSON


# ============================================================================================ (5)
_KILLED_WRITER = """
import os, sys
import numpy as np
sys.path.insert(0, {repo!r})
from common.atomic_io import atomic_write

def write(f):
    np.save(f, np.zeros(1000))
    f.flush()
    os._exit(9)  # killed mid-write: no except / finally block runs, as with SIGKILL

atomic_write({target!r}, write)
"""


def _kill_mid_write(directory: Path) -> list[Path]:
    """Run a process that dies while atomically writing ``directory/checkpoint.npz``; the temp files it left."""
    before = set(directory.iterdir())
    code = _KILLED_WRITER.format(repo=str(REPO), target=str(directory / CHECKPOINT_FILE))
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 9
    return sorted(set(directory.iterdir()) - before)


def _decoys(directory: Path) -> list[Path]:
    """Files beside a checkpoint that are not its temp files: another target's, other names, a directory."""
    out = [directory / n for n in (".metrics.abcd1234.tmp", ".checkpoint.tmp", ".checkpoint.abcd1234.tmp.keep",
                                   "checkpoint.abcd1234.tmp", ".checkpoint.abc.tmp", "notes.txt")]
    for p in out:
        p.write_text("keep")
    (directory / ".checkpoint.dir12345.tmp").mkdir()
    return [*out, directory / ".checkpoint.dir12345.tmp"]


@pytest.mark.parametrize("where", ["checkpoint-dir", "resume-from"])
def test_a_killed_writers_checkpoint_temp_file_is_removed_when_a_strategy_starts(tmp_path, where):
    first = tmp_path / "first"
    _run(first, {"num-server-rounds": 1})
    left = _kill_mid_write(first)
    assert len(left) == 1 and left[0].name.startswith(".checkpoint.") and left[0].name.endswith(".tmp")
    if where == "resume-from":  # there only a temp file older than RESUME_TEMP_MIN_AGE_S counts as a killed writer's
        old = left[0].stat().st_mtime - 3600.0
        os.utime(left[0], (old, old))
    decoys = _decoys(first)
    raw, cfg, nodes = _setup({"num-server-rounds": 2})
    if where == "checkpoint-dir":
        s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=first)
    else:
        s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path / "second", resume_from=first)
    s.start(InProcessGrid(client_app, nodes, raw))
    assert not left[0].exists()
    assert all(p.exists() for p in decoys)
    load_checkpoint(PGVIStrategy(build_problem(cfg)), first)


def test_a_fresh_temp_file_in_the_resume_directory_is_kept(tmp_path):
    """The directory a run resumes from may be a live run's: deleting its write-in-progress temp file made that
    run's checkpoint write fail (review of this change)."""
    first = tmp_path / "first"
    _run(first, {"num-server-rounds": 1})
    live = first / ".checkpoint.abcd1234.tmp"  # another server's write in progress
    live.write_bytes(b"partial")
    raw, cfg, nodes = _setup({"num-server-rounds": 2})
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path / "second", resume_from=first)
    s.start(InProcessGrid(client_app, nodes, raw))
    assert live.exists()


def test_stale_temp_files_match_exactly_what_atomic_write_creates(tmp_path):
    from common.atomic_io import stale_temp_files

    left = _kill_mid_write(tmp_path)
    _decoys(tmp_path)
    assert stale_temp_files(tmp_path / CHECKPOINT_FILE) == left


# ============================================================================================ (6)
@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    """One finished run's checkpoint (read only) and its run config."""
    d = tmp_path_factory.mktemp("ckpt")
    raw, cfg, nodes = _setup({"num-server-rounds": 1})
    PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=d).start(InProcessGrid(client_app, nodes, raw))
    return d, raw


def _rewritten(tmp_path: Path, src: Path, arrays=None, meta=None) -> Path:
    a, m = load_npz(src / CHECKPOINT_FILE)
    atomic_save_npz(tmp_path / CHECKPOINT_FILE, a if arrays is None else arrays(a), m if meta is None else meta(m))
    return tmp_path


@pytest.mark.parametrize("key", ["exclusion-removes-site", "aggregator", "pipeline-evaluation"])
def test_a_checkpoint_without_a_newer_config_key_loads_when_the_run_leaves_it_at_its_default(tmp_path, checkpoint_run,
                                                                                           key):
    src, raw = checkpoint_run
    d = _rewritten(tmp_path, src, meta=lambda m: {**m, "config": {k: v for k, v in m["config"].items() if k != key}})
    load_checkpoint(PGVIStrategy(build_problem(parse_run_config(raw))), d)


def test_a_checkpoint_without_batch_halvings_resumes_with_the_old_behaviour_only(tmp_path, checkpoint_run):
    # batch-halvings came with a default (3) that changed the behaviour: a checkpoint written before it ran with the
    # whole-batch rejection, i.e. 0; the default was accepted (switching the resumed run silently) and 0 refused
    src, raw = checkpoint_run
    d = _rewritten(tmp_path, src, meta=lambda m: {**m, "config": {k: v for k, v in m["config"].items()
                                                                  if k != "batch-halvings"}})
    load_checkpoint(PGVIStrategy(build_problem(parse_run_config({**raw, "batch-halvings": 0}))), d)
    with pytest.raises(CheckpointMismatch, match=r"batch-halvings \(checkpoint: absent .*behaviour before it, 0\); "
                                                 r"this run: 3\)"):
        load_checkpoint(PGVIStrategy(build_problem(parse_run_config(raw))), d)


@pytest.mark.parametrize("schedule", ["sequential", "asynchronous"])
def test_a_non_synchronous_checkpoint_without_batch_halvings_resumes_at_the_default(tmp_path, schedule):
    # batch-halvings does nothing there and the config refuses any other value than the default: the legacy value
    # 0 made such a checkpoint impossible to resume with any run config (final review, stop 33)
    d = tmp_path / "ck"
    raw, cfg, nodes = _setup({"num-server-rounds": 1, "schedule": schedule})
    PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=d).start(InProcessGrid(client_app, nodes, raw))
    old = _rewritten(tmp_path / "old", d, meta=lambda m: {**m, "config": {k: v for k, v in m["config"].items()
                                                                           if k != "batch-halvings"}})
    load_checkpoint(PGVIStrategy(build_problem(parse_run_config(raw))), old)


def test_a_checkpoint_without_a_config_key_is_refused_when_the_run_sets_it(tmp_path, checkpoint_run):
    src, raw = checkpoint_run
    d = _rewritten(tmp_path, src, meta=lambda m: {**m, "config": {k: v for k, v in m["config"].items()
                                                                  if k != "aggregator"}})
    cfg = parse_run_config({**raw, "aggregator": "median"})
    with pytest.raises(CheckpointMismatch, match=r"aggregator \(checkpoint: absent .*'sum'.*this run: 'median'\)"):
        load_checkpoint(PGVIStrategy(build_problem(cfg)), d)
    # a key this version does not know (a newer checkpoint's) differs
    d2 = _rewritten(tmp_path / "newer", src, meta=lambda m: {**m, "config": {**m["config"], "new-knob": 3}})
    with pytest.raises(CheckpointMismatch, match="new-knob .*unknown to this version"):
        load_checkpoint(PGVIStrategy(build_problem(parse_run_config(raw))), d2)


@pytest.mark.parametrize("change,free", [({"eval-samples": 17}, True), ({"torch-threads": 1}, True),
                                         ({"checkpoint": False}, True), ({"data-dir": "/tmp/elsewhere"}, False),
                                         ({"evaluate-clients": True}, False), ({"seed": 7}, False)])
def test_resume_may_change_only_the_evaluation_thread_and_output_keys(checkpoint_run, change, free):
    src, raw = checkpoint_run
    strategy = PGVIStrategy(build_problem(parse_run_config({**raw, **change})))
    if free:
        load_checkpoint(strategy, src)
    else:
        with pytest.raises(CheckpointMismatch, match=next(iter(change))):
            load_checkpoint(strategy, src)


def test_a_checkpoint_that_still_holds_a_key_made_free_since_loads(tmp_path, checkpoint_run):
    """Checkpoints written before eval-samples, torch-threads and checkpoint were free keys hold them in their config."""
    src, raw = checkpoint_run
    d = _rewritten(tmp_path, src, meta=lambda m: {**m, "config": {**m["config"], "eval-samples": 200,
                                                                  "torch-threads": 0, "checkpoint": True}})
    load_checkpoint(PGVIStrategy(build_problem(parse_run_config({**raw, "eval-samples": 17, "torch-threads": 1}))), d)


_DAMAGE = {
    "no-version": (None, lambda m: {k: v for k, v in m.items() if k != "version"}),
    "rng-garbage": (None, lambda m: {**m, "rng": "[1,2"}),
    "history-none": (None, lambda m: {**m, "history": None}),
    "ledger-list": (None, lambda m: {**m, "ledger-versions": [1, 2]}),
    "config-list": (None, lambda m: {**m, "config": []}),
    "header-list": (None, lambda m: [m]),
    "posterior-missing": (lambda a: {k: v for k, v in a.items() if not k.startswith("posterior|")}, None),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_damaged_checkpoint_is_a_mismatch_naming_the_file_and_changes_nothing(tmp_path, checkpoint_run, damage):
    src, raw = checkpoint_run
    arrays, meta = _DAMAGE[damage]
    d = _rewritten(tmp_path, src, arrays, meta)
    target = PGVIStrategy(build_problem(parse_run_config(raw)))
    before = _snapshot(target)
    with pytest.raises(CheckpointMismatch, match=re.escape(str(d / CHECKPOINT_FILE))):
        load_checkpoint(target, d)
    _same(_snapshot(target), before)


@pytest.mark.parametrize("content", [b"not a zip at all", b"PK\x03\x04 torn"])
def test_an_unreadable_checkpoint_file_is_a_mismatch_naming_the_file(tmp_path, checkpoint_run, content):
    _, raw = checkpoint_run
    (tmp_path / CHECKPOINT_FILE).write_bytes(content)
    named = re.escape(f"[{tmp_path / CHECKPOINT_FILE}]")
    with pytest.raises(CheckpointMismatch, match=r"^not a readable checkpoint: .*" + named):
        load_checkpoint(PGVIStrategy(build_problem(parse_run_config(raw))), tmp_path)


def test_a_header_that_is_not_json_is_a_mismatch(tmp_path, checkpoint_run):
    src, raw = checkpoint_run
    a, _ = load_npz(src / CHECKPOINT_FILE)
    np.savez(tmp_path / CHECKPOINT_FILE, __meta__=np.frombuffer(b"{not json", dtype=np.uint8), **a)
    with pytest.raises(CheckpointMismatch, match=re.escape(str(tmp_path / CHECKPOINT_FILE))):
        load_checkpoint(PGVIStrategy(build_problem(parse_run_config(raw))), tmp_path)



# ------------------------------------------------------------------------------------------------ a later review
@pytest.mark.parametrize("b", [1e5, 1e7])
def test_float32_deltas_that_cancel_leave_the_global_site_the_product_of_the_stored_sites(tmp_path, b):
    """A client whose float32 Deltas cancel (+B in eta1 in round 1, -B in round 2; the posterior stays proper) left
    the running global site rounding(s) of B away from the product of the sites (0.0076 at B = 1e5): the server then
    refused its own checkpoint on resume.  The global site is now the stored sites' sum, formed in float64."""
    def hook(request, reply):
        if _is_train_reply_of(request, reply, "site-1"):
            rnd = int(request.content[P.CONFIG]["server-round"])
            if rnd in (1, 2):
                d = record_arrays(reply, P.DELTA)
                for k in d:
                    if k.startswith("eta1"):
                        d[k] = (d[k] + np.float32(b if rnd == 1 else -b)).astype(np.float32)
                set_record_arrays(reply.content, P.DELTA, d)
        return [reply]

    s = _run(tmp_path, {"family": "mean_field", "dtype": "float32", "num-server-rounds": 3}, reply_hook=hook)
    assert not s.rejections and s.ledger_versions == {"site-0": 3, "site-1": 3, "site-2": 3}
    st = s.state
    assert product_of_sites(st.sites.values(), st.prior, torch.float64).max_abs_diff(st.global_site) == 0.0
    _, cfg, _ = _setup({"family": "mean_field", "dtype": "float32", "num-server-rounds": 3})
    resumed = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    load_checkpoint(resumed, tmp_path)
    assert resumed.state.global_site.max_abs_diff(st.global_site) == 0.0


def test_a_checkpoint_whose_posterior_is_not_the_server_step_of_its_ledger_is_refused(tmp_path):
    """The loader checked the posterior proper and the ledger consistent, then took the stored posterior as it was:
    one doubled (still proper) loaded, and the resumed server sent clients a posterior its ledger does not give."""
    s = _run(tmp_path)
    arrays, meta = load_npz(tmp_path / CHECKPOINT_FILE)
    _, cfg, _ = _setup()
    load_checkpoint(PGVIStrategy(build_problem(cfg), poll_interval=0.0), tmp_path)  # as written: loads
    atomic_save_npz(tmp_path / CHECKPOINT_FILE,
                    {k: (v * 2.0 if k.startswith("posterior|") else v) for k, v in arrays.items()}, meta)
    with pytest.raises(CheckpointMismatch, match=r"checkpointed posterior != the server step of the prior and the "
                                                 r"global site .*checkpoint\.npz"):
        load_checkpoint(PGVIStrategy(build_problem(cfg), poll_interval=0.0), tmp_path)
    assert s.state.posterior is not None
