"""Smoke + substance tests of scripts/exp_synthetic.py at a tiny size (each subcommand once, into a tmp dir).

Each experiment's outputs must exist, and each must show its paper's qualitative effect at a fixed seed:
robust losses beat PVI on the clutter problem, the NLL's influence grows with the outlier's distance while a
robust loss's stays bounded, and the robust logistic regression's boundary is closer to the clean target.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from scripts import exp_synthetic as E


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("exp_synthetic")
    out, img = root / "runs", root / "img"
    results = {}
    for name in E.EXPERIMENTS:
        results[name] = E.main([name, "--tiny", "--out", str(out), "--img", str(img)])[name]
    return {"out": out, "img": img, "results": results}


@pytest.mark.parametrize("name,csvs", [
    ("clutter", ["clutter.csv", "clutter_eps_sweep.csv"]),
    ("influence", ["influence.csv"]),
    ("logistic2d", ["logistic2d.csv"]),
])
def test_outputs_written(outputs: dict, name: str, csvs: list[str]) -> None:
    d = outputs["out"] / name
    for c in csvs:
        rows = _rows(d / c)
        assert rows, f"{c} is empty"
        assert not any(r.get("error") for r in rows), [r["error"] for r in rows if r.get("error")]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["experiment"] == name and summary["table"]
    png = outputs["img"] / f"synthetic_{name}.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clutter_robust_losses_beat_pvi(outputs: dict) -> None:
    rows = [r for r in _rows(outputs["out"] / "clutter" / "clutter.csv") if r["seed"] == "0"]
    err = {r["method"]: float(r["abs_error"]) for r in rows}
    # PVI (and the MLE) are pulled towards the outliers at theta + 3; the robust losses are not
    assert err["pvi"] > 0.5 and err["mle"] > 0.5
    assert err["beta_kl"] < 0.5 * err["pvi"]
    assert err["sm_imq"] < 0.5 * err["pvi"]
    # the sweep: with no contamination PVI is fine, at eps = 0.25 it is not
    sweep = outputs["results"]["clutter"]["eps_sweep"]["pvi"]
    assert sweep["0"]["abs_error_mean"] < sweep["0.25"]["abs_error_mean"]


def test_influence_nll_unbounded_robust_bounded(outputs: dict) -> None:
    table = outputs["results"]["influence"]["table"]
    z = outputs["results"]["influence"]["settings"]["z_grid"]
    nll = [table["nll_kl"]["curve"][f"{v:g}"] for v in z]
    assert all(b > a for a, b in zip(nll, nll[1:])), nll  # strictly increasing in z
    assert nll[-1] > 5 * nll[1]
    for name in ("beta_kl", "sm_se"):
        curve = [table[name]["curve"][f"{v:g}"] for v in z]
        assert curve[-1] < 0.2 * nll[-1], (name, curve, nll)
        # bounded: the far-away outlier has no more influence than the worst nearby one
        assert curve[-1] <= max(curve[1:-1]) + 1e-9, (name, curve)


def test_logistic_robust_boundary_closer_to_clean_target(outputs: dict) -> None:
    table = outputs["results"]["logistic2d"]["table"]
    assert table["fedgvi_beta_ar"]["angle_to_target_deg_mean"] < table["pvi"]["angle_to_target_deg_mean"]
    assert table["pvi_clean"]["angle_to_target_deg_mean"] == pytest.approx(0.0, abs=1e-3)
    assert table["fedgvi_beta_ar"]["acc_fresh_test_mean"] > 0.9
