"""The SSD-SGD benchmark and experiment scripts: smoke runs, --help, and the claim verdicts' exit status."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # plumbing only: the interpreter would make it crawl
    return subprocess.run([sys.executable, str(REPO_ROOT / "perf" / script), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def load_experiment():
    spec = importlib.util.spec_from_file_location("ssd_sgd_experiment", REPO_ROOT / "perf" / "ssd_sgd_experiment.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_smoke_writes_results(tmp_path):
    result = run_script("bench_ssd_sgd.py", "--smoke", "--out", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = read_rows(tmp_path / "ssd_sgd.csv")
    assert {(r["op"], r["provider"]) for r in rows} >= {("ssd_sgd_step", "torch"), ("ssd_sgd_step", "floor"),
                                                        ("ssd_sgd_step_pulled", "floor")}
    assert all(float(r["ms_p50"]) > 0 for r in rows)
    floor = next(r for r in rows if r["op"] == "ssd_sgd_step" and r["provider"] == "floor")
    assert int(floor["floor_bytes"]) == 32 * int(floor["n"])
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert "triton" not in {r["provider"] for r in rows}, "CPU numbers labelled as Triton"


def test_benchmark_composite_is_the_same_step_as_the_op():
    spec = importlib.util.spec_from_file_location("bench_ssd_sgd", REPO_ROOT / "perf" / "bench_ssd_sgd.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO_ROOT / "perf"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO_ROOT / "perf"))
    import tritonopt

    b = module.buffers(5000, torch.device("cpu"))
    ours = {k: v.clone() for k, v in b.items()}
    with tritonopt.use_backend("reference"):
        tritonopt.ops.ssd_sgd_step(ours["param"], ours["grad"], ours["pre"], shadow_weight=ours["sw"],
                                   shadow_momentum=ours["smom"], **module.HYPER)
    lists = {k: module.split(v, 7) for k, v in b.items()}
    module.ssd_sgd_step_composite(lists["param"], lists["grad"], lists["pre"], lists["sw"], lists["smom"],
                                  **module.HYPER)
    for name in ("param", "sw", "smom"):
        assert torch.allclose(ours[name], b[name], rtol=1e-5, atol=1e-6), name


def test_experiment_help_runs_without_spawning():
    result = run_script("ssd_sgd_experiment.py", "--help", timeout=120)
    assert result.returncode == 0 and "--smoke" in result.stdout and "--bandwidth-mbps" in result.stdout


def test_a_failed_claim_makes_the_experiment_exit_nonzero():
    module = load_experiment()
    setup = module.Setup(seeds=(0,))
    rows = []
    for name, seconds, mb, acc in [(module.SSGD, 10.0, 100.0, 70.0), ("SSD-SGD k=5", 5.0, 40.0, 70.5),
                                   ("SSD-SGD k=5, SGD local updater", 5.0, 40.0, 69.0),
                                   (module.POST_LOCAL, 4.0, 25.0, 69.5)]:
        rows.append(dict(run=name, seed=0, seconds=seconds, mb_sent=mb, collectives=1, link_seconds=0.0,
                         global_acc=acc, local_acc=acc, final_loss=0.1, losses=[0.1]))
    lines, ok = module.summarize(rows, setup, smoke=False, seconds=1.0)
    assert ok and sum("**holds**" in line for line in lines) == 4
    rows[2]["global_acc"] = 71.0  # the plain local updater now beats GLU
    lines, ok = module.summarize(rows, setup, smoke=False, seconds=1.0)
    assert not ok and any("GLU beats" in line and "does not hold" in line for line in lines)
    rows[2]["global_acc"] = 69.0
    rows[1]["seconds"] = 8.0  # only 1.25x faster
    assert not module.summarize(rows, setup, smoke=False, seconds=1.0)[1]


def test_the_link_model_charges_a_ring_all_reduce():
    link = load_experiment().LinkTime(bandwidth_mbps=20.0, latency_ms=1.0, world=4)
    assert link(0) == pytest.approx(1e-3)
    assert link(2_000_000) == pytest.approx(1e-3 + 1.5 * 2_000_000 / 20e6)
    assert load_experiment().LinkTime(0.0, 1.0, 4)(10**6) == 0.0


@pytest.mark.slow
def test_experiment_smoke_writes_table_plot_and_runs(tmp_path):
    result = run_script("ssd_sgd_experiment.py", "--smoke", "--out", str(tmp_path), timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    rows = read_rows(tmp_path / "ssd_sgd_runs.csv")
    assert {r["run"] for r in rows} == {"SSGD", "SSD-SGD k=2", "SSD-SGD k=3", "SSD-SGD k=5", "SSD-SGD k=8",
                                        "SSD-SGD k=5, SGD local updater", "post-local SGD k=5"}
    summary = (tmp_path / "ssd_sgd_summary.md").read_text()
    assert "Claim checks" in summary and "moves at least 2x fewer bytes" in summary
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "ssd_sgd.png").exists()
