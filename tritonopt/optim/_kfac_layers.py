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

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from tritonopt._validation import FLOAT_DTYPES, dtype_names


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
    """One preconditioned layer and its K-FAC buffers."""

    name: str
    module: nn.Module
    a_dim: int
    g_dim: int
    has_bias: bool
    # Running averages, in the preconditioner's factor dtype (None until the first factor update).
    a_factor: Optional[torch.Tensor] = None
    g_factor: Optional[torch.Tensor] = None
    # float32 mean over this step's micro-batches of X^T X / n; folded into the factors by step().
    a_batch: Optional[torch.Tensor] = None
    g_batch: Optional[torch.Tensor] = None
    a_count: int = 0
    g_count: int = 0
    # Micro-batches of this step that reached the layer with no rows.
    empty_batches: int = 0
    # float32 sum of this step's output-gradient rows as the hooks saw them: with a bias it
    # should equal the bias gradient, which tells an unannounced loss scale (None: not watched).
    g_sum: Optional[torch.Tensor] = None
    # Eigen data (see tritonopt.optim.kfac_functional.eigen_shapes), in the inverse dtype.
    eigen: dict = field(default_factory=dict)

    @property
    def has_statistics(self) -> bool:
        """Whether this step's forward and backward passes both reached the layer."""
        return self.a_count > 0 and self.g_count > 0

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
        w = self.weight.grad.reshape(self.g_dim, -1)
        if not self.has_bias:
            if w.dtype != torch.float32:
                w = w.to(torch.float32)
            return w if w.is_contiguous() else w.contiguous()
        parts = [w, self.bias.grad.reshape(self.g_dim, 1)]
        if w.dtype == torch.float32 and parts[1].dtype == torch.float32:
            return torch.cat(parts, dim=1)
        # cat converts to float32 on its way
        return torch.cat(parts, dim=1, out=torch.empty((self.g_dim, self.a_dim), dtype=torch.float32, device=w.device))

    def write_grad(self, matrix: torch.Tensor) -> None:
        """Copy a ``[g, a]`` matrix back into the weight/bias gradients (their dtypes)."""
        w_cols = self.a_dim - int(self.has_bias)
        weight_grad = self.weight.grad
        if weight_grad.is_contiguous():  # one copy, where reshaping the strided columns would copy twice
            weight_grad.view(self.g_dim, w_cols).copy_(matrix[:, :w_cols])
        else:
            weight_grad.copy_(matrix[:, :w_cols].reshape(weight_grad.shape))
        if self.has_bias:
            self.bias.grad.copy_(matrix[:, w_cols].reshape(self.bias.shape))


def _matches(name: str, module: nn.Module, skip: Iterable) -> bool:
    for rule in skip:
        if isinstance(rule, type):
            if isinstance(module, rule):
                return True
        elif re.search(rule, name) or re.search(rule, type(module).__name__):
            return True
    return False


def register_layers(model: nn.Module, skip_layers: Iterable[Union[str, type]] = ()) -> list[KFACLayer]:
    """A :class:`KFACLayer` for each ``nn.Linear``/``nn.Conv2d`` of ``model`` whose parameters all require grad.

    ``skip_layers`` holds regular expressions (``re.search`` on the module's
    name and on its class name) and module types. Raises
    :class:`UnsupportedLayerError` for a variant K-FAC cannot handle, and
    ``TypeError`` for parameters of a dtype the factor and preconditioning ops
    do not take (float32, float16 and bfloat16 are supported), naming the layer.
    """
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)) or _matches(name, module, skip_layers):
            continue
        params = list(module.parameters(recurse=False))
        if not params or not all(p.requires_grad for p in params):
            continue
        layer = make_layer(name, module)
        for p in params:
            if p.dtype not in FLOAT_DTYPES:
                raise TypeError(
                    f"layer {name!r} has {p.dtype} parameters: K-FAC supports {dtype_names(FLOAT_DTYPES)} "
                    "(its factors and preconditioning are computed in float32); convert the model or add "
                    "the layer to skip_layers"
                )
        layers.append(layer)
    return layers


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
