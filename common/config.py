"""The run configuration, validated at the boundary.

Flower passes the run config as a flat dict of ``int | float | bool | str`` with hyphenated keys
(``[tool.flwr.app.config]`` in pyproject.toml, overridden by ``flwr run -c 'key=value'``).  :func:`parse_run_config`
turns it into a :class:`RunConfig` or raises one :class:`ConfigError` whose message names every offending key,
before round 1 — never a traceback in round 7.  The checks run in two stages: every key's own value, then (once all
values are valid) the checks across keys (a loss's hyperparameter, a model/dataset pair, ...); a message lists every
offending key of the first stage that fails, so fixing those can reveal errors of the second.
"""

from __future__ import annotations

import math
from fractions import Fraction
import sys
from collections.abc import Mapping
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key(s) and what is allowed."""


def _hyphen(name: str) -> str:
    return name.replace("_", "-")


LOSS_NAMES = ("nll", "gce", "beta", "gamma", "score_matching")
DIVERGENCE_NAMES = ("kl", "weighted_kl", "reverse_kl", "alpha_renyi", "fisher_rao")
MODEL_NAMES = ("gaussian_location", "linear_regression", "logistic_regression", "bnn")
SYNTHETIC_DATASETS = ("synthetic_gaussian_location", "synthetic_linear_regression", "synthetic_logistic_2d")
REGRESSION_MODELS = ("gaussian_location", "linear_regression")
REGRESSION_DATASETS = ("synthetic_gaussian_location", "synthetic_linear_regression")
LABEL_PARTITIONERS = ("label_skew", "dirichlet")  # the partitioners that split by class
# The tightest consumer of the seed is numpy's legacy RandomState (the iid partition and the stratified train/test
# split), which takes [0, 2**32 - 1] and is given the seed itself; every offset the code adds to the seed
# (+1, +4242, x 100_003 + ..., + 0x5EED0BEC + 7919 x round) goes to default_rng / torch, which take far more.
SEED_MAX = 2**32 - 1
#: the most torch threads a run or node config may ask for (torch.set_num_threads takes a C int; a typo such as
#: 100000 would make OpenMP start that many threads)
MAX_TORCH_THREADS = 1024
# (smallest normal, largest finite) of each dtype, as numpy's finfo(...).tiny / .max
_FLOAT_RANGE = {"float32": (2.0**-126, (2.0 - 2.0**-23) * 2.0**127),
                "float64": (sys.float_info.min, sys.float_info.max)}
#: the largest |alpha| of an Alpha-Renyi divergence per dtype: 2^-10 / eps.  Its combined precision
#: ``alpha lambda_q + (1 - alpha) lambda_p`` cancels to ~ alpha eps of its terms (at q = cavity the exact value is
#: lambda_p; alpha 1e16 in float64 rounded it to <= 0, the divergence 'infinite' and every client failed round 1)
_ALPHA_MAX = {"float32": 2.0**-10 / 2.0**-23, "float64": 2.0**-10 / 2.0**-52}


#: What a key whose range its own validator checks takes, as the message refusing a bool for it says.
_KIND_TEXT = {"damping": "a number in (0, 1] or 'auto'", "max_staleness": "an integer >= 0 or 'auto'"}
_BOUND_TEXT = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
_UNIONS = (Union, types.UnionType)  # ``Union[int, str]`` and ``int | str``


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type takes a bool (``bool``, or a union with ``bool`` in it)."""
    return annotation is bool or (get_origin(annotation) in _UNIONS and bool in get_args(annotation))


def _kind(annotation: Any, metadata: list[Any] = ()) -> str:
    """What a field of type ``annotation`` (with pydantic's ``gt``/``ge``/``lt``/``le`` metadata) takes, in words:
    ``'a number > 0'``, ``'an integer >= 0 and <= 4294967295'``, ``"one of 'iid', 'dirichlet'"``."""
    if get_origin(annotation) in _UNIONS:
        return " or ".join(_kind(a) for a in get_args(annotation))
    if get_origin(annotation) is Literal:
        values = get_args(annotation)
        return repr(values[0]) if len(values) == 1 else "one of " + ", ".join(map(repr, values))
    base = {int: "an integer", float: "a number", str: "a string"}.get(annotation, getattr(annotation, "__name__", "?"))
    bounds = [f"{op} {getattr(m, attr)!r}" for m in metadata for attr, op in _BOUND_TEXT if hasattr(m, attr)]
    return base + (" " + " and ".join(bounds) if bounds else "")


