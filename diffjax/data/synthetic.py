"""Synthetic tasks with random access: example ``i`` is a pure function of (seed, split, i).

Both return the language-model fields (``inputs``, ``targets``, ``weights``; ``weights`` is 1
only on the answer tokens) plus fixed-shape extras, all in *position* coordinates ``t`` of the
``seq_len`` inputs (``targets[t] = inputs[t + 1]``):

- ``answer_spans`` [R, 2] int32: ``[start, end)`` of query r's answer in target positions
  (``targets[start:end]`` is the answer; ``inputs[start]`` is the token the model answers from).
- ``needle`` task: ``needle_spans`` [N, 2] (each needle sentence as input positions),
  ``needle_value_spans`` [N, 2] (its value digits), ``needle_depths`` [N] float32 (where each
  needle starts, as a fraction of the haystack), ``query_needle`` [R] (which needle query r asks),
  ``query_spans`` [R, 2] (each query with its answer, as input positions; the last one ends
  at ``seq_len + 1``, its final byte being only a target).
- ``mqar`` task: ``pair_spans`` [P, 2] (each key-value pair), ``query_pair`` [R].

:func:`answer_accuracy` scores predictions: an example is correct when every answer token
(``weights > 0``) is predicted exactly.

Both tasks declare their validation metrics (:data:`RETRIEVAL_METRICS`, the sources'
``validation_metrics``): name -> ``fn(predictions, batch) -> (right, counted)`` on this process's
rows of one validation batch; the train loop sums the two counts over batches and processes and
logs ``val_<name> = right / counted``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from diffjax.data.config import DataConfig
from diffjax.data.sources import TokenStream
from diffjax.data.tokenizer import BOS, PAD

# A validation metric: (predictions [B, T] token ids, batch) -> (items right, items counted)
ValidationMetric = Callable[[np.ndarray, Mapping[str, Any]], tuple[int, int]]

SPLIT_IDS = {"train": 0, "validation": 1}
SYNTHETIC_TRAIN_EXAMPLES = 2**31  # the train "epoch" of a synthetic task: practically endless
_DIGITS = np.frombuffer(b"0123456789", np.uint8)


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), SPLIT_IDS[split], int(index)])


def _distinct_rows(rng: np.random.Generator, n: int, draw) -> np.ndarray:
    """``n`` distinct rows from ``draw(rng, k) -> [k, width]`` (redraws the duplicates)."""
    rows = draw(rng, n)
    while True:
        seen: set[bytes] = set()
        dup = []
        for i in range(n):
            b = rows[i].tobytes()
            if b in seen:
                dup.append(i)
            seen.add(b)
        if not dup:
            return rows
        rows[dup] = draw(rng, len(dup))


def place_needles(depths: np.ndarray, haystack_len: int, needle_bytes: int) -> np.ndarray:
    """Start offsets in a haystack of ``haystack_len`` bytes for needles of ``needle_bytes``
    at fractional ``depths``: needle i starts at ``round(depth_i * (H - L))`` unless that would
    overlap its neighbours, in which case it is moved just enough (needles never overlap)."""
    n = len(depths)
    room = haystack_len - needle_bytes
    ideal = np.rint(np.asarray(depths, np.float64) * room).astype(np.int64)
    order = np.argsort(ideal, kind="stable")
    pos = ideal[order].copy()
    for k in range(1, n):
        pos[k] = max(pos[k], pos[k - 1] + needle_bytes)
    pos[-1] = min(pos[-1], room)
    for k in range(n - 2, -1, -1):
        pos[k] = min(pos[k], pos[k + 1] - needle_bytes)
    out = np.empty(n, np.int64)
    out[order] = pos
    return out


# ============================================================================ validation metrics
def answer_counts(preds, batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(examples whose answers are all right, examples with an answer)``
    (:func:`answer_correct`)."""
    ok, has = answer_correct(np.asarray(preds), batch)
    return int((ok & has).sum()), int(has.sum())


