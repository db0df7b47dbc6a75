"""Orbax checkpoints of the train state, the data iterator and the run's metadata.

Saves are asynchronous and atomic, so a process killed at any moment leaves either a whole
checkpoint or an unfinished one that is ignored and cleaned up on the next start. On local disk
Orbax writes into a temporary directory and renames it when complete; in a bucket (``gs://``,
written by tensorstore), where a rename is a copy, it writes the step's directory in place and
commits it with a ``commit_success.txt`` marker written last. The last
``keep_checkpoints`` and the best (lowest validation loss) are preserved.

Each checkpoint holds ``state`` (step, params, optimizer state), ``data`` (the Grain iterator's
state: the number of global batches read, the same on every process, so one JSON file serves
any process count) and ``meta`` (the model config, for the mismatch check on resume).

Sharded states save from every process (each writes its shards) and restore onto any mesh:
:meth:`Checkpointer.restore` reads into the target's shardings (``abstract_like(tree,
shardings)``), so a run saved with ``fsdp=8`` continues with ``data=2, tensor=4`` or on
another number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as cm

from diffjax.interop import hf
from diffjax.infra import sharding, storage
from diffjax.nn.attention import Ramp
from diffjax.config import ConfigError, ModelConfig
from diffjax.interop.conversion import RetrofitConfig, retrofit_config
from diffjax.nn.model import TransformerLM, initial_rest, stack_layers, unstack_layers

from diffjax.train.config import ExperimentConfig


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, or written by a different model config."""


# the metrics Orbax records with a preemption checkpoint (Checkpointer.save(preempted=True))
PREEMPTED = "preempted"


def _is_preemption(metrics: Any) -> bool:
    return isinstance(metrics, dict) and PREEMPTED in metrics


def _val_loss(metrics: Any) -> float:
    """The ranking of a checkpoint for "best": its validation loss (a preemption checkpoint,
    which has none, ranks last)."""
    return math.inf if _is_preemption(metrics) else metrics["val_loss"]


