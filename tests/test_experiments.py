"""The experiment runner: every planned run has a valid config, and the report's best/final statistics."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from common.config import parse_run_config
from scripts import experiments as E


def test_every_planned_run_is_a_valid_run_config_with_the_method_settings():
    runs = E.fmnist_noise_runs(list(E.METHODS), [0.0, 0.4], [0, 1]) + E.fmnist_noniid_runs(
        ["fedgvi", "fedavg"], ["synchronous", "sequential", "asynchronous"], [0], rounds=5)
    assert len({r.name for r in runs}) == len(runs)
    for r in runs:
        cfg = parse_run_config(r.config)  # raises on any invalid key or value
        assert cfg.dataset == "fashion_mnist" and cfg.hidden_sizes == [200]
        if r.method == "pvi":
            assert (cfg.loss, cfg.divergence) == ("nll", "kl")
        if r.method == "fedgvi":
            assert (cfg.loss, cfg.loss_delta, cfg.divergence, cfg.divergence_alpha) == ("gce", 0.8, "alpha_renyi", 2.5)
        if r.experiment == "fmnist_noniid":
            assert (cfg.num_clients, cfg.partitioner, cfg.dirichlet_alpha) == (10, "dirichlet", 0.3)
    # FedAvg has only the synchronous schedule
    assert {r.tags["schedule"] for r in runs if r.method == "fedavg" and r.experiment == "fmnist_noniid"} == {"synchronous"}


def _fake_run(root, name, method, noise, seed, accs, eces, **extra):
    d = root / name
    d.mkdir(parents=True)
    (d / "run_config.json").write_text(json.dumps({"label-noise": noise, "seed": seed, "schedule": "synchronous",
                                                   "num-server-rounds": len(accs), "local-epochs": 3,
                                                   **({"method": "fedavg"} if method == "fedavg" else {}), **extra}))
    rows = [{"round": 0.0, "test-accuracy": 0.1, "test-nll": 2.3, "test-ece": 0.0, "test-brier": 0.9}]
    for i, (a, e) in enumerate(zip(accs, eces), start=1):
        rows.append({"round": float(i), "test-accuracy": a, "test-nll": 1.0 / i, "test-ece": e, "test-brier": 0.3,
                     "client-seconds-mean": 2.0 * i})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "summary.json").write_text(json.dumps({"wall-seconds": 12.0}))
    return d


def test_summarise_reports_best_over_rounds_and_final_round_separately(tmp_path):
    d = _fake_run(tmp_path, "fedgvi-noise40-seed0", "fedgvi", 0.4, 0, [0.80, 0.86, 0.84], [0.05, 0.02, 0.03])
    s = E.summarise(d)
    assert s["method"] == "fedgvi" and s["noise"] == 0.4 and s["rounds"] == 3
    assert s["best-accuracy"] == 0.86 and s["final-accuracy"] == 0.84  # round 0 (the prior) is not a candidate
    assert s["best-ece"] == 0.02 and s["final-ece"] == 0.03 and s["final-nll"] == pytest.approx(1 / 3)
    assert s["client-seconds-per-round"] == pytest.approx(4.0)
    (d / "summary.json").unlink()
    assert E.summarise(d) is None  # an unfinished run is not reported
    short = _fake_run(tmp_path, "fedgvi-noise40-seed1", "fedgvi", 0.4, 1, [0.80, 0.86], [0.05, 0.02],
                      **{"num-server-rounds": 5})
    assert E.summarise(short) is None  # finished early (e.g. an asynchronous deadline): not reported either


def test_variant_label_names_loss_weight_and_learning_rate_when_not_default():
    assert E._variant_label("pvi", {"lr": E.FMNIST_BASE["lr"]}) == "PVI"
    assert E._variant_label("fedgvi", {"loss-weight": 50.0, "lr": 0.003}) == (
        "FedGVI (GCE 0.8 + AR 2.5), loss weight 50, lr 0.003")
    assert E._variant_label("pvi", {"lr": 0.003}) == "PVI, lr 0.003"
    assert E._variant_label("fedavg", {"lr": 0.003, "fedavg-lr": 0.1}) == "FedAvg"  # FedAvg has its own lr


def test_report_table_has_mean_and_sample_std_over_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    monkeypatch.setattr(E, "_plot_reliability", lambda *a: None)  # needs real posteriors
    for seed, final in enumerate([0.80, 0.84, 0.88]):
        _fake_run(tmp_path, f"pvi-noise40-seed{seed}", "pvi", 0.4, seed, [0.5, final], [0.1, 0.1])
    _fake_run(tmp_path, "fedavg-noise40-seed0", "fedavg", 0.4, 0, [0.6, 0.5], [0.2, 0.3])
    # a variant: another budget and a loss weight gets its own table and its own label, never pooled with PVI
    _fake_run(tmp_path, "fedgvi-noise40-seed0-long", "fedgvi", 0.4, 0, [0.5, 0.7, 0.9], [0.1, 0.1, 0.05],
              **{"loss-weight": 10.0, "local-epochs": 5})
    _fake_run(tmp_path, "fedgvi-noise40-seed0-e20", "fedgvi", 0.4, 0, [0.5, 0.7, 0.95], [0.1, 0.1, 0.05],
              **{"loss-weight": 10.0, "local-epochs": 20})
    text = E.report_fmnist_noise(tmp_path)
    assert "**2 rounds, <= 3 local epochs / 2 rounds, 0 local epochs (FedAvg)**" in text
    assert "**3 rounds, <= 5 local epochs / 3 rounds, <= 20 local epochs**" in text
    long_table = text.split("**3 rounds, <= 5 local epochs / 3 rounds, <= 20 local epochs**")[1].split("| run |")[0]
    # two epoch budgets with the same rounds: two rows, never pooled into one cell
    assert "| FedGVI (GCE 0.8 + AR 2.5), loss weight 10 [<= 5 local epochs] | acc final | 90.00 (1 seed) |" in long_table
    assert "| FedGVI (GCE 0.8 + AR 2.5), loss weight 10 [<= 20 local epochs] | acc final | 95.00 (1 seed) |" in long_table
    assert "PVI" not in long_table
    assert "| FedGVI (GCE 0.8 + AR 2.5), loss weight 10 [<= 5 local epochs] | issue reference (best) | 87.21 |" in long_table
    row = next(line for line in text.splitlines() if line.startswith("| PVI | acc final"))
    assert f"{84.0:.2f} ± {np.std([80, 84, 88], ddof=1):.2f} (3 seeds)" in row
    assert "| FedAvg | acc best | 60.00 (1 seed) |" in text
    assert "| PVI | issue reference (best) | 82.81 |" in text
    assert (tmp_path / "results.csv").exists() and len(json.loads((tmp_path / "results.json").read_text())) == 6
    # file names depend on the rounds only (the base budget of 10 rounds has no tag), not on which runs exist
    assert (tmp_path / "img" / "fmnist_noise40_2rounds_curves.png").stat().st_size > 1000
    assert (tmp_path / "img" / "fmnist_noise40_3rounds_curves.png").stat().st_size > 1000
    assert not (tmp_path / "img" / "fmnist_noise40_curves.png").exists()
    # the plot legend uses the same split labels as the table
    rows = json.loads((tmp_path / "results.json").read_text())
    long_rows = [r for r in rows if r["rounds"] == 3]
    assert sorted(E._shown_label(r, E._several_budgets(long_rows)) for r in long_rows) == [
        "FedGVI (GCE 0.8 + AR 2.5), loss weight 10 [<= 20 local epochs]",
        "FedGVI (GCE 0.8 + AR 2.5), loss weight 10 [<= 5 local epochs]"]


def test_rescore_recomputes_the_final_metrics_from_the_saved_model_and_the_report_uses_them(tmp_path):
    """A run recorded with the old, floored NLL: ``rescore`` re-evaluates its saved final posterior with the run's
    own draws (accuracy identical) and the exact NLL, and ``summarise`` then reports the rescored values."""
    import torch

    from common.evaluation import evaluate_posterior
    from common.problem import build_problem, load_full_data

    raw = {"model": "bnn", "hidden": "8", "dataset": "digits", "num-clients": 2, "min-clients": 2,
           "eval-samples": 5, "seed": 3, "label-noise": 0.0, "dtype": "float32"}
    cfg = parse_run_config(raw)
    data = load_full_data(cfg)
    problem = build_problem(cfg, data)
    mean = problem.model.init_mean(generator=torch.Generator().manual_seed(0), scale=8.0, dtype=torch.float32)
    q = problem.prior.__class__.from_mean_variance(mean, {k: torch.full_like(v, 1e-3) for k, v in mean.items()})
    honest = evaluate_posterior(problem, q, data.x_test, data.y_test, cfg.eval_samples, seed=cfg.seed)
    extra = {k: v for k, v in raw.items() if k not in ("seed", "label-noise")}
    d = _fake_run(tmp_path, "fedgvi-noise00-seed3", "fedgvi", 0.0, 3, [honest["accuracy"]], [honest["ece"]], **extra)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[-1].update({"test-nll": 0.5, "test-brier": honest["brier"]})  # what the floored NLL had recorded
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    np.savez(d / "posterior.npz", **q.to_numpy())
    assert E.summarise(d)["final-nll"] == 0.5
    E.rescore(tmp_path)
    out = json.loads((d / E.RESCORED).read_text())
    assert out["same-draws"] and out["recorded"]["test-nll"] == 0.5
    s = E.summarise(d)
    assert s["final-nll"] == pytest.approx(honest["nll"], rel=1e-12)
    assert s["final-accuracy"] == honest["accuracy"] and s["final-ece"] == pytest.approx(honest["ece"], abs=1e-12)


def test_report_never_averages_runs_whose_settings_differ_beyond_the_seed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    monkeypatch.setattr(E, "_plot_reliability", lambda *a: None)
    _fake_run(tmp_path, "fedgvi-noise40-seed0", "fedgvi", 0.4, 0, [0.5, 0.80], [0.1, 0.1])
    _fake_run(tmp_path, "fedgvi-noise40-seed1", "fedgvi", 0.4, 1, [0.5, 0.82], [0.1, 0.1])
    _fake_run(tmp_path, "fedgvi-noise40-seed0-mc1", "fedgvi", 0.4, 0, [0.5, 0.60], [0.1, 0.1], **{"mc-samples": 1})
    _fake_run(tmp_path, "fedgvi-noise40-seed0-again", "fedgvi", 0.4, 0, [0.5, 0.81], [0.1, 0.1])
    text = E.report_fmnist_noise(tmp_path)
    # before: one cell "70.00 ± 10.00 (3 seeds)"-style mean over all four runs
    assert "| FedGVI (GCE 0.8 + AR 2.5) [mc-samples=1] | acc final | 60.00 (1 seed) |" in text
    # -seed0 and -seed0-again: the same settings and seed, so two rows (by suffix), not "(3 seeds)"
    assert ("| FedGVI (GCE 0.8 + AR 2.5) [mc-samples=—] [runs without a suffix] | acc final | 81.00 ± 1.41 (2 seeds) |"
            in text)
    assert "| FedGVI (GCE 0.8 + AR 2.5) [mc-samples=—] [runs *-again] | acc final | 81.00 (1 seed) |" in text
    err = capsys.readouterr().err
    assert "fedgvi-noise40-seed0, fedgvi-noise40-seed0-again have the same settings, noise 0.4 and seed 0" in err


def test_report_counts_distinct_seeds_and_never_averages_two_runs_of_one_seed(tmp_path, monkeypatch, capsys):
    """Two runs of seed 0 with identical settings (a rerun under another suffix) are not "2 seeds": each gets its
    own row, labelled by its run-name suffix, with a warning naming both."""
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    monkeypatch.setattr(E, "_plot_reliability", lambda *a: None)
    _fake_run(tmp_path, "pvi-noise40-seed0-long", "pvi", 0.4, 0, [0.5, 0.80], [0.1, 0.1])
    _fake_run(tmp_path, "pvi-noise40-seed0-rerun", "pvi", 0.4, 0, [0.5, 0.84], [0.1, 0.1])
    _fake_run(tmp_path, "pvi-noise40-seed1-rerun", "pvi", 0.4, 1, [0.5, 0.86], [0.1, 0.1])
    text = E.report_fmnist_noise(tmp_path)
    assert "(3 seeds)" not in text and "82.00 ± 2.83 (2 seeds)" not in text  # old: seed 0 twice in one mean
    assert "| PVI [runs *-long] | acc final | 80.00 (1 seed) |" in text
    assert "| PVI [runs *-rerun] | acc final | 85.00 ± 1.41 (2 seeds) |" in text
    assert "pvi-noise40-seed0-long, pvi-noise40-seed0-rerun have the same settings, noise 0.4 and seed 0" in (
        capsys.readouterr().err)
    # a cell is never computed from two runs of one seed, whoever calls it
    with pytest.raises(ValueError, match="same seed"):
        E._mean_std([80.0, 84.0], [0, 0])


def test_noniid_report_seed_column_counts_distinct_seeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    for name, final in (("fedgvi-synchronous-seed0", 0.7), ("fedgvi-synchronous-seed0-again", 0.8)):
        _fake_run(tmp_path, name, "fedgvi", 0.0, 0, [0.5, final], [0.1, 0.1],
                  **{"num-clients": 10, "partitioner": "dirichlet"})
    text = E.report_fmnist_noniid(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| FedGVI")]
    # before: one row "| synchronous | 2 | 75.00 ± 7.07 (2 seeds) |" for a single seed
    assert len(rows) == 2, text
    assert "| synchronous [runs without a suffix] | 1 | 70.00 (1 seed) | 70.00 (1 seed) |" in rows[1]
    assert "| synchronous [runs *-again] | 1 | 80.00 (1 seed) | 80.00 (1 seed) |" in rows[0]
    assert "have the same settings, noise 0 and seed 0" in capsys.readouterr().err


def _finished(run, cfg: dict, rounds: int | None = None) -> None:
    """The records of a run of ``run``'s name that ended after ``rounds`` rounds (default: every planned one)."""
    run.out.mkdir(parents=True)
    (run.out / "run_config.json").write_text(json.dumps(cfg))
    n = int(cfg["num-server-rounds"]) if rounds is None else rounds
    rows = [{"round": float(i), "test-accuracy": 0.5, "test-nll": 1.0, "test-ece": 0.1, "test-brier": 0.3}
            for i in range(n + 1)]
    (run.out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run.out / "summary.json").write_text("{}")


