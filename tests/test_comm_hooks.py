"""The compressed DDP communication hooks on 2 gloo ranks (one spawn for the module).

Every scenario trains a small MLP whose layers are registered in another order
than backward reaches them, with buckets of about 1 KB, so DDP's rebuild after
the first iteration changes which parameters each bucket holds. A wrapper
around each hook logs, per call, the rank's gradient before the hook, the
averaged result, and the per-parameter error after it; the parent checks the
error-feedback identities on those logs with bounds derived from float32
rounding (``u = 2**-24``).
"""

import copy
import io
import math
import time

import pytest
import torch
import torch.distributed as dist
from _distributed import run_on_ranks
from torch import nn

import tritonopt
from tritonopt.dist import EFTopKState, LowRankState, ef_topk_hook, lowrank_ef_hook

WORLD = 2
STEPS = 4
BUCKET_CAP_MB = 0.001  # ~1 KB: one bucket per layer after the rebuild (one bucket before it)
# k = 13 per block; a partial last block keeps ceil(0.1 * length). Blocks are few: each costs the
# Triton interpreter about 0.15 s.
TOPK = dict(density=0.1, block_size=128)
LOWRANK = dict(rank=2, warmup_iters=1)  # min_compression_rate 2: the 12x6 layer stays uncompressed
UNIT_ROUNDOFF = 2.0**-24
RESUME_STEPS, RESUME_AT = 7, 3  # a checkpoint after 3 iterations (DDP has rebuilt its buckets), 4 more after it
RESUME_CASES = {  # name: hook, state, settings, model ("MisorderedMLP" or "ForwardOrderMLP")
    "topk": (ef_topk_hook, EFTopKState, TOPK, "MisorderedMLP"),  # the checkpoint holds errors
    # Saved in the last warm-up iteration: compression starts at the restart, on DDP's initial bucket.
    "topk_warmup_ends_at_restart": (ef_topk_hook, EFTopKState, dict(TOPK, warmup_iters=RESUME_AT), "MisorderedMLP"),
    "lowrank": (lowrank_ef_hook, LowRankState, LOWRANK, "MisorderedMLP"),
    "lowrank_warmup_ends_at_restart": (lowrank_ef_hook, LowRankState, dict(LOWRANK, warmup_iters=RESUME_AT),
                                       "MisorderedMLP"),
    # Its initial bucket meets the three compressed weights in another order than the rebuilt buckets: the
    # warm starts drawn at the restart must follow the saved order.
    "lowrank_warmup_ends_at_restart_forward_order": (
        lowrank_ef_hook, LowRankState, dict(LOWRANK, warmup_iters=RESUME_AT), "ForwardOrderMLP"),
}
STALL_TIMEOUT = 2.0  # seconds: the hook states' timeout in the stalled-peer scenarios


class MisorderedMLP(nn.Module):
    """6 -> 12 -> 24 -> 10, its layers registered last-first (backward reaches them in another order)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(24, 10)
        self.body = nn.Linear(12, 24)
        self.stem = nn.Linear(6, 12)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


class ForwardOrderMLP(nn.Module):
    """6 -> 24 -> 24 -> 10, registered in forward order; every weight is compressed at rank 2."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(6, 24)
        self.body = nn.Linear(24, 24)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


def batches(rank: int, steps: int):
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(steps)]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _topk_errors(state: EFTopKState, bucket) -> dict[str, torch.Tensor]:
    flat = state.bucket_error(bucket.index())
    errors, offset = {}, 0
    for parameter in bucket.parameters():
        errors[id(parameter)] = flat[offset : offset + parameter.numel()].view(parameter.shape)
        offset += parameter.numel()
    return errors


def _lowrank_errors(state: LowRankState, bucket) -> dict[int, torch.Tensor]:
    errors = {}
    for parameter in bucket.parameters():
        error = state.parameter_error(parameter)
        if error is not None:
            errors[id(parameter)] = error.view(parameter.shape)
    return errors


