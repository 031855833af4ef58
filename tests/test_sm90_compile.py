"""Compile gate for sm_90 (H100): every kernel compiles ahead of time, fits, and does not spill.

No GPU is needed. A subprocess with the Triton interpreter off runs the real
launchers of ``tritonopt.kernels`` on ``meta`` tensors of ResNet-18 and BERT-base
sizes (the shapes ``perf/autotune.py`` tunes for; K-FAC's factors in the padded
layout its preconditioners store them in; the momentum-SGD and SSD-SGD steps on
one flat buffer of all the parameters), records every launch instead
of running it, and compiles each recorded launch with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` through the
``ptxas`` shipped inside the Triton wheel. The arguments are specialised exactly
as Triton specialises them at a real launch (integers divisible by 16, equal to
1, pointer alignment), so the compiled code is the code an H100 would run.

A compiled variant fails the gate on

* a compile error,
* more than ``SPILL_BUDGET_BYTES`` of register spill stores (from the ptxas log),
* more than ``H100_SHARED_BYTES_PER_BLOCK`` of shared memory (it could not launch),
* global loads that are all scalar, in a bandwidth-bound kernel (every kernel
  but those of ``COMPUTE_BOUND_KERNELS``): the PTX has ``ld.global`` but no
  ``ld.global.v2`` / ``.v4``, so each thread moves one element per instruction
  and the kernel cannot reach the bandwidth its floor assumes. The launches where
  no vector load is possible are listed, with the reason, in
  ``SCALAR_LOAD_EXCEPTIONS``; the full sweep also fails on an exception that no
  variant needs any more.

The default suite compiles, for every kernel, the config it runs with at each
shape (the pinned config, or the first config left after shape pruning), at
one representative shape per kernel (one where it must load vectors, if any,
preferably BERT-base's); ``-m compile`` (``make compile-check``)
sweeps every config of every autotune space at every distinct specialisation
of both models.

Run by hand for a table: ``python tests/test_sm90_compile.py [--full] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent

# H100 (sm_90): 228 KB of shared memory per SM, of which a block may use 227 KB.
H100_SHARED_BYTES_PER_BLOCK = 227 * 1024
# Spill stores allowed per kernel. Spills go to local memory (L1, then L2/HBM):
# a few bytes in a loop-free epilogue cost nothing measurable, anything inside
# a streaming loop doubles its memory traffic. Zero until a kernel needs more.
SPILL_BUDGET_BYTES = 0

KERNEL_MODULES = ("ef_topk", "sparse_ring", "lowrank", "kfac", "lanczos", "fosi_step", "sgd_momentum",
                  "ssd_sgd")

# Kernels whose time goes to the tensor cores, not to loads: their operand tiles
# reach shared memory through cp.async, which the ld.global count does not see.
# (The factor update is a GEMM too, but its epilogue streams the old factor, the
# whole cost of a step at a small batch: its loads must be vectors.)
COMPUTE_BOUND_KERNELS = {
    "kfac._gemm_epilogue_kernel": "a tensor-core GEMM; its ld.global read the epilogue's operands once",
}


@dataclass(frozen=True)
class ScalarLoadException:
    """Launches of one kernel whose global loads cannot be vectors, and why."""

    kernel: str
    reason: str
    # Whether the reason holds for a launch: its arguments by name, constexprs and num_warps included.
    applies: Callable[[dict], bool]


def _odd(name: str) -> Callable[[dict], bool]:
    return lambda arguments: arguments[name] % 2 == 1


def _thread_share_within_a_word(*pointers: str) -> Callable[[dict], bool]:
    """Whether each thread's share of a ``BLOCK_K`` row chunk, in the widest of ``pointers``' dtypes, is <= 4 bytes."""
    def applies(arguments):
        entries = arguments["BLOCK_K"] // (32 * arguments.get("num_warps", 4))
        return entries * max(arguments[name].element_size() for name in pointers) <= 4
    return applies


_THREAD_SHARE_WITHIN_A_WORD = (
    "a thread's share of a row chunk, BLOCK_K / (32 num_warps) entries, is at most 4 bytes (at k = 164: one "
    "entry per thread with 8 warps, or two 16-bit ones with 4): one ld.global.b32 already moves all of it, "
    "and the warp's loads coalesce")
_ODD_ROW_LENGTH = ("an odd row length p (at the models' shapes, a Linear layer with its bias column): rows of "
                   "the caller's gradient and error start at every alignment")
SCALAR_LOAD_EXCEPTIONS = (
    ScalarLoadException("kfac._triu_unpack_kernel",
                        "row i of the packed triangle starts at i * dim - i * (i - 1) / 2, at every alignment, "
                        "and half of each output row is a column of the triangle, one entry per packed row",
                        lambda arguments: True),
    ScalarLoadException("sparse_ring._lcg_slice_bounds_kernel",
                        "a binary search: each lane reads the middle entry of its own row's open range, one "
                        "index per row per step (log2 k steps), not a stream",
                        lambda arguments: True),
    ScalarLoadException("sparse_ring._sliced_lcg_kernel",
                        "each row's share of a slice starts at whichever entry the search found, at every "
                        "alignment; a warp's loads of consecutive entries still coalesce",
                        lambda arguments: True),
    ScalarLoadException("sparse_ring._sparse_lcg_kernel", _THREAD_SHARE_WITHIN_A_WORD,
                        _thread_share_within_a_word("idx_ptr", "val_ptr")),
    ScalarLoadException("sparse_ring._ring_insert_kernel", _THREAD_SHARE_WITHIN_A_WORD,
                        _thread_share_within_a_word("new_idx_ptr", "new_val_ptr")),
    ScalarLoadException("lowrank._accumulate_project_kernel", _ODD_ROW_LENGTH, _odd("p")),
    ScalarLoadException("lowrank._back_project_kernel", _ODD_ROW_LENGTH, _odd("p")),
    ScalarLoadException("lowrank._residual_kernel", _ODD_ROW_LENGTH, _odd("p")),
)


def scalar_load_exception(kernel: str, arguments: dict) -> str:
    """The reason a launch of ``kernel`` may load only scalars, or "" where it must load vectors."""
    for exception in SCALAR_LOAD_EXCEPTIONS:
        if exception.kernel == kernel and exception.applies(arguments):
            return exception.reason
    return ""


@dataclass
class Variant:
    """One compiled kernel at one config and one argument specialisation."""

    kernel: str  # module.name
    shape: str  # where the launch came from (model and workload)
    config: str  # the autotune config (or "launch" for an un-tuned kernel)
    # The config a launch at this shape runs without timing: the pinned one, or for
    # a timed kernel the first left after pruning (timing may pick another).
    used: bool
    registers: int = -1
    spill_bytes: int = -1
    shared_bytes: int = -1
    vector_loads: int = -1  # ld.global.v2/.v4 instructions in the PTX
    scalar_loads: int = -1  # single-element ld.global instructions
    scalar_exception: str = ""  # why this launch may load only scalars (SCALAR_LOAD_EXCEPTIONS), or ""
    error: str = ""

    def loads(self) -> str:
        """"vector" (some ld.global.v2/.v4), "scalar" (ld.global, none of them vectors) or "none"."""
        if self.vector_loads > 0:
            return "vector"
        return "scalar" if self.scalar_loads > 0 else "none"

    def problems(self) -> list[str]:
        if self.error:
            return [f"compile error: {self.error}"]
        found = []
        if self.spill_bytes > SPILL_BUDGET_BYTES:
            found.append(f"{self.spill_bytes} bytes of spill stores (budget {SPILL_BUDGET_BYTES})")
        if self.shared_bytes > H100_SHARED_BYTES_PER_BLOCK:
            found.append(f"{self.shared_bytes} bytes of shared memory (H100 limit {H100_SHARED_BYTES_PER_BLOCK})")
        if (self.loads() == "scalar" and self.kernel not in COMPUTE_BOUND_KERNELS
                and not self.scalar_exception):
            found.append(f"{self.scalar_loads} scalar global loads and no vector load in a bandwidth-bound "
                         "kernel (vectorise them, or add a justified SCALAR_LOAD_EXCEPTIONS entry)")
        return found

    def label(self) -> str:
        return f"{self.kernel} [{self.shape}] {self.config}"


# =========================================================================== worker
# Everything below up to the tests runs in the subprocess (interpreter off).


@dataclass
class _Launch:
    kernel: str
    tuner: object  # the decorated kernel object (Autotuner or JITFunction)
    args: tuple
    kwargs: dict
    shape: str = ""


@dataclass
class _Recorder:
    """Stands in for a kernel object: ``kernel[grid](...)`` records the launch."""

    name: str
    target: object
    sink: list = field(default_factory=list)
    shape: str = ""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(_Launch(self.name, self.target, args, kwargs, self.shape))

        return launch

    @property
    def fn(self):  # launchers reach ``kernel.fn`` to bypass autotuning
        return self

    @property
    def tuning_space(self):  # launchers size buffers from the config space
        return getattr(self.target, "tuning_space", None)


def _kernel_objects() -> dict:
    """Every ``*_kernel`` of ``tritonopt.kernels``: ``{"module.name": (module, object)}``."""
    import importlib

    from triton.runtime.jit import JITFunction, KernelInterface

    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"tritonopt.kernels.{module_name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and isinstance(obj, (JITFunction, KernelInterface)):
                found[f"{module_name}.{name}"] = (module, obj)
    return found


@contextlib.contextmanager
def _recording(kernels: dict, sink: list):
    """Swap every kernel of ``kernels`` for a :class:`_Recorder` inside the block."""
    recorders = {}
    for name, (module, obj) in kernels.items():
        recorders[name] = _Recorder(name, obj, sink)
        setattr(module, name.split(".", 1)[1], recorders[name])
    try:
        yield recorders
    finally:
        for name, (module, obj) in kernels.items():
            setattr(module, name.split(".", 1)[1], obj)


def _model_launches(kernels: dict, model_names: list[str]) -> list[_Launch]:
    """Run every launcher on meta tensors at the models' shapes; return the recorded launches."""
    import torch

    sys.path.insert(0, str(REPO_ROOT / "perf"))
    import autotune as perf_autotune

    from tritonopt.kernels import (ef_topk, fosi_step, kfac, lanczos, lowrank, sgd_momentum, sparse_ring,
                                   ssd_sgd)
    from tritonopt.optim._blocks import kept_per_block
    from tritonopt.optim.kfac_functional import factor_buffer

    meta = torch.device("meta")

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=meta)

    def factor(dim):  # a [dim, dim] factor as K-FAC stores it (rows padded from 128 columns on)
        return factor_buffer(dim, device=meta)

    sink: list[_Launch] = []
    with _recording(kernels, sink) as recorders:

        def label(text):
            for recorder in recorders.values():
                recorder.shape = text

        for model_name in model_names:
            model = perf_autotune.MODELS[model_name]
            n = model.num_params
            # SparseAdaGrad's default, a middle size, M-FAC/GGT's default, a long row, and the
            # whole model as one block (a global Top-k, as EFCP's code takes it).
            for block_size in (4096, 8192, model.block_size, 4 * model.block_size, n):
                num_blocks = math.ceil(n / block_size)
                k = kept_per_block(model.density, None, block_size)
                label(f"{model_name} ef_topk blocks={num_blocks}x{block_size} k={k}")
                ef_topk.ef_topk_triton(empty(num_blocks, block_size), empty(num_blocks, block_size), k)

            num_blocks = math.ceil(n / model.block_size)
            k = kept_per_block(model.density, None, model.block_size)
            m = model.ring_m
            label(f"{model_name} ring blocks={num_blocks} m={m} k={k}")
            # int16 positions are what the optimizers store for blocks up to 32768; int32 above.
            for index_dtype in (torch.int16, torch.int32):
                indices = empty(num_blocks, m, k, dtype=index_dtype)
                for values_dtype in (torch.float32, torch.bfloat16):
                    values = empty(num_blocks, m, k, dtype=values_dtype)
                    sparse_ring.sparse_sp_triton(indices, values, empty(num_blocks, model.block_size))
                    sparse_ring.sparse_lcg_triton(indices, values, empty(m), model.block_size)
                    sparse_ring.sparse_ring_insert_triton(
                        indices, values, 1, empty(num_blocks, k, dtype=index_dtype), empty(num_blocks, k)
                    )
            # The whole model as one block (a global Top-k): the sliced LCG.
            k_global = kept_per_block(model.density, None, n)
            label(f"{model_name} ring blocks=1 of {n} m={m} k={k_global}")
            for values_dtype in (torch.float32, torch.bfloat16):
                sparse_ring.sparse_lcg_triton(empty(1, m, k_global, dtype=torch.int32),
                                              empty(1, m, k_global, dtype=values_dtype), empty(m), n, True)

            for layer in dict.fromkeys(model.layers):
                g, a, rows = layer.g, layer.a, layer.rows
                label(f"{model_name} lowrank {g}x{a} rank={model.lowrank_rank}")
                lowrank.lowrank_ef_triton(empty(g, a), empty(g, a), empty(a, model.lowrank_rank))
                label(f"{model_name} kfac layer g={g} a={a} rows={rows}")
                # A odd `a` is a Linear with bias: the kernel appends the column of ones.
                has_bias = a % 2 == 1 and a > 3 * 49
                in_dim = a - 1 if has_bias else a
                # The default precision everywhere; the other two at BERT's layers.
                precisions = kfac.PRECISIONS if model_name == "bert-base" else (kfac.DEFAULT_PRECISION,)
                for precision in precisions:
                    label(f"{model_name} kfac layer g={g} a={a} rows={rows} {precision}")
                    kfac.kfac_factor_update_triton(factor(a), empty(rows, in_dim), 0.95, has_bias, 1.0,
                                                   precision)
                    kfac.kfac_factor_update_triton(factor(g), empty(rows, g), 0.95, False, 1.0,
                                                   precision)
                    kfac.eigenbasis_precondition_prediv_triton(empty(g, a), empty(a, a), empty(g, g), empty(g, a),
                                                               precision)
                    kfac.eigenbasis_precondition_triton(empty(g, a), empty(a, a), empty(a), empty(g, g), empty(g),
                                                        1e-3, precision)
                for dim in (a, g):
                    label(f"{model_name} kfac factor {dim}x{dim}")
                    kfac.triu_pack_triton(factor(dim), torch.bfloat16)
                    kfac.triu_unpack_triton(empty(dim * (dim + 1) // 2, dtype=torch.bfloat16), dim,
                                            torch.float32)

            label(f"{model_name} lanczos n={n} m={model.lanczos_m}")
            lanczos.gram_schmidt_project_triton(empty(model.lanczos_m, n), empty(n), model.lanczos_m, 2)
            padded = -(-n // 16) * 16  # a basis allocated with its row stride rounded up to 16
            label(f"{model_name} lanczos n={n} m={model.lanczos_m} row stride {padded}")
            lanczos.gram_schmidt_project_triton(empty(model.lanczos_m, padded)[:, :n], empty(n),
                                                model.lanczos_m, 2)
            for rank in (model.fosi_rank, 2 * model.fosi_rank, 4 * model.fosi_rank, fosi_step.MAX_RANK):
                for stride in (n, padded):
                    label(f"{model_name} fosi n={n} r={rank}" + (f" row stride {stride}" if stride != n else ""))
                    for base in fosi_step.BASES:
                        fosi_step.fosi_step_triton(
                            empty(n), empty(n), empty(rank, stride)[:, :n], empty(rank), empty(n), empty(n), None,
                            base, 1e-3, 0.9, 0.999, 1e-8, 3, 1.0, 0.0, 1.0,
                        )

            # One flat buffer of all the parameters, as FlatSGD, a DSP stage and SSD-SGD update them.
            label(f"{model_name} flat buffer n={n}")
            for grad_dtype in (torch.float32, torch.bfloat16):
                # Plain SGD; momentum SGD's first step and a later one; Nesterov with weight decay.
                sgd_settings = ((0.0, False, False, 0.0), (0.9, True, False, 0.0), (0.9, False, False, 5e-4),
                                (0.9, False, True, 5e-4))
                for momentum, first_step, nesterov, weight_decay in sgd_settings:
                    sgd_momentum.sgd_momentum_step_triton(
                        empty(n), empty(n, dtype=grad_dtype), empty(n), lr=0.1, momentum=momentum,
                        dampening=0.0, weight_decay=weight_decay, nesterov=nesterov, maximize=False,
                        first_step=first_step,
                    )
            for param_dtype in (torch.float32, torch.bfloat16):
                # A local step and a pulled one (saving the pulled momentum or not) with shadow
                # buffers; both without them (the GLU part alone).
                ssd_settings = ((False, True, False), (True, True, True), (True, True, False),
                                (False, False, False), (True, False, False))
                for pulled, shadow, save_momentum in ssd_settings:
                    shadow_buffers = (empty(n), empty(n)) if shadow else (None, None)
                    ssd_sgd.ssd_sgd_step_triton(
                        empty(n, dtype=param_dtype), empty(n, dtype=param_dtype), empty(n),
                        *shadow_buffers, empty(n) if save_momentum else None,
                        0.1, 0.9, 1e-4, 0.1, 1e-4, 1.0, 0.5, 0.1, 0.5 if pulled and shadow else 1.0, pulled,
                    )
    return sink


def _config_space(tuner, launch: _Launch) -> list[tuple[str, dict, bool]]:
    """``(config label, launch kwargs, used)`` for every config the gate compiles for one launch."""
    from tritonopt._runtime import tuning_space

    space = tuning_space(tuner)
    if space is None:  # a plain @jit kernel: one variant, as launched
        return [("launch", dict(launch.kwargs), True)]
    key_args = space.key_arguments(launch.args, launch.kwargs)
    candidates = space.launchable(key_args)
    chosen = space.choose(key_args)
    out = []
    for config in candidates:
        kwargs = {**launch.kwargs, **config.all_kwargs()}
        out.append((_config_label(config), kwargs, config is chosen))
    return out


def _config_label(config) -> str:
    fields = [f"{k}={v}" for k, v in config.kwargs.items()]
    fields += [f"warps={config.num_warps}", f"stages={config.num_stages}"]
    return ",".join(fields)


def _jit_function(obj):
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores")
_PTX_LOAD = re.compile(r"ld\.global(?:\.[a-z0-9]+)*")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _compile(jit_fn, args: tuple, kwargs: dict):
    """Compile one launch for sm_90 as ``JITFunction.run`` would; returns (kernel, ptxas log)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound_args, specialization, options)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
    return kernel, log.getvalue()


def _resources(kernel, log: str) -> tuple[int, int, int]:
    """(registers, spill-store bytes, shared bytes) of a compiled kernel."""
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILL.search(log)
    if regs is None or spills is None:  # the log was not printed: run ptxas -v on the PTX ourselves
        from triton.backends.nvidia.compiler import get_ptxas

        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(kernel.asm["ptx"])
            result = subprocess.run(
                [get_ptxas(90).path, "-v", "--gpu-name=sm_90a",
                 str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                capture_output=True, text=True, check=True,
            )
        log = result.stderr + result.stdout
        regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILL.search(log)
    shared = kernel.metadata.shared
    return int(regs.group(1)), int(spills.group(1)), int(shared)


def _compile_job(job):
    """Pool worker: compile one variant. ``job`` is (variant dict, launch index, kwargs)."""
    variant, launch_index, kwargs = job
    launch = _LAUNCHES[launch_index]
    result = Variant(**variant)
    try:
        jit_fn = _jit_function(launch.tuner)
        arguments = {**dict(zip(jit_fn.arg_names, launch.args)), **kwargs}
        result.scalar_exception = scalar_load_exception(launch.kernel, arguments)
        kernel, log = _compile(jit_fn, launch.args, kwargs)
        result.registers, result.spill_bytes, result.shared_bytes = _resources(kernel, log)
        loads = _PTX_LOAD.findall(kernel.asm["ptx"])
        result.vector_loads = sum(1 for op in loads if ".v2" in op or ".v4" in op)
        result.scalar_loads = len(loads) - result.vector_loads
    except Exception as exc:  # reported, not raised: the gate lists every failure
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return asdict(result)


_LAUNCHES: list[_Launch] = []


def _specialisation_key(launch: _Launch, kwargs: dict):
    """What decides the compiled code: the kernel, the specialised signature and the options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit_fn = _jit_function(launch.tuner)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    _, specialization, _ = binder(*launch.args, **kwargs)
    options = {k: v for k, v in sorted(kwargs.items()) if k not in jit_fn.arg_names}
    constexprs = {k: v for k, v in sorted(kwargs.items()) if k in jit_fn.arg_names}
    return (launch.kernel, repr(specialization), repr(options), repr(constexprs))


def run_gate(full: bool, models: list[str], workers: int, only: str = "") -> dict:
    """Compile the variants; return ``{"variants", "kernels", "uncovered", "triton"}``."""
    import multiprocessing

    import triton

    kernels = _kernel_objects()
    launches = _model_launches(kernels, models)
    _LAUNCHES[:] = launches
    covered = {launch.kernel for launch in launches}
    selected = [(index, launch) for index, launch in enumerate(launches) if only in launch.kernel]
    if not full:  # one representative shape per kernel: its first launch that must load vectors (no
        # scalar-load exception covers it), at the last model if it has one; else its first at the last model
        def preference(item):
            index, launch = item
            arguments = {**dict(zip(_jit_function(launch.tuner).arg_names, launch.args)), **launch.kwargs}
            excepted = bool(scalar_load_exception(launch.kernel, arguments))
            return excepted, not launch.shape.startswith(models[-1] + " "), index

        representative = {}
        for item in selected:
            kernel = item[1].kernel
            if kernel not in representative or preference(item) < preference(representative[kernel]):
                representative[kernel] = item
        selected = sorted(representative.values(), key=lambda item: item[0])
    jobs, seen = [], set()
    for index, launch in selected:
        for config_label, kwargs, used in _config_space(launch.tuner, launch):
            if not (full or used):
                continue
            key = _specialisation_key(launch, kwargs)
            if key in seen:  # the same code as a variant already listed
                continue
            seen.add(key)
            jobs.append((asdict(Variant(launch.kernel, launch.shape, config_label, used)), index, kwargs))
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            variants = pool.map(_compile_job, jobs, chunksize=1)
    else:
        variants = [_compile_job(job) for job in jobs]
    return {"triton": triton.__version__, "variants": variants, "kernels": sorted(kernels),
            "uncovered": sorted(set(kernels) - covered)}


_WORKER_FLAG = "TRITONOPT_SM90_WORKER"


def _worker_environment(cache_dir: str) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compile, do not interpret
    env["TRITONOPT_AUTOTUNE"] = "1"  # the default mode: timed and pinned kernels as on a GPU
    env["TRITON_DUMP_PTXAS_LOG"] = "1"
    env["TRITON_CACHE_DIR"] = cache_dir  # an empty cache: ptxas runs and prints its log
    env[_WORKER_FLAG] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def run_gate_subprocess(full: bool, models=("resnet18", "bert-base"), timeout: float = 3600,
                        only: str = "") -> dict:
    """Run :func:`run_gate` in a fresh interpreter-free process; the parsed JSON result."""
    with tempfile.TemporaryDirectory(prefix="tritonopt-sm90-") as tmp:
        out = Path(tmp) / "gate.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--json", str(out), "--models", *models]
        if full:
            command.append("--full")
        if only:
            command += ["--only", only]
        result = subprocess.run(command, env=_worker_environment(str(Path(tmp) / "cache")),
                                capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0 or not out.exists():
            raise RuntimeError(f"the sm_90 compile worker failed ({result.returncode}):\n"
                               f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return json.loads(out.read_text())


def _loads_column(variant: Variant) -> str:
    if variant.loads() != "scalar":
        return variant.loads()
    if variant.kernel in COMPUTE_BOUND_KERNELS:
        return "scalar (GEMM)"
    return "scalar (exc.)" if variant.scalar_exception else "SCALAR"


def format_table(variants: list[dict]) -> str:
    """One line per variant; "loads" is vector, scalar (excepted or a GEMM), SCALAR (fails) or none."""
    lines = [f"{'kernel':<42} {'regs':>4} {'spill':>6} {'smem':>7} {'ld.v':>4} {'ld.1':>4} {'loads':<13} "
             f"{'used':>4}  config / shape"]
    for v in sorted(variants, key=lambda v: (v["kernel"], v["shape"], v["config"])):
        status = v["error"] or ""
        lines.append(f"{v['kernel']:<42} {v['registers']:>4} {v['spill_bytes']:>6} {v['shared_bytes']:>7} "
                     f"{v['vector_loads']:>4} {v['scalar_loads']:>4} {_loads_column(Variant(**v)):<13} "
                     f"{'yes' if v['used'] else '':>4}  {v['config']} / {v['shape']} {status}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every config at every specialisation")
    parser.add_argument("--models", nargs="+", default=["resnet18", "bert-base"])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--only", default="", help="compile only kernels whose name contains this")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if os.environ.get(_WORKER_FLAG) != "1":  # run by hand: re-run in the worker environment
        with tempfile.TemporaryDirectory(prefix="tritonopt-sm90-") as cache_dir:
            return subprocess.run([sys.executable, *sys.argv], env=_worker_environment(cache_dir)).returncode
    result = run_gate(args.full, args.models, args.workers, args.only)
    if args.json is not None:
        args.json.write_text(json.dumps(result))
    else:
        print(f"triton {result['triton']}")
        print(format_table(result["variants"]))
        excepted = {v["kernel"]: v["scalar_exception"] for v in result["variants"]
                    if v["scalar_exception"] and Variant(**v).loads() == "scalar"}
        for kernel, reason in sorted(excepted.items()):
            print(f"scalar loads allowed in {kernel}: {reason}")
        if result["uncovered"]:
            print("no launch recorded for:", ", ".join(result["uncovered"]))
    return 0


if __name__ == "__main__":
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())


# =========================================================================== tests

import pytest  # noqa: E402

from tritonopt._runtime import HAS_TRITON  # noqa: E402


def _cuda_backend_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not (HAS_TRITON and _cuda_backend_available()), reason="needs Triton with its NVIDIA backend"
)


def _assert_gate(result: dict) -> None:
    assert result["variants"], "no kernel variant was compiled"
    assert not result["uncovered"], f"kernels the gate never launched: {result['uncovered']}"
    failures = [f"{Variant(**v).label()}: {'; '.join(Variant(**v).problems())}"
                for v in result["variants"] if Variant(**v).problems()]
    assert not failures, "sm_90 compile gate:\n" + "\n".join(failures)


def test_every_kernel_compiles_for_sm90_at_its_used_config():
    """Default suite: each kernel at the config it runs with, one representative shape."""
    result = run_gate_subprocess(full=False)
    _assert_gate(result)
    assert {v["kernel"] for v in result["variants"]} == set(result["kernels"])


def test_flat_buffer_kernels_load_vectors_at_a_length_triton_does_not_see_aligned():
    """ResNet-18's 11,689,512 parameters are a multiple of 8 but not of 16, the only divisor
    Triton specialises on: the momentum-SGD and SSD-SGD steps still load vectors (the
    default suite's representative shape, BERT-base's, is a multiple of 16)."""
    result = run_gate_subprocess(full=False, models=("resnet18",), only="sgd")
    _assert_gate(result)
    variants = [Variant(**v) for v in result["variants"]]
    assert {v.kernel for v in variants} == {"sgd_momentum._sgd_momentum_kernel",
                                            "ssd_sgd._ssd_sgd_step_kernel"}
    assert all(v.shape == "resnet18 flat buffer n=11689512" and v.loads() == "vector"
               for v in variants), format_table(result["variants"])


@pytest.mark.compile
def test_every_config_compiles_for_sm90_at_model_shapes():
    """Full sweep: every config of every autotune space at every specialisation of both models."""
    result = run_gate_subprocess(full=True)
    _assert_gate(result)
    # An exception no variant needs any more (its loads became vectors) must go: it would hide a regression.
    needed = {(v["kernel"], v["scalar_exception"]) for v in result["variants"]
              if v["scalar_exception"] and Variant(**v).loads() == "scalar"}
    stale = [f"{e.kernel}: {e.reason}" for e in SCALAR_LOAD_EXCEPTIONS if (e.kernel, e.reason) not in needed]
    assert not stale, "scalar-load exceptions that no variant needs:\n" + "\n".join(stale)


def test_variant_problems_are_detected():
    """The gate's thresholds catch what they claim to (a gate that cannot fail checks nothing)."""
    ok = Variant("k", "s", "c", True, registers=64, spill_bytes=0, shared_bytes=1024)
    assert ok.problems() == []
    assert "spill" in Variant("k", "s", "c", True, 255, SPILL_BUDGET_BYTES + 4, 0).problems()[0]
    assert "shared" in Variant("k", "s", "c", True, 64, 0, 262_144).problems()[0]
    assert "compile error" in Variant("k", "s", "c", True, error="PTXASError").problems()[0]


def test_scalar_only_loads_of_a_bandwidth_bound_kernel_fail_the_gate():
    """Only vector loads pass a bandwidth-bound kernel, unless a listed reason covers the launch."""
    def variant(kernel, vector, scalar, exception=""):
        return Variant(kernel, "s", "c", True, 32, 0, 0, vector_loads=vector, scalar_loads=scalar,
                       scalar_exception=exception)

    assert variant("sparse_ring._sparse_sp_kernel", 8, 16).problems() == []  # a gather beside vectors
    assert variant("sparse_ring._sparse_sp_kernel", 0, 0).problems() == []  # no global load at all
    assert "scalar global loads" in variant("sparse_ring._sparse_sp_kernel", 0, 48).problems()[0]
    assert variant("kfac._triu_unpack_kernel", 0, 8, "a reason").problems() == []
    assert variant("kfac._gemm_epilogue_kernel", 0, 32).problems() == []  # compute-bound


def test_scalar_load_exceptions_name_kernels_and_hold_only_where_their_reason_does():
    from triton.runtime.jit import JITFunction, KernelInterface

    def kernel_names(module_name):
        module = __import__(f"tritonopt.kernels.{module_name}", fromlist=["_"])
        return {f"{module_name}.{name}" for name, obj in vars(module).items()
                if name.endswith("_kernel") and isinstance(obj, (JITFunction, KernelInterface))}

    known = set().union(*(kernel_names(name) for name in KERNEL_MODULES))
    for exception in SCALAR_LOAD_EXCEPTIONS:
        assert exception.kernel in known and exception.kernel not in COMPUTE_BOUND_KERNELS, exception.kernel
        assert len(exception.reason) > 40, exception.kernel
    assert set(COMPUTE_BOUND_KERNELS) <= known
    # Odd row lengths are excepted, even ones are not: an even p must load vectors.
    assert scalar_load_exception("lowrank._residual_kernel", {"p": 769})
    assert scalar_load_exception("lowrank._residual_kernel", {"p": 768}) == ""
    # K-FAC pads the rows of its factors: a factor of odd dim loads in vectors too.
    assert scalar_load_exception("kfac._triu_pack_kernel", {"stride_r": 772}) == ""
    assert scalar_load_exception("sparse_ring._sparse_sp_kernel", {"k": 41}) == ""
    # LCG at k = 164 (chunks of 256) with 4 warps: two entries per thread, 8 bytes with float32 values.
    import torch

    lcg = {"BLOCK_K": 256, "num_warps": 4, "idx_ptr": torch.empty(0, dtype=torch.int16, device="meta")}
    assert scalar_load_exception("sparse_ring._sparse_lcg_kernel",
                                 {**lcg, "val_ptr": torch.empty(0, dtype=torch.float32, device="meta")}) == ""
    assert scalar_load_exception("sparse_ring._sparse_lcg_kernel",
                                 {**lcg, "val_ptr": torch.empty(0, dtype=torch.bfloat16, device="meta")})
