"""KFACPreconditioner in one process: factors, preconditioned gradients, KL clip, checkpoints, errors."""

import copy
import math
import warnings

import pytest
import torch
from _helpers import needs_triton
from conftest import backend_device
from torch import nn

import tritonopt
from tritonopt.optim.kfac import KFACPreconditioner, UnsupportedLayerError


@pytest.fixture(autouse=True)
def reference_backend(request):
    """The preconditioner tests run the reference ops unless a test asks for Triton."""
    if request.function.__name__.startswith("test_triton"):
        yield
        return
    with tritonopt.use_backend("reference"):
        yield


def kron_solve(grad, a, g, damping):
    """``(A (x) G + damping I)^-1 vec(grad)``, dense float64 (column-major vec)."""
    a, g, grad = a.double(), g.double(), grad.double()
    n = a.shape[0] * g.shape[0]
    fisher = torch.kron(a.T.contiguous(), g) + damping * torch.eye(n, dtype=torch.float64)
    return torch.linalg.solve(fisher, grad.T.reshape(-1)).reshape(a.shape[0], g.shape[0]).T


def patches_by_hand(x, kernel, stride, padding):
    """Conv2d patch matrix ``[N * Ho * Wo, C * kh * kw]`` by explicit slicing, ``(C, kh, kw)`` order."""
    n, c, h, w = x.shape
    kh, kw = kernel
    xp = torch.nn.functional.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    ho = (h + 2 * padding[0] - kh) // stride[0] + 1
    wo = (w + 2 * padding[1] - kw) // stride[1] + 1
    rows = []
    for b in range(n):
        for i in range(ho):
            for j in range(wo):
                window = xp[b, :, i * stride[0] : i * stride[0] + kh, j * stride[1] : j * stride[1] + kw]
                rows.append(window.reshape(-1))
    return torch.stack(rows), ho * wo


class Capture:
    """Records each layer's input and output gradient with plain hooks (an independent oracle)."""

    def __init__(self, modules):
        self.inputs, self.grads = {}, {}
        for m in modules:
            m.register_forward_hook(self._fwd(m))

    def _fwd(self, m):
        def hook(module, inputs, output):
            self.inputs[m] = inputs[0].detach().clone()
            output.register_hook(lambda g: self.grads.__setitem__(m, g.detach().clone()))
        return hook


def one_step(model, x, y, **kwargs):
    precond = KFACPreconditioner(model, **kwargs)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    raw = {l.name: l.grad_matrix().clone() for l in precond.layers}
    precond.step()
    return precond, raw


# --------------------------------------------------------------------------- factors


@pytest.mark.parametrize("bias", [True, False])
def test_linear_factors_are_the_second_moments(bias):
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias)
    model = nn.Sequential(layer)
    capture = Capture([layer])
    x = torch.randn(2, 4, 5)  # a sequence input: rows are all leading positions
    y = torch.randint(0, 3, (2, 4))
    precond = KFACPreconditioner(model, factor_decay=0.9)
    model.zero_grad()
    nn.functional.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1)).backward()
    precond.step()
    xa = capture.inputs[layer].reshape(-1, 5).double()
    if bias:
        xa = torch.cat([xa, torch.ones(8, 1, dtype=torch.float64)], 1)
    xg = capture.grads[layer].reshape(-1, 3).double()
    (l,) = precond.layers
    eye_a, eye_g = torch.eye(xa.shape[1], dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    assert torch.allclose(l.a_factor.double(), 0.9 * eye_a + 0.1 * xa.T @ xa / 8, atol=1e-6)
    assert torch.allclose(l.g_factor.double(), 0.9 * eye_g + 0.1 * xg.T @ xg / 8, atol=1e-9)
    assert torch.equal(l.a_factor, l.a_factor.T) and torch.equal(l.g_factor, l.g_factor.T)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("conv", [
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(0, 1)),
])
def test_conv2d_factors_follow_the_patch_extraction(bias, conv):
    torch.manual_seed(1)
    layer = nn.Conv2d(2, 3, bias=bias, **conv)
    model = nn.Sequential(layer, nn.Flatten())
    capture = Capture([layer])
    x = torch.randn(3, 2, 5, 6)
    out = model(x)
    precond = KFACPreconditioner(model, factor_decay=0.5, g_batch_scale=False)
    model.zero_grad()
    out = model(x)
    (out**2).mean().backward()
    precond.step()
    rows, positions = patches_by_hand(capture.inputs[layer], layer.kernel_size, layer.stride, layer.padding)
    xa = rows.double()
    if bias:
        xa = torch.cat([xa, torch.ones(xa.shape[0], 1, dtype=torch.float64)], 1)
    xa = xa / positions
    g = capture.grads[layer]
    xg = g.permute(0, 2, 3, 1).reshape(-1, 3).double() / positions
    n = xa.shape[0]
    (l,) = precond.layers
    assert l.a_dim == 2 * layer.kernel_size[0] * layer.kernel_size[1] + bias
    half_a = 0.5 * torch.eye(l.a_dim, dtype=torch.float64)
    assert torch.allclose(l.a_factor.double(), half_a + 0.5 * xa.T @ xa / n, atol=1e-7)
    assert torch.allclose(l.g_factor.double(), 0.5 * torch.eye(3, dtype=torch.float64) + 0.5 * xg.T @ xg / n,
                          atol=1e-12, rtol=1e-5)
    # Gradient layout: columns of grad align with A's index order, bias last.
    w_grad = (g.permute(0, 2, 3, 1).reshape(-1, 3).double().T @ rows.double())
    raw = torch.cat([w_grad] + ([g.sum((0, 2, 3)).double()[:, None]] if bias else []), 1)
    model.zero_grad()
    (model(x) ** 2).mean().backward()
    assert torch.allclose(l.grad_matrix().double(), raw, atol=1e-6)


