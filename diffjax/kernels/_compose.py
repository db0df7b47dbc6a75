"""DIFF attention from calls of a vendor's standard attention (jax only): the compositions the
official code uses, shared by the cuDNN (:mod:`.cudnn`) and Splash (:mod:`.splash`) paths.

``attend(q, k, v)`` is one standard softmax attention call, ``[B, T, Hq, D]`` x ``[B, S, Hkv,
D]`` x ``[B, S, Hkv, Dv]`` -> ``[B, T, Hq, Dv]`` (query head ``i`` reads kv head ``i // (Hq //
Hkv)``), with the masks and scale already bound.

- DIFF V2 (``k2=None``): one call over the 2h query heads laid out as the official
  ``multihead_flashdiffv2.py`` lays them out, pair ``i`` = heads ``2i`` (Q1) and ``2i + 1`` (Q2);
  both heads of a pair fall in kv group ``i // (h / h_kv)``, the pair's own. Then
  ``O_i = O_2i - lambda_i O_2i+1``.
- DIFF V1: one call per map, ``attend(q1, k1, v)`` and ``attend(q2, k2, v)``, with the value
  twice as wide as q/k; a backend that takes no such value gets V in two halves (four calls,
  as the official code does with stock flash attention).

``O1 - lambda O2`` is formed in float32 from the two outputs (cast to the query dtype at the
end), as the fused kernels form it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def pair_heads(q1: jax.Array, q2: jax.Array) -> jax.Array:
    """``[B, T, h, d]`` twice -> ``[B, T, 2h, d]`` with head ``2i`` = ``q1[:, :, i]`` and head
    ``2i + 1`` = ``q2[:, :, i]`` (the official V2 layout of the query heads)."""
    b, t, h, d = q1.shape
    return jnp.stack([q1, q2], axis=3).reshape(b, t, 2 * h, d)


def unpair_heads(o: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`pair_heads`: ``[B, T, 2h, dv]`` -> heads ``0::2`` and ``1::2``."""
    b, t, h2, dv = o.shape
    o = o.reshape(b, t, h2 // 2, 2, dv)
    return o[:, :, :, 0], o[:, :, :, 1]


def combine(o1: jax.Array, o2: jax.Array, lam, dtype) -> jax.Array:
    """``O1 - lambda O2`` in float32, cast to ``dtype``; ``lam`` a scalar (V1) or ``[B, T, H]``
    (V2, one value per query token and head)."""
    lam = jnp.asarray(lam, jnp.float32)
    if lam.ndim:
        lam = lam[..., None]
    return (o1.astype(jnp.float32) - lam * o2.astype(jnp.float32)).astype(dtype)


def in_value_halves(attend: Attend, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``attend(q, k, v)`` for a value wider than q/k, as two calls on its halves (each as wide
    as q/k), concatenated."""
    d = q.shape[-1]
    return jnp.concatenate([attend(q, k, v[..., :d]), attend(q, k, v[..., d:])], axis=-1)


def attention(attend: Attend, q, k, v, second=None, *, wide_value: bool) -> jax.Array:
    """One softmax map, ``attend(q, k, v)`` (``second`` None), or two, ``softmax(q k^T s) v -
    lam * softmax(q2 k2^T s) v`` (``second=(q2, k2, lam)``) from standard calls (module doc);
    ``k2=None``: both maps read ``k`` (V2: one call over the paired heads). ``wide_value``:
    whether ``attend`` takes a value wider than q/k (else it gets the value in halves)."""

    def call(q, k):
        if v.shape[-1] == q.shape[-1] or wide_value:
            return attend(q, k, v)
        return in_value_halves(attend, q, k, v)

    if second is None:
        return call(q, k)
    q2, k2, lam = second
    if k2 is None:
        o1, o2 = unpair_heads(call(pair_heads(q, q2), k))
    else:
        o1, o2 = call(q, k), call(q2, k2)
    return combine(o1, o2, lam, q.dtype)
