"""The wire codec (strategies/codec.py): packed natural-parameter records, their layouts and their checks."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import ShapeMismatchError
from common.families import MeanFieldGaussian
from strategies.codec import (
    MAX_LAYOUT_CHARS,
    PACKED_KEY,
    arrays_to_record,
    decode_arrays,
    encode_arrays,
    factor_to_record,
    layout_key,
    record_to_factor,
)

BNN_SHAPES = {"layers.0.weight": (200, 784), "layers.0.bias": (200,), "layers.1.weight": (10, 200),
              "layers.1.bias": (10,)}


def bnn_posterior() -> MeanFieldGaussian:
    g = torch.Generator().manual_seed(0)
    mean = {k: torch.randn(s, generator=g) for k, s in BNN_SHAPES.items()}
    var = {k: torch.rand(s, generator=g) + 0.1 for k, s in BNN_SHAPES.items()}
    return MeanFieldGaussian.from_mean_variance(mean, var)


def raw_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_keeps_names_shapes_values_and_order(dtype):
    rng = np.random.default_rng(1)
    arrays = {"b/w": rng.standard_normal((3, 4)), "a": rng.standard_normal(5), "scalar": np.array(2.5),
              "empty": np.zeros((0, 3)), "t3": rng.standard_normal((2, 1, 2))}
    arrays = {k: v.astype(dtype) for k, v in arrays.items()}
    record, layout = encode_arrays(arrays)
    assert list(record.keys()) == [PACKED_KEY]
    assert [name for name, _ in json.loads(layout)] == list(arrays)  # the sender's order
    out = decode_arrays(record, layout)
    assert list(out) == list(arrays)
    for k, v in arrays.items():
        assert out[k].dtype == dtype and out[k].shape == v.shape and np.array_equal(out[k], v)


def test_factor_round_trip_and_legacy_record_decode_alike():
    q = bnn_posterior()
    record, layout = factor_to_record(q)
    assert record_to_factor(record, q, layout).max_abs_diff(q) == 0.0
    assert record_to_factor(arrays_to_record(q.to_numpy()), q).max_abs_diff(q) == 0.0  # one Array per tensor


def test_a_packed_bnn_posterior_is_three_objects_instead_of_seventeen():
    """What packing is for: Flower 1.39 moves every Array and ArrayChunk as an object of its own."""
    q = bnn_posterior()
    packed, _ = factor_to_record(q)
    named = arrays_to_record(q.to_numpy())
    assert len(get_all_nested_objects(packed)) == 3
    assert len(get_all_nested_objects(named)) == 2 * len(q.params) + 1 == 17
    # the bytes: one .npy header instead of eight
    payload = q.numel() * 4
    assert packed.count_bytes() < named.count_bytes() and packed.count_bytes() - payload < 256


def test_cast_to_a_requested_dtype_and_refuse_mixed_or_integer_dtypes():
    record, layout = encode_arrays({"a": np.ones(2), "b": np.ones(3, dtype=np.float32)}, np.float32)
    assert decode_arrays(record, layout)["a"].dtype == np.float32
    with pytest.raises(ValueError, match="share one"):
        encode_arrays({"a": np.ones(2), "b": np.ones(3, dtype=np.float32)})
    with pytest.raises(ValueError, match="share one"):
        encode_arrays({"a": np.arange(3)})


@pytest.mark.parametrize(
    "layout, match",
    [
        ("not json", "not JSON"),
        ('{"a": [2]}', "list of"),
        ('[["a"]]', "is not \\[name"),
        ('[["a", 2]]', "is not \\[name"),
        ('[[1, [2]]]', "is not \\[name"),
        ('[["a", [-1]]]', "is not \\[name"),
        ('[["a", [2.0]]]', "is not \\[name"),
        ('[["a", [true]]]', "is not \\[name"),
        ('[["a", [2]], ["a", [2]]]', "twice"),
        ('[["a", [65536, 65536]]]', "2\\^31"),
        ("[" + ",".join('["x%d", [1]]' % i for i in range(20000)) + "]", "at most 2\\^14"),
        (" " * (MAX_LAYOUT_CHARS + 1), "at most 2\\^20"),
        (b'[["a", [2]]]', "must be a string"),
        ("[" * 200_000, "not JSON"),  # nested deeper than the parser recurses
        ('[["a", [' + ",".join(["2"] * 33) + "]]]", "at most 32"),
        # a shape whose product would be a 100,000-digit number is refused after one multiplication too many,
        # not after computing it (that took 9 s per reply before the bound)
        ('[["a", [' + ",".join(["2147483647"] * 32) + "]]]", "2\\^31"),
        ('[["a", [' + ",".join(["2147483647"] * 31) + ",0]]]", "2\\^31"),
    ],
)
def test_a_malformed_layout_is_a_typed_error(layout, match):
    record = ArrayRecord({PACKED_KEY: Array(np.zeros(2))})
    with pytest.raises(ShapeMismatchError, match=match):
        decode_arrays(record, layout)


def test_the_record_must_hold_exactly_the_packed_array_of_the_layouts_length():
    layout = '[["a", [2, 3]], ["b", [4]]]'
    for keys in ({"other": Array(np.zeros(10))}, {PACKED_KEY: Array(np.zeros(10)), "x": Array(np.zeros(1))}, {}):
        with pytest.raises(ShapeMismatchError, match="one array"):
            decode_arrays(ArrayRecord(keys), layout)
    for n in (9, 11):  # one scalar short or over
        with pytest.raises(ShapeMismatchError, match="shape"):
            decode_arrays(ArrayRecord({PACKED_KEY: Array(np.zeros(n))}), layout)
    assert decode_arrays(ArrayRecord({PACKED_KEY: Array(np.zeros(10))}), layout)["a"].shape == (2, 3)


def test_header_checks_come_before_the_bytes_are_loaded():
    layout = '[["a", [4]]]'
    garbage = b"\x00" * 16
    with pytest.raises(ShapeMismatchError, match="dtype"):  # integer dtype in the metadata
        decode_arrays(ArrayRecord({PACKED_KEY: raw_array("int64", (4,), garbage)}), layout)
    with pytest.raises(ShapeMismatchError, match="more than"):  # oversized payload, never parsed
        decode_arrays(ArrayRecord({PACKED_KEY: raw_array("float32", (4,), b"\x00" * (4 * 8 + 4097))}), layout)
    with pytest.raises(ShapeMismatchError, match="could not be decoded"):  # within limits but not an .npy
        decode_arrays(ArrayRecord({PACKED_KEY: raw_array("float32", (4,), garbage)}), layout)
    # metadata that lies about the payload: the decoded array is checked again
    with pytest.raises(ShapeMismatchError, match="decodes to shape"):
        decode_arrays(ArrayRecord({PACKED_KEY: raw_array("float32", (4,), npy(np.zeros(3, np.float32)))}), layout)
    with pytest.raises(ShapeMismatchError, match="decodes to dtype"):
        decode_arrays(ArrayRecord({PACKED_KEY: raw_array("float32", (4,), npy(np.zeros(4, np.int32)))}), layout)


def test_error_messages_cut_a_peers_names_and_shapes_short():
    record = ArrayRecord({PACKED_KEY: Array(np.zeros(2, np.float32))})
    with pytest.raises(ShapeMismatchError) as err:
        decode_arrays(record, json.dumps([["x" * 500_000, [2]]]), {"a": (2,)})
    assert "names differ" in str(err.value) and len(str(err.value)) < 200
    with pytest.raises(ShapeMismatchError) as err:
        decode_arrays(ArrayRecord({"x" * 500_000: raw_array("float32", (1,) * 5000, b"")}), None, None)
    assert len(str(err.value)) < 300


def test_a_big_endian_or_half_precision_payload_under_a_float32_label_is_refused():
    for value in (np.zeros(4, ">f4"), np.zeros(4, np.float16)):
        record = ArrayRecord({PACKED_KEY: raw_array("float32", (4,), npy(value))})
        with pytest.raises(ShapeMismatchError, match="decodes to dtype"):
            decode_arrays(record, '[["a", [4]]]')


def test_expected_names_and_shapes_are_checked_against_the_layout():
    q = bnn_posterior()
    record, layout = factor_to_record(q)
    entries = json.loads(layout)
    renamed = json.dumps([["eta9/x" if i == 0 else n, s] for i, (n, s) in enumerate(entries)])
    with pytest.raises(ShapeMismatchError, match="names differ"):
        record_to_factor(record, q, renamed)
    transposed = json.dumps([[n, s[::-1] if i == 0 else s] for i, (n, s) in enumerate(entries)])
    with pytest.raises(ShapeMismatchError, match="has shape"):
        record_to_factor(record, q, transposed)
    # the layout describes the sender's bytes: another order of the same tensors decodes to the same factor
    arrays = q.to_numpy()
    reordered, reordered_layout = encode_arrays(dict(reversed(list(arrays.items()))))
    assert json.loads(reordered_layout) == entries[::-1]
    assert record_to_factor(reordered, q, reordered_layout).max_abs_diff(q) == 0.0


def test_non_finite_values_are_refused_by_the_factor():
    q = bnn_posterior()
    arrays = q.to_numpy()
    arrays[next(iter(arrays))][0, 0] = np.nan
    record, layout = encode_arrays(arrays)
    with pytest.raises(Exception, match="(?i)finite"):
        record_to_factor(record, q, layout)


def test_layout_key():
    assert layout_key("delta") == "delta-layout"


names = st.text(min_size=0, max_size=6)
dims = st.one_of(st.integers(-2, 5), st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), st.none())
entries = st.one_of(st.lists(st.one_of(names, st.lists(dims, max_size=3), st.integers()), max_size=3), names,
                    st.none())
layouts = st.one_of(st.lists(entries, max_size=4).map(json.dumps), st.text(max_size=40))


@settings(max_examples=300, deadline=None)
@given(layout=layouts, n=st.integers(0, 12), dtype=st.sampled_from(["float32", "float64", "int32", "<f4", "|u1"]),
       key=st.sampled_from([PACKED_KEY, "other"]), cut=st.integers(0, 200))
def test_any_layout_and_record_decode_or_raise_the_typed_error(layout, n, dtype, key, cut):
    value = np.arange(n, dtype=np.float64 if dtype.startswith(("float64",)) else np.float32)
    data = npy(value)[: max(0, len(npy(value)) - cut) if cut < 100 else None]
    record = ArrayRecord({key: raw_array(dtype, (n,), data)})
    try:
        out = decode_arrays(record, layout)
    except ShapeMismatchError:
        return
    assert sum(v.size for v in out.values()) == n and all(v.dtype.kind == "f" for v in out.values())


@pytest.mark.parametrize("packed", [True, False])
def test_names_and_shapes_are_refused_before_any_array_is_deserialised(monkeypatch, packed):
    """The codec promises the check before deserialisation (a peer's 50-MB array must not be loaded to find out its
    shape is wrong); removing it went unnoticed because a later check refused the Delta all the same (stop-30
    audit)."""
    from strategies import codec

    arrays = {"eta1/w": np.zeros(3), "eta2/w": np.full(3, -0.5)}
    wrong = {"eta1/w": np.zeros(4), "eta2/w": np.full(4, -0.5)}
    if packed:
        record, layout = codec.encode_arrays(wrong)
    else:
        record, layout = codec.arrays_to_record(wrong), None
    monkeypatch.setattr(codec, "_load", lambda *a, **k: pytest.fail("an array was deserialised"))
    with pytest.raises(codec.ShapeMismatchError, match=r"shape \(4,\), expected \(3,\)"):
        codec.decode_arrays(record, layout, {k: v.shape for k, v in arrays.items()})
