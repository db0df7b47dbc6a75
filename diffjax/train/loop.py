"""The training loop of one model: jitted step with donated state, evaluation, metrics,
checkpoints, exact resume, divergence stop.

The state is a plain pytree ``{"step", "params", "opt_state"}`` (the model's ``nnx.Param``
state and Optax's state), so one jitted function updates it and Orbax saves it. It lives on a
``("data", "fsdp", "tensor")`` mesh (``exp.mesh``; one device is the 1x1x1 mesh): every
parameter and both Adam moments are placed by their logical axis names
(:mod:`diffjax.sharding`), batches are global arrays assembled from each process's rows, and
the step is compiled once with those shardings. Every step's loss reaches ``metrics.jsonl``
(written by process 0); the host reads step ``n``'s metrics while step ``n + 1`` runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diffjax import data as data_lib
from diffjax import sharding
from diffjax.compile_options import cpu_compile_options
from diffjax.config import ConfigError, ModelConfig
from diffjax.model import TransformerLM
from diffjax.params import count_params

from .checkpoint import Checkpointer, CheckpointError, abstract_like, check_same_model
from .config import ExperimentConfig
from .metrics import MetricsWriter, read_metrics
from .optimizer import learning_rate_schedule, make_optimizer

# optax >= 0.2.5 has optax.tree.norm; older versions optax.global_norm
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

# Fault injection for the kill-and-resume tests: SIGKILL this process right after step N. At a
# checkpoint step the kill lands while that step's asynchronous save may still be in flight;
# at any other step it lands after the earlier saves have committed. Unset in normal use.
_FAULT_KILL_AT_STEP = int(os.environ.get("DIFFJAX_FAULT_KILL_AT_STEP", "0") or 0)

MODEL_INPUTS = ("inputs", "targets", "weights", "segment_ids", "positions")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""

    def __init__(self, step: int, loss: float, last_checkpoint: int | None, directory: str):
        self.step, self.loss, self.last_checkpoint = step, loss, last_checkpoint
        kept = (f"the last good checkpoint (step {last_checkpoint}) is kept in {directory}"
                if last_checkpoint is not None else "no checkpoint had been written yet")
        super().__init__(f"the training loss is {loss} at step {step}; stopped, and {kept}. Fix: "
                         f"lower train.lr, raise train.warmup_steps or set train.grad_clip, then "
                         f"rerun (it resumes from the last good checkpoint).")


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
    val_accuracy: float | None = None
    resumed_from: int | None = None
    mesh: str | None = None  # e.g. "data=1 fsdp=4 tensor=2 (8 devices, 2 processes)"
    seed: int = 0  # the init seed (train.seed)
    val_query_accuracy: float | None = None  # the share of queries answered exactly

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- pure functions
def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """Sum of per-token cross-entropy times weight, and the sum of weights."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * weights), jnp.sum(weights)


def _model_kwargs(batch):
    return {k: batch[k] for k in ("segment_ids", "positions") if k in batch}


