"""The momentum-SGD update of one flat parameter buffer in a single pass (the DSP stage update).

DSP updates each stage's weights right after that stage's own backward (Xu et
al., CVPR 2020, sec. 3.3), with SGD or momentum SGD (sec. 2, 4; the
experiments use momentum 0.9, sec. 5). The update runs at the current weights
with a stale gradient, so nothing but ``w``, ``g`` and the momentum buffer
enters it. Math, element-wise, exactly ``torch.optim.SGD`` (the algorithm its documentation states)::

    d   = -g if maximize else g                              (fp32)
    d   = d + weight_decay * w                               if weight_decay != 0
    buf = d                                                  first step
    buf = momentum * buf + (1 - dampening) * d               later steps     } if momentum != 0
    d   = d + momentum * buf  (nesterov)  or  buf                            }
    w   = w - lr * d

Layout: ``param`` (float32) and ``momentum_buffer`` (float32) are updated in
place; ``grad`` is float32, float16 or bfloat16 (upcast after the load); all
three contiguous with the same number of elements, read as flat vectors.

GPU design: one program per ``BLOCK`` elements; ``w``, ``g`` and ``buf`` are
read once and ``w``, ``buf`` written once: ``16 + sizeof(g)`` bytes per
element (20 in fp32), against about 44 for ``torch.optim.SGD``'s unfused
sequence (weight decay add, ``mul_``, ``add_``, parameter ``add_``, each a pass
over memory). The options that change the arithmetic's structure (weight
decay, momentum, first step, Nesterov, maximize) are compile-time flags; the
rates are runtime scalars, so a learning-rate schedule never recompiles. The
launcher passes the largest power of two dividing ``n`` (``N_ALIGN``): Triton
only knows whether ``n`` is a multiple of 16, and a flat buffer of ResNet-18's
11,689,512 parameters (a multiple of 8) would otherwise load one element at a
time, because the tail mask could start anywhere.
"""

from __future__ import annotations

import contextlib

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import aligned_block, alignment


def _sgd_configs():
    return [triton.Config({"BLOCK": block}, num_warps=w) for block, w in ((1024, 4), (2048, 4), (4096, 8), (8192, 8))]


@autotune(
    _sgd_configs,
    key=["n_bucket", "HAS_WEIGHT_DECAY", "HAS_MOMENTUM", "FIRST_STEP", "NESTEROV"],
    restore_value=["param_ptr", "buf_ptr"],
)
@jit
def _sgd_momentum_kernel(
    param_ptr,  # [n] fp32, updated in place
    grad_ptr,  # [n] fp32/fp16/bf16
    buf_ptr,  # [n] fp32 momentum buffer, updated in place (unused without momentum)
    n,
    lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    n_bucket,  # next power of two of n: autotune key only
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    N_ALIGN: tl.constexpr,  # a power of two dividing n
    BLOCK: tl.constexpr,
):
    offs, mask = aligned_block(n, N_ALIGN, BLOCK)
    w = tl.load(param_ptr + offs, mask=mask, other=0.0)
    d = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        d = -d
    if HAS_WEIGHT_DECAY:
        d = d + weight_decay * w
    if HAS_MOMENTUM:
        if FIRST_STEP:
            buf = d
        else:
            buf = tl.load(buf_ptr + offs, mask=mask, other=0.0)
            buf = buf * momentum + one_minus_dampening * d
        tl.store(buf_ptr + offs, buf, mask=mask)
        if NESTEROV:
            d = d + momentum * buf
        else:
            d = buf
    tl.store(param_ptr + offs, w - lr * d, mask=mask)


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def sgd_momentum_step_triton(
    param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
) -> None:
    """Launch the fused update; arguments already validated (see ``tritonopt._ops.sgd_momentum``)."""
    n = param.numel()
    if n == 0:
        return
    has_momentum = momentum != 0.0
    buf = momentum_buffer if has_momentum else param  # never touched without momentum
    grid = lambda meta: (cdiv(n, meta["BLOCK"]),)  # noqa: E731
    with _device_guard(param):
        _sgd_momentum_kernel[grid](
            param, grad, buf, n, lr, momentum, 1.0 - dampening, weight_decay, next_power_of_2(n),
            HAS_WEIGHT_DECAY=weight_decay != 0.0, HAS_MOMENTUM=has_momentum,
            FIRST_STEP=first_step, NESTEROV=nesterov, MAXIMIZE=maximize, N_ALIGN=alignment(n),
        )


def sgd_momentum_step_reference(
    param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
) -> None:
    """Plain PyTorch, the operations of ``torch.optim.SGD``'s single-tensor step in its order;
    same arguments as :func:`sgd_momentum_step_triton`."""
    d = grad.to(torch.float32)
    if maximize:
        d = -d
    if weight_decay != 0.0:
        d = d.add(param, alpha=weight_decay)
    if momentum != 0.0:
        if first_step:
            momentum_buffer.copy_(d)
        else:
            momentum_buffer.mul_(momentum).add_(d, alpha=1.0 - dampening)
        d = d.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(d, alpha=-lr)
