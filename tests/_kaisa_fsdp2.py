"""Rank-side scenarios of KAISA on an FSDP2-sharded model (run inside tests/test_fsdp2.py's spawn).

Each sharded run is paired with KAISA on a plain copy of the model that sees the
same data on each rank and is given the sharded run's averaged gradients, gathered
whole, before its ``step()``. KAISA gathers the same whole gradients itself, and the
factors come from the same activations, so the two must agree bit for bit: no
tolerance is allowed. A model with 13 output rows on 2 ranks (7 and 6) and 3 rows
(2 and 1) makes every shard uneven.
"""

from __future__ import annotations

import io

import torch
from _distributed import refusals_of

KAISA_CASES = {
    "comm_opt": dict(grad_worker_fraction=1.0),
    "mem_opt": dict(grad_worker_fraction=0.5, symmetry_aware=True),
    "inverse": dict(grad_worker_fraction=1.0, compute_method="inverse", factor_update_steps=2, inv_update_steps=2),
}
KAISA_KW = dict(lr=0.1, damping=0.01, kl_clip=0.001)
KAISA_STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def _sharded(mesh, **options):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)


def _whole(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


class _Trainer:
    """A model, SGD with momentum and KAISA over it."""

    def __init__(self, model, **kaisa):
        import tritonopt

        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        self.kaisa = tritonopt.dist.KAISAPreconditioner(model, **KAISA_KW, **kaisa)

    def backward(self, rank: int, step: int):
        self.opt.zero_grad(set_to_none=True)
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(self.model(x), y).backward()

    def step(self) -> bool:
        stepped = self.kaisa.step()
        self.opt.step()
        return stepped


def compare(rank, mesh, kaisa):
    sharded, plain = _Trainer(_sharded(mesh), **kaisa), _Trainer(_model(), **kaisa)
    exact, changed, stepped = True, False, True
    for step in range(KAISA_STEPS):
        sharded.backward(rank, step)
        plain.backward(rank, step)
        raw = [p.grad.full_tensor() for p in sharded.model.parameters()]
        for p, whole in zip(plain.model.parameters(), raw):
            p.grad = whole.clone()
        stepped = sharded.step() and plain.step() and stepped
        preconditioned = [p.grad.full_tensor() for p in sharded.model.parameters()]
        exact = exact and all(torch.equal(a, p.grad) for a, p in zip(preconditioned, plain.model.parameters()))
        exact = exact and torch.equal(_whole(sharded.model), torch.cat([p.detach().reshape(-1)
                                                                         for p in plain.model.parameters()]))
        changed = changed or any(not torch.equal(a, b) for a, b in zip(preconditioned, raw))
    stats = sharded.kaisa.communicator.stats()
    gather = stats.get("grad_allgather")
    return {"exact": exact, "preconditioned": changed, "stepped": stepped,
            "gather": None if gather is None else (gather.calls, gather.bytes_sent, gather.bytes_received),
            "grad_broadcast": "grad_broadcast" in stats,
            "local_rows": [p.to_local().shape[0] for p in sharded.model.parameters()]}


def checkpoint(rank, mesh, directory, kaisa=KAISA_CASES["mem_opt"]):
    """The model and SGD through torch.distributed.checkpoint, KAISA's state (the same factors on every rank,
    each rank's eigen data) through each rank's ``state_dict()``, after 2 steps; the resumed run against the
    uninterrupted one, bit for bit. Also rank 0's KAISA state loaded on every rank: the other rank recomputes
    the eigen data of its layers from the saved factors (the same ones: an eigen update every step)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = f"{directory}/kaisa"

    def state(trainer):
        return {"model": get_model_state_dict(trainer.model),
                "optim": get_optimizer_state_dict(trainer.model, trainer.opt)}

    first = _Trainer(_sharded(mesh), **kaisa)
    for step in range(2):
        first.backward(rank, step)
        first.step()
    dcp.save(state(first), checkpoint_id=path)
    buffer = io.BytesIO()
    torch.save(first.kaisa.state_dict(), buffer)
    rank0 = [buffer.getvalue() if rank == 0 else None]
    dist.broadcast_object_list(rank0, src=0)
    for step in range(2, KAISA_STEPS):
        first.backward(rank, step)
        first.step()

    results = {}
    for source, saved in (("own", buffer.getvalue()), ("rank0", rank0[0])):
        resumed = _Trainer(_sharded(mesh), **kaisa)
        template = state(resumed)
        dcp.load(template, checkpoint_id=path)
        set_model_state_dict(resumed.model, template["model"])
        set_optimizer_state_dict(resumed.model, resumed.opt, template["optim"])
        resumed.kaisa.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True))
        for step in range(2, KAISA_STEPS):
            resumed.backward(rank, step)
            resumed.step()
        results[source] = torch.equal(_whole(first.model), _whole(resumed.model))
    results["steps"] = first.kaisa.steps
    return results


def _refusals(rank, mesh):
    import tritonopt
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def columns():  # rows sharded for the bias, columns (6 of them: 3 and 3) for the weight
        model = torch.nn.Sequential(torch.nn.Linear(6, 4))
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
        return model

    def mixed():
        model = _model()
        fully_shard(model[0], mesh=mesh)
        return model

    attempts = {
        "kfac": lambda: tritonopt.optim.KFACPreconditioner(_sharded(mesh)),
        "columns": lambda: tritonopt.dist.KAISAPreconditioner(columns()),
        "mixed": lambda: tritonopt.dist.KAISAPreconditioner(mixed()),
        "disagree": lambda: tritonopt.dist.KAISAPreconditioner(_sharded(mesh), damping=0.01 * (rank + 1)),
    }
    return refusals_of(attempts)


def kaisa_scenario(rank, mesh, directory):
    """Everything the K-FAC tests of tests/test_fsdp2.py assert on, as this rank saw it.

    On the reference ops: what is tested here is the sharding around them (the ops agree with their
    kernels in tests/test_kfac_ops.py), and the interpreted kernels would take ten times as long.
    """
    import tritonopt

    with tritonopt.use_backend("reference"):
        out = {name: compare(rank, mesh, kaisa) for name, kaisa in KAISA_CASES.items()}
        out["checkpoint"] = checkpoint(rank, mesh, directory)
        out["refusals"] = _refusals(rank, mesh)
    return out
