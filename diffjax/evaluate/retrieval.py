"""Multi-needle retrieval (the paper's Table 2): accuracy over context lengths x needle depths.

Examples come from the generator behind ``data.source=needle``
(:class:`diffjax.data.NeedleSource`: N needles at random depths in corpus text, R of them
asked at the end). Each query is scored on its own: correct when every digit of its answer is
the model's greedy (argmax) prediction. Queries are binned by the depth of the needle they ask
for (its start as a fraction of the haystack), so a cell is "retrieval of a needle at this
depth with N - 1 distractor needles around it"."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from diffjax.data import DataConfig, make_source
from diffjax.data import query_correct as data_query_correct
from diffjax.runtime import Runtime

from .positions import stack_examples
from .probe import check_model, losses_and_predictions


def needle_task(
    base: DataConfig | None = None,
    *,
    seq_len: int,
    num_needles: int,
    num_queries: int,
    num_examples: int = 64,
    seed: int = 0,
    query_replacement: bool = False,
) -> DataConfig:
    """A needle-task ``DataConfig``: the keys, values, templates and haystack text of ``base``
    when it is a needle task (the haystack's ``path`` too when it is a text corpus), the stdlib
    corpus otherwise; ``query_replacement`` as in ``DataConfig`` (False: the paper's R distinct
    needles). Validated: a ``seq_len`` too short for the needles raises ``ConfigError``."""
    kw: dict = {}
    if base is not None and base.source == "needle":
        kw = dict(
            path=base.path,
            key_len=base.key_len,
            value_len=base.value_len,
            needle_template=base.needle_template,
            query_template=base.query_template,
            needle_key_letters=base.needle_key_letters,
            needle_num_key_letters=base.needle_num_key_letters,
            val_fraction=base.val_fraction,
            max_files=base.max_files,
            stdlib_tests=base.stdlib_tests,
        )
    elif base is not None and base.source in ("stdlib", "text"):
        kw = dict(
            path=base.path,
            val_fraction=base.val_fraction,
            max_files=base.max_files,
            stdlib_tests=base.stdlib_tests,
        )
    return DataConfig(
        source="needle",
        seq_len=seq_len,
        num_needles=num_needles,
        num_queries=num_queries,
        num_val_examples=num_examples,
        seed=seed,
        query_replacement=query_replacement,
        **kw,
    )


def task_examples(config: DataConfig, num: int | None = None) -> dict[str, np.ndarray]:
    """The first ``num`` validation examples of a task (all ``num_val_examples`` by default),
    stacked into ``[num, ...]`` numpy arrays."""
    src = make_source(config, "validation")
    num = len(src) if num is None else min(int(num), len(src))
    return stack_examples(src, range(num))


def query_correct(preds_or_logits, batch: dict) -> np.ndarray:
    """``[B, R]`` bool: query r of example b has every answer token (``answer_spans[b, r]``, in
    target positions) predicted exactly. ``preds_or_logits``: ``[B, T]`` ids or ``[B, T, V]``.
    The first half of :func:`diffjax.data.query_correct` (which also says which queries have an
    answer)."""
    return data_query_correct(preds_or_logits, batch)[0]


def query_depths(batch: dict) -> np.ndarray:
    """``[B, R]``: the depth (fraction of the haystack) of the needle each query asks for."""
    depths, asked = np.asarray(batch["needle_depths"]), np.asarray(batch["query_needle"])
    return np.take_along_axis(depths, asked, axis=1)


def depth_bins(depths: np.ndarray, num_bins: int) -> np.ndarray:
    """Bin index of each depth: the nearest of ``num_bins`` evenly spaced centres in [0, 1]."""
    if num_bins < 1:
        raise ValueError(f"depth_bins: num_bins must be >= 1, got {num_bins}")
    if num_bins == 1:
        return np.zeros(np.shape(depths), int)
    return np.clip(np.rint(np.asarray(depths) * (num_bins - 1)), 0, num_bins - 1).astype(int)


@dataclasses.dataclass
class RetrievalGrid:
    """Per (context length, depth bin): ``correct`` and ``total`` query counts."""

    lengths: list[int]
    depths: list[float]  # bin centres
    num_needles: int
    num_queries: int
    correct: np.ndarray  # [L, D] int
    total: np.ndarray  # [L, D] int

    @property
    def accuracy(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.total > 0, self.correct / np.maximum(self.total, 1), np.nan)

    def length_accuracy(self) -> np.ndarray:
        """Accuracy per length over every depth (``[L]``)."""
        return self.correct.sum(1) / np.maximum(self.total.sum(1), 1)

    def overall(self) -> float:
        return float(self.correct.sum() / max(self.total.sum(), 1))

    def to_dict(self) -> dict:
        return {
            "lengths": self.lengths,
            "depths": self.depths,
            "num_needles": self.num_needles,
            "num_queries": self.num_queries,
            "correct": self.correct.tolist(),
            "total": self.total.tolist(),
        }


def multi_needle_retrieval(
    model,
    *,
    lengths: Sequence[int],
    num_needles: int,
    num_queries: int,
    data: DataConfig | None = None,
    num_examples: int = 64,
    num_depth_bins: int = 5,
    batch_size: int = 8,
    seed: int = 0,
    query_replacement: bool = False,
    runtime: Runtime | None = None,
) -> RetrievalGrid:
    """Retrieval accuracy of ``model`` on the needle task, per context length and needle depth.

    ``data``: the run's data config (keys, values and haystack text are taken from it when it
    is a needle task). ``num_examples`` examples per length (validation split, seed ``seed``),
    each with ``num_queries`` scored queries (drawn with replacement with
    ``query_replacement``). ``runtime``: the mesh and context spec the forward runs with
    (:func:`.probe.losses_and_predictions`)."""
    check_model(model)
    lengths = [int(x) for x in lengths]
    too_long = [x for x in lengths if x > model.config.max_seq_len]
    if too_long:
        raise ValueError(
            f"multi_needle_retrieval: lengths {too_long} exceed the model's "
            f"max_seq_len {model.config.max_seq_len}. Fix: drop them"
        )
    correct = np.zeros((len(lengths), num_depth_bins), int)
    total = np.zeros_like(correct)
    for li, length in enumerate(lengths):
        cfg = needle_task(
            data,
            seq_len=length,
            num_needles=num_needles,
            num_queries=num_queries,
            num_examples=num_examples,
            seed=seed,
            query_replacement=query_replacement,
        )
        batch = task_examples(cfg)
        preds = losses_and_predictions(model, batch, batch_size, runtime)[1]
        ok = query_correct(preds, batch)
        bins = depth_bins(query_depths(batch), num_depth_bins)
        np.add.at(correct[li], bins.ravel(), ok.ravel().astype(int))
        np.add.at(total[li], bins.ravel(), 1)
    centres = list(np.linspace(0, 1, num_depth_bins)) if num_depth_bins > 1 else [0.5]
    return RetrievalGrid(
        lengths, [float(c) for c in centres], num_needles, num_queries, correct, total
    )
