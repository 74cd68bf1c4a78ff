"""Fault-injection suite on a REAL loopback deployment: SuperLink + SuperNodes as separate OS processes, TLS on.

Usage::

    .venv/bin/python scripts/fault_suite.py [--only SCENARIO ...] [--out DIR] [--rounds 3] [--byz-rounds 2]

Every scenario runs the conjugate Gaussian-location model (``model=gaussian_location``,
``dataset=synthetic_gaussian_location``, ``family=full_covariance``, ``dtype=float64``, ``loss=nll``,
``divergence=kl``, synchronous schedule, ``damping=auto`` = 1/M, ``evaluate-clients=false``) through
``flwr run`` on a :class:`scripts.deploy.Deployment`, and is compared with a fault-free run of the same
config.  Scenarios (``--only`` names).  Groups: ``invalid`` = ``invalid-combined`` + ``invalid-huge``,
``invalid-each`` = the four one-kind ``invalid-<kind>`` runs, ``replies-each`` = ``lose-reply`` +
``crash-before-reply`` (see ``GROUPS``); ``byzantine`` = all six Byzantine runs:

=====================  ==========================================================================================
``baseline``           3 clients, no fault (the reference of every 3-client scenario; always run with them)
``kill-restart-state`` SIGKILL SuperNode 2 in round 2 right after its client staged its update, restart it with
                       its state dir
``kill-restart-wiped`` SIGKILL SuperNode 2 while its round-2 ClientApp runs, restart it with an EMPTY state dir
``lose-reply``         node config ``fault=lose-reply@2`` on node 1 (update staged, reply lost)
``crash-before-reply`` ``fault=crash-before-reply@2`` on node 1 (ClientApp dies before staging)
``serverapp-kill``     SIGKILL the run's ``flwr-serverapp`` process once round 2's checkpoint is on disk, stop the
                       run, then ``flwr run`` again with ``resume=<first run's output dir>``
``reply-faults``       ``lose-reply@2`` on node 1 and ``crash-before-reply@2`` on node 0 in the same run
``invalid-combined``   one invalid kind per round, each on its own node: node 0 ``nan@1``, node 1
                       ``wrong-shape@2``, node 2 ``improper@3``
``invalid-<kind>``     ``fault=<kind>@2`` on node 1, kind in nan, wrong-shape, improper, huge
``byzantine``          10 honest + 1 Byzantine client (node 10, ``fault=scale:10`` or ``flip`` in every round),
                       aggregator ``sum`` and ``median``, plus the honest runs with both aggregators
=====================  ==========================================================================================

Checks per run (all read from the run's records and the nodes' state dirs, never from the live strategy):

* posterior vs the fault-free run: max |natural-parameter difference| (must be <= 1e-6 where the fault does not
  change which updates are applied: ``serverapp-kill``); otherwise vs the closed form
  ``strategies.reference.expected_posterior(cfg, ledger_versions)`` (<= 1e-6);
* the ledger identity ``posterior == prior * prod(sites.npz)`` and, for honest clients under ``sum``, each
  ledger site equals its closed form ``(1 - (1 - rho)^k) e_m`` with ``k`` its ledger version;
* each client's own site: ``ClientState.load(<node state dir>, client_id)`` reconciled with the ledger
  version (and the ledger site if the server's final checkpoint marks the client for resync), exactly as the
  next message would do, must equal its site in ``sites.npz``;
* updates lost: a client whose committed (acknowledged) version is ahead of the ledger, or whose site cannot
  be reconciled, or updates the server counted as applied that are not in the ledger: must be 0;
* updates double-applied: ledger versions beyond the accepted replies (sum of the per-round ``applied``
  counters) or beyond the number of rounds in which the client could have delivered an update: must be 0;
* bad replies (invalid-reply scenarios): replies the fault injection corrupted vs the server's rejections of
  that client in that round: must be 100 %.

Duplicate delivery cannot be produced by a real SuperNode (each message is pulled once and answered once);
it is covered in process by ``tests/test_inprocess.py::test_faulty_reply_never_corrupts_the_posterior[duplicate]``.

Infrastructure: a shared 2-core machine.  Before each run the suite waits (bounded) for the 1-minute load
average to drop below ``--max-load``; each run's logs are scanned for Flower-side symptoms of CPU starvation
(``Runtime task-token authentication failed``: a ClientApp that did not start within Flower's 30 s task-claim
window; ``database is locked``: a SuperLink SQLite timeout answered with HTTP 500).  A run that failed with
such a symptom is marked ``INFRA`` and its scenario is retried once (``--retries``).

Writes ``<out>/results.json`` and ``<out>/table.md``; stops every process it started (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from common.atomic_io import load_npz  # noqa: E402
from common.client_state import ClientState  # noqa: E402
from common.config import RunConfig, parse_run_config  # noqa: E402
from common.families import GaussianFactor  # noqa: E402
from common.problem import build_problem  # noqa: E402
from scripts.arg_types import int_at_least, number_above  # noqa: E402
from scripts.deploy import Deployment, RunResult, free_port_kwargs  # noqa: E402
from scripts.remove_tree import remove_tree  # noqa: E402
from scripts.stop_signals import STOP_SIGNALS, raise_interrupt, signal_handlers  # noqa: E402
from strategies.checkpoint import CHECKPOINT_FILE  # noqa: E402
from strategies.reference import exact_sites, expected_posterior, max_natural_diff  # noqa: E402

TOL = 1e-6
KILLED_NODE = 2  # SuperNode killed in the kill scenarios
INVALID_KINDS = ("nan", "wrong-shape", "improper", "huge")
BYZ_ATTACKS = ("scale:10", "flip")
BYZ_AGGREGATORS = ("sum", "median")
#: reply-fault scenarios: {node index: "mode@rounds"}; every listed fault keeps that node's update of those
#: rounds out of the ledger.  The combined ones put each kind on its own node (client/app.py takes one mode a node).
REPLY_PLANS: dict[str, dict[int, str]] = {
    "reply-faults": {1: "lose-reply@2", 0: "crash-before-reply@2"},
    "lose-reply": {1: "lose-reply@2"},
    "crash-before-reply": {1: "crash-before-reply@2"},
    "invalid-combined": {0: "nan@1", 1: "wrong-shape@2", 2: "improper@3"},
    **{f"invalid-{k}": {1: f"{k}@2"} for k in INVALID_KINDS},
}
#: Rounds the kill scenarios run beyond ``--rounds`` (see ``scen_kill``).
KILL_EXTRA_ROUNDS = 3
THREE_NODE = ("kill-restart-state", "kill-restart-wiped", "serverapp-kill", *REPLY_PLANS)
ALL = ("baseline", *THREE_NODE, "byzantine")
DEFAULT = ("baseline", "reply-faults", "invalid-combined", "invalid-huge", "serverapp-kill", "kill-restart-state",
           "kill-restart-wiped", "byzantine")  # fmt: skip
GROUPS = {
    "invalid": ("invalid-combined", "invalid-huge"),
    "invalid-each": tuple(f"invalid-{k}" for k in INVALID_KINDS),
    "replies-each": ("lose-reply", "crash-before-reply"),
}

MODEL_RUN: dict[str, Any] = {
    "model": "gaussian_location",
    "dataset": "synthetic_gaussian_location",
    "family": "full_covariance",
    "dtype": "float64",
    "loss": "nll",
    "divergence": "kl",
    "schedule": "synchronous",
    "damping": "auto",
    "evaluate-clients": False,
    "checkpoint": True,
    "eval-samples": 50,
}

_INFRA_PATTERNS = {
    "task-token-expired": re.compile(r"Runtime task-token authentication failed"),
    "sqlite-locked": re.compile(r"database is locked"),
    "http-500": re.compile(r"500 Internal Server Error"),
    "grpc-internal": re.compile(r"StatusCode\.INTERNAL"),
}
_FAULT_FAILURE = re.compile(r"round (\d+): client '([^']+)' failed: .*fault injection")
_ANY_FAILURE = re.compile(r"round (\d+): client '([^']+)' (?:failed|could not update): (.*)")
_TIMEOUT = re.compile(r"round (\d+): (\d+) client\(s\) did not reply in time")


def _now() -> str:
    return time.strftime("%H:%M:%S")


def say(msg: str) -> None:
    """A progress line on stdout; never raises (after SIGHUP the terminal may be gone: a write to it fails with
    EIO, which must not keep the suite from stopping its deployments and writing its results)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"[{_now()} load {os.getloadavg()[0]:5.1f}] {msg}", flush=True)


