"""Regression tests of the config/data/records review (review 25b): every infeasible or non-finite run config is one
ConfigError naming the run-config key before round 1; regression runs partition as configured; label noise does
not change the partition; a reused output directory never mixes two runs' result files; result files are written
atomically; the client metrics do not pool counts; the FedAvg client checks its node's num-partitions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from common.config import ConfigError, RunConfig, parse_run_config
from common.data.partition import partition
from common.problem import _full_dataset, build_problem, client_shard, load_full_data
from server.app import prepare
from tests.test_server_app import app_config
from tests.test_strategy_edge_cases import _EvalReply

INF, NAN = float("inf"), float("nan")
REGRESSION = [("linear_regression", "synthetic_linear_regression"),
              ("gaussian_location", "synthetic_gaussian_location")]


def _config_error(raw: dict, via_prepare: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        prepare(raw) if via_prepare else parse_run_config(raw)
    msg = str(info.value)
    assert msg.startswith("invalid run config: ") and "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------------
# 1. regression datasets: the configured partitioner, and no label-based options


@pytest.mark.parametrize("model,dataset", REGRESSION)
def test_regression_keeps_size_skew(model, dataset):
    """size_skew ignores the labels: a regression run gets the skewed sizes, not the iid split (it did)."""
    cfg = parse_run_config({"model": model, "dataset": dataset, "num-clients": 5, "partitioner": "size_skew"})
    sizes = [len(client_shard(cfg, m).y_train) for m in range(5)]
    n = len(load_full_data(cfg).y_train)
    expected = [len(p) for p in partition("size_skew", np.zeros(n, np.int64), 5, seed=cfg.seed)]
    assert sizes == expected and len(set(sizes)) > 1, sizes


@pytest.mark.parametrize("model,dataset", REGRESSION)
@pytest.mark.parametrize("partitioner", ["label_skew", "dirichlet"])
def test_regression_rejects_label_based_partitioners(model, dataset, partitioner):
    """These crashed every client with ``TypeError: iid() got an unexpected keyword argument``."""
    msg = _config_error({"model": model, "dataset": dataset, "num-clients": 5, "partitioner": partitioner})
    assert "partitioner" in msg and partitioner in msg and "real-valued" in msg


@pytest.mark.parametrize("model,dataset", REGRESSION)
def test_regression_says_that_label_noise_is_not_applied(model, dataset, caplog):
    """Label noise was silently ignored for real-valued targets: the server now says so before round 1 (not an
    error: the app's default label-noise is for its classification job)."""
    cfg = parse_run_config({"model": model, "dataset": dataset, "label-noise": 0.3})
    assert "label-noise = 0.3" in (cfg.ignored_label_noise() or "")
    assert parse_run_config({"model": model, "dataset": dataset, "label-noise": 0.0}).ignored_label_noise() is None
    assert parse_run_config({"label-noise": 0.3}).ignored_label_noise() is None  # digits: applied
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.addHandler(caplog.handler)
    try:
        prepare({**app_config(), "model": model, "dataset": dataset, "family": "mean_field", "label-noise": 0.3})
    finally:
        FLOWER_LOGGER.removeHandler(caplog.handler)
    assert any("no contamination is applied" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------
# 2. partition feasibility before round 1


@pytest.mark.parametrize(
    "override,keys",
    [
        # the app's defaults (digits, 3 clients, 2 classes each): 3 x 2 < 10 classes
        ({"partitioner": "label_skew"}, ["partitioner", "num-clients", "classes-per-client"]),
        ({"dataset": "breast_cancer", "model": "logistic_regression", "partitioner": "label_skew",
          "classes-per-client": 3}, ["classes-per-client"]),
        ({"dataset": "breast_cancer", "model": "logistic_regression", "num-clients": 500, "min-clients": 2},
         ["num-clients"]),
        ({"dataset": "synthetic_logistic_2d", "model": "logistic_regression", "num-clients": 1000, "min-clients": 2},
         ["num-clients"]),
        ({"dataset": "breast_cancer", "model": "logistic_regression", "partitioner": "dirichlet", "num-clients": 50,
          "min-clients": 2}, ["partitioner", "num-clients"]),
        ({"dataset": "digits", "partitioner": "dirichlet", "dirichlet-alpha": 1e-3, "num-clients": 20,
          "min-clients": 2}, ["dirichlet-alpha", "num-clients"]),
    ],
)
def test_infeasible_partition_is_a_config_error_before_round_1(override, keys):
    msg = _config_error({**app_config(), **override}, via_prepare=True)
    for key in keys:
        assert key in msg, (key, msg)
    for internal in ("classes_per_partition", "min_size", "num_partitions", "max_retries"):
        assert internal not in msg, msg


def test_dirichlet_alpha_must_be_finite():
    assert "dirichlet-alpha" in _config_error({"partitioner": "dirichlet", "dirichlet-alpha": INF})


def test_feasible_partitions_still_prepare():
    cfg, _ = prepare({**app_config(), "partitioner": "label_skew", "num-clients": 5, "min-clients": 2})
    assert sum(len(client_shard(cfg, m).y_train) for m in range(5)) == len(load_full_data(cfg).y_train)


# ---------------------------------------------------------------------------------------------------
# 3. non-finite floats, the prior, the seed, and errors attributed to the right key


@pytest.mark.parametrize(
    "override,key",
    [
        ({"prior-mean": NAN}, "prior-mean"),
        ({"prior-mean": INF}, "prior-mean"),
        ({"prior-variance": INF}, "prior-variance"),
        ({"lr": INF}, "lr"),
        ({"lr-scale": INF}, "lr-scale"),
        ({"loss": "beta", "loss-beta": INF}, "loss-beta"),
        ({"loss": "gamma", "loss-gamma": INF}, "loss-gamma"),
        ({"divergence": "alpha_renyi", "divergence-alpha": INF}, "divergence-alpha"),
        ({"server-divergence": "alpha_renyi", "server-divergence-alpha": INF}, "server-divergence-alpha"),
        ({"divergence": "weighted_kl", "divergence-w": INF}, "divergence-w"),
        ({"server-divergence": "weighted_kl", "server-divergence-w": INF}, "server-divergence-w"),
        ({"aggregator": "norm_clip", "aggregator-clip-norm": INF}, "aggregator-clip-norm"),
        ({"aggregator": "norm_clip", "aggregator-clip-multiplier": INF}, "aggregator-clip-multiplier"),
        ({"fedavg-lr": INF}, "fedavg-lr"),
        ({"sm-c": INF}, "sm-c"),
        ({"likelihood-sigma": INF}, "likelihood-sigma"),
        ({"round-timeout-s": INF}, "round-timeout-s"),
        ({"wait-for-clients-s": INF}, "wait-for-clients-s"),
        ({"damping": INF}, "damping"),
        ({"damping": NAN}, "damping"),
    ],
)
def test_non_finite_floats_are_rejected_naming_the_key(override, key):
    msg = _config_error({"dataset": "breast_cancer", **override})
    assert f"{key}:" in msg and ("finite" in msg or key == "damping"), msg
    assert msg.count(":") == 2, msg  # one error, not one per branch of a union ("damping.float: ...")


@pytest.mark.parametrize(
    "override",
    [{"prior-variance": 1e-320}, {"prior-variance": 1e-320, "dtype": "float32"},
     {"prior-variance": 1e-39, "dtype": "float32"}, {"prior-variance": 1e39, "dtype": "float32"},
     {"prior-mean": 1e39, "dtype": "float32"}, {"prior-mean": 1e30, "prior-variance": 1e-30, "dtype": "float32"},
     {"prior-mean": 1e300, "prior-variance": 1e-300}],
)
def test_prior_outside_the_dtype_is_rejected(override):
    """These passed validation and died with 'prior is improper' (or a raw RuntimeError) naming no key."""
    msg = _config_error({"dataset": "breast_cancer", **override})
    assert ("prior-mean" if "prior-mean" in override else "prior-variance") in msg, msg


@pytest.mark.parametrize("dtype,variance", [("float32", 1e-37), ("float32", 1e37), ("float64", 1e-300)])
def test_extreme_but_representable_prior_builds_a_proper_prior(dtype, variance):
    cfg = parse_run_config({"dataset": "breast_cancer", "dtype": dtype, "prior-variance": variance})
    assert build_problem(cfg).prior.is_proper()


@pytest.mark.parametrize("seed", [-1, -5000, 2**32, 2**63])
def test_seed_out_of_range_names_the_seed(seed):
    """seed=-1 was reported as 'dataset/test-fraction', or passed prepare and failed in every client."""
    for raw in ({"dataset": "breast_cancer", "seed": seed}, {**app_config(), "seed": seed}):
        msg = _config_error(raw, via_prepare=True)
        assert "seed:" in msg and "test-fraction" not in msg, msg


@pytest.mark.parametrize("extra", [{"dataset": "breast_cancer", "model": "logistic_regression", "label-noise": 0.1},
                                   {"dataset": "digits", "partitioner": "dirichlet"},
                                   {"dataset": "synthetic_logistic_2d", "model": "logistic_regression"}])
def test_largest_seed_is_accepted_by_every_consumer(extra):
    cfg, problem = prepare({**app_config(), "seed": 2**32 - 1, "num-clients": 3, "min-clients": 2, **extra})
    shard = client_shard(cfg, 2)
    assert len(shard.y_train) > 0 and problem.prior.is_proper()


def test_prepare_attributes_a_contamination_failure_to_label_noise(monkeypatch):
    """Every ValueError of the data stage was reported as 'dataset/test-fraction'."""
    import common.data.contamination as contamination

    def broken(*args, **kwargs):
        raise ValueError("flip failed")

    monkeypatch.setattr(contamination, "random_flip", broken)
    msg = _config_error({**app_config(), "seed": 11, "label-noise": 0.25}, via_prepare=True)
    assert "label-noise" in msg and "flip failed" in msg and "test-fraction" not in msg, msg


def test_prepare_still_attributes_a_bad_split_to_test_fraction():
    msg = _config_error({**app_config(), "test-fraction": 0.9995}, via_prepare=True)
    assert "test-fraction" in msg, msg


# ---------------------------------------------------------------------------------------------------
# 4. the partition does not depend on the label noise


@pytest.mark.parametrize("extra", [{"partitioner": "label_skew", "classes-per-client": 2},
                                   {"partitioner": "dirichlet", "dirichlet-alpha": 0.3}])
@pytest.mark.parametrize("kind", ["random", "class_map"])
def test_label_noise_does_not_change_the_partition(extra, kind):
    base = {"dataset": "digits", "num-clients": 5, "min-clients": 2, "label-noise-kind": kind, **extra}
    clean_cfg = parse_run_config({**base, "label-noise": 0.0})
    noisy_cfg = parse_run_config({**base, "label-noise": 0.3})
    clean = [client_shard(clean_cfg, m) for m in range(5)]
    noisy = [client_shard(noisy_cfg, m) for m in range(5)]
    for c, z in zip(clean, noisy):
        np.testing.assert_array_equal(c.x_train, z.x_train)  # the same points (indices are sorted)
        np.testing.assert_array_equal(c.x_test, z.x_test)
        np.testing.assert_array_equal(c.y_test, z.y_test)
    # each client's labels are the contaminated labels of its points: the union has exactly the configured rate
    n = len(_full_dataset(clean_cfg).y_train)
    flipped = sum(int(np.sum(c.y_train != z.y_train)) for c, z in zip(clean, noisy))
    assert flipped == int(np.round(0.3 * n))
    full = load_full_data(noisy_cfg)  # the server's view agrees with the union of the clients' shards
    assert sorted(np.concatenate([z.y_train for z in noisy]).tolist()) == sorted(full.y_train.tolist())


# ---------------------------------------------------------------------------------------------------
# 5./6. result files: a reused directory, atomic writes


RESULT_FILES = ["summary.json", "metrics.csv", "posterior.npz", "sites.npz", "model.npz", "rescored.json"]


def test_recorder_removes_a_previous_runs_result_files(tmp_path):
    from strategies.results import RoundRecorder

    for name in [*RESULT_FILES, "checkpoint.npz", "notes.txt"]:
        (tmp_path / name).write_text("old run")
    RoundRecorder(tmp_path, {"seed": 2})
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint.npz", "metrics.jsonl", "notes.txt", "run_config.json"], left
    assert json.loads((tmp_path / "run_config.json").read_text()) == {"seed": 2}


def _record_atomic_writes(monkeypatch) -> list[str]:
    import common.atomic_io as atomic_io
    import strategies.fedavg_baseline as fedavg_baseline
    import strategies.results as results

    written: list[str] = []
    real = atomic_io.atomic_write

    def recording(path, write, mode=0o600):
        written.append(str(getattr(path, "name", path)))
        return real(path, write, mode)

    for module in (results, fedavg_baseline):
        monkeypatch.setattr(module, "atomic_write", recording, raising=False)
    return written


def test_run_config_is_written_atomically(tmp_path, monkeypatch):
    from strategies.results import RoundRecorder

    written = _record_atomic_writes(monkeypatch)
    RoundRecorder(tmp_path, {"seed": 1})
    assert "run_config.json" in written
    assert (tmp_path / "run_config.json").stat().st_mode & 0o777 == 0o644


def test_fedavg_result_files_are_written_atomically(tmp_path, monkeypatch):
    from client.fedavg_app import app as fedavg_client_app
    from strategies.fedavg_baseline import run_fedavg
    from strategies.inprocess import InProcessGrid
    from tests.test_fedavg_baseline import RAW

    written = _record_atomic_writes(monkeypatch)
    cfg = parse_run_config(RAW)
    (tmp_path / "posterior.npz").write_text("stale")
    grid = InProcessGrid(fedavg_client_app, [{"partition-id": m, "num-partitions": 2} for m in range(2)], RAW)
    run_fedavg(grid, cfg, load_full_data(cfg), tmp_path)
    assert {"model.npz", "summary.json", "metrics.csv", "run_config.json"} <= set(written), written
    assert not (tmp_path / "posterior.npz").exists()
    with np.load(tmp_path / "model.npz") as z:
        assert z.files
    assert json.loads((tmp_path / "summary.json").read_text())["method"] == "fedavg"


# ---------------------------------------------------------------------------------------------------
# 7. client metrics: counts are not weighted by the counts


def test_pooled_client_metrics_do_not_weight_num_points_by_n():
    """``num_points`` (common.metrics) was pooled as sum(n^2)/sum(n): 38.0 for clients of 38 points each."""
    from strategies.pgvi import PGVIStrategy

    strategy = PGVIStrategy(build_problem(parse_run_config({})))
    replies = [_EvalReply({"num-examples": float(n), "num_points": float(n), "accuracy": acc}, i)
               for i, (n, acc) in enumerate([(30, 0.5), (84, 1.0)])]
    out = dict(strategy.aggregate_evaluate(1, replies))
    assert out["client-num-examples"] == 114.0
    assert out["client-accuracy"] == pytest.approx((30 * 0.5 + 84) / 114)
    assert out.get("client-num_points", 114.0) == 114.0, out
    assert all(math.isfinite(v) for v in out.values())


# ---------------------------------------------------------------------------------------------------
# 8. the FedAvg client checks its node's num-partitions


def test_fedavg_client_rejects_a_node_config_that_disagrees_with_num_clients():
    from client import fedavg_app

    raw = {**app_config(), "num-clients": 3}
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                  run_config=raw)
    with pytest.raises(ValueError, match="num-partitions=2 disagrees with run config num-clients=3"):
        fedavg_app._setup(None, ctx)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# 9. a TOML bool is a value of the bool keys only (review of the client plumbing, finding 1)

_BOOL_KEYS = {"download", "exclusion-removes-site", "local-reparam", "conjugate", "evaluate-clients",
              "pipeline-evaluation", "checkpoint"}
_NON_BOOL_KEYS = sorted(f.alias for f in RunConfig.model_fields.values() if f.alias not in _BOOL_KEYS)


def test_the_bool_keys_are_the_fields_typed_bool():
    assert {f.alias for f in RunConfig.model_fields.values() if f.annotation is bool} == _BOOL_KEYS


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("key", _NON_BOOL_KEYS)
def test_a_bool_for_a_key_that_is_not_a_bool_is_refused_naming_the_key(key, value):
    """pydantic's lax mode read ``-c lr=true`` as lr = 1.0 and ``batch-size=false`` as 0 (full batch) without a
    word; only max-staleness refused it."""
    msg = _config_error({key: value})
    assert msg.startswith(f"invalid run config: {key}: ") and f"got {value!r}" in msg, msg
    assert msg.count(";") == 0, msg  # one error: the key's own, no other key's


def test_a_bool_is_refused_with_what_the_key_takes():
    assert _config_error({"lr": True}) == "invalid run config: lr: must be a number > 0, got True (a TOML bool)"
    assert _config_error({"batch-size": False}) == ("invalid run config: batch-size: must be an integer >= 0, "
                                                    "got False (a TOML bool)")
    assert _config_error({"damping": True}) == ("invalid run config: damping: must be a number in (0, 1] or "
                                                "'auto', got True (a TOML bool)")
    assert "partitioner: must be one of 'iid', 'label_skew', 'dirichlet', 'size_skew', got True" in \
        _config_error({"partitioner": True})
    both = _config_error({"num-server-rounds": True, "seed": False})
    assert "num-server-rounds: must be an integer >= 1, got True" in both and "seed: must be an integer >= 0" in both


def test_bools_from_the_command_line_are_refused_before_round_1():
    """The reviewer's case: ``-c 'num-server-rounds=true lr=true batch-size=false ...'`` through simulate.py's
    parser and the ServerApp's prepare()."""
    from scripts.simulate import pyproject_run_config

    raw = pyproject_run_config(["num-server-rounds=true lr=true batch-size=false fraction-train=true seed=true "
                                "object-pull-retry-s=true torch-threads=true"])
    msg = _config_error(raw, via_prepare=True)
    for key in ("num-server-rounds", "lr", "batch-size", "fraction-train", "seed", "object-pull-retry-s",
                "torch-threads"):
        assert f"{key}: must be" in msg, (key, msg)


def test_a_bool_batch_size_in_the_node_config_is_refused():
    from client.node_request import node_run_config
    from common.errors import PGVIError

    raw = app_config()
    cfg, _, _ = node_run_config(raw, {"partition-id": 0, "batch-size": 4})
    assert cfg.batch_size == 4
    with pytest.raises(PGVIError, match=r"^node config batch-size: must be an integer >= 0, got True \(a TOML bool\)$"):
        node_run_config(raw, {"partition-id": 0, "batch-size": True})


@pytest.mark.parametrize(("text", "expected"), [("false", False), ("no", False), ("0", False), ("off", False),
                                                ("true", True), ("yes", True), ("1", True), (False, False),
                                                (True, True)])
def test_bool_keys_keep_taking_bools_and_their_strings(text, expected):
    cfg = parse_run_config({key: text for key in _BOOL_KEYS})
    assert all(getattr(cfg, key.replace("-", "_")) is expected for key in _BOOL_KEYS)


def test_numbers_keep_their_lax_conversions():
    cfg = parse_run_config({"num-server-rounds": 5.0, "batch-size": 3.0, "lr": 1, "damping": 1, "max-staleness": 2,
                            "hidden": 200})
    assert (cfg.num_server_rounds, cfg.batch_size, cfg.lr, cfg.damping, cfg.max_staleness, cfg.hidden) == \
        (5, 3, 1.0, 1, 2, "200")
    assert isinstance(cfg.num_server_rounds, int) and isinstance(cfg.lr, float)


def test_a_key_given_in_both_spellings_and_an_unknown_underscore_key_are_named_as_given():
    """The model takes field names (label_noise) besides the run-config keys (label-noise). Given both, pydantic
    keeps the key and forbids the name; the error said "label-noise: unknown run-config key", a known key."""
    with pytest.raises(ConfigError) as exc:
        parse_run_config({"label-noise": 0.1, "label_noise": 0.2})
    assert str(exc.value) == ("invalid run config: label_noise: given twice, as label_noise and as label-noise "
                              "(pyproject.toml's [tool.flwr.app.config] sets label-noise, so an override must use "
                              "that spelling: label-noise=...)")
    with pytest.raises(ConfigError) as exc:
        parse_run_config({"no_such_key": 1})
    assert str(exc.value) == "invalid run config: no_such_key: unknown run-config key"
    assert parse_run_config({"label_noise": 0.2}).label_noise == 0.2  # one spelling alone stays accepted


GAUSS32 = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "dtype": "float32"}


