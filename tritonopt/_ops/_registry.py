"""How an op is declared: once, with its schema, argument contract, fake and backends.

::

    @define_op("ef_topk", mutates_args=("error",))
    def ef_topk(grad: torch.Tensor, error: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        '''What the op computes: math, shapes, layout (the public docstring).'''
        check_tensor("grad", grad, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
        ...                                       # the argument contract: checks only

    @ef_topk.register_fake
    def _(grad, error, k):                        # output shapes, for torch.compile and meta tensors
        return grad.new_empty(...), grad.new_empty(...)

    ef_topk.register_backends(triton=kernels.ef_topk_triton, reference=kernels.ef_topk_reference)

The decorated function's signature is the op's schema (``torch.library`` reads
it: the op is ``torch.ops.tritonopt.<name>``), its body the argument contract,
its docstring the op's documentation. The result is an :class:`Op`. Calling it:

* in eager mode, with ordinary tensors: the contract runs once, then the
  backend that :func:`~tritonopt._runtime.select_backend` picks for the first
  tensor argument's device, inside the NVTX range ``nvtx``. The dispatcher is
  not entered: its per-call cost is the same order as a small kernel's;
* while ``torch.compile`` traces: the custom op, whose fake runs the contract at
  trace time and whose implementation runs it when the compiled code executes;
* with tensors that have no storage (meta, fake, under a dispatch mode): the
  contract, then the custom op, which routes them to the fake.

A ``composite`` op is plain torch code on either backend (no custom op); it
traces as it is.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Callable, Optional, Sequence

import torch

from tritonopt._runtime import nvtx_range, select_backend

__all__ = ["Op", "define_op"]

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _dispatch_mode_active() -> bool:
    stack_length = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return stack_length is not None and stack_length() > 0


_MAX_CALL_PLANS = 64  # call shapes remembered per op


class _FromArgs:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _FromKwargs:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Default:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _pick(source, args: tuple, kwargs: dict):
    if type(source) is _FromArgs:
        return args[source.index]
    if type(source) is _FromKwargs:
        return kwargs[source.name]
    return source.value


class Op:
    """A declared op: call it like a function (see the module docstring)."""

    def __init__(
        self,
        contract: Callable,
        *,
        name: str,
        mutates_args: Sequence[str],
        nvtx: Optional[str],
        composite: bool,
        cuda_default: str = "triton",
    ):
        functools.update_wrapper(self, contract)
        if cuda_default not in ("triton", "reference"):
            raise ValueError(f"cuda_default must be 'triton' or 'reference', got {cuda_default!r}")
        self.name = name
        self.cuda_default = cuda_default
        self.contract = contract
        self.nvtx = nvtx or f"tritonopt/{name}"
        self.composite = composite
        self._backends: dict[str, Callable] = {}
        hints = typing.get_type_hints(contract)
        signature = inspect.signature(contract)
        parameters = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
        returns = hints.get("return")
        self.signature = signature.replace(
            parameters=parameters, return_annotation=None if returns is type(None) else returns
        )
        tensor_params = [p for p in parameters if p.annotation is torch.Tensor]
        if not tensor_params:
            raise TypeError(f"op {name!r} needs a torch.Tensor argument to choose its backend")
        self._device_param = (parameters.index(tensor_params[0]), tensor_params[0].name)
        # Float parameters are converted so that an int never reaches a kernel (Triton
        # specialises integer arguments, so 1 and 1.0 would compile different kernels).
        self._float_params = [(i, p.name) for i, p in enumerate(parameters) if p.annotation is float]
        self._parameter_count = len(parameters)
        self._keyword_only = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
        # How a call's arguments map onto the full argument list, per call shape (the number of
        # positional arguments and the keyword names): Signature.bind costs tens of microseconds,
        # and an optimizer calls its ops with the same shape at every step.
        self._plans: dict[tuple, tuple] = {}
        # torch.library refuses keyword-only tensors: the dispatcher's schema takes every
        # argument by position or name, and its calls are mapped back to the Python signature.
        # The schema declares no defaults and every call through it gives every argument: torch
        # up to 2.12 drops trailing arguments equal to their defaults when it redispatches, and
        # then fails to find a mutated one left at its default (IndexError).
        self._schema_signature = self.signature.replace(
            parameters=[
                p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty)
                for p in parameters
            ]
        )
        self.custom_op = None
        if not composite:

            def checked_run(*args, **kwargs):
                args, kwargs = self._complete(self._schema_signature, args, kwargs)
                self.contract(*args, **kwargs)
                return self._run(*args, **kwargs)

            checked_run.__signature__ = self._schema_signature
            checked_run.__name__ = name
            self.custom_op = torch.library.custom_op(
                f"tritonopt::{name}", checked_run, mutates_args=tuple(mutates_args)
            )

    # ------------------------------------------------------------------ declaration

    def register_fake(self, fake: Callable) -> Callable:
        """The output shapes and dtypes for tensors without data; the contract runs first."""
        if self.custom_op is None:
            raise TypeError(f"composite op {self.name!r} has no fake: it traces as plain torch code")

        def checked_fake(*args, **kwargs):
            args, kwargs = self._complete(self._schema_signature, args, kwargs)
            self.contract(*args, **kwargs)
            return fake(*args, **kwargs)

        self.custom_op.register_fake(checked_fake)
        return fake

    def register_backends(self, *, triton: Optional[Callable] = None, reference: Callable) -> None:
        """The implementations, called with the op's own arguments.

        ``triton`` is the Triton launcher; ``reference`` the plain-PyTorch version,
        which also serves when no Triton kernel exists (``triton=None``).
        """
        self._backends = {"triton": triton or reference, "reference": reference}

    # ------------------------------------------------------------------ calling

    def _complete(self, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every argument given, defaults filled in: positional ones by position, keyword-only by name."""
        if kwargs or len(args) != self._parameter_count or self._keyword_only:
            key = (signature is self.signature, len(args), tuple(kwargs))
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan(signature, len(args), tuple(kwargs))
                if len(self._plans) < _MAX_CALL_PLANS:
                    self._plans[key] = plan
            positional, keyword = plan
            args, kwargs = (
                tuple(_pick(source, args, kwargs) for source in positional),
                {name: _pick(source, args, kwargs) for name, source in keyword},
            )
        if self._float_params:
            args = list(args)
            for index, name in self._float_params:
                if name in self._keyword_only:
                    if isinstance(kwargs[name], int):
                        kwargs[name] = float(kwargs[name])
                elif isinstance(args[index], int):
                    args[index] = float(args[index])
            args = tuple(args)
        return args, kwargs

    def _plan(self, signature: inspect.Signature, n_args: int, names: tuple) -> tuple:
        """Where each argument of the full list comes from, for calls of this shape."""
        bound = signature.bind(*(_FromArgs(i) for i in range(n_args)), **{n: _FromKwargs(n) for n in names})
        bound.apply_defaults()
        sources = [(n, v if isinstance(v, (_FromArgs, _FromKwargs)) else _Default(v)) for n, v in bound.arguments.items()]
        return (tuple(src for n, src in sources if n not in self._keyword_only),
                tuple((n, src) for n, src in sources if n in self._keyword_only))

    def _device(self, args: tuple, kwargs: dict) -> torch.device:
        index, name = self._device_param
        tensor = args[index] if index < len(args) else kwargs[name]
        return tensor.device

    def _run(self, *args, **kwargs):
        backend = select_backend(self._device(args, kwargs), cuda_default=self.cuda_default)
        implementation = self._backends[backend]
        with nvtx_range(self.nvtx):
            return implementation(*args, **kwargs)

    def _eager_path(self, args: tuple, kwargs: dict) -> bool:
        if _dispatch_mode_active():
            return False
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and (
                type(value) not in _PLAIN_TENSOR_TYPES or value.device.type == "meta"
            ):
                return False
        return True

    def dispatcher_arguments(self, *args, **kwargs) -> tuple:
        """A call's arguments as the dispatcher's schema takes them: all of them, by position."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _through_dispatcher(self, args: tuple, kwargs: dict):
        return self.custom_op(*self.dispatcher_arguments(*args, **kwargs))

    def __call__(self, *args, **kwargs):
        if self.custom_op is not None and torch.compiler.is_compiling():
            return self._through_dispatcher(args, kwargs)
        self.contract(*args, **kwargs)
        if self.custom_op is None or self._eager_path(args, kwargs):
            args, kwargs = self._complete(self.signature, args, kwargs)
            return self._run(*args, **kwargs)
        return self._through_dispatcher(args, kwargs)

    def prepared(self, device: torch.device) -> Callable:
        """The op for a caller that makes every argument itself and calls it many times.

        An optimizer's step calls an op once per layer on buffers it built and checked when it
        built them. Here the backend for ``device`` is chosen once, and each call skips the
        argument contract, the dispatcher and the NVTX range of its own (the caller's range
        covers the loop): about 20 us per call on a CPU, a tenth of a K-FAC step at ten small
        layers. Defaults are filled in and ints made floats as for any call. While
        ``torch.compile`` traces, under a dispatch mode, or on the meta device, this is the op
        itself.
        """
        if self.custom_op is not None and (
            torch.compiler.is_compiling() or _dispatch_mode_active() or device.type == "meta"
        ):
            return self
        implementation = self._backends[select_backend(device, cuda_default=self.cuda_default)]

        def call(*args, **kwargs):
            args, kwargs = self._complete(self.signature, args, kwargs)
            return implementation(*args, **kwargs)

        return call

    def __repr__(self) -> str:
        return f"<tritonopt op {self.name}{self.signature}>"


def define_op(
    name: str,
    *,
    mutates_args: Sequence[str] = (),
    nvtx: Optional[str] = None,
    composite: bool = False,
    cuda_default: str = "triton",
) -> Callable[[Callable], Op]:
    """Declare the op ``tritonopt::<name>`` from its contract function (see the module docstring).

    Args:
        name: the op's name in the ``tritonopt`` namespace.
        mutates_args: the arguments written in place (``torch.library``'s declaration).
        nvtx: the NVTX range of each call, ``tritonopt/<name>`` by default.
        composite: plain torch code on every backend; no custom op is registered.
        cuda_default: the backend on CUDA tensors when none is forced; ``"reference"`` where the
            PyTorch path was measured faster than the kernel on a GPU (``perf/results/<gpu>/``).
    """

    def declare(contract: Callable) -> Op:
        return Op(contract, name=name, mutates_args=mutates_args, nvtx=nvtx, composite=composite,
                  cuda_default=cuda_default)

    return declare
