"""Smoke + substance tests of scripts/exp_synthetic.py at a tiny size (each subcommand once, into a tmp dir).

Each experiment's outputs must exist, and each must show its paper's qualitative effect at a fixed seed:
robust losses beat PVI on the clutter problem, the NLL's influence grows with the outlier's distance while a
robust loss's stays bounded, and the robust logistic regression's boundary is closer to the clean target.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
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


def test_influence_distances_are_computed_in_float64(outputs: dict) -> None:
    """The run is float64 throughout (results_synthetic.md); the Fisher-Rao distance was formed from float32
    tensors (exactly float32 numbers, up to 6e-6 relative off)."""
    import math

    rows = [r for r in _rows(outputs["out"] / "influence" / "influence.csv") if r["fisher_rao"]]
    ref = {(r["method"], r["seed"]): (float(r["mean"]), float(r["sd"])) for r in rows if float(r["z"]) == 0.0}
    assert rows and ref
    for r in rows:
        m0, s0 = ref[(r["method"], r["seed"])]
        m, s = float(r["mean"]), float(r["sd"])
        # the univariate Fisher-Rao distance: 2 sqrt(2) atanh of the ratio of the distances from (m, sqrt2 s) to
        # (m0, sqrt2 s0) and to its mirror image (m0, -sqrt2 s0)
        d = math.hypot(m - m0, math.sqrt(2) * (s - s0)) / math.hypot(m - m0, math.sqrt(2) * (s + s0))
        assert float(r["fisher_rao"]) == pytest.approx(2 * math.sqrt(2) * math.atanh(d), rel=1e-12, abs=1e-14), r


def test_logistic_robust_boundary_closer_to_clean_target(outputs: dict) -> None:
    table = outputs["results"]["logistic2d"]["table"]
    assert table["fedgvi_beta_ar"]["angle_to_target_deg_mean"] < table["pvi"]["angle_to_target_deg_mean"]
    assert table["pvi_clean"]["angle_to_target_deg_mean"] == pytest.approx(0.0, abs=1e-3)
    assert table["fedgvi_beta_ar"]["acc_fresh_test_mean"] > 0.9


def test_results_doc_eps_sweep_shows_each_cells_runs_and_every_failure() -> None:
    """docs/results_synthetic.md's clutter ε-sweep: a cell averaged over fewer runs than the seeds it promises
    must say so (``n = k``), and the failed runs are counted per method, so that n + failures = seeds for every
    cell (failures are recorded in the CSV and never hidden; the β-loss lost 1 of 3 runs at ε = 0.4)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "results_synthetic.md").read_text()
    caption, table = doc.split("ε-sweep:", 1)[1].split("\n\n", 2)[:2]
    seeds = int(re.search(r"on (\d+) seeds per ε", caption).group(1))
    lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()]
    header, rows = lines[0], lines[2:]
    eps_cols = [i for i, h in enumerate(header) if h.startswith("ε = ")]
    assert header[-1] == "failed runs", header
    assert {r[0] for r in rows} == {"`pvi`", "`beta_kl`", "`sm_imq`", "`sm_se`"}
    for r in rows:
        missing = 0
        for i in eps_cols:
            m = re.fullmatch(r"\d+\.\d{3} ± \d+\.\d{3}(?: \(n = (\d+), (\d+) failed\))?", r[i])
            assert m, (r[0], header[i], r[i])
            n = int(m.group(1) or seeds)
            assert n + int(m.group(2) or 0) == seeds, (r[0], header[i], r[i])
            missing += seeds - n
        failed, total = map(int, re.match(r"(\d+)/(\d+)", r[-1]).groups())
        assert (failed, total) == (missing, seeds * len(eps_cols)), (r[0], r[-1])
    beta = next(r for r in rows if r[0] == "`beta_kl`")
    assert beta[eps_cols[-1]].endswith("(n = 2, 1 failed)")  # the ε = 0.4 run of seed 2: improper cavity
    # RESULTS.md's headline of the sweep says so too
    results = (Path(__file__).resolve().parent.parent / "docs" / "RESULTS.md").read_text()
    headline = next(b for b in results.split("\n  - ") if "As ε goes from 0 to 0.4" in b)
    assert "failed" in headline and "mean of 2" in headline, headline


