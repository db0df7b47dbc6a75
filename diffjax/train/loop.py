"""The training loop of one model: jitted step with donated state, evaluation, metrics,
checkpoints, exact resume, divergence stop.

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
import functools
import itertools
import json
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from diffjax.ops import context
from diffjax import data as data_lib
from diffjax.infra import flops as flops_lib
from diffjax.interop import hf
from diffjax import ops
from diffjax.infra import sharding, storage
from diffjax.infra.compile_options import cpu_compile_options
from diffjax.config import ConfigError, KernelTarget, ModelConfig
from diffjax.nn.model import TransformerLM, sown_diagnostics, sown_lambdas
from diffjax.nn.param_count import count_params
from diffjax.interop.conversion import RampSchedule, RetrofitConfig, retrofit_model, set_ramp
from diffjax.infra.runtime import Runtime

from diffjax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    abstract_like,
    check_same_model,
    load_pretrained,
)
from diffjax.train.config import ExperimentConfig
from diffjax.train.metrics import (
    MetricsCollector,
    MetricsWriter,
    StepProfiler,
    WandbRun,
    check_wandb,
    read_metrics,
)
from diffjax.train.optimizer import learning_rate_schedule, make_optimizer, spike_metrics

MODEL_INPUTS = ("inputs", "targets", "weights", "segment_ids", "positions", "token_index")
MASK_INPUTS = ("positions", "segment_ids", "token_index")  # what the model reads beside tokens


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
    # (set explicitly, or auto's measurement: diffjax.ops.model_impl)
    attention_impl: str | None = None
    attention_impl_why: str | None = None
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


# ---------------------------------------------------------------------------- the steps
def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """Sum of per-token cross-entropy times weight, and the sum of weights."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * weights), jnp.sum(weights)


def _call(model, batch) -> jax.Array:
    return model(batch["inputs"], **{k: batch[k] for k in MASK_INPUTS if k in batch})


# the signals of a step that are largest values (the rest are means): combined over
# microbatches by their maximum (train.diagnostics; diffjax.nn.model.SOWN_DIAGNOSTICS)
MAX_SIGNALS = ("logit_max", "activation_max", "output_logit_max")
# what train.diagnostics adds to each record: per layer ([L], logit_max [L, maps]), or one value
DIAGNOSTICS = (
    "logit_max",
    "lambda_std",
    "activation_max",
    "output_logit_max",
    "update_ratio",
)


def _loss_terms(params, batch, graphdef, rest):
    """The batch's weighted cross-entropy sum, and ``(weight sum, signals)``: each layer's
    lambda as ``signals["lambda"]`` (:func:`diffjax.nn.model.sown_lambdas`; empty for standard
    attention) and, for a model built with diagnostics, what it sows
    (:func:`diffjax.nn.model.sown_diagnostics`) and the output logits' largest magnitude."""
    model = nnx.merge(graphdef, params, rest)
    logits, sown = nnx.capture(_call, nnx.Intermediate)(model, batch)
    total, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    lambdas = sown_lambdas(sown)
    signals = {"lambda": jnp.stack(lambdas) if lambdas else jnp.zeros((0,), jnp.float32)}
    if model.diagnostics:
        signals.update(sown_diagnostics(sown))
        signals["output_logit_max"] = jnp.max(jnp.abs(logits))
    return total, (weight, signals)


def loss_fn(params, batch, graphdef, rest) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The batch's mean weighted cross-entropy, and its signals (:func:`_loss_terms`): each
    layer's lambda as ``aux["lambda"]``, and the diagnostics of a model built with them."""
    total, (weight, signals) = _loss_terms(params, batch, graphdef, rest)
    return total / jnp.maximum(weight, 1.0), signals


def microbatches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """``[B, ...] -> [k, B / k, ...]``: microbatch ``j`` is rows ``j::k`` of the batch, so each
    data shard's rows split into its own ``k`` microbatches (no rows move between devices),
    each constrained to the batch's row sharding."""

    def split(x):
        x = jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0)
        return sharding.constrain(x, None, "batch", *(None,) * (x.ndim - 2))

    return {name: split(x) for name, x in batch.items()}


