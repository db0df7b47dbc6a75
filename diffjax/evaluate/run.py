"""``python -m diffjax.evaluate RUN_DIR [--quick]``: every analysis on every model of a run.

:func:`discover_models` finds the models a ``train.py`` run wrote (``RUN_DIR/<label>/`` or
``RUN_DIR/<label>/seed_<n>/``, each holding ``checkpoints/``); :func:`evaluate_run` loads the
best checkpoint of each, runs the analyses of the registry (:mod:`.analyses`, each on a
:class:`ModelInputs`) and writes ``RUN_DIR/eval.json``, ``RUN_DIR/eval.md`` (:mod:`.report`) and
the plots ``RUN_DIR/eval_*.png`` (each analysis's own). RUN_DIR is a local folder or a
``gs://`` URL: every read and write goes through :mod:`diffjax.infra.storage`."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from diffjax import ops
from diffjax.infra import storage
from diffjax.config import ConfigError
from diffjax.data import DataConfig
from diffjax.nn.param_count import count_params
from diffjax.train.checkpoint import Checkpointer, committed_steps, load_model

from diffjax.evaluate import analyses as registry
from diffjax.evaluate import noise_floor as nf
from diffjax.evaluate.analysis import Analysis
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.report import render
from diffjax.evaluate.results import kind_entry
from diffjax.evaluate.settings import EvalSettings

__all__ = [
    "EvalSettings",
    "ModelEntry",
    "ModelInputs",
    "data_config",
    "discover_models",
    "evaluate_model",
    "evaluate_run",
    "read_run_config",
    "relative_path",
]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One trained model of a run: ``label`` (first folder under the run), ``seed``, folder."""

    label: str
    seed: int
    path: str


# ---------------------------------------------------------------------------- discovery
def _folders(run_dir: str) -> Iterator[tuple[tuple[str, ...], list[str]]]:
    """``(parts, subfolders)`` of every folder under ``run_dir`` (a local path or a ``gs://``
    URL), ``parts`` its path relative to ``run_dir``, top-down; a ``checkpoints/`` folder is
    listed, never entered."""
    if not storage.is_remote(run_dir):
        for root, dirs, _ in os.walk(run_dir):
            rel = os.path.relpath(root, run_dir)
            yield (() if rel == "." else tuple(rel.split(os.sep))), dirs
            dirs[:] = [d for d in dirs if d != "checkpoints"]
        return
    todo = [()]
    while todo:
        parts = todo.pop(0)
        here = storage.path(storage.join(run_dir, *parts))
        dirs = sorted(p.name for p in here.iterdir() if p.is_dir())
        yield parts, dirs
        todo += [(*parts, d) for d in dirs if d != "checkpoints"]


def relative_path(path: str, run_dir: str) -> str:
    """``path`` relative to ``run_dir`` (``"."`` for the folder itself), local or ``gs://``."""
    if storage.is_remote(run_dir):
        return str(storage.path(path).relative_to(storage.path(run_dir)))
    return os.path.relpath(path, run_dir)


def discover_models(run_dir: str, default_seed: int = 0) -> list[ModelEntry]:
    """Every folder under ``run_dir`` (local or ``gs://``) holding a ``checkpoints/`` folder with
    a committed step, as ``ModelEntry(label, seed, path)``: label = the first path component
    under ``run_dir`` (the run folder's own name when the checkpoints are directly in it), seed =
    ``n`` of a ``seed_<n>`` component, else ``default_seed``. Sorted by label then seed."""
    run_dir = str(storage.absolute(run_dir))
    found = []
    for parts, dirs in _folders(run_dir):
        root = storage.join(run_dir, *parts)
        if "checkpoints" in dirs and committed_steps(storage.join(root, "checkpoints")):
            label = parts[0] if parts else storage.path(run_dir).name
            seed = default_seed
            for p in parts:
                m = re.fullmatch(r"seed_(\d+)", p)
                if m:
                    seed = int(m.group(1))
            found.append(ModelEntry(label, seed, root))
    order = {"diff": 0, "standard": 1}
    return sorted(found, key=lambda e: (order.get(e.label, 2), e.label, e.seed))


def read_run_config(run_dir: str) -> dict[str, Any]:
    """``RUN_DIR/config.json`` (``ExperimentConfig.to_dict()``), local or ``gs://``."""
    path = storage.join(run_dir, "config.json")
    if not storage.exists(path):
        raise ConfigError(
            f"{run_dir} has no config.json. Fix: pass a run directory written by "
            f"train.py (e.g. runs/default)"
        )
    return storage.read_json(path)


def data_config(cfg: dict[str, Any]) -> DataConfig:
    """The run's ``DataConfig`` (:meth:`DataConfig.from_saved`: fields this version does not
    know are ignored, those the run's version did not have take their value from before)."""
    return DataConfig.from_saved(cfg.get("data", {}))


