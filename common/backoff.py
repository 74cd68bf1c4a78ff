"""Geometric back-off of a poll: wait ``first``, then ``factor`` times the previous wait, capped at ``cap``;
:meth:`GeometricBackoff.reset` (something arrived) starts again at ``first``.

Used where a process polls for something that comes in bursts after long quiet spells: the ServerApp waiting
for a round's replies (``strategies/pgvi.py``) and the paced SuperNode waiting for its next message
(``client/paced_supernode.py``).  A poll soon after an arrival finds the rest of a burst quickly; a long quiet
spell costs a poll per ``cap`` seconds instead of one per ``first``.
"""

from __future__ import annotations

import math
import threading


class GeometricBackoff:
    """The waits ``first, first*factor, first*factor^2, ...`` capped at ``cap``; :meth:`reset` starts again.
    ``first = 0`` gives waits of 0 (a busy poll, for in-process tests).  Thread-safe."""

    def __init__(self, first: float, cap: float, factor: float) -> None:
        self._lock = threading.Lock()
        self.configure(first, cap, factor)

    def configure(self, first: float, cap: float, factor: float) -> None:
        """New settings (ValueError naming the bad one); the next wait is ``first``."""
        for name, value in (("first", first), ("cap", cap), ("factor", factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"back-off {name} must be a finite number, got {value!r}")
        if not 0 <= first <= cap:
            raise ValueError(f"back-off first wait must be in [0, cap={cap}], got {first}")
        if factor < 1:
            raise ValueError(f"back-off factor must be >= 1, got {factor}")
        with self._lock:
            self.first, self.cap, self.factor = float(first), float(cap), float(factor)
            self._next = self.first

    def reset(self) -> None:
        with self._lock:
            self._next = self.first

    def next_wait(self) -> float:
        with self._lock:
            wait = self._next
            self._next = min(self.cap, wait * self.factor)
            return wait
