"""The input pipeline: ``make_dataset`` (a grain dataset of numpy batches) and the checks and
summaries around it.

Train: ``source -> shuffle(seed) -> repeat(num_epochs) -> rows of this process -> batch(B)``.
The example stream is cut into *global* batches of ``G = process_count * B`` examples; process
``p`` reads rows ``[p B, (p + 1) B)`` of each (and only those). The shuffle is global and
reseeded every epoch (grain folds the epoch into the seed). So global batch ``j`` is the same
examples in the same order whatever the number of processes, and the iterator's state (the
number of batches read) means the same on every process and for any process count: a
checkpoint written by 2 processes resumes on 1 or 4.

Validation: ``source -> shuffle(fixed seed) -> pad -> rows of this process -> batch(B)``: one
fixed order (independent of ``seed``, so the first k batches are the same representative
sample for every run), padded with zero-weight examples (all ``PAD``) to a multiple of ``G`` so
every example is seen once, every batch has the same shape and every process gets the same
number of batches.

The iterator of the returned dataset has ``get_state()`` / ``set_state()`` (a small dict,
JSON-serialisable; the train loop saves it in every checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, Sequence

import numpy as np

from diffjax.infra import storage

from diffjax.data.config import DataConfig, DataError
from diffjax.data.mixture import MixturePlan, Stage, first_stage, shares
from diffjax.data.sources import (
    MANIFEST_FILE,
    Corpus,
    WindowSource,
    check_token_ids,
    is_prepared_dir,
    load_corpus,
    read_manifest,
    stdlib_root,
    tokenizer_identity,
)
from diffjax.data.synthetic import (
    SYNTHETIC_TRAIN_EXAMPLES,
    MQARSource,
    NeedleSource,
    ValidationMetric,
)
from diffjax.data.tokenizer import PAD, VOCAB_SIZE, HFTokenizer

SPLITS = ("train", "validation")
VALIDATION_SHUFFLE_SEED = 0x5EED  # the validation order: one fixed permutation
DEFAULT_NUM_THREADS = 2  # reading threads (at most data.prefetch)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        hint = (
            " ('val' is spelled 'validation')" if split in ("val", "valid", "eval", "test") else ""
        )
        raise DataError(f"split: unknown split {split!r}{hint}. Fix: use 'train' or 'validation'")


def _check_config(config: DataConfig) -> None:
    if not isinstance(config, DataConfig):
        raise TypeError(f"expected a diffjax.data.DataConfig, got {type(config).__name__}")


# ============================================================================ sources
def _haystack(config: DataConfig, split: str) -> tuple[Corpus, Any]:
    corpus = load_corpus(config)
    stream = corpus.stream(split)
    if len(stream) == 0:  # val_fraction=0: the validation haystacks come from the train text
        stream = corpus.train
    return corpus, stream


def make_source(
    config: DataConfig, split: str, *, seed: int | None = None, global_batch: int | None = None
):
    """The random-access source of one split (``len``, ``[i]`` -> dict of numpy arrays).

    ``seed`` (default ``config.seed``) picks the synthetic *train* examples; synthetic validation
    examples always use ``config.seed``. ``global_batch`` (examples per step over all
    processes) is needed by a synthetic train split with a context-length curriculum
    (``config.synthetic.curriculum_steps > 0``): example ``i`` belongs to step ``i // global_batch``."""
    _check_config(config)
    _check_split(split)
    seed = config.seed if seed is None or split == "validation" else int(seed)
    if config.synthetic.curriculum_steps > 0 and split == "train" and global_batch is None:
        raise DataError(
            "make_source: data.synthetic.curriculum_steps > 0 sizes each train example by its "
            "step, which needs the global batch size. Fix: pass global_batch=G "
            "(examples per step over all processes)"
        )
    if config.source == "mqar":
        n = SYNTHETIC_TRAIN_EXAMPLES if split == "train" else config.synthetic.num_val_examples
        return MQARSource(config, split, seed, n, global_batch)
    if config.source == "needle":
        _, stream = _haystack(config, split)
        n = SYNTHETIC_TRAIN_EXAMPLES if split == "train" else config.synthetic.num_val_examples
        return NeedleSource(config, split, seed, stream, n, global_batch)
    if config.source == "mixture":
        import grain

        parts = [src for src in component_sources(config, split).values() if len(src)]
        return grain.MapDataset.concatenate(parts) if parts else grain.MapDataset.range(0)
    corpus = load_corpus(config)
    return WindowSource(corpus.stream(split), config.seq_len, documents(config, corpus, split))


