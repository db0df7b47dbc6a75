"""Aggregation over seeds: mean and standard deviation, and the paired difference of two models
with a t-interval. Small pure functions on plain numbers."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample standard deviation)`` (ddof 1; the std is NaN for fewer than 2 values;
    both NaN for none). NaN values are left out."""
    x = np.asarray([v for v in values if v is not None], np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else math.nan


@dataclasses.dataclass(frozen=True)
class PairedInterval:
    """The per-seed differences ``a - b``: their mean, standard deviation, count, and the
    two-sided t-interval ``mean +/- t_{(1+c)/2, n-1} * std / sqrt(n)`` (None for n < 2)."""

    mean: float
    std: float
    n: int
    confidence: float
    low: float | None
    high: float | None

    @property
    def excludes_zero(self) -> bool | None:
        """True when the interval lies wholly on one side of zero; None without an interval."""
        if self.low is None or self.high is None:
            return None
        return self.low > 0 or self.high < 0

    def describe(self, unit: str = "") -> str:
        """One sentence: the interval and whether it excludes zero."""
        u = f" {unit}" if unit else ""
        if self.low is None:
            return (f"{self.mean:+.4f}{u} from {self.n} seed(s); no interval can be given "
                    f"from fewer than 2 seeds")
        verdict = ("excludes zero" if self.excludes_zero
                   else "includes zero: no difference can be claimed")
        return (f"{self.mean:+.4f}{u} (n={self.n} seeds, {self.confidence:.0%} t-interval "
                f"[{self.low:+.4f}, {self.high:+.4f}], {verdict})")


def eval_paired_t_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95
                           ) -> PairedInterval:
    """The paired difference ``a_i - b_i`` (one pair per seed) with a ``confidence`` t-interval.

    Named for the evaluation package; :mod:`diffjax.train.report` may hold an equivalent helper
    for the training report."""
    if len(a) != len(b):
        raise ValueError(f"eval_paired_t_interval: {len(a)} values vs {len(b)}: pass one value "
                         f"per seed for each model, in the same seed order")
    if not 0 < confidence < 1:
        raise ValueError(f"eval_paired_t_interval: confidence must be in (0, 1), got {confidence}")
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    d = d[np.isfinite(d)]
    n = int(d.size)
    if n == 0:
        return PairedInterval(math.nan, math.nan, 0, confidence, None, None)
    mean = float(d.mean())
    if n < 2:
        return PairedInterval(mean, math.nan, n, confidence, None, None)
    from scipy import stats

    std = float(d.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return PairedInterval(mean, std, n, confidence, mean - half, mean + half)


def fmt_mean_std(values: Sequence[float], spec: str = "{:.3f}") -> str:
    """``"m"`` for one value, ``"m ± s"`` for several, ``"n/a"`` for none."""
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return "n/a"
    m, s = mean_std(vals)
    return spec.format(m) if len(vals) == 1 else f"{spec.format(m)} ± {spec.format(s)}"
