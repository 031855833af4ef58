"""Run a function on several gloo ranks in fresh processes and collect what each returns.

Spawning costs seconds, so a test module calls :func:`run_on_ranks` once (in a
module-scoped fixture) with a function that runs all of its scenarios and
returns their results; the tests then assert on those results in the parent.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    # Tensors put on an mp queue travel as shared-memory handles that vanish
    # when the sending process exits before the parent reads them; bytes do not.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _worker(rank, world_size, port, fn, args, results, teardown=True):
    if not teardown:
        _worker_without_teardown(rank, world_size, port, fn, args, results)
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report the failure to the parent instead of hanging it
        results.put((rank, "error", traceback.format_exc()))


def _worker_without_teardown(rank, world_size, port, fn, args, results):
    """``_worker`` for scenarios that leave groups broken (a rank stalled on purpose): report, then exit
    at once, since destroying a group with work a peer never joined may wait on that peer."""
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        results.put((rank, "ok", _to_bytes(fn(rank, world_size, *args))))
    except BaseException:  # report the failure to the parent instead of hanging it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0, teardown: bool = True
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process.

    ``fn`` must be a module-level function (it is pickled by reference) and
    return picklable values (CPU tensors are fine). A rank that raises, or a
    run that exceeds ``timeout`` seconds, fails with the ranks' tracebacks.
    ``teardown=False``: each rank exits without destroying its groups once it has
    reported (for scenarios that leave a group broken on purpose).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results, teardown), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                outputs[rank] = _from_bytes(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout} s waiting for ranks {sorted(set(range(world_size)) - set(outputs))}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [outputs[r] for r in range(world_size)]
