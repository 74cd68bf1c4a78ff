"""Closed-form reference posteriors of conjugate PGVI runs (used by the parity tests and benchmarks).

For a Gaussian model with a loss that is exactly quadratic in theta (NLL, or score matching with the constant
weight) and D = (1/w) KL, the client's local posterior is ``cavity * exp(-w L_m)`` whatever the
cavity, so its Delta is ``rho * (e_m - t_m)`` with ``e_m = exp(-w L_m)`` the exact site.  Hence, whatever
the schedule, after ``k`` applied updates of client m its site is ``(1 - (1 - rho)^k) e_m`` (FedGVI Lemma
4.5); with the server divergence KL the server posterior is ``prior * prod_m t_m`` (the posterior functions refuse
another server divergence).

Independence.  Where a textbook closed form exists, the sites and the prior are computed here with numpy in
float64 from the raw training data, without the library's losses, models, quadratic forms, factor algebra or
``client_shard`` (:func:`textbook_sites`), so a wrong likelihood formula or a shard that loses a point in the
library does not cancel out of the parity tests:

* models ``gaussian_location`` (``y ~ N(theta, sigma^2 I)``, design ``A = I``) and ``linear_regression``
  (``y ~ N([x, 1]^T theta, sigma^2)``, bias last);
* loss ``nll``: ``-log p`` summed over the client's points has precision ``P = sum A^T A / sigma^2`` and shift
  ``h = sum A^T y / sigma^2``;
* loss ``score_matching`` with the ``constant`` weight ``beta_w``: the Hyvarinen score ``s = (y - A theta) /
  sigma^2`` gives per point ``beta_w^2 ||y - A theta||^2 / sigma^4`` plus a constant, so ``P = 2 beta_w^2 sum A^T A
  / sigma^4``, ``h = 2 beta_w^2 sum A^T y / sigma^4``; the library's ``beta_w = sigma / sqrt(2)`` (not a run-config
  key) makes this the NLL site, i.e. conjugate SM + KL is exact Bayes;
* times the GBI loss weight ``loss-weight``, and with ``weighted_kl`` of weight ``w`` times ``w``: the convention
  of :class:`common.divergences.WeightedKL` is ``D = (1/w) KL``, and (FedGVI Lemma B.1) ``E_q[L] + (1/w) KL`` has the
  minimiser of ``E_q[w L] + KL``, i.e. the site is ``exp(-w L)`` (tests/test_reference_oracle.py checks this by
  minimising the objective numerically).

The data go the way a client's do: :func:`common.problem.load_full_data` (the configured contamination) and the
configured partitioner of :mod:`common.data.partition`, drawn on the labels ``client_shard`` draws it on (the clean
class labels, all zeros for real-valued targets); the index selection is redone here, not taken from
``client_shard``.

LIBRARY PATH (not independent): score matching with the ``imq`` or ``se`` weight has no textbook closed form; for
it :func:`library_sites` builds the sites from the library's own ``problem.loss.quadratic`` with the weights
centred at the prior mean.  Such a reference can only agree with the library, not check it, and only for an update
whose cavity mean is the prior's (a synchronous run's round 1): the weights are centred at the cavity mean, which
moves, so the loss changes from update to update, Lemma 4.5's recursion does not hold and the reference posteriors
(:func:`expected_posterior`, :func:`exact_posterior`) refuse such a run config.
"""

from __future__ import annotations

import numpy as np
import torch

from common.config import RunConfig
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.problem import build_problem, client_shard, load_clean_data, load_full_data

TEXTBOOK_MODELS = ("gaussian_location", "linear_regression")
TEXTBOOK_PARTITIONERS = ("iid", "size_skew")  # the partitioners a real-valued target allows (config refuses the others)
SM_BETA_W_OVER_SIGMA = 2.0**-0.5  # the library's fixed score-matching weight beta_w = sigma / sqrt(2)


def _divergence_w(cfg: RunConfig) -> float:
    if cfg.divergence not in ("kl", "weighted_kl"):
        raise ValueError("the closed-form reference needs divergence kl or weighted_kl")
    return float(cfg.divergence_w) if cfg.divergence == "weighted_kl" else 1.0


def has_textbook_form(cfg: RunConfig) -> bool:
    """Whether :func:`exact_sites` is the independent textbook reference (else the library path)."""
    if cfg.model not in TEXTBOOK_MODELS or cfg.divergence not in ("kl", "weighted_kl"):
        return False
    return cfg.loss == "nll" or (cfg.loss == "score_matching" and cfg.sm_weight == "constant")


# ==================================================================================================
# the independent (textbook) path: numpy, float64, raw data


