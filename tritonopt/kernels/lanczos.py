"""Gram-Schmidt projection for (distributed) Lanczos: FOSI / DHO2 (Gu et al., Alg. 1 line 8, Alg. 2 lines 9-12).

Math. ``D`` is ``[m, n_c]`` row-major: row ``j`` is a Lanczos vector (or, in
DHO2, the local column shard of one). Only the first ``num_rows`` rows take
part (the vectors written so far; the rest of ``D`` is never read)::

    coef    = D[:num_rows] @ h                     (K2, "m" in the paper)
    h_orth  = h - D[:num_rows]^T @ coef            (K3)
    sq_norm = h_orth . h_orth                      (the partial ||h||^2 of Alg. 2 line 12)

``gram_schmidt_project`` runs the pair ``passes`` times (2 = CGS2: classical
Gram-Schmidt repeated once, which restores orthogonality to working precision
in fp32) and returns the summed coefficients of all passes. In a distributed
run the two halves are separate ops with an ``all_reduce`` of ``coef`` between
them (:mod:`tritonopt.dist.lanczos`).

Shapes and dtypes: ``basis`` ``[m, n_c]`` and ``h`` ``[n_c]``, both float32 or
both float64, contiguous; ``coef`` ``[num_rows]``; ``sq_norm`` a 0-d tensor;
accumulation in the input dtype.

GPU design. Both halves are memory-bound streams over ``D``: each program owns
a ``BLOCK_N`` slice of columns, keeps its slice of ``h`` in registers and walks
the ``num_rows`` rows in ``BLOCK_M``-row tiles (coalesced row reads).
* K2 writes one partial coefficient vector per program (``[programs, num_rows]``)
  which a second, tiny reduction sums: deterministic, no atomics.
* K3 reads ``coef`` once per program, rebuilds ``D^T coef`` for its slice, writes
  ``h_orth`` and a partial squared norm.
* Vector loads: every program but the last masks its columns with a bound that
  is a multiple of ``BLOCK_N``, so the loads of ``h`` are vectorised for any
  ``n_c``; the rows of ``D`` are vectorised when its row stride is a multiple
  of 16 elements (a padded leading dimension: ``D`` may be a ``[:, :n_c]`` view
  of a wider buffer).
* Both kernels are pinned per key (the partial sums depend on ``BLOCK_N``), so
  the result is the same bits in every process.
Traffic per pass: ``2 * num_rows * n_c`` elements of ``D`` (one read in each
half; a grid-wide reduction separates them, so one read is the floor only if
the two halves were one kernel, which the dependency forbids) plus ``3 n_c`` of
vector traffic.
"""

from __future__ import annotations

import contextlib

import torch

from tritonopt._runtime import autotune, candidate_configs, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import alignment
from tritonopt.kernels._tiles import column_program, load_tile

def _gs_configs():
    # (8, 2048) with 8 warps spilled on sm_90 with Triton 3.6: (4, 2048) holds half the tile.
    return [
        triton.Config({"BLOCK_M": 8, "BLOCK_N": 512}, num_warps=4),
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 1024}, num_warps=8),
        triton.Config({"BLOCK_M": 4, "BLOCK_N": 2048}, num_warps=8),
        triton.Config({"BLOCK_M": 4, "BLOCK_N": 4096}, num_warps=8),
    ]


