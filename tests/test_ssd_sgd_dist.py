"""SSD-SGD on gloo ranks against a float64 single-process oracle of Algorithms 1 and 2 plus the server.

One spawn of 4 ranks for the module: the 4-rank scenarios run on the world,
then the 2-rank ones on the pairs {0, 1} and {2, 3} at once (each process
pays torch's optimizer import once). Each rank returns what it saw and the
tests assert in the parent, on both pairs.
"""

import copy
import datetime
import io
import pickle
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks
from _helpers import flat
from conftest import backend_device
from torch import nn

import tritonopt
from tritonopt.dist import SSDSGD

IN, HIDDEN, OUT, BATCH = 5, 6, 3, 4
WARMUP = 4  # the paper's wp + 1
GROUP0 = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)  # GLU settings: the defaults (alpha 2, beta 0.5, 4 lr)
GROUP1 = dict(lr=0.08, momentum=0.8, weight_decay=1e-2, glu_alpha=1.5, glu_beta=0.7, local_lr_mult=3.0,
              local_weight_decay=5e-3)
LR_DROP = WARMUP + 2  # the schedule changes both groups' lr inside the first delay window
DELAYS = (1, 3, 5)
EXACT = 1e-12  # float64 max-abs bound on the difference from the oracle
EARLY_STOP_TIMEOUT = 2.0  # seconds, the process-group timeout of the early-stop scenario
OWN_TIMEOUT = 2.0  # seconds, SSDSGD's own timeout in the stall scenario (its group's is torch's 30 minutes)
REFUSAL_GROUP_TIMEOUT = 10.0  # seconds: bounds a wait on a rank that refused, were the refusal not shared
# An lr whose CRC-32 agreed with 0.05's on the 16 bits the agreement check once carried.
LR_CRC16_TWIN = 0.05002274500000001


def make_model(dtype=torch.float64, seed=0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(HIDDEN))
    return nn.Sequential(*layers).to(dtype)


