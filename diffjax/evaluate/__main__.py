"""``python -m diffjax.evaluate RUN_DIR [--quick]``: the paper's analyses on a train.py run."""

from __future__ import annotations

import argparse
import sys

from diffjax.config import ConfigError
from diffjax.train.checkpoint import CheckpointError

from .run import evaluate_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffjax.evaluate",
        description="Run the paper's analyses (multi-needle retrieval, attention allocation, "
        "activation outliers, logit quantization, the noise floor, loss by "
        "position) on every model of a train.py run directory; writes "
        "RUN_DIR/eval.md, eval.json and eval_*.png.",
    )
    parser.add_argument("run_dir", help="a directory written by train.py (e.g. runs/needle)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small subset: one context length, few examples (under a "
        "minute of CPU time for the default comparison)",
    )
    args = parser.parse_args(argv)
    try:
        evaluate_run(args.run_dir, quick=args.quick)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
