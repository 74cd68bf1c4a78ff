"""Review of the server schedules (2026-11-28), each test failing on the code before its fix:

(1) a resumed run whose remaining messages all failed ended with AllClientsFailed ("no update was applied") while
    its uninterrupted twin, whose earlier updates the checkpoint holds, completed;
(2) a finite Delta that overflowed its client's ledger site (two colluding peers: +B and -B keep the global site
    finite) was applied: an infinite site, q = prior x prod sites broken and every later checkpoint refused;
(3) the asynchronous schedule's stop message named no reason when its clients timed out;
(4) a sequential run resumed with fewer num-server-rounds than its open, partly applied round wrote a posterior
    whose updates no row recorded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Error, Message

from client.app import app as client_app
from common import protocol as P
from common.config import parse_run_config
from common.errors import PGVIError
from common.factors import PGVIServerState, UpdateRejected
from common.families import MeanFieldGaussian
from common.problem import build_problem
from strategies.checkpoint import save_checkpoint
from strategies.inprocess import InProcessGrid
from strategies.pgvi import AllClientsFailed, PGVIStrategy
from tests.test_inprocess import BASE


class _Crash(BaseException):
    """The server 'killed' right after its n-th checkpoint write."""


def _nodes(cfg):
    return [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"}
            for m in range(cfg.num_clients)]


def _fail(which):
    def hook(request, reply):
        if request.metadata.message_type == "train":
            c = request.content[P.CONFIG]
            if which(c["client-id"], int(c["server-round"])):
                return [Message(Error(code=0, reason="local step failed"), reply_to=request)]
        return [reply]
    return hook


def _killed_after(cfg, raw, grid, directory: Path, n: int) -> PGVIStrategy:
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=directory)
    count = [0]

    def checkpoint() -> None:
        save_checkpoint(s, directory)
        count[0] += 1
        if count[0] == n:
            raise _Crash()

    s._checkpoint = checkpoint  # type: ignore[method-assign]
    with pytest.raises(_Crash):
        s.start(grid)
    return s


@pytest.mark.parametrize("overrides, which, kill_at", [
    # sequential: checkpoints r1 x3 + end (4), r2 site-0 (5), site-1 (6): killed there; site-2's round 2 fails
    ({"schedule": "sequential", "num-server-rounds": 2}, lambda cid, rnd: cid == "site-2" and rnd == 2, 6),
    # synchronous, half the clients a round: killed after round 1's checkpoint; round 2's clients fail
    ({"schedule": "synchronous", "num-server-rounds": 2, "num-clients": 4, "min-clients": 2, "fraction-train": 0.5,
      "pipeline-evaluation": False}, lambda cid, rnd: rnd == 2, 2),
], ids=["sequential", "synchronous-fraction-0.5"])
def test_a_resumed_run_whose_last_messages_fail_completes_as_its_uninterrupted_twin(tmp_path, overrides, which,
                                                                                     kill_at):
    raw = {**BASE, **overrides}
    cfg = parse_run_config(raw)
    ref = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    ref.start(InProcessGrid(client_app, _nodes(cfg), raw, reply_hook=_fail(which)))  # completes
    grid = InProcessGrid(client_app, _nodes(cfg), raw, reply_hook=_fail(which))
    _killed_after(cfg, raw, grid, tmp_path / "live", kill_at)
    resumed = PGVIStrategy(build_problem(cfg), poll_interval=0.0, resume_from=tmp_path / "live")
    resumed.start(grid)  # was: AllClientsFailed: no update was applied in rounds 2-2
    assert resumed.ledger_versions == ref.ledger_versions
    assert [r["round"] for r in resumed.history] == [r["round"] for r in ref.history]


def test_a_run_that_never_applied_anything_still_fails():
    raw = {**BASE, "schedule": "synchronous", "num-server-rounds": 2, "num-clients": 4, "min-clients": 2,
           "fraction-train": 0.5}
    cfg = parse_run_config(raw)
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    with pytest.raises(AllClientsFailed, match="no update was applied|all 2 client messages failed"):
        s.start(InProcessGrid(client_app, _nodes(cfg), raw, reply_hook=_fail(lambda cid, rnd: True)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_delta_that_overflows_its_site_is_rejected_and_nothing_changes(dtype):
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    prior = MeanFieldGaussian.from_mean_variance({"w": torch.zeros(2, dtype=tdtype)}, {"w": torch.ones(2, dtype=tdtype)})
    state = PGVIServerState(prior=prior)
    big = 0.6 * float(np.finfo(dtype).max)

    def delta(v: float) -> MeanFieldGaussian:
        arrays = {k: np.zeros_like(a) for k, a in prior.to_numpy().items()}
        arrays[next(k for k in arrays if k.startswith("eta1"))][:] = v
        return prior.from_numpy(arrays)

    state.apply({"a": delta(big), "b": delta(-big)})  # the global site stays finite: accepted
    before = ({k: v.to_numpy() for k, v in state.sites.items()}, state.posterior.to_numpy(), state.version)
    with pytest.raises(UpdateRejected, match="site of 'a' after its Delta") as info:
        state.apply({"a": delta(big)})  # a's site would be 1.2 x max: inf
    assert isinstance(info.value, PGVIError)
    after = ({k: v.to_numpy() for k, v in state.sites.items()}, state.posterior.to_numpy(), state.version)
    assert after[2] == before[2]
    for k in before[1]:
        np.testing.assert_array_equal(after[1][k], before[1][k])
    for cid in before[0]:
        for k in before[0][cid]:
            np.testing.assert_array_equal(after[0][cid][k], before[0][cid][k])


def test_asynchronous_timeouts_name_the_reason_of_the_stop():
    raw = {**BASE, "schedule": "asynchronous", "round-timeout-s": 0.2, "num-clients": 2, "min-clients": 2}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(client_app, _nodes(cfg), raw,
                         reply_hook=lambda req, rep: [] if req.metadata.message_type == "train" else [rep])
    with pytest.raises(AllClientsFailed, match=r"last reason: client 'site-\d' did not reply within round-timeout-s"):
        PGVIStrategy(build_problem(cfg), poll_interval=0.0).start(grid)


def test_a_sequential_resume_with_fewer_rounds_records_its_partly_applied_round(tmp_path):
    raw = {**BASE, "schedule": "sequential", "num-server-rounds": 3}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(client_app, _nodes(cfg), raw)
    # checkpoints: r1 x3 + end, r2 x3 + end, r3 site-0, site-1 (10): 2 of round 3's updates applied
    killed = _killed_after(cfg, raw, grid, tmp_path / "live", 10)
    assert killed.round_completed == 2 and killed.state.version == 8
    raw2 = {**raw, "num-server-rounds": 2}  # a resume-free key
    resumed = PGVIStrategy(build_problem(parse_run_config(raw2)), poll_interval=0.0, resume_from=tmp_path / "live")
    resumed.start(grid)
    assert [int(r["round"]) for r in resumed.history] == [0, 1, 2, 3]  # was [0, 1, 2], the last at version 6
    assert resumed.history[-1]["version"] == resumed.state.version == 8


@pytest.mark.parametrize("kill_at", [6, 7])
def test_an_asynchronous_resume_with_fewer_rounds_records_its_partly_applied_round(tmp_path, kill_at):
    # the asynchronous twin of the test above (a final review found the first fix covered only the sequential and
    # synchronous schedules): killed inside round 2 with some of its updates applied, resumed with 1 round
    raw = {**BASE, "schedule": "asynchronous", "num-server-rounds": 3}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(client_app, _nodes(cfg), raw)
    killed = _killed_after(cfg, raw, grid, tmp_path / "live", kill_at)
    assert killed.round_completed == 1 and killed.state.version > killed.history[-1]["version"]
    raw2 = {**raw, "num-server-rounds": 1}
    resumed = PGVIStrategy(build_problem(parse_run_config(raw2)), poll_interval=0.0, resume_from=tmp_path / "live")
    resumed.start(grid)
    assert [int(r["round"]) for r in resumed.history] == [0, 1, 2]  # was [0, 1], the last at an older version
    assert resumed.history[-1]["version"] == resumed.state.version == killed.state.version
