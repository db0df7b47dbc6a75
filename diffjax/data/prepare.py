"""``python -m diffjax.data.prepare``: text corpora to ``.bin`` token shards and a manifest.

    python -m diffjax.data.prepare corpus/ more/*.jsonl.gz prepare.tokenizer=tokenizer.json prepare.out=prepared
    python train.py data.source=tokens data.path=prepared model.vocab_size=...
    python -m diffjax.data.prepare gs://bucket/raw/ prepare.tokenizer=byte prepare.out=gs://bucket/prepared

Inputs: ``.txt`` files (one document each), ``.jsonl`` / ``.jsonl.gz`` (one document a line, its
text in ``prepare.text_field``), ``.parquet`` (a ``prepare.text_field`` column; needs ``pyarrow``), and a
Hugging Face dataset name or ``save_to_disk`` folder (needs ``datasets``). Directories and globs
expand, sorted. Each document becomes ``[bos] ids [eos]`` exactly as the ``text`` source builds
its streams (``BOS bytes EOS`` for the byte tokenizer; a ``tokenizer.json``'s own bos/eos ids
when its ``tokenizer_config.json`` names them, else none).

A document goes to validation when ``crc32(key) / 2**32 < val_fraction``, with ``key`` its
input's key (the path relative to the directory given, or the path as given) for a ``.txt`` file
and ``key:index`` (0-based line or row) for the others: the split of one document depends on
nothing else. Each split is one stream cut into ``prepare.shard_tokens`` shards (``train_00000.bin``,
``val_00000.bin``, ...; the last shorter), each with its document index beside it
(``train_00000.idx``: the offsets within the shard of the documents that begin in it, int64;
training keeps documents apart by it, whatever the tokenizer's special tokens). The output
depends only on the inputs and options
(not on ``prepare.workers``). Each shard is written to a temporary name and renamed; ``manifest.json``
comes last, so a folder with a manifest is complete, and rerunning an interrupted preparation
keeps the finished shards (checked byte for byte, not rewritten) and gives the same bytes.

Inputs and ``prepare.out`` may be in a bucket (``gs://``): inputs are streamed from it, each shard is
uploaded whole (an object appears only when its upload completes) and the manifest last; a
shard already there is kept when its size and MD5 hash match.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import glob
import gzip
import importlib.util
import json
import multiprocessing
import os
import pathlib
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from diffjax import cli
from diffjax.infra import storage
from diffjax.config import ConfigError, check_fields

from diffjax.data.config import DataError
from diffjax.data.documents import INDEX_DTYPE
from diffjax.data.sources import (
    BYTE_TOKENIZER,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    SKIPPED_TEXT_DIRS,
    _concat_documents,
    file_sha256,
    is_validation_file,
)
from diffjax.data.tokenizer import BOS, EOS, VOCAB_SIZE, HFTokenizer, load_tokenizer

KINDS = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".parquet": "parquet"}
DTYPES = ("auto", "uint16", "uint32")
OPTIONS_FILE = ".prepare.json"  # the fingerprint, written before the first shard
CHUNK_BYTES = 1 << 20  # text per unit of work
UINT16_IDS = 2**16
PROGRESS_SECONDS = 5.0


class PrepareError(DataError):
    """Inputs or options that ``prepare`` refuses: the message names the setting or input and
    the fix."""


def _fail(field: str, problem: str, fix: str) -> PrepareError:
    return PrepareError(f"{field}: {problem}. Fix: {fix}")


# ============================================================================ options, inputs
@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    """What to prepare: the inputs, the tokenizer (a ``tokenizer.json`` or ``"byte"``), the
    output folder and how to cut it."""

    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    text_field: str = "text"
    workers: int = 1
    shard_tokens: int = 100_000_000
    val_fraction: float = 0.005
    dtype: str = "auto"
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input: its split key, where it is, its kind and size (bytes; 0 for a dataset)."""

    key: str
    path: str
    kind: str  # "txt" | "jsonl" | "jsonl.gz" | "parquet" | "hf"
    size: int


def _kind_of(name: str) -> str | None:
    for ext, kind in KINDS.items():
        if name.endswith(ext):
            return kind
    return None


def _unknown_extension(path: str) -> PrepareError:
    return _fail(
        "INPUT",
        f"{path!r} has an unknown extension",
        f"give {', '.join(KINDS)} files (or a directory or glob of them), or convert it",
    )


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json")
    )


def _needs_datasets(what: str) -> PrepareError:
    return _fail(
        "INPUT",
        f"{what} is read with the Hugging Face 'datasets' package, which is not installed",
        "pip install 'diffjax[readers]' (or datasets; or give local .txt/.jsonl/.parquet files)",
    )


def _dir_files(root: str) -> list[tuple[str, str]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIPPED_TEXT_DIRS and not d.startswith(".")
        )
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if not name.startswith(".") and _kind_of(name) and os.path.isfile(full):
                found.append((pathlib.Path(os.path.relpath(full, root)).as_posix(), full))
    return found


