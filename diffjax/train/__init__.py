"""Training: the experiment config, the optimizer, the loop of one model (:func:`train_model`,
its :class:`TrainResult`), Orbax checkpoints and metrics files.

By concern: :mod:`.step` (the loss, accumulation, the jitted train and eval steps),
:mod:`.setup` (the run's checks, the model, optimizer, compiled steps and initial state),
:mod:`.recorder` (each step's record: metrics.jsonl, TensorBoard, W&B; the summary),
:mod:`.preemption` (SIGTERM/SIGINT to a saved stop; divergence), :mod:`.hooks` (what runs
after a step, every N steps), :mod:`.loop` (one model's training, from these),
:mod:`.checkpoint`, :mod:`.metrics`, :mod:`.optimizer`, :mod:`.config`.

A model and seed of a run lives in ``<run dir>/<label>/seed_<seed>/`` (:func:`model_directory`):
``metrics.jsonl``, ``tb/``, ``checkpoints/`` and ``result.json``.
"""

from diffjax.train.checkpoint import Checkpointer, CheckpointError, export_model, load_model
from diffjax.train.config import (
    ExperimentConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    config_keys,
    default_config,
    load_config,
    model_directory,
)
from diffjax.train.preemption import Preempted, TrainingDiverged, preemption_guard
from diffjax.train.recorder import TrainResult
from diffjax.train.loop import train_model
from diffjax.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ExperimentConfig",
    "Preempted",
    "RunConfig",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "apply_overrides",
    "config_keys",
    "decay_mask",
    "default_config",
    "learning_rate_schedule",
    "load_config",
    "export_model",
    "load_model",
    "make_optimizer",
    "model_directory",
    "preemption_guard",
    "train_model",
]
