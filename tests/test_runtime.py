"""Backend choice, autotune modes and pinned configs, NVTX ranges, importing without a GPU or Triton."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import backend_device, run_on_backend, triton_runs_here

import tritonopt
from tritonopt import _runtime
from tritonopt.kernels import ef_topk as ef_topk_kernels


def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_changes}
    env = {key: value for key, value in env.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_reference_is_forced_by_environment(monkeypatch):
    monkeypatch.setenv("TRITONOPT_BACKEND", "reference")
    assert tritonopt.select_backend(torch.device("cpu")) == "reference"
    assert tritonopt.select_backend(torch.device("cuda")) == "reference"


def test_unknown_backend_in_environment_is_named(monkeypatch):
    monkeypatch.setenv("TRITONOPT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="TRITONOPT_BACKEND='cuda'"):
        tritonopt.select_backend(torch.device("cpu"))


def test_use_backend_overrides_environment_and_restores(monkeypatch):
    monkeypatch.setenv("TRITONOPT_BACKEND", "triton")
    with tritonopt.use_backend("reference"):
        assert tritonopt.select_backend(torch.device("cpu")) == "reference"
        with tritonopt.use_backend("auto"):
            monkeypatch.setenv("TRITONOPT_BACKEND", "reference")
            assert tritonopt.select_backend(torch.device("cpu")) == "reference"
        assert tritonopt.select_backend(torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="backend"):
        with tritonopt.use_backend("fast"):
            pass


@pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
def test_auto_picks_triton_where_it_runs(device):
    assert tritonopt.select_backend(device) == "triton"


@pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
def test_an_op_measured_slower_than_cublas_runs_its_reference_on_cuda_unless_triton_is_forced():
    # The device is only named: choosing a backend queries no GPU.
    cuda = torch.device("cuda")
    assert tritonopt.select_backend(cuda) == "triton"
    assert tritonopt.select_backend(cuda, cuda_default="reference") == "reference"
    with tritonopt.use_backend("triton"):
        assert tritonopt.select_backend(cuda, cuda_default="reference") == "triton"
    # Under the interpreter (CPU tensors) every op still runs its kernel: that is what the tests prove.
    if backend_device("triton").type == "cpu":
        assert tritonopt.select_backend(torch.device("cpu"), cuda_default="reference") == "triton"
    with pytest.raises(ValueError, match="cuda_default"):
        tritonopt.select_backend(cuda, cuda_default="cublas")


def test_the_ops_slower_than_their_torch_path_on_an_h100_are_the_ones_that_default_to_it():
    from tritonopt import ops

    defaults = {name: getattr(ops, name).cuda_default for name in ops.__all__
                if hasattr(getattr(ops, name), "cuda_default")}
    slower = {"kfac_factor_update", "eigenbasis_precondition", "eigenbasis_precondition_prediv", "lowrank_ef"}
    assert {name for name, default in defaults.items() if default == "reference"} == slower
    assert "ef_topk" in defaults and "sparse_lcg" in defaults


def test_forced_triton_on_an_unsupported_device_fails_clearly():
    with tritonopt.use_backend("triton"):
        with pytest.raises(tritonopt.BackendUnavailableError, match="device type 'meta'"):
            tritonopt.select_backend(torch.device("meta"))


def test_forced_triton_without_interpreter_on_cpu_fails_clearly():
    result = run_python(
        """
        import torch, tritonopt
        assert tritonopt.select_backend(torch.device("cpu")) == "reference"
        grad, error = torch.randn(2, 16), torch.zeros(2, 16)
        tritonopt.ops.ef_topk(grad, error, 2)  # auto: the reference serves
        with tritonopt.use_backend("triton"):
            try:
                tritonopt.ops.ef_topk(grad, error, 2)
            except tritonopt.BackendUnavailableError as exc:
                print("refused:", exc)
        """,
        TRITON_INTERPRET=None,
        TRITONOPT_BACKEND=None,
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


def test_import_and_ops_work_without_triton():
    result = run_python(
        """
        import sys
        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is not installed")
        sys.meta_path.insert(0, NoTriton())
        import torch, tritonopt
        from tritonopt import _runtime
        assert not _runtime.HAS_TRITON
        grad, error = torch.tensor([[3.0, -1.0, 2.0]]), torch.zeros(1, 3)
        indices, values = tritonopt.ops.ef_topk(grad, error, 1)
        assert indices.tolist() == [[0]] and values.tolist() == [[3.0]]
        opt = tritonopt.optim.SparseAdaGrad([torch.nn.Parameter(torch.ones(3))], density=0.5)
        with tritonopt.use_backend("triton"):
            try:
                tritonopt.ops.ef_topk(grad, error, 1)
            except tritonopt.BackendUnavailableError as exc:
                print("refused:", exc)
        """,
        TRITON_INTERPRET="1",
    )
    assert result.returncode == 0, result.stderr
    assert "Triton is not importable" in result.stdout


def test_import_queries_no_device():
    result = run_python(
        """
        import torch, tritonopt
        assert not torch.cuda.is_initialized()
        print("clean")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "clean" in result.stdout