def expand_inputs(inputs: Sequence[str]) -> list[InputFile]:
    """The input files of ``inputs`` (files, directories, globs, dataset names), sorted by
    key, each once. Raises PrepareError for a missing path or an unknown extension."""
    out: dict[str, InputFile] = {}
    for given in inputs:
        if storage.is_remote(given):
            for inp in _bucket_inputs(given):
                out.setdefault(inp.path, inp)
            continue
        path = os.path.expanduser(given)
        if glob.has_magic(path):
            matches = sorted(glob.glob(path, recursive=True))
            if not matches:
                raise _fail("INPUT", f"the glob {given!r} matches nothing", "check the pattern")
        elif os.path.exists(path):
            matches = [path]
        else:
            if importlib.util.find_spec("datasets") is None:
                raise _fail(
                    "INPUT",
                    f"{given!r} does not exist (working directory {os.getcwd()}); read as a "
                    f"Hugging Face dataset name it needs the 'datasets' package",
                    "give an existing file, directory or glob, or pip install 'diffjax[readers]'",
                )
            out.setdefault(given, InputFile(given, given, "hf", 0))
            continue
        for m in matches:
            if _is_saved_dataset(m):
                if importlib.util.find_spec("datasets") is None:
                    raise _needs_datasets(f"{m!r} (a saved dataset)")
                key = pathlib.Path(os.path.normpath(m)).as_posix()
                out.setdefault(os.path.realpath(m), InputFile(key, m, "hf", 0))
                continue
            if os.path.isdir(m):
                pairs = _dir_files(m)
            elif _kind_of(m) is None:
                raise _unknown_extension(m)
            else:
                pairs = [(pathlib.Path(os.path.normpath(m)).as_posix(), m)]
            for key, full in pairs:
                kind = _kind_of(full)
                out.setdefault(
                    os.path.realpath(full), InputFile(key, full, kind, os.path.getsize(full))
                )
    files = sorted(out.values(), key=lambda f: (f.key, f.path))
    if not files:
        raise _fail(
            "INPUT",
            f"{', '.join(map(repr, inputs))} holds no input files",
            f"give {', '.join(KINDS)} files, or a directory or glob holding them",
        )
    return files


def _bucket_inputs(given: str) -> list[InputFile]:
    """The input files of a ``gs://`` object, prefix ("folder") or glob, keyed as local ones
    are (the path relative to the prefix given, or the URL as given)."""
    storage.check_access(given, what="INPUT", write=False)
    fs = storage.filesystem()
    given = given.rstrip("/")
    bare = given.split("://", 1)[1]
    if glob.has_magic(given):
        found = {m: e for m, e in fs.glob(bare, detail=True).items() if e.get("type") == "file"}
        if not found:
            raise _fail("INPUT", f"the glob {given!r} matches nothing", "check the pattern")
        pairs = [(f"gs://{m}", f"gs://{m}", int(e["size"])) for m, e in sorted(found.items())]
        for _, url, _ in pairs:
            if _kind_of(url) is None:
                raise _unknown_extension(url)
    elif fs.isfile(bare):
        if _kind_of(given) is None:
            raise _unknown_extension(given)
        pairs = [(given, given, int(fs.info(bare)["size"]))]
    elif fs.isdir(bare):
        pairs = []
        for name, e in sorted(fs.find(bare, detail=True).items()):
            rel = name[len(bare) :].lstrip("/")
            parts = rel.split("/")
            hidden = any(p.startswith(".") or p in SKIPPED_TEXT_DIRS for p in parts)
            if not hidden and _kind_of(rel) and e.get("type") == "file":
                pairs.append((rel, f"gs://{name}", int(e["size"])))
    else:
        raise _fail(
            "INPUT",
            f"{given!r} does not exist (no object, and no objects under that prefix)",
            "give an existing object, prefix or glob (gcloud storage ls to look)",
        )
    return [InputFile(key, url, _kind_of(url), size) for key, url, size in pairs]


@contextlib.contextmanager
def _open_input(inp: InputFile):
    """An input's bytes as a binary file object (a ``.gz`` decompressed; an object in a bucket
    streamed)."""
    with contextlib.ExitStack() as stack:
        if storage.is_remote(inp.path):
            fh = stack.enter_context(storage.path(inp.path).open("rb"))
        else:
            fh = stack.enter_context(open(inp.path, "rb"))
        if inp.kind == "jsonl.gz":
            fh = stack.enter_context(gzip.GzipFile(fileobj=fh, mode="rb"))
        yield fh


def _first_record(inp: InputFile) -> tuple[int, dict] | None:
    """(line index, parsed record) of the first non-blank line of a jsonl input, or None."""
    with _open_input(inp) as fh:
        for i, line in enumerate(fh):
            if line.strip():
                return i, _parse_line(inp, i, line)
    return None


