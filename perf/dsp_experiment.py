"""DSP's claims at CPU scale: accuracy over seeds at tuned lrs, throughput against five baselines, stragglers.

The paper (Xu, Huo and Huang, CVPR 2020, sec. 5) trains ResNets cut into K = 3-4
blocks on GPUs and reports test accuracy at or close to BP's (Tables 1 and 4),
speed-ups of x1.5-x4.8 over BP / model-parallel BP (Table 3), and a smaller
relative slow-down than its baselines when GPUs are randomly slowed (Table 2).
Its queues put at least 2 batches of staleness on each stage boundary, so with
two stages its configurations are m >= 2 (here m = 2 and 4); m = 1 is this
library's own and is reported beside them, labelled so.

The experiment has two parts, which run separately (``--part``) or together:

* ``accuracy`` (:mod:`perf._dsp_accuracy`; insensitive to the machine's load):
  BP and DSP at each staleness, every learning rate of one grid, every seed,
  trained ``--sweep-epochs`` epochs in one process each (DSP through
  ``DSPSimulator``, the gloo stages' arithmetic bit for bit); each mode's
  learning rate by a rule fixed in the code (highest mean test accuracy over the
  seeds after the sweep's epochs); the chosen runs continue to ``--epochs``
  epochs, with the test accuracy after every epoch;
* ``timing`` (:mod:`perf._dsp_timing`; needs an otherwise idle machine): BP,
  BP-K, DDP, GPipe and 1F1B at each micro-batch count and DSP at each staleness,
  interleaved every 16 batches, ``--timing-epochs`` timed epochs; then BP-K and
  each DSP configuration under random stragglers at +50 / +100 / +150 %.

Data and model (:mod:`perf._dsp_setup`): 4,096 synthetic 32x32 images of 10
classes, a residual CNN of 32 channels and six units, batches of 64, SGD with
momentum 0.9 per stage.

Claims (each printed PASS or FAIL; the script exits with status 1 if one fails;
``--smoke`` runs a few batches and checks only claim 0, which a few batches
decide):

0. (timing) BP-K ends part A with BP's weights, bit for bit;
1. (accuracy, two-sided) every DSP configuration ends within X of BP's test
   accuracy, each at its own learning rate: X = the paper's largest gap below BP
   (1.07 points, Table 1) + 2 standard errors of the mean per-seed difference;
2. (timing, one-sided) every DSP configuration has at least 1.3x the throughput
   of BP-K (median of the epochs' paired ratios); its ratios to every other
   mode are reported, not claimed;
3. (timing) at every straggler level, every DSP configuration's relative
   slow-down (straggled / paired clean time - 1, median over the repetitions)
   is smaller than BP-K's; a claim fails as undecided when any straggled run of
   the two was faster than its clean pair.

Outputs (``--out``, default ``perf/results/dsp/``; with ``--smoke``
``perf/results/local/smoke/dsp/``): accuracy: ``dsp_accuracy_runs.csv`` (every
run and epoch), ``dsp_accuracy.md``, ``dsp_accuracy.png``; timing:
``dsp_runs.csv`` (every timed run), ``dsp_summary.csv`` (one row per mode and
level), ``dsp_timing.md``, ``dsp_timing.png``; ``dsp_summary.md`` joins the
two parts' tables found in the folder.

    python -m perf.dsp_experiment [--part accuracy|timing|all] [--smoke] [--out DIR]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/dsp_experiment.py
    import _as_module

    _as_module.run(__file__)

import os
import shlex
import sys
import time

import torch

from perf import _dsp_accuracy as accuracy
from perf import _dsp_timing as timing
from perf import _harness as harness
from perf._dsp_setup import Sizes

NAME = "dsp"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
PARTS = ("accuracy", "timing", "all")
SMOKE_SIZES = dict(train_size=256, test_size=128, channels=8)


def parse_args(argv):
    parser = harness.script_parser(
        __doc__.split("\n\n")[0], default_out="perf/results/dsp/",
        smoke_help="seconds: 256 training images, 8 channels, 2 seeds, 2 learning rates, 1 timed epoch, 4 "
        "straggler batches, one repetition; checks the plumbing and the BP-K reproduction only",
    )
    parser.add_argument("--part", choices=PARTS, default="all",
                        help="accuracy (load-insensitive), timing (needs an idle machine) or both (default)")
    parser.add_argument("--seeds", type=harness.positive_int, default=3,
                        help="seeds of the accuracy part, 0..N-1 (default: %(default)s)")
    parser.add_argument("--epochs", type=harness.positive_int, default=6,
                        help="epochs of the chosen accuracy runs (default: %(default)s)")
    parser.add_argument("--sweep-epochs", type=harness.positive_int, default=3,
                        help="epochs of the learning-rate sweep, at most --epochs (default: %(default)s)")
    parser.add_argument("--workers", type=harness.positive_int, default=2,
                        help="accuracy runs at a time, one thread each (default: %(default)s)")
    parser.add_argument("--timing-epochs", type=harness.positive_int, default=5,
                        help="timed epochs of every mode (default: %(default)s)")
    parser.add_argument("--straggler-reps", type=harness.positive_int, default=3,
                        help="repetitions of the straggler runs (default: %(default)s)")
    parser.add_argument("--straggler-steps", type=harness.positive_int, default=48,
                        help="batches per straggler run, at most one epoch's 64 (default: %(default)s)")
    parser.add_argument("--split", type=int, default=2,
                        help="residual units on rank 0 for BP-K and DSP (1..5; GPipe's and 1F1B's cut stays "
                        "after unit 3)")
    args = parser.parse_args(argv)
    if not 1 <= args.split < Sizes.units:
        parser.error(f"--split must be in 1..{Sizes.units - 1}")
    if args.sweep_epochs > args.epochs:
        parser.error(f"--sweep-epochs ({args.sweep_epochs}) must be at most --epochs ({args.epochs})")
    if args.straggler_steps > Sizes().steps_per_epoch:
        parser.error(f"--straggler-steps must be at most {Sizes().steps_per_epoch} (one epoch's batches)")
    return args


def setups(args) -> tuple[accuracy.AccuracySetup, timing.TimingSetup]:
    if args.smoke:
        sizes = Sizes(split=args.split, **SMOKE_SIZES)
        return (accuracy.AccuracySetup(sizes=sizes, lrs=(0.01, 0.02), seeds=(0, 1), sweep_epochs=1, epochs=2,
                                       workers=min(args.workers, 2), smoke=True),
                timing.TimingSetup(sizes=sizes, epochs=1, straggler_steps=4, straggler_reps=1,
                                   straggler_levels=(0.0, 1.0), smoke=True))
    sizes = Sizes(split=args.split)
    return (accuracy.AccuracySetup(sizes=sizes, seeds=tuple(range(args.seeds)), sweep_epochs=args.sweep_epochs,
                                   epochs=args.epochs, workers=args.workers),
            timing.TimingSetup(sizes=sizes, epochs=args.timing_epochs, straggler_steps=args.straggler_steps,
                               straggler_reps=args.straggler_reps))


def claims_text(checks, smoke: bool) -> str:
    lines = ["", "Claims:", ""]
    for claim in checks:
        verdict = "not checked (smoke run)" if smoke and not claim.smoke_scale else (
            "PASS" if claim.holds else "FAIL")
        lines.append(f"- {verdict}: {claim.text}" + (f" ({claim.detail})" if claim.detail else ""))
    return "\n".join(lines) + "\n"


def run_accuracy_part(setup: accuracy.AccuracySetup, out_dir, command: str) -> list[harness.Claim]:
    began = time.perf_counter()
    outcome = accuracy.run_accuracy(setup)
    checks = accuracy.claims(setup, outcome)
    text = accuracy.markdown(setup, outcome, command, time.perf_counter() - began)
    print(text)
    rows = [{key: row[key] for key in ("mode", "lr", "seed", "epoch", "stage", "test_accuracy", "train_loss",
                                       "run_seconds")} | {"chosen_lr": outcome["chosen"][row["mode"]]}
            for row in outcome["rows"]]
    written = harness.write_results(rows, out_dir, "dsp_accuracy_runs")
    (out_dir / "dsp_accuracy.md").write_text(text + claims_text(checks, setup.smoke))
    accuracy.plot(setup, outcome, out_dir / "dsp_accuracy.png")
    print(f"wrote {written}, {out_dir / 'dsp_accuracy.md'}")
    return checks


def run_timing_part(setup: timing.TimingSetup, out_dir, command: str) -> list[harness.Claim]:
    began = time.perf_counter()
    per_rank = timing.run_ranks(setup)
    runs = timing.merge_runs(per_rank)
    summary = timing.summarise(setup, runs)
    checks = timing.claims(setup, summary, per_rank)
    text = timing.markdown(setup, summary, runs, command, time.perf_counter() - began)
    print(text)
    summary_rows = [
        {"part": "A", "mode": name, "level": 0.0, "median_seconds": t["seconds"], "min_seconds": t["min"],
         "max_seconds": t["max"], "samples_per_s": t["samples_per_s"]}
        for name, t in summary["throughput"].items()
    ] + [
        {"part": "B", "mode": name, "level": level, "median_seconds": s["seconds"], "slowdown": s["slowdown"],
         "min_slowdown": min(s["relative"]), "max_slowdown": max(s["relative"])}
        for (name, level), s in summary["stragglers"].items()
    ]
    written = [harness.write_results(runs, out_dir, "dsp_runs"),
               harness.write_results(summary_rows, out_dir, "dsp_summary")]
    (out_dir / "dsp_timing.md").write_text(text + claims_text(checks, setup.smoke))
    timing.plot(setup, summary, out_dir / "dsp_timing.png")
    print("wrote " + ", ".join(str(path) for path in written + [out_dir / "dsp_timing.md"]))
    return checks


def join_summary(out_dir) -> None:
    """``dsp_summary.md``: the parts' tables found in ``out_dir`` (a part run alone keeps the other's)."""
    parts = [out_dir / name for name in ("dsp_accuracy.md", "dsp_timing.md") if (out_dir / name).exists()]
    text = "# DSP against BP, BP-K, DDP, GPipe and 1F1B (CPU)\n\n" + "\n".join(p.read_text() for p in parts)
    (out_dir / "dsp_summary.md").write_text(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    accuracy_setup, timing_setup = setups(args)
    out_dir = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITONOPT_BACKEND", "reference")
    torch.set_num_threads(1)
    command = shlex.join(["python", "-m", "perf.dsp_experiment", *argv])
    checks = []
    if args.part in ("accuracy", "all"):
        checks += run_accuracy_part(accuracy_setup, out_dir, command)
    if args.part in ("timing", "all"):
        checks += run_timing_part(timing_setup, out_dir, command)
    join_summary(out_dir)
    print(f"wrote {out_dir / 'dsp_summary.md'}")
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