def clients_per_round(fraction: float, n: int) -> int:
    """How many of ``n`` usable clients a synchronous or sequential round samples with ``fraction-train`` =
    ``fraction``: ``fraction x n`` rounded half up (``floor(fraction x n + 0.5)``: 0.5 x 5 -> 3, 0.625 x 4 -> 3;
    Python's ``round`` rounds halves to even, 2.5 -> 2 but 3.5 -> 4), at least 1 and at most ``n`` (``n >= 1``)."""
    # in exact decimal arithmetic: floor(0.58 * 25 + 0.5) is 14 in floats (0.58 * 25 = 14.4999...), 15 exactly
    return max(1, min(n, math.floor(Fraction(repr(float(fraction))) * n + Fraction(1, 2))))


class RunConfig(BaseModel):
    """Every knob of a PGVI run.  Field ``foo_bar`` is run-config key ``foo-bar``."""

    # allow_inf_nan=False: no key takes inf or NaN (a float written as `inf`/`nan` in TOML or `-c` is one clear
    # error here, not an improper prior or a raw ValueError of a hyperparameter in round 1)
    model_config = ConfigDict(alias_generator=_hyphen, populate_by_name=True, extra="forbid", frozen=True,
                              allow_inf_nan=False)

    # ---- problem -------------------------------------------------------------------------------
    model: Literal["gaussian_location", "linear_regression", "logistic_regression", "bnn"] = "logistic_regression"
    hidden: str = Field("200", description="BNN hidden sizes, comma-separated ('' for none)")
    family: Literal["mean_field", "full_covariance"] = "mean_field"
    dtype: Literal["float32", "float64"] = "float64"
    prior_mean: float = 0.0
    prior_variance: float = Field(1.0, gt=0, description="v and the precision 1/v must be normal floats of dtype")
    dataset: str = "breast_cancer"
    data_dir: str = ""
    download: bool = False
    test_fraction: float = Field(0.2, gt=0, lt=1)
    num_clients: int = Field(3, ge=1, description="M: number of data partitions / clients in the federation")
    partitioner: Literal["iid", "label_skew", "dirichlet", "size_skew"] = "iid"
    dirichlet_alpha: float = Field(0.5, gt=0, description="finite; small = few classes per client")
    classes_per_client: int = Field(2, ge=1)
    label_noise: float = Field(0.0, ge=0, lt=1)
    label_noise_kind: Literal["random", "class_map"] = "random"

    # ---- PGVI ----------------------------------------------------------------------------------
    loss: str = "nll"
    loss_delta: float = Field(0.5, description="GCE delta in (0, 1]")
    loss_beta: float = Field(1.5, description="beta-loss beta > 1")
    loss_gamma: float = Field(1.5, description="gamma-loss gamma > 1")
    loss_weight: float = Field(1.0, gt=0, allow_inf_nan=False,
                               description="GBI learning rate w: the local objective is E_q[w L] + D")
    sm_weight: Literal["constant", "imq", "se"] = "imq"
    sm_c: float = Field(1.0, gt=0)
    likelihood_sigma: float = Field(1.0, gt=0, description="known noise scale of the Gaussian models")
    divergence: str = "kl"
    divergence_alpha: float = Field(2.5, description="Alpha-Renyi alpha (real, != 0, != 1)")
    divergence_w: float = Field(1.0, gt=0, description="weighted KL: D = (1/w) KL")
    server_divergence: str = "kl"
    server_divergence_alpha: float = 2.5
    server_divergence_w: float = Field(1.0, gt=0, description="server weighted KL: D_s = (1/w) KL")
    damping: float | Literal["auto"] = Field("auto", description="rho in (0, 1]; 'auto' = 1/M (sequential: 1)")
    schedule: Literal["synchronous", "sequential", "asynchronous"] = "synchronous"
    sequential_order: str = Field(
        "", description="comma-separated client ids visited first, in this order; the others follow in sorted order"
    )
    max_staleness: int | Literal["auto"] = Field(
        "auto", description="asynchronous: reject updates older than this many versions; 'auto' = num-clients"
    )
    num_server_rounds: int = Field(5, ge=1)
    fraction_train: float = Field(
        1.0, gt=0, le=1,
        description="synchronous/sequential: each round samples clients_per_round(fraction, N) of the N usable "
                    "clients, i.e. fraction x N rounded half up (0.5 x 5 -> 3), at least 1",
    )
    min_clients: int = Field(2, ge=1)
    aggregator: Literal["sum", "norm_clip", "trimmed_mean", "median"] = Field(
        "sum", description="how a synchronous batch of Deltas is combined (robust options for Byzantine clients)"
    )
    aggregator_trim: float = Field(0.2, ge=0, lt=0.5, description="trimmed_mean: fraction cut at each end")
    aggregator_clip_norm: float = Field(0.0, ge=0, description="norm_clip: fixed bound; 0 = multiplier x median norm")
    aggregator_clip_multiplier: float = Field(2.0, gt=0)
    max_bad_replies: int = Field(3, ge=0, description="exclude a client after this many invalid replies (0 = never)")
    batch_halvings: int = Field(
        3, ge=0, le=30,
        description="synchronous: a batch of Deltas each valid on its own that fails jointly (improper or unbounded "
                    "server posterior, server optimisation failing) is applied with every Delta's damping halved, "
                    "up to this many times, before it is rejected as a whole (0: rejected at once)",
    )
    exclusion_removes_site: bool = Field(
        False, description="on exclusion, divide the client's site out of the posterior (its earlier updates are distrusted)"
    )
    wait_for_clients_s: float = Field(120.0, ge=0)
    round_timeout_s: float = Field(600.0, gt=0)
    object_pull_retry_s: float = Field(
        0.05, ge=0.001, le=10.0,
        description="ServerApp: first retry of a reply's object not yet at the SuperLink (Flower 1.39: 1 s)",
    )

    # ---- local optimiser -----------------------------------------------------------------------
    local_epochs: int = Field(100, ge=1)
    lr: float = Field(1e-2, gt=0)
    lr_scale: float = Field(1e-2, gt=0)
    mc_samples: int = Field(10, ge=1)
    batch_size: int = Field(0, ge=0, description="0 = full batch")
    patience: int = Field(10, ge=1)
    init: Literal["posterior", "cavity"] = "posterior"
    local_reparam: bool = True
    conjugate: bool = Field(True, description="use the closed-form client update where it exists")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="in [0, 2**32 - 1], the range of numpy's RandomState")
    torch_threads: int = Field(0, ge=0, le=MAX_TORCH_THREADS, description="0 = leave torch's default")

    # ---- evaluation / output -------------------------------------------------------------------
    eval_samples: int = Field(200, ge=1)
    # ---- baseline: FedAvg with a deterministic MLP of the same architecture (client/fedavg_app.py) -----------
    fedavg_lr: float = Field(0.1, gt=0, description="FedAvg client SGD learning rate")
    fedavg_momentum: float = Field(0.9, ge=0, lt=1)
    fedavg_weight_decay: float = Field(5e-4, ge=0)
    fedavg_local_epochs: int = Field(10, ge=1)
    fedavg_batch_size: int = Field(100, ge=1)
    evaluate_clients: bool = True
    pipeline_evaluation: bool = Field(
        True,
        description="synchronous schedule without evaluate-clients: evaluate round r's posterior on the server "
                    "while the clients work on round r+1 (same records, the row of round r written after that push)",
    )
    output_dir: str = "outputs"
    checkpoint: bool = Field(True, description="write the server state after every applied update")
    resume: str = Field("", description="directory of a checkpoint to resume from ('' = start fresh)")

    # ---- validators ----------------------------------------------------------------------------
    @field_validator("*", mode="before")
    @classmethod
    def _bool_only_for_bool_keys(cls, v: object, info: ValidationInfo) -> object:
        # pydantic's lax mode reads a bool as the number 1 / 0 (`-c lr=true` would be lr = 1.0, `batch-size=false`
        # full batch): a TOML bool is refused for every key that is not a bool (strings such as "false" for a bool
        # key and 5.0 for an integer key keep pydantic's lax conversion)
        if isinstance(v, bool) and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not _takes_bool(field.annotation):
                kind = _KIND_TEXT.get(info.field_name) or _kind(field.annotation, field.metadata)
                raise ValueError(f"must be {kind}, got {v!r} (a TOML bool)")
        return v

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        if v not in LOSS_NAMES:
            raise ValueError(f"unknown loss '{v}'; known: {', '.join(LOSS_NAMES)}")
        return v

    @field_validator("divergence", "server_divergence")
    @classmethod
    def _known_divergence(cls, v: str) -> str:
        if v not in DIVERGENCE_NAMES:
            raise ValueError(f"unknown divergence '{v}'; known: {', '.join(DIVERGENCE_NAMES)}")
        return v

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        from common.data.datasets import dataset_names

        known = (*dataset_names(), *SYNTHETIC_DATASETS)
        if v not in known:
            raise ValueError(f"unknown dataset '{v}'; known: {', '.join(known)}")
        return v

    @field_validator("hidden", mode="before")
    @classmethod
    def _hidden_sizes(cls, v: object) -> str:
        if isinstance(v, int) and not isinstance(v, bool):  # `flwr run -c hidden=200` gives an int
            v = str(v)
        if not isinstance(v, str):
            raise ValueError(f"must be comma-separated positive integers, got {v!r}")
        parts = [p.strip() for p in v.split(",") if p.strip()]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"must be comma-separated positive integers, got '{v}'")
        return v

    @field_validator("damping", mode="before")
    @classmethod
    def _damping_finite(cls, v: object) -> object:
        # before the union: a non-finite float would otherwise fail both of its branches ("damping.float: ...")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"damping rho must be in (0, 1] or 'auto', got {v}")
        return v

    @field_validator("damping")
    @classmethod
    def _damping_range(cls, v: float | str) -> float | str:
        if v != "auto" and not (0.0 < float(v) <= 1.0):
            raise ValueError(f"damping rho must be in (0, 1] or 'auto', got {v}")
        return v

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _staleness_kind(cls, v: object) -> object:
        # before the union: a value neither branch takes would fail both ("max-staleness.int: ...; max-staleness.
        # literal['auto']: ..."), two errors for one key
        if isinstance(v, bool) or v == "auto" or isinstance(v, int):
            return v
        if isinstance(v, str):  # a number as text, as pydantic's lax mode reads it
            try:
                v = float(v.strip()) if v.strip().lower() not in ("nan", "inf", "-inf", "+inf") else v
            except ValueError:
                pass
        if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 2.0**63:
            return int(v)
        raise ValueError(f"max-staleness must be an integer >= 0 or 'auto', got {v!r}")

    @field_validator("damping", mode="before")
    @classmethod
    def _damping_kind(cls, v: object) -> object:
        # a string other than 'auto' (a number as text is read as the number, as pydantic's lax mode would)
        if isinstance(v, str) and v != "auto":
            try:
                return float(v)
            except ValueError:
                raise ValueError(f"damping rho must be in (0, 1] or 'auto', got {v!r}") from None
        return v

    @field_validator("max_staleness")
    @classmethod
    def _staleness_range(cls, v: int | str) -> int | str:
        if v != "auto" and int(v) < 0:
            raise ValueError(f"max-staleness must be an integer >= 0 or 'auto', got {v!r}")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> RunConfig:
        errors: list[str] = []
        if self.loss == "gce" and not (0.0 < self.loss_delta <= 1.0):
            errors.append(f"loss-delta: GCE needs delta in (0, 1], got {self.loss_delta}")
        if self.loss == "beta" and not self.loss_beta > 1.0:
            errors.append(f"loss-beta: the beta-loss needs beta > 1, got {self.loss_beta}")
        if self.loss == "gamma" and not self.loss_gamma > 1.0:
            errors.append(f"loss-gamma: the gamma-loss needs gamma > 1, got {self.loss_gamma}")
        if self.loss == "score_matching" and self.model not in ("gaussian_location", "linear_regression"):
            errors.append(f"loss: score_matching needs a Gaussian model, not '{self.model}'")
        for key, name, alpha in (
            ("divergence-alpha", self.divergence, self.divergence_alpha),
            ("server-divergence-alpha", self.server_divergence, self.server_divergence_alpha),
        ):
            if name == "alpha_renyi":
                if alpha == 1.0:
                    errors.append(f"{key}: alpha = 1 is the KL divergence; use divergence 'kl'")
                elif alpha == 0.0:
                    errors.append(f"{key}: alpha = 0 is the reverse KL; use divergence 'reverse_kl'")
                elif not math.isfinite(alpha):
                    errors.append(f"{key}: alpha must be finite, got {alpha}")
        if self.min_clients > self.num_clients:
            errors.append(
                f"min-clients: {self.min_clients} is more than the {self.num_clients} clients of the federation (num-clients)"
            )
        if self.model in REGRESSION_MODELS and self.dataset not in REGRESSION_DATASETS:
            errors.append(f"dataset: model '{self.model}' needs real-valued targets "
                          f"({' or '.join(REGRESSION_DATASETS)}); '{self.dataset}' is a classification dataset")
        if self.model == "linear_regression" and self.dataset == "synthetic_gaussian_location":
            errors.append("dataset: model 'linear_regression' needs covariates; 'synthetic_gaussian_location' has "
                          "none (use synthetic_linear_regression, or model gaussian_location)")
        if self.model in ("logistic_regression", "bnn") and self.dataset in REGRESSION_DATASETS:
            errors.append(f"dataset: model '{self.model}' is a classifier; '{self.dataset}' has real-valued targets")
        if self.real_valued_targets and self.partitioner in LABEL_PARTITIONERS:
            errors.append(f"partitioner: '{self.partitioner}' splits by class; '{self.dataset}' has real-valued "
                          "targets (use 'iid' or 'size_skew')")
        errors.extend(self._prior_errors())
        tiny = _FLOAT_RANGE[self.dtype][0]
        if self.model in REGRESSION_MODELS and not tiny**0.5 <= self.likelihood_sigma <= tiny**-0.5:
            errors.append(f"likelihood-sigma: with dtype {self.dtype} sigma^2 and its inverse must be normal floats, "
                          f"i.e. sigma within [{tiny**0.5:.4g}, {tiny**-0.5:.4g}], got {self.likelihood_sigma:g}")
        # rates and hyperparameters the computation scales by (with their derived factors, as the losses check
        # them at run time): a subnormal one is 0 where the clients flush denormals (damping 1e-310: 'rho must be in
        # (0, 1], got 0.0' from every client), one beyond the dtype's range inf
        lo, hi = _FLOAT_RANGE[self.dtype]
        scaled: list[tuple[str, float, tuple[float, ...]]] = [
            ("lr", self.lr, (self.lr,)), ("lr-scale", self.lr_scale, (self.lr_scale,))]
        if self.damping != "auto":
            scaled.append(("damping", float(self.damping), (float(self.damping),)))
        if self.loss == "gce" and 0.0 < self.loss_delta <= 1.0:
            scaled.append(("loss-delta", self.loss_delta, (self.loss_delta,)))
        if self.loss == "beta" and self.loss_beta > 1.0:
            scaled.append(("loss-beta", self.loss_beta, (self.loss_beta, self.loss_beta - 1.0)))
        if self.loss == "gamma" and self.loss_gamma > 1.0:
            g, c = self.loss_gamma, self.loss_gamma - 1.0
            scaled.append(("loss-gamma", g, (g, c, c / g, g / c)))
        for key, name, alpha in (("divergence-alpha", self.divergence, self.divergence_alpha),
                                 ("server-divergence-alpha", self.server_divergence, self.server_divergence_alpha)):
            if name != "alpha_renyi" or alpha in (0.0, 1.0) or not math.isfinite(alpha):
                continue  # refused above
            if abs(alpha) > _ALPHA_MAX[self.dtype]:
                errors.append(f"{key}: |alpha| must be <= {_ALPHA_MAX[self.dtype]:.4g} with dtype {self.dtype} "
                              "(beyond it the combined precision alpha lambda_q + (1 - alpha) lambda_p loses the "
                              f"digits that decide its sign), got {alpha:g}")
            else:
                scaled.append((key, alpha, (alpha, 1.0 - alpha, alpha * (alpha - 1.0))))
        for key, value, factors in scaled:
            if not all(lo <= abs(f) <= hi for f in factors):
                errors.append(f"{key}: {value:g} is not representable with dtype {self.dtype}: it (or a factor of it "
                              f"the computation uses) is outside the normal floats [{lo:.4g}, {hi:.4g}]")
        # the FedAvg baseline's network is float32 whatever dtype is (common/deterministic_mlp.py): fedavg-lr 1e-40
        # with dtype float64 ran a 'completed' baseline that never moved, 1e39 (or such a weight decay) failed
        # every client in round 1 (a subnormal weight decay is 0, as good as asked for)
        lo32, hi32 = _FLOAT_RANGE["float32"]
        for key, value, low in (("fedavg-lr", self.fedavg_lr, lo32),
                                ("fedavg-weight-decay", self.fedavg_weight_decay, 0.0)):
            if not low <= value <= hi32:
                errors.append(f"{key}: {value:g} is not representable in float32, the FedAvg network's dtype "
                              f"(whatever dtype is): it must be within [{low:.4g}, {hi32:.4g}]")
        # scales a loss or divergence divides or multiplies a tensor by: outside these ranges they (or their
        # reciprocals) leave the dtype's normal floats and the objective is NaN (inf * 0) at valid data
        if self.loss == "score_matching" and self.sm_weight != "constant" and not tiny**0.5 <= self.sm_c <= tiny**-0.5:
            errors.append(f"sm-c: with dtype {self.dtype} c^2 and its inverse must be normal floats, i.e. c within "
                          f"[{tiny**0.5:.4g}, {tiny**-0.5:.4g}], got {self.sm_c:g}")
        for key, name, w in (("divergence-w", self.divergence, self.divergence_w),
                             ("server-divergence-w", self.server_divergence, self.server_divergence_w),
                             ("loss-weight", "weighted_kl", self.loss_weight)):
            if name == "weighted_kl" and not tiny <= w <= 1.0 / tiny:
                errors.append(f"{key}: with dtype {self.dtype} it and its inverse must be normal floats, i.e. within "
                              f"[{tiny:.4g}, {1.0 / tiny:.4g}], got {w:g}")
        if self.family == "full_covariance" and self.model == "bnn":
            errors.append("family: a BNN needs family 'mean_field'")
        if self.schedule != "synchronous":
            # sequential and asynchronous updates arrive one at a time: a location estimate over a batch of one
            # Delta is that Delta, and a median-relative clipping bound is relative to the Delta itself
            if self.aggregator in ("trimmed_mean", "median"):
                errors.append(f"aggregator: '{self.aggregator}' combines a batch of Deltas and needs schedule "
                              f"'synchronous' (the {self.schedule} schedule applies one Delta at a time)")
            elif self.aggregator == "norm_clip" and not self.aggregator_clip_norm > 0:
                errors.append(f"aggregator-clip-norm: with schedule '{self.schedule}' norm_clip needs a fixed bound "
                              "> 0 (the default bound is relative to the median norm of a batch)")
            default_halvings = type(self).model_fields["batch_halvings"].default
            if self.batch_halvings != default_halvings:
                errors.append(f"batch-halvings: {self.batch_halvings} does nothing with schedule '{self.schedule}' "
                              "(it applies one Delta at a time: a Delta that fails is rejected on its own); leave "
                              f"it at {default_halvings}")
        if self.schedule != "sequential" and self.sequential_order.strip():
            errors.append(f"sequential-order: sets the sequential schedule's visiting order and does nothing with "
                          f"schedule '{self.schedule}'; leave it empty")
        order = [c.strip() for c in self.sequential_order.split(",") if c.strip()]
        if len(set(order)) != len(order):
            dup = sorted({c for c in order if order.count(c) > 1})
            errors.append(f"sequential-order: client id(s) listed twice: {', '.join(dup)}")
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def real_valued_targets(self) -> bool:
        """A regression model or dataset: no class labels to partition by or to flip."""
        return self.model in REGRESSION_MODELS or self.dataset in REGRESSION_DATASETS

    def ignored_label_noise(self) -> str | None:
        """Why ``label-noise`` does nothing in this run (real-valued targets have no class labels to flip), or
        ``None``.  Not an error: the app's default (0.2, for the embedded classification job) would otherwise
        have to be overridden by every regression run; the server logs it before round 1 instead."""
        if self.label_noise > 0 and self.real_valued_targets:
            return (f"label-noise = {self.label_noise} flips class labels; '{self.dataset}' has real-valued targets, "
                    "so no contamination is applied")
        return None

    def aggregator_warning(self) -> str | None:
        """Why the Byzantine-robust aggregator cannot limit any client in this run's synchronous batches of
        ``M = clients_per_round(fraction-train, num-clients)`` Deltas (fewer if clients fail), or ``None``: a trimmed
        mean that trims ``floor(trim * M) = 0`` values, a median of at most 2 values and a median-relative clipping
        bound of at most 2 norms are the plain mean / no clipping; and an aggregator setting at a value other
        than its default that the chosen aggregator ignores (``aggregator-trim`` with ``median``, a typo for
        ``trimmed_mean``).  Not an error (a configuration may be reused with more clients; a sweep passes one
        setting to runs of several aggregators); the server logs it before round 1."""
        defaults = type(self).model_fields
        used = {"trimmed_mean": {"aggregator_trim"},
                "norm_clip": {"aggregator_clip_norm"} | (set() if self.aggregator_clip_norm else
                                                         {"aggregator_clip_multiplier"})}.get(self.aggregator, set())
        ignored = [k for k in ("aggregator_trim", "aggregator_clip_norm", "aggregator_clip_multiplier")
                   if k not in used and getattr(self, k) != defaults[k].default]
        why = [f"{', '.join(f'{_hyphen(k)} = {getattr(self, k):g}' for k in ignored)} does nothing with aggregator "
               f"'{self.aggregator}'" + (" and a fixed aggregator-clip-norm" if self.aggregator == "norm_clip"
                                         and "aggregator_clip_multiplier" in ignored else "")] if ignored else []
        if (bounds := self._aggregator_bounds_nothing()) is not None:
            why.append(bounds)
        return "; ".join(why) or None

    def _aggregator_bounds_nothing(self) -> str | None:
        """The part of :meth:`aggregator_warning` about batches: why the aggregator limits no client, or ``None``."""
        if self.schedule != "synchronous" or self.aggregator == "sum":
            return None
        m = clients_per_round(self.fraction_train, self.num_clients)
        if self.aggregator == "trimmed_mean" and int(self.aggregator_trim * m) == 0:
            return (f"aggregator trimmed_mean with aggregator-trim = {self.aggregator_trim:g} trims floor("
                    f"{self.aggregator_trim:g} x {m}) = 0 of the {m} Deltas of a round: it is the plain mean and "
                    "bounds no client")
        if self.aggregator == "median" and m <= 2:
            return f"aggregator median of {m} Delta(s) a round is their mean: it bounds no client"
        # median-relative bound: mult * b >= b for one Delta; mult * (a + b) / 2 >= b for two iff mult >= 2
        if self.aggregator == "norm_clip" and not self.aggregator_clip_norm and m <= 2 \
                and self.aggregator_clip_multiplier >= m:
            return (f"aggregator norm_clip with the median-relative bound (multiplier "
                    f"{self.aggregator_clip_multiplier:g}) over {m} Delta(s) a round never clips: set "
                    "aggregator-clip-norm to a fixed bound")
        return None

    def _prior_errors(self) -> list[str]:
        """The prior's variance v and precision 1/v must be normal numbers of the run's dtype (else the prior is
        improper: 0 or inf after the cast), and its mean must fit in it."""
        tiny, big = _FLOAT_RANGE[self.dtype]
        errors = []
        if not tiny <= self.prior_variance <= 1.0 / tiny:
            errors.append(f"prior-variance: with dtype {self.dtype} the variance and its inverse must be normal "
                          f"floats, i.e. within [{tiny:.4g}, {1.0 / tiny:.4g}], got {self.prior_variance:g}")
        if not abs(self.prior_mean) <= big:
            errors.append(f"prior-mean: must fit in dtype {self.dtype} (|mean| <= {big:.4g}), got {self.prior_mean:g}")
        elif not errors and not abs(self.prior_mean) / self.prior_variance <= big:  # the natural parameter m / v
            errors.append(f"prior-mean: prior-mean / prior-variance = {self.prior_mean:g} / {self.prior_variance:g} "
                          f"overflows dtype {self.dtype} (the prior's natural parameter)")
        return errors

    # ---- derived -------------------------------------------------------------------------------
    @property
    def hidden_sizes(self) -> list[int]:
        return [int(p) for p in self.hidden.split(",") if p.strip()]

    def aggregator_hyper(self) -> dict[str, float | None]:
        if self.aggregator == "trimmed_mean":
            return {"trim": self.aggregator_trim}
        if self.aggregator == "norm_clip":
            return {"max_norm": self.aggregator_clip_norm or None, "multiplier": self.aggregator_clip_multiplier}
        return {}

    def staleness_bound(self) -> int:
        """The largest staleness an asynchronous update may have.  ``'auto'`` = M: with one message in flight
        per client, every other client's update can land between a client's dispatch and its reply, so a
        bound below M - 1 starves the slower clients even when all run at the same speed."""
        return self.num_clients if self.max_staleness == "auto" else int(self.max_staleness)

    def rho(self) -> float:
        if self.damping == "auto":
            return 1.0 if self.schedule == "sequential" else 1.0 / self.num_clients
        return float(self.damping)

    def to_flat(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(_hyphen(str(p)) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":  # the key as given: its hyphenated form may be a known key
            given = ".".join(str(p) for p in e["loc"])
            if given != key and key in _KEYS:
                lines.append(f"{given}: given twice, as {given} and as {key} (pyproject.toml's [tool.flwr.app.config] "
                             f"sets {key}, so an override must use that spelling: {key}=...)")
            else:
                lines.append(f"{given}: unknown run-config key")
        elif not key:  # model-level checks already name their keys
            lines.append(msg)
        elif e["type"] == "value_error":
            lines.append(f"{key}: {msg}")
        else:
            lines.append(f"{key}: {msg} (got {e.get('input')!r})")
    return "invalid run config: " + "; ".join(lines)


#: the run-config keys (the fields' aliases)
_KEYS = frozenset(f.alias or n for n, f in RunConfig.model_fields.items())


def parse_run_config(raw: Mapping[str, Any], *, ignore_unknown: bool = False) -> RunConfig:
    """Validate Flower's flat run config into a :class:`RunConfig` or raise :class:`ConfigError`.

    ``ignore_unknown`` drops keys that are not fields (Flower may add its own, e.g. ``num-server-rounds``
    is ours but other apps' keys are not).
    """
    data = dict(raw)
    if ignore_unknown:
        known = {f.alias or n for n, f in RunConfig.model_fields.items()} | set(RunConfig.model_fields)
        data = {k: v for k, v in data.items() if k in known}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
