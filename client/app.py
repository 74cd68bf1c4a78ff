"""PGVI ClientApp: Message-API handlers in front of the NumPyClient ``client.pgvi_client.PGVIClient``.

The ``@app.train()`` / ``@app.evaluate()`` / ``@app.query()`` handlers translate Flower messages (named
arrays in ArrayRecords) to a :class:`client.pgvi_client.Request` and back; the legacy
``ClientApp(client_fn=...)`` route would not receive Message-API records in Flower 1.39.

This module imports no torch: Flower 1.39 starts a new ClientApp process for every message, and the
computation runs either here (``client.pgvi_client`` is imported on the first train/evaluate message) or,
when the node config names one, in the node's warm compute worker (``client/warm_worker.py``), which keeps
torch, the data shard and the problem loaded across messages.

Node config keys: ``partition-id`` (a whole number in ``[0, num-clients)``; required when ``num-clients`` > 1),
``num-partitions`` (if given, equal to the run's ``num-clients``), ``client-id`` (stable id, default ``site-<partition-id>``),
``state-dir`` (durable client state; default: kept in the SuperNode's memory for the run),
``torch-threads`` (a whole number in [1, 1024]; default: the run config's ``torch-threads``, 0 there meaning 1), ``batch-size`` (overrides the run config's, for small devices),
``compute-worker`` (path of the node's warm worker socket; default: compute in the ClientApp process),
``compute-worker-timeout-s`` (how long to wait for the worker's result, default 3600; a positive number of
seconds, at most 30 days: more is surely a typo, and past ~24.8 days one ``poll`` of the socket overflows).
If the worker is unreachable, fails the handshake, or sends no result within that timeout (it is then
presumably hung), the ClientApp logs a warning and computes the message in its own process.

Fault injection, for tests only (node config ``fault``, default off): ``scale:<x>`` and ``flip`` (a Byzantine
client: Delta times x or -1), ``nan``, ``wrong-shape``, ``improper``, ``huge`` (invalid replies the server must
reject), ``lose-reply`` (the client stages its update, then its reply is lost) and ``crash-before-reply`` (the
client dies after computing, before staging).  A mode may be limited to some rounds: ``lose-reply@2``.

The identity query (``query``) checks every node-config value a train or evaluate message would refuse (and an
unknown ``fault`` mode), so a bad node config fails before round 1 with an error naming the key, instead of every
train message failing while the run goes on without the node.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from client import warm_worker
from client.node_request import InjectedFault, Request, Result, node_client_id, node_run_config
from common import protocol as P
from common.client_state import ClientState
from common.errors import PGVIError
from strategies.codec import arrays_to_record, decode_arrays, encode_arrays, layout_key

app = ClientApp()

WORKER_TIMEOUT_KEY = "compute-worker-timeout-s"
#: The fault modes (node config ``fault``, tests only) besides ``scale:<x>``; ``client.pgvi_client`` runs them.
FAULT_MODES = ("flip", "nan", "wrong-shape", "improper", "huge", "lose-reply", "crash-before-reply")


def __getattr__(name: str):  # ``client.app.PGVIClient`` without importing torch at module import
    if name == "PGVIClient":
        from client import pgvi_client

        return getattr(pgvi_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ids(context: Context) -> tuple[str, str | None]:
    nc = context.node_config
    client_id = node_client_id(nc)  # the id node_run_config checks, in the query before round 1
    state_dir = str(nc["state-dir"]) if nc.get("state-dir") else None
    return client_id, state_dir


def _check_state_dir(state_dir: str) -> None:
    """Every train message saves the client's state in ``state_dir``: one that cannot be created or written (a path
    below a file, a directory another user owns) is refused here, in the identity query, naming the key, instead of
    failing every train message while the run goes on without the node."""
    import tempfile

    try:
        os.makedirs(state_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".write-check-"):
            pass
    except OSError as err:
        raise PGVIError(f"node config state-dir {state_dir!r} is not a directory this client can write: "
                        f"{type(err).__name__}: {err.strerror or err}") from None


def _load_state(context: Context, client_id: str, state_dir: str | None) -> ClientState:
    if state_dir:
        return ClientState.load(state_dir, client_id)
    if "pgvi-site" in context.state and "pgvi-meta" in context.state:
        arrays = {k: a.numpy() for k, a in context.state["pgvi-site"].items()}
        return ClientState.from_arrays(arrays, dict(context.state["pgvi-meta"]))
    return ClientState()


def _save_state(context: Context, state: ClientState, client_id: str, state_dir: str | None) -> None:
    if state_dir:
        state.save(state_dir, client_id)
        return
    arrays, meta = state.to_arrays()
    context.state["pgvi-site"] = arrays_to_record(arrays)
    context.state["pgvi-meta"] = ConfigRecord(meta)


def _fault_spec(node_config: Mapping) -> tuple[str, frozenset[int] | None]:
    """Node config ``fault`` as (mode, the rounds it is limited to or None = every round); ('', None) = none.

    ``ValueError`` naming the key unless the mode is one of :data:`FAULT_MODES` or ``scale:<number>`` and the
    rounds after ``@`` are whole numbers >= 1, comma-separated: checked by the query before round 1.  A bad
    round list used to fail every train message, and an unknown mode (``fllip``) or a ``scale:`` without a
    number ran an honest client under the fault's name."""
    spec = str(node_config.get("fault", ""))
    if not spec:
        return "", None
    mode, at, rounds_text = spec.partition("@")
    rounds: frozenset[int] | None = None
    problem = ""
    if at:  # read as the train path always read them: int() of each non-empty comma-separated part
        try:
            rounds = frozenset(int(r) for r in rounds_text.split(",") if r)
        except ValueError:
            rounds = frozenset()
        if not rounds or min(rounds) < 1:  # an empty list or round 0 never fires: an honest client, unnoticed
            problem = "the rounds after '@' must be whole numbers >= 1, comma-separated"
    if mode.startswith("scale:"):
        try:
            float(mode.split(":", 1)[1])
        except ValueError:
            problem = problem or "scale:<x> takes a number x"
    elif mode not in FAULT_MODES:
        problem = problem or f"unknown mode {mode!r}; known: {', '.join(FAULT_MODES)}, scale:<x>"
    if problem:
        raise ValueError(f"node config fault {spec!r}: {problem} (e.g. 'lose-reply@2' or 'scale:10@1,3')")
    return mode, rounds