def accumulated_loss_and_grads(params, batch, graphdef, rest, accum_steps: int):
    """``((loss, aux), grads)`` as ``jax.value_and_grad(loss_fn, has_aux=True)`` gives them for
    the whole batch, computed over ``accum_steps`` microbatches (:func:`microbatches`) in a
    ``lax.scan``: the weighted cross-entropy sums and their gradients are summed, then divided
    by the whole batch's weight sum (so unevenly weighted microbatches, e.g. answer-only
    weights, count by their tokens); the lambdas (and the mean signals) are averaged over the
    microbatches, the largest values (:data:`MAX_SIGNALS`) are their maximum."""
    mbs = microbatches(batch, accum_steps)
    grad_fn = jax.value_and_grad(_loss_terms, has_aux=True)
    first = jax.tree.map(lambda x: x[0], mbs)
    shapes = jax.eval_shape(lambda p, b: _loss_terms(p, b, graphdef, rest)[1][1], params, first)

    def combine(name, a, b):
        return jnp.maximum(a, b) if name in MAX_SIGNALS else a + b

    def body(carry, mb):
        total, weight, signals, grads = carry
        (t, (w, sig)), g = grad_fn(params, mb, graphdef, rest)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        signals = {k: combine(k, signals[k], sig[k]) for k in signals}
        return (total + t, weight + w, signals, grads), None

    # the sums in float32 (also for bfloat16 parameters), the gradients cast back at the end
    zero = jnp.zeros((), jnp.float32)
    init = (
        zero,
        zero,
        {
            k: jnp.full(v.shape, -jnp.inf if k in MAX_SIGNALS else 0, v.dtype)
            for k, v in shapes.items()
        },
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params),
    )
    (total, weight, signals, grads), _ = jax.lax.scan(body, init, mbs)
    denom = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
    signals = {k: v if k in MAX_SIGNALS else v / accum_steps for k, v in signals.items()}
    return (total / denom, signals), grads


def train_step(
    state,
    batch,
    *,
    graphdef,
    rest,
    tx: optax.GradientTransformation,
    schedule,
    accum_steps=1,
    ramp: RampSchedule | None = None,
):
    """One optimizer step: ``(new state, metrics)``; the state is donated by the jit.
    ``accum_steps > 1``: the gradient of the batch accumulated over that many microbatches
    (:func:`accumulated_loss_and_grads`; the batch rows per data shard must divide by it).
    ``ramp``: a retrofit's schedule of the negative map's weight w (``ModelConfig.ramp``):
    the step ran with ``w(step)``, and the new state holds ``w(step + 1)``, the model as the
    next step and an evaluation of this state see it (recorded as ``ramp``)."""
    if accum_steps == 1:
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, graphdef, rest
        )
    else:
        (loss, aux), grads = accumulated_loss_and_grads(
            state["params"], batch, graphdef, rest, accum_steps
        )
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"], value=loss)
    params = optax.apply_updates(state["params"], updates)
    if ramp is not None:
        params = set_ramp(params, ramp(state["step"] + 1))
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "lr": schedule(state["step"]),
        **aux,
        **spike_metrics(opt_state),
    }
    if ramp is not None:
        metrics["ramp"] = ramp(state["step"])
    if "output_logit_max" in aux:  # train.diagnostics: the update's RMS over the parameters'
        metrics["update_ratio"] = optax.tree.norm(updates) / optax.tree.norm(state["params"])
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def eval_step(params, batch, *, graphdef, rest):
    """``(loss sum, weight sum, argmax predictions)`` of one validation batch."""
    logits = _call(nnx.merge(graphdef, params, rest), batch)
    total, weight = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return total, weight, jnp.argmax(logits, axis=-1)


# ---------------------------------------------------------------------------- setup
@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """One model's optimizer and the shapes and placements of its train state, before the state
    exists: ``init(key) -> (state, rest)`` creates it from an init key, ``abstract``/
    ``abstract_rest`` describe it (``jax.eval_shape``), ``state_sh``/``rest_sh`` place it on
    ``runtime.mesh`` by logical axes; ``seed`` is the run's init seed (``train.seed``)."""

    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    init: Callable[[jax.Array], tuple[dict[str, Any], Any]]
    abstract: Any
    abstract_rest: Any
    state_sh: Any
    rest_sh: Any
    runtime: Runtime
    jitted_init: Callable[[jax.Array], tuple[dict[str, Any], Any]]  # ``init``, jitted, sharded
    seed: int = 0
    accum_steps: int = 1  # microbatches per step (``train.grad_accum_steps``)
    ramp: RampSchedule | None = None  # a retrofit's w(step) (``ModelConfig.ramp``)

    def fresh_state(self) -> tuple[dict[str, Any], Any]:
        """A new state from ``seed``, created sharded in one jitted function (one compile, not
        one per initializer; the seed's key is an argument, not a constant, so every seed of a
        multi-seed run reuses that compile)."""
        return self.jitted_init(jax.random.key(self.seed))

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.runtime.mesh


