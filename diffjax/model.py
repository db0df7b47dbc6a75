"""The decoder-only language model: embedding, L pre-norm blocks, final norm, output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import AttentionLayer, MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2
from .config import ModelConfig
from .layers import Linear, RMSNorm, SwiGLU, as_dtype
from .sharding import constrain, param_init

_ACT = ("act_batch", "act_seq", "act_embed")


def make_attention(config: ModelConfig, depth: int, *, rngs: nnx.Rngs) -> AttentionLayer:
    """The attention layer of block ``depth`` for ``config.attention``."""
    args = (config.d_model, depth, config.num_heads, config.kv_heads)
    common = dict(
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling_spec,
        attention_impl=config.attention_impl,
        dtype=as_dtype(config.dtype),
        param_dtype=as_dtype(config.param_dtype),
        kernel_init=nnx.initializers.normal(config.init_std),
        rngs=rngs,
    )
    if config.attention == "standard":
        return MultiheadAttention(*args, head_dim=config.resolved_head_dim, **common)
    if config.attention == "diff_v1":
        return MultiheadDiffAttn(
            *args,
            lambda_init=config.lambda_init,
            norm=config.diff_norm,
            norm_eps=config.diff_norm_eps,
            **common,
        )
    if config.attention == "diff_v2":
        return MultiheadDiffAttnV2(*args, head_dim=config.resolved_head_dim, **common)
    raise AssertionError(config.attention)  # unreachable: ModelConfig validates the kind


class Block(nnx.Module):
    """``x + attn(norm(x))``, then ``x + ffn(norm(x))`` (LLaMA's pre-norm residual block)."""

    def __init__(self, config: ModelConfig, depth: int, *, rngs: nnx.Rngs):
        pdt = as_dtype(config.param_dtype)
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt)
        self.attn = make_attention(config, depth, rngs=rngs)
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt)
        self.ffn = SwiGLU(
            config.d_model,
            config.resolved_ffn_dim,
            dtype=as_dtype(config.dtype),
            param_dtype=pdt,
            kernel_init=nnx.initializers.normal(config.init_std),
            rngs=rngs,
        )

    def __call__(self, x, positions=None, segment_ids=None):
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids), *_ACT)
        return constrain(x + self.ffn(self.ffn_norm(x)), *_ACT)

    def extend(self, x, positions, cache, **step):
        """Decoding with a KV cache: ``(x, updated layer cache)`` (see :mod:`diffjax.decode`)."""
        a, cache = self.attn.extend(self.attn_norm(x), positions, cache, **step)
        x = constrain(x + a, *_ACT)
        return constrain(x + self.ffn(self.ffn_norm(x)), *_ACT), cache


class TransformerLM(nnx.Module):
    """Decoder-only LM. ``model(tokens [B, T] int) -> logits [B, T, vocab]`` (float32).

    ``positions`` (``[B, T]``, default ``arange(T)``) and ``segment_ids`` (``[B, T]``, packed
    sequences: no attention across segments) are passed to every attention layer.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"TransformerLM takes a ModelConfig, got {type(config).__name__}")
        self.config = config
        dt, pdt = as_dtype(config.dtype), as_dtype(config.param_dtype)
        init = nnx.initializers.normal(config.init_std)
        self.embed = nnx.Embed(
            config.vocab_size,
            config.d_model,
            dtype=dt,
            param_dtype=pdt,
            embedding_init=param_init(init, "vocab", "embed"),
            rngs=rngs,
        )
        self.layers = nnx.List([Block(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt)
        self.lm_head = (
            None
            if config.tie_embeddings
            else Linear(
                config.d_model,
                config.vocab_size,
                use_bias=False,
                dtype=dt,
                param_dtype=pdt,
                kernel_init=param_init(init, "embed", "vocab"),
                rngs=rngs,
            )
        )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(
                f"TransformerLM expects tokens of shape [batch, seq], got {tokens.shape}"
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"TransformerLM expects integer tokens, got dtype {tokens.dtype}")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds ModelConfig.max_seq_len="
                f"{cfg.max_seq_len}; raise max_seq_len or shorten the input"
            )
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and arr.shape != tokens.shape:
                raise ValueError(
                    f"{name} must have the shape of tokens {tokens.shape}, got {arr.shape}"
                )
        x = constrain(self._embed(tokens), *_ACT)
        for block in self.layers:
            x = block(x, positions, segment_ids)
        return self._logits(x)

    def extend(self, tokens: jax.Array, positions: jax.Array, caches, **step):
        """Decoding: ``(logits [B, T, vocab], updated caches)`` for ``tokens`` ``[B, T]`` at
        ``positions``, with one cache per layer. Use :func:`diffjax.decode.prefill`,
        :func:`diffjax.decode.decode_step` or :func:`diffjax.generate`, which build the masks."""
        x = constrain(self._embed(tokens), *_ACT)
        new = []
        for block, cache in zip(self.layers, caches, strict=True):
            x, cache = block.extend(x, positions, cache, **step)
            new.append(cache)
        return self._logits(x), tuple(new)

    def _logits(self, x: jax.Array) -> jax.Array:
        """Final norm and output head, float32 logits."""
        x = self.norm(x)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return constrain(logits.astype(jnp.float32), "act_batch", "act_seq", "act_vocab")

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """The embedding lookup. Under a mesh the table is gathered over its ``embed`` (fsdp)
        shards first, FSDP-style, so the lookup's output (and, backward, the table's gradient)
        is split by batch rows and not by width: GSPMD left alone would all-gather the
        activations' gradient instead."""
        table = self.embed.embedding[...].astype(self.embed.dtype or self.embed.param_dtype)
        return jnp.take(constrain(table, "act_vocab", None), tokens, axis=0)

    def lambdas(self) -> list[jax.Array] | None:
        """DIFF V1: each layer's learned lambda (float32 scalars, from the parameters); None for
        the other kinds (DIFF V2's lambda depends on the input: see :func:`sown_lambdas`)."""
        if self.config.attention == "diff_v1":
            return [block.attn.lambda_full() for block in self.layers]
        return None


def sown_lambdas(intermediates: nnx.State) -> list[jax.Array]:
    """Each layer's lambda in a call of a :class:`TransformerLM` under ``nnx.capture(...,
    nnx.Intermediate)``: DIFF V1's scalar, DIFF V2's mean over the batch, tokens and heads
    (float32 scalars, the first call's); ``[]`` for standard attention. ::

        logits, intermediates = nnx.capture(model, nnx.Intermediate)(tokens)
        lambdas = sown_lambdas(intermediates)
    """
    layers = nnx.to_pure_dict(intermediates).get("layers", {})
    return [
        layers[i]["attn"]["lambda"][0]
        for i in sorted(layers)
        if "lambda" in layers[i].get("attn", {})
    ]
