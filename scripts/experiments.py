"""Experiment runner: the Fashion-MNIST experiments of issue 5, every method through the same data path.

Usage:
    python scripts/experiments.py fmnist-noise  [--methods ...] [--noise ...] [--seeds ...] [--dry-run]
    python scripts/experiments.py fmnist-noniid [--schedules ...] [--seeds ...] [--rounds N] [--dry-run]
    python scripts/experiments.py report        # tables (markdown, CSV, JSON) and plots of the finished runs
    bash scripts/run_experiments.sh             # the runs of docs/RESULTS.md's tables in lanes, then the report

Each run is one ``scripts/run_inprocess.py`` process (the real PGVI strategy and ClientApp, or Flower's
``FedAvg`` with the deterministic-MLP ClientApp) writing ``metrics.jsonl`` / ``summary.json`` into
``runs/experiments/<experiment>/<run name>/``.  A run that completed every planned round (``summary.json``
present and ``metrics.jsonl`` reaching ``num-server-rounds``) is skipped when its ``run_config.json`` holds the
requested settings, so an interrupted experiment continues where it stopped; a run that ended early is run again.
A finished run of the same name with other settings is refused (every differing key is named) before anything
runs: choose another ``--suffix``.  The whole plan is checked before its first run starts: every run config is
validated, two runs may not share a name, and ``-c`` may not set a key the command sets run by run (the noise
level, the seed, a setting of the method such as its loss, ..., and ``output-dir``: each run's records go to its
own directory).  A batch in which a run fails, or exits 0 before
its planned rounds, exits non-zero once the other runs are done.  ``report`` aggregates whatever has finished into ``runs/experiments/<experiment>/results.{csv,json}``,
``table.md`` and PNG plots in ``docs/img/``; each cell counts distinct seeds, and runs of the same settings,
noise and seed get separate rows, never one mean; runs that ended early or never ended are listed under the
tables, not averaged in.

Methods (the papers' names):
  pvi     PVI = PGVI with the NLL loss and the KL divergence
  fedgvi  FedGVI: GCE(delta=0.8) loss + Alpha-Renyi(alpha=2.5) divergence
  gce     FedGVI with GCE(delta=0.8) and the KL divergence ("GCE alone")
  fedavg  FedAvg (Flower's strategy), deterministic MLP of the same architecture, SGD with momentum
  gvi1    global GVI on one client (all data, GCE + AR), the centralised reference
  vi1     global VI on one client (all data, NLL + KL)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "experiments"
IMG = ROOT / "docs" / "img"

# the setting shared by every Fashion-MNIST run: 1x200 MLP, prior N(0, I), mean-field Gaussian, damping 1/M,
# Adam with one learning rate for means and scales, batch 256, 10 MC samples with local reparameterisation;
# a local update stops after `local-epochs` or earlier when the objective stops improving (`patience`)
FMNIST_BASE: dict[str, object] = {
    "dataset": "fashion_mnist", "model": "bnn", "hidden": "200", "family": "mean_field", "dtype": "float32",
    "num-clients": 3, "min-clients": 3, "partitioner": "iid", "label-noise-kind": "random",
    "num-server-rounds": 10, "damping": "auto", "schedule": "synchronous",
    "local-epochs": 3, "patience": 1, "batch-size": 256, "lr": 0.001, "lr-scale": 0.001, "mc-samples": 10,
    "eval-samples": 100, "evaluate-clients": False, "checkpoint": False, "torch-threads": 1,
    "fedavg-lr": 0.1, "fedavg-momentum": 0.9, "fedavg-weight-decay": 5e-4, "fedavg-local-epochs": 10,
    "fedavg-batch-size": 100,
}

METHODS: dict[str, dict[str, object]] = {
    "pvi": {"loss": "nll", "divergence": "kl"},
    "fedgvi": {"loss": "gce", "loss-delta": 0.8, "divergence": "alpha_renyi", "divergence-alpha": 2.5},
    "gce": {"loss": "gce", "loss-delta": 0.8, "divergence": "kl"},
    "fedavg": {},
    "gvi1": {"loss": "gce", "loss-delta": 0.8, "divergence": "alpha_renyi", "divergence-alpha": 2.5,
             "num-clients": 1, "min-clients": 1},
    "vi1": {"loss": "nll", "divergence": "kl", "num-clients": 1, "min-clients": 1},
}
LABELS = {"pvi": "PVI", "fedgvi": "FedGVI (GCE 0.8 + AR 2.5)", "gce": "FedGVI (GCE 0.8 + KL)", "fedavg": "FedAvg",
          "gvi1": "GVI, 1 client", "vi1": "VI, 1 client"}
# Reference values quoted in the issue (said there to be FedGVI's Fashion-MNIST results, best over rounds, 5 seeds),
# keyed by noise rate.  They are NOT in the FedGVI paper: its Fashion-MNIST figure has noise 0 / 0.2 / 0.4 only,
# FedGVI with GCE delta in {1.0, 0.5, 0.0} against PVI (no delta = 0.8, no FedAvg) on an axis of about 84-88 %
# (docs/RESULTS.md, "the reference values"; ../shared/papers/notes/fedgvi.md section 4.6).
ISSUE_REFERENCE = {
    "pvi": {0.0: 86.21, 0.1: 85.14, 0.2: 84.36, 0.4: 82.81},
    "fedgvi": {0.0: 88.59, 0.1: 88.44, 0.2: 87.95, 0.4: 87.21},
    "fedavg": {0.0: 85.72, 0.1: 78.99, 0.2: 71.16, 0.4: 48.97},
}


@dataclass
class Run:
    experiment: str
    name: str
    method: str
    config: dict[str, object]
    tags: dict[str, object] = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return RUNS / self.experiment / self.name

    @property
    def finished(self) -> bool:
        """The run ended (``summary.json`` exists), whether or not it completed every planned round."""
        return (self.out / "summary.json").exists()

    @property
    def done(self) -> bool:
        """The run ended after every planned round (see :func:`unfinished_reason`): only such a run is skipped."""
        return unfinished_reason(self.out) is None

    def differences(self) -> list[str]:
        """How the finished run in ``self.out`` differs from this run's requested settings (empty: the same)."""
        path = self.out / "run_config.json"
        if not path.exists():
            return [f"{path} is missing, so its settings are unknown"]
        return config_differences(json.loads(path.read_text()), requested_config(self))


