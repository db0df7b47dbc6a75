"""The byte-level tokenizer: 256 byte values and three special tokens (vocabulary 259)."""

from __future__ import annotations

import os

import numpy as np

from diffjax.config import BYTE_SPECIAL_TOKENS as SPECIAL_TOKENS
from diffjax.infra import storage

from diffjax.data.config import DataError

BOS = SPECIAL_TOKENS["<bos>"]  # beginning of a document
EOS = SPECIAL_TOKENS["<eos>"]  # end of a document
PAD = SPECIAL_TOKENS["<pad>"]  # filler; never a target that counts (weight 0)
VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus ``BOS`` = 256, ``EOS`` = 257, ``PAD`` = 258.

    >>> tok = ByteTokenizer()
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
    """

    bos_id = BOS
    eos_id = EOS
    pad_id = PAD

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(
        self, text: str | bytes, *, add_bos: bool = False, add_eos: bool = False
    ) -> np.ndarray:
        """``text`` (``str`` is UTF-8 encoded) as an int32 array of byte ids, optionally
        framed by ``BOS`` / ``EOS``."""
        if isinstance(text, str):
            data = text.encode("utf-8")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TypeError(f"ByteTokenizer.encode takes str or bytes, got {type(text).__name__}")
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        if add_bos or add_eos:
            parts = [np.array([BOS], np.int32)] if add_bos else []
            parts.append(ids)
            if add_eos:
                parts.append(np.array([EOS], np.int32))
            ids = np.concatenate(parts)
        return ids

    def decode(self, ids) -> str:
        """The text of ``ids`` (any integer array-like, any shape, flattened); special tokens and
        ids outside 0..255 are skipped; invalid UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            arr = arr.astype(np.int64)
        arr = arr[(arr >= 0) & (arr < 256)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259, BOS=256, EOS=257, PAD=258)"


TOKENIZER_JSON = "tokenizer.json"


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (e.g. a checkpoint's) through the ``tokenizers`` package.

    ``path``: the file, or a directory holding it (a checkpoint directory), local or ``gs://``;
    nothing is downloaded from a hub. ``bos_id`` / ``eos_id`` / ``pad_id`` come from the directory's
    ``tokenizer_config.json`` (``bos_token``, ...) when it names them, else None.
    """

    def __init__(self, path: str):
        path = os.fspath(path) if not storage.is_remote(path) else str(path)
        file = storage.join(path, TOKENIZER_JSON) if storage.isdir(path) else path
        if not storage.exists(file):
            raise DataError(
                f"DataConfig.tokenizer: {file!r} does not exist. Fix: pass a "
                f"tokenizer.json file or a directory holding one (a Hugging Face checkpoint, "
                f"local or gs://; nothing is downloaded from a hub), or 'byte'"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - a dependency of diffjax
            raise DataError(
                f"DataConfig.tokenizer: reading {file!r} needs the 'tokenizers' "
                f"package ({e}). Fix: pip install tokenizers"
            ) from None
        try:
            self._tok = Tokenizer.from_str(storage.read_text(file))
        except Exception as e:  # noqa: BLE001 - the tokenizers error types are not public
            raise DataError(
                f"DataConfig.tokenizer: {file!r} is not a tokenizer.json ({e}). Fix: "
                f"pass the tokenizer.json of a Hugging Face checkpoint"
            ) from None
        self.path = file
        special: dict = {}
        cfg_file = storage.join(str(storage.path(file).parent), "tokenizer_config.json")
        if storage.exists(cfg_file):
            special = storage.read_json(cfg_file)
        # transformers' split_special_tokens: a special token's spelling in a text is text
        self._tok.encode_special_tokens = bool(special.get("split_special_tokens", False))

        def token_id(key: str) -> int | None:
            tok = special.get(key)
            if isinstance(tok, dict):  # {"content": "<s>", ...}
                tok = tok.get("content")
            return None if tok is None else self._tok.token_to_id(tok)

        self.bos_id, self.eos_id, self.pad_id = (
            token_id("bos_token"),
            token_id("eos_token"),
            token_id("pad_token"),
        )

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to ``vocab_size - 1`` (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str | bytes, *, add_bos: bool = False, add_eos: bool = False
    ) -> np.ndarray:
        """``text`` as int32 ids (no special tokens of the tokenizer's template), optionally
        framed by ``bos_id`` / ``eos_id`` when the tokenizer has them."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode takes str or bytes, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return np.asarray(ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (int32), encoded in parallel."""
        return [
            np.asarray(e.ids, np.int32)
            for e in self._tok.encode_batch(texts, add_special_tokens=False)
        ]

    def decode(self, ids) -> str:
        """The text of ``ids`` (any integer array-like, flattened), special tokens skipped."""
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        return self._tok.decode(arr.tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id})"
        )


def load_tokenizer(spec: str | None) -> ByteTokenizer | HFTokenizer:
    """``None`` or ``"byte"``: the byte tokenizer; otherwise :class:`HFTokenizer` of ``spec``
    (a ``tokenizer.json`` or a directory holding one)."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