def recording(hook, errors_of, log: list, names: dict[int, str], poison=None):
    """``hook`` wrapped to append one entry per call to ``log``; ``poison(iteration, bucket)`` may edit the
    gradient before the hook sees it."""

    def wrapper(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        iteration, warmup = state.iteration, state.iteration < state.warmup_iters
        if poison is not None:
            poison(iteration, bucket)
        params = bucket.parameters()
        grads = {names[id(p)]: g.clone() for p, g in zip(params, bucket.gradients())}
        future = hook(state, bucket)

        def record(fut):
            buffer = fut.value()
            outs = {names[id(p)]: g.clone() for p, g in zip(params, bucket.gradients())}
            errors = {} if warmup else {names[i]: e.clone() for i, e in errors_of(state, bucket).items()}
            log.append(dict(iteration=iteration, index=bucket.index(), warmup=warmup,
                            layout=[(names[id(p)], tuple(p.shape)) for p in params],
                            grads=grads, outs=outs, errors=errors))
            return buffer

        return future.then(record)

    return wrapper


def train(model, ddp, data, steps):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in data[:steps]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):  # skipped otherwise, as GradScaler does
            optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_hook(hook, errors_of, state, rank, steps=STEPS, poison=None):
    model = MisorderedMLP()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    log = []
    ddp.register_comm_hook(state, recording(hook, errors_of, log, _names(model), poison))
    params = train(model, ddp, batches(rank, steps), steps)
    return dict(params=params, log=log, stats={k: vars(v) for k, v in state.communicator.stats().items()},
                initial=torch.cat([p.detach().reshape(-1) for p in MisorderedMLP().parameters()]))


def density_one_against_default(rank):
    """Per step, the default DDP and the hook at density 1 average the same local gradients."""
    default_model, hook_model = MisorderedMLP(), MisorderedMLP()
    default_ddp = nn.parallel.DistributedDataParallel(default_model, bucket_cap_mb=BUCKET_CAP_MB)
    hook_ddp = nn.parallel.DistributedDataParallel(hook_model, bucket_cap_mb=BUCKET_CAP_MB)
    state = EFTopKState(density=1.0, block_size=TOPK["block_size"])
    log = []
    hook_ddp.register_comm_hook(state, recording(ef_topk_hook, _topk_errors, log, _names(hook_model)))
    optimizer = torch.optim.SGD(default_ddp.parameters(), lr=0.1, momentum=0.9)
    steps = []
    for x, y in batches(rank, 3):
        with torch.no_grad():
            for target, source in zip(hook_model.parameters(), default_model.parameters()):
                target.copy_(source)
        for ddp in (default_ddp, hook_ddp):
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        steps.append({name: (p.grad.clone(), q.grad.clone()) for (name, p), q in
                      zip(default_model.named_parameters(), hook_model.parameters())})
        optimizer.step()
    return dict(steps=steps, log=log)


def nonfinite_gradient(rank):
    """Rank 0's gradient holds an infinity in the first bucket of the second iteration."""

    def poison(iteration, bucket):
        if rank == 0 and iteration == 1 and bucket.index() == 0:
            bucket.gradients()[1].view(-1)[0] = float("inf")  # head.weight, compressed by both hooks

    return {
        name: run_hook(hook, errors_of, state, rank, steps=3, poison=poison)["log"]
        for name, hook, errors_of, state in (
            ("topk", ef_topk_hook, _topk_errors, EFTopKState(**TOPK)),
            ("lowrank", lowrank_ef_hook, _lowrank_errors, LowRankState(rank=2)),
        )
    }


def float64_bucket(rank):
    model = MisorderedMLP().double()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(EFTopKState(), ef_topk_hook)
    try:
        ddp(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    except Exception as error:  # DDP re-raises what the hook raised
        return f"{type(error).__name__}: {error}"
    return "no error"


def sgd_steps(ddp, optimizer, data):
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def resume(rank, hook, state_class, settings, model_name):
    """The same run uninterrupted, and restarted from a checkpoint (model, optimizer, hook state) that went
    through ``torch.save`` and ``torch.load(weights_only=True)``; and restarted without the hook state."""
    data = batches(rank, RESUME_STEPS)
    model_class = {"MisorderedMLP": MisorderedMLP, "ForwardOrderMLP": ForwardOrderMLP}[model_name]

    def start(model, state=None):
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
        state = state_class(**settings) if state is None else state
        ddp.register_comm_hook(state, hook)
        return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    model = model_class()
    ddp, _, optimizer = start(model)
    sgd_steps(ddp, optimizer, data)
    uninterrupted = flat_parameters(model)

    model = model_class()
    ddp, state, optimizer = start(model)
    sgd_steps(ddp, optimizer, data[:RESUME_AT])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()}, saved)

    def restart(with_hook_state: bool):
        checkpoint = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
        model = model_class(seed=1)
        model.load_state_dict(checkpoint["model"])
        state = state_class(**settings)
        if with_hook_state:
            state.load_state_dict(checkpoint["hook"])
        ddp, state, optimizer = start(model, state)
        optimizer.load_state_dict(checkpoint["optimizer"])
        sgd_steps(ddp, optimizer, data[RESUME_AT:])
        return flat_parameters(model), state.iteration, checkpoint["hook"]

    resumed, iteration, hook_state = restart(True)
    without_hook_state, _, _ = restart(False)
    buckets = hook_state.get("buckets", hook_state.get("layout"))
    return dict(uninterrupted=uninterrupted, resumed=resumed, without_hook_state=without_hook_state,
                iteration=iteration, saved_buckets=len(buckets))


