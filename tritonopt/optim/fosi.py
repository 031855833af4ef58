"""FOSI: a base first-order optimizer plus a Newton step on the extreme Hessian eigenspace.

Sivan, Gabel and Schuster, "FOSI: Hybrid First and Second Order Optimization"
(ICLR 2024), as restated by Gu et al., "Accelerating Deep Neural Network
Training via Distributed Hybrid Order Optimization", sec. II-B (eqs. 2-12).

The arithmetic lives in :mod:`tritonopt.optim.functional` (``fosi_update``,
``fosi_base_step``, ``fosi_newton_scale``, ``fosi_base_scale``) and
:mod:`tritonopt.optim.lanczos`; :class:`FOSI` adds the schedule, the state and
the guards. Where the subspace ``V`` lives and how sums over it are taken is
one object, the *subspace* (:class:`LocalSubspace` here: all of ``V`` in this
process). :class:`tritonopt.dist.DHO2` passes one that shards ``V`` over ranks
and puts collectives between the same pieces.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Iterable, Optional, Sequence

import torch

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_float
from tritonopt.optim._blocks import BlockLayout, zeros_with_aligned_rows
from tritonopt.optim._fosi_checkpoints import BASE_STATE, FOSICheckpoints
from tritonopt.optim._fosi_config import MAX_RANK, Curvature, FOSIConfig, LocalSubspace, ese_hvp  # noqa: F401
from tritonopt.optim._fosi_sharded import ParameterShardedSubspace
from tritonopt.optim._packed import PackedGroup, PackedOptimizer, StepWork, _caller_stacklevel, bind_flat_state
from tritonopt.optim._sharding import local_tensor
from tritonopt.optim.functional import FOSIHyper, fosi_base_scale
from tritonopt.optim.lanczos import DifferenceHVP

__all__ = ["FOSI", "Curvature", "FOSIConfig", "LocalSubspace"]

# Overflow guard. While a bound on every intermediate of the update stays below
# this, nothing can reach inf in float32, and adding less than it to a finite
# float32 value cannot overflow either (half an ulp at float32's maximum is 2^103).
_OVERFLOW_GUARD = 1e15


class FOSI(FOSICheckpoints, PackedOptimizer):
    r"""FOSI with a choice of base optimizer (Adam, heavy-ball, SGD) on one flat parameter vector.

    Stages (Gu et al. sec. II-B):

    1. warm-up: the first updates are plain base-optimizer steps (eq. 2);
    2. ESE: before update ``t`` (0-based) with ``t >= warmup_steps`` and
       ``(t - warmup_steps) % curvature_update_every == 0``, Lanczos (``m``
       iterations, full re-orthogonalisation) on the Hessian of
       ``curvature_loss_fn`` at the current weights gives the ``k`` largest and
       ``l`` smallest Ritz pairs ``(lambda_j, v_j)`` (rows of ``V``);
    3. update (eqs. 11-12), for the parameters of group ``i``::

           g1 = V^T V g,  g2 = g - g1
           w <- (1 - lr_i wd_i) w - rho_i V^T (s * V g) + b (I - V^T V) O_i(g2)
           s_j = alpha / max(|lambda_j|, eigenvalue_floor * max|u|),  rho_i = lr_i / initial_lr_i

       ``O_i`` is the base optimizer's step with group ``i``'s hyperparameters
       (sign and rate included), run on ``g2`` only, so its state never sees
       the Newton subspace; ``max|u|`` the largest ``|Ritz value|``.

    Before the first ESE, or with ``k + l = 0``, ``V`` is empty and the update is
    exactly the base optimizer's step.

    **The Newton step follows the learning rate.** ``alpha`` is its scale at
    each group's initial learning rate (``initial_lr``, recorded when the group
    is added, the key ``torch.optim.lr_scheduler`` reads): a scheduler that
    changes ``lr`` scales the Newton step by the same factor, and with
    ``lr = 0`` no parameter moves. (A group created with ``lr = 0`` applies
    ``alpha`` itself once its ``lr`` is positive.)

    **Parameter groups.** The curvature couples every parameter, so all
    trainable parameters of all groups form one vector with one basis ``V``
    and one ESE. Each group may set its own ``lr``, ``weight_decay`` and base
    hyperparameters (``betas``, ``momentum``, ``eps``); the settings of
    :class:`FOSIConfig` (``base``, ``k``, ``alpha``, the schedule, ...) are
    shared. When every group has the same base hyperparameters and Newton
    factor the update is one fused call; otherwise the base step runs per group.

    Args:
        params: parameters or parameter groups. Every trainable parameter needs a
            gradient at each step (a step where none has one is a no-op; a
            partial set raises ``RuntimeError``). All on one device.
        lr, betas, eps, momentum: base optimizer (Adam uses ``betas``; heavy-ball
            ``momentum``: ``a = momentum a + g2; w -= lr a``).
        weight_decay: decoupled weight decay, ``w <- (1 - lr wd) w`` before the
            update (outside the Hessian, which is the loss's only).
        base: ``"adam"`` (default), ``"heavy_ball"`` or ``"sgd"``.
        k, l: number of largest / smallest eigenpairs (``k + l <= 64``).
        alpha: Newton step scale at the initial learning rate.
        num_lanczos_iters: ``m``; default ``max(4 (k + l), 2 ln n)``, clamped to ``n``.
        warmup_steps, curvature_update_every: the ESE schedule above.
            ``warmup_steps=None`` is the FOSI reference code's default
            (``warmup_w = None``): the first ESE after ``curvature_update_every - 1``
            base steps. Its ``warmup_w = W >= 1`` is ``warmup_steps = W - 1`` here.
        curvature_loss_fn: zero-argument callable returning the scalar loss
            whose Hessian is estimated. It is called once per ESE (then one
            extra backward per Lanczos iteration, with scaled-dot-product
            attention on its math backend, which has a double backward, and a
            ``torch.compile``d model running its own, eager code, for the same reason) on
            **whatever batch it closes over**; a fixed "ESE batch" (as in the
            FOSI reference code) gives a deterministic estimate. ``None``: no
            scheduled ESE; call :meth:`update_curvature` yourself. A copy
            (``copy.deepcopy``) keeps the same function: give the copy its own.
        lanczos_dtype: float64 (default, as the FOSI reference) or float32.
        reorth_passes: Gram-Schmidt rounds per Lanczos iteration (2 = CGS2, default).
        paper_exact: ``s_j = alpha / lambda_j`` (signed, eq. 11 as printed)
            instead of ``alpha / |lambda_j|`` (reference code; a negative Ritz
            value otherwise turns the Newton step uphill); needs
            ``g1_momentum = 0`` and ``learning_rate_clip = 1``.
        g1_momentum: momentum on the Newton subspace's coefficients (reference
            code: ``decay``; Adam: EMA ``z = d z + (1-d) V g``, others
            ``z = d z + V g``). 0 (default) disables it. Kept in coefficient
            space (``[r]``); at an ESE it is carried into the new basis.
        learning_rate_clip: ``b = clip(lambda_max / lambda_(k), 1, learning_rate_clip)``
            scales the base step (reference code); 1 (default) disables it.
        ritz_rtol: Ritz values with ``|lambda| <= ritz_rtol * max|u|`` are dropped.
        eigenvalue_floor: ``|lambda_j|`` is clamped to at least
            ``eigenvalue_floor * max|u|`` in ``s_j`` (relative, so the Newton
            step does not depend on the loss's scale; default 1e-3).
        seed: seeds Lanczos' start vector (ESE number ``e`` uses ``seed + e``).
        on_nonfinite: non-finite gradients: ``"skip"`` (default: nothing
            changes, a warning, :attr:`skipped_steps` counts it) or ``"raise"``
            (``FloatingPointError``, nothing changes). An ESE whose Hessian
            products are not finite keeps the previous curvature and warns. A
            finite gradient large enough that the update could overflow (a
            bound on it, computed from the gradient's largest entry, exceeds
            1e15) makes the step copy the state first and check the result; if
            it is not finite the step is undone, including an ESE it ran, and
            counted like a non-finite gradient.

        hvp: the ESE's Hessian-vector products: ``"double_backward"`` (the default
            on plain tensors), ``"central_difference"`` (``(g(w + eps v) - g(w - eps v))
            / (2 eps)``, two gradients per product; the default on DTensor parameters)
            or ``"forward_difference"`` (``(g(w + eps v) - g(w)) / eps``, one, plus
            ``g(w)`` once): :class:`~tritonopt.optim.lanczos.DifferenceHVP`.
        hvp_eps: their step along the unit vector ``v``; default
            :func:`~tritonopt.optim.lanczos.difference_step`'s, ``u^(1/3) (1 + ||w||)``
            (central) or ``u^(1/2) (1 + ||w||)``, ``u`` the parameters' unit roundoff.

    **Sharded parameters** (DTensors of FSDP2's ``fully_shard``, ``Shard(0)`` or
    ``Replicate()`` on a 1-D mesh, or along the shard dimension of a 2-D HSDP
    mesh, replicated along its replicate one): every rank builds the same FOSI
    and steps after each backward. ``V``, the Lanczos vectors and the base
    optimizer's state are sharded like the parameters; every sum over
    coordinates is the shard dimension's ranks' partial sums all-reduced (an
    HSDP mesh's replicas compute alike), a replicated parameter counted once
    (:mod:`~tritonopt.optim._fosi_sharded` lists the collectives). The products
    default to central differences: FSDP2 forms a sharded parameter's gradient in
    a reduce-scatter, which has no backward, so no double backward reaches it (a
    loss of DTensor arithmetic, without ``fully_shard``, may take
    ``hvp="double_backward"``). Each gradient is then FSDP2's average over the
    ranks, the Hessian that of the ranks' mean ``curvature_loss_fn`` (give every
    rank the same ESE batch), and its ``backward()`` writes the gradient of every
    parameter it reaches (FOSI's own get theirs back). Ranks given other settings
    fail at construction naming them (every rank of the mesh, replicas
    included); a ``state_dict`` or a ``torch.distributed.checkpoint`` resumes
    on as many ranks along the shard dimension as saved it, whatever the
    number of replicas (an HSDP mesh's on a 1-D mesh of its shard dimension's
    size, and the reverse).

    Precision: float32, float16 and bfloat16 parameters are updated through a
    float32 copy (the fused op); float64 parameters (all of them float64) keep
    every buffer, the basis and the Hessian-vector products in float64.

    Host synchronisations: one per step (the gradient's largest entry, read for
    the non-finite policy and the overflow bound), a second only on a step the
    bound flags; one per Lanczos iteration during an ESE.

    State (per parameter, views of flat buffers, float32 or float64 as above;
    on sharded parameters the rank's part, shown as DTensors by ``state_dict``):
    ``exp_avg`` and ``exp_avg_sq`` (Adam) or ``momentum_buffer`` (heavy-ball),
    and ``eigenvectors`` (``[r, *param.shape]``: the parameter's slice of ``V``;
    ``state_dict`` pads it with zero rows to ``k + l``, whatever ``r``).
    Global state (``state_dict()["fosi"]``, copied into its first group):
    ``eigenvalues``, ``all_eigenvalues`` (float64), ``ritz_scale``, ``g1_velocity``,
    ``base_scale``, ``step``, ``base_step``, ``ese_count``, ``velocity_bound``.
    Copies, pickles, ``torch.load(weights_only=True)`` and torch.distributed.checkpoint
    resume bit for bit; the last loads the state exactly on another rank count too.
    """

    SHARDING_REFUSAL = None

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        base: str = "adam",
        betas: tuple[float, float] = (0.9, 0.999),
        momentum: float = 0.9,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        k: int = 10,
        l: int = 0,
        alpha: float = 0.1,
        num_lanczos_iters: Optional[int] = None,
        warmup_steps: Optional[int] = 0,
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
        hvp: Optional[str] = None,
        hvp_eps: Optional[float] = None,
        subspace=None,
    ):
        self.config = FOSIConfig(
            base=base, k=k, l=l, alpha=alpha, num_lanczos_iters=num_lanczos_iters, warmup_steps=warmup_steps,
            curvature_update_every=curvature_update_every, lanczos_dtype=lanczos_dtype,
            reorth_passes=reorth_passes, paper_exact=paper_exact, g1_momentum=g1_momentum,
            learning_rate_clip=learning_rate_clip, ritz_rtol=ritz_rtol, eigenvalue_floor=eigenvalue_floor,
            seed=seed, hvp=hvp, hvp_eps=hvp_eps,
        )
        if curvature_loss_fn is not None and not callable(curvature_loss_fn):
            raise TypeError("curvature_loss_fn must be callable (or None)")
        self.curvature_loss_fn = curvature_loss_fn
        self.subspace = LocalSubspace() if subspace is None else subspace
        self.step_count = 0  # updates applied
        self.base_step = 0  # base-optimizer steps (Adam's bias correction)
        self.ese_count = 0
        self.eigenvalues = torch.zeros(0, dtype=torch.float64)  # the ones this process applies
        self.all_eigenvalues = torch.zeros(0, dtype=torch.float64)  # every selected Ritz value
        self.ritz_scale = 0.0
        self.base_scale = 1.0
        self.g1_velocity: Optional[torch.Tensor] = None
        self.velocity_bound = 0.0  # bound on the (global) norm of g1_velocity
        self.last_lanczos: dict = {}
        self._newton_scale: Optional[torch.Tensor] = None  # on the parameters' device, derived
        self._scale_max = 0.0
        self._state_bound: Optional[float] = None  # bound on max|state_a|; None: measure it
        self._checked_settings: Optional[list] = None  # the groups' settings the last step validated
        defaults = dict(lr=lr, betas=betas, momentum=momentum, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, on_nonfinite)
        if self._shards is not None:
            if subspace is not None:
                raise ValueError(f"{type(self).__name__} does not support DTensor (sharded, e.g. FSDP2 fully_shard) "
                                 "parameters: its subspace is its own; FOSI itself steps them")
            self.subspace = ParameterShardedSubspace(self._shards)

    def _agreement_settings(self) -> dict:
        """The packed optimizers' settings, FOSI's shared ones and whether a curvature loss is given."""
        settings = super()._agreement_settings()
        settings.update(dataclasses.asdict(self.config))
        settings["curvature_loss_fn"] = "given" if self.curvature_loss_fn is not None else None
        return settings

    # ------------------------------------------------------------------ settings

    def _check_group(self, group: dict) -> None:
        check_float("lr", group["lr"], low=0.0)
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_float("betas[0]", betas[0], low=0.0, high=1.0, high_open=True)
        check_float("betas[1]", betas[1], low=0.0, high=1.0, high_open=True)
        check_float("momentum", group["momentum"], low=0.0, high=1.0)
        check_float("eps", group["eps"], low=0.0)
        check_float("weight_decay", group["weight_decay"], low=0.0)
        if "initial_lr" in group:
            check_float("initial_lr", group["initial_lr"], low=0.0)

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group.get("betas"), list):
            param_group = {**param_group, "betas": tuple(param_group["betas"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("initial_lr", group["lr"])

    def _group_settings(self) -> list[tuple]:
        """Each group's hyperparameters, as the update reads them (compared to skip repeated checks)."""
        return [(g["lr"], g["betas"], g["momentum"], g["eps"], g["weight_decay"], g["initial_lr"])
                for g in self.param_groups]

    def _check_settings(self) -> list[tuple]:
        """The groups' settings, validated unless they are the ones the last step validated."""
        settings = self._group_settings()
        if settings != self._checked_settings:
            for group in self.param_groups:
                self._check_group(group)
            self._checked_settings = settings
        return settings

    def _segments(self, settings: list[tuple], sizes: list[int]) -> list[FOSIHyper]:
        """Each group's slice of the vector with its hyperparameters (groups without trainable parameters skipped)."""
        segments, stop = [], 0
        for (lr, betas, momentum, eps, weight_decay, initial), size in zip(settings, sizes):
            if not size:
                continue
            stop += size
            rho = lr / initial if initial > 0 else float(lr > 0)
            beta1 = momentum if self.config.base == "heavy_ball" else betas[0]
            segments.append(FOSIHyper(stop, lr, beta1, betas[1], eps, weight_decay, rho))
        return segments

    # ------------------------------------------------------------------ layout and state

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _work_dtype(self, params: Sequence[torch.Tensor]) -> torch.dtype:
        return torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32

    def _packed_group(self, index: int, groups: list[dict], params: list[torch.Tensor]) -> PackedGroup:
        """The flat buffers of the trainable parameters (rebuilt from the per-parameter state when stale)."""
        packed = self._packed.get(0)
        if packed is not None and packed.layout.matches(params):
            return packed
        if not params:
            raise RuntimeError("FOSI has no trainable parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all FOSI parameters must be on one device, found {sorted(map(str, devices))}")
        layout = BlockLayout(params, sum(local_tensor(p).numel() for p in params))
        dtype = self._work_dtype(params)
        # Parameters added since the last step (a new group) start with zero state, and with
        # zero columns in V: the Newton step reaches them from the next ESE on.
        stored = [p for p in params if "eigenvectors" in self.state[p]]
        rank = self.state[stored[0]]["eigenvectors"].shape[0] if stored else 0
        buffers = bind_flat_state(self.state, layout, list(BASE_STATE[self.config.base]), dtype)
        basis = zeros_with_aligned_rows(rank, layout.total, dtype, layout.device)
        for p, start, numel in zip(params, layout.offsets, layout.numels):
            if "eigenvectors" in self.state[p]:
                basis[:, start : start + numel].copy_(self.state[p]["eigenvectors"].reshape(rank, numel))
        flat = {name: buffer.view(-1) for name, buffer in buffers.items()}
        packed = PackedGroup(layout, {**flat, "basis": basis},
                             {"grad": layout.zeros(dtype).view(-1), "weights": layout.zeros(dtype).view(-1)})
        packed.group_sizes = [sum(local_tensor(p).numel() for p in g["params"] if p.requires_grad)
                              for g in self.param_groups]
        packed.weight_views = layout.views(packed.weights)
        self._packed[0] = packed
        if self._shards is not None:
            self.subspace.bind(params)
        self._bind_basis_views(packed)
        self._derive_newton_scale(layout.device, dtype)
        self._state_bound = None  # measured at the next step
        return packed

    def _fit_velocity(self, packed: PackedGroup) -> None:
        """``g1_velocity`` as long as the basis, on its device and in its dtype (zeros when it is not).

        Done where the velocity is used, not when the packed group is built: a
        refused step leaves it as it was.
        """
        basis = packed.basis
        if self.g1_velocity is None or self.g1_velocity.shape[0] != basis.shape[0]:
            self.g1_velocity = torch.zeros(basis.shape[0], dtype=basis.dtype, device=packed.layout.device)
        else:
            self.g1_velocity = self.g1_velocity.to(device=packed.layout.device, dtype=basis.dtype)

    def _bind_basis_views(self, packed: PackedGroup) -> None:
        basis = packed.basis
        rank = basis.shape[0]
        for p, start, numel in zip(packed.layout.tensors, packed.layout.offsets, packed.layout.numels):
            self.state[p]["eigenvectors"] = basis[:, start : start + numel].view(rank, *local_tensor(p).shape)

    def _state_buffers(self, packed: PackedGroup) -> list[torch.Tensor]:
        return [packed.state[name] for name in BASE_STATE[self.config.base]]

    # ------------------------------------------------------------------ curvature

    def _estimate(self, loss_fn: Callable[[], torch.Tensor], packed: PackedGroup) -> Optional[Curvature]:
        """The ESE at the current weights, or None when its Hessian products were not finite (warned)."""
        n = packed.layout.total
        dtype = packed.basis.dtype
        hvp = None
        with nvtx_range("tritonopt/fosi/ese"):
            try:
                hvp = self._make_hvp(packed.layout.tensors, loss_fn, dtype)
                return self.subspace.extreme_spectrum(hvp, n, self.config, dtype=dtype, device=packed.layout.device,
                                                      seed=self.config.seed + self.ese_count)
            except FloatingPointError as exc:
                warnings.warn(f"FOSI: curvature estimation failed ({exc}); keeping the previous curvature",
                              RuntimeWarning, stacklevel=_caller_stacklevel())
                return None
            finally:
                if isinstance(hvp, DifferenceHVP):
                    hvp.close()

    def _make_hvp(self, params: Sequence[torch.Tensor], loss_fn: Callable[[], torch.Tensor], dtype: torch.dtype):
        """The Hessian-vector product the configuration names (see ``hvp``), on this rank's coordinates."""
        sharded = self._shards is not None
        squared_norm = self.subspace.squared_norm if sharded else (lambda w: float(w.dot(w)))
        return ese_hvp(self.config, params, loss_fn, dtype, sharded=sharded, squared_norm=squared_norm)

    def _derive_newton_scale(self, device: torch.device, dtype: torch.dtype) -> None:
        """``s`` on the parameters' device (copied once per estimate, not per step), and ``max|s|``
        over every Ritz value, a host number (the same on every rank of a distributed run)."""
        self._newton_scale = self.config.newton_scale(self.eigenvalues, self.ritz_scale).to(device=device, dtype=dtype)
        every = self.config.newton_scale(self.all_eigenvalues, self.ritz_scale)
        self._scale_max = float(every.abs().max()) if every.numel() else 0.0

    def _curvature_refs(self, packed: PackedGroup) -> dict:
        """What installing an estimate replaces (references: the estimate installs new tensors)."""
        return dict(basis=packed.basis, eigenvalues=self.eigenvalues, all_eigenvalues=self.all_eigenvalues,
                    ritz_scale=self.ritz_scale, base_scale=self.base_scale, g1_velocity=self.g1_velocity,
                    _newton_scale=self._newton_scale, _scale_max=self._scale_max, ese_count=self.ese_count,
                    last_lanczos=self.last_lanczos)

    def _restore_curvature(self, packed: PackedGroup, refs: dict) -> None:
        packed.state["basis"] = refs.pop("basis")
        for name, value in refs.items():
            setattr(self, name, value)
        self._bind_basis_views(packed)

    def _install(self, packed: PackedGroup, curvature: Optional[Curvature]) -> None:
        """Make ``curvature`` the current estimate (None: a failed ESE, which only counts)."""
        self.ese_count += 1
        if curvature is None:
            return
        dtype, device = packed.basis.dtype, packed.layout.device
        basis = curvature.basis.to(device=device, dtype=dtype)
        old_basis, velocity = packed.basis, self.g1_velocity
        if self.config.g1_momentum > 0 and old_basis.shape[0] and velocity is not None:
            velocity = self.subspace.carry_velocity(basis, old_basis, velocity).to(dtype)
        else:
            velocity = torch.zeros(basis.shape[0], dtype=dtype, device=device)
        packed.state["basis"] = basis
        self.eigenvalues = curvature.values.to(torch.float64).cpu()
        self.all_eigenvalues = curvature.all_values.to(torch.float64).cpu()
        self.ritz_scale = float(curvature.ritz_scale)
        self.base_scale = fosi_base_scale(self.all_eigenvalues, self.config.k, self.config.learning_rate_clip)
        self.g1_velocity = velocity
        self._derive_newton_scale(device, dtype)
        self.last_lanczos = curvature.report
        self._bind_basis_views(packed)

    @torch._dynamo.disable  # a double backward and a host read per Lanczos iteration: see _update
    @torch.no_grad()
    def update_curvature(self, loss_fn: Optional[Callable[[], torch.Tensor]] = None) -> bool:
        """Run the ESE now at the current weights; returns False if it failed (curvature kept).

        ``loss_fn`` defaults to ``curvature_loss_fn``.
        """
        loss_fn = self.curvature_loss_fn if loss_fn is None else loss_fn
        if loss_fn is None or not callable(loss_fn):
            raise ValueError("update_curvature needs a loss function (loss_fn or curvature_loss_fn)")
        packed = self._packed_group(0, self.param_groups, self._trainable())
        self._fit_velocity(packed)
        if self.config.k + self.config.l == 0:
            return True
        curvature = self._estimate(loss_fn, packed)
        self._install(packed, curvature)
        return curvature is not None

    def newton_scale(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        """``s_j`` for ``eigenvalues`` with this optimizer's alpha, floor and current ``ritz_scale`` (float64)."""
        return self.config.newton_scale(eigenvalues, self.ritz_scale)

    # ------------------------------------------------------------------ step

    def _check_step(self) -> None:
        # Hyperparameters a user or a scheduler set since the last step: checked before anything changes.
        self._check_settings()
        params = self._trainable()
        with_grad = [p for p in params if p.grad is not None]
        if with_grad and len(with_grad) != len(params):
            raise RuntimeError(
                f"FOSI needs a gradient for every trainable parameter (the curvature couples them): "
                f"{len(params) - len(with_grad)} of {len(params)} have .grad None"
            )
        self._check_grads(with_grad)

    def _step_units(self) -> list[tuple[int, list[dict]]]:
        return [(0, self.param_groups)]  # the curvature couples every group: one vector

    def _prepare(self, index: int, groups: list[dict]) -> Optional[StepWork]:
        params = self._trainable()
        if not params or params[0].grad is None:
            return None
        packed = self._packed_group(index, groups, params)
        packed.layout.pack([p.grad for p in params], packed.grad.view(1, -1))
        self.subspace.reduce_gradient(packed.grad)
        # The update's bound needs the gradient's largest entry and, when the packed state was just
        # (re)built, the state's.
        largest_grad = packed.grad.abs().amax()
        state_buffers = self._state_buffers(packed)
        measures = [largest_grad]
        if self._state_bound is None and state_buffers:
            measures.append(state_buffers[0].abs().amax())
        return StepWork(index, groups, params, packed, largest_grad, measures=measures)

    def _read(self, work: list[StepWork]) -> float:
        """On sharded parameters, every reading (the gradient's largest entry first) is the largest over the
        ranks, in one all-reduce, so that every rank takes the same decisions."""
        if self._shards is None or not work:
            return super()._read(work)
        (unit,) = work
        unit.readings = self._shards.largest_each(torch.stack(unit.measures))
        return unit.readings[0]

    def _update_bound(self, largest_grad: float, segments: list[FOSIHyper], n: int, r: int):
        """``(risky, state_bound, velocity_bound)`` after this step, from ``max|g|`` (see ``_OVERFLOW_GUARD``).

        Element bounds, with ``||.||`` the 2-norm and the rows of ``V`` orthonormal:
        ``|g2_i| <= max|g| + ||V g||``, ``||V g|| <= sqrt(n) max|g|``, the Newton
        step ``<= rho max|s| ||q||``, the base step from the state's bound (Adam:
        ``lr / bc1 * max|a| / eps``), its projection ``<= (1 + sqrt(n))`` times it.
        """
        sqrt_n = math.sqrt(n)
        coef = sqrt_n * largest_grad if r else 0.0
        g2 = largest_grad + coef
        config, state = self.config, self._state_bound or 0.0
        decay, gain = config.g1_decay_gain()
        velocity = decay * self.velocity_bound + gain * coef if config.g1_momentum > 0 else 0.0
        q = velocity if config.g1_momentum > 0 else coef
        newton = max(h.newton_factor for h in segments) * self._scale_max * q
        new_state, base_step = 0.0, 0.0
        for h in segments:
            if config.base == "sgd":
                a, u = 0.0, h.lr * g2
            elif config.base == "heavy_ball":
                a = h.beta1 * state + g2
                u = h.lr * a
            else:
                a = h.beta1 * state + (1.0 - h.beta1) * g2
                bias = 1.0 - h.beta1 ** (self.base_step + 1)
                u = h.lr / bias * a / h.eps if h.eps > 0 else math.inf
            new_state, base_step = max(new_state, a), max(base_step, u)
        total = newton + self.base_scale * (1.0 + sqrt_n) * base_step
        decays = all(abs(1.0 - h.lr * h.weight_decay) <= 1.0 for h in segments)
        largest = max(g2, q, newton, new_state, total)
        risky = not (decays and math.isfinite(largest) and largest < _OVERFLOW_GUARD)
        return risky, new_state, velocity

    # torch.compile runs the step after the closure eagerly (a graph break in a compiled step). The
    # step is driven by host numbers: the gradient's largest entry decides whether it may happen
    # (the non-finite policy) and whether its result must be checked for overflow, and the
    # bounds, counters and Ritz values it keeps are Python numbers, which a traced step would
    # bake into guards and recompile for at every step. An ESE takes a double backward, which
    # torch.compile's autograd cannot trace.
    @torch._dynamo.disable
    def _step_packed(self) -> None:
        super()._step_packed()

    def _update(self, work: list[StepWork], stateless) -> None:
        """An ESE first when one is due, then the update; undone when the bound flagged it and it overflowed."""
        (unit,) = work
        packed, params, layout = unit.packed, unit.params, unit.packed.layout
        largest_grad, *largest_state = unit.readings
        if self._state_bound is None:
            self._state_bound = largest_state[0] if largest_state else 0.0
        velocity_before = self.g1_velocity
        self._fit_velocity(packed)
        state_buffers = self._state_buffers(packed)
        settings = self._group_settings()

        refs = None
        if self.curvature_loss_fn is not None and self.config.curvature_due(self.step_count):
            refs = self._curvature_refs(packed)
            self._install(packed, self._estimate(self.curvature_loss_fn, packed))
        segments = self._segments(settings, packed.group_sizes)
        whole = self.subspace.total if self._shards is not None else layout.total
        risky, state_bound, velocity_bound = self._update_bound(largest_grad, segments, whole, packed.basis.shape[0])
        with nvtx_range("tritonopt/fosi/pack"):
            layout.pack(params, packed.weights.view(1, -1))
        live = [*state_buffers, self.g1_velocity]
        saved = [t.clone() for t in live] if risky else None
        decay, gain = self.config.g1_decay_gain()
        use_velocity = self.config.g1_momentum > 0 and packed.basis.shape[0] > 0
        self.subspace.update(
            packed.weights, packed.grad, packed.basis, self._newton_scale,
            all_rows=self.all_eigenvalues.numel(), base=self.config.base,
            segments=segments, step=self.base_step + 1, first_moment=state_buffers[0] if state_buffers else None,
            second_moment=state_buffers[1] if len(state_buffers) > 1 else None, base_scale=self.base_scale,
            g1_velocity=self.g1_velocity if use_velocity else None, g1_decay=decay, g1_gain=gain,
        )
        if risky:
            # One read: whether everything the step wrote is finite, and the state's largest entry.
            finite = torch.stack([torch.isfinite(t).all() for t in (packed.weights, *live)]).all()
            largest = state_buffers[0].abs().amax() if state_buffers else packed.weights.new_zeros(())
            if self._shards is None:
                finite, largest_state = torch.stack([finite.double(), largest.double()]).tolist()
            else:  # every rank undoes the step when any rank's result is not finite
                broken, largest_state = self._shards.largest_each(torch.stack([(~finite).double(), largest.double()]))
                finite = float(broken == 0.0)
            if finite != 1.0:
                for t, copy in zip(live, saved):
                    t.copy_(copy)
                if refs is not None:
                    self._restore_curvature(packed, refs)
                self.g1_velocity = velocity_before
                self._refuse_step("the update overflowed to NaN or inf (a finite but huge gradient); the step "
                                  "was undone", stateless)
                return
            state_bound = largest_state
        with nvtx_range("tritonopt/fosi/unpack"):
            torch._foreach_copy_(list(layout.locals), packed.weight_views)
        self._state_bound, self.velocity_bound = state_bound, velocity_bound
        self.base_step += 1
        self.step_count += 1
