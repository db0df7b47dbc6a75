"""Reading a :class:`diffjax.TransformerLM`'s inside without changing it: each block's attention
input (the output of ``attn_norm``) and output (the hidden state after both residuals), captured
with ``nnx.capture(..., method_outputs=nnx.Intermediate)``; the attention layers' own
``attention_maps`` / ``attention_logits`` then recompute maps and logits from those inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def check_model(model) -> None:
    from diffjax.model import TransformerLM

    if not isinstance(model, TransformerLM):
        raise TypeError(
            f"expected a diffjax.TransformerLM, got {type(model).__name__}. Fix: "
            f"build one with diffjax.TransformerLM(config) or load one with "
            f"diffjax.train.load_model(run_folder)"
        )


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


def capture_layers(model, tokens: jax.Array) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """``(logits, attention_inputs, block_outputs)``: the model's logits and, per block, the
    normalised input its attention layer sees and the block's output ``[B, T, D]``. Traceable
    (call it inside ``nnx.jit``)."""
    logits, inter = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(tokens)
    attn_in, outs = [], []
    for i in range(len(model.layers)):
        layer = inter["layers"][i]
        attn_in.append(layer["attn_norm"]["__call__"].get_value()[0])
        outs.append(layer["__call__"].get_value()[0])
    return logits, attn_in, outs


@nnx.jit(static_argnames="layer")
def _layer_maps(model, tokens, layer):
    _, attn_in, _ = capture_layers(model, tokens)
    return model.layers[layer].attn.attention_maps(attn_in[layer])


def layer_attention_maps(model, tokens, layer: int = -1) -> dict[str, np.ndarray]:
    """The attention maps of block ``layer`` (negative: from the last) of ``model`` on
    ``tokens`` ``[B, T]``, as numpy: what that layer's ``attention_maps`` gives on the input it
    sees inside the model. Standard attention: ``a`` ``[B, heads, T, T]``; DIFF: ``a1``, ``a2``,
    ``lam`` (V1 a scalar, V2 ``[B, T, h]``) and ``diff = a1 - lam * a2``. Materialises ``T x T``
    maps: for inspection and plots."""
    check_model(model)
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
def _losses_and_predictions(model, inputs, targets):
    logits = model(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return loss, jnp.argmax(logits, axis=-1)


def losses_and_predictions(
    model, batch: dict, batch_size: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token cross-entropy ``[B, T]`` (nats, float64) and greedy predictions ``[B, T]`` of
    ``model`` on ``batch["inputs"]`` / ``batch["targets"]``, in fixed-size batches (the last one
    padded), so each model and length compiles once for every analysis that uses it."""
    check_model(model)
    x_all = np.asarray(check_tokens(model, batch["inputs"]))
    y_all = np.asarray(batch["targets"])
    losses, preds = [], []
    for i in range(0, len(x_all), batch_size):
        x, y = x_all[i : i + batch_size], y_all[i : i + batch_size]
        pad = batch_size - len(x)
        if pad:
            x = np.concatenate([x, np.repeat(x[-1:], pad, 0)])
            y = np.concatenate([y, np.repeat(y[-1:], pad, 0)])
        loss, pred = _losses_and_predictions(
            model, jnp.asarray(x, jnp.int32), jnp.asarray(y, jnp.int32)
        )
        loss, pred = jax.device_get((loss, pred))
        losses.append(np.asarray(loss, np.float64)[: batch_size - pad])
        preds.append(np.asarray(pred)[: batch_size - pad])
    return np.concatenate(losses), np.concatenate(preds)
