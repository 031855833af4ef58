"""K-FAC's arithmetic as functions of one layer's buffers (KAISA, Pauloski et al. SC '21, sec. 2-4).

:class:`~tritonopt.optim.kfac.KFACPreconditioner` runs these in one process;
:class:`~tritonopt.dist.kaisa.KAISAPreconditioner` runs the same functions and
puts its collectives between them. Re-exported by :mod:`tritonopt.optim.functional`.

For a layer with A factor ``[a, a]`` and G factor ``[g, g]`` (see
:mod:`tritonopt.optim._kfac_layers` for the layout of ``grad``, ``[g, a]``):

===================================  ==================================================
:func:`kfac_accumulate_statistic`    micro-batch mean of ``X^T X / n`` (paper sec. 4.2)
:func:`kfac_running_average`         ``decay F + (1 - decay) F_batch`` (sec. 2.1.2)
:func:`kfac_running_averages`        the same for many factors, batched
:func:`kfac_eigendecompose`          ``eigh`` in float32, eigenvalues clamped at 0 (sec. 3.3)
:func:`kfac_inverses`                ``(F + damping I)^-1`` for the inverse method (Eq. 12-14)
:func:`kfac_eigen_data`              what a gradient worker keeps (prediv: sec. 4.4)
:func:`kfac_precondition`            ``P`` for one layer (Eq. 15-17, or Eq. 14)
:func:`kfac_precondition_layers`     the same for many layers whose buffers the caller made
:func:`kfac_inner_products`          ``<P_l, grad_l>`` in float64, per layer
:func:`kfac_inner_products_float32`  the same in float32 (a fast probe; float64 decides)
:func:`kfac_kl_clip_scale`           the KL-clip factor ``nu`` (float64) from them
:func:`kfac_scale_preconditioned`    ``nu P`` in place, the clip applied
:func:`kl_clip_scale_of_sum`         the same ``nu`` on the host, from their sum read there
:func:`all_finite`                   many finiteness checks, one host synchronisation
:func:`factor_buffer`                a ``[d, d]`` factor in the layout below
===================================  ==================================================

Factor layout. A factor (statistic buffer or running average) of ``d >= 128``
columns is the ``[:, :d]`` view of a ``[d, factor_row_stride(d)]`` buffer, its
rows padded to a multiple of 4 entries (16 bytes of float32): every row then
starts 16-byte aligned, and the factor-update and triangle-packing kernels load
it in vectors even where ``d`` is odd (a layer's input width plus its bias
column: 577, 769). The padding is zero and never enters a product; checkpoints
hold the unpadded ``[d, d]`` factors, and memory reports count the padding
(:func:`buffer_bytes`). Narrower factors (at most 64 KB) are bound by launch
latency rather than by their loads and are stored unpadded.

Eigen data, by compute method (``"eigen"`` with or without ``prediv``, ``"inverse"``):

=================  ==============================================  =========================
method             names                                           shapes
=================  ==============================================  =========================
eigen, prediv      ``qa``, ``qg``, ``inv_denominator``             ``[a,a]``, ``[g,g]``, ``[g,a]``
eigen              ``qa``, ``qg``, ``da``, ``dg``                  ``[a,a]``, ``[g,g]``, ``[a]``, ``[g]``
inverse            ``a_inv``, ``g_inv``                            ``[a,a]``, ``[g,g]``
=================  ==============================================  =========================
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping, NamedTuple, Optional, Sequence

import torch

from tritonopt._validation import FLOAT_DTYPES, check_int, dtype_names
from tritonopt.ops import (
    eigen_inv_denominator,
    eigenbasis_precondition,
    eigenbasis_precondition_prediv,
    kfac_factor_update,
)

# The functions of one layer's arithmetic, which tritonopt.optim.functional re-exports.
LAYER_FUNCTIONS = (
    "all_finite",
    "kfac_accumulate_statistic",
    "kfac_eigen_data",
    "kfac_eigendecompose",
    "kfac_inner_products",
    "kfac_inner_products_float32",
    "kfac_inverses",
    "kfac_kl_clip_scale",
    "kfac_precondition",
    "kfac_precondition_layers",
    "kfac_running_average",
    "kfac_running_averages",
    "kfac_scale_preconditioned",
    "kl_clip_scale_of_sum",
)
__all__ = sorted([
    "COMPUTE_METHODS",
    "EIGENBASIS_NAMES",
    "Decomposition",
    "buffer_bytes",
    "eigen_shapes",
    "eigenbasis_layout",
    "factor_buffer",
    "factor_row_stride",
    "finiteness_probes",
    "float32_finiteness_probe",
    "gram_finiteness_probes",
    "statistics_finiteness_probe",
    *LAYER_FUNCTIONS,
])

COMPUTE_METHODS = ("eigen", "inverse")
# The eigen data that are eigenbases, kept in eigh's column-major layout (see eigenbasis_layout).
EIGENBASIS_NAMES = ("qa", "qg")

# See "Factor layout" above: rows of factors this wide or wider are padded to a multiple of
# FACTOR_ROW_ALIGN entries.
PADDED_FACTOR_MIN_DIM = 128
FACTOR_ROW_ALIGN = 4


def factor_row_stride(dim: int) -> int:
    """The row stride of a ``[dim, dim]`` factor: ``dim``, rounded up to a multiple of 4 from 128 on."""
    check_int("dim", dim, low=0)
    if dim < PADDED_FACTOR_MIN_DIM:
        return dim
    return -(-dim // FACTOR_ROW_ALIGN) * FACTOR_ROW_ALIGN


def factor_buffer(dim: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """An uninitialised ``[dim, dim]`` factor in K-FAC's layout (zero row padding, see the module's
    docstring): the ``[:, :dim]`` view of a ``[dim, factor_row_stride(dim)]`` buffer."""
    stride = factor_row_stride(dim)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.{dtype_names(FLOAT_DTYPES)}, got {dtype!r}")
    padded = torch.empty((dim, stride), dtype=dtype, device=device)
    padded[:, dim:].zero_()
    return padded[:, :dim]


def buffer_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes ``t`` occupies, the row padding of a factor included (0 for None)."""
    if t is None:
        return 0
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) > t.shape[1]:
        return t.shape[0] * t.stride(0) * t.element_size()
    return t.numel() * t.element_size()


