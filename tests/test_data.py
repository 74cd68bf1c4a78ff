"""Tests of common.data: dataset loaders (offline, with small files in the real formats), partitioners,
label contamination and the synthetic data-generating processes."""

from __future__ import annotations

import gzip
import math
import os
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import common.data.datasets as dsm
from common.data import (
    Dataset,
    apportion,
    class_map_flip,
    clutter_1d,
    conjugate_linear_regression,
    label_counts,
    load_dataset,
    logistic_2d_with_outliers,
    partition,
    partitioner_names,
    random_flip,
    read_idx,
    student_t_location,
)

REPO = Path(__file__).resolve().parents[1]

# ==================================================================================================
# fixture writers: the real on-disk formats, written byte by byte (independently of the readers)

_IDX_CODES = {np.dtype("uint8"): 0x08, np.dtype("int8"): 0x09, np.dtype("int16"): 0x0B,
              np.dtype("int32"): 0x0C, np.dtype("float32"): 0x0D, np.dtype("float64"): 0x0E}


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    """IDX: 0x00 0x00, type code, ndim, big-endian uint32 dims, big-endian data."""
    array = np.asarray(array)
    header = bytes([0, 0, _IDX_CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def make_mnist_like(directory: Path, gz: bool, n_train: int = 12, n_test: int = 5, seed: int = 0,
                    mixed: bool = False) -> dict[str, np.ndarray]:
    """The four MNIST-family files (train/t10k images idx3 and labels idx1) in ``directory``."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test).astype(np.uint8),
    }
    arrays["train-images-idx3-ubyte"][0, 0, :3] = [0, 255, 128]  # known corner values
    for i, (stem, arr) in enumerate(arrays.items()):
        write_idx(directory / stem, arr, gz=(gz if not mixed else i % 2 == 0))
    return arrays


def make_cifar(directory: Path, per_batch: int = 4, n_test: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """CIFAR-10 python batches with the real keys (data (N, 3072) uint8 channel-major, labels list)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    out = {"x_train": [], "y_train": []}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = n_test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        entry = {"batch_label": f"{name} of 5", "labels": labels, "data": data,
                 "filenames": [f"img_{i}.png" for i in range(n)]}
        with open(directory / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        if name == "test_batch":
            out["x_test"], out["y_test"] = data, np.array(labels)
        else:
            out["x_train"].append(data)
            out["y_train"].append(np.array(labels))
    with open(directory / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                     "ship", "truck"], "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    out["x_train"] = np.concatenate(out["x_train"])
    out["y_train"] = np.concatenate(out["y_train"])
    return out


@pytest.fixture
def no_debian(monkeypatch, tmp_path):
    """Point the Debian Fashion-MNIST location at a directory that does not exist."""
    missing = tmp_path / "no-debian" / "fashion-mnist"
    monkeypatch.setattr(dsm, "DEBIAN_FASHION_MNIST_DIR", missing)
    return missing


# ==================================================================================================
# IDX reader


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_uint8_images_and_labels(tmp_path, gz):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 7).astype(np.uint8)
    p_img = write_idx(tmp_path / "img", images, gz)
    p_lab = write_idx(tmp_path / "lab", labels, gz)
    np.testing.assert_array_equal(read_idx(p_img), images)
    np.testing.assert_array_equal(read_idx(p_lab), labels)
    assert read_idx(p_img).dtype == np.uint8 and read_idx(p_img).shape == (7, 28, 28)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "float32", "float64"])
def test_read_idx_multibyte_types_are_big_endian(tmp_path, dtype):
    arr = (np.arange(-6, 6).reshape(3, 4) * 1000 // 7).astype(dtype)
    if dtype == "int8":
        arr = np.arange(-6, 6).reshape(3, 4).astype(dtype)
    out = read_idx(write_idx(tmp_path / "a", arr, gz=True))
    np.testing.assert_array_equal(out, arr)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative


def test_read_idx_header_is_parsed_from_the_bytes(tmp_path):
    # hand-written bytes: uint8, 2 dims (2, 3), data 1..6
    p = tmp_path / "hand"
    p.write_bytes(bytes([0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6]))
    np.testing.assert_array_equal(read_idx(p), [[1, 2, 3], [4, 5, 6]])


def test_read_idx_rejects_malformed_files(tmp_path):
    bad_magic = tmp_path / "bad_magic"
    bad_magic.write_bytes(bytes([1, 0, 0x08, 1, 0, 0, 0, 1, 7]))
    with pytest.raises(ValueError, match="first two bytes"):
        read_idx(bad_magic)
    bad_type = tmp_path / "bad_type"
    bad_type.write_bytes(bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 7]))
    with pytest.raises(ValueError, match="type code"):
        read_idx(bad_type)
    truncated = tmp_path / "truncated"
    truncated.write_bytes(bytes([0, 0, 0x08, 1, 0, 0, 0, 5, 7, 7]))
    with pytest.raises(ValueError, match="expected 5"):
        read_idx(truncated)


def test_read_idx_agrees_with_torchvision_reader(tmp_path):
    mnist = pytest.importorskip("torchvision.datasets.mnist")
    rng = np.random.default_rng(2)
    for arr in (rng.integers(0, 256, (4, 5, 6), dtype=np.uint8), rng.integers(-(2**31), 2**31 - 1, (3, 4), dtype=np.int32)):
        p = write_idx(tmp_path / f"x{arr.dtype}", arr, gz=False)
        np.testing.assert_array_equal(read_idx(p), mnist.read_sn3_pascalvincent_tensor(str(p)).numpy())


