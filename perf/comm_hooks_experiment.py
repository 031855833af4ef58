"""Compressed DDP communication hooks on the digits MLP: accuracy against bytes sent, 2 gloo ranks.

Protocol: the digits task of ``perf/_digits.py`` (1437 train / 360 test, MLP 64-256-256-10,
d = 85,002), global batch 32 split between 2 gloo ranks (one thread each; rank r takes
every second sample from r), SGD with momentum 0.9, 10 epochs (450 steps), seeds 0, 1 and 2.
DistributedDataParallel (one 85,002-element bucket) with four communication hooks:

* ``no compression``: torch's ``allreduce_hook``, DDP's own average;
* ``torch PowerSGD r4``: torch's ``powerSGD_hook`` (rank 4, error feedback, warm start);
* ``EF Top-k 1%``: ``tritonopt.dist.ef_topk_hook`` (density 0.01, blocks of 16384);
* ``EF low-rank r4``: ``tritonopt.dist.lowrank_ef_hook`` (rank 4).

The compressed hooks average uncompressed for the first ``--warmup`` steps (default 45, one
epoch: 10 % of the run, the start torch's PowerSGD documentation recommends). Bytes sent per
rank are counted where each hook hands its tensors to ``torch.distributed`` (a counting
wrapper of ``all_reduce`` and the all-gathers in each rank process; all-reduce: the
tensor, all-gather: the input), so torch's hook is measured as ours are.

Learning rate (``perf._comm_hooks_report`` holds the rules, fixed before any run): every hook
runs every lr of the grid (default 0.0125, 0.025, 0.05, 0.1) on every seed; its best lr has the
highest mean test accuracy over the seeds (the smaller on a tie); a best lr on the grid's edge
adds the next lr beyond it (halved or doubled), once. Each hook is then reported and judged at
its own best lr, from those same sweep runs. Every figure: mean ± standard error over the seeds.

Claims checked (exit status 1 if one fails):

* both ranks end with bitwise identical parameters in every run (a smoke run checks it);
* tritonopt's hooks count the bytes that reached ``torch.distributed`` (smoke run too);
* each compressed hook sends >= 5x fewer bytes than no compression over the run, and >= 10x
  fewer per step after the warm-up (from the formulas: Top-k 1 % sends 6 bytes per kept
  entry, about 66x fewer; rank 4 sends ``4 r (n + m)`` per matrix, about 17x fewer);
* each compressed hook's mean test accuracy is within 1 point of no compression's, above or
  below, with at least 3 seeds (the bound's reasoning is beside ``ACCURACY_POINTS``).

ms/step is reported, not claimed. Run from the repository root (about 2 minutes on 2 CPU
cores)::

    python -m perf.comm_hooks_experiment [--epochs 10] [--seeds 0 1 2] [--lrs ...] [--warmup 45] [--out DIR]
    python -m perf.comm_hooks_experiment --smoke     # seconds: checks the plumbing
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/comm_hooks_experiment.py
    import _as_module

    _as_module.run(__file__)

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from perf import _comm_hooks_report as report
from perf import _harness as harness
from perf import _ranks as ranks
from perf._comm_hooks_report import COMPRESSED, OURS, RUNS  # noqa: F401  (the names the tests and docs use)
from perf._digits import BATCH_SIZE, TRAIN_SIZE, load_digits_split, make_mlp, train
from tritonopt.dist import EFTopKState, LowRankState, ef_topk_hook, lowrank_ef_hook

NAME = "comm_hooks"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
WORLD = 2
MOMENTUM = 0.9
DENSITY, BLOCK_SIZE, RANK = 0.01, 16384, 4
SEEDS = (0, 1, 2)
SMOKE_STEPS, SMOKE_WARMUP = 8, 2
SMOKE_LRS = (0.025, 0.05)


# --------------------------------------------------------------------------- byte counting


class CollectiveBytes:
    """Counts the bytes each rank hands to ``torch.distributed``'s all-reduce and all-gathers.

    Installed in a rank's process, it wraps the module's functions, so every hook's
    collectives (torch's, tritonopt's, DDP's own through ``allreduce_hook``) are counted the
    same way: an all-reduce sends its tensor, an all-gather its input.
    """

    WRAPPED = ("all_reduce", "all_gather_into_tensor", "all_gather_single")

    def __init__(self):
        self.sent = 0
        for name in self.WRAPPED:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(original, name))

    def _counting(self, original, name):
        def wrapper(*args, **kwargs):
            if name == "all_reduce":
                tensor = args[0] if args else kwargs["tensor"]
            else:
                tensor = args[1] if len(args) > 1 else kwargs["input_tensor"]
            self.sent += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return wrapper


# --------------------------------------------------------------------------- one rank


def register(run: str, ddp, warmup: int, seed: int):
    """Register ``run``'s hook on ``ddp``; return its state (tritonopt's hooks count their own bytes)."""
    if run == "no compression":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return None
    if run == "torch PowerSGD r4":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                            start_powerSGD_iter=warmup, random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    if run == "EF Top-k 1%":
        state = EFTopKState(density=DENSITY, block_size=BLOCK_SIZE, warmup_iters=warmup)
        ddp.register_comm_hook(state, ef_topk_hook)
        return state
    state = LowRankState(rank=RANK, warmup_iters=warmup, seed=seed)
    ddp.register_comm_hook(state, lowrank_ef_hook)
    return state


def train_one(rank: int, world: int, config: dict, counter: CollectiveBytes, data, run: str, lr: float,
              seed: int) -> dict:
    """One training run of ``run`` at ``lr`` from ``seed`` on this rank; its row, with per-epoch curves."""
    model = make_mlp(seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = register(run, ddp, config["warmup"], seed)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=MOMENTUM)

    def step(x, y, loss_fn):
        optimizer.zero_grad()
        loss = loss_fn(ddp(x[rank::world]), y[rank::world])
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    dist.barrier()
    start_bytes = counter.sent
    epoch_bytes, warmup_bytes, steps = [], [0], [0]

    def on_step():
        steps[0] += 1
        if steps[0] == config["warmup"]:
            warmup_bytes[0] = counter.sent - start_bytes

    result = train(model, step, data, seed=seed, epochs=config["epochs"], max_steps=config["max_steps"],
                   on_step=on_step, on_epoch=lambda epoch, r: epoch_bytes.append(counter.sent - start_bytes))
    sent = counter.sent - start_bytes
    # The start-up agreement ran when the state was built, before this window opened.
    counted = (sum(s.bytes_sent for label, s in state.communicator.stats().items() if label != "config_check")
               if state is not None else None)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)  # outside the counted window
    if rank == 0:
        print(f"  {run:<18} lr {lr:<7g} seed {seed}: {result.steps} steps, test accuracy "
              f"{100 * result.test_accuracies[-1]:.2f} %, {sent / 2**20:.2f} MiB sent", flush=True)
    return {
        "run": run, "lr": lr, "seed": seed, "rank": rank, "steps": result.steps, "warmup_steps": config["warmup"],
        "test_accuracy": 100 * result.test_accuracies[-1], "final_train_loss": result.train_losses[-1],
        "bytes_sent": sent, "bytes_sent_warmup": warmup_bytes[0],
        "hook_counted_bytes": counted if counted is not None else "",
        "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
        "ms_per_step": result.ms_per_step,
        "epoch_losses": result.mean_batch_losses, "epoch_accuracies": [100 * a for a in result.test_accuracies],
        "epoch_bytes": epoch_bytes,
    }


def train_rank(rank: int, world: int, config: dict) -> list[dict]:
    """Every hook's sweep on this rank: each lr on each seed, then the rule's widening."""
    counter = CollectiveBytes()
    data = load_digits_split()
    rows = []

    def decided(value: float) -> float:  # rank 0's decision, so that no rank can drift from it
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    for run in config["runs"]:
        lrs = list(config["lrs"])
        for lr in lrs:
            for seed in config["seeds"]:
                rows.append(train_one(rank, world, config, counter, data, run, lr, seed))
        for _ in range(config["max_widenings"]):
            extra = report.widened(lrs, decided(report.best_lr(rows, run, rank)))
            if extra is None:
                break
            lrs.append(extra)
            if rank == 0:
                print(f"  {run}: best lr on the grid's edge, adding lr {extra:g}", flush=True)
            for seed in config["seeds"]:
                rows.append(train_one(rank, world, config, counter, data, run, extra, seed))
    return rows


def _rank_main(rank: int, world: int, config: dict) -> list[dict]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames the all-gather
    return train_rank(rank, world, config)


def run_on_ranks(config: dict) -> list[dict]:
    # One thread per rank (2 ranks on 2 cores: more threads only fight each other).
    return [row for rows in ranks.run_on_ranks(WORLD, _rank_main, config, timeout=None, weights_only=True)
            for row in rows]


# --------------------------------------------------------------------------- command line


def warmup_steps(text: str) -> int:
    value = harness.positive_int(text)
    if value < 2:
        # DDP rebuilds its buckets after the first step; torch's PowerSGD with error feedback refuses to start earlier.
        raise argparse.ArgumentTypeError(f"must be at least 2 (torch's powerSGD_hook needs it), got {value}")
    return value


def learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a learning rate must be positive and finite, got {text}")
    return value


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/comm_hooks/",
        smoke_help=f"one seed, lrs {' and '.join(map(str, SMOKE_LRS))} (and the widening), {SMOKE_STEPS} steps with "
        f"{SMOKE_WARMUP} of warm-up: checks the plumbing in seconds (only the identical-ranks and byte-count "
        "claims are checked)",
    )
    parser.add_argument("--epochs", type=harness.positive_int, default=10, help="(default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help=f"(default: %(default)s; the accuracy claims need at least {report.MIN_SEEDS})")
    parser.add_argument("--lrs", type=learning_rate, nargs="+", default=list(report.LRS),
                        help="the learning-rate grid every hook sweeps (default: %(default)s)")
    parser.add_argument("--warmup", type=warmup_steps, default=45,
                        help="uncompressed steps before the compressed hooks start (default: %(default)s)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help="hooks to run (default: all of %(choices)s)")
    args = parser.parse_args(argv)
    for name in ("seeds", "lrs", "runs"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            parser.error(f"--{name} must be distinct, got {values}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # The ranks run one thread each; the parent too, so that the recorded device says so.
    torch.set_num_threads(1)
    if args.smoke:
        args.epochs, args.seeds, args.warmup, args.lrs = 1, [0], SMOKE_WARMUP, list(SMOKE_LRS)
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    config = {"epochs": args.epochs, "seeds": args.seeds, "warmup": args.warmup, "runs": args.runs,
              "lrs": args.lrs, "max_widenings": report.MAX_WIDENINGS,
              "max_steps": SMOKE_STEPS if args.smoke else None}
    steps = min(config["max_steps"] or 10**9, args.epochs * -(-TRAIN_SIZE // BATCH_SIZE))
    print(f"{len(args.runs)} hooks x {len(args.lrs)} lrs (+ up to {report.MAX_WIDENINGS} widening) x "
          f"{len(args.seeds)} seeds x {steps} steps on {WORLD} gloo ranks (one thread each)", flush=True)
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    rows = run_on_ranks(config)
    seconds = time.perf_counter() - began
    load_after = os.getloadavg()[0]
    print(f"trained in {seconds:.0f} s")
    summary = report.summarise(rows)
    checks = report.claims(rows, summary)

    csv_rows = [{k: v for k, v in r.items() if not k.startswith("epoch_")} for r in rows]
    csv_path = harness.write_results(csv_rows, out_dir, NAME)
    command = "python -m perf.comm_hooks_experiment" + (
        " --smoke" if args.smoke else
        f" --epochs {args.epochs} --seeds {' '.join(map(str, args.seeds))} --lrs {' '.join(map(str, args.lrs))} "
        f"--warmup {args.warmup}")
    header = (f"Device: {harness.device_name()} per rank, torch {torch.__version__}, {harness.cpu_model()}. "
              f"{rows[0]['steps']} steps of global batch 32, SGD momentum {MOMENTUM}; compressed hooks average "
              f"uncompressed for the first {args.warmup} steps. Top-k: density {DENSITY}, blocks of {BLOCK_SIZE}; "
              f"low rank: r = {RANK}. Machine load (1-minute average) {load_before:.1f} at the start, "
              f"{load_after:.1f} at the end: it moves ms/step, never accuracy or bytes.")
    lines = report.markdown(summary, checks, smoke=args.smoke, command=command, header=header, seconds=seconds)
    (out_dir / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {csv_path} and {out_dir / f'{NAME}.md'}")
    plotted = report.plot(summary, out_dir / f"{NAME}.png")
    print(f"wrote {plotted}" if plotted else "matplotlib is not installed: no plot written")
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
