"""Corpora as token streams, and fixed-length windows over them (random access).

- ``stdlib``: this interpreter's standard-library ``.py`` files (nothing to download).
- ``text``: UTF-8 text files (a file, a directory, a glob; comma-separated for several).
- ``tokens``: pre-tokenized ``.npy`` (``np.load(mmap_mode="r")``) / raw ``.bin`` (``np.memmap``)
  files, never read into memory whole; or a folder written by ``python -m diffjax.data.prepare``
  (its ``manifest.json`` names the train and validation shards, their dtype and tokenizer),
  locally or as a ``gs://`` prefix (read by concurrent ranged reads of the windows asked for).

Text corpora are split by file: a file goes to validation when ``crc32(key) / 2**32 <
val_fraction``, where ``key`` is its path relative to the corpus root. The split of one file
does not depend on any other file, so adding or removing files never moves the others. Each
split is one stream ``BOS bytes EOS BOS bytes EOS ...`` (uint16, cached per process), and
example ``i`` is the window ``stream[i*T : i*T + T + 1]`` (``inputs = w[:-1]``,
``targets = w[1:]``).

Each corpus also says where its documents start (:mod:`diffjax.data.documents`): the text
sources record it while building their streams (each file is a document), a prepared folder
from the index beside each shard (a folder prepared before the index: its manifest's BOS/EOS
ids), raw token files from the BOS/EOS ids of ``data.tokenizer``. The windows then carry
``segment_ids`` and ``positions`` and weigh no target across a boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import pathlib
import sysconfig
import time
import zlib
from typing import Sequence

import numpy as np

from diffjax.infra import storage

from diffjax.data.config import DataConfig, DataError
from diffjax.data.documents import (
    INDEX_DTYPE,
    Boundaries,
    DocumentIndex,
    SpecialTokens,
    mark_windows,
)
from diffjax.data.tokenizer import BOS, EOS, HFTokenizer

# Directories never part of the stdlib corpus (third-party packages, bytecode caches).
STDLIB_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
# The stdlib's test packages: left out by default. They are ~60% of the bytes but (1) many
# installations do not ship them (Debian/Ubuntu's python3 packages and the official Docker
# images delete them), so including them would make "the stdlib corpus" differ between machines
# with the same Python version, and (2) they hold large literal data blobs (unicode tables,
# encoded test vectors, deliberately malformed source) rather than representative code.
STDLIB_TEST_DIRS = ("test", "tests", "idle_test")
SKIPPED_TEXT_DIRS = ("__pycache__", ".git", ".hg", ".svn")
_BINARY_SNIFF_BYTES = 8192


# ============================================================================ file lists
def stdlib_root() -> pathlib.Path:
    """The running interpreter's standard-library directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=8)
def _stdlib_files(root: str, include_tests: bool, part: str = "all") -> tuple[tuple[str, str], ...]:
    base = pathlib.Path(root)
    excluded = set(STDLIB_EXCLUDED_DIRS) | (set() if include_tests else set(STDLIB_TEST_DIRS))
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(".")]
        if part == "modules":
            dirnames[:] = []  # the top-level modules: the files beside the packages
        if part == "packages" and dirpath == str(base):
            continue  # the packages: the files in the directories below
        for name in filenames:
            if name.endswith(".py"):
                full = os.path.join(dirpath, name)
                if os.path.isfile(full):
                    found.append((pathlib.Path(full).relative_to(base).as_posix(), full))
    return tuple(sorted(found))


def stdlib_files(
    *, include_tests: bool = False, max_files: int | None = None, part: str = "all"
) -> list[pathlib.Path]:
    """The stdlib corpus's files: every ``.py`` under the interpreter's stdlib directory, except
    ``site-packages``, ``dist-packages``, ``__pycache__`` (and the test packages unless
    ``include_tests``), sorted by relative POSIX path; of ``part`` (``"modules"``: the
    top-level ones, ``"packages"``: those in its packages; ``"all"``: both); the first
    ``max_files`` if given."""
    files = _stdlib_files(str(stdlib_root()), bool(include_tests), part)
    if max_files is not None:
        files = files[:max_files]
    return [pathlib.Path(full) for _, full in files]


def is_validation_file(key: str, val_fraction: float) -> bool:
    """Whether the file with relative path ``key`` belongs to the validation split (a stable
    hash, independent of every other file)."""
    return zlib.crc32(key.encode("utf-8")) < val_fraction * 2**32


def _split_patterns(path: str) -> list[str]:
    return [p.strip() for p in path.split(",") if p.strip()]