def _parse_line(inp: InputFile, index: int, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise _fail(
            "INPUT",
            f"line {index + 1} of {inp.path!r} is not JSON ({e})",
            "write one JSON object a line (JSON Lines)",
        ) from None
    if not isinstance(record, dict):
        raise _fail(
            "INPUT",
            f"line {index + 1} of {inp.path!r} is a JSON {type(record).__name__}, not an object",
            'write one object a line, e.g. {"text": "..."}',
        )
    return record


def _missing_field(inp: InputFile, where: str, field: str, fields: Sequence[str]) -> PrepareError:
    return _fail(
        "prepare.text_field",
        f"{field!r} is not a field of {where} of {inp.path!r} (its fields: "
        f"{', '.join(map(repr, fields)) or 'none'})",
        "pass prepare.text_field with the field that holds the text"
        + (f", e.g. prepare.text_field={fields[0]}" if fields else ""),
    )


def check_input(inp: InputFile, text_field: str) -> None:
    """Refuse an input before any work: an empty file, a binary ``.txt``, a jsonl/parquet
    input without the text field, a parquet file without ``pyarrow``."""
    if inp.kind == "hf":
        return
    if inp.size == 0:
        raise _fail(
            "INPUT",
            f"{inp.path!r} is empty (0 bytes): no documents",
            "remove it from the inputs (or fill it)",
        )
    if inp.kind == "txt":
        with _open_input(inp) as fh:
            if b"\x00" in fh.read(8192):
                raise _fail(
                    "INPUT",
                    f"{inp.path!r} holds NUL bytes (binary, not UTF-8 text)",
                    "remove it from the inputs; .txt inputs are UTF-8 text",
                )
    elif inp.kind in ("jsonl", "jsonl.gz"):
        first = _first_record(inp)
        if first is None:
            raise _fail(
                "INPUT",
                f"{inp.path!r} holds no documents (only blank lines)",
                "remove it from the inputs",
            )
        index, record = first
        if text_field not in record:
            raise _missing_field(inp, f"line {index + 1}", text_field, list(record))
    elif inp.kind == "parquet":
        pq = _pyarrow_parquet(inp.path)
        with _open_input(inp) as fh:
            names = list(pq.read_schema(fh).names)
        if text_field not in names:
            raise _missing_field(inp, "the columns", text_field, names)


def _pyarrow_parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _fail(
            "INPUT",
            f"reading the parquet file {path!r} needs the 'pyarrow' package",
            "pip install 'diffjax[readers]' (or pyarrow; or convert it to .jsonl)",
        ) from None
    return pq


# ============================================================================ tokenizer
@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer of a preparation: how the manifest names it, its ids and BOS/EOS."""

    spec: str  # "byte" or the tokenizer.json path
    sha256: str | None  # of the tokenizer.json bytes; None for "byte"
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    @property
    def identity(self) -> str:
        return self.sha256 or BYTE_TOKENIZER

    def to_json(self) -> dict:
        if self.sha256 is None:
            return {"name": BYTE_TOKENIZER, "path": None, "sha256": None}
        return {"name": os.path.basename(self.spec), "path": self.spec, "sha256": self.sha256}


def tokenizer_info(spec: str) -> TokenizerInfo:
    """Load the tokenizer named by ``prepare.tokenizer`` (``"byte"`` or a tokenizer.json / a
    directory holding one) and describe it."""
    if spec == BYTE_TOKENIZER:
        return TokenizerInfo(BYTE_TOKENIZER, None, VOCAB_SIZE, BOS, EOS)
    try:
        tok = load_tokenizer(spec)
    except DataError as e:
        raise _fail("prepare.tokenizer", str(e), "give a local tokenizer.json, or 'byte'") from None
    path = str(storage.absolute(tok.path))
    return TokenizerInfo(path, file_sha256(path), tok.vocab_size, tok.bos_id, tok.eos_id)


def resolve_dtype(dtype: str, vocab_size: int) -> str:
    """``auto``: uint16 when every id fits, else uint32. Refuses uint16 for a larger vocab."""
    if dtype not in DTYPES:
        raise _fail("prepare.dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if dtype == "auto":
        return "uint16" if vocab_size <= UINT16_IDS else "uint32"
    if dtype == "uint16" and vocab_size > UINT16_IDS:
        raise _fail(
            "prepare.dtype",
            f"uint16 holds ids up to {UINT16_IDS - 1} but the tokenizer has "
            f"vocab_size {vocab_size:,}",
            "pass prepare.dtype=uint32 (or prepare.dtype=auto)",
        )
    return dtype


# ============================================================================ work units
@dataclasses.dataclass(frozen=True)
class Chunk:
    """A unit of work: documents ``first``, ``first + 1``, ... of input ``input_index``, as
    jsonl ``lines`` (bytes), ``texts``, or (a .txt input) nothing: the worker reads the file
    (``lines``: the bytes of a .txt object in a bucket, read by the parent)."""

    input_index: int
    first: int
    lines: bytes | None = None
    texts: tuple[str | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a worker needs besides the chunk."""

    inputs: tuple[InputFile, ...]
    tokenizer: str
    text_field: str
    val_fraction: float
    dtype: str


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """A chunk's documents as token ids, per split, with each document's token count."""

    train: np.ndarray
    train_lengths: np.ndarray
    val: np.ndarray
    val_lengths: np.ndarray
    text_bytes: int
    skipped: int  # documents with empty text


def _jsonl_chunks(index: int, inp: InputFile) -> Iterator[Chunk]:
    with _open_input(inp) as fh:
        first = 0
        while True:
            block = fh.read(CHUNK_BYTES)
            if not block:
                return
            block += fh.readline()  # end at a line end
            yield Chunk(index, first, lines=block)
            first += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)


