"""scripts/bench_core.py's step floors: the kernels do the work they stand for, and the bound is the arithmetic
the output says (the figures themselves are machine-dependent and are only checked for sign and consistency)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from common import fused_sampling
from scripts import bench_core as bc

pytestmark = pytest.mark.skipif(bc._FLOORS.get() is None, reason="no C compiler: the floors' kernels are not built")


def test_floor_streams_read_four_streams_and_update_six():
    """Every one of the 4 read-only streams reaches every one of the 6 written ones (so none can be skipped), and
    nothing beyond ``n`` is touched."""
    n = 1000
    reads = [torch.full((n + 8,), 1e30) for _ in range(4)]
    writes = [torch.full((n + 8,), float(k)) for k in range(6)]
    r = (ctypes.c_void_p * 4)(*[t.data_ptr() for t in reads])
    w = (ctypes.c_void_p * 6)(*[t.data_ptr() for t in writes])
    bc._FLOORS.get().floor_streams(n, r, w)
    for k, t in enumerate(writes):
        assert torch.equal(t[:n], torch.full((n,), k + 4.0)), k  # (2e30 + 2e30) * 1e-30 added
        assert torch.equal(t[n:], torch.full((8,), float(k)))
    reads[2][5] = 0.0  # one read-only stream changes one element of every written stream
    bc._FLOORS.get().floor_streams(n, r, w)
    assert all(float(t[5]) == k + 4.0 + 3.0 and float(t[6]) == k + 8.0 for k, t in enumerate(writes))


@pytest.mark.parametrize("n", [1, 1023, 1024, 5000])
def test_floor_normals_are_the_projects_normals(n):
    """The normals the floor times are the generator's own: their sum is that of fused_sampling.standard_normal on
    stream 0 with the same key (up to float32 summation order)."""
    key = (678 << 32) | 12345
    want = float(fused_sampling.standard_normal(n, 0, key).double().sum())
    got = bc._FLOORS.get().floor_normals(n, 12345, 678)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_step_floors_are_consistent():
    sizes, batch, samples, peak = [30, 8, 3], 16, 2, 50.0
    fl = bc.step_floors(sizes, batch, samples, peak, min_time=0.01)
    assert fl is not None
    params = 30 * 8 + 8 + 8 * 3 + 3
    assert fl["stream_bytes"] == 4 * params * (bc.FLOOR_READS + bc.FLOOR_WRITES)
    assert fl["normals_count"] == samples * batch * 8
    assert fl["layer1_flops"] == 8 * batch * 30 * 8
    assert fl["step_flops"] == bc.bnn_flops_per_point(sizes, samples) * batch
    assert fl["other_matmul"] == pytest.approx((fl["step_flops"] - fl["layer1_flops"]) / (peak * 1e9))
    assert all(fl[k] > 0 for k in ("gemms", "streams", "normals", "other_matmul"))
    assert fl["sum"] == pytest.approx(fl["gemms"] + fl["other_matmul"] + fl["streams"] + fl["normals"])
    assert fl["reachable"] == pytest.approx(fl["step_flops"] / fl["sum"] / (peak * 1e9))
    assert bc.step_floors([30, 8, 8, 3], batch, samples, peak) is None  # two hidden layers: not this step


def test_floors_line_states_the_bound_and_what_the_target_needs():
    fl = {"gemms": 2e-3, "other_matmul": 0.5e-3, "streams": 0.25e-3, "normals": 0.75e-3, "sum": 3.5e-3,
          "stream_bytes": 1e7, "normals_count": 512000.0, "layer1_flops": 3.2e8, "step_flops": 3.5e8,
          "reachable": 3.5e8 / 3.5e-3 / 200e9}
    line = bc.floors_line(fl, 200.0, 256, {"nll + kl": 7.0e-3})
    assert "layer-1 GEMMs 2.00 (160.0 GFLOP/s)" in line
    assert "10 + 6 float32 streams 0.25 (40.0 GB/s)" in line
    assert "512,000 normals 0.75" in line
    assert "sum 3.50 -> at most 50% of the peak is reachable" in line
    assert "60% needs 2.92 ms per step; the epochs took nll + kl 7.00" in line
