"""The project's environment variables, read one way: on/off switches and numbers.

A switch (``PGVI_FUSED_KERNELS``, ``PGVI_KERNEL_OPENMP``, ``PGVI_EXPLICIT_STEP``, ``PGVI_FLUSH_DENORMALS``,
``PGVI_FAB_CACHE``) is unset or empty (its default) or one of ``1 true yes on`` / ``0 false no off``, in any case,
blanks around it ignored.  A number (the paced SuperNode's waits, the first object-pull retry) is unset or empty
(its default) or a float.  Anything else is a ``ValueError`` that names the variable and its value: a typo never
silently means the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"0", "false", "no", "off"})


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Switch ``name`` of ``env`` (default: ``os.environ``); unset or empty gives ``default``."""
    raw = _raw(name, env)
    if not raw:
        return default
    value = raw.lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={raw!r} must be 0 or 1 (or false/true, no/yes, off/on)")


def env_number(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """Number ``name`` of ``env`` (default: ``os.environ``); None when unset or empty.  Only the form is checked
    here (``nan`` and ``inf`` parse); the caller checks the range."""
    raw = _raw(name, env)
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


__all__ = ["OFF", "ON", "env_flag", "env_number"]
