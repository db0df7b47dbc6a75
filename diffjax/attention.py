"""The three attention layers, with the official code's arguments and parameter names.

- :class:`MultiheadAttention`: the standard twin (MHA / GQA / MQA), as ``multihead_attention.py``.
- :class:`MultiheadDiffAttn`: DIFF V1, as ``multihead_flashdiff_1.py`` (its head pairing).
- :class:`MultiheadDiffAttnV2`: DIFF V2, as ``multihead_flashdiffv2.py``.

All are called as ``module(x, positions=None, segment_ids=None)`` with ``x`` ``[batch, seq,
embed]`` and are causal unless built with ``causal=False``. The attention math itself is in
:mod:`diffjax.ops` (one dispatch point, ``attention_impl``). For decoding, ``extend`` runs the
same layer against a KV cache (``cache_layout()`` says what it holds; :mod:`diffjax.decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from . import ops
from .config import lambda_init_fn
from .layers import (
    Dtype,
    Linear,
    RMSNorm,
    RopeScaling,
    apply_rotary,
    as_dtype,
    default_positions,
    rotary_angles,
    torch_linear_init,
)
from .sharding import constrain, param, param_init

# Logical axis names (see diffjax.sharding): the fused head dimension of a projection is
# "heads" (query side) or "kv_heads"; activations [B, T, heads, d] are constrained by head.
_Q_ACT = ("act_batch", "act_seq", "act_heads", None)
_KV_ACT = ("act_batch", "act_seq", "act_kv_heads", None)


def _check_input(x: jax.Array, embed_dim: int, name: str) -> None:
    if x.ndim != 3 or x.shape[-1] != embed_dim:
        raise ValueError(f"{name} expects x of shape [batch, seq, {embed_dim}], got {x.shape}")


def _rotate(
    q: jax.Array,
    k: jax.Array,
    x: jax.Array,
    positions: jax.Array | None,
    theta: float,
    scaling: RopeScaling | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Interleaved rotary on every raw q and k head (rotary dim = head dim)."""
    positions = default_positions(x, positions)
    cos, sin = rotary_angles(positions, q.shape[-1], theta, scaling)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# ---------------------------------------------------------------------------- KV cache
# Decoding (diffjax.decode) calls ``extend`` instead of ``__call__``: the layer's keys and values
# go into a per-layer cache ``{name: [B, L, kv_heads, width]}`` at slot ``index``. Two cases:
#
# - T > 1 (prefill, into an empty cache at slot 0): attention over the new tokens themselves,
#   causal, with ``segment_ids`` [B, T] (0 on left padding, 1 on the prompt) so that a prompt
#   token never sees padding; the keys/values are then stored.
# - T == 1 (one decoded token): its key/value is stored at ``index``, then the query attends to
#   the whole cache with ``kv_segment_ids`` [B, L] (1 on the slots that hold this row's tokens,
#   0 on padding and empty slots) against ``segment_ids`` [B, 1] of ones: the "kv lengths" mask,
#   which the fused kernels take as segment ids.
_CACHE_ACT = ("act_batch", None, "act_kv_heads", None)


def _update_cache(
    cache: dict[str, jax.Array], new: dict[str, jax.Array], index
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], dict]:
    """``(arrays to attend to, the updated cache, the mask keywords of ops)``."""
    if set(cache) != set(new):
        raise ValueError(
            f"KV cache entries {sorted(cache)} do not match this layer's "
            f"{sorted(new)}: the cache was built for another attention kind"
        )
    t = next(iter(new.values())).shape[1]
    updated = {
        n: constrain(
            jax.lax.dynamic_update_slice_in_dim(
                cache[n], new[n].astype(cache[n].dtype), index, axis=1
            ),
            *_CACHE_ACT,
        )
        for n in cache
    }
    if t == 1:
        return updated, updated, dict(causal=False)
    return {n: new[n].astype(cache[n].dtype) for n in new}, updated, dict(causal=True)


def _check_extend(module, x, segment_ids, kv_segment_ids):
    if not module.causal:
        raise ValueError(
            f"{type(module).__name__}.extend: decoding with a KV cache needs a causal "
            f"layer (built with causal=False)"
        )
    if x.shape[1] == 1 and kv_segment_ids is None:
        raise ValueError(
            f"{type(module).__name__}.extend: one decoded token needs kv_segment_ids "
            f"[batch, cache length] (which cache slots hold this row's tokens)"
        )
    return dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids if x.shape[1] == 1 else None)