class RunConfigMismatch(RuntimeError):
    """A finished run of the requested name was made with other settings."""


def _evaluated_rows(run_dir: Path) -> list[dict[str, float]]:
    """The rows of ``metrics.jsonl`` of rounds 1.. that carry the test metrics (round 0 is the prior)."""
    return [r for r in _rows(run_dir) if r.get("round", 0) >= 1 and "test-accuracy" in r]


def unfinished_reason(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` does not count as finished, or ``None`` when it completed every planned round:
    ``summary.json`` present (it is written last) and the last evaluated round of ``metrics.jsonl`` at least the
    ``num-server-rounds`` of its ``run_config.json``.  A run stops early without failing, e.g. an asynchronous run
    at its overall deadline or a run whose clients all failed; its ``summary.json`` alone does not say it is done."""
    if not (run_dir / "summary.json").exists():
        return "no summary.json (failed, interrupted or still running)"
    if not (run_dir / "run_config.json").exists():
        return "no run_config.json, so its planned rounds are unknown"
    planned = int(json.loads((run_dir / "run_config.json").read_text()).get("num-server-rounds", 0))
    rows = _evaluated_rows(run_dir)
    if not rows:
        return f"no evaluated round in metrics.jsonl ({planned} planned)"
    if int(rows[-1]["round"]) < planned:
        return f"stopped after round {int(rows[-1]['round'])} of {planned}"
    return None


#: keys of ``run_config.json`` that do not change a run's results (where it writes them)
_NOT_COMPARED = {"output-dir"}


def _project_importable() -> None:
    if str(ROOT) not in sys.path:  # run as ``python scripts/experiments.py``: sys.path[0] is scripts/
        sys.path.insert(0, str(ROOT))


def _overrides(config: dict[str, object]) -> list[str]:
    return [f"{k}={_toml(v)}" for k, v in config.items()]


def requested_config(run: Run) -> dict[str, object]:
    """The ``run_config.json`` that ``scripts/run_inprocess.py`` records for ``run``: pyproject.toml's run config
    with the run's ``-c`` overrides, validated and normalised by ``RunConfig`` (``to_flat``), and FedAvg's
    ``method`` tag (``strategies/fedavg_baseline.py``)."""
    _project_importable()
    from common.config import parse_run_config
    from scripts.simulate import pyproject_run_config

    flat = parse_run_config(pyproject_run_config(_overrides(run.config))).to_flat()
    return {**flat, "method": "fedavg"} if run.method == "fedavg" else flat


def config_differences(existing: dict[str, object], requested: dict[str, object]) -> list[str]:
    """Every setting in which a finished run's ``run_config.json`` (``existing``) differs from ``requested``.
    A key the finished run does not record (it predates the key) counts as different unless the requested value
    is the key's default; a recorded key the current code does not know always counts."""
    _project_importable()
    from common.config import parse_run_config

    defaults = parse_run_config({}).to_flat()
    out = []
    for k in sorted((set(existing) | set(requested)) - _NOT_COMPARED):
        if k in existing and k in requested:
            a, b = existing[k], requested[k]
            if a != b or isinstance(a, bool) != isinstance(b, bool):  # True == 1 in Python, not as a setting
                out.append(f"{k}: finished run {a!r}, requested {b!r}")
        elif k in requested:
            if k not in defaults or requested[k] != defaults[k]:
                out.append(f"{k}: not recorded by the finished run, requested {requested[k]!r}")
        else:
            out.append(f"{k}: finished run {existing[k]!r}, not a setting of the requested run")
    return out


def mismatched(runs: list[Run]) -> list[str]:
    """A message for each finished run whose settings differ from the requested ones."""
    return [f"{run.name}: {run.out} holds a finished run with other settings: " + "; ".join(diffs)
            for run in runs if run.finished and (diffs := run.differences())]


def duplicate_names(runs: list[Run]) -> list[str]:
    """A message for each run name the plan holds more than once: the second run would meet the first one's
    records (refused mid-batch if their settings differ, skipped if not).  Noise levels that round to the same
    percentage (0.1 and 0.10000001: ``noise10``) get the same name, so do repeated ``--seeds`` / ``--methods``."""
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    out = []
    for name, same in by_name.items():
        if len(same) < 2:
            continue
        keys = sorted({k for r in same for k in r.config})
        differing = [k for k in keys if len({json.dumps(r.config.get(k)) for r in same}) > 1]
        what = ("; ".join(", ".join(f"{k}={r.config.get(k)!r}" for k in differing) for r in same) if differing
                else "the same settings each time")
        out.append(f"{name}: planned {len(same)} times ({what})")
    return out


#: the run-config keys each experiment sets run by run from its own options (``-c`` must not set them)
PER_RUN_OPTIONS: dict[str, dict[str, str]] = {
    "fmnist_noise": {"label-noise": "--noise", "seed": "--seeds"},
    "fmnist_noniid": {"schedule": "--schedules", "seed": "--seeds", "num-server-rounds": "--rounds"},
}


def per_run_overrides(runs: list[Run], overrides: dict[str, object]) -> list[str]:
    """A message for each ``-c`` key that would override what the plan sets run by run: a key of the runs' names
    (:data:`PER_RUN_OPTIONS`: noise level, seed, schedule, rounds), a key that defines a planned method
    (:data:`METHODS`: its loss, divergence and their parameters, the one-client methods' ``num-clients``; the run's
    name and table label say the method's own values), or one whose value differs between the planned runs.
    Applied to every run, such an override makes the runs identical, or not what their names say, without a word.
    ``output-dir`` too: each run's records go to its own directory, and ``run_inprocess.py`` refuses the key."""
    out = []
    options = {k: v for r in runs for k, v in PER_RUN_OPTIONS.get(r.experiment, {}).items()}
    method_keys: dict[str, list[str]] = {}
    for m in dict.fromkeys(r.method for r in runs):
        for k, v in METHODS[m].items():
            method_keys.setdefault(k, []).append(f"{m}: {_toml(v)}")
    for given, value in overrides.items():
        key = given.replace("_", "-")  # the run config also takes the fields' names (label_noise for label-noise)
        planned = sorted({json.dumps(r.config.get(key)) for r in runs})
        if key == "output-dir":  # run_inprocess.py refuses it, so every run would exit 2
            where = sorted({str(r.out.parent) for r in runs})
            out.append(f"-c {given}={_toml(value)}: output-dir is not taken here: each run's records go to "
                       f"{' / '.join(where)}/<run name>; choose the names with --suffix")
        elif key in options:
            out.append(f"-c {given}={_toml(value)}: {key} is set run by run by {options[key]} "
                       f"(here {' / '.join(planned)}); use {options[key]}")
        elif key in method_keys:
            out.append(f"-c {given}={_toml(value)}: {key} is a setting of the method chosen by --methods "
                       f"({'; '.join(method_keys[key])}), which the runs' names and labels stand for")
        elif len(planned) > 1:
            unset = ", null = not set: the default" if "null" in planned else ""
            out.append(f"-c {given}={_toml(value)}: {key} differs between the planned runs ({' / '.join(planned)}"
                       f"{unset}), e.g. by --methods; every run would get the same value. Run the runs that should "
                       "get it in a command of their own")
    return out


def invalid_configs(runs: list[Run]) -> list[str]:
    """Every distinct run-config error of the plan (``RunConfig`` validation, as ``run_inprocess.py`` does it, and
    for a FedAvg run a model the baseline cannot train: ``baseline_hidden_sizes``), with the runs it concerns:
    checked before the first run, instead of each run failing in its own process."""
    errors: dict[str, list[str]] = {}
    for run in runs:
        try:
            flat = requested_config(run)
            if run.method == "fedavg":
                from common.config import parse_run_config
                from common.deterministic_mlp import baseline_hidden_sizes

                baseline_hidden_sizes(parse_run_config({k: v for k, v in flat.items() if k != "method"}))
        except ValueError as err:  # ConfigError, or a value parse_overrides cannot take
            errors.setdefault(str(err), []).append(run.name)
    return [f"{msg} (run{'s' if len(names) > 1 else ''} {', '.join(names)})" for msg, names in errors.items()]


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def fmnist_noise_runs(methods: list[str], noise: list[float], seeds: list[int]) -> list[Run]:
    runs = []
    for seed in seeds:
        for eps in noise:
            for m in methods:
                cfg = {**FMNIST_BASE, **METHODS[m], "label-noise": eps, "seed": seed}
                runs.append(Run("fmnist_noise", f"{m}-noise{round(eps * 100):02d}-seed{seed}", m, cfg,
                                {"noise": eps, "seed": seed}))
    return runs


def fmnist_noniid_runs(methods: list[str], schedules: list[str], seeds: list[int], rounds: int) -> list[Run]:
    runs = []
    for seed in seeds:
        for sched in schedules:
            for m in methods:
                cfg = {**FMNIST_BASE, **METHODS[m], "num-clients": 10, "min-clients": 10,
                       "partitioner": "dirichlet", "dirichlet-alpha": 0.3, "label-noise": 0.0,
                       "schedule": sched, "num-server-rounds": rounds, "seed": seed}
                if m == "fedavg" and sched != "synchronous":
                    continue  # FedAvg has one (synchronous) schedule
                runs.append(Run("fmnist_noniid", f"{m}-{sched}-seed{seed}", m, cfg, {"schedule": sched, "seed": seed}))
    return runs


def execute(run: Run, dry_run: bool = False) -> int:
    """Run ``run`` unless it has completed every planned round with the same settings, and return the run's exit
    code (0 when skipped or a dry run).  A finished run of its name with other settings raises
    :class:`RunConfigMismatch` naming every differing key (it is never skipped as if it were this run); one that
    ended before its planned rounds is run again."""
    if run.finished:
        if problems := mismatched([run]):
            raise RunConfigMismatch(problems[0] + ". Choose another --suffix, or move that run away.")
        if (reason := unfinished_reason(run.out)) is None:
            print(f"[skip] {run.name}: {run.out / 'summary.json'} exists with the same settings", flush=True)
            return 0
        print(f"[redo] {run.name}: the earlier run of these settings is incomplete ({reason}): running it again",
              flush=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "run_inprocess.py"), "--out", str(run.out),
           "--method", "fedavg" if run.method == "fedavg" else "pgvi"]
    for k, v in run.config.items():
        cmd += ["-c", f"{k}={_toml(v)}"]
    print(f"[run ] {run.name}: {' '.join(cmd[1:])}", flush=True)
    if dry_run:
        return 0
    run.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    t0 = time.time()
    with (run.out / "log.txt").open("w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    print(f"[done] {run.name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    if rc == 0 and (reason := unfinished_reason(run.out)) is not None:
        # e.g. an asynchronous run at its deadline, or every client failed: it ends cleanly but is not done
        print(f"[short] {run.name}: exit 0 but {reason}", flush=True)
        rc = 1
    if rc != 0:
        print(f"       see {run.out / 'log.txt'}", flush=True)
    return rc


# ---------------------------------------------------------------------------------------------- report
def _rows(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    # a metric written as null (a NaN: results.py writes strict JSON) reads as NaN, which the best-over-rounds
    # statistics skip (np.nanmax / np.nanmin) and the plots leave as gaps, instead of failing the whole report
    return [{k: math.nan if v is None else v for k, v in json.loads(line).items()}
            for line in path.read_text().splitlines() if line.strip()]


def summarise(run_dir: Path) -> dict[str, object] | None:
    """Best-over-rounds (the papers' convention) and final-round metrics of one finished run; ``None`` for a run
    that has not finished every planned round (:func:`unfinished_reason`; a warning says why when it has ended).

    A ``rescored.json`` (see :func:`rescore`) replaces the final round's NLL only, and only when its accuracy is the
    recorded one (the same predictive draws): accuracy, ECE and Brier stay the recorded ones, so that the final
    round is never scored with other draws than the rounds it is compared with (best over rounds)."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return None
    if reason := unfinished_reason(run_dir):  # e.g. an asynchronous run that hit its overall deadline
        print(f"warning: {run_dir.name} {reason}: not reported", file=sys.stderr)
        return None
    rows = _evaluated_rows(run_dir)
    cfg = json.loads((run_dir / "run_config.json").read_text())
    summary = json.loads(summary_path.read_text())
    final = dict(rows[-1])
    nlls = [r["test-nll"] for r in rows]
    if (run_dir / RESCORED).exists():  # the final NLL recomputed with the current evaluation (see ``rescore``)
        new = json.loads((run_dir / RESCORED).read_text())["final"]
        if abs(new["test-accuracy"] - final["test-accuracy"]) < 1e-12:
            final["test-nll"] = nlls[-1] = new["test-nll"]
        else:
            print(f"warning: {run_dir.name}: {RESCORED} was computed with other draws than the run's own "
                  f"(final accuracy {new['test-accuracy']:.4f}, recorded {final['test-accuracy']:.4f}): ignored, the "
                  "recorded final metrics are reported", file=sys.stderr)
    secs = [r["client-seconds-mean"] for r in rows if "client-seconds-mean" in r]
    epochs = [r["client-epochs-mean"] for r in rows if "client-epochs-mean" in r]
    return {
        "run": run_dir.name, "method": cfg.get("method") or run_dir.name.split("-")[0],
        "noise": float(cfg.get("label-noise", 0.0)), "seed": int(cfg.get("seed", 0)),
        "schedule": _schedule_label(cfg), "rounds": int(final["round"]),
        "budget": _budget_label(cfg), "label": _variant_label(cfg.get("method") or run_dir.name.split("-")[0], cfg),
        "best-accuracy": _best(np.nanmax, [r["test-accuracy"] for r in rows]), "final-accuracy": final["test-accuracy"],
        "best-nll": _best(np.nanmin, nlls), "final-nll": final["test-nll"],
        "best-ece": _best(np.nanmin, [r["test-ece"] for r in rows]), "final-ece": final["test-ece"],
        "final-brier": final["test-brier"], "wall-seconds": float(summary.get("wall-seconds", math.nan)),
        "client-seconds-per-round": float(np.mean(secs)) if secs else math.nan,
        "client-epochs-per-round": float(np.mean(epochs)) if epochs else math.nan,
        "config": json.dumps({k: v for k, v in sorted(cfg.items()) if k not in _NOT_SETTINGS}),
    }


def _best(pick: Callable[[np.ndarray], np.floating], values: list[float]) -> float:
    """The best of a run's per-round values, NaN rounds skipped (NaN if every round is NaN)."""
    arr = np.asarray(values, dtype=float)
    return float(pick(arr)) if (~np.isnan(arr)).any() else math.nan


#: run-config keys that may differ between runs averaged into one table cell (the cell's own coordinates)
_NOT_SETTINGS = {"seed", "label-noise", "output-dir"}


def _run_suffix(run: str) -> str | None:
    """What ``--suffix`` appended to a run's name (``''`` for none), or ``None`` for a name not of that form."""
    m = re.search(r"-seed\d+(.*)$", run)
    return m.group(1) if m else None


def _separate_settings(rows: list[dict[str, object]], group: Callable[[dict[str, object]], object],
                       field: str = "label") -> None:
    """Runs that ``group`` would average together must share every setting but the seed and the noise level.
    Where they do not, each run's ``field`` gets the settings that differ (``[mc-samples=1]``), so that they
    land in different rows instead of one mean.  Runs that then still share ``field``, noise and seed (the same
    settings run twice, e.g. a rerun under another ``--suffix``) are never averaged or counted as two seeds:
    each run of that row gets its name's suffix (``[runs *-again]``, or its whole name if that does not tell
    them apart), and a warning names them on stderr."""
    groups: dict[object, list[dict[str, object]]] = {}
    for r in rows:
        groups.setdefault(group(r), []).append(r)
    for members in groups.values():
        configs = [json.loads(str(r["config"])) for r in members]
        keys = sorted({k for c in configs for k in c})
        differing = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]
        for r, c in zip(members, configs):
            if differing:
                r[field] = f"{r[field]} [" + ", ".join(f"{k}={c.get(k, '—')}" for k in differing) + "]"
        rows_of: dict[object, list[dict[str, object]]] = {}
        for r in members:
            rows_of.setdefault(r[field], []).append(r)
        for same in rows_of.values():
            cells: dict[tuple, list[str]] = {}
            for r in same:
                cells.setdefault((r["noise"], r["seed"]), []).append(str(r["run"]))
            dups = {k: v for k, v in cells.items() if len(v) > 1}
            if not dups:
                continue
            suffixes = [_run_suffix(str(r["run"])) for r in same]
            cells_by_suffix = {(r["noise"], r["seed"], x) for r, x in zip(same, suffixes)}
            by_suffix = None not in suffixes and len(cells_by_suffix) == len(same)
            for r, x in zip(same, suffixes):
                tag = (f"runs *{x}" if x else "runs without a suffix") if by_suffix else f"run {r['run']}"
                r[field] = f"{r[field]} [{tag}]"
            for (noise, seed), names in sorted(dups.items()):
                print(f"warning: runs {', '.join(names)} have the same settings, noise {noise:g} and seed {seed}: "
                      f"reported in separate rows ({'by run-name suffix' if by_suffix else 'by run name'}), never "
                      "averaged or counted as several seeds", file=sys.stderr)


def _budget_label(cfg: dict) -> str:
    """The optimisation budget of a run: server rounds and (at most) local epochs per round."""
    rounds = int(cfg.get("num-server-rounds", 0))
    if cfg.get("method") == "fedavg":
        return f"{rounds} rounds, {int(cfg.get('fedavg-local-epochs', 0))} local epochs (FedAvg)"
    return f"{rounds} rounds, <= {int(cfg.get('local-epochs', 0))} local epochs"


def _variant_label(method: str, cfg: dict) -> str:
    """The method's name plus what sets this run apart from the method's defaults (loss weight, learning rate)."""
    w = float(cfg.get("loss-weight", 1.0))
    label = LABELS[method] + (f", loss weight {w:g}" if w != 1.0 else "")
    if method != "fedavg" and float(cfg.get("lr", FMNIST_BASE["lr"])) != FMNIST_BASE["lr"]:
        label += f", lr {float(cfg['lr']):g}"
    return label


def _several_budgets(rows: list[dict[str, object]]) -> frozenset[bool]:
    """Which kinds of run (``True``: FedAvg, ``False``: PGVI) come in more than one budget among ``rows``."""
    return frozenset(fedavg for fedavg in (False, True)
                     if len({r["budget"] for r in rows if (r["method"] == "fedavg") == fedavg}) > 1)


def _shown_label(row: dict[str, object], several: frozenset[bool]) -> str:
    """A run's label in a table row or a plot legend: the epoch cap is added when the same table or plot holds
    several budgets of its kind (:func:`_several_budgets`: PGVI's, or FedAvg's local epochs), so that runs of
    different budgets are never averaged together or shown under one name."""
    if (row["method"] == "fedavg") in several:
        return f"{row['label']} [{str(row['budget']).split(', ', 1)[1].removesuffix(' (FedAvg)')}]"
    return str(row["label"])


def _budget_key(row: dict[str, object]) -> tuple[int, int]:
    """Sort budgets by rounds, then epochs; FedAvg's fixed budget goes with the PGVI budget of its rounds."""
    nums = [int(t) for t in str(row["budget"]).replace(",", " ").split() if t.isdigit()]
    return nums[0], (0 if "FedAvg" in str(row["budget"]) else 1)


def _schedule_label(cfg: dict) -> str:
    sched = str(cfg.get("schedule", ""))
    if sched == "asynchronous":
        return f"asynchronous (max staleness {cfg.get('max-staleness', 'auto')})"
    return sched


def _mean_std(values: list[float], seeds: list[int] | None = None) -> str:
    """``mean ± sample std (n seeds)``; ``seeds`` (one per value) must be distinct, so n counts seeds, not runs."""
    if seeds is not None and len(set(seeds)) != len(seeds):
        raise ValueError(f"one table cell holds several runs of the same seed ({sorted(seeds)}); they would be "
                         "counted as several seeds")
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f} (1 seed)"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f} ({len(values)} seeds)"


def report_fmnist_noise(exp_dir: Path) -> str:
    rows = [s for d in sorted(exp_dir.iterdir()) if d.is_dir() and (s := summarise(d))] if exp_dir.exists() else []
    if not rows:
        return "\n".join([f"no finished runs in {exp_dir}", *_unreported(exp_dir)]) + "\n"
    _separate_settings(rows, lambda r: (r["label"], r["budget"]))
    _write_tables(exp_dir, rows)
    noises = sorted({r["noise"] for r in rows})
    order = {m: i for i, m in enumerate(METHODS)}
    lines = ["Accuracy (%) on the clean test set, mean ± std over distinct seeds; issue reference = the values quoted "
             "in the issue as FedGVI's (best over rounds, 5 seeds), which the FedGVI paper does not contain.",
             "One table per optimisation budget (FedAvg's runs are listed with the PGVI budget of the same rounds)."]
    rounds_seen = sorted({_budget_key(r)[0] for r in rows})
    for rounds in rounds_seen:
        sel = [r for r in rows if _budget_key(r)[0] == rounds]
        budgets = " / ".join(sorted({str(r["budget"]) for r in sel},
                                    key=lambda b: ("FedAvg" in b, [int(t) for t in b.split() if t.isdigit()])))
        lines += ["", f"**{budgets}**", "",
                  "| method | metric | " + " | ".join(f"{round(e * 100)} % noise" for e in noises) + " |",
                  "|---|---|" + "---|" * len(noises)]
        # a row per (variant, budget); the budget is spelled out when one table holds several of its kind
        several = _several_budgets(sel)
        variants = sorted({(str(r["method"]), str(r["label"]), str(r["budget"])) for r in sel},
                          key=lambda v: (order[v[0]], v[1], [int(t) for t in v[2].split() if t.isdigit()]))
        for m, label, budget in variants:
            shown = _shown_label({"label": label, "budget": budget, "method": m}, several)
            for metric, scale in (("best-accuracy", 100), ("final-accuracy", 100), ("final-ece", 100), ("final-nll", 1)):
                cells = []
                for e in noises:
                    cell = [r for r in sel if r["label"] == label and r["budget"] == budget and r["noise"] == e]
                    cells.append(_mean_std([r[metric] * scale for r in cell], [int(r["seed"]) for r in cell]))
                name = {"best-accuracy": "acc best", "final-accuracy": "acc final", "final-ece": "ECE final (%)",
                        "final-nll": "NLL final"}[metric]
                lines.append(f"| {shown} | {name} | " + " | ".join(cells) + " |")
            if m in ISSUE_REFERENCE:
                lines.append(f"| {shown} | issue reference (best) | "
                             + " | ".join(f"{ISSUE_REFERENCE[m].get(e, math.nan):.2f}" for e in noises) + " |")
    lines += ["", "| run | rounds | wall s | client local update s/round (mean) | local epochs run/round (mean) |",
              "|---|---|---|---|---|"]
    for r in rows:
        ep = r["client-epochs-per-round"]
        lines.append(f"| {r['run']} | {r['rounds']} | {r['wall-seconds']:.0f} | {r['client-seconds-per-round']:.1f} | "
                     + ("—" if math.isnan(ep) else f"{ep:.2f}") + " |")
    for rounds in rounds_seen:
        sel = [r for r in rows if _budget_key(r)[0] == rounds]
        tag = "" if rounds == FMNIST_BASE["num-server-rounds"] else f"_{rounds}rounds"  # stable file names
        _plot_curves(exp_dir, sel, group="noise", title=f"Fashion-MNIST, 3 clients, {{}} % label noise, {rounds} rounds",
                     fname=f"fmnist_noise{{}}{tag}_curves.png")
        _plot_reliability(exp_dir, sel, tag)
    text = "\n".join(lines + _unreported(exp_dir)) + "\n"
    (exp_dir / "table.md").write_text(text)
    return text


def report_fmnist_noniid(exp_dir: Path) -> str:
    rows = [s for d in sorted(exp_dir.iterdir()) if d.is_dir() and (s := summarise(d))] if exp_dir.exists() else []
    if not rows:
        return "\n".join([f"no finished runs in {exp_dir}", *_unreported(exp_dir)]) + "\n"
    for r in rows:  # no noise column here: a run with other label noise is another setting, not another seed
        settings = json.loads(str(r["config"]))
        settings["label-noise"] = r["noise"]
        r["config"] = json.dumps(dict(sorted(settings.items())))
    _separate_settings(rows, lambda r: (r["method"], r["schedule"]), field="schedule")
    _write_tables(exp_dir, rows)
    lines = ["| method | schedule | seeds | acc best (%) | acc final (%) | ECE final (%) | NLL final | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["method"], r["schedule"]) for r in rows})
    for m, sched in keys:
        sel = [r for r in rows if r["method"] == m and r["schedule"] == sched]
        seeds = [int(r["seed"]) for r in sel]
        lines.append(f"| {LABELS[m]} | {sched} | {len(set(seeds))} | "
                     f"{_mean_std([r['best-accuracy'] * 100 for r in sel], seeds)} | "
                     f"{_mean_std([r['final-accuracy'] * 100 for r in sel], seeds)} | "
                     f"{_mean_std([r['final-ece'] * 100 for r in sel], seeds)} | "
                     f"{_mean_std([r['final-nll'] for r in sel], seeds)} | "
                     f"{np.mean([r['wall-seconds'] for r in sel]):.0f} |")
    _plot_curves(exp_dir, rows, group=None, title="Fashion-MNIST, 10 clients, Dirichlet(0.3)",
                 fname="fmnist_noniid_curves.png")
    text = "\n".join(lines + _unreported(exp_dir)) + "\n"
    (exp_dir / "table.md").write_text(text)
    return text


def _unreported(exp_dir: Path) -> list[str]:
    """Lines for the report naming every run directory that is not in the tables and why: it ended before its
    planned rounds, or has no ``summary.json`` (see :func:`unfinished_reason`).  Such a run is never averaged in,
    and rerunning its command runs it again."""
    notes = [f"- {d.name}: {reason}" for d in (sorted(exp_dir.iterdir()) if exp_dir.exists() else [])
             if d.is_dir() and (reason := unfinished_reason(d))]
    return ["", "Incomplete runs, not in the tables:", *notes] if notes else []


def _write_tables(exp_dir: Path, rows: list[dict[str, object]]) -> None:
    (exp_dir / "results.json").write_text(json.dumps(rows, indent=2))
    with (exp_dir / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_curves(exp_dir: Path, rows: list[dict[str, object]], group: str | None, title: str, fname: str) -> None:
    """Accuracy, NLL and ECE per round for each method (mean over seeds), one figure per group value."""
    plt = _plt()
    IMG.mkdir(parents=True, exist_ok=True)
    groups = sorted({r[group] for r in rows}) if group else [None]
    for g in groups:
        sel = [r for r in rows if group is None or r[group] == g]
        several = _several_budgets(sel)
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        series: dict[str, list[list[dict[str, float]]]] = {}
        for r in sel:
            key = _shown_label(r, several) + (f" ({r['schedule']})" if group is None else "")
            series.setdefault(key, []).append([x for x in _rows(exp_dir / r["run"]) if x.get("round", 0) >= 1])
        for key, runs in sorted(series.items()):
            n = min(len(x) for x in runs)
            rounds = [runs[0][i]["round"] for i in range(n)]
            for ax, metric, scale in zip(axes, ("test-accuracy", "test-nll", "test-ece"), (100, 1, 100)):
                vals = np.array([[x[i][metric] * scale for i in range(n)] for x in runs])
                ax.plot(rounds, vals.mean(0), label=f"{key} (n={len(runs)})")
                if len(runs) > 1:
                    ax.fill_between(rounds, vals.min(0), vals.max(0), alpha=0.2)
        for ax, ylabel in zip(axes, ("test accuracy (%)", "test NLL", "test ECE (%)")):
            ax.set_xlabel("server round")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        handles, labels = axes[0].get_legend_handles_labels()
        ncol = 2 if len(labels) > 1 else 1
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
        fig.suptitle(title.format(round(g * 100)) if g is not None else title)
        fig.tight_layout(rect=(0, 0.04 + 0.05 * ((len(labels) + ncol - 1) // ncol), 1, 1))
        out = IMG / (fname.format(f"{round(g * 100):02d}") if g is not None else fname)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        print(f"wrote {out}")


def _final_predictive(run_dir: Path, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(probs, log_probs, labels)`` of a finished run's final model on the clean test set, with the draws the
    run's own evaluation used (generator seeded with the run's seed, ``eval-samples`` samples)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from common.config import parse_run_config
    from common.problem import build_problem, load_full_data
    from common.runtime import subnormals_flushed

    raw = json.loads((run_dir / "run_config.json").read_text())
    raw.pop("method", None)
    cfg = parse_run_config(raw)
    data = load_full_data(cfg)
    if method == "fedavg":
        from common.deterministic_mlp import DeterministicMLP, baseline_hidden_sizes, predict_log_probs

        model = DeterministicMLP(data.x_train.shape[1], baseline_hidden_sizes(cfg), data.num_classes)
        with np.load(run_dir / "model.npz") as z:
            model.set_arrays({k: z[k] for k in z.files})
        log_probs = predict_log_probs(model, data.x_test)
        return np.exp(log_probs), log_probs, data.y_test
    problem = build_problem(cfg, data)
    with np.load(run_dir / "posterior.npz") as z:
        q = problem.prior.from_numpy({k: z[k] for k in z.files})
    xt, _ = problem.tensors(data.x_test, data.y_test)
    with torch.no_grad(), subnormals_flushed():  # as the run's own evaluation (server/app.py)
        gen = torch.Generator().manual_seed(cfg.seed)
        log_probs = problem.model.predictive_log_probs(q, xt, cfg.eval_samples, generator=gen).numpy()
    return np.exp(log_probs), log_probs, data.y_test


RESCORED = "rescored.json"


def rescore(exp_dir: Path) -> None:
    """Recompute each finished run's final-round test metrics from its saved final model with the current
    evaluation code, into ``<run>/rescored.json``.  Made for the NLL fix of 2026-11-23: runs recorded before it
    floored the predictive probability at 1e-12 inside the NLL.  The report takes the final NLL from it, nothing
    else, and only when the recomputed accuracy is the recorded one (the run's own draws); see :func:`summarise`."""
    from common.metrics import classification_metrics_from_log_probs

    for run_dir in sorted(p for p in exp_dir.glob("*") if (p / "summary.json").exists()):
        rows = [r for r in _rows(run_dir) if r.get("round", 0) >= 1 and "test-accuracy" in r]
        if not rows:
            continue
        method = json.loads((run_dir / "run_config.json").read_text()).get("method") or run_dir.name.split("-")[0]
        _, log_probs, y = _final_predictive(run_dir, method)
        m = classification_metrics_from_log_probs(log_probs, y)
        final = {f"test-{k}": float(v) for k, v in m.items() if k != "num_points"}
        rec = rows[-1]
        same_draws = abs(final["test-accuracy"] - rec["test-accuracy"]) < 1e-12
        (run_dir / RESCORED).write_text(json.dumps({
            "final": final, "recorded": {k: rec[k] for k in final if k in rec}, "same-draws": same_draws,
            "why": "final-round metrics recomputed from the saved final model; NLL exact from log-probabilities",
        }, indent=1))
        acc = ("unchanged" if same_draws else f"DIFFERS: {rec['test-accuracy']:.4f} -> {final['test-accuracy']:.4f} "
               "(other draws: not used by the report)")
        print(f"{run_dir.name}: NLL {rec['test-nll']:.4f} -> {final['test-nll']:.4f}; accuracy {acc}", flush=True)


def _plot_reliability(exp_dir: Path, rows: list[dict[str, object]], tag: str = "") -> None:
    """Reliability diagrams (15 bins) of the final models, lowest seed, for each noise level."""
    from common.metrics import expected_calibration_error, reliability_bins

    plt = _plt()
    for eps in sorted({r["noise"] for r in rows}):
        lowest = min(x["seed"] for x in rows if x["noise"] == eps)  # of this noise level (the docstring's)
        sel = [r for r in rows if r["noise"] == eps and r["seed"] == lowest]
        if not sel:
            continue
        fig, axes = plt.subplots(1, len(sel), figsize=(3.6 * len(sel), 3.6), squeeze=False)
        for ax, r in zip(axes[0], sel):
            probs, _, y = _final_predictive(exp_dir / r["run"], r["method"])
            bins = reliability_bins(probs, y)
            conf, acc, count = bins["confidence"], bins["accuracy"], bins["count"]
            edges = np.linspace(0, 1, len(count) + 1)
            ax.bar(edges[:-1], np.where(count > 0, acc, 0), width=np.diff(edges), align="edge",
                   edgecolor="k", alpha=0.7, label="accuracy")
            ax.plot([0, 1], [0, 1], "k--", lw=1)
            ax.plot(conf[count > 0], acc[count > 0], "o", ms=3, color="C3", label="(confidence, accuracy)")
            ax.set_title(f"{r['label']}\nECE {100 * expected_calibration_error(probs, y):.2f} %", fontsize=9)
            ax.set_xlabel("confidence")
            ax.set_ylabel("accuracy")
        fig.suptitle(f"Reliability, Fashion-MNIST, {round(eps * 100)} % label noise, seed {sel[0]['seed']}")
        fig.tight_layout()
        out = IMG / f"fmnist_noise{round(eps * 100):02d}{tag}_reliability.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------- CLI
def _refuse(problems: list[str], what: str) -> None:
    """Print each problem and exit non-zero (before any run starts) when there is one."""
    if problems:
        for msg in problems:
            print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(f"{len(problems)} {what}; nothing was run.")


def main(argv: list[str] | None = None) -> None:
    _project_importable()
    from scripts.arg_types import number_above

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p1 = sub.add_parser("fmnist-noise", help="3 clients, homogeneous, random label noise")
    p1.add_argument("--methods", nargs="+", default=["fedgvi", "pvi", "fedavg", "gce"], choices=list(METHODS))
    p1.add_argument("--noise", nargs="+", type=number_above(0.0, allow_low=True), default=[0.4, 0.0, 0.1, 0.2])
    p1.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p2 = sub.add_parser("fmnist-noniid", help="10 clients, Dirichlet(0.3), the three schedules")
    # not the one-client references (gvi1, vi1): this experiment sets ten clients
    p2.add_argument("--methods", nargs="+", default=["fedgvi"],
                    choices=[m for m in METHODS if METHODS[m].get("num-clients") != 1])
    p2.add_argument("--schedules", nargs="+", default=["synchronous", "sequential", "asynchronous"])
    p2.add_argument("--seeds", nargs="+", type=int, default=[0])
    p2.add_argument("--rounds", type=int, default=10)
    for p in (p1, p2):
        p.add_argument("--suffix", default="", help="appended to each run's name (a variant of the same runs)")
        p.add_argument("--dry-run", action="store_true", help="print the commands only")
        p.add_argument("-c", "--config", action="append", default=[], help="extra run-config override key=value")
    sub.add_parser("report", help="tables and plots of the finished runs")
    sub.add_parser("rescore", help="recompute the final-round test metrics of finished runs (exact NLL)")
    args = ap.parse_args(argv)

    if args.cmd in ("fmnist-noise", "fmnist-noniid"):
        if args.cmd == "fmnist-noise":
            runs = fmnist_noise_runs(args.methods, args.noise, args.seeds)
        else:
            runs = fmnist_noniid_runs(args.methods, args.schedules, args.seeds, args.rounds)
        import tomllib

        extra: dict[str, object] = {}
        for kv in args.config:
            k, eq, v = kv.partition("=")
            try:
                if not eq or not k.strip():
                    raise ValueError("expected key=value")
                extra[k.strip()] = tomllib.loads(f"v = {v}")["v"]
            except (ValueError, tomllib.TOMLDecodeError) as err:
                if re.search(r"\s[A-Za-z_][\w-]*\s*=", v):
                    ap.error(f"-c {kv!r}: one key=value per -c (e.g. -c lr=0.1 -c seed=2)")
                ap.error(f"-c {kv!r}: {err} (a TOML value: strings quoted, e.g. -c 'loss=\"gce\"')")
        # the whole plan is checked before any run starts, so that a batch never stops half-way
        _refuse(per_run_overrides(runs, extra), "-c override(s) of what this command sets run by run")
        for run in runs:
            run.config.update(extra)
            run.name += args.suffix
        _refuse(duplicate_names(runs), "run name(s) planned more than once (give each noise level, seed and "
                "method once; noise levels that round to the same percentage share a name)")
        _refuse(invalid_configs(runs), "invalid run config(s)")
        _refuse(mismatched(runs), "finished run(s) of these names with other settings. Choose another --suffix, "
                "or move those runs away")
        failed = [run.name for run in runs if execute(run, dry_run=args.dry_run)]
        if failed:
            raise SystemExit(f"{len(failed)} of {len(runs)} run(s) failed or ended early: {', '.join(failed)}; see "
                             "each run's log.txt. The other runs are done.")
        return  # several lanes may run at once: only `report` writes the tables and plots
    if args.cmd == "rescore":
        for exp in ("fmnist_noise", "fmnist_noniid"):
            if (RUNS / exp).exists():
                rescore(RUNS / exp)
        return
    print(report_fmnist_noise(RUNS / "fmnist_noise"))
    print(report_fmnist_noniid(RUNS / "fmnist_noniid"))


if __name__ == "__main__":
    main()
