"""The compiled kernels on every x86-64 instruction-set level they have a code path for.

The C sources choose their vector widths and the Philox multiply by the target's ISA (``__AVX512F__``,
``__AVX2__``, neither: the generic path that arm64 also takes).  A test run only ever builds the machine's own
path, so here the kernel test modules run again in fresh interpreters with ``PGVI_KERNEL_MARCH`` set to the
baseline ``x86-64`` (SSE2: generic path) and ``x86-64-v3`` (AVX2 without AVX-512), each with its own kernel
cache; and the generator's raw words and normals are compared across the builds.  Also: the head's two forms of
its lane sums against each other, the kernels built by clang, and the generator and the head built for arm64 and
run under qemu.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import native

ROOT = Path(__file__).resolve().parents[1]
MARCHES = ["x86-64", "x86-64-v3"]
#: the kernel tests that compare with torch formulas, closed forms and the reference Philox; the compiler-missing,
#: fork and cache tests do not depend on the ISA and are left to their own modules.
SELECT = "not compiler and not disabled and not fork and not shared_cache"


def _cc_supports(march: str) -> bool:
    cc = native._compiler()  # noqa: SLF001
    if cc is None:
        return False
    proc = subprocess.run([cc, f"-march={march}", "-x", "c", "-E", "-"], input="", capture_output=True, text=True,
                          timeout=60)
    return proc.returncode == 0


pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels"),
    pytest.mark.skipif(native.disabled_by_environment(), reason="kernels disabled"),
]


def _env(march: str, cache: Path) -> dict[str, str]:
    env = dict(os.environ, PGVI_KERNEL_MARCH=march, PGVI_KERNEL_CACHE=str(cache))
    env.pop("PGVI_FUSED_KERNELS", None)
    return env


def _assert_kernel_tests_pass(env: dict[str, str], cache: Path) -> None:
    """The ISA-dependent kernel tests pass in a fresh interpreter with ``env``, having built all three kernels
    into ``cache``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SELECT,
         "tests/test_fused_sampling.py", "tests/test_fused_head.py", "tests/test_fused_meanfield.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    built = sorted(p.name.split("_")[1] for p in cache.glob("pgvi_*.so"))
    assert built == ["head", "meanfield", "sampling"], built


@pytest.mark.parametrize("march", MARCHES)
def test_kernel_tests_pass_when_built_for(march: str, tmp_path: Path) -> None:
    if not _cc_supports(march):
        pytest.skip(f"the C compiler does not know -march={march}")
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    _assert_kernel_tests_pass(_env(march, cache), cache)


_PROBE = r"""
import json, torch
from common import fused_sampling, native
lib = fused_sampling._NATIVE.get()
assert lib is not None
w = torch.empty(4 * 256, dtype=torch.int32)
lib.pgvi_philox_raw(w.data_ptr(), 7, 3, 0x12345678, 0x9ABCDEF0)
z = fused_sampling.standard_normal(5000, 2, 123456789)
print(json.dumps({"flags": native.compile_flags(), "raw": w.tolist(), "z": z.tolist()}))
"""


def test_generator_gives_the_same_numbers_on_every_isa(tmp_path: Path) -> None:
    marches = [m for m in MARCHES if _cc_supports(m)] + ["native"]
    out = {}
    for march in marches:
        cache = tmp_path / march
        cache.mkdir(mode=0o700)
        proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=_env(march, cache), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[march] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert f"-march={march}" in out[march]["flags"]
    base = out["native"]
    for march in marches:
        assert out[march]["raw"] == base["raw"], march  # the integer generator is exact
        diff = max(abs(a - b) for a, b in zip(out[march]["z"], base["z"], strict=True))
        assert diff <= 2e-6, (march, diff)  # libmvec's variants for each width may differ in the last bits


def test_march_override_changes_the_build_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGVI_KERNEL_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in native.compile_flags() and "-march=native" not in native.compile_flags()
    monkeypatch.delenv("PGVI_KERNEL_MARCH")
    assert native.compile_flags() == native.FLAGS


_ARM_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
    uint32_t k0 = (uint32_t)strtoul(argv[1], 0, 10), k1 = (uint32_t)strtoul(argv[2], 0, 10);
    static uint32_t w[4 * NB];
    static float z[5000];
    pgvi_philox_raw(w, 7, 3, 0x12345678u, 0x9ABCDEF0u);
    for (int i = 0; i < 4 * NB; i++) printf("%u\n", w[i]);
    pgvi_normals(z, 5000, 2, k0, k1);
    for (int i = 0; i < 5000; i++) printf("%.9g\n", z[i]);
    return 0;
}
"""


def _executable_flags(march: str) -> list[str]:
    """The kernels' compile flags for an executable (no ``-fPIC -shared``) with ``-march=march``."""
    return [f"-march={march}" if f.startswith("-march=") else f for f in native.FLAGS if f not in ("-fPIC", "-shared")]


