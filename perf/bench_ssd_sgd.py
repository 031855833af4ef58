"""Benchmark the fused SSD-SGD step (``tritonopt.ops.ssd_sgd_step``) against its composite and its floor.

One iteration of SSD-SGD's steps-delay stage over flat buffers of ``n`` float32 elements
(Xu et al. Eq. 8 and the MXNet momentum-SGD server), the providers of ``perf/_harness.py``:
the launcher ``ssd_sgd_step_triton`` (without a GPU, the reference ``ssd_sgd_step_reference``),
the public op, and ``ssd_sgd_step_composite`` below, the same math as eager
``torch._foreach_*`` ops over a list of parameter-sized tensors (the fastest eager form:
7 ops, 19 element accesses instead of 8).

Floor: ``32 n`` bytes for the common step (read ``p, g, pre, sw, smom``; write ``p, sw,
smom``) over the measured bandwidth. The step right after a pull (one in ``k``; ``p`` is
not read, ``pre`` and the synchronised momentum are written: ``36 n`` bytes) is timed as
``ssd_sgd_step_pulled``, without a composite. Targets on an H100: at least 80 % of the
bandwidth on the floor's bytes, and at least 2x the composite.

Without a CUDA device the script says so and times the reference path on small sizes.
Results: ``ssd_sgd.csv`` and ``ssd_sgd.png`` (GB/s on the floor's bytes against ``n``).

    python -m perf.bench_ssd_sgd [--smoke] [--nvtx] [--elements 1e6 25557032] [--tensors 161] [--out DIR]
    nsys profile -t nvtx,cuda python -m perf.bench_ssd_sgd --nvtx
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_ssd_sgd.py
    import _as_module

    _as_module.run(__file__)

import sys
from functools import partial

import torch

import tritonopt
from perf import _harness as harness
from tritonopt.kernels.ssd_sgd import ssd_sgd_step_reference, ssd_sgd_step_triton

NAME = "ssd_sgd"
STEP_OP = "ssd_sgd_step"
PULLED_OP = "ssd_sgd_step_pulled"
GPU_ELEMENTS = (1_000_000, 5_000_000, 25_557_032, 100_000_000)  # 25.6 M: ResNet-50
CPU_ELEMENTS = (100_000, 1_000_000)
SMOKE_ELEMENTS = (20_000,)
TENSORS = 161  # the composite's list length: ResNet-50 has 161 parameter tensors
STEP_FLOOR_BYTES, PULLED_FLOOR_BYTES = 32, 36  # per float32 element

# The paper's setting (sec. 4.1): lr 0.4, m 0.9, wd 1e-4, loc_lr = 4 lr, alpha 2, beta 0.5, k 5.
HYPER = dict(lr=0.4, momentum=0.9, weight_decay=1e-4, local_lr=1.6, local_weight_decay=1e-4,
             glu_alpha=2.0, glu_beta=0.5, sync_coef=(1 - 0.9) / (0.4 * 5))
PULLED_SCALE = 0.25  # the mean of 4 ranks' shadows; the sums stay finite under repetition


def ssd_sgd_step_composite(params, grads, pre, sw, smom, *, lr, momentum, weight_decay, local_lr,
                           local_weight_decay, glu_alpha, glu_beta, sync_coef) -> None:
    """Eager foreach SSD-SGD step (the common, non-pulled one), in place: the speed baseline.

    Shadow server ``smom = m smom - lr (g + wd sw); sw += smom``, then GLU in its
    closed form ``p = (1 - L wd_loc + L beta c) p - L alpha g - L beta c pre``.
    """
    torch._foreach_mul_(smom, momentum)
    torch._foreach_add_(smom, grads, alpha=-lr)
    torch._foreach_add_(smom, sw, alpha=-lr * weight_decay)
    torch._foreach_add_(sw, smom)
    big_l, c = local_lr, sync_coef
    torch._foreach_mul_(params, 1.0 - big_l * local_weight_decay + big_l * glu_beta * c)
    torch._foreach_add_(params, grads, alpha=-big_l * glu_alpha)
    torch._foreach_add_(params, pre, alpha=-big_l * glu_beta * c)


def split(flat: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """Views of ``flat`` as ``pieces`` tensors of nearly equal size (a parameter list)."""
    return list(torch.tensor_split(flat, min(pieces, flat.numel())))


def buffers(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda scale: torch.randn(n, device=device, generator=gen) * scale  # noqa: E731
    return dict(param=make(1.0), grad=make(1.0), pre=make(1.0), sw=make(1.0), smom=make(0.01),
                sync_mom=torch.zeros(n, device=device))


def _launcher(launcher, *, pulled: bool):
    """A kernel-module function (every argument by position) as a call on the buffers."""

    def call(b):
        launcher(b["param"], b["grad"], b["pre"], b["sw"], b["smom"], b["sync_mom"] if pulled else None,
                 *HYPER.values(), PULLED_SCALE if pulled else 1.0, pulled)  # HYPER: in the launchers' order

    return call


def _public(b, *, pulled: bool):
    extra = dict(sync_momentum=b["sync_mom"], pulled=True, shadow_scale=PULLED_SCALE) if pulled else {}
    tritonopt.ops.ssd_sgd_step(b["param"], b["grad"], b["pre"], shadow_weight=b["sw"], shadow_momentum=b["smom"],
                               **extra, **HYPER)


def _composite(b, tensors: int):
    lists = {k: split(v, tensors) for k, v in b.items()}
    return lambda: ssd_sgd_step_composite(lists["param"], lists["grad"], lists["pre"], lists["sw"], lists["smom"],
                                          **HYPER)


def step_cases(n: int, tensors: int, device: torch.device) -> list[harness.Case]:
    """The common step and the step after a pull, each provider on its own fresh buffers."""

    def provider(call):
        def build():
            b = buffers(n, device)
            return lambda: call(b)

        return build

    shape = dict(n=n, tensors=tensors, dtype="float32")
    return [
        harness.Case(
            op=STEP_OP, shape=shape, floor_bytes=STEP_FLOOR_BYTES * n,
            triton=provider(_launcher(ssd_sgd_step_triton, pulled=False)),
            reference=provider(_launcher(ssd_sgd_step_reference, pulled=False)),
            public=provider(partial(_public, pulled=False)),
            torch=lambda: _composite(buffers(n, device), tensors),
        ),
        harness.Case(
            op=PULLED_OP, shape=shape, floor_bytes=PULLED_FLOOR_BYTES * n,
            triton=provider(_launcher(ssd_sgd_step_triton, pulled=True)),
            reference=provider(_launcher(ssd_sgd_step_reference, pulled=True)),
            public=provider(partial(_public, pulled=True)),
        ),
    ]


def cases(args, context: harness.BenchContext):
    if args.smoke:
        elements = SMOKE_ELEMENTS
    elif args.elements is not None:
        elements = tuple(args.elements)
    else:
        elements = GPU_ELEMENTS if context.on_gpu else CPU_ELEMENTS
    for n in elements:
        yield partial(step_cases, n, args.tensors, context.device)


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0],
                             smoke_help=f"n = {SMOKE_ELEMENTS[0]}, a few repetitions: checks the script runs")
    p.add_argument("--elements", type=harness.positive_int, nargs="+", default=None, metavar="N",
                   help="flat buffer lengths (default: 1e6 5e6 25557032 1e8 on a GPU, 1e5 1e6 on the CPU)")
    p.add_argument("--tensors", type=harness.positive_int, default=TENSORS,
                   help="tensors in the composite's parameter list (default: %(default)s, ResNet-50's count)")
    return p


def main(argv=None) -> int:
    return harness.run_benchmark(
        name=NAME, parser=parser(), cases=cases, argv=argv, shape_columns=("n",),
        preamble=lambda args, ctx: [f"floor bytes: {STEP_FLOOR_BYTES} n (common step), {PULLED_FLOOR_BYTES} n "
                                    "(after a pull), float32"],
        plots=[harness.Plot(f"{NAME}.png", (STEP_OP, PULLED_OP), x="n", y="gbps", series=("op", "provider"),
                            title="SSD-SGD step", xlabel="n (elements)", ylabel="GB/s on the floor's bytes")],
    )


if __name__ == "__main__":
    sys.exit(main())