def test_execute_skips_a_finished_run_only_when_its_recorded_settings_are_the_requested_ones(tmp_path, monkeypatch,
                                                                                                 capsys):
    """A finished run under the requested name is skipped only if its run_config.json matches the request; with
    other settings the runner refuses (naming every differing key) before starting anything, never skips."""
    monkeypatch.setattr(E, "RUNS", tmp_path)
    calls = []
    monkeypatch.setattr(E.subprocess, "call", lambda *a, **k: calls.append(a) or 0)
    same, other = E.fmnist_noise_runs(["fedgvi"], [0.4], [0, 1])
    for run in (same, other):
        run.name += "-rerun"
    _finished(same, E.requested_config(same))  # what run_inprocess.py records for this request
    # a finished run of the same name made with another learning rate and budget (e.g. an older command)
    _finished(other, {**E.requested_config(other), "lr": 0.003, "num-server-rounds": 25})
    E.execute(same)
    assert not calls and "[skip] fedgvi-noise40-seed0-rerun" in capsys.readouterr().out
    with pytest.raises(E.RunConfigMismatch) as err:
        E.execute(other)  # before: "[skip]", and its numbers would have been reported as this request's
    msg = str(err.value)
    assert "fedgvi-noise40-seed1-rerun" in msg and "lr: finished run 0.003, requested 0.001" in msg
    assert "num-server-rounds: finished run 25, requested 10" in msg and msg.count("finished run ") == 3, msg
    assert not calls
    # through the CLI: the mismatch is found before any run starts, and nothing is run
    (same.out / "summary.json").unlink()  # seed 0 would now run first if the check came late
    with pytest.raises(SystemExit, match="nothing was run"):
        E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "0", "1", "--methods", "fedgvi", "--suffix=-rerun"])
    assert not calls
    assert "num-server-rounds: finished run 25, requested 10" in capsys.readouterr().err
    # a request with the finished run's settings is a match, so it is skipped, not refused
    E.main(["fmnist-noise", "--noise", "0.4", "--seeds", "1", "--methods", "fedgvi", "--suffix=-rerun",
            "-c", "lr=0.003", "-c", "num-server-rounds=25"])
    assert not calls and "[skip] fedgvi-noise40-seed1-rerun" in capsys.readouterr().out