def seeded_state_init(
    model_cfg: ModelConfig, tx: optax.GradientTransformation, target: KernelTarget | None = None
) -> Callable[[Any], tuple[dict[str, Any], Any]]:
    """``init(key) -> (state, rest)``: the train state ``{"step", "params", "opt_state"}``
    (every leaf of params and of the Adam moments a ``nnx.Variable`` carrying its logical axes)
    and the model's non-parameter state, from ``key = jax.random.key(seed)`` (what
    ``nnx.Rngs(seed)`` makes of an init seed; a traced argument gives the same parameters as a
    constant seed, bit for bit)."""

    def init_state(key):
        model = TransformerLM(model_cfg, rngs=nnx.Rngs(key), target=target)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        return state, rest

    return init_state


def make_state_init(
    model_cfg: ModelConfig, tcfg, tx: optax.GradientTransformation | None = None
) -> Callable[[], tuple[dict[str, Any], Any]]:
    """``init() -> (state, rest)``: :func:`seeded_state_init` from ``tcfg.seed``.
    ``jax.eval_shape(init)`` describes it without allocating; ``jax.jit(init, out_shardings=...)``
    creates it already sharded."""
    init = seeded_state_init(model_cfg, make_optimizer(tcfg) if tx is None else tx)

    def init_state():
        return init(jax.random.key(tcfg.seed))

    return init_state


def model_setup(
    model_cfg: ModelConfig, tcfg, runtime: Runtime, ramp: RampSchedule | None = None
) -> ModelSetup:
    """The :class:`ModelSetup` of ``model_cfg`` trained with ``tcfg`` on ``runtime.mesh``: every
    parameter and both Adam moments placed by their logical axes, step and counts replicated.
    Built once per process for a model, train config up to the seed, mesh and logical-axis
    rules: the seeds of a multi-seed run (and the throughput measurement) share its compiled
    init. The model is built with ``runtime.context``: the order :func:`model_inputs` lays
    the tokens out in over a ``context`` axis."""
    setup = _model_setup(
        model_cfg,
        dataclasses.replace(tcfg, seed=0, num_seeds=1),
        runtime,
        sharding.current_rules(),
        ramp if model_cfg.ramp else None,
    )
    return dataclasses.replace(setup, seed=tcfg.seed)


@functools.lru_cache(maxsize=8)
def _model_setup(model_cfg: ModelConfig, tcfg, runtime: Runtime, rules, ramp) -> ModelSetup:
    del rules  # part of the cache key: the shardings depend on the logical-axis rules in force
    tx, mesh = make_optimizer(tcfg), runtime.mesh
    init = seeded_state_init(model_cfg, tx, runtime.kernel_target)
    model = nnx.eval_shape(
        lambda: TransformerLM(
            model_cfg,
            rngs=nnx.Rngs(0),
            context=runtime.context,
            target=runtime.kernel_target,
            diagnostics=tcfg.diagnostics,
        )
    )
    graphdef = nnx.graphdef(model)
    abstract, abstract_rest = jax.eval_shape(init, jax.random.key(0))
    state_sh = sharding.tree_shardings(abstract, mesh)
    rest_sh = sharding.tree_shardings(abstract_rest, mesh)
    return ModelSetup(
        graphdef,
        tx,
        learning_rate_schedule(tcfg),
        init,
        abstract,
        abstract_rest,
        state_sh,
        rest_sh,
        runtime,
        jax.jit(init, out_shardings=(state_sh, rest_sh)),
        accum_steps=tcfg.grad_accum_steps,
        ramp=ramp,
    )


def compile_steps(setup: ModelSetup, state, rest, batch) -> tuple[Any, Callable]:
    """The train step compiled for ``state`` (donated) and batches shaped and placed like
    ``batch`` (arrays, or ``jax.ShapeDtypeStruct`` with shardings), and the eval step
    (compiled at its first call)."""
    train, evaluate_fn = jit_steps(setup, rest, {k: v.sharding for k, v in batch.items()})
    return train.lower(state, batch).compile(), evaluate_fn


