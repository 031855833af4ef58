"""The DSP experiment runs end to end in smoke mode, writes its tables and plot, and judges its claims."""

import importlib.util

import pytest

from _perf import output_of, perf_module, read_csv, run_script, smoke_run

MODES = {"BP (1 process)", "BP-K", "GPipe", "DSP m=1", "DSP m=2", "DSP m=4"}


@pytest.mark.smoke
def test_smoke_run_writes_every_result():
    result, out = smoke_run("dsp_experiment")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(out / "dsp_summary.csv")
    assert {row["mode"] for row in rows if row["part"] == "A"} == MODES
    assert all(float(row["median_seconds"]) > 0 for row in rows)
    assert {row["mode"] for row in rows if row["part"] == "B"} == {"BP-K", "DSP m=1", "DSP m=2", "DSP m=4"}
    runs = read_csv(out / "dsp_runs.csv")
    # DSP stages report their compute time; both ranks worked in every DSP run
    assert all(float(r["compute_seconds_rank0"]) > 0 and float(r["compute_seconds_rank1"]) > 0
               for r in runs if r["mode"].startswith("DSP"))
    # BP-K is back-propagation split over two ranks: the same weights, which a smoke run checks
    assert "PASS: BP-K ends with BP's weights, bit for bit" in output
    accuracy = {row["mode"]: row["test_accuracy"] for row in rows if row["part"] == "A"}
    assert accuracy["BP-K"] == accuracy["BP (1 process)"]
    text = (out / "dsp_summary.md").read_text()
    assert "not checked (smoke run): DSP m=1 has >= 1.3x the throughput of BP-K" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "dsp.png").exists()


def test_the_claims_follow_the_measurements():
    experiment = perf_module("dsp_experiment")
    setup = experiment.Setup()
    modes = setup.modes
    summary = {
        "throughput": {name: {"seconds": 10.0} for name in modes},
        "accuracy": {name: {"test_accuracy": 0.9} for name in modes},
        "stragglers": {(name, level): {"added_seconds": 1.0}
                       for name in ["BP-K"] + [f"DSP m={m}" for m in setup.straggler_staleness]
                       for level in setup.straggler_levels},
    }
    summary["throughput"]["DSP m=1"]["seconds"] = 10.0 / 1.35  # 1.35x: holds
    summary["throughput"]["DSP m=2"]["seconds"] = 10.0 / 1.25  # 1.25x: fails
    summary["accuracy"]["DSP m=1"]["test_accuracy"] = 0.8  # 10 points below BP: fails
    summary["stragglers"][("DSP m=4", 0.5)]["added_seconds"] = 0.5  # less than BP-K's 1.0: holds
    states = {"BP (1 process)": {"0.weight": experiment.torch.ones(2), "4.weight": experiment.torch.ones(3)},
              "BP-K": {"0.weight": experiment.torch.ones(2)}}
    per_rank = [{"states": states}, {"states": {"BP-K": {"4.weight": experiment.torch.ones(3)}}}]
    verdicts = {claim.text: claim.holds for claim in experiment.claims(setup, summary, per_rank)}
    assert verdicts["BP-K ends with BP's weights, bit for bit"]
    assert verdicts["DSP m=1 has >= 1.3x the throughput of BP-K"]
    assert not verdicts["DSP m=2 has >= 1.3x the throughput of BP-K"]
    assert not any(holds for text, holds in verdicts.items() if text.startswith("DSP m=1 test accuracy"))
    assert verdicts["+50% stragglers add fewer seconds to DSP (best queue, m=4) than to BP-K"]
    assert not verdicts["+100% stragglers add fewer seconds to DSP (best queue, m=1) than to BP-K"]
    per_rank[1]["states"]["BP-K"]["4.weight"] = experiment.torch.full((3,), 1.0 + 2**-20)
    assert not experiment.claims(setup, summary, per_rank)[0].holds


@pytest.mark.smoke
def test_help_and_bad_arguments():
    result = run_script("dsp_experiment", "--help", timeout=60)
    assert result.returncode == 0 and "--smoke" in result.stdout
    result = run_script("dsp_experiment", "--split", "6", "--out", "/nonexistent", timeout=60)
    assert result.returncode == 2 and "--split" in result.stderr
