"""The table of optimizers the contract tests run through (in the manner of torch's ``OptimizerInfo``).

Each entry says how to build the optimizer on a small problem and which bad
hyperparameters it must name. A *run* (``ParamsRun`` or ``ModelRun``) owns the
parameters (or model), the optimizer and a deterministic stream of gradients,
so that a contract test can step it, poison a gradient, copy it or checkpoint
it and compare bit for bit. A new optimizer joins every contract test by
adding an entry here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

import tritonopt
from _helpers import SHAPES, gradient_stream, make_params, set_grads, state_tensors


class ParamsRun:
    """An optimizer that consumes ``.grad`` of ``shapes`` parameters; gradient ``i`` is fixed by ``i``."""

    def __init__(self, info: "OptimizerInfo", *, on_nonfinite: str = "skip", seed: int = 0,
                 dtype: torch.dtype = torch.float32, shapes=SHAPES):
        self.shapes = shapes
        self.params = make_params(shapes, seed, dtype)
        self.optimizer = info.build(self.params, on_nonfinite=on_nonfinite)
        self.optimizers = [self.optimizer]

    def gradients(self, i: int) -> list[torch.Tensor]:
        return gradient_stream(self.shapes, 1, seed=100 + i)[0]

    def step(self, i: int, poison: Optional[Callable[[list[torch.Tensor]], None]] = None):
        grads = self.gradients(i)
        if poison is not None:
            poison(grads)
        set_grads(self.params, grads)
        return self.optimizer.step()

    def snapshot(self, ignore: tuple = ()) -> list:
        """Parameters, then every optimizer's state dict (keys in ``ignore`` left out), cloned."""
        return [p.detach().clone() for p in self.params] + state_tensors(
            [o.state_dict() for o in self.optimizers], ignore
        )

    def checkpoint(self) -> dict:
        return {"params": [p.detach().clone() for p in self.params],
                "optimizers": [o.state_dict() for o in self.optimizers]}

    def restore(self, checkpoint: dict) -> None:
        with torch.no_grad():
            for p, value in zip(self.params, checkpoint["params"]):
                p.copy_(value)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizers"]):
            optimizer.load_state_dict(state)


