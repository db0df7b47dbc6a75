"""Text from a trained checkpoint: ``python -m diffjax.sample RUN_DIR "def main("``.

``RUN_DIR`` is a run folder written by ``train.py`` (its models are the folders under it that
hold ``checkpoints/``: ``RUN_DIR/<label>/checkpoints`` or, for multi-seed runs,
``RUN_DIR/<label>/seed_<s>/checkpoints``) or one model's folder. With several models the DIFF
model (label ``diff``) of the first seed is used unless ``sample.model=LABEL`` /
``sample.train_seed=S`` say otherwise; the choice is printed (to stderr). The best checkpoint
(lowest validation loss) is read unless ``sample.step`` says ``latest`` or a step number.

``RUN_DIR`` may also be a Hugging Face checkpoint directory (``config.json`` with a
``model_type`` and ``*.safetensors``, read by :func:`diffjax.from_pretrained`). Either may be in
a bucket (``gs://bucket/runs/default``), as may ``sample.tokenizer``.

The prompts follow ``RUN_DIR`` and run as one left-padded batch (a prompt that looks like a
setting, ``a.b=c``, goes after ``--``). Decoding is greedy unless ``sample.temperature`` is
above 0 (then ``sample.top_k`` and ``sample.sampling_seed`` apply). The tokenizer is
``sample.tokenizer`` (``byte`` or a ``tokenizer.json`` / a directory holding one) or else found:
a Hugging Face directory's own ``tokenizer.json``, or the run's ``data.tokenizer`` (its
``config.json``), or the byte tokenizer (vocabulary 259). :func:`sample` takes any tokenizer
object with ``encode``/``decode``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Any, Sequence

import jax
import numpy as np

from diffjax import cli
from diffjax.infra import storage
from diffjax.config import ConfigError, check_fields, fail
from diffjax.data.config import DataError
from diffjax.data.tokenizer import ByteTokenizer, load_tokenizer
from diffjax.nn.decode import generate, pad_prompts
from diffjax.interop.hf import from_pretrained
from diffjax.train.checkpoint import CheckpointError, load_model

_SEED = re.compile(r"seed_(\d+)$")


class ModelChoiceError(ValueError):
    """No model, or no model matching the requested label/seed, under a run folder."""


def find_models(run_dir: str) -> list[tuple[str, str | None, int | None]]:
    """The model folders under ``run_dir`` (local or ``gs://``): ``(path, label, seed)`` for
    each folder holding ``checkpoints/`` (``run_dir`` itself: label and seed None), sorted by
    label then seed. Folders are searched three levels deep."""
    run = storage.absolute(run_dir)
    if run.name == "checkpoints":
        run = run.parent
    if storage.isdir(run / "checkpoints"):
        return [(str(run), None, None)]
    found = []

    def visit(folder, rel: tuple[str, ...]) -> None:
        subdirs = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if rel and "checkpoints" in subdirs:
            seed = next((int(m.group(1)) for part in rel if (m := _SEED.match(part))), None)
            label = next((part for part in rel if not _SEED.match(part)), rel[0])
            found.append((str(folder), label, seed))
        elif len(rel) < 3:
            for name in subdirs:
                visit(folder / name, rel + (name,))

    if storage.isdir(run):
        visit(run, ())
    return sorted(found, key=lambda f: (f[1] or "", -1 if f[2] is None else f[2]))


def _relative(path: str, root: str) -> str:
    if storage.is_remote(path):
        return str(storage.path(path).relative_to(storage.path(root)))
    return os.path.relpath(path, root)


def choose_model(
    run_dir: str, label: str | None = None, seed: int | None = None
) -> tuple[str, str]:
    """``(model folder, a sentence saying which and what else there is)``; the DIFF model of
    the first seed by default."""
    models = find_models(run_dir)
    if not models:
        raise ModelChoiceError(
            f"no model under {run_dir}: no folder holding checkpoints/ (looked for "
            f"RUN_DIR/<label>/checkpoints and RUN_DIR/<label>/seed_<s>/checkpoints). Fix: pass a "
            f"run folder written by train.py, after it saved a checkpoint."
        )
    if len(models) == 1 and models[0][1] is None:
        if label is not None or seed is not None:
            raise ModelChoiceError(
                f"{run_dir} is one model's folder. Fix: drop sample.model and sample.train_seed"
            )
        return models[0][0], f"model: {models[0][0]}"
    labels = sorted({m[1] for m in models})
    seeds = sorted({m[2] for m in models if m[2] is not None})
    if label is None:
        label = "diff" if "diff" in labels else labels[0]
    picked = [m for m in models if m[1] == label and (seed is None or m[2] == seed)]
    if not picked:
        seed_fix = (
            f" and sample.train_seed in {seeds}" if seeds else " (this run has no seed_* folders)"
        )
        raise ModelChoiceError(
            f"no model with label {label!r}{'' if seed is None else f' and seed {seed}'} under "
            f"{run_dir}. Fix: use sample.model in {labels}{seed_fix}"
        )
    path = picked[0][0]
    others = [_relative(m[0], run_dir) for m in models if m[0] != path]
    note = f"model: {path}"
    if others:
        note += f" (also here: {', '.join(others)}; choose with sample.model=LABEL / sample.train_seed=S)"
    return path, note


def sample(
    model,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    tokenizer: Any = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng=None,
) -> list[str]:
    """The generated continuation (text after the prompt) of each prompt, stopped at the
    tokenizer's ``eos_id`` when it has one. ``tokenizer``: anything with ``encode(str) -> ids``
    and ``decode(ids) -> str`` (default the byte tokenizer)."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and vocab > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab} tokens but the model's vocabulary is "
            f"{model.config.vocab_size}. Fix: use the tokenizer the model was "
            f"trained with."
        )
    encoded = [np.asarray(tokenizer.encode(p)) for p in prompts]
    if any(e.size == 0 for e in encoded):
        raise ValueError(
            "every prompt needs at least one token; got an empty prompt. Fix: pass "
            "some text as the prompt."
        )
    tokens, lengths = pad_prompts(encoded)
    eos = getattr(tokenizer, "eos_id", None)
    out = np.asarray(
        generate(
            model,
            tokens,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            rng=rng,
            prompt_lengths=lengths,
            eos_id=eos,
        )
    )
    texts = []
    for row in out[:, tokens.shape[1] :]:
        if eos is not None and (hits := np.flatnonzero(row == eos)).size:
            row = row[: hits[0]]
        texts.append(tokenizer.decode(row))
    return texts


