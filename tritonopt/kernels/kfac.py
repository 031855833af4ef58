"""K-FAC kernels: factor update, eigenbasis preconditioning, triangle pack/unpack.

KAISA (Pauloski et al., SC '21) preconditions the gradient of each ``Linear`` /
``Conv2d`` layer with the Kronecker factors ``A`` (input second moment) and ``G``
(output-gradient second moment) of its Fisher block, through their
eigendecompositions (paper sec. 2.1, Eq. 15-17; sec. 4.3, 4.4).

Factor update (paper sec. 2.1.2, running average; K1 of the design)::

    X      = [x, 1] * scale            if append_bias, else x * scale     [n, dim]
    factor = decay * factor + (1 - decay) * X^T X / n                    [dim, dim], in place

``x`` is ``[n, in_dim]`` (float32/16/bf16, any strides), ``factor`` ``[dim, dim]``
float32 row-major with ``dim = in_dim + append_bias``; its rows may be padded
(K-FAC stores factors of 128 or more columns with a row stride rounded up to a
multiple of 4 entries, 16 bytes), and then load in vectors whatever ``dim`` is.
The bias column of ones is never materialised: the kernel substitutes it on load. GPU design: one program
per ``BLOCK x BLOCK`` tile of the **upper** triangle (``T (T + 1) / 2`` programs for
``T`` tiles per side, half the flops of the full product); each program streams
``X`` in ``BLOCK_K`` row chunks, accumulates ``X_I^T X_J`` in fp32 with ``tl.dot``,
applies the running average to the upper entries it owns and stores the tile
twice, once in place and once transposed into the lower triangle. The result is
therefore symmetric to the last bit, and depends on the upper triangle of the old
factor only (the epilogue reads whole tile rows, up to the row padding, so that
they load in vectors, and stores only the entries it owns). With ``decay == 0``
the old factor is not read (it may hold garbage).

Eigenbasis preconditioning (paper Eq. 15-17 and sec. 4.4)::

    V1 = QG^T grad QA                                   [g, a]
    V2 = V1 / (dG dA^T + damping)   or   V1 * D         (D = 1 / (dG dA^T + damping), "prediv")
    P  = QG V2 QA^T                                     = (A (x) G + damping I)^-1 grad

``grad`` is ``[g, a]`` (weight reshaped to 2-D, bias as the last column), ``qa``
``[a, a]`` and ``qg`` ``[g, g]`` hold eigenvectors in their columns, ``da``/``dg``
the eigenvalues. Four launches of one tiled GEMM kernel, transposes taken through
strides, the element-wise divide (or the multiply by ``D``) fused into the
epilogue of the second product; intermediates stay fp32 (two ``[g, a]`` buffers).
Flops: ``4 g a (g + a)``.

Precision. fp32 ``tl.dot`` on a GPU defaults to TF32 (10-bit mantissa). The
divide by ``dG dA^T + damping`` amplifies the rotated gradient by up to
``1 / damping`` in the directions of small eigenvalues, so TF32 rounding of the
inputs of the first two products becomes a relative error of order
``2^-11 * cond`` in ``P``. The kernels therefore default to ``"tf32x3"`` (three
TF32 products that recover fp32 accuracy, still on the tensor cores); ``"ieee"``
(fp32 FMA) and ``"tf32"`` can be chosen per call. Under the interpreter every
choice computes exact fp32 products.

Triangle pack/unpack (paper sec. 4.3; K4 of the design)::

    pack:   out[i*d - i*(i-1)/2 + (j - i)] = cast(scale * M[i, j])   for j >= i      [d(d+1)/2]
    unpack: M[i, j] = M[j, i] = cast(scale * packed[idx(min(i,j), max(i,j))])        [d, d]

One program per (row, column block); no index tensors (``torch.triu_indices``
would need ``2 d (d+1)/2`` int64 indices, 170 MB at ``d = 4608``). Rows of a
matrix padded like the factors load in vectors.

Reading into the row padding. Triton knows of an integer only whether it is a
multiple of 16, and a row of odd length ``dim`` masked at ``dim`` loads one entry
at a time. The launchers therefore pass ``ROW_ALIGN`` (:func:`_row_alignment`), a
power of two dividing the row stride such that every row may be read up to the
next multiple of ``ROW_ALIGN``: the kernels mask their loads there and their
stores at ``dim``, so the padding is read but never enters a stored value.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from tritonopt._runtime import autotune, cdiv, jit, next_power_of_2, tl, triton
from tritonopt.kernels._alignment import alignment, assume_multiple

PRECISIONS = ("tf32x3", "ieee", "tf32")
DEFAULT_PRECISION = "tf32x3"

# Epilogues of the GEMM kernel.
_EPILOGUE_NONE = 0
_EPILOGUE_MULTIPLY = 1  # C *= E[m, n]                (prediv)
_EPILOGUE_DIVIDE_OUTER = 2  # C /= e1[m] * e2[n] + damping


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _row_alignment(matrix: torch.Tensor) -> int:
    """``ROW_ALIGN`` for the rows of a square ``matrix``: a power of two (up to 16) dividing its
    row stride, such that every row may be read up to the next multiple of it without leaving the
    storage.

    That is the row stride's own divisor when the rows are contiguous and the storage holds the
    last row's padding (a ``[dim, stride]`` buffer's ``[:, :dim]`` view), else the divisor of both
    ``dim`` and the stride (rows read up to ``dim`` only).
    """
    dim, stride = matrix.shape[0], matrix.stride(0)
    within_rows = alignment(dim, stride)
    if dim == 0 or matrix.stride(1) != 1:
        return within_rows
    padded = alignment(stride)
    row_width = -(-dim // padded) * padded
    end = matrix.storage_offset() + (dim - 1) * stride + row_width
    fits = end * matrix.element_size() <= matrix.untyped_storage().nbytes()
    return padded if fits else within_rows


def _float32_products(device: torch.device):
    """Autocast off for ``device`` while a reference computes its float32 products.

    The factor update runs in forward and backward hooks, so it may run inside the
    caller's ``torch.autocast``, which would round the products to half precision
    (and make ``out=`` refuse the float32 factor). The check costs 0.2 us; entering
    the context 3.5 us, so it is entered only when autocast is on.
    """
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- factor update


# What compiles without spills on sm_90 (Triton 3.6 and 3.9; tests/test_sm90_compile.py):
# at most 32 accumulator elements per thread, and output tiles no larger than
# these per precision ("tf32x3" holds the split big and small operand parts
# beside the accumulator; "ieee" runs on the FMA units with its operands in
# registers, and 128 x 64 spills there).
_ACC_PER_THREAD = 32
_MAX_TILE_ELEMENTS = {"tf32x3": 128 * 64, "tf32": 128 * 64, "ieee": 64 * 64}
# Shared memory a block may use on an H100 (227 KB of the SM's 228 KB).
_SHARED_LIMIT_BYTES = 227 * 1024


def _tile_fits(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
               precision: str) -> bool:
    """Registers and shared memory of one fp32 GEMM tile config on sm_90."""
    threads = 32 * num_warps
    staged = (block_m + block_n) * block_k * 4 * num_stages  # both operands, every stage
    return (block_m * block_n <= min(_ACC_PER_THREAD * threads, _MAX_TILE_ELEMENTS[precision])
            and staged <= _SHARED_LIMIT_BYTES)


def _factor_configs():
    # In order of preference (the first that fits a key runs: the reduction order
    # over the rows of X depends on BLOCK_K and on the tile, so it is pinned).
    # Measured on sm_90: 128-wide tiles and BLOCK_K = 64 spill at every precision.
    return [
        triton.Config({"BLOCK": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK": 32, "BLOCK_K": 32}, num_warps=2, num_stages=2),
    ]


def _factor_prune(configs, key_args):
    """Tiles that fit the precision's register budget and shared memory, no wider than the factor."""
    precision = key_args["PRECISION"]
    fit = [c for c in configs if _tile_fits(c.kwargs["BLOCK"], c.kwargs["BLOCK"], c.kwargs["BLOCK_K"],
                                            c.num_warps, c.num_stages, precision)]
    narrow = [c for c in fit if c.kwargs["BLOCK"] <= max(32, key_args["dim_bucket"])]
    return narrow or fit[-1:]


