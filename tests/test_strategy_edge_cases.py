"""Edge cases of the PGVI strategy found in review, each against the real ClientApp through the in-process Grid.

* duplicated replies (re-executed or re-delivered messages) are harmless: they never count towards a client's
  exclusion, synchronously or asynchronously;
* a client excluded by a later reply of the same batch gets none of that batch applied;
* malformed ``query`` and ``evaluate`` replies are ignored with a warning, never a server crash;
* ``sequential-order`` never drops a client it does not list;
* a node that cannot identify itself is asked again with a backoff, not at every sampling;
* checkpoints keep client ids that contain the key separator, and a long float32 run resumes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from common import protocol as P
from common.config import parse_run_config
from common.factors import PGVIServerState
from common.problem import build_problem
from strategies.checkpoint import load_checkpoint, save_checkpoint
from strategies.pgvi import PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_inprocess import _tamper, client_sites, run


@pytest.mark.parametrize("schedule", ["synchronous", "asynchronous"])
def test_duplicated_replies_never_exclude_an_honest_client(schedule):
    over = {"schedule": schedule, "num-server-rounds": 4, "max-bad-replies": 2, "exclusion-removes-site": True}
    cfg, strategy, grid = run(over, reply_hook=_tamper("duplicate", once=False))
    assert any("duplicate" in str(r["reason"]) for r in strategy.rejections)
    assert strategy.bad_replies == {}
    assert strategy.ledger_versions == {f"site-{m}": 4 for m in range(3)}
    rows = [r for r in strategy.history if r["round"] >= 1]
    assert [(r["applied"], r["rejected"]) for r in rows] == [(3.0, 1.0)] * 4  # the duplicate resolves no message
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    for cid, site in client_sites(grid, strategy).items():  # every client agrees with the ledger
        ledger = strategy.state.sites[cid].to_numpy()
        assert all(np.allclose(site[k], ledger[k], rtol=0, atol=1e-12) for k in ledger), cid


def _second_reply_with_unknown_status(victim: str = "site-1"):
    """After the victim's valid reply, deliver a copy of it with an unknown status (a bad reply)."""

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type != "train" or reply.has_error():
            return [reply]
        if str(reply.content[P.CONFIG].get("client-id")) != victim:
            return [reply]
        cfg = dict(reply.content[P.CONFIG])
        cfg["status"] = "bogus"
        content = RecordDict({P.CONFIG: ConfigRecord(cfg), P.DELTA: reply.content[P.DELTA]})
        forged = Message(content=content, reply_to=request)
        forged.metadata.__dict__["_src_node_id"] = reply.metadata.src_node_id
        return [reply, forged]

    return hook


def test_client_excluded_within_a_batch_has_none_of_it_applied():
    over = {"schedule": "synchronous", "num-server-rounds": 3, "max-bad-replies": 1, "exclusion-removes-site": True}
    cfg, strategy, _ = run(over, reply_hook=_second_reply_with_unknown_status())
    assert strategy.bad_replies == {"site-1": 1}
    reasons = [str(r["reason"]) for r in strategy.rejections if r["client-id"] == "site-1"]
    assert any("unknown status" in r for r in reasons) and any("client excluded" in r for r in reasons)
    # before the fix the valid first reply of round 1 was applied after the exclusion: site-1 at version 1
    assert strategy.ledger_versions == {"site-0": 3, "site-1": 0, "site-2": 3}
    assert all(float(v.abs().max()) == 0.0 for v in strategy.state.sites["site-1"].params.values())
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    assert strategy.state.check_invariant() < 1e-12


@pytest.mark.parametrize("bad_version", [math.inf, math.nan, "three", [1, 2]])
def test_malformed_identity_reply_does_not_crash_the_server(bad_version):
    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == "query" and reply.content[P.CONFIG].get("client-id") == "site-2":
            reply.content[P.CONFIG] = ConfigRecord({"client-id": "site-2", "site-version": bad_version})
        return [reply]

    cfg, strategy, _ = run({"num-server-rounds": 2}, reply_hook=hook)
    assert strategy.ledger_versions == {f"site-{m}": 2 for m in range(3)}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


