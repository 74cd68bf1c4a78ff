"""A drop-in ``flower-supernode`` that asks the SuperLink for its next message soon after answering one.

Flower 1.39's SuperNode (``flwr.supernode.start_client_internal``) runs one loop: pull a message from the
SuperLink; if there is none, ``time.sleep(3)`` and pull again; if there is one, wait for the ClientApp's reply
(checking its own state every ``time.sleep(0.5)``), push it, pull again.  In a synchronous round every node
answers, finds nothing (the server is still aggregating) and sleeps 3 s, so the next round's message waits on
each node for a uniformly random 0-3 s, and the round for the slowest of them; every reply waits for up to
0.5 s more (``docs/bench_network.md`` section 4).

``python -m client.paced_supernode <flower-supernode arguments>`` runs Flower's own ``flower_supernode()``
(same arguments, same logs, same protocol) with two waits changed:

- the idle wait after a pull that found nothing backs off geometrically: ``pull_min`` after the last message,
  then ``factor`` times the previous wait, capped at ``pull_max`` (Flower's 3 s by default), and starts again
  at ``pull_min`` whenever a message arrives.  A node that waits long for work therefore pulls as rarely as
  Flower's; a node in a run of rounds finds the next message within about ``(factor - 1)`` times the time since
  its last reply, or ``pull_min``;
- the wait for the ClientApp's reply (and for a reply's content) is ``reply_poll`` instead of 0.5 s.  That poll
  reads the node's own in-process state, not the network.

Settings come from the environment, validated before the node starts (a bad value exits with one message):
:data:`ENV_PULL_MIN` (default 0.1 s), :data:`ENV_PULL_MAX` (3 s), :data:`ENV_FACTOR` (1.5),
:data:`ENV_REPLY_POLL` (0.1 s).  The node also asks the SuperLink again for an object of a message that is
still arriving after ``$PGVI_OBJECT_PULL_RETRY_S`` (default 0.05 s) instead of Flower's 1 s
(``client/object_pulls.py``), and its Fleet channel runs no connectivity-polling thread for DEBUG logs only
(``client/channel_watch.py``).

Installation into Flower: the loop looks up ``time`` and ``_pull_and_store_message`` in its module's globals at
call time; :func:`install` replaces the first with a stand-in whose ``sleep`` maps Flower's two wait lengths
(3 and 0.5 s; any other length is slept as asked) and wraps the second to restart the back-off when a message
arrives.  It checks the Flower version (1.39.x) and that the loop's source still holds those two waits; if
anything differs it logs one warning and :func:`main` runs ``flower_supernode()`` unpaced (the object retry of
``client/object_pulls.py`` still applies if that module's own checks pass).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import sys
import time as _time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from client import channel_watch, object_pulls
from client.flower_version import version_problem
from common.backoff import GeometricBackoff
from common.environment import env_number

log = logging.getLogger("flwr")  # Flower's logger: same handler and format as the SuperNode's own lines

MODULE = "flwr.supernode.start_client_internal"
#: Flower 1.39's idle wait after an empty pull, and its wait for a reply or a reply's content (seconds).
FLOWER_IDLE_WAIT = 3
FLOWER_REPLY_WAIT = 0.5

ENV_PULL_MIN = "PGVI_SUPERNODE_PULL_MIN_S"
ENV_PULL_MAX = "PGVI_SUPERNODE_PULL_MAX_S"
ENV_FACTOR = "PGVI_SUPERNODE_PULL_FACTOR"
ENV_REPLY_POLL = "PGVI_SUPERNODE_REPLY_POLL_S"


@dataclass(frozen=True)
class Pacing:
    """The waits of a paced SuperNode, in seconds (see the module docstring)."""

    pull_min: float = 0.1
    pull_max: float = float(FLOWER_IDLE_WAIT)
    factor: float = 1.5
    reply_poll: float = 0.1

    def __post_init__(self) -> None:
        for name in ("pull_min", "pull_max", "factor", "reply_poll"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.01 <= self.pull_min <= self.pull_max:
            raise ValueError(f"pull_min must be in [0.01, pull_max={self.pull_max}], got {self.pull_min}")
        if self.pull_max > 60:
            raise ValueError(f"pull_max must be at most 60 s, got {self.pull_max}")
        if not 1.0 <= self.factor <= 10.0:
            raise ValueError(f"factor must be in [1, 10], got {self.factor}")
        if not 0.01 <= self.reply_poll <= FLOWER_REPLY_WAIT:
            raise ValueError(f"reply_poll must be in [0.01, {FLOWER_REPLY_WAIT}], got {self.reply_poll}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Pacing:
        """The pacing from :data:`ENV_PULL_MIN`, :data:`ENV_PULL_MAX`, :data:`ENV_FACTOR`,
        :data:`ENV_REPLY_POLL` (unset or empty: the default).  ValueError names the variable."""
        env = os.environ if env is None else env
        values: dict[str, float] = {}
        for field, var in (("pull_min", ENV_PULL_MIN), ("pull_max", ENV_PULL_MAX), ("factor", ENV_FACTOR),
                           ("reply_poll", ENV_REPLY_POLL)):  # fmt: skip
            value = env_number(var, env)
            if value is not None:
                values[field] = value
        try:
            return cls(**values)
        except ValueError as err:
            set_vars = ", ".join(f"{v}={env[v]!r}" for v in (ENV_PULL_MIN, ENV_PULL_MAX, ENV_FACTOR, ENV_REPLY_POLL)
                                 if env.get(v, "").strip())  # fmt: skip
            raise ValueError(f"{err} (from {set_vars})") from None


class Backoff(GeometricBackoff):
    """The idle waits: ``pull_min``, then ``factor`` times the previous one, capped at ``pull_max``;
    :meth:`reset` (a message arrived) starts again at ``pull_min``.  Setting :attr:`pacing` applies new waits.
    Thread-safe."""

    def __init__(self, pacing: Pacing) -> None:
        super().__init__(pacing.pull_min, pacing.pull_max, pacing.factor)
        self._pacing = pacing

    @property
    def pacing(self) -> Pacing:
        return self._pacing

    @pacing.setter
    def pacing(self, pacing: Pacing) -> None:
        self.configure(pacing.pull_min, pacing.pull_max, pacing.factor)
        self._pacing = pacing


class PacedTime:
    """Stands in for the ``time`` module inside Flower's SuperNode loop: ``sleep(3)`` is the back-off's next
    wait, ``sleep(0.5)`` is ``reply_poll``, anything else (and every other attribute) is ``time``'s."""

    def __init__(self, backoff: Backoff, sleep: Callable[[float], None] = _time.sleep) -> None:
        self.backoff = backoff
        self._sleep = sleep

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_IDLE_WAIT:
            seconds = self.backoff.next_wait()
        elif seconds == FLOWER_REPLY_WAIT:
            seconds = self.backoff.pacing.reply_poll
        self._sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


