"""The plain ``jax.numpy`` attention math: what every other implementation must compute.

This module imports only jax and numpy. :mod:`diffjax.ops` runs it as the ``"xla"``
implementation, and the Pallas kernels (:mod:`.gpu`, :mod:`.tpu`) share its constants and input
checks and are tested against it.

Layout everywhere: ``[batch, seq, heads, dim]``. GQA is index arithmetic: query head ``i``
reads kv head ``i // (Hq // Hkv)``; K/V are never repeated in memory.

- :func:`attention`: one softmax map, ``softmax(q k^T s) v``, or two (``second=(q2, k2,
  lam)``), ``softmax(q k^T s) v - lam * softmax(q2 k2^T s) v``, each branch normalised by its
  own softmax denominator (:func:`dot_product_attention` and :func:`differential_attention`
  name the two cases).

Numerics (the kernels match them): logits and softmax in float32, probabilities cast to v's
dtype before the value product (as flash attention and the official code do), float32
accumulation, a float32 lambda, and a zero output for a query that sees no key at all. The
differential form takes one value product on the float32 map ``A1 - lam * A2`` (cast to v's
dtype), the kernels two (``o1 - lam * o2`` in float32): equal in float32 to rounding. The ``[T, S]`` maps are materialised: the kernels exist for long
sequences.

``logit_bits`` simulates absmax quantization of the logits (the paper's Fig. 8): see
:func:`absmax_quantize`. ``logit_max=True`` also returns each map's largest logit per query row
(training diagnostics), from the same logits the softmax reads: see :func:`attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A large finite negative logit for masked positions: keeps fully-masked rows NaN-free.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------- input checks
def check_qkv(
    q, k, v, segment_ids=None, kv_segment_ids=None, *, what: str, qname: str = "q", kname: str = "k"
) -> None:
    """Raise a ValueError naming the problem when q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``, v
    ``[B,S,Hkv,Dv]`` and the segment ids ``[B,T]`` / ``[B,S]`` do not fit together."""
    for name, x in ((qname, q), (kname, k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{what}: {name} must be [batch, seq, heads, dim], got shape {x.shape}. "
                "Fix: split the heads off the model dimension (reshape to 4 dims)"
            )
    b, t, hq, d = q.shape
    bk, s, hkv, dk = k.shape
    if bk != b or v.shape[0] != b:
        raise ValueError(
            f"{what}: batch sizes differ: {qname} {q.shape}, {kname} {k.shape}, v {v.shape}. "
            "Fix: pass queries, keys and values of the same batch"
        )
    if dk != d:
        raise ValueError(
            f"{what}: {qname} and {kname} head dims differ: {d} vs {dk}. Fix: project queries "
            "and keys to one head dim"
        )
    if v.shape[1] != s or v.shape[2] != hkv:
        raise ValueError(
            f"{what}: v must be [batch, {s}, {hkv}, dv] like {kname}, got {v.shape}. Fix: give "
            f"v the key length and kv heads of {kname}"
        )
    if hq % hkv:
        raise ValueError(
            f"{what}: {hkv} kv heads do not divide {hq} query heads. Fix: use a number of kv "
            f"heads that divides {hq} (each kv head serves Hq // Hkv query heads)"
        )
    if segment_ids is not None:
        if segment_ids.shape != (b, t):
            raise ValueError(
                f"{what}: segment_ids must be [batch, seq] = [{b}, {t}], got "
                f"{segment_ids.shape}. Fix: one id per query token"
            )
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        if kv_seg.shape != (b, s):
            raise ValueError(
                f"{what}: key segment ids must be [batch, kv_seq] = [{b}, {s}], got "
                f"{kv_seg.shape}. Fix: "
                + (
                    "pass kv_segment_ids when the key length differs"
                    if kv_segment_ids is None
                    else "one id per key token"
                )
            )
    elif kv_segment_ids is not None:
        raise ValueError(
            f"{what}: kv_segment_ids given without segment_ids. Fix: pass the queries' "
            "segment_ids too, or neither"
        )


def check_differential(
    q1, k1, q2, k2, v, lam, segment_ids=None, kv_segment_ids=None, *, what: str
) -> None:
    """:func:`check_qkv` for both branches (``k2`` None: both read ``k1``), plus lambda: a
    scalar (V1) or ``[B, T, Hq]`` (V2)."""
    check_qkv(q1, k1, v, segment_ids, kv_segment_ids, what=what, qname="q1", kname="k1")
    if q2.shape != q1.shape:
        raise ValueError(
            f"{what}: q1 and q2 must have the same shape, got {q1.shape} and {q2.shape}. "
            "Fix: give both maps' queries the same heads and head dim"
        )
    if k2 is not None and k2.shape != k1.shape:
        raise ValueError(
            f"{what}: k1 and k2 must have the same shape, got {k1.shape} and {k2.shape}. "
            "Fix: give both maps' keys the same heads and head dim (or k2=None to share k1)"
        )
    b, t, hq, _ = q1.shape
    if jnp.shape(lam) not in ((), (b, t, hq)):
        raise ValueError(
            f"{what}: lam must be a scalar or [batch, seq, heads] = [{b}, {t}, {hq}], "
            f"got shape {jnp.shape(lam)}. Fix: one lambda for all (V1) or one per query token "
            "and head (V2)"
        )


def check_logit_bits(bits) -> None:
    if bits is not None and (
        not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 24
    ):
        raise ValueError(
            f"absmax quantization: bits must be an integer in [2, 24], got "
            f"{bits!r}. Fix: use e.g. 16, 8, 6 or 4 (or None for no quantization)"
        )


# ---------------------------------------------------------------------------- masks
def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array | None:
    """Boolean ``[batch or 1, q_len, kv_len]`` mask (True = may attend), or None for no mask.

    Causal masking aligns the last query with the last key (query ``i`` sees keys
    ``j <= i + kv_len - q_len``), as the official code's ``triu(..., 1 + offset)`` does.
    Segment ids stop attention across packed-sequence boundaries.
    """
    mask = None
    if causal:
        offset = kv_len - q_len
        q_idx = jnp.arange(q_len)[:, None]
        k_idx = jnp.arange(kv_len)[None, :]
        mask = (k_idx <= q_idx + offset)[None]
    if segment_ids is not None:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        seg = segment_ids[:, :, None] == kv_seg[:, None, :]
        mask = seg if mask is None else jnp.logical_and(mask, seg)
    return mask


# ---------------------------------------------------------------------------- quantization
def absmax_quantize(
    x: jax.Array, bits: int, *, mask: jax.Array | None = None, axis=(-2, -1)
) -> jax.Array:
    """``x`` rounded to a symmetric ``bits``-bit grid whose step is ``absmax / (2^(bits-1)-1)``,
    the absmax taken over ``axis`` among the entries where ``mask`` is True (all if None).
    A block whose absmax is 0 is returned unchanged. Float32 in the arithmetic."""
    check_logit_bits(bits)
    x = jnp.asarray(x, jnp.float32)
    mag = jnp.abs(x) if mask is None else jnp.where(mask, jnp.abs(x), 0.0)
    absmax = jnp.max(mag, axis=axis, keepdims=True)
    levels = float(2 ** (bits - 1) - 1)
    step = jnp.where(absmax > 0, absmax / levels, 1.0)
    return jnp.clip(jnp.round(x / step), -levels, levels) * step


# ---------------------------------------------------------------------------- the maps
# Inside, the maps are laid out [B, Hkv, R*T, S]: the R = Hq / Hkv query heads of a kv group
# stacked along the query axis, so both products are 4-D batched matmuls over (B, Hkv) whose
# outputs need no transpose (5-D GQA einsums, "btgrd,bsgd->bgrts", make XLA:CPU transpose
# every map). Query head i = g * R + r, so [B, Hkv, R*T, S] is a free view of [B, Hq, T, S].
def _group_queries(q: jax.Array, hkv: int) -> jax.Array:
    """``[B, T, Hq, D]`` -> ``[B, Hkv, R*T, D]`` (row ``r*T + t`` is query head ``g*R + r``)."""
    b, t, hq, d = q.shape
    r = hq // hkv
    return q.reshape(b, t, hkv, r, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, r * t, d)


def _ungroup_queries(x: jax.Array, t: int) -> jax.Array:
    """``[B, Hkv, R*T, D]`` -> ``[B, T, Hkv*R, D]`` (the inverse of :func:`_group_queries`)."""
    b, hkv, rt, d = x.shape
    r = rt // t
    return x.reshape(b, hkv, r, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * r, d)


def _group_rows(x: jax.Array, hkv: int) -> jax.Array:
    """A per-(query, head) value ``[B, T, Hq]`` -> ``[B, Hkv, R*T, 1]``, aligned with the maps."""
    b, t, hq = x.shape
    return x.reshape(b, t, hkv, hq // hkv).transpose(0, 2, 3, 1).reshape(b, hkv, -1)[..., None]


def _group_mask(mask: jax.Array | None, r: int) -> jax.Array | None:
    """The ``[B or 1, T, S]`` mask as ``[B or 1, 1, R*T, S]`` (the same rows for every head)."""
    if mask is None:
        return None
    mb, t, s = mask.shape
    if r == 1:
        return mask[:, None]
    return jnp.broadcast_to(mask[:, None, None], (mb, 1, r, t, s)).reshape(mb, 1, r * t, s)


def _grouped_logits(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """``q k^T * scale`` as ``[B, Hkv, R*T, S]`` float32, for q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``."""
    hkv = k.shape[2]
    logits = jnp.einsum(
        "bgqd,bgsd->bgqs",
        _group_queries(q, hkv),
        k.transpose(0, 2, 1, 3),
        preferred_element_type=jnp.float32,
    )
    return logits * jnp.float32(scale)


def _row_max(logits: jax.Array, gmask: jax.Array | None) -> jax.Array:
    """The largest visible logit of each row, ``[B, Hkv, R*T]`` (-inf for a row that sees no
    key), without gradient."""
    visible = logits if gmask is None else jnp.where(gmask, logits, -jnp.inf)
    return jax.lax.stop_gradient(jnp.max(visible, axis=-1))


def _ungroup_rows(x: jax.Array, t: int) -> jax.Array:
    """Row statistics ``[B, Hkv, R*T]`` -> ``[B, T, Hq]`` (the inverse of :func:`_group_rows`)."""
    return _ungroup_queries(x[..., None], t)[..., 0]


def _grouped_probs(
    q: jax.Array,
    k: jax.Array,
    mask: jax.Array | None,
    scale: float,
    logit_bits: int | None = None,
    *,
    zero_masked: bool = True,
    logit_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax probabilities ``[B, Hkv, R*T, S]`` in float32. ``zero_masked=False`` leaves the
    masked entries of a row with no visible key uniform (the caller zeroes them).
    ``logit_max``: ``(probs, maxes)``, ``maxes`` ``[B, Hkv, R*T]`` the largest visible logit of
    each row (:func:`_row_max`; before any ``logit_bits`` quantization)."""
    b, t, hq, _ = q.shape
    hkv, s = k.shape[2], k.shape[1]
    r = hq // hkv
    logits = _grouped_logits(q, k, scale)
    gmask = _group_mask(mask, r)
    maxes = _row_max(logits, gmask) if logit_max else None
    if logit_bits is not None:  # absmax blocks per query head: [.., R, T, S]
        logits = absmax_quantize(
            logits.reshape(b, hkv, r, t, s),
            logit_bits,
            mask=None if mask is None else mask[:, None, None],
        ).reshape(b, hkv, r * t, s)
    if gmask is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        probs = jax.nn.softmax(jnp.where(gmask, logits, MASK_VALUE), axis=-1)
        # A query that sees no key at all gets zero weights (and a zero output), as flash
        # attention gives, rather than a uniform average over keys it may not see.
        probs = jnp.where(gmask, probs, 0.0) if zero_masked else probs
    return (probs, maxes) if logit_max else probs