def make_train_step(graphdef, rest, tx: optax.GradientTransformation, schedule) -> Callable:
    """``step(state, batch) -> (state, metrics)``; jit it with ``donate_argnums=0``."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        model.record_lambdas()
        logits = model(batch["inputs"], **_model_kwargs(batch))
        total, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
        lambdas = model.lambdas()
        aux = {"lambda": jnp.stack(lambdas) if lambdas else jnp.zeros((0,), jnp.float32)}
        return total / jnp.maximum(weight, 1.0), aux

    def step(state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": _tree_norm(grads),
                   "lr": schedule(state["step"]), **aux}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return step


def make_eval_step(graphdef, rest) -> Callable:
    """``eval(params, batch) -> (loss sum, weight sum, argmax predictions)``."""

    def evaluate(params, batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["inputs"], **_model_kwargs(batch))
        total, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
        return total, weight, jnp.argmax(logits, axis=-1)

    return evaluate


def memory_estimate(compiled) -> int | None:
    """XLA's estimate of the compiled step's memory: arguments + outputs + temporaries - aliased."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def device_peak_memory() -> int | None:
    """The device allocator's peak in this process (GPU/TPU; None on CPU). It only grows, so it
    covers everything the process ran before, the other model of a comparison included."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def make_state_init(model_cfg: ModelConfig, tcfg, tx: optax.GradientTransformation | None = None
                    ) -> Callable[[], tuple[dict[str, Any], Any]]:
    """``init() -> (state, rest)``: the train state ``{"step", "params", "opt_state"}`` (every
    leaf of params and of the Adam moments a ``nnx.Variable`` carrying its logical axes) and the
    model's non-parameter state. ``jax.eval_shape(init)`` describes it without allocating;
    ``jax.jit(init, out_shardings=...)`` creates it already sharded."""
    tx = make_optimizer(tcfg) if tx is None else tx

    def init_state():
        model = TransformerLM(model_cfg, rngs=nnx.Rngs(tcfg.seed))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        return state, rest

    return init_state


def pretrained_state(path: str, model_cfg: ModelConfig, tx: optax.GradientTransformation,
                     state_sh: Any, rest_sh: Any, mesh) -> tuple[dict[str, Any], Any]:
    """The train state at step 0 with the parameters of the Hugging Face checkpoint ``path``
    (``train.init_from``), read onto ``mesh`` as :func:`make_state_init`'s would be placed."""
    from diffjax import hf

    keep = {k: getattr(model_cfg, k) for k in hf.OVERRIDABLE}
    model = hf.from_pretrained(path, mesh=mesh, **keep)
    if model.config != model_cfg:
        diffs = [f"{k}: checkpoint {v!r}, config {getattr(model_cfg, k)!r}"
                 for k, v in model.config.to_dict().items() if getattr(model_cfg, k) != v]
        raise ConfigError(f"train.init_from={path!r}: the model config differs from the "
                          f"checkpoint's ({'; '.join(diffs)}). Fix: take the model config from "
                          f"the checkpoint (diffjax.train.config.resolve_init_from; train.py "
                          f"does).")
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, state_sh["params"])
    rest = jax.device_put(rest, rest_sh)
    opt_state = jax.jit(tx.init, out_shardings=state_sh["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), state_sh["step"])
    return {"step": step, "params": params, "opt_state": opt_state}, rest


# ---------------------------------------------------------------------------- the loop
def describe_mesh(mesh) -> str:
    sizes = " ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.devices.shape))
    return (f"{sizes} ({mesh.devices.size} device{'s' * (mesh.devices.size > 1)}, "
            f"{jax.process_count()} process{'es' * (jax.process_count() > 1)})")


class _MemoryWriter:
    """The metrics sink of processes other than 0 (process 0 writes the files)."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


def train_model(exp: ExperimentConfig, model_cfg: ModelConfig, label: str, directory: str, *,
                require_checkpoint: bool = False, log: Callable[[str], None] = print,
                mesh: jax.sharding.Mesh | None = None) -> TrainResult:
    """Train ``model_cfg`` on ``exp.data`` with ``exp.train`` on ``mesh`` (default: built from
    ``exp.mesh`` over every device of every process) in ``directory``, resuming from its latest
    checkpoint if it has one (saved on any mesh), and return the summary. With several
    processes every process calls it; only process 0 writes metrics and results."""
    mesh = sharding.make_mesh(exp.mesh) if mesh is None else mesh
    sharding.check_model_mesh(model_cfg, mesh, exp.train.batch_size)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        return _train_model(exp, model_cfg, label, directory, require_checkpoint, log, mesh)


def _train_model(exp: ExperimentConfig, model_cfg: ModelConfig, label: str, directory: str,
                 require_checkpoint: bool, log: Callable[[str], None], mesh) -> TrainResult:
    tcfg = exp.train
    main = jax.process_index() == 0
    os.makedirs(directory, exist_ok=True)
    ckpt = Checkpointer(os.path.join(directory, "checkpoints"), keep=tcfg.keep_checkpoints)
    latest = ckpt.latest_step()
    if require_checkpoint and latest is None:
        raise CheckpointError(f"--resume was given but {directory} holds no checkpoint. Fix: drop "
                              f"--resume to start a new run, or point run.dir at the run to resume.")
    meta = {"model": model_cfg.to_dict(), "label": label, "data": dataclasses.asdict(exp.data)}
    if latest is not None:
        saved = ckpt.read_meta(latest)
        check_same_model(saved["model"], meta["model"], directory)
        changed = sorted(k for k in set(saved.get("data", {})) | set(meta["data"])
                         if saved.get("data", {}).get(k) != meta["data"].get(k))
        if changed:
            log(f"[{label}] note: the data config differs from the checkpoint's ({', '.join(changed)}); "
                f"the resumed run will not see the batches an uninterrupted run would have seen")

    # Data: the same global batches in the same order for every model of the experiment and
    # every mesh; this process reads only the rows its devices hold.
    share, shares = sharding.process_batch_share(mesh, tcfg.batch_size)
    local_batch = tcfg.batch_size // shares
    train_iter = iter(data_lib.make_dataset(exp.data, "train", batch_size=local_batch,
                                            process_index=share, process_count=shares))
    val_batches = list(itertools.islice(
        iter(data_lib.make_dataset(exp.data, "validation", batch_size=local_batch,
                                   process_index=share, process_count=shares)),
        tcfg.eval_batches))

    def to_device(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return sharding.global_batch({k: v for k, v in batch.items() if k in MODEL_INPUTS},
                                     mesh, tcfg.batch_size)

    # Model, optimizer, state: created in one jitted function (one compile, not one per
    # initializer), or only described (eval_shape) when a checkpoint will replace it.
    tx = make_optimizer(tcfg)
    schedule = learning_rate_schedule(tcfg)

    init_state = make_state_init(model_cfg, tcfg, tx)

    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0))),
                               nnx.Param, ...)
    abstract, abstract_rest = jax.eval_shape(init_state)
    # every parameter and both Adam moments by their logical axes; step and counts replicated
    state_sh = sharding.tree_shardings(abstract, mesh)
    rest_sh = sharding.tree_shardings(abstract_rest, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    start = 0
    if latest is None and tcfg.init_from is not None:
        state, rest = pretrained_state(tcfg.init_from, model_cfg, tx, state_sh, rest_sh, mesh)
        log(f"[{label}] parameters from the Hugging Face checkpoint {tcfg.init_from}")
    elif latest is None:
        state, rest = jax.jit(init_state, out_shardings=(state_sh, rest_sh))()
    else:
        rest = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_rest),
                       out_shardings=rest_sh)()
        state = ckpt.restore(latest, abstract_like(abstract, state_sh), train_iter)
        start = int(state["step"])
        log(f"[{label}] resuming from the checkpoint at step {start} in {ckpt.directory} "
            f"on the mesh {describe_mesh(mesh)}")

    n_params = count_params(model_cfg).total
    if not val_batches:
        raise data_lib.DataError(
            f"the validation split of {exp.data.source!r} data holds no batch of "
            f"{local_batch} x {exp.data.seq_len} tokens. Fix: add data, or lower "
            f"train.batch_size or data.seq_len, or raise data.val_fraction.")
    first = to_device(val_batches[0])  # shapes for compiling; no training batch is consumed
    batch_sh = {k: v.sharding for k, v in first.items()}
    step_fn = jax.jit(make_train_step(graphdef, rest, tx, schedule), donate_argnums=0,
                      compiler_options=cpu_compile_options(),
                      in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated))
    compiled = step_fn.lower(state, first).compile()
    memory = memory_estimate(compiled)
    eval_fn = jax.jit(make_eval_step(graphdef, rest), compiler_options=cpu_compile_options(),
                      in_shardings=(state_sh["params"], batch_sh),
                      out_shardings=(replicated, replicated, batch_sh["inputs"]))

    writer = (MetricsWriter(directory, resume_step=start, tensorboard=tcfg.tensorboard,
                            log_every=tcfg.log_every) if main else _MemoryWriter())
    tokens_per_step = tcfg.batch_size * exp.data.seq_len

    def evaluate(params) -> dict[str, float]:
        total = weight = 0.0
        correct = answered = q_correct = q_answered = 0
        for b in val_batches:
            t, w, p = eval_fn(params, to_device(b))
            total, weight = total + float(t), weight + float(w)
            if "answer_spans" in b:  # this process's rows; summed over processes below
                ok, has = data_lib.answer_correct(sharding.local_rows(p), b)
                correct, answered = correct + int((ok & has).sum()), answered + int(has.sum())
                ok, has = data_lib.query_correct(sharding.local_rows(p), b)
                q_correct, q_answered = q_correct + int(ok.sum()), q_answered + int(has.sum())
        out = {"val_loss": total / max(weight, 1.0)}
        out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
        if "answer_spans" in val_batches[0]:
            counts = np.array([correct, answered, q_correct, q_answered], np.int64)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                counts = multihost_utils.process_allgather(counts).reshape(-1, 4).sum(0)
            # an example counts when all its answers are right; a query when its answer is
            out["val_answer_accuracy"] = float(counts[0] / counts[1]) if counts[1] else 0.0
            out["val_query_accuracy"] = float(counts[2] / counts[3]) if counts[3] else 0.0
        return out

    last_good = latest
    pending: list[tuple[int, Any]] = []
    timer = {"t": time.perf_counter()}

    bar = None
    if tcfg.progress and main:
        from tqdm.auto import tqdm

        bar = tqdm(total=tcfg.steps, initial=start, desc=label, unit="step", dynamic_ncols=True)

    def process(step: int, metrics: Any, timed: bool) -> dict[str, Any]:
        host = jax.device_get(metrics)
        now = time.perf_counter()
        dt = now - timer["t"]
        timer["t"] = now
        loss = float(host["loss"])
        ppl = math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss
        record = {"step": step, "loss": loss, "ppl": ppl, "lr": float(host["lr"]),
                  "grad_norm": float(host["grad_norm"]), "tokens": step * tokens_per_step,
                  "step_time": dt, "tokens_per_s": tokens_per_step / dt if dt > 0 else None,
                  "timed": timed}
        if host["lambda"].size:
            record["lambda"] = [float(x) for x in host["lambda"]]
        if not math.isfinite(loss):
            writer.write(record)
            raise TrainingDiverged(step, loss, last_good, ckpt.directory)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        return record

    try:
        for step in range(start + 1, tcfg.steps + 1):
            batch = to_device(next(train_iter))
            state, metrics = compiled(state, batch)
            # the first step after (re)start includes warm-up; it is not counted in throughput
            pending.append((step, metrics, step > start + 1))
            boundary = (step % tcfg.eval_every == 0 or step % tcfg.checkpoint_every == 0
                        or step == tcfg.steps)
            while len(pending) > (0 if boundary else 1):
                s, m, timed = pending.pop(0)
                rec = process(s, m, timed)
                if pending or not boundary:
                    writer.write(rec)
            if boundary:
                rec.update(evaluate(state["params"]))
                writer.write(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", val=f"{rec['val_loss']:.3f}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}")
                if step % tcfg.checkpoint_every == 0 or step == tcfg.steps:
                    ckpt.save(step, state, train_iter.get_state(), meta, rec["val_loss"])
                    last_good = step
                timer["t"] = time.perf_counter()  # eval/checkpoint time is not step time
                pending = [(s, m, False) for s, m, _ in pending]
            if step == _FAULT_KILL_AT_STEP:  # fault injection, see _FAULT_KILL_AT_STEP
                if step % tcfg.checkpoint_every:
                    ckpt.wait()  # earlier saves committed; the kill lands between checkpoints
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        if bar is not None:
            bar.close()
        writer.close()
        ckpt.wait()
        ckpt.close()

    records = (read_metrics(os.path.join(directory, "metrics.jsonl")) if main
               else writer.records)
    result = summarize(label, model_cfg, directory, records, n_params, memory, latest)
    result.mesh = describe_mesh(mesh)
    result.seed = tcfg.seed
    if main:
        with open(os.path.join(directory, "result.json"), "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return result


def summarize(label: str, model_cfg: ModelConfig, directory: str, records: list[dict],
              n_params: int, memory: int | None, resumed_from: int | None) -> TrainResult:
    """A :class:`TrainResult` from the run's metrics records."""
    timed = [r for r in records if r.get("timed") and r.get("step_time")]
    step_time = float(np.median([r["step_time"] for r in timed])) if timed else float("nan")
    last = records[-1] if records else {}
    tail = [r["loss"] for r in records[-max(1, len(records) // 20):]]
    evals = [r for r in records if "val_loss" in r]
    device_peak = device_peak_memory()
    tokens_per_step = last.get("tokens", 0) / max(last.get("step", 1), 1)
    return TrainResult(
        label=label, attention=model_cfg.attention, directory=directory, params=n_params,
        steps=int(last.get("step", 0)), tokens_seen=int(last.get("tokens", 0)),
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
        val_accuracy=evals[-1].get("val_answer_accuracy") if evals else None,
        val_query_accuracy=evals[-1].get("val_query_accuracy") if evals else None,
        resumed_from=resumed_from)
