"""The FOSI update over a flat parameter buffer (FOSI eqs. 11-12 in Gu et al., sec. II-B).

Math. ``V`` is ``[r, n]`` row-major with orthonormal rows (the ``k`` largest and
``l`` smallest Ritz vectors, ``r = k + l``), ``g`` the gradient, ``w`` the
parameters, ``s`` (``[r]``) the per-direction Newton scale (``alpha / lambda``
or ``alpha / |lambda|``)::

    c   = V g                                  pass A (grid-wide reduction 1)
    q   = c                  or, with a g1 velocity ``z`` (``[r]``, coefficient space):
          z = decay * z + gain * c ;  q = z
    g2  = g - V^T c                            pass B
    d1  = -V^T (s * q)                         pass B  (Newton step in span(V))
    u   = O(g2)                                pass B  (base optimizer; updates its state)
    e   = V u                                  pass B  (grid-wide reduction 2)
    w  += d1 + b * u                           pass B
    w  -= b * V^T e                            pass C  (keeps the base step out of span(V))

so ``w_new = w + d1 + b (I - V^T V) O(g2)`` with ``b`` the base-step scale
(1 in the paper; ``clip(lambda_max / lambda_k, 1, c)`` in the FOSI reference code).

Base optimizers ``O`` (element-wise, ``u`` includes the minus sign and the rate):

* ``sgd``:        ``u = -lr g2``
* ``heavy_ball``: ``a = beta1 a + g2 ;  u = -lr a``                      (state ``a``)
* ``adam``:       ``a = beta1 a + (1-beta1) g2 ; b2 = beta2 b2 + (1-beta2) g2^2 ;
                    u = -(lr / bc1) a / (sqrt(b2) / sqrt(bc2) + eps)``     (states ``a``, ``b2``)

With ``r = 0`` passes A and C are skipped and pass B is exactly the base step.

Layout: every length-``n`` buffer is contiguous float32 (``grad`` may be
float16/bfloat16, upcast after load); ``V`` float32 ``[r, n]``.

GPU design: three passes over ``V``, because ``c`` and ``e`` are reductions over
all of ``n`` that the next element needs (two grid-wide sync points). Pass B
rebuilds ``V^T c`` and ``V^T (s q)`` from one ``[BLOCK_R, BLOCK_N]`` tile of ``V``
held in registers (``r <= 64``), runs the base optimizer on ``g2`` in registers,
and writes the per-program partial of ``e``. Traffic ~ ``3 r n + 10 n`` words
against ``~7 n`` for a plain Adam step. The small ``[r]`` algebra between the
passes stays in torch on the device (no host synchronisation).

The tile width ``BLOCK_N`` is pruned per ``BLOCK_R`` so that the basis tile
stays in registers (at most 64 elements per thread); the partial sums depend
on it, so the three kernels are pinned per key (the same bits in every
process). Every program but the last masks its columns with a bound that is a
multiple of ``BLOCK_N``, so the length-``n`` vectors are loaded with vector
instructions for any ``n``; the rows of ``V`` are, when its row stride is even
(16-byte vectors from a multiple of 4 elements; ``V`` may be a ``[:, :n]`` view
of a wider buffer): the launcher passes the stride's power-of-two divisor.
"""

from __future__ import annotations

import contextlib
import math

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton, candidate_configs
from tritonopt.kernels._alignment import alignment
from tritonopt.kernels._tiles import column_program, load_tile

BASES = ("sgd", "heavy_ball", "adam")
_BASE_CODE = {"sgd": 0, "heavy_ball": 1, "adam": 2}
MAX_RANK = 64
# Elements of the [BLOCK_R, BLOCK_N] basis tile each thread may hold in
# registers: beyond this the base kernel (tile, five [BLOCK_N] vectors and the
# products) spills on sm_90.
_TILE_ELEMENTS_PER_THREAD = 64


def _fosi_configs():
    # In order of preference: the widest tile whose basis slice fits in registers.
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w)
        for bn, w in ((2048, 8), (1024, 8), (512, 8), (512, 4), (256, 8), (256, 4), (128, 4), (64, 4))
    ]


def _fits_rank(configs, key_args):
    """Prune: the configs whose basis tile stays within the register budget at this ``BLOCK_R``."""
    budget = _TILE_ELEMENTS_PER_THREAD * 32
    return [c for c in configs if key_args["BLOCK_R"] * c.kwargs["BLOCK_N"] <= budget * c.num_warps]


