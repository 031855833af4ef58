"""The K-FAC perf scripts run end to end (smoke mode), the convergence metric and its
"best learning rate" rule behave, and the demo entry trains."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from _perf import output_of, perf_module, read_csv, smoke_run

kfac_experiment = perf_module("kfac_experiment")


def run_smoke(script: str, *extra: str):
    result, out = smoke_run(script, *extra)
    assert result.returncode == 0, output_of(result)
    return result, out


def has_matplotlib():
    return importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def convergence_smoke():
    """One smoke run of both tasks (a few iterations, one seed, one LR per optimizer)."""
    return run_smoke("kfac_experiment")[1]


read_rows = read_csv


@pytest.mark.smoke
@pytest.mark.parametrize("task", ["autoencoder", "classifier"])
def test_convergence_experiment_smoke(convergence_smoke, task):
    stem = convergence_smoke / f"kfac_{task}"
    points = read_rows(Path(f"{stem}.csv"))
    assert {r["optimizer"] for r in points} == {"SGD", "SGD+K-FAC"}
    curves: dict[tuple, list[tuple[int, float]]] = {}
    for r in points:
        curves.setdefault((r["optimizer"], float(r["lr"]), int(r["seed"])), []).append(
            (int(r["iteration"]), float(r["loss"]))
        )
    for key, curve in curves.items():
        iterations = [it for it, _ in curve]
        losses = [loss for _, loss in curve]
        assert iterations[0] == 0 and iterations == sorted(set(iterations)), key
        assert all(math.isfinite(loss) and loss > 0 for loss in losses), key
        assert losses[-1] < 0.9 * losses[0], f"{key}: the full-data loss did not decrease: {losses}"

    runs = read_rows(Path(f"{stem}_runs.csv"))
    assert len(runs) == len(curves)
    target_columns = [c for c in runs[0] if c.startswith("iterations_to_")]
    assert target_columns
    for r in runs:
        curve = curves[(r["optimizer"], float(r["lr"]), int(r["seed"]))]
        assert float(r["final_loss"]) == pytest.approx(curve[-1][1], rel=1e-5)
        assert 0 < float(r["ms_per_step"]) < 1e4
        for column in target_columns:
            target = float(column.removeprefix("iterations_to_"))
            first = next((it for it, loss in curve if loss <= target), math.inf)
            assert float(r[column]) == first, (column, r)

    summary = Path(f"{stem}.md").read_text()
    assert "**Claim.**" in summary and "**Measured.**" in summary and "Smoke run" in summary
    assert "speed-up (iterations)" in summary
    if has_matplotlib():
        assert Path(f"{stem}.png").stat().st_size > 0


@pytest.mark.smoke
def test_only_the_chosen_task_runs():
    result, out = run_smoke("kfac_experiment", "--no-progress", "--task", "autoencoder")
    assert (out / "kfac_autoencoder.md").exists()
    assert not (out / "kfac_classifier.md").exists()
    # A smoke run cannot decide the iterations claim: it is reported, not checked.
    assert "not checked (smoke run): autoencoder: K-FAC reaches every target" in result.stdout


def fake_run(kind, lr, seed, first_hit, steps=100, every=10):
    """A run whose loss is 1 until ``first_hit`` (None: never) and 0.01 from there."""
    curve = [(it, 0.01 if first_hit is not None and it >= first_hit else 1.0)
             for it in range(0, steps + 1, every)]
    return kfac_experiment.Run(kind, lr, seed, curve)


def configs_from(hits: dict[tuple[str, float], list]):
    runs = {key: [fake_run(*key, seed, h) for seed, h in enumerate(per_seed)] for key, per_seed in hits.items()}
    return kfac_experiment.configurations(runs)


def test_best_needs_every_seed_to_reach_the_target():
    configs = configs_from({
        ("sgd", 1.0): [40, 60, 50],
        ("sgd", 5.0): [10, None, 10],  # fastest seeds, but one never gets there
        ("sgd", 3.0): [30, 30, 30],
        ("kfac", 1.0): [10, 20, 30],
    })
    best_sgd = kfac_experiment.best_configuration(configs, "sgd", 0.1)
    assert best_sgd.lr == 3.0
    result = kfac_experiment.compare(configs, 0.1, steps=100)
    assert result.kfac.lr == 1.0
    assert result.speedup == pytest.approx(30 / 20)
    assert result.holds and not result.lower_bound


def test_speedup_when_an_optimizer_never_qualifies():
    never_sgd = configs_from({("sgd", 1.0): [None, 50], ("kfac", 1.0): [20, 30]})
    result = kfac_experiment.compare(never_sgd, 0.1, steps=100)
    assert result.sgd is None and result.lower_bound and result.speedup == pytest.approx(100 / 25)
    never_kfac = configs_from({("sgd", 1.0): [40, 50], ("kfac", 1.0): [20, None]})
    result = kfac_experiment.compare(never_kfac, 0.1, steps=100)
    assert result.kfac is None and not result.holds and math.isnan(result.speedup)
    slow_kfac = configs_from({("sgd", 1.0): [40, 40], ("kfac", 1.0): [30, 30]})
    assert not kfac_experiment.compare(slow_kfac, 0.1, steps=100).holds  # 1.33x < 1.5x


def test_autoencoder_shape():
    model = kfac_experiment.make_autoencoder(0)
    linear = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [m.in_features for m in linear] + [linear[-1].out_features] == [64, 128, 32, 8, 32, 128, 64]
    # The 8-unit bottleneck feeds the next Linear directly (no activation).
    layers = list(model)
    assert isinstance(layers[layers.index(linear[2]) + 1], torch.nn.Linear)
    pixels, targets = kfac_experiment.load_autoencoder_data()
    assert pixels.shape == (1797, 64) and torch.equal(pixels, targets)
    assert 0 <= pixels.min() and pixels.max() <= 1
    out = model(pixels[:5])
    assert ((0 < out) & (out < 1)).all()


@pytest.mark.smoke
def test_tradeoff_smoke_matches_formulas():
    result, out = run_smoke("kaisa_tradeoff")
    assert "PASS: measured K-FAC memory and bytes received equal the formulas" in result.stdout
    rows = read_csv(out / "kaisa_tradeoff.csv")
    assert len(rows) == 3 * 4
    for r in rows:
        assert r["kfac_bytes"] == r["kfac_bytes_formula"]
        for label in ("factor_allreduce", "eigen_broadcast", "grad_broadcast"):
            assert r[f"{label}_received"] == r[f"{label}_received_formula"], label
    mean_eigen = {
        f: sum(int(r["eigen_bytes"]) for r in rows if float(r["fraction"]) == f) / 4 for f in (0.25, 0.5, 1.0)
    }
    assert mean_eigen[0.5] == 2 * mean_eigen[0.25] and mean_eigen[1.0] == 4 * mean_eigen[0.25]


@pytest.mark.smoke
def test_bench_smoke():
    result, out = run_smoke("bench_kfac")
    rows = read_csv(out / "kfac.csv")
    providers = {r["provider"] for r in rows}
    assert {"torch", "floor", "sgd", "sgd+kfac"} <= providers
    assert {r["op"] for r in rows} == {"kfac_factor_update", "eigenbasis_precondition", "train_step"}
    if not torch.cuda.is_available():
        assert "no CUDA device" in result.stdout
        assert not any(p.endswith("triton") for p in providers), "CPU numbers labelled as Triton"


def test_build_kfac_is_a_demo_train_step():
    build_kfac = perf_module("_optimizers").build_kfac
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    step = build_kfac(model, steps_per_epoch=45)
    losses = [step(x, y, torch.nn.functional.cross_entropy) for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    dims = [(65, 32), (33, 10)]
    kfac_bytes = 4 * sum(2 * (a * a + g * g) + a * a + g * g + a * g for a, g in dims)
    momentum_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert step.state_bytes() == kfac_bytes + momentum_bytes
