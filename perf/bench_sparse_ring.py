"""Benchmark the sparse ring-buffer ops (SP, LCG, insertion) against torch and the memory floor.

Per shape (``d = num_blocks * block_size`` from 2^20 to 2^24, ``m`` rows, ``k``
kept per block at the given density) and op:

* ``triton``: the launchers of :mod:`tritonopt.kernels.sparse_ring`;
* ``torch``: the best eager composite with the same inputs: absolute int64
  indices precomputed (as the EFCP code stores them) and ``torch.take`` + sum for
  SP, ``index_add_`` for LCG, ``index_copy_``-style assignment for insertion;
* ``dense``: ``G @ x`` / ``w @ G`` on a dense float32 ``[m, d]`` buffer (what dense
  M-FAC pays), where it fits in memory;
* ``floor``: ``m * k_total * (4 + 4) + 4 d`` bytes (SP and LCG; int32 indices,
  fp32 values) or ``2 * k_total * (4 + 4)`` (insertion) over the measured copy
  bandwidth.

``--optimizer-step`` (GPU only) also times ``SparseMFAC.step()`` and ``MFAC.step()``
at ResNet-18 size (d = 11,689,512, m = 1024, 1 %) and reports their state bytes.

Without a CUDA device the script says so, times the reference path on small
shapes (m = 32, d <= 2^20), labels it ``reference`` and exits 0.

    python perf/bench_sparse_ring.py [--smoke] [--nvtx] [--m 1024] [--density 0.01]
                                     [--block-size 16384] [--optimizer-step] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tritonopt  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import _bench_common as bench
from tritonopt._runtime import HAS_TRITON, nvtx_range
from tritonopt.kernels import sparse_ring as kernels
from tritonopt.optim.sparse_adagrad import kept_per_block

OP = "sparse_ring"
NO_CUDA_MESSAGE = "no CUDA device: timing the reference path only (not representative of GPU speed)"
DENSE_LIMIT_BYTES = 8 << 30


def make_ring(num_blocks, m, k, block_size, device):
    gen = torch.Generator(device=device).manual_seed(0)
    # Distinct sorted positions per (block, row), as ef_topk produces them.
    starts = torch.randint(0, block_size - k + 1, (num_blocks, m, 1), device=device, generator=gen)
    stride = max(1, (block_size - 1) // max(1, k))
    positions = torch.arange(k, device=device) * stride
    indices = ((starts + positions) % block_size).sort(dim=2).values.to(torch.int32)
    values = torch.randn((num_blocks, m, k), device=device, generator=gen)
    return indices, values


def measure(num_blocks, m, k, block_size, device, primary, *, bandwidth, reps, use_nvtx):
    d = num_blocks * block_size
    indices, values = make_ring(num_blocks, m, k, block_size, device)
    absolute = kernels._absolute_indices(indices, block_size)  # [num_blocks, m, k] int64
    absolute_rows = absolute.permute(1, 0, 2).reshape(m, -1).contiguous()
    values_rows = values.permute(1, 0, 2).reshape(m, -1).contiguous()
    x = torch.randn((num_blocks, block_size), device=device)
    w = torch.randn(m, device=device)
    new_i, new_v = indices[:, 0].contiguous(), values[:, 0].contiguous()
    flat_x = x.view(-1)

    def torch_sp():
        return (values_rows * flat_x.take(absolute_rows)).sum(dim=1)

    def torch_lcg():
        out = torch.zeros(d, device=device)
        return out.index_add_(0, absolute_rows.view(-1), (w.view(-1, 1) * values_rows).view(-1))

    def torch_insert():
        absolute_rows[3] = absolute[:, 0].reshape(-1)
        values_rows[3] = new_v.view(-1)

    if primary == "triton":
        ours = {
            "sp": lambda: kernels.sparse_sp_triton(indices, values, x),
            "lcg": lambda: kernels.sparse_lcg_triton(indices, values, w, block_size),
            "insert": lambda: kernels.sparse_ring_insert_triton(indices, values, 3, new_i, new_v),
        }
    else:
        ours = {
            "sp": lambda: kernels.sparse_sp_reference(indices, values, x),
            "lcg": lambda: kernels.sparse_lcg_reference(indices, values, w, block_size),
            "insert": lambda: kernels.sparse_ring_insert_reference(indices, values, 3, new_i, new_v),
        }
    composite = {"sp": torch_sp, "lcg": torch_lcg, "insert": torch_insert}
    dense = None
    if 4 * m * d <= (DENSE_LIMIT_BYTES if device.type == "cuda" else 1 << 28):
        window = torch.randn((m, d), device=device)
        dense = {"sp": lambda: window @ flat_x, "lcg": lambda: w @ window}

    k_total = num_blocks * k
    rows = []
    for op in ("sp", "lcg", "insert"):
        moved = 2 * k_total * 8 if op == "insert" else m * k_total * 8 + 4 * d
        providers = {primary: ours[op], "torch": composite[op]}
        if dense is not None and op in dense:
            providers["dense"] = dense[op]
        timings = {}
        for provider, fn in providers.items():
            call = fn
            if use_nvtx:
                name = f"tritonopt/bench/{OP}/{op}/{provider}"

                def call(fn=fn, name=name):
                    with nvtx_range(name):
                        fn()

            timings[provider] = bench.time_ms(call, device, cpu_reps=reps)
        floor_ms = moved / (bandwidth * 1e9) * 1e3
        timings["floor"] = bench.Timing(floor_ms, floor_ms, floor_ms)
        for provider, timing in timings.items():
            rows.append({
                "op": op, "provider": provider, "m": m, "d": d, "num_blocks": num_blocks,
                "block_size": block_size, "k_per_block": k, "ms_p50": timing.p50,
                "ms_p20": timing.p20, "ms_p80": timing.p80,
                "gbps": moved / (timing.p50 * 1e-3) / 1e9, "floor_ms": floor_ms,
                "pct_of_floor": 100.0 * floor_ms / timing.p50,
                "speedup_vs_torch": timings["torch"].p50 / timing.p50,
            })
    return rows


def optimizer_step_rows(device, density, block_size):
    from tritonopt.optim.mfac import MFAC, SparseMFAC

    d, m = 11_689_512, 1024
    rows = []
    for name, cls, kwargs in (
        ("SparseMFAC", SparseMFAC, dict(density=density, block_size=block_size)),
        ("MFAC", MFAC, {}),
    ):
        param = torch.nn.Parameter(torch.zeros(d, device=device))
        opt = cls([param], lr=1e-3, ngrads=m, damp=1e-6, **kwargs)
        param.grad = torch.randn(d, device=device)
        timing = bench.time_ms(opt.step, device)
        rows.append({"op": "optimizer_step", "provider": name, "m": m, "d": d,
                     "ms_p50": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80,
                     "state_bytes": opt.state_bytes()})
        del opt, param
        torch.cuda.empty_cache()
    return rows


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Time SP / LCG / insertion of the sparse ring buffer.")
    parser.add_argument("--m", type=int, default=None, help="rows (default: 1024 on GPU, 32 on CPU)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--block-size", type=int, default=16384)
    parser.add_argument("--nvtx", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape, a few repetitions")
    parser.add_argument("--optimizer-step", action="store_true",
                        help="GPU only: time SparseMFAC.step() and MFAC.step() at d = 11.7M, m = 1024")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    primary = "triton" if on_gpu and HAS_TRITON else "reference"
    if not on_gpu:
        print(NO_CUDA_MESSAGE)
    m = args.m or (1024 if on_gpu else 32)
    if args.smoke:
        shapes, m, block_size, reps = [(4, 1024)], 8, 1024, 3
    else:
        block_size, reps = args.block_size, 10
        top = 24 if on_gpu else 20
        shapes = [(max(1, (1 << e) // block_size), block_size) for e in range(20, top + 1, 2)]
    k = kept_per_block(args.density, None, block_size)
    bandwidth = bench.measure_bandwidth_gbps(device, cpu_reps=reps)
    print(f"{OP}: m = {m}, density {args.density:g} (k = {k} per block of {block_size}), "
          f"device: {bench.device_name()}; copy bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for num_blocks, bs in shapes:
        rows += measure(num_blocks, m, k, bs, device, primary, bandwidth=bandwidth, reps=reps,
                        use_nvtx=args.nvtx)
    if args.optimizer_step and on_gpu:
        rows += optimizer_step_rows(device, args.density, args.block_size)
    headers = ["op", "provider", "m", "d", "ms", "GB/s", "% of floor", "vs torch"]
    print(bench.format_table(headers, [
        [r["op"], r["provider"], r["m"], r["d"], r["ms_p50"], r.get("gbps", float("nan")),
         r.get("pct_of_floor", float("nan")), r.get("speedup_vs_torch", float("nan"))] for r in rows
    ]))
    out_dir = args.out if args.out is not None else bench.default_results_dir()
    print(f"wrote {bench.write_results(rows, out_dir, OP)}")
    plotted = [r for r in rows if r["op"] in ("sp", "lcg")]
    bench.save_plot(
        plotted, Path(out_dir) / f"{OP}.png", x="d", y="gbps", series=("provider", "op"),
        title=f"sparse ring SP / LCG, m = {m}, {bench.device_name()}"
        + ("" if on_gpu else "\nCPU reference path: not representative of GPU speed"),
        xlabel="d (vector length)", ylabel="GB/s on the floor's bytes",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
