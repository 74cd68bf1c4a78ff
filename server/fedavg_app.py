"""FedAvg baseline ServerApp (Flower's built-in ``FedAvg``), for ``client/fedavg_app.py`` clients."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from client import object_pulls
from common.config import ConfigError, RunConfig, parse_run_config
from common.deterministic_mlp import baseline_hidden_sizes
from server.app import config_errors_logged, prepare
from strategies.fedavg_baseline import run_fedavg

app = ServerApp()


def prepare_fedavg(run_config: dict) -> RunConfig:
    """The FedAvg baseline's checks before round 1: :func:`server.app.prepare`'s (the same validation and data
    path as PGVI) and a classifier model (:func:`~common.deterministic_mlp.baseline_hidden_sizes`).  The baseline
    writes no checkpoint and cannot resume: a ``resume`` directory is a ``ConfigError`` (``prepare`` would check
    it as a PGVI checkpoint, and the run would start from round 1 without a word)."""
    if parse_run_config(run_config).resume:
        raise ConfigError("invalid run config: resume: the FedAvg baseline writes no checkpoint and cannot resume "
                          "a run; leave resume empty")
    cfg, _ = prepare(run_config)
    baseline_hidden_sizes(cfg)
    return cfg


@app.main()
def main(grid: Grid, context: Context) -> None:
    with config_errors_logged():
        cfg = prepare_fedavg(dict(context.run_config))
        object_pulls.set_initial_retry(cfg.object_pull_retry_s)
        from common.problem import load_full_data

        run_fedavg(grid, cfg, load_full_data(cfg), Path(cfg.output_dir) / f"fedavg-run-{grid.run.run_id}")