@jit
def _coefficients_tile(basis_ptr, h_ptr, partial_ptr, pid, cols, col_bound, num_rows, stride_d,
                       BLOCK_M: tl.constexpr):
    in_cols = cols < col_bound
    h = tl.load(h_ptr + cols, mask=in_cols, other=0.0)
    for row_start in range(0, num_rows, BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        in_rows = rows < num_rows
        tile = load_tile(basis_ptr, rows.to(tl.int64), in_rows, cols, in_cols, stride_d)
        partial = tl.sum(tile * h[None, :], axis=1)
        tl.store(partial_ptr + pid * num_rows + rows, partial, mask=in_rows)


# Each program's partial sum covers its BLOCK_N columns: the reduction order
# depends on the config, so both kernels are pinned per key.
@autotune(_gs_configs, key=["cols_bucket", "rows_bucket"], pinned=True, reset_to_zero=["partial_ptr"])
@jit
def _gs_coefficients_kernel(
    basis_ptr,  # [m, n_cols], row stride stride_d (an even one keeps its loads vectorised)
    h_ptr,  # [n_cols]
    partial_ptr,  # [max_programs, num_rows] partial coefficients, output
    n_cols,
    num_rows,
    stride_d,
    cols_bucket,  # autotune keys only
    rows_bucket,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,  # a power of two dividing stride_d
):
    stride_d, pid, cols = column_program(stride_d, STRIDE_ALIGN, BLOCK_N)
    # Interior programs mask with a bound the compiler knows is a multiple of
    # BLOCK_N, so their loads stay vectorised whatever n_cols is; only the last
    # program masks with n_cols itself.
    if (pid + 1) * BLOCK_N <= n_cols:
        _coefficients_tile(basis_ptr, h_ptr, partial_ptr, pid, cols, (n_cols // BLOCK_N) * BLOCK_N,
                           num_rows, stride_d, BLOCK_M)
    else:
        _coefficients_tile(basis_ptr, h_ptr, partial_ptr, pid, cols, n_cols, num_rows, stride_d, BLOCK_M)


@jit
def _subtract_tile(basis_ptr, h_ptr, coef_ptr, out_ptr, sq_partial_ptr, pid, cols, col_bound, num_rows,
                   stride_d, BLOCK_M: tl.constexpr):
    in_cols = cols < col_bound
    h = tl.load(h_ptr + cols, mask=in_cols, other=0.0)
    projection = h * 0
    for row_start in range(0, num_rows, BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        in_rows = rows < num_rows
        coef = tl.load(coef_ptr + rows, mask=in_rows, other=0.0)
        tile = load_tile(basis_ptr, rows.to(tl.int64), in_rows, cols, in_cols, stride_d)
        projection += tl.sum(tile * coef[:, None], axis=0)
    result = h - projection
    tl.store(out_ptr + cols, result, mask=in_cols)
    tl.store(sq_partial_ptr + pid, tl.sum(result * result, axis=0))


@autotune(_gs_configs, key=["cols_bucket", "rows_bucket"], pinned=True, reset_to_zero=["sq_partial_ptr"])
@jit
def _gs_subtract_kernel(
    basis_ptr,  # [m, n_cols], row stride stride_d
    h_ptr,  # [n_cols]
    coef_ptr,  # [num_rows]
    out_ptr,  # [n_cols] h - D^T coef, output
    sq_partial_ptr,  # [max_programs] partial squared norms, output
    n_cols,
    num_rows,
    stride_d,
    cols_bucket,
    rows_bucket,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,  # a power of two dividing stride_d
):
    stride_d, pid, cols = column_program(stride_d, STRIDE_ALIGN, BLOCK_N)
    if (pid + 1) * BLOCK_N <= n_cols:  # interior: a bound known to be a multiple of BLOCK_N
        _subtract_tile(basis_ptr, h_ptr, coef_ptr, out_ptr, sq_partial_ptr, pid, cols,
                       (n_cols // BLOCK_N) * BLOCK_N, num_rows, stride_d, BLOCK_M)
    else:
        _subtract_tile(basis_ptr, h_ptr, coef_ptr, out_ptr, sq_partial_ptr, pid, cols, n_cols, num_rows,
                       stride_d, BLOCK_M)


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _grid(n_cols: int):
    return lambda meta: (cdiv(n_cols, meta["BLOCK_N"]),)


def _partial_rows(kernel, n_cols: int, num_rows: int) -> int:
    """Programs of the narrowest config ``kernel`` may run with: rows of its partial buffer."""
    key_args = {"cols_bucket": next_power_of_2(n_cols), "rows_bucket": next_power_of_2(max(num_rows, 1))}
    return cdiv(n_cols, min(c.kwargs["BLOCK_N"] for c in candidate_configs(kernel, key_args)))


def gram_schmidt_coefficients_triton(basis: torch.Tensor, h: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``basis[:num_rows] @ h`` with the Triton kernel; arguments already validated."""
    n_cols = basis.shape[1]
    if num_rows == 0 or n_cols == 0:
        return torch.zeros(num_rows, dtype=basis.dtype, device=basis.device)
    partial = torch.zeros((_partial_rows(_gs_coefficients_kernel, n_cols, num_rows), num_rows),
                          dtype=basis.dtype, device=basis.device)
    with _device_guard(basis):
        _gs_coefficients_kernel[_grid(n_cols)](
            basis, h, partial, n_cols, num_rows, basis.stride(0),
            next_power_of_2(n_cols), next_power_of_2(num_rows), STRIDE_ALIGN=alignment(basis.stride(0)),
        )
    return partial.sum(dim=0)


def gram_schmidt_subtract_triton(
    basis: torch.Tensor, h: torch.Tensor, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h - basis[:len(coef)]^T coef, ||.||^2)`` with the Triton kernel; arguments validated."""
    n_cols = basis.shape[1]
    num_rows = coef.shape[0]
    out = torch.empty_like(h)
    if n_cols == 0:
        return out, torch.zeros((), dtype=h.dtype, device=h.device)
    sq_partial = torch.zeros(_partial_rows(_gs_subtract_kernel, n_cols, num_rows), dtype=h.dtype,
                             device=h.device)
    with _device_guard(basis):
        _gs_subtract_kernel[_grid(n_cols)](
            basis, h, coef, out, sq_partial, n_cols, num_rows, basis.stride(0),
            next_power_of_2(n_cols), next_power_of_2(max(num_rows, 1)),
            STRIDE_ALIGN=alignment(basis.stride(0)),
        )
    return out, sq_partial.sum()


def gram_schmidt_project_triton(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``passes`` rounds of classical Gram-Schmidt with the Triton kernels."""
    coef_total = torch.zeros(num_rows, dtype=basis.dtype, device=basis.device)
    sq_norm = None
    for _ in range(passes):
        coef = gram_schmidt_coefficients_triton(basis, h, num_rows)
        h, sq_norm = gram_schmidt_subtract_triton(basis, h, coef)
        coef_total += coef
    return h, coef_total, sq_norm


# --------------------------------------------------------------------------- reference


def gram_schmidt_coefficients_reference(basis: torch.Tensor, h: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Plain-PyTorch ``basis[:num_rows] @ h``."""
    return basis[:num_rows] @ h


def gram_schmidt_subtract_reference(
    basis: torch.Tensor, h: torch.Tensor, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch ``h - basis[:len(coef)]^T coef`` and its squared norm."""
    out = h - coef @ basis[: coef.shape[0]]
    return out, torch.dot(out, out)


def gram_schmidt_project_reference(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch classical Gram-Schmidt, ``passes`` rounds; coefficients summed."""
    coef_total = torch.zeros(num_rows, dtype=basis.dtype, device=basis.device)
    sq_norm = torch.dot(h, h)
    for _ in range(passes):
        coef = gram_schmidt_coefficients_reference(basis, h, num_rows)
        h, sq_norm = gram_schmidt_subtract_reference(basis, h, coef)
        coef_total += coef
    return h, coef_total, sq_norm
