"""``python train.py`` (or ``python -m diffjax.compare``) ``[--config configs/NAME.py] [--resume]
[dotted.key=value ...]``.

Trains the configured DIFF model and its twins (``compare.twins``, default its standard twin;
:class:`diffjax.compare.Comparison`) one after the other on the same data, from each init seed
of ``train.seed .. train.seed + compare.seeds - 1`` (``RUN_DIR/<label>/seed_<seed>/``), times
them side by side, then writes ``report.md`` and ``loss.png`` in the run directory and prints the table. A
run directory that holds checkpoints resumes every unfinished model and seed from them.

SIGTERM or SIGINT (Ctrl-C) during training stops it at the next step, saves that step and exits
with status 75 (EX_TEMPFAIL); running the same command again resumes from there.

A config file that declares a study (a sweep's ``SWEEP``, a ``SENSITIVITY`` ladder, a
``RETROFIT``) is for that study's own command, which the refusal names
(:mod:`diffjax.compare.studies`).

Several processes (hosts): start one per host with ``--coordinator_address HOST:PORT
--num_processes N --process_id I``; on a TPU pod slice, under SLURM or Open MPI the flags may be
left out (JAX finds the cluster). See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import jax

from diffjax import data as data_lib
from diffjax import ops
from diffjax.infra import sharding, storage
from diffjax.config import ConfigError
from diffjax.evaluate import evaluate_run
from diffjax.train.checkpoint import (
    CheckpointError,
    committed_steps,
    lingering_save_threads,
    resolve_init_from,
)
from diffjax.train.config import apply_overrides, experiment_keys_help, model_directory
from diffjax.train.loop import AfterStep, train_model
from diffjax.train.preemption import Preempted, TrainingDiverged
from diffjax.train.recorder import TrainResult
from diffjax.train.setup import check_run, describe_mesh, run_runtime

from diffjax.compare.config import Comparison, default_comparison, load_comparison
from diffjax.compare.report import results_table, write_report
from diffjax.compare import studies
from diffjax.compare.runner import Run, run_plan
from diffjax.compare.throughput import side_by_side_throughput

from diffjax.compare.studies import (  # re-exported: every program's exit codes
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINT,
    EXIT_DIVERGED,
    EXIT_PREEMPTED,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a Differential Transformer and its standard-attention twin on the "
        "same data, in the same order, from the same seed, and compare them.",
        epilog=experiment_keys_help(default_comparison())
        + "\n\nexample: python train.py --config configs/needle.py "
        "train.steps=200 model.num_layers=4",
    )
    parser.add_argument(
        "--config",
        help="a Python config file with get_config() (default: the built-in default comparison)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="resume the run in run.dir (an error if it holds no checkpoint); "
        "without it, a run directory with checkpoints resumes anyway",
    )
    dist = parser.add_argument_group(
        "multi-host",
        "one process per host, all with the same config; process 0 writes the "
        "report. Left out on TPU pods / SLURM / Open MPI, where JAX detects the "
        "cluster.",
    )
    dist.add_argument(
        "--coordinator_address",
        metavar="HOST:PORT",
        help="address of process 0 (jax.distributed.initialize)",
    )
    dist.add_argument("--num_processes", type=int, metavar="N", help="number of processes")
    dist.add_argument("--process_id", type=int, metavar="I", help="this process, 0 .. N-1")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


# environment variables that mean "one of several processes of a cluster JAX can detect"
_CLUSTER_ENV = {
    "SLURM_STEP_NUM_TASKS": "SLURM",
    "OMPI_COMM_WORLD_SIZE": "Open MPI",
    "TPU_WORKER_HOSTNAMES": "TPU pod",
    "JAX_COORDINATOR_ADDRESS": "JAX",
}


def _detected_cluster() -> str | None:
    for var, name in _CLUSTER_ENV.items():
        value = os.environ.get(var, "")
        if var == "TPU_WORKER_HOSTNAMES":
            if "," in value:
                return name
        elif var == "JAX_COORDINATOR_ADDRESS":
            if value:
                return name
        elif value.isdigit() and int(value) > 1:
            return name
    return None


def init_distributed(args: argparse.Namespace) -> str | None:
    """Start JAX's multi-controller runtime when launched as several processes; returns how (or
    None for a single process). Must run before anything touches a device."""
    flags = (args.coordinator_address, args.num_processes, args.process_id)
    if any(f is not None for f in flags):
        if any(f is None for f in flags):
            raise ConfigError(
                "--coordinator_address, --num_processes and --process_id go "
                "together. Fix: give all three (the same address and count to "
                "every process, process ids 0 .. N-1), or none."
            )
        n, i = args.num_processes, args.process_id
        if n < 1 or not 0 <= i < n:
            raise ConfigError(
                f"--process_id {i} is not in [0, --num_processes={n}). Fix: number "
                f"the processes 0 .. {max(n, 1) - 1}."
            )
        if ":" not in args.coordinator_address:
            raise ConfigError(
                f"--coordinator_address {args.coordinator_address!r} has no port. "
                f"Fix: give HOST:PORT, e.g. 10.0.0.1:1234."
            )
        if n == 1:
            return None
        jax.distributed.initialize(args.coordinator_address, n, i)
        return f"process {i} of {n} (coordinator {args.coordinator_address})"
    cluster = _detected_cluster()
    if cluster is not None:
        jax.distributed.initialize()
        return f"process {jax.process_index()} of {jax.process_count()} ({cluster} cluster)"
    return None


_error = studies.error


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` (``sys.exit``), except after a checkpoint save that the
    bucket stopped answering: Orbax's threads of that save end only at their own timeouts
    (minutes) and the interpreter would wait for them, so the process ends at once instead,
    its output flushed. The last committed checkpoint is already on storage."""
    if lingering_save_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _checked_run(args: argparse.Namespace):
    """What ``train.py`` checks before any compute: the config with its overrides, the data,
    the run directory's bucket, the processes, the mesh and every cross-field rule, then each
    model's attention decided once for the run (:func:`diffjax.train.setup.run_runtime`:
    refused here, before any model trains, if it cannot run) and its kernels checked on this
    device. ``(exp, data description, how the processes started, mesh, runtimes by label)``;
    a :class:`ConfigError` (or DataError) names what is wrong and the fix."""
    exp = apply_overrides(load_comparison(args.config), args.overrides)
    storage.set_timeout(exp.run.storage_timeout_s)  # every bucket call from here on
    exp = resolve_init_from(exp)
    description = data_lib.check_data(exp.data, exp.model.vocab_size)
    # a bucket that does not exist, no credentials or no permission: refused before compute
    storage.check_access(exp.run.path, what="run.dir", write=True)
    distributed = init_distributed(args)
    mesh = sharding.make_mesh(exp.mesh)  # checks the sizes against the devices
    check_run(exp, mesh, exp.models.values())  # every cross-field rule, in one place
    runtimes = {label: run_runtime(exp, cfg, mesh) for label, cfg in exp.models.items()}
    if exp.train.kernel_check != "off":
        for label, runtime in runtimes.items():
            ops.check_kernels(
                exp.models[label],
                runtime.attention,
                interpret=exp.train.kernel_check == "interpret",
                log=print if jax.process_index() == 0 else None,
            )
    return exp, description, distributed, mesh, runtimes


