#!/bin/bash
# Every Fashion-MNIST run of docs/RESULTS.md, most important first, in parallel lanes of one torch thread each
# (a 2-core machine). Each command skips runs that have finished, so the script can be re-run after a stop.
cd "$(dirname "$0")/.."
E=".venv/bin/python scripts/experiments.py"
(
  $E fmnist-noise --noise 0.4 --seeds 0 --methods fedgvi pvi fedavg
  $E fmnist-noise --noise 0.4 --seeds 1 --methods fedgvi pvi fedavg
  $E fmnist-noise --noise 0.4 --seeds 0 --methods gce
  $E fmnist-noniid --schedules synchronous sequential asynchronous --seeds 0 --rounds 10
  $E fmnist-noniid --schedules asynchronous --seeds 0 --rounds 10 --suffix=-staleness10 -c max-staleness=10
) > runs/experiments/lane-a.log 2>&1 &
(
  $E fmnist-noise --noise 0.0 --seeds 0 --methods fedgvi pvi fedavg
  $E fmnist-noise --noise 0.4 --seeds 2 --methods fedgvi pvi fedavg
  $E fmnist-noise --noise 0.2 --seeds 0 --methods fedgvi pvi fedavg
  $E fmnist-noise --noise 0.1 --seeds 0 --methods fedgvi pvi fedavg
) > runs/experiments/lane-b.log 2>&1 &
(
  $E fmnist-noise --noise 0.4 --seeds 0 --methods gvi1 vi1     # the one-client (centralised) references
  $E fmnist-noise --noise 0.0 --seeds 1 --methods pvi fedgvi
) > runs/experiments/lane-c.log 2>&1 &
wait
# second seeds where time allowed (two lanes)
(
  $E fmnist-noise --noise 0.4 --seeds 1 --methods gce
  $E fmnist-noise --noise 0.2 --seeds 1 --methods fedgvi pvi
) > runs/experiments/lane-x.log 2>&1 &
(
  $E fmnist-noise --noise 0.0 --seeds 1 --methods fedavg
  $E fmnist-noise --noise 0.1 --seeds 1 --methods fedgvi pvi fedavg
) > runs/experiments/lane-y.log 2>&1 &
wait
# FedGVI with the loss weight 10 of the reference BNN code (it sums the GCE over its 10 MC samples)
$E fmnist-noise --noise 0.4 --seeds 0 1 --methods fedgvi --suffix=-w10 -c loss-weight=10 > runs/experiments/lane-w.log 2>&1
# the issue's 25 rounds at 40 % noise, up to 5 local epochs (patience 2): FedGVI (loss weight 10) against PVI
LONG="-c num-server-rounds=25 -c local-epochs=5 -c patience=2"
(
  $E fmnist-noise --noise 0.4 --seeds 0 2 --methods fedgvi --suffix=-w10-long $LONG -c loss-weight=10
  $E fmnist-noise --noise 0.4 --seeds 1 --methods pvi --suffix=-long $LONG
) > runs/experiments/lane-l1.log 2>&1 &
(
  $E fmnist-noise --noise 0.4 --seeds 1 --methods fedgvi --suffix=-w10-long $LONG -c loss-weight=10
  $E fmnist-noise --noise 0.4 --seeds 0 2 --methods pvi --suffix=-long $LONG
) > runs/experiments/lane-l2.log 2>&1 &
wait
# FedGVI with up to 20 local epochs (patience 3), and FedAvg, over the same 25 rounds
$E fmnist-noise --noise 0.4 --seeds 0 --methods fedgvi --suffix=-w10-e20 -c num-server-rounds=25 -c local-epochs=20 \
    -c patience=3 -c loss-weight=10 > runs/experiments/lane-e20.log 2>&1 &
$E fmnist-noise --noise 0.4 --seeds 0 1 2 --methods fedavg --suffix=-long -c num-server-rounds=25 > runs/experiments/lane-fa.log 2>&1 &
wait
# the asynchronous schedule with the default max-staleness ('auto' = M)
$E fmnist-noniid --schedules asynchronous --seeds 0 --rounds 10 > runs/experiments/lane-async.log 2>&1
$E report