def test_micro_batches_average_to_the_concatenated_batch():
    torch.manual_seed(2)
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    models = [nn.Sequential(nn.Linear(6, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    # The loss of each of m micro-batches is divided by m, so delta carries 1/8 either way.
    whole = KFACPreconditioner(models[0])
    split = KFACPreconditioner(models[1])
    nn.functional.cross_entropy(models[0](x), y).backward()
    for half in (slice(0, 4), slice(4, 8)):
        (nn.functional.cross_entropy(models[1](x[half]), y[half]) / 2).backward()
    whole.step()
    split.step()
    assert torch.allclose(whole.layers[0].a_factor, split.layers[0].a_factor, atol=1e-6)
    assert torch.allclose(whole.layers[0].g_factor, split.layers[0].g_factor, rtol=1e-5, atol=1e-9)
    assert not torch.equal(whole.layers[0].g_factor, torch.eye(4)), "statistics were folded in"


def test_hooks_capture_only_in_training_on_factor_steps():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3))
    precond = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2)
    layer = precond.layers[0]
    model.eval()
    nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
    assert layer.a_count == 0 and layer.g_count == 0
    model.train()
    with torch.no_grad():
        model(torch.randn(5, 4))
    assert layer.a_count == 0
    nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
    assert layer.a_count == 1 and layer.g_count == 1
    precond.step()  # step 0 -> 1
    before = layer.a_factor.clone()
    model.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
    assert layer.a_count == 0, "step 1 is not a factor step"
    precond.step()
    assert torch.equal(layer.a_factor, before)


# --------------------------------------------------------------------------- preconditioning


@pytest.mark.parametrize("prediv", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_preconditioned_gradients_equal_dense_kronecker_solve(prediv, bias):
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1, bias=bias), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 5, bias=bias)
    )
    x, y = torch.randn(6, 1, 4, 4), torch.randint(0, 5, (6,))
    damping = 0.05
    precond, raw = one_step(model, x, y, damping=damping, kl_clip=None, prediv=prediv, factor_decay=0.7)
    for layer in precond.layers:
        expected = kron_solve(raw[layer.name], layer.a_factor, layer.g_factor, damping)
        got = layer.grad_matrix().double()
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), layer.name


