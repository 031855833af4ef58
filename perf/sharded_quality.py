"""Below density 1, does sharding change what the Top-k optimizers learn? FSDP2 on 2 ranks against one process.

On a sharded model each rank cuts its Top-k blocks from its own rows, so at
``density < 1`` the kept entries, and so the run, differ from the unsharded
optimizer's. This experiment measures whether the quality does: ``SparseMFAC``,
``SparseGGT`` and ``SparseAdaGrad`` at ``density = 0.1`` (blocks of 64) train one
MLP (24 -> 61 -> 10, 2,145 parameters; 61 and 10 rows cut 31/30 and 5/5) on a fixed
teacher-labelled classification set of 1,024 points, twice from each seed:

* ``sharded``: ``fully_shard`` over 2 gloo ranks (one thread each), each rank a
  batch of 32 per step; FSDP2 averages the two gradients;
* ``unsharded``: one process, the same 64 points per step, so the same averaged
  gradient up to rounding.

Protocol, fixed here (nothing is chosen after the runs): ``STEPS`` steps; the
loss is the cross-entropy over the whole set after the last step. Each
(optimizer, variant) has its own best lr from one sweep over ``LR_GRID`` (the
lowest mean loss over the seeds; a best lr on the grid's edge adds the next
point beyond it, at most ``MAX_WIDENINGS`` times). At those lrs, per seed, the
difference ``sharded - unsharded``; the claim, two-sided: its mean plus or minus 2
standard errors lies within ``MARGIN`` (10 %) of the unsharded mean loss.

    python -m perf.sharded_quality [--seeds 0 1 2 3 4] [--out DIR]   # a few minutes on 2 cores
    python -m perf.sharded_quality --smoke                         # 5 steps, 2 lrs, 2 seeds: the plumbing
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/sharded_quality.py
    import _as_module

    _as_module.run(__file__)

import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from perf import _harness as harness
from perf import _ranks as ranks
from perf._stats import mean_se, pm

NAME = "sharded_quality"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
SEEDS, STEPS, SMOKE_STEPS = (0, 1, 2, 3, 4), 150, 5
POINTS, FEATURES, HIDDEN, CLASSES, RANK_BATCH, WORLD = 1024, 24, 61, 10, 32, 2
DENSITY, BLOCK_SIZE, NGRADS = 0.1, 64, 16
MARGIN = 0.10  # of the unsharded mean loss
MAX_WIDENINGS = 6
# A first run with grids a decade lower and 2 widenings left SparseMFAC's and SparseGGT's best lrs on the
# grid's edge: these start higher and widen further, both variants alike.
LR_GRID = {
    "SparseMFAC": (1e-2, 3e-2, 1e-1, 3e-1),
    "SparseGGT": (1e-1, 3e-1, 1.0, 3.0),
    "SparseAdaGrad": (1e-1, 3e-1, 1.0, 3.0),
}
LR_STEP = math.sqrt(10)  # the grids' ratio: a widening adds lr / LR_STEP or lr * LR_STEP


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``POINTS`` inputs and the classes a random teacher MLP gives them."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(POINTS, FEATURES, generator=gen)
    w1 = torch.randn(FEATURES, 32, generator=gen) / math.sqrt(FEATURES)
    w2 = torch.randn(32, CLASSES, generator=gen) / math.sqrt(32)
    return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)


def batch_indices(seed: int, step: int) -> torch.Tensor:
    """The step's ``WORLD * RANK_BATCH`` points; rank ``r`` takes the ``r``-th block of ``RANK_BATCH``."""
    gen = torch.Generator().manual_seed(1_000_000 * (seed + 1) + step)
    return torch.randperm(POINTS, generator=gen)[: WORLD * RANK_BATCH]


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def optimizer(name: str, params, lr: float):
    import tritonopt

    settings = {
        "SparseMFAC": dict(ngrads=NGRADS, damp=1e-4, density=DENSITY, block_size=BLOCK_SIZE),
        "SparseGGT": dict(ngrads=NGRADS, eps=1e-4, density=DENSITY, block_size=BLOCK_SIZE),
        "SparseAdaGrad": dict(density=DENSITY, block_size=BLOCK_SIZE),
    }[name]
    return getattr(tritonopt.optim, name)(params, lr=lr, **settings)


def whole_set_loss(net: nn.Module, data) -> float:
    x, y = data
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(net(x), y))
    return loss if math.isfinite(loss) else math.inf