def _smallest_block_n(kernel, **key_args) -> int:
    """The narrowest tile ``kernel`` may run with at this key: sizes the partial buffers."""
    return min(c.kwargs["BLOCK_N"] for c in candidate_configs(kernel, key_args))


# The partial sums over each program's columns depend on BLOCK_N: pinned per key.
@autotune(_fosi_configs, key=["n_bucket", "BLOCK_R"], prune=_fits_rank, pinned=True,
          reset_to_zero=["partial_ptr"])
@jit
def _fosi_coefficients_kernel(
    basis_ptr,  # [r, n], row stride stride_v (>= n; an even one keeps loads vectorised)
    vec_ptr,  # [n] (grad: any float dtype)
    partial_ptr,  # [max_programs, r] output
    n, r, stride_v,  # V is [r, n], its rows stride_v elements apart
    n_bucket,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,  # a power of two dividing stride_v
):
    stride_v, pid, cols = column_program(stride_v, STRIDE_ALIGN, BLOCK_N)
    if (pid + 1) * BLOCK_N <= n:  # interior: a bound known to be a multiple of BLOCK_N (vector loads)
        _coefficients_tile(basis_ptr, vec_ptr, partial_ptr, pid, cols, (n // BLOCK_N) * BLOCK_N, r,
                           stride_v, BLOCK_R)
    else:
        _coefficients_tile(basis_ptr, vec_ptr, partial_ptr, pid, cols, n, r, stride_v, BLOCK_R)


@jit
def _tile_lanes(cols, col_bound, r, BLOCK_R: tl.constexpr):
    """``(in_cols, rows, in_rows)``: the masks of a ``[BLOCK_R, len(cols)]`` tile of V at ``cols``
    (``r`` rows, columns below ``col_bound``) and its row indices."""
    in_cols = cols < col_bound
    rows = tl.arange(0, BLOCK_R)
    return in_cols, rows, rows < r


@jit
def _coefficients_tile(basis_ptr, vec_ptr, partial_ptr, pid, cols, col_bound, r, stride_v,
                       BLOCK_R: tl.constexpr):
    in_cols, rows, in_rows = _tile_lanes(cols, col_bound, r, BLOCK_R)
    x = tl.load(vec_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    tile = load_tile(basis_ptr, rows.to(tl.int64), in_rows, cols, in_cols, stride_v)
    tl.store(partial_ptr + pid * r + rows, tl.sum(tile * x[None, :], axis=1), mask=in_rows)


@autotune(
    _fosi_configs,
    key=["n_bucket", "BLOCK_R", "BASE"],
    prune=_fits_rank,
    pinned=True,
    restore_value=["param_ptr", "state_a_ptr", "state_b_ptr"],
    reset_to_zero=["partial_ptr"],
)
@jit
def _fosi_base_kernel(
    param_ptr,  # [n] fp32, updated: w += d1 + b u
    grad_ptr,  # [n]
    basis_ptr,  # [r, n] fp32, row stride stride_v
    coef_ptr,  # [r] c = V g
    newton_ptr,  # [r] s * q (the Newton coefficients, sign not applied)
    state_a_ptr,  # [n] fp32: momentum / exp_avg (unused for sgd)
    state_b_ptr,  # [n] fp32: exp_avg_sq (adam only)
    partial_ptr,  # [max_programs, r] output: partials of e = V u
    n, r, stride_v,  # V is [r, n], its rows stride_v elements apart
    lr,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    step_size,  # adam: lr / bc1
    bc2_sqrt,  # adam: sqrt(bc2)
    eps,
    base_scale,
    n_bucket,
    BASE: tl.constexpr,  # 0 sgd, 1 heavy_ball, 2 adam
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,  # a power of two dividing stride_v
):
    stride_v, pid, cols = column_program(stride_v, STRIDE_ALIGN, BLOCK_N)
    if (pid + 1) * BLOCK_N <= n:  # interior: a bound known to be a multiple of BLOCK_N (vector loads)
        _base_tile(param_ptr, grad_ptr, basis_ptr, coef_ptr, newton_ptr, state_a_ptr, state_b_ptr,
                   partial_ptr, pid, cols, (n // BLOCK_N) * BLOCK_N, r, stride_v, lr, beta1, beta2,
                   one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt, eps, base_scale, BASE, BLOCK_R)
    else:
        _base_tile(param_ptr, grad_ptr, basis_ptr, coef_ptr, newton_ptr, state_a_ptr, state_b_ptr,
                   partial_ptr, pid, cols, n, r, stride_v, lr, beta1, beta2,
                   one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt, eps, base_scale, BASE, BLOCK_R)


@jit
def _base_tile(param_ptr, grad_ptr, basis_ptr, coef_ptr, newton_ptr, state_a_ptr, state_b_ptr, partial_ptr,
               pid, cols, col_bound, r, stride_v, lr, beta1, beta2, one_minus_beta1, one_minus_beta2,
               step_size, bc2_sqrt, eps, base_scale, BASE: tl.constexpr, BLOCK_R: tl.constexpr):
    in_cols, rows, in_rows = _tile_lanes(cols, col_bound, r, BLOCK_R)
    tile = load_tile(basis_ptr, rows.to(tl.int64), in_rows, cols, in_cols, stride_v)
    coef = tl.load(coef_ptr + rows, mask=in_rows, other=0.0)
    newton = tl.load(newton_ptr + rows, mask=in_rows, other=0.0)
    g = tl.load(grad_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    g2 = g - tl.sum(tile * coef[:, None], axis=0)
    newton_step = -tl.sum(tile * newton[:, None], axis=0)

    if BASE == 2:
        a = tl.load(state_a_ptr + cols, mask=in_cols, other=0.0)
        b = tl.load(state_b_ptr + cols, mask=in_cols, other=0.0)
        a = beta1 * a + one_minus_beta1 * g2
        b = beta2 * b + one_minus_beta2 * (g2 * g2)
        tl.store(state_a_ptr + cols, a, mask=in_cols)
        tl.store(state_b_ptr + cols, b, mask=in_cols)
        u = -step_size * (a / (tl.sqrt(b) / bc2_sqrt + eps))
    elif BASE == 1:
        a = tl.load(state_a_ptr + cols, mask=in_cols, other=0.0)
        a = beta1 * a + g2
        tl.store(state_a_ptr + cols, a, mask=in_cols)
        u = -lr * a
    else:
        u = -lr * g2

    tl.store(partial_ptr + pid * r + rows, tl.sum(tile * u[None, :], axis=1), mask=in_rows)
    w = tl.load(param_ptr + cols, mask=in_cols, other=0.0)
    tl.store(param_ptr + cols, w + (newton_step + base_scale * u), mask=in_cols)


@autotune(_fosi_configs, key=["n_bucket", "BLOCK_R"], prune=_fits_rank, pinned=True,
          restore_value=["param_ptr"])
@jit
def _fosi_project_out_kernel(
    param_ptr,  # [n] fp32, updated: w -= b V^T e
    basis_ptr,  # [r, n], row stride stride_v
    coef_ptr,  # [r] e = V u
    n, r, stride_v,  # V is [r, n], its rows stride_v elements apart
    base_scale,
    n_bucket,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,  # a power of two dividing stride_v
):
    stride_v, pid, cols = column_program(stride_v, STRIDE_ALIGN, BLOCK_N)
    if (pid + 1) * BLOCK_N <= n:  # interior: a bound known to be a multiple of BLOCK_N (vector loads)
        _project_out_tile(param_ptr, basis_ptr, coef_ptr, cols, (n // BLOCK_N) * BLOCK_N, r, stride_v,
                          base_scale, BLOCK_R)
    else:
        _project_out_tile(param_ptr, basis_ptr, coef_ptr, cols, n, r, stride_v, base_scale, BLOCK_R)


@jit
def _project_out_tile(param_ptr, basis_ptr, coef_ptr, cols, col_bound, r, stride_v, base_scale,
                      BLOCK_R: tl.constexpr):
    in_cols, rows, in_rows = _tile_lanes(cols, col_bound, r, BLOCK_R)
    tile = load_tile(basis_ptr, rows.to(tl.int64), in_rows, cols, in_cols, stride_v)
    coef = tl.load(coef_ptr + rows, mask=in_rows, other=0.0)
    w = tl.load(param_ptr + cols, mask=in_cols, other=0.0)
    tl.store(param_ptr + cols, w - base_scale * tl.sum(tile * coef[:, None], axis=0), mask=in_cols)


# --------------------------------------------------------------------------- shared host math


def adam_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """``(lr / (1 - beta1^step), sqrt(1 - beta2^step))``: Adam's bias corrections."""
    return lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


def newton_coefficients(
    coef: torch.Tensor,
    newton_scale: torch.Tensor,
    g1_velocity: torch.Tensor | None,
    g1_decay: float,
    g1_gain: float,
) -> torch.Tensor:
    """``s * q`` with ``q = c`` or the updated coefficient-space velocity (updated in place)."""
    if g1_velocity is None:
        return newton_scale * coef
    g1_velocity.mul_(g1_decay).add_(coef, alpha=g1_gain)
    return newton_scale * g1_velocity


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fosi_step_triton(
    param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
    base, lr, beta1, beta2, eps, step, base_scale, g1_decay, g1_gain,
) -> None:
    """Launch the three FOSI passes; arguments already validated (see ``tritonopt._ops.fosi_step``)."""
    n = param.shape[0]
    r = basis.shape[0]
    if n == 0:
        return
    block_r = next_power_of_2(max(r, 1))
    n_bucket = next_power_of_2(n)
    # Every config at this key covers n with at least this many programs.
    max_programs = cdiv(n, min(
        _smallest_block_n(_fosi_coefficients_kernel, n_bucket=n_bucket, BLOCK_R=block_r),
        _smallest_block_n(_fosi_base_kernel, n_bucket=n_bucket, BLOCK_R=block_r, BASE=_BASE_CODE[base]),
    ))
    grid = lambda meta: (cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step) if base == "adam" else (0.0, 1.0)
    dummy = param  # never read: the BASE constexpr prunes the loads
    stride_v = basis.stride(0) if r > 0 else n
    stride_align = alignment(stride_v)
    with _device_guard(param):
        if r > 0:
            partial = torch.zeros((max_programs, r), dtype=torch.float32, device=param.device)
            _fosi_coefficients_kernel[grid](basis, grad, partial, n, r, stride_v, n_bucket, BLOCK_R=block_r,
                                            STRIDE_ALIGN=stride_align)
            coef = partial.sum(dim=0)
            newton = newton_coefficients(coef, newton_scale, g1_velocity, g1_decay, g1_gain)
        else:
            coef = newton = torch.zeros(1, dtype=torch.float32, device=param.device)
        partial_e = torch.zeros((max_programs, max(r, 1)), dtype=torch.float32, device=param.device)
        _fosi_base_kernel[grid](
            param, grad, basis if r > 0 else dummy, coef, newton,
            state_a if state_a is not None else dummy,
            state_b if state_b is not None else dummy,
            partial_e, n, r, stride_v, lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2,
            step_size, bc2_sqrt, eps, base_scale, n_bucket,
            BASE=_BASE_CODE[base], BLOCK_R=block_r, STRIDE_ALIGN=stride_align,
        )
        if r > 0:
            e = partial_e.sum(dim=0)
            _fosi_project_out_kernel[grid](param, basis, e, n, r, stride_v, base_scale, n_bucket,
                                           BLOCK_R=block_r, STRIDE_ALIGN=stride_align)


# --------------------------------------------------------------------------- reference


def base_update_reference(g2, state_a, state_b, base, lr, beta1, beta2, eps, step) -> torch.Tensor:
    """The base optimizer's step ``u = O(g2)`` (states updated in place), same formulas as the kernel."""
    if base == "adam":
        step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
        state_a.mul_(beta1).add_((1.0 - beta1) * g2)
        state_b.mul_(beta2).add_((1.0 - beta2) * (g2 * g2))
        return -step_size * (state_a / (state_b.sqrt() / bc2_sqrt + eps))
    if base == "heavy_ball":
        state_a.mul_(beta1).add_(g2)
        return -lr * state_a
    return -lr * g2


def fosi_step_reference(
    param, grad, basis, newton_scale, state_a, state_b, g1_velocity,
    base, lr, beta1, beta2, eps, step, base_scale, g1_decay, g1_gain,
) -> None:
    """Plain-PyTorch FOSI step; same contract as :func:`fosi_step_triton`."""
    g = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
    if basis.shape[0] == 0:
        u = base_update_reference(g, state_a, state_b, base, lr, beta1, beta2, eps, step)
        param.add_(torch.zeros_like(g) + base_scale * u)  # 0 + x, not x: -0 becomes +0, as it always has
        return
    coef = basis @ g
    newton = newton_coefficients(coef, newton_scale, g1_velocity, g1_decay, g1_gain)
    u = base_update_reference(g - coef @ basis, state_a, state_b, base, lr, beta1, beta2, eps, step)
    e = basis @ u
    # A small model's step is bound by its calls: x - y is x + (-y) exactly and 1 * x is x, so
    # the negation and the unit scalings are left out without changing a bit.
    scaled = u if base_scale == 1.0 else base_scale * u
    param.add_(scaled - newton @ basis)
    param.sub_(e @ basis if base_scale == 1.0 else base_scale * (e @ basis))