def _expand(path: str, *, field: str, want) -> list[tuple[str, str]]:
    """``[(key, full_path)]`` for each file of the comma-separated ``path``; ``want(name)``
    filters the files found inside directories. Keys are paths relative to the directory given
    (or the path as matched), used for the split hash and for sorting."""
    out: dict[str, str] = {}
    for pattern in _split_patterns(path):
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(glob.glob(expanded, recursive=True))
            if not matches:
                raise DataError(
                    f"DataConfig.{field}: the glob {pattern!r} matches nothing "
                    f"(working directory {os.getcwd()}). Fix: check the pattern, "
                    f"or give a file or directory"
                )
        elif not os.path.exists(expanded):
            raise DataError(
                f"DataConfig.{field}: {pattern!r} does not exist (working directory "
                f"{os.getcwd()}). Fix: give an existing file, directory or glob"
            )
        else:
            matches = [expanded]
        for m in matches:
            if os.path.isdir(m):
                for dirpath, dirnames, filenames in os.walk(m):
                    dirnames[:] = sorted(
                        d for d in dirnames if d not in SKIPPED_TEXT_DIRS and not d.startswith(".")
                    )
                    for name in filenames:
                        full = os.path.join(dirpath, name)
                        if not name.startswith(".") and want(name) and os.path.isfile(full):
                            key = pathlib.Path(os.path.relpath(full, m)).as_posix()
                            out.setdefault(os.path.realpath(full), key)
            elif os.path.isfile(m):
                out.setdefault(os.path.realpath(m), pathlib.Path(os.path.normpath(m)).as_posix())
    files = sorted(((key, full) for full, key in out.items()))
    if not files:
        raise DataError(
            f"DataConfig.{field}: {path!r} holds no usable files. Fix: point it at "
            f"files, a directory with files, or a glob that matches files"
        )
    return files


def _looks_binary(head: bytes) -> bool:
    return b"\x00" in head


# ============================================================================ streams
class TokenStream:
    """A read-only 1-D sequence of token ids made of pieces (in-memory arrays or memory-mapped
    files), read by ``stream[start:stop]`` (an int32 copy of that range only)."""

    def __init__(self, pieces: Sequence["_Piece"]):
        self._pieces = list(pieces)
        lengths = [len(p) for p in self._pieces]
        self._offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, int(start)), min(len(self), int(stop))
        if stop <= start:
            return np.zeros((0,), np.int32)
        first = int(np.searchsorted(self._offsets, start, side="right")) - 1
        out = []
        i = first
        while start < stop:
            lo = int(self._offsets[i])
            hi = int(self._offsets[i + 1])
            take = min(stop, hi)
            out.append(self._pieces[i].read(start - lo, take - lo))
            start = take
            i += 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """``[self.read(a, b) for a, b in ranges]``, with the ranged reads of every piece in a
        bucket in flight at once (one round trip for a whole batch of windows)."""
        plans, remote = [], []
        for start, stop in ranges:
            start, stop = max(0, int(start)), min(len(self), int(stop))
            plan = []
            if stop > start:
                i = int(np.searchsorted(self._offsets, start, side="right")) - 1
                while start < stop:
                    lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
                    take = min(stop, hi)
                    piece = self._pieces[i]
                    if isinstance(piece, _RemotePiece):
                        plan.append(len(remote))
                        remote.append((piece, start - lo, take - lo))
                    else:
                        plan.append(piece.read(start - lo, take - lo))
                    start, i = take, i + 1
            plans.append(plan)
        fetched = _RemotePiece.read_all(remote)
        out = []
        for plan in plans:
            parts = [fetched[x] if isinstance(x, int) else x for x in plan]
            if not parts:
                out.append(np.zeros((0,), np.int32))
            else:
                out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return out

    def sub(self, start: int, stop: int) -> "TokenStream":
        """The view ``[start, stop)`` of this stream."""
        return _SubStream(self, start, stop)


class _SubStream(TokenStream):
    def __init__(self, parent: TokenStream, start: int, stop: int):
        self._parent, self._start, self._stop = parent, int(start), int(stop)

    def __len__(self) -> int:
        return self._stop - self._start

    def read(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, int(start)), min(len(self), int(stop))
        return self._parent.read(self._start + start, self._start + stop)

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        n, at = len(self), self._start
        clipped = [(max(0, int(a)), min(n, int(b))) for a, b in ranges]
        return self._parent.read_many([(at + a, at + max(a, b)) for a, b in clipped])


class _Piece:
    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def read(self, start: int, stop: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


class _ArrayPiece(_Piece):
    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.array[start:stop].astype(np.int32)


class _FilePiece(_Piece):
    """A token file, memory-mapped on first read (and again after unpickling)."""

    def __init__(self, path: str, dtype: str, length: int):
        self.path, self.dtype, self.length = path, dtype, int(length)
        self._array = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self):
        return {"path": self.path, "dtype": self.dtype, "length": self.length, "_array": None}

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = open_token_file(self.path, self.dtype)
        return self._array

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.array[start:stop]).astype(np.int32)


class _RemotePiece(_Piece):
    """A token shard in a bucket, read by ranged reads of the bytes asked for (nothing is
    downloaded whole or kept: every process reads only the windows of its own rows)."""

    def __init__(self, url: str, dtype: str, length: int):
        self.url, self.dtype, self.length = url, dtype, int(length)

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.read_all([(self, start, stop)])[0]

    @staticmethod
    def read_all(requests: Sequence[tuple["_RemotePiece", int, int]]) -> list[np.ndarray]:
        """Tokens ``[start, stop)`` of each ``(piece, start, stop)``, read concurrently."""
        if not requests:
            return []
        items = [np.dtype(p.dtype).itemsize for p, _, _ in requests]
        blobs = storage.read_ranges(
            [p.url for p, _, _ in requests],
            [a * k for (_, a, _), k in zip(requests, items)],
            [b * k for (_, _, b), k in zip(requests, items)],
        )
        out = []
        for (piece, a, b), blob in zip(requests, blobs):
            if len(blob) != (b - a) * np.dtype(piece.dtype).itemsize:
                raise DataError(
                    f"DataConfig.path: reading tokens {a}:{b} of {piece.url!r} returned "
                    f"{len(blob)} bytes; the object changed while training. Fix: do not "
                    f"rewrite a prepared prefix a run reads (prepare into a new one)"
                )
            out.append(np.frombuffer(blob, dtype=piece.dtype).astype(np.int32))
        return out


