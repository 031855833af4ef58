"""Benchmark the K-FAC ops against torch composites and the matrix-throughput floor.

What is measured:

* ``factor_update`` for ``x: [n, d]`` (bias column implicit, ``d + 1`` factor):
  ``triton`` (the fused upper-triangle kernel) vs ``torch`` = ``torch.cat`` of the
  ones column, ``X.T @ X / n`` and ``lerp_`` into the factor. Flop floor: the
  symmetric product, ``2 n (d+1)(d+2)/2`` flops.
* ``precondition`` for ``grad: [g, a]``: ``triton`` (four GEMM launches, the divide
  fused, precomputed reciprocal ``D``) vs ``torch`` = four ``@`` and a multiply.
  Flop floor: ``4 g a (g + a)``.
* ``floor``: those flops divided by the **measured** matrix throughput at the
  precision used (``torch.matmul`` on 8192^2 fp32 with TF32 on for ``tf32`` and
  ``tf32x3`` -- the latter divided by 3, it issues three TF32 products -- and off
  for ``ieee``).
* ``step``: end-to-end training-step time of a small ResNet (BasicBlocks, batch
  norm; the convolutions and the classifier are preconditioned) with SGD-momentum,
  with and without K-FAC (factors every step, eigendecompositions every 10 steps,
  amortised in the mean).

Targets on an H100 (from the design): preconditioning >= 1.2x the torch
composite, factor update >= 1.5x, both >= 60 % of the measured throughput.

Without CUDA: the script says so, times the reference path (``reference``) and the
composite on small shapes only, writes to ``perf/results/cpu/``, and exits 0.

    python perf/bench_kfac.py [--smoke] [--nvtx] [--precision tf32x3|ieee|tf32] [--out DIR]
    nsys profile -t nvtx,cuda python perf/bench_kfac.py --nvtx
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

try:
    import tritonopt  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

import _bench_common as bench
from tritonopt._runtime import HAS_TRITON, nvtx_range
from tritonopt.kernels import kfac as kernels
from tritonopt.optim.kfac import KFACPreconditioner

OP = "kfac"
NO_CUDA_MESSAGE = "no CUDA device: timing the reference path only (not representative of GPU speed)"
GPU_FACTOR_SHAPES = [(4096, 255), (8192, 1023), (16384, 2047), (8192, 4095), (25088, 4607)]
GPU_PRECOND_SHAPES = [(256, 257), (1024, 1025), (4096, 4097), (512, 2049), (2048, 513), (1024, 4608)]
CPU_FACTOR_SHAPES = [(1024, 255), (2048, 511)]
CPU_PRECOND_SHAPES = [(256, 257), (128, 513)]
SMOKE_FACTOR_SHAPES = [(64, 31)]
SMOKE_PRECOND_SHAPES = [(32, 33)]


# --------------------------------------------------------------------------- composites


def factor_composite(factor, x, decay):
    xs = torch.cat([x.float(), x.new_ones(x.shape[0], 1, dtype=torch.float32)], 1)
    factor.lerp_(xs.T @ xs / x.shape[0], 1.0 - decay)


def precondition_composite(grad, qa, qg, inv_denominator):
    return qg @ ((qg.T @ grad @ qa) * inv_denominator) @ qa.T


def measure_matmul_tflops(device: torch.device, precision: str, reps: int) -> float:
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision != "ieee"
    try:
        timing = bench.time_ms(lambda: a @ b, device, cpu_reps=reps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    tflops = 2 * n**3 / (timing.p50 * 1e-3) / 1e12
    # tf32x3 issues three TF32 products per product (GPU only; the CPU has no TF32).
    return tflops / 3 if precision == "tf32x3" and device.type == "cuda" else tflops


def wrap(name, fn, use_nvtx):
    if not use_nvtx:
        return fn

    def call():
        with nvtx_range(f"tritonopt/bench/{OP}/{name}"):
            fn()

    return call


def row(kind, provider, shape, timing, flops, floor_ms, torch_ms, precision):
    return {
        "op": kind, "provider": provider, "shape": "x".join(map(str, shape)),
        "size": max(shape), "precision": precision,
        "ms_p50": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80,
        "tflops": flops / (timing.p50 * 1e-3) / 1e12,
        "floor_ms": floor_ms, "pct_of_floor": 100.0 * floor_ms / timing.p50,
        "speedup_vs_torch": torch_ms / timing.p50,
    }


def bench_factor(shapes, device, primary, precision, tflops, reps, use_nvtx):
    rows = []
    for n, d in shapes:
        x = torch.randn(n, d, device=device)
        flops = 2 * n * (d + 1) * (d + 2) / 2
        floor_ms = flops / (tflops * 1e12) * 1e3
        providers = {"torch": lambda f: factor_composite(f, x, 0.95)}
        if primary == "triton":
            providers["triton"] = lambda f: kernels.kfac_factor_update_triton(f, x, 0.95, True, 1.0, precision)
        else:
            providers["reference"] = lambda f: kernels.kfac_factor_update_reference(f, x, 0.95, True, 1.0)
        timings = {}
        for name, op in providers.items():
            factor = torch.eye(d + 1, device=device)
            timings[name] = bench.time_ms(wrap(name, lambda: op(factor), use_nvtx), device, cpu_reps=reps)
        for name, timing in timings.items():
            rows.append(row("factor_update", name, (n, d + 1), timing, flops, floor_ms, timings["torch"].p50, precision))
        rows.append(row("factor_update", "floor", (n, d + 1), bench.Timing(floor_ms, floor_ms, floor_ms),
                        flops, floor_ms, timings["torch"].p50, precision))
    return rows


def bench_precondition(shapes, device, primary, precision, tflops, reps, use_nvtx):
    rows = []
    for g, a in shapes:
        grad = torch.randn(g, a, device=device)
        qa = torch.linalg.qr(torch.randn(a, a, device=device))[0].contiguous()
        qg = torch.linalg.qr(torch.randn(g, g, device=device))[0].contiguous()
        inv = 1.0 / (torch.rand(g, a, device=device) + 0.01)
        flops = 4 * g * a * (g + a)
        floor_ms = flops / (tflops * 1e12) * 1e3
        providers = {"torch": lambda: precondition_composite(grad, qa, qg, inv)}
        if primary == "triton":
            providers["triton"] = lambda: kernels.eigenbasis_precondition_triton(
                grad, qa, qg, inv_denominator=inv, precision=precision)
        else:
            providers["reference"] = lambda: kernels.eigenbasis_precondition_reference(
                grad, qa, qg, inv_denominator=inv)
        timings = {name: bench.time_ms(wrap(name, op, use_nvtx), device, cpu_reps=reps)
                   for name, op in providers.items()}
        for name, timing in timings.items():
            rows.append(row("precondition", name, (g, a), timing, flops, floor_ms, timings["torch"].p50, precision))
        rows.append(row("precondition", "floor", (g, a), bench.Timing(floor_ms, floor_ms, floor_ms),
                        flops, floor_ms, timings["torch"].p50, precision))
    return rows


# --------------------------------------------------------------------------- end to end


class BasicBlock(nn.Module):
    def __init__(self, channels_in, channels_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out))
            if stride != 1 or channels_in != channels_out else nn.Identity()
        )

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def small_resnet(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10),
    )


def bench_step(device, batch, image, width, steps, use_nvtx):
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

        for _ in range(3):  # warm-up: allocations, first eigendecomposition
            one()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            with nvtx_range(f"tritonopt/bench/{OP}/step/{provider}") if use_nvtx else _null():
                one()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - began) * 1e3 / steps
        rows.append({"op": "train_step", "provider": provider, "shape": f"b{batch}_i{image}_w{width}",
                     "size": width, "ms_p50": ms, "ms_p20": ms, "ms_p80": ms})
    return rows


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Time tritonopt's K-FAC ops against torch composites.")
    parser.add_argument("--precision", choices=kernels.PRECISIONS, default=kernels.DEFAULT_PRECISION)
    parser.add_argument("--nvtx", action="store_true", help=f"NVTX range tritonopt/bench/{OP}/<provider> per call")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape per op: checks the script runs")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    args = parser.parse_args(argv)

    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu and HAS_TRITON:
        primary = "triton"
    else:
        primary = "reference"
        print(NO_CUDA_MESSAGE if not on_gpu else "Triton is not importable: timing the reference path")
    if args.nvtx and importlib.util.find_spec("nvtx") is None:
        print("--nvtx: the nvtx package is not installed, so no ranges will be emitted")

    reps = 3 if args.smoke else 10
    if args.smoke:
        factor_shapes, precond_shapes, step_args = SMOKE_FACTOR_SHAPES, SMOKE_PRECOND_SHAPES, (4, 8, 4, 2)
    elif on_gpu:
        factor_shapes, precond_shapes, step_args = GPU_FACTOR_SHAPES, GPU_PRECOND_SHAPES, (128, 32, 64, 20)
    else:
        factor_shapes, precond_shapes, step_args = CPU_FACTOR_SHAPES, CPU_PRECOND_SHAPES, (16, 16, 8, 10)

    tflops = measure_matmul_tflops(device, args.precision, reps)
    print(f"{OP}: device {bench.device_name()}, precision {args.precision}, measured matrix throughput "
          f"{tflops:.2f} TFLOP/s (floor = flops / this)")
    rows = bench_factor(factor_shapes, device, primary, args.precision, tflops, reps, args.nvtx)
    rows += bench_precondition(precond_shapes, device, primary, args.precision, tflops, reps, args.nvtx)
    rows += bench_step(device, *step_args, use_nvtx=args.nvtx)

    headers = ["op", "provider", "shape", "ms", "TFLOP/s", "% of floor", "vs torch"]
    table = [[r["op"], r["provider"], r["shape"], r["ms_p50"], r.get("tflops", float("nan")),
              r.get("pct_of_floor", float("nan")), r.get("speedup_vs_torch", float("nan"))] for r in rows]
    print()
    print(bench.format_table(headers, table))
    print()
    out_dir = args.out if args.out is not None else bench.default_results_dir()
    csv_path = bench.write_results(rows, out_dir, OP)
    print(f"wrote {csv_path}")
    title = f"{OP} ops, {args.precision}, {bench.device_name()}"
    if not on_gpu:
        title += "\nCPU reference path: not representative of GPU speed"
    bench.save_plot([r for r in rows if r["op"] != "train_step"], Path(out_dir) / f"{OP}.png",
                    x="size", y="ms_p50", series=("provider", "op"), title=title,
                    xlabel="largest dimension", ylabel="ms (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
