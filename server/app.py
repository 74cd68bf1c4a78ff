"""PGVI ServerApp: validate the run config, build the problem, run the PGVI strategy, write the records."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from logging import ERROR, INFO, WARNING
from pathlib import Path

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from client import object_pulls
from common.config import REGRESSION_MODELS, ConfigError, RunConfig, parse_run_config
from common.evaluation import evaluate_posterior
from common.problem import Problem, build_problem, load_clean_data, load_full_data, train_partition
from common.runtime import configure_threads, flush_denormals_from_environment, subnormals_flushed
from strategies.pgvi import PGVIStrategy
from strategies.results import recorder_for

app = ServerApp()


def prepare(run_config: dict) -> tuple[RunConfig, Problem]:
    """Everything that can fail on configuration, done before round 1 (raises ConfigError)."""
    cfg = parse_run_config(run_config)  # also the seed's range, so the stages below cannot fail on it
    with _memory_attributed_to("num-clients/dataset (the synthetic sets draw 60 points per client)"):
        return _prepare(cfg)


@contextmanager
def _memory_attributed_to(keys: str) -> Iterator[None]:
    """A size the config accepts but this machine cannot allocate (``hidden="100000000"``: 25.6 GB of parameters;
    ``num-clients=100000000`` for a synthetic set: 134 GiB) is a ConfigError naming the keys, not numpy's or torch's
    allocation traceback."""
    try:
        yield
    except MemoryError as err:
        raise ConfigError(f"invalid run config: {keys}: does not fit in memory ({type(err).__name__}: {err})") from None
    except RuntimeError as err:
        if "can't allocate" not in str(err):
            raise
        raise ConfigError(f"invalid run config: {keys}: does not fit in memory ({' '.join(str(err).split())})") from None


def _prepare(cfg: RunConfig) -> tuple[RunConfig, Problem]:
    # each stage's failure is attributed to the keys that stage reads
    try:
        load_clean_data(cfg)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid run config: dataset/data-dir: {err}") from None
    except ValueError as err:
        if "test_fraction" in str(err):  # the train/test split: a test-fraction that leaves too few points
            raise ConfigError(f"invalid run config: dataset/test-fraction: {err}") from None
        raise ConfigError(f"invalid run config: dataset/data-dir: {err}") from None  # a malformed data file
    try:
        data = load_full_data(cfg)
    except ValueError as err:
        raise ConfigError(f"invalid run config: label-noise/label-noise-kind: {err}") from None
    train_partition(cfg)  # an infeasible partition: ConfigError naming partitioner/num-clients/... (cached for clients)
    if (why := cfg.ignored_label_noise()) is not None:
        log(WARNING, "run config: %s", why)
    if (why := cfg.aggregator_warning()) is not None:
        log(WARNING, "run config: %s", why)
    if cfg.torch_threads:
        configure_threads(cfg.torch_threads)
    try:  # a bad PGVI_FLUSH_DENORMALS fails here, before round 1
        flush_denormals_from_environment()
    except ValueError as err:
        raise ConfigError(f"invalid environment: {err}") from None
    with _memory_attributed_to("model/hidden/family (the model's parameters and their Gaussian)"):
        problem = build_problem(cfg, data)
    _check_likelihood_precision(cfg, problem, data)
    if cfg.resume:  # a missing or foreign checkpoint is a config error, found before any record is written
        from strategies.checkpoint import CheckpointMismatch, load_checkpoint

        try:
            load_checkpoint(PGVIStrategy(problem), cfg.resume)
        except (FileNotFoundError, CheckpointMismatch) as err:
            raise ConfigError(f"invalid run config: resume: {err}") from None
    return cfg, problem


#: the largest share of the dtype's largest float the likelihood's precision may take (the posterior adds the
#: prior's and the other clients' to it, the cavity subtracts one)
_PRECISION_HEADROOM = 2.0**-10


def _check_likelihood_precision(cfg: RunConfig, problem: Problem, data) -> None:
    """The Gaussian models' loss is quadratic in theta: the precision it adds, summed over the whole training set
    (an upper bound for any client's), computed in float64, must stay well inside the dtype's range.  The config's
    own bound on likelihood-sigma cannot see the data: float32 with sigma 1.1e-19 (just above that bound) and 60
    points made the precision 5e39, inf in float32, and every client's conjugate update 'improper' in round 1."""
    if cfg.model not in REGRESSION_MODELS:
        return
    f64 = torch.float64
    x = torch.as_tensor(data.x_train, dtype=f64)
    y = torch.as_tensor(data.y_train, dtype=f64)
    mean = problem.prior.mean()  # the score-matching weight's reference point: the prior's mean will do here
    reference = {k: v.to(f64) for k, v in mean.items()} if isinstance(mean, dict) else {"theta": mean.to(f64)}
    try:
        quad = problem.loss.quadratic(problem.model, x if x.numel() else None, y, reference)
    except (ValueError, RuntimeError, TypeError):  # not this check's business: the run reports it where it arises
        return
    if quad is None:
        return
    top = float(quad.precision.abs().max()) if quad.precision.numel() else 0.0
    limit = float(torch.finfo(getattr(torch, cfg.dtype)).max) * _PRECISION_HEADROOM
    if not top <= limit:
        raise ConfigError(f"invalid run config: likelihood-sigma: with these data the likelihood's precision reaches "
                          f"{top:.3g} (sigma {cfg.likelihood_sigma:g}, {len(data.y_train)} training points), beyond "
                          f"{limit:.3g}, the part of dtype {cfg.dtype}'s range left for the posterior: raise "
                          "likelihood-sigma or use dtype float64")


def run_strategy(grid: Grid, cfg: RunConfig, problem: Problem, out_dir: Path) -> PGVIStrategy:
    data = load_full_data(cfg)
    recorder = recorder_for(out_dir, cfg.to_flat())

    def server_evaluate(q):  # held-out test set of the whole dataset
        with subnormals_flushed():  # on the evaluating thread, for this call (the process may be a test's)
            return evaluate_posterior(problem, q, data.x_test, data.y_test, cfg.eval_samples, seed=cfg.seed)

    strategy = PGVIStrategy(
        problem,
        server_evaluate=server_evaluate,
        on_round_end=recorder.record,
        checkpoint_dir=out_dir if cfg.checkpoint else None,
        resume_from=cfg.resume or None,
    )
    t0 = time.time()
    strategy.start(grid)
    assert strategy.state.posterior is not None
    recorder.finish(
        strategy.state.posterior,
        strategy.state.sites,
        {
            "wall-seconds": time.time() - t0,
            "ledger-versions": strategy.ledger_versions,
            "rejections": strategy.rejections,
            "final": strategy.history[-1] if strategy.history else {},
            "rounds-completed": strategy.round_completed,
            "rounds-planned": cfg.num_server_rounds,
        },
    )
    log(INFO, "PGVI records written to %s", out_dir)
    return strategy


@contextmanager
def config_errors_logged() -> Iterator[None]:
    """A :class:`ConfigError` leaving a ServerApp is first logged as one ERROR line naming the key, then re-raised:
    Flower 1.39 logs every exception of a ServerApp with its traceback ("ServerApp raised an exception", or
    "Simulation raised an exception") and marks the run failed with the message as its details; the line comes
    before that traceback."""
    try:
        yield
    except ConfigError as err:
        log(ERROR, "%s", err)
        raise


@app.main()
def main(grid: Grid, context: Context) -> None:
    with config_errors_logged():
        cfg, problem = prepare(dict(context.run_config))
        # how soon this process's Grid asks the SuperLink again for a reply's arrays still being pushed
        object_pulls.set_initial_retry(cfg.object_pull_retry_s)
        out_dir = Path(cfg.output_dir) / f"run-{grid.run.run_id}"
        run_strategy(grid, cfg, problem, out_dir)
