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

Security: the socket's directory is created with mode 0700 and the connection is authenticated with
``multiprocessing.connection``'s HMAC challenge, using a random key the worker writes next to the socket
(``<socket>.key``, mode 0600) and the ClientApp reads.  Only processes of the same user on the same host
can connect.  Requests are pickled only after that handshake.

Requests are served one at a time (a node has one message in flight).  A ClientApp that disappears
mid-request (Flower stopped it) costs the computation, not the worker.  If the worker cannot be reached,
the ClientApp logs a warning and computes in its own process (``client/app.py``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

KEY_SUFFIX = ".key"


class WorkerUnavailable(ConnectionError):
    """The node's compute worker is not running, or its key is missing or wrong."""


class WorkerError(RuntimeError):
    """The request raised inside the worker; the message carries the worker-side exception and traceback."""

    def __init__(self, kind: str, message: str, trace: str) -> None:
        super().__init__(f"{kind}: {message}\n--- in the compute worker ---\n{trace}")
        self.kind = kind


def key_path(socket_path: str | os.PathLike) -> Path:
    return Path(str(socket_path) + KEY_SUFFIX)


def call(socket_path: str | os.PathLike, request: object) -> object:
    """Send one request to the worker at ``socket_path`` and return its result (or raise what it raised)."""
    try:
        key = key_path(socket_path).read_bytes()
        conn = Client(str(socket_path), family="AF_UNIX", authkey=key)
    except (OSError, EOFError) as err:  # no key file, no socket, connection refused
        raise WorkerUnavailable(f"compute worker at {socket_path} not reachable: {err}") from err
    except Exception as err:  # multiprocessing.AuthenticationError: a stale or wrong key
        raise WorkerUnavailable(f"compute worker at {socket_path} refused the connection: {err}") from err
    with conn:
        conn.send(request)
        status, payload = conn.recv()
    if status == "ok":
        return payload
    kind, message, trace = payload
    if kind == "InjectedFault":
        from client.node_request import InjectedFault

        raise InjectedFault(message)
    raise WorkerError(kind, message, trace)


def _serve_one(conn: Connection, handle) -> None:
    try:
        request = conn.recv()
    except (EOFError, OSError):
        return
    try:
        reply = ("ok", handle(request))
    except Exception as err:  # report every failure to the caller; the worker itself keeps serving
        reply = ("error", (type(err).__name__, str(err), traceback.format_exc()))
    try:
        conn.send(reply)
    except (BrokenPipeError, ConnectionResetError, OSError):
        print(f"[warm-worker] the ClientApp left before its reply ({reply[0]})", file=sys.stderr, flush=True)


def serve(socket_path: str | os.PathLike, *, max_requests: int | None = None) -> int:
    """Listen on ``socket_path`` until SIGTERM/SIGINT (or ``max_requests``); returns the requests served."""
    from client.pgvi_client import handle  # torch, common: loaded once, here

    path = Path(socket_path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    path.unlink(missing_ok=True)
    key = secrets.token_bytes(32)
    kpath = key_path(path)
    fd = os.open(kpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    stop = False

    def _stop(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True
        print(f"[warm-worker] signal {signum}: stopping", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    served = 0
    listener = Listener(str(path), family="AF_UNIX", authkey=key)
    print(f"[warm-worker] pid {os.getpid()} ready on {path}", file=sys.stderr, flush=True)
    try:
        while not stop and (max_requests is None or served < max_requests):
            try:
                conn = listener.accept()
            except KeyboardInterrupt:
                break
            except Exception as err:  # a failed handshake (wrong key) must not stop the worker
                print(f"[warm-worker] refused a connection: {err}", file=sys.stderr, flush=True)
                continue
            with conn:
                t = time.perf_counter()
                try:
                    _serve_one(conn, handle)
                except KeyboardInterrupt:
                    break
                served += 1
                print(f"[warm-worker] request {served} served in {time.perf_counter() - t:.2f} s", file=sys.stderr, flush=True)
    finally:
        listener.close()
        path.unlink(missing_ok=True)
        kpath.unlink(missing_ok=True)
        for s, h in old.items():
            signal.signal(s, h)
    return served


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.warm_worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="Unix socket path (its directory is made 0700)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads (a request's node config overrides it)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    served = serve(args.socket)
    print(f"[warm-worker] stopped after {served} requests", file=sys.stderr, flush=True)
    # Nothing is left to write (client state is saved atomically inside each request), so skip the interpreter's
    # teardown: with ten workers holding Fashion-MNIST shards it took over 10 s on 2 cores (measured with
    # scripts/bench_network.py --warm-workers: 6 of 10 workers were still alive 10 s after SIGTERM).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
