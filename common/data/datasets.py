"""Real datasets as numpy arrays, loaded local-first.

:func:`load_dataset` returns a :class:`Dataset`: flattened, scaled float32 inputs and int64 labels, with the
dataset's canonical train/test split (or a seeded stratified split for the small scikit-learn sets).

Names and where the data come from:

================  ==================================================================================
``breast_cancer`` scikit-learn's embedded WDBC (569 x 30, 2 classes); stratified split by ``seed``,
                  features standardised with the *training* mean and standard deviation.
``digits``        scikit-learn's embedded 8x8 digits (1,797 x 64, 10 classes); stratified split by
                  ``seed``, pixels / 16.
``fashion_mnist`` IDX files (``.gz`` or not) in ``data_dir/FashionMNIST/raw`` (torchvision's layout),
                  ``data_dir/fashion_mnist``, then Debian's ``/usr/share/datasets/fashion-mnist``
                  (``apt-get install -y dataset-fashion-mnist``), then a torchvision download if
                  ``download=True``.
``mnist``         IDX files in ``data_dir/MNIST/raw`` (torchvision's layout) or ``data_dir/mnist``, else a
                  torchvision download if ``download=True``.
``kmnist``        as ``mnist``, under ``data_dir/KMNIST/raw`` or ``data_dir/kmnist``.
``cifar10``       the python pickles ``data_batch_1..5`` and ``test_batch`` in
                  ``data_dir/cifar-10-batches-py`` (torchvision's layout) or ``data_dir``, else a
                  torchvision download if ``download=True``.  Flattened in the pickle's channel-major
                  order (3 x 32 x 32, i.e. what ``ToTensor()`` then ``flatten()`` gives).
``kuzushiji49``   the ``k49-{train,test}-{imgs,labels}.npz`` files in ``data_dir`` or
                  ``data_dir/k49``; no automatic download.
================  ==================================================================================

The two small sets are read from the data files the scikit-learn wheel ships (``sklearn/datasets/data``,
located with ``importlib.util.find_spec``), parsed into the arrays scikit-learn's own loaders return (tested
byte for byte), and split by :func:`common.data.stratified_split.stratified_split`, which reproduces
``train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)`` exactly: the arrays are
bit-identical to the scikit-learn route, but scikit-learn (and scipy) is never imported.  That saves 60-80 MB of
resident memory per process (80 MB in a fresh process after ``import torch``, 59-73 MB in the processes of a
simulation) and keeps a second libgomp out of the processes that also run torch.

All image sets are scaled to [0, 1] (pixels / 255) and flattened.  The IDX reader and the CIFAR reader are
our own, so reading never needs torchvision; torchvision is imported lazily and only to download.  When
``data_dir`` is ``None`` the root is ``$PGVI_DATA_DIR`` if set, else ``~/.cache/pgvi/data``.

The three MNIST-family sets use the same four file names (``train-images-idx3-ubyte`` ...), so each is
looked for only in folders that name it, never in ``data_dir`` itself: files copied flat into a shared root
would otherwise be read as MNIST, KMNIST and Fashion-MNIST alike.  The one exception: flat files in
``data_dir`` are read when the directory's own name identifies the dataset (compared lower-case without ``-``
and ``_``: ``mnist``; ``kmnist``; ``fashion_mnist``, ``fashion-mnist`` or ``FashionMNIST``), e.g.
``data_dir=/usr/share/datasets/fashion-mnist`` for ``fashion_mnist``.

A data file that cannot be read (truncated copy, wrong format, bad gzip/zip/pickle stream, malformed IDX header)
raises ``ValueError`` naming the file; a failed download (``download=True`` without network) raises
``FileNotFoundError`` with the usual not-found message and the reason.

Datasets with a canonical split (the image sets) ignore ``seed`` and ``test_fraction``.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
import pickle
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.data.stratified_split import stratified_split
from common.registry import Registry

__all__ = [
    "DEBIAN_FASHION_MNIST_DIR",
    "Dataset",
    "DatasetLoader",
    "dataset_names",
    "default_data_dir",
    "load_dataset",
    "read_idx",
]

#: Where Debian's ``dataset-fashion-mnist`` package installs the original IDX ``.gz`` files.
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

#: Environment variable naming the default data root.
DATA_DIR_ENV = "PGVI_DATA_DIR"


# --------------------------------------------------------------------------------------------------
# the container


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test pair of numpy arrays.

    Attributes:
        x_train: float32, shape ``(N_train, D)``: flattened, scaled inputs.
        y_train: classification: int64, shape ``(N_train,)``, labels in ``[0, num_classes)``;
            regression: floating, shape ``(N_train, 1)``.
        x_test: float32, shape ``(N_test, D)``.
        y_test: as ``y_train``, for the test set.
        num_classes: number of classes, or ``None`` for a regression dataset.
        name: the registry name (or any label for a hand-built dataset).
        input_shape: the shape of one input before flattening (e.g. ``(1, 28, 28)``, ``(3, 32, 32)``,
            ``(30,)``); its product is ``D``.

    The arrays are validated on construction (dtypes, shapes, label range); they are not copied, and
    "frozen" refers to the attributes, not to the arrays' contents.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int | None
    name: str
    input_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x = getattr(self, f"x_{split}")
            y = getattr(self, f"y_{split}")
            if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
                raise ValueError(
                    f"x_{split} must be a float32 numpy array of shape (N, D), got "
                    f"{type(x).__name__} {getattr(x, 'dtype', None)} {getattr(x, 'shape', None)}"
                )
            if not isinstance(y, np.ndarray):
                raise ValueError(f"y_{split} must be a numpy array, got {type(y).__name__}")
            if y.shape[0] != x.shape[0]:
                raise ValueError(f"x_{split} has {x.shape[0]} rows but y_{split} has {y.shape[0]}")
            if self.num_classes is None:
                if not np.issubdtype(y.dtype, np.floating) or y.ndim != 2 or y.shape[1] != 1:
                    raise ValueError(
                        f"regression y_{split} (num_classes=None) must be floating with shape (N, 1), "
                        f"got {y.dtype} {y.shape}"
                    )
            else:
                if y.dtype != np.int64 or y.ndim != 1:
                    raise ValueError(f"y_{split} must be int64 of shape (N,), got {y.dtype} {y.shape}")
                if y.size and (y.min() < 0 or y.max() >= self.num_classes):
                    raise ValueError(
                        f"y_{split} has labels outside [0, {self.num_classes}): "
                        f"min {y.min()}, max {y.max()}"
                    )
        if self.x_train.shape[1] != self.x_test.shape[1]:
            raise ValueError(
                f"x_train has {self.x_train.shape[1]} features but x_test has {self.x_test.shape[1]}"
            )
        if self.num_classes is not None and (not isinstance(self.num_classes, int) or self.num_classes < 2):
            raise ValueError(f"num_classes must be an int >= 2 or None, got {self.num_classes!r}")
        shape = tuple(int(s) for s in self.input_shape) or (int(self.x_train.shape[1]),)
        if int(np.prod(shape)) != self.x_train.shape[1]:
            raise ValueError(f"input_shape {shape} does not have {self.x_train.shape[1]} elements")
        object.__setattr__(self, "input_shape", shape)

    @property
    def is_classification(self) -> bool:
        return self.num_classes is not None

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, train={self.x_train.shape}, test={self.x_test.shape}, "
            f"num_classes={self.num_classes}, input_shape={self.input_shape})"
        )


# --------------------------------------------------------------------------------------------------
# readers

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def _open_maybe_gz(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _corrupt(path: Path, fmt: str, why: object) -> ValueError:
    """The error for a data file that exists but cannot be read as ``fmt``."""
    why = " ".join(str(why).split()) or type(why).__name__
    return ValueError(f"{path}: corrupt or truncated {fmt} file ({why}); delete it and copy it again")


# What a damaged gzip / zip / pickle / npy stream raises while it is read (``zlib.error`` is not an OSError).
# Errors of opening the file (missing, permissions) are not among them: the file is opened outside the ``try``.
_STREAM_ERRORS = (OSError, EOFError, zlib.error, zipfile.BadZipFile)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (the MNIST family's format), gzip-compressed if its name ends in ``.gz``.

    Format: two zero bytes, a type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
    0x0E float64), the number of dimensions ``nd``, then ``nd`` big-endian uint32 sizes, then the data in
    C order, big-endian.  Returns an array of that shape in native byte order.

    Raises:
        ValueError: the file cannot be read (a truncated or damaged gzip stream, or not gzip at all), a bad
            magic number, an unknown type code, a short header, or a data section of the wrong length; the
            message names the file.
        OSError: the file cannot be opened (e.g. ``FileNotFoundError``, ``PermissionError``).
    """
    path = Path(path)
    with _open_maybe_gz(path) as f:
        try:
            raw = f.read()
        except _STREAM_ERRORS as e:
            raise _corrupt(path, "IDX", f"{type(e).__name__}: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise _corrupt(path, "IDX", f"not an IDX file: the first two bytes must be zero, file has {len(raw)} bytes")
    code, nd = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise _corrupt(path, "IDX", f"unknown IDX type code 0x{code:02x}")
    header = 4 + 4 * nd
    if len(raw) < header:
        raise _corrupt(path, "IDX", f"truncated IDX header: {nd} dimensions declared, file has {len(raw)} bytes")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(nd))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = math.prod(dims) * dtype.itemsize  # Python ints: no overflow for absurd headers
    if len(raw) - header != expected:
        raise _corrupt(
            path, "IDX", f"IDX data section has {len(raw) - header} bytes, expected {expected} for shape {dims}"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: ``data`` (N, 3072) uint8 channel-major, ``labels`` list of N ints.

    These files are pickles, so only read files you trust (the official CIFAR-10 archive).
    """
    with open(path, "rb") as f:
        try:
            entry = pickle.load(f, encoding="latin1")
        except (*_STREAM_ERRORS, pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError,
                IndexError, KeyError, OverflowError, MemoryError) as e:  # what a damaged pickle stream can raise
            raise _corrupt(path, "CIFAR-10 pickle", f"{type(e).__name__}: {e}") from e
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        raise _corrupt(path, "CIFAR-10 pickle", "not a CIFAR-10 python batch: expected a dict with 'data' and "
                       "'labels'")
    try:
        data = np.asarray(entry["data"])  # no dtype= here: a cast would wrap 300 to 44 and zero [0, 1] floats
        labels = np.asarray(entry["labels"])
    except (ValueError, TypeError, OverflowError) as e:
        raise _corrupt(path, "CIFAR-10 pickle", f"{type(e).__name__}: {e}") from e
    if data.dtype != np.uint8:
        raise _corrupt(path, "CIFAR-10 pickle", f"'data' must hold uint8 pixels, got {data.dtype}")
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.ndim != 1 or data.shape[0] != labels.shape[0]:
        raise _corrupt(path, "CIFAR-10 pickle", f"data {data.shape} / labels {labels.shape} are not (N, 3072) / (N,)")
    return data, _labels(labels, 10, f"cifar10: {path}")


def _read_npz_array(path: Path, fmt: str) -> np.ndarray:
    """The array ``arr_0`` of an ``.npz`` file (how the Kuzushiji-49 files store theirs); pickles refused."""
    with open(path, "rb") as f:  # opening errors (missing, permissions) propagate as they are
        try:
            loaded = np.load(f, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ValueError(f"not an .npz archive (np.load gave a {type(loaded).__name__})")
            with loaded as npz:
                return np.asarray(npz["arr_0"])
        except (*_STREAM_ERRORS, ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise _corrupt(path, fmt, f"{type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------------
# helpers


def default_data_dir() -> Path:
    """``$PGVI_DATA_DIR`` if set, else ``~/.cache/pgvi/data``."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/pgvi/data").expanduser()


