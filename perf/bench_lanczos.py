"""Benchmark the FOSI / DHO2 ops (Lanczos Gram-Schmidt projection, fused FOSI step) against their floors.

Two ops, each with the providers of ``perf/_harness.py``: the public op forced to the
Triton backend on a GPU (argument checks and dispatch included, as users call it; these ops
have no separate launcher) or the reference backend elsewhere, and the fastest eager-PyTorch
composite of the same math; and against its memory floor, the bytes it cannot avoid moving
divided by the device's measured streaming bandwidth.

``gram_schmidt_project`` (one Lanczos iteration's re-orthogonalisation, Gu et al. Alg. 1
line 8 / Alg. 2 lines 9-12), basis ``D: [m, n]``, all ``m`` rows taking part (the last and
most expensive iteration), ``passes`` rounds (2 = CGS2, the default, as in Lanczos)::

    per pass:  coef = D @ h ;  h = h - D^T coef          then  sq = h . h

* ``torch``: :func:`gram_schmidt_composite` (``mv`` + ``addmv`` per pass, cuBLAS);
* ``floor``: ``passes * (2 m + 3) * n * itemsize`` bytes. Within a pass the subtraction
  needs every coefficient, which needs all of ``h``: a grid-wide dependency, so ``D`` is
  read twice per pass; ``h`` is read by both halves and the result written once (``3 n``).
  The ``m``-sized coefficient traffic is left out.

``fosi_step`` (one FOSI-Adam update of a flat parameter vector, Gu et al. eqs. 11-12),
basis ``V: [r, n]`` with ``r = k + l`` orthonormal-ish rows::

    c = V g ; g2 = g - V^T c ; u = Adam(g2) ; e = V u ; w += b u - V^T (s c + b e)

* ``torch``: :func:`fosi_step_composite`, unfused eager ops (four reads of ``V``);
* ``floor``: ``(3 r + 10) * n * 4`` bytes. ``e`` needs ``u``, which needs ``c`` (a
  reduction over all of ``n``), and the last correction needs all of ``e``: two grid-wide
  dependencies, so ``V`` is read three times. Vector traffic: ``g`` read twice (for ``c``
  and for ``g2``), Adam's two moments read and written (``4 n``), ``w`` (or a stored ``u``)
  read and written twice (``4 n``).

The floors assume every byte comes from memory at the device's best streaming rate: the
bandwidth is the faster of a copy and a gemv read (on a CPU these read-mostly ops, built from
gemv, move bytes faster than a copy, which also reads each line it writes), and every timed
call starts with cold caches (``do_bench``'s L2 flush on a GPU; the harness's own flush on the
CPU). On the copy's rate alone, with warm caches, the CPU composites ran faster than their
"floor". A basis that fits in the GPU's L2 can still be read twice from it within one call,
and beat the floor there.

Every op is timed on the same buffers call after call (the FOSI step keeps updating ``w``
and the moments; the work per call does not change). Without a CUDA device the script says
so and times the reference path on small sizes. Results: ``lanczos.csv`` (both ops, column
``op``), ``lanczos_gram_schmidt.png`` and ``lanczos_fosi_step.png`` (GB/s against ``n``).

    python -m perf.bench_lanczos [--smoke] [--nvtx] [--dtypes fp32 fp64] [--passes 2]
                                 [--elements 1000000 50000000] [--out DIR]
    nsys profile -t nvtx,cuda python -m perf.bench_lanczos --nvtx
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_lanczos.py
    import _as_module

    _as_module.run(__file__)

import math
import sys
from functools import partial

import torch

import tritonopt
from perf import _harness as harness
from tritonopt.kernels.fosi_step import adam_scalars

CSV_STEM = "lanczos"
GS_OP = "gram_schmidt_project"
FOSI_OP = "fosi_step"
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}

GPU_ELEMENTS = (1_000_000, 5_000_000, 10_000_000, 50_000_000)
GPU_BASIS_ROWS = (24, 48, 96)  # m: Lanczos iterations (4 (k + l) with k + l up to 24)
GPU_RANKS = (8, 24)  # r = k + l
# The CPU paths are slow and not the subject: keep the CPU sweep short.
CPU_ELEMENTS = (100_000, 1_000_000)
CPU_BASIS_ROWS = (24,)
CPU_RANKS = (8, 24)
SMOKE_ELEMENTS = (20_000,)
SMOKE_BASIS_ROWS = (8,)
SMOKE_RANKS = (4,)

# Adam hyperparameters of the FOSI step (the values do not change the work).
LR, BETA1, BETA2, EPS, ADAM_STEP, ALPHA = 1e-3, 0.9, 0.999, 1e-8, 10, 0.1


# --------------------------------------------------------------------------- composites


def gram_schmidt_composite(
    basis: torch.Tensor, h: torch.Tensor, num_rows: int, passes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager-PyTorch classical Gram-Schmidt, ``passes`` rounds: the speed baseline.

    Returns ``(h_orth, coefficients summed over the passes, ||h_orth||^2)`` like the op.
    """
    rows = basis[:num_rows]
    coef_total = None
    for _ in range(passes):
        coef = rows @ h
        h = torch.addmv(h, rows.t(), coef, alpha=-1.0)
        coef_total = coef if coef_total is None else coef_total + coef
    return h, coef_total, torch.dot(h, h)


