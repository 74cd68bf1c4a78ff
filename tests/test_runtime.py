"""common.runtime: thread count, argument checks, and the allocator setting that stops per-step page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.runtime import configure_compute, flush_denormals_active, set_flush_denormals

ROOT = Path(__file__).resolve().parent.parent


def test_configure_compute_sets_threads_and_checks_its_argument() -> None:
    before = torch.get_num_threads()
    try:  # flush off: a pool started here with the mode on would keep it for the rest of the test session
        configure_compute(2, flush_denormals=False)
        assert torch.get_num_threads() == 2
        configure_compute(1, flush_denormals=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="threads"):
            configure_compute(bad)  # type: ignore[arg-type]


def _run(code: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c code argv...`` with this repository importable and no flush switch inherited; must exit 0."""
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PGVI_FLUSH_DENORMALS": "", **env})
    assert res.returncode == 0, res.stderr
    return res


_FAULTS = """
import resource, sys, torch
torch.set_num_threads(1)
def faults():
    # the allocation pattern of a BNN step: several 2 MB activations alive at once, all freed at its end
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        eps = torch.randn(10, 256, 200)
        a = eps * 2.0
        h = torch.relu(a)
        h2 = h * h
        g = h2 + a
        del eps, a, h, h2, g
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
if sys.argv[1] == "tuned":
    from common.runtime import tune_allocator
    assert tune_allocator()
else:
    # glibc's initial mmap threshold (128 KiB), pinned: every 2 MB block is mmap-ed and unmapped again. Left
    # dynamic, glibc raises the threshold after the first frees and then trims the heap top or not depending on
    # the address-space layout (40 steps gave 0, 19,360 and 98,720 faults in three runs on this machine).
    import ctypes
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024) == 1
faults()  # warm-up: the first allocations fault in any case
print(faults())
"""


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_tuned_allocator_stops_the_page_faults_of_repeated_steps() -> None:
    out = {mode: [int(v) for v in _run(_FAULTS, mode).stdout.split()] for mode in ("mmap", "tuned")}
    mmap_faults = out["mmap"][0]
    tuned_faults = out["tuned"][0]
    # mmap-ed blocks: every step faults its activations in again (~2,500 pages a step); tuned: the same heap
    # pages are reused
    assert mmap_faults > 40 * 2000, out
    assert tuned_faults < 1000, out


_MODE = """
import logging, sys, torch
logging.basicConfig(level=logging.WARNING)
from common.runtime import configure_compute, flush_denormals_active
threads = int(sys.argv[1])
configure_compute(threads)
x = torch.full((threads * 400_000,), 1e-30, dtype=torch.float32)
tiny = torch.full((64, 64), 1e-20, dtype=torch.float32)
print(flush_denormals_active(),
      int(torch.count_nonzero(x * 1e-10)),                      # FTZ: subnormal results of every thread -> 0
      float(torch.tensor(1e-40, dtype=torch.float32) * 1e10),   # DAZ: a subnormal input counts as 0
      int(torch.count_nonzero(tiny @ tiny)))                    # MKL's GEMM: 64 * 1e-40, subnormal -> 0
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_configure_compute_flushes_subnormals_in_every_thread(threads) -> None:
    res = _run(_MODE, str(threads))
    active, kept, daz, gemm = res.stdout.split()
    assert (active, kept, float(daz), gemm) == ("True", "0", 0.0, "0")
    assert "flush-to-zero" not in res.stderr, res.stderr  # the pool started after the mode: no warning


def test_flush_switch_off_keeps_gradual_underflow() -> None:
    active, kept, daz, gemm = _run(_MODE, "2", PGVI_FLUSH_DENORMALS="0").stdout.split()
    assert active == "False" and int(kept) == 2 * 400_000 and float(daz) > 0 and int(gemm) == 64 * 64


def test_a_bad_flush_switch_or_argument_is_an_error_naming_it(monkeypatch) -> None:
    monkeypatch.setenv("PGVI_FLUSH_DENORMALS", "maybe")
    with pytest.raises(ValueError, match="PGVI_FLUSH_DENORMALS='maybe' must be 0 or 1"):
        configure_compute(1)
    monkeypatch.delenv("PGVI_FLUSH_DENORMALS")
    for bad in (1, "on", 0.5):
        with pytest.raises(ValueError, match="flush_denormals"):
            configure_compute(1, flush_denormals=bad)  # type: ignore[arg-type]


def test_a_pool_started_before_configure_compute_is_reported() -> None:
    # torch's intra-op threads start at the first parallel operation and keep the mode they started with
    code = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
torch.set_num_threads(2)
torch.full((800_000,), 1.0) * 2.0  # starts the pool without flush-to-zero
from common.runtime import configure_compute, flush_denormals_active, set_flush_denormals
configure_compute(2)
configure_compute(2)  # probed once
"""
    err = _run(code).stderr
    assert err.count("flush-to-zero is on in this thread but not in all of torch's 2 intra-op threads") == 1, err


