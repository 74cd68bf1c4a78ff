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


# ------------------------------------------------------------------- bad command lines (stop-31 docs review, finding 7)
class _Ran(Exception):
    """Raised by the stand-in for ``run_experiment``: the command line got as far as running the experiment."""


@pytest.fixture
def cli(monkeypatch, capsys):
    """``scripts/byzantine.py``'s ``main`` on an argv, with ``run_experiment`` replaced by a stand-in that records its
    arguments and raises :class:`_Ran`: returns (exit code or "ran", stderr, the stand-in's calls)."""
    import sys

    from scripts import byzantine

    calls: list[tuple] = []

    def stand_in(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Ran

    monkeypatch.setattr(byzantine, "run_experiment", stand_in)

    def run(*argv: str):
        monkeypatch.setattr(sys, "argv", ["byzantine.py", *argv])
        try:
            byzantine.main()
        except SystemExit as exc:
            return exc.code, capsys.readouterr().err, calls
        except _Ran:
            return "ran", capsys.readouterr().err, calls
        return 0, capsys.readouterr().err, calls

    return run


@pytest.mark.parametrize("argv,says", [
    (["--honest", "0"], "argument --honest: must be an integer >= 1, got 0"),
    (["--rounds", "-1"], "argument --rounds: must be an integer >= 1, got -1"),
    (["--jobs", "0"], "argument --jobs: must be an integer >= 1, got 0"),
    (["--local-epochs", "0"], "argument --local-epochs: must be an integer >= 1, got 0"),
    (["--aggregators", "sum,foo"], "--aggregators: unknown aggregator 'foo'; known: sum, norm_clip"),
    (["-c", "lr"], "-c 'lr': expected space-separated key=value pairs"),
    (["-c", "partitioner=iid"], "is not a TOML value"),
    (["-c", "lr=-1"], "lr: Input should be greater than 0"),
    # two runs of one scenario wrote one directory at once (interleaved metrics.jsonl, 9 'applied' of 6)
    (["--attacks", "scale:10,scale:10"], "--attacks: listed twice: scale:10"),
    (["--aggregators", "median,median"], "--aggregators: listed twice: median"),
])
def test_bad_options_are_argparse_errors_before_anything_runs(cli, argv, says):
    """Before: ValueError / TOMLDecodeError tracebacks (experiment_config outside the try, run_experiment re-raised
    unless --from-records), or, for a bad -c value, every run failing in its own process."""
    code, err, calls = cli(*argv)
    assert code == 2, (code, err)
    assert err.strip().splitlines()[-1].startswith("byzantine.py: error: ") and says in err, err
    assert calls == []


@pytest.mark.parametrize("override,option", [
    ('aggregator="median"', "--aggregators"),
    ("num-server-rounds=2", "--rounds"),
    ("local_epochs=3", "--local-epochs"),
    ("num-clients=5", "--honest"),
    ('output-dir="elsewhere"', "--out"),
])
def test_a_c_override_of_a_key_an_option_sets_is_refused_naming_the_option(cli, override, option):
    """Before, ``-c aggregator=...`` was overwritten run by run without a word (each run sets its aggregator), though
    the comment said the -c overrides win; the other keys silently overrode the option the tables stand for."""
    code, err, calls = cli("-c", override)
    assert code == 2 and f"is set by {option}" in err, (code, err)
    assert calls == []


def test_other_c_overrides_still_reach_every_run(cli):
    code, _, calls = cli("--honest", "3", "--aggregators", "sum,norm_clip", "-c", "aggregator-clip-multiplier=1.0",
                         "-c", "eval-samples=10 mc-samples=2", "-c", "damping=0.5")
    assert code == "ran" and len(calls) == 1
    raw = calls[0][0][0]
    assert raw["aggregator-clip-multiplier"] == 1.0 and raw["eval-samples"] == 10 and raw["mc-samples"] == 2
    assert raw["damping"] == 0.5 and raw["num-clients"] == 4  # a fixed setting of the experiment may be overridden
    assert raw.get("aggregator") == load_run_config([]).get("aggregator")  # each run sets its own


def test_from_records_without_the_records_is_an_error_not_a_traceback(cli, tmp_path):
    """Before: FileNotFoundError tracebacks (only a ValueError was turned into a message)."""
    code, err, calls = cli("--from-records", "--out", str(tmp_path / "missing"))
    assert code == 2 and "--from-records:" in err and "is not a directory" in err, (code, err)
    assert calls == []


def test_from_records_of_runs_the_directory_does_not_hold_is_an_error_not_a_traceback(monkeypatch, capsys, tmp_path):
    """An existing --out without these runs' records (the real ``run_experiment``, which only reads)."""
    import sys

    from scripts import byzantine

    monkeypatch.setattr(sys, "argv", ["byzantine.py", "--from-records", "--out", str(tmp_path), "--attacks", "flip"])
    with pytest.raises(SystemExit) as exc:
        byzantine.main()
    assert str(exc.value).startswith(f"error: no records of this run in {tmp_path}: ")
    assert "honest-sum/metrics.jsonl is missing" in str(exc.value)