def batch(rank, t, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(BATCH, IN, generator=gen, dtype=dtype), torch.randn(BATCH, OUT, generator=gen, dtype=dtype)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def lr_at(t, base):
    return base * (0.6 if t >= LR_DROP else 1.0)


def param_groups(model, same_lr=False):
    first, last = list(model[0].parameters()), list(model[-1].parameters())
    return [dict(params=first, **GROUP0), dict(params=last, **(GROUP0 if same_lr else GROUP1))]


def group_scalars(t, k):
    """Per group: (flat slice, the scalars of iteration t), as SSDSGD resolves them."""
    n0 = HIDDEN * IN + HIDDEN
    out = []
    for sl, g in ((slice(0, n0), GROUP0), (slice(n0, None), GROUP1)):
        lr, m = lr_at(t, g["lr"]), g["momentum"]
        out.append((sl, dict(lr=lr, m=m, wd=g["weight_decay"], L=g.get("local_lr_mult", 4.0) * lr,
                             wd_loc=g.get("local_weight_decay", g["weight_decay"]),
                             alpha=g.get("glu_alpha", 2.0), beta=g.get("glu_beta", 0.5), k=k)))
    return out


# --------------------------------------------------------------------------- the oracle


def grad_at(w, rank, t):
    model = make_model()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(w.clone(), model.parameters())
    loss_of(model, *batch(rank, t)).backward()
    return flat(p.grad for p in model.parameters())


def oracle(world, steps, k, wp1):
    """Algorithm 1 + Algorithm 2 (descent sign) + the MXNet momentum-SGD server, K virtual workers.

    Returns, per iteration: the server's weight, each worker's device weight and local weight.
    """
    w = flat(make_model().parameters())
    mom = torch.zeros_like(w)
    dev = [w.clone() for _ in range(world)]
    local = pre = None
    loc_update = 0
    out = []
    for t in range(steps):
        g = [grad_at(dev[i], i, t) for i in range(world)]
        gbar = sum(g) / world
        scalars = group_scalars(t, k)
        for sl, s in scalars:  # every push, synchronous aggregation
            mom[sl].mul_(s["m"]).add_(gbar[sl] + s["wd"] * w[sl], alpha=-s["lr"])
            w[sl].add_(mom[sl])
        if t < wp1:  # warm-up: SSGD, pull every iteration
            dev = [w.clone() for _ in range(world)]
            out.append(dict(global_=w.clone(), dev=[d.clone() for d in dev], local=[d.clone() for d in dev]))
            continue
        if local is None:  # Alg. 1 line 10 / Alg. 2 line 2
            local = [d.clone() for d in dev]
            pre = [d.clone() for d in dev]
        j = t - wp1
        for i in range(world):
            new_pre = pre[i].clone()
            for sl, s in scalars:
                c = (1 - s["m"]) / (s["lr"] * k)
                grad_sync = c * (pre[i][sl] - local[i][sl])
                if loc_update > 0 and loc_update % k == 0:
                    new_pre[sl] = local[i][sl]
                local[i][sl] = local[i][sl] - s["L"] * (
                    s["alpha"] * g[i][sl] + s["wd_loc"] * local[i][sl] + s["beta"] * grad_sync)
            pre[i] = new_pre
        loc_update += 1
        dev = [lw.clone() for lw in local]  # broadcast the locally updated weight
        if j % k == k - 1:
            local = [w.clone() for _ in range(world)]  # pull, consumed by the next local update
        out.append(dict(global_=w.clone(), dev=[d.clone() for d in dev], local=[lw.clone() for lw in local]))
    return out


# --------------------------------------------------------------------------- rank-side scenarios


def train_step(model, opt, rank, t, dtype=torch.float64):
    for group, base in zip(opt.param_groups, (GROUP0["lr"], opt.param_groups[1]["initial"])):
        group["lr"] = lr_at(t, base)
    opt.zero_grad()
    loss_of(model, *batch(rank, t, dtype)).backward()
    opt.step()


def build(model, k, wp1, comm="shadow", same_lr=False, group=None, **kw):
    opt = SSDSGD(param_groups(model, same_lr), lr=GROUP0["lr"], momentum=GROUP0["momentum"],
                 weight_decay=GROUP0["weight_decay"], delay_steps=k, warmup_steps=wp1, comm=comm,
                 process_group=group, **kw)
    opt.param_groups[1]["initial"] = opt.param_groups[1]["lr"]
    return opt


def exactness_run(rank, group, k, wp1, steps, comm):
    model = make_model()
    opt = build(model, k, wp1, comm, group=group)
    records, syncs = [], 0
    for t in range(steps):
        train_step(model, opt, rank, t)
        rec = dict(dev=flat(model.parameters()))
        done = opt.steps - wp1
        if done <= 0:
            rec["global"] = flat(opt.global_parameters())
        elif done % k == 0:
            syncs += 1
            if syncs % 2 == 0 or comm == "per_step":  # odd syncs are consumed by step() without finalize()
                opt.finalize()
                rec["global"] = flat(opt.global_parameters())
        records.append(rec)
    stats = {label: vars(s) for label, s in opt.comm.stats().items()}
    return dict(records=records, stats=stats, numel=sum(p.numel() for p in model.parameters()))


def warmup_only_run(rank, group):
    model = make_model()
    opt = build(model, 3, 100, group=group)
    out = []
    for t in range(6):
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
        out.append(flat(model.parameters()))
    return out


def closed_form_run(rank, group, identical_batches):
    model = make_model()
    opt = SSDSGD(model.parameters(), lr=0.1, momentum=0.0, weight_decay=1e-2, delay_steps=1, warmup_steps=0,
                 glu_alpha=1.0, glu_beta=0.0, local_lr_mult=1.0, process_group=group)
    out = []
    for t in range(6):
        opt.zero_grad()
        loss_of(model, *batch(0 if identical_batches else rank, t)).backward()
        opt.step()
        opt.finalize()
        out.append((flat(model.parameters()), flat(opt.global_parameters())))
    return out


def resume_run(rank, group, comm, checkpoint_at, steps=14, k=3, wp1=3):
    """Uninterrupted vs checkpoint at ``checkpoint_at`` (state_dict through bytes) and resume."""
    def train(model, opt, first, last):
        for t in range(first, last):
            train_step(model, opt, rank, t)

    model = make_model()
    opt = build(model, k, wp1, comm, group=group)
    train(model, opt, 0, steps)
    opt.finalize()
    straight = (flat(model.parameters()), flat(opt.global_parameters()))

    model = make_model()
    opt = build(model, k, wp1, comm, group=group)
    train(model, opt, 0, checkpoint_at)
    buffer = io.BytesIO()
    saved = opt.state_dict()
    torch.save(saved, buffer)
    sync_state = saved["ssd_sgd"]["sync_state"]
    resumed_model = make_model(seed=1)  # different initial weights: the state dict must restore them
    resumed = build(resumed_model, k, wp1, comm, group=group)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    train(resumed_model, resumed, checkpoint_at, steps)
    resumed.finalize()
    return dict(straight=straight, resumed=(flat(resumed_model.parameters()), flat(resumed.global_parameters())),
                sync_state=sync_state)


def batchnorm_run(rank, group, k=2, wp1=2, steps=6):
    model = make_model(batchnorm=True)
    groups = [dict(params=list(model[0].parameters()) + list(model[1].parameters())),
              dict(params=list(model[-1].parameters()))]
    opt = SSDSGD(groups, lr=0.05, delay_steps=k, warmup_steps=wp1, sync_buffers=model.buffers(),
                 process_group=group)
    seen = []
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
        if (opt.steps - wp1) % k == 0 and opt.steps > wp1:
            before = model[1].running_mean.clone()
            opt.finalize()
            seen.append((before, model[1].running_mean.clone(), model[1].num_batches_tracked.clone()))
    return seen


def backend_run(rank, group, backend):
    # As in the test process (backend_device): Triton compiled on CUDA with a GPU (gloo carries SSDSGD's
    # broadcast and all-reduce of CUDA tensors), else interpreted on the CPU; inputs are made on the CPU.
    device = backend_device(backend)
    model = make_model(dtype=torch.float32).to(device)
    opt = SSDSGD(param_groups(model), lr=0.05, delay_steps=2, warmup_steps=2, process_group=group)
    with tritonopt.use_backend(backend):
        for t in range(7):
            opt.zero_grad()
            loss_of(model, *(x.to(device) for x in batch(rank, t, torch.float32))).backward()
            opt.step()
    opt.finalize()
    return dict(weights=flat(model.parameters()).cpu(), global_=flat(opt.global_parameters()).cpu(),
                device=model[0].weight.device.type)


def capture(fn):
    """``fn()``'s error as (type name, message), or None."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the parent asserts on the type
        return type(error).__name__, str(error)
    return None


def nonfinite_run(rank, group, comm, policy, bad_step, bad_rank=1, k=3, wp1=3, steps=11):
    model = make_model()
    opt = build(model, k, wp1, comm, group=group, on_nonfinite=policy)
    log = []
    for t in range(steps):
        for group, base in zip(opt.param_groups, (GROUP0["lr"], opt.param_groups[1]["initial"])):
            group["lr"] = lr_at(t, base)
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        if t == bad_step and rank == bad_rank:
            model[0].weight.grad[0, 0] = float("nan")
        before = flat(model.parameters())
        steps_before = opt.steps
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            error = capture(opt.step)
        log.append(dict(t=t, error=error, warned=[str(w.message) for w in caught],
                        steps_before=steps_before, steps=opt.steps, skipped=opt.skipped_steps,
                        before=before, after=flat(model.parameters()),
                        pre=None if opt.in_warmup else flat(opt.state[p]["pre_weight"] for p in model.parameters())))
    opt.finalize()
    return dict(log=log, final=flat(model.parameters()), global_=flat(opt.global_parameters()))


def mismatch_runs(rank, group):
    out = {}
    # Parameter shapes differ: a clear ValueError on every rank, not a gloo abort.
    model = nn.Linear(IN, HIDDEN + rank).double()
    out["shapes"] = capture(lambda: SSDSGD(model.parameters(), lr=0.1, process_group=group))
    out["lr"] = capture(lambda: SSDSGD(make_model().parameters(), lr=0.1 * (1 + rank), process_group=group))
    out["warmup"] = capture(lambda: SSDSGD(make_model().parameters(), lr=0.1, warmup_steps=3 + rank,
                                           process_group=group))
    # A learning rate changed on one rank only, in the delay stage: every rank raises at the next sync.
    model = make_model()
    opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=1, process_group=group)
    errors = []
    for t in range(6):
        if t == 2 and rank == 1:
            opt.param_groups[0]["lr"] = 0.07
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        errors.append(capture(opt.step))
    out["drift"] = errors
    # The same during the warm-up: raised at once, nothing modified.
    model = make_model()
    opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=5, process_group=group)
    opt.param_groups[0]["lr"] = 0.05 + 0.01 * rank
    opt.zero_grad()
    loss_of(model, *batch(rank, 0)).backward()
    before = flat(model.parameters())
    out["warmup_drift"] = (capture(opt.step), torch.equal(before, flat(model.parameters())))
    return out


def copy_and_memory_run(rank, group):
    model = make_model()
    opt = SSDSGD(model.parameters(), lr=0.05, process_group=group)
    return dict(deepcopy=capture(lambda: copy.deepcopy(opt)), pickle=capture(lambda: pickle.dumps(opt)),
                state_bytes=opt.state_bytes(), numel=sum(p.numel() for p in model.parameters()))


def steps_until_an_error(model, opt, rank):
    """Rank 0 steps 8 times, rank 1 only 4: rank 0's first failing step, its error and how long it waited."""
    for t in range(8 if rank == 0 else 4):
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        start = time.monotonic()
        error = capture(opt.step)
        if error is not None:
            return (t, error, time.monotonic() - start)
    return None


def early_stop_run(rank, group):
    """Rank 1 stops after 4 steps; rank 0 must raise within the group's timeout, not hang."""
    model = make_model()
    opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=2, process_group=group)
    result = steps_until_an_error(model, opt, rank)
    dist.barrier()  # on the world group: rank 1 waits here while rank 0 times out
    return result


