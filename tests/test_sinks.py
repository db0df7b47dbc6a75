"""Attention sinks and massive activations (diffjax.evaluate.sinks) against numpy: the maps
from each layer's projections with numpy's softmax (DIFF: A1 - lambda A2), the block outputs
by calling the blocks one after the other, on windows that hold a document start."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import ModelConfig, TransformerLM
from diffjax.evaluate.sinks import Sinks, sinks

B, T = 2, 12


def _softmax_maps(q, k, positions, segments, scale):
    """``[B, H, T, S]`` causal softmax maps within each segment, in numpy (kv heads repeated)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    t = np.arange(q.shape[1])
    allowed = (t[None, :, None] >= t[None, None, :]) & (
        segments[:, :, None] == segments[:, None, :]
    )
    logits = np.where(allowed[:, None], logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("attention", ["standard", "diff_v1", "diff_v2"])
def test_sinks_match_numpy(attention):
    cfg = ModelConfig(
        vocab_size=61,
        d_model=32,
        num_layers=2,
        num_heads=4 if attention == "standard" else 2,
        attention=attention,
        max_seq_len=16,
        attention_impl="xla",
        gate="headwise" if attention == "diff_v2" else "none",
    )
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 61, (B, T)).astype(np.int32)
    # row 0: one document from before the window, a new one from token 5; row 1: one document
    # starting at token 0, another at token 8
    positions = np.array([[*range(3, 8), *range(7)], [*range(8), *range(4)]], np.int32)
    segments = np.array([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4], np.int32)
    got = sinks(model, tokens, masks={"positions": positions, "segment_ids": segments})

    x = model.embed(jnp.asarray(tokens))
    first, doc, massive = [], [], []
    for block in model.layers:
        h = block.attn_norm(x)
        p = block.attn.project(h, jnp.asarray(positions))
        scale = block.attn.scale
        w = _softmax_maps(p.q, p.k, positions, segments, scale)
        if p.q2 is not None:
            k2 = p.k if p.k2 is None else p.k2
            lam = np.asarray(p.lam, np.float64)
            lam = lam if lam.ndim == 0 else np.transpose(lam, (0, 2, 1))[..., None]
            w = w - lam * _softmax_maps(p.q2, k2, positions, segments, scale)
        first.append(w[:, :, 1:, 0].mean())
        masses = [
            w[b, :, t, t - positions[b, t]]
            for b in range(B)
            for t in range(T)
            if positions[b, t] > 0 and t - positions[b, t] >= 0
        ]
        doc.append(np.concatenate(masses).mean())
        x = block(x, jnp.asarray(positions), jnp.asarray(segments))
        mag = np.abs(np.asarray(x, np.float64))
        massive.append(mag.max() / np.median(mag))
    np.testing.assert_allclose(got.first_token, first, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got.document_start, doc, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got.massive, massive, rtol=1e-4)
    assert got.tokens == B * T and Sinks.from_dict(got.to_dict()) == got


def test_without_documents_there_is_no_document_start_mass():
    cfg = ModelConfig(vocab_size=61, d_model=32, num_layers=1, num_heads=2, max_seq_len=16)
    model = TransformerLM(cfg, rngs=nnx.Rngs(1))
    got = sinks(model, np.zeros((3, 8), np.int32), batch_size=2)
    assert got.document_start is None and len(got.first_token) == 1
    assert np.isfinite(got.massive).all() and got.massive[0] >= 1.0
