"""RMSNorm, rotary embedding (interleaved pairs) and SwiGLU against independent numpy code."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import RMSNorm, SwiGLU, apply_rotary, rotary_angles
from diffjax.nn.layers import rms_norm
from oracle import np_rmsnorm as np_rms_norm
from oracle import np_rotary, np_silu


# Jitted wrappers: one XLA compile per shape instead of one per eager primitive.
@jax.jit
def rotate(x, positions, theta=10000.0):
    cos, sin = rotary_angles(positions, x.shape[-1], theta)
    return apply_rotary(x, cos, sin)


call = nnx.jit(lambda module, x: module(x))


# ----------------------------------------------------------------------------- RMSNorm
def test_rmsnorm_weight_init_ones():
    norm = RMSNorm(24)
    w = np.asarray(norm.scale[...])
    chex.assert_shape(w, (24,))
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, np.ones(24, np.float32))
    params = nnx.state(norm, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == 24


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_rmsnorm_matches_numpy_float32(eps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 32)).astype(np.float32) * 3.0
    w = rng.normal(size=(32,)).astype(np.float32)
    norm = RMSNorm(32, eps=eps)
    norm.scale[...] = jnp.asarray(w)
    y = norm(jnp.asarray(x))
    assert y.dtype == jnp.float32
    chex.assert_shape(y, x.shape)
    np.testing.assert_allclose(np.asarray(y), np_rms_norm(x, w, eps), rtol=1e-6, atol=1e-6)


def test_rmsnorm_eps_matters_for_small_inputs():
    x = np.full((1, 8), 1e-3, np.float32)
    y = RMSNorm(8, eps=1e-5)(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), np_rms_norm(x, np.ones(8), 1e-5), rtol=1e-5)
    assert float(y[0, 0]) < 0.5  # eps dominates mean(x^2) = 1e-6


def test_rmsnorm_bf16_in_bf16_out():
    rng = np.random.default_rng(1)
    x32 = rng.normal(size=(4, 7, 64)).astype(np.float32)
    x16 = jnp.asarray(x32, jnp.bfloat16)
    w = rng.normal(size=(64,)).astype(np.float32)
    norm = RMSNorm(64)
    norm.scale[...] = jnp.asarray(w)
    y16 = norm(x16)
    assert y16.dtype == jnp.bfloat16
    ref = np_rms_norm(np.asarray(x16.astype(jnp.float32)), w, 1e-5)
    y32 = norm(x16.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(y32), ref, rtol=1e-5, atol=1e-5)
    # bf16 has an 8-bit mantissa: two roundings (normalised value, product) -> ~1% relative.
    np.testing.assert_allclose(np.asarray(y16.astype(jnp.float32)), ref, rtol=2e-2, atol=2e-2)


def test_rms_norm_function_without_weight():
    x = np.random.default_rng(2).normal(size=(2, 16)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(rms_norm(jnp.asarray(x), None, 1e-5)),
        np_rms_norm(x, 1.0, 1e-5),
        rtol=1e-6,
        atol=1e-6,
    )


def test_rmsnorm_rejects_wrong_width():
    with pytest.raises(ValueError):
        RMSNorm(16)(jnp.ones((2, 8)))


# ----------------------------------------------------------------------------- rotary
def test_rotary_angles_values_and_shape():
    positions = jnp.arange(10, dtype=jnp.int32)[None]
    cos, sin = rotary_angles(positions, 8, theta=10000.0)
    chex.assert_shape([cos, sin], (1, 10, 4))
    assert cos.dtype == jnp.float32 and sin.dtype == jnp.float32
    ang = np.arange(10)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8.0)
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(ang), atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin[0]), np.sin(ang), atol=1e-6)


def test_rotary_angles_rejects_odd_dim():
    with pytest.raises(ValueError):
        rotary_angles(jnp.arange(4)[None], 7)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_apply_rotary_matches_numpy(theta):
    rng = np.random.default_rng(3)
    b, t, h, d = 2, 40, 3, 16
    x = rng.normal(size=(b, t, h, d)).astype(np.float32)
    positions = np.stack([np.arange(t), np.arange(t)[::-1] + 7])  # distinct rows
    y = rotate(jnp.asarray(x), jnp.asarray(positions), theta)
    assert y.dtype == jnp.float32
    chex.assert_shape(y, x.shape)
    np.testing.assert_allclose(np.asarray(y), np_rotary(x, positions, theta), rtol=1e-5, atol=2e-5)


def test_apply_rotary_is_interleaved_not_half_split():
    # A unit vector in channel 0 at position p turns into channels (0, 1), not (0, d/2).
    d = 8
    x = np.zeros((1, 1, 1, d), np.float32)
    x[..., 0] = 1.0
    cos, sin = rotary_angles(jnp.asarray([[1]]), d)
    y = np.asarray(apply_rotary(jnp.asarray(x), cos, sin))[0, 0, 0]
    np.testing.assert_allclose(y[:2], [np.cos(1.0), np.sin(1.0)], atol=1e-6)
    np.testing.assert_allclose(y[2:], 0.0, atol=0)


def test_apply_rotary_position_zero_is_identity_and_norm_preserved():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 12, 4, 32)).astype(np.float32)
    zeros = jnp.zeros((2, 12), jnp.int32)
    np.testing.assert_array_equal(np.asarray(rotate(jnp.asarray(x), zeros)), x)

    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32) * 13, (2, 12))
    y = np.asarray(rotate(jnp.asarray(x), positions))
    # Each pair keeps its length, hence the whole vector does too.
    np.testing.assert_allclose(
        np.linalg.norm(y.reshape(2, 12, 4, 16, 2), axis=-1),
        np.linalg.norm(x.reshape(2, 12, 4, 16, 2), axis=-1),
        rtol=1e-5,
    )
    assert not np.allclose(y, x)


def test_apply_rotary_broadcasts_batch_one_angles():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 6, 2, 8)).astype(np.float32)
    cos1, sin1 = rotary_angles(jnp.arange(6)[None], 8)
    cos3, sin3 = rotary_angles(jnp.broadcast_to(jnp.arange(6), (3, 6)), 8)
    np.testing.assert_array_equal(
        np.asarray(apply_rotary(jnp.asarray(x), cos1, sin1)),
        np.asarray(apply_rotary(jnp.asarray(x), cos3, sin3)),
    )


def test_rotary_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(6)
    d = 16
    q = jnp.asarray(rng.normal(size=(1, 1, 1, d)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(1, 1, 1, d)).astype(np.float32))

    def score(pq, pk):
        rq = rotate(q, jnp.asarray([[pq]], jnp.int32))
        rk = rotate(k, jnp.asarray([[pk]], jnp.int32))
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(5, 2), score(25, 22), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(score(3, 3), float(jnp.sum(q * k)), rtol=1e-5, atol=1e-5)


def test_apply_rotary_bf16_in_bf16_out():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 9, 2, 16)), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    y = rotate(x, positions)
    assert y.dtype == jnp.bfloat16
    ref = np_rotary(np.asarray(x.astype(jnp.float32)), np.asarray(positions))
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- SwiGLU
def test_swiglu_matches_numpy():
    d, hidden = 16, 32
    ffn = SwiGLU(d, hidden, rngs=nnx.Rngs(0))
    w1, w2, w3 = (np.asarray(m.kernel[...], np.float64) for m in (ffn.w1, ffn.w2, ffn.w3))
    chex.assert_shape([w1, w3], (d, hidden))
    chex.assert_shape(w2, (hidden, d))
    # Bias-free.
    assert ffn.w1.bias is None and ffn.w2.bias is None and ffn.w3.bias is None
    params = nnx.state(ffn, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == 3 * d * hidden

    x = np.random.default_rng(8).normal(size=(2, 5, d)).astype(np.float32)
    y = call(ffn, jnp.asarray(x))
    assert y.dtype == jnp.float32
    ref = (np_silu(x @ w1) * (x @ w3)) @ w2
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6)
    # The gate is w1 (not w3): swapping them changes the result.
    swapped = (np_silu(x @ w3) * (x @ w1)) @ w2
    assert not np.allclose(ref, swapped, atol=1e-4)


def test_swiglu_bf16_compute():
    d, hidden = 16, 32
    ffn32 = SwiGLU(d, hidden, rngs=nnx.Rngs(1))
    ffn16 = SwiGLU(d, hidden, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(9).normal(size=(2, 5, d)), jnp.float32)
    y16 = call(ffn16, x)
    assert y16.dtype == jnp.bfloat16
    y32 = call(ffn32, x)
    rel = float(jnp.linalg.norm(y16.astype(jnp.float32) - y32) / jnp.linalg.norm(y32))
    assert rel < 2e-2
