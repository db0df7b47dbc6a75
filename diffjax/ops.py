"""Pure attention math and the one dispatch point for attention implementations.

Layout everywhere: ``[batch, seq, heads, dim]``.

- :func:`dot_product_attention`: standard (MHA/GQA/MQA) softmax attention.
- :func:`differential_attention`: ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``, each
  branch normalised by its own softmax denominator.

Both take ``impl``: ``"xla"`` (plain ``jax.numpy``, defined here), ``"auto"`` (the fastest
registered implementation for the current backend; XLA on CPU), or any name registered with
:func:`register_attention_impl` (the Pallas kernels register ``"pallas"``). Shapes are checked
here, once, before any implementation runs; implementations may assume valid input.

GQA is index arithmetic: query head ``i`` reads kv head ``i // (Hq // Hkv)``. K/V are never
repeated in memory.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# A large finite negative logit for masked positions: keeps fully-masked rows NaN-free.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------- masks
def attention_mask(q_len: int, kv_len: int, *, causal: bool = True,
                   segment_ids: jax.Array | None = None,
                   kv_segment_ids: jax.Array | None = None) -> jax.Array | None:
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


# ---------------------------------------------------------------------------- XLA reference
def _attention_probs(q: jax.Array, k: jax.Array, mask: jax.Array | None, scale: float
                     ) -> jax.Array:
    """Softmax probabilities ``[B, Hkv, R, T, S]`` in float32, for q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    if mask is None:
        return jax.nn.softmax(logits, axis=-1)
    mask = mask[:, None, None, :, :]
    probs = jax.nn.softmax(jnp.where(mask, logits, MASK_VALUE), axis=-1)
    # A query that sees no key at all gets zero weights (and a zero output), as flash attention
    # gives, rather than a uniform average over keys it may not see.
    return jnp.where(mask, probs, 0.0)


