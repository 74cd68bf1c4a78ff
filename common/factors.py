"""PGVI factor algebra (FedGVI eqs. 3, 5, 6) and the transport-free server state.

Notation (natural parameters, sites ``t_m = exp(-l_m)``):

* posterior    q       = pi * prod_m t_m                 (server with D_s = KL)
* cavity       q\\m    = q / t_m                          (eq. 3)
* damped site  t_m'    = t_m * (q_m / q)**rho             (eq. 5), Delta_m = (q_m / q)**rho
* server       q'      = q * prod_m Delta_m               (eq. 6 + closed-form eq. 7)

Every object that must be a distribution is checked with ``check_proper`` and raises
:class:`~common.errors.ImproperDistributionError` when it is not; nothing is clipped.  The caller decides
(e.g. reject the update, or halve ``rho`` and retry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from common.errors import ImproperDistributionError, PGVIError, ShapeMismatchError
from common.families import FullCovarianceGaussian, GaussianFactor


def check_damping(rho: float) -> float:
    if not (0.0 < float(rho) <= 1.0):
        raise ValueError(f"damping rho must be in (0, 1], got {rho}")
    return float(rho)


def cavity(posterior: GaussianFactor, site: GaussianFactor) -> GaussianFactor:
    """``q / t_m``, checked to be a proper distribution, from a posterior ``q`` checked to be one too (an improper
    ``q`` divided by a site of even lower precision gives a proper cavity, and the client's Delta would be computed
    against a ``q`` the server never holds: the server only sends proper posteriors, so this is a corrupted
    message or a direct caller's mistake, named here)."""
    posterior.check_proper("posterior")
    cav = posterior / site
    detail = cav.improper_detail()
    if detail is None:
        return cav
    if _within_rounding_of_posterior(posterior, cav):
        way_out = ("run with dtype float64" if posterior.dtype != torch.float64 else
                   "a less vague prior (prior-variance) or data of a smaller scale")
        detail += (f"; there the cavity's precision is within {posterior.dtype}'s rounding of the posterior's: this "
                   "client's site holds nearly all of it (a vague prior, or this client's data dominating those "
                   f"directions), and the exact cavity, prior x the other sites, is lost in q's rounding: {way_out}")
    raise ImproperDistributionError("cavity", detail)


#: how many ulps of the posterior's precision a non-positive cavity precision may be from 0 to be put down to rounding
_CANCELLATION_ULPS = 16.0


def _within_rounding_of_posterior(posterior: GaussianFactor, cav: GaussianFactor) -> bool:
    """Whether some non-positive precision of the cavity ``q / t_m`` is within a few ulps of the posterior's own
    precision there (in the factors' dtype): the difference of two nearly equal precisions, whose exact value (the
    prior's and the other sites' precision) was rounded away when ``q`` was formed.  Finite factors only."""
    eps = torch.finfo(posterior.dtype).eps
    if isinstance(cav, FullCovarianceGaussian) and isinstance(posterior, FullCovarianceGaussian):
        lam_c = -(cav.eta2 + cav.eta2.T)
        lam_q = -(posterior.eta2 + posterior.eta2.T)
        if not (torch.isfinite(lam_c).all() and torch.isfinite(lam_q).all()):
            return False
        smallest = float(torch.linalg.eigvalsh(lam_c.to(torch.float64))[0])
        scale = float(torch.linalg.matrix_norm(lam_q.to(torch.float64), ord=2))
        return smallest <= 0.0 and -smallest <= _CANCELLATION_ULPS * eps * scale
    for key, e2 in cav.params.items():
        if not key.startswith("eta2"):
            continue
        lam_c, lam_q = -2.0 * e2, -2.0 * posterior.params[key]
        bad = lam_c <= 0
        if bool(bad.any()) and bool((lam_c[bad].abs() <= _CANCELLATION_ULPS * eps * lam_q[bad].abs()).any()):
            return True
    return False


def product_of_sites(sites: Iterable[GaussianFactor], like: GaussianFactor,
                     accumulate: torch.dtype | None = None) -> GaussianFactor:
    """``prod_m t_m`` (natural parameters summed) from ``like.zeros_like()``, in ``like``'s dtype; with
    ``accumulate`` the sum is formed in that dtype (e.g. float64) and cast back once."""
    if accumulate is None:
        total = like.zeros_like()
        for s in sites:
            total = total * s
        return total
    return _sum_in(sites, like, accumulate).to(like.dtype)


def _sum_in(sites: Iterable[GaussianFactor], like: GaussianFactor, dtype: torch.dtype) -> GaussianFactor:
    """``prod_m t_m`` formed and returned in ``dtype``."""
    total = like.zeros_like().to(dtype)
    for s in sites:
        total = total * s.to(dtype)
    return total


def damped_delta(local_posterior: GaussianFactor, posterior: GaussianFactor, rho: float) -> GaussianFactor:
    """``Delta_m = (q_m / q) ** rho``: the change of client m's site, the only thing sent to the server."""
    local_posterior.check_proper("local posterior")
    return (local_posterior / posterior) ** check_damping(rho)


def apply_deltas(posterior: GaussianFactor, deltas: Iterable[GaussianFactor], what: str = "server posterior") -> GaussianFactor:
    """``q * prod Delta``, checked to be proper."""
    out = posterior
    for d in deltas:
        out = out * d
    return out.check_proper(what)


ServerStep = Callable[[GaussianFactor, GaussianFactor], GaussianFactor]
"""``(prior, global_site) -> posterior``: FedGVI eq. 7 for a server divergence D_s."""


def kl_server_step(prior: GaussianFactor, global_site: GaussianFactor) -> GaussianFactor:
    """Eq. 7 with D_s = KL: ``q_s = pi * exp(-l_s)``, exact in natural parameters."""
    return prior * global_site


class UpdateRejected(PGVIError):
    """A client's Delta was not applied; ``reason`` says why.  The server state is unchanged."""

    def __init__(self, client_id: str, reason: str) -> None:
        self.client_id = client_id
        self.reason = reason
        super().__init__(f"update from client '{client_id}' rejected: {reason}")


@dataclass
class PGVIServerState:
    """Prior, per-client sites (the ledger), the global loss approximation and the posterior.

    ``global_site`` is ``exp(-l_s)`` = the product of all sites; ``posterior`` is the result of the
    server step ``server_step(prior, global_site)``.  ``version`` counts applied update batches; it is
    what clients' staleness is measured in.
    """

    prior: GaussianFactor
    server_step: ServerStep = kl_server_step
    sites: dict[str, GaussianFactor] = field(default_factory=dict)
    global_site: GaussianFactor | None = None
    posterior: GaussianFactor | None = None
    version: int = 0
    #: ``(global_site, the same sum in float64)`` as :meth:`apply` left them (see :meth:`_global_site64`)
    _global64: tuple[GaussianFactor, GaussianFactor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prior.check_proper("prior")
        if self.global_site is None:
            self.global_site = self.prior.zeros_like()
        if self.posterior is None:
            self.posterior = self.server_step(self.prior, self.global_site).check_proper("server posterior")

    def site(self, client_id: str) -> GaussianFactor:
        """Client's site from the ledger (the uniform factor for a client never heard from)."""
        if client_id not in self.sites:
            self.sites[client_id] = self.prior.zeros_like()
        return self.sites[client_id]

    def apply(self, deltas: Mapping[str, GaussianFactor]) -> GaussianFactor:
        """Apply a batch of Deltas atomically (eq. 6 then eq. 7).

        All Deltas are checked first (finiteness, layout, dtype), then the resulting posterior must be proper.  If
        any check fails nothing changes and :class:`UpdateRejected` names the offending client (all clients
        of the batch, comma-separated, when only their joint effect makes the posterior improper).

        Cavities are not checked here: a site may legitimately have negative precision, and whether a
        client's next cavity is proper is checked by that client (``common.factors.cavity`` raises), which
        then reports a failed step and keeps its site.

        A Delta must have the prior's dtype (as one decoded by ``strategies.codec.record_to_factor`` always has):
        one of another dtype is rejected instead of silently promoting the ledger and posterior to it.
        """
        assert self.global_site is not None and self.posterior is not None
        new_sites = {}
        # the global site takes each site's change as stored (the new site less the old), summed in float64 and
        # cast once: a float32 site rounds at its own scale, and a client whose Deltas cancel (+B, then -B) left the
        # float32 running sum that many roundings of B away from the product of the sites (0.0076 at B = 1e5),
        # beyond what a resume accepts, so the server refused its own checkpoint
        global64 = self._global_site64()
        for cid, delta in deltas.items():
            try:
                if delta.dtype != self.prior.dtype:
                    raise ShapeMismatchError(
                        f"Delta from '{cid}' has dtype {delta.dtype}, the server state {self.prior.dtype}"
                    )
                delta.check_finite(f"Delta from '{cid}'")
                # a finite Delta can still overflow the client's site (two colluding peers: +B and -B keep the
                # global site finite while one site reaches inf): q = prior x prod sites would break silently and
                # every later checkpoint be refused
                old = new_sites.get(cid, self.sites.get(cid, self.prior.zeros_like()))
                new_sites[cid] = (old * delta).check_finite(f"site of '{cid}' after its Delta")
                global64 = global64 * (new_sites[cid].to(torch.float64) / old.to(torch.float64))
            except PGVIError as err:
                raise UpdateRejected(cid, str(err)) from err
        try:
            global_site = global64.to(self.prior.dtype).check_finite("global site")
            posterior = self.server_step(self.prior, global_site).check_proper("server posterior")
        except PGVIError as err:
            raise UpdateRejected(",".join(deltas), str(err)) from err

        self.sites.update(new_sites)
        self.global_site = global_site
        self._global64 = (global_site, global64)
        self.posterior = posterior
        self.version += 1
        return posterior

    def _global_site64(self) -> GaussianFactor:
        """The product of the stored sites in float64: the one :meth:`apply` last formed while ``global_site`` is
        still the one it set, else summed afresh from the sites (after :meth:`remove_site`, a checkpoint's load)."""
        if self._global64 is not None and self._global64[0] is self.global_site:
            return self._global64[1]
        return _sum_in(self.sites.values(), self.prior, torch.float64)

    def remove_site(self, client_id: str) -> GaussianFactor:
        """Take a client's site out of the global approximation (``l_s -= l_m``) and reset it to uniform.

        The global site becomes the product of the *other* sites, recomputed (summed in float64, then cast to the
        state's dtype), not the running global site divided by the removed one: the running sum carries the
        rounding of every Delta it absorbed, and a removed site is typically a Byzantine client's, far larger than
        the others (a float32 run whose excluded client had pushed eta1 to 1e9 kept a residue of 61 in the global
        site and the posterior after dividing it out, and its checkpoint was refused on resume as an inconsistent
        ledger).  The recomputed product is what :meth:`check_invariant` compares against.

        Atomic like :meth:`apply`: if the posterior without the site would be improper, :class:`UpdateRejected`
        is raised and nothing changes.  Counts as an applied batch (``version`` advances).
        """
        assert self.global_site is not None and self.posterior is not None
        site = self.sites.get(client_id)
        if site is None:
            return self.posterior
        try:  # summed in float64 (the float32 sum of many sites rounds at every addition), checked finite
            others = (s for cid, s in self.sites.items() if cid != client_id)
            global_site = product_of_sites(others, self.prior, torch.float64).check_finite("global site")
        except PGVIError as err:
            raise UpdateRejected(client_id, f"removing its site: {err}") from err
        try:
            posterior = self.server_step(self.prior, global_site).check_proper("server posterior")
        except PGVIError as err:
            raise UpdateRejected(client_id, f"removing its site: {err}") from err
        self.sites[client_id] = self.prior.zeros_like()
        self.global_site = global_site
        self.posterior = posterior
        self.version += 1
        return posterior

    def check_invariant(self, atol: float = 1e-8) -> float:
        """max |eta(global_site) - eta(prod sites)|: must be ~0 at all times (l_s = sum_m l_m)."""
        assert self.global_site is not None
        return product_of_sites(self.sites.values(), self.prior).max_abs_diff(self.global_site)
