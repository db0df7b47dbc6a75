"""``python -m diffjax.retrofit_study --config FILE [study.<field>=value ...] [key=value ...]``:
the retrofit study a config file declares (a module-level ``RETROFIT``,
:class:`diffjax.compare.RetrofitStudy`): a standard source per seed, continued unconverted and
converted to DIFF, every model probed, then ``RUN_DIR/retrofit.md``
(:mod:`diffjax.compare.retrofit_study`). One process; resumable (finished runs are skipped,
SIGTERM/SIGINT stops and saves, exit 75)."""

from __future__ import annotations

import argparse
import sys

from diffjax import data as data_lib
from diffjax.compare import studies
from diffjax.compare.retrofit_study import SCALAR_FIELDS, RetrofitStudy, run_study, summary
from diffjax.config import ConfigError
from diffjax.train.checkpoint import CheckpointError
from diffjax.train.loop import AfterStep
from diffjax.train.preemption import Preempted, TrainingDiverged


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diffjax.retrofit_study",
        description="Train a standard source per seed, continue it unconverted and converted to "
        "DIFF (the config file's RETROFIT), probe every model, then write RUN_DIR/retrofit.md. "
        "Overrides as train.py's (python train.py --help lists the keys), and "
        f"study.<field>=value for {', '.join(SCALAR_FIELDS)}. One process.",
    )
    parser.add_argument(
        "--config", required=True, help="a config file with get_config() and RETROFIT"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def main(argv: list[str] | None = None, *, after_step: AfterStep | None = None) -> int:
    """The retrofit study's command line; returns the exit code. ``after_step``: passed to
    every run's training (the resume test stops a run from it)."""
    args = build_parser().parse_args(argv)
    try:
        study = RetrofitStudy.of(studies.check_command(args.config, "RETROFIT"))
        text = run_study(args.config, study, args.overrides, after_step=after_step)
    except (ConfigError, data_lib.DataError) as e:
        studies.error(str(e))
        return studies.EXIT_BAD_INPUT
    except CheckpointError as e:
        studies.error(str(e))
        return studies.EXIT_CHECKPOINT
    except TrainingDiverged as e:
        studies.error(str(e))
        return studies.EXIT_DIVERGED
    except Preempted as e:
        print(
            f"{e.describe()}. Re-running the same command resumes from there (finished runs "
            f"are skipped).",
            file=sys.stderr,
            flush=True,
        )
        return studies.EXIT_PREEMPTED
    print("\n" + summary(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