# A model's entry of eval.json holds the analyses' results in this order, the one earlier
# versions wrote (eval.md shows them in the registry's order); an analysis not named here
# follows, in the registry's order.
ENTRY_ORDER = (
    "validation",
    "positions",
    "retrieval",
    "allocation",
    "noise_measured",
    "ablation",
    "outliers",
    "quantization",
)


def _entry_order(analyses: Sequence[Analysis]) -> list[Analysis]:
    rank = {name: i for i, name in enumerate(ENTRY_ORDER)}
    return sorted(analyses, key=lambda a: rank.get(a.name, len(rank)))


def evaluate_model(
    model, data: DataConfig, settings: EvalSettings, log: Callable[[str], Any] = print
) -> dict[str, Any]:
    """Every analysis of the registry on one model: its entry of eval.json (a JSON-able dict:
    the attention kind, DIFF V1's λ per layer, each analysis's result)."""
    out: dict[str, Any] = kind_entry(model.config)
    lam = model.lambdas() if model.config.attention == "diff_v1" else None
    out["lambda"] = None if lam is None else [float(x) for x in lam]
    inputs = ModelInputs(model, data, settings)
    for analysis in _entry_order(registry.ANALYSES):
        t0 = time.perf_counter()
        result = analysis.measure(inputs)
        if result is not None:
            analysis.store(result, out)
        log(f"    {analysis.name} ({time.perf_counter() - t0:.1f}s)")
    return out


# ---------------------------------------------------------------------------- the run
def _scale(entry: ModelEntry, model, cfg: dict[str, Any]) -> dict[str, Any]:
    ckpt = Checkpointer(storage.join(entry.path, "checkpoints"), async_save=False)
    try:
        step = ckpt.best_step()
    finally:
        ckpt.close()
    t, d = cfg.get("train", {}), cfg.get("data", {})
    tokens = int(step or 0) * int(t.get("batch_size", 0)) * int(d.get("seq_len", 0))
    return {"params": count_params(model).total, "step": step, "tokens": tokens}


def evaluate_run(
    run_dir: str,
    *,
    quick: bool = False,
    log: Callable[[str], Any] = print,
    settings: EvalSettings | None = None,
    write: bool = True,
) -> str:
    """Evaluate every model of a ``train.py`` run (a local folder or a ``gs://`` URL); write
    ``eval.md``, ``eval.json`` and the plots into ``run_dir``; return the markdown. ``quick``: a small subset (one context length,
    few examples: 51 s of CPU time for the default comparison's two models). ``settings``
    overrides the quick/full choice (e.g. fewer examples or bit widths).

    Several processes (``train.py`` on many hosts) call it together: the checkpoint reads are
    collective (every process must open and restore the same checkpoints, in the same order),
    each process evaluates the models on its first local device, and only the one with
    ``write=True`` (process 0) writes the files; the others return ``""``."""
    run_dir = str(storage.absolute(run_dir))
    if not storage.isdir(run_dir):
        raise ConfigError(
            f"run directory {run_dir} does not exist. Fix: pass the folder "
            f"train.py wrote (e.g. runs/default)"
        )
    cfg = read_run_config(run_dir)
    data = data_config(cfg)
    entries = discover_models(run_dir, default_seed=int(cfg.get("train", {}).get("seed", 0)))
    if not entries:
        raise ConfigError(
            f"{run_dir} holds no model with a committed checkpoint (looked for "
            f"*/checkpoints/<step>). Fix: train first (python train.py), or pass "
            f"the run's own folder"
        )
    settings = EvalSettings.for_run(quick) if settings is None else settings
    results = []
    for e in entries:
        log(f"evaluating {e.label} (seed {e.seed}) from {e.path}")
        model = load_model(e.path, "best")
        ops.check_kernels(model.config, log=log)  # with the kernels: checked on this device first
        r = evaluate_model(model, data, settings, log)
        r.update(
            label=e.label,
            seed=e.seed,
            path=relative_path(e.path, run_dir),
            **_scale(e, model, cfg),
        )
        results.append(r)
    if not write:
        return ""
    noise = nf.noise_floor_closed_form(nf.DEFAULT_NS, nf.REPORT_MARGIN, nf.REPORT_LAMBDA)
    text = render(run_dir, data, settings, results, noise)
    storage.write_text(storage.join(run_dir, "eval.md"), text)
    storage.write_json(
        storage.join(run_dir, "eval.json"),
        {
            "quick": quick,
            "models": results,
            "noise_closed_form": {k: np.asarray(v).tolist() for k, v in noise.items()},
        },
        default=_json_default,
    )
    log(f"evaluation: {storage.join(run_dir, 'eval.md')}")
    return text


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
