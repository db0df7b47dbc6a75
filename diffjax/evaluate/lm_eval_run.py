"""lm-eval tasks on every model of a ``train.py`` run (DIFF and its twin, each seed):
``python -m diffjax.evaluate RUN_DIR lm_eval.tasks=t1,t2``.

:func:`evaluate_run_tasks` finds the models with :func:`.run.discover_models`, runs
``lm_eval.simple_evaluate`` on each (the best checkpoint, through
:class:`diffjax.lm_eval.DiffJaxLM`), writes ``RUN_DIR/lm_eval.json`` and puts its section
(:mod:`.lm_tasks`) into ``RUN_DIR/eval.md``: appended, or in place of the section an earlier call
wrote. lm-eval is the ``eval`` extra: without it :data:`AVAILABLE` is False and the functions
raise a :class:`ConfigError` that says how to install it; the analyses never need it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from diffjax.infra import storage
from diffjax.config import ConfigError, check_fields, fail

from diffjax.evaluate.lm_tasks import (
    HEADING,
    PAPER_SCALE,
    PAPER_TASKS,
    higher_is_better,
    main_metrics,
    render_section,
    replace_section,
)
from diffjax.evaluate.results import kind_entry
from diffjax.evaluate.run import ModelEntry, discover_models, relative_path

try:  # the `eval` extra
    import lm_eval
    from lm_eval.tasks import TaskManager

    from diffjax.lm_eval.model import DEFAULT_BATCH_SIZE, DiffJaxLM
except ImportError as e:  # pragma: no cover - the test extra installs lm-eval
    AVAILABLE, _MISSING = False, e
    DEFAULT_BATCH_SIZE = 16
else:
    AVAILABLE, _MISSING = True, None

__all__ = [
    "AVAILABLE",
    "LmEvalSettings",
    "check_tasks",
    "evaluate_run_tasks",
    "prepare",
    "run_models",
]


@dataclasses.dataclass(frozen=True)
class LmEvalSettings:
    """lm-eval tasks on every model of a run (``lm_eval.*``; the `eval` extra); checked at
    construction."""

    # lm-eval task names (globs allowed), comma-separated. Empty: no lm-eval task
    tasks: tuple[str, ...] = ()
    # only the lm-eval tasks: eval.md keeps its analyses, its lm-eval section is replaced
    only: bool = False
    include_path: str | None = None  # a folder of task YAML files, besides lm-eval's own
    # also lm-eval's own tasks (false: only those of include_path, which skips indexing
    # lm-eval's ~15,000 task files)
    default_tasks: bool = True
    # at most this many examples per task (below 1: that fraction). None: every example
    limit: float | None = None
    batch_size: str = str(DEFAULT_BATCH_SIZE)  # rows per batch (lm-eval's batch_size)
    num_fewshot: int | None = None  # shots (None: each task's own)

    def __post_init__(self):
        check_fields(self)
        c = "LmEvalSettings"
        if self.limit is not None and not self.limit > 0:
            fail(c, "limit", f"must be > 0, got {self.limit:g}", "e.g. lm_eval.limit=100 or 0.1")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            fail(c, "num_fewshot", f"must be >= 0, got {self.num_fewshot}", "e.g. 0 or 5")
        if self.only and not self.tasks:
            fail(c, "only", "runs no task", "add lm_eval.tasks=t1,t2")
        if not self.default_tasks and not self.include_path and self.tasks:
            fail(
                c,
                "default_tasks",
                "is false but lm_eval.include_path is not set (no task would be known)",
                "pass lm_eval.include_path=DIR, or drop lm_eval.default_tasks=false",
            )

    @property
    def example_limit(self) -> int | float | None:
        """``limit`` as lm-eval takes it: a count (an int) from 1 up, else a fraction."""
        if self.limit is not None and self.limit >= 1 and self.limit == int(self.limit):
            return int(self.limit)
        return self.limit


def _require() -> None:
    if not AVAILABLE:
        raise ConfigError(
            f"lm-eval tasks need lm-evaluation-harness ({_MISSING}). Fix: pip install -e "
            f'".[eval]" (or pip install "lm-eval>=0.4.5,<0.5"), or leave out lm_eval.tasks'
        )


# ---------------------------------------------------------------------------- input checks
def run_models(run_dir: str) -> list[ModelEntry]:
    """The models of ``run_dir`` (local or ``gs://``; :func:`discover_models`, the default seed
    from its ``config.json``), or a :class:`ConfigError` when it holds none."""
    run_dir = str(storage.absolute(run_dir))
    if not storage.isdir(run_dir):
        raise ConfigError(
            f"run directory {run_dir} does not exist. Fix: pass the folder train.py wrote "
            f"(e.g. runs/default)"
        )
    seed = 0
    cfg_file = storage.join(run_dir, "config.json")
    if storage.exists(cfg_file):
        cfg = storage.read_json(cfg_file)
        seed = int(cfg.get("train", {}).get("seed", 0)) if isinstance(cfg, dict) else 0
    entries = discover_models(run_dir, default_seed=seed)
    if not entries:
        raise ConfigError(
            f"{run_dir} holds no model with a committed checkpoint (looked for "
            f"*/checkpoints/<step>). Fix: train first (python train.py), or pass the run's "
            f"own folder"
        )
    return entries


def check_tasks(tasks: Sequence[str], manager: TaskManager) -> list[str]:
    """The task names (globs allowed, as lm-eval's command line takes them), or a
    :class:`ConfigError` naming those lm-eval does not know."""
    _require()
    tasks = [t.strip() for t in tasks if t and t.strip()]
    if not tasks:
        raise ConfigError("no lm-eval task given. Fix: lm_eval.tasks=t1,t2 (lm-eval task names)")
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise ConfigError(
            f"unknown lm-eval task(s): {', '.join(missing)}. Fix: check the names "
            f"(python -m diffjax.lm_eval ls tasks lists them), or pass lm_eval.include_path="
            f"DIR with the folder of your task YAML files"
        )
    return tasks


def prepare(
    run_dir: str,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    include_defaults: bool = True,
) -> tuple[list[ModelEntry], TaskManager, list[str]]:
    """The run's models, the task manager and the checked task names: every input check of
    :func:`evaluate_run_tasks`, before any model is loaded (lm-eval missing, no model in the
    run, an unknown task: :class:`ConfigError`)."""
    _require()
    if not include_defaults and not include_path:
        raise ConfigError(
            "only the tasks of an include path were asked for, but none is given (no task "
            "would be known). Fix: pass lm_eval.include_path=DIR, or drop "
            "lm_eval.default_tasks=false"
        )
    entries = run_models(run_dir)
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    return entries, manager, check_tasks(tasks, manager)


# ---------------------------------------------------------------------------- the run
def evaluate_run_tasks(
    run_dir: str,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    include_defaults: bool = True,
    limit: int | float | None = None,
    batch_size: int | str | None = DEFAULT_BATCH_SIZE,
    num_fewshot: int | None = None,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on every model of a ``train.py`` run; write
    ``RUN_DIR/lm_eval.json`` and the section ``## LM Eval Harness tasks`` of
    ``RUN_DIR/eval.md`` (appended, or in place of an earlier one); return the JSON's content.

    ``include_path``: a folder of task YAML files besides lm-eval's own (``include_defaults``
    False: only those, which skips indexing lm-eval's ~15,000 task files). ``limit``: at most
    that many examples per task (a float below 1: that fraction). Bad input (no model in the
    run, an unknown task) raises :class:`ConfigError` before any model is loaded. ``run_dir``:
    a local folder or a ``gs://`` URL."""
    run_dir = str(storage.absolute(run_dir))
    entries, manager, tasks = prepare(
        run_dir, tasks, include_path=include_path, include_defaults=include_defaults
    )
    models, hib = [], {}
    for e in entries:
        log(f"lm-eval {','.join(tasks)}: {e.label} (seed {e.seed}) from {e.path}")
        t0 = time.perf_counter()
        # the model's own folder: RUN/<label>/seed_<n>/, RUN/<label>/ or the run folder itself
        lm = DiffJaxLM(path=e.path, model=e.label, seed=e.seed, batch_size=batch_size)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
        )
        metrics = main_metrics(out)
        for task, h in higher_is_better(out).items():
            hib.setdefault(task, {}).update(h)
        models.append(
            {
                "label": e.label,
                "seed": e.seed,
                "path": relative_path(e.path, run_dir),
                **kind_entry(lm.model.config),
                "metrics": metrics,
                "n_samples": {
                    t: v.get("effective", v.get("original"))
                    for t, v in out.get("n-samples", {}).items()
                },
            }
        )
        log(
            f"    {'; '.join(f'{t} {k} {v:.4g}' for t, ms in metrics.items() for k, v in ms.items())}"
            f" ({time.perf_counter() - t0:.1f}s)"
        )
    data = {
        "lm_eval_version": getattr(lm_eval, "__version__", "?"),
        "tasks": list(tasks),
        "include_path": include_path,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "higher_is_better": hib,
        "models": models,
        "paper": {
            "scale": PAPER_SCALE,
            "tasks": [
                {"task": t, "metric": m, "transformer": v[0], "diff": v[1]}
                for (t, m), v in PAPER_TASKS.items()
            ],
        },
    }
    json_path = storage.join(run_dir, "lm_eval.json")
    storage.write_json(json_path, data)
    md_path = storage.join(run_dir, "eval.md")
    old = storage.read_text(md_path) if storage.exists(md_path) else ""
    storage.write_text(md_path, replace_section(old, "\n".join(render_section(data))))
    log(f"lm-eval: {json_path}, section {HEADING!r} of {md_path}")
    return data
