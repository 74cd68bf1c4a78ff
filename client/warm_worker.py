"""A node's warm compute worker: torch, the data shard and the problem stay loaded across messages.

Flower 1.39 starts a fresh ``flwr-clientapp`` process for every message (both isolation modes).  Our
ClientApp module imports no torch, so that process is cheap; what is expensive (importing torch, loading
and partitioning the dataset, building the model) happens once per node in this worker, and every train
and evaluate message of the run is served from it.  The ClientApp sends the worker a
:class:`client.pgvi_client.Request` over a Unix-domain socket and replies to the server with the
:class:`~client.pgvi_client.Result`; it is the same :func:`client.pgvi_client.handle` either way, so results
are bit-for-bit those of the in-process path.

Run one per SuperNode host, next to the SuperNode, and point the node at it::

    python -m client.warm_worker --socket /run/pgvi/site-0/worker.sock
    flower-supernode ... --node-config "partition-id=0 num-partitions=3 compute-worker='/run/pgvi/site-0/worker.sock'"

Security: the socket's directory must be private to the worker's user.  A missing directory is created
with mode 0700; an existing one is never chmod-ed: the worker refuses to start unless it is owned by the
worker's user and has no group/other permissions (so ``--socket /tmp/w.sock`` or a bare ``--socket w.sock``
in a shared directory is an error, not a silent ``chmod`` of ``/tmp`` or of the working directory).  The
connection is authenticated with ``multiprocessing.connection``'s HMAC challenge, using a random key the
worker writes next to the socket (``<socket>.key``, mode 0600, created afresh with ``O_EXCL|O_NOFOLLOW``)
and the ClientApp reads.  Only processes of the same user on the same host can connect.  Requests are
pickled only after that handshake.

Timeouts: the handshake must complete within ``HANDSHAKE_TIMEOUT_S`` (10 s) on both sides: a ClientApp
whose worker does not answer gets :class:`WorkerUnavailable`, and a peer that connects but stalls cannot
block the worker (it is dropped, logged, and the worker keeps serving; ``--handshake-timeout-s`` changes
the worker's bound, at most ``MAX_HANDSHAKE_TIMEOUT_S``, 3600 s).  The ClientApp then waits for the result
at most ``compute-worker-timeout-s`` (node config, default 3600 s, at most ``MAX_RESULT_TIMEOUT_S``, 30 days)
and raises :class:`WorkerTimeout` after that.  The caps keep the values within what the socket layer takes
(``settimeout`` and ``poll`` raise ``OverflowError`` on huge ones); :func:`call` waits for a result in slices
``poll`` can take, and turns an ``OverflowError`` from the socket layer into :class:`WorkerUnavailable`.

Requests are served one at a time (a node has one message in flight).  A ClientApp that disappears
mid-request (Flower stopped it) costs the computation, not the worker; a ClientApp that connects while the
worker is still busy with such an abandoned request times out in the handshake.  Nothing a peer sends stops
the worker: a request it cannot unpickle (a FAB whose code differs from the worker's) gets an error reply.
If the worker cannot be reached, times out, dies mid-request (crash, OOM kill, SIGTERM on a restart) or
cannot read the request, the ClientApp gets a :class:`WorkerUnavailable`, logs a warning and computes in its
own process (``client/app.py``).

One worker per socket path: a worker holds an exclusive ``flock`` on ``<socket>.lock`` (:class:`SocketLock`)
from before it looks at the path until it has cleaned up, so of two workers started together only one gets
past it (the other exits with :class:`WorkerAlreadyRunning`).  Under the lock it refuses to start while a
worker without the lock answers on the path (a socket file nobody listens on, left by a killed worker, is
replaced), and a stopping worker removes the socket and key only if they are still its own, so it cannot take
the path from under a successor.  The kernel drops a killed worker's lock; its lock file blocks nobody.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import secrets
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from multiprocessing.reduction import ForkingPickler  # what Connection.send/recv pickle with
from pathlib import Path

KEY_SUFFIX = ".key"
LOCK_SUFFIX = ".lock"
HANDSHAKE_TIMEOUT_S = 10.0  # connect + HMAC challenge, each side
RESULT_TIMEOUT_S = 3600.0  # default of the node config key compute-worker-timeout-s (client/app.py)
# Upper bounds of the two settings.  settimeout() overflows past ~292 years and poll() past ~24.8 days (its
# milliseconds are a C int); call() waits in slices of at most _POLL_SLICE_S, so 30 days is fine.  Values this
# large are typos, and refusing them with the limit in the message beats an OverflowError in round 1.
MAX_HANDSHAKE_TIMEOUT_S = 3600.0  # --handshake-timeout-s; it also bounds the wait for the request
MAX_RESULT_TIMEOUT_S = 30 * 86400.0  # node config compute-worker-timeout-s (client/app.py)
#: the largest request or reply either side reads (a pickled posterior, site and Delta: 2.5 MB for the 784-200-10 BNN)
MAX_MESSAGE_BYTES = 1 << 32
_POLL_SLICE_S = 86400.0


class WorkerUnavailable(ConnectionError):
    """The node's compute worker is not running, its key is missing or wrong, or it did not complete the handshake.

    The subclasses are the ways a worker that took the request can still fail to produce a result; the ClientApp
    catches them all with this class and computes the message itself."""


class WorkerTimeout(WorkerUnavailable):
    """The worker took the request but sent no result within the timeout: it is presumably hung."""


class WorkerLost(WorkerUnavailable):
    """The connection broke after the handshake, before the result arrived: the worker died mid-request
    (crashed, was OOM-killed, or was stopped by a SIGTERM on a restart).  Its computation is lost; the
    ClientApp state is not (the worker keeps none), so computing the message again is safe."""


class WorkerIncompatible(WorkerUnavailable):
    """The worker could not unpickle the request, or the ClientApp the worker's reply: the two run different
    code (a FAB other than the one the worker was started from), so the ClientApp computes the message itself."""


class WorkerAlreadyRunning(RuntimeError):
    """Another worker answers on the socket path: two workers on one path would take it from each other."""


class WorkerError(RuntimeError):
    """The request raised inside the worker; the message carries the worker-side exception and traceback."""

    def __init__(self, kind: str, message: str, trace: str) -> None:
        super().__init__(f"{kind}: {message}\n--- in the compute worker ---\n{trace}")
        self.kind = kind


class SocketDirectoryError(RuntimeError):
    """The socket's directory exists and is not private to the worker's user."""


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__  # a bare EOFError has no message


def key_path(socket_path: str | os.PathLike) -> Path:
    return Path(str(socket_path) + KEY_SUFFIX)


def lock_path(socket_path: str | os.PathLike) -> Path:
    return Path(str(socket_path) + LOCK_SUFFIX)


class _HandshakeChannel:
    """``send_bytes``/``recv_bytes`` in :class:`multiprocessing.connection.Connection`'s wire format (a 4-byte
    big-endian length, then the bytes) over a socket, all under one deadline.

    The stdlib ``deliver_challenge``/``answer_challenge`` use nothing else, so they run unchanged over this
    channel and the whole handshake cannot outlast the deadline, even against a peer that trickles bytes.  A
    socket timeout cannot just be left on the socket a ``Connection`` wraps: ``settimeout`` makes the
    descriptor non-blocking and ``Connection``'s raw reads would fail at once.  Reads never go past the
    current message, so the ``Connection`` that takes over afterwards starts at the next one.
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake timed out")
        self._sock.settimeout(left)

    def send_bytes(self, buf: bytes) -> None:
        buf = bytes(buf)
        self._arm()
        self._sock.sendall(struct.pack("!i", len(buf)) + buf)

    def _recv_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            self._arm()
            chunk = self._sock.recv(n)
            if not chunk:
                raise EOFError("the peer closed the connection during the handshake")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        (size,) = struct.unpack("!i", self._recv_exact(4))
        if size < 0 or (maxlength is not None and size > maxlength):
            raise OSError(f"bad handshake message length {size}")
        return self._recv_exact(size)