def jit_steps(setup: ModelSetup, rest, batch_sh: dict) -> tuple[Callable, Callable]:
    """The one place the steps are jitted (``train.py``, the throughput measurement and the
    planner compile these): the train step (state donated) and the eval step for batches
    placed by ``batch_sh``, with the compiler options of ``setup.runtime.platform``."""
    replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
    options = cpu_compile_options(setup.runtime.platform)
    # the model's non-parameter state (DIFF V1's lambda_init per layer) is a constant of the
    # step, as host values: the same program whether it was computed here or for a target
    rest = jax.tree.map(np.asarray, rest)
    model = dict(graphdef=setup.graphdef, rest=rest)
    train = jax.jit(
        functools.partial(
            train_step,
            tx=setup.tx,
            schedule=setup.schedule,
            accum_steps=setup.accum_steps,
            ramp=setup.ramp,
            **model,
        ),
        donate_argnums=0,
        compiler_options=options,
        in_shardings=(setup.state_sh, batch_sh),
        out_shardings=(setup.state_sh, replicated),
    )
    evaluate_fn = jax.jit(
        functools.partial(eval_step, **model),
        compiler_options=options,
        in_shardings=(setup.state_sh["params"], batch_sh),
        out_shardings=(replicated, replicated, batch_sh["inputs"]),
    )
    return train, evaluate_fn


def check_run(exp: ExperimentConfig, mesh, models: Iterable[ModelConfig] | None = None) -> None:
    """Every rule that joins the experiment's configs to a mesh, checked in this one place
    before any compute (``train.py``, :func:`train_model` and the planner call it), each with
    its "field: problem. Fix: ..." message: each model's heads and the batch against the mesh
    axes (:func:`diffjax.infra.sharding.check_model_mesh`), the accumulation against the data shards
    (:func:`check_grad_accum`), the sequence against the ``context`` axis and its order
    (:func:`diffjax.ops.context.check_sequence`). ``models``: default every model of ``exp``;
    ``mesh`` may be abstract (a planner's target)."""
    check_wandb(exp.run.wandb)
    order = exp.mesh.context_order
    for model_cfg in exp.models.values() if models is None else models:
        sharding.check_model_mesh(model_cfg, mesh, exp.train.batch_size, order)
    check_grad_accum(exp.train, mesh)
    context.check_sequence(exp.data.seq_len, context.axis_size(mesh), order)


def attention_choice(exp: ExperimentConfig, model_cfg: ModelConfig, runtime: Runtime):
    """``(implementation, why)`` of ``model_cfg``'s attention in training on ``runtime``
    (:func:`diffjax.ops.model_impl` at the run's sequence length, documents and diagnostics); a
    :class:`ConfigError` with the reason and fix when an explicit one cannot run them."""
    try:
        return ops.model_impl(
            model_cfg,
            runtime.kernel_target,
            exp.data.seq_len,
            data_lib.carries_documents(exp.data),
            exp.train.diagnostics,
        )
    except ValueError as e:
        raise ConfigError(f"model.attention_impl={model_cfg.attention_impl}: {e}") from None


def check_grad_accum(tcfg, mesh) -> None:
    """Refuse, before any compute, a ``train.grad_accum_steps`` that does not split every data
    shard's rows of the batch (each process's too) into whole microbatches."""
    k, batch = tcfg.grad_accum_steps, tcfg.batch_size
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    shards = sizes.get("data", 1) * sizes.get("fsdp", 1)
    if k == 1 or batch % shards:  # batch % shards: sharding.check_model_mesh's message
        return
    rows = batch // shards
    if batch % k or rows % k:
        valid = [d for d in range(1, rows + 1) if rows % d == 0]
        raise ConfigError(
            f"train.grad_accum_steps={k} does not divide the {rows} rows of train.batch_size="
            f"{batch} that each of the data x fsdp = {shards} data shards holds: every shard "
            f"splits its own rows into the microbatches. Fix: use train.grad_accum_steps in "
            f"{valid}, or a train.batch_size that is a multiple of {shards * k}."
        )


