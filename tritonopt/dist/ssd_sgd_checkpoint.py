"""SSD-SGD's per-rank checkpoints: what ``state_dict`` saves, and what ``load_state_dict`` checks before restoring.

A checkpoint holds torch's ``state`` and ``param_groups`` (each parameter's
``pre_weight``, ``shadow_weight``, ``shadow_momentum``, ``sync_momentum`` and its
``local_weight``), ``skipped_steps``, and an ``"ssd_sgd"`` entry: what it was
saved for (rank, world size, settings, each parameter's shape and dtype), the
counters of :class:`~tritonopt.dist.ssd_sgd_core.WindowState`, the trailer of
the synchronisation buffer and the rank's ``sync_buffers``. Loading checks every
field's type and range and every tensor's shape and dtype (nothing is cast),
then that the ranks' global state agrees, before anything changes.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from tritonopt.dist._agreement import check_ranks_agree
from tritonopt.dist._startup import agreement_device
from tritonopt.dist.ssd_sgd_check import CHECK_ELEMENTS, DIGEST_BITS
from tritonopt.dist.ssd_sgd_core import GROUP_KEYS, VERDICTS, WindowState

__all__ = ["STATE_NAMES", "SSDSGDCheckpoints", "param_layout"]

STATE_NAMES = ("pre_weight", "shadow_weight", "shadow_momentum", "sync_momentum")
# What a checkpoint holds per parameter: the state above and the rank's local weight.
_ENTRY_NAMES = frozenset(STATE_NAMES + ("local_weight",))
# Entries that must be finite; the shadow may hold a bad window's NaN until its synchronisation.
_FINITE_ENTRIES = ("pre_weight", "sync_momentum", "local_weight")
# The checkpoint's "ssd_sgd" entry: what it must hold, no more.
_SAVED_FIELDS = frozenset((
    "rank", "world_size", "comm", "delay_steps", "warmup_steps", "layout", "steps", "delay_ready",
    "window_start", "window_digest", "sync_state", "sync_scale", "verdict", "resolved", "pull_due", "trailer",
    "sync_buffers",
))


def param_layout(groups: Sequence[dict]) -> list[list[tuple]]:
    """Each group's parameters as (shape, dtype) pairs, in order: what a checkpoint was saved for."""
    return [[(tuple(p.shape), p.dtype) for p in group["params"]] for group in groups]


def _tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
    """A saved ``layout`` in the form :func:`param_layout` gives, or None if it is not one."""
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