# ======================================================================================================
# records of one run


@dataclasses.dataclass
class RunRecord:
    """What one ``flwr run`` left behind, read back from disk."""

    label: str
    result: RunResult | None
    out_dir: Path | None  # <output-dir>/run-<id>
    cfg: RunConfig
    posterior: dict[str, np.ndarray] | None = None
    sites: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    checkpoint_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, float]] = dataclasses.field(default_factory=list)  # metrics.jsonl
    infra: dict[str, int] = dataclasses.field(default_factory=dict)
    fault_failures: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    other_failures: list[str] = dataclasses.field(default_factory=list)  # failures the suite did not inject
    max_load: float = 0.0

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok and self.posterior is not None

    @property
    def ledger(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.summary.get("ledger-versions", {}).items()}

    @property
    def rejections(self) -> list[dict[str, Any]]:
        return list(self.summary.get("rejections", []))

    @property
    def resync(self) -> set[str]:
        return set(self.checkpoint_meta.get("resync", []))

    def describe_failure(self) -> str:
        if self.result is None:
            return "no result"
        infra = ", ".join(f"{k}={v}" for k, v in self.infra.items() if v)
        return f"status={self.result.status} details={self.result.details[:300]!r}" + (f" infra[{infra}]" if infra else "")


def _read_run(label: str, cfg: RunConfig, result: RunResult | None, base_out: Path) -> RunRecord:
    out_dir = None
    if result is not None and result.run_id is not None:
        cand = base_out / f"run-{result.run_id}"
        out_dir = cand if cand.exists() else None
    rec = RunRecord(label, result, out_dir, cfg)
    if out_dir is None:
        return rec
    if (out_dir / "posterior.npz").exists():
        with np.load(out_dir / "posterior.npz") as z:
            rec.posterior = {k: z[k] for k in z.files}
    if (out_dir / "sites.npz").exists():
        with np.load(out_dir / "sites.npz") as z:
            for key in z.files:
                cid, param = key.split("|", 1)
                rec.sites.setdefault(cid, {})[param] = z[key]
    if (out_dir / "summary.json").exists():
        rec.summary = json.loads((out_dir / "summary.json").read_text())
    if (out_dir / CHECKPOINT_FILE).exists():
        _, rec.checkpoint_meta = load_npz(out_dir / CHECKPOINT_FILE)
    if (out_dir / "metrics.jsonl").exists():
        rec.rows = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return rec


