"""SSD-SGD: several-steps-delay SGD with global-gradient local updates (Xu et al., SSD-SGD).

The paper runs on a parameter server: every worker pushes its gradient every
iteration (the server applies synchronous momentum SGD to the mean of the K
workers' gradients) but pulls the global weights only every ``k`` iterations;
in between each worker trains on its own local weights with GLU (Eq. 8), which
mixes its gradient with ``grad_sync``, the global gradient estimated from two
pulled weights (sec. 3.2.1). The first ``wp + 1`` iterations are plain
synchronous SGD (the warm-up stage, sec. 3.1). This module maps that onto
``torch.distributed`` collectives with no server process.

Per rank, iteration ``t`` (``g`` the rank's own gradient, at the weights it
last trained on; MXNet's server rule ``mom = m mom - lr (g + wd w); w += mom``):

* warm-up, ``t < warmup_steps`` (the paper's ``wp + 1``): ``g`` is all-reduced
  and averaged, and every rank applies the server rule to the parameters,
  which therefore are the global weights on every rank;
* delay stage, ``j = t - warmup_steps``: GLU (Algorithm 2, descent sign)::

      w_src     = the pulled global weight if a pull arrived since the last step, else p
      grad_sync = (1 - m) / (lr k) * (pre - w_src)
      pre       = w_src                                        (only after a pull)
      p         = w_src - local_lr * (glu_alpha g + local_weight_decay w_src + glu_beta grad_sync)

  and a pull is issued at the end of every iteration with ``j % k == k - 1``,
  to be consumed by the next iteration's GLU (Algorithm 1 lines 20-22).

``comm="shadow"`` (default; sec. 2.2 of the design note). The server rule is
affine in ``(w, mom, g)`` for fixed scalars, so each rank runs a *shadow
server* ``(sw, smom)`` on its own gradient from the last synchronised state;
the mean of the K shadows after ``k`` steps is exactly the server's state.
The pull becomes one asynchronous all-reduce of ``[sw; smom]`` (2d values)
launched at the end of iteration ``j`` and waited on at the start of
iteration ``j + 1``, so it overlaps that iteration's forward and backward.
The GLU and the shadow step run fused in one pass over flat buffers
(:func:`tritonopt.ops.ssd_sgd_step`). Exact for this linear server with
identical scalars on every rank (checked, below).

``comm="per_step"`` (reference). Each iteration's gradient is all-reduced
asynchronously (d values, DDP's volume) into a replica of the server state on
every rank; the replica is advanced through iteration ``j`` before the GLU of
``j + 1``. No rank waits for another except at those points.

Collectives (through :class:`~tritonopt.dist.CountingCommunicator`;
``s`` bytes per element of the state dtype: 4, or 8 for float64 parameters;
``b`` the elements of ``sync_buffers``; every all-reduce carries
``CHECK_ELEMENTS = 8`` more values that let all ranks verify, together, that
they used the same step count and hyperparameters: a 64-bit BLAKE2b digest of
them as five digits of ``B`` bits and three ``B``-bit limbs of the digits'
squared norm, ``B = min(16, M - bits(K))`` with ``M`` = 24 (float32) or 53
(float64) mantissa bits, so that every sum is exact; the ranks agree iff
``|sum v|^2 = K sum |v|^2``. All 64 bits are compared on up to 2047 ranks in
float32):

============================  =====================  ===================================
label                         when                   size
============================  =====================  ===================================
``config_check``              construction           two all-gathers of int64 digests
                                                     (one value, then one per checked
                                                     setting and one more): ranks agree
                                                     on shapes and hyperparameters
``load_state_dict_check``     ``load_state_dict``    the same, plus counters and state
``initial_broadcast``         construction           the parameters (their dtype), and
                                                     the floating ``sync_buffers``
``warmup_grad_allreduce``     each warm-up step      ``(d + 8) s``
``shadow_sync_allreduce``     every k delay steps    ``(2d + b + 8) s``
``per_step_grad_allreduce``   each delay step        ``(d + 8) s``
============================  =====================  ===================================

Memory per rank besides the parameters (which SSDSGD moves into one flat
buffer: each parameter's ``.data`` becomes a view of it): ``pre`` (d), the
shadow or replica server state (2d), the momentum of the last synchronised
state (d, for discarding a window, below), and a gradient buffer (d), all in
float32 (float64 for float64 parameters), one packed group across all
parameter groups (:meth:`state_bytes` counts them); ``per_step`` also keeps up
to ``k + 1`` gradient buffers in flight.

Non-finite values (``on_nonfinite="skip"`` or ``"raise"``; every rank decides
together). Warm-up: the averaged gradient and the update are checked on every
rank (they are identical there); a bad step changes nothing. Delay stage: an
element whose local update is not finite keeps its value and poisons the
rank's shadow (NaN), so every rank sees it in the next synchronised state; the
whole window since the last pull is then discarded on every rank: the server
state goes back to the last synchronised one, and the parameters to its
weights. ``"skip"`` warns and adds the window's steps to ``skipped_steps``;
``"raise"`` raises ``FloatingPointError`` at that point. A rank whose step
count or hyperparameters (learning-rate schedule included) differ from the
others' makes every rank raise ``ValueError`` at the next synchronisation
(the window is discarded first). :meth:`SSDSGD.finalize` acts on neither: the
next step does, so training is the same with or without it.

A rank that stops early: the others raise
:class:`~tritonopt.dist.CollectiveFailure` (a ``RuntimeError``) from their next
wait, naming the collective and the ranks, after at most ``timeout`` (SSDSGD
then runs on its own copy of the group, created with it; default: the process
group's timeout; a dead peer is usually noticed sooner). A rank that refuses
its own arguments (construction) or state dict (``load_state_dict``) still
joins the agreement check, so every rank raises that error at once, the
others naming the rank.

BatchNorm and other buffers are local (like MXNet's auxiliary states);
``sync_buffers=model.buffers()`` averages the floating-point ones at each
delay-stage synchronisation (with the state of the same iteration; ``comm="shadow"``
only), and keeps integer ones (``num_batches_tracked``) local.

A parameter without a gradient counts as a zero gradient (the server still
applies momentum and weight decay to it, as a parameter server updates every
key); leave frozen parameters out of the optimizer.

Checkpoints are per rank: ``state_dict`` flushes an in-flight synchronisation
first, and holds the counters, ``pre``, the server state, the rank's local
weights and its ``sync_buffers``, with what it was saved for (rank, world size,
settings, each parameter's shape and dtype in order); ``load_state_dict``
restores all of them (the parameters and buffers included, over what
construction broadcast from rank 0), on the same rank of the same world size,
after checking every field's type and range and every tensor's shape and dtype
(nothing is cast), and checks with the agreement check that the ranks' global
state agrees. ``copy.deepcopy`` and ``pickle`` are refused (a
process group cannot be copied).
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import math
import struct
import warnings
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_choice, check_float, check_int
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.ops import ssd_sgd_step
from tritonopt.optim import BlockLayout, PackedGroup, PackedOptimizer
from tritonopt.optim.functional import server_momentum_sgd, ssd_sgd_step_scalars

__all__ = ["SSDSGD", "COMM_MODES", "CHECK_ELEMENTS"]

COMM_MODES = ("shadow", "per_step")
CHECK_ELEMENTS = 8
# The agreement check: a 64-bit digest of the step counts and hyperparameters as CHECK_DIGITS digits,
# and the CHECK_ELEMENTS - CHECK_DIGITS limbs of their squared norm (see _write_check).
CHECK_DIGITS = 5
DIGEST_BITS = 64
_GROUP_KEYS = ("lr", "momentum", "weight_decay", "local_lr_mult", "local_weight_decay",
               "glu_alpha", "glu_beta")
_STATE_NAMES = ("pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum")
# What a checkpoint holds per parameter: the state above and the rank's local weight.
_ENTRY_NAMES = frozenset(_STATE_NAMES + ("local_weight",))
# Entries that must be finite; the shadow may hold a bad window's NaN until its synchronisation.
_FINITE_ENTRIES = ("pre_weight", "sync_momentum", "local_weight")
# The checkpoint's "ssd_sgd" entry: what it must hold, no more.
_SAVED_FIELDS = frozenset((
    "rank", "world_size", "comm", "delay_steps", "warmup_steps", "layout", "steps", "delay_ready",
    "window_start", "window_digest", "sync_state", "sync_scale", "verdict", "resolved", "pull_due", "trailer",
    "sync_buffers",
))
_VERDICTS = (None, "nonfinite", "mismatch")
_ALGO = "tritonopt/ssd_sgd"


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _setup_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the agreement check's small tensors live: NCCL needs the current CUDA device, gloo the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_digit_bits(world_size: int, param_dtype: torch.dtype) -> int:
    """Bits per value of the agreement check: the sum over ``world_size`` ranks must stay exact in the state dtype.

    16 bits (float32, up to 256 ranks) carry the 64-bit digest in four digits;
    at least 13 (up to 2047 ranks in float32) still carry all of it in five.
    """
    mantissa = 53 if param_dtype == torch.float64 else 24
    bits = min(16, mantissa - world_size.bit_length())
    if bits < 3:  # the squared norm would not fit its limbs
        raise ValueError(f"SSDSGD's agreement check cannot be exact on {world_size} ranks in this dtype")
    return bits


def _layout(groups: Sequence[dict]) -> list[list[tuple]]:
    """Each group's parameters as (shape, dtype) pairs, in order: what a checkpoint was saved for."""
    return [[(tuple(p.shape), p.dtype) for p in group["params"]] for group in groups]


