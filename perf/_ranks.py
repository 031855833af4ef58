"""Run a function on several gloo ranks of this machine, each in a fresh process, and collect what each returns.

The one launcher of the experiments and the distributed tests. Each rank runs
``fn(rank, world_size, *args)`` after joining a gloo process group on
127.0.0.1, with one torch thread (several ranks share a few cores) and the
environment changes asked for; what each rank returns travels back through
``torch.save`` bytes, so CPU tensors outlive the process that made them. A rank
that raises, or a run that exceeds its time, fails with every rank's traceback
instead of hanging the caller.

:func:`collect_from_ranks` is the same launcher for runs in which a rank dies or
stalls on purpose (the fault tests): each rank sends what it sees as it goes,
joins its process group itself (with the timeouts the scenario needs), and
ends without a teardown; the caller says when it has seen enough.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Mapping, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankChannel", "collect_from_ranks", "free_port", "run_on_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    # Tensors put on an mp queue travel as shared-memory handles that vanish
    # when the sending process exits before the parent reads them; bytes do not.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(payload: bytes, weights_only: bool) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=weights_only)


def _set_environment(env: Mapping[str, Optional[str]]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _worker(rank, world_size, port, fn, args, results, teardown, env, group_timeout, own_session):
    try:
        torch.set_num_threads(1)
        if own_session:
            os.setsid()
        _set_environment(env)
        kwargs = {} if group_timeout is None else {"timeout": datetime.timedelta(seconds=group_timeout)}
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, **kwargs)
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, world_size, *args))))
            if teardown:
                dist.barrier()  # every rank's result is queued before any rank tears the group down
        finally:
            if teardown:
                dist.destroy_process_group()
    except BaseException:  # report the failure to the parent instead of hanging it
        results.put((rank, "error", traceback.format_exc()))
    if not teardown:
        # A scenario that left a group broken on purpose (a rank stalled): destroying it could wait on a
        # peer that never comes, so report and leave at once.
        results.close()
        results.join_thread()
        os._exit(0)


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: Optional[float] = 240.0,
    teardown: bool = True,
    env: Optional[Mapping[str, Optional[str]]] = None,
    group_timeout: Optional[float] = None,
    weights_only: bool = False,
    own_session: bool = False,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own process.

    Args:
        fn: a module-level function (pickled by reference) returning something
            ``torch.save`` can write.
        timeout: seconds to wait for all ranks before failing (None: no limit; a rank
            that dies before reporting fails the run at once either way).
        teardown: destroy the process group after ``fn``; ``False`` for
            scenarios that leave a group broken on purpose.
        env: environment variables to set in each rank before anything runs
            (``None`` removes one).
        group_timeout: the process group's timeout in seconds (torch's default if None).
        weights_only: read the ranks' results with ``torch.load(weights_only=True)``
            (numbers, strings, lists, dicts and tensors only).
        own_session: each rank starts a session of its own (``os.setsid``), so that
            the kernel's autogroup scheduling treats the ranks as separate devices
            rather than one slice of a busy machine (the timing experiments).
        start_method: ``"spawn"`` (a fresh interpreter per rank) or ``"forkserver"``;
            ``preload``: modules the forkserver imports once, before its first rank,
            so that a rank starts without importing them again.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), or the
            ranks did not all report within ``timeout``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    ctx = mp.get_context(start_method)
    if preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(rank, world_size, port, fn, args, results, teardown, dict(env or {}), group_timeout,
                               own_session))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    began = time.monotonic()
    try:
        while len(outputs) < world_size and not errors:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                waiting = sorted(set(range(world_size)) - set(outputs))
                # A rank killed by a signal (or os._exit before reporting) never reports: say so at once.
                dead = [r for r in waiting if not procs[r].is_alive() and procs[r].exitcode not in (None, 0)]
                if dead:
                    errors += [f"rank {r} exited with code {procs[r].exitcode} before reporting" for r in dead]
                elif timeout is not None and time.monotonic() - began > timeout:
                    errors.append(f"timed out after {timeout} s waiting for ranks {waiting}")
                continue
            if status == "ok":
                outputs[rank] = _from_bytes(value, weights_only)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        # Which ranks had died on their own, before any is killed below.
        died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        # Name any rank that died without a word: its peers' errors (a reset connection) follow from it.
        errors += [f"rank {r} exited with code {code} before reporting" for r, code in died.items()
                   if r not in outputs and f"rank {r} exited" not in "".join(errors)]
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [outputs[r] for r in range(world_size)]


class RankChannel:
    """A rank's side of :func:`collect_from_ranks`: where to rendezvous, and the line to the caller."""

    def __init__(self, rank: int, init_method: str, results):
        self.rank = rank
        self.init_method = init_method  # for dist.init_process_group, with the scenario's own timeout
        self._results = results

    def put(self, key: str, value: Any = None) -> None:
        """Send ``(rank, key, value)`` to the caller now (``value``: anything ``torch.save`` writes)."""
        self._results.put((self.rank, key, _to_bytes(value)))

    def exit(self, code: int = 0) -> NoReturn:
        """Deliver what was put, then end this process at once: no teardown, a group may be broken."""
        self._results.close()
        self._results.join_thread()
        os._exit(code)


