"""Benchmark tritonopt's optimizers against the authors' implementations, in one run.

For each algorithm with an *anchor*, the authors' own code (``perf/anchors/``: K-FAC against
gpauloski/kfac-pytorch, FOSI-Adam against hsivan/fosi's torch version, M-FAC and S-MFAC against
IST-DASLab/EFCP), at the same hyperparameters on the same model and batch:

* **agreement** (at the demo's size): in lockstep from the same initial weights, on the same
  batches, through at least one of their periodic updates: before each step tritonopt's model
  takes the anchor's parameters, and the relative difference of the two updates,
  ``max |u_tritonopt - u_anchor| / max |u_anchor|``, must stay within the bound each pair
  derives from float32 rounding at every step;
* **time**: the step alone and the whole training iteration, each the mean over whole periods
  of the algorithm's schedule (as ``perf.bench_optimizer_step`` measures them), tritonopt's and
  the anchor's alternately, ``--repeats`` times, reporting the median of each; the ratio
  tritonopt / anchor is the figure, below 1 when tritonopt is faster, with its spread: the
  smallest and largest ratio of one repeat's two measurements;
* the optimizer state each holds.

The anchors are read from checkouts of their repositories under ``--anchors`` (default
``.anchors/``, filled by ``make anchors``); hsivan/fosi also needs ``torchopt``. A pair whose
checkout is missing is reported as skipped; a checkout that is there but does not import stops
the run with the error and how to fix it. Sizes are ``perf.bench_optimizer_step``'s: ``demo``
and ``cnn`` (the CPU default, one thread: the demo's MLP and a CIFAR-size small ResNet),
``resnet18`` (added by default on a GPU), ``shrunk`` (``--smoke``).

    python -m perf.bench_anchors [--smoke] [--anchors DIR] [--sizes demo cnn resnet18] [--repeats 7] [--profile 8]
                                 [--kernels 8] [--only KFAC+SGD FOSI-Adam S-MFAC MFAC]

``--profile N`` then runs each side's step under ``cProfile`` and prints, per pair, the ``N``
functions where each step spends the most of its own time (host time: on a GPU the kernels run
asynchronously and show where they are waited for), so the two sides' costs can be compared
line by line. ``--kernels N`` runs it under torch's profiler instead and prints each side's ``N``
costliest GPU kernels (on the CPU: operators) with their calls and microseconds per step: how
many launches a step makes, and which ones take the time.

Results: ``anchors.csv`` in ``perf/results/<device>/``. The exit status is 1 when a pair
disagrees beyond its bound, or when a checkout that is there does not import.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/bench_anchors.py
    import _as_module

    _as_module.run(__file__)

import contextlib
import copy
import cProfile
import gc
import importlib
import importlib.util
import pstats
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

from perf import _harness as harness
from perf.anchors import AnchorBroken, AnchorMissing, AnchorPair, fosi_anchor, kfac_anchor
from perf.bench_optimizer_step import SIZES, Entry, Size, measure

NAME = "anchors"
DEFAULT_ANCHORS = harness.REPO_ROOT / ".anchors"
# The pair names of perf/anchors/, for --only.
ALGORITHMS = ("KFAC+SGD", "FOSI-Adam", "S-MFAC", "MFAC")
AGREEMENT_BATCH_SEED = 1


def anchor_modules() -> list:
    """The modules defining anchor pairs."""
    modules = [kfac_anchor, fosi_anchor]
    if importlib.util.find_spec("perf.anchors.efcp") is not None:
        modules.append(importlib.import_module("perf.anchors.efcp"))
    return modules


def agreement(pair: AnchorPair, size: Size, device: torch.device) -> float:
    """The largest relative difference of the two sides' updates, in lockstep.

    Before each step tritonopt's model takes the anchor's parameters, so both see the same
    gradient and only the optimizers' arithmetic differs (on a ReLU network, two runs apart by
    rounding alone drift apart once a unit's sign flips). For step ``t``, with ``u`` each side's
    change of the parameters: ``max |u_tritonopt - u_anchor| / max |u_anchor|``, less the rounding
    of the stored parameters (``eps * |theta|`` per entry); the figure is the largest over
    ``pair.agreement_steps`` steps.
    """
    torch.manual_seed(0)
    initial = size.make_model().to(device)
    ours, theirs = copy.deepcopy(initial), copy.deepcopy(initial)
    step_ours, step_theirs = pair.build_tritonopt(ours), pair.build_anchor(theirs)
    gen = torch.Generator().manual_seed(AGREEMENT_BATCH_SEED)
    loss_fn = torch.nn.functional.cross_entropy
    flat = torch.nn.utils.parameters_to_vector
    worst = 0.0
    for _ in range(pair.agreement_steps):
        x = torch.randn(size.batch, *size.input_shape, generator=gen).to(device)
        y = torch.randint(0, size.classes, (size.batch,), generator=gen).to(device)
        with torch.no_grad():
            for a, b in zip(ours.parameters(), theirs.parameters()):
                a.copy_(b)
            before = flat(theirs.parameters()).clone()
        step_ours(x, y, loss_fn)
        step_theirs(x, y, loss_fn)
        with torch.no_grad():
            after_ours, after_theirs = flat(ours.parameters()), flat(theirs.parameters())
            # Storing theta + u rounds each side's parameter once, by half a unit in the last
            # place of the result: differences within that are no difference in the updates.
            stored = torch.finfo(after_theirs.dtype).eps * torch.maximum(after_ours.abs(), after_theirs.abs())
            beyond = ((after_ours - after_theirs).abs() - stored).clamp(min=0)
            worst = max(worst, beyond.max().item() / (after_theirs - before).abs().max().item())
    return worst


def timed(pair: AnchorPair, size: Size, device: torch.device, *, repeats: int, min_iterations: int,
          use_nvtx: bool = False) -> dict:
    """Median step and iteration times of both sides, measured alternately."""
    sides = {
        "tritonopt": Entry(pair.name, pair.anchor, lambda model, _: pair.build_tritonopt(model),
                           period=lambda _: pair.period),
        "anchor": Entry(pair.anchor, pair.anchor, lambda model, _: pair.build_anchor(model),
                        period=lambda _: pair.period),
    }
    samples: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, entry in sides.items():
            samples[side].append(measure(entry, size, device, min_iterations=min_iterations, use_nvtx=use_nvtx))
            gc.collect()
    row = {}
    for side, rows in samples.items():
        row[f"{side}_step_ms"] = statistics.median(r["step_ms"] for r in rows)
        row[f"{side}_iteration_ms"] = statistics.median(r["iteration_ms"] for r in rows)
        row[f"{side}_state_bytes"] = rows[0]["state_bytes"]
    row["step_ratio"] = row["tritonopt_step_ms"] / row["anchor_step_ms"]
    row["iteration_ratio"] = row["tritonopt_iteration_ms"] / row["anchor_iteration_ms"]
    # The two sides of one repeat ran back to back, under the same load: their ratios show
    # how far the machine's noise moves the figure.
    for quantity in ("step", "iteration"):
        ratios = [ours[f"{quantity}_ms"] / theirs[f"{quantity}_ms"]
                  for ours, theirs in zip(samples["tritonopt"], samples["anchor"])]
        row[f"{quantity}_ratio_min"], row[f"{quantity}_ratio_max"] = min(ratios), max(ratios)
    row["parameters"] = rows[0]["parameters"]
    row["iterations"] = rows[0]["iterations"]
    return row


def _readable(function: str) -> str:
    """cProfile's names of built-ins, shortened: ``Tensor.view``, ``torch.topk``."""
    if function.startswith("<method '"):
        method, owner = function[len("<method '"):].split("' of '", 1)
        return f"{owner.split('.')[-1].split(chr(39))[0].replace('TensorBase', 'Tensor')}.{method}"
    if function.startswith("<built-in method "):
        return function[len("<built-in method "):].rstrip(">")
    return function


