"""Compressed DDP communication hooks on the digits MLP: accuracy against bytes sent, 2 gloo ranks.

Protocol: the digits task of ``perf/_digits.py`` (1437 train / 360 test, MLP 64-256-256-10,
d = 85,002), global batch 32 split between 2 gloo ranks (one thread each; rank r takes
every second sample from r), SGD lr 0.05 with momentum 0.9, 10 epochs (450 steps), seeds
0 and 1. DistributedDataParallel (one 85,002-element bucket) with four communication hooks:

* ``no compression``: torch's ``allreduce_hook``, DDP's own average;
* ``torch PowerSGD r4``: torch's ``powerSGD_hook`` (rank 4, error feedback, warm start);
* ``EF Top-k 1%``: ``tritonopt.dist.ef_topk_hook`` (density 0.01, blocks of 16384);
* ``EF low-rank r4``: ``tritonopt.dist.lowrank_ef_hook`` (rank 4).

The compressed hooks average uncompressed for the first ``--warmup`` steps (default 45, one
epoch: 10 % of the run, the start torch's PowerSGD documentation recommends). Bytes sent per
rank are counted where each hook hands its tensors to ``torch.distributed`` (a counting
wrapper of ``all_reduce`` and the all-gathers in each rank process; all-reduce: the
tensor, all-gather: the input), so torch's hook is measured as ours are.

Claims checked (exit status 1 if one fails):

* both ranks end with bitwise identical parameters in every run (a smoke run checks it);
* tritonopt's hooks count the bytes that reached ``torch.distributed`` (smoke run too);
* each compressed hook sends >= 5x fewer bytes than no compression over the run, and >= 10x
  fewer per step after the warm-up (from the formulas: Top-k 1 % sends 6 bytes per kept
  entry, about 66x fewer; rank 4 sends ``4 r (n + m)`` per matrix, about 17x fewer);
* each compressed hook's test accuracy is within 1 point of no compression (means over
  seeds; PowerSGD rank 4 and error-feedback Top-k match uncompressed SGD's accuracy in
  Vogels et al. 2019 and Karimireddy et al. 2019).

Run from the repository root (about a minute on 2 CPU cores)::

    python -m perf.comm_hooks_experiment [--epochs 10] [--seeds 0 1] [--warmup 45] [--out DIR]
    python -m perf.comm_hooks_experiment --smoke     # seconds: checks the plumbing
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/comm_hooks_experiment.py
    import _as_module

    _as_module.run(__file__)

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from perf import _harness as harness
from perf import _ranks as ranks
from perf._digits import BATCH_SIZE, TRAIN_SIZE, load_digits_split, make_mlp, train
from tritonopt.dist import EFTopKState, LowRankState, ef_topk_hook, lowrank_ef_hook

NAME = "comm_hooks"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
WORLD = 2
LR, MOMENTUM = 0.05, 0.9
DENSITY, BLOCK_SIZE, RANK = 0.01, 16384, 4
TOTAL_RATIO, COMPRESSED_RATIO = 5, 10  # bytes: at least this many times fewer than no compression
ACCURACY_POINTS = 1.0  # test accuracy within this many points of no compression
SMOKE_STEPS, SMOKE_WARMUP = 8, 2
RUNS = ("no compression", "torch PowerSGD r4", "EF Top-k 1%", "EF low-rank r4")
COMPRESSED = RUNS[1:]
OURS = ("EF Top-k 1%", "EF low-rank r4")


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


def train_rank(rank: int, world: int, config: dict) -> list[dict]:
    """Every (run, seed) on this rank; one row each, with per-epoch curves."""
    counter = CollectiveBytes()
    data = load_digits_split()
    rows = []
    for seed in config["seeds"]:
        for run in config["runs"]:
            model = make_mlp(seed)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            state = register(run, ddp, config["warmup"], seed)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)

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
                print(f"  {run}, seed {seed}: {result.steps} steps, test accuracy "
                      f"{100 * result.test_accuracies[-1]:.2f} %, {sent / 2**20:.2f} MiB sent", flush=True)
            rows.append({
                "run": run, "seed": seed, "rank": rank, "steps": result.steps, "warmup_steps": config["warmup"],
                "test_accuracy": 100 * result.test_accuracies[-1], "final_train_loss": result.train_losses[-1],
                "bytes_sent": sent, "bytes_sent_warmup": warmup_bytes[0],
                "hook_counted_bytes": counted if counted is not None else "",
                "ranks_identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
                "ms_per_step": result.ms_per_step,
                "epoch_losses": result.mean_batch_losses, "epoch_accuracies": [100 * a for a in result.test_accuracies],
                "epoch_bytes": epoch_bytes,
            })
    return rows


def _rank_main(rank: int, world: int, config: dict) -> list[dict]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames the all-gather
    return train_rank(rank, world, config)


def run_on_ranks(config: dict) -> list[dict]:
    # One thread per rank (2 ranks on 2 cores: more threads only fight each other).
    return [row for rows in ranks.run_on_ranks(WORLD, _rank_main, config, timeout=None, weights_only=True)
            for row in rows]


# --------------------------------------------------------------------------- reporting


def summarise(rows: list[dict]) -> dict:
    """Per run, means over seeds of rank 0's rows (the ranks hold the same model; bytes are per rank)."""
    summary = {}
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run and r["rank"] == 0]
        steps, warmup = mine[0]["steps"], mine[0]["warmup_steps"]
        compressed_steps = max(steps - warmup, 0)
        summary[run] = {
            "test_accuracy": float(np.mean([r["test_accuracy"] for r in mine])),
            "per_seed_accuracy": [r["test_accuracy"] for r in mine],
            "final_train_loss": float(np.mean([r["final_train_loss"] for r in mine])),
            "bytes_sent": float(np.mean([r["bytes_sent"] for r in mine])),
            "bytes_per_step_after_warmup": float(np.mean(
                [(r["bytes_sent"] - r["bytes_sent_warmup"]) / compressed_steps for r in mine]))
            if compressed_steps else float("nan"),
            "ms_per_step": float(np.mean([r["ms_per_step"] for r in rows if r["run"] == run])),
            "curve": np.mean([r["epoch_losses"] for r in mine], axis=0).tolist(),
            "accuracy_curve": np.mean([r["epoch_accuracies"] for r in mine], axis=0).tolist(),
            "bytes_curve": np.mean([r["epoch_bytes"] for r in mine], axis=0).tolist(),
        }
    return summary


