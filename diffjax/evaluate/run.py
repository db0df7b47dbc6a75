"""``python -m diffjax.evaluate RUN_DIR [--quick]``: every analysis on every model of a run.

:func:`discover_models` finds the models a ``train.py`` run wrote (``RUN_DIR/<label>/`` or
``RUN_DIR/<label>/seed_<n>/``, each holding ``checkpoints/``); :func:`evaluate_run` loads the
best checkpoint of each, runs the analyses and writes ``RUN_DIR/eval.json``, ``RUN_DIR/eval.md``
(its sections: :mod:`.report`) and the plots ``RUN_DIR/eval_*.png`` (:mod:`.plots`). RUN_DIR is
a local folder or a ``gs://`` URL: every read and write goes through :mod:`diffjax.storage`."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Callable, Iterator

import numpy as np

from diffjax import ops, storage
from diffjax.config import ConfigError
from diffjax.data import DataConfig, query_kinds
from diffjax.param_count import count_params
from diffjax.train.checkpoint import Checkpointer, committed_steps, load_model

from . import ablation as abl_lib
from . import allocation as alloc_lib
from . import noise_floor as nf
from . import outliers as outl
from . import paper
from . import positions as pos
from . import quantize as quant
from . import retrieval as ret
from .probe import losses_and_predictions
from .report import render
from .settings import EvalSettings

__all__ = [
    "EvalSettings",
    "ModelEntry",
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
    """The run's ``DataConfig`` (fields this version does not know are ignored)."""
    names = {f.name for f in dataclasses.fields(DataConfig)}
    return DataConfig(**{k: v for k, v in cfg.get("data", {}).items() if k in names})


# ---------------------------------------------------------------------------- one model
def _needle_setting(data: DataConfig) -> tuple[int, int]:
    return (data.num_needles, data.num_queries) if data.source == "needle" else (1, 1)


def _replacement(data: DataConfig, n: int, r: int) -> bool:
    """The run's own needle setting keeps its query_replacement; the paper's settings ask R
    distinct needles."""
    return data.source == "needle" and data.query_replacement and (n, r) == _needle_setting(data)


def _task(data: DataConfig, seq_len: int, n: int, r: int, **kw) -> DataConfig:
    return ret.needle_task(
        data,
        seq_len=seq_len,
        num_needles=n,
        num_queries=r,
        query_replacement=_replacement(data, n, r),
        **kw,
    )


def _fits(data: DataConfig, seq_len: int, n: int, r: int) -> bool:
    try:
        _task(data, seq_len, n, r)
        return True
    except ConfigError:
        return False