def batchnorm_resume_run(rank, group, k=3, wp1=2, steps=11, checkpoint_at=7):
    """BatchNorm with sync_buffers, resumed in the usual order: load the model, build SSDSGD, load its state.

    The checkpoint falls inside a window, after a forward pass since the last average: the ranks'
    statistics differ there and are packed into the next synchronisation.
    """
    def build_bn(model):
        return SSDSGD(model.parameters(), lr=0.05, delay_steps=k, warmup_steps=wp1, sync_buffers=model.buffers(),
                      process_group=group)

    def train(model, opt, first, last):
        for t in range(first, last):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()

    def outcome(model, opt):
        opt.finalize()
        return [flat(model.parameters()), flat(opt.global_parameters()), *[b.clone() for b in model.buffers()]]

    model = make_model(batchnorm=True)
    opt = build_bn(model)
    train(model, opt, 0, steps)
    straight = outcome(model, opt)

    model = make_model(batchnorm=True)
    opt = build_bn(model)
    train(model, opt, 0, checkpoint_at)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = make_model(seed=1, batchnorm=True)
    resumed_model.load_state_dict(saved["model"])
    resumed = build_bn(resumed_model)  # broadcasts rank 0's parameters and buffers
    resumed.load_state_dict(saved["opt"])
    train(resumed_model, resumed, checkpoint_at, steps)
    return dict(straight=straight, resumed=outcome(resumed_model, resumed),
                checkpoint_mean=saved["model"]["1.running_mean"])


