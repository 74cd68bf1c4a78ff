"""How the compiled kernels use threads (common.native): on torch's own OpenMP pool where torch runs on GNU
OpenMP, otherwise Python threads; the results are the same either way.

Fresh interpreters, so each route builds and loads its own kernels (``PGVI_KERNEL_OPENMP=0`` selects the Python
threads) into a private cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import native

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(native.disabled_by_environment(), reason="kernels disabled")

#: the three kernel libraries at 2 threads: digests of every output and gradient, the route, and the OpenMP
#: runtimes mapped into the process
_PROBE = r"""
import hashlib, json
import sklearn.datasets  # noqa: F401 - maps scikit-learn's own libgomp before torch's (its wheel bundles one)
import torch
from common import fused_head, fused_meanfield, fused_sampling, native
from common.losses import make_loss
torch.set_num_threads(2)
g = torch.Generator().manual_seed(3)
out = {}
def dig(*ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
R, H, C = 300, 50, 7  # three row blocks of the head
mu = torch.randn(R, H, generator=g).requires_grad_(); var = (torch.rand(R, H, generator=g) + 0.1).requires_grad_()
wm = (0.1 * torch.randn(C, H, generator=g)).requires_grad_(); bm = torch.zeros(C).requires_grad_()
wv = (1e-2 * torch.rand(C, H, generator=g)).requires_grad_(); bv = (1e-2 * torch.rand(C, generator=g)).requires_grad_()
y = torch.randint(0, C, (R,), generator=g)
v = fused_head.expected_loss(mu, var, wm, bm, wv, bv, y, 4, 4, make_loss("gce", delta=0.8), torch.Generator().manual_seed(1))
out["head"] = dig(v, *torch.autograd.grad(v, (mu, var, wm, bm, wv, bv)))
n = 3 * 4096 + 123  # four blocks of the mean-field kernel
loc, raw = torch.randn(n, generator=g).requires_grad_(), (0.5 * torch.randn(n, generator=g) - 4.0).requires_grad_()
mp, lp = 0.1 * torch.randn(n, generator=g), 1.0 + torch.rand(n, generator=g)
vv, value, bad = fused_meanfield.variance_and_divergence(loc, raw, mp, lp, "alpha_renyi", 2.5, 0.5, 1e-8)
out["meanfield"] = dig(vv, value, *torch.autograd.grad(value + vv.sum(), (loc, raw)))
from common.adam import Adam  # the fused update (backward + Adam in one pass), on the same four blocks
p_loc, p_raw = torch.nn.Parameter(loc.detach().clone()), torch.nn.Parameter(raw.detach().clone())
opt = Adam([([p_loc], 1e-2), ([p_raw], 3e-3)])
for _ in range(3):
    st, _, _ = fused_meanfield.forward([p_loc.detach()], [p_raw.detach()], [mp], [lp], 2, 2.5, 1e-8)
    t = opt.advance([p_loc, p_raw])
    fused_meanfield.backward_adam(st, [p_raw.detach()], [torch.randn(n, generator=g)], [torch.randn(n, generator=g)],
                                  0.5, 2, 2.5, opt.constants(), t[:1], t[1:], fused_meanfield.adam_vector_width(0.9, 0.999, 1e-8))
out["update"] = dig(p_loc, p_raw, opt.exp_avg[id(p_loc)], opt.exp_avg_sq[id(p_raw)])
m2, s2 = torch.randn(64, 100, generator=g).requires_grad_(), (0.5 + torch.rand(64, 100, generator=g)).requires_grad_()
h, h2, eps = fused_sampling.sample_relu(m2, s2, 5, torch.Generator().manual_seed(2))
out["sampling"] = dig(h, h2, eps, *torch.autograd.grad((h + h2).sum(), (m2, s2)))
out["openmp"] = [m._NATIVE.openmp for m in (fused_head, fused_meanfield, fused_sampling)]
out["runtime"] = str(native.openmp_runtime())
out["torch_dir"] = str(__import__("pathlib").Path(torch.__file__).resolve().parent)
print(json.dumps(out))
"""


def _probe(tmp_path: Path, **env: str) -> dict:
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700, parents=True)
    full = dict(os.environ, PGVI_KERNEL_CACHE=str(cache), PYTHONPATH=str(ROOT), **env)
    full.pop("PGVI_FUSED_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, env=full,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _torch_on_gnu_openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info() and any(
        "libgomp" in line for line in open("/proc/self/maps", encoding="utf-8"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_openmp_and_python_threads_give_identical_results(tmp_path: Path) -> None:
    omp = _probe(tmp_path / "omp")
    py = _probe(tmp_path / "py", PGVI_KERNEL_OPENMP="0")
    assert py["openmp"] == [False, False, False] and py["runtime"] == "None"
    if _torch_on_gnu_openmp():
        # every library on torch's own runtime, not on scikit-learn's (mapped too, see the probe)
        assert omp["openmp"] == [True, True, True]
        if (Path(omp["torch_dir"]) / "lib").exists() and any((Path(omp["torch_dir"]) / "lib").glob("libgomp*")):
            assert omp["runtime"].startswith(omp["torch_dir"]), omp["runtime"]
    for key in ("head", "meanfield", "update", "sampling"):
        assert omp[key] == py[key], key


def test_a_failed_openmp_build_falls_back_to_python_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenMP build is tried first; if it cannot be built or loaded the plain build is used, not the torch
    path."""
    from common import fused_meanfield

    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("PGVI_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(native, "openmp_runtime", lambda: Path("/nonexistent/libgomp.so.1"))
    lib = native.NativeLibrary("meanfield_fallback", fused_meanfield._C_SOURCE, {})  # noqa: SLF001
    assert lib.get() is not None
    assert lib.openmp is False and lib.parallel_in_openmp() is False


def test_the_runtime_chosen_is_torchs() -> None:
    torch_dir = Path("/venv/site-packages/torch")
    sk = Path("/venv/site-packages/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0")
    own = torch_dir / "lib" / "libgomp.so.1"
    libs = torch_dir.parent / "torch.libs" / "libgomp-a34b3233.so.1"
    system = Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    assert native._choose_openmp_runtime([sk, own], torch_dir) == own  # noqa: SLF001
    assert native._choose_openmp_runtime([libs, sk], torch_dir) == libs  # noqa: SLF001
    assert native._choose_openmp_runtime([system], torch_dir) == system  # noqa: SLF001
    assert native._choose_openmp_runtime([sk, system], torch_dir) is None  # noqa: SLF001


def test_run_parallel_splits_like_run_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One driver call with all threads on an OpenMP build; otherwise one call per Python-thread chunk, each with
    one thread; the chunk bounds are multiples of ``align``."""

    class Lib:
        def __init__(self, openmp: bool) -> None:
            self.openmp = openmp

        def parallel_in_openmp(self) -> bool:
            return self.openmp

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        calls: list[tuple[int, int, int]] = []
        native.run_parallel(Lib(True), lambda lo, hi, nt: calls.append((lo, hi, nt)), 10_000, align=4096)
        assert calls == [(0, 10_000, 2)]
        calls.clear()
        native.run_parallel(Lib(True), lambda lo, hi, nt: calls.append((lo, hi, nt)), 100, align=4096)
        assert calls == [(0, 100, 1)]  # one block: no second thread
        calls.clear()
        native.run_parallel(Lib(False), lambda lo, hi, nt: calls.append((lo, hi, nt)), 10_000, align=4096)
        assert sorted(calls) == [(0, 4096, 1), (4096, 10_000, 1)]
    finally:
        torch.set_num_threads(before)


def _needed(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, timeout=60, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif(shutil.which("readelf") is None or native._compiler() is None,  # noqa: SLF001
                    reason="needs readelf and a C compiler")
def test_the_library_needs_the_runtime_it_was_linked_against(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's soname must end up in DT_NEEDED even where the linker runs with --as-needed (Debian's
    default), which drops a library named before the objects that use it; the symbols then came from the
    system's libgomp (-fopenmp's implicit -lgomp), a second OpenMP runtime beside torch's whenever torch's copy
    has another soname (wheels that bundle libgomp-<hash>.so).  scikit-learn's wheel bundles such a copy."""
    import sklearn

    hashed = sorted((Path(sklearn.__file__).resolve().parent.parent / "scikit_learn.libs").glob("libgomp-*.so*"))
    if not hashed:
        pytest.skip("no libgomp with a hashed soname here")
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("PGVI_KERNEL_CACHE", str(cache))
    from common import fused_meanfield

    so = native.compile_library("meanfield_link", fused_meanfield._C_SOURCE, *native.openmp_flags(hashed[0]))  # noqa: SLF001
    soname = subprocess.run(["readelf", "-d", str(hashed[0])], capture_output=True, text=True, timeout=60,
                            check=True).stdout.split("Library soname: [", 1)[1].split("]", 1)[0]
    needed = _needed(so)
    assert [n for n in needed if "gomp" in n] == [soname], needed


def test_alpha_renyi_counts_have_a_row_per_thread() -> None:
    """The forward driver counts a thread's out-of-domain coordinates in its own row, so the Python-thread route
    (a build without OpenMP ignores `omp atomic`) has no shared counter: with two threads over two blocks of one
    tensor, each thread's row holds its own block's violations."""
    import numpy as np

    from common import fused_meanfield as fm

    lib = fm._NATIVE.get()  # noqa: SLF001
    n = 2 * fm.BLOCK
    loc, mp = torch.zeros(n), torch.zeros(n)
    raw = torch.full((n,), -3.0)
    lp = torch.ones(n)
    lp[:37] = 1e9  # outside the alpha = 2.5 domain: 37 in the first block, 5 in the second
    lp[fm.BLOCK + 100:fm.BLOCK + 105] = 1e9
    var, chain = torch.empty(n), torch.empty(n)
    ptrs = np.array([t.data_ptr() for t in (loc, raw, mp, lp, var, chain)], dtype=np.int64)
    counts, off = np.array([n], dtype=np.int64), np.array([0, 2], dtype=np.int64)
    partial = np.zeros(2)
    bad = np.zeros((2, 1), dtype=np.int64)
    assert lib.pgvi_mf_forward_many(1, ptrs.ctypes.data, counts.ctypes.data, off.ctypes.data, 0, 2, 2, 2, 2.5, 1e-6,
                                    partial.ctypes.data, bad.ctypes.data) == 0
    assert bad.tolist() == [[37], [5]]


def test_the_cavity_changed_in_place_before_the_backward_is_an_error() -> None:
    from common import fused_meanfield as fm

    g = torch.Generator().manual_seed(0)
    loc = torch.randn(100, generator=g, requires_grad=True)
    raw = torch.full((100,), -3.0, requires_grad=True)
    mp, lp = torch.zeros(100), torch.ones(100)
    _, value, _ = fm.variance_and_divergence(loc, raw, mp, lp, "kl", 1.0, 0.5, 1e-6)
    mp.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()
