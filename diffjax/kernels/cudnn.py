"""DIFF attention and its twin on cuDNN's flash attention (NVIDIA GPUs), through jax.

The compositions are :mod:`._compose`'s: standard attention and DIFF V2 are one cuDNN call each
(V2 over its 2h query heads, paired as the official ``multihead_flashdiffv2.py`` pairs them), DIFF
V1 two calls with a value twice as wide as q/k where cuDNN takes one, else four. Gradients are
jax's own cuDNN backward.

Two entry points of jax:

- ``jax.nn.dot_product_attention(implementation="cudnn")``, the public one, for the plain case
  (no segments, the value as wide as q/k);
- ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, a private function, for
  what the public one does not take: cuDNN's packed layout (several documents per row, from
  ``segment_ids``) and a value wider than q/k (Hopper or newer with cuDNN >= 9.10). It is used in
  the jax releases :data:`PRIVATE_JAX` only, and only when its signature has the arguments used;
  elsewhere a wide value goes in halves (four calls for V1) and segment ids are refused with the
  fix (:func:`unsupported`).

Documents kept apart (``segment_ids`` ``[B, T]``, each id one contiguous run of tokens, as
:mod:`diffjax.data` numbers documents) become cuDNN's packed layout: the start and length of
every run. Its arrays have a fixed number of slots, :func:`segment_slots` per row (a row's runs
may spill into the free slots of earlier rows); a batch with more runs than fit makes the
output NaN, never a silently wrong mask. In the packed layout jax scales the key/value offsets by
the query's heads and width, so keys and values are given the query's heads (GQA's kv heads
repeated) and the query's width (V1's value in halves): jax's tests cover packing for that
shape only.

``implementation="xla"`` runs the same compositions on XLA (what a CPU target runs, and what the
tests compare against the reference math): the public call with ``implementation="xla"``, and
for the packed layout a dense mask built from the very offsets and lengths cuDNN would get.
cuDNN takes bfloat16 and float16 only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

import jax
import jax.numpy as jnp

from . import _compose

IMPLEMENTATIONS = ("cudnn", "xla")
DTYPES = ("bfloat16", "float16")
# the jax releases whose private cuDNN function is used, [low, high): lowered and compiled for
# an H200 with 0.10.2 here; on a GPU the kernel self-check runs each composition first
PRIVATE_JAX = ((0, 10), (0, 12))
_PRIVATE_ARGS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type")
WIDE_VALUE_CUDNN = 91000  # cuDNN 9.10: a value head dim other than q/k's (Hopper and newer)


# ---------------------------------------------------------------------------- jax's functions
def _jax_version() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


@functools.cache
def private_api():
    """jax's private cuDNN attention module, or None when this jax is outside
    :data:`PRIVATE_JAX` or its function lacks the arguments used."""
    low, high = PRIVATE_JAX
    if not low <= _jax_version() < high:
        return None
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return None
    params = inspect.signature(fa.dot_product_attention).parameters
    if not all(a in params for a in _PRIVATE_ARGS) or not hasattr(fa, "MaskType"):
        return None
    return fa


def wide_value_supported() -> bool:
    """Whether cuDNN here takes a value wider than q/k: the private function, a GPU of compute
    capability 9.0 or newer and cuDNN >= 9.10 (what jax itself checks before the call)."""
    fa = private_api()
    if fa is None:
        return False
    try:
        return bool(fa.check_compute_capability("9.0")) and (
            fa.check_cudnn_version() >= WIDE_VALUE_CUDNN
        )
    except Exception:  # no cuDNN, or no GPU
        return False


@contextlib.contextmanager
def compile_only(cudnn_version: int = 91200, compute_capability: tuple[int, int] = (9, 0)):
    """Trace for a GPU that is not here (a deviceless compile, the planner): jax's cuDNN checks
    read this version and compute capability instead of a device's. Restored on exit."""
    fa = private_api()
    if fa is None:
        yield
        return
    saved = fa.check_cudnn_version, fa.check_compute_capability

    def capability(wanted: str) -> bool:
        return compute_capability >= tuple(int(x) for x in wanted.split("."))

    fa.check_cudnn_version, fa.check_compute_capability = (lambda: cudnn_version), capability
    try:
        yield
    finally:
        fa.check_cudnn_version, fa.check_compute_capability = saved


