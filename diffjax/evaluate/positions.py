"""Validation loss and perplexity, and loss by position (does a model use far context?)."""

from __future__ import annotations

import math

import numpy as np

from diffjax.data import DataConfig, DataError, make_source


def corpus_for_positions(data: DataConfig, seq_len: int) -> DataConfig | None:
    """The corpus to measure loss by position on: the run's corpus, or for a needle run the text
    its haystacks are cut from; None for MQAR (no running text)."""
    if data.source in ("stdlib", "text", "tokens"):
        return data.replace(seq_len=seq_len)
    if data.source == "needle":
        return DataConfig(
            source="stdlib" if data.path is None else "text",
            path=data.path,
            seq_len=seq_len,
            val_fraction=data.val_fraction,
            max_files=data.max_files,
            stdlib_tests=data.stdlib_tests,
        )
    return None


def validation_examples(config: DataConfig, num: int) -> dict[str, np.ndarray]:
    """``num`` validation examples spread evenly over the split (all when it has fewer),
    stacked. Raises ``DataError`` with the fix when the split holds none."""
    src = make_source(config, "validation")
    if len(src) == 0:
        raise DataError(
            f"the validation split of {config.source!r} holds no example of "
            f"{config.seq_len + 1} tokens. Fix: use a shorter length or more data"
        )
    idx = np.unique(np.linspace(0, len(src) - 1, min(num, len(src))).astype(int))
    return stack_examples(src, idx)


def stack_examples(src, indices) -> dict[str, np.ndarray]:
    """Examples ``indices`` of a data source, each field stacked into ``[len(indices), ...]``."""
    rows = [src[int(i)] for i in indices]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def validation_loss(losses: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """``(weighted mean loss, perplexity exp(loss))`` from per-token losses and weights."""
    w = np.asarray(weights, np.float64)
    if w.sum() <= 0:
        raise ValueError("validation_loss: every weight is 0")
    loss = float((losses * w).sum() / w.sum())
    return loss, math.exp(min(loss, 50.0))


def loss_by_position(
    losses: np.ndarray, weights: np.ndarray, num_buckets: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """Mean loss in ``num_buckets`` equal position buckets: ``(bucket end positions, loss)``
    (weighted by ``weights``; NaN for a bucket with no weight)."""
    t = losses.shape[1]
    num_buckets = max(1, min(num_buckets, t))
    edges = np.linspace(0, t, num_buckets + 1).astype(int)
    w = np.asarray(weights, np.float64)
    out = np.full(num_buckets, np.nan)
    for i in range(num_buckets):
        ws = w[:, edges[i] : edges[i + 1]].sum()
        if ws > 0:
            out[i] = float(
                (losses[:, edges[i] : edges[i + 1]] * w[:, edges[i] : edges[i + 1]]).sum() / ws
            )
    return edges[1:], out