# ==================================================================================================
# Dataset container


def _toy(**over):
    kw = dict(x_train=np.zeros((4, 3), np.float32), y_train=np.array([0, 1, 0, 1], np.int64),
              x_test=np.zeros((2, 3), np.float32), y_test=np.array([1, 0], np.int64), num_classes=2, name="toy")
    kw.update(over)
    return Dataset(**kw)


def test_dataset_validates_dtypes_shapes_and_labels():
    ds = _toy()
    assert ds.input_shape == (3,) and ds.num_features == 3 and ds.is_classification
    with pytest.raises(ValueError, match="float32"):
        _toy(x_train=np.zeros((4, 3), np.float64))
    with pytest.raises(ValueError, match="int64"):
        _toy(y_train=np.array([0, 1, 0, 1], np.int32))
    with pytest.raises(ValueError, match="rows"):
        _toy(y_train=np.array([0, 1, 0], np.int64))
    with pytest.raises(ValueError, match="outside"):
        _toy(y_test=np.array([2, 0], np.int64))
    with pytest.raises(ValueError, match="features"):
        _toy(x_test=np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="input_shape"):
        _toy(input_shape=(2, 2))
    reg = _toy(y_train=np.zeros((4, 1)), y_test=np.zeros((2, 1)), num_classes=None)
    assert not reg.is_classification
    with pytest.raises(ValueError, match=r"\(N, 1\)"):
        _toy(y_train=np.zeros(4), y_test=np.zeros((2, 1)), num_classes=None)
    with pytest.raises(Exception):
        ds.name = "other"  # frozen


# ==================================================================================================
# scikit-learn embedded datasets


@pytest.mark.parametrize("seed", [0, 3])
def test_breast_cancer_split_and_standardisation_use_train_statistics(seed):
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    raw, y = load_breast_cancer(return_X_y=True)
    ds = load_dataset("breast_cancer", seed=seed, test_fraction=0.2)
    assert ds.x_train.shape == (455, 30) and ds.x_test.shape == (114, 30)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64 and ds.num_classes == 2
    # the split: sklearn's stratified split of the row indices with random_state=seed
    i_tr, i_te = train_test_split(np.arange(len(y)), test_size=0.2, stratify=y, random_state=seed)
    assert len(np.intersect1d(i_tr, i_te)) == 0 and len(i_tr) + len(i_te) == len(y)
    m, s = raw[i_tr].mean(axis=0), raw[i_tr].std(axis=0)
    np.testing.assert_allclose(ds.x_train, (raw[i_tr] - m) / s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ds.x_test, (raw[i_te] - m) / s, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ds.y_test, y[i_te])
    # standardised with train statistics: train mean 0 and sd 1, test not exactly
    np.testing.assert_allclose(ds.x_train.astype(np.float64).mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(ds.x_train.astype(np.float64).std(axis=0), 1.0, atol=1e-5)
    assert np.abs(ds.x_test.astype(np.float64).mean(axis=0)).max() > 1e-3
    # stratified: the malignant share of the test set is within one point of the overall share
    assert abs(np.sum(ds.y_test == 0) - 0.2 * np.sum(y == 0)) <= 1


def test_sklearn_splits_are_seeded():
    a, b, c = (load_dataset("breast_cancer", seed=s) for s in (1, 1, 2))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.y_test, c.y_test) or not np.array_equal(a.x_test, c.x_test)


def test_digits_pixels_over_16_and_stratified():
    from sklearn.datasets import load_digits

    raw, y = load_digits(return_X_y=True)
    ds = load_dataset("digits", seed=0, test_fraction=0.25)
    assert ds.x_train.shape[0] + ds.x_test.shape[0] == 1797 and ds.x_test.shape == (450, 64)
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    # every row is a raw row / 16 (the row multiset is preserved)
    got = np.concatenate([ds.x_train, ds.x_test]).astype(np.float64) * 16
    np.testing.assert_array_equal(np.unique(got, axis=0), np.unique(raw, axis=0))
    test_counts = np.bincount(ds.y_test, minlength=10)
    assert np.all(np.abs(test_counts - 0.25 * np.bincount(y)) <= 1)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_test_fraction_is_guarded(bad):
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("digits", test_fraction=bad)


def test_unknown_dataset_lists_the_known_names():
    with pytest.raises(KeyError, match="fashion_mnist"):
        load_dataset("imagenet")


# ==================================================================================================
# MNIST family (Fashion-MNIST, MNIST, KMNIST): our IDX reader on torchvision's and Debian's layouts


