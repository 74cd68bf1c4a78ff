"""Label contamination of a training set (the test set is never contaminated).

Both functions choose exactly ``round(rate * n)`` distinct points (numpy's round, half to even) uniformly
at random and give each a label different from its own; they return ``(new_labels, flipped_mask)`` and
never modify their input.

* :func:`random_flip` (FedGVI's Fashion-MNIST experiment): each chosen point gets a uniformly random *other*
  class, independently.
* :func:`class_map_flip` (FedGVI's MNIST experiment, App. C.3.1): one map ``c -> m(c)`` with ``m(c) != c``
  drawn once (each ``m(c)`` uniform over the other classes, independently, so two classes may share a
  target); every chosen point of class ``c`` becomes ``m(c)``.

Random stream: ``rng = np.random.default_rng(seed)``; the points are ``rng.choice(n, k, replace=False)``, as in
the FedGVI reference code, so with the same seed the *same points* are flipped.  The new labels are then drawn
from the same ``rng`` (random_flip: one uniform draw over the other classes per chosen point, in order;
class_map_flip: one per class, classes in order).  The reference code re-seeds a fresh generator before drawing
the new labels, so the new labels are not the paper's (checked on 2026-11-23: 11 % of flipped points agree
for random_flip, about chance; 30 % for class_map_flip).  The runs of ``common.problem`` contaminate with
``seed = run seed + 4242``, so each seed also draws its own noise; the paper fixes the noise seed at 42.
"""

from __future__ import annotations

import numpy as np

__all__ = ["class_map_flip", "random_flip"]


def _check(y: np.ndarray, rate: float, num_classes: int, seed: int) -> tuple[np.ndarray, float, int]:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    rate = float(rate)
    if not (0.0 <= rate < 1.0):
        raise ValueError(f"rate must be in [0, 1), got {rate}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got min {y.min()}, max {y.max()}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return y, rate, int(num_classes)


def _choose(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    return rng.choice(n, int(np.round(rate * n)), replace=False)


def _other_class(current: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Map a draw ``d`` uniform on ``{0..C-2}`` to the ``d``-th class of ``{0..C-1} \\ {current}``."""
    return draws + (draws >= current)


def _prepare(
    y: np.ndarray, rate: float, num_classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.random.Generator]:
    """Validated copy of the labels, an all-False mask, the chosen indices (empty for rate 0), the class count
    and the generator that chose them (the caller draws the new classes from it next)."""
    y, rate, c = _check(y, rate, num_classes, seed)
    rng = np.random.default_rng(seed)
    new = y.astype(np.int64, copy=True)
    mask = np.zeros(y.shape[0], dtype=bool)
    if rate == 0.0 or y.size == 0:
        return new, mask, np.zeros(0, dtype=np.int64), c, rng
    return new, mask, _choose(y.shape[0], rate, rng), c, rng


def random_flip(y: np.ndarray, rate: float, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Give ``round(rate * n)`` random points a uniformly random other class.

    Returns:
        ``(new_labels, flipped_mask)``: a new int64 array, and a bool mask of the chosen points (on which
        ``new_labels != y``).
    """
    new, mask, idx, c, rng = _prepare(y, rate, num_classes, seed)
    if idx.size:
        new[idx] = _other_class(new[idx], rng.integers(0, c - 1, size=idx.size))
        mask[idx] = True
    return new, mask


def class_map_flip(y: np.ndarray, rate: float, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Relabel ``round(rate * n)`` random points through one random class map ``c -> m(c) != c``.

    Returns:
        ``(new_labels, flipped_mask)`` as in :func:`random_flip`.
    """
    new, mask, idx, c, rng = _prepare(y, rate, num_classes, seed)
    if idx.size:
        classes = np.arange(c, dtype=np.int64)
        target = _other_class(classes, rng.integers(0, c - 1, size=c))
        new[idx] = target[new[idx]]
        mask[idx] = True
    return new, mask
