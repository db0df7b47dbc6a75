"""Metrics: one JSON object per training step in ``metrics.jsonl``, TensorBoard event files.

Every line has ``step`` and ``loss`` (that step's training loss); evaluation steps add
``val_loss`` (and task metrics such as ``val_answer_accuracy``). On resume the lines after the
restored step are dropped, so a resumed run's file equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def _plain(value: Any):
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line, from a kill mid-write, is skipped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


class MetricsWriter:
    """Appends step records to ``<dir>/metrics.jsonl`` and scalars to TensorBoard (``<dir>/tb``)."""

    def __init__(
        self, directory: str, *, resume_step: int = 0, tensorboard: bool = True, log_every: int = 1
    ):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        self.log_every = log_every
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(directory, "tb"), purge_step=resume_step + 1)

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

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class MetricsCollector:
    """The metrics sink of processes other than 0 (process 0 writes the files): keeps the
    records in ``records``."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass
