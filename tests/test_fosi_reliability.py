"""FOSI's promises to a user who makes mistakes: undone steps leave no trace, copies and checkpoints
resume bit for bit, bad state and bad hyperparameters are refused before anything changes, and a
step synchronises with the host once."""

import copy
import io
import pickle

import pytest
import torch
from _fosi_problems import HostReads, flat, make_problem, set_grads, train, one_thread  # noqa: F401  (fixture)

import tritonopt
from tritonopt.optim.fosi import FOSI

SETTINGS = dict(lr=1e-2, k=2, l=1, warmup_steps=1, curvature_update_every=4, num_lanczos_iters=12,
                g1_momentum=0.9, learning_rate_clip=3.0)


def build(seed=2, **overrides):
    model, loss_fn = make_problem(seed)
    opt = FOSI(model.parameters(), curvature_loss_fn=loss_fn, **{**SETTINGS, **overrides})
    return model, loss_fn, opt


def assert_same_run(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    assert torch.equal(flat(model_a), flat(model_b))
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    for pid, entry in state_a["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, state_b["state"][pid][name]), name
    for key, value in state_a["fosi"].items():
        other = state_b["fosi"][key]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key


def test_an_undone_overflowing_step_at_an_ese_leaves_the_run_as_if_it_never_happened():
    # The step that is undone runs the ESE first: its eigenpairs, ese_count and velocity must go too.
    runs = {}
    for with_bad_step in (False, True):
        model, loss_fn, opt = build()
        with tritonopt.use_backend("reference"):
            train(model, opt, loss_fn, 5)  # ESE before updates 1 and 5: the next step runs one
            if with_bad_step:
                set_grads(model, loss_fn)
                for p in model.parameters():  # finite, but Adam's second moment overflows
                    p.grad.mul_(1e25 / p.grad.abs().max().clamp_min(1e-30))
                with pytest.warns(RuntimeWarning, match="undone"):
                    opt.step()
                assert opt.skipped_steps == 1 and opt.ese_count == 1
            train(model, opt, loss_fn, 6)
        opt.skipped_steps = 0
        runs[with_bad_step] = (model, opt)
    assert_same_run(runs[False], runs[True])


def test_a_bad_learning_rate_set_after_construction_changes_nothing():
    model, loss_fn, opt = build()
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 3)
    before = (flat(model), copy.deepcopy(opt.state_dict()))
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), (torch.tensor(0.1), TypeError)):
        opt.param_groups[0]["lr"] = bad
        set_grads(model, loss_fn)
        with pytest.raises(error, match="lr"):
            opt.step()
        assert torch.equal(flat(model), before[0])
        after = opt.state_dict()
        assert after["fosi"]["base_step"] == before[1]["fosi"]["base_step"] == 3
        for pid, entry in before[1]["state"].items():
            for name, value in entry.items():
                assert torch.equal(after["state"][pid][name], value), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp's no_dist, as meant
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "state_dict", "torch.distributed.checkpoint"])
def test_copies_and_checkpoints_resume_bit_for_bit(how, tmp_path):
    model, loss_fn, opt = build()
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 6)  # mid-run: curvature installed, velocity non-zero
        if how == "deepcopy":
            model2, opt2 = copy.deepcopy((model, opt))  # the loss object is copied with its model
        elif how == "pickle":
            model2, opt2 = pickle.loads(pickle.dumps((model, opt)))  # the loss travels with its model
        elif how == "torch.distributed.checkpoint":
            # It keeps only state and param_groups, so FOSI's global state must travel in the groups.
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            dcp.save({"model": model.state_dict(), "opt": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=tmp_path, no_dist=True)
            model2, _, opt2 = build()
            template = {"model": model2.state_dict(), "opt": get_optimizer_state_dict(model2, opt2)}
            dcp.load(template, checkpoint_id=tmp_path, no_dist=True)
            model2.load_state_dict(template["model"])
            set_optimizer_state_dict(model2, opt2, template["opt"])
        else:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            model2, _, opt2 = build()
            model2.load_state_dict(saved["model"])
            opt2.load_state_dict(saved["opt"])
        assert opt2.config == opt.config and opt2.param_groups[0]["lr"] == SETTINGS["lr"]
        assert opt2.ese_count == opt.ese_count == 2 and opt2.eigenvalues.numel() == 3
        train(model, opt, loss_fn, 5)  # another ESE at update 9
        train(model2, opt2, opt2.curvature_loss_fn, 5)
    assert_same_run((model, opt), (model2, opt2))


def test_pickles_hold_the_state_once():
    model, loss_fn = make_problem(sizes=(6, 400, 3))
    opt = FOSI(model.parameters(), curvature_loss_fn=loss_fn, **SETTINGS)
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 3)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Each parameter's state is a view of a flat buffer (4 views here); the pickle must not
    # store the whole buffer once per view.
    assert len(pickle.dumps(opt)) < 1.5 * state_bytes + 2 * params_bytes


def tampered(good, edit):
    bad = copy.deepcopy(good)
    edit(bad)
    return bad


def foreign_adam_state():
    model, loss_fn = make_problem(2)
    adam = torch.optim.Adam(model.parameters())
    set_grads(model, loss_fn)
    adam.step()
    return adam.state_dict()


