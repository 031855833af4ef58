"""Every perf script answers ``--help`` and runs ``--smoke`` end to end; the shared harness behaves."""

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
from unittest import mock

import pytest
import torch

from _perf import PERF_DIR, REPO_ROOT, SCRIPTS, output_of, perf_module, read_csv, run_script, smoke_run

# What each script's smoke run must write (beside its table on stdout).
SMOKE_OUTPUTS = {
    "autotune": ["autotune_resnet18.csv", "autotune_resnet18.json"],
    "bench_ef_topk": ["ef_topk.csv"],
    "bench_anchors": [],  # anchors.csv only where the authors' checkouts are (make anchors)
    "bench_dsp_recompute": ["dsp_recompute.csv"],
    "bench_kfac": ["kfac.csv"],
    "bench_lanczos": ["lanczos.csv"],
    "bench_lowrank": ["lowrank.csv"],
    "bench_optimizer_step": ["optimizer_step.csv"],
    "bench_sgd_momentum": ["sgd_momentum.csv"],
    "bench_sharded": ["sharded.csv", "sharded.md"],
    "bench_sparse_ring": ["sparse_ring.csv"],
    "bench_ssd_sgd": ["ssd_sgd.csv"],
    "comm_hooks_experiment": ["comm_hooks.csv", "comm_hooks.md"],
    "demo_digits": ["demo_digits.csv", "demo_digits_curves.csv", "demo_digits.md"],
    "dsp_experiment": ["dsp_runs.csv", "dsp_summary.csv", "dsp_summary.md"],
    "efcp_experiment": ["efcp.csv", "efcp_summary.md"],
    "fosi_experiment": ["fosi_e1.csv", "fosi_digits.csv", "fosi_dist.csv", "fosi_comm.csv", "fosi_summary.md"],
    "kaisa_tradeoff": ["kaisa_tradeoff.csv", "kaisa_tradeoff.md"],
    "kfac_experiment": ["kfac_autoencoder.csv", "kfac_classifier.csv", "kfac_autoencoder.md"],
    "sharded_quality": ["sharded_quality_runs.csv", "sharded_quality.md"],
    "ssd_sgd_experiment": ["ssd_sgd_runs.csv", "ssd_sgd_summary.md"],
}
# Smoke runs that spawn gloo ranks and take about a minute: with -m slow.
SLOW_SMOKE = {"ssd_sgd_experiment"}
OPTIMIZERS = ("SGD", "Adam", "Adagrad", "SparseAdaGrad", "MFAC", "SparseMFAC", "GGT", "SparseGGT",
              "LowRankMFAC", "KFAC+SGD", "FOSI-Adam")


def test_every_script_is_listed():
    assert sorted(SMOKE_OUTPUTS) == SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name):
    stdout = io.StringIO()
    # Importing a script may set environment defaults for its own run (autotune's Triton cache).
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as exit_info:
        perf_module(name).main(["--help"])
    assert exit_info.value.code == 0
    text = stdout.getvalue()
    assert text.startswith("usage:") and "--smoke" in text and "--out" in text, text


@pytest.mark.smoke
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SMOKE else name
                                  for name in SCRIPTS])
def test_smoke(name):
    result, out = smoke_run(name)
    assert result.returncode == 0, output_of(result)
    for filename in SMOKE_OUTPUTS[name]:
        assert (out / filename).stat().st_size > 0, (filename, output_of(result))
    for path in out.glob("*.csv"):
        rows = read_csv(path)
        assert rows, f"{path.name} has no data rows"
        assert {"device", "torch_version", "git_sha", "timestamp"} <= set(rows[0]), path.name


@pytest.mark.smoke
def test_a_script_runs_as_a_file_too(tmp_path):
    result = run_script("bench_ef_topk", "--smoke", "--out", str(tmp_path), as_file=True)
    assert result.returncode == 0, output_of(result)
    assert (tmp_path / "ef_topk.csv").exists()


@pytest.mark.smoke
def test_benchmark_providers_on_this_machine():
    result, out = smoke_run("bench_ef_topk")
    rows = read_csv(out / "ef_topk.csv")
    providers = {row["provider"] for row in rows}
    assert {"torch", "floor"} <= providers
    if torch.cuda.is_available():
        assert {"triton", "op/triton"} <= providers
    else:
        assert "no CUDA device" in output_of(result)
        assert providers == {"reference", "op/reference", "torch", "floor"}, "CPU numbers labelled as Triton"
    for row in rows:
        assert float(row["ms_p50"]) > 0
        # The columns follow from one another as documented.
        assert float(row["pct_of_floor"]) == pytest.approx(100 * float(row["floor_ms"]) / float(row["ms_p50"]),
                                                          rel=1e-6)
        assert int(row["floor_bytes"]) == perf_module("bench_ef_topk").floor_bytes(
            int(row["num_blocks"]), int(row["block_size"]), int(row["k"]), 4)


@pytest.mark.smoke
def test_autotune_smoke_runs_every_workload():
    result, out = smoke_run("autotune")
    assert result.returncode == 0, output_of(result)
    for model in ("resnet18", "bert-base"):
        rows = read_csv(out / f"autotune_{model}.csv")
        ops = {row["op"] for row in rows}
        assert {"ef_topk", "sparse_sp", "sparse_lcg", "sparse_ring_insert", "kfac_factor_update",
                "eigenbasis_precondition", "lowrank_ef", "gram_schmidt_project", "fosi_step"} <= ops
        assert all(float(row["ms_p50"]) > 0 for row in rows)
        record = json.loads((out / f"autotune_{model}.json").read_text())
        assert record["workloads"] and record["tuned"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "no CUDA device" in output_of(result)


@pytest.mark.smoke
def test_optimizer_step_bench_covers_every_optimizer():
    result, out = smoke_run("bench_optimizer_step")
    rows = {row["optimizer"]: row for row in read_csv(out / "optimizer_step.csv")}
    assert set(rows) == set(OPTIMIZERS), output_of(result)
    closest = {"SparseAdaGrad": "Adagrad", "KFAC+SGD": "SGD", "SGD": "SGD", "Adagrad": "Adagrad"}
    for name, row in rows.items():
        assert row["size"] == "shrunk" and row["closest"] == closest.get(name, "Adam")
        step, iteration = float(row["step_ms"]), float(row["iteration_ms"])
        assert 0 < step < iteration, row
        assert int(row["state_bytes"]) > 0
        base = rows[row["closest"]]
        assert float(row["step_vs_closest"]) == pytest.approx(step / float(base["step_ms"]), rel=1e-9)
        assert float(row["iteration_vs_adam"]) == pytest.approx(iteration / float(rows["Adam"]["iteration_ms"]),
                                                                rel=1e-9)
    # Whole periods of the periodic work are timed.
    assert int(rows["KFAC+SGD"]["iterations"]) % int(rows["KFAC+SGD"]["period"]) == 0
    assert int(rows["FOSI-Adam"]["iterations"]) % int(rows["FOSI-Adam"]["period"]) == 0


def test_resnet18_has_its_parameter_count():
    models = perf_module("_models")
    assert sum(p.numel() for p in models.resnet18().parameters()) == models.RESNET18_PARAMETERS == 11_689_512


# --------------------------------------------------------------------------- the harness


def test_smoke_runs_never_overwrite_real_results(tmp_path):
    harness = perf_module("_harness")
    real = harness.RESULTS_DIR / "efcp"
    assert harness.output_dir(None, real, smoke=False, name="efcp") == real
    smoke = harness.output_dir(None, real, smoke=True, name="efcp")
    assert smoke == harness.LOCAL_RESULTS_DIR / "smoke" / "efcp"
    assert harness.output_dir(tmp_path, real, smoke=True, name="efcp") == tmp_path
    assert perf_module("demo_digits").DEFAULT_OUT.is_relative_to(harness.LOCAL_RESULTS_DIR)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("path", ["perf/results/local/demo/demo_digits.png", "perf/results/local/smoke/x.csv",
                                  "perf/results/cpu/ef_topk.csv"])
def test_local_results_are_ignored(path):
    assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT).returncode == 0


