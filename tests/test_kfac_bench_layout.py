"""The K-FAC benchmarks time the factor update on factors laid out as the optimizer stores them.

``perf/bench_kfac.py`` and ``perf/autotune.py`` each build a factor update; here every
``kfac_factor_update`` call they make is recorded, with the factor's shape, strides and
storage (its row padding), the input's width and the bias flag, and compared with the calls
``KFACPreconditioner`` makes for a layer of the same shape.
"""

import pytest
import torch
from _perf import perf_module
from torch import nn

import tritonopt
from tritonopt.optim import KFACPreconditioner, kfac_functional

# A Linear(130, 129) with bias: the A factor is 131 wide (rows padded to 132), G 129 (also 132).
IN_FEATURES, OUT_FEATURES, BATCH = 130, 129, 16


def call_layout(factor: torch.Tensor, x: torch.Tensor, append_bias: bool) -> tuple:
    return (tuple(factor.shape), factor.stride(), factor.untyped_storage().nbytes(), factor.storage_offset(),
            factor.dtype, x.shape[1], bool(append_bias))


@pytest.fixture
def recorded(monkeypatch):
    """The layouts of every factor update called through the public op or by the optimizer."""
    calls = []

    def recorder(original):
        def update(factor, x, decay, append_bias=False, **kwargs):
            calls.append(call_layout(factor, x, append_bias))
            return original(factor, x, decay, append_bias=append_bias, **kwargs)

        return update

    monkeypatch.setattr(tritonopt.ops, "kfac_factor_update", recorder(tritonopt.ops.kfac_factor_update))
    monkeypatch.setattr(kfac_functional, "kfac_factor_update", recorder(kfac_functional.kfac_factor_update))
    return calls


def optimizer_layouts(calls: list) -> set:
    """The factor updates of one preconditioned step of a Linear(IN_FEATURES, OUT_FEATURES)."""
    torch.manual_seed(0)
    model = nn.Linear(IN_FEATURES, OUT_FEATURES)
    precond = KFACPreconditioner(model)
    model(torch.randn(BATCH, IN_FEATURES)).square().sum().backward()
    assert precond.step()
    layouts = set(calls)
    calls.clear()
    return layouts


def test_bench_kfac_times_the_factor_layout_the_optimizer_stores(recorded):
    bench_kfac = perf_module("bench_kfac")
    with tritonopt.use_backend("reference"):
        expected = optimizer_layouts(recorded)
        case = bench_kfac.factor_case(BATCH, IN_FEATURES, torch.device("cpu"), "ieee")
        case.public()()
    (bench_layout,) = recorded
    assert bench_layout[0] == (IN_FEATURES + 1,) * 2 and bench_layout[1] == (132, 1), "a padded factor"
    assert bench_layout in expected


def test_autotune_times_the_factor_layouts_the_optimizer_stores(recorded):
    autotune = perf_module("autotune")
    shapes = autotune.ModelShapes("linear", 4096, (autotune.Layer(IN_FEATURES + 1, OUT_FEATURES, BATCH, bias=True),),
                                  ring_m=4)
    with tritonopt.use_backend("reference"):
        expected = optimizer_layouts(recorded)
        for work in autotune.workloads(shapes, torch.device("cpu")):
            if work.op == "kfac_factor_update":
                work.build()()
    assert len(expected) == 2 and set(recorded) == expected