@dataclasses.dataclass
class KeepPolicy:
    """Orbax preservation: the last ``keep`` and the best (lowest validation loss) of the
    regular checkpoints, and a preemption checkpoint while it is the latest checkpoint. A
    preemption checkpoint is not counted among the last ``keep``, so saving it removes nothing;
    once training resumed from it and saved a later checkpoint, it goes."""

    keep: int

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        regular = [i for i, c in enumerate(checkpoints) if not _is_preemption(c.metrics)]
        policy = cm.AnyPreservationPolicy(
            [
                cm.LatestN(n=self.keep),
                cm.BestN(
                    get_metric_fn=_val_loss,
                    reverse=True,
                    n=1,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        kept = policy.should_preserve([checkpoints[i] for i in regular], context=context)
        out = [False] * len(checkpoints)
        for i, k in zip(regular, kept):
            out[i] = bool(k)
        if checkpoints:
            last = max(range(len(checkpoints)), key=lambda i: checkpoints[i].step)
            out[last] = out[last] or _is_preemption(checkpoints[last].metrics)
        return out


# checkpointers whose save in flight was given up (the bucket stopped answering): see
# Checkpointer.abandon and lingering_save_threads
_ABANDONED: list[Checkpointer] = []


def lingering_save_threads() -> bool:
    """Whether a save that :meth:`Checkpointer.abandon` gave up may still hold threads alive:
    Orbax's threads of a save that the bucket stopped answering end only at their own timeouts
    (minutes), and the interpreter waits for them at exit."""
    import threading

    main = threading.main_thread()
    return bool(_ABANDONED) and any(
        t.is_alive() and not t.daemon and t is not main for t in threading.enumerate()
    )


class Checkpointer:
    def __init__(self, directory: storage.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = str(storage.absolute(directory))  # a local path or a gs:// URL
        self.abandoned = False
        # best_fn is what makes Orbax write each step's metrics to disk: without it they live
        # only in this manager's memory, and after a resume BestN sees none and deletes the
        # best checkpoint. (Preservation itself is decided by ``policy`` alone.)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=KeepPolicy(keep),
            best_fn=_val_loss,
            best_mode="min",
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            storage.path(self.directory),
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def best_step(self) -> int | None:
        """The step with the lowest recorded validation loss (the latest if none recorded)."""
        return (
            self.manager.best_step() if self.manager.best_step() is not None else self.latest_step()
        )

    def save(
        self,
        step: int,
        state: Any,
        data_state: Any,
        meta: dict[str, Any],
        val_loss: float | None = None,
        *,
        preempted: bool = False,
    ) -> None:
        """Save ``step`` (asynchronously: :meth:`wait` for the commit). ``preempted``: a
        checkpoint written because training was stopped (no validation loss): it removes no
        earlier checkpoint and is never the best (:class:`KeepPolicy`)."""
        if preempted:
            metrics = {PREEMPTED: 1.0}
        else:
            metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        # the previous save is waited for here: its failure surfaces now
        with self._guarded(f"saving the checkpoint at step {step} in"):
            self.manager.save(
                step,
                metrics=metrics,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(json.loads(json.dumps(data_state))),  # a snapshot now
                    meta=ocp.args.JsonSave(meta),
                ),
            )

    def read_meta(self, step: int) -> dict[str, Any]:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
        except Exception as e:  # noqa: BLE001 - any failure to read is a bad checkpoint
            raise CheckpointError(_unreadable(self.directory, step, e)) from e

    def read_data(self, step: int) -> dict[str, Any]:
        """The data iterator's state saved at ``step`` (what :meth:`restore` sets it to)."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))[
                "data"
            ]
        except Exception as e:  # noqa: BLE001 - any failure to read is a bad checkpoint
            raise CheckpointError(_unreadable(self.directory, step, e)) from e

    def restore(self, step: int, abstract_state: Any, data_iterator: Any) -> Any:
        """The state at ``step``, placed like ``abstract_state`` (``ShapeDtypeStruct``s with
        shardings: any mesh); sets ``data_iterator``'s position in place."""
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
            data_iterator.set_state(out["data"])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(_unreadable(self.directory, step, e)) from e
        return out["state"]

    def wait(self) -> None:
        """Until the save in flight has committed (a no-op once :meth:`abandon` was called)."""
        if self.abandoned:
            return
        with self._guarded("finishing the checkpoint save in"):
            self.manager.wait_until_finished()

    def abandon(self) -> None:
        """Give up the save in flight without waiting for it: the bucket stopped answering.
        What it wrote has no commit marker, so it is ignored and cleaned up on the next start;
        the last committed checkpoint is untouched. :meth:`wait` and :meth:`close` return at
        once from now on."""
        if not self.abandoned:
            self.abandoned = True
            _ABANDONED.append(self)

    def close(self) -> None:
        if self.abandoned:
            return
        with self._guarded("finishing the checkpoint save in"):
            self.manager.close()

    @contextlib.contextmanager
    def _guarded(self, op: str):
        """:func:`storage.guarded`; a save that failed so is abandoned."""
        try:
            with storage.guarded(op, self.directory):
                yield
        except storage.StorageError:
            self.abandon()
            raise


def committed_steps(directory: storage.PathLike) -> list[int]:
    """The committed checkpoint steps in ``directory`` (local or ``gs://``) without opening a
    manager: on local disk a step Orbax renamed from its temporary name, in a bucket one with
    its commit marker."""
    if not storage.isdir(directory):
        return []
    return sorted(ocp.step.checkpoint_steps(storage.path(directory)))


def _unreadable(directory: str, step: int, error: Exception) -> str:
    return (
        f"the checkpoint at step {step} in {directory} cannot be read "
        f"({type(error).__name__}: {str(error)[:300]}). Nothing was changed. Fix: move "
        f"{storage.join(directory, str(step))} aside to resume from an earlier checkpoint, "
        f"or set run.dir to a new directory to start over."
    )


# how a model is run, not what it is: a checkpoint resumes with any of these changed
EXECUTION_FIELDS = ("attention_impl", "remat")


def check_same_model(saved: dict[str, Any], current: dict[str, Any], directory: str) -> None:
    """Stop when a checkpoint was written by a different model config. A field the checkpoint
    does not record (written before the field existed) counts as its default; the
    :data:`EXECUTION_FIELDS` may differ. A checkpoint of the other parameter layout
    (``scan_layers``) is refused with its own message, which names the converter."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    saved = {**{k: v for k, v in defaults.items() if k in current}, **saved}
    if saved.get("scan_layers") != current.get("scan_layers"):
        layout = {True: "scanned (stacked layers)", False: "unrolled (one entry per layer)"}
        raise ConfigError(
            f"the checkpoint in {directory} holds {layout[bool(saved.get('scan_layers'))]} "
            f"parameters, but model.scan_layers={current.get('scan_layers')}. Fix: resume with "
            f"model.scan_layers={saved.get('scan_layers')}, or copy the run into the other "
            f"layout with `python -m diffjax.train.convert {directory} NEW_DIR` "
            f"(optimizer state included; for a model alone: diffjax.nn.model.stack_layers / "
            f"unstack_layers)."
        )
    diffs = [
        f"{k}: checkpoint has {saved.get(k)!r}, config has {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k) and k not in EXECUTION_FIELDS
    ]
    if diffs:
        raise ConfigError(
            f"the checkpoint in {directory} was written by a different model config ("
            + "; ".join(diffs)
            + "). Fix: use the same model.* settings to resume it, or set "
            "run.dir (or run.name) to a new directory for a new run."
        )


def abstract_like(tree: Any, sharding: Any = None) -> Any:
    """Shape/dtype/sharding structs of ``tree`` (arrays or ``ShapeDtypeStruct``s), the restore
    target. ``sharding``: a tree of shardings like ``tree`` (e.g.
    :func:`diffjax.infra.sharding.tree_shardings`: restore onto that mesh), or one sharding for every
    leaf; leaves left without one get the first local device."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding
        )

    def one(x):
        s = sharding or getattr(x, "sharding", None) or default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(one, tree)


def checkpoint_dir(directory: storage.PathLike) -> str:
    """The ``checkpoints/`` folder of a model's run folder (or that folder itself)."""
    directory = str(storage.absolute(directory))
    if storage.path(directory).name == "checkpoints":
        return directory
    return storage.join(directory, "checkpoints")


def is_checkpoint_dir(directory: storage.PathLike) -> bool:
    """Whether ``directory`` is a diffjax model folder (it or its ``checkpoints/`` holds a
    committed step)."""
    try:
        return bool(committed_steps(checkpoint_dir(directory)))
    except Exception:  # noqa: BLE001 - unreadable: not one
        return False


def read_checkpoint(
    directory: storage.PathLike, step: int | str = "best"
) -> tuple[str, int, dict[str, Any], ModelConfig]:
    """``(checkpoints folder, step, meta, model config)`` of a model's run folder (see
    :func:`load_model` for ``directory`` and ``step``); no weights are read."""
    storage.check_access(directory, what="the model's run folder", write=False)
    directory = str(storage.absolute(directory))
    ckpt_dir = checkpoint_dir(directory)
    steps = committed_steps(ckpt_dir)
    if not steps:
        raise CheckpointError(
            f"{directory} holds no committed checkpoint (looked in {ckpt_dir}). Fix: pass the "
            f"folder of one model and seed of a run written by train.py (e.g. "
            f"runs/default/diff/seed_0), after at least one checkpoint was saved."
        )
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    try:
        if step == "best":
            step = ckpt.best_step()
        elif step == "latest":
            step = ckpt.latest_step()
        elif not isinstance(step, int) or step not in steps:
            raise CheckpointError(
                f"no checkpoint at step {step!r} in {ckpt_dir}. Fix: use "
                f"'best', 'latest' or one of {steps}."
            )
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    try:
        config = ModelConfig(**meta["model"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(
            f"the checkpoint at step {step} in {ckpt_dir} holds no diffjax model config that "
            f"this version can read ({type(e).__name__}: {e}). Fix: load it with the diffjax "
            f"version that wrote it."
        ) from e
    return ckpt_dir, step, meta, config


def load_model(
    directory: storage.PathLike, step: int | str = "best", *, mesh: jax.sharding.Mesh | None = None
):
    """The :class:`diffjax.TransformerLM` saved in a training run's checkpoints.

    ``directory``: a model's run folder (the one holding ``checkpoints/``) or the
    ``checkpoints/`` folder itself, on local disk or in a bucket (``gs://``). ``step``: ``"best"`` (lowest validation loss; the latest
    when no loss was recorded), ``"latest"`` or a step number. Only the parameters are read
    (not the optimizer state; a retrofit's ramp w is one of them); the model config comes from
    the checkpoint. With ``mesh`` the
    parameters are placed on it by their logical axes as they are read; otherwise on the first
    local device. Raises :class:`CheckpointError` naming the problem and the fix.
    """
    ckpt_dir, step, _, config = read_checkpoint(directory, step)
    abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
    if mesh is None:
        target = abstract_like(params, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    else:
        with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
            target = abstract_like(params, sharding.tree_shardings(params, mesh))
    path = storage.path(ckpt_dir) / str(step) / "state"
    try:
        with ocp.PyTreeCheckpointer() as reader:
            item = {"params": target}
            params = reader.restore(
                path,
                args=ocp.args.PyTreeRestore(
                    item=item,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                    partial_restore=True,
                ),
            )["params"]
    except Exception as e:  # noqa: BLE001 - any failure to read is a bad checkpoint
        raise CheckpointError(_unreadable(ckpt_dir, step, e)) from e
    rest = initial_rest(config)  # DIFF V1's lambda_init per layer
    if mesh is not None:
        rest = jax.device_put(rest, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return nnx.merge(graphdef, params, rest)


def run_of(model_dir: storage.PathLike) -> tuple[str, dict[str, Any]] | None:
    """``(run dir, its config.json)`` of the train.py run holding ``model_dir`` (the folder
    itself, its parent or grandparent: ``RUN/<label>/seed_<n>/``), or None."""
    d = storage.absolute(model_dir)
    for _ in range(3):
        file = storage.join(d, "config.json")
        cfg = storage.read_json(file) if storage.path(file).is_file() else None
        if isinstance(cfg, dict) and "model" in cfg and "data" in cfg:
            return str(d), cfg
        if not d.parent.name:  # the root, or a bucket's top
            break
        d = d.parent
    return None


def run_tokenizer_spec(spec: str | None, run_dir: str) -> str:
    """A run's ``data.tokenizer`` as :func:`diffjax.data.load_tokenizer` and
    ``save_pretrained(tokenizer=...)`` take it: ``"byte"`` for bytes (None); a relative path
    that does not exist from here is read relative to the run directory."""
    if spec in (None, "byte"):
        return "byte"
    inside = storage.join(run_dir, spec)
    return spec if storage.exists(spec) or not storage.exists(inside) else inside


def export_model(directory: storage.PathLike, out: str, step: int | str = "best", **kw: Any) -> str:
    """Write one model of a train.py run as a Hugging Face checkpoint (:func:`hf.save_pretrained`;
    ``kw``: its ``max_shard_size`` or ``tokenizer``) with the run's own tokenizer beside it
    (its ``data.tokenizer``: the byte tokenizer as a ``tokenizer.json``, or the run's
    tokenizer files). ``directory``: the model's folder (``RUN/<label>/seed_<s>``); ``step``
    as :func:`load_model`. Refused before anything is read when ``out`` holds a checkpoint
    or the model cannot be expressed. Returns ``out``."""
    _, _, _, config = read_checkpoint(directory, step)
    hf.check_exportable(config.replace(ramp=False))
    if "tokenizer" not in kw:
        run = run_of(directory)
        kw["tokenizer"] = (
            run_tokenizer_spec(run[1]["data"].get("tokenizer"), run[0]) if run else None
        )
    return hf.save_pretrained(load_model(directory, step), out, **kw)


# ---------------------------------------------------------------------------- train.init_from
def pretrained_source(path: str) -> tuple[str, ModelConfig, dict[str, Any]]:
    """``(kind, model config, meta)`` of a checkpoint to start from (``train.init_from``, a
    retrofit's source): ``"hf"``, a Hugging Face directory (``config.json``; meta ``{}``), or
    ``"diffjax"``, a model's run folder (its best step's meta). Refuses anything else, before
    any weight is read."""
    storage.check_access(path, what="train.init_from", write=False)
    if is_checkpoint_dir(path):  # first: a model folder may hold its run's config.json too
        _, _, meta, config = read_checkpoint(path, "best")
        return "diffjax", config, meta
    if storage.exists(storage.join(path, hf.CONFIG_FILE)):
        return "hf", hf.config_from_pretrained(path), {}
    raise CheckpointError(
        f"{path} holds neither a Hugging Face checkpoint (config.json) nor a diffjax "
        f"checkpoint (checkpoints/ with a committed step). Fix: pass a Hugging Face "
        f"directory, a train.py model folder such as runs/NAME/standard/seed_0, or what "
        f"python -m diffjax.retrofit wrote."
    )


def load_pretrained(path: str, *, mesh: jax.sharding.Mesh | None = None, **overrides: Any):
    """The :class:`diffjax.TransformerLM` of a Hugging Face directory or a diffjax model folder
    (:func:`pretrained_source`); ``overrides``: ModelConfig fields that change no weight
    (:data:`diffjax.interop.hf.OVERRIDABLE`), e.g. ``scan_layers`` (the layout is converted)."""
    kind, config, _ = pretrained_source(path)
    if kind == "hf":
        return hf.from_pretrained(path, mesh=mesh, **overrides)
    model = load_model(path, "best", mesh=mesh)
    want = config.replace(**overrides)
    if want.scan_layers != config.scan_layers:
        model = stack_layers(model) if want.scan_layers else unstack_layers(model)
    if model.config != want:  # the execution fields only (dtype, remat, ...): rebuilt alike
        dtype = jax.numpy.dtype(want.param_dtype)

        def cast(v):
            if isinstance(v, nnx.Param) and not isinstance(v, Ramp):
                return v.replace(v[...].astype(dtype))
            return v

        state = jax.tree.map(cast, nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
        fresh = nnx.eval_shape(lambda: TransformerLM(want, rngs=nnx.Rngs(0)))
        model = nnx.merge(nnx.graphdef(fresh), state)
    return model


def resolve_init_from(config: ExperimentConfig) -> ExperimentConfig:
    """With ``train.init_from``: the experiment with the checkpoint's model config (keeping
    ``model.dtype``, ``param_dtype`` and ``attention_impl``; with ``train.retrofit``, the DIFF
    model of ``model.attention`` the source becomes, :func:`diffjax.retrofit.retrofit_config`)
    and, for text data with no ``data.tokenizer`` set, the checkpoint's ``tokenizer.json`` when
    it has one (``data.tokenizer=byte`` keeps bytes); otherwise ``config`` unchanged. A diffjax
    checkpoint of a retrofit (``model.ramp``) brings its ``retrofit.*`` settings unless the
    config sets any. ``train.init_from`` may be local or ``gs://`` (a bucket that does not
    exist or cannot be read is refused first)."""
    if config.train.init_from is None:
        return config
    keep = {k: getattr(config.model, k) for k in ("dtype", "param_dtype", "attention_impl")}
    data, path = config.data, config.train.init_from
    _, model, meta = pretrained_source(path)
    model = model.replace(**keep)
    retrofit = config.retrofit
    if config.train.retrofit:
        model = retrofit_config(
            model,
            config.model.attention,
            lambda_init=config.model.lambda_init,
            diff_norm=config.model.diff_norm,
        )
    elif model.ramp and retrofit == RetrofitConfig() and "retrofit" in meta:
        retrofit = RetrofitConfig(**meta["retrofit"])
    if (
        data.tokenizer is None
        and data.source in ("stdlib", "text")
        and storage.path(storage.join(path, "tokenizer.json")).is_file()
    ):
        data = data.replace(tokenizer=path)  # the checkpoint's own ids
    return dataclasses.replace(config, data=data, model=model, retrofit=retrofit)
