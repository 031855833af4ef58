"""The EFCP experiment and the sparse-ring / low-rank benchmarks run end to end (smoke mode)."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tritonopt

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # plumbing only: the interpreter would make it crawl
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "perf" / script), "--smoke", "--out", str(out_dir), *extra],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180,
    )


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_experiment_smoke_writes_table_plot_and_summary(tmp_path):
    result = run_script("efcp_experiment.py", tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = read_rows(tmp_path / "efcp.csv")
    names = {row["optimizer"] for row in rows}
    assert {"D-MFAC", "S-MFAC 1% EF", "S-MFAC 1% no EF", "LR-MFAC r4"} <= names
    by_name = {row["optimizer"]: row for row in rows}
    # The state-size part of the claim holds whatever the training length.
    assert int(by_name["D-MFAC"]["state_bytes"]) >= 30 * int(by_name["S-MFAC 1% EF"]["state_bytes"])
    assert all(float(row["final_train_loss"]) > 0 for row in rows)
    summary = (tmp_path / "efcp_summary.md").read_text()
    assert "S-MFAC 1% EF" in summary and "Claim checks" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "efcp.png").exists()


def test_demo_entries_follow_the_train_step_protocol():
    spec = importlib.util.spec_from_file_location("efcp_experiment", REPO_ROOT / "perf" / "efcp_experiment.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO_ROOT / "perf"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO_ROOT / "perf"))
    torch.manual_seed(0)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    for build in (module.build_mfac, module.build_sparse_mfac, module.build_lowrank_mfac):
        model = module.make_mlp(0)
        step = build(model, 45)
        before = [p.detach().clone() for p in model.parameters()]
        with tritonopt.use_backend("reference"):  # d = 85,002: too large for the interpreter
            loss = step(x, y, torch.nn.functional.cross_entropy)
        assert isinstance(loss, float) and loss > 0
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert step.state_bytes() > 0


@pytest.mark.parametrize("script, stem", [("bench_sparse_ring.py", "sparse_ring"), ("bench_lowrank.py", "lowrank")])
def test_benchmark_smoke_writes_results(tmp_path, script, stem):
    result = run_script(script, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = read_rows(tmp_path / f"{stem}.csv")
    assert rows and all(float(row["ms_p50"]) > 0 for row in rows)
    assert {"torch", "floor"} <= {row["provider"] for row in rows}
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert "triton" not in {row["provider"] for row in rows}
