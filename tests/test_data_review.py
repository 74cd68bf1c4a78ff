"""Review fixes of common/data/datasets.py: MNIST-family file locations are per dataset, a corrupt or truncated
data file is a ValueError naming it, and a failed download is a FileNotFoundError (all offline, small files in
the real formats)."""

from __future__ import annotations

import gzip
import pickle
import socket
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

import common.data.datasets as dsm
from common.data import load_dataset, read_idx

_FAMILY = {"mnist": "MNIST", "kmnist": "KMNIST", "fashion_mnist": "FashionMNIST"}


def _idx_bytes(arr) -> bytes:
    arr = np.asarray(arr, np.uint8)
    return bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def _write_set(directory: Path, fill: int, gz: bool = False) -> None:
    """A tiny MNIST-family set whose every pixel is ``fill`` (identifies where a load came from)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"train-images-idx3-ubyte": np.full((4, 28, 28), fill), "train-labels-idx1-ubyte": [0, 1, 2, 3],
             "t10k-images-idx3-ubyte": np.full((2, 28, 28), fill), "t10k-labels-idx1-ubyte": [4, 5]}
    for stem, arr in files.items():
        if gz:
            (directory / f"{stem}.gz").write_bytes(gzip.compress(_idx_bytes(arr)))
        else:
            (directory / stem).write_bytes(_idx_bytes(arr))


def _fill(ds) -> int:
    return int(round(float(ds.x_train[0, 0]) * 255))


@pytest.fixture
def no_debian(monkeypatch, tmp_path):
    missing = tmp_path / "no-debian" / "fashion-mnist"
    monkeypatch.setattr(dsm, "DEBIAN_FASHION_MNIST_DIR", missing)
    return missing


def _corrupt_message_ok(msg: str, path: Path) -> bool:
    return str(path) in msg and "corrupt or truncated" in msg and "delete it and copy it again" in msg


# ==================================================================================================
# 1. each MNIST-family dataset is read only from its own locations


def test_flat_files_in_the_data_root_are_not_taken_for_every_mnist_family_name(tmp_path, no_debian):
    _write_set(tmp_path, 200)  # someone's Fashion-MNIST files, flat in the root
    _write_set(tmp_path / "MNIST" / "raw", 10)  # the real MNIST in torchvision's layout
    assert _fill(load_dataset("mnist", data_dir=tmp_path)) == 10
    for name in ("kmnist", "fashion_mnist"):
        with pytest.raises(FileNotFoundError):
            load_dataset(name, data_dir=tmp_path)


def test_each_mnist_family_dataset_reads_its_own_folder(tmp_path, no_debian):
    for fill, name in enumerate(_FAMILY, start=1):
        _write_set(tmp_path / name, fill, gz=(fill % 2 == 0))
    for fill, name in enumerate(_FAMILY, start=1):
        ds = load_dataset(name, data_dir=tmp_path)
        assert ds.name == name and _fill(ds) == fill


def test_torchvision_layout_comes_before_the_per_dataset_folder(tmp_path, no_debian):
    for name, cls in _FAMILY.items():
        _write_set(tmp_path / cls / "raw", 7)
        _write_set(tmp_path / name, 9)
        assert _fill(load_dataset(name, data_dir=tmp_path)) == 7


@pytest.mark.parametrize("dirname", ["fashion-mnist", "fashion_mnist", "FashionMNIST"])
def test_a_data_dir_named_after_its_dataset_may_hold_the_files_flat(tmp_path, no_debian, dirname):
    """e.g. ``data-dir = /usr/share/datasets/fashion-mnist`` (Debian's folder): only that dataset reads it."""
    flat = tmp_path / dirname
    _write_set(flat, 33, gz=True)
    assert _fill(load_dataset("fashion_mnist", data_dir=flat)) == 33
    for other in ("mnist", "kmnist"):
        with pytest.raises(FileNotFoundError):
            load_dataset(other, data_dir=flat)


def test_a_flat_mnist_folder_is_not_kmnist(tmp_path, no_debian):
    _write_set(tmp_path / "mnist", 5)
    assert _fill(load_dataset("mnist", data_dir=tmp_path / "mnist")) == 5
    with pytest.raises(FileNotFoundError):
        load_dataset("kmnist", data_dir=tmp_path / "mnist")


@pytest.mark.parametrize("name", list(_FAMILY))
def test_not_found_error_names_only_per_dataset_locations(tmp_path, no_debian, name):
    root = tmp_path / "data"
    root.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, data_dir=root)
    msg = str(info.value)
    searched = msg.split("Searched: ", 1)[1].split(". Expected files", 1)[0].split(", ")
    assert str(root) not in searched
    assert str(root / _FAMILY[name] / "raw") in searched and str(root / name) in searched
    advice = msg.split("copy the IDX files into ", 1)[1]
    assert str(root / name) in advice and str(root / _FAMILY[name] / "raw") in advice
    assert f"{root} " not in advice and f"{root}." not in advice and f"{root}," not in advice


