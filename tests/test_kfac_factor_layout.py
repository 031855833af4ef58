"""K-FAC's factor layout: rows padded to a multiple of 4 entries from 128 columns on.

The padding gives every row a 16-byte aligned start, so the factor-update and
triangle-packing kernels load factors of odd dim (a layer with its bias column)
in vectors (``tests/test_sm90_compile.py`` checks the loads). Here: the layout
itself, that the padding changes no bit of any result, that checkpoints hold the
unpadded factors, and that memory reports count the padding.
"""

import pytest
import torch
from _helpers import needs_triton
from conftest import backend_device
from torch import nn

import tritonopt
from tritonopt.dist.kaisa import KAISAPreconditioner
from tritonopt.kernels import kfac as kfac_kernels
from tritonopt.optim import kfac_functional
from tritonopt.optim.kfac import KFACPreconditioner
from tritonopt.optim.kfac_functional import buffer_bytes, factor_buffer, factor_row_stride

# a = 131 (130 inputs and the bias column) and 130, g = 129 and 3: three padded dims, one narrow.
IN_FEATURES, HIDDEN, OUT_FEATURES = 130, 129, 3


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


def train(precond_type=KFACPreconditioner, steps: int = 3, device=torch.device("cpu"), **kwargs):
    """``steps`` preconditioned steps of :func:`make_model` on ``device``:
    (model, preconditioner, gradients per step)."""
    model = make_model().to(device)
    precond = precond_type(model, damping=0.01, **kwargs)
    generator = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        model.zero_grad()
        x = torch.randn(24, IN_FEATURES, generator=generator).to(device)
        model(x).square().sum().backward()
        assert precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    return model, precond, grads


def unpadded(monkeypatch):
    monkeypatch.setattr(kfac_functional, "PADDED_FACTOR_MIN_DIM", 1 << 30)


def test_factor_rows_are_padded_to_a_multiple_of_4_from_128_columns_on():
    dims = (0, 2, 127, 128, 129, 131, 577, 769)
    assert [factor_row_stride(d) for d in dims] == [0, 2, 127, 128, 132, 132, 580, 772]
    factor = factor_buffer(131)
    assert factor.shape == (131, 131) and factor.stride() == (132, 1)
    assert factor.untyped_storage().nbytes() == buffer_bytes(factor) == 131 * 132 * 4
    padding = torch.as_strided(factor, (131, 1), (132, 1), factor.storage_offset() + 131)
    assert torch.equal(padding, torch.zeros(131, 1))
    narrow = factor_buffer(127, dtype=torch.bfloat16)
    assert narrow.is_contiguous() and buffer_bytes(narrow) == 127 * 127 * 2
    assert buffer_bytes(None) == 0


def test_factor_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="dim"):
        factor_row_stride(-1)
    with pytest.raises(TypeError, match="dim"):
        factor_buffer(3.0)
    with pytest.raises(TypeError, match="dtype"):
        factor_buffer(3, dtype=torch.int32)


def test_kernels_read_into_the_row_padding_only_where_the_storage_holds_it():
    padded = factor_buffer(131)
    assert kfac_kernels._row_alignment(padded) == 4
    # The same rows, but the storage ends right after the last row's 131st entry.
    short = torch.empty(130 * 132 + 131).as_strided((131, 131), (132, 1))
    assert kfac_kernels._row_alignment(short) == 1
    assert kfac_kernels._row_alignment(torch.empty(131, 131)) == 1
    assert kfac_kernels._row_alignment(torch.empty(132, 132)) == 4
    # Columns 2 entries apart: rows are read up to dim only (the divisor of both, not the stride's 8).
    assert kfac_kernels._row_alignment(torch.empty(132, 264)[:, ::2]) == 4


