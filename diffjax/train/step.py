"""The train step of one model: the loss (weighted cross-entropy, the diagnostics' sown
signals), gradient accumulation over microbatches, the jitted train and eval steps, and the
validation loss over a list of batches."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from diffjax.ops import context
from diffjax import data as data_lib
from diffjax.infra import sharding
from diffjax.nn.model import sown_diagnostics, sown_lambdas
from diffjax.interop.conversion import RampSchedule, set_ramp
from diffjax.infra.runtime import Runtime

from diffjax.train.optimizer import spike_metrics


MODEL_INPUTS = ("inputs", "targets", "weights", "segment_ids", "positions", "token_index")


MASK_INPUTS = ("positions", "segment_ids", "token_index")  # what the model reads beside tokens


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """Sum of per-token cross-entropy times weight, and the sum of weights."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * weights), jnp.sum(weights)


def _call(model, batch) -> jax.Array:
    return model(batch["inputs"], **{k: batch[k] for k in MASK_INPUTS if k in batch})


# the signals of a step that are largest values (the rest are means): combined over
# microbatches by their maximum (train.diagnostics; diffjax.nn.model.SOWN_DIAGNOSTICS)
MAX_SIGNALS = ("logit_max", "activation_max", "output_logit_max")


# what train.diagnostics adds to each record: per layer ([L], logit_max [L, maps]), or one value
DIAGNOSTICS = (
    "logit_max",
    "lambda_std",
    "activation_max",
    "output_logit_max",
    "update_ratio",
)


def _loss_terms(params, batch, graphdef, rest):
    """The batch's weighted cross-entropy sum, and ``(weight sum, signals)``: each layer's
    lambda as ``signals["lambda"]`` (:func:`diffjax.nn.model.sown_lambdas`; empty for standard
    attention) and, for a model built with diagnostics, what it sows
    (:func:`diffjax.nn.model.sown_diagnostics`) and the output logits' largest magnitude."""
    model = nnx.merge(graphdef, params, rest)
    logits, sown = nnx.capture(_call, nnx.Intermediate)(model, batch)
    total, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    lambdas = sown_lambdas(sown)
    signals = {"lambda": jnp.stack(lambdas) if lambdas else jnp.zeros((0,), jnp.float32)}
    if model.diagnostics:
        signals.update(sown_diagnostics(sown))
        signals["output_logit_max"] = jnp.max(jnp.abs(logits))
    return total, (weight, signals)


def loss_fn(params, batch, graphdef, rest) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The batch's mean weighted cross-entropy, and its signals (:func:`_loss_terms`): each
    layer's lambda as ``aux["lambda"]``, and the diagnostics of a model built with them."""
    total, (weight, signals) = _loss_terms(params, batch, graphdef, rest)
    return total / jnp.maximum(weight, 1.0), signals


def microbatches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """``[B, ...] -> [k, B / k, ...]``: microbatch ``j`` is rows ``j::k`` of the batch, so each
    data shard's rows split into its own ``k`` microbatches (no rows move between devices),
    each constrained to the batch's row sharding."""

    def split(x):
        x = jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0)
        return sharding.constrain(x, None, "batch", *(None,) * (x.ndim - 2))

    return {name: split(x) for name, x in batch.items()}


def accumulated_loss_and_grads(params, batch, graphdef, rest, accum_steps: int):
    """``((loss, aux), grads)`` as ``jax.value_and_grad(loss_fn, has_aux=True)`` gives them for
    the whole batch, computed over ``accum_steps`` microbatches (:func:`microbatches`) in a
    ``lax.scan``: the weighted cross-entropy sums and their gradients are summed, then divided
    by the whole batch's weight sum (so unevenly weighted microbatches, e.g. answer-only
    weights, count by their tokens); the lambdas (and the mean signals) are averaged over the
    microbatches, the largest values (:data:`MAX_SIGNALS`) are their maximum."""
    mbs = microbatches(batch, accum_steps)
    grad_fn = jax.value_and_grad(_loss_terms, has_aux=True)
    first = jax.tree.map(lambda x: x[0], mbs)
    shapes = jax.eval_shape(lambda p, b: _loss_terms(p, b, graphdef, rest)[1][1], params, first)

    def combine(name, a, b):
        return jnp.maximum(a, b) if name in MAX_SIGNALS else a + b

    def body(carry, mb):
        total, weight, signals, grads = carry
        (t, (w, sig)), g = grad_fn(params, mb, graphdef, rest)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        signals = {k: combine(k, signals[k], sig[k]) for k in signals}
        return (total + t, weight + w, signals, grads), None

    # the sums in float32 (also for bfloat16 parameters), the gradients cast back at the end
    zero = jnp.zeros((), jnp.float32)
    init = (
        zero,
        zero,
        {
            k: jnp.full(v.shape, -jnp.inf if k in MAX_SIGNALS else 0, v.dtype)
            for k, v in shapes.items()
        },
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params),
    )
    (total, weight, signals, grads), _ = jax.lax.scan(body, init, mbs)
    denom = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
    signals = {k: v if k in MAX_SIGNALS else v / accum_steps for k, v in signals.items()}
    return (total / denom, signals), grads