def test_config_differences_names_each_key_and_treats_unrecorded_keys_by_their_default():
    base = E.requested_config(E.fmnist_noise_runs(["pvi"], [0.0], [0])[0])
    assert E.config_differences(dict(base), base) == []
    assert E.config_differences({**base, "output-dir": "elsewhere"}, base) == []  # where it wrote is no setting
    old = {k: v for k, v in base.items() if k != "pipeline-evaluation"}  # a run from before the key existed
    assert E.config_differences(old, base) == []  # requested value = the default
    assert E.config_differences(old, {**base, "pipeline-evaluation": False}) == [
        "pipeline-evaluation: not recorded by the finished run, requested False"]
    assert E.config_differences({**base, "max-staleness": 2}, base) == [
        "max-staleness: finished run 2, requested 'auto'"]
    assert E.config_differences({**base, "checkpoint": 0}, base) == ["checkpoint: finished run 0, requested False"]
    assert E.config_differences({**base, "method": "fedavg"}, base) == [
        "method: finished run 'fedavg', not a setting of the requested run"]


ROOT = Path(__file__).resolve().parent.parent


def _commands(text: str) -> list[list[str]]:
    """The ``$E ...`` commands of a bash text (run_experiments.sh, or a fenced block of RESULTS.md) as argv lists
    of ``experiments.py``, with the script's variables (``LONG``, ``LR3``, ``A``) expanded; ``report`` left out."""
    env: dict[str, str] = {}
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in line.split(";"):
            part = part.split("#")[0].split(">")[0].strip().removesuffix("&").strip()
            if m := re.fullmatch(r'(\w+)="(.*)"', part):
                env[m.group(1)] = re.sub(r"\$(\w+)", lambda v: env[v.group(1)], m.group(2))
            elif part.startswith("$E "):
                argv = shlex.split(re.sub(r"\$(\w+)", lambda v: env[v.group(1)], part[3:]))
                if argv[0] != "report":
                    out.append(argv)
    return out