def test_malformed_evaluate_replies_are_skipped():
    seen: dict[str, float] = {}

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type != "evaluate" or reply.has_error():
            return [reply]
        node = request.metadata.dst_node_id
        metrics = dict(reply.content[P.METRICS])
        if node == 1000:
            reply.content[P.METRICS] = MetricRecord({**metrics, "num-examples": [1.0, 2.0]})
        elif node == 1001:
            reply.content[P.METRICS] = MetricRecord({**metrics, "num-examples": math.nan})
        else:
            seen["n"] = float(metrics["num-examples"])
        return [reply]

    _, strategy, _ = run({"num-server-rounds": 2, "evaluate-clients": True}, reply_hook=hook)
    rows = [r for r in strategy.history if r["round"] >= 1]
    assert len(rows) == 2
    assert all(r["client-num-examples"] == seen["n"] for r in rows)  # only the well-formed reply counted
    assert all(math.isfinite(v) for r in rows for v in r.values())


def test_sequential_order_visits_unlisted_clients_after_the_listed_ones():
    visits: list[str] = []

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == "train":
            visits.append(str(request.content[P.CONFIG]["client-id"]))
        return [reply]

    cfg, strategy, _ = run({"schedule": "sequential", "num-server-rounds": 2, "sequential-order": "site-2, ghost"},
                           reply_hook=hook)
    assert visits == ["site-2", "site-0", "site-1"] * 2  # before the fix: ["site-2"] * 2
    assert strategy.ledger_versions == {f"site-{m}": 2 for m in range(3)}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


@pytest.mark.parametrize("schedule", ["synchronous", "asynchronous"])
def test_an_unidentifiable_node_is_not_queried_at_every_sampling(schedule):
    """A fourth node whose query fails (its partition does not exist) must not be queried again and again
    (before the fix: at every sampling, i.e. every round, and every poll of the asynchronous loop)."""
    from client.app import app as client_app
    from strategies.inprocess import InProcessGrid
    from tests.test_inprocess import BASE

    raw = {**BASE, "schedule": schedule, "num-server-rounds": 4}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    stray = {"partition-id": 0, "num-partitions": 99, "client-id": "stray"}
    queries: dict[int, int] = {}

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == "query":
            queries[request.metadata.dst_node_id] = queries.get(request.metadata.dst_node_id, 0) + 1
        return [reply]

    grid = InProcessGrid(client_app, [*nodes, stray], raw, reply_hook=hook)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.01)
    strategy.start(grid)
    stray_node = max(grid.contexts)
    assert stray_node not in strategy.node_client
    assert queries[stray_node] <= 2, queries  # the start, then at most one retry within 30 s
    assert strategy.ledger_versions == {f"site-{m}": 4 for m in range(3)}


def test_checkpoint_keeps_client_ids_that_contain_the_separator(tmp_path):
    cfg, strategy, _ = run({"num-server-rounds": 1})
    site = strategy.state.sites.pop("site-2")
    strategy.state.sites["lab|ward-2"] = site
    strategy.ledger_versions["lab|ward-2"] = strategy.ledger_versions.pop("site-2")
    save_checkpoint(strategy, tmp_path)
    again = PGVIStrategy(build_problem(cfg))
    load_checkpoint(again, tmp_path)
    assert sorted(again.state.sites) == ["lab|ward-2", "site-0", "site-1"]
    assert max_natural_diff(again.state.sites["lab|ward-2"], site) == 0.0
    assert max_natural_diff(again.state.posterior, strategy.state.posterior) == 0.0


def test_a_long_float32_run_resumes_from_its_checkpoint(tmp_path):
    """300 batches of 20 Deltas in float32: the checkpoint loads.  The running float32 global site used to drift
    from the sum of the sites by rounding (well above a relative 1e-6, which the loader's tolerance allows for);
    it is now the stored sites' float64 sum, cast once, so only the float32 re-summation differs from it."""
    raw = {"model": "logistic_regression", "dataset": "breast_cancer", "dtype": "float32", "num-clients": 20,
           "min-clients": 20}
    cfg = parse_run_config(raw)
    strategy = PGVIStrategy(build_problem(cfg))
    prior = strategy.problem.prior
    state = PGVIServerState(prior=prior)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        batch = {}
        for m in range(20):
            params = {k: (torch.randn(v.shape, generator=gen) * 3.0 if k.startswith("eta1")
                          else -torch.rand(v.shape, generator=gen) * 0.05).to(v.dtype) for k, v in prior.params.items()}
            batch[f"site-{m}"] = prior._like(params)
        state.apply(batch)
    scale = max(float(v.abs().max()) for v in state.global_site.params.values())
    assert state.check_invariant() <= 20 * torch.finfo(torch.float32).eps * scale  # 20 float32 additions
    strategy.state = state
    strategy.ledger_versions = {f"site-{m}": 300 for m in range(20)}
    save_checkpoint(strategy, tmp_path)
    again = PGVIStrategy(build_problem(cfg))
    load_checkpoint(again, tmp_path)
    assert again.ledger_versions == strategy.ledger_versions
    assert max_natural_diff(again.state.posterior, state.posterior) == 0.0


