"""``python -m diffjax.evaluate RUN_DIR [--quick] [eval.KEY=VALUE ...] [lm_eval.KEY=VALUE ...]``:
the paper's analyses on a train.py run, and lm-eval tasks on its models; ``python -m
diffjax.evaluate RUN_DIR long_context.lengths=32768 mesh.context=8``: the needle grid with the
sequence split over devices. RUN_DIR: a local folder or a ``gs://BUCKET/PATH`` URL (checked for
access first).

``--quick`` is a mode: it picks the quick set of :class:`EvalSettings` (one context length, few
examples) instead of the full one; ``eval.*`` settings change single fields of either."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from diffjax import cli
from diffjax.infra import storage
from diffjax.config import TOKEN_ORDERS, ConfigError
from diffjax.infra.sharding import MeshConfig
from diffjax.train.checkpoint import CheckpointError

from diffjax.evaluate import lm_eval_run
from diffjax.evaluate.lm_eval_run import LmEvalSettings
from diffjax.evaluate.long_context import LongContextSettings, evaluate_long_context
from diffjax.evaluate.run import evaluate_run
from diffjax.evaluate.settings import EvalSettings

PROG = "python -m diffjax.evaluate"


def sections(quick: bool = False) -> tuple[cli.Section, ...]:
    """The settings of ``python -m diffjax.evaluate``: ``eval.*`` (the analyses; the quick or
    the full set of :class:`EvalSettings`, less its ``quick``, which ``--quick`` sets),
    ``lm_eval.*``, ``long_context.*`` and ``mesh.*`` (long context only; from
    ``mesh.context=-1``: every device splits the sequence)."""
    return (
        cli.Section("eval", EvalSettings.for_run(quick), exclude=("quick",)),
        cli.Section("lm_eval", LmEvalSettings()),
        cli.Section("long_context", LongContextSettings()),
        cli.Section("mesh", MeshConfig(context=-1), {"context_order": TOKEN_ORDERS}),
    )


# each old flag and what replaced it (refused with the new spelling)
RENAMED = {
    "--long-context": cli.Renamed("long_context.lengths={}"),
    "--long-context-examples": cli.Renamed("long_context.examples={}"),
    "--lm-eval-tasks": cli.Renamed("lm_eval.tasks={}"),
    "--lm-eval-only": cli.Renamed("lm_eval.only=true", values="none"),
    "--lm-eval-include-path": cli.Renamed("lm_eval.include_path={}"),
    "--lm-eval-no-default-tasks": cli.Renamed("lm_eval.default_tasks=false", values="none"),
    "--lm-eval-limit": cli.Renamed("lm_eval.limit={}"),
    "--lm-eval-batch-size": cli.Renamed("lm_eval.batch_size={}"),
    "--lm-eval-num-fewshot": cli.Renamed("lm_eval.num_fewshot={}"),
}


def parser() -> argparse.ArgumentParser:
    quick = EvalSettings.for_run(True)
    p = cli.parser(
        PROG,
        "Run the paper's analyses (multi-needle retrieval, attention allocation, contribution "
        "by ablation, activation outliers, logit quantization, the noise floor, loss by "
        "position) on every model of a train.py run directory; writes RUN_DIR/eval.md, "
        "eval.json and eval_*.png. With lm_eval.tasks=t1,t2 also lm-eval tasks on every model "
        "(the `eval` extra): RUN_DIR/lm_eval.json and a section of eval.md. With "
        "long_context.lengths=L1,L2 only the needle grid at those lengths, the sequence split "
        "over the devices of mesh.* (RUN_DIR/long_context.md).",
        sections(),
        epilog=f"The eval.* defaults below are the full set; with --quick: retrieval_examples "
        f"{quick.retrieval_examples}, allocation_examples {quick.allocation_examples}, "
        f"val_examples {quick.val_examples}, outlier_examples {quick.outlier_examples}.",
        example=f"{PROG} runs/default --quick eval.bits=8,4 lm_eval.tasks=hellaswag "
        f"lm_eval.limit=100",
    )
    p.add_argument(
        "run_dir",
        help="a directory written by train.py (e.g. runs/needle, or gs://BUCKET/runs/needle)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a mode: the quick set of the analyses (one context length, few examples; under a "
        "minute of CPU time for the default comparison) instead of the full set",
    )
    return p


def _refused(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # --quick picks the defaults the eval.* settings change: look for the mode first
        quick = "--quick" in cli.split_overrides(argv)[1]
        args, settings = cli.parse(parser(), argv, sections(quick), RENAMED)
    except ConfigError as e:
        return _refused(str(e))
    lm: LmEvalSettings = settings["lm_eval"]
    long: LongContextSettings = settings["long_context"]
    given = {o.partition("=")[0].partition(".")[0] for o in args.overrides}
    try:
        # a gs:// run: the bucket, the credentials and the right to write, before any compute
        storage.check_access(args.run_dir, what="RUN", write=True)
        if "mesh" in given and not long.lengths:
            raise ConfigError(
                "mesh settings apply to the long-context grid only. Fix: add "
                "long_context.lengths=L1,L2"
            )
        if long.lengths:
            evaluate_long_context(
                args.run_dir,
                long.lengths,
                mesh_config=settings["mesh"],
                examples=long.examples,
            )
            return 0
        tasks = list(lm.tasks) or None
        if tasks:  # every input check before any compute
            lm_eval_run.prepare(
                args.run_dir,
                tasks,
                include_path=lm.include_path,
                include_defaults=lm.default_tasks,
            )
        if not lm.only:
            evaluate_run(args.run_dir, quick=args.quick, settings=settings["eval"])
        if tasks:
            lm_eval_run.evaluate_run_tasks(
                args.run_dir,
                tasks,
                include_path=lm.include_path,
                include_defaults=lm.default_tasks,
                limit=lm.example_limit,
                batch_size=lm.batch_size,
                num_fewshot=lm.num_fewshot,
            )
    except (ConfigError, CheckpointError) as e:
        return _refused(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
