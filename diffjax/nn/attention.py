"""The three attention layers, with the official code's arguments and parameter names.

- :class:`MultiheadAttention`: the standard twin (MHA / GQA / MQA), as ``multihead_attention.py``.
- :class:`MultiheadDiffAttn`: DIFF V1, as ``multihead_flashdiff_1.py`` (its head pairing).
- :class:`MultiheadDiffAttnV2`: DIFF V2, as ``multihead_flashdiffv2.py``.

One API for all three (:class:`AttentionLayer`): built as ``Layer(embed_dim, depth, num_heads,
num_kv_heads=None, ...)``, called as ``layer(x, positions=None, segment_ids=None,
token_index=None)`` with ``x``
``[batch, seq, embed_dim]``, causal unless built with ``causal=False``. Each layer is three
steps::

    p = layer.project(x, positions)   # Projection: q/k/v after rotary, and lambda
    o = attention(p)                  # diffjax.ops: the one dispatch point (attention_impl)
    y = layer.output(o, x)            # (V1: per-head norm), the gate (if any) and out_proj

``project`` is also what analyses read (maps and logits are computed from it with
:mod:`diffjax.kernels.reference`). For decoding, ``extend`` runs the same body against a KV
cache (``cache_layout()`` says what it holds; :mod:`diffjax.nn.decode`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from diffjax import ops
from diffjax.config import GATES, ContextSpec, KernelTarget, RopeScaling, lambda_init_fn
from diffjax.nn.layers import (
    Dtype,
    Linear,
    RMSNorm,
    apply_rotary,
    as_dtype,
    default_positions,
    rotary_angles,
    torch_linear_init,
)
from diffjax.infra.sharding import constrain, param, param_init

# Logical axis names (see diffjax.infra.sharding): the fused head dimension of a projection is
# "heads" (query side) or "kv_heads"; activations [B, T, heads, d] are constrained by head.
_Q_ACT = ("act_batch", "act_seq", "act_heads", None)
_KV_ACT = ("act_batch", "act_seq", "act_kv_heads", None)
CACHE_AXES = ("act_batch", None, "act_kv_heads", None)  # a KV cache [B, L, H_kv, width]
# the activations named for rematerialization (diffjax.nn.model.remat_policy's "minimal"): the
# q/k/v projections and the attention output before out_proj
SAVED_NAMES = ("query_proj", "key_proj", "value_proj", "attn_out")


class LambdaInit(nnx.Variable):
    """DIFF V1's ``lambda_init`` and its output scale ``1 - lambda_init``: per-layer data, not
    trained. Variables (not Python floats) so that a model with stacked layers holds one value
    per layer."""


def lambda_init_variables(value) -> tuple[LambdaInit, LambdaInit]:
    """``(lambda_init, 1 - lambda_init)`` as float32 variables, each rounded once from the
    float64 value (``value``: a number or an array of them, one per stacked layer), as the
    official code's Python float is when it meets a tensor."""
    value = np.asarray(value, np.float64)
    return LambdaInit(jnp.asarray(value, jnp.float32)), LambdaInit(
        jnp.asarray(1.0 - value, jnp.float32)
    )


class Ramp(nnx.Param):
    """The weight w of DIFF's negative map in a retrofitted layer (``ModelConfig.ramp``):
    ``lambda`` is used as ``w * lambda``. A parameter so that it lives in checkpoints and moves
    with the parameters, but never trained: its gradient is stopped, weight decay skips it
    (not a matrix), and the train step sets it from the retrofit's ramp (see
    :mod:`diffjax.retrofit`). At w = 1 the layer is plain DIFF."""


def ramp_param(ramp: bool) -> Ramp | None:
    """A layer's :class:`Ramp` (float32 scalar at 1) when ``ramp``, else None."""
    if not ramp:
        return None
    return Ramp(jnp.ones((), jnp.float32), out_sharding=(), eager_sharding=False)


def _ramped(layer, lam: jax.Array) -> jax.Array:
    """``w * lambda`` for a layer with a :class:`Ramp` (w not differentiated), else lambda."""
    if getattr(layer, "ramp", None) is None:
        return lam
    return lam * jax.lax.stop_gradient(layer.ramp[...]).astype(lam.dtype)


