"""Review of the client side (2026-11-28): a client id the node accepts works with a state directory; a resent
site that is not of the family is asked for again, not adopted; a start below the parameterisation floor is a
``failed`` reply, not an exception out of ``fit``."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from client.app import app as client_app
from client.pgvi_client import PGVIClient
from common import protocol as P
from common.client_state import ClientState
from common.config import parse_run_config
from common.errors import PGVIError, ScaleFloorError
from common.problem import build_problem, client_shard
from common.variational import variational_for
from common.protocol import client_id_problem
from strategies.inprocess import InProcessGrid

IDS = ["site 3", "Hôpital-3", "site:3", "a/b", "../x", "%41", "~", "é" * 128, "x" * 128]


@pytest.mark.parametrize("cid", IDS)
def test_every_id_the_node_accepts_has_its_own_state_file_in_the_state_dir(tmp_path, cid):
    assert client_id_problem(cid) is None  # the node and the server accept it
    path = ClientState.path_for(tmp_path, cid)
    assert path.parent == tmp_path and path.name.endswith(".npz") and len(path.name.encode()) <= 255
    st = ClientState(site={"eta1": np.ones(2), "eta2": -np.ones(2)}, version=3, tag="t")
    assert st.save(tmp_path, cid) == path
    back = ClientState.load(tmp_path, cid)
    assert back.version == 3 and back.tag == "t"


def test_state_file_names_are_distinct_and_plain_ids_keep_theirs(tmp_path):
    names = {ClientState.path_for(tmp_path, c).name for c in IDS + ["site-3", "site_3", "site.3", "A"]}
    assert len(names) == len(IDS) + 4
    assert ClientState.path_for(tmp_path, "site-3").name == "site-3.npz"  # the files written before stay found
    assert ClientState.path_for(tmp_path, "%41").name != ClientState.path_for(tmp_path, "A").name


def test_a_node_with_a_state_dir_and_a_spaced_client_id_identifies_itself(tmp_path):
    raw = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "num-clients": 3,
           "min-clients": 2, "num-server-rounds": 1, "evaluate-clients": False, "checkpoint": False}
    node = {"partition-id": 0, "num-partitions": 3, "client-id": "site 3", "state-dir": str(tmp_path)}
    grid = InProcessGrid(client_app, [node], raw)
    (node_id,) = list(grid.contexts)
    msg = Message(RecordDict({P.CONFIG: ConfigRecord({"request": "identity"})}), dst_node_id=node_id,
                  message_type=MessageType.QUERY)
    (reply,) = grid.send_and_receive([msg])
    assert not reply.has_error(), reply.error.reason  # was: ValueError: client-id 'site 3' must match ...
    assert reply.content[P.CONFIG]["client-id"] == "site 3"


def test_a_resent_site_of_the_wrong_structure_is_asked_for_again_and_not_adopted():
    cfg = parse_run_config({"dataset": "synthetic_logistic_2d", "model": "logistic_regression",
                            "family": "full_covariance", "num-clients": 2, "local-epochs": 2})
    problem = build_problem(cfg)
    client = PGVIClient(problem, client_shard(cfg, 0), "site-0", ClientState(version=0), 0)
    post = problem.prior.to_numpy()
    site = {k: np.zeros_like(v) for k, v in post.items()}
    site["eta2"][0, 1] = 1e-3  # finite, the right shape, not symmetric
    config = {"server-round": 2, "rho": 0.5, "site-version": 3, "site-tag": "t3", "posterior-version": 5,
              "has-site": True}
    _, _, m = client.fit([post[k] for k in client.names] + [site[k] for k in client.names], config)
    assert m["status"] == P.STATUS_RESYNC and "symmetric" in m["reason"], m
    assert client.state.version == 0 and client.state.site is None  # was: adopted as version 3, then failed for good


@pytest.mark.parametrize("stored", [
    {"eta1/theta": np.zeros(1), "eta2/theta": np.zeros(1)},  # a gaussian_location run's site (other names)
    {"eta1": np.zeros(7), "eta2": np.zeros((7, 7))},  # the same names, another size
])
def test_a_stored_site_of_another_layout_at_the_ledgers_version_asks_for_the_site(stored):
    """A state-dir reused by a run of another model: its version-0 site matched the ledger's version, every round
    failed on its shapes (a failed reply, never a resync) and the client's data was never used."""
    cfg = parse_run_config({"dataset": "synthetic_logistic_2d", "model": "logistic_regression",
                            "family": "full_covariance", "num-clients": 2, "local-epochs": 2})
    problem = build_problem(cfg)
    client = PGVIClient(problem, client_shard(cfg, 0), "site-0", ClientState(site=stored, version=0), 0)
    post = problem.prior.to_numpy()
    config = {"server-round": 1, "rho": 0.5, "site-version": 0, "posterior-version": 0}
    _, _, m = client.fit([post[k] for k in client.names], config)
    assert m["status"] == P.STATUS_RESYNC and "the stored site does not fit this run" in m["reason"], m
    uniform = {k: np.zeros_like(v) for k, v in post.items()}  # the server resends its ledger site
    _, _, m = client.fit([post[k] for k in client.names] + [uniform[k] for k in client.names],
                         {**config, "has-site": True})
    assert m["status"] == P.STATUS_OK, m


def test_a_posterior_narrower_than_the_scale_floor_is_a_failed_reply():
    cfg = parse_run_config({"dataset": "synthetic_gaussian_location", "model": "gaussian_location",
                            "divergence": "alpha_renyi", "divergence-alpha": 0.5, "num-clients": 2,
                            "local-epochs": 2})
    problem = build_problem(cfg)
    client = PGVIClient(problem, client_shard(cfg, 0), "site-0", ClientState(), 0)
    post = {k: np.full_like(v, -0.5e17 if k.startswith("eta2") else 1.5e17)
            for k, v in problem.prior.to_numpy().items()}  # N(1.5, 1e-17): proper, scale 3e-9 < min_scale 1e-8
    assert problem.prior.from_numpy(post).is_proper()
    _, _, m = client.fit([post[k] for k in client.names],
                         {"server-round": 1, "rho": 0.5, "site-version": 0, "posterior-version": 0})
    assert m["status"] == P.STATUS_FAILED and "ScaleFloorError" in m["reason"], m


def test_the_scale_floor_error_is_typed():
    prior = build_problem(parse_run_config({"dataset": "synthetic_gaussian_location",
                                            "model": "gaussian_location", "dtype": "float64"})).prior
    narrow = prior.from_numpy({k: np.full_like(v, -0.5e17 if k.startswith("eta2") else 0.0)
                               for k, v in prior.to_numpy().items()})
    with pytest.raises(ScaleFloorError) as info:
        variational_for(narrow)
    assert isinstance(info.value, PGVIError) and isinstance(info.value, ValueError)
