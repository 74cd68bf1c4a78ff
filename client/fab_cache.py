"""Install a FAB once per node, not once per message, in ClientApps forked by ``client/preforked_superexec.py``.

Flower 1.39's ``run_clientapp`` calls ``flwr.cli.install.install_from_fab(fab_bytes, skip_prompt=True)`` for
every message: it extracts the whole FAB into a temporary directory, checks every file against the FAB's
``.info/CONTENT`` manifest, and only then finds the app installed under
``$FLWR_HOME/apps/<publisher>.<name>.<version>.<hash prefix>`` and returns that directory.  For this project's FAB
(67 files, 895 kB on 2026-11-27) that was 6.7 ms of CPU per message here on 2026-11-27, against 0.57 ms with the
cache (one round of 5 calls); on 2026-11-24, when the FAB had 64 files and 624 kB, 15-40 ms against 0.5 ms
(``scripts/bench_fab_install.py``, ``docs/bench_network.md`` section 4c).

:func:`install` replaces the name ``install_from_fab`` in ``flwr.supernode.runtime.run_clientapp`` with the
function :func:`make_cached_install` builds, which first computes the SHA-256 of the FAB's bytes (Flower names the install
directory after the same digest).  If an earlier call in this node's ``FLWR_HOME`` installed exactly these bytes
(a marker file named after the full digest, kept per Flower version, holds the directory Flower returned) and that
directory is still the one Flower would use for these bytes under this ``FLWR_HOME`` and holds the app, it returns
the directory at once.  Otherwise it calls Flower's function unchanged and, when that returns, writes
the marker.  So a FAB is extracted and verified by Flower at least once per node and ``FLWR_HOME``, and the
bytes that skip it are identical, digest for digest, to bytes that passed it.

A relative ``FLWR_HOME`` (Flower takes it relative to the process's working directory, and returns a relative
install path) is made absolute against the same working directory, so the marker names one directory wherever
the process goes next; the cached function returns that absolute path (Flower's ``run_clientapp`` ignores the
value: it finds the app under ``FLWR_HOME`` itself).

A marker is written only when the install directory holds every file of the FAB at its size (read from the
FAB's zip directory, no extraction; only after Flower's own install ran: about 2 ms for this project's FAB of
66 entries at the time, against 60-70 ms for Flower's install, measured then on the shared 2-core machine).  Flower
returns an existing install directory at once, even one another process is still copying into (two ClientApps
installing the same new FAB into a shared ``FLWR_HOME``) or one an earlier install left half-written (a full
disk): such a directory is not marked, and a warning names what it lacks.  Flower then keeps using it all the
same (it checks only that the directory exists): after an interrupted install, remove the directory.

What this does not change: a FAB given as a path, an ``install_dir`` other than ``FLWR_HOME``, and every error of
Flower's install (a bad FAB is still refused by Flower's checks, and no marker is written).  Like Flower, it does
not re-check an installed directory's files.  :func:`install` checks the Flower version (1.39.x) and the name it
replaces; otherwise it logs one warning and changes nothing.  ``PGVI_FAB_CACHE=0`` turns it off (the SuperExec's
environment).
"""

from __future__ import annotations

import compileall
import hashlib
import importlib
import importlib.metadata
import io
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

from client.flower_version import version_problem
from common.atomic_io import atomic_write
from common.environment import env_flag

log = logging.getLogger("flwr")

try:  # guarded: with another Flower, install() refuses and changes nothing
    # Flower installs a FAB to <FLWR_HOME>/<APP_DIR>/<publisher>.<name>.<version>.<first FAB_HASH_TRUNCATION hex>
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION

    _FLOWER_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover - only with an incompatible Flower
    _FLOWER_IMPORT_ERROR = _err

MODULE = "flwr.supernode.runtime.run_clientapp"
NAME = "install_from_fab"
#: The markers' directory under ``FLWR_HOME``; per Flower version, one file per installed FAB, named by its full
#: SHA-256 and holding the directory Flower installed it to.
MARKER_DIR = ".pgvi-installed-fabs-v2"  # v2: the install's modules were compiled (:func:`compile_app`) before the
# marker was written; a node's markers of the version before are not trusted, so its FABs are installed (and compiled)
# once more
#: Environment variable: ``0`` / ``false`` / ``no`` / ``off`` turn the cache off.
ENV_FAB_CACHE = "PGVI_FAB_CACHE"


def enabled_from_env(env: Any = None) -> bool:
    """Whether :data:`ENV_FAB_CACHE` leaves the cache on (unset or empty: on; :func:`common.environment.env_flag`)."""
    return env_flag(ENV_FAB_CACHE, True, env)


def _marker(home: Path, flwr_version: str, digest: str) -> Path:
    return home / MARKER_DIR / flwr_version / digest


def _installed_dir(marker: Path, home: Path, digest: str) -> Path | None:
    """The directory ``marker`` names if it is the one Flower installs these bytes to under ``home``
    (``<home>/apps/<publisher>.<name>.<version>.<first 8 hex digits>``) and it still holds the app; else None."""
    try:
        text = marker.read_text()
    except (OSError, ValueError):
        return None
    installed = Path(text)
    if not text or not installed.is_absolute() or installed.parent != home / APP_DIR:
        return None
    if not installed.name.endswith("." + digest[:FAB_HASH_TRUNCATION]) or not (installed / "pyproject.toml").is_file():
        return None
    return installed


