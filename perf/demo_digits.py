"""Train a small MLP on scikit-learn's digits with several optimizers and compare them.

    python perf/demo_digits.py [--epochs 10] [--seeds 2] [--only SGD Adam] [--out DIR]

The data set ships inside scikit-learn (1,797 8x8 images; nothing is
downloaded): a fixed permutation gives 1,437 training and 360 test images,
standardised with the training statistics. The model is a 64-256-256-10 ReLU
MLP (85,002 parameters), trained with batches of 32 and a constant learning
rate. Each optimizer runs once per seed; the table reports the mean over seeds
of the final training loss (whole training set), the test accuracy, the bytes
of optimizer state and the wall time per step. A plot of the training loss per
epoch is saved beside a CSV and a markdown table.

An optimizer enters the comparison as a *builder* (see ``perf/_digits.py``); the
paper optimizers' builders live in their experiments (``efcp_experiment.py``,
``kfac_experiment.py``, ``fosi_experiment.py``), which check the papers' claims
with more seeds and baselines.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

import tritonopt  # noqa: E402
from tritonopt.optim import SparseAdaGrad  # noqa: E402

# The experiments beside this file provide the builders of the paper optimizers.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _digits import (  # noqa: E402
    Digits,
    OptimizerStep,
    TrainStep,
    load_digits_split,
    make_mlp,
)
from efcp_experiment import build_lowrank_mfac, build_mfac, build_sparse_mfac  # noqa: E402
from fosi_experiment import build_fosi  # noqa: E402
from kfac_experiment import build_kfac  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "demo"


def build_sgd(model, steps_per_epoch):
    return OptimizerStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def build_adam(model, steps_per_epoch):
    return OptimizerStep(model, torch.optim.Adam(model.parameters(), lr=1e-3))


def build_sparse_adagrad(model, steps_per_epoch):
    optimizer = SparseAdaGrad(model.parameters(), lr=0.05, density=0.01, block_size=4096)
    return OptimizerStep(model, optimizer)


BUILDERS: dict[str, Callable[[torch.nn.Module, int], TrainStep]] = {
    "SGD (momentum 0.9, lr 0.05)": build_sgd,
    "Adam (lr 1e-3)": build_adam,
    "SparseAdaGrad (1 %, lr 0.05)": build_sparse_adagrad,
    "M-FAC (m 128, damp 0.03, lr 0.01)": build_mfac,
    "S-MFAC (1 %, m 128, damp 0.03, lr 0.01)": build_sparse_mfac,
    "LR-MFAC (rank 4, m 128, damp 0.03, lr 0.01)": build_lowrank_mfac,
    "K-FAC (SGD momentum 0.9, lr 0.1, damping 0.3)": build_kfac,
    "FOSI-Adam (lr 1e-3, k 10, α 0.1)": build_fosi,
}


@dataclass
class RunResult:
    name: str
    seed: int
    epoch_losses: list[float] = field(default_factory=list)
    test_accuracy: float = 0.0
    state_bytes: int = 0
    ms_per_step: float = 0.0


@torch.no_grad()
def evaluate(model, x, y, loss_fn) -> tuple[float, float]:
    logits = model(x)
    return loss_fn(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def train_one(name, builder, data: Digits, seed, epochs, batch_size, progress) -> RunResult:
    model = make_mlp(seed)
    loss_fn = torch.nn.functional.cross_entropy
    steps_per_epoch = -(-len(data.y_train) // batch_size)
    step = builder(model, steps_per_epoch)
    result = RunResult(name, seed)
    shuffle = torch.Generator().manual_seed(1000 + seed)
    train_seconds, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(data.y_train), generator=shuffle)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            began = time.perf_counter()
            step(data.x_train[batch], data.y_train[batch], loss_fn)
            train_seconds += time.perf_counter() - began
            steps += 1
            progress.update(1)
        result.epoch_losses.append(evaluate(model, data.x_train, data.y_train, loss_fn)[0])
    result.test_accuracy = evaluate(model, data.x_test, data.y_test, loss_fn)[1]
    result.state_bytes = step.state_bytes()
    result.ms_per_step = 1000 * train_seconds / steps
    return result


def summarise(results: list[RunResult]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r.name for r in results):
        runs = [r for r in results if r.name == name]
        rows.append(
            {
                "optimizer": name,
                "seeds": len(runs),
                "final_train_loss": statistics.mean(r.epoch_losses[-1] for r in runs),
                "test_accuracy_pct": 100 * statistics.mean(r.test_accuracy for r in runs),
                "state_bytes": runs[0].state_bytes,
                "ms_per_step": statistics.mean(r.ms_per_step for r in runs),
            }
        )
    return rows


def format_markdown(rows: list[dict]) -> str:
    lines = [
        "| optimizer | final train loss | test accuracy | optimizer state | ms / step |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['optimizer']} | {row['final_train_loss']:.4f} | "
            f"{row['test_accuracy_pct']:.2f} % | {row['state_bytes'] / 2**10:,.1f} KiB | "
            f"{row['ms_per_step']:.2f} |"
        )
    return "\n".join(lines)


def save_outputs(results: list[RunResult], rows: list[dict], out: Path, header: str, plot: bool):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo_digits.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "demo_digits.md").write_text(f"{header}\n\n{format_markdown(rows)}\n")
    if not plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.name for r in results):
        runs = [r for r in results if r.name == name]
        epochs = range(1, len(runs[0].epoch_losses) + 1)
        mean = [statistics.mean(values) for values in zip(*(r.epoch_losses for r in runs))]
        ax.plot(epochs, mean, marker="o", markersize=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (whole training set)")
    ax.set_title(f"digits MLP, mean over {len({r.seed for r in results})} seed(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "demo_digits.png", dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=2, help="runs per optimizer (seeds 0..N-1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="optimizers whose name starts so")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    for name in ("epochs", "seeds", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> list[dict]:
    from tqdm import tqdm

    args = parse_args(argv)
    builders = BUILDERS
    if args.only:
        builders = {n: b for n, b in BUILDERS.items() if any(n.startswith(o) for o in args.only)}
        if not builders:
            raise SystemExit(f"--only matched none of: {', '.join(BUILDERS)}")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    data = load_digits_split()
    steps_per_run = args.epochs * -(-len(data.y_train) // args.batch_size)
    backend = tritonopt.select_backend(torch.device("cpu"))
    header = (
        f"digits MLP 64-256-256-10, {args.epochs} epochs, batch {args.batch_size}, "
        f"{args.seeds} seed(s); tritonopt ops on the CPU run the {backend} backend"
    )
    print(header)
    results = []
    with tqdm(total=len(builders) * args.seeds * steps_per_run, unit="step") as progress:
        for name, builder in builders.items():
            for seed in range(args.seeds):
                progress.set_description(f"{name}, seed {seed}")
                results.append(
                    train_one(name, builder, data, seed, args.epochs, args.batch_size, progress)
                )
    rows = summarise(results)
    print()
    print(format_markdown(rows))
    save_outputs(results, rows, args.out, header, plot=not args.no_plot)
    print(f"\nwrote {args.out}/demo_digits.csv, .md and .png")
    return rows


if __name__ == "__main__":
    main()
