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


class LikelihoodOutput(ABC):
    @abstractmethod
    def log_prob(self, y: Tensor) -> Tensor:
        """``log p(y_b | theta_s, x_b)``, shape ``(S, B)``."""

    @abstractmethod
    def log_integral_power(self, power: float) -> Tensor:
        """``log int p(z | theta_s, x_b)^power dz``, shape ``(S, B)`` (a sum over classes if discrete)."""


class CategoricalOutput(LikelihoodOutput):
    """Softmax likelihood from logits of shape ``(S, B, C)``; targets are integer class labels ``(B,)``."""

    def __init__(self, logits: Tensor) -> None:
        self.logits = logits
        self.log_probs = torch.log_softmax(logits, dim=-1)

    def log_prob(self, y: Tensor) -> Tensor:
        idx = y.long().view(1, -1, 1).expand(self.log_probs.shape[0], -1, 1)
        return self.log_probs.gather(-1, idx).squeeze(-1)

    def log_integral_power(self, power: float) -> Tensor:
        return torch.logsumexp(power * self.log_probs, dim=-1)


class GaussianOutput(LikelihoodOutput):
    """Isotropic Gaussian likelihood ``N(y; mean, sigma^2 I)``; ``mean`` is ``(S, B, D)``, ``y`` is ``(B, D)``."""

    def __init__(self, mean: Tensor, sigma: float) -> None:
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        self.mean = mean
        self.sigma = float(sigma)

    @property
    def event_dim(self) -> int:
        return int(self.mean.shape[-1])

    def log_prob(self, y: Tensor) -> Tensor:
        r2 = ((y.unsqueeze(0) - self.mean) ** 2).sum(-1)
        d = self.event_dim
        return -0.5 * r2 / self.sigma**2 - 0.5 * d * math.log(2 * math.pi * self.sigma**2)

    def log_integral_power(self, power: float) -> Tensor:
        # int N(z; m, s^2 I)^b dz = (2 pi s^2)^{d(1-b)/2} b^{-d/2}
        d = self.event_dim
        val = 0.5 * d * (1 - power) * math.log(2 * math.pi * self.sigma**2) - 0.5 * d * math.log(power)
        return torch.full(self.mean.shape[:-1], val, dtype=self.mean.dtype)