class Projection(NamedTuple):
    """A layer's attention inputs, after the projections and rotary (float32 lambda).

    Standard attention fills ``q, k, v``; DIFF adds the second map's ``q2`` and ``lam``, and
    V1 its own second key ``k2`` (DIFF V2's two maps read the one key ``k``: ``k2`` is None).
    """

    q: jax.Array  # [B, T, H, d]: queries (DIFF: Q1 of each pair)
    k: jax.Array  # [B, S, H_kv, d]: keys (DIFF V1: K1; DIFF V2: the key both maps read)
    v: jax.Array  # [B, S, H_kv, dv]: values (DIFF V1: 2d wide)
    q2: jax.Array | None = None  # [B, T, H, d]: DIFF: Q2 of each pair
    k2: jax.Array | None = None  # [B, S, H_kv, d]: DIFF V1: K2
    lam: jax.Array | None = None  # DIFF: lambda, V1 a scalar, V2 [B, T, H]


def attend(p: Projection, *, scale: float, impl, **masks) -> jax.Array:
    """``[B, T, H, dv]``: softmax attention of ``p`` (differential when it has ``q2``).
    ``masks``: ``causal``, ``segment_ids``, ``kv_segment_ids``, and for a sequence split over a
    ``context`` mesh axis the tokens' ``positions`` and the ``context`` spec; ``logit_max=True``
    returns ``(out, maxes)``, each row's largest logit per map (:func:`diffjax.ops.differential_attention`)."""
    if p.q2 is None:
        return ops.dot_product_attention(p.q, p.k, p.v, scale=scale, impl=impl, **masks)
    return ops.differential_attention(
        p.q, p.k, p.q2, p.k2, p.v, p.lam, scale=scale, impl=impl, **masks
    )