def _build_arm64(tmp_path: Path, name: str, source: str) -> Path:
    """``source`` (a kernel's C source and a ``main``) built as a static arm64 executable with the kernels' flags."""
    src = tmp_path / f"{name}.c"
    src.write_text(native.PRELUDE + source, encoding="utf-8")
    exe = tmp_path / name
    subprocess.run(["aarch64-linux-gnu-gcc", *_executable_flags("armv8-a"), "-static", str(src), "-o", str(exe), "-lm"],
                   check=True, capture_output=True, timeout=300)
    return exe


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
                    reason="needs Debian's gcc-aarch64-linux-gnu and qemu-user")
def test_arm64_build_gives_the_same_generator_numbers(tmp_path: Path) -> None:
    """The generator built for arm64 (its NEON multiply path), run under qemu, against this machine's build."""
    import torch

    from common import fused_sampling

    exe = _build_arm64(tmp_path, "philox_arm64", fused_sampling._C_SOURCE + _ARM_MAIN)  # noqa: SLF001
    asm = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(exe)], capture_output=True, text=True, check=True)
    assert "umull" in asm.stdout  # the NEON multiply path was built, not the scalar fallback
    k0, k1 = fused_sampling._split_key(123456789)  # noqa: SLF001
    out = subprocess.run(["qemu-aarch64", str(exe), str(k0), str(k1)], capture_output=True, text=True, check=True,
                         timeout=300).stdout.split()
    raw_arm, z_arm = [int(v) for v in out[: 4 * 256]], torch.tensor([float(v) for v in out[4 * 256:]])
    lib = fused_sampling._NATIVE.get()  # noqa: SLF001
    if lib is None:
        pytest.skip("kernels unavailable on this machine")
    w = torch.empty(4 * 256, dtype=torch.int32)
    lib.pgvi_philox_raw(w.data_ptr(), 7, 3, 0x12345678, 0x9ABCDEF0)
    assert raw_arm == [v & 0xFFFFFFFF for v in w.tolist()]
    z = fused_sampling.standard_normal(5000, 2, 123456789)
    assert z_arm.shape == z.shape
    assert float((z_arm - z).abs().max()) <= 4e-6  # scalar libm on arm64, libmvec here


_HEAD_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
static void *read_n(FILE *f, size_t size, int64_t n) {
    void *p = malloc(size * (size_t)(n > 0 ? n : 1));
    if (!p || fread(p, size, (size_t)n, f) != (size_t)n) { fprintf(stderr, "short read\n"); exit(3); }
    return p;
}
static void print_all(const float *x, int64_t n) { for (int64_t i = 0; i < n; i++) printf("%.9g\n", x[i]); }
/* argv: input file, k0, k1, gscale.  The file: int64 cases, then per case int64 R, H, C, D, float32 delta and
   float32 mu, sd (R x H), wm, wv (C x H), bm, bv (C), int64 y (R); every row of a case in one block. */