def _precision(precision: Optional[str]) -> dict:
    return {} if precision is None else {"precision": precision}


def _float32_products(device: torch.device):
    """Autocast off for ``device``: the inverse method's products stay float32 when a
    step runs inside the caller's ``torch.autocast`` (entered only when it is on)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class Decomposition(NamedTuple):
    """``F = vectors diag(values) vectors^T``: float32, ``values >= 0``; ``vectors`` in the
    column-major layout ``eigh`` gives them (see :func:`eigenbasis_layout`)."""

    values: torch.Tensor
    vectors: torch.Tensor


def eigen_shapes(a_dim: int, g_dim: int, method: str, prediv: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a layer's eigen data, in their storage and communication order."""
    if method == "inverse":
        return {"a_inv": (a_dim, a_dim), "g_inv": (g_dim, g_dim)}
    if prediv:
        return {"qa": (a_dim, a_dim), "qg": (g_dim, g_dim), "inv_denominator": (g_dim, a_dim)}
    return {"qa": (a_dim, a_dim), "qg": (g_dim, g_dim), "da": (a_dim,), "dg": (g_dim,)}


def finiteness_probes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float64 value per tensor that is finite exactly when every entry of the tensor is.

    The probe is the tensor's sum in float64: NaN and inf propagate into it, and
    a float64 sum of float32, float16 or bfloat16 values cannot overflow. One
    reduction per tensor, no host synchronisation.
    """
    return torch.stack([t.sum(dtype=torch.float64) for t in tensors])


def gram_finiteness_probes(statistics: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`finiteness_probes` for factor statistics, which are Gram matrices ``X^T X / n``
    (or averages of them): one float64 trace per matrix.

    The trace is finite exactly when the whole matrix is: a NaN or inf in ``X``
    reaches the diagonal, and by Cauchy-Schwarz ``|S_ij| <= max(S_ii, S_jj)``
    bounds every entry, and every partial sum of the products, by the diagonal,
    so an off-diagonal entry cannot overflow while the diagonal stays finite.
    Reads ``d`` entries of each ``d x d`` matrix instead of ``d^2``.
    """
    return torch.stack([torch.diagonal(s).sum(dtype=torch.float64) for s in statistics])