def _rotate(q, k, positions, x, theta: float, scaling: RopeScaling | None):
    """Interleaved rotary on every raw q and k head (rotary dim = head dim)."""
    cos, sin = rotary_angles(default_positions(x, positions), q.shape[-1], theta, scaling)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _pair_halves(x: jax.Array, axes) -> tuple[jax.Array, jax.Array]:
    """``x [B, T, 2n, d]`` -> raw heads ``2i`` and ``2i + 1``, each ``[B, T, n, d]``. Viewed
    pair-major ``[.., n, 2, d]``: slicing the pair axis (not a stride over the sharded head
    axis) keeps every pair on one device."""
    b, t, n2, d = x.shape
    x = x.reshape(b, t, n2 // 2, 2, d)
    return constrain(x[:, :, :, 0], *axes), constrain(x[:, :, :, 1], *axes)


# ---------------------------------------------------------------------------- KV cache
# Decoding (diffjax.nn.decode) calls ``extend``: the layer's keys and values go into a per-layer
# cache ``{name: [B, L, kv_heads, width]}`` (names: the Projection fields k, v and V1's k2) at
# slot ``index``. Two cases:
#
# - T > 1 (prefill, into an empty cache at slot 0): attention over the new tokens themselves,
#   causal, with ``segment_ids`` [B, T] (0 on left padding, 1 on the prompt) so that a prompt
#   token never sees padding; the keys/values are then stored.
# - T == 1 (one decoded token): its key/value is stored at ``index``, then the query attends to
#   the whole cache with ``kv_segment_ids`` [B, L] (1 on the slots that hold this row's tokens,
#   0 on padding and empty slots) against ``segment_ids`` [B, 1] of ones: the "kv lengths" mask,
#   which the fused kernels take as segment ids.
def _with_cache(p: Projection, cache: dict[str, jax.Array], index, kv_segment_ids):
    """``(projection to attend with, updated cache, mask keywords)``."""
    new = {n: getattr(p, n) for n in ("k", "k2", "v") if getattr(p, n) is not None}
    if set(cache) != set(new):
        raise ValueError(
            f"KV cache entries {sorted(cache)} do not match this layer's {sorted(new)}: the "
            f"cache was built for another attention kind"
        )
    new = {n: a.astype(cache[n].dtype) for n, a in new.items()}
    update = jax.lax.dynamic_update_slice_in_dim
    cache = {n: constrain(update(cache[n], new[n], index, axis=1), *CACHE_AXES) for n in cache}
    if p.q.shape[1] == 1:  # one token: attend to the whole cache
        return p._replace(**cache), cache, dict(causal=False, kv_segment_ids=kv_segment_ids)
    return p._replace(**new), cache, dict(causal=True)


class AttentionLayer(nnx.Module):
    """What the three layers share: head bookkeeping and its checks, bias-free linears, and
    the one body of the plain and the cached call. A layer defines ``project`` (q/k/v and
    lambda), ``output`` and ``cache_layout``.

    ``diagnostics`` (False unless set, e.g. by ``TransformerLM(..., diagnostics=True)``): a
    call under ``nnx.capture(..., nnx.Intermediate)`` also sows ``"logit_max"``, ``[maps]``
    float32, the largest attention logit ``q . k * scale`` of each softmax map over the batch,
    tokens and heads (the running row maximum of the fused kernels and the ring; the XLA
    path's own logits), and for DIFF V2 ``"lambda_std"``, the spread of ``sigmoid(lambda)``.
    Off, the call is exactly the plain one."""

    diagnostics: bool = False

    def _init_heads(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        num_kv_heads: int | None,
        head_dim: int,
        *,
        rope_theta: float,
        rope_scaling: RopeScaling | None,
        causal: bool,
        attention_impl,
        context: ContextSpec | None = None,
        target: KernelTarget | None = None,
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
        # what computes attention, decided now (never while tracing): a run's decision
        # (ops.Resolved: its Runtime's), else the setting for `target` (default: this
        # process's backend) on whole sequences; an unknown one fails here
        self.attention_impl = ops.resolve(attention_impl, target)
        self.target = self.attention_impl.target
        self.embed_dim, self.depth = embed_dim, depth
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.causal = causal
        # sequence parallelism over a `context` mesh axis: ring or all-gather, and how the
        # tokens lie over the axis. It runs when the decision above carries it (a model built
        # for a Runtime whose mesh splits the sequence: diffjax.nn.model.for_runtime); a layer
        # built by hand runs whole sequences. Default: the ring, the natural order.
        given = ContextSpec() if context is None else context
        self.context = self.attention_impl.context or given

    def _linear(self, n_in, n_out, dtype, param_dtype, kernel_init, rngs, axes=("embed", "heads")):
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

    def _init_gate(self, gate: str, width: int, args) -> None:
        """Gated attention's output gate (Qiu et al. 2025), ``gate_proj: D -> h`` ("headwise")
        or ``D -> h * width`` ("elementwise", ``width``: a head's output width); None for
        "none". Its kernel is initialised as the query projection's: the released code computes
        the gate as extra output columns of ``q_proj``."""
        if gate not in GATES:
            raise ValueError(f"{type(self).__name__}: gate must be one of {GATES}, got {gate!r}")
        self.gate = gate
        n_out = {"none": 0, "headwise": self.num_heads, "elementwise": self.num_heads * width}
        self.gate_proj = self._linear(self.embed_dim, n_out[gate], *args) if n_out[gate] else None

    def _gated(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """The heads ``o [B, T, H, dv]`` times ``sigmoid(gate_proj(x))`` (per head, or per
        channel), or ``o`` without a gate."""
        if self.gate_proj is None:
            return o
        b, t, h, dv = o.shape
        g = jax.nn.sigmoid(self.gate_proj(x)).reshape(
            b, t, h, dv if self.gate == "elementwise" else 1
        )
        return o * constrain(g, *_Q_ACT).astype(o.dtype)

    def _split_heads(self, x: jax.Array, positions, q_heads: int, k_heads: int, v_width: int):
        """q ``[B, T, q_heads, d]``, k ``[B, T, k_heads, d]`` (both rotated) and v ``[B, T,
        H_kv, v_width]`` from ``x [B, T, D]``."""
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{type(self).__name__} expects x of shape [batch, seq, {self.embed_dim}], "
                f"got {x.shape}"
            )
        b, t, _ = x.shape
        d = self.head_dim
        q = checkpoint_name(self.q_proj(x), "query_proj")
        k = checkpoint_name(self.k_proj(x), "key_proj")
        v = checkpoint_name(self.v_proj(x), "value_proj")
        q = constrain(q.reshape(b, t, q_heads, d), *_Q_ACT)
        k = constrain(k.reshape(b, t, k_heads, d), *_KV_ACT)
        v = constrain(v.reshape(b, t, self.num_kv_heads, v_width), *_KV_ACT)
        q, k = _rotate(q, k, positions, x, self.rope_theta, self.rope_scaling)
        return constrain(q, *_Q_ACT), constrain(k, *_KV_ACT), v

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        token_index: jax.Array | None = None,
    ) -> jax.Array:
        return self._forward(x, positions, segment_ids, token_index=token_index)[0]

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
        """Decoding: ``(output, updated cache)`` for ``x`` ``[B, T, D]`` written at slot
        ``index`` (see the KV cache notes above; :mod:`diffjax.nn.decode` drives it)."""
        name = type(self).__name__
        if not self.causal:
            raise ValueError(
                f"{name}.extend: decoding with a KV cache needs a causal layer (built with "
                f"causal=False)"
            )
        if x.shape[1] == 1 and kv_segment_ids is None:
            raise ValueError(
                f"{name}.extend: one decoded token needs kv_segment_ids [batch, cache length] "
                f"(which cache slots hold this row's tokens)"
            )
        return self._forward(x, positions, segment_ids, (cache, index, kv_segment_ids))

    def _forward(self, x, positions, segment_ids, cached=None, token_index=None):
        """The one body: ``(output, updated cache or None)``. ``positions`` rotate q and k;
        over a ``context`` axis the masks follow ``token_index`` (default ``positions``), so
        positions that restart at document starts never loosen causality."""
        p = self.project(x, positions)
        masks, cache = dict(causal=self.causal), None
        if cached is not None:
            p, cache, masks = _with_cache(p, *cached)
        elif p.lam is not None:
            _sow_lambda(self, p.lam)
        if p.q.shape[1] > 1:  # a sequence split over a `context` mesh axis: the index orders it
            masks.update(positions=positions if token_index is None else token_index)
        masks.update(scale=self.scale, impl=self.attention_impl)
        if cached is None and self.diagnostics and capturing(self):
            o, maxes = attend(p, segment_ids=segment_ids, logit_max=True, **masks)
            _sow_diagnostics(self, p, maxes)
        else:
            o = attend(p, segment_ids=segment_ids, **masks)
        return self.output(checkpoint_name(o, "attn_out"), x), cache

    def project(self, x: jax.Array, positions: jax.Array | None = None) -> Projection:
        raise NotImplementedError

    def output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """``out_proj`` of the heads ``o [B, T, H, dv]``, gated by the layer's input ``x`` when
        the layer has a gate, concatenated."""
        o = self._gated(o, x)
        b, t, h, dv = o.shape
        return self.out_proj(o.reshape(b, t, h * dv))


class MultiheadAttention(AttentionLayer):
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
        attention_impl="auto",
        context: ContextSpec | None = None,
        target: KernelTarget | None = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        gate: str = "none",
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
            depth,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            causal=causal,
            attention_impl=attention_impl,
            context=context,
            target=target,
        )
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        args = (dtype, param_dtype, kernel_init, rngs)
        self.q_proj = self._linear(embed_dim, h * d, *args)
        self.k_proj = self._linear(embed_dim, hkv * d, *args, axes=("embed", "kv_heads"))
        self.v_proj = self._linear(embed_dim, hkv * d, *args, axes=("embed", "kv_heads"))
        self.out_proj = self._linear(h * d, embed_dim, *args, axes=("heads", "embed"))
        self._init_gate(gate, d, args)

    def project(self, x: jax.Array, positions: jax.Array | None = None) -> Projection:
        """q ``[B, T, H, d]``, k and v ``[B, T, H_kv, d]``, after rotary."""
        return Projection(
            *self._split_heads(x, positions, self.num_heads, self.num_kv_heads, self.head_dim)
        )

    def cache_layout(self) -> dict[str, tuple[int, int]]:
        """The KV cache entries of this layer: name -> (kv heads, width) per token."""
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}


