"""Simulated absmax quantization of the attention logits (the paper's Fig. 8).

Each map's pre-softmax logits ``q k^T / sqrt(d)`` are quantized per example and head: the
scale is the largest magnitude over the ``T x S`` block (masked entries left out),
``scale = absmax / (2^(bits-1) - 1)``, and each logit becomes ``round(x / scale) * scale``
(symmetric, round to nearest); then masking, softmax and the value product run in float32 as
usual. A large outlier sets a coarse step for every other logit of its head, which is how
outliers hurt low-bit attention.

The quantized forward is an attention implementation registered with
:func:`diffjax.ops.register_attention_impl` under ``"absmax<bits>"``; :func:`with_quantized_logits`
returns a copy of a model whose attention layers use it. The implementation name is a static
attribute of the modules, so a jitted function traced for the quantized copy is a different
cache entry from the original model's: nothing leaks into later calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import ops

PAPER_BITS = (16, 8, 6, 4)


def absmax_quantize(x: jax.Array, bits: int, *, mask: jax.Array | None = None,
                    axis=(-2, -1)) -> jax.Array:
    """``x`` rounded to a symmetric ``bits``-bit grid whose step is ``absmax / (2^(bits-1)-1)``,
    the absmax taken over ``axis`` among the entries where ``mask`` is True (all if None).
    A block whose absmax is 0 is returned unchanged. Float32 in the arithmetic."""
    _check_bits(bits)
    x = jnp.asarray(x, jnp.float32)
    mag = jnp.abs(x) if mask is None else jnp.where(mask, jnp.abs(x), 0.0)
    absmax = jnp.max(mag, axis=axis, keepdims=True)
    levels = float(2 ** (bits - 1) - 1)
    scale = jnp.where(absmax > 0, absmax / levels, 1.0)
    return jnp.clip(jnp.round(x / scale), -levels, levels) * scale


def _check_bits(bits) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 24:
        raise ValueError(f"absmax quantization: bits must be an integer in [2, 24], got "
                         f"{bits!r}. Fix: use e.g. 16, 8, 6 or 4")


def _probs(q, k, bits, causal, segment_ids, kv_segment_ids, scale):
    logits, mask = ops.attention_logits(q, k, causal=causal, segment_ids=segment_ids,
                                        kv_segment_ids=kv_segment_ids, scale=scale)
    full = None if mask is None else mask[:, None]
    logits = absmax_quantize(logits, bits, mask=full)
    if full is None:
        return jax.nn.softmax(logits, axis=-1)
    probs = jax.nn.softmax(jnp.where(full, logits, ops.MASK_VALUE), axis=-1)
    return jnp.where(full, probs, 0.0)  # a query that sees no key gets zero weights


def _attend(probs, v):
    """``probs`` ``[B, Hq, T, S]`` times v ``[B, S, Hkv, Dv]`` -> ``[B, T, Hq, Dv]`` float32."""
    b, hq, t, s = probs.shape
    hkv = v.shape[2]
    p = probs.reshape(b, hkv, hq // hkv, t, s).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, v.shape[-1])


def _impl(bits: int) -> ops.AttentionImpl:
    def standard(q, k, v, *, causal, segment_ids, kv_segment_ids, scale):
        p = _probs(q, k, bits, causal, segment_ids, kv_segment_ids, scale)
        return _attend(p, v).astype(q.dtype)

    def differential(q1, k1, q2, k2, v, lam, *, causal, segment_ids, kv_segment_ids, scale):
        o1 = _attend(_probs(q1, k1, bits, causal, segment_ids, kv_segment_ids, scale), v)
        o2 = _attend(_probs(q2, k2, bits, causal, segment_ids, kv_segment_ids, scale), v)
        lam = jnp.asarray(lam, jnp.float32)
        if lam.ndim:
            lam = lam[..., None]
        return (o1 - lam * o2).astype(q1.dtype)

    # backends=(): never chosen by impl="auto"
    return ops.AttentionImpl(impl_name(bits), standard, differential, backends=(), priority=-1)


def impl_name(bits: int) -> str:
    """The registered attention implementation that quantizes logits to ``bits``."""
    return f"absmax{int(bits)}"


def register_quantized_impl(bits: int) -> str:
    """Register (once) the ``bits``-bit quantized-logits implementation; returns its name."""
    name = impl_name(bits)
    _check_bits(bits)
    if name not in ops.available_impls():
        ops.register_attention_impl(_impl(int(bits)))
    return name


def with_quantized_logits(model: nnx.Module, bits: int | None) -> nnx.Module:
    """A copy of ``model`` (sharing its parameter arrays) whose attention layers quantize their
    logits to ``bits`` (None: an unchanged copy using the plain XLA path). ``model`` itself is
    not modified."""
    name = "xla" if bits is None else register_quantized_impl(bits)
    copy = nnx.merge(*nnx.split(model))
    found = 0
    for _, module in nnx.iter_graph(copy):
        if isinstance(module, nnx.Module) and hasattr(module, "attention_impl"):
            module.attention_impl = name
            found += 1
    if not found:
        raise ValueError(f"with_quantized_logits: {type(model).__name__} has no diffjax "
                         f"attention layer (no module with an attention_impl attribute)")
    return copy


def quantization_sweep(model: nnx.Module, val_batch: dict, needle_batch: dict | None = None, *,
                       bits=PAPER_BITS, batch_size: int = 8) -> list[dict]:
    """Validation loss (weighted by ``val_batch["weights"]``) and, with ``needle_batch``, query
    retrieval accuracy of ``model`` with full-precision logits (``bits=None``, first row) and
    with logits quantized to each width in ``bits``."""
    import numpy as np

    from .positions import validation_loss
    from .probe import losses_and_predictions
    from .retrieval import query_correct

    rows = []
    for b in (None, *bits):
        q = model if b is None else with_quantized_logits(model, b)
        loss, _ = losses_and_predictions(q, val_batch, batch_size)
        row = {"bits": b, "val_loss": validation_loss(loss, val_batch["weights"])[0]}
        if needle_batch is not None:
            _, preds = losses_and_predictions(q, needle_batch, batch_size)
            row["accuracy"] = float(np.mean(query_correct(preds, needle_batch)))
        rows.append(row)
    return rows
