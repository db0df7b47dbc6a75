"""Small helpers for reading the per-model results of a run (``eval.json``'s ``models``, or
their typed :class:`diffjax.evaluate.analysis.ModelResult`) in tables and plots."""

from __future__ import annotations

import numpy as np


def model_name(label: str, rs: list) -> str:
    """``"label (attention kind)"``, the column name of a model (``rs``: its results, eval.json
    entries or :class:`~diffjax.evaluate.analysis.ModelResult`)."""
    attention = rs[0]["attention"] if isinstance(rs[0], dict) else rs[0].attention
    return f"{label} ({attention})"


def seed_mean(arrays) -> np.ndarray:
    """Mean over seeds ignoring NaN (empty depth bins), NaN where every seed has NaN."""
    a = (
        np.asarray([np.nan if x is None else x for x in arrays], float)
        if not any(isinstance(x, (list, np.ndarray)) for x in arrays)
        else np.asarray(arrays, float)
    )
    n = np.isfinite(a).sum(0)
    return np.where(n > 0, np.nansum(a, 0) / np.maximum(n, 1), np.nan)