@pytest.mark.parametrize("override, key", [
    ({"loss": "score_matching", "sm-c": 1e-20}, "sm-c"),  # c^2 = 0 in float32: w / (c^2 + r^2) = inf, inf * 0 = NaN
    ({"loss": "score_matching", "sm-weight": "se", "sm-c": 1e20}, "sm-c"),
    ({"divergence": "weighted_kl", "divergence-w": 1e-39}, "divergence-w"),  # 0.5 / w = inf: D(q, q) = NaN
    ({"server-divergence": "weighted_kl", "server-divergence-w": 1e39}, "server-divergence-w"),
    ({"loss-weight": 1e39}, "loss-weight"),  # inf in float32: w * 0 = NaN at a certain point
])
def test_scales_outside_the_dtype_are_refused_naming_the_key(override, key):
    msg = _config_error({**GAUSS32, **override})
    assert f"{key}: with dtype float32" in msg, msg


@pytest.mark.parametrize("override", [
    {"loss": "score_matching", "sm-c": 1e-20, "dtype": "float64"},
    {"loss": "score_matching", "sm-weight": "constant", "sm-c": 1e-20},  # c unused
    {"divergence-w": 1e-39},  # divergence kl: w unused
    {"divergence": "weighted_kl", "divergence-w": 1e-30},
    {"loss-weight": 1e30},
])
def test_representable_or_unused_scales_are_accepted(override):
    parse_run_config({**GAUSS32, **override})


