"""The EFCP experiment and the sparse-ring / low-rank benchmarks run end to end (smoke mode);
a failed claim fails the experiment."""

import importlib.util

import pytest
import torch

import tritonopt
from _perf import output_of, perf_module, read_csv, smoke_run

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
CLAIM_RUNS = ["D-MFAC", "S-MFAC 1% EF", "S-MFAC 1% no EF"]


@needs_sklearn
@pytest.mark.smoke
def test_experiment_smoke_writes_table_plot_and_summary():
    result, out = smoke_run("efcp_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "efcp.csv")
    by_name = {row["optimizer"]: row for row in rows}
    experiment = perf_module("efcp_experiment")
    assert set(by_name) == set(experiment.RUNS)
    # The whole sweep is in the results: every optimizer at every lr of its grid.
    for name, grid in experiment.LR_GRIDS.items():
        assert sorted(float(row["lr"]) for row in rows if row["optimizer"] == name) == sorted(grid), name
    # The state-size part of the claim holds whatever the training length, and a smoke run checks it.
    assert int(by_name["D-MFAC"]["state_bytes"]) >= 30 * int(by_name["S-MFAC 1% EF"]["state_bytes"])
    assert "PASS: S-MFAC state >= 30x smaller than D-MFAC" in output
    assert "not checked (smoke run): S-MFAC 1% EF accuracy within 1 pt of D-MFAC" in output
    assert all(float(row["final_train_loss"]) > 0 for row in rows)
    summary = (out / "efcp_summary.md").read_text()
    assert "S-MFAC 1% EF" in summary and "Claim checks" in summary
    assert "The sweep (every configuration run" in summary and "best lr" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "efcp.png").exists()


@needs_sklearn
def test_a_failed_claim_fails_the_experiment(tmp_path, monkeypatch, capsys):
    experiment = perf_module("efcp_experiment")
    argv = ["--smoke", "--out", str(tmp_path), "--runs", *CLAIM_RUNS]
    threads = torch.get_num_threads()  # main() runs on one thread
    try:
        with tritonopt.use_backend("reference"):  # d = 85,002: too large for the interpreter
            monkeypatch.setattr(experiment, "STATE_RATIO", 1000)  # no sparse state is 1000x smaller
            assert experiment.main(argv) == 1
            assert "FAIL: S-MFAC state >= 1000x smaller than D-MFAC" in capsys.readouterr().out
            monkeypatch.setattr(experiment, "STATE_RATIO", 30)
            assert experiment.main(argv) == 0
    finally:
        torch.set_num_threads(threads)


def sweep_rows(losses_by_lr: dict, accuracy: float = 95.0, name: str = "D-MFAC") -> list[dict]:
    """Rows as the sweep writes them: ``{lr: [final train loss of seed 0, seed 1, ...]}``."""
    return [{"optimizer": name, "lr": lr, "seed": seed, "final_train_loss": loss, "test_accuracy": accuracy,
             "state_bytes": 1000, "ms_per_step": 1.0, "epoch_losses": [loss]}
            for lr, losses in losses_by_lr.items() for seed, loss in enumerate(losses)]


def test_best_lr_is_the_lowest_mean_final_train_loss():
    experiment = perf_module("efcp_experiment")
    # 0.03 has the single best seed, 0.01 the best mean; 0.1 diverged on one seed.
    rows = sweep_rows({0.003: [0.5, 0.5, 0.5], 0.01: [0.02, 0.02, 0.02], 0.03: [0.001, 0.1, 0.1],
                       0.1: [1e-5, float("nan"), 1e-5]})
    assert experiment.best_lr(rows, "D-MFAC") == 0.01
    summary = experiment.summarise(rows)["D-MFAC"]
    assert summary["lr"] == 0.01 and not summary["on_edge"]
    assert summary["loss"] == pytest.approx((0.02, 0.0))
    assert [lr for lr, _, _ in summary["sweep"]] == [0.003, 0.01, 0.03, 0.1]
    # A best lr at either end of the grid is flagged.
    assert experiment.summarise(sweep_rows({0.003: [0.1, 0.1], 0.01: [0.2, 0.2]}))["D-MFAC"]["on_edge"]
    with pytest.raises(ValueError, match="no runs of 'SGD'"):
        experiment.best_lr(rows, "SGD")


