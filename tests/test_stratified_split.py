"""Tests of common.data.stratified_split and of the scikit-learn-free ``digits`` / ``breast_cancer`` loaders:
scikit-learn (installed here) is the oracle, index for index and bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from sklearn.utils.extmath import _approximate_mode

import common.data.datasets as dsm
from common.data.datasets import load_dataset
from common.data.stratified_split import approximate_mode, stratified_split

REPO = Path(__file__).resolve().parents[1]

DIGITS_Y = load_digits(return_X_y=True)[1]
BREAST_CANCER_Y = load_breast_cancer(return_X_y=True)[1]
FRACTIONS = [0.1, 0.2, 0.25, 0.33, 0.5, 0.9]


def sklearn_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The row indices ``train_test_split(..., stratify=y, random_state=seed)`` picks, in its order."""
    return train_test_split(np.arange(len(y)), test_size=test_fraction, stratify=y, random_state=seed)


def assert_same_split(y: np.ndarray, test_fraction: float, seed: int) -> None:
    train, test = stratified_split(y, test_fraction, seed)
    ref_train, ref_test = sklearn_split(y, test_fraction, seed)
    assert train.dtype == np.int64 and test.dtype == np.int64
    np.testing.assert_array_equal(train, ref_train)
    np.testing.assert_array_equal(test, ref_test)


# ==================================================================================================
# the split against train_test_split


@pytest.mark.parametrize("labels", [DIGITS_Y, BREAST_CANCER_Y], ids=["digits", "breast_cancer"])
@pytest.mark.parametrize("test_fraction", FRACTIONS)
def test_split_of_the_embedded_labels_is_train_test_split(labels, test_fraction):
    for seed in range(31):
        assert_same_split(labels, test_fraction, seed)


@pytest.mark.parametrize("case", range(12))
def test_split_of_random_uneven_labels_is_train_test_split(case):
    rng = np.random.default_rng(case)
    n_classes = int(rng.integers(2, 9))
    sizes = 2 + rng.geometric(0.08, n_classes)  # uneven, every class >= 2
    values = np.sort(rng.choice(np.arange(-50, 1000), n_classes, replace=False))  # not 0..C-1
    y = rng.permutation(np.repeat(values, sizes))
    if case % 3 == 0:
        y = np.array([f"class-{v}" for v in y])  # string labels sort (and stratify) the same way
    compared = 0
    for test_fraction in [0.07, 0.3, 0.5, 0.66]:
        n_test = int(np.ceil(test_fraction * len(y)))
        if min(n_test, len(y) - n_test) < n_classes:
            continue
        for seed in range(8):
            assert_same_split(y, test_fraction, seed)
        compared += 1
    assert compared >= 3


def test_test_size_is_the_ceiling_of_the_float_product():
    y = np.repeat([0, 1], 50)
    assert 0.07 * 100 > 7  # 7.000000000000001
    train, test = stratified_split(y, 0.07, 0)
    assert (len(train), len(test)) == (92, 8)
    assert_same_split(y, 0.07, 0)


def test_ties_in_the_class_counts_are_broken_through_the_same_random_draws():
    # three classes of 3, 4 train points: shares 4/3 each, one extra point for one of three tied classes
    y = np.repeat([0, 1, 2], 3)
    chosen = set()
    for seed in range(40):
        assert_same_split(y, 0.5, seed)
        train, _ = stratified_split(y, 0.5, seed)
        counts = np.bincount(y[train], minlength=3)
        assert sorted(counts) == [1, 1, 2]
        chosen.add(int(np.argmax(counts)))
    assert chosen == {0, 1, 2}  # the tie really is broken at random


@pytest.mark.parametrize("counts, n_draws", [([4, 2], 3), ([5, 2], 4), ([2, 2, 2, 1], 2), ([3, 3, 3, 3, 1], 7),
                                             ([10, 7, 7, 7, 3], 11), ([1, 1, 1, 1, 1, 1], 3), ([6, 4], 10)])
@pytest.mark.parametrize("seed", [0, 1, 42])
def test_approximate_mode_is_sklearns_and_consumes_the_same_random_stream(counts, n_draws, seed):
    counts = np.array(counts)
    ours_rng, ref_rng = np.random.RandomState(seed), np.random.RandomState(seed)
    ours = approximate_mode(counts, n_draws, ours_rng)
    np.testing.assert_array_equal(ours, _approximate_mode(counts, n_draws, ref_rng))
    assert ours.sum() == n_draws and np.all(np.abs(ours - counts / counts.sum() * n_draws) < 1)
    assert ours_rng.randint(2**31) == ref_rng.randint(2**31)  # the generators are in the same state


# ==================================================================================================
# degenerate inputs: scikit-learn's errors, as ValueErrors with a clear message


