"""Benchmark of the PGVI core's hot path: one local epoch of the 784-200-10 mean-field BNN.

In one process, with ``torch.set_num_threads(--threads)``:

1. the machine's float32 matmul peak: ``torch.mm`` on square matrices of a few sizes, best GFLOP/s;
2. one epoch of :func:`common.local_gvi.local_gvi` on ``--n`` synthetic samples (inputs uniform in [0, 1]^784,
   10 random classes), batch ``--batch``, ``--samples`` Monte Carlo samples, local reparameterisation, for
   (a) ``nll`` + ``kl`` and (b) ``gce(0.8)`` + ``alpha_renyi(2.5)``;
3. samples/s, achieved GFLOP/s and its fraction of the peak, and the peak RSS of this process (``VmHWM``); with
   ``--compare-torch-path`` the child process's own peak is printed separately (this process's peak never
   includes a child's).

Both rates are reported by wall clock and by process CPU time (``time.process_time``).  On a machine shared
with other work the wall-clock figures measure the sharing; with ``--threads 1`` the CPU-time figures are
the per-core efficiency and do not depend on the load (with 2 threads, OpenMP's waiting threads also burn
CPU time, so only the wall-clock figure is meaningful, on a quiet machine).

FLOP count (matmuls only; element-wise work, sampling, the divergence and Adam are not counted but are
inside the timed epoch).  Per minibatch of ``B`` points and ``S`` samples, layer ``l`` maps ``in_l -> out_l``:

* forward (local reparameterisation, :meth:`BayesianMLP.forward_flops`): two GEMMs per layer (mean
  ``h W_mu^T`` and variance ``h^2 W_var^T``): layer 1 on the ``B`` input rows once (its moments are shared by
  all samples), later layers on ``S B`` rows: ``4 B in_1 out_1 + 4 S B sum_{l>1} in_l out_l``;
* backward: each GEMM needs the weight gradient (as many FLOPs as its forward); the input gradient is
  needed for layers > 1 only (layer 1's inputs are data): ``4 B in_1 out_1 + 8 S B sum_{l>1} in_l out_l``.

For 784-200-10, S = 10: 1,254,400 + 240,000 = 1,494,400 FLOPs per point per epoch.

Step floors (``--threads 1``, one hidden layer).  After the epochs the script measures, in the same run, lower
bounds on a step's time that no arrangement of the step's other work can remove, and the share of the peak they
leave reachable: the step's four layer-1 GEMMs as the step calls them (torch's GEMMs at those shapes); the other
matmul FLOPs at the peak rate itself; the parameter update's memory traffic, the fewest float32 streams any Adam
step on the mean-field parameters moves (gradients w.r.t. mean and variance, the cavity's two natural parameters,
mean, raw scale and their four Adam moments: 10 read, 6 written), at this core's rate for such a stream; and the
``S B H`` standard normals of the hidden layer's draw with the project's generator (Philox4x32-10 and Box-Muller),
made in a cache-resident tile and not stored.  Each is a bound for this machine with torch's GEMMs and this
generator, not for every conceivable kernel: a faster small-shape GEMM or normal generator would lower it.

Run:  .venv/bin/python scripts/bench_core.py [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from common.divergences import make_divergence  # noqa: E402
from common.families import MeanFieldGaussian  # noqa: E402
from common.local_gvi import LocalGVIConfig, local_gvi  # noqa: E402
from common.losses import make_loss  # noqa: E402
from common import fused_sampling, native  # noqa: E402
from common.models import make_model  # noqa: E402
from common.runtime import configure_compute, flush_denormals_from_environment, set_flush_denormals  # noqa: E402
from scripts.arg_types import int_at_least  # noqa: E402


def rss_mb() -> float:
    """Peak resident set size of this process so far, MiB: ``VmHWM`` of ``/proc/self/status``.

    Not ``ru_maxrss``: Linux keeps in it the peak of the image a process replaced by exec, so a child started by
    a 600-MiB parent (the ``--compare-torch-path`` child) reads at least 600 MiB from its first line on.  Without
    ``/proc``, ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def matmul_peak(sizes: list[int], min_time: float = 0.4) -> tuple[float, float, dict[int, tuple[float, float]]]:
    """Best float32 ``torch.mm`` GFLOP/s over square sizes, by wall clock and by process CPU time.

    Each size is timed in rounds of at least ``min_time`` s; the best round counts.  The CPU-time rate is
    robust to other processes sharing the cores (with one thread it is the per-core rate).
    """
    results = {}
    for n in sizes:
        a = torch.rand(n, n)
        b = torch.rand(n, n)
        c = torch.empty(n, n)
        for _ in range(3):
            torch.mm(a, b, out=c)
        best_wall, best_cpu = 0.0, 0.0
        for _ in range(3):
            reps, elapsed = 0, 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            while elapsed < min_time:
                torch.mm(a, b, out=c)
                reps += 1
                elapsed = time.perf_counter() - t0
            cpu = time.process_time() - c0
            best_wall = max(best_wall, 2.0 * n**3 * reps / elapsed / 1e9)
            best_cpu = max(best_cpu, 2.0 * n**3 * reps / cpu / 1e9)
        results[n] = (best_wall, best_cpu)
    return max(w for w, _ in results.values()), max(c for _, c in results.values()), results


