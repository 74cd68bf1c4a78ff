"""common.adam.Adam: bit-identical to torch.optim.Adam(fused=True); its fallback is torch's textbook Adam; it
validates its hyperparameters; and a local GVI run no longer imports torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.adam import Adam

REPO = Path(__file__).resolve().parents[1]


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in [(7, 5), (5,), (3, 3), (1,)]]


def _run(make_opt, dtype: torch.dtype, steps: int = 25) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    params = _params(dtype)
    opt = make_opt(params)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        opt.zero_grad()
        loss = sum(((p - 0.3) ** 2 * torch.rand(p.shape, generator=g, dtype=dtype)).sum() for p in params[:3])
        if t % 3 == 0:  # the last parameter gets a gradient only every third step
            loss = loss + (params[3] ** 4).sum()
        loss.backward()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bit_identical_to_torch_fused_adam(dtype: torch.dtype) -> None:
    ours = _run(lambda ps: Adam([(ps[:2], 3e-2), (ps[2:], 1e-2)]), dtype)
    theirs = _run(lambda ps: torch.optim.Adam([{"params": ps[:2], "lr": 3e-2}, {"params": ps[2:], "lr": 1e-2}],
                                              fused=True), dtype)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_fallback_is_torchs_textbook_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Adam, "_fused_applies", staticmethod(lambda params: False))
    ours = _run(lambda ps: Adam([(ps, 2e-2)], betas=(0.8, 0.99), eps=1e-6), torch.float64)
    theirs = _run(lambda ps: torch.optim.Adam(ps, lr=2e-2, betas=(0.8, 0.99), eps=1e-6, foreach=False),
                  torch.float64)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_rejects_bad_hyperparameters_and_parameters() -> None:
    p = torch.zeros(3, requires_grad=True)
    for kwargs, what in [({"betas": (1.0, 0.9)}, "beta1"), ({"betas": (0.9, -0.1)}, "beta2"),
                         ({"eps": float("nan")}, "eps")]:
        with pytest.raises(ValueError, match=what):
            Adam([([p], 1e-3)], **kwargs)
    for lr in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="lr"):
            Adam([([p], lr)])
    with pytest.raises(ValueError, match="more than one group"):
        Adam([([p], 1e-3), ([p], 1e-2)])
    with pytest.raises(ValueError, match="leaf"):
        Adam([([p * 2], 1e-3)])


def test_a_local_gvi_run_does_not_import_torch_dynamo() -> None:
    """torch.optim's constructor imports torch._dynamo (~890 modules, ~1 CPU-s); the local GVI loop must not."""
    code = (
        "import sys, torch\n"
        "from common.local_gvi import LocalGVIConfig, local_gvi\n"
        "from common.models import make_model\n"
        "from common.families import MeanFieldGaussian\n"
        "from common.losses import make_loss\n"
        "from common.divergences import make_divergence\n"
        "m = make_model('bnn', in_features=6, hidden=[8], num_classes=3)\n"
        "p = MeanFieldGaussian.isotropic(m.param_shapes, 0.0, 1.0, dtype=torch.float32)\n"
        "x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))\n"
        "cfg = LocalGVIConfig(epochs=2, batch_size=16, n_samples=2, local_reparam=True)\n"
        "local_gvi(m, make_loss('gce', delta=0.8), make_divergence('alpha_renyi', alpha=2.5), p, x, y, p, cfg)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
