"""Simulated absmax quantization of the attention logits (the paper's Fig. 8).

Each map's pre-softmax logits ``q k^T / sqrt(d)`` are quantized per example and head: the
scale is the largest magnitude over the ``T x S`` block (masked entries left out),
``scale = absmax / (2^(bits-1) - 1)``, and each logit becomes ``round(x / scale) * scale``
(symmetric, round to nearest); then masking, softmax and the value product run in float32 as
usual. A large outlier sets a coarse step for every other logit of its head, which is how
outliers hurt low-bit attention.

The quantized forward is the reference math with ``logit_bits`` set
(:func:`diffjax.kernels.reference.absmax_quantize` on the logits); :func:`with_quantized_logits`
returns a copy of a model whose attention layers use it. ``logit_bits`` is a static attribute
of the modules, so a jitted function traced for the quantized copy is a different cache entry
from the original model's: nothing leaks into later calls.
"""

from __future__ import annotations

from flax import nnx

from diffjax.kernels.reference import absmax_quantize, check_logit_bits

__all__ = ["PAPER_BITS", "absmax_quantize", "quantization_sweep", "with_quantized_logits"]

PAPER_BITS = (16, 8, 6, 4)


def with_quantized_logits(model: nnx.Module, bits: int | None) -> nnx.Module:
    """A copy of ``model`` (sharing its parameter arrays) whose attention layers quantize their
    logits to ``bits`` (None: an unchanged copy using the plain XLA path). ``model`` itself is
    not modified."""
    check_logit_bits(bits)
    copy = nnx.merge(*nnx.split(model))
    found = 0
    for _, module in nnx.iter_graph(copy):
        if isinstance(module, nnx.Module) and hasattr(module, "logit_bits"):
            module.attention_impl = "xla"
            module.logit_bits = None if bits is None else int(bits)
            found += 1
    if not found:
        raise ValueError(
            f"with_quantized_logits: {type(model).__name__} has no diffjax "
            f"attention layer (no module with a logit_bits attribute)"
        )
    return copy


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
