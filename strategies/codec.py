"""Natural parameters <-> Flower ArrayRecords, with the checks an untrusted peer's arrays need.

Shapes and dtypes are checked from the Array metadata *before* the bytes are deserialised, so an oversized
array is rejected without being loaded; deserialisation uses numpy without pickle (Flower's ``Array.numpy``).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

from typing import TYPE_CHECKING

from common.errors import ShapeMismatchError

if TYPE_CHECKING:  # the ClientApp imports this module; it must not pull in torch
    from common.families import GaussianFactor

_FLOAT_DTYPES = {"float32", "float64", "<f4", "<f8"}


def factor_to_record(factor: GaussianFactor, dtype: np.dtype | str | None = None) -> ArrayRecord:
    """One Array per natural-parameter tensor, keyed by its name (e.g. ``eta1/layers.0.weight``)."""
    arrays = factor.to_numpy()
    if dtype is not None:
        arrays = {k: v.astype(dtype, copy=False) for k, v in arrays.items()}
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def arrays_to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def record_to_factor(record: ArrayRecord, like: GaussianFactor) -> GaussianFactor:
    """Decode ``record`` into a factor of ``like``'s layout; raises ShapeMismatchError / NonFiniteError."""
    expected = {k: tuple(v.shape) for k, v in like.params.items()}
    got = set(record.keys())
    if got != set(expected):
        missing, extra = sorted(set(expected) - got), sorted(got - set(expected))
        raise ShapeMismatchError(f"array names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    arrays = {}
    for k, shape in expected.items():
        arr = record[k]
        if tuple(arr.shape) != shape:
            raise ShapeMismatchError(f"'{k}' has shape {tuple(arr.shape)}, expected {shape}")
        if str(arr.dtype) not in _FLOAT_DTYPES:
            raise ShapeMismatchError(f"'{k}' has dtype {arr.dtype!r}, expected float32 or float64")
        limit = int(np.prod(shape, dtype=np.int64)) * 8 + 4096  # float64 payload + .npy header
        if len(arr.data) > limit:
            raise ShapeMismatchError(f"'{k}' carries {len(arr.data)} bytes, more than the {limit} its shape allows")
        try:
            value = arr.numpy()
        except Exception as err:  # malformed bytes: never let a peer crash the server
            raise ShapeMismatchError(f"'{k}' could not be decoded: {err}") from None
        if tuple(value.shape) != shape:
            raise ShapeMismatchError(f"'{k}' decodes to shape {tuple(value.shape)}, expected {shape}")
        arrays[k] = value
    return like.from_numpy(arrays)


def payload_bytes(factor: GaussianFactor, itemsize: int) -> int:
    """Raw size of the natural parameters at ``itemsize`` bytes per scalar (e.g. 4 for float32)."""
    return factor.numel() * itemsize
