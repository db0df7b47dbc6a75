"""Activation outliers (the paper's Table 5): the largest and the median magnitudes of the
attention logits and of the hidden states over a fixed token budget.

As the paper's authors describe it (microsoft/unilm issue 1666): attention logits are the
pre-softmax ``q k^T / sqrt(d)`` of every head, both maps ``q1 k1^T`` and ``q2 k2^T`` for DIFF,
taken in absolute value (here only the entries a query may attend to: the causal mask's
entries are left out); hidden states are the output of each layer (a block: attention and FFN
with their residuals). All layers are pooled."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .probe import attention_logits, capture_layers, check_tokens, for_analysis

KS = (1, 2, 3, 10, 100)


def top_magnitudes(values, ks: Sequence[int] = KS, mask=None) -> dict[str, float]:
    """``{"top-k": k-th largest |value|, ..., "median": median |value|}`` over every entry (where
    ``mask`` is True). ``top-k`` is NaN when there are fewer than k values."""
    mag = np.abs(np.asarray(values, np.float32))
    if mask is not None:
        mag = mag[np.broadcast_to(np.asarray(mask, bool), mag.shape)]
    mag = mag.ravel()
    out: dict[str, float] = {}
    kmax = min(max(ks), mag.size)
    top = -np.sort(-np.partition(mag, mag.size - kmax)[mag.size - kmax :]) if kmax else mag[:0]
    for k in ks:
        out[f"top-{k}"] = float(top[k - 1]) if k <= top.size else float("nan")
    out["median"] = float(np.median(mag)) if mag.size else float("nan")
    return out


@nnx.jit
def _activations(model, tokens):
    _, attn_in, outs = capture_layers(model, tokens)
    logits = []
    mask = None
    for block, h in zip(model.layers, attn_in):
        got = attention_logits(block.attn, h)
        mask = got["mask"]
        logits += [got[k] for k in ("logits", "logits1", "logits2") if k in got]
    stacked = jnp.stack(logits)  # [L * maps, B, H, T, S]
    if mask is not None:  # -1 marks the entries a query may not attend to
        stacked = jnp.where(mask[None, :, None], jnp.abs(stacked), -1.0)
    else:
        stacked = jnp.abs(stacked)
    return stacked, jnp.stack(outs)


def activation_outliers(
    model, tokens, *, batch_size: int = 4, ks: Sequence[int] = KS
) -> dict[str, dict[str, float]]:
    """Top-k and median magnitudes of ``model``'s attention logits and hidden states over the
    ``tokens`` ``[B, T]`` given (the token budget is ``B * T``)."""
    model = for_analysis(model)
    tokens = np.asarray(check_tokens(model, tokens))
    logit_mags, hidden = [], []
    for i in range(0, len(tokens), batch_size):
        lg, hs = _activations(model, jnp.asarray(tokens[i : i + batch_size], jnp.int32))
        lg = np.asarray(lg)
        logit_mags.append(lg[lg >= 0])
        hidden.append(np.abs(np.asarray(hs)).ravel())
    return {
        "attention logits": top_magnitudes(np.concatenate(logit_mags), ks),
        "hidden states": top_magnitudes(np.concatenate(hidden), ks),
    }