# ============================================================================ mixtures
def _in_component(name: str, error: DataError) -> DataError:
    """``error`` of one component, said of it: the component's name, then the message."""
    text = str(error)
    if text.startswith("DataConfig.") and not text.startswith("DataConfig.mixture"):
        text = f"DataConfig.mixture[{name}]." + text[len("DataConfig.") :]
    else:
        text = f"DataConfig.mixture[{name}]: {text}"
    return DataError(text)


def _component_windows(config: DataConfig, split: str) -> dict[str, WindowSource]:
    out = {}
    for c in config.mixture.components:
        part = config.component(c.name)
        if split == "validation" and part.val_fraction == 0:
            continue  # a component without a validation split is not validated
        try:
            if part.source == "tokens":
                _check_prepared(c.name, part.path)
            out[c.name] = make_source(part, split)
        except DataError as e:
            raise _in_component(c.name, e) from None
    return out


def component_sources(config: DataConfig, split: str) -> dict[str, Any]:
    """The ``split`` examples of each component of a mixture, by name: a ``grain.MapDataset``
    of its windows, each carrying ``component`` (the component's index in ``data.mixture``).
    A component with ``val_fraction=0`` has no validation split (left out). Documents are kept
    apart where every component knows its boundaries; where one does not (and
    ``data.document_mask`` is None), for none of them, with one printed line naming it."""
    import grain

    windows = _component_windows(config, split)
    unknown = [name for name, src in windows.items() if src.documents is None]
    if config.masks_documents and unknown and len(unknown) < len(windows):
        note = (
            f"data.document_mask: documents are not kept apart in the mixture: component "
            f"{unknown[0]!r} does not know where its documents start (prepare it with python -m "
            f"diffjax.data.prepare, or set data.document_mask=false to silence this)."
        )
        if note not in _NOTED:
            _NOTED.add(note)
            print(note, file=sys.stderr)
        windows = _component_windows(config.replace(document_mask=False), split)
    index = {c.name: i for i, c in enumerate(config.mixture.components)}
    return {
        name: grain.MapDataset.source(src).map(_Tag(index[name])) for name, src in windows.items()
    }


class _Tag:
    """Adds ``component``: the index of the example's component in ``data.mixture``."""

    def __init__(self, index: int):
        self.index = np.int32(index)

    def __call__(self, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**example, "component": self.index}


def _check_prepared(name: str, path: str) -> None:
    """A ``tokens`` component is a prepared corpus: a folder with its manifest (written last,
    so a folder without one is a preparation that did not finish)."""
    if storage.is_remote(path) or is_prepared_dir(os.path.expanduser(path)):
        return
    if not os.path.exists(os.path.expanduser(path)):
        problem = "does not exist"
    else:
        problem = (
            f"holds no {MANIFEST_FILE}: it is not a prepared corpus, or its preparation did not "
            f"finish (the manifest is written last)"
        )
    raise DataError(
        f"DataConfig.mixture[{name}].path: {path!r} {problem}. Fix: prepare it (python -m "
        f"diffjax.data.prepare INPUT... prepare.tokenizer=T prepare.out={path}; an interrupted "
        f"preparation continues), or point data.mixture.{name}.path at a prepared folder "
        f"(text files: data.mixture.{name}.source=text)"
    )