# ---------------------------------------------------------------------------- packed layout
def segment_slots(seq_len: int) -> int:
    """The packed layout's slots per row: every row's documents fit while they average at least
    128 tokens (and 8 documents per row at any length)."""
    return max(8, seq_len // 128)


def segment_layout(segment_ids: jax.Array, slots: int):
    """cuDNN's packed layout of ``segment_ids`` ``[B, T]`` (each id one contiguous run):
    ``(offsets [B, slots + 1], lengths [B, slots], fits)`` in jax's convention (a slot's start
    relative to its own row, -1 in free slots). The runs fill the slots in order, row by row;
    a run may take a slot of an earlier row (jax adds that row's start back), so the batch fits
    while no leading rows hold more runs than their slots (``fits``, a bool scalar)."""
    b, t = segment_ids.shape
    capacity = b * slots
    starts = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    ).reshape(-1)
    n = jnp.sum(starts)
    # the absolute token index of the first capacity + 1 run starts, b * t past the last
    first = jnp.nonzero(starts, size=capacity + 1, fill_value=b * t)[0].astype(jnp.int32)
    index = jnp.arange(capacity, dtype=jnp.int32)
    used = index < n
    slot_row = index // slots
    lengths = jnp.where(used, first[1:] - first[:-1], -1)
    offsets = jnp.where(used, first[:-1] - slot_row * t, -1)
    fits = (n <= capacity) & jnp.all(jnp.where(used, first[:-1] // t >= slot_row, True))
    offsets = jnp.concatenate([offsets.reshape(b, slots), jnp.full((b, 1), -1, jnp.int32)], 1)
    return offsets, lengths.reshape(b, slots), fits


def packed_segment_ids(offsets: jax.Array, lengths: jax.Array, seq_len: int) -> jax.Array:
    """``[B, T]`` ids from a packed layout, as cuDNN reads it (for the XLA path): a token gets
    the flat index of the slot whose run covers it (-1 - its index where none does, so it
    shares no segment)."""
    b, slots = lengths.shape
    row = jnp.arange(b, dtype=jnp.int32)[:, None] * seq_len
    start = jnp.where(offsets[:, :slots] >= 0, offsets[:, :slots] + row, -1).reshape(-1)
    end = start + jnp.maximum(lengths.reshape(-1), 0)
    token = jnp.arange(b * seq_len, dtype=jnp.int32)[:, None]
    cover = (token >= start[None]) & (token < end[None]) & (start[None] >= 0)
    ids = jnp.where(cover.any(1), jnp.argmax(cover, axis=1), -1 - token[:, 0])
    return ids.reshape(b, seq_len).astype(jnp.int32)


# ---------------------------------------------------------------------------- what it takes
def unsupported(
    *,
    dtype,
    head_dim: int,
    v_head_dim: int,
    q_len: int,
    kv_len: int,
    causal: bool,
    segments: bool,
    kv_segments: bool = False,
    compute_capability: tuple[int, int] | None = None,
) -> str | None:
    """Why cuDNN's attention cannot run this call (the reason and its fix), or None."""
    if jnp.dtype(dtype).name not in DTYPES:
        return (
            f"cuDNN's flash attention takes bfloat16 or float16, not {jnp.dtype(dtype).name}. "
            "Fix: model.dtype=bfloat16, or model.attention_impl=pallas"
        )
    h_max = 256 if compute_capability is None or compute_capability >= (9, 0) else 128
    for name, width in (("q/k", head_dim), ("value", v_head_dim)):
        if width % 8 or width > h_max:
            return (
                f"cuDNN's flash attention takes head widths that are multiples of 8 up to "
                f"{h_max}; the {name} width is {width}. Fix: model.attention_impl=pallas"
            )
    if causal and q_len != kv_len:
        return (
            f"cuDNN's causal mask aligns the first query with the first key, diffjax's the "
            f"last with the last; they differ for {q_len} queries over {kv_len} keys. Fix: "
            "model.attention_impl=pallas"
        )
    if kv_segments:
        return (
            "cuDNN's packed layout takes one set of segment ids for queries and keys, and this "
            "call has separate kv_segment_ids. Fix: model.attention_impl=pallas"
        )
    if segments and private_api() is None:
        low, high = (".".join(map(str, v)) for v in PRIVATE_JAX)
        return (
            f"documents kept apart need cuDNN's packed layout, which diffjax reaches through a "
            f"jax function it uses in jax {low} to {high} (exclusive) only; this is jax "
            f"{jax.__version__}. Fix: data.document_mask=false, or model.attention_impl=pallas"
        )
    return None


# ---------------------------------------------------------------------------- one call
def _mask_type(causal: bool, packed: bool):
    mt = private_api().MaskType
    if packed:
        return mt.PADDING_CAUSAL if causal else mt.PADDING
    return mt.CAUSAL if causal else mt.NO_MASK


def _attend(q, k, v, *, causal: bool, scale: float, packed, implementation: str):
    """One standard attention call ``[B, T, Hq, Dv]``: ``packed`` is None or ``(offsets,
    lengths)`` of :func:`segment_layout`."""
    if packed is not None:  # the packed layout's offsets assume the query's heads and width
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        if v.shape[-1] != q.shape[-1]:
            call = functools.partial(
                _attend, causal=causal, scale=scale, packed=packed, implementation=implementation
            )
            return _compose.in_value_halves(call, q, k, v)
    if implementation == "xla":
        return _xla_attend(q, k, v, causal=causal, scale=scale, packed=packed)
    if packed is None and v.shape[-1] == q.shape[-1]:
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn"
        )
    fa = private_api()
    kw = {}
    if packed is not None:
        offsets, lengths = packed
        kw = dict(q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets)
    return fa.dot_product_attention(
        q, k, v, scale=scale, mask_type=_mask_type(causal, packed is not None), **kw
    )


def _xla_attend(q, k, v, *, causal: bool, scale: float, packed):
    """:func:`_attend` on XLA: jax's XLA attention, the packed layout as a dense mask."""
    if v.shape[-1] != q.shape[-1]:  # jax's XLA attention takes no wider value: in halves
        call = functools.partial(_xla_attend, causal=causal, scale=scale, packed=packed)
        return _compose.in_value_halves(call, q, k, v)
    mask = None
    if packed is not None:
        ids = packed_segment_ids(*packed, q.shape[1])
        mask = (ids[:, :, None] == ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, implementation="xla"
    )


def _prepare(q, k, segment_ids, kv_segment_ids, causal, dv, implementation, what):
    """The packed layout of the call (or None) and whether the output is valid; refuses what
    cuDNN cannot run (:func:`unsupported`)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{what}: unknown implementation {implementation!r}. Fix: use one of "
            f"{', '.join(map(repr, IMPLEMENTATIONS))}"
        )
    same = kv_segment_ids is None or kv_segment_ids is segment_ids
    reason = unsupported(
        dtype=q.dtype if implementation == "cudnn" else jnp.bfloat16,
        head_dim=q.shape[-1],
        v_head_dim=dv,
        q_len=q.shape[1],
        kv_len=k.shape[1],
        causal=causal,
        segments=segment_ids is not None and implementation == "cudnn",
        kv_segments=not same,
    )
    if reason is not None:
        raise ValueError(f"{what}: {reason}")
    if segment_ids is None:
        return None, None
    offsets, lengths, fits = segment_layout(segment_ids, segment_slots(q.shape[1]))
    return (offsets, lengths), fits


def _guard(out: jax.Array, fits) -> jax.Array:
    """NaN where the documents did not fit the packed layout's slots."""
    return out if fits is None else jnp.where(fits, out, jnp.nan).astype(out.dtype)


# ---------------------------------------------------------------------------- public API
def attention(
    q,
    k,
    v,
    *,
    second=None,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    implementation: str = "cudnn",
    wide_value: bool | None = None,
) -> jax.Array:
    """Softmax attention on cuDNN, ``[B, T, Hq, Dv]``: one map, ``softmax(q k^T s) v``, or two
    (``second=(q2, k2, lam)``), ``softmax(q k^T s) v - lam * softmax(q2 k2^T s) v`` composed of
    standard calls (``k2=None``: V2, one call over the paired heads). q ``[B, T, Hq, D]``, k
    ``[B, S, Hkv, D]``, v ``[B, S, Hkv, Dv]``; ``segment_ids`` ``[B, T]`` keep documents apart
    (module doc). ``wide_value``: V1's value in one call per map (default: where cuDNN takes
    it, :func:`wide_value_supported`; always on XLA)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    what = "cudnn.attention"
    packed, fits = _prepare(
        q, k, segment_ids, kv_segment_ids, causal, v.shape[-1], implementation, what
    )
    if wide_value is None:
        wide_value = implementation == "xla" or (second is not None and wide_value_supported())
    attend = functools.partial(
        _attend, causal=causal, scale=scale, packed=packed, implementation=implementation
    )
    return _guard(_compose.attention(attend, q, k, v, second, wide_value=wide_value), fits)


def dot_product_attention(q, k, v, **options) -> jax.Array:
    """``softmax(q k^T s) v`` on cuDNN: :func:`attention` with one map."""
    return attention(q, k, v, **options)


def differential_attention(q1, k1, q2, k2, v, lam, **options) -> jax.Array:
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v`` on cuDNN: :func:`attention` with
    two maps."""
    return attention(q1, k1, v, second=(q2, k2, lam), **options)


def composition(kind: str, *, segments: bool, wide_value: bool | None = None) -> str:
    """How many cuDNN calls a layer of ``kind`` ("standard", "v1", "v2") makes, in words (for
    reports)."""
    if kind != "v1":
        return "one cuDNN call" + (" over the 2h paired query heads" if kind == "v2" else "")
    wide = (wide_value_supported() if wide_value is None else wide_value) and not segments
    return "two cuDNN calls (V 2d wide)" if wide else "four cuDNN calls (V in halves)"


def tested_range() -> Iterator[str]:
    yield from (".".join(map(str, v)) for v in PRIVATE_JAX)
