"""``python train.py [--config configs/NAME.py] [--resume] [dotted.key=value ...]``.

Trains the configured DIFF model and (with ``compare=true``, the default) its standard twin
one after the other on the same data, then writes ``report.md`` and ``loss.png`` in the run
directory and prints the table. A run directory that holds checkpoints resumes from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from diffjax import data as data_lib
from diffjax.config import ConfigError

from .checkpoint import CheckpointError, committed_steps
from .config import apply_overrides, config_keys, load_config
from .loop import TrainingDiverged, train_model
from .report import results_table, write_report

EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_CHECKPOINT = 2, 3, 4


def _keys_help() -> str:
    lines = ["config keys (set as key=value; defaults of the built-in default comparison):"]
    for key, type_str, value in config_keys(load_config(None)):
        lines.append(f"  {key:<26} {type_str:<24} default: {value!r}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Differential Transformer and its standard-attention twin on the "
                    "same data, in the same order, from the same seed, and compare them.",
        epilog=_keys_help() + "\n\nexample: python train.py --config configs/needle.py "
                              "train.steps=200 model.num_layers=4")
    parser.add_argument("--config", help="a Python config file with get_config() "
                                         "(default: the built-in default comparison)")
    parser.add_argument("--resume", action="store_true",
                        help="resume the run in run.dir (an error if it holds no checkpoint); "
                             "without it, a run directory with checkpoints resumes anyway")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        exp = apply_overrides(load_config(args.config), args.overrides)
        description = data_lib.check_data(exp.data, exp.model.vocab_size)
    except (ConfigError, data_lib.DataError) as e:
        _error(str(e))
        return EXIT_BAD_INPUT

    run_dir = exp.run.path
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(exp.to_dict(), f, indent=1, default=str)
    print(f"run directory: {run_dir}")
    print(f"data: {description}")
    if args.resume and not any(committed_steps(os.path.join(run_dir, label, "checkpoints"))
                               for label in exp.models):
        _error(f"--resume was given but {run_dir} holds no checkpoint. Fix: drop --resume to "
               f"start a new run, or set run.dir to the run to resume.")
        return EXIT_CHECKPOINT

    results = []
    for label, model_cfg in exp.models.items():
        print(f"\n== {label}: {model_cfg.attention}, {model_cfg.num_layers} layers, "
              f"d_model {model_cfg.d_model}, {model_cfg.num_heads} heads")
        try:
            results.append(train_model(exp, model_cfg, label, os.path.join(run_dir, label)))
        except ConfigError as e:
            _error(str(e))
            return EXIT_BAD_INPUT
        except data_lib.DataError as e:
            _error(str(e))
            return EXIT_BAD_INPUT
        except CheckpointError as e:
            _error(str(e))
            return EXIT_CHECKPOINT
        except TrainingDiverged as e:
            _error(f"[{label}] {e}")
            return EXIT_DIVERGED

    import jax

    if jax.process_index() == 0:
        write_report(run_dir, exp, results, description)
        print("\n" + results_table(results))
        print(f"\nreport: {os.path.join(run_dir, 'report.md')}, plot: "
              f"{os.path.join(run_dir, 'loss.png')}")
    return 0