def _fault_mode(context: Context, server_round: int) -> str:
    """The fault to inject in ``server_round`` ('' = none)."""
    mode, rounds = _fault_spec(context.node_config)
    if rounds is not None and server_round not in rounds:
        return ""
    return mode


def _worker_timeout(node_config: Mapping) -> float:
    """Node config ``compute-worker-timeout-s``: seconds to wait for the warm worker's result (default 3600).

    At most :data:`client.warm_worker.MAX_RESULT_TIMEOUT_S` (30 days): a larger value used to reach the socket
    layer and fail every message with an ``OverflowError``; it is refused here, in the query before round 1."""
    raw = node_config.get(WORKER_TIMEOUT_KEY)
    if raw is None:
        return warm_worker.RESULT_TIMEOUT_S
    try:
        value = float("nan") if isinstance(raw, bool) else float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and 0 < value <= warm_worker.MAX_RESULT_TIMEOUT_S):
        raise ValueError(f"node config {WORKER_TIMEOUT_KEY} must be a positive number of seconds at most "
                         f"{warm_worker.MAX_RESULT_TIMEOUT_S:.0f} (30 days), got {raw!r}")
    return value


def _compute(request: Request, context: Context) -> Result:
    """Run ``request`` in the node's warm worker when one is configured, reachable and answers in time, else here."""
    socket_path = context.node_config.get("compute-worker")
    if socket_path:
        timeout = _worker_timeout(context.node_config)
        try:
            return warm_worker.call(str(socket_path), request, timeout=timeout)
        except warm_worker.WorkerTimeout as err:  # our connection is closed; a late result is discarded
            log(30, "PGVI client: %s; the worker looks hung, computing in the ClientApp process instead", err)
        except warm_worker.WorkerUnavailable as err:
            log(30, "PGVI client: %s; computing in the ClientApp process instead", err)
    from client.pgvi_client import handle

    return handle(request)


def _arrays(msg: Message, config: Mapping, name: str) -> dict:
    """The named arrays of record ``name`` (packed with the layout the config carries, or one Array each)."""
    return decode_arrays(msg.content[name], config.get(layout_key(name)))


def _request(kind: str, msg: Message, context: Context, state: ClientState, fault: str = "") -> Request:
    config = dict(msg.content[P.CONFIG])
    site = None
    if kind == "train" and config.get("has-site") and P.SITE in msg.content:
        site = _arrays(msg, config, P.SITE)
    return Request(kind=kind, run_config=dict(context.run_config), node_config=dict(context.node_config),
                   posterior=_arrays(msg, config, P.POSTERIOR), config=config, site=site, state=state, fault=fault)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Identify: the stable client id and the version of the site this client holds."""
    node_run_config(dict(context.run_config), dict(context.node_config))  # a bad config fails before round 1
    _worker_timeout(context.node_config)
    _fault_spec(context.node_config)
    client_id, state_dir = _ids(context)
    if state_dir:
        _check_state_dir(state_dir)
    state = _load_state(context, client_id, state_dir)
    cfg = ConfigRecord({"client-id": client_id, "site-version": state.version,
                        "pending": state.pending_version is not None})
    return Message(RecordDict({P.CONFIG: cfg}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    client_id, state_dir = _ids(context)
    fault = _fault_mode(context, int(msg.content[P.CONFIG].get("server-round", 0)))
    result = _compute(_request("train", msg, context, _load_state(context, client_id, state_dir), fault), context)
    _save_state(context, result.state, client_id, state_dir)
    if fault == "lose-reply":
        raise InjectedFault("fault injection: reply lost after the client staged its update")
    metrics = result.metrics
    reply_cfg = ConfigRecord({k: v for k, v in metrics.items() if isinstance(v, str) or k.endswith("version")})
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and not k.endswith("version")}
    content = RecordDict({P.CONFIG: reply_cfg, P.METRICS: MetricRecord(numeric)})
    if result.delta:
        content[P.DELTA], reply_cfg[layout_key(P.DELTA)] = encode_arrays(result.delta)
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    result = _compute(_request("evaluate", msg, context, ClientState()), context)
    return Message(RecordDict({P.METRICS: MetricRecord({k: float(v) for k, v in result.metrics.items()})}),
                   reply_to=msg)
