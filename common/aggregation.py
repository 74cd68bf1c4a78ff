"""Byzantine-robust aggregation of a batch of client Deltas, in natural-parameter space.

Plain PGVI (FedGVI eq. 6) adds every client's Delta to the server loss, ``l_s <- l_s + sum_m Delta_m``; in natural
parameters, ``eta(global site) += sum_m eta(Delta_m)``.  One client that sends an arbitrary Delta (a Byzantine
client, or a broken one) can then move the posterior anywhere.  An :class:`Aggregator` replaces the plain sum.  It
maps each client's *received* Delta to the Delta the server *credits* to that client's site:

    credited = aggregator({client id: received Delta})      # same ids, same family, layout and dtype
    site_m <- site_m * credited_m,   global site <- global site * prod_m credited_m

The aggregate that replaces ``sum_m Delta_m`` is therefore ``sum_m credited_m``.  Because the ledger is updated
with the credited Deltas, ``posterior = prior * prod_m site_m`` still holds exactly, and a client whose Delta was
altered is later resent its credited site.

Registered aggregators (``make_aggregator(name, **hyper)``):

* ``"sum"``: the identity (plain PGVI).
* ``"norm_clip"`` (``max_norm``, ``multiplier``): each Delta is scaled down, direction unchanged, so that its
  Euclidean norm over *all* its natural-parameter coordinates (eta1 and eta2 flattened together; for a
  full-covariance factor this is the Frobenius norm of the eta2 matrix, so each off-diagonal pair counts twice)
  is at most the bound.  The bound is ``max_norm``; with ``max_norm=None`` it is ``multiplier * median`` of the
  batch's norms (adaptive).  A Delta within the bound is credited unchanged.
* ``"trimmed_mean"`` (``trim``): the coordinate-wise trimmed mean of the batch: per coordinate, drop the
  ``floor(trim * M)`` smallest and the ``floor(trim * M)`` largest values and average the rest (the semantics of
  ``scipy.stats.trim_mean``).  Every client is credited that mean, so the aggregate is ``M x trimmed mean``.
* ``"median"``: the coordinate-wise median (for even ``M`` the mean of the two middle values), credited to every
  client likewise.

Trade-offs, honestly:

* Trimmed mean and median estimate a *common* location.  They assume homogeneous (IID) clients whose honest
  Deltas scatter around one value.  With heterogeneous (non-IID) honest clients each client's Delta carries
  information about its own data, and replacing every Delta by the batch's median (or trimmed mean) biases the
  posterior: the aggregate ``M x median`` is not ``sum_m Delta_m`` even with no attacker.  Every client is also
  credited the same Delta, so client sites become identical increments rather than each client's own loss
  approximation.  In return, per coordinate they tolerate up to ``floor(trim * M)`` (trimmed mean) or fewer than
  ``M / 2`` (median) arbitrary Deltas: the result stays inside the range of the honest values.
* Norm clipping credits every honest Delta within the bound *unchanged*, so with a bound above the honest norms it
  adds no bias for heterogeneous clients.  It only limits how far one client can move the posterior (at most the
  bound per Delta); it does not detect a Byzantine Delta of ordinary size, e.g. a sign-flipped honest Delta.
  With the adaptive bound and ``multiplier = 1`` about half of the batch (those above the median norm) is scaled
  down a little; use a multiplier above 1 to leave typical honest Deltas untouched.  If more than half of the
  batch has norm zero the adaptive bound is zero and every Delta is credited as zero.
* Properness.  No aggregator guarantees that the aggregated posterior is proper, nor that it is proper whenever
  the plain sum would be: e.g. a client with a large precision increase and several with small decreases have a
  proper plain sum, while their median (or the clipped large one) is a net precision decrease.  (For a batch of
  a single Delta, norm clipping cannot break properness: ``q * Delta**c`` with ``c`` in ``[0, 1]`` is a convex
  combination of ``q`` and ``q * Delta`` in natural parameters, and proper natural parameters form a convex
  set.)  The server therefore applies the credited Deltas with
  :meth:`common.factors.PGVIServerState.apply`, which checks the posterior after aggregation and rejects the
  batch atomically if it is improper.  Where the server step is a closed form, the server also checks each
  received Delta on its own before aggregating (``PGVIStrategy._check_alone``: ``posterior * Delta`` must be proper
  for the KL step, ``posterior * Delta ** w`` for the weighted KL step) and rejects one that fails, charging its
  client: such a Delta never reaches the aggregator, even where clipping would have made it harmless, so the
  batch the median or trimmed mean sees is the one left after that check.  A server step solved by optimisation
  is not run once per Delta beforehand: the batch's own step decides, and a Delta is blamed only after the batch
  is rejected.  Any other server step (a wrapper, a plug-in) is run with each Delta alone.

All aggregators are deterministic, do not modify their inputs, and give bit-identical results whatever the order
of the clients in the mapping (sorting is exact).  Credited Deltas are new factors, except that a Delta credited
unchanged (``"sum"``, or within the clipping bound) is returned as the input object itself: factors are
immutable by convention (every operation returns a new factor).  Non-finite Deltas and batches of mixed
family/layout/dtype are rejected with typed errors naming the client.
"""

