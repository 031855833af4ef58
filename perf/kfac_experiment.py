"""K-FAC vs SGD-momentum on digits: iterations to a fixed training loss.

KAISA's claim (Pauloski et al. SC '21, sec. 1 and 5.3): K-FAC preconditioning
reaches the baseline's quality in fewer iterations than the base optimizer alone
(ResNet-32/CIFAR-10: 40 % fewer epochs, Fig. 1). The CPU-scale claim checked
here: on scikit-learn's digits, K-FAC with SGD-momentum underneath reaches a fixed
target loss in at least 1.5x fewer iterations than the best-tuned SGD-momentum.

Two tasks, both on the digits that ship with scikit-learn (nothing is downloaded):

* ``autoencoder`` (the primary result, the claim checked): all 1,797 images, pixels / 16, a
  64-128-32-8-32-128-64 MLP (tanh between layers, linear 8-unit bottleneck,
  sigmoid output), MSE loss, batches of 128 drawn with replacement, 1,000
  iterations, the full-data MSE every 10; targets MSE <= 0.03 and <= 0.02.
  K-FAC: factors every step, eigendecompositions every 10, damping 0.03,
  decay 0.95, KL clip 1e-3. LR grids: SGD {1, 3, 5, 7, 10}, K-FAC {0.1, 0.3, 1, 3, 10}.
* ``classifier`` (secondary, reported): the demo's task (``perf/_digits.py``: 1,437
  standardised training images, a 64-256-256-10 ReLU MLP), batches of 32 in
  shuffled epochs, cross-entropy, 300 iterations, the training-set loss every 5;
  targets 0.1, 0.05, 0.02. K-FAC: the demo's (``perf/_optimizers.py``): eigendecompositions
  every 5, damping 0.3. LR grids: SGD {0.02, 0.03, 0.05, 0.1}, K-FAC {0.03, 0.1, 0.3, 1}.

Every configuration runs once per seed; a seed fixes the initial weights and the
batch order, so SGD and K-FAC see the same ones. The metric is the first logged
iteration at which the full-data loss is at or below the target. For each target
and optimizer, the *best* learning rate is the one with the fewest mean
iterations among those where every seed reaches the target (a configuration
with a seed that never gets there cannot be best); the speed-up is SGD's mean
over K-FAC's mean. The exit status is 1 when the checked claim fails.

Results (``--out``, default ``perf/results/kfac/``), per task: ``kfac_<task>.csv``
(every logged point), ``kfac_<task>_runs.csv`` (per run: iterations to each
target, final loss, ms/step), ``kfac_<task>.md`` (claim, tables, verdict) and
``kfac_<task>.png`` (mean loss over seeds of the best configurations).
``--smoke`` runs a few iterations of one configuration per optimizer, in seconds.

    python -m perf.kfac_experiment [--task all|autoencoder|classifier] [--seeds 5]
                                   [--steps N] [--out DIR] [--smoke]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python perf/kfac_experiment.py
    import _as_module

    _as_module.run(__file__)

import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from perf import _harness as harness
from perf._digits import load_digits_split, make_mlp
from perf._optimizers import KFAC_SETTINGS, SGD_MOMENTUM, KFACStep, OptimizerStep

NAME = "kfac"
DEFAULT_OUT = harness.RESULTS_DIR / NAME
CLAIMED_SPEEDUP = 1.5
AUTOENCODER_KFAC_SETTINGS = dict(
    factor_update_steps=1, inv_update_steps=10, damping=0.03, factor_decay=0.95, kl_clip=1e-3
)


# --------------------------------------------------------------------------- tasks


def make_autoencoder(seed: int) -> torch.nn.Module:
    """64-128-32-8-32-128-64: tanh between layers, a linear bottleneck, a sigmoid output."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(),
        torch.nn.Linear(128, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 8),
        torch.nn.Linear(8, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 128), torch.nn.Tanh(),
        torch.nn.Linear(128, 64), torch.nn.Sigmoid(),
    )


def load_autoencoder_data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    pixels = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0  # 0..16 -> [0, 1]
    return pixels, pixels


