"""common.fused_sampling: the compiled Philox/Box-Muller generator is standard normal, the fused ReLU layer
equals the torch formula on the same noise (values and gradients), results do not depend on the thread
count, and the model falls back to torch's sampler when the kernels cannot be built."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import fused_sampling as fs
from common.families import MeanFieldGaussian
from common.models import make_model

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not fs.available(), reason="fused sampling kernels could not be built here")


def test_generator_is_standard_normal() -> None:
    n = 1 << 20
    z = fs.standard_normal(n, stream=3, key=0x1234_5678_9ABC).double()
    se = 1.0 / math.sqrt(n)
    assert abs(z.mean().item()) < 5 * se
    assert abs(z.var().item() - 1.0) < 5 * math.sqrt(2.0) * se
    assert abs(((z - z.mean()) ** 4).mean().item() / z.var().item() ** 2 - 3.0) < 5 * math.sqrt(24.0) * se
    # Kolmogorov-Smirnov distance to N(0, 1) (critical value at 1e-4: 2.15 / sqrt(n))
    zs, _ = torch.sort(z)
    cdf = 0.5 * (1.0 + torch.erf(zs / math.sqrt(2.0)))
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum((grid - cdf).abs(), (cdf - (grid - 1.0 / n)).abs()).max().item()
    assert ks < 2.15 / math.sqrt(n), ks
    assert z.abs().max().item() <= 5.7682  # sqrt(2 log 2^24): the radius uniform is at least 2^-24


def test_streams_and_keys_are_independent_and_reproducible() -> None:
    n = 200_000
    a = fs.standard_normal(n, 0, 7)
    assert torch.equal(a, fs.standard_normal(n, 0, 7))
    for other in (fs.standard_normal(n, 1, 7), fs.standard_normal(n, 0, 8), fs.standard_normal(n, 0, 7 + (1 << 32))):
        assert not torch.equal(a, other)
        corr = torch.corrcoef(torch.stack([a, other]).double())[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(n)
    # a prefix is the same numbers (counters, not a sequential state)
    assert torch.equal(fs.standard_normal(1001, 0, 7), a[:1001])


def _inputs(rows: int = 37, width: int = 53, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(rows, width, generator=g)
    sd = torch.rand(rows, width, generator=g) + 0.05
    return mu, sd


def test_forward_and_backward_equal_the_torch_formula_on_the_same_noise() -> None:
    mu, sd = _inputs()
    mu.requires_grad_(True)
    sd.requires_grad_(True)
    h, h2, eps = fs.sample_relu(mu, sd, 7, torch.Generator().manual_seed(1))
    assert h.shape == h2.shape == eps.shape == (7, 37, 53)
    a = (mu.detach().double() + sd.detach().double() * eps.double()).clamp_min(0.0)
    assert torch.allclose(h.double(), a, rtol=1e-6, atol=1e-6)
    assert torch.allclose(h2.double(), a * a, rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(h.shape, generator=g), torch.randn(h.shape, generator=g)
    d_mu, d_sd = torch.autograd.grad((w1 * h).sum() + (w2 * h2).sum(), (mu, sd))
    # reference: autograd through the torch formula in float64 with the same eps
    mu64 = mu.detach().double().requires_grad_(True)
    sd64 = sd.detach().double().requires_grad_(True)
    ref_h = torch.relu(mu64 + sd64 * eps.double())
    r_mu, r_sd = torch.autograd.grad((w1.double() * ref_h).sum() + (w2.double() * ref_h * ref_h).sum(), (mu64, sd64))
    assert torch.allclose(d_mu.double(), r_mu, rtol=1e-4, atol=1e-4)
    assert torch.allclose(d_sd.double(), r_sd, rtol=1e-4, atol=1e-4)


def test_gradient_of_h_alone() -> None:
    mu, sd = _inputs(5, 9, seed=3)
    mu.requires_grad_(True)
    sd.requires_grad_(True)
    h, _, eps = fs.sample_relu(mu, sd, 4, torch.Generator().manual_seed(4))
    d_mu, d_sd = torch.autograd.grad(h.sum(), (mu, sd))
    mask = (h > 0).float()
    assert torch.allclose(d_mu, mask.sum(0), atol=1e-5)
    assert torch.allclose(d_sd, (mask * eps).sum(0), atol=1e-5)


def test_nan_propagates() -> None:
    mu, sd = _inputs(3, 4)
    mu[1, 2] = math.nan
    h, _, _ = fs.sample_relu(mu, sd, 2, torch.Generator().manual_seed(0))
    assert torch.isnan(h[:, 1, 2]).all() and int(torch.isnan(h).sum()) == 2


def test_same_seed_same_samples_and_thread_count_does_not_matter() -> None:
    mu, sd = _inputs(64, 100)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fs.sample_relu(mu, sd, 9, torch.Generator().manual_seed(5))
        torch.set_num_threads(2)
        two = fs.sample_relu(mu, sd, 9, torch.Generator().manual_seed(5))
        mu_g, sd_g = mu.clone().requires_grad_(True), sd.clone().requires_grad_(True)
        h, h2, _ = fs.sample_relu(mu_g, sd_g, 9, torch.Generator().manual_seed(5))
        grads_two = torch.autograd.grad(h.sum() + h2.sum(), (mu_g, sd_g))
        torch.set_num_threads(1)
        mu_g, sd_g = mu.clone().requires_grad_(True), sd.clone().requires_grad_(True)
        h, h2, _ = fs.sample_relu(mu_g, sd_g, 9, torch.Generator().manual_seed(5))
        grads_one = torch.autograd.grad(h.sum() + h2.sum(), (mu_g, sd_g))
    finally:
        torch.set_num_threads(before)
    for x, y in zip(one, two):
        assert torch.equal(x, y)
    for x, y in zip(grads_one, grads_two):
        assert torch.equal(x, y)
    three = fs.sample_relu(mu, sd, 9, torch.Generator().manual_seed(6))
    assert not torch.equal(one[0], three[0])


def test_rejects_what_it_cannot_take() -> None:
    mu, sd = _inputs(3, 4)
    with pytest.raises(RuntimeError, match="float32"):
        fs.sample_relu(mu.double(), sd.double(), 2)
    with pytest.raises(ValueError, match="shape"):
        fs.sample_relu(mu, sd[:2], 2)
    with pytest.raises(ValueError, match="n_samples"):
        fs.sample_relu(mu, sd, 0)


def _bnn_and_q(seed: int = 0) -> tuple[object, MeanFieldGaussian]:
    model = make_model("bnn", in_features=6, hidden=[16, 12], num_classes=3)
    mean = model.init_mean(torch.Generator().manual_seed(seed))
    var = {k: torch.full_like(v, 0.05) for k, v in mean.items()}
    return model, MeanFieldGaussian.from_mean_variance(mean, var)


def test_model_fused_and_torch_paths_agree_in_distribution() -> None:
    """The predictive probabilities (a per-point expectation) of the fused and the torch sampler agree to
    Monte Carlo error, and so do their gradients' expectations w.r.t. the means."""
    model, q = _bnn_and_q()
    x = torch.randn(20, 6, generator=torch.Generator().manual_seed(1))
    s = 20_000
    p_fused = model.predictive_probs(q, x, s, generator=torch.Generator().manual_seed(2))
    model.use_fused_sampling = False
    p_torch = model.predictive_probs(q, x, s, generator=torch.Generator().manual_seed(3))
    model.use_fused_sampling = True
    assert (p_fused - p_torch).abs().max().item() < 0.02
    assert torch.allclose(p_fused.sum(-1), torch.ones(20, dtype=p_fused.dtype), atol=1e-5)