class _AttentionLayer(nnx.Module):
    """Shared constructor pieces: head bookkeeping and its checks, bias-free linears."""

    def _init_heads(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None,
        head_dim: int,
        *,
        rope_theta: float,
        causal: bool,
        attention_impl: str,
        rope_scaling: RopeScaling | None = None,
        kv_note: str = "",
    ) -> None:
        """Check and store the head layout; ``num_kv_heads=None`` means MHA."""
        name = type(self).__name__
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{name}: num_kv_heads={num_kv_heads} must divide num_heads={num_heads}{kv_note}"
            )
        if head_dim % 2:
            raise ValueError(f"{name}: head width {head_dim} must be even for rotary")
        ops.check_impl(attention_impl)  # an unknown implementation fails here, at construction
        self.embed_dim = embed_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.n_rep = num_heads // num_kv_heads
        self.scaling = head_dim**-0.5
        self.rope_theta, self.causal, self.attention_impl = rope_theta, causal, attention_impl
        self.rope_scaling = rope_scaling
        # Simulated absmax quantization of the logits (XLA path; the quantization analysis sets
        # it on a copy of the model: diffjax.evaluate.quantize.with_quantized_logits).
        self.logit_bits: int | None = None

    def _linear(
        self,
        n_in: int,
        n_out: int,
        dtype,
        param_dtype,
        kernel_init,
        rngs,
        axes: tuple[str, str] = ("embed", "heads"),
    ):
        """A bias-free linear whose kernel carries the logical ``axes`` (in, out)."""
        return Linear(
            n_in,
            n_out,
            use_bias=False,
            dtype=as_dtype(dtype),
            param_dtype=as_dtype(param_dtype),
            kernel_init=param_init(kernel_init, *axes),
            rngs=rngs,
        )