# review of 2026-11-28: values every client then refused in round 1 are refused before it, naming the key
@pytest.mark.parametrize("override, key", [
    ({"damping": 1e-310}, "damping"),  # the clients flush denormals: 'rho must be in (0, 1], got 0.0'
    ({"lr": 1e-310}, "lr"), ({"lr-scale": 1e-310}, "lr-scale"), ({"fedavg-lr": 1e-310}, "fedavg-lr"),
    ({"loss": "gce", "loss-delta": 1e-310}, "loss-delta"),
    ({"divergence": "alpha_renyi", "divergence-alpha": 1e-310}, "divergence-alpha"),
    ({"server-divergence": "alpha_renyi", "server-divergence-alpha": 1e-310}, "server-divergence-alpha"),
    ({"dtype": "float32", "loss": "gce", "loss-delta": 1e-39}, "loss-delta"),
    ({"dtype": "float32", "loss": "beta", "loss-beta": 1e39}, "loss-beta"),
    ({"dtype": "float32", "loss": "gamma", "loss-gamma": 1e39}, "loss-gamma"),
    ({"divergence": "alpha_renyi", "divergence-alpha": 1e16}, "divergence-alpha"),  # D(q || q) 'infinite'
    ({"dtype": "float32", "divergence": "alpha_renyi", "divergence-alpha": 8193.0}, "divergence-alpha"),
    ({"family": "full_covariance", "server-divergence": "alpha_renyi", "server-divergence-alpha": 1e16},
     "server-divergence-alpha"),  # the server step failed at the prior, in PGVIStrategy's constructor
    ({"sequential-order": "site-1"}, "sequential-order"),  # synchronous: silently ignored
    # the FedAvg network is float32 whatever dtype is: with float64, lr 1e-40 never moved it (a 'completed' run)
    ({"dtype": "float64", "fedavg-lr": 1e-40}, "fedavg-lr"), ({"dtype": "float64", "fedavg-lr": 1e39}, "fedavg-lr"),
    ({"fedavg-weight-decay": 1e39}, "fedavg-weight-decay"),
    ({"schedule": "asynchronous", "sequential-order": "site-1"}, "sequential-order"),
])
def test_values_the_clients_refused_in_round_1_are_config_errors(override, key):
    msg = _config_error({"dataset": "breast_cancer", **override})
    assert msg.startswith(f"invalid run config: {key}:"), msg