def mixture_plan(
    config: DataConfig,
    global_batch: int,
    stages: Sequence[Any] | None = None,
    num_epochs: int | None = None,
) -> MixturePlan:
    """The :class:`~diffjax.data.mixture.MixturePlan` of a mixture's train split read in global
    batches of ``global_batch`` examples: its components' sizes, the ``stages`` (dicts as
    checkpoints record them, or :class:`~diffjax.data.mixture.Stage`; default the config's
    weights from step 0) and the passes over each component (``data.mixture.exhausted``, or
    ``num_epochs`` when given)."""
    if config.source != "mixture":
        raise DataError(
            f"mixture_plan: source={config.source!r} is not a mixture. Fix: pass a config "
            f"with data.source=mixture"
        )
    lengths = {name: len(src) for name, src in component_sources(config, "train").items()}
    staged = tuple(
        s if isinstance(s, Stage) else Stage.from_dict(s) for s in (stages or first_stage(config))
    )
    for stage in staged:
        for name in stage.mixed:
            if name not in lengths:
                raise DataError(
                    f"DataConfig.mixture: the run mixed the component {name!r} from step "
                    f"{stage.step}, and this config has none. Fix: keep it in data.mixture "
                    f"(weight 0 stops training on it)"
                )
            if lengths[name] == 0:
                raise DataError(
                    f"DataConfig.mixture[{name}]: its train split holds fewer than seq_len + 1 "
                    f"= {config.seq_len + 1} tokens, so no example, but its weight is "
                    f"{stage.weights[name]:g}. Fix: give it more data, use a shorter "
                    f"data.seq_len, or weight 0"
                )
    repeat = config.mixture.exhausted == "repeat" and num_epochs is None
    return MixturePlan(lengths, int(global_batch), staged, None if repeat else (num_epochs or 1))


def _mixture_train(
    config: DataConfig, batch_size: int, pi: int, pc: int, seed: int, num_epochs, stages
):
    """A mixture's train split as this process's batches (a ``grain.MapDataset``)."""
    global_batch = pc * batch_size
    plan = mixture_plan(config, global_batch, stages, num_epochs)
    ds = plan.dataset(component_sources(config, "train"), seed, config.shuffle)
    if len(ds) < global_batch:
        raise DataError(
            f"make_dataset: the mixture holds {len(ds)} train examples before a component runs "
            f"out, fewer than one global batch of {pc} x {batch_size}. Fix: use a smaller "
            f"batch_size or seq_len, more data, or data.mixture.exhausted=repeat"
        )
    return _process_batches(ds, global_batch, batch_size, pi)


_NOTED: set[str] = set()  # the notes already printed by this process


def carries_documents(config: DataConfig) -> bool:
    """Whether the batches of ``config`` carry ``segment_ids`` and ``positions``, judged
    without reading the data (a compile-only plan traces the step with them): masking on and
    the boundaries knowable (text sources; token files in a prepared folder or with a
    ``data.tokenizer``). :func:`make_source` decides from the data itself."""
    if not config.masks_documents:
        return False
    if config.source == "mixture":
        return all(carries_documents(config.component(c.name)) for c in config.mixture.components)
    if config.source != "tokens":
        return True
    if config.tokenizer is not None:
        return True
    paths = [p.strip() for p in (config.path or "").split(",") if p.strip()]
    return len(paths) == 1 and is_prepared_dir(os.path.expanduser(paths[0]))


