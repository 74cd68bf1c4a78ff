"""Closed-form reference posteriors of conjugate PGVI runs (used by the parity tests and benchmarks).

For a Gaussian model with a loss that is exactly quadratic in theta (NLL, or score matching with weights
that do not move) and D = (1/w) KL, the client's local posterior is ``cavity * exp(-w L_m)`` whatever the
cavity, so its Delta is ``rho * (e_m - t_m)`` with ``e_m = exp(-w L_m)`` the exact site.  Hence, whatever
the schedule, after ``k`` applied updates of client m its site is ``(1 - (1 - rho)^k) e_m`` (FedGVI Lemma
4.5); the server posterior is ``prior * prod_m t_m``.
"""

from __future__ import annotations

from common.config import RunConfig
from common.families import GaussianFactor
from common.problem import build_problem, client_shard


def exact_sites(cfg: RunConfig) -> dict[str, GaussianFactor]:
    """``e_m = exp(-w * L_m)`` for client ``site-m``, m = 0..M-1 (default client ids)."""
    problem = build_problem(cfg)
    w = cfg.divergence_w if cfg.divergence == "weighted_kl" else 1.0
    if cfg.divergence not in ("kl", "weighted_kl"):
        raise ValueError("the closed-form reference needs divergence kl or weighted_kl")
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


def expected_posterior(cfg: RunConfig, updates_per_client: dict[str, int]) -> GaussianFactor:
    """``prior * prod_m (1 - (1-rho)^k_m) e_m`` for k_m applied updates of client m."""
    problem = build_problem(cfg)
    rho = cfg.rho()
    post = problem.prior
    for cid, e in exact_sites(cfg).items():
        k = updates_per_client.get(cid, 0)
        post = post * (e ** (1.0 - (1.0 - rho) ** k))
    return post


def exact_posterior(cfg: RunConfig) -> GaussianFactor:
    """The GBI / Bayes posterior ``prior * prod_m e_m`` (the fixed point of every schedule)."""
    problem = build_problem(cfg)
    post = problem.prior
    for e in exact_sites(cfg).values():
        post = post * e
    return post


def max_natural_diff(a: GaussianFactor, b: GaussianFactor) -> float:
    return max(float((v - b.params[k]).abs().max()) for k, v in a.params.items())