# ============================================================================ text corpora
@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: the train and validation streams and how they were made."""

    kind: str  # "stdlib" | "text" | "tokens"
    path: str | None
    files: tuple[str, ...]
    train: TokenStream
    validation: TokenStream
    train_files: int
    validation_files: int
    split_by: str  # "file" | "stream" | "document" (a prepared folder)
    seconds: float  # time to read and tokenize (0 when cached)
    # where documents start in each stream (diffjax.data.documents), or None when unknown
    train_documents: Boundaries | None = None
    validation_documents: Boundaries | None = None
    # how the boundaries are known ("index", "BOS/EOS ids"), or why they are not
    documents_note: str = ""

    def stream(self, split: str) -> TokenStream:
        return self.train if split == "train" else self.validation

    def documents(self, split: str) -> Boundaries | None:
        return self.train_documents if split == "train" else self.validation_documents


def _concat_documents(datas: Sequence[bytes]) -> np.ndarray:
    """``BOS d0 EOS BOS d1 EOS ...`` as one uint16 array (np.frombuffer: ~1 GB/s)."""
    total = sum(len(d) + 2 for d in datas)
    out = np.empty((total,), np.uint16)
    pos = 0
    for d in datas:
        n = len(d)
        out[pos] = BOS
        out[pos + 1 : pos + 1 + n] = np.frombuffer(d, dtype=np.uint8)
        out[pos + 1 + n] = EOS
        pos += n + 2
    return out


def _stream_split(stream: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = len(stream) - int(round(val_fraction * len(stream)))
    return stream[:cut], stream[cut:]


def _encode_documents(datas: Sequence[bytes], tokenizer: str) -> tuple[np.ndarray, np.ndarray]:
    """``[bos] ids(d0) [eos] [bos] ids(d1) [eos] ...`` with a Hugging Face tokenizer (its BOS/EOS
    where it has them), uint32 (uint16 when every id fits), and each document's token count."""
    tok = HFTokenizer(tokenizer)
    pieces, lengths = [], []
    for ids in tok.encode_batch([d.decode("utf-8", errors="replace") for d in datas]):
        if tok.bos_id is not None:
            pieces.append(np.array([tok.bos_id], np.int64))
        pieces.append(ids.astype(np.int64))
        if tok.eos_id is not None:
            pieces.append(np.array([tok.eos_id], np.int64))
        lengths.append(len(ids) + (tok.bos_id is not None) + (tok.eos_id is not None))
    out = np.concatenate(pieces) if pieces else np.zeros((0,), np.int64)
    return out.astype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32), np.array(lengths)