def cpu_description() -> str:
    """The CPU model and its vector extensions that the kernels' code paths depend on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    flags = set(native._cpu_flags().partition(":")[2].split())  # noqa: SLF001 - the line the kernel cache keys on
    isa = [f for f in ("avx512f", "avx2", "fma", "asimd", "sve") if f in flags]
    return f"{model} ({platform.machine()}; {', '.join(isa) or 'no AVX2/AVX-512/NEON flag'})"


def kernel_description() -> str:
    if native.disabled_by_environment():
        return "off (PGVI_FUSED_KERNELS)"
    return f"built with {' '.join(f for f in native.compile_flags() if f.startswith('-march'))}"


def bnn_flops_per_point(sizes: list[int], n_samples: int) -> int:
    pairs = [sizes[i] * sizes[i + 1] for i in range(len(sizes) - 1)]
    forward = 4 * pairs[0] + 4 * n_samples * sum(pairs[1:])
    backward = 4 * pairs[0] + 8 * n_samples * sum(pairs[1:])
    return forward + backward


#: The floors' C kernels: the parameter update's fewest streams, and the hidden draw's normals made and dropped.
_FLOOR_SOURCE = fused_sampling.PHILOX_SOURCE + r"""
/* r: 4 read-only streams, w: 6 streams read and written, n elements each (the fewest an Adam step on mean-field
   parameters moves: see scripts/bench_core.py); returns nothing, the writes keep the loop */
void floor_streams(int64_t n, float *const *r, float *const *w) {
    const float *a = r[0], *b = r[1], *c = r[2], *d = r[3];
    float *p = w[0], *q = w[1], *s = w[2], *t = w[3], *u = w[4], *v = w[5];
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float g = (a[i] + b[i]) * 1e-30f + (c[i] + d[i]) * 1e-30f;
        p[i] += g; q[i] += g; s[i] += g; t[i] += g; u[i] += g; v[i] += g;
    }
}
/* n standard normals of stream 0 under (k0, k1), made tile by tile in a cache-resident buffer and summed (the
   sum keeps the work; nothing is stored) */
double floor_normals(int64_t n, uint32_t k0, uint32_t k1) {
    float z[4 * NB];
    double sum = 0.0;
    for (int64_t t = 0; t < n; t += 4 * NB) {
        philox_normals(z, (uint32_t)(t / 4), 0, k0, k1);
        int64_t m = n - t < 4 * NB ? n - t : 4 * NB;
        float part = 0.0f;
        #pragma omp simd reduction(+:part)
        for (int64_t i = 0; i < m; i++) part += z[i];
        sum += part;
    }
    return sum;
}
"""
_FLOORS = native.NativeLibrary("benchfloors", _FLOOR_SOURCE, {
    "floor_streams": ([ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p], None),
    "floor_normals": ([ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32], ctypes.c_double),
}, fallback="without the step floors")
#: float32 streams of the parameter count an Adam step on mean-field parameters reads / writes at the least
FLOOR_READS, FLOOR_WRITES = 10, 6


def _best_seconds(fn, min_time: float = 0.2, rounds: int = 5) -> float:  # type: ignore[no-untyped-def]
    """The best mean time of one call of ``fn`` over ``rounds`` rounds of at least ``min_time`` s each."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_time or reps == 0:
            fn()
            reps += 1
        best = min(best, elapsed / reps)
    return best


