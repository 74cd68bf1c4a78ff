"""The request a PGVI node serves for one train or evaluate message, as plain Python and numpy.

No torch here: ``client/app.py`` (started by Flower for every message) builds a :class:`Request` and either
computes it in its own process or sends it to the node's warm compute worker; both run
``client.pgvi_client.handle``.
"""

from __future__ import annotations

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


def node_run_config(run_config: dict[str, Scalar], node_config: dict[str, Scalar]) -> tuple[RunConfig, int, str]:
    """The validated run config as this node runs it (node-level ``batch-size``), its partition and client id
    (checked: ``strategies.codec.client_id_problem``)."""
    # imported here: the ClientApp process of a train or evaluate message never validates the config (its worker
    # does), and building the pydantic models costs every such process about 6 ms of CPU
    from common.config import ConfigError, parse_run_config

    cfg = parse_run_config(dict(run_config))
    partition_id = int(node_config.get("partition-id", 0))
    if "num-partitions" in node_config and int(node_config["num-partitions"]) != cfg.num_clients:
        raise PGVIError(
            f"node config num-partitions={node_config['num-partitions']} disagrees with run config "
            f"num-clients={cfg.num_clients}"
        )
    if "batch-size" in node_config:  # validated like the run config's own key (>= 0; 0 = full batch)
        try:
            cfg = parse_run_config({**cfg.to_flat(), "batch-size": node_config["batch-size"]})
        except ConfigError as err:
            raise PGVIError(f"node config {err}".replace("invalid run config: ", "")) from None
    client_id = str(node_config.get("client-id", f"site-{partition_id}"))
    # the id keys the server's ledger and checkpoint: a node with an id the server would refuse fails here, in its
    # identity query before round 1, with the reason, instead of never being identified
    from strategies.codec import client_id_problem

    if (why := client_id_problem(client_id)) is not None:
        raise PGVIError(f"node config client-id {why}")
    return cfg, partition_id, client_id