def test_a_second_live_node_cannot_take_over_a_connected_clients_id():
    """An impostor (or a misconfigured node) claiming the client id of a connected node is ignored: it gets no
    site and no train message, and the real client's ledger entry is untouched. A restarted client (its old
    node gone) still takes its site over: tests/test_inprocess.py::test_restarted_client_without_state_..."""
    from client.app import app as client_app
    from strategies.inprocess import InProcessGrid
    from tests.test_inprocess import BASE

    raw = {**BASE, "num-server-rounds": 3}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    impostor = {"partition-id": 1, "num-partitions": 3, "client-id": "site-0"}
    trained: list[int] = []

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type == "train":
            trained.append(request.metadata.dst_node_id)
        return [reply]

    grid = InProcessGrid(client_app, [*nodes, impostor], raw, reply_hook=hook)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    impostor_node = max(grid.contexts)
    assert impostor_node not in strategy.node_client and impostor_node not in trained
    assert strategy.node_client[min(grid.contexts)] == "site-0"
    assert strategy.ledger_versions == {f"site-{m}": 3 for m in range(3)}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


def test_a_client_id_beyond_num_clients_is_not_admitted_to_the_ledger(caplog):
    """num-clients is the number of partitions: a node with a new id once the ledger holds num-clients clients (a
    node renamed, or a run resumed with other ids) is ignored; admitted, it counted its partition's points twice
    (Gaussian location resumed with hosp-0..2 for site-0..2: posterior precision 201 for an exact 181)."""
    from client.app import app as client_app
    from strategies.inprocess import InProcessGrid
    from tests.test_inprocess import BASE

    raw = {**BASE, "num-server-rounds": 2}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    renamed = {"partition-id": 0, "num-partitions": 3, "client-id": "hosp-0"}
    grid = InProcessGrid(client_app, [*nodes, renamed], raw)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    assert max(grid.contexts) not in strategy.node_client
    assert strategy.ledger_versions == {f"site-{m}": 2 for m in range(3)}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    assert "client id 'hosp-0' is not in the ledger, which already holds num-clients=3 clients" in caplog.text


def test_run_stops_when_every_client_is_excluded():
    from strategies.pgvi import AllClientsFailed

    with pytest.raises(AllClientsFailed, match="every client is excluded"):
        run({"num-server-rounds": 5, "max-bad-replies": 1},
            reply_hook=lambda req, rep: [rep] if req.metadata.message_type != "train" else
            _tamper("nan", victim=str(rep.content[P.CONFIG].get("client-id")), once=False)(req, rep))


def test_asynchronous_rounds_hold_exactly_num_clients_outcomes():
    """Replies that trickle in (here: at most two per pull) must not spill over a round boundary: before the fix
    the round closed only after a whole pull, and every round held 4 outcomes."""
    from client.app import app as client_app
    from strategies.inprocess import InProcessGrid
    from tests.test_inprocess import BASE

    class Trickle(InProcessGrid):
        def pull_messages(self, message_ids):
            wanted = set(message_ids)
            keys = [k for k in self._replies if k.split("#")[0] in wanted][:2]
            return [self._replies.pop(k) for k in keys]

    raw = {**BASE, "schedule": "asynchronous", "num-server-rounds": 6}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    grid = Trickle(client_app, nodes, raw)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    rows = [r for r in strategy.history if r["round"] >= 1]
    assert len(rows) == 6
    assert [r["applied"] + r["rejected"] + r["failed"] for r in rows] == [3.0] * 6
    assert sum(strategy.ledger_versions.values()) == 18
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


@pytest.mark.parametrize("bad", [-3, "x", 2.5])
def test_a_bad_node_batch_size_fails_at_identification_not_in_training(bad):
    """Node config ``batch-size`` is validated like the run config's key when the node identifies itself, so the
    node never joins (and the run does not start with it) instead of failing every train message."""
    from client.node_request import node_run_config
    from common.errors import PGVIError

    assert node_run_config({}, {"partition-id": 0, "batch-size": 64})[0].batch_size == 64
    with pytest.raises(PGVIError, match="node config batch-size"):
        node_run_config({}, {"partition-id": 0, "batch-size": bad})