def client_training_data(cfg: RunConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every client's ``(x, y)`` training arrays (float64), by partition id, selected here from the full
    (contaminated) training set with the configured partitioner; checks that the parts cover every point once."""
    from common.data.partition import partition

    full = load_full_data(cfg)  # contamination as configured (label noise; none for real-valued targets)
    clean = load_clean_data(cfg)
    n = int(full.y_train.shape[0])
    # the partition is drawn from the clean class labels; real-valued targets are split as one class
    labels = clean.y_train if clean.num_classes > 1 else np.zeros(n, dtype=np.int64)
    if cfg.partitioner not in TEXTBOOK_PARTITIONERS:
        raise ValueError(f"the textbook reference supports partitioners {TEXTBOOK_PARTITIONERS}, not {cfg.partitioner}")
    parts = partition(cfg.partitioner, labels, cfg.num_clients, seed=cfg.seed)
    if len(parts) != cfg.num_clients:
        raise AssertionError(f"partitioner gave {len(parts)} parts for {cfg.num_clients} clients")
    seen = np.sort(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    if not np.array_equal(seen, np.arange(n)):
        raise AssertionError("the partition does not hold every training point exactly once")
    x = np.asarray(full.x_train, dtype=np.float64)
    y = np.asarray(full.y_train, dtype=np.float64)
    if y.ndim == 1:
        y = y[:, None]
    return [(x[np.sort(np.asarray(p))], y[np.sort(np.asarray(p))]) for p in parts]


def _design(cfg: RunConfig, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The design matrices ``A_b`` of the points, shape ``(n, D, d)``."""
    n, d_out = y.shape
    if cfg.model == "gaussian_location":
        return np.broadcast_to(np.eye(d_out), (n, d_out, d_out))
    if cfg.model == "linear_regression":
        if d_out != 1:
            raise ValueError(f"linear_regression needs y of shape (n, 1), got {y.shape}")
        return np.concatenate([x, np.ones((n, 1))], axis=1)[:, None, :]  # bias last
    raise ValueError(f"no textbook form for model {cfg.model}")


def textbook_site_natural(cfg: RunConfig, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(eta1, eta2)`` (float64) of the exact site ``exp(-w * loss_weight * L)`` of a client with data ``(x, y)``."""
    if not has_textbook_form(cfg):
        raise ValueError(f"no textbook closed form for model {cfg.model}, loss {cfg.loss}, divergence {cfg.divergence}")
    s2 = float(cfg.likelihood_sigma) ** 2
    a = _design(cfg, x, y)
    ata = np.einsum("bik,bil->kl", a, a)  # sum_b A_b^T A_b
    aty = np.einsum("bik,bi->k", a, y)  # sum_b A_b^T y_b
    if cfg.loss == "nll":
        precision, shift = ata / s2, aty / s2
    else:  # score matching, constant weight beta_w: beta_w^2 ||y - A theta||^2 / sigma^4 per point (+ const)
        beta_w = SM_BETA_W_OVER_SIGMA * float(cfg.likelihood_sigma)
        precision, shift = 2.0 * beta_w**2 * ata / s2**2, 2.0 * beta_w**2 * aty / s2**2
    scale = float(cfg.loss_weight) * _divergence_w(cfg)
    return scale * shift, -0.5 * scale * precision


def textbook_prior_natural(cfg: RunConfig, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``N(prior-mean 1, prior-variance I)`` in natural parameters (float64)."""
    v = float(cfg.prior_variance)
    return np.full(d, float(cfg.prior_mean) / v), -0.5 / v * np.eye(d)


def _factor(cfg: RunConfig, eta1: np.ndarray, eta2: np.ndarray) -> GaussianFactor:
    """The run's family and dtype: full covariance, or mean field (only for a diagonal precision: exact there)."""
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    if cfg.family == "full_covariance":
        return FullCovarianceGaussian(torch.as_tensor(eta1, dtype=dtype), torch.as_tensor(eta2, dtype=dtype))
    off = eta2 - np.diag(np.diagonal(eta2))
    if np.abs(off).max(initial=0.0) > 0:
        raise ValueError("a site with off-diagonal precision is not conjugate to a mean-field Gaussian")
    return MeanFieldGaussian({"theta": torch.as_tensor(eta1, dtype=dtype)},
                             {"theta": torch.as_tensor(np.diagonal(eta2).copy(), dtype=dtype)})


def textbook_sites_natural(cfg: RunConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {f"site-{m}": textbook_site_natural(cfg, x, y) for m, (x, y) in enumerate(client_training_data(cfg))}


def textbook_sites(cfg: RunConfig) -> dict[str, GaussianFactor]:
    """The exact sites from the raw data (see the module doc), in the run's family and dtype."""
    return {cid: _factor(cfg, *nat) for cid, nat in textbook_sites_natural(cfg).items()}


def _textbook_posterior(cfg: RunConfig, power: dict[str, float]) -> GaussianFactor:
    """``prior * prod_m e_m ** power[m]``, summed in float64 natural parameters."""
    sites = textbook_sites_natural(cfg)
    d = next(iter(sites.values()))[0].shape[0]
    eta1, eta2 = textbook_prior_natural(cfg, d)
    for cid, (e1, e2) in sites.items():
        p = power.get(cid, 0.0)
        eta1, eta2 = eta1 + p * e1, eta2 + p * e2
    return _factor(cfg, eta1, eta2)


# ==================================================================================================
# LIBRARY PATH (not independent): the library's own quadratic forms, for what has no textbook form


def library_sites(cfg: RunConfig) -> dict[str, GaussianFactor]:
    """``e_m = exp(-w * L_m)`` from ``problem.loss.quadratic`` on ``client_shard`` (weights centred at the prior
    mean).  NOT an independent oracle: used only where there is no textbook form (IMQ/SE score matching), and by
    tests/test_reference_oracle.py to show that both paths agree on the correct code."""
    problem = build_problem(cfg)
    w = _divergence_w(cfg)
    sites = {}
    for m in range(cfg.num_clients):
        shard = client_shard(cfg, m)
        x, y = problem.tensors(shard.x_train, shard.y_train)
        reference_theta = {"theta": problem.prior.mean()} if problem.loss.needs_reference else None
        quad = problem.loss.quadratic(problem.model, x, y, reference_theta)
        if quad is None:
            raise ValueError(f"loss {cfg.loss} is not quadratic for model {cfg.model}")
        sites[f"site-{m}"] = quad.as_factor(problem.prior, weight=w)
    return sites


# ==================================================================================================
# the reference


def exact_sites(cfg: RunConfig) -> dict[str, GaussianFactor]:
    """``e_m = exp(-w * L_m)`` for client ``site-m``, m = 0..M-1 (default client ids): the textbook form where
    there is one (:func:`has_textbook_form`), else the library path (:func:`library_sites`)."""
    return textbook_sites(cfg) if has_textbook_form(cfg) else library_sites(cfg)


def _require_kl_server(cfg: RunConfig) -> None:
    """The posteriors below are ``prior * prod_m t_m``: the server step of ``server-divergence = kl`` only, and for
    losses with a textbook form (:func:`has_textbook_form`; not IMQ / SE score matching, see the module docstring).  The
    sites themselves follow Lemma 4.5 under any server divergence, the posterior does not (``weighted_kl``: ``prior
    * (prod_m t_m)^w``; the others: FedGVI eq. 7's minimiser), so another one is a ``ValueError``, not a wrong
    reference."""
    if cfg.server_divergence != "kl":
        raise ValueError(f"the reference posterior is prior x prod of sites, the server step of server-divergence "
                         f"'kl'; this run config has '{cfg.server_divergence}'")
    if not has_textbook_form(cfg):  # IMQ / SE score matching: weights centred at the moving cavity mean
        raise ValueError(f"no reference posterior for loss '{cfg.loss}' with sm-weight '{cfg.sm_weight}' (or this "
                         "model): its weights are centred at the cavity mean, which moves between updates, so the "
                         "sites do not follow Lemma 4.5 (exact_sites / library_sites give the first synchronous "
                         "round's)")


def expected_posterior(cfg: RunConfig, updates_per_client: dict[str, int]) -> GaussianFactor:
    """``prior * prod_m (1 - (1-rho)^k_m) e_m`` for k_m applied updates of client m (``server-divergence = kl``)."""
    _require_kl_server(cfg)
    rho = cfg.rho()
    power = {f"site-{m}": 1.0 - (1.0 - rho) ** updates_per_client.get(f"site-{m}", 0) for m in range(cfg.num_clients)}
    return _textbook_posterior(cfg, power)


def exact_posterior(cfg: RunConfig) -> GaussianFactor:
    """The GBI / Bayes posterior ``prior * prod_m e_m`` (the fixed point of every schedule; ``server-divergence =
    kl``)."""
    _require_kl_server(cfg)
    power = {f"site-{m}": 1.0 for m in range(cfg.num_clients)}
    return _textbook_posterior(cfg, power)


def max_natural_diff(a: GaussianFactor, b: GaussianFactor) -> float:
    return max(float((v - b.params[k]).abs().max()) for k, v in a.params.items())