class ModelRun(ParamsRun):
    """An optimizer that needs a model (curvature from its loss, or layer hooks): a small MLP classifier.

    ``sizes`` are the layer widths (inputs, hidden, classes); ``reversed_params``
    gives the optimizer the model's parameters in reverse order.
    """

    def __init__(self, info: "OptimizerInfo", *, on_nonfinite: str = "skip", seed: int = 0,
                 dtype: torch.dtype = torch.float32, sizes=(6, 8, 3), reversed_params: bool = False):
        torch.manual_seed(seed)
        inputs, hidden, self.classes = sizes
        self.model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(),
                                         torch.nn.Linear(hidden, self.classes)).to(dtype)
        self.params = list(self.model.parameters())
        self.optimizer_params = self.params[::-1] if reversed_params else self.params
        gen = torch.Generator().manual_seed(1)  # the data belongs to the problem, not to the run's seed
        self.curvature_batch = (torch.randn(32, inputs, generator=gen).to(dtype),
                                torch.randint(0, self.classes, (32,), generator=gen))
        self.optimizers = info.build_for_model(self, on_nonfinite=on_nonfinite)
        self.optimizer = self.optimizers[0]

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(16, self.model[0].in_features, generator=gen).to(self.params[0].dtype)
        return x, torch.randint(0, self.classes, (16,), generator=gen)

    def curvature_loss(self) -> torch.Tensor:
        x, y = self.curvature_batch
        return torch.nn.functional.cross_entropy(self.logits(x), y)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output, in float32 when the model computes in a narrower dtype."""
        out = self.model(x)
        return out if out.dtype in (torch.float32, torch.float64) else out.float()

    def step(self, i: int, poison: Optional[Callable[[list[torch.Tensor]], None]] = None):
        self.model.zero_grad(set_to_none=True)
        x, y = self.batch(i)
        torch.nn.functional.cross_entropy(self.logits(x), y).backward()
        if poison is not None:
            grads = [p.grad for p in self.params]
            poison(grads)
        return self.info_step(self)

    info_step: Callable = staticmethod(lambda run: run.optimizer.step())


@dataclass
class OptimizerInfo:
    name: str
    run: type  # ParamsRun or ModelRun
    build: Optional[Callable] = None  # build(params, **kwargs) for ParamsRun
    build_for_model: Optional[Callable] = None  # build_for_model(run, **kwargs) -> [optimizers] for ModelRun
    bad_hyperparameters: list = field(default_factory=list)  # (kwargs, word the message must contain)
    steps_to_wrap: int = 4  # steps after which any window has wrapped
    param_groups: bool = True  # accepts several groups with their own hyperparameters
    bad_group: Optional[dict] = None  # a group option that must be refused by add_param_group
    # Contract tests this optimizer does not pass yet: test name -> the defect (strict xfail).
    known_defects: dict = field(default_factory=dict)
    # Run options that build the same problem for other parameters: a checkpoint of the default
    # run must be refused by each (name -> make_run keyword arguments).
    other_layouts: dict = field(default_factory=lambda: {
        "permuted shapes": dict(shapes=SHAPES[::-1]),
        "transposed shapes": dict(shapes=[tuple(reversed(s)) for s in SHAPES]),
        "another dtype": dict(dtype=torch.bfloat16),
    })

    def make_run(self, **kwargs):
        return self.run(self, **kwargs)


def _windowed(cls, **hyper):
    return lambda params, **kwargs: cls(params, **{**hyper, **kwargs})


COMMON_BAD = [
    (dict(lr=-1.0), "lr"),
    (dict(lr=math.nan), "lr"),
    (dict(lr=torch.tensor(0.1)), "lr"),
    (dict(on_nonfinite="ignore"), "on_nonfinite"),
]
WINDOW_BAD = COMMON_BAD + [
    (dict(ngrads=0), "ngrads"),
    (dict(ngrads=2.0), "ngrads"),
    (dict(momentum=1.0), "momentum"),
    (dict(weight_decay=-1.0), "weight_decay"),
]
SPARSE_BAD = [
    (dict(density=0.0), "density"),
    (dict(density=1.5), "density"),
    (dict(block_size=0), "block_size"),
    (dict(error_feedback=1), "error_feedback"),
    (dict(values_dtype=torch.float16), "values_dtype"),
]

OPTIMIZERS = [
    OptimizerInfo(
        "SparseAdaGrad", ParamsRun,
        build=_windowed(tritonopt.optim.SparseAdaGrad, lr=0.05, density=0.25, block_size=16, weight_decay=0.01),
        bad_hyperparameters=COMMON_BAD + [
            (dict(eps=-1.0), "eps"), (dict(eps=0.0), "eps"), (dict(density=0.0), "density"), (dict(k=0), "k"),
            (dict(block_size=0), "block_size"), (dict(density=0.1, k=2), "density or k"),
        ],
        bad_group={"density": 2.0},
    ),
    OptimizerInfo(
        "FlatSGD", ParamsRun,
        build=_windowed(tritonopt.optim.FlatSGD, lr=0.05, momentum=0.9, weight_decay=0.01),
        bad_hyperparameters=COMMON_BAD + [
            (dict(momentum=-0.5), "momentum"), (dict(dampening=math.nan), "dampening"),
            (dict(weight_decay=-1.0), "weight_decay"), (dict(nesterov=True, dampening=0.1), "nesterov"),
            (dict(nesterov=1), "nesterov"), (dict(maximize="yes"), "maximize"),
        ],
        bad_group={"momentum": -1.0},
    ),
    OptimizerInfo(
        "MFAC", ParamsRun,
        build=_windowed(tritonopt.optim.MFAC, lr=0.05, ngrads=3, damp=0.1, momentum=0.5, weight_decay=0.01),
        bad_hyperparameters=WINDOW_BAD + [(dict(damp=0.0), "damp"), (dict(damp=math.inf), "damp")],
        bad_group={"damp": -1.0},
    ),
    OptimizerInfo(
        "SparseMFAC", ParamsRun,
        build=_windowed(tritonopt.optim.SparseMFAC, lr=0.05, ngrads=3, damp=0.1, density=0.25, block_size=16,
                        momentum=0.5),
        bad_hyperparameters=WINDOW_BAD + SPARSE_BAD + [(dict(damp=0.0), "damp")],
        bad_group={"density": 2.0},
    ),
    OptimizerInfo(
        "SparseMFAC-bf16-values", ParamsRun,
        build=_windowed(tritonopt.optim.SparseMFAC, lr=0.05, ngrads=3, damp=0.1, density=0.25, block_size=16,
                        values_dtype=torch.bfloat16),
        bad_group={"values_dtype": torch.float16},
    ),
    OptimizerInfo(
        "SparseMFAC-bf16-error", ParamsRun,
        build=_windowed(tritonopt.optim.SparseMFAC, lr=0.05, ngrads=3, damp=0.1, density=0.25, block_size=16,
                        error_dtype=torch.bfloat16, momentum=0.5),
        bad_hyperparameters=[(dict(error_dtype=torch.float16), "error_dtype")],
        bad_group={"error_dtype": torch.float16},
    ),
    OptimizerInfo(
        "GGT", ParamsRun,
        build=_windowed(tritonopt.optim.GGT, lr=0.05, ngrads=3, eps=0.1, momentum=0.5),
        bad_hyperparameters=WINDOW_BAD + [(dict(eps=0.0), "eps")],
        bad_group={"eps": 0.0},
    ),
    OptimizerInfo(
        "SparseGGT", ParamsRun,
        build=_windowed(tritonopt.optim.SparseGGT, lr=0.05, ngrads=3, eps=0.1, density=0.25, block_size=16),
        bad_hyperparameters=WINDOW_BAD + SPARSE_BAD + [(dict(eps=-1.0), "eps")],
        bad_group={"block_size": 0},
    ),
    OptimizerInfo(
        "LowRankMFAC", ParamsRun,
        build=_windowed(tritonopt.optim.LowRankMFAC, lr=0.05, ngrads=3, damp=0.1, rank=2, momentum=0.5),
        bad_hyperparameters=WINDOW_BAD + [(dict(rank=0), "rank"), (dict(damp=-1.0), "damp"), (dict(seed=-1), "seed")],
        bad_group={"rank": 0},
    ),
]


def _fosi_for_model(run: ModelRun, **kwargs):
    return [tritonopt.optim.FOSI(run.optimizer_params, lr=1e-2, k=2, l=1, num_lanczos_iters=8,
                                 curvature_update_every=3, curvature_loss_fn=run.curvature_loss, **kwargs)]


def _kfac_for_model(run: ModelRun, **kwargs):
    sgd = torch.optim.SGD(run.model.parameters(), lr=0.05, momentum=0.9)
    kfac = tritonopt.optim.KFACPreconditioner(run.model, factor_update_steps=1, inv_update_steps=2,
                                              damping=0.1, lr=0.05, **kwargs)
    return [kfac, sgd]


class KFACRun(ModelRun):
    """K-FAC replaces the gradients; the SGD step after it applies them when K-FAC says they are usable."""

    @staticmethod
    def info_step(run):
        if run.optimizers[0].step():
            run.optimizers[1].step()


OPTIMIZERS += [
    OptimizerInfo(
        "FOSI", ModelRun, build_for_model=_fosi_for_model,
        bad_hyperparameters=COMMON_BAD + [(dict(k=-1), "k"), (dict(alpha=-1.0), "alpha"),
                                          (dict(curvature_update_every=0), "curvature_update_every"),
                                          (dict(weight_decay=-1.0), "weight_decay"),
                                          (dict(eigenvalue_floor=2.0), "eigenvalue_floor")],
        steps_to_wrap=4,
        other_layouts={
            "permuted shapes": dict(reversed_params=True),
            "transposed shapes": dict(sizes=(8, 6, 3)),  # the first weight is [6, 8] instead of [8, 6]
            "another dtype": dict(dtype=torch.float64),
        },
    ),
    OptimizerInfo(
        "KFACPreconditioner", KFACRun, build_for_model=_kfac_for_model,
        bad_hyperparameters=[(dict(damping=0.0), "damping"), (dict(factor_update_steps=0), "factor_update_steps")],
        steps_to_wrap=4, param_groups=False,
        other_layouts={
            # K-FAC keeps its state per named layer, so its "order" is the layers': the first
            # layer takes the second one's weight shape, [3, 8].
            "permuted shapes": dict(sizes=(8, 3, 3)),
            "transposed shapes": dict(sizes=(8, 6, 3)),
            "another dtype": dict(dtype=torch.bfloat16),
        },
    ),
]

PARAMS_OPTIMIZERS = [info for info in OPTIMIZERS if info.run is ParamsRun]


def known_defect_marks(info: OptimizerInfo, test: str, variant: str = "") -> list:
    """A strict xfail mark where ``info`` has a known defect for ``test`` (or ``test[word]`` with ``word``
    in ``variant``, the words of one parametrisation); no marks otherwise."""
    for key, reason in info.known_defects.items():
        if key == test or (key.startswith(test + "[") and key[len(test) + 1 : -1] in variant):
            return [pytest.mark.xfail(reason=reason, strict=True)]
    return []


def cases(test: str, infos=None) -> list:
    """``infos`` (default: every optimizer) as pytest params for ``test``, with their known-defect marks."""
    return [pytest.param(info, marks=known_defect_marks(info, test), id=info.name)
            for info in (OPTIMIZERS if infos is None else infos)]
