"""Which attention implementation is fastest where it was measured: the table behind
``attention_impl="auto"``.

``impl_table.json`` (beside this module) holds what ``benchmarks/attention.py --table`` measured
on a device: per platform and GPU compute capability, attention kind ("v1", "v2", "standard"),
dtype, head width, sequence length and whether documents were kept apart (segment ids), the
forward+backward milliseconds of each implementation that ran, with the device, jax version and
date. :func:`fastest` reads it: among the implementations that can run a call, the one with the
smallest time in the entry nearest to the call (the same platform, capability, kind, dtype and
segments; then the nearest head width and length, on a log scale). Where nothing was measured it
answers None and ``"auto"`` keeps its default (the Pallas kernels on a GPU or TPU): no guess
stands in for a measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any, Iterable, Sequence

PATH = pathlib.Path(__file__).with_name("impl_table.json")
KINDS = ("v1", "v2", "standard")
# what an entry must say (ms: implementation -> forward+backward milliseconds)
FIELDS = ("platform", "kind", "dtype", "head_dim", "seq_len", "segments", "ms")


@dataclasses.dataclass(frozen=True)
class Pick:
    """The implementation :func:`fastest` chose and the measurement it chose from."""

    impl: str
    entry: dict[str, Any]

    def describe(self) -> str:
        e = self.entry
        times = ", ".join(f"{k} {v:.3g} ms" for k, v in sorted(e["ms"].items(), key=lambda x: x[1]))
        where = e.get("device", e["platform"])
        return (
            f"measured fastest ({where}, {e.get('date', 'undated')}, jax {e.get('jax', '?')}: "
            f"{e['kind']} d={e['head_dim']} T={e['seq_len']} "
            f"{'documents apart' if e['segments'] else 'no segments'} {e['dtype']}, "
            f"fwd+bwd {times})"
        )


def check_entry(entry: dict[str, Any]) -> None:
    """A ValueError naming what an entry lacks or gets wrong."""
    missing = [f for f in FIELDS if f not in entry]
    if missing:
        raise ValueError(f"impl table entry {entry!r} lacks {', '.join(missing)}")
    if entry["kind"] not in KINDS:
        raise ValueError(f"impl table entry: unknown kind {entry['kind']!r}; use one of {KINDS}")
    if not entry["ms"] or not all(v > 0 for v in entry["ms"].values()):
        raise ValueError(f"impl table entry {entry!r}: ms must map implementations to times > 0")


@functools.cache
def _entries(path: str) -> tuple[dict[str, Any], ...]:
    p = pathlib.Path(path)
    if not p.exists():
        return ()
    entries = tuple(json.loads(p.read_text())["entries"])
    for e in entries:
        check_entry(e)
    return entries


def entries(path: str | pathlib.Path = PATH) -> tuple[dict[str, Any], ...]:
    """The table's entries (none when the file is absent)."""
    return _entries(str(path))


def _matches(e: dict, platform: str, capability, kind: str, dtype: str, segments: bool) -> bool:
    if (e["platform"], e["kind"], e["dtype"], bool(e["segments"])) != (
        platform,
        kind,
        dtype,
        segments,
    ):
        return False
    cc = e.get("compute_capability")
    return platform != "gpu" or capability is None or cc is None or tuple(cc) == tuple(capability)


def fastest(
    *,
    platform: str,
    compute_capability: Sequence[int] | None,
    kind: str,
    dtype: str,
    head_dim: int,
    seq_len: int,
    segments: bool,
    eligible: Iterable[str],
    table: Sequence[dict[str, Any]] | None = None,
) -> Pick | None:
    """The fastest of ``eligible`` in the nearest measurement of this call (module doc), or
    None where none was measured (or none of ``eligible`` ran there)."""
    eligible = set(eligible)
    rows = [
        e
        for e in (entries() if table is None else table)
        if _matches(e, platform, compute_capability, kind, dtype, segments)
        and eligible & set(e["ms"])
    ]
    if not rows:
        return None

    def distance(e):
        return (abs(math.log2(e["head_dim"] / head_dim)), abs(math.log2(e["seq_len"] / seq_len)))

    entry = min(rows, key=distance)
    impl = min((i for i in entry["ms"] if i in eligible), key=lambda i: entry["ms"][i])
    return Pick(impl, entry)


def merged(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with every entry of ``new`` replacing the one measured for the same device kind,
    capability, attention kind, dtype, head width, length and segments (what a benchmark run
    writes back)."""

    def key(e):
        cc = e.get("compute_capability")
        return (
            e["platform"],
            tuple(cc) if cc else None,
            e["kind"],
            e["dtype"],
            e["head_dim"],
            e["seq_len"],
            bool(e["segments"]),
        )

    out = {key(e): e for e in old}
    for e in new:
        check_entry(e)
        out[key(e)] = e
    return sorted(out.values(), key=key)


def write(new: Sequence[dict[str, Any]], path: str | pathlib.Path = PATH) -> None:
    """Merge ``new`` into the table at ``path`` (:func:`merged`) and write it."""
    p = pathlib.Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {"entries": []}
    doc["entries"] = merged(doc["entries"], new)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    _entries.cache_clear()
