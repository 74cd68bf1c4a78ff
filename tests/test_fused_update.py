"""common.fused_meanfield.backward_adam: the mean-field backward, the loss's gradient and torch's fused Adam in
one pass give bit-identical parameters and Adam states to the three done apart (fused_meanfield.backward, a
torch add, common.adam.Adam.step, i.e. torch._fused_adam_), for every divergence, for tensors whose sizes
leave every tail length of torch's 8-wide vector loop, over several steps, at one and two threads, for both
branches of torch's lerp; a torch build whose arithmetic it does not reproduce is detected."""

from __future__ import annotations

import pytest
import torch

from common import fused_meanfield as fm
from common.adam import Adam

pytestmark = pytest.mark.skipif(not fm.available(), reason="mean-field kernels could not be built here")

# sizes: whole vectors, every tail length 1..7 of the 8-wide loop, and more than one 4096-element block
SHAPES = [(3, 8), (9,), (2, 5), (11,), (4, 3), (13,), (7, 2), (15,), (5000,), (3, 1367)]
KINDS = [("kl", 1.0), ("reverse_kl", 0.0), ("alpha_renyi", 2.5), ("alpha_renyi", 0.5)]
#: torch CPU builds whose Adam arithmetic the fused update is written for (a failed self-check there is a bug)
_REPRODUCED = ("AVX2", "AVX512")


def _tensors(seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    locs = [torch.nn.Parameter(0.3 * torch.randn(s, generator=g)) for s in SHAPES]
    raws = [torch.nn.Parameter(-2.0 + 0.5 * torch.randn(s, generator=g)) for s in SHAPES]
    mps = [0.2 * torch.randn(s, generator=g) for s in SHAPES]
    lps = [0.8 + torch.rand(s, generator=g) for s in SHAPES]
    return locs, raws, mps, lps


def _loss_grads(seed: int, step: int, with_none: bool):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1000 * seed + step)
    # gradients over six orders of magnitude, some tensors without a loss gradient
    scale = lambda s: 10.0 ** torch.randint(-3, 3, s, generator=g).float()  # noqa: E731
    g_vars = [torch.randn(s, generator=g) * scale(s) for s in SHAPES]
    g_locs = [torch.randn(s, generator=g) * scale(s) for s in SHAPES]
    if with_none:
        g_vars[1] = None
        g_locs[2] = None
    return g_vars, g_locs


def _check_against_torch(kind: str, alpha: float, threads: int, betas: tuple[float, float]) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        width = fm.adam_vector_width(betas[0], betas[1], 1e-8)
        if width is None and torch.backends.cpu.get_cpu_capability() not in _REPRODUCED:
            pytest.skip("this torch build's Adam arithmetic is not one the fused update reproduces")
        assert width is not None, "the fused update no longer reproduces torch's Adam on this build"
        a_locs, a_raws, mps, lps = _tensors(0)
        b_locs = [torch.nn.Parameter(t.detach().clone()) for t in a_locs]
        b_raws = [torch.nn.Parameter(t.detach().clone()) for t in a_raws]
        opt_a = Adam([(a_locs, 3e-2), (a_raws, 1e-2)], betas=betas)
        opt_b = Adam([(b_locs, 3e-2), (b_raws, 1e-2)], betas=betas)
        code = fm.KINDS[kind]
        for step in range(4):
            g_vars, g_locs = _loss_grads(0, step, with_none=step % 2 == 1)
            # apart: the backward, the loss gradient added by torch, torch's fused Adam
            st, total_a, _ = fm.forward([p.detach() for p in a_locs], [p.detach() for p in a_raws], mps, lps, code,
                                        alpha, 1e-6)
            gl, gr = fm.backward(st, g_vars, 0.37, code, alpha)
            for p, g, extra in zip(a_locs, gl, g_locs):
                p.grad = g if extra is None else g.add_(extra)
            for p, g in zip(a_raws, gr):
                p.grad = g
            opt_a.step()
            # fused
            sb, total_b, _ = fm.forward([p.detach() for p in b_locs], [p.detach() for p in b_raws], mps, lps, code,
                                        alpha, 1e-6)
            assert total_a == total_b
            fm.backward_adam(sb, [p.detach() for p in b_raws], g_vars, g_locs, 0.37, code, alpha,
                             opt_b.constants(), opt_b.advance(b_locs), opt_b.advance(b_raws), width)
            for pa, pb in zip([*a_locs, *a_raws], [*b_locs, *b_raws]):
                assert torch.equal(pa.detach(), pb.detach()), (kind, step, pa.shape)
                assert torch.equal(opt_a.exp_avg[id(pa)], opt_b.exp_avg[id(pb)])
                assert torch.equal(opt_a.exp_avg_sq[id(pa)], opt_b.exp_avg_sq[id(pb)])
                assert torch.equal(opt_a.steps[id(pa)], opt_b.steps[id(pb)])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind, alpha", KINDS)
def test_fused_update_equals_backward_then_torch_adam(kind: str, alpha: float, threads: int) -> None:
    _check_against_torch(kind, alpha, threads, (0.9, 0.999))


@pytest.mark.parametrize("betas", [(0.5, 0.999), (0.3, 0.99), (0.0, 0.9)])
def test_both_of_torchs_lerp_branches(betas: tuple[float, float]) -> None:
    # torch's lerp is m + w (g - m) for a weight w = 1 - beta1 < 0.5 and g - (g - m)(1 - w) otherwise
    _check_against_torch("kl", 1.0, 1, betas)


