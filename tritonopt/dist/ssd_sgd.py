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

``comm="shadow"`` (default). The server rule is
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

Where the parts live: this module holds the public class, which picks one core
and one transport at construction and does not branch on ``comm`` afterwards;
:mod:`~tritonopt.dist.ssd_sgd_core` holds the arithmetic and the counters of
every phase, with no communication (:class:`~tritonopt.dist.ssd_sgd_core.ShadowServerCore`,
:class:`~tritonopt.dist.ssd_sgd_core.ReplicaServerCore`);
:mod:`~tritonopt.dist.ssd_sgd_sync` the collectives of each ``comm`` mode;
:mod:`~tritonopt.dist.ssd_sgd_checkpoint` ``state_dict`` and ``load_state_dict``;
:mod:`~tritonopt.dist.ssd_sgd_check` the agreement check's encoding.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_choice, check_float, check_int
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist._startup import agreement_device
from tritonopt.dist.ssd_sgd_check import CHECK_ELEMENTS, check_digit_bits
from tritonopt.dist.ssd_sgd_checkpoint import STATE_NAMES, SSDSGDCheckpoints
from tritonopt.dist.ssd_sgd_core import (
    GROUP_KEYS,
    NVTX_PREFIX,
    DiscardedWindow,
    FlatParameters,
    ReplicaServerCore,
    ShadowServerCore,
    mismatch_message,
    unpack_buffers,
)
from tritonopt.dist.ssd_sgd_sync import PerStepSync, ShadowSync
from tritonopt.optim import PackedGroup, PackedOptimizer, apply_nonfinite_policy
from tritonopt.optim.functional import ssd_sgd_step_scalars

__all__ = ["SSDSGD", "COMM_MODES", "CHECK_ELEMENTS"]

# Each comm mode: the core that does its arithmetic and the strategy that does its communication.
_MODES = {"shadow": (ShadowServerCore, ShadowSync), "per_step": (ReplicaServerCore, PerStepSync)}
COMM_MODES = tuple(_MODES)


