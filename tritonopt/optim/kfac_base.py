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

This module holds the construction and the step pieces; the hooks and the
checks of what they captured are in ``_kfac_capture.py``, the checkpoints in
``_kfac_checkpoints.py``, the hyperparameters and argument checks in
``_kfac_arguments.py``.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from tritonopt._runtime import nvtx_range
from tritonopt._validation import FLOAT_DTYPES, check_bool, check_choice
from tritonopt.optim._kfac_arguments import (
    HYPERPARAMETERS,
    Schedule,
    check_grad_scaler,
    check_hyperparameter,
    check_precision,
)
from tritonopt.optim._kfac_capture import KFACStatisticsCapture
from tritonopt.optim._kfac_capture import _InputHook  # noqa: F401  (pickles name the hook here)
from tritonopt.optim._kfac_checkpoints import KFACCheckpoints
from tritonopt.optim._kfac_layers import KFACLayer, register_layers
from tritonopt.optim._packed import NONFINITE_POLICIES, apply_nonfinite_policy
from tritonopt.optim.kfac_functional import (
    COMPUTE_METHODS,
    all_finite,
    buffer_bytes,
    eigen_shapes,
    factor_buffer,
    float32_finiteness_probe,
    gram_finiteness_probes,
    kfac_eigen_data,
    kfac_eigendecompose,
    kfac_inner_products,
    kfac_inner_products_float32,
    kfac_inverses,
    kfac_scale_preconditioned,
    kl_clip_scale_of_sum,
    kfac_running_averages,
    statistics_finiteness_probe,
)

__all__ = ["BaseKFACPreconditioner", "HYPERPARAMETERS", "Schedule", "check_hyperparameter"]


