"""K-FAC with inputs a careless user gives: huge gradients, float64 models, empty batches, DDP,
layers whose hooks never run, copies and tampered checkpoints."""

import copy
import io
import math
import pickle
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tritonopt
from tritonopt.dist.kaisa import KAISAPreconditioner
from tritonopt.optim.kfac import KFACPreconditioner


@pytest.fixture(autouse=True)
def reference_backend():
    with tritonopt.use_backend("reference"):
        yield


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def backward(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    nn.functional.cross_entropy(model(x), y).backward()


def train(model, opt, kfac, steps):
    for t in steps:
        opt.zero_grad()
        backward(model, t)
        if kfac.step():
            opt.step()


def snapshot(kfac):
    """Everything a step could change, cloned: counters, factors, eigen data, gradients."""
    return copy.deepcopy({
        "steps": kfac.steps,
        "layers": [(l.a_factor, l.g_factor, dict(l.eigen)) for l in kfac.layers],
        "grads": [p.grad for p in kfac.model.parameters()],
    })


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        assert torch.equal(a.isnan(), b.isnan())
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def float64_preconditioned(layer, grad, damping):
    """``nu``-free ``P`` from the layer's eigen data, in float64."""
    e = {k: v.double() for k, v in layer.eigen.items()}
    rotated = e["qg"].T @ grad @ e["qa"]
    return e["qg"] @ (rotated * e["inv_denominator"]) @ e["qa"].T


# --------------------------------------------------------------------------- huge gradients


@pytest.mark.parametrize("magnitude", [1e20, 1e25])
def test_a_huge_finite_gradient_is_preconditioned_not_zeroed_or_nan(magnitude):
    model = make_mlp()
    kfac = KFACPreconditioner(model, damping=1e-3, kl_clip=1e-3, lr=0.1)
    for t in range(3):
        model.zero_grad()
        backward(model, t)
        kfac.step()
    model.zero_grad()
    backward(model, 3)
    gen = torch.Generator().manual_seed(4)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * magnitude
    raw = {l.name: l.grad_matrix().double() for l in kfac.layers}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kfac.step() is True
    # The float64 oracle of the same formula: nu P with nu from <P, grad> in float64.
    expected = {l.name: float64_preconditioned(l, raw[l.name], 1e-3) for l in kfac.layers}
    inner = sum((expected[n] * raw[n]).sum() for n in expected)
    nu = min(1.0, math.sqrt(1e-3 / (0.1**2 * abs(inner.item()))))
    assert torch.isfinite(kfac.last_kl_scale) and 0 < kfac.last_kl_scale.item() < 1
    assert kfac.last_kl_scale.item() == pytest.approx(nu, rel=1e-5)
    for layer in kfac.layers:
        got = layer.grad_matrix().double()
        want = nu * expected[layer.name]
        assert torch.isfinite(got).all() and got.abs().max() > 0
        # fp32 rotations of a gradient whose directions D amplifies by up to max(D)/min(D).
        d = layer.eigen["inv_denominator"].double()
        tolerance = 8 * max(layer.a_dim, layer.g_dim) * 2.0**-24 * (d.max() / d.min()).item()
        assert (got - want).norm() <= tolerance * want.norm(), layer.name


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_gradient_too_large_to_precondition_changes_nothing(policy):
    model = make_mlp()
    # Factors close to their batch statistics: G of the last layer is singular (softmax rows
    # sum to 0), so D = 1 / (dG dA^T + damping) reaches about 1 / damping.
    kfac = KFACPreconditioner(model, damping=1e-6, factor_decay=0.01, on_nonfinite=policy)
    for t in range(2):
        model.zero_grad()
        backward(model, t)
        kfac.step()
    assert kfac.layers[1].eigen["inv_denominator"].max() > 1e4
    model.zero_grad()
    backward(model, 2)
    # Finite, but P ~ D grad overflows float32.
    model[2].weight.grad = torch.randn(model[2].weight.shape, generator=torch.Generator().manual_seed(0)) * 1e35
    before = snapshot(kfac)
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="overflow float32"):
            kfac.step()
    else:
        with pytest.warns(RuntimeWarning, match="overflow float32"):
            assert kfac.step() is False
        assert kfac.skipped_steps == 1
    assert_same(before, snapshot(kfac))