def claims(rows: list[dict], summary: dict) -> list[harness.Claim]:
    checks = [
        harness.Claim("both ranks end with bitwise identical parameters in every run",
                      all(r["ranks_identical"] for r in rows),
                      f"{sum(r['ranks_identical'] for r in rows)} of {len(rows)} rank rows", smoke_scale=True),
    ]
    ours = [r for r in rows if r["run"] in OURS]
    if ours:
        checks.append(harness.Claim(
            "tritonopt's hooks count the bytes that reached torch.distributed",
            all(r["hook_counted_bytes"] == r["bytes_sent"] for r in ours),
            "; ".join(f"{r['run']} rank {r['rank']} seed {r['seed']}: {r['hook_counted_bytes']} vs {r['bytes_sent']}"
                      for r in ours if r["hook_counted_bytes"] != r["bytes_sent"]) or f"{len(ours)} rank rows",
            smoke_scale=True))
    base = summary.get("no compression")
    if base is None:
        return checks
    for run in COMPRESSED:
        s = summary.get(run)
        if s is None:
            continue
        total = base["bytes_sent"] / s["bytes_sent"]
        per_step = base["bytes_per_step_after_warmup"] / s["bytes_per_step_after_warmup"]
        checks += [
            harness.Claim(f"{run} sends >= {TOTAL_RATIO}x fewer bytes than no compression over the run",
                          total >= TOTAL_RATIO, f"{total:.1f}x"),
            harness.Claim(f"{run} sends >= {COMPRESSED_RATIO}x fewer bytes per step after the warm-up",
                          per_step >= COMPRESSED_RATIO, f"{per_step:.1f}x"),
            harness.Claim(f"{run} test accuracy within {ACCURACY_POINTS:g} pt of no compression",
                          abs(s["test_accuracy"] - base["test_accuracy"]) <= ACCURACY_POINTS,
                          f"{s['test_accuracy']:.2f} vs {base['test_accuracy']:.2f}"),
        ]
    return checks


def table_rows(summary: dict) -> list[list]:
    base = summary.get("no compression")
    rows = []
    for run, s in summary.items():
        ratio = base["bytes_sent"] / s["bytes_sent"] if base else float("nan")
        rows.append([run, s["test_accuracy"], " / ".join(f"{a:.2f}" for a in s["per_seed_accuracy"]),
                     s["final_train_loss"], s["bytes_sent"] / 2**20, ratio,
                     s["bytes_per_step_after_warmup"] / 2**10, s["ms_per_step"]])
    return rows


