"""The model and tokenizer behind ``path=``: a Hugging Face directory written by
:func:`diffjax.save_pretrained` (``config.json`` with a ``model_type``), a ``train.py`` run
directory (``config.json`` of the experiment, one folder per model and seed), or the folder of
one model of a run (the one holding ``checkpoints/``). Each may be local or in a bucket
(``gs://``); a tokenizer in a bucket is read from a temporary local copy."""

from __future__ import annotations

import os
from typing import Any

import jax

from diffjax.infra import storage
from diffjax.config import ConfigError
from diffjax.data.tokenizer import TOKENIZER_JSON, ByteTokenizer, HFTokenizer, load_tokenizer
from diffjax.interop.hf import from_pretrained
from diffjax.nn.model import TransformerLM
from diffjax.train.checkpoint import (
    committed_steps,
    load_model,
    run_of,
    run_tokenizer_spec,
)
from diffjax.train.config import model_directory

Tokenizer = ByteTokenizer | HFTokenizer


def _read_json(file: str) -> dict[str, Any] | None:
    if not storage.path(file).is_file():
        return None
    data = storage.read_json(file)
    return data if isinstance(data, dict) else None


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` holds a Hugging Face ``config.json`` (one naming a ``model_type``)."""
    cfg = _read_json(storage.join(path, "config.json"))
    return cfg is not None and "model_type" in cfg


def has_checkpoints(path: str) -> bool:
    """Whether ``path`` is one model's folder: a ``checkpoints/`` with a committed step."""
    return bool(committed_steps(storage.join(path, "checkpoints")))


def run_config(model_dir: str) -> tuple[str, dict[str, Any]] | None:
    """``(run dir, its config.json)`` of the run holding ``model_dir`` (the folder itself, its
    parent or grandparent: ``RUN/<label>/seed_<n>/``), or None."""
    return run_of(model_dir)


def models_of_run(run_dir: str) -> list[str]:
    """The model folders under ``run_dir`` (relative paths), for error messages."""
    root = storage.path(run_dir)
    found = []

    def visit(folder) -> None:
        subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
        if any(p.name == "checkpoints" for p in subdirs) and has_checkpoints(str(folder)):
            found.append(str(folder.relative_to(root)))
        for sub in subdirs:
            if sub.name != "checkpoints":
                visit(sub)

    if storage.isdir(root):
        visit(root)
    return sorted(found)


def model_dir_of_run(run_dir: str, label: str, seed: int) -> str:
    """The folder of model ``label``, seed ``seed`` of a run: ``RUN/<label>/seed_<seed>/``, or
    ``RUN/<label>/`` (runs of one seed written before the per-seed layout)."""
    for d in (model_directory(run_dir, label, seed), storage.join(run_dir, label)):
        if has_checkpoints(d):
            return d
    found = models_of_run(run_dir)
    raise ConfigError(
        f"{run_dir} holds no model {label!r} with seed {seed} (looked for "
        f"{label}/seed_{seed}/checkpoints and {label}/checkpoints). Fix: pass model= and seed= "
        f"of one of its models: {', '.join(found) if found else 'none has a committed checkpoint'}"
    )


def run_tokenizer(spec: str | None, run_dir: str) -> Tokenizer:
    """A run's ``data.tokenizer`` (None or ``"byte"``: bytes); a relative path that does not
    exist from here is read relative to the run directory."""
    return load_tokenizer(run_tokenizer_spec(spec, run_dir))


def hf_dir_tokenizer(path: str) -> Tokenizer:
    """The ``tokenizer.json`` of a Hugging Face directory, else the byte tokenizer."""
    if storage.path(storage.join(path, TOKENIZER_JSON)).is_file():
        return load_tokenizer(path)
    return ByteTokenizer()


def load(
    path: str,
    *,
    model: str = "diff",
    seed: int | None = None,
    step: int | str = "best",
    tokenizer: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[TransformerLM, Tokenizer, str]:
    """``(model, tokenizer, where it was read)`` for ``path`` (see the module docstring).

    In a run directory ``model`` (the label: ``diff`` or ``standard``) and ``seed`` (default:
    the run's ``train.seed``) choose the model, ``step`` the checkpoint (``"best"``,
    ``"latest"`` or a step). ``tokenizer``: a ``tokenizer.json`` (or its directory) or
    ``"byte"`` instead of the run's or the directory's own. ``mesh``: place the parameters on
    it as they are read. ``path`` (and ``tokenizer``) may be local or ``gs://``: a bucket that
    does not exist or cannot be read is refused first (:class:`diffjax.infra.storage.StorageError`).
    """
    path = os.fspath(path)
    storage.check_access(path, what="path", write=False)
    path = str(storage.absolute(path))
    if not storage.isdir(path):
        raise ConfigError(
            f"{path} is not a directory. Fix: pass path= a train.py run directory, the "
            f"folder of one of its models, or a Hugging Face directory (diffjax.save_pretrained)"
        )
    override = None if tokenizer is None else load_tokenizer(tokenizer)
    if is_hf_dir(path):
        lm = from_pretrained(path, mesh=mesh)
        return lm, override or hf_dir_tokenizer(path), path
    if has_checkpoints(path):
        model_dir, found = path, run_config(path)
    else:
        cfg = _read_json(storage.join(path, "config.json"))
        if cfg is None:
            raise ConfigError(
                f"{path} holds neither a config.json nor a checkpoints/ folder. Fix: pass a "
                f"train.py run directory, the folder of one of its models, or a Hugging Face "
                f"directory written by diffjax.save_pretrained"
            )
        if seed is None:
            seed = int(cfg.get("train", {}).get("seed", 0))
        model_dir, found = model_dir_of_run(path, model, int(seed)), (path, cfg)
    lm = load_model(model_dir, step, mesh=mesh)
    if override is not None:
        return lm, override, model_dir
    if found is None:
        return lm, ByteTokenizer(), model_dir
    run_dir, cfg = found
    return lm, run_tokenizer(cfg.get("data", {}).get("tokenizer"), run_dir), model_dir


__all__ = [
    "Tokenizer",
    "has_checkpoints",
    "hf_dir_tokenizer",
    "is_hf_dir",
    "load",
    "model_dir_of_run",
    "models_of_run",
    "run_config",
    "run_tokenizer",
]
