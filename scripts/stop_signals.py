"""Stop signals for the scripts that start processes (deploy.py, simulate.py, fault_suite.py).

SIGTERM and SIGHUP (a closed terminal, a dropped ssh session) stop a script the way Ctrl-C does: the handler
raises ``KeyboardInterrupt``, so every ``finally`` that stops the script's processes runs.  While that cleanup
runs, :func:`signal_handlers` with ``signal.SIG_IGN`` keeps a second signal from cutting it short.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["STOP_SIGNALS", "raise_interrupt", "signal_handlers"]

#: Signals that stop a script like Ctrl-C does (KeyboardInterrupt, so cleanup runs).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def raise_interrupt(signum: int, _frame: object) -> None:
    """A signal handler raising ``KeyboardInterrupt("signal SIGTERM")`` (naming the signal)."""
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def signal_handlers(handler: Any, sigs: Sequence[int]) -> Iterator[None]:
    """Install ``handler`` for ``sigs`` (main thread only: elsewhere nothing changes), restoring the old handlers
    on exit."""
    old: dict[int, Any] = {}
    for sig in sigs:
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # pragma: no cover - not the main thread
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