@needs_triton
def test_triton_and_reference_paths_agree_over_steps():
    torch.manual_seed(5)
    base = nn.Sequential(nn.Conv2d(1, 2, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))
    x, y = torch.randn(3, 4, 1, 5, 5), torch.randint(0, 3, (3, 4))
    device = backend_device("triton")  # both runs there: the same forward and backward, only the ops differ
    base, x, y = base.to(device), x.to(device), y.to(device)
    runs = {}
    for backend in ("triton", "reference"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with tritonopt.use_backend(backend):
            precond = KFACPreconditioner(model, damping=0.03, inv_update_steps=2)
            for t in range(3):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[t]), y[t]).backward()
                precond.step()
                opt.step()
        runs[backend] = (model, precond)
    for lt, lr_ in zip(runs["triton"][1].layers, runs["reference"][1].layers):
        assert torch.allclose(lt.a_factor, lr_.a_factor, rtol=1e-5, atol=1e-6)
        assert torch.allclose(lt.g_factor, lr_.g_factor, rtol=1e-5, atol=1e-9)
        for name in lt.eigen:
            if name == "inv_denominator":
                assert torch.allclose(lt.eigen[name], lr_.eigen[name], rtol=1e-3)
    for pt, pr in zip(runs["triton"][0].parameters(), runs["reference"][0].parameters()):
        assert torch.allclose(pt, pr, rtol=1e-4, atol=1e-5)


def test_kl_clip_scale():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    free = copy.deepcopy(model)
    p_free, raw = one_step(free, x, y, kl_clip=None, lr=0.5)
    clip_model = copy.deepcopy(model)
    kappa = 1e-4
    p_clip, _ = one_step(clip_model, x, y, kl_clip=kappa, lr=0.5)
    inner = sum((l.grad_matrix().double() * raw[l.name].double()).sum() for l in p_free.layers)
    nu = min(1.0, math.sqrt(kappa / abs(0.25 * inner.item())))
    assert nu < 1, "the test must exercise the clip"
    for lf, lc in zip(p_free.layers, p_clip.layers):
        assert torch.allclose(lc.grad_matrix(), lf.grad_matrix() * nu, rtol=1e-5, atol=1e-8)
    # A large trust region leaves the step alone.
    big, _ = one_step(copy.deepcopy(model), x, y, kl_clip=1e6, lr=0.5)
    for lf, lb in zip(p_free.layers, big.layers):
        assert torch.equal(lf.grad_matrix(), lb.grad_matrix())


def test_other_parameters_are_untouched_and_skip_rules_work():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    precond = KFACPreconditioner(model, skip_layers=[r"^2$"])
    assert [l.name for l in precond.layers] == ["0"]
    assert [l.name for l in KFACPreconditioner(copy.deepcopy(model), skip_layers="^0$").layers] == ["2"]
    with pytest.raises(ValueError, match="no nn.Linear"):
        KFACPreconditioner(copy.deepcopy(model), skip_layers=[nn.Linear])
    with pytest.raises(ValueError, match="no nn.Linear"):
        KFACPreconditioner(copy.deepcopy(model), skip_layers=["Linear"])  # class names match too
    model.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(6, 4)), torch.randint(0, 3, (6,))).backward()
    ln = model[1].weight.grad.clone()
    last = model[2].weight.grad.clone()
    precond.step()
    assert torch.equal(model[1].weight.grad, ln) and torch.equal(model[2].weight.grad, last)


def test_schedules_are_functions_of_the_step():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(3, 2))
    seen = []

    def damping(step):
        seen.append(step)
        return 0.1 / (step + 1)

    precond = KFACPreconditioner(model, damping=damping, inv_update_steps=lambda s: 1, prediv=False)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        precond.step()
    assert set(seen) == {0, 1, 2}
    bad = KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), damping=lambda s: -1.0)
    bad.model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(ValueError, match="damping"):
        bad.step()


# --------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_resumes_bitwise():
    torch.manual_seed(9)
    base = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))
    x, y = torch.randn(7, 5, 1, 4, 4), torch.randint(0, 3, (7, 5))
    args = dict(factor_update_steps=2, inv_update_steps=4, damping=0.03)

    def run(model, opt, precond, steps):
        for t in steps:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[t]), y[t]).backward()
            precond.step()
            opt.step()

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, **args)
    run(model, opt, precond, range(3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), precond.state_dict()))
    run(model, opt, precond, range(3, 7))

    model2 = copy.deepcopy(base)
    model2.load_state_dict(saved[0])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved[1])
    precond2 = KFACPreconditioner(model2, **args)
    precond2.load_state_dict(saved[2])
    assert precond2.steps == 3
    for l in precond2.layers:
        assert l.a_factor.dtype == torch.float32
    run(model2, opt2, precond2, range(3, 7))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    for l1, l2 in zip(precond.layers, precond2.layers):
        assert torch.equal(l1.a_factor, l2.a_factor) and torch.equal(l1.g_factor, l2.g_factor)


