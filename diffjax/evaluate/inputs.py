"""What every analysis of ``python -m diffjax.evaluate`` reads: :class:`ModelInputs` (one model,
the run's data and the settings, and the inputs several analyses share, computed once), and the
examples they are built from (the validation split's, a needle task's). It imports no analysis:
the analyses import it, the registry (:mod:`.analyses`) imports the analyses, and the runner
(:mod:`.run`) the registry, so the imports run one way."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from diffjax.config import ConfigError
from diffjax.data import DataConfig, DataError, NeedleData, SyntheticData, make_source

from diffjax.evaluate.probe import losses_and_predictions
from diffjax.evaluate.settings import EvalSettings

__all__ = [
    "ModelInputs",
    "fits",
    "keeps_replacement",
    "needle_task",
    "run_needle_setting",
    "run_needle_task",
    "stack_examples",
    "task_examples",
    "validation_examples",
]


# ---------------------------------------------------------------------------- examples
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
    needle, kw = NeedleData(), {}
    if base is not None and base.source in ("needle", "stdlib", "text"):
        kw = dict(
            path=base.path,
            val_fraction=base.val_fraction,
            max_files=base.max_files,
            stdlib=base.stdlib,
        )
        if base.source == "needle":  # its keys, values and templates
            needle = base.needle
    return DataConfig(
        source="needle",
        seq_len=seq_len,
        needle=dataclasses.replace(
            needle,
            num_needles=num_needles,
            num_queries=num_queries,
            query_replacement=query_replacement,
            depths=None,
        ),
        synthetic=SyntheticData(num_val_examples=num_examples),
        seed=seed,
        **kw,
    )


def task_examples(config: DataConfig, num: int | None = None) -> dict[str, np.ndarray]:
    """The first ``num`` validation examples of a task (all ``num_val_examples`` by default),
    stacked into ``[num, ...]`` numpy arrays."""
    src = make_source(config, "validation")
    num = len(src) if num is None else min(int(num), len(src))
    return stack_examples(src, range(num))


# ---------------------------------------------------------------------------- the run's needles
def run_needle_setting(data: DataConfig) -> tuple[int, int]:
    """``(N needles, R queried)`` of a run on the needle task; (1, 1) for any other run."""
    return (data.needle.num_needles, data.needle.num_queries) if data.source == "needle" else (1, 1)


def keeps_replacement(data: DataConfig, n: int, r: int) -> bool:
    """The run's own needle setting keeps its query_replacement; the paper's settings ask R
    distinct needles."""
    return (
        data.source == "needle"
        and data.needle.query_replacement
        and (n, r) == run_needle_setting(data)
    )


def run_needle_task(data: DataConfig, seq_len: int, n: int, r: int, **kw) -> DataConfig:
    """The needle task of N = ``n``, R = ``r`` at ``seq_len`` on the run's needles and text
    (:func:`needle_task`; ``kw``: its other settings)."""
    return needle_task(
        data,
        seq_len=seq_len,
        num_needles=n,
        num_queries=r,
        query_replacement=keeps_replacement(data, n, r),
        **kw,
    )


def fits(data: DataConfig, seq_len: int, n: int, r: int) -> bool:
    """Whether N = ``n`` needles, R = ``r`` queried fit in ``seq_len`` tokens of the run's task."""
    try:
        run_needle_task(data, seq_len, n, r)
        return True
    except ConfigError:
        return False


@dataclasses.dataclass
class ModelInputs:
    """What the analyses of one model read (each analysis's ``measure`` takes it): the model,
    the run's data and the settings, and the inputs several analyses share, computed once: the
    validation examples and the model's losses and predictions on them, the needle examples of
    the run's own needle setting at the trained context."""

    model: Any
    data: DataConfig
    settings: EvalSettings

    @functools.cached_property
    def val(self) -> dict[str, np.ndarray]:
        return validation_examples(self.data, self.settings.val_examples)

    @functools.cached_property
    def val_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(per-token losses, predictions)`` on :attr:`val`."""
        return self.losses_and_predictions(self.val)

    def losses_and_predictions(self, batch: dict) -> tuple[np.ndarray, np.ndarray]:
        return losses_and_predictions(self.model, batch, self.settings.batch_size)

    @property
    def needle_setting(self) -> tuple[int, int]:
        """``(N needles, R queried)`` of the run (1, 1 for a run not on the needle task)."""
        return run_needle_setting(self.data)

    @property
    def lengths(self) -> list[int]:
        """The contexts of the retrieval grid: the trained one (quick), or a quarter, half, one
        and the longest the model takes."""
        seq_len, max_len = self.data.seq_len, self.model.config.max_seq_len
        if self.settings.quick:
            return [seq_len]
        return sorted({x for x in (seq_len // 4, seq_len // 2, seq_len, max_len) if x <= max_len})

    def fits(self, seq_len: int, n: int, r: int) -> bool:
        return fits(self.data, seq_len, n, r)

    def replacement(self, n: int, r: int) -> bool:
        return keeps_replacement(self.data, n, r)

    def needle_examples(self, seq_len: int, num: int | None = None, seed: int = 1) -> dict:
        """``num`` (default: the allocation's) needle examples of the run's setting."""
        n0, r0 = self.needle_setting
        num = self.settings.allocation_examples if num is None else num
        return task_examples(
            run_needle_task(self.data, seq_len, n0, r0, num_examples=num, seed=seed)
        )

    @functools.cached_property
    def needle_batch(self) -> dict | None:
        """The allocation's examples at the trained context; None where they do not fit."""
        if not self.fits(self.data.seq_len, *self.needle_setting):
            return None
        return self.needle_examples(self.data.seq_len)
