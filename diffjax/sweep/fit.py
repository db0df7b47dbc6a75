"""Scaling curves and the parameter-efficiency ratio, in plain numpy (scipy for the fit).

* :func:`fit_scaling_law`: ``L(N) = E + A N^-alpha`` by least squares when at least
  :data:`MIN_SIZES_FOR_POWER_LAW` sizes support its three parameters, else a straight line in
  log-log (``L = A N^-alpha``, ``E = 0``); :attr:`ScalingFit.form` says which was fitted.
* :func:`parameter_ratio`: for each twin size, the DIFF parameter count at which DIFF's mean
  loss equals the twin's, interpolated piecewise-linearly in ``log N`` between *measured* DIFF
  sizes, divided by the twin's ``N``; ``None`` when that loss lies outside DIFF's measured
  losses (never extrapolated; :func:`unmatched_bound` then says which side, as a bound). With
  ``method="fit"`` the same read from DIFF's fitted law inside its measured sizes instead: the
  piecewise-linear curve runs above a convex loss curve between sizes, so it leans high by a
  few percent when the sizes are far apart (about 4% at 3x steps), which the fit does not.
* :func:`bootstrap_parameter_ratio`: a percentile interval of that ratio, resampling the seeds
  of each size with replacement, DIFF's and the twin's seed ``s`` together (they share the
  init seed and the data order).
* :func:`tokens_ratio` and :func:`bootstrap_tokens_ratio`: the same for training tokens from
  one size's learning curves: the tokens at which DIFF's validation loss first reaches the
  twin's final validation loss, divided by the twin's tokens.

A ratio below 1 means DIFF needs fewer parameters (tokens) than the twin for the same loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

MIN_SIZES_FOR_POWER_LAW = 4
POWER_LAW = "power law L = E + A N^-alpha"
LOG_LOG_LINE = "straight line in log-log, L = A N^-alpha (E = 0)"


# ---------------------------------------------------------------------------- fits
@dataclasses.dataclass(frozen=True)
class ScalingFit:
    """A fitted ``L(N) = E + A N^-alpha``; ``form`` is :data:`POWER_LAW` or
    :data:`LOG_LOG_LINE` (then ``E`` is 0); ``sizes`` the measured range it was fitted on;
    ``rms`` the root mean square residual in loss."""

    form: str
    E: float
    A: float
    alpha: float
    sizes: tuple[float, float]
    n_points: int
    rms: float
    note: str = ""

    def predict(self, n) -> np.ndarray:
        """The fitted loss at parameter counts ``n``."""
        n = np.asarray(n, np.float64)
        return self.E + self.A * np.exp(-self.alpha * np.log(n))

    def describe(self) -> str:
        """One line: the form and its parameters."""
        text = f"{self.form}: "
        if self.form == POWER_LAW:
            text += f"E = {self.E:.4f}, "
        text += (
            f"A = {self.A:.4g}, alpha = {self.alpha:.4f} "
            f"({self.n_points} sizes, rms residual {self.rms:.4f})"
        )
        return text + (f"; {self.note}" if self.note else "")


def _as_means(losses: Sequence) -> np.ndarray:
    """Per size: the value, or the mean of a sequence of per-seed values (non-finite dropped)."""
    out = []
    for x in losses:
        values = np.atleast_1d(np.asarray(x, np.float64))
        values = values[np.isfinite(values)]
        out.append(float(values.mean()) if values.size else float("nan"))
    return np.asarray(out, np.float64)


def _clean(sizes: Sequence[float], losses: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Sizes and mean losses as arrays, sorted by size, the sizes without a finite loss dropped."""
    n = np.asarray(sizes, np.float64)
    y = _as_means(losses)
    if n.shape != y.shape:
        raise ValueError(f"{n.size} sizes against {y.size} losses")
    if np.any(~np.isfinite(n)) or np.any(n <= 0):
        raise ValueError(f"parameter counts must be positive, got {list(sizes)}")
    keep = np.isfinite(y)
    order = np.argsort(n[keep])
    return n[keep][order], y[keep][order]


def fit_log_log_line(sizes: Sequence[float], losses: Sequence, note: str = "") -> ScalingFit:
    """``log L = log A - alpha log N`` by least squares (two or more sizes)."""
    n, y = _clean(sizes, losses)
    if n.size < 2 or np.unique(n).size < 2:
        raise ValueError(f"a log-log line needs two distinct sizes, got {n.size}")
    if np.any(y <= 0):
        raise ValueError("a log-log line needs positive losses")
    slope, intercept = np.polyfit(np.log(n), np.log(y), 1)
    fit = ScalingFit(
        LOG_LOG_LINE,
        0.0,
        float(math.exp(intercept)),
        float(-slope),
        (n[0], n[-1]),
        int(n.size),
        0.0,
        note,
    )
    return dataclasses.replace(fit, rms=float(np.sqrt(np.mean((fit.predict(n) - y) ** 2))))


