"""AdamW with warmup and decay, global-norm clipping, and a weight-decay mask.

Weight decay applies to matrices only (rank >= 2: not norm scales, biases or V1's lambda
vectors ``lambda_q1 ... lambda_k2``) and not to DIFF V2's ``lambda_proj``, a matrix that is the
lambda's own parameterisation.
"""

from __future__ import annotations

import jax
import optax

from .config import TrainConfig

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


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
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
    return optax.chain(*parts)
