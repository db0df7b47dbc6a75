"""The scaling sweep: DIFF and its standard-attention twin compared at every size of a ladder,
their loss-against-parameters curves fitted, and the parameter-efficiency ratio (the DIFF
parameters, or training tokens, that reach the twin's loss, over the twin's).

``python -m diffjax.sweep --config configs/scaling_cpu.py`` (:func:`main`) runs
:mod:`diffjax.compare` at each size of the config file's ``SWEEP`` (:class:`Ladder`) into
``RUN_DIR/size_<d_model>x<num_layers>/`` and writes ``RUN_DIR/sweep.md`` with its plots
(:func:`write_sweep_report`); the fits and ratios are plain functions of numbers
(:mod:`diffjax.sweep.fit`). See docs/sweep.md.
"""

from diffjax.sweep.cli import main, non_embedding_params, plan_sweep
from diffjax.sweep.fit import (
    Interval,
    ScalingFit,
    bootstrap_parameter_ratio,
    bootstrap_tokens_ratio,
    fit_log_log_line,
    fit_scaling_law,
    fitted_size,
    matched_size,
    parameter_ratio,
    tokens_ratio,
    tokens_to_reach,
    unmatched_bound,
)
from diffjax.sweep.ladder import Ladder, load_ladder, size_name
from diffjax.sweep.report import write_sweep_report

__all__ = [
    "Interval",
    "Ladder",
    "ScalingFit",
    "bootstrap_parameter_ratio",
    "bootstrap_tokens_ratio",
    "fit_log_log_line",
    "fit_scaling_law",
    "fitted_size",
    "load_ladder",
    "main",
    "matched_size",
    "non_embedding_params",
    "parameter_ratio",
    "plan_sweep",
    "size_name",
    "tokens_ratio",
    "tokens_to_reach",
    "unmatched_bound",
    "write_sweep_report",
]