def incompatibility() -> str | None:
    """Why :func:`install` cannot pace this Flower's SuperNode, or None."""
    if (problem := version_problem()) is not None:
        return problem
    try:
        mod = importlib.import_module(MODULE)
        loop_src = inspect.getsource(mod.start_client_internal)
        push_src = inspect.getsource(mod._push_messages)
        module_src = inspect.getsource(mod)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    if getattr(mod, "time", None) is not _time and not isinstance(getattr(mod, "time", None), PacedTime):
        return f"{MODULE} does not use the time module as `time`"
    if not callable(getattr(mod, "_pull_and_store_message", None)):
        return f"{MODULE} has no _pull_and_store_message"
    if loop_src.count(f"time.sleep({FLOWER_IDLE_WAIT})") != 1 or "_pull_and_store_message(" not in loop_src:
        return f"the SuperNode loop no longer has one time.sleep({FLOWER_IDLE_WAIT}) after _pull_and_store_message"
    if f"time.sleep({FLOWER_REPLY_WAIT})" not in push_src:
        return f"_push_messages no longer waits with time.sleep({FLOWER_REPLY_WAIT})"
    # the stand-in maps every sleep of these two lengths in the module: there must be no others (Flower 1.39:
    # the idle wait, and the reply and reply-content waits of _push_messages)
    counts = (module_src.count(f"time.sleep({FLOWER_IDLE_WAIT})"), module_src.count(f"time.sleep({FLOWER_REPLY_WAIT})"))
    if counts != (1, 2):
        return (f"{MODULE} has {counts[0]} time.sleep({FLOWER_IDLE_WAIT}) and {counts[1]} "
                f"time.sleep({FLOWER_REPLY_WAIT}), not 1 and 2")
    return None


def install(pacing: Pacing) -> bool:
    """Pace Flower's SuperNode loop in this process.  False (after one WARNING) if this Flower is not the one
    this was written for; nothing is changed then."""
    problem = incompatibility()
    if problem is not None:
        log.warning("pgvi-supernode: %s; running Flower's SuperNode unchanged (idle pulls every %s s)",
                    problem, FLOWER_IDLE_WAIT)
        return False
    mod = importlib.import_module(MODULE)
    if isinstance(mod.time, PacedTime):
        mod.time.backoff.pacing = pacing  # re-install: new settings, same wrappers
        mod.time.backoff.reset()
        return True
    backoff = Backoff(pacing)
    pull = mod._pull_and_store_message

    def paced_pull(*args: Any, **kwargs: Any) -> Any:
        run_id = pull(*args, **kwargs)
        if run_id is not None:
            backoff.reset()
        return run_id

    paced_pull._pgvi_original = pull  # type: ignore[attr-defined]
    mod._pull_and_store_message = paced_pull
    mod.time = PacedTime(backoff)
    return True


def uninstall() -> None:
    """Undo :func:`install` (for tests)."""
    mod = importlib.import_module(MODULE)
    if isinstance(mod.time, PacedTime):
        mod.time = _time
    original = getattr(mod._pull_and_store_message, "_pgvi_original", None)
    if original is not None:
        mod._pull_and_store_message = original


def main() -> None:
    """``flower-supernode`` (same arguments), with paced pulls when this Flower allows it, its first retry
    of a message's object not yet at the SuperLink after ``$PGVI_OBJECT_PULL_RETRY_S`` (default 0.05 s,
    ``client/object_pulls.py``), and no connectivity polling thread for DEBUG logs (``client/channel_watch.py``)."""
    try:
        pacing = Pacing.from_env()
        initial_retry = object_pulls.initial_retry_from_env()
    except ValueError as err:
        print(f"pgvi-supernode: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if install(pacing):
        log.info("pgvi-supernode: idle pulls after %s s, x%s, up to %s s; reply checks every %s s",
                 pacing.pull_min, pacing.factor, pacing.pull_max, pacing.reply_poll)
    if object_pulls.set_initial_retry(initial_retry):
        log.info("pgvi-supernode: first retry of an object not yet at the SuperLink after %s s", initial_retry)
    if channel_watch.install():
        log.info("pgvi-supernode: the Fleet channel's connectivity is not polled for DEBUG logs")
    from flwr.supernode.cli.flower_supernode import flower_supernode

    flower_supernode()


if __name__ == "__main__":
    main()
