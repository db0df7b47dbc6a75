"""The token-level pieces of the lm-eval model: inputs cut to the model's context, rolling
windows, length buckets, right-padded batches and the compiled scoring forward.

Scoring is causal, so a row right-padded to its bucket's length gives the same log-probs at its
real positions as the row alone: one compiled forward per (batch rows, bucket length) serves
every request of that bucket."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from diffjax.infra.compile_options import lazy_jit

# (model input, targets: the input shifted by one, number of last targets that are scored)
Row = tuple[list[int], list[int], int]


def length_buckets(max_len: int, smallest: int = 32) -> tuple[int, ...]:
    """The padded lengths: powers of two from ``smallest`` below ``max_len``, then ``max_len``."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    out = []
    size = smallest
    while size < max_len:
        out.append(size)
        size *= 2
    return (*out, max_len)


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``length`` tokens."""
    for size in buckets:
        if length <= size:
            return size
    raise ValueError(f"{length} tokens exceed the largest bucket {buckets[-1]}")


def loglikelihood_row(context: Sequence[int], continuation: Sequence[int], max_len: int) -> Row:
    """The row scoring ``continuation`` after ``context``: the last ``max_len + 1`` tokens of
    their concatenation (the context truncated from the left), the input all but the last, the
    targets all but the first, the last ``len(continuation)`` targets scored."""
    if not continuation:
        raise ValueError("the continuation holds no token: nothing to score")
    if not context:
        raise ValueError("the context holds no token: give at least a prefix token")
    if len(continuation) > max_len:
        raise ValueError(
            f"the continuation has {len(continuation)} tokens, more than the model's context "
            f"of {max_len}: it cannot be scored in one window"
        )
    whole = [int(t) for t in (*context, *continuation)][-(max_len + 1) :]
    return whole[:-1], whole[1:], len(continuation)


def rolling_windows(
    tokens: Sequence[int], prefix_token: int, max_len: int
) -> list[tuple[list[int], list[int]]]:
    """``(context, continuation)`` windows over a document that score each of its tokens exactly
    once: the first window predicts its first ``max_len`` tokens after ``prefix_token``; each
    next one predicts the following ``max_len`` tokens with as much preceding text as fits
    (lm-eval's ``get_rolling_token_windows`` with ``context_len=1``, made disjoint)."""
    return [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(
            token_list=[int(t) for t in tokens],
            prefix_token=int(prefix_token),
            max_seq_len=max_len,
            context_len=1,
        )
    ]


def pad_rows(rows: Sequence[Sequence[int]], width: int, num_rows: int) -> np.ndarray:
    """``[num_rows, width]`` int32: each row left-aligned, zeros after it and below the rows."""
    out = np.zeros((num_rows, width), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def plan_batches(
    lengths: Sequence[int], buckets: Sequence[int], rows: int
) -> list[tuple[int, list[int]]]:
    """``(bucket length, indices)`` batches of at most ``rows`` requests, each request in the
    smallest bucket holding it; longest first (the slowest batches run first)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(bucket_of(lengths[i], buckets), []).append(i)
    return [
        (size, idx[k : k + rows])
        for size, idx in sorted(groups.items(), reverse=True)
        for k in range(0, len(idx), rows)
    ]


def batch_rows(batch_size: int, num_shards: int) -> int:
    """Rows of every compiled batch: ``batch_size`` rounded up to a multiple of the shards."""
    return max(num_shards, math.ceil(batch_size / num_shards) * num_shards)


@functools.partial(lazy_jit, static_argnames=("graphdef",))
def token_scores(graphdef, state, inputs, targets):
    """Per position, the log-prob of ``targets`` under ``log_softmax`` of the model's float32
    logits on ``inputs`` ``[B, T]``, and whether the target is the argmax."""
    logits = nnx.merge(graphdef, state)(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def row_result(logp: np.ndarray, greedy: np.ndarray, row: Row) -> tuple[float, bool]:
    """``(sum of the scored log-probs, all scored targets greedy)`` of one row of a batch."""
    n, k = len(row[0]), row[2]
    return float(logp[n - k : n].astype(np.float64).sum()), bool(greedy[n - k : n].all())


def until_token(tokens: np.ndarray, stop: int | None) -> np.ndarray:
    """``tokens`` before the first ``stop`` (all of them when it is absent or None)."""
    hits = np.flatnonzero(tokens == stop) if stop is not None else []
    return tokens[: hits[0]] if len(hits) else tokens


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stops`` (empty stops ignored)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


__all__ = [
    "Row",
    "batch_rows",
    "bucket_of",
    "cut_at_stops",
    "length_buckets",
    "loglikelihood_row",
    "pad_rows",
    "plan_batches",
    "rolling_windows",
    "row_result",
    "token_scores",
    "until_token",
]