def test_debian_location_still_follows_the_data_dir(tmp_path, monkeypatch):
    debian = tmp_path / "usr" / "share" / "datasets" / "fashion-mnist"
    _write_set(debian, 77, gz=True)
    monkeypatch.setattr(dsm, "DEBIAN_FASHION_MNIST_DIR", debian)
    assert _fill(load_dataset("fashion_mnist", data_dir=tmp_path / "empty")) == 77
    _write_set(tmp_path / "data" / "fashion_mnist", 3)
    assert _fill(load_dataset("fashion_mnist", data_dir=tmp_path / "data")) == 3
    with pytest.raises(FileNotFoundError):  # Debian's folder is Fashion-MNIST's only
        load_dataset("mnist", data_dir=tmp_path / "empty")


# ==================================================================================================
# 2. a corrupt or truncated data file is a ValueError naming the file


def _gz_variants():
    good = gzip.compress(_idx_bytes(np.zeros((4, 28, 28))))
    bad_deflate = bytearray(good)
    bad_deflate[12:20] = b"\xff" * 8  # garbage in the deflate stream (zlib.error or a CRC failure)
    return {
        "truncated_gz": good[: len(good) // 2],  # EOFError
        "not_gzip": _idx_bytes(np.zeros((4, 28, 28))),  # raw bytes under a .gz name: BadGzipFile
        "bad_deflate": bytes(bad_deflate),
        "empty_gz": b"",
    }


@pytest.mark.parametrize("kind", list(_gz_variants()))
def test_corrupt_gz_idx_file_is_a_value_error_naming_it(tmp_path, no_debian, kind):
    raw = tmp_path / "MNIST" / "raw"
    _write_set(raw, 1, gz=True)
    bad = raw / "train-images-idx3-ubyte.gz"
    bad.write_bytes(_gz_variants()[kind])
    with pytest.raises(ValueError) as info:
        read_idx(bad)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)
    with pytest.raises(ValueError) as info:
        load_dataset("mnist", data_dir=tmp_path)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)


@pytest.mark.parametrize("content", [b"", b"\x00\x00\x08", bytes([0, 0, 8, 3, 0, 0]),
                                     bytes([1, 2, 8, 1, 0, 0, 0, 1, 5]), bytes([0, 0, 0x42, 1, 0, 0, 0, 1, 5]),
                                     bytes([0, 0, 8, 1, 0, 0, 0, 5, 7, 7])],
                         ids=["empty", "short_magic", "short_dims", "bad_magic", "bad_type", "short_data"])
def test_malformed_idx_headers_are_corrupt_file_errors(tmp_path, content):
    bad = tmp_path / "x-idx1-ubyte"
    bad.write_bytes(content)
    with pytest.raises(ValueError) as info:
        read_idx(bad)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)


def test_idx_dims_whose_product_overflows_are_rejected(tmp_path):
    bad = tmp_path / "huge-idx3-ubyte"
    bad.write_bytes(bytes([0, 0, 8, 4]) + struct.pack(">4I", *([2**32 - 1] * 4)) + b"\x00" * 16)
    with pytest.raises(ValueError) as info:
        read_idx(bad)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)


def _cifar(directory: Path) -> None:
    directory.mkdir(parents=True)
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        blob = pickle.dumps({"labels": [1, 2], "data": np.zeros((2, 3072), np.uint8)}, protocol=2)
        (directory / f).write_bytes(blob)


@pytest.mark.parametrize("cut", [0, 1, 40, -3])
def test_truncated_cifar_batch_is_a_value_error_naming_it(tmp_path, cut):
    d = tmp_path / "cifar-10-batches-py"
    _cifar(d)
    bad = d / "data_batch_3"
    bad.write_bytes(bad.read_bytes()[:cut])
    with pytest.raises(ValueError) as info:
        load_dataset("cifar10", data_dir=tmp_path)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)