def _missing_files(fab: bytes, installed: Path) -> list[str]:
    """The FAB's files that ``installed`` lacks or holds at another size (Flower copies every file but those under
    ``.info/`` into the install directory).  A FAB that is no zip (Flower's install accepted it, so never here)
    counts as complete: the check is to keep partial copies unmarked, not to second-guess Flower."""
    try:
        entries = zipfile.ZipFile(io.BytesIO(fab)).infolist()
    except (zipfile.BadZipFile, ValueError):
        return []
    missing = []
    for info in entries:
        if info.is_dir() or info.filename.startswith(".info/"):
            continue
        try:
            size = (installed / info.filename).stat().st_size
        except OSError:
            size = -1
        if size != info.file_size:
            missing.append(info.filename)
    return missing


def compile_app(installed: Path) -> bool:
    """Write the bytecode of every module under ``installed`` to its ``__pycache__``, once, when the FAB is installed.

    Python caches a module's bytecode the first time it imports it, unless ``PYTHONDONTWRITEBYTECODE`` is set (common
    in container images; this sandbox sets it): then every ClientApp compiled the FAB's modules from source again,
    36 ms of its CPU per message here (cProfile of 40 forked ClientApps, ``docs/bench_network.md`` section 1x).
    ``py_compile`` writes the files whatever that variable says (each atomically: a concurrent import reads the old
    file or the new one), and an import reads them.  They are checked against the sources' timestamps as usual, so a
    changed source is compiled afresh.  False (logged, not raised) if a module cannot be compiled or written: the
    ClientApp then compiles it from source, as before.
    """
    try:
        ok = compileall.compile_dir(str(installed), quiet=2, workers=1)
    except (OSError, ValueError) as err:
        ok = False
        log.debug("pgvi fab cache: could not compile %s: %s", installed, err)
    if not ok:
        log.debug("pgvi fab cache: some modules under %s were not compiled; they are compiled at import", installed)
    return bool(ok)


def make_cached_install(flower_install: Any, flwr_home: Any, flwr_version: str = "unknown") -> Any:
    """``install_from_fab`` with the cache in front of ``flower_install``; ``flwr_home()`` gives ``FLWR_HOME``;
    markers are kept per ``flwr_version`` (a new Flower installs every FAB through its own checks once)."""

    def cached_install_from_fab(fab_file: Any, install_dir: Path | None = None, skip_prompt: bool = False) -> Path:
        if not isinstance(fab_file, bytes) or install_dir is not None:
            return flower_install(fab_file, install_dir=install_dir, skip_prompt=skip_prompt)
        home = Path(os.path.abspath(flwr_home()))  # a relative FLWR_HOME: against the cwd, as Flower uses it
        digest = hashlib.sha256(fab_file).hexdigest()
        marker = _marker(home, flwr_version, digest)
        installed = _installed_dir(marker, home, digest)
        if installed is not None:
            return installed
        path = Path(os.path.abspath(flower_install(fab_file, install_dir=None, skip_prompt=skip_prompt)))
        missing = _missing_files(fab_file, path)
        if missing:  # another process is still copying into it, or an earlier install was cut short
            log.warning("pgvi fab cache: %s lacks %d of the FAB's files (e.g. %s): an install still running in "
                        "another process, or an interrupted one (then remove the directory); not cached",
                        path, len(missing), missing[0])
            return path
        compile_app(path)
        try:  # temp file + fsync + rename: a concurrent ClientApp, or one after a power loss, never reads a torn marker
            atomic_write(marker, lambda f: f.write(str(path).encode()))
        except OSError as err:  # no marker: the next message installs through Flower again
            log.debug("pgvi fab cache: could not write %s: %s", marker, err)
        return path

    cached_install_from_fab.pgvi_fab_cache = True  # type: ignore[attr-defined]
    return cached_install_from_fab


def install() -> bool:
    """Put :func:`make_cached_install`'s function in place of ``install_from_fab`` in Flower's ``run_clientapp``
    module (this process only).  False, with one warning, if this Flower is not the one it was written for."""
    problem = version_problem()
    if problem is None and _FLOWER_IMPORT_ERROR is not None:
        problem = f"flwr.common.constant lacks APP_DIR / FAB_HASH_TRUNCATION ({_FLOWER_IMPORT_ERROR})"
    if problem is None:
        try:
            module = importlib.import_module(MODULE)
            current = getattr(module, NAME)
            from flwr.supercore.utils import get_flwr_home
        except (ImportError, AttributeError) as err:
            problem = f"{MODULE}.{NAME} not found ({err})"
    if problem is not None:
        log.warning("pgvi fab cache: %s; FABs are installed by Flower for every message", problem)
        return False
    if not getattr(current, "pgvi_fab_cache", False):
        setattr(module, NAME, make_cached_install(current, get_flwr_home, importlib.metadata.version("flwr")))
    return True