def disagreement(rank):
    """States built differently on the two ranks: what each rank raised (None: nothing)."""
    cases = {
        "block_size": lambda: EFTopKState(**dict(TOPK, block_size=[128, 64][rank])),
        "warmup_iters": lambda: EFTopKState(**dict(TOPK, warmup_iters=rank)),
        "density": lambda: EFTopKState(**dict(TOPK, density=[0.1, 0.2][rank])),
        "rank": lambda: LowRankState(rank=[2, 3][rank]),
        "min_compression_rate": lambda: LowRankState(rank=2, min_compression_rate=[2.0, 0.0][rank]),
        "own_argument": lambda: EFTopKState(**dict(TOPK, density=[0.1, 0.0][rank])),
        "own_timeout": lambda: LowRankState(rank=2, timeout=[30.0, -1.0][rank]),
        "seed": lambda: LowRankState(rank=2, seed=rank),  # harmless: each rank's warm start is its own
    }
    raised = {}
    for name, make in cases.items():
        try:
            make()
            raised[name] = None
        except Exception as error:  # noqa: BLE001 - the test records what each rank raised
            raised[name] = (type(error).__name__, str(error))
    return raised


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_state, a, b))
    return a == b


def _edited(state_dict, path, value):
    edited = copy.deepcopy(state_dict)
    *parents, last = path
    target = edited
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value(target[last]) if callable(value) else value
    return edited


_DELETE = object()


def _nan_at_first(tensor):
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


# name: (path into the state dict, new value or a function of the old one, ranks that edit it)
TOPK_EDITS = {
    "other rank": (["process_rank"], 0, [1]),
    "other world size": (["world_size"], 3, [0, 1]),
    "negative iteration": (["iteration"], -1, [0, 1]),
    "other iteration on one rank": (["iteration"], lambda i: i + 1, [1]),
    "other density": (["settings", "density"], 0.2, [0, 1]),
    "short error": (["buckets", 0, "error"], lambda e: e[:-1], [0, 1]),
    "non-finite error": (["buckets", 0, "error"], _nan_at_first, [0, 1]),
    "unknown parameter": (["buckets", 0, "keys", 0], 99, [0, 1]),
    "unknown dtype": (["parameters", 0, 1], "int8", [0, 1]),
    "other model": (["parameters", 0, 0], [99], [0, 1]),
    "missing field": (["iteration"], _DELETE, [0, 1]),
    "other version": (["version"], 2, [0, 1]),
}
LOWRANK_EDITS = {
    "other rank": (["process_rank"], 0, [1]),
    "other approximation rank": (["settings", "rank"], 3, [0, 1]),
    "bad generator": (["generator"], torch.zeros(3, dtype=torch.uint8), [0, 1]),
    "short warm start": (["tensors", 0, "q"], lambda q: q[:-1], [0, 1]),
    "uncompressed parameter": (["tensors", 0, "key"], 1, [0, 1]),  # head.bias, 1-D
    "float64 error": (["tensors", 0, "error"], lambda e: e.double(), [0, 1]),
}


def checkpoint_refusals(rank):
    """Edited state dicts, each loaded on both ranks: what each rank raised, and whether its state stayed."""
    out = {}
    for name, hook, state_class, settings, edits in (
            ("topk", ef_topk_hook, EFTopKState, TOPK, TOPK_EDITS),
            ("lowrank", lowrank_ef_hook, LowRankState, LOWRANK, LOWRANK_EDITS)):
        model = MisorderedMLP()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
        state = state_class(**settings)
        ddp.register_comm_hook(state, hook)
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches(rank, RESUME_AT))
        saved = io.BytesIO()
        torch.save(state.state_dict(), saved)
        good = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
        results = {}
        for edit, (path, value, ranks) in edits.items():
            state_dict = _edited(good, path, value) if rank in ranks else copy.deepcopy(good)
            before = state.state_dict()
            try:
                state.load_state_dict(state_dict)
                raised = None
            except Exception as error:  # noqa: BLE001 - the test records what each rank raised
                raised = (type(error).__name__, str(error))
            results[edit] = (raised, _same_state(before, state.state_dict()))
        state.load_state_dict(good)
        results["reloaded"] = _same_state(good, state.state_dict())
        # A new process's state has not met its model yet: another model is refused at the first hook call.
        other = ForwardOrderMLP()
        ddp = nn.parallel.DistributedDataParallel(other, bucket_cap_mb=BUCKET_CAP_MB)
        state = state_class(**settings)
        state.load_state_dict(good)
        ddp.register_comm_hook(state, hook)
        x, y = batches(rank, 1)[0]
        before = [p.detach().clone() for p in other.parameters()]
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
            results["other model at the first hook call"] = None
        except ValueError as error:
            results["other model at the first hook call"] = str(error)
        results["other model untouched"] = all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
        out[name] = results
    return out


