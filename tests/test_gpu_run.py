"""perf/gpu_run.sh, the one command for a GPU machine: it parses, names its phases, and runs every benchmark."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from _perf import PERF_DIR, REPO_ROOT

SCRIPT = PERF_DIR / "gpu_run.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*phases: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "LOG_DIR": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), *phases], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.smoke
def test_every_documented_phase_is_handled_and_an_unknown_one_is_refused(tmp_path):
    text = SCRIPT.read_text()
    documented = re.findall(r"^#   (\w+)\s+\d+\s", text, re.M)
    assert documented == ["env", "gpu", "suite", "bench", "autotune", "e2e", "anchors"]
    for phase in documented:
        assert re.search(rf"^\s+{phase}\)", text, re.M), phase
    result = run("no_such_phase", tmp_path=tmp_path)
    assert result.returncode == 2 and "unknown phase no_such_phase" in result.stdout


@pytest.mark.smoke
def test_the_bench_phase_runs_every_kernel_benchmark(tmp_path):
    # PYTHON=echo-like stand-in: a python that only records the modules it was asked to run.
    recorder = tmp_path / "python"
    recorder.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -m ]; then echo "$2" >> {tmp_path}/ran; exit 0; fi\n'
                        f'exec {sys.executable} "$@"\n')
    recorder.chmod(0o755)
    env = {**os.environ, "PYTHON": str(recorder), "LOG_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), "bench"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    ran = (tmp_path / "ran").read_text().split()
    expected = sorted(f"perf.{p.stem}" for p in PERF_DIR.glob("bench_*.py")
                      if p.stem not in ("bench_optimizer_step", "bench_anchors"))
    assert sorted(ran) == expected and "perf.bench_ssd_sgd" in ran
    summary = (tmp_path / "summary.tsv").read_text().splitlines()
    assert summary[0] == "phase\texit\tseconds" and len(summary) == 1 + len(expected)


def _recording_python(tmp_path, seconds: int = 0):
    """A stand-in python that records the modules it is asked to run, each taking ``seconds``."""
    recorder = tmp_path / "python"
    recorder.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -m ]; then echo "$2" >> {tmp_path}/ran; sleep {seconds}; exit 0; fi\n'
                        f'exec {sys.executable} "$@"\n')
    recorder.chmod(0o755)
    return recorder


@pytest.mark.smoke
def test_a_phase_may_name_one_benchmark_and_an_unknown_one_is_refused(tmp_path):
    env = {**os.environ, "PYTHON": str(_recording_python(tmp_path)), "LOG_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), "bench_ssd_sgd", "bench_kfac"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "ran").read_text().split() == ["perf.bench_ssd_sgd", "perf.bench_kfac"]
    refused = subprocess.run(["bash", str(SCRIPT), "bench_no_such_op"], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "unknown phase bench_no_such_op" in refused.stdout


@pytest.mark.smoke
def test_phases_past_the_deadline_are_skipped_and_recorded(tmp_path):
    # Each stand-in benchmark would take 60 s; the deadline (counted from the script's start, which spends a
    # few seconds naming the device) stops the first at the time left and skips the rest, so a machine lent
    # for a fixed time is never taken back in the middle of writing the results.
    env = {**os.environ, "PYTHON": str(_recording_python(tmp_path, seconds=60)), "LOG_DIR": str(tmp_path),
           "DEADLINE": "15"}
    result = subprocess.run(["bash", str(SCRIPT), "bench_ssd_sgd", "bench_kfac", "e2e"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split("\t") for line in (tmp_path / "summary.tsv").read_text().splitlines()[1:]]
    assert [row[0] for row in rows] == ["bench_ssd_sgd", "bench_kfac", "e2e"]
    assert rows[0][1] == "124" and int(rows[0][2]) <= 15
    assert rows[1][1] == rows[2][1] == "skipped" and "skipped, the DEADLINE of 15 s has passed" in result.stdout
    assert (tmp_path / "ran").read_text().split()[0] == "perf.bench_ssd_sgd"


@pytest.mark.smoke
def test_the_anchors_phase_runs_each_size_to_its_own_folder(tmp_path):
    # One run per size, so a size cut off by the deadline (ResNet-18 takes minutes) loses only its own table.
    recorder = tmp_path / "python"
    recorder.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -m ]; then echo "$*" >> {tmp_path}/ran; exit 0; fi\n'
                        f'exec {sys.executable} "$@"\n')
    recorder.chmod(0o755)
    env = {**os.environ, "PYTHON": str(recorder), "LOG_DIR": str(tmp_path), "ANCHOR_SIZES": "demo cnn"}
    result = subprocess.run(["bash", str(SCRIPT), "anchors"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = (tmp_path / "ran").read_text().splitlines()
    assert len(runs) == 2
    for size, line in zip(["demo", "cnn"], runs):
        assert line.startswith("-m perf.bench_anchors --sizes " + size + " ")
        assert re.search(rf"--out perf/results/[\w-]+/anchors/{size}$", line), line
    rows = (tmp_path / "summary.tsv").read_text().splitlines()[1:]
    assert [row.split("\t")[0] for row in rows] == ["anchors_demo", "anchors_cnn"]
