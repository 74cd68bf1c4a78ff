"""Removing a directory that processes may still be writing into (deploy.py, simulate.py, fault_suite.py).

A process that is being stopped may still create files in a directory being removed: Ray's driver writes its logs
into the head's session dir until it exits, a ClientApp saves its state with a temporary file and a rename.  One
``shutil.rmtree`` then fails on a directory that is no longer empty ("Directory not empty"), and with
``ignore_errors=True`` the failure is silent and the directory stays.  :func:`remove_tree` retries instead.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

__all__ = ["REMOVE_TREE_TIMEOUT_S", "remove_tree"]

#: Seconds :func:`remove_tree` keeps retrying a directory that something keeps non-empty.
REMOVE_TREE_TIMEOUT_S = 10.0


def remove_tree(path: str | os.PathLike[str], timeout: float = REMOVE_TREE_TIMEOUT_S, interval: float = 0.1) -> None:
    """Remove ``path`` and everything under it; a ``path`` that does not exist is not an error.  An attempt that
    fails (a file made or removed by another process while it ran) is repeated every ``interval`` s; the last
    attempt's ``OSError`` is raised once ``timeout`` s have passed."""
    if timeout < 0 or interval <= 0:
        raise ValueError(f"remove_tree: timeout must be >= 0 and interval > 0, got {timeout} and {interval}")
    path = Path(path)
    end = time.monotonic() + timeout
    while True:
        try:
            shutil.rmtree(path)
            return
        except OSError:
            if not os.path.lexists(path):
                return
            if time.monotonic() >= end:
                raise
        time.sleep(interval)