def test_claims_decide_the_exit_status(capsys):
    harness = perf_module("_harness")
    quality = harness.Claim("trains as well", holds=False, detail="0.5 vs 0.1")
    size = harness.Claim("state 30x smaller", holds=True, smoke_scale=True)
    assert harness.report_claims([quality, size], smoke=False) == 1
    assert "FAIL: trains as well (0.5 vs 0.1)" in capsys.readouterr().out
    # A smoke run cannot decide a training result: reported, not checked.
    assert harness.report_claims([quality, size], smoke=True) == 0
    assert "not checked (smoke run): trains as well" in capsys.readouterr().out
    assert harness.report_claims([harness.Claim("state", holds=False, smoke_scale=True)], smoke=True) == 1


def test_nvtx_request_says_what_it_does(monkeypatch, capsys):
    harness = perf_module("_harness")
    assert harness.nvtx_enabled(False, torch.device("cpu")) is False
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None)
    assert harness.nvtx_enabled(True, torch.device("cuda")) is False
    assert "nvtx package is not installed" in capsys.readouterr().out
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: object())
    assert harness.nvtx_enabled(True, torch.device("cpu")) is True
    assert "no CUDA device" in capsys.readouterr().out


def test_case_providers_and_floor_rows():
    harness = perf_module("_harness")
    calls = []

    def builder(name):
        return lambda: (lambda: calls.append(name))

    case = harness.Case(op="op", shape={"n": 8}, floor_bytes=4_000, triton=builder("triton"),
                        reference=builder("reference"), public=builder("public"), torch=builder("torch"),
                        extra={"dense": builder("dense")})
    assert [name for name, _, _ in case.providers("reference")] == ["reference", "op/reference", "torch", "dense"]
    assert [backend for _, _, backend in case.providers("triton")] == [None, "triton", None, None]
    context = harness.BenchContext(torch.device("cpu"), "reference", smoke=True, reps=1, nvtx=False,
                                   yardsticks=harness.Yardsticks(torch.device("cpu"), 1))
    context.yardsticks.__dict__["bandwidth_gbps"] = 2.0  # as if measured: 2 GB/s
    rows = {row["provider"]: row for row in harness.measure_case(case, context)}
    assert set(calls) == {"reference", "public", "torch", "dense"}
    floor = rows["floor"]
    assert floor["floor_ms"] == pytest.approx(4_000 / 2e9 * 1e3) and floor["pct_of_floor"] == pytest.approx(100)
    assert floor["gbps"] == pytest.approx(2.0)
    assert math.isfinite(rows["reference"]["speedup_vs_torch"])


def test_entries_per_block_matches_the_optimizers_rule():
    harness = perf_module("_harness")
    assert harness.entries_per_block(0.01, 4096) == 41
    assert harness.entries_per_block(0.07, 100) == 7  # not 8 from 7.000000000000001
    assert harness.entries_per_block(1e-9, 16) == 1


def test_scripts_do_not_edit_sys_path():
    for path in PERF_DIR.glob("*.py"):
        if path.name == "_as_module.py":  # the file entry point's one job
            continue
        assert "sys.path" not in path.read_text(), path.name


@pytest.mark.parametrize("primary", [None, "reference", "triton"], ids=["this-machine", "reference", "triton"])
def test_a_shape_out_of_gpu_memory_is_skipped(tmp_path, capsys, primary):
    harness = perf_module("_harness")
    bench_cases = perf_module("_bench_cases")

    def too_large():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    def small():
        x = torch.ones(1024)
        return harness.Case(op="scale", shape={"n": 1024}, floor_bytes=8 * 1024,
                            reference=lambda: (lambda: x * 2), torch=lambda: (lambda: x.mul(2)))

    # None: the primary this machine's device gives (triton on a GPU, reference on the CPU); else that one.
    chosen = primary or harness.primary_backend(harness.default_device())
    with mock.patch.object(bench_cases, "primary_backend", lambda device: chosen):
        status = harness.run_benchmark(
            name="scale", parser=harness.bench_parser("scale", smoke_help="small"),
            argv=["--smoke", "--out", str(tmp_path)], cases=lambda args, context: [too_large, small],
            shape_columns=("n",), plots=[])
    assert status == 0
    assert "skipped too_large(): out of GPU memory" in capsys.readouterr().out
    # The primary's own provider is timed only where the case declares it: this case has a reference and
    # no triton launcher, so under a triton primary (a GPU) only torch and the floor remain.
    expected = {"torch", "floor"} | ({"reference"} if chosen == "reference" else set())
    assert {row["provider"] for row in read_csv(tmp_path / "scale.csv")} == expected
