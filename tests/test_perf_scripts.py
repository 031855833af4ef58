"""The benchmark scripts run end to end (smoke mode) and record their results."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_smoke(script: str, out_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The interpreter would make any Triton path crawl; the smoke run checks plumbing only.
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "perf" / script), "--smoke", "--out", str(out_dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_ef_topk_smoke_writes_results(tmp_path):
    result = run_smoke("bench_ef_topk.py", tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output

    csv_path = tmp_path / "ef_topk.csv"
    assert csv_path.exists(), output
    with csv_path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows, "the CSV has no data rows"
    assert all(float(row["ms_p50"]) > 0 for row in rows)
    assert {"torch", "floor"} <= {row["provider"] for row in rows}

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "ef_topk.png").exists()
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert "triton" not in {row["provider"] for row in rows}, "CPU numbers labelled as Triton"


def test_autotune_smoke_runs_every_workload(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "perf" / "autotune.py"), "--smoke", "--model", "resnet18", "bert-base",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    import json

    for model in ("resnet18", "bert-base"):
        with (tmp_path / f"autotune_{model}.csv").open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        ops = {row["op"] for row in rows}
        assert {"ef_topk", "sparse_sp", "sparse_lcg", "sparse_ring_insert", "kfac_factor_update",
                "eigenbasis_precondition", "lowrank_ef", "gram_schmidt_project", "fosi_step"} <= ops
        assert all(float(row["ms_p50"]) > 0 for row in rows)
        record = json.loads((tmp_path / f"autotune_{model}.json").read_text())
        assert record["workloads"] and record["tuned"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