from __future__ import annotations

import inspect
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor

from common.errors import ShapeMismatchError
from common.families import GaussianFactor
from common.registry import Registry


# ==================================================================================================
# helpers
def _norm_parts(factor: GaussianFactor) -> tuple[float, float]:
    """``(scale, relative)`` with the natural-parameter norm equal to ``scale * relative``: ``(1, norm)`` where the
    norm is a finite float64, else ``scale`` the largest magnitude (finite entries whose squares overflow)."""
    norms = [float(torch.linalg.vector_norm(v.detach(), dtype=torch.float64)) for v in factor.params.values()]
    norm = math.hypot(*norms)
    if math.isinf(norm):  # finite entries whose squares overflow (a float64 Delta of 1e200s: the clip zeroed it)
        scale = max(float(v.detach().abs().max().to(torch.float64)) for v in factor.params.values() if v.numel())
        if math.isfinite(scale) and scale > 0.0:
            return scale, math.hypot(*(float(torch.linalg.vector_norm(v.detach().to(torch.float64) / scale))
                                       for v in factor.params.values()))
    return 1.0, norm


def natural_parameter_norm(factor: GaussianFactor) -> float:
    """Euclidean norm of all natural-parameter coordinates of ``factor`` (eta1 and eta2 flattened together),
    accumulated in float64 (``inf`` only where the norm itself is beyond float64's range)."""
    scale, relative = _norm_parts(factor)
    return scale * relative


