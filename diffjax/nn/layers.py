"""Building blocks: RMSNorm, rotary position embedding (interleaved pairs, optional linear or
Llama 3 frequency scaling), SwiGLU.

The math is in small pure functions (``rms_norm``, ``rotary_angles``, ``apply_rotary``);
the NNX modules only hold parameters and call them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax.config import RopeScaling
from diffjax.infra.sharding import constrain, param, param_init

Dtype = Any

# torch.nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)): the official
# modules are built with it, so a freshly built diffjax module has the same weight statistics.
torch_linear_init = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def as_dtype(dtype: Dtype) -> jnp.dtype:
    """``"bfloat16"`` / ``jnp.bfloat16`` / ``np.dtype`` -> ``jnp.dtype``."""
    return jnp.dtype(dtype)


# ---------------------------------------------------------------------------- Linear
class Linear(nnx.Linear):
    """``nnx.Linear`` (same parameters, same result) applied to a 2-D ``[N, in]`` view of its
    input: ``x [..., in]`` is flattened to ``[prod(...), in]``, multiplied, and reshaped back.

    The reshapes are free (bitcasts), and GPU/TPU compilers flatten a dot's free dimensions this
    way themselves; XLA:CPU does not, and with a 3-D input turns each weight gradient
    ``x^T dy`` into a transposed copy: the 2-D view makes the SwiGLU FFN's forward and backward
    about a third faster on CPU (``benchmarks/step_time.py``).
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim <= 2:
            return super().__call__(x)
        y = super().__call__(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------- RMSNorm
def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` in float32, cast back to ``x.dtype``, then ``* weight``.

    Same order of operations as the official ``rms_norm.py``: normalise in float32, cast to the
    input dtype, multiply by the weight.
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = y.astype(x.dtype)
    if weight is not None:
        y = y * weight.astype(x.dtype)
    return y


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learnable weight (init 1)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype: Dtype = jnp.float32):
        self.dim = dim
        self.eps = eps
        self.scale = param(jnp.ones((dim,), as_dtype(param_dtype)), "norm")

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm expects a last axis of {self.dim}, got shape {x.shape}")
        return rms_norm(x, self.scale[...], self.eps)


# ---------------------------------------------------------------------------- rotary
def scale_inv_freq(inv_freq: jax.Array, scaling: RopeScaling | None) -> jax.Array:
    """``inv_freq`` (float32) rescaled by ``scaling`` (None: unchanged), as transformers'
    ``_compute_linear_scaling_rope_parameters`` / ``_compute_llama3_parameters``."""
    if scaling is None:
        return inv_freq
    factor = jnp.float32(scaling.factor)
    if scaling.kind == "linear":
        return inv_freq / factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return jnp.where(medium, smoothed, scaled).astype(jnp.float32)


def rotary_angles(
    positions: jax.Array, dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin of ``positions * theta^(-2j/dim)``, j < dim/2: shape ``positions.shape + (dim/2,)``
    (the frequencies rescaled by ``scaling`` when given).

    float32 throughout (positions up to 2^24 are exact).
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    inv_freq = scale_inv_freq(inv_freq, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved (GPT-J) channel pairs ``(x[2j], x[2j+1])`` by the angles.

    ``x``: ``[batch, seq, heads, dim]``; ``cos``/``sin``: ``[batch or 1, seq, dim/2]``.
    Computed in float32, returned in ``x.dtype`` (as flash-attn's rotary kernel does).
    """
    b, t, h, d = x.shape
    xf = x.astype(jnp.float32).reshape(b, t, h, d // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c = cos[:, :, None, :]
    s = sin[:, :, None, :]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return out.reshape(b, t, h, d).astype(x.dtype)


def default_positions(x: jax.Array, positions: jax.Array | None) -> jax.Array:
    """``positions`` checked against ``x`` ``[batch, seq, ...]``, or ``arange(seq)`` per row."""
    b, t = x.shape[0], x.shape[1]
    if positions is None:
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if positions.ndim == 1:
        positions = positions[None, :]
    if positions.shape[-1] != t or positions.shape[0] not in (1, b) or positions.ndim != 2:
        raise ValueError(
            f"positions must have shape [batch, seq] = [{b}, {t}] (or [seq]), got {positions.shape}"
        )
    return positions


# ---------------------------------------------------------------------------- SwiGLU
class SwiGLU(nnx.Module):
    """LLaMA feed-forward: ``w2(silu(w1 x) * w3 x)``, bias-free."""

    def __init__(
        self,
        d_model: int,
        hidden_dim: int,
        *,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        rngs: nnx.Rngs,
    ):
        kw = dict(
            use_bias=False, dtype=as_dtype(dtype), param_dtype=as_dtype(param_dtype), rngs=rngs
        )
        up = param_init(kernel_init, "embed", "mlp")
        self.w1 = Linear(d_model, hidden_dim, kernel_init=up, **kw)  # gate
        self.w3 = Linear(d_model, hidden_dim, kernel_init=up, **kw)  # up
        self.w2 = Linear(
            hidden_dim, d_model, kernel_init=param_init(kernel_init, "mlp", "embed"), **kw
        )  # down

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.silu(self.w1(x)) * self.w3(x), "act_batch", "act_seq", "act_mlp")
        return self.w2(h)
