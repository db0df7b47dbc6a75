"""DIFF attention and its twin on Splash attention (TPU), jax's block-sparse flash kernel.

The compositions are :mod:`._compose`'s: standard attention and DIFF V2 are one Splash call each
(V2 over its 2h query heads, paired as the official ``multihead_flashdiffv2.py`` pairs them; GQA
is Splash's own), DIFF V1 two calls sharing the value, which Splash takes twice as wide as q/k.
Documents are kept apart by Splash's own segment ids; causal masking is bottom-right aligned (a
``CausalMask`` offset by ``S - T``). Splash takes no softmax scale: the queries are scaled first.
Gradients are Splash's own backward kernels.

On a CPU the kernels run interpreted (``interpret=True`` or ``pltpu.InterpretParams()``): what
the tests compare against the reference math. The sequence lengths must be multiples of the
block (:func:`block_size`: a power of two from 128 to 512).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from . import _compose

MAX_BLOCK = 512
MIN_BLOCK = 128  # the TPU's lane width: Splash's smallest block (interpreted too)


def block_size(q_len: int, kv_len: int) -> int:
    """The Splash block for these lengths: the largest power of two up to :data:`MAX_BLOCK`
    that divides both."""
    return math.gcd(q_len, kv_len, MAX_BLOCK) & -math.gcd(q_len, kv_len, MAX_BLOCK)


def unsupported(*, q_len: int, kv_len: int, kv_segments: bool = False) -> str | None:
    """Why Splash cannot run this call (the reason and its fix), or None."""
    if block_size(q_len, kv_len) < MIN_BLOCK:
        return (
            f"Splash attention needs sequence lengths that are multiples of {MIN_BLOCK}; this "
            f"call has {q_len} queries over {kv_len} keys. Fix: data.seq_len a multiple of "
            f"{MIN_BLOCK}, or model.attention_impl=pallas"
        )
    if kv_segments:
        return (
            "this Splash path takes one set of segment ids for queries and keys, and the call "
            "has separate kv_segment_ids. Fix: model.attention_impl=pallas"
        )
    return None


def _kernel(q_heads: int, q_len: int, kv_len: int, causal: bool, interpret):
    block = block_size(q_len, kv_len)
    shape = (q_len, kv_len)
    one = sm.CausalMask(shape, offset=kv_len - q_len) if causal else sm.FullMask(shape)
    sizes = {f: block for f in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv")}
    sizes.update({f: block for f in ("block_kv_dkv", "block_kv_dkv_compute", "block_q_dq")})
    return sk.make_splash_mha(
        sm.MultiHeadMask([one] * q_heads),
        block_sizes=sk.BlockSizes(**sizes, block_kv_dq=block),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def _attend(q, k, v, *, causal: bool, scale: float, segment_ids, interpret):
    """One Splash call ``[B, T, Hq, Dv]`` (batch rows mapped over the per-example kernel)."""
    kernel = _kernel(q.shape[2], q.shape[1], k.shape[1], causal, interpret)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, H, T, D]
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)

    def one(q, k, v, seg):
        return kernel(q, k, v, segment_ids=None if seg is None else sk.SegmentIds(seg, seg))

    out = jax.vmap(one)(heads_first(qs), heads_first(k), heads_first(v), segment_ids)
    return heads_first(out)


def _prepare(q, k, kv_segment_ids, segment_ids, what):
    same = kv_segment_ids is None or kv_segment_ids is segment_ids
    reason = unsupported(q_len=q.shape[1], kv_len=k.shape[1], kv_segments=not same)
    if reason is not None:
        raise ValueError(f"{what}: {reason}")


def attention(
    q,
    k,
    v,
    *,
    second=None,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Softmax attention on Splash, ``[B, T, Hq, Dv]``: one map, ``softmax(q k^T s) v``, or two
    (``second=(q2, k2, lam)``), ``softmax(q k^T s) v - lam * softmax(q2 k2^T s) v`` (``k2=None``:
    V2, one call over the paired heads; V1: two calls sharing ``v``). q ``[B, T, Hq, D]``, k
    ``[B, S, Hkv, D]``, v ``[B, S, Hkv, Dv]``; ``segment_ids`` ``[B, T]`` keep documents
    apart."""
    _prepare(q, k, kv_segment_ids, segment_ids, "splash.attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attend = functools.partial(
        _attend, causal=causal, scale=scale, segment_ids=segment_ids, interpret=interpret
    )
    return _compose.attention(attend, q, k, v, second, wide_value=True)


def dot_product_attention(q, k, v, **options) -> jax.Array:
    """``softmax(q k^T s) v`` on Splash: :func:`attention` with one map."""
    return attention(q, k, v, **options)


def differential_attention(q1, k1, q2, k2, v, lam, **options) -> jax.Array:
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v`` on Splash: :func:`attention` with
    two maps."""
    return attention(q1, k1, v, second=(q2, k2, lam), **options)