def _parquet_chunks(index: int, inp: InputFile, text_field: str) -> Iterator[Chunk]:
    pq = _pyarrow_parquet(inp.path)
    first = 0
    with _open_input(inp) as fh:
        for batch in pq.ParquetFile(fh).iter_batches(batch_size=4096, columns=[text_field]):
            texts = tuple(batch.column(0).to_pylist())
            yield Chunk(index, first, texts=texts)
            first += len(texts)


def _dataset_chunks(index: int, inp: InputFile, text_field: str) -> Iterator[Chunk]:
    import datasets

    if os.path.isdir(inp.path):
        ds = datasets.load_from_disk(inp.path)
    else:
        ds = datasets.load_dataset(inp.path, split="train")
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[sorted(ds)[0]]
    if text_field not in ds.column_names:
        raise _missing_field(inp, "the columns", text_field, list(ds.column_names))
    step = 4096
    for first in range(0, len(ds), step):
        yield Chunk(index, first, texts=tuple(ds[first : first + step][text_field]))


def iter_chunks(settings: Settings) -> Iterator[Chunk]:
    """Every input's documents as chunks, in input order."""
    for index, inp in enumerate(settings.inputs):
        if inp.kind == "txt" and storage.is_remote(inp.path):
            with _open_input(inp) as fh:  # read here: a bucket's client does not survive a fork
                yield Chunk(index, 0, lines=fh.read())
        elif inp.kind == "txt":
            yield Chunk(index, 0)
        elif inp.kind in ("jsonl", "jsonl.gz"):
            yield from _jsonl_chunks(index, inp)
        elif inp.kind == "parquet":
            yield from _parquet_chunks(index, inp, settings.text_field)
        else:
            yield from _dataset_chunks(index, inp, settings.text_field)


def _chunk_documents(settings: Settings, chunk: Chunk) -> Iterator[tuple[str, bytes | str]]:
    """(split key, text) of each document of a chunk (``""`` for an empty or null text);
    raises PrepareError for a record without the text field or with a non-text value."""
    inp = settings.inputs[chunk.input_index]
    if inp.kind == "txt":
        if chunk.lines is not None:  # read by the parent (an object in a bucket)
            yield inp.key, chunk.lines
            return
        with _open_input(inp) as fh:
            yield inp.key, fh.read()
        return
    if chunk.lines is not None:
        texts = []
        for i, line in enumerate(chunk.lines.split(b"\n")):
            if not line.strip():
                continue
            record = _parse_line(inp, chunk.first + i, line)
            if settings.text_field not in record:
                where = f"line {chunk.first + i + 1}"
                raise _missing_field(inp, where, settings.text_field, list(record))
            texts.append((chunk.first + i, record[settings.text_field]))
    else:
        texts = [(chunk.first + i, t) for i, t in enumerate(chunk.texts or ())]
    for index, text in texts:
        if text is not None and not isinstance(text, str):
            raise _fail(
                "prepare.text_field",
                f"{settings.text_field!r} of document {index} of {inp.path!r} is a "
                f"{type(text).__name__}, not text",
                "pass prepare.text_field with the field that holds the text",
            )
        yield f"{inp.key}:{index}", text or ""


_TOKENIZERS: dict[str, HFTokenizer] = {}


def _hf_tokenizer(path: str) -> HFTokenizer:
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = HFTokenizer(path)
    return _TOKENIZERS[path]


