"""K-FAC's checkpoints: ``state_dict`` with unpadded factors, its checks, and loading it back."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tritonopt._validation import FLOAT_DTYPES, check_int, check_tensor
from tritonopt.optim._kfac_arguments import HYPERPARAMETERS, check_hyperparameter
from tritonopt.optim._kfac_layers import KFACLayer
from tritonopt.optim.kfac_functional import factor_buffer

__all__ = ["KFACCheckpoints"]

def _layer_layout(layer) -> list[tuple]:
    """The layer's weight (and bias) as ``(shape, dtype)`` pairs: what a checkpoint's factors were saved for."""
    params = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    return [(tuple(p.shape), p.dtype) for p in params]


def _unpadded_copy(factor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A contiguous ``[dim, dim]`` copy of a (padded) factor, for a checkpoint."""
    return None if factor is None else factor.clone(memory_format=torch.contiguous_format)


class KFACCheckpoints:
    """The checkpoints of :class:`~tritonopt.optim.kfac_base.BaseKFACPreconditioner`.

    It uses the preconditioner's ``layers``, counters, hyperparameters, storage
    dtypes, ``eigen_shapes``, ``eigen_update`` and ``end_capture``.
    """

    def state_dict(self, include_eigen: bool = True) -> dict:
        """Steps, constant hyperparameters, factors and (by default) eigen data, per layer name.

        Tensors keep their storage dtypes, and factors are saved unpadded ``[dim, dim]``
        (contiguous); everything is plain data (loadable with
        ``torch.load(weights_only=True)``). Callable hyperparameters are not saved
        (pass them again to the constructor). With ``include_eigen`` a resumed run
        equals an uninterrupted one bit for bit; without it, :meth:`load_state_dict`
        recomputes the eigen data from the factors, which equals the uninterrupted
        run only when the factors did not change since the last eigen update.
        """
        layers = {}
        for layer in self.layers:
            entry = {
                "a_factor": _unpadded_copy(layer.a_factor),
                "g_factor": _unpadded_copy(layer.g_factor),
                "param_layout": _layer_layout(layer),
            }
            if include_eigen:
                entry["eigen"] = {k: v.clone() for k, v in layer.eigen.items()}
            layers[layer.name] = entry
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "hyperparameters": {k: v for k, v in self.hyperparameters.items() if not callable(v)},
            "prediv": self.prediv,
            "compute_method": self.compute_method,
            "layers": layers,
        }

    def check_state_dict(self, state_dict) -> None:
        """Raise ``ValueError`` naming the problem unless ``state_dict`` fits this preconditioner."""
        try:
            self._check_state_dict(state_dict)
        except TypeError as error:  # a field of the wrong kind is a bad value of the state dict
            raise ValueError(str(error)) from error

    def _check_state_dict(self, state_dict) -> None:
        if not isinstance(state_dict, dict) or "layers" not in state_dict or "steps" not in state_dict:
            raise ValueError(f"state_dict must be a dict from {type(self).__name__}.state_dict()")
        check_int("state_dict['steps']", state_dict["steps"], low=0)
        check_int("state_dict['skipped_steps']", state_dict.get("skipped_steps", 0), low=0)
        for key, mine in (("prediv", self.prediv), ("compute_method", self.compute_method)):
            if state_dict.get(key, mine) != mine:
                raise ValueError(f"state_dict was saved with {key}={state_dict[key]!r}, this preconditioner "
                                 f"has {key}={mine!r}")
        hyper = state_dict.get("hyperparameters", {})
        if not isinstance(hyper, dict):
            raise ValueError("state_dict['hyperparameters'] must be a dict")
        for name, value in hyper.items():
            if name not in HYPERPARAMETERS:
                raise ValueError(f"state_dict has an unknown hyperparameter {name!r}")
            check_hyperparameter(name, value)
        saved = state_dict["layers"]
        if not isinstance(saved, dict):
            raise ValueError("state_dict['layers'] must be a dict of layer names")
        names = [l.name for l in self.layers]
        if sorted(saved) != sorted(names):
            raise ValueError(f"state_dict has layers {sorted(saved)} but this preconditioner has {sorted(names)}")
        for layer in self.layers:
            entry = saved[layer.name]
            if not isinstance(entry, dict):
                raise ValueError(f"state_dict layer {layer.name!r}: expected a dict, got {type(entry).__name__}")
            saved_layout, layout = entry.get("param_layout"), _layer_layout(layer)
            if saved_layout is None or [(tuple(s), d) for s, d in saved_layout] != layout:
                raise ValueError(f"state_dict layer {layer.name!r}: param_layout {saved_layout!r} is not this layer's "
                                 f"{layout!r} (weight and bias shapes and dtypes): its factors are another layer's")
            for key, dim in (("a_factor", layer.a_dim), ("g_factor", layer.g_dim)):
                if key not in entry:
                    raise ValueError(f"state_dict layer {layer.name!r} has no {key!r}")
                if entry[key] is not None:
                    self._check_saved_tensor(layer, key, entry[key], (dim, dim))
            if (entry["a_factor"] is None) != (entry["g_factor"] is None):
                raise ValueError(f"state_dict layer {layer.name!r}: a_factor and g_factor must both be saved or both None")
            if "eigen" in entry:
                self._check_saved_eigen(layer, entry["eigen"])

    def _check_saved_tensor(self, layer: KFACLayer, key: str, value, shape) -> None:
        where = f"state_dict layer {layer.name!r}: {key}"
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{where} has shape {got}, expected {tuple(shape)}")
        check_tensor(where, value, dtypes=FLOAT_DTYPES)

    def _check_saved_eigen(self, layer: KFACLayer, eigen) -> None:
        if not isinstance(eigen, dict):
            raise ValueError(f"state_dict layer {layer.name!r}: eigen must be a dict, got {type(eigen).__name__}")
        if not eigen:
            return
        shapes = self.eigen_shapes(layer)
        if set(eigen) != set(shapes):
            raise ValueError(
                f"state_dict layer {layer.name!r}: eigen holds {sorted(eigen)}, expected {sorted(shapes)} "
                f"(compute_method={self.compute_method!r}, prediv={self.prediv})"
            )
        for name, shape in shapes.items():
            self._check_saved_tensor(layer, f"eigen {name!r}", eigen[name], shape)

    def restore_state(self, state_dict: dict, needs_eigen: Callable[[int], bool]) -> list[int]:
        """Load a checked state dict; returns the layers that need eigen data it lacks.

        Call :meth:`check_state_dict` first. Eigen data are kept for the layers
        ``needs_eigen`` accepts; a layer with saved factors and no (or empty)
        saved eigen data is returned for recomputation.
        """
        device = self.layers[0].weight.device
        for name, value in state_dict.get("hyperparameters", {}).items():
            if not callable(self.hyperparameters[name]):
                self.hyperparameters[name] = value
        self.steps = int(state_dict["steps"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        missing = []
        for index, layer in enumerate(self.layers):
            entry = state_dict["layers"][layer.name]
            for key in ("a_factor", "g_factor"):
                t = entry[key]
                stored = None
                if t is not None:  # into the padded layout the kernels load in vectors
                    stored = factor_buffer(t.shape[0], dtype=self.factor_dtype, device=device)
                    stored.copy_(t)
                setattr(layer, key, stored)
            layer.eigen = {}
            if not needs_eigen(index):
                continue
            saved = entry.get("eigen") or {}
            if saved:
                layer.eigen = {k: v.to(device=device, dtype=self.inv_dtype, copy=True) for k, v in saved.items()}
            elif layer.a_factor is not None:
                missing.append(index)
        self.end_capture()
        return missing

    def load_state_dict(self, state_dict: dict, compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; validated before anything changes.

        Eigen data missing from ``state_dict`` are recomputed from the factors when
        ``compute_inverses`` is true.
        """
        self.check_state_dict(state_dict)
        missing = self.restore_state(state_dict, needs_eigen=lambda index: True)
        if compute_inverses and missing:
            for i, data in self.eigen_update(missing, {}, self.hyperparameter("damping")).items():
                self.layers[i].eigen = data
