"""Measure the bias of a Monte Carlo local GVI step: its posterior variance against the exact optimum's.

One local step (``common.local_gvi.local_gvi``, local reparameterisation, Adam, early stopping) on the beta-loss
Gaussian location problem with a KL divergence to a Gaussian prior, against the exact minimiser of the same
objective (the expected beta-loss of a Gaussian has a closed form; L-BFGS in float64 on (mean, log variance)).
Prints, per number of Monte Carlo samples, the mean and sd over seeds of var(q) / var(exact optimum) and the mean
error in units of the exact posterior's sd.  The README's ``mc-samples`` row quotes its output:

    python scripts/check_local_mc_bias.py                                   # prior variance 4, 3000 epochs
    python scripts/check_local_mc_bias.py --prior-var 10 --epochs 2000 --samples 10
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from common.divergences import make_divergence
from common.families import FullCovarianceGaussian
from common.local_gvi import LocalGVIConfig, local_gvi
from common.losses import make_loss
from common.models import make_model


def exact_optimum(x: torch.Tensor, beta: float, sigma: float, prior_var: float) -> tuple[float, float]:
    """(mean, variance) minimising E_q[sum_i beta-loss] + KL(q || N(0, prior_var)) over 1-D Gaussians q."""
    c, s2 = beta - 1.0, sigma**2

    def objective(mu: torch.Tensor, logv: torch.Tensor) -> torch.Tensor:
        v = torch.exp(logv)
        e_pc = (2 * math.pi * s2) ** (-c / 2) * torch.sqrt(s2 / (s2 + c * v)) * torch.exp(
            -c * (x - mu) ** 2 / (2 * (s2 + c * v)))
        loss = (-e_pc / c + (2 * math.pi * s2) ** ((1 - beta) / 2) * beta**-0.5 / beta).sum()
        return loss + 0.5 * (v / prior_var + mu**2 / prior_var - 1 + math.log(prior_var) - logv)

    p = torch.tensor([float(x.mean()), math.log(s2 / len(x))], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([p], lr=1, max_iter=500, tolerance_grad=1e-14, tolerance_change=1e-16,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        val = objective(p[0], p[1])
        val.backward()
        return val

    opt.step(closure)
    return p[0].item(), math.exp(p[1].item())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prior-var", type=float, default=4.0)
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--samples", type=int, nargs="+", default=[10, 50, 200])
    ap.add_argument("--seeds", type=int, default=6, help="at least 2 (an sd is printed)")
    ap.add_argument("--points", type=int, default=180)
    ap.add_argument("--beta", type=float, default=1.5)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--patience", type=int, default=10)
    args = ap.parse_args(argv)
    if args.seeds < 2:
        ap.error(f"--seeds must be at least 2 (the sd over seeds is printed), got {args.seeds}")
    torch.set_num_threads(1)
    dt, sigma = torch.float64, 1.0
    x = torch.tensor(np.random.default_rng(0).normal(1.5, 1.0, size=args.points), dtype=dt)
    m_opt, v_opt = exact_optimum(x, args.beta, sigma, args.prior_var)
    prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(1, dtype=dt),
                                                        torch.tensor([[args.prior_var]], dtype=dt))
    model, loss = make_model("gaussian_location", dim=1, sigma=sigma), make_loss("beta", beta=args.beta)
    print(f"beta {args.beta}, {args.points} points, prior variance {args.prior_var}, lr {args.lr}, "
          f"{args.epochs} epochs, patience {args.patience}, {args.seeds} seeds; exact optimum mean {m_opt:.4f} "
          f"variance {v_opt:.5f}")
    for s in args.samples:
        ratios, errs = [], []
        for seed in range(args.seeds):
            cfg = LocalGVIConfig(epochs=args.epochs, lr=args.lr, n_samples=s, patience=args.patience, seed=seed,
                                 dtype=dt)
            q = local_gvi(model, loss, make_divergence("kl"), prior, None, x.unsqueeze(-1), prior, cfg).posterior
            ratios.append(float(q.covariance()[0, 0]) / v_opt)
            errs.append((float(q.mean()[0]) - m_opt) / math.sqrt(v_opt))
        print(f"mc-samples {s}: variance ratio {np.mean(ratios):.3f} (sd {np.std(ratios, ddof=1):.3f}), "
              f"mean error {np.mean(errs):+.4f} sd")


if __name__ == "__main__":
    main()
