"""Statistics of a multi-seed comparison, for the comparison report (:mod:`diffjax.compare`) and
the evaluation tables: results grouped by model, mean and spread over seeds, and the paired
difference DIFF - twin with a Student-t confidence interval on the per-seed differences.

Pairing: seed ``s`` of both models starts from the same init seed and sees the same batches in
the same order, so the per-seed difference removes what the two share (the data order, the
init seed's luck) and the interval is on ``d_s = DIFF_s - twin_s``:

    mean(d) +/- t_{(1 + c) / 2, n - 1} * std(d, ddof=1) / sqrt(n)

With one seed no interval exists (no spread to estimate); the functions say so with ``None``.
Nor does one exist when every paired difference is the same (e.g. an accuracy of 0 for both
models in every seed): the sample standard deviation is 0 and a "[x, x]" interval would claim a
certainty that a handful of seeds cannot give; :attr:`PairedDifference.no_spread` says so.

A ratio of two seed-averaged quantities (:func:`ratio_of_means`) is the ratio of the means, and
only where the denominator is clearly positive; never a mean of per-seed ratios, which a
near-zero denominator in one seed blows up.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np


R = TypeVar("R")


def _field(result: Any, name: str) -> Any:
    return result[name] if isinstance(result, Mapping) else getattr(result, name)


def group_by_label(results: Sequence[R]) -> dict[str, list[R]]:
    """``{label: [result of each seed, in seed order]}``, the labels in the order they first
    appear. A result is an object with ``label`` and ``seed`` attributes (a
    :class:`diffjax.train.TrainResult`) or a mapping with those keys."""
    out: dict[str, list[R]] = {}
    for r in results:
        out.setdefault(_field(r, "label"), []).append(r)
    return {k: sorted(v, key=lambda r: _field(r, "seed")) for k, v in out.items()}


def twins_of(groups: Mapping[str, Any]) -> list[str]:
    """The twins beside DIFF in :func:`group_by_label`'s groups (every other label), in
    order; none without DIFF."""
    return [label for label in groups if label != "diff"] if "diff" in groups else []


def twin_name(label: str) -> str:
    """How the reports name a twin: ``"the twin"`` (the standard twin), ``"the gated twin"``."""
    return "the twin" if label == "standard" else f"the {label} twin"


def minus(label: str) -> str:
    """A difference's column name: ``"DIFF − twin"`` (the standard twin), ``"DIFF − gated"``."""
    return "DIFF − " + ("twin" if label == "standard" else label)


def _finite(values: Sequence[float | None]) -> np.ndarray:
    return np.array([v for v in values if v is not None and math.isfinite(v)], np.float64)


def mean_std(values: Sequence[float | None]) -> tuple[float, float | None, int]:
    """``(mean, sample standard deviation (ddof=1), n)`` of the finite values; the standard
    deviation is None for fewer than two values, the mean NaN for none."""
    x = _finite(values)
    if x.size == 0:
        return float("nan"), None, 0
    return float(x.mean()), (float(x.std(ddof=1)) if x.size > 1 else None), int(x.size)


def fmt_mean_std(
    values: Sequence[float | None],
    spec: str | Callable[[float], str] = "{:.3f}",
    *,
    none_finite: str = "n/a",
    note_missing: bool = False,
) -> str:
    """``"m"`` for one finite value, ``"m ± s"`` for several, ``"n/a"`` for none
    (``none_finite``: the text when there are values but none is finite). ``spec``: a format
    string or a function. ``note_missing``: ``" (k n/a)"`` after it when ``k`` values are
    missing or not finite."""
    text = spec.format if isinstance(spec, str) else spec
    m, s, n = mean_std(values)
    if n == 0:
        return none_finite if len(values) else "n/a"
    cell = text(m) if s is None else f"{text(m)} ± {text(s)}"
    return cell + (f" ({len(values) - n} n/a)" if note_missing and n < len(values) else "")


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """``a - b`` paired by seed: the mean difference, its t-interval (None with one pair, and
    None when every pair has the same difference: :attr:`no_spread`) and the number of pairs."""

    mean: float
    low: float | None
    high: float | None
    n: int
    confidence: float

    @property
    def half_width(self) -> float | None:
        return None if self.low is None else (self.high - self.low) / 2

    @property
    def no_spread(self) -> bool:
        """True when there are several pairs but their differences are all equal: the sample
        standard deviation is 0 and no interval can be estimated."""
        return self.n >= 2 and self.low is None

    @property
    def excludes_zero(self) -> bool | None:
        """True when the interval lies on one side of zero; None when there is no interval."""
        if self.low is None:
            return None
        return self.low > 0 or self.high < 0


def t_interval(diffs: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """``(mean, half width)`` of the Student-t interval of the mean of ``diffs``; the half width
    is None for fewer than two values (NaN mean for none)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    d = _finite(diffs)
    if d.size == 0:
        return float("nan"), None
    if d.size == 1:
        return float(d[0]), None
    from scipy import stats

    t = float(stats.t.ppf((1.0 + confidence) / 2.0, d.size - 1))
    return float(d.mean()), t * float(d.std(ddof=1)) / math.sqrt(d.size)


def _all_equal(values: Sequence[float]) -> bool:
    """True for several values that are equal up to float rounding (relative 1e-12)."""
    x = np.asarray(values, np.float64)
    return x.size >= 2 and float(np.ptp(x)) <= 1e-12 * float(np.abs(x).max())


def paired_difference(
    a: Sequence[float | None], b: Sequence[float | None], confidence: float = 0.95
) -> PairedDifference:
    """The per-seed differences ``a[i] - b[i]`` (pairs with a missing or non-finite value are
    dropped) and their t-interval."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} values against {len(b)}; pair them by seed")
    diffs = [
        x - y
        for x, y in zip(a, b)
        if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
    ]
    mean, half = t_interval(diffs, confidence)
    if half is None or _all_equal(diffs):
        return PairedDifference(mean, None, None, len(diffs), confidence)
    return PairedDifference(mean, mean - half, mean + half, len(diffs), confidence)


