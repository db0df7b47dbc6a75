"""The training loop of one model: jitted step with donated state, evaluation, metrics,
checkpoints, exact resume, divergence stop, built from the package's pieces: the step
(:mod:`.step`), what training starts from (:mod:`.setup`), what it records
(:mod:`.recorder`) and how it stops (:mod:`.preemption`).

The state is a plain pytree ``{"step", "params", "opt_state"}`` (the model's ``nnx.Param``
state and Optax's state), so one jitted function updates it and Orbax saves it. It lives on a
``("data", "fsdp", "context", "tensor")`` mesh (``exp.mesh``; one device is the 1x1x1x1 mesh): every
parameter and both Adam moments are placed by their logical axis names
(:mod:`diffjax.infra.sharding`), batches are global arrays assembled from each process's rows, and
the step is compiled once with those shardings. Every step's loss reaches ``metrics.jsonl``
(written by process 0); the host reads step ``n``'s metrics while step ``n + 1`` runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
from flax import nnx

from diffjax import data as data_lib
from diffjax import ops
from diffjax.infra import sharding, storage
from diffjax.config import ModelConfig
from diffjax.nn.param_count import count_params
from diffjax.infra.runtime import Runtime

from diffjax.train.checkpoint import (
    Checkpointer,
    abstract_like,
)
from diffjax.train.config import ExperimentConfig
from diffjax.train.metrics import (
    StepProfiler,
    read_metrics,
)
from diffjax.train.step import model_inputs
from diffjax.train.setup import (
    Validation,
    ModelSetup,
    open_run,
    run_runtime,
    check_run,
    compile_steps,
    describe_mesh,
    initial_state,
    model_setup,
    process_stream,
)
from diffjax.train.recorder import (
    Throughput,
    TrainResult,
    Recorder,
    progress_bar,
    memory_estimate,
    metrics_sink,
    summarize,
)
from diffjax.train.hooks import Hooks
from diffjax.train.preemption import KeepPosition, Preempted, TrainingDiverged, preemption_guard


AfterStep = Callable[[int, Checkpointer], None]


def train_model(
    exp: ExperimentConfig,
    model_cfg: ModelConfig,
    label: str,
    directory: str,
    *,
    require_checkpoint: bool = False,
    log: Callable[[str], None] = print,
    mesh: jax.sharding.Mesh | None = None,
    runtime: Runtime | None = None,
    after_step: AfterStep | None = None,
) -> TrainResult:
    """Train ``model_cfg`` on ``exp.data`` with ``exp.train`` on ``mesh`` (default: built from
    ``exp.mesh`` over every device of every process) in ``directory``, resuming from its latest
    checkpoint if it has one (saved on any mesh), and return the summary. With several
    processes every process calls it; only process 0 writes metrics and results.

    SIGTERM or SIGINT stops it at the next step boundary (the same step on every process):
    that step is saved (model, optimizer and data-iterator state; no earlier checkpoint is
    removed), the save committed, and :class:`Preempted` raised; calling it again resumes.

    ``after_step(step, checkpointer)`` runs after each step's bookkeeping (its evaluation and
    checkpoint save issued, the save maybe still in flight); the resume tests kill the process
    from it. ``runtime``: the run's :class:`Runtime` as :func:`run_runtime` decided it (a
    caller that checked it before, e.g. for every model of a comparison); default decided here
    for ``mesh``."""
    runtime = run_runtime(exp, model_cfg, mesh) if runtime is None else runtime
    mesh = runtime.mesh
    check_run(exp, mesh, [model_cfg])
    with preemption_guard(), jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        return _train_model(
            exp, model_cfg, label, directory, require_checkpoint, log, runtime, after_step
        )


@dataclasses.dataclass
class _Steps:
    """What the steps of one model's run share besides the state: the config, the mesh, the
    checkpointer and the checkpoint metadata, the data, the compiled steps and the recorder."""

    exp: ExperimentConfig
    runtime: Runtime
    label: str
    ckpt: Checkpointer
    meta: dict
    train_iter: Any
    val: Validation
    train_fn: Callable
    eval_fn: Callable
    recorder: "Recorder"
    rollbacks: int = 0  # train.on_nan=rollback: how many so far
    rolled_back_to: int | None = None  # the checkpoint step the last rollback restored
    plan: data_lib.MixturePlan | None = None  # a mixture's: what each batch reads
    log: Callable[[str], None] = print
    read: int = 0  # global batches the train iterator has read (a rollback skips, not rereads)
    val_loss: float | None = None  # the last evaluation's, saved with the checkpoint after it

    def batch(self) -> tuple[dict[str, jax.Array] | None, float]:
        """The next training batch on the devices (None: the data has ended, a mixture with
        ``data.mixture.exhausted=stop``), and the seconds spent waiting for it."""
        t = time.perf_counter()
        host = next(self.train_iter, None)
        wait = time.perf_counter() - t
        if host is None:
            return None, wait
        for note in self.plan.notes(self.read) if self.plan is not None else ():
            self.log(f"[{self.label}] {note}")  # a component ran out and starts over
        self.read += 1
        return model_inputs(host, self.runtime, self.exp.train.batch_size), wait

    def end_of_data(self, step: int, state) -> None:
        """The data ended after ``step``: said in the log, that step evaluated and saved."""
        self.log(f"[{self.label}] {self.plan.end_note(step)}")
        if self.recorder.queued is not None:
            self.evaluate(step, state)
            self.save(step, state)

    def is_checkpoint(self, step: int) -> bool:
        return step % self.exp.train.checkpoint_every == 0 or step == self.exp.train.steps

    def hooks(self, after_step: AfterStep | None) -> Hooks:
        """After each step, in order: the evaluation (every ``train.eval_every`` steps and at
        each checkpoint step), the checkpoint (every ``train.checkpoint_every`` steps and the
        last), the caller's ``after_step`` and the preemption stop."""
        tcfg, hooks = self.exp.train, Hooks()
        hooks.add(self.evaluate, every=tcfg.eval_every, also=self.is_checkpoint)
        hooks.add(self.save, every=tcfg.checkpoint_every, also=lambda s: s == tcfg.steps)
        if after_step is not None:
            hooks.add(lambda step, state: after_step(step, self.ckpt), name="after_step")
        hooks.add(self.stop_if_preempted)
        return hooks

    def evaluate(self, step: int, state) -> None:
        """Validation into the step's record, written now."""
        record = self.recorder.pop()
        rows = self.exp.train.batch_size
        record.update(self.val.evaluate(self.eval_fn, state["params"], self.runtime, rows))
        self.recorder.write_evaluated(record)
        self.val_loss = record["val_loss"]
        self.recorder.restart_clock()

    def save(self, step: int, state) -> None:
        """The checkpoint of ``step`` (with the data iterator's position and the step's
        validation loss; the evaluation hook ran first), and the metrics flushed."""
        self.ckpt.save(step, state, self.train_iter.get_state(), self.meta, self.val_loss)
        self.recorder.last_good = step
        self.recorder.writer.flush()  # a bucket's metrics.jsonl holds this step's records
        self.recorder.restart_clock()

    def roll_back(
        self, diverged: TrainingDiverged, setup: ModelSetup, model_cfg, log
    ) -> tuple[Any, int]:
        """``train.on_nan=rollback``: ``(state, step)`` of the last good checkpoint (the initial
        state when none was saved; the one before it when the loss went non-finite again
        before a newer one was saved), with the data left where it is: the batches read since
        that checkpoint are skipped. The records after that step are dropped from the metrics.
        Raises ``diverged`` with ``train.on_nan=stop`` or after ``train.nan_retries``."""
        tcfg = self.exp.train
        if tcfg.on_nan != "rollback" or self.rollbacks >= tcfg.nan_retries:
            raise diverged
        target = diverged.last_checkpoint
        self.ckpt.wait()
        if target is not None and target == self.rolled_back_to:  # its parameters may be bad
            target = max((s for s in self.ckpt.all_steps() if s < target), default=None)
        if target is None:
            state = initial_state(setup, model_cfg, tcfg, self.ckpt, None, None, log, self.label)[0]
        else:
            abstract = abstract_like(setup.abstract, setup.state_sh)
            state = self.ckpt.restore(target, abstract, KeepPosition())
        self.rollbacks, self.rolled_back_to = self.rollbacks + 1, target
        step = 0 if target is None else target
        log(
            f"[{self.label}] the loss is {diverged.loss} at step {diverged.step}: rolled back "
            f"to {'the initial state' if target is None else f'the checkpoint at step {step}'}, "
            f"skipping the batches read since (rollback {self.rollbacks} of at most "
            f"{tcfg.nan_retries})"
        )
        self.recorder.rewind(step, self.rollbacks)
        return state, step

    def stop_if_preempted(self, step: int, state) -> None:
        """On SIGTERM/SIGINT (every process at the same step): this step's record and a
        checkpoint of it, committed, then :class:`Preempted`."""
        guard = preemption_guard()
        if not guard.stop_at(step):
            return
        recorder = self.recorder
        if recorder.queued is not None:  # this step's record (a NaN loss raises here)
            recorder.writer.write(recorder.pop())
        if not self.is_checkpoint(step):  # a checkpoint step is saved already
            self.ckpt.save(step, state, self.train_iter.get_state(), self.meta, preempted=True)
            recorder.last_good = step
        self.ckpt.wait()
        raise Preempted(
            step, self.ckpt.directory, guard.signal_name, self.label, self.exp.train.seed
        )


