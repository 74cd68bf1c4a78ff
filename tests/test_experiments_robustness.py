"""scripts/experiments.py: a batch is checked as a whole before its first run, a failed run fails the batch, an
early-stopped run is neither skipped nor hidden, and ``rescore`` cannot make a run's summary inconsistent.

No real run is started: ``subprocess.call`` is replaced by a stand-in that validates the run config as
``run_inprocess.py`` does and writes the records a run leaves (``run_config.json``, ``metrics.jsonl``,
``summary.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.config import parse_run_config
from scripts import experiments as E
from scripts.simulate import pyproject_run_config
from tests.test_experiments import _fake_run, _finished


def _stand_in(calls: list[str], rc: dict[str, int] | None = None):
    """A ``subprocess.call`` for ``execute``'s command: exit 1 on an invalid run config (as run_inprocess.py),
    or the exit code ``rc`` gives the run's directory name; otherwise the records of a complete run."""
    def call(cmd, **_):
        out = Path(cmd[cmd.index("--out") + 1])
        calls.append(out.name)
        overrides = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-c"]
        try:
            cfg = parse_run_config(pyproject_run_config(overrides)).to_flat()
        except ValueError:
            return 1
        if (rc or {}).get(out.name, 0):
            return rc[out.name]
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(cfg))
        rows = [{"round": float(i), "test-accuracy": 0.5, "test-nll": 1.0, "test-ece": 0.1, "test-brier": 0.3}
                for i in range(int(cfg["num-server-rounds"]) + 1)]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (out / "summary.json").write_text("{}")
        return 0
    return call


@pytest.fixture
def calls(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.setattr(E, "RUNS", tmp_path / "runs")
    got: list[str] = []
    monkeypatch.setattr(E.subprocess, "call", _stand_in(got))
    return got


# ------------------------------------------------------------------------------------- finding 3
def test_run_names_planned_twice_are_refused_before_any_run(calls, capsys):
    """0.1 and 0.10000001 are both ``noise10``: before, the first run ran and the second was refused mid-batch as
    a finished run with other settings (RunConfigMismatch), so the batch stopped half-way."""
    with pytest.raises(SystemExit, match="planned more than once.*nothing was run"):
        E.main(["fmnist-noise", "--noise", "0.1", "0.10000001", "--seeds", "0", "--methods", "pvi"])
    assert calls == []
    err = capsys.readouterr().err
    assert "pvi-noise10-seed0: planned 2 times (label-noise=0.1; label-noise=0.10000001)" in err
    with pytest.raises(SystemExit, match="planned more than once"):  # a repeated seed: the same settings twice
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "0", "--methods", "pvi"])
    assert "pvi-noise40-seed0: planned 2 times (the same settings each time)" in capsys.readouterr().err
    assert calls == []


# ------------------------------------------------------------------------------------- finding 4
def test_an_invalid_run_config_is_refused_before_the_first_run(calls, capsys):
    """Before, each run started its own process, failed there on the config, and the batch exited 0."""
    with pytest.raises(SystemExit, match="invalid run config.*nothing was run"):
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "pvi", "-c", "lr=-1"])
    assert calls == []
    err = capsys.readouterr().err
    assert "lr: Input should be greater than 0" in err and "pvi-noise40-seed0, pvi-noise40-seed1" in err
    # a -c value that is not TOML (an unquoted string) is an argparse error, not a TOMLDecodeError traceback
    with pytest.raises(SystemExit) as exc:
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "--methods", "pvi", "-c", "partitioner=iid"])
    assert exc.value.code == 2 and "-c 'partitioner=iid'" in capsys.readouterr().err
    assert calls == []


def test_a_failed_run_makes_the_batch_exit_non_zero_after_the_other_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "RUNS", tmp_path / "runs")
    calls: list[str] = []
    monkeypatch.setattr(E.subprocess, "call", _stand_in(calls, rc={"pvi-noise40-seed0": 1}))
    with pytest.raises(SystemExit, match=r"1 of 2 run\(s\) failed or ended early: pvi-noise40-seed0;") as exc:
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "pvi"])
    assert exc.value.code not in (0, None)
    assert calls == ["pvi-noise40-seed0", "pvi-noise40-seed1"]  # the batch went on after the failure
    # the runs that succeeded are skipped next time; the failed one is run again
    calls.clear()
    monkeypatch.setattr(E.subprocess, "call", _stand_in(calls))
    E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "pvi"])
    assert calls == ["pvi-noise40-seed0"]


