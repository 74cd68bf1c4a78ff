"""Crash-safe files: an ``.npz`` of named arrays plus a JSON header, replaced atomically.

Write = temp file in the same directory + fsync + ``os.replace`` + directory fsync, so a reader sees either
the old file or the new one, never a torn write, even across a power cut.  Used for the client state, the
server checkpoint and a run's result files.  A process killed mid-write leaves its temp file behind
(:func:`stale_temp_files`; the server removes its checkpoint's when a strategy starts).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

_META_KEY = "__meta__"
#: ``tempfile.mkstemp``'s random part of a temp file's name (8 of these characters, CPython 3.x)
_TEMP_RANDOM = r"[a-z0-9_]{8}"


#: Age (s) below which another writer's temp file is presumed in progress and kept by the clean-ups of a run's
#: start (result files, client state, the checkpoint a run resumes from): a write takes about a second per 100 MB.
STALE_TEMP_MIN_AGE_S = 600.0


def _temp_affixes(path: Path) -> tuple[str, str]:
    """``(prefix, suffix)`` of the temp files :func:`atomic_write` creates for ``path``."""
    return f".{path.stem}.", ".tmp"


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` can only be read by setting it, a race with
    other threads creating files); 0 where ``/proc`` does not say (Linux < 4.7, other systems)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], mode: int = 0o600) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, fsync it, then atomically replace ``path`` with it.
    The file gets ``mode`` less the umask, as a file ``open`` creates (default 0600: client state and checkpoints
    are private; result files pass 0644, so under umask 077 they are private too, as metrics.jsonl is)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix, suffix = _temp_affixes(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(fd, mode & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """The temp files :func:`atomic_write` left beside ``path`` when its process was killed mid-write (a temp file
    is removed on any exception, but not on SIGKILL or a power cut): the regular files named exactly as it names
    them for ``path`` (``.<stem>.<8 random characters>.tmp``; another target with the same stem, e.g. ``x.json``
    beside ``x.npz``, shares the pattern).  Only safe to delete while no process is writing ``path``."""
    path = Path(path)
    prefix, suffix = _temp_affixes(path)
    pattern = re.compile(re.escape(prefix) + _TEMP_RANDOM + re.escape(suffix))
    try:
        names = os.listdir(path.parent)
    except (FileNotFoundError, NotADirectoryError):  # nothing written there yet
        return []
    return sorted(path.parent / n for n in names
                  if pattern.fullmatch(n) and (path.parent / n).is_file() and not (path.parent / n).is_symlink())


def remove_stale_temp_files(path: str | os.PathLike, min_age_s: float = 0.0) -> tuple[int, int]:
    """Delete :func:`stale_temp_files` of ``path`` last modified at least ``min_age_s`` seconds ago (a write in
    progress keeps its temp file's modification time fresh: a positive age spares another process's write);
    ``(files removed, their bytes)``.  A file that vanished or cannot be removed meanwhile is skipped."""
    removed = size = 0
    now = time.time()
    for tmp in stale_temp_files(path):
        try:
            st = tmp.stat()
            if now - st.st_mtime < min_age_s:
                continue
            n = st.st_size
            tmp.unlink()
        except OSError:
            continue
        removed, size = removed + 1, size + n
    return removed, size


def atomic_save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    header = np.frombuffer(json.dumps(meta, default=str).encode(), dtype=np.uint8)
    return atomic_write(path, lambda f: np.savez(f, **{_META_KEY: header}, **arrays))


def load_npz(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)`` of a file written by :func:`atomic_save_npz` (no pickle)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z[_META_KEY]).decode())
        arrays = {k: z[k] for k in z.files if k != _META_KEY}
    return arrays, meta