def _k49(directory: Path) -> None:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    arrays = {"k49-train-imgs.npz": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
              "k49-train-labels.npz": np.array([0, 1, 48], np.uint8),
              "k49-test-imgs.npz": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
              "k49-test-labels.npz": np.array([2, 3], np.uint8)}
    for fname, arr in arrays.items():
        np.savez_compressed(directory / fname, arr)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "bad_member", "no_arr_0"])
def test_corrupt_k49_npz_is_a_value_error_naming_it(tmp_path, kind):
    d = tmp_path / "k49"
    _k49(d)
    assert load_dataset("kuzushiji49", data_dir=tmp_path).x_train.shape == (3, 784)
    bad = d / "k49-test-imgs.npz"
    blob = bad.read_bytes()
    if kind == "truncated":
        bad.write_bytes(blob[: len(blob) // 2])
    elif kind == "garbage":
        bad.write_bytes(b"not a zip file at all")
    elif kind == "bad_member":  # the zip directory is fine, the compressed member is not
        with zipfile.ZipFile(bad) as zf:
            info = zf.getinfo("arr_0.npy")
        data = bytearray(blob)
        off = info.header_offset
        start = off + 30 + int.from_bytes(data[off + 26 : off + 28], "little") + int.from_bytes(
            data[off + 28 : off + 30], "little")
        data[start + 4 : start + 20] = b"\xff" * 16
        bad.write_bytes(bytes(data))
    else:
        np.savez_compressed(bad, images=np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(ValueError) as info:
        load_dataset("kuzushiji49", data_dir=tmp_path)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)


def test_prepare_turns_a_corrupt_idx_file_into_a_config_error(tmp_path, no_debian):
    from common.config import ConfigError
    from server.app import prepare

    raw = tmp_path / "MNIST" / "raw"
    _write_set(raw, 1, gz=True)
    bad = raw / "t10k-labels-idx1-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:-6])
    with pytest.raises(ConfigError) as info:
        prepare({"dataset": "mnist", "model": "bnn", "data-dir": str(tmp_path)})
    msg = str(info.value)
    assert "data-dir" in msg and str(bad) in msg and "\n" not in msg


# ==================================================================================================
# 3. a failed download is a FileNotFoundError: the usual message plus the reason


@pytest.mark.parametrize("error", [RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried x"),
                                   OSError("[Errno -2] Name or service not known"),
                                   ImportError("download=True needs torchvision to fetch MNIST: pip install")])
@pytest.mark.parametrize("name", ["mnist", "kmnist", "fashion_mnist", "cifar10"])
def test_download_failure_is_file_not_found_with_the_reason(tmp_path, no_debian, monkeypatch, name, error):
    def failing(class_name, root):
        raise error

    monkeypatch.setattr(dsm, "_torchvision_download", failing)
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, data_dir=tmp_path, download=True)
    msg = str(info.value)
    assert "download failed" in msg and str(error).splitlines()[0] in msg
    assert "Searched" in msg and str(tmp_path) in msg and "\n" not in msg


def test_download_urlerror_is_file_not_found(tmp_path, monkeypatch):
    import urllib.error

    def failing(class_name, root):
        raise urllib.error.URLError("[Errno 111] Connection refused")

    monkeypatch.setattr(dsm, "_torchvision_download", failing)
    with pytest.raises(FileNotFoundError, match="download failed.*Connection refused"):
        load_dataset("mnist", data_dir=tmp_path, download=True)


@pytest.fixture
def closed_port(monkeypatch) -> int:
    """A loopback port nobody listens on; and no proxy, so urllib connects to it directly."""
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "*")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_real_torchvision_download_to_a_closed_port(tmp_path, no_debian, monkeypatch, closed_port, name):
    tvd = pytest.importorskip("torchvision.datasets")
    monkeypatch.setattr(getattr(tvd, _FAMILY[name]), "mirrors", [f"http://127.0.0.1:{closed_port}/"])
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, data_dir=tmp_path, download=True)
    msg = str(info.value)
    assert "download failed" in msg and f"127.0.0.1:{closed_port}" in msg and "\n" not in msg