@needs_triton
@pytest.mark.parametrize("decay", [0.0, 0.75])
def test_triton_ops_on_padded_factors_match_contiguous_ones_bit_for_bit(decay):
    device = backend_device("triton")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 130, generator=generator).to(device)
    old = torch.randn(131, 131, generator=generator)
    old = (old + old.T).to(device)
    contiguous = old.clone()
    padded = factor_buffer(131, device=device)
    padded.copy_(old)
    with tritonopt.use_backend("triton"):
        tritonopt.ops.kfac_factor_update(contiguous, x, decay, append_bias=True, scale=0.5)
        tritonopt.ops.kfac_factor_update(padded, x, decay, append_bias=True, scale=0.5)
        assert torch.equal(padded, contiguous)
        packed = tritonopt.ops.triu_pack(padded, torch.bfloat16)
        assert torch.equal(packed, tritonopt.ops.triu_pack(contiguous, torch.bfloat16))
    padding = torch.as_strided(padded, (131, 1), (132, 1), padded.storage_offset() + 131)
    assert torch.equal(padding.cpu(), torch.zeros(131, 1)), "the padding is never written"


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_preconditioner_stores_padded_factors_and_computes_the_same_bits(backend, monkeypatch):
    device = backend_device(backend)
    with tritonopt.use_backend(backend):
        _, precond, grads = train(device=device)
        with monkeypatch.context() as patch:
            unpadded(patch)
            _, plain, plain_grads = train(device=device)
    for layer in precond.layers:
        for factor in (layer.a_factor, layer.g_factor, layer.a_batch, layer.g_batch):
            assert factor.stride() == (factor_row_stride(factor.shape[0]), 1)
    assert precond.layers[0].a_factor.stride() == (132, 1)
    assert plain.layers[0].a_factor.is_contiguous()
    for padded_step, plain_step in zip(grads, plain_grads):
        assert all(torch.equal(p, q) for p, q in zip(padded_step, plain_step))
    for layer, plain_layer in zip(precond.layers, plain.layers):
        assert torch.equal(layer.a_factor, plain_layer.a_factor)
        assert torch.equal(layer.g_factor, plain_layer.g_factor)


def test_memory_reports_count_the_padding():
    with tritonopt.use_backend("reference"):
        _, precond, _ = train(steps=1)
        _, narrow, _ = train(steps=1, factor_dtype=torch.bfloat16)
        _, kaisa, _ = train(KAISAPreconditioner, steps=1)
    padded = 131 * 132 + 129 * 132 + 130 * 132 + 3 * 3
    usage = precond.memory_usage()
    assert usage["factors"] == usage["batch"] == 4 * padded
    assert narrow.memory_usage()["factors"] == 2 * padded
    assert narrow.memory_usage()["batch"] == 4 * padded, "statistics accumulate in float32"
    assert kaisa.memory_usage() == kaisa.expected_memory()
    assert kaisa.expected_memory()["factors"] == 4 * padded


def test_checkpoints_hold_unpadded_factors_and_resume_in_the_padded_layout():
    with tritonopt.use_backend("reference"):
        model, precond, _ = train(steps=2)
        state = precond.state_dict()
        a_factor = state["layers"]["0"]["a_factor"]
        assert a_factor.shape == (131, 131) and a_factor.is_contiguous()
        assert a_factor.untyped_storage().nbytes() == 131 * 131 * 4
        assert torch.equal(a_factor, precond.layers[0].a_factor)
        resumed = KFACPreconditioner(make_model(seed=5), damping=0.01)
        resumed.load_state_dict(state)
        for layer, original in zip(resumed.layers, precond.layers):
            assert layer.a_factor.stride() == original.a_factor.stride()
            assert torch.equal(layer.a_factor, original.a_factor)
            assert torch.equal(layer.g_factor, original.g_factor)
        narrow = KFACPreconditioner(make_model(seed=5), damping=0.01, factor_dtype=torch.bfloat16)
        narrow.load_state_dict(state)
        assert narrow.layers[0].a_factor.stride() == (132, 1)
        assert torch.equal(narrow.layers[0].a_factor, precond.layers[0].a_factor.to(torch.bfloat16))


def test_the_functional_module_re_exports_each_layer_function_of_kfac_functional():
    from tritonopt.optim import functional

    for name in kfac_functional.LAYER_FUNCTIONS:
        assert name in functional.__all__ and name in kfac_functional.__all__
        assert getattr(functional, name) is getattr(kfac_functional, name)
    assert functional.__all__[:28] == sorted(functional.__all__[:28])
    assert not [name for name in kfac_functional.__all__ if name.startswith("kfac_") and name not in functional.__all__]