def finalize_run(rank, group, comm, call_finalize, k=3, wp1=3, steps=11, bad_step=4):
    """A NaN gradient on rank 1 inside a delay window; ``call_finalize``: finalize() after every later step."""
    model = make_model()
    opt = build(model, k, wp1, comm, group=group)
    log = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(steps):
            for g, base in zip(opt.param_groups, (GROUP0["lr"], opt.param_groups[1]["initial"])):
                g["lr"] = lr_at(t, base)
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            if t == bad_step and rank == 1:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
            log.append((flat(model.parameters()), opt.steps, opt.skipped_steps))
            if call_finalize and t >= bad_step:  # mid-window, and where a window's sync is in flight
                opt.finalize()
        opt.finalize()
    return dict(log=log, global_=flat(opt.global_parameters()))


def batchnorm_finalize_run(rank, group, call_finalize, k=2, wp1=2, steps=7):
    """sync_buffers averaged by finalize() (for evaluation) and again by the next step, after its forward pass."""
    model = make_model(batchnorm=True)
    opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=k, warmup_steps=wp1, sync_buffers=model.buffers(),
                 process_group=group)
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, t)).backward()
        opt.step()
        if call_finalize:
            opt.finalize()
    return [flat(model.parameters()), *[b.clone() for b in model.buffers()]]


def digest_runs(rank, group):
    """Rank 1's lr drifts to LR_CRC16_TWIN: in the warm-up, and in a delay window of each comm mode."""
    out = {}
    for name, comm, warmup, drift_at in (("warmup", "shadow", 4, 1), ("shadow", "shadow", 1, 2),
                                         ("per_step", "per_step", 1, 2)):
        model = make_model()
        opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=warmup, comm=comm,
                     process_group=group)
        errors = []
        for t in range(6):
            if t == drift_at and rank == 1:
                opt.param_groups[0]["lr"] = LR_CRC16_TWIN
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            errors.append(capture(opt.step))
        out[name] = errors
    return out


def refusal_runs(rank, group):
    """A rank that refuses its own arguments or state dict: every rank raises at once."""
    out = {}
    start = time.monotonic()
    out["lr"] = capture(lambda: SSDSGD(make_model().parameters(), lr=-1.0 if rank == 1 else 0.05,
                                       process_group=group))
    out["lr_seconds"] = time.monotonic() - start
    try:  # were the refusal not shared, the ranks' collectives would pair up wrongly from here on
        model = make_model()
        opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=1, process_group=group)
        for t in range(3):
            opt.zero_grad()
            loss_of(model, *batch(rank, t)).backward()
            opt.step()
        shared = [opt.state_dict()]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        before = flat(model.parameters())
        start = time.monotonic()
        out["foreign_state"] = capture(lambda: opt.load_state_dict(shared[0]))  # rank 1 loads rank 0's
        out["foreign_state_seconds"] = time.monotonic() - start
        out["unchanged"] = torch.equal(before, flat(model.parameters())) and opt.steps == 3
        # Both ranks go on in step: no collective was left half-joined.
        opt.zero_grad()
        loss_of(model, *batch(rank, 3)).backward()
        out["next_step"] = capture(opt.step)
    except Exception as error:  # noqa: BLE001 - the test reports what is missing
        out["aftermath"] = (type(error).__name__, str(error))
    return out


def own_timeout_run(rank, group):
    """SSDSGD with timeout=OWN_TIMEOUT on a group of torch's default timeout; rank 1 stops after 4 steps."""
    model = make_model()
    built = []
    error = capture(lambda: built.append(SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=2,
                                                process_group=group, timeout=OWN_TIMEOUT)))
    if error is not None:
        return dict(construction=error)
    opt = built[0]
    result = steps_until_an_error(model, opt, rank)
    dist.barrier(group=group)  # rank 1 stalls here, on another group, while rank 0 waits out the timeout
    return dict(construction=None, failure=result, timeout=opt.timeout.total_seconds())


def bad_state_runs(rank, group):
    """Corrupted state dicts (the same on both ranks): each refused with the field named, nothing modified."""
    model = make_model(dtype=torch.float32)
    opt = SSDSGD(model.parameters(), lr=0.05, delay_steps=2, warmup_steps=1, process_group=group)
    for t in range(4):
        opt.zero_grad()
        loss_of(model, *batch(rank, t, torch.float32)).backward()
        opt.step()
    good = opt.state_dict()

    def corrupted(change):
        state = copy.deepcopy(good)
        change(state)
        return state

    def set_field(name, value):
        return lambda s: s["ssd_sgd"].__setitem__(name, value)

    def as_float64(s):
        for entry in s["state"].values():
            for name in entry:
                entry[name] = entry[name].double()
        s["ssd_sgd"]["trailer"] = s["ssd_sgd"]["trailer"].double()

    wide = SSDSGD(make_model().parameters(), lr=0.05, delay_steps=2, warmup_steps=1, process_group=group)
    cases = {
        "steps": set_field("steps", -5),
        "sync_state": set_field("sync_state", "bogus"),
        "window_start": set_field("window_start", 1e9),
        "window_start_int": set_field("window_start", 10**9),
        "verdict": set_field("verdict", "bogus"),
        "sync_scale": set_field("sync_scale", 0.3),
        "delay_ready": set_field("delay_ready", 1),
        "window_digest": set_field("window_digest", -1),
        "trailer": set_field("trailer", torch.zeros(3)),
        "sync_buffers": set_field("sync_buffers", [torch.zeros(2)]),
        "missing_field": lambda s: s["ssd_sgd"].pop("pull_due"),
        "missing_skipped": lambda s: s.pop("skipped_steps"),
        "missing_entry": lambda s: s["state"][0].pop("pre_weight"),
        "lr": lambda s: s["param_groups"][0].__setitem__("lr", -1.0),
        "float64_state": as_float64,
        "float64_checkpoint": lambda s: s.update(wide.state_dict()),
    }
    params_before = flat(model.parameters())
    state_before = {name: t.clone() for name, t in opt.state[model[0].weight].items()}
    out = {name: capture(lambda: opt.load_state_dict(corrupted(change))) for name, change in cases.items()}
    out["unchanged"] = (torch.equal(params_before, flat(model.parameters())) and opt.steps == 4
                        and all(torch.equal(t, opt.state[model[0].weight][n]) for n, t in state_before.items()))
    out["good"] = capture(lambda: opt.load_state_dict(good))
    return out