@pytest.mark.parametrize("override", [
    {"dtype": "float32", "divergence": "alpha_renyi", "divergence-alpha": 8192.0},
    {"divergence": "alpha_renyi", "divergence-alpha": 4e12},
    {"divergence": "alpha_renyi", "divergence-alpha": 1e-300}, {"lr": 1e-300}, {"damping": 1e-300},
    {"schedule": "sequential", "sequential-order": "site-1"},
    {"fedavg-weight-decay": 1e-40}, {"fedavg-weight-decay": 0.0}, {"fedavg-momentum": 0.0}, {"fedavg-lr": 1e38},
])
def test_extreme_but_usable_values_are_accepted(override):
    parse_run_config({"dataset": "breast_cancer", **override})


@pytest.mark.parametrize("value", [2.5, float("nan"), "abc", 1e20, "nan"])
def test_a_bad_max_staleness_is_one_error(value):
    msg = _config_error({"max-staleness": value})
    assert msg.count("max-staleness") == 2 and ".int" not in msg and "literal" not in msg, msg  # key: message


@pytest.mark.parametrize("value, expected", [("3", 3), (" 3 ", 3), (3.0, 3), ("3.0", 3), (2**63 - 1, 2**63 - 1)])
def test_max_staleness_as_text_or_integral_float_is_read_as_before(value, expected):
    assert parse_run_config({"max-staleness": value}).max_staleness == expected