def test_real_torchvision_cifar_download_to_a_closed_port(tmp_path, monkeypatch, closed_port):
    tvd = pytest.importorskip("torchvision.datasets")
    monkeypatch.setattr(tvd.CIFAR10, "url", f"http://127.0.0.1:{closed_port}/cifar-10-python.tar.gz")
    with pytest.raises(FileNotFoundError, match="download failed"):
        load_dataset("cifar10", data_dir=tmp_path, download=True)


def test_prepare_turns_a_failed_download_into_a_config_error(tmp_path, monkeypatch):
    from common.config import ConfigError
    from server.app import prepare

    def failing(class_name, root):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz: <urlopen error offline>")

    monkeypatch.setattr(dsm, "_torchvision_download", failing)
    with pytest.raises(ConfigError) as info:
        prepare({"dataset": "mnist", "model": "bnn", "data-dir": str(tmp_path), "download": True})
    msg = str(info.value)
    assert "data-dir" in msg and "download failed" in msg and "urlopen error offline" in msg and "\n" not in msg



@pytest.mark.parametrize("call", [
    lambda syn: syn.clutter_1d(5, inlier_shift=float("nan")),
    lambda syn: syn.clutter_1d(5, outlier_shift=float("inf")),
    lambda syn: syn.clutter_1d(5, theta=float("inf")),
    lambda syn: syn.clutter_1d(5, theta_prior_mean=float("nan")),
    lambda syn: syn.student_t_location(3, loc=float("nan")),
    lambda syn: syn.conjugate_linear_regression(3, dim=2, theta=[0.0, float("nan")]),
])
def test_synthetic_generators_refuse_non_finite_locations(call):
    """Stop-30 review: the scales were checked, the locations not: NaN or inf data came back without an error."""
    import common.data.synthetic as syn
    with pytest.raises(ValueError, match="must be (a )?finite"):
        call(syn)


# ==================================================================================================
# 3. content that a cast would silently change is refused, naming the file (review of 2026-11-28)


@pytest.mark.parametrize("data", [np.full((2, 3072), 0.5, np.float32),  # pixels already in [0, 1]: all black
                                  np.full((2, 3072), 300, np.int64),  # wrapped to 44
                                  np.full((2, 3072), -1, np.int64)])  # became 255
def test_cifar_pixels_that_are_not_uint8_are_refused_naming_the_batch(tmp_path, data):
    d = tmp_path / "cifar-10-batches-py"
    _cifar(d)
    bad = d / "data_batch_2"
    bad.write_bytes(pickle.dumps({"labels": [1, 2], "data": data}, protocol=2))
    with pytest.raises(ValueError, match="uint8") as info:
        load_dataset("cifar10", data_dir=tmp_path)
    assert _corrupt_message_ok(str(info.value), bad), str(info.value)


@pytest.mark.parametrize("labels, match", [([0.0, 1.5], "integer class indices"), ([1, 10], r"outside \[0, 10\)")])
def test_cifar_labels_are_checked_per_batch_file(tmp_path, labels, match):
    d = tmp_path / "cifar-10-batches-py"
    _cifar(d)
    bad = d / "data_batch_4"
    bad.write_bytes(pickle.dumps({"labels": labels, "data": np.zeros((2, 3072), np.uint8)}, protocol=2))
    with pytest.raises(ValueError, match=match) as info:
        load_dataset("cifar10", data_dir=tmp_path)
    assert str(bad) in str(info.value)


def test_idx_float_labels_are_refused_not_truncated(tmp_path, no_debian):
    _write_set(tmp_path / "mnist", 7)
    labels = np.array([0.0, 1.5, 2.9, 3.0], ">f4")  # IDX type 0x0D: float32, big-endian
    bad = tmp_path / "mnist" / "train-labels-idx1-ubyte"
    bad.write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 4) + labels.tobytes())
    with pytest.raises(ValueError, match="integer class indices") as info:
        load_dataset("mnist", data_dir=tmp_path)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("fname, arr, match", [
    ("k49-train-labels.npz", np.array([0.0, 1.5, 2.5]), "integer class indices"),
    ("k49-test-labels.npz", np.array([2, 49], np.uint8), r"outside \[0, 49\)"),
])
def test_k49_label_errors_name_the_file(tmp_path, fname, arr, match):
    d = tmp_path / "k49"
    _k49(d)
    np.savez_compressed(d / fname, arr)
    with pytest.raises(ValueError, match=match) as info:
        load_dataset("kuzushiji49", data_dir=tmp_path)
    assert str(d / fname) in str(info.value)