def encode_documents(
    texts: Sequence[bytes | str], tokenizer: str, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """``[bos] ids(d0) [eos] [bos] ids(d1) [eos] ...`` and each document's token count: the
    byte tokenizer frames every document with BOS/EOS; a tokenizer.json with its own bos/eos
    ids where it has them (the ``text`` source's convention)."""
    if not texts:
        return np.zeros((0,), dtype), np.zeros((0,), np.int64)
    if tokenizer == BYTE_TOKENIZER:
        datas = [t.encode("utf-8") if isinstance(t, str) else t for t in texts]
        lengths = np.array([len(d) + 2 for d in datas], np.int64)
        return _concat_documents(datas).astype(dtype, copy=False), lengths
    tok = _hf_tokenizer(tokenizer)
    strs = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
    encoded = tok.encode_batch(strs)
    frame = (tok.bos_id is not None) + (tok.eos_id is not None)
    lengths = np.array([len(ids) + frame for ids in encoded], np.int64)
    out = np.empty((int(lengths.sum()),), dtype)
    pos = 0
    for ids in encoded:
        if tok.bos_id is not None:
            out[pos] = tok.bos_id
            pos += 1
        out[pos : pos + len(ids)] = ids
        pos += len(ids)
        if tok.eos_id is not None:
            out[pos] = tok.eos_id
            pos += 1
    return out, lengths


def tokenize_chunk(settings: Settings, chunk: Chunk) -> ChunkResult:
    """A chunk's documents tokenized and split (by the hash of each document's key)."""
    train, val, skipped = [], [], 0
    for key, text in _chunk_documents(settings, chunk):
        if not text:
            skipped += 1
            continue
        (val if is_validation_file(key, settings.val_fraction) else train).append(text)
    train_ids, train_lengths = encode_documents(train, settings.tokenizer, settings.dtype)
    val_ids, val_lengths = encode_documents(val, settings.tokenizer, settings.dtype)
    return ChunkResult(
        train_ids, train_lengths, val_ids, val_lengths, _chunk_bytes(settings, chunk), skipped
    )


def _chunk_bytes(settings: Settings, chunk: Chunk) -> int:
    """The input bytes a chunk stands for (its share of the progress bar)."""
    if chunk.lines is not None:
        return len(chunk.lines)
    if chunk.texts is not None:
        return sum(len(t or "") for t in chunk.texts)
    return settings.inputs[chunk.input_index].size


def _worker_init() -> None:
    # One thread per worker process: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZERS.clear()


def _tokenize_in_worker(settings: Settings, chunk: Chunk) -> ChunkResult:
    return tokenize_chunk(settings, chunk)


def tokenized_chunks(settings: Settings, workers: int) -> Iterator[ChunkResult]:
    """Every chunk's result in input order, from ``workers`` processes (in this process when
    1). The order, and so the output, does not depend on ``workers``."""
    chunks = iter_chunks(settings)
    if workers <= 1:
        for chunk in chunks:
            yield tokenize_chunk(settings, chunk)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_worker_init
    ) as pool:
        pending: list[concurrent.futures.Future] = []
        for chunk in chunks:
            pending.append(pool.submit(_tokenize_in_worker, settings, chunk))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


# ============================================================================ shards
def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


def write_shard(path: str, tokens: np.ndarray) -> bool:
    """Write ``tokens`` to ``path`` through a temporary file renamed into place (an object in a
    bucket: uploaded whole, it appears only when the upload completes); a file or object that
    already holds exactly these bytes is kept. Returns whether it wrote."""
    data = tokens.tobytes()
    if storage.is_remote(path):
        if storage.same_bytes(path, data):
            return False
        storage.write_bytes(path, data)
        return True
    if os.path.isfile(path) and os.path.getsize(path) == len(data):
        with open(path, "rb") as fh:
            if fh.read() == data:
                return False
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return True


def index_name(shard: str) -> str:
    """The document index beside a shard: ``train_00000.bin`` -> ``train_00000.idx``."""
    return shard[: -len(".bin")] + ".idx"


class ShardWriter:
    """One split's stream, cut into shards of ``shard_tokens`` tokens as it arrives, each with
    its document index (the offsets, within the shard, of the documents that begin in it)."""

    def __init__(self, out: str, split: str, dtype: str, shard_tokens: int):
        self.out, self.split, self.dtype, self.size = out, split, dtype, int(shard_tokens)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self.position = 0  # tokens received
        self._starts: list[np.ndarray] = []  # stream offsets of the documents not yet emitted
        self.shards: list[dict] = []
        self.written = 0  # shards written (the rest were already there)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if len(lengths):
            starts = self.position + np.concatenate([[0], np.cumsum(lengths[:-1])])
            self._starts.append(starts.astype(np.int64))
        self.position += len(tokens)
        self._buffer.append(tokens)
        self._buffered += len(tokens)
        while self._buffered >= self.size:
            self._emit(self.size)

    def finish(self) -> list[dict]:
        if self._buffered:
            self._emit(self._buffered)
        return self.shards

    def _emit(self, n: int) -> None:
        data = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        shard, rest = data[:n], data[n:]
        self._buffer, self._buffered = ([rest] if len(rest) else []), len(rest)
        index = len(self.shards)
        begin = index * self.size
        starts = np.concatenate(self._starts) if self._starts else np.zeros((0,), np.int64)
        mine = starts[starts < begin + n]
        self._starts = [starts[len(mine) :]]
        name = shard_name(self.split, index)
        self.written += write_shard(storage.join(self.out, name), shard)
        offsets = (mine - begin).astype(INDEX_DTYPE)
        write_shard(storage.join(self.out, index_name(name)), offsets)
        self.shards.append(
            {"file": name, "tokens": int(n), "documents": len(mine), "index": index_name(name)}
        )


# ============================================================================ the manifest
def fingerprint(
    options: PrepareOptions, inputs: Sequence[InputFile], tok: TokenizerInfo, dtype: str
) -> dict:
    """What decides the output bytes: two preparations with equal fingerprints write the same
    shards (a folder holding another fingerprint is refused)."""
    return {
        "tokenizer": tok.identity,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "dtype": dtype,
        "shard_tokens": options.shard_tokens,
        "val_fraction": options.val_fraction,
        "text_field": options.text_field,
        "inputs": [[inp.key, inp.kind, inp.size] for inp in inputs],
    }


