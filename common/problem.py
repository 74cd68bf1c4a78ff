"""Build a PGVI problem (data shard, model, prior, loss, divergences, optimiser settings) from a RunConfig.

The server, every client and the in-process runner call the same builder, so a run's pieces agree by
construction: the same seed gives every client the same partition of the same contaminated training set.  The
partition is drawn from the clean labels (the label noise does not move points between clients); each client then
holds the contaminated labels of its points.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from common.config import SYNTHETIC_DATASETS, ConfigError, RunConfig
from common.divergences import Divergence, make_divergence
from common.factors import ServerStep
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.local_gvi import LocalGVIConfig
from common.likelihoods import check_class_labels
from common.losses import Loss, make_loss, weighted
from common.models import LikelihoodModel, make_model
from common.server_gvi import make_server_step

DIRICHLET_MIN_SIZE = 10  # partitioner dirichlet: every client gets at least this many training points
DIRICHLET_MAX_RETRIES = 1000  # ... in at most this many draws


@dataclass(frozen=True)
class ArraysSplit:
    """Train/test arrays of one dataset (or one client's shard of it)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # 0 for regression / location models

    @property
    def in_features(self) -> int:
        return int(self.x_train.shape[1]) if self.x_train.ndim == 2 else 0


def _synthetic(cfg: RunConfig) -> ArraysSplit:
    rng = np.random.default_rng(cfg.seed)
    n, n_test = 60 * cfg.num_clients, 200
    if cfg.dataset == "synthetic_gaussian_location":
        # y ~ N(theta*, sigma^2), theta* = 1.5: the conjugate model of the parity tests
        y = rng.normal(1.5, cfg.likelihood_sigma, size=(n + n_test, 1))
        x = np.zeros((n + n_test, 0))
        return ArraysSplit(x[:n], y[:n], x[n:], y[n:], 0)
    if cfg.dataset == "synthetic_linear_regression":
        theta = np.array([0.5, -1.0, 2.0])
        x = rng.normal(size=(n + n_test, 3))
        y = (x @ theta + 0.3 + cfg.likelihood_sigma * rng.normal(size=n + n_test))[:, None]
        return ArraysSplit(x[:n], y[:n], x[n:], y[n:], 0)
    if cfg.dataset == "synthetic_logistic_2d":
        from common.data.synthetic import logistic_2d_with_outliers

        d = logistic_2d_with_outliers(seed=cfg.seed)
        return ArraysSplit(d.x_train, d.y_train, d.x_test, d.y_test, 2)
    raise KeyError(cfg.dataset)


@lru_cache(maxsize=4)
def _full_dataset(cfg: RunConfig) -> ArraysSplit:
    if cfg.dataset in SYNTHETIC_DATASETS:
        return _synthetic(cfg)
    from common.data.datasets import load_dataset

    ds = load_dataset(cfg.dataset, data_dir=cfg.data_dir or None, download=cfg.download, seed=cfg.seed,
                      test_fraction=cfg.test_fraction)
    return ArraysSplit(ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.num_classes)


def load_clean_data(cfg: RunConfig) -> ArraysSplit:
    """The whole dataset with its clean training labels (what the partition is drawn from)."""
    return _full_dataset(cfg)


def load_full_data(cfg: RunConfig) -> ArraysSplit:
    """The whole dataset, training labels contaminated as configured (the test set stays clean)."""
    data = _full_dataset(cfg)
    if cfg.label_noise > 0 and data.num_classes > 1:
        from common.data.contamination import class_map_flip, random_flip

        flip = random_flip if cfg.label_noise_kind == "random" else class_map_flip
        y_train, _ = flip(data.y_train, cfg.label_noise, data.num_classes, seed=cfg.seed + 4242)
        data = ArraysSplit(data.x_train, y_train, data.x_test, data.y_test, data.num_classes)
    return data


def _partitioner_kwargs(cfg: RunConfig) -> dict:
    """The keyword arguments of the configured partitioner (only those it takes)."""
    if cfg.partitioner == "dirichlet":
        return {"alpha": cfg.dirichlet_alpha, "min_size": DIRICHLET_MIN_SIZE, "max_retries": DIRICHLET_MAX_RETRIES}
    if cfg.partitioner == "label_skew":
        return {"classes_per_partition": cfg.classes_per_client}
    return {}  # iid, size_skew


def _partition_error(cfg: RunConfig, labels: np.ndarray, err: ValueError) -> ConfigError:
    """The partitioner's ValueError in the run config's terms (its keys, not the partitioner's argument names)."""
    n, m, ds = int(labels.shape[0]), cfg.num_clients, cfg.dataset
    c = int(np.unique(labels).size)
    if m > n:
        msg = f"num-clients: {m} clients but '{ds}' has only {n} training points (every client needs one)"
    elif cfg.partitioner == "label_skew":
        k = cfg.classes_per_client
        if k > c:
            msg = f"classes-per-client: {k} is more than the {c} classes of '{ds}' (partitioner label_skew)"
        elif m * k < c:
            msg = (f"partitioner: label_skew with num-clients x classes-per-client = {m} x {k} = {m * k} leaves some "
                   f"of the {c} classes of '{ds}' unused; raise num-clients or classes-per-client")
        else:
            msg = (f"partitioner: label_skew with num-clients={m}, classes-per-client={k}: a class of '{ds}' has "
                   "fewer training points than clients holding it; lower num-clients or classes-per-client")
    elif cfg.partitioner == "dirichlet":
        if "degenerate" in str(err):  # alpha so large that numpy's draw is all zeros (common/data/partition.py)
            msg = f"dirichlet-alpha: {err}"
        elif m * DIRICHLET_MIN_SIZE > n:
            msg = (f"num-clients: partitioner dirichlet gives every client at least {DIRICHLET_MIN_SIZE} training "
                   f"points; {m} clients need {m * DIRICHLET_MIN_SIZE}, '{ds}' has {n}")
        else:
            msg = (f"dirichlet-alpha: no Dirichlet({cfg.dirichlet_alpha:g}) draw in {DIRICHLET_MAX_RETRIES} attempts "
                   f"gave each of the num-clients={m} clients at least {DIRICHLET_MIN_SIZE} of the {n} training points "
                   f"of '{ds}'; raise dirichlet-alpha or lower num-clients (partitioner dirichlet)")
    else:
        msg = f"partitioner/num-clients: '{cfg.partitioner}' cannot split '{ds}' into {m} clients: {err}"
    return ConfigError(f"invalid run config: {msg}")


@lru_cache(maxsize=4)
def train_partition(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """Every client's (sorted, read-only) indices into the training set.

    Drawn from the *clean* labels, so the label noise does not change which points a client holds (a label-based
    partition of the contaminated labels would move the flipped points); regression targets are partitioned as
    if all of one class (``iid`` and ``size_skew`` ignore the labels; the config rejects the label-based ones).
    An infeasible partition raises :class:`ConfigError` naming the run-config keys: the server runs this in
    ``prepare``, before round 1.
    """
    from common.data.partition import partition

    data = _full_dataset(cfg)
    if data.num_classes > 1:
        labels = data.y_train
    else:
        labels = np.zeros(len(data.y_train), dtype=np.int64)
    try:
        parts = partition(cfg.partitioner, labels, cfg.num_clients, seed=cfg.seed, **_partitioner_kwargs(cfg))
    except ValueError as err:
        raise _partition_error(cfg, labels, err) from None
    for p in parts:
        p.setflags(write=False)
    return tuple(parts)


def client_shard(cfg: RunConfig, partition_id: int) -> ArraysSplit:
    """Client ``partition_id``'s share of the (contaminated) training set and of the test set."""
    if not 0 <= partition_id < cfg.num_clients:
        raise ValueError(f"partition-id {partition_id} is outside [0, num-clients={cfg.num_clients})")
    data = load_full_data(cfg)
    train_idx = train_partition(cfg)[partition_id]  # of the clean labels; the shard gets the contaminated ones
    test_labels = data.y_test
    # the local test split is a random 1/M of the test set (may be empty when M exceeds its size)
    perm = np.random.default_rng(cfg.seed + 1).permutation(len(test_labels))
    test_idx = np.sort(np.array_split(perm, cfg.num_clients)[partition_id])
    return ArraysSplit(data.x_train[train_idx], data.y_train[train_idx], data.x_test[test_idx],
                       data.y_test[test_idx], data.num_classes)


@dataclass
class Problem:
    cfg: RunConfig
    model: LikelihoodModel
    prior: GaussianFactor
    loss: Loss
    divergence: Divergence
    server_step: ServerStep
    local: LocalGVIConfig
    dtype: torch.dtype

    def tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` in the problem's dtype and ``y`` as ``long`` class labels (classifiers) or in the dtype.

        A classifier's labels are checked here, where the data is loaded, before the cast: ``ValueError``
        naming the dataset and model unless they are (integer-valued) class indices in ``[0, num_classes)``.
        The cast alone would truncate a float label (``0.99`` -> class 0) without a word, and the training
        loop checks the labels only once per :func:`~common.local_gvi.local_gvi` call, not per minibatch.
        """
        xt = torch.as_tensor(np.asarray(x), dtype=self.dtype)
        if self.model.is_classifier:
            raw = torch.as_tensor(np.asarray(y))
            if raw.dtype == torch.bool:  # binary labels as False / True: classes 0 / 1, as the cast to long made them
                raw = raw.to(torch.int64)
            c = int(self.model.num_classes)  # type: ignore[attr-defined]  # every classifier model has it
            cfg = self.cfg  # None for a hand-built Problem (tests): then name the model only
            what = (f"dataset '{cfg.dataset}' (model '{cfg.model}', {c} classes)" if cfg is not None
                    else f"model '{self.model.name}' ({c} classes)")
            check_class_labels(raw, c, what)
            yt = raw.to(torch.long)
        else:
            yt = torch.as_tensor(np.asarray(y), dtype=self.dtype)
        return xt, yt


def _loss(cfg: RunConfig) -> Loss:
    hyper = {
        "nll": {},
        "gce": {"delta": cfg.loss_delta},
        "beta": {"beta": cfg.loss_beta},
        "gamma": {"gamma": cfg.loss_gamma},
        "score_matching": {"weight": cfg.sm_weight, "c": cfg.sm_c},
    }[cfg.loss]
    return weighted(make_loss(cfg.loss, **hyper), cfg.loss_weight)


def _divergence(name: str, alpha: float, w: float) -> Divergence:
    hyper = {"alpha_renyi": {"alpha": alpha}, "weighted_kl": {"w": w}}.get(name, {})
    return make_divergence(name, **hyper)


def _model(cfg: RunConfig, data: ArraysSplit) -> LikelihoodModel:
    if cfg.model == "gaussian_location":
        return make_model("gaussian_location", dim=int(data.y_train.shape[1]), sigma=cfg.likelihood_sigma)
    if cfg.model == "linear_regression":
        return make_model("linear_regression", in_features=data.in_features, sigma=cfg.likelihood_sigma)
    if cfg.model == "logistic_regression":
        return make_model("logistic_regression", in_features=data.in_features, num_classes=max(2, data.num_classes))
    return make_model("bnn", in_features=data.in_features, hidden=cfg.hidden_sizes, num_classes=data.num_classes)


def build_problem(cfg: RunConfig, data: ArraysSplit | None = None) -> Problem:
    """Everything but the data shard; ``data`` (default: the full dataset) fixes input/output sizes."""
    data = data if data is not None else load_full_data(cfg)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    model = _model(cfg, data)
    shapes = model.param_shapes
    if cfg.family == "full_covariance":
        if list(shapes) != ["theta"]:
            raise ValueError(f"family full_covariance needs a single-vector model, '{cfg.model}' has {list(shapes)}")
        (d,) = shapes["theta"]
        fisher_rao = [k for k, v in (("divergence", cfg.divergence), ("server-divergence", cfg.server_divergence))
                      if v == "fisher_rao"]
        if fisher_rao and d > 1:  # the closed form is univariate (per coordinate: mean_field)
            raise ConfigError(f"invalid run config: {'/'.join(fisher_rao)}: the Fisher-Rao distance has a closed form "
                              f"for univariate Gaussians only; family 'full_covariance' with model '{cfg.model}' has "
                              f"d = {d} > 1 (use family 'mean_field', which takes it per coordinate)")
        prior: GaussianFactor = FullCovarianceGaussian.from_mean_covariance(
            torch.full((d,), cfg.prior_mean, dtype=dtype), cfg.prior_variance * torch.eye(d, dtype=dtype)
        )
    else:
        prior = MeanFieldGaussian.isotropic(shapes, cfg.prior_mean, cfg.prior_variance, dtype=dtype)
    local = LocalGVIConfig(
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size or None,
        lr=cfg.lr,
        lr_scale=cfg.lr_scale,
        n_samples=cfg.mc_samples,
        patience=cfg.patience,
        seed=cfg.seed,
        init=cfg.init,
        local_reparam=cfg.local_reparam,
        # BNNs: judge early stopping on the epoch's running objective (no extra pass over the data)
        objective_estimate="running" if cfg.model == "bnn" else "end_of_epoch",
    )
    server_hyper = {"alpha_renyi": {"alpha": cfg.server_divergence_alpha},
                    "weighted_kl": {"w": cfg.server_divergence_w}}.get(cfg.server_divergence, {})
    return Problem(
        cfg=cfg,
        model=model,
        prior=prior,
        loss=_loss(cfg),
        divergence=_divergence(cfg.divergence, cfg.divergence_alpha, cfg.divergence_w),
        server_step=make_server_step(cfg.server_divergence, **server_hyper),
        local=local,
        dtype=dtype,
    )
