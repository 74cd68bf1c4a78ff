"""Parity of Flower's simulation engine (`flwr run . <local>` with Ray) with the in-process run and the closed form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.config import parse_run_config
from scripts.simulate import pick_run, run_simulation
from strategies.reference import expected_posterior, has_textbook_form, max_natural_diff
from tests.test_inprocess import BASE, TEXTBOOK_PARITY_CASES, run

pytestmark = pytest.mark.slow

CASES = {
    **TEXTBOOK_PARITY_CASES,  # checked against the independent oracle as well as the in-process run
    # IMQ weights have no textbook closed form: parity with the in-process run only
    "sync-sm-imq-wkl": {"schedule": "synchronous", "loss": "score_matching", "sm-weight": "imq", "divergence": "weighted_kl", "divergence-w": 0.7},
}
NO_CLOSED_FORM = {"sync-sm-imq-wkl"}


def test_cases_cover_both_losses_and_deterministic_schedules_against_the_oracle():
    checked = set()
    for name, case in CASES.items():
        cfg = parse_run_config({**BASE, **case})
        assert has_textbook_form(cfg) == (name not in NO_CLOSED_FORM), name
        if has_textbook_form(cfg):
            checked.add((cfg.schedule, cfg.loss, cfg.divergence))
    objectives = (("nll", "kl"), ("score_matching", "weighted_kl"))
    assert {(s, loss, d) for s in ("synchronous", "sequential") for loss, d in objectives} <= checked


@pytest.mark.parametrize("case", list(CASES))
def test_simulation_matches_inprocess_and_closed_form(case, tmp_path):
    overrides = {**CASES[case], "num-server-rounds": 3, "dtype": "float64", "evaluate-clients": False,
                 "wait-for-clients-s": 180, "round-timeout-s": 120}
    raw = {**BASE, **overrides}
    res = run_simulation(raw, num_supernodes=raw["num-clients"], workdir=tmp_path, timeout=900)
    assert res["status"] == "finished:completed", res["log"].read_text()[-3000:]
    post = dict(np.load(res["out_dir"] / "posterior.npz"))
    summary = json.loads((res["out_dir"] / "summary.json").read_text())
    cfg, strategy, _ = run(overrides)
    ref = strategy.state.posterior.to_numpy()
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in ref.items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
    if case not in NO_CLOSED_FORM:  # the independent closed form of the ledger reached
        expected = expected_posterior(parse_run_config(raw), summary["ledger-versions"])
        assert max_natural_diff(strategy.state.posterior.from_numpy(post), expected) < 1e-6


def test_pick_run_takes_this_invocations_run_not_an_earlier_one():
    earlier = {"run-id": "570153098676490552", "status": "finished:failed"}
    mine = {"run-id": "3831847892416236757", "status": "finished:completed"}
    log = "INFO :      Starting logstream for run_id `3831847892416236757`\n..."
    assert pick_run([mine, earlier], log) == mine
    assert pick_run([earlier, mine], log) == mine
    assert pick_run([earlier], log) == {}  # our run is not listed: unknown, never somebody else's status
    assert pick_run([earlier], "no run id") == {}  # no run started here: never the earlier one
    assert pick_run([earlier, mine], "no run id") == {}
