"""The Flower release that this project's hooks into Flower's own processes were written for.

``client/preforked_superexec.py``, ``client/paced_supernode.py`` and ``client/object_pulls.py`` change how
Flower's SuperExec, SuperNode and object pulls behave inside those processes.  Each checks :func:`version_problem`
first and leaves Flower unchanged (with one warning) under any other release.
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED_FLWR = "1.39."


def version_problem() -> str | None:
    """Why the installed Flower is not the one the hooks were written for (``1.39.x``), or None."""
    try:
        version = importlib.metadata.version("flwr")
    except importlib.metadata.PackageNotFoundError:
        return "flwr is not installed"
    if not version.startswith(SUPPORTED_FLWR):
        return f"flwr {version} is not {SUPPORTED_FLWR}x"
    return None
