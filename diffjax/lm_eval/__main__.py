"""``python -m diffjax.lm_eval ...``: lm-eval's command line with the ``diffjax`` model
registered (stock ``lm-eval`` discovers no model outside its own package).

``python -m diffjax.lm_eval --run RUN_DIR --tasks t1,t2 [--include_path P] [--limit N]
[--batch_size N] [--num_fewshot K] [--no-default-tasks]`` instead runs the tasks on every model
of a ``train.py`` run (:func:`diffjax.lm_eval.run.evaluate_run_tasks`): ``RUN_DIR/lm_eval.json``
and a section of ``RUN_DIR/eval.md``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lm_eval.__main__ import cli_evaluate

from diffjax.config import ConfigError
from diffjax.lm_eval import DiffJaxLM  # noqa: F401 - registers the model as "diffjax"
from diffjax.lm_eval.model import DEFAULT_BATCH_SIZE
from diffjax.lm_eval.run import evaluate_run_tasks


def _is_run_mode(argv: Sequence[str]) -> bool:
    return any(a == "--run" or a.startswith("--run=") for a in argv)


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--limit {text} must be > 0")
    return int(value) if value >= 1 and value == int(value) else value


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m diffjax.lm_eval --run",
        description="lm-eval tasks on every model of a train.py run (DIFF and its twin, each "
        "seed): RUN_DIR/lm_eval.json and the section '## LM Eval Harness tasks' of "
        "RUN_DIR/eval.md. Without --run: lm-eval's own command line.",
    )
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="a train.py run directory")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    p.add_argument("--include_path", default=None, help="a folder of extra task YAML files")
    p.add_argument(
        "--limit", type=_limit, default=None, help="at most N examples per task (<1: a fraction)"
    )
    p.add_argument("--batch_size", default=str(DEFAULT_BATCH_SIZE), help="rows per batch")
    p.add_argument("--num_fewshot", type=int, default=None, help="shots (default: each task's)")
    p.add_argument(
        "--no-default-tasks",
        dest="default_tasks",
        action="store_false",
        help="only the tasks of --include_path (skips indexing lm-eval's own task files)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``--run``: :func:`evaluate_run_tasks` (exit 2 with a one-line error on bad input);
    otherwise lm-eval's command line on ``argv`` (default: ``sys.argv``, untouched)."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    if not _is_run_mode(args_in):
        if argv is not None:
            sys.argv = [sys.argv[0], *args_in]
        cli_evaluate()
        return 0
    args = run_parser().parse_args(args_in)
    if not args.default_tasks and not args.include_path:
        print(
            "error: --no-default-tasks needs --include_path (no task would be known)",
            file=sys.stderr,
        )
        return 2
    try:
        evaluate_run_tasks(
            args.run,
            args.tasks.split(","),
            include_path=args.include_path,
            include_defaults=args.default_tasks,
            limit=args.limit,
            batch_size=args.batch_size,
            num_fewshot=args.num_fewshot,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        sys.exit(code)