def evaluate_model(
    model, data: DataConfig, settings: EvalSettings, log: Callable[[str], Any] = print
) -> dict[str, Any]:
    """Every analysis on one model; a JSON-able dict."""
    bs = settings.batch_size
    seq_len, max_len = data.seq_len, model.config.max_seq_len
    out: dict[str, Any] = {"attention": model.config.attention}
    lam = model.lambdas() if model.config.attention == "diff_v1" else None
    out["lambda"] = None if lam is None else [float(x) for x in lam]

    t0 = time.perf_counter()
    val = pos.validation_examples(data, settings.val_examples)
    losses, preds = losses_and_predictions(model, val, bs)
    out["val_loss"], out["val_ppl"] = pos.validation_loss(losses, val["weights"])
    if "answer_spans" in val:
        correct = ret.query_correct(preds, val)
        out["val_accuracy"] = float(np.mean(correct))
        if "query_needle" in val or "query_pair" in val:
            first, repeat = query_kinds(val)
            out["val_first_query_accuracy"] = float(np.mean(correct[first]))
            if repeat.any():
                out["val_repeat_query_accuracy"] = float(np.mean(correct[repeat]))
    log(f"    validation loss {out['val_loss']:.4f} ({time.perf_counter() - t0:.1f}s)")

    # 6. loss by position (long contexts: the model's max_seq_len in the full set)
    t0 = time.perf_counter()
    length = seq_len if settings.quick else max_len
    corpus = pos.corpus_for_positions(data, length)
    if corpus is not None:
        if corpus == data:
            pl, pw = losses, val["weights"]
        else:
            ex = pos.validation_examples(corpus, settings.val_examples)
            pl, pw = losses_and_predictions(model, ex, bs)[0], ex["weights"]
        ends, by_pos = pos.loss_by_position(pl, pw, settings.loss_buckets)
        out["positions"] = {
            "length": length,
            "trained_length": seq_len,
            "ends": ends.tolist(),
            "loss": by_pos.tolist(),
        }
        log(f"    loss by position at {length} ({time.perf_counter() - t0:.1f}s)")

    # 1. multi-needle retrieval
    t0 = time.perf_counter()
    n0, r0 = _needle_setting(data)
    settings_nr = [(n0, r0)]
    if not settings.quick:
        settings_nr += [s for s in paper.RETRIEVAL_SETTINGS if s != (n0, r0)]
    lengths = (
        [seq_len]
        if settings.quick
        else sorted({x for x in (seq_len // 4, seq_len // 2, seq_len, max_len) if x <= max_len})
    )
    out["retrieval"] = {}
    for n, r in settings_nr:
        ls = [x for x in lengths if _fits(data, x, n, r)]
        if not ls:
            continue
        grid = ret.multi_needle_retrieval(
            model,
            lengths=ls,
            num_needles=n,
            num_queries=r,
            data=data,
            num_examples=settings.retrieval_examples,
            num_depth_bins=settings.depth_bins,
            batch_size=bs,
            query_replacement=_replacement(data, n, r),
        )
        out["retrieval"][f"{n},{r}"] = grid.to_dict()
    log(f"    retrieval ({time.perf_counter() - t0:.1f}s)")

    # 2. attention allocation and 5. the measured noise floor
    t0 = time.perf_counter()
    if _fits(data, seq_len, n0, r0):
        batch = ret.task_examples(
            _task(data, seq_len, n0, r0, num_examples=settings.allocation_examples, seed=1)
        )
        a = alloc_lib.attention_allocation(
            model, batch, num_depth_bins=settings.depth_bins, batch_size=bs
        )
        out["allocation"] = a.to_dict()
        out["noise_measured"] = []
        for x in [seq_len] if settings.quick else lengths:
            if not _fits(data, x, n0, r0):
                continue
            b = (
                batch
                if x == seq_len
                else ret.task_examples(
                    _task(data, x, n0, r0, num_examples=settings.allocation_examples, seed=1)
                )
            )
            m = alloc_lib.measured_noise_floor(model, b, batch_size=bs)
            out["noise_measured"].append({"length": x, **m})
    log(f"    attention allocation and noise floor ({time.perf_counter() - t0:.1f}s)")

    # contribution by ablation, on the allocation's examples (a run trained on the needle task)
    if "allocation" in out and data.source == "needle":
        t0 = time.perf_counter()
        ab = abl_lib.contribution_by_ablation(model, batch, batch_size=bs)
        out["ablation"] = ab.to_dict()
        log(f"    contribution by ablation ({time.perf_counter() - t0:.1f}s)")

    # 3. activation outliers
    t0 = time.perf_counter()
    ocorpus = pos.corpus_for_positions(data, seq_len)
    otokens = (
        pos.validation_examples(ocorpus, settings.outlier_examples)["inputs"]
        if ocorpus is not None
        else val["inputs"][: settings.outlier_examples]
    )
    out["outliers"] = outl.activation_outliers(model, otokens, batch_size=min(bs, 4))
    out["outliers"]["tokens"] = int(otokens.size)
    log(f"    activation outliers ({time.perf_counter() - t0:.1f}s)")

    # 4. quantization
    t0 = time.perf_counter()
    task = val if "answer_spans" in val else None
    if task is None and _fits(data, seq_len, n0, r0):
        task = ret.task_examples(
            _task(data, seq_len, n0, r0, num_examples=settings.retrieval_examples)
        )
    out["quantization"] = quant.quantization_sweep(
        model, val, task, bits=settings.bits, batch_size=bs
    )
    log(f"    quantization ({time.perf_counter() - t0:.1f}s)")
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
