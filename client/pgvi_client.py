"""The PGVI client's computation: ``PGVIClient`` (a NumPyClient) and the two requests a node serves.

This is the torch side of the ClientApp.  ``client/app.py`` turns Flower messages into a plain request
(run config, node config, arrays, message config, the client's state) and hands it either to
:func:`handle` in its own process or to the node's warm compute worker (``client/warm_worker.py``), which
calls the same :func:`handle` with torch, the data shard and the problem already loaded.

``PGVIClient.fit`` receives the posterior's natural parameters (as a list in the order of ``names``),
reconciles its site with the server's ledger, forms the cavity, runs the local GVI step and returns the
damped Delta; ``evaluate`` scores the posterior predictive on the client's local test split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import numpy as np
from flwr.client import NumPyClient

from common import protocol as P
from common.client_state import ClientState
from common.client_update import client_step
from common.config import RunConfig
from common.errors import PGVIError
from common.evaluation import evaluate_posterior
from common.problem import ArraysSplit, Problem, build_problem, client_shard
from common.runtime import configure_threads, subnormals_flushed

from client.node_request import InjectedFault, Request, Result, Scalar, node_run_config


class PGVIClient(NumPyClient):
    """One PGVI client: its data shard, its state (site + pending update) and the shared problem."""

    def __init__(self, problem: Problem, shard: ArraysSplit, client_id: str, state: ClientState,
                 partition_id: int = 0) -> None:
        self.problem = problem
        self.partition_id = partition_id  # selects this client's random stream (common.client_update.local_seed)
        self.shard = shard
        self.client_id = client_id
        self.state = state
        self.names = list(problem.prior.params)
        self.shapes = {k: tuple(v.shape) for k, v in problem.prior.params.items()}
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

    def _site_problem(self, arrays: list[np.ndarray]) -> str | None:
        """Why ``arrays`` are not a site of this problem (the names, in order, with their shapes; finite; the family's
        structure), or None."""
        if len(arrays) != len(self.names):
            return f"it carries {len(arrays)} site arrays named as the model's, expected {len(self.names)}"
        for name, a in zip(self.names, arrays):
            a = np.asarray(a)
            if a.shape != self.shapes[name]:
                return f"site array {name!r} has shape {a.shape}, expected {self.shapes[name]}"
            if not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
                return f"site array {name!r} is not finite floating point"
        try:  # the family's structure too (a full-covariance eta2 must be symmetric): checked before it is adopted
            self.problem.prior.from_numpy(dict(zip(self.names, arrays)))
        except PGVIError as err:
            return f"its site is not one of this family ({err})"
        return None

    def fit(self, parameters: list[np.ndarray], config: dict[str, Scalar]) -> tuple[list[np.ndarray], int, dict[str, Scalar]]:
        """``parameters``: posterior arrays, then (if ``config['has-site']``) the ledger's site arrays."""
        n = len(self.names)
        raw_rho = config.get("rho", self.problem.cfg.rho())
        try:
            rho = float(raw_rho)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            rho = math.nan
        if not (math.isfinite(rho) and 0.0 < rho <= 1.0):  # a bad message: nothing of it is acted on
            return [], 0, self._reply(P.STATUS_FAILED, self.state.version, config,
                                      f"damping rho must be in (0, 1], got {raw_rho!r}")
        ledger_site = None
        if config.get("has-site", False):
            why = self._site_problem(parameters[n:])
            if why is not None:  # never adopt (and save) a broken site: ask for it again, the state is unchanged
                return [], 0, self._reply(P.STATUS_RESYNC, self.state.version, config,
                                          f"the message says has-site but {why}: resend the site")
            ledger_site = dict(zip(self.names, parameters[n:]))
        ledger_tag = config.get(P.SITE_TAG, "")
        ledger_tag = ledger_tag if isinstance(ledger_tag, str) else ""  # "" (an older server): versions decide
        if not self.state.reconcile(int(config.get("site-version", P.UNKNOWN_VERSION)), ledger_site, ledger_tag):
            return [], 0, self._reply(P.STATUS_RESYNC, self.state.version, config, "site does not match the ledger")
        if self.state.site is not None and ledger_site is None:
            # a state-dir reused by a run of another model holds a site of another layout, at a version (0) the
            # ledger matches: every round failed on its shapes and the server never resent it
            stored = self.state.site
            why = (f"it holds arrays {sorted(stored)}, the model has {sorted(self.names)}"
                   if set(stored) != set(self.names) else self._site_problem([stored[k] for k in self.names]))
            if why is not None:
                return [], 0, self._reply(P.STATUS_RESYNC, self.state.version, config,
                                          f"the stored site does not fit this run ({why}): resend the site")
        try:
            posterior = self._factor(parameters[:n])
            site = self.problem.prior.from_numpy(self.state.site) if self.state.site is not None else self.problem.prior.zeros_like()
            res = client_step(self.problem, posterior, site, self.x, self.y, rho, step_seed=self._step_seed(config),
                              stream=self.partition_id)
        except PGVIError as err:
            return [], 0, self._reply(P.STATUS_FAILED, self.state.version, config, f"{type(err).__name__}: {err}")
        tag = self.state.stage(res.new_site.to_numpy())
        delta = res.delta.to_numpy()
        metrics: dict[str, Scalar] = dict(res.metrics)
        metrics.update(self._reply(P.STATUS_OK, self.state.version, config))
        metrics[P.UPDATE_TAG] = tag
        return [delta[k] for k in self.names], len(self.y), metrics

    @staticmethod
    def _step_seed(config: Mapping[str, Scalar]) -> int:
        """The local optimiser's step (``common.client_update.local_seed``): the server round for a client's first
        message of the round, and the round with ``round-message`` (its n-th message of the round, n >= 1: only the
        asynchronous schedule sends a client several) for the others, so that two updates of one client in one
        round (each against another posterior) do not share their Monte Carlo draws.  The first message's step is
        the round, as every message's was before 2026-11-27: synchronous and sequential seeds are unchanged, and an
        asynchronous burst still equals the synchronous run.  A re-executed message gets its seed again."""
        rnd, nth = int(config.get("server-round", 0)), int(config.get(P.ROUND_MESSAGE, 0))
        return rnd if nth == 0 else (rnd << 32) | (nth & 0xFFFFFFFF)

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        q = self._factor(parameters).check_proper("posterior")
        cfg = self.problem.cfg
        m = evaluate_posterior(self.problem, q, self.shard.x_test, self.shard.y_test, cfg.eval_samples, seed=cfg.seed,
                               bin_sums=True)
        return float(m.get("nll", 0.0)), int(m["num-examples"]), dict(m)


