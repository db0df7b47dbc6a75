"""What a run records: each step's metrics record (loss, throughput, MFU, diagnostics), the
recorder that writes metrics.jsonl, TensorBoard and W&B and stops on divergence, the progress
bar, and the run's summary (:class:`TrainResult`)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

from diffjax.infra import flops as flops_lib
from diffjax.config import ModelConfig

from diffjax.train.config import ExperimentConfig
from diffjax.train.metrics import (
    MetricsCollector,
    MetricsWriter,
    WandbRun,
)
from diffjax.train.preemption import TrainingDiverged
from diffjax.train.step import DIAGNOSTICS


@dataclasses.dataclass
class TrainResult:
    label: str
    attention: str
    directory: str
    params: int
    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float | None
    tokens_per_s: float
    step_time_s: float
    peak_memory_bytes: int | None  # XLA's estimate for the compiled train step (per device)
    memory_source: str
    device_peak_bytes: int | None = None  # the device's peak so far in this process (cumulative)
    lambdas: list[float] | None = None
    resumed_from: int | None = None
    mesh: str | None = None  # e.g. "data=1 fsdp=4 tensor=2 (8 devices, 2 processes)"
    seed: int = 0  # the init seed (train.seed)
    # the final evaluation's metrics beyond loss and perplexity, those the data declares
    # (diffjax.data.validation_metrics), by their metrics.jsonl key: {"val_<name>": value}
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # the median over the timed steps of the model TFLOP/s per device (diffjax.infra.flops), and of
    # the MFU (that / the device's peak; None when the peak is unknown, e.g. on CPU)
    tflops_per_device: float | None = None
    mfu: float | None = None
    spikes_skipped: int | None = None  # train.skip_spikes: the updates skipped (None: off)
    rollbacks: int = 0  # train.on_nan=rollback: the rollbacks in this process's last leg
    # what computed the attention in training ("xla", "pallas", "cudnn", "splash") and why
    # (set explicitly, or auto's measurement: diffjax.ops.Resolved.describe)
    attention_impl: str | None = None
    attention_impl_why: str | None = None
    gate: str = "none"  # gated attention's output gate (model.gate)
    # a mixture (data.source=mixture): what the run read of each component and the weights
    # over the run (diffjax.data.MixturePlan.summary); None for one corpus
    mixture: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainResult:
        """The result a ``result.json`` holds. One written before :attr:`metrics` existed (the
        validation metrics were fields of their own: ``val_accuracy`` for
        ``val_answer_accuracy``, the others under their metrics.jsonl key) loads with them moved
        into :attr:`metrics`."""
        known = {f.name for f in dataclasses.fields(cls)}
        metrics = dict(d.get("metrics") or {})
        for key, value in d.items():
            if key.startswith("val_") and key not in known and value is not None:
                metrics.setdefault("val_answer_accuracy" if key == "val_accuracy" else key, value)
        return cls(**{k: v for k, v in d.items() if k in known and k != "metrics"}, metrics=metrics)


def metrics_sink(
    exp: ExperimentConfig, directory: str, start: int
) -> MetricsWriter | MetricsCollector:
    """Where the step records go: process 0 writes ``metrics.jsonl`` and TensorBoard's files
    in ``directory`` (from ``start``, the resumed step); the other processes keep them."""
    if jax.process_index() != 0:
        return MetricsCollector()
    tracker = None
    if exp.run.wandb != "off":
        tracker = WandbRun(exp.run, exp.to_dict(), directory)
    return MetricsWriter(
        directory,
        resume_step=start,
        tensorboard=exp.train.tensorboard,
        log_every=exp.train.log_every,
        sync_every_s=exp.run.sync_every_s,
        tracker=tracker,
    )


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step time into model TFLOP/s per device and MFU: the model FLOPs of a step
    (:func:`diffjax.infra.flops.train_flops_per_token` x tokens), the devices, and the device's peak
    TFLOP/s (None: no MFU)."""

    flops_per_step: float
    devices: int
    peak_tflops: float | None = None

    @classmethod
    def of(cls, model_cfg: ModelConfig, tcfg, seq_len: int, mesh) -> Throughput:
        tokens = tcfg.batch_size * seq_len
        kind = mesh.devices.flat[0].device_kind
        return cls(
            flops_lib.train_flops_per_token(model_cfg, seq_len) * tokens,
            mesh.devices.size,
            flops_lib.peak_tflops(kind, tcfg.peak_tflops),
        )

    def add_to(self, record: dict[str, Any], step_time: float) -> None:
        if not step_time > 0:
            return
        tflops = self.flops_per_step / step_time / self.devices / 1e12
        record["tflops_per_device"] = tflops
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops


def step_record(
    step: int,
    host: dict[str, np.ndarray],
    step_time: float,
    tokens_per_step: int,
    timed: bool,
    throughput: Throughput | None = None,
    data_wait: float | None = None,
) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of one step from its metrics on the host (with
    ``throughput``: its model TFLOP/s per device and MFU; ``data_wait``: the seconds the loop
    waited for input within ``step_time``)."""
    loss = float(host["loss"])
    record = {
        "step": step,
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss,
        "lr": float(host["lr"]),
        "grad_norm": float(host["grad_norm"]),
        "tokens": step * tokens_per_step,
        "step_time": step_time,
        "tokens_per_s": tokens_per_step / step_time if step_time > 0 else None,
        "timed": timed,
    }
    if data_wait is not None:
        record["data_wait"] = data_wait
    if host["lambda"].size:
        record["lambda"] = [float(x) for x in host["lambda"]]
    if "ramp" in host:  # a retrofit: the negative map's weight w this step ran with
        record["ramp"] = float(host["ramp"])
    if "skipped" in host:  # train.skip_spikes
        record["skipped"] = bool(host["skipped"])
        record["spikes_skipped"] = int(host["spikes_skipped"])
    for name in DIAGNOSTICS:  # train.diagnostics
        if name in host:
            record[name] = np.asarray(host[name], np.float64).tolist()
    if throughput is not None:
        throughput.add_to(record, step_time)
    return record


def _speed(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's throughput: tokens/s and the MFU (or model TFLOP/s per device)."""
    out = {"tok_s": f"{record['tokens_per_s']:.0f}"} if record.get("tokens_per_s") else {}
    if record.get("mfu") is not None:
        out["mfu"] = f"{record['mfu']:.1%}"
    elif record.get("tflops_per_device") is not None:
        out["tflops"] = f"{record['tflops_per_device']:.3g}"
    return out