def test_a_bad_damping_string_is_one_error():
    msg = _config_error({"damping": "abc"})
    assert msg == "invalid run config: damping: damping rho must be in (0, 1] or 'auto', got 'abc'", msg
    assert parse_run_config({"damping": "0.5"}).damping == 0.5


def test_an_output_dir_that_cannot_be_written_is_a_config_error_before_round_1(tmp_path):
    from server.app import run_strategy
    from strategies.inprocess import InProcessGrid
    from client.app import app as client_app

    (tmp_path / "afile").write_text("")
    raw = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "num-server-rounds": 1,
           "output-dir": str(tmp_path / "afile" / "out")}
    cfg, problem = prepare(raw)
    nodes = [{"partition-id": m, "num-partitions": 3, "client-id": f"site-{m}"} for m in range(3)]
    grid = InProcessGrid(client_app, nodes, raw)
    with pytest.raises(ConfigError, match=r"^invalid run config: output-dir: cannot write .*NotADirectoryError"):
        run_strategy(grid, cfg, problem, tmp_path / "afile" / "out" / "run-1")


@pytest.mark.parametrize("app_module", ["server.app", "server.fedavg_app"])
def test_a_config_error_leaving_the_server_app_is_first_one_error_line(app_module, caplog):
    # Flower 1.39 logs a failed ServerApp's traceback ('ServerApp raised an exception'); the message naming the
    # key comes first, as one line
    import importlib
    import logging
    import types

    module = importlib.import_module(app_module)
    ctx = types.SimpleNamespace(run_config={"loss": "huber"})
    grid = types.SimpleNamespace(run=types.SimpleNamespace(run_id=1))
    caplog.set_level(logging.ERROR, logger="flwr")
    with pytest.raises(ConfigError, match="loss: unknown loss 'huber'"):
        module.main(grid, ctx)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert lines and lines[0].startswith("invalid run config: loss: unknown loss 'huber'") and "\n" not in lines[0]