def train(net: nn.Module, opt, data, seed: int, steps: int, rows: slice) -> None:
    x, y = data
    for step in range(steps):
        chosen = batch_indices(seed, step)[rows]
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x[chosen]), y[chosen]).backward()
        opt.step()


def unsharded_loss(name: str, lr: float, seed: int, steps: int) -> float:
    net, data = model(seed), dataset(seed)
    train(net, optimizer(name, net.parameters(), lr), data, seed, steps, slice(None))
    return whole_set_loss(net, data)


def _sharded_rank(rank: int, world: int, runs: list) -> list[float]:
    """Each run ``(name, lr, seed, steps)`` with FSDP2 over the ranks; the whole-set losses (the same on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world,))
    losses = []
    for name, lr, seed, steps in runs:
        net, data = model(seed), dataset(seed)
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        train(net, optimizer(name, net.parameters(), lr), data, seed, steps,
              slice(rank * RANK_BATCH, (rank + 1) * RANK_BATCH))
        whole = model(seed)
        with torch.no_grad():
            for target, p in zip(whole.parameters(), net.parameters()):
                target.copy_(p.full_tensor())
        losses.append(whole_set_loss(whole, data))
    return losses


def run_batch(variant: str, runs: list) -> list[float]:
    if variant == "unsharded":
        return [unsharded_loss(*run) for run in runs]
    per_rank = ranks.run_on_ranks(WORLD, _sharded_rank, runs, timeout=None, env={"TRITON_INTERPRET": None},
                                  weights_only=True)
    return per_rank[0]


def sweep(names, seeds, steps: int, grid: dict, widenings: int) -> list[dict]:
    """Every (optimizer, variant, lr, seed) the protocol runs: the grid, then the widenings at the edges."""
    rows, pending = [], {(n, v): list(grid[n]) for n in names for v in ("sharded", "unsharded")}
    for round_ in range(widenings + 1):
        for variant in ("unsharded", "sharded"):
            runs = [(n, lr, s, steps) for (n, v), lrs in pending.items() if v == variant for lr in lrs for s in seeds]
            if not runs:
                continue
            began = time.perf_counter()
            for (name, lr, seed, _), loss in zip(runs, run_batch(variant, runs)):
                rows.append({"optimizer": name, "variant": variant, "lr": lr, "seed": seed, "steps": steps,
                             "loss": loss})
            print(f"  {variant}: {len(runs)} runs in {time.perf_counter() - began:.0f} s", flush=True)
        pending = {}
        for name in names:
            for variant in ("sharded", "unsharded"):
                lrs = sorted({r["lr"] for r in rows if r["optimizer"] == name and r["variant"] == variant})
                best = best_lr(rows, name, variant)
                if round_ < widenings and best in (lrs[0], lrs[-1]) and len(lrs) > 1:
                    pending[(name, variant)] = [best / LR_STEP if best == lrs[0] else best * LR_STEP]
        if not pending:
            break
    return rows


def mean_loss(rows, name: str, variant: str, lr: float) -> float:
    losses = [r["loss"] for r in rows if (r["optimizer"], r["variant"], r["lr"]) == (name, variant, lr)]
    return sum(losses) / len(losses)


def best_lr(rows, name: str, variant: str) -> float:
    """The lr of the lowest mean loss (the smaller lr on a tie)."""
    lrs = sorted({r["lr"] for r in rows if r["optimizer"] == name and r["variant"] == variant})
    return min(lrs, key=lambda lr: (mean_loss(rows, name, variant, lr), lr))


def compare(rows, names) -> list[dict]:
    """Per optimizer, at each variant's best lr: the losses, the paired differences and the margin."""
    results = []
    for name in names:
        lr = {v: best_lr(rows, name, v) for v in ("sharded", "unsharded")}
        loss = {v: {r["seed"]: r["loss"] for r in rows
                    if (r["optimizer"], r["variant"], r["lr"]) == (name, v, lr[v])} for v in lr}
        seeds = sorted(loss["unsharded"])
        diffs = [loss["sharded"][s] - loss["unsharded"][s] for s in seeds]
        unsharded_mean, unsharded_se = mean_se([loss["unsharded"][s] for s in seeds])
        sharded_mean, sharded_se = mean_se([loss["sharded"][s] for s in seeds])
        diff_mean, diff_se = mean_se(diffs)
        margin = MARGIN * unsharded_mean
        low, high = diff_mean - 2 * diff_se, diff_mean + 2 * diff_se
        results.append({
            "optimizer": name, "seeds": len(seeds), "lr_sharded": lr["sharded"], "lr_unsharded": lr["unsharded"],
            "loss_sharded": sharded_mean, "se_sharded": sharded_se,
            "loss_unsharded": unsharded_mean, "se_unsharded": unsharded_se,
            "difference": diff_mean, "se_difference": diff_se, "margin": margin,
            "within_margin": bool(math.isfinite(low) and math.isfinite(high) and -margin <= low and high <= margin),
        })
    return results