def _second_step_backward(kfac, model):
    """One accepted step (an eigen update), then the next step's forward and backward."""
    model.zero_grad()
    backward(model, 0)
    assert kfac.step() is True
    model.zero_grad()
    backward(model, 1)


@pytest.mark.parametrize("eigen_step", [False, True], ids=["plain step", "eigen step"])
@pytest.mark.parametrize("poisoned", ["gradient", "statistic"])
def test_a_refused_step_names_the_layer_and_what_is_not_finite(poisoned, eigen_step):
    model = make_mlp()
    kfac = KFACPreconditioner(model, inv_update_steps=1 if eigen_step else 10, on_nonfinite="raise")
    _second_step_backward(kfac, model)
    if poisoned == "gradient":
        model[2].bias.grad[1] = float("inf")
        expected = r"the gradients of layers \['2'\] hold NaN or inf"
    else:
        kfac.layers[1].g_batch[0, 0] = float("nan")
        expected = r"the factor statistics of layers \['2'\] hold NaN or inf"
    before = snapshot(kfac)
    with pytest.raises(FloatingPointError, match=expected):
        kfac.step()
    assert_same(before, snapshot(kfac))


@pytest.mark.parametrize("eigen_step", [False, True], ids=["plain step", "eigen step"])
def test_finite_statistics_whose_float32_trace_overflows_are_not_refused(eigen_step):
    """The statistics' one probe adds float32 traces, which can overflow on finite entries:
    then the exact per-matrix probes decide, and they find nothing to refuse. (A plain step
    probes the statistics after folding them into the factors, eigen steps before.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 3))
    kfac = KFACPreconditioner(model, inv_update_steps=1 if eigen_step else 10, on_nonfinite="raise")
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        model.zero_grad()
        x, y = torch.randn(8, 40, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        if kfac.steps == 0:
            assert kfac.step() is True
    statistic = kfac.layers[0].a_batch
    # 41 diagonal entries of 0.9 * float32's largest: even folded with weight 0.05 they add up
    # past float32's range, while every entry stays finite.
    statistic.diagonal().fill_(0.9 * torch.finfo(torch.float32).max)
    assert torch.isfinite(statistic).all() and not torch.isfinite(torch.trace(0.05 * statistic))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eigen update of so large a factor may warn; not refused
        assert kfac.step() is True
    assert kfac.steps == 2 and kfac.skipped_steps == 0
    assert kfac.layers[0].a_factor[0, 0] > 1e36  # the huge statistic was folded in


def test_the_readme_loop_does_not_apply_a_refused_step():
    model = make_mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFACPreconditioner(model)
    train(model, sgd, kfac, range(2))
    params = [p.detach().clone() for p in model.parameters()]
    sgd.zero_grad()
    backward(model, 2)
    model[2].bias.grad[0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        usable = kfac.step()
    assert usable is False
    if usable:
        sgd.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    sgd.zero_grad()
    backward(model, 3)
    assert kfac.step() is True


# --------------------------------------------------------------------------- dtypes and batches


@pytest.mark.parametrize("cls", [KFACPreconditioner, KAISAPreconditioner])
def test_a_float64_model_is_refused_at_construction(cls):
    with pytest.raises(TypeError, match=r"layer '0' has torch.float64 parameters"):
        cls(nn.Sequential(nn.Linear(3, 2)).double())
    # A model converted after construction: the hook records it, step() says so.
    model = nn.Sequential(nn.Linear(3, 2))
    kfac = KFACPreconditioner(model)
    model.double()
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()  # no error from inside a hook
    with pytest.raises(ValueError, match="float64 input"):
        kfac.step()
    assert kfac.steps == 0 and kfac.layers[0].a_factor is None


def test_an_empty_batch_is_reported_not_raised_from_a_hook():
    model = make_mlp()
    kfac = KFACPreconditioner(model)
    model(torch.randn(0, 4)).sum().backward()  # used to fail inside the forward hook
    with pytest.warns(RuntimeWarning, match="empty batch"):
        assert kfac.step() is True
    assert all(l.a_factor is None for l in kfac.layers), "an empty batch has no statistics"
    model.zero_grad()
    backward(model, 0)
    assert kfac.step() is True and all(l.a_factor is not None for l in kfac.layers)


# --------------------------------------------------------------------------- a loss scale K-FAC was not told


def scaler_run(cls, *, scaled=True, grad_scaler_argument=False, dtype=None, between=None, steps=5):
    """The README's loop with a ``GradScaler`` (``scaled``), passed as ``grad_scaler=`` or not, the
    forward under ``torch.autocast(dtype)`` when ``dtype`` is given; ``between(model, step)`` runs
    between ``scaler.unscale_`` and ``kfac.step()``. Returns the loss-scale warnings and the steps taken."""
    model = make_mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    kfac = cls(model, grad_scaler=scaler if grad_scaler_argument else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            sgd.zero_grad()
            gen = torch.Generator().manual_seed(t)
            x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(sgd)
            if between is not None:
                between(model, t)
            if kfac.step():
                scaler.step(sgd)
            scaler.update()
    return [w for w in caught if "grad_scaler=" in str(w.message)], kfac.steps


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
@pytest.mark.parametrize("cls", [KFACPreconditioner, KAISAPreconditioner])
def test_a_grad_scaler_not_passed_as_grad_scaler_is_reported_once(cls, dtype):
    reported, steps = scaler_run(cls, dtype=dtype)
    assert steps == 5
    assert len(reported) == 1 and reported[0].category is RuntimeWarning
    assert "2^16 times" in str(reported[0].message)


@pytest.mark.parametrize("case", ["no_scaler", "grad_scaler_passed", "disabled_scaler", "clipped",
                                  "accumulated", "one_step_scaled_by_a_power_of_two"])
def test_no_loss_scale_is_reported_where_there_is_none(case):
    def clip(model, t):
        nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # a large factor, not a power of two

    def accumulate(model, t):  # the gradients of earlier steps are still in .grad
        if t == 0:
            accumulate.kept = [p.grad.clone() for p in model.parameters()]
        for p, kept in zip(model.parameters(), accumulate.kept):
            p.grad.add_(kept)

    def one_step(model, t):  # 2^8 on one step only: a coincidence, not a loss scale
        if t == 2:
            for p in model.parameters():
                p.grad.div_(256)

    options = {
        "no_scaler": dict(scaled=False),
        "grad_scaler_passed": dict(grad_scaler_argument=True),
        "disabled_scaler": dict(scaled=False, grad_scaler_argument=True),
        "clipped": dict(scaled=False, between=clip),
        "accumulated": dict(scaled=False, between=accumulate),
        "one_step_scaled_by_a_power_of_two": dict(scaled=False, between=one_step),
    }[case]
    for dtype in (None, torch.bfloat16):
        reported, steps = scaler_run(KFACPreconditioner, dtype=dtype, **options)
        assert reported == [] and steps == 5


# --------------------------------------------------------------------------- layers, DDP


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0])


def test_a_layer_whose_hooks_never_run_is_reported_once():
    torch.manual_seed(0)
    model = Attention()
    kfac = KFACPreconditioner(model)
    assert [l.name for l in kfac.layers] == ["attn.out_proj", "head"]
    model(torch.randn(2, 3, 4)).sum().backward()
    with pytest.warns(RuntimeWarning, match=r"\['attn.out_proj'\].*skip_layers"):
        kfac.step()
    model.zero_grad()
    model(torch.randn(2, 3, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kfac.step()
    KFACPreconditioner(Attention(), skip_layers=["out_proj"])  # the documented way out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_data_parallel_models_are_refused_with_a_pointer_to_kaisa(one_rank_world):
    ddp = nn.parallel.DistributedDataParallel(make_mlp())
    with pytest.raises(ValueError, match="KAISAPreconditioner"):
        KFACPreconditioner(ddp)
    with pytest.raises(ValueError, match="KAISAPreconditioner"):
        KFACPreconditioner(nn.DataParallel(make_mlp()))
    kaisa = KAISAPreconditioner(ddp)  # the distributed entry takes it
    assert [l.name for l in kaisa.layers] == ["module.0", "module.2"]
    backward(ddp, 0)
    assert kaisa.step() is True


def test_kaisa_in_one_process_is_kfac():
    runs = []
    for cls in (KFACPreconditioner, KAISAPreconditioner):
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, cls(model, inv_update_steps=2, damping=0.03), range(4))
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(*runs)


# --------------------------------------------------------------------------- copies and checkpoints


def test_deepcopy_pickle_and_weights_only_checkpoints_resume_bit_for_bit():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2, damping=0.03)
    train(model, opt, kfac, range(3))
    copies = [copy.deepcopy((model, opt, kfac)), pickle.loads(pickle.dumps((model, opt, kfac)))]
    buffer = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict(), kfac.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    loaded_model = make_mlp(seed=1)
    loaded_model.load_state_dict(saved[0])
    loaded_opt = torch.optim.SGD(loaded_model.parameters(), lr=0.1, momentum=0.9)
    loaded_opt.load_state_dict(saved[1])
    loaded = KFACPreconditioner(loaded_model, factor_update_steps=2, inv_update_steps=2, damping=0.03)
    loaded.load_state_dict(saved[2])
    copies.append((loaded_model, loaded_opt, loaded))

    train(model, opt, kfac, range(3, 7))
    for m, o, k in copies:
        assert k.model is m and all(l.module in set(m.modules()) for l in k.layers)
        train(m, o, k, range(3, 7))
        for p, q in zip(model.parameters(), m.parameters()):
            assert torch.equal(p, q)
        for l1, l2 in zip(kfac.layers, k.layers):
            assert torch.equal(l1.a_factor, l2.a_factor) and torch.equal(l1.g_factor, l2.g_factor)


def _tampered(good):
    def edit(fn):
        bad = copy.deepcopy(good)
        fn(bad)
        return bad

    sgd = torch.optim.SGD(make_mlp().parameters(), lr=0.1).state_dict()
    inverse = copy.deepcopy(good)
    inverse["compute_method"] = "inverse"
    return [
        (sgd, "state_dict must be a dict"),
        (edit(lambda s: s.pop("steps")), "state_dict must be a dict"),
        (edit(lambda s: s["layers"]["0"].pop("a_factor")), "has no 'a_factor'"),
        (edit(lambda s: s["layers"]["2"].__setitem__("g_factor", torch.eye(4))), "g_factor has shape"),
        (edit(lambda s: s["layers"]["2"].__setitem__("a_factor", torch.eye(7, dtype=torch.int64))), "a_factor must be"),
        (edit(lambda s: s["layers"]["0"]["eigen"].__setitem__("qa", torch.eye(3))), "'qa'"),
        (edit(lambda s: s["layers"]["0"].__setitem__("g_factor", None)), "both be saved"),
        (edit(lambda s: s.__setitem__("steps", -1)), "steps"),
        (edit(lambda s: s.__setitem__("steps", "3")), "steps"),
        (edit(lambda s: s["hyperparameters"].__setitem__("damping", 0.0)), "damping"),
        (edit(lambda s: s["layers"].pop("2")), "layers"),
        (inverse, "compute_method"),
    ]


def test_tampered_state_dicts_are_refused_before_anything_changes():
    model = make_mlp()
    kfac = KFACPreconditioner(model)
    backward(model, 0)
    kfac.step()
    good = kfac.state_dict()
    target = KFACPreconditioner(make_mlp(seed=1))
    backward(target.model, 1)
    target.step()
    before = copy.deepcopy(target.state_dict())
    for bad, message in _tampered(good):
        with pytest.raises((ValueError, TypeError), match=message):
            target.load_state_dict(bad)
        assert_same(before, target.state_dict())
    target.load_state_dict(good)
    assert_same(good, target.state_dict())


def test_kaisa_refuses_copies_but_its_model_can_be_copied():
    model = make_mlp()
    kaisa = KAISAPreconditioner(model)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(kaisa)
    twin = copy.deepcopy(model)  # the copy carries no K-FAC hooks that feed the original
    backward(twin, 0)
    assert kaisa.pending_statistics() == []


def test_the_loss_scale_watch_ends_after_its_window():
    """Without a scaler, the hooks' extra sums and step()'s comparison stop after the watch window,
    so a long run does not keep paying for a check that found nothing."""
    from tritonopt.optim._kfac_capture import _LOSS_SCALE_WATCH_STEPS

    model = make_mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFACPreconditioner(model)
    train(model, sgd, kfac, range(_LOSS_SCALE_WATCH_STEPS - 1))
    assert kfac.watches_loss_scale() and any(layer.g_sum is not None for layer in kfac.layers)
    train(model, sgd, kfac, range(_LOSS_SCALE_WATCH_STEPS - 1, _LOSS_SCALE_WATCH_STEPS + 2))
    assert not kfac.watches_loss_scale() and all(layer.g_sum is None for layer in kfac.layers)
