"""K-FAC with eigenbasis preconditioning (KAISA, Pauloski et al. SC '21, sec. 2-4).

Usage::

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFACPreconditioner(model, lr=lambda step: optimizer.param_groups[0]["lr"])
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        kfac.step()          # replaces the Linear/Conv2d gradients by preconditioned ones
        optimizer.step()

Per step ``k`` (counted from 0 by :meth:`KFACPreconditioner.step`):

1. **Factors** (``k % factor_update_steps == 0``). Hooks on every registered layer
   capture, in training mode with autograd on, the layer input (forward) and the
   gradient w.r.t. its output (backward), and average ``X^T X / n`` over the
   step's forward/backward passes into a batch buffer with the fused
   :func:`~tritonopt._ops.kfac.kfac_factor_update` (micro-batch ``m`` uses decay
   ``(m-1)/m``, an exact running mean). ``step()`` then folds the batch into the
   running average ``F <- decay F + (1 - decay) F_batch`` (``F = I`` before the first
   update; paper sec. 2.1.2). Folding in ``step()`` rather than in the hook lets
   non-finite statistics be refused before they reach ``F`` and lets a
   distributed subclass all-reduce the batch statistics first.
2. **Eigendecompositions** (``k % inv_update_steps == 0``): ``torch.linalg.eigh`` in
   fp32, batched over layers whose factors have one size, eigenvalues clamped at 0;
   with ``prediv`` the reciprocal ``D = 1 / (dG dA^T + damping)`` is computed once
   here (paper sec. 4.4), else ``dA, dG`` are kept and the current damping used.
3. **Preconditioning** (every step): ``P = QG [(QG^T grad QA) / (dG dA^T + damping)] QA^T``
   = ``(A (x) G + damping I)^-1 grad`` (paper Eq. 15-17) with
   :func:`~tritonopt._ops.kfac.eigenbasis_precondition` (or its prediv variant).
4. **KL clip**: ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <P_l, grad_l>|))`` (``nu = 1``
   when the sum is 0, no clipping when ``kl_clip`` is None); the gradients become
   ``nu P``. ``nu`` stays on the device: no per-layer host synchronisation.

Non-finite values. A step whose gradients or fresh factor statistics hold NaN/inf
is refused before anything changes: ``on_nonfinite="skip"`` (default) warns,
leaves every gradient, factor and counter as it was (the step counter does not
advance) and counts :attr:`skipped_steps`; ``"raise"`` raises
``FloatingPointError``. Stored factors that are non-finite (e.g. loaded from a
corrupt checkpoint) or whose eigendecomposition fails: the eigen update of that
layer is skipped with a warning and its previous eigenbasis is kept (a layer that
never had one passes its gradient through unpreconditioned); ``"raise"`` raises.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from tritonopt._ops.kfac import (
    eigen_inv_denominator,
    eigenbasis_precondition,
    eigenbasis_precondition_prediv,
    kfac_factor_update,
)
from tritonopt._runtime import nvtx_range
from tritonopt.kernels.kfac import DEFAULT_PRECISION, PRECISIONS
from tritonopt.optim._kfac_layers import KFACLayer, UnsupportedLayerError, make_layer

__all__ = ["KFACPreconditioner", "UnsupportedLayerError"]

Schedule = Union[float, int, Callable[[int], float]]
_NONFINITE_POLICIES = ("skip", "raise")
_SCALAR_HYPERPARAMETERS = (
    "factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr",
)


def _check_damping(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"damping must be a finite number > 0, got {v!r}")


def _check_factor_decay(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"factor_decay must be a number in (0, 1], got {v!r}")


def _check_kl_clip(v):
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"kl_clip must be None or a finite number > 0, got {v!r}")


def _check_lr(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {v!r}")


def _check_steps(name):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return check


_CHECKS = {
    "factor_update_steps": _check_steps("factor_update_steps"),
    "inv_update_steps": _check_steps("inv_update_steps"),
    "damping": _check_damping,
    "factor_decay": _check_factor_decay,
    "kl_clip": _check_kl_clip,
    "lr": _check_lr,
}


def _matches(name: str, module: nn.Module, skip: Iterable) -> bool:
    for rule in skip:
        if isinstance(rule, type):
            if isinstance(module, rule):
                return True
        elif re.search(rule, name) or re.search(rule, type(module).__name__):
            return True
    return False


class KFACPreconditioner:
    """K-FAC preconditioner for the ``nn.Linear`` and ``nn.Conv2d`` layers of a model.

    Call :meth:`step` after ``loss.backward()`` and before the optimizer's
    ``step()``; it rewrites the registered layers' ``.grad`` in place (other
    parameters are untouched), so any ``torch.optim`` optimizer applies the
    preconditioned update.

    Args:
        model: the module whose Linear/Conv2d layers are preconditioned
            (every one whose parameters all require grad, unless skipped).
        factor_update_steps: update the factors every this many steps (int >= 1).
        inv_update_steps: recompute eigendecompositions every this many steps.
        damping: ``> 0``, added to the products of eigenvalues (paper Eq. 16).
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
        precision: GPU matrix-unit precision of the kernels (see :mod:`tritonopt.kernels.kfac`).
        on_nonfinite: ``"skip"`` or ``"raise"`` (see the module docstring).

    Raises:
        UnsupportedLayerError: a Linear/Conv2d variant that cannot be handled
            (grouped or non-zero-padded convolutions, uninitialised lazy layers);
            the message says to skip it.
        ValueError: bad hyperparameters (the message names them), or no layer to precondition.
    """

    algorithm = "kfac"
    # A distributed subclass cannot skip an eigen update that only one process saw fail.
    _raise_on_eigh_failure = False

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
        precision: str = DEFAULT_PRECISION,
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
                _CHECKS[name](value)
        if on_nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if isinstance(skip_layers, (str, type)):
            skip_layers = (skip_layers,)
        skip_layers = tuple(skip_layers)
        for rule in skip_layers:
            if not isinstance(rule, (str, type)):
                raise TypeError(f"skip_layers must hold regex strings or module types, got {rule!r}")
        for name, flag in (("g_batch_scale", g_batch_scale), ("prediv", prediv)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if (
            not callable(factor_update_steps) and not callable(inv_update_steps)
            and inv_update_steps % factor_update_steps
        ):
            warnings.warn(
                f"inv_update_steps={inv_update_steps} is not a multiple of "
                f"factor_update_steps={factor_update_steps}: some eigendecompositions will "
                "reuse factors that did not change", stacklevel=2,
            )
        self.hyperparameters = hyper
        self.skip_layers = skip_layers
        self.g_batch_scale = g_batch_scale
        self.prediv = prediv
        self.precision = precision
        self.on_nonfinite = on_nonfinite
        self.steps = 0
        self.skipped_steps = 0
        self.model = model

        self.layers: list[KFACLayer] = []
        for name, module in model.named_modules():
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            if _matches(name, module, skip_layers):
                continue
            params = list(module.parameters(recurse=False))
            if not params or not all(p.requires_grad for p in params):
                continue
            self.layers.append(make_layer(name, module))
        if not self.layers:
            raise ValueError(
                "model has no nn.Linear or nn.Conv2d layer to precondition (after skip_layers)"
            )
        self._handles = []
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_hook(self._make_forward_hook(layer)))

    # ------------------------------------------------------------------ hyperparameters

    def hyperparameter(self, name: str, step: Optional[int] = None):
        """The value of a hyperparameter at ``step`` (default: the current step), validated."""
        value = self.hyperparameters[name]
        if callable(value):
            value = value(self.steps if step is None else step)
            _CHECKS[name](value)
        return value

    def _factor_step(self) -> bool:
        return self.steps % self.hyperparameter("factor_update_steps") == 0

    def _eigen_step(self) -> bool:
        return self.steps % self.hyperparameter("inv_update_steps") == 0

    # ------------------------------------------------------------------ hooks

    def _make_forward_hook(self, layer: KFACLayer):
        def hook(module, inputs, output):
            if not (module.training and torch.is_grad_enabled() and self._factor_step()):
                return
            x = inputs[0]
            with torch.no_grad(), nvtx_range(f"tritonopt/{self.algorithm}/factor_a"):
                rows, scale = layer.a_rows(x.detach())
                layer.a_batch = self._accumulate(layer.a_batch, layer.a_dim, rows, scale,
                                                 layer.a_count, layer.has_bias)
                layer.a_count += 1
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._make_grad_hook(layer))

        return hook

    def _make_grad_hook(self, layer: KFACLayer):
        def hook(grad_output):
            with torch.no_grad(), nvtx_range(f"tritonopt/{self.algorithm}/factor_g"):
                rows, scale = layer.g_rows(grad_output.detach(), self.g_batch_scale)
                layer.g_batch = self._accumulate(layer.g_batch, layer.g_dim, rows, scale,
                                                 layer.g_count, False)
                layer.g_count += 1

        return hook

    def _accumulate(self, buffer, dim, rows, scale, count, append_bias):
        if buffer is None:
            buffer = torch.empty((dim, dim), dtype=torch.float32, device=rows.device)
        # Micro-batch m (1-based) enters a running mean: decay (m-1)/m, weight 1/m.
        kfac_factor_update(buffer, rows, count / (count + 1), append_bias=append_bias,
                           scale=scale, precision=self.precision)
        return buffer

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model (no more factor statistics)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ step

    def _pending_factor_layers(self) -> list[KFACLayer]:
        return [l for l in self.layers if l.a_count and l.g_count]

    def _discard_batches(self) -> None:
        for layer in self.layers:
            layer.a_count = layer.g_count = 0

    def _reduce_factor_batches(self, layers: list[KFACLayer]) -> None:
        """Combine batch statistics across processes (nothing to do in one process)."""

    def _nonfinite(self, grads: dict[str, torch.Tensor], pending) -> bool:
        checks = [torch.isfinite(g).all() for g in grads.values()]
        for layer in pending:
            checks.append(torch.isfinite(layer.a_batch).all())
            checks.append(torch.isfinite(layer.g_batch).all())
        if not checks:
            return False
        return not bool(torch.stack(checks).all())

    @torch.no_grad()
    def step(self) -> None:
        """Fold factor statistics, refresh eigendecompositions, precondition the gradients."""
        pending = self._pending_factor_layers()
        with nvtx_range(f"tritonopt/{self.algorithm}/factor_reduce"):
            self._reduce_factor_batches(pending)
        layers_with_grad = [l for l in self.layers if l.has_grad()]
        grads = {l.name: l.grad_matrix() for l in layers_with_grad}  # [g, a] fp32, read once
        if self._nonfinite(grads, pending):
            self._discard_batches()
            if self.on_nonfinite == "raise":
                raise FloatingPointError(
                    f"{type(self).__name__}: a gradient or factor statistic holds NaN or inf; "
                    "nothing was modified"
                )
            self.skipped_steps += 1
            warnings.warn(
                f"{type(self).__name__}: a gradient or factor statistic holds NaN or inf; the "
                "step was skipped (gradients, factors and the step counter are unchanged)",
                RuntimeWarning, stacklevel=2,
            )
            return

        with nvtx_range(f"tritonopt/{self.algorithm}/factor_fold"):
            if pending:
                decay = self.hyperparameter("factor_decay")
                for layer in pending:
                    layer.a_factor = self._fold(layer.a_factor, layer.a_batch, decay)
                    layer.g_factor = self._fold(layer.g_factor, layer.g_batch, decay)
            self._discard_batches()
        if self._eigen_step():
            with nvtx_range(f"tritonopt/{self.algorithm}/eigen"):
                self._update_eigen(self.hyperparameter("damping"))
        with nvtx_range(f"tritonopt/{self.algorithm}/precondition"):
            preconditioned = self._precondition_layers(layers_with_grad, grads)
        with nvtx_range(f"tritonopt/{self.algorithm}/scale"):
            self._scale_and_write(layers_with_grad, preconditioned, grads)
        self.steps += 1

    @staticmethod
    def _fold(factor, batch, decay):
        if factor is None:  # the running average starts from the identity
            factor = torch.eye(batch.shape[0], dtype=torch.float32, device=batch.device)
        return factor.mul_(decay).add_(batch, alpha=1.0 - decay)

    # ------------------------------------------------------------------ eigen

    def _eigen_owner_layers(self) -> list[KFACLayer]:
        """The layers whose factors this process decomposes (all of them here)."""
        return self.layers

    @staticmethod
    def _finite_factors(layer: KFACLayer) -> bool:
        return (
            layer.a_factor is not None and layer.g_factor is not None
            and bool(torch.isfinite(layer.a_factor).all()) and bool(torch.isfinite(layer.g_factor).all())
        )

    def _factor_ok(self, layer: KFACLayer) -> bool:
        if layer.a_factor is None or layer.g_factor is None:
            return False
        if self._finite_factors(layer):
            return True
        message = (
            f"{type(self).__name__}: the factors of layer {layer.name!r} hold NaN or inf; its "
            "eigen update was skipped and its previous eigenbasis kept"
        )
        if self.on_nonfinite == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return False

    def _decompose(self, layers: list[KFACLayer], damping: float) -> None:
        """Eigendecompose the factors of ``layers``, batched over equal sizes, into ``layer.eigen``."""
        jobs = []  # (layer, which, matrix)
        for layer in layers:
            if self._factor_ok(layer):
                jobs.append((layer, "a", layer.a_factor))
                jobs.append((layer, "g", layer.g_factor))
        by_dim: dict[int, list] = {}
        for job in jobs:
            by_dim.setdefault(job[2].shape[0], []).append(job)
        results: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for dim, group in by_dim.items():
            stacked = torch.stack([m.to(torch.float32) for _, _, m in group])
            try:
                values, vectors = torch.linalg.eigh(stacked)
            except torch.linalg.LinAlgError:
                if self.on_nonfinite == "raise" or self._raise_on_eigh_failure:
                    raise
                warnings.warn(
                    f"{type(self).__name__}: eigh failed for factors of size {dim}; those eigen "
                    "updates were skipped", RuntimeWarning, stacklevel=3,
                )
                continue
            values = values.clamp_(min=0.0)
            for i, (layer, which, _) in enumerate(group):
                # eigh returns column-major eigenvectors: make them contiguous once, here.
                results[(layer.name, which)] = (values[i].contiguous(), vectors[i].contiguous())
        for layer in layers:
            if (layer.name, "a") not in results or (layer.name, "g") not in results:
                continue
            da, qa = results[(layer.name, "a")]
            dg, qg = results[(layer.name, "g")]
            if self.prediv:
                layer.eigen = {"qa": qa, "qg": qg,
                               "inv_denominator": eigen_inv_denominator(dg, da, damping)}
            else:
                layer.eigen = {"qa": qa, "qg": qg, "da": da, "dg": dg}

    def _update_eigen(self, damping: float) -> None:
        self._decompose(self._eigen_owner_layers(), damping)

    # ------------------------------------------------------------------ preconditioning

    def _precondition_one(self, layer: KFACLayer, grad: torch.Tensor) -> torch.Tensor:
        eigen = layer.eigen
        if not eigen:
            return grad
        if self.prediv:
            return eigenbasis_precondition_prediv(
                grad, eigen["qa"], eigen["qg"], eigen["inv_denominator"], precision=self.precision
            )
        return eigenbasis_precondition(
            grad, eigen["qa"], eigen["da"], eigen["qg"], eigen["dg"],
            self.hyperparameter("damping"), precision=self.precision,
        )

    def _precondition_layers(self, layers: list[KFACLayer], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {layer.name: self._precondition_one(layer, grads[layer.name]) for layer in layers}

    def _scale_and_write(
        self, layers: list[KFACLayer], preconditioned: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
    ) -> None:
        if not layers:
            return
        kl_clip = self.hyperparameter("kl_clip")
        if kl_clip is None:
            nu = None
        else:
            lr = self.hyperparameter("lr")
            inner = torch.stack(
                [(preconditioned[l.name] * grads[l.name]).sum() for l in layers]
            ).sum()
            vg = inner * (lr * lr)
            nu = torch.where(
                vg == 0, torch.ones_like(vg), torch.clamp(torch.sqrt(kl_clip / vg.abs()), max=1.0)
            )
        self.last_kl_scale = nu
        for layer in layers:
            p = preconditioned[layer.name]
            layer.write_grad(p if nu is None else p * nu)

    # ------------------------------------------------------------------ memory

    def memory_usage(self) -> dict[str, int]:
        """Bytes this process holds for K-FAC: ``factors``, ``batch`` buffers, ``eigen`` data, ``total``."""
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        usage = {"factors": 0, "batch": 0, "eigen": 0}
        for layer in self.layers:
            usage["factors"] += nbytes(layer.a_factor) + nbytes(layer.g_factor)
            usage["batch"] += nbytes(layer.a_batch) + nbytes(layer.g_batch)
            usage["eigen"] += sum(nbytes(t) for t in layer.eigen.values())
        usage["total"] = sum(usage.values())
        return usage

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, include_eigen: bool = True) -> dict:
        """Steps, constant hyperparameters, factors and (by default) eigen data, per layer name.

        Callable hyperparameters are not saved (pass them again to the constructor).
        With ``include_eigen`` a resumed run equals an uninterrupted one bit for bit;
        without it, :meth:`load_state_dict` recomputes the eigen data from the factors,
        which equals the uninterrupted run only when the factors did not change since
        the last eigen update.
        """
        layers = {}
        for layer in self.layers:
            entry = {
                "a_factor": None if layer.a_factor is None else layer.a_factor.clone(),
                "g_factor": None if layer.g_factor is None else layer.g_factor.clone(),
            }
            if include_eigen:
                entry["eigen"] = {k: v.clone() for k, v in layer.eigen.items()}
            layers[layer.name] = entry
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "hyperparameters": {
                k: v for k, v in self.hyperparameters.items() if not callable(v)
            },
            "prediv": self.prediv,
            "layers": layers,
        }

    def load_state_dict(self, state_dict: dict, compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; validated before anything changes.

        Eigen data missing from ``state_dict`` are recomputed from the factors when
        ``compute_inverses`` is true.
        """
        if not isinstance(state_dict, dict) or "layers" not in state_dict or "steps" not in state_dict:
            raise ValueError("state_dict must be a dict from KFACPreconditioner.state_dict()")
        saved = state_dict["layers"]
        names = [l.name for l in self.layers]
        if sorted(saved) != sorted(names):
            raise ValueError(
                f"state_dict has layers {sorted(saved)} but this preconditioner has {sorted(names)}"
            )
        if state_dict.get("prediv", self.prediv) != self.prediv:
            raise ValueError(
                f"state_dict was saved with prediv={state_dict.get('prediv')}, this "
                f"preconditioner has prediv={self.prediv}"
            )
        for name, value in state_dict.get("hyperparameters", {}).items():
            if name not in _CHECKS:
                raise ValueError(f"state_dict has an unknown hyperparameter {name!r}")
            _CHECKS[name](value)
        for layer in self.layers:
            entry = saved[layer.name]
            if not isinstance(entry, dict):
                raise ValueError(f"state_dict layer {layer.name!r}: expected a dict, got {type(entry).__name__}")
            for key, dim in (("a_factor", layer.a_dim), ("g_factor", layer.g_dim)):
                t = entry.get(key)
                if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (dim, dim)):
                    raise ValueError(
                        f"state_dict layer {layer.name!r}: {key} has shape "
                        f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}, "
                        f"expected {(dim, dim)}"
                    )
            if "eigen" in entry:
                self._check_saved_eigen(layer, entry["eigen"])
        device = self.layers[0].weight.device
        for name, value in state_dict.get("hyperparameters", {}).items():
            if not callable(self.hyperparameters[name]):
                self.hyperparameters[name] = value
        self.steps = int(state_dict["steps"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        missing_eigen = []
        for index, layer in enumerate(self.layers):
            entry = saved[layer.name]
            for key in ("a_factor", "g_factor"):
                t = entry.get(key)
                setattr(layer, key, None if t is None else t.to(device=device, dtype=torch.float32, copy=True))
            if self._saved_eigen_usable(index, entry):
                layer.eigen = {k: v.to(device=device, dtype=torch.float32, copy=True)
                               for k, v in self._saved_eigen_kept(index, entry).items()}
            else:
                layer.eigen = {}
                missing_eigen.append(layer)
            layer.a_count = layer.g_count = 0
        if compute_inverses and self._any_process(bool(missing_eigen)):
            self._restore_eigen(missing_eigen)

    def _eigen_names(self) -> tuple[str, ...]:
        return ("qa", "qg", "inv_denominator") if self.prediv else ("qa", "qg", "da", "dg")

    def _eigen_shapes(self, layer: KFACLayer) -> list[tuple[int, ...]]:
        a, g = layer.a_dim, layer.g_dim
        if self.prediv:
            return [(a, a), (g, g), (g, a)]
        return [(a, a), (g, g), (a,), (g,)]

    def _check_saved_eigen(self, layer: KFACLayer, eigen) -> None:
        """Raise ``ValueError`` unless ``eigen`` is empty or holds this layer's eigen data."""
        if not isinstance(eigen, dict):
            raise ValueError(f"state_dict layer {layer.name!r}: eigen must be a dict, got {type(eigen).__name__}")
        if not eigen:
            return
        names = self._eigen_names()
        if set(eigen) != set(names):
            raise ValueError(
                f"state_dict layer {layer.name!r}: eigen holds {sorted(eigen)}, expected {sorted(names)} "
                f"(prediv={self.prediv})"
            )
        for name, shape in zip(names, self._eigen_shapes(layer)):
            t = eigen[name]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"state_dict layer {layer.name!r}: eigen {name!r} is {got}, expected {shape}")

    def _saved_eigen_usable(self, index: int, entry: dict) -> bool:
        """Whether the saved eigen data of layer ``index`` can be used as they are."""
        return "eigen" in entry

    def _saved_eigen_kept(self, index: int, entry: dict) -> dict:
        """The saved eigen data this process keeps for layer ``index``."""
        return entry["eigen"]

    def _any_process(self, flag: bool) -> bool:
        """``flag`` or'ed over the processes that share this preconditioner (one here)."""
        return flag

    def _restore_eigen(self, layers: list[KFACLayer]) -> None:
        self._decompose(layers, self.hyperparameter("damping"))