def _handshake(sock: socket.socket, authkey: bytes, deadline: float, *, server: bool) -> None:
    """The HMAC challenge in both directions, in the order ``Listener.accept`` / ``Client`` run it."""
    channel = _HandshakeChannel(sock, deadline)
    if server:
        deliver_challenge(channel, authkey)
        answer_challenge(channel, authkey)
    else:
        answer_challenge(channel, authkey)
        deliver_challenge(channel, authkey)


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts (SO_SNDTIMEO/SO_RCVTIMEO) on a blocking socket: a read or write that makes
    no progress for ``seconds`` fails with ``BlockingIOError`` (a blocking ``connect`` with ``EAGAIN``)."""
    sec = int(min(seconds, 2**31 - 1))  # min first: int(inf) would raise
    usec = min(int((seconds - int(seconds)) * 1e6), 999_999) if sec < 2**31 - 1 else 0
    tv = struct.pack("@ll", sec, usec)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _connection(sock: socket.socket, io_timeout: float) -> Connection:
    """Hand an authenticated socket to a blocking ``Connection`` whose reads and writes time out after
    ``io_timeout`` s without progress."""
    sock.settimeout(None)  # blocking again: Connection reads and writes the raw descriptor
    _set_io_timeout(sock, io_timeout)
    return Connection(sock.detach())


def _wait_for_reply(conn: Connection, deadline: float) -> bool:
    """``conn.poll`` until data arrives (True) or ``deadline`` passes (False), in slices of at most
    ``_POLL_SLICE_S``: ``poll`` takes its timeout in milliseconds as a C int and raises ``OverflowError`` past
    ~24.8 days, less than the ``MAX_RESULT_TIMEOUT_S`` the node config allows."""
    while True:
        if conn.poll(max(0.0, min(deadline - time.monotonic(), _POLL_SLICE_S))):
            return True
        if time.monotonic() >= deadline:
            return False


def call(socket_path: str | os.PathLike, request: object, *, timeout: float = RESULT_TIMEOUT_S,
         handshake_timeout: float | None = None) -> object:
    """Send one request to the worker at ``socket_path`` and return its result (or raise what it raised).

    Raises :class:`WorkerUnavailable` if the worker cannot be reached or does not complete the handshake
    within ``handshake_timeout`` (default :data:`HANDSHAKE_TIMEOUT_S`), and its subclasses after the handshake:
    :class:`WorkerTimeout` if no result arrives within ``timeout`` seconds of sending the request,
    :class:`WorkerLost` if the connection breaks first (the worker died), :class:`WorkerIncompatible` if the
    worker could not read the request or its reply cannot be read here.  A request that raised in the worker
    raises :class:`WorkerError` (or the ``InjectedFault`` it was).  A timeout the socket layer cannot take (an
    ``OverflowError``) raises :class:`WorkerUnavailable` too, so the ClientApp falls back instead of failing.
    """
    hs = HANDSHAKE_TIMEOUT_S if handshake_timeout is None else float(handshake_timeout)
    try:
        key = key_path(socket_path).read_bytes()
    except OSError as err:  # no key file: no worker
        raise WorkerUnavailable(f"compute worker at {socket_path} not reachable: {err}") from err
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + hs
        _set_io_timeout(sock, hs)  # bounds a blocking connect to a worker whose backlog is full
        sock.connect(str(socket_path))
        _handshake(sock, key, deadline, server=False)
        conn = _connection(sock, timeout)
    except (TimeoutError, BlockingIOError) as err:
        sock.close()
        raise WorkerUnavailable(f"compute worker at {socket_path} did not complete the handshake within "
                                f"{hs:g} s (busy or hung?)") from err
    except OverflowError as err:  # settimeout: a handshake timeout the socket layer cannot take
        sock.close()
        raise WorkerUnavailable(f"compute worker at {socket_path} not reachable: the socket layer refused the "
                                f"handshake timeout of {hs:g} s ({_describe(err)})") from err
    except (OSError, EOFError) as err:  # no socket, connection refused, closed during the handshake
        sock.close()
        raise WorkerUnavailable(f"compute worker at {socket_path} not reachable: {err}") from err
    except Exception as err:  # multiprocessing.AuthenticationError: a stale or wrong key
        sock.close()
        raise WorkerUnavailable(f"compute worker at {socket_path} refused the connection: {err}") from err
    except BaseException:
        sock.close()
        raise
    deadline = time.monotonic() + timeout
    with conn:
        try:
            conn.send(request)
            if not _wait_for_reply(conn, deadline):
                raise WorkerTimeout(f"compute worker at {socket_path} sent no result within {timeout:g} s "
                                    "(node config compute-worker-timeout-s)")
            data = conn.recv_bytes(MAX_MESSAGE_BYTES)
        except WorkerUnavailable:  # the WorkerTimeout above: a ConnectionError, i.e. an OSError
            raise
        except MemoryError as err:  # a reply too large to hold: the ClientApp computes itself
            raise WorkerLost(f"compute worker at {socket_path} sent a reply that does not fit in memory: "
                             f"{_describe(err)}") from err
        except BlockingIOError as err:  # SO_SNDTIMEO/SO_RCVTIMEO: the worker stopped reading or writing
            raise WorkerTimeout(f"compute worker at {socket_path} stalled for {timeout:g} s mid-transfer "
                                "(node config compute-worker-timeout-s)") from err
        except OverflowError as err:  # a wait the socket layer cannot take: fall back rather than fail the message
            raise WorkerUnavailable(f"compute worker at {socket_path} took the request, but the ClientApp cannot "
                                    f"wait {timeout:g} s for its result ({_describe(err)}; node config "
                                    "compute-worker-timeout-s)") from err
        except (EOFError, OSError) as err:  # EOF, ECONNRESET, EPIPE: the worker process is gone
            raise WorkerLost(f"compute worker at {socket_path} closed the connection mid-request (it crashed, "
                             f"was killed or was stopped): {_describe(err)}") from err
    try:  # outside the I/O handlers: a reply we cannot read is the worker's other code, not a dead worker
        status, payload = ForkingPickler.loads(data)
        if status != "ok":
            kind, message, trace = payload
    except Exception as err:
        raise WorkerIncompatible(f"compute worker at {socket_path} replied, but the ClientApp could not read the "
                                 f"worker's reply ({_describe(err)}); does it run the FAB's code?") from err
    if status == "ok":
        return payload
    if status == "unreadable":
        raise WorkerIncompatible(f"compute worker at {socket_path} could not read the request ({kind}: {message}); "
                                 "does it run the FAB's code?")
    if kind == "InjectedFault":
        from client.node_request import InjectedFault

        raise InjectedFault(message)
    raise WorkerError(kind, message, trace)


def _failure(err: BaseException) -> tuple[str, str, str]:
    return type(err).__name__, str(err), traceback.format_exc()


def _serve_one(conn: Connection, handle) -> None:
    """Read one request, run it, send the reply.  Whatever the peer sends, this returns (``serve`` keeps going).

    The bytes are read and unpickled separately: once a whole message is read the connection is still in
    step, so a request the worker cannot unpickle (a FAB whose code differs from the worker's: a missing module
    or class) gets an ``"unreadable"`` reply the ClientApp turns into :class:`WorkerIncompatible` and falls back
    on.  A reply that cannot be pickled is reported as an ``"error"`` reply.
    """
    try:
        data = conn.recv_bytes(MAX_MESSAGE_BYTES)
    except EOFError:
        return
    except (OSError, MemoryError) as err:  # BlockingIOError: no request within the I/O timeout after the handshake;
        # "bad message length": a header announcing more than MAX_MESSAGE_BYTES (2^62 raised MemoryError, uncaught:
        # the worker exited and every later message computed in the ClientApp)
        print(f"[warm-worker] no request received: {err!r}", file=sys.stderr, flush=True)
        return
    try:
        request = ForkingPickler.loads(data)
    except Exception as err:  # any exception: unpickling runs code (imports, __setstate__, reducers)
        print(f"[warm-worker] could not read a request ({_describe(err)}); replied with the error, "
              "still serving", file=sys.stderr, flush=True)
        reply = ("unreadable", _failure(err))
    else:
        try:
            reply = ("ok", handle(request))
        except Exception as err:  # report every failure to the caller; the worker itself keeps serving
            reply = ("error", _failure(err))
    try:
        out = ForkingPickler.dumps(reply)
    except Exception as err:  # the result holds something unpicklable: tell the caller, do not die of it
        print(f"[warm-worker] could not pickle the {reply[0]} reply ({_describe(err)})",
              file=sys.stderr, flush=True)
        out = ForkingPickler.dumps(("error", _failure(err)))
    try:
        conn.send_bytes(out)
    except OSError:  # BrokenPipeError, ConnectionResetError, or BlockingIOError: the peer stopped reading
        print(f"[warm-worker] the ClientApp left before its reply ({reply[0]})", file=sys.stderr, flush=True)


def check_socket_dir(socket_path: str | os.PathLike) -> Path:
    """Make the socket's directory 0700 if it is missing; else require that it is private to this user.

    An existing directory is never chmod-ed (``--socket /tmp/w.sock`` must not make ``/tmp`` 0700).  Raises
    :class:`SocketDirectoryError` unless it is a directory owned by the effective user with no group/other
    permissions.  Returns the directory.
    """
    parent = Path(socket_path).parent
    try:
        parent.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    else:
        os.chmod(parent, 0o700)  # just created by us: 0700 whatever the umask
    st = os.stat(parent)
    mode, euid = stat.S_IMODE(st.st_mode), os.geteuid()
    where = os.path.abspath(parent)
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirectoryError(f"the socket's directory {where} is not a directory")
    if st.st_uid != euid or mode & 0o077:
        raise SocketDirectoryError(
            f"refusing to listen in {where} (owner uid {st.st_uid}, mode {mode:04o}): the socket's directory must "
            f"be owned by this user (uid {euid}) with no group/other permissions. Give the socket a directory of "
            "its own (the worker creates a missing one with mode 0700), or chmod 700 a directory only the "
            "worker uses")
    return parent


def check_no_live_worker(socket_path: str | os.PathLike) -> bool:
    """Raise :class:`WorkerAlreadyRunning` if a process accepts connections on ``socket_path``.

    Returns whether a stale file is in the way: a socket nobody listens on (its worker was killed before its
    cleanup), or anything else a connect is refused on.  A connection attempt, not the file, tells a live worker
    from a stale one; the live worker sees a peer that leaves before the handshake and logs it.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(socket_path))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except ConnectionRefusedError:
        return True
    except (BlockingIOError, TimeoutError) as err:  # EAGAIN: a live worker whose backlog is full
        raise WorkerAlreadyRunning(f"a compute worker is already listening on {socket_path} (busy: {err}); stop it "
                                   "first, or give this worker a socket path of its own") from err
    finally:
        probe.close()
    raise WorkerAlreadyRunning(f"a compute worker is already listening on {socket_path}; stop it first, or give "
                               "this worker a socket path of its own")


