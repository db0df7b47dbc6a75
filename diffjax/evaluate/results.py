"""Reading the per-model results of a run (``eval.json``'s ``models``: one dict per model and
seed, grouped by label with :func:`diffjax.evaluate.stats.group_by_label`) for the report's
tables and plots."""

from __future__ import annotations

import numpy as np


def get(r: dict, *keys, default=None):
    """``r[k0][k1]...``, or ``default`` where a key or index is missing."""
    for k in keys:
        if isinstance(r, dict) and k in r:
            r = r[k]
        elif isinstance(r, list) and isinstance(k, int) and k < len(r):
            r = r[k]
        else:
            return default
    return r


def model_name(label: str, rs: list[dict]) -> str:
    """``"label (attention kind)"``, the column name of a model."""
    return f"{label} ({rs[0]['attention']})"


def seed_mean(arrays) -> np.ndarray:
    """Mean over seeds ignoring NaN (empty depth bins), NaN where every seed has NaN."""
    a = (
        np.asarray([np.nan if x is None else x for x in arrays], float)
        if not any(isinstance(x, (list, np.ndarray)) for x in arrays)
        else np.asarray(arrays, float)
    )
    n = np.isfinite(a).sum(0)
    return np.where(n > 0, np.nansum(a, 0) / np.maximum(n, 1), np.nan)


def retrieval_overall(r: dict, setting: str) -> float | None:
    """Retrieval accuracy over every length and depth of ``setting`` (``"N,R"``)."""
    g = r.get("retrieval", {}).get(setting)
    if not g:
        return None
    return float(np.sum(g["correct"]) / max(np.sum(g["total"]), 1))


def allocation_overall(r: dict, c: int) -> float | None:
    """The share of category ``c`` over every depth bin, weighted by the bin's queries."""
    a = r.get("allocation")
    if not a:
        return None
    w = np.asarray(a["count"], float)
    sh = np.nan_to_num(np.asarray(a["shares"], float)[:, c])
    return float((sh * w).sum() / max(w.sum(), 1))


def retrieval_head_share(r: dict) -> float | None:
    """The retrieval head's (held-out) answer share, None when none was found."""
    h = get(r, "allocation", "retrieval_head")
    if not h or h.get("layer") is None or not np.isfinite(h["share"]):
        return None
    return float(h["share"])


def diff_shares(noise: dict) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form differential map's signal and distractor weights as shares of the row's
    absolute mass."""
    s, d = np.asarray(noise["diff_signal"]), np.asarray(noise["diff_distractors"])
    mass = np.abs(s) + np.abs(d)
    return s / mass, d / mass
