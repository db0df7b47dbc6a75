"""One model's training configuration: typed dataclasses, Python config files and
``dotted.key=value``.

An experiment is :class:`ExperimentConfig` = ``run`` (where it writes) + ``model``
(:class:`diffjax.ModelConfig`) + ``data`` (:class:`diffjax.data.DataConfig`) + ``train``
(:class:`TrainConfig`) + ``mesh`` (:class:`diffjax.infra.sharding.MeshConfig`: the data / fsdp /
tensor axis sizes) + ``retrofit`` (a conversion's settings). What a comparison trains beside the
model (its twin, the seeds) is the experiment layer's: :class:`diffjax.compare.Comparison` adds
a ``compare`` section, and every function here serves its sections too.

A config file is a Python file with ``get_config() -> ExperimentConfig``. Any field can be
overridden from the command line as ``section.field=value``; values are parsed by the field's
declared type, and an unknown key or a bad value stops with a message that names it and the
fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import os
from typing import Any, ClassVar, Iterator

from diffjax.infra import storage
from diffjax.cli import summary
from diffjax.config import (
    ROPE_SCALINGS,
    ConfigError,
    ModelConfig,
    allowed_values,
    check_declared,
    check_fields,
    convert,
    declared,
    describe_type,
    fail,
    field_comments,
    field_types,
)
from diffjax.data import DataConfig, MixtureComponent
from diffjax.data.config import moved_keys
from diffjax.interop.conversion import LAMBDA_PROJ, RAMPS, SECONDS, RetrofitConfig
from diffjax.infra.sharding import MeshConfig

SCHEDULES = ("linear", "cosine", "constant")
KERNEL_CHECKS = ("auto", "off", "interpret")
ON_NAN = ("stop", "rollback")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping. Defaults follow the paper's recipe for its small models
    (Table 10: AdamW (0.9, 0.98), weight decay 0.05, 375 warmup steps, linear decay, lr 1.5e-4);
    config files scale them to the model at hand."""

    steps: int = declared(
        1000, ge=1, fix="set train.steps to a positive integer"
    )  # train steps (optimizer updates)
    batch_size: int = declared(
        16, ge=1, fix="set train.batch_size to a positive integer"
    )  # global batch (sequences per step)
    # split each global batch into this many microbatches, run one after another inside the
    # one compiled step (their gradients summed): the activations of batch_size /
    # grad_accum_steps sequences at a time
    grad_accum_steps: int = declared(
        1, ge=1, fix="set train.grad_accum_steps=1 (no accumulation) or more"
    )
    lr: float = declared(
        1.5e-4, gt=0, fix="set train.lr to a positive learning rate, e.g. 1e-3"
    )  # the peak learning rate, reached after warmup
    warmup_steps: int = declared(
        375, ge=0, fix="set train.warmup_steps=0 or more"
    )  # steps of linear warmup to lr
    schedule: str = declared(
        "linear", choices=SCHEDULES, what="schedule"
    )  # the decay after warmup, to lr * min_lr_ratio ("constant": none)
    min_lr_ratio: float = declared(
        0.0, ge=0, le=1, fix="set train.min_lr_ratio between 0 and 1"
    )  # final lr = lr * min_lr_ratio
    b1: float = declared(0.9, ge=0, lt=1, fix="set train.b1 to e.g. 0.9")  # AdamW beta1
    b2: float = declared(0.98, ge=0, lt=1, fix="set train.b2 to e.g. 0.9")  # AdamW beta2
    eps: float = declared(1e-8, ge=0, fix="set train.eps to 0 or more")  # AdamW epsilon
    weight_decay: float = declared(
        0.05, ge=0, fix="set train.weight_decay to 0 or more"
    )  # not applied to norms, lambda parameters and biases
    grad_clip: float = declared(
        1.0, ge=0, fix="set train.grad_clip to 0 or more"
    )  # global-norm clipping; 0 turns it off
    eval_every: int = declared(
        100, ge=1, fix="set train.eval_every to a positive integer"
    )  # steps between validations
    eval_batches: int = declared(
        8, ge=1, fix="set train.eval_batches to a positive integer"
    )  # validation batches per validation
    checkpoint_every: int = declared(
        100, ge=1, fix="set train.checkpoint_every to a positive integer"
    )  # steps between checkpoints
    keep_checkpoints: int = declared(
        3, ge=1, fix="set train.keep_checkpoints to a positive integer"
    )  # the last K; the best (lowest validation loss) is kept too
    log_every: int = declared(
        1, ge=1, fix="set train.log_every to a positive integer"
    )  # metrics.jsonl gets every step; TensorBoard every log_every steps
    seed: int = declared(
        0, ge=0, fix="use a non-negative seed"
    )  # parameter init (a comparison's models of one seed all get it)
    # A checkpoint to start from: a Hugging Face directory or a diffjax model folder. Hugging
    # Face: model_type diffllama or llama; diffjax: a train.py run's <label>/seed_<s> (its best
    # step) or what python -m diffjax.retrofit wrote. The model config comes from it
    # (model.dtype, param_dtype and attention_impl are kept). A run that holds a checkpoint
    # resumes from that.
    init_from: str | None = None
    # convert train.init_from (a standard model) to model.attention (DIFF V1 or V2) with the
    # retrofit.* settings before training: its negative map ramped in from weight 0
    retrofit: bool = False
    # check the Pallas kernels against the reference math before training, once per device
    # kind, jax version and head widths (cached): "auto" when the run uses them (GPU/TPU),
    # "off", or "interpret" (through the interpreters, also on CPU; for tests)
    kernel_check: str = declared("auto", choices=KERNEL_CHECKS, what="setting")
    # the accelerator's peak dense bf16 TFLOP/s per device, for MFU (model FLOPs utilisation).
    # None: looked up from the device kind (diffjax.infra.flops.PEAK_TFLOPS); no MFU on CPU unless set
    peak_tflops: float | None = declared(
        None,
        gt=0,
        fix="set train.peak_tflops to the device's peak TFLOP/s, e.g. 989 for an H100, or "
        "None to look it up from the device kind",
    )
    progress: bool = True  # show a progress bar
    tensorboard: bool = True  # write TensorBoard logs (tb/ in each model's folder)
    # "START:END": a jax.profiler trace of steps START..END (1-based, both included) in each
    # model's folder (profile/; TensorBoard's profile plugin, XProf and Perfetto read it).
    # None: no trace
    profile_steps: str | None = None
    # log DIFF's signals from the step in every record. Each layer's largest attention logit
    # (both maps for DIFF), V2's sigma(lambda) spread, the largest hidden activation, the
    # output logits' largest magnitude, the update-to-parameter RMS ratio. Off: today's step
    diagnostics: bool = False
    # skip a step's update when its loss or gradient norm passes this multiple of the running
    # median. Also when either is not finite; parameters and optimizer state stay unchanged,
    # the batch is consumed. 0: never skip
    skip_spikes: float = 0.0
    spike_window: int = declared(
        64, ge=2, fix="set train.spike_window to e.g. 64"
    )  # steps in the running median (skipping starts once it is full)
    # on a non-finite loss: stop, or roll back to the last good checkpoint and go on. A
    # rollback skips past the batches read since that checkpoint
    on_nan: str = declared("stop", choices=ON_NAN, what="setting")
    nan_retries: int = declared(
        3, ge=0, fix="set train.nan_retries to 0 or more"
    )  # the most rollbacks train.on_nan=rollback makes in one run

    def __post_init__(self):
        check_fields(self)
        check_declared(self)  # the bounds and choices declared with the fields
        c = "TrainConfig"
        self._check_profile_steps()
        self._check_stability()
        if self.batch_size >= 1 and self.batch_size % self.grad_accum_steps:
            valid = [k for k in range(1, self.batch_size + 1) if self.batch_size % k == 0]
            fail(
                c,
                "grad_accum_steps",
                f"{self.grad_accum_steps} microbatches cannot split train.batch_size="
                f"{self.batch_size} evenly",
                f"use train.grad_accum_steps in {valid}, or a train.batch_size that is a "
                f"multiple of {self.grad_accum_steps}",
            )

    def _check_stability(self) -> None:
        c = "TrainConfig"
        if self.skip_spikes and not self.skip_spikes > 1:
            fail(
                c,
                "skip_spikes",
                f"must be 0 (off) or a multiple > 1 of the running median, got {self.skip_spikes}",
                "set train.skip_spikes=0, or e.g. train.skip_spikes=3",
            )

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """``(start, end)`` of :attr:`profile_steps`, or None."""
        if self.profile_steps is None:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)

    def _check_profile_steps(self) -> None:
        if self.profile_steps is None:
            return
        parts = self.profile_steps.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            fail(
                "TrainConfig",
                "profile_steps",
                f"{self.profile_steps!r} is not START:END",
                "write the steps to trace as train.profile_steps=START:END, e.g. 10:12",
            )
        start, end = (int(p) for p in parts)
        if not 1 <= start <= end <= self.steps:
            fail(
                "TrainConfig",
                "profile_steps",
                f"the window {start}:{end} is not inside the run's steps 1:{self.steps}",
                f"choose 1 <= START <= END <= train.steps={self.steps}, e.g. "
                f"{min(10, self.steps)}:{min(12, self.steps)}",
            )


