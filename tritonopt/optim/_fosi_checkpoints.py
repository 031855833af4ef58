"""FOSI's checkpoints and copies: its global state beside the per-parameter one, checked before a load.

On sharded parameters the per-parameter state shows as DTensors (``eigenvectors``
``[r, *param.shape]`` sharded along dimension 1 like the parameter's rows). The
global state travels in the first parameter group as well, as plain numbers,
sharded or not: ``torch.distributed.checkpoint`` keeps only ``state`` and
``param_groups``.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tritonopt._validation import check_float, check_int
from tritonopt.optim._sharding import is_sharded, like_param_rows, local_tensor

BASE_STATE = {"adam": ("exp_avg", "exp_avg_sq"), "heavy_ball": ("momentum_buffer",), "sgd": ()}
_GLOBAL_KEYS = ("eigenvalues", "all_eigenvalues", "ritz_scale", "g1_velocity", "base_scale", "step",
                "base_step", "ese_count", "velocity_bound")
_GROUP_KEY = "fosi"  # the global state, as plain numbers, in the state dict's first parameter group
_VECTORS = ("eigenvalues", "all_eigenvalues", "g1_velocity")


def _padded_rows(vectors: torch.Tensor, rows: int) -> torch.Tensor:
    """``vectors`` ``[r, ...]`` with zero rows below, ``rows`` in all: a checkpoint's basis has one shape whatever
    ``r``, so that ``torch.distributed.checkpoint`` loads it into a fresh optimizer's template."""
    if vectors.shape[0] >= rows:
        return vectors
    return torch.cat([vectors, vectors.new_zeros((rows - vectors.shape[0], *vectors.shape[1:]))])


def _as_numbers(extra: dict) -> dict:
    """The global state with its tensors as lists of Python floats (exact: float64 and float32 fit) and dtypes."""
    out = dict(extra)
    for key in _VECTORS:
        value = extra[key]
        out[key] = None if value is None else value.tolist()
        out[f"{key}_dtype"] = None if value is None else str(value.dtype).removeprefix("torch.")
    return out


def _from_numbers(numbers) -> dict:
    """:func:`_as_numbers` undone (``ValueError`` naming what is malformed)."""
    if not isinstance(numbers, dict):
        raise ValueError(f"param_groups[0][{_GROUP_KEY!r}] must be a dict, got {type(numbers).__name__}")
    out = {key: value for key, value in numbers.items() if not key.endswith("_dtype")}
    for key in _VECTORS:
        values, dtype = numbers.get(key), numbers.get(f"{key}_dtype")
        if values is None:
            continue
        if dtype not in ("float32", "float64") or not isinstance(values, (list, tuple)):
            raise ValueError(f"param_groups[0][{_GROUP_KEY!r}][{key!r}] must be a list of floats with a float32 or "
                             f"float64 dtype, got {type(values).__name__} and {dtype!r}")
        out[key] = torch.tensor(values, dtype=getattr(torch, dtype))
    return out


def _check_same_global_state(extra, in_group: dict) -> None:
    """``state_dict()`` holds FOSI's global state twice (``state_dict['fosi']`` and its first group's copy):
    ``ValueError`` naming the first entry in which they differ."""
    if not isinstance(extra, dict):
        return  # _check_saved names the problem
    for key in sorted(set(extra) | set(in_group)):
        mine, theirs = extra.get(key), in_group.get(key)
        tensors = isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
        same = (mine.dtype == theirs.dtype and torch.equal(mine, theirs)) if tensors else (
            type(mine) is type(theirs) and not isinstance(mine, torch.Tensor) and mine == theirs)
        if not same:
            raise ValueError(f"state_dict['fosi'][{key!r}] is {mine!r} and param_groups[0][{_GROUP_KEY!r}][{key!r}] "
                             f"{theirs!r}: a state dict of state_dict() holds the same value in both")