def pretrained_state(
    path: str, model_cfg: ModelConfig, setup: ModelSetup, retrofit: RetrofitConfig | None = None
) -> tuple[dict[str, Any], Any]:
    """The train state at step 0 with the parameters of the checkpoint ``path``
    (``train.init_from``: a Hugging Face directory or a diffjax model folder), read onto the
    mesh as :meth:`ModelSetup.fresh_state`'s would be; with ``retrofit`` (``train.retrofit``)
    the standard model there converted to ``model_cfg``'s DIFF kind first
    (:func:`diffjax.retrofit.retrofit_model`)."""
    keep = {k: getattr(model_cfg, k) for k in hf.OVERRIDABLE}
    if retrofit is not None:
        source = load_pretrained(path, **keep)
        model = retrofit_model(
            source,
            model_cfg.attention,
            retrofit,
            lambda_init=model_cfg.lambda_init,
            diff_norm=model_cfg.diff_norm,
            seed=setup.seed,
        )
    else:
        model = load_pretrained(path, mesh=setup.mesh, **keep)
    if model.config != model_cfg:
        diffs = [
            f"{k}: checkpoint {v!r}, config {getattr(model_cfg, k)!r}"
            for k, v in model.config.to_dict().items()
            if getattr(model_cfg, k) != v
        ]
        raise ConfigError(
            f"train.init_from={path!r}: the model config differs from the "
            f"checkpoint's ({'; '.join(diffs)}). Fix: take the model config from "
            f"the checkpoint (diffjax.train.config.resolve_init_from; train.py "
            f"does)."
        )
    _, params, rest = nnx.split(model, nnx.Param, ...)
    if setup.ramp is not None:
        params = set_ramp(params, setup.ramp(0))
    params = jax.device_put(params, setup.state_sh["params"])
    rest = jax.device_put(rest, setup.rest_sh)
    opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_sh["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), setup.state_sh["step"])
    return {"step": step, "params": params, "opt_state": opt_state}, rest


def model_inputs(
    batch: dict[str, np.ndarray], runtime: Runtime, global_rows: int
) -> dict[str, jax.Array]:
    """The global arrays a step reads (:data:`MODEL_INPUTS`) from this process's batch rows.
    On a mesh whose ``context`` axis splits the sequence, the tokens are put in
    ``runtime.context.order`` (:func:`diffjax.ops.context.order_batch`: every input, with
    explicit positions, so the model computes the same function and the loss the same sum)."""
    arrays = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
    n = runtime.context_size
    if n > 1:
        arrays = context.order_batch(arrays, n, runtime.context.order)
    return sharding.global_batch(arrays, runtime.mesh, global_rows)


def step_inputs(data: data_lib.DataConfig, runtime: Runtime) -> dict[str, Any]:
    """The arrays a step reads (as :func:`model_inputs` makes them) and their dtypes: the
    tokens, targets and weights; ``segment_ids`` and ``positions`` where the data keeps
    documents apart; ``positions`` and ``token_index`` where a ``context`` axis splits the
    sequence (what a compile-only plan traces the step with)."""
    names = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
    if data_lib.carries_documents(data):
        names.update(segment_ids=jnp.int32, positions=jnp.int32)
    if runtime.context_size > 1:
        names.update(positions=jnp.int32, token_index=jnp.int32)
    return names


def process_stream(
    exp: ExperimentConfig,
    split: str,
    mesh,
    data: data_lib.DataConfig | None = None,
    stages: list[dict] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's rows of every global batch of ``split`` of ``data`` (default
    ``exp.data``; ``stages``: a mixture's weights over the run): the same global batches in the
    same order for every model of the experiment and every mesh."""
    share, shares = sharding.process_batch_share(mesh, exp.train.batch_size)
    return iter(
        data_lib.make_dataset(
            exp.data if data is None else data,
            split,
            batch_size=exp.train.batch_size // shares,
            process_index=share,
            process_count=shares,
            mixture_stages=stages,
        )
    )


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


def _open_run(
    exp: ExperimentConfig,
    model_cfg: ModelConfig,
    label: str,
    directory: str,
    require_checkpoint: bool,
    log,
) -> tuple[Checkpointer, int | None, dict[str, Any]]:
    """The run's checkpointer, its latest step (None: a new run) and the metadata each
    checkpoint records; refuses a checkpoint of another model, notes a changed data config."""
    storage.makedirs(directory)
    ckpt = Checkpointer(storage.join(directory, "checkpoints"), keep=exp.train.keep_checkpoints)
    latest = ckpt.latest_step()
    if require_checkpoint and latest is None:
        raise CheckpointError(
            f"--resume was given but {directory} holds no checkpoint. Fix: drop "
            f"--resume to start a new run, or point run.dir at the run to resume."
        )
    meta = {"model": model_cfg.to_dict(), "label": label, "data": dataclasses.asdict(exp.data)}
    meta["optimizer"] = {"skip_spikes": bool(exp.train.skip_spikes)}  # its state's shape
    if model_cfg.ramp:  # a retrofit: how its w moves (train.init_from of it brings them)
        meta["retrofit"] = dataclasses.asdict(exp.retrofit)
    saved = None if latest is None else ckpt.read_meta(latest)
    if exp.data.source == "mixture":  # the weights over the run, in every checkpoint
        meta["mixture_stages"] = mixture_stages(exp.data, ckpt, latest, saved, log, label)
    if latest is not None:
        check_same_model(saved["model"], meta["model"], directory)
        check_same_optimizer(saved.get("optimizer", {}), meta["optimizer"], directory)
        changed = data_changes(saved.get("data", {}), meta["data"])
        if changed:
            log(
                f"[{label}] note: the data config differs from the checkpoint's ({', '.join(changed)}); "
                f"the resumed run will not see the batches an uninterrupted run would have seen"
            )
    return ckpt, latest, meta


def data_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The data settings that differ from a checkpoint's (as JSON: a saved config's lists are
    its tuples), leaving out those that change no batch (``prefetch``) and a mixture's weights,
    which :func:`mixture_stages` handles."""
    theirs = {**data_lib.config.SAVED_BEFORE, **saved}
    mine = json.loads(json.dumps(current))

    def strip(k: str, v: Any) -> Any:
        return [{**c, "weight": None} for c in v or ()] if k == "mixture" else v

    return sorted(
        k
        for k in set(theirs) | set(mine)
        if strip(k, theirs.get(k)) != strip(k, mine.get(k))
        and k not in ("prefetch", "mixture_reweight")
    )


def mixture_stages(data, ckpt: Checkpointer, latest, saved, log, label: str) -> list[dict]:
    """A mixture's weights over the run (:func:`diffjax.data.resume_stages`): the config's
    from step 0 for a new run; a resumed run's from its checkpoint, with a change of weights
    (allowed by ``data.mixture_reweight``, else refused) starting at the resumed step."""
    if latest is None:
        return [s.to_dict() for s in data_lib.mixture.first_stage(data)]
    batch = data_lib.batches_read(ckpt.read_data(latest))
    stages, note = data_lib.resume_stages(
        data, saved.get("mixture_stages"), saved.get("data", {}), batch, latest
    )
    if note:
        log(f"[{label}] {note}")
    return [s.to_dict() for s in stages]


def check_same_optimizer(saved: dict[str, Any], current: dict[str, Any], directory: str) -> None:
    """Refuse a resume whose optimizer state has another shape than the checkpoint's: the spike
    skipping keeps its window in it, so ``train.skip_spikes`` cannot be turned on or off."""
    was, now = bool(saved.get("skip_spikes", False)), current["skip_spikes"]
    if was != now:
        state = "on" if was else "off"
        raise ConfigError(
            f"train.skip_spikes: the checkpoint in {directory} was written with spike skipping "
            f"{state}, whose optimizer state has {'a' if was else 'no'} running window. Fix: "
            f"resume with spike skipping {state} (train.skip_spikes="
            f"{'a multiple, e.g. 3' if was else '0'}), or set run.dir to a new directory."
        )


def initial_state(
    setup: ModelSetup,
    model_cfg: ModelConfig,
    tcfg,
    ckpt: Checkpointer,
    latest: int | None,
    train_iter,
    log,
    label: str,
    retrofit: RetrofitConfig | None = None,
):
    """``(state, rest)`` to start from: the latest checkpoint's (which also moves ``train_iter``
    to where it was), ``train.init_from``'s parameters (converted to DIFF with ``retrofit``),
    or a fresh initialisation."""
    if latest is not None:
        # the non-parameter state (DIFF V1's per-layer lambda_init) as a fresh model has it;
        # XLA drops the parameter initialisers this function does not return
        rest = jax.jit(lambda: setup.init(jax.random.key(0))[1], out_shardings=setup.rest_sh)()
        state = ckpt.restore(latest, abstract_like(setup.abstract, setup.state_sh), train_iter)
        log(
            f"[{label}] resuming from the checkpoint at step {int(state['step'])} in "
            f"{ckpt.directory} on the mesh {describe_mesh(setup.mesh)}"
        )
        return state, rest
    if tcfg.init_from is not None:
        what = "retrofitted to DIFF from" if retrofit is not None else "from the checkpoint"
        log(f"[{label}] parameters {what} {tcfg.init_from}")
        return pretrained_state(tcfg.init_from, model_cfg, setup, retrofit)
    state, rest = setup.fresh_state()
    if setup.ramp is not None:
        params = set_ramp(state["params"], setup.ramp(0))
        state = {**state, "params": jax.device_put(params, setup.state_sh["params"])}
    return state, rest


# ---------------------------------------------------------------------------- evaluation
def evaluate(
    eval_fn: Callable,
    params,
    batches: list[dict[str, np.ndarray]],
    runtime: Runtime,
    global_rows: int,
    metrics: Mapping[str, data_lib.ValidationMetric] | None = None,
) -> dict[str, float]:
    """Validation loss and perplexity over ``batches`` (this process's rows), and ``val_<name>``
    for each of ``metrics`` (``name -> fn(predictions, batch) -> (right, counted)``, what the
    data declares: :func:`diffjax.data.validation_metrics`): ``right / counted``, both summed
    over the batches and the processes (left out when nothing was counted). On a ``context``
    mesh axis the predictions return from ``runtime.context.order`` to the data's order."""
    metrics = dict(metrics or {})
    total = weight = 0.0
    counts = np.zeros((len(metrics), 2), np.int64)  # per metric: right, counted
    for b in batches:
        t, w, p = eval_fn(params, model_inputs(b, runtime, global_rows))
        total, weight = total + float(t), weight + float(w)
        if metrics:  # this process's rows; summed over processes below
            preds = context.restore_order(
                np.asarray(sharding.local_rows(p)), runtime.context_size, runtime.context.order
            )
            for i, fn in enumerate(metrics.values()):
                counts[i] += fn(preds, b)
    out = {"val_loss": total / max(weight, 1.0)}
    out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
    if metrics and jax.process_count() > 1:
        counts = multihost_utils.process_allgather(counts).reshape(-1, len(metrics), 2).sum(0)
    for name, (right, n) in zip(metrics, counts):
        if n:
            out[f"val_{name}"] = float(right / n)
    return out


# ---------------------------------------------------------------------------- recording
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


class _KeepPosition:
    """A data iterator stand-in for a rollback's restore: the live iterator keeps its place."""

    def set_state(self, state) -> None:
        del state


class _Recorder:
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


def _progress_bar(total: int, start: int, label: str):
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


def describe_mesh(mesh) -> str:
    sizes = " ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.devices.shape))
    return (
        f"{sizes} ({mesh.devices.size} device{'s' * (mesh.devices.size > 1)}, "
        f"{jax.process_count()} process{'es' * (jax.process_count() > 1)})"
    )


# ---------------------------------------------------------------------------- preemption
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


# ---------------------------------------------------------------------------- the loop
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
    from it."""
    runtime = Runtime.of(model_cfg, exp.mesh, mesh)
    mesh = runtime.mesh
    check_run(exp, mesh, [model_cfg])
    with _GUARD, jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        return _train_model(
            exp, model_cfg, label, directory, require_checkpoint, log, runtime, after_step
        )


@dataclasses.dataclass
class _Validation:
    """The validation batches every evaluation of a model reads (this process's rows), and the
    metrics the data declares beyond loss and perplexity."""

    batches: list[dict[str, np.ndarray]]
    metrics: dict[str, data_lib.ValidationMetric]
    # a mixture: each validated component's own batches (``eval_batches`` of each), and the
    # shares its losses are blended by into val_loss (the training weights, as realised)
    components: dict[str, list[dict[str, np.ndarray]]] = dataclasses.field(default_factory=dict)
    blend: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, exp: ExperimentConfig, mesh) -> "_Validation":
        data, n = exp.data, exp.train.eval_batches
        if data.source != "mixture":
            batches = list(itertools.islice(process_stream(exp, "validation", mesh), n))
            return cls(
                _some(batches, exp, mesh, repr(data.source)), data_lib.validation_metrics(data)
            )
        parts = {c.name: data.component(c.name) for c in data.mixture}
        components = {
            name: _some(
                list(itertools.islice(process_stream(exp, "validation", mesh, part), n)),
                exp,
                mesh,
                f"component {name!r}",
            )
            for name, part in parts.items()
            if part.val_fraction > 0  # a component without a validation split
        }
        if not components:
            raise data_lib.DataError(
                "DataConfig.mixture: no component has a validation split (each sets "
                "val_fraction=0). Fix: give one a val_fraction > 0."
            )
        batches = [b for bs in components.values() for b in bs]
        shares = data_lib.mixture.shares(data.weights)
        return cls(batches, {}, components, {k: shares[k] for k in components})

    def evaluate(self, eval_fn, params, runtime: Runtime, rows: int) -> dict[str, float]:
        """The validation metrics of ``params``. A mixture's: each component's loss as
        ``val_loss/<name>``, and ``val_loss`` their blend by the training shares (the mean where
        no validated component is trained on)."""
        if not self.components:
            return evaluate(eval_fn, params, self.batches, runtime, rows, self.metrics)
        out = {
            f"val_loss/{name}": evaluate(eval_fn, params, batches, runtime, rows)["val_loss"]
            for name, batches in self.components.items()
        }
        total = sum(self.blend.values())
        weights = self.blend if total > 0 else dict.fromkeys(self.blend, 1.0)
        loss = sum(w * out[f"val_loss/{n}"] for n, w in weights.items()) / sum(weights.values())
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), **out}


def _some(batches: list, exp: ExperimentConfig, mesh, what: str) -> list:
    """``batches``, or a DataError when the validation split of ``what`` gave none."""
    if not batches:
        tcfg = exp.train
        local_batch = tcfg.batch_size // sharding.process_batch_share(mesh, tcfg.batch_size)[1]
        raise data_lib.DataError(
            f"the validation split of {what} data holds no batch of "
            f"{local_batch} x {exp.data.seq_len} tokens. Fix: add data, or lower "
            f"train.batch_size or data.seq_len, or raise data.val_fraction."
        )
    return batches


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
    val: _Validation
    train_fn: Callable
    eval_fn: Callable
    recorder: "_Recorder"
    rollbacks: int = 0  # train.on_nan=rollback: how many so far
    rolled_back_to: int | None = None  # the checkpoint step the last rollback restored
    plan: data_lib.MixturePlan | None = None  # a mixture's: what each batch reads
    log: Callable[[str], None] = print
    read: int = 0  # global batches the train iterator has read (a rollback skips, not rereads)

    def batch(self) -> tuple[dict[str, jax.Array] | None, float]:
        """The next training batch on the devices (None: the data has ended, a mixture with
        ``data.mixture_exhausted=stop``), and the seconds spent waiting for it."""
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
            self.evaluate_and_save(step, state, force=True)

    def is_checkpoint(self, step: int) -> bool:
        return step % self.exp.train.checkpoint_every == 0 or step == self.exp.train.steps

    def evaluate_and_save(self, step: int, state, force: bool = False) -> None:
        """At an evaluation or checkpoint step (or ``force``: the data ended): validation into
        the step's record, and the checkpoint (with the data iterator's position) once the
        record is written."""
        tcfg, save = self.exp.train, self.is_checkpoint(step) or force
        if not (save or step % tcfg.eval_every == 0):
            return
        record = self.recorder.pop()
        rows = tcfg.batch_size
        record.update(self.val.evaluate(self.eval_fn, state["params"], self.runtime, rows))
        self.recorder.write_evaluated(record)
        if save:
            self.ckpt.save(step, state, self.train_iter.get_state(), self.meta, record["val_loss"])
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
            state = self.ckpt.restore(target, abstract, _KeepPosition())
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
        if not _GUARD.stop_at(step):
            return
        recorder = self.recorder
        if recorder.queued is not None:  # this step's record (a NaN loss raises here)
            recorder.writer.write(recorder.pop())
        if not self.is_checkpoint(step):  # a checkpoint step is saved already
            self.ckpt.save(step, state, self.train_iter.get_state(), self.meta, preempted=True)
            recorder.last_good = step
        self.ckpt.wait()
        raise Preempted(
            step, self.ckpt.directory, _GUARD.signal_name, self.label, self.exp.train.seed
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
    tcfg, mesh = exp.train, runtime.mesh
    if not _GUARD.synced and _GUARD.requested():  # came before this model started
        ckpt_dir = storage.join(str(storage.absolute(directory)), "checkpoints")
        raise Preempted(None, ckpt_dir, _GUARD.signal_name, label, tcfg.seed)
    impl = attention_choice(exp, model_cfg, runtime)
    log(f"[{label}] attention: {impl[0]} ({impl[1]})")
    if tcfg.kernel_check != "off":  # before anything is trained: a failure stops the run
        ops.check_kernels(
            model_cfg, impl=impl[0], interpret=tcfg.kernel_check == "interpret", log=log
        )
    ckpt, latest, meta = _open_run(exp, model_cfg, label, directory, require_checkpoint, log)
    stages = meta.get("mixture_stages")
    train_iter, val = process_stream(exp, "train", mesh, None, stages), _Validation.of(exp, mesh)
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
    bar = _progress_bar(tcfg.steps, start, label) if tcfg.progress and _is_main() else None
    throughput = Throughput.of(model_cfg, tcfg, exp.data.seq_len, mesh)
    tokens = tcfg.batch_size * exp.data.seq_len
    recorder = _Recorder(writer, tokens, bar, latest, ckpt.directory, throughput)
    run = _Steps(exp, runtime, label, ckpt, meta, train_iter, val, train_fn, eval_fn, recorder)
    run.plan, run.log, run.read = _mixture_plan(exp, stages, log, label), log, _read(train_iter)
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
                run.evaluate_and_save(step, state)
                if after_step is not None:
                    after_step(step, ckpt)
                run.stop_if_preempted(step, state)
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
    ``result.json``); ``impl``: :func:`attention_choice`; ``mixture``: what a mixture run read
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
