"""Benchmark the fused momentum-SGD step (``tritonopt.ops.sgd_momentum_step``, the DSP stage update) against torch.

Per flat buffer of ``n`` elements (2^16 to 2^26; a ResNet-164 block at K = 4 holds about
2^19 parameters, a ResNet-50 block at K = 3 about 2^23), momentum 0.9, weight decay 1e-4,
float32 weights and momentum, the gradient in ``--grad-dtype``, the providers of
``perf/_harness.py``: the launcher ``sgd_momentum_step_triton`` (one pass: read ``w``, ``g``,
``buf``; write ``w``, ``buf``; without a GPU, the reference ``sgd_momentum_step_reference``,
``torch.optim.SGD``'s single-tensor operations), the public op, and two baselines stepping the
same buffer as one parameter: ``torch``, ``torch.optim.SGD`` as a user gets it (foreach on
CUDA, the single-tensor loop on the CPU), and ``torch_fused``, ``torch.optim.SGD(fused=True)``.
Every call is a later step (the momentum buffer exists).

Floor: ``n * (16 + sizeof(g))`` bytes over the measured bandwidth. Without a CUDA device the
script says so and times the reference path on at most 2^22 elements. Results:
``sgd_momentum.csv`` and ``sgd_momentum.png`` (GB/s against elements).

    python -m perf.bench_sgd_momentum [--smoke] [--nvtx] [--grad-dtype fp32|fp16|bf16] [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_sgd_momentum.py
    import _as_module

    _as_module.run(__file__)

import sys
from functools import partial

import torch

import tritonopt
from perf import _harness as harness
from tritonopt.kernels.sgd_momentum import sgd_momentum_step_reference, sgd_momentum_step_triton

OP = "sgd_momentum"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ELEMENTS_LOG2_RANGE = (16, 26)
CPU_MAX_ELEMENTS_LOG2 = 22
SMOKE_ELEMENTS = 1 << 12
HYPER = dict(lr=0.01, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=False, maximize=False)


def floor_bytes(n: int, grad_bytes: int) -> int:
    """Read w, g, buf and write w, buf: ``n * (4 + g + 4 + 4 + 4)``."""
    return n * (16 + grad_bytes)


def torch_sgd(w: torch.Tensor, g: torch.Tensor, **implementation):
    """``torch.optim.SGD`` stepping ``w`` as one parameter, after a first step that creates its buffer."""
    param = torch.nn.Parameter(w)
    param.grad = g.to(w.dtype)
    optimizer = torch.optim.SGD([param], lr=HYPER["lr"], momentum=HYPER["momentum"],
                                weight_decay=HYPER["weight_decay"], **implementation)
    optimizer.step()
    return optimizer.step


def case(n: int, grad_dtype: torch.dtype, device: torch.device) -> harness.Case:
    w0 = torch.randn(n, device=device)
    g = (torch.randn(n, device=device) * 1e-3).to(grad_dtype)

    def provider(fn):
        def build():
            w, buf = w0.clone(), torch.zeros_like(w0)
            return lambda: fn(w, g, buf, first_step=False, **HYPER)

        return build

    return harness.Case(
        op=OP, shape=dict(elements=n, grad_dtype=str(grad_dtype).removeprefix("torch.")),
        floor_bytes=floor_bytes(n, g.element_size()),
        triton=provider(sgd_momentum_step_triton), reference=provider(sgd_momentum_step_reference),
        public=provider(tritonopt.ops.sgd_momentum_step),
        torch=lambda: torch_sgd(w0.clone(), g),
        extra={"torch_fused": lambda: torch_sgd(w0.clone(), g, fused=True)},
    )


def cases(args, context: harness.BenchContext):
    grad_dtype = DTYPES[args.grad_dtype]
    if args.smoke:
        sizes = [SMOKE_ELEMENTS]
    else:
        top = ELEMENTS_LOG2_RANGE[1] if context.on_gpu else CPU_MAX_ELEMENTS_LOG2
        sizes = [1 << k for k in range(ELEMENTS_LOG2_RANGE[0], top + 1, 2)]
    for n in sizes:
        yield partial(case, n, grad_dtype, context.device)


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0],
                             smoke_help=f"one size ({SMOKE_ELEMENTS} elements), a few repetitions")
    p.add_argument("--grad-dtype", choices=sorted(DTYPES), default="fp32", help="gradient dtype (default: fp32)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=OP, parser=parser(), cases=cases, argv=argv, shape_columns=("elements", "grad_dtype"),
        preamble=lambda args, ctx: [f"momentum {HYPER['momentum']}, weight decay {HYPER['weight_decay']}, "
                                    f"grad {args.grad_dtype}; floor bytes = n * (16 + grad itemsize)"],
        plots=[harness.Plot(f"{OP}.png", (OP,), x="elements", y="gbps", series=("provider",),
                            title=OP + "_step, grad {grad_dtype}", xlabel="elements",
                            ylabel="GB/s on the floor's bytes")],
    )


if __name__ == "__main__":
    sys.exit(main())
