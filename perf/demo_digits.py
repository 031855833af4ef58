"""Train a small MLP on scikit-learn's digits with eight optimizers and compare them.

    python -m perf.demo_digits [--epochs 10] [--seeds 2] [--only SGD Adam] [--out DIR]

The data set ships inside scikit-learn (1,797 8x8 images; nothing is downloaded): a fixed
permutation gives 1,437 training and 360 test images, standardised with the training
statistics. The model is a 64-256-256-10 ReLU MLP (85,002 parameters), trained with batches
of 32 and a constant learning rate, on one thread. Each optimizer runs once per seed; the
table reports the mean over seeds of the final training loss (whole training set), the test
accuracy (and its range over seeds), the bytes of optimizer state and the wall time per
step. The figure has three panels: the training loss per epoch, the training loss against the
time spent in training steps (both the mean over seeds, the band their range), and the
optimizer state. A CSV file and a markdown table are written beside it, by default to
``perf/results/local/demo/`` (not committed); ``make demo-reference`` regenerates the
committed ``perf/results/demo/``.

The optimizers are the builders of ``perf/_optimizers.py``, with the hyperparameters the
paper experiments use (``efcp_experiment``, ``kfac_experiment``, ``fosi_experiment``), which
check the papers' claims with more seeds and baselines.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/demo_digits.py
    import _as_module

    _as_module.run(__file__)

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import tritonopt
from perf import _harness as harness
from perf import _optimizers as optimizers
from perf._digits import BATCH_SIZE, Digits, load_digits_split, make_mlp, train

DEFAULT_OUT = harness.LOCAL_RESULTS_DIR / "demo"
REFERENCE_OUT = harness.RESULTS_DIR / "demo"

BUILDERS: dict[str, Callable[[torch.nn.Module, int], optimizers.TrainStep]] = {
    "SGD (momentum 0.9, lr 0.05)": optimizers.build_sgd,
    "Adam (lr 1e-3)": optimizers.build_adam,
    "SparseAdaGrad (1 %, lr 0.05)": optimizers.build_sparse_adagrad,
    "M-FAC (m 128, damp 0.03, lr 0.01)": optimizers.build_mfac,
    "S-MFAC (1 %, m 128, damp 0.03, lr 0.01)": optimizers.build_sparse_mfac,
    "LR-MFAC (rank 4, m 128, damp 0.03, lr 0.01)": optimizers.build_lowrank_mfac,
    "K-FAC (SGD momentum 0.9, lr 0.1, damping 0.3)": optimizers.build_kfac,
    "FOSI-Adam (lr 1e-3, k 10, α 0.1)": optimizers.build_fosi,
}


@dataclass
class RunResult:
    name: str
    seed: int
    initial_loss: float = float("nan")  # whole training set, before training
    epoch_losses: list[float] = field(default_factory=list)  # whole training set, after each epoch
    epoch_seconds: list[float] = field(default_factory=list)  # time in training steps, at each epoch's end
    test_accuracy: float = 0.0
    state_bytes: int = 0
    ms_per_step: float = 0.0


def train_one(name, builder, data: Digits, seed, epochs, batch_size, progress) -> RunResult:
    model = make_mlp(seed)
    step = builder(model, -(-len(data.y_train) // batch_size))
    run = train(model, step, data, seed=seed, epochs=epochs, batch_size=batch_size, on_step=progress.update)
    return RunResult(name, seed, run.initial_train_loss, run.train_losses, run.train_seconds,
                     run.test_accuracies[-1], step.state_bytes(), run.ms_per_step)


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
                "test_accuracy_min_pct": 100 * min(r.test_accuracy for r in runs),
                "test_accuracy_max_pct": 100 * max(r.test_accuracy for r in runs),
                "state_bytes": runs[0].state_bytes,
                "ms_per_step": statistics.mean(r.ms_per_step for r in runs),
            }
        )
    return rows


def format_markdown(rows: list[dict]) -> str:
    lines = [
        "| optimizer | final train loss | test accuracy | over seeds | optimizer state | ms / step |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['optimizer']} | {row['final_train_loss']:.3g} | "
            f"{row['test_accuracy_pct']:.2f} % | "
            f"{row['test_accuracy_min_pct']:.2f}–{row['test_accuracy_max_pct']:.2f} % | "
            f"{row['state_bytes'] / 2**10:,.1f} KiB | {row['ms_per_step']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[RunResult], rows: list[dict], path: Path, title: str) -> None:
    """Three panels: loss per epoch, loss against training time (mean over seeds, band: their
    range), and the optimizer state of each optimizer."""
    plt = harness.pyplot()
    fig, (by_epoch, by_time, memory) = plt.subplots(1, 3, figsize=(17, 5))
    names = list(dict.fromkeys(r.name for r in results))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, name in enumerate(names):
        colour = colours[index % len(colours)]
        runs = [r for r in results if r.name == name]
        # Epoch 0, at 0 s: the loss before training, the same start for every optimizer.
        per_epoch = list(zip(*([r.initial_loss] + r.epoch_losses for r in runs)))
        mean = [statistics.mean(values) for values in per_epoch]
        low, high = [min(values) for values in per_epoch], [max(values) for values in per_epoch]
        epochs = range(len(mean))
        by_epoch.plot(epochs, mean, marker="o", markersize=3, color=colour, label=name)
        by_epoch.fill_between(epochs, low, high, color=colour, alpha=0.2, linewidth=0)
        seconds = [0.0] + [statistics.mean(values) for values in zip(*(r.epoch_seconds for r in runs))]
        by_time.plot(seconds, mean, marker="o", markersize=3, color=colour, label=name)
        by_time.fill_between(seconds, low, high, color=colour, alpha=0.2, linewidth=0)
    seeds = len({r.seed for r in results})
    for ax, xlabel in ((by_epoch, "epoch"), (by_time, "seconds in training steps (mean over seeds)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (whole training set)")
        ax.grid(True, which="both", alpha=0.3)
    by_epoch.set_title(f"loss per epoch: mean of {seeds} seed(s), band: their range")
    by_time.set_title("loss against wall-clock time")
    by_epoch.legend(fontsize=7)

    kib = [row["state_bytes"] / 2**10 for row in rows]
    bars = memory.barh(range(len(rows)), kib, color=colours[: len(rows)])
    memory.bar_label(bars, labels=[f"{v:,.0f} KiB" for v in kib], padding=3, fontsize=8)
    memory.set_yticks(range(len(rows)), [row["optimizer"].split(" (")[0] for row in rows])
    memory.invert_yaxis()
    memory.set_xscale("log")
    memory.set_xlim(right=max(kib) * 8)
    memory.set_xlabel("optimizer state (KiB, log scale)")
    memory.set_title("optimizer state")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_outputs(results: list[RunResult], rows: list[dict], out: Path, header: str, with_plot: bool):
    out.mkdir(parents=True, exist_ok=True)
    harness.write_results(rows, out, "demo_digits")
    curves = [{"optimizer": r.name, "seed": r.seed, "epoch": epoch, "train_loss": loss,
               "seconds_in_steps": seconds}
              for r in results
              for epoch, (loss, seconds) in enumerate(zip([r.initial_loss] + r.epoch_losses,
                                                         [0.0] + r.epoch_seconds))]
    harness.write_results(curves, out, "demo_digits_curves")
    (out / "demo_digits.md").write_text(f"{header}\n\n{format_markdown(rows)}\n")
    if not with_plot:
        return
    try:
        plot(results, rows, out / "demo_digits.png", header)
    except ImportError:
        print("matplotlib is not installed: no plot written")


def parse_args(argv=None) -> argparse.Namespace:
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/local/demo/",
        smoke_help="one epoch, one seed: checks the plumbing",
    )
    parser.add_argument("--epochs", type=harness.positive_int, default=10, help="(default: %(default)s)")
    parser.add_argument("--seeds", type=harness.positive_int, default=2,
                        help="runs per optimizer, seeds 0..N-1 (default: %(default)s)")
    parser.add_argument("--batch-size", type=harness.positive_int, default=BATCH_SIZE,
                        help="(default: %(default)s)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="optimizers whose name starts so")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs, args.seeds = 1, 1
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    builders = BUILDERS
    if args.only:
        builders = {n: b for n, b in BUILDERS.items() if any(n.startswith(o) for o in args.only)}
        if not builders:
            raise SystemExit(f"--only matched none of: {', '.join(BUILDERS)}")
    # One thread, as in the experiments: the same runs compute the same figures in both.
    torch.set_num_threads(1)
    out = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name="demo")
    backend = tritonopt.select_backend(torch.device("cpu"))
    header = (
        f"digits MLP 64-256-256-10, {args.epochs} epochs, batch {args.batch_size}, "
        f"{args.seeds} seed(s), 1 thread; tritonopt ops on the CPU run the {backend} backend; "
        f"measured on {harness.cpu_model()}, torch {torch.__version__}"
    )
    print(header, flush=True)
    data = load_digits_split()
    steps_per_run = args.epochs * -(-len(data.y_train) // args.batch_size)
    results = []
    with harness.progress(len(builders) * args.seeds * steps_per_run, "loading", unit="step") as bar:
        for name, builder in builders.items():
            for seed in range(args.seeds):
                bar.set_description(f"{name}, seed {seed}")
                results.append(train_one(name, builder, data, seed, args.epochs, args.batch_size, bar))
    rows = summarise(results)
    print()
    print(format_markdown(rows))
    save_outputs(results, rows, out, header, with_plot=not args.no_plot)
    print(f"\nwrote {out}/demo_digits.csv, demo_digits_curves.csv, .md and .png")
    return rows


if __name__ == "__main__":
    main()
