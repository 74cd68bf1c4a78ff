"""Byzantine-robustness experiment: one Byzantine client among honest ones, under each aggregator.

Usage:
    python scripts/byzantine.py [--rounds 5] [--local-epochs 100] [--honest 10] [--jobs 2]
                                [--attacks scale:10,flip] [--aggregators sum,norm_clip,trimmed_mean,median]
                                [--out runs/byzantine] [--from-records] [-c key=value ...]

The embedded main job (``[tool.flwr.app.config]`` in pyproject.toml: BNN 64-50-10 on scikit-learn digits,
GCE loss + Alpha-Renyi divergence, 20 % random label noise, IID split) is run with ``honest + 1`` clients
(``num-clients = min-clients = honest + 1``), the synchronous schedule and ``damping = auto`` (rho = 1/M),
through the real PGVI strategy and the real ClientApp in one process (:class:`strategies.inprocess.InProcessGrid`,
as ``scripts/run_inprocess.py``).  The Byzantine client is the last partition (``site-<M-1>``); it has the
test-only node config ``fault`` (``scale:10``: it sends 10 x its Delta; ``flip``: it sends -Delta) in every round.

Scenarios: ``honest`` (no fault) and each attack, each under each aggregator (``sum``, ``norm_clip``,
``trimmed_mean``, ``median``, with the run-config hyperparameters of the main job).  Every run has the same seed,
data and partition; only the fault and the aggregator differ.  Accuracy is the server's held-out test set
(``test-accuracy`` in each run's ``metrics.jsonl``), reported for the final round and as the best over rounds
1..R, and as differences in percentage points to the honest run with plain sum and to the honest run with the
same aggregator.  Diagnostics of the final posterior: the relative shift of its mean, ``||mu - mu_ref|| /
||mu_ref||`` over all weights, against the honest plain-sum run and against the honest run with the same
aggregator; the ratio of its mean precision to the honest plain-sum one; and the mean precision of the ledger's
sites (the other clients' average and the last client's).  Results and observations: docs/byzantine.md.

Each run writes the usual records (``metrics.jsonl``, ``metrics.csv``, ``summary.json``, ...) under
``<out>/<scenario>-<aggregator>/``.  Runs are independent processes (``--jobs``), each with one torch thread, so
the results do not depend on ``--jobs`` (each run is deterministic).  The tables are always read back from the
records; ``--from-records`` rebuilds them from an earlier run without running anything, and refuses records of
runs made with different settings (rounds, clients, seed, local epochs, attack, ...: every differing key is named),
whose rows would not be comparable.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import numpy as np  # noqa: E402

from scripts.arg_types import int_at_least  # noqa: E402

AGGREGATORS = ("sum", "norm_clip", "trimmed_mean", "median")
ATTACKS = ("scale:10", "flip")
HONEST = "honest"


@dataclass(frozen=True)
class RunSpec:
    """One run: the scenario (``honest`` or an attack = the Byzantine client's ``fault``) and the aggregator."""

    scenario: str
    aggregator: str

    @property
    def name(self) -> str:
        return f"{self.scenario.replace(':', '')}-{self.aggregator}"


@dataclass
class RunResult:
    """What the table needs from one run, read back from its records (see :func:`load_result`)."""

    scenario: str
    aggregator: str
    accuracy_by_round: list[float]  # server test accuracy after rounds 1..R
    final_nll: float
    applied: int
    rejected: int
    posterior_mean: np.ndarray  # all weights' means, concatenated in the prior's name order
    posterior_precision: np.ndarray
    site_precision: dict[str, float]  # client id -> mean precision of its ledger site over all coordinates
    byzantine_id: str  # the last client (the Byzantine one when the scenario is an attack)
    cpu_seconds: float
    wall_seconds: float

    @property
    def final_accuracy(self) -> float:
        return self.accuracy_by_round[-1]

    @property
    def best_round(self) -> int:
        return int(np.argmax(self.accuracy_by_round)) + 1

    @property
    def best_accuracy(self) -> float:
        return self.accuracy_by_round[self.best_round - 1]


def experiment_config(base: dict, honest: int, rounds: int, local_epochs: int, overrides: dict | None = None) -> dict:
    """The run config shared by every run: the main job with ``honest + 1`` clients, synchronous, damping auto."""
    if honest < 1:
        raise ValueError(f"honest must be >= 1 (number of honest clients), got {honest}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if local_epochs < 1:
        raise ValueError(f"local_epochs must be >= 1, got {local_epochs}")
    m = honest + 1
    raw = dict(base)
    raw.update({
        "num-clients": m,
        "min-clients": m,
        "schedule": "synchronous",
        "damping": "auto",
        "fraction-train": 1.0,
        "num-server-rounds": rounds,
        "local-epochs": local_epochs,
        "torch-threads": 1,
        "evaluate-clients": False,  # the clients' local test splits are not reported; the server's test set is
        "checkpoint": False,
        "resume": "",
        "wait-for-clients-s": 0.0,
    })
    raw.update(overrides or {})
    return raw


def _node_configs(num_clients: int, fault: str) -> list[dict]:
    width = len(str(num_clients - 1))
    nodes = []
    for m in range(num_clients):
        nc = {"partition-id": m, "num-partitions": num_clients, "client-id": f"site-{m:0{width}d}", "torch-threads": 1}
        if fault and m == num_clients - 1:
            nc["fault"] = fault
        nodes.append(nc)
    return nodes


def byzantine_client_id(num_clients: int) -> str:
    return _node_configs(num_clients, "")[-1]["client-id"]


def run_one(spec: RunSpec, raw: dict, out_dir: str) -> RunResult:
    """One run of the real strategy against the real ClientApp, in this process; records under
    ``<out_dir>/<spec.name>/`` (plus ``byzantine.json``: the run's CPU and wall seconds)."""
    import logging

    from common.runtime import configure_compute

    configure_compute(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from client.app import app as client_app
    from server.app import prepare, run_strategy
    from strategies.inprocess import InProcessGrid

    raw = {**raw, "aggregator": spec.aggregator}
    cfg, problem = prepare(raw)
    fault = "" if spec.scenario == HONEST else spec.scenario
    grid = InProcessGrid(client_app, _node_configs(cfg.num_clients, fault), raw)
    run_dir = Path(out_dir) / spec.name
    t_wall, t_cpu = time.time(), time.process_time()
    run_strategy(grid, cfg, problem, run_dir)
    timing = {"cpu-seconds": time.process_time() - t_cpu, "wall-seconds": time.time() - t_wall,
              "scenario": spec.scenario, "aggregator": spec.aggregator, "num-clients": cfg.num_clients}
    (run_dir / "byzantine.json").write_text(json.dumps(timing, indent=2))
    return load_result(spec, out_dir)


def load_result(spec: RunSpec, out_dir: str | Path) -> RunResult:
    """Read one run's records: ``metrics.jsonl`` (rows with ``test-accuracy``), ``posterior.npz``, ``sites.npz``,
    ``run_config.json`` and ``byzantine.json`` (timing; NaN when absent)."""
    run_dir = Path(out_dir) / spec.name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["round"] >= 1]
    if not rows:
        raise ValueError(f"{run_dir}: no completed round in metrics.jsonl")
    num_clients = int(json.loads((run_dir / "run_config.json").read_text())["num-clients"])
    post = np.load(run_dir / "posterior.npz")
    names = [k.removeprefix("eta1/") for k in post.files if k.startswith("eta1/")]
    prec = np.concatenate([-2.0 * post[f"eta2/{n}"].astype(np.float64).ravel() for n in names])
    mean = np.concatenate([post[f"eta1/{n}"].astype(np.float64).ravel() for n in names]) / prec
    sites = np.load(run_dir / "sites.npz")
    site_precision: dict[str, float] = {}
    for cid in sorted({k.split("|", 1)[0] for k in sites.files}):
        site_precision[cid] = float(np.mean(np.concatenate(
            [-2.0 * sites[f"{cid}|eta2/{n}"].astype(np.float64).ravel() for n in names])))
    timing_file = run_dir / "byzantine.json"
    timing = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    return RunResult(
        scenario=spec.scenario,
        aggregator=spec.aggregator,
        accuracy_by_round=[float(r["test-accuracy"]) for r in rows],
        final_nll=float(rows[-1]["test-nll"]),
        applied=int(sum(r.get("applied", 0.0) for r in rows)),
        rejected=int(sum(r.get("rejected", 0.0) for r in rows)),
        posterior_mean=mean,
        posterior_precision=prec,
        site_precision=site_precision,
        byzantine_id=byzantine_client_id(num_clients),
        cpu_seconds=float(timing.get("cpu-seconds", math.nan)),
        wall_seconds=float(timing.get("wall-seconds", math.nan)),
    )


#: run-config keys that may differ between the runs of one experiment: set per run, or where the run wrote
_PER_RUN_KEYS = {"aggregator", "output-dir"}


def mixed_settings(specs: list[RunSpec], out_dir: str | Path) -> list[str]:
    """Every way in which the records in ``out_dir`` of ``specs`` are not the runs of one experiment: a run config
    (every key but the aggregator) other than the first run's (the honest run with plain sum), an aggregator other
    than the run's directory name says, or a ``byzantine.json`` naming another scenario (the fault is a node
    config, not in ``run_config.json``).  Empty when they are.  The runs' rows are compared with each other and
    with the honest runs, so records of other rounds, clients, seeds or attacks must never meet in one table."""
    out_dir = Path(out_dir)
    configs = {s: json.loads((out_dir / s.name / "run_config.json").read_text()) for s in specs}
    ref_spec = specs[0]
    ref = configs[ref_spec]
    problems = []
    for s, cfg in configs.items():
        if cfg.get("aggregator") != s.aggregator:
            problems.append(f"{s.name}: run with the aggregator {cfg.get('aggregator')!r}, not {s.aggregator!r}")
        timing = out_dir / s.name / "byzantine.json"
        recorded = json.loads(timing.read_text()).get("scenario") if timing.exists() else None
        if recorded is not None and recorded != s.scenario:
            problems.append(f"{s.name}: run as the scenario {recorded!r} (byzantine.json), not {s.scenario!r}")
        if s == ref_spec:
            continue
        diffs = [f"{k} {cfg.get(k, '(not recorded)')!r} ({ref_spec.name}: {ref.get(k, '(not recorded)')!r})"
                 for k in sorted((set(cfg) | set(ref)) - _PER_RUN_KEYS) if cfg.get(k) != ref.get(k)]
        if diffs:
            problems.append(f"{s.name}: " + ", ".join(diffs))
    return problems


def _run_star(args: tuple[RunSpec, dict, str]) -> RunResult:
    return run_one(*args)


def check_attack(attack: str) -> None:
    """``flip`` or ``scale:<finite number>``, else ``ValueError``: the client runs an unknown fault as an honest
    update, so a typo (``scale10``, ``fllip``) gave a row identical to the honest run, under an attack's name."""
    if attack == "flip":
        return
    if attack.startswith("scale:"):
        try:
            factor = float(attack.split(":", 1)[1])
        except ValueError:
            factor = math.nan
        if math.isfinite(factor):
            return
    raise ValueError(f"unknown attack {attack!r}; known: 'flip' and 'scale:<finite number>' (e.g. 'scale:10')")


def specs_for(attacks: tuple[str, ...], aggregators: tuple[str, ...], honest_all: bool) -> list[RunSpec]:
    """The runs: honest with plain sum (the reference), honest with every other aggregator if ``honest_all``,
    and every (attack, aggregator)."""
    specs = [RunSpec(HONEST, "sum")]
    if honest_all:
        specs += [RunSpec(HONEST, a) for a in aggregators if a != "sum"]
    specs += [RunSpec(f, a) for f in attacks for a in aggregators]
    return specs


def run_experiment(
    raw: dict,
    attacks: tuple[str, ...] = ATTACKS,
    aggregators: tuple[str, ...] = AGGREGATORS,
    out_dir: str | Path = ROOT / "runs" / "byzantine",
    jobs: int = 1,
    honest_all: bool = True,
    from_records: bool = False,
) -> list[dict]:
    """Run every scenario and return the table rows (dicts; accuracies as fractions, differences in points).

    ``raw`` is the full run config (see :func:`experiment_config`); the aggregator is set per run.  With
    ``from_records`` nothing is run: the rows are rebuilt from the records of an earlier run in ``out_dir``, and
    ``ValueError`` names every difference when those records are not runs of one setting (:func:`mixed_settings`).
    """
    for a in aggregators:
        if a not in AGGREGATORS:
            raise ValueError(f"unknown aggregator '{a}'; known: {', '.join(AGGREGATORS)}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    for attack in attacks:
        check_attack(attack)
    specs = specs_for(tuple(attacks), tuple(aggregators), honest_all)
    if from_records:
        results = [load_result(s, out_dir) for s in specs]
        if problems := mixed_settings(specs, out_dir):
            raise ValueError(f"the records in {out_dir} are runs of different settings, so their rows are not "
                             "comparable; rerun them, or rebuild the table of one setting at a time:\n  "
                             + "\n  ".join(problems))
    elif jobs > 1:
        work = [(s, dict(raw), str(out_dir)) for s in specs]
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
            results = list(ex.map(_run_star, work))
    else:
        results = [_run_star((s, dict(raw), str(out_dir))) for s in specs]
    return make_table(results)


def make_table(results: list[RunResult]) -> list[dict]:
    """Rows with differences to the honest plain-sum run and to the honest run with the same aggregator."""
    by = {(r.scenario, r.aggregator): r for r in results}
    ref = by[(HONEST, "sum")]
    ref_prec = float(np.mean(ref.posterior_precision))

    def shift(r: RunResult, base: RunResult | None) -> float:
        if base is None:
            return math.nan
        return float(np.linalg.norm(r.posterior_mean - base.posterior_mean) / np.linalg.norm(base.posterior_mean))

    rows = []
    for r in results:
        same = by.get((HONEST, r.aggregator))
        others = [v for k, v in r.site_precision.items() if k != r.byzantine_id]
        rows.append({
            "scenario": r.scenario,
            "aggregator": r.aggregator,
            "final-accuracy": r.final_accuracy,
            "best-accuracy": r.best_accuracy,
            "best-round": r.best_round,
            "final-diff-pts": 100.0 * (r.final_accuracy - ref.final_accuracy),
            "best-diff-pts": 100.0 * (r.best_accuracy - ref.best_accuracy),
            "final-diff-same-agg-pts": math.nan if same is None else 100.0 * (r.final_accuracy - same.final_accuracy),
            "final-nll": r.final_nll,
            "mean-shift": shift(r, ref),
            "mean-shift-same-agg": shift(r, same),
            "precision-ratio": float(np.mean(r.posterior_precision)) / ref_prec,
            "site-precision-others": float(np.mean(others)) if others else math.nan,
            "site-precision-last": r.site_precision.get(r.byzantine_id, math.nan),
            "applied": r.applied,
            "rejected": r.rejected,
            "accuracy-by-round": r.accuracy_by_round,
            "cpu-seconds": r.cpu_seconds,
            "wall-seconds": r.wall_seconds,
        })
    return rows


def _pts(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.2f}"


def _md(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """Accuracy on the server's test set: final round, best over rounds, differences in points."""
    head = ["scenario", "aggregator", "final acc %", "best acc % (round)", "final - honest sum (pts)",
            "best - honest sum (pts)", "final - honest same agg. (pts)", "final test NLL"]
    body = [[r["scenario"], r["aggregator"], f"{100 * r['final-accuracy']:.2f}",
             f"{100 * r['best-accuracy']:.2f} ({r['best-round']})", _pts(r["final-diff-pts"]),
             _pts(r["best-diff-pts"]), _pts(r["final-diff-same-agg-pts"]), f"{r['final-nll']:.4f}"] for r in rows]
    return _md(head, body)


def diagnostics_table(rows: list[dict]) -> str:
    """The final posterior against the honest ones, the ledger's sites, applied/rejected updates."""
    head = ["scenario", "aggregator", "mean shift vs honest sum", "mean shift vs honest same agg.",
            "mean precision / honest sum", "site precision: other clients (avg)", "site precision: last client",
            "applied / rejected"]
    body = [[r["scenario"], r["aggregator"], f"{r['mean-shift']:.4f}", f"{r['mean-shift-same-agg']:.4f}",
             f"{r['precision-ratio']:.3f}", f"{r['site-precision-others']:.2f}", f"{r['site-precision-last']:.2f}",
             f"{r['applied']} / {r['rejected']}"] for r in rows]
    return _md(head, body)


def per_round_table(rows: list[dict]) -> str:
    """Server test accuracy (%) after each round."""
    n = max(len(r["accuracy-by-round"]) for r in rows)
    head = ["scenario", "aggregator", *(f"r{i + 1}" for i in range(n))]
    body = [[r["scenario"], r["aggregator"], *(f"{100 * a:.2f}" for a in r["accuracy-by-round"])] for r in rows]
    return _md(head, body)


#: run-config keys this script sets from its own options (per run: the aggregator), which ``-c`` may not set:
#: applied after the option, ``-c aggregator=...`` was overwritten run by run without a word, and the others
#: would contradict the option the tables and the records' names stand for
OPTION_KEYS: dict[str, str] = {
    "aggregator": "--aggregators (one run per aggregator)",
    "num-clients": "--honest (num-clients = honest + 1)",
    "min-clients": "--honest (min-clients = honest + 1)",
    "num-server-rounds": "--rounds",
    "local-epochs": "--local-epochs",
    "output-dir": "--out (each run's records go to <out>/<scenario>-<aggregator>)",
}


def parse_config_overrides(items: list[str]) -> dict:
    """The ``-c`` overrides (``key=value`` pairs with TOML values, as ``flwr run -c``): ``ValueError`` names a
    malformed one, or a key that one of this script's options sets (:data:`OPTION_KEYS`), with that option."""
    from scripts.simulate import parse_overrides

    overrides: dict = {}
    for item in items:
        for key, value in parse_overrides(item).items():
            option = OPTION_KEYS.get(key.replace("_", "-"))  # the run config also takes the fields' names
            if option is not None:
                raise ValueError(f"-c {item!r}: {key} is set by {option}, not by -c")
            overrides[key] = value
    return overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest", type=int_at_least(1), default=10, help="number of honest clients (plus one Byzantine)")
    ap.add_argument("--rounds", type=int_at_least(1), default=5)
    ap.add_argument("--local-epochs", type=int_at_least(1), default=100)
    ap.add_argument("--jobs", type=int_at_least(1), default=2, help="runs in parallel (processes, 1 torch thread each)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated faults ('' for none)")
    ap.add_argument("--aggregators", default=",".join(AGGREGATORS),
                    help=f"comma-separated, of {', '.join(AGGREGATORS)}")
    ap.add_argument("--no-honest-all", action="store_true", help="honest run with plain sum only")
    ap.add_argument("-c", "--config", action="append", default=[],
                    help="run-config override key=value (TOML value), applied over the experiment's fixed settings "
                         "(schedule, damping, ...); not a key an option sets: " + ", ".join(OPTION_KEYS))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "byzantine")
    ap.add_argument("--from-records", action="store_true", help="do not run: rebuild the tables from <out>")
    args = ap.parse_args()
    for attack in (a for a in args.attacks.split(",") if a):
        try:
            check_attack(attack)
        except ValueError as err:
            ap.error(f"--attacks: {err}")
    for agg in args.aggregators.split(","):
        if agg and agg not in AGGREGATORS:
            ap.error(f"--aggregators: unknown aggregator {agg!r}; known: {', '.join(AGGREGATORS)}")
    for option, listed in (("--attacks", args.attacks), ("--aggregators", args.aggregators)):
        items = [a for a in listed.split(",") if a]
        if repeated := sorted({a for a in items if items.count(a) > 1}):  # two processes would write one directory
            ap.error(f"{option}: listed twice: {', '.join(repeated)}")
    if args.from_records and not args.out.is_dir():
        ap.error(f"--from-records: {args.out} is not a directory, so there are no records to rebuild the tables from")

    from common.config import parse_run_config
    from scripts.run_inprocess import load_run_config

    aggregators = tuple(a for a in args.aggregators.split(",") if a)
    try:
        overrides = parse_config_overrides(args.config)  # applied last: they win over the experiment's settings
        raw = experiment_config(load_run_config([]), args.honest, args.rounds, args.local_epochs, overrides)
        if not args.from_records:
            for agg in ("sum", *aggregators):  # as each run will: a bad -c value is refused before any run starts
                parse_run_config({**raw, "aggregator": agg})
    except ValueError as err:  # a malformed -c, a key an option sets, or a ConfigError
        ap.error(str(err))
    code = code_version()  # before the workers import the code
    t0, c0 = time.time(), _cpu_with_children()
    try:
        rows = run_experiment(raw, tuple(a for a in args.attacks.split(",") if a), aggregators, args.out, args.jobs,
                              honest_all=not args.no_honest_all, from_records=args.from_records)
    except (ValueError, OSError) as err:
        if not args.from_records:
            raise
        if isinstance(err, FileNotFoundError):  # a run of these scenarios that the records do not hold
            raise SystemExit(f"error: no records of this run in {args.out}: {err.filename} is missing (run the "
                             "command without --from-records first, with the same --attacks and --aggregators)"
                             ) from None
        raise SystemExit(f"error: {err}") from None
    wall, cpu = time.time() - t0, _cpu_with_children() - c0
    print(markdown_table(rows), end="\n\n")
    print(diagnostics_table(rows), end="\n\n")
    print(per_round_table(rows), end="\n\n")
    runs_cpu = sum(r["cpu-seconds"] for r in rows)
    if args.from_records:
        cfg = json.loads((args.out / RunSpec(HONEST, "sum").name / "run_config.json").read_text())
        print(f"tables rebuilt from the records in {args.out} (every run: "
              + ", ".join(f"{k} {cfg.get(k)}" for k in ("num-clients", "num-server-rounds", "local-epochs", "seed"))
              + f"); the runs took {runs_cpu:.1f} CPU s in total (max {max(r['cpu-seconds'] for r in rows):.1f} s, "
              f"max wall {max(r['wall-seconds'] for r in rows):.1f} s)")
    else:
        print(f"wall {wall:.1f} s with --jobs {args.jobs}; CPU {cpu:.1f} s (this process and its workers); "
              f"inside the runs {runs_cpu:.1f} CPU s (max {max(r['cpu-seconds'] for r in rows):.1f} s per run); "
              f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("command: " + " ".join(shlex.quote(a) for a in ["python", *sys.argv]))
    if not args.from_records:
        print(f"code: {code} (at the start)")
        out_json = args.out / "table.json"
        out_json.write_text(json.dumps({"wall-seconds": wall, "cpu-seconds": cpu, "argv": sys.argv, "code": code,
                                        "rows": rows}, indent=2, default=float))


def code_version() -> str:
    """The git commit of the code that ran, and whether the core packages had uncommitted changes (read-only)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "common", "strategies", "client", "server"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head + (" + uncommitted changes in " + ", ".join(sorted({ln[3:] for ln in dirty.splitlines()}))
                   if dirty else "")


def _cpu_with_children() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main()