def exactness_runs(rank, group):
    out = {}
    for k in DELAYS:
        out[("shadow", k)] = exactness_run(rank, group, k, WARMUP, WARMUP + 3 * k + 2, "shadow")
    out[("per_step", 3)] = exactness_run(rank, group, 3, WARMUP, WARMUP + 11, "per_step")
    out[("shadow_no_warmup", 3)] = exactness_run(rank, group, 3, 0, 10, "shadow")
    return out


def pair_scenarios(rank, group, short_timeout_group, refusal_group):
    return {
        "exact": exactness_runs(rank, group),
        "warmup_only": warmup_only_run(rank, group),
        "closed_identical": closed_form_run(rank, group, identical_batches=True),
        "closed_distinct": closed_form_run(rank, group, identical_batches=False),
        "resume": {
            (comm, at): resume_run(rank, group, comm, at)
            for comm, at in (("shadow", 6), ("shadow", 7), ("shadow", 2), ("per_step", 6), ("per_step", 8))
        },
        "batchnorm": batchnorm_run(rank, group),
        "backend": {b: backend_run(rank, group, b) for b in ("reference", "triton")},
        "nonfinite": {
            ("shadow", "skip", 5): nonfinite_run(rank, group, "shadow", "skip", 5),
            ("shadow", "skip", 1): nonfinite_run(rank, group, "shadow", "skip", 1),
            ("shadow", "raise", 4): nonfinite_run(rank, group, "shadow", "raise", 4),
            ("per_step", "skip", 4): nonfinite_run(rank, group, "per_step", "skip", 4),
        },
        "mismatch": mismatch_runs(rank, group),
        "copy_and_memory": copy_and_memory_run(rank, group),
        "batchnorm_resume": batchnorm_resume_run(rank, group),
        "finalize": {(comm, call): finalize_run(rank, group, comm, call)
                     for comm in ("shadow", "per_step") for call in (False, True)},
        "batchnorm_finalize": {call: batchnorm_finalize_run(rank, group, call) for call in (False, True)},
        "digest": digest_runs(rank, group),
        "bad_state": bad_state_runs(rank, group),
        "refusal": refusal_runs(rank, refusal_group),
        "early_stop": early_stop_run(rank, short_timeout_group),  # it breaks that group
        "own_timeout": own_timeout_run(rank, group),  # last: it breaks SSDSGD's own group
    }


