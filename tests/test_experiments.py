"""The experiment runner: every planned run has a valid config, and the report's best/final statistics."""

from __future__ import annotations

import json

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
    assert "| FedGVI (GCE 0.8 + AR 2.5), loss weight 10 [<= 5 local epochs] | published (best) | 87.21 |" in long_table
    row = next(line for line in text.splitlines() if line.startswith("| PVI | acc final"))
    assert f"{84.0:.2f} ± {np.std([80, 84, 88], ddof=1):.2f} (3 seeds)" in row
    assert "| FedAvg | acc best | 60.00 (1 seed) |" in text
    assert "| PVI | published (best) | 82.81 |" in text
    assert (tmp_path / "results.csv").exists() and len(json.loads((tmp_path / "results.json").read_text())) == 6
    # file names depend on the rounds only (the base budget of 10 rounds has no tag), not on which runs exist
    assert (tmp_path / "img" / "fmnist_noise40_2rounds_curves.png").stat().st_size > 1000
    assert (tmp_path / "img" / "fmnist_noise40_3rounds_curves.png").stat().st_size > 1000
    assert not (tmp_path / "img" / "fmnist_noise40_curves.png").exists()
    # the plot legend uses the same split labels as the table
    rows = json.loads((tmp_path / "results.json").read_text())
    long_rows = [r for r in rows if r["rounds"] == 3]
    assert sorted(E._shown_label(r, True) for r in long_rows) == [
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
    assert "| FedGVI (GCE 0.8 + AR 2.5) [mc-samples=—] | acc final | 81.00 ± 1.00 (3 seeds) |" in text
    assert "have the same settings and seed" in capsys.readouterr().err  # -seed0 and -seed0-again
