"""Training: configs, optimizer, the loop, Orbax checkpoints, metrics and the comparison report.

``python train.py`` (:func:`diffjax.train.cli.main`) trains a DIFF model and its standard twin
on the same data in the same order from each init seed (``train.num_seeds``) and writes
``runs/<name>/``: ``config.json``, ``report.md``, ``loss.png`` and ``<label>/seed_<seed>/``
(:func:`model_directory`) per model and seed.
"""

from .checkpoint import Checkpointer, CheckpointError, load_model
from .config import (
    ExperimentConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    config_keys,
    default_config,
    load_config,
    model_directory,
)
from .loop import TrainingDiverged, TrainResult, train_model
from .optimizer import decay_mask, learning_rate_schedule, make_optimizer

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "ExperimentConfig",
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
    "load_model",
    "make_optimizer",
    "model_directory",
    "train_model",
]