@pytest.mark.skipif(not _runtime.HAS_TRITON, reason="needs Triton")
def test_kernels_without_timed_autotuning_are_pinned():
    kernel = ef_topk_kernels._ef_topk_row_kernel
    space = _runtime.tuning_space(kernel)
    assert len(space.configs) == len(ef_topk_kernels._ef_topk_configs())  # the whole space is declared
    if _runtime.autotune_enabled():  # a GPU: Triton's autotuner times the configs
        assert "error_ptr" in kernel.restore_value  # the kernel updates error in place
    else:  # the interpreter has no driver to time with
        assert isinstance(kernel, _runtime.PinnedKernel)


@pytest.mark.skipif(not _runtime.HAS_TRITON, reason="needs Triton")
def test_kernels_whose_reduction_order_depends_on_the_config_are_pinned():
    from tritonopt.kernels import fosi_step, kfac, lanczos, lowrank, sparse_ring

    for kernel in (sparse_ring._sparse_sp_kernel, lanczos._gs_coefficients_kernel, lanczos._gs_subtract_kernel,
                   fosi_step._fosi_coefficients_kernel, fosi_step._fosi_base_kernel,
                   fosi_step._fosi_project_out_kernel, kfac._factor_update_kernel, kfac._gemm_epilogue_kernel,
                   lowrank._accumulate_project_kernel, lowrank._back_project_kernel, lowrank._residual_kernel):
        assert _runtime.tuning_space(kernel).pinned, kernel
        if _runtime.autotune_mode() != "all":
            assert isinstance(kernel, _runtime.PinnedKernel), kernel


@pytest.mark.skipif(not _runtime.HAS_TRITON, reason="needs Triton")
def test_pinned_choice_is_the_first_launchable_config_of_the_key():
    from tritonopt.kernels import fosi_step, kfac

    space = _runtime.tuning_space(fosi_step._fosi_base_kernel)
    # Wide ranks prune the wide tiles (they spill); the choice is a function of the key only.
    small = space.choose({"n_bucket": 1 << 20, "BLOCK_R": 16, "BASE": 2})
    large = space.choose({"n_bucket": 1 << 20, "BLOCK_R": 64, "BASE": 2})
    assert small.kwargs["BLOCK_N"] * 16 <= 64 * 32 * small.num_warps
    assert large.kwargs["BLOCK_N"] * 64 <= 64 * 32 * large.num_warps
    assert large.kwargs["BLOCK_N"] < small.kwargs["BLOCK_N"]
    assert space.choose({"n_bucket": 1 << 20, "BLOCK_R": 64, "BASE": 2}) is large
    # No K-FAC config needs more shared memory than an H100 block may use.
    for config in _runtime.tuning_space(kfac._factor_update_kernel).configs:
        block, block_k = config.kwargs["BLOCK"], config.kwargs["BLOCK_K"]
        assert 2 * block * block_k * 4 * config.num_stages <= 227 * 1024
    with pytest.raises(ValueError, match="no config fits"):
        _runtime.TuningSpace([], ["x"], ["x"], None, True).choose({"x": 1})


@pytest.mark.skipif(not _runtime.HAS_TRITON, reason="needs Triton")
def test_pinned_kernel_records_its_choice_per_key():
    from tritonopt.kernels import lanczos

    if not triton_runs_here():
        pytest.skip("Triton cannot run here")
    basis, h = torch.randn(3, 40), torch.randn(40)
    run_on_backend("triton", tritonopt.ops.gram_schmidt_project, basis, h, 3)
    kernel = lanczos._gs_coefficients_kernel
    space = _runtime.tuning_space(kernel)
    key = (64, 4)  # (cols_bucket, rows_bucket) of n = 40, 3 rows
    recorded = {config for k, config in kernel.cache.items() if k[:2] == key}  # one entry per dtype
    assert recorded == {space.choose(dict(zip(space.key, key)))}


def test_autotune_switch_is_read_from_environment(monkeypatch):
    # Read at each call (a kernel reads it when it is defined): no fresh process needed. Without the
    # interpreter Triton could time configs, so the switch alone must turn autotuning off.
    monkeypatch.setattr(_runtime, "INTERPRETER", False)
    monkeypatch.setattr(_runtime, "HAS_TRITON", True)
    monkeypatch.setenv("TRITONOPT_AUTOTUNE", "0")
    assert (_runtime.autotune_enabled(), _runtime.autotune_mode()) == (False, "off")
    monkeypatch.setenv("TRITONOPT_AUTOTUNE", "1")
    assert (_runtime.autotune_enabled(), _runtime.autotune_mode()) == (True, "default")
    monkeypatch.setenv("TRITONOPT_AUTOTUNE", "fastest")
    with pytest.raises(ValueError, match="TRITONOPT_AUTOTUNE='fastest'"):
        _runtime.autotune_mode()


def test_nvtx_range_is_a_context_manager_with_or_without_nvtx():
    with tritonopt.nvtx_range("tritonopt/test/range"):
        value = 1 + 1
    assert value == 2
    result = run_python(
        """
        import tritonopt
        with tritonopt.nvtx_range("tritonopt/test/off"):
            pass
        print(tritonopt._runtime._nvtx_module())
        """,
        TRITONOPT_NVTX="0",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_helpers():
    assert [_runtime.next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 4097)] == [1, 1, 2, 4, 4, 8, 8192]
    assert _runtime.cdiv(10, 4) == 3 and _runtime.cdiv(8, 4) == 2
