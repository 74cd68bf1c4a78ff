"""Evaluation records (from a review; each test fails on the code before the fix).

* Pooled client metrics divide each metric by the examples of the clients that reported it: one shared
  denominator made an infinite NLL pull the pooled NLL *down* (0.3 and inf -> 0.15) and a missing key halve it.
* A metric one client reports as +inf and another as -inf has no pooled value (inf - inf): it is NaN (``null`` in
  ``metrics.jsonl``) with a warning naming the key and the nodes; it was a silent NaN.  (+inf with +inf stays
  +inf and finite means are unchanged: checked alongside, those held before.)
* ``metrics.jsonl`` / ``summary.json`` are strict JSON (non-finite values as ``null``): Python wrote ``Infinity``.
* The log table shows the pooled client NLL, ECE and Brier, not only the client accuracy.
* ``metrics.csv`` exists after every round, so a run that stops early still leaves its table.
* A confidence one ulp above a bin edge goes to the bin ``reliability_bins`` says it is in.
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from common.config import parse_run_config
from common.metrics import calibration_bin_sums, reliability_bins
from common.problem import build_problem
from strategies.pgvi import PGVIStrategy
from common.strict_json import dumps_json
from strategies.results import RoundRecorder
from tests.test_strategy_edge_cases import _EvalReply


@pytest.fixture(scope="module")
def strategy() -> PGVIStrategy:
    return PGVIStrategy(build_problem(parse_run_config({})))


def test_an_infinite_client_nll_makes_the_pooled_nll_infinite_not_smaller(strategy):
    replies = [_EvalReply({"num-examples": 100.0, "nll": 0.3, "accuracy": 0.9}, 0),
               _EvalReply({"num-examples": 100.0, "nll": math.inf, "accuracy": 0.7}, 1)]
    out = dict(strategy.aggregate_evaluate(1, replies))
    assert out["client-nll"] == math.inf
    assert out["client-accuracy"] == pytest.approx(0.8)
    assert out["client-num-examples"] == 200.0


def test_a_metric_missing_from_a_reply_is_the_mean_over_the_clients_that_sent_it(strategy):
    replies = [_EvalReply({"num-examples": 100.0, "brier": 0.2, "accuracy": 0.9}, 0),
               _EvalReply({"num-examples": 300.0, "accuracy": 0.5}, 1)]
    out = dict(strategy.aggregate_evaluate(1, replies))
    assert out["client-brier"] == pytest.approx(0.2)
    assert out["client-accuracy"] == pytest.approx((90 + 150) / 400)
    # a classifier beside a regression client: each metric over its own clients' points
    mixed = [_EvalReply({"num-examples": 100.0, "accuracy": 0.9}, 0), _EvalReply({"num-examples": 300.0, "rmse": 2.0}, 1)]
    out = dict(strategy.aggregate_evaluate(1, mixed))
    assert out["client-accuracy"] == pytest.approx(0.9)
    assert out["client-rmse"] == pytest.approx(2.0)
    assert out["client-num-examples"] == 400.0


def test_a_nan_metric_is_left_out_of_its_mean_with_a_warning(strategy, caplog):
    replies = [_EvalReply({"num-examples": 100.0, "nll": 0.3}, 0), _EvalReply({"num-examples": 100.0, "nll": math.nan}, 7)]
    with caplog.at_level(logging.WARNING):
        out = dict(strategy.aggregate_evaluate(1, replies))
    assert out["client-nll"] == pytest.approx(0.3)
    assert "node 7" in caplog.text and "'nll'" in caplog.text


def test_opposite_infinite_client_values_pool_to_nan_with_a_warning_naming_the_key(strategy, caplog, tmp_path):
    replies = [_EvalReply({"num-examples": 100.0, "nll": math.inf, "accuracy": 0.9}, 3),
               _EvalReply({"num-examples": 300.0, "nll": -math.inf, "accuracy": 0.5}, 5)]
    with caplog.at_level(logging.WARNING):
        out = dict(strategy.aggregate_evaluate(1, replies))
    assert math.isnan(out["client-nll"])
    assert out["client-accuracy"] == pytest.approx((90 + 150) / 400)  # the other metrics are unaffected
    warned = [r.getMessage() for r in caplog.records if "'nll'" in r.getMessage()]
    assert len(warned) == 1 and "+inf from node(s) 3" in warned[0] and "-inf from node(s) 5" in warned[0], warned
    assert "undefined" in warned[0]
    rec = RoundRecorder(tmp_path, {})
    rec.record(1, {"round": 1, **out})
    assert _strict_load((tmp_path / "metrics.jsonl").read_text())["client-nll"] is None
    assert "nan" in (tmp_path / "metrics.csv").read_text().splitlines()[1].split(",")


@pytest.mark.parametrize(("a", "b", "pooled"), [(math.inf, math.inf, math.inf), (-math.inf, -math.inf, -math.inf),
                                                (math.inf, 0.5, math.inf), (0.3, 0.5, (30 + 150) / 400)])
def test_same_sign_infinite_values_stay_infinite_and_finite_means_are_unchanged(strategy, caplog, a, b, pooled):
    replies = [_EvalReply({"num-examples": 100.0, "nll": a}, 0), _EvalReply({"num-examples": 300.0, "nll": b}, 1)]
    with caplog.at_level(logging.WARNING):
        out = dict(strategy.aggregate_evaluate(1, replies))
    assert out["client-nll"] == pytest.approx(pooled)
    assert "undefined" not in caplog.text


def test_an_rmse_of_both_infinite_signs_is_infinite_not_undefined(strategy, caplog):
    """The RMSE pools squares: -inf squared is +inf, so +inf and -inf give an infinite pooled RMSE."""
    replies = [_EvalReply({"num-examples": 10.0, "rmse": math.inf}, 0),
               _EvalReply({"num-examples": 10.0, "rmse": -math.inf}, 1)]
    with caplog.at_level(logging.WARNING):
        out = dict(strategy.aggregate_evaluate(1, replies))
    assert out["client-rmse"] == math.inf and "undefined" not in caplog.text


def test_infinite_bin_sums_still_skip_the_reply(strategy):
    good = {"num-examples": 10.0, "ece": 0.1, "ece-bin-13-count": 10.0, "ece-bin-13-conf": 9.0, "ece-bin-13-correct": 8.0}
    bad = {**good, "ece-bin-13-count": math.inf}
    out = dict(strategy.aggregate_evaluate(1, [_EvalReply(good, 0), _EvalReply(bad, 1)]))
    assert out["client-num-examples"] == 10.0
    assert out["client-ece"] == pytest.approx(0.1)


def _strict_load(text: str) -> object:
    def refuse(token: str) -> object:
        raise ValueError(f"non-standard JSON constant {token}")
    return json.loads(text, parse_constant=refuse)


def test_result_files_are_strict_json_and_the_csv_is_written_every_round(tmp_path):
    rec = RoundRecorder(tmp_path, {"seed": 0, "bad": math.nan})
    rec.record(0, {"round": 0, "test-nll": math.inf, "test-accuracy": 0.5})
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["round,test-accuracy,test-nll", "0,0.5,inf"]
    rec.record(1, {"round": 1, "test-nll": math.nan, "test-accuracy": np.float64(0.75)})
    assert (tmp_path / "metrics.csv").read_text().splitlines()[2] == "1,0.75,nan"
    rows = [_strict_load(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"round": 0, "test-nll": None, "test-accuracy": 0.5},
                    {"round": 1, "test-nll": None, "test-accuracy": 0.75}]
    assert _strict_load((tmp_path / "run_config.json").read_text()) == {"bad": None, "seed": 0}
    assert _strict_load(dumps_json({"final": rec.rows[-1], "list": [1.0, -math.inf]})) == {
        "final": {"round": 1, "test-nll": None, "test-accuracy": 0.75}, "list": [1.0, None]}


def test_the_log_table_shows_the_pooled_client_metrics(tmp_path, monkeypatch):
    # the recorder's own log calls, whatever level or handlers other tests left on Flower's logger
    import strategies.results as results

    lines: list[str] = []
    monkeypatch.setattr(results, "log", lambda level, msg, *args: lines.append(msg % args if args else msg))
    rec = RoundRecorder(tmp_path, {})
    row = {"round": 1, "client-accuracy": 0.91, "client-nll": 0.3456, "client-ece": 0.0789, "client-brier": 0.1234}
    rec.record(1, row)
    text = "\n".join(lines)
    assert "cli nll" in text and "cli ece" in text and "cli brier" in text
    assert "0.3456" in text and "0.0789" in text and "0.1234" in text


def test_a_confidence_one_ulp_above_an_edge_is_in_the_bin_above_it():
    edges = np.arange(16) / 15
    for k in range(8, 15):  # binary top-label confidences are >= 1/2
        for c in (np.nextafter(edges[k], 2.0), edges[k], np.nextafter(edges[k], 0.0)):
            p, y = np.array([[1.0 - c, c]]), np.array([1])
            b = int(np.argmax(calibration_bin_sums(p, y)[0]))
            rb = reliability_bins(p, y)
            assert rb["lower"][b] < c <= rb["upper"][b], (k, c, b)


def test_finite_client_values_near_the_float_range_pool_without_overflow(strategy):
    """n x value overflowed: 1e308 beside -1e308 pooled to inf - inf = NaN without a word, and 1e306 from 300
    examples to inf (review of this change set)."""
    replies = [_EvalReply({"num-examples": 100.0, "nll": 1e308}, 0), _EvalReply({"num-examples": 100.0, "nll": -1e308}, 1)]
    assert dict(strategy.aggregate_evaluate(1, replies))["client-nll"] == 0.0
    replies = [_EvalReply({"num-examples": 300.0, "nll": 1e306}, 0), _EvalReply({"num-examples": 100.0, "nll": 1e306}, 1)]
    assert dict(strategy.aggregate_evaluate(1, replies))["client-nll"] == pytest.approx(1e306)


@pytest.mark.parametrize("n_samples", [0, -3, True, 2.5])
@pytest.mark.parametrize("model", ["gaussian_location", "logistic_regression"])
def test_evaluate_posterior_refuses_a_bad_number_of_samples_for_every_model(model, n_samples):
    """Stop-30 review: the regression path failed with 'math domain error' (0) or a raw torch error instead."""
    from common.evaluation import evaluate_posterior
    dataset = "synthetic_gaussian_location" if model == "gaussian_location" else "breast_cancer"
    problem = build_problem(parse_run_config({"model": model, "dataset": dataset}))
    x, y = (np.zeros((4, 0)), np.ones((4, 1))) if model == "gaussian_location" else (np.ones((4, 30)), np.array([0, 1] * 2))
    with pytest.raises(ValueError, match="n_samples must be an integer >= 1"):
        evaluate_posterior(problem, problem.prior, x, y, n_samples)


def test_a_reused_output_dir_never_writes_through_a_metrics_symlink_and_loses_killed_temp_files(tmp_path):
    """Review of stop 35: metrics.jsonl was truncated and appended to through a symlink left in a reused output
    directory (every other record replaces its link), and a killed run's temp files stayed for good."""
    import os
    import time

    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(victim)
    old_tmp, fresh_tmp = out / ".metrics.k1ndpxti.tmp", out / ".summary.abcd1234.tmp"
    for t in (old_tmp, fresh_tmp):
        t.write_bytes(b"partial")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))  # a killed run's; the fresh one may be in progress
    rec = RoundRecorder(out, {"seed": 0})
    rec.record(1, {"round": 1, "test-accuracy": 0.5})
    assert victim.read_text() == "precious data\n"
    assert not (out / "metrics.jsonl").is_symlink()
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not old_tmp.exists() and fresh_tmp.exists()


def test_result_files_follow_the_umask(tmp_path):
    """atomic_write set 0644 whatever the umask: under umask 077 metrics.jsonl and the checkpoint were private and
    sites.npz (the same per-client sites) world-readable."""
    import os
    import stat

    from common.atomic_io import atomic_write

    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "a.json", lambda f: f.write(b"{}"), mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o600
    os.umask(0o022)
    try:
        atomic_write(tmp_path / "b.json", lambda f: f.write(b"{}"), mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o644


def test_a_metrics_jsonl_deleted_mid_run_is_recreated(tmp_path):
    """An operator (or log rotation) removing metrics.jsonl between rounds made every later record() raise
    FileNotFoundError and stop the run; the rows from then on are written to a new file."""
    rec = RoundRecorder(tmp_path, {"seed": 0})
    rec.record(1, {"round": 1, "test-accuracy": 0.5})
    (tmp_path / "metrics.jsonl").unlink()
    rec.record(2, {"round": 2, "test-accuracy": 0.6})
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2]
