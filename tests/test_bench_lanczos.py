"""perf/bench_lanczos.py: its torch baselines compute the ops' math, and the smoke run records results."""

import importlib.util

import pytest
import torch

from _perf import output_of, perf_module, read_csv, smoke_run
from tritonopt.kernels.fosi_step import fosi_step_reference
from tritonopt.kernels.lanczos import gram_schmidt_project_reference


@pytest.fixture(scope="module")
def bench_module():
    return perf_module("bench_lanczos")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("passes", [1, 2])
def test_gram_schmidt_composite_matches_reference(bench_module, dtype, passes):
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(300, 12, generator=gen, dtype=torch.float64))
    basis = q.T.contiguous().to(dtype)
    h = torch.randn(300, generator=gen, dtype=torch.float64).to(dtype)
    expected = gram_schmidt_project_reference(basis, h, 9, passes)
    got = bench_module.gram_schmidt_composite(basis, h, 9, passes)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)


def test_fosi_step_composite_matches_reference(bench_module):
    gen = torch.Generator().manual_seed(1)
    n, r = 500, 6
    q, _ = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=torch.float64))
    basis = q.T.contiguous().float()
    scale = 0.1 / (1.0 + torch.rand(r, generator=gen))
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    # param, exp_avg, exp_avg_sq (non-negative) part-way through a run
    buffers = [torch.randn(n, generator=gen) * 0.1 for _ in range(3)]
    buffers[2] = buffers[2].abs()
    ref = [b.clone() for b in buffers]
    mine = [b.clone() for b in buffers]
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=gen)
        fosi_step_reference(ref[0], grad, basis, scale, ref[1], ref[2], None, "adam",
                            hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], step, 1.5, 0.0, 1.0)
        bench_module.fosi_step_composite(mine[0], grad, basis, scale, mine[1], mine[2],
                                         step=step, base_scale=1.5, **hyper)
    assert not torch.equal(ref[0], buffers[0]), "the reference step did not move the parameters"
    for e, g in zip(ref, mine):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_floor_formulas(bench_module):
    # passes * (2 m + 3) * n * itemsize and (3 r + 10) * n * 4, as the docstring and output state.
    assert bench_module.gram_schmidt_floor_bytes(1000, 24, 2, 4) == 2 * 51 * 1000 * 4
    assert bench_module.gram_schmidt_floor_bytes(1000, 96, 1, 8) == 195 * 1000 * 8
    assert bench_module.fosi_step_floor_bytes(1000, 24) == 82 * 1000 * 4


@pytest.mark.smoke
def test_bench_lanczos_smoke_writes_results():
    result, tmp_path = smoke_run("bench_lanczos")
    output = output_of(result)
    assert result.returncode == 0, output
    rows = read_csv(tmp_path / "lanczos.csv")
    assert rows, "the CSV has no data rows"
    assert all(float(row["ms_p50"]) > 0 for row in rows)
    assert {row["op"] for row in rows} == {"gram_schmidt_project", "fosi_step"}
    for op in ("gram_schmidt_project", "fosi_step"):
        providers = {row["provider"] for row in rows if row["op"] == op}
        # The public op is the primary provider: these ops have no separate launcher.
        primary = "op/triton" if torch.cuda.is_available() else "op/reference"
        assert providers == {primary, "torch", "floor"}, (op, providers)
    assert {row["dtype"] for row in rows if row["op"] == "gram_schmidt_project"} == {"float32", "float64"}
    # The recorded floor follows the stated byte formula.
    for row in rows:
        n, rows_ = int(row["n"]), int(row["rows"])
        if row["op"] == "gram_schmidt_project":
            itemsize = 4 if row["dtype"] == "float32" else 8
            expected = int(row["passes"]) * (2 * rows_ + 3) * n * itemsize
        else:
            expected = (3 * rows_ + 10) * n * 4
        assert int(row["floor_bytes"]) == expected, row

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "lanczos_gram_schmidt.png").exists()
        assert (tmp_path / "lanczos_fosi_step.png").exists()
    if not torch.cuda.is_available():
        assert "no CUDA device" in output
        assert "triton" not in {row["provider"] for row in rows}, "CPU numbers labelled as Triton"