def _differences(a: dict, b: dict) -> list[str]:
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _read_json(path: str) -> dict | None:
    try:
        data = json.loads(storage.read_bytes(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: str, data: dict) -> None:
    storage.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _out_files(out: str) -> dict[str, int]:
    """The files directly in the folder or prefix ``out``: name -> bytes."""
    if storage.is_remote(out):
        return storage.object_sizes(out)
    if not os.path.isdir(out):
        return {}
    return {
        n: os.path.getsize(os.path.join(out, n))
        for n in os.listdir(out)
        if os.path.isfile(os.path.join(out, n))
    }


def _existing_shards(out: str) -> list[str]:
    """The shards and their indexes in the folder."""
    return sorted(
        n
        for n in _out_files(out)
        if n.startswith(("train_", "val_")) and n.endswith((".bin", ".idx"))
    )


def check_out(out: str, fp: dict) -> dict | None:
    """Refuse an ``--out`` folder that holds another preparation (a manifest, or unfinished
    shards, of other inputs or options). Returns the folder's manifest when it is this one's."""
    if storage.is_remote(out):
        if storage.filesystem().isfile(out.split("://", 1)[1]):
            raise _fail(
                "prepare.out", f"{out!r} is an object", "give a prefix (gs://BUCKET/prepared)"
            )
        files = _out_files(out)
        if not files:
            return None
    else:
        if os.path.exists(out) and not os.path.isdir(out):
            raise _fail(
                "prepare.out", f"{out!r} is a file", "give a folder (it is created if missing)"
            )
        if not os.path.isdir(out):
            return None
        files = _out_files(out)
    fix = "choose another prepare.out, or delete the folder to prepare it again"
    manifest_path = storage.join(out, MANIFEST_FILE)
    if MANIFEST_FILE in files:
        manifest = _read_json(manifest_path)
        theirs = (manifest or {}).get("fingerprint")
        if not isinstance(theirs, dict):
            raise _fail("prepare.out", f"{manifest_path!r} is not a manifest of this command", fix)
        if theirs != fp:
            diff = ", ".join(_differences(theirs, fp))
            raise _fail(
                "prepare.out", f"{out!r} holds a finished preparation with another {diff}", fix
            )
        return manifest
    options_path = storage.join(out, OPTIONS_FILE)
    if OPTIONS_FILE in files:
        theirs = (_read_json(options_path) or {}).get("fingerprint")
        if theirs != fp:
            diff = ", ".join(_differences(theirs or {}, fp))
            raise _fail(
                "prepare.out", f"{out!r} holds an unfinished preparation with another {diff}", fix
            )
    elif _existing_shards(out):
        raise _fail("prepare.out", f"{out!r} holds token shards of an unknown preparation", fix)
    return None


def _manifest_complete(out: str, manifest: dict, dtype: str) -> bool:
    """Whether the folder's manifest is this version's and every shard and index it lists is
    there at its size (a folder prepared before the index existed is completed in place)."""
    if manifest.get("version") != MANIFEST_VERSION:
        return False
    item, index_item = np.dtype(dtype).itemsize, np.dtype(INDEX_DTYPE).itemsize
    files = _out_files(out)
    for shards in manifest.get("shards", {}).values():
        for s in shards:
            if files.get(s["file"]) != s["tokens"] * item:
                return False
            if files.get(s.get("index")) != s["documents"] * index_item:
                return False
    return True


def build_manifest(
    options: PrepareOptions,
    inputs: Sequence[InputFile],
    tok: TokenizerInfo,
    dtype: str,
    fp: dict,
    shards: dict[str, list[dict]],
    skipped: int,
) -> dict:
    """The manifest: everything a reader needs (shards, dtype, tokenizer, vocab_size) and how
    the folder was made (inputs, split, convention)."""
    convention = (
        "[bos] ids [eos] per document, concatenated; bos/eos are omitted where the tokenizer "
        "has none; beside each shard its index: the offsets within the shard of the documents "
        f"that begin in it, {np.dtype(INDEX_DTYPE).str} (little-endian int64)"
    )
    totals = {
        split: {
            "tokens": sum(s["tokens"] for s in lst),
            "documents": sum(s["documents"] for s in lst),
        }
        for split, lst in shards.items()
    }
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "tokenizer": tok.to_json(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "convention": convention,
        "split": {
            "val_fraction": options.val_fraction,
            "by": "document: validation when crc32(key) / 2**32 < val_fraction; key is the "
            "input's key for a .txt file, 'key:index' (0-based line or row) otherwise",
        },
        "shard_tokens": options.shard_tokens,
        "text_field": options.text_field,
        "inputs": [{"key": i.key, "path": i.path, "kind": i.kind, "bytes": i.size} for i in inputs],
        "skipped_empty_documents": skipped,
        "totals": totals,
        "shards": shards,
        "fingerprint": fp,
    }


# ============================================================================ progress
class Progress:
    """Progress on stderr: a tqdm bar over the input bytes (when tqdm is installed), else a
    line every few seconds; tokens/s in both."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.enabled, self.t0, self.tokens, self.bytes = enabled, time.perf_counter(), 0, 0
        self._last = self.t0
        self._bar = None
        if enabled and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, file=sys.stderr)

    def update(self, nbytes: int, ntokens: int) -> None:
        self.tokens += ntokens
        self.bytes += nbytes
        if not self.enabled:
            return
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix_str(f"{self.tokens:,} tokens, {rate:,.0f} tokens/s")
        elif time.perf_counter() - self._last >= PROGRESS_SECONDS:
            self._last = time.perf_counter()
            print(
                f"{self.bytes:,} bytes, {self.tokens:,} tokens, {rate:,.0f} tokens/s",
                file=sys.stderr,
            )

    def close(self) -> float:
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self.t0


# ============================================================================ prepare
@dataclasses.dataclass(frozen=True)
class PrepareResult:
    """What a preparation made: the manifest, the seconds it took, the tokens per second and
    the shards it wrote (those already there from an interrupted run are not rewritten)."""

    manifest: dict
    seconds: float
    tokens_per_second: float
    shards_written: int


def check_options(options: PrepareOptions) -> None:
    """Refuse impossible numbers and paths before any work."""
    _check_numbers(options)
    storage.path(options.out, what="prepare.out")  # a scheme diffjax writes (gs://) or local
    for value in options.inputs:
        storage.path(value, what="INPUT")


def _check_numbers(options: PrepareOptions | PrepareSettings) -> None:
    if options.workers < 1:
        raise _fail(
            "prepare.workers", f"must be >= 1, got {options.workers}", "use e.g. prepare.workers=4"
        )
    if options.shard_tokens < 1:
        raise _fail(
            "prepare.shard_tokens",
            f"must be >= 1, got {options.shard_tokens}",
            "use e.g. prepare.shard_tokens=100000000",
        )
    if not 0.0 <= options.val_fraction < 1.0:
        raise _fail(
            "prepare.val_fraction",
            f"must be in [0, 1), got {options.val_fraction}",
            "use e.g. prepare.val_fraction=0.005 (0: no validation shards)",
        )
    if not options.text_field:
        raise _fail("prepare.text_field", "is empty", "name the field that holds the text")


def prepare(options: PrepareOptions) -> PrepareResult:
    """Tokenize the inputs into ``options.out``: shards, then ``manifest.json``. Every check
    runs before any tokenizing; a finished identical folder is left as it is."""
    check_options(options)
    inputs = expand_inputs(options.inputs)
    tok = tokenizer_info(options.tokenizer)
    dtype = resolve_dtype(options.dtype, tok.vocab_size)
    for inp in inputs:
        check_input(inp, options.text_field)
    fp = fingerprint(options, inputs, tok, dtype)
    out = options.out.rstrip("/") if storage.is_remote(options.out) else options.out
    storage.check_access(out, what="prepare.out", write=True)
    existing = check_out(out, fp)
    if existing is not None and _manifest_complete(out, existing, dtype):
        if options.progress:
            print(
                f"{out}: already prepared ({MANIFEST_FILE} matches); nothing to do", file=sys.stderr
            )
        return PrepareResult(existing, 0.0, 0.0, 0)
    storage.makedirs(out)
    if existing is not None:  # a shard of it is missing or damaged: made again below
        storage.remove(storage.join(out, MANIFEST_FILE))
    _write_json(storage.join(out, OPTIONS_FILE), {"fingerprint": fp})
    for name in _out_files(out):
        if ".tmp-" in name:  # a temporary file of an interrupted run
            storage.remove(storage.join(out, name))
    settings = Settings(tuple(inputs), tok.spec, options.text_field, options.val_fraction, dtype)
    writers = {s: ShardWriter(out, s, dtype, options.shard_tokens) for s in ("train", "val")}
    sized = all(i.kind in ("txt", "jsonl") for i in inputs)
    progress = Progress(sum(i.size for i in inputs) if sized else 0, options.progress)
    skipped = 0
    for result in tokenized_chunks(settings, options.workers):
        writers["train"].add(result.train, result.train_lengths)
        writers["val"].add(result.val, result.val_lengths)
        skipped += result.skipped
        progress.update(result.text_bytes, len(result.train) + len(result.val))
    shards = {split: w.finish() for split, w in writers.items()}
    seconds = progress.close()
    if not shards["train"] and not shards["val"]:
        raise _fail(
            "INPUT",
            f"the inputs hold no documents ({skipped} have empty text in {options.text_field!r})",
            "give inputs with text (or the prepare.text_field that holds it)",
        )
    if not shards["train"]:
        raise _fail(
            "prepare.val_fraction",
            f"every document fell into validation ({options.val_fraction})",
            "lower prepare.val_fraction, or give more documents",
        )
    keep = {name for lst in shards.values() for s in lst for name in (s["file"], s["index"])}
    for name in _existing_shards(out):
        if name not in keep:
            storage.remove(storage.join(out, name))
    manifest = build_manifest(options, inputs, tok, dtype, fp, shards, skipped)
    _write_json(storage.join(out, MANIFEST_FILE), manifest)  # last: a manifest means complete
    total = progress.tokens
    rate = total / max(seconds, 1e-9)
    if options.progress:
        t, v = manifest["totals"]["train"], manifest["totals"]["val"]
        print(
            f"{out}: {t['tokens']:,} train tokens ({t['documents']:,} documents, "
            f"{len(shards['train'])} shards), {v['tokens']:,} validation tokens "
            f"({v['documents']:,} documents, {len(shards['val'])} shards), {dtype}, "
            f"in {seconds:.1f} s: {rate:,.0f} tokens/s",
            file=sys.stderr,
        )
        if options.val_fraction > 0 and not shards["val"]:
            print(
                f"{out}: no document fell into validation; train with data.val_fraction=0 "
                f"or prepare more documents",
                file=sys.stderr,
            )
    written = writers["train"].written + writers["val"].written
    return PrepareResult(manifest, seconds, rate, written)


# ============================================================================ command line
@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """The settings of ``python -m diffjax.data.prepare`` (``prepare.*``): everything of
    :class:`PrepareOptions` but the inputs, which are positional. Checked at construction."""

    tokenizer: str | None = None  # required: a tokenizer.json (or a folder holding one), or 'byte'
    out: str | None = None  # required: the output folder, or a gs:// prefix
    text_field: str = "text"  # jsonl/parquet: the field that holds each document's text
    # tokenizing processes (the output does not depend on it). Default: this machine's CPUs
    workers: int = max(1, os.cpu_count() or 1)
    shard_tokens: int = PrepareOptions.shard_tokens  # tokens per shard (the last may be shorter)
    # the share of documents held out for validation (by a hash of each document's key)
    val_fraction: float = PrepareOptions.val_fraction
    dtype: str = "auto"  # the shards' dtype; auto: uint16 when the vocab fits, else uint32
    progress: bool = True  # show progress on stderr

    def __post_init__(self):
        check_fields(self)
        if self.dtype not in DTYPES:
            raise _fail(
                "prepare.dtype", f"unknown dtype {self.dtype!r}", f"use one of {', '.join(DTYPES)}"
            )
        _check_numbers(self)

    def options(self, inputs: Sequence[str]) -> PrepareOptions:
        """These settings with ``inputs`` as :class:`PrepareOptions`; the tokenizer and the
        output folder must be set."""
        for name, example in (("tokenizer", "byte"), ("out", "prepared")):
            if getattr(self, name) is None:
                raise _fail(
                    f"prepare.{name}", "is required", f"give it, e.g. prepare.{name}={example}"
                )
        return PrepareOptions(
            inputs=tuple(inputs),
            tokenizer=self.tokenizer,
            out=self.out,
            text_field=self.text_field,
            workers=self.workers,
            shard_tokens=self.shard_tokens,
            val_fraction=self.val_fraction,
            dtype=self.dtype,
            progress=self.progress,
        )


PROG = "python -m diffjax.data.prepare"
SECTIONS = (cli.Section("prepare", PrepareSettings(), {"dtype": DTYPES}),)
# each old flag and what replaced it (refused with the new spelling)
RENAMED = {
    "--tokenizer": cli.Renamed("prepare.tokenizer={}"),
    "--out": cli.Renamed("prepare.out={}"),
    "--text-field": cli.Renamed("prepare.text_field={}"),
    "--workers": cli.Renamed("prepare.workers={}"),
    "--shard-tokens": cli.Renamed("prepare.shard_tokens={}"),
    "--val-fraction": cli.Renamed("prepare.val_fraction={}"),
    "--dtype": cli.Renamed("prepare.dtype={}"),
    "--quiet": cli.Renamed("prepare.progress=false", values="none"),
}


def parse_args(argv: Sequence[str] | None = None) -> PrepareOptions:
    """The command line as :class:`PrepareOptions` (a bad setting: :class:`ConfigError`)."""
    p = cli.parser(
        PROG,
        "Tokenize text corpora into .bin token shards and a manifest.json that "
        "train.py data.source=tokens data.path=OUT trains on.",
        SECTIONS,
        example=f"{PROG} corpus/ more/*.jsonl.gz prepare.tokenizer=tokenizer.json "
        f"prepare.out=prepared prepare.workers=8",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt/.jsonl/.jsonl.gz/.parquet files, directories, globs (local or gs://), or a "
        "Hugging Face dataset (needs `datasets`); one that looks like a setting goes after --",
    )
    args, settings = cli.parse(p, argv, SECTIONS, RENAMED)
    return settings["prepare"].options(args.inputs)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a refused input prints its message and returns 2."""
    try:
        options = parse_args(argv)
        prepare(options)
    except ConfigError as e:  # DataError, and StorageError (a bucket that cannot be used)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
