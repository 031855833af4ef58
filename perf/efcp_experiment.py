"""EFCP's claim at CPU scale: a 99 %-sparse M-FAC with error feedback trains like dense M-FAC.

Protocol: scikit-learn's digits (fixed permutation, 1437 train /
360 test, features standardised with the training statistics), an MLP
64-256-256-10 with ReLU and cross-entropy (d = 85,002), batch 32 (45 steps per
epoch), constant learning rate, no weight decay, 10 epochs, seeds 0 and 1.

Optimizers: SGD (lr 0.05, momentum 0.9); dense M-FAC (m = 128, damp 0.03, lr 0.01);
S-MFAC with the same m, damp and lr at 1 % density (blocks of 4096, 41 kept per
block) with and without error feedback, and at 0.1 %; LR-MFAC (rank 4).

Reported per optimizer: final train loss (full training set, after the last
step), test accuracy, optimizer-state bytes and ms per step (mean over seeds), and
a plot of the per-epoch mean training loss. The claim checked:

* S-MFAC 1 % + EF: final train loss within 2x of dense M-FAC's and test accuracy
  within 1 point (means over seeds);
* S-MFAC 1 % without EF: a clearly higher final train loss than with EF;
* S-MFAC's state at least 30x smaller than dense M-FAC's.

The ``build_*`` functions are the entries of ``perf/demo_digits.py``:
``build(model, steps_per_epoch) -> TrainStep`` where ``TrainStep(x, y, loss_fn)``
runs forward, backward and the update and returns the batch loss, and
``TrainStep.state_bytes()`` reports the optimizer state.

Run from the repository root (about a minute on 2 CPU cores)::

    python perf/efcp_experiment.py [--epochs 10] [--seeds 0 1] [--out perf/results/efcp]
    python perf/efcp_experiment.py --smoke --out /tmp/efcp     # seconds: checks the plumbing
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

try:
    import tritonopt  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

import _bench_common as bench
from _digits import OptimizerStep, TrainStep, load_digits_split, make_mlp
from tritonopt.optim.mfac import MFAC, SparseMFAC

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "efcp"
BATCH = 32
# Hyperparameters that train this task well within a few epochs.
MFAC_HYPER = dict(lr=0.01, ngrads=128, damp=0.03)
SPARSE_BLOCK = 4096
LOWRANK_HYPER = dict(lr=0.01, ngrads=128, damp=0.03, rank=4)


def build_sgd(model: torch.nn.Module, steps_per_epoch: int) -> TrainStep:
    return OptimizerStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def build_mfac(model: torch.nn.Module, steps_per_epoch: int) -> TrainStep:
    """Dense M-FAC, window 128, damp 0.03, lr 0.01."""
    return OptimizerStep(model, MFAC(model.parameters(), **MFAC_HYPER))


def build_sparse_mfac(
    model: torch.nn.Module, steps_per_epoch: int, *, density: float = 0.01,
    error_feedback: bool = True,
) -> TrainStep:
    """S-MFAC at 1 % density (blocks of 4096), error feedback, same m / damp / lr as M-FAC."""
    optimizer = SparseMFAC(
        model.parameters(), density=density, block_size=SPARSE_BLOCK,
        error_feedback=error_feedback, **MFAC_HYPER,
    )
    return OptimizerStep(model, optimizer)


def build_sparse_mfac_no_ef(model: torch.nn.Module, steps_per_epoch: int) -> TrainStep:
    return build_sparse_mfac(model, steps_per_epoch, error_feedback=False)


def build_sparse_mfac_01(model: torch.nn.Module, steps_per_epoch: int) -> TrainStep:
    return build_sparse_mfac(model, steps_per_epoch, density=0.001)


def build_lowrank_mfac(model: torch.nn.Module, steps_per_epoch: int) -> TrainStep:
    """LR-MFAC: rank-4 power-iteration compression with error feedback, same m / damp / lr."""
    from tritonopt.optim.lowrank_mfac import LowRankMFAC

    return OptimizerStep(model, LowRankMFAC(model.parameters(), **LOWRANK_HYPER))


RUNS = {
    "SGD": build_sgd,
    "D-MFAC": build_mfac,
    "S-MFAC 1% EF": build_sparse_mfac,
    "S-MFAC 1% no EF": build_sparse_mfac_no_ef,
    "S-MFAC 0.1% EF": build_sparse_mfac_01,
    "LR-MFAC r4": build_lowrank_mfac,
}


# --------------------------------------------------------------------------- training


def train_one(name, build, data, seed, epochs, max_steps=None):
    x_train, y_train, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    model = make_mlp(seed)
    steps_per_epoch = -(-len(x_train) // BATCH)
    step = build(model, steps_per_epoch)
    loss_fn = torch.nn.functional.cross_entropy
    gen = torch.Generator().manual_seed(1000 + seed)
    epoch_losses, seconds, steps = [], 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=gen)
        losses = []
        for start in range(0, len(x_train), BATCH):
            batch = order[start : start + BATCH]
            began = time.perf_counter()
            losses.append(step(x_train[batch], y_train[batch], loss_fn))
            seconds += time.perf_counter() - began
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        epoch_losses.append(float(np.mean(losses)))
        if max_steps is not None and steps >= max_steps:
            break
    with torch.no_grad():
        train_loss = float(loss_fn(model(x_train), y_train))
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean()) * 100
    return {
        "optimizer": name, "seed": seed, "final_train_loss": train_loss,
        "test_accuracy": accuracy, "state_bytes": step.state_bytes(),
        "ms_per_step": 1e3 * seconds / max(1, steps), "epoch_losses": epoch_losses,
    }


# --------------------------------------------------------------------------- reporting


def summarise(rows):
    names = list(dict.fromkeys(r["optimizer"] for r in rows))
    summary = {}
    for name in names:
        runs = [r for r in rows if r["optimizer"] == name]
        summary[name] = {
            key: float(np.mean([r[key] for r in runs]))
            for key in ("final_train_loss", "test_accuracy", "state_bytes", "ms_per_step")
        }
        summary[name]["per_seed_loss"] = [r["final_train_loss"] for r in runs]
        summary[name]["per_seed_acc"] = [r["test_accuracy"] for r in runs]
        summary[name]["curve"] = np.mean([r["epoch_losses"] for r in runs], axis=0).tolist()
    return summary


def claim_checks(summary):
    dense, sparse = summary.get("D-MFAC"), summary.get("S-MFAC 1% EF")
    plain = summary.get("S-MFAC 1% no EF")
    if not (dense and sparse and plain):
        return []
    return [
        ("S-MFAC 1% EF loss within 2x of D-MFAC",
         sparse["final_train_loss"] <= 2 * dense["final_train_loss"],
         f"{sparse['final_train_loss']:.4f} vs {dense['final_train_loss']:.4f}"),
        ("S-MFAC 1% EF accuracy within 1 pt of D-MFAC",
         abs(sparse["test_accuracy"] - dense["test_accuracy"]) <= 1.0,
         f"{sparse['test_accuracy']:.2f} vs {dense['test_accuracy']:.2f}"),
        ("no EF ends with a higher loss than EF",
         plain["final_train_loss"] > sparse["final_train_loss"],
         f"{plain['final_train_loss']:.4f} vs {sparse['final_train_loss']:.4f}"),
        ("S-MFAC state >= 30x smaller than D-MFAC",
         dense["state_bytes"] >= 30 * sparse["state_bytes"],
         f"{dense['state_bytes'] / sparse['state_bytes']:.1f}x"),
    ]


def write_outputs(rows, summary, out_dir: Path, args) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_rows = [{k: v for k, v in r.items() if k != "epoch_losses"} for r in rows]
    csv_path = bench.write_results(csv_rows, out_dir, "efcp")
    headers = ["optimizer", "final train loss (mean)", "per seed", "test acc % (mean)",
               "state MiB", "ms/step"]
    table_rows = [
        [name, s["final_train_loss"], " / ".join(f"{v:.4f}" for v in s["per_seed_loss"]),
         s["test_accuracy"], s["state_bytes"] / 2**20, s["ms_per_step"]]
        for name, s in summary.items()
    ]
    table = bench.format_table(headers, table_rows)
    print(table)
    checks = claim_checks(summary)
    lines = [
        "# EFCP on the digits MLP (64-256-256-10, d = 85,002)",
        "",
        f"Command: `python perf/efcp_experiment.py --epochs {args.epochs} --seeds "
        f"{' '.join(map(str, args.seeds))}`; device: {bench.device_name()}, "
        f"torch {torch.__version__}. M-FAC family: m = {MFAC_HYPER['ngrads']}, damp = "
        f"{MFAC_HYPER['damp']}, lr = {MFAC_HYPER['lr']}; S-MFAC blocks of {SPARSE_BLOCK}; "
        "SGD lr 0.05, momentum 0.9. Means over seeds.",
        "",
        "| optimizer | final train loss (mean) | per seed | test acc % (mean) | state MiB | ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for row in table_rows:
        lines.append(
            f"| {row[0]} | {row[1]:.4f} | {row[2]} | {row[3]:.2f} | {row[4]:.3f} | {row[5]:.1f} |"
        )
    if checks:
        lines += ["", "Claim checks:", ""]
        lines += [f"- {'PASS' if ok else 'FAIL'}: {text} ({detail})" for text, ok, detail in checks]
        for text, ok, detail in checks:
            print(f"{'PASS' if ok else 'FAIL'}: {text} ({detail})")
    (out_dir / "efcp_summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {out_dir / 'efcp_summary.md'}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in summary.items():
        ax.plot(range(1, len(s["curve"]) + 1), s["curve"], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training loss over the epoch")
    ax.set_title("EFCP on digits MLP: S-MFAC (99% sparse) vs dense M-FAC")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_dir / "efcp.png", dpi=100)
    plt.close(fig)
    print(f"wrote {out_dir / 'efcp.png'}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description="EFCP's claim on the digits MLP.")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help=f"optimizers to run (default: all of {list(RUNS)})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR")
    parser.add_argument("--smoke", action="store_true",
                        help="one seed, a few steps per optimizer: checks the plumbing in seconds")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # One thread: on a shared 2-core machine OpenMP synchronisation dominates these small ops.
    torch.set_num_threads(1)
    if args.smoke:
        args.epochs, args.seeds = 1, [0]
    max_steps = 5 if args.smoke else None
    data = load_digits_split()
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        def tqdm(iterable, **_):
            return iterable
    jobs = [(name, seed) for name in args.runs for seed in args.seeds]
    for name, seed in tqdm(jobs, desc="runs"):
        rows.append(train_one(name, RUNS[name], data, seed, args.epochs, max_steps))
    summary = summarise(rows)
    write_outputs(rows, summary, args.out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