def claim_verdicts(dense_acc, sparse_acc, plain_losses, sparse_losses=(0.010, 0.011, 0.012)):
    """The claims' verdicts for three seeds of D-MFAC, S-MFAC 1 % EF and S-MFAC 1 % no EF at one lr each."""
    experiment = perf_module("efcp_experiment")
    rows = (sweep_rows({0.01: [0.010, 0.011, 0.012]}, 0.0, "D-MFAC")
            + sweep_rows({0.01: list(sparse_losses)}, 0.0, "S-MFAC 1% EF")
            + sweep_rows({0.03: list(plain_losses)}, 0.0, "S-MFAC 1% no EF"))
    accuracies = {"D-MFAC": dense_acc, "S-MFAC 1% EF": sparse_acc, "S-MFAC 1% no EF": (90.0, 90.0, 90.0)}
    for row in rows:
        row["test_accuracy"] = accuracies[row["optimizer"]][row["seed"]]
    return {claim.text: claim for claim in experiment.claims(experiment.summarise(rows), rows)}


def test_accuracy_parity_is_two_sided_and_reports_standard_errors():
    dense = (96.0, 96.5, 97.0)
    holds = claim_verdicts(dense, (96.2, 96.0, 96.4), (0.05, 0.06, 0.07))
    parity = "S-MFAC 1% EF accuracy within 1 pt of D-MFAC (above or below)"
    assert holds[parity].holds
    assert "± 0.29" in holds[parity].detail  # D-MFAC's SE: std 0.5 / sqrt(3)
    assert not claim_verdicts(dense, (98.5, 98.0, 98.2), (0.05, 0.06, 0.07))[parity].holds  # far above
    assert not claim_verdicts(dense, (94.5, 95.0, 94.8), (0.05, 0.06, 0.07))[parity].holds  # far below


def test_no_error_feedback_must_end_higher_by_more_than_two_standard_errors():
    clearly = "no EF ends with a higher loss than EF, by more than 2 SE"
    dense = (96.0, 96.5, 97.0)
    assert claim_verdicts(dense, dense, (0.05, 0.06, 0.07))[clearly].holds
    # Higher on the mean, but within the seeds' noise: not clearly higher.
    assert not claim_verdicts(dense, dense, (0.002, 0.012, 0.025))[clearly].holds


def test_defaults_are_three_seeds_and_distinct_seeds():
    experiment = perf_module("efcp_experiment")
    assert experiment.parse_args([]).seeds == [0, 1, 2]
    with pytest.raises(SystemExit):
        experiment.parse_args(["--seeds", "1", "1", "2"])


def test_builders_take_the_swept_lr_and_keep_their_defaults():
    optimizers = perf_module("_optimizers")
    digits = perf_module("_digits")
    defaults = {optimizers.build_sgd: 0.05, optimizers.build_mfac: 0.01, optimizers.build_sparse_mfac: 0.01,
                optimizers.build_sparse_mfac_no_ef: 0.01, optimizers.build_sparse_mfac_01: 0.01,
                optimizers.build_lowrank_mfac: 0.01}
    for build, default in defaults.items():
        assert build(digits.make_mlp(0), 45).optimizer.param_groups[0]["lr"] == default
        assert build(digits.make_mlp(0), 45, lr=0.003).optimizer.param_groups[0]["lr"] == 0.003


def test_demo_entries_follow_the_train_step_protocol():
    optimizers = perf_module("_optimizers")
    digits = perf_module("_digits")
    torch.manual_seed(0)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    for build in (optimizers.build_mfac, optimizers.build_sparse_mfac, optimizers.build_lowrank_mfac):
        model = digits.make_mlp(0)
        step = build(model, 45)
        before = [p.detach().clone() for p in model.parameters()]
        with tritonopt.use_backend("reference"):
            loss = step(x, y, torch.nn.functional.cross_entropy)
        assert isinstance(loss, float) and loss > 0
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert step.state_bytes() > 0


@pytest.mark.smoke
@pytest.mark.parametrize("script, stem", [("bench_sparse_ring", "sparse_ring"), ("bench_lowrank", "lowrank")])
def test_benchmark_smoke_writes_results(script, stem):
    result, out = smoke_run(script)
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / f"{stem}.csv")
    assert rows and all(float(row["ms_p50"]) > 0 for row in rows)
    assert {"torch", "floor"} <= {row["provider"] for row in rows}
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert not any(row["provider"].endswith("triton") for row in rows), "CPU numbers labelled as Triton"


@pytest.mark.smoke
def test_sparse_ring_floors_follow_their_formulas():
    bench = perf_module("bench_sparse_ring")
    result, out = smoke_run("bench_sparse_ring")
    rows = read_csv(out / "sparse_ring.csv")
    assert {row["op"] for row in rows} == {"sparse_sp", "sparse_lcg", "sparse_ring_insert"}
    for row in rows:
        m, d = int(row["m"]), int(row["d"])
        k_total = int(row["num_blocks"]) * int(row["k_per_block"])
        assert int(row["floor_bytes"]) == bench.floor_bytes(row["op"], m, k_total, d)
    absolute = bench.absolute_indices(torch.tensor([[[0, 3]], [[1, 2]]], dtype=torch.int32), 4)
    assert absolute.tolist() == [[[0, 3]], [[5, 6]]]
