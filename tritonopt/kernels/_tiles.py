"""Tiles of a row-major matrix, as the kernels that stream one by blocks of columns take them.

FOSI's three passes and Lanczos's two Gram-Schmidt kernels give each program
``BLOCK_N`` columns of a basis whose rows start ``stride`` elements apart
(:func:`column_program`), and those kernels and the low-rank power iteration
load and store masked 2-D tiles with one pattern (:func:`load_tile`,
:func:`store_tile`). Triton inlines these helpers, so a caller compiles to the
instructions it would write itself (a few independent ones may come in another order).
"""

from __future__ import annotations

from tritonopt._runtime import jit, tl
from tritonopt.kernels._alignment import assume_multiple


@jit
def column_program(stride, STRIDE_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(stride, pid, cols)``: the row stride as the compiler sees its alignment (a multiple of the
    launcher's ``STRIDE_ALIGN``: vector loads of the rows), this program's index and its columns."""
    stride = assume_multiple(stride, STRIDE_ALIGN)
    pid = tl.program_id(0).to(tl.int64)
    return stride, pid, pid * BLOCK_N + tl.arange(0, BLOCK_N)


@jit
def load_tile(ptr, rows, row_ok, cols, col_ok, row_stride):
    """``ptr[rows[i] * row_stride + cols[j]]`` for every ``(i, j)`` where ``row_ok[i] & col_ok[j]``, else 0.

    The caller casts ``rows`` to int64 where ``rows * row_stride`` may pass 2**31.
    """
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                   other=0.0)


@jit
def store_tile(ptr, rows, row_ok, cols, col_ok, row_stride, value):
    """Writes ``value`` where :func:`load_tile` with the same arguments reads."""
    tl.store(ptr + rows[:, None] * row_stride + cols[None, :], value, mask=row_ok[:, None] & col_ok[None, :])