class SSDSGDCheckpoints:
    """``state_dict``, ``check_state_dict`` and ``load_state_dict`` of :class:`~tritonopt.dist.SSDSGD`.

    Reads the optimizer's settings (``rank``, ``world_size``, ``comm_mode``,
    ``delay_steps``, ``warmup_steps``, ``param_groups`` and their check
    ``_check_group``), its core (``_core``), its transport (``_transport``, whose
    in-flight collectives are flushed first) and what the agreement check needs
    (``_settings``, ``_collectives``, ``process_group``).
    """

    def state_dict(self) -> dict:
        """Per-rank state: flushes an in-flight synchronisation first (it stays to be consumed).

        Besides torch's ``state`` and ``param_groups`` and ``skipped_steps``, the
        ``"ssd_sgd"`` entry names what it was saved for (this rank, the world size,
        the settings, and each parameter's shape and dtype in order) and holds the
        counters, the synchronisation's trailer and this rank's ``sync_buffers``.
        It holds only tensors, numbers, strings, dtypes and lists of them, so
        ``torch.load(..., weights_only=True)`` reads it back.
        """
        self._transport.flush()
        state = super().state_dict()
        core = self._core
        params = core.flat.params
        state["state"] = {
            index: {**value, "local_weight": params[index].detach().clone()}
            for index, value in state["state"].items()
        }
        state["ssd_sgd"] = dict(
            rank=self.rank, world_size=self.world_size, comm=self.comm_mode,
            delay_steps=self.delay_steps, warmup_steps=self.warmup_steps, layout=param_layout(self.param_groups),
            **core.window.saved(),
            trailer=core.trailer.clone(),
            # The rank's own statistics: construction broadcast rank 0's over those the model restored.
            sync_buffers=[b.detach().clone() for b in core.sync_buffers],
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
        mine = param_layout(self.param_groups)
        if _saved_layout(extra["layout"]) != mine:
            raise ValueError(
                f"layout: the state dict was saved for parameters {extra['layout']!r}, this optimizer "
                f"has {mine!r} (shape and dtype of each parameter, per group, in order); a checkpoint "
                "resumes only the parameters it was saved for"
            )
        window = self._checked_window(extra)

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
        core = self._core
        params = core.flat.params
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
                dtype = p.dtype if name == "local_weight" else core.state_dtype
                _check_saved_tensor(f"state[{index!r}][{name!r}]", value, tuple(p.shape), dtype,
                                    finite=name in _FINITE_ENTRIES)
            entries.append(entry)
        b = sum(t.numel() for t in core.sync_buffers)
        _check_saved_tensor("ssd_sgd['trailer']", extra["trailer"], (b + CHECK_ELEMENTS,), core.state_dtype)
        saved_buffers = extra["sync_buffers"]
        if not isinstance(saved_buffers, (list, tuple)) or len(saved_buffers) != len(core.sync_buffers):
            raise ValueError(f"ssd_sgd['sync_buffers'] must list this optimizer's {len(core.sync_buffers)} "
                             "floating-point sync_buffers")
        for i, (saved, own) in enumerate(zip(saved_buffers, core.sync_buffers)):
            _check_saved_tensor(f"ssd_sgd['sync_buffers'][{i}]", saved, tuple(own.shape), own.dtype)

        def flat_of(name: str) -> torch.Tensor:
            return torch.cat([entry[name].reshape(-1) for entry in entries])

        return dict(
            window=window, skipped=skipped, groups=groups, trailer=extra["trailer"], sync_buffers=saved_buffers,
            pre=flat_of("pre_weight"), sync_momentum=flat_of("sync_momentum"), local=flat_of("local_weight"),
            server=torch.cat([flat_of("shadow_weight"), flat_of("shadow_momentum")]),
        )

    def _checked_window(self, extra: dict) -> WindowState:
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
        sync_state = _saved_choice(extra, "sync_state", self._core.SAVED_SYNC_STATES)
        if sync_state == "ready" and not at_sync_point:
            raise ValueError(f"ssd_sgd['sync_state']='ready' needs steps={steps} at a synchronisation point")
        sync_scale = extra["sync_scale"]
        if type(sync_scale) is not float or sync_scale not in (1.0, 1.0 / self.world_size):
            raise ValueError(f"ssd_sgd['sync_scale'] must be 1.0 or 1/world_size, got {sync_scale!r}")
        verdict = _saved_choice(extra, "verdict", VERDICTS)
        if verdict is not None and not delay_ready:
            raise ValueError(f"ssd_sgd['verdict']={verdict!r} needs the delay stage (delay_ready)")
        resolved = _saved_bool(extra, "resolved")
        pull_due = _saved_bool(extra, "pull_due")
        if pull_due and (not self._core.KEEPS_PULL_DUE or not at_sync_point):
            raise ValueError(f"ssd_sgd['pull_due'] is set off a per_step synchronisation point (steps={steps})")
        return WindowState(steps=steps, delay_ready=delay_ready, window_start=window_start,
                           window_digest=window_digest, sync_state=sync_state, sync_scale=sync_scale,
                           verdict=verdict, resolved=resolved, pull_due=pull_due)

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
            self._transport.flush()  # a collective this rank launched must complete before the state changes
            window = saved["window"]
            settings = {
                **self._settings(self._core.sync_buffers, self._requested_timeout),
                "the saved hyperparameters": [[g.get(k) for k in GROUP_KEYS] for g in saved["groups"]],
                "the step counters": (window.steps, window.window_start, window.delay_ready, window.sync_state,
                                      window.verdict, window.pull_due),
                "the pre-weight": _tensor_digest(saved["pre"]),
                "the synchronised momentum": _tensor_digest(saved["sync_momentum"]),
                "the synchronised server state": (_tensor_digest(saved["server"])
                                                  if self._core.saved_server_is_global(window) else ""),
            }
        try:
            check_ranks_agree("SSDSGD", settings, comm=self._collectives, group=self.process_group,
                              device=agreement_device(self.process_group), label="load_state_dict_check",
                              problem=problem, stage="while loading its state")
        except ValueError as error:
            if problem is not None or "configured differently" not in str(error):
                raise
            raise ValueError(f"{error}; load each rank's state dict from one checkpoint") from error
        for group, saved_group in zip(self.param_groups, saved["groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self._core.restore(saved["window"], pre=saved["pre"], sync_momentum=saved["sync_momentum"],
                           server=saved["server"], trailer=saved["trailer"], local=saved["local"],
                           sync_buffers=saved["sync_buffers"])
        self._transport.forget()
        self.skipped_steps = saved["skipped"]