@jit
def _load_columns(x_ptr, rows, cols, n_rows, in_dim, stride_xn, stride_xd, HAS_BIAS_COLUMN: tl.constexpr):
    """``X[rows, cols]`` as fp32, with column ``in_dim`` read as ones when there is a bias column."""
    in_rows = rows[:, None] < n_rows
    tile = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xn + cols[None, :].to(tl.int64) * stride_xd,
        mask=in_rows & (cols[None, :] < in_dim),
        other=0.0,
    ).to(tl.float32)
    if HAS_BIAS_COLUMN:
        tile = tl.where(in_rows & (cols[None, :] == in_dim), 1.0, tile)
    return tile


@autotune(_factor_configs, key=["dim_bucket", "rows_bucket", "PRECISION"], prune=_factor_prune,
          pinned=True, restore_value=["factor_ptr"])
@jit
def _factor_update_kernel(
    factor_ptr,  # [dim, dim] fp32, row stride stride_f (unit column stride), updated in place
    x_ptr,  # [n_rows, in_dim], any float dtype and strides
    n_rows,
    in_dim,
    dim,  # in_dim + HAS_BIAS_COLUMN
    stride_f,  # >= dim, a multiple of ROW_ALIGN
    stride_xn,
    stride_xd,
    decay,  # weight of the old factor; 0 means "do not read it"
    coeff,  # (1 - decay) * scale^2 / n_rows
    dim_bucket,  # autotune keys only
    rows_bucket,
    HAS_BIAS_COLUMN: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # divides stride_f; rows readable up to a multiple of it (_row_alignment)
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    stride_f = assume_multiple(stride_f, ROW_ALIGN)
    row_width = assume_multiple(dim + ROW_ALIGN - 1, ROW_ALIGN)  # dim rounded up to ROW_ALIGN
    # Program p -> tile (ti, tj), ti <= tj, enumerating the lower triangle (tj, ti) row by row.
    pid = tl.program_id(0)
    tj = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    tj = tl.where((tj + 1) * (tj + 2) // 2 <= pid, tj + 1, tj)  # guard against sqrt rounding
    tj = tl.where(tj * (tj + 1) // 2 > pid, tj - 1, tj)
    ti = pid - tj * (tj + 1) // 2

    rows = ti * BLOCK + tl.arange(0, BLOCK)  # factor rows = columns I of X
    cols = tj * BLOCK + tl.arange(0, BLOCK)  # factor columns = columns J of X
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, n_rows, BLOCK_K):
        x_i = _load_columns(x_ptr, k0 + ks, rows, n_rows, in_dim, stride_xn, stride_xd, HAS_BIAS_COLUMN)
        x_j = _load_columns(x_ptr, k0 + ks, cols, n_rows, in_dim, stride_xn, stride_xd, HAS_BIAS_COLUMN)
        acc += tl.dot(tl.trans(x_i), x_j, input_precision=PRECISION)

    in_bounds = (rows[:, None] < dim) & (cols[None, :] < dim)
    owned = in_bounds & (rows[:, None] <= cols[None, :])
    offsets = rows[:, None].to(tl.int64) * stride_f + cols[None, :]
    # Whole tile rows up to the row padding, so that they load in vectors (a mask at the
    # diagonal or at an odd dim would split them); the entries not owned are never stored.
    # Rows past dim (the last tile's) read row dim - 1 instead of being masked: the mask
    # costs registers that make a config spill on sm_90.
    readable = (cols[None, :] < row_width) & (decay != 0.0)
    row_offsets = tl.minimum(rows, dim - 1).to(tl.int64) * stride_f
    old = tl.load(factor_ptr + row_offsets[:, None] + cols[None, :], mask=readable, other=0.0)
    new = decay * old + coeff * acc
    tl.store(factor_ptr + offsets, new, mask=owned)
    # The same values, transposed, into the lower triangle: symmetric by construction.
    new_t = tl.trans(new)
    offsets_t = cols[:, None].to(tl.int64) * stride_f + rows[None, :]
    owned_t = (cols[:, None] < dim) & (rows[None, :] < dim) & (rows[None, :] <= cols[:, None])
    tl.store(factor_ptr + offsets_t, new_t, mask=owned_t)


def kfac_factor_update_triton(
    factor: torch.Tensor,
    x: torch.Tensor,
    decay: float,
    append_bias: bool,
    scale: float,
    precision: str = DEFAULT_PRECISION,
    *,
    block: int | None = None,
) -> None:
    """Launch the fused factor update. Arguments must already be validated.

    ``block`` forces one tile size (tests use it to exercise many tiles on tiny shapes).
    """
    n_rows, in_dim = x.shape
    dim = factor.shape[0]
    coeff = (1.0 - decay) * scale * scale / n_rows
    kernel = _factor_update_kernel
    meta = {}
    if block is not None:
        kernel = _factor_update_kernel.fn  # bypass autotune: explicit configuration
        meta = {"BLOCK": block, "BLOCK_K": min(32, max(16, block))}

    def grid(meta_):
        tiles = cdiv(dim, meta_["BLOCK"])
        return (tiles * (tiles + 1) // 2,)

    with _device_guard(factor):
        kernel[grid](
            factor, x, n_rows, in_dim, dim, factor.stride(0), x.stride(0), x.stride(1),
            float(decay), float(coeff), next_power_of_2(dim), next_power_of_2(n_rows),
            HAS_BIAS_COLUMN=bool(append_bias), PRECISION=precision, ROW_ALIGN=_row_alignment(factor),
            **meta,
        )


def kfac_factor_update_reference(
    factor: torch.Tensor, x: torch.Tensor, decay: float, append_bias: bool, scale: float
) -> None:
    """Plain-PyTorch factor update; same contract as the kernel (upper triangle mirrored)."""
    xs = x.to(torch.float32)
    if append_bias:
        xs = torch.cat([xs, xs.new_ones(xs.shape[0], 1)], dim=1)
    coeff = (1.0 - decay) * scale * scale / x.shape[0]
    with _float32_products(x.device):
        product = xs.T @ xs
    new = product * coeff if decay == 0 else decay * factor + coeff * product
    torch.where(_upper_triangle(new.shape[0], new.device), new, new.T, out=factor)


@functools.lru_cache(maxsize=16)
def _upper_triangle(dim: int, device: torch.device) -> torch.Tensor:
    """``[dim, dim]`` bool, True on and above the diagonal: the entries a factor update computes."""
    return torch.ones(dim, dim, dtype=torch.bool, device=device).triu_()


# --------------------------------------------------------------------------- preconditioning


def _gemm_configs():
    # In order of preference; the first that fits a key runs (pinned: BLOCK_K and
    # the tile decide how the products over K are grouped and rounded). Measured
    # on sm_90 by tests/test_sm90_compile.py: 128 x 128 tiles and BLOCK_K = 64
    # spill at every precision, 64 x 128 with "ieee", 32 x 32 with 2 warps with
    # "tf32x3"; _tile_fits prunes 128 x 64 for "ieee".
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=3),
    ]


def _gemm_prune(configs, key_args):
    """Tiles that fit the precision's register budget and shared memory, no wider than needed."""
    precision = key_args["PRECISION"]
    fit = [c for c in configs if _tile_fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                                            c.num_warps, c.num_stages, precision)]
    narrow = [c for c in fit if c.kwargs["BLOCK_M"] <= max(64, key_args["m_bucket"])
              and c.kwargs["BLOCK_N"] <= max(64, key_args["n_bucket"])]
    return narrow or fit[-1:]