WANDB_MODES = ("off", "online", "offline")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run writes: ``dir`` (default ``runs/<name>``), a local folder or a bucket."""

    name: str = "default"  # the run's name: it writes to runs/<name> unless dir is set
    # where the run writes (None: runs/<name>): a local path or gs://BUCKET/PATH
    dir: str | None = None
    # with a gs:// run.dir: upload metrics.jsonl and TensorBoard's files every this many seconds
    # (and at each checkpoint and at the end); a SIGKILL loses at most the records since then
    sync_every_s: float = 30.0
    # the budget of one call into a bucket (read, write, listing), retries included; past it the
    # call fails naming the path (None: $DIFFJAX_STORAGE_TIMEOUT_S, else 120 s)
    storage_timeout_s: float | None = None
    # Weights & Biases: "off", "online" (needs `wandb login` or WANDB_API_KEY) or "offline"
    # (written under each model's folder; `wandb sync` uploads it later). Process 0 logs the
    # scalars TensorBoard gets and the whole config, one W&B run per model and seed.
    wandb: str = "off"
    wandb_project: str = "diffjax"  # the W&B project
    wandb_entity: str | None = None  # the W&B team or user (None: the login's default)
    # the W&B run names' stem (None: run.name); each run is STEM-LABEL-seed_S, grouped by STEM
    wandb_name: str | None = None
    wandb_tags: tuple[str, ...] = ()  # tags on every W&B run of this experiment

    def __post_init__(self):
        check_fields(self)
        if self.wandb not in WANDB_MODES:
            fail(
                "RunConfig",
                "wandb",
                f"unknown mode {self.wandb!r}",
                f"use one of {', '.join(map(repr, WANDB_MODES))}",
            )
        if self.dir is not None:
            storage.path(self.dir, what="run.dir")  # a scheme nobody handles: refused here
        if not self.sync_every_s > 0:
            fail(
                "RunConfig",
                "sync_every_s",
                f"must be > 0, got {self.sync_every_s}",
                "set run.sync_every_s to a number of seconds, e.g. 30",
            )
        if self.dir is not None and storage.is_remote(self.dir) and self.sync_every_s < 1:
            fail(
                "RunConfig",
                "sync_every_s",
                f"{self.sync_every_s} s is below 1 s for a run in a bucket ({self.dir}): each "
                "sync rewrites metrics.jsonl, and Cloud Storage allows about one write per second "
                "to one object (faster writes are answered 429 and retried)",
                "set run.sync_every_s=1 or more (the default, 30, writes each file at most "
                "once every 30 s)",
            )
        if self.storage_timeout_s is not None and not self.storage_timeout_s > 0:
            fail(
                "RunConfig",
                "storage_timeout_s",
                f"must be > 0, got {self.storage_timeout_s}",
                "set run.storage_timeout_s to a number of seconds, e.g. 300, or leave it unset",
            )
        if not self.name or os.sep in self.name:
            fail(
                "RunConfig",
                "name",
                f"must be a plain non-empty name, got {self.name!r}",
                "use a name like 'diff-vs-twin' (set run.dir for a path)",
            )

    @property
    def path(self) -> str:
        return self.dir if self.dir else os.path.join("runs", self.name)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One model's training: where it writes, the model, its data, the optimisation, the mesh
    and (for a conversion) the retrofit settings. The experiment layer's comparison
    (:class:`diffjax.compare.Comparison`) adds what it trains beside it."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    retrofit: RetrofitConfig = RetrofitConfig()
    # keys this config no longer has: {old key: what replaced it}, for the override's error
    MOVED: ClassVar[dict[str, str]] = moved_keys()

    def __post_init__(self):
        check_fields(self)
        if self.train.retrofit and self.train.init_from is None:
            fail(
                "ExperimentConfig",
                "train.retrofit",
                "converts the model train.init_from names, but train.init_from is unset",
                "set train.init_from to a standard model (a diffjax run folder or a Hugging "
                "Face Llama directory)",
            )
        if self.train.retrofit and not self.model.is_diff:
            fail(
                "ExperimentConfig",
                "train.retrofit",
                "converts to DIFF, but model.attention is 'standard'",
                "set model.attention=diff_v2 (starts exactly at the source) or diff_v1",
            )
        if (self.model.ramp or self.train.retrofit) and self.retrofit.lambda_proj != "default":
            if self.model.attention != "diff_v2":
                fail(
                    "ExperimentConfig",
                    "retrofit.lambda_proj",
                    f"is {self.retrofit.lambda_proj!r}, a DIFF V2 setting, but model.attention "
                    f"is {self.model.attention!r}",
                    "leave retrofit.lambda_proj at 'default' for DIFF V1",
                )
        if self.data.seq_len > self.model.max_seq_len:
            fail(
                "ExperimentConfig",
                "data.seq_len",
                f"{self.data.seq_len} is longer than the model takes (model.max_seq_len="
                f"{self.model.max_seq_len})",
                f"set data.seq_len <= {self.model.max_seq_len} or model.max_seq_len >= {self.data.seq_len}",
            )

    @property
    def label(self) -> str:
        """The model's folder name in a run: ``diff`` for a DIFF model, else ``standard``."""
        return "diff" if self.model.is_diff else "standard"

    def with_seed(self, seed: int) -> "ExperimentConfig":
        """This experiment with init seed ``seed`` (the data order is unchanged)."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train, seed=seed))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_directory(run_dir: str, label: str, seed: int) -> str:
    """Where one model of one seed writes: ``RUN_DIR/<label>/seed_<seed>/`` (metrics.jsonl, tb/,
    checkpoints/, result.json); ``RUN_DIR`` local or ``gs://``."""
    return storage.join(run_dir, label, f"seed_{seed}")