def stalled_peer(rank, hook, state_class, settings):
    """Rank 1 builds the state (timeout ``STALL_TIMEOUT``) and then sleeps past it; rank 0 runs backward."""
    model = MisorderedMLP()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(state_class(**settings, timeout=STALL_TIMEOUT), hook)
    outcome = None
    if rank == 0:
        x, y = batches(rank, 1)[0]
        began = time.monotonic()
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
            outcome = "no error"
        except RuntimeError as error:
            outcome = (time.monotonic() - began, str(error))
    else:
        time.sleep(STALL_TIMEOUT + 3.0)
    dist.barrier()  # the world group: the hook's own group is the one that failed
    return outcome


def scenarios(rank, world):
    results = {
        # The ops' Triton kernels (through the interpreter on CPU).
        "topk": run_hook(ef_topk_hook, _topk_errors, EFTopKState(**TOPK), rank),
        "lowrank": run_hook(lowrank_ef_hook, _lowrank_errors, LowRankState(**LOWRANK), rank),
    }
    with tritonopt.use_backend("reference"):  # the hooks' own logic, at the references' speed
        results.update(density_one=density_one_against_default(rank), nonfinite=nonfinite_gradient(rank),
                       float64=float64_bucket(rank))
        results["resume"] = {name: resume(rank, *case) for name, case in RESUME_CASES.items()}
        results["disagreement"] = disagreement(rank)
        results["refusals"] = checkpoint_refusals(rank)
        # Last: a timed-out collective leaves its group unusable.
        results["stalled"] = {
            "topk": stalled_peer(rank, ef_topk_hook, EFTopKState, TOPK),  # compressed from the first iteration
            "lowrank": stalled_peer(rank, lowrank_ef_hook, LowRankState, LOWRANK),  # the warm-up all-reduce
        }
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(WORLD, scenarios, timeout=600)


# --------------------------------------------------------------------------- helpers


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of a float32 sum or dot product of n terms."""
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def calls_by_iteration(log):
    return sorted(log, key=lambda e: (e["iteration"], e["index"]))


def per_parameter_steps(results, name):
    """``{iteration: {parameter: [entry of rank 0, entry of rank 1]}}`` with each entry's tensors for it."""
    steps = {}
    for rank_result in results:
        log = rank_result[name]["log"] if "log" in rank_result[name] else rank_result[name]
        for entry in log:
            for parameter, _ in entry["layout"]:
                steps.setdefault(entry["iteration"], {}).setdefault(parameter, []).append(dict(
                    warmup=entry["warmup"], grad=entry["grads"][parameter].double(),
                    out=entry["outs"][parameter].double(), error=entry["errors"].get(parameter)))
    return steps


def previous_errors(steps, iteration, parameter, shape):
    """Each rank's error for ``parameter`` after ``iteration - 1`` (zeros before the first compressed step)."""
    if iteration - 1 in steps:
        return [e["error"].double() if e["error"] is not None else torch.zeros(shape, dtype=torch.float64)
                for e in steps[iteration - 1][parameter]]
    return [torch.zeros(shape, dtype=torch.float64)] * WORLD


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", ["topk", "lowrank"])
def test_ranks_stay_bitwise_identical_and_train(results, name):
    first, second = (r[name]["params"] for r in results)
    assert torch.equal(first, second)
    assert not torch.equal(first, results[0][name]["initial"])  # the steps changed the parameters


def test_buckets_were_rebuilt_during_the_run(results):
    """Otherwise the carry-over of the Top-k error across DDP's rebuild would go unchecked."""
    log = calls_by_iteration(results[0]["topk"]["log"])
    first = [entry["layout"] for entry in log if entry["iteration"] == 0]
    later = [entry["layout"] for entry in log if entry["iteration"] == 1]
    assert len(first) == 1 and len(later) == 3 and sorted(sum(later, [])) == sorted(first[0])


