"""scripts/stop_signals.py and the scripts' use of it (from a review of this change set).

* A signal ignored when a script starts stays ignored: under ``nohup`` (SIGHUP ignored) simulate.py and
  fault_suite.py used to install their SIGHUP handler over it and stopped when the terminal closed.
* fault_suite's stop of a deployment ignores further stop signals (a second SIGTERM cut it short and left a
  process that ignores SIGTERM running), as simulate's and deploy's cleanups do.
* fault_suite --max-load takes inf ("never wait"), as it did before its numbers were validated.
"""

from __future__ import annotations

import argparse
import math
import signal
import types

import pytest

from scripts import arg_types, fault_suite
from scripts.stop_signals import STOP_SIGNALS, raise_interrupt, signal_handlers


@pytest.fixture
def saved_handlers():
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOP_SIGNALS)}
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_a_signal_ignored_on_entry_stays_ignored(saved_handlers):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with signal_handlers(raise_interrupt, STOP_SIGNALS):
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is raise_interrupt
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ignoring_installs_over_anything_and_restores(saved_handlers):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, raise_interrupt)
    with signal_handlers(signal.SIG_IGN, STOP_SIGNALS):
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in STOP_SIGNALS)
    assert signal.getsignal(signal.SIGTERM) is raise_interrupt


def test_fault_suite_stops_a_deployment_with_stop_signals_ignored(saved_handlers):
    seen = {}

    class FakeDeployment:
        run_dir = types.SimpleNamespace(name="fake")

        def stop(self):
            seen.update({s: signal.getsignal(s) for s in (signal.SIGINT, *STOP_SIGNALS)})
            return []

        def leftover_processes(self):
            return []

    signal.signal(signal.SIGTERM, raise_interrupt)
    dep = FakeDeployment()
    suite = types.SimpleNamespace(deployments=[dep])
    fault_suite.Suite._stop(suite, dep)  # type: ignore[arg-type]
    assert seen and all(h is signal.SIG_IGN for h in seen.values()), seen
    assert signal.getsignal(signal.SIGTERM) is raise_interrupt and suite.deployments == []


def test_fault_suite_max_load_takes_inf_but_not_nan_or_zero():
    parse = arg_types.number_above(allow_inf=True)
    assert parse("inf") == math.inf and parse("2.5") == 2.5
    for bad in ("nan", "0", "-inf", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        arg_types.number_above()("inf")  # the other numbers stay finite
