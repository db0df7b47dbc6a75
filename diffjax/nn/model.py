"""The decoder-only language model: embedding, L pre-norm blocks, final norm, output head.

Two layouts of the blocks' parameters (``ModelConfig.scan_layers``):

- unrolled: ``model.layers`` is a list of L :class:`Block` s, run one after another;
- scanned: ``model.layers`` is one :class:`Block` whose every variable has a leading layer
  axis ``[L, ...]`` (logical axis ``"layers"``), run with one ``nnx.scan``: the step compiles
  one block, not L, so compile time stays flat with depth.

Both compute the same function; :func:`stack_layers` and :func:`unstack_layers` convert a
model between them, and :meth:`TransformerLM.blocks` gives each layer as a :class:`Block` in
either layout (what per-layer analyses read). ``ModelConfig.remat`` chooses what each block
keeps for the backward pass (:func:`remat_policy`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from diffjax import ops
from diffjax.nn.attention import (
    capturing,
    SAVED_NAMES,
    AttentionLayer,
    MultiheadAttention,
    MultiheadDiffAttn,
    MultiheadDiffAttnV2,
    lambda_init_variables,
)
from diffjax.config import ConfigError, ContextSpec, KernelTarget, ModelConfig, lambda_init_fn
from diffjax.nn.layers import Linear, RMSNorm, SwiGLU, as_dtype
from diffjax.infra.sharding import constrain, param_init

_ACT = ("act_batch", "act_seq", "act_embed")


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of ``ModelConfig.remat`` (None for ``"none"``: no
    rematerialization). ``"full"`` saves nothing inside a block; ``"dots"`` saves the outputs of
    the matmuls with no batch dimension (the projections and the FFN, not the attention maps);
    ``"minimal"`` saves the named q/k/v projections and attention output
    (:data:`diffjax.nn.attention.SAVED_NAMES`); ``"minimal_offload"`` moves those to host memory
    (pinned host) and brings them back for the backward pass."""
    policies = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return policies.nothing_saveable
    if name == "dots":
        return policies.dots_with_no_batch_dims_saveable
    if name == "minimal":
        return policies.save_only_these_names(*SAVED_NAMES)
    if name == "minimal_offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise AssertionError(name)  # unreachable: ModelConfig validates the policy


def make_attention(
    config: ModelConfig,
    depth: int,
    *,
    rngs: nnx.Rngs,
    context: ContextSpec | None = None,
    target: KernelTarget | None = None,
    attention_impl=None,
) -> AttentionLayer:
    """The attention layer of block ``depth`` for ``config.attention``; ``context``: how it
    runs over a ``context`` mesh axis (default: ``config.context_attention``, the natural
    order); ``target``: the machine it is traced for (default: this process's backend);
    ``attention_impl``: a name or an implementation object (default ``config.attention_impl``)."""
    args = (config.d_model, depth, config.num_heads, config.kv_heads)
    common = dict(
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling_spec,
        attention_impl=config.attention_impl if attention_impl is None else attention_impl,
        context=context_spec(config, context),
        target=target,
        dtype=as_dtype(config.dtype),
        param_dtype=as_dtype(config.param_dtype),
        kernel_init=nnx.initializers.normal(config.init_std),
        gate=config.gate,
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
            ramp=config.ramp,
            **common,
        )
    if config.attention == "diff_v2":
        return MultiheadDiffAttnV2(
            *args, head_dim=config.resolved_head_dim, ramp=config.ramp, **common
        )
    raise AssertionError(config.attention)  # unreachable: ModelConfig validates the kind