@pytest.mark.parametrize("y, test_fraction, match", [
    (np.array([0, 0, 0, 1, 1, 2]), 0.5, r"at least 2 members.*\[2\]"),
    (np.repeat([0, 1, 2], 10), 0.05, r"test set of 2, fewer than the 3 classes"),
    (np.repeat([0, 1, 2], 10), 0.95, r"train set of 1, fewer than the 3 classes"),
    (np.repeat([0, 1], 3), 0.99, r"empty train set"),
])
def test_degenerate_inputs_raise_where_sklearn_raises(y, test_fraction, match):
    with pytest.raises(ValueError, match=match):
        stratified_split(y, test_fraction, 0)
    with pytest.raises(ValueError):
        sklearn_split(y, test_fraction, 0)


@pytest.mark.parametrize("test_fraction", [0.0, 1.0, -0.2])
def test_test_fraction_and_label_shape_are_guarded(test_fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        stratified_split(np.repeat([0, 1], 5), test_fraction, 0)
    with pytest.raises(ValueError, match=r"shape \(n,\)"):
        stratified_split(np.zeros((4, 2)), 0.5, 0)


def test_the_loaders_test_fraction_can_reach_the_split_errors():
    # breast_cancer has 569 points: 0.999 leaves an empty train set, 0.001 a test set of 1 < 2 classes
    with pytest.raises(ValueError, match="empty train set"):
        load_dataset("breast_cancer", test_fraction=0.999)
    with pytest.raises(ValueError, match="test set of 1, fewer than the 2 classes"):
        load_dataset("breast_cancer", test_fraction=0.001)


# ==================================================================================================
# the loaders: bit-identical to scikit-learn's loaders + train_test_split, without importing scikit-learn


def reference_digits(seed: int, test_fraction: float) -> dict[str, np.ndarray]:
    """What ``_load_digits`` computed with scikit-learn."""
    x, y = load_digits(return_X_y=True)
    y = y.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)
    return {"x_train": (x_tr / 16.0).astype(np.float32), "y_train": y_tr.astype(np.int64),
            "x_test": (x_te / 16.0).astype(np.float32), "y_test": y_te.astype(np.int64)}


def reference_breast_cancer(seed: int, test_fraction: float) -> dict[str, np.ndarray]:
    """What ``_load_breast_cancer`` computed with scikit-learn."""
    x, y = load_breast_cancer(return_X_y=True)
    x, y = x.astype(np.float64), y.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    return {"x_train": ((x_tr - mean) / std).astype(np.float32), "y_train": y_tr.astype(np.int64),
            "x_test": ((x_te - mean) / std).astype(np.float32), "y_test": y_te.astype(np.int64)}


def test_the_files_are_parsed_as_sklearns_loaders_parse_them():
    for ours, ref in ((dsm._read_digits(), load_digits(return_X_y=True)),
                      (dsm._read_breast_cancer(), load_breast_cancer(return_X_y=True))):
        for a, b in zip(ours, ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


@pytest.mark.parametrize("name, reference", [("digits", reference_digits),
                                             ("breast_cancer", reference_breast_cancer)])
@pytest.mark.parametrize("seed, test_fraction", [(0, 0.2), (1, 0.1), (7, 0.25), (13, 0.33), (30, 0.9), (5, 0.07)])
def test_loaders_are_bit_identical_to_the_sklearn_route(name, reference, seed, test_fraction):
    ds = load_dataset(name, seed=seed, test_fraction=test_fraction)
    for key, expected in reference(seed, test_fraction).items():
        got = getattr(ds, key)
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert got.tobytes() == expected.tobytes(), key


def test_the_data_folder_is_sklearns_own():
    import sklearn

    assert dsm._sklearn_data_dir() == Path(sklearn.__file__).parent / "datasets" / "data"


def test_loading_the_sklearn_sets_imports_neither_sklearn_nor_scipy():
    code = ("import importlib.util, sys; from common.data.datasets import load_dataset; "
            "assert importlib.util.find_spec('sklearn') is not None and 'sklearn' not in sys.modules; "
            "load_dataset('digits'); load_dataset('breast_cancer', seed=3, test_fraction=0.3); "
            "bad = [m for m in ('sklearn', 'scipy') if m in sys.modules]; assert not bad, bad; "
            "maps = open('/proc/self/maps').read(); assert 'scikit_learn.libs' not in maps, 'sklearn libgomp'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("name, filename", [("digits", "digits.csv.gz"), ("breast_cancer", "breast_cancer.csv")])
def test_missing_data_file_error_names_the_dataset_path_and_fix(tmp_path, monkeypatch, name, filename):
    monkeypatch.setattr(dsm, "_sklearn_data_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_dataset(name)
    message = str(err.value)
    assert message.startswith(f"{name}: data files not found.")
    assert str(tmp_path) in message and filename in message and "pip install 'pgvi[data]'" in message
    monkeypatch.setattr(dsm, "_sklearn_data_dir", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"scikit-learn is not installed.*pip install 'pgvi\[data\]'"):
        load_dataset(name)
