"""The plain ``jax.numpy`` reference the Pallas kernels are tested against.

Same signature as the kernels (``sm_scale``, ``segment_ids``, ``kv_segment_ids``); the math is
:func:`diffjax.ops.differential_attention_xla` / :func:`diffjax.ops.dot_product_attention_xla`
(float32 softmax, probabilities cast to v's dtype, float32 accumulation, ``o1 - lam * o2`` in
float32, zero output for a query that sees no key). It materialises the ``[T, S]`` maps: use it
for checking, not for long sequences.
"""

from __future__ import annotations

from diffjax import ops


def diff_attention_reference(q1, k1, q2, k2, v, lam, *, causal=True, segment_ids=None,
                             kv_segment_ids=None, sm_scale=None):
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``, ``[B, T, Hq, Dv]``."""
    scale = q1.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return ops.differential_attention_xla(q1, k1, q2, k2, v, lam, causal=causal,
                                          segment_ids=segment_ids,
                                          kv_segment_ids=kv_segment_ids, scale=scale)


def attention_reference(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None,
                        sm_scale=None):
    """``softmax(q k^T s) v``, ``[B, T, Hq, Dv]``."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return ops.dot_product_attention_xla(q, k, v, causal=causal, segment_ids=segment_ids,
                                         kv_segment_ids=kv_segment_ids, scale=scale)