class MultiheadAttention(_AttentionLayer):
    """Standard multi-head attention (MHA, GQA with ``num_kv_heads``, MQA with 1).

    Parameters ``q_proj [D, H d]``, ``k_proj``/``v_proj [D, H_kv d]``, ``out_proj [H d, D]``, as
    the official ``multihead_attention.py`` (``head_dim`` defaults to ``embed_dim // num_heads``;
    set it for the twin of a DIFF V2 layer whose width is not ``D / h``).
    """

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        causal: bool = True,
        attention_impl: str = "auto",
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        rngs: nnx.Rngs,
    ):
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"MultiheadAttention: embed_dim={embed_dim} is not divisible by "
                    f"num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        self._init_heads(
            embed_dim,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            causal=causal,
            attention_impl=attention_impl,
        )
        self.depth = depth
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        args = (dtype, param_dtype, kernel_init, rngs)
        self.q_proj = self._linear(embed_dim, h * d, *args)
        self.k_proj = self._linear(embed_dim, hkv * d, *args, axes=("embed", "kv_heads"))
        self.v_proj = self._linear(embed_dim, hkv * d, *args, axes=("embed", "kv_heads"))
        self.out_proj = self._linear(h * d, embed_dim, *args, axes=("heads", "embed"))

    def _qkv(self, x, positions):
        """(q, k, v) after rotary, ``[B, T, heads, head_dim]``."""
        _check_input(x, self.embed_dim, type(self).__name__)
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q, k = _rotate(q, k, x, positions, self.rope_theta, self.rope_scaling)
        return constrain(q, *_Q_ACT), constrain(k, *_KV_ACT), constrain(v, *_KV_ACT)

    def attention_maps(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """The softmax map ``a`` ``[B, heads, T, S]`` (float32), for analysis."""
        q, k, _ = self._qkv(x, positions)
        return {
            "a": ops.attention_weights(
                q, k, causal=self.causal, segment_ids=segment_ids, scale=self.scaling
            )
        }

    def attention_logits(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """The pre-softmax logits ``logits`` ``[B, heads, T, S]`` (``q k^T / sqrt(d)``, float32)
        and ``mask`` (``[B or 1, T, S]``, True = may attend, or None), for analysis."""
        q, k, _ = self._qkv(x, positions)
        logits, mask = ops.attention_logits(
            q, k, causal=self.causal, segment_ids=segment_ids, scale=self.scaling
        )
        return {"logits": logits, "mask": mask}

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        q, k, v = self._qkv(x, positions)
        b, t = x.shape[:2]
        o = ops.dot_product_attention(
            q,
            k,
            v,
            causal=self.causal,
            segment_ids=segment_ids,
            scale=self.scaling,
            impl=self.attention_impl,
            logit_bits=self.logit_bits,
        )
        return self.out_proj(o.reshape(b, t, self.num_heads * self.head_dim))

    def cache_layout(self) -> dict[str, tuple[int, int]]:
        """The KV cache entries of this layer: name -> (kv heads, width) per token."""
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def extend(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: dict[str, jax.Array],
        *,
        index,
        segment_ids: jax.Array,
        kv_segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Decoding: ``(output, updated cache)`` for ``x`` ``[B, T, D]`` written at slot ``index``
        (see the KV cache notes above; :mod:`diffjax.decode` drives it)."""
        mask = _check_extend(self, x, segment_ids, kv_segment_ids)
        q, k, v = self._qkv(x, positions)
        kv, cache, kw = _update_cache(cache, dict(k=k, v=v), index)
        b, t = x.shape[:2]
        o = ops.dot_product_attention(
            q,
            kv["k"],
            kv["v"],
            scale=self.scaling,
            impl=self.attention_impl,
            logit_bits=self.logit_bits,
            **kw,
            **mask,
        )
        return self.out_proj(o.reshape(b, t, self.num_heads * self.head_dim)), cache


class MultiheadDiffAttn(_AttentionLayer):
    """Differential attention V1 (the paper), with the pairing of ``multihead_flashdiff_1.py``.

    ``num_heads`` = h DIFF heads (half the baseline's heads); ``num_kv_heads`` = h_kv (half the
    baseline's kv heads; None for MHA). Head width d = ``embed_dim // num_heads // 2``.

    - ``q_proj: D -> D`` viewed as ``[T, 2h, d]``: DIFF head i has Q1 = raw head 2i, Q2 = 2i+1.
    - ``k_proj: D -> D / n_rep`` viewed as ``[S, 2h_kv, d]``: group g = i // n_rep has
      K1 = raw head 2g, K2 = raw head 2g+1.
    - ``v_proj: D -> D / n_rep`` viewed as ``[S, h_kv, 2d]``.
    - ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` (float32 scalar);
      ``O = RMSNorm_2d((A1 - lambda A2) V) * (1 - lambda_init)``; ``out_proj: D -> D``.

    ``lambda_init``: None for the depth schedule ``0.8 - 0.6 exp(-0.3 depth)``, or a fixed value
    (the paper's ablation). ``norm=False`` drops the per-head RMSNorm and its ``(1 - lambda_init)``
    factor (the paper's "without GroupNorm" ablation).
    """

    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        lambda_init: float | None = None,
        norm: bool = True,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        causal: bool = True,
        attention_impl: str = "auto",
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        rngs: nnx.Rngs,
    ):
        if embed_dim % (2 * num_heads):
            raise ValueError(
                f"MultiheadDiffAttn: embed_dim={embed_dim} must be divisible by "
                f"2*num_heads={2 * num_heads} (num_heads is the number of DIFF heads, "
                f"half the baseline's)"
            )
        head_dim = embed_dim // num_heads // 2
        self._init_heads(
            embed_dim,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            causal=causal,
            attention_impl=attention_impl,
        )
        self.depth = depth
        self.lambda_init = float(lambda_init_fn(depth) if lambda_init is None else lambda_init)
        args = (dtype, param_dtype, kernel_init, rngs)
        self.q_proj = self._linear(embed_dim, embed_dim, *args)
        self.k_proj = self._linear(
            embed_dim, embed_dim // self.n_rep, *args, axes=("embed", "kv_heads")
        )
        self.v_proj = self._linear(
            embed_dim, embed_dim // self.n_rep, *args, axes=("embed", "kv_heads")
        )
        self.out_proj = self._linear(embed_dim, embed_dim, *args, axes=("heads", "embed"))
        init = nnx.initializers.normal(0.1)
        key = rngs.params()
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.lambda_q1 = param(init(k1, (head_dim,), jnp.float32), "head_dim")
        self.lambda_k1 = param(init(k2, (head_dim,), jnp.float32), "head_dim")
        self.lambda_q2 = param(init(k3, (head_dim,), jnp.float32), "head_dim")
        self.lambda_k2 = param(init(k4, (head_dim,), jnp.float32), "head_dim")
        self.subln = RMSNorm(2 * head_dim, eps=norm_eps, param_dtype=param_dtype) if norm else None

    def lambda_full(self) -> jax.Array:
        """The layer's lambda (float32 scalar)."""
        return differential_lambda(
            self.lambda_q1[...],
            self.lambda_k1[...],
            self.lambda_q2[...],
            self.lambda_k2[...],
            self.lambda_init,
        )

    def _qkv(self, x, positions):
        """(q1, k1, q2, k2, v) after rotary, in the flash_1 pairing."""
        _check_input(x, self.embed_dim, type(self).__name__)
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = constrain(self.q_proj(x).reshape(b, t, 2 * h, d), *_Q_ACT)
        k = constrain(self.k_proj(x).reshape(b, t, 2 * hkv, d), *_KV_ACT)
        v = constrain(self.v_proj(x).reshape(b, t, hkv, 2 * d), *_KV_ACT)
        q, k = _rotate(q, k, x, positions, self.rope_theta, self.rope_scaling)
        # pair-major views [.., h, 2, d]: raw heads 2i, 2i+1 form DIFF head i; slicing the pair
        # axis (not a stride over the sharded head axis) keeps every pair on one device
        q = q.reshape(b, t, h, 2, d)
        k = k.reshape(b, t, hkv, 2, d)
        q1, q2 = constrain(q[:, :, :, 0], *_Q_ACT), constrain(q[:, :, :, 1], *_Q_ACT)
        k1, k2 = constrain(k[:, :, :, 0], *_KV_ACT), constrain(k[:, :, :, 1], *_KV_ACT)
        return q1, k1, q2, k2, v

    def attention_maps(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """The two softmax maps ``a1``, ``a2`` ``[B, h, T, S]``, ``lam`` and the differential map
        ``diff = a1 - lam * a2`` (float32), for analysis. Materialises ``T x S`` maps."""
        q1, k1, q2, k2, _ = self._qkv(x, positions)
        kw = dict(causal=self.causal, segment_ids=segment_ids, scale=self.scaling)
        a1 = ops.attention_weights(q1, k1, **kw)
        a2 = ops.attention_weights(q2, k2, **kw)
        lam = self.lambda_full()
        return {"a1": a1, "a2": a2, "lam": lam, "diff": a1 - lam * a2}

    def attention_logits(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """The pre-softmax logits of both maps, ``logits1``/``logits2`` ``[B, h, T, S]``
        (``q_i k_i^T / sqrt(d)``, float32), and ``mask`` (``[B or 1, T, S]`` or None)."""
        q1, k1, q2, k2, _ = self._qkv(x, positions)
        kw = dict(causal=self.causal, segment_ids=segment_ids, scale=self.scaling)
        l1, mask = ops.attention_logits(q1, k1, **kw)
        l2, _ = ops.attention_logits(q2, k2, **kw)
        return {"logits1": l1, "logits2": l2, "mask": mask}

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        q1, k1, q2, k2, v = self._qkv(x, positions)
        b, t = x.shape[:2]
        h, d = self.num_heads, self.head_dim
        lam = self.lambda_full()
        _sow_lambda(self, lam)
        o = ops.differential_attention(
            q1,
            k1,
            q2,
            k2,
            v,
            lam,
            causal=self.causal,
            segment_ids=segment_ids,
            scale=self.scaling,
            impl=self.attention_impl,
            logit_bits=self.logit_bits,
        )
        if self.subln is not None:
            o = self.subln(o) * jnp.asarray(1.0 - self.lambda_init, o.dtype)
        return self.out_proj(o.reshape(b, t, h * 2 * d))

    def cache_layout(self) -> dict[str, tuple[int, int]]:
        """The KV cache entries of this layer: name -> (kv heads, width) per token. The raw key
        heads K1 (2g) and K2 (2g+1) of each kv group, and its value, 2d wide."""
        hkv, d = self.num_kv_heads, self.head_dim
        return {"k1": (hkv, d), "k2": (hkv, d), "v": (hkv, 2 * d)}

    def extend(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: dict[str, jax.Array],
        *,
        index,
        segment_ids: jax.Array,
        kv_segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Decoding: ``(output, updated cache)`` for ``x`` ``[B, T, D]`` written at slot ``index``
        (see the KV cache notes above; :mod:`diffjax.decode` drives it)."""
        mask = _check_extend(self, x, segment_ids, kv_segment_ids)
        q1, k1, q2, k2, v = self._qkv(x, positions)
        kv, cache, kw = _update_cache(cache, dict(k1=k1, k2=k2, v=v), index)
        b, t = x.shape[:2]
        h, d = self.num_heads, self.head_dim
        o = ops.differential_attention(
            q1,
            kv["k1"],
            q2,
            kv["k2"],
            kv["v"],
            self.lambda_full(),
            scale=self.scaling,
            impl=self.attention_impl,
            logit_bits=self.logit_bits,
            **kw,
            **mask,
        )
        if self.subln is not None:
            o = self.subln(o) * jnp.asarray(1.0 - self.lambda_init, o.dtype)
        return self.out_proj(o.reshape(b, t, h * 2 * d)), cache


def _sow_lambda(layer: nnx.Module, lam: jax.Array) -> None:
    """Sow the mean of a DIFF layer's lambda in this call (V1: its scalar; V2: over batch,
    tokens and heads) as the ``nnx.Intermediate`` ``"lambda"`` when the call runs under
    ``nnx.capture(..., nnx.Intermediate)`` (:func:`diffjax.model.sown_lambdas` reads it).
    Elsewhere nothing is kept.

    Why the guard: flax 0.12's ``Module.sow`` outside ``nnx.capture`` stores the value on the
    layer as a new ``Intermediate`` variable (a tuple that grows by one each call, under
    ``nnx.jit`` too) with a DeprecationWarning, so every plain forward pass would change the
    model's state and checkpoints. flax has no public "am I under capture" query; its guide
    ("Extracting intermediate values", section "How nnx.capture works") documents the
    mechanism this reads: ``capture`` sets ``__captures__`` on every module of the graph for
    the call and deletes it after. The other ways out are worse: a flag the caller of capture
    sets is the mutable flag this replaced, and ``sow``'s return value only says whether a
    capture took the value, after an uncaptured call has already stored it."""
    if hasattr(layer, "__captures__"):
        layer.sow(nnx.Intermediate, "lambda", jnp.mean(lam))


def differential_lambda(
    lq1: jax.Array, lk1: jax.Array, lq2: jax.Array, lk2: jax.Array, lambda_init: float
) -> jax.Array:
    """DIFF V1's re-parameterised lambda, ``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``, float32."""
    f32 = jnp.float32
    return (
        jnp.exp(jnp.sum(lq1.astype(f32) * lk1.astype(f32)))
        - jnp.exp(jnp.sum(lq2.astype(f32) * lk2.astype(f32)))
        + f32(lambda_init)
    )


class MultiheadDiffAttnV2(_AttentionLayer):
    """Differential attention V2, as ``multihead_flashdiffv2.py`` with ``use_diff_v2=True``.

    ``num_heads`` = h output heads over 2h query heads of width ``head_dim`` = d; query heads 2i
    and 2i+1 form pair i and share kv group ``i // (h / h_kv)``. ``q_proj: D -> 2h d``,
    ``k_proj``/``v_proj: D -> h_kv d``, ``o_proj: h d -> D``, ``lambda_proj: D -> h``;
    ``O_i = O_{2i} - sigmoid(lambda_proj(x))_i O_{2i+1}`` (lambda per token and head, in float32).
    No per-head norm.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None,
        head_dim: int,
        *,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        causal: bool = True,
        attention_impl: str = "auto",
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        lambda_proj_init=torch_linear_init,
        rngs: nnx.Rngs,
    ):
        self._init_heads(
            d_model,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            causal=causal,
            attention_impl=attention_impl,
            kv_note=", or the query pairs (2i, 2i+1) straddle kv groups",
        )
        self.d_model = d_model
        self.num_q_heads = 2 * num_heads
        num_kv_heads = self.num_kv_heads
        args = (dtype, param_dtype, kernel_init, rngs)
        self.q_proj = self._linear(d_model, self.num_q_heads * head_dim, *args)
        self.k_proj = self._linear(
            d_model, num_kv_heads * head_dim, *args, axes=("embed", "kv_heads")
        )
        self.v_proj = self._linear(
            d_model, num_kv_heads * head_dim, *args, axes=("embed", "kv_heads")
        )
        self.o_proj = self._linear(num_heads * head_dim, d_model, *args, axes=("heads", "embed"))
        # lambda is computed in float32 whatever the activation dtype.
        # (``lambda_proj_init``: torch's default Linear init, as the official code leaves it.)
        self.lambda_proj = self._linear(
            d_model, num_heads, jnp.float32, param_dtype, lambda_proj_init, rngs
        )

    def lambda_values(self, x: jax.Array) -> jax.Array:
        """Per-token, per-head lambda ``sigmoid(lambda_proj(x))``, ``[batch, seq, h]`` float32."""
        lam = jax.nn.sigmoid(self.lambda_proj(x.astype(jnp.float32)))
        return constrain(lam, "act_batch", "act_seq", "act_heads")

    def _qkv(self, x, positions):
        """(q, k, v) after rotary: q ``[B, T, 2h, d]``, k and v ``[B, S, h_kv, d]``."""
        _check_input(x, self.d_model, type(self).__name__)
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = constrain(self.q_proj(x).reshape(b, t, 2 * h, d), *_Q_ACT)
        k = constrain(self.k_proj(x).reshape(b, t, hkv, d), *_KV_ACT)
        v = constrain(self.v_proj(x).reshape(b, t, hkv, d), *_KV_ACT)
        q, k = _rotate(q, k, x, positions, self.rope_theta, self.rope_scaling)
        return q, k, v

    def _pairs(self, q):
        """(q1, q2) ``[B, T, h, d]``: query heads 2i and 2i+1 of output head i (pair-major, so
        a head-sharded q splits into whole pairs)."""
        b, t = q.shape[:2]
        q = q.reshape(b, t, self.num_heads, 2, self.head_dim)
        return constrain(q[:, :, :, 0], *_Q_ACT), constrain(q[:, :, :, 1], *_Q_ACT)

    def attention_maps(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """``a1``, ``a2`` ``[B, h, T, S]``, ``lam`` ``[B, T, h]`` and ``diff = a1 - lam * a2``
        (float32), for analysis. Materialises ``T x S`` maps."""
        q, k, _ = self._qkv(x, positions)
        q1, q2 = self._pairs(q)
        kw = dict(causal=self.causal, segment_ids=segment_ids, scale=self.scaling)
        a1 = ops.attention_weights(q1, k, **kw)
        a2 = ops.attention_weights(q2, k, **kw)
        lam = self.lambda_values(x)
        return {
            "a1": a1,
            "a2": a2,
            "lam": lam,
            "diff": a1 - jnp.transpose(lam, (0, 2, 1))[..., None] * a2,
        }

    def attention_logits(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """The pre-softmax logits of both maps, ``logits1``/``logits2`` ``[B, h, T, S]``
        (float32), and ``mask`` (``[B or 1, T, S]`` or None)."""
        q, k, _ = self._qkv(x, positions)
        q1, q2 = self._pairs(q)
        kw = dict(causal=self.causal, segment_ids=segment_ids, scale=self.scaling)
        l1, mask = ops.attention_logits(q1, k, **kw)
        l2, _ = ops.attention_logits(q2, k, **kw)
        return {"logits1": l1, "logits2": l2, "mask": mask}

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        q, k, v = self._qkv(x, positions)
        b, t = x.shape[:2]
        lam = self.lambda_values(x)
        _sow_lambda(self, lam)
        q1, q2 = self._pairs(q)
        o = ops.differential_attention(
            q1,
            k,
            q2,
            k,
            v,
            lam,
            causal=self.causal,
            segment_ids=segment_ids,
            scale=self.scaling,
            impl=self.attention_impl,
            logit_bits=self.logit_bits,
        )
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))

    def cache_layout(self) -> dict[str, tuple[int, int]]:
        """The KV cache entries of this layer: name -> (kv heads, width) per token. One key and
        one value per kv head, read once for both maps of every pair."""
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def extend(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: dict[str, jax.Array],
        *,
        index,
        segment_ids: jax.Array,
        kv_segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Decoding: ``(output, updated cache)`` for ``x`` ``[B, T, D]`` written at slot ``index``
        (see the KV cache notes above; :mod:`diffjax.decode` drives it)."""
        mask = _check_extend(self, x, segment_ids, kv_segment_ids)
        q, k, v = self._qkv(x, positions)
        kv, cache, kw = _update_cache(cache, dict(k=k, v=v), index)
        b, t = x.shape[:2]
        q1, q2 = self._pairs(q)
        o = ops.differential_attention(
            q1,
            kv["k"],
            q2,
            kv["k"],
            kv["v"],
            self.lambda_values(x),
            scale=self.scaling,
            impl=self.attention_impl,
            logit_bits=self.logit_bits,
            **kw,
            **mask,
        )
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim)), cache


__all__ = ["MultiheadAttention", "MultiheadDiffAttn", "MultiheadDiffAttnV2", "differential_lambda"]
