"""The measurement of a retrofit: a standard model trained, then continued three ways on the same
tokens in the same order from the same weights: unconverted, converted to DIFF V2 and converted
to DIFF V1 (``python -m diffjax.retrofit_study --config configs/retrofit_cpu.py
[study.<field>=value ...] [key=value ...]``).

A config file declares the study as a module-level ``RETROFIT`` (a :class:`RetrofitStudy`)
beside its ``get_config()``, whose experiment is the source's, one model's training (a
:class:`diffjax.train.ExperimentConfig`): a standard model (``model.attention=standard``), its
data and recipe::

    RETROFIT = RetrofitStudy(
        source_steps=600,
        continue_steps=400,
        arms={"v2": ["model.attention=diff_v2"], "v1": ["model.attention=diff_v1"]},
        continuation=["train.lr=1e-3", "retrofit.warmup_steps=100"],
        seeds=3,
    )

``python -m diffjax.retrofit_study`` (:mod:`diffjax.retrofit_study`) runs it (``train.py``
refuses the file, naming that command: :mod:`diffjax.compare.studies`); ``study.<field>=value``
overrides its scalar fields. For each init seed ``s`` of ``train.seed .. train.seed + seeds - 1``:

- ``RUN_DIR/source/seed_<s>``: the source, ``source_steps`` from init seed ``s`` on the config's
  data order (``data.seed``), plus the ``source`` overrides. With ``train.init_from=PATH`` on the
  command line no source is trained: every seed starts from PATH (the folder then holds only
  the source's probes).
- ``RUN_DIR/<baseline>/seed_<s>`` (``standard``): the source continued unconverted
  (``train.init_from`` = the source's folder, its best checkpoint), ``continue_steps`` with the
  ``continuation`` overrides.
- ``RUN_DIR/<arm>/seed_<s>`` per converted arm: the same with ``train.retrofit=true`` and the
  arm's overrides (its ``model.attention``, ``retrofit.*``).

Every continuation of a seed reads the same batches in the same order: ``data.seed`` =
``continue_data_seed`` (None: the config's ``data.seed + 1``, so the continuation sees batches
in another order than the source did). With an external source the seeds would otherwise
differ only in the fresh parts of a conversion, so seed index ``i`` continues on
``continue_data_seed + i``. The validation batches are the config's (the validation order
does not depend on ``data.seed`` for the corpora).

Resumable: a finished run (its ``study_done.json`` written with the same overrides) is skipped;
an unfinished one resumes from its checkpoint (the train loop's own resume). SIGTERM or SIGINT
stops the run in training at the next step, saved (exit status 75); the same
command resumes. Each run's output goes to its ``train.log``; the terminal gets a line per run.

After each run its models are probed on a loaded model (``study_done.json``'s ``probes``): the
source's validation loss on the continuation's validation batches (the level a continuation
has to recover), and retrieval (a needle probe and an MQAR probe, byte-level data only) of the
source and of every continuation's final model. The report (``retrofit.md``, ``retrofit.png``)
is :mod:`diffjax.compare.retrofit_report`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Mapping

import numpy as np

from diffjax import data as data_lib
from diffjax.infra import sharding, storage
from diffjax.config import ConfigError, apply_scoped, split_scoped
from diffjax.data.synthetic import query_chance
from diffjax.evaluate.probe import losses_and_predictions
from diffjax.evaluate.inputs import task_examples
from diffjax.evaluate.retrieval import multi_needle_retrieval
from diffjax.interop.conversion import retrofit_config
from diffjax.train.checkpoint import (
    load_model,
    load_pretrained,
    read_checkpoint,
    resolve_init_from,
)
from diffjax.train.config import ExperimentConfig, apply_overrides, load_config
from diffjax.train.loop import AfterStep, train_model
from diffjax.train.setup import check_run
from diffjax.train.metrics import read_metrics

from diffjax.compare.retrofit_report import DONE_FILE, PLAN_FILE, RUN_CONFIG, write_study_report
from diffjax.compare import studies
from diffjax.compare.runner import Run, run_log, run_plan
from diffjax.compare.config import Comparison

SOURCE = "source"  # the source's folder name
# the keys the study sets for every run (each has its own field of RetrofitStudy)
RESERVED = {
    "run.dir": "set it on the command line: the study's folder",
    "train.init_from": "the study sets it (a continuation starts from its seed's source); an "
    "external source goes on the command line",
    "train.retrofit": "the study sets it for every converted arm",
    "train.seed": "the seeds are RetrofitStudy.seeds from the config's train.seed",
    "compare.seeds": "set RetrofitStudy.seeds (study.seeds=N)",
    "train.steps": "set RetrofitStudy.source_steps or continue_steps",
    "compare.twins": "every run of the study trains one model",
    "data.seed": "set RetrofitStudy.continue_data_seed (the source keeps the config's)",
}
# the fields a command line may set as study.<field>=value
SCALAR_FIELDS = (
    "source_steps",
    "continue_steps",
    "seeds",
    "continue_data_seed",
    "retrieval",
    "probe_examples",
)
# the probes of each model (byte-level data): the needle task with one query, the most needles
# of NEEDLES that fit the context; MQAR with MQAR_PAIRS pairs and MQAR_QUERIES queries
NEEDLES = (4, 3, 2, 1)
MQAR_PAIRS, MQAR_QUERIES = 8, 4


def _fail(field: str, problem: str, fix: str):
    raise ConfigError(f"RETROFIT.{field}: {problem}. Fix: {fix}.")


def _check_items(field: str, name: str, items: Any) -> tuple[str, ...]:
    where = f"{name!r}: " if name else ""
    if isinstance(items, str) or not all(isinstance(o, str) and "=" in o for o in items):
        _fail(
            field,
            f"{where}{items!r} is not a list of key=value strings",
            "give e.g. ['train.lr=1e-3']",
        )
    for o in items:
        key = o.split("=", 1)[0].strip()
        if key in RESERVED:
            _fail(field, f"{where}{key} is set by the study", RESERVED[key])
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class RetrofitStudy:
    """A retrofit study (see the module); checked at construction."""

    source_steps: int  # the source's train steps (unused with an external train.init_from)
    continue_steps: int  # every continuation's train steps
    # the converted arms: {name: [key=value, ...]}, each naming its DIFF kind (model.attention)
    # and any retrofit.* setting; the study adds train.retrofit=true
    arms: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: {
            "v2": ("model.attention=diff_v2",),
            "v1": ("model.attention=diff_v1",),
        }
    )
    seeds: int = 3  # init seeds train.seed .. train.seed + seeds - 1 (a source each)
    baseline: str = "standard"  # the folder of the unconverted continuation
    source: tuple[str, ...] = ()  # overrides of the source alone
    continuation: tuple[str, ...] = ()  # overrides of every continuation (lr, warmup, evals)
    # the continuations' data.seed (None: the config's data.seed + 1: fresh batches)
    continue_data_seed: int | None = None
    retrieval: bool = True  # probe each model's retrieval (needle, MQAR) after its run
    probe_examples: int = 64  # examples of each retrieval probe

    def __post_init__(self):
        for name in ("source_steps", "continue_steps", "seeds", "probe_examples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, f"got {value!r}", "give a positive integer")
        if self.continue_data_seed is not None and not (
            isinstance(self.continue_data_seed, int) and 0 <= self.continue_data_seed < 2**32
        ):
            _fail(
                "continue_data_seed",
                f"got {self.continue_data_seed!r}",
                "give a non-negative 32-bit seed, or None for the config's data.seed + 1",
            )
        if not isinstance(self.retrieval, bool):
            _fail("retrieval", f"got {self.retrieval!r}", "give True or False")
        if not (isinstance(self.baseline, str) and self.baseline.isidentifier()):
            _fail("baseline", f"got {self.baseline!r}", "use a plain name such as 'standard'")
        if self.baseline == SOURCE:
            _fail("baseline", f"{SOURCE!r} is the source's folder", "use e.g. 'standard'")
        if not isinstance(self.arms, Mapping) or not self.arms:
            _fail(
                "arms",
                f"got {self.arms!r}",
                "give at least one converted arm, e.g. {'v2': ['model.attention=diff_v2']}",
            )
        arms = {}
        for name, items in self.arms.items():
            if not (isinstance(name, str) and name.isidentifier()):
                _fail("arms", f"name {name!r}", "use a plain name such as 'v2' (a folder name)")
            if name in (SOURCE, self.baseline):
                _fail(
                    "arms", f"name {name!r} is the source's or the baseline's folder", "rename it"
                )
            items = _check_items("arms", name, items)
            kinds = [
                o.split("=", 1)[1].strip()
                for o in items
                if o.split("=", 1)[0].strip() == "model.attention"
            ]
            if not kinds or kinds[-1] not in ("diff_v1", "diff_v2"):
                _fail(
                    "arms",
                    f"{name!r} names no DIFF kind (model.attention={kinds[-1] if kinds else 'unset'})",
                    "add 'model.attention=diff_v2' or 'model.attention=diff_v1' to the arm",
                )
            arms[name] = items
        object.__setattr__(self, "arms", arms)
        object.__setattr__(self, "source", _check_items("source", "", self.source))
        continuation = _check_items("continuation", "", self.continuation)
        object.__setattr__(self, "continuation", continuation)

    @classmethod
    def of(cls, value: Any) -> "RetrofitStudy":
        """A :class:`RetrofitStudy` from a config file's ``RETROFIT`` (one, or a dict of its
        fields)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                _fail(unknown[0], "unknown field", f"use only {', '.join(sorted(known))}")
            for name in ("source_steps", "continue_steps"):
                if name not in value:
                    _fail(name, "missing", "give the source's and the continuation's train steps")
            return cls(**value)
        raise ConfigError(
            f"RETROFIT is a {type(value).__name__}. Fix: set RETROFIT to a "
            f"diffjax.compare.RetrofitStudy(source_steps=..., continue_steps=...)."
        )