def test_model_uses_the_fused_path_and_is_reproducible() -> None:
    model, q = _bnn_and_q()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    mean, var = q.mean(), q.variance()
    out1 = model.output_local_reparam(mean, var, x, 5, torch.Generator().manual_seed(9)).logits
    out2 = model.output_local_reparam(mean, var, x, 5, torch.Generator().manual_seed(9)).logits
    assert torch.equal(out1, out2)
    model.use_fused_sampling = False
    out3 = model.output_local_reparam(mean, var, x, 5, torch.Generator().manual_seed(9)).logits
    assert out3.shape == out1.shape and not torch.equal(out1, out3)  # a different generator: the fused path ran


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


_PROBE = (
    "import torch, logging; logging.basicConfig(level=logging.WARNING)\n"
    "from common import fused_sampling as fs\n"
    "from common.models import make_model\n"
    "from common.families import MeanFieldGaussian\n"
    "print('available', fs.available())\n"
    "m = make_model('bnn', in_features=4, hidden=[8], num_classes=3)\n"
    "mean = m.init_mean(torch.Generator().manual_seed(0))\n"
    "q = MeanFieldGaussian.from_mean_variance(mean, {k: torch.full_like(v, 0.1) for k, v in mean.items()})\n"
    "p = m.predictive_probs(q, torch.randn(5, 4), 50)\n"
    "print('sum', round(float(p.sum()), 4))\n"
)


