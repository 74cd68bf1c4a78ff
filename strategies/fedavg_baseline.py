"""The FedAvg baseline on Flower's built-in ``FedAvg`` strategy, recorded like a PGVI run.

The global deterministic MLP is evaluated centrally on the held-out test set after every round with the
same metrics (accuracy, NLL, ECE-15, Brier) and written to the same ``metrics.jsonl`` / ``summary.json``
layout as :mod:`strategies.results`, so the experiment runner treats both methods alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from common.atomic_io import atomic_write
from common.config import RunConfig
from common.deterministic_mlp import DeterministicMLP, predict_log_probs
from common.metrics import classification_metrics_from_log_probs
from common.problem import ArraysSplit
from strategies.pgvi import AllClientsFailed, _last_line
from common.strict_json import dumps_json
from strategies.results import RoundRecorder


class OrderedFedAvg(FedAvg):
    """Flower's ``FedAvg``, reproducible under the run's seed, with each round's outcome counted, and stopped
    when a round has no valid reply (as PGVI).

    * Sampling: ``FedAvg`` samples its clients with the module-level ``random.sample`` (seeded by the OS), so with
      ``fraction-train`` < 1 two runs of one seed trained different clients.  Round ``r`` here draws from a
      ``random.Random`` seeded by ``(seed, r)`` over the sorted node ids.  As in ``FedAvg`` a round waits until
      ``min_available_nodes`` (and ``min_train_nodes``) nodes are connected, but at most ``wait_for_clients_s``
      (``FedAvg`` waits forever), then stops with :class:`~strategies.pgvi.AllClientsFailed`.
    * Order: ``FedAvg`` sums the replies in the order they come back, so two runs with the same seed add the same
      float32 models in different orders.  The last-bit differences that leaves are then amplified by SGD on noisy
      labels: two runs of the 40 %-noise Fashion-MNIST baseline differed by 2.7 points of test accuracy after
      round 2.  The replies are summed in node-id order.
    * Failures: ``FedAvg.aggregate_train`` returns ``(None, None)`` when no reply is valid, and the run went on with
      the old model as if the round had trained.  :attr:`round_stats` holds the round's ``sent`` / ``replied`` /
      ``applied`` / ``failed`` counts (the PGVI rows' names; ``failed`` = sampled nodes without a valid reply:
      error replies and timeouts) and the mean and max of the clients' local-update seconds and epochs
      (``client-seconds-mean`` ..., of the valid replies); it is reset when the round is configured.  After a
      round's server-side evaluation (so its row is recorded first) :meth:`start` raises ``AllClientsFailed`` if
      no reply of the round was valid.
    """

    def __init__(self, *, seed: int, wait_for_clients_s: float, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.seed = seed
        self.wait_for_clients_s = wait_for_clients_s
        self.round_stats: dict[str, float] = {}
        self._sent: list[int] = []
        self._last_failure = ""

    def sample_train_nodes(self, grid: Grid, server_round: int) -> tuple[list[int], list[int]]:
        """``(sampled, connected)`` node ids of round ``server_round``, the sample sorted."""
        need = max(self.min_available_nodes, self.min_train_nodes)
        deadline = time.monotonic() + self.wait_for_clients_s
        while len(nodes := sorted(set(grid.get_node_ids()))) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AllClientsFailed(
                    f"round {server_round}: only {len(nodes)} of the {need} nodes FedAvg needs (min-clients) connected "
                    f"within wait-for-clients-s={self.wait_for_clients_s:g}s")
            log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).", len(nodes), need)
            time.sleep(min(1.0, left))
        size = min(len(nodes), max(int(len(nodes) * self.fraction_train), self.min_train_nodes))
        rng = random.Random(f"fedavg-sample:{self.seed}:{server_round}")  # a str seed hashes with SHA-512: stable
        return sorted(rng.sample(nodes, size)), nodes

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """``FedAvg.configure_train`` with :meth:`sample_train_nodes` instead of Flower's unseeded sampling."""
        self.round_stats, self._sent, self._last_failure = {}, [], ""
        if self.fraction_train == 0.0:
            return []
        node_ids, connected = self.sample_train_nodes(grid, server_round)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(connected))
        self._sent = node_ids
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):  # type: ignore[no-untyped-def]
        ordered = sorted(replies, key=lambda m: m.metadata.src_node_id)
        arrays, metrics = super().aggregate_train(server_round, ordered)  # validates the valid replies' contents
        valid = [m for m in ordered if not m.has_error()]
        errors = [m for m in ordered if m.has_error()]
        failed = len(set(self._sent) - {m.metadata.src_node_id for m in valid})
        stats = {"sent": float(len(self._sent)), "replied": float(len(ordered)), "applied": float(len(valid)),
                 "failed": float(failed)}
        if errors:
            self._last_failure = _last_line(errors[-1].error.reason)
        elif failed:
            self._last_failure = f"{failed} client(s) did not reply within round-timeout-s"
        for key, name in (("client-seconds", "client-seconds"), ("epochs", "client-epochs")):
            values = [float(r[key]) for m in valid for r in m.content.metric_records.values() if key in r]
            if values:
                stats.update({f"{name}-mean": sum(values) / len(values), f"{name}-max": max(values)})
        self.round_stats = stats
        return arrays, metrics

    def check_progress(self, server_round: int) -> None:
        """Raise :class:`AllClientsFailed` if round ``server_round`` sent messages and no reply was valid."""
        if self.round_stats.get("sent", 0.0) > 0 and self.round_stats.get("applied", 0.0) == 0:
            raise AllClientsFailed(f"round {server_round}: all {int(self.round_stats['sent'])} client messages "
                                   f"failed (last reason: {self._last_failure})")

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """``Strategy.start``, stopping after the server-side evaluation of a round none of whose replies was valid."""

        def evaluate_then_check(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
            if server_round > 0:
                self.check_progress(server_round)
            return res

        return super().start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds, timeout=timeout,
                             train_config=train_config, evaluate_config=evaluate_config,
                             evaluate_fn=evaluate_then_check)