def _train_model(
    exp: ExperimentConfig,
    model_cfg: ModelConfig,
    label: str,
    directory: str,
    require_checkpoint: bool,
    log: Callable[[str], None],
    runtime: Runtime,
    after_step: AfterStep | None,
) -> TrainResult:
    tcfg, mesh, guard = exp.train, runtime.mesh, preemption_guard()
    if not guard.synced and guard.requested():  # came before this model started
        ckpt_dir = storage.join(str(storage.absolute(directory)), "checkpoints")
        raise Preempted(None, ckpt_dir, guard.signal_name, label, tcfg.seed)
    impl = runtime.attention.describe()
    log(f"[{label}] attention: {impl[0]} ({impl[1]})")
    if tcfg.kernel_check != "off":  # before anything is trained: a failure stops the run
        interpret = tcfg.kernel_check == "interpret"
        ops.check_kernels(model_cfg, runtime.attention, interpret=interpret, log=log)
    ckpt, latest, meta = open_run(exp, model_cfg, label, directory, require_checkpoint, log)
    stages = meta.get("mixture_stages")
    train_iter, val = process_stream(exp, "train", mesh, None, stages), Validation.of(exp, mesh)
    setup = model_setup(model_cfg, tcfg, runtime, exp.retrofit.schedule)
    retrofit = exp.retrofit if tcfg.retrofit else None
    state, rest = initial_state(
        setup, model_cfg, tcfg, ckpt, latest, train_iter, log, label, retrofit
    )
    start = int(state["step"])
    # compiled for a validation batch's shapes: no training batch is consumed
    example = model_inputs(val.batches[0], runtime, tcfg.batch_size)
    train_fn, eval_fn = compile_steps(setup, state, rest, example)
    writer = metrics_sink(exp, directory, start)
    bar = progress_bar(tcfg.steps, start, label) if tcfg.progress and _is_main() else None
    throughput = Throughput.of(model_cfg, tcfg, exp.data.seq_len, mesh)
    tokens = tcfg.batch_size * exp.data.seq_len
    recorder = Recorder(writer, tokens, bar, latest, ckpt.directory, throughput)
    run = _Steps(exp, runtime, label, ckpt, meta, train_iter, val, train_fn, eval_fn, recorder)
    run.plan, run.log, run.read = _mixture_plan(exp, stages, log, label), log, _read(train_iter)
    hooks = run.hooks(after_step)
    profiler = StepProfiler(tcfg.profile_window, directory)
    step = start
    try:
        while step < tcfg.steps:
            profiler.before(step + 1)
            batch, wait = run.batch()
            if batch is None:  # a mixture that stops when a component runs out has ended
                run.end_of_data(step, state)
                break
            step += 1
            state, metrics = train_fn(state, batch)
            profiler.after(step, metrics)
            try:  # the first step after a (re)start includes warm-up: not counted in throughput
                recorder.push(step, metrics, timed=step > start + 1, data_wait=wait)
                hooks.run(step, state)
            except TrainingDiverged as diverged:  # train.on_nan=rollback, else raised again
                state, step = run.roll_back(diverged, setup, model_cfg, log)
    except storage.StorageError:  # the bucket stopped answering: a save in flight cannot commit
        ckpt.abandon()
        raise
    finally:
        profiler.close()
        try:
            recorder.close()
        except storage.StorageError:
            ckpt.abandon()
            raise
        finally:
            ckpt.wait()
            ckpt.close()
    mixture = run.plan.summary(run.read) if run.plan is not None else None
    return _finish(
        model_cfg, label, directory, writer, train_fn, latest, mesh, tcfg.seed, impl, mixture
    )