def sections(cls: type = ExperimentConfig) -> dict[str, type]:
    """``{name: dataclass}`` of the config class ``cls``'s sections (its dataclass fields):
    ``run``, ``model``, ``data``, ``train``, ``mesh``, ``retrofit``, and those a subclass adds."""
    types = field_types(cls)
    return {
        f.name: types[f.name]
        for f in dataclasses.fields(cls)
        if dataclasses.is_dataclass(types[f.name])
    }


SECTIONS = sections(ExperimentConfig)

# the allowed values of keys whose sections check them by hand (python train.py --help lists
# them beside those declared with the fields: :func:`choices`)
SECTION_CHOICES: dict[str, tuple[str, ...]] = {
    "model.rope_scaling": ROPE_SCALINGS,
    "retrofit.ramp": RAMPS,
    "retrofit.second": SECONDS,
    "retrofit.lambda_proj": LAMBDA_PROJ,
}


def _leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, type, dataclasses.Field]]:
    """``(key, the dataclass that holds it, its field)`` of every settable key under the config
    class ``cls``, a section's own sections included (``data.needle.num_needles``)."""
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(types[f.name]):
            yield from _leaves(types[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", cls, f


def choices(cls: type = ExperimentConfig) -> dict[str, tuple[str, ...]]:
    """The allowed values of every key of ``cls`` with a fixed set: those declared with the
    fields (:func:`diffjax.config.declared`), then the sections' own."""
    out = {}
    for key, owner, f in _leaves(cls):
        allowed = allowed_values(owner).get(f.name)
        if allowed is not None and allowed.choices is not None:
            out[key] = allowed.choices
    return {**out, **SECTION_CHOICES}


CHOICES = choices(ExperimentConfig)


# ---------------------------------------------------------------------------- keys and overrides
def config_keys(config: ExperimentConfig | None = None) -> list[tuple[str, str, Any]]:
    """Every settable key of ``config`` (default: a default :class:`ExperimentConfig`) as
    ``(key, type, current value)``, section by section (a section's sections together)."""
    config = config or ExperimentConfig()
    return [
        (key, str(f.type), functools.reduce(getattr, key.split("."), config))
        for key, _, f in _leaves(type(config))
    ]


def key_descriptions(cls: type = ExperimentConfig) -> dict[str, str]:
    """``{key: one line}`` for every settable key of ``cls``: the first sentence of the comment
    beside or above its dataclass field, and its allowed values where it has a fixed set
    (:func:`choices`). ``python train.py --help`` prints them."""
    fixed = choices(cls)
    out = {}
    for key, owner, f in _leaves(cls):
        text = summary(field_comments(owner).get(f.name, ""))
        if key in fixed:
            values = "one of " + ", ".join(map(repr, fixed[key]))
            text = f"{text}; {values}" if text else values
        out[key] = text
    return out


def experiment_keys_help(config: ExperimentConfig | None = None) -> str:
    """Every key of ``config`` (default: :func:`default_config`) with its type, its value there
    and its one-line description: ``python train.py --help`` ends with it."""
    config = config or default_config()
    lines = ["config keys (set as key=value; defaults of the built-in default comparison):"]
    descriptions = key_descriptions(type(config))
    for key, type_str, value in config_keys(config):
        lines.append(f"  {key:<33} {type_str:<24} default: {value!r}")
        if descriptions.get(key):
            lines.append(f"      {descriptions[key]}")
    return "\n".join(lines)


def apply_overrides(config: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    """Apply ``["section.field=value", ...]`` to ``config`` (any :class:`ExperimentConfig`,
    its subclasses' sections included; ``data.needle.num_needles=4`` for a section's own
    section); each section is validated once all its changes are applied. A key the config's
    class lists in ``MOVED`` is refused with what replaced it."""
    leaves = {key: f for key, owner, f in _leaves(type(config))}
    types = {key: field_types(owner)[f.name] for key, owner, f in _leaves(type(config))}
    changes: dict[str, Any] = {}
    components: list[tuple[str, str, Any]] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not key=value. Fix: write it like "
                f"train.steps=200 (see --help for every key)."
            )
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in config.MOVED:
            raise ConfigError(f"the key {key!r} has moved. Fix: {config.MOVED[key]}.")
        if key not in leaves and key.startswith(COMPONENT_KEY):
            components.append(_component_change(key, raw))
            continue
        if key not in leaves:
            close = difflib.get_close_matches(key, list(leaves), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"unknown config key {key!r}. Fix: {hint}run train.py --help for the list of keys."
            )
        tp = types[key]
        try:
            value = convert(tp, raw, text=True)
        except ConfigError:  # a nested config's own check (a mixture component's)
            raise
        except ValueError as e:
            raise ConfigError(
                f"{key}: bad value {raw!r}: {e}. Fix: give {describe_type(tp)}."
            ) from None
        *path, name = key.split(".")
        functools.reduce(lambda d, p: d.setdefault(p, {}), path, changes)[name] = value
    if components:  # data.mixture.NAME.FIELD=VALUE, applied to the components given or set here
        mixture = changes.setdefault("data", {}).setdefault("mixture", {})
        given = mixture.get("components", config.data.mixture.components)
        mixture["components"] = _set_components(given, components)
    return _replaced(config, changes)


def _replaced(obj: Any, changes: dict[str, Any]) -> Any:
    """``obj`` with ``changes`` applied, a nested dict per section (each section rebuilt, so
    validated, once)."""
    return dataclasses.replace(
        obj,
        **{
            k: _replaced(getattr(obj, k), v) if isinstance(v, dict) else v
            for k, v in changes.items()
        },
    )


COMPONENT_KEY = "data.mixture."


def _component_change(key: str, raw: str) -> tuple[str, str, Any]:
    """``(name, field, value)`` of a ``data.mixture.NAME.FIELD=VALUE`` override."""
    name, _, field = key[len(COMPONENT_KEY) :].rpartition(".")
    types = field_types(MixtureComponent)
    if not name or field not in types or field == "name":
        fields = ", ".join(f for f in types if f != "name")
        raise ConfigError(
            f"{key}: not a component setting. Fix: write data.mixture.NAME.FIELD=VALUE with "
            f"FIELD one of {fields} (e.g. data.mixture.web.weight=0.5)."
        )
    try:
        return name, field, convert(types[field], raw, text=True)
    except ValueError as e:
        raise ConfigError(
            f"{key}: bad value {raw!r}: {e}. Fix: give {describe_type(types[field])}."
        ) from None


def _set_components(mixture, changes: list[tuple[str, str, Any]]):
    """``mixture`` with each ``(name, field, value)`` applied to the component ``name``."""
    by_name = {c.name: c for c in mixture}
    for name, field, value in changes:
        if name not in by_name:
            names = ", ".join(by_name) or "none"
            raise ConfigError(
                f"data.mixture.{name}.{field}: the mixture has no component {name!r} (its "
                f"components: {names}). Fix: name one of them, or add it: data.mixture.components="
                f"{','.join([*map(str, mixture), name + ':WEIGHT:PATH'])}."
            )
        by_name[name] = dataclasses.replace(by_name[name], **{field: value})
    return tuple(by_name.values())


def load_config(path: str | None) -> ExperimentConfig:
    """``get_config()`` of a Python config file (an :class:`ExperimentConfig`, or a subclass of
    it such as the experiment layer's comparison), or :func:`default_config` when ``path`` is
    None."""
    if path is None:
        return default_config()
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path!r} does not exist. Fix: pass a file such as configs/default.py."
        )
    spec = importlib.util.spec_from_file_location("_diffjax_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(
            f"config file {path!r} has no get_config(). Fix: define "
            f"get_config() returning diffjax.train.ExperimentConfig."
        )
    try:
        config = module.get_config()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(config, ExperimentConfig):
        raise ConfigError(
            f"{path}: get_config() returned {type(config).__name__}. Fix: return "
            f"a diffjax.train.ExperimentConfig."
        )
    return config


def default_config() -> ExperimentConfig:
    """The default experiment, one model's training: a small DIFF V1 model on the built-in
    corpus (the standard library's sources), sized so that the default comparison
    (:func:`diffjax.compare.default_comparison`: it and its twin, two seeds each, quick
    evaluation included) finishes in about seven minutes on 2 CPU cores (an estimate)."""
    return ExperimentConfig(
        run=RunConfig(name="default"),
        model=ModelConfig(
            vocab_size=259,
            d_model=128,
            num_layers=4,
            num_heads=2,
            attention="diff_v1",
            max_seq_len=256,
        ),
        data=DataConfig(source="stdlib", seq_len=128),
        train=TrainConfig(
            steps=200,
            batch_size=16,
            lr=2e-3,
            warmup_steps=20,
            schedule="cosine",
            min_lr_ratio=0.1,
            b2=0.95,
            weight_decay=0.1,
            eval_every=50,
            eval_batches=8,
            checkpoint_every=100,
        ),
    )
