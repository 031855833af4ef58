"""tritonopt's optimizers on FSDP2-sharded models: state per rank, step time and bytes communicated, W = 1, 2, 4.

Each optimizer that steps DTensor parameters (``SparseAdaGrad``, ``MFAC``, ``SparseMFAC``,
``GGT``, ``SparseGGT``), ``KAISA`` (``KAISAPreconditioner`` in front of SGD with momentum,
COMM-OPT, eigendecompositions every 10 steps) and ``torch.optim.Adam`` beside them, steps two
models on W gloo ranks of this machine, one torch thread each (KAISA's first step on ResNet-18
decomposes factors up to 4608 x 4608: about a minute per W on a CPU). At W >= 2 every module
is ``fully_shard``'ed (FSDP2, a 1-D mesh) and each rank trains on its own batch; W = 1 is the
unsharded optimizer on the plain model. The models:

* ``resnet18``: ResNet-18 (11,689,512 parameters, ``perf/_models.py``) on 32x32 images,
  batches of 4 per rank (small images: the optimizers see every parameter, the forward
  stays cheap on a CPU);
* ``transformer``: one ``nn.TransformerEncoderLayer`` of width 512 (8 heads, feed-forward
  2048: 3,152,384 parameters), sequences of 32 tokens, batches of 4 per rank.

Windows of ``ngrads = 8`` gradients; the sparse ones keep 1 % of each block of 4096. Each
optimizer takes ``--steps`` steps (default 6) on a model built afresh; per rank:

* ``state``: ``opt.state_bytes()`` (Adam: the bytes of its state tensors' local parts,
  each storage once; KAISA: ``memory_usage()["total"]`` plus SGD's momentum), after the last step;
* ``step ms``: the median time of ``opt.step()`` (KAISA: ``kaisa.step()`` and SGD's) over the
  steps after the first (which allocates the state), the slowest rank's;
* ``communicated``: the bytes ``opt.shard_group`` all-reduced, per step; for KAISA the bytes its
  gradient gather (``grad_allgather``, what sharding adds to KAISA's collectives) received.

Checks (exit status 1 if one fails; the smoke run checks them too, bytes and sizes are exact):

* every rank all-reduces ``8 m + 4`` bytes per step in 2 calls for the window family (the
  ``m`` float64 products ``G x`` and one float32 for the ranks' shared non-finite check),
  ``4`` bytes in 1 call for ``SparseAdaGrad``; KAISA gathers ``4 (W - 1) sum ceil(r / W) c``
  bytes in 1 call (the ``r x c`` weights and biases of its layers,
  ``tritonopt.dist.kaisa_sharded.expected_gather_bytes``);
* every rank's state is 1/W of W = 1's, within a stated tolerance: the replicated parts
  (the ``m x m`` float64 Gram matrix and one float32 step counter per parameter, whole on
  every rank) are added, not divided; the sharded rest may exceed its share by rank 0's
  padding (every rank pads its window to rank 0's part, which holds ``ceil(rows / W)`` rows
  of each parameter, rounded up to whole blocks for the blockwise ones; Adam's ranks hold
  their own rows), and 1 % more either way. KAISA's K-FAC memory (factors, statistic buffers,
  eigen data: every layer's on every rank at COMM-OPT) is whole on every rank and must equal
  ``kaisa.expected_memory()``; SGD's momentum is shared as Adam's state is.

Times come from W processes sharing this machine's cores: with more ranks than cores, or
other work running, they measure the machine as much as the optimizer. Bytes are exact.

Run from the repository root (about 8 minutes on 2 CPU cores, KAISA 4 of them)::

    python -m perf.bench_sharded [--worlds 1 2 4] [--steps 4] [--only MFAC GGT ...] [--out DIR]
    python -m perf.bench_sharded --smoke     # tiny models, W = 1 and 2, one step: seconds
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_sharded.py
    import _as_module

    _as_module.run(__file__)

import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from perf import _harness as harness
from perf import _ranks as ranks
from perf._models import BasicBlock, resnet18

NAME = "sharded"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
WORLDS, SMOKE_WORLDS = (1, 2, 4), (1, 2)
STEPS, SMOKE_STEPS = 6, 1
NGRADS = 8
DENSITY, BLOCK_SIZE = 0.01, 4096
# The sharded part of a rank's state may exceed its predicted share (padding included) by this fraction.
STATE_SLACK = 0.01
OPTIMIZERS = ("SparseAdaGrad", "MFAC", "SparseMFAC", "GGT", "SparseGGT", "KAISA", "Adam")
# The models an optimizer runs on, where not all (see the module docstring).
ONLY_ON: dict = {}  # optimizer -> the only models it runs on (none restricted)
KAISA_INV_UPDATE_STEPS = 10
WINDOW_FAMILY = ("MFAC", "SparseMFAC", "GGT", "SparseGGT")
BLOCKWISE = ("SparseAdaGrad", "SparseMFAC", "SparseGGT")


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Workload:
    """A model, the modules ``fully_shard`` wraps, and a loss on one rank's batch."""

    name: str
    build: Callable[[], nn.Module]
    shard_units: Callable[[nn.Module], list]  # wrapped before the root, which takes the rest
    loss: Callable[[nn.Module, torch.Generator], torch.Tensor]