def scenarios(rank, world):
    # Every rank creates every group, in the same order.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    short = [dist.new_group(r, timeout=datetime.timedelta(seconds=EARLY_STOP_TIMEOUT)) for r in ([0, 1], [2, 3])]
    refusal = [dist.new_group(r, timeout=datetime.timedelta(seconds=REFUSAL_GROUP_TIMEOUT))
               for r in ([0, 1], [2, 3])]
    world_results = exactness_runs(rank, None)
    pair_results = pair_scenarios(rank % 2, pairs[rank // 2], short[rank // 2], refusal[rank // 2])
    return dict(world=world_results, pair=pair_results)


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(4, scenarios, timeout=300)


def ranks_of(results, which):
    """The per-rank results of the world (4 ranks) or of one pair (2 ranks)."""
    if which == "world":
        return [dict(exact=r["world"]) for r in results]
    first = {"pair01": 0, "pair23": 2}[which]
    return [results[first]["pair"], results[first + 1]["pair"]]


@pytest.fixture(scope="module")
def four_ranks(results):
    return ranks_of(results, "world")


@pytest.fixture(scope="module", params=["pair01", "pair23"])
def two_ranks(results, request):
    return ranks_of(results, request.param)


# --------------------------------------------------------------------------- exactness


def max_abs(a, b):
    return float((a - b).abs().max())


@pytest.mark.parametrize("which", ["world", "pair01", "pair23"])
@pytest.mark.parametrize("mode, k", [("shadow", 1), ("shadow", 3), ("shadow", 5), ("per_step", 3),
                                     ("shadow_no_warmup", 3)])
def test_distributed_run_equals_the_oracle(results, which, mode, k):
    ranks = ranks_of(results, which)
    world = len(ranks)
    wp1 = 0 if mode == "shadow_no_warmup" else WARMUP
    runs = [r["exact"][(mode, k)]["records"] for r in ranks]
    expected = oracle(world, len(runs[0]), k, wp1)
    globals_checked = 0
    for t, want in enumerate(expected):
        for rank in range(world):
            rec = runs[rank][t]
            assert max_abs(rec["dev"], want["dev"][rank]) <= EXACT, (t, rank, "device")
            if "global" in rec:
                globals_checked += 1
                assert max_abs(rec["global"], want["global_"]) <= EXACT, (t, rank, "global")
                # a pull just arrived: the local weight is the global one
                assert max_abs(rec["global"], want["local"][rank]) <= EXACT, (t, rank, "local")
                assert torch.equal(rec["global"], runs[0][t]["global"]), "global state differs across ranks"
            elif t >= wp1 and (t + 1 - wp1) % k:
                assert max_abs(rec["dev"], want["local"][rank]) <= EXACT, (t, rank, "local")
    assert globals_checked >= world * (min(wp1, len(expected)) + 1)


def test_collective_counts_and_bytes_equal_the_formulas(four_ranks):
    for rank_result in four_ranks:
        for (mode, k), run in rank_result["exact"].items():
            d, stats, steps = run["numel"], run["stats"], len(run["records"])
            wp1 = 0 if mode == "shadow_no_warmup" else WARMUP
            per_call = lambda n: n * 8  # float64  # noqa: E731
            assert stats["initial_broadcast"] == dict(
                calls=1, bytes_sent=per_call(d) if rank_result is four_ranks[0] else 0,
                bytes_received=0 if rank_result is four_ranks[0] else per_call(d))
            assert stats["config_check"]["calls"] == 2  # the agreement check's two all-gathers
            if wp1:
                assert stats["warmup_grad_allreduce"] == dict(
                    calls=wp1, bytes_sent=wp1 * per_call(d + SSDSGD.CHECK_ELEMENTS),
                    bytes_received=wp1 * per_call(d + SSDSGD.CHECK_ELEMENTS))
            if mode == "per_step":
                n = steps - wp1
                assert stats["per_step_grad_allreduce"]["calls"] == n
                assert stats["per_step_grad_allreduce"]["bytes_sent"] == n * per_call(d + SSDSGD.CHECK_ELEMENTS)
                assert "shadow_sync_allreduce" not in stats
            else:
                syncs = (steps - wp1) // k
                assert stats["shadow_sync_allreduce"] == dict(
                    calls=syncs, bytes_sent=syncs * per_call(2 * d + SSDSGD.CHECK_ELEMENTS),
                    bytes_received=syncs * per_call(2 * d + SSDSGD.CHECK_ELEMENTS))
                assert set(stats) == {"config_check", "initial_broadcast", "warmup_grad_allreduce",
                                      "shadow_sync_allreduce"} - ({"warmup_grad_allreduce"} if not wp1 else set())


def test_warmup_only_is_synchronous_sgd(two_ranks):
    # torch's SGD equals the MXNet convention at a constant lr (mom = -lr * buf); the mean of the
    # two ranks' mean losses is the mean loss on their concatenated batches.
    model = make_model()
    groups = [dict(params=list(model[0].parameters()), **GROUP0), dict(params=list(model[-1].parameters()),
                                                                        **{k: GROUP1[k] for k in GROUP0})]
    sgd = torch.optim.SGD(groups, lr=GROUP0["lr"])
    for t, got in enumerate(two_ranks[0]["warmup_only"]):
        sgd.zero_grad()
        xs, ys = zip(*(batch(r, t) for r in range(2)))
        loss_of(model, torch.cat(xs), torch.cat(ys)).backward()
        sgd.step()
        for rank in range(2):
            assert max_abs(two_ranks[rank]["warmup_only"][t], flat(model.parameters())) <= EXACT


def test_one_step_delay_without_momentum_or_glu_is_its_closed_form(two_ranks):
    lr, wd = 0.1, 1e-2
    # Identical batches on every rank: each step is exactly SGD with weight decay.
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
    for t in range(6):
        sgd.zero_grad()
        loss_of(model, *batch(0, t)).backward()
        sgd.step()
        for rank in range(2):
            device, global_ = two_ranks[rank]["closed_identical"][t]
            assert max_abs(device, flat(model.parameters())) <= EXACT
            assert max_abs(global_, flat(model.parameters())) <= EXACT
    # Distinct batches: W' = W - lr (mean_i g_i + wd W), p_i' = W - lr (g_i + wd W), g_i taken at p_i.
    w = flat(make_model().parameters())
    p = [w.clone(), w.clone()]
    for t in range(6):
        g = [grad_at(p[i], i, t) for i in range(2)]
        p = [w - lr * (g[i] + wd * w) for i in range(2)]
        w = w - lr * ((g[0] + g[1]) / 2 + wd * w)
        for rank in range(2):
            device, global_ = two_ranks[rank]["closed_distinct"][t]
            assert max_abs(device, p[rank]) <= EXACT and max_abs(global_, w) <= EXACT


# --------------------------------------------------------------------------- checkpoints, buffers, backends


@pytest.mark.parametrize("comm, at", [("shadow", 6), ("shadow", 7), ("shadow", 2), ("per_step", 6),
                                      ("per_step", 8)])
def test_resumed_run_equals_uninterrupted_bit_for_bit(two_ranks, comm, at):
    for rank in range(2):
        run = two_ranks[rank]["resume"][(comm, at)]
        for straight, resumed in zip(run["straight"], run["resumed"]):
            assert torch.equal(straight, resumed), (rank, comm, at)
    if comm == "shadow" and at == 6:  # 3 warm-up steps, k = 3: the sync launched at step 6 was in flight
        assert two_ranks[0]["resume"][(comm, at)]["sync_state"] == "ready"  # state_dict() flushed it


def test_sync_buffers_are_averaged_at_each_sync(two_ranks):
    seen = [two_ranks[r]["batchnorm"] for r in range(2)]
    assert len(seen[0]) >= 2
    for (before0, after0, count0), (before1, after1, count1) in zip(*seen):
        assert not torch.equal(before0, before1)  # the ranks' statistics had drifted apart
        assert torch.allclose(after0, (before0 + before1) / 2, rtol=0, atol=1e-15)
        assert torch.equal(after0, after1)
        assert torch.equal(count0, count1)  # integer counters stay local (equal here)


def test_triton_and_reference_backends_agree_inside_the_optimizer(two_ranks):
    # float32, 7 steps: each step rounds differently by a few ulps of the summed terms (FMA on a GPU).
    for rank in range(2):
        ref, tri = two_ranks[rank]["backend"]["reference"], two_ranks[rank]["backend"]["triton"]
        assert (ref["device"], tri["device"]) == ("cpu", backend_device("triton").type)
        for name in ("weights", "global_"):
            assert torch.allclose(ref[name], tri[name], rtol=1e-5, atol=1e-6), (rank, name)


# --------------------------------------------------------------------------- bad input and failures


def test_nonfinite_gradient_in_warmup_is_skipped_on_every_rank(two_ranks):
    logs = [two_ranks[r]["nonfinite"][("shadow", "skip", 1)]["log"] for r in range(2)]
    for log in logs:
        entry = log[1]
        assert entry["error"] is None and any("not finite" in w for w in entry["warned"])
        assert torch.equal(entry["before"], entry["after"]) and entry["steps"] == entry["steps_before"]
        assert log[-1]["skipped"] == 1
    assert torch.equal(two_ranks[0]["nonfinite"][("shadow", "skip", 1)]["global_"],
                       two_ranks[1]["nonfinite"][("shadow", "skip", 1)]["global_"])


@pytest.mark.parametrize("comm", ["shadow", "per_step"])
def test_nonfinite_gradient_in_delay_stage_discards_the_window_on_every_rank(two_ranks, comm):
    bad_step = 5 if comm == "shadow" else 4
    runs = [two_ranks[r]["nonfinite"][(comm, "skip", bad_step)] for r in range(2)]
    k, wp1 = 3, 3
    # The window holding step 5 is steps 3..5; it is judged at the start of step 6.
    judged = [entry for entry in runs[0]["log"] if entry["warned"]]
    assert len(judged) == 1 and judged[0]["t"] == 6
    for run in runs:
        entry = run["log"][6]
        assert any("discarded on every rank" in w for w in entry["warned"])
        assert entry["skipped"] == k and entry["steps"] == wp1 + 1  # window dropped, this step applied
        assert entry["pre"] is not None and torch.isfinite(entry["pre"]).all()
        assert all(torch.isfinite(e["after"]).all() for e in run["log"])
        assert run["log"][-1]["skipped"] == k
    # pre after the discard is still the warm-up's final global weight: the same on both ranks
    assert torch.equal(runs[0]["log"][6]["pre"], runs[1]["log"][6]["pre"])
    assert torch.equal(runs[0]["global_"], runs[1]["global_"])
    assert torch.isfinite(runs[0]["global_"]).all()


def test_nonfinite_gradient_with_raise_raises_on_every_rank_at_the_same_step(two_ranks):
    logs = [two_ranks[r]["nonfinite"][("shadow", "raise", 4)]["log"] for r in range(2)]
    raised = [[e["t"] for e in log if e["error"] is not None] for log in logs]
    assert raised[0] == raised[1] == [6]
    for log in logs:
        assert log[6]["error"][0] == "FloatingPointError"
        assert torch.equal(log[6]["after"], log[6]["pre"].to(log[6]["after"].dtype))  # reset to global
        assert log[6]["skipped"] == 0 and log[6]["steps"] == 3


def test_mismatched_setups_raise_a_named_error_on_every_rank(two_ranks):
    for rank in range(2):
        out = two_ranks[rank]["mismatch"]
        assert out["shapes"][0] == "ValueError" and "parameter shapes" in out["shapes"][1]
        assert out["lr"][0] == "ValueError" and "lr" in out["lr"][1]
        assert out["warmup"][0] == "ValueError" and "warmup_steps" in out["warmup"][1]
        errors = [e for e in out["drift"] if e is not None]
        assert errors and errors[0][0] == "ValueError" and "differed" in errors[0][1]
        assert out["drift"].index(errors[0]) == 3  # judged where the window's sync is consumed
        error, unchanged = out["warmup_drift"]
        assert error[0] == "ValueError" and "nothing was modified" in error[1] and unchanged


def test_a_rank_that_stops_early_makes_the_others_raise_within_the_timeout(two_ranks):
    t, (kind, message), waited = two_ranks[0]["early_stop"]
    assert kind == "CollectiveFailure" and "'shadow_sync_allreduce'" in message and "failed on rank" in message
    assert t >= 4 and waited < EARLY_STOP_TIMEOUT + 10.0  # the timeout plus slack for a loaded machine
    assert two_ranks[1]["early_stop"] is None


def test_copies_are_refused_and_state_bytes_counts_every_buffer(two_ranks):
    for rank in range(2):
        out = two_ranks[rank]["copy_and_memory"]
        for how in ("deepcopy", "pickle"):
            assert out[how][0] == "TypeError" and "cannot be copied or pickled" in out[how][1]
        # float64: pre, the synchronised momentum and the gradient (d each, the gradient with the
        # agreement check's values), and the shadow server [sw; smom] with them: 5d + 2 * CHECK_ELEMENTS.
        d = out["numel"]
        assert out["state_bytes"] == 8 * (5 * d + 2 * SSDSGD.CHECK_ELEMENTS)


# --------------------------------------------------------------------------- resuming, finalize, agreement


def test_resumed_run_with_sync_buffers_equals_uninterrupted_bit_for_bit(two_ranks):
    runs = [two_ranks[r]["batchnorm_resume"] for r in range(2)]
    # At the checkpoint the ranks' statistics differ: rank 1's must not be replaced by rank 0's.
    assert not torch.equal(runs[0]["checkpoint_mean"], runs[1]["checkpoint_mean"])
    for rank, run in enumerate(runs):
        assert len(run["straight"]) == len(run["resumed"]) == 2 + 3  # weights, globals, three BatchNorm buffers
        for straight, resumed in zip(run["straight"], run["resumed"]):
            assert torch.equal(straight, resumed), rank


@pytest.mark.parametrize("comm", ["shadow", "per_step"])
def test_finalize_after_a_nonfinite_gradient_leaves_training_unchanged(two_ranks, comm):
    for rank in range(2):
        without, with_finalize = (two_ranks[rank]["finalize"][(comm, call)] for call in (False, True))
        assert without["log"][-1][2] == 3  # the bad window (3 steps) was skipped
        for t, (a, b) in enumerate(zip(without["log"], with_finalize["log"])):
            assert torch.equal(a[0], b[0]) and a[1:] == b[1:], (rank, t)
        assert torch.equal(without["global_"], with_finalize["global_"])


def test_finalize_with_sync_buffers_leaves_training_unchanged(two_ranks):
    for rank in range(2):
        runs = two_ranks[rank]["batchnorm_finalize"]
        assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True])), rank


