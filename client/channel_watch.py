"""Stop the SuperNode's Fleet channel from polling its own connectivity five times a second just to log it.

Flower 1.39's SuperNode (``flwr.client.grpc_rere_client.connection.grpc_request_response``) subscribes
``flwr.supercore.grpc.on_channel_state_change`` to its channel's connectivity; that callback only logs the new
state at DEBUG.  grpcio implements a subscription with a thread that calls ``watch_connectivity_state`` with a
0.2-s deadline in a loop for as long as the channel lives (``grpc/_channel.py``: "We'd rather not poll").  On an
idle paced SuperNode that thread and the gRPC core work it causes are about 3 of its 6.5-8.5 ms of CPU per second
(``docs/bench_network.md`` section 1l), which matters to a node that waits between rounds, e.g. on a small
board.  (In busy 10-node rounds here the saving, about 0.6 CPU-s a round by that figure, was not measurable.)

:func:`install` replaces the name ``create_channel`` in that module with a wrapper that returns Flower's channel
with one change: ``subscribe`` ignores exactly Flower's log-only callback, unless a handler of the ``flwr``
logger writes DEBUG records (``FLWR_LOG_LEVEL=DEBUG``; then the states are logged as before).  Any other callback is subscribed as usual.  gRPC reconnects
a channel by itself; the subscription never asked it to (``try_to_connect`` is False).  It checks the Flower
version (1.39.x) and that the connection code still subscribes that callback; otherwise it logs one warning and
changes nothing.  Used by ``client/paced_supernode.py``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from client.flower_version import version_problem

log = logging.getLogger("flwr")

MODULE = "flwr.client.grpc_rere_client.connection"
CALL = "channel.subscribe(on_channel_state_change)"


def debug_logged(logger: logging.Logger = log) -> bool:
    """Whether a DEBUG record of ``logger`` would reach a handler that writes it.  Flower's ``flwr`` logger is
    always at DEBUG; its console handler (INFO unless ``FLWR_LOG_LEVEL`` says otherwise) decides what shows."""
    if not logger.isEnabledFor(logging.DEBUG):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        if any(h.level <= logging.DEBUG for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


class QuietSubscribe:
    """A channel that passes everything to ``channel`` except subscriptions of ``skipped`` while
    ``debug_shown()`` is False (default: :func:`debug_logged` of the ``flwr`` logger, asked at each call)."""

    def __init__(self, channel: Any, skipped: Any, debug_shown: Any = None) -> None:
        self._channel = channel
        self._skipped = skipped
        self._debug_shown = debug_shown
        self._dropped = 0  # subscriptions of ``skipped`` not passed on (unsubscribe drops as many)

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        if callback is self._skipped and not try_to_connect and not (self._debug_shown or debug_logged)():
            self._dropped += 1
            return
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        if callback is self._skipped and self._dropped:
            self._dropped -= 1
            return
        self._channel.unsubscribe(callback)

    def __enter__(self) -> QuietSubscribe:
        self._channel.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._channel.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)


def incompatibility() -> str | None:
    """Why :func:`install` cannot apply to this Flower, or None."""
    if (problem := version_problem()) is not None:
        return problem
    try:
        mod = importlib.import_module(MODULE)
        source = inspect.getsource(mod)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    if not callable(getattr(mod, "create_channel", None)) or not callable(getattr(mod, "on_channel_state_change", None)):
        return f"{MODULE} has no create_channel / on_channel_state_change"
    if source.count(CALL) != 1:
        return f"{MODULE} no longer calls {CALL} once"
    return None


def install() -> bool:
    """Wrap ``create_channel`` in Flower's SuperNode connection module (this process only).  False, after one
    warning, if this Flower is not the one it was written for."""
    problem = incompatibility()
    if problem is not None:
        log.warning("pgvi-supernode: %s; the Fleet channel keeps polling its connectivity", problem)
        return False
    mod = importlib.import_module(MODULE)
    original = mod.create_channel
    if getattr(original, "_pgvi_quiet", False):
        return True
    skipped = mod.on_channel_state_change

    def create_channel(*args: Any, **kwargs: Any) -> Any:
        return QuietSubscribe(original(*args, **kwargs), skipped)

    create_channel._pgvi_quiet = True  # type: ignore[attr-defined]
    create_channel._pgvi_original = original  # type: ignore[attr-defined]
    mod.create_channel = create_channel
    return True


def uninstall() -> None:
    """Undo :func:`install` (for tests)."""
    mod = importlib.import_module(MODULE)
    original = getattr(mod.create_channel, "_pgvi_original", None)
    if original is not None:
        mod.create_channel = original