class Block(nnx.Module):
    """``x + attn(norm(x))``, then ``x + ffn(norm(x))`` (LLaMA's pre-norm residual block)."""

    def __init__(
        self,
        config: ModelConfig,
        depth: int,
        *,
        rngs: nnx.Rngs,
        context: ContextSpec | None = None,
        target: KernelTarget | None = None,
        attention_impl=None,
        diagnostics: bool = False,
    ):
        pdt = as_dtype(config.param_dtype)
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt)
        self.attn = make_attention(
            config, depth, rngs=rngs, context=context, target=target, attention_impl=attention_impl
        )
        # under nnx.capture: the attention's signals, and this block's largest |activation|
        self.diagnostics = self.attn.diagnostics = diagnostics
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt)
        self.ffn = SwiGLU(
            config.d_model,
            config.resolved_ffn_dim,
            dtype=as_dtype(config.dtype),
            param_dtype=pdt,
            kernel_init=nnx.initializers.normal(config.init_std),
            rngs=rngs,
        )

    def __call__(self, x, positions=None, segment_ids=None, token_index=None):
        x = constrain(x + self.attn(self.attn_norm(x), positions, segment_ids, token_index), *_ACT)
        x = constrain(x + self.ffn(self.ffn_norm(x)), *_ACT)
        if self.diagnostics and capturing(self):  # the residual stream's largest magnitude
            self.sow(nnx.Intermediate, "activation_max", jnp.max(jnp.abs(x)).astype(jnp.float32))
        return x

    def run(self, x, positions=None, segment_ids=None, token_index=None, *, remat: str = "none"):
        """``self(x, ...)`` under the rematerialization policy ``remat`` (:func:`remat_policy`).
        What the block sows (the attention's lambda, the diagnostics) is sown as in a plain
        call."""
        masks = (positions, segment_ids, token_index)
        if remat == "none":  # the plain call (what nnx.capture's method outputs record)
            return self(x, *masks)
        graphdef, state = nnx.split(self)
        y, sown = apply_block(graphdef, state, x, masks, remat, capturing(self))
        resow(self, sown)
        return y

    def extend(self, x, positions, cache, **step):
        """Decoding with a KV cache: ``(x, updated layer cache)`` (see :mod:`diffjax.nn.decode`)."""
        a, cache = self.attn.extend(self.attn_norm(x), positions, cache, **step)
        x = constrain(x + a, *_ACT)
        return constrain(x + self.ffn(self.ffn_norm(x)), *_ACT), cache


def apply_block(graphdef, state, x, masks, remat: str, capture: bool):
    """One block as a pure function of its state: ``(output, sown)``, ``sown`` what the block
    sows when ``capture`` (``{"attn": {name: value}, name: value}``, the first value of each;
    else None), under the policy ``remat``. Pure, so it can run under ``jax.checkpoint`` and
    ``jax.lax.scan`` with a model closed over from outside (NNX's own transforms refuse
    variables created at another trace level). ``masks``: the block's ``(positions,
    segment_ids, token_index)``."""

    def call(state, x):
        block = nnx.merge(graphdef, state)
        if not capture:
            return block(x, *masks), None
        y, sown = nnx.capture(Block.__call__, nnx.Intermediate)(block, x, *masks)
        return y, jax.tree.map(lambda v: v[0], nnx.to_pure_dict(sown), is_leaf=_is_sown)

    policy = remat_policy(remat)
    if policy is not None:
        call = jax.checkpoint(call, policy=policy, prevent_cse=False)
    return call(state, x)


def _is_sown(x) -> bool:
    return isinstance(x, tuple)  # the values one name was sown with, in call order


def resow(block: Block, sown: dict | None) -> None:
    """Sow ``sown`` (what :func:`apply_block` returns, or the same stacked over layers) on
    ``block`` and its attention layer, as a plain call of them would have."""
    for name, value in (sown or {}).items():
        if name == "attn":
            for attn_name, v in value.items():
                block.attn.sow(nnx.Intermediate, attn_name, v)
        else:
            block.sow(nnx.Intermediate, name, value)


