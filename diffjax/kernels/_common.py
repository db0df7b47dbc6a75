"""Helpers shared by the GPU and TPU kernels (jax only): sizes, block-size checks and
float32-accumulating dots."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E): folded into the softmax scale


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_block_fields(sizes, fields, ok, requirement: str) -> None:
    """Raise a ValueError naming the first of ``fields`` of ``sizes`` (a ``BlockSizes``) that is
    not an int (bools excluded) with ``ok(value)``; ``requirement`` says what is accepted."""
    for name in fields:
        value = getattr(sizes, name)
        if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
            raise ValueError(f"{type(sizes).__name__}.{name} must be {requirement}; got {value!r}")


def dot_nn(a, b):
    """``a @ b`` accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """``a @ b.T`` accumulated in float32 (contract the last dims)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """``a.T @ b`` accumulated in float32 (contract the first dims)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
