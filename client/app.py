"""PGVI ClientApp: a NumPyClient behind Message-API handlers.

``PGVIClient.fit`` receives the posterior's natural parameters (as a list in the order of ``names``),
reconciles its site with the server's ledger, forms the cavity, runs the local GVI step and returns the
damped Delta; ``evaluate`` scores the posterior predictive on the client's local test split.

The ``@app.train()`` / ``@app.evaluate()`` / ``@app.query()`` handlers translate Flower messages (named
arrays in ArrayRecords) to those calls; the legacy ``ClientApp(client_fn=...)`` route would not receive
Message-API records in Flower 1.39.

Node config keys: ``partition-id`` (int), ``client-id`` (stable id, default ``site-<partition-id>``),
``state-dir`` (durable client state; default: kept in the SuperNode's memory for the run),
``torch-threads`` (default 1), ``batch-size`` (overrides the run config's, for small devices).

Fault injection, for tests only (node config ``fault``, default off): ``scale:<x>`` and ``flip`` (a Byzantine
client: Delta times x or -1), ``nan``, ``wrong-shape``, ``improper``, ``huge`` (invalid replies the server must
reject), ``lose-reply`` (the client stages its update, then its reply is lost) and ``crash-before-reply`` (the
client dies after computing, before staging).  A mode may be limited to some rounds: ``lose-reply@2``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from common import protocol as P
from common.client_state import ClientState
from common.client_update import client_step
from common.config import RunConfig, parse_run_config
from common.errors import PGVIError
from common.evaluation import evaluate_posterior
from common.problem import ArraysSplit, Problem, build_problem, client_shard
from strategies.codec import arrays_to_record

Scalar = bool | bytes | float | int | str


class PGVIClient(NumPyClient):
    """One PGVI client: its data shard, its state (site + pending update) and the shared problem."""

    def __init__(self, problem: Problem, shard: ArraysSplit, client_id: str, state: ClientState) -> None:
        self.problem = problem
        self.shard = shard
        self.client_id = client_id
        self.state = state
        self.names = list(problem.prior.params)
        self.x, self.y = problem.tensors(shard.x_train, shard.y_train)

    def _factor(self, arrays: list[np.ndarray]):
        if len(arrays) != len(self.names):
            raise PGVIError(f"expected {len(self.names)} arrays, got {len(arrays)}")
        return self.problem.prior.from_numpy(dict(zip(self.names, arrays)))

    def _reply(self, status: str, base: int, config: dict[str, Scalar], reason: str = "") -> dict[str, Scalar]:
        return {
            "client-id": self.client_id,
            "status": status,
            "reason": reason[:500],
            "base-site-version": base,
            "posterior-version": int(config.get("posterior-version", -1)),
        }

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar]) -> tuple[list[np.ndarray], int, dict[str, Scalar]]:
        """``parameters``: posterior arrays, then (if ``config['has-site']``) the ledger's site arrays."""
        n = len(self.names)
        has_site = bool(config.get("has-site", False))
        ledger_site = dict(zip(self.names, parameters[n:])) if has_site else None
        if not self.state.reconcile(int(config.get("site-version", P.UNKNOWN_VERSION)), ledger_site):
            return [], 0, self._reply(P.STATUS_RESYNC, self.state.version, config, "site does not match the ledger")
        try:
            posterior = self._factor(parameters[:n])
            site = self.problem.prior.from_numpy(self.state.site) if self.state.site is not None else self.problem.prior.zeros_like()
            rho = float(config.get("rho", self.problem.cfg.rho()))
            res = client_step(self.problem, posterior, site, self.x, self.y, rho, step_seed=int(config.get("server-round", 0)))
        except PGVIError as err:
            return [], 0, self._reply(P.STATUS_FAILED, self.state.version, config, f"{type(err).__name__}: {err}")
        self.state.stage(res.new_site.to_numpy())
        delta = res.delta.to_numpy()
        metrics: dict[str, Scalar] = dict(res.metrics)
        metrics.update(self._reply(P.STATUS_OK, self.state.version, config))
        return [delta[k] for k in self.names], len(self.y), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        q = self._factor(parameters).check_proper("posterior")
        cfg = self.problem.cfg
        m = evaluate_posterior(self.problem, q, self.shard.x_test, self.shard.y_test, cfg.eval_samples, seed=cfg.seed)
        return float(m.get("nll", 0.0)), int(m["num-examples"]), dict(m)


# ==================================================================================================
# Flower wiring
app = ClientApp()


@lru_cache(maxsize=8)
def _problem_and_shard(cfg: RunConfig, partition_id: int) -> tuple[Problem, ArraysSplit]:
    shard = client_shard(cfg, partition_id)
    return build_problem(cfg), shard


