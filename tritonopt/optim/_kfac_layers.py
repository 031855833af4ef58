"""How K-FAC sees a ``Linear`` or ``Conv2d`` layer: factor inputs and the 2-D gradient.

For a layer with weight ``W`` (``[g, ...]``) and optional bias, K-FAC works with

* ``grad``: ``[g, a]``, ``W.grad`` reshaped to 2-D with the bias gradient as the
  last column, so column ``j`` matches row/column ``j`` of ``A``;
* the A factor's rows ``X_a``: the layer input (Linear: ``x.reshape(-1, in)``;
  Conv2d: the unfolded patches ``[N * S, C_in * kh * kw]`` in ``(C_in, kh, kw)``
  order, identical to ``W.view(C_out, -1)``), plus an implicit column of ones
  when there is a bias;
* the G factor's rows ``X_g``: the gradient of the loss w.r.t. the layer output
  (``[n, out]`` / ``[N * S, C_out]``).

Conv2d rows are scaled by ``1 / S`` (``S = Ho * Wo``) on both sides, as the
reference implementation of KAISA does. With ``g_batch_scale``
the G rows are multiplied by the local batch size, which undoes the ``1 / n`` of a
mean-reduced loss: G then does not depend on the batch size, and a data-parallel
run equals a single-process run on the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class UnsupportedLayerError(ValueError):
    """A Linear/Conv2d variant K-FAC cannot precondition; skip it by name or type."""


def _conv_padding(module: nn.Conv2d) -> tuple[int, int]:
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0, 0)
        # "same": symmetric only when the dilated kernel has an odd extent.
        pads = []
        for k, d in zip(module.kernel_size, module.dilation):
            extent = d * (k - 1)
            if extent % 2:
                raise UnsupportedLayerError(
                    f"Conv2d with padding='same' and an even kernel extent needs asymmetric "
                    f"padding, which K-FAC's patch extraction does not support "
                    f"(kernel_size={module.kernel_size}, dilation={module.dilation})"
                )
            pads.append(extent // 2)
        return tuple(pads)
    return tuple(module.padding)


@dataclass
class KFACLayer:
    """One preconditioned layer and its K-FAC buffers (all float32)."""

    name: str
    module: nn.Module
    a_dim: int
    g_dim: int
    has_bias: bool
    # Running averages (None until the first factor update).
    a_factor: Optional[torch.Tensor] = None
    g_factor: Optional[torch.Tensor] = None
    # Mean over this step's micro-batches of X^T X / n; folded into the factors by step().
    a_batch: Optional[torch.Tensor] = None
    g_batch: Optional[torch.Tensor] = None
    a_count: int = 0
    g_count: int = 0
    # Eigen data: qa, qg always; inv_denominator with prediv, else da, dg.
    eigen: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "conv2d" if isinstance(self.module, nn.Conv2d) else "linear"

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.module.bias if self.has_bias else None

    # ------------------------------------------------------------ factor rows

    def a_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(X, scale)`` with ``X`` the rows of the A factor (without the bias column)."""
        m = self.module
        if isinstance(m, nn.Conv2d):
            if x.dim() == 3:  # unbatched input
                x = x.unsqueeze(0)
            patches = F.unfold(
                x, m.kernel_size, dilation=m.dilation, padding=_conv_padding(m), stride=m.stride
            )  # [N, C_in*kh*kw, S]
            positions = patches.shape[-1]
            rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
            return rows, 1.0 / positions
        return x.reshape(-1, x.shape[-1]), 1.0

    def g_rows(self, grad_output: torch.Tensor, g_batch_scale: bool) -> tuple[torch.Tensor, float]:
        """``(X, scale)`` with ``X`` the rows of the G factor."""
        m = self.module
        if isinstance(m, nn.Conv2d):
            if grad_output.dim() == 3:
                grad_output = grad_output.unsqueeze(0)
            batch = grad_output.shape[0]
            positions = grad_output.shape[2] * grad_output.shape[3]
            rows = grad_output.permute(0, 2, 3, 1).reshape(-1, grad_output.shape[1])
            scale = 1.0 / positions
        else:
            batch = grad_output.shape[0] if grad_output.dim() > 1 else 1
            rows = grad_output.reshape(-1, grad_output.shape[-1])
            scale = 1.0
        if g_batch_scale:
            scale *= batch
        return rows, scale

    # ------------------------------------------------------------ gradients

    def has_grad(self) -> bool:
        return self.weight.grad is not None and (not self.has_bias or self.bias.grad is not None)

    def grad_matrix(self) -> torch.Tensor:
        """``[g, a]`` float32, contiguous: weight gradient as 2-D, bias gradient last."""
        w = self.weight.grad.reshape(self.g_dim, -1).to(torch.float32)
        if self.has_bias:
            return torch.cat([w, self.bias.grad.reshape(self.g_dim, 1).to(torch.float32)], dim=1)
        return w.contiguous()

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copy a ``[g, a]`` matrix back into the weight/bias gradients (their dtypes)."""
        w_cols = self.a_dim - int(self.has_bias)
        self.weight.grad.copy_(matrix[:, :w_cols].reshape(self.weight.shape))
        if self.has_bias:
            self.bias.grad.copy_(matrix[:, w_cols].reshape(self.bias.shape))


def make_layer(name: str, module: nn.Module) -> KFACLayer:
    """A :class:`KFACLayer` for a supported module, or :class:`UnsupportedLayerError`."""
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise UnsupportedLayerError(
            f"layer {name!r} ({type(module).__name__}) is not initialised yet: run one forward "
            "pass before building the preconditioner, or skip it"
        )
    has_bias = getattr(module, "bias", None) is not None
    if isinstance(module, nn.Linear):
        return KFACLayer(name, module, module.in_features + has_bias, module.out_features, has_bias)
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise UnsupportedLayerError(
                f"layer {name!r}: Conv2d with groups={module.groups} is not supported by K-FAC "
                "(its Fisher block is not one Kronecker product); add it to skip_layers"
            )
        if module.padding_mode != "zeros":
            raise UnsupportedLayerError(
                f"layer {name!r}: Conv2d with padding_mode={module.padding_mode!r} is not "
                "supported (patches are extracted with zero padding); add it to skip_layers"
            )
        _conv_padding(module)
        kh, kw = module.kernel_size
        return KFACLayer(name, module, module.in_channels * kh * kw + has_bias, module.out_channels, has_bias)
    raise UnsupportedLayerError(
        f"layer {name!r}: K-FAC supports nn.Linear and nn.Conv2d, not {type(module).__name__}"
    )