def fosi_step_composite(
    param: torch.Tensor,
    grad: torch.Tensor,
    basis: torch.Tensor,
    newton_scale: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    base_scale: float = 1.0,
) -> None:
    """Eager-PyTorch FOSI-Adam step, in place: the speed baseline (four reads of ``basis``).

    ``w += b u - V^T (s c + b e)`` with ``c = V g``, ``u = Adam(g - V^T c)``, ``e = V u``.
    """
    coef = basis @ grad
    g2 = torch.addmv(grad, basis.t(), coef, alpha=-1.0)
    exp_avg.lerp_(g2, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g2, g2, value=1.0 - beta2)
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
    update = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps)  # the denominator, reused as u's buffer
    torch.div(exp_avg, update, out=update).mul_(-step_size)
    projection = basis @ update
    param.add_(update, alpha=base_scale)
    param.addmv_(basis.t(), newton_scale * coef + base_scale * projection, alpha=-1.0)


# --------------------------------------------------------------------------- floors


def gram_schmidt_floor_bytes(n: int, num_rows: int, passes: int, itemsize: int) -> int:
    """Bytes the projection cannot avoid: per pass, D read twice, h read twice, h_orth written."""
    return passes * (2 * num_rows + 3) * n * itemsize


def fosi_step_floor_bytes(n: int, rank: int, itemsize: int = 4) -> int:
    """Bytes a FOSI-Adam step cannot avoid: V read three times, g twice, moments and w (or u) 4n each."""
    return (3 * rank + 10) * n * itemsize


# --------------------------------------------------------------------------- cases