def _root(data_dir: str | os.PathLike[str] | None) -> Path:
    return Path(data_dir).expanduser() if data_dir is not None else default_data_dir()


def _check_fraction(test_fraction: float) -> float:
    if not (0.0 < float(test_fraction) < 1.0):
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    return float(test_fraction)


def _scale_images(images: np.ndarray, name: str) -> np.ndarray:
    """uint8 images (N, ...) -> float32 (N, prod(...)) in [0, 1]."""
    if images.dtype != np.uint8:
        raise ValueError(f"{name}: expected uint8 pixels, got {images.dtype}")
    return (images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(255.0)).astype(np.float32)


def _labels(labels: np.ndarray, num_classes: int, name: str) -> np.ndarray:
    """Class indices in ``[0, num_classes)`` as int64; an array of another kind (a float label would be truncated to
    another class: 1.5 -> 1) is refused, as are labels out of range (``name`` says where they came from)."""
    y = np.asarray(labels)
    if y.size and y.dtype.kind not in "iu":
        raise ValueError(f"{name}: labels must be integer class indices, got dtype {y.dtype}")
    y = y.astype(np.int64).reshape(-1)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{name}: labels outside [0, {num_classes}): min {y.min()}, max {y.max()}")
    return y


_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _find_idx_files(directory: Path) -> dict[str, Path] | None:
    """The four MNIST-family files in ``directory`` (each raw or ``.gz``), or ``None`` if any is missing."""
    found: dict[str, Path] = {}
    for key, stem in _MNIST_FILES.items():
        for candidate in (directory / stem, directory / f"{stem}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            return None
    return found


def _idx_dataset(files: dict[str, Path], name: str, num_classes: int) -> Dataset:
    """The dataset of the four IDX files; a file whose content does not fit (shape, dtype, labels) is a
    ``ValueError`` naming it."""
    arrays = {key: read_idx(path) for key, path in files.items()}
    where = {key: f"{name}: {path}" for key, path in files.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{name}: {split} images {x.shape} ({files[f'x_{split}']}) and labels {y.shape} "
                f"({files[f'y_{split}']}) are not (N, H, W) and (N,)"
            )
    h, w = arrays["x_train"].shape[1:]
    if arrays["x_test"].shape[1:] != (h, w):
        raise ValueError(f"{name}: train images are {h}x{w} ({files['x_train']}) but test images are "
                         f"{arrays['x_test'].shape[1:]} ({files['x_test']})")
    return Dataset(
        x_train=_scale_images(arrays["x_train"], where["x_train"]),
        y_train=_labels(arrays["y_train"], num_classes, where["y_train"]),
        x_test=_scale_images(arrays["x_test"], where["x_test"]),
        y_test=_labels(arrays["y_test"], num_classes, where["y_test"]),
        num_classes=num_classes,
        name=name,
        input_shape=(1, int(h), int(w)),
    )


def _missing(
    name: str,
    searched: Sequence[Path | str],
    expected: Sequence[str],
    how: Sequence[str],
    download_error: BaseException | None = None,
) -> FileNotFoundError:
    lines = [f"{name}: data files not found."]
    lines.append("Searched: " + ", ".join(str(p) for p in searched) + ".")
    lines.append("Expected files: " + ", ".join(expected) + ".")
    lines.append("To get the data: " + "; or ".join(how) + ".")
    if download_error is not None:
        reason = " ".join(str(download_error).split()) or "no details"
        lines.append(f"(download failed: {type(download_error).__name__}: {reason})")
    return FileNotFoundError(" ".join(lines))


# What a failed torchvision download raises: its MNIST-family classes wrap every mirror's error in a
# RuntimeError; CIFAR10 lets urllib's URLError (an OSError) or an integrity-check RuntimeError through; a root
# that cannot be created is an OSError; an install without torchvision is our ImportError below.
_DOWNLOAD_ERRORS = (RuntimeError, OSError, ImportError)


def _torchvision_download(class_name: str, root: Path) -> None:
    """Download a torchvision dataset (both splits) into ``root``.  Needs torchvision and the network."""
    try:
        import torchvision.datasets as tvd  # lazy: the client-only install has no torchvision
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            f"download=True needs torchvision to fetch {class_name}: pip install 'pgvi[data]' "
            "(or put the files in data_dir yourself)"
        ) from e
    root.mkdir(parents=True, exist_ok=True)
    cls = getattr(tvd, class_name)
    for train in (True, False):
        cls(str(root), train=train, download=True)