# --------------------------------------------------------------------------- checkpoint fields


def _saved_int(extra: dict, name: str, low: int, high: Optional[int] = None) -> int:
    value = extra[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"ssd_sgd[{name!r}] must be an int {bound}, got {value!r}")
    return value


def _saved_bool(extra: dict, name: str) -> bool:
    value = extra[name]
    if not isinstance(value, bool):
        raise ValueError(f"ssd_sgd[{name!r}] must be a bool, got {value!r}")
    return value


def _saved_choice(extra: dict, name: str, choices: Sequence):
    value = extra[name]
    if not (value is None or isinstance(value, str)) or value not in choices:
        raise ValueError(f"ssd_sgd[{name!r}] must be one of {list(choices)}, got {value!r}")
    return value


def _saved_layout(saved) -> Optional[list[list[tuple]]]:
    """A saved ``layout`` in the form :func:`_layout` gives, or None if it is not one."""
    try:
        return [[(tuple(shape), dtype) for shape, dtype in group] for group in saved]
    except (TypeError, ValueError):
        return None


def _check_saved_tensor(name: str, value, shape: tuple, dtype: torch.dtype, *, finite: bool = False) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if value.dtype != dtype:
        raise ValueError(f"{name} is {value.dtype}, expected {dtype} (a checkpoint is not cast)")
    if finite and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} holds NaN or inf")


# --------------------------------------------------------------------------- flat parameters


class _FlatParameters:
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


# --------------------------------------------------------------------------- the optimizer


