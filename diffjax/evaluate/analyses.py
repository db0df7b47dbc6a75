"""The registry: every analysis of ``python -m diffjax.evaluate``, in the order of its section in
``eval.md``. Each is one module's :class:`~diffjax.evaluate.analysis.Analysis` (its measure, its
typed result in eval.json, its section and plot); the runner (:mod:`.run`) and the report
(:mod:`.report`) only loop over this list, so a new analysis is its module and a line here."""

from __future__ import annotations

from diffjax.evaluate import (
    ablation,
    allocation,
    noise_floor,
    outliers,
    positions,
    quantize,
    retrieval,
    sinks,
)
from diffjax.evaluate import validation
from diffjax.evaluate.analysis import Analysis

ANALYSES: tuple[Analysis, ...] = (
    validation.ANALYSIS,
    retrieval.ANALYSIS,
    allocation.ANALYSIS,  # with the retrieval head
    ablation.ANALYSIS,
    outliers.ANALYSIS,
    quantize.ANALYSIS,
    noise_floor.ANALYSIS,  # the closed form beside the measured noise floor
    positions.ANALYSIS,
    sinks.ANALYSIS,  # every model: DIFF's and gated attention's claim
)
