"""scripts/byzantine.py on a tiny configuration: 3 honest + 1 Byzantine client, 1 round, 2 local epochs.

Checks the table's rows, that accuracies are finite and consistent with the records each run writes, that the
differences are computed against the right reference, and that the fault really reaches the server (a scaled
Byzantine Delta moves the plain-sum posterior; the honest runs with sum and norm clipping coincide).
"""

from __future__ import annotations

import json
import math

import pytest

from scripts.byzantine import AGGREGATORS, ATTACKS, HONEST, experiment_config, markdown_table, run_experiment
from scripts.run_inprocess import load_run_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("byzantine")
    raw = experiment_config(load_run_config([]), honest=3, rounds=1, local_epochs=2,
                            overrides={"eval-samples": 10, "mc-samples": 2})
    return raw, out, run_experiment(raw, out_dir=out, jobs=1)


def test_table_has_one_row_per_scenario_and_aggregator(tiny):
    raw, _, rows = tiny
    assert raw["num-clients"] == raw["min-clients"] == 4
    assert raw["schedule"] == "synchronous" and raw["damping"] == "auto"
    keys = [(r["scenario"], r["aggregator"]) for r in rows]
    expected = [(HONEST, a) for a in AGGREGATORS] + [(f, a) for f in ATTACKS for a in AGGREGATORS]
    assert keys == expected


def test_accuracies_are_finite_and_match_the_records(tiny):
    _, out, rows = tiny
    for r in rows:
        for k in ("final-accuracy", "best-accuracy", "final-nll", "mean-shift", "precision-ratio"):
            assert math.isfinite(r[k]), (r["scenario"], r["aggregator"], k)
        assert 0.0 <= r["final-accuracy"] <= r["best-accuracy"] <= 1.0
        name = f"{r['scenario'].replace(':', '')}-{r['aggregator']}"
        recorded = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [row["round"] for row in recorded] == [0.0, 1.0]
        assert recorded[-1]["test-accuracy"] == r["final-accuracy"]
        assert r["accuracy-by-round"] == [row["test-accuracy"] for row in recorded[1:]]


def test_differences_are_against_the_honest_runs(tiny):
    _, _, rows = tiny
    by = {(r["scenario"], r["aggregator"]): r for r in rows}
    ref = by[(HONEST, "sum")]
    assert ref["final-diff-pts"] == 0.0 and ref["mean-shift"] == 0.0 and ref["precision-ratio"] == 1.0
    for r in rows:
        assert r["final-diff-pts"] == pytest.approx(100 * (r["final-accuracy"] - ref["final-accuracy"]), abs=1e-12)
        assert r["best-diff-pts"] == pytest.approx(100 * (r["best-accuracy"] - ref["best-accuracy"]), abs=1e-12)
        same = by[(HONEST, r["aggregator"])]
        assert r["final-diff-same-agg-pts"] == pytest.approx(
            100 * (r["final-accuracy"] - same["final-accuracy"]), abs=1e-12)
    table = markdown_table(rows)
    assert len(table.splitlines()) == 2 + len(rows)


def test_the_byzantine_client_reaches_the_server(tiny):
    _, _, rows = tiny
    by = {(r["scenario"], r["aggregator"]): r for r in rows}
    # no attacker: adaptive clipping (2 x median norm) leaves the honest Deltas unchanged
    assert by[(HONEST, "norm_clip")]["mean-shift"] == 0.0
    # 10 x one client's Delta under plain sum: more precision and a moved mean
    scaled = by[("scale:10", "sum")]
    assert scaled["precision-ratio"] > 1.5 and scaled["mean-shift"] > 1e-3
    # clipping bounds that client's contribution
    assert by[("scale:10", "norm_clip")]["precision-ratio"] < scaled["precision-ratio"]
    for r in rows:
        assert r["applied"] + r["rejected"] == 4


def test_tables_rebuilt_from_the_records_are_the_same(tiny):
    raw, out, rows = tiny
    again = run_experiment(raw, out_dir=out, from_records=True)
    assert again == rows


@pytest.mark.parametrize("attack", ["fllip", "scale10", "scale:", "scale:nan", "scale:inf", "nan"])
def test_an_unknown_attack_is_refused_before_anything_runs(attack, tmp_path):
    """The client runs an unknown fault as an honest update: a typo gave an honest row under an attack's name."""
    from scripts import byzantine

    with pytest.raises(ValueError, match="unknown attack"):
        byzantine.run_experiment({}, (attack,), ("sum",), tmp_path, 1)
    assert not any(tmp_path.iterdir())
    for ok in ("flip", "scale:10", "scale:-0.5"):
        byzantine.check_attack(ok)


def test_tables_from_records_of_different_settings_are_refused(tiny, tmp_path):
    """``--from-records`` on a directory holding runs of several commands (another seed, another number of rounds,
    a scale factor recorded under another name): before, their rows were put in one table and compared."""
    import shutil

    from scripts import byzantine

    raw, out, rows = tiny
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    for name, changes in (("flip-median", {"seed": raw["seed"] + 1}), ("scale10-sum", {"num-server-rounds": 2})):
        path = mixed / name / "run_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    timing = mixed / "honest-median" / "byzantine.json"
    timing.write_text(json.dumps({**json.loads(timing.read_text()), "scenario": "scale:10"}))
    with pytest.raises(ValueError, match="runs of different settings") as err:
        run_experiment(raw, out_dir=mixed, from_records=True)
    msg = str(err.value)
    assert f"flip-median: seed {raw['seed'] + 1} (honest-sum: {raw['seed']})" in msg
    assert "scale10-sum: num-server-rounds 2 (honest-sum: 1)" in msg
    assert "honest-median: run as the scenario 'scale:10' (byzantine.json), not 'honest'" in msg
    assert len(msg.splitlines()) == 4, msg  # the three runs above, nothing else
    assert byzantine.mixed_settings(byzantine.specs_for(ATTACKS, AGGREGATORS, True), out) == []
