"""Attention-level tests: the three modules and the pure ops against an independent numpy
implementation of the formulas (docs: shared/reference/diff-transformer.md), plus causality,
segment isolation, rotary properties, lambda, parameter counts and error messages.

The numpy reference (tests/oracle.py) does not call diffjax: projections use torch layout
weights (``W [out, in]``, ``y = x @ W.T``), rotary is interleaved (GPT-J) in float64, softmax is
in float64, and GQA reads kv head ``i // n_rep`` for query head ``i``.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import ops
from diffjax.kernels import reference
from oracle import (
    diff_v1_sd,
    diff_v2_sd,
    normal,
    THETA,
    np_attention,
    np_diff_v1_lambda,
    np_diff_v1_module,
    np_diff_v2_module,
    np_differential,
    np_lambda_init,
    np_linear,
    np_mask,
    np_rmsnorm,
    np_rotary,
    np_softmax_probs,
    np_standard_module,
    standard_sd,
)

TOL = 1e-5


# ============================================================================ helpers
# Weights are loaded from a state dict in nearly every test, so build with a cheap zero init
# (random init is eager and compiles per shape; it is tested where it matters).
ZEROS = nnx.initializers.zeros_init()


@nnx.jit
def _apply(module, x, positions, segment_ids):
    return module(x, positions, segment_ids)


def apply(module, x, positions=None, segment_ids=None):
    """``module(x, positions, segment_ids)`` under ``nnx.jit`` (one compile per shape, fast)."""
    as_j = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
    return _apply(module, jnp.asarray(x), as_j(positions), as_j(segment_ids))


def make_standard(embed, heads, kv_heads, head_dim=None, seed=0, **kw):
    kw.setdefault("kernel_init", ZEROS)
    return diffjax.MultiheadAttention(
        embed, 0, heads, kv_heads, head_dim=head_dim, rngs=nnx.Rngs(seed), **kw
    )


def make_v1(embed, heads, kv_heads, depth=0, seed=0, **kw):
    kw.setdefault("kernel_init", ZEROS)
    return diffjax.MultiheadDiffAttn(embed, depth, heads, kv_heads, rngs=nnx.Rngs(seed), **kw)


def make_v2(embed, heads, kv_heads, head_dim, seed=0, **kw):
    kw.setdefault("kernel_init", ZEROS)
    return diffjax.MultiheadDiffAttnV2(
        embed, 0, heads, kv_heads, head_dim=head_dim, rngs=nnx.Rngs(seed), **kw
    )


def rand_x(rng, b, t, embed):
    return rng.standard_normal((b, t, embed)).astype(np.float32)


def assert_close(actual, expected, tol=TOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=tol, rtol=tol)


def n_params(module) -> int:
    return sum(
        math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(nnx.state(module, nnx.Param))
    )


# ============================================================================ 1. vs numpy: modules
STANDARD_CASES = [  # (embed, heads, kv_heads): MHA, GQA n_rep 2, GQA n_rep 4, MQA
    pytest.param(64, 8, 8, id="mha"),
    pytest.param(64, 8, 4, id="gqa2"),
    pytest.param(64, 8, 2, id="gqa4"),
    pytest.param(64, 8, 1, id="mqa"),
]


@pytest.mark.parametrize("embed,heads,kv_heads", STANDARD_CASES)
def test_standard_module_matches_numpy(embed, heads, kv_heads):
    rng = np.random.default_rng(1)
    d = embed // heads
    sd = standard_sd(rng, embed, heads, kv_heads, d)
    m = diffjax.load_unilm_state_dict(make_standard(embed, heads, kv_heads), sd)
    x = rand_x(rng, 2, 12, embed)
    out = apply(m, x)
    chex.assert_shape(out, (2, 12, embed))
    chex.assert_type(out, jnp.float32)
    assert_close(out, np_standard_module(x, sd, heads, kv_heads, d))


def test_standard_module_head_dim_override_matches_numpy():
    """``head_dim=`` (the V2 twin): widths not equal to embed / heads."""
    rng = np.random.default_rng(2)
    embed, heads, kv_heads, d = 48, 4, 2, 16
    sd = standard_sd(rng, embed, heads, kv_heads, d)
    m = diffjax.load_unilm_state_dict(make_standard(embed, heads, kv_heads, head_dim=d), sd)
    x = rand_x(rng, 2, 10, embed)
    assert_close(apply(m, x), np_standard_module(x, sd, heads, kv_heads, d))


V1_CASES = [  # (embed, h, h_kv, depth): MHA, GQA n_rep 2, GQA n_rep 4
    pytest.param(128, 4, 4, 0, id="mha-depth0"),
    pytest.param(128, 4, 2, 5, id="gqa2-depth5"),
    pytest.param(128, 4, 1, 11, id="gqa4-depth11"),
]


@pytest.mark.parametrize("embed,heads,kv_heads,depth", V1_CASES)
def test_diff_v1_module_matches_numpy(embed, heads, kv_heads, depth):
    rng = np.random.default_rng(3 + depth)
    sd = diff_v1_sd(rng, embed, heads, kv_heads)
    m = diffjax.load_unilm_state_dict(make_v1(embed, heads, kv_heads, depth=depth), sd)
    # the reference lambda is far from lambda_init and the norm weight is not all ones
    lam = np_diff_v1_lambda(sd, np_lambda_init(depth))
    assert abs(lam - np_lambda_init(depth)) > 1e-2
    x = rand_x(rng, 2, 12, embed)
    out = apply(m, x)
    chex.assert_shape(out, (2, 12, embed))
    assert_close(out, np_diff_v1_module(x, sd, heads, kv_heads, depth))


def np_diff_v1_naive_module(x, sd, num_heads, num_kv_heads, depth):
    """multihead_diffattn.py: repeat the 2h_kv raw key heads n_rep times, then pair (2i, 2i+1)."""
    x = np.asarray(x, np.float64)
    b, t, embed = x.shape
    h, hkv = num_heads, num_kv_heads
    n_rep = h // hkv
    d = embed // h // 2
    pos = np.broadcast_to(np.arange(t), (b, t))
    q = np_rotary(np_linear(x, sd["q_proj.weight"]).reshape(b, t, 2 * h, d), pos)
    k = np_rotary(np_linear(x, sd["k_proj.weight"]).reshape(b, t, 2 * hkv, d), pos)
    v = np_linear(x, sd["v_proj.weight"]).reshape(b, t, hkv, 2 * d)
    k, v = np.repeat(k, n_rep, axis=2), np.repeat(v, n_rep, axis=2)  # repeat_kv
    lambda_init = np_lambda_init(depth)
    lam = np_diff_v1_lambda(sd, lambda_init)
    mask = np_mask(t, t, True)
    heads = []
    for i in range(h):
        a1 = np_softmax_probs(q[:, :, 2 * i], k[:, :, 2 * i], d**-0.5, mask)
        a2 = np_softmax_probs(q[:, :, 2 * i + 1], k[:, :, 2 * i + 1], d**-0.5, mask)
        o = np.einsum("bts,bsd->btd", a1 - lam * a2, v[:, :, i])
        heads.append(np_rmsnorm(o, sd["subln.weight"]) * (1 - lambda_init))
    return np_linear(np.concatenate(heads, axis=-1), sd["out_proj.weight"])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_diff_v1_pairing_is_flash1_not_naive(kv_heads):
    """n_rep = 1: the naive file and flash_1 agree. n_rep = 2: the naive file pairs Q1 and Q2
    with the same key head; diffjax must follow flash_1 (and differ visibly from naive)."""
    rng = np.random.default_rng(4)
    embed, h = 64, 4
    sd = diff_v1_sd(rng, embed, h, kv_heads)
    m = diffjax.load_unilm_state_dict(make_v1(embed, h, kv_heads), sd)
    x = rand_x(rng, 1, 8, embed)
    out = np.asarray(apply(m, x), np.float64)
    naive = np_diff_v1_naive_module(x, sd, h, kv_heads, 0)
    if kv_heads == h:
        assert_close(out, naive)
    else:
        assert np.abs(out - naive).max() > 1e-3
        assert_close(out, np_diff_v1_module(x, sd, h, kv_heads, 0))


V2_CASES = [  # (embed, h, h_kv, d)
    pytest.param(64, 4, 4, 16, id="mha"),
    pytest.param(64, 4, 2, 16, id="gqa2"),
    pytest.param(64, 4, 1, 8, id="gqa4-narrow"),
]


@pytest.mark.parametrize("embed,heads,kv_heads,head_dim", V2_CASES)
def test_diff_v2_module_matches_numpy(embed, heads, kv_heads, head_dim):
    rng = np.random.default_rng(5)
    sd = diff_v2_sd(rng, embed, heads, kv_heads, head_dim)
    m = diffjax.load_unilm_state_dict(make_v2(embed, heads, kv_heads, head_dim), sd)
    x = rand_x(rng, 2, 12, embed)
    out = apply(m, x)
    chex.assert_shape(out, (2, 12, embed))
    chex.assert_type(out, jnp.float32)
    assert_close(out, np_diff_v2_module(x, sd, heads, kv_heads, head_dim))


# ============================================================================ 1. vs numpy: ops
def _jit(fn, **static):
    """``fn`` with ``static`` keyword options fixed, under ``jax.jit`` (one compile per shape)."""
    return jax.jit(functools.partial(fn, **static))


def _qkv(rng, b, t, s, hq, hkv, d, dv):
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, dv)).astype(np.float32)
    return q, k, v


SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]], np.int32)


@pytest.mark.parametrize(
    "causal,use_seg,hq,hkv",
    [  # a covering subset of the full grid
        (True, False, 4, 4),
        (True, True, 4, 2),
        (False, True, 4, 1),
        (False, False, 4, 2),
        (True, True, 4, 1),
        (False, True, 4, 4),
    ],
)
def test_dot_product_attention_matches_numpy(causal, use_seg, hq, hkv):
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, 2, 10, 10, hq, hkv, 8, 8)
    seg = SEG if use_seg else None
    out = _jit(ops.dot_product_attention, causal=causal, impl="xla")(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        segment_ids=None if seg is None else jnp.asarray(seg),
    )
    chex.assert_shape(out, (2, 10, hq, 8))
    assert_close(out, np_attention(q, k, v, causal=causal, segment_ids=seg))


def test_dot_product_attention_scale_dv_and_kv_longer_than_q():
    """Dv != D, a custom scale, and S > T with the causal diagonal aligned at the end."""
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 2, 4, 9, 4, 2, 8, 12)
    out = _jit(ops.dot_product_attention, scale=0.2)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert_close(out, np_attention(q, k, v, scale=0.2))
    qseg = np.array([[0, 1, 1, 1], [0, 0, 0, 0]], np.int32)
    kseg = np.array([[0, 0, 0, 0, 0, 0, 1, 1, 1], [0] * 9], np.int32)
    out = _jit(ops.dot_product_attention)(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        segment_ids=jnp.asarray(qseg),
        kv_segment_ids=jnp.asarray(kseg),
    )
    assert_close(out, np_attention(q, k, v, segment_ids=qseg, kv_segment_ids=kseg))


@pytest.mark.parametrize(
    "causal,use_seg,lam_kind,dv_mult,hq,hkv",
    [  # pairwise covering
        (True, False, "scalar", 2, 4, 2),
        (True, True, "per_token", 1, 4, 4),
        (False, True, "scalar", 1, 4, 2),
        (False, False, "per_token", 2, 4, 1),
        (True, True, "per_token", 2, 4, 2),
        (False, True, "scalar", 2, 4, 4),
        (True, False, "scalar", 1, 4, 1),
        (False, True, "per_token", 1, 4, 2),
    ],
)
def test_differential_attention_matches_numpy(causal, use_seg, lam_kind, dv_mult, hq, hkv):
    rng = np.random.default_rng(12)
    b, t, d = 2, 10, 8
    q1, k1, v = _qkv(rng, b, t, t, hq, hkv, d, d * dv_mult)
    q2, k2, _ = _qkv(rng, b, t, t, hq, hkv, d, d)
    if lam_kind == "scalar":
        lam = np.float32(0.63)
    else:
        lam = rng.uniform(0.05, 0.95, (b, t, hq)).astype(np.float32)
    seg = SEG if use_seg else None
    out = _jit(ops.differential_attention, causal=causal, impl="xla")(
        *(jnp.asarray(a) for a in (q1, k1, q2, k2, v)),
        jnp.asarray(lam),
        segment_ids=None if seg is None else jnp.asarray(seg),
    )
    chex.assert_shape(out, (b, t, hq, d * dv_mult))
    chex.assert_type(out, jnp.float32)
    assert_close(out, np_differential(q1, k1, q2, k2, v, lam, causal=causal, segment_ids=seg))


def test_differential_attention_python_float_lambda_and_zero_lambda():
    rng = np.random.default_rng(13)
    q1, k1, v = _qkv(rng, 1, 6, 6, 2, 2, 8, 16)
    q2, k2, _ = _qkv(rng, 1, 6, 6, 2, 2, 8, 8)
    args = [jnp.asarray(a) for a in (q1, k1, q2, k2, v)]
    fn = _jit(ops.differential_attention)
    assert_close(fn(*args, 1.3), np_differential(q1, k1, q2, k2, v, 1.3))
    # lam = 0 reduces to standard attention with (q1, k1)
    assert_close(fn(*args, 0.0), np_attention(q1, k1, v))


def test_differential_attention_per_token_lambda_is_per_token():
    """Changing lam at one (token, head) only changes that (token, head) output."""
    rng = np.random.default_rng(14)
    q1, k1, v = _qkv(rng, 1, 6, 6, 4, 2, 8, 8)
    q2, k2, _ = _qkv(rng, 1, 6, 6, 4, 2, 8, 8)
    args = [jnp.asarray(a) for a in (q1, k1, q2, k2, v)]
    lam = np.full((1, 6, 4), 0.5, np.float32)
    fn = _jit(ops.differential_attention)
    a = np.asarray(fn(*args, jnp.asarray(lam)))
    lam[0, 3, 2] = 0.9
    bb = np.asarray(fn(*args, jnp.asarray(lam)))
    diff = np.abs(a - bb).max(-1)
    assert diff[0, 3, 2] > 1e-3
    diff[0, 3, 2] = 0
    assert diff.max() == 0


# ======================================================================= 2. causality, segments
# Three modules (embed 64, GQA) with random non-trivial weights, shared by the tests below so
# that they also share compiled programs: kind -> (build(causal), make state dict, numpy ref).
SHARED = {
    "standard": (
        lambda causal: make_standard(64, 8, 2, causal=causal),
        lambda rng: standard_sd(rng, 64, 8, 2, 8),
        lambda x, sd, **kw: np_standard_module(x, sd, 8, 2, 8, **kw),
    ),
    "v1": (
        lambda causal: make_v1(64, 4, 2, depth=2, causal=causal),
        lambda rng: diff_v1_sd(rng, 64, 4, 2),
        lambda x, sd, **kw: np_diff_v1_module(x, sd, 4, 2, 2, **kw),
    ),
    "v2": (
        lambda causal: make_v2(64, 4, 2, 16, causal=causal),
        lambda rng: diff_v2_sd(rng, 64, 4, 2, 16),
        lambda x, sd, **kw: np_diff_v2_module(x, sd, 4, 2, 16, **kw),
    ),
}


def _three_modules(causal=True):
    """kind -> (module, its state dict)."""
    rng = np.random.default_rng(20)
    out = {}
    for kind, (build, make_sd, _) in SHARED.items():
        sd = make_sd(rng)
        out[kind] = (diffjax.load_unilm_state_dict(build(causal), sd), sd)
    return out


@pytest.fixture(scope="module")
def three_modules():
    return _three_modules()


@pytest.fixture(scope="module")
def three_bidirectional_modules():
    return _three_modules(causal=False)


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_modules_match_numpy_with_explicit_positions_and_segments(three_modules, kind):
    m, sd = three_modules[kind]
    rng = np.random.default_rng(6)
    seg = np.array([[0] * 6 + [1] * 6 + [2] * 4, [0] * 10 + [1] * 6], np.int32)
    pos = np.array(
        [list(range(6)) + list(range(6)) + list(range(4)), list(range(3, 13)) + list(range(6))],
        np.int32,
    )
    x = rand_x(rng, 2, 16, 64)
    assert_close(
        apply(m, x, positions=pos, segment_ids=seg),
        SHARED[kind][2](x, sd, positions=pos, segment_ids=seg),
    )


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_modules_match_numpy_non_causal(three_bidirectional_modules, kind):
    m, sd = three_bidirectional_modules[kind]
    x = rand_x(np.random.default_rng(7), 2, 16, 64)
    assert_close(apply(m, x), SHARED[kind][2](x, sd, causal=False))


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_causality(three_modules, kind):
    m, _ = three_modules[kind]
    rng = np.random.default_rng(21)
    x = rand_x(rng, 2, 16, 64)
    base = np.asarray(apply(m, x))
    for t0 in (0, 7, 15):
        x2 = x.copy()
        x2[:, t0:] += rng.standard_normal(x2[:, t0:].shape).astype(np.float32)
        out = np.asarray(apply(m, x2))
        np.testing.assert_allclose(out[:, :t0], base[:, :t0], atol=1e-6, rtol=0)
        assert np.abs(out[:, t0:] - base[:, t0:]).max() > 1e-3  # the change is visible


SEGMENTS = [(0, 6), (6, 12), (12, 16)]  # [start, end) of three packed segments in T = 16


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_segment_isolation(three_modules, three_bidirectional_modules, kind, causal):
    rng = np.random.default_rng(23)
    m, _ = (three_modules if causal else three_bidirectional_modules)[kind]
    seg = np.concatenate([np.full(e - s, i) for i, (s, e) in enumerate(SEGMENTS)])[None]
    seg = jnp.asarray(np.repeat(seg, 2, 0).astype(np.int32))
    x = rand_x(rng, 2, 16, 64)
    base = np.asarray(apply(m, x, segment_ids=seg))
    s, e = SEGMENTS[1]
    x2 = x.copy()
    x2[:, s:e] += rng.standard_normal(x2[:, s:e].shape).astype(np.float32)
    out = np.asarray(apply(m, x2, segment_ids=seg))
    np.testing.assert_allclose(out[:, :s], base[:, :s], atol=1e-6, rtol=0)
    np.testing.assert_allclose(out[:, e:], base[:, e:], atol=1e-6, rtol=0)
    assert np.abs(out[:, s:e] - base[:, s:e]).max() > 1e-3
    # without segment ids the other segments do see the change (the mask is what isolates)
    if not causal:
        free = np.asarray(apply(m, x2))
        assert np.abs(free[:, :s] - np.asarray(apply(m, x))[:, :s]).max() > 1e-4


@pytest.mark.parametrize("restart_positions", [False, True])
@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_packed_segment_equals_segment_alone(three_modules, kind, restart_positions):
    m, _ = three_modules[kind]
    rng = np.random.default_rng(24)
    x = rand_x(rng, 2, 16, 64)
    seg = np.concatenate([np.full(e - s, i) for i, (s, e) in enumerate(SEGMENTS)])
    seg = jnp.asarray(np.broadcast_to(seg, (2, 16)).astype(np.int32))
    if restart_positions:
        pos = np.concatenate([np.arange(e - s) for s, e in SEGMENTS])
    else:
        pos = np.arange(16)
    packed = np.asarray(apply(m, x, positions=np.broadcast_to(pos, (2, 16)), segment_ids=seg))
    for s, e in SEGMENTS:
        alone = np.asarray(apply(m, x[:, s:e]))  # positions 0..len-1
        np.testing.assert_allclose(packed[:, s:e], alone, atol=TOL, rtol=TOL)


# ============================================================================ 2. rotary
@jax.jit
def _rot_jit(x, positions):
    cos, sin = diffjax.rotary_angles(positions, x.shape[-1], THETA)
    return diffjax.apply_rotary(x, cos, sin)


def _rot(x, positions):
    """diffjax rotary of x [B, T, H, d] at positions [B, T]."""
    return np.asarray(_rot_jit(jnp.asarray(x), jnp.asarray(positions)), np.float64)


def test_rotary_matches_numpy_interleaved():
    rng = np.random.default_rng(30)
    x = rng.standard_normal((2, 16, 3, 32)).astype(np.float32)
    pos = np.stack([np.arange(16), np.arange(16) * 3 + 5])
    assert_close(_rot(x, pos), np_rotary(x, pos))
    # interleaved, not half-split: channel 0 pairs with channel 1 (position 1, frequency 1)
    e0 = np.zeros((1, 1, 1, 8), np.float32)
    e0[..., 0] = 1.0
    r = _rot(e0, np.array([[1]]))[0, 0, 0]
    np.testing.assert_allclose(r[:2], [math.cos(1.0), math.sin(1.0)], atol=1e-6)
    np.testing.assert_allclose(r[2:], 0, atol=1e-7)


def test_rotary_angles_formula():
    pos = np.arange(12)
    cos, sin = diffjax.rotary_angles(jnp.asarray(pos), 16, THETA)
    chex.assert_shape(cos, (12, 8))
    ang = pos[:, None] * THETA ** (-2.0 * np.arange(8) / 16)
    assert_close(cos, np.cos(ang))
    assert_close(sin, np.sin(ang))


def test_rotary_dot_product_depends_only_on_offset():
    rng = np.random.default_rng(31)
    d, n = 32, 24
    q = rng.standard_normal((1, n, 1, d))
    k = rng.standard_normal((1, n, 1, d))
    q = (q / np.linalg.norm(q, axis=-1, keepdims=True)).astype(np.float32)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    m_pos = rng.integers(0, 40, n)[None]
    n_pos = rng.integers(0, 40, n)[None]
    dots = np.sum(_rot(q, m_pos) * _rot(k, n_pos), -1)
    for shift in (1, 17, 60):
        shifted = np.sum(_rot(q, m_pos + shift) * _rot(k, n_pos + shift), -1)
        np.testing.assert_allclose(shifted, dots, atol=TOL)
    # the same offset m - n from a different origin: (m - n, 0)
    origin = np.sum(_rot(q, m_pos - n_pos + 40) * _rot(k, np.zeros_like(n_pos) + 40), -1)
    np.testing.assert_allclose(origin, dots, atol=TOL)
    # and the dot product does depend on the offset (rotary is not the identity)
    other = np.sum(_rot(q, m_pos + 3) * _rot(k, n_pos), -1)
    assert np.abs(other - dots).max() > 1e-2


def test_rotary_preserves_norm():
    rng = np.random.default_rng(32)
    x = rng.standard_normal((2, 16, 4, 32)).astype(np.float32)
    pos = rng.integers(0, 2048, (2, 16))
    np.testing.assert_allclose(
        np.linalg.norm(_rot(x, pos), axis=-1),
        np.linalg.norm(x.astype(np.float64), axis=-1),
        rtol=TOL,
    )


# ============================================================================ 3. lambda
@pytest.mark.parametrize("depth", range(12))
def test_lambda_init_schedule(depth):
    expected = 0.8 - 0.6 * math.exp(-0.3 * depth)
    assert diffjax.lambda_init_fn(depth) == pytest.approx(expected, abs=1e-12)
    m = diffjax.MultiheadDiffAttn(32, depth, 2, rngs=nnx.Rngs(0))
    # float32 variables, each rounded once from the float64 schedule (as the official code's
    # Python float is when it meets a tensor)
    assert m.lambda_init[...] == np.float32(expected)
    assert m.output_scale[...] == np.float32(1.0 - expected)


def test_lambda_init_override():
    m = diffjax.MultiheadDiffAttn(32, 7, 2, lambda_init=0.5, rngs=nnx.Rngs(0))
    assert m.lambda_init[...] == 0.5 and m.output_scale[...] == 0.5


def test_lambda_full_matches_numpy():
    rng = np.random.default_rng(40)
    sd = diff_v1_sd(rng, 64, 2, 2)
    m = diffjax.load_unilm_state_dict(make_v1(64, 2, 2, depth=4), sd)
    lam = m.lambda_full()
    chex.assert_shape(lam, ())
    chex.assert_type(lam, jnp.float32)
    expected = np_diff_v1_lambda(sd, np_lambda_init(4))
    assert abs(float(lam) - expected) < TOL
    assert abs(expected - np_lambda_init(4)) > 1e-2  # non-trivial vectors


def test_lambda_params_float32_under_bfloat16():
    m = diffjax.MultiheadDiffAttn(
        64, 0, 2, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, kernel_init=ZEROS, rngs=nnx.Rngs(0)
    )
    d = 64 // 2 // 2
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        p = getattr(m, name)[...]
        chex.assert_shape(p, (d,))
        chex.assert_type(p, jnp.float32)
    assert m.q_proj.kernel[...].dtype == jnp.bfloat16  # param_dtype is honoured elsewhere
    chex.assert_type(m.lambda_full(), jnp.float32)
    out = apply(m, jnp.ones((1, 4, 64), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def test_lambda_params_init_statistics():
    """N(0, 0.1^2): pool the four vectors over several seeds (d = 128)."""
    samples = []
    for seed in range(4):
        m = diffjax.MultiheadDiffAttn(256, 0, 1, rngs=nnx.Rngs(seed))
        vecs = [
            np.asarray(getattr(m, n)[...])
            for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
        ]
        assert all(v.shape == (128,) for v in vecs)
        # the four vectors are independent draws
        assert not np.allclose(vecs[0], vecs[1]) and not np.allclose(vecs[2], vecs[3])
        samples.append(np.concatenate(vecs))
    assert not np.allclose(samples[0], samples[1])  # and differ across seeds
    allv = np.concatenate(samples)  # 2048 samples: std error of the std ~ 0.0016
    assert abs(allv.std() - 0.1) < 0.01
    assert abs(allv.mean()) < 0.01


def test_v2_lambda_values():
    rng = np.random.default_rng(41)
    sd = diff_v2_sd(rng, 64, 4, 2, 16)
    sd["lambda_proj.weight"] = normal(rng, (4, 64), 0.3)  # logits of std ~2.4
    m = diffjax.load_unilm_state_dict(make_v2(64, 4, 2, 16), sd)
    x = rand_x(rng, 2, 12, 64)
    lam = m.lambda_values(jnp.asarray(x))
    chex.assert_shape(lam, (2, 12, 4))
    chex.assert_type(lam, jnp.float32)
    lam = np.asarray(lam)
    assert np.all(lam > 0) and np.all(lam < 1)
    expected = 1 / (1 + np.exp(-(x.astype(np.float64) @ sd["lambda_proj.weight"].T)))
    assert_close(lam, expected)
    assert lam.std() > 0.1  # varies per token and head


def test_v2_lambda_float32_under_bfloat16_activations():
    m = make_v2(64, 4, 2, 16, dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(42).standard_normal((1, 4, 64)), jnp.bfloat16)
    chex.assert_type(m.lambda_values(x), jnp.float32)
    assert apply(m, x).dtype == jnp.bfloat16


# ============================================================================ 4. parameter counts
@pytest.mark.parametrize("diff_kv,std_heads,std_kv", [(None, 16, None), (4, 16, 8)])
def test_v1_param_count_matches_official_example(diff_kv, std_heads, std_kv):
    """multihead_diffattn example.py: DIFF 8 heads vs standard 16 heads (MHA); 8/4 vs 16/8."""
    embed = 1024
    d = embed // 8 // 2
    diff = nnx.eval_shape(lambda: diffjax.MultiheadDiffAttn(embed, 0, 8, diff_kv, rngs=nnx.Rngs(0)))
    std = nnx.eval_shape(
        lambda: diffjax.MultiheadAttention(embed, 0, std_heads, std_kv, rngs=nnx.Rngs(0))
    )
    assert n_params(diff) == n_params(std) + 4 * d + 2 * d
    # the exact official numbers
    kv_frac = 1 if diff_kv is None else 2
    expected_std = 2 * embed * embed + 2 * embed * embed // kv_frac
    assert n_params(std) == expected_std
    assert n_params(diff) == expected_std + 6 * d


def test_v1_param_count_without_norm():
    diff = nnx.eval_shape(
        lambda: diffjax.MultiheadDiffAttn(128, 0, 4, 2, norm=False, rngs=nnx.Rngs(0))
    )
    std = nnx.eval_shape(lambda: diffjax.MultiheadAttention(128, 0, 8, 4, rngs=nnx.Rngs(0)))
    assert n_params(diff) == n_params(std) + 4 * 16


@pytest.mark.parametrize("embed,h,hkv,d", [(1024, 8, 8, 128), (1024, 8, 4, 128), (96, 4, 2, 16)])
def test_v2_param_count(embed, h, hkv, d):
    v2 = nnx.eval_shape(
        lambda: diffjax.MultiheadDiffAttnV2(embed, 0, h, hkv, head_dim=d, rngs=nnx.Rngs(0))
    )
    std = nnx.eval_shape(
        lambda: diffjax.MultiheadAttention(embed, 0, h, hkv, head_dim=d, rngs=nnx.Rngs(0))
    )
    assert n_params(std) == 2 * embed * h * d + 2 * embed * hkv * d
    assert n_params(v2) == n_params(std) + embed * h * d + embed * h


# ============================================================================ 6. errors
def _arr(*shape):
    return jnp.zeros(shape, jnp.float32)


@pytest.mark.parametrize(
    "args,match",
    [
        (
            (_arr(2, 8, 16), _arr(2, 8, 2, 16), _arr(2, 8, 2, 16)),
            r"q must be \[batch, seq, heads, dim\]",
        ),
        (
            (_arr(2, 8, 4, 16), _arr(2, 8, 16), _arr(2, 8, 2, 16)),
            r"k must be \[batch, seq, heads, dim\]",
        ),
        ((_arr(2, 8, 6, 16), _arr(2, 8, 4, 16), _arr(2, 8, 4, 16)), r"4 kv heads do not divide 6"),
        ((_arr(2, 8, 4, 16), _arr(2, 8, 2, 8), _arr(2, 8, 2, 16)), r"head dims differ"),
        ((_arr(2, 8, 4, 16), _arr(3, 8, 2, 16), _arr(3, 8, 2, 16)), r"batch sizes differ"),
        ((_arr(2, 8, 4, 16), _arr(2, 8, 2, 16), _arr(2, 7, 2, 16)), r"v must be"),
    ],
)
def test_dot_product_attention_shape_errors(args, match):
    with pytest.raises(ValueError, match=match):
        ops.dot_product_attention(*args)


def test_segment_ids_shape_errors():
    q, k, v = _arr(2, 8, 4, 16), _arr(2, 8, 2, 16), _arr(2, 8, 2, 16)
    with pytest.raises(ValueError, match=r"segment_ids must be \[batch, seq\] = \[2, 8\]"):
        ops.dot_product_attention(q, k, v, segment_ids=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids must be"):
        ops.dot_product_attention(q, k, v, segment_ids=jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match=r"kv_segment_ids given without segment_ids"):
        ops.dot_product_attention(q, k, v, kv_segment_ids=jnp.zeros((2, 8), jnp.int32))
    k2, v2 = _arr(2, 10, 2, 16), _arr(2, 10, 2, 16)
    with pytest.raises(ValueError, match=r"pass kv_segment_ids"):
        ops.dot_product_attention(q, k2, v2, segment_ids=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids must be"):
        ops.differential_attention(q, k, q, k, v, 0.5, segment_ids=jnp.zeros((2, 9), jnp.int32))


def test_differential_attention_shape_errors():
    q, k, v = _arr(2, 8, 4, 16), _arr(2, 8, 2, 16), _arr(2, 8, 2, 32)
    with pytest.raises(
        ValueError, match=r"lam must be a scalar or \[batch, seq, heads\] = \[2, 8, 4\]"
    ):
        ops.differential_attention(q, k, q, k, v, jnp.zeros((2, 8)))
    with pytest.raises(ValueError, match=r"lam must be"):
        ops.differential_attention(q, k, q, k, v, jnp.zeros((2, 8, 2)))
    with pytest.raises(ValueError, match=r"q1 and q2 must have the same shape"):
        ops.differential_attention(q, k, _arr(2, 8, 2, 16), k, v, 0.5)
    with pytest.raises(ValueError, match=r"k1 and k2 must have the same shape"):
        ops.differential_attention(q, k, q, _arr(2, 8, 1, 16), v, 0.5)
    with pytest.raises(ValueError, match=r"2 kv heads do not divide 3"):
        ops.differential_attention(_arr(2, 8, 3, 16), k, _arr(2, 8, 3, 16), k, v, 0.5)
    with pytest.raises(ValueError, match=r"q1 must be \[batch, seq, heads, dim\]"):
        ops.differential_attention(_arr(8, 4, 16), k, _arr(8, 4, 16), k, v, 0.5)


def test_unknown_impl_error():
    q = _arr(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"unknown attention impl 'nope'"):
        ops.dot_product_attention(q, q, q, impl="nope")


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_modules_reject_wrong_input(three_modules, kind):
    m, _ = three_modules[kind]
    with pytest.raises(ValueError, match=r"expects x of shape \[batch, seq, 64\]"):
        m(jnp.zeros((2, 8, 32)))
    with pytest.raises(ValueError, match=r"expects x of shape"):
        m(jnp.zeros((8, 64)))
    # (traced under jit: the checks run before any compute, and inside jit as well)
    with pytest.raises(ValueError, match=r"positions must have shape"):
        apply(m, jnp.zeros((2, 8, 64)), positions=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(ValueError, match=r"segment_ids must be"):
        apply(m, jnp.zeros((2, 8, 64)), segment_ids=jnp.zeros((2, 7), jnp.int32))


def test_module_constructor_errors():
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=8"):
        diffjax.MultiheadAttention(64, 0, 8, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"embed_dim=60 is not divisible by num_heads=8"):
        diffjax.MultiheadAttention(60, 0, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"2\*num_heads=8"):
        diffjax.MultiheadDiffAttn(60, 0, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4"):
        diffjax.MultiheadDiffAttn(64, 0, 4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"straddle"):
        diffjax.MultiheadDiffAttnV2(64, 0, 3, 2, head_dim=16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"must be even"):
        diffjax.MultiheadDiffAttnV2(64, 0, 4, 2, head_dim=15, rngs=nnx.Rngs(0))


def test_query_that_sees_no_key_gets_zero_output():
    """Like flash attention: no visible key -> zero weights and zero output, not a uniform mean."""
    q = jnp.ones((1, 2, 1, 4))
    k = jnp.ones((1, 3, 1, 4))
    v = jnp.arange(1.0, 4.0).reshape(1, 3, 1, 1)
    seg, kv_seg = jnp.array([[0, 5]]), jnp.array([[0, 0, 1]])
    out = ops.dot_product_attention(q, k, v, causal=False, segment_ids=seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, 0], [1.5, 0.0], atol=1e-6)
    w = reference.attention_weights(q, k, causal=False, segment_ids=seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(np.asarray(w)[0, 0], [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]], atol=1e-6)
    d = ops.differential_attention(
        q, k, q, k, v, 0.5, causal=False, segment_ids=seg, kv_segment_ids=kv_seg
    )
    np.testing.assert_allclose(np.asarray(d)[0, :, 0, 0], [0.75, 0.0], atol=1e-6)


def test_v2_lambda_proj_uses_torch_default_init_whatever_kernel_init():
    """The official V2 leaves lambda_proj at nn.Linear's default, U(-1/sqrt(D), 1/sqrt(D))."""
    d_model = 256
    m = diffjax.MultiheadDiffAttnV2(
        d_model, 0, 8, 4, head_dim=32, kernel_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0)
    )
    w = np.asarray(m.lambda_proj.kernel[...])
    bound = 1 / math.sqrt(d_model)
    assert np.abs(w).max() <= bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)
    assert not np.asarray(m.q_proj.kernel[...]).any()