def _planned(argv: list[str], monkeypatch, tmp_path) -> list:
    """The runs one ``experiments.py`` command would execute (nothing is run)."""
    got: list = []
    monkeypatch.setattr(E, "RUNS", tmp_path / "none")
    monkeypatch.setattr(E, "execute", lambda run, dry_run=False: got.append(run))
    E.main(argv)
    return got


def test_run_experiments_sh_recreates_the_noniid_table_and_has_no_dead_command(monkeypatch, tmp_path):
    """Every run of the non-IID table (three staleness bounds) comes from a command of run_experiments.sh, no
    command plans only runs an earlier command already made, and a name planned twice has the same settings."""
    seen: dict[str, dict] = {}
    for argv in _commands((ROOT / "scripts" / "run_experiments.sh").read_text()):
        runs = _planned(argv, monkeypatch, tmp_path)
        assert runs, argv
        assert any(r.name not in seen for r in runs), f"dead command (every run made before): {argv}"
        for r in runs:
            cfg = E.requested_config(r)
            assert E.config_differences(seen.get(r.name, cfg), cfg) == [], r.name
            seen[r.name] = cfg
    staleness = {n: seen[n]["max-staleness"] for n in seen if n.startswith("fedgvi-asynchronous-seed0")}
    assert staleness == {"fedgvi-asynchronous-seed0": "auto", "fedgvi-asynchronous-seed0-staleness10": 10,
                         "fedgvi-asynchronous-seed0-staleness2": 2}


