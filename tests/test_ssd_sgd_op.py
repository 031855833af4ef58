"""The fused SSD-SGD step op: Triton against the reference, the reference against float64 math.

Its argument contract (bad input, aliasing, meta tensors, empty buffers, opcheck) is
checked with every other op's, from its entries in ``_op_table.py``.
"""

import pytest
import torch
from _helpers import BACKENDS, needs_triton
from conftest import backend_device
from hypothesis import given
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import ssd_sgd_step

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS32 = torch.finfo(torch.float32).eps
# Each output is a chain of at most 10 float32 operations whose every intermediate is bounded by
# M (below), so it is within 10 eps32 * M of the exact value; two evaluation orders (or FMA
# contraction on a GPU) are within twice that of each other.
ROUNDING = 10 * EPS32


def make_buffers(n, seed, param_dtype=torch.float32, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    state = lambda: (torch.randn(n, generator=gen) * scale).to(device)  # noqa: E731
    return dict(
        param=state().to(param_dtype), grad=state().to(param_dtype), pre=state(),
        sw=state(), smom=state() * 0.1, sync_mom=torch.zeros(n, device=device),
    )


def call(buffers, backend, *, pulled, shadow, save_sync=True, **hyper):
    """The op on copies of ``buffers``, on ``backend``'s device when they are on the CPU (else where
    they are); the copies come back where ``buffers`` are, with the count of refused elements."""
    home = buffers["param"].device
    target = backend_device(backend) if home.type == "cpu" else home
    out = {k: v.to(target, copy=True) for k, v in buffers.items()}
    kw = dict(hyper)
    if shadow:
        kw.update(shadow_weight=out["sw"], shadow_momentum=out["smom"])
        if pulled and save_sync:
            kw["sync_momentum"] = out["sync_mom"]
    with tritonopt.use_backend(backend):
        count = ssd_sgd_step(out["param"], out["grad"], out["pre"], pulled=pulled, **kw)
    return {k: v.to(home) for k, v in out.items()}, int(count)


def expected_float64(b, *, pulled, shadow, lr, momentum, weight_decay, local_lr, local_weight_decay,
                     glu_alpha, glu_beta, sync_coef, shadow_scale=1.0):
    """The step as Eq. 8's closed form (``grad_sync`` substituted, per input), in float64, plus bounds M per output."""
    f = {k: v.double() for k, v in b.items()}
    if shadow and pulled:
        sw, smom = shadow_scale * f["sw"], shadow_scale * f["smom"]
        w_src = sw
    else:
        sw, smom, w_src = f["sw"], f["smom"], f["param"]
    big_l, c = local_lr, sync_coef
    param = (1 - big_l * local_weight_decay + big_l * glu_beta * c) * w_src - big_l * glu_alpha * f["grad"] \
        - big_l * glu_beta * c * f["pre"]
    bound_p = w_src.abs() + big_l * (abs(glu_alpha) * f["grad"].abs() + local_weight_decay * w_src.abs()
                                     + abs(glu_beta) * abs(c) * (f["pre"].abs() + w_src.abs()))
    out = dict(param=(param, bound_p), grad=(f["grad"], 0 * bound_p))
    out["pre"] = (w_src, w_src.abs()) if pulled else (f["pre"], 0 * bound_p)
    if shadow:
        new_mom = momentum * smom - lr * f["grad"] - lr * weight_decay * sw
        bound_m = momentum * smom.abs() + lr * (f["grad"].abs() + weight_decay * sw.abs())
        out["smom"] = (new_mom, bound_m)
        out["sw"] = (sw + new_mom, sw.abs() + bound_m)
        out["sync_mom"] = (smom, smom.abs()) if pulled else (f["sync_mom"], 0 * bound_p)
    else:
        out.update(sw=(f["sw"], 0 * bound_p), smom=(f["smom"], 0 * bound_p), sync_mom=(f["sync_mom"], 0 * bound_p))
    return out


def assert_close(got, want, bound, dtype, what):
    # rounding of the float32 chain, plus one rounding to the stored dtype: relative for normal
    # values, at most the subnormal spacing (tiny * eps: 2**-24 in float16) below its normal range
    info = torch.finfo(dtype)
    tol = ROUNDING * bound + info.eps * want.abs() + info.tiny * info.eps + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"{what}: max error {float(err.max()):.3g}"


hyper_strategy = st.fixed_dictionaries(dict(
    lr=st.sampled_from([0.0, 0.05, 0.4]),
    momentum=st.sampled_from([0.0, 0.9]),
    weight_decay=st.sampled_from([0.0, 1e-4]),
    local_lr=st.sampled_from([0.0, 0.2, 1.6]),
    local_weight_decay=st.sampled_from([0.0, 1e-4, 1e-2]),
    glu_alpha=st.sampled_from([1.0, 2.0, -0.5]),
    glu_beta=st.sampled_from([0.0, 0.5]),
    sync_coef=st.sampled_from([0.0, 0.05, 2.5]),
))


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    n=st.integers(1, 3000),
    seed=st.integers(0, 2**31 - 1),
    hyper=hyper_strategy,
    pulled=st.booleans(),
    shadow=st.booleans(),
    save_sync=st.booleans(),
    scale=st.sampled_from([1.0, 0.25, 0.5]),
    param_dtype=st.sampled_from(sorted(PARAM_DTYPES)),
)
def test_step_matches_its_float64_closed_form(backend, n, seed, hyper, pulled, shadow, save_sync, scale, param_dtype):
    dtype = PARAM_DTYPES[param_dtype]
    shadow_scale = scale if (pulled and shadow) else 1.0
    buffers = make_buffers(n, seed, dtype)
    out, count = call(buffers, backend, pulled=pulled, shadow=shadow, save_sync=save_sync,
                      shadow_scale=shadow_scale, **hyper)
    want = expected_float64(buffers, pulled=pulled, shadow=shadow, shadow_scale=shadow_scale, **hyper)
    assert count == 0
    for name, (value, bound) in want.items():
        if name == "sync_mom" and not (shadow and pulled and save_sync):
            value, bound = buffers[name].double(), 0 * bound
        stored = dtype if name in ("param", "grad") else torch.float32
        assert_close(out[name], value, bound, stored, name)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton)])