def _warmed_step(pair: AnchorPair, size: Size, device: torch.device, build):
    """``(step, x, y)``: one side's step on a fresh model, run past its warm-up as the timing is."""
    torch.manual_seed(0)
    model = size.make_model().to(device)
    x = torch.randn(size.batch, *size.input_shape, device=device)
    y = torch.randint(0, size.classes, (size.batch,), device=device)
    step = build(model)
    for _ in range(step.warmup_steps + 2 * pair.period):
        step(x, y, torch.nn.functional.cross_entropy)
    return step, x, y


def _sides(pair: AnchorPair):
    return (pair.name, pair.build_tritonopt), (pair.anchor, pair.build_anchor)


def profile_steps(pair: AnchorPair, size: Size, device: torch.device, *, iterations: int,
                  top: int) -> list[list]:
    """Each side's ``top`` functions by own time in its step, ms per step, with the step's total."""
    table = []
    for name, build in _sides(pair):
        step, x, y = _warmed_step(pair, size, device, build)
        profile = cProfile.Profile()

        @contextlib.contextmanager
        def profiled():
            profile.enable()
            try:
                yield
            finally:
                profile.disable()

        step.update_timer = profiled
        for _ in range(iterations):
            step(x, y, torch.nn.functional.cross_entropy)
        stats = pstats.Stats(profile).stats
        total = sum(entry[2] for entry in stats.values()) * 1e3 / iterations
        ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
        table.append([name, "(whole step)", "", f"{total:.3f}", "100 %"])
        for (filename, line, function), entry in ranked:
            where = f"{Path(filename).name}:{line}" if line else "(built-in)"
            function = _readable(function)
            own = entry[2] * 1e3 / iterations
            table.append([name, function, where, f"{own:.3f}", f"{100 * own / total:.0f} %"])
    return table


