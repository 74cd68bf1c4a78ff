"""Tests of common.config: defaults, the flat round trip, one-line ConfigErrors that name the offending key for
every guarded value, the damping rule rho = 1/M (synchronous) or 1 (sequential), hyphenated aliases, and the
app's own [tool.flwr.app.config]."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from common.config import ConfigError, RunConfig, parse_run_config

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_defaults_parse_and_flat_round_trip():
    cfg = parse_run_config({})
    assert isinstance(cfg, RunConfig)
    flat = cfg.to_flat()
    assert all("_" not in k for k in flat), [k for k in flat if "_" in k]
    assert all(isinstance(v, (int, float, bool, str)) for v in flat.values())
    again = parse_run_config(flat)
    assert again == cfg
    assert again.to_flat() == flat


def test_non_default_round_trip():
    raw = {"model": "bnn", "hidden": "50,20", "loss": "gce", "loss-delta": 0.7, "divergence": "alpha_renyi",
           "divergence-alpha": 0.5, "damping": 0.25, "schedule": "asynchronous", "num-clients": 7,
           "min-clients": 7, "seed": 3}
    cfg = parse_run_config(raw)
    assert cfg.hidden_sizes == [50, 20] and cfg.loss_delta == 0.7 and cfg.rho() == 0.25
    assert parse_run_config(cfg.to_flat()) == cfg
    for k, v in raw.items():
        assert cfg.to_flat()[k] == v


# ---------------------------------------------------------------------------------------------------
# every bad value -> one ConfigError naming the key
BAD = [
    ({"loss": "huber"}, "loss", "unknown loss"),
    ({"divergence": "hellinger"}, "divergence", "unknown divergence"),
    ({"server-divergence": "tv"}, "server-divergence", "unknown divergence"),
    ({"divergence": "alpha_renyi", "divergence-alpha": 1.0}, "divergence-alpha", "KL"),
    ({"divergence": "alpha_renyi", "divergence-alpha": 1}, "divergence-alpha", "KL"),
    ({"divergence": "alpha_renyi", "divergence-alpha": 0.0}, "divergence-alpha", "reverse"),
    ({"divergence": "alpha_renyi", "divergence-alpha": -1e16}, "divergence-alpha", "|alpha| must be <="),
    ({"server-divergence": "alpha_renyi", "server-divergence-alpha": -0.0}, "server-divergence-alpha", "reverse"),
    ({"server-divergence": "alpha_renyi", "server-divergence-alpha": 1.0}, "server-divergence-alpha", "KL"),
    ({"loss": "gce", "loss-delta": 0.0}, "loss-delta", "(0, 1]"),
    ({"loss": "gce", "loss-delta": 1.5}, "loss-delta", "(0, 1]"),
    ({"loss": "gce", "loss-delta": -0.1}, "loss-delta", "(0, 1]"),
    ({"max-staleness": -1}, "max-staleness", ">= 0"),
    ({"max-staleness": "never"}, "max-staleness", ""),
    ({"loss-weight": 0.0}, "loss-weight", "greater than 0"),
    ({"loss-weight": -2.0}, "loss-weight", "greater than 0"),
    ({"loss-weight": float("inf")}, "loss-weight", "finite"),
    ({"loss-weight": float("nan")}, "loss-weight", "finite"),
    ({"loss": "beta", "loss-beta": 1.0}, "loss-beta", "> 1"),
    ({"loss": "beta", "loss-beta": 0.5}, "loss-beta", "> 1"),
    ({"loss": "gamma", "loss-gamma": 1.0}, "loss-gamma", "> 1"),
    ({"loss": "gamma", "loss-gamma": -3.0}, "loss-gamma", "> 1"),
    ({"damping": 0}, "damping", "(0, 1]"),
    ({"damping": 0.0}, "damping", "(0, 1]"),
    ({"damping": 1.5}, "damping", "(0, 1]"),
    ({"damping": -1}, "damping", "(0, 1]"),
    ({"damping": "half"}, "damping", ""),
    ({"num-clients": 3, "min-clients": 4}, "min-clients", "num-clients"),
    ({"no-such-key": 1}, "no-such-key", "unknown run-config key"),
    ({"num-server-rounds": "x"}, "num-server-rounds", "'x'"),
    ({"num-server-rounds": 0}, "num-server-rounds", ""),
    ({"hidden": "20,x"}, "hidden", "20,x"),
    ({"hidden": "20,0"}, "hidden", "positive"),
    ({"fraction-train": 0}, "fraction-train", ""),
    ({"fraction-train": 1.5}, "fraction-train", ""),
    ({"loss": "score_matching", "model": "logistic_regression"}, "loss", "score_matching"),
    ({"loss": "score_matching", "model": "bnn"}, "loss", "score_matching"),
    ({"family": "full_covariance", "model": "bnn"}, "family", "mean_field"),
    ({"prior-variance": 0.0}, "prior-variance", ""),
    ({"family": "diagonal"}, "family", ""),
    ({"schedule": "sequential", "aggregator": "trimmed_mean"}, "aggregator", "synchronous"),
    ({"schedule": "asynchronous", "aggregator": "median"}, "aggregator", "synchronous"),
    ({"schedule": "asynchronous", "aggregator": "norm_clip"}, "aggregator-clip-norm", "fixed bound"),
    ({"schedule": "sequential", "batch-halvings": 0}, "batch-halvings", "one Delta at a time"),
    ({"schedule": "asynchronous", "batch-halvings": 5}, "batch-halvings", "leave it at 3"),
    ({"batch-halvings": -1}, "batch-halvings", ""),
    ({"batch-halvings": True}, "batch-halvings", ""),
    ({"sequential-order": "site-1, site-0, site-1"}, "sequential-order", "site-1"),
    ({"model": "gaussian_location", "dataset": "digits"}, "dataset", "real-valued"),
    ({"model": "linear_regression", "dataset": "breast_cancer"}, "dataset", "real-valued"),
    ({"model": "bnn", "dataset": "synthetic_linear_regression"}, "dataset", "classifier"),
]


@pytest.mark.parametrize("raw,key,phrase", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_value_names_key(raw, key, phrase):
    with pytest.raises(ConfigError) as ei:
        parse_run_config(raw)
    msg = str(ei.value)
    assert f"{key}:" in msg or f"{key}." in msg, msg
    assert phrase in msg, msg
    assert "\n" not in msg and "Traceback" not in msg and "pydantic" not in msg.lower(), msg
    assert ei.value.__cause__ is None and ei.value.__suppress_context__
    assert isinstance(ei.value, ValueError)


def test_valid_edge_values():
    assert parse_run_config({"loss": "gce", "loss-delta": 1.0}).loss_delta == 1.0
    assert parse_run_config({"damping": 1}).rho() == 1.0
    assert parse_run_config({"damping": 1e-6}).rho() == 1e-6
    assert parse_run_config({"num-clients": 4, "min-clients": 4}).min_clients == 4
    assert parse_run_config({"hidden": ""}).hidden_sizes == []
    assert parse_run_config({"hidden": " 20, 10 "}).hidden_sizes == [20, 10]
    # the guarded hyperparameters only matter for the loss / divergence that uses them
    assert parse_run_config({"loss": "nll", "loss-delta": 0.0, "loss-beta": 0.5}).loss == "nll"
    assert parse_run_config({"divergence": "kl", "divergence-alpha": 1.0}).divergence == "kl"
    assert parse_run_config({"loss": "score_matching", "model": "linear_regression", "dataset": "synthetic_linear_regression"}).loss == "score_matching"
    assert parse_run_config({"family": "full_covariance", "model": "logistic_regression"}).family == "full_covariance"


def test_several_errors_are_reported_together():
    with pytest.raises(ConfigError) as ei:
        parse_run_config({"loss": "huber", "damping": 2.0, "bogus": 1})
    msg = str(ei.value)
    for key in ("loss:", "damping:", "bogus:"):
        assert key in msg, msg
    assert "\n" not in msg


def test_ignore_unknown():
    cfg = parse_run_config({"other-app-key": 3, "num-server-rounds": 9}, ignore_unknown=True)
    assert cfg.num_server_rounds == 9
    with pytest.raises(ConfigError, match="other-app-key"):
        parse_run_config({"other-app-key": 3})


# ---------------------------------------------------------------------------------------------------
# derived values
@pytest.mark.parametrize("m", [1, 2, 3, 10])
def test_rho_auto(m):
    base = {"num-clients": m, "min-clients": 1}
    assert parse_run_config({**base, "schedule": "synchronous"}).rho() == pytest.approx(1.0 / m, rel=0, abs=0)
    assert parse_run_config({**base, "schedule": "sequential"}).rho() == 1.0
    assert parse_run_config({**base, "damping": "auto"}).rho() == pytest.approx(1.0 / m)
    assert parse_run_config({**base, "schedule": "sequential", "damping": 0.3}).rho() == 0.3
    assert parse_run_config({**base, "damping": 0.3}).rho() == 0.3


def test_every_field_has_hyphenated_alias():
    for name, field in RunConfig.model_fields.items():
        alias = name.replace("_", "-")
        assert field.alias == alias, name
    defaults = parse_run_config({})
    # both spellings are accepted and mean the same field
    assert parse_run_config({"num-server-rounds": 4}).num_server_rounds == 4
    assert parse_run_config({"num_server_rounds": 4}).num_server_rounds == 4
    assert set(defaults.to_flat()) == {n.replace("_", "-") for n in RunConfig.model_fields}


def test_config_is_frozen():
    cfg = parse_run_config({})
    with pytest.raises(Exception):
        cfg.num_clients = 5  # type: ignore[misc]


def test_pyproject_app_config_parses():
    with PYPROJECT.open("rb") as f:
        app_cfg = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert app_cfg, "empty [tool.flwr.app.config]"
    cfg = parse_run_config(app_cfg)
    flat = cfg.to_flat()
    for k, v in app_cfg.items():
        assert k in flat, f"{k} is not a RunConfig field"
        assert flat[k] == v, k
    # Flower rejects a --run-config / -c key that [tool.flwr.app.config] does not declare ("Invalid run
    # configuration"): every field must be declared there to be settable from the command line
    assert sorted(set(flat) - set(app_cfg)) == []


@pytest.mark.parametrize("key,div", [("divergence-alpha", "divergence"), ("server-divergence-alpha", "server-divergence")])
def test_nan_alpha_is_rejected(key, div):
    with pytest.raises(ConfigError, match=key):
        parse_run_config({div: "alpha_renyi", key: float("nan")})


@pytest.mark.parametrize("overrides, warned", [
    ({"aggregator": "trimmed_mean", "num-clients": 4, "min-clients": 2}, "trims floor"),  # floor(0.2 * 4) = 0
    ({"aggregator": "trimmed_mean", "num-clients": 10, "min-clients": 2}, None),  # trims 2 of 10
    ({"aggregator": "trimmed_mean", "num-clients": 10, "min-clients": 2, "fraction-train": 0.4}, "trims floor"),
    ({"aggregator": "median", "num-clients": 2, "min-clients": 2}, "is their mean"),
    ({"aggregator": "median", "num-clients": 3, "min-clients": 2}, None),
    ({"aggregator": "norm_clip", "num-clients": 2, "min-clients": 2}, "never clips"),  # multiplier 2, two norms
    ({"aggregator": "norm_clip", "num-clients": 2, "min-clients": 2, "aggregator-clip-multiplier": 1.5}, None),
    ({"aggregator": "norm_clip", "num-clients": 2, "min-clients": 2, "aggregator-clip-norm": 5.0}, None),
    ({"aggregator": "sum", "num-clients": 2, "min-clients": 2}, None),
    # a setting the chosen aggregator ignores (a typo for another aggregator): said, not silently dropped
    ({"aggregator": "median", "num-clients": 5, "aggregator-trim": 0.3},
     "aggregator-trim = 0.3 does nothing with aggregator 'median'"),
    ({"aggregator-clip-norm": 5.0}, "aggregator-clip-norm = 5 does nothing with aggregator 'sum'"),
    ({"aggregator": "norm_clip", "num-clients": 5, "aggregator-clip-norm": 5.0, "aggregator-clip-multiplier": 3.0},
     "aggregator-clip-multiplier = 3 does nothing with aggregator 'norm_clip' and a fixed aggregator-clip-norm"),
    ({"aggregator": "median", "num-clients": 2, "min-clients": 2, "aggregator-trim": 0.3},  # both said
     "aggregator-trim = 0.3 does nothing with aggregator 'median'; aggregator median of 2 Delta(s)"),
    ({"aggregator": "trimmed_mean", "num-clients": 10, "min-clients": 2, "aggregator-trim": 0.3}, None),
    ({"aggregator": "norm_clip", "num-clients": 5, "aggregator-clip-multiplier": 3.0}, None),
])
def test_a_robust_aggregator_that_cannot_bound_any_client_is_warned_about(overrides, warned):
    from common.config import parse_run_config

    why = parse_run_config(overrides).aggregator_warning()
    assert (why is None) if warned is None else (warned in why)


def test_an_ignored_trim_with_norm_clip_does_not_blame_a_fixed_clip_norm():
    from common.config import parse_run_config

    why = parse_run_config({"aggregator": "norm_clip", "num-clients": 5, "aggregator-trim": 0.3}).aggregator_warning()
    assert why == "aggregator-trim = 0.3 does nothing with aggregator 'norm_clip'"
    why = parse_run_config({"aggregator": "norm_clip", "num-clients": 5, "aggregator-trim": 0.3,
                            "aggregator-clip-norm": 5.0, "aggregator-clip-multiplier": 3.0}).aggregator_warning()
    assert why == ("aggregator-trim = 0.3, aggregator-clip-multiplier = 3 does nothing with aggregator 'norm_clip' "
                   "and a fixed aggregator-clip-norm")
