"""The M-FAC family beside IST-DASLab/EFCP, the code of Modoranu et al. (2024), "Error Feedback
Can Accurately Compress Preconditioners".

Pairs:

* ``S-MFAC``: :class:`tritonopt.optim.SparseMFAC` against EFCP's
  ``optimizers/sparse/SparseGradientMFAC.py`` (error feedback, Top-k, M-FAC on the sparse
  rows). EFCP's Top-k is *global*: ``k`` entries of largest ``|e + g|`` over the whole model.
  tritonopt's is blockwise and caps ``block_size`` at the model's size, so a block as large
  as the model is the same selection. EFCP keeps ``int(k_init * d)`` entries for a fraction
  ``k_init`` but exactly ``k_init`` for ``k_init > 1``; it is given tritonopt's
  ``k = ceil(density * d)``. At ResNet-18 size this one block holds 11.7 M entries, so the
  pair times tritonopt's Top-k in a configuration slower than its blockwise default.
* ``MFAC``: :class:`tritonopt.optim.MFAC` against EFCP's ``optimizers/dense/MFAC.py``
  (``DenseMFAC``). Both use ``F = damp I + (1/m) G^T G`` with ``m = ngrads`` from the first
  step (EFCP's ``denom = m + D_ii``; EFCP calls ``1/damp`` "lambd").

Settings: the demo's ``lr = 0.01``, ``damp = 0.03`` and 1 % density at every size, with the
demo's window of 128 gradients at the ``demo`` size and ``size.window`` elsewhere (the window
sets the cost; ``lr / damp`` keeps the agreement bound below the same). Both EFCP optimizers
get ``wd_type="wd"`` and ``weight_decay=0`` (their decay, ``theta *= 1 - gamma``, is
tritonopt's ``weight_decay = gamma / lr``; with none, both updates are ``theta -= lr * u``),
no momentum, and the model's device as ``dev`` and the only entry of ``gpus``. Each EFCP step
also computes the norms it logs; that is part of the step its users run, so it is timed.
Dense M-FAC's window is ``4 m d`` bytes on each side: at ResNet-18 size (``m = 1024``) 48 GB.

EFCP targets CUDA. To run it on a CPU, three calls into torch are answered for it while it
constructs and steps (:func:`_anchor_runtime`; its code is not changed): the rank, which it
asks ``torch.distributed`` for outside any process group (0); ``torch.lu(A, pivot=False)``,
which torch implements only on CUDA (from the Cholesky factor of ``A``, which is symmetric
positive definite); and ``torch.nn.parallel.parallel_apply`` over its one device, which torch
refuses without an accelerator (the one call, in this thread, as torch makes it).

Not paired:

* GGT (``optimizers/dense/GGT.py``): it forms ``g / eps - U U^T g / eps`` in float32, which
  cancels to about ``2^-24 / eps`` of ``|g|``, and adds ``1e-6 I`` to ``G^T G`` before its
  eigendecomposition. At the published ``eps = 1e-5`` the two implementations differ by
  2.6e-3 of ``max|theta|`` after 20 steps on the demo MLP in which the parameters move by
  6.7e-3 (1.8e-7 at ``eps = 0.1``): agreement would measure EFCP's rounding, not tritonopt.
  It also puts its state on ``cuda:<rank>`` whatever the model's device.
* SparseAdaGrad (``optimizers/sparse/SparseAdaGrad.py``): its step calls
  ``helpers.optim.apply_topk`` with a keyword (``layerwise_topk``) that function does not
  take, so it cannot run.
* LR-MFAC (``optimizers/lowrank/``): its coefficient setup calls the ``hinv_cuda``
  extension unconditionally (no CPU path), it keeps one window per layer, and its power
  iteration starts from its own ``torch.randn`` draws, so its compressed rows differ from
  tritonopt's from the first step.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from pathlib import Path
from typing import Iterator

import torch

from perf._optimizers import MFAC_HYPER, OptimizerStep
from perf.anchors import AnchorBroken, AnchorPair, broken, checkout, importable
from tritonopt.optim import MFAC, SparseMFAC, optimizer_state_bytes
from tritonopt.optim._blocks import kept_per_block

REPOSITORY = "IST-DASLab/EFCP"
FOLDER = "EFCP"
# Imported by EFCP's optimizers and helpers for experiment logging and GPU monitoring only.
LOGGING_MODULES = ("wandb", "line_profiler", "yaml", "tqdm", "gpustat")
DEMO_DENSITY = 0.01

# Steps of the agreement check: 20 of the demo's window of 128 rows, so that the Gram matrix
# and EFCP's coefficient recursion span many rows, and S-MFAC's error buffer has been fed
# back 19 times (entries move in and out of the Top-k).
AGREEMENT_STEPS = 20

# The bound on max|theta_tritonopt - theta_EFCP| / max|theta_EFCP| after T = AGREEMENT_STEPS
# steps, from float32 rounding (u = 2^-24 = 6.0e-8). Each step adds -lr * (c/damp - w @ G) to
# theta, rounded twice over:
# * the addition, at most u * max|theta|;
# * the update, whose two terms are each at most lr * max|c| / damp, with w @ G a sum of at
#   most T rows: at most T * u * lr * max|c| / damp. (The weights w, float64 Cholesky in
#   tritonopt, float32 unpivoted LU and M-FAC recursions in EFCP, are accurate far beyond
#   that: A = G G^T / damp + m I is well conditioned.)
# Summed over the steps, with P = sum_t lr * max|c_t| / damp / max|theta| the path the
# parameters travel (P = 5 on the demo MLP at lr / damp = 1/3), each implementation stays
# within T * (1 + P) * u = 20 * 6 * 6.0e-8 = 7.2e-6 of the exact trajectory, and the two
# within twice that, 1.4e-5. Measured on the demo MLP (tritonopt's float32 run and EFCP's
# against tritonopt's float64 run): 4.2e-7 and 4.2e-7 (M-FAC), 2.0e-7 and 2.0e-7 (S-MFAC);
# between the two, 2.3e-7 and 1.2e-7. The bound is the worst case (every rounding adding
# up); a wrong damping convention, a missing row or one changed Top-k entry (lr / damp *
# |a_k|, about 3e-4 of max|theta|) moves theta by 1e-4 or more. S-MFAC's Top-k selects from
# |e + g|, rounded alike by both: only two magnitudes within rounding of each other at the
# k-th place could select differently, and the check flags that.
# perf.bench_anchors measures in lockstep instead: both sides update the same parameters, and a
# step's update difference is taken relative to the update's largest entry. Each side is then
# within (T + 1) u R of the exact update, R = max(|c| / damp, |w @ G|) / max|update| being how
# far the update's two terms cancel; the two sides within 2 (T + 1) u R = 2.5e-6 R. The same
# 1.5e-5 allows R up to 6; measured there: 1.0e-7 for both pairs.
MFAC_RTOL = SPARSE_MFAC_RTOL = 1.5e-5


def _load(anchors_dir: Path) -> dict:
    """EFCP's S-MFAC and M-FAC classes, from the checkout under ``anchors_dir``."""
    root = checkout(anchors_dir, FOLDER).resolve()
    names = {"SparseMFAC": ("optimizers.sparse.SparseGradientMFAC", "SparseGradientMFAC"),
             "MFAC": ("optimizers.dense.MFAC", "DenseMFAC")}
    classes = {}
    with importable(root, stubs=LOGGING_MODULES):
        for key, (module_name, class_name) in names.items():
            try:
                module = importlib.import_module(module_name)
            except Exception as error:  # any import-time failure of the checkout
                raise broken(root, module_name, error) from error
            # EFCP's top-level packages have generic names (helpers, optimizers): make sure these
            # are EFCP's and not another package already imported under the same name.
            if not Path(module.__file__).resolve().is_relative_to(root):
                raise AnchorBroken(
                    f"{module_name} resolves to {module.__file__}, not to the {REPOSITORY}"
                    f" checkout at {root}: another package of that name is already imported"
                )
            classes[key] = getattr(module, class_name)
    for module in list(sys.modules.values()):
        if (getattr(module, "parallel_apply", None) is torch.nn.parallel.parallel_apply
                and module not in _PARALLEL_APPLY_USERS
                and Path(getattr(module, "__file__", None) or "/").resolve().is_relative_to(root)):
            _PARALLEL_APPLY_USERS.append(module)
    return classes