def _check_mnist_like(ds: Dataset, arrays: dict[str, np.ndarray], name: str) -> None:
    assert ds.name == name and ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert ds.x_train.shape == (12, 784) and ds.x_test.shape == (5, 784)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    expected = arrays["train-images-idx3-ubyte"].reshape(12, 784).astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(ds.x_train, expected)
    np.testing.assert_array_equal(ds.x_train[0, :3], np.array([0.0, 1.0, 128 / 255], np.float32))
    np.testing.assert_array_equal(ds.y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.x_test.reshape(5, 28, 28) * 255, arrays["t10k-images-idx3-ubyte"])


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_from_data_dir_flat(tmp_path, no_debian, gz):
    """Flat files are read from a data_dir named after the dataset (Debian's folder name here), and from the
    per-dataset folder data_dir/fashion_mnist; never from a data_dir of another name (tests/test_data_review.py)."""
    arrays = make_mnist_like(tmp_path / "fashion-mnist", gz=gz)
    _check_mnist_like(load_dataset("fashion_mnist", data_dir=str(tmp_path / "fashion-mnist")), arrays, "fashion_mnist")
    arrays = make_mnist_like(tmp_path / "root" / "fashion_mnist", gz=gz, seed=2)
    _check_mnist_like(load_dataset("fashion_mnist", data_dir=str(tmp_path / "root")), arrays, "fashion_mnist")


def test_fashion_mnist_from_torchvision_layout_with_mixed_compression(tmp_path, no_debian):
    arrays = make_mnist_like(tmp_path / "FashionMNIST" / "raw", gz=True, mixed=True)
    _check_mnist_like(load_dataset("fashion_mnist", data_dir=tmp_path), arrays, "fashion_mnist")


def test_fashion_mnist_falls_back_to_debian_location(tmp_path, monkeypatch):
    debian = tmp_path / "usr" / "share" / "datasets" / "fashion-mnist"
    arrays = make_mnist_like(debian, gz=True, seed=5)
    monkeypatch.setattr(dsm, "DEBIAN_FASHION_MNIST_DIR", debian)
    empty = tmp_path / "empty"
    empty.mkdir()
    _check_mnist_like(load_dataset("fashion_mnist", data_dir=empty), arrays, "fashion_mnist")


def test_fashion_mnist_missing_files_error_names_paths_and_remedies(tmp_path, no_debian):
    empty = tmp_path / "empty"
    empty.mkdir()
    make_mnist_like(empty, gz=True)
    (empty / "t10k-labels-idx1-ubyte.gz").unlink()  # three of four files is still "missing"
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("fashion_mnist", data_dir=empty, download=False)
    msg = str(info.value)
    for needle in (str(empty), str(empty / "FashionMNIST" / "raw"), str(no_debian),
                   "apt-get install -y dataset-fashion-mnist", "download=True", "t10k-labels-idx1-ubyte"):
        assert needle in msg, needle


@pytest.mark.parametrize("stem, array, match", [
    ("t10k-labels-idx1-ubyte", np.array([0, 3, 10, 1, 2], dtype=np.uint8), "labels outside"),
    ("train-images-idx3-ubyte", np.zeros((12, 28, 28), dtype=np.int16), "expected uint8"),
    ("t10k-images-idx3-ubyte", np.zeros((5, 27, 28), dtype=np.uint8), "train images are 28x28"),
])
def test_an_idx_file_whose_content_does_not_fit_is_named(tmp_path, no_debian, stem, array, match):
    # the module promises a ValueError naming the file; these named only the dataset (data review, stop 32)
    raw = tmp_path / "FashionMNIST" / "raw"
    make_mnist_like(raw, gz=False)
    bad = write_idx(raw / stem, array, gz=False)
    with pytest.raises(ValueError, match=match) as info:
        load_dataset("fashion_mnist", data_dir=tmp_path)
    assert str(bad) in str(info.value)


def test_mismatched_image_and_label_counts_are_rejected(tmp_path, no_debian):
    raw = tmp_path / "FashionMNIST" / "raw"
    arrays = make_mnist_like(raw, gz=False)
    write_idx(raw / "train-labels-idx1-ubyte", arrays["train-labels-idx1-ubyte"][:-1], gz=False)
    with pytest.raises(ValueError, match="labels"):
        load_dataset("fashion_mnist", data_dir=tmp_path)


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("kmnist", "KMNIST")])
def test_mnist_and_kmnist_read_torchvision_layout_and_agree_with_torchvision(tmp_path, name, folder):
    arrays = make_mnist_like(tmp_path / folder / "raw", gz=False, seed=7)
    ds = load_dataset(name, data_dir=tmp_path)
    _check_mnist_like(ds, arrays, name)
    tvd = pytest.importorskip("torchvision.datasets")
    for train, x, y in ((True, ds.x_train, ds.y_train), (False, ds.x_test, ds.y_test)):
        tv = getattr(tvd, folder)(str(tmp_path), train=train, download=False)
        np.testing.assert_array_equal(x, tv.data.numpy().reshape(len(tv), -1).astype(np.float32) / np.float32(255))
        np.testing.assert_array_equal(y, tv.targets.numpy())


@pytest.mark.parametrize("name", ["mnist", "kmnist", "cifar10"])
def test_torchvision_sets_missing_without_download_is_a_clear_error(tmp_path, name, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("must not download when download=False")

    monkeypatch.setattr(dsm, "_torchvision_download", boom)
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, data_dir=tmp_path)
    msg = str(info.value)
    assert str(tmp_path) in msg and "download=True" in msg and "Searched" in msg


