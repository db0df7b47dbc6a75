"""``python -m diffjax.evaluate RUN_DIR [--quick] [--lm-eval-tasks t1,t2 ...]``: the paper's
analyses on a train.py run, and lm-eval tasks on its models; ``python -m diffjax.evaluate
RUN_DIR --long-context 32768 mesh.context=8``: the needle grid with the sequence split over
devices. RUN_DIR: a local folder or a ``gs://BUCKET/PATH`` URL (checked for access first)."""

from __future__ import annotations

import argparse
import sys

from diffjax import storage
from diffjax.config import ConfigError
from diffjax.train.checkpoint import CheckpointError

from diffjax.sharding import MeshConfig
from diffjax.train.config import ExperimentConfig, apply_overrides

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


def _mesh(overrides: list[str]) -> MeshConfig:
    """The mesh of ``mesh.KEY=VALUE`` overrides (typed and checked as train.py's), from
    ``context=-1``."""
    other = [o for o in overrides if not o.startswith("mesh.")]
    if other:
        raise ConfigError(
            f"{other[0]!r}: only mesh.KEY=VALUE settings follow the run directory. Fix: e.g. "
            f"mesh.context=8 (the model and data come from the run)"
        )
    return apply_overrides(ExperimentConfig(mesh=MeshConfig(context=-1)), overrides).mesh


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m diffjax.evaluate",
        description="Run the paper's analyses (multi-needle retrieval, attention allocation, "
        "contribution by ablation, activation outliers, logit quantization, the noise floor, "
        "loss by position) on every model of a train.py run directory; writes "
        "RUN_DIR/eval.md, eval.json and eval_*.png. With --lm-eval-tasks also lm-eval tasks "
        "on every model (the `eval` extra): RUN_DIR/lm_eval.json and a section of eval.md.",
    )
    p.add_argument(
        "run_dir",
        help="a directory written by train.py (e.g. runs/needle, or gs://BUCKET/runs/needle)",
    )
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
    p.add_argument(
        "mesh",
        nargs="*",
        metavar="mesh.KEY=VALUE",
        help="the mesh of --long-context, as train.py takes it (default mesh.context=-1: every "
        "device splits the sequence; e.g. mesh.context=8 mesh.context_order=striped)",
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
    args = parser().parse_intermixed_args(argv)
    tasks = args.lm_eval_tasks.split(",") if args.lm_eval_tasks else None
    try:
        # a gs:// run: the bucket, the credentials and the right to write, before any compute
        storage.check_access(args.run_dir, what="RUN", write=True)
        if args.mesh and not args.long_context:
            raise ConfigError(
                "mesh settings apply to --long-context only. Fix: add --long-context LENGTHS"
            )
        if args.long_context:
            evaluate_long_context(
                args.run_dir,
                _lengths(args.long_context),
                mesh_config=_mesh(args.mesh),
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