def test_load_state_dict_validates_before_changing_anything():
    model = nn.Sequential(nn.Linear(3, 2))
    precond = KFACPreconditioner(model)
    model(torch.randn(4, 3)).sum().backward()
    precond.step()
    good = precond.state_dict()
    other = KFACPreconditioner(nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="layers"):
        other.load_state_dict(good)
    bad = copy.deepcopy(good)
    bad["layers"]["0"]["a_factor"] = torch.eye(3)
    fresh = KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="a_factor"):
        fresh.load_state_dict(bad)
    assert fresh.steps == 0 and fresh.layers[0].a_factor is None
    bad = copy.deepcopy(good)
    bad["hyperparameters"]["damping"] = -1.0
    with pytest.raises(ValueError, match="damping"):
        fresh.load_state_dict(bad)
    # Eigen data are checked too: wrong shapes, or the other prediv's names.
    bad = copy.deepcopy(good)
    bad["layers"]["0"]["eigen"]["qa"] = torch.eye(3)
    with pytest.raises(ValueError, match="'qa'"):
        fresh.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["layers"]["0"]["eigen"] = {"qa": torch.eye(4), "qg": torch.eye(2), "da": torch.ones(4), "dg": torch.ones(2)}
    with pytest.raises(ValueError, match="eigen holds"):
        fresh.load_state_dict(bad)
    assert fresh.steps == 0 and fresh.layers[0].a_factor is None and fresh.layers[0].eigen == {}
    # Without eigen data the eigendecomposition is recomputed from the factors.
    slim = precond.state_dict(include_eigen=False)
    fresh.load_state_dict(slim)
    assert set(fresh.layers[0].eigen) == {"qa", "qg", "inv_denominator"}
    assert torch.allclose(fresh.layers[0].eigen["inv_denominator"], precond.layers[0].eigen["inv_denominator"])


def test_memory_usage_counts_factors_batches_and_eigen():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 4, bias=False))
    precond = KFACPreconditioner(model)
    assert precond.memory_usage()["total"] == 0
    model(torch.randn(5, 3)).sum().backward()
    precond.step()
    dims = [(4, 2), (2, 4)]
    factors = 4 * sum(a * a + g * g for a, g in dims)
    eigen = 4 * sum(a * a + g * g + a * g for a, g in dims)
    assert precond.memory_usage() == {"factors": factors, "batch": factors, "eigen": eigen,
                                      "total": 2 * factors + eigen}


# --------------------------------------------------------------------------- bad input and non-finite values


@pytest.mark.parametrize("kwargs,word", [
    (dict(damping=0.0), "damping"),
    (dict(damping=float("nan")), "damping"),
    (dict(factor_decay=0.0), "factor_decay"),
    (dict(factor_decay=1.5), "factor_decay"),
    (dict(kl_clip=-1.0), "kl_clip"),
    (dict(lr=-0.1), "lr"),
    (dict(factor_update_steps=0), "factor_update_steps"),
    (dict(inv_update_steps=2.5), "inv_update_steps"),
    (dict(on_nonfinite="ignore"), "on_nonfinite"),
    (dict(precision="tf16"), "precision"),
    (dict(skip_layers=[3]), "skip_layers"),
    (dict(g_batch_scale="yes"), "g_batch_scale"),
    (dict(compute_method="cholesky"), "compute_method"),
    (dict(factor_dtype=torch.float64), "factor_dtype"),
    (dict(inv_dtype="bfloat16"), "inv_dtype"),
    (dict(grad_scaler=2.0), "grad_scaler"),
    (dict(independent_ranks=1), "independent_ranks"),
])
def test_bad_hyperparameters_are_named(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), **kwargs)