def test_results_md_rerun_commands_use_names_of_their_own(monkeypatch, tmp_path):
    """The rerun commands printed in docs/RESULTS.md never reuse a run name of run_experiments.sh or of another
    block: the runner skips a finished run with the same settings, so a reused name would rerun nothing."""
    script = {r.name for argv in _commands((ROOT / "scripts" / "run_experiments.sh").read_text())
              for r in _planned(argv, monkeypatch, tmp_path)}
    doc = (ROOT / "docs" / "RESULTS.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", doc, flags=re.S) if "experiments.py" in b]
    assert len(blocks) >= 4
    owner: dict[str, int] = {}
    for i, block in enumerate(blocks):
        for argv in _commands(block):
            for r in _planned(argv, monkeypatch, tmp_path):
                assert r.name not in script, f"RESULTS.md block {i} reuses {r.name} of run_experiments.sh"
                assert owner.setdefault(r.name, i) == i, f"blocks {owner[r.name]} and {i} both name {r.name}"


def test_reference_values_are_not_credited_to_the_paper():
    src = (ROOT / "scripts" / "experiments.py").read_text()
    assert "published" not in src.lower() and "FedGVI paper, Table" not in src
    doc = (ROOT / "docs" / "RESULTS.md").read_text()
    assert "published = FedGVI paper" not in doc and "| published (best) |" not in doc
    assert "with 25 local epochs, reached 48.97" not in doc