# ==================================================================================================
# serving a request


@lru_cache(maxsize=8)
def _problem_and_shard(cfg: RunConfig, partition_id: int) -> tuple[Problem, ArraysSplit]:
    shard = client_shard(cfg, partition_id)
    return build_problem(cfg), shard


def _inject(mode: str, client: PGVIClient, delta: list[np.ndarray]) -> list[np.ndarray]:
    """Corrupt the outgoing Delta; a Byzantine client that is believed also records what it sent."""
    if mode.startswith("scale:") or mode == "flip":
        factor = -1.0 if mode == "flip" else float(mode.split(":", 1)[1])
        delta = [factor * d for d in delta]
        site = client.problem.prior.from_numpy(client.state.site) if client.state.site is not None else client.problem.prior.zeros_like()
        client.state.stage((site * client._factor(delta)).to_numpy(), tag=client.state.pending_tag)  # the reply's tag
    elif mode == "nan":
        delta = [np.full_like(d, np.nan) for d in delta]
    elif mode == "wrong-shape":
        delta = [np.zeros(d.size + 1, dtype=d.dtype) for d in delta]
    elif mode == "improper":
        delta = [d if not k.startswith("eta2") else np.full_like(d, 1e6) for k, d in zip(client.names, delta)]
    elif mode == "huge":
        delta = [np.zeros(50_000_000, dtype=np.float32)] + [d.astype(np.float32) for d in delta[1:]]  # one dtype: packable
    return delta


def handle(req: Request) -> Result:
    """Serve one train or evaluate request; the same code runs in the ClientApp process or in a warm worker.

    ``crash-before-reply`` raises :class:`InjectedFault` before the update is staged, so the returned state
    is never saved; ``lose-reply`` is the caller's (the state is saved, then the reply is lost).
    """
    cfg, partition_id, client_id = node_run_config(req.run_config, req.node_config)
    configure_threads(int(req.node_config.get("torch-threads", cfg.torch_threads or 1)))
    with subnormals_flushed():  # this thread's own mode again afterwards (the caller may be an in-process Grid)
        return _serve(req, cfg, partition_id, client_id)


def _serve(req: Request, cfg: RunConfig, partition_id: int, client_id: str) -> Result:
    problem, shard = _problem_and_shard(cfg, partition_id)
    client = PGVIClient(problem, shard, client_id, req.state, partition_id)
    arrays = [req.posterior[k] for k in client.names]
    if req.kind == "evaluate":
        _, _, metrics = client.evaluate(arrays, req.config)
        return Result({}, metrics, client.state)
    if req.kind != "train":
        raise ValueError(f"unknown request kind {req.kind!r}")
    if req.config.get("has-site"):  # a site without exactly the model's names is none (fit asks for it again)
        site = req.site or {}
        if set(site) == set(client.names):
            arrays += [site[k] for k in client.names]
    delta, _, metrics = client.fit(arrays, req.config)
    if req.fault == "crash-before-reply":
        raise InjectedFault("fault injection: client crashed before staging its update")
    if delta and req.fault:
        delta = _inject(req.fault, client, delta)
    return Result(dict(zip(client.names, delta)), metrics, client.state)
