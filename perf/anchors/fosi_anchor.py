"""FOSI-Adam: tritonopt's ``FOSI`` beside hsivan/fosi's torch version (``fosi_adam_torch``).

Both run the reference's defaults as the README's recipe spells them out: Lanczos of order
``4 (k + l)`` in float64 with two Gram-Schmidt passes, ``g1`` momentum 0.9, no learning-rate
clip (Adam), no eigenvalue floor, no dropped Ritz values, the curvature estimated on one fixed
batch (the reference's static-batch mode) of eight training batches. ``k``, ``alpha``, the
learning rate and the schedule are ``perf.bench_optimizer_step``'s at each size; the
reference's ``warmup_w = W`` is tritonopt's ``warmup_steps = W - 1``.

hsivan/fosi is read from a checkout (``<anchors>/fosi``). Its package ``__init__`` also imports
the JAX version; only ``fosi.torch_optim`` is loaded here, which needs ``torchopt``
(``pip install torchopt``). The reference draws Lanczos' start vector from torch's global
generator; before each of its curvature estimates the global generator is seeded as
tritonopt seeds its own (``seed + estimate number``), so both start from the same vector.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import types
from pathlib import Path

import torch

from perf import _optimizers as optimizers
from perf.anchors import AnchorBroken, AnchorPair, broken, checkout, require
from tritonopt.optim import FOSI

FOLDER = "fosi"
ESE_BATCHES = 8  # the curvature batch: this many training batches (perf/_optimizers.py: FosiStep)
G1_MOMENTUM = 0.9  # the reference's `decay`
SEED = 0


def load(anchors_dir: Path):
    """hsivan/fosi's ``fosi.torch_optim`` and ``torchopt``, without the package's JAX half."""
    root = checkout(anchors_dir, FOLDER)
    torchopt = require("torchopt", "the FOSI reference's torch version needs torchopt:"
                                   " `make anchors` installs it (or `pip install torchopt`)")
    if "fosi" not in sys.modules:
        package = types.ModuleType("fosi")
        package.__path__ = [str(root / "fosi")]
        sys.modules["fosi"] = package
    elif not any(str(root) in p for p in getattr(sys.modules["fosi"], "__path__", [])):
        raise AnchorBroken(f"another `fosi` package ({sys.modules['fosi']}) is already imported,"
                           f" not the checkout at {root}: uninstall it")
    try:
        module = importlib.import_module("fosi.torch_optim")
    except Exception as error:  # any import-time failure of the checkout
        raise broken(root, "fosi.torch_optim", error) from error
    return module, torchopt


def schedule(size) -> dict:
    """k, l, alpha, lr and the curvature schedule at ``size`` (the reference's ``warmup_w``)."""
    hyper = size.fosi
    update_every = hyper["curvature_update_every"]
    warmup = hyper.get("warmup_steps", 0)
    return dict(lr=hyper["lr"], k=hyper["k"], l=hyper.get("l", 0), alpha=hyper["alpha"],
                update_every=update_every, warmup_w=(warmup if warmup is not None else update_every - 1) + 1)


def curvature_batch(size, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    n = ESE_BATCHES * size.batch
    x = torch.randn(n, *size.input_shape, generator=gen)
    y = torch.randint(0, size.classes, (n,), generator=gen)
    return x.to(device), y.to(device)


def build_tritonopt(model: torch.nn.Module, size) -> optimizers.OptimizerStep:
    s = schedule(size)
    device = next(model.parameters()).device
    x, y = curvature_batch(size, device)
    loss_fn = torch.nn.functional.cross_entropy
    optimizer = FOSI(
        model.parameters(), lr=s["lr"], base="adam", k=s["k"], l=s["l"], alpha=s["alpha"],
        num_lanczos_iters=4 * (s["k"] + s["l"]), g1_momentum=G1_MOMENTUM, learning_rate_clip=1.0,
        curvature_update_every=s["update_every"], warmup_steps=s["warmup_w"] - 1,
        eigenvalue_floor=0.0, ritz_rtol=0.0, seed=SEED,
        curvature_loss_fn=lambda: loss_fn(model(x), y),
    )
    return optimizers.OptimizerStep(model, optimizer)


class ReferenceFosiStep(optimizers.OptimizerStep):
    """hsivan/fosi's functional FOSI-Adam over ``model``'s parameters, as a train step.

    ``update`` is the reference's ``update`` and torchopt's in-place ``apply_updates``; the
    gradients come from ``loss.backward()`` as for every other optimizer.
    """

    def __init__(self, model: torch.nn.Module, size, module, torchopt):
        self.model = model
        self.update_timer = contextlib.nullcontext
        self.torchopt = torchopt
        self.params = tuple(model.parameters())
        names = [name for name, _ in model.named_parameters()]
        s = schedule(size)
        self.warmup_w, self.update_every = s["warmup_w"], s["update_every"]
        self.count = 0
        self.estimates = 0
        loss_fn = torch.nn.functional.cross_entropy

        def functional_loss(params, batch):
            out = torch.func.functional_call(model, dict(zip(names, params)), (batch[0],))
            return loss_fn(out, batch[1])

        with contextlib.redirect_stdout(io.StringIO()):  # it prints its Lanczos order
            self.transform = module.fosi_adam_torch(
                torchopt.adam(lr=s["lr"]), functional_loss, curvature_batch(size, self.params[0].device),
                decay=G1_MOMENTUM, num_iters_to_approx_eigs=s["update_every"], approx_k=s["k"],
                approx_l=s["l"], warmup_w=self.warmup_w, alpha=s["alpha"], device=self.params[0].device,
            )
        self.state = self.transform.init(self.params)

    @property
    def warmup_steps(self) -> int:
        return self.warmup_w - 1

    def __call__(self, x, y, loss_fn) -> float:
        for p in self.params:
            p.grad = None
        loss = loss_fn(self.model(x), y)
        loss.backward()
        with self.update_timer():
            self.update()
        return loss.item()

    def update(self) -> None:
        estimate_now = (self.count + 1 >= self.warmup_w
                        and (self.count + 1 - self.warmup_w) % self.update_every == 0)
        grads = tuple(p.grad for p in self.params)
        if estimate_now:
            torch.manual_seed(SEED + self.estimates)
            self.estimates += 1
            with contextlib.redirect_stdout(io.StringIO()):  # it prints every estimate's eigenvalues
                updates, self.state = self.transform.update(grads, self.state, self.params)
        else:
            updates, self.state = self.transform.update(grads, self.state, self.params)
        self.torchopt.apply_updates(self.params, updates, inplace=True)
        self.count += 1

    def state_bytes(self) -> int:
        leaves = self.torchopt.pytree.tree_leaves(self.state)
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def pairs(anchors_dir: Path, size) -> list[AnchorPair]:
    """FOSI-Adam, tritonopt's and hsivan/fosi's, at ``size``'s settings.

    Agreement (lockstep, at the demo's size): through two curvature estimates and one step past
    them, where both still do the same arithmetic (README: from the third estimate on,
    tritonopt drops the part of the old ``g1`` momentum outside the new basis). The bound,
    ``rtol = 1e-4``, adds two known sources:

    * the reference's Adam (torchopt) computes ``1 - beta2**t`` in float32, where ``beta2 =
      0.999`` is stored as ``0.99900001287``: at ``t = 1`` the bias correction is off by
      ``1.3e-5``, the step by half of that, ``6.5e-6`` (it fades as ``t`` grows);
    * the Ritz vectors come from Hessian-vector products rounded differently (float32
      forward-over-reverse there, double backward here: about ``sqrt(256) * 2**-24 = 1e-6`` of
      ``||H||``), and a Ritz vector moves by that over its relative gap; at the demo's first
      estimate the closest two of the ten Ritz values are 1.4 % of the largest apart, so the
      Newton direction may move by ``1e-6 / 0.014 = 7e-5``.
    """
    module, torchopt = load(anchors_dir)
    s = schedule(size)
    steps = s["warmup_w"] + s["update_every"] + 1
    return [AnchorPair(
        name="FOSI-Adam", anchor="hsivan/fosi",
        build_tritonopt=lambda model: build_tritonopt(model, size),
        build_anchor=lambda model: ReferenceFosiStep(model, size, module, torchopt),
        period=s["update_every"], agreement_steps=steps, rtol=1e-4,
        settings=dict(s, num_lanczos_iters=4 * (s["k"] + s["l"]), g1_momentum=G1_MOMENTUM),
    )]
