"""Benchmark the K-FAC ops against torch composites and the matrix-throughput floor.

Ops, with the providers of ``perf/_harness.py`` (Triton launcher or reference, public op,
torch composite):

* ``kfac_factor_update`` for ``x: [n, d]`` (bias column implicit, ``d + 1`` factor); the
  composite is ``torch.cat`` of the ones column, ``X.T @ X / n`` and ``lerp_`` into the
  factor. Flop floor: the symmetric product, ``2 n (d+1)(d+2)/2`` flops. The factor has the
  layout K-FAC stores it in (:func:`~tritonopt.optim.kfac_functional.factor_buffer`: rows
  padded to a multiple of 4 entries from 128 columns on), so an odd ``d + 1`` such as 769
  is timed as the optimizer runs it.
* ``eigenbasis_precondition`` for ``grad: [g, a]`` (precomputed reciprocal ``D``): four GEMM
  launches with the multiply fused, against four ``@`` and a multiply. Flop floor:
  ``4 g a (g + a)``.

Floors divide those flops by the **measured** matrix throughput at the precision used
(``torch.matmul`` on 8192^2 fp32 with TF32 on for ``tf32`` and ``tf32x3`` -- the latter
divided by 3, it issues three TF32 products -- and off for ``ieee``).

``train_step``: end-to-end training-step time of a small ResNet (BasicBlocks, batch norm;
the convolutions and the classifier are preconditioned) with SGD-momentum, with and without
K-FAC (factors every step, eigendecompositions every 10 steps, amortised in the mean).

Targets on an H100 (from the design): preconditioning >= 1.2x the torch composite, factor
update >= 1.5x, both >= 60 % of the measured throughput. Without CUDA the script says so and
times the reference path on small shapes. Results: ``kfac.csv`` and ``kfac.png``.

    python -m perf.bench_kfac [--smoke] [--nvtx] [--precision tf32x3|ieee|tf32] [--out DIR]
    nsys profile -t nvtx,cuda python -m perf.bench_kfac --nvtx
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_kfac.py
    import _as_module

    _as_module.run(__file__)

import sys
import time
from functools import partial

import torch
from torch import nn

import tritonopt
from perf import _harness as harness
from perf._models import small_resnet
from tritonopt.kernels import kfac as kernels
from tritonopt.optim import KFACPreconditioner
from tritonopt.optim.kfac_functional import factor_buffer

NAME = "kfac"
DECAY = 0.95
# (8192, 768): a BERT-base Linear with its bias column, 769 wide, whose factor rows are padded.
GPU_FACTOR_SHAPES = [(4096, 255), (8192, 768), (8192, 1023), (16384, 2047), (8192, 4095), (25088, 4607)]
GPU_PRECOND_SHAPES = [(256, 257), (1024, 1025), (4096, 4097), (512, 2049), (2048, 513), (1024, 4608)]
CPU_FACTOR_SHAPES = [(1024, 255), (1024, 256), (2048, 511)]
CPU_PRECOND_SHAPES = [(256, 257), (128, 513)]
SMOKE_FACTOR_SHAPES = [(64, 31)]
SMOKE_PRECOND_SHAPES = [(32, 33)]
# train_step: (batch, image side, width, timed steps)
GPU_STEP, CPU_STEP, SMOKE_STEP = (128, 32, 64, 20), (16, 16, 8, 10), (4, 8, 4, 2)


def identity_factor(dim: int, device) -> torch.Tensor:
    """The ``[dim, dim]`` identity in the layout K-FAC stores its factors in (rows padded from 128 columns on)."""
    return factor_buffer(dim, device=device).copy_(torch.eye(dim, device=device))


def factor_composite(factor, x, decay):
    xs = torch.cat([x.float(), x.new_ones(x.shape[0], 1, dtype=torch.float32)], 1)
    factor.lerp_(xs.T @ xs / x.shape[0], 1.0 - decay)


def precondition_composite(grad, qa, qg, inv_denominator):
    return qg @ ((qg.T @ grad @ qa) * inv_denominator) @ qa.T


def factor_case(n, d, device, precision) -> harness.Case:
    x = torch.randn(n, d, device=device)

    def provider(update):
        def build():
            factor = identity_factor(d + 1, device)
            return lambda: update(factor)

        return build

    return harness.Case(
        op="kfac_factor_update", shape=dict(shape=f"{n}x{d + 1}", size=d + 1),
        floor_flops=2 * n * (d + 1) * (d + 2) / 2, precision=precision,
        triton=provider(lambda f: kernels.kfac_factor_update_triton(f, x, DECAY, True, 1.0, precision)),
        reference=provider(lambda f: kernels.kfac_factor_update_reference(f, x, DECAY, True, 1.0)),
        public=provider(lambda f: tritonopt.ops.kfac_factor_update(f, x, DECAY, append_bias=True,
                                                                   precision=precision)),
        torch=provider(lambda f: factor_composite(f, x, DECAY)),
    )


def precondition_case(g, a, device, precision) -> harness.Case:
    grad = torch.randn(g, a, device=device)
    qa = torch.linalg.qr(torch.randn(a, a, device=device))[0].contiguous()
    qg = torch.linalg.qr(torch.randn(g, g, device=device))[0].contiguous()
    inv = 1.0 / (torch.rand(g, a, device=device) + 0.01)

    def ready(fn):
        return lambda: fn

    return harness.Case(
        op="eigenbasis_precondition", shape=dict(shape=f"{g}x{a}", size=max(g, a)),
        floor_flops=4 * g * a * (g + a), precision=precision,
        triton=ready(lambda: kernels.eigenbasis_precondition_prediv_triton(grad, qa, qg, inv, precision)),
        reference=ready(lambda: kernels.eigenbasis_precondition_prediv_reference(grad, qa, qg, inv)),
        public=ready(lambda: tritonopt.ops.eigenbasis_precondition_prediv(grad, qa, qg, inv, precision=precision)),
        torch=ready(lambda: precondition_composite(grad, qa, qg, inv)),
    )


def cases(args, context: harness.BenchContext):
    if args.smoke:
        factor_shapes, precond_shapes = SMOKE_FACTOR_SHAPES, SMOKE_PRECOND_SHAPES
    elif context.on_gpu:
        factor_shapes, precond_shapes = GPU_FACTOR_SHAPES, GPU_PRECOND_SHAPES
    else:
        factor_shapes, precond_shapes = CPU_FACTOR_SHAPES, CPU_PRECOND_SHAPES
    for n, d in factor_shapes:
        yield partial(factor_case, n, d, context.device, args.precision)
    for g, a in precond_shapes:
        yield partial(precondition_case, g, a, context.device, args.precision)


def train_step_rows(args, context: harness.BenchContext) -> list[dict]:
    """Mean time of a training step of :func:`small_resnet`, SGD-momentum with and without K-FAC."""
    batch, image, width, steps = SMOKE_STEP if args.smoke else (GPU_STEP if context.on_gpu else CPU_STEP)
    device = context.device
    torch.manual_seed(0)
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    rows = []
    for provider in ("sgd", "sgd+kfac"):
        model = small_resnet(width).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        precond = KFACPreconditioner(model, inv_update_steps=10, damping=0.003) if provider == "sgd+kfac" else None

        def one():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if precond is not None:
                precond.step()
            opt.step()

        timed = harness.with_range(f"tritonopt/bench/{NAME}/step/{provider}", one, context.nvtx)
        for _ in range(3):  # warm-up: allocations, first eigendecomposition
            one()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            timed()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - began) * 1e3 / steps
        rows.append({"op": "train_step", "provider": provider, "shape": f"b{batch}_i{image}_w{width}",
                     "size": width, "ms_p50": ms, "ms_p20": ms, "ms_p80": ms})
    return rows


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0], smoke_help="one tiny shape per op, a few repetitions")
    p.add_argument("--precision", choices=kernels.PRECISIONS, default=kernels.DEFAULT_PRECISION,
                   help="matrix-unit precision of the kernels and the floor (default: %(default)s)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=NAME, parser=parser(), cases=cases, argv=argv, shape_columns=("shape", "precision"),
        extra_rows=train_step_rows,
        preamble=lambda args, ctx: [f"precision {args.precision}; flop floors: factor update "
                                    "n (d+1)(d+2), preconditioning 4 g a (g + a)"],
        plots=[harness.Plot(f"{NAME}.png", ("kfac_factor_update", "eigenbasis_precondition"), x="size",
                            y="ms_p50", series=("provider", "op"), title="K-FAC ops, {precision}",
                            xlabel="largest dimension", ylabel="ms (median)")],
    )


if __name__ == "__main__":
    sys.exit(main())
