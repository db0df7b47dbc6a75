"""Small helpers for reading the per-model results of a run (``eval.json``'s ``models``, or
their typed :class:`diffjax.evaluate.analysis.ModelResult`) in tables and plots."""

from __future__ import annotations

import numpy as np


def model_name(label: str, rs: list) -> str:
    """``"label (attention kind)"``, or ``"label (attention kind, elementwise gate)"`` for a
    gated model: the column name of a model (``rs``: its results, eval.json entries,
    :class:`~diffjax.evaluate.analysis.ModelResult` or :class:`diffjax.train.TrainResult`)."""
    r = rs[0]
    attention = r["attention"] if isinstance(r, dict) else r.attention
    gate = (r.get("gate") if isinstance(r, dict) else getattr(r, "gate", None)) or "none"
    return f"{label} ({attention}{'' if gate == 'none' else f', {gate} gate'})"


def kind_entry(config) -> dict:
    """What a model's result entry says of its kind: ``{"attention": ...}``, and ``"gate"``
    for a gated model (``config``: its :class:`diffjax.ModelConfig`); read by :func:`model_name`."""
    gated = config.gate != "none"
    return {"attention": config.attention, **({"gate": config.gate} if gated else {})}


def seed_mean(arrays) -> np.ndarray:
    """Mean over seeds ignoring NaN (empty depth bins), NaN where every seed has NaN."""
    a = (
        np.asarray([np.nan if x is None else x for x in arrays], float)
        if not any(isinstance(x, (list, np.ndarray)) for x in arrays)
        else np.asarray(arrays, float)
    )
    n = np.isfinite(a).sum(0)
    return np.where(n > 0, np.nansum(a, 0) / np.maximum(n, 1), np.nan)
