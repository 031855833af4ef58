"""The agreement check SSD-SGD appends to every all-reduce: did all ranks run the same steps?

Every all-reduce of :class:`~tritonopt.dist.SSDSGD` carries ``CHECK_ELEMENTS``
more values: a 64-bit BLAKE2b digest of the step counts and hyperparameters the
rank used since the last all-reduce (:func:`step_digest`), written as
``CHECK_DIGITS`` digits of ``B`` bits, and the ``B``-bit limbs of the digits'
squared norm (:func:`write_check`). Summed over ``K`` ranks, every value stays an
integer below 2^24 (2^53 in float64), so the sum is exact in any order, and the
ranks agree iff ``|sum v|^2 = K sum |v|^2`` (Cauchy-Schwarz; :func:`check_agrees`).
Pure arithmetic on small tensors: no communication here.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

__all__ = ["CHECK_DIGITS", "CHECK_ELEMENTS", "DIGEST_BITS", "check_agrees", "check_digit_bits", "step_digest",
           "write_check"]

CHECK_ELEMENTS = 8
# A 64-bit digest as CHECK_DIGITS digits, then the CHECK_ELEMENTS - CHECK_DIGITS limbs of their squared norm.
CHECK_DIGITS = 5
DIGEST_BITS = 64


def check_digit_bits(world_size: int, param_dtype: torch.dtype) -> int:
    """Bits per value of the agreement check: the sum over ``world_size`` ranks must stay exact in the state dtype.

    16 bits (float32, up to 256 ranks) carry the 64-bit digest in four digits;
    at least 13 (up to 2047 ranks in float32) still carry all of it in five.
    """
    mantissa = 53 if param_dtype == torch.float64 else 24
    bits = min(16, mantissa - world_size.bit_length())
    if bits < 3:  # the squared norm would not fit its limbs
        raise ValueError(f"SSDSGD's agreement check cannot be exact on {world_size} ranks in this dtype")
    return bits


def step_digest(steps: int, scalars: list[dict], previous: int = 0) -> int:
    """A 64-bit digest of step ``steps`` and its per-group scalars, chained onto ``previous`` (a window's steps)."""
    data = previous.to_bytes(8, "little") + struct.pack("<q", steps)
    for s in scalars:
        data += struct.pack("<7d", s["lr"], s["momentum"], s["weight_decay"], s["local_lr"],
                            s["local_weight_decay"], s["glu_alpha"], s["glu_beta"])
    return int.from_bytes(hashlib.blake2b(data, digest_size=DIGEST_BITS // 8).digest(), "little")


def write_check(out: torch.Tensor, digest: int, bits: int) -> None:
    """``digest`` as CHECK_DIGITS digits of ``bits`` bits, then the limbs of their squared norm, into ``out``."""
    mask = (1 << bits) - 1
    digits = [(digest >> (bits * i)) & mask for i in range(CHECK_DIGITS)]
    norm = sum(x * x for x in digits)
    limbs = [(norm >> (bits * i)) & mask for i in range(CHECK_ELEMENTS - CHECK_DIGITS)]
    out.copy_(torch.tensor(digits + limbs, dtype=out.dtype))


def check_agrees(summed: torch.Tensor, bits: int, world_size: int) -> bool:
    """Whether ``summed``, the sum over ``world_size`` ranks of :func:`write_check`'s values, came from one digest."""
    values = summed.tolist()
    if not all(math.isfinite(v) and v == int(v) for v in values):
        return False
    digits, limbs = [int(v) for v in values[:CHECK_DIGITS]], [int(v) for v in values[CHECK_DIGITS:]]
    norms = sum(limb << (bits * i) for i, limb in enumerate(limbs))
    return sum(s * s for s in digits) == world_size * norms
