"""The real multi-process deployment on loopback: a SuperLink and 3 SuperNodes as separate OS processes,
with the defaults of ``Deployment``: TLS on (certificates made by scripts/pki.py) and SuperNode
authentication on (one key pair per node, registered before the node starts), gRPC Fleet API; the app
launched with ``flwr run``.

Parity with the in-process run and the independent closed form (conjugate model; NLL + KL and constant-weight
score matching + weighted KL, synchronous and sequential), a SuperNode with an unregistered
key refused while the registered ones run, and a client killed mid-run.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from common.config import parse_run_config
from scripts import pki
from scripts.deploy import Deployment, find_free_ports, free_port_kwargs
from strategies.reference import exact_posterior, expected_posterior, has_textbook_form, max_natural_diff
from tests.test_inprocess import BASE, TEXTBOOK_PARITY_CASES, run

pytestmark = pytest.mark.slow

DEPLOY_RUN = {**BASE, "dtype": "float64", "wait-for-clients-s": 120, "round-timeout-s": 60, "num-server-rounds": 3}


@contextlib.contextmanager
def online(dep: Deployment) -> Iterator[Deployment]:
    """``dep`` started and online for the block, then stopped, leaving none of its processes running."""
    try:
        dep.start()
        dep.wait_online(timeout=180)
        yield dep
    finally:
        dep.stop()
        assert dep.leftover_processes() == []


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with online(Deployment(3, run_dir=tmp_path_factory.mktemp("deploy"), **free_port_kwargs(3))) as dep:
        yield dep


def _run(dep: Deployment, overrides: dict, out_dir) -> tuple[dict, dict]:
    raw = {**DEPLOY_RUN, **overrides, "output-dir": str(out_dir)}
    res = dep.run_app(raw, timeout=900)
    assert res.ok, (res, res.log_path.read_text()[-3000:] if res.log_path else "")
    (run_dir,) = [p for p in out_dir.iterdir() if p.name == f"run-{res.run_id}"]
    post = dict(np.load(run_dir / "posterior.npz"))
    summary = json.loads((run_dir / "summary.json").read_text())
    return post, summary


@pytest.mark.parametrize("case", list(TEXTBOOK_PARITY_CASES))
def test_deployment_matches_inprocess_and_closed_form(deployment, case, tmp_path):
    """One ``flwr run`` per case on the module's deployment; the posterior equals the in-process run's and the
    independent closed form of the ledger reached, to 1e-6."""
    overrides = TEXTBOOK_PARITY_CASES[case]
    post, summary = _run(deployment, overrides, tmp_path)
    cfg, strategy, _ = run({**overrides, "dtype": "float64", "num-server-rounds": 3})
    assert has_textbook_form(cfg)
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
    expected = expected_posterior(cfg, summary["ledger-versions"])
    assert max_natural_diff(expected.from_numpy(post), expected) < 1e-6


def test_deployment_asynchronous_reaches_the_exact_posterior(deployment, tmp_path):
    post, summary = _run(deployment, {"schedule": "asynchronous", "damping": 1.0}, tmp_path)
    cfg = parse_run_config({**DEPLOY_RUN, "schedule": "asynchronous", "damping": 1.0})
    exact = exact_posterior(cfg)
    assert max_natural_diff(exact.from_numpy(post), exact) < 1e-6
    assert all(v >= 1 for v in summary["ledger-versions"].values())


def test_unregistered_supernode_is_refused_while_registered_ones_run(deployment, tmp_path):
    """Default Deployment = TLS + SuperNode auth. A 4th SuperNode with a valid but UNREGISTERED key
    (same CA, so it passes TLS) is refused by the SuperLink: it never shows up at the SuperLink,
    exits with Flower's 305, and the run reaches exactly the three registered sites."""
    assert deployment.auth and not deployment.insecure
    link = next(p for p in deployment.procs if p.role == "superlink")
    assert {"--enable-supernode-auth", "--ssl-certfile"} <= set(link.cmd) and "--insecure" not in link.cmd
    registered = {deployment.node_ids[k] for k in range(3)}
    for k in range(3):
        node = next(p for p in deployment.procs if p.role == "supernode" and p.index == k)
        assert node.cmd[node.cmd.index("--auth-supernode-private-key") + 1] == str(deployment.node_key(k)[0])
        assert deployment.node_id_from_log(k) == deployment.node_ids[k]  # the id its key was registered as

    rogue_key, rogue_pub = tmp_path / "rogue.key", tmp_path / "rogue.pub"
    pki.generate_node_keypair(rogue_key, rogue_pub, "rogue")
    probe = deployment.spawn_probe_node(rogue_key, port=find_free_ports(1)[0], name="rogue")
    seen_ids: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # every node the SuperLink lists while the rogue node tries to join and the run runs
        while not stop.is_set():
            try:
                seen_ids.update(r["node-id"] for r in deployment.list_nodes())
            except Exception:  # noqa: BLE001 - a slow CLI call on a loaded machine; try again
                pass
            stop.wait(3.0)

    out = tmp_path / "out"
    out.mkdir()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        _post, summary = _run(deployment, {"schedule": "synchronous", "num-server-rounds": 2}, out)
        rc = deployment.wait_process_exit(probe, timeout=120)
    finally:
        stop.set()
        watcher.join(timeout=90)
    assert set(summary["ledger-versions"]) == {"site-0", "site-1", "site-2"}
    assert all(v == 2 for v in summary["ledger-versions"].values())
    assert rc is not None and rc != 0
    probe_log = Path(probe.log_path).read_text()
    assert "Failed to activate SuperNode" in probe_log and "305" in probe_log
    assert "No SuperNode found with the given public key" in Path(link.log_path).read_text()
    assert seen_ids and seen_ids <= registered  # the rogue node never appeared, not even as offline
    assert {r["node-id"] for r in deployment.list_nodes() if r["status"] == "online"} == registered