# ------------------------------------------------------------------------------------- finding 5
@pytest.mark.parametrize("argv,override,says", [
    (["fmnist-noise", "--noise", "0.0", "0.4", "--methods", "pvi"], "label-noise=0.2", "set run by run by --noise"),
    (["fmnist-noise", "--noise", "0.4", "--methods", "pvi"], "label-noise=0.2", "set run by run by --noise"),
    (["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "pvi"], "seed=3", "by --seeds"),
    (["fmnist-noise", "--noise", "0.4", "--methods", "fedgvi", "pvi"], 'loss="nll"', "fedgvi: \"gce\"; pvi: \"nll\""),
    (["fmnist-noise", "--noise", "0.4", "--methods", "pvi"], 'loss="gce"', "a setting of the method"),
    (["fmnist-noise", "--noise", "0.4", "--methods", "fedgvi"], "loss-delta=0.5", "(fedgvi: 0.8)"),
    (["fmnist-noise", "--noise", "0.4", "--methods", "fedgvi", "gvi1"], "num-clients=5", "(gvi1: 1)"),
    (["fmnist-noniid", "--schedules", "synchronous", "sequential"], 'schedule="sequential"', "by --schedules"),
    (["fmnist-noniid", "--schedules", "synchronous"], "num-server-rounds=25", "by --rounds"),
])
def test_a_config_override_of_a_key_set_run_by_run_is_refused(calls, capsys, argv, override, says):
    """Before, ``-c`` won over every run's own value: e.g. all noise levels, or FedGVI and PVI, became one run."""
    with pytest.raises(SystemExit, match="sets run by run; nothing was run"):
        E.main([*argv, "-c", override])
    assert says in capsys.readouterr().err
    assert calls == []


def test_a_config_override_the_runs_share_is_still_applied(monkeypatch, tmp_path):
    """A variant of the same runs (a loss weight, a budget: the report labels both) stays allowed."""
    got: list = []
    monkeypatch.setattr(E, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(E, "execute", lambda run, dry_run=False: got.append(run))
    E.main(["fmnist-noise", "--noise", "0.0", "0.4", "--seeds", "0", "--methods", "fedgvi", "--suffix=-w10",
            "-c", "loss-weight=10", "-c", "num-server-rounds=25"])
    assert [(r.name, r.config["loss-weight"], r.config["num-server-rounds"]) for r in got] == [
        ("fedgvi-noise00-seed0-w10", 10, 25), ("fedgvi-noise40-seed0-w10", 10, 25)]


def test_an_override_of_a_key_that_differs_between_the_planned_runs_is_refused():
    runs = [E.Run("fmnist_noise", "a", "pvi", {"lr": 0.001}), E.Run("fmnist_noise", "b", "pvi", {})]
    assert E.per_run_overrides(runs, {"lr": 0.003}) == [
        "-c lr=0.003: lr differs between the planned runs (0.001 / null, null = not set: the default), e.g. by "
        "--methods; every run would get the same value. Run the runs that should get it in a command of their own"]
    assert E.per_run_overrides(runs, {"patience": 2}) == []


# ------------------------------------------------------------------------------------- finding 6
def test_an_early_stopped_run_is_not_done_is_run_again_and_the_report_lists_it(calls, tmp_path, monkeypatch,
                                                                                capsys):
    """A run that wrote summary.json after 2 of its 10 rounds (e.g. an asynchronous run at its deadline): before,
    it counted as done, so it was skipped on every rerun, and the report left it out with a stderr warning only."""
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    monkeypatch.setattr(E, "_plot_reliability", lambda *a: None)
    short, full = E.fmnist_noise_runs(["pvi"], [0.4], [0, 1])
    _finished(short, E.requested_config(short), rounds=2)
    _finished(full, E.requested_config(full))
    assert not short.done and full.done and short.finished
    assert E.unfinished_reason(short.out) == "stopped after round 2 of 10"
    text = E.report_fmnist_noise(E.RUNS / "fmnist_noise")
    assert "| PVI | acc final | 50.00 (1 seed) |" in text  # the complete run only
    assert "Incomplete runs, not in the tables:\n- pvi-noise40-seed0: stopped after round 2 of 10" in text
    assert "- pvi-noise40-seed0: stopped after round 2 of 10" in (E.RUNS / "fmnist_noise" / "table.md").read_text()
    capsys.readouterr()
    E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "pvi"])
    assert calls == ["pvi-noise40-seed0"]  # run again; the complete run is skipped
    out = capsys.readouterr().out
    assert "[redo] pvi-noise40-seed0" in out and "stopped after round 2 of 10" in out
    assert "[skip] pvi-noise40-seed1" in out and short.done
    # an ended run with other settings is still refused, complete or not (never overwritten as if it were this one)
    other = E.fmnist_noise_runs(["pvi"], [0.4], [2])[0]
    _finished(other, {**E.requested_config(other), "lr": 0.003}, rounds=1)
    with pytest.raises(SystemExit, match="other settings"):
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "2", "--methods", "pvi"])


