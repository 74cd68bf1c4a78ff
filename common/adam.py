"""Adam for the local GVI loop, computed by torch's fused CPU kernel without constructing a ``torch.optim``
optimiser.

Constructing any ``torch.optim.Optimizer`` in torch 2.14 imports ``torch._dynamo`` and with it sympy, mpmath and
about 890 other modules: about 1 CPU-second once per process (a client that starts a process per message pays
it every round), and 135,000 more Python objects that every later full garbage collection walks (measured in
``docs/bench_core.md``).  :class:`Adam` keeps the same state (``exp_avg``, ``exp_avg_sq`` and a float32 step
counter per parameter) and calls the same kernel as ``torch.optim.Adam(..., fused=True)`` (``torch._fused_adam_``;
results are bit-identical, tested), one call per parameter group.  Where that kernel does not exist or does not
take the tensors, the update is the textbook one (Kingma & Ba 2015, Algorithm 1, with ``eps`` added to the
bias-corrected root as torch does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def _check(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < lo or v >= hi or (lo_open and v == lo):
        raise ValueError(f"Adam: {name} must be in {'(' if lo_open else '['}{lo}, {hi}), got {value!r}")
    return v


class Adam:
    """Adam over parameter groups ``[(params, lr), ...]`` (no weight decay, no AMSGrad)."""

    def __init__(self, groups: Sequence[tuple[Iterable[Tensor], float]], betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.beta1 = _check("beta1", betas[0], 0.0, 1.0)
        self.beta2 = _check("beta2", betas[1], 0.0, 1.0)
        self.eps = _check("eps", eps, 0.0, math.inf)
        self.groups: list[tuple[list[Tensor], float]] = []
        seen: set[int] = set()
        for params, lr in groups:
            plist = list(params)
            for p in plist:
                if not p.requires_grad or not p.is_leaf:
                    raise ValueError("Adam: every parameter must be a leaf tensor that requires grad")
                if id(p) in seen:
                    raise ValueError("Adam: a parameter appears in more than one group")
                seen.add(id(p))
            self.groups.append((plist, _check("lr", lr, 0.0, math.inf, lo_open=True)))
        self.exp_avg = {id(p): torch.zeros_like(p, memory_format=torch.preserve_format)
                        for ps, _ in self.groups for p in ps}
        self.exp_avg_sq = {id(p): torch.zeros_like(p, memory_format=torch.preserve_format)
                           for ps, _ in self.groups for p in ps}
        self.steps = {id(p): torch.zeros((), dtype=torch.float32, device=p.device) for ps, _ in self.groups for p in ps}

    def zero_grad(self) -> None:
        for ps, _ in self.groups:
            for p in ps:
                p.grad = None

    def constants(self) -> tuple[float, float, float, float]:
        """``(1 - beta1, beta2, 1 - beta2, eps)``: the update's constants, for a kernel that applies it."""
        return 1.0 - self.beta1, self.beta2, 1.0 - self.beta2, self.eps

    def adam_states(self, params: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """``(exp_avg, exp_avg_sq)`` per parameter, without counting a step (the states a kernel will write)."""
        return [(self.exp_avg[id(p)], self.exp_avg_sq[id(p)]) for p in params]

    def advance(self, params: Sequence[Tensor]) -> list[tuple[Tensor, Tensor, float, float]]:
        """Count one step of ``params`` and return what a kernel needs to apply that step itself, per parameter:
        ``(exp_avg, exp_avg_sq, -lr / (1 - beta1^t), sqrt(1 - beta2^t))`` in float64, formed as torch's fused
        kernel forms them (from the float32 step counter).  The caller must then update every parameter, its
        ``exp_avg`` and ``exp_avg_sq`` in place with the update of :meth:`step` (``common.fused_meanfield``'s
        fused update does, bit-identically to torch's kernel).  Only where :meth:`fused_applies` holds."""
        lr_of = {id(p): lr for ps, lr in self.groups for p in ps}
        if any(id(p) not in lr_of for p in params):
            raise ValueError("Adam.advance: a parameter is not in any group")
        steps = [self.steps[id(p)] for p in params]
        torch._foreach_add_(steps, 1)
        out = []
        for p, st in zip(params, steps):
            t = float(st)
            bc1, bc2 = 1.0 - math.pow(self.beta1, t), 1.0 - math.pow(self.beta2, t)
            out.append((self.exp_avg[id(p)], self.exp_avg_sq[id(p)], -(lr_of[id(p)] / bc1), math.sqrt(bc2)))
        return out

    def step_bound(self, params: Sequence[Tensor]) -> float | None:
        """The most any entry of ``params`` can move in one step, whatever the gradients: ``lr`` (the largest of their
        groups') times ``K = sup_t |m_hat_t| / sqrt(v_hat_t)``; ``None`` if ``beta1^2 >= beta2`` (no such bound).

        With ``r = beta1^2 / beta2``, Cauchy-Schwarz on ``m_t = (1 - beta1) sum_i beta1^(t-i) g_i`` against
        ``v_t = (1 - beta2) sum_i beta2^(t-i) g_i^2`` gives ``|m_t| <= (1 - beta1) sqrt((1 - r^t) / (1 - r))
        sqrt(v_t / (1 - beta2))``; the bias corrections multiply by ``sqrt(1 - beta2^t) / (1 - beta1^t)``, and ``eps``
        only shrinks the step.  ``K`` is the supremum of the product over ``t`` (7.28 for the defaults 0.9, 0.999,
        where a typical step is about 1 x ``lr``), taken over ``t`` up to where it is at its limit, times 1.01."""
        lr_of = {id(p): lr for ps, lr in self.groups for p in ps}
        if not params or any(id(p) not in lr_of for p in params):
            raise ValueError("Adam.step_bound: a parameter is not in any group")
        b1, b2 = self.beta1, self.beta2
        r = b1 * b1 / b2
        if not r < 1.0:
            return None
        k, t = 0.0, 1
        while True:  # the product increases to its limit after its early dip; stop once every factor has converged
            k = max(k, (1 - b1) * math.sqrt((1 - r**t) / ((1 - r) * (1 - b2))) * math.sqrt(1 - b2**t) / (1 - b1**t))
            if b2**t < 1e-12 and r**t < 1e-12 and b1**t < 1e-12:
                break
            t = t + 1 if t < 64 else 2 * t
        limit = (1 - b1) / math.sqrt((1 - r) * (1 - b2))
        return 1.01 * max(k, limit) * max(lr_of[id(p)] for p in params)

    def fused_applies(self, params: Sequence[Tensor]) -> bool:
        """Whether :meth:`step` updates ``params`` with torch's fused kernel (float32 or float64 CPU tensors)."""
        return self._fused_applies(list(params))

    @staticmethod
    def _fused_applies(params: list[Tensor]) -> bool:
        return (hasattr(torch, "_fused_adam_") and len({(p.device, p.dtype) for p in params}) == 1
                and params[0].device.type == "cpu" and params[0].dtype in (torch.float32, torch.float64))

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for ps, lr in self.groups:
            params = [p for p in ps if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            m = [self.exp_avg[id(p)] for p in params]
            v = [self.exp_avg_sq[id(p)] for p in params]
            steps = [self.steps[id(p)] for p in params]
            if self._fused_applies(params):
                torch._foreach_add_(steps, 1)
                torch._fused_adam_(params, grads, m, v, [], steps, lr=lr, beta1=self.beta1,  # type: ignore[attr-defined]
                                   beta2=self.beta2, weight_decay=0.0, eps=self.eps, amsgrad=False, maximize=False)
                continue
            for p, g, mi, vi, st in zip(params, grads, m, v, steps):
                st.add_(1)
                t = float(st)
                mi.lerp_(g, 1.0 - self.beta1)
                vi.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
                bc1, bc2 = 1.0 - self.beta1**t, 1.0 - self.beta2**t
                denom = (vi.sqrt() / math.sqrt(bc2)).add_(self.eps)
                p.addcdiv_(mi, denom, value=-lr / bc1)


__all__ = ["Adam"]