def random_basis(rows: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows ~ N(0, I / n): unit length and mutually orthogonal up to O(1/sqrt(n)), like a Lanczos basis.

    An exactly orthonormal basis (QR) would cost more than the benchmark at n = 5e7
    and changes nothing in the work done.
    """
    basis = torch.randn(rows, n, dtype=dtype, device=device)
    return basis.mul_(1.0 / math.sqrt(n))


def gram_schmidt_case(n: int, num_rows: int, dtype: torch.dtype, passes: int, device) -> harness.Case:
    basis = random_basis(num_rows, n, dtype, device)
    h = torch.randn(n, dtype=dtype, device=device)

    def op():
        return tritonopt.ops.gram_schmidt_project(basis, h, num_rows, passes)

    return harness.Case(
        op=GS_OP, shape=dict(n=n, rows=num_rows, dtype=str(dtype).removeprefix("torch."), passes=passes),
        floor_bytes=gram_schmidt_floor_bytes(n, num_rows, passes, basis.element_size()),
        public=lambda: op,
        torch=lambda: lambda: gram_schmidt_composite(basis, h, num_rows, passes),
    )


def fosi_step_case(n: int, rank: int, device) -> harness.Case:
    basis = random_basis(rank, n, torch.float32, device)
    grad = torch.randn(n, device=device)
    newton_scale = ALPHA / (1.0 + torch.rand(rank, device=device))
    hyper = dict(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, step=ADAM_STEP)

    def buffers():
        return torch.zeros(n, device=device), torch.zeros(n, device=device), torch.full((n,), 1e-4, device=device)

    def public():
        param, exp_avg, exp_avg_sq = buffers()
        return lambda: tritonopt.ops.fosi_step(param, grad, basis, newton_scale, base="adam",
                                               state_a=exp_avg, state_b=exp_avg_sq, **hyper)

    def composite():
        param, exp_avg, exp_avg_sq = buffers()
        return lambda: fosi_step_composite(param, grad, basis, newton_scale, exp_avg, exp_avg_sq, **hyper)

    return harness.Case(
        op=FOSI_OP, shape=dict(n=n, rows=rank, dtype="float32", passes=""),
        floor_bytes=fosi_step_floor_bytes(n, rank), public=public, torch=composite,
    )


def cases(args, context: harness.BenchContext):
    if args.smoke:
        elements, basis_rows, ranks = SMOKE_ELEMENTS, SMOKE_BASIS_ROWS, SMOKE_RANKS
    elif context.on_gpu:
        elements, basis_rows, ranks = GPU_ELEMENTS, GPU_BASIS_ROWS, GPU_RANKS
    else:
        elements, basis_rows, ranks = CPU_ELEMENTS, CPU_BASIS_ROWS, CPU_RANKS
    if args.elements is not None and not args.smoke:
        elements = tuple(args.elements)
    for n in elements:
        for dtype_name in args.dtypes:
            for m in basis_rows:
                yield partial(gram_schmidt_case, n, m, DTYPES[dtype_name], args.passes, context.device)
        for r in ranks:
            yield partial(fosi_step_case, n, r, context.device)


def parser():
    p = harness.bench_parser(
        __doc__.split("\n\n")[0],
        smoke_help=f"tiny sizes (n = {SMOKE_ELEMENTS[0]}, m = {SMOKE_BASIS_ROWS[0]}, r = {SMOKE_RANKS[0]}), "
        "a few repetitions: checks the script runs, in seconds",
    )
    p.add_argument("--elements", type=harness.positive_int, nargs="+", default=None, metavar="N",
                   help="vector lengths n to sweep (default: 1e6 5e6 1e7 5e7 on a GPU, 1e5 1e6 on the CPU)")
    p.add_argument("--dtypes", choices=sorted(DTYPES), nargs="+", default=["fp32", "fp64"],
                   help="basis dtypes of the Gram-Schmidt projection (default: fp32 fp64); the FOSI step is fp32")
    p.add_argument("--passes", type=int, choices=(1, 2, 3), default=2,
                   help="Gram-Schmidt rounds per projection: 1 = CGS (paper), 2 = CGS2 (default, as Lanczos runs)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=CSV_STEM, parser=parser(), cases=cases, argv=argv, shape_columns=("n", "rows", "dtype"),
        preamble=lambda args, ctx: [
            f"{GS_OP} floor bytes = passes * (2 m + 3) * n * itemsize  (passes = {args.passes}); "
            f"{FOSI_OP} floor bytes = (3 r + 10) * n * 4  (Adam base, fp32)"],
        plots=[
            harness.Plot("lanczos_gram_schmidt.png", (GS_OP,), x="n", y="gbps", series=("provider", "rows", "dtype"),
                         title=GS_OP + ", {passes} pass(es)", xlabel="n (vector length)",
                         ylabel="GB/s on the floor's bytes"),
            harness.Plot("lanczos_fosi_step.png", (FOSI_OP,), x="n", y="gbps", series=("provider", "rows"),
                         title=f"{FOSI_OP} (Adam)", xlabel="n (vector length)", ylabel="GB/s on the floor's bytes"),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
