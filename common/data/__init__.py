"""Data path of the PGVI core: real datasets, client partitions, label contamination, synthetic DGPs.

numpy only at import time: torchvision is imported lazily, and only to download; scikit-learn is never imported
(the embedded sets are read from the files its wheel ships), so a client-only install can import this package.
"""

from common.data.contamination import class_map_flip, random_flip
from common.data.datasets import Dataset, dataset_names, default_data_dir, load_dataset, read_idx
from common.data.partition import (
    apportion,
    dirichlet,
    iid,
    label_counts,
    label_skew,
    partition,
    partitioner_names,
    shards,
    size_skew,
)
from common.data.synthetic import (
    ClutterData,
    LinearRegressionData,
    Logistic2DData,
    clutter_1d,
    conjugate_linear_regression,
    logistic_2d_with_outliers,
    student_t_location,
)

__all__ = [
    "ClutterData",
    "Dataset",
    "LinearRegressionData",
    "Logistic2DData",
    "apportion",
    "class_map_flip",
    "clutter_1d",
    "conjugate_linear_regression",
    "dataset_names",
    "default_data_dir",
    "dirichlet",
    "iid",
    "label_counts",
    "label_skew",
    "load_dataset",
    "logistic_2d_with_outliers",
    "partition",
    "partitioner_names",
    "random_flip",
    "read_idx",
    "shards",
    "size_skew",
    "student_t_location",
]
