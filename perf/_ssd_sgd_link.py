"""The SSD-SGD experiment's link model and its accounting: bytes, modeled transfer time, time spent blocked.

The model is arithmetic, not a shaped network: a collective of ``b`` payload bytes
puts ``wire(b)`` bytes on one shared link (ring all-reduce ``2 (N - 1) / N b``,
ring all-gather ``(N - 1) b`` for ``b`` the input, broadcast ``b``), which is busy
for ``latency + wire(b) / bandwidth`` seconds from the later of the collective's
issue and the end of the previous transfer (one link, transfers in order). The
real gloo collective runs at once on loopback; waiting for it returns at the
later of its real completion and that modeled end. Until it waits, a rank keeps
computing, so any overlap of communication and computation is measured, not
assumed: :class:`Link` records the seconds a rank spends blocked in waits next to
the modeled seconds of its transfers.

:meth:`Link.install` replaces ``torch.distributed``'s ``all_reduce``,
``all_gather_into_tensor``, ``all_gather_single`` and ``broadcast`` in the rank's
process by counting versions, so every method's collectives (SSDSGD's, torch's
post-local averager's, DDP's communication hooks') are counted and charged the same
way: an all-reduce sends its tensor, an all-gather its input, a broadcast its
tensor (from the source; the others count it too, which only the excluded
set-up does). DDP waits for a hook's future at the end of the backward pass
(one bucket here): :func:`linked_hook` waits inside the hook for the real
collectives and the modeled end, and counts that whole wait as blocked.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

WRAPPED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "broadcast")


class LinkTime:
    """Seconds one collective keeps the modeled link busy (0 when ``bandwidth_mbps`` is 0: no model)."""

    def __init__(self, bandwidth_mbps: float, latency_ms: float, world: int):
        if bandwidth_mbps < 0 or latency_ms < 0:
            raise ValueError(f"bandwidth_mbps and latency_ms must be >= 0, got {bandwidth_mbps}, {latency_ms}")
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.bandwidth = bandwidth_mbps * 1e6
        self.latency = latency_ms * 1e-3
        self.world = world

    def wire_bytes(self, nbytes: int, kind: str = "all_reduce") -> float:
        """Bytes a rank puts on the wire for a collective of ``nbytes`` payload (a ring schedule)."""
        if kind == "all_reduce":
            return 2 * (self.world - 1) / self.world * nbytes
        if kind == "all_gather":
            return (self.world - 1) * nbytes
        if kind == "broadcast":
            return float(nbytes)
        raise ValueError(f"kind must be all_reduce, all_gather or broadcast, got {kind!r}")

    def __call__(self, nbytes: int, kind: str = "all_reduce") -> float:
        if self.bandwidth <= 0:
            return 0.0
        return self.latency + self.wire_bytes(nbytes, kind) / self.bandwidth


class _LinkedWork:
    """A real work handle whose ``wait`` also lasts until the modeled end; the wait counts as blocked."""

    def __init__(self, link: "Link", work, done_at: float):
        self._link, self._work, self._done_at = link, work, done_at

    def wait(self, *args, **kwargs):
        began = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        self._link.sleep_until(self._done_at)
        self._link.add_blocked(time.perf_counter() - began)
        return result

    def __getattr__(self, name):  # is_completed, get_future, ...: the real handle's
        return getattr(self._work, name)


class Link:
    """One rank's link: counts every collective's payload, charges the modeled time while ``enabled``.

    Counters: ``bytes_sent`` and ``calls`` (always), ``modeled_seconds`` (the sum of the
    modeled transfer durations) and ``blocked_seconds`` (wall time spent in waits on
    communication), the latter two only while ``enabled``.
    """

    def __init__(self, link_time: LinkTime):
        self.link_time = link_time
        self.enabled = False
        self._free_at = 0.0
        self._in_hook = 0
        self._originals: dict = {}
        self.reset()

    # ------------------------------------------------------------------ accounting

    def reset(self) -> None:
        self.bytes_sent = 0
        self.calls = 0
        self.modeled_seconds = 0.0
        self.blocked_seconds = 0.0

    def counters(self) -> dict:
        return dict(bytes_sent=self.bytes_sent, calls=self.calls, modeled_seconds=self.modeled_seconds,
                    blocked_seconds=self.blocked_seconds)

    def add_blocked(self, seconds: float) -> None:
        if self.enabled and not self._in_hook:  # a hook counts its whole wait itself
            self.blocked_seconds += seconds

    def schedule(self, nbytes: int, kind: str) -> float:
        """Count a collective of ``nbytes`` payload issued now; its modeled end (now when disabled)."""
        self.bytes_sent += nbytes
        self.calls += 1
        now = time.perf_counter()
        if not self.enabled:
            return now
        seconds = self.link_time(nbytes, kind)
        self.modeled_seconds += seconds
        self._free_at = max(now, self._free_at) + seconds
        return self._free_at

    @property
    def free_at(self) -> float:
        return self._free_at

    @staticmethod
    def sleep_until(moment: float) -> None:
        remaining = moment - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    # ------------------------------------------------------------------ torch.distributed

    def install(self) -> None:
        """Route this process's ``torch.distributed`` collectives through the link."""
        if self._originals:
            raise RuntimeError("this Link is already installed")
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original):
        kind = "all_gather" if name.startswith("all_gather") else name
        payload_position, payload_keyword = (1, "input_tensor") if kind == "all_gather" else (0, "tensor")

        def collective(*args, **kwargs):
            tensor = args[payload_position] if len(args) > payload_position else kwargs[payload_keyword]
            async_op = kwargs.get("async_op", False)
            done_at = self.schedule(tensor.numel() * tensor.element_size(), kind)
            began = time.perf_counter()
            work = original(*args, **kwargs)
            if async_op:
                return _LinkedWork(self, work, done_at)
            self.sleep_until(done_at)
            self.add_blocked(time.perf_counter() - began)
            return work

        collective.__wrapped__ = original
        return collective

    @contextlib.contextmanager
    def inside_hook(self):
        self._in_hook += 1
        try:
            yield
        finally:
            self._in_hook -= 1


def linked_hook(link: Link, hook):
    """``hook`` (a DDP communication hook) waited on inside, real collectives and modeled end, counted as blocked.

    With one gradient bucket DDP calls the hook when the backward pass ends and waits
    for its future at once, so waiting inside the hook changes no timing but makes
    the blocked time measurable.
    """

    def waited(state, bucket):
        began = time.perf_counter()
        with link.inside_hook():
            value = hook(state, bucket).wait()
        link.sleep_until(link.free_at)
        link.add_blocked(time.perf_counter() - began)
        done = torch.futures.Future()
        done.set_result(value)
        return done

    return waited
