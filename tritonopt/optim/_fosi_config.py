"""FOSI's settings, and the subspace through which it reaches its basis ``V``.

:class:`FOSIConfig` holds the settings every parameter group shares;
:class:`LocalSubspace` keeps all of ``V`` in this process and hands an
estimate over as a :class:`Curvature` (:class:`tritonopt.dist.DHO2` passes a
subspace that shards ``V`` over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Callable, Optional, Sequence

import torch

from tritonopt._validation import check_bool, check_choice, check_float, check_int
from tritonopt.optim.functional import FOSI_BASES, fosi_newton_scale, fosi_update
from tritonopt.optim._sharding import local_tensor
from tritonopt.optim.lanczos import (
    DifferenceHVP,
    LanczosResult,
    default_breakdown_rtol,
    default_lanczos_iters,
    extreme_ritz,
    difference_step,
    lanczos,
    make_hvp,
    ritz_vectors,
)

# The fused update takes at most this many basis rows (k + l).
MAX_RANK = 64
# How the ESE forms Hessian-vector products: by double backward, or from differences of the gradient.
HVP_METHODS = ("double_backward", "central_difference", "forward_difference")

@dataclass(frozen=True)
class FOSIConfig:
    """FOSI's settings shared by every parameter group (see :class:`FOSI` for their meaning); validated."""

    base: str = "adam"
    k: int = 10
    l: int = 0
    alpha: float = 0.1
    num_lanczos_iters: Optional[int] = None
    warmup_steps: Optional[int] = 0
    curvature_update_every: int = 100
    lanczos_dtype: torch.dtype = torch.float64
    reorth_passes: int = 2
    paper_exact: bool = False
    g1_momentum: float = 0.0
    learning_rate_clip: float = 1.0
    ritz_rtol: float = 1e-6
    eigenvalue_floor: float = 1e-3
    seed: int = 0
    hvp: Optional[str] = None
    hvp_eps: Optional[float] = None

    def __post_init__(self) -> None:
        check_choice("base", self.base, FOSI_BASES)
        check_int("k", self.k, low=0)
        check_int("l", self.l, low=0)
        if self.k + self.l > MAX_RANK:
            raise ValueError(f"k + l must be at most {MAX_RANK}, got {self.k + self.l}")
        check_float("alpha", self.alpha, low=0.0)
        if self.num_lanczos_iters is not None:
            check_int("num_lanczos_iters", self.num_lanczos_iters, low=1)
        if self.warmup_steps is not None:
            check_int("warmup_steps", self.warmup_steps, low=0)
        check_int("curvature_update_every", self.curvature_update_every, low=1)
        if self.lanczos_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"lanczos_dtype must be torch.float32 or torch.float64, got {self.lanczos_dtype}")
        check_int("reorth_passes", self.reorth_passes, low=1, high=3)
        check_bool("paper_exact", self.paper_exact)
        check_float("g1_momentum", self.g1_momentum, low=0.0, high=1.0, high_open=True)
        check_float("learning_rate_clip", self.learning_rate_clip, low=1.0)
        if self.paper_exact and (self.g1_momentum or self.learning_rate_clip != 1.0):
            raise ValueError("paper_exact=True is eqs. (11)-(12) as printed: it takes g1_momentum=0 "
                             "and learning_rate_clip=1")
        check_float("ritz_rtol", self.ritz_rtol, low=0.0, high=1.0)
        check_float("eigenvalue_floor", self.eigenvalue_floor, low=0.0, high=1.0)
        check_int("seed", self.seed, low=0)
        if self.hvp is not None:
            check_choice("hvp", self.hvp, HVP_METHODS)
        if self.hvp_eps is not None:
            check_float("hvp_eps", self.hvp_eps, low=0.0, low_open=True)
            if self.hvp == "double_backward":
                raise ValueError("hvp_eps is the step of a gradient-difference product; hvp='double_backward' "
                                 "takes none")

    def hvp_method(self, sharded: bool) -> str:
        """The product the ESE uses: ``hvp``, or by default double backward on plain tensors and central
        differences on DTensor parameters (FSDP2 forms their gradient in a reduce-scatter with no backward)."""
        if self.hvp is not None:
            return self.hvp
        return "central_difference" if sharded else "double_backward"

    @property
    def first_curvature_step(self) -> int:
        """The update index (0-based) before which the first ESE runs."""
        return self.curvature_update_every - 1 if self.warmup_steps is None else self.warmup_steps

    def curvature_due(self, step: int) -> bool:
        """Whether the ESE runs before update ``step`` (0-based)."""
        first = self.first_curvature_step
        return self.k + self.l > 0 and step >= first and (step - first) % self.curvature_update_every == 0

    def lanczos_iters(self, n: int) -> int:
        if self.num_lanczos_iters is not None:
            return min(self.num_lanczos_iters, n)
        return default_lanczos_iters(self.k, self.l, n)

    def g1_decay_gain(self) -> tuple[float, float]:
        """``(decay, gain)`` of the coefficient-space velocity: an EMA for Adam, a momentum sum otherwise."""
        d = self.g1_momentum
        return d, (1.0 - d) if self.base == "adam" else 1.0

    def newton_scale(self, eigenvalues: torch.Tensor, ritz_scale: float) -> torch.Tensor:
        """:func:`~tritonopt.optim.functional.fosi_newton_scale` with these settings (float64)."""
        return fosi_newton_scale(eigenvalues.double(), self.alpha, floor=self.eigenvalue_floor,
                                 ritz_scale=ritz_scale, signed=self.paper_exact)