def _attend(probs: jax.Array, v: jax.Array, t: int) -> jax.Array:
    """``probs`` ``[B,Hkv,R*T,S]`` times v ``[B,S,Hkv,Dv]`` -> ``[B,T,Hkv*R,Dv]`` in float32."""
    out = jnp.einsum(
        "bgqs,bgsd->bgqd",
        probs.astype(v.dtype),
        v.transpose(0, 2, 1, 3),
        preferred_element_type=jnp.float32,
    )
    return _ungroup_queries(out, t)


def _default_scale(q: jax.Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def attention_logits(
    q: jax.Array,
    k: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The pre-softmax logits ``q k^T * scale`` ``[B, Hq, T, S]`` (float32) and the boolean mask
    ``[B or 1, T, S]`` (True = may attend; None when nothing is masked). Masked entries keep
    their raw value: read them through the mask."""
    b, t, hq, _ = q.shape
    logits = _grouped_logits(q, k, _default_scale(q, scale)).reshape(b, hq, t, k.shape[1])
    mask = attention_mask(
        t, k.shape[1], causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids
    )
    return logits, mask


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The softmax attention map ``[B, Hq, T, S]`` (float32)."""
    b, t, hq, _ = q.shape
    mask = attention_mask(
        t, k.shape[1], causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids
    )
    probs = _grouped_probs(q, k, mask, _default_scale(q, scale))
    return probs.reshape(b, hq, t, k.shape[1])


def attention(
    q,
    k,
    v,
    *,
    second=None,
    causal=True,
    segment_ids=None,
    kv_segment_ids=None,
    scale=None,
    logit_bits=None,
    logit_max=False,
):
    """Softmax attention with one map, ``softmax(q k^T s) v`` (``second`` None), or two,
    ``softmax(q k^T s) v - lam * softmax(q2 k2^T s) v`` (``second=(q2, k2, lam)``; ``k2=None``:
    both maps read ``k``, DIFF V2's shared key; ``lam`` a scalar (V1) or ``[B, T, Hq]`` (V2)):
    ``[B, T, Hq, Dv]`` in ``q.dtype``. ``scale`` defaults to ``D ** -0.5``.

    ``logit_max=True``: ``(out, maxes)``, ``maxes`` float32 ``[n_maps, B, T, Hq]`` the largest
    logit ``(q k^T) * scale`` of each map's query rows over the keys they see (the softmax's
    own logits, before any ``logit_bits`` quantization), -inf for a row that sees no key; no
    gradient. ``out`` is the same as without it."""
    mask = attention_mask(
        q.shape[1],
        k.shape[1],
        causal=causal,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    return masked_attention(
        q, k, v, mask, second=second, scale=scale, logit_bits=logit_bits, logit_max=logit_max
    )


def masked_attention(q, k, v, mask, *, second=None, scale=None, logit_bits=None, logit_max=False):
    """:func:`attention` under a boolean ``mask`` ``[B or 1, T, S]`` (True = may attend; None:
    every key), e.g. one built from positions rather than indices.

    Two maps are computed as one value product on the differential map, ``(A1 - lam A2) v``:
    lambda is constant along each map row, so this is the same sum as ``A1 v - lam A2 v`` with
    one ``[T, S] x [S, Dv]`` product instead of two. The map is formed in float32 and cast to
    v's dtype, then accumulated in float32 (the same in float32 to rounding; in bfloat16 it
    rounds the differential map once instead of each map). A query that sees no key gets a
    zero output, as the fused kernels give."""
    _, t, hq, _ = q.shape
    hkv = k.shape[2]
    scale = _default_scale(q, scale)
    maps = (
        [(q, k)] if second is None else [(q, k), (second[0], k if second[1] is None else second[1])]
    )
    kw = dict(zero_masked=False, logit_max=logit_max)
    probs = [_grouped_probs(qi, ki, mask, scale, logit_bits, **kw) for qi, ki in maps]
    if logit_max:
        probs, maxes = zip(*probs)
    p = probs[0]
    if second is not None:
        lam = jnp.asarray(second[2], jnp.float32)
        if lam.ndim:  # [B, T, Hq] per-token, per-head lambda (V2): one value per map row
            lam = _group_rows(lam, hkv)
        p = p - lam * probs[1]
    gmask = _group_mask(mask, hq // hkv)
    if gmask is not None:  # a query that sees no key gets a zero output (see _grouped_probs)
        p = jnp.where(gmask, p, 0.0)
    out = _attend(p, v, t).astype(q.dtype)
    if not logit_max:
        return out
    return out, jnp.stack([_ungroup_rows(m, t) for m in maxes])


def dot_product_attention(q, k, v, **options):
    """``softmax(q k^T s) v``: :func:`attention` with one map (the same keywords)."""
    return attention(q, k, v, **options)


def differential_attention(q1, k1, q2, k2, v, lam, **options):
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``: :func:`attention` with two maps
    (``k2=None``: both maps read ``k1``; the same keywords)."""
    return attention(q1, k1, v, second=(q2, k2, lam), **options)
