"""K-FAC's statistics capture: the hooks that feed A and G, and the checks of what they saw.

Hooks are objects bound to the preconditioner (not closures), so
``copy.deepcopy`` and ``pickle`` of a model together with its preconditioner
give a copy whose hooks feed the copied preconditioner. (Callable
hyperparameters must be picklable functions for ``pickle``.)
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Optional

import torch

from tritonopt._validation import FLOAT_DTYPES
from tritonopt.optim.kfac_functional import kfac_accumulate_statistic

__all__ = ["KFACStatisticsCapture"]

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


class _InputHook:
    """Forward hook of one registered layer: captures the A statistic.

    A copy (``copy.deepcopy``, ``pickle``) is bound to the copy of its
    preconditioner, or inert when the preconditioner cannot be copied.
    """

    def __init__(self, preconditioner: Optional["KFACStatisticsCapture"], index: int):
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

    def __init__(self, preconditioner: "KFACStatisticsCapture", index: int):
        self.preconditioner, self.index = preconditioner, index

    def __call__(self, grad):
        self.preconditioner.capture_output_grad(self.index, grad)


class KFACStatisticsCapture:
    """The statistics half of :class:`~tritonopt.optim.kfac_base.BaseKFACPreconditioner`.

    Its forward and output-gradient hooks add each micro-batch's A and G
    statistics to the layers' scratch buffers on factor-update steps; ``step()``
    checks what they recorded, watches for a loss scale nobody announced, and
    forgets the statistics afterwards. It uses the preconditioner's ``layers``,
    ``precision``, ``g_batch_scale``, ``grad_scaler`` and ``is_factor_step``.
    """

    def _start_capture(self) -> None:
        """Hook every layer; the first step captures if it is a factor-update step."""
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
        # Float32 norms are far within the tolerance, and the ratios are taken on the host (a few
        # calls fewer); a norm that overflows float32 gives a ratio that is not finite, left out.
        norms = torch.stack([torch.linalg.vector_norm(t) for pair in pairs for t in pair]).tolist()
        ratios = [seen / applied if applied else math.inf for seen, applied in zip(norms[::2], norms[1::2])]
        ratios = [r for r in ratios if math.isfinite(r) and r > 0]
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