def test_topk_error_feedback_identity_per_parameter_and_step(results):
    """``W out = sum_r (grad_r + error_old_r - error_new_r)``, across DDP's bucket rebuild too.

    Per rank, ``a = fl(error_old + grad)`` (one rounding, ``u |a|``), then the message ``m``
    and the new error split ``a`` exactly (each entry goes to one of them, so ``|m| <= |a|``);
    the hook sums ``fl(m_r / W)`` over the ranks (``W - 1`` roundings) and the division by
    ``W = 2`` is exact: ``|W out - sum_r (a_r - e_new_r)| <= (W + 2) u sum_r |error_old_r + grad_r|``.
    """
    steps = per_parameter_steps(results, "topk")
    assert len(steps) == STEPS
    kept = []
    for iteration, parameters in steps.items():
        for parameter, entries in parameters.items():
            shape = entries[0]["grad"].shape
            old = previous_errors(steps, iteration, parameter, shape)
            accumulated = [e["grad"] + o for e, o in zip(entries, old)]
            sent = sum(a - e["error"].double() for a, e in zip(accumulated, entries))
            bound = (WORLD + 2) * UNIT_ROUNDOFF * sum(a.abs() for a in accumulated)
            out = entries[0]["out"]
            assert torch.equal(out, entries[1]["out"])
            assert ((WORLD * out - sent).abs() <= bound).all(), (iteration, parameter)
            kept.append(entries[0]["error"] != 0)
    # Error feedback keeps what was not sent: at 10 % density, most entries.
    assert torch.cat([k.reshape(-1) for k in kept]).float().mean() > 0.5


def test_lowrank_error_feedback_identity_per_parameter_and_step(results):
    """``W out = sum_r (grad_r + error_old_r - error_new_r)`` for the compressed tensors, and the plain
    average for the others.

    Per rank: ``A = fl(error_old + grad)`` (``u |A|``); ``error_new = fl(A - fl(P Q^T))`` with the
    rank-``r`` product off by at most ``gamma_r (|P||Q|^T)`` and the subtraction by
    ``u |error_new|``; the hook's ``fl(P_cat Q_cat^T) / W`` is off by ``gamma_{Wr} sum_r |P_r||Q_r|^T``
    and ``u |out|``. ``P`` has orthonormal columns (``|P_ik| <= 1``) and ``Q = A^T P``, so
    ``|Q_jk| <= ||A[:, j]||`` and ``(|P||Q|^T)_ij <= r ||A[:, j]||`` (a factor 1.01 covers the
    rounding of ``P``'s norms and of ``Q``).
    """
    steps = per_parameter_steps(results, "lowrank")
    compressed_seen = set()
    for iteration, parameters in steps.items():
        for parameter, entries in parameters.items():
            out = entries[0]["out"]
            assert torch.equal(out, entries[1]["out"])
            grads = [e["grad"] for e in entries]
            if entries[0]["warmup"] or entries[0]["error"] is None:  # averaged uncompressed
                bound = (WORLD + 1) * UNIT_ROUNDOFF * sum(g.abs() for g in grads)
                assert ((WORLD * out - sum(grads)).abs() <= bound).all(), (iteration, parameter)
                continue
            compressed_seen.add(parameter)
            shape = grads[0].shape
            r = min(LOWRANK["rank"], shape[0], math.prod(shape[1:]))
            old = previous_errors(steps, iteration, parameter, shape)
            accumulated = [(g + o).reshape(shape[0], -1) for g, o in zip(grads, old)]
            new_errors = [e["error"].double().reshape(shape[0], -1) for e in entries]
            sent = sum(a - e for a, e in zip(accumulated, new_errors))
            column_norms = sum(a.norm(dim=0, keepdim=True) for a in accumulated)  # [1, m]
            bound = ((gamma(WORLD * r) + gamma(r)) * 1.01 * r * column_norms
                     + UNIT_ROUNDOFF * (sum(a.abs() for a in accumulated) + sum(e.abs() for e in new_errors)
                                        + WORLD * out.reshape(shape[0], -1).abs()))
            assert ((WORLD * out.reshape(shape[0], -1) - sent).abs() <= bound).all(), (iteration, parameter)
            # Rank 2 of a 10x24 or 24x12 gradient leaves a residual.
            assert new_errors[0].abs().max() > 0
    assert compressed_seen == {"head.weight", "body.weight"}  # 12x6 fails the compression-rate test


