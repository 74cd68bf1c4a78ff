"""Run the PGVI ServerApp logic against the real ClientApp in one process (no Ray, no network).

Usage:
    python scripts/run_inprocess.py [-c key=value ...] [--out runs/inprocess] [--method pgvi|fedavg]

Same strategy, same client code and same records as a Flower run; the fastest way to try a configuration.
``--method fedavg`` runs the FedAvg baseline (Flower's ``FedAvg`` + ``client/fedavg_app.py``) instead; its records
default to runs/inprocess-fedavg, so it does not replace a PGVI run's.
The records go to --out (a ``-c output-dir=...`` is refused, as by scripts/simulate.py), and the run config they
record names that directory as its ``output-dir``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.app import app as client_app  # noqa: E402
from common.config import ConfigError  # noqa: E402
from server.app import prepare, run_strategy  # noqa: E402
from strategies.inprocess import InProcessGrid  # noqa: E402


def load_run_config(overrides: list[str]) -> dict:
    """pyproject.toml's run config with the ``-c`` overrides (``flwr run -c``'s syntax, parsed as
    :func:`scripts.simulate.parse_overrides` does: ``ValueError`` names a malformed one)."""
    from scripts.simulate import pyproject_run_config

    return pyproject_run_config(overrides)


def run(raw: dict, out: Path):
    cfg, problem = prepare(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"} for m in range(cfg.num_clients)]
    grid = InProcessGrid(client_app, nodes, raw)
    return run_strategy(grid, cfg, problem, out)


def run_fedavg_baseline(raw: dict, out: Path):
    from client.fedavg_app import app as fedavg_client_app
    from common.problem import load_full_data
    from server.fedavg_app import prepare_fedavg
    from strategies.fedavg_baseline import run_fedavg

    cfg = prepare_fedavg(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients} for m in range(cfg.num_clients)]
    grid = InProcessGrid(fedavg_client_app, nodes, raw)
    return run_fedavg(grid, cfg, load_full_data(cfg), out)


def default_out(method: str) -> Path:
    """The records' directory without ``--out``: one per method (the baseline's run used to replace PGVI's)."""
    return ROOT / "runs" / ("inprocess-fedavg" if method == "fedavg" else "inprocess")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", action="append", default=[],
                    help="run-config override key=value (TOML value); not output-dir (use --out)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the directory of the records (default runs/inprocess, with --method fedavg "
                         "runs/inprocess-fedavg: a reused directory loses its previous run's records)")
    ap.add_argument("--method", choices=("pgvi", "fedavg"), default="pgvi")
    args = ap.parse_args()
    if args.out is None:
        args.out = default_out(args.method)
    try:
        from scripts.simulate import refuse_output_dir

        raw = load_run_config(args.config)
        refuse_output_dir(args.config, f"--out (now {args.out})")
    except ValueError as e:
        ap.error(str(e))
    raw = {**raw, "output-dir": str(args.out)}  # where the records are, as their run config says
    try:
        (run_fedavg_baseline if args.method == "fedavg" else run)(raw, args.out)
    except ConfigError as e:  # a bad run-config value: its message, not a traceback
        raise SystemExit(f"run_inprocess.py: {e}") from None


if __name__ == "__main__":
    import logging

    logging.getLogger("flwr").setLevel(logging.INFO)
    main()
