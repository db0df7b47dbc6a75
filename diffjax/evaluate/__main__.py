"""``python -m diffjax.evaluate RUN_DIR [--quick] [--lm-eval-tasks t1,t2 ...]``: the paper's
analyses on a train.py run, and lm-eval tasks on its models."""

from __future__ import annotations

import argparse
import sys

from diffjax.config import ConfigError
from diffjax.train.checkpoint import CheckpointError

from diffjax.sharding import MeshConfig

from . import lm_eval_run
from .long_context import evaluate_long_context
from .run import evaluate_run


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--lm-eval-limit {text} must be > 0")
    return int(value) if value >= 1 and value == int(value) else value


def _lengths(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"--long-context {text!r}: give token counts separated by commas. Fix: e.g. "
            f"--long-context 8192,32768"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m diffjax.evaluate",
        description="Run the paper's analyses (multi-needle retrieval, attention allocation, "
        "contribution by ablation, activation outliers, logit quantization, the noise floor, "
        "loss by position) on every model of a train.py run directory; writes "
        "RUN_DIR/eval.md, eval.json and eval_*.png. With --lm-eval-tasks also lm-eval tasks "
        "on every model (the `eval` extra): RUN_DIR/lm_eval.json and a section of eval.md.",
    )
    p.add_argument("run_dir", help="a directory written by train.py (e.g. runs/needle)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small subset: one context length, few examples (under a "
        "minute of CPU time for the default comparison)",
    )
    c = p.add_argument_group("long context (the sequence split over devices)")
    c.add_argument(
        "--long-context",
        default=None,
        metavar="LENGTHS",
        help="only the multi-needle grid at these lengths (comma-separated tokens), on a mesh "
        "whose context axis splits the sequence: RUN_DIR/long_context.md",
    )
    c.add_argument("--context", type=int, default=-1, help="devices on the context axis (-1: all)")
    c.add_argument(
        "--context-order", default="zigzag", help="the tokens' order: zigzag or contiguous"
    )
    c.add_argument(
        "--long-context-examples", type=int, default=8, help="examples per length (default 8)"
    )
    g = p.add_argument_group("lm-evaluation-harness tasks")
    g.add_argument("--lm-eval-tasks", default=None, help="lm-eval task names, comma-separated")
    g.add_argument(
        "--lm-eval-only",
        action="store_true",
        help="only the lm-eval tasks: eval.md keeps its analyses, its lm-eval section is replaced",
    )
    g.add_argument("--lm-eval-include-path", default=None, help="a folder of task YAML files")
    g.add_argument(
        "--lm-eval-no-default-tasks",
        dest="lm_eval_defaults",
        action="store_false",
        help="only the tasks of --lm-eval-include-path (skips indexing lm-eval's own tasks)",
    )
    g.add_argument(
        "--lm-eval-limit",
        type=_limit,
        default=None,
        help="at most N examples per task (<1: a fraction)",
    )
    g.add_argument(
        "--lm-eval-batch-size", default=str(lm_eval_run.DEFAULT_BATCH_SIZE), help="rows per batch"
    )
    g.add_argument(
        "--lm-eval-num-fewshot", type=int, default=None, help="shots (default: each task's)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    tasks = args.lm_eval_tasks.split(",") if args.lm_eval_tasks else None
    try:
        if args.long_context:
            evaluate_long_context(
                args.run_dir,
                _lengths(args.long_context),
                mesh_config=MeshConfig(context=args.context, context_order=args.context_order),
                examples=args.long_context_examples,
            )
            return 0
        if args.lm_eval_only and not tasks:
            raise ConfigError("--lm-eval-only runs no task. Fix: add --lm-eval-tasks t1,t2")
        if tasks:  # every input check before any compute
            lm_eval_run.prepare(
                args.run_dir,
                tasks,
                include_path=args.lm_eval_include_path,
                include_defaults=args.lm_eval_defaults,
            )
        if not args.lm_eval_only:
            evaluate_run(args.run_dir, quick=args.quick)
        if tasks:
            lm_eval_run.evaluate_run_tasks(
                args.run_dir,
                tasks,
                include_path=args.lm_eval_include_path,
                include_defaults=args.lm_eval_defaults,
                limit=args.lm_eval_limit,
                batch_size=args.lm_eval_batch_size,
                num_fewshot=args.lm_eval_num_fewshot,
            )
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