class BaseKFACPreconditioner(KFACStatisticsCapture, KFACCheckpoints):
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
        precision: GPU matrix-unit precision of the kernels (see :mod:`tritonopt.kernels.kfac`),
            when they run: on CUDA tensors the products run through cuBLAS in full float32 unless
            the Triton backend is forced (see the backends page).
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
        hyper = dict(
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps,
            damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr,
        )
        for name, value in hyper.items():
            if not callable(value):
                check_hyperparameter(name, value)
        check_choice("on_nonfinite", on_nonfinite, NONFINITE_POLICIES)
        check_choice("compute_method", compute_method, COMPUTE_METHODS)
        check_precision(precision)
        check_choice("factor_dtype", factor_dtype, FLOAT_DTYPES)
        check_choice("inv_dtype", inv_dtype, FLOAT_DTYPES)
        check_grad_scaler(grad_scaler)
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
        self._start_capture()

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

    # ------------------------------------------------------------------ step pieces

    def read_gradients(self) -> dict[int, torch.Tensor]:
        """``{layer index: [g, a] float32 gradient}`` for the layers that have gradients."""
        return {i: layer.grad_matrix() for i, layer in enumerate(self.layers) if layer.has_grad()}

    def write_gradient(self, index: int, matrix: torch.Tensor) -> None:
        """Put layer ``index``'s ``[g, a]`` preconditioned gradient into its parameters' ``.grad``."""
        self.layers[index].write_grad(matrix)

    def nonfinite_problem(
        self,
        grads: dict[int, torch.Tensor],
        statistics: Iterable[int] = (),
        preconditioned: Optional[dict[int, torch.Tensor]] = None,
    ) -> tuple[Optional[str], Optional[float]]:
        """What is not finite among these, or None; and ``sum_l <P_l, grad_l>`` when ``preconditioned`` is given.

        One host sync, over a few values each finite when all it covers is: with
        ``preconditioned``, the float32 ``<P_l, grad_l>`` of every layer of ``grads``
        (:func:`~tritonopt.optim.kfac_functional.kfac_inner_products_float32`), which stand for
        the gradients and ``P`` and add up to the KL clip's sum; without it, one float32 probe
        of the gradients; and one probe of the statistic buffers of the layers ``statistics``
        (:func:`~tritonopt.optim.kfac_functional.statistics_finiteness_probe`). Float32 can
        overflow on finite entries, so when a value is not finite, exact float64 probes decide
        and name the layers at fault (a second sync), and the sum is taken in float64.
        """
        statistics = list(statistics)
        order = list(grads)
        with_products = bool(order) and preconditioned is not None
        parts = []
        if with_products:
            products = kfac_inner_products_float32([preconditioned[i] for i in order], [grads[i] for i in order])
            parts.append(products.sum(dtype=torch.float64).reshape(1))
        elif order:
            parts.append(float32_finiteness_probe([grads[i] for i in order]).reshape(1))
        if statistics:
            parts.append(statistics_finiteness_probe(self._statistic_buffers(statistics)).reshape(1))
        if not parts:
            return None, None
        values = torch.cat(parts).tolist()
        inner_sum = values[0] if with_products else None
        if all(math.isfinite(v) for v in values):
            return None, inner_sum
        problem = self._nonfinite_layers(grads, statistics, preconditioned)
        if problem is None and with_products and not math.isfinite(inner_sum):
            # Finite gradients and P whose float32 products overflowed: float64 holds them exactly.
            inner_sum = kfac_inner_products([preconditioned[i] for i in order], [grads[i] for i in order]).sum().item()
        return problem, inner_sum

    def _statistic_buffers(self, statistics: list[int]) -> list[torch.Tensor]:
        return [t for i in statistics for t in (self.layers[i].a_batch, self.layers[i].g_batch)]

    def _nonfinite_layers(self, grads: dict, statistics: list[int], preconditioned: Optional[dict]) -> Optional[str]:
        """Which layers' gradients, statistics or ``P`` are not finite, in that order of blame; None
        when all are (the statistics' probe overflowed float32 on finite entries)."""
        order = list(grads)
        grad_flags = all_finite([grads[i] for i in order])
        bad_grads = [self.layers[i].name for i, ok in zip(order, grad_flags) if not ok]
        if bad_grads:
            return f"the gradients of layers {bad_grads} hold NaN or inf"
        if statistics:
            flags = gram_finiteness_probes(self._statistic_buffers(statistics)).isfinite().tolist()
            bad_stats = [self.layers[i].name for k, i in enumerate(statistics) if not (flags[2 * k] and flags[2 * k + 1])]
            if bad_stats:
                return f"the factor statistics of layers {bad_stats} hold NaN or inf"
        p_flags = all_finite([preconditioned[i] for i in order]) if preconditioned else []
        overflow = [self.layers[i].name for i, ok in zip(order, p_flags) if not ok]
        if not overflow:
            return None
        return (f"the preconditioned gradients of layers {overflow} overflow float32 (gradients too large to "
                "precondition)")

    def refuse_step(self, problem: str) -> bool:
        """Apply ``on_nonfinite`` to a step that must not happen (nothing has been modified); False."""
        apply_nonfinite_policy(self, problem, "gradients, factors and the step counter are unchanged")
        return False

    def fold_factors(self, indices: Iterable[int], decay: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The new running averages of ``indices``, float32, written over their statistic buffers.

        Nothing is committed: :meth:`finish_step` does that.
        """
        indices = list(indices)
        buffers = [b for i in indices for b in (self.layers[i].a_batch, self.layers[i].g_batch)]
        factors = [f for i in indices for f in (self.layers[i].a_factor, self.layers[i].g_factor)]
        averages = kfac_running_averages(factors, buffers, decay, out=buffers)
        return {i: (averages[2 * k], averages[2 * k + 1]) for k, i in enumerate(indices)}

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
        matrices = [t for _, pair in candidates for t in pair]
        if not matrices or math.isfinite(float32_finiteness_probe(matrices).item()):
            return [i for i, _ in candidates]
        flags = all_finite(matrices)
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
            problem, _ = self.nonfinite_problem(grads, statistics)
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
        clip's sum are checked together (one host sync, :meth:`nonfinite_problem`);
        a refused step leaves everything as it was. ``preconditioned`` is the
        step's own: the clip scales it in place.
        """
        order = list(grads)
        problem, inner_sum = self.nonfinite_problem(grads, statistics, preconditioned)
        if problem is not None:
            return self.refuse_step(problem)
        kl_scale = None
        if hyper["kl_clip"] is not None and order:
            kl_scale = kl_clip_scale_of_sum(inner_sum, lr=hyper["lr"], kl_clip=hyper["kl_clip"])
        for i, (a, g) in folded.items():
            self._store_factors(self.layers[i], a, g)
        for i, data in eigen.items():
            self.layers[i].eigen = data
        if kl_scale is not None and kl_scale != 1.0:  # nu = 1 leaves P as it is, bit for bit
            kfac_scale_preconditioned([preconditioned[i] for i in order], kl_scale)
        for i in order:
            self.write_gradient(i, preconditioned[i])
        self.last_kl_scale = None if kl_scale is None else torch.tensor(kl_scale, dtype=torch.float64)
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