def _unpivoted_lu_from_cholesky(lu):
    """``torch.lu`` with ``pivot=False`` on CPU tensors, where torch implements it only on CUDA.

    EFCP factors ``A = lambd * G G^T + m I`` without pivoting; ``A`` is symmetric positive
    definite, so with its Cholesky factor ``A = C C^T`` the unpivoted LU is
    ``L = C diag(C)^-1`` (unit lower) and ``U = diag(C) C^T``, returned packed as LAPACK does
    (``U`` on and above the diagonal, ``L`` below), with identity pivots.
    """

    def factor(A, pivot=True, get_infos=False, out=None):
        if pivot or A.device.type != "cpu" or out is not None:
            return lu(A, pivot=pivot, get_infos=get_infos, out=out)
        C, info = torch.linalg.cholesky_ex(A)
        if get_infos is False and int(info.max()) != 0:
            raise RuntimeError("unpivoted LU: the matrix is not positive definite")
        diagonal = C.diagonal(dim1=-2, dim2=-1)
        packed = (diagonal.unsqueeze(-1) * C.mT).triu() + (C / diagonal.unsqueeze(-2)).tril(-1)
        pivots = torch.arange(1, A.shape[-1] + 1, dtype=torch.int32).expand(A.shape[:-1])
        return (packed, pivots, info) if get_infos else (packed, pivots)

    return factor


