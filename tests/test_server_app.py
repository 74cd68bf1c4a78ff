"""The ServerApp's boundary: every bad run-config value is one clear error before round 1."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from common.config import ConfigError
from server.app import prepare

ROOT = Path(__file__).resolve().parent.parent


def app_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


@pytest.mark.parametrize(
    "override,key,text",
    [
        ({"loss": "huber"}, "loss", "unknown loss 'huber'"),
        ({"divergence": "alpha_renyi", "divergence-alpha": 1.0}, "divergence-alpha", "use divergence 'kl'"),
        ({"loss": "gce", "loss-delta": 0.0}, "loss-delta", "(0, 1]"),
        ({"loss": "gce", "loss-delta": 1.2}, "loss-delta", "(0, 1]"),
        ({"damping": 0.0}, "damping", "(0, 1]"),
        ({"damping": 1.5}, "damping", "(0, 1]"),
        ({"min-clients": 4, "num-clients": 3}, "min-clients", "more than the 3 clients"),
        ({"dataset": "mnist", "data-dir": "/nonexistent/pgvi-data"}, "dataset", "/nonexistent/pgvi-data"),
        ({"dataset": "no_such_dataset"}, "dataset", "no_such_dataset"),
    ],
)
def test_bad_run_config_is_one_clear_error(override, key, text):
    raw = {**app_config(), **override}
    with pytest.raises(ConfigError) as ei:
        prepare(raw)
    msg = str(ei.value)
    assert key in msg and text in msg, msg
    assert "\n" not in msg and "Traceback" not in msg


def test_embedded_default_prepares_without_download():
    cfg, problem = prepare(app_config())
    assert cfg.dataset == "digits" and cfg.label_noise > 0 and cfg.loss == "gce"
    assert problem.model.is_classifier


@pytest.mark.parametrize("server_divergence,extra", [("weighted_kl", {"server-divergence-w": 0.5}),
                                                     ("alpha_renyi", {"server-divergence-alpha": 0.5})])
def test_every_server_divergence_builds(server_divergence, extra):
    _, problem = prepare({**app_config(), "server-divergence": server_divergence, **extra})
    post = problem.server_step(problem.prior, problem.prior.zeros_like())
    assert post.is_proper()
