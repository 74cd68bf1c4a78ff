"""scripts/check_local_mc_bias.py: its exact optimum (the README's mc-samples figures are ratios to it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scripts.check_local_mc_bias import exact_optimum, main


@pytest.mark.parametrize("prior_var", [4.0, 10.0])
def test_the_exact_beta_loss_optimum_tends_to_the_conjugate_posterior_as_beta_tends_to_1(prior_var):
    x = torch.tensor(np.random.default_rng(3).normal(1.5, 1.0, size=50), dtype=torch.float64)
    precision = 1.0 / prior_var + len(x)  # sigma = 1, prior mean 0
    mean, var = exact_optimum(x, 1.0 + 1e-6, 1.0, prior_var)
    assert mean == pytest.approx(float(x.sum()) / precision, rel=1e-5)
    assert var == pytest.approx(1.0 / precision, rel=1e-5)
    mean_b, var_b = exact_optimum(x, 1.5, 1.0, prior_var)  # robust: a different optimum, not the conjugate one
    assert abs(var_b - 1.0 / precision) > 1e-3 / precision and math.isfinite(mean_b)


def test_the_script_prints_a_ratio_per_sample_count(capsys):
    main(["--epochs", "30", "--samples", "5", "20", "--seeds", "2", "--points", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("beta 1.5, 20 points, prior variance 4.0")
    assert [ln.split(":")[0] for ln in lines[1:]] == ["mc-samples 5", "mc-samples 20"]
