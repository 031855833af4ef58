"""EFCP's claim at CPU scale: a 99 %-sparse M-FAC with error feedback trains like dense M-FAC.

Protocol: scikit-learn's digits (fixed permutation, 1437 train / 360 test, features
standardised with the training statistics), an MLP 64-256-256-10 with ReLU and cross-entropy
(d = 85,002), batch 32 (45 steps per epoch), constant learning rate, no weight decay,
10 epochs, seeds 0 and 1.

Optimizers (``perf/_optimizers.py``): SGD (lr 0.05, momentum 0.9); dense M-FAC (m = 128,
damp 0.03, lr 0.01); S-MFAC with the same m, damp and lr at 1 % density (blocks of 4096, 41
kept per block) with and without error feedback, and at 0.1 %; LR-MFAC (rank 4).

Reported per optimizer: final train loss (full training set, after the last step), test
accuracy, optimizer-state bytes and ms per step (mean over seeds), and a plot of the
per-epoch mean training loss. The claims checked (exit status 1 if one fails):

* S-MFAC 1 % + EF: final train loss within 2x of dense M-FAC's and test accuracy within
  1 point (means over seeds);
* S-MFAC 1 % without EF: a clearly higher final train loss than with EF;
* S-MFAC's state at least 30x smaller than dense M-FAC's (the one a smoke run checks).

A full run also measures S-MFAC's state at ResNet-18 size (d = 11,689,512, m = 1024, 1 %,
blocks of 16384) after one step on random gradients, next to the dense window's size
(``efcp_resnet18_state.md``; about 1 GB of memory).

Run from the repository root (about a minute on 2 CPU cores)::

    python -m perf.efcp_experiment [--epochs 10] [--seeds 0 1] [--out perf/results/efcp]
    python -m perf.efcp_experiment --smoke     # seconds: checks the plumbing
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/efcp_experiment.py
    import _as_module

    _as_module.run(__file__)

import sys
from pathlib import Path

import numpy as np
import torch

from perf import _harness as harness
from perf import _optimizers as optimizers
from perf._digits import load_digits_split, make_mlp, steps_per_epoch, train

NAME = "efcp"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
STATE_RATIO = 30  # S-MFAC's state at least this many times smaller than dense M-FAC's
SMOKE_STEPS = 5

RUNS = {
    "SGD": optimizers.build_sgd,
    "D-MFAC": optimizers.build_mfac,
    "S-MFAC 1% EF": optimizers.build_sparse_mfac,
    "S-MFAC 1% no EF": optimizers.build_sparse_mfac_no_ef,
    "S-MFAC 0.1% EF": optimizers.build_sparse_mfac_01,
    "LR-MFAC r4": optimizers.build_lowrank_mfac,
}


# --------------------------------------------------------------------------- training


def train_one(name, build, data, seed, epochs, max_steps=None, progress=None) -> dict:
    model = make_mlp(seed)
    step = build(model, steps_per_epoch(data))
    run = train(model, step, data, seed=seed, epochs=epochs, max_steps=max_steps,
                on_step=progress.update if progress is not None else (lambda: None))
    return {
        "optimizer": name, "seed": seed, "final_train_loss": run.train_losses[-1],
        "test_accuracy": run.test_accuracies[-1] * 100, "state_bytes": step.state_bytes(),
        "ms_per_step": run.ms_per_step, "epoch_losses": run.mean_batch_losses,
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


def claims(summary) -> list[harness.Claim]:
    dense, sparse = summary.get("D-MFAC"), summary.get("S-MFAC 1% EF")
    plain = summary.get("S-MFAC 1% no EF")
    if not (dense and sparse and plain):
        return []
    return [
        harness.Claim("S-MFAC 1% EF loss within 2x of D-MFAC",
                      sparse["final_train_loss"] <= 2 * dense["final_train_loss"],
                      f"{sparse['final_train_loss']:.4f} vs {dense['final_train_loss']:.4f}"),
        harness.Claim("S-MFAC 1% EF accuracy within 1 pt of D-MFAC",
                      abs(sparse["test_accuracy"] - dense["test_accuracy"]) <= 1.0,
                      f"{sparse['test_accuracy']:.2f} vs {dense['test_accuracy']:.2f}"),
        harness.Claim("no EF ends with a higher loss than EF",
                      plain["final_train_loss"] > sparse["final_train_loss"],
                      f"{plain['final_train_loss']:.4f} vs {sparse['final_train_loss']:.4f}"),
        harness.Claim(f"S-MFAC state >= {STATE_RATIO}x smaller than D-MFAC",
                      dense["state_bytes"] >= STATE_RATIO * sparse["state_bytes"],
                      f"{dense['state_bytes'] / sparse['state_bytes']:.1f}x", smoke_scale=True),
    ]


def write_outputs(rows, summary, checks, out_dir: Path, args) -> None:
    csv_rows = [{k: v for k, v in r.items() if k != "epoch_losses"} for r in rows]
    csv_path = harness.write_results(csv_rows, out_dir, NAME)
    headers = ["optimizer", "final train loss (mean)", "per seed", "test acc % (mean)",
               "state MiB", "ms/step"]
    table_rows = [
        [name, s["final_train_loss"], " / ".join(f"{v:.4f}" for v in s["per_seed_loss"]),
         s["test_accuracy"], s["state_bytes"] / 2**20, s["ms_per_step"]]
        for name, s in summary.items()
    ]
    print(harness.format_table(headers, table_rows))
    command = "python -m perf.efcp_experiment" + (
        " --smoke" if args.smoke else f" --epochs {args.epochs} --seeds {' '.join(map(str, args.seeds))}")
    lines = [
        "# EFCP on the digits MLP (64-256-256-10, d = 85,002)",
        "",
        f"Command: `{command}`; device: {harness.device_name()}, "
        f"torch {torch.__version__}. M-FAC family: m = {optimizers.MFAC_HYPER['ngrads']}, damp = "
        f"{optimizers.MFAC_HYPER['damp']}, lr = {optimizers.MFAC_HYPER['lr']}; S-MFAC blocks of "
        f"{optimizers.SPARSE_BLOCK}; SGD lr 0.05, momentum 0.9. Means over seeds.",
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
        for claim in checks:
            verdict = "not checked (smoke run)" if args.smoke and not claim.smoke_scale else (
                "PASS" if claim.holds else "FAIL")
            lines.append(f"- {verdict}: {claim.text} ({claim.detail})")
    (out_dir / "efcp_summary.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {out_dir / 'efcp_summary.md'}")
    try:
        plt = harness.pyplot()
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="(default: %(default)s)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), metavar="RUN",
                        help="optimizers to run (default: all of %(choices)s)")
    return parser.parse_args(argv)


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
    jobs = [(name, seed) for name in args.runs for seed in args.seeds]
    per_run = min(max_steps or 10**9, args.epochs * steps_per_epoch(data))
    with harness.progress(len(jobs) * per_run, "runs") as bar:
        for name, seed in jobs:
            bar.set_description(f"{name}, seed {seed}")
            rows.append(train_one(name, RUNS[name], data, seed, args.epochs, max_steps, bar))
    summary = summarise(rows)
    checks = claims(summary)
    write_outputs(rows, summary, checks, out_dir, args)
    if not args.smoke:
        resnet18_state(out_dir)
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