def test_influence_reports_a_method_whose_reference_run_failed_instead_of_crashing(tmp_path, monkeypatch, capsys):
    """A failed run at z = 0 leaves its method no Fisher-Rao distance at any z: before, ``np.nanargmax`` of the
    all-NaN curve raised, and nothing of the experiment (no CSV, no summary, no figure) was written.  The runs are
    stand-ins (posterior mean 0.1 z, variance 1), so that only the bookkeeping is tested."""
    import numpy as np

    def run_federation(problem, shards, rounds, tol=0.0):
        z = float(shards[-1][1][-1, 0])  # the extra observation, appended to the last client's shard
        if problem.cfg.loss == "beta" and z == 0.0:
            return {"posterior": None, "history": [], "rounds": 0, "error": "round 1: injected failure"}
        return {"posterior": z, "history": [], "rounds": 1, "error": ""}

    monkeypatch.setattr(E, "run_federation", run_federation)
    monkeypatch.setattr(E, "moments", lambda z: (np.array([0.1 * z]), np.array([1.0])))
    summary = E.run_influence(tmp_path / "runs", tmp_path / "img", seeds=1, tiny=True)
    beta = summary["table"]["beta_kl"]
    assert math.isnan(beta["fr_max"]) and math.isnan(beta["fr_at_zmax"]) and beta["z_of_max"] is None
    assert beta["failures"] == 1 and beta["errors"] == ["seed 0, z = 0: round 1: injected failure"]
    assert all(math.isnan(v) for v in beta["curve"].values())
    for name in ("nll_kl", "sm_se"):  # the other methods are reported as before
        t = summary["table"][name]
        assert t["failures"] == 0 and "errors" not in t and t["z_of_max"] == 20.0 and t["fr_max"] > 0
    assert "influence of beta_kl: no Fisher-Rao distance at any z" in capsys.readouterr().err
    assert (tmp_path / "runs" / "influence" / "summary.json").exists()
    assert (tmp_path / "img" / "synthetic_influence.png").stat().st_size > 10_000


@pytest.mark.parametrize("seeds", ["0", "-1", "two"])
def test_a_number_of_seeds_below_one_is_an_argparse_error(seeds, monkeypatch, capsys):
    """Before, ``--seeds 0`` silently ran the default number of seeds (``0 or default``) and ``--seeds -1`` ran no
    seed and crashed after the experiment (UnboundLocalError)."""
    ran = []
    monkeypatch.setattr(E, "run_clutter", lambda out, img, seeds, tiny: ran.append(seeds) or {"table": {}})
    with pytest.raises(SystemExit) as exc:
        E.main(["clutter", "--tiny", "--seeds", seeds])
    assert exc.value.code == 2 and ran == []
    assert "--seeds" in capsys.readouterr().err
    E.main(["clutter", "--tiny", "--seeds", "2"])
    assert ran == [2]


def test_a_single_value_has_no_spread(tmp_path):
    """``mean_std`` of one value: before, std 0, which a table shows as "± 0.000", a measured spread of zero."""
    import numpy as np

    from common.data.synthetic import clutter_1d

    assert E.mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2.0)))
    for values in ([0.3], [0.3, float("nan")]):
        mean, std = E.mean_std(values)
        assert mean == 0.3 and math.isnan(std)
    assert all(math.isnan(v) for v in E.mean_std([]))
    t = E._summarise([{"method": "pvi", "abs_error": 0.3, "sd": 0.1}, {"method": "beta", "abs_error": 0.1},
                      {"method": "beta", "abs_error": 0.2}], ["abs_error", "sd"])
    assert t["pvi"]["abs_error_mean"] == 0.3 and math.isnan(t["pvi"]["abs_error_std"]) and t["pvi"]["abs_error_n"] == 1
    assert t["beta"]["abs_error_std"] == pytest.approx(np.std([0.1, 0.2], ddof=1)) and t["beta"]["abs_error_n"] == 2
    # the figure's error bars: a single run's cell is drawn without a bar, and does not break the plot
    sweep = {"pvi": {"0": {"abs_error_mean": 0.1, "abs_error_std": float("nan")},
                     "0.25": {"abs_error_mean": 1.2, "abs_error_std": 0.1}}}
    E._plot_clutter(tmp_path / "c.png", clutter_1d(n=40, eps=0.25, seed=0),
                    {"pvi": (-1.0, 0.2, "PVI"), "mle": (-0.5, 0.0, "MLE")}, sweep, (0.0, 0.25))
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_summary_files_are_strict_json_with_missing_values_as_null(tmp_path):
    """A single run's spread (NaN) and failed runs' values were written as the bare token NaN, which is not JSON."""
    path = tmp_path / "s" / "summary.json"
    E.write_json(path, {"std": E.mean_std([0.3])[1], "curve": {"0": np.float32("nan")}, "mean": 0.3})

    def refuse(token: str) -> None:
        raise AssertionError(f"non-JSON token {token}")
    assert json.loads(path.read_text(), parse_constant=refuse) == {"std": None, "curve": {"0": None}, "mean": 0.3}
