"""Wake a node's SuperExec as soon as its SuperNode has a message, instead of at its next task poll.

With ``--isolation process`` a ClientApp starts only when the node's SuperExec asks the SuperNode for a task
(``AcquireTask``), which Flower 1.39's SuperExec does every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (1 s
by default; ``flwr.supercore.superexec.run_superexec``).  A message that reaches the node therefore waits a
uniformly random part of that interval, and a synchronous round waits for the slowest of its nodes.

Both processes of a node are ours when it runs ``client/paced_supernode.py`` and
``client/preforked_superexec.py``.  With ``$PGVI_TASK_WAKEUP_SOCKET`` set to the same path for both:

- the SuperExec binds a Unix datagram socket there, and its poll wait (the loop's one
  ``time.sleep(task_poll_interval)``) becomes a wait on that socket with the same timeout: one datagram ends
  one wait, so the loop asks for the task at once; without datagrams it polls exactly as Flower's;
- the SuperNode sends one datagram to it each time it has stored a message (and created its task).

A datagram carries no data the SuperExec trusts: it only moves the next ``AcquireTask`` forward (which is
authenticated as before).  A SuperNode whose SuperExec does not listen (not started yet, Flower's own
SuperExec, another isolation mode) loses nothing: the send fails silently and the task is found at the next
poll.  The socket's directory should be private to the node (``Deployment`` uses one under the run directory).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import inspect
import logging
import os
import select
import socket
import stat
import time as _time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from client.flower_version import version_problem

log = logging.getLogger("flwr")

ENV_SOCKET = "PGVI_TASK_WAKEUP_SOCKET"
MODULE = "flwr.supercore.superexec.run_superexec"
#: The one wait of Flower 1.39's SuperExec loop that this replaces.
FLOWER_POLL_WAIT = "time.sleep(task_poll_interval)"
#: Linux ``sockaddr_un.sun_path`` holds 108 bytes including the terminating NUL.
MAX_PATH_BYTES = 107


def check_socket_path(path: str | os.PathLike, what: str = ENV_SOCKET) -> Path:
    """``path`` as an absolute Path short enough for a Unix socket; ValueError naming ``what`` otherwise."""
    p = Path(path)
    if not p.is_absolute():
        raise ValueError(f"{what} must be an absolute path, got {str(path)!r}")
    if len(os.fsencode(p)) > MAX_PATH_BYTES:
        raise ValueError(f"{what} is {len(os.fsencode(p))} bytes long; a Unix socket path holds at most "
                         f"{MAX_PATH_BYTES}: {str(p)!r}")
    return p


def socket_path_from_env(env: Mapping[str, str] | None = None) -> Path | None:
    """The socket path from :data:`ENV_SOCKET` (unset or empty: None); ValueError if it cannot be one."""
    raw = (os.environ if env is None else env).get(ENV_SOCKET, "").strip()
    return check_socket_path(raw) if raw else None


def notify(path: str | os.PathLike) -> bool:
    """Send one wake-up datagram to ``path``, never blocking; False if nobody listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        try:
            s.sendto(b"!", os.fspath(path))
            return True
        except OSError as err:  # no listener, a full queue (it will poll anyway), a stale file
            if err.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ENOTSOCK):
                log.debug("task wake-up to %s failed: %s", path, err)
            return False


class WakeupListener:
    """The SuperExec's end: a Unix datagram socket bound at ``path`` (a stale socket file there is replaced;
    any other file is an error).  :meth:`wait` returns early, consuming one datagram, when one arrives."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = check_socket_path(path, "the task wake-up socket path")
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(f"{self.path} exists and is not a socket")
            self.path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(os.fspath(self.path))
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise
        self.waits = 0  # calls of wait()
        self.woken = 0  # waits ended by a datagram

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; True (one datagram consumed) if woken before that."""
        self.waits += 1
        deadline = _time.monotonic() + max(0.0, timeout)
        while True:
            remaining = deadline - _time.monotonic()
            try:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, remaining))
            except InterruptedError:  # pragma: no cover - PEP 475 retries select itself
                continue
            if ready:
                try:
                    self.sock.recv(64)
                except BlockingIOError:  # another reader took it: keep waiting
                    continue
                self.woken += 1
                return True
            if remaining <= 0:
                return False

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class WakeableTime:
    """Stands in for the ``time`` module inside Flower's SuperExec loop: ``sleep`` waits on the listener
    (the module's only sleep is the task poll wait, checked by :func:`incompatibility`); every other
    attribute is ``time``'s."""

    def __init__(self, listener: WakeupListener) -> None:
        self.listener = listener

    def sleep(self, seconds: float) -> None:
        self.listener.wait(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


def incompatibility() -> str | None:
    """Why :func:`install` cannot make this Flower's SuperExec loop wakeable, or None."""
    if (problem := version_problem()) is not None:
        return problem
    try:
        mod = importlib.import_module(MODULE)
        src = inspect.getsource(mod)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    if getattr(mod, "time", None) is not _time and not isinstance(getattr(mod, "time", None), WakeableTime):
        return f"{MODULE} does not use the time module as `time`"
    if src.count("time.sleep(") != 1 or src.count(FLOWER_POLL_WAIT) != 1:
        return f"{MODULE} no longer waits with exactly one {FLOWER_POLL_WAIT}"
    return None


def install(path: str | os.PathLike) -> WakeupListener | None:
    """Bind the listener at ``path`` and make Flower's SuperExec loop wait on it.  None (after one WARNING,
    nothing changed) if this Flower is not the one this was written for or the socket cannot be bound."""
    problem = incompatibility()
    if problem is None:
        try:
            listener = WakeupListener(path)
        except (OSError, ValueError) as err:
            problem = f"cannot listen on {path}: {err}"
    if problem is not None:
        log.warning("pgvi-superexec: %s; tasks are found at the SuperExec's polls only", problem)
        return None
    mod = importlib.import_module(MODULE)
    if isinstance(mod.time, WakeableTime):
        mod.time.listener.close()
    mod.time = WakeableTime(listener)
    return listener


def uninstall() -> None:
    """Undo :func:`install` (for tests)."""
    mod = importlib.import_module(MODULE)
    if isinstance(mod.time, WakeableTime):
        mod.time.listener.close()
        mod.time = _time