def _fit_power_law(n: np.ndarray, y: np.ndarray) -> ScalingFit | None:
    """``L = E + exp(a - alpha * log(N / N0))`` with ``N0`` the geometric mean of the sizes
    (so ``a`` and ``alpha`` are not tied together by a large ``log N``), ``0 <= E < min L``,
    ``0 < alpha <= 4``; the best of a few starts, or None when none converges."""
    from scipy.optimize import least_squares

    x = np.log(n) - np.log(n).mean()
    y_min = float(y.min())
    best = None
    for e_share in (0.0, 0.5, 0.8, 0.95):
        e0 = e_share * y_min
        gap = np.maximum(y - e0, 1e-6)
        slope, a0 = np.polyfit(x, np.log(gap), 1)
        start = np.array([e0, a0, float(np.clip(-slope, 1e-3, 3.9))])

        def residual(p):
            return p[0] + np.exp(p[1] - p[2] * x) - y

        try:
            res = least_squares(
                residual,
                start,
                bounds=([0.0, -50.0, 1e-4], [max(y_min * (1 - 1e-9), 1e-12), 50.0, 4.0]),
                x_scale="jac",
                max_nfev=2000,
            )
        except ValueError:
            continue
        if res.success and (best is None or res.cost < best.cost):
            best = res
    if best is None:
        return None
    e, a, alpha = (float(v) for v in best.x)
    amplitude = math.exp(a + alpha * float(np.log(n).mean()))  # A in L = E + A N^-alpha
    rms = float(np.sqrt(np.mean(best.fun**2)))
    return ScalingFit(POWER_LAW, e, amplitude, alpha, (n[0], n[-1]), int(n.size), rms)


def fit_scaling_law(
    sizes: Sequence[float], losses: Sequence, min_sizes: int = MIN_SIZES_FOR_POWER_LAW
) -> ScalingFit | None:
    """Fit the losses (per size a value or per-seed values, averaged) against parameter counts:
    the three-parameter power law with ``min_sizes`` or more sizes, else (or when it does not
    converge) a straight line in log-log; None with fewer than two sizes."""
    n, y = _clean(sizes, losses)
    if np.unique(n).size < 2:
        return None
    if np.unique(n).size >= min_sizes:
        fit = _fit_power_law(n, y)
        if fit is not None:
            return fit
        return fit_log_log_line(n, y, note="the power law did not converge")
    return fit_log_log_line(
        n, y, note=f"{np.unique(n).size} sizes: fewer than {min_sizes} for three parameters"
    )


# ---------------------------------------------------------------------------- matching a loss
def matched_size(sizes: Sequence[float], losses: Sequence, target: float) -> float | None:
    """The smallest ``N`` at which the piecewise-linear curve (in ``log N``) through the measured
    mean losses reaches ``target``; None when ``target`` lies outside the measured losses."""
    n, y = _clean(sizes, losses)
    return _matched(n, np.log(n), y, target)


def _matched(n: np.ndarray, x: np.ndarray, y: np.ndarray, target: float) -> float | None:
    """:func:`matched_size` on clean arrays (sorted sizes, their logs, the mean losses)."""
    if n.size == 0 or not math.isfinite(target):
        return None
    if n.size == 1:
        return float(n[0]) if y[0] == target else None
    for i in range(n.size - 1):
        lo, hi = (y[i], y[i + 1]) if y[i] <= y[i + 1] else (y[i + 1], y[i])
        if lo <= target <= hi:
            if y[i] == y[i + 1]:
                return float(n[i])
            t = (y[i] - target) / (y[i] - y[i + 1])
            return float(math.exp(x[i] + t * (x[i + 1] - x[i])))
    return None


def fitted_size(f: ScalingFit, target: float) -> float | None:
    """The ``N`` at which the fit ``f`` equals ``target``, when it lies inside the measured
    range ``f.sizes`` it was fitted on (never extrapolated); else None."""
    gap = target - f.E
    if not math.isfinite(target) or gap <= 0 or f.A <= 0 or f.alpha <= 0:
        return None
    n = math.exp(math.log(f.A / gap) / f.alpha)
    lo, hi = f.sizes
    return n if lo * (1 - 1e-9) <= n <= hi * (1 + 1e-9) else None


METHODS = ("interpolate", "fit")


