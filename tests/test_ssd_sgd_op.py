"""The fused SSD-SGD step op: Triton against the reference, the reference against float64 math, bad input."""

import pytest
import torch
from conftest import triton_runs_here
from hypothesis import given
from hypothesis import strategies as st

import tritonopt
from tritonopt.ops import ssd_sgd_step

triton_only = pytest.mark.skipif(not triton_runs_here(), reason="Triton cannot run here")
BACKENDS = ["reference", pytest.param("triton", marks=triton_only)]
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
    out = {k: v.clone() for k, v in buffers.items()}
    kw = dict(hyper)
    if shadow:
        kw.update(shadow_weight=out["sw"], shadow_momentum=out["smom"])
        if pulled and save_sync:
            kw["sync_momentum"] = out["sync_mom"]
    with tritonopt.use_backend(backend):
        count = ssd_sgd_step(out["param"], out["grad"], out["pre"], pulled=pulled, **kw)
    return out, int(count)


def expected_float64(b, *, pulled, shadow, lr, momentum, weight_decay, local_lr, local_weight_decay,
                     glu_alpha, glu_beta, sync_coef, shadow_scale=1.0):
    """The step written as its closed form (design note sec. 5), in float64, plus bounds M per output."""
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
    # rounding of the float32 chain, plus one rounding to the stored dtype
    tol = ROUNDING * bound + torch.finfo(dtype).eps * want.abs() + 1e-30
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


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=triton_only)])
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_buffers_are_a_no_op(backend):
    buffers = make_buffers(0, 0)
    out, count = call(buffers, backend, pulled=True, shadow=True, lr=0.1, momentum=0.9, weight_decay=0.0,
                      local_lr=0.4, local_weight_decay=0.0, glu_alpha=2.0, glu_beta=0.5, sync_coef=0.2)
    assert count == 0 and out["param"].numel() == 0


GOOD = dict(lr=0.1, momentum=0.9, weight_decay=0.0, local_lr=0.4, local_weight_decay=0.0, glu_alpha=2.0,
            glu_beta=0.5, sync_coef=0.2)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(param=torch.zeros(10, 2)), "param must be a 1-D"),
        (dict(grad=torch.zeros(9)), "grad must be 1-D with 10"),
        (dict(pre_weight=torch.zeros(10, dtype=torch.float16)), "pre_weight must be one of"),
        (dict(param=torch.zeros(10, dtype=torch.float64)), "both be float64 or neither"),
        (dict(pre_weight=torch.zeros(20)[::2]), "pre_weight must be contiguous"),
        (dict(param=torch.zeros(10, requires_grad=True)), "must not require grad"),
        (dict(shadow_weight=torch.zeros(10), shadow_momentum=None), "given together"),
        (dict(sync_momentum=torch.zeros(10), pulled=False), "sync_momentum is written only"),
        (dict(shadow_scale=0.5, pulled=False, sync_momentum=None), "shadow_scale applies"),
        (dict(shadow_momentum=torch.zeros(10, dtype=torch.float64)), "shadow_momentum must have"),
        (dict(momentum=1.0), "momentum must lie in"),
        (dict(lr=-0.1), "lr must be >= 0"),
        (dict(glu_beta=float("nan")), "glu_beta must be finite"),
        (dict(sync_coef="fast"), "sync_coef must be a float"),
        (dict(pulled=1), "pulled must be a bool"),
    ],
)
def test_bad_arguments_are_named_and_nothing_changes(change, match):
    args = dict(param=torch.ones(10), grad=torch.ones(10), pre_weight=torch.ones(10),
                shadow_weight=torch.ones(10), shadow_momentum=torch.ones(10), sync_momentum=torch.ones(10),
                pulled=True, **GOOD)
    args.update(change)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((TypeError, ValueError), match=match):
        ssd_sgd_step(**args)
    for k, v in before.items():
        assert torch.equal(args[k], v), k


def test_aliasing_buffers_are_rejected():
    w = torch.ones(10)
    with pytest.raises(ValueError, match="param and pre_weight must not share memory"):
        ssd_sgd_step(w, torch.ones(10), w, **GOOD)
    s = torch.ones(20)
    with pytest.raises(ValueError, match="shadow_weight and shadow_momentum must not share memory"):
        ssd_sgd_step(torch.ones(10), torch.ones(10), torch.ones(10), shadow_weight=s[:10],
                     shadow_momentum=s[5:15], **GOOD)
    assert torch.equal(w, torch.ones(10)) and torch.equal(s, torch.ones(20))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pulled, shadow", [(False, False), (True, False), (False, True), (True, True)])
def test_opcheck(backend, pulled, shadow):
    b = make_buffers(300, 9)
    sw, smom = (b["sw"], b["smom"]) if shadow else (None, None)
    sync = b["sync_mom"] if (pulled and shadow) else None
    args = (b["param"], b["grad"], b["pre"], sw, smom, sync, 0.1, 0.9, 1e-4, 0.4, 1e-4, 2.0, 0.5, 0.2,
            0.5 if (pulled and shadow) else 1.0, pulled)
    with tritonopt.use_backend(backend):
        torch.library.opcheck(torch.ops.tritonopt.ssd_sgd_step, args)


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