def documents(config: DataConfig, corpus: Corpus, split: str):
    """The boundaries the windows of ``split`` are masked by, or None: none when
    ``data.document_mask`` is off; where the corpus does not know them, None with one printed
    line saying why (``document_mask`` None) or a DataError naming the fix (True)."""
    if not config.masks_documents:
        return None
    if corpus.train_documents is not None:
        return corpus.documents(split)
    fix = (
        "prepare the files with python -m diffjax.data.prepare (it records where each "
        "document starts), name their tokenizer in data.tokenizer when it has a BOS or EOS id, "
        "or set data.document_mask=false"
    )
    if config.document_mask:
        raise DataError(
            f"DataConfig.document_mask: is true, but {corpus.documents_note}. Fix: {fix}"
        )
    note = (
        f"data.document_mask: documents are not kept apart: {corpus.documents_note}. To keep "
        f"them apart, {fix.replace(', or set data.document_mask=false', '')}."
    )
    if note not in _NOTED:
        _NOTED.add(note)
        print(note, file=sys.stderr)
    return None


def validation_metrics(config: DataConfig) -> dict[str, ValidationMetric]:
    """The validation metrics the data of ``config`` declares beyond loss and perplexity: its
    source's ``validation_metrics``, name -> ``fn(predictions, batch) -> (right, counted)``
    (see :mod:`diffjax.data.synthetic`); empty for a corpus."""
    _check_config(config)
    source = {"mqar": MQARSource, "needle": NeedleSource}.get(config.source, WindowSource)
    return dict(source.validation_metrics)


def _process_batches(ds, global_batch: int, batch: int, index: int):
    """Batch ``j`` of this process: rows ``[index * batch, (index + 1) * batch)`` of the
    ``global_batch`` elements ``[j * global_batch, (j + 1) * global_batch)`` of ``ds`` (a grain
    ``MapDataset``), stacked. Only those rows are ever read, in one batched read (``_getitems``:
    a corpus in a bucket fetches the batch's windows concurrently)."""
    import grain

    class ProcessBatches(grain.MapDataset):
        def __len__(self) -> int:
            return len(self._parent) // global_batch

        def __getitem__(self, j):
            if isinstance(j, slice):
                return self.slice(j)
            first = int(j) * global_batch + index * batch
            rows = self._parent._getitems(list(range(first, first + batch)))
            return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

        def __str__(self) -> str:
            return f"ProcessBatches(rows {index * batch}:{(index + 1) * batch} of {global_batch})"

    return ProcessBatches(ds)


class _PadSource:
    """``n`` zero-weight examples shaped like ``template`` (inputs/targets all PAD)."""

    def __init__(self, n: int, template: dict[str, np.ndarray]):
        self._n = int(n)
        self._example = {}
        for k, v in template.items():
            v = np.asarray(v)
            fill = PAD if k in ("inputs", "targets") else -1 if k == "component" else 0
            self._example[k] = np.full(v.shape, fill, v.dtype)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._example.items()}