def _apply_in_turn(modules, inputs, kwargs_tup=None, devices=None):
    """``parallel_apply`` on a machine without an accelerator, where torch's refuses to run.

    EFCP runs its per-device work through ``parallel_apply`` with one entry per device; with
    the one CPU device that is one call, which torch's version also makes in the calling
    thread.
    """
    kwargs_tup = kwargs_tup or [{}] * len(modules)
    return [module(*(inp if isinstance(inp, (list, tuple)) else (inp,)), **kwargs)
            for module, inp, kwargs in zip(modules, inputs, kwargs_tup)]


# torch.nn.parallel and the EFCP modules that bound its parallel_apply at import (filled by _load).
_PARALLEL_APPLY_USERS: list = [torch.nn.parallel]


@contextlib.contextmanager
def _anchor_runtime() -> Iterator[None]:
    """What EFCP's optimizers need from torch on one CPU process, for the span of a call.

    * ``torch.distributed.get_rank()``: EFCP's steps ask for the rank whenever the package is
      available, initialised or not; outside a process group this process is rank 0.
    * ``torch.lu(A, pivot=False)`` on CPU tensors: see :func:`_unpivoted_lu_from_cholesky`.
    * ``torch.nn.parallel.parallel_apply`` without an accelerator: see :func:`_apply_in_turn`.
    """
    patches = [(torch, "lu", _unpivoted_lu_from_cholesky(torch.lu))]
    if not torch.accelerator.is_available():
        for owner in _PARALLEL_APPLY_USERS:
            patches.append((owner, "parallel_apply", _apply_in_turn))
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        patches.append((torch.distributed, "get_rank", lambda *args, **kwargs: 0))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _tensors_bytes(*holders) -> int:
    """Bytes of the distinct tensors held as attributes (or in lists of them) of ``holders``."""
    seen, total = set(), 0
    for holder in holders:
        for value in vars(holder).values():
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
    return total


