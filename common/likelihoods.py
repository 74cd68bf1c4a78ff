"""Per-sample likelihood outputs p(y | theta_s, x_b) that losses consume.

A model evaluated at S parameter samples on a batch of B points returns one of these.  Losses need only
``log_prob(y)`` (shape ``(S, B)``) and, for the beta- and gamma-losses, ``log_integral_power(power)``:
``log int p(z | theta_s, x_b)^power dz`` (shape ``(S, B)``), a closed form for both families below.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from common.errors import ShapeMismatchError


class LikelihoodOutput(ABC):
    @abstractmethod
    def log_prob(self, y: Tensor) -> Tensor:
        """``log p(y_b | theta_s, x_b)``, shape ``(S, B)``."""

    @abstractmethod
    def log_integral_power(self, power: float) -> Tensor:
        """``log int p(z | theta_s, x_b)^power dz``, shape ``(S, B)`` (a sum over classes if discrete)."""


_WIDE_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def check_class_labels(y: Tensor, num_classes: int, what: str = "categorical likelihood") -> None:
    """``ValueError`` (message prefixed with ``what``) unless ``y`` holds class indices in ``[0, num_classes)``:
    an integer dtype, or a floating one whose values are all integers (e.g. binary ``0.``/``1.``).

    Without it a float label is truncated by the ``long()`` cast (``0.99`` -> class 0) and an out-of-range one
    is a raw index error (or, in a compiled kernel, a wrong read).  One ``aminmax`` pass over the labels and two
    scalar reads (plus, for floating labels only, an integrality test): a few microseconds, which is why the
    training loop runs it once on the whole label tensor (see :attr:`CategoricalOutput.labels_checked`).
    """
    if y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"{what}: labels must be integer class indices, got dtype {y.dtype}")
    if y.dtype in _WIDE_UNSIGNED:  # no aminmax for them; a value past int64's range wraps negative and is refused
        y = y.to(torch.int64)
    if y.numel() and y.device.type != "meta":
        lo_t, hi_t = torch.aminmax(y)
        lo, hi = lo_t.item(), hi_t.item()  # two scalar reads: cheaper on the CPU than combining on-device
        floating = y.is_floating_point()
        # written so that a NaN label (lo or hi NaN) fails it too
        if not (lo >= 0 and hi < num_classes) or (floating and bool((y != torch.trunc(y)).any())):
            raise ValueError(
                f"{what}: labels must be {'integer-valued ' if floating else ''}class indices "
                f"in [0, {num_classes}), got labels from {lo:g} to {hi:g} (dtype {y.dtype})"
            )


class CategoricalOutput(LikelihoodOutput):
    """Softmax likelihood from logits of shape ``(S, B, C)``; targets are integer class labels ``(B,)``.

    ``labels_checked`` (default ``False``): set by a caller that has already run :func:`check_class_labels` on
    the labels it will pass (the training loop validates a client's whole label tensor once, before the first
    step, and passes rows of it); :meth:`log_prob` then skips the per-call value check, 4-11 us a call, 6-12 %
    of the loss's forward and backward pass on a 32-row logistic-regression minibatch.  The label count (a
    Python comparison) is checked on every call.
    """

    def __init__(self, logits: Tensor, labels_checked: bool = False) -> None:
        self.logits = logits
        self.log_probs = torch.log_softmax(logits, dim=-1)
        self.labels_checked = bool(labels_checked)

    @property
    def num_classes(self) -> int:
        return int(self.logits.shape[-1])

    def log_prob(self, y: Tensor) -> Tensor:
        """``log p(y_b | theta_s, x_b)`` for labels ``y`` of shape ``(B,)`` (or any shape with ``B`` elements,
        e.g. ``(B, 1)``): integer class indices in ``[0, C)``; a floating label must be integer-valued.

        Anything else is a ``ValueError``: without the check a short ``y`` silently drops points (``gather``
        takes the first ``len(y)``), a float label is truncated (``0.99`` -> class 0) and an out-of-range one
        is a raw index error.  The count is checked on every call, the dtype and values
        (:func:`check_class_labels`) unless :attr:`labels_checked` says the caller has done that.
        """
        b, c = int(self.log_probs.shape[-2]), int(self.log_probs.shape[-1])
        if y.numel() != b:
            raise ValueError(
                f"categorical likelihood: {y.numel()} label(s) of shape {tuple(y.shape)} for a batch of {b} "
                f"points (logits of shape {tuple(self.logits.shape)}); expected labels of shape ({b},)"
            )
        if not self.labels_checked:
            check_class_labels(y, c)
        idx = y.long().view(1, -1, 1).expand(self.log_probs.shape[0], -1, 1)
        return self.log_probs.gather(-1, idx).squeeze(-1)

    def log_integral_power(self, power: float) -> Tensor:
        return torch.logsumexp(power * self.log_probs, dim=-1)


class GaussianOutput(LikelihoodOutput):
    """Isotropic Gaussian likelihood ``N(y; mean, sigma^2 I)``; ``mean`` is ``(S, B, D)``, ``y`` is ``(B, D)``.

    A mean whose batch dimension is 1 (``(S, 1, D)``, e.g. a location model without inputs) broadcasts against
    any batch.  With ``D = 1`` the targets may also be ``(B,)`` (see :meth:`target`).
    """

    def __init__(self, mean: Tensor, sigma: float) -> None:
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"Gaussian likelihood: sigma must be finite and > 0, got {sigma}")
        self.mean = mean
        self.sigma = float(sigma)

    @property
    def event_dim(self) -> int:
        return int(self.mean.shape[-1])

    def target(self, y: Tensor) -> Tensor:
        """``y`` as a ``(B, D)`` tensor that lines up with ``mean`` (``(S, B, D)`` or ``(S, 1, D)``), else
        :class:`~common.errors.ShapeMismatchError` naming both shapes.

        A ``(B,)`` target is accepted only when the event dimension ``D`` is 1, as the column ``(B, 1)``.
        Without this, ``y.unsqueeze(0) - mean`` would broadcast a ``(B,)`` target against a ``(S, B, 1)`` mean
        to ``(S, B, B)``, and the sum over the last axis would add every target's residual to every row: a
        wrong likelihood, silently, and a wrong posterior from the Monte Carlo and quadrature paths.
        """
        d = self.event_dim
        yy = y.unsqueeze(-1) if (y.dim() == 1 and d == 1) else y
        batch = tuple(self.mean.shape[1:-1])
        ok = (
            yy.dim() == self.mean.dim() - 1
            and int(yy.shape[-1]) == d
            and all(mb in (1, yb) for mb, yb in zip(batch, yy.shape[:-1]))
        )
        if not ok:
            dims = ", ".join("any" if mb == 1 else str(mb) for mb in batch)
            expect = f"({dims}, {d})" + (f" or ({dims},)" if d == 1 else "")
            raise ShapeMismatchError(
                f"Gaussian likelihood: target of shape {tuple(y.shape)} does not match the mean of shape "
                f"{tuple(self.mean.shape)} (samples, batch, event); expected a target of shape {expect}"
            )
        return yy

    def log_prob(self, y: Tensor) -> Tensor:
        # the residual is scaled before it is squared: -0.5 r^2 / sigma^2 put dL/d(r^2) = p^delta / (2 sigma^2)
        # (8e38 for GCE at sigma 1e-14) into the backward pass, an inf (or inf * 0 = NaN) gradient in float32
        # where the value and the true gradient are finite
        z = (self.target(y).unsqueeze(0) - self.mean) / self.sigma
        d = self.event_dim
        return -0.5 * (z * z).sum(-1) - 0.5 * d * math.log(2 * math.pi * self.sigma**2)

    def log_integral_power(self, power: float) -> Tensor:
        # int N(z; m, s^2 I)^b dz = (2 pi s^2)^{d(1-b)/2} b^{-d/2}
        d = self.event_dim
        val = 0.5 * d * (1 - power) * math.log(2 * math.pi * self.sigma**2) - 0.5 * d * math.log(power)
        return torch.full(self.mean.shape[:-1], val, dtype=self.mean.dtype, device=self.mean.device)