@pytest.mark.parametrize("schedule", ["synchronous", "sequential", "asynchronous"])
def test_run_stops_instead_of_completing_when_every_node_is_gone(schedule):
    """Every node disconnects after round 1: the run must not carry on with empty rounds and end 'completed'."""
    from strategies.pgvi import AllClientsFailed

    def all_gone(rnd, grid):
        if rnd == 1:
            for n in list(grid.contexts):
                grid.remove_node(n)

    with pytest.raises(AllClientsFailed, match="no client is connected"):
        run({"schedule": schedule, "num-server-rounds": 4}, between_rounds=all_gone)


class _EvalReply:
    def __init__(self, metrics: dict, node: int) -> None:
        self.content = {P.METRICS: MetricRecord(metrics)}
        self.metadata = type("Meta", (), {"src_node_id": node})()

    def has_error(self) -> bool:
        return False


def test_client_metrics_are_those_of_all_clients_points_together():
    """Accuracy/NLL/Brier: example-weighted means; RMSE: root of the pooled mean square; ECE: from the summed
    per-bin sums (the weighted mean of per-client ECEs is not the ECE of the union), falling back to that
    mean when a client sent no bins."""
    from common.metrics import bin_sum_key, calibration_bin_sums, expected_calibration_error

    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    rng = np.random.default_rng(1)
    probs = [rng.dirichlet(np.ones(4), size=n) for n in (30, 70)]
    # client 0 over-confident (random labels), client 1 under-confident (always right): in a shared bin the
    # gaps have opposite signs, so the ECE of the union is below the weighted mean of the two ECEs
    ys = [rng.integers(0, 4, len(probs[0])), probs[1].argmax(1)]
    replies = []
    for node, (p, y) in enumerate(zip(probs, ys)):
        m = {"num-examples": float(len(y)), "accuracy": float(np.mean(p.argmax(1) == y)),
             "ece": expected_calibration_error(p, y), "rmse": 1.0 + node}
        for what, arr in zip(("count", "conf", "correct"), calibration_bin_sums(p, y)):
            m.update({bin_sum_key(b, what): float(v) for b, v in enumerate(arr)})
        replies.append(_EvalReply(m, node))
    out = dict(strategy.aggregate_evaluate(1, replies))
    p_all, y_all = np.vstack(probs), np.concatenate(ys)
    assert out["client-ece"] == pytest.approx(expected_calibration_error(p_all, y_all), abs=1e-12)
    assert out["client-accuracy"] == pytest.approx(float(np.mean(p_all.argmax(1) == y_all)))
    assert out["client-rmse"] == pytest.approx(math.sqrt((30 * 1.0 + 70 * 4.0) / 100))
    assert out["client-num-examples"] == 100.0
    assert not any(k.startswith("client-ece-bin") for k in out)
    weighted = (30 * replies[0].content[P.METRICS]["ece"] + 70 * replies[1].content[P.METRICS]["ece"]) / 100
    assert abs(out["client-ece"] - weighted) > 1e-3  # the two differ here
    old_client = {k: v for k, v in dict(replies[1].content[P.METRICS]).items() if not k.startswith("ece-bin")}
    mixed = dict(strategy.aggregate_evaluate(1, [replies[0], _EvalReply(old_client, 1)]))
    assert mixed["client-ece"] == pytest.approx(weighted)


def test_malformed_ece_bins_skip_the_reply_and_never_crash():
    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    good = {"num-examples": 10.0, "accuracy": 0.5, "ece": 0.1, "ece-bin-13-count": 10.0, "ece-bin-13-conf": 9.0,
            "ece-bin-13-correct": 8.0}
    for bad in ({"ece-bin-xx-count": 1.0}, {"ece-bin-13-count": math.nan}, {"ece-bin-02-conf": -1.0},
                {"ece-bin-1000-count": 1.0}):
        out = dict(strategy.aggregate_evaluate(1, [_EvalReply(good, 0), _EvalReply({**good, **bad}, 1)]))
        assert out["client-num-examples"] == 10.0  # only the well-formed reply
        assert out["client-ece"] == pytest.approx(0.1)  # |8 - 9| / 10


