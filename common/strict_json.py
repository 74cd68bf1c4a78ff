"""Strict JSON for result files: non-finite floats are written as ``null``.

Python's :func:`json.dumps` writes the bare tokens ``NaN`` / ``Infinity`` for non-finite floats by default.
They are not JSON: jq, browsers and most parsers other than Python's refuse the whole file.  Result files
(metrics, summaries, experiment tables) hold NaN wherever a value does not exist (a failed run, the spread of a
single value), so every writer of such files goes through :func:`dumps_json`.  NumPy scalars and arrays are
converted first (``json.dumps`` would send a NumPy float to ``default`` only after its non-finite check).
"""

from __future__ import annotations

import json
import math

import numpy as np

__all__ = ["dumps_json", "json_safe"]


def json_safe(value: object) -> object:
    """``value`` with every non-finite float (in dicts, lists and tuples, NumPy scalars and arrays included)
    replaced by ``None`` and NumPy numbers turned into Python numbers."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps_json(value: object, **kw: object) -> str:
    """Strict JSON of ``value`` (non-finite floats as ``null``, see :func:`json_safe`); ``kw`` go to
    :func:`json.dumps` (``allow_nan`` is always False: a non-finite value that reached the encoder is a bug)."""
    return json.dumps(json_safe(value), allow_nan=False, **kw)
