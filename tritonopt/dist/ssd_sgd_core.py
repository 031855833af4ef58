"""SSD-SGD's per-rank state machine, without communication: what a rank computes between collectives.

:class:`~tritonopt.dist.SSDSGD` is this core plus a transport
(:mod:`tritonopt.dist.ssd_sgd_sync`) that moves its buffers between the ranks.
The core prepares each buffer a collective carries (:meth:`SSDSGDCore.prepare_warmup`,
``prepare_sync``, ``local_step``) and takes up the sum when it arrives
(``apply_warmup``, ``judge_sync``, ``apply_to_replica``); between those it runs
the phases of the algorithm (see :mod:`tritonopt.dist.ssd_sgd` for the maths):

* warm-up: the server's momentum SGD on the mean gradient, on every rank alike;
* entering the delay stage: ``pre``, the server state and the synchronised
  momentum start from the global weights;
* local steps: GLU (Eq. 8), fused with a step of the rank's shadow server
  (:class:`ShadowServerCore`) or followed by the gradient's all-reduce into a
  replica of the server (:class:`ReplicaServerCore`);
* windows: a pull starts a window from the synchronised state; a bad window
  (a non-finite value, or ranks that ran different steps) is discarded, back to
  the last synchronised state, and reported to the caller as a
  :class:`DiscardedWindow` (the caller applies ``on_nonfinite``);
* checkpoints: :class:`WindowState` holds every counter of those phases.

Nothing here issues a collective or waits for one, so K cores in one process,
with the sums written out by hand, run exactly what K ranks run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_int
from tritonopt.dist.ssd_sgd_check import CHECK_ELEMENTS, check_agrees, step_digest, write_check
from tritonopt.ops import ssd_sgd_step
from tritonopt.optim import BlockLayout
from tritonopt.optim.functional import server_momentum_sgd

__all__ = ["GROUP_KEYS", "DiscardedWindow", "FlatParameters", "ReplicaServerCore", "SSDSGDCore", "ShadowServerCore",
           "WindowState", "mismatch_message", "unpack_buffers"]

NVTX_PREFIX = "tritonopt/ssd_sgd"
# The per-group hyperparameters (ssd_sgd_step_scalars turns them into each step's scalars).
GROUP_KEYS = ("lr", "momentum", "weight_decay", "local_lr_mult", "local_weight_decay", "glu_alpha", "glu_beta")
VERDICTS = (None, "nonfinite", "mismatch")


def mismatch_message(first: int, last: int, *, discarded: bool) -> str:
    """What every rank raises (``ValueError``) when the ranks ran different steps ``first .. last - 1``."""
    what = (f"steps {first}..{last - 1} (that window was discarded on every rank)" if discarded
            else f"step {first} (nothing was modified)")
    return ("SSDSGD: the ranks' step counts or hyperparameters (lr, momentum, weight decay, GLU "
            f"settings) differed during {what}; the exact mapping of the parameter server needs "
            "identical values on every rank, e.g. the same learning-rate schedule")


def _require(condition: bool, what: str) -> None:
    """A phase called out of order is a bug of the caller: say which order the core needs."""
    if not condition:
        raise RuntimeError(f"SSD-SGD core: {what}")


def unpack_buffers(buffers: Sequence[torch.Tensor], flat: torch.Tensor, *, scale: float) -> None:
    """``buffers`` from ``flat`` (their values end to end) times ``scale``, each cast to its own dtype."""
    start = 0
    for b in buffers:
        n = b.numel()
        b.copy_((flat[start : start + n] * scale).view(b.shape))
        start += n


# --------------------------------------------------------------------------- flat parameters


class FlatParameters:
    """Every parameter of every group, end to end in one flat buffer, in group order.

    Each parameter's ``.data`` is made a view of its slice, so the fused step
    updates all of them in one pass and one all-reduce carries every group.
    This class is the only place that knows where a parameter lives.
    """

    def __init__(self, groups: Sequence[dict]):
        self.params = [p for group in groups for p in group["params"]]
        self.layout = BlockLayout(self.params, 1 << 62)  # one row: the whole vector
        self.numel = self.layout.total
        self.group_spans = []
        start = 0
        for group in groups:
            count = sum(p.numel() for p in group["params"])
            self.group_spans.append((start, count))
            start += count
        self.buffer = self.layout.zeros(self.params[0].dtype).view(-1)
        self.layout.pack([p.detach() for p in self.params], self.buffer)
        for p, view in zip(self.params, self.layout.views(self.buffer)):
            p.data = view
        self._addresses = [p.data_ptr() for p in self.params]

    def check_bound(self) -> None:
        for p, address in zip(self.params, self._addresses):
            if p.data_ptr() != address or p.device != self.buffer.device:
                raise RuntimeError(
                    "SSDSGD: a parameter no longer lives in the optimizer's flat buffer (its .data "
                    "was replaced, e.g. by model.to() after the optimizer was built); build SSDSGD "
                    "after moving the model"
                )

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat[:numel]`` shaped like each parameter."""
        return self.layout.views(flat[: self.numel])

    def group_slice(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        start, count = self.group_spans[index]
        return flat[start : start + count]

    def pack_grads(self, out: torch.Tensor) -> None:
        """Gradients into ``out[:numel]``; a parameter without one counts as zeros."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.layout.pack(grads, out[: self.numel])


# --------------------------------------------------------------------------- counters


@dataclass
class WindowState:
    """The counters of the phases: with the buffers, everything a checkpoint must restore."""

    steps: int = 0  # iterations applied (discarded windows are not counted)
    delay_ready: bool = False  # pre / server state initialised for the delay stage
    window_start: int = 0  # step count at the last consumed synchronisation
    window_digest: int = 0  # of the steps since the last launched synchronisation (shadow server)
    sync_state: str = "none"  # shadow server: "none" | "in_flight" | "ready"
    sync_scale: float = 1.0  # what the summed server state is multiplied by when pulled
    verdict: Optional[str] = None  # "nonfinite" | "mismatch" once a window is known bad
    resolved: bool = False  # the ready state's verdict has been acted on
    pull_due: bool = False  # replica server: the next delay step consumes a pull

    def saved(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DiscardedWindow:
    """A window of steps ``first .. last - 1`` that every rank discarded, and why (``verdict``)."""

    verdict: str
    first: int
    last: int


# --------------------------------------------------------------------------- the core


class SSDSGDCore:
    """One rank's buffers and counters, and the phases that are the same for both servers.

    Args:
        flat: the parameters, already moved into one flat buffer.
        sync_buffers: the floating-point buffers averaged at each synchronisation (shadow server only).
        world_size: ``K``, the number of ranks whose sums the core receives.
        delay_steps, warmup_steps: ``k`` and the paper's ``wp + 1``.
        check_bits: bits per value of the agreement check (:func:`~tritonopt.dist.ssd_sgd_check.check_digit_bits`).

    Buffers (float32, or float64 for float64 parameters): ``pre`` (d), the
    synchronised momentum (d), the gradient with the agreement check (d + 8), and
    ``sync``: ``[server weight | server momentum | sync buffers | agreement check]``,
    one all-reduce.
    """

    # What a checkpoint of this server may hold in "sync_state", and whether it may hold pull_due=True.
    SAVED_SYNC_STATES: tuple[str, ...] = ("none",)
    KEEPS_PULL_DUE = False

    def __init__(self, flat: FlatParameters, sync_buffers: Sequence[torch.Tensor], *, world_size: int,
                 delay_steps: int, warmup_steps: int, check_bits: int):
        if not isinstance(flat, FlatParameters):
            raise TypeError(f"flat must be a FlatParameters, got {type(flat).__name__}")
        check_int("world_size", world_size, low=1)
        check_int("delay_steps", delay_steps, low=1)
        check_int("warmup_steps", warmup_steps, low=0)
        check_int("check_bits", check_bits, low=3, high=16)
        for b in sync_buffers:
            if not isinstance(b, torch.Tensor) or not b.is_floating_point() or b.device != flat.buffer.device:
                raise ValueError(f"sync_buffers must be floating-point tensors on {flat.buffer.device}")
        self.flat = flat
        self.sync_buffers = list(sync_buffers)
        self.world_size = world_size
        self.delay_steps = delay_steps
        self.warmup_steps = warmup_steps
        self.check_bits = check_bits
        d = flat.numel
        dtype = torch.float64 if flat.buffer.dtype == torch.float64 else torch.float32
        device = flat.buffer.device
        self.state_dtype = dtype
        b = sum(t.numel() for t in self.sync_buffers)
        self.sync = torch.zeros(2 * d + b + CHECK_ELEMENTS, dtype=dtype, device=device)
        self.pre = torch.zeros(d, dtype=dtype, device=device)
        self.sync_momentum = torch.zeros(d, dtype=dtype, device=device)
        self.grad = torch.zeros(d + CHECK_ELEMENTS, dtype=dtype, device=device)
        self.server_weight = self.sync[:d]
        self.server_momentum = self.sync[d : 2 * d]
        self.trailer = self.sync[2 * d :]  # what follows the server state: the buffers and the check
        self.trailer_buffers = self.sync[2 * d : 2 * d + b]
        self.trailer_check = self.sync[2 * d + b :]
        self.window = WindowState(window_start=warmup_steps)

    # ------------------------------------------------------------------ where the step stands

    @property
    def in_warmup(self) -> bool:
        return self.window.steps < self.warmup_steps

    def _at_sync_point(self) -> bool:
        return (self.window.steps - self.warmup_steps) % self.delay_steps == 0

    def _check_scalars(self, scalars: list[dict]) -> None:
        if len(scalars) != len(self.flat.group_spans):
            raise ValueError(f"scalars must hold one dict per parameter group ({len(self.flat.group_spans)}), "
                             f"got {len(scalars)}")

    def _agrees(self, summed_check: torch.Tensor) -> bool:
        return check_agrees(summed_check, self.check_bits, self.world_size)

    def global_weights(self) -> torch.Tensor:
        """The flat global weights as of the last synchronisation this rank completed (not a copy)."""
        window = self.window
        if not window.delay_ready:
            return self.flat.buffer
        if window.verdict is not None:
            return self.pre
        return self._synchronised_weights()

    def _synchronised_weights(self) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ warm-up (SSGD)

    def prepare_warmup(self, scalars: list[dict]) -> torch.Tensor:
        """The packed gradient with this step's agreement check: what the warm-up sums over the ranks."""
        _require(self.in_warmup, "prepare_warmup after the warm-up")
        self._check_scalars(scalars)
        write_check(self.grad[self.flat.numel :], step_digest(self.window.steps, scalars), self.check_bits)
        return self.grad

    def apply_warmup(self, scalars: list[dict]) -> Optional[str]:
        """The server's momentum SGD on the mean of the summed gradient (now in :attr:`grad`), on every rank alike.

        Raises ``ValueError`` (nothing modified) when the ranks ran different
        steps. Returns what was not finite (nothing modified), or None once applied.
        """
        _require(self.in_warmup, "apply_warmup after the warm-up")
        self._check_scalars(scalars)
        d = self.flat.numel
        window = self.window
        if not self._agrees(self.grad[d:]):
            raise ValueError(mismatch_message(window.steps, window.steps + 1, discarded=False))
        mean = self.grad[:d].div_(self.world_size)
        updates = []
        for index, s in enumerate(scalars):
            w = self.flat.group_slice(self.flat.buffer, index)
            mom = self.flat.group_slice(self.server_momentum, index)
            new_w, new_mom = server_momentum_sgd(w, mom, self.flat.group_slice(mean, index), lr=s["lr"],
                                                 momentum=s["momentum"], weight_decay=s["weight_decay"])
            updates.append((w, mom, new_w, new_mom))
        finite = torch.stack([torch.isfinite(t).all() for u in updates for t in u[2:]]).all()
        if not bool(finite):
            return f"the averaged gradient or the update at step {window.steps} is not finite"
        for w, mom, new_w, new_mom in updates:
            w.copy_(new_w)
            mom.copy_(new_mom)
        window.steps += 1
        return None

    def enter_delay_stage(self) -> None:
        """pre = server weight = the global weight; momentum as the warm-up left it."""
        _require(not self.in_warmup and not self.window.delay_ready, "enter_delay_stage once, after the warm-up")
        self.pre.copy_(self.flat.buffer)
        self.server_weight.copy_(self.flat.buffer)
        self.sync_momentum.copy_(self.server_momentum)
        self.window.window_start = self.window.steps
        self.window.delay_ready = True

    # ------------------------------------------------------------------ bad windows

    def discard_bad_window(self) -> Optional[DiscardedWindow]:
        """Back to the last synchronised state, on every rank alike, if the window was judged bad; else None."""
        window = self.window
        if window.verdict is None:
            return None
        verdict, window.verdict = window.verdict, None
        first, last = window.window_start, window.steps
        self.server_weight.copy_(self.pre)
        self.server_momentum.copy_(self.sync_momentum)
        self.flat.buffer.copy_(self.pre)
        window.sync_scale = 1.0
        window.steps = first
        window.resolved = True
        self._mark_pull_due()
        return DiscardedWindow(verdict, first, last)

    def _mark_pull_due(self) -> None:
        """After a discard: the next delay step starts from the last synchronised state."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints

    def saved_server_is_global(self, window: WindowState) -> bool:
        """Whether the server state saved with ``window`` is the same on every rank (then the ranks compare it)."""
        raise NotImplementedError

    def restore(self, window: WindowState, *, pre: torch.Tensor, sync_momentum: torch.Tensor,
                server: torch.Tensor, trailer: torch.Tensor, local: torch.Tensor,
                sync_buffers: Sequence[torch.Tensor]) -> None:
        """Every buffer and counter from a checked checkpoint (the parameters and buffers included)."""
        d = self.flat.numel
        with torch.no_grad():
            self.pre.copy_(pre)
            self.sync_momentum.copy_(sync_momentum)
            self.sync[: 2 * d].copy_(server)
            self.sync[2 * d :].copy_(trailer)
            self.flat.buffer.copy_(local)
            for buffer, value in zip(self.sync_buffers, sync_buffers):
                buffer.copy_(value)
        self.window = dataclasses.replace(window)


class ShadowServerCore(SSDSGDCore):
    """``comm="shadow"``: each rank steps a shadow server on its own gradient; the sum of the K shadows,
    taken every k steps and scaled by 1/K, is the server's state."""

    SAVED_SYNC_STATES = ("none", "ready")

    @property
    def sync_in_flight(self) -> bool:
        return self.window.sync_state == "in_flight"

    @property
    def sync_ready(self) -> bool:
        return self.window.sync_state == "ready"

    def _synchronised_weights(self) -> torch.Tensor:
        if self.window.sync_state == "ready":
            return self.server_weight * self.window.sync_scale
        return self.pre

    def _mark_pull_due(self) -> None:
        self.window.sync_state = "ready"

    def saved_server_is_global(self, window: WindowState) -> bool:
        return window.sync_state == "ready"

    def consume_sync(self) -> Optional[DiscardedWindow]:
        """Start a window from the ready synchronised state: average the buffers, or discard a bad window."""
        _require(self.sync_ready, "consume_sync without a synchronisation ready (judge_sync first)")
        window = self.window
        discarded = self.discard_bad_window()
        if discarded is None and not window.resolved:
            if self.sync_buffers:
                unpack_buffers(self.sync_buffers, self.trailer_buffers, scale=window.sync_scale)
            window.resolved = True
        window.window_start = window.steps
        return discarded

    def local_step(self, scalars: list[dict], *, pulled: bool) -> bool:
        """GLU and the shadow server's step, fused; True when a synchronisation is due now."""
        window = self.window
        _require(window.delay_ready and not self.sync_in_flight and pulled == self.sync_ready
                 and (window.resolved or not pulled),
                 "a local step needs the delay stage, no synchronisation in flight, and pulled=True exactly "
                 "when a consumed synchronisation is ready")
        self._check_scalars(scalars)
        scale = window.sync_scale if pulled else 1.0
        with nvtx_range(f"{NVTX_PREFIX}/local_update"):
            for index, s in enumerate(scalars):
                ssd_sgd_step(
                    self.flat.group_slice(self.flat.buffer, index),
                    self.flat.group_slice(self.grad, index),
                    self.flat.group_slice(self.pre, index),
                    shadow_weight=self.flat.group_slice(self.server_weight, index),
                    shadow_momentum=self.flat.group_slice(self.server_momentum, index),
                    sync_momentum=self.flat.group_slice(self.sync_momentum, index) if pulled else None,
                    pulled=pulled, shadow_scale=scale, **s,
                )
        window.sync_state = "none"
        window.window_digest = step_digest(window.steps, scalars, window.window_digest)
        window.steps += 1
        return self._at_sync_point()

    def prepare_sync(self) -> torch.Tensor:
        """The shadow state, the sync buffers and the window's check: what the synchronisation sums."""
        _require(self.window.delay_ready and self.window.sync_state == "none",
                 "prepare_sync after a local step, with no synchronisation pending")
        if self.sync_buffers:
            self.trailer_buffers.copy_(torch.cat([b.reshape(-1).to(self.state_dtype) for b in self.sync_buffers]))
        write_check(self.trailer_check, self.window.window_digest, self.check_bits)
        return self.sync

    def sync_launched(self) -> None:
        _require(self.window.sync_state == "none", "sync_launched once per prepare_sync")
        self.window.window_digest = 0
        self.window.sync_state = "in_flight"

    def judge_sync(self) -> None:
        """The summed state arrived in :attr:`sync`: judge the window (the next step acts on the verdict)."""
        _require(self.sync_in_flight, "judge_sync without a synchronisation launched")
        window = self.window
        if not self._agrees(self.trailer_check):
            window.verdict = "mismatch"
        elif not bool(torch.isfinite(self.sync[: 2 * self.flat.numel]).all()):
            window.verdict = "nonfinite"
        window.sync_scale = 1.0 / self.world_size
        window.sync_state = "ready"
        window.resolved = False

    def show_synchronised_buffers(self) -> None:
        """The sync buffers take the averages of a good synchronisation not yet consumed (for evaluation)."""
        window = self.window
        if window.sync_state == "ready" and window.verdict is None and not window.resolved and self.sync_buffers:
            unpack_buffers(self.sync_buffers, self.trailer_buffers, scale=window.sync_scale)


class ReplicaServerCore(SSDSGDCore):
    """``comm="per_step"``: every rank advances a replica of the server by each step's mean gradient."""

    KEEPS_PULL_DUE = True

    def _synchronised_weights(self) -> torch.Tensor:
        return self.server_weight

    def _mark_pull_due(self) -> None:
        self.window.pull_due = True

    def saved_server_is_global(self, window: WindowState) -> bool:
        return True

    def pull(self) -> None:
        """Start a window from the replica (every gradient of the last window applied, any bad window discarded)."""
        _require(self.window.pull_due and self.window.verdict is None,
                 "pull when a pull is due, after discard_bad_window")
        self.flat.buffer.copy_(self.server_weight)
        self.sync_momentum.copy_(self.server_momentum)
        self.window.window_start = self.window.steps
        self.window.pull_due = False

    def local_step(self, scalars: list[dict], *, pulled: bool) -> torch.Tensor:
        """GLU on the local weights; returns the gradient with its check, to be summed over the ranks.

        A local overflow makes the sent gradient NaN, so every rank sees it in the mean.
        """
        _require(self.window.delay_ready and not self.window.pull_due,
                 "a local step needs the delay stage, and pull() first when a pull is due")
        self._check_scalars(scalars)
        bad = []
        with nvtx_range(f"{NVTX_PREFIX}/local_update"):
            for index, s in enumerate(scalars):
                bad.append(ssd_sgd_step(
                    self.flat.group_slice(self.flat.buffer, index),
                    self.flat.group_slice(self.grad, index),
                    self.flat.group_slice(self.pre, index),
                    pulled=pulled, **s,
                ))
        send = self.grad.clone()
        if int(torch.stack(bad).sum()):
            send[0] = float("nan")
        write_check(send[self.flat.numel :], step_digest(self.window.steps, scalars), self.check_bits)
        return send

    def advance(self) -> None:
        """The step's gradient is on its way: count the step; a pull is due at the end of a window."""
        self.window.steps += 1
        if self._at_sync_point():
            self.window.pull_due = True

    def apply_to_replica(self, summed: torch.Tensor, scalars: list[dict]) -> bool:
        """The server rule on one step's mean gradient (``summed``, the sum over the ranks); whether it was applied.

        The verdict is the same however a window's sums are split among calls:
        a mismatch anywhere in the window wins over a non-finite state.
        """
        d = self.flat.numel
        if summed.shape != self.grad.shape or summed.dtype != self.grad.dtype:
            raise ValueError(f"summed must be a gradient buffer like local_step's ({tuple(self.grad.shape)}, "
                             f"{self.grad.dtype}), got {tuple(summed.shape)}, {summed.dtype}")
        window = self.window
        if window.verdict == "mismatch":
            return False
        if not self._agrees(summed[d:]):
            window.verdict = "mismatch"
            return False
        if window.verdict is not None:  # non-finite already: the window will be discarded
            return False
        mean = summed[:d].div_(self.world_size)
        # In place: the replica needs no trial copy (a non-finite state is caught by judge_replica).
        for index, s in enumerate(scalars):
            w = self.flat.group_slice(self.server_weight, index)
            mom = self.flat.group_slice(self.server_momentum, index)
            g = self.flat.group_slice(mean, index)
            mom.mul_(s["momentum"]).add_(g + s["weight_decay"] * w, alpha=-s["lr"])
            w.add_(mom)
        return True

    def judge_replica(self, applied: bool) -> None:
        """After a batch of :meth:`apply_to_replica` calls: a non-finite replica marks the window bad."""
        d = self.flat.numel
        if applied and self.window.verdict is None and not bool(torch.isfinite(self.sync[: 2 * d]).all()):
            self.window.verdict = "nonfinite"