def run_fedavg(grid: Grid, cfg: RunConfig, data: ArraysSplit, out_dir: str | Path) -> list[dict[str, float]]:
    """Run ``cfg.num_server_rounds`` FedAvg rounds over all ``cfg.num_clients`` clients; returns the rows."""
    if data.num_classes < 2:
        raise ValueError("the FedAvg baseline needs a classification dataset")
    out = Path(out_dir)
    recorder = RoundRecorder(out, {**cfg.to_flat(), "method": "fedavg"})
    torch.manual_seed(cfg.seed)
    model = DeterministicMLP(data.x_train.shape[1], cfg.hidden_sizes, data.num_classes)
    history: list[dict[str, float]] = []
    t0 = time.time()
    strategy = OrderedFedAvg(fraction_train=cfg.fraction_train, fraction_evaluate=0.0, min_train_nodes=cfg.min_clients,
                             min_evaluate_nodes=0, min_available_nodes=cfg.min_clients, seed=cfg.seed,
                             wait_for_clients_s=cfg.wait_for_clients_s)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.set_arrays({k: v.numpy() for k, v in arrays.to_torch_state_dict().items()})
        m = classification_metrics_from_log_probs(predict_log_probs(model, data.x_test), data.y_test)
        row = {"round": float(server_round), "test-accuracy": m["accuracy"], "test-nll": m["nll"],
               "test-ece": m["ece"], "test-brier": m["brier"], "wall-seconds": time.time() - t0}
        if server_round > 0:  # this round's counts and client-side figures, under the PGVI rows' names
            row.update(strategy.round_stats)
        recorder.record(server_round, row)
        history.append(row)
        return MetricRecord({k: float(v) for k, v in row.items()})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=cfg.num_server_rounds, timeout=cfg.round_timeout_s,
                            train_config=ConfigRecord({}), evaluate_fn=evaluate)
    final = {k: v.numpy() for k, v in result.arrays.to_torch_state_dict().items()}
    # each result file atomically, summary.json last (its presence means the others are complete)
    atomic_write(out / "model.npz", lambda f: np.savez(f, **final), mode=0o644)
    recorder.write_csv()
    summary = {"method": "fedavg", "wall-seconds": time.time() - t0, "final": history[-1] if history else {},
               "train-metrics": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()}}
    text = dumps_json(summary, indent=2, default=str).encode()
    atomic_write(out / "summary.json", lambda f: f.write(text), mode=0o644)
    log(INFO, "FedAvg records written to %s", out)
    return history