class LogWindow:
    """Byte offsets of a deployment's log files, to scan only what one run wrote."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.offsets = {p: p.stat().st_size for p in dep.logs_dir.glob("*.log")}

    def text(self, name_glob: str = "*.log") -> str:
        chunks = []
        for p in sorted(self.dep.logs_dir.glob(name_glob)):
            with open(p, "rb") as fh:
                fh.seek(self.offsets.get(p, 0))
                chunks.append(fh.read().decode(errors="replace"))
        return "\n".join(chunks)


def _scan_infra(window: LogWindow, run_log: Path | None) -> dict[str, int]:
    text = window.text()
    if run_log is not None and run_log.exists() and run_log not in window.offsets:
        text += run_log.read_text(errors="replace")
    return {k: len(p.findall(text)) for k, p in _INFRA_PATTERNS.items()}


# ======================================================================================================
# running

APP_PARTS = ("pyproject.toml", "README.md", "common", "strategies", "client", "server")


def snapshot_app(dest: Path) -> tuple[Path, str]:
    """Copy the Flower app (pyproject + packages) to ``dest``: every run of the suite ships the same code even
    if the working tree changes meanwhile.  Returns the copy and a SHA-256 over its files."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for part in APP_PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dest / part)
    # the copy holds none of the paths pyproject's fab-exclude names (docs/, scripts/, tests/, ...), and Flower
    # 1.39 refuses to build a FAB with a pattern that matches nothing: drop the key from the copy
    pyproject = dest / "pyproject.toml"
    text, n = re.subn(r"(?m)^fab-exclude\s*=\s*\[[^\]]*\]\s*\n", "", pyproject.read_text())
    if n > 1:
        raise RuntimeError(f"{pyproject}: {n} fab-exclude keys")
    pyproject.write_text(text)
    digest = hashlib.sha256()
    for f in sorted(dest.rglob("*")):
        if f.is_file():
            digest.update(str(f.relative_to(dest)).encode() + b"\0" + f.read_bytes())
    return dest, digest.hexdigest()


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.rounds = args.rounds
        self.byz_rounds = args.byz_rounds
        self.results: list[dict[str, Any]] = []
        self.deployments: list[Deployment] = []
        self.baseline: RunRecord | None = None
        self.app_dir, self.app_sha = snapshot_app(self.out / "app")

    # ---------------------------------------------------------------------------------- plumbing
    def run_config(self, n: int, rounds: int, **extra: Any) -> dict[str, Any]:
        return {
            **MODEL_RUN,
            "num-clients": n,
            "min-clients": n,
            "num-server-rounds": rounds,
            "round-timeout-s": self.args.round_timeout,
            "wait-for-clients-s": self.args.wait_for_clients,
            "seed": 0,
            **extra,
        }

    @contextlib.contextmanager
    def deployment(self, n: int) -> Iterator[Deployment]:
        run_dir = self.out / f"deploy-{n}"
        shutil.rmtree(run_dir, ignore_errors=True)
        dep = Deployment(n, run_dir=run_dir, app_dir=self.app_dir, superexec_poll_interval=self.args.poll_interval,
                         node_config={"torch-threads": 1}, superlink_state=self.args.superlink_state,
                         **free_port_kwargs(n))  # fmt: skip
        self.deployments.append(dep)
        try:
            say(f"starting SuperLink + {n} SuperNodes (TLS) in {run_dir}")
            dep.start()
            dep.wait_online(timeout=600)
            say(f"{n} SuperNodes online")
            yield dep
        finally:
            self._stop(dep)

    def _stop(self, dep: Deployment) -> None:
        if dep not in self.deployments:
            return
        # a second Ctrl-C / SIGTERM / SIGHUP must not cut the stop short (it takes < ~20 s): a process that ignores
        # SIGTERM would be left running without its SIGKILL
        with signal_handlers(signal.SIG_IGN, (signal.SIGINT, *STOP_SIGNALS)):
            killed = dep.stop()
        left = dep.leftover_processes()
        say(f"deployment {dep.run_dir.name} stopped; stray processes killed by marker: {len(killed)}, left: {len(left)}")
        self.deployments.remove(dep)

    def wait_load(self) -> None:
        deadline = time.monotonic() + self.args.load_wait
        if os.getloadavg()[0] < self.args.max_load:
            return
        say(f"load above {self.args.max_load}: waiting up to {self.args.load_wait:.0f}s before the next run")
        while os.getloadavg()[0] >= self.args.max_load and time.monotonic() < deadline:
            time.sleep(5)

    def wait_idle(self, dep: Deployment, timeout: float = 90.0) -> bool:
        """Until no ClientApp/ServerApp process of this deployment runs (state files are quiet).  A ClientApp
        whose task token expired before it pulled its message hangs until its node stops (Flower 1.39); it never
        touches the state, hence the bounded wait."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = [c for _, c in dep.leftover_processes() if "flwr-clientapp" in c or "flwr-serverapp" in c]
            if not busy:
                return True
            time.sleep(0.5)
        return False

    def ensure_online(self, dep: Deployment) -> None:
        """Restart SuperNodes the SuperLink no longer lists as online (Flower 1.39: one INTERNAL error from a
        locked SuperLink database can end a node's heartbeat thread while its process lives on)."""
        try:
            online = {r["node-id"] for r in dep.list_nodes() if r.get("status") == "online"}
        except Exception as err:  # noqa: BLE001 - the CLI itself may time out on a loaded machine
            say(f"could not list nodes ({err}); not checking")
            return
        for k in range(dep.num_nodes):
            if dep.node_ids.get(k) not in online:
                say(f"SuperNode {k} is not online at the SuperLink: restarting it")
                dep.restart_node(k, timeout=300)

    def fresh_states(self, dep: Deployment) -> None:
        self.wait_idle(dep)
        for k in range(dep.num_nodes):
            dep.wipe_node_state(k)

    def set_faults(self, dep: Deployment, plan: dict[int, str]) -> None:
        for k in range(dep.num_nodes):
            self.set_fault(dep, k, plan.get(k))

    def set_fault(self, dep: Deployment, k: int, fault: str | None) -> None:
        """Restart node ``k`` only if its ``fault`` entry changes (SIGTERM restart: immediate without auth)."""
        want = {"fault": fault} if fault else {}
        if dep.node_configs.get(k, {}) == want:
            return
        say(f"restarting SuperNode {k} with node config {want or '(no fault)'}")
        self.wait_idle(dep)
        dep.restart_node(k, timeout=300, node_config=want)

    def launch(
        self,
        dep: Deployment,
        label: str,
        raw: dict[str, Any],
        base_out: Path,
        during: Callable[[Path, threading.Thread], dict[str, Any]] | None = None,
        timeout: float | None = None,
    ) -> tuple[RunRecord, dict[str, Any]]:
        """``flwr run`` in a thread; ``during(base_out, thread)`` acts while it runs; read the records back."""
        self.wait_load()
        remove_tree(base_out)  # no records of an earlier attempt (retried while its last processes exit)
        base_out.mkdir(parents=True, exist_ok=True)
        raw = {**raw, "output-dir": str(base_out)}
        cfg = parse_run_config(raw)
        window = LogWindow(dep)
        box: dict[str, Any] = {}
        t0 = time.monotonic()

        def target() -> None:
            try:
                box["result"] = dep.run_app(raw, timeout=timeout or self.args.run_timeout)
            except BaseException as err:  # noqa: BLE001 - reported, never swallowed
                box["error"] = err

        say(f"run {label}: flwr run ({cfg.num_clients} clients, {cfg.num_server_rounds} rounds)")
        worker = threading.Thread(target=target, name=f"run-{label}", daemon=True)
        worker.start()
        max_load = os.getloadavg()[0]
        info: dict[str, Any] = {}
        if during is not None:
            info = during(base_out, worker)
        while worker.is_alive():
            worker.join(timeout=2.0)
            max_load = max(max_load, os.getloadavg()[0])
        if "error" in box:
            raise box["error"]
        result: RunResult = box["result"]
        cli_early = 0
        if result.run_id is not None and not result.status.startswith("finished"):
            # `flwr run --stream` can exit while the run goes on (its log stream got an HTTP 500 from a locked
            # SuperLink database): wait for the run itself, stop it at the run timeout -- never start the next
            # run while this one can still touch the clients' state
            cli_early = 1
            say(f"run {label}: flwr CLI exited with the run still {result.status}; waiting for the run itself")
            result = self._wait_finished(dep, result, deadline=t0 + (timeout or self.args.run_timeout))
        rec = _read_run(label, cfg, result, base_out)
        rec.max_load = max_load
        rec.infra = _scan_infra(window, result.log_path)
        rec.infra["cli-stream-ended-early"] = cli_early
        run_log = result.log_path.read_text(errors="replace") if result.log_path.exists() else ""
        rec.fault_failures = [(int(r), c) for r, c in _FAULT_FAILURE.findall(run_log)]
        clean = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", run_log)
        rec.other_failures = [f"round {r}: '{c}' failed: {why.strip()[:200]}" for r, c, why in _ANY_FAILURE.findall(clean)
                              if "fault injection" not in why]  # fmt: skip
        rec.other_failures += [f"round {r}: {n} client(s) timed out" for r, n in _TIMEOUT.findall(clean)]
        say(f"run {label}: {result.status} in {time.monotonic() - t0:.0f}s, ledger {rec.ledger}, "
            f"rejections {len(rec.rejections)}" + ("" if rec.ok else f" -- {rec.describe_failure()}"))  # fmt: skip
        return rec, info

    def _wait_finished(self, dep: Deployment, result: RunResult, deadline: float) -> RunResult:
        status, info = result.status, dict(result.info)
        stopped = False
        while not status.startswith("finished"):
            if time.monotonic() > deadline and not stopped:
                say(f"run {result.run_id} still {status} at the run timeout: flwr stop")
                dep.flwr("stop", str(result.run_id), dep.connection, check=False, timeout=120)
                stopped, deadline = True, time.monotonic() + 120
            elif stopped and time.monotonic() > deadline:
                break
            time.sleep(5)
            with contextlib.suppress(Exception):
                info = dep.run_info(result.run_id)
                status = str(info.get("status", status))
        return dataclasses.replace(result, status=status, details=str(info.get("status-details", "")), info=info)

    # ---------------------------------------------------------------------------------- analysis
    def analyse(
        self,
        dep: Deployment,
        rec: RunRecord,
        *,
        reference: RunRecord | None,
        require_equal_to_reference: bool,
        closed_form: bool = True,
        honest_sum_clients: Sequence[str] | None = None,
        max_accepts: dict[str, int] | None = None,
        bad_plan: dict[str, list[int]] | None = None,
        check_clients: bool = True,
        earlier_rows: Sequence[dict[str, float]] = (),
    ) -> dict[str, Any]:
        """All checks of one finished run; returns a dict with ``problems`` (empty = PASS)."""
        out: dict[str, Any] = {"run-id": rec.result.run_id if rec.result else None, "problems": []}
        problems: list[str] = out["problems"]
        if not rec.ok:
            problems.append(f"run did not complete: {rec.describe_failure()}")
            return out
        cfg = rec.cfg
        problem = build_problem(cfg)
        prior = problem.prior
        post = prior.from_numpy(rec.posterior)
        ledger = rec.ledger
        out["ledger"] = ledger
        out["rejections"] = rec.rejections
        out["max-load"] = round(rec.max_load, 1)
        out["infra"] = {k: v for k, v in rec.infra.items() if v}

        # posterior vs the fault-free run
        if reference is not None and reference.ok:
            d = max(float(np.max(np.abs(rec.posterior[k] - reference.posterior[k]))) for k in rec.posterior)
            out["diff-vs-fault-free"] = d
            if require_equal_to_reference and not d <= TOL:
                problems.append(f"posterior differs from the fault-free run by {d:.3g} > {TOL}")
        # posterior vs the closed form of the ledger's update counts
        if closed_form:
            expected = expected_posterior(cfg, ledger)
            d = max_natural_diff(post, expected)
            out["diff-vs-closed-form"] = d
            if not d <= TOL:
                problems.append(f"posterior differs from expected_posterior(ledger) by {d:.3g} > {TOL}")
        # ledger identity: posterior == prior * prod(sites)
        sites = {cid: prior.from_numpy(arrs) for cid, arrs in rec.sites.items()}
        prod = prior
        for s in sites.values():
            prod = prod * s
        d = max_natural_diff(post, prod)
        out["ledger-identity"] = d
        if not d <= TOL:
            problems.append(f"posterior != prior * prod(ledger sites): {d:.3g}")
        # each honest client's ledger site vs its closed form (1 - (1-rho)^k) e_m
        if honest_sum_clients:
            rho = cfg.rho()
            exact = exact_sites(cfg)
            worst = 0.0
            for cid in honest_sum_clients:
                k = ledger.get(cid, 0)
                want = exact[cid] ** (1.0 - (1.0 - rho) ** k)
                worst = max(worst, max_natural_diff(sites.get(cid, prior.zeros_like()), want))
            out["sites-vs-closed-form"] = worst
            if not worst <= TOL:
                problems.append(f"a ledger site differs from its closed form by {worst:.3g}")

        # clients' own sites vs the ledger; updates lost
        lost = 0
        client_rows = {}
        if check_clients:
            resync = rec.resync
            worst = 0.0
            for k in range(dep.num_nodes):
                cid = dep.node_name(k)
                st = ClientState.load(dep.node_state_dir(k), cid)
                before = {"version": st.version, "pending": st.pending_version}
                lv = ledger.get(cid, 0)
                ledger_site = rec.sites.get(cid)
                if st.version > lv:  # the client was told its update was applied; the ledger does not have it
                    lost += st.version - lv
                ok = st.reconcile(lv, ledger_site if cid in resync else None)
                if not ok:
                    lost += 1
                    client_rows[cid] = {**before, "ledger": lv, "reconciled": False}
                    problems.append(f"{cid}: client state {before} cannot be reconciled with ledger version {lv}")
                    continue
                mine = prior.from_numpy(st.site) if st.site is not None else prior.zeros_like()
                theirs = prior.from_numpy(ledger_site) if ledger_site is not None else prior.zeros_like()
                diff = max_natural_diff(mine, theirs)
                worst = max(worst, diff)
                client_rows[cid] = {**before, "ledger": lv, "resync": cid in resync, "site-diff": diff}
                if not diff <= 1e-9:
                    problems.append(f"{cid}: client site differs from the ledger site by {diff:.3g}")
            out["client-vs-ledger"] = worst
            out["clients"] = client_rows
        # accepted replies: the per-round `applied` counters (metrics.jsonl; a resumed run adds the rows of the
        # rounds its predecessor completed), counted apart from the ledger
        rows = [*earlier_rows, *rec.rows]
        applied_rounds = sum(int(r.get("applied", 0)) for r in rows if r.get("round", 0) >= 1)
        total_ledger = sum(ledger.values())
        lost += max(0, applied_rounds - total_ledger)
        double = max(0, total_ledger - applied_rounds)
        if max_accepts is not None:
            for cid, v in ledger.items():
                double += max(0, v - max_accepts.get(cid, 0))
        out["accepted-replies"] = applied_rounds
        out["updates-lost"] = lost
        out["double-applied"] = double
        if lost:
            problems.append(f"{lost} update(s) lost")
        if double:
            problems.append(f"{double} update(s) double-applied")

        # bad replies rejected / sent
        if bad_plan is not None:
            sent = rejected = 0
            for cid, rounds in bad_plan.items():
                for r in rounds:
                    sent += 1
                    if any(x["client-id"] == cid and int(x["round"]) == r for x in rec.rejections):
                        rejected += 1
            out["bad-sent"], out["bad-rejected"] = sent, rejected
            if rejected != sent:
                problems.append(f"only {rejected}/{sent} bad replies rejected")
        return out

    @staticmethod
    def check_ledger(rec: RunRecord, planned: dict[str, int], analysis: dict[str, Any], notes: list[str],
                     allowed_extra_failures: int = 0) -> None:  # fmt: skip
        """The ledger must equal ``planned`` unless the shortfall is explained by failed messages the suite did
        not inject (starvation on this shared machine, reported as notes); more than planned is a problem."""
        ledger = rec.ledger
        over = {c: v for c, v in ledger.items() if v > planned.get(c, 0)}
        short = sum(max(0, n - ledger.get(c, 0)) for c, n in planned.items())
        if over:
            analysis["problems"].append(f"ledger {ledger} exceeds the plan {planned}")
        if short == 0:
            return
        if short <= len(rec.other_failures) - allowed_extra_failures:
            notes.append(f"ledger {ledger} vs plan {planned}: {short} update(s) missing because of failures the suite "
                         f"did not inject: {'; '.join(rec.other_failures)}")  # fmt: skip
        else:
            analysis["problems"].append(f"ledger {ledger} is not {planned} (failures not injected by the suite: "
                                        f"{rec.other_failures or 'none'})")  # fmt: skip

    def record(self, name: str, faults: dict[str, int], analysis: dict[str, Any], notes: list[str] | None = None,
               status: str | None = None) -> dict[str, Any]:  # fmt: skip
        row = {
            "scenario": name,
            "status": status or ("PASS" if not analysis.get("problems") else "FAIL"),
            "faults": faults,
            **analysis,
            "notes": notes or [],
        }
        self.results.append(row)
        say(f"== {name}: {row['status']}" + (f" -- {'; '.join(analysis['problems'])}" if analysis.get("problems") else ""))
        self.write()
        return row

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "table.md").write_text(render_table(self.results))

    # ---------------------------------------------------------------------------------- scenarios
    def with_retry(self, name: str, fn: Callable[[], tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Run a scenario; an INFRA failure (run failed with a Flower starvation symptom) is retried."""
        for attempt in range(self.args.retries + 1):
            faults, analysis, *rest = fn()
            notes = rest[0] if rest else []
            infra = analysis.get("infra") or {}
            failed_run = any(p.startswith(("run did not complete", "the fault-free reference run had failures"))
                             for p in analysis.get("problems", []))  # fmt: skip
            if failed_run and any(infra.values()) and attempt < self.args.retries:
                self.record(name, faults, analysis, notes + [f"attempt {attempt + 1}: infrastructure failure, retried"],
                            status="INFRA")  # fmt: skip
                continue
            status = "INFRA" if failed_run and any(infra.values()) else None
            self.record(name, faults, analysis, notes, status=status)
            return

    def scen_baseline(self, dep: Deployment) -> tuple[dict, dict, list]:
        self.set_faults(dep, {})
        self.fresh_states(dep)
        rec, _ = self.launch(dep, "baseline", self.run_config(3, self.rounds), self.out / "baseline")
        self.baseline = rec if rec.ok else None
        cids = [dep.node_name(k) for k in range(3)]
        analysis = self.analyse(dep, rec, reference=None, require_equal_to_reference=False, honest_sum_clients=cids,
                                max_accepts={c: self.rounds for c in cids})  # fmt: skip
        notes: list[str] = []
        if rec.ok:
            self.check_ledger(rec, {c: self.rounds for c in cids}, analysis, notes)
            if notes:  # the reference must be fault-free: retry it
                analysis["problems"].append("the fault-free reference run had failures")
                analysis["infra"] = {**analysis.get("infra", {}), "reference-had-failures": 1}
        return {}, analysis, notes

    def _kill_node_during(self, dep: Deployment, wipe: bool) -> Callable[[Path, threading.Thread], dict[str, Any]]:
        k = KILLED_NODE
        cid = dep.node_name(k)
        port = dep.node_ports[k]
        state_file = ClientState.path_for(dep.node_state_dir(k), cid)

        def during(base_out: Path, worker: threading.Thread) -> dict[str, Any]:
            info: dict[str, Any] = {}
            deadline = time.monotonic() + self.args.run_timeout
            # 1. round 1 recorded -> round 2 is under way
            while worker.is_alive() and time.monotonic() < deadline:
                rows = [ln for f in base_out.glob("run-*/metrics.jsonl") for ln in f.read_text().splitlines() if ln]
                if any(json.loads(ln)["round"] >= 1 for ln in rows):
                    break
                time.sleep(0.2)
            # 2. the trigger: (state) the client staged its round-2 update; (wiped) its ClientApp is running
            trigger = "staged" if not wipe else "clientapp-running"
            while worker.is_alive() and time.monotonic() < deadline:
                if wipe:
                    if any(f"127.0.0.1:{port} " in c + " " and "flwr-clientapp" in c for _, c in dep.leftover_processes()):
                        break
                    time.sleep(0.15)
                else:
                    with contextlib.suppress(Exception):
                        if state_file.exists() and ClientState.load(dep.node_state_dir(k), cid).pending_version == 2:
                            break
                time.sleep(0.05)
            if not worker.is_alive():
                info["kill"] = "run ended before the trigger"
                return info
            st = ClientState.load(dep.node_state_dir(k), cid)
            dep.kill_node(k, signal.SIGKILL)
            info.update(trigger=trigger, killed_at=_now(),
                        state_at_kill={"version": st.version, "pending": st.pending_version})  # fmt: skip
            say(f"SIGKILLed SuperNode {k} ({trigger}; client state version {st.version}, pending {st.pending_version})")
            dep.restart_node(k, timeout=300, wipe_state=wipe)
            info["restarted_at"] = _now()
            say(f"SuperNode {k} restarted {'with an EMPTY' if wipe else 'with its'} state dir and online")
            return info

        return during

    def scen_kill(self, dep: Deployment, wipe: bool) -> tuple[dict, dict, list]:
        name = "kill-restart-wiped" if wipe else "kill-restart-state"
        self.set_faults(dep, {})
        self.fresh_states(dep)
        # With SuperNode authentication the SIGKILLed node can restart only once the SuperLink has marked its old
        # session offline (about 60 s), which is also when the SuperLink fails its round-2 message: round 3
        # then starts at once, before the restarted node is online.  The extra rounds give the restarted node
        # rounds to rejoin, so that its recovery (rollback, or resync of a wiped state) is what gets checked.
        rounds = self.rounds + KILL_EXTRA_ROUNDS
        rec, info = self.launch(dep, name, self.run_config(3, rounds), self.out / name,
                                during=self._kill_node_during(dep, wipe))  # fmt: skip
        cids = [dep.node_name(k) for k in range(3)]
        killed = dep.node_name(KILLED_NODE)
        analysis = self.analyse(dep, rec, reference=self.baseline, require_equal_to_reference=False,
                                honest_sum_clients=cids, max_accepts={c: rounds for c in cids})  # fmt: skip
        analysis["kill"] = info
        notes = []
        if rec.ok:
            lv = rec.ledger.get(killed, 0)
            notes.append(f"{killed} ended with {lv}/{rounds} updates applied (killed in round 2: "
                         f"{'its round-2 reply reached the server before the kill' if lv == rounds else 'its round-2 update was not applied'})")  # fmt: skip
            if lv <= 1:
                analysis["problems"].append(f"{killed} did not rejoin after its restart ({lv} updates applied in {rounds} "
                                            "rounds): its recovery was not exercised")  # fmt: skip
            planned = {c: rounds for c in cids if c != killed}
            planned[killed] = lv  # timing decides whether its round-2 update was applied (checked by the oracles)
            # the killed node's round-2 message fails (node unavailable / timeout): one failure the suite caused
            self.check_ledger(rec, planned, analysis, notes, allowed_extra_failures=1)
            if "state_at_kill" not in info:
                analysis["problems"].append(f"kill not performed: {info.get('kill')}")
        return {"supernode-sigkill": 1 if "state_at_kill" in info else 0}, analysis, notes

    def scen_reply_faults(self, dep: Deployment, name: str) -> tuple[dict, dict, list]:
        """Node-config faults (lose-reply, crash-before-reply, invalid replies) per :data:`REPLY_PLANS`."""
        plan = REPLY_PLANS[name]
        self.set_faults(dep, plan)
        self.fresh_states(dep)
        rec, _ = self.launch(dep, name, self.run_config(3, self.rounds), self.out / name)
        cids = [dep.node_name(k) for k in range(3)]
        parsed = {dep.node_name(k): (spec.split("@")[0], [int(r) for r in spec.split("@")[1].split(",")])
                  for k, spec in plan.items()}  # fmt: skip
        expected_ledger = {c: self.rounds - len(parsed[c][1]) if c in parsed else self.rounds for c in cids}
        bad_plan = {c: rs for c, (kind, rs) in parsed.items() if kind in INVALID_KINDS}
        analysis = self.analyse(
            dep, rec, reference=self.baseline, require_equal_to_reference=False, honest_sum_clients=cids,
            max_accepts=expected_ledger, bad_plan=bad_plan or None,
        )  # fmt: skip
        faults: dict[str, int] = {}
        notes = ["node config fault: " + ", ".join(f"{c} {k}@{','.join(map(str, rs))}" for c, (k, rs) in parsed.items())]
        if not rec.ok:
            return {kind: 0 for kind, _ in parsed.values()}, analysis, notes
        self.check_ledger(rec, expected_ledger, analysis, notes)
        for cid, (kind, rs) in parsed.items():
            if kind in INVALID_KINDS:
                hits = [x for x in rec.rejections if x["client-id"] == cid and int(x["round"]) in rs]
                faults[kind] = len(hits)
                notes += [f"{cid} round {x['round']} ({kind}) rejected: {x['reason'][:150]}" for x in hits]
            else:
                seen = sorted(r for r, c in rec.fault_failures if c == cid)
                faults[kind] = len(seen)
                if seen != sorted(rs):
                    analysis["problems"].append(f"{cid}: injected {kind} failures expected in rounds {rs}, server log shows {seen}")
        others = [x for x in rec.rejections if x["client-id"] not in bad_plan]
        if others:
            analysis["problems"].append(f"unexpected rejections {others}")
        return faults, analysis, notes

    def scen_serverapp_kill(self, dep: Deployment) -> tuple[dict, dict, list]:
        name = "serverapp-kill"
        self.set_faults(dep, {})
        self.fresh_states(dep)
        first_out = self.out / name / "first"
        info: dict[str, Any] = {}

        def during(base_out: Path, worker: threading.Thread) -> dict[str, Any]:
            deadline = time.monotonic() + self.args.run_timeout
            while worker.is_alive() and time.monotonic() < deadline:
                for ck in base_out.glob(f"run-*/{CHECKPOINT_FILE}"):
                    with contextlib.suppress(Exception):
                        _, meta = load_npz(ck)
                        if int(meta["round-completed"]) >= 2:
                            info["checkpoint"] = {"round-completed": meta["round-completed"], "version": meta["version"],
                                                  "ledger": meta["ledger-versions"], "dir": str(ck.parent)}  # fmt: skip
                            break
                if "checkpoint" in info:
                    break
                time.sleep(0.1)
            procs = [(pid, c) for pid, c in dep.leftover_processes() if "flwr-serverapp" in c]
            if not procs or "checkpoint" not in info:
                info["kill"] = f"no serverapp process / checkpoint (procs={procs})"
                return info
            for pid, _ in procs:
                os.kill(pid, signal.SIGKILL)
            info["killed-pids"] = [pid for pid, _ in procs]
            say(f"SIGKILLed flwr-serverapp pid(s) {info['killed-pids']} after round {info['checkpoint']['round-completed']}'s checkpoint")
            run_dir = Path(info["checkpoint"]["dir"])
            run_id = run_dir.name.removeprefix("run-")
            res = dep.flwr("stop", run_id, dep.connection, check=False, timeout=120)
            info["flwr-stop-rc"] = res.returncode
            return info

        first, _ = self.launch(dep, name + "/first", self.run_config(3, self.rounds), first_out, during=during,
                               timeout=min(self.args.run_timeout, 900))  # fmt: skip
        info["first-run-status"] = first.result.status if first.result else None
        notes = [f"first run ended {info['first-run-status']} after the kill"]
        if "killed-pids" not in info:
            analysis = {"problems": [f"ServerApp not killed: {info.get('kill')}"], "kill": info}
            return {"serverapp-sigkill": 0}, analysis, notes
        self.wait_idle(dep)
        resume_dir = info["checkpoint"]["dir"]
        second, _ = self.launch(dep, name + "/resume", self.run_config(3, self.rounds, resume=resume_dir),
                                self.out / name / "resume")  # fmt: skip
        cids = [dep.node_name(k) for k in range(3)]
        done = int(info["checkpoint"]["round-completed"])
        earlier = [r for r in first.rows if 1 <= r.get("round", 0) <= done]
        # the resumed run's records hold every round exactly once: rounds 1..done replayed from the checkpoint
        # (identical to the first run's rows), then the rounds it ran itself
        analysis = self.analyse(dep, second, reference=self.baseline, require_equal_to_reference=True,
                                honest_sum_clients=cids, max_accepts={c: self.rounds for c in cids})  # fmt: skip
        all_rounds = [int(r["round"]) for r in second.rows if r.get("round", 0) >= 1]
        replayed = [r for r in second.rows if 1 <= r.get("round", 0) <= done]
        notes.append(f"resumed run's records hold rounds {all_rounds}; rounds 1..{done} replayed from the checkpoint")
        if second.ok and all_rounds != list(range(1, self.rounds + 1)):
            analysis["problems"].append(f"resumed run's records hold rounds {all_rounds}, expected 1..{self.rounds} once")
        if second.ok and [r.get("applied") for r in replayed] != [r.get("applied") for r in earlier]:
            analysis["problems"].append("replayed rows differ from the first run's rows for rounds 1..done")
        analysis["kill"] = info
        if second.ok and second.ledger != {c: self.rounds for c in cids}:
            analysis["problems"].append(f"resumed ledger {second.ledger} is not {self.rounds} per client "
                                        f"(failures not injected: {second.other_failures or 'none'})")  # fmt: skip
        if self.baseline is None:
            analysis["problems"].append("no fault-free run to compare with")
        return {"serverapp-sigkill": 1}, analysis, notes

    def scen_byzantine(self, dep: Deployment) -> None:
        n = dep.num_nodes
        byz = n - 1
        byz_cid = dep.node_name(byz)
        cids = [dep.node_name(k) for k in range(n)]
        runs: dict[tuple[str, str], RunRecord] = {}
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        # the honest plain-sum reference first, the honest robust reference last (fewest node restarts)
        order = [(None, "sum"), *((a, g) for a in BYZ_ATTACKS for g in BYZ_AGGREGATORS), (None, "median")]
        for attack, agg in order:
            self.set_fault(dep, byz, attack)
            label = f"byzantine-{attack or 'honest'}-{agg}".replace(":", "")
            for attempt in range(self.args.retries + 1):
                self.ensure_online(dep)
                self.fresh_states(dep)
                rec, _ = self.launch(dep, label, self.run_config(n, self.byz_rounds, aggregator=agg), self.out / label)
                if rec.ok or not any(rec.infra.values()) or attempt == self.args.retries:
                    break
                say(f"{label}: infrastructure failure ({rec.describe_failure()}); retrying")
            key = (attack or "honest", agg)
            runs[key] = rec
            honest_sum = [c for c in cids if c != byz_cid or attack is None] if agg == "sum" else None
            analysis = self.analyse(
                dep, rec, reference=None, require_equal_to_reference=False,
                closed_form=(attack is None and agg == "sum"), honest_sum_clients=honest_sum,
                max_accepts={c: self.byz_rounds for c in cids},
            )  # fmt: skip
            notes = []
            if rec.ok:
                analysis["posterior-mean"] = _mean(rec).tolist()
                byz_rej = [x for x in rec.rejections if x["client-id"] == byz_cid]
                if byz_rej:
                    notes.append(f"{len(byz_rej)} reply(ies) of {byz_cid} rejected: {byz_rej[0]['reason'][:120]}")
                if rec.ledger != {c: self.byz_rounds for c in cids}:
                    notes.append(f"ledger {rec.ledger}; failures not injected: {rec.other_failures or 'none'}")
            faults = {attack: self.byz_rounds if rec.ok else 0} if attack else {}
            status = "INFRA" if not rec.ok and any(rec.infra.values()) else None
            rows[key] = self.record(label, faults, analysis, notes, status=status)
            self._fill_shifts(runs, rows)

    def _fill_shifts(self, runs: dict[tuple[str, str], RunRecord], rows: dict[tuple[str, str], dict[str, Any]]) -> None:
        """Posterior-mean shift of every Byzantine run from the honest runs (plain sum; same aggregator)."""
        for (attack, agg), row in rows.items():
            if "posterior-mean" not in row:
                continue
            mu = np.asarray(row["posterior-mean"])
            for ref_key, field in (((("honest", "sum")), "mean-shift-vs-honest-sum"),
                                   ((("honest", agg)), "mean-shift-vs-honest-same-aggregator")):  # fmt: skip
                ref = rows.get(ref_key)
                if ref is not None and "posterior-mean" in ref:
                    row[field] = float(np.linalg.norm(mu - np.asarray(ref["posterior-mean"])))
        self.write()

    # ---------------------------------------------------------------------------------- main
    def run(self, selected: Sequence[str]) -> int:
        t0 = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        three = [s for s in selected if s in THREE_NODE]  # in the order given
        try:
            if three or "baseline" in selected:
                with self.deployment(3) as dep:
                    self.with_retry("baseline", lambda: self.scen_baseline(dep))
                    for s in three:
                        if s == "kill-restart-state":
                            self.with_retry(s, lambda: self.scen_kill(dep, wipe=False))
                        elif s == "kill-restart-wiped":
                            self.with_retry(s, lambda: self.scen_kill(dep, wipe=True))
                        elif s == "serverapp-kill":
                            self.with_retry(s, lambda: self.scen_serverapp_kill(dep))
                        else:
                            self.with_retry(s, lambda: self.scen_reply_faults(dep, s))
            if "byzantine" in selected:
                with self.deployment(self.args.honest + 1) as dep:
                    self.scen_byzantine(dep)
        finally:
            for dep in list(self.deployments):
                self._stop(dep)
            self.write()
        print()
        print(render_table(self.results))
        print(f"total {time.monotonic() - t0:.0f}s; results in {self.out}/results.json, table in {self.out}/table.md")
        final = {r["scenario"]: r["status"] for r in self.results}  # the last attempt of each scenario
        return 0 if final and all(v == "PASS" for v in final.values()) else 1


def _mean(rec: RunRecord) -> np.ndarray:
    prior = build_problem(rec.cfg).prior
    q: GaussianFactor = prior.from_numpy(rec.posterior)
    return np.atleast_1d(q.mean().detach().cpu().numpy())  # type: ignore[union-attr]


# ======================================================================================================
# report


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.1e}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{v:.4g}"
    return str(v)


def render_table(results: list[dict[str, Any]]) -> str:
    head = ("| scenario | status | faults injected | updates lost | double-applied | bad rejected/sent "
            "| max dq vs fault-free | max dq vs closed form | client vs ledger | ledger |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        faults = ", ".join(f"{k}: {v}" for k, v in r.get("faults", {}).items()) or "none"
        bad = f"{r['bad-rejected']}/{r['bad-sent']} ({100 * r['bad-rejected'] / r['bad-sent']:.0f} %)" if r.get("bad-sent") else "-"
        ledger = " ".join(f"{k.removeprefix('site-')}:{v}" for k, v in sorted(r.get("ledger", {}).items(), key=lambda kv: int(kv[0].split("-")[-1])))
        lines.append(
            f"| {r['scenario']} | {r['status']} | {faults} | {_fmt(r.get('updates-lost'))} | {_fmt(r.get('double-applied'))} "
            f"| {bad} | {_fmt(r.get('diff-vs-fault-free'))} | {_fmt(r.get('diff-vs-closed-form'))} "
            f"| {_fmt(r.get('client-vs-ledger'))} | {ledger or '-'} |"
        )
    final = list({r["scenario"]: r for r in results}.values())  # the last attempt of each scenario
    kinds: dict[str, list[int]] = {}
    for r in final:
        for kind, n in r.get("faults", {}).items():
            k = kinds.setdefault(kind, [0, 0, 0, 0, 0])
            k[0] += n
            k[1] += int(r.get("updates-lost") or 0)
            k[2] += int(r.get("double-applied") or 0)
            if kind in INVALID_KINDS:  # rejections observed in the planned (client, round)s / planned
                plan = REPLY_PLANS.get(r["scenario"], {})
                k[3] += n
                k[4] += sum(len(spec.split("@")[1].split(",")) for spec in plan.values() if spec.split("@")[0] == kind)
    if kinds:
        lines += ["", "| fault kind | injected | updates lost (runs with it) | double-applied (runs with it) "
                  "| bad rejected/sent |", "|---|---|---|---|---|"]  # fmt: skip
        for kind, (n, lost, double, rej, sent) in kinds.items():
            lines.append(f"| {kind} | {n} | {lost} | {double} | {f'{rej}/{sent}' if sent else '-'} |")
    byz = [r for r in results if r["scenario"].startswith("byzantine-") and "posterior-mean" in r]
    if byz:
        lines += ["", "| Byzantine run | posterior mean | shift vs honest (sum) | shift vs honest (same aggregator) |",
                  "|---|---|---|---|"]  # fmt: skip
        for r in byz:
            lines.append(f"| {r['scenario']} | {', '.join(f'{m:.4f}' for m in r['posterior-mean'])} "
                         f"| {_fmt(r.get('mean-shift-vs-honest-sum'))} | {_fmt(r.get('mean-shift-vs-honest-same-aggregator'))} |")  # fmt: skip
    problems = [(r["scenario"], p) for r in results for p in r.get("problems", [])]
    if problems:
        lines += ["", "Problems:"] + [f"- {s}: {p}" for s, p in problems]
    notes = [(r["scenario"], n) for r in results for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:"] + [f"- {s}: {n}" for s, n in notes]
    return "\n".join(lines) + "\n"


# ======================================================================================================
# CLI


def _expand(only: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in only:
        if name in GROUPS:
            out += GROUPS[name]
        elif name in ALL:
            out.append(name)
        else:
            raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(ALL)}, {', '.join(GROUPS)}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, metavar="SCENARIO",
                   help=f"default: {' '.join(DEFAULT)}; also: {', '.join(x for x in ALL if x not in DEFAULT)}; "
                        f"groups: {', '.join(g + '=' + '+'.join(v) for g, v in GROUPS.items())}. "
                        "baseline always runs with a 3-client scenario")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "fault_suite"), help="output dir (default runs/fault_suite)")
    p.add_argument("--rounds", type=int_at_least(3, " (faults hit round 2, round 3 shows the recovery)"), default=3,
                   help="rounds of the 3-client runs (faults hit round 2; >= 3)")
    p.add_argument("--byz-rounds", type=int_at_least(1), default=2, help="rounds of the Byzantine runs (>= 1)")
    p.add_argument("--honest", type=int_at_least(1), default=10, help="honest clients in the Byzantine runs (>= 1)")
    p.add_argument("--round-timeout", type=number_above(), default=600.0, help="run config round-timeout-s (> 0)")
    p.add_argument("--wait-for-clients", type=number_above(allow_low=True), default=300.0,
                   help="run config wait-for-clients-s (>= 0)")
    p.add_argument("--run-timeout", type=number_above(), default=1800.0, help="seconds before a flwr run is stopped")
    p.add_argument("--poll-interval", type=number_above(), default=1.0, help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (s)")
    p.add_argument("--superlink-state", choices=("sqlite", "memory"), default="memory",
                   help="SuperLink state: memory (default; no SQLite 'database is locked' under load, Finding 2) "
                        "or sqlite (the durable state.db)")
    p.add_argument("--max-load", type=number_above(allow_inf=True), default=16.0,
                   help="wait before a run while loadavg(1 min) >= this (> 0; inf: never wait)")
    p.add_argument("--load-wait", type=number_above(allow_low=True), default=60.0,
                   help="longest wait for the load to drop (s)")
    p.add_argument("--retries", type=int_at_least(0), default=1,
                   help="retries of a scenario after an INFRA failure (>= 0; 0 = run each scenario once)")
    args = p.parse_args(argv)
    selected = list(dict.fromkeys(_expand(args.only) if args.only else DEFAULT))
    if any(s in THREE_NODE for s in selected) and "baseline" not in selected:
        selected.insert(0, "baseline")
    suite = Suite(args)
    say(f"fault suite: {', '.join(selected)}; output {suite.out}; app snapshot sha256 {suite.app_sha[:16]}")
    try:
        # SIGTERM and SIGHUP (terminal closed, ssh dropped) act like Ctrl-C, as in scripts/deploy.py: the
        # deployments' `finally` blocks stop every process; the old handlers are restored afterwards
        with signal_handlers(raise_interrupt, STOP_SIGNALS):
            return suite.run(selected)
    except KeyboardInterrupt as err:
        say(f"interrupted ({err or 'Ctrl-C'}); every process was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