class Recorder:
    """Reads each step's metrics back one step late (the host waits for step ``n`` while step
    ``n + 1`` runs), times the steps, writes the records and draws the progress bar. A
    non-finite loss is written, then raises :class:`TrainingDiverged` naming ``last_good``."""

    def __init__(
        self,
        writer,
        tokens_per_step: int,
        bar,
        last_good: int | None,
        ckpt_dir: str,
        throughput: Throughput | None = None,
    ):
        self.writer, self.tokens_per_step, self.bar = writer, tokens_per_step, bar
        self.last_good, self.ckpt_dir, self.throughput = last_good, ckpt_dir, throughput
        self.queued: tuple[int, Any, bool] | None = None
        self.rollbacks = 0  # train.on_nan=rollback: how many so far
        self.restart_clock()

    def restart_clock(self) -> None:
        """The time until now (evaluation, checkpointing) is not step time."""
        self.clock, self.waited = time.perf_counter(), 0.0

    def push(self, step: int, metrics: Any, timed: bool, data_wait: float | None = None) -> None:
        """Queue this step's metrics; write the previous step's record. ``data_wait``, the wait
        for this step's batch, falls inside the time of the step read next (the previous one:
        reading lags a step), so each record's wait is the waiting within its own step time."""
        self.waited += data_wait or 0.0
        previous, self.queued = self.queued, (step, metrics, timed)
        if previous is not None:
            self.writer.write(self._read(*previous))

    def pop(self) -> dict[str, Any]:
        """The queued step's record, not written yet (an evaluation adds to it)."""
        queued, self.queued = self.queued, None
        return self._read(*queued)

    def rewind(self, step: int, rollbacks: int) -> None:
        """After a rollback to ``step``: the queued step and every record after ``step`` are
        dropped, and the records from here on carry the number of ``rollbacks``."""
        self.queued, self.rollbacks = None, rollbacks
        self.writer.rewind(step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()
        self.restart_clock()

    def write_evaluated(self, record: dict[str, Any]) -> None:
        self.writer.write(record)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", val=f"{record['val_loss']:.3f}", **_speed(record)
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()

    def _read(self, step: int, metrics: Any, timed: bool) -> dict[str, Any]:
        host = jax.device_get(metrics)
        now = time.perf_counter()
        record = step_record(
            step, host, now - self.clock, self.tokens_per_step, timed, self.throughput, self.waited
        )
        self.clock, self.waited = now, 0.0
        if self.rollbacks:
            record["rollbacks"] = self.rollbacks
        if not (math.isfinite(record["loss"]) or record.get("skipped")):
            self.writer.write(record)
            raise TrainingDiverged(step, record["loss"], self.last_good, self.ckpt_dir)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", **_speed(record))
        return record


def progress_bar(total: int, start: int, label: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc=label, unit="step", dynamic_ncols=True)


def memory_estimate(compiled) -> int | None:
    """XLA's estimate of the compiled step's memory: arguments + outputs + temporaries - aliased."""
    try:
        m = compiled.memory_analysis()
        return int(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def device_peak_memory() -> int | None:
    """The device allocator's peak in this process (GPU/TPU; None on CPU). It only grows, so it
    covers everything the process ran before, the other model of a comparison included."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def summarize(
    label: str,
    model_cfg: ModelConfig,
    directory: str,
    records: list[dict],
    n_params: int,
    memory: int | None,
    resumed_from: int | None,
) -> TrainResult:
    """A :class:`TrainResult` from the run's metrics records."""
    timed = [r for r in records if r.get("timed") and r.get("step_time")]
    step_time = float(np.median([r["step_time"] for r in timed])) if timed else float("nan")
    last = records[-1] if records else {}
    trained = [r for r in records if not r.get("skipped")]  # a skipped step's loss may be NaN
    tail = [r["loss"] for r in trained[-max(1, len(trained) // 20) :]]
    evals = [r for r in records if "val_loss" in r]
    device_peak = device_peak_memory()
    tokens_per_step = last.get("tokens", 0) / max(last.get("step", 1), 1)
    return TrainResult(
        label=label,
        attention=model_cfg.attention,
        gate=model_cfg.gate,
        directory=directory,
        params=n_params,
        steps=int(last.get("step", 0)),
        tokens_seen=int(last.get("tokens", 0)),
        final_train_loss=float(np.mean(tail)) if tail else float("nan"),
        final_val_loss=evals[-1]["val_loss"] if evals else None,
        tokens_per_s=tokens_per_step / step_time if timed else float("nan"),
        step_time_s=step_time,
        peak_memory_bytes=memory,
        memory_source="XLA's estimate for the compiled train step (arguments + outputs + "
        "temporaries - donated), per device; the same measure on every backend, "
        "and not affected by the other model trained in the same process",
        device_peak_bytes=device_peak,
        lambdas=last.get("lambda"),
        tflops_per_device=_median(timed, "tflops_per_device"),
        mfu=_median(timed, "mfu"),
        metrics={
            k: v
            for k, v in (evals[-1] if evals else {}).items()
            if k.startswith("val_") and k not in ("val_loss", "val_ppl")
        },
        resumed_from=resumed_from,
        spikes_skipped=last.get("spikes_skipped"),
        rollbacks=int(last.get("rollbacks", 0)),
    )


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.median(values)) if values else None