@dataclass
class Curvature:
    """One extreme-spectrum estimate, as a subspace hands it to :class:`FOSI`.

    ``values`` (``[r_here]`` float64) and ``basis`` (``[r_here, n]``, orthonormal
    rows) are the Ritz pairs this process applies; ``all_values`` (``[r]``
    float64, ascending) every selected Ritz value; ``ritz_scale`` the largest
    ``|Ritz value|`` of the estimate; ``report`` what the estimate held.
    """

    values: torch.Tensor
    basis: torch.Tensor
    all_values: torch.Tensor
    ritz_scale: float
    report: dict


def ese_hvp(config: FOSIConfig, params: Sequence[torch.Tensor], loss_fn: Callable[[], torch.Tensor],
            dtype: torch.dtype, *, sharded: bool, squared_norm: Callable[[torch.Tensor], float]):
    """The Hessian-vector product of ``loss_fn`` that ``config.hvp`` names, on this rank's coordinates.

    ``squared_norm(w)``: ``||w||^2`` of the whole weight vector whose local part
    is ``w`` (float64), for the default step of a gradient-difference product.
    """
    method = config.hvp_method(sharded)
    if method == "double_backward":
        return make_hvp(params, loss_fn, dtype)
    scheme = "central" if method == "central_difference" else "forward"
    step = config.hvp_eps
    if step is None:
        squared = squared_norm(torch.cat([local_tensor(p).detach().reshape(-1).double() for p in params]))
        coarsest = max((p.dtype for p in params), key=lambda t: torch.finfo(t).eps)
        step = difference_step(scheme, coarsest, math.sqrt(squared) if squared >= 0 else math.nan)
    return DifferenceHVP(params, loss_fn, dtype, scheme=scheme, eps=step)


def curvature_from_lanczos(result: LanczosResult, config: FOSIConfig, dtype: torch.dtype) -> Curvature:
    """The selected Ritz pairs of a Lanczos run (every row of ``V`` here), their vectors in ``dtype``."""
    ritz = extreme_ritz(result.tridiag, config.k, config.l, config.ritz_rtol)
    report = {"steps": result.steps, "breakdown": result.breakdown, "basis_numel": result.basis.numel(),
              "basis_shape": tuple(result.basis.shape)}
    return Curvature(ritz.values, ritz_vectors(result.basis, ritz.vectors, dtype), ritz.values, ritz.scale, report)


class LocalSubspace:
    """FOSI's subspace held whole in this process (the default of :class:`FOSI`).

    A subspace is the object through which FOSI reaches ``V``; another one
    (DHO2's, which shards ``V`` over ranks) provides the same methods:

    * ``reduce_gradient(grad)``: make the flat gradient the one every process uses;
    * ``extreme_spectrum(hvp, n, config, *, dtype, device, seed) -> Curvature``;
    * ``carry_velocity(new_basis, old_basis, velocity)``: ``V_new V_old^T z``;
    * ``update(weights, grad, basis, newton_scale, *, all_rows, **kwargs)``: one
      update (the arguments of :func:`~tritonopt.optim.functional.fosi_update`;
      ``all_rows`` counts the rows of ``V`` over every process);
    * ``identity()`` (extra entries of a checkpoint) and
      ``check_checkpoint(entry, device, problem)``: raise ``problem`` (what this
      process found wrong with a state dict), or another reason a load does
      not belong here, before anything changes.
    """

    def reduce_gradient(self, grad: torch.Tensor) -> None:
        return None

    def extreme_spectrum(self, hvp, n: int, config: FOSIConfig, *, dtype, device, seed: int) -> Curvature:
        result = lanczos(hvp, n, config.lanczos_iters(n), dtype=config.lanczos_dtype, device=device,
                         passes=config.reorth_passes, seed=seed,
                         breakdown_rtol=default_breakdown_rtol(config.lanczos_dtype))
        return curvature_from_lanczos(result, config, dtype)

    def carry_velocity(self, new_basis: torch.Tensor, old_basis: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        return new_basis @ (velocity @ old_basis)

    def update(self, weights, grad, basis, newton_scale, *, all_rows: int, **kwargs) -> None:
        # The optimizer's own packed buffers, checked when they were packed.
        fosi_update(weights, grad, basis, newton_scale, prepared=True, **kwargs)

    def identity(self) -> dict:
        return {}

    def check_checkpoint(self, entry, device: torch.device, problem: Optional[Exception]) -> None:
        if problem is not None:
            raise problem