@pytest.mark.parametrize("cc, why", [("/bin/false", "/bin/false failed"), ("", "no C compiler")])
def test_falls_back_to_torch_without_a_working_compiler(tmp_path: Path, cc: str, why: str) -> None:
    res = _python(_PROBE, {"CC": cc, "PATH": str(tmp_path), "PGVI_KERNEL_CACHE": str(tmp_path / "c")})
    assert res.returncode == 0, res.stderr
    assert "available False" in res.stdout and "sum 5.0" in res.stdout
    assert "sampling kernels unavailable" in res.stderr and why in res.stderr


def test_disabled_by_environment_and_refuses_a_shared_cache(tmp_path: Path) -> None:
    res = _python(_PROBE, {"PGVI_FUSED_KERNELS": "0"})
    assert res.returncode == 0 and "available False" in res.stdout, res.stderr
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    res = _python(_PROBE, {"PGVI_KERNEL_CACHE": str(shared)})
    assert res.returncode == 0 and "available False" in res.stdout, res.stderr
    assert "not a directory private to this user" in res.stderr
    private = tmp_path / "private"
    res = _python(_PROBE, {"PGVI_KERNEL_CACHE": str(private)})
    assert res.returncode == 0 and "available True" in res.stdout, res.stderr
    assert len(list(private.glob("pgvi_sampling_*.so"))) == 1


@pytest.mark.parametrize("out", [3, fs.MAX_FOLDED_WIDTH + 5])  # folded into the kernel / two torch GEMMs
def test_sample_relu_linear_equals_sample_relu_then_the_next_layers_moments(out: int) -> None:
    rows, width, s = 11, 40, 6
    g = torch.Generator().manual_seed(7)
    leaves = [torch.randn(rows, width, generator=g), torch.rand(rows, width, generator=g) + 0.1,
              torch.randn(out, width, generator=g) * 0.3, torch.randn(out, generator=g),
              torch.rand(out, width, generator=g) * 0.1, torch.rand(out, generator=g) * 0.1]
    a = [t.clone().requires_grad_(True) for t in leaves]
    b = [t.clone().requires_grad_(True) for t in leaves]
    mu_next, var_next = fs.sample_relu_linear(*a, s, torch.Generator().manual_seed(3))
    h, h2, _ = fs.sample_relu(b[0], b[1], s, torch.Generator().manual_seed(3))
    ref_mu = torch.addmm(b[3], h.view(s * rows, width), b[2].t())
    ref_var = torch.addmm(b[5], h2.view(s * rows, width), b[4].t())
    assert torch.equal(mu_next, ref_mu) and torch.equal(var_next, ref_var)
    w1 = torch.randn(ref_mu.shape, generator=g)
    w2 = torch.randn(ref_var.shape, generator=g)
    grads = torch.autograd.grad((w1 * mu_next).sum() + (w2 * var_next).sum(), a)
    refs = torch.autograd.grad((w1 * ref_mu).sum() + (w2 * ref_var).sum(), b)
    for got, want in zip(grads, refs):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_sample_relu_linear_gradient_of_one_output_only() -> None:
    mu, sd = _inputs(6, 10)
    mu.requires_grad_(True)
    w = torch.randn(4, 10)
    bias = torch.zeros(4)
    wv = torch.rand(4, 10, requires_grad=True)
    m_next, v_next = fs.sample_relu_linear(mu, sd, w, bias, wv, bias, 3, torch.Generator().manual_seed(0))
    (g_mu,) = torch.autograd.grad(m_next.sum(), (mu,), retain_graph=True)
    h, _, _ = fs.sample_relu(mu.detach(), sd, 3, torch.Generator().manual_seed(0))
    want = ((h > 0).float() * w.sum(0)).sum(0)
    assert torch.allclose(g_mu, want, atol=1e-5)
    (g_wv,) = torch.autograd.grad(v_next.sum(), (wv,))
    h2 = h.view(-1, 10) ** 2
    assert torch.allclose(g_wv, h2.sum(0).expand(4, 10), rtol=1e-5)
    with pytest.raises(ValueError, match="weights must be"):
        fs.sample_relu_linear(mu, sd, w[:, :5], bias, wv, bias, 3)


