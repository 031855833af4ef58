"""Rank side of a stall in a sharded optimizer's step (run last in tests/test_fsdp2.py's spawn).

The model is sharded over a group of its own with a short timeout (``DeviceMesh.from_group``),
so the stall breaks that group only. Rank 1 sleeps past the timeout before its ``step()``;
rank 0's step waits in the optimizer's all-reduce and must raise ``CollectiveFailure``
within the timeout. Rank 1 then finds rank 0 gone, and fails the same way.
"""

from __future__ import annotations

import datetime
import time

import torch

STALL_TIMEOUT = 3.0  # seconds: the sharded model's group
STALL_SLEEP = STALL_TIMEOUT + 2.0


def stall_scenario(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import tritonopt
    from tritonopt.dist import CollectiveFailure

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=STALL_TIMEOUT))
    # Named, so that it is not taken for an equal mesh over the same ranks made earlier (and its group).
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("stall",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    fully_shard(model, mesh=mesh)
    opt = tritonopt.optim.MFAC(model.parameters(), lr=0.01, ngrads=4, damp=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=gen)).square().mean().backward()
        dist.barrier(group=group)  # together here, however far apart the earlier scenarios left them
        if step == 1 and rank == 1:
            time.sleep(STALL_SLEEP)
        began = time.monotonic()
        try:
            opt.step()
        except Exception as error:  # noqa: BLE001 - the test looks at the type and message
            return {"step": step, "kind": type(error).__name__, "collective_failure": isinstance(error, CollectiveFailure),
                    "message": str(error), "seconds": time.monotonic() - began}
    return {"step": 2, "kind": None, "seconds": time.monotonic() - began}