# ------------------------------------------------------------------------------------- finding 2
def _rescored_run(tmp_path, monkeypatch, predicted_right: int):
    """A finished 2-round run (final accuracy 0.5 on 10 test points, best 0.6) rescored from a final model whose
    predictions get ``predicted_right`` of the 10 points right."""
    d = _fake_run(tmp_path, "pvi-noise40-seed0", "pvi", 0.4, 0, [0.6, 0.5], [0.1, 0.2])
    y = np.arange(10) % 3
    log_probs = np.log(np.full((10, 3), 0.05))
    right = np.arange(10) < predicted_right
    log_probs[np.arange(10), np.where(right, y, (y + 1) % 3)] = np.log(0.9)
    monkeypatch.setattr(E, "_final_predictive", lambda run_dir, method: (np.exp(log_probs), log_probs, y))
    E.rescore(tmp_path)
    return d, -float(np.mean(log_probs[np.arange(10), y]))


def test_rescoring_with_other_draws_never_replaces_the_recorded_final_metrics(tmp_path, monkeypatch, capsys):
    """Before: the rescored accuracy (1.0, other draws) replaced the recorded final one (0.5), so the summary had
    final accuracy 1.0 > best 0.6, and a final ECE and NLL of another evaluation than every other round's."""
    d, _ = _rescored_run(tmp_path, monkeypatch, predicted_right=10)
    printed = capsys.readouterr().out
    s = E.summarise(d)
    assert (s["final-accuracy"], s["best-accuracy"]) == (0.5, 0.6)
    assert (s["final-ece"], s["final-nll"], s["final-brier"]) == (0.2, 0.5, 0.3)  # the recorded ones
    assert "other draws: not used by the report" in printed
    assert "computed with other draws than the run's own" in capsys.readouterr().err


def test_rescoring_with_the_runs_own_draws_replaces_the_final_nll_only(tmp_path, monkeypatch):
    d, exact_nll = _rescored_run(tmp_path, monkeypatch, predicted_right=5)  # the recorded accuracy: same draws
    assert json.loads((d / E.RESCORED).read_text())["same-draws"]
    s = E.summarise(d)
    assert s["final-nll"] == pytest.approx(exact_nll) and s["final-nll"] != 0.5
    assert (s["final-accuracy"], s["final-ece"], s["final-brier"]) == (0.5, 0.2, 0.3)  # the recorded ones
    assert s["best-accuracy"] >= s["final-accuracy"] and s["best-ece"] <= s["final-ece"]
    assert s["best-nll"] <= s["final-nll"] and s["best-nll"] == min(1.0, exact_nll)