def load_study(path: str | None) -> RetrofitStudy | None:
    """The ``RETROFIT`` of the config file at ``path``, or None when it declares none."""
    name, value = studies.declared(path)
    if name != "RETROFIT":
        return None
    try:
        return RetrofitStudy.of(value)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def apply_study_overrides(study: RetrofitStudy, overrides: list[str]) -> RetrofitStudy:
    """``study`` with ``["study.seeds=2", ...]`` applied (:data:`SCALAR_FIELDS`)."""
    return apply_scoped(
        study, "study", SCALAR_FIELDS, overrides, "the arms are set in the config file"
    )


# ---------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One run of the study: the source of a seed, or one of its continuations."""

    name: str  # "source/seed_0", "v2/seed_1"
    arm: str  # "source", the baseline's name or a converted arm's
    role: str  # "source", "baseline" or "converted"
    seed: int
    directory: str
    overrides: tuple[str, ...]  # on get_config()'s experiment
    source: str  # where the model starts: the source's folder (a continuation), or ""
    external: bool = False  # a source not trained here (the command line's train.init_from)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StudyPlan:
    config: str
    run_dir: str
    study: RetrofitStudy
    base: ExperimentConfig  # the config with the command line's overrides: the source's
    runs: tuple[StudyRun, ...]

    def continuation_of(self, source: StudyRun) -> StudyRun:
        """The baseline continuation of ``source``'s seed."""
        return next(r for r in self.runs if r.role == "baseline" and r.seed == source.seed)


