"""The FedAvg baseline's model: a deterministic ReLU MLP with the BNN's architecture and parameter names.

``DeterministicMLP`` has one point estimate per weight where :class:`common.models.BayesianMLP` has a
mean-field Gaussian; its parameters are named ``layers.{i}.weight`` / ``layers.{i}.bias`` with the same
shapes, so the two are directly comparable.  :func:`sgd_epochs` is the client's local training (SGD with
momentum and weight decay, the FedAvg settings of the FedGVI paper), :func:`predict_probs` its softmax
predictions for the same metrics (``common.metrics``) as the Bayesian models.  :func:`baseline_hidden_sizes`
says which deterministic network a run's ``model`` corresponds to.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from common.config import ConfigError
from common.likelihoods import check_class_labels

if TYPE_CHECKING:
    from common.config import RunConfig


def baseline_hidden_sizes(cfg: RunConfig) -> list[int]:
    """The hidden sizes of the FedAvg baseline's network for run config ``cfg``: the deterministic counterpart of
    the run's model.  ``bnn``: the BNN's ``hidden`` sizes; ``logistic_regression``: none (multinomial logistic
    regression, ``in_features -> num_classes``).  Any other model (``linear_regression``, ``gaussian_location``:
    not classifiers) raises :class:`~common.config.ConfigError` naming the key ``model``."""
    if cfg.model == "bnn":
        return list(cfg.hidden_sizes)
    if cfg.model == "logistic_regression":
        return []
    raise ConfigError(f"invalid run config: model: the FedAvg baseline trains a classifier, model 'bnn' or "
                      f"'logistic_regression'; got '{cfg.model}'")


class DeterministicMLP(nn.Module):
    """``in_features -> hidden[0] -> ... -> num_classes`` with ReLU; PyTorch's default Linear initialisation."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 2 or any(h < 1 for h in hidden):
            raise ValueError(
                f"DeterministicMLP needs in_features >= 1, hidden sizes >= 1 and num_classes >= 2, got "
                f"{in_features}, {list(hidden)}, {num_classes}"
            )
        sizes = [in_features, *hidden, num_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x

    def get_arrays(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.state_dict().items()}

    def set_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        own = self.state_dict()
        if set(arrays) != set(own):
            raise ValueError(f"parameter names differ: got {sorted(arrays)}, expected {sorted(own)}")
        new = {}
        for k, v in arrays.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"'{k}' has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
            # checked after the cast to the model's dtype: a float64 1e39 passed the check and became inf
            new[k] = t = torch.as_tensor(np.asarray(v), dtype=own[k].dtype)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"'{k}' has non-finite entries (in {own[k].dtype})")
        self.load_state_dict(new)

    @property
    def num_classes(self) -> int:
        return self.layers[-1].out_features


@dataclass(frozen=True)
class SGDConfig:
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    epochs: int = 10
    batch_size: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"SGDConfig.lr must be finite and > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"SGDConfig.momentum must be in [0, 1), got {self.momentum}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"SGDConfig.weight_decay must be finite and >= 0, got {self.weight_decay}")
        for name in ("epochs", "batch_size", "seed"):  # 2.5 failed in range(), True ran one epoch
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"SGDConfig.{name} must be an integer, got {value!r}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"SGDConfig needs epochs >= 1 and batch_size >= 1, got {self.epochs}, {self.batch_size}")


def sgd_epochs(model: DeterministicMLP, x: np.ndarray, y: np.ndarray, config: SGDConfig) -> list[float]:
    """Train in place with mini-batch SGD on the mean cross-entropy; returns the mean loss of each epoch.

    A fresh optimiser per call (FedAvg clients keep no momentum between rounds); shuffling is seeded.
    Raises ``FloatingPointError`` if the loss becomes non-finite or, after the last step, a parameter does (a
    diverged client must not send NaNs: each batch's loss is measured before its step, so the loss alone misses
    a last step that overflows the weights).
    """
    if len(x) == 0:
        raise ValueError("sgd_epochs: no training data")
    xt = torch.as_tensor(x, dtype=torch.float32)
    labels = torch.as_tensor(np.asarray(y))
    if len(labels) != len(xt):
        raise ValueError(f"sgd_epochs: {len(labels)} labels for {len(xt)} inputs")
    if labels.dtype == torch.bool:  # binary labels as False / True: classes 0 / 1, as Problem.tensors reads them
        labels = labels.to(torch.int64)
    # the BNN path's check: a label 0.6 was truncated to class 0 by the cast, one out of range an index error
    check_class_labels(labels, model.num_classes, "sgd_epochs")
    yt = labels.long()
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(config.seed)
    model.train()
    trace = []
    for epoch in range(config.epochs):
        perm = torch.randperm(len(xt), generator=gen)
        total = 0.0
        for start in range(0, len(xt), config.batch_size):
            idx = perm[start : start + config.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        mean = total / len(xt)
        if not math.isfinite(mean):
            raise FloatingPointError(f"sgd_epochs: the training loss became {mean} in epoch {epoch + 1}")
        trace.append(mean)
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise FloatingPointError(f"sgd_epochs: non-finite parameters after the last step: {', '.join(bad)}")
    return trace


def predict_log_probs(model: DeterministicMLP, x: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """Log-softmax class probabilities, shape ``(N, num_classes)``, float64 (exact NLL, see common.metrics)."""
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            xb = torch.as_tensor(x[start : start + batch_size], dtype=torch.float32)
            out.append(torch.log_softmax(model(xb).double(), dim=-1).numpy())
    return np.concatenate(out) if out else np.zeros((0, model.num_classes))


def predict_probs(model: DeterministicMLP, x: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """Softmax class probabilities, shape ``(N, num_classes)``, float64."""
    return np.exp(predict_log_probs(model, x, batch_size))