def kernel_steps(pair: AnchorPair, size: Size, device: torch.device, *, iterations: int,
                 top: int) -> list[list]:
    """Each side's ``top`` costliest GPU kernels (CPU: operators, own time) in its step.

    Rows ``[side, name, calls per step, us per step, share]``, each side's first the step's
    totals: every kernel launch (every operator call on the CPU, nested ones included) and
    their time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    table = []
    for name, build in _sides(pair):
        step, x, y = _warmed_step(pair, size, device, build)
        calls: dict[str, int] = {}
        microseconds: dict[str, float] = {}

        @contextlib.contextmanager
        def profiled():
            with profile(activities=activities) as profiler:
                yield
            for event in profiler.key_averages():
                if on_gpu != (event.device_type == DeviceType.CUDA):
                    continue
                own = event.self_device_time_total if on_gpu else event.self_cpu_time_total
                calls[event.key] = calls.get(event.key, 0) + event.count
                microseconds[event.key] = microseconds.get(event.key, 0.0) + own

        step.update_timer = profiled
        for _ in range(iterations):
            step(x, y, torch.nn.functional.cross_entropy)
        total = sum(microseconds.values()) / iterations
        table.append([name, "(whole step)", f"{sum(calls.values()) / iterations:.1f}", f"{total:.1f}", "100 %"])
        for key in sorted(microseconds, key=microseconds.get, reverse=True)[:top]:
            own = microseconds[key] / iterations
            share = f"{100 * own / total:.0f} %" if total else ""
            table.append([name, key[:60], f"{calls[key] / iterations:.1f}", f"{own:.1f}", share])
    return table


def ratio_spread(row: dict, quantity: str) -> str:
    """The smallest and largest one-repeat ratio, e.g. ``1.18-1.29x``."""
    return f"{row[f'{quantity}_ratio_min']:.2f}-{row[f'{quantity}_ratio_max']:.2f}x"


def parser():
    p = harness.bench_parser(__doc__.split("\n\n")[0],
                             smoke_help="the shrunk size only, one repeat: checks the script in seconds")
    p.add_argument("--anchors", type=Path, default=DEFAULT_ANCHORS, metavar="DIR",
                   help="folder of the anchors' checkouts (default: .anchors/, see `make anchors`)")
    p.add_argument("--sizes", nargs="+", choices=["demo", "cnn", "resnet18"], default=None,
                   help="default: demo, cnn and resnet18 on a GPU, demo and cnn on the CPU")
    p.add_argument("--repeats", type=harness.positive_int, default=7,
                   help="alternating measurements of each side; the median is reported (default 7)")
    p.add_argument("--only", nargs="+", choices=sorted(ALGORITHMS), default=None, metavar="ALGORITHM",
                   help=f"only these pairs ({', '.join(sorted(ALGORITHMS))}; default: all), e.g. to fit the "
                        "ResNet-18 size into a short GPU loan")
    p.add_argument("--profile", type=harness.positive_int, default=None, metavar="N",
                   help="also print each side's N costliest functions per step (cProfile, own time)")
    p.add_argument("--kernels", type=harness.positive_int, default=None, metavar="N",
                   help="also print each side's N costliest GPU kernels per step (CPU: operators), with their "
                        "calls per step (torch's profiler)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    device, primary = harness.training_step_device()
    use_nvtx = harness.nvtx_enabled(args.nvtx, device)
    if args.smoke:
        sizes, repeats, min_iterations = ["shrunk"], 1, 3
    else:
        sizes = args.sizes or (["demo", "cnn", "resnet18"] if device.type == "cuda" else ["demo", "cnn"])
        repeats, min_iterations = args.repeats, (20 if device.type == "cuda" else 40)
    print(f"{NAME}: device {harness.device_name()}, tritonopt backend {primary}, anchors from {args.anchors}")
    rows, claims, profiles, kernel_tables = [], [], [], []
    for size_name in sizes:
        size = SIZES[size_name]
        pairs, broken = [], []
        for module in anchor_modules():
            try:
                pairs += module.pairs(args.anchors, size)
            except AnchorMissing as missing:
                print(f"skipped {module.__name__.rsplit('.', 1)[-1]} at {size_name}: {missing}")
            except AnchorBroken as error:
                broken.append(f"{module.__name__.rsplit('.', 1)[-1]}: {error}")
        if broken:
            # A checkout that is there was meant to be measured: skipping it would pass for a
            # run with nothing to compare.
            print("error: an anchor's checkout does not import, nothing measured\n"
                  + "\n".join(broken), file=sys.stderr)
            return 1
        if args.only:
            pairs = [pair for pair in pairs if pair.name in args.only]
        with harness.progress(len(pairs), f"{size_name}", unit="pair") as bar:
            for pair in pairs:
                bar.set_description(f"{size_name}: {pair.name}")
                row = {"size": size_name, "algorithm": pair.name, "anchor": pair.anchor}
                # The agreement is a property of the arithmetic, and each pair derives its bound
                # for the demo's model: checked there, where both run quickly.
                if size_name == "demo":
                    row["relative_difference"] = agreement(pair, size, device)
                    row["rtol"] = pair.rtol
                    row["agreement_steps"] = pair.agreement_steps
                    claims.append(harness.Claim(
                        f"{pair.name} agrees with {pair.anchor} after {pair.agreement_steps} steps at {size_name}",
                        row["relative_difference"] <= pair.rtol,
                        f"relative difference {row['relative_difference']:.2e}, bound {pair.rtol:.1e}",
                        smoke_scale=True,
                    ))
                try:
                    row.update(timed(pair, size, device, repeats=repeats, min_iterations=min_iterations,
                                     use_nvtx=use_nvtx))
                    if args.profile:
                        profiles.append((size_name, profile_steps(pair, size, device, iterations=min_iterations,
                                                                  top=args.profile)))
                    if args.kernels:
                        kernel_tables.append((size_name, kernel_steps(pair, size, device,
                                                                      iterations=min_iterations, top=args.kernels)))
                except torch.cuda.OutOfMemoryError:
                    print(f"skipped timing {pair.name} at {size_name}: out of GPU memory")
                rows.append(row)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                bar.update(1)
    if not rows:
        print(f"no anchor could be loaded from {args.anchors}: nothing measured")
        return 0
    for size_name in sizes:
        mine = [r for r in rows if r["size"] == size_name and "step_ratio" in r]
        if not mine:
            continue
        print(f"\n{size_name}: {mine[0]['parameters']:,} parameters")
        print(harness.format_table(
            ["algorithm", "anchor", "step ms", "anchor step ms", "step ratio", "iteration ratio",
             "step ratio range", "state MiB", "anchor state MiB", "rel. difference"],
            [[r["algorithm"], r["anchor"], r["tritonopt_step_ms"], r["anchor_step_ms"], f"{r['step_ratio']:.2f}x",
              f"{r['iteration_ratio']:.2f}x", ratio_spread(r, "step"),
              r["tritonopt_state_bytes"] / 2**20, r["anchor_state_bytes"] / 2**20,
              f"{r['relative_difference']:.1e}" if "relative_difference" in r else ""]
             for r in mine]))
    for size_name, table in profiles:
        print(f"\n{size_name}: where each step's time goes (cProfile, own time per step, ms)")
        print(harness.format_table(["side", "function", "where", "ms", "share"], table))
    what = "GPU kernels" if device.type == "cuda" else "operators"
    for size_name, table in kernel_tables:
        print(f"\n{size_name}: each step's {what} (torch's profiler, per step)")
        print(harness.format_table(["side", what[:-1], "calls", "us", "share"], table))
    print()
    out_dir = harness.output_dir(args.out, harness.device_results_dir(), smoke=args.smoke, name=NAME)
    print(f"wrote {harness.write_results(rows, out_dir, NAME)}")
    return harness.report_claims(claims, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