def _keys(items) -> set[str]:
    return {o.split("=", 1)[0].strip() for o in items}


def plan_study(config: str, study: RetrofitStudy, overrides: list[str]) -> StudyPlan:
    """Every run of the study, in order (seed by seed: the source, the baseline, the arms),
    each one's config checked (a bad arm stops here, before anything trains)."""
    for key in ("compare.seeds", "compare.twins", "train.steps", "data.seed", "train.retrofit"):
        if key in _keys(overrides):
            raise ConfigError(f"{key} is set by the retrofit study. Fix: {RESERVED[key]}.")
    loaded = one_model(config)
    user = [*overrides]
    if "train.progress" not in _keys(overrides):
        user.append("train.progress=false")
    base = apply_overrides(loaded, user)
    external = base.train.init_from
    if external is None and base.model.attention != "standard":
        raise ConfigError(
            f"the retrofit study trains a standard source, but the config's model.attention is "
            f"{base.model.attention!r}. Fix: set model.attention=standard in get_config() (an "
            f"even number of heads of width d_model / num_heads, for DIFF V1)."
        )
    source_model = resolve_init_from(base).model
    run_dir = base.run.path
    seed0 = base.train.seed
    data_seed = base.data.seed + 1 if study.continue_data_seed is None else study.continue_data_seed
    if external is None and data_seed == base.data.seed:
        raise ConfigError(
            f"RETROFIT.continue_data_seed is the source's data.seed ({data_seed}): the "
            f"continuations would read the source's batches again in the same order. Fix: give "
            f"another seed, or None (data.seed + 1)."
        )
    runs = []
    for i in range(study.seeds):
        seed = seed0 + i
        src_dir = storage.join(run_dir, SOURCE, f"seed_{seed}")
        src = [
            *user,
            *study.source,
            f"train.steps={study.source_steps}",
            f"train.seed={seed}",
        ]
        runs.append(
            StudyRun(
                f"{SOURCE}/seed_{seed}",
                SOURCE,
                "source",
                seed,
                src_dir,
                tuple(src),
                external or "",
                external=external is not None,
            )
        )
        start = external or src_dir
        common = [
            *user,
            *study.continuation,
            f"train.steps={study.continue_steps}",
            f"train.seed={seed}",
            f"data.seed={data_seed + (i if external else 0)}",
            f"train.init_from={start}",
        ]
        arms = {study.baseline: ("baseline", [])}
        arms.update({a: ("converted", [*o, "train.retrofit=true"]) for a, o in study.arms.items()})
        for arm, (role, own) in arms.items():
            runs.append(
                StudyRun(
                    f"{arm}/seed_{seed}",
                    arm,
                    role,
                    seed,
                    storage.join(run_dir, arm, f"seed_{seed}"),
                    tuple([*common, *own]),
                    start,
                )
            )
    plan = StudyPlan(config, run_dir, study, base, tuple(runs))
    for run in plan.runs:
        _check_run_config(plan, run, loaded, source_model)
    return plan


