"""Formatting a value over seeds for the evaluation tables. The statistics themselves (mean and
standard deviation over seeds, the paired DIFF - twin t-interval) are
:mod:`diffjax.train.stats`, shared with the training report."""

from __future__ import annotations

from typing import Sequence

from diffjax.train.stats import mean_std


def fmt_mean_std(values: Sequence[float | None], spec: str = "{:.3f}") -> str:
    """``"m"`` for one value, ``"m ± s"`` for several, ``"n/a"`` for none."""
    m, s, n = mean_std(values)
    if n == 0:
        return "n/a"
    return spec.format(m) if s is None else f"{spec.format(m)} ± {spec.format(s)}"