def _byte_documents(datas: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_concat_documents` and each document's token count."""
    return _concat_documents(datas), np.array([len(d) + 2 for d in datas], np.int64)


@functools.lru_cache(maxsize=8)
def _load_text(
    kind: str,
    path: str | None,
    files: tuple[tuple[str, str, int, int], ...],
    val_fraction: float,
    tokenizer: tuple[str, int, int] | None = None,
) -> Corpus:
    """Read, tokenize and split. ``files`` = ((key, full path, size, mtime_ns), ...) so that a
    changed file is a cache miss."""
    t0 = time.perf_counter()
    train, val = [], []
    for key, full, _, _ in files:
        with open(full, "rb") as fh:
            data = fh.read()
        if not data:
            continue
        if kind == "text" and _looks_binary(data[:_BINARY_SNIFF_BYTES]):
            continue
        (val if is_validation_file(key, val_fraction) else train).append(data)
    where = path if path is not None else str(stdlib_root())
    if not train and not val:
        raise DataError(
            f"DataConfig.path: the {len(files)} file(s) of {where!r} hold no text (all are empty, "
            f"or binary: they contain NUL bytes). Fix: point data.path at UTF-8 text files; for "
            f"pre-tokenized .npy/.bin files use data.source='tokens'"
        )
    concat = (
        _byte_documents
        if tokenizer is None
        else functools.partial(_encode_documents, tokenizer=tokenizer[0])
    )
    if val_fraction > 0 and (not train or not val):
        # Too few files for a split by file (e.g. a single file): split the stream instead.
        stream, lengths = concat(train + val)
        train_arr, val_arr = _stream_split(stream, val_fraction)
        docs = DocumentIndex.from_lengths(lengths)
        cut = len(train_arr)
        train_docs, val_docs = docs.sub(0, cut), docs.sub(cut, len(stream))
        split_by, n_train, n_val = "stream", len(train) + len(val), len(train) + len(val)
    else:
        (train_arr, train_len), (val_arr, val_len) = concat(train), concat(val)
        train_docs = DocumentIndex.from_lengths(train_len)
        val_docs = DocumentIndex.from_lengths(val_len)
        split_by, n_train, n_val = "file", len(train), len(val)
    for arr in (train_arr, val_arr):
        arr.setflags(write=False)
    return Corpus(
        kind=kind,
        path=path,
        files=tuple(f[1] for f in files),
        train=TokenStream([_ArrayPiece(train_arr)]),
        validation=TokenStream([_ArrayPiece(val_arr)]),
        train_files=n_train,
        validation_files=n_val,
        split_by=split_by,
        seconds=time.perf_counter() - t0,
        train_documents=train_docs,
        validation_documents=val_docs,
        documents_note="each file is a document",
    )


def _stat_key(files: Sequence[tuple[str, str]]) -> tuple[tuple[str, str, int, int], ...]:
    out = []
    for key, full in files:
        st = os.stat(full)
        out.append((key, full, st.st_size, st.st_mtime_ns))
    return tuple(out)


def text_files(config: DataConfig) -> list[tuple[str, str]]:
    """``[(key, full path)]`` of a stdlib/text(/needle haystack) corpus, sorted, capped by
    ``max_files``."""
    if config.path is None:
        files = list(_stdlib_files(str(stdlib_root()), config.stdlib.tests, config.stdlib.part))
        if not files:
            raise DataError(
                f"DataConfig.source: no .py files under {str(stdlib_root())!r} "
                f"(this Python ships without its stdlib sources). Fix: use "
                f"source='text' with data.path=<your text files>"
            )
    else:
        files = _expand(config.path, field="path", want=lambda name: True)
    if config.max_files is not None:
        files = files[: config.max_files]
    return files


def load_text_corpus(config: DataConfig) -> Corpus:
    """The stdlib corpus (``path is None``) or the text files of ``config.path``, tokenized
    and split (cached per process)."""
    kind = "stdlib" if config.path is None else "text"
    tokenizer = None
    if config.tokenizer not in (None, "byte"):
        file = os.path.abspath(HFTokenizer(config.tokenizer).path)
        st = os.stat(file)  # a changed tokenizer file is a cache miss
        tokenizer = (file, st.st_size, st.st_mtime_ns)
    return _load_text(
        kind, config.path, _stat_key(text_files(config)), config.val_fraction, tokenizer
    )


# ============================================================================ token files
TOKEN_EXTENSIONS = (".npy", ".bin")


def open_token_file(path: str, dtype: str) -> np.ndarray:
    """A 1-D read-only memory map of a token file (``.npy`` keeps its own dtype)."""
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        if arr.ndim != 1:
            arr = arr.reshape(-1)  # a view for C-contiguous arrays
        return arr
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def _check_token_file(path: str, dtype: str) -> int:
    """The file's token count, after checking its format. Raises DataError."""
    if not path.endswith(TOKEN_EXTENSIONS):
        raise DataError(
            f"DataConfig.path: {path!r} is not a token file. Fix: give .npy files "
            f"(any integer dtype) or raw .bin files of data.tokens.dtype"
        )
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(
            f"DataConfig.path: the token file {path!r} is empty (0 bytes). Fix: "
            f"remove it from data.path or regenerate it"
        )
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file
            raise DataError(
                f"DataConfig.path: {path!r} is not a readable .npy file ({e}). Fix: "
                f"write it with np.save(path, tokens)"
            ) from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(
                f"DataConfig.path: {path!r} holds {arr.dtype} values, not token ids. "
                f"Fix: save integer token ids (e.g. tokens.astype(np.uint16))"
            )
        n = int(arr.size)
    else:
        item = np.dtype(dtype).itemsize
        if size % item:
            raise DataError(
                f"DataConfig.tokens.dtype: {path!r} has {size} bytes, not a multiple "
                f"of {item} ({dtype}). Fix: set data.tokens.dtype to the dtype the "
                f"file was written with (uint16, uint32 or int32)"
            )
        n = size // item
    if n == 0:
        raise DataError(
            f"DataConfig.path: the token file {path!r} is empty. Fix: remove it "
            f"from data.path or regenerate it"
        )
    return n


@functools.lru_cache(maxsize=64)
def _token_range(path: str, dtype: str, size: int, mtime_ns: int) -> tuple[int, int, int]:
    """(min id, max id, position of the first max) of a token file, in chunks of 16 M tokens."""
    arr = open_token_file(path, dtype)
    lo, hi, where = None, None, 0
    chunk = 1 << 24
    for start in range(0, len(arr), chunk):
        block = np.asarray(arr[start : start + chunk])
        bmin, bmax = int(block.min()), int(block.max())
        lo = bmin if lo is None else min(lo, bmin)
        if hi is None or bmax > hi:
            hi, where = bmax, start + int(np.argmax(block))
    return int(lo), int(hi), int(where)


def check_token_ids(files: Sequence[str], dtype: str, vocab_size: int) -> None:
    """Every id of every token file in ``[0, vocab_size)``; else a DataError naming the file.
    A shard of a prepared folder is read with its manifest's dtype, and the manifest's
    ``vocab_size`` must fit the model's."""
    remote = [p for p in files if storage.is_remote(p)]
    for directory in sorted({p.rsplit("/", 1)[0] for p in remote}):
        # a prepared prefix in a bucket: its manifest's vocab_size (written by prepare from the
        # tokenizer) is checked; scanning every id would download the whole corpus
        check_manifest_vocab(directory, read_manifest(directory), vocab_size)
    files = [p for p in files if not storage.is_remote(p)]
    for directory in sorted({os.path.dirname(p) for p in files if _shard_manifest(p)}):
        check_manifest_vocab(directory, read_manifest(directory), vocab_size)
    for path in files:
        manifest = _shard_manifest(path)
        file_dtype = manifest.dtype if manifest is not None else dtype
        st = os.stat(path)
        lo, hi, where = _token_range(path, file_dtype, st.st_size, st.st_mtime_ns)
        if hi >= vocab_size:
            raise DataError(
                f"DataConfig.path: the token file {path!r} holds id {hi} (at position {where}), "
                f"but the model's vocab_size is {vocab_size}. Fix: set model.vocab_size >= {hi + 1}, "
                f"or check data.tokens.dtype ({file_dtype}) and the tokenizer that wrote the file"
            )
        if lo < 0:
            raise DataError(
                f"DataConfig.path: the token file {path!r} holds the negative id {lo}. Fix: "
                f"write non-negative token ids"
            )


# ============================================================================ prepared folders
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "diffjax.prepared-tokens"
MANIFEST_VERSION = 2  # 2: an index of document starts beside each shard
READABLE_VERSIONS = (1, 2)  # 1: no index (boundaries from the manifest's BOS/EOS ids)
BYTE_TOKENIZER = "byte"


@dataclasses.dataclass(frozen=True)
class Shard:
    """One ``.bin`` shard of a prepared folder: its file name, tokens, the documents that
    begin in it and (format version 2) its index file: their start offsets within the shard,
    :data:`~diffjax.data.documents.INDEX_DTYPE`."""

    file: str
    tokens: int
    documents: int
    index: str | None = None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` of a prepared folder says about its shards (the fields the
    reader needs; the file holds more)."""

    vocab_size: int
    dtype: str
    tokenizer: str  # "byte", or the sha256 of the tokenizer.json bytes
    tokenizer_name: str  # "byte", or the tokenizer.json path it was prepared with
    train: tuple[Shard, ...]
    validation: tuple[Shard, ...]
    version: int = MANIFEST_VERSION
    bos_id: int | None = None
    eos_id: int | None = None


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with storage.path(path).open("rb") if storage.is_remote(path) else open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_identity(spec: str | None) -> str:
    """``"byte"`` for the byte tokenizer (``None`` or ``"byte"``), else the sha256 of the
    ``tokenizer.json`` of ``spec`` (a file or a directory holding one)."""
    if spec in (None, BYTE_TOKENIZER):
        return BYTE_TOKENIZER
    return file_sha256(HFTokenizer(spec).path)


@functools.lru_cache(maxsize=64)
def _foreign_manifest(file: str, size: int, mtime_ns: int) -> bool:
    """Whether ``file`` is valid JSON of another format (an unreadable one counts as ours, so
    that reading it reports the problem)."""
    try:
        with open(file) as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return False
    return not (isinstance(raw, dict) and raw.get("format") == MANIFEST_FORMAT)


def is_prepared_dir(path: str) -> bool:
    """Whether ``path`` is a folder holding a ``manifest.json`` written by
    ``python -m diffjax.data.prepare`` (a manifest of another format does not count)."""
    if storage.is_remote(path):
        return True  # a bucket's prefix is read as prepared: read_manifest says what is wrong
    file = os.path.join(path, MANIFEST_FILE)
    if not (os.path.isdir(path) and os.path.isfile(file)):
        return False
    st = os.stat(file)
    return not _foreign_manifest(os.path.abspath(file), st.st_size, st.st_mtime_ns)


def _manifest_error(directory: str, problem: str) -> DataError:
    return DataError(
        f"DataConfig.path: {storage.join(directory, MANIFEST_FILE)!r} {problem}. Fix: prepare "
        f"the folder again with python -m diffjax.data.prepare (or point data.path elsewhere)"
    )


def _parse_shards(directory: str, raw, split: str) -> tuple[Shard, ...]:
    try:
        return tuple(
            Shard(
                str(s["file"]),
                int(s["tokens"]),
                int(s["documents"]),
                None if s.get("index") is None else str(s["index"]),
            )
            for s in raw[split]
        )
    except (KeyError, TypeError, ValueError):
        raise _manifest_error(directory, f"has no valid shards.{split} list") from None


@functools.lru_cache(maxsize=16)
def _read_manifest(directory: str, size: int, mtime_ns: int) -> Manifest:
    try:
        with open(os.path.join(directory, MANIFEST_FILE), "rb") as fh:
            text = fh.read()
    except OSError as e:
        raise _manifest_error(directory, f"is not readable ({e})") from None
    return _parse_manifest(directory, text)


def _parse_manifest(directory: str, text: bytes) -> Manifest:
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise _manifest_error(directory, f"is not readable JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
        raise _manifest_error(directory, f"is not a {MANIFEST_FORMAT} manifest")
    if raw.get("version") not in READABLE_VERSIONS:
        raise _manifest_error(
            directory,
            f"has version {raw.get('version')!r}; this diffjax reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
        )
    try:
        tok = raw["tokenizer"]
        manifest = Manifest(
            vocab_size=int(raw["vocab_size"]),
            dtype=str(raw["dtype"]),
            tokenizer=str(tok.get("sha256") or tok["name"]),
            tokenizer_name=str(tok.get("path") or tok["name"]),
            train=_parse_shards(directory, raw["shards"], "train"),
            validation=_parse_shards(directory, raw["shards"], "val"),
            version=int(raw["version"]),
            bos_id=None if raw.get("bos_id") is None else int(raw["bos_id"]),
            eos_id=None if raw.get("eos_id") is None else int(raw["eos_id"]),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise _manifest_error(directory, f"lacks a field ({e})") from None
    if manifest.dtype not in ("uint16", "uint32", "int32"):
        raise _manifest_error(directory, f"names the unknown dtype {manifest.dtype!r}")
    if manifest.version >= 2:
        missing = [s.file for s in manifest.train + manifest.validation if s.index is None]
        if missing:
            raise _manifest_error(directory, f"names no index file for {missing[0]}")
    return manifest


def read_manifest(directory: str) -> Manifest:
    """The manifest of a prepared folder (cached while the file is unchanged). Raises
    DataError when it is unreadable or of another format (or, in a bucket, missing)."""
    if storage.is_remote(directory):
        file = storage.join(directory, MANIFEST_FILE)
        try:
            text = storage.read_bytes(file)
        except FileNotFoundError:
            raise DataError(
                f"DataConfig.path: {directory!r} holds no {MANIFEST_FILE}, so it is not a "
                f"prepared corpus (or its preparation did not finish: the manifest is written "
                f"last). Fix: prepare the corpus into it (python -m diffjax.data.prepare "
                f"INPUT... prepare.tokenizer=T prepare.out={directory}), or point data.path at the prefix "
                f"that holds {MANIFEST_FILE}"
            ) from None
        return _parse_manifest(directory, text)
    st = os.stat(os.path.join(directory, MANIFEST_FILE))
    return _read_manifest(os.path.abspath(directory), st.st_size, st.st_mtime_ns)


def _shard_manifest(path: str) -> Manifest | None:
    """The manifest of the prepared folder that lists the shard ``path``, or None."""
    directory = os.path.dirname(os.path.abspath(path))
    if not is_prepared_dir(directory):
        return None
    manifest = read_manifest(directory)
    name = os.path.basename(path)
    listed = any(s.file == name for s in manifest.train + manifest.validation)
    return manifest if listed else None


def check_manifest_vocab(directory: str, manifest: Manifest, vocab_size: int) -> None:
    """A model of ``vocab_size`` ids can embed every token of the prepared folder; else a
    DataError naming model.vocab_size."""
    if vocab_size < manifest.vocab_size:
        raise DataError(
            f"model.vocab_size: {vocab_size} is smaller than the vocab_size "
            f"{manifest.vocab_size} of the tokenizer {manifest.tokenizer_name!r} that prepared "
            f"{directory!r} (its {MANIFEST_FILE}). Fix: set model.vocab_size >= "
            f"{manifest.vocab_size}, or prepare the corpus with this model's tokenizer"
        )


def check_manifest_tokenizer(directory: str, manifest: Manifest, tokenizer: str | None) -> None:
    """The run's ``data.tokenizer`` (when set) is the tokenizer that prepared the folder,
    compared by sha256 of the tokenizer.json bytes (or ``"byte"``); else a DataError."""
    if tokenizer is None:
        return
    mine = tokenizer_identity(tokenizer)
    if mine != manifest.tokenizer:
        raise DataError(
            f"DataConfig.tokenizer: the run names {tokenizer!r} ({mine[:12]}), but {directory!r} "
            f"was prepared with {manifest.tokenizer_name!r} ({manifest.tokenizer[:12]}; its "
            f"{MANIFEST_FILE}). Fix: set data.tokenizer to the tokenizer that prepared the "
            f"folder, or prepare the corpus again with prepare.tokenizer={tokenizer}"
        )


def _shard_pieces(
    directory: str, shards: Sequence[Shard], dtype: str, sizes: dict[str, int] | None
) -> list[_Piece]:
    """``sizes``: a bucket's objects under ``directory`` (one listing for every shard and
    index of a load); None for a local folder."""
    pieces = []
    item = np.dtype(dtype).itemsize
    if sizes is not None:
        for shard in shards:
            size = sizes.get(shard.file)
            if size != shard.tokens * item:
                raise _manifest_error(
                    directory,
                    f"lists {shard.file} with {shard.tokens} {dtype} tokens "
                    f"({shard.tokens * item} bytes), but the object is "
                    f"{'missing' if size is None else f'{size} bytes'}",
                )
            pieces.append(_RemotePiece(storage.join(directory, shard.file), dtype, shard.tokens))
        return pieces
    for shard in shards:
        full = os.path.join(directory, shard.file)
        if not os.path.isfile(full) or os.path.getsize(full) != shard.tokens * item:
            raise _manifest_error(
                directory,
                f"lists {shard.file} with {shard.tokens} {dtype} tokens, but the file is "
                f"{'missing' if not os.path.isfile(full) else 'of another size'}",
            )
        pieces.append(_FilePiece(full, dtype, shard.tokens))
    return pieces


def _index_error(directory: str, shard: Shard, problem: str) -> DataError:
    return DataError(
        f"DataConfig.path: the document index {shard.index} of {storage.join(directory, shard.file)!r} "
        f"{problem}, so it does not match its shard. Fix: prepare the folder again with python -m "
        f"diffjax.data.prepare (its shards are kept when unchanged), or train without document "
        f"masking (data.document_mask=false)"
    )


@functools.lru_cache(maxsize=256)
def _local_index(directory: str, shard: Shard, first: bool, size: int, mtime_ns: int) -> np.ndarray:
    """A shard's index file, memory-mapped and checked (cached while the file is unchanged)."""
    full = os.path.join(directory, shard.index)
    starts = np.memmap(full, dtype=INDEX_DTYPE, mode="r") if size else np.zeros((0,), np.int64)
    _check_index(directory, shard, starts, first)
    return starts