def _check_run_config(plan: StudyPlan, run: StudyRun, loaded, source_model) -> None:
    """The run's config is valid and, for a converted arm, the source can become its DIFF kind
    (before the source exists: the continuation's init_from is left out here)."""
    items = [o for o in run.overrides if _keys([o]) & {"train.init_from", "train.retrofit"}]
    rest = [o for o in run.overrides if o not in items]
    try:
        if run.external:
            return
        exp = apply_overrides(loaded, rest)
        if run.role == "converted":
            retrofit_config(
                source_model,
                exp.model.attention,
                lambda_init=exp.model.lambda_init,
                diff_norm=exp.model.diff_norm,
            )
    except ConfigError as e:
        raise ConfigError(f"{run.name}: {e}") from None


def run_config(plan: StudyPlan, run: StudyRun) -> ExperimentConfig:
    """The run's experiment (a continuation's model config from its source's checkpoint)."""
    return resolve_init_from(apply_overrides(one_model(plan.config), list(run.overrides)))


def one_model(config: str) -> ExperimentConfig:
    """The config file's experiment as one model's training: every run of the study trains one
    model, so a comparison's settings (its twins, its seeds) do not apply."""
    loaded = load_config(config)
    return loaded.experiment() if isinstance(loaded, Comparison) else loaded