@pytest.mark.parametrize("stage, error, keys", [
    ("build_problem", RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                                   "you tried to allocate 25600000000 bytes"), "model/hidden/family"),
    ("load_full_data", MemoryError("Unable to allocate 134. GiB for an array"), "num-clients/dataset"),
])
def test_a_size_that_does_not_fit_in_memory_is_a_config_error(monkeypatch, stage, error, keys):
    # hidden="100000000" or num-clients=100000000 with a synthetic set ended prepare with the allocator's traceback
    import server.app as server_app

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(server_app, stage, boom)
    msg = _config_error({"dataset": "breast_cancer"}, via_prepare=True)
    assert msg.startswith(f"invalid run config: {keys}") and "does not fit in memory" in msg, msg


def test_other_runtime_errors_of_prepare_are_not_taken_for_memory(monkeypatch):
    import server.app as server_app

    def boom(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(server_app, "build_problem", boom)
    with pytest.raises(RuntimeError, match="something else"):
        prepare({"dataset": "breast_cancer"})


@pytest.mark.parametrize("override", [
    {"dtype": "float32", "model": "linear_regression", "dataset": "synthetic_linear_regression",
     "likelihood-sigma": 1.1e-19},  # within the config's bound; with 180 points the precision is 1.6e40
    {"dtype": "float64", "model": "linear_regression", "dataset": "synthetic_linear_regression",
     "likelihood-sigma": 1.5e-154},
    {"dtype": "float32", "model": "gaussian_location", "dataset": "synthetic_gaussian_location",
     "loss": "score_matching", "likelihood-sigma": 1e-17},
])
def test_a_likelihood_precision_beyond_the_dtype_is_a_config_error(override):
    # review of 2026-11-28: every client's conjugate update was 'improper' in round 1
    msg = _config_error(override, via_prepare=True)
    assert msg.startswith("invalid run config: likelihood-sigma: with these data the likelihood's precision"), msg


@pytest.mark.parametrize("override", [
    {"dtype": "float32", "model": "linear_regression", "dataset": "synthetic_linear_regression", "likelihood-sigma": 1e-6},
    {"dtype": "float32", "model": "gaussian_location", "dataset": "synthetic_gaussian_location", "likelihood-sigma": 1e-3},
    {"dtype": "float32", "model": "linear_regression", "dataset": "synthetic_linear_regression", "likelihood-sigma": 9e18},
])
def test_ordinary_likelihood_scales_still_prepare(override):
    prepare(override)


def test_the_fedavg_baseline_refuses_an_output_dir_it_cannot_write_naming_the_key(tmp_path):
    # a final review found the PGVI fix had left FedAvg's run_fedavg with the NotADirectoryError traceback
    from common.problem import load_full_data
    from strategies.fedavg_baseline import run_fedavg

    (tmp_path / "afile").write_text("")
    cfg = parse_run_config({"dataset": "digits", "model": "bnn", "hidden": "8", "num-server-rounds": 1})
    with pytest.raises(ConfigError, match=r"^invalid run config: output-dir: cannot write .*NotADirectoryError"):
        run_fedavg(None, cfg, load_full_data(cfg), tmp_path / "afile" / "out")
