"""The numpy oracle the tests compare against: the formulas written out independently of
diffjax (docs: shared/reference/diff-transformer.md), in float64.

Projections use torch layout weights (``W [out, in]``, ``y = x @ W.T``), rotary is interleaved
(GPT-J), softmax is in float64, and GQA reads kv head ``i // n_rep`` for query head ``i``.
Nothing here imports diffjax.
"""

from __future__ import annotations

import math

import numpy as np

THETA = 10000.0


def np_linear(x, w):
    """torch nn.Linear without bias: ``x @ W.T`` with ``W [out, in]``."""
    return x @ w.T


def np_rotary(x, positions, theta=THETA):
    """Interleaved rotary: pair ``(x[2j], x[2j+1])`` rotated by ``pos * theta^(-2j/d)``.

    x ``[B, T, H, d]``, positions ``[B, T]``; computed in float64.
    """
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    j = np.arange(d // 2, dtype=np.float64)
    angle = np.asarray(positions, np.float64)[..., None] * theta ** (-2.0 * j / d)  # [B,T,d/2]
    c, s = np.cos(angle)[:, :, None, :], np.sin(angle)[:, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def np_mask(t, s, causal, segment_ids=None, kv_segment_ids=None):
    """Boolean ``[B or 1, T, S]``: True where query i may attend key j."""
    mask = np.ones((1, t, s), bool)
    if causal:
        mask = mask & (np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t))[None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        kv = seg if kv_segment_ids is None else np.asarray(kv_segment_ids)
        mask = mask & (seg[:, :, None] == kv[:, None, :])
    return mask


def np_softmax_probs(q, k, scale, mask):
    """Softmax of ``q k^T * scale`` with masked entries excluded. q ``[B,T,D]``, k ``[B,S,D]``."""
    logits = np.einsum("btd,bsd->bts", q, k) * scale
    logits = np.where(mask, logits, -np.inf)
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


def np_attention(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None, scale=None):
    """Per-head loop; query head i reads kv head i // n_rep. Returns ``[B, T, Hq, Dv]``."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    n_rep = hq // hkv
    scale = d**-0.5 if scale is None else scale
    mask = np_mask(t, s, causal, segment_ids, kv_segment_ids)
    out = np.zeros((b, t, hq, v.shape[-1]))
    for i in range(hq):
        g = i // n_rep
        p = np_softmax_probs(q[:, :, i], k[:, :, g], scale, mask)
        out[:, :, i] = np.einsum("bts,bsd->btd", p, v[:, :, g])
    return out


def np_differential(q1, k1, q2, k2, v, lam, *, causal=True, segment_ids=None, scale=None):
    """``(A1 - lam A2) V`` per head, lam scalar or ``[B, T, Hq]``."""
    q1, k1, q2, k2, v = (np.asarray(a, np.float64) for a in (q1, k1, q2, k2, v))
    b, t, hq, d = q1.shape
    n_rep = hq // k1.shape[2]
    scale = d**-0.5 if scale is None else scale
    mask = np_mask(t, k1.shape[1], causal, segment_ids)
    lam = np.broadcast_to(np.asarray(lam, np.float64), (b, t, hq))
    out = np.zeros((b, t, hq, v.shape[-1]))
    for i in range(hq):
        g = i // n_rep
        a1 = np_softmax_probs(q1[:, :, i], k1[:, :, g], scale, mask)
        a2 = np_softmax_probs(q2[:, :, i], k2[:, :, g], scale, mask)
        a = a1 - lam[:, :, i, None] * a2
        out[:, :, i] = np.einsum("bts,bsd->btd", a, v[:, :, g])
    return out


def np_rmsnorm(x, w, eps=1e-5):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_lambda_init(depth):
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def np_standard_module(
    x, sd, num_heads, num_kv_heads, head_dim, positions=None, causal=True, segment_ids=None
):
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
    q = np_linear(x, sd["q_proj.weight"]).reshape(b, t, num_heads, head_dim)
    k = np_linear(x, sd["k_proj.weight"]).reshape(b, t, num_kv_heads, head_dim)
    v = np_linear(x, sd["v_proj.weight"]).reshape(b, t, num_kv_heads, head_dim)
    q, k = np_rotary(q, pos), np_rotary(k, pos)
    o = np_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    out_w = sd["out_proj.weight"] if "out_proj.weight" in sd else sd["o_proj.weight"]
    return np_linear(o.reshape(b, t, num_heads * head_dim), out_w)


def np_diff_v1_lambda(sd, lambda_init):
    return (
        np.exp(np.sum(sd["lambda_q1"].astype(np.float64) * sd["lambda_k1"]))
        - np.exp(np.sum(sd["lambda_q2"].astype(np.float64) * sd["lambda_k2"]))
        + lambda_init
    )


def np_diff_v1_module(
    x, sd, num_heads, num_kv_heads, depth, positions=None, causal=True, segment_ids=None
):
    """DIFF V1 with the pairing of multihead_flashdiff_1.py, written head by head."""
    x = np.asarray(x, np.float64)
    b, t, embed = x.shape
    h, hkv = num_heads, num_kv_heads
    n_rep = h // hkv
    d = embed // h // 2
    pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
    q = np_rotary(np_linear(x, sd["q_proj.weight"]).reshape(b, t, 2 * h, d), pos)
    k = np_rotary(np_linear(x, sd["k_proj.weight"]).reshape(b, t, 2 * hkv, d), pos)
    v = np_linear(x, sd["v_proj.weight"]).reshape(b, t, hkv, 2 * d)
    lambda_init = np_lambda_init(depth)
    lam = np_diff_v1_lambda(sd, lambda_init)
    mask = np_mask(t, t, causal, segment_ids)
    heads = []
    for i in range(h):
        g = i // n_rep
        a1 = np_softmax_probs(q[:, :, 2 * i], k[:, :, 2 * g], d**-0.5, mask)
        a2 = np_softmax_probs(q[:, :, 2 * i + 1], k[:, :, 2 * g + 1], d**-0.5, mask)
        o = np.einsum("bts,bsd->btd", a1 - lam * a2, v[:, :, g])  # [B, T, 2d]
        heads.append(np_rmsnorm(o, sd["subln.weight"]) * (1 - lambda_init))
    return np_linear(np.concatenate(heads, axis=-1), sd["out_proj.weight"])


def np_diff_v2_module(
    x, sd, num_heads, num_kv_heads, head_dim, positions=None, causal=True, segment_ids=None
):
    """DIFF V2 as the official forward: one attention over 2h q heads, then pairs (2i, 2i+1)."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, hkv, d = num_heads, num_kv_heads, head_dim
    pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else positions
    q = np_rotary(np_linear(x, sd["q_proj.weight"]).reshape(b, t, 2 * h, d), pos)
    k = np_rotary(np_linear(x, sd["k_proj.weight"]).reshape(b, t, hkv, d), pos)
    v = np_linear(x, sd["v_proj.weight"]).reshape(b, t, hkv, d)
    attn = np_attention(q, k, v, causal=causal, segment_ids=segment_ids)  # [B,T,2h,d]
    lam = 1.0 / (1.0 + np.exp(-np_linear(x, sd["lambda_proj.weight"])))  # [B,T,h]
    o = attn[:, :, 0::2] - lam[..., None] * attn[:, :, 1::2]
    return np_linear(o.reshape(b, t, h * d), sd["o_proj.weight"])


def np_silu(x):
    return x / (1.0 + np.exp(-x))


# ---------------------------------------------------------------------------- weights
# Random official-layout state dicts (torch layout, ``W [out, in]``) for the three modules.
def normal(rng, shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)


def standard_sd(rng, embed, num_heads, num_kv_heads, head_dim, std=0.1):
    return {
        "q_proj.weight": normal(rng, (num_heads * head_dim, embed), std),
        "k_proj.weight": normal(rng, (num_kv_heads * head_dim, embed), std),
        "v_proj.weight": normal(rng, (num_kv_heads * head_dim, embed), std),
        "out_proj.weight": normal(rng, (embed, num_heads * head_dim), std),
    }


def diff_v1_sd(rng, embed, num_heads, num_kv_heads, std=0.1):
    n_rep = num_heads // num_kv_heads
    d = embed // num_heads // 2
    sd = {
        "q_proj.weight": normal(rng, (embed, embed), std),
        "k_proj.weight": normal(rng, (embed // n_rep, embed), std),
        "v_proj.weight": normal(rng, (embed // n_rep, embed), std),
        "out_proj.weight": normal(rng, (embed, embed), std),
        "subln.weight": (1.0 + normal(rng, (2 * d,), 0.3)).astype(np.float32),
    }
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        sd[name] = normal(rng, (d,), 0.3)
    return sd


def diff_v2_sd(rng, embed, num_heads, num_kv_heads, head_dim, std=0.1):
    return {
        "q_proj.weight": normal(rng, (2 * num_heads * head_dim, embed), std),
        "k_proj.weight": normal(rng, (num_kv_heads * head_dim, embed), std),
        "v_proj.weight": normal(rng, (num_kv_heads * head_dim, embed), std),
        "o_proj.weight": normal(rng, (embed, num_heads * head_dim), std),
        "lambda_proj.weight": normal(rng, (num_heads, embed), 0.2),
    }