# ---------------------------------------------------------------------------- the probes
def validation_loss(model, exp: ExperimentConfig) -> float:
    """``model``'s loss on the validation batches a run of ``exp`` evaluates on (its first
    ``train.eval_batches`` batches of ``train.batch_size``), token-weighted as the train loop's
    evaluation."""
    batches = data_lib.make_dataset(exp.data, "validation", batch_size=exp.train.batch_size)
    total = weight = 0.0
    for b in itertools.islice(iter(batches), exp.train.eval_batches):
        losses, _ = losses_and_predictions(model, b, exp.train.batch_size)
        w = np.asarray(b["weights"], np.float64)
        total, weight = total + float((losses * w).sum()), weight + float(w.sum())
    return total / max(weight, 1.0)


def retrieval_probes(model, data: data_lib.DataConfig, examples: int) -> dict[str, Any]:
    """Needle and MQAR accuracy of ``model`` at the data's context (byte-level data only; the
    reason in ``skipped`` otherwise): each query right when its whole answer is the greedy
    prediction, with the no-retrieval chance of the first query (:func:`query_chance`)."""
    if not data.uses_byte_tokenizer or model.config.vocab_size < 256:
        return {"skipped": "the probes are byte-level and the model's tokens are not bytes"}
    seq_len = min(data.seq_len, model.config.max_seq_len)
    out: dict[str, Any] = {}
    for n in NEEDLES:
        try:
            grid = multi_needle_retrieval(
                model,
                lengths=[seq_len],
                num_needles=n,
                num_queries=1,
                data=data,
                num_examples=examples,
                num_depth_bins=1,
            )
        except ConfigError:
            continue
        cfg = data_lib.DataConfig(
            source="needle",
            seq_len=seq_len,
            needle=data_lib.NeedleData(num_needles=n, num_queries=1),
        )
        out["needle"] = {
            "accuracy": grid.overall(),
            "queries": int(grid.total.sum()),
            "needles": n,
            "seq_len": seq_len,
            "chance": query_chance(cfg)["no_retrieval_first"],
        }
        break
    else:
        out["needle_skipped"] = f"no needle fits a {seq_len}-token context"
    try:
        cfg = data_lib.DataConfig(
            source="mqar",
            seq_len=seq_len,
            mqar=data_lib.MqarData(num_pairs=MQAR_PAIRS, num_queries=MQAR_QUERIES),
            synthetic=data_lib.SyntheticData(num_val_examples=examples),
        )
    except ConfigError:
        return out
    batch = task_examples(cfg)
    preds = losses_and_predictions(model, batch, 8)[1]
    correct, has = data_lib.query_correct(preds, batch)
    chance = query_chance(cfg)
    out["mqar"] = {
        "accuracy": float(correct.sum() / max(has.sum(), 1)),
        "first_accuracy": float(correct[:, 0].sum() / max(has[:, 0].sum(), 1)),
        "queries": int(has.sum()),
        "pairs": MQAR_PAIRS,
        "asked": MQAR_QUERIES,
        "seq_len": seq_len,
        "chance": chance["no_retrieval"],
        "chance_first": chance["no_retrieval_first"],
    }
    return out


def _source_val_loss(directory: str) -> tuple[int, float | None]:
    """The step of the source's best checkpoint (where its continuations start) and the
    validation loss its own evaluation recorded there."""
    _, step, _, _ = read_checkpoint(directory, "best")
    records = read_metrics(storage.join(directory, "metrics.jsonl"))
    losses = [r["val_loss"] for r in records if r.get("step") == step and "val_loss" in r]
    return step, (losses[-1] if losses else None)


