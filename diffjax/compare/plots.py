"""The pictures every paired report draws the same way: seeds thin and their mean thick, DIFF −
twin with its pointwise band and crossover, token axes with short labels. The comparison's
``loss.png``, the retrofit study's and the sweeps' figures compose them."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.ticker import FuncFormatter, MaxNLocator

from diffjax.compare.curves import CROSSING, FROM_START, Crossover, DifferenceCurve, mean_curve


def compact_count(x: float, _pos=None) -> str:
    """A token count as a short tick label: ``0``, ``950``, ``100k``, ``1.5M``, ``2B``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def token_axis(ax, legend: bool = True) -> None:
    """Tokens on ``ax``'s x axis: few ticks with short labels (120k, 1.5M; long token counts
    otherwise run together), a light grid and the legend."""
    ax.set_xlabel("tokens")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.xaxis.set_major_formatter(FuncFormatter(compact_count))
    if legend:
        ax.legend(fontsize=8)


def draw_seed_curves(
    ax,
    curves: Sequence[tuple[np.ndarray, np.ndarray]],
    color: str,
    label: str,
    *,
    marker: str | None = None,
) -> None:
    """One model's curves ``(x, y)``, one per seed, on ``ax``: each seed thin and the mean over
    the x values they share thick (one seed: that curve, labelled ``label``)."""
    if len(curves) == 1:
        ax.plot(*curves[0], color=color, lw=1.8, label=label, marker=marker, ms=3)
        return
    for x, y in curves:
        ax.plot(x, y, color=color, lw=0.7, alpha=0.45)
    if curves:
        xs, mean = mean_curve(curves)
        n = len(curves)
        ax.plot(
            xs, mean, color=color, lw=2.4, label=f"{label}: mean of {n} seeds (thin: each seed)"
        )


def draw_points_and_mean(
    ax,
    xs: Sequence[float],
    values: Sequence[Sequence[float]],
    color: str,
    label: str,
    *,
    marker: str | None = None,
) -> np.ndarray:
    """At each ``x`` of ``xs`` its seeds' ``values`` as points, and their mean over the finite
    ones as a line (NaN where none is finite), labelled ``label``; returns the means."""
    means = []
    for x, ys in zip(xs, values):
        ys = np.asarray(ys, float)
        ax.scatter(np.full(ys.size, x), ys, s=12, alpha=0.5, color=color)
        finite = ys[np.isfinite(ys)]
        means.append(float(finite.mean()) if finite.size else np.nan)
    ax.plot(xs, means, color=color, lw=1.6, marker=marker, label=label)
    return np.asarray(means)


def draw_band(
    ax, x: np.ndarray, curve: DifferenceCurve, color: str, label: str, band: str | None = None
) -> None:
    """A difference curve's mean over seeds on ``ax`` against ``x`` (its tokens or steps), and
    with several seeds its pointwise band shaded where it is defined (``band``: its legend
    label)."""
    ax.plot(x, curve.mean, color=color, lw=2.2, marker="o", ms=2.5, label=label)
    ok = np.isfinite(curve.low)
    if curve.n_seeds > 1 and ok.any():
        ax.fill_between(
            x[ok], curve.low[ok], curve.high[ok], color=color, alpha=0.2, lw=0, label=band
        )


def draw_difference(
    ax, curve: DifferenceCurve, cross: Crossover, color: str = "C3", what: str = "DIFF − twin"
) -> None:
    """DIFF − twin against tokens on ``ax``: every seed thin, the mean over seeds thick, its
    pointwise band shaded (several seeds), a line at zero and the crossover marked; titled
    ``what`` and the crossover."""
    for d in curve.per_seed:
        ax.plot(curve.tokens, d, color=color, lw=0.7, alpha=0.4)
    n = curve.n_seeds
    label = f"mean of {n} seeds (thin: each seed)" if n > 1 else "one seed: no band"
    band = f"{curve.confidence:.0%} t-band over seeds (pointwise)"
    draw_band(ax, curve.tokens, curve, color, label, band)
    ax.axhline(0.0, color="black", lw=0.9)
    if cross.kind in (CROSSING, FROM_START):
        ax.axvline(cross.tokens, color="black", ls="--", lw=1.0, label="crossover")
    verdict = {
        CROSSING: f"crossover at {compact_count(cross.tokens or 0)} tokens",
        FROM_START: "DIFF ahead from the start",
    }.get(cross.kind, "one seed: no crossover claimed" if n < 2 else "no crossover")
    ax.set_title(f"{what}, validation loss ({verdict})", fontsize=10)
    ax.set_ylabel("DIFF − twin (nats/token; < 0: DIFF ahead)")