@autotune(_gemm_configs, key=["m_bucket", "n_bucket", "k_bucket", "PRECISION"], prune=_gemm_prune,
          pinned=True)
@jit
def _gemm_epilogue_kernel(
    a_ptr, b_ptr, c_ptr,  # C[M, N] = A[M, K] @ B[K, N] (+ epilogue); C fp32
    e1_ptr, e2_ptr,  # epilogue operands (unused for EPILOGUE == 0)
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_e1m, stride_e1n,  # E [M, N] for EPILOGUE 1; e1 [M] stride for EPILOGUE 2
    stride_e2,  # e2 [N] stride for EPILOGUE 2
    damping,
    m_bucket, n_bucket, k_bucket,  # autotune keys only
    EPILOGUE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-tiles share their B column-tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(
            a_ptr + rm64[:, None] * stride_am + ks[None, :].to(tl.int64) * stride_ak,
            mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0,
        ).to(tl.float32)
        b = tl.load(
            b_ptr + ks[:, None].to(tl.int64) * stride_bk + rn64[None, :] * stride_bn,
            mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0,
        ).to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)

    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if EPILOGUE == 1:
        e = tl.load(e1_ptr + rm64[:, None] * stride_e1m + rn64[None, :] * stride_e1n, mask=mask, other=0.0)
        acc = acc * e.to(tl.float32)
    elif EPILOGUE == 2:
        e1 = tl.load(e1_ptr + rm64 * stride_e1m, mask=rm < M, other=0.0).to(tl.float32)
        e2 = tl.load(e2_ptr + rn64 * stride_e2, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc / (e1[:, None] * e2[None, :] + damping)
    tl.store(c_ptr + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn, acc, mask=mask)


def _strides(t: torch.Tensor, transpose: bool) -> tuple[int, int]:
    return (t.stride(1), t.stride(0)) if transpose else (t.stride(0), t.stride(1))


def _gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, transpose_a=False, transpose_b=False,
    epilogue=_EPILOGUE_NONE, e1=None, e2=None, damping=0.0, precision=DEFAULT_PRECISION,
    block: int | None = None,
) -> torch.Tensor:
    M, N = out.shape
    K = a.shape[0] if transpose_a else a.shape[1]
    s_am, s_ak = _strides(a, transpose_a)
    s_bk, s_bn = _strides(b, transpose_b)
    if epilogue == _EPILOGUE_MULTIPLY:
        s_e1m, s_e1n, s_e2 = e1.stride(0), e1.stride(1), 0
        e2 = e1
    elif epilogue == _EPILOGUE_DIVIDE_OUTER:
        s_e1m, s_e1n, s_e2 = e1.stride(0), 0, e2.stride(0)
    else:
        e1 = e2 = out
        s_e1m = s_e1n = s_e2 = 0
    kernel = _gemm_epilogue_kernel
    meta = {}
    if block is not None:
        kernel = _gemm_epilogue_kernel.fn
        meta = {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_K": max(16, block), "GROUP_M": 2}

    def grid(meta_):
        return (cdiv(M, meta_["BLOCK_M"]) * cdiv(N, meta_["BLOCK_N"]),)

    kernel[grid](
        a, b, out, e1, e2, M, N, K, s_am, s_ak, s_bk, s_bn, out.stride(0), out.stride(1),
        s_e1m, s_e1n, s_e2, float(damping),
        next_power_of_2(M), next_power_of_2(N), next_power_of_2(K),
        EPILOGUE=epilogue, PRECISION=precision, **meta,
    )
    return out


def eigenbasis_precondition_triton(
    grad: torch.Tensor, qa: torch.Tensor, da: torch.Tensor, qg: torch.Tensor, dg: torch.Tensor, damping: float,
    precision: str = DEFAULT_PRECISION, *, block: int | None = None,
) -> torch.Tensor:
    """``QG [(QG^T grad QA) / (dG dA^T + damping)] QA^T``, fp32 (the op ``eigenbasis_precondition``).

    Arguments must already be validated. ``block`` forces one square tile size.
    """
    return _eigenbasis_triton(grad, qa, qg, precision, block, epilogue=_EPILOGUE_DIVIDE_OUTER, e1=dg, e2=da,
                              damping=damping)


def eigenbasis_precondition_prediv_triton(
    grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, inv_denominator: torch.Tensor,
    precision: str = DEFAULT_PRECISION, *, block: int | None = None,
) -> torch.Tensor:
    """``QG [(QG^T grad QA) * inv_denominator] QA^T``, fp32 (the op ``eigenbasis_precondition_prediv``).

    Arguments must already be validated. ``block`` forces one square tile size.
    """
    return _eigenbasis_triton(grad, qa, qg, precision, block, epilogue=_EPILOGUE_MULTIPLY, e1=inv_denominator)


def _eigenbasis_triton(grad, qa, qg, precision, block, **scaling) -> torch.Tensor:
    # Four GEMMs; the second scales the rotated gradient in its epilogue (``scaling``: _gemm's).
    g_dim, a_dim = grad.shape
    first = torch.empty((g_dim, a_dim), dtype=torch.float32, device=grad.device)
    second = torch.empty_like(first)
    if g_dim == 0 or a_dim == 0:
        return second
    with _device_guard(grad):
        _gemm(qg, grad, first, transpose_a=True, precision=precision, block=block)  # QG^T grad
        _gemm(first, qa, second, precision=precision, block=block, **scaling)  # (. QA) scaled
        _gemm(second, qa, first, transpose_b=True, precision=precision, block=block)  # V2 QA^T
        _gemm(qg, first, second, precision=precision, block=block)  # QG (V2 QA^T)
    return second


def eigenbasis_precondition_reference(
    grad: torch.Tensor, qa: torch.Tensor, da: torch.Tensor, qg: torch.Tensor, dg: torch.Tensor, damping: float,
) -> torch.Tensor:
    """Plain-PyTorch eigenbasis preconditioning in float32 (paper Eq. 15-17)."""
    qa, qg = _float32(qa), _float32(qg)
    with _float32_products(grad.device):
        rotated = qg.T @ _float32(grad) @ qa
        return qg @ (rotated / (torch.outer(_float32(dg), _float32(da)) + damping)) @ qa.T


def eigenbasis_precondition_prediv_reference(
    grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, inv_denominator: torch.Tensor,
) -> torch.Tensor:
    """Plain-PyTorch eigenbasis preconditioning with the precomputed reciprocal (paper sec. 4.4), float32."""
    qa, qg = _float32(qa), _float32(qg)
    with _float32_products(grad.device):
        rotated = qg.T @ _float32(grad) @ qa
        return qg @ (rotated * _float32(inv_denominator)) @ qa.T


def _float32(t: torch.Tensor) -> torch.Tensor:
    # A preconditioner calls this per layer and step: skip the no-op conversion's dispatch.
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def eigen_inv_denominator_reference(dg: torch.Tensor, da: torch.Tensor, damping: float) -> torch.Tensor:
    """``1 / (dG dA^T + damping)``, the precomputed reciprocal of paper sec. 4.4 (fp32)."""
    return 1.0 / (torch.outer(dg.to(torch.float32), da.to(torch.float32)) + damping)


# --------------------------------------------------------------------------- triangle pack


def triu_numel(dim: int) -> int:
    return dim * (dim + 1) // 2


@jit
def _triu_pack_kernel(
    mat_ptr, out_ptr, dim, stride_r, stride_c, scale,
    BLOCK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # divides stride_r; rows readable up to a multiple of it (_row_alignment)
):
    stride_r = assume_multiple(stride_r, ROW_ALIGN)
    row_width = assume_multiple(dim + ROW_ALIGN - 1, ROW_ALIGN)  # dim rounded up to ROW_ALIGN
    row = tl.program_id(0).to(tl.int64)
    # Chunks start at the last ROW_ALIGN-aligned column at or before the diagonal,
    # and run into the row padding, so that rows load in vectors; the entries left
    # of the diagonal or right of dim are loaded but not stored.
    cols = row // ROW_ALIGN * ROW_ALIGN + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(mat_ptr + row * stride_r + cols * stride_c, mask=cols < row_width, other=0.0)
    values = values.to(tl.float32)
    start = row * dim - row * (row - 1) // 2
    tl.store(out_ptr + start + (cols - row), (values * scale).to(out_ptr.dtype.element_ty),
             mask=(cols < dim) & (cols >= row))


@jit
def _triu_unpack_kernel(
    packed_ptr, out_ptr, dim, scale,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = cols < dim
    i = tl.minimum(cols, row)
    j = tl.maximum(cols, row)
    index = i * dim - i * (i - 1) // 2 + (j - i)
    values = tl.load(packed_ptr + index, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (values * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _pack_block(dim: int) -> int:
    return min(1024, max(16, next_power_of_2(dim)))


def _pack_warps(block: int) -> int:
    """Warps for a ``block``-wide row chunk: at least four entries per thread from 128 on, so they load as vectors."""
    return min(4, max(1, block // 128))


def triu_pack_triton(matrix: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    dim = matrix.shape[0]
    out = torch.empty(triu_numel(dim), dtype=dtype, device=matrix.device)
    if dim == 0:
        return out
    block = _pack_block(dim)
    with _device_guard(matrix):
        _triu_pack_kernel[(dim, cdiv(dim, block))](
            matrix, out, dim, matrix.stride(0), matrix.stride(1), float(scale), BLOCK=block,
            ROW_ALIGN=_row_alignment(matrix), num_warps=_pack_warps(block),
        )
    return out


def triu_unpack_triton(packed: torch.Tensor, dim: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    out = torch.empty((dim, dim), dtype=dtype, device=packed.device)
    if dim == 0:
        return out
    block = _pack_block(dim)
    with _device_guard(packed):
        _triu_unpack_kernel[(dim, cdiv(dim, block))](packed, out, dim, float(scale), BLOCK=block,
                                                      num_warps=_pack_warps(block))
    return out


def triu_pack_reference(matrix: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Row-major upper triangle of ``scale * matrix`` (computed in fp32), cast to ``dtype``."""
    dim = matrix.shape[0]
    rows, cols = torch.triu_indices(dim, dim, device=matrix.device)
    return (matrix.to(torch.float32)[rows, cols] * scale).to(dtype)


def triu_unpack_reference(packed: torch.Tensor, dim: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The symmetric ``[dim, dim]`` matrix whose upper triangle is ``scale * packed``."""
    out = torch.empty((dim, dim), dtype=torch.float32, device=packed.device)
    rows, cols = torch.triu_indices(dim, dim, device=packed.device)
    values = packed.to(torch.float32) * scale
    out[rows, cols] = values
    out[cols, rows] = values
    return out.to(dtype)