STEPS = ("best", "latest")


@dataclasses.dataclass(frozen=True)
class SampleSettings:
    """What ``python -m diffjax.sample`` generates and from which checkpoint (``sample.*``)."""

    max_new_tokens: int = 200  # tokens generated after each prompt (fewer when EOS comes first)
    temperature: float = 0.0  # 0: greedy decoding; above 0: sampling at this temperature
    # with temperature above 0, sample among the k most likely tokens only (None: all of them)
    top_k: int | None = None
    sampling_seed: int = 0  # the seed of the sampling (with temperature above 0)
    # which model of a run folder: its label, e.g. diff or standard (None: diff, else the first)
    model: str | None = None
    train_seed: int | None = None  # which training seed of a run folder (None: the first)
    # which checkpoint: best (lowest validation loss), latest, or a step number
    step: str = "best"
    # byte, or a tokenizer.json (or a directory holding one). None: found beside the
    # checkpoint or in the run's config, else byte
    tokenizer: str | None = None

    def __post_init__(self):
        check_fields(self)
        c = "SampleSettings"
        if self.max_new_tokens < 1:
            fail(c, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}", "e.g. 200")
        if self.temperature < 0:
            fail(
                c,
                "temperature",
                f"must be >= 0, got {self.temperature}",
                "use 0 for greedy decoding or e.g. 0.8 to sample",
            )
        if self.top_k is not None and self.top_k < 1:
            fail(c, "top_k", f"must be >= 1, got {self.top_k}", "use e.g. 40, or none for all")
        if self.step not in STEPS and not self.step.isdigit():
            fail(
                c,
                "step",
                f"{self.step!r} is not a checkpoint",
                "use best, latest or a step number",
            )

    @property
    def checkpoint(self) -> str | int:
        """``"best"``, ``"latest"`` or the step number, as :func:`load_model` takes it."""
        return self.step if self.step in STEPS else int(self.step)


