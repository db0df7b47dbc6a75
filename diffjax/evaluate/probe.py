"""Reading a :class:`diffjax.TransformerLM`'s inside without changing it: each block's attention
input (the output of ``attn_norm``) and output (the hidden state after both residuals), captured
with ``nnx.capture(..., method_outputs=nnx.Intermediate)``; :func:`attention_maps` and
:func:`attention_logits` then recompute a layer's maps and logits from its input, from the
layer's projections (``layer.project``) and the reference math
(:mod:`diffjax.kernels.reference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diffjax.ops import context
from diffjax.infra import sharding
from diffjax.nn.attention import AttentionLayer, Projection
from diffjax.data.documents import DOCUMENT_ARRAYS
from diffjax.kernels import reference
from diffjax.nn.model import TransformerLM, for_runtime, unstack_layers
from diffjax.infra.runtime import Runtime


def check_model(model) -> None:
    if not isinstance(model, TransformerLM):
        raise TypeError(
            f"expected a diffjax.TransformerLM, got {type(model).__name__}. Fix: "
            f"build one with diffjax.TransformerLM(config) or load one with "
            f"diffjax.train.load_model(run_folder)"
        )


def for_analysis(model: TransformerLM) -> TransformerLM:
    """``model`` as the per-layer analyses read it: one :class:`~diffjax.nn.model.Block` per layer
    (a scanned model is unstacked; layer i keeps its index) and no rematerialization (nothing
    is differentiated, and each block's call must be the model's own for ``nnx.capture``).
    The parameters are shared or sliced, never changed."""
    check_model(model)
    if model.config.scan_layers:
        model = unstack_layers(model)
    if model.config.remat != "none":
        model = nnx.merge(*nnx.split(model))
        model.config = model.config.replace(remat="none")
    return model


def check_tokens(model, tokens) -> jax.Array:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"expected integer tokens [batch, seq], got {tokens.dtype} {tokens.shape}")
    if tokens.shape[1] > model.config.max_seq_len:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len "
            f"{model.config.max_seq_len}. Fix: use shorter inputs"
        )
    return tokens


def capture_layers(
    model, tokens: jax.Array, **masks
) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """``(logits, attention_inputs, block_outputs)``: the model's logits and, per block, the
    normalised input its attention layer sees and the block's output ``[B, T, D]``; ``masks``:
    the model's ``positions`` and ``segment_ids``, if any. Traceable (call it inside
    ``nnx.jit``)."""
    run = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)
    logits, inter = run(tokens, **masks)
    attn_in, outs = [], []
    for i in range(len(model.layers)):
        layer = inter["layers"][i]
        attn_in.append(layer["attn_norm"]["__call__"].get_value()[0])
        outs.append(layer["__call__"].get_value()[0])
    return logits, attn_in, outs


def _project(layer, x, positions) -> Projection:
    if not isinstance(layer, AttentionLayer):
        raise TypeError(
            f"expected a diffjax attention layer (MultiheadAttention, MultiheadDiffAttn or "
            f"MultiheadDiffAttnV2), got {type(layer).__name__}. Fix: pass model.layers[i].attn"
        )
    return layer.project(x, positions)


def _masking(layer, segment_ids) -> dict:
    return dict(causal=layer.causal, segment_ids=segment_ids, scale=layer.scale)


def attention_maps(
    layer, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> dict[str, jax.Array]:
    """The softmax maps of an attention ``layer`` on its input ``x`` ``[B, T, D]`` (float32,
    ``[B, heads, T, S]``), for analysis: standard attention ``a``; DIFF the two maps ``a1``,
    ``a2`` of each pair, ``lam`` (V1 a scalar, V2 ``[B, T, h]``) and the differential map
    ``diff = a1 - lam * a2``. Traceable; materialises ``T x S`` maps."""
    p = _project(layer, x, positions)
    kw = _masking(layer, segment_ids)
    if p.q2 is None:
        return {"a": reference.attention_weights(p.q, p.k, **kw)}
    a1 = reference.attention_weights(p.q, p.k, **kw)
    a2 = reference.attention_weights(p.q2, p.k if p.k2 is None else p.k2, **kw)
    lam = p.lam
    row_lam = lam if jnp.ndim(lam) == 0 else jnp.transpose(lam, (0, 2, 1))[..., None]
    return {"a1": a1, "a2": a2, "lam": lam, "diff": a1 - row_lam * a2}


def attention_rows(
    layer, x: jax.Array, rows: jax.Array, segment_ids: jax.Array | None = None
) -> dict[str, jax.Array]:
    """The rows ``rows`` ``[B, N]`` (int positions) of :func:`attention_maps` on ``x``
    ``[B, T, D]``: the same keys (``a``; DIFF ``a1``, ``a2``, ``lam`` and ``diff``) but
    ``[B, heads, N, S]`` (V2's ``lam`` ``[B, N, h]``), so a few query rows of a long sequence
    cost ``O(N * S)``, not ``O(T * S)`` (under a ``context`` mesh the keys are gathered, the
    maps never formed whole). Traceable."""
    p = _project(layer, x, None)
    b, s, n = x.shape[0], x.shape[1], rows.shape[1]
    rows = jnp.asarray(rows, jnp.int32)

    def pick(a):  # [B, T, ...] -> the rows' [B, N, ...]
        return jnp.take_along_axis(a, rows.reshape((b, n) + (1,) * (a.ndim - 2)), axis=1)

    q_seg = None if segment_ids is None else pick(segment_ids)
    mask = context.position_mask(
        rows,
        jnp.arange(s, dtype=jnp.int32),
        causal=layer.causal,
        segment_ids=q_seg,
        kv_segment_ids=segment_ids,
    )

    def weights(q, k):
        return reference._grouped_probs(pick(q), k, mask, layer.scale).reshape(b, -1, n, s)

    if p.q2 is None:
        return {"a": weights(p.q, p.k)}
    a1 = weights(p.q, p.k)
    a2 = weights(p.q2, p.k if p.k2 is None else p.k2)
    lam = p.lam if jnp.ndim(p.lam) == 0 else pick(p.lam)
    row_lam = lam if jnp.ndim(lam) == 0 else jnp.transpose(lam, (0, 2, 1))[..., None]
    return {"a1": a1, "a2": a2, "lam": lam, "diff": a1 - row_lam * a2}


def attention_logits(
    layer, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> dict[str, jax.Array]:
    """The pre-softmax logits ``q k^T * scale`` of an attention ``layer`` on ``x`` (float32,
    ``[B, heads, T, S]``): standard attention ``logits``, DIFF ``logits1`` and ``logits2`` (both
    maps of each pair), and ``mask`` (``[B or 1, T, S]``, True = may attend, or None). Masked
    entries keep their raw value: read them through the mask. Traceable."""
    p = _project(layer, x, positions)
    kw = _masking(layer, segment_ids)
    if p.q2 is None:
        logits, mask = reference.attention_logits(p.q, p.k, **kw)
        return {"logits": logits, "mask": mask}
    l1, mask = reference.attention_logits(p.q, p.k, **kw)
    l2, _ = reference.attention_logits(p.q2, p.k if p.k2 is None else p.k2, **kw)
    return {"logits1": l1, "logits2": l2, "mask": mask}


@nnx.jit(static_argnames="layer")
def _layer_maps(model, tokens, layer):
    _, attn_in, _ = capture_layers(model, tokens)
    return attention_maps(model.layers[layer].attn, attn_in[layer])


def layer_attention_maps(model, tokens, layer: int = -1) -> dict[str, np.ndarray]:
    """The attention maps of block ``layer`` (negative: from the last) of ``model`` on
    ``tokens`` ``[B, T]``, as numpy: what :func:`attention_maps` gives for that layer on the input
    it sees inside the model. Standard attention: ``a`` ``[B, heads, T, T]``; DIFF: ``a1``, ``a2``,
    ``lam`` (V1 a scalar, V2 ``[B, T, h]``) and ``diff = a1 - lam * a2``. Materialises ``T x T``
    maps: for inspection and plots."""
    model = for_analysis(model)
    tokens = check_tokens(model, tokens)
    n = len(model.layers)
    if not isinstance(layer, (int, np.integer)) or not -n <= layer < n:
        raise ValueError(
            f"layer_attention_maps: layer must be an int in [{-n}, {n - 1}] for a "
            f"model of {n} layers, got {layer!r}"
        )
    maps = _layer_maps(model, tokens.astype(jnp.int32), int(layer) % n)
    return {k: np.asarray(v) for k, v in maps.items()}


@nnx.jit
def _losses_and_predictions(model, inputs, targets, masks):
    logits = model(inputs, **masks)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return loss, jnp.argmax(logits, axis=-1)


MASKS = DOCUMENT_ARRAYS  # what a batch may carry beside its tokens


def losses_and_predictions(
    model, batch: dict, batch_size: int = 8, runtime: Runtime | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token cross-entropy ``[B, T]`` (nats, float64) and greedy predictions ``[B, T]`` of
    ``model`` on ``batch["inputs"]`` / ``batch["targets"]``, in fixed-size batches (the last one
    padded), so each model and length compiles once for every analysis that uses it.

    The batch's ``segment_ids`` and ``positions`` (documents kept apart), when it has them,
    go to the model with the tokens.

    ``runtime``: run on its mesh, the model built for it (:func:`diffjax.nn.model.for_runtime`).
    Where the mesh's ``context`` axis splits the sequence, each batch goes in the model's token
    order with its positions (:func:`diffjax.ops.context.order_batch`) and the results come back in
    the data's order. None: the mesh set by the caller (``jax.set_mesh``), if any, and the model
    as built (a model built by hand runs whole sequences)."""
    check_model(model)
    if runtime is None:
        return _losses_and_predictions_batched(model, batch, batch_size)
    with runtime.activate():
        return _losses_and_predictions_batched(for_runtime(model, runtime), batch, batch_size)


def _losses_and_predictions_batched(model, batch: dict, batch_size: int):
    split = model.attention_impl.context  # the spec when the model runs over a context axis
    n = 1 if split is None else context.axis_size(sharding.context_mesh(), split.axis)
    order = model.context.order  # how the model's attention reads the tokens over the axis
    x_all = np.asarray(check_tokens(model, batch["inputs"]))
    rows = {"inputs": x_all, "targets": np.asarray(batch["targets"])}
    rows.update({k: np.asarray(batch[k], np.int32) for k in MASKS if batch.get(k) is not None})
    losses, preds = [], []
    for i in range(0, len(x_all), batch_size):
        part = {k: v[i : i + batch_size] for k, v in rows.items()}
        pad = batch_size - len(part["inputs"])
        if pad:
            part = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in part.items()}
        if n > 1:
            part = context.order_batch(part, n, order)
        x, y = (jnp.asarray(part.pop(k), jnp.int32) for k in ("inputs", "targets"))
        loss, pred = jax.device_get(_losses_and_predictions(model, x, y, part))
        if n > 1:
            loss, pred = (context.restore_order(np.asarray(a), n, order) for a in (loss, pred))
        losses.append(np.asarray(loss, np.float64)[: batch_size - pad])
        preds.append(np.asarray(pred)[: batch_size - pad])
    return np.concatenate(losses), np.concatenate(preds)