def _check_index(directory: str, shard: Shard, starts: np.ndarray, first: bool) -> None:
    """Offsets sorted, within the shard, one per document that begins in it (the split's first
    shard: from offset 0)."""
    if len(starts) != shard.documents:
        raise _index_error(
            directory,
            shard,
            f"holds {len(starts)} starts for the {shard.documents} documents the manifest says "
            "begin in it",
        )
    if len(starts) and (int(starts[0]) < 0 or int(starts[-1]) >= shard.tokens):
        raise _index_error(
            directory, shard, f"holds offsets outside the shard's {shard.tokens} tokens"
        )
    if len(starts) > 1 and bool(np.any(np.diff(starts) < 0)):
        raise _index_error(directory, shard, "is not sorted")
    if first and (not len(starts) or int(starts[0]) != 0):
        raise _index_error(directory, shard, "does not start a document at the split's offset 0")


def _shard_index(
    directory: str, shards: Sequence[Shard], sizes: dict[str, int] | None
) -> DocumentIndex:
    """The document starts of the stream of ``shards`` from their index files: memory-mapped
    from a folder, fetched once (concurrently) from a bucket (``sizes``: its listing, as in
    :func:`_shard_pieces`); each checked against its shard."""
    item = np.dtype(INDEX_DTYPE).itemsize
    offsets = np.concatenate([[0], np.cumsum([s.tokens for s in shards])]).astype(np.int64)
    if sizes is not None:
        for shard in shards:
            if sizes.get(shard.index) != shard.documents * item:
                raise _index_error(
                    directory,
                    shard,
                    "is missing"
                    if shard.index not in sizes
                    else f"has {sizes[shard.index]} "
                    f"bytes for {shard.documents} documents of {item} bytes",
                )
        blobs = storage.read_ranges(
            [storage.join(directory, s.index) for s in shards],
            [0] * len(shards),
            [s.documents * item for s in shards],
        )
        arrays = [np.frombuffer(b, dtype=INDEX_DTYPE) for b in blobs]
        for i, (shard, starts) in enumerate(zip(shards, arrays)):
            _check_index(directory, shard, starts, first=i == 0)
    else:
        arrays = []
        for shard in shards:
            full = os.path.join(directory, shard.index)
            if not os.path.isfile(full):
                raise _index_error(directory, shard, "is missing")
            st = os.stat(full)
            if st.st_size != shard.documents * item:
                raise _index_error(
                    directory,
                    shard,
                    f"has {st.st_size} bytes for {shard.documents} documents of {item} bytes",
                )
            first = len(arrays) == 0
            arrays.append(_local_index(directory, shard, first, st.st_size, st.st_mtime_ns))
    return DocumentIndex([(int(o), a) for o, a in zip(offsets, arrays)])