# ============================================================================ the dataset
def make_dataset(
    config: DataConfig,
    split: str,
    *,
    batch_size: int,
    seed: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    num_epochs: int | None = None,
    vocab_size: int | None = None,
    read_options=None,
    mixture_stages: Sequence[Any] | None = None,
):
    """A ``grain.IterDataset`` of batches: dicts of numpy arrays ``inputs`` [B, T] int32,
    ``targets`` [B, T] int32, ``weights`` [B, T] float32 (1 where the target counts), plus the
    synthetic tasks' extras (see :mod:`diffjax.data.synthetic`).

    Args:
      config: the data.
      split: ``"train"`` or ``"validation"``.
      batch_size: examples per batch *on this process* (global batch / process_count).
      seed: train shuffle order and synthetic train examples (default ``config.seed``);
        validation does not depend on it.
      process_index, process_count: this process's share: rows ``[process_index * B,
        (process_index + 1) * B)`` of every global batch of ``process_count * B`` (the train
        loop derives them from the mesh: ``diffjax.infra.sharding.process_batch_share``).
      num_epochs: passes over the data; None = forever for train, 1 for validation.
      vocab_size: if given, :func:`check_data` runs first (token ids < vocab_size).
      read_options: ``grain.ReadOptions`` (default: 2 threads, ``config.prefetch`` batches
        read ahead).
      mixture_stages: a mixture's weights over the run (:func:`mixture_plan`; a checkpoint's
        ``mixture_stages``); default the config's weights from the start.

    A mixture (``config.source == "mixture"``): the train batches mix the components
    (:mod:`diffjax.data.mixture`), each row carrying ``component``, its index in
    ``data.mixture``; the validation batches hold every component's validation examples once.

    ``iter(dataset)`` supports ``get_state()`` / ``set_state()``. Problems with the data raise
    :class:`DataError` here, before any batch is read.
    """
    import grain

    _check_config(config)
    _check_split(split)
    _check_share(batch_size, process_index, process_count, num_epochs)
    batch_size, pi, pc = int(batch_size), int(process_index), int(process_count)
    if vocab_size is not None:
        check_data(config, vocab_size)
    train_seed = config.seed if seed is None else int(seed)
    if not 0 <= train_seed < 2**32:
        raise DataError(
            f"make_dataset: seed must be in [0, 2**32), got {seed}. Fix: pass a "
            f"non-negative 32-bit seed"
        )
    if config.source == "mixture" and split == "train":
        ds = _mixture_train(config, batch_size, pi, pc, train_seed, num_epochs, mixture_stages)
        return ds.to_iter_dataset(read_options or _read_options(config))
    src = make_source(config, split, seed=train_seed, global_batch=pc * batch_size)
    if len(src) == 0:
        raise _no_examples(config, split)
    ds = src if isinstance(src, grain.MapDataset) else grain.MapDataset.source(src)
    shuffle = config.shuffle and not config.is_synthetic  # synthetic examples are i.i.d. already
    if split == "train":
        if len(src) * (num_epochs or 1) < batch_size * pc:
            raise DataError(
                f"make_dataset: the train split has {len(src)} examples, fewer than one global "
                f"batch of {pc} x {batch_size} in {num_epochs or 1} epoch(s). Fix: use a "
                f"smaller batch_size or seq_len, more epochs, or more data"
            )
        if shuffle:
            ds = ds.shuffle(seed=train_seed)
        ds = _process_batches(ds.repeat(num_epochs), pc * batch_size, batch_size, pi)
    else:
        ds = _validation_batches(ds, src, shuffle, pc * batch_size, batch_size, pi, num_epochs)
    return ds.to_iter_dataset(read_options or _read_options(config))


