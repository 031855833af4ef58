"""Lanczos with full re-orthogonalisation, Ritz selection and Hessian-vector products (FOSI's ESE stage).

Algorithm 1 of Gu et al. (FOSI's extreme spectrum estimation), written once
for a row-sharded basis so the single-process and the distributed run
(:mod:`tritonopt.dist.lanczos`, Algorithm 2) share every line:

    D[0] = v1 / ||v1||,  v1 ~ N(0, I) from a seeded generator (identical on every rank)
    for i in 0..m-1:
        v      = D[i]                        (all_gather of the row shards)
        h      = H v                         (hvp, full length on every rank)
        B[i,i] = h . v                       (float64)
        if i == m-1: stop                    (lines 7-12 would write past the end)
        h      = h - D^T (D h), passes times (rows 0..i; Gram-Schmidt op per shard,
                                              all_reduce of the coefficients between halves)
        beta   = sqrt(all_reduce(||h_shard||^2))
        if beta <= breakdown_rtol * ||H v||: stop (invariant subspace found)
        B[i+1,i] = B[i,i+1] = beta;  D[i+1] = h / beta

Host synchronisation: one per iteration (``beta``, ``||H v||`` and the
finiteness of ``h`` are read together: the breakdown test needs them on the
host), plus one at the end for the diagonal of ``B``, which stays on the
device meanwhile.

Ritz pairs: ``eigh(B)``; the ``l`` smallest and ``k`` largest eigenvalues (in
that, ascending, order) and their vectors ``U_sel^T D``. Pairs with
``|lambda| <= ritz_rtol * max|u|`` are dropped (their inverse would blow up the
Newton step; the base optimizer handles those directions instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tritonopt._validation import check_int
from tritonopt.optim._blocks import zeros_with_aligned_rows
from tritonopt.optim._sharding import as_like, is_sharded, local_tensor
from tritonopt.ops import gram_schmidt_project

HVP = Callable[[torch.Tensor], torch.Tensor]

__all__ = [
    "LanczosResult",
    "RitzSelection",
    "DIFFERENCE_SCHEMES",
    "DifferenceHVP",
    "check_lanczos_arguments",
    "default_breakdown_rtol",
    "default_lanczos_iters",
    "difference_step",
    "extreme_ritz",
    "lanczos",
    "lanczos_loop",
    "make_hvp",
    "ritz_vectors",
    "select_ritz",
    "start_vector",
]


def default_lanczos_iters(k: int, l: int, n: int) -> int:
    """``m = max(4 (k + l), ceil(2 ln n))`` clamped to ``[1, n]`` (Gu et al. sec. II-B)."""
    m = max(4 * (k + l), math.ceil(2.0 * math.log(max(n, 2))))
    return max(1, min(m, n))


def default_breakdown_rtol(dtype: torch.dtype) -> float:
    return 1e3 * torch.finfo(dtype).eps


@dataclass
class LanczosResult:
    """``basis``: ``[steps, n_c]`` rows of D (this rank's columns); ``tridiag``: ``[steps, steps]`` float64 (CPU)."""

    basis: torch.Tensor
    tridiag: torch.Tensor
    steps: int
    breakdown: bool


def start_vector(n: int, seed: int) -> torch.Tensor:
    """The unit Gaussian start vector (float64, CPU), identical for a given ``(n, seed)``."""
    gen = torch.Generator().manual_seed(int(seed))
    v = torch.randn(n, generator=gen, dtype=torch.float64)
    return v / torch.linalg.vector_norm(v)


def lanczos_loop(
    hvp: HVP,
    n: int,
    num_iters: int,
    *,
    shard_start: int,
    shard_len: int,
    gather: Callable[[torch.Tensor], torch.Tensor],
    project: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    breakdown_rtol: float,
    first: Optional[torch.Tensor] = None,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    counted: Optional[torch.Tensor] = None,
) -> LanczosResult:
    """Algorithm 1/2 on the row shard ``[shard_start, shard_start + shard_len)`` of the padded vector.

    ``gather(shard) -> padded full vector``; ``project(D, h_shard, rows) -> (h_shard, ||h||^2)``
    with every needed reduction done inside (identity / all_reduce).

    Parameters sharded over ranks (each rank holds its own coordinates of every
    vector, ``hvp`` maps them to its own coordinates of ``H v``): ``first`` is
    this rank's entries of the start vector, ``project`` returns this rank's
    part of ``||h||^2``, ``reduce`` sums a small float64 tensor over the ranks,
    and ``counted`` (float64, 1 or 0 per coordinate, None: all 1) makes a
    coordinate that several ranks hold count once. The rank's parts of ``B[i,i]``,
    of ``||h||^2``, of ``||H v||^2`` and its count of non-finite entries then
    travel in one ``reduce`` per iteration, so every rank takes the same decisions.

    Raises:
        FloatingPointError: a Hessian-vector product or the residual norm is not finite.
    """
    basis = zeros_with_aligned_rows(num_iters, shard_len, dtype, device)
    diagonal = torch.zeros(num_iters, dtype=torch.float64, device=device)  # B[i, i], read once at the end
    off_diagonal: list[float] = []
    padded = max(n, shard_start + shard_len)
    if first is None:
        first = torch.zeros(padded, dtype=torch.float64)
        first[:n] = start_vector(n, seed)
        first = first[shard_start : shard_start + shard_len]
    basis[0] = first.to(device=device, dtype=dtype)
    steps, breakdown = num_iters, False
    h_full = torch.zeros(padded, dtype=dtype, device=device)
    for i in range(num_iters):
        v = gather(basis[i])[:n]
        h = hvp(v).to(device=device, dtype=dtype)
        if h.shape != (n,):
            raise ValueError(f"hvp must return a vector of {n} entries, got shape {tuple(h.shape)}")
        h64 = h.double()
        counted_h = h64 if counted is None else h64 * counted
        diagonal[i] = torch.dot(counted_h, v.double())
        if i == num_iters - 1:
            if reduce is not None:
                diagonal[i] = reduce(diagonal[i : i + 1].clone())[0]
            break
        h_full[:n] = h
        h_shard, sq_norm = project(basis, h_full[shard_start : shard_start + shard_len].contiguous(), i + 1)
        # One host read per iteration: the residual norm, ||H v|| and whether H v is finite.
        if reduce is None:
            sq_beta, sq_h_norm, finite = torch.stack(
                [sq_norm.double().reshape(()), h64.dot(h64), torch.isfinite(h).all().double()]
            ).tolist()
        else:
            sums = reduce(torch.stack([diagonal[i], sq_norm.double().reshape(()), counted_h.dot(h64),
                                       (~torch.isfinite(h)).sum().double()]))
            diagonal[i] = sums[0]
            sq_beta, sq_h_norm, nonfinite = sums[1:].tolist()
            finite = float(nonfinite == 0.0)
        if finite != 1.0:
            raise FloatingPointError("the Hessian-vector product holds NaN or inf")
        beta = math.sqrt(max(sq_beta, 0.0))
        if not math.isfinite(beta):
            raise FloatingPointError("the Lanczos residual norm is not finite")
        if beta <= breakdown_rtol * math.sqrt(sq_h_norm) or beta == 0.0:
            steps, breakdown = i + 1, True
            break
        off_diagonal.append(beta)
        basis[i + 1] = h_shard / beta
    diagonal = diagonal[:steps].cpu()
    if not bool(torch.isfinite(diagonal).all()):
        raise FloatingPointError("the Hessian-vector product holds NaN or inf")
    tridiag = torch.diag(diagonal)
    if steps > 1:
        betas = torch.tensor(off_diagonal[: steps - 1], dtype=torch.float64)
        tridiag += torch.diag(betas, 1) + torch.diag(betas, -1)
    return LanczosResult(basis[:steps], tridiag, steps, breakdown)


def check_lanczos_arguments(n, num_iters, dtype) -> None:
    """``n`` and ``num_iters`` ints >= 1, ``dtype`` float32 or float64 (the checks of every Lanczos entry)."""
    check_int("n", n, low=1)
    check_int("num_iters", num_iters, low=1)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def lanczos(
    hvp: HVP,
    n: int,
    num_iters: int,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    passes: int = 2,
    seed: int = 0,
    breakdown_rtol: Optional[float] = None,
) -> LanczosResult:
    """Single-process Lanczos with full re-orthogonalisation (Gu et al. Alg. 1).

    Args:
        hvp: ``v -> H v`` on length-``n`` vectors (``v`` is given in ``dtype``;
            the result is cast back to ``dtype``).
        n: problem size; ``num_iters`` (``m``) is clamped to ``n``.
        dtype: float64 (the FOSI reference) or float32 (use ``passes=2``).
        passes: Gram-Schmidt rounds per iteration (1 = CGS as in the paper, 2 = CGS2).
        seed: seeds the start vector.
        breakdown_rtol: stop when ``beta <= breakdown_rtol * ||H v||``
            (default ``1000 eps(dtype)``).
    """
    check_lanczos_arguments(n, num_iters, dtype)
    device = torch.device(device)

    def project(basis, h, rows):
        h, _, sq_norm = gram_schmidt_project(basis, h, rows, passes)
        return h, sq_norm

    return lanczos_loop(
        hvp, n, min(num_iters, n), shard_start=0, shard_len=n, gather=lambda x: x,
        project=project, dtype=dtype, device=device, seed=seed,
        breakdown_rtol=default_breakdown_rtol(dtype) if breakdown_rtol is None else breakdown_rtol,
    )


@dataclass
class RitzSelection:
    """The selected Ritz pairs of a tridiagonal ``B`` (see :func:`extreme_ritz`).

    ``values``: ``[r]`` float64, the ``l`` smallest then the ``k`` largest kept;
    ``vectors``: ``[steps, r]`` float64, their eigenvectors of ``B`` (``U_sel``);
    ``scale``: the largest ``|u|`` over every eigenvalue of ``B`` (0 for an empty ``B``).
    """

    values: torch.Tensor
    vectors: torch.Tensor
    scale: float


def extreme_ritz(tridiag: torch.Tensor, k: int, l: int, ritz_rtol: float = 1e-6) -> RitzSelection:
    """``eigh(B)``; the ``l`` smallest then ``k`` largest Ritz values, with their vectors and the spectrum's scale.

    Fewer than ``k + l`` are returned when Lanczos stopped early or values are
    too close to zero (``|lambda| <= ritz_rtol * max|u|``, or not finite).
    """
    values, vectors = torch.linalg.eigh(tridiag.double())
    steps = values.shape[0]
    k_kept = min(k, steps)
    l_kept = min(l, steps - k_kept)
    selected = list(range(l_kept)) + list(range(steps - k_kept, steps))
    chosen = values[selected]
    scale = float(values.abs().max()) if steps else 0.0
    keep = torch.isfinite(chosen) & (chosen.abs() > max(ritz_rtol * scale, 1e-300))
    index = torch.tensor(selected, dtype=torch.long)[keep]
    return RitzSelection(values[index], vectors[:, index], scale)


def select_ritz(
    tridiag: torch.Tensor, k: int, l: int, ritz_rtol: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues [r], U_sel [steps, r])`` of :func:`extreme_ritz`."""
    selection = extreme_ritz(tridiag, k, l, ritz_rtol)
    return selection.values, selection.vectors


def ritz_vectors(basis: torch.Tensor, u_selected: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``U_sel^T D`` (``[r, n_c]``, contiguous, in ``dtype``) for this rank's columns of D."""
    return (u_selected.to(device=basis.device, dtype=basis.dtype).T @ basis).to(dtype).contiguous()


def make_hvp(
    params: Sequence[torch.Tensor],
    loss_fn: Callable[[], torch.Tensor],
    dtype: Optional[torch.dtype] = None,
) -> HVP:
    """Hessian-vector products of ``loss_fn()`` w.r.t. ``params`` by double backward.

    ``loss_fn`` is evaluated once (one forward and a graph-keeping backward);
    each product is one more backward through that graph. Vectors are flat in
    ``params`` order, cast to each parameter's dtype; products come back in
    ``dtype`` (default: float64 when every parameter is float64, else float32).
    DTensor parameters take and give their local parts (this rank's coordinates)
    laid end to end; their loss must be differentiable twice with respect to
    them (DTensor operations are; FSDP2's ``fully_shard`` is not).

    Scaled-dot-product attention runs its math backend here: the fused CPU and
    GPU attention kernels have no double backward. For the same reason
    ``loss_fn`` runs with ``torch.compile`` set to eager (``set_stance("force_eager")``):
    a compiled model's backward cannot be differentiated again, so the products
    come from the model's own, uncompiled code.

    Raises:
        ValueError: ``loss_fn`` does not return a scalar tensor, or it does not
            depend on any of ``params`` (a loss that closes over another model,
            or a ``fully_shard`` model, whose gradient reaches its sharded
            parameters through a reduce-scatter that has no backward).
    """
    params = list(params)
    if dtype is None:
        dtype = torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH), torch.compiler.set_stance("force_eager"):
        loss = _scalar_loss(loss_fn)
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    if all(g is None for g in grads):
        if any(is_sharded(p) for p in params):
            raise ValueError(
                "the curvature loss's gradient does not reach the optimizer's DTensor parameters by autograd: "
                "FSDP2 (fully_shard) forms it in a reduce-scatter that has no backward, so no double backward "
                "goes through it; use a gradient-difference product (hvp='central_difference')"
            )
        raise ValueError("the curvature loss does not depend on the optimizer's parameters")
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    locals_ = [local_tensor(p) for p in params]
    offsets = _offsets(locals_)

    def hvp(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(offsets[-1], dtype=dtype, device=locals_[0].device)
        if not live:
            return out
        pieces = [
            as_like(v[offsets[i] : offsets[i + 1]].view(locals_[i].shape).to(device=locals_[i].device,
                                                                                dtype=params[i].dtype), params[i])
            for i in live
        ]
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            products = torch.autograd.grad(
                [grads[i] for i in live], [params[i] for i in live], grad_outputs=pieces,
                retain_graph=True, allow_unused=True,
            )
        for i, hv in zip(live, products):
            if hv is not None:
                out[offsets[i] : offsets[i + 1]] = local_tensor(hv).reshape(-1).to(dtype)
        return out

    return hvp


def _offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    return offsets


def _scalar_loss(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    loss = loss_fn()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the curvature loss function must return a scalar tensor")
    if not loss.requires_grad:
        raise ValueError("the curvature loss does not depend on the optimizer's parameters")
    return loss


DIFFERENCE_SCHEMES = ("central", "forward")


def difference_step(scheme: str, dtype: torch.dtype, weight_norm: float) -> float:
    """The default step ``eps`` of a gradient-difference product along a unit vector.

    ``eps = c (1 + ||theta||)`` with ``c = u^(1/3)`` (central) or ``u^(1/2)``
    (forward), ``u`` the unit roundoff of ``dtype``: the step that balances the
    truncation error (``O(eps^2)`` central, ``O(eps)`` forward) against the
    gradient's rounding divided by ``eps`` (Nocedal and Wright, sec. 8.1), scaled
    with the weights so that ``theta + eps v`` still moves every coordinate the
    vector reaches (a step below ``u ||theta||`` would round away).
    """
    if scheme not in DIFFERENCE_SCHEMES:
        raise ValueError(f"scheme must be one of {DIFFERENCE_SCHEMES}, got {scheme!r}")
    if not math.isfinite(weight_norm) or weight_norm < 0:
        raise FloatingPointError("the weights' norm is not finite")
    u = torch.finfo(dtype).eps / 2
    return (u ** (1 / 3) if scheme == "central" else math.sqrt(u)) * (1.0 + weight_norm)


class DifferenceHVP:
    """Hessian-vector products of ``loss_fn()`` from differences of its gradient, for models without a double backward.

    ``H v ~ (g(theta + eps v) - g(theta - eps v)) / (2 eps)`` (``"central"``: two
    gradients per product, error ``O(eps^2)``) or ``(g(theta + eps v) - g(theta)) / eps``
    (``"forward"``: one, plus ``g(theta)`` once, error ``O(eps)``). Each gradient
    is one forward and one backward of ``loss_fn`` at the shifted weights, which
    are written into the parameters and restored exactly after it.

    Plain tensors take their gradient with ``torch.autograd.grad`` (nothing else
    is touched); DTensor parameters with ``backward()``, as FSDP2 forms a
    sharded parameter's gradient only there (in its reduce-scatter): the gradient
    each rank reads is then FSDP2's average over the ranks, so the product is
    that of the ranks' mean curvature loss, and ``backward()`` writes the
    gradient of every parameter the loss reaches. :meth:`close` (call it when
    done) gives the optimizer's parameters back the gradients they had.

    Vectors are flat in ``params`` order (DTensors: their local parts); products
    come back in ``dtype``.
    """

    def __init__(self, params: Sequence[torch.Tensor], loss_fn: Callable[[], torch.Tensor], dtype: torch.dtype,
                 *, scheme: str, eps: float):
        if scheme not in DIFFERENCE_SCHEMES:
            raise ValueError(f"scheme must be one of {DIFFERENCE_SCHEMES}, got {scheme!r}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
        self.params = list(params)
        self.loss_fn, self.dtype, self.scheme, self.eps = loss_fn, dtype, scheme, float(eps)
        self.locals = [local_tensor(p) for p in self.params]
        self.offsets = _offsets(self.locals)
        self.sharded = any(is_sharded(p) for p in self.params)
        self.saved_grads = [p.grad for p in self.params]
        self.weights = [t.detach().clone() for t in self.locals]
        self.at_weights = self._gradient(None, 0.0) if scheme == "forward" else None

    def _gradient(self, v: Optional[torch.Tensor], step: float) -> torch.Tensor:
        """The loss's gradient (flat, float64) at ``theta + step v``; the weights are restored after it."""
        try:
            if v is not None:
                with torch.no_grad():
                    for local, weight, start, stop in zip(self.locals, self.weights, self.offsets, self.offsets[1:]):
                        shift = (v[start:stop] * step).view(local.shape).to(device=local.device, dtype=local.dtype)
                        local.copy_(weight + shift)
            with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH), torch.compiler.set_stance("force_eager"):
                loss = _scalar_loss(self.loss_fn)
                if self.sharded:
                    for p in self.params:
                        p.grad = None
                    loss.backward()
                    grads = [p.grad for p in self.params]
                else:
                    grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        finally:
            with torch.no_grad():
                for local, weight in zip(self.locals, self.weights):
                    local.copy_(weight)
        if all(g is None for g in grads):
            raise ValueError("the curvature loss does not depend on the optimizer's parameters")
        out = torch.zeros(self.offsets[-1], dtype=torch.float64, device=self.locals[0].device)
        for g, start, stop in zip(grads, self.offsets, self.offsets[1:]):
            if g is not None:
                out[start:stop] = local_tensor(g).reshape(-1)
        return out

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        if self.scheme == "central":
            product = (self._gradient(v, self.eps) - self._gradient(v, -self.eps)) / (2 * self.eps)
        else:
            product = (self._gradient(v, self.eps) - self.at_weights) / self.eps
        return product.to(self.dtype)

    def close(self) -> None:
        """Give the parameters back the gradients they had before the first product."""
        for p, grad in zip(self.params, self.saved_grads):
            p.grad = grad