int main(int argc, char **argv) {
    if (argc != 5) return 4;
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 5;
    uint32_t k0 = (uint32_t)strtoul(argv[2], 0, 10), k1 = (uint32_t)strtoul(argv[3], 0, 10);
    float gscale = strtof(argv[4], 0);
    int64_t *ncase = read_n(f, 8, 1);
    for (int64_t n = 0; n < *ncase; n++) {
        int64_t *dim = read_n(f, 8, 4), R = dim[0], H = dim[1], C = dim[2], D = dim[3];
        float *delta = read_n(f, 4, 1);
        float *mu = read_n(f, 4, R * H), *sd = read_n(f, 4, R * H), *wm = read_n(f, 4, C * H),
              *wv = read_n(f, 4, C * H), *bm = read_n(f, 4, C), *bv = read_n(f, 4, C);
        int64_t *y = read_n(f, 8, R);
        float *dmu = calloc(R * H, 4), *dvar = calloc(R * H, 4), *dwm = calloc(C * H, 4), *dwv = calloc(C * H, 4),
              *dbm = calloc(C, 4), *dbv = calloc(C, 4);
        double loss = 0.0;
        int st = pgvi_head_block(mu, sd, R, H, wm, bm, wv, bv, C, y, R, D, k0, k1, *delta, gscale, 1, 0, R, &loss,
                                 dmu, dvar, dwm, dwv, dbm, dbv);
        printf("%d\n%.17g\n", st, loss);
        print_all(dmu, R * H); print_all(dvar, R * H); print_all(dwm, C * H); print_all(dbm, C);
        print_all(dwv, C * H); print_all(dbv, C);
    }
    return 0;
}
"""
#: (R, H, C, D, delta): R not a multiple of the kernel's 4-row groups, H of either vector width, 8 C of the
#: lane_sums width (3 classes: a partial transpose, and an odd class count for the weight-gradient pairs); the
#: GCE loss and the NLL.  R <= BLOCK_ROWS: one block on either side, so no partial sums to add.
_HEAD_CASES = [(37, 37, 3, 4, 0.5), (20, 200, 10, 3, 0.0)]


def _write_head_inputs(path: Path, specs: list[tuple[int, int, int, int, float]]) -> tuple[Path, list]:
    """Deterministic inputs of ``_HEAD_MAIN`` for each ``(R, H, C, D, delta)`` in ``specs``, written to ``path``;
    returns it and ``[(D, delta, tensors)]`` (positive scales and variances, labels in ``[0, C)``)."""
    import struct

    import torch

    from common import fused_head

    g = torch.Generator().manual_seed(20260101)
    cases, blob = [], [struct.pack("<q", len(specs))]
    for rows, width, classes, draws, delta in specs:
        assert rows <= fused_head.BLOCK_ROWS
        t = {"mu": torch.randn(rows, width, generator=g),
             "sd": 0.1 + torch.rand(rows, width, generator=g),
             "wm": torch.randn(classes, width, generator=g) / width**0.5,
             "wv": (0.01 + torch.rand(classes, width, generator=g)) / width,
             "bm": 0.1 * torch.randn(classes, generator=g),
             "bv": 0.01 + 0.1 * torch.rand(classes, generator=g),
             "y": torch.randint(0, classes, (rows,), generator=g)}
        cases.append((draws, delta, t))
        blob.append(struct.pack("<4qf", rows, width, classes, draws, delta))
        blob += [t[k].numpy().tobytes() for k in ("mu", "sd", "wm", "wv", "bm", "bv", "y")]
    path.write_bytes(b"".join(blob))
    return path, cases


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
                    reason="needs Debian's gcc-aarch64-linux-gnu and qemu-user")
def test_arm64_head_matches_this_machines_head(tmp_path: Path) -> None:
    """The categorical head built for arm64 (VL 8 vectors through GCC's generic vector extensions, the scalar
    ``lane_sums``, NEON Philox), run under qemu over every row in one block, against this machine's build (x86:
    the transposing ``lane_sums``) through :func:`common.fused_head.loss_and_gradients`."""
    import torch

    from common import fused_head, fused_sampling

    if not fused_head.available():
        pytest.skip("kernels unavailable on this machine")
    data, cases = _write_head_inputs(tmp_path / "head_inputs.bin", _HEAD_CASES)

    exe = _build_arm64(tmp_path, "head_arm64", fused_head._C_SOURCE + _HEAD_MAIN)  # noqa: SLF001
    k0, k1 = fused_sampling._split_key(987654321)  # noqa: SLF001
    gscale = 0.25
    out = subprocess.run(["qemu-aarch64", str(exe), str(data), str(k0), str(k1), repr(gscale)], capture_output=True,
                         text=True, check=True, timeout=300).stdout.split()

    pos = 0
    for draws, delta, t in cases:
        rows, width = t["mu"].shape
        classes = t["wm"].shape[0]
        status, loss_arm = int(out[pos]), float(out[pos + 1])
        pos += 2
        assert status == 0
        arm = []
        for shape in ((rows, width), (rows, width), (classes, width), (classes,), (classes, width), (classes,)):
            n = int(torch.Size(shape).numel())
            arm.append(torch.tensor([float(v) for v in out[pos:pos + n]]).reshape(shape))
            pos += n
        loss, grads = fused_head.loss_and_gradients(t["mu"], t["sd"], t["wm"], t["bm"], t["wv"], t["bv"], t["y"],
                                                    draws, delta, gscale, k0, k1, True)
        assert grads is not None
        assert torch.isfinite(torch.tensor([loss, loss_arm])).all()
        # Not bit for bit: the builds share the generator's integers and the summation orders that do not depend
        # on the vector width, but the normals and exp/log come from scalar libm on arm64 and libmvec here (last
        # bits, see the generator test), and the dot products over H and the weight gradients run in VL = 8 lanes
        # there and 16 here with AVX-512.  Seen: losses (double sums of float rows) within 3e-9 relative, every
        # gradient entry within 3e-7 of its tensor's largest entry, small entries (cancellation) up to 4e-4
        # relative; hence an atol relative to the largest entry, rtol 1e-4.  A wrong lane of lane_sums' transpose
        # moves the loss by ~1e-2 relative and entries by ~4e-2 of the largest.
        assert loss_arm == pytest.approx(loss, rel=1e-6)
        names = ("dmu", "dvar", "dwm", "dbm", "dwv", "dbv")
        for name, a, b in zip(names, arm, grads, strict=True):
            assert a.shape == b.shape, name
            scale = float(b.abs().max())
            assert scale > 0, name
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, nm=name: f"{nm}: {m}")
    assert pos == len(out)


#: more shapes for the x86 builds: 64 classes (MAXC), one class, 17 (a partial last transpose), two
_LANE_SUM_CASES = _HEAD_CASES + [(9, 50, 64, 2, 0.8), (11, 16, 1, 2, 0.0), (5, 33, 17, 1, 0.3), (6, 24, 2, 3, 0.0)]


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_transposing_lane_sums_give_the_scalar_sums_bit_for_bit(march: str, tmp_path: Path) -> None:
    """The head built as the kernels build it (AVX-512 or AVX2: the transposing ``lane_sums``) and with
    ``-DPGVI_SCALAR_LANE_SUMS`` (each lane sum as a scalar loop in lane order) prints the same loss and gradients,
    digit for digit (``%.9g`` round-trips a float, ``%.17g`` a double)."""
    from common import fused_head, fused_sampling

    cc = native._compiler()  # noqa: SLF001
    if cc is None or not _cc_supports(march):
        pytest.skip(f"no C compiler for -march={march}")
    data, _ = _write_head_inputs(tmp_path / "inputs.bin", _LANE_SUM_CASES)
    src = tmp_path / "head.c"
    src.write_text(native.PRELUDE + fused_head._C_SOURCE + _HEAD_MAIN, encoding="utf-8")  # noqa: SLF001
    flags = _executable_flags(march)
    k0, k1 = fused_sampling._split_key(20261126)  # noqa: SLF001
    outputs, binaries = [], []
    for extra in ([], ["-DPGVI_SCALAR_LANE_SUMS"]):
        exe = tmp_path / f"head{'-scalar' if extra else ''}"
        subprocess.run([cc, *flags, *extra, str(src), "-o", str(exe), "-lm"], check=True, capture_output=True,
                       timeout=300)
        binaries.append(exe.read_bytes())
        outputs.append(subprocess.run([str(exe), str(data), str(k0), str(k1), "0.25"], capture_output=True, text=True,
                                      check=True, timeout=300).stdout)
    assert binaries[0] != binaries[1]  # the switch took effect
    assert outputs[0].split()[0] == "0" and len(outputs[0].split()) > 1000
    assert outputs[0] == outputs[1]


def _clang() -> str | None:
    return shutil.which("clang") or next(
        (c for v in range(30, 10, -1) if (c := shutil.which(f"clang-{v}"))), None)


@pytest.mark.skipif(_clang() is None, reason="no clang (Debian's clang)")
def test_kernel_tests_pass_when_built_with_clang(tmp_path: Path) -> None:
    """The kernels' compiler falls back to clang where ``cc``/``gcc`` are missing (``CC`` chooses it): their tests
    pass with every kernel built by clang (clang spells GCC's vector shuffles differently)."""
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    env = dict(_env("native", cache), CC=str(_clang()))
    _assert_kernel_tests_pass(env, cache)


def test_avx512_path_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX-512 path (512-bit vectors, its own Philox multiply) cannot run on a CPU without AVX-512, but it
    must build with the flags the kernels use; checked by compiling every kernel for ``x86-64-v4`` through the
    kernels' own build (``native.compile_library``), without loading it."""
    if not _cc_supports("x86-64-v4"):
        pytest.skip("the C compiler does not know -march=x86-64-v4")
    from common import fused_head, fused_meanfield, fused_sampling

    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("PGVI_KERNEL_MARCH", "x86-64-v4")
    monkeypatch.setenv("PGVI_KERNEL_CACHE", str(cache))
    for name, module in (("sampling", fused_sampling), ("head", fused_head), ("meanfield", fused_meanfield)):
        so = native.compile_library(name, module._C_SOURCE)  # noqa: SLF001
        if shutil.which("objdump"):
            asm = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
            assert "%zmm" in asm, name  # 512-bit code was generated
