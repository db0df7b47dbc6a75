"""Metrics: one JSON object per training step in ``metrics.jsonl``, TensorBoard event files.

Every line has ``step`` and ``loss`` (that step's training loss); evaluation steps add
``val_loss`` (and task metrics such as ``val_answer_accuracy``). On resume the lines after the
restored step are dropped, so a resumed run's file equals an uninterrupted run's.

In a bucket (a ``gs://`` run directory), where objects cannot be appended to, both are written
to a local folder and uploaded whole (:class:`diffjax.infra.storage.SyncedDir`) every ``sync_every_s``
seconds, at each checkpoint (:meth:`MetricsWriter.flush`) and at the end: a reader sees the
files as of the last upload, never a torn one, and a process killed with SIGKILL loses at most
the records since then, which the resumed run (from the last checkpoint, whose records were
uploaded with it) writes again. TensorBoard reads the event files from the bucket
(``tensorboard --logdir gs://...``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import tempfile
from typing import Any

import numpy as np

from diffjax.infra import storage
from diffjax.config import ConfigError


def _plain(value: Any):
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


NON_FINITE = ("nan", "inf", "-inf")  # how _plain writes them (JSON has no NaN)


def _number(value: Any):
    """``_plain``'s inverse for the non-finite floats it wrote as text."""
    if isinstance(value, str) and value in NON_FINITE:
        return float(value)
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value


def read_metrics(path: storage.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, local or ``gs://`` (a torn last line, from a kill
    mid-write, is skipped), non-finite values back as floats."""
    try:  # one request for an object in a bucket (no existence check before it)
        text = storage.read_text(path)
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        records.append({k: _number(v) for k, v in record.items()})
    return records


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a step record that TensorBoard and W&B get: every number but ``step``,
    and each per-layer value as ``NAME/layer_I`` (each layer's lambda, the diagnostics), one
    per softmax map as ``NAME/layer_I/map_J`` (the attention logits' maximum)."""
    out = {}
    for k, v in record.items():
        if k == "step":
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, list):
                    out.update({f"{k}/layer_{i}/map_{j}": y for j, y in enumerate(x)})
                elif isinstance(x, (int, float)):
                    out[f"{k}/layer_{i}"] = x
    return out


def check_wandb(mode: str) -> None:
    """Before any compute: ``run.wandb`` other than ``off`` needs the ``wandb`` package, and
    ``online`` a login (``WANDB_API_KEY`` or ``wandb login``'s netrc entry); else a
    ConfigError naming the fix."""
    if mode == "off":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"run.wandb: {mode!r} needs the wandb package, which is not installed. Fix: pip "
            f"install -e '.[wandb]' (or run.wandb=off)"
        )
    if mode == "online" and not _wandb_logged_in():
        raise ConfigError(
            "run.wandb: 'online' needs a W&B login, and there is none (no WANDB_API_KEY, no "
            "netrc entry for api.wandb.ai). Fix: wandb login (or export WANDB_API_KEY=...), "
            "or run.wandb=offline to write the run locally and `wandb sync` it later"
        )


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
    try:
        return netrc.netrc().authenticators(host.split("/")[0]) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbRun:
    """One W&B run: a model and seed of an experiment (``directory`` its folder), named
    ``STEM-LABEL-seed_S`` and grouped by ``STEM`` (``run.wandb_name``, else ``run.name``), with
    the whole experiment config logged once. Its files go under ``directory/wandb`` (a bucket:
    a local folder, named in the log). A resumed run continues the same W&B run (its id comes
    from the folder)."""

    def __init__(self, run_cfg, config: dict[str, Any], directory: storage.PathLike, log=print):
        import wandb

        label, seed = str(directory).rstrip("/").split("/")[-2:]
        stem = run_cfg.wandb_name or run_cfg.name
        local = str(directory)
        if storage.is_remote(directory):
            local = tempfile.mkdtemp(prefix="diffjax-wandb-")
            log(f"W&B ({run_cfg.wandb}): its files are in {local} (the run directory is a bucket)")
        os.makedirs(local, exist_ok=True)
        ident = hashlib.sha1(str(storage.absolute(directory)).encode()).hexdigest()[:16]
        self._run = wandb.init(
            mode=run_cfg.wandb,
            project=run_cfg.wandb_project,
            entity=run_cfg.wandb_entity,
            name=f"{stem}-{label}-{seed}",
            group=stem,
            tags=list(run_cfg.wandb_tags),
            config=config,
            dir=local,
            id=ident,
            resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsWriter:
    """Appends step records to ``<dir>/metrics.jsonl`` and scalars to TensorBoard (``<dir>/tb``)
    and, given a ``tracker`` (:class:`WandbRun`), to W&B; ``<dir>`` local or ``gs://`` (see the
    module's doc: uploaded every ``sync_every_s`` seconds and at each :meth:`flush`)."""

    def __init__(
        self,
        directory: storage.PathLike,
        *,
        resume_step: int = 0,
        tensorboard: bool = True,
        log_every: int = 1,
        sync_every_s: float = 30.0,
        tracker: "WandbRun | None" = None,
    ):
        self._tracker = tracker
        self._dir = storage.SyncedDir(directory, every_s=sync_every_s)
        self._dir.pull("metrics.jsonl")  # a resume on a machine with nothing of the run
        path = self._dir.local_path("metrics.jsonl")
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
        storage.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a")
        self.log_every = log_every
        self._tb = self._open_tb(resume_step) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        step = record["step"]
        is_eval = any(k.startswith("val_") for k in record)
        if (self._tb is not None or self._tracker is not None) and (
            step % self.log_every == 0 or is_eval
        ):
            values = scalars(record)
            for k, v in values.items():
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
            if self._tracker is not None:
                self._tracker.log(values, step)
        if self._dir.is_remote:
            self._upload(force=False)

    def rewind(self, step: int) -> None:
        """Drop the records after ``step`` (a rollback): from ``metrics.jsonl``, and from
        TensorBoard's view (a new events file that purges the later steps). W&B keeps what it
        was sent: its steps only grow, so the retried steps reach it again only past the last
        one logged."""
        self._file.close()
        path = self._dir.local_path("metrics.jsonl")
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        storage.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a")
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tb(step)

    def _open_tb(self, step: int):
        from tensorboardX import SummaryWriter

        return SummaryWriter(
            self._dir.local_path("tb"),
            purge_step=step + 1,
            filename_suffix=f".{os.getpid()}.{step}",  # a resume's file never replaces another's
        )

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
        if self._tracker is not None:
            self._tracker.close()
        self._dir.close()


class MetricsCollector:
    """The metrics sink of processes other than 0 (process 0 writes the files): keeps the
    records in ``records``."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def rewind(self, step: int) -> None:
        self.records = [r for r in self.records if r.get("step", 0) <= step]

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