def test_inconsistent_ece_bins_skip_the_reply():
    """Bins that no set of points could produce (a review found these pooled into ECE inf, 0 or 50)."""
    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    good = {"num-examples": 10.0, "accuracy": 0.5, "ece": 0.1, "ece-bin-13-count": 10.0, "ece-bin-13-conf": 9.0,
            "ece-bin-13-correct": 8.0}
    for bad in ({"ece-bin-13-conf": 1e308}, {"ece-bin-13-conf": 50.0},  # conf > count
                {"ece-bin-13-count": 10.0, "ece-bin-13-conf": 9.0, "ece-bin-13-correct": 8.0, "ece-bin-99-count": 1.0},
                {"ece-bin-\u0661\u0662-count": 1.0},  # non-ASCII digits
                {"ece-bin-13-count": 12.0, "ece-bin-13-conf": 9.0, "ece-bin-13-correct": 8.0}):  # counts != n
        reply = {**good, **bad}
        out = dict(strategy.aggregate_evaluate(1, [_EvalReply(good, 0), _EvalReply(reply, 1)]))
        assert out["client-num-examples"] == 10.0, bad
        assert out["client-ece"] == pytest.approx(0.1), bad
    counts_only = {k: v for k, v in good.items() if not k.endswith(("-conf", "-correct"))}
    out = dict(strategy.aggregate_evaluate(1, [_EvalReply(good, 0), _EvalReply(counts_only, 1)]))
    assert out["client-num-examples"] == 10.0


def test_evaluate_replies_with_impossible_counts_are_skipped_not_a_crash(monkeypatch):
    """Stop-30 review: two replies with num-examples 1e308 made the pooling raise OverflowError (the run failed); one
    with 1e300 decided every pooled metric; a fractional count was taken. A count must be a whole number in
    [0, 2^53], as a train reply's."""
    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    warned: list[str] = []
    monkeypatch.setattr("strategies.pgvi.log", lambda level, msg, *a: warned.append(msg % a if a else msg))
    honest = _EvalReply({"num-examples": 100.0, "accuracy": 0.7}, 0)
    for bad in (1e308, 1e300, 0.25, 2.0**53 + 2, -5.0):
        warned.clear()
        huge = [_EvalReply({"num-examples": bad, "accuracy": 0.9}, 1), _EvalReply({"num-examples": bad, "accuracy": 0.9}, 2)]
        out = dict(strategy.aggregate_evaluate(1, [*huge, honest]))
        assert out["client-accuracy"] == 0.7 and out["client-num-examples"] == 100.0, (bad, out)
        if bad > 0:
            assert sum("num-examples" in w and "skipped" in w for w in warned) == 2, (bad, warned)


def test_evaluate_metrics_outside_their_range_are_left_out_of_the_pooled_values(monkeypatch):
    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    warned: list[str] = []
    monkeypatch.setattr("strategies.pgvi.log", lambda level, msg, *a: warned.append(msg % a if a else msg))
    good = {"num-examples": 100.0, "accuracy": 0.7, "brier": 0.3, "ece": 0.1, "nll": 0.8}
    bad = {"num-examples": 100.0, "accuracy": 7.0, "brier": -3.0, "ece": 1.5, "nll": 0.6}
    out = dict(strategy.aggregate_evaluate(1, [_EvalReply(good, 0), _EvalReply(bad, 1)]))
    assert (out["client-accuracy"], out["client-brier"], out["client-ece"]) == (0.7, 0.3, 0.1)
    assert out["client-nll"] == pytest.approx(0.7)  # in range: pooled
    assert any("'accuracy'" in w and "'brier'" in w and "'ece'" in w and "outside" in w for w in warned), warned


@pytest.mark.parametrize("kind, says", [("nan", "non-finite"), ("shape", "shape"), ("improper", "improper")])
def test_a_rejected_delta_is_logged_with_its_client_and_reason(monkeypatch, kind, says):
    """The issue asks for a rejection "with a logged reason": the tests checked only strategy.rejections, so a
    silenced warning went unnoticed (stop-30 audit)."""
    from tests.test_schedules_review import _warnings

    logged = _warnings(monkeypatch)
    run({"schedule": "synchronous", "num-server-rounds": 2}, reply_hook=_tamper(kind))
    rejected = [w for w in logged if "rejected update from client 'site-1'" in w]
    assert len(rejected) == 1 and says in rejected[0].lower(), logged


def test_an_evaluate_reply_whose_count_is_too_large_for_a_float_is_skipped_not_a_crash(monkeypatch):
    """10**400 (a MetricRecord takes it) raised OverflowError out of aggregate_evaluate (a regression of 73fb6ae)."""
    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    monkeypatch.setattr("strategies.pgvi.log", lambda *a: None)
    out = dict(strategy.aggregate_evaluate(1, [_EvalReply({"num-examples": 10**400, "accuracy": 0.9}, 1),
                                               _EvalReply({"num-examples": 100.0, "accuracy": 0.7}, 0)]))
    assert out["client-accuracy"] == 0.7 and out["client-num-examples"] == 100.0