class FOSICheckpoints:
    """``state_dict`` (with ``"fosi"``: the global state), ``load_state_dict`` and pickling for :class:`FOSI`."""

    LIKE_PARAM_ENTRIES = frozenset({"exp_avg", "exp_avg_sq", "momentum_buffer"})
    # The base optimizer's state and the basis V are per coordinate, laid out like the parameters; the Ritz
    # values, g1's velocity along V and the counters are the same on every rank.
    # So a torch.distributed.checkpoint resumes on any number of ranks, or in an unsharded optimizer.
    RESHARDABLE = True
    LIKE_PARAM_ROWS_ENTRIES = frozenset({"eigenvectors"})

    def state_dict(self) -> dict:
        state = super().state_dict()
        rows = self.config.k + self.config.l
        state["state"] = {key: {**entry, "eigenvectors": _padded_rows(entry["eigenvectors"], rows)}
                          if "eigenvectors" in entry and not is_sharded(entry["eigenvectors"]) else entry
                          for key, entry in state["state"].items()}
        state["fosi"] = {
            "eigenvalues": self.eigenvalues.clone(),
            "all_eigenvalues": self.all_eigenvalues.clone(),
            "ritz_scale": self.ritz_scale,
            "g1_velocity": None if self.g1_velocity is None else self.g1_velocity.clone(),
            "base_scale": self.base_scale,
            "step": self.step_count,
            "base_step": self.base_step,
            "ese_count": self.ese_count,
            "velocity_bound": self.velocity_bound,
            **self.subspace.identity(),
        }
        if state["param_groups"]:  # what torch.distributed.checkpoint keeps, sharded or not
            state["param_groups"][0][_GROUP_KEY] = _as_numbers(state["fosi"])
        return state

    def _sharded_state(self, saved_state: dict) -> dict:
        shown = super()._sharded_state(saved_state)
        params = [p for group in self.param_groups for p in group["params"]]
        for key, entry in shown.items():
            vectors = entry.get("eigenvectors")
            if isinstance(vectors, torch.Tensor) and not is_sharded(vectors):
                entry["eigenvectors"] = like_param_rows(_padded_rows(vectors, self.config.k + self.config.l),
                                                        params[key])
        return shown

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`; a malformed or foreign one raises before anything changes."""
        extra, problem = None, None
        try:
            if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
                raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (an optimizer's "
                                 "state_dict)")
            state_dict = dict(state_dict)
            extra, in_group = state_dict.pop("fosi", None), None
            groups = state_dict["param_groups"]
            if isinstance(groups, (list, tuple)) and any(isinstance(g, dict) and _GROUP_KEY in g for g in groups):
                in_group = _from_numbers(groups[0].get(_GROUP_KEY) if isinstance(groups[0], dict) else None)
                if extra is None:  # through torch.distributed.checkpoint, which keeps only the groups
                    extra = in_group
                state_dict["param_groups"] = [{k: v for k, v in g.items() if k != _GROUP_KEY}
                                              if isinstance(g, dict) else g for g in groups]
            if extra is None:
                raise ValueError("state_dict has no 'fosi' entry: it was not saved by FOSI")
            state_dict["state"] = self._unpadded(state_dict["state"], extra)
            self._check_saved(state_dict, extra)
            if in_group is not None and in_group is not extra:
                _check_same_global_state(extra, in_group)
        except ValueError as exc:
            problem = exc
        except TypeError as exc:  # a field of the wrong kind is a bad value of the state dict
            problem = ValueError(str(exc))
            problem.__cause__ = exc
        device = self._trainable()[0].device if self._trainable() else torch.device("cpu")
        # Raises ``problem``; a distributed subspace first agrees with the other ranks.
        self.subspace.check_checkpoint(extra, device, problem)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])
            group.setdefault("initial_lr", group["lr"])
        self.eigenvalues = extra["eigenvalues"].to(torch.float64).clone()
        self.all_eigenvalues = extra["all_eigenvalues"].to(torch.float64).clone()
        self.ritz_scale = float(extra["ritz_scale"])
        velocity = extra["g1_velocity"]
        self.g1_velocity = None if velocity is None else velocity.to(device=device, copy=True)
        self.base_scale = float(extra["base_scale"])
        self.step_count, self.base_step = int(extra["step"]), int(extra["base_step"])
        self.ese_count = int(extra["ese_count"])
        self.velocity_bound = float(extra["velocity_bound"])

    def _unpadded(self, saved_state, extra):
        """The saved bases cut to their ``r`` rows (``r``: the saved Ritz values) where :meth:`state_dict` padded
        them to ``k + l``; anything else as given, for :meth:`_check_saved` to judge."""
        values = extra.get("eigenvalues") if isinstance(extra, dict) else None
        if not isinstance(saved_state, dict) or not isinstance(values, torch.Tensor) or values.dim() != 1:
            return saved_state
        rows, rank = self.config.k + self.config.l, values.numel()

        def cut(entry):
            vectors = entry.get("eigenvectors") if isinstance(entry, dict) else None
            if isinstance(vectors, torch.Tensor) and vectors.dim() >= 1 and vectors.shape[0] == rows != rank:
                return {**entry, "eigenvectors": vectors[:rank]}
            return entry

        return {key: cut(entry) for key, entry in saved_state.items()}

    def _check_saved(self, state_dict: dict, extra) -> None:
        """Everything a load relies on, checked before anything changes (names the first problem)."""
        if not isinstance(extra, dict):
            raise ValueError(f"state_dict['fosi'] must be a dict, got {type(extra).__name__}")
        missing = [key for key in _GLOBAL_KEYS if key not in extra]
        if missing:
            raise ValueError(f"state_dict['fosi'] lacks {missing}")
        for key in ("eigenvalues", "all_eigenvalues"):
            value = extra[key]
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
                raise ValueError(f"state_dict['fosi'][{key!r}] must be a 1-D float tensor")
            if value.numel() > self.config.k + self.config.l:
                raise ValueError(f"state_dict['fosi'][{key!r}] holds {value.numel()} Ritz values but this "
                                 f"optimizer keeps at most k + l = {self.config.k + self.config.l}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"state_dict['fosi'][{key!r}] holds NaN or inf")
        for key in ("ritz_scale", "base_scale", "velocity_bound"):
            check_float(f"state_dict['fosi'][{key!r}]", extra[key], low=0.0)
        for key in ("step", "base_step", "ese_count"):
            check_int(f"state_dict['fosi'][{key!r}]", extra[key], low=0)
        rank = extra["eigenvalues"].numel()
        velocity = extra["g1_velocity"]
        if velocity is not None and (not isinstance(velocity, torch.Tensor) or velocity.shape != (rank,)
                                     or not bool(torch.isfinite(velocity).all())):
            raise ValueError(f"state_dict['fosi']['g1_velocity'] must be None or a finite [{rank}] tensor")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        # The rule every packed optimizer keeps (the parameter layout it was saved for, the
        # hyperparameters, skipped_steps), here so that a distributed subspace agrees on it.
        super().check_state_dict(state_dict)
        saved = self._local_state_dict(state_dict)["state"]  # a sharded optimizer's DTensors as their local parts
        expected = {*BASE_STATE[self.config.base], "eigenvectors"}
        for group, saved_group in zip(self.param_groups, groups):
            if len(group["params"]) != len(saved_group.get("params", ())):
                raise ValueError("state_dict's parameter groups hold other numbers of parameters")
            for p, pid in zip(group["params"], saved_group["params"]):
                entry = saved.get(pid)
                if not p.requires_grad:
                    continue
                if not entry:
                    if saved:
                        raise ValueError(f"state_dict has no state for parameter {pid} while others have some")
                    continue
                if set(entry) != expected:
                    raise ValueError(f"state_dict holds state {sorted(entry)} for parameter {pid}; FOSI with "
                                     f"base={self.config.base!r} keeps {sorted(expected)}")
                local = local_tensor(p)
                for name, value in entry.items():
                    shape = (rank, *local.shape) if name == "eigenvectors" else tuple(local.shape)
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                        raise ValueError(f"state {name!r} of parameter {pid} must have shape {shape}, got {got}")
                    if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                        raise ValueError(f"state {name!r} of parameter {pid} must be finite floating point")

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # Per-parameter state entries are views of flat buffers; a pickle would store the
        # whole buffer once per view. Standalone copies keep it the size of the state.
        state["state"] = defaultdict(dict, {
            p: {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in entry.items()}
            for p, entry in self.state.items()
        })
        return state
