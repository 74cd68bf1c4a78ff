"""Crash-safe files: an ``.npz`` of named arrays plus a JSON header, replaced atomically.

Write = temp file in the same directory + fsync + ``os.replace`` + directory fsync, so a reader sees either
the old file or the new one, never a torn write, even across a power cut.  Used for the client state, the
server checkpoint and a run's result files.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

_META_KEY = "__meta__"


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], mode: int = 0o600) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, fsync it, then atomically replace ``path`` with it.
    The file gets ``mode`` (default 0600: client state and checkpoints are private; result files pass 0644)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
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


def atomic_save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    header = np.frombuffer(json.dumps(meta, default=str).encode(), dtype=np.uint8)
    return atomic_write(path, lambda f: np.savez(f, **{_META_KEY: header}, **arrays))


def load_npz(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)`` of a file written by :func:`atomic_save_npz` (no pickle)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z[_META_KEY]).decode())
        arrays = {k: z[k] for k in z.files if k != _META_KEY}
    return arrays, meta
