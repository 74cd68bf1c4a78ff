"""The request a PGVI node serves for one train or evaluate message, as plain Python and numpy.

No torch here: ``client/app.py`` (started by Flower for every message) builds a :class:`Request` and either
computes it in its own process or sends it to the node's warm compute worker; both run
``client.pgvi_client.handle``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.client_state import ClientState
from common.errors import PGVIError

if TYPE_CHECKING:
    from common.config import RunConfig

Scalar = bool | bytes | float | int | str


@dataclass
class Request:
    """Everything one train or evaluate message needs, as plain Python and numpy (picklable).

    ``arrays`` are keyed by name: the posterior's under ``posterior``, the ledger's copy of the site (resync
    only) under ``site``.  ``state`` is the client's state before the message; ``fault`` the test-only fault
    mode for this round ('' = none).
    """

    kind: str  # "train" | "evaluate"
    run_config: dict[str, Scalar]
    node_config: dict[str, Scalar]
    posterior: dict[str, np.ndarray]
    config: dict[str, Scalar]
    site: dict[str, np.ndarray] | None = None
    state: ClientState = field(default_factory=ClientState)
    fault: str = ""


@dataclass
class Result:
    """The reply's content: Delta (empty when the status is not ok) and metrics, and the client's new state."""

    delta: dict[str, np.ndarray]
    metrics: dict[str, Scalar]
    state: ClientState


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection to make a reply disappear."""


class MissingPartitionId(PGVIError, ValueError):
    """A node config without ``partition-id`` in a run of several clients."""


def node_partition_id(node_config: Mapping[str, Scalar], num_clients: int) -> int:
    """The node's ``partition-id`` (:func:`whole_number`); required when the run has more than one client, since
    without it a node trained partition 0 whatever its client-id (the PGVI and the FedAvg client both)."""
    if "partition-id" not in node_config and num_clients > 1:
        raise MissingPartitionId(f"node config partition-id is missing: with num-clients={num_clients} each node must "
                                 "say which partition it holds (Flower's simulation sets it; deploy.py, the compose "
                                 "file and docs/edge.md give it)")
    return whole_number(node_config, "partition-id", 0)


def whole_number(node_config: Mapping[str, Scalar], key: str, default: int) -> int:
    """Node config ``key`` as an ``int`` (``default`` when absent): an integer, a float with no fractional part
    (``2.0``) or a string of one (``"2"``), as the train path's ``int(...)`` reads them.

    ``PGVIError`` naming the key otherwise: ``int()`` alone truncated ``1.9`` to 1 and read a TOML bool as 1 / 0,
    so a typo ran another partition without a word."""
    if key not in node_config:
        return default
    raw = node_config[key]
    value: int | None = None
    if isinstance(raw, numbers.Integral) and not isinstance(raw, bool):
        value = int(raw)
    elif isinstance(raw, float) and raw.is_integer():  # False for inf and NaN
        value = int(raw)
    elif isinstance(raw, str):
        try:
            value = int(raw)
        except ValueError:
            value = None
    if value is None:
        bool_note = " (a TOML bool)" if isinstance(raw, bool) else ""
        raise PGVIError(f"node config {key} must be a whole number, got {raw!r}{bool_note}")
    return value


def node_client_id(node_config: Mapping[str, Scalar]) -> str:
    """The node's client id as given: ``client-id``, default ``site-<partition-id>`` (unchecked: see
    :func:`node_run_config`).  No pydantic here: a train message's ClientApp process calls this."""
    if "client-id" in node_config:
        return str(node_config["client-id"])
    return f"site-{whole_number(node_config, 'partition-id', 0)}"


def node_run_config(run_config: dict[str, Scalar], node_config: dict[str, Scalar]) -> tuple[RunConfig, int, str]:
    """The validated run config as this node runs it (node-level ``batch-size``), its partition and client id
    (checked: ``common.protocol.client_id_problem``).

    Every node-level value a train or evaluate message would refuse is refused here, in the identity query before
    round 1, with ``PGVIError`` naming the node-config key: ``partition-id`` and ``num-partitions`` are whole
    numbers, ``num-partitions`` equals ``num-clients``, ``partition-id`` is in ``[0, num-clients)`` (else
    ``common.problem.client_shard`` refuses every message), ``torch-threads`` is a positive whole number (else
    ``common.runtime.configure_threads`` refuses every message).  Otherwise the run went on without the node, one
    WARNING per round."""
    # imported here: the ClientApp process of a train or evaluate message never validates the config (its worker
    # does), and building the pydantic models costs every such process about 6 ms of CPU
    from common.config import MAX_TORCH_THREADS, ConfigError, parse_run_config

    cfg = parse_run_config(dict(run_config))
    partition_id = node_partition_id(node_config, cfg.num_clients)
    if "num-partitions" in node_config and whole_number(node_config, "num-partitions", 0) != cfg.num_clients:
        raise PGVIError(
            f"node config num-partitions={node_config['num-partitions']} disagrees with run config "
            f"num-clients={cfg.num_clients}"
        )
    if not 0 <= partition_id < cfg.num_clients:
        raise PGVIError(f"node config partition-id {partition_id} is outside [0, num-clients={cfg.num_clients})")
    if "torch-threads" in node_config:  # the train path: configure_threads(int(...)), which takes an int >= 1
        raw_threads = node_config["torch-threads"]
        try:
            threads = whole_number(node_config, "torch-threads", 1)
        except PGVIError:
            threads = 0
        if not 1 <= threads <= MAX_TORCH_THREADS:
            raise PGVIError(f"node config torch-threads must be a whole number in [1, {MAX_TORCH_THREADS}], got "
                            f"{raw_threads!r}")
    if "batch-size" in node_config:  # validated like the run config's own key (>= 0; 0 = full batch)
        try:
            cfg = parse_run_config({**cfg.to_flat(), "batch-size": node_config["batch-size"]})
        except ConfigError as err:
            raise PGVIError(f"node config {err}".replace("invalid run config: ", "")) from None
    client_id = node_client_id(node_config)
    # the id keys the server's ledger and checkpoint: a node with an id the server would refuse fails here, in its
    # identity query before round 1, with the reason, instead of never being identified
    from common.protocol import client_id_problem

    if (why := client_id_problem(client_id)) is not None:
        raise PGVIError(f"node config client-id {why}")
    return cfg, partition_id, client_id
