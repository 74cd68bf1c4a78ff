"""A private, lean Ray head for Flower's simulation engine (``simulate.py --lean-ray``).

Flower 1.39's Ray backend calls ``ray.init(include_dashboard=False, ...)``, which starts a head with seven
processes besides the client actors: GCS, raylet, the dashboard agent and the runtime-env agent (the raylet's
two agents), the dashboard API server (started even with ``include_dashboard=False``), the autoscaler monitor and
the log monitor.  A single-host simulation needs only the first four: nothing autoscales, the drivers' logs are in
Flower's own log, and nothing asks the dashboard's REST API.  On this project's 1,000-client benchmark the other
three held about 260 MB of resident memory (docs/bench_network.md, section 2g).  ``ray.init`` takes no option
that leaves them out.

:func:`start_lean_ray_head` starts the head with ``ray start --head`` in a child process, with the autoscaler
monitor (``--no-monitor``) and the log monitor (``--include-log-monitor=false``) off and two of Ray's own steps
left out (see :data:`_PATCHES`): the Ray Client server (which ``ray start`` starts whenever Ray Client's
dependencies are installed; no flag turns it off) and the dashboard API server.  ``ray start`` returns once the
head is up; its processes run on, detached.  Flower's ``ray.init`` then joins the head through ``RAY_ADDRESS``
(``ray.init`` reads it when no address is given), so its driver starts no head of its own.

The head keeps everything in a temp dir of its own (its sessions, sockets and ``ray_current_cluster`` file), never
in Ray's default ``/tmp/ray``: a plain ``ray.init()`` elsewhere on the machine neither finds nor joins it.
Stopping it is the caller's: the head's GCS and raylet inherit the environment it was started with, so a marker
variable in it finds them, and the raylet's children are listed too (its agents and workers: a process title
written over a process's environment would hide the marker).  ``simulate.py`` does so, with a short grace: Ray's
GCS server ignores SIGTERM.

The head's GCS and raylet listen on every interface (as those of the head Flower's own ``ray.init`` starts do;
Ray 2.55's launcher passes them no address to bind to), and a Ray cluster without authentication runs whatever a
connection asks of it.  The head is therefore started with Ray's token authentication (Ray >= 2.52,
``RAY_AUTH_MODE=token``), with a random 256-bit token in ``<temp dir>/auth-token`` (mode 0600, named by
``RAY_AUTH_TOKEN_PATH``), which Ray then requires on its control-plane RPCs.  A process joins the head with
:func:`joining_env` (``simulate.py`` gives it to ``flwr run``, and so to Flower's ``ray.init``);
without it, or with another token, the GCS and the raylet's node manager refuse the RPC (``InvalidAuthToken``,
``UNAUTHENTICATED``), and the runtime-env agent, an HTTP server on the machine's own address, answers 401/403
(``tests/test_lean_ray.py`` checks the three).

Usage as a script (what :func:`start_lean_ray_head` runs): ``python scripts/lean_ray.py --port P --temp-dir D
[--num-cpus N]``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["LeanRayError", "auth_env", "joining_env", "start_lean_ray_head"]

#: What the launcher leaves out of ``ray start --head``, as (module, attribute, replacement) for each of Ray's
#: own steps it replaces.  The names are those of Ray 2.55 (the version flwr[simulation] 1.39 installs); the
#: launcher refuses a Ray without them instead of starting a head with everything.
_PATCHES = (
    # ``ray start`` turns the Ray Client server on when this returns None (its dependencies importable)
    ("ray.scripts.scripts", "get_ray_client_dependency_error", lambda: "left out by scripts/lean_ray.py"),
    # the dashboard API server (Node.start_head_processes calls it whatever include_dashboard says)
    ("ray._private.node", "Node.start_api_server", lambda self, **_: None),
)
START_TIMEOUT_S = 120.0


#: The head's token file in its temp dir (see the module docstring).
AUTH_TOKEN_FILE = "auth-token"


class LeanRayError(RuntimeError):
    """The lean Ray head could not be started (the message holds the end of ``ray start``'s output)."""


def auth_env(temp_dir: Path) -> dict[str, str]:
    """The environment variables with which a process joins the head whose temp dir is ``temp_dir`` (the head's
    own processes get them from :func:`start_lean_ray_head`)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(temp_dir) / AUTH_TOKEN_FILE)}


def joining_env(env: dict[str, str], temp_dir: Path) -> dict[str, str]:
    """``env`` with :func:`auth_env` of the head in ``temp_dir``, and without a ``RAY_AUTH_TOKEN`` (Ray would take that
    before the head's token file)."""
    return {**{k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}, **auth_env(temp_dir)}


def _write_token(temp_dir: Path) -> None:
    """A new random token in ``temp_dir``, readable by this user only; refuses to reuse or follow an existing file."""
    path = Path(temp_dir) / AUTH_TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise LeanRayError(f"cannot create the head's token file {path}: {err}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as Ray's own `ray get-auth-token --generate`


def _patch_ray() -> None:
    import importlib

    for module_name, attr, replacement in _PATCHES:
        try:
            owner: object = importlib.import_module(module_name)
        except ImportError as err:
            raise LeanRayError(f"Ray is not installed here ({err}): --lean-ray needs flwr[simulation]") from None
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not callable(getattr(owner, name, None)):
            import ray

            raise LeanRayError(f"Ray {ray.__version__} has no {module_name}.{attr}: --lean-ray supports the Ray "
                               "that flwr[simulation] 1.39 installs (2.55); run without --lean-ray")
        setattr(owner, name, replacement)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="start a lean Ray head (see the module docstring) and return")
    ap.add_argument("--port", type=int, required=True, help="GCS port")
    ap.add_argument("--temp-dir", required=True)
    ap.add_argument("--num-cpus", type=int, default=None, help="default: what Ray detects")
    ap.add_argument("--dashboard-agent-listen-port", type=int, required=True)
    args = ap.parse_args(argv)
    try:
        _patch_ray()
    except LeanRayError as err:
        print(f"lean_ray.py: error: {err}", file=sys.stderr)
        return 2
    from ray.scripts import scripts

    # the head advertises the loopback address (its GCS and raylet still listen on every interface, as those of
    # the head Flower's own ray.init starts do)
    cmd = ["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(args.port), "--temp-dir",
           args.temp_dir, "--no-monitor",
           "--include-log-monitor=false", "--include-dashboard=false", "--disable-usage-stats",
           "--dashboard-agent-listen-port", str(args.dashboard_agent_listen_port),
           # workers on ports the kernel picks: with Ray's default range (10002-19999) two heads on one machine
           # walk the same ports in the same order and one's worker or driver fails to bind ("Address already in
           # use": 7 of 16 pairs of simultaneous lean simulations failed); Flower's own ray.init passes 0 too
           "--min-worker-port", "0", "--max-worker-port", "0"]
    if args.num_cpus is not None:
        cmd += ["--num-cpus", str(args.num_cpus)]
    try:
        scripts.cli.main(args=cmd, prog_name="ray")  # click exits: 0 once the head is up
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 1
    return 0


def start_lean_ray_head(env: dict[str, str], port: int, agent_port: int, temp_dir: Path, *,
                        num_cpus: int | None = None, timeout: float = START_TIMEOUT_S, cwd: Path | None = None,
                        preexec_fn: Callable[[], None] | None = None) -> str:
    """Start the lean head (GCS on 127.0.0.1:``port``, the dashboard agent on ``agent_port``) with ``env``, which
    its processes inherit, and its sessions, sockets and logs in ``temp_dir`` (an existing directory; Ray's
    socket paths must stay under 108 bytes).  Returns the address: ``RAY_ADDRESS=address`` makes ``ray.init()``
    join it.  ``cwd``: the working directory of the head's processes and so of every worker (client actor) it
    starts (default: this process's).  ``preexec_fn`` runs in the launcher before it starts (e.g. joining a memory cgroup, which the
    head's processes then inherit).  The head requires the token it writes to ``temp_dir``: join it with
    :func:`joining_env`.  :class:`LeanRayError` if ``ray start`` fails or takes longer than ``timeout`` s.  Stopping
    the head (see the module docstring) and removing ``temp_dir`` are the caller's, whether or not it started."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--temp-dir", str(temp_dir),
           "--dashboard-agent-listen-port", str(agent_port)]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    _write_token(temp_dir)
    env = {**joining_env(env, temp_dir), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # `ray start --head` must not be pointed at another cluster
    try:
        done = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=preexec_fn, check=False)
    except subprocess.TimeoutExpired as err:
        out = err.stdout or ""
        raise LeanRayError(f"the lean Ray head did not start within {timeout:g} s: "
                           f"{_tail(out if isinstance(out, str) else out.decode(errors='replace'))}") from None
    if done.returncode != 0:
        out = done.stdout + done.stderr
        hint = (f"; the temp dir {temp_dir} is too long for Ray's socket paths (at most 107 bytes): set RAY_TMPDIR to "
                "a short directory such as /tmp" if "path length" in out else "")
        raise LeanRayError(f"`ray start --head` failed (exit {done.returncode}): {_tail(out)}{hint}")
    return f"127.0.0.1:{port}"


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:]) or "(no output)"


if __name__ == "__main__":
    sys.exit(_main())