def train_step(
    state,
    batch,
    *,
    graphdef,
    rest,
    tx: optax.GradientTransformation,
    schedule,
    accum_steps=1,
    ramp: RampSchedule | None = None,
):
    """One optimizer step: ``(new state, metrics)``; the state is donated by the jit.
    ``accum_steps > 1``: the gradient of the batch accumulated over that many microbatches
    (:func:`accumulated_loss_and_grads`; the batch rows per data shard must divide by it).
    ``ramp``: a retrofit's schedule of the negative map's weight w (``ModelConfig.ramp``):
    the step ran with ``w(step)``, and the new state holds ``w(step + 1)``, the model as the
    next step and an evaluation of this state see it (recorded as ``ramp``)."""
    if accum_steps == 1:
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, graphdef, rest
        )
    else:
        (loss, aux), grads = accumulated_loss_and_grads(
            state["params"], batch, graphdef, rest, accum_steps
        )
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"], value=loss)
    params = optax.apply_updates(state["params"], updates)
    if ramp is not None:
        params = set_ramp(params, ramp(state["step"] + 1))
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "lr": schedule(state["step"]),
        **aux,
        **spike_metrics(opt_state),
    }
    if ramp is not None:
        metrics["ramp"] = ramp(state["step"])
    if "output_logit_max" in aux:  # train.diagnostics: the update's RMS over the parameters'
        metrics["update_ratio"] = optax.tree.norm(updates) / optax.tree.norm(state["params"])
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def eval_step(params, batch, *, graphdef, rest):
    """``(loss sum, weight sum, argmax predictions)`` of one validation batch."""
    logits = _call(nnx.merge(graphdef, params, rest), batch)
    total, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return total, weight, jnp.argmax(logits, axis=-1)


def model_inputs(
    batch: dict[str, np.ndarray], runtime: Runtime, global_rows: int
) -> dict[str, jax.Array]:
    """The global arrays a step reads (:data:`MODEL_INPUTS`) from this process's batch rows.
    On a mesh whose ``context`` axis splits the sequence, the tokens are put in
    ``runtime.context.order`` (:func:`diffjax.ops.context.order_batch`: every input, with
    explicit positions, so the model computes the same function and the loss the same sum)."""
    arrays = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
    n = runtime.context_size
    if n > 1:
        arrays = context.order_batch(arrays, n, runtime.context.order)
    return sharding.global_batch(arrays, runtime.mesh, global_rows)


def step_inputs(data: data_lib.DataConfig, runtime: Runtime) -> dict[str, Any]:
    """The arrays a step reads (as :func:`model_inputs` makes them) and their dtypes: the
    tokens, targets and weights; ``segment_ids`` and ``positions`` where the data keeps
    documents apart; ``positions`` and ``token_index`` where a ``context`` axis splits the
    sequence (what a compile-only plan traces the step with)."""
    names = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
    if data_lib.carries_documents(data):
        names.update(segment_ids=jnp.int32, positions=jnp.int32)
    if runtime.context_size > 1:
        names.update(positions=jnp.int32, token_index=jnp.int32)
    return names


def evaluate(
    eval_fn: Callable,
    params,
    batches: list[dict[str, np.ndarray]],
    runtime: Runtime,
    global_rows: int,
    metrics: Mapping[str, data_lib.ValidationMetric] | None = None,
) -> dict[str, float]:
    """Validation loss and perplexity over ``batches`` (this process's rows), and ``val_<name>``
    for each of ``metrics`` (``name -> fn(predictions, batch) -> (right, counted)``, what the
    data declares: :func:`diffjax.data.validation_metrics`): ``right / counted``, both summed
    over the batches and the processes (left out when nothing was counted). On a ``context``
    mesh axis the predictions return from ``runtime.context.order`` to the data's order."""
    metrics = dict(metrics or {})
    total = weight = 0.0
    counts = np.zeros((len(metrics), 2), np.int64)  # per metric: right, counted
    for b in batches:
        t, w, p = eval_fn(params, model_inputs(b, runtime, global_rows))
        total, weight = total + float(t), weight + float(w)
        if metrics:  # this process's rows; summed over processes below
            preds = context.restore_order(
                np.asarray(sharding.local_rows(p)), runtime.context_size, runtime.context.order
            )
            for i, fn in enumerate(metrics.values()):
                counts[i] += fn(preds, b)
    out = {"val_loss": total / max(weight, 1.0)}
    out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
    if metrics and jax.process_count() > 1:
        counts = multihost_utils.process_allgather(counts).reshape(-1, len(metrics), 2).sum(0)
    for name, (right, n) in zip(metrics, counts):
        if n:
            out[f"val_{name}"] = float(right / n)
    return out
