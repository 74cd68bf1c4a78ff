"""client/object_pulls.py: the first retry of Flower's object pulls.

(a) bounds and the environment variable; (b) the setting reaches the functions every Flower 1.39 caller uses,
and a different Flower is left alone; (c) Flower's real ``pull_objects`` retries an unavailable object after the
set delay (and after about 1 s with Flower's default); (d) the ServerApp sets it from the run config.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import time

import pytest

from client import object_pulls as op

MOD = importlib.import_module(op.MODULE)


@pytest.fixture
def restore_flower():
    saved = {getattr(MOD, name): dict(getattr(MOD, name).__kwdefaults__) for name in op.FUNCTIONS}
    yield
    for fn, kw in saved.items():  # the functions of setup time (a test may have replaced the module attribute)
        fn.__kwdefaults__.clear()
        fn.__kwdefaults__.update(kw)


# --------------------------------------------------------------------------------------------- (a)


@pytest.mark.parametrize("bad", [0.0, 0.0005, 10.5, -1.0, float("nan"), float("inf"), "0.1", True, None])
def test_out_of_bounds_or_non_numbers_are_refused(bad):
    with pytest.raises(ValueError, match="initial retry must be"):
        op.check_initial_retry(bad)


def test_bounds_are_inclusive_and_ints_become_floats():
    assert op.check_initial_retry(op.MIN_RETRY_S) == op.MIN_RETRY_S
    assert op.check_initial_retry(10) == 10.0 and isinstance(op.check_initial_retry(10), float)


def test_environment_variable_default_value_and_errors():
    assert op.initial_retry_from_env({}) == op.DEFAULT_INITIAL_RETRY_S == 0.05
    assert op.initial_retry_from_env({op.ENV_INITIAL_RETRY: " "}) == 0.05
    assert op.initial_retry_from_env({op.ENV_INITIAL_RETRY: "1"}) == 1.0
    with pytest.raises(ValueError, match=f"{op.ENV_INITIAL_RETRY}='soon' is not a number"):
        op.initial_retry_from_env({op.ENV_INITIAL_RETRY: "soon"})
    with pytest.raises(ValueError, match=f"{op.ENV_INITIAL_RETRY} must be in"):
        op.initial_retry_from_env({op.ENV_INITIAL_RETRY: "20"})


# --------------------------------------------------------------------------------------------- (b)


def test_flowers_default_is_the_documented_one():
    """If Flower's 1 s changes, this module's docs (and its reason to exist) need a look."""
    from flwr.supercore.constant import PULL_INITIAL_BACKOFF

    assert PULL_INITIAL_BACKOFF == op.FLOWER_INITIAL_RETRY_S


def test_set_reaches_both_functions(restore_flower):
    assert op.incompatibility() is None
    assert op.set_initial_retry(0.02) is True
    assert op.current_initial_retry() == 0.02
    for name in op.FUNCTIONS:
        assert getattr(MOD, name).__kwdefaults__["initial_backoff"] == 0.02
    with pytest.raises(ValueError):
        op.set_initial_retry(0)
    assert op.current_initial_retry() == 0.02  # a refused value changes nothing


def test_another_flower_version_is_left_alone(monkeypatch, caplog, restore_flower):
    before = op.current_initial_retry()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.40.0")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert op.set_initial_retry(0.02) is False
    monkeypatch.undo()
    assert op.current_initial_retry() == before
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "1.40.0" in rec.getMessage() and "Flower's first retry" in rec.getMessage()


def test_a_function_without_the_keyword_is_refused(monkeypatch, restore_flower):
    def pull_objects(object_ids, pull_object_fn, *, max_time=1):  # no initial_backoff
        return {}

    monkeypatch.setattr(MOD, "pull_objects", pull_objects)
    assert "has no keyword-only 'initial_backoff'" in op.incompatibility()
    assert op.set_initial_retry(0.02) is False


# --------------------------------------------------------------------------------------------- (c)


def _time_to_second_try(retry: float | None) -> float:
    """Flower's real ``pull_objects`` on one object that is unavailable at the first try: seconds between
    the first and the second try."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    tries: list[float] = []

    def pull(object_id: str) -> bytes:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise ObjectUnavailableError(object_id)
        return b"content"

    if retry is not None:
        assert op.set_initial_retry(retry)
    assert MOD.pull_objects(["a"], pull) == {"a": b"content"}
    return tries[1] - tries[0]


def test_flowers_pull_retries_after_the_set_delay(restore_flower):
    assert 0.8 * 0.05 <= _time_to_second_try(0.05) < 0.5
    assert 0.8 * 1.0 <= _time_to_second_try(1.0) <= 1.5  # Flower's own first retry, for comparison


# --------------------------------------------------------------------------------------------- (d)


def test_server_app_sets_it_from_the_run_config(monkeypatch, restore_flower):
    from server import app as server_app

    seen: list[float] = []
    monkeypatch.setattr(server_app, "prepare", lambda rc: (server_app.parse_run_config(rc), None))
    monkeypatch.setattr(server_app, "run_strategy", lambda grid, cfg, problem, out: seen.append(op.current_initial_retry()))

    class _Ctx:
        run_config = {"object-pull-retry-s": 0.2}

    class _Grid:
        run = type("R", (), {"run_id": 7})()

    server_app.main(_Grid(), _Ctx())
    assert seen == [0.2]
    from common.config import ConfigError, parse_run_config

    assert parse_run_config({}).object_pull_retry_s == 0.05
    with pytest.raises(ConfigError, match="object-pull-retry-s"):
        parse_run_config({"object-pull-retry-s": 0})