def test_download_true_goes_through_torchvision_then_reads_the_files(tmp_path, monkeypatch):
    calls = []

    def fake_download(class_name, root):  # what torchvision leaves on disk: root/MNIST/raw/*-ubyte
        calls.append((class_name, Path(root)))
        make_mnist_like(Path(root) / class_name / "raw", gz=False, seed=11)

    monkeypatch.setattr(dsm, "_torchvision_download", fake_download)
    ds = load_dataset("mnist", data_dir=tmp_path, download=True)
    assert calls == [("MNIST", tmp_path)]
    assert ds.x_train.shape == (12, 784)
    load_dataset("mnist", data_dir=tmp_path, download=True)  # present now: no second download
    assert len(calls) == 1


def test_default_data_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PGVI_DATA_DIR", str(tmp_path))
    arrays = make_mnist_like(tmp_path / "KMNIST" / "raw", gz=True, seed=3)
    _check_mnist_like(load_dataset("kmnist"), arrays, "kmnist")


def test_fashion_mnist_from_debian_package_if_installed():
    if not dsm.DEBIAN_FASHION_MNIST_DIR.is_dir():
        pytest.skip(f"{dsm.DEBIAN_FASHION_MNIST_DIR} absent (Debian package dataset-fashion-mnist not installed)")
    ds = load_dataset("fashion_mnist", data_dir="/nonexistent-pgvi-data-dir")
    assert ds.x_train.shape == (60000, 784) and ds.x_test.shape == (10000, 784)
    np.testing.assert_array_equal(ds.y_train[:10], [9, 0, 0, 3, 0, 2, 7, 2, 5, 5])
    np.testing.assert_array_equal(ds.y_test[:10], [9, 2, 1, 1, 6, 1, 4, 6, 5, 7])
    np.testing.assert_array_equal(np.bincount(ds.y_train), np.full(10, 6000))
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0


# ==================================================================================================
# CIFAR-10 and Kuzushiji-49