def parameter_ratio(
    diff_sizes: Sequence[float],
    diff_losses: Sequence,
    twin_sizes: Sequence[float],
    twin_losses: Sequence,
    method: str = "interpolate",
) -> list[float | None]:
    """Per twin size: ``N_DIFF(L_twin) / N_twin``, where ``N_DIFF(L)`` is the DIFF parameter
    count at which DIFF's loss equals ``L``: with ``method="interpolate"`` interpolated in
    ``log N`` between measured DIFF sizes (:func:`matched_size`), with ``"fit"`` read from
    DIFF's fitted scaling law restricted to its measured sizes (:func:`fitted_size`). None
    where the twin's loss is outside DIFF's measured range. Losses per size: a value or the
    per-seed values (averaged)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    twin_means = _as_means(twin_losses)
    if len(twin_sizes) != twin_means.size:
        raise ValueError(f"{len(twin_sizes)} twin sizes against {twin_means.size} losses")
    f = fit_scaling_law(diff_sizes, diff_losses) if method == "fit" else None
    n, y = _clean(diff_sizes, diff_losses)
    x = np.log(n)
    out = []
    for n_twin, target in zip(twin_sizes, twin_means):
        inside = _matched(n, x, y, float(target)) is not None  # within DIFF's measured losses
        if method == "fit":
            n_diff = None if f is None or not inside else fitted_size(f, float(target))
        else:
            n_diff = _matched(n, x, y, float(target))
        out.append(None if n_diff is None else n_diff / float(n_twin))
    return out


def unmatched_bound(
    diff_sizes: Sequence[float], diff_losses: Sequence, n_twin: float, target: float
) -> tuple[str, float] | None:
    """Where a twin loss ``target`` lies outside DIFF's measured losses: ``("<", r)`` when even
    DIFF's smallest measured size reaches it (the ratio is below ``r = N_DIFF,min / N_twin``),
    ``(">", r)`` when not even its largest does (above ``N_DIFF,max / N_twin``); None inside."""
    n, y = _clean(diff_sizes, diff_losses)
    if n.size == 0 or not math.isfinite(target) or matched_size(n, y, target) is not None:
        return None
    if y[0] <= target:
        return "<", float(n[0] / n_twin)
    if np.all(y > target):
        return ">", float(n[-1] / n_twin)
    return None


# ---------------------------------------------------------------------------- bootstrap
@dataclasses.dataclass(frozen=True)
class Interval:
    """A bootstrap percentile interval: ``low`` and ``high`` (None when there is none: too few
    resamples give a value, one seed, or seeds that agree exactly; ``reason`` says which),
    ``defined`` the share of resamples that gave a value, ``resamples`` their count."""

    low: float | None
    high: float | None
    defined: float
    resamples: int
    confidence: float
    reason: str = ""

    def describe(self, spec: str = "{:.0%}") -> str:
        if self.low is None:
            return f"no interval: {self.reason}"
        text = (
            f"{self.confidence:.0%} bootstrap interval [{spec.format(self.low)}, "
            f"{spec.format(self.high)}]"
        )
        if self.defined < 1.0:
            text += f" ({self.defined:.0%} of resamples within the measured range)"
        return text


ONE_SEED = "one seed per size, nothing to resample (set compare.seeds=2 or more)"


def _interval(
    values: list[float | None], confidence: float, min_defined: float, seeds: int
) -> Interval:
    """The percentile interval of the resampled values (``seeds``: the most seeds of a size)."""
    got = np.array([v for v in values if v is not None and math.isfinite(v)], np.float64)
    share = got.size / max(len(values), 1)
    if seeds < 2:
        return Interval(None, None, share, len(values), confidence, ONE_SEED)
    if got.size == 0 or share < min_defined:
        reason = f"{share:.0%} of {len(values)} resamples within the measured range"
        return Interval(None, None, share, len(values), confidence, reason)
    if float(np.ptp(got)) <= 1e-12 * float(np.abs(got).max()):
        reason = "the seeds agree exactly, no spread to resample"
        return Interval(None, None, share, len(values), confidence, reason)
    a = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(got, [a, 100.0 - a])
    return Interval(float(low), float(high), share, len(values), confidence)


def _paired_seeds(diff_seeds: Sequence, twin_seeds: Sequence) -> list[tuple[np.ndarray, ...]]:
    """Per size: the DIFF and twin per-seed values as equal-length arrays (seed s with seed s)."""
    out = []
    for d, t in zip(diff_seeds, twin_seeds, strict=True):
        d, t = np.atleast_1d(np.asarray(d, np.float64)), np.atleast_1d(np.asarray(t, np.float64))
        if d.shape[0] != t.shape[0]:
            raise ValueError(
                f"paired seeds: {d.shape[0]} DIFF seeds against {t.shape[0]} twin seeds at a size"
            )
        out.append((d, t))
    return out


def bootstrap_parameter_ratio(
    diff_sizes: Sequence[float],
    diff_seed_losses: Sequence[Sequence[float]],
    twin_sizes: Sequence[float],
    twin_seed_losses: Sequence[Sequence[float]],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    min_defined: float = 0.5,
    seed: int = 0,
) -> list[Interval]:
    """Per twin size, a percentile interval of :func:`parameter_ratio`: each resample draws,
    per size, seed indices with replacement, the same indices for DIFF and the twin (the two
    sizes lists correspond entry by entry: one ladder). A resample whose twin loss falls
    outside DIFF's resampled range gives no value; with fewer than ``min_defined`` of them
    giving one, no interval."""
    if len(diff_sizes) != len(twin_sizes):
        raise ValueError("the DIFF and twin sizes come from one ladder: give as many of each")
    pairs = _paired_seeds(diff_seed_losses, twin_seed_losses)
    rng = np.random.default_rng(seed)
    draws: list[list[float | None]] = [[] for _ in twin_sizes]
    for _ in range(resamples):
        d_means, t_means = [], []
        for d, t in pairs:
            idx = rng.integers(0, d.shape[0], d.shape[0])
            d_means.append(float(np.mean(d[idx])))
            t_means.append(float(np.mean(t[idx])))
        for i, r in enumerate(parameter_ratio(diff_sizes, d_means, twin_sizes, t_means)):
            draws[i].append(r)
    seeds = max((d.shape[0] for d, _ in pairs), default=0)
    return [_interval(v, confidence, min_defined, seeds) for v in draws]


# ---------------------------------------------------------------------------- tokens
def tokens_to_reach(
    tokens: Sequence[float], losses: Sequence[float], target: float
) -> float | None:
    """The tokens at which a learning curve (validation loss at increasing tokens) first reaches
    ``target``, interpolated linearly in ``log tokens`` between the two evaluations around the
    crossing; None when it never does, or already does at its first evaluation (no earlier
    point to interpolate from)."""
    t = np.asarray(tokens, np.float64)
    y = np.asarray(losses, np.float64)
    if t.shape != y.shape or t.size == 0:
        raise ValueError(f"{t.size} token counts against {y.size} losses")
    if not math.isfinite(target) or y[0] <= target:
        return None
    for i in range(1, t.size):
        if y[i] <= target:
            if t[i - 1] <= 0:
                return float(t[i])
            s = (y[i - 1] - target) / (y[i - 1] - y[i])
            x0, x1 = math.log(t[i - 1]), math.log(t[i])
            return float(math.exp(x0 + s * (x1 - x0)))
    return None


def tokens_ratio(
    diff_tokens: Sequence[float],
    diff_losses: Sequence[float],
    twin_tokens: Sequence[float],
    twin_losses: Sequence[float],
) -> float | None:
    """``T_DIFF / T_twin``: the tokens at which DIFF's validation loss first reaches the twin's
    final validation loss, over the twin's tokens at that final evaluation; None when DIFF does
    not reach it within its curve (or at its first point already)."""
    target = float(np.asarray(twin_losses, np.float64)[-1])
    reached = tokens_to_reach(diff_tokens, diff_losses, target)
    return None if reached is None else reached / float(np.asarray(twin_tokens)[-1])


def bootstrap_tokens_ratio(
    diff_tokens: Sequence[float],
    diff_seed_curves: Sequence[Sequence[float]],
    twin_tokens: Sequence[float],
    twin_seed_curves: Sequence[Sequence[float]],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    min_defined: float = 0.5,
    seed: int = 0,
) -> Interval:
    """A percentile interval of :func:`tokens_ratio` on the seed-mean curves, resampling seeds
    with replacement (DIFF's and the twin's seed ``s`` together). Curves: one row per seed."""
    d = np.atleast_2d(np.asarray(diff_seed_curves, np.float64))
    t = np.atleast_2d(np.asarray(twin_seed_curves, np.float64))
    if d.shape[0] != t.shape[0]:
        raise ValueError(f"paired seeds: {d.shape[0]} DIFF curves against {t.shape[0]} twin curves")
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        idx = rng.integers(0, d.shape[0], d.shape[0])
        values.append(tokens_ratio(diff_tokens, d[idx].mean(0), twin_tokens, t[idx].mean(0)))
    return _interval(values, confidence, min_defined, d.shape[0])
