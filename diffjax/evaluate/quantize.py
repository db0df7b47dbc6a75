"""Simulated absmax quantization of the attention logits (the paper's Fig. 8).

Each map's pre-softmax logits ``q k^T / sqrt(d)`` are quantized per example and head: the
scale is the largest magnitude over the ``T x S`` block (masked entries left out),
``scale = absmax / (2^(bits-1) - 1)``, and each logit becomes ``round(x / scale) * scale``
(symmetric, round to nearest); then masking, softmax and the value product run in float32 as
usual. A large outlier sets a coarse step for every other logit of its head, which is how
outliers hurt low-bit attention.

The quantized forward is the reference math with ``logit_bits`` set
(:func:`diffjax.kernels.reference.absmax_quantize` on the logits), packaged as the attention
implementation :class:`QuantizedLogits`; :func:`with_quantized_logits` builds a model whose
attention layers use it, holding the original's parameters. ``attention_impl`` is a static
attribute of the layers, so a jitted function traced for the quantized model is a different
cache entry from the original model's: nothing leaks into later calls.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from diffjax.model import TransformerLM, rebuilt
from diffjax.kernels import reference
from diffjax.kernels.reference import absmax_quantize, check_logit_bits

from .paper import QUANTIZATION_BITS as PAPER_BITS
from .positions import validation_loss
from .probe import losses_and_predictions
from .retrieval import query_correct

__all__ = [
    "PAPER_BITS",
    "QuantizedLogits",
    "absmax_quantize",
    "quantization_sweep",
    "with_quantized_logits",
]


@dataclasses.dataclass(frozen=True)
class QuantizedLogits:
    """An attention implementation (a value for a layer's ``attention_impl``, or ``impl=`` of
    :mod:`diffjax.ops`): the reference math with every map's logits absmax-quantized to
    ``bits`` bits before the softmax. Frozen, so it hashes by value as a static attribute."""

    bits: int

    def __post_init__(self):
        check_logit_bits(self.bits)

    def dot_product_attention(self, q, k, v, *, causal, segment_ids, kv_segment_ids, scale):
        return reference.dot_product_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            scale=scale,
            logit_bits=self.bits,
        )

    def differential_attention(
        self, q1, k1, q2, k2, v, lam, *, causal, segment_ids, kv_segment_ids, scale
    ):
        return reference.differential_attention(
            q1,
            k1,
            q2,
            k2,
            v,
            lam,
            causal=causal,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            scale=scale,
            logit_bits=self.bits,
        )


def with_quantized_logits(model: TransformerLM, bits: int | None) -> TransformerLM:
    """``model`` built again (sharing its parameter arrays) with attention layers that quantize
    their logits to ``bits`` (:class:`QuantizedLogits`; None: the plain XLA path). ``model``
    itself is not modified."""
    check_logit_bits(bits)
    if not isinstance(model, TransformerLM):
        raise ValueError(
            f"with_quantized_logits: takes a diffjax TransformerLM, got {type(model).__name__}. "
            f"Fix: pass the language model (its attention layers are built with the quantized "
            f"implementation)"
        )
    return rebuilt(model, attention_impl="xla" if bits is None else QuantizedLogits(int(bits)))


def quantization_sweep(
    model: nnx.Module,
    val_batch: dict,
    needle_batch: dict | None = None,
    *,
    bits=PAPER_BITS,
    batch_size: int = 8,
) -> list[dict]:
    """Validation loss (weighted by ``val_batch["weights"]``) and, with ``needle_batch``, query
    retrieval accuracy of ``model`` with full-precision logits (``bits=None``, first row) and
    with logits quantized to each width in ``bits``."""
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