def _resnet(num_classes: int, width: int, image: int, batch: int) -> Workload:
    def loss(model, gen):
        x = torch.randn(batch, 3, image, image, generator=gen)
        y = torch.randint(0, num_classes, (batch,), generator=gen)
        return nn.functional.cross_entropy(model(x), y)

    # One FSDP2 unit per BasicBlock, as FSDP2 wraps ResNets; the stem and the head go with the root.
    return Workload("resnet18", lambda: resnet18(num_classes=num_classes, width=width),
                    lambda model: [m for m in model if isinstance(m, BasicBlock)], loss)


def _transformer(width: int, heads: int, feedforward: int, tokens: int, batch: int) -> Workload:
    def build():
        return nn.TransformerEncoderLayer(width, heads, feedforward, dropout=0.0, batch_first=True)

    def loss(model, gen):
        x = torch.randn(batch, tokens, width, generator=gen)
        return nn.functional.mse_loss(model(x), torch.randn(batch, tokens, width, generator=gen))

    return Workload("transformer", build, lambda model: [], loss)


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        return [_resnet(num_classes=10, width=4, image=16, batch=4),
                _transformer(width=64, heads=2, feedforward=128, tokens=8, batch=2)]
    return [_resnet(num_classes=1000, width=64, image=32, batch=4),
            _transformer(width=512, heads=8, feedforward=2048, tokens=32, batch=4)]


def build_model(workload: Workload, world: int) -> nn.Module:
    """The same initial model on every rank; FSDP2-sharded over all ranks when ``world > 1``."""
    torch.manual_seed(0)
    model = workload.build()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for unit in workload.shard_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


class KAISAStep:
    """``KAISAPreconditioner`` (COMM-OPT) in front of SGD with momentum, stepped as one optimizer."""

    def __init__(self, model: nn.Module):
        import tritonopt

        self.sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        # out_proj's weight is used by MultiheadAttention directly, its forward never runs: no factors.
        self.kaisa = tritonopt.dist.KAISAPreconditioner(model, lr=1e-3, skip_layers=("out_proj",),
                                                        inv_update_steps=KAISA_INV_UPDATE_STEPS)

    def zero_grad(self, set_to_none: bool = True):
        self.sgd.zero_grad(set_to_none=set_to_none)

    def step(self):
        if self.kaisa.step():
            self.sgd.step()

    def state_bytes(self) -> int:
        return self.kaisa.memory_usage()["total"] + local_state_bytes(self.sgd)

    def gathered(self) -> tuple[int, int]:
        """(bytes received, calls) of the gradient gather so far."""
        stats = self.kaisa.communicator.stats().get("grad_allgather")
        return (0, 0) if stats is None else (stats.bytes_received, stats.calls)

    def expected_gather_bytes(self, world: int) -> int:
        """What the gather should receive per step, from the layers' shapes (0 on an unsharded model)."""
        from tritonopt.dist.kaisa_sharded import expected_gather_bytes

        sharded = self.kaisa.sharded
        return 0 if sharded is None else expected_gather_bytes(sharded.row_sharded_shapes(), world)["received"]