def test_cifar10_reads_python_batches_channel_major(tmp_path, monkeypatch):
    ref = make_cifar(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", data_dir=tmp_path)
    assert ds.x_train.shape == (20, 3072) and ds.x_test.shape == (3, 3072) and ds.input_shape == (3, 32, 32)
    np.testing.assert_array_equal(ds.x_train, ref["x_train"].astype(np.float32) / np.float32(255))
    np.testing.assert_array_equal(ds.y_train, ref["y_train"])
    np.testing.assert_array_equal(ds.y_test, ref["y_test"])
    # the same arrays as torchvision's CIFAR10 (HWC uint8) -> CHW -> flatten; its md5 check is bypassed
    cifar = pytest.importorskip("torchvision.datasets.cifar")
    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    tv = cifar.CIFAR10(str(tmp_path), train=True, download=False)
    chw = tv.data.transpose(0, 3, 1, 2).reshape(len(tv), -1).astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(ds.x_train, chw)
    np.testing.assert_array_equal(ds.y_train, np.array(tv.targets))


def test_kuzushiji49_reads_npz_files(tmp_path):
    rng = np.random.default_rng(4)
    k49 = tmp_path / "k49"
    k49.mkdir()
    arrays = {"k49-train-imgs.npz": rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
              "k49-train-labels.npz": rng.integers(0, 49, 6).astype(np.uint8),
              "k49-test-imgs.npz": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
              "k49-test-labels.npz": np.array([48, 0], np.uint8)}
    for fname, arr in arrays.items():
        np.savez_compressed(k49 / fname, arr)  # key arr_0, as the official files
    ds = load_dataset("kuzushiji49", data_dir=tmp_path)
    assert ds.num_classes == 49 and ds.x_train.shape == (6, 784)
    np.testing.assert_array_equal(ds.y_test, [48, 0])
    np.testing.assert_array_equal(ds.x_train * 255, arrays["k49-train-imgs.npz"].reshape(6, -1))
    with pytest.raises(FileNotFoundError, match="codh.rois.ac.jp"):
        load_dataset("kuzushiji49", data_dir=tmp_path / "nothing")


def test_importing_the_data_path_pulls_in_no_heavy_dependency():
    code = ("import sys, common.data, common.metrics; "
            "bad = [m for m in ('torch', 'torchvision', 'sklearn', 'scipy', 'flwr') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})


# ==================================================================================================
# partitioners

LABELS_60K = np.random.default_rng(0).integers(0, 10, 60000)
ALL_CASES = [
    ("iid", {}),
    ("label_skew", {"classes_per_partition": 2}),
    ("dirichlet", {"alpha": 0.5, "min_size": 5}),
    ("size_skew", {"distribution": "power_law", "exponent": 1.5}),
    ("size_skew", {"distribution": "dirichlet", "alpha": 1.0}),
    ("shards", {"shards_per_partition": 2}),
]


def test_partitioner_names():
    assert partitioner_names() == ["dirichlet", "iid", "label_skew", "shards", "size_skew"]


@pytest.mark.parametrize("name, kw", ALL_CASES)
@pytest.mark.parametrize("m", [1, 7, 50])
def test_partitions_cover_every_index_exactly_once_and_are_deterministic(name, kw, m):
    labels = LABELS_60K[:3000]
    if name == "label_skew" and m * kw["classes_per_partition"] < 10:
        kw = {"classes_per_partition": 10}  # one partition must hold all 10 classes
    parts = partition(name, labels, m, seed=123, **kw)
    assert len(parts) == m
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)  # sorted, no repeats
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    again = partition(name, labels, m, seed=123, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    if m > 1:
        other = partition(name, labels, m, seed=124, **kw)
        assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("name, kw", ALL_CASES)
def test_partitions_are_fast_for_1000_clients_of_60k(name, kw):
    t0 = time.perf_counter()
    parts = partition(name, LABELS_60K, 1000, seed=1, **kw)
    elapsed = time.perf_counter() - t0
    assert len(parts) == 1000 and sum(p.size for p in parts) == 60000
    assert elapsed < 2.0, f"{name} took {elapsed:.2f} s"


def test_iid_matches_the_reference_homogeneous_split_and_balances_sizes():
    labels = LABELS_60K[:1003]
    for seed in (676, 93):
        parts = partition("iid", labels, 10, seed)
        # specification (FedGVI/PVI code): legacy global seed, one permutation, strided slices
        np.random.seed(seed)
        perm = np.random.permutation(labels.size)
        for i, p in enumerate(parts):
            np.testing.assert_array_equal(p, np.sort(perm[i::10]))
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003


def test_label_skew_gives_exactly_k_classes_and_uses_every_class():
    labels = np.repeat(np.arange(10), 100)
    for m, k in ((20, 2), (7, 3), (10, 1), (3, 10)):
        parts = partition("label_skew", labels, m, seed=5, classes_per_partition=k)
        counts = label_counts(labels, parts, 10)
        assert np.all((counts > 0).sum(axis=1) == k)
        holders = (counts > 0).sum(axis=0)
        assert holders.min() >= 1 and holders.max() - holders.min() <= 1  # balanced holders
        for cls in range(10):  # a class is split as evenly as possible among its holders
            held = counts[:, cls][counts[:, cls] > 0]
            assert held.max() - held.min() <= 1
    # non-contiguous labels are fine
    odd = np.array([3, 7, 100] * 20)
    parts = partition("label_skew", odd, 6, seed=0, classes_per_partition=1)
    assert all(np.unique(odd[p]).size == 1 for p in parts)


def test_label_skew_guards():
    labels = np.repeat(np.arange(10), 10)
    with pytest.raises(ValueError, match="exceeds the number of classes"):
        partition("label_skew", labels, 5, 0, classes_per_partition=11)
    with pytest.raises(ValueError, match="unused"):
        partition("label_skew", labels, 4, 0, classes_per_partition=2)
    with pytest.raises(ValueError, match="classes_per_partition"):
        partition("label_skew", labels, 5, 0, classes_per_partition=0)
    with pytest.raises(ValueError, match="fewer points"):  # 3 points of class 0 shared by 5 holders
        partition("label_skew", np.array([0, 0, 0] + [1] * 20), 5, 0, classes_per_partition=2)


def test_dirichlet_shares_follow_the_beta_marginal():
    """With one class, client 0's share is floor(n p_0)/n with p ~ Dir(alpha 1_M), so p_0 ~ Beta(alpha,
    (M-1) alpha).  KS test over 1,000 seeds (and the same test rejects the wrong alpha)."""
    n, m, alpha = 5000, 5, 0.5  # P(p_0 < 1/n) ~ 0.02 is below the KS critical value 0.06 for 1,000 draws
    labels = np.zeros(n, np.int64)
    share = np.array([partition("dirichlet", labels, m, seed=s, alpha=alpha, min_size=0)[0].size / n
                      for s in range(1000)])
    assert stats.kstest(share, stats.beta(alpha, (m - 1) * alpha).cdf).pvalue > 1e-3
    assert stats.kstest(share, stats.beta(1.0, (m - 1) * 1.0).cdf).pvalue < 1e-6


def test_dirichlet_alpha_controls_heterogeneity_and_min_size_is_enforced():
    labels = LABELS_60K[:20000]
    glob = np.bincount(labels, minlength=10) / labels.size

    def mean_tv(alpha):
        counts = label_counts(labels, partition("dirichlet", labels, 20, 0, alpha=alpha, min_size=1), 10)
        props = counts / counts.sum(axis=1, keepdims=True)
        return 0.5 * np.abs(props - glob).sum(axis=1).mean()

    assert mean_tv(1000.0) < 0.05 < 0.5 < mean_tv(0.05)
    parts = partition("dirichlet", labels, 200, 0, alpha=0.3, min_size=20)
    assert min(p.size for p in parts) >= 20


def test_dirichlet_guards():
    labels = np.arange(100) % 4
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            partition("dirichlet", labels, 4, 0, alpha=bad)
    with pytest.raises(ValueError, match="min_size"):
        partition("dirichlet", labels, 20, 0, min_size=10)
    with pytest.raises(ValueError, match="max_retries"):
        partition("dirichlet", labels, 50, 0, alpha=0.01, min_size=2, max_retries=5)
    with pytest.raises(ValueError, match="integers"):
        partition("dirichlet", labels.astype(float), 4, 0)


def test_size_skew_power_law_sizes_are_pareto():
    """Sizes are proportional to i.i.d. Pareto(a) weights W (up to rounding), and for W_i ~ Pareto(a),
    log W_i ~ Exp(a); by memorylessness log(W_i / W_min) over the other M-1 clients are again i.i.d. Exp(a)."""
    n, m, a = 1_000_000, 300, 1.5
    labels = np.zeros(n, np.int64)
    logs = []
    for seed in range(6):
        sizes = np.array([p.size for p in partition("size_skew", labels, m, seed, exponent=a, min_size=0)])
        assert sizes.sum() == n and sizes.min() > 300  # large enough for rounding to be negligible
        rel = np.log(sizes / sizes.min())
        logs.append(np.delete(rel, np.argmin(sizes)))
    logs = np.concatenate(logs)
    assert stats.kstest(logs, stats.expon(scale=1 / a).cdf).pvalue > 1e-3
    assert stats.kstest(logs, stats.expon(scale=1 / 3.0).cdf).pvalue < 1e-6


def test_size_skew_dirichlet_sizes_follow_the_beta_marginal_and_labels_stay_iid():
    n, m, alpha = 2000, 5, 2.0
    labels = np.zeros(n, np.int64)
    share = np.array([partition("size_skew", labels, m, s, distribution="dirichlet", alpha=alpha, min_size=0)[0].size / n
                      for s in range(800)])
    assert stats.kstest(share, stats.beta(alpha, (m - 1) * alpha).cdf).pvalue > 1e-3
    assert stats.kstest(share, stats.beta(1.0, (m - 1) * 1.0).cdf).pvalue < 1e-6
    # labels inside a partition are a uniformly random subset: class proportions match the global ones
    labels = LABELS_60K
    parts = partition("size_skew", labels, 10, 3, exponent=1.0, min_size=100)
    big = max(parts, key=len)
    expected = np.bincount(labels, minlength=10) / labels.size * big.size
    assert stats.chisquare(np.bincount(labels[big], minlength=10), expected).pvalue > 1e-3
    assert min(p.size for p in parts) >= 100


def test_size_skew_guards():
    labels = np.zeros(100, np.int64)
    with pytest.raises(ValueError, match="exponent"):
        partition("size_skew", labels, 4, 0, exponent=0.0)
    with pytest.raises(ValueError, match="alpha"):
        partition("size_skew", labels, 4, 0, distribution="dirichlet", alpha=-1.0)
    with pytest.raises(ValueError, match="distribution"):
        partition("size_skew", labels, 4, 0, distribution="zipf")
    with pytest.raises(ValueError, match="min_size"):
        partition("size_skew", labels, 4, 0, min_size=30)


def test_apportion_is_exact_and_proportional():
    np.testing.assert_array_equal(apportion(10, np.array([1.0, 1.0, 1.0])), [4, 3, 3])  # tie -> lowest index
    # quotas 3.5, 1.75, 1.75 -> floors 3, 1, 1 (sum 5); the 2 left go to the largest remainders .75, .75
    np.testing.assert_array_equal(apportion(7, np.array([0.5, 0.25, 0.25])), [3, 2, 2])
    w = np.random.default_rng(0).random(50)
    out = apportion(12345, w)
    assert out.sum() == 12345 and np.all(np.abs(out - 12345 * w / w.sum()) < 1)
    with pytest.raises(ValueError):
        apportion(5, np.array([0.0, 0.0]))


def test_shards_are_label_sorted_pieces():
    labels = np.repeat(np.arange(10), 100)  # 40 shards of 25: each shard is one class
    parts = partition("shards", labels, 20, seed=0, shards_per_partition=2)
    assert all(p.size == 50 for p in parts)
    assert all(np.unique(labels[p]).size <= 2 for p in parts)
    counts = label_counts(labels, parts, 10)
    assert np.all(counts % 25 == 0)


def test_common_partition_guards():
    labels = np.arange(10) % 3
    for name, kw in ALL_CASES:
        kw = {**kw, "min_size": 0} if "min_size" in kw or name == "size_skew" else kw
        with pytest.raises(ValueError, match="exceeds the number of points"):
            partition(name, labels, 11, 0, **kw)
        with pytest.raises(ValueError, match="num_partitions"):
            partition(name, labels, 0, 0, **kw)
        with pytest.raises(ValueError, match="1-D"):
            partition(name, labels.reshape(2, 5), 2, 0, **kw)
        with pytest.raises(ValueError, match="seed"):
            partition(name, labels, 2, -1, **kw)
    with pytest.raises(KeyError, match="dirichlet"):
        partition("pathological", labels, 2, 0)


# ==================================================================================================
# label contamination


@pytest.mark.parametrize("flip", [random_flip, class_map_flip])
@pytest.mark.parametrize("n, rate, expected", [(1000, 0.1, 100), (10, 0.25, 2), (10, 0.35, 4), (7, 0.0, 0),
                                               (5000, 0.6, 3000), (3, 0.5, 2)])
def test_contamination_flips_exactly_round_rate_n_and_never_writes_the_input(flip, n, rate, expected):
    y = np.random.default_rng(n).integers(0, 10, n)
    y.setflags(write=False)  # any write would raise
    before = y.copy()
    new, mask = flip(y, rate, 10, seed=42)
    assert mask.sum() == expected == int(np.round(rate * n))
    assert new.dtype == np.int64 and mask.dtype == bool
    assert np.all(new[mask] != y[mask]) and np.array_equal(new[~mask], y[~mask])
    assert np.all((new >= 0) & (new < 10))
    np.testing.assert_array_equal(y, before)
    again, mask2 = flip(y, rate, 10, seed=42)
    np.testing.assert_array_equal(new, again)
    np.testing.assert_array_equal(mask, mask2)


def test_random_flip_new_class_is_uniform_over_the_others_and_points_uniform():
    c, n, rate = 4, 200_000, 0.3
    y = np.random.default_rng(1).integers(0, c, n)
    new, mask = random_flip(y, rate, c, seed=7)
    for cls in range(c):
        got = np.bincount(new[mask & (y == cls)], minlength=c)
        assert got[cls] == 0
        others = np.delete(got, cls)
        assert stats.chisquare(others).pvalue > 1e-3  # uniform over the C-1 other classes
    # the chosen points are a uniform subset: flipped share is the same in every class
    table = np.array([[np.sum(mask & (y == k)), np.sum(~mask & (y == k))] for k in range(c)])
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_class_map_flip_sends_each_class_to_one_other_class():
    c = 10
    y = np.random.default_rng(2).integers(0, c, 5000)
    new, mask = class_map_flip(y, 0.4, c, seed=42)
    for cls in range(c):
        targets = np.unique(new[mask & (y == cls)])
        assert targets.size == 1 and targets[0] != cls
    # over seeds, the target of a class is uniform over the other classes
    y3 = np.repeat(np.arange(3), 10)
    first = []
    for s in range(1500):
        new3, mask3 = class_map_flip(y3, 0.9, 3, seed=s)
        first.append(new3[mask3 & (y3 == 0)][0])  # 27 of 30 points flipped: some of class 0 always are
    counts = np.bincount(first, minlength=3)
    assert counts[0] == 0 and stats.binomtest(int(counts[1]), 1500, 0.5).pvalue > 1e-3


def test_contamination_follows_the_reference_random_stream():
    """Specification written as a loop: points = rng.choice(n, round(rate n), replace=False); then, for
    random_flip, each chosen point in turn gets rng.choice(other classes in increasing order); for
    class_map_flip each class 0..C-1 in turn draws its target the same way."""
    y = np.random.default_rng(3).integers(0, 10, 1000)
    for seed in (42, 0):
        rng = np.random.default_rng(seed)
        idx = rng.choice(y.size, int(np.round(0.1 * y.size)), replace=False)
        expect = y.copy()
        for i in idx:
            expect[i] = rng.choice([k for k in range(10) if k != y[i]], 1)[0]
        np.testing.assert_array_equal(random_flip(y, 0.1, 10, seed)[0], expect)

        rng = np.random.default_rng(seed)
        idx = rng.choice(y.size, int(np.round(0.1 * y.size)), replace=False)
        target = {k: rng.choice([j for j in range(10) if j != k], 1)[0] for k in range(10)}
        expect = y.copy()
        for i in idx:
            expect[i] = target[int(y[i])]
        np.testing.assert_array_equal(class_map_flip(y, 0.1, 10, seed)[0], expect)


@pytest.mark.parametrize("flip", [random_flip, class_map_flip])
def test_contamination_guards(flip):
    y = np.array([0, 1, 2, 1])
    for bad in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="rate"):
            flip(y, bad, 3, 0)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        flip(y, 0.5, 2, 0)
    with pytest.raises(ValueError, match="num_classes"):
        flip(np.zeros(4, int), 0.5, 1, 0)
    with pytest.raises(ValueError, match="integers"):
        flip(y.astype(float), 0.5, 3, 0)


# ==================================================================================================
# synthetic data-generating processes


def test_clutter_1d_is_the_huber_mixture():
    theta, eps = 0.3, 0.25
    d = clutter_1d(n=20000, eps=eps, seed=1, theta=theta)
    assert d.x.shape == (20000,) and d.x.dtype == np.float64 and d.theta == theta
    assert d.inlier_mean == pytest.approx(theta - 2) and d.outlier_mean == pytest.approx(theta + 3)

    def cdf(x):
        return (1 - eps) * stats.norm.cdf(x, theta - 2, 1.0) + eps * stats.norm.cdf(x, theta + 3, 0.5)

    assert stats.kstest(d.x, cdf).pvalue > 1e-3
    # and not the mixture with the other reading of the OCR (inlier mean -2 without theta) at theta=1.5
    d2 = clutter_1d(n=20000, eps=eps, seed=1, theta=1.5)
    assert stats.kstest(d2.x, lambda x: (1 - eps) * stats.norm.cdf(x, -2, 1) + eps * stats.norm.cdf(x, 4.5, .5)).pvalue < 1e-6
    # the component labels: Binomial(n, eps) outliers, each component Gaussian with its own moments
    k = d.is_outlier.sum()
    assert abs(k - 20000 * eps) < 4 * math.sqrt(20000 * eps * (1 - eps))
    assert stats.kstest(d.x[d.is_outlier], stats.norm(theta + 3, 0.5).cdf).pvalue > 1e-3
    assert stats.kstest(d.x[~d.is_outlier], stats.norm(theta - 2, 1.0).cdf).pvalue > 1e-3


def test_clutter_1d_defaults_draw_theta_from_the_prior():
    d = clutter_1d(seed=0)
    assert d.x.shape == (100,) and d.eps == 0.25
    thetas = np.array([clutter_1d(seed=s).theta for s in range(1000)])
    assert stats.kstest(thetas, stats.norm(0.0, 0.5).cdf).pvalue > 1e-3
    np.testing.assert_array_equal(clutter_1d(seed=9).x, clutter_1d(seed=9).x)
    for bad in dict(eps=1.0), dict(eps=-0.1), dict(n=0), dict(outlier_std=0.0):
        with pytest.raises(ValueError):
            clutter_1d(**bad)


def test_student_t_location():
    x = student_t_location(20000, seed=2)
    assert x.shape == (20000,) and x.dtype == np.float64
    assert stats.kstest(x, stats.t(4).cdf).pvalue > 1e-3
    assert stats.kstest(x, stats.norm.cdf).pvalue < 1e-6  # heavy tails are visible
    y = student_t_location(20000, df=4, loc=1.0, scale=2.0, seed=2)
    np.testing.assert_allclose(y, 1.0 + 2.0 * x)
    with pytest.raises(ValueError, match="df"):
        student_t_location(10, df=0.0)


def test_logistic_2d_paper_defaults():
    d = logistic_2d_with_outliers(seed=0)
    assert d.x_train.shape == (106, 2) and d.is_outlier.sum() == 6  # ceil(0.05 * 100 / 0.95) = 6
    assert np.all(d.y_train[d.is_outlier] == 0) and np.all(d.is_outlier[-6:])
    np.testing.assert_array_equal(d.x_test, d.x_train[:100])
    np.testing.assert_array_equal(d.y_test, d.y_train[:100])
    assert set(np.unique(d.y_train)) == {0, 1} and d.y_train.dtype == np.int64
    b = logistic_2d_with_outliers(seed=0, balanced=True)
    assert b.y_test.sum() == 50
    # class-1 count ~ Binomial(100, 1/2): mean 50, variance 25
    counts = np.array([logistic_2d_with_outliers(n=100, seed=s).y_test.sum() for s in range(1000)])
    assert abs(counts.mean() - 50) < 4 * 5 / math.sqrt(1000)
    assert 0.85 < counts.var() / 25 < 1.15


def test_logistic_2d_component_moments():
    n = 40000
    d = logistic_2d_with_outliers(n=n, num_outliers=n // 2, seed=3, balanced=True)
    x1 = d.x_train[: n // 2][d.y_train[: n // 2] == 1]
    x0 = d.x_train[:n][d.y_train[:n] == 0]
    xo = d.x_train[d.is_outlier]
    for xs, mean, cov in ((x1, [3, 4], [[1, .35], [.35, .75]]), (x0, [0, 0], [[.8, -.4], [-.4, 1]]),
                          (xo, [1, 5], [[.15, .1], [.1, .15]])):
        assert xs.shape[0] == n // 2
        se = np.sqrt(np.diag(cov) / xs.shape[0])
        assert np.all(np.abs(xs.mean(axis=0) - mean) < 4.5 * se)
        np.testing.assert_allclose(np.cov(xs.T), cov, atol=0.04)
    with pytest.raises(ValueError, match="outlier_fraction"):
        logistic_2d_with_outliers(outlier_fraction=1.0)


def test_conjugate_linear_regression_residuals_are_gaussian():
    d = conjugate_linear_regression(n=5000, dim=3, sigma=0.7, seed=4)
    assert d.x.shape == (5000, 3) and d.y.shape == (5000, 1) and d.theta.shape == (3,)
    resid = d.y[:, 0] - d.x @ d.theta
    assert stats.kstest(resid, stats.norm(0, 0.7).cdf).pvalue > 1e-3
    theta = np.array([1.0, -2.0])
    e = conjugate_linear_regression(n=10, dim=2, theta=theta, seed=0)
    np.testing.assert_array_equal(e.theta, theta)
    with pytest.raises(ValueError, match="sigma"):
        conjugate_linear_regression(sigma=0.0)
    with pytest.raises(ValueError, match="theta"):
        conjugate_linear_regression(dim=3, theta=np.ones(2))


def test_dirichlet_with_an_overflowing_alpha_is_refused_not_given_to_the_last_client():
    # a review: numpy's Dirichlet draw is all zeros once num_partitions x alpha overflows, and every point went to the
    # last partition without an error (min_size 0), or the run config said "raise dirichlet-alpha"
    from common.data.partition import dirichlet

    labels = np.repeat(np.arange(10), 50)
    assert [len(p) for p in dirichlet(labels, 3, 0, alpha=1e307, min_size=0)] == [160, 170, 170]
    with pytest.raises(ValueError, match="degenerate"):
        dirichlet(labels, 3, 0, alpha=1e308, min_size=0)


def test_an_overflowing_dirichlet_alpha_is_a_config_error_that_says_lower_it():
    from common.config import ConfigError, parse_run_config
    from common.problem import train_partition

    cfg = parse_run_config({"dataset": "digits", "model": "logistic_regression", "partitioner": "dirichlet",
                            "dirichlet-alpha": 1e308})
    with pytest.raises(ConfigError, match="dirichlet-alpha: .*degenerate.*lower alpha"):
        train_partition(cfg)


def test_apportion_sums_to_total_when_the_weights_sum_overflows():
    # finite weights whose float sum is inf made every quota 0 (the review of 2026-11-28: [1e308, 1e308] -> [1, 1])
    np.testing.assert_array_equal(apportion(10, np.array([1e308, 1e308])), [5, 5])
    np.testing.assert_array_equal(apportion(7, np.array([1e308, 1e307, 1.0])), [6, 1, 0])
    for total in (2.5, -1, True):
        with pytest.raises(ValueError, match="integer >= 0"):
            apportion(total, np.array([1.0, 1.0]))
    assert apportion(np.int64(4), np.array([1.0, 3.0])).tolist() == [1, 3]