def test_a_torch_build_with_other_arithmetic_is_detected_and_the_explicit_step_declines() -> None:
    # ATEN_CPU_CAPABILITY=default: torch's vector loop rounds every operation apart; no width reproduces it
    code = (
        "import torch\n"
        "from common import fused_meanfield as fm\n"
        "from common.adam import Adam\n"
        "from common.divergences import make_divergence\n"
        "from common.explicit_step import OneHiddenLayerStep\n"
        "from common.families import MeanFieldGaussian\n"
        "from common.local_gvi import MeanFieldMomentDivergence\n"
        "from common.losses import make_loss\n"
        "from common.models import make_model\n"
        "from common.variational import MeanFieldVariational\n"
        "m = make_model('bnn', in_features=6, hidden=[5], num_classes=3)\n"
        "p = MeanFieldGaussian.isotropic(m.param_shapes, 0.0, 1.0, dtype=torch.float32)\n"
        "q = MeanFieldVariational(p, dtype=torch.float32)\n"
        "fd = MeanFieldMomentDivergence.create(make_divergence('kl'), p)\n"
        "opt = Adam([(q.loc_parameters(), 1e-2), (q.scale_parameters(), 1e-2)])\n"
        "step = OneHiddenLayerStep.create(m, make_loss('nll'), q, fd, torch.randn(8, 6), torch.zeros(8, dtype=torch.long), 2, opt)\n"
        "print(fm.adam_vector_width(0.9, 0.999, 1e-8), step is None)\n"
    )
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True"]
    assert fm.adam_vector_width(0.9, 0.999, 1e-8) is not None  # this process's build is one it reproduces


def test_advance_refuses_a_parameter_outside_the_optimiser_and_bad_states() -> None:
    locs, raws, mps, lps = _tensors(1)
    opt = Adam([(locs, 1e-2)])
    with pytest.raises(ValueError, match="not in any group"):
        opt.advance(raws)
    st, _, _ = fm.forward([p.detach() for p in locs], [p.detach() for p in raws], mps, lps, 0, 1.0, 1e-6)
    terms = opt.advance(locs)
    wrong = [(torch.zeros(3), t[1], t[2], t[3]) for t in terms]
    args = (st, [p.detach() for p in raws])
    with pytest.raises(ValueError, match="contiguous float32"):
        fm.backward_adam(*args, [None] * len(locs), [None] * len(locs), 1.0, 0, 1.0, opt.constants(), terms, wrong, 8)
    # the gradients it reads: a short one would be read past its end, a float64 one as float32
    short = [torch.zeros(10)] + [None] * (len(locs) - 1)
    wide = [torch.zeros(SHAPES[0], dtype=torch.float64)] + [None] * (len(locs) - 1)
    for bad in (short, wide):
        with pytest.raises(ValueError, match="gradients must be float32"):
            fm.backward_adam(*args, [None] * len(locs), bad, 1.0, 0, 1.0, opt.constants(), terms, terms, 8)
        with pytest.raises(ValueError, match="gradients must be float32"):
            fm.backward_adam(*args, bad, [None] * len(locs), 1.0, 0, 1.0, opt.constants(), terms, terms, 8)
    with pytest.raises(ValueError, match="vector width"):
        fm.backward_adam(*args, [None] * len(locs), [None] * len(locs), 1.0, 0, 1.0, opt.constants(), terms, terms, 5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind, alpha", KINDS)
def test_update_with_the_next_forward_equals_update_then_forward(kind: str, alpha: float, threads: int) -> None:
    # backward_adam(forward_min_scale=...) runs each block's forward right after its update: the parameters,
    # Adam's states, the next step's variances and chains, its divergence sum and undefined counts are the bits
    # of backward_adam followed by forward
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        width = fm.adam_vector_width(0.9, 0.999, 1e-8)
        if width is None:
            pytest.skip("this torch build's Adam arithmetic is not one the fused update reproduces")
        code = fm.KINDS[kind]
        a_locs, a_raws, mps, lps = _tensors(3)
        b_locs = [torch.nn.Parameter(t.detach().clone()) for t in a_locs]
        b_raws = [torch.nn.Parameter(t.detach().clone()) for t in a_raws]
        opt_a, opt_b = (Adam([(ls, 3e-2), (rs, 1e-2)]) for ls, rs in ((a_locs, a_raws), (b_locs, b_raws)))
        sa, _, _ = fm.forward([p.detach() for p in a_locs], [p.detach() for p in a_raws], mps, lps, code, alpha, 1e-6)
        sb, _, _ = fm.forward([p.detach() for p in b_locs], [p.detach() for p in b_raws], mps, lps, code, alpha, 1e-6)
        for step in range(3):
            g_vars, g_locs = _loss_grads(3, step, with_none=step == 1)
            fm.backward_adam(sa, [p.detach() for p in a_raws], g_vars, g_locs, 0.37, code, alpha, opt_a.constants(),
                             opt_a.advance(a_locs), opt_a.advance(a_raws), width)
            sa, total_a, bad_a = fm.forward([p.detach() for p in a_locs], [p.detach() for p in a_raws], mps, lps,
                                            code, alpha, 1e-6)
            ahead = fm.backward_adam(sb, [p.detach() for p in b_raws], g_vars, g_locs, 0.37, code, alpha,
                                     opt_b.constants(), opt_b.advance(b_locs), opt_b.advance(b_raws), width,
                                     forward_min_scale=1e-6)
            assert ahead is not None
            assert ahead[0] == total_a and list(ahead[1]) == list(bad_a), (kind, step)
            for ta, tb in zip([*a_locs, *a_raws, *sa.variances, *sa.chains], [*b_locs, *b_raws, *sb.variances,
                                                                              *sb.chains]):
                assert torch.equal(ta.detach(), tb.detach()), (kind, step, ta.shape)
    finally:
        torch.set_num_threads(before)
