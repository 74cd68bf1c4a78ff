"""Test helpers: read and rewrite the packed natural-parameter records of PGVI messages (strategies/codec.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Message, RecordDict

from common import protocol as P
from strategies.codec import decode_arrays, encode_arrays, layout_key


def record_arrays(msg: Message, name: str) -> dict[str, np.ndarray]:
    """The named arrays of ``msg``'s record ``name``, split by the layout its config carries (copies)."""
    layout = msg.content[P.CONFIG].get(layout_key(name))
    return {k: v.copy() for k, v in decode_arrays(msg.content[name], layout).items()}


def set_record_arrays(content: RecordDict, name: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Replace record ``name`` of a message's ``content`` with ``arrays``, packed (in float64 if their dtypes
    differ or one is not float32), and its layout in the config."""
    dtypes = {np.asarray(a).dtype for a in arrays.values()}
    dtype = np.float64 if np.dtype(np.float64) in dtypes or not all(d.kind == "f" for d in dtypes) else None
    content[name], content[P.CONFIG][layout_key(name)] = encode_arrays(arrays, dtype)
