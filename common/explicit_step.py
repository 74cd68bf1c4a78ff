"""One local GVI step of a one-hidden-layer mean-field BNN with its gradients written out: no autograd graph.

On the local-reparameterisation path with the compiled kernels, a step of :func:`common.local_gvi.local_gvi`
for :class:`~common.models.BayesianMLP` ``in -> H -> C`` is, for a minibatch ``x`` (``B`` rows) of ``n`` points::

    v, D      = fused_meanfield.forward(locs, raw scales)         variances of all four tensors, D(q || cavity)
    mu, var   = x W_mu^T + b_mu,  x^2 W_var^T + b_var             the hidden layer's pre-activation moments
    L, grads  = fused_head.loss_and_gradients(mu, sqrt(var), ...) the sampled hidden layer, output layer and loss
    objective = (n / B) L + D

then its gradient and Adam's update: the head returns ``dL/dmu, dL/dvar`` and the output layer's gradients, the
hidden layer's weight gradients are two GEMMs (``dmu^T x``, ``dvar^T x^2``) and two column sums, and
``fused_meanfield.backward_adam`` adds the divergence's gradient, turns the gradients w.r.t. the variances into
gradients w.r.t. the raw scales and applies Adam to every parameter in the same pass (torch's fused Adam
arithmetic, operation for operation), then forms the next step's ``v, D`` block by block while the updated
parameters are still in cache; the next step uses them unless torch changed a parameter in place meanwhile (an
early-stopping restore moves the parameters' version counters).  Through autograd and ``Adam.step`` the same step is five autograd
Functions, about twenty graph nodes, the Python around them and three more passes over the 2 x 159,010
parameters of 784-200-10 (``docs/bench_core.md`` has the times).  Here it is the calls above, in the order
autograd makes them, on the same tensors: the objective, the parameters and Adam's state are bit-identical to
the autograd path's (``tests/test_explicit_step.py``, ``tests/test_fused_update.py``), and so is a whole
:func:`~common.local_gvi.local_gvi` run.

It applies where that autograd path would run the fused kernels for every piece: a :class:`BayesianMLP` with
one hidden layer and fused sampling on, a loss the head computes (NLL or GCE, optionally weighted, no
reference), a moment-form divergence (:class:`~common.local_gvi.MeanFieldMomentDivergence`), float32 CPU
parameters, the kernels built, and :class:`~common.adam.Adam` over exactly ``q``'s parameters.
``PGVI_EXPLICIT_STEP=0`` turns it off (the autograd path then runs, for comparisons).  Deeper networks keep the
autograd path (its middle layers' sampler is an autograd Function).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from common import fused_head, fused_meanfield, fused_sampling
from common.adam import Adam
from common.environment import env_flag
from common.errors import DivergenceUndefinedError
from common.fused_meanfield import KINDS

#: Environment switch: ``0`` keeps the autograd path even where this step applies.
ENV_SWITCH = "PGVI_EXPLICIT_STEP"


def disabled_by_environment() -> bool:
    """``PGVI_EXPLICIT_STEP=0`` (also ``false``/``no``/``off``: :func:`common.environment.env_flag`)."""
    return not env_flag(ENV_SWITCH, True)


class OneHiddenLayerStep:
    """The step for fixed data ``x`` (``(n, in)`` float32), labels ``y`` (``(n,)``), a mean-field ``q`` (its
    parameters are read and updated in place at every call, with the optimiser's state) and a moment-form
    divergence ``fd`` to the cavity.  Build it with :meth:`create`, which returns ``None`` where it does not
    apply."""

    def __init__(self, model, loss, q, fd, x: Tensor, y: Tensor, n_samples: int,  # type: ignore[no-untyped-def]
                 optimiser: Adam, adam_width: int) -> None:
        spec = fused_head.loss_spec(loss)
        assert spec is not None
        self.delta, self.weight = spec
        self.names = list(q.names)
        self.locs, self.raws = list(q.locs), list(q.raw_scales)
        self.min_scale = float(q.min_scale)
        self.kind, self.alpha, self.c = KINDS[fd.kind], float(fd.alpha), 0.5 * fd.weight
        self.mean_ps = [fd.mean_p[k].detach().contiguous() for k in self.names]
        self.lam_ps = [fd.lam_p[k].detach().contiguous() for k in self.names]
        self.x = x
        self.y = (y.long() if y.dtype != torch.int64 else y).contiguous()
        self.n = int(x.shape[0])
        self.n_samples = int(n_samples)
        self.dtype = self.locs[0].dtype
        self.optimiser = optimiser
        self.adam_width = adam_width  # fused_meanfield.adam_vector_width for the optimiser's hyperparameters
        # fixed per run: the parameters' block numbering, buffers for the variances and d var / d raw, and the
        # operands the fused update writes through raw pointers (checked once here)
        self.numbering = fused_meanfield.blocks(self.locs)
        self.buffers = ([torch.empty_like(p) for p in self.locs], [torch.empty_like(p) for p in self.locs])
        fused_meanfield.check_adam_operands(self.locs, self.raws, optimiser.adam_states(self.locs),
                                            optimiser.adam_states(self.raws))
        # the next step's forward pass, made by the previous step's update while the parameters were in cache,
        # with the parameters' version counters at that time: ``(versions, state, total, bad)`` or ``None``
        self._next: tuple[tuple[int, ...], fused_meanfield.MomentPass, float, object] | None = None

    def _versions(self) -> tuple[int, ...]:
        """The parameters' version counters: any in-place change from torch (an early-stopping restore, a
        ``copy_``) moves them; the kernels' writes through raw pointers do not."""
        return tuple(p._version for p in (*self.locs, *self.raws))

    @classmethod
    def create(cls, model, loss, q, fd, x: Tensor, y: Tensor | None, n_samples: int,  # type: ignore[no-untyped-def]
               optimiser: Adam) -> OneHiddenLayerStep | None:
        """The step, or ``None`` where it does not apply (see the module docstring); ``optimiser`` is the
        :class:`~common.adam.Adam` over ``q``'s locs and raw scales that the step advances."""
        from common.models import BayesianMLP
        from common.variational import MeanFieldVariational

        if disabled_by_environment() or fd is None or not isinstance(q, MeanFieldVariational):
            return None
        if not (isinstance(model, BayesianMLP) and model.num_layers == 2 and model.use_fused_sampling
                and model.num_classes <= fused_head.MAX_CLASSES):
            return None
        if fused_head.loss_spec(loss) is None or getattr(loss, "needs_reference", False):
            return None
        if list(q.names) != list(model.param_shapes) or not all(
                fused_head.applies_to(t) and fused_meanfield.applies_to(t) and t.is_contiguous()
                for t in (*q.locs, *q.raw_scales)):
            return None  # the kernels read and write the parameters' storage as dense arrays
        params = [*q.locs, *q.raw_scales]
        if not (isinstance(optimiser, Adam) and optimiser.fused_applies(params)
                and {id(p) for ps, _ in optimiser.groups for p in ps} == {id(p) for p in params}):
            return None
        # the fused update reproduces this torch build's Adam bit for bit (checked once), or the autograd path runs
        adam_width = fused_meanfield.adam_vector_width(optimiser.beta1, optimiser.beta2, optimiser.eps)
        if adam_width is None:
            return None
        if not (x.dtype == q.locs[0].dtype and x.dim() == 2 and x.shape[1] == model.in_features
                and y is not None and y.shape == (x.shape[0],) and not torch.is_floating_point(y)):
            return None
        return cls(model, loss, q, fd, x, y, n_samples, optimiser, adam_width)

    def __call__(self, idx: Tensor | slice, generator: torch.Generator | None,
                 check: Callable[[Tensor, Tensor], object] | None = None) -> tuple[Tensor, Tensor]:
        """One step on the minibatch ``idx``: ``(E_q[loss on the minibatch] n / B, D(q || cavity))`` as float32
        scalars, the values the autograd path gives, and the optimiser's update of ``q`` with the objective's
        gradient.  ``check(expected, divergence)`` runs before the update (it raises to refuse the step).

        Raises:
            DivergenceUndefinedError: an Alpha-Renyi divergence is undefined at ``q`` (nothing is drawn
                from ``generator`` then, as on the autograd path).
        """
        if isinstance(idx, slice):
            xb, yb = self.x[idx], self.y[idx]
        else:
            xb, yb = self.x.index_select(0, idx), self.y.index_select(0, idx)
        b = int(xb.shape[0])
        locs = [p.detach() for p in self.locs]
        ahead, self._next = self._next, None
        if ahead is not None and ahead[0] == self._versions():
            state, total, bad = ahead[1], ahead[2], ahead[3]
        else:
            state, total, bad = fused_meanfield.forward(locs, [p.detach() for p in self.raws], self.mean_ps,
                                                         self.lam_ps, self.kind, self.alpha, self.min_scale,
                                                         self.numbering, self.buffers)
        for name, loc, nb in zip(self.names, locs, bad):
            if nb:
                raise DivergenceUndefinedError.alpha_renyi(self.alpha, int(nb), loc.numel(), name)
        w0, b0, w1, b1 = locs
        v_w0, v_b0, v_w1, v_b1 = state.variances
        mu = torch.addmm(b0, xb, w0.t())
        x2 = xb * xb
        var = torch.addmm(v_b0, x2, v_w0.t())
        k0, k1 = fused_sampling.draw_key(generator)
        s = self.n_samples
        total_loss, grads = fused_head.loss_and_gradients(mu, var.sqrt(), w1, b1, v_w1, v_b1, yb, s, self.delta,
                                                          self.weight / s, k0, k1, True)
        assert grads is not None
        # the autograd path's values: the head's float32 sum times n / B, and c times the divergence's sum
        head_value = torch.tensor(total_loss * self.weight / s, dtype=self.dtype)
        scale = head_value.new_tensor(self.n / b)
        expected = head_value * scale
        divergence = torch.tensor(self.c * total, dtype=self.dtype)
        if check is not None:
            check(expected, divergence)
        d_mu, d_var, d_w1, d_b1, d_vw1, d_vb1 = (g.mul_(scale) for g in grads)
        g_w0 = d_mu.t().mm(xb)  # the hidden layer's weight gradients, as addmm's backward forms them
        g_vw0 = d_var.t().mm(x2)
        g_b0 = d_mu.sum(0)
        g_vb0 = d_var.sum(0)
        # the divergence's gradient, the loss's and Adam in one pass over the parameters, then the next step's forward
        terms = self.optimiser.advance(self.locs + self.raws)
        ahead = fused_meanfield.backward_adam(state, [p.detach() for p in self.raws], [g_vw0, g_vb0, d_vw1, d_vb1],
                                              [g_w0, g_b0, d_w1, d_b1], self.c, self.kind, self.alpha,
                                              self.optimiser.constants(), terms[:4], terms[4:], self.adam_width,
                                              validate=False, forward_min_scale=self.min_scale)
        assert ahead is not None
        self._next = (self._versions(), state, *ahead)
        return expected, divergence


__all__ = ["ENV_SWITCH", "OneHiddenLayerStep", "disabled_by_environment"]