def runs_on(name: str, workload: Workload) -> bool:
    return workload.name in ONLY_ON.get(name, (workload.name,))


def build_optimizer(name: str, model: nn.Module):
    import tritonopt

    params = model.parameters()
    if name == "Adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "KAISA":
        return KAISAStep(model)
    settings = {
        "SparseAdaGrad": dict(lr=0.01, density=DENSITY, block_size=BLOCK_SIZE),
        "MFAC": dict(lr=1e-3, ngrads=NGRADS, damp=0.1),
        "SparseMFAC": dict(lr=1e-3, ngrads=NGRADS, damp=0.1, density=DENSITY, block_size=BLOCK_SIZE),
        "GGT": dict(lr=1e-3, ngrads=NGRADS, eps=0.1),
        "SparseGGT": dict(lr=1e-3, ngrads=NGRADS, eps=0.1, density=DENSITY, block_size=BLOCK_SIZE),
    }[name]
    return getattr(tritonopt.optim, name)(params, **settings)


# --------------------------------------------------------------------------- what is measured


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the rank's own part of every state tensor, each storage once (torch's optimizers)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def state_bytes(name: str, optimizer) -> int:
    return local_state_bytes(optimizer) if name == "Adam" else optimizer.state_bytes()


# Optimizers whose ranks keep their own rows, unpadded (the last rank the fewest).
OWN_ROWS = ("Adam", "KAISA")


def replicated_bytes(row: dict) -> int:
    """State every rank holds whole: a float32 step counter per parameter, the window's m x m float64 Gram matrix;
    KAISA's K-FAC memory as ``expected_memory()`` gives it (SGD keeps no step counter)."""
    name = row["optimizer"]
    if name == "KAISA":
        return row["kfac_expected_bytes"]
    return 4 * row["num_params"] + (8 * NGRADS * NGRADS if name in WINDOW_FAMILY else 0)


def communicated_per_step(row: dict) -> tuple[int, int]:
    """(bytes, calls) a sharded step all-reduces (the m float64 products and the float32 non-finite check), or,
    for KAISA, gathers (the formula's bytes, computed on the rank from the layers' shapes)."""
    name = row["optimizer"]
    if name in WINDOW_FAMILY:
        return 8 * NGRADS + 4, 2
    if name == "SparseAdaGrad":
        return 4, 1
    if name == "KAISA":
        return row["expected_bytes_per_step"], 1
    return 0, 0  # Adam: none of its own (FSDP2's collectives move the gradients)