# --------------------------------------------------------------------------------------------------
# loaders

DatasetLoader = Callable[..., Dataset]
DATASETS: Registry[Dataset] = Registry("dataset")


def _sklearn_data_dir() -> Path | None:
    """The installed scikit-learn's ``datasets/data`` folder, or ``None`` if scikit-learn is not installed.

    ``find_spec`` of a top-level package asks the import system's finders where it is (or returns the spec of an
    already imported one); it does not import scikit-learn.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"


def _sklearn_data_file(name: str, filename: str) -> Path:
    directory = _sklearn_data_dir()
    if directory is not None and (directory / filename).is_file():
        return directory / filename
    raise _missing(
        name,
        [directory if directory is not None else "sys.path (scikit-learn is not installed)"],
        [filename],
        ["pip install 'pgvi[data]' (scikit-learn ships the file; it is read, never imported)"],
    )


def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits(return_X_y=True)`` from its file: ``digits.csv.gz`` holds 1,797 rows of
    64 pixel counts (0..16) then the label, read into float64 with ``np.loadtxt`` as scikit-learn does."""
    path = _sklearn_data_file("digits", "digits.csv.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",", ndmin=2)
    if data.shape[1] != 65:
        raise ValueError(f"digits: {path} has {data.shape[1]} columns, expected 64 pixels and a label")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _read_breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_breast_cancer(return_X_y=True)`` from its file: ``breast_cancer.csv`` starts
    with a header line ``n_samples,n_features,<target names>`` (``569,30,malignant,benign``), then one row per
    sample: the 30 features, then the label (0 malignant, 1 benign)."""
    path = _sklearn_data_file("breast_cancer", "breast_cancer.csv")
    with open(path, encoding="utf-8") as f:
        header = f.readline().split(",")
        data = np.loadtxt(f, delimiter=",", ndmin=2)
    expected = (int(header[0]), int(header[1]) + 1)
    if data.shape != expected:
        raise ValueError(f"breast_cancer: {path} holds {data.shape} values, its header says {expected}")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _stratified(x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float):
    train, test = stratified_split(y, test_fraction, seed)
    return x[train], x[test], y[train], y[test]


@DATASETS.register("breast_cancer")
def _load_breast_cancer(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    test_fraction = _check_fraction(test_fraction)
    x, y = _read_breast_cancer()
    x_tr, x_te, y_tr, y_te = _stratified(x, y, seed, test_fraction)
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0)
    if np.any(std == 0):  # pragma: no cover - not the case for WDBC
        raise ValueError("breast_cancer: a feature is constant on the training split")
    return Dataset(
        x_train=((x_tr - mean) / std).astype(np.float32),
        y_train=y_tr.astype(np.int64),
        x_test=((x_te - mean) / std).astype(np.float32),
        y_test=y_te.astype(np.int64),
        num_classes=2,
        name="breast_cancer",
        input_shape=(30,),
    )


@DATASETS.register("digits")
def _load_digits(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    test_fraction = _check_fraction(test_fraction)
    x, y = _read_digits()
    x_tr, x_te, y_tr, y_te = _stratified(x, y, seed, test_fraction)
    return Dataset(
        x_train=(x_tr / 16.0).astype(np.float32),
        y_train=y_tr.astype(np.int64),
        x_test=(x_te / 16.0).astype(np.float32),
        y_test=y_te.astype(np.int64),
        num_classes=10,
        name="digits",
        input_shape=(1, 8, 8),
    )


def _dataset_key(text: str) -> str:
    """``fashion_mnist``, ``fashion-mnist``, ``FashionMNIST`` -> ``fashionmnist``: how a folder names a dataset."""
    return text.lower().replace("-", "").replace("_", "")


def _mnist_family(name: str, tv_class: str, data_dir, download: bool, extra_dirs: Sequence[Path] = (),
                  extra_how: Sequence[str] = ()) -> Dataset:
    """MNIST, KMNIST or Fashion-MNIST from the first of these folders holding the four IDX files:

    1. ``root/<tv_class>/raw`` (torchvision's layout, where ``download=True`` puts them);
    2. ``root/<name>`` (e.g. ``root/fashion_mnist``);
    3. ``root`` itself, only if its own name identifies this dataset (``_dataset_key(root.name)`` equals that
       of ``name``), e.g. ``data_dir=/usr/share/datasets/fashion-mnist`` or ``data_dir=~/data/mnist``;
    4. ``extra_dirs`` (Fashion-MNIST: Debian's ``/usr/share/datasets/fashion-mnist``).

    The three datasets share the file names, so a root of any other name is never read flat: files copied
    there would be taken for all three.  Then a torchvision download into ``root`` if ``download``.
    """
    root = _root(data_dir)
    local = [root / tv_class / "raw", root / name]
    if _dataset_key(root.name) == _dataset_key(name):
        local.append(root)
    searched = [*local, *extra_dirs]
    expected = [f"{stem}[.gz]" for stem in _MNIST_FILES.values()]
    how = [*extra_how,
           f"the run config's download=true (in Python: load_dataset({name!r}, download=True); needs torchvision "
           f"and network) into {root}",
           f"copy the IDX files into {root / name} or {root / tv_class / 'raw'}"]
    for directory in searched:
        files = _find_idx_files(directory)
        if files is not None:
            return _idx_dataset(files, name, 10)
    if download:
        try:
            _torchvision_download(tv_class, root)
        except _DOWNLOAD_ERRORS as e:
            raise _missing(name, searched, expected, how, download_error=e) from e
        files = _find_idx_files(root / tv_class / "raw")
        if files is None:  # pragma: no cover - torchvision changed its layout
            raise FileNotFoundError(f"{name}: torchvision reported a download but {root / tv_class / 'raw'} "
                                    "does not hold the four IDX files")
        return _idx_dataset(files, name, 10)
    raise _missing(name, searched, expected, how)


@DATASETS.register("fashion_mnist")
def _load_fashion_mnist(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    return _mnist_family(
        "fashion_mnist",
        "FashionMNIST",
        data_dir,
        download,
        extra_dirs=[DEBIAN_FASHION_MNIST_DIR],
        extra_how=[f"apt-get install -y dataset-fashion-mnist (installs {DEBIAN_FASHION_MNIST_DIR})"],
    )


@DATASETS.register("mnist")
def _load_mnist(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    return _mnist_family("mnist", "MNIST", data_dir, download)


@DATASETS.register("kmnist")
def _load_kmnist(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    return _mnist_family("kmnist", "KMNIST", data_dir, download)


_CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_CIFAR_TEST = ["test_batch"]


def _find_cifar(directory: Path) -> bool:
    return all((directory / f).is_file() for f in _CIFAR_TRAIN + _CIFAR_TEST)


def _cifar_dataset(directory: Path) -> Dataset:
    parts = {}
    for split, files in (("train", _CIFAR_TRAIN), ("test", _CIFAR_TEST)):
        batches = [_read_cifar_batch(directory / f) for f in files]
        parts[split] = (np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]))
    return Dataset(
        x_train=_scale_images(parts["train"][0], "cifar10"),
        y_train=parts["train"][1],  # checked per batch file by _read_cifar_batch
        x_test=_scale_images(parts["test"][0], "cifar10"),
        y_test=parts["test"][1],
        num_classes=10,
        name="cifar10",
        input_shape=(3, 32, 32),
    )


@DATASETS.register("cifar10")
def _load_cifar10(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    root = _root(data_dir)
    searched = [root / "cifar-10-batches-py", root]
    for directory in searched:
        if _find_cifar(directory):
            return _cifar_dataset(directory)
    how = [f"the run config's download=true (in Python: load_dataset('cifar10', download=True); needs torchvision "
           f"and network) into {root}",
           f"unpack cifar-10-python.tar.gz into {root}"]
    if download:
        try:
            _torchvision_download("CIFAR10", root)
        except _DOWNLOAD_ERRORS as e:
            raise _missing("cifar10", searched, _CIFAR_TRAIN + _CIFAR_TEST, how, download_error=e) from e
        if not _find_cifar(root / "cifar-10-batches-py"):  # pragma: no cover - torchvision changed its layout
            raise FileNotFoundError(f"cifar10: torchvision reported a download but {searched[0]} is incomplete")
        return _cifar_dataset(root / "cifar-10-batches-py")
    raise _missing("cifar10", searched, _CIFAR_TRAIN + _CIFAR_TEST, how)


_K49_FILES = {
    "x_train": "k49-train-imgs.npz",
    "y_train": "k49-train-labels.npz",
    "x_test": "k49-test-imgs.npz",
    "y_test": "k49-test-labels.npz",
}


@DATASETS.register("kuzushiji49")
def _load_kuzushiji49(
    data_dir: str | None = None, download: bool = False, seed: int = 0, test_fraction: float = 0.2
) -> Dataset:
    root = _root(data_dir)
    searched = [root / "k49", root]
    how = [
        "download the four k49-*.npz files from http://codh.rois.ac.jp/kmnist/dataset/k49/ "
        f"into {root / 'k49'} (no automatic download: torchvision has no Kuzushiji-49 loader)"
    ]
    for directory in searched:
        if all((directory / f).is_file() for f in _K49_FILES.values()):
            arrays = {key: _read_npz_array(directory / fname, "Kuzushiji-49 .npz")
                      for key, fname in _K49_FILES.items()}
            where = {key: f"kuzushiji49: {directory / fname}" for key, fname in _K49_FILES.items()}
            for split in ("train", "test"):
                x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
                if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
                    raise ValueError(f"kuzushiji49: {split} images {x.shape} ({directory / _K49_FILES[f'x_{split}']}) "
                                     f"and labels {y.shape} ({directory / _K49_FILES[f'y_{split}']}) are not "
                                     "(N, H, W) and (N,)")
            h, w = arrays["x_train"].shape[1:]
            return Dataset(
                x_train=_scale_images(arrays["x_train"], where["x_train"]),
                y_train=_labels(arrays["y_train"], 49, where["y_train"]),
                x_test=_scale_images(arrays["x_test"], where["x_test"]),
                y_test=_labels(arrays["y_test"], 49, where["y_test"]),
                num_classes=49,
                name="kuzushiji49",
                input_shape=(1, int(h), int(w)),
            )
    if download:
        raise FileNotFoundError(
            "kuzushiji49: download=True is not supported. " + str(_missing("kuzushiji49", searched,
                                                                          list(_K49_FILES.values()), how))
        )
    raise _missing("kuzushiji49", searched, list(_K49_FILES.values()), how)


# --------------------------------------------------------------------------------------------------
# public entry point


def dataset_names() -> list[str]:
    """The names :func:`load_dataset` accepts."""
    return DATASETS.names()


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> Dataset:
    """Load a dataset by registry name (see the module docstring for the names and sources).

    Args:
        name: one of :func:`dataset_names`.
        data_dir: where to look for (and download to) files; default ``$PGVI_DATA_DIR`` or
            ``~/.cache/pgvi/data``.
        download: allow a torchvision download when the files are not found locally.
        seed: seed of the stratified train/test split (datasets without a canonical split only).
        test_fraction: test share of that split, in (0, 1) (datasets without a canonical split only).

    Raises:
        KeyError: unknown name (the message lists the known ones).
        FileNotFoundError: files missing and ``download=False``, or the download failed (the message then ends
            with ``(download failed: ...)``); the message lists the paths searched and how to get the data.
        ValueError: a data file is corrupt or truncated (the message names it), or holds malformed arrays.
    """
    loader = DATASETS.get(name)
    return loader(data_dir=data_dir, download=bool(download), seed=int(seed), test_fraction=test_fraction)
