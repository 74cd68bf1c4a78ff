"""FedAvg baseline ServerApp (Flower's built-in ``FedAvg``), for ``client/fedavg_app.py`` clients."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from client import object_pulls
from server.app import prepare
from strategies.fedavg_baseline import run_fedavg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg, _ = prepare(dict(context.run_config))  # the same validation and data path as PGVI
    object_pulls.set_initial_retry(cfg.object_pull_retry_s)
    from common.problem import load_full_data

    run_fedavg(grid, cfg, load_full_data(cfg), Path(cfg.output_dir) / f"fedavg-run-{grid.run.run_id}")