class MultiheadDiffAttn(AttentionLayer):
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
        ramp: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        causal: bool = True,
        attention_impl="auto",
        context: ContextSpec | None = None,
        target: KernelTarget | None = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        gate: str = "none",
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
            depth,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            causal=causal,
            attention_impl=attention_impl,
            context=context,
            target=target,
        )
        value = lambda_init_fn(depth) if lambda_init is None else lambda_init
        self.lambda_init, self.output_scale = lambda_init_variables(value)
        n_rep = self.num_heads // self.num_kv_heads
        args = (dtype, param_dtype, kernel_init, rngs)
        self.q_proj = self._linear(embed_dim, embed_dim, *args)
        kv = ("embed", "kv_heads")
        self.k_proj = self._linear(embed_dim, embed_dim // n_rep, *args, axes=kv)
        self.v_proj = self._linear(embed_dim, embed_dim // n_rep, *args, axes=kv)
        self.out_proj = self._linear(embed_dim, embed_dim, *args, axes=("heads", "embed"))
        self._init_gate(gate, 2 * head_dim, args)
        init = nnx.initializers.normal(0.1)
        k1, k2, k3, k4 = jax.random.split(rngs.params(), 4)
        self.lambda_q1 = param(init(k1, (head_dim,), jnp.float32), "head_dim")
        self.lambda_k1 = param(init(k2, (head_dim,), jnp.float32), "head_dim")
        self.lambda_q2 = param(init(k3, (head_dim,), jnp.float32), "head_dim")
        self.lambda_k2 = param(init(k4, (head_dim,), jnp.float32), "head_dim")
        self.subln = RMSNorm(2 * head_dim, eps=norm_eps, param_dtype=param_dtype) if norm else None
        self.ramp = ramp_param(ramp)

    def lambda_full(self) -> jax.Array:
        """The layer's lambda (float32 scalar)."""
        return differential_lambda(
            self.lambda_q1[...],
            self.lambda_k1[...],
            self.lambda_q2[...],
            self.lambda_k2[...],
            self.lambda_init[...],
        )

    def project(self, x: jax.Array, positions: jax.Array | None = None) -> Projection:
        """Q1, Q2 ``[B, T, h, d]``, K1, K2 ``[B, T, h_kv, d]``, V ``[B, T, h_kv, 2d]`` (after
        rotary, in the flash_1 pairing) and the scalar lambda."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._split_heads(x, positions, 2 * h, 2 * hkv, 2 * d)
        (q1, q2), (k1, k2) = _pair_halves(q, _Q_ACT), _pair_halves(k, _KV_ACT)
        return Projection(q1, k1, v, q2=q2, k2=k2, lam=_ramped(self, self.lambda_full()))

    def output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """The per-head RMSNorm times ``1 - lambda_init`` (unless built with ``norm=False``),
        then the gate (if any) and ``out_proj``."""
        if self.subln is not None:
            o = self.subln(o) * self.output_scale[...].astype(o.dtype)
        return super().output(o, x)

    def cache_layout(self) -> dict[str, tuple[int, int]]:
        """The KV cache entries of this layer: name -> (kv heads, width) per token. The raw key
        heads K1 (2g) and K2 (2g+1) of each kv group, and its value, 2d wide."""
        hkv, d = self.num_kv_heads, self.head_dim
        return {"k": (hkv, d), "k2": (hkv, d), "v": (hkv, 2 * d)}


class MultiheadDiffAttnV2(AttentionLayer):
    """Differential attention V2, as ``multihead_flashdiffv2.py`` with ``use_diff_v2=True``.

    ``num_heads`` = h output heads over 2h query heads of width ``head_dim`` = d (default
    ``embed_dim // num_heads``); query heads 2i and 2i+1 form pair i and share kv group
    ``i // (h / h_kv)``. ``q_proj: D -> 2h d``, ``k_proj``/``v_proj: D -> h_kv d``,
    ``out_proj: h d -> D`` (the official file's ``o_proj``), ``lambda_proj: D -> h``;
    ``O_i = O_{2i} - sigmoid(lambda_proj(x))_i O_{2i+1}`` (lambda per token and head, in
    float32). No per-head norm.
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
        attention_impl="auto",
        context: ContextSpec | None = None,
        target: KernelTarget | None = None,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        kernel_init=torch_linear_init,
        lambda_proj_init=torch_linear_init,
        ramp: bool = False,
        gate: str = "none",
        rngs: nnx.Rngs,
    ):
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"MultiheadDiffAttnV2: embed_dim={embed_dim} is not divisible by "
                    f"num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        self._init_heads(
            embed_dim,
            depth,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            causal=causal,
            attention_impl=attention_impl,
            context=context,
            target=target,
            kv_note=", or the query pairs (2i, 2i+1) straddle kv groups",
        )
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        args = (dtype, param_dtype, kernel_init, rngs)
        self.q_proj = self._linear(embed_dim, 2 * h * d, *args)
        self.k_proj = self._linear(embed_dim, hkv * d, *args, axes=("embed", "kv_heads"))
        self.v_proj = self._linear(embed_dim, hkv * d, *args, axes=("embed", "kv_heads"))
        self.out_proj = self._linear(h * d, embed_dim, *args, axes=("heads", "embed"))
        self._init_gate(gate, d, args)
        # lambda is computed in float32 whatever the activation dtype.
        # (``lambda_proj_init``: torch's default Linear init, as the official code leaves it.)
        self.lambda_proj = self._linear(
            embed_dim, h, jnp.float32, param_dtype, lambda_proj_init, rngs
        )
        self.ramp = ramp_param(ramp)

    def lambda_values(self, x: jax.Array) -> jax.Array:
        """Per-token, per-head lambda ``sigmoid(lambda_proj(x))``, ``[batch, seq, h]`` float32."""
        lam = jax.nn.sigmoid(self.lambda_proj(x.astype(jnp.float32)))
        return constrain(lam, "act_batch", "act_seq", "act_heads")

    def project(self, x: jax.Array, positions: jax.Array | None = None) -> Projection:
        """Q1, Q2 ``[B, T, h, d]`` (query heads 2i and 2i+1, pair-major, so a head-sharded q
        splits into whole pairs), the shared key K and V ``[B, T, h_kv, d]`` (after rotary),
        and lambda ``[B, T, h]``."""
        q, k, v = self._split_heads(
            x, positions, 2 * self.num_heads, self.num_kv_heads, self.head_dim
        )
        q1, q2 = _pair_halves(q, _Q_ACT)
        return Projection(q1, k, v, q2=q2, lam=_ramped(self, self.lambda_values(x)))

    def cache_layout(self) -> dict[str, tuple[int, int]]:
        """The KV cache entries of this layer: name -> (kv heads, width) per token. One key and
        one value per kv head, read once for both maps of every pair."""
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}


def capturing(module: nnx.Module) -> bool:
    """Whether a call of ``module`` runs under ``nnx.capture`` (see :func:`_sow_lambda` for
    this test)."""
    return hasattr(module, "__captures__")


def _sow_diagnostics(layer: AttentionLayer, p: Projection, maxes: jax.Array) -> None:
    """Sow ``"logit_max"`` (``maxes [maps, B, T, H]`` reduced to ``[maps]``; a row that sees no
    key, at -inf, never wins) and, for a per-token lambda (V2), ``"lambda_std"``."""
    layer.sow(nnx.Intermediate, "logit_max", jnp.max(maxes, axis=(1, 2, 3)))
    if p.lam is not None and jnp.ndim(p.lam) > 0:
        layer.sow(nnx.Intermediate, "lambda_std", jnp.std(p.lam))


def _sow_lambda(layer: nnx.Module, lam: jax.Array) -> None:
    """Sow the mean of a DIFF layer's lambda in this call (V1: its scalar; V2: over batch,
    tokens and heads) as the ``nnx.Intermediate`` ``"lambda"`` when the call runs under
    ``nnx.capture(..., nnx.Intermediate)`` (:func:`diffjax.nn.model.sown_lambdas` reads it).
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
    if capturing(layer):
        layer.sow(nnx.Intermediate, "lambda", jnp.mean(lam))


def differential_lambda(
    lq1: jax.Array, lk1: jax.Array, lq2: jax.Array, lk2: jax.Array, lambda_init
) -> jax.Array:
    """DIFF V1's re-parameterised lambda, ``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``, float32."""
    f32 = jnp.float32
    return (
        jnp.exp(jnp.sum(lq1.astype(f32) * lk1.astype(f32)))
        - jnp.exp(jnp.sum(lq2.astype(f32) * lk2.astype(f32)))
        + jnp.asarray(lambda_init, f32)
    )


__all__ = [
    "AttentionLayer",
    "LambdaInit",
    "lambda_init_variables",
    "MultiheadAttention",
    "MultiheadDiffAttn",
    "MultiheadDiffAttnV2",
    "Projection",
    "Ramp",
    "attend",
    "differential_lambda",
]