_FORK_PROBE = """
import hashlib, os, sys, torch
from common import fused_sampling as fs
torch.set_num_threads(2)
mu = torch.linspace(-1, 1, 64 * 100).reshape(64, 100)
sd = torch.full((64, 100), 0.5)
def digest():
    h = fs.sample_relu(mu, sd, 4, torch.Generator().manual_seed(1))[0]
    return hashlib.sha256(h.numpy().tobytes()).hexdigest()
if sys.argv[1] == "parent-loads":
    parent = digest()  # loads the kernels and creates this process's thread pool
else:  # only torch creates the pool (a two-thread GEMM); the child is the first to load the kernels
    a = torch.rand(512, 512)
    (a @ a).sum()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, digest().encode())
    os._exit(0)
os.close(w)
child = os.read(r, 100).decode()
os.waitpid(pid, 0)
if sys.argv[1] != "parent-loads":
    parent = digest()
print("same" if child == parent else f"differ {parent} {child}")
"""


@pytest.mark.parametrize("who", ["parent-loads", "child-loads"])
def test_threaded_kernels_work_in_a_forked_child(who: str) -> None:
    """A forked child (multiprocessing's default start on Linux) must not use its parent's thread pool, whose
    threads do not exist in the child: the first threaded kernel call hung, whether the parent had loaded the
    kernels or only run a torch GEMM on two threads before the fork.  Run in a fresh interpreter with a timeout,
    so a hang fails the test instead of the suite."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", _FORK_PROBE, who], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:  # the probe and a hung forked child, if any
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    assert proc.returncode == 0 and out.strip() == "same", (out, err)


def _philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 in plain Python (Salmon et al. 2011, Random123's philox4x32 with 10 rounds)."""
    x0, x1, x2, x3 = ctr
    k0, k1 = key
    m = 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = 0xD2511F53 * x0, 0xCD9E8D57 * x2
        x0, x1, x2, x3 = ((p1 >> 32) ^ x1 ^ k0) & m, p1 & m, ((p0 >> 32) ^ x3 ^ k1) & m, p0 & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return x0, x1, x2, x3


def test_philox_is_philox4x32_10() -> None:
    """Random123's known answer for counter 0, key 0, and every counter of two tiles against plain Python."""
    assert _philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    for block0, stream, key in [(0, 0, 0), (2**32 - 256, 0xFFFFFFFF, 0x1234_5678_9ABC_DEF0)]:
        words = fs.philox_words(block0, stream, key)
        for c in range(256):
            want = _philox4x32_10((block0 + c, stream, 0, 0), (key & 0xFFFFFFFF, key >> 32))
            assert tuple(int(w) for w in words[:, c]) == want, c