def test_unsupported_layers_and_empty_models():
    with pytest.raises(UnsupportedLayerError, match="skip_layers"):
        KFACPreconditioner(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)))
    with pytest.raises(UnsupportedLayerError, match="padding_mode"):
        KFACPreconditioner(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect")))
    with pytest.raises(UnsupportedLayerError, match="initialised"):
        KFACPreconditioner(nn.Sequential(nn.LazyLinear(3)))
    assert KFACPreconditioner(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Linear(2, 2)),
                              skip_layers=[nn.Conv2d]).layers[0].name == "1"
    with pytest.raises(ValueError, match="no nn.Linear"):
        KFACPreconditioner(nn.Sequential(nn.ReLU()))
    with pytest.raises(TypeError, match="model"):
        KFACPreconditioner("model")
    with pytest.warns(UserWarning, match="multiple"):
        KFACPreconditioner(nn.Sequential(nn.Linear(2, 2)), factor_update_steps=3, inv_update_steps=4)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("bias", [True, False])
def test_a_conv_layers_gradient_matrix_reads_and_writes_any_memory_layout(memory_format, bias):
    from tritonopt.optim._kfac_layers import make_layer

    conv = nn.Conv2d(3, 5, 2, bias=bias)
    gen = torch.Generator().manual_seed(3)
    weight_grad = torch.randn(conv.weight.shape, generator=gen)
    conv.weight.grad = weight_grad.clone().to(memory_format=memory_format)
    if bias:
        conv.bias.grad = torch.randn(5, generator=gen)
    layer = make_layer("conv", conv)
    matrix = layer.grad_matrix()
    assert matrix.shape == (5, 12 + bias) and matrix.is_contiguous()
    assert torch.equal(matrix[:, :12], weight_grad.reshape(5, 12))
    layer.write_grad(matrix * 2)
    assert torch.equal(conv.weight.grad, 2 * weight_grad)
    assert conv.weight.grad.is_contiguous(memory_format=memory_format)  # written in place
    if bias:
        assert torch.equal(conv.bias.grad, 2 * matrix[:, 12])


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_gradients_change_nothing(policy):
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(3, 2))
    precond = KFACPreconditioner(model, on_nonfinite=policy)
    model(torch.randn(4, 3)).sum().backward()
    precond.step()
    factors = precond.layers[0].a_factor.clone()
    model.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    grad = model[0].weight.grad.clone()
    if policy == "raise":
        with pytest.raises(FloatingPointError):
            precond.step()
    else:
        with pytest.warns(RuntimeWarning, match="skipped"):
            precond.step()
        assert precond.skipped_steps == 1
    assert precond.steps == 1
    assert torch.equal(precond.layers[0].a_factor, factors)
    assert torch.equal(torch.nan_to_num(model[0].weight.grad), torch.nan_to_num(grad))


def test_nonfinite_factors_skip_the_eigen_update():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(3, 2))
    precond = KFACPreconditioner(model)
    model(torch.randn(4, 3)).sum().backward()
    precond.step()
    state = precond.state_dict(include_eigen=False)
    state["layers"]["0"]["g_factor"][0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match="eigen update was skipped"):
        precond.load_state_dict(state)
    assert precond.layers[0].eigen == {}
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(4, 3)).sum().backward()
        grad = precond.layers[0].grad_matrix()
        precond.step()  # factor update folds finite statistics onto inf: still refused by eigen
    after = precond.layers[0].grad_matrix()
    assert torch.isfinite(after).all()
    # No eigenbasis: the gradient passes through, only scaled by the KL clip.
    assert torch.allclose(after / after.norm(), grad / grad.norm(), atol=1e-6)


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
def test_gpu_triton_and_reference_preconditioners_agree_on_a_real_layer():
    """A 1024-wide MLP on CUDA: the Triton path (tf32x3) tracks the reference (fp32 cuBLAS)."""
    torch.manual_seed(12)
    dev = torch.device("cuda")
    base = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1000)).to(dev)
    x = torch.randn(5, 256, 1024, device=dev)
    y = torch.randint(0, 1000, (5, 256), device=dev)
    grads = {}
    for backend in ("triton", "reference"):
        model = copy.deepcopy(base)
        with tritonopt.use_backend(backend):
            precond = KFACPreconditioner(model, damping=3e-3, kl_clip=None, inv_update_steps=2)
            for t in range(5):
                model.zero_grad()
                nn.functional.cross_entropy(model(x[t]), y[t]).backward()
                precond.step()
        grads[backend] = [l.grad_matrix() for l in precond.layers]
    for ours, ref in zip(grads["triton"], grads["reference"]):
        assert (ours - ref).norm() <= 1e-3 * ref.norm()
