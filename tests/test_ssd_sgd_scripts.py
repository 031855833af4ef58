"""The SSD-SGD benchmark and experiment: what their smoke runs write, the composite's math, the link
model, and the claim verdicts' exit status (``--help`` and plain smoke runs: ``test_perf_scripts.py``)."""

import importlib.util

import pytest
import torch
from _perf import output_of, perf_module, read_csv, smoke_run

import tritonopt


@pytest.mark.smoke
def test_benchmark_smoke_times_both_steps_against_their_floors():
    result, out = smoke_run("bench_ssd_sgd")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "ssd_sgd.csv")
    pairs = {(r["op"], r["provider"]) for r in rows}
    assert {("ssd_sgd_step", "torch"), ("ssd_sgd_step", "floor"), ("ssd_sgd_step_pulled", "floor")} <= pairs
    assert ("ssd_sgd_step_pulled", "torch") not in pairs
    assert all(float(r["ms_p50"]) > 0 for r in rows)
    for op, per_element in (("ssd_sgd_step", 32), ("ssd_sgd_step_pulled", 36)):
        floor = next(r for r in rows if r["op"] == op and r["provider"] == "floor")
        assert int(floor["floor_bytes"]) == per_element * int(floor["n"])
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert {r["provider"] for r in rows} == {"reference", "op/reference", "torch", "floor"}, \
            "CPU numbers labelled as Triton"


@pytest.mark.parametrize("pulled", [False, True])
def test_benchmark_providers_compute_the_same_step(pulled):
    bench = perf_module("bench_ssd_sgd")
    b = bench.buffers(5000, torch.device("cpu"))
    ours = {k: v.clone() for k, v in b.items()}
    with tritonopt.use_backend("reference"):
        bench._public(ours, pulled=pulled)
    launched = {k: v.clone() for k, v in b.items()}
    bench._launcher(bench.ssd_sgd_step_reference, pulled=pulled)(launched)
    for name in ("param", "pre", "sw", "smom", "sync_mom"):
        assert torch.equal(ours[name], launched[name]), name
    if not pulled:  # the composite is the common step's baseline
        bench._composite(b, 7)()
        for name in ("param", "sw", "smom"):
            assert torch.allclose(ours[name], b[name], rtol=1e-5, atol=1e-6), name


def summary_rows(experiment, accuracy_of_plain: float = 69.0, seconds_of_ssd: float = 5.0) -> list[dict]:
    rows = []
    for name, seconds, mb, acc in [(experiment.SSGD, 10.0, 100.0, 70.0), ("SSD-SGD k=5", seconds_of_ssd, 40.0, 70.5),
                                   ("SSD-SGD k=5, SGD local updater", 5.0, 40.0, accuracy_of_plain),
                                   (experiment.POST_LOCAL, 4.0, 25.0, 69.5)]:
        rows.append(dict(run=name, seed=0, seconds=seconds, mb_sent=mb, collectives=1, link_seconds=0.0,
                         global_acc=acc, local_acc=acc, final_loss=0.1, losses=[0.1]))
    return rows


def test_a_failed_claim_makes_the_experiment_exit_nonzero(capsys):
    experiment = perf_module("ssd_sgd_experiment")
    harness = perf_module("_harness")
    setup = experiment.Setup(seeds=(0,))
    lines, claims = experiment.summarize(summary_rows(experiment), setup, smoke=False, seconds=1.0)
    assert len(claims) == 4 and all(c.holds for c in claims)
    assert sum(": PASS" in line or ". PASS:" in line for line in lines) == 4
    assert harness.report_claims(claims, smoke=False) == 0
    # The plain local updater now beats GLU.
    lines, claims = experiment.summarize(summary_rows(experiment, accuracy_of_plain=71.0), setup, smoke=False,
                                         seconds=1.0)
    assert any(". FAIL: GLU beats" in line for line in lines)
    assert harness.report_claims(claims, smoke=False) == 1
    assert "FAIL: GLU beats the plain-SGD local updater" in capsys.readouterr().out
    # Only 1.25x faster: the speed claim fails, though a smoke run does not judge it.
    _, claims = experiment.summarize(summary_rows(experiment, seconds_of_ssd=8.0), setup, smoke=False, seconds=1.0)
    assert harness.report_claims(claims, smoke=False) == 1
    assert harness.report_claims(claims, smoke=True) == 0


def test_the_link_model_charges_a_ring_all_reduce():
    experiment = perf_module("ssd_sgd_experiment")
    link = experiment.LinkTime(bandwidth_mbps=20.0, latency_ms=1.0, world=4)
    assert link(0) == pytest.approx(1e-3)
    assert link(2_000_000) == pytest.approx(1e-3 + 1.5 * 2_000_000 / 20e6)
    assert experiment.LinkTime(0.0, 1.0, 4)(10**6) == 0.0


@pytest.mark.slow
def test_experiment_smoke_writes_table_plot_and_runs():
    result, out = smoke_run("ssd_sgd_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "ssd_sgd_runs.csv")
    assert {r["run"] for r in rows} == {"SSGD", "SSD-SGD k=2", "SSD-SGD k=3", "SSD-SGD k=5", "SSD-SGD k=8",
                                        "SSD-SGD k=5, SGD local updater", "post-local SGD k=5"}
    assert "PASS: SSD-SGD k = 5 moves at least 2x fewer bytes than SSGD" in output
    assert "not checked (smoke run): GLU beats the plain-SGD local updater" in output
    summary = (out / "ssd_sgd_summary.md").read_text()
    assert "Claim checks" in summary and "moves at least 2x fewer bytes" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "ssd_sgd.png").exists()