@pytest.mark.parametrize("case", ["warmup", "shadow", "per_step"])
def test_an_lr_that_agreed_on_16_crc_bits_is_caught(two_ranks, case):
    for rank in range(2):
        errors = [e for e in two_ranks[rank]["digest"][case] if e is not None]
        assert errors, (rank, case)
        assert errors[0][0] == "ValueError" and "differed" in errors[0][1]


def test_a_rank_that_refuses_its_own_arguments_makes_every_rank_raise_at_once(two_ranks):
    for rank in range(2):
        out = two_ranks[rank]["refusal"]
        assert "aftermath" not in out, out["aftermath"]
        for what in ("lr", "foreign_state"):
            kind, message = out[what]
            assert kind == "ValueError", (rank, what, message)
            assert out[f"{what}_seconds"] < 5.0, (rank, what)  # not the group's 10 s timeout
            if rank == 0:
                assert "rank 1" in message
        assert out["unchanged"] and out["next_step"] is None
    assert "lr" in two_ranks[0]["refusal"]["lr"][1] and "lr must be >= 0" in two_ranks[1]["refusal"]["lr"][1]
    assert "rank=0" in two_ranks[0]["refusal"]["foreign_state"][1]  # rank 1's reason, shared


@pytest.mark.parametrize("case, field", [
    ("steps", "steps"), ("sync_state", "sync_state"), ("window_start", "window_start"),
    ("window_start_int", "window_start"), ("verdict", "verdict"), ("sync_scale", "sync_scale"),
    ("delay_ready", "delay_ready"), ("window_digest", "window_digest"), ("trailer", "trailer"),
    ("sync_buffers", "sync_buffers"), ("missing_field", "pull_due"), ("missing_skipped", "skipped_steps"),
    ("missing_entry", "pre_weight"), ("lr", "lr"), ("float64_state", "torch.float64"),
    ("float64_checkpoint", "layout"),
])
def test_a_bad_state_dict_is_refused_naming_the_field(two_ranks, case, field):
    for rank in range(2):
        out = two_ranks[rank]["bad_state"]
        kind, message = out[case]
        assert kind == "ValueError" and field in message, (rank, case, message)
        assert out["unchanged"] and out["good"] is None


def test_ssdsgd_raises_within_its_own_timeout_when_a_rank_stalls(two_ranks):
    out = two_ranks[0]["own_timeout"]
    assert out["construction"] is None and out["timeout"] == OWN_TIMEOUT
    t, (kind, message), waited = out["failure"]
    assert kind == "CollectiveFailure" and "'shadow_sync_allreduce'" in message
    assert t >= 4 and waited < OWN_TIMEOUT + 10.0  # its group's own timeout is 30 minutes
    assert two_ranks[1]["own_timeout"]["failure"] is None