class TransformerLM(nnx.Module):
    """Decoder-only LM. ``model(tokens [B, T] int) -> logits [B, T, vocab]`` (float32).

    ``positions`` (``[B, T]``, default ``arange(T)``: the rotary positions, e.g. restarting at
    each document start), ``segment_ids`` (``[B, T]``, packed sequences: no attention across
    segments) and ``token_index`` (``[B, T]``, each token's index in its row before the tokens
    were reordered over a ``context`` mesh axis: the order the causal mask and the context ring
    follow; default ``positions``) are passed to every attention layer.

    ``context``: how attention runs when a ``context`` mesh axis splits the sequence, and the
    order the tokens lie in over it (:class:`diffjax.config.ContextSpec`; default: the ring
    of ``config.context_attention``, the natural order). A run builds its model with the
    spec it lays the batches out by. ``target``: the machine it is traced for
    (:class:`diffjax.config.KernelTarget`; default: this process's backend, taken when built).
    ``attention_impl``: every layer's implementation, a name or an object with the two
    functions (default: ``config.attention_impl``; e.g. the quantized logits of the analyses).
    ``diagnostics``: a call under ``nnx.capture(..., nnx.Intermediate)`` also sows each
    layer's signals (:func:`sown_diagnostics`); off, every call is the plain one.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        context: ContextSpec | None = None,
        target: KernelTarget | None = None,
        attention_impl=None,
        diagnostics: bool = False,
    ):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"TransformerLM takes a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.context = context = context_spec(config, context)
        # every layer's attention, decided once (ops.resolve): a run's decision (its Runtime's
        # ops.Resolved), else the setting (None: the config's) for `target` on whole sequences
        resolved = ops.resolve(
            config.attention_impl if attention_impl is None else attention_impl, target
        )
        if resolved.context not in (None, context):  # built again for another token order
            resolved = resolved.redecided(resolved.target, context)
        self.attention_impl, self.target = resolved, resolved.target
        self.diagnostics = diagnostics
        attn = dict(
            context=context, target=self.target, attention_impl=resolved, diagnostics=diagnostics
        )
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
        if config.scan_layers:
            self.layers = _stacked_blocks(config, rngs, attn)
        else:
            blocks = [Block(config, i, rngs=rngs, **attn) for i in range(config.num_layers)]
            self.layers = nnx.List(blocks)
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
        token_index: jax.Array | None = None,
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
        masks = (positions, segment_ids, token_index)
        for name, arr in zip(("positions", "segment_ids", "token_index"), masks):
            if arr is not None and arr.shape != tokens.shape:
                raise ValueError(
                    f"{name} must have the shape of tokens {tokens.shape}, got {arr.shape}"
                )
        x = constrain(self._embed(tokens), *_ACT)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            capture = capturing(self.layers)

            def body(x, layer):
                return apply_block(graphdef, layer, x, masks, cfg.remat, capture)

            x, sown = jax.lax.scan(body, x, state)
            resow(self.layers, sown)  # each value stacked, [L, ...]
        else:
            for block in self.layers:
                x = block.run(x, *masks, remat=cfg.remat)
        return self._logits(x)

    def extend(self, tokens: jax.Array, positions: jax.Array, caches, **step):
        """Decoding: ``(logits [B, T, vocab], updated caches)`` for ``tokens`` ``[B, T]`` at
        ``positions``, with one cache per layer (scanned layers: one cache whose arrays have a
        leading layer axis). Use :func:`diffjax.nn.decode.prefill`,
        :func:`diffjax.nn.decode.decode_step` or :func:`diffjax.generate`, which build the masks."""
        x = constrain(self._embed(tokens), *_ACT)
        if self.config.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x, layer_and_cache):
                layer, cache = layer_and_cache
                return nnx.merge(graphdef, layer).extend(x, positions, cache, **step)

            x, cache = jax.lax.scan(body, x, (state, caches[0]))
            return self._logits(x), (cache,)
        new = []
        for block, cache in zip(self.layers, caches, strict=True):
            x, cache = block.extend(x, positions, cache, **step)
            new.append(cache)
        return self._logits(x), tuple(new)

    def blocks(self) -> list[Block]:
        """Each layer as a :class:`Block`, in order: ``model.layers`` itself when unrolled; for
        scanned layers, one block per layer holding that layer's slice of the stacked
        parameters (copies: for analyses, not for training)."""
        if not self.config.scan_layers:
            return list(self.layers)
        state = nnx.to_pure_dict(nnx.state(self.layers))
        out = []
        for i in range(self.config.num_layers):
            block = _abstract_block(self.config, self._attention_args())
            nnx.update(block, jax.tree.map(lambda a, i=i: a[i], state))
            out.append(block)
        return out

    def _attention_args(self) -> dict:
        """How this model's attention was built (to build another like it)."""
        return dict(
            context=self.context,
            target=self.target,
            attention_impl=self.attention_impl,
            diagnostics=self.diagnostics,
        )

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
            if self.config.scan_layers:
                graphdef, state = nnx.split(self.layers.attn)
                return list(jax.vmap(lambda s: nnx.merge(graphdef, s).lambda_full())(state))
            return [block.attn.lambda_full() for block in self.layers]
        return None