class SocketLock:
    """An exclusive ``flock`` on ``<socket>.lock``, held for a worker's whole life: one worker per socket path.

    Why: a worker decides that a socket file is stale (nobody accepts on it) and then unlinks it; without a lock
    around the two steps, a worker that found the file stale could unlink a second worker's fresh socket and bind
    its own, leaving two workers running, one unreachable with torch and its data loaded.  The lock is taken
    before the check and kept until the socket and key are removed on the way out.

    The kernel drops an ``flock`` when its holder dies (SIGKILL, OOM kill), so a lock file left by a killed worker
    blocks nobody.  :meth:`release` removes the file while still holding it, and :meth:`acquire` checks after
    locking that the file it locked is still the one at the path (else it opens the path again): a worker that
    opened the file just before its holder removed it cannot hold the removed file next to a successor that
    created a new one.  The lock is per open file: a second :class:`SocketLock` on the path fails in the same
    process too.
    """

    _ATTEMPTS = 10  # each retry means another worker released the path between our open and our flock

    def __init__(self, socket_path: str | os.PathLike) -> None:
        self.socket_path = Path(socket_path)
        self.path = lock_path(socket_path)
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> SocketLock:
        """Take the lock without waiting; raises :class:`WorkerAlreadyRunning` (naming the socket) if another
        worker holds it, ``OSError`` if the lock file cannot be opened or locked (a filesystem without locks:
        the message names the lock file and says to move the socket to a local filesystem).  Returns ``self``."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this SocketLock")
        for _ in range(self._ATTEMPTS):
            # O_NOFOLLOW: a symlink planted at the path cannot make us create or lock another file
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
            except BlockingIOError as err:  # EWOULDBLOCK: another worker holds it
                os.close(fd)
                self._refuse(err)
            except OSError as err:  # ENOLCK, EINVAL, ...: a filesystem without working locks (NFS without lockd)
                os.close(fd)
                raise OSError(err.errno, f"cannot lock {self.path} ({err.strerror or _describe(err)}): its "
                              "filesystem does not support flock (NFS without a lock manager?); put the worker's "
                              "socket on a local filesystem, e.g. under /tmp or $XDG_RUNTIME_DIR (--socket; with "
                              "scripts/deploy.py, --run-dir)") from err
            except BaseException:
                os.close(fd)
                raise
            if _file_id(self.path) == (st.st_dev, st.st_ino):
                self._fd, self._id = fd, (st.st_dev, st.st_ino)
                return self
            os.close(fd)  # we locked a file its holder had just removed: lock the one at the path now
        raise WorkerAlreadyRunning(f"the lock file {self.path} of the socket {self.socket_path} kept changing hands "
                                   f"({self._ATTEMPTS} attempts): are workers being started on it in a loop?")

    def _refuse(self, err: OSError) -> None:
        check_no_live_worker(self.socket_path)  # a live worker: "already listening", the message operators know
        raise WorkerAlreadyRunning(
            f"another compute worker holds {self.path}: it is already starting or stopping on {self.socket_path} "
            "(not yet or no longer listening); stop it first, or give this worker a socket path of its own") from err

    def release(self) -> None:
        """Remove the lock file if it is still ours (while holding it: see the class doc), then unlock."""
        if self._fd is None:
            return
        try:
            _remove_if_ours(self.path, self._id)
        finally:
            os.close(self._fd)
            self._fd = self._id = None

    def __enter__(self) -> SocketLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _remove_if_ours(path: Path, ours: tuple[int, int] | None, key: bytes | None = None) -> None:
    """Unlink ``path`` if it is still the file this worker created (same device and inode, and for the key the
    same content: an inode number freed by an unlinked key can be reused); a successor's socket or key is left
    alone and the fact logged."""
    if ours is None:  # never created (the bind or the key write failed)
        return
    now = _file_id(path)
    if now is None:  # already gone
        return
    mine = now == ours
    if mine and key is not None:
        try:
            mine = path.read_bytes() == key
        except OSError:
            mine = False
    if not mine:
        print(f"[warm-worker] {path} is not this worker's any more (another worker took the path?); left in place",
              file=sys.stderr, flush=True)
        return
    path.unlink(missing_ok=True)


def check_handshake_timeout(seconds: float) -> float:
    """``seconds`` as a float if it is a usable handshake timeout (``0 < seconds <= MAX_HANDSHAKE_TIMEOUT_S``),
    else ``ValueError``: past the limit ``settimeout`` would refuse it and every connection with it."""
    value = float(seconds)
    if not 0 < value <= MAX_HANDSHAKE_TIMEOUT_S:
        raise ValueError(f"handshake_timeout must be a positive number of seconds at most "
                         f"{MAX_HANDSHAKE_TIMEOUT_S:g}, got {seconds!r}")
    return value


def serve(socket_path: str | os.PathLike, *, max_requests: int | None = None,
          handshake_timeout: float = HANDSHAKE_TIMEOUT_S, lock: SocketLock | None = None) -> int:
    """Listen on ``socket_path`` until SIGTERM/SIGINT (or ``max_requests``); returns the requests served.

    A peer that does not complete the handshake within ``handshake_timeout`` seconds (at most
    ``MAX_HANDSHAKE_TIMEOUT_S``, else ``ValueError`` before anything is touched) is dropped (and so is one that
    then sends no request, or stops reading its reply, for that long); the worker keeps serving.

    Runs under the path's :class:`SocketLock`: ``lock``, held by the caller (``main`` takes it before its slow
    imports) and left held, or else one taken here and released on return.  Raises :class:`WorkerAlreadyRunning`
    if another worker holds the lock or answers on ``socket_path``.  The check runs before the slow import (a
    quick refusal) and again just before the bind (a worker without the lock that started meanwhile); a stale
    socket file is replaced.  On the way out the socket and key are removed only if they are still the ones
    this worker created.
    """
    handshake_timeout = check_handshake_timeout(handshake_timeout)
    path = Path(socket_path)
    if lock is not None and not (lock.held and lock.path == lock_path(path)):
        raise ValueError(f"serve() on {path} needs the lock {lock_path(path)} held, got "
                         f"{'a held' if lock.held else 'an unheld'} lock on {lock.path}")
    check_socket_dir(path)
    own = lock is None
    if own:
        lock = SocketLock(path).acquire()
    try:
        return _serve_locked(path, max_requests, handshake_timeout)
    finally:
        if own:
            lock.release()


def _serve_locked(path: Path, max_requests: int | None, handshake_timeout: float) -> int:
    """:func:`serve` once the path's :class:`SocketLock` is held."""
    check_no_live_worker(path)
    from client.pgvi_client import handle  # torch, common: loaded once, here

    kpath = key_path(path)
    stop = False

    def _stop(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True
        print(f"[warm-worker] signal {signum}: stopping", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    def _stopping(signum, frame):  # noqa: ARG001 - during the clean-up: a second signal must not cut it short
        print(f"[warm-worker] signal {signum}: already stopping", file=sys.stderr, flush=True)

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    served = 0
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_id = key_id = key = None
    try:
        try:  # the handler's KeyboardInterrupt can come at any line of this block, a blocking accept or
            # handshake included (a signal between two requests once escaped from the print after one and ended
            # the worker with a traceback); the accepted socket of an interrupted handshake closes with the frame
            if check_no_live_worker(path):  # a killed worker's socket and key; the lock keeps other workers out
                path.unlink(missing_ok=True)
                print(f"[warm-worker] replacing the stale socket {path} (nobody listened on it)",
                      file=sys.stderr, flush=True)
            try:  # bind is atomic: a worker that bound the path since the check above makes it fail
                listener.bind(str(path))
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    raise
                raise WorkerAlreadyRunning(f"another compute worker took {path} while this one started") from err
            sock_id = _file_id(path)
            listener.listen(8)
            # the key only now, once the path is ours: a refused start leaves the live worker's key alone
            key = secrets.token_bytes(32)
            kpath.unlink(missing_ok=True)  # then O_EXCL|O_NOFOLLOW: a symlink planted here cannot redirect the write
            fd = os.open(kpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            st = os.fstat(fd)
            key_id = st.st_dev, st.st_ino
            with os.fdopen(fd, "wb") as f:
                f.write(key)
            print(f"[warm-worker] pid {os.getpid()} ready on {path}", file=sys.stderr, flush=True)
            while not stop and (max_requests is None or served < max_requests):
                try:
                    raw, _ = listener.accept()
                except OSError as err:  # e.g. out of file descriptors: log, do not spin
                    print(f"[warm-worker] accept failed: {err!r}", file=sys.stderr, flush=True)
                    time.sleep(0.1)
                    continue
                try:
                    _handshake(raw, key, time.monotonic() + handshake_timeout, server=True)
                    conn = _connection(raw, handshake_timeout)
                except Exception as err:  # a wrong key or a stalled peer must not stop the worker
                    raw.close()
                    why = (f"no handshake within {handshake_timeout:g} s" if isinstance(err, TimeoutError)
                           else f"{type(err).__name__}: {err}")
                    print(f"[warm-worker] refused a connection ({why}); still serving", file=sys.stderr, flush=True)
                    continue
                with conn:
                    t = time.perf_counter()
                    try:
                        _serve_one(conn, handle)
                    except KeyboardInterrupt:  # also one the request's own code raised: stop, as before
                        break
                    served += 1
                    print(f"[warm-worker] request {served} served in {time.perf_counter() - t:.2f} s", file=sys.stderr,
                          flush=True)
        except KeyboardInterrupt:
            if not stop:  # not raised by the signal handler: not ours to swallow
                raise
    finally:
        for s in old:
            signal.signal(s, _stopping)
        # the socket's inode is compared while the listener still holds it: no new file can reuse the number yet
        _remove_if_ours(path, sock_id)
        _remove_if_ours(kpath, key_id, key)
        listener.close()
        for s, h in old.items():
            signal.signal(s, h)
    return served


def _handshake_seconds(text: str) -> float:
    """``--handshake-timeout-s``: positive seconds, at most ``MAX_HANDSHAKE_TIMEOUT_S`` (see
    :func:`check_handshake_timeout`)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_HANDSHAKE_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds at most "
                                         f"{MAX_HANDSHAKE_TIMEOUT_S:g}, got {text!r}")
    return value


def _torch_threads(text: str) -> int:
    """``--torch-threads``: a whole number in [1, MAX_TORCH_THREADS] (0 reached ``torch.set_num_threads`` and failed
    there)."""
    from common.config import MAX_TORCH_THREADS

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_TORCH_THREADS:
        raise argparse.ArgumentTypeError(f"must be a whole number in [1, {MAX_TORCH_THREADS}], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.warm_worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True,
                    help="Unix socket path; its directory is created 0700 if missing, else must be private to this user")
    ap.add_argument("--torch-threads", type=_torch_threads, default=1,
                    help="torch threads until the first request; each request then runs with its node config's "
                         "torch-threads, else the run config's (0 there: 1)")
    ap.add_argument("--handshake-timeout-s", type=_handshake_seconds, default=HANDSHAKE_TIMEOUT_S,
                    help="drop a peer that does not complete the authentication handshake within this time "
                         f"(default {HANDSHAKE_TIMEOUT_S:g}, at most {MAX_HANDSHAKE_TIMEOUT_S:g})")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:  # before the slow torch import; the lock for the worker's whole life (a second worker stops here)
        check_socket_dir(args.socket)
        lock = SocketLock(args.socket).acquire()
    except (SocketDirectoryError, WorkerAlreadyRunning, OSError) as err:
        sys.exit(f"[warm-worker] {err}")
    with lock:  # released (its file removed) on the way out, sys.exit included
        try:
            check_no_live_worker(args.socket)  # a worker of a version without the lock
        except (WorkerAlreadyRunning, OSError) as err:
            sys.exit(f"[warm-worker] {err}")
        from common import explicit_step, native
        from common.runtime import configure_compute, flush_denormals_from_environment  # imports torch

        try:  # a bad compute switch stops the worker now (before round 1), not at its first request
            native.disabled_by_environment()
            native.openmp_disabled_by_environment()
            explicit_step.disabled_by_environment()
            flush_denormals_from_environment()
        except ValueError as err:
            sys.exit(f"[warm-worker] {err}")
        configure_compute(args.torch_threads)
        try:
            served = serve(args.socket, handshake_timeout=args.handshake_timeout_s, lock=lock)
        except WorkerAlreadyRunning as err:
            sys.exit(f"[warm-worker] {err}")
    print(f"[warm-worker] stopped after {served} requests", file=sys.stderr, flush=True)
    # Nothing is left to write (the ClientApp saves the client state it gets back), so skip the interpreter's
    # teardown: with ten workers holding Fashion-MNIST shards it took over 10 s on 2 cores (measured with
    # scripts/bench_network.py --warm-workers: 6 of 10 workers were still alive 10 s after SIGTERM).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
