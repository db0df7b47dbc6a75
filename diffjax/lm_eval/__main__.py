"""``python -m diffjax.lm_eval ...``: lm-eval's command line with the ``diffjax`` model
registered (stock ``lm-eval`` discovers no model outside its own package). Tasks on every model
of a ``train.py`` run, with the seeds and the paired DIFF - twin interval in ``eval.md``:
``python -m diffjax.evaluate RUN_DIR lm_eval.tasks=t1,t2``."""

from __future__ import annotations

import sys
from typing import Sequence

from lm_eval.__main__ import cli_evaluate

from diffjax.lm_eval import DiffJaxLM  # noqa: F401 - registers the model as "diffjax"


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line on ``argv`` (default: ``sys.argv``, untouched)."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--run" or a.startswith("--run=") for a in args_in):
        print(
            "error: lm-eval tasks on every model of a run: python -m diffjax.evaluate RUN_DIR "
            "lm_eval.tasks=t1,t2 [lm_eval.only=true] (see --help there)",
            file=sys.stderr,
        )
        return 2
    if argv is not None:
        sys.argv = [sys.argv[0], *args_in]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        sys.exit(code)