def test_losses_stay_finite_and_unchanged_when_a_probability_underflows() -> None:
    # the true class 100 nats below the best: p = e^-100 ~ 4e-44, subnormal in float32
    from common.likelihoods import CategoricalOutput
    from common.losses import make_loss

    logits = torch.tensor([[[0.0, 2.0, -100.0, 1.0], [3.0, -1.0, 0.5, -100.0]]], dtype=torch.float32)
    y = torch.tensor([2, 3])
    losses = [make_loss("nll"), make_loss("gce", delta=0.8), make_loss("beta", beta=1.5),
              make_loss("gamma", gamma=1.5)]

    def values_and_grads():
        out = []
        for loss in losses:
            z = logits.clone().requires_grad_(True)
            value = loss(CategoricalOutput(z), y).sum()
            (grad,) = torch.autograd.grad(value, z)
            out.append((value.detach(), grad))
        return out

    assert flush_denormals_active() is False  # pytest's process: IEEE gradual underflow
    ieee = values_and_grads()
    try:
        assert set_flush_denormals(True)
        flushed = values_and_grads()
    finally:
        set_flush_denormals(False)
    for loss, (v0, g0), (v1, g1) in zip(losses, ieee, flushed):
        assert torch.isfinite(v1) and torch.isfinite(g1).all(), loss
        torch.testing.assert_close(v1, v0, rtol=1e-6, atol=0.0, msg=str(loss))
        torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-37, msg=str(loss))


def test_subnormals_flushed_is_scoped_to_its_block() -> None:
    from common.runtime import subnormals_flushed

    assert flush_denormals_active() is False
    with subnormals_flushed() as on:
        assert on is True and flush_denormals_active()
        with subnormals_flushed(False) as inner:  # nested: the inner block's mode, then the outer one's again
            assert inner is False and not flush_denormals_active()
        assert flush_denormals_active()
    assert flush_denormals_active() is False
    with pytest.raises(RuntimeError, match="boom"):
        with subnormals_flushed():
            raise RuntimeError("boom")
    assert flush_denormals_active() is False  # restored on the way out of an exception too
    try:
        assert set_flush_denormals(True)
        with subnormals_flushed(False):
            assert not flush_denormals_active()
        assert flush_denormals_active()  # a caller that flushes keeps flushing
    finally:
        set_flush_denormals(False)


def test_a_client_update_runs_flushed_and_gives_the_caller_its_mode_back(monkeypatch) -> None:
    # an in-process Grid runs the ClientApp in this very thread, as a test or a library user would
    from client import pgvi_client
    from tests.test_inprocess import run

    seen = []
    fit = pgvi_client.PGVIClient.fit

    def recording_fit(self, *args, **kwargs):
        seen.append(flush_denormals_active())
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(pgvi_client.PGVIClient, "fit", recording_fit)
    run({"num-server-rounds": 1})
    assert seen and all(seen), seen
    assert flush_denormals_active() is False
    seen.clear()
    monkeypatch.setenv("PGVI_FLUSH_DENORMALS", "0")
    run({"num-server-rounds": 1})
    assert seen and not any(seen), seen


def test_a_cpu_without_the_mode_is_told_once_and_not_retried(monkeypatch, caplog) -> None:
    import common.runtime as R

    calls = []
    monkeypatch.setattr(R.torch, "set_flush_denormal", lambda on: calls.append(on) or False)  # a CPU without it
    monkeypatch.setattr(R, "_flush_unsupported", False)
    with caplog.at_level("INFO", logger="common.runtime"):
        assert set_flush_denormals(True) is False
        configure_compute(1)
        configure_compute(1)
        with R.subnormals_flushed() as on:
            assert on is False
    assert calls == [True]  # tried once
    assert [r.getMessage() for r in caplog.records].count(
        "torch cannot switch flush-to-zero on this CPU: subnormal numbers keep IEEE gradual underflow") == 1
    assert set_flush_denormals(False) is True  # off is what the CPU does anyway


def test_a_bad_flush_switch_is_a_config_error_before_round_one(monkeypatch) -> None:
    from common.config import ConfigError
    from server.app import prepare
    from tests.test_inprocess import BASE

    monkeypatch.setenv("PGVI_FLUSH_DENORMALS", "maybe")
    with pytest.raises(ConfigError, match="invalid environment: PGVI_FLUSH_DENORMALS='maybe' must be 0 or 1"):
        prepare(dict(BASE))
