"""Posterior-predictive evaluation of a PGVI posterior on held-out data."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from common.errors import NonFiniteError
from common.families import GaussianFactor
from common.problem import Problem


def evaluate_posterior(
    problem: Problem, q: GaussianFactor, x: np.ndarray, y: np.ndarray, n_samples: int, seed: int = 0,
    bin_sums: bool = False,
) -> dict[str, float]:
    """Metrics of the averaged posterior predictive ``p(y|x) = E_q[p(y|theta, x)]``.

    Classifiers: accuracy, NLL, ECE (15 bins), Brier; with ``bin_sums`` also the ECE's additive per-bin sums
    (:func:`common.metrics.calibration_bin_sums`, keys :func:`common.metrics.bin_sum_key`), from which a server pools the
    ECE of all clients' points exactly.  Gaussian models: predictive NLL (MC mixture over ``n_samples``
    posterior draws) and RMSE of the predictive mean, per point (``sqrt(mean_b ||y_b - mean_b||^2)``: for ``D > 1``
    it is ``sqrt(D)`` times the per-coordinate RMSE); ``y`` is ``(B, D)``, or ``(B,)`` for ``D = 1``, and a
    mismatch raises :class:`~common.errors.ShapeMismatchError`.
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 1:
        raise ValueError(f"evaluate_posterior: n_samples must be an integer >= 1, got {n_samples!r}")
    if len(y) == 0:
        return {"num-examples": 0.0}
    xt, yt = problem.tensors(x, y)
    for t, what in ((xt, "inputs"), (yt, "targets")):  # a NaN target gave nll = rmse = nan, silently
        if torch.is_floating_point(t) and t.numel() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"evaluate_posterior: the {what} have {int((~torch.isfinite(t)).sum())} "
                                 "non-finite entries")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if problem.model.is_classifier:
            from common.metrics import classification_metrics_from_log_probs

            log_probs = problem.model.predictive_log_probs(q, xt, n_samples, generator=gen).numpy()
            # the labels as the problem converted them (bool -> 0 / 1), which the metrics' integer check takes
            out = classification_metrics_from_log_probs(log_probs, yt.numpy(), bin_sums=bin_sums)  # exact NLL
        else:
            theta = q.rsample(n_samples, generator=gen)
            pred = problem.model.output(theta, xt)
            # (B, D): a (B,) target of a one-dimensional output becomes the column (B, 1), any other mismatch
            # raises ShapeMismatchError (a (B,) target against a (B, 1) mean would broadcast to (B, B))
            yt = pred.target(yt)  # type: ignore[attr-defined]
            logp = pred.log_prob(yt)  # (S, B)
            nll = -(torch.logsumexp(logp, dim=0) - math.log(n_samples)).mean()
            mean = pred.mean.mean(0)  # type: ignore[attr-defined]
            rmse = ((mean - yt) ** 2).sum(-1).mean().sqrt()
            out = {"nll": float(nll), "rmse": float(rmse)}
    out["num-examples"] = float(len(y))
    return {k: float(v) for k, v in out.items()}