def statistics_finiteness_probe(statistics: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float64 scalar, finite when every one of the Gram matrices ``statistics`` is.

    The sum of the matrices' traces, each taken in their own dtype: a NaN or inf
    reaches it (see :func:`gram_finiteness_probes`), but a float32 trace can also
    overflow on finite entries. So a finite probe clears them all, and a caller
    that finds it not finite asks :func:`gram_finiteness_probes` (exact, one
    value per matrix) which are. One call per matrix and one to add them up.
    """
    return torch.stack([torch.trace(s) for s in statistics]).sum(dtype=torch.float64)


def float32_finiteness_probe(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float64 scalar, finite when every entry of ``tensors`` is: the sum of their float32 sums.

    NaN and inf reach it, but a float32 sum can also overflow on finite entries;
    so a finite probe clears them all, and a caller that finds it not finite asks
    :func:`all_finite` (exact, float64) which are. A third of the cost of the
    float64 sums on a CPU.
    """
    return torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum(dtype=torch.float64)


def all_finite(tensors: Sequence[Optional[torch.Tensor]]) -> list[bool]:
    """Whether each tensor is all finite (``None`` counts as finite), with one host sync."""
    present = [(i, t) for i, t in enumerate(tensors) if t is not None]
    flags = [True] * len(tensors)
    if present:
        checks = finiteness_probes([t for _, t in present]).isfinite().tolist()
        for (i, _), ok in zip(present, checks):
            flags[i] = ok
    return flags


def kfac_accumulate_statistic(
    statistic: Optional[torch.Tensor],
    rows: torch.Tensor,
    count: int,
    *,
    append_bias: bool,
    scale: float = 1.0,
    precision: Optional[str] = None,
) -> torch.Tensor:
    """Add micro-batch ``count + 1`` to the running mean of ``X^T X / n``; returns the buffer.

    ``X = scale * [rows, 1]`` with ``append_bias``, else ``scale * rows``;
    ``rows`` is ``[n, d]``. Micro-batch ``m = count + 1`` enters with weight
    ``1/m`` (decay ``(m-1)/m``), so after ``m`` calls the buffer holds the mean
    of the ``m`` micro-batch statistics, as if the factors were computed on the
    concatenated batch (paper sec. 4.2). ``statistic`` is a float32
    ``[d + append_bias, d + append_bias]`` buffer, or None to allocate one
    (:func:`factor_buffer`; its content is not read when ``count == 0``).
    ``precision``: the op's GPU matrix-unit precision (None: the op's default).
    """
    if statistic is None:
        statistic = factor_buffer(rows.shape[1] + int(append_bias), device=rows.device)
    kfac_factor_update(statistic, rows, count / (count + 1), append_bias=append_bias, scale=scale,
                       **_precision(precision))
    return statistic


def kfac_running_average(
    factor: Optional[torch.Tensor], statistic: torch.Tensor, decay: float, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``decay * factor + (1 - decay) * statistic`` in float32 (paper sec. 2.1.2).

    ``factor`` is the running average (any float dtype, read in float32; None
    before the first update, when the identity stands in for it). The result is
    written to ``out`` (float32; it may be ``statistic`` itself) or a new tensor;
    ``factor`` is never modified, so a caller can still drop the result.
    Computed as one ``torch.lerp(statistic, factor, decay)``: one pass over the
    two matrices, rounded once per entry.
    """
    return kfac_running_averages([factor], [statistic], decay, out=None if out is None else [out])[0]


def kfac_running_averages(
    factors: Sequence[Optional[torch.Tensor]],
    statistics: Sequence[torch.Tensor],
    decay: float,
    *,
    out: Optional[Sequence[torch.Tensor]] = None,
) -> list[torch.Tensor]:
    """:func:`kfac_running_average` of each pair, bit for bit, in one batched call (a step over
    many small layers is bound by the calls, not the arithmetic)."""
    if len(factors) != len(statistics):
        raise ValueError(f"got {len(factors)} factors for {len(statistics)} statistics")
    if out is not None and len(out) != len(statistics):
        raise ValueError(f"out has {len(out)} tensors for {len(statistics)} statistics")
    olds = [
        torch.eye(s.shape[0], dtype=torch.float32, device=s.device) if f is None
        else f if f.dtype == torch.float32 else f.to(torch.float32)
        for f, s in zip(factors, statistics)
    ]
    if out is None:
        results = [s.clone() for s in statistics]
    else:
        results = list(out)
        for r, s in zip(results, statistics):
            if r is not s:
                r.copy_(s)
    if results:
        # lerp(S, F, decay) = S + decay (F - S): the batched and the single op round alike.
        torch._foreach_lerp_(results, olds, decay)
    return results


def kfac_eigendecompose(factors: Sequence[torch.Tensor]) -> list[Optional[Decomposition]]:
    """The eigendecomposition of each symmetric factor, in float32, batched over equal sizes on CUDA.

    Factors are read in float32 whatever their storage dtype (paper sec. 3.3:
    ``eigh`` is unstable in half precision); eigenvalues below 0 (round-off of
    a positive semi-definite matrix) are clamped to 0; eigenvectors stay in
    ``eigh``'s column-major layout, which every holder of eigen data keeps
    (:func:`eigenbasis_layout`). An entry is None where ``torch.linalg.eigh`` failed: a
    failing batch is retried one factor at a time, so only the failing factors
    are None. Callers check finiteness first (:func:`all_finite`).
    """
    results: list[Optional[Decomposition]] = [None] * len(factors)
    by_dim: dict[int, list[int]] = {}
    for i, f in enumerate(factors):
        # CUDA decomposes a batch of small matrices in one launch; on the CPU LAPACK takes them
        # one at a time either way (the same bits), and stacking them only copies.
        key = f.shape[0] if f.device.type == "cuda" else i
        by_dim.setdefault(key, []).append(i)
    for indices in by_dim.values():
        stacked = (factors[indices[0]].to(torch.float32).unsqueeze(0) if len(indices) == 1
                   else torch.stack([factors[i].to(torch.float32) for i in indices]))
        try:
            values, vectors = torch.linalg.eigh(stacked)
            batches = [(indices, values, vectors)]
        except torch.linalg.LinAlgError:
            batches = []
            for j, i in enumerate(indices):
                try:
                    v, q = torch.linalg.eigh(stacked[j : j + 1])
                except torch.linalg.LinAlgError:
                    continue
                batches.append(([i], v, q))
        for batch_indices, values, vectors in batches:
            values = values.clamp_(min=0.0)
            for k, i in enumerate(batch_indices):
                results[i] = Decomposition(values[k], vectors[k])
    return results


def eigenbasis_layout(matrix: torch.Tensor) -> torch.Tensor:
    """A copy of the square ``matrix`` in the column-major layout ``torch.linalg.eigh`` gives its
    eigenvectors (strides ``(1, n)``).

    Every holder of an eigenbasis keeps it so, rather than copying it to row-major after each
    decomposition (a transposing copy of every factor's size): a matrix product may round a
    transposed operand differently, so ranks that received a basis must hold it in the layout
    of the rank that computed it, and of a one-process run.
    """
    n = matrix.shape[0]
    return torch.empty_strided((n, n), (1, n), dtype=matrix.dtype, device=matrix.device).copy_(matrix)


def kfac_inverses(factors: Sequence[torch.Tensor], damping: float) -> list[Optional[torch.Tensor]]:
    """``(F + damping I)^-1`` of each factor in float32, batched over equal sizes (inverse method).

    A Cholesky factorisation first; where round-off makes ``F + damping I`` not
    positive definite in float32, the inverse is taken through the
    eigendecomposition with eigenvalues clamped at 0 instead (the same
    ``F`` the eigen method uses). None where both fail.
    """
    results: list[Optional[torch.Tensor]] = [None] * len(factors)
    by_dim: dict[int, list[int]] = {}
    for i, f in enumerate(factors):
        by_dim.setdefault(f.shape[0], []).append(i)
    for dim, indices in by_dim.items():
        eye = torch.eye(dim, dtype=torch.float32, device=factors[indices[0]].device)
        stacked = (factors[indices[0]].to(torch.float32).unsqueeze(0) if len(indices) == 1
                   else torch.stack([factors[i].to(torch.float32) for i in indices]))
        cholesky, info = torch.linalg.cholesky_ex(stacked + damping * eye)
        inverses = torch.cholesky_inverse(cholesky)
        failed = info.tolist()
        fallback = [i for i, bad in zip(indices, failed) if bad]
        decompositions = dict(zip(fallback, kfac_eigendecompose([factors[i] for i in fallback])))
        for k, i in enumerate(indices):
            if not failed[k]:
                results[i] = inverses[k].contiguous()
            elif decompositions[i] is not None:
                values, vectors = decompositions[i]
                with _float32_products(vectors.device):
                    results[i] = ((vectors / (values + damping)) @ vectors.T).contiguous()
    return results


def kfac_eigen_data(
    a: Decomposition | torch.Tensor,
    g: Decomposition | torch.Tensor,
    *,
    damping: float,
    prediv: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """What a gradient worker keeps for one layer, stored in ``dtype`` (paper sec. 3.3, 4.4).

    ``a``, ``g``: the :class:`Decomposition` of each factor (eigen method), or
    the inverses ``(F + damping I)^-1`` (inverse method). With ``prediv`` the
    eigen method keeps ``D = 1 / (dG dA^T + damping)``, computed here once in
    float32 (``damping`` is then fixed until the next eigen update), instead of
    the eigenvalues. Names and shapes: :func:`eigen_shapes`.
    """
    if isinstance(a, torch.Tensor):
        data = {"a_inv": a, "g_inv": g}
    elif prediv:
        # Prepared: the eigenvalues are this module's own (no argument checks per layer).
        inv_denominator = eigen_inv_denominator.prepared(a.values.device)(g.values, a.values, damping)
        data = {"qa": a.vectors, "qg": g.vectors, "inv_denominator": inv_denominator}
    else:
        data = {"qa": a.vectors, "qg": g.vectors, "da": a.values, "dg": g.values}
    return {name: t if t.dtype == dtype else t.to(dtype) for name, t in data.items()}


def kfac_precondition(
    grad: torch.Tensor, eigen: dict[str, torch.Tensor], *, damping: float, precision: Optional[str] = None
) -> torch.Tensor:
    """The preconditioned gradient ``P`` of one layer, float32 ``[g, a]``; ``grad`` itself without eigen data.

    * eigen method (paper Eq. 15-17): ``P = QG [(QG^T grad QA) / (dG dA^T + damping)] QA^T
      = (A (x) G + damping I)^-1 grad``, with the ops
      :func:`~tritonopt.ops.eigenbasis_precondition_prediv` (``inv_denominator``
      given: ``damping`` is not read) or :func:`~tritonopt.ops.eigenbasis_precondition`;
    * inverse method (Eq. 12-14): ``P = (G + damping I)^-1 grad (A + damping I)^-1``,
      two float32 matrix products.

    Eigen data in a narrower dtype are read in float32.
    """
    return _precondition(grad, eigen, damping, precision, eigenbasis_precondition_prediv, eigenbasis_precondition)


def kfac_precondition_layers(
    grads: Mapping[int, torch.Tensor],
    eigen: Mapping[int, dict[str, torch.Tensor]],
    *,
    damping: float,
    precision: Optional[str] = None,
) -> dict[int, torch.Tensor]:
    """:func:`kfac_precondition` of every layer ``i`` of ``grads`` with ``eigen[i]``, bit for bit.

    For a caller whose tensors are its own: float32 ``[g, a]`` gradients and the eigen data of
    :func:`kfac_eigen_data`, all on one device. The preconditioning ops run prepared
    (:meth:`~tritonopt._ops._registry.Op.prepared`): their backend is chosen once and their
    argument checks are skipped, which an optimizer's step over many small layers notices.
    """
    if not grads:
        return {}
    device = next(iter(grads.values())).device
    prediv_op, eigen_op = eigenbasis_precondition_prediv.prepared(device), eigenbasis_precondition.prepared(device)
    return {i: _precondition(grad, eigen[i], damping, precision, prediv_op, eigen_op) for i, grad in grads.items()}


def _precondition(grad, eigen, damping, precision, prediv_op, eigen_op) -> torch.Tensor:
    if not eigen:
        return grad
    if "a_inv" in eigen:
        with _float32_products(grad.device):
            return eigen["g_inv"].to(torch.float32) @ grad @ eigen["a_inv"].to(torch.float32)
    # Every argument by position: a prepared op then skips matching them to its signature.
    given = () if precision is None else (precision,)
    if "inv_denominator" in eigen:
        return prediv_op(grad, eigen["qa"], eigen["qg"], eigen["inv_denominator"], *given)
    return eigen_op(grad, eigen["qa"], eigen["da"], eigen["qg"], eigen["dg"], damping, *given)


def kfac_inner_products(preconditioned: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``<P_l, grad_l>`` for each layer, float64 ``[L]``.

    Accumulated in float64, where products of float32 values cannot overflow:
    an entry is finite exactly when both its layer's ``P`` and ``grad`` are.
    """
    _check_layer_pairs(preconditioned, grads)
    return torch.stack([
        torch.dot(p.reshape(-1).to(torch.float64), g.reshape(-1).to(torch.float64))
        for p, g in zip(preconditioned, grads)
    ])


def kfac_inner_products_float32(preconditioned: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``<P_l, grad_l>`` for each layer, float32 ``[L]``, as kfac-pytorch computes its KL clip's sum.

    One float32 dot product per layer. An entry is not finite when its layer's
    ``P`` or ``grad`` is, but also when a product overflows float32 on finite
    entries: a caller that finds one not finite asks :func:`kfac_inner_products`
    (float64, exact) for the sum and for which tensors are at fault.
    """
    _check_layer_pairs(preconditioned, grads)
    for layer, (p, g) in enumerate(zip(preconditioned, grads)):
        if p.dtype != torch.float32 or g.dtype != torch.float32:
            raise TypeError(f"layer {layer}: P and grad must be float32, got {p.dtype} and {g.dtype}")
    return torch.stack([torch.dot(p.reshape(-1), g.reshape(-1)) for p, g in zip(preconditioned, grads)])


def _check_layer_pairs(preconditioned: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    if len(preconditioned) != len(grads):
        raise ValueError(f"got {len(preconditioned)} preconditioned gradients for {len(grads)} gradients")
    if not grads:
        raise ValueError("inner products need at least one layer")
    for layer, (p, g) in enumerate(zip(preconditioned, grads)):
        if p.shape != g.shape:
            raise ValueError(f"layer {layer}: P is {tuple(p.shape)} but grad is {tuple(g.shape)}")


def kfac_scale_preconditioned(preconditioned: Sequence[torch.Tensor], nu: float) -> None:
    """``P_l *= nu`` for every layer, in place: the KL clip applied (``0 <= nu <= 1``).

    In float32, as kfac-pytorch scales, when ``nu`` is a normal float32 number;
    below that range (a huge ``P``) ``nu`` would lose its digits in float32, so
    the product is taken in float64 and rounded once.
    """
    if not 0.0 <= nu <= 1.0:
        raise ValueError(f"the KL clip's factor must lie in [0, 1], got {nu!r}")
    if not preconditioned:
        return
    if nu >= torch.finfo(torch.float32).tiny or nu == 0.0:
        torch._foreach_mul_(list(preconditioned), nu)
        return
    for p in preconditioned:
        p.copy_(p.to(torch.float64).mul_(nu))


def kfac_kl_clip_scale(inner_products: torch.Tensor, *, lr: float, kl_clip: Optional[float]) -> Optional[torch.Tensor]:
    """The KL-clip factor ``nu = min(1, sqrt(kl_clip / |lr^2 sum_l <P_l, grad_l>|))``, a float64 scalar tensor.

    ``inner_products`` come from :func:`kfac_inner_products`. ``nu = 1`` when
    their sum (or ``lr``) is 0; None when ``kl_clip`` is None (no clipping).
    ``lr`` divides outside the square root, so a huge but finite gradient gets a
    tiny ``nu`` rather than an infinite sum (which would make ``nu`` 0 and the
    update 0, or NaN). ``nu`` stays on the device: no host synchronisation.
    Applying it, ``nu P``, is the caller's.
    """
    if kl_clip is None:
        return None
    inner = inner_products.sum().abs()
    if lr == 0:
        return torch.ones_like(inner)
    return torch.where(inner == 0, torch.ones_like(inner), torch.clamp(torch.sqrt(kl_clip / inner) / lr, max=1.0))


def kl_clip_scale_of_sum(inner_sum: float, *, lr: float, kl_clip: Optional[float]) -> Optional[float]:
    """:func:`kfac_kl_clip_scale` for a step that reads ``sum_l <P_l, grad_l>`` on the host anyway.

    The same ``nu = min(1, sqrt(kl_clip / |inner_sum|) / lr)`` (1 when the sum or ``lr`` is 0,
    None without ``kl_clip``) in IEEE float64 arithmetic, without the half-dozen device
    operations on one scalar. Python's ``sqrt`` is correctly rounded, as CUDA's is; torch's
    vectorised CPU ``sqrt`` may miss by one unit in the last place, so the two ``nu`` can differ
    by a few units of float64's last place, which moves ``nu P`` rounded to float32 only where
    ``nu P`` lies within about ``2**-50`` (relative) of a float32 rounding boundary.
    """
    if kl_clip is None:
        return None
    inner = abs(inner_sum)
    if lr == 0 or inner == 0:
        return 1.0
    return min(math.sqrt(kl_clip / inner) / lr, 1.0)