def _check_share(batch_size, process_index, process_count, num_epochs) -> None:
    """:func:`make_dataset`'s batch size, process share and epochs, else a DataError."""
    for name, value, low in (("batch_size", batch_size, 1), ("process_count", process_count, 1)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise DataError(
                f"make_dataset: {name} must be an integer >= {low}, got {value!r}. "
                f"Fix: pass a positive {name}"
            )
    if not 0 <= process_index < process_count:
        raise DataError(
            f"make_dataset: process_index {process_index} is not in [0, "
            f"{process_count}). Fix: pass jax.process_index() and jax.process_count()"
        )
    if num_epochs is not None and (not isinstance(num_epochs, (int, np.integer)) or num_epochs < 1):
        raise DataError(
            f"make_dataset: num_epochs must be None or >= 1, got {num_epochs!r}. "
            f"Fix: pass None (train: forever; validation: one pass) or a positive int"
        )


def _no_examples(config: DataConfig, split: str) -> DataError:
    """The error for a split that holds no example."""
    if split == "validation" and config.val_fraction == 0:
        return DataError(
            "DataConfig.val_fraction: is 0, so there is no validation split. "
            "Fix: set data.val_fraction > 0 (e.g. 0.05)"
        )
    where = config.path if config.path is not None else str(stdlib_root())
    return DataError(
        f"DataConfig.seq_len: the {split} split of {where!r} holds fewer than "
        f"seq_len + 1 = {config.seq_len + 1} tokens, so no example. Fix: use a "
        f"shorter seq_len, more data, or another val_fraction"
    )


def _validation_batches(ds, src, shuffle: bool, chunk: int, batch_size: int, pi: int, num_epochs):
    """The validation examples (one fixed permutation when shuffled) padded to whole global
    batches of ``chunk`` (so epochs stay aligned), this process's rows of each."""
    import grain

    n = len(src)
    if shuffle:
        ds = ds.shuffle(seed=VALIDATION_SHUFFLE_SEED)
    padded = math.ceil(n / chunk) * chunk
    if padded > n:
        pad = grain.MapDataset.source(_PadSource(padded - n, src[0]))
        ds = grain.MapDataset.concatenate([ds, pad])
    if num_epochs is not None and num_epochs > 1:
        ds = ds.repeat(num_epochs)
    return _process_batches(ds, chunk, batch_size, pi)


def _read_options(config: DataConfig):
    """Two reading threads (at most ``data.prefetch``), ``data.prefetch`` batches ahead."""
    import grain

    depth = config.prefetch
    return grain.ReadOptions(
        num_threads=min(DEFAULT_NUM_THREADS, depth), prefetch_buffer_size=depth
    )


def steps_per_epoch(
    config: DataConfig, split: str, *, batch_size: int, process_count: int = 1
) -> int:
    """Batches per process in one pass of ``split`` (validation counts the padded last batch)."""
    n = num_examples(config, split)
    if split == "train":
        return n // (process_count * batch_size)
    return math.ceil(n / (process_count * batch_size))


# ============================================================================ checks, summaries
@dataclasses.dataclass(frozen=True)
class DataSummary:
    """What :func:`check_data` found (the numbers behind :func:`describe`)."""

    source: str
    description: str
    seq_len: int
    files: int
    train_files: int
    validation_files: int
    train_tokens: int  # the split's stream (synthetic: examples * (seq_len + 1))
    validation_tokens: int
    train_examples: int  # windows of seq_len + 1 tokens (synthetic: examples)
    validation_examples: int
    split_by: str  # "file" | "stream" | "synthetic"
    seconds: float  # reading + tokenizing (of the load that filled the per-process cache)

    def __str__(self) -> str:
        return self.description


def _fmt(n: int) -> str:
    if n >= 1e6:
        return f"{n / 1e6:,.1f} M"
    if n >= 1e4:
        return f"{n / 1e3:,.1f} k"
    return f"{n:,}"


def _corpus_words(corpus: Corpus, config: DataConfig) -> str:
    files = f"{len(corpus.files):,} file{'s' if len(corpus.files) != 1 else ''}"
    tokens = (
        f"{_fmt(len(corpus.train))} train tokens, {_fmt(len(corpus.validation))} validation tokens"
    )
    how = ""
    if corpus.split_by == "stream" and corpus.kind != "tokens" and config.val_fraction > 0:
        how = " (split by position: too few files to split by file)"
    if corpus.kind == "stdlib":
        tests = "with" if config.stdlib.tests else "without"
        part = "" if config.stdlib.part == "all" else f"its {config.stdlib.part}, "
        return f"stdlib corpus ({stdlib_root()}, {part}{tests} tests): {files}, {tokens}{how}"
    if corpus.kind == "text":
        return f"text corpus {config.path!r}: {files}, {tokens}{how}"
    return f"token files {config.path!r}: {files}, {tokens}"


def _synthetic_summary(config: DataConfig) -> DataSummary:
    """:func:`check_data`'s summary of a synthetic task (needle retrieval or MQAR): what one
    example holds and how many there are (the needle's haystack corpus read and checked)."""
    T = config.seq_len
    if config.source == "needle":
        corpus, _ = _haystack(config, "train")
        hay = (
            "the stdlib corpus"
            if corpus.kind == "stdlib"
            else f"{len(corpus.files):,} text file(s) {config.path!r}"
        )
        F = config.seq_len - config.needle.min_seq_len
        fill = dict(key="k" * config.needle.key_len, value="0" * config.needle.value_len)
        desc = (
            f"needle retrieval: {config.needle.num_needles} needles "
            f"{config.needle.template.format(**fill)!r}, {config.needle.num_queries} queries "
            f"{config.needle.query_template.format(**fill)!r} (keys: {config.needle.key_len} of "
            f"{config.needle.key_alphabet!r}), seq_len {T} ({F:,} haystack bytes per example "
            f"from {hay})"
        )
        files, secs = len(corpus.files), corpus.seconds
    else:
        desc = f"MQAR: {config.mqar.num_pairs} key-value pairs, {config.mqar.num_queries} queries, seq_len {T}"
        files, secs = 0, 0.0
    ntr, nva = SYNTHETIC_TRAIN_EXAMPLES, config.synthetic.num_val_examples
    desc += f", {nva:,} validation examples"
    if config.synthetic.curriculum_steps:
        desc += (
            f"; curriculum: train examples grow from {config.context_len(0)} to {T} "
            f"tokens over the first {config.synthetic.curriculum_steps:,} steps (PAD after each)"
        )
    return DataSummary(
        config.source,
        desc,
        T,
        files,
        files,
        files,
        ntr * (T + 1),
        nva * (T + 1),
        ntr,
        nva,
        "synthetic",
        secs,
    )


def check_data(config: DataConfig, vocab_size: int = VOCAB_SIZE) -> DataSummary:
    """Read (and cache) the data of ``config`` and check it against a model with
    ``vocab_size`` token ids: paths exist, files hold text / tokens, every token id is below
    ``vocab_size``, each split holds at least one example. Raises :class:`DataError` (a
    ``ConfigError``) naming the path or field and the fix."""
    _check_config(config)
    if config.source == "mixture":
        return _check_mixture(config, vocab_size)
    if not config.uses_byte_tokenizer and config.source != "tokens":
        tok = HFTokenizer(config.tokenizer)
        if tok.vocab_size > vocab_size:
            raise DataError(
                f"DataConfig.tokenizer: {tok.path!r} has {tok.vocab_size:,} ids but the "
                f"model's vocab_size is {vocab_size:,}. Fix: set model.vocab_size >= "
                f"{tok.vocab_size} (or use the tokenizer of this model's checkpoint)"
            )
    elif config.source != "tokens" and vocab_size < VOCAB_SIZE:
        raise DataError(
            f"DataConfig.source: {config.source!r} uses the byte tokenizer (ids up "
            f"to {VOCAB_SIZE - 1}) but the model's vocab_size is {vocab_size}. Fix: "
            f"set model.vocab_size={VOCAB_SIZE}"
        )
    T = config.seq_len
    if config.is_synthetic:
        return _synthetic_summary(config)
    # the streams and their sizes (document boundaries are read by make_source, when used)
    corpus = load_corpus(config.replace(document_mask=False))
    if config.source == "tokens":
        check_token_ids(corpus.files, config.tokens.dtype, vocab_size)
    ntr = max(0, (len(corpus.train) - 1) // T)
    nva = max(0, (len(corpus.validation) - 1) // T)
    where = config.path if config.path is not None else str(stdlib_root())
    if ntr == 0:
        raise DataError(
            f"DataConfig.seq_len: the train split of {where!r} holds "
            f"{len(corpus.train):,} tokens, fewer than seq_len + 1 = {T + 1}. Fix: "
            f"use a shorter seq_len, more data or a smaller val_fraction"
        )
    if nva == 0 and config.val_fraction > 0:
        raise DataError(
            f"DataConfig.val_fraction: the validation split of {where!r} holds "
            f"{len(corpus.validation):,} tokens, fewer than seq_len + 1 = {T + 1}. "
            f"Fix: raise val_fraction, use a shorter seq_len or more data"
        )
    return DataSummary(
        config.source,
        _corpus_words(corpus, config),
        T,
        len(corpus.files),
        corpus.train_files,
        corpus.validation_files,
        len(corpus.train),
        len(corpus.validation),
        ntr,
        nva,
        corpus.split_by,
        corpus.seconds,
    )


def _tokenizer_of(part: DataConfig) -> tuple[str, int, str]:
    """``(identity, vocab size, name)`` of the tokenizer a component's ids come from: a
    prepared corpus's manifest, else ``data.tokenizer`` (the byte tokenizer when unset)."""
    if part.source == "tokens":
        path = part.path if storage.is_remote(part.path) else os.path.expanduser(part.path)
        m = read_manifest(path.rstrip("/") if storage.is_remote(path) else path)
        return m.tokenizer, m.vocab_size, m.tokenizer_name
    if part.tokenizer in (None, "byte"):
        return "byte", VOCAB_SIZE, "byte"
    tok = HFTokenizer(part.tokenizer)
    return tokenizer_identity(part.tokenizer), tok.vocab_size, str(tok.path)


def _check_mixture(config: DataConfig, vocab_size: int) -> DataSummary:
    """:func:`check_data` of every component (its errors named by it), and one tokenizer for
    them all: a model reads one vocabulary."""
    parts, tokenizers = {c.name: config.component(c.name) for c in config.mixture.components}, {}
    for name, part in parts.items():
        try:
            if part.source == "tokens":
                _check_prepared(name, part.path)
            tokenizers[name] = _tokenizer_of(part)
        except DataError as e:
            raise _in_component(name, e) from None
    (first, (ident, vocab, tname)), *rest = tokenizers.items()
    for name, (other, other_vocab, other_name) in rest:
        if (other, other_vocab) != (ident, vocab):
            raise DataError(
                f"DataConfig.mixture[{name}]: its ids come from the tokenizer {other_name!r} "
                f"({other_vocab:,} ids), those of component {first!r} from {tname!r} "
                f"({vocab:,} ids): one model reads one vocabulary. Fix: prepare {name!r} again "
                f"with prepare.tokenizer={tname} (or leave it out of data.mixture)"
            )
    summaries = {}
    for name, part in parts.items():  # one vocabulary: each component's own checks
        try:
            summaries[name] = check_data(part, vocab_size)
        except DataError as e:
            raise _in_component(name, e) from None
    shares_ = shares(config.weights)
    words = "; ".join(
        f"{name} ({shares_[name]:.0%}): {summary.description}"
        for name, summary in summaries.items()
    )
    total = lambda key: sum(getattr(x, key) for x in summaries.values())  # noqa: E731
    return DataSummary(
        "mixture",
        f"mixture of {len(summaries)} components (realised train shares in parentheses; "
        f"when one runs out: {config.mixture.exhausted}): {words}",
        config.seq_len,
        total("files"),
        total("train_files"),
        total("validation_files"),
        total("train_tokens"),
        total("validation_tokens"),
        total("train_examples"),
        total("validation_examples"),
        "component",
        total("seconds"),
    )


def describe(config: DataConfig) -> str:
    """One line, e.g. ``"stdlib corpus (...): 1,234 files, 12.1 M train tokens, 0.6 M
    validation tokens"``."""
    return check_data(config).description


def num_tokens(config: DataConfig, split: str) -> int:
    """Tokens in ``split`` (the corpus stream; synthetic: examples * (seq_len + 1))."""
    _check_split(split)
    _check_config(config)
    if config.is_synthetic:
        return num_examples(config, split) * (config.seq_len + 1)
    if config.source == "mixture":
        parts = [config.component(c.name) for c in config.mixture.components]
        return sum(num_tokens(p, split) for p in parts if split == "train" or p.val_fraction)
    return len(load_corpus(config).stream(split))


def num_examples(config: DataConfig, split: str) -> int:
    """Examples (windows of seq_len + 1 tokens) in one pass of ``split``."""
    _check_split(split)
    if config.is_synthetic:
        return SYNTHETIC_TRAIN_EXAMPLES if split == "train" else config.synthetic.num_val_examples
    return len(make_source(config, split))
