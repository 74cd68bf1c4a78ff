"""Crash-safe files: an ``.npz`` of named arrays plus a JSON header, replaced atomically.

Write = temp file in the same directory + fsync + ``os.replace`` + directory fsync, so a reader sees either
the old file or the new one, never a torn write, even across a power cut.  Used for the client state and the
server checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

_META_KEY = "__meta__"


def atomic_save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            header = np.frombuffer(json.dumps(meta, default=str).encode(), dtype=np.uint8)
            np.savez(f, **{_META_KEY: header}, **arrays)
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


def load_npz(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)`` of a file written by :func:`atomic_save_npz` (no pickle)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z[_META_KEY]).decode())
        arrays = {k: z[k] for k in z.files if k != _META_KEY}
    return arrays, meta
