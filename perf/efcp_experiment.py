"""EFCP's claim at CPU scale: a 99 %-sparse M-FAC with error feedback trains like dense M-FAC.

Protocol: scikit-learn's digits (fixed permutation, 1437 train / 360 test, features
standardised with the training statistics), an MLP 64-256-256-10 with ReLU and cross-entropy
(d = 85,002), batch 32 (45 steps per epoch), constant learning rate, no weight decay,
10 epochs, seeds 0, 1 and 2.

Optimizers (``perf/_optimizers.py``): SGD (momentum 0.9); dense M-FAC (m = 128, damp 0.03);
S-MFAC with the same m and damp at 1 % density (blocks of 4096, 41 kept per block) with and
without error feedback, and at 0.1 %; LR-MFAC (rank 4). Each runs every learning rate of its
grid (``LR_GRIDS``) on every seed: one sweep, and every figure comes from it. The rule, fixed
here before any result: each optimizer's best learning rate is the one of lowest mean final
train loss over the seeds (a non-finite loss counts as infinite; the smaller lr on a tie). A
best lr on the edge of its grid is flagged in the summary.

Reported per optimizer at its best lr: final train loss (full training set, after the last
step) and test accuracy as mean +- standard error over the seeds (SE = sample std / sqrt(n)),
optimizer-state bytes and ms per step (means), the whole sweep, and a plot of the per-epoch
mean training loss. The claims checked (exit status 1 if one fails), each optimizer at its
own best lr, on means over the seeds:

* S-MFAC 1 % + EF: final train loss within 2x of dense M-FAC's;
* S-MFAC 1 % + EF: test accuracy within 1 point of dense M-FAC's, above or below (two-sided);
* S-MFAC 1 % without EF: a clearly higher final train loss than with EF (by more than 2 SE of
  the difference);
* S-MFAC's state at least 30x smaller than dense M-FAC's (the one a smoke run checks).

A full run also measures S-MFAC's state at ResNet-18 size (d = 11,689,512, m = 1024, 1 %,
blocks of 16384) after one step on random gradients, next to the dense window's size
(``efcp_resnet18_state.md``; about 1 GB of memory).

Run from the repository root (about 6 minutes on 2 CPU cores)::

    python -m perf.efcp_experiment [--epochs 10] [--seeds 0 1 2] [--out perf/results/efcp]
    python -m perf.efcp_experiment --smoke     # seconds: checks the plumbing
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/efcp_experiment.py
    import _as_module

    _as_module.run(__file__)

import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from perf import _harness as harness
from perf._stats import mean_se
from perf import _stats as stats
from perf import _optimizers as optimizers
from perf._digits import load_digits_split, make_mlp, steps_per_epoch, train

NAME = "efcp"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
STATE_RATIO = 30  # S-MFAC's state at least this many times smaller than dense M-FAC's
LOSS_RATIO = 2  # S-MFAC 1 % + EF's final train loss at most this many times dense M-FAC's
PARITY_POINTS = 1.0  # |S-MFAC 1 % + EF's test accuracy - dense M-FAC's|, in points
CLEARLY_SE = 2  # "clearly higher": the difference of the means exceeds this many of its SEs
SMOKE_STEPS = 5
DEFAULT_SEEDS = (0, 1, 2)

RUNS = {
    "SGD": optimizers.build_sgd,
    "D-MFAC": optimizers.build_mfac,
    "S-MFAC 1% EF": optimizers.build_sparse_mfac,
    "S-MFAC 1% no EF": optimizers.build_sparse_mfac_no_ef,
    "S-MFAC 0.1% EF": optimizers.build_sparse_mfac_01,
    "LR-MFAC r4": optimizers.build_lowrank_mfac,
}
MFAC_LRS = (0.003, 0.01, 0.03, 0.1)
# The learning rates each optimizer runs: one sweep, in this script, on every seed. Each grid reaches a
# factor of 2 to 3 beyond the lr the earlier single-lr runs used, on both sides.
LR_GRIDS = {name: MFAC_LRS for name in RUNS} | {"SGD": (0.02, 0.05, 0.1, 0.2)}


# --------------------------------------------------------------------------- training


def train_one(name, lr, data, seed, epochs, max_steps=None, progress=None) -> dict:
    model = make_mlp(seed)
    step = RUNS[name](model, steps_per_epoch(data), lr=lr)
    run = train(model, step, data, seed=seed, epochs=epochs, max_steps=max_steps,
                on_step=progress.update if progress is not None else (lambda: None))
    return {
        "optimizer": name, "lr": lr, "seed": seed, "final_train_loss": run.train_losses[-1],
        "test_accuracy": run.test_accuracies[-1] * 100, "state_bytes": step.state_bytes(),
        "ms_per_step": run.ms_per_step, "epoch_losses": run.mean_batch_losses,
    }


# --------------------------------------------------------------------------- statistics


def pm(mean: float, se: float, digits: int = 6) -> str:
    return stats.pm(mean, se, digits)

def difference(a, b) -> tuple[float, float]:
    """Mean of ``a`` minus mean of ``b``, and the SE of that difference (independent seeds' runs)."""
    (mean_a, se_a), (mean_b, se_b) = mean_se(a), mean_se(b)
    return mean_a - mean_b, math.hypot(se_a, se_b)


def runs_of(rows, name: str, lr: float | None = None) -> list[dict]:
    return [r for r in rows if r["optimizer"] == name and (lr is None or r["lr"] == lr)]


def best_lr(rows, name: str) -> float:
    """The rule: the lr of lowest mean final train loss over the seeds; non-finite counts as
    infinite, and the smaller lr wins a tie."""
    lrs = sorted({r["lr"] for r in runs_of(rows, name)})
    if not lrs:
        raise ValueError(f"no runs of {name!r} to choose a learning rate from")

    def mean_loss(lr):
        losses = [r["final_train_loss"] for r in runs_of(rows, name, lr)]
        return statistics.fmean(losses) if all(math.isfinite(v) for v in losses) else math.inf

    return min(lrs, key=lambda lr: (mean_loss(lr), lr))


# --------------------------------------------------------------------------- reporting


def summarise(rows) -> dict:
    """Per optimizer, its best lr by :func:`best_lr` and its figures there; ``sweep``: every lr's."""
    summary = {}
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        lr = best_lr(rows, name)
        grid = sorted({r["lr"] for r in runs_of(rows, name)})
        runs = runs_of(rows, name, lr)
        summary[name] = {
            "lr": lr, "on_edge": len(grid) > 1 and lr in (grid[0], grid[-1]),
            "loss": mean_se(r["final_train_loss"] for r in runs),
            "accuracy": mean_se(r["test_accuracy"] for r in runs),
            "per_seed_loss": [r["final_train_loss"] for r in runs],
            "per_seed_acc": [r["test_accuracy"] for r in runs],
            "state_bytes": float(np.mean([r["state_bytes"] for r in runs])),
            "ms_per_step": float(np.mean([r["ms_per_step"] for r in runs])),
            "curve": np.mean([r["epoch_losses"] for r in runs], axis=0).tolist(),
            "sweep": [(g, mean_se(r["final_train_loss"] for r in runs_of(rows, name, g)),
                       mean_se(r["test_accuracy"] for r in runs_of(rows, name, g))) for g in grid],
        }
    return summary


def claims(summary, rows) -> list[harness.Claim]:
    """The claims, each optimizer at its own best lr (``summary``), judged on means over the seeds."""
    dense, sparse = summary.get("D-MFAC"), summary.get("S-MFAC 1% EF")
    plain = summary.get("S-MFAC 1% no EF")
    if not (dense and sparse and plain):
        return []

    def at_best(name, key):
        return [r[key] for r in runs_of(rows, name, summary[name]["lr"])]

    loss_ratio = sparse["loss"][0] / dense["loss"][0]
    gap, gap_se = difference(at_best("S-MFAC 1% EF", "test_accuracy"), at_best("D-MFAC", "test_accuracy"))
    no_ef, no_ef_se = difference(at_best("S-MFAC 1% no EF", "final_train_loss"),
                                 at_best("S-MFAC 1% EF", "final_train_loss"))
    return [
        harness.Claim(f"S-MFAC 1% EF loss within {LOSS_RATIO}x of D-MFAC",
                      sparse["loss"][0] <= LOSS_RATIO * dense["loss"][0],
                      f"{pm(*sparse['loss'])} vs {pm(*dense['loss'])}: {loss_ratio:.2f}x"),
        harness.Claim(f"S-MFAC 1% EF accuracy within {PARITY_POINTS:g} pt of D-MFAC (above or below)",
                      abs(gap) <= PARITY_POINTS,
                      f"{pm(*sparse['accuracy'], 2)} vs {pm(*dense['accuracy'], 2)}: "
                      f"difference {pm(gap, gap_se, 2)} points"),
        harness.Claim(f"no EF ends with a higher loss than EF, by more than {CLEARLY_SE} SE",
                      not math.isnan(no_ef_se) and no_ef > CLEARLY_SE * no_ef_se,
                      f"{pm(*plain['loss'])} vs {pm(*sparse['loss'])}: difference {pm(no_ef, no_ef_se)}"),
        harness.Claim(f"S-MFAC state >= {STATE_RATIO}x smaller than D-MFAC",
                      dense["state_bytes"] >= STATE_RATIO * sparse["state_bytes"],
                      f"{dense['state_bytes'] / sparse['state_bytes']:.1f}x", smoke_scale=True),
    ]


def summary_lines(summary, checks, args) -> list[str]:
    command = "python -m perf.efcp_experiment" + (
        " --smoke" if args.smoke else f" --epochs {args.epochs} --seeds {' '.join(map(str, args.seeds))}")
    seeds = len(args.seeds)
    lines = [
        "# EFCP on the digits MLP (64-256-256-10, d = 85,002)",
        "",
        f"Command: `{command}`; device: {harness.device_name()}, "
        f"torch {torch.__version__}. M-FAC family: m = {optimizers.MFAC_HYPER['ngrads']}, damp = "
        f"{optimizers.MFAC_HYPER['damp']}; S-MFAC blocks of {optimizers.SPARSE_BLOCK}; SGD momentum "
        f"{optimizers.SGD_MOMENTUM}. Each optimizer at its own best lr: the lowest mean final train loss "
        f"over the {seeds} seed(s) in the sweep below. Mean ± standard error over the seeds.",
        "",
        "| optimizer | best lr | final train loss | per seed | test acc % | state MiB | ms/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        edge = " (grid edge)" if s["on_edge"] else ""
        lines.append(
            f"| {name} | {s['lr']:g}{edge} | {pm(*s['loss'])} | "
            f"{' / '.join(f'{v:.6f}' for v in s['per_seed_loss'])} | {pm(*s['accuracy'], 2)} | "
            f"{s['state_bytes'] / 2**20:.3f} | {s['ms_per_step']:.1f} |")
    lines += ["", "The sweep (every configuration run, mean ± SE over the seeds; * = chosen):", "",
              "| optimizer | lr | final train loss | test acc % |", "|---|---|---|---|"]
    for name, s in summary.items():
        for lr, loss, accuracy in s["sweep"]:
            mark = " *" if lr == s["lr"] else ""
            lines.append(f"| {name} | {lr:g}{mark} | {pm(*loss)} | {pm(*accuracy, 2)} |")
    edges = [name for name, s in summary.items() if s["on_edge"]]
    if edges:
        lines += ["", f"Best lr on the edge of its grid: {', '.join(edges)}."]
    if checks:
        lines += ["", "Claim checks:", ""]
        for claim in checks:
            verdict = "not checked (smoke run)" if args.smoke and not claim.smoke_scale else (
                "PASS" if claim.holds else "FAIL")
            lines.append(f"- {verdict}: {claim.text} ({claim.detail})")
    return lines


def write_outputs(rows, summary, checks, out_dir: Path, args) -> None:
    csv_rows = [{k: v for k, v in r.items() if k != "epoch_losses"} for r in rows]
    csv_path = harness.write_results(csv_rows, out_dir, NAME)
    lines = summary_lines(summary, checks, args)
    print("\n".join(lines))
    (out_dir / "efcp_summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {out_dir / 'efcp_summary.md'}")
    try:
        plt = harness.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in summary.items():
        ax.plot(range(1, len(s["curve"]) + 1), s["curve"], marker="o", label=f"{name} (lr {s['lr']:g})")
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training loss over the epoch (mean over seeds)")
    ax.set_title("EFCP on digits MLP: S-MFAC (99% sparse) vs dense M-FAC, each at its best lr")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_dir / "efcp.png", dpi=100)
    plt.close(fig)
    print(f"wrote {out_dir / 'efcp.png'}")


def resnet18_state(out_dir: Path) -> None:
    """S-MFAC's measured state at ResNet-18 size, and what a dense window would hold."""
    import tritonopt
    from perf._models import resnet18
    from tritonopt.optim import SparseMFAC

    params = list(resnet18().parameters())
    d = sum(p.numel() for p in params)
    ngrads, density, block = 1024, 0.01, 16384
    opt = SparseMFAC(params, lr=0.01, density=density, ngrads=ngrads, damp=1e-5, block_size=block)
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with tritonopt.use_backend("reference"):
        opt.step()
    measured = opt.state_bytes()
    dense_window = 4 * ngrads * d
    text = (f"S-MFAC at ResNet-18 size (d = {d:,}, m = {ngrads}, density {density:.0%}, blocks of {block}): "
            f"{measured:,} bytes after one step ({measured / 1e9:.2f} GB); a dense float32 window of "
            f"the same m holds {dense_window:,} bytes ({dense_window / 1e9:.1f} GB), "
            f"{dense_window / measured:.1f}x more.")
    print(text)
    (out_dir / "efcp_resnet18_state.md").write_text(text + "\n")
    del opt, params


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/efcp/",
        smoke_help=f"one seed, {SMOKE_STEPS} steps per optimizer: checks the plumbing in seconds "
        "(only the state-size claim is checked)",
    )
    parser.add_argument("--epochs", type=harness.positive_int, default=10, help="(default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS), help="(default: %(default)s)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help="optimizers to run (default: all of %(choices)s)")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")
    if len(set(args.runs)) != len(args.runs):
        parser.error(f"--runs must be distinct, got {args.runs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # One thread: on a shared 2-core machine OpenMP synchronisation dominates these small ops.
    torch.set_num_threads(1)
    if args.smoke:
        args.epochs, args.seeds = 1, [0]
    max_steps = SMOKE_STEPS if args.smoke else None
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    data = load_digits_split()
    rows = []
    # The whole sweep: every optimizer at every lr of its grid on every seed; the best lrs are chosen after it.
    jobs = [(name, lr, seed) for name in args.runs for lr in LR_GRIDS[name] for seed in args.seeds]
    per_run = min(max_steps or 10**9, args.epochs * steps_per_epoch(data))
    with harness.progress(len(jobs) * per_run, "runs") as bar:
        for name, lr, seed in jobs:
            bar.set_description(f"{name}, lr {lr:g}, seed {seed}")
            rows.append(train_one(name, lr, data, seed, args.epochs, max_steps, bar))
    summary = summarise(rows)
    checks = claims(summary, rows)
    write_outputs(rows, summary, checks, out_dir, args)
    if not args.smoke:
        resnet18_state(out_dir)
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
