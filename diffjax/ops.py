"""The one dispatch point for attention: checks shapes once, then runs an implementation.

Layout everywhere: ``[batch, seq, heads, dim]``.

- :func:`dot_product_attention`: standard (MHA/GQA/MQA) softmax attention.
- :func:`differential_attention`: ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``, each
  branch normalised by its own softmax denominator.

``impl`` picks the implementation:

- ``"xla"``: the plain ``jax.numpy`` math of :mod:`diffjax.kernels.reference`;
- ``"pallas"``: the fused kernels of :mod:`diffjax.kernels` (interpreted on CPU), run per shard
  under ``jax.shard_map`` when a mesh is set with ``jax.set_mesh``;
- ``"auto"``: ``"pallas"`` on GPU and TPU, ``"xla"`` elsewhere.

``logit_bits`` (XLA only) simulates absmax quantization of the logits, for the quantization
analysis (:mod:`diffjax.evaluate.quantize`).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from diffjax.kernels import reference
from diffjax.kernels.reference import MASK_VALUE, attention_mask  # noqa: F401  (re-exported)

IMPLS = ("auto", "xla", "pallas")


def check_impl(impl: str, logit_bits: int | None = None) -> str:
    """The concrete implementation (``"xla"`` or ``"pallas"``) for ``impl``; a ValueError that
    names the fix for an unknown one or for ``logit_bits`` with the kernels."""
    if impl not in IMPLS:
        raise ValueError(
            f"unknown attention impl {impl!r}. Fix: use one of {', '.join(map(repr, IMPLS))}."
        )
    reference.check_logit_bits(logit_bits)
    if impl == "auto":
        impl = "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
        if logit_bits is not None:
            impl = "xla"  # the simulated quantization exists in the reference math only
    if impl == "pallas" and logit_bits is not None:
        raise ValueError(
            "logit_bits (simulated quantization of the logits) runs on the XLA path "
            "only. Fix: use impl='xla' (or 'auto')."
        )
    return impl


# ---------------------------------------------------------------------------- public API
def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
    logit_bits: int | None = None,
) -> jax.Array:
    """Standard softmax attention. q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``, v ``[B,S,Hkv,Dv]``.

    Returns ``[B, T, Hq, Dv]``. ``scale`` defaults to ``D ** -0.5``.
    """
    reference.check_qkv(q, k, v, segment_ids, kv_segment_ids, what="dot_product_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    masks = dict(causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    match check_impl(impl, logit_bits):
        case "xla":
            return reference.dot_product_attention(
                q, k, v, scale=scale, logit_bits=logit_bits, **masks
            )
        case "pallas":
            return _pallas_standard(q, k, v, scale=scale, **masks)


def differential_attention(
    q1: jax.Array,
    k1: jax.Array,
    q2: jax.Array,
    k2: jax.Array,
    v: jax.Array,
    lam: jax.Array | float,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
    logit_bits: int | None = None,
) -> jax.Array:
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``, ``[B, T, Hq, Dv]``.

    q1, q2 ``[B,T,Hq,D]``; k1, k2 ``[B,S,Hkv,D]`` (V2 passes one key array twice); v
    ``[B,S,Hkv,Dv]``; ``lam`` a scalar (V1) or ``[B, T, Hq]`` (V2). ``scale`` defaults to
    ``D ** -0.5``.
    """
    reference.check_differential(
        q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids, what="differential_attention"
    )
    scale = q1.shape[-1] ** -0.5 if scale is None else scale
    masks = dict(causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    match check_impl(impl, logit_bits):
        case "xla":
            return reference.differential_attention(
                q1, k1, q2, k2, v, lam, scale=scale, logit_bits=logit_bits, **masks
            )
        case "pallas":
            return _pallas_differential(q1, k1, q2, k2, v, lam, scale=scale, **masks)


def attention_weights(
    q: jax.Array,
    k: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The softmax attention map ``[B, Hq, T, S]`` (float32), for analysis and plots.

    q ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``; query head ``i`` reads kv head ``i // (Hq // Hkv)``.
    Materialises the whole map: meant for inspection, not for training.
    """
    reference.check_qkv(q, k, k, segment_ids, kv_segment_ids, what="attention_weights")
    return reference.attention_weights(
        q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale
    )


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
    ``[B or 1, T, S]`` (True = may attend; None when nothing is masked), for analysis (outliers,
    quantization). Masked entries keep their raw value: read them through the mask. Query head
    ``i`` reads kv head ``i // (Hq // Hkv)``. Materialises the whole ``T x S`` block."""
    reference.check_qkv(q, k, k, segment_ids, kv_segment_ids, what="attention_logits")
    return reference.attention_logits(
        q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale
    )


# ---------------------------------------------------------------------------- Pallas
# A Pallas kernel is one opaque call that GSPMD cannot split, so under a mesh it runs inside
# jax.shard_map: batch rows over the batch axes, heads over `tensor` (kv heads and query heads
# alike, so every query head finds its kv group, and DIFF pairs, which share a head index, stay
# together), sequence and head width whole. On CPU the kernels run interpreted (tests).
def _mesh_axes(batch: int, kv_heads: int):
    """``(mesh, batch axes, head axes)`` under the context mesh, or ``(None, None, None)``."""
    from diffjax import sharding

    mesh = sharding.context_mesh()
    if mesh is None or mesh.size == 1:
        return None, None, None
    bspec = sharding.logical_to_spec(("act_batch",), (batch,), mesh)
    hspec = sharding.logical_to_spec(("act_kv_heads",), (kv_heads,), mesh)
    return mesh, (bspec[0] if len(bspec) else None), (hspec[0] if len(hspec) else None)


def _pallas_standard(q, k, v, *, causal, segment_ids, kv_segment_ids, scale):
    from diffjax import kernels

    def run(q, k, v, segment_ids, kv_segment_ids):
        return kernels.flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            sm_scale=scale,
            interpret=jax.default_backend() == "cpu",
        )

    mesh, b, h = _mesh_axes(q.shape[0], k.shape[2])
    if mesh is None:
        return run(q, k, v, segment_ids, kv_segment_ids)
    seg = None if segment_ids is None else P(b, None)
    kv_seg = None if kv_segment_ids is None else P(b, None)
    heads = P(b, None, h, None)
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(heads, heads, heads, seg, kv_seg),
        out_specs=heads,
        check_vma=False,
    )(q, k, v, segment_ids, kv_segment_ids)


def _pallas_differential(q1, k1, q2, k2, v, lam, *, causal, segment_ids, kv_segment_ids, scale):
    from diffjax import kernels

    shared = k1 is k2  # DIFF V2: one key for both maps (the kernel then loads it once)

    def run(q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids):
        return kernels.differential_flash_attention(
            q1,
            k1,
            q2,
            k1 if shared else k2,
            v,
            lam,
            causal=causal,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            sm_scale=scale,
            interpret=jax.default_backend() == "cpu",
        )

    k2 = None if shared else k2
    mesh, b, h = _mesh_axes(q1.shape[0], k1.shape[2])
    if mesh is None:
        return run(q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids)
    heads = P(b, None, h, None)
    lam_spec = P() if jax.numpy.ndim(lam) == 0 else P(b, None, h)  # V1 scalar, V2 [B, T, Hq]
    seg = None if segment_ids is None else P(b, None)
    kv_seg = None if kv_segment_ids is None else P(b, None)
    in_specs = (heads, heads, heads, None if shared else heads, heads, lam_spec, seg, kv_seg)
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(
        q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids
    )