@pytest.mark.parametrize("edit, match", [
    (lambda s: (s.pop("fosi"), s["param_groups"][0].pop("fosi")), "no 'fosi' entry"),
    (lambda s: s["fosi"].pop("base_step"), "lacks"),
    (lambda s: s["state"][0].pop("exp_avg_sq"), "keeps"),
    (lambda s: s["state"][0].__setitem__("exp_avg", torch.zeros(3)), "shape"),
    (lambda s: s["state"][1].__setitem__("exp_avg", torch.full_like(s["state"][1]["exp_avg"], float("nan"))),
     "finite"),
    (lambda s: s["state"][2].__setitem__("eigenvectors", s["state"][2]["eigenvectors"][:2]), "shape"),
    (lambda s: s["fosi"].__setitem__("eigenvalues", torch.ones(5, dtype=torch.float64)), "at most k \\+ l"),
    (lambda s: s["fosi"].__setitem__("g1_velocity", torch.zeros(7)), "g1_velocity"),
    (lambda s: s["fosi"].__setitem__("step", -1), "step"),
    # The copy in the first parameter group (what torch.distributed.checkpoint keeps) must agree.
    (lambda s: s["param_groups"][0]["fosi"].__setitem__("ese_count", 7), "holds the same value in both"),
    (lambda s: s["param_groups"].append(dict(s["param_groups"][0])), "parameter groups"),
    (lambda s: s["param_groups"][0].__setitem__("lr", -1.0), "lr"),
])
def test_a_tampered_state_dict_is_refused_before_anything_changes(edit, match):
    model, loss_fn, opt = build()
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 3)
    good = copy.deepcopy(opt.state_dict())
    target_model, target_loss, target = build(seed=5, lr=5e-2)
    with tritonopt.use_backend("reference"):
        train(target_model, target, target_loss, 2)
    before = (flat(target_model), copy.deepcopy(target.state_dict()))
    with pytest.raises((TypeError, ValueError), match=match):
        target.load_state_dict(tampered(good, edit))
    assert torch.equal(flat(target_model), before[0])
    after = target.state_dict()
    assert after["param_groups"] == before[1]["param_groups"] and after["fosi"]["step"] == 2
    for pid, entry in before[1]["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][pid][name], value), name
    target.load_state_dict(good)  # the untouched one loads
    assert target.param_groups[0]["lr"] == SETTINGS["lr"] and target.ese_count == opt.ese_count


def test_another_optimizers_state_or_base_is_refused():
    model, loss_fn, opt = build()
    with pytest.raises(ValueError, match="not saved by FOSI"):
        opt.load_state_dict(foreign_adam_state())
    other_model, other_loss, heavy_ball = build(base="heavy_ball", learning_rate_clip=1.0)
    with tritonopt.use_backend("reference"):
        train(other_model, heavy_ball, other_loss, 2)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(heavy_ball.state_dict())
    assert not opt.state and opt.eigenvalues.numel() == 0


def test_one_host_read_per_step_and_one_per_lanczos_iteration():
    model, loss_fn, opt = build(g1_momentum=0.0, learning_rate_clip=1.0)
    m = SETTINGS["num_lanczos_iters"]
    reads = []
    with tritonopt.use_backend("reference"):
        for _ in range(6):  # ESE before updates 1 and 5
            set_grads(model, loss_fn)
            with HostReads() as counter:
                opt.step()
            reads.append(counter.count)
    plain = [r for i, r in enumerate(reads) if i not in (1, 5)]
    # The first step also reads the (just built) state's largest entry, in the same read.
    assert plain == [1, 1, 1, 1], reads
    # An ESE step: one read per Lanczos iteration (m - 1 of them), the diagonal of B once,
    # and a few host-side numbers of the m x m eigendecomposition (CPU data, not device syncs).
    assert all(reads[i] <= m + 6 for i in (1, 5)), reads


def test_a_checkpoint_holds_k_plus_l_basis_rows_whatever_the_ritz_values_found():
    # Before the first ESE there is no basis (r = 0): the state dict pads each parameter's rows of V with zeros to
    # k + l, the shape every checkpoint of these settings has (torch.distributed.checkpoint loads into a fresh
    # optimizer's template of that shape), and a load keeps the first r rows.
    model, loss_fn, opt = build()
    with tritonopt.use_backend("reference"):
        train(model, opt, loss_fn, 1)
        saved = opt.state_dict()
        assert opt.eigenvalues.numel() == 0 and opt.state[model[0].weight]["eigenvectors"].shape[0] == 0
        rows = SETTINGS["k"] + SETTINGS["l"]
        for entry in saved["state"].values():
            assert entry["eigenvectors"].shape[0] == rows and not entry["eigenvectors"].any()
        model2, _, opt2 = build()
        model2.load_state_dict(model.state_dict())
        opt2.load_state_dict(copy.deepcopy(saved))
        assert opt2.state[model2[0].weight]["eigenvectors"].shape[0] == 0
        train(model, opt, loss_fn, 6)  # the ESEs before updates 1 and 5
        train(model2, opt2, opt2.curvature_loss_fn, 6)
    assert_same_run((model, opt), (model2, opt2))