def load_classifier_data() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits_split()
    return data.x_train, data.y_train


def batches_with_replacement(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    while True:
        yield torch.randint(0, n, (batch_size,), generator=generator)


def batches_in_epochs(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled epochs; the tail shorter than a batch is dropped."""
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    loss_label: str
    steps: int
    eval_every: int
    batch_size: int
    targets: tuple[float, ...]
    sgd_lrs: tuple[float, ...]
    kfac_lrs: tuple[float, ...]
    kfac_settings: dict
    make_model: Callable[[int], torch.nn.Module]
    load_data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable
    batches: Callable[[int, int, torch.Generator], Iterator[torch.Tensor]]
    description: str
    smoke_targets: tuple[float, ...]  # loose, just under the initial loss
    checks_claim: bool  # the primary task decides the exit status; the other is reported
    notes: tuple[str, ...] = ()
    recommended_sgd_lrs: Optional[tuple[float, ...]] = None  # when the SGD grid was widened


AUTOENCODER = Task(
    name="autoencoder",
    title="digits autoencoder 64-128-32-8-32-128-64 (primary result)",
    loss_label="full-data MSE",
    steps=1000,
    eval_every=10,
    batch_size=128,
    targets=(0.03, 0.02),
    # The recommended SGD grid is {1, 3, 5, 10}; 7 is added because 10 was reported to stall on
    # some seeds, so the best stable SGD may lie between 5 and 10: a denser grid only makes the
    # baseline stronger.
    sgd_lrs=(1.0, 3.0, 5.0, 7.0, 10.0),
    kfac_lrs=(0.1, 0.3, 1.0, 3.0, 10.0),
    recommended_sgd_lrs=(1.0, 3.0, 5.0, 10.0),
    kfac_settings=AUTOENCODER_KFAC_SETTINGS,
    make_model=make_autoencoder,
    load_data=load_autoencoder_data,
    loss_fn=torch.nn.functional.mse_loss,
    batches=batches_with_replacement,
    description=(
        "All 1,797 scikit-learn digits, pixels / 16. A 64-128-32-8-32-128-64 MLP (tanh between "
        "layers, linear 8-unit bottleneck, sigmoid output) reconstructs its input; MSE loss; "
        "batches of 128 drawn with replacement; the MSE over all 1,797 images every 10 iterations."
    ),
    smoke_targets=(0.15, 0.1),
    checks_claim=True,
    notes=(
        "The SGD grid adds lr 7 to the recommended {1, 3, 5, 10}: 10 was reported to stall on some "
        "seeds, so the best stable SGD could lie between 5 and 10. This can only make the baseline "
        "stronger; the speed-ups with the recommended grid alone are given below.",
        "The demo's classification MLP is the secondary result: `kfac_classifier.md`.",
    ),
)

CLASSIFIER = Task(
    name="classifier",
    title="digits classifier 64-256-256-10 (secondary result)",
    loss_label="training-set cross-entropy",
    steps=300,
    eval_every=5,
    batch_size=32,
    targets=(0.1, 0.05, 0.02),
    sgd_lrs=(0.02, 0.03, 0.05, 0.1),
    kfac_lrs=(0.03, 0.1, 0.3, 1.0),
    kfac_settings=KFAC_SETTINGS,
    make_model=make_mlp,
    load_data=load_classifier_data,
    loss_fn=torch.nn.functional.cross_entropy,
    batches=batches_in_epochs,
    description=(
        "The demo's task: 1,437 standardised training digits, a 64-256-256-10 ReLU MLP, "
        "cross-entropy, batches of 32 in shuffled epochs; the loss over the whole training set "
        "every 5 iterations."
    ),
    smoke_targets=(2.0, 1.5),
    checks_claim=False,
    notes=(
        "Damping 0.3 instead of the paper's 0.003: with 0.003 K-FAC reaches low losses early and "
        "then diverges on this task (with a mean-reduced loss G is tiny, so the step is close to "
        "grad / damping in most directions).",
        "The primary result is the autoencoder: `kfac_autoencoder.md`.",
    ),
)

TASKS = {task.name: task for task in (AUTOENCODER, CLASSIFIER)}
OPTIMIZER_LABELS = {"sgd": "SGD", "kfac": "SGD+K-FAC"}


def smoke_version(task: Task) -> Task:
    """A few iterations, one learning rate per optimizer, targets a few iterations can reach."""
    middle_sgd, middle_kfac = len(task.sgd_lrs) // 2, len(task.kfac_lrs) // 2
    return replace(
        task, steps=3 * task.eval_every, targets=task.smoke_targets,
        sgd_lrs=task.sgd_lrs[middle_sgd : middle_sgd + 1], kfac_lrs=task.kfac_lrs[middle_kfac : middle_kfac + 1],
    )


# --------------------------------------------------------------------------- training


@dataclass
class Run:
    kind: str
    lr: float
    seed: int
    curve: list[tuple[int, float]] = field(default_factory=list)  # (iteration, full-data loss)
    ms_per_step: float = 0.0
    skipped_steps: int = 0

    def iterations_to(self, target: float) -> float:
        return next((it for it, loss in self.curve if loss <= target), math.inf)

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]


def train_run(task: Task, kind: str, lr: float, seed: int, data, progress=None) -> Run:
    inputs, labels = data
    model = task.make_model(seed)
    if kind == "kfac":
        step = KFACStep(model, lr=lr, **task.kfac_settings)
    else:
        step = OptimizerStep(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=SGD_MOMENTUM))
    batches = task.batches(len(labels), task.batch_size, torch.Generator().manual_seed(1000 + seed))
    run = Run(kind, lr, seed)

    def log(iteration: int) -> None:
        with torch.no_grad():  # no factor statistics are captured without autograd
            run.curve.append((iteration, task.loss_fn(model(inputs), labels).item()))

    log(0)
    seconds = 0.0
    for iteration in range(1, task.steps + 1):
        batch = next(batches)
        began = time.perf_counter()
        step(inputs[batch], labels[batch], task.loss_fn)
        seconds += time.perf_counter() - began
        if iteration % task.eval_every == 0 or iteration == task.steps:
            log(iteration)
        if progress is not None:
            progress.update(1)
    run.ms_per_step = 1e3 * seconds / task.steps
    if kind == "kfac":
        run.skipped_steps = step.preconditioner.skipped_steps
    return run


def run_task(task: Task, seeds: int, progress_bar: bool = True) -> dict[tuple[str, float], list[Run]]:
    data = task.load_data()
    grid = [("sgd", lr) for lr in task.sgd_lrs] + [("kfac", lr) for lr in task.kfac_lrs]
    progress = harness.progress(len(grid) * seeds * task.steps, task.name, unit="it") if progress_bar else None
    runs = {(kind, lr): [train_run(task, kind, lr, seed, data, progress) for seed in range(seeds)]
            for kind, lr in grid}
    if progress is not None:
        progress.close()
    return runs


# --------------------------------------------------------------------------- summary


@dataclass
class Configuration:
    kind: str
    lr: float
    runs: list[Run]

    def hits(self, target: float) -> list[float]:
        return [run.iterations_to(target) for run in self.runs]

    def mean_iterations(self, target: float) -> float:
        """Mean over seeds; infinite when any seed never reaches the target."""
        return statistics.mean(self.hits(target))

    @property
    def mean_final_loss(self) -> float:
        return statistics.mean(run.final_loss for run in self.runs)

    @property
    def ms_per_step(self) -> float:
        return statistics.mean(run.ms_per_step for run in self.runs)


def configurations(runs: dict[tuple[str, float], list[Run]]) -> list[Configuration]:
    return [Configuration(kind, lr, per_seed) for (kind, lr), per_seed in runs.items()]


def best_configuration(configs: list[Configuration], kind: str, target: float) -> Optional[Configuration]:
    """Fewest mean iterations among the learning rates where every seed reaches ``target``.

    Ties go to the lower mean final loss. None when no learning rate qualifies.
    """
    qualified = [c for c in configs if c.kind == kind and math.isfinite(c.mean_iterations(target))]
    if not qualified:
        return None
    return min(qualified, key=lambda c: (c.mean_iterations(target), c.mean_final_loss))


@dataclass
class TargetResult:
    target: float
    sgd: Optional[Configuration]
    kfac: Optional[Configuration]
    speedup: float  # nan when K-FAC never qualifies
    lower_bound: bool  # SGD never qualifies: the speed-up is at least `speedup`

    @property
    def holds(self) -> bool:
        return math.isfinite(self.speedup) and self.speedup >= CLAIMED_SPEEDUP


def compare(configs: list[Configuration], target: float, steps: int) -> TargetResult:
    sgd, kfac = best_configuration(configs, "sgd", target), best_configuration(configs, "kfac", target)
    if kfac is None:
        return TargetResult(target, sgd, kfac, math.nan, False)
    if sgd is None:  # SGD needs more than the whole budget
        return TargetResult(target, sgd, kfac, steps / kfac.mean_iterations(target), True)
    return TargetResult(target, sgd, kfac, sgd.mean_iterations(target) / kfac.mean_iterations(target), False)


def format_iterations(value: float) -> str:
    return f"{value:.0f}" if math.isfinite(value) else "never"


def format_hits(hits: list[float]) -> str:
    return ", ".join(format_iterations(h) for h in hits)


def format_speedup(result: TargetResult) -> str:
    if not math.isfinite(result.speedup):
        return "n/a"
    return (">" if result.lower_bound else "") + f"{result.speedup:.2f}x"


def markdown(task: Task, runs, seeds: int, seconds: float, smoke: bool) -> str:
    configs = configurations(runs)
    results = [compare(configs, t, task.steps) for t in task.targets]
    verdict = "holds" if all(r.holds for r in results) else "does not hold"
    per_target = "; ".join(f"{format_speedup(r)} at {r.target:g}" for r in results)
    settings = ", ".join(f"{k}={v:g}" for k, v in task.kfac_settings.items())
    lines = [
        f"# K-FAC vs SGD-momentum: {task.title}",
        "",
    ]
    if smoke:
        lines += ["**Smoke run** (a few iterations, one learning rate each): the numbers below "
                  "check the plumbing and say nothing about the claim.", ""]
    lines += [
        f"**Claim.** On digits, K-FAC (with SGD-momentum underneath) reaches a fixed target loss in "
        f"at least {CLAIMED_SPEEDUP:g}x fewer iterations than the best-tuned SGD-momentum.",
        "",
        f"**Measured.** Speed-up in iterations of the best K-FAC over the best SGD: {per_target}. "
        f"On this task the claim **{verdict}** (it must hold at every target).",
        "",
        f"**Setup.** {task.description} {task.steps} iterations, {seeds} seed(s) per learning rate "
        f"(seed s: initial weights and batch order, the same for both optimizers). SGD momentum "
        f"{SGD_MOMENTUM:g}; K-FAC ({settings}) preconditions the gradients of every Linear layer "
        f"before the same SGD step, with the optimizer's learning rate in the KL clip. "
        f"Learning-rate grids: SGD {{{', '.join(f'{lr:g}' for lr in task.sgd_lrs)}}}, "
        f"K-FAC {{{', '.join(f'{lr:g}' for lr in task.kfac_lrs)}}}.",
        "",
        f"**Best-tuned.** For each target and optimizer, the learning rate with the fewest mean "
        f"iterations among those where *every* seed reaches the target (ties: lower final loss). "
        f"Iterations are the first logged iteration (every {task.eval_every}) with "
        f"{task.loss_label} <= target.",
        "",
        "| target | best SGD lr | SGD iterations per seed | SGD mean | best K-FAC lr "
        "| K-FAC iterations per seed | K-FAC mean | speed-up (iterations) | speed-up (wall clock) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [f"{r.target:g}"]
        for config in (r.sgd, r.kfac):
            if config is None:
                cells += ["none", "-", "-"]
            else:
                cells += [f"{config.lr:g}", format_hits(config.hits(r.target)),
                          format_iterations(config.mean_iterations(r.target))]
        if r.sgd is not None and r.kfac is not None:
            wall = (r.sgd.mean_iterations(r.target) * r.sgd.ms_per_step) / (
                r.kfac.mean_iterations(r.target) * r.kfac.ms_per_step)
            wall_text = f"{wall:.2f}x"
        else:
            wall_text = "n/a"
        cells += [format_speedup(r), wall_text]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "`never`: that seed did not reach the target within the budget. `none`: no learning rate "
        "of the grid reaches the target on every seed (a `>` speed-up is then a lower bound: SGD "
        "needs more than the whole budget).",
        "",
        "## All configurations",
        "",
        "| optimizer | lr | " + " | ".join(f"iterations to {t:g} (per seed) | mean" for t in task.targets)
        + f" | final {task.loss_label} (per seed) | mean | ms/step |",
        "|---|---|" + "---|---|" * len(task.targets) + "---|---|---|",
    ]
    for c in configs:
        cells = [OPTIMIZER_LABELS[c.kind], f"{c.lr:g}"]
        for t in task.targets:
            cells += [format_hits(c.hits(t)), format_iterations(c.mean_iterations(t))]
        cells += [", ".join(f"{run.final_loss:.4f}" for run in c.runs), f"{c.mean_final_loss:.4f}",
                  f"{c.ms_per_step:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Notes", ""]
    for r in results:
        for config in (r.sgd, r.kfac):
            if config is None:
                continue
            grid = task.sgd_lrs if config.kind == "sgd" else task.kfac_lrs
            if len(grid) > 1 and config.lr in (min(grid), max(grid)):
                lines.append(f"- At target {r.target:g} the best {OPTIMIZER_LABELS[config.kind]} lr "
                             f"({config.lr:g}) is at the edge of its grid: a wider grid might do better.")
    skipped = sum(run.skipped_steps for per_seed in runs.values() for run in per_seed)
    if skipped:
        lines.append(f"- K-FAC refused {skipped} step(s) with non-finite gradients or statistics.")
    lines += [f"- {note}" for note in task.notes]
    if task.recommended_sgd_lrs is not None and set(task.recommended_sgd_lrs) != set(task.sgd_lrs):
        recommended = [c for c in configs if c.kind == "kfac" or c.lr in task.recommended_sgd_lrs]
        alone = "; ".join(
            f"{format_speedup(r)} at {r.target:g} (best SGD lr "
            f"{'none' if r.sgd is None else f'{r.sgd.lr:g}'})"
            for r in (compare(recommended, t, task.steps) for t in task.targets)
        )
        grid = ", ".join(f"{lr:g}" for lr in task.recommended_sgd_lrs)
        lines.append(f"- With the recommended SGD grid {{{grid}}} alone the speed-ups are: {alone}.")
    lines += [
        "- ms/step is the mean time of one training step (forward, backward, K-FAC, SGD; the "
        "full-data evaluations excluded) on a shared 2-core CPU with one thread: it is noisy, and "
        "the wall-clock speed-up is only indicative. The claim is about iterations.",
        f"- Run time of this task: {seconds:.0f} s "
        f"(torch {torch.__version__}, {torch.get_num_threads()} thread).",
        "",
    ]
    return "\n".join(lines)


def plot(task: Task, runs, path: Path) -> None:
    plt = harness.pyplot()
    configs = configurations(runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, colour in (("sgd", "tab:blue"), ("kfac", "tab:red")):
        chosen = plotted_configuration(configs, kind, task.targets)
        if chosen is None:
            continue
        iterations = [it for it, _ in chosen.runs[0].curve]
        for run in chosen.runs:
            ax.plot(iterations, [loss for _, loss in run.curve], color=colour, alpha=0.2, linewidth=0.8)
        mean = [statistics.mean(run.curve[i][1] for run in chosen.runs) for i in range(len(iterations))]
        ax.plot(iterations, mean, color=colour, linewidth=2,
                label=f"{OPTIMIZER_LABELS[kind]} lr={chosen.lr:g} (mean of {len(chosen.runs)} seeds)")
    for target in task.targets:
        ax.axhline(target, color="grey", linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel(task.loss_label)
    ax.set_title(f"{task.title}:\nbest SGD-momentum vs best SGD+K-FAC at target {task.targets[-1]:g} "
                 "(faint: single seeds)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plotted_configuration(configs, kind, targets) -> Optional[Configuration]:
    """The best at the tightest target any learning rate reaches, else the lowest final loss."""
    for target in reversed(targets):
        chosen = best_configuration(configs, kind, target)
        if chosen is not None:
            return chosen
    candidates = [c for c in configs if c.kind == kind]
    return min(candidates, key=lambda c: c.mean_final_loss) if candidates else None


def write_results(task: Task, runs, out: Path, seeds: int, seconds: float, smoke: bool) -> str:
    stem = out / f"kfac_{task.name}"
    all_runs = [run for per_seed in runs.values() for run in per_seed]
    harness.write_results(
        [{"optimizer": OPTIMIZER_LABELS[run.kind], "lr": run.lr, "seed": run.seed, "iteration": iteration,
          "loss": f"{loss:.6g}"} for run in all_runs for iteration, loss in run.curve],
        out, stem.name)
    harness.write_results(
        [{"optimizer": OPTIMIZER_LABELS[run.kind], "lr": run.lr, "seed": run.seed,
          **{f"iterations_to_{t:g}": run.iterations_to(t) for t in task.targets},
          "final_loss": f"{run.final_loss:.6g}", "ms_per_step": f"{run.ms_per_step:.3f}",
          "skipped_steps": run.skipped_steps} for run in all_runs],
        out, f"{stem.name}_runs")
    summary = markdown(task, runs, seeds, seconds, smoke)
    Path(f"{stem}.md").write_text(summary)
    try:
        plot(task, runs, Path(f"{stem}.png"))
    except ImportError:
        print("matplotlib is not installed: no plot written")
    return summary


def claim(task: Task, runs) -> harness.Claim:
    """The task's verdict: K-FAC's speed-up in iterations at least the claimed one at every target."""
    configs = configurations(runs)
    results = [compare(configs, t, task.steps) for t in task.targets]
    return harness.Claim(
        f"{task.name}: K-FAC reaches every target in >= {CLAIMED_SPEEDUP:g}x fewer iterations than SGD",
        all(r.holds for r in results), "; ".join(f"{format_speedup(r)} at {r.target:g}" for r in results))


def main(argv=None) -> int:
    parser = harness.script_parser(__doc__.split("\n")[0], default_out="perf/results/kfac/",
                                   smoke_help="a few iterations, one LR per optimizer, 1 seed")
    parser.add_argument("--task", choices=["all", *TASKS], default="all",
                        help="which task(s) to run (default: both)")
    parser.add_argument("--seeds", type=harness.positive_int, default=5, help="(default: %(default)s)")
    parser.add_argument("--steps", type=harness.positive_int, default=None,
                        help="iterations per run (default: the task's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small matrices: more threads only oversubscribe the cores
    out = harness.output_dir(args.out, DEFAULT_OUT, smoke=args.smoke, name=NAME)
    names = list(TASKS) if args.task == "all" else [args.task]
    checks = []
    for name in names:
        task = TASKS[name]
        if args.smoke:
            task = smoke_version(task)
            args.seeds = 1
        if args.steps is not None:
            task = replace(task, steps=args.steps)
        began = time.perf_counter()
        runs = run_task(task, args.seeds, progress_bar=not args.no_progress)
        summary = write_results(task, runs, out, args.seeds, time.perf_counter() - began, args.smoke)
        print(summary)
        print(f"wrote {out}/kfac_{task.name}{{.csv,_runs.csv,.md,.png}}")
        if task.checks_claim:
            checks.append(claim(task, runs))
        else:
            print(f"{task.name}: reported, not a checked claim (the primary result is the autoencoder)")
    return harness.report_claims(checks, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