def probe_run(plan: StudyPlan, run: StudyRun, exp: ExperimentConfig) -> dict[str, Any]:
    """The probes of a finished run (see the module)."""
    probes: dict[str, Any] = {}
    if run.role == "source":
        if run.external:
            model = load_pretrained(run.source)
        else:
            model = load_model(run.directory, "best")
            step, own = _source_val_loss(run.directory)
            probes.update(start_step=step, own_val_loss=own)
        # the level a continuation recovers: on the continuation's validation batches
        probes["val_loss"] = validation_loss(model, run_config(plan, plan.continuation_of(run)))
    else:
        model = load_model(run.directory, "latest")
    if plan.study.retrieval:
        probes["retrieval"] = retrieval_probes(model, exp.data, plan.study.probe_examples)
    return probes


# ---------------------------------------------------------------------------- the driver
def _run_one(plan: StudyPlan, run: StudyRun, mesh, after_step: AfterStep | None) -> dict:
    """Train (and probe) one run, its output appended to its ``train.log``; what its marker
    records."""
    start = time.time()
    with run_log(run.directory, after_step) as step:
        exp = run_config(plan, run)
        storage.write_json(storage.join(run.directory, RUN_CONFIG), exp.to_dict(), default=str)
        result = None
        if not (run.role == "source" and run.external):
            check_run(exp, mesh)
            print(f"\n== {run.name}: {exp.model.attention}, from {run.source or 'scratch'}")
            result = train_model(exp, exp.model, run.arm, run.directory, mesh=mesh, after_step=step)
        trained = time.time() - start
        probes = probe_run(plan, run, exp)
        print(f"probes: {probes}")
    return {
        "train_s": trained,
        "probe_s": time.time() - start - trained,
        "resumed_from": None if result is None else result.resumed_from,
        "params": None if result is None else result.params,
        "attention": exp.model.attention,
        "probes": probes,
    }


def write_plan(plan: StudyPlan) -> None:
    """``RUN_DIR/retrofit_plan.json`` (the study and its runs, for the report) and
    ``RUN_DIR/config.json`` (the source's experiment)."""
    storage.makedirs(plan.run_dir)
    content = {
        "config": plan.config,
        "study": dataclasses.asdict(plan.study),
        "runs": [r.to_dict() for r in plan.runs],
    }
    storage.write_json(storage.join(plan.run_dir, PLAN_FILE), content)
    storage.write_json(storage.join(plan.run_dir, "config.json"), plan.base.to_dict(), default=str)


def run_study(
    config: str,
    study: RetrofitStudy,
    overrides: list[str],
    *,
    after_step: AfterStep | None = None,
    say: Callable[[str], None] = print,
) -> str:
    """Plan, train and probe every unfinished run, then write the report; returns its text.
    Raises ``ConfigError`` (a bad declaration, config or data; before anything trains),
    :class:`Preempted` (stopped and saved: the same call resumes) and what the train loop
    raises."""
    mine, overrides = split_scoped(overrides, "study")
    study = apply_study_overrides(study, mine)
    plan = plan_study(config, study, overrides)
    storage.check_access(plan.run_dir, what="run.dir", write=True)
    data_lib.check_data(plan.base.data, plan.base.model.vocab_size)
    mesh = sharding.make_mesh(plan.base.mesh)
    write_plan(plan)
    kind = (
        "an external source" if plan.base.train.init_from else f"{study.source_steps}-step sources"
    )
    say(
        f"retrofit study: {study.seeds} seeds x ({kind}, then {1 + len(study.arms)} "
        f"continuations of {study.continue_steps} steps: {study.baseline}, "
        f"{', '.join(study.arms)}) into {plan.run_dir}"
    )
    by_name = {r.name: r for r in plan.runs}
    run_plan(
        [Run(r.name, r.directory, r.overrides) for r in plan.runs],
        lambda run: _run_one(plan, by_name[run.name], mesh, after_step),
        run_dir=plan.run_dir,
        done_file=DONE_FILE,
        describe=lambda run: "probing" if by_name[run.name].external else "training",
        say=say,
    )
    return write_study_report(plan.run_dir)


def summary(text: str) -> str:
    """The ``## Summary`` section of ``retrofit.md``."""
    body = text.split("\n## Summary\n", 1)[-1]
    return body.split("\n## ", 1)[0].strip()
