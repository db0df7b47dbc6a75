"""The byte-level tokenizer: 256 byte values and three special tokens (vocabulary 259)."""

from __future__ import annotations

import numpy as np

BOS = 256  # beginning of a document
EOS = 257  # end of a document
PAD = 258  # filler; never a target that counts (weight 0)
VOCAB_SIZE = 259
SPECIAL_TOKENS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD}


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

    def encode(self, text: str | bytes, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
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