def initial_rest(config: ModelConfig) -> nnx.State:
    """The non-parameter state of a new model of ``config`` (DIFF V1's per-layer
    ``lambda_init``): what goes beside parameters read from a checkpoint. Computed in one jitted
    function that XLA prunes to these few values (the parameters' initialisers are dropped)."""
    return jax.jit(lambda: nnx.split(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param, ...)[2])()


# ---------------------------------------------------------------------------- the two layouts
def _stacked_blocks(config: ModelConfig, rngs: nnx.Rngs, attn: dict) -> Block:
    """L blocks as one :class:`Block` with a leading layer axis on every variable (logical
    axis ``"layers"``), each layer from its own split of ``rngs``; DIFF V1's per-layer
    ``lambda_init`` is written in afterwards."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(config, 0, rngs=rngs, **attn)

    blocks = make(rngs)
    if isinstance(blocks.attn, MultiheadDiffAttn):
        values = [
            lambda_init_fn(i) if config.lambda_init is None else config.lambda_init
            for i in range(config.num_layers)
        ]
        blocks.attn.lambda_init, blocks.attn.output_scale = lambda_init_variables(values)
    return blocks


def _abstract_block(config: ModelConfig, attn: dict) -> Block:
    return nnx.eval_shape(lambda: Block(config, 0, rngs=nnx.Rngs(0), **attn))


def _convert(model: TransformerLM, scan_layers: bool, layers) -> TransformerLM:
    """A model of the other layout whose parameters are ``model``'s, blocks replaced by
    ``layers`` (a pure-dict state in the new layout)."""
    config = model.config.replace(scan_layers=scan_layers)
    attn = model._attention_args()
    new = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0), **attn))
    state = nnx.to_pure_dict(nnx.state(model))
    state["layers"] = layers
    nnx.update(new, state)
    return new


def context_spec(config: ModelConfig, context: ContextSpec | None = None) -> ContextSpec:
    """``context``, or the default of a model of ``config`` (its ``context_attention``, the
    natural order); a spec whose implementation is not the config's is refused."""
    if context is None:
        return ContextSpec(impl=config.context_attention)
    if context.impl != config.context_attention:
        raise ConfigError(
            f"ContextSpec.impl: {context.impl!r} differs from the model's "
            f"context_attention={config.context_attention!r}. Fix: build the spec from the "
            f"model config (ContextSpec(impl=config.context_attention, order=...))"
        )
    return context


def with_context(model: TransformerLM, context: ContextSpec) -> TransformerLM:
    """A model built with ``context`` that holds ``model``'s parameters (``model`` itself when
    it was built with it; ``model`` is never changed): for a model loaded without knowing the
    order its tokens will lie in over a ``context`` mesh axis."""
    return model if model.context == context else rebuilt(model, context=context)


def for_runtime(model: TransformerLM, runtime) -> TransformerLM:
    """``model`` as a :class:`diffjax.infra.runtime.Runtime` runs it: its attention as the
    runtime decided it (``runtime.attention`` for the model's setting; else decided now for the
    runtime's kernel target and, where its mesh splits the sequence, its context spec):
    ``model`` itself when it was built so, otherwise a new model holding the same arrays."""
    asked = model.attention_impl.asked
    resolved = runtime.attention
    if resolved is None or resolved.asked != asked:  # a runtime built by hand, another setting
        resolved = ops.resolve(asked, runtime.kernel_target, context=runtime.split_context)
    changes = {}
    if resolved.context is not None and model.context != resolved.context:
        changes["context"] = context_spec(model.config, resolved.context)
    if model.attention_impl != resolved:
        changes["attention_impl"] = resolved
    return rebuilt(model, **changes) if changes else model