SECTIONS = (cli.Section("sample", SampleSettings(), {"step": (*STEPS, "<step number>")}),)
RENAMED = {
    "--prompt": cli.Renamed("RUN_DIR {}", note=" (the prompts are positional, after RUN_DIR)"),
    **{
        f: cli.Renamed("sample.max_new_tokens={}") for f in ("--max_new_tokens", "--max-new-tokens")
    },
    "--temperature": cli.Renamed("sample.temperature={}"),
    **{f: cli.Renamed("sample.top_k={}") for f in ("--top_k", "--top-k")},
    **{f: cli.Renamed("sample.sampling_seed={}") for f in ("--sample_seed", "--sample-seed")},
    "--model": cli.Renamed("sample.model={}"),
    "--seed": cli.Renamed("sample.train_seed={}"),
    "--step": cli.Renamed("sample.step={}"),
    "--tokenizer": cli.Renamed("sample.tokenizer={}"),
}


def _parser():
    p = cli.parser(
        "python -m diffjax.sample",
        __doc__.split("\n\n")[0],
        SECTIONS,
        epilog=__doc__.split("\n\n", 1)[1],
        example='python -m diffjax.sample runs/default "def main(" sample.temperature=0.8 '
        "sample.max_new_tokens=100",
    )
    p.add_argument("run_dir", help="a run folder written by train.py, or one model's folder")
    p.add_argument(
        "prompts", nargs="+", metavar="PROMPT", help="text to continue (several: a batch)"
    )
    return p


def _is_file(path: str) -> bool:
    return storage.path(path).is_file()


def is_hf_checkpoint(path: str) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint directory (``config.json`` naming a
    ``model_type``), as opposed to a train.py run folder (whose ``config.json`` has none)."""
    file = storage.join(path, "config.json")
    if not _is_file(file):
        return False
    try:
        return "model_type" in storage.read_json(file)
    except (OSError, ValueError):
        return False


def find_tokenizer(run_dir: str, model_dir: str) -> str | None:
    """The tokenizer a model was trained with: a ``tokenizer.json`` beside a Hugging Face
    checkpoint, else the run's ``data.tokenizer`` (``RUN_DIR/config.json``), else None (bytes)."""
    for folder in (model_dir, run_dir):
        if is_hf_checkpoint(folder) and _is_file(storage.join(folder, "tokenizer.json")):
            return folder
    parent = storage.path(model_dir).parent
    for folder in (run_dir, *(str(p) for p in (parent, parent.parent) if p.name)):
        file = storage.join(folder, "config.json")
        if _is_file(file) and not is_hf_checkpoint(folder):
            try:
                return storage.read_json(file).get("data", {}).get("tokenizer")
            except (OSError, ValueError):
                return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, settings = cli.parse(_parser(), argv, SECTIONS, RENAMED)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    opts: SampleSettings = settings["sample"]
    try:
        storage.check_access(args.run_dir, what="RUN_DIR", write=False)
        run_dir = str(storage.absolute(args.run_dir))
        if is_hf_checkpoint(run_dir):
            path, note = run_dir, f"Hugging Face checkpoint: {args.run_dir}"
            model = from_pretrained(path)
        else:
            path, note = choose_model(args.run_dir, opts.model, opts.train_seed)
            model = load_model(path, opts.checkpoint)
        tokenizer = load_tokenizer(
            opts.tokenizer if opts.tokenizer is not None else find_tokenizer(run_dir, path)
        )
    except (ModelChoiceError, CheckpointError, ConfigError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    print(
        f"{note}\n{cfg.attention}, {cfg.num_layers} layers, d_model {cfg.d_model}, "
        f"checkpoint {opts.step}, tokenizer {type(tokenizer).__name__}",
        file=sys.stderr,
    )
    if tokenizer.vocab_size > cfg.vocab_size:
        print(
            f"error: this model's vocabulary has {cfg.vocab_size} tokens, the tokenizer "
            f"{tokenizer.vocab_size}: it was trained on other token ids. Fix: pass the "
            f"tokenizer it was trained with (sample.tokenizer=...).",
            file=sys.stderr,
        )
        return 2
    try:
        texts = sample(
            model,
            args.prompts,
            opts.max_new_tokens,
            tokenizer=tokenizer,
            temperature=opts.temperature,
            top_k=opts.top_k,
            rng=jax.random.key(opts.sampling_seed),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, (prompt, text) in enumerate(zip(args.prompts, texts)):
        if i:
            print("-" * 40)
        print(prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
