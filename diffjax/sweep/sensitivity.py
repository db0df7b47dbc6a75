"""Learning-rate sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale
Transformer training instabilities", section 3.1) and its paired bootstrap over seeds.

For one model and seed, with ``ℓ(η)`` the final loss at learning rate ``η`` over the swept
rungs and ``ℓ₀`` the loss at initialisation::

    sensitivity = mean over η of [ min(ℓ(η), ℓ₀) - min over η of ℓ(η) ]

A rung whose final loss is not finite (it diverged) counts as ``ℓ₀``, as the cap does for a
loss above it. Lower is more robust: 0 when every rung ends at the best loss.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np


def lr_sensitivity(final: Sequence[float], initial: float) -> float:
    """The sensitivity of one run family: ``final`` the final losses over the rungs (NaN or inf
    where a rung diverged), ``initial`` the loss at initialisation."""
    x = np.asarray(final, float)
    if x.size == 0:
        raise ValueError("lr_sensitivity: no rungs. Fix: pass one final loss per rung")
    if not np.isfinite(initial):
        raise ValueError(f"lr_sensitivity: the loss at initialisation is {initial}")
    capped = np.where(np.isfinite(x), np.minimum(x, initial), initial)
    return float(np.mean(capped - capped.min()))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean over seeds and its bootstrap interval (None with a single seed)."""

    mean: float
    low: float | None
    high: float | None
    seeds: int

    def cell(self, spec: str = "{:.4f}") -> str:
        text = spec.format(self.mean)
        if self.low is None:
            return f"{text} (1 seed: no interval)"
        return f"{text} [{spec.format(self.low)}, {spec.format(self.high)}]"


def bootstrap(
    per_seed: Mapping[str, Sequence[float]],
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Estimate]:
    """Each model's mean over seeds with a paired percentile bootstrap interval: every
    resample draws seed indices with replacement once and uses them for every model (the
    models' values at one index come from the same init seed and data order), so a
    difference of two models' entries, computed per seed and passed as its own entry, gets its
    paired interval. ``per_seed``: ``{model: [value per seed]}``, equally long. With 2 seeds
    the resamples take only 3 distinct values: the interval is that coarse."""
    lengths = {len(v) for v in per_seed.values()}
    if len(lengths) != 1:
        raise ValueError(
            f"bootstrap: every model needs one value per seed, got lengths {sorted(lengths)}"
        )
    n = lengths.pop()
    values = {k: np.asarray(v, float) for k, v in per_seed.items()}
    if n < 2:
        return {k: Estimate(float(v.mean()), None, None, n) for k, v in values.items()}
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    tail = (1 - level) / 2 * 100
    out = {}
    for k, v in values.items():
        means = v[idx].mean(axis=1)
        low, high = np.percentile(means, [tail, 100 - tail])
        out[k] = Estimate(float(v.mean()), float(low), float(high), n)
    return out
