"""Natural parameters <-> Flower ArrayRecords, with the checks an untrusted peer's arrays need.

On the wire a factor is **one** Array: every tensor's values back to back, in float32 or float64, and a layout
string (JSON ``[[name, [dim, ...]], ...]``, sent in the message's ConfigRecord under ``<record>-layout``) that
splits it again.  Flower 1.39 stores and moves every Array (and its chunk) as an object of its own, one request
per object and hop (ServerApp -> SuperLink -> SuperNode -> ClientApp and back); one Array per tensor made the
784-200-10 BNN's posterior 17 objects instead of 3.  A record without a layout is read as one Array per tensor,
keyed by name (the format before packing).

Layout, names, shapes and dtype are checked *before* the bytes are deserialised, so an oversized array is
rejected without being loaded; deserialisation uses numpy without pickle (Flower's ``Array.numpy``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from typing import TYPE_CHECKING

from common.errors import ShapeMismatchError
from common.protocol import short_repr as _short

if TYPE_CHECKING:  # the ClientApp imports this module; it must not pull in torch
    from common.families import GaussianFactor

_FLOAT_DTYPES = {"float32", "float64", "<f4", "<f8"}
#: The one key of a packed record.
PACKED_KEY = "packed"
#: Bounds on a peer's layout: its length in characters, its number of tensors and its number of scalars.
MAX_LAYOUT_CHARS = 1 << 20
MAX_TENSORS = 1 << 14
MAX_SCALARS = 1 << 31
MAX_DIMS = 32
_NATIVE_FLOATS = (np.dtype("<f4"), np.dtype("<f8"))
def layout_key(record_name: str) -> str:
    """The ConfigRecord key that carries the layout of the packed record sent under ``record_name``."""
    return f"{record_name}-layout"


def encode_arrays(arrays: Mapping[str, np.ndarray], dtype: np.dtype | str | None = None) -> tuple[ArrayRecord, str]:
    """``arrays`` packed into a record of one 1-D Array (``PACKED_KEY``), and the layout that splits it.

    All arrays must share one floating dtype (or are cast to ``dtype``)."""
    values = {k: np.asarray(v) if dtype is None else np.asarray(v).astype(dtype, copy=False) for k, v in arrays.items()}
    dtypes = {v.dtype for v in values.values()}
    if len(dtypes) > 1 or any(str(d) not in _FLOAT_DTYPES for d in dtypes):
        raise ValueError(f"encode_arrays: arrays must share one float32 or float64 dtype, got {sorted(map(str, dtypes))}")
    layout = json.dumps([[k, [int(d) for d in v.shape]] for k, v in values.items()], separators=(",", ":"))
    flat = (np.concatenate([v.reshape(-1) for v in values.values()]) if values
            else np.zeros(0, dtype=dtype or np.float32))
    return ArrayRecord({PACKED_KEY: Array(np.ascontiguousarray(flat))}), layout


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """One Array per name (the client's own state kept in its node's Context, which Flower sends as one protobuf
    rather than as separate objects)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def _parse_layout(layout: object) -> list[tuple[str, tuple[int, ...], int]]:
    """A peer's layout string, checked: names unique strings, dimensions non-negative ints, bounded sizes.
    Returns ``(name, shape, number of scalars)`` per tensor, in order."""
    if not isinstance(layout, str) or len(layout) > MAX_LAYOUT_CHARS:
        raise ShapeMismatchError("layout must be a string of at most 2^20 characters")
    try:
        entries = json.loads(layout)
    except (ValueError, RecursionError) as err:  # RecursionError: '[[[[...' nested deeper than the parser goes
        raise ShapeMismatchError(f"layout is not JSON: {_short(str(err))}") from None
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise ShapeMismatchError("layout must be a list of at most 2^14 [name, shape] entries")
    out: list[tuple[str, tuple[int, ...], int]] = []
    total = 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and len(entry[1]) <= MAX_DIMS
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_SCALARS for d in entry[1])):
            raise ShapeMismatchError(f"layout entry {_short(entry)} is not [name, [at most {MAX_DIMS} non-negative "
                                     f"ints]]")
        shape = tuple(entry[1])
        size = 1
        for d in shape:  # stop as soon as the count passes the bound: each product stays below 2^62
            size *= d
            if size >= MAX_SCALARS:
                break
        total += size
        if total >= MAX_SCALARS:
            raise ShapeMismatchError("layout describes 2^31 scalars or more")
        out.append((entry[0], shape, size))  # exact: a size past the bound has raised above
    if len({name for name, _, _ in out}) != len(out):
        raise ShapeMismatchError("layout names a tensor twice")
    return out