class SSDSGD(SSDSGDCheckpoints, PackedOptimizer):
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
            core_class, sync_class = _MODES[comm]
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
            if buffers and not sync_class.AVERAGES_SYNC_BUFFERS:
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
            group=process_group, device=agreement_device(process_group), problem=problem,
        )
        # Every rank agreed on the timeout, so every member creates the timed group (or none does).
        self._requested_timeout = own_timeout
        self.timeout = own_timeout if own_timeout is not None else resolve_timeout(None, process_group)
        if own_timeout is not None:
            members = dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD)
            process_group = timed_group(members, own_timeout, layer="SSDSGD", local=True)
        self.process_group = process_group
        self._collectives = GuardedCommunicator(self.comm, layer="SSDSGD", timeout=self.timeout)
        self._check_bits = check_digit_bits(self.world_size, self.param_groups[0]["params"][0].dtype)

        with torch.no_grad():
            flat = FlatParameters(self.param_groups)
            source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            self._collectives.broadcast(flat.buffer, source, label="initial_broadcast", group=process_group)
            if buffers:
                packed = torch.cat([b.reshape(-1).to(flat.buffer.dtype) for b in buffers])
                self._collectives.broadcast(packed, source, label="initial_broadcast", group=process_group)
                unpack_buffers(buffers, packed, scale=1.0)
        self._core = core_class(flat, buffers, world_size=self.world_size, delay_steps=delay_steps,
                                warmup_steps=warmup_steps, check_bits=self._check_bits)
        self._transport = sync_class(self._core, self._collectives, process_group, self._report_discarded_window)
        self._bind_state()

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
            if key not in GROUP_KEYS and key != "params":
                raise ValueError(
                    f"{key!r} is not a per-group setting of SSDSGD (those are {', '.join(GROUP_KEYS)})"
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
            **{key: [g[key] for g in groups] for key in GROUP_KEYS},
            "delay_steps": self.delay_steps,
            "warmup_steps": self.warmup_steps,
            "comm": self.comm_mode,
            "on_nonfinite": self.on_nonfinite,
            "the sync_buffers' shapes": [(tuple(b.shape), str(b.dtype)) for b in buffers],
            "timeout": None if timeout is None else timeout.total_seconds(),
        }

    def _bind_state(self) -> None:
        """One packed group across all parameter groups; ``state[p]`` holds views of the core's buffers."""
        core, flat = self._core, self._core.flat
        self._packed["all"] = PackedGroup(
            flat.layout,
            state=dict(pre_weight=core.pre, server_state=core.sync, sync_momentum=core.sync_momentum),
            work=dict(grad=core.grad),
        )
        views = {
            "pre_weight": flat.views(core.pre),
            "shadow_weight": flat.views(core.server_weight),
            "shadow_momentum": flat.views(core.server_momentum),
            "sync_momentum": flat.views(core.sync_momentum),
        }
        for i, p in enumerate(flat.params):
            self.state[p] = {name: views[name][i] for name in STATE_NAMES}

    # ------------------------------------------------------------------ public

    @property
    def steps(self) -> int:
        """Iterations applied so far (warm-up included; discarded windows not counted)."""
        return self._core.window.steps

    @property
    def in_warmup(self) -> bool:
        return self._core.in_warmup

    def finalize(self) -> None:
        """Wait for an in-flight synchronisation; call before evaluating.

        The ``sync_buffers`` take the synchronised averages, and
        :meth:`global_parameters` returns the global weights (the last good ones
        if the window was bad). Training afterwards is what it would have been
        without the call: the parameters are left alone, a bad window is
        discarded whole by the next step, as it would have been, and that step
        sets the buffers to the averages again, after its forward pass.
        """
        self._transport.finalize()

    def global_parameters(self) -> list[torch.Tensor]:
        """Copies of the global (server) weights as of the last completed synchronisation.

        Shaped like the parameters. During the warm-up these are the parameters
        themselves. After :meth:`finalize` at a step count with
        ``(steps - warmup_steps) % delay_steps == 0`` they equal the server's
        weights after that many iterations.
        """
        flat = self._core.flat
        with torch.no_grad():
            return [v.to(flat.buffer.dtype, copy=True) for v in flat.views(self._core.global_weights())]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One SSD-SGD iteration on this rank's own gradients (see the module docstring)."""
        loss = self._evaluate_closure(closure)
        core = self._core
        core.flat.check_bound()
        self._check_gradients()
        scalars = self._group_scalars()
        with nvtx_range(f"{NVTX_PREFIX}/pack"):
            core.flat.pack_grads(core.grad)
        if core.in_warmup:
            with nvtx_range(f"{NVTX_PREFIX}/warmup"):
                problem = self._transport.warmup_step(scalars)
                if problem is not None:
                    apply_nonfinite_policy(self, problem, "parameters and state are unchanged")
        else:
            if not core.window.delay_ready:
                core.enter_delay_stage()
            self._transport.delay_step(scalars)
        return loss

    def _check_gradients(self) -> None:
        with_grad = [p for p in self._core.flat.params if p.grad is not None]
        self._check_grads(with_grad)
        for p in with_grad:  # a parameter's grad_dtype may let an integer gradient in
            if not p.grad.is_floating_point():
                raise RuntimeError(f"SSDSGD needs real floating-point gradients, got {p.grad.dtype}")

    def _group_scalars(self) -> list[dict]:
        """The op's scalars of this iteration per group (validated: a scheduler may have changed them)."""
        out = []
        for group in self.param_groups:
            self._check_group(group)
            out.append(ssd_sgd_step_scalars(**{key: group[key] for key in GROUP_KEYS},
                                            delay_steps=self.delay_steps))
        return out

    def _report_discarded_window(self, window: DiscardedWindow) -> None:
        """Every rank discarded ``window``: ranks that ran different steps raise ``ValueError``; a non-finite
        value follows ``on_nonfinite``, counting all of the window's steps as skipped.

        (The shared policy of the packed optimizers counts one step that changed nothing; a discarded
        window counts every step of it and has reset the parameters, so it says so itself.)
        """
        first, last = window.first, window.last
        if window.verdict == "mismatch":
            raise ValueError(mismatch_message(first, last, discarded=True))
        problem = (f"a gradient or local update was not finite on some rank during steps {first}..{last - 1}; "
                   "that window was discarded on every rank and the parameters reset to the last "
                   "synchronised global weights")
        if self.on_nonfinite == "raise":
            raise FloatingPointError(f"SSDSGD: {problem}")
        skipped = last - first
        self.skipped_steps += skipped
        # stacklevel 3: the transport's step, which consumed the synchronisation.
        warnings.warn(f"SSDSGD: {problem}; {skipped} step(s) skipped", RuntimeWarning, stacklevel=3)

    def __reduce__(self):
        raise TypeError("SSDSGD holds a process group and cannot be copied or pickled; save its state_dict "
                        "on every rank instead")
