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
    assert set(by_name) == set(perf_module("efcp_experiment").RUNS)
    # The state-size part of the claim holds whatever the training length, and a smoke run checks it.
    assert int(by_name["D-MFAC"]["state_bytes"]) >= 30 * int(by_name["S-MFAC 1% EF"]["state_bytes"])
    assert "PASS: S-MFAC state >= 30x smaller than D-MFAC" in output
    assert "not checked (smoke run): S-MFAC 1% EF accuracy within 1 pt of D-MFAC" in output
    assert all(float(row["final_train_loss"]) > 0 for row in rows)
    summary = (out / "efcp_summary.md").read_text()
    assert "S-MFAC 1% EF" in summary and "Claim checks" in summary
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
