#!/usr/bin/env bash
# Set up (if needed) and run the embedded main job in Flower's simulation engine: a robust BNN
# (GCE loss + Alpha-Renyi divergence) on scikit-learn digits with 20 % label noise over 3 clients.
# Extra arguments are passed to scripts/simulate.py, e.g. -c 'num-server-rounds=5'.  One SuperNode per client:
# simulate.py takes their number from the run config's num-clients (-c 'num-clients=4 min-clients=4' runs 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/simulate.py --out runs/main "$@"