@given(
    n=st.sampled_from([1, 1023, 1024, 1025, 2049, 4097]),
    seed=st.integers(0, 2**31 - 1),
    hyper=hyper_strategy,
    pulled=st.booleans(),
    shadow=st.booleans(),
    param_dtype=st.sampled_from(sorted(PARAM_DTYPES)),
)
def test_triton_matches_the_reference(backend, n, seed, hyper, pulled, shadow, param_dtype):
    dtype = PARAM_DTYPES[param_dtype]
    buffers = make_buffers(n, seed, dtype)
    scale = 0.5 if (pulled and shadow) else 1.0
    ref, ref_count = call(buffers, "reference", pulled=pulled, shadow=shadow, shadow_scale=scale, **hyper)
    tri, tri_count = call(buffers, backend, pulled=pulled, shadow=shadow, shadow_scale=scale, **hyper)
    assert ref_count == tri_count == 0
    want = expected_float64(buffers, pulled=pulled, shadow=shadow, shadow_scale=scale, **hyper)
    for name in ref:
        stored = dtype if name in ("param", "grad") else torch.float32
        # both are within the rounding bound of the exact value, hence within twice of each other
        assert_close(tri[name], ref[name].double(), 2 * want[name][1], stored, name)
        assert_close(ref[name], tri[name].double(), 2 * want[name][1], stored, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pulled", [False, True])
def test_float64_buffers_follow_the_closed_form_to_rounding(backend, pulled):
    n = 777
    gen = torch.Generator().manual_seed(3)
    b = {k: torch.randn(n, generator=gen, dtype=torch.float64) for k in ("param", "grad", "pre", "sw", "smom")}
    b["sync_mom"] = torch.zeros(n, dtype=torch.float64)
    hyper = dict(lr=0.4, momentum=0.9, weight_decay=1e-4, local_lr=1.6, local_weight_decay=1e-4, glu_alpha=2.0,
                 glu_beta=0.5, sync_coef=(1 - 0.9) / (0.4 * 5))
    scale = 0.25 if pulled else 1.0
    out, _ = call(b, backend, pulled=pulled, shadow=True, shadow_scale=scale, **hyper)
    want = expected_float64(b, pulled=pulled, shadow=True, shadow_scale=scale, **hyper)
    for name, (value, bound) in want.items():
        err = (out[name] - value).abs()
        assert bool((err <= 12 * torch.finfo(torch.float64).eps * bound + 1e-300).all()), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shadow", [False, True])
def test_nonfinite_elements_keep_their_value_and_poison_the_shadow(backend, shadow):
    n = 2100
    buffers = make_buffers(n, 7)
    bad = torch.tensor([0, 5, 1024, 2099])
    buffers["grad"][bad[:2]] = float("nan")
    buffers["grad"][bad[2:]] = float("inf")
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-4, local_lr=0.4, local_weight_decay=1e-4,
                 glu_alpha=2.0, glu_beta=0.5, sync_coef=0.2)
    out, count = call(buffers, backend, pulled=False, shadow=shadow, **hyper)
    assert count == len(bad)
    assert torch.equal(out["param"][bad], buffers["param"][bad])
    assert torch.isfinite(out["param"]).all()
    if shadow:
        assert torch.isnan(out["sw"][bad]).all()
        good = torch.ones(n, dtype=torch.bool)
        good[bad] = False
        assert torch.isfinite(out["sw"][good]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_that_overflows_the_parameter_dtype_is_refused_element_wise(backend):
    buffers = make_buffers(64, 8, torch.float16)
    buffers["grad"][3] = 60000.0  # finite in float16, but 1.6 * 2 * 6e4 is not
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.0, local_lr=1.6, local_weight_decay=0.0,
                 glu_alpha=2.0, glu_beta=0.5, sync_coef=0.0)
    out, count = call(buffers, backend, pulled=False, shadow=True, **hyper)
    assert count == 1 and out["param"][3] == buffers["param"][3] and torch.isnan(out["sw"][3])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1_000_003, 25_557_032])
def test_gpu_triton_matches_reference_at_real_sizes(n):
    buffers = make_buffers(n, 0, device="cuda")
    hyper = dict(lr=0.4, momentum=0.9, weight_decay=1e-4, local_lr=1.6, local_weight_decay=1e-4,
                 glu_alpha=2.0, glu_beta=0.5, sync_coef=0.05)
    for pulled in (False, True):
        scale = 0.25 if pulled else 1.0
        ref, _ = call(buffers, "reference", pulled=pulled, shadow=True, shadow_scale=scale, **hyper)
        tri, _ = call(buffers, "triton", pulled=pulled, shadow=True, shadow_scale=scale, **hyper)
        want = expected_float64(buffers, pulled=pulled, shadow=True, shadow_scale=scale, **hyper)
        for name in ref:
            assert_close(tri[name], ref[name].double(), 2 * want[name][1], torch.float32, name)
