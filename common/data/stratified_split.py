"""A seeded stratified train/test split, index for index the one scikit-learn's ``train_test_split`` makes.

:func:`stratified_split` returns the row indices that
``sklearn.model_selection.train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)``
puts in the train and the test set, in the same order (``StratifiedShuffleSplit`` with one split, as in
scikit-learn 1.9.1; the tests compare it with the installed scikit-learn).  It exists so that the seeded splits
of the embedded ``digits`` and ``breast_cancer`` sets (:mod:`common.data.datasets`) stay exactly the ones the
project has always used while loading them no longer imports scikit-learn: that import costs 60-80 MB of
resident memory in every process that loads them (the ServerApp and each simulation client actor) and maps
scikit-learn's own libgomp next to torch's.

One ``np.random.RandomState(seed)`` drives every random step, in this order:

1. sizes: ``n_test = ceil(test_fraction * n)`` (of the float product: ``0.07 * 100`` is ``7.000000000000001``,
   so 8 test points), ``n_train = n - n_test``;
2. per-class counts: ``n_i = approximate_mode(class_counts, n_train)`` for train, then
   ``t_i = approximate_mode(class_counts - n_i, n_test)`` for test (each draws from the stream whenever a
   remainder is left to hand out);
3. for each class, in sorted label order, a permutation of its indices (ascending): the first ``n_i`` go to
   train, the next ``t_i`` to test;
4. a permutation of the concatenated train indices, then one of the test indices.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["approximate_mode", "stratified_split"]


def approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class draw counts that sum to ``n_draws``, in proportion to ``class_counts``.

    scikit-learn's ``sklearn.utils.extmath._approximate_mode``: floor each share
    ``class_counts / class_counts.sum() * n_draws`` (these float operations, in this order), then add one to the
    classes with the largest remainders until the counts sum to ``n_draws``.  Remainder levels are visited from
    the largest down, and at each level ``rng.choice(tied classes, size=min(#tied, still needed),
    replace=False)`` picks the classes; it is called, and draws from ``rng``, even when it takes all of them.
    """
    continuous = class_counts / class_counts.sum() * n_draws
    counts = np.floor(continuous)
    need = int(n_draws - counts.sum())
    remainder = continuous - counts
    for value in np.unique(remainder)[::-1]:
        if need == 0:
            break
        (tied,) = np.nonzero(remainder == value)
        take = min(len(tied), need)
        counts[rng.choice(tied, size=take, replace=False)] += 1
        need -= take
    return counts.astype(np.int64)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, test)`` of a stratified split of the labels ``y`` (see the module docstring).

    Args:
        y: labels, shape ``(n,)``, any sortable dtype.
        test_fraction: test share, in (0, 1); the test set has ``ceil(test_fraction * n)`` points.
        seed: seed of the ``np.random.RandomState`` (a non-negative int, as ``random_state``).

    Returns:
        Two int64 index arrays into ``y``, disjoint and together covering ``0..n-1``, each in shuffled order.

    Raises:
        ValueError: ``y`` not 1-D, ``test_fraction`` outside (0, 1), an empty train set, a class with fewer
            than 2 members, or a train or test set smaller than the number of classes (scikit-learn's errors).
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"stratified split: labels must have shape (n,), got {y.shape}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"stratified split: test_fraction must be in (0, 1), got {test_fraction}")
    n = y.shape[0]
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test
    if n_train == 0:
        raise ValueError(
            f"stratified split: test_fraction={test_fraction} of {n} points leaves an empty train set"
        )
    classes, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    if class_counts.min() < 2:
        raise ValueError(
            "stratified split: every class needs at least 2 members (one for train, one for test); "
            f"classes with 1: {classes[class_counts < 2].tolist()}"
        )
    for split, size in (("train", n_train), ("test", n_test)):
        if size < len(classes):
            raise ValueError(
                f"stratified split: test_fraction={test_fraction} of {n} points gives a {split} set of {size}, "
                f"fewer than the {len(classes)} classes (each class needs a point in each set)"
            )

    by_class = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = approximate_mode(class_counts, n_train, rng)
    t_i = approximate_mode(class_counts - n_i, n_test, rng)
    train, test = [], []
    for indices, count, n_tr, n_te in zip(by_class, class_counts, n_i, t_i):
        shuffled = indices[rng.permutation(count)]
        train.append(shuffled[:n_tr])
        test.append(shuffled[n_tr : n_tr + n_te])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))
