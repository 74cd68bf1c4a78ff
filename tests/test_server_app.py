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
        ({"model": "gaussian_location", "dataset": "digits"}, "dataset", "real-valued"),
        ({"test-fraction": 0.9995}, "test-fraction", ""),
        ({"resume": "/nonexistent/pgvi-run"}, "resume", "no checkpoint"),
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


def test_result_files_are_replaced_atomically_and_readable(tmp_path, monkeypatch):
    """A crash while writing a result file leaves the previous file (or none), never a torn one."""
    import json as _json

    import numpy as np

    from common.atomic_io import atomic_write
    from strategies.results import RoundRecorder

    target = tmp_path / "summary.json"
    atomic_write(target, lambda f: f.write(b'{"ok": 1}'), mode=0o644)

    def crash(f):
        f.write(b'{"half')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash)
    assert _json.loads(target.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left
    assert (target.stat().st_mode & 0o777) == 0o644
    from common.families import MeanFieldGaussian
    import torch

    q = MeanFieldGaussian.from_mean_variance({"w": torch.zeros(3)}, {"w": torch.ones(3)})
    rec = RoundRecorder(tmp_path / "run", {"a": 1})
    rec.record(1, {"round": 1.0, "test-accuracy": 0.5})
    rec.finish(q, {"site-0": q}, {"rounds-completed": 1})
    with np.load(tmp_path / "run" / "posterior.npz") as z:
        assert sorted(z.files) == sorted(q.to_numpy())
    assert (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0] == "round,test-accuracy"


def test_resume_from_a_checkpoint_of_another_run_config_is_a_config_error(tmp_path):
    from strategies.checkpoint import save_checkpoint
    from strategies.pgvi import PGVIStrategy

    cfg, problem = prepare(app_config())
    strategy = PGVIStrategy(problem)
    strategy.state.site("site-0")
    strategy.ledger_versions["site-0"] = 0
    save_checkpoint(strategy, tmp_path)
    assert prepare({**app_config(), "resume": str(tmp_path)})[0].resume == str(tmp_path)
    with pytest.raises(ConfigError, match="resume: run config differs from the checkpoint's in: seed"):
        prepare({**app_config(), "resume": str(tmp_path), "seed": cfg.seed + 1})