def test_run_experiments_sh_exits_non_zero_naming_a_failed_command_after_running_the_others(tmp_path):
    """Before, a failed command (failed run or refused plan) in a lane left only a line in that lane's log, and
    the script's exit status was the report's: 0.  The script is run in a copy of the tree whose
    ``.venv/bin/python`` only records its arguments (and fails for the one-client references)."""
    import subprocess

    script = Path(E.__file__).with_name("run_experiments.sh")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_experiments.sh").write_text(script.read_text())
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/bash\nshift\necho "$*" >> "$(dirname "$0")/../../calls.txt"\n'
                    'case " $* " in *" gvi1 "*) exit 3;; esac\nexit 0\n')
    fake.chmod(0o755)
    res = subprocess.run(["bash", str(tmp_path / "scripts" / "run_experiments.sh")], capture_output=True, text=True,
                         timeout=120)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    planned = [line for line in script.read_text().splitlines() if line.strip().startswith("$E ")]
    assert len(calls) == len(planned) and calls[-1] == "report"  # every command ran, the report last
    assert res.returncode == 1, res.stderr
    assert "exit 3: scripts/experiments.py fmnist-noise --noise 0.4 --seeds 0 --methods gvi1 vi1" in res.stderr
    assert res.stderr.count("exit ") == 1


# ------------------------------------------------------------------------------------- stop 30
def test_a_run_that_exits_0_before_its_planned_rounds_fails_the_batch(tmp_path, monkeypatch, capsys):
    """An asynchronous run at its deadline, or one whose clients all failed, writes summary.json and exits 0 after
    fewer rounds than planned. Before, the batch exited 0 as if every run were done (only a rerun said "[redo]")."""
    monkeypatch.setattr(E, "RUNS", tmp_path / "runs")
    calls: list[str] = []
    complete = _stand_in(calls)

    def short_first(cmd, **kw):
        rc = complete(cmd, **kw)
        out = Path(cmd[cmd.index("--out") + 1])
        if out.name == "pvi-noise40-seed0":  # keep the prior's row and round 1 only
            rows = (out / "metrics.jsonl").read_text().splitlines()[:2]
            (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
        return rc

    monkeypatch.setattr(E.subprocess, "call", short_first)
    with pytest.raises(SystemExit, match=r"1 of 2 run\(s\) failed or ended early: pvi-noise40-seed0;"):
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "pvi"])
    assert calls == ["pvi-noise40-seed0", "pvi-noise40-seed1"]
    assert "pvi-noise40-seed0: exit 0 but stopped after round 1 of 10" in capsys.readouterr().out


def test_several_pairs_in_one_c_are_told_to_use_one_c_each(calls, capsys):
    with pytest.raises(SystemExit) as exc:
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "--methods", "pvi", "-c", "lr=0.1 seed=2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "one key=value per -c" in err and "strings quoted" not in err, err
    assert calls == []


def test_an_underscore_spelling_of_a_key_set_run_by_run_is_refused_as_that_key(calls, capsys):
    """``-c label_noise=0.2``: the run config takes field names too, so it was not seen as the --noise key; the
    error then named "label-noise" as an unknown key."""
    with pytest.raises(SystemExit, match="sets run by run; nothing was run"):
        E.main(["fmnist-noise", "--noise", "0.4", "--methods", "pvi", "-c", "label_noise=0.2"])
    assert "-c label_noise=0.2: label-noise is set run by run by --noise" in capsys.readouterr().err
    assert calls == []


# ------------------------------------------------------------------- stop-31 docs review (findings 6 and 7)
@pytest.mark.parametrize("override", ['output-dir="x"', 'output_dir="x"'])
def test_an_output_dir_override_is_refused_in_the_plan_check(calls, capsys, override):
    """run_inprocess.py refuses ``-c output-dir`` (its records go to --out): the plan was accepted, and then every
    run exited 2."""
    with pytest.raises(SystemExit, match="sets run by run; nothing was run"):
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "--methods", "pvi", "-c", override])
    err = capsys.readouterr().err
    assert f"-c {override.split('=')[0]}=\"x\": output-dir is not taken here" in err
    assert "choose the names with --suffix" in err
    assert calls == []


@pytest.mark.parametrize("noise", ["nan", "inf", "NaN"])
def test_a_non_finite_noise_level_is_an_argparse_error(calls, capsys, noise):
    """Before: ValueError 'cannot convert float NaN to integer' (OverflowError for inf) while naming the runs."""
    with pytest.raises(SystemExit) as exc:
        E.main(["fmnist-noise", "--noise", "0.4", noise, "--seeds", "0", "--methods", "pvi", "--dry-run"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument --noise: must be a finite number >= 0, got '{noise}'" in err, err
    assert calls == []
