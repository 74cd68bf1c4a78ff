"""``log1p`` and ``softplus`` for float32 CPU tensors without torch's slow AVX-512 kernels.

With torch 2.14 on an AVX-512 CPU (``torch.backends.cpu.get_cpu_capability() == "AVX512"``), float32
``torch.log1p`` and ``torch.nn.functional.softplus`` take about 10 ns per element, ten times ``torch.log``
(measured on 156,800 elements, one thread: log1p 1.55 ms, softplus 1.69 ms, log 0.15 ms). The same ops
under ``ATEN_CPU_CAPABILITY=avx2`` take 0.17 ms and 0.36 ms. In the BNN's local GVI step these two ops
on the first layer's 156,800 scales cost about a third of the step (``docs/bench_core.md``).

So on an AVX-512 CPU, for float32 tensors of at least :data:`MIN_NUMEL` elements, this module computes

* ``log1p(x)`` by Goldberg's rewrite ``log(u) * x / (u - 1)`` with ``u = fl(1 + x)`` (``x`` itself where
  ``u == 1``): the rounding error of ``1 + x`` cancels in the ratio, so the result is accurate to a few
  ulps (Goldberg, "What every computer scientist should know about floating-point arithmetic", 1991,
  Theorem 4; measured: relative error <= 1.8e-7 against float64, torch's own float32 log1p 6.2e-8);
* ``softplus(x) = max(x, 0) + log1p(exp(-|x|))`` with that ``log1p``, and the exact derivative
  ``sigmoid(x)`` in the backward pass (one kernel instead of autograd through the chain).

Everywhere else (float64, small tensors, other CPUs) they are torch's own ops. Both functions follow torch
for every input: ``log1p(-1) = -inf``, ``log1p(x < -1) = nan`` (also for ``-inf``), ``log1p(inf) = inf``, ``nan``
propagates;
``softplus`` agrees with ``F.softplus`` (threshold 20) to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

#: Below this size the per-op overhead of the rewrite outweighs the slow kernel.
MIN_NUMEL = 4096

_SLOW_FLOAT32_TRANSCENDENTALS = torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def _use_rewrite(x: Tensor, force: bool | None) -> bool:
    if force is not None:
        return force and x.dtype == torch.float32
    return (
        _SLOW_FLOAT32_TRANSCENDENTALS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() >= MIN_NUMEL
    )


def _log1p_rewrite(x: Tensor) -> Tensor:
    u = x + 1.0
    d = u - 1.0
    exact = (d == 0) | (u == torch.inf)  # log1p(x) = x to rounding where 1 + x == 1; inf where x == inf
    return torch.where(exact, x, torch.log(u) * (x / d))


def log1p(x: Tensor, force: bool | None = None) -> Tensor:
    """``log(1 + x)`` elementwise (no autograd graph through the rewrite: use on values, or inside an
    ``autograd.Function``).  ``force`` selects the path for tests (``True``: rewrite, ``False``: torch)."""
    if not _use_rewrite(x, force):
        return torch.log1p(x)
    return _log1p_rewrite(x)


class _Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.relu(x) + _log1p_rewrite(torch.exp(-x.abs()))

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


def softplus(x: Tensor, force: bool | None = None) -> Tensor:
    """``log(1 + exp(x))`` elementwise, differentiable (derivative ``sigmoid(x)``); ``force`` as in
    :func:`log1p`."""
    if not _use_rewrite(x, force):
        return F.softplus(x)
    return _Softplus.apply(x)


def log_ratio(ratio: Tensor, diff: Tensor, log1p_fn: Callable[[Tensor], Tensor] = torch.log1p) -> Tensor:
    """``log(ratio)`` given ``ratio`` and ``diff = ratio - 1`` as rounded: ``log1p(diff)`` where ``|diff| <= 1/2``
    (accurate near 1, where ``log(ratio)`` would lose digits), ``log(ratio)`` elsewhere (where ``diff`` may have
    lost them: ``ratio - 1`` is ``-1`` in float32 for any ratio below 3e-8).  The branch not taken gets a harmless
    argument, so autograd through it gives no ``0 * inf = NaN``.  ``log1p_fn``: :func:`log1p` on values (inside an
    ``autograd.Function``), ``torch.log1p`` (the default) where autograd differentiates the result.  The same split
    as the mean-field kernel's (``common/fused_meanfield.py``)."""
    near = diff.abs() <= 0.5
    return torch.where(near, log1p_fn(torch.where(near, diff, torch.zeros_like(diff))),
                       torch.log(torch.where(near, torch.ones_like(ratio), ratio)))


def all_finite(x: Tensor) -> bool:
    """Whether every element of ``x`` is finite (``torch.isfinite(x).all()``), from one sum where it can: a sum
    with a NaN or an infinity among its terms is not finite, so a finite sum proves every element finite; only
    a non-finite sum (a bad element, or an overflow of finite ones) takes the element-wise test.  On the BNN's
    156,800 first-layer parameters: 0.01 ms instead of 0.22 ms (four element-wise passes)."""
    if not x.is_floating_point() and not x.is_complex():
        return True
    if x.numel() == 0 or bool(torch.isfinite(x.sum())):
        return True
    return bool(torch.isfinite(x).all())


__all__ = ["MIN_NUMEL", "all_finite", "log1p", "log_ratio", "softplus"]
