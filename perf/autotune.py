"""Warm and record the Triton autotune cache for the shapes of real models.

Each tritonopt kernel autotunes over a small config space, keyed by power-of-two
buckets of its shape. The first call at a new bucket benchmarks every config,
which costs seconds in the middle of a training step. This script makes those
first calls ahead of time, for the shapes a model will produce:

* ``resnet18`` (11,689,512 parameters; batch 32 at 224x224): ``ef_topk`` and the
  sparse ring (SP, LCG, insertion; m = 1024, 1 %, blocks of 16384) over all
  parameters, and ``ef_topk`` and LCG with the whole model as one block (a global
  Top-k); K-FAC factor updates and eigenbasis preconditioning per conv/linear
  layer; ``lowrank_ef`` (rank 4) per unfolded weight; the Lanczos Gram-Schmidt
  step (m = 40) and the FOSI-Adam step (k = 10) over all parameters.
* ``bert-base`` (110M parameters, rough count; batch 32 x 128 tokens): the same
  with its 768/3072-wide Linear layers and a ring of m = 256.

With ``TRITON_CACHE_AUTOTUNING=1`` (set here unless the environment says
otherwise) Triton keeps the timings on disk, in its cache directory, so that
later processes on the same machine start tuned. The script also writes, for
every autotuned kernel, the config chosen at each key it met and the median time
of each workload afterwards: ``autotune_<model>.csv`` and
``autotune_<model>.json`` in ``perf/results/<device>/`` (or ``--out``).

Without a CUDA device nothing can be tuned: the script says so, and runs each
workload once on the current backend at shapes shrunk a thousandfold
(``--smoke`` always shrinks them), which checks the shapes are valid for the
ops and nothing more.

    python -m perf.autotune [--model resnet18 bert-base] [--smoke] [--nvtx] [--out DIR]
    nsys profile -t nvtx,cuda python -m perf.autotune --nvtx
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/autotune.py
    import _as_module

    _as_module.run(__file__)

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # read when Triton's knobs are first used

import torch  # noqa: E402

import tritonopt  # noqa: E402
from perf import _harness as bench  # noqa: E402
from perf.bench_kfac import identity_factor  # noqa: E402

NO_CUDA_MESSAGE = ("no CUDA device: nothing to autotune; running each workload once at shrunken shapes "
                   "to check them (times are not representative)")
SHRINK = 1000  # element counts are divided by this without a GPU or with --smoke


@dataclass(frozen=True)
class Layer:
    """A conv/linear layer as K-FAC sees it: ``a`` input features (bias included), ``g`` outputs, ``rows`` samples.

    With ``bias``, ``a`` counts the column of ones the factor update appends to the ``a - 1`` inputs.
    """

    a: int
    g: int
    rows: int
    bias: bool = False


@dataclass(frozen=True)
class ModelShapes:
    name: str
    num_params: int
    layers: tuple[Layer, ...]
    ring_m: int
    lanczos_m: int = 40
    fosi_rank: int = 10
    density: float = 0.01
    block_size: int = 16384
    lowrank_rank: int = 4


def _resnet18_layers(batch: int = 32) -> tuple[Layer, ...]:
    layers = [Layer(3 * 49, 64, batch * 112 * 112)]  # conv1 7x7 (no bias)
    for channels_in, channels, side in ((64, 64, 56), (64, 128, 28), (128, 256, 14), (256, 512, 7)):
        layers.append(Layer(channels_in * 9, channels, batch * side * side))
        layers.append(Layer(channels * 9, channels, batch * side * side))
        if channels_in != channels:
            layers.append(Layer(channels_in, channels, batch * side * side))  # 1x1 downsample
    layers.append(Layer(512 + 1, 1000, batch, bias=True))  # fc
    return tuple(layers)


def _bert_base_layers(batch: int = 32, seq: int = 128) -> tuple[Layer, ...]:
    tokens = batch * seq
    return (Layer(768 + 1, 768, tokens, bias=True), Layer(768 + 1, 3 * 768, tokens, bias=True),  # attention out, QKV
            Layer(768 + 1, 3072, tokens, bias=True), Layer(3072 + 1, 768, tokens, bias=True))  # MLP


MODELS = {
    "resnet18": ModelShapes("resnet18", 11_689_512, _resnet18_layers(), ring_m=1024),
    "bert-base": ModelShapes("bert-base", 110_000_000, _bert_base_layers(), ring_m=256),
}


def shrink(model: ModelShapes) -> ModelShapes:
    """The same workloads at about a thousandth of the elements: for checking shapes without a GPU."""
    layers = tuple(Layer(max(2, layer.a // 32), max(2, layer.g // 32), max(4, layer.rows // SHRINK), layer.bias)
                   for layer in model.layers)
    return ModelShapes(model.name, max(4096, model.num_params // SHRINK), tuple(dict.fromkeys(layers)),
                       ring_m=4, lanczos_m=8, fosi_rank=2, block_size=1024)


@dataclass
class Workload:
    op: str
    shape: dict
    build: Callable[[], Callable[[], object]]  # allocates; returns the call to make
    results: dict = field(default_factory=dict)


def workloads(model: ModelShapes, device: torch.device) -> list[Workload]:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    num_blocks = math.ceil(model.num_params / model.block_size)
    k = bench.entries_per_block(model.density, model.block_size)
    out: list[Workload] = []

    def ef_topk():
        grad, error = randn(num_blocks, model.block_size), torch.zeros(num_blocks, model.block_size, device=device)
        return lambda: tritonopt.ops.ef_topk(grad, error, k)

    out.append(Workload("ef_topk", {"num_blocks": num_blocks, "block_size": model.block_size, "k": k}, ef_topk))

    def ring():
        # Distinct ascending positions per row, as ef_topk writes them: one in each of k equal strides.
        stride = model.block_size // k
        offsets = torch.randint(0, stride, (num_blocks, model.ring_m, k), generator=gen, device=device)
        indices = (torch.arange(k, device=device) * stride + offsets).to(torch.int32)
        values = randn(num_blocks, model.ring_m, k)
        return indices, values

    ring_shape = {"num_blocks": num_blocks, "m": model.ring_m, "k": k, "block_size": model.block_size}

    def sparse_sp():
        indices, values = ring()
        x = randn(num_blocks, model.block_size)
        return lambda: tritonopt.ops.sparse_sp(indices, values, x)

    def sparse_lcg():
        indices, values = ring()
        weights = randn(model.ring_m)
        return lambda: tritonopt.ops.sparse_lcg(indices, values, weights, model.block_size, ascending=True)

    def ring_insert():
        indices, values = ring()
        new_indices, new_values = indices[:, 0].contiguous(), values[:, 0].contiguous()
        return lambda: tritonopt.ops.sparse_ring_insert(indices, values, 1, new_indices, new_values)

    out += [Workload("sparse_sp", ring_shape, sparse_sp), Workload("sparse_lcg", ring_shape, sparse_lcg),
            Workload("sparse_ring_insert", ring_shape, ring_insert)]

    # The whole model as one block (a global Top-k): the split Top-k and the sliced LCG.
    n = model.num_params
    k_global = bench.entries_per_block(model.density, n)

    def ef_topk_global():
        grad, error = randn(1, n), torch.zeros(1, n, device=device)
        return lambda: tritonopt.ops.ef_topk(grad, error, k_global)

    def sparse_lcg_global():
        stride = n // k_global
        offsets = torch.randint(0, stride, (1, model.ring_m, k_global), generator=gen, device=device)
        indices = (torch.arange(k_global, device=device) * stride + offsets).to(torch.int32)
        values, weights = randn(1, model.ring_m, k_global), randn(model.ring_m)
        return lambda: tritonopt.ops.sparse_lcg(indices, values, weights, n, ascending=True)

    out += [Workload("ef_topk", {"num_blocks": 1, "block_size": n, "k": k_global}, ef_topk_global),
            Workload("sparse_lcg", {"num_blocks": 1, "m": model.ring_m, "k": k_global, "block_size": n},
                     sparse_lcg_global)]

    factor_shapes = set()
    for layer in dict.fromkeys(model.layers):  # each distinct shape once
        for side, dim, bias in (("A", layer.a, layer.bias), ("G", layer.g, False)):
            if (layer.rows, dim, bias) in factor_shapes:
                continue
            factor_shapes.add((layer.rows, dim, bias))

            # As the optimizer runs it: the factor in K-FAC's row-padded layout, the bias column appended.
            def factor_update(dim=dim, rows=layer.rows, bias=bias):
                factor, x = identity_factor(dim, device), randn(rows, dim - int(bias))
                return lambda: tritonopt.ops.kfac_factor_update(factor, x, 0.95, append_bias=bias)

            out.append(Workload("kfac_factor_update", {"factor": side, "rows": layer.rows, "dim": dim, "bias": bias},
                                factor_update))

        def precondition(layer=layer):
            grad = randn(layer.g, layer.a)
            qa = torch.linalg.qr(randn(layer.a, layer.a)).Q.contiguous()
            qg = torch.linalg.qr(randn(layer.g, layer.g)).Q.contiguous()
            inv = tritonopt.ops.eigen_inv_denominator(randn(layer.g).abs(), randn(layer.a).abs(), 1e-3)
            return lambda: tritonopt.ops.eigenbasis_precondition_prediv(grad, qa, qg, inv)

        out.append(Workload("eigenbasis_precondition", {"g": layer.g, "a": layer.a}, precondition))

        def lowrank(layer=layer):
            grad, error = randn(layer.g, layer.a), torch.zeros(layer.g, layer.a, device=device)
            q = randn(layer.a, model.lowrank_rank)
            return lambda: tritonopt.ops.lowrank_ef(grad, error, q)

        out.append(Workload("lowrank_ef", {"n": layer.g, "p": layer.a, "rank": model.lowrank_rank}, lowrank))

    # Timing needs the shapes, not orthonormal rows: a scaled random basis avoids an n x m QR.
    def gram_schmidt():
        basis = randn(model.lanczos_m, n) / math.sqrt(n)
        h = randn(n)
        return lambda: tritonopt.ops.gram_schmidt_project(basis, h, model.lanczos_m)

    def fosi():
        param, grad = randn(n), randn(n)
        basis = randn(model.fosi_rank, n) / math.sqrt(n)
        scale = torch.full((model.fosi_rank,), 0.1, device=device)
        exp_avg, exp_avg_sq = torch.zeros(n, device=device), torch.zeros(n, device=device)
        return lambda: tritonopt.ops.fosi_step(param, grad, basis, scale, base="adam",
                                               state_a=exp_avg, state_b=exp_avg_sq)

    out += [Workload("gram_schmidt_project", {"n": n, "m": model.lanczos_m}, gram_schmidt),
            Workload("fosi_step", {"n": n, "rank": model.fosi_rank}, fosi)]
    return out


def autotuned_kernels() -> dict[str, object]:
    """Every kernel in ``tritonopt.kernels`` with a config space (timed or pinned), by ``module.name``."""
    import importlib
    import pkgutil

    from tritonopt._runtime import HAS_TRITON, tuning_space

    if not HAS_TRITON:  # no Triton: nothing autotunes
        return {}

    import tritonopt.kernels as kernels_pkg

    found = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"tritonopt.kernels.{info.name}")
        for name, obj in vars(module).items():
            if tuning_space(obj) is not None:
                found[f"{info.name}.{name}"] = obj
    return found


def chosen_configs(kernels: dict[str, object]) -> list[dict]:
    """The config each kernel picked at every key it has seen (empty where it did not tune)."""
    from tritonopt._runtime import tuning_space

    rows = []
    for name, tuner in sorted(kernels.items()):
        for key, config in getattr(tuner, "cache", {}).items():
            rows.append({"kernel": name, "key_names": ",".join(tuner.keys), "key": repr(key),
                         "config": str(config), "candidates": len(tuner.configs),
                         "pinned": tuning_space(tuner).pinned})
    return rows


def run_model(model: ModelShapes, device: torch.device, use_nvtx: bool) -> list[dict]:
    # On CUDA every workload runs its Triton kernel, forced: the K-FAC products and lowrank_ef
    # default to cuBLAS there, and it is the kernels' cache this warms.
    with tritonopt.use_backend("triton" if device.type == "cuda" else "auto"):
        return _run_workloads(model, device, use_nvtx)


def _run_workloads(model: ModelShapes, device: torch.device, use_nvtx: bool) -> list[dict]:
    rows = []
    for work in workloads(model, device):
        call = work.build()
        label = f"tritonopt/autotune/{model.name}/{work.op}"

        timed = bench.with_range(label, call, use_nvtx)

        timed()  # the first call at a new key bucket tunes
        timing = bench.time_ms(timed, device, cpu_reps=1, cpu_warmup=0)
        rows.append({"model": model.name, "op": work.op,
                     "shape": ";".join(f"{k}={v}" for k, v in work.shape.items()),
                     "ms_p50": timing.p50})
        print(f"  {work.op:<26} {rows[-1]['shape']:<48} {timing.p50:10.3f} ms")
        del call
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def parse_args(argv: list[str] | None):
    parser = bench.bench_parser("Warm and record tritonopt's Triton autotune cache for real model shapes.",
                                smoke_help="shrunken shapes, to check the script")
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["resnet18"],
                        help="models whose shapes to tune (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = bench.cuda_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if not on_gpu:
        print(NO_CUDA_MESSAGE)
    use_nvtx = bench.nvtx_enabled(args.nvtx, device)
    out_dir = bench.output_dir(args.out, bench.device_results_dir(), smoke=args.smoke, name="autotune")
    kernels = autotuned_kernels()
    for name in args.model:
        model = MODELS[name] if on_gpu and not args.smoke else shrink(MODELS[name])
        print(f"{model.name}: {model.num_params:,} parameters, {len(model.layers)} layer shapes, on {bench.device_name()}")
        rows = run_model(model, device, use_nvtx)
        configs = chosen_configs(kernels) if on_gpu else []
        csv_path = bench.write_results(rows, out_dir, f"autotune_{model.name}")
        json_path = Path(out_dir) / f"autotune_{model.name}.json"
        json_path.write_text(json.dumps({"model": model.name, "environment": bench.environment_fields(),
                                         "tuned": on_gpu, "workloads": rows, "chosen_configs": configs},
                                        indent=2) + "\n")
        print(f"wrote {csv_path} and {json_path.name}; {len(configs)} tuned (kernel, key) pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
