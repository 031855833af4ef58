"""DSP in one process: the stage loops of :class:`~tritonopt.dist.DSPStage` without ranks.

The simulator runs the same per-stage arithmetic (:class:`~tritonopt.dist.dsp_core.StageCompute`)
in the same per-stage order (:func:`~tritonopt.dist.dsp_core.stage_actions`)
as the multi-process run, and moves tensors between stages through in-memory
FIFO channels (copied, contiguous, as a transport would). Each stage's result
depends only on what it receives and in which order, so any interleaving of the
stages gives the same numbers: a run of ``K`` gloo processes with the same
staleness, data and seeds (and the same intra-op thread count) is reproduced
bit for bit, whatever the processes' timing.

RNG. With ``seeds=None`` the stages draw (dropout) from the calling process's
stream in the simulator's round-robin order; with all staleness 0 this is the
order of ordinary back-propagation of the whole model. With
``seeds=(s_0, ..., s_{K-1})`` stage ``k`` draws from its own stream, seeded
``s_k``: what rank ``k`` of a multi-process run draws after
``torch.manual_seed(s_k)``; the caller's stream is left untouched.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from tritonopt.dist.dsp_core import (
    StageCompute,
    capture_rng,
    check_modes,
    check_staleness,
    set_rng,
    stage_actions,
)

__all__ = ["DSPSimulator", "simulate_dsp"]


def _module_devices(modules: Sequence[nn.Module]) -> list[torch.device]:
    devices = []
    for module in modules:
        for p in module.parameters():
            if p.device.type == "cuda" and p.device not in devices:
                devices.append(p.device)
    return devices


def _transported(t: torch.Tensor) -> torch.Tensor:
    """What a transport delivers: a fresh contiguous copy with no autograd history."""
    return t.detach().clone(memory_format=torch.contiguous_format)


class DSPSimulator:
    """``K`` DSP stages in one process.

    Args:
        modules: the ``K`` blocks, in pipeline order.
        optimizers: one optimizer per block, over that block's parameters.
        staleness: ``(m_0, ..., m_{K-1})``, non-increasing, last 0.
        loss_fn: ``loss_fn(output, targets) -> scalar`` for the last block.
        bn_policy: ``"forward"`` or ``"recompute"`` (see :mod:`tritonopt.dist.dsp_core`).
        recompute: ``"serial"`` or ``"overlap"`` (each stage recomputes beside its next forward,
            in a worker thread; the same results).
        flush: ``"epoch"`` (each :meth:`train` drains the pipeline) or ``"never"``
            (batches stream across calls; :meth:`flush` drains).
        seeds: per-stage RNG seeds, or ``None`` to share the caller's stream.
        record_events: keep each stage's ``(kind, batch, version)`` events (``stages[k].events``).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        optimizers: Sequence,
        staleness: Sequence[int],
        loss_fn: Callable,
        *,
        bn_policy: str = "forward",
        recompute: str = "serial",
        flush: str = "epoch",
        seeds: Optional[Sequence[int]] = None,
        record_events: bool = False,
    ):
        modules, optimizers = list(modules), list(optimizers)
        if not modules:
            raise ValueError("modules must hold at least one block")
        for k, module in enumerate(modules):
            if not isinstance(module, nn.Module):
                raise TypeError(f"modules[{k}] must be an nn.Module, got {type(module).__name__}")
        if len(optimizers) != len(modules):
            raise ValueError(f"need one optimizer per block: {len(modules)} blocks, {len(optimizers)} optimizers")
        for k, opt in enumerate(optimizers):
            if not (callable(getattr(opt, "step", None)) and callable(getattr(opt, "zero_grad", None))):
                raise TypeError(f"optimizers[{k}] must have step() and zero_grad(), got {type(opt).__name__}")
        staleness = tuple(staleness)
        if len(staleness) != len(modules):
            raise ValueError(f"need one staleness per block: {len(modules)} blocks, {len(staleness)} values")
        staleness = check_staleness(staleness)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        check_modes(bn_policy=bn_policy, recompute=recompute, flush=flush)
        if seeds is not None:
            seeds = list(seeds)
            if len(seeds) != len(modules) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
                raise ValueError(f"seeds must be one int per block ({len(modules)}), got {seeds!r}")

        num_stages = len(modules)
        self.staleness = staleness
        self.flush_mode = flush
        self.stages = [
            StageCompute(
                modules[k], optimizers[k], staleness[k], is_first=k == 0, is_last=k == num_stages - 1,
                loss_fn=loss_fn, bn_policy=bn_policy, recompute=recompute, record_events=record_events,
            )
            for k in range(num_stages)
        ]
        self._devices = _module_devices(modules)
        self._rng_states = None
        if seeds is not None:
            self._rng_states = []
            for seed in seeds:
                with torch.random.fork_rng(devices=self._devices):
                    torch.manual_seed(seed)
                    self._rng_states.append(capture_rng(self._devices))
        self._next_batch = 0  # global batch id of the next batch (streaming)
        # Messages in flight, kept across calls like a transport's: into stage k from k - 1 / k + 1.
        self._activations: list[deque] = [deque() for _ in range(num_stages)]
        self._gradients: list[deque] = [deque() for _ in range(num_stages)]
        self._input_bytes: list[Optional[int]] = [None] * num_stages  # one batch's input, per stage

    # ------------------------------------------------------------ driving

    def train(self, batches: Iterable, *, interleaving_seed: Optional[int] = None) -> torch.Tensor:
        """Run ``batches`` (``(inputs, targets)`` pairs) through the pipeline; the losses, in order.

        ``interleaving_seed``: ``None`` runs the stages round-robin; an int picks the
        next stage to act at random among those that can (the results do not
        change when every stage has its own RNG stream, or none draws).
        """
        batches = list(batches)
        for i, item in enumerate(batches):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError(f"batches[{i}] must be an (inputs, targets) pair, got {type(item).__name__}")
            if not isinstance(item[0], torch.Tensor):
                raise TypeError(f"batches[{i}][0] (inputs) must be a tensor, got {type(item[0]).__name__}")
            if item[0].shape != batches[0][0].shape or item[0].dtype != batches[0][0].dtype:
                raise ValueError(
                    f"every batch's inputs must have one shape and dtype: batch 0 has "
                    f"{tuple(batches[0][0].shape)} {batches[0][0].dtype}, batch {i} has "
                    f"{tuple(item[0].shape)} {item[0].dtype}"
                )
        first = self._next_batch if self.flush_mode == "never" else 0
        losses = self._run(batches, first, interleaving_seed)
        if self.flush_mode == "never":
            self._next_batch += len(batches)
        else:
            self._run([], first + len(batches), interleaving_seed)
        return losses

    def flush(self) -> None:
        """Back-propagate every batch still queued (streaming mode)."""
        self._run([], self._next_batch, None)

    def _run(self, batches: list, first: int, interleaving_seed: Optional[int]) -> torch.Tensor:
        num_stages = len(self.stages)
        targets = {first + i: y for i, (_, y) in enumerate(batches)}
        inputs = {first + i: x for i, (x, _) in enumerate(batches)}
        schedules = [
            iter(stage_actions(s.staleness, s.is_last, first, len(batches), s.pending)) for s in self.stages
        ]
        current: list[Optional[tuple[str, int]]] = [next(it, None) for it in schedules]
        activations, gradients = self._activations, self._gradients
        losses: list[torch.Tensor] = []
        chooser = random.Random(interleaving_seed) if interleaving_seed is not None else None

        def ready(k: int) -> bool:
            action = current[k]
            if action is None:
                return False
            kind, batch = action
            if kind == "backward":
                return bool(gradients[k])
            return k == 0 or bool(activations[k])

        def act(k: int) -> None:
            kind, batch = current[k]
            stage = self.stages[k]
            if kind == "backward":
                got, grad_output = gradients[k].popleft()
                assert got == batch, f"stage {k}: gradient of batch {got} arrived, expected {batch}"
                grad_input = stage.backward(batch, grad_output)
                if k > 0:
                    gradients[k - 1].append((batch, _transported(grad_input)))
            else:
                if k == 0:
                    x = inputs[batch]
                else:
                    got, x = activations[k].popleft()
                    assert got == batch, f"stage {k}: activation of batch {got} arrived, expected {batch}"
                if self._input_bytes[k] is None:
                    self._input_bytes[k] = x.numel() * x.element_size()
                if kind == "forward":
                    activations[k + 1].append((batch, _transported(stage.forward(batch, x))))
                else:
                    loss, grad_input = stage.forward_backward(batch, x, targets[batch])
                    losses.append(loss)
                    if k > 0:
                        gradients[k - 1].append((batch, _transported(grad_input)))
            current[k] = next(schedules[k], None)

        caller_rng = capture_rng(self._devices) if self._rng_states is not None else None
        try:
            while any(a is not None for a in current):
                candidates = [k for k in range(num_stages) if ready(k)]
                if not candidates:
                    raise RuntimeError(f"DSP simulation deadlocked at actions {current}")
                order = [chooser.choice(candidates)] if chooser is not None else candidates
                for k in order:
                    while ready(k):
                        if self._rng_states is not None:
                            set_rng(self._rng_states[k], self._devices)
                        act(k)
                        if self._rng_states is not None:
                            self._rng_states[k] = capture_rng(self._devices)
                        if chooser is not None:
                            break
        except BaseException:
            for stage in self.stages:  # no recomputation thread outlives a failed run
                stage.discard_prefetch()
            raise
        finally:
            if caller_rng is not None:
                set_rng(caller_rng, self._devices)
        return torch.stack(losses) if losses else torch.empty(0)

    # ------------------------------------------------------------ reports

    def memory_report(self) -> list[dict[str, int]]:
        """Per stage: the input queue now, its peak between steps, and the formula ``m_k B s_in b``."""
        reports = []
        for k, stage in enumerate(self.stages):
            reports.append(
                {
                    "staleness": stage.staleness,
                    "queue_entries": len(stage.pending),
                    "queue_bytes": stage.queue_bytes(),
                    "peak_queue_entries": stage.peak_queue_entries,
                    "peak_queue_bytes": stage.peak_queue_bytes,
                    "expected_queue_bytes": stage.staleness * (self._input_bytes[k] or 0),
                }
            )
        return reports


def simulate_dsp(
    modules: Sequence[nn.Module],
    optimizers: Sequence,
    batches: Iterable,
    staleness: Sequence[int],
    loss_fn: Callable,
    **options,
) -> torch.Tensor:
    """Train ``modules`` as a DSP pipeline on ``batches`` in one process; the last stage's losses.

    The arithmetic of ``K`` :class:`~tritonopt.dist.DSPStage` ranks, bit for bit
    (see :class:`DSPSimulator`, whose keyword options ``bn_policy``, ``recompute``, ``seeds``,
    ``record_events`` and ``interleaving_seed`` this accepts). One epoch, drained
    at the end (``flush="epoch"``).
    """
    interleaving_seed = options.pop("interleaving_seed", None)
    simulator = DSPSimulator(modules, optimizers, staleness, loss_fn, **options)
    return simulator.train(batches, interleaving_seed=interleaving_seed)
