"""What every K-FAC preconditioner shares: layers, statistics hooks, schedules, step pieces, checkpoints.

:class:`BaseKFACPreconditioner` registers the ``nn.Linear``/``nn.Conv2d``
layers of a model, validates the arguments, captures the factor statistics
from forward/backward hooks, and offers the pieces of a step as public
methods. :class:`~tritonopt.optim.kfac.KFACPreconditioner` (one process) and
:class:`~tritonopt.dist.kaisa.KAISAPreconditioner` (many) each write their
``step()`` from these pieces and the functions of
:mod:`tritonopt.optim.kfac_functional`; the distributed one puts its
collectives between them.

A step is a transaction. Until :meth:`BaseKFACPreconditioner.finish_step`
commits it, new factors live in the scratch statistic buffers and new eigen
data in fresh tensors, and no gradient is written; so a step refused by the
non-finite policy (a NaN/inf gradient or statistic, or a preconditioned
gradient that overflows float32) leaves every gradient, factor, eigen datum
and counter as it was.

Hooks are objects bound to the preconditioner (not closures), so
``copy.deepcopy`` and ``pickle`` of a model together with its preconditioner
give a copy whose hooks feed the copied preconditioner. (Callable
hyperparameters must be picklable functions for ``pickle``.)
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from tritonopt._runtime import nvtx_range
from tritonopt.optim._sharding import KFAC_SHARDING_REFUSAL, refuse_sharded
from tritonopt._validation import (
    FLOAT_DTYPES,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_tensor,
)
from tritonopt.ops import eigenbasis_precondition_prediv
from tritonopt.optim._kfac_layers import KFACLayer, register_layers
from tritonopt.optim._packed import NONFINITE_POLICIES, apply_nonfinite_policy
from tritonopt.optim.kfac_functional import (
    COMPUTE_METHODS,
    all_finite,
    buffer_bytes,
    eigen_shapes,
    factor_buffer,
    finiteness_probes,
    gram_finiteness_probes,
    kfac_accumulate_statistic,
    kfac_eigen_data,
    kfac_eigendecompose,
    kfac_inner_products,
    kfac_inverses,
    kfac_kl_clip_scale,
    kfac_running_average,
)

__all__ = ["BaseKFACPreconditioner", "HYPERPARAMETERS", "Schedule", "check_hyperparameter"]

Schedule = Union[float, int, Callable[[int], float]]
HYPERPARAMETERS = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")

# An unannounced loss scale is reported when the output gradients the hooks saw are 2^k
# (k >= this) times the gradients step() preconditions. A GradScaler starts at 2^16 and
# halves only on overflow; a smaller power of two is likelier a coincidence (a clip factor).
_SMALLEST_REPORTED_SCALE_EXPONENT = 8
# How far the two sums may differ beyond the power of two: a bias gradient computed in half
# precision is rounded there (2.5e-3 measured for a bfloat16 Conv2d), the hooks' sum is float32.
_LOSS_SCALE_TOLERANCE = 2.0**-6
# Steps in a row that must show the same kind of scale before the warning.
_LOSS_SCALE_EVIDENCE_STEPS = 2
# Checked steps after which, with nothing found, the hooks stop keeping the sums and step() stops
# comparing them: a GradScaler scales from the first step, and the check costs a reduction per
# layer and a host read per step, which a long run should not keep paying.
_LOSS_SCALE_WATCH_STEPS = 20


def check_hyperparameter(name: str, value) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is valid for it."""
    if name in ("factor_update_steps", "inv_update_steps"):
        check_int(name, value, low=1)
    elif name == "damping":
        check_float(name, value, low=0.0, low_open=True)
    elif name == "factor_decay":
        check_float(name, value, low=0.0, high=1.0, low_open=True)
    elif name == "kl_clip":
        if value is not None:
            check_float(name, value, low=0.0, low_open=True)
    elif name == "lr":
        check_float(name, value, low=0.0)
    else:
        raise ValueError(f"unknown K-FAC hyperparameter {name!r}")


def _layer_layout(layer) -> list[tuple]:
    """The layer's weight (and bias) as ``(shape, dtype)`` pairs: what a checkpoint's factors were saved for."""
    params = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    return [(tuple(p.shape), p.dtype) for p in params]