def rank_columns(shapes: list[tuple], world: int, rank: int, block_size: int = 1) -> int:
    """Entries of ``rank``'s part of the parameters, rounded up to whole blocks.

    FSDP2 cuts each parameter's rows as ``torch.chunk`` does: ``ceil(rows / W)`` to each
    rank in turn, the last ranks fewer or none. Rank 0's part is the span every rank pads
    its window and buffers to.
    """
    entries = 0
    for rows, *rest in shapes:
        chunk = -(-rows // world)
        entries += max(0, min(chunk, rows - rank * chunk)) * math.prod(rest)
    return -(-entries // block_size) * block_size


def measure(rank: int, world: int, workload: Workload, name: str, steps: int) -> dict:
    """Build ``workload``'s model and ``name`` over it, take ``steps`` steps; this rank's numbers."""
    model = build_model(workload, world)
    optimizer = build_optimizer(name, model)
    step_ms = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        loss = workload.loss(model, gen)
        loss.backward()
        dist.barrier()  # the ranks start the step together: the time is the step's, not the backward's skew
        began = time.perf_counter()
        optimizer.step()
        step_ms.append(1e3 * (time.perf_counter() - began))
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"{name} on {workload.name}: the loss is {float(loss.detach())} at step {step}")
    group = getattr(optimizer, "shard_group", None)
    params = list(model.parameters())
    communicated, calls = (group.bytes_all_reduced, group.all_reduce_calls) if group is not None else (0, 0)
    extra = {}
    if name == "KAISA":
        communicated, calls = optimizer.gathered()
        extra = {"kfac_expected_bytes": optimizer.kaisa.expected_memory()["total"],
                 "expected_bytes_per_step": optimizer.expected_gather_bytes(world)}
    return {
        "rank": rank, "state_bytes": state_bytes(name, optimizer),
        "step_ms": step_ms[1:] or step_ms,  # the first step allocates the state: not timed when others are
        "bytes_all_reduced": communicated, "all_reduce_calls": calls,
        "num_params": len(params), "shapes": [tuple(p.shape) for p in params],
        "parameters": sum(p.numel() for p in params), **extra,
    }


def _rank_main(rank: int, world: int, config: dict) -> list[dict]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for workload in workloads(config["smoke"]):
        for name in config["optimizers"]:
            if not runs_on(name, workload):
                continue
            began = time.perf_counter()
            rows.append({"model": workload.name, "optimizer": name, **measure(rank, world, workload, name,
                                                                               config["steps"])})
            if rank == 0:
                print(f"  W={world} {workload.name} {name}: {time.perf_counter() - began:.1f} s", flush=True)
    return rows


def run_world(world: int, config: dict) -> list[dict]:
    """Every (model, optimizer) on ``world`` ranks; one row each, the ranks' numbers in lists."""
    per_rank = ranks.run_on_ranks(world, _rank_main, config, timeout=None, env={"TRITON_INTERPRET": None},
                                  weights_only=True)
    rows = []
    for seen in zip(*per_rank):
        first = seen[0]
        rows.append({"model": first["model"], "optimizer": first["optimizer"], "world": world,
                     "parameters": first["parameters"], "num_params": first["num_params"], "shapes": first["shapes"],
                     "steps": config["steps"],
                     "state_bytes": [r["state_bytes"] for r in seen],
                     "step_ms": [statistics.median(r["step_ms"]) for r in seen],
                     "bytes_all_reduced": [r["bytes_all_reduced"] for r in seen],
                     "all_reduce_calls": [r["all_reduce_calls"] for r in seen],
                     **{key: first[key] for key in ("kfac_expected_bytes", "expected_bytes_per_step") if key in first}})
    return rows


# --------------------------------------------------------------------------- checks and report


def state_bounds(row: dict, unsharded_bytes: int) -> tuple[float, float]:
    """The least and most bytes a rank of ``row`` may hold, from W = 1's state (see the module's checks).

    tritonopt's optimizers pad every rank to rank 0's part; Adam keeps each rank's own rows, the last
    rank's the fewest.
    """
    name, world, shapes = row["optimizer"], row["world"], row["shapes"]
    replicated = replicated_bytes(row)
    sharded = unsharded_bytes - replicated
    block = BLOCK_SIZE if name in BLOCKWISE else 1
    whole = rank_columns(shapes, 1, 0, block)
    largest_share = rank_columns(shapes, world, 0, block) / whole
    least_share = rank_columns(shapes, world, world - 1) / whole if name in OWN_ROWS else largest_share
    return (replicated + sharded * least_share * (1 - STATE_SLACK),
            replicated + sharded * largest_share * (1 + STATE_SLACK))


def summarise(rows: list[dict]) -> list[dict]:
    """One result per (model, W, optimizer): the largest rank's state, the slowest rank's median step,
    rank 0's bytes per step, the formula's, and the bounds of the state check."""
    unsharded = {(r["model"], r["optimizer"]): r["state_bytes"][0] for r in rows if r["world"] == 1}
    results = []
    for r in rows:
        world, steps = r["world"], r["steps"]
        expected_bytes, expected_calls = communicated_per_step(r) if world > 1 else (0, 0)
        base = unsharded.get((r["model"], r["optimizer"]))
        low, high = state_bounds(r, base) if base is not None else (math.nan, math.nan)
        results.append({
            "model": r["model"], "parameters": r["parameters"], "world": world, "optimizer": r["optimizer"],
            "steps": steps, "ngrads": NGRADS if r["optimizer"] in WINDOW_FAMILY else "",
            "density": DENSITY if r["optimizer"] in BLOCKWISE else "",
            "state_bytes_per_rank": max(r["state_bytes"]), "state_bytes_least_rank": min(r["state_bytes"]),
            "state_vs_share": max(r["state_bytes"]) * world / base if base else math.nan,
            "state_bound_low": low, "state_bound_high": high,
            "step_ms_median": max(r["step_ms"]),
            "bytes_all_reduced_per_step": r["bytes_all_reduced"][0] / steps,
            "expected_bytes_per_step": expected_bytes,
            "bytes_per_rank_agree": len(set(r["bytes_all_reduced"])) == 1,
            "all_reduce_calls_per_step": r["all_reduce_calls"][0] / steps,
            "expected_calls_per_step": expected_calls,
        })
    return results


def claims(results: list[dict]) -> list[harness.Claim]:
    checks = []
    for world in sorted({r["world"] for r in results if r["world"] > 1}):
        mine = [r for r in results if r["world"] == world]
        wrong_bytes = [r for r in mine if not r["bytes_per_rank_agree"]
                       or r["bytes_all_reduced_per_step"] != r["expected_bytes_per_step"]
                       or r["all_reduce_calls_per_step"] != r["expected_calls_per_step"]]
        checks.append(harness.Claim(
            f"W={world}: every rank all-reduces 8 m + 4 bytes per step in 2 calls (window family), "
            "4 bytes in 1 call (SparseAdaGrad); KAISA gathers the formula's bytes in 1 call", not wrong_bytes,
            "; ".join(f"{r['model']} {r['optimizer']}: {r['bytes_all_reduced_per_step']:g} B in "
                      f"{r['all_reduce_calls_per_step']:g} calls per step, expected {r['expected_bytes_per_step']} B "
                      f"in {r['expected_calls_per_step']}" for r in wrong_bytes) or f"{len(mine)} runs",
            smoke_scale=True))
        wrong_state = [r for r in mine if not (r["state_bound_low"] <= r["state_bytes_least_rank"]
                                               and r["state_bytes_per_rank"] <= r["state_bound_high"])]
        checks.append(harness.Claim(
            f"W={world}: every rank's state is 1/W of W=1's, plus the replicated parts, padding and "
            f"{100 * STATE_SLACK:g} %", not wrong_state,
            "; ".join(f"{r['model']} {r['optimizer']}: {r['state_bytes_least_rank']}..{r['state_bytes_per_rank']} B, "
                      f"allowed {r['state_bound_low']:.0f}..{r['state_bound_high']:.0f}" for r in wrong_state)
            or f"{len(mine)} runs", smoke_scale=True))
    return checks


HEADERS = ["model", "W", "optimizer", "state MiB per rank", "x W / W=1", "step ms (median)",
           "communicated B/step", "formula B/step"]


def table_rows(results: list[dict]) -> list[list]:
    return [[r["model"], r["world"], r["optimizer"], r["state_bytes_per_rank"] / 2**20, r["state_vs_share"],
             r["step_ms_median"], int(r["bytes_all_reduced_per_step"]) if r["world"] > 1 else "-",
             r["expected_bytes_per_step"] if r["world"] > 1 and r["optimizer"] != "Adam" else "-"]
            for r in results]


def command_line(args) -> str:
    if args.smoke:
        return "python -m perf.bench_sharded --smoke"
    command = f"python -m perf.bench_sharded --worlds {' '.join(map(str, args.worlds))} --steps {args.steps}"
    return command + (f" --only {' '.join(args.only)}" if list(args.only) != list(OPTIMIZERS) else "")


def write_outputs(results: list[dict], checks: list[harness.Claim], out_dir: Path, args, seconds: float,
                  load: tuple[float, float]) -> Path:
    csv_path = harness.write_results(results, out_dir, NAME)
    rows = table_rows(results)
    print(harness.format_table(HEADERS, rows))
    sizes = {r["model"]: r["parameters"] for r in results}
    models = ", ".join(f"{model} ({parameters:,} parameters)" for model, parameters in sizes.items())
    text = [
        "# tritonopt's optimizers on FSDP2-sharded models (gloo ranks on one CPU)",
        "",
        f"Command: `{command_line(args)}` ({seconds:.0f} s); machine: {harness.cpu_model()}, "
        f"{os.cpu_count()} cores, one torch thread per rank; load average (1 min) {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end; torch {torch.__version__}. Models: {models}. "
        f"{args.steps} step{'s' if args.steps > 1 else ''} per optimizer; windows of m = {NGRADS}; the sparse ones "
        f"keep {100 * DENSITY:g} % of each block of {BLOCK_SIZE}. State: the largest rank's; step: the slowest rank's "
        + ("median over the steps after the first" if args.steps > 1 else "one step, the state's allocation included")
        + "; communicated: what `opt.shard_group` all-reduced per step, for KAISA what its gradient gather "
        "received (W = 1: no collective); KAISA: COMM-OPT in front of SGD with momentum, eigendecompositions "
        f"every {KAISA_INV_UPDATE_STEPS} steps. "
        "`x W / W=1`: the state per rank times W over W = 1's (1 = an exact 1/W share).",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    for row in rows:
        text.append("| " + " | ".join(harness.format_value(v) if not isinstance(v, float) else f"{v:.4g}"
                                      for v in row) + " |")
    if checks:
        text += ["", "Checks:", ""]
        text += [f"- {'PASS' if c.holds else 'FAIL'}: {c.text} ({c.detail})" for c in checks]
    md_path = out_dir / f"{NAME}.md"
    md_path.write_text("\n".join(text) + "\n")
    print(f"wrote {csv_path} and {md_path}")
    return md_path


# --------------------------------------------------------------------------- command line


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/sharded/",
        smoke_help="tiny models, W = 1 and 2, one step: checks the plumbing, the byte counts and the state "
        "shares in seconds",
    )
    parser.add_argument("--worlds", type=harness.positive_int, nargs="+", default=list(WORLDS),
                        help="rank counts; 1 must be among them, the state check's reference (default: %(default)s)")
    parser.add_argument("--steps", type=harness.positive_int, default=STEPS,
                        help="steps per optimizer, the first not timed (default: %(default)s)")
    parser.add_argument("--only", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS), metavar="OPT",
                        help="optimizers to run (default: all of %(choices)s)")
    args = parser.parse_args(argv)
    if 1 not in args.worlds:
        parser.error(f"--worlds must include 1 (W = 1's state is the reference of the 1/W check), got {args.worlds}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks run one thread each; the parent too, so that the recorded device says so
    if args.smoke:
        args.worlds, args.steps = list(SMOKE_WORLDS), SMOKE_STEPS
    args.worlds = sorted(set(args.worlds))
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    config = {"smoke": args.smoke, "steps": args.steps, "optimizers": list(dict.fromkeys(args.only))}
    print(f"{len(config['optimizers'])} optimizers x 2 models x {args.steps} steps on W = "
          f"{', '.join(map(str, args.worlds))} gloo ranks (one thread each)", flush=True)
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    rows = [row for world in args.worlds for row in run_world(world, config)]
    seconds, load_after = time.perf_counter() - began, os.getloadavg()[0]
    results = summarise(rows)
    checks = claims(results)
    write_outputs(results, checks, out_dir, args, seconds, (load_before, load_after))
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