class EFCPStep(OptimizerStep):
    """An EFCP optimizer as a train step: its state lives in attributes, not ``optimizer.state``."""

    def __call__(self, x, y, loss_fn) -> float:
        with _anchor_runtime():  # entered outside the timed update
            return super().__call__(x, y, loss_fn)

    def state_bytes(self) -> int:
        held = _tensors_bytes(self.optimizer, self.optimizer.hinv)
        return held + optimizer_state_bytes(self.optimizer)


def _quietly(make):
    """Build an EFCP optimizer without its constructor's prints."""
    with contextlib.redirect_stdout(io.StringIO()), _anchor_runtime():
        return make()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def settings_at(size) -> dict:
    """The hyperparameters both sides of every pair get at ``size`` (see the module docstring)."""
    ngrads = MFAC_HYPER["ngrads"] if size.name == "demo" else size.window
    return dict(lr=MFAC_HYPER["lr"], ngrads=ngrads, damp=MFAC_HYPER["damp"], density=DEMO_DENSITY)


def kept_entries(model: torch.nn.Module, density: float) -> int:
    """Top-k's ``k`` over the whole model: tritonopt's rule for one block of ``d`` entries."""
    d = _parameter_count(model)
    kept = kept_per_block(density, None, d)
    if kept < 2:
        # EFCP reads k_init <= 1 as a fraction of d, so a count of 1 cannot be passed to it.
        raise ValueError(f"{density} of {d} parameters keeps {kept} entry;"
                         " the pair needs at least 2")
    return kept


def tritonopt_builders(size) -> dict:
    """Pair name -> tritonopt's side (``model -> OptimizerStep``) at ``size``; needs no checkout."""
    hyper = settings_at(size)
    window = dict(lr=hyper["lr"], ngrads=hyper["ngrads"], damp=hyper["damp"])

    def sparse(model):
        # One block over the whole model (BlockLayout caps the block at d): EFCP's global Top-k.
        kept_entries(model, hyper["density"])
        return OptimizerStep(model, SparseMFAC(model.parameters(), density=hyper["density"],
                                               block_size=_parameter_count(model), **window))

    def dense(model):
        return OptimizerStep(model, MFAC(model.parameters(), **window))

    return {"S-MFAC": sparse, "MFAC": dense}


def pairs(anchors_dir: Path, size) -> list[AnchorPair]:
    """S-MFAC and M-FAC, each by tritonopt and by EFCP, at ``size`` (see the module docstring)."""
    efcp = _load(anchors_dir)
    hyper = settings_at(size)
    common = dict(ngrads=hyper["ngrads"], lr=hyper["lr"], damp=hyper["damp"], wd_type="wd",
                  weight_decay=0.0, momentum=0.0)

    def efcp_sparse(model):
        # k as a count, not a fraction
        dev, kept = _device(model), kept_entries(model, hyper["density"])
        return EFCPStep(model, _quietly(lambda: efcp["SparseMFAC"](
            model.parameters(), k_init=kept, dev=dev, gpus=[dev], **common)))

    def efcp_dense(model):
        dev = _device(model)
        return EFCPStep(model, _quietly(lambda: efcp["MFAC"](
            model.parameters(), dev=dev, gpus=[dev], **common)))

    ours = tritonopt_builders(size)
    settings = dict(hyper, momentum=0.0, weight_decay=0.0)
    return [
        AnchorPair("S-MFAC", REPOSITORY, ours["S-MFAC"], efcp_sparse,
                   agreement_steps=AGREEMENT_STEPS, rtol=SPARSE_MFAC_RTOL,
                   settings=dict(settings, topk="global"),
                   notes="Top-k over the whole model (EFCP's is global): tritonopt with one block"),
        AnchorPair("MFAC", REPOSITORY, ours["MFAC"], efcp_dense, agreement_steps=AGREEMENT_STEPS,
                   rtol=MFAC_RTOL, settings={k: v for k, v in settings.items() if k != "density"}),
    ]
