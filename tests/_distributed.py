"""Run a function on several gloo ranks in processes of their own and collect what each returns.

The launcher is :func:`perf._ranks.run_on_ranks`, shared with the experiments; here
each rank runs Triton kernels through the interpreter where there is no GPU, as the
test process does. The ranks fork from one forkserver per test session that has
imported torch and tritonopt (:data:`PRELOAD`), so a rank starts in a fraction of a
second instead of importing them anew. Still, a test module calls :func:`run_on_ranks`
once (in a module-scoped fixture) with a function that runs all of its scenarios and
returns their results; the tests then assert on those results in the parent.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from _perf import perf_module

_ranks = perf_module("_ranks")


# Every rank of the session forks from one forkserver that imported these once (it inherits this process's
# environment, TRITON_INTERPRET included): a spawned rank spends about 3 CPU-seconds importing them.
PRELOAD = ["torch", "torch.distributed.fsdp", "tritonopt", "tritonopt.optim", "tritonopt.dist"]


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0, teardown: bool = True
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process (see :mod:`perf._ranks`).

    ``teardown=False``: each rank exits without destroying its groups once it has
    reported (for scenarios that leave a group broken on purpose).
    """
    interpret = os.environ.get("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0")
    return _ranks.run_on_ranks(world_size, fn, *args, timeout=timeout, teardown=teardown,
                               env={"TRITON_INTERPRET": interpret}, start_method="forkserver", preload=PRELOAD)


def collect_from_ranks(world_size: int, fn: Callable[..., Any], *args: Any, **options: Any):
    """:func:`perf._ranks.collect_from_ranks` (runs in which a rank dies or stalls on purpose), with the
    Triton interpreter in each rank as in :func:`run_on_ranks`; ``options`` are that function's."""
    interpret = os.environ.get("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0")
    options = {"start_method": "forkserver", "preload": PRELOAD, **options}
    return _ranks.collect_from_ranks(world_size, fn, *args, env={"TRITON_INTERPRET": interpret}, **options)


def refusals_of(attempts: dict) -> dict:
    """``{name: None, or "ErrorType: message"}`` for each ``name: callable`` of ``attempts`` (ValueError and
    RuntimeError caught), so that a test can assert on every refusal a rank saw."""
    seen = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            seen[name] = None
        except (ValueError, RuntimeError) as error:
            seen[name] = f"{type(error).__name__}: {error}"
    return seen
