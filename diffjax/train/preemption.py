"""Stopping and surviving: SIGTERM/SIGINT turned into a save at the next step boundary on every
process (:class:`PreemptionGuard`, :class:`Preempted`), and the divergence a rollback answers
(:class:`TrainingDiverged`)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""

    def __init__(self, step: int, loss: float, last_checkpoint: int | None, directory: str):
        self.step, self.loss, self.last_checkpoint = step, loss, last_checkpoint
        kept = (
            f"the last good checkpoint (step {last_checkpoint}) is kept in {directory}"
            if last_checkpoint is not None
            else "no checkpoint had been written yet"
        )
        super().__init__(
            f"the training loss is {loss} at step {step}; stopped, and {kept}. Fix: "
            f"lower train.lr, raise train.warmup_steps or set train.grad_clip, then "
            f"rerun (it resumes from the last good checkpoint)."
        )


class Preempted(Exception):
    """Training stopped on SIGTERM or SIGINT (every process at the same step) after saving a
    checkpoint of ``step`` in ``directory`` and waiting for its commit; re-running the same
    command resumes from it. ``step`` is None when the signal came between two models' training
    (nothing new to save). ``label``/``seed``: the model being trained, where known."""

    def __init__(
        self,
        step: int | None,
        directory: str,
        signal_name: str = "a signal",
        label: str | None = None,
        seed: int | None = None,
    ):
        self.step, self.directory, self.signal_name = step, directory, signal_name
        self.label, self.seed = label, seed
        super().__init__(self.describe())

    def describe(self) -> str:
        model = (
            ""
            if self.label is None
            else f" of {self.label}" + ("" if self.seed is None else f" (seed {self.seed})")
        )
        if self.step is None:
            return (
                f"stopped by {self.signal_name} between training runs{model}; every checkpoint "
                f"saved so far is kept ({self.directory})"
            )
        return (
            f"stopped by {self.signal_name} at step {self.step}{model}; saved a checkpoint of "
            f"that step in {self.directory}"
        )


class KeepPosition:
    """A data iterator stand-in for a rollback's restore: the live iterator keeps its place."""

    def set_state(self, state) -> None:
        del state


def _preemption_sync_manager():
    """JAX's preemption sync manager (``jax.distributed.initialize`` starts it; it catches
    SIGTERM), or None."""
    from jax._src import distributed

    return getattr(distributed.global_state, "preemption_sync_manager", None)


class PreemptionGuard:
    """Turns SIGTERM and SIGINT into a stop at the next step boundary, the same step on every
    process (:meth:`stop_at`), while it is entered (re-entrant: the command line holds it over
    every model and seed, :func:`train_model` over its own loop); the previous handlers are
    back on exit.

    One process: a Python handler for both signals sets a flag. Several processes: JAX's
    preemption service (started by ``jax.distributed.initialize``) catches SIGTERM and agrees
    on a step (``multihost_utils.reached_preemption_sync_point``); SIGINT is passed to it as a
    SIGTERM to this process. A second SIGINT raises ``KeyboardInterrupt`` at once."""

    def __init__(self):
        self.depth = 0
        self.received: str | None = None
        self.synced = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        self.depth += 1
        if self.depth == 1:
            self.received = None
            self._install()
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for sig, handler in self._previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            self._previous = {}

    def _install(self) -> None:
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python handlers can only be set from the main thread
        self.synced = jax.process_count() > 1 and _preemption_sync_manager() is not None
        if jax.process_count() > 1 and not self.synced:
            return  # the preemption service is off: the processes could not agree on a step
        sigs = (signal.SIGINT,) if self.synced else (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        first = self.received is None
        self.received = signal.Signals(signum).name
        if self.synced and first:
            os.kill(os.getpid(), signal.SIGTERM)  # to the preemption service

    @property
    def signal_name(self) -> str:
        return self.received or "SIGTERM"

    def requested(self) -> bool:
        """A stop was asked of this process (not agreed among processes: :meth:`stop_at`)."""
        return self.received is not None

    def stop_at(self, step: int) -> bool:
        """Whether to stop after ``step``; every process calls it at every step and gets the
        same answer."""
        if self.synced:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None


_GUARD = PreemptionGuard()


def preemption_guard() -> PreemptionGuard:
    """The process's :class:`PreemptionGuard` (``with preemption_guard(): ...``)."""
    return _GUARD
