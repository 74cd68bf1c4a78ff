#!/bin/bash
# Every Fashion-MNIST run of docs/RESULTS.md, most important first (each command skips finished runs).
cd /work/main
E=".venv/bin/python scripts/experiments.py"
$E fmnist-noise --noise 0.4 --seeds 0 --methods fedgvi pvi fedavg
$E fmnist-noise --noise 0.4 --seeds 1 2 --methods fedgvi pvi fedavg
$E fmnist-noise --noise 0.0 --seeds 0 --methods fedgvi pvi fedavg
$E fmnist-noise --noise 0.4 --seeds 0 --methods gce
$E fmnist-noniid --schedules synchronous sequential asynchronous --seeds 0 --rounds 10
$E fmnist-noise --noise 0.2 --seeds 0 --methods fedgvi pvi fedavg
$E fmnist-noise --noise 0.1 --seeds 0 --methods fedgvi pvi fedavg
