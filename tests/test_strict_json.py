"""common.strict_json: result files are strict JSON (non-finite values as null), NumPy values included."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from common.strict_json import dumps_json, json_safe


def _strict_load(text: str) -> object:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_python_and_numpy_values_become_null():
    value = {"nan": math.nan, "inf": -math.inf, "f32": np.float32("inf"), "f64": np.float64("nan"),
             "arr": np.array([1.5, np.nan]), "nested": [(1, np.int64(2)), {"x": np.float32(0.25)}]}
    assert _strict_load(dumps_json(value)) == {"nan": None, "inf": None, "f32": None, "f64": None,
                                               "arr": [1.5, None], "nested": [[1, 2], {"x": 0.25}]}


def test_a_non_finite_value_never_reaches_the_encoder():
    # json.dumps(default=float) sends a NumPy float32 to default only after the non-finite check: with
    # allow_nan=False it raised ValueError; json_safe converts NumPy scalars first
    assert json_safe(np.float32("nan")) is None
    with pytest.raises(ValueError):
        json.dumps({"x": np.float32("nan")}, default=float, allow_nan=False)
    assert dumps_json({"x": np.float32("nan")}) == '{"x": null}'


def test_finite_values_and_keyword_arguments_pass_through():
    assert dumps_json({"b": 1.0, "a": [True, None, "s"]}, sort_keys=True) == '{"a": [true, null, "s"], "b": 1.0}'