def paired_by_seed(
    groups: Mapping[str, Sequence[Any]], get, a: str = "diff", b: str = "standard"
) -> tuple[list, list]:
    """The values ``get(result)`` of models ``a`` and ``b`` (labels of :func:`group_by_label`'s
    groups) for the seeds both have a value for (not None), in seed order: the pairs of
    :func:`paired_difference`. Empty without both models."""
    if a not in groups or b not in groups:
        return [], []
    x = {_field(r, "seed"): get(r) for r in groups[a]}
    y = {_field(r, "seed"): get(r) for r in groups[b]}
    return pair_seeds(x, y)[1:]


def pair_seeds(a: Mapping[int, Any], b: Mapping[int, Any]) -> tuple[list[int], list, list]:
    """``(seeds, a's values, b's values)`` for the seeds both ``{seed: value}`` have a value
    for (not None), in seed order: the pairs of :func:`paired_difference`."""
    seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
    return seeds, [a[s] for s in seeds], [b[s] for s in seeds]


def difference_cell(d: PairedDifference, spec: str = "{:+.4f}", why: bool = True) -> str:
    """A table cell of a paired difference: ``"mean [low, high]"``; without an interval the
    mean and, with ``why``, the reason (``"n/a"`` with no pair), else ``"(no interval)"``."""
    if d.low is not None:
        return f"{spec.format(d.mean)} [{spec.format(d.low)}, {spec.format(d.high)}]"
    if not why:
        return f"{spec.format(d.mean)} (no interval)"
    if d.n == 0:
        return "n/a"
    if d.no_spread:
        return f"{spec.format(d.mean)} (equal in all {d.n} seeds: no interval)"
    return f"{spec.format(d.mean)} (one seed: no interval)"


def describe_difference(
    d: PairedDifference, what: str, a: str = "DIFF", b: str = "the twin", spec: str = "{:+.4f}"
) -> str:
    """One sentence: the mean difference, its interval, and whether the interval excludes zero."""
    pct = f"{d.confidence:.0%}"
    if d.n == 0:
        return f"{what}: no seed has both values; no difference can be given."
    if d.no_spread:
        return (
            f"{what}, {a} minus {b}: {spec.format(d.mean)} in each of {d.n} paired seeds; the "
            f"differences have no spread, so no confidence interval can be given (more seeds, "
            f"or more evaluation examples, would be needed to tell the two apart)."
        )
    if d.low is None:
        return (
            f"{what}, {a} minus {b}: {spec.format(d.mean)} from one seed; no confidence "
            f"interval can be given from one seed (set compare.seeds=2 or more)."
        )
    where = (
        f"the interval excludes zero: over these {d.n} seeds {a} is "
        f"{'higher' if d.low > 0 else 'lower'}"
        if d.excludes_zero
        else f"the interval includes zero: these {d.n} seeds cannot tell the two apart"
    )
    return (
        f"{what}, {a} minus {b}: {spec.format(d.mean)}, {pct} t-interval "
        f"[{spec.format(d.low)}, {spec.format(d.high)}] over {d.n} paired seeds; {where}."
    )


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval for a rate from ``k`` successes in ``n`` trials,
    e.g. the share of seeds in which a model learns a task: ``(low, high)``, both in [0, 1]."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not (isinstance(k, int) and isinstance(n, int) and 0 <= k <= n and n >= 1):
        raise ValueError(f"clopper_pearson needs integers 0 <= k <= n, n >= 1; got k={k}, n={n}")
    from scipy import stats

    a = (1.0 - confidence) / 2.0
    low = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1.0 - a, k + 1, n - k))
    return low, high


def clearly_positive(values: Sequence[float | None], min_value: float = 1e-9) -> bool:
    """True when every value is finite and above ``min_value`` and, with several values, their
    mean is more than their sample standard deviation (the mean is not within noise of zero).
    The test a denominator must pass before a ratio is formed."""
    if any(v is None or not math.isfinite(v) for v in values):
        return False
    x = np.asarray(values, np.float64)
    if x.size == 0 or np.any(x <= min_value):
        return False
    return x.size == 1 or float(x.mean()) > float(x.std(ddof=1))


def ratio_of_means(
    num: Sequence[float | None], den: Sequence[float | None], min_value: float = 1e-9
) -> float | None:
    """``mean(num) / mean(den)`` over the pairs where both are finite, or None when the
    denominators are not :func:`clearly_positive` (a ratio near a zero denominator says
    nothing, and its sign can flip from seed to seed). Never the mean of per-pair ratios."""
    if len(num) != len(den):
        raise ValueError(f"ratio_of_means: {len(num)} numerators against {len(den)} denominators")
    pairs = [
        (x, y)
        for x, y in zip(num, den)
        if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)
    ]
    if not pairs or not clearly_positive([y for _, y in pairs], min_value):
        return None
    return float(np.mean([x for x, _ in pairs]) / np.mean([y for _, y in pairs]))
