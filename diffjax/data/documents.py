"""Document boundaries: where documents start in a token stream, and what a training window
makes of them (segment ids, positions from each document's start, no target across a
boundary).

A corpus is one stream of concatenated documents. Its boundaries come from

- :class:`DocumentIndex`: the sorted stream offsets at which documents start (the text sources
  record them while concatenating; ``python -m diffjax.data.prepare`` writes one index file per
  shard, read by memory map or, from a bucket, fetched once), exact for any tokenizer;
- :class:`SpecialTokens`: the tokenizer's BOS/EOS ids (a document starts at a BOS and after an
  EOS), for token files prepared without an index.

:func:`mark_documents` turns a window of ``T + 1`` tokens and the starts inside it into the
arrays a batch carries (:data:`DOCUMENT_ARRAYS`)::

    stream   ... d0 d0 EOS | BOS d1 d1 d1 EOS | BOS d2 ...
    inputs       d0 d0 EOS   BOS d1 d1 d1 EOS   BOS
    segment_ids   1  1  1     2  2  2  2  2      3      a new id at each document start
    positions     0  1  2     0  1  2  3  4      0      restart there (the window's first
                                                        partial document counts from 0)
    targets      d0 EOS BOS  d1 d1 d1 EOS BOS   d2
    weights       1  1  0     1  1  1  1  0      1      no target across a boundary

The target that would cross a boundary (the first token of the next document, predicted from
the last token of this one) is weighted 0: attention cannot see the next document, so the
prediction would be a guess about a document the model has not started (with BOS/EOS framing it
is the BOS after an EOS, free to predict, and still not this document's). The document's own
end token stays a target: the model learns where documents end.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DOCUMENT_ARRAYS = ("segment_ids", "positions")
INDEX_DTYPE = "<i8"  # a prepared shard's index: little-endian int64 offsets within the shard


class DocumentIndex:
    """The document starts of a stream: sorted offsets (repeats allowed: an empty document),
    held in pieces ``(offset, starts)`` whose ``starts`` are relative to ``offset`` (numpy
    arrays or memory maps; a piece is searched, never read whole)."""

    def __init__(self, pieces: Sequence[tuple[int, np.ndarray]]):
        self._pieces = [(int(offset), starts) for offset, starts in pieces]

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> DocumentIndex:
        """The index of documents of ``lengths`` tokens, concatenated from offset 0."""
        lengths = np.asarray(lengths, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths[:-1])]) if len(lengths) else lengths
        return cls([(0, starts.astype(np.int64))])

    def __len__(self) -> int:
        return sum(len(s) for _, s in self._pieces)

    def between(self, start: int, stop: int) -> np.ndarray:
        """The starts in ``[start, stop)`` (int64 stream offsets, sorted)."""
        out = []
        for offset, starts in self._pieces:
            a, b = int(start) - offset, int(stop) - offset
            lo, hi = np.searchsorted(starts, [a, b], side="left")
            if hi > lo:
                out.append(np.asarray(starts[lo:hi], np.int64) + offset)
        if not out:
            return np.zeros((0,), np.int64)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def sub(self, start: int, stop: int) -> DocumentIndex:
        """The index of the view ``stream[start:stop]`` (offsets relative to ``start``)."""
        starts = self.between(start, stop) - int(start)
        return DocumentIndex([(0, starts)])

    def window_starts(self, start: int, window: np.ndarray) -> np.ndarray:
        """Offsets ``1 <= t < len(window)`` at which a document starts in the window that
        begins at stream offset ``start``."""
        return self.batch_starts(np.array([start]), np.asarray(window)[None])[1]

    def batch_starts(
        self, starts: np.ndarray, windows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`window_starts` of every window ``windows[i]`` (``[N, L]``) at stream offset
        ``starts[i]``, as ``(row, offset)`` pairs (one search per piece for the whole batch)."""
        starts = np.asarray(starts, np.int64)
        length = windows.shape[1]
        rows, offsets = [], []
        for offset, piece in self._pieces:
            lo = np.searchsorted(piece, starts + 1 - offset, side="left")
            hi = np.searchsorted(piece, starts + length - offset, side="left")
            counts = hi - lo
            if not counts.sum():
                continue
            row = np.repeat(np.arange(len(starts)), counts)
            first = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
            at = first + np.arange(len(row))
            rows.append(row)
            offsets.append(np.asarray(piece[at], np.int64) + offset - starts[row])
        if not rows:
            return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
        return np.concatenate(rows), np.concatenate(offsets)

    def __repr__(self) -> str:
        return f"DocumentIndex({len(self):,} document starts)"


class SpecialTokens:
    """Boundaries from the tokenizer's special ids: a document starts at each ``bos`` and
    right after each ``eos`` (either may be None, not both)."""

    def __init__(self, bos: int | None, eos: int | None):
        if bos is None and eos is None:
            raise ValueError("SpecialTokens needs a BOS or an EOS id")
        self.bos, self.eos = bos, eos

    def window_starts(self, start: int, window: np.ndarray) -> np.ndarray:
        return self.batch_starts(np.array([start]), np.asarray(window)[None])[1]

    def batch_starts(
        self, starts: np.ndarray, windows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(row, offset)`` of each document start inside the windows ``[N, L]``."""
        del starts
        hit = np.zeros((windows.shape[0], max(windows.shape[1] - 1, 0)), bool)
        if self.bos is not None:
            hit |= windows[:, 1:] == self.bos
        if self.eos is not None:
            hit |= windows[:, :-1] == self.eos
        rows, offsets = np.nonzero(hit)
        return rows.astype(np.int64), offsets.astype(np.int64) + 1

    def __repr__(self) -> str:
        return f"SpecialTokens(bos={self.bos}, eos={self.eos})"


Boundaries = DocumentIndex | SpecialTokens


def mark_documents(num_inputs: int, starts: np.ndarray) -> dict[str, np.ndarray]:
    """``segment_ids``, ``positions`` (int32 ``[T]``) and ``weights`` (float32 ``[T]``) of a
    window with ``T = num_inputs`` inputs (``T + 1`` tokens) in which documents start at the
    offsets ``starts`` (in ``[1, T]``; offset ``T`` is the last target's; repeats allowed).
    See the module doc."""
    starts = np.asarray(starts, np.int64)
    marks = mark_windows(num_inputs, 1, np.zeros_like(starts), starts)
    return {k: v[0] for k, v in marks.items()}


def mark_windows(
    num_inputs: int, num_windows: int, rows: np.ndarray, starts: np.ndarray
) -> dict[str, np.ndarray]:
    """:func:`mark_documents` of ``num_windows`` windows at once (``[N, T]`` arrays), with the
    document starts given as ``(rows[i], starts[i])`` pairs."""
    t, n = int(num_inputs), int(num_windows)
    begins = np.zeros((n, t + 1), bool)
    begins[:, 0] = True
    begins[np.asarray(rows, np.int64), np.asarray(starts, np.int64)] = True
    index = np.arange(t, dtype=np.int32)
    first = np.maximum.accumulate(np.where(begins[:, :t], index, 0), axis=1)
    return {
        "segment_ids": np.cumsum(begins[:, :t], axis=1, dtype=np.int32),
        "positions": (index - first).astype(np.int32),
        "weights": (~begins[:, 1:]).astype(np.float32),
    }