def _prepared_documents(
    directory: str,
    manifest: Manifest,
    train: Sequence[Shard],
    val: Sequence[Shard],
    sizes: dict[str, int] | None,
) -> tuple[Boundaries | None, Boundaries | None, str]:
    """Each split's boundaries and how they are known: the index of a version-2 folder, else
    the manifest's BOS/EOS ids, else none (and why)."""
    if manifest.version >= 2:
        return (
            _shard_index(directory, train, sizes),
            _shard_index(directory, val, sizes) if val else None,
            "index",
        )
    if manifest.bos_id is None and manifest.eos_id is None:
        return (
            None,
            None,
            (
                f"{directory!r} was prepared by an older diffjax (no document index) with a tokenizer "
                f"that has neither a BOS nor an EOS id"
            ),
        )
    marks = SpecialTokens(manifest.bos_id, manifest.eos_id)
    return marks, marks, "BOS/EOS ids"


def load_prepared_corpus(config: DataConfig, directory: str) -> Corpus:
    """A prepared folder: its train shards for training and its validation shards for
    validation (the split is the one ``prepare`` made, by document), in its manifest's dtype.
    ``max_files`` caps the shards of each split."""
    t0 = time.perf_counter()
    if storage.is_remote(directory):
        storage.check_access(directory, what="data.path", write=False)
    manifest = read_manifest(directory)
    check_manifest_tokenizer(directory, manifest, config.tokenizer)
    train, val = manifest.train, manifest.validation
    if config.max_files is not None:
        train, val = train[: config.max_files], val[: config.max_files]
    if not train:
        raise _manifest_error(directory, "lists no train shards")
    if config.val_fraction > 0 and not val:
        raise DataError(
            f"DataConfig.val_fraction: {directory!r} holds no validation shards (prepared with "
            f"prepare.val_fraction=0, or too few documents). Fix: set data.val_fraction=0, or "
            f"prepare it again with prepare.val_fraction > 0"
        )
    # a bucket's prefix is listed once for the shards and indexes of both splits
    sizes = storage.object_sizes(directory) if storage.is_remote(directory) else None
    train_pieces = _shard_pieces(directory, train, manifest.dtype, sizes)
    val_pieces = _shard_pieces(directory, val, manifest.dtype, sizes)
    train_docs, val_docs, note = (None, None, "")
    if config.masks_documents:
        train_docs, val_docs, note = _prepared_documents(directory, manifest, train, val, sizes)
    return Corpus(
        kind="tokens",
        path=config.path,
        files=tuple(getattr(p, "path", None) or p.url for p in train_pieces + val_pieces),
        train=TokenStream(train_pieces),
        validation=TokenStream(val_pieces),
        train_files=len(train_pieces),
        validation_files=len(val_pieces),
        split_by="document",
        seconds=time.perf_counter() - t0,
        train_documents=train_docs,
        validation_documents=val_docs,
        documents_note=note,
    )