def step_floors(sizes: list[int], batch: int, n_samples: int, peak: float, min_time: float = 0.2
                ) -> dict[str, float] | None:
    """Lower bounds on one step's time (seconds) for the one-hidden-layer BNN ``sizes = [in, H, C]`` on this
    machine and thread count (see the module docstring), with their sum, the step's matmul FLOPs and the largest
    share of ``peak`` (GFLOP/s) they leave reachable; None without the floors' kernels or for another depth."""
    lib = _FLOORS.get()
    if lib is None or len(sizes) != 3:
        return None
    d, h, c = sizes
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch, d, generator=g)
    x2 = x * x
    w, wv = torch.randn(h, d, generator=g) * 0.05, torch.rand(h, d, generator=g) * 1e-3
    b, bv = torch.zeros(h), torch.full((h,), 1e-3)
    d_mu, d_var = torch.randn(batch, h, generator=g), torch.randn(batch, h, generator=g)

    def gemms() -> None:  # the four calls of common/explicit_step.py's step
        torch.addmm(b, x, w.t())
        torch.addmm(bv, x2, wv.t())
        d_mu.t().mm(x)
        d_var.t().mm(x2)

    params = d * h + h + h * c + c
    reads = [torch.rand(params, generator=g) for _ in range(FLOOR_READS - FLOOR_WRITES)]
    writes = [torch.rand(params, generator=g) for _ in range(FLOOR_WRITES)]
    r_ptrs = (ctypes.c_void_p * len(reads))(*[t.data_ptr() for t in reads])
    w_ptrs = (ctypes.c_void_p * len(writes))(*[t.data_ptr() for t in writes])
    normals = n_samples * batch * h
    layer1_flops = 8 * batch * d * h  # two forward GEMMs and two weight-gradient GEMMs
    step_flops = bnn_flops_per_point(sizes, n_samples) * batch
    out = {
        "gemms": _best_seconds(gemms, min_time),
        "other_matmul": (step_flops - layer1_flops) / (peak * 1e9),
        "streams": _best_seconds(lambda: lib.floor_streams(params, r_ptrs, w_ptrs), min_time),
        "normals": _best_seconds(lambda: lib.floor_normals(normals, 12345, 678), min_time),
    }
    out["stream_bytes"] = float(4 * params * (FLOOR_READS + FLOOR_WRITES))
    out["layer1_flops"], out["step_flops"], out["normals_count"] = float(layer1_flops), float(step_flops), float(normals)
    out["sum"] = out["gemms"] + out["other_matmul"] + out["streams"] + out["normals"]
    out["reachable"] = step_flops / out["sum"] / (peak * 1e9)
    return out