def _median(values: list[float]) -> float:
    """The median, the two middle values of an even count averaged as ``a / 2 + b / 2`` (``statistics.median``'s
    ``(a + b) / 2`` overflowed for two norms near float64's maximum, and the adaptive bound became inf)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * ordered[mid - 1] + 0.5 * ordered[mid]


def check_batch(deltas: Mapping[str, GaussianFactor]) -> list[str]:
    """The client ids of a batch of Deltas, after checking that they are finite and share one family, layout and
    dtype.  Raises :class:`~common.errors.NonFiniteError` / :class:`~common.errors.ShapeMismatchError` naming the
    client, ``TypeError`` for a value that is not a :class:`GaussianFactor`."""
    ids = list(deltas)
    if not ids:
        return ids
    ref_id = ids[0]
    ref = deltas[ref_id]
    for cid in ids:
        d = deltas[cid]
        if not isinstance(d, GaussianFactor):
            raise TypeError(f"Delta from '{cid}' is a {type(d).__name__}, not a GaussianFactor")
        if type(d) is not type(ref):
            raise ShapeMismatchError(
                f"Delta from '{cid}' is a {type(d).__name__}, Delta from '{ref_id}' a {type(ref).__name__}"
            )
        if list(d.params) != list(ref.params):
            raise ShapeMismatchError(
                f"Delta from '{cid}' has natural parameters {list(d.params)}, '{ref_id}' has {list(ref.params)}"
            )
        for k, v in d.params.items():
            r = ref.params[k]
            if v.shape != r.shape or v.dtype != r.dtype:
                raise ShapeMismatchError(
                    f"Delta from '{cid}': '{k}' is {tuple(v.shape)} {v.dtype}, "
                    f"Delta from '{ref_id}' has {tuple(r.shape)} {r.dtype}"
                )
        d.check_finite(f"Delta from '{cid}'")
    return ids


def _positive_finite(value: object, name: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}") from None
    if not (math.isfinite(x) and x > 0.0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return x


def coordinatewise_median(stacked: Tensor) -> Tensor:
    """Median over dim 0 of ``stacked``; for an even count the mean of the two middle values (as ``np.median``;
    ``torch.median`` would return the lower one).

    The mean of the two middle values is ``0.5 a + 0.5 b``: halving is exact (short of subnormals), so this is
    ``0.5 (a + b)`` to the bit wherever that does not overflow, and finite for all finite inputs (``a + b``
    overflowed for two values near the float range, e.g. ``3e38`` in float32)."""
    m = stacked.shape[0]
    s = torch.sort(stacked, dim=0).values
    if m % 2 == 1:
        return s[m // 2].clone()
    return 0.5 * s[m // 2 - 1] + 0.5 * s[m // 2]


#: float64 values at or above this magnitude are scaled by ``2**-_SCALE_BITS`` before a sum (exact: a power of two)
_BIG = 2.0 ** 1000
_SCALE_BITS = 64


def coordinatewise_trimmed_mean(stacked: Tensor, trim: float) -> Tensor:
    """Trimmed mean over dim 0: drop the ``int(trim * M)`` smallest and largest values per coordinate and average
    the rest (``scipy.stats.trim_mean(x, trim, axis=0)``).

    Overflow-safe for finite inputs: the sum is taken in float64 (and cast back to the input's dtype), and a float64
    coordinate with a value of magnitude ``>= 2**1000`` is summed scaled by ``2**-64`` (exact short of subnormals, so
    float64 results are unchanged wherever the plain sum did not overflow).  The values are summed in sorted order,
    so the result does not depend on the order of the clients."""
    m = stacked.shape[0]
    k = int(trim * m)
    s = torch.sort(stacked, dim=0).values[k : m - k]
    wide = s.to(torch.float64)
    big = wide.abs().amax(dim=0) >= _BIG
    if bool(big.any()):
        scale = torch.where(big, 2.0 ** -_SCALE_BITS, 1.0).to(torch.float64)
        mean = (wide * scale).mean(dim=0) / scale
    else:
        mean = wide.mean(dim=0)
    return mean.to(stacked.dtype)


def _coordinatewise(deltas: Mapping[str, GaussianFactor], ids: list[str], reduce) -> GaussianFactor:  # noqa: ANN001
    """Apply ``reduce`` (stacked ``(M, *shape)`` -> ``shape``) to each named natural-parameter tensor."""
    ref = deltas[ids[0]]
    out = {k: reduce(torch.stack([deltas[c].params[k].detach() for c in ids])) for k in ref.params}
    return ref._like(out)


# ==================================================================================================
# aggregators
class Aggregator(ABC):
    """Maps a batch of received Deltas to the Deltas the server credits to each client's site."""

    name: ClassVar[str]

    @abstractmethod
    def __call__(self, deltas: Mapping[str, GaussianFactor]) -> dict[str, GaussianFactor]:
        """Map each client's received Delta to the Delta the server *credits* to that client's site.

        The server then applies the credited Deltas (sum of credited = the aggregate that replaces sum Delta), so
        the ledger identity posterior = prior * prod(sites) keeps holding and each client is later resent its
        credited site.  Must not modify the inputs.  Deterministic.  Same family/layout/dtype as the inputs.
        The keys (and their order) are those of ``deltas``; an empty batch gives an empty dict.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


AGGREGATORS: Registry[Aggregator] = Registry("aggregator")


@AGGREGATORS.register("sum")
class Sum(Aggregator):
    """Plain PGVI: every Delta is credited as received."""

    name: ClassVar[str] = "sum"

    def __call__(self, deltas: Mapping[str, GaussianFactor]) -> dict[str, GaussianFactor]:
        ids = check_batch(deltas)
        return {cid: deltas[cid] for cid in ids}


@AGGREGATORS.register("norm_clip")
class NormClip(Aggregator):
    """Scale each Delta down (direction unchanged) to Euclidean norm at most the bound.

    ``max_norm``: the fixed bound; ``None`` for the adaptive bound ``multiplier * median(norms of the batch)``.
    ``multiplier`` is used only by the adaptive bound.
    """

    name: ClassVar[str] = "norm_clip"

    def __init__(self, max_norm: float | None = None, multiplier: float = 1.0) -> None:
        self.max_norm = None if max_norm is None else _positive_finite(max_norm, "max_norm")
        self.multiplier = _positive_finite(multiplier, "multiplier")

    def bound(self, norms: list[float]) -> float:
        """The clipping bound for a batch whose Deltas have these norms."""
        if self.max_norm is not None:
            return self.max_norm
        # at most float64's largest value: multiplier * median overflowed to inf (and a median of overflowing norms
        # is inf), and an infinite bound credited every Delta unchanged, however large its norm
        return min(self.multiplier * _median(norms), sys.float_info.max)

    def __call__(self, deltas: Mapping[str, GaussianFactor]) -> dict[str, GaussianFactor]:
        ids = check_batch(deltas)
        if not ids:
            return {}
        parts = [_norm_parts(deltas[c]) for c in ids]
        norms = [scale * relative for scale, relative in parts]
        bound = self.bound(norms)
        out: dict[str, GaussianFactor] = {}
        for cid, norm, (scale, relative) in zip(ids, norms, parts):
            d = deltas[cid]
            # bound / norm as (bound / scale) / relative: finite and > 0 also for a norm beyond float64's range
            # (bound / inf credited the Delta as zero, not scaled down to the bound)
            out[cid] = d if norm <= bound else d ** ((bound / scale) / relative)
        return out

    def __repr__(self) -> str:
        return f"NormClip(max_norm={self.max_norm}, multiplier={self.multiplier})"


@AGGREGATORS.register("trimmed_mean")
class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean (``floor(trim * M)`` dropped at each end), credited to every client."""

    name: ClassVar[str] = "trimmed_mean"

    def __init__(self, trim: float = 0.2) -> None:
        if isinstance(trim, bool):
            raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
        try:
            t = float(trim)
        except (TypeError, ValueError):
            raise ValueError(f"trim must be in [0, 0.5), got {trim!r}") from None
        if not (0.0 <= t < 0.5):
            raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
        self.trim = t

    def location(self, deltas: Mapping[str, GaussianFactor]) -> GaussianFactor:
        ids = check_batch(deltas)
        if not ids:
            raise ValueError("the trimmed mean of an empty batch is undefined")
        return _coordinatewise(deltas, ids, lambda x: coordinatewise_trimmed_mean(x, self.trim))

    def __call__(self, deltas: Mapping[str, GaussianFactor]) -> dict[str, GaussianFactor]:
        if not deltas:
            return {}
        loc = self.location(deltas)
        return {cid: loc.clone() for cid in deltas}

    def __repr__(self) -> str:
        return f"TrimmedMean(trim={self.trim})"


@AGGREGATORS.register("median")
class Median(Aggregator):
    """Coordinate-wise median (mean of the two middle values for even ``M``), credited to every client."""

    name: ClassVar[str] = "median"

    def location(self, deltas: Mapping[str, GaussianFactor]) -> GaussianFactor:
        ids = check_batch(deltas)
        if not ids:
            raise ValueError("the median of an empty batch is undefined")
        return _coordinatewise(deltas, ids, coordinatewise_median)

    def __call__(self, deltas: Mapping[str, GaussianFactor]) -> dict[str, GaussianFactor]:
        if not deltas:
            return {}
        loc = self.location(deltas)
        return {cid: loc.clone() for cid in deltas}


def make_aggregator(name: str, **hyper: object) -> Aggregator:
    """The aggregator registered as ``name`` with hyperparameters ``hyper`` (e.g. ``trim=0.1``).

    Unknown ``name``: :class:`KeyError` listing the known names.  Unknown or invalid hyperparameters:
    :class:`ValueError` naming them.
    """
    factory = AGGREGATORS.get(name)
    accepted = list(inspect.signature(factory).parameters)
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
        raise ValueError(f"aggregator '{name}' takes hyperparameters {accepted or 'none'}; unknown: {unknown}")
    return factory(**hyper)