# review of the experiment tooling, 2026-11-28
def test_noniid_report_never_averages_runs_of_other_label_noise(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    extra = {"num-clients": 10, "partitioner": "dirichlet"}
    _fake_run(tmp_path, "fedgvi-synchronous-seed0", "fedgvi", 0.0, 0, [0.5, 0.80], [0.1, 0.1], **extra)
    _fake_run(tmp_path, "fedgvi-synchronous-seed1", "fedgvi", 0.0, 1, [0.5, 0.82], [0.1, 0.1], **extra)
    _fake_run(tmp_path, "fedgvi-synchronous-seed2-noise40", "fedgvi", 0.4, 2, [0.5, 0.40], [0.1, 0.1], **extra)
    _fake_run(tmp_path, "fedgvi-synchronous-seed0-noise40", "fedgvi", 0.4, 0, [0.5, 0.42], [0.1, 0.1], **extra)
    text = E.report_fmnist_noniid(tmp_path)  # was: one '3 seeds' cell, or a ValueError with seed 0 twice
    assert "| synchronous [label-noise=0.0] | 2 | 81.00 ± 1.41 (2 seeds) |" in text, text
    assert "| synchronous [label-noise=0.4] | 2 | 50.00 ± 0.00 (2 seeds) | 41.00 ± 1.41 (2 seeds) |" in text, text


def test_noniid_refuses_the_one_client_references():
    with pytest.raises(SystemExit):
        E.main(["fmnist-noniid", "--methods", "gvi1", "--dry-run"])


def test_fedavg_runs_of_other_budgets_get_their_own_labels(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    monkeypatch.setattr(E, "_plot_reliability", lambda *a: None)
    plotted: list[str] = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, label=None, **k: plotted.append(label))
    for seed in (0, 1):
        for epochs, suffix in ((10, ""), (1, "-e1")):
            _fake_run(tmp_path, f"fedavg-noise20-seed{seed}{suffix}", "fedavg", 0.2, seed,
                      [0.5, 0.8 if epochs == 10 else 0.2], [0.1, 0.1], **{"fedavg-local-epochs": epochs})
    text = E.report_fmnist_noise(tmp_path)
    assert "| FedAvg [10 local epochs] | acc final | 80.00 ± 0.00 (2 seeds) |" in text, text
    assert "| FedAvg [1 local epochs] | acc final | 20.00 ± 0.00 (2 seeds) |" in text, text
    labels = {p for p in plotted if p}
    assert {"FedAvg [1 local epochs] (n=2)", "FedAvg [10 local epochs] (n=2)"} <= labels, labels  # was 'FedAvg (n=4)'


def test_a_null_metric_in_a_record_does_not_stop_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    monkeypatch.setattr(E, "_plot_reliability", lambda *a: None)
    d = _fake_run(tmp_path, "pvi-noise20-seed0", "pvi", 0.2, 0, [0.5, 0.8, 0.7], [0.1, 0.05, 0.08])
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[1]["test-nll"] = None  # how results.py writes a NaN
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = E.summarise(d)  # was: TypeError in min(float, None), and the whole report lost
    assert s["best-nll"] == pytest.approx(1 / 3) and s["best-accuracy"] == 0.8
    assert "| PVI | acc final | 70.00 (1 seed) |" in E.report_fmnist_noise(tmp_path)


def test_reliability_diagrams_use_the_lowest_seed_of_each_noise_level(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "IMG", tmp_path / "img")
    (tmp_path / "img").mkdir()
    drawn = []
    monkeypatch.setattr(E, "_final_predictive", lambda run_dir, method: drawn.append(run_dir.name) or (
        np.full((4, 2), 0.5), None, np.array([0, 1, 0, 1])))
    rows = [{"noise": 0.2, "seed": 0, "run": "pvi-noise20-seed0", "method": "pvi", "label": "PVI"},
            {"noise": 0.1, "seed": 1, "run": "pvi-noise10-seed1", "method": "pvi", "label": "PVI"}]
    E._plot_reliability(tmp_path, rows)
    assert drawn == ["pvi-noise10-seed1", "pvi-noise20-seed0"]  # was: nothing for 10 %, whose lowest seed is 1
