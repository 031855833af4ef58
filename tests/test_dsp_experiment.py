"""perf/dsp_experiment.py runs end to end in smoke mode and writes its tables and plot."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "perf" / "dsp_experiment.py"


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("TRITON_INTERPRET", None)  # plumbing only: the reference path
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_smoke_run_writes_every_result(tmp_path):
    result = run("--smoke", "--out", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    with (tmp_path / "dsp_summary.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    modes = {row["mode"] for row in rows if row["part"] == "A"}
    assert modes == {"BP (1 process)", "BP-K", "GPipe", "DSP m=1", "DSP m=2", "DSP m=4"}
    assert all(float(row["median_seconds"]) > 0 for row in rows)
    assert {row["mode"] for row in rows if row["part"] == "B"} == {"BP-K", "DSP m=1", "DSP m=2", "DSP m=4"}
    with (tmp_path / "dsp_runs.csv").open(newline="") as handle:
        runs = list(csv.DictReader(handle))
    # DSP stages report their compute time; both ranks worked in every DSP run
    assert all(float(r["compute_seconds_rank0"]) > 0 and float(r["compute_seconds_rank1"]) > 0
               for r in runs if r["mode"].startswith("DSP"))
    text = (tmp_path / "dsp_summary.md").read_text()
    assert "claims not checked" in text
    # BP-K is back-propagation split over two ranks: the same weights, so the same accuracy
    accuracy = {row["mode"]: row["test_accuracy"] for row in rows if row["part"] == "A"}
    assert accuracy["BP-K"] == accuracy["BP (1 process)"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "dsp.png").exists()


def test_help_and_bad_arguments():
    result = run("--help", timeout=60)
    assert result.returncode == 0 and "--smoke" in result.stdout
    result = run("--split", "6", "--out", "/nonexistent", timeout=60)
    assert result.returncode == 2 and "--split" in result.stderr