def query_counts(preds, batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(queries answered exactly, queries)`` (:func:`query_correct`)."""
    ok, has = query_correct(preds, batch)
    return int(ok.sum()), int(has.sum())


def _kind_counts(preds, batch: Mapping[str, Any], kind: int) -> tuple[int, int]:
    ok, has = query_correct(preds, batch)
    of_kind = query_kinds(batch)[kind]
    return int((ok & of_kind).sum()), int((has & of_kind).sum())


def first_query_counts(preds, batch: Mapping[str, Any]) -> tuple[int, int]:
    """:func:`query_counts` of query 0 alone: only the needles (pairs) hold its answer
    (:func:`query_kinds`), so it is the query that measures retrieval."""
    return _kind_counts(preds, batch, 0)


def repeat_query_counts(preds, batch: Mapping[str, Any]) -> tuple[int, int]:
    """:func:`query_counts` of the queries that repeat an earlier one (copyable from it; none
    without ``query_replacement``: then the metric has nothing to count and is not logged)."""
    return _kind_counts(preds, batch, 1)


# The needle and MQAR tasks' validation metrics: an example counts when all its answers are
# right, a query when its answer is; then query 0 alone and the repeated queries.
RETRIEVAL_METRICS: Mapping[str, ValidationMetric] = {
    "answer_accuracy": answer_counts,
    "query_accuracy": query_counts,
    "first_query_accuracy": first_query_counts,
    "repeat_query_accuracy": repeat_query_counts,
}


class NeedleSource:
    """Multi-needle retrieval. Layout of the ``seq_len + 1`` tokens::

        BOS | haystack (corpus text with N needles at their depths) | R queries

    needle: ``needle_template`` (by default ``"\\nThe magic number for <key> is <value>.\\n"``);
    query: ``query_template`` (``"\\nWhat is the magic number for <key>? <value>."``); keys are
    ``key_len`` characters of ``config.needle.key_alphabet`` (lowercase letters by default), values
    ``value_len`` digits (no leading zero), both distinct within an example.
    Only the answer digits carry weight. The haystack is a random span of the split's corpus
    stream (document markers become newlines). Under a context-length curriculum a short train
    example has a shorter haystack and is PAD after its last query."""

    validation_metrics = RETRIEVAL_METRICS

    def __init__(
        self,
        config: DataConfig,
        split: str,
        seed: int,
        haystack: TokenStream,
        length: int,
        global_batch: int | None = None,
    ):
        self.config, self.split, self.seed = config, split, int(seed)
        self.haystack, self._len = haystack, int(length)
        self.global_batch = global_batch
        c = config
        self.T = c.seq_len
        self.K, self.V = c.needle.key_len, c.needle.value_len
        self.nl, self.ql = c.needle.needle_bytes, c.needle.query_bytes
        self.H = (
            self.T - c.needle.num_queries * self.ql
        )  # haystack + needles (BOS is the other token)
        self.F = self.H - c.needle.num_needles * self.nl  # filler bytes (at full length)
        self._needle_parts = [p.encode() for p in _split_template(c.needle.template)]
        self._query_parts = [p.encode() for p in _split_template(c.needle.query_template)]
        self._key_letters = np.frombuffer(c.needle.key_alphabet.encode("ascii"), np.uint8)
        # Offset of the value inside a needle / of the answer inside a query.
        self.needle_value_at = len(self._needle_parts[0]) + self.K + len(self._needle_parts[1])
        self.query_value_at = len(self._query_parts[0]) + self.K + len(self._query_parts[1])

    def __len__(self) -> int:
        return self._len

    def _filler(self, rng: np.random.Generator, F: int) -> np.ndarray:
        M = len(self.haystack)
        if F == 0:
            return np.zeros((0,), np.int32)
        if M >= F:
            start = int(rng.integers(0, M - F + 1))
            fill = self.haystack.read(start, start + F)
        else:  # a corpus shorter than one haystack: repeat it
            fill = np.resize(self.haystack.read(0, M), F)
        return np.where(fill >= 256, 10, fill).astype(np.int32)

    def _needle(self, key: bytes, value: bytes) -> np.ndarray:
        a, b, c = self._needle_parts
        return np.frombuffer(a + key + b + value + c, np.uint8).astype(np.int32)

    def _query(self, key: bytes, value: bytes) -> np.ndarray:
        a, b, c = self._query_parts
        return np.frombuffer(a + key + b + value + c, np.uint8).astype(np.int32)

    def __getitem__(self, index: int) -> dict[str, Any]:
        c = self.config
        N, R, T = c.needle.num_needles, c.needle.num_queries, self.T
        rng = _rng(self.seed, self.split, index)
        keys = _distinct_rows(
            rng,
            N,
            lambda g, k: self._key_letters[g.integers(0, len(self._key_letters), (k, self.K))],
        )
        values = _distinct_rows(
            rng,
            N,
            lambda g, k: np.concatenate(
                [_DIGITS[g.integers(1, 10, (k, 1))], _DIGITS[g.integers(0, 10, (k, self.V - 1))]], 1
            ),
        )
        if c.needle.depths is not None:
            depths = np.asarray(c.needle.depths, np.float64)
        else:
            depths = rng.uniform(0.0, 1.0, N)
        asked = rng.choice(N, size=R, replace=c.needle.query_replacement)
        L = context_len(c, self.split, index, self.global_batch)
        H = L - R * self.ql  # this example's haystack + needles
        filler = self._filler(rng, H - N * self.nl)

        pos = place_needles(depths, H, self.nl)  # haystack offsets
        hay = np.empty((H,), np.int32)
        cursor, used = 0, 0
        for i in np.argsort(pos, kind="stable"):
            gap = int(pos[i]) - cursor
            hay[cursor : cursor + gap] = filler[used : used + gap]
            used += gap
            hay[pos[i] : pos[i] + self.nl] = self._needle(keys[i].tobytes(), values[i].tobytes())
            cursor = int(pos[i]) + self.nl
        hay[cursor:] = filler[used : used + H - cursor]

        queries = [self._query(keys[i].tobytes(), values[i].tobytes()) for i in asked]
        pad = np.full((T - L,), PAD, np.int32)  # a curriculum's short example: PAD after it
        w = np.concatenate([np.array([BOS], np.int32), hay, *queries, pad])
        assert len(w) == T + 1, (len(w), T + 1)

        weights = np.zeros((T,), np.float32)
        answer_spans = np.zeros((R, 2), np.int32)
        q0 = 1 + H
        for r in range(R):
            a = q0 + r * self.ql + self.query_value_at  # first answer digit, as a w position
            answer_spans[r] = (a - 1, a - 1 + self.V)  # target positions
            weights[a - 1 : a - 1 + self.V] = 1.0
        starts = 1 + pos
        needle_spans = np.stack([starts, starts + self.nl], 1).astype(np.int32)
        value_starts = starts + self.needle_value_at
        value_spans = np.stack([value_starts, value_starts + self.V], 1).astype(np.int32)
        room = max(H - self.nl, 1)
        query_starts = q0 + self.ql * np.arange(R)
        return {
            "inputs": w[:-1],
            "targets": w[1:],
            "weights": weights,
            "answer_spans": answer_spans,
            "needle_spans": needle_spans,
            "needle_value_spans": value_spans,
            "needle_depths": (pos / room).astype(np.float32),
            "query_needle": asked.astype(np.int32),
            "query_spans": np.stack([query_starts, query_starts + self.ql], 1).astype(np.int32),
        }

    def __repr__(self) -> str:
        c = self.config
        return (
            f"NeedleSource({self.split}, {self._len} examples, {c.needle.num_needles} needles, "
            f"{c.needle.num_queries} queries, seq_len {c.seq_len}, {self.F} filler bytes)"
        )


def context_len(config: DataConfig, split: str, index: int, global_batch: int | None) -> int:
    """Tokens of example ``index`` of ``split``: under a context-length curriculum
    (``config.synthetic.curriculum_steps > 0``) a train example belongs to step ``index // global_batch``
    (synthetic train examples are not shuffled, so example ``i`` is row ``i % G`` of global batch
    ``i // G``) and is :meth:`DataConfig.context_len` of that step long; else ``seq_len``."""
    if config.synthetic.curriculum_steps == 0 or split != "train":
        return config.seq_len
    if global_batch is None:
        raise ValueError(
            "a context-length curriculum (data.synthetic.curriculum_steps > 0) needs the "
            "global batch size to know each train example's step: build the source "
            "with make_source(..., global_batch=G) (make_dataset does)"
        )
    return config.context_len(int(index) // int(global_batch))


def _split_template(template: str) -> list[str]:
    """``"a{key}b{value}c"`` -> ``["a", "b", "c"]``."""
    a, rest = template.split("{key}")
    b, c = rest.split("{value}")
    return [a, b, c]


class MQARSource:
    """Multi-query associative recall. Layout of the ``seq_len + 1`` tokens::

        BOS k1 v1 k2 v2 ... kP vP | PAD ... PAD | kq1 vq1 ... kqR vqR

    keys are distinct byte ids in 0..mqar_num_keys-1 (default 127), values byte ids in
    128..127+mqar_num_values (default 255; they may repeat); the R
    queried pairs are distinct (unless ``query_replacement``) and sit at the end, so the recall
    distance grows with ``seq_len``. Only the queried values carry weight. Under a context-length
    curriculum a short train example ends with its queries and is PAD after them."""

    validation_metrics = RETRIEVAL_METRICS

    def __init__(
        self,
        config: DataConfig,
        split: str,
        seed: int,
        length: int,
        global_batch: int | None = None,
    ):
        self.config, self.split, self.seed, self._len = config, split, int(seed), int(length)
        self.global_batch = global_batch

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        c = self.config
        P, R, T = c.mqar.num_pairs, c.mqar.num_queries, c.seq_len
        rng = _rng(self.seed, self.split, index)
        keys = rng.choice(c.mqar.num_keys, size=P, replace=False).astype(np.int32)
        values = rng.integers(128, 128 + c.mqar.num_values, size=P).astype(np.int32)
        asked = rng.choice(P, size=R, replace=c.mqar.query_replacement)
        w = np.full((T + 1,), PAD, np.int32)
        w[0] = BOS
        w[1 : 1 + 2 * P : 2] = keys
        w[2 : 2 + 2 * P : 2] = values
        qs = context_len(c, self.split, index, self.global_batch) + 1 - 2 * R  # PAD after it
        w[qs : qs + 2 * R : 2] = keys[asked]
        w[qs + 1 : qs + 2 * R : 2] = values[asked]
        weights = np.zeros((T,), np.float32)
        answer_at = qs + 2 * np.arange(R)  # target positions of the queried values
        weights[answer_at] = 1.0
        starts = 1 + 2 * np.arange(P)
        return {
            "inputs": w[:-1],
            "targets": w[1:],
            "weights": weights,
            "answer_spans": np.stack([answer_at, answer_at + 1], 1).astype(np.int32),
            "pair_spans": np.stack([starts, starts + 2], 1).astype(np.int32),
            "query_pair": asked.astype(np.int32),
        }

    def __repr__(self) -> str:
        c = self.config
        return (
            f"MQARSource({self.split}, {self._len} examples, {c.mqar.num_pairs} pairs, "
            f"{c.mqar.num_queries} queries, seq_len {c.seq_len})"
        )


# ============================================================================ chance levels
def query_chance(config: DataConfig) -> dict[str, float]:
    """What a query's exact-answer accuracy is without retrieval, for ``val_query_accuracy``:

    - ``"uniform"``: a random answer of the right form (needle: one of the
      ``9 * 10**(value_len - 1)`` values; MQAR: one of the ``mqar_num_values`` values).
    - ``"no_retrieval"``: the best guess that reads the context but not the key-value link: a
      value copied from a random needle (pair) not asked by an earlier query of the example
      (earlier answers are in the input). Needle values are distinct, so query r is right with
      probability ``1 / (N - r)``; MQAR values are drawn with replacement from M values, so a
      wrong pair still carries the right value with probability ``1 / M``:
      ``1 / (P - r) + (1 - 1 / (P - r)) / M``. Averaged over the R queries. A model must beat
      this to show retrieval (when every needle or pair is queried, the last query is right by
      elimination alone: ``N = R`` gives it probability 1). With ``query_replacement`` nothing
      is eliminated: every query is ``1 / N`` (needle) or ``1 / P + (1 - 1 / P) / M`` (MQAR).
      But a repeated query can be copied from the earlier one (:func:`query_kinds`), so beating
      this level on all queries does not show retrieval from the needles.
    - ``"no_retrieval_first"``: the same level for query 0 alone (``1 / N``, or
      ``1 / P + (1 - 1 / P) / M``): nothing precedes it, nothing is eliminated or copied. This
      is the level that ``val_first_query_accuracy`` must beat to show retrieval.
    """

    def left(n: int, i: int) -> int:  # needles/pairs a no-retrieval guess picks from at query i
        return n if config.task.query_replacement else n - i

    if config.source == "needle":
        n, r = config.needle.num_needles, config.needle.num_queries
        uniform = 1.0 / (9 * 10 ** (config.needle.value_len - 1))
        per_query = [1.0 / left(n, i) for i in range(r)]
    elif config.source == "mqar":
        p, r, m = config.mqar.num_pairs, config.mqar.num_queries, config.mqar.num_values
        uniform = 1.0 / m
        per_query = [1.0 / left(p, i) + (1.0 - 1.0 / left(p, i)) / m for i in range(r)]
    else:
        raise ValueError(
            f"query_chance: data.source={config.source!r} has no queries; it is "
            f"defined for 'needle' and 'mqar'"
        )
    return {
        "uniform": uniform,
        "no_retrieval": max(float(np.mean(per_query)), uniform),
        "no_retrieval_first": max(per_query[0], uniform),
    }


def query_kinds(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(first, repeat)``, two ``[B, R]`` bool numpy arrays for a needle or MQAR batch.

    ``first``: query 0 of each example. Nothing is asked before it, so its answer is in the
    input only inside the needles (pairs): the one query that measures retrieval from them
    alone. ``repeat``: a query whose needle (pair) an earlier query of the example already
    asked. Its answer then also sits in the input right after that earlier query, so it can be
    copied from there, a few tokens back, without reading the needles at all. With
    ``query_replacement`` most queries are repeats (16 draws from 4 needles: about 75%), and a
    model that only copies earlier queries scores about 0.8 on all queries while staying at
    the no-retrieval level on the first one. (The queries in between ask a needle for the first
    time after others were asked, which also admits elimination.)"""
    key = "query_needle" if "query_needle" in batch else "query_pair"
    if key not in batch:
        raise ValueError(
            "query_kinds: the batch has no 'query_needle' or 'query_pair' field; "
            "it is defined for the needle and MQAR tasks (data.source needle/mqar)"
        )
    asked = np.asarray(batch[key])
    first = np.zeros(asked.shape, bool)
    first[:, 0] = True
    repeat = np.zeros(asked.shape, bool)
    for r in range(1, asked.shape[1]):
        repeat[:, r] = (asked[:, :r] == asked[:, r : r + 1]).any(1)
    return first, repeat


# ============================================================================ scoring
def _is_numpy(*arrays) -> bool:
    return all(isinstance(a, (np.ndarray, np.generic)) for a in arrays)


def answer_correct(preds_or_logits, batch: dict[str, Any]):
    """Per example: ``(correct, has_answer)``, two [B] bool arrays. ``preds_or_logits`` is
    [B, T] token ids or [B, T, V] logits (argmax taken); an example is correct when every target
    with ``weights > 0`` is predicted exactly. numpy in, numpy out; jax arrays (also under
    ``jit``) in, jax arrays out."""
    preds, targets, weights = preds_or_logits, batch["targets"], batch["weights"]
    xp = np
    if not _is_numpy(preds, targets, weights):
        import jax.numpy as jnp

        xp = jnp
    preds = xp.asarray(preds)
    if preds.ndim == 3:
        preds = xp.argmax(preds, axis=-1)
    if preds.shape != xp.asarray(targets).shape:
        raise ValueError(
            f"answer_accuracy: predictions of shape {preds.shape} (after argmax) do "
            f"not match targets {xp.asarray(targets).shape}"
        )
    counts = xp.asarray(weights) > 0
    ok = (preds == xp.asarray(targets)) | ~counts
    return xp.all(ok, axis=-1), xp.any(counts, axis=-1)


def query_correct(preds_or_logits, batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per query: ``(correct, has_answer)``, two [B, R] bool numpy arrays. Query r of an example
    is correct when every token of its answer span (``answer_spans[:, r]``) is predicted
    exactly; ``has_answer`` is False for validation padding (no weight in the span; without
    ``weights`` in the batch, an empty span). Chance is one over the number of possible answers
    (MQAR: 1/128; needle: 1/(9 * 10**(value_len - 1)))."""
    preds = np.asarray(preds_or_logits)
    if preds.ndim == 3:
        preds = preds.argmax(-1)
    targets, spans = np.asarray(batch["targets"]), np.asarray(batch["answer_spans"])
    if preds.shape != targets.shape:
        raise ValueError(
            f"query_correct: predictions of shape {preds.shape} (after argmax) do "
            f"not match targets {targets.shape}"
        )
    t = np.arange(targets.shape[1])
    in_span = (t >= spans[..., :1]) & (t < spans[..., 1:])  # [B, R, T]
    wrong = (preds != targets)[:, None, :]
    correct = ~np.any(wrong & in_span, axis=-1)
    if "weights" in batch:
        has = np.any((np.asarray(batch["weights"]) > 0)[:, None, :] & in_span, axis=-1)
    else:
        has = spans[..., 1] > spans[..., 0]
    return correct & has, has


def answer_accuracy(preds_or_logits, batch: dict[str, Any]):
    """The fraction of examples (with at least one answer token) whose answer tokens are all
    predicted exactly; examples with no answer (validation padding) are left out. Returns a
    float for numpy inputs, a jax scalar for jax inputs (0 when no example has an answer), and
    None for batches of a corpus (no ``answer_spans``: every token is a target there, so
    "answer accuracy" would mean whole windows predicted exactly; use
    :func:`answer_correct` for that)."""
    if "answer_spans" not in batch:
        return None
    correct, has = answer_correct(preds_or_logits, batch)
    if isinstance(correct, np.ndarray):
        n = int(has.sum())
        return float((correct & has).sum() / n) if n else 0.0
    import jax.numpy as jnp

    n = has.sum()
    return jnp.where(n > 0, (correct & has).sum() / jnp.maximum(n, 1), 0.0)