def _mixture_plan(exp: ExperimentConfig, stages, log, label: str):
    """A mixture's :class:`diffjax.data.MixturePlan` (None for one corpus); logs, before
    training, where a mixture that stops when a component runs out will end."""
    if exp.data.source != "mixture":
        return None
    plan = data_lib.mixture_plan(exp.data, exp.train.batch_size, stages)
    note = plan.stop_note(exp.train.steps)
    if note:
        log(f"[{label}] {note}")
    return plan


def _read(train_iter) -> int:
    """The global batches a (restored) train iterator has read."""
    return data_lib.batches_read(train_iter.get_state())


def _is_main() -> bool:
    return jax.process_index() == 0


def _finish(
    model_cfg, label, directory, writer, train_fn, latest, mesh, seed, impl, mixture=None
) -> TrainResult:
    """The model's :class:`TrainResult` from its metrics (process 0 also writes
    ``result.json``); ``impl``: the run's attention (:meth:`diffjax.ops.Resolved.describe`); ``mixture``: what a mixture run read
    of each component."""
    main = _is_main()
    records = read_metrics(storage.join(directory, "metrics.jsonl")) if main else writer.records
    n_params, memory = count_params(model_cfg).total, memory_estimate(train_fn)
    result = summarize(label, model_cfg, directory, records, n_params, memory, latest)
    result.mesh, result.seed, result.mixture = describe_mesh(mesh), seed, mixture
    result.attention_impl, result.attention_impl_why = impl
    if main:
        storage.write_json(storage.join(directory, "result.json"), result.to_dict())
    return result
