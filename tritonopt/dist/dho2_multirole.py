"""MR-DHO2: accelerator ranks estimate the curvature while worker ranks train; eq. (17) joins them.

:class:`MRDHO2` runs the epoch (weights broadcast, the accelerators' ESE, the
workers' first-order steps, the Ritz vectors scattered to the workers);
:func:`final_update_local` is eq. (17) on the workers, summed by all_reduces, and
:func:`final_update_reference` the same formula in one process. The collectives
per epoch and what each role holds: :mod:`tritonopt.dist.dho2`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from tritonopt._runtime import nvtx_range
from tritonopt._validation import check_choice, check_float, check_int
from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._collective_guard import GuardedCommunicator, group_timeout, resolve_timeout, timed_group
from tritonopt.dist._comm import CountingCommunicator
from tritonopt.dist._startup import agreement_device, model_layout, require_process_group
from tritonopt.dist.lanczos import column_split, distributed_lanczos, lanczos_shard_report, shard_size
from tritonopt.optim import apply_nonfinite_policy
from tritonopt.optim.fosi import FOSIConfig
from tritonopt.optim.functional import FOSIHyper, fosi_update
from tritonopt.optim.lanczos import RitzSelection, extreme_ritz, make_hvp, ritz_vectors

__all__ = ["MRDHO2", "final_update_local", "final_update_reference"]


class MRDHO2:
    """Multi-role DHO2: accelerators estimate curvature while workers train (see :mod:`tritonopt.dist.dho2`).

    Args:
        params: the model's parameters (every rank builds the same model).
        num_accelerators: ``A``, ranks ``0..A-1``; the other ``J = C - A`` ranks are workers.
        lr, base, betas, momentum, eps: the workers' base optimizer.
        k, l, alpha, num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol,
        eigenvalue_floor, paper_exact, seed: as in :class:`~tritonopt.optim.FOSI`.
        accumulated_gradient: ``"sum"`` (default, as printed) or ``"mean"``: how ``p`` enters eq. (17).
        comm: a :class:`CountingCommunicator` (made if None); its counters record every collective.
        timeout: seconds or a ``timedelta`` for every process group MR-DHO2 creates
            (a world copy and the accelerator, worker and bridge groups);
            None: the world's timeout.
        on_nonfinite: a worker gradient with NaN or inf: ``"skip"`` (warn, count
            in :attr:`skipped_steps`, change nothing) or ``"raise"``.

    Must be constructed on every rank at the same time (it checks that the
    ranks agree, then creates process groups). float64 models keep float64 buffers.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, num_accelerators: int, lr: float = 1e-3,
                 base: str = "adam", betas=(0.9, 0.999), momentum: float = 0.9, eps: float = 1e-8,
                 k: int = 10, l: int = 0, alpha: float = 0.1, num_lanczos_iters: Optional[int] = None,
                 lanczos_dtype: torch.dtype = torch.float64, reorth_passes: int = 2,
                 ritz_rtol: float = 1e-6, eigenvalue_floor: float = 1e-3, paper_exact: bool = False,
                 accumulated_gradient: str = "sum", seed: int = 0,
                 comm: Optional[CountingCommunicator] = None, timeout=None, on_nonfinite: str = "skip"):
        require_process_group("MRDHO2")
        world = dist.get_world_size()
        # A bad argument is kept, not raised, until this rank has joined the configuration check:
        # the other ranks would otherwise wait there for it until the timeout.
        problem: Optional[Exception] = None
        try:
            self._check_arguments(params, num_accelerators, lr, base, betas, momentum, eps, k, l, alpha,
                                  num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol, eigenvalue_floor,
                                  paper_exact, accumulated_gradient, seed, on_nonfinite)
            self.timeout = resolve_timeout(timeout)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then raised
            problem = exc
        if problem is not None:
            try:
                self.timeout = resolve_timeout(timeout)
            except (TypeError, ValueError):
                self.timeout = group_timeout(None)
        self.comm = CountingCommunicator() if comm is None else comm
        self._collectives = GuardedCommunicator(self.comm, layer="MRDHO2", timeout=self.timeout)
        # Every collective runs on a group created here with the timeout, the world's too.
        self.world_group = timed_group(range(world), self.timeout, layer="MRDHO2")
        if problem is not None:
            check_ranks_agree("MRDHO2", None, comm=self._collectives, group=self.world_group,
                              device=agreement_device(None), problem=problem)
        self.rank, self.world = dist.get_rank(), world
        self.accelerators = list(range(num_accelerators))
        self.workers = list(range(num_accelerators, world))
        self.first_worker = self.workers[0]
        self.is_worker = self.rank >= num_accelerators
        device = self.params[0].device
        settings = {
            "model (shapes, dtypes)": model_layout(self.params),
            **dataclasses.asdict(self.config),
            "base optimizer": (lr, tuple(betas), momentum, eps),
            "accumulated_gradient": accumulated_gradient,
            "world layout": (world, num_accelerators),
        }
        check_ranks_agree("MRDHO2", settings, comm=self._collectives, group=self.world_group, device=device)
        self.accelerator_group = timed_group(self.accelerators, self.timeout, layer="MRDHO2")
        self.worker_group = timed_group(self.workers, self.timeout, layer="MRDHO2")
        self.bridge_group = timed_group(self.accelerators + [self.first_worker], self.timeout, layer="MRDHO2")
        self.n = sum(p.numel() for p in self.params)
        self.dtype = torch.float64 if all(p.dtype == torch.float64 for p in self.params) else torch.float32
        self.weights = torch.zeros(self.n, dtype=self.dtype, device=device)
        self.grad = torch.zeros(self.n, dtype=self.dtype, device=device)
        self.base_state = [torch.zeros(self.n, dtype=self.dtype, device=device)
                           for _ in range({"adam": 2, "heavy_ball": 1, "sgd": 0}[base])]
        self.base_step = 0
        self.skipped_steps = 0
        self.epoch = 0
        self._rows_shard: Optional[torch.Tensor] = None
        self._ritz = None
        self.memory: dict = {}

    def _check_arguments(self, params, num_accelerators, lr, base, betas, momentum, eps, k, l, alpha,
                         num_lanczos_iters, lanczos_dtype, reorth_passes, ritz_rtol, eigenvalue_floor, paper_exact,
                         accumulated_gradient, seed, on_nonfinite) -> None:
        """Check this rank's arguments and keep the configuration and the parameters; no collective."""
        world = dist.get_world_size()
        check_int("num_accelerators", num_accelerators, low=1, high=world - 1)
        check_choice("accumulated_gradient", accumulated_gradient, ("sum", "mean"))
        check_choice("on_nonfinite", on_nonfinite, ("skip", "raise"))
        check_float("lr", lr, low=0.0)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_float("betas[0]", betas[0], low=0.0, high=1.0, high_open=True)
        check_float("betas[1]", betas[1], low=0.0, high=1.0, high_open=True)
        check_float("momentum", momentum, low=0.0, high=1.0)
        check_float("eps", eps, low=0.0)
        self.config = FOSIConfig(base=base, k=k, l=l, alpha=alpha, num_lanczos_iters=num_lanczos_iters,
                                 lanczos_dtype=lanczos_dtype, reorth_passes=reorth_passes, paper_exact=paper_exact,
                                 ritz_rtol=ritz_rtol, eigenvalue_floor=eigenvalue_floor, seed=seed)
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MRDHO2 needs at least one trainable parameter")
        if any(not p.is_floating_point() or p.is_complex() for p in self.params):
            raise ValueError("MRDHO2 needs real floating-point parameters")
        if len({p.device for p in self.params}) != 1:
            raise ValueError("all MRDHO2 parameters must be on one device")
        beta1 = momentum if base == "heavy_ball" else betas[0]
        self.segments = [FOSIHyper(sum(p.numel() for p in self.params), lr, beta1, betas[1], eps)]
        self.accumulated_gradient, self.on_nonfinite = accumulated_gradient, on_nonfinite

    def _pack(self, tensors, out: torch.Tensor) -> torch.Tensor:
        torch.cat([t.reshape(-1).to(self.dtype) for t in tensors], out=out)
        return out

    @torch.no_grad()
    def _unpack(self, flat: torch.Tensor) -> None:
        start = 0
        for p in self.params:
            p.copy_(flat[start : start + p.numel()].view(p.shape))
            start += p.numel()

    @torch.no_grad()
    def begin_epoch(self, curvature_loss_fn: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """Share the epoch-start weights with the accelerators; accelerators run the ESE.

        ``curvature_loss_fn`` is needed on accelerators (the loss on their ESE
        batch, evaluated at the broadcast weights); workers may pass None.
        """
        w = self._pack(self.params, self.weights)
        if self.rank in self.accelerators or self.rank == self.first_worker:
            self._collectives.broadcast(w, src=self.first_worker, label="weights_broadcast", group=self.bridge_group)
        if self.is_worker:
            self._checkpoint = w.clone()
            self._accumulated = torch.zeros_like(w)
            self._epoch_steps = 0
            return
        self._unpack(w)
        if curvature_loss_fn is None:
            raise ValueError("curvature_loss_fn is required on accelerator ranks")
        config = self.config
        with nvtx_range("tritonopt/mrdho2/ese"):
            result = distributed_lanczos(
                make_hvp(self.params, curvature_loss_fn, self.dtype), self.n, config.lanczos_iters(self.n),
                comm=self._collectives, group=self.accelerator_group, dtype=config.lanczos_dtype,
                device=w.device, passes=config.reorth_passes, seed=config.seed + self.epoch,
            )
        self._ritz = extreme_ritz(result.tridiag, config.k, config.l, config.ritz_rtol)
        self._rows_shard = ritz_vectors(result.basis, self._ritz.vectors, self.dtype)
        self.memory = lanczos_shard_report(result, self.n, len(self.accelerators))

    @torch.no_grad()
    def step(self) -> None:
        """A worker's first-order step on the averaged gradient (eq. 13); accelerators must not call it."""
        if not self.is_worker:
            raise RuntimeError("MRDHO2.step runs on worker ranks only")
        grad = self._pack([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params], self.grad)
        self._collectives.all_reduce(grad, label="worker_grad_all_reduce", group=self.worker_group)
        grad.div_(len(self.workers))
        if not math.isfinite(float(grad.abs().amax())):
            apply_nonfinite_policy(self, "a gradient holds NaN or inf", "parameters and state are unchanged")
            return
        w = self._pack(self.params, self.weights)
        empty = w.new_zeros((0, self.n))
        fosi_update(w, grad, empty, w.new_zeros(0), base=self.config.base, segments=self.segments,
                    step=self.base_step + 1, first_moment=self.base_state[0] if self.base_state else None,
                    second_moment=self.base_state[1] if len(self.base_state) > 1 else None)
        self.base_step += 1
        self._unpack(w)
        self._accumulated.add_(grad)
        self._epoch_steps += 1

    @torch.no_grad()
    def end_epoch(self) -> None:
        """Scatter the Ritz vectors and values to the workers, which apply eq. (17)."""
        A, J = len(self.accelerators), len(self.workers)
        n_a = shard_size(self.n, A)
        device = self.weights.device
        # How many Ritz pairs survived: known on accelerators, broadcast with the values (and the
        # spectrum's scale, for the eigenvalue floor). Both on the weights' device: NCCL moves device tensors.
        count = torch.tensor([0 if self._ritz is None else self._ritz.values.numel()], dtype=torch.int64,
                             device=device)
        self._collectives.broadcast(count, src=0, label="eigenvalue_broadcast", group=self.world_group)
        r = int(count[0])
        if self.rank == 0:
            known = torch.cat([self._ritz.values, torch.tensor([self._ritz.scale], dtype=torch.float64)])
            values = known.to(device=device, dtype=torch.float64)
        else:
            values = torch.zeros(r + 1, dtype=torch.float64, device=device)
        self._collectives.broadcast(values, src=0, label="eigenvalue_broadcast", group=self.world_group)
        values, ritz_scale = values[:r].cpu(), float(values[r])  # the Ritz values stay on the host, as in FOSI
        splits = column_split(r, J)
        if self.is_worker:
            mine = splits[self.rank - A]
            send = torch.zeros((0, n_a), dtype=self.dtype, device=device)
            in_splits = [0] * self.world
            out_splits = [mine] * A + [0] * J
        else:
            send = self._rows_shard.contiguous()
            in_splits = [0] * A + splits
            out_splits = [0] * self.world
            mine = 0
        received = torch.empty((sum(out_splits), n_a), dtype=self.dtype, device=device)
        self._collectives.all_to_all_single(received, send, out_splits, in_splits, label="ritz_scatter",
                                            group=self.world_group)
        self.epoch += 1
        if not self.is_worker:
            return
        j = self.rank - A
        start = sum(splits[:j])
        v = received.view(A, mine, n_a).permute(1, 0, 2).reshape(mine, A * n_a)[:, : self.n].contiguous()
        scale = self.config.newton_scale(values[start : start + mine], ritz_scale).to(device=device, dtype=self.dtype)
        w = self._pack(self.params, self.weights)
        self._weights_after = final_update_local(
            v, scale, self._checkpoint, w, self._accumulated, max(self._epoch_steps, 1),
            self.accumulated_gradient, comm=self._collectives, group=self.worker_group,
        )
        self._unpack(self._weights_after)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's state; checkpoints are per rank (accelerators hold Ritz vectors, workers the epoch so far).

        The model's parameters are not in it: save them with the model. Saved between
        :meth:`begin_epoch` and :meth:`end_epoch`, it resumes the epoch where it was.
        """
        ritz = self._ritz
        return {
            "rank": self.rank, "world_size": self.world, "num_accelerators": len(self.accelerators),
            "n": self.n, "dtype": self.dtype, "epoch": self.epoch, "base_step": self.base_step,
            "skipped_steps": self.skipped_steps, "base_state": [t.clone() for t in self.base_state],
            "epoch_start": _clone_or_none(getattr(self, "_checkpoint", None)),
            "accumulated": _clone_or_none(getattr(self, "_accumulated", None)),
            "epoch_steps": getattr(self, "_epoch_steps", 0),
            "rows_shard": _clone_or_none(self._rows_shard),
            "ritz": None if ritz is None else {"values": ritz.values.clone(), "vectors": ritz.vectors.clone(),
                                               "scale": ritz.scale},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state dict saved by this rank; a collective (every rank loads at the same point).

        Every rank checks its own before anything changes; if any rank's is refused
        (another rank's, another model, a malformed one), or the ranks load different
        epochs, every rank raises and nothing is loaded anywhere.
        """
        problem: Optional[Exception] = None
        checked = None
        try:
            checked = self._checked_state(state_dict)
        except (TypeError, ValueError) as exc:
            problem = exc
        check_ranks_agree("MRDHO2.load_state_dict", None if problem else {"epoch": checked["epoch"]},
                          comm=self._collectives, group=self.world_group, device=self.weights.device,
                          label="load_state_dict", problem=problem, stage="while loading its state")
        for mine, saved in zip(self.base_state, checked["base_state"]):
            mine.copy_(saved)
        self.epoch, self.base_step = checked["epoch"], checked["base_step"]
        self.skipped_steps, self._epoch_steps = checked["skipped_steps"], checked["epoch_steps"]
        for name, key in (("_checkpoint", "epoch_start"), ("_accumulated", "accumulated")):
            if checked[key] is None:
                self.__dict__.pop(name, None)
            else:
                setattr(self, name, checked[key])
        self._rows_shard = checked["rows_shard"]
        ritz = checked["ritz"]
        self._ritz = None if ritz is None else RitzSelection(ritz["values"], ritz["vectors"], ritz["scale"])

    def _checked_state(self, state: dict) -> dict:
        """``state`` validated against this rank, its tensors copied to the weights' device; changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"MRDHO2: a state dict must be a dict, got {type(state).__name__}")
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"MRDHO2: not an MR-DHO2 state dict (missing {missing}, unexpected {extra})")
        saved = (state["rank"], state["world_size"], state["num_accelerators"])
        if saved != (self.rank, self.world, len(self.accelerators)):
            raise ValueError(
                f"MRDHO2: this state dict was saved on rank {saved[0]} of {saved[1]} with {saved[2]} accelerators, "
                f"not on this rank ({self.rank} of {self.world}, {len(self.accelerators)} accelerators): every "
                "rank must load the state dict it saved"
            )
        if (state["n"], state["dtype"]) != (self.n, self.dtype):
            raise ValueError(f"MRDHO2: the state dict is for {state['n']} {state['dtype']} parameters, this "
                             f"model has {self.n} {self.dtype}")
        for key in ("epoch", "base_step", "skipped_steps", "epoch_steps"):
            check_int(f"state_dict[{key!r}]", state[key], low=0)
        device = self.weights.device
        vector = (self.n,)

        def tensor(key, value, shape, dtype, optional=False):
            if value is None and optional:
                return None
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"MRDHO2: state_dict[{key!r}] must be a {dtype} tensor of shape {tuple(shape)}, "
                                 f"got {got}")
            return value.detach().to(device, copy=True)

        base = state["base_state"]
        if not isinstance(base, (list, tuple)) or len(base) != len(self.base_state):
            raise ValueError(f"MRDHO2: state_dict['base_state'] must hold {len(self.base_state)} buffers "
                             f"(base optimizer {self.config.base!r})")
        checked = {key: state[key] for key in ("epoch", "base_step", "skipped_steps", "epoch_steps")}
        checked["base_state"] = [tensor("base_state", t, vector, self.dtype) for t in base]
        for key in ("epoch_start", "accumulated"):
            checked[key] = tensor(key, state[key], vector, self.dtype, optional=True)
        ritz = state["ritz"]
        if ritz is None:
            checked["ritz"] = None
            if state["rows_shard"] is not None:
                raise ValueError("MRDHO2: state_dict['rows_shard'] without the Ritz values it belongs to")
            checked["rows_shard"] = None
        else:
            if not isinstance(ritz, dict) or set(ritz) != {"values", "vectors", "scale"}:
                raise ValueError("MRDHO2: state_dict['ritz'] must be None or a dict of values, vectors and scale")
            values = ritz["values"]
            r = values.shape[0] if isinstance(values, torch.Tensor) and values.dim() == 1 else -1
            steps = ritz["vectors"].shape[0] if isinstance(ritz["vectors"], torch.Tensor) else -1
            check_float("state_dict['ritz']['scale']", ritz["scale"], low=0.0)
            checked["ritz"] = {"values": tensor("ritz.values", values, (r,), torch.float64),
                               "vectors": tensor("ritz.vectors", ritz["vectors"], (steps, r), torch.float64),
                               "scale": float(ritz["scale"])}
            checked["ritz"]["values"] = checked["ritz"]["values"].cpu()
            checked["ritz"]["vectors"] = checked["ritz"]["vectors"].cpu()
            rows = shard_size(self.n, len(self.accelerators))
            checked["rows_shard"] = tensor("rows_shard", state["rows_shard"], (r, rows), self.dtype)
        return checked


def _clone_or_none(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.clone()


def final_update_local(v_j, scale_j, checkpoint, weights, accumulated, steps, mode, *, comm, group):
    """Eq. (17) from worker ``j``'s rows ``V_j`` (sums over workers are all_reduces)."""
    p = accumulated / steps if mode == "mean" else accumulated
    o = weights - checkpoint
    stacked = torch.stack([(scale_j * (v_j @ p)) @ v_j, (v_j @ o) @ v_j])
    comm.all_reduce(stacked, label="final_newton_and_projection", group=group)
    newton, projection = stacked[0], stacked[1]
    q = o - projection
    reprojection = ((v_j @ q) @ v_j).contiguous()
    comm.all_reduce(reprojection, label="final_reprojection", group=group)
    return checkpoint - newton + q - reprojection


def final_update_reference(v, scale, checkpoint, weights, accumulated, steps, mode="mean"):
    """Single-process eq. (17): ``c - V^T (s * V p~) + (I - P)(I - P) o`` (``V``: all ``r`` rows)."""
    p = accumulated / steps if mode == "mean" else accumulated
    o = weights - checkpoint
    q = o - (v @ o) @ v
    return checkpoint - (scale * (v @ p)) @ v + q - (v @ q) @ v