def _channel_worker(rank, world_size, init_method, fn, args, results, env):
    channel = RankChannel(rank, init_method, results)
    try:
        torch.set_num_threads(1)
        _set_environment(env)
        fn(rank, world_size, channel, *args)
    except BaseException:  # report the failure to the caller instead of hanging it
        channel.put("error", traceback.format_exc())
    channel.exit(0)


def collect_from_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    done: Callable[[list], bool],
    timeout: float,
    on_timeout: str = "raise",
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    env: Optional[Mapping[str, Optional[str]]] = None,
    grace: float = 0.0,
) -> tuple[list[tuple[int, str, Any]], dict[int, Optional[int]]]:
    """Run ``fn(rank, world_size, channel, *args)`` on each rank; collect what the ranks send.

    ``channel`` is the rank's :class:`RankChannel`: ``fn`` joins its process group
    at ``channel.init_method`` and sends ``channel.put(key, value)`` as it goes; a
    rank may die or stall on purpose. The reports, ``[(rank, key, value)]`` in order
    of arrival, are collected until ``done(reports)`` is true; then every rank still
    running after ``grace`` seconds is killed.

    Args:
        done: when the caller has seen enough (called after each report, and before the first).
        timeout: seconds to wait for ``done``.
        on_timeout: ``"raise"`` (a ``RuntimeError`` listing the reports so far) or
            ``"return"`` (what arrived; the caller judges it).
        start_method: ``"spawn"`` or ``"forkserver"``; ``preload``: modules the
            forkserver imports once for every rank (a start then costs about a second).
        env: environment variables to set in each rank first (``None`` removes one).
        grace: seconds the ranks get to end on their own once ``done`` (a rank that
            exits with a code of its own, to be checked).

    Returns:
        The reports, and each rank's exit code (``-9`` where it was killed here).

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), or ``timeout``
            passed with ``on_timeout="raise"``.
    """
    if on_timeout not in ("raise", "return"):
        raise ValueError(f"on_timeout must be 'raise' or 'return', got {on_timeout!r}")
    ctx = mp.get_context(start_method)
    if preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_channel_worker, daemon=True,
                         args=(rank, world_size, init_method, fn, args, results, dict(env or {})))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    reports: list[tuple[int, str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while not done(reports):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if on_timeout == "return":
                    break
                raise RuntimeError(f"timed out after {timeout} s; the ranks reported {[r[:2] for r in reports]}")
            try:
                rank, key, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            value = _from_bytes(payload, weights_only=False)
            if key == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            reports.append((rank, key, value))
    finally:
        ends = time.monotonic() + grace
        for p in procs:
            p.join(timeout=max(0.0, ends - time.monotonic()))
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return reports, {rank: p.exitcode for rank, p in enumerate(procs)}
