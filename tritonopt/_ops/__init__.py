"""Registration of tritonopt's custom ops, one module per op family.

Each module validates its arguments (before anything is modified), registers
``torch.library`` custom ops in the ``tritonopt`` namespace (with fake
implementations, so they compose with ``torch.compile`` and pass
``torch.library.opcheck``), and dispatches to the Triton kernel or the
PyTorch reference through :func:`tritonopt._runtime.select_backend`.
The public names are re-exported by :mod:`tritonopt.ops`.
"""
