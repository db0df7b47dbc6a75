"""The paper's analyses, as functions on a model and arrays, and ``python -m diffjax.evaluate
RUN_DIR [--quick]`` for a whole run (see docs/evaluation.md).

- :func:`multi_needle_retrieval` (Table 2), :func:`attention_allocation` (Table 3; per head, and the
  retrieval head by :func:`best_head`),
  :func:`contribution_by_ablation` (what one head's attention to each category adds to the
  answer's log-probability, by removing it; the head that matters most by
  :func:`best_ablation_head`),
  :func:`activation_outliers` (Table 5), :func:`quantization_sweep` /
  :func:`with_quantized_logits` (Fig. 8), :func:`noise_floor_closed_form` /
  :func:`noise_floor_streamed` / :func:`measured_noise_floor` (the noise floor; its gain:
  :func:`closed_form_gain`, :func:`asymptotic_gain`, :func:`cancellation_point`),
  :func:`loss_by_position` / :func:`validation_loss`, :func:`layer_attention_maps` (one block's
  maps inside a model, for plots);
- :func:`attention_maps` / :func:`attention_logits`: an attention layer's maps and logits on its
  input, from ``layer.project`` and the reference math; :func:`attention_rows` a few rows of
  the maps (any length);
- :func:`evaluate_run`: every analysis of the registry (:mod:`.analyses`; each module holds its
  measure, its typed result, its section of ``eval.md`` and its plot) on every model of a run,
  into ``eval.json`` and ``eval.md`` (:mod:`.report`; the paper's numbers beside ours:
  :mod:`.paper`).
"""

from diffjax.evaluate.ablation import Ablation, best_ablation_head, contribution_by_ablation
from diffjax.evaluate.allocation import (
    CATEGORIES,
    Allocation,
    attention_allocation,
    best_head,
    category_mass,
    measured_noise_floor,
    position_categories,
)
from diffjax.evaluate.noise_floor import (
    asymptotic_gain,
    cancellation_point,
    closed_form_gain,
    noise_floor_closed_form,
    noise_floor_streamed,
)
from diffjax.evaluate.outliers import activation_outliers, top_magnitudes
from diffjax.evaluate.inputs import ModelInputs, needle_task, task_examples, validation_examples
from diffjax.evaluate.positions import corpus_for_positions, loss_by_position, validation_loss
from diffjax.evaluate.probe import (
    attention_logits,
    attention_maps,
    attention_rows,
    layer_attention_maps,
    losses_and_predictions,
)
from diffjax.evaluate.quantize import (
    QuantizedLogits,
    absmax_quantize,
    quantization_sweep,
    with_quantized_logits,
)
from diffjax.evaluate.retrieval import (
    RetrievalGrid,
    multi_needle_retrieval,
    query_correct,
    query_depths,
)
from diffjax.evaluate.run import ModelEntry, discover_models, evaluate_model, evaluate_run
from diffjax.evaluate.settings import EvalSettings
from diffjax.evaluate.stats import mean_std

__all__ = [
    "Ablation",
    "Allocation",
    "CATEGORIES",
    "EvalSettings",
    "ModelEntry",
    "ModelInputs",
    "QuantizedLogits",
    "RetrievalGrid",
    "absmax_quantize",
    "activation_outliers",
    "attention_allocation",
    "attention_logits",
    "attention_maps",
    "attention_rows",
    "best_ablation_head",
    "best_head",
    "category_mass",
    "corpus_for_positions",
    "discover_models",
    "evaluate_model",
    "evaluate_run",
    "loss_by_position",
    "losses_and_predictions",
    "mean_std",
    "layer_attention_maps",
    "measured_noise_floor",
    "multi_needle_retrieval",
    "needle_task",
    "noise_floor_closed_form",
    "noise_floor_streamed",
    "asymptotic_gain",
    "cancellation_point",
    "closed_form_gain",
    "contribution_by_ablation",
    "position_categories",
    "quantization_sweep",
    "query_correct",
    "query_depths",
    "task_examples",
    "top_magnitudes",
    "validation_examples",
    "validation_loss",
    "with_quantized_logits",
]