def load_token_corpus(config: DataConfig) -> Corpus:
    """The ``.npy``/``.bin`` files of ``config.path`` as one memory-mapped stream (files in
    sorted order), split at ``1 - val_fraction`` of its length; or, when ``config.path`` is a
    prepared folder (it holds ``manifest.json``), its train and validation shards."""
    patterns = _split_patterns(config.path)
    if storage.is_remote(config.path):  # one prepared prefix (DataConfig refuses the rest)
        return load_prepared_corpus(config, config.path.rstrip("/"))
    prepared = [p for p in patterns if is_prepared_dir(os.path.expanduser(p))]
    if prepared:
        if len(patterns) > 1:
            raise DataError(
                f"DataConfig.path: {prepared[0]!r} is a prepared folder ({MANIFEST_FILE}), "
                f"given with other paths. Fix: give the prepared folder alone as data.path"
            )
        return load_prepared_corpus(config, os.path.expanduser(prepared[0]))
    t0 = time.perf_counter()
    files = _expand(config.path, field="path", want=lambda name: name.endswith(TOKEN_EXTENSIONS))
    if config.max_files is not None:
        files = files[: config.max_files]
    pieces = [
        _FilePiece(full, config.tokens.dtype, _check_token_file(full, config.tokens.dtype))
        for _, full in files
    ]
    stream = TokenStream(pieces)
    n = len(stream)
    cut = n - int(round(config.val_fraction * n))
    marks, note = _raw_token_documents(config)
    return Corpus(
        kind="tokens",
        path=config.path,
        files=tuple(f[1] for f in files),
        train=stream.sub(0, cut),
        validation=stream.sub(cut, n),
        train_files=len(files),
        validation_files=len(files) if cut < n else 0,
        split_by="stream",
        seconds=time.perf_counter() - t0,
        train_documents=marks,
        validation_documents=marks,
        documents_note=note,
    )