def floors_line(fl: dict[str, float], peak: float, batch: int, step_seconds: dict[str, float],
                target: float = 0.6) -> str:
    """The printed summary of :func:`step_floors` against the epochs' seconds per step."""
    ms = {k: 1e3 * fl[k] for k in ("gemms", "other_matmul", "streams", "normals", "sum")}
    need = 1e3 * fl["step_flops"] / (target * peak * 1e9)
    took = ", ".join(f"{name} {1e3 * t:.2f}" for name, t in step_seconds.items())
    return (f"step floors, ms per step of {batch} points (lower bounds on this machine, torch's GEMMs and this "
            f"generator): layer-1 GEMMs {ms['gemms']:.2f} ({fl['layer1_flops'] / fl['gemms'] / 1e9:.1f} GFLOP/s); "
            f"the other matmul FLOPs at the peak {ms['other_matmul']:.2f}; the parameter update's "
            f"{FLOOR_READS} + {FLOOR_WRITES} float32 streams {ms['streams']:.2f} "
            f"({fl['stream_bytes'] / fl['streams'] / 1e9:.1f} GB/s); {fl['normals_count']:,.0f} normals "
            f"{ms['normals']:.2f}; sum {ms['sum']:.2f} -> at most {100 * fl['reachable']:.0f}% of the peak is "
            f"reachable ({100 * target:.0f}% needs {need:.2f} ms per step; the epochs took {took})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int_at_least(1, " (synthetic samples)"), default=20_000)
    ap.add_argument("--batch", type=int_at_least(1, " (a minibatch size)"), default=256)
    ap.add_argument("--samples", type=int_at_least(1, " (Monte Carlo samples)"), default=10)
    ap.add_argument("--hidden", type=int, default=200)
    ap.add_argument("--repeats", type=int_at_least(1, " (timed epochs)"), default=3,
                    help="timed epochs per configuration (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of 20 training steps")
    ap.add_argument("--compare-torch-path", action="store_true",
                    help="then run the same epochs in a child process with PGVI_FUSED_KERNELS=0 (the torch path) "
                         "and print the kernels' speed-up measured in this run")
    ap.add_argument("--compare-autograd-route", type=int, default=0, metavar="ROUNDS",
                    help="then, in this process, alternate the explicit step (common/explicit_step.py) and the autograd "
                         "route with the same kernels (PGVI_EXPLICIT_STEP=0) for ROUNDS rounds of one epoch per "
                         "configuration, and print best / median epoch times and the ratio of the best")
    ap.add_argument("--default-allocator", action="store_true",
                    help="keep glibc's malloc thresholds (the clients tune them: common.runtime.configure_compute)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        raise SystemExit("--threads must be >= 1")
    if args.default_allocator:  # the clients' floating-point mode all the same, so that only the allocator differs
        set_flush_denormals(flush_denormals_from_environment())
        torch.set_num_threads(args.threads)
    else:
        configure_compute(args.threads)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"allocator {'default' if args.default_allocator else 'tuned'}, load average {os.getloadavg()}")
    print(f"cpu: {cpu_description()}; kernels {kernel_description()}")
    print(f"peak RSS after imports: {rss_mb():.0f} MiB")
    g = torch.Generator().manual_seed(args.seed)
    x = torch.rand(args.n, 784, generator=g)
    y = torch.randint(0, 10, (args.n,), generator=g)
    model = make_model("bnn", in_features=784, hidden=[args.hidden], num_classes=10)
    prior = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 1.0, dtype=torch.float32)
    mean = model.init_mean(torch.Generator().manual_seed(args.seed))
    init = MeanFieldGaussian.from_mean_variance(mean, {k: torch.full_like(v, 1e-3) for k, v in mean.items()})
    flops_point = bnn_flops_per_point(model.sizes, args.samples)

    base = LocalGVIConfig(epochs=1, batch_size=args.batch, lr=5e-4, n_samples=args.samples, patience=None,
                          seed=args.seed, local_reparam=True, objective_estimate="running")
    cases = [
        ("nll + kl", make_loss("nll"), make_divergence("kl")),
        ("gce(0.8) + alpha_renyi(2.5)", make_loss("gce", delta=0.8), make_divergence("alpha_renyi", alpha=2.5)),
    ]
    # warm-up (first-call costs: the optimiser import, allocator growth)
    local_gvi(model, cases[0][1], cases[0][2], prior, x[: 4 * args.batch], y[: 4 * args.batch], init, base)

    # The epochs run before the matmul peak: its 16 MB matrices would raise glibc's dynamic mmap threshold
    # and hide the allocator's page faults that a client process sees (see common/runtime.py).
    measured = []
    for name, loss, div in cases:
        times, cpus, faults = [], [], []
        for r in range(args.repeats):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            res = local_gvi(model, loss, div, prior, x, y, init, replace(base, seed=args.seed + r))
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        measured.append((name, times, cpus, faults, res, rss_mb()))

    epochs_rss = rss_mb()  # the epochs' peak, before the matmul peak's 16-MiB matrices add to it
    peak, peak_cpu, per_size = matmul_peak([256, 512, 1024, 2048])
    print("matmul float32 GFLOP/s by size (wall / per CPU-second): "
          + ", ".join(f"{n}: {w:.1f} / {c:.1f}" for n, (w, c) in per_size.items()))
    print(f"peak: {peak:.1f} GFLOP/s wall, {peak_cpu:.1f} GFLOP per CPU-second")
    print(f"model {model.sizes}, {model.num_params} parameters; {flops_point:,} matmul FLOPs per point per epoch")
    for name, times, cpus, faults, res, rss_after in measured:
        best, best_cpu = min(times), min(cpus)
        gflops = flops_point * args.n / best / 1e9
        gflops_cpu = flops_point * args.n / best_cpu / 1e9
        print(
            f"[{name}] epoch {best:.3f} s wall (runs {', '.join(f'{t:.2f}' for t in times)}), "
            f"{args.n / best:,.0f} samples/s, {gflops:.1f} GFLOP/s = {100 * gflops / peak:.0f}% of the wall peak; "
            f"{best_cpu:.3f} CPU-s, {gflops_cpu:.1f} GFLOP per CPU-second = {100 * gflops_cpu / peak_cpu:.0f}% of "
            f"the CPU-time peak; minor page faults per epoch {', '.join(str(f) for f in faults)}; "
            f"objective {res.objective_trace[0]:.1f}, path {res.path}, peak RSS after it {rss_after:.0f} MiB"
        )

    if args.threads == 1:
        fl = step_floors(model.sizes, args.batch, args.samples, peak)
        if fl is not None:
            steps = math.ceil(args.n / args.batch)
            print(floors_line(fl, peak, args.batch, {name: min(times) / steps for name, times, *_ in measured}))
    else:
        print("step floors: measured with --threads 1 only (the floors' kernels run on one thread)")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        sub = 20 * args.batch
        with profile(activities=[ProfilerActivity.CPU], record_shapes=bool(os.environ.get("BENCH_SHAPES"))) as prof:
            local_gvi(model, cases[1][1], cases[1][2], prior, x[:sub], y[:sub], init, base)
        print(prof.key_averages(group_by_input_shape=bool(os.environ.get("BENCH_SHAPES"))).table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("BENCH_ROWS", "25"))))

    if args.compare_autograd_route > 0:
        compare_autograd_route(args.compare_autograd_route, cases, model, prior, x, y, init, base)
    child_rss = None
    if args.compare_torch_path and not native.disabled_by_environment():
        child_rss = compare_torch_path(args, {name: min(times) for name, times, *_ in measured})
    in_process = "matmul peak" + (" and autograd-route comparison" if args.compare_autograd_route > 0 else "")
    child = "" if child_rss is None else f"; of the torch-path child process (its own peak): {child_rss:.0f} MiB"
    print(f"peak RSS of the epochs: {epochs_rss:.0f} MiB (the target's figure); of this process over the whole run, "
          f"{in_process} included: {rss_mb():.0f} MiB{child}; load average after: {os.getloadavg()}")