def rebuilt(model: TransformerLM, **attention) -> TransformerLM:
    """A new model built like ``model`` but for the given ``context``, ``target`` or
    ``attention_impl``, holding ``model``'s variables (the same arrays; ``model`` is never
    changed)."""
    attn = {**model._attention_args(), **attention}
    if isinstance(attention.get("attention_impl"), ops.Resolved):  # it carries its own target
        attn["target"] = attention["attention_impl"].target
    new = nnx.eval_shape(lambda: TransformerLM(model.config, rngs=nnx.Rngs(0), **attn))
    nnx.update(new, nnx.state(model))
    return new


def stack_layers(model: TransformerLM) -> TransformerLM:
    """``model`` (unrolled layers) as a model with ``scan_layers=True`` and the same
    parameters, stacked on a leading layer axis. The same function: outputs and gradients
    equal the unrolled model's."""
    if model.config.scan_layers:
        raise ValueError("stack_layers: the model's layers are already stacked (scan_layers=True)")
    per_layer = [nnx.to_pure_dict(nnx.state(b)) for b in model.layers]
    return _convert(model, True, jax.tree.map(lambda *a: jnp.stack(a), *per_layer))


def unstack_layers(model: TransformerLM) -> TransformerLM:
    """``model`` (stacked layers) as a model with ``scan_layers=False`` and the same
    parameters, one :class:`Block` per layer."""
    if not model.config.scan_layers:
        raise ValueError("unstack_layers: the model's layers are not stacked (scan_layers=False)")
    state = nnx.to_pure_dict(nnx.state(model.layers))
    layers = {i: jax.tree.map(lambda a, i=i: a[i], state) for i in range(model.config.num_layers)}
    return _convert(model, False, layers)


def sown_lambdas(intermediates: nnx.State) -> list[jax.Array]:
    """Each layer's lambda in a call of a :class:`TransformerLM` under ``nnx.capture(...,
    nnx.Intermediate)``: DIFF V1's scalar, DIFF V2's mean over the batch, tokens and heads
    (float32 scalars, the first call's); ``[]`` for standard attention. ::

        logits, intermediates = nnx.capture(model, nnx.Intermediate)(tokens)
        lambdas = sown_lambdas(intermediates)
    """
    layers = nnx.to_pure_dict(intermediates).get("layers", {})
    if "attn" in layers:  # scanned layers: one stacked value, [L]
        return list(layers["attn"]["lambda"][0]) if "lambda" in layers["attn"] else []
    return [
        layers[i]["attn"]["lambda"][0]
        for i in sorted(layers)
        if "lambda" in layers[i].get("attn", {})
    ]


# what sown_diagnostics reads: (where it is sown, its name), "attn" for the attention layer
SOWN_DIAGNOSTICS = (
    ("attn", "logit_max"),  # [maps]: the largest attention logit of each softmax map
    ("attn", "lambda_std"),  # DIFF V2: the spread of sigmoid(lambda) over batch, tokens, heads
    ("block", "activation_max"),  # the residual stream's largest |value| after the block
)


def sown_diagnostics(intermediates: nnx.State) -> dict[str, jax.Array]:
    """Each layer's diagnostics in a call of a :class:`TransformerLM` built with
    ``diagnostics=True`` under ``nnx.capture(..., nnx.Intermediate)``: ``{name: [L, ...]}``
    for the names of :data:`SOWN_DIAGNOSTICS` the model sowed (the first call's). ::

        model = TransformerLM(config, rngs=nnx.Rngs(0), diagnostics=True)
        logits, intermediates = nnx.capture(model, nnx.Intermediate)(tokens)
        sown_diagnostics(intermediates)["logit_max"]  # [num_layers, maps]
    """
    layers = nnx.to_pure_dict(intermediates).get("layers", {})
    stacked = "attn" in layers or any(n in layers for _, n in SOWN_DIAGNOSTICS)
    per_layer = [layers] if stacked else [layers[i] for i in sorted(layers)]
    out = {}
    for where, name in SOWN_DIAGNOSTICS:
        found = [(d.get("attn", {}) if where == "attn" else d).get(name) for d in per_layer]
        if found and all(f is not None for f in found):
            out[name] = found[0][0] if stacked else jnp.stack([f[0] for f in found])
    return out
