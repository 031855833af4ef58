"""Telling the compiler how a row stride or length is aligned, so that rows load in vectors.

Triton specialises an integer argument on divisibility by 16 and nothing finer:
a kernel launched with rows ``k = 164`` float32 entries apart knows nothing of
their 16-byte alignment and loads them one element at a time. A launcher passes
:func:`alignment` of such a size as a ``constexpr`` (one compiled variant per
power of two), and the kernel rebinds the size through :func:`assume_multiple`,
which leaves its value unchanged but lets the compiler prove the alignment; a
kernel over a flat buffer takes its block and mask from :func:`aligned_block`.
"""

from __future__ import annotations

import math

from tritonopt._runtime import jit, tl

# Sixteen elements are a 16-byte vector of the narrowest dtype a kernel streams
# (8-bit), and Triton's own specialisation stops there too.
MAX_ALIGNMENT = 16


def alignment(*sizes: int) -> int:
    """The largest power of two up to ``MAX_ALIGNMENT`` dividing every one of ``sizes``."""
    divisor = MAX_ALIGNMENT
    for size in sizes:
        divisor = math.gcd(divisor, int(size))
    return divisor


@jit
def assume_multiple(value, ALIGN: tl.constexpr):
    """``value`` itself, which the launcher guarantees is a multiple of ``ALIGN``, as the compiler sees it."""
    # Dividing and multiplying back is the identity here; the product carries
    # ALIGN's divisibility, which a hint on a scalar argument does not.
    return value // ALIGN * ALIGN


@jit
def aligned_block(n, N_ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """``(offs, mask)``: this program's ``BLOCK`` elements of a flat buffer of length ``n`` (int64 offsets),
    masked at ``n``, which the launcher guarantees is a multiple of ``N_ALIGN``: the mask changes only at
    multiples of ``N_ALIGN``, so the loads are vectors."""
    n = assume_multiple(n, N_ALIGN)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n
