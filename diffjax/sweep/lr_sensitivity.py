"""``python -m diffjax.sweep.lr_sensitivity --config FILE [--report-only] [key=value ...]``: DIFF
and its twin trained at every learning rate of the config file's ``SENSITIVITY`` ladder (a
:class:`diffjax.sweep.Ladder` over ``train.lr``), then their learning-rate sensitivity
(:mod:`diffjax.sweep.sensitivity`) with its paired bootstrap over seeds, in ``RUN_DIR/sweep.md``.
The sweep's runner, resume and overrides (:mod:`diffjax.sweep.cli`)."""

from __future__ import annotations

import sys

from diffjax.sweep.cli import AfterStep
from diffjax.sweep.cli import main as sweep_main


def main(argv: list[str] | None = None, *, after_step: AfterStep | None = None) -> int:
    """The learning-rate sensitivity's command line; returns the exit code."""
    return sweep_main(argv, after_step=after_step, study="SENSITIVITY")


if __name__ == "__main__":
    sys.exit(main())
