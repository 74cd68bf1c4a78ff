"""Stop signals for the scripts that start processes (deploy.py, simulate.py, fault_suite.py).

SIGTERM and SIGHUP (a closed terminal, a dropped ssh session) stop a script the way Ctrl-C does: the handler
raises ``KeyboardInterrupt``, so every ``finally`` that stops the script's processes runs.  A signal ignored when
the script starts (SIGHUP under ``nohup``) stays ignored.  While that cleanup
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
    on exit.  A signal the process ignores (``SIG_IGN``, e.g. SIGHUP under ``nohup``) stays ignored unless
    ``handler`` is ``SIG_IGN`` itself: a script started with ``nohup ... &`` must outlive its terminal, as the
    shell's rule for traps of signals ignored on entry has it."""
    old: dict[int, Any] = {}
    for sig in sigs:
        if handler is not signal.SIG_IGN and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # pragma: no cover - not the main thread
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
