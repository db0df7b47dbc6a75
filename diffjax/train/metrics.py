"""Metrics: one JSON object per training step in ``metrics.jsonl``, TensorBoard event files.

Every line has ``step`` and ``loss`` (that step's training loss); evaluation steps add
``val_loss`` (and task metrics such as ``val_answer_accuracy``). On resume the lines after the
restored step are dropped, so a resumed run's file equals an uninterrupted run's.

In a bucket (a ``gs://`` run directory), where objects cannot be appended to, both are written
to a local folder and uploaded whole (:class:`diffjax.storage.SyncedDir`) every ``sync_every_s``
seconds, at each checkpoint (:meth:`MetricsWriter.flush`) and at the end: a reader sees the
files as of the last upload, never a torn one, and a process killed with SIGKILL loses at most
the records since then, which the resumed run (from the last checkpoint, whose records were
uploaded with it) writes again. TensorBoard reads the event files from the bucket
(``tensorboard --logdir gs://...``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from diffjax import storage


def _plain(value: Any):
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_metrics(path: storage.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, local or ``gs://`` (a torn last line, from a kill
    mid-write, is skipped)."""
    if not storage.exists(path):
        return []
    records = []
    for line in storage.read_text(path).splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


class MetricsWriter:
    """Appends step records to ``<dir>/metrics.jsonl`` and scalars to TensorBoard (``<dir>/tb``);
    ``<dir>`` local or ``gs://`` (see the module's doc: uploaded every ``sync_every_s``
    seconds and at each :meth:`flush`)."""

    def __init__(
        self,
        directory: storage.PathLike,
        *,
        resume_step: int = 0,
        tensorboard: bool = True,
        log_every: int = 1,
        sync_every_s: float = 30.0,
    ):
        self._dir = storage.SyncedDir(directory, every_s=sync_every_s)
        self._dir.pull("metrics.jsonl")  # a resume on a machine with nothing of the run
        path = self._dir.local_path("metrics.jsonl")
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
        storage.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a")
        self.log_every = log_every
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(
                self._dir.local_path("tb"),
                purge_step=resume_step + 1,
                filename_suffix=f".{os.getpid()}",  # a resume's file never replaces another's
            )

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = record["step"]
            is_eval = any(k.startswith("val_") for k in record)
            if step % self.log_every == 0 or is_eval:
                for k, v in record.items():
                    if k == "step":
                        continue
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._tb.add_scalar(k, v, step)
                    elif isinstance(v, list) and k == "lambda":
                        for i, x in enumerate(v):
                            self._tb.add_scalar(f"lambda/layer_{i}", x, step)
        if self._dir.is_remote:
            self._upload(force=False)

    def _upload(self, force: bool) -> None:
        if not (force or self._dir.due()):
            return
        if self._tb is not None:
            self._tb.flush()
        self._dir.sync()

    def flush(self) -> None:
        """Everything written so far reaches the run directory (a bucket: uploaded now)."""
        if self._dir.is_remote:
            self._upload(force=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        self._dir.close()


class MetricsCollector:
    """The metrics sink of processes other than 0 (process 0 writes the files): keeps the
    records in ``records``."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class StepProfiler:
    """A ``jax.profiler`` trace of the steps ``window = (start, end)`` of one run, written to
    ``<directory>/profile`` (a bucket: traced to a local folder, uploaded when the window
    closes). A resumed run traces what is left of the window. Open it with TensorBoard's
    profile plugin (``tensorboard --logdir <directory>/profile``), XProf, or Perfetto (the
    ``.trace.json.gz`` it writes beside the ``.xplane.pb``)."""

    def __init__(self, window: tuple[int, int] | None, directory: storage.PathLike):
        self.window, self.directory = window, directory
        self._dir: storage.SyncedDir | None = None

    def before(self, step: int) -> None:
        """Called before step ``step``: starts the trace at the window's first step."""
        if self.window is None or self._dir is not None:
            return
        start, end = self.window
        if start <= step <= end:
            import jax

            self._dir = storage.SyncedDir(storage.join(self.directory, "profile"))
            jax.profiler.start_trace(self._dir.local, create_perfetto_trace=True)

    def after(self, step: int, outputs) -> None:
        """Called after step ``step`` with its outputs: at the window's last step, waits for
        them (the trace holds the whole step) and writes the trace."""
        if self._dir is not None and step >= self.window[1]:
            import jax

            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self._dir is None:
            return
        import jax

        jax.profiler.stop_trace()
        self._dir.close()
        self._dir = None