def _raw_token_documents(config: DataConfig) -> tuple[SpecialTokens | None, str]:
    """Raw token files hold no index: their boundaries are the BOS/EOS ids of
    ``data.tokenizer`` when it names one that has them."""
    if config.tokenizer is None:
        return None, (
            f"the raw token files {config.path!r} carry no document index and data.tokenizer is "
            f"unset, so their BOS/EOS ids are unknown"
        )
    if config.tokenizer == BYTE_TOKENIZER:
        return SpecialTokens(BOS, EOS), "BOS/EOS ids"
    tok = HFTokenizer(config.tokenizer)
    if tok.bos_id is None and tok.eos_id is None:
        return None, (
            f"the raw token files {config.path!r} carry no document index and the tokenizer "
            f"{config.tokenizer!r} has neither a BOS nor an EOS id"
        )
    return SpecialTokens(tok.bos_id, tok.eos_id), "BOS/EOS ids"


def load_corpus(config: DataConfig) -> Corpus:
    """The corpus of a stdlib/text/tokens config (and the haystack corpus of a needle config)."""
    if config.source == "tokens":
        return load_token_corpus(config)
    return load_text_corpus(config)


# ============================================================================ windows
class WindowSource:
    """Random access to the windows of a stream: example ``i`` is
    ``w = stream[i*T : i*T + T + 1]`` as ``inputs = w[:-1]``, ``targets = w[1:]``, ``weights``
    = 1 (int32 / float32). With ``documents`` (the stream's boundaries) each example also
    carries ``segment_ids`` and ``positions`` and weighs no target across a boundary
    (:func:`diffjax.data.documents.mark_documents`). A grain ``MapDataset`` source
    (``__len__``, ``__getitem__``)."""

    validation_metrics: dict = {}  # a corpus: validation loss and perplexity only

    def __init__(self, stream: TokenStream, seq_len: int, documents: Boundaries | None = None):
        self.stream, self.seq_len, self.documents = stream, int(seq_len), documents
        self._len = max(0, (len(stream) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self._getitems([index])[0]

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """``[self[i] for i in indices]`` with the reads in flight together (grain's batched
        read: a batch of windows from a bucket is one round trip, not one per window)."""
        T = self.seq_len
        for index in indices:
            if not 0 <= int(index) < self._len:
                raise IndexError(f"window {index} out of range [0, {self._len})")
        starts = [int(i) * T for i in indices]
        windows = self.stream.read_many([(a, a + T + 1) for a in starts])
        if self.documents is None:
            ones = np.ones((T,), np.float32)
            return [{"inputs": w[:-1], "targets": w[1:], "weights": ones.copy()} for w in windows]
        stacked = np.stack(windows)
        rows, offsets = self.documents.batch_starts(np.array(starts, np.int64), stacked)
        marks = mark_windows(T, len(windows), rows, offsets)
        return [
            {"inputs": w[:-1], "targets": w[1:], **{k: v[i] for k, v in marks.items()}}
            for i, w in enumerate(windows)
        ]

    def __repr__(self) -> str:
        docs = "" if self.documents is None else f", documents by {self.documents!r}"
        return f"WindowSource({self._len} windows of {self.seq_len} + 1 tokens{docs})"
