"""Helpers shared by the GPU and TPU kernels (jax only): sizes and float32-accumulating dots."""

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


def dot_nn(a, b):
    """``a @ b`` accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """``a @ b.T`` accumulated in float32 (contract the last dims)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """``a.T @ b`` accumulated in float32 (contract the first dims)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
