"""The FedAvg baseline on Flower's built-in ``FedAvg`` strategy, recorded like a PGVI run.

The global deterministic MLP is evaluated centrally on the held-out test set after every round with the
same metrics (accuracy, NLL, ECE-15, Brier) and written to the same ``metrics.jsonl`` / ``summary.json``
layout as :mod:`strategies.results`, so the experiment runner treats both methods alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from common.atomic_io import atomic_write
from common.config import RunConfig, clients_per_round
from common.deterministic_mlp import DeterministicMLP, baseline_hidden_sizes, predict_log_probs
from common.metrics import classification_metrics_from_log_probs
from common.problem import ArraysSplit
from common.protocol import FEDAVG_TRAIN_METRICS, METRICS
from strategies.pgvi import AllClientsFailed, _finite_number, _last_line, _reply_text, _train_metric_problem
from common.strict_json import dumps_json
from strategies.results import recorder_for


def _name_differences(got: set[str], expected: set[str]) -> str:
    """``"missing [...]; unexpected [...]"`` (the non-empty parts) of a reply's names against the expected ones."""
    parts = [f"{what} {sorted(names)}" for what, names in (("missing", expected - got), ("unexpected", got - expected))
             if names]
    return "; ".join(parts)


class OrderedFedAvg(FedAvg):
    """Flower's ``FedAvg`` with seeded sampling, malformed replies left out, each round's outcome counted, and
    stopped when a round has no valid reply (as PGVI).

    * Sampling: ``FedAvg`` samples its clients with the module-level ``random.sample`` (seeded by the OS).  Round
      ``r`` here draws from a ``random.Random`` seeded by ``(seed, r)`` over the sorted node ids.  It samples
      :func:`common.config.clients_per_round` ``(fraction_train, connected)`` nodes (``fraction_train`` x the
      connected nodes rounded half up, at least 1), PGVI's rule.  This deliberately differs from Flower's
      ``FedAvg`` (``int(n x fraction_train)``, floored, at least ``min_train_nodes``), so that both methods train
      the same number of clients per round: ``min_train_nodes`` / ``min_available_nodes`` (the run's
      ``min-clients``) only gate the round's start.  As in ``FedAvg`` a round waits until that many nodes are
      connected, but at most ``wait_for_clients_s`` (``FedAvg`` waits forever), then stops with
      :class:`~strategies.pgvi.AllClientsFailed`.
    * Order: ``FedAvg`` sums the replies in the order they come back, so two runs with the same seed added the
      same float32 models in different orders.  The last-bit differences that leaves are then amplified by SGD on
      noisy labels: two runs of the 40 %-noise Fashion-MNIST baseline differed by 2.7 points of test accuracy
      after round 2.  The replies are summed in node-id order.
    * Reproducibility: sampling and summation follow the node ids, so a run is reproducible (the same clients,
      the same bits) only where a partition gets the same node id in every run: on the in-process grid
      (:class:`strategies.inprocess.InProcessGrid`, ``scripts/run_inprocess.py``), which numbers the nodes 1000,
      1001, ... in partition order.  Flower's simulation and deployment draw node ids at random, so there the
      sampled partitions (with ``fraction-train`` < 1) and the order of the sum change from run to run, and two
      runs of one seed are not reproducible, not even to the last bit.
    * Validation: each train reply that is not an error is checked before Flower's ``FedAvg.aggregate_train``
      sees it (:meth:`_reply_problem`): from a node the round sampled, the first reply of its node in the batch (later
      copies are duplicates),
      exactly one ArrayRecord and one MetricRecord, the ArrayRecord with exactly the names and shapes of the
      arrays the round sent, their dtype and finite values, the MetricRecord with exactly the keys of
      :data:`common.protocol.FEDAVG_TRAIN_METRICS`, a whole ``num-examples`` >= 1, finite ``client-seconds`` and
      ``epochs`` in [0, 2^53] and a finite ``train-loss``.  A reply that fails is logged (WARNING, node and
      reason) and left out; the valid ones are averaged by Flower's own code exactly as before.
    * Failures: ``FedAvg.aggregate_train`` returns ``(None, None)`` when no reply is valid, and the run went on with
      the old model as if the round had trained.  :attr:`round_stats` holds the round's ``sent`` / ``replied`` /
      ``applied`` / ``rejected`` / ``failed`` counts (the PGVI rows' names; ``rejected`` = replies left out by the
      validation, ``failed`` = sampled nodes without a valid reply: error replies, rejected replies and timeouts)
      and the mean and max of the clients' local-update seconds and epochs (``client-seconds-mean`` ..., of the
      valid replies); it is reset when the round is configured.  After a round's server-side evaluation (so its
      row is recorded first) :meth:`start` raises ``AllClientsFailed`` if no reply of the round was valid, with
      the reason of the round's last failure.
    """

    def __init__(self, *, seed: int, wait_for_clients_s: float, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.seed = seed
        self.wait_for_clients_s = wait_for_clients_s
        self.round_stats: dict[str, float] = {}
        self._sent: list[int] = []
        self._sent_layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
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
        size = clients_per_round(self.fraction_train, len(nodes))  # PGVI's rule, not FedAvg's (class docstring)
        rng = random.Random(f"fedavg-sample:{self.seed}:{server_round}")  # a str seed hashes with SHA-512: stable
        return sorted(rng.sample(nodes, size)), nodes

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """``FedAvg.configure_train`` with :meth:`sample_train_nodes` instead of Flower's unseeded sampling."""
        self.round_stats, self._sent, self._last_failure = {}, [], ""
        self._sent_layout = {k: (tuple(v.shape), v.numpy().dtype) for k, v in arrays.items()}  # what a reply sends back
        if self.fraction_train == 0.0:
            return []
        node_ids, connected = self.sample_train_nodes(grid, server_round)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(connected))
        self._sent = node_ids
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)

    def _reply_problem(self, content: RecordDict) -> str | None:
        """Why a train reply's ``content`` may not be averaged in, else ``None`` (see the class docstring)."""
        arrays, metrics = dict(content.array_records), dict(content.metric_records)
        if list(arrays) != [self.arrayrecord_key] or list(metrics) != [METRICS]:
            return (f"expected one ArrayRecord '{self.arrayrecord_key}' and one MetricRecord '{METRICS}', got "
                    f"ArrayRecord(s) {sorted(arrays)} and MetricRecord(s) {sorted(metrics)}")
        record = arrays[self.arrayrecord_key]
        if set(record) != set(self._sent_layout):
            differences = _name_differences(set(record), set(self._sent_layout))
            return f"array names differ from the round's model: {differences}"
        for name, value in record.items():
            x = value.numpy()
            shape, dtype = self._sent_layout[name]
            if tuple(x.shape) != shape:
                return f"array '{name}' has shape {tuple(x.shape)}, the round's model {shape}"
            if x.dtype != dtype:  # a float64 reply first in node order made the whole average float64
                return f"array '{name}' has dtype {x.dtype}, the round's model {dtype}"
            if not np.isfinite(x).all():
                return f"array '{name}' has non-finite entries"
        items = dict(metrics[METRICS].items())
        if set(items) != set(FEDAVG_TRAIN_METRICS):
            differences = _name_differences(set(items), set(FEDAVG_TRAIN_METRICS))
            return f"metric names differ from the FedAvg client's: {differences}"
        for key in ("num-examples", "client-seconds", "epochs"):
            if (why := _train_metric_problem(key, items[key])) is not None:
                return f"metric '{key}': {why}"
        if items["num-examples"] < 1:
            return "metric 'num-examples' is 0: a reply must count at least one example"
        if _finite_number(items["train-loss"]) is None:
            return "metric 'train-loss' is not a finite real number"
        return None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):  # type: ignore[no-untyped-def]
        """``FedAvg.aggregate_train`` over the error replies and the valid replies, in node-id order."""
        ordered = sorted(replies, key=lambda m: m.metadata.src_node_id)  # stable: a node's replies keep their order
        kept: list[Message] = []  # the valid replies and the error replies (Flower logs the errors)
        valid: list[Message] = []
        seen: set[int] = set()
        rejected = 0
        for msg in ordered:
            node = msg.metadata.src_node_id
            if msg.has_error():
                kept.append(msg)
                self._last_failure = _last_line(msg.error.reason)
                continue
            if node not in self._sent:
                why: str | None = "a reply from a node this round did not sample"
            elif node in seen:
                why = "a second reply from this node in the round (only its first is used)"
            else:
                seen.add(node)
                try:
                    why = self._reply_problem(msg.content)
                except Exception as err:  # malformed content must never crash the server
                    why = f"malformed reply: {type(err).__name__}: {err}"
            if why is None:
                kept.append(msg)
                valid.append(msg)
                continue
            why = _reply_text(why, 300)
            log(WARNING, "round %d: train reply of node %d rejected, not averaged in: %s", server_round, node, why)
            rejected += 1
            self._last_failure = f"node {node}: reply rejected: {why}"
        arrays, metrics = super().aggregate_train(server_round, kept)
        failed = len(set(self._sent) - {m.metadata.src_node_id for m in valid})
        stats = {"sent": float(len(self._sent)), "replied": float(len(ordered)), "applied": float(len(valid)),
                 "rejected": float(rejected), "failed": float(failed)}
        if failed and not self._last_failure:
            self._last_failure = f"{failed} client(s) did not reply within round-timeout-s"
        for key, name in (("client-seconds", "client-seconds"), ("epochs", "client-epochs")):
            values = [float(m.content[METRICS][key]) for m in valid]  # validated: finite numbers
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
    """Run ``cfg.num_server_rounds`` FedAvg rounds, each over ``clients_per_round(fraction-train, connected)``
    clients; returns the rows.  The network is :func:`~common.deterministic_mlp.baseline_hidden_sizes`'s
    (``ConfigError`` for a model that is not a classifier, before anything is written)."""
    hidden = baseline_hidden_sizes(cfg)
    out = Path(out_dir)
    recorder = recorder_for(out, {**cfg.to_flat(), "method": "fedavg"})
    torch.manual_seed(cfg.seed)
    model = DeterministicMLP(data.x_train.shape[1], hidden, data.num_classes)
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