def claims(results) -> list[harness.Claim]:
    return [harness.Claim(
        f"{r['optimizer']} at density {DENSITY:g}: sharded over {WORLD} ranks, the loss is the unsharded one's "
        f"within {100 * MARGIN:g} % (mean difference +- 2 SE inside +-{r['margin']:.4f})", r["within_margin"],
        f"difference {pm(r['difference'], r['se_difference'], 4, signed=True)} over {r['seeds']} seeds; "
        f"unsharded {pm(r['loss_unsharded'], r['se_unsharded'], 4)} at lr {r['lr_unsharded']:g}, "
        f"sharded {pm(r['loss_sharded'], r['se_sharded'], 4)} at lr {r['lr_sharded']:g}") for r in results]


def write_outputs(rows, results, checks, out_dir: Path, args, seconds: float) -> None:
    harness.write_results(rows, out_dir, f"{NAME}_runs")
    headers = ["optimizer", "lr unsharded", "loss unsharded", "lr sharded", "loss sharded", "sharded - unsharded",
               "margin", "within"]
    table = [[r["optimizer"], f"{r['lr_unsharded']:g}", pm(r["loss_unsharded"], r["se_unsharded"], 4),
              f"{r['lr_sharded']:g}", pm(r["loss_sharded"], r["se_sharded"], 4),
              pm(r["difference"], r["se_difference"], 4, signed=True), f"±{r['margin']:.4f}",
              "yes" if r["within_margin"] else "no"] for r in results]
    print(harness.format_table(headers, table))
    sweep_lines = []
    for name in sorted({r["optimizer"] for r in rows}):
        for variant in ("unsharded", "sharded"):
            lrs = sorted({r["lr"] for r in rows if (r["optimizer"], r["variant"]) == (name, variant)})
            cells = ", ".join(f"{lr:g}: {mean_loss(rows, name, variant, lr):.4f}" for lr in lrs)
            sweep_lines.append(f"- {name}, {variant}: {cells}")
    command = "python -m perf.sharded_quality" + (" --smoke" if args.smoke else
                                                   f" --seeds {' '.join(map(str, args.seeds))}")
    text = [
        "# Top-k optimizers on an FSDP2-sharded model: quality against one process",
        "",
        f"Command: `{command}` ({seconds:.0f} s); machine: {harness.cpu_model()}, {os.cpu_count()} cores; torch "
        f"{torch.__version__}. {args.steps} steps, density {DENSITY:g}, blocks of {BLOCK_SIZE}, windows of "
        f"{NGRADS}; loss: cross-entropy over the whole set of {POINTS} after the last step, mean ± standard error "
        f"over {len(args.seeds)} seeds, each variant at its own best lr. Sharded: {WORLD} gloo ranks, batches of "
        f"{RANK_BATCH} each; unsharded: one process, the same {WORLD * RANK_BATCH} points.",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in table),
        "",
        "Mean loss per lr (the sweep):",
        "",
        *sweep_lines,
        "",
        "Checks:",
        "",
        *(f"- {'PASS' if c.holds else 'FAIL'}: {c.text} ({c.detail})" for c in checks),
    ]
    path = out_dir / f"{NAME}.md"
    path.write_text("\n".join(text) + "\n")
    print(f"wrote {path}")


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out=f"perf/results/{NAME}/",
        smoke_help=f"{SMOKE_STEPS} steps, the two lowest lrs, 2 seeds: checks the plumbing (no claim is decided)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="at least 3 (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.smoke and len(set(args.seeds)) < 3:
        parser.error(f"--seeds needs at least 3 different seeds for a standard error, got {args.seeds}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    names = list(LR_GRID)
    grid, widenings = LR_GRID, MAX_WIDENINGS
    args.steps = STEPS
    if args.smoke:
        args.seeds, args.steps, widenings = [0, 1], SMOKE_STEPS, 0
        grid = {name: lrs[:2] for name, lrs in LR_GRID.items()}
    args.seeds = sorted(set(args.seeds))
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    began = time.perf_counter()
    rows = sweep(names, args.seeds, args.steps, grid, widenings)
    results = compare(rows, names)
    checks = claims(results)
    write_outputs(rows, results, checks, out_dir, args, time.perf_counter() - began)
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
