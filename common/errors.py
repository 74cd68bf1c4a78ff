"""Typed errors of the PGVI core.

A distribution that goes improper is never repaired silently (the reference code zeroes its Alpha-Renyi
term on NaN; we do not).  The core raises one of these and the caller decides what to do (halve the
damping, reject a client's update, stop the run).
"""

from __future__ import annotations


class PGVIError(Exception):
    """Base class of every error raised on purpose by the PGVI core."""


class ImproperDistributionError(PGVIError, ValueError):
    """A Gaussian that must be a probability distribution has a precision that is not positive definite.

    Attributes:
        what: which object was checked ("cavity", "server posterior", "local posterior", ...).
        detail: a human-readable description of the offending entries.
    """

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"{what} is improper: {detail}")


class DivergenceUndefinedError(PGVIError, ValueError):
    """A divergence has no finite value for these arguments (e.g. Alpha-Renyi with alpha > 1 when
    alpha * eta_q + (1 - alpha) * eta_p is not a proper natural parameter)."""

    @classmethod
    def alpha_renyi(cls, alpha: float, bad: int, numel: int, name: str) -> DivergenceUndefinedError:
        """The error of a mean-field Alpha-Renyi divergence undefined in ``bad`` of the ``numel`` coordinates
        of tensor ``name``."""
        return cls(
            f"Alpha-Renyi divergence with alpha={alpha:g} is infinite: combined precision "
            f"alpha*lambda_q + (1-alpha)*lambda_p <= 0 in {bad} of {numel} coordinates of '{name}'"
            + (f"; for alpha > 1, q must satisfy sigma_q^2 < {alpha / (alpha - 1.0):.4g} * sigma_p^2"
               if alpha > 1.0 else "")
        )


class NonFiniteError(PGVIError, ValueError):
    """A tensor that must be finite contains NaN or infinity."""


class ShapeMismatchError(PGVIError, ValueError):
    """Two sets of natural parameters do not have the same names and shapes."""


class ScaleFloorError(PGVIError, ValueError):
    """A proper distribution is narrower than the variational family's parameterisation floor ``min_scale`` (a
    scale ``softplus(raw) + min_scale`` cannot represent it), so the local optimiser cannot start from it."""