def run_with_fault_after_round_1(
    dep: Deployment, overrides: dict, out_dir, fault: Callable[[], None]
) -> tuple[dict, dict]:
    """:func:`_run` in a thread, calling ``fault()`` as soon as the run's metrics show round 1; the run's posterior
    and summary. Fails if round 1 never came or the run did not finish."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(zip(("post", "summary"), _run(dep, overrides, out_dir))))
    worker.start()
    faulted = False
    deadline = time.time() + 600
    while worker.is_alive() and time.time() < deadline:
        rows = [json.loads(line) for f in Path(out_dir).glob("run-*/metrics.jsonl")
                for line in f.read_text().splitlines() if line]
        if not faulted and any(r["round"] >= 1 for r in rows):
            fault()
            faulted = True
        time.sleep(0.2)
    worker.join(timeout=60)
    assert faulted and "summary" in result, result
    return result["post"], result["summary"]


def assert_site_2_dropped_out(overrides: dict, post: dict, summary: dict) -> None:
    """site-0 and site-1 took part in every round, site-2 in round 1 and not in all; the posterior is the closed
    form of the ledger reached."""
    rounds = overrides["num-server-rounds"]
    versions = summary["ledger-versions"]
    assert versions["site-0"] == rounds and versions["site-1"] == rounds
    assert 1 <= versions["site-2"] < rounds
    expected = expected_posterior(parse_run_config({**DEPLOY_RUN, **overrides}), versions)
    assert max_natural_diff(expected.from_numpy(post), expected) < 1e-6


def test_killed_client_does_not_stop_the_run(deployment, tmp_path):
    """SIGKILL the SuperNode of site-2 after round 1; rounds 2-4 go on with site-0 and site-1."""
    overrides = {"schedule": "synchronous", "num-server-rounds": 4, "round-timeout-s": 90}
    post, summary = run_with_fault_after_round_1(deployment, overrides, tmp_path, lambda: deployment.kill_node(2))
    assert_site_2_dropped_out(overrides, post, summary)


def test_warm_workers_serve_every_update_and_match_inprocess(tmp_path):
    """``Deployment(warm_workers=True)``: a warm compute worker per node computes every train message;
    the posterior equals the in-process run's and the closed form, and stop() leaves nothing running."""
    overrides = {"num-clients": 2, "min-clients": 2}
    with online(Deployment(2, run_dir=tmp_path / "dep", warm_workers=True, **free_port_kwargs(2))) as dep:
        post, summary = _run(dep, overrides, tmp_path / "out")
    assert not any(dep.worker_socket(k).exists() for k in range(2))  # the workers cleaned up
    served = [Path(dep.logs_dir / f"warm-worker-{k}.log").read_text().count("served in") for k in range(2)]
    assert served == [DEPLOY_RUN["num-server-rounds"]] * 2, served
    cfg, strategy, _ = run({"dtype": "float64", "num-server-rounds": 3, **overrides})
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
