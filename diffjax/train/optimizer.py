"""AdamW with warmup and decay, global-norm clipping, a weight-decay mask, and (optionally)
skipping the update of a step whose loss or gradient spikes.

Weight decay applies to matrices only (rank >= 2: not norm scales, biases or V1's lambda
vectors ``lambda_q1 ... lambda_k2``) and not to DIFF V2's ``lambda_proj``, a matrix that is the
lambda's own parameterisation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from diffjax.train.config import TrainConfig

NO_DECAY_NAMES = ("lambda",)  # matrices that get no weight decay, by path name


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then linear/cosine decay to ``lr * min_lr_ratio`` at
    ``steps`` (or constant)."""
    warmup = min(cfg.warmup_steps, cfg.steps)
    decay_steps = max(cfg.steps - warmup, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), decay], [warmup])


def decay_mask(params):
    """True for the parameters that get weight decay: matrices whose path names no lambda."""

    def keep(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator="/").lower()
        return x.ndim >= 2 and not any(n in name for n in NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(keep, params)


class SkipSpikesState(NamedTuple):
    """:func:`skip_spikes`'s state: the recent losses and gradient norms, the skips so far."""

    history: jax.Array  # [2, window] float32: the last finite (loss, gradient norm); NaN: empty
    skipped: jax.Array  # int32: updates skipped so far
    last_skipped: jax.Array  # bool: the latest update was skipped
    inner_state: optax.OptState


def spike_test(history: jax.Array, stats: jax.Array, factor: float) -> jax.Array:
    """Whether ``stats`` (``[2]``: a step's loss and gradient norm) is a spike against
    ``history`` (``[2, window]``, NaN where empty): a value that is not finite, or, once the
    window is full, either value above ``factor`` times its median over the window."""
    full = ~jnp.any(jnp.isnan(history))
    above = jnp.any(stats > factor * jnp.nanmedian(history, axis=1))
    return ~jnp.all(jnp.isfinite(stats)) | (full & above)


def skip_spikes(
    inner: optax.GradientTransformation, factor: float, window: int
) -> optax.GradientTransformationExtraArgs:
    """``inner``, except that a step whose loss (``update(..., value=loss)``) or gradient norm
    is a spike (:func:`spike_test`) gets zero updates and leaves ``inner``'s state as it was:
    the parameters and the optimizer state (Adam's moments and count) stay unchanged. Every
    finite step's values enter the window, spikes too: the median barely moves for one, and
    a lasting change of level (e.g. new data) stops counting as spikes after ``window / 2``
    steps instead of freezing training."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return SkipSpikesState(
            jnp.full((2, window), jnp.nan, jnp.float32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.bool_),
            inner.init(params),
        )

    def update(updates, state, params=None, *, value, **extra):
        stats = jnp.stack([value, optax.tree.norm(updates)]).astype(jnp.float32)
        skip = spike_test(state.history, stats, factor)
        new, inner_state = inner.update(updates, state.inner_state, params, value=value, **extra)
        new = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new)
        inner_state = jax.tree.map(
            lambda n, o: jnp.where(skip, o, n), inner_state, state.inner_state
        )
        pushed = jnp.concatenate([state.history[:, 1:], stats[:, None]], axis=1)
        history = jnp.where(jnp.all(jnp.isfinite(stats)), pushed, state.history)
        skipped = state.skipped + skip.astype(jnp.int32)
        return new, SkipSpikesState(history, skipped, skip, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def spike_metrics(opt_state) -> dict[str, jax.Array]:
    """``{"skipped", "spikes_skipped"}`` from an optimizer state made with
    ``train.skip_spikes`` (this step's update skipped; the skips so far), else ``{}``."""
    if not isinstance(opt_state, SkipSpikesState):
        return {}
    return {"skipped": opt_state.last_skipped, "spikes_skipped": opt_state.skipped}


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """AdamW (:func:`learning_rate_schedule`, :func:`decay_mask`) after global-norm clipping,
    inside :func:`skip_spikes` when ``cfg.skip_spikes`` is set. Its ``update`` takes the
    step's loss as ``value=``."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    tx = optax.chain(*parts)
    if cfg.skip_spikes:
        return skip_spikes(tx, cfg.skip_spikes, cfg.spike_window)
    return tx
