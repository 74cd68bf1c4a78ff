"""common/environment.py: the one parser of the project's on/off switches and numbers, and its callers."""

from __future__ import annotations

import math

import pytest

from client import fab_cache, object_pulls
from client import paced_supernode as ps
from common import explicit_step, native
from common.environment import env_flag, env_number


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("", True), ("  ", True), ("1", True), (" on ", True),
                                               ("YES", True), ("true", True), ("0", False), ("false", False),
                                               ("OFF", False), (" no", False)])
def test_a_switch_reads_the_same_words_everywhere(raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {"X": raw}
    assert env_flag("X", True, env) is expected
    assert env_flag("X", False, env) is (False if raw is None or not raw.strip() else expected)


@pytest.mark.parametrize("raw", ["2", "fasle", "enabled", "0.0", "1 0"])
def test_a_switch_with_any_other_value_is_an_error_naming_it(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^X='{raw}' must be 0 or 1"):
        env_flag("X", True, {"X": raw})


def test_a_number() -> None:
    assert env_number("N", {}) is None and env_number("N", {"N": " "}) is None
    assert env_number("N", {"N": " 0.25 "}) == 0.25 and env_number("N", {"N": "1e-3"}) == 1e-3
    assert math.isnan(env_number("N", {"N": "nan"}))  # the form only: ranges are the caller's
    with pytest.raises(ValueError, match=r"^N='soon' is not a number$"):
        env_number("N", {"N": "soon"})


def test_every_switch_of_the_project_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # each of these once read its variable its own way (PGVI_EXPLICIT_STEP took only "0"; the kernel switches
    # took anything else as "on")
    for var, disabled in (("PGVI_FUSED_KERNELS", native.disabled_by_environment),
                          ("PGVI_EXPLICIT_STEP", explicit_step.disabled_by_environment)):
        monkeypatch.setenv(var, "off")
        assert disabled() is True
        monkeypatch.setenv(var, "on")
        assert disabled() is False
        monkeypatch.setenv(var, "fasle")
        with pytest.raises(ValueError, match=var):
            disabled()
        monkeypatch.delenv(var)
        assert disabled() is False
    assert fab_cache.enabled_from_env({fab_cache.ENV_FAB_CACHE: "no"}) is False
    with pytest.raises(ValueError, match=fab_cache.ENV_FAB_CACHE):
        fab_cache.enabled_from_env({fab_cache.ENV_FAB_CACHE: "maybe"})
    # a kernel's first use with a bad switch raises, and keeps raising (it is not taken as 'tried, off')
    monkeypatch.setenv("PGVI_FUSED_KERNELS", "fasle")
    kernel = native.NativeLibrary("probe", "int pgvi_probe(void) { return 1; }", {})
    for _ in range(2):
        with pytest.raises(ValueError, match="PGVI_FUSED_KERNELS"):
            kernel.get()
    monkeypatch.delenv("PGVI_FUSED_KERNELS")
    monkeypatch.setenv("PGVI_KERNEL_OPENMP", "false")
    assert native.openmp_runtime() is None
    monkeypatch.setenv("PGVI_KERNEL_OPENMP", "nope")
    with pytest.raises(ValueError, match="PGVI_KERNEL_OPENMP"):
        native.openmp_runtime()


def test_every_number_of_the_project_uses_it() -> None:
    with pytest.raises(ValueError, match=rf"^{object_pulls.ENV_INITIAL_RETRY}='x' is not a number$"):
        object_pulls.initial_retry_from_env({object_pulls.ENV_INITIAL_RETRY: "x"})
    with pytest.raises(ValueError, match=rf"^{ps.ENV_REPLY_POLL}='x' is not a number$"):
        ps.Pacing.from_env({ps.ENV_REPLY_POLL: "x"})
    assert ps.Pacing.from_env({ps.ENV_PULL_MAX: " 3 "}).pull_max == 3.0
