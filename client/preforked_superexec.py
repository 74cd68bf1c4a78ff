"""A drop-in ``flower-superexec`` that forks ClientApps from a warm forkserver instead of exec-ing them.

Flower 1.39 runs every message in a new ``flwr-clientapp`` OS process: a fresh interpreter that first
imports ``flwr.supernode.cli`` (about 1 CPU-second, most of it the SuperNode's database and web stack),
then runs the ClientApp.  With ``--isolation process`` it is a separate ``flower-superexec`` process that
starts them: it polls the SuperNode's Runtime API (``AcquireTask``) and hands each task to an *executor*
(``SubprocessExecutor``: ``Popen([flwr-clientapp, --runtime-api-address, ..., --token, ...])``).

``python -m client.preforked_superexec <flower-superexec arguments>`` runs Flower's own
``flower_superexec()`` (same arguments, same polling loop, same logs) with one change: the executor is a
:class:`PreforkedExecutor`.  For ``TaskType.CLIENT_APP`` it builds exactly the argument list
``SubprocessExecutor`` would build and runs the same entry function, ``flwr.supernode.cli:flwr_clientapp``,
with that ``sys.argv``, in a child forked from a multiprocessing *forkserver* that has already imported
``flwr.supernode.cli``, ``flwr.supernode.runtime.run_clientapp`` and the third-party modules they pull in
(numpy, pydantic, grpc, httpx).  A fork costs milliseconds instead of the import.

- The forkserver is a fresh interpreter started once (``multiprocessing`` ``forkserver`` context); the
  SuperExec itself is never forked (it runs threads: the HTTP client, the parent monitor).  torch is not
  preloaded (``client/app.py`` does not import it; a ClientApp that computes in-process imports it itself).
- Nothing of this project is preloaded: the ClientApp is imported from the FAB that Flower installs, as in
  ``flwr-clientapp``.  ``multiprocessing`` imports this module in the child to find the child's function;
  the child removes this package from ``sys.modules`` again before it runs the entry function, so the
  FAB's ``client`` package is the one ``load_app`` imports.
- The child closes the forkserver's and the resource tracker's inherited pipe ends and starts like a
  fresh ``flwr-clientapp``: same argv, environment, working directory, stdin (/dev/null; Deployment gives
  the SuperExec the same), stdout/stderr (the SuperExec's, or /dev/null if ``spec.suppress_output``).
  It gets ``--parent-pid <SuperExec pid>`` like any ClientApp, so it exits when the SuperExec dies.
- Other task types (ServerApp, ...) go to the normal subprocess launch.  If the forkserver cannot start,
  or a fork request fails before it reached the forkserver (connecting, passing it the pipe fds), that task
  is launched as a subprocess with one WARNING (no task is lost).  A failure *after* that (the forkserver
  died between its fork and its pid reply, a pipe broke) may leave a child that already has the task and
  runs it: a subprocess with the same token would run it twice (and in Flower 1.39 the loser's exit marks
  the task failed and revokes the token, losing the working child's reply), so that launch returns
  Flower's ambiguous outcome, ``LaunchResult.unknown`` (Flower's task expiry handles a task nobody runs),
  with one WARNING, and the next launch re-checks the forkserver (restarted if it died).  After
  :data:`MAX_CONSECUTIVE_FAILURES` failed fork requests in a row every later task is a subprocess.
- ``reconcile()`` (called by Flower's loop before every poll) drops the records of finished children (the
  forkserver reaps them, so there are no zombies); ``close()`` never waits for running children.

Installation into Flower: :func:`install` replaces the module-level name
``flwr.supercore.superexec.run_superexec.get_executor`` (looked up by ``run_superexec`` at call time) with
a function that returns a :class:`PreforkedExecutor` for ``ExecutorType.SUBPROCESS`` and delegates every
other executor type to Flower's.  It checks the Flower version (1.39.x) and every attribute it relies on;
if one is missing it logs one warning and :func:`main` runs plain ``flower_superexec()``.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from client import fab_cache, object_pulls
from client.flower_version import version_problem

log = logging.getLogger("flwr")  # Flower's logger: same handler and format as the SuperExec's own lines

#: The console script ``flwr-clientapp`` (flwr's entry_points.txt).
CLIENTAPP_ENTRY = "flwr.supernode.cli:flwr_clientapp"
#: Imported once in the forkserver.  ``flwr.supernode.cli`` already imports numpy, pydantic, grpc and httpx;
#: they are listed so that a change in Flower's imports does not silently make every fork import them.
#: (A name that fails to import is skipped by the forkserver.)
PRELOAD: tuple[str, ...] = (
    "flwr.supernode.cli",
    "flwr.supernode.runtime.run_clientapp",
    "numpy",
    "pydantic",
    "grpc",
    "httpx",
    "httpcore",  # httpx imports it (and h11) only when the first HTTP client is made: 18 ms in every ClientApp
    # what the child itself imports to unpickle its function (this module's Flower imports)
    "flwr.supercore.superexec.executor",
)
#: After this many failed fork requests in a row, every later ClientApp is started as a subprocess.
MAX_CONSECUTIVE_FAILURES = 3
#: The project's top-level packages, those the FAB and the wheel carry (``[tool.hatch.build.targets.wheel]
#: packages`` in pyproject.toml): removed from ``sys.modules`` in the child, see :func:`_forget_own_packages`.  A
#: fixed list, not "every package beside ``client/``": installed, that directory is site-packages, and the child
#: dropped flwr, numpy and grpc too, whose re-import numpy refuses ("cannot load module more than once").
_OWN_PACKAGES = frozenset({"client", "common", "server", "strategies"})

try:  # guarded: with another Flower, main() still runs plain flower_superexec()
    from flwr.supercore.constant import (
        TASK_TYPE_TO_APPIO_API_ADDRESS_ARG,
        TASK_TYPE_TO_COMMAND,
        ExecutorType,
        TaskType,
    )
    from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult, SubprocessExecutor

    _FLOWER_IMPORT_ERROR: BaseException | None = None
except ImportError as _err:  # pragma: no cover - only with an incompatible Flower
    _FLOWER_IMPORT_ERROR = _err
    SubprocessExecutor = object  # type: ignore[assignment,misc]


# ============================================================================================ the argv


def clientapp_argv(spec: ExecutionSpec) -> list[str]:
    """The argument list ``SubprocessExecutor.launch`` (Flower 1.39) builds for ``spec``."""
    args = [
        TASK_TYPE_TO_COMMAND[spec.task_type],
        TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[spec.task_type],
        spec.runtime_api_address,
        "--token",
        spec.token,
    ]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args.extend(["--root-certificates", spec.root_certificates_path])
    if spec.parent_pid is not None:
        args.extend(["--parent-pid", str(spec.parent_pid)])
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


# ============================================================================================ the child


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _detach_from_forkserver() -> None:
    """Close the pipe ends a forkserver child inherits (the forkserver's 'alive' pipe, the resource
    tracker's), so that the forkserver's and the tracker's lifetimes are the SuperExec's, not the
    ClientApps'; a ClientApp that uses multiprocessing itself starts its own, like a fresh process."""
    from multiprocessing import forkserver, resource_tracker

    fs = getattr(forkserver, "_forkserver", None)
    fd = getattr(fs, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        fs._forkserver_alive_fd = None  # type: ignore[union-attr]
    if fs is not None:
        fs._forkserver_address = None
        fs._forkserver_pid = None
        fs._inherited_fds = None
    rt = getattr(resource_tracker, "_resource_tracker", None)
    fd = getattr(rt, "_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        rt._fd = None  # type: ignore[union-attr]
        rt._pid = None  # type: ignore[union-attr]


def _forget_own_packages() -> None:
    """Drop this project's packages, imported only to unpickle the child's function (``client``, and the parts of
    ``common`` that ``client.fab_cache`` and ``client.object_pulls`` import), from ``sys.modules``: ``flwr``'s
    ``load_app`` must import the ClientApp *and everything it imports* from the FAB directory it puts first on
    ``sys.path`` (as in ``flwr-clientapp``), not find the SuperExec's copies already imported; a kept ``common``
    made the FAB's ``client.app`` run with the checkout's protocol, state and config code.  The functions already
    patched into Flower keep their own modules' globals."""
    for name in [n for n in sys.modules if n.split(".")[0] in _OWN_PACKAGES]:
        del sys.modules[name]


def _fresh_main_module() -> None:
    """Give the child a bare ``__main__`` (no file, no spec), as an interpreter whose main module cannot be
    re-imported has.  The forkserver's ``__main__`` is the SuperExec's (``python -m client.preforked_superexec``);
    left in place, a ClientApp that starts ``spawn`` or ``forkserver`` processes (a DataLoader's workers, say)
    would have each of them re-import that module, which the FAB's ``client`` package need not contain."""
    import types

    sys.modules.pop("__mp_main__", None)
    sys.modules["__main__"] = types.ModuleType("__main__")


def _child_main(entry: str, argv: Sequence[str], suppress_output: bool, initial_retry: float | None = None,
                cache_fab: bool = False) -> None:
    """Runs in the forked child: become ``argv[0]`` with ``argv`` and call ``entry`` (``module:function``).
    ``initial_retry``: Flower's first retry of an object not there yet, in seconds (``client/object_pulls.py``;
    None: Flower's).  ``cache_fab``: install the FAB once per node (``client/fab_cache.py``).  The exit handlers
    (``atexit``) run at the end, as at a fresh interpreter's exit; the forkserver ends its children with
    ``os._exit``, which would skip them."""
    import atexit

    if initial_retry is not None:
        object_pulls.set_initial_retry(initial_retry)
    if cache_fab:
        fab_cache.install()
    _detach_from_forkserver()
    _forget_own_packages()
    _fresh_main_module()
    if suppress_output:
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
    sys.argv = list(argv)
    try:
        _resolve(entry)()
    finally:
        atexit._run_exitfuncs()


# ============================================================================================ forkserver


def _stop_helper_process(obj: Any, fd_attr: str, pid_attr: str, timeout: float) -> None:
    """Stop a multiprocessing helper (forkserver / resource tracker) we own: close our end of its 'alive'
    pipe, wait up to ``timeout`` for it to exit, then SIGKILL it.  Never blocks longer than that."""
    fd, pid = getattr(obj, fd_attr, None), getattr(obj, pid_attr, None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        setattr(obj, fd_attr, None)
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    except (ChildProcessError, ProcessLookupError):
        pass
    setattr(obj, pid_attr, None)


def stop_forkserver(timeout: float = 5.0) -> None:
    """Stop this process's multiprocessing forkserver (if it runs).  Its running children keep running.

    Flower calls ``close()`` from its SIGTERM handler, which may interrupt a fork request that holds the
    forkserver's lock: then (lock not free within 1 s) nothing is done, and the forkserver exits by itself
    when this process does (its 'alive' pipe closes)."""
    from multiprocessing import forkserver

    fs = getattr(forkserver, "_forkserver", None)
    if fs is None or getattr(fs, "_forkserver_pid", None) is None:
        return
    if not fs._lock.acquire(timeout=1.0):
        return
    try:
        _stop_helper_process(fs, "_forkserver_alive_fd", "_forkserver_pid", timeout)
        fs._forkserver_address = None  # Linux: an abstract socket, nothing to unlink
    finally:
        fs._lock.release()


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)


def _stop_resource_tracker(timeout: float = 5.0) -> None:
    from multiprocessing import resource_tracker

    rt = getattr(resource_tracker, "_resource_tracker", None)
    if rt is None or getattr(rt, "_pid", None) is None or not rt._lock.acquire(timeout=1.0):
        return
    try:
        _stop_helper_process(rt, "_fd", "_pid", timeout)
    finally:
        rt._lock.release()


def _untrack(proc: multiprocessing.process.BaseProcess) -> None:
    """Take ``proc`` out of multiprocessing's list of this process's children: its atexit handler joins
    every non-daemon child, which would keep a stopping SuperExec waiting for its running ClientApps (they
    exit by themselves once the SuperExec is gone: ``--parent-pid``).  :meth:`PreforkedExecutor.reconcile`
    tracks them instead."""
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.discard(proc)


# ============================================================================================ the fork request


class ForkRequestSent(Exception):
    """A fork request failed after it reached the forkserver (``__cause__``: the error): the forkserver may have
    forked a child that has its job and runs it, so the task must not be started a second time."""


try:  # Linux/macOS: the forkserver start method
    from multiprocessing import popen_forkserver as _popen_forkserver
    from multiprocessing.context import ForkServerProcess as _ForkServerProcess
except ImportError:  # pragma: no cover - no forkserver here: start_forkserver() fails, every task is a subprocess
    _popen_forkserver = None  # type: ignore[assignment]
    _ForkServerProcess = object  # type: ignore[assignment,misc]


if _popen_forkserver is not None:

    class _PhasedPopen(_popen_forkserver.Popen):  # type: ignore[misc,name-defined]
        """``popen_forkserver.Popen`` that tells a failure before the fork request reached the forkserver
        (pickling the job, connecting, passing the fds: re-raised as is) from one after it (writing the job to
        the child's pipe, reading its pid back: raised as :class:`ForkRequestSent`).  ``_launch`` sets
        ``self.sentinel`` from ``forkserver.connect_to_new_process`` exactly when the request was sent."""

        def _launch(self, process_obj: Any) -> None:
            try:
                super()._launch(process_obj)
            except Exception as err:
                if getattr(self, "sentinel", None) is not None:
                    raise ForkRequestSent(f"{type(err).__name__}: {err}") from err
                raise


class _PhasedForkServerProcess(_ForkServerProcess):  # type: ignore[misc,valid-type]
    """The forkserver context's ``Process``, started by :class:`_PhasedPopen`."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _PhasedPopen(process_obj)


# ============================================================================================ the executor


class PreforkedExecutor(SubprocessExecutor):  # type: ignore[misc,valid-type]
    """``SubprocessExecutor`` whose CLIENT_APP launches are forks of a warm forkserver (see module doc).

    ``entry`` is the function the child calls (``module:function``; tests pass their own), ``preload`` the
    forkserver's imports.  ``start=False`` defers starting the forkserver to the first CLIENT_APP launch.
    ``initial_retry`` (seconds, None = Flower's 1 s) is set in every forked ClientApp by
    ``client.object_pulls.set_initial_retry``: how soon it asks its SuperNode again for an object of the
    message that the SuperNode is still receiving.  A ClientApp started by the subprocess fallback keeps
    Flower's 1 s.  ``cache_fab``: every forked ClientApp installs the FAB through ``client.fab_cache`` (once
    per node instead of once per message); the subprocess fallback keeps Flower's install.
    """

    def __init__(self, *, entry: str = CLIENTAPP_ENTRY, preload: Sequence[str] = PRELOAD, start: bool = True,
                 initial_retry: float | None = None, cache_fab: bool = True) -> None:
        super().__init__()
        self.entry = entry
        self.cache_fab = bool(cache_fab)
        if initial_retry is not None:  # a bad value would raise in every child before its ClientApp runs
            initial_retry = object_pulls.check_initial_retry(initial_retry, "initial_retry")
        self.initial_retry = initial_retry
        self.preload = list(preload)
        self.children: list[multiprocessing.process.BaseProcess] = []
        self.forked = 0  # ClientApps started by a fork
        self.fallbacks = 0  # ClientApps started as a subprocess after a fork request failed before it was sent
        self.unknown = 0  # launches that failed after the fork request was sent (LaunchResult.unknown)
        self._ctx: Any = None
        self._started = False  # this executor started (or used) the forkserver: close() stops it
        self._failures = 0
        self._disabled: str | None = None
        self._owns_tracker = False
        if start:
            self.start_forkserver()

    # ------------------------------------------------------------------------------------ forkserver
    def start_forkserver(self) -> bool:
        """Start the forkserver (the preload runs in it, concurrently).  False (and one WARNING) if it
        cannot start: every ClientApp is then a subprocess."""
        if self._disabled is not None:
            return False
        if self._ctx is not None:
            return True
        try:
            from multiprocessing import forkserver

            tracker_before = _resource_tracker_pid()
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(self.preload)
            forkserver.ensure_running()
            self._owns_tracker = self._owns_tracker or (tracker_before is None and _resource_tracker_pid() is not None)
        except Exception as err:  # noqa: BLE001 - any failure: Flower's subprocess launch instead
            self._disabled = f"{type(err).__name__}: {err}"
            log.warning("pgvi-superexec: the ClientApp forkserver could not start (%s); every ClientApp "
                        "is started as a subprocess (flwr-clientapp)", self._disabled)
            return False
        self._ctx = ctx
        self._started = True
        pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
        log.info("pgvi-superexec: ClientApps are forked from a forkserver (pid %s) that preloads %s",
                 pid, ", ".join(self.preload))
        return True

    @property
    def active(self) -> bool:
        """Whether CLIENT_APP tasks are (still) forked."""
        return self._disabled is None

    # ------------------------------------------------------------------------------------ executor protocol
    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        if spec.task_type != TaskType.CLIENT_APP or not self.start_forkserver():
            return super().launch(spec)
        argv = clientapp_argv(spec)
        try:
            proc = _PhasedForkServerProcess(
                target=_child_main,
                args=(self.entry, argv, bool(spec.suppress_output), self.initial_retry, self.cache_fab),
                name=f"flwr-clientapp-task-{spec.task_id}",
                daemon=False,  # a daemonic process could not start processes of its own
            )
            proc.start()
        except ForkRequestSent as err:  # a child may run the task: never start it a second time
            self._failed_fork(err)
            self.unknown += 1
            self._ctx = None  # the next launch re-checks the forkserver (ensure_running restarts a dead one)
            message = (f"the fork request for task_id {spec.task_id} reached the ClientApp forkserver but then "
                       f"failed ({err}): a forked ClientApp may be running it")
            log.warning(
                "pgvi-superexec: %s; not started as a subprocess (it would run twice with the same token); "
                "launch outcome unknown%s", message,
                "; forking is now off for this SuperExec" if self._disabled else "",
            )  # fmt: skip
            return LaunchResult.unknown(message)
        except Exception as err:  # noqa: BLE001 - before the fork request was sent: start it the normal way
            self._failed_fork(err)
            self.fallbacks += 1
            log.warning(
                "pgvi-superexec: forking the ClientApp for task_id %d failed (%s: %s) before the forkserver got "
                "the request; starting it as a subprocess%s", spec.task_id, type(err).__name__, err,
                "; forking is now off for this SuperExec" if self._disabled else "",
            )  # fmt: skip
            return super().launch(spec)
        self._failures = 0
        self.forked += 1
        _untrack(proc)
        self.children.append(proc)
        return LaunchResult.accepted()

    def _failed_fork(self, err: Exception) -> None:
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._disabled = f"{self._failures} failed forks in a row, the last {type(err).__name__}: {err}"

    def reconcile(self) -> None:
        """Forget the children that have exited (the forkserver reaped them) and release their pipes."""
        running = []
        for proc in self.children:
            try:
                done = proc.exitcode is not None
            except ValueError:  # already closed
                continue
            if done:
                proc.close()
            else:
                running.append(proc)
        self.children = running
        super().reconcile()

    def close(self) -> None:
        """Release what the executor owns without waiting for running ClientApps (they exit by themselves
        when the SuperExec is gone): stop the forkserver (bounded wait) and, if we started it, the
        multiprocessing resource tracker."""
        self.reconcile()
        self.children = []  # running ones: their pipes close when the objects go
        if self._started:  # also after a failed fork request reset _ctx
            stop_forkserver()
            if self._owns_tracker:
                _stop_resource_tracker()
            self._ctx = None
            self._started = False
        super().close()


# ============================================================================================ Flower hook


def incompatibility() -> str | None:
    """Why :func:`install` cannot patch this Flower, or None."""
    if _FLOWER_IMPORT_ERROR is not None:
        return f"cannot import Flower's executor API ({_FLOWER_IMPORT_ERROR})"
    if (problem := version_problem()) is not None:
        return problem
    try:
        rs = importlib.import_module("flwr.supercore.superexec.run_superexec")
        cli = importlib.import_module("flwr.supercore.cli")
        entry = _resolve(CLIENTAPP_ENTRY)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    missing = [name for obj, name in ((rs, "get_executor"), (rs, "run_superexec"), (cli, "flower_superexec"),
                                      (SubprocessExecutor, "launch"), (SubprocessExecutor, "reconcile"))
               if not callable(getattr(obj, name, None))]  # fmt: skip
    if missing:
        return f"Flower lacks {', '.join(missing)}"
    if not callable(entry) or TASK_TYPE_TO_COMMAND.get(TaskType.CLIENT_APP) != "flwr-clientapp":
        return "Flower's ClientApp command is not flwr-clientapp"
    return None


def install(initial_retry: float | None = None, cache_fab: bool = True) -> bool:
    """Make Flower's ``run_superexec`` use a :class:`PreforkedExecutor` (with ``initial_retry`` and ``cache_fab``)
    for the subprocess executor.  False (after one WARNING) if this Flower is not the one this was written for;
    nothing is changed then."""
    problem = incompatibility()
    if problem is not None:
        log.warning("pgvi-superexec: %s; running Flower's SuperExec unchanged (a new flwr-clientapp "
                    "process per message)", problem)
        return False
    rs = importlib.import_module("flwr.supercore.superexec.run_superexec")
    original = rs.get_executor
    if getattr(original, "_pgvi_preforked", False):
        return True

    def get_executor(executor_type: Any, executor_config: Any = None, *, insecure: bool = False,
                     root_certificates_path: str | None = None) -> Any:
        if executor_type == ExecutorType.SUBPROCESS and executor_config is None:
            return PreforkedExecutor(initial_retry=initial_retry, cache_fab=cache_fab)
        return original(executor_type, executor_config, insecure=insecure,
                        root_certificates_path=root_certificates_path)

    get_executor._pgvi_preforked = True  # type: ignore[attr-defined]
    get_executor._pgvi_original = original  # type: ignore[attr-defined]
    rs.get_executor = get_executor
    return True


def main() -> None:
    """``flower-superexec`` (same arguments), with forked ClientApps when this Flower allows it; their first
    retry of an object not there yet is ``$PGVI_OBJECT_PULL_RETRY_S`` (default 0.05 s, ``client/object_pulls.py``);
    they install the FAB once per node unless ``$PGVI_FAB_CACHE`` is 0 (``client/fab_cache.py``)."""
    try:
        initial_retry = object_pulls.initial_retry_from_env()
        cache_fab = fab_cache.enabled_from_env()
    except ValueError as err:
        print(f"pgvi-superexec: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    install(initial_retry, cache_fab)
    from flwr.supercore.cli import flower_superexec

    flower_superexec()


if __name__ == "__main__":
    main()