def test_density_one_equals_ddp_default_average(results):
    """Both average the same float32 gradients, with ``W - 1`` roundings of the sum and one of the
    division each: ``|hook - default| <= 2 W u sum_r |g_r| / W`` per entry (``W = 2``: both are exact up
    to one rounding of ``g_0 + g_1``, and equal here)."""
    local = {}
    for rank_result in results:
        for entry in rank_result["density_one"]["log"]:
            for parameter, grad in entry["grads"].items():
                local.setdefault((entry["iteration"], parameter), []).append(grad.double())
            assert all(e.abs().max() == 0 for e in entry["errors"].values())  # everything was sent
    for rank_result in results:
        for step, grads in enumerate(rank_result["density_one"]["steps"]):
            for parameter, (default, hooked) in grads.items():
                bound = 2 * UNIT_ROUNDOFF * sum(g.abs() for g in local[(step, parameter)])
                difference = (default.double() - hooked.double()).abs()
                assert (difference <= bound).all(), (step, parameter)
    assert len(local) == 3 * 6


def test_byte_counters_equal_the_formulas(results):
    """Top-k: per compressed call, ``E`` kept entries as float32 values and int16 positions, padded to
    4 bytes; low rank: ``4 r (n + m)`` per compressed tensor, 4 bytes per other element."""
    for rank_result in results:
        topk_sent = 0
        for entry in rank_result["topk"]["log"]:
            numel = sum(math.prod(shape) for _, shape in entry["layout"])
            block = min(TOPK["block_size"], numel)
            blocks = -(-numel // block)
            last = numel - (blocks - 1) * block
            entries = (blocks - 1) * math.ceil(TOPK["density"] * block) + math.ceil(TOPK["density"] * last)
            topk_sent += 4 * entries + 4 * math.ceil(2 * entries / 4)
        stats = rank_result["topk"]["stats"]
        assert set(stats) == {"config_check", "topk_allgather"}
        # The start-up agreement: the number of digests, then 5 of them (names, 3 settings, the ranks).
        assert stats["config_check"] == dict(calls=2, bytes_sent=8 + 5 * 8, bytes_received=(WORLD - 1) * (8 + 5 * 8))
        assert stats["topk_allgather"] == dict(calls=len(rank_result["topk"]["log"]), bytes_sent=topk_sent,
                                               bytes_received=(WORLD - 1) * topk_sent)

        warmup = factors = plain = 0
        compressed_calls = plain_calls = 0
        for entry in rank_result["lowrank"]["log"]:
            if entry["warmup"]:
                warmup += 4 * sum(math.prod(shape) for _, shape in entry["layout"])
                continue
            shapes = [(s[0], math.prod(s[1:]), len(s)) for _, s in entry["layout"]]
            compressed = [(n, m) for n, m, dims in shapes if dims >= 2 and 2 * 2 * (n + m) < n * m]
            factors += sum(4 * 2 * (n + m) for n, m in compressed)
            plain += 4 * sum(n * m for n, m, dims in shapes) - sum(4 * n * m for n, m in compressed)
            compressed_calls += bool(compressed)
            plain_calls += len(compressed) < len(shapes)
        stats = rank_result["lowrank"]["stats"]
        assert set(stats) == {"config_check", "warmup_allreduce", "lowrank_allgather", "uncompressed_allreduce"}
        assert stats["config_check"] == dict(calls=2, bytes_sent=8 + 5 * 8, bytes_received=(WORLD - 1) * (8 + 5 * 8))
        assert stats["warmup_allreduce"] == dict(calls=1, bytes_sent=warmup, bytes_received=warmup)
        assert stats["lowrank_allgather"] == dict(calls=compressed_calls, bytes_sent=factors,
                                                  bytes_received=(WORLD - 1) * factors)
        assert stats["uncompressed_allreduce"] == dict(calls=plain_calls, bytes_sent=plain, bytes_received=plain)


@pytest.mark.parametrize("name", ["topk", "lowrank"])
def test_a_nonfinite_gradient_is_sent_but_not_remembered(results, name):
    for rank_result in results:
        log = calls_by_iteration(rank_result["nonfinite"][name])
        poisoned = [e for e in log if e["iteration"] == 1 and e["index"] == 0]
        assert len(poisoned) == 1
        assert poisoned[0]["layout"][1][0] == "head.weight"
        assert not torch.isfinite(poisoned[0]["outs"]["head.weight"]).all()  # GradScaler would see it
        assert all(torch.isfinite(e).all() for entry in log for e in entry["errors"].values())
        if rank_result is results[0]:
            assert poisoned[0]["errors"]["head.weight"].abs().max() == 0  # restarted from zero
        else:
            assert poisoned[0]["errors"]["head.weight"].abs().max() > 0
        # The other buckets of that step, and every later step, are finite again.
        assert all(torch.isfinite(o).all() for entry in log if entry["iteration"] != 1 or entry["index"] != 0
                   for o in entry["outs"].values())


def test_an_unsupported_gradient_dtype_is_named(results):
    assert all("the bucket's gradient must be float32, float16 or bfloat16, got torch.float64" in r["float64"]
               for r in results)


@pytest.mark.parametrize("make, error, match", [
    (lambda: EFTopKState(density=0.0), ValueError, "density must be > 0"),
    (lambda: EFTopKState(density=1.5), ValueError, "density must be <= 1"),
    (lambda: EFTopKState(density="1%"), TypeError, "density must be a float"),
    (lambda: EFTopKState(block_size=0), ValueError, "block_size must be an int >= 1"),
    (lambda: EFTopKState(block_size=64.0), TypeError, "block_size must be an int"),
    (lambda: EFTopKState(warmup_iters=-1), ValueError, "warmup_iters must be an int >= 0"),
    (lambda: EFTopKState(process_group="world"), TypeError, "process_group must be a torch.distributed.ProcessGroup"),
    (lambda: LowRankState(rank=0), ValueError, "rank must be an int >= 1"),
    (lambda: LowRankState(rank=True), TypeError, "rank must be an int"),
    (lambda: LowRankState(min_compression_rate=-1.0), ValueError, "min_compression_rate must be >= 0"),
    (lambda: LowRankState(min_compression_rate=float("nan")), ValueError, "min_compression_rate must be a finite"),
    (lambda: LowRankState(seed=-1), ValueError, "seed must be an int >= 0"),
    (lambda: LowRankState(warmup_iters=2.5), TypeError, "warmup_iters must be an int"),
    (lambda: ef_topk_hook(LowRankState(), None), TypeError, "state must be an instance of EFTopKState"),
    (lambda: lowrank_ef_hook(LowRankState(), None), TypeError, "bucket must be a torch.distributed.GradBucket"),
    (lambda: EFTopKState().bucket_error(-1), ValueError, "index must be an int >= 0"),
    (lambda: LowRankState().parameter_error("w"), TypeError, "parameter must be a torch.Tensor"),
    (lambda: LowRankState().compressed_shape((4, -1)), ValueError, "shape must be a sequence of non-negative ints"),
    (lambda: EFTopKState(timeout=-1.0), ValueError, "timeout must be > 0"),
    (lambda: LowRankState(timeout="1s"), TypeError, "timeout must be a float"),
])
def test_bad_arguments_raise_named_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_compressed_shape_follows_the_compression_rate_rule():
    state = LowRankState(rank=4)
    assert state.compressed_shape((256, 64)) == (256, 64, 4)
    assert state.compressed_shape((16, 3, 3, 3)) == (16, 27, 4)  # unfolded to its first dimension
    assert state.compressed_shape((8, 8)) is None  # 4 * 16 * 2 = 128 >= 64
    assert state.compressed_shape((256,)) is None
    assert LowRankState(rank=4, min_compression_rate=0).compressed_shape((3, 2)) == (3, 2, 2)  # rank capped


# --------------------------------------------------------------------------- checkpoints, agreement, timeouts


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_a_run_restarted_from_a_checkpoint_equals_the_uninterrupted_one_bitwise(results, name):
    for rank_result in results:
        run = rank_result["resume"][name]
        assert run["iteration"] == RESUME_STEPS
        # Saved after DDP's rebuild (3 buckets); the restart's first iteration has DDP's initial single bucket.
        assert run["saved_buckets"] == 3
        assert torch.equal(run["resumed"], run["uninterrupted"])
        # The hook state matters: without it the restarted run goes elsewhere.
        assert not torch.equal(run["without_hook_state"], run["uninterrupted"])
    assert torch.equal(results[0]["resume"][name]["resumed"], results[1]["resume"][name]["resumed"])


@pytest.mark.parametrize("name, layer, setting, values", [
    ("block_size", "EFTopKState", "block_size", "rank 0: 128, rank 1: 64"),
    ("warmup_iters", "EFTopKState", "warmup_iters", "rank 0: 0, rank 1: 1"),
    ("density", "EFTopKState", "density", "rank 0: 0.1, rank 1: 0.2"),
    ("rank", "LowRankState", "rank", "rank 0: 2, rank 1: 3"),
    ("min_compression_rate", "LowRankState", "min_compression_rate", "rank 0: 2.0, rank 1: 0.0"),
])
def test_every_rank_names_a_setting_that_differs_at_construction(results, name, layer, setting, values):
    for rank_result in results:
        kind, message = rank_result["disagreement"][name]
        assert kind == "ValueError"
        assert f"{layer}: the ranks were configured differently ({setting}: {values})" in message


@pytest.mark.parametrize("name, own", [
    ("own_argument", "density must be > 0.0, got 0.0"),
    ("own_timeout", "timeout must be > 0.0, got -1.0"),
])
def test_an_argument_one_rank_refuses_is_raised_on_every_rank(results, name, own):
    assert results[1]["disagreement"][name] == ("ValueError", own)
    kind, message = results[0]["disagreement"][name]
    assert kind == "ValueError" and f"rank 1 refused at start-up: ValueError: {own}" in message


def test_ranks_may_seed_their_warm_starts_differently(results):
    assert all(r["disagreement"]["seed"] is None for r in results)


@pytest.mark.parametrize("name, edits", [("topk", TOPK_EDITS), ("lowrank", LOWRANK_EDITS)])
def test_a_refused_state_dict_raises_on_every_rank_and_changes_nothing(results, name, edits):
    layer = {"topk": "EFTopKState", "lowrank": "LowRankState"}[name]
    for rank, rank_result in enumerate(results):
        refusals = rank_result["refusals"][name]
        for edit, (path, _, ranks) in edits.items():
            raised, unchanged = refusals[edit]
            assert raised is not None and raised[0] == "ValueError", (edit, rank, raised)
            assert unchanged, (edit, rank)
            if edit == "other iteration on one rank":  # no rank refuses: they disagree
                assert "the ranks were configured differently (iteration: " in raised[1]
            elif rank in ranks:
                assert raised[1].startswith(f"{layer}.load_state_dict: "), (edit, raised)
            else:  # told by the rank that refused
                assert (f"rank {ranks[0]} refused while loading its state: ValueError: {layer}.load_state_dict"
                        in raised[1])
        assert refusals["reloaded"]
        assert (f"{layer}: parameter 0 (in the order the hook first meets them) has shape (24, 6) and dtype "
                f"torch.float32, but the loaded state was saved for (10, 24) and torch.float32"
                in refusals["other model at the first hook call"])
        assert refusals["other model untouched"]


def test_refused_state_dicts_name_the_field(results):
    topk, lowrank = results[1]["refusals"]["topk"], results[1]["refusals"]["lowrank"]
    expected = [
        (topk, "other rank", "process_rank is 0 but this state has 1"),
        (topk, "other world size", "world_size is 3 but this state has 2"),
        (topk, "negative iteration", "iteration must be an int >= 0, got -1"),
        (topk, "other density", "settings.density is 0.2 but this state has 0.1"),
        (topk, "short error", "bucket 0 error must be a torch.float32 tensor of shape"),
        (topk, "non-finite error", "bucket 0 error holds a NaN or an infinity"),
        (topk, "unknown parameter", "buckets[0].keys must be an int in [0, 5], got 99"),
        (topk, "unknown dtype", "parameters[0] dtype must be one of"),
        (topk, "missing field", "the state dict must hold exactly the keys"),
        (topk, "other version", "version is 2 but this state has 1"),
        (lowrank, "other approximation rank", "settings.rank is 3 but this state has 2"),
        (lowrank, "bad generator", "generator is not a CPU generator's state"),
        (lowrank, "short warm start", "tensors[0].q must be a torch.float32 tensor of shape"),
        (lowrank, "uncompressed parameter", "tensors[0].key names parameter 1 of shape (10,), which this state does"),
        (lowrank, "float64 error", "tensors[0].error must be a torch.float32 tensor"),
    ]
    for refusals, edit, text in expected:
        assert text in refusals[edit][0][1], (edit, refusals[edit])
    assert "iteration: rank 0: 3, rank 1: 4" in topk["other iteration on one rank"][0][1]
    assert "parameters" in topk["other model"][0][1]


@pytest.mark.parametrize("name, label, collective", [
    ("topk", "topk_allgather", "all_gather_into_tensor"),
    ("lowrank", "warmup_allreduce", "all_reduce"),
])
def test_a_stalled_peer_makes_the_hook_fail_within_the_timeout(results, name, label, collective):
    waited, message = results[0]["stalled"][name]
    layer = {"topk": "EFTopKState", "lowrank": "LowRankState"}[name]
    assert f"CollectiveFailure: {layer}: the collective {label!r} ({collective}) among ranks [0, 1] failed" in message
    assert f"timeout {STALL_TIMEOUT:g} s" in message
    assert waited < STALL_TIMEOUT + 10.0  # the timeout plus slack for a loaded machine


def test_a_state_built_before_init_process_group_cannot_checkpoint():
    for state in (EFTopKState(), LowRankState()):
        with pytest.raises(RuntimeError, match="built before torch.distributed was initialized"):
            state.state_dict()