def _attend(probs: jax.Array, v: jax.Array) -> jax.Array:
    """``probs`` ``[B,Hkv,R,T,S]`` times v ``[B,S,Hkv,Dv]`` -> ``[B,T,Hkv*R,Dv]`` in float32.

    The probabilities are cast to v's dtype first (as flash attention and the official code do),
    and the products accumulate in float32.
    """
    b, hkv, r, t, _ = probs.shape
    out = jnp.einsum("bgrts,bsgd->btgrd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, hkv * r, v.shape[-1])


def dot_product_attention_xla(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None,
                              scale=None):
    """Standard attention in plain jax.numpy. Output ``[B, T, Hq, Dv]`` in ``q.dtype``."""
    mask = attention_mask(q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids)
    out = _attend(_attention_probs(q, k, mask, scale), v)
    return out.astype(q.dtype)


def differential_attention_xla(q1, k1, q2, k2, v, lam, *, causal=True, segment_ids=None,
                               kv_segment_ids=None, scale=None):
    """Differential attention in plain jax.numpy. Output ``[B, T, Hq, Dv]`` in ``q1.dtype``.

    Both branch outputs accumulate in float32 and the subtraction ``o1 - lam * o2`` is done in
    float32 with a float32 lambda, then cast to the activation dtype.
    """
    mask = attention_mask(q1.shape[1], k1.shape[1], causal=causal, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids)
    o1 = _attend(_attention_probs(q1, k1, mask, scale), v)
    o2 = _attend(_attention_probs(q2, k2, mask, scale), v)
    lam = jnp.asarray(lam, jnp.float32)
    if lam.ndim:  # [B, T, Hq] per-token, per-head lambda (V2)
        lam = lam[..., None]
    return (o1 - lam * o2).astype(q1.dtype)


def attention_weights(q: jax.Array, k: jax.Array, *, causal: bool = True,
                      segment_ids: jax.Array | None = None,
                      kv_segment_ids: jax.Array | None = None,
                      scale: float | None = None) -> jax.Array:
    """The softmax attention map ``[B, Hq, T, S]`` (float32), for analysis and plots.

    q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``; query head ``i`` reads kv head ``i // (Hq // Hkv)``.
    Materialises the whole map: meant for inspection, not for training.
    """
    _check_qkv(q, k, k, segment_ids, kv_segment_ids, "attention_weights")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = attention_mask(q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids)
    probs = _attention_probs(q, k, mask, scale)  # [B, Hkv, R, T, S]
    b, hkv, r, t, s = probs.shape
    return probs.reshape(b, hkv * r, t, s)


def attention_logits(q: jax.Array, k: jax.Array, *, causal: bool = True,
                     segment_ids: jax.Array | None = None,
                     kv_segment_ids: jax.Array | None = None,
                     scale: float | None = None) -> tuple[jax.Array, jax.Array | None]:
    """The pre-softmax logits ``q k^T * scale`` ``[B, Hq, T, S]`` (float32) and the boolean mask
    ``[B or 1, T, S]`` (True = may attend; None when nothing is masked), for analysis (outliers,
    quantization). Masked entries keep their raw value: read them through the mask. Query head
    ``i`` reads kv head ``i // (Hq // Hkv)``. Materialises the whole ``T x S`` block."""
    _check_qkv(q, k, k, segment_ids, kv_segment_ids, "attention_logits")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    logits = (logits * jnp.float32(scale)).reshape(b, hq, t, k.shape[1])
    mask = attention_mask(t, k.shape[1], causal=causal, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids)
    return logits, mask


# ---------------------------------------------------------------------------- registry
class StandardFn(Protocol):
    def __call__(self, q, k, v, *, causal, segment_ids, kv_segment_ids, scale) -> jax.Array: ...


class DifferentialFn(Protocol):
    def __call__(self, q1, k1, q2, k2, v, lam, *, causal, segment_ids, kv_segment_ids,
                 scale) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One attention implementation: a standard and a differential function.

    ``backends``: the ``jax.default_backend()`` values on which ``impl="auto"`` may pick it.
    """

    name: str
    standard: StandardFn
    differential: DifferentialFn
    backends: tuple[str, ...] = ()
    priority: int = 0


_IMPLS: dict[str, AttentionImpl] = {}


def register_attention_impl(impl: AttentionImpl) -> None:
    """Add (or replace) an implementation under ``impl.name``."""
    if impl.name == "auto":
        raise ValueError("'auto' is reserved for automatic selection; pick another name")
    _IMPLS[impl.name] = impl


def available_impls() -> tuple[str, ...]:
    return tuple(_IMPLS)


register_attention_impl(AttentionImpl(
    "xla", dot_product_attention_xla, differential_attention_xla,
    backends=("cpu", "gpu", "cuda", "rocm", "tpu"), priority=0))


def resolve_impl(impl: str) -> AttentionImpl:
    """The implementation for ``impl``; ``"auto"`` picks the highest-priority one registered for
    the current backend (the XLA path on CPU)."""
    if impl == "auto":
        backend = jax.default_backend()
        candidates = [i for i in _IMPLS.values() if backend in i.backends]
        return max(candidates, key=lambda i: i.priority) if candidates else _IMPLS["xla"]
    if impl not in _IMPLS:
        raise ValueError(
            f"unknown attention impl {impl!r}. Fix: use 'auto' or one of "
            f"{', '.join(map(repr, _IMPLS))}."
        )
    return _IMPLS[impl]


# ---------------------------------------------------------------------------- checks
def _check_qkv(q, k, v, segment_ids, kv_segment_ids, what: str, qname="q", kname="k"):
    for name, x in ((qname, q), (kname, k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{what}: {name} must be [batch, seq, heads, dim], got shape {x.shape}")
    b, t, hq, d = q.shape
    bk, s, hkv, dk = k.shape
    if bk != b or v.shape[0] != b:
        raise ValueError(f"{what}: batch sizes differ: {qname} {q.shape}, {kname} {k.shape}, v {v.shape}")
    if dk != d:
        raise ValueError(f"{what}: {qname} and {kname} head dims differ: {d} vs {dk}")
    if v.shape[1] != s or v.shape[2] != hkv:
        raise ValueError(f"{what}: v must be [batch, {s}, {hkv}, dv] like {kname}, got {v.shape}")
    if hq % hkv:
        raise ValueError(f"{what}: {hkv} kv heads do not divide {hq} query heads")
    if segment_ids is not None:
        if segment_ids.shape != (b, t):
            raise ValueError(f"{what}: segment_ids must be [batch, seq] = [{b}, {t}], got {segment_ids.shape}")
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        if kv_seg.shape != (b, s):
            raise ValueError(
                f"{what}: key segment ids must be [batch, kv_seq] = [{b}, {s}], got {kv_seg.shape}"
                + ("; pass kv_segment_ids when the key length differs" if kv_segment_ids is None else "")
            )
    elif kv_segment_ids is not None:
        raise ValueError(f"{what}: kv_segment_ids given without segment_ids")


# ---------------------------------------------------------------------------- public API
def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                          segment_ids: jax.Array | None = None,
                          kv_segment_ids: jax.Array | None = None,
                          scale: float | None = None, impl: str = "auto") -> jax.Array:
    """Standard softmax attention. q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``, v ``[B,S,Hkv,Dv]``.

    Returns ``[B, T, Hq, Dv]``. ``scale`` defaults to ``D ** -0.5``.
    """
    _check_qkv(q, k, v, segment_ids, kv_segment_ids, "dot_product_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fn = resolve_impl(impl).standard
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
              scale=scale)


def differential_attention(q1: jax.Array, k1: jax.Array, q2: jax.Array, k2: jax.Array,
                           v: jax.Array, lam: jax.Array | float, *, causal: bool = True,
                           segment_ids: jax.Array | None = None,
                           kv_segment_ids: jax.Array | None = None,
                           scale: float | None = None, impl: str = "auto") -> jax.Array:
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``, ``[B, T, Hq, Dv]``.

    q1, q2 ``[B,T,Hq,D]``; k1, k2 ``[B,S,Hkv,D]``; v ``[B,S,Hkv,Dv]`` (Dv = D or 2D); ``lam`` a
    scalar (V1) or ``[B, T, Hq]`` (V2). ``scale`` defaults to ``D ** -0.5``.
    """
    what = "differential_attention"
    _check_qkv(q1, k1, v, segment_ids, kv_segment_ids, what, "q1", "k1")
    if q2.shape != q1.shape:
        raise ValueError(f"{what}: q1 and q2 must have the same shape, got {q1.shape} and {q2.shape}")
    if k2.shape != k1.shape:
        raise ValueError(f"{what}: k1 and k2 must have the same shape, got {k1.shape} and {k2.shape}")
    lam_shape = jnp.shape(lam)
    b, t, hq, _ = q1.shape
    if lam_shape not in ((), (b, t, hq)):
        raise ValueError(f"{what}: lam must be a scalar or [batch, seq, heads] = [{b}, {t}, {hq}], "
                         f"got shape {lam_shape}")
    scale = q1.shape[-1] ** -0.5 if scale is None else scale
    fn = resolve_impl(impl).differential
    return fn(q1, k1, q2, k2, v, lam, causal=causal, segment_ids=segment_ids,
              kv_segment_ids=kv_segment_ids, scale=scale)


# ---------------------------------------------------------------------------- Pallas
# The fused kernels (diffjax.kernels) are imported on first use, so that importing diffjax does
# not import Pallas. On CPU they run interpreted: slow, but the same code path, for tests.
def _kernel_kwargs(scale):
    return dict(sm_scale=scale, interpret=jax.default_backend() == "cpu")


def _per_shard(body, q, k, arrays: dict[str, jax.Array | None]) -> jax.Array:
    """``body(**arrays)`` on each device's shard under the context mesh (``jax.set_mesh``), or
    directly without one. A Pallas kernel is one opaque call that GSPMD cannot split, so under a
    mesh it runs inside ``jax.shard_map``: batch rows over the batch axes, heads over ``tensor``
    (kv heads and query heads alike, so every query head finds its kv group, and DIFF pairs,
    which share a head index, stay together), sequence and head width whole.

    ``arrays`` holds ``q``-like ``[B, T, Hq, .]`` (keys starting with ``q`` or ``o``),
    ``k``/``v``-like ``[B, S, Hkv, .]``, ``lam`` (scalar or ``[B, T, Hq]``) and segment ids
    ``[B, T]``; None entries are passed through."""
    from . import sharding

    mesh = sharding.context_mesh()
    live = {n: a for n, a in arrays.items() if a is not None}
    if mesh is None or mesh.size == 1:
        return body(**arrays)
    b, hkv = q.shape[0], k.shape[2]
    batch = sharding.logical_to_spec(("act_batch",), (b,), mesh)
    heads = sharding.logical_to_spec(("act_kv_heads",), (hkv,), mesh)
    bax = batch[0] if len(batch) else None
    hax = heads[0] if len(heads) else None

    def spec(name, a):
        if name == "lam" and a.ndim == 0:
            return P()
        if name == "lam":
            return P(bax, None, hax)
        if name.endswith("segment_ids"):
            return P(bax, None)
        return P(bax, None, hax, None)

    names = list(live)
    in_specs = tuple(spec(n, live[n]) for n in names)

    def local(*xs):
        kw = dict(arrays)
        kw.update(zip(names, xs))
        return body(**kw)

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(bax, None, hax, None),
                         check_vma=False)(*(live[n] for n in names))