def _node(context: Context) -> tuple[RunConfig, int, str, str | None]:
    cfg = parse_run_config(dict(context.run_config))
    nc = context.node_config
    partition_id = int(nc.get("partition-id", 0))
    if "num-partitions" in nc and int(nc["num-partitions"]) != cfg.num_clients:
        raise PGVIError(
            f"node config num-partitions={nc['num-partitions']} disagrees with run config num-clients={cfg.num_clients}"
        )
    if "batch-size" in nc:
        cfg = cfg.model_copy(update={"batch_size": int(nc["batch-size"])})
    torch.set_num_threads(int(nc.get("torch-threads", cfg.torch_threads or 1)))
    client_id = str(nc.get("client-id", f"site-{partition_id}"))
    state_dir = str(nc["state-dir"]) if nc.get("state-dir") else None
    return cfg, partition_id, client_id, state_dir


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


def _client(context: Context) -> tuple[PGVIClient, str | None]:
    cfg, partition_id, client_id, state_dir = _node(context)
    problem, shard = _problem_and_shard(cfg, partition_id)
    return PGVIClient(problem, shard, client_id, _load_state(context, client_id, state_dir)), state_dir


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Identify: the stable client id and the version of the site this client holds."""
    _, _, client_id, state_dir = _node(context)
    state = _load_state(context, client_id, state_dir)
    cfg = ConfigRecord({"client-id": client_id, "site-version": state.version,
                        "pending": state.pending_version is not None})
    return Message(RecordDict({P.CONFIG: cfg}), reply_to=msg)


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection to make a reply disappear."""


def _fault_mode(context: Context, server_round: int) -> str:
    mode = str(context.node_config.get("fault", ""))
    if "@" in mode:
        mode, rounds = mode.split("@", 1)
        if server_round not in {int(r) for r in rounds.split(",") if r}:
            return ""
    return mode


def _inject(mode: str, client: PGVIClient, delta: list[np.ndarray]) -> list[np.ndarray]:
    """Corrupt the outgoing Delta; a Byzantine client that is believed also records what it sent."""
    if mode.startswith("scale:") or mode == "flip":
        factor = -1.0 if mode == "flip" else float(mode.split(":", 1)[1])
        delta = [factor * d for d in delta]
        site = client.problem.prior.from_numpy(client.state.site) if client.state.site is not None else client.problem.prior.zeros_like()
        client.state.stage((site * client._factor(delta)).to_numpy())
    elif mode == "nan":
        delta = [np.full_like(d, np.nan) for d in delta]
    elif mode == "wrong-shape":
        delta = [np.zeros(d.size + 1, dtype=d.dtype) for d in delta]
    elif mode == "improper":
        delta = [d if not k.startswith("eta2") else np.full_like(d, 1e6) for k, d in zip(client.names, delta)]
    elif mode == "huge":
        delta = [np.zeros(50_000_000, dtype=np.float32)] + delta[1:]
    return delta


@app.train()
def train(msg: Message, context: Context) -> Message:
    client, state_dir = _client(context)
    config = dict(msg.content[P.CONFIG])
    fault = _fault_mode(context, int(config.get("server-round", 0)))
    posterior = msg.content[P.POSTERIOR]
    arrays = [posterior[k].numpy() for k in client.names]
    if config.get("has-site") and P.SITE in msg.content:
        arrays += [msg.content[P.SITE][k].numpy() for k in client.names]
    delta, n, metrics = client.fit(arrays, config)
    if fault == "crash-before-reply":
        raise InjectedFault("fault injection: client crashed before staging its update")
    if delta and fault:
        delta = _inject(fault, client, delta)
    _save_state(context, client.state, client.client_id, state_dir)
    if fault == "lose-reply":
        raise InjectedFault("fault injection: reply lost after the client staged its update")
    reply_cfg = ConfigRecord({k: v for k, v in metrics.items() if isinstance(v, str) or k.endswith("version")})
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and not k.endswith("version")}
    content = RecordDict({P.CONFIG: reply_cfg, P.METRICS: MetricRecord(numeric)})
    if delta:
        content[P.DELTA] = arrays_to_record(dict(zip(client.names, delta)))
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    client, _ = _client(context)
    posterior = msg.content[P.POSTERIOR]
    _, _, metrics = client.evaluate([posterior[k].numpy() for k in client.names], dict(msg.content[P.CONFIG]))
    return Message(RecordDict({P.METRICS: MetricRecord({k: float(v) for k, v in metrics.items()})}), reply_to=msg)
