"""What a model's training starts from: the run's checks, the model and its optimizer built
on the mesh, the steps compiled, the state initialised, restored or taken from a pretrained
checkpoint, and the data streams of this process."""

from __future__ import annotations

import dataclasses
import itertools
import math
import functools
import json
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diffjax.ops import context
from diffjax import data as data_lib
from diffjax.interop import hf
from diffjax import ops
from diffjax.infra import sharding, storage
from diffjax.infra.compile_options import cpu_compile_options
from diffjax.config import ConfigError, KernelTarget, ModelConfig
from diffjax.nn.model import TransformerLM
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
    check_wandb,
)
from diffjax.train.optimizer import learning_rate_schedule, make_optimizer
from diffjax.train.step import eval_step, evaluate, train_step


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
        dataclasses.replace(tcfg, seed=0),
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
            attention_impl=runtime.attention,
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
    (:func:`diffjax.ops.context.check_sequence`). ``models``: default ``exp.model``;
    ``mesh`` may be abstract (a planner's target)."""
    check_wandb(exp.run.wandb)
    order = exp.mesh.context_order
    for model_cfg in [exp.model] if models is None else models:
        sharding.check_model_mesh(model_cfg, mesh, exp.train.batch_size, order)
    check_grad_accum(exp.train, mesh)
    context.check_sequence(exp.data.seq_len, context.axis_size(mesh), order)


def run_runtime(
    exp: ExperimentConfig,
    model_cfg: ModelConfig,
    mesh=None,
    target: KernelTarget | None = None,
) -> Runtime:
    """The :class:`Runtime` of ``model_cfg``'s run in ``exp`` on ``mesh`` (default: built from
    ``exp.mesh``; ``target``: the platform and GPU it is traced for, default the mesh's
    devices'), with the model's attention decided once (:func:`diffjax.ops.resolve_model`
    for the run's sequence length, documents and diagnostics, over the ``context`` axis where
    the mesh splits the sequence): what the run logs, records and self-checks, and what its
    steps run. A :class:`ConfigError` with the reason and fix when the setting cannot run
    them."""
    runtime = Runtime.of(model_cfg, exp.mesh, mesh)
    if target is not None:
        cc = target.compute_capability
        runtime = dataclasses.replace(runtime, platform=target.platform, compute_capability=cc)
    try:
        attention = ops.resolve_model(
            model_cfg,
            runtime.kernel_target,
            seq_len=exp.data.seq_len,
            segments=data_lib.carries_documents(exp.data),
            logit_max=exp.train.diagnostics,
            context=runtime.split_context,
        )
    except ValueError as e:
        raise ConfigError(f"model.attention_impl={model_cfg.attention_impl}: {e}") from None
    return dataclasses.replace(runtime, attention=attention)


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


def open_run(
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
    """The data settings (``data.`` keys) that differ from a checkpoint's (a saved config of
    this version or an earlier one: :meth:`DataConfig.from_saved`), leaving out those that
    change no batch (``prefetch``) and a mixture's weights, which :func:`mixture_stages`
    handles."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            elif k == "components":
                out[prefix + k] = [{**c, "weight": None} for c in v]
            else:
                out[prefix + k] = v
        return out

    theirs = flat(json.loads(json.dumps(data_lib.DataConfig.from_saved(saved).to_dict())))
    mine = flat(json.loads(json.dumps(current)))
    return sorted(
        k
        for k in set(theirs) | set(mine)
        if theirs.get(k) != mine.get(k) and k not in ("prefetch", "mixture.reweight")
    )


def mixture_stages(data, ckpt: Checkpointer, latest, saved, log, label: str) -> list[dict]:
    """A mixture's weights over the run (:func:`diffjax.data.resume_stages`): the config's
    from step 0 for a new run; a resumed run's from its checkpoint, with a change of weights
    (allowed by ``data.mixture.reweight``, else refused) starting at the resumed step."""
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


def describe_mesh(mesh) -> str:
    sizes = " ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.devices.shape))
    return (
        f"{sizes} ({mesh.devices.size} device{'s' * (mesh.devices.size > 1)}, "
        f"{jax.process_count()} process{'es' * (jax.process_count() > 1)})"
    )


@dataclasses.dataclass
class Validation:
    """The validation batches every evaluation of a model reads (this process's rows), and the
    metrics the data declares beyond loss and perplexity."""

    batches: list[dict[str, np.ndarray]]
    metrics: dict[str, data_lib.ValidationMetric]
    # a mixture: each validated component's own batches (``eval_batches`` of each), and the
    # shares its losses are blended by into val_loss (the training weights, as realised)
    components: dict[str, list[dict[str, np.ndarray]]] = dataclasses.field(default_factory=dict)
    blend: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, exp: ExperimentConfig, mesh) -> "Validation":
        data, n = exp.data, exp.train.eval_batches
        if data.source != "mixture":
            batches = list(itertools.islice(process_stream(exp, "validation", mesh), n))
            return cls(
                _some(batches, exp, mesh, repr(data.source)), data_lib.validation_metrics(data)
            )
        parts = {c.name: data.component(c.name) for c in data.mixture.components}
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