def pallas_standard(q, k, v, *, causal, segment_ids, kv_segment_ids, scale):
    from diffjax import kernels

    def body(q, k, v, segment_ids, kv_segment_ids):
        return kernels.flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                       kv_segment_ids=kv_segment_ids, **_kernel_kwargs(scale))

    return _per_shard(body, q, k, dict(q=q, k=k, v=v, segment_ids=segment_ids,
                                       kv_segment_ids=kv_segment_ids))


def pallas_differential(q1, k1, q2, k2, v, lam, *, causal, segment_ids, kv_segment_ids, scale):
    from diffjax import kernels

    shared = k1 is k2  # DIFF V2: one key for both maps (the kernel then loads it once)

    def body(q1, k1, q2, v, lam, segment_ids, kv_segment_ids, k2=None):
        return kernels.diff_flash_attention(q1, k1, q2, k1 if shared else k2, v, lam,
                                            causal=causal, segment_ids=segment_ids,
                                            kv_segment_ids=kv_segment_ids, **_kernel_kwargs(scale))

    return _per_shard(body, q1, k1, dict(q1=q1, k1=k1, q2=q2, k2=None if shared else k2, v=v,
                                         lam=lam, segment_ids=segment_ids,
                                         kv_segment_ids=kv_segment_ids))


register_attention_impl(AttentionImpl(
    "pallas", pallas_standard, pallas_differential, backends=("gpu", "tpu"), priority=10))