class SSDSGD(PackedOptimizer):
    """SSD-SGD on ``torch.distributed``; run one instance on every rank (see the module docstring).

    Args:
        params: parameters or parameter groups; all floating point, one dtype and one device.
            Groups may set ``lr``, ``momentum``, ``weight_decay``, ``local_lr_mult``,
            ``local_weight_decay``, ``glu_alpha`` and ``glu_beta``.
        lr: the server's learning rate (the global model's).
        momentum: the server's momentum ``m``, in ``[0, 1)``.
        weight_decay: the server's L2 weight decay.
        delay_steps: ``k``, the pull period (>= 1; ``k = 1`` is one-step delay, not SSGD).
        warmup_steps: iterations of synchronous SGD before the delay stage (the paper's
            ``wp + 1``; 500 in its experiments).
        glu_alpha, glu_beta: Eq. 8's weights of the local gradient and of ``grad_sync``.
        local_lr_mult: the local learning rate is ``local_lr_mult * lr`` (4 in the paper).
        local_weight_decay: Eq. 8's ``wd``; None: ``weight_decay``.
        comm: ``"shadow"`` (one all-reduce of 2d values every k steps) or ``"per_step"``.
        process_group: the group of the ranks (None: the world); its timeout bounds every wait.
        on_nonfinite: ``"skip"`` or ``"raise"`` (see the module docstring).
        sync_buffers: tensors (e.g. ``model.buffers()``) whose floating-point ones are
            averaged at each delay-stage synchronisation; broadcast from rank 0 at construction.
        communicator: a :class:`~tritonopt.dist.CountingCommunicator` to issue the
            collectives through (None: one is made for ``process_group``); ``comm``
            holds it, with its counters.
        timeout: seconds or a ``datetime.timedelta``. SSDSGD then runs on its own copy
            of ``process_group`` created with this timeout (after the agreement check,
            which runs on ``process_group``), so a rank that dies or stalls makes the
            others raise :class:`~tritonopt.dist.CollectiveFailure` within it; None
            (default): ``process_group`` and its own timeout.

    Pass each rank its own local gradients (no DDP). Construction issues the
    agreement check (two small all-gathers) and the broadcast of rank 0's parameters.
    A rank whose own arguments are refused still joins the agreement check, so every
    rank raises that error (the others name the rank) at once.
    """

    CHECK_ELEMENTS = CHECK_ELEMENTS  # values appended to every all-reduce (see the module docstring)

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        delay_steps: int = 5,
        warmup_steps: int = 500,
        glu_alpha: float = 2.0,
        glu_beta: float = 0.5,
        local_lr_mult: float = 4.0,
        local_weight_decay: Optional[float] = None,
        comm: str = "shadow",
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        on_nonfinite: str = "skip",
        sync_buffers: Iterable[torch.Tensor] = (),
        communicator: Optional[CountingCommunicator] = None,
        timeout: Union[None, float, datetime.timedelta] = None,
    ):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        local_lr_mult=local_lr_mult, local_weight_decay=local_weight_decay,
                        glu_alpha=glu_alpha, glu_beta=glu_beta)
        # This rank's own checks; a refusal is shared with the other ranks at the agreement check below.
        problem: Optional[Exception] = None
        buffers: list[torch.Tensor] = []
        try:
            check_int("delay_steps", delay_steps, low=1)
            check_int("warmup_steps", warmup_steps, low=0)
            check_choice("comm", comm, COMM_MODES)
            if communicator is not None and not isinstance(communicator, CountingCommunicator):
                raise TypeError("communicator must be a tritonopt.dist.CountingCommunicator")
            own_timeout = None if timeout is None else resolve_timeout(timeout)
            self.delay_steps = delay_steps
            self.warmup_steps = warmup_steps
            self.comm_mode = comm
            self._building = True
            try:
                super().__init__(params, defaults, on_nonfinite)
            finally:
                self._building = False
            self._check_parameters()
            buffers = self._check_sync_buffers(sync_buffers)
            if buffers and comm != "shadow":
                raise ValueError("sync_buffers are averaged with the shadow synchronisation: use comm='shadow'")
        except Exception as exc:  # any refusal, so that the other ranks hear of it instead of waiting
            problem = exc

        if not dist.is_available() or not dist.is_initialized():
            if problem is not None:
                raise problem
            raise RuntimeError("SSDSGD needs an initialised torch.distributed process group")
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        self.comm = communicator if isinstance(communicator, CountingCommunicator) else CountingCommunicator(
            process_group)
        check_ranks_agree(
            "SSDSGD", None if problem is not None else self._settings(buffers, own_timeout),
            comm=GuardedCommunicator(self.comm, layer="SSDSGD", timeout=resolve_timeout(None, process_group)),
            group=process_group, device=_setup_device(process_group), problem=problem,
        )
        # Every rank agreed on the timeout, so every member creates the timed group (or none does).
        self._requested_timeout = own_timeout
        self.timeout = own_timeout if own_timeout is not None else resolve_timeout(None, process_group)
        if own_timeout is not None:
            members = dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD)
            process_group = timed_group(members, own_timeout, layer="SSDSGD", local=True)
        self.process_group = process_group
        self._collectives = GuardedCommunicator(self.comm, layer="SSDSGD", timeout=self.timeout)
        self._check_bits = _check_digit_bits(self.world_size, self.param_groups[0]["params"][0].dtype)

        with torch.no_grad():
            self._flat = _FlatParameters(self.param_groups)
            self._sync_buffers = buffers
            source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            self._collectives.broadcast(self._flat.buffer, source, label="initial_broadcast", group=process_group)
            if buffers:
                packed = torch.cat([b.reshape(-1).to(self._flat.buffer.dtype) for b in buffers])
                self._collectives.broadcast(packed, source, label="initial_broadcast", group=process_group)
                self._unpack_buffers(packed, scale=1.0)
        self._allocate_state()

        self._steps = 0  # iterations applied (discarded windows are not counted)
        self._delay_ready = False  # pre / server state initialised for the delay stage
        self._window_start = warmup_steps  # step count at the last consumed synchronisation
        self._window_digest = 0  # of the steps since the last launched synchronisation (shadow)
        self._sync_state = "none"  # shadow: "none" | "in_flight" | "ready"
        self._work = None
        self._sync_scale = 1.0
        self._verdict: Optional[str] = None  # "nonfinite" | "mismatch" once a window is known bad
        self._resolved = False  # the ready state's verdict has been acted on
        self._pending: collections.deque = collections.deque()  # per_step: (buffer, work, scalars)
        self._pull_due = False  # per_step: the next delay step consumes a pull

    # ------------------------------------------------------------------ set-up

    def _check_group(self, group: dict) -> None:
        check_float("lr", group["lr"], low=0.0)
        check_float("momentum", group["momentum"], low=0.0, high=1.0, high_open=True)
        check_float("weight_decay", group["weight_decay"], low=0.0)
        check_float("local_lr_mult", group["local_lr_mult"], low=0.0)
        if group["local_weight_decay"] is not None:
            check_float("local_weight_decay", group["local_weight_decay"], low=0.0)
        check_float("glu_alpha", group["glu_alpha"])
        check_float("glu_beta", group["glu_beta"])

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError("SSDSGD packs its parameters at construction: pass every group to it")
        for key in param_group:
            if key not in _GROUP_KEYS and key != "params":
                raise ValueError(
                    f"{key!r} is not a per-group setting of SSDSGD (those are {', '.join(_GROUP_KEYS)})"
                )
        super().add_param_group(param_group)

    def _check_parameters(self) -> None:
        """Across groups: one dtype, one device, dense, some elements (each group is checked as it is added)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if not params:
            raise ValueError("SSDSGD got no parameters")
        first = params[0]
        for p in params:
            if p.dtype != first.dtype:
                raise ValueError(f"all parameters must share one dtype, found {first.dtype} and {p.dtype}")
            if p.device != first.device:
                raise ValueError(f"all parameters must be on one device, found {first.device} and {p.device}")
            if p.is_sparse:
                raise ValueError("SSDSGD does not support sparse parameters")
        if sum(p.numel() for p in params) == 0:
            raise ValueError("SSDSGD's parameters hold no elements")

    def _check_sync_buffers(self, sync_buffers) -> list[torch.Tensor]:
        if isinstance(sync_buffers, torch.Tensor):
            raise TypeError("sync_buffers must be an iterable of tensors, e.g. model.buffers()")
        device = self.param_groups[0]["params"][0].device
        chosen = []
        for b in sync_buffers:
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"sync_buffers must hold tensors, got {type(b).__name__}")
            if b.device != device:
                raise ValueError(f"a sync buffer is on {b.device} but the parameters are on {device}")
            if b.is_floating_point() and b.numel():  # integer counters stay local
                chosen.append(b)
        return chosen

    def _settings(self, buffers, timeout: Optional[datetime.timedelta]) -> dict[str, object]:
        """What every rank must hold alike (the agreement check)."""
        groups = self.param_groups
        return {
            "the number of parameter groups": len(groups),
            "the parameter shapes": [[tuple(p.shape) for p in g["params"]] for g in groups],
            "the parameter dtype": str(groups[0]["params"][0].dtype),
            **{key: [g[key] for g in groups] for key in _GROUP_KEYS},
            "delay_steps": self.delay_steps,
            "warmup_steps": self.warmup_steps,
            "comm": self.comm_mode,
            "on_nonfinite": self.on_nonfinite,
            "the sync_buffers' shapes": [(tuple(b.shape), str(b.dtype)) for b in buffers],
            "timeout": None if timeout is None else timeout.total_seconds(),
        }

    def _allocate_state(self) -> None:
        """One packed group across all parameter groups; ``state[p]`` holds views of its slices."""
        d = self._flat.numel
        dtype = torch.float64 if self._flat.buffer.dtype == torch.float64 else torch.float32
        device = self._flat.buffer.device
        self._state_dtype = dtype
        b = sum(t.numel() for t in self._sync_buffers)
        # [shadow (or replica) weight | its momentum | sync buffers | agreement check]: one all-reduce
        sync = torch.zeros(2 * d + b + CHECK_ELEMENTS, dtype=dtype, device=device)
        packed = PackedGroup(
            self._flat.layout,
            state=dict(pre_weight=torch.zeros(d, dtype=dtype, device=device), server_state=sync,
                       sync_momentum=torch.zeros(d, dtype=dtype, device=device)),
            work=dict(grad=torch.zeros(d + CHECK_ELEMENTS, dtype=dtype, device=device)),
        )
        self._packed["all"] = packed
        self._grad, self._pre, self._sync_momentum = packed.grad, packed.pre_weight, packed.sync_momentum
        self._sync = sync
        self._server_weight = sync[:d]
        self._server_momentum = sync[d : 2 * d]
        self._trailer_buffers = sync[2 * d : 2 * d + b]
        self._trailer_check = sync[2 * d + b :]
        views = {
            "pre_weight": self._flat.views(self._pre),
            "shadow_weight": self._flat.views(self._server_weight),
            "shadow_momentum": self._flat.views(self._server_momentum),
            "sync_momentum": self._flat.views(self._sync_momentum),
        }
        for i, p in enumerate(self._flat.params):
            self.state[p] = {name: views[name][i] for name in _STATE_NAMES}

    # ------------------------------------------------------------------ public

    @property
    def steps(self) -> int:
        """Iterations applied so far (warm-up included; discarded windows not counted)."""
        return self._steps

    @property
    def in_warmup(self) -> bool:
        return self._steps < self.warmup_steps

    def finalize(self) -> None:
        """Wait for an in-flight synchronisation; call before evaluating.

        The ``sync_buffers`` take the synchronised averages, and
        :meth:`global_parameters` returns the global weights (the last good ones
        if the window was bad). Training afterwards is what it would have been
        without the call: the parameters are left alone, a bad window is
        discarded whole by the next step, as it would have been, and that step
        sets the buffers to the averages again, after its forward pass.
        """
        if self.comm_mode == "shadow":
            if self._sync_state == "in_flight":
                self._complete_sync()
            if self._sync_state == "ready" and self._verdict is None and not self._resolved and self._sync_buffers:
                self._unpack_buffers(self._trailer_buffers, scale=self._sync_scale)
        else:
            self._drain()

    def global_parameters(self) -> list[torch.Tensor]:
        """Copies of the global (server) weights as of the last completed synchronisation.

        Shaped like the parameters. During the warm-up these are the parameters
        themselves. After :meth:`finalize` at a step count with
        ``(steps - warmup_steps) % delay_steps == 0`` they equal the server's
        weights after that many iterations.
        """
        with torch.no_grad():
            if not self._delay_ready:
                flat = self._flat.buffer
            elif self._verdict is not None:
                flat = self._pre
            elif self.comm_mode == "per_step":
                flat = self._server_weight
            elif self._sync_state == "ready":
                flat = self._server_weight * self._sync_scale
            else:
                flat = self._pre
            return [v.to(self._flat.buffer.dtype, copy=True) for v in self._flat.views(flat)]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One SSD-SGD iteration on this rank's own gradients (see the module docstring)."""
        loss = self._evaluate_closure(closure)
        self._flat.check_bound()
        self._check_gradients()
        scalars = self._group_scalars()
        with nvtx_range(f"{_ALGO}/pack"):
            self._flat.pack_grads(self._grad)
        if self._steps < self.warmup_steps:
            with nvtx_range(f"{_ALGO}/warmup"):
                self._warmup_step(scalars)
        else:
            if not self._delay_ready:
                self._enter_delay_stage()
            if self.comm_mode == "shadow":
                self._shadow_step(scalars)
            else:
                self._per_step_step(scalars)
        return loss

    def _check_gradients(self) -> None:
        with_grad = [p for p in self._flat.params if p.grad is not None]
        self._check_grads(with_grad)
        for p in with_grad:  # a parameter's grad_dtype may let an integer gradient in
            if not p.grad.is_floating_point():
                raise RuntimeError(f"SSDSGD needs real floating-point gradients, got {p.grad.dtype}")

    def _group_scalars(self) -> list[dict]:
        """The op's scalars of this iteration per group (validated: a scheduler may have changed them)."""
        out = []
        for group in self.param_groups:
            self._check_group(group)
            out.append(ssd_sgd_step_scalars(**{key: group[key] for key in _GROUP_KEYS},
                                            delay_steps=self.delay_steps))
        return out

    def _step_digest(self, scalars: list[dict], previous: int = 0) -> int:
        """A 64-bit digest of this step's count and scalars, chained onto ``previous`` (a window's steps)."""
        data = previous.to_bytes(8, "little") + struct.pack("<q", self._steps)
        for s in scalars:
            data += struct.pack("<7d", s["lr"], s["momentum"], s["weight_decay"], s["local_lr"],
                                s["local_weight_decay"], s["glu_alpha"], s["glu_beta"])
        return int.from_bytes(hashlib.blake2b(data, digest_size=DIGEST_BITS // 8).digest(), "little")

    # ------------------------------------------------------------------ warm-up (SSGD)

    def _warmup_step(self, scalars: list[dict]) -> None:
        d = self._flat.numel
        self._write_check(self._grad[d:], self._step_digest(scalars))
        self._collectives.all_reduce(self._grad, label="warmup_grad_allreduce", group=self.process_group,
                                     async_op=True).wait()
        if not self._check_agrees(self._grad[d:]):
            raise ValueError(self._mismatch_message(self._steps, self._steps + 1, discarded=False))
        mean = self._grad[:d].div_(self.world_size)
        updates = []
        for index, s in enumerate(scalars):
            w = self._flat.group_slice(self._flat.buffer, index)
            mom = self._flat.group_slice(self._server_momentum, index)
            new_w, new_mom = server_momentum_sgd(w, mom, self._flat.group_slice(mean, index), lr=s["lr"],
                                                 momentum=s["momentum"], weight_decay=s["weight_decay"])
            updates.append((w, mom, new_w, new_mom))
        finite = torch.stack([torch.isfinite(t).all() for u in updates for t in u[2:]]).all()
        if not bool(finite):
            self._refuse_step(f"the averaged gradient or the update at step {self._steps} is not finite")
            return
        for w, mom, new_w, new_mom in updates:
            w.copy_(new_w)
            mom.copy_(new_mom)
        self._steps += 1

    def _enter_delay_stage(self) -> None:
        """pre = shadow weight = the global weight; momentum as the warm-up left it."""
        self._pre.copy_(self._flat.buffer)
        self._server_weight.copy_(self._flat.buffer)
        self._sync_momentum.copy_(self._server_momentum)
        self._window_start = self._steps
        self._delay_ready = True

    # ------------------------------------------------------------------ delay stage, shadow server

    def _shadow_step(self, scalars: list[dict]) -> None:
        if self._sync_state == "in_flight":
            self._complete_sync()
        pulled = self._sync_state == "ready"
        if pulled:
            self._resolve()
            self._window_start = self._steps
        scale = self._sync_scale if pulled else 1.0
        with nvtx_range(f"{_ALGO}/local_update"):
            for index, s in enumerate(scalars):
                ssd_sgd_step(
                    self._flat.group_slice(self._flat.buffer, index),
                    self._flat.group_slice(self._grad, index),
                    self._flat.group_slice(self._pre, index),
                    shadow_weight=self._flat.group_slice(self._server_weight, index),
                    shadow_momentum=self._flat.group_slice(self._server_momentum, index),
                    sync_momentum=self._flat.group_slice(self._sync_momentum, index) if pulled else None,
                    pulled=pulled, shadow_scale=scale, **s,
                )
        self._sync_state = "none"
        self._window_digest = self._step_digest(scalars, self._window_digest)
        self._steps += 1
        if (self._steps - self.warmup_steps) % self.delay_steps == 0:
            self._launch_sync()

    def _launch_sync(self) -> None:
        with nvtx_range(f"{_ALGO}/sync_launch"):
            if self._sync_buffers:
                self._trailer_buffers.copy_(torch.cat([b.reshape(-1).to(self._state_dtype)
                                                       for b in self._sync_buffers]))
            self._write_check(self._trailer_check, self._window_digest)
            self._work = self._collectives.all_reduce(self._sync, label="shadow_sync_allreduce",
                                                      group=self.process_group, async_op=True)
        self._window_digest = 0
        self._sync_state = "in_flight"

    def _complete_sync(self) -> None:
        with nvtx_range(f"{_ALGO}/sync_wait"):
            work, self._work = self._work, None
            work.wait()
        d = self._flat.numel
        if not self._check_agrees(self._trailer_check):
            self._verdict = "mismatch"
        elif not bool(torch.isfinite(self._sync[: 2 * d]).all()):
            self._verdict = "nonfinite"
        self._sync_scale = 1.0 / self.world_size
        self._sync_state = "ready"
        self._resolved = False

    # ------------------------------------------------------------------ delay stage, per-step replica

    def _per_step_step(self, scalars: list[dict]) -> None:
        d = self._flat.numel
        pulled = self._pull_due
        if pulled:
            self._drain()
            if self._verdict is not None:
                self._resolve()
            self._flat.buffer.copy_(self._server_weight)
            self._sync_momentum.copy_(self._server_momentum)
            self._window_start = self._steps
            self._pull_due = False
        bad = []
        with nvtx_range(f"{_ALGO}/local_update"):
            for index, s in enumerate(scalars):
                bad.append(ssd_sgd_step(
                    self._flat.group_slice(self._flat.buffer, index),
                    self._flat.group_slice(self._grad, index),
                    self._flat.group_slice(self._pre, index),
                    pulled=pulled, **s,
                ))
        send = self._grad.clone()
        if int(torch.stack(bad).sum()):  # a local overflow: make every rank see it in the mean
            send[0] = float("nan")
        self._write_check(send[d:], self._step_digest(scalars))
        work = self._collectives.all_reduce(send, label="per_step_grad_allreduce", group=self.process_group,
                                            async_op=True)
        self._pending.append((send, work, scalars, self._steps))
        self._steps += 1
        if (self._steps - self.warmup_steps) % self.delay_steps == 0:
            self._pull_due = True

    def _drain(self) -> None:
        """Wait for every pending gradient all-reduce and apply them, in order, to the replica.

        The verdict is the same however the window's all-reduces are split among
        calls (``finalize`` drains mid-window): a mismatch anywhere in the window
        wins over a non-finite state.
        """
        d = self._flat.numel
        applied = False
        with nvtx_range(f"{_ALGO}/server_replica"):
            while self._pending:
                send, work, scalars, step = self._pending.popleft()
                work.wait()
                if self._verdict == "mismatch":
                    continue
                if not self._check_agrees(send[d:]):
                    self._verdict = "mismatch"
                    continue
                if self._verdict is not None:  # non-finite already: the window will be discarded
                    continue
                mean = send[:d].div_(self.world_size)
                # The server rule in place: the replica needs no trial copy (a non-finite state is caught below).
                for index, s in enumerate(scalars):
                    w = self._flat.group_slice(self._server_weight, index)
                    mom = self._flat.group_slice(self._server_momentum, index)
                    g = self._flat.group_slice(mean, index)
                    mom.mul_(s["momentum"]).add_(g + s["weight_decay"] * w, alpha=-s["lr"])
                    w.add_(mom)
                applied = True
        if applied and self._verdict is None and not bool(torch.isfinite(self._sync[: 2 * d]).all()):
            self._verdict = "nonfinite"

    # ------------------------------------------------------------------ verdicts

    def _resolve(self) -> None:
        """Act once on a completed synchronisation: average the buffers, or discard a bad window."""
        if self._resolved and self._verdict is None:
            return
        if self._verdict is None:
            if self._sync_buffers and self.comm_mode == "shadow":
                self._unpack_buffers(self._trailer_buffers, scale=self._sync_scale)
            self._resolved = True
            return
        verdict, self._verdict = self._verdict, None
        first, last = self._window_start, self._steps
        # Back to the last synchronised state, on every rank alike.
        self._server_weight.copy_(self._pre)
        self._server_momentum.copy_(self._sync_momentum)
        self._flat.buffer.copy_(self._pre)
        self._sync_scale = 1.0
        self._steps = first
        self._resolved = True
        if self.comm_mode == "shadow":
            self._sync_state = "ready"
        else:
            self._pending.clear()
            self._pull_due = True
        if verdict == "mismatch":
            raise ValueError(self._mismatch_message(first, last, discarded=True))
        self._discard_window(
            f"a gradient or local update was not finite on some rank during steps {first}..{last - 1}; "
            "that window was discarded on every rank and the parameters reset to the last "
            "synchronised global weights",
            skipped=last - first,
        )

    def _discard_window(self, problem: str, *, skipped: int) -> None:
        """``on_nonfinite`` for a window already discarded: it counts all of its steps as skipped."""
        if self.on_nonfinite == "raise":
            raise FloatingPointError(f"SSDSGD: {problem}")
        self.skipped_steps += skipped
        warnings.warn(f"SSDSGD: {problem}; {skipped} step(s) skipped", RuntimeWarning, stacklevel=3)

    def _mismatch_message(self, first: int, last: int, *, discarded: bool) -> str:
        what = (f"steps {first}..{last - 1} (that window was discarded on every rank)" if discarded
                else f"step {first} (nothing was modified)")
        return ("SSDSGD: the ranks' step counts or hyperparameters (lr, momentum, weight decay, GLU "
                f"settings) differed during {what}; the exact mapping of the parameter server needs "
                "identical values on every rank, e.g. the same learning-rate schedule")

    # ------------------------------------------------------------------ helpers

    def _write_check(self, out: torch.Tensor, digest: int) -> None:
        """The digest as a vector v of CHECK_DIGITS digits, then the limbs of |v|^2, all of ``_check_bits`` bits.

        After the all-reduce's sum over K ranks, ``|sum v|^2 = K sum |v|^2`` holds
        iff every rank's v is the same (Cauchy-Schwarz); every sum is an integer
        below 2^24 (2^53 in float64), so exact in any order of summation.
        """
        bits = self._check_bits
        mask = (1 << bits) - 1
        digits = [(digest >> (bits * i)) & mask for i in range(CHECK_DIGITS)]
        norm = sum(x * x for x in digits)
        limbs = [(norm >> (bits * i)) & mask for i in range(CHECK_ELEMENTS - CHECK_DIGITS)]
        out.copy_(torch.tensor(digits + limbs, dtype=out.dtype))

    def _check_agrees(self, summed: torch.Tensor) -> bool:
        values = summed.tolist()
        if not all(math.isfinite(v) and v == int(v) for v in values):
            return False
        digits, limbs = [int(v) for v in values[:CHECK_DIGITS]], [int(v) for v in values[CHECK_DIGITS:]]
        norms = sum(limb << (self._check_bits * i) for i, limb in enumerate(limbs))
        return sum(s * s for s in digits) == self.world_size * norms

    def _unpack_buffers(self, flat: torch.Tensor, *, scale: float) -> None:
        start = 0
        for b in self._sync_buffers:
            n = b.numel()
            b.copy_((flat[start : start + n] * scale).view(b.shape))
            start += n

    # ------------------------------------------------------------------ checkpoints

    def _flush(self) -> None:
        if self.comm_mode == "shadow":
            if self._sync_state == "in_flight":
                self._complete_sync()
        else:
            self._drain()

    def state_dict(self) -> dict:
        """Per-rank state: flushes an in-flight synchronisation first (it stays to be consumed).

        Besides torch's ``state`` and ``param_groups`` and ``skipped_steps``, the
        ``"ssd_sgd"`` entry names what it was saved for (this rank, the world size,
        the settings, and each parameter's shape and dtype in order) and holds the
        counters, the synchronisation's trailer and this rank's ``sync_buffers``.
        It holds only tensors, numbers, strings, dtypes and lists of them, so
        ``torch.load(..., weights_only=True)`` reads it back.
        """
        self._flush()
        state = super().state_dict()
        params = self._flat.params
        state["state"] = {
            index: {**value, "local_weight": params[index].detach().clone()}
            for index, value in state["state"].items()
        }
        state["ssd_sgd"] = dict(
            rank=self.rank, world_size=self.world_size, comm=self.comm_mode,
            delay_steps=self.delay_steps, warmup_steps=self.warmup_steps, layout=_layout(self.param_groups),
            steps=self._steps, delay_ready=self._delay_ready,
            window_start=self._window_start, window_digest=self._window_digest,
            sync_state=self._sync_state, sync_scale=self._sync_scale, verdict=self._verdict,
            resolved=self._resolved, pull_due=self._pull_due,
            trailer=self._sync[2 * self._flat.numel :].clone(),
            # The rank's own statistics: construction broadcast rank 0's over those the model restored.
            sync_buffers=[b.detach().clone() for b in self._sync_buffers],
        )
        return state

    def check_state_dict(self, state_dict) -> None:
        """Raise ``ValueError`` naming the first problem unless this rank can load ``state_dict``.

        Checks every field's type and range, every tensor's shape, dtype and
        finiteness, and that it was saved on this rank of this world size, with
        these settings and parameters; modifies nothing. :meth:`load_state_dict`
        checks besides that the ranks' global state agrees.
        """
        self._checked_state(state_dict)

    def _checked_state(self, state_dict) -> dict:
        """What :meth:`load_state_dict` restores, every value checked; ``ValueError`` naming the first problem."""
        if not isinstance(state_dict, dict):
            raise ValueError("state_dict must be a dict, as SSDSGD.state_dict() returns, "
                             f"got {type(state_dict).__name__}")
        extra = state_dict.get("ssd_sgd")
        if not isinstance(extra, dict):
            raise ValueError("not an SSDSGD state dict (no 'ssd_sgd' entry)")
        missing = sorted(_SAVED_FIELDS - set(extra))
        if missing:
            raise ValueError(f"the state dict's 'ssd_sgd' entry lacks {missing}; save it with this version's "
                             "SSDSGD.state_dict()")
        unknown = sorted(set(extra) - _SAVED_FIELDS, key=str)
        if unknown:
            raise ValueError(f"the state dict's 'ssd_sgd' entry holds {unknown}, which SSDSGD does not keep")
        for key, mine in (("world_size", self.world_size), ("rank", self.rank), ("comm", self.comm_mode),
                          ("delay_steps", self.delay_steps), ("warmup_steps", self.warmup_steps)):
            if type(extra[key]) is not type(mine) or extra[key] != mine:
                raise ValueError(
                    f"this state dict has {key}={extra[key]!r} but this optimizer has {mine!r}; "
                    "SSDSGD's state is per rank: load each rank's own state dict into an optimizer "
                    "built with the same settings"
                )
        mine = _layout(self.param_groups)
        if _saved_layout(extra["layout"]) != mine:
            raise ValueError(
                f"layout: the state dict was saved for parameters {extra['layout']!r}, this optimizer "
                f"has {mine!r} (shape and dtype of each parameter, per group, in order); a checkpoint "
                "resumes only the parameters it was saved for"
            )
        counters = self._checked_counters(extra)

        skipped = state_dict.get("skipped_steps")
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"skipped_steps must be an int >= 0, got {skipped!r}")
        groups = state_dict.get("param_groups")
        if not isinstance(groups, (list, tuple)) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in groups):
            raise ValueError("param_groups must be a list of dicts, each with a 'params' list")
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(own["params"]) for g, own in zip(groups, self.param_groups)):
            raise ValueError(f"param_groups: the state dict has groups of {[len(g['params']) for g in groups]} "
                             f"parameters, this optimizer {[len(g['params']) for g in self.param_groups]}")
        for index, group in enumerate(groups):
            try:
                self._check_group({**self.defaults, **group})
            except TypeError as error:  # a field of the wrong kind is a bad value of the state dict
                raise ValueError(f"param_groups[{index}]: {error}") from error
            except ValueError as error:
                raise ValueError(f"param_groups[{index}]: {error}") from error

        saved_state = state_dict.get("state")
        if not isinstance(saved_state, dict):
            raise ValueError("state must be a dict of each parameter's saved state")
        params = self._flat.params
        saved_ids = [i for g in groups for i in g["params"]]
        if len(set(saved_ids)) != len(saved_ids):
            raise ValueError("param_groups list a parameter id more than once")
        strays = sorted(set(saved_state) - set(saved_ids), key=str)
        if strays:
            raise ValueError(f"state holds entries for parameter ids {strays} that no parameter group lists")
        entries = []
        for index, p in zip(saved_ids, params):
            entry = saved_state.get(index)
            if not isinstance(entry, dict) or set(entry) != _ENTRY_NAMES:
                got = sorted(entry, key=str) if isinstance(entry, dict) else type(entry).__name__
                raise ValueError(f"state[{index!r}] must hold exactly {sorted(_ENTRY_NAMES)}, got {got}")
            for name, value in entry.items():
                dtype = p.dtype if name == "local_weight" else self._state_dtype
                _check_saved_tensor(f"state[{index!r}][{name!r}]", value, tuple(p.shape), dtype,
                                    finite=name in _FINITE_ENTRIES)
            entries.append(entry)
        b = sum(t.numel() for t in self._sync_buffers)
        _check_saved_tensor("ssd_sgd['trailer']", extra["trailer"], (b + CHECK_ELEMENTS,), self._state_dtype)
        saved_buffers = extra["sync_buffers"]
        if not isinstance(saved_buffers, (list, tuple)) or len(saved_buffers) != len(self._sync_buffers):
            raise ValueError(f"ssd_sgd['sync_buffers'] must list this optimizer's {len(self._sync_buffers)} "
                             "floating-point sync_buffers")
        for i, (saved, own) in enumerate(zip(saved_buffers, self._sync_buffers)):
            _check_saved_tensor(f"ssd_sgd['sync_buffers'][{i}]", saved, tuple(own.shape), own.dtype)

        def flat_of(name: str) -> torch.Tensor:
            return torch.cat([entry[name].reshape(-1) for entry in entries])

        return dict(
            counters=counters, skipped=skipped, groups=groups, trailer=extra["trailer"], sync_buffers=saved_buffers,
            pre=flat_of("pre_weight"), sync_momentum=flat_of("sync_momentum"), local=flat_of("local_weight"),
            server=torch.cat([flat_of("shadow_weight"), flat_of("shadow_momentum")]),
        )

    def _checked_counters(self, extra: dict) -> dict:
        """The saved step counters and synchronisation state, each checked against the others."""
        k, warmup = self.delay_steps, self.warmup_steps
        steps = _saved_int(extra, "steps", 0)
        delay_ready = _saved_bool(extra, "delay_ready")
        if (steps < warmup and delay_ready) or (steps > warmup and not delay_ready):
            raise ValueError(f"ssd_sgd['delay_ready']={delay_ready} contradicts steps={steps} with "
                             f"warmup_steps={warmup}")
        at_sync_point = delay_ready and (steps - warmup) % k == 0
        if delay_ready:
            window_start = _saved_int(extra, "window_start", max(warmup, steps - k), steps)
            if (window_start - warmup) % k:
                raise ValueError("ssd_sgd['window_start'] must be warmup_steps plus a multiple of "
                                 f"delay_steps={k}, got {window_start}")
        else:
            window_start = _saved_int(extra, "window_start", warmup, warmup)
        window_digest = _saved_int(extra, "window_digest", 0, (1 << DIGEST_BITS) - 1)
        states = ("none", "ready") if self.comm_mode == "shadow" else ("none",)
        sync_state = _saved_choice(extra, "sync_state", states)
        if sync_state == "ready" and not at_sync_point:
            raise ValueError(f"ssd_sgd['sync_state']='ready' needs steps={steps} at a synchronisation point")
        sync_scale = extra["sync_scale"]
        if type(sync_scale) is not float or sync_scale not in (1.0, 1.0 / self.world_size):
            raise ValueError(f"ssd_sgd['sync_scale'] must be 1.0 or 1/world_size, got {sync_scale!r}")
        verdict = _saved_choice(extra, "verdict", _VERDICTS)
        if verdict is not None and not delay_ready:
            raise ValueError(f"ssd_sgd['verdict']={verdict!r} needs the delay stage (delay_ready)")
        resolved = _saved_bool(extra, "resolved")
        pull_due = _saved_bool(extra, "pull_due")
        if pull_due and (self.comm_mode == "shadow" or not at_sync_point):
            raise ValueError(f"ssd_sgd['pull_due'] is set off a per_step synchronisation point (steps={steps})")
        return dict(steps=steps, delay_ready=delay_ready, window_start=window_start, window_digest=window_digest,
                    sync_state=sync_state, sync_scale=sync_scale, verdict=verdict, resolved=resolved,
                    pull_due=pull_due)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state dict this rank saved (:meth:`check_state_dict` first, then the ranks' agreement).

        A collective: every rank of the group must call it. A rank whose state
        dict is refused still joins the agreement check, so every rank raises at
        once (the others name that rank); nothing is modified on any rank.
        """
        problem: Optional[Exception] = None
        saved = settings = None
        try:
            saved = self._checked_state(state_dict)
        except Exception as exc:  # any refusal, so that the other ranks hear of it instead of waiting
            problem = exc
        if problem is None:
            self._flush()  # a collective this rank launched must complete before the state changes
            counters = saved["counters"]
            server_is_global = self.comm_mode == "per_step" or counters["sync_state"] == "ready"
            settings = {
                **self._settings(self._sync_buffers, self._requested_timeout),
                "the saved hyperparameters": [[g.get(k) for k in _GROUP_KEYS] for g in saved["groups"]],
                "the step counters": tuple(counters[k] for k in ("steps", "window_start", "delay_ready",
                                                                 "sync_state", "verdict", "pull_due")),
                "the pre-weight": _tensor_digest(saved["pre"]),
                "the synchronised momentum": _tensor_digest(saved["sync_momentum"]),
                "the synchronised server state": _tensor_digest(saved["server"]) if server_is_global else "",
            }
        try:
            check_ranks_agree("SSDSGD", settings, comm=self._collectives, group=self.process_group,
                              device=_setup_device(self.process_group), label="load_state_dict_check",
                              problem=problem, stage="while loading its state")
        except ValueError as error:
            if problem is not None or "configured differently" not in str(error):
                raise
            raise ValueError(f"{error}; load each rank's state dict from one checkpoint") from error
        d = self._flat.numel
        with torch.no_grad():
            for group, saved_group in zip(self.param_groups, saved["groups"]):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
            self._pre.copy_(saved["pre"])
            self._sync_momentum.copy_(saved["sync_momentum"])
            self._sync[: 2 * d].copy_(saved["server"])
            self._sync[2 * d :].copy_(saved["trailer"])
            self._flat.buffer.copy_(saved["local"])
            for buffer, value in zip(self._sync_buffers, saved["sync_buffers"]):
                buffer.copy_(value)
        self._work = None
        self._pending.clear()
        counters = saved["counters"]
        self._steps = counters["steps"]
        self.skipped_steps = saved["skipped"]
        self._delay_ready = counters["delay_ready"]
        self._window_start = counters["window_start"]
        self._window_digest = counters["window_digest"]
        self._sync_state = counters["sync_state"]
        self._sync_scale = counters["sync_scale"]
        self._verdict = counters["verdict"]
        self._resolved = counters["resolved"]
        self._pull_due = counters["pull_due"]

    def __reduce__(self):
        raise TypeError("SSDSGD holds a process group and cannot be copied or pickled; save its state_dict "
                        "on every rank instead")