def main(
    argv: list[str] | None = None,
    *,
    after_step: AfterStep | None = None,
    study: str | None = None,
) -> int:
    """``train.py``'s command line; returns the exit code. ``after_step``: see
    :func:`diffjax.train.loop.train_model` (every model and seed gets it). ``study``: the
    declaration the config file holds when a study runs its comparisons through this (a
    sweep's ``SWEEP``); None: a plain training config."""
    args = build_parser().parse_args(argv)
    try:
        studies.check_command(args.config, study)  # a study's file: refused, its command named
    except ConfigError as e:
        _error(str(e))
        return EXIT_BAD_INPUT
    try:
        exp, description, distributed, mesh, runtimes = _checked_run(args)
    except (ConfigError, data_lib.DataError) as e:
        _error(str(e))
        return EXIT_BAD_INPUT

    main_process = jax.process_index() == 0
    run_dir = exp.run.path  # a local folder or gs://BUCKET/PATH
    storage.makedirs(run_dir)
    if distributed:
        print(f"distributed: {distributed}")
    print(f"run directory: {run_dir}")
    print(f"data: {description}")
    print(f"mesh: {describe_mesh(mesh)}")
    dirs = [model_directory(run_dir, label, seed) for seed in exp.seeds for label in exp.models]
    if args.resume and not any(committed_steps(storage.join(d, "checkpoints")) for d in dirs):
        _error(
            f"--resume was given but {run_dir} holds no checkpoint. Fix: drop --resume to "
            f"start a new run, or set run.dir to the run to resume."
        )
        return EXIT_CHECKPOINT

    if main_process:  # after the checks: a refused run leaves the old config.json as it was
        storage.write_json(storage.join(run_dir, "config.json"), exp.to_dict(), default=str)
    try:
        results = train_seeds(exp, run_dir, mesh, runtimes=runtimes, after_step=after_step)
    except storage.StorageError as e:  # the bucket stopped answering mid-run
        _error(
            f"{e} Training stopped; the last committed checkpoint in {run_dir} is kept. "
            f"Re-running the same command once the bucket answers resumes from it."
        )
        return EXIT_PREEMPTED
    except (ConfigError, data_lib.DataError) as e:  # DataError is a ConfigError
        _error(str(e))
        return EXIT_BAD_INPUT
    except CheckpointError as e:
        _error(str(e))
        return EXIT_CHECKPOINT
    except TrainingDiverged as e:
        _error(str(e))
        return EXIT_DIVERGED
    except Preempted as e:
        print(
            f"{e.describe()}. Re-running the same command resumes from there.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED

    sides = []
    rounds = exp.compare.throughput_rounds
    if exp.compare.twins and rounds:
        print(
            f"\nthroughput side by side: {rounds} rounds, the compiled steps alternated on the "
            f"same batches"
        )
        models = exp.models
        for name in exp.compare.twins:  # DIFF against each twin
            pair = {"diff": models["diff"], name: models[name]}
            sides.append(side_by_side_throughput(exp, pair, mesh, rounds=rounds))
    if main_process:
        write_report(run_dir, exp, results, description, throughput=sides)
        print("\n" + results_table(results))
        for side in sides:
            print(side.describe())
        print(
            f"\nreport: {storage.join(run_dir, 'report.md')}, plot: "
            f"{storage.join(run_dir, 'loss.png')}"
        )
    if exp.compare.quick_eval:  # every process: its checkpoint reads are collective
        quick_evaluation(run_dir, main_process=main_process)
    return 0


def _quiet(_: str) -> None:
    pass


def quick_evaluation(run_dir: str, *, main_process: bool = True) -> None:
    """``python -m diffjax.evaluate RUN_DIR --quick``, its text appended to ``report.md``.

    Every process of a multi-process run calls it (Orbax opens and restores checkpoints
    collectively: process 0 alone would wait there for the others forever, while they wait
    for it at JAX's shutdown barrier); only the main process prints and writes."""
    log = print if main_process else _quiet
    log("\nquick evaluation (python -m diffjax.evaluate --quick; the full set: without --quick)")
    text = evaluate_run(run_dir, quick=True, log=log, write=main_process)
    if not main_process:
        return
    body = text.split("\n", 1)[1] if text.startswith("# ") else text  # its own title dropped
    report = storage.join(run_dir, "report.md")
    storage.write_text(  # rewritten whole: an object in a bucket cannot be appended to
        report,
        storage.read_text(report)
        + "\n## Quick evaluation (`python -m diffjax.evaluate --quick`)\n\n"
        "Also in eval.md, with its plots (eval_*.png).\n" + body,
    )


def train_seeds(
    exp: Comparison, run_dir: str, mesh, *, runtimes=None, after_step: AfterStep | None = None
) -> list[TrainResult]:
    """Train every model of ``exp`` (DIFF and its twins) from every init seed of
    ``exp.seeds``, seed by seed, each in ``RUN_DIR/<label>/seed_<seed>/`` (resuming what a
    checkpoint there holds); every run sees the same batches in the same order. ``runtimes``:
    each model's :class:`Runtime` by label (:func:`diffjax.train.setup.run_runtime`; default
    built from ``mesh``).

    SIGTERM or SIGINT stops it at the next step boundary with :class:`Preempted` (the step
    saved; see :func:`diffjax.train.loop.train_model`), also between two models. A plan on the
    one runner (:func:`diffjax.compare.runner.run_plan`), without done-markers: a finished
    model resumes from its last checkpoint and ends at once, giving its result again."""
    runs = [
        Run(f"{label}/seed_{seed}", model_directory(run_dir, label, seed), (f"train.seed={seed}",))
        for seed in exp.seeds
        for label in exp.models
    ]

    def describe(run: Run) -> str:
        model = exp.models[run.name.split("/")[0]]
        return (
            f"{model.attention}, {model.num_layers} layers, d_model {model.d_model}, "
            f"{model.num_heads} heads"
        )

    def execute(run: Run) -> TrainResult:
        label, seed = run.name.split("/")[0], int(run.name.rsplit("_", 1)[1])
        try:
            return train_model(
                exp.with_seed(seed),
                exp.models[label],
                label,
                run.directory,
                mesh=mesh,
                runtime=None if runtimes is None else runtimes[label],
                after_step=after_step,
            )
        except TrainingDiverged as e:
            e.args = (f"[{label}, seed {seed}] {e}",)
            raise

    return run_plan(runs, execute, run_dir=run_dir, done_file=None, describe=describe)