def _check_array_header(name: str, arr: Array, shape: tuple[int, ...]) -> None:
    """Shape, dtype and byte count from the Array's metadata, before any bytes are deserialised."""
    if tuple(arr.shape) != shape:
        raise ShapeMismatchError(f"{_short(name)} has shape {_short(tuple(arr.shape))}, expected {_short(shape)}")
    if str(arr.dtype) not in _FLOAT_DTYPES:
        raise ShapeMismatchError(f"{_short(name)} has dtype {_short(arr.dtype)}, expected float32 or float64")
    limit = math.prod(shape) * 8 + 4096  # float64 payload + .npy header
    if len(arr.data) > limit:
        raise ShapeMismatchError(f"{_short(name)} carries {len(arr.data)} bytes, more than the {limit} its shape "
                                 "allows")


def _load(name: str, arr: Array, shape: tuple[int, ...]) -> np.ndarray:
    try:
        value = arr.numpy()
    except Exception as err:  # malformed bytes: never let a peer crash the server
        raise ShapeMismatchError(f"{_short(name)} could not be decoded: {_short(str(err))}") from None
    if not isinstance(value, np.ndarray):  # np.load of a zip (.npz) payload gives an NpzFile, not an array
        close = getattr(value, "close", None)
        if callable(close):
            close()
        raise ShapeMismatchError(f"{_short(name)} decodes to a {type(value).__name__}, not an array (.npy) payload")
    if tuple(value.shape) != shape:
        raise ShapeMismatchError(f"{_short(name)} decodes to shape {_short(tuple(value.shape))}, expected "
                                 f"{_short(shape)}")
    if value.dtype not in _NATIVE_FLOATS:
        raise ShapeMismatchError(f"{_short(name)} decodes to dtype {value.dtype}, expected little-endian float32 "
                                 "or float64")
    return value


def _check_names(got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]] | None) -> None:
    if expected is None:
        return
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise ShapeMismatchError(f"array names differ: missing {_short(missing)}, unexpected {_short(extra)}")
    for k, shape in expected.items():
        if tuple(got[k]) != tuple(shape):
            raise ShapeMismatchError(f"{_short(k)} has shape {_short(tuple(got[k]))}, expected {tuple(shape)}")


def decode_arrays(record: ArrayRecord, layout: object,
                  expected: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """The named arrays of ``record``: split by ``layout`` (a packed record; a peer's value, so anything but a
    layout string is refused), or one Array per name when ``layout`` is ``None``.  With ``expected`` (name -> shape) the names and shapes must be exactly those.
    Raises ShapeMismatchError for anything malformed."""
    if layout is None:
        shapes = {k: tuple(a.shape) for k, a in record.items()}
        _check_names(shapes, expected)
        for k, arr in record.items():
            _check_array_header(k, arr, shapes[k])
        return {k: _load(k, arr, shapes[k]) for k, arr in record.items()}
    entries = _parse_layout(layout)
    _check_names({name: shape for name, shape, _ in entries}, expected)
    if set(record.keys()) != {PACKED_KEY}:
        raise ShapeMismatchError(f"a packed record holds one array '{PACKED_KEY}', got {sorted(record.keys())[:5]}")
    total = sum(n for _, _, n in entries)
    arr = record[PACKED_KEY]
    _check_array_header(PACKED_KEY, arr, (total,))
    flat = _load(PACKED_KEY, arr, (total,))
    out: dict[str, np.ndarray] = {}
    start = 0
    for name, shape, n in entries:
        out[name] = flat[start:start + n].reshape(shape)
        start += n
    return out


def factor_to_record(factor: GaussianFactor, dtype: np.dtype | str | None = None) -> tuple[ArrayRecord, str]:
    """The factor's natural parameters (e.g. ``eta1/layers.0.weight``) as a packed record and its layout."""
    return encode_arrays(factor.to_numpy(), dtype)


def record_to_factor(record: ArrayRecord, like: GaussianFactor, layout: object = None) -> GaussianFactor:
    """Decode ``record`` (packed with ``layout``, or one Array per tensor without) into a factor of ``like``'s
    layout; raises ShapeMismatchError / NonFiniteError."""
    expected = {k: tuple(v.shape) for k, v in like.params.items()}
    return like.from_numpy(decode_arrays(record, layout, expected))


def payload_bytes(factor: GaussianFactor, itemsize: int) -> int:
    """Raw size of the natural parameters at ``itemsize`` bytes per scalar (e.g. 4 for float32)."""
    return factor.numel() * itemsize
