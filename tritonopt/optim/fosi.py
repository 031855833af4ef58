"""FOSI: a base first-order optimizer plus a Newton step on the extreme Hessian eigenspace.

Sivan, Gabel and Schuster, "FOSI: Hybrid First and Second Order Optimization"
(ICLR 2024), as restated by Gu et al., "Accelerating Deep Neural Network
Training via Distributed Hybrid Order Optimization", sec. II-B (eqs. 2-12).
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from tritonopt._ops.fosi_step import fosi_step
from tritonopt._runtime import nvtx_range
from tritonopt.kernels.fosi_step import BASES, MAX_RANK
from tritonopt.optim._blocks import BlockLayout
from tritonopt.optim._lanczos import (
    default_breakdown_rtol,
    default_lanczos_iters,
    lanczos,
    make_hvp,
    ritz_vectors,
    select_ritz,
)

_NONFINITE_POLICIES = ("skip", "raise")
# A finite gradient can still overflow the update (g2 squared in Adam, a huge Newton
# step). While a bound on every intermediate stays below this, none can reach inf in
# float32, so the base optimizer's state is copied (to undo a failed step) only above it.
_OVERFLOW_GUARD = 1e15
_BASE_STATE = {"adam": ("exp_avg", "exp_avg_sq"), "heavy_ball": ("momentum_buffer",), "sgd": ()}


def _check_number(name: str, value, *, low: float = -math.inf, high: float = math.inf,
                  low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ValueError(f"{name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_group(group: dict) -> None:
    if isinstance(group["lr"], torch.Tensor):
        raise TypeError("lr must be a float (a tensor lr is not supported)")
    _check_number("lr", group["lr"], low=0.0)
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    _check_number("betas[0]", betas[0], low=0.0, high=1.0, high_open=True)
    _check_number("betas[1]", betas[1], low=0.0, high=1.0, high_open=True)
    _check_number("momentum", group["momentum"], low=0.0, high=1.0)
    _check_number("eps", group["eps"], low=0.0)


@dataclass
class _Packed:
    """The flat buffers of the FOSI vector; per-parameter state entries are views of them."""

    layout: BlockLayout
    weights: torch.Tensor  # [n] fp32 working copy of the parameters
    grad: torch.Tensor  # [n] fp32
    state_a: Optional[torch.Tensor]
    state_b: Optional[torch.Tensor]
    basis: torch.Tensor  # [r, n] fp32 (DHO2: this rank's rows)


class FOSI(Optimizer):
    r"""FOSI with a choice of base optimizer (Adam, heavy-ball, SGD) on one flat parameter vector.

    Stages (Gu et al. sec. II-B):

    1. warm-up: the first ``warmup_steps`` updates are plain base-optimizer steps (eq. 2);
    2. ESE: before update ``t`` with ``t >= warmup_steps`` and
       ``(t - warmup_steps) % curvature_update_every == 0``, Lanczos (``m``
       iterations, full re-orthogonalisation) on the Hessian of
       ``curvature_loss_fn`` at the current weights gives the ``k`` largest and
       ``l`` smallest Ritz pairs ``(lambda_j, v_j)`` (rows of ``V``);
    3. update (eqs. 11-12)::

           g1 = V^T V g,  g2 = g - g1
           w += -V^T (s * V g) + b (I - V^T V) O(g2),    s_j = alpha / |lambda_j|

       ``O`` is the base optimizer's step (sign and rate included), run on
       ``g2`` only, so its state never sees the Newton subspace.

    Before the first ESE, or with ``k + l = 0``, ``V`` is empty and the update is
    exactly the base optimizer's step.

    Args:
        params: the parameters (one group). All trainable parameters form one
            vector: the curvature couples them, so each step needs a gradient
            for every parameter with ``requires_grad`` (a step where none has one
            is a no-op; a partial set raises ``RuntimeError``).
        lr, betas, eps: base optimizer (Adam uses ``betas``; heavy-ball uses
            ``momentum``: ``a = momentum a + g2; w -= lr a``).
        base: ``"adam"`` (default), ``"heavy_ball"`` or ``"sgd"``.
        k, l: number of largest / smallest eigenpairs (``k + l <= 64``).
        alpha: Newton step scale.
        num_lanczos_iters: ``m``; default ``max(4 (k + l), 2 ln n)``, clamped to ``n``.
        warmup_steps, curvature_update_every: the ESE schedule above.
        curvature_loss_fn: zero-argument callable returning the scalar loss
            whose Hessian is estimated. It is called once per ESE (then one
            extra backward per Lanczos iteration) on **whatever batch it closes
            over**; a fixed "ESE batch" (as in the FOSI reference code) gives a
            deterministic estimate. ``None``: no scheduled ESE; call
            :meth:`update_curvature` yourself.
        lanczos_dtype: float64 (default, as the FOSI reference) or float32.
        reorth_passes: Gram-Schmidt rounds per Lanczos iteration (2 = CGS2, default).
        paper_exact: use ``s_j = alpha / lambda_j`` (signed, eq. 11 as printed)
            instead of ``alpha / |lambda_j|`` (reference code; a negative Ritz
            value otherwise turns the Newton step uphill). Also forces
            ``g1_momentum = 0`` and ``learning_rate_clip = 1``.
        g1_momentum: momentum on the Newton subspace's coefficients (reference
            code: ``decay``; Adam: EMA ``z = d z + (1-d) V g``, others
            ``z = d z + V g``). 0 (default) disables it. Kept in coefficient
            space (``[r]``); at an ESE it is carried into the new basis.
        learning_rate_clip: ``b = clip(lambda_max / lambda_(k), 1, learning_rate_clip)``
            scales the base step (reference code); 1 (default) disables it.
        ritz_rtol: Ritz values with ``|lambda| <= ritz_rtol * max|u|`` are dropped.
        eigenvalue_floor: ``|lambda|`` is clamped to at least this in ``s_j`` (default 1e-3).
        seed: seeds Lanczos' start vector (ESE number ``e`` uses ``seed + e``).
        on_nonfinite: non-finite gradients: ``"skip"`` (default: nothing
            changes, a warning, :attr:`skipped_steps` counts it) or ``"raise"``
            (``FloatingPointError``, nothing changes). An ESE whose Hessian
            products are not finite keeps the previous curvature and warns. A
            finite gradient large enough that the update could overflow (a
            bound on it exceeds 1e15) makes the step copy the base optimizer's
            state first; if the parameters or that state turn non-finite, the
            step is undone and counted like a non-finite gradient.

    State (per parameter, float32, views of flat buffers): ``exp_avg`` and
    ``exp_avg_sq`` (Adam) or ``momentum_buffer`` (heavy-ball), and
    ``eigenvectors`` (``[r, *param.shape]``: the parameter's slice of ``V``).
    Global state (``state_dict()["fosi"]``): ``eigenvalues`` (float64),
    ``g1_velocity``, ``base_scale``, ``step``, ``base_step``, ``ese_count``,
    ``skipped_steps``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        base: str = "adam",
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.9,
        eps: float = 1e-8,
        k: int = 10,
        l: int = 0,
        alpha: float = 0.1,
        num_lanczos_iters: Optional[int] = None,
        warmup_steps: int = 0,
        curvature_update_every: int = 100,
        curvature_loss_fn: Optional[Callable[[], torch.Tensor]] = None,
        lanczos_dtype: torch.dtype = torch.float64,
        reorth_passes: int = 2,
        paper_exact: bool = False,
        g1_momentum: float = 0.0,
        learning_rate_clip: float = 1.0,
        ritz_rtol: float = 1e-6,
        eigenvalue_floor: float = 1e-3,
        seed: int = 0,
        on_nonfinite: str = "skip",
    ):
        if base not in BASES:
            raise ValueError(f"base must be one of {BASES}, got {base!r}")
        _check_int("k", k, 0)
        _check_int("l", l, 0)
        if k + l > MAX_RANK:
            raise ValueError(f"k + l must be at most {MAX_RANK}, got {k + l}")
        _check_number("alpha", alpha, low=0.0)
        if num_lanczos_iters is not None:
            _check_int("num_lanczos_iters", num_lanczos_iters, 1)
        _check_int("warmup_steps", warmup_steps, 0)
        _check_int("curvature_update_every", curvature_update_every, 1)
        if curvature_loss_fn is not None and not callable(curvature_loss_fn):
            raise TypeError("curvature_loss_fn must be callable (or None)")
        if lanczos_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"lanczos_dtype must be torch.float32 or torch.float64, got {lanczos_dtype}")
        if isinstance(reorth_passes, bool) or reorth_passes not in (1, 2, 3):
            raise ValueError(f"reorth_passes must be 1, 2 or 3, got {reorth_passes!r}")
        _check_number("g1_momentum", g1_momentum, low=0.0, high=1.0, high_open=True)
        _check_number("learning_rate_clip", learning_rate_clip, low=1.0)
        _check_number("ritz_rtol", ritz_rtol, low=0.0, high=1.0)
        _check_number("eigenvalue_floor", eigenvalue_floor, low=0.0)
        _check_int("seed", seed, 0)
        if on_nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas,
                        momentum=momentum, eps=eps)
        _check_group(defaults)
        self.base = base
        self.k, self.l, self.alpha = k, l, float(alpha)
        self.num_lanczos_iters = num_lanczos_iters
        self.warmup_steps, self.curvature_update_every = warmup_steps, curvature_update_every
        self.curvature_loss_fn = curvature_loss_fn
        self.lanczos_dtype, self.reorth_passes = lanczos_dtype, reorth_passes
        self.paper_exact = bool(paper_exact)
        self.g1_momentum = 0.0 if paper_exact else float(g1_momentum)
        self.learning_rate_clip = 1.0 if paper_exact else float(learning_rate_clip)
        self.ritz_rtol, self.seed, self.on_nonfinite = float(ritz_rtol), seed, on_nonfinite
        self.eigenvalue_floor = float(eigenvalue_floor)
        # Global (not per-parameter) state.
        self.step_count = 0  # updates applied
        self.base_step = 0  # base-optimizer steps (Adam's bias correction)
        self.ese_count = 0
        self.skipped_steps = 0
        self.eigenvalues = torch.zeros(0, dtype=torch.float64)  # the ones this rank uses
        self.all_eigenvalues = torch.zeros(0, dtype=torch.float64)  # every selected Ritz value
        self.base_scale = 1.0
        self.g1_velocity: Optional[torch.Tensor] = None
        self.last_lanczos: dict = {}
        self._packed: Optional[_Packed] = None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise ValueError(
                "FOSI takes one parameter group: its curvature couples all parameters into one vector"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        _check_group(group)
        for p in group["params"]:
            if p.is_complex():
                raise ValueError("FOSI does not support complex parameters")
            if not p.is_floating_point():
                raise ValueError(f"FOSI needs floating-point parameters, got {p.dtype}")

    # ------------------------------------------------------------------ layout and state

    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self.param_groups[0]["params"] if p.requires_grad]

    def _base_state_names(self) -> tuple[str, ...]:
        return _BASE_STATE[self.base]

    def _ensure_packed(self) -> _Packed:
        params = self._trainable()
        if self._packed is not None and self._packed.layout.matches(params):
            return self._packed
        if not params:
            raise RuntimeError("FOSI has no trainable parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all FOSI parameters must be on one device, found {sorted(map(str, devices))}")
        layout = BlockLayout(params, sum(p.numel() for p in params))
        n = layout.total
        names = self._base_state_names()
        flat = [layout.zeros().view(-1) for _ in names]
        stored = [bool(self.state[p]) for p in params]
        if any(stored) and not all(stored):
            raise RuntimeError("FOSI state exists for some parameters but not others")
        rank = self.state[params[0]]["eigenvectors"].shape[0] if stored[0] else 0
        basis = torch.zeros((rank, n), dtype=torch.float32, device=layout.device)
        for p, start, numel in zip(params, layout.offsets, layout.numels):
            state = self.state[p]
            for name, buf in zip(names, flat):
                view = buf[start : start + numel].view(p.shape)
                if stored[0]:
                    view.copy_(state[name].reshape(p.shape))
                state[name] = view
            if stored[0]:
                basis[:, start : start + numel].copy_(state["eigenvectors"].reshape(rank, numel))
        packed = _Packed(
            layout=layout,
            weights=torch.zeros(n, dtype=torch.float32, device=layout.device),
            grad=torch.zeros(n, dtype=torch.float32, device=layout.device),
            state_a=flat[0] if names else None,
            state_b=flat[1] if len(names) > 1 else None,
            basis=basis,
        )
        self._packed = packed
        self._bind_basis_views()
        if self.g1_velocity is None or self.g1_velocity.shape[0] != rank:
            self.g1_velocity = torch.zeros(rank, dtype=torch.float32, device=layout.device)
        return packed

    def _bind_basis_views(self) -> None:
        packed = self._packed
        rank = packed.basis.shape[0]
        for p, start, numel in zip(packed.layout.tensors, packed.layout.offsets, packed.layout.numels):
            self.state[p]["eigenvectors"] = packed.basis[:, start : start + numel].view(rank, *p.shape)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["fosi"] = {
            "eigenvalues": self.eigenvalues.clone(),
            "all_eigenvalues": self.all_eigenvalues.clone(),
            "g1_velocity": None if self.g1_velocity is None else self.g1_velocity.clone(),
            "base_scale": self.base_scale,
            "step": self.step_count,
            "base_step": self.base_step,
            "ese_count": self.ese_count,
            "skipped_steps": self.skipped_steps,
        }
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("fosi", None)
        if extra is None:
            raise ValueError("state_dict has no 'fosi' entry: it was not saved by FOSI")
        saved_state = state_dict["state"]
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        for group in state_dict["param_groups"]:
            _check_group({**group, "betas": tuple(group["betas"])})
        self._check_saved_extra(extra, [saved_state[i] for i in saved_ids if i in saved_state])
        super().load_state_dict(state_dict)
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        for saved_id, p in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            for name, value in saved_state[saved_id].items():
                if isinstance(value, torch.Tensor):  # undo the base class's cast to the param dtype
                    self.state[p][name] = value.to(device=p.device, dtype=torch.float32, copy=True)
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])
        device = params[0].device if params else torch.device("cpu")
        self.eigenvalues = extra["eigenvalues"].to(torch.float64).clone()
        self.all_eigenvalues = extra["all_eigenvalues"].to(torch.float64).clone()
        velocity = extra["g1_velocity"]
        self.g1_velocity = None if velocity is None else velocity.to(device=device, dtype=torch.float32).clone()
        self.base_scale = float(extra["base_scale"])
        self.step_count, self.base_step = int(extra["step"]), int(extra["base_step"])
        self.ese_count, self.skipped_steps = int(extra["ese_count"]), int(extra["skipped_steps"])
        self._packed = None

    def _check_saved_extra(self, extra, saved_states: list) -> None:
        """Validate the global FOSI state (and its agreement with the per-parameter state) before loading."""
        if not isinstance(extra, dict):
            raise ValueError(f"state_dict['fosi'] must be a dict, got {type(extra).__name__}")
        required = ("eigenvalues", "all_eigenvalues", "g1_velocity", "base_scale", "step", "base_step",
                    "ese_count", "skipped_steps")
        missing = [key for key in required if key not in extra]
        if missing:
            raise ValueError(f"state_dict['fosi'] lacks {missing}")
        for key in ("eigenvalues", "all_eigenvalues"):
            value = extra[key]
            if not isinstance(value, torch.Tensor) or value.dim() != 1:
                raise ValueError(f"state_dict['fosi'][{key!r}] must be a 1-D tensor")
        rank = extra["eigenvalues"].numel()
        for state in saved_states:
            vectors = state.get("eigenvectors")
            if isinstance(vectors, torch.Tensor) and vectors.shape[0] != rank:
                raise ValueError(
                    f"state_dict holds {rank} eigenvalues but eigenvectors with {vectors.shape[0]} rows"
                )
        velocity = extra["g1_velocity"]
        if velocity is not None and (not isinstance(velocity, torch.Tensor) or velocity.dim() != 1):
            raise ValueError("state_dict['fosi']['g1_velocity'] must be None or a 1-D tensor")

    # ------------------------------------------------------------------ curvature

    def _curvature_due(self) -> bool:
        t = self.step_count
        return (
            self.curvature_loss_fn is not None
            and self.k + self.l > 0
            and t >= self.warmup_steps
            and (t - self.warmup_steps) % self.curvature_update_every == 0
        )

    def lanczos_iters(self, n: int) -> int:
        if self.num_lanczos_iters is not None:
            return min(self.num_lanczos_iters, n)
        return default_lanczos_iters(self.k, self.l, n)

    def newton_scale(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        """``s_j = alpha / lambda_j`` (paper_exact) or ``alpha / |lambda_j|``, float32.

        ``|lambda_j|`` is clamped to at least ``eigenvalue_floor``: a nearly flat
        ESE batch (late in training) otherwise yields huge Newton steps.
        """
        magnitude = eigenvalues.abs().clamp_min(self.eigenvalue_floor)
        denom = torch.sign(eigenvalues) * magnitude if self.paper_exact else magnitude
        return (self.alpha / denom).to(torch.float32)

    def _base_scale_from(self, all_eigenvalues: torch.Tensor) -> float:
        if self.learning_rate_clip <= 1.0 or self.k == 0 or all_eigenvalues.numel() == 0:
            return 1.0
        largest = all_eigenvalues[-min(self.k, all_eigenvalues.numel()):]
        if float(largest[0]) <= 0:
            return 1.0
        return float(min(max(float(largest[-1] / largest[0]), 1.0), self.learning_rate_clip))

    def _compute_curvature(self, loss_fn, packed: _Packed):
        """``(eigenvalues used here [r], this rank's basis rows [r, n], all Ritz values, report)``."""
        n = packed.layout.total
        hvp = make_hvp(packed.layout.tensors, loss_fn)
        result = lanczos(
            hvp, n, self.lanczos_iters(n), dtype=self.lanczos_dtype, device=packed.layout.device,
            passes=self.reorth_passes, seed=self.seed + self.ese_count,
            breakdown_rtol=default_breakdown_rtol(self.lanczos_dtype),
        )
        values, u_sel = select_ritz(result.tridiag, self.k, self.l, self.ritz_rtol)
        basis = ritz_vectors(result.basis, u_sel)
        report = {"steps": result.steps, "breakdown": result.breakdown,
                  "basis_numel": result.basis.numel(), "basis_shape": tuple(result.basis.shape)}
        return values, basis, values, report

    @torch.no_grad()
    def update_curvature(self, loss_fn: Optional[Callable[[], torch.Tensor]] = None) -> bool:
        """Run the ESE now at the current weights; returns False if it failed (curvature kept).

        ``loss_fn`` defaults to ``curvature_loss_fn``.
        """
        loss_fn = self.curvature_loss_fn if loss_fn is None else loss_fn
        if loss_fn is None or not callable(loss_fn):
            raise ValueError("update_curvature needs a loss function (loss_fn or curvature_loss_fn)")
        packed = self._ensure_packed()
        if self.k + self.l == 0:
            return True
        with nvtx_range("tritonopt/fosi/ese"):
            try:
                values, basis, all_values, report = self._compute_curvature(loss_fn, packed)
            except FloatingPointError as exc:
                warnings.warn(f"FOSI: curvature estimation failed ({exc}); keeping the previous curvature",
                              RuntimeWarning, stacklevel=2)
                self.ese_count += 1
                return False
        old_basis = packed.basis
        if self.g1_momentum > 0 and old_basis.shape[0] and self.g1_velocity is not None:
            # Carry the coefficient-space velocity into the new basis: z' = V_new V_old^T z.
            velocity = self._change_basis(basis, old_basis, self.g1_velocity)
        else:
            velocity = torch.zeros(basis.shape[0], dtype=torch.float32, device=basis.device)
        packed.basis = basis.to(packed.layout.device)
        self.eigenvalues = values.to(torch.float64).cpu()
        self.all_eigenvalues = all_values.to(torch.float64).cpu()
        self.base_scale = self._base_scale_from(all_values)
        self.g1_velocity = velocity
        self.last_lanczos = report
        self.ese_count += 1
        self._bind_basis_views()
        return True

    def _change_basis(self, new_basis, old_basis, velocity):
        return (new_basis @ (velocity @ old_basis)).to(torch.float32)

    # ------------------------------------------------------------------ step

    def _reduce_gradient(self, grad: torch.Tensor) -> None:
        """Hook: DHO2 averages the gradient over ranks here."""

    def _check_grads(self, params: list[torch.Tensor]) -> bool:
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return False
        if len(with_grad) != len(params):
            raise RuntimeError(
                f"FOSI needs a gradient for every trainable parameter (the curvature couples them): "
                f"{len(params) - len(with_grad)} of {len(params)} have .grad None"
            )
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("FOSI does not support sparse gradients")
            if p.grad.is_complex():
                raise RuntimeError("FOSI does not support complex gradients")
            if p.grad.shape != p.shape:
                raise RuntimeError(
                    f"a gradient has shape {tuple(p.grad.shape)} but its parameter has shape {tuple(p.shape)}"
                )
        return True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._trainable()
        if not self._check_grads(params):
            return loss
        packed = self._ensure_packed()
        with nvtx_range("tritonopt/fosi/pack"):
            packed.layout.pack([p.grad for p in params], packed.grad.view(1, -1))
        self._reduce_gradient(packed.grad)
        grad_max = float(packed.grad.abs().amax())  # NaN or inf if any entry is (one host sync)
        if not math.isfinite(grad_max):
            if self.on_nonfinite == "raise":
                raise FloatingPointError("FOSI: a gradient holds NaN or inf; nothing was modified")
            self.skipped_steps += 1
            warnings.warn("FOSI: a gradient holds NaN or inf; the step was skipped and parameters "
                          "and state are unchanged", RuntimeWarning, stacklevel=2)
            return loss
        if self._curvature_due():
            self.update_curvature(self.curvature_loss_fn)
        packed.layout.pack(params, packed.weights.view(1, -1))
        group = self.param_groups[0]
        saved = self._save_state_if_overflow_possible(packed, group, grad_max)
        self.base_step += 1
        self._apply_update(packed, group)
        # On a risky step the state is checked too: Adam's second moment can overflow to
        # inf while the update it divides stays finite, freezing those coordinates for good.
        checked = [packed.weights] + ([live for live, _ in saved] if saved is not None else [])
        if not all(bool(torch.isfinite(t).all()) for t in checked):
            if saved is not None:
                for live, copy in saved:
                    live.copy_(copy)
                self.base_step -= 1
                message = ("FOSI: the update overflowed to NaN or inf (a finite but huge gradient); "
                           "the step was undone: parameters and state are unchanged")
            else:  # not expected below _OVERFLOW_GUARD; the state can no longer be restored
                message = ("FOSI: the update produced NaN or inf; the parameters were left unchanged, "
                           "the base optimizer's state advanced")
            if self.on_nonfinite == "raise":
                raise FloatingPointError(message)
            self.skipped_steps += 1
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return loss
        with nvtx_range("tritonopt/fosi/unpack"):
            for p, value in zip(params, packed.layout.views(packed.weights.view(1, -1))):
                p.copy_(value)
        self.step_count += 1
        return loss

    def _save_state_if_overflow_possible(self, packed: _Packed, group: dict, grad_max: float):
        """Copies of the state the update changes in place, or None when it cannot overflow.

        Rows of ``V`` are orthonormal, so ``|g2_i| <= (1 + sqrt(n)) max|g|`` and the Newton
        step is at most ``max|s| sqrt(n) max|g|``; the learning rate scales the base step.
        """
        # Every Ritz value, not this rank's share: distributed ranks must decide alike.
        scale = self.newton_scale(self.all_eigenvalues)
        scale_max = float(scale.abs().max()) if scale.numel() else 0.0
        bound = grad_max * (1.0 + math.sqrt(packed.layout.total)) * max(1.0, scale_max, group["lr"])
        if bound < _OVERFLOW_GUARD:
            return None
        live = [t for t in (packed.state_a, packed.state_b, self.g1_velocity) if t is not None]
        return [(t, t.clone()) for t in live]

    def _base_hyper(self, group: dict) -> dict:
        beta1 = group["momentum"] if self.base == "heavy_ball" else group["betas"][0]
        return dict(lr=group["lr"], beta1=beta1, beta2=group["betas"][1], eps=group["eps"], step=self.base_step)

    def _g1_decay_gain(self) -> tuple[float, float]:
        d = self.g1_momentum
        return d, (1.0 - d) if self.base == "adam" else 1.0

    def _apply_update(self, packed: _Packed, group: dict) -> None:
        use_velocity = self.g1_momentum > 0 and packed.basis.shape[0] > 0
        decay, gain = self._g1_decay_gain()
        fosi_step(
            packed.weights, packed.grad, packed.basis,
            self.newton_scale(self.eigenvalues).to(packed.basis.device),
            base=self.base, state_a=packed.state_a, state_b=packed.state_b,
            base_scale=self.base_scale,
            g1_velocity=self.g1_velocity if use_velocity else None,
            g1_decay=decay, g1_gain=gain, **self._base_hyper(group),
        )
