"""The experiment: a DIFF model against its standard-attention twin.

``python train.py`` (= ``python -m diffjax.compare``, :func:`main`) trains the configured DIFF
model and its twin on the same data in the same order from each init seed
(``train.num_seeds``; seed by seed the pair shares the init seed and the batches), times the
two side by side (:func:`side_by_side_throughput`), and writes ``runs/<name>/``:
``config.json``, ``report.md`` and ``loss.png`` (:func:`write_report`; the statistics are
:mod:`diffjax.evaluate.stats`) and ``<label>/seed_<seed>/`` per model and seed
(:func:`diffjax.train.model_directory`); then, unless ``train.quick_eval=false``, the quick
evaluation (:mod:`diffjax.evaluate`).
"""

from .cli import main, quick_evaluation, train_seeds
from .report import (
    comparison_sentences,
    learned_counts,
    per_seed_table,
    plot_losses,
    results_table,
    write_report,
)
from .throughput import SideBySide, side_by_side_throughput

__all__ = [
    "SideBySide",
    "comparison_sentences",
    "learned_counts",
    "main",
    "per_seed_table",
    "plot_losses",
    "quick_evaluation",
    "results_table",
    "side_by_side_throughput",
    "train_seeds",
    "write_report",
]