def _unpadded_copy(factor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A contiguous ``[dim, dim]`` copy of a (padded) factor, for a checkpoint."""
    return None if factor is None else factor.clone(memory_format=torch.contiguous_format)


def _check_precision(precision) -> None:
    # The preconditioning op owns the list of precisions: run its argument checks on meta tensors.
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str, got {type(precision).__name__}")
    probe = torch.empty((1, 1), device="meta")
    eigenbasis_precondition_prediv(probe, probe, probe, probe, precision=precision)


def _check_grad_scaler(grad_scaler) -> None:
    if grad_scaler is None or isinstance(grad_scaler, torch.amp.GradScaler) or callable(grad_scaler):
        return
    raise TypeError(
        "grad_scaler must be a torch.amp.GradScaler, a function returning the current loss scale, or None; "
        f"got {type(grad_scaler).__name__}"
    )


class _InputHook:
    """Forward hook of one registered layer: captures the A statistic.

    A copy (``copy.deepcopy``, ``pickle``) is bound to the copy of its
    preconditioner, or inert when the preconditioner cannot be copied.
    """

    def __init__(self, preconditioner: Optional["BaseKFACPreconditioner"], index: int):
        self.preconditioner, self.index = preconditioner, index

    def __call__(self, module, inputs, output):
        if self.preconditioner is not None:
            self.preconditioner.capture_input(self.index, inputs, output)

    def _copyable(self):
        p = self.preconditioner
        return p if p is not None and p.copyable else None

    def __deepcopy__(self, memo):
        p = self._copyable()
        return type(self)(None if p is None else copy.deepcopy(p, memo), self.index)

    def __reduce__(self):
        return type(self), (self._copyable(), self.index)


class _OutputGradHook:
    """Hook on one layer output's gradient: captures the G statistic."""

    def __init__(self, preconditioner: "BaseKFACPreconditioner", index: int):
        self.preconditioner, self.index = preconditioner, index

    def __call__(self, grad):
        self.preconditioner.capture_output_grad(self.index, grad)


class BaseKFACPreconditioner:
    """K-FAC's layers, hooks, schedules, step pieces and checkpoints (see the module docstring).

    Args (all keyword-only but ``model``):
        model: the module whose Linear/Conv2d layers are preconditioned (every one
            whose parameters all require grad, unless skipped); float32, float16
            or bfloat16 parameters.
        factor_update_steps: update the factors every this many steps (int >= 1).
        inv_update_steps: recompute eigendecompositions (or inverses) every this many steps.
        damping: ``> 0``, added to the products of eigenvalues (paper Eq. 16), or to
            each factor with the inverse method (Eq. 12).
        factor_decay: running-average weight of the old factor, in ``(0, 1]``.
        kl_clip: trust-region size ``kappa > 0`` of the KL clip, or None (no clip).
        lr: the optimizer's learning rate, used by the KL clip only.
            Each of the six above may be a constant or a function ``f(step) -> value``
            of the K-FAC step (validated each time it is read).
        skip_layers: regular expressions (``re.search`` on the module's name and on its
            class name) or module types to leave alone.
        g_batch_scale: multiply the G rows by the local batch size (G independent of the
            batch size; needed for a data-parallel run to equal a single-process one).
        prediv: precompute ``1 / (dG dA^T + damping)`` at each eigen update (paper
            sec. 4.4); the damping baked in is the one of that step.
        compute_method: ``"eigen"`` (paper Eq. 15-17) or ``"inverse"``
            (``(G + damping I)^-1 grad (A + damping I)^-1``, Eq. 12-14: two products
            per step instead of four, a different damping).
        factor_dtype: storage of the running averages ``A, G``: torch.float32
            (default), float16 or bfloat16 (paper sec. 3.3). The statistics are
            accumulated and the averages updated in float32, rounded once to this.
        inv_dtype: storage of the eigen data or inverses: float32 (default), float16
            or bfloat16. ``eigh`` and the inverses always run in float32.
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop (or a
            function returning its current scale): G is computed from the output
            gradients divided by the loss scale (paper sec. 4.1). Without it, output
            gradients that were loss-scaled anyway are warned about once
            (:meth:`check_loss_scale`).
        precision: GPU matrix-unit precision of the kernels (see :mod:`tritonopt.kernels.kfac`).
        on_nonfinite: ``"skip"`` or ``"raise"`` (see :mod:`tritonopt.optim.kfac`).

    Raises:
        UnsupportedLayerError: a Linear/Conv2d variant that cannot be handled; the
            message says to skip it.
        TypeError / ValueError: a bad argument (the message names it), parameters
            of an unsupported dtype, or no layer to precondition.
    """

    algorithm = "kfac"
    # Whether copy.deepcopy/pickle may copy it (with the model its hooks are on).
    copyable = True

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Schedule = 1,
        inv_update_steps: Schedule = 1,
        damping: Schedule = 0.001,
        factor_decay: Schedule = 0.95,
        kl_clip: Optional[Schedule] = 0.001,
        lr: Schedule = 0.1,
        skip_layers: Iterable[Union[str, type]] = (),
        g_batch_scale: bool = False,
        prediv: bool = True,
        compute_method: str = "eigen",
        factor_dtype: torch.dtype = torch.float32,
        inv_dtype: torch.dtype = torch.float32,
        grad_scaler=None,
        precision: str = "tf32x3",
        on_nonfinite: str = "skip",
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        refuse_sharded(type(self).__name__, list(model.parameters()), KFAC_SHARDING_REFUSAL)
        hyper = dict(
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps,
            damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr,
        )
        for name, value in hyper.items():
            if not callable(value):
                check_hyperparameter(name, value)
        check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
        check_choice("compute_method", compute_method, COMPUTE_METHODS)
        _check_precision(precision)
        check_choice("factor_dtype", factor_dtype, FLOAT_DTYPES)
        check_choice("inv_dtype", inv_dtype, FLOAT_DTYPES)
        _check_grad_scaler(grad_scaler)
        if isinstance(skip_layers, (str, type)):
            skip_layers = (skip_layers,)
        skip_layers = tuple(skip_layers)
        for rule in skip_layers:
            if not isinstance(rule, (str, type)):
                raise TypeError(f"skip_layers must hold regex strings or module types, got {rule!r}")
        check_bool("g_batch_scale", g_batch_scale)
        check_bool("prediv", prediv)
        if (
            not callable(factor_update_steps) and not callable(inv_update_steps)
            and inv_update_steps % factor_update_steps
        ):
            warnings.warn(
                f"inv_update_steps={inv_update_steps} is not a multiple of "
                f"factor_update_steps={factor_update_steps}: some eigendecompositions will "
                "reuse factors that did not change", stacklevel=3,
            )
        layers = register_layers(model, skip_layers)
        if not layers:
            raise ValueError("model has no nn.Linear or nn.Conv2d layer to precondition (after skip_layers)")

        self.model = model
        self.layers: list[KFACLayer] = layers
        self.hyperparameters = hyper
        self.skip_layers = skip_layers
        self.g_batch_scale = g_batch_scale
        self.prediv = prediv
        self.compute_method = compute_method
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.grad_scaler = grad_scaler
        self.precision = precision
        self.on_nonfinite = on_nonfinite
        self.steps = 0
        self.skipped_steps = 0
        self.last_kl_scale: Optional[torch.Tensor] = None
        self._capturing = self.is_factor_step()
        self._loss_scale: Optional[float] = None
        self._capture_problems: list[str] = []
        self._reported_unhooked: set[str] = set()
        self._reported_loss_scale = False
        self._loss_scale_evidence = 0
        self._loss_scale_checks = 0
        self._handles = [
            layer.module.register_forward_hook(_InputHook(self, i)) for i, layer in enumerate(self.layers)
        ]

    # ------------------------------------------------------------------ hyperparameters

    def hyperparameter(self, name: str, step: Optional[int] = None):
        """The value of a hyperparameter at ``step`` (default: the current step), validated."""
        value = self.hyperparameters[name]
        if callable(value):
            value = value(self.steps if step is None else step)
            check_hyperparameter(name, value)
        return value

    def step_hyperparameters(self) -> dict:
        """Every hyperparameter at the current step, validated (before a step changes anything)."""
        return {name: self.hyperparameter(name) for name in HYPERPARAMETERS}

    def is_factor_step(self) -> bool:
        return self.steps % self.hyperparameter("factor_update_steps") == 0

    def is_eigen_step(self) -> bool:
        return self.steps % self.hyperparameter("inv_update_steps") == 0

    def eigen_shapes(self, layer: KFACLayer) -> dict[str, tuple[int, ...]]:
        return eigen_shapes(layer.a_dim, layer.g_dim, self.compute_method, self.prediv)

    # ------------------------------------------------------------------ statistics capture

    @property
    def capturing(self) -> bool:
        """Whether the hooks capture statistics now (a factor-update step)."""
        return self._capturing

    def capture_input(self, index: int, inputs: tuple, output) -> None:
        """Forward hook: add this micro-batch's A statistic; hook the output for G.

        Runs only in training mode with autograd on, on factor-update steps. It
        never raises: an empty batch is counted and reported by ``step()``, an
        input of an unsupported dtype makes ``step()`` raise.
        """
        layer = self.layers[index]
        if not (self._capturing and layer.module.training and torch.is_grad_enabled()):
            return
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor):
            return
        if x.dtype not in FLOAT_DTYPES:
            self._capture_problems.append(f"layer {layer.name!r} received a {x.dtype} input")
            return
        rows, scale = layer.a_rows(x.detach())
        if rows.shape[0] == 0:
            layer.empty_batches += 1
            return
        layer.a_batch = kfac_accumulate_statistic(layer.a_batch, rows, layer.a_count, append_bias=layer.has_bias,
                                                  scale=scale, precision=self.precision)
        layer.a_count += 1
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(_OutputGradHook(self, index))

    def capture_output_grad(self, index: int, grad: torch.Tensor) -> None:
        """Backward hook: add this micro-batch's G statistic (unscaled by the loss scale)."""
        layer = self.layers[index]
        rows, scale = layer.g_rows(grad.detach(), self.g_batch_scale)
        if rows.shape[0] == 0:
            return
        loss_scale = self.loss_scale()
        if loss_scale is None:
            return
        if layer.has_bias and self.watches_loss_scale():
            rows_sum = rows.sum(dim=0, dtype=torch.float32)
            layer.g_sum = rows_sum if layer.g_count == 0 else layer.g_sum.add_(rows_sum)
        layer.g_batch = kfac_accumulate_statistic(layer.g_batch, rows, layer.g_count, append_bias=False,
                                                  scale=scale / loss_scale, precision=self.precision)
        layer.g_count += 1

    def loss_scale(self) -> Optional[float]:
        """The grad scaler's current scale (1 without one), read once per step; None if unusable."""
        if self._loss_scale is None:
            if self.grad_scaler is None:
                value = 1.0
            elif isinstance(self.grad_scaler, torch.amp.GradScaler):
                value = self.grad_scaler.get_scale()
            else:
                value = self.grad_scaler()
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                self._capture_problems.append(f"the grad scaler's scale is {value!r}, not a finite number > 0")
                return None
            self._loss_scale = float(value)
        return self._loss_scale

    def watches_loss_scale(self) -> bool:
        """Whether the hooks keep the sums that tell a loss scale nobody passed as ``grad_scaler``.

        Until it was reported, without a ``grad_scaler``, where the gradients are this
        process's own (across ranks DDP averages them), and for the first
        ``_LOSS_SCALE_WATCH_STEPS`` checked steps only.
        """
        return (self.grad_scaler is None and not self._reported_loss_scale
                and self._loss_scale_checks < _LOSS_SCALE_WATCH_STEPS
                and getattr(self, "world_size", 1) == 1)

    def check_loss_scale(self, grads: dict[int, torch.Tensor]) -> None:
        """Warn once when the output gradients were loss-scaled but no ``grad_scaler`` was given.

        For a layer with a bias, the sum of the output-gradient rows its hook saw is
        its bias gradient. A ``torch.amp.GradScaler`` scales the first by ``2^k`` and
        ``scaler.unscale_`` divides the second by it; G then holds ``2^(2k)``. So when
        every comparable layer shows the same kind of ratio, a power of two of at least
        ``2^8``, on two steps in a row, it warns (``RuntimeWarning``) to pass ``grad_scaler=``.
        """
        if not self.watches_loss_scale():
            return
        pairs = [(layer.g_sum, grads[i][:, -1]) for i, layer in enumerate(self.layers)
                 if i in grads and layer.has_bias and layer.has_statistics and layer.g_sum is not None]
        if not pairs:
            return
        self._loss_scale_checks += 1
        if self._loss_scale_checks == _LOSS_SCALE_WATCH_STEPS:
            for layer in self.layers:
                layer.g_sum = None
        seen = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float64) for s, _ in pairs])
        applied = torch.stack([torch.linalg.vector_norm(b, dtype=torch.float64) for _, b in pairs])
        ratios = [r for r in (seen / applied).tolist() if math.isfinite(r) and r > 0]
        if not ratios:
            return
        exponents = [round(math.log2(r)) for r in ratios]
        scaled = all(k == exponents[0] and k >= _SMALLEST_REPORTED_SCALE_EXPONENT
                     and abs(r / 2.0**k - 1) <= _LOSS_SCALE_TOLERANCE for r, k in zip(ratios, exponents))
        self._loss_scale_evidence = self._loss_scale_evidence + 1 if scaled else 0
        if self._loss_scale_evidence < _LOSS_SCALE_EVIDENCE_STEPS:
            return
        self._reported_loss_scale = True
        for layer in self.layers:
            layer.g_sum = None
        warnings.warn(
            f"{type(self).__name__}: the output gradients its hooks saw were 2^{exponents[0]} times the "
            "gradients it preconditions, as a torch.amp.GradScaler's loss scale makes them after "
            "scaler.unscale_: pass grad_scaler=scaler, or G holds the squared loss scale and the "
            "preconditioned updates shrink by orders of magnitude", RuntimeWarning, stacklevel=5,
        )

    def pending_statistics(self) -> list[int]:
        """Indices of the layers that have this step's A and G statistics."""
        return [i for i, layer in enumerate(self.layers) if layer.has_statistics]

    def end_capture(self) -> None:
        """Forget this step's statistics (after a step, refused or not)."""
        for layer in self.layers:
            layer.a_count = layer.g_count = layer.empty_batches = 0
        self._loss_scale = None
        self._capture_problems.clear()
        self._capturing = self.is_factor_step()

    def check_capture(self, grads: dict[int, torch.Tensor]) -> None:
        """Raise for problems the hooks recorded; warn about layers the hooks did not reach.

        A registered layer with a gradient but no statistics on a step where other
        layers got theirs has a module whose forward is never called (e.g.
        ``nn.MultiheadAttention.out_proj``, whose weight is used directly): it is
        reported once and passes its gradient through unpreconditioned.
        """
        if self._capture_problems:
            problems = "; ".join(dict.fromkeys(self._capture_problems))
            raise ValueError(
                f"{type(self).__name__}: {problems}. K-FAC takes float32, float16 or bfloat16 activations "
                "and a finite loss scale > 0; nothing was modified"
            )
        self.check_loss_scale(grads)
        empty = [l.name for l in self.layers if l.empty_batches]
        if empty:
            warnings.warn(
                f"{type(self).__name__}: an empty batch (0 rows) reached layers {empty}; it contributed no "
                "factor statistics", RuntimeWarning, stacklevel=3,
            )
        if not any(l.has_statistics for l in self.layers):
            return
        unhooked = [self.layers[i].name for i in grads
                    if not self.layers[i].has_statistics and self.layers[i].name not in self._reported_unhooked]
        if unhooked:
            self._reported_unhooked.update(unhooked)
            warnings.warn(
                f"{type(self).__name__}: layers {unhooked} have gradients but their forward hooks never ran "
                "(their modules are not called, as MultiheadAttention.out_proj is not): they get no factors "
                "and are not preconditioned; add them to skip_layers", RuntimeWarning, stacklevel=3,
            )

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model (no more factor statistics)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ step pieces

    def read_gradients(self) -> dict[int, torch.Tensor]:
        """``{layer index: [g, a] float32 gradient}`` for the layers that have gradients."""
        return {i: layer.grad_matrix() for i, layer in enumerate(self.layers) if layer.has_grad()}

    def nonfinite_problem(
        self,
        grads: dict[int, torch.Tensor],
        statistics: Iterable[int] = (),
        preconditioned: Optional[dict[int, torch.Tensor]] = None,
        inner_products: Optional[torch.Tensor] = None,
    ) -> Optional[str]:
        """What is not finite among these (one host sync), or None.

        ``inner_products`` (:func:`~tritonopt.optim.kfac_functional.kfac_inner_products`
        of ``preconditioned`` and ``grads``, in ``grads``' order) stand for both:
        each is finite exactly when its layer's gradient and ``P`` are.
        """
        statistics = list(statistics)
        order = list(grads)
        parts = []
        if inner_products is not None:
            parts.append(inner_products)
        elif order:
            parts.append(finiteness_probes([grads[i] for i in order]))
            if preconditioned:
                parts.append(finiteness_probes([preconditioned[i] for i in order]))
        if statistics:
            parts.append(gram_finiteness_probes([t for i in statistics for t in (self.layers[i].a_batch,
                                                                                 self.layers[i].g_batch)]))
        if not parts:
            return None
        flags = torch.cat(parts).isfinite().tolist()
        if all(flags):
            return None
        layer_flags = flags[: len(order)]
        if inner_products is None and preconditioned:
            layer_flags = [g and p for g, p in zip(layer_flags, flags[len(order) : 2 * len(order)])]
        stat_flags = flags[len(flags) - 2 * len(statistics):] if statistics else []
        suspects = [i for i, ok in zip(order, layer_flags) if not ok]
        bad_grads = [self.layers[i].name for i, ok in zip(suspects, all_finite([grads[i] for i in suspects])) if not ok]
        if bad_grads:
            return f"the gradients of layers {bad_grads} hold NaN or inf"
        bad_stats = [self.layers[i].name for k, i in enumerate(statistics) if not (stat_flags[2 * k] and stat_flags[2 * k + 1])]
        if bad_stats:
            return f"the factor statistics of layers {bad_stats} hold NaN or inf"
        overflow = [self.layers[i].name for i in suspects]
        return f"the preconditioned gradients of layers {overflow} overflow float32 (gradients too large to precondition)"

    def refuse_step(self, problem: str) -> bool:
        """Apply ``on_nonfinite`` to a step that must not happen (nothing has been modified); False."""
        apply_nonfinite_policy(self, problem, "gradients, factors and the step counter are unchanged")
        return False

    def fold_factors(self, indices: Iterable[int], decay: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The new running averages of ``indices``, float32, written over their statistic buffers.

        Nothing is committed: :meth:`finish_step` does that.
        """
        folded = {}
        for i in indices:
            layer = self.layers[i]
            folded[i] = (
                kfac_running_average(layer.a_factor, layer.a_batch, decay, out=layer.a_batch),
                kfac_running_average(layer.g_factor, layer.g_batch, decay, out=layer.g_batch),
            )
        return folded

    def factors_of(self, index: int, folded: dict) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The factors a decomposition of layer ``index`` uses now: this step's fold, else the stored ones."""
        if index in folded:
            return folded[index]
        layer = self.layers[index]
        if layer.a_factor is None or layer.g_factor is None:
            return None
        return layer.a_factor, layer.g_factor

    def finite_factor_layers(self, indices: Iterable[int], folded: dict) -> list[int]:
        """Those of ``indices`` whose factors exist and are finite; the others are reported.

        A layer with non-finite factors (a corrupt checkpoint) keeps its previous
        eigen data: a warning with ``on_nonfinite="skip"``, ``FloatingPointError``
        with ``"raise"``.
        """
        candidates = [(i, self.factors_of(i, folded)) for i in indices]
        candidates = [(i, f) for i, f in candidates if f is not None]
        flags = all_finite([t for _, pair in candidates for t in pair])
        usable = []
        for k, (i, _) in enumerate(candidates):
            if flags[2 * k] and flags[2 * k + 1]:
                usable.append(i)
                continue
            message = (f"{type(self).__name__}: the factors of layer {self.layers[i].name!r} hold NaN or inf; "
                       "its eigen update was skipped and its previous eigenbasis kept")
            if self.on_nonfinite == "raise":
                raise FloatingPointError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return usable

    def decompose(self, matrices: list[torch.Tensor], damping: float, *, strict: bool = False) -> list:
        """Per factor: a :class:`~tritonopt.optim.kfac_functional.Decomposition` (eigen method) or
        ``(F + damping I)^-1`` (inverse method); None where it failed (a warning), or a
        ``torch.linalg.LinAlgError`` with ``strict`` or ``on_nonfinite="raise"``."""
        if self.compute_method == "inverse":
            results = kfac_inverses(matrices, damping)
        else:
            results = kfac_eigendecompose(matrices)
        failed = sorted({m.shape[0] for m, r in zip(matrices, results) if r is None})
        if failed:
            message = f"{type(self).__name__}: the decomposition of factors of sizes {failed} failed"
            if strict or self.on_nonfinite == "raise":
                raise torch.linalg.LinAlgError(message)
            warnings.warn(message + "; those eigen updates were skipped", RuntimeWarning, stacklevel=3)
        return results

    def eigen_update(
        self, indices: Iterable[int], folded: dict, damping: float, *, strict: bool = False
    ) -> dict[int, dict[str, torch.Tensor]]:
        """New eigen data (or inverses) of the layers ``indices``, not committed.

        Layers whose factors are missing or not finite, or whose decomposition
        failed, are left out (they keep their previous eigen data).
        """
        usable = self.finite_factor_layers(indices, folded)
        matrices = [t for i in usable for t in self.factors_of(i, folded)]
        results = self.decompose(matrices, damping, strict=strict)
        eigen = {}
        for k, i in enumerate(usable):
            a, g = results[2 * k], results[2 * k + 1]
            if a is not None and g is not None:
                eigen[i] = kfac_eigen_data(a, g, damping=damping, prediv=self.prediv, dtype=self.inv_dtype)
        return eigen

    def run_step(
        self,
        hyper: dict,
        grads: dict[int, torch.Tensor],
        statistics: list[int],
        *,
        eigen_update: Callable[[dict, float], dict],
        precondition: Callable[[dict, dict, float], dict],
    ) -> bool:
        """A step once this step's statistics are in place: refuse, fold, update eigen data, precondition, commit.

        ``eigen_update(folded, damping)`` returns the new eigen data this process
        keeps; ``precondition(grads, eigen, damping)`` returns ``P`` of every layer
        in ``grads``. (A distributed caller puts its collectives in these two.)
        Returns :meth:`finish_step`'s answer.
        """
        eigen_step = self.is_eigen_step()
        if eigen_step:  # decompositions are costly: do not start them on non-finite input
            problem = self.nonfinite_problem(grads, statistics)
            if problem is not None:
                return self.refuse_step(problem)
        with nvtx_range(f"tritonopt/{self.algorithm}/factor_fold"):
            folded = self.fold_factors(statistics, hyper["factor_decay"])
        eigen = {}
        if eigen_step:
            with nvtx_range(f"tritonopt/{self.algorithm}/eigen"):
                eigen = eigen_update(folded, hyper["damping"])
        with nvtx_range(f"tritonopt/{self.algorithm}/precondition"):
            preconditioned = precondition(grads, eigen, hyper["damping"])
        with nvtx_range(f"tritonopt/{self.algorithm}/scale"):
            return self.finish_step(grads, preconditioned, folded, eigen, hyper,
                                    statistics=() if eigen_step else statistics)

    def finish_step(
        self,
        grads: dict[int, torch.Tensor],
        preconditioned: dict[int, torch.Tensor],
        folded: dict,
        eigen: dict[int, dict[str, torch.Tensor]],
        hyper: dict,
        statistics: Iterable[int] = (),
    ) -> bool:
        """Apply the KL clip and commit the step; False (nothing committed) if it is refused.

        The gradients, the statistic buffers of the layers ``statistics`` (folded
        or not: non-finite either way), the preconditioned gradients and the KL
        scale are checked together (one host sync); a refused step leaves
        everything as it was.
        """
        order = list(grads)
        inner_products = None
        if hyper["kl_clip"] is not None and order:
            inner_products = kfac_inner_products([preconditioned[i] for i in order], [grads[i] for i in order])
        problem = self.nonfinite_problem(grads, statistics, preconditioned, inner_products)
        if problem is not None:
            return self.refuse_step(problem)
        kl_scale = None
        if inner_products is not None:
            kl_scale = kfac_kl_clip_scale(inner_products, lr=hyper["lr"], kl_clip=hyper["kl_clip"])
        for i, (a, g) in folded.items():
            self._store_factors(self.layers[i], a, g)
        for i, data in eigen.items():
            self.layers[i].eigen = data
        for i in order:
            p = preconditioned[i]
            # nu may lie below float32's normal range when P is huge: scale in float64, round once.
            self.layers[i].write_grad(p if kl_scale is None else p.to(torch.float64) * kl_scale)
        self.last_kl_scale = kl_scale
        self.steps += 1
        return True

    def _store_factors(self, layer: KFACLayer, a: torch.Tensor, g: torch.Tensor) -> None:
        # The folded factors live in the statistic buffers: in float32 the buffers and the old
        # factors swap roles; otherwise the factors are rounded once into their storage dtype.
        # Every buffer has the padded layout of kfac_functional.factor_buffer.
        if self.factor_dtype == torch.float32:
            # (At the first update there is no old factor: the buffer is allocated again.)
            layer.a_factor, layer.a_batch = a, (factor_buffer(layer.a_dim, device=a.device)
                                                if layer.a_factor is None else layer.a_factor)
            layer.g_factor, layer.g_batch = g, (factor_buffer(layer.g_dim, device=g.device)
                                                if layer.g_factor is None else layer.g_factor)
            return
        for name, value in (("a_factor", a), ("g_factor", g)):
            stored = getattr(layer, name)
            if stored is None:
                stored = factor_buffer(value.shape[0], dtype=self.factor_dtype, device=value.device)
                setattr(layer, name, stored)
            stored.copy_(value)

    # ------------------------------------------------------------------ memory

    def memory_usage(self) -> dict[str, int]:
        """Bytes this process holds for K-FAC: ``factors``, ``batch`` buffers, ``eigen`` data and
        ``total``, the factors' row padding included."""
        usage = {"factors": 0, "batch": 0, "eigen": 0}
        for layer in self.layers:
            usage["factors"] += buffer_bytes(layer.a_factor) + buffer_bytes(layer.g_factor)
            usage["batch"] += buffer_bytes(layer.a_batch) + buffer_bytes(layer.g_batch)
            usage["eigen"] += sum(buffer_bytes(t) for t in layer.eigen.values())
        usage["total"] = sum(usage.values())
        return usage

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, include_eigen: bool = True) -> dict:
        """Steps, constant hyperparameters, factors and (by default) eigen data, per layer name.

        Tensors keep their storage dtypes, and factors are saved unpadded ``[dim, dim]``
        (contiguous); everything is plain data (loadable with
        ``torch.load(weights_only=True)``). Callable hyperparameters are not saved
        (pass them again to the constructor). With ``include_eigen`` a resumed run
        equals an uninterrupted one bit for bit; without it, :meth:`load_state_dict`
        recomputes the eigen data from the factors, which equals the uninterrupted
        run only when the factors did not change since the last eigen update.
        """
        layers = {}
        for layer in self.layers:
            entry = {
                "a_factor": _unpadded_copy(layer.a_factor),
                "g_factor": _unpadded_copy(layer.g_factor),
                "param_layout": _layer_layout(layer),
            }
            if include_eigen:
                entry["eigen"] = {k: v.clone() for k, v in layer.eigen.items()}
            layers[layer.name] = entry
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "hyperparameters": {k: v for k, v in self.hyperparameters.items() if not callable(v)},
            "prediv": self.prediv,
            "compute_method": self.compute_method,
            "layers": layers,
        }

    def check_state_dict(self, state_dict) -> None:
        """Raise ``ValueError`` naming the problem unless ``state_dict`` fits this preconditioner."""
        try:
            self._check_state_dict(state_dict)
        except TypeError as error:  # a field of the wrong kind is a bad value of the state dict
            raise ValueError(str(error)) from error

    def _check_state_dict(self, state_dict) -> None:
        if not isinstance(state_dict, dict) or "layers" not in state_dict or "steps" not in state_dict:
            raise ValueError(f"state_dict must be a dict from {type(self).__name__}.state_dict()")
        check_int("state_dict['steps']", state_dict["steps"], low=0)
        check_int("state_dict['skipped_steps']", state_dict.get("skipped_steps", 0), low=0)
        for key, mine in (("prediv", self.prediv), ("compute_method", self.compute_method)):
            if state_dict.get(key, mine) != mine:
                raise ValueError(f"state_dict was saved with {key}={state_dict[key]!r}, this preconditioner "
                                 f"has {key}={mine!r}")
        hyper = state_dict.get("hyperparameters", {})
        if not isinstance(hyper, dict):
            raise ValueError("state_dict['hyperparameters'] must be a dict")
        for name, value in hyper.items():
            if name not in HYPERPARAMETERS:
                raise ValueError(f"state_dict has an unknown hyperparameter {name!r}")
            check_hyperparameter(name, value)
        saved = state_dict["layers"]
        if not isinstance(saved, dict):
            raise ValueError("state_dict['layers'] must be a dict of layer names")
        names = [l.name for l in self.layers]
        if sorted(saved) != sorted(names):
            raise ValueError(f"state_dict has layers {sorted(saved)} but this preconditioner has {sorted(names)}")
        for layer in self.layers:
            entry = saved[layer.name]
            if not isinstance(entry, dict):
                raise ValueError(f"state_dict layer {layer.name!r}: expected a dict, got {type(entry).__name__}")
            saved_layout, layout = entry.get("param_layout"), _layer_layout(layer)
            if saved_layout is None or [(tuple(s), d) for s, d in saved_layout] != layout:
                raise ValueError(f"state_dict layer {layer.name!r}: param_layout {saved_layout!r} is not this layer's "
                                 f"{layout!r} (weight and bias shapes and dtypes): its factors are another layer's")
            for key, dim in (("a_factor", layer.a_dim), ("g_factor", layer.g_dim)):
                if key not in entry:
                    raise ValueError(f"state_dict layer {layer.name!r} has no {key!r}")
                if entry[key] is not None:
                    self._check_saved_tensor(layer, key, entry[key], (dim, dim))
            if (entry["a_factor"] is None) != (entry["g_factor"] is None):
                raise ValueError(f"state_dict layer {layer.name!r}: a_factor and g_factor must both be saved or both None")
            if "eigen" in entry:
                self._check_saved_eigen(layer, entry["eigen"])

    def _check_saved_tensor(self, layer: KFACLayer, key: str, value, shape) -> None:
        where = f"state_dict layer {layer.name!r}: {key}"
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{where} has shape {got}, expected {tuple(shape)}")
        check_tensor(where, value, dtypes=FLOAT_DTYPES)

    def _check_saved_eigen(self, layer: KFACLayer, eigen) -> None:
        if not isinstance(eigen, dict):
            raise ValueError(f"state_dict layer {layer.name!r}: eigen must be a dict, got {type(eigen).__name__}")
        if not eigen:
            return
        shapes = self.eigen_shapes(layer)
        if set(eigen) != set(shapes):
            raise ValueError(
                f"state_dict layer {layer.name!r}: eigen holds {sorted(eigen)}, expected {sorted(shapes)} "
                f"(compute_method={self.compute_method!r}, prediv={self.prediv})"
            )
        for name, shape in shapes.items():
            self._check_saved_tensor(layer, f"eigen {name!r}", eigen[name], shape)

    def restore_state(self, state_dict: dict, needs_eigen: Callable[[int], bool]) -> list[int]:
        """Load a checked state dict; returns the layers that need eigen data it lacks.

        Call :meth:`check_state_dict` first. Eigen data are kept for the layers
        ``needs_eigen`` accepts; a layer with saved factors and no (or empty)
        saved eigen data is returned for recomputation.
        """
        device = self.layers[0].weight.device
        for name, value in state_dict.get("hyperparameters", {}).items():
            if not callable(self.hyperparameters[name]):
                self.hyperparameters[name] = value
        self.steps = int(state_dict["steps"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        missing = []
        for index, layer in enumerate(self.layers):
            entry = state_dict["layers"][layer.name]
            for key in ("a_factor", "g_factor"):
                t = entry[key]
                stored = None
                if t is not None:  # into the padded layout the kernels load in vectors
                    stored = factor_buffer(t.shape[0], dtype=self.factor_dtype, device=device)
                    stored.copy_(t)
                setattr(layer, key, stored)
            layer.eigen = {}
            if not needs_eigen(index):
                continue
            saved = entry.get("eigen") or {}
            if saved:
                layer.eigen = {k: v.to(device=device, dtype=self.inv_dtype, copy=True) for k, v in saved.items()}
            elif layer.a_factor is not None:
                missing.append(index)
        self.end_capture()
        return missing

    def load_state_dict(self, state_dict: dict, compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; validated before anything changes.

        Eigen data missing from ``state_dict`` are recomputed from the factors when
        ``compute_inverses`` is true.
        """
        self.check_state_dict(state_dict)
        missing = self.restore_state(state_dict, needs_eigen=lambda index: True)
        if compute_inverses and missing:
            for i, data in self.eigen_update(missing, {}, self.hyperparameter("damping")).items():
                self.layers[i].eigen = data
