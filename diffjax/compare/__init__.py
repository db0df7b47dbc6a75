"""The experiment: a DIFF model against its standard-attention twin.

``python train.py`` (= ``python -m diffjax.compare``, :func:`main`) trains the configured DIFF
model and its twin on the same data in the same order from each init seed (a
:class:`Comparison`: one model's experiment with a ``compare`` section, :class:`CompareConfig`;
``compare.seeds``: seed by seed the pair shares the init seed and the batches), times the
two side by side (:func:`side_by_side_throughput`), and writes ``runs/<name>/``:
``config.json``, ``report.md`` and ``loss.png`` (:func:`write_report`; the statistics are
:mod:`diffjax.evaluate.stats`) and ``<label>/seed_<seed>/`` per model and seed
(:func:`diffjax.train.model_directory`); then, with ``compare.quick_eval``, the quick
evaluation (:mod:`diffjax.evaluate`).

A config file with a module-level ``RETROFIT`` (:class:`RetrofitStudy`) is a retrofit study,
run by ``python -m diffjax.retrofit_study`` (:mod:`.retrofit_study`: a standard model
trained, then continued unconverted and converted to DIFF V2 and V1; ``retrofit.md``,
:mod:`.retrofit_report`); each study's command: :mod:`.studies`.
"""

from diffjax.compare.config import (
    CompareConfig,
    Comparison,
    as_comparison,
    default_comparison,
    load_comparison,
)
from diffjax.compare.cli import exit_process, main, quick_evaluation, train_seeds
from diffjax.compare.report import (
    comparison_sentences,
    learned_counts,
    per_seed_table,
    plot_losses,
    results_table,
    write_report,
)
from diffjax.compare.retrofit_report import write_study_report
from diffjax.compare.retrofit_study import RetrofitStudy, run_study
from diffjax.compare.throughput import SideBySide, side_by_side_throughput

__all__ = [
    "CompareConfig",
    "Comparison",
    "as_comparison",
    "default_comparison",
    "load_comparison",
    "RetrofitStudy",
    "SideBySide",
    "comparison_sentences",
    "learned_counts",
    "exit_process",
    "main",
    "per_seed_table",
    "plot_losses",
    "quick_evaluation",
    "results_table",
    "run_study",
    "side_by_side_throughput",
    "train_seeds",
    "write_report",
    "write_study_report",
]
