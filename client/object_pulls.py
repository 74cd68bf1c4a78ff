"""How soon Flower asks again for a message's object that has not arrived yet (Flower 1.39: 1 s; here 0.05 s).

Flower moves a message as its metadata first and its objects (the arrays) after, and the receiver pulls the
objects with ``flwr.supercore.inflatable.inflatable_utils.pull_objects``.  An object asked for before it has
arrived comes back "unavailable", and ``pull_objects`` tries again after ``initial_backoff`` seconds, doubling
(jitter +-20 %, capped at 10 s): ``PULL_INITIAL_BACKOFF = 1`` in Flower 1.39.  A synchronous round races like
this up to three times:

- a SuperNode pulls a train message from the SuperLink while the ServerApp is still pushing its arrays;
- a ClientApp pulls the message from its SuperNode while the SuperNode is still pulling it from the SuperLink
  (the SuperNode creates the task first; a ClientApp forked by ``client/preforked_superexec.py`` asks within
  milliseconds, where a fresh ``flwr-clientapp`` spends about a second importing Flower first);
- the ServerApp pulls a reply from the SuperLink while the SuperNode is still pushing its arrays.

Each race lost costs about a second of waiting (``strace`` of a forked ClientApp in a round of the conjugate
model: its puller thread idle for 1.08 s between two requests, ``docs/bench_network.md`` section 4).

:func:`set_initial_retry` sets the keyword default ``initial_backoff`` of ``pull_objects`` and
``pull_and_inflate_object_from_tree`` in this process (every caller in Flower 1.39 uses the default).  Nothing
else changes: the doubling, the cap, the number of tries and the total time limit stay Flower's.  It checks the
Flower version (1.39.x) and that both functions still have that keyword; otherwise it logs one warning and
changes nothing.  Used by ``client/paced_supernode.py`` (the SuperNode's pulls), ``client/preforked_superexec.py``
(its forked ClientApps) and the ServerApp (``server/app.py``, run config ``object-pull-retry-s``).
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Mapping

from client.flower_version import version_problem
from common.environment import env_number

log = logging.getLogger("flwr")

MODULE = "flwr.supercore.inflatable.inflatable_utils"
FUNCTIONS = ("pull_objects", "pull_and_inflate_object_from_tree")
KEYWORD = "initial_backoff"
#: Flower 1.39's ``PULL_INITIAL_BACKOFF``.
FLOWER_INITIAL_RETRY_S = 1.0
#: This project's default first retry.
DEFAULT_INITIAL_RETRY_S = 0.05
#: Bounds accepted by :func:`set_initial_retry` (Flower's cap on a single wait is 10 s).
MIN_RETRY_S, MAX_RETRY_S = 0.001, 10.0
#: Environment variable read by :func:`initial_retry_from_env` (the SuperNode and the SuperExec use it).
ENV_INITIAL_RETRY = "PGVI_OBJECT_PULL_RETRY_S"


def check_initial_retry(seconds: float, name: str = "initial retry") -> float:
    """``seconds`` as a float if it is a finite number in [:data:`MIN_RETRY_S`, :data:`MAX_RETRY_S`], else
    ValueError naming ``name``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {seconds!r}")
    if not MIN_RETRY_S <= seconds <= MAX_RETRY_S:
        raise ValueError(f"{name} must be in [{MIN_RETRY_S}, {MAX_RETRY_S}] s, got {seconds}")
    return float(seconds)


def initial_retry_from_env(env: Mapping[str, str] | None = None) -> float:
    """:data:`ENV_INITIAL_RETRY` (unset or empty: :data:`DEFAULT_INITIAL_RETRY_S`); ValueError names it."""
    value = env_number(ENV_INITIAL_RETRY, env)
    return DEFAULT_INITIAL_RETRY_S if value is None else check_initial_retry(value, ENV_INITIAL_RETRY)


def incompatibility() -> str | None:
    """Why :func:`set_initial_retry` cannot apply to this Flower, or None."""
    if (problem := version_problem()) is not None:
        return problem
    try:
        mod = importlib.import_module(MODULE)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    for name in FUNCTIONS:
        kw = getattr(getattr(mod, name, None), "__kwdefaults__", None)
        if not isinstance(kw, dict) or KEYWORD not in kw:
            return f"{MODULE}.{name} has no keyword-only '{KEYWORD}'"
    return None


def current_initial_retry() -> float | None:
    """The ``initial_backoff`` default of ``pull_objects`` in this process (None if it has none)."""
    if incompatibility() is not None:
        return None
    return float(importlib.import_module(MODULE).pull_objects.__kwdefaults__[KEYWORD])


def set_initial_retry(seconds: float = DEFAULT_INITIAL_RETRY_S) -> bool:
    """Make Flower's object pulls in this process retry first after ``seconds`` (ValueError if out of
    bounds).  False (after one WARNING) if this Flower is not the one this was written for."""
    seconds = check_initial_retry(seconds)
    problem = incompatibility()
    if problem is not None:
        log.warning("pgvi: %s; object pulls keep Flower's first retry", problem)
        return False
    mod = importlib.import_module(MODULE)
    for name in FUNCTIONS:
        getattr(mod, name).__kwdefaults__[KEYWORD] = seconds
    return True