def torch_path_command(args: argparse.Namespace) -> list[str]:
    """This script with every option of this run but the profile and the comparisons."""
    cmd = [sys.executable, __file__]
    for key, value in vars(args).items():
        if key in ("profile", "compare_torch_path", "compare_autograd_route") or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    return cmd


#: the figure the last line gives for the whole run of the process that printed it (read back from the child)
_WHOLE_RUN_RSS = re.compile(r"of this process over the whole run, [^:]*: ([0-9.]+) MiB")


def compare_torch_path(args: argparse.Namespace, kernel_epoch: dict[str, float]) -> float | None:
    """The same epochs in a fresh interpreter with the kernels off; prints its lines and the speed-ups, and returns
    the child's peak RSS in MiB as the child reports it (its own ``VmHWM``; None if its output has no such line)."""
    out = subprocess.run(torch_path_command(args), env=dict(os.environ, PGVI_FUSED_KERNELS="0"),
                         capture_output=True, text=True, check=True).stdout
    whole = _WHOLE_RUN_RSS.findall(out)
    torch_epoch = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\[(.+?)\] epoch ([0-9.]+) s wall", out, re.M)}
    print("torch path (PGVI_FUSED_KERNELS=0, child process):")
    for line in out.splitlines():
        if line.startswith(("peak:", "[")):
            print(f"  {line}")
    for name, t in kernel_epoch.items():
        if name in torch_epoch:
            print(f"[{name}] kernels {t:.3f} s vs torch path {torch_epoch[name]:.3f} s per epoch: "
                  f"{torch_epoch[name] / t:.2f}x")
    return float(whole[-1]) if whole else None


def compare_autograd_route(rounds: int, cases: list, model, prior, x, y, init, base) -> None:  # type: ignore[no-untyped-def]
    """Alternate the two routes of a local step in this process (the machine's drift hits both alike)."""
    from common import explicit_step

    saved = os.environ.get(explicit_step.ENV_SWITCH)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(rounds):
            for route, switch in (("explicit step", "1"), ("autograd route", "0")):
                os.environ[explicit_step.ENV_SWITCH] = switch
                for name, loss, div in cases:
                    t0 = time.perf_counter()
                    local_gvi(model, loss, div, prior, x, y, init, replace(base, seed=base.seed + r))
                    times.setdefault((name, route), []).append(time.perf_counter() - t0)
    finally:
        if saved is None:
            os.environ.pop(explicit_step.ENV_SWITCH, None)
        else:
            os.environ[explicit_step.ENV_SWITCH] = saved
    print(f"explicit step vs autograd route, {rounds} alternating rounds in this process (s per epoch, best / median):")
    for name, _, _ in cases:
        e, a = sorted(times[(name, "explicit step")]), sorted(times[(name, "autograd route")])
        print(f"[{name}] explicit {e[0]:.3f} / {e[len(e) // 2]:.3f}, autograd {a[0]:.3f} / {a[len(a) // 2]:.3f}: "
              f"best {a[0] / e[0]:.2f}x")


if __name__ == "__main__":
    main()