def write_outputs(rows, summary, checks, out_dir: Path, args) -> None:
    csv_rows = [{k: v for k, v in r.items() if not k.startswith("epoch_")} for r in rows]
    csv_path = harness.write_results(csv_rows, out_dir, NAME)
    headers = ["hook", "test acc % (mean)", "per seed", "final train loss", "MiB sent per rank",
               "fewer bytes", "KiB/step after warm-up", "ms/step"]
    lines = table_rows(summary)
    print(harness.format_table(headers, lines))
    command = "python -m perf.comm_hooks_experiment" + (
        " --smoke" if args.smoke else
        f" --epochs {args.epochs} --seeds {' '.join(map(str, args.seeds))} --warmup {args.warmup}")
    steps = rows[0]["steps"]
    text = [
        "# Compressed DDP communication hooks on the digits MLP (2 gloo ranks)",
        "",
        f"Command: `{command}`; device: {harness.device_name()} per rank, torch {torch.__version__}. "
        f"{steps} steps of global batch 32, SGD lr {LR} momentum {MOMENTUM}; compressed hooks average "
        f"uncompressed for the first {args.warmup} steps. Top-k: density {DENSITY}, blocks of {BLOCK_SIZE}; "
        f"low rank: r = {RANK}. Bytes sent per rank (all-reduce: the tensor; all-gather: the input), "
        "means over seeds. ms/step: two processes sharing the machine, the ops' CPU reference path "
        "(not GPU speed).",
        "",
        "| hook | test acc % (mean) | per seed | final train loss | MiB sent per rank | fewer bytes "
        "| KiB/step after warm-up | ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in lines:
        text.append(f"| {row[0]} | {row[1]:.2f} | {row[2]} | {row[3]:.4f} | {row[4]:.2f} | {row[5]:.1f}x "
                    f"| {row[6]:.1f} | {row[7]:.1f} |")
    if checks:
        text += ["", "Claim checks:", ""]
        for claim in checks:
            verdict = "not checked (smoke run)" if args.smoke and not claim.smoke_scale else (
                "PASS" if claim.holds else "FAIL")
            text.append(f"- {verdict}: {claim.text} ({claim.detail})")
    (out_dir / f"{NAME}.md").write_text("\n".join(text) + "\n")
    print(f"wrote {csv_path} and {out_dir / f'{NAME}.md'}")
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, s in summary.items():
        left.plot(range(1, len(s["curve"]) + 1), s["curve"], marker="o", label=run)
        right.plot(np.array(s["bytes_curve"]) / 2**20, s["accuracy_curve"], marker="o", label=run)
    left.set_yscale("log")
    left.set_xlabel("epoch")
    left.set_ylabel("mean training loss over the epoch")
    left.grid(True, which="both", alpha=0.3)
    right.set_xscale("log")
    right.set_xlabel("MiB sent per rank (cumulative)")
    right.set_ylabel("test accuracy % (after each epoch)")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize="small")
    fig.suptitle("DDP on 2 gloo ranks, digits MLP: accuracy against bytes sent")
    fig.tight_layout()
    fig.savefig(out_dir / f"{NAME}.png", dpi=100)
    plt.close(fig)
    print(f"wrote {out_dir / f'{NAME}.png'}")


# --------------------------------------------------------------------------- command line


def warmup_steps(text: str) -> int:
    value = harness.positive_int(text)
    if value < 2:
        # DDP rebuilds its buckets after the first step; torch's PowerSGD with error feedback refuses to start earlier.
        raise argparse.ArgumentTypeError(f"must be at least 2 (torch's powerSGD_hook needs it), got {value}")
    return value


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/comm_hooks/",
        smoke_help=f"one seed, {SMOKE_STEPS} steps with {SMOKE_WARMUP} of warm-up: checks the plumbing in seconds "
        "(only the identical-ranks and byte-count claims are checked)",
    )
    parser.add_argument("--epochs", type=harness.positive_int, default=10, help="(default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="(default: %(default)s)")
    parser.add_argument("--warmup", type=warmup_steps, default=45,
                        help="uncompressed steps before the compressed hooks start (default: %(default)s)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help="hooks to run (default: all of %(choices)s)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # The ranks run one thread each; the parent too, so that the recorded device says so.
    torch.set_num_threads(1)
    if args.smoke:
        args.epochs, args.seeds, args.warmup = 1, [0], SMOKE_WARMUP
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    config = {"epochs": args.epochs, "seeds": args.seeds, "warmup": args.warmup, "runs": args.runs,
              "max_steps": SMOKE_STEPS if args.smoke else None}
    steps = min(config["max_steps"] or 10**9, args.epochs * -(-TRAIN_SIZE // BATCH_SIZE))
    print(f"{len(args.runs)} hooks x {len(args.seeds)} seeds x {steps} steps on {WORLD} gloo ranks "
          f"(one thread each)", flush=True)
    began = time.perf_counter()
    rows = run_on_ranks(config)
    print(f"trained in {time.perf_counter() - began:.0f} s")
    summary = summarise(rows)
    checks = claims(rows, summary)
    write_outputs(rows, summary, checks, out_dir, args)
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
