"""Sequence (context) parallel attention: the sequence dimension sharded over a mesh axis.

The math of :mod:`diffjax.kernels.reference` (DIFF V1, DIFF V2 and standard attention) with the
sequence cut into ``N`` blocks, one per device along a mesh axis (``"context"`` by default).
Queries stay where they are; keys and values travel:

- **ring** (:func:`ring_attention`, one softmax map or two): each device keeps its
  query block and passes its K/V block round the ring with ``jax.lax.ppermute`` for ``N``
  steps, taking each arriving block in chunks of ``block_k`` keys and merging each softmax
  map's partial result by its log-sum-exp (flash attention across devices and within them;
  a chunk the mask hides entirely is skipped). Per device memory is ``O(T/N)`` (maps of
  ``[T/N, block_k]``): the backward is a ``jax.custom_vjp`` that saves only the local
  blocks, the per-map outputs and log-sum-exps, and rotates K/V again together with their
  gradient accumulators, which arrive home after a full cycle.
- **all-gather** (:func:`allgather_attention`, one map or two): K/V
  gathered whole on every device (``jax.lax.all_gather(tiled=True)``), then the reference's
  math on ``[T/N, T]`` maps; plain autodiff. Simpler, ``O(T)`` memory per device.

Both are called *inside* ``jax.shard_map``; :func:`context_attention` (one softmax map or two)
is the wrapper to call from outside.

**Token order and positions.** Masks are built from the *global* positions of the tokens
(``q_pos``, ``k_pos``: a key is visible to a query iff ``k_pos <= q_pos`` under the causal
mask, and both carry the same segment id when segment ids are given), so any token order
works. Under a causal mask the contiguous order leaves the first device almost idle (the ring
skips the key chunks it may not see) and the last doing most of the work; the zigzag order
(:func:`zigzag_order`: device ``i`` holds chunks ``i`` and ``2N-1-i`` of ``2N``) gives every
device the same number of visible pairs, so the same work when ``block_k`` is at most
``T / (2N)``. The all-gather path computes every pair, masked.

Layout everywhere: ``[batch, seq, heads, dim]``; GQA as in the reference (query head ``i``
reads kv head ``i // (Hq // Hkv)``). Inside, the maps are ``[B, Hkv, R*T, S]`` like the
reference's (``R = Hq / Hkv`` query heads stacked along the rows). Numerics: float32 logits,
softmax statistics, accumulators and gradients; probabilities cast to v's dtype before the
value product; a query that sees no key at all gets a zero output.

With ``kernel="gpu"`` or ``"tpu"`` the ring's blocks run the fused Pallas kernels
(``flash_partials`` / ``flash_partial_grads`` of :mod:`diffjax.kernels`), laid out by the token
order instead of positions (see :data:`KERNEL_ORDERS`).

``logit_max=True`` (diagnostics) also returns each map's largest logit per query row over the
keys it sees, ``[n_maps, B, T, Hq]``: the ring keeps the running max its blocks' softmaxes
already compute (the XLA chunks' or the kernels', ``flash_partials(return_row_max=True)``) and
merges it over the blocks by max; the all-gather takes it from its logits. No gradient; without
it the programs are unchanged.

This module imports only jax, numpy, :mod:`diffjax.kernels` and
:class:`diffjax.config.ConfigError`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from diffjax import kernels
from diffjax.config import CONTEXT_ATTENTIONS as IMPLS
from diffjax.config import KERNEL_ORDERS, RUN_TOKEN_ORDER, TOKEN_ORDERS, ConfigError
from diffjax.kernels import reference


# ---------------------------------------------------------------------------- token orders
def _check_divisible(seq_len: int, parts: int, what: str) -> None:
    if seq_len % parts:
        raise ConfigError(
            f"context.seq_len: a sequence of {seq_len} tokens does not split into {parts} "
            f"equal chunks ({what}). Fix: use a sequence length that is a multiple of {parts} "
            f"(pad the sequence, or pick a context axis size that divides it)"
        )


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
    """The zigzag token order for ``n`` devices: a permutation ``perm`` of ``range(seq_len)``.

    The sequence is cut into ``2n`` equal chunks; device ``i`` holds chunks ``i`` and
    ``2n-1-i`` (in that order), so under a causal mask every device has the same number of
    visible (query, key) pairs. ``x[:, perm]`` puts a ``[B, T, ...]`` sequence into that order
    (device ``i``'s block is then ``x[:, perm][:, i*T/n:(i+1)*T/n]``); ``perm`` is also the
    global position of each token of the permuted sequence. Raises :class:`ConfigError` when
    ``seq_len`` is not a multiple of ``2n``.
    """
    if n < 1:
        raise ConfigError(f"context.size: {n} devices. Fix: use at least 1")
    _check_divisible(seq_len, 2 * n, f"zigzag order over {n} devices needs 2*{n} chunks")
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def striped_order(seq_len: int, n: int) -> np.ndarray:
    """The striped token order: device ``i`` holds tokens ``i, i+n, i+2n, ...`` (a
    permutation of ``range(seq_len)``, used as :func:`zigzag_order`'s). Also balanced under a
    causal mask (to one token). Raises :class:`ConfigError` when ``n`` does not divide
    ``seq_len``."""
    if n < 1:
        raise ConfigError(f"context.size: {n} devices. Fix: use at least 1")
    _check_divisible(seq_len, n, f"striped order over {n} devices")
    return np.arange(seq_len).reshape(seq_len // n, n).T.reshape(-1)


def inverse_order(perm) -> np.ndarray:
    """The inverse permutation: ``x[:, perm][:, inverse_order(perm)] == x``."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


# ---------------------------------------------------------------------------- batches in order
def axis_size(mesh, axis: str = "context") -> int:
    """The size of ``mesh``'s ``axis`` (1 when there is no mesh or no such axis); concrete or
    abstract meshes alike."""
    if mesh is None:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes)).get(axis, 1))


def check_sequence(seq_len: int, n: int, order: str, what: str = "data.seq_len") -> None:
    """A :class:`ConfigError` naming ``what`` and the fix when a sequence of ``seq_len`` tokens
    cannot be laid over ``n`` context devices in ``order`` (zigzag: ``2n`` equal chunks;
    striped and contiguous: ``n``)."""
    if order not in TOKEN_ORDERS:
        raise ConfigError(
            f"mesh.context_order: unknown order {order!r}. Fix: use one of "
            f"{', '.join(TOKEN_ORDERS)}"
        )
    if n <= 1:
        return
    parts = 2 * n if order == "zigzag" else n
    if seq_len % parts:
        other = (
            "" if order != "zigzag" else f", or mesh.context_order=contiguous (a multiple of {n})"
        )
        raise ConfigError(
            f"{what}={seq_len} does not split into {parts} equal chunks for mesh.context={n} "
            f"in the {order} order. Fix: a sequence length that is a multiple of {parts}, or "
            f"a mesh.context that divides it{other}"
        )


def token_order(seq_len: int, n: int, order: str) -> np.ndarray:
    """The permutation that puts a sequence in ``order`` for ``n`` context devices
    ("zigzag", "striped" or "contiguous": the identity)."""
    check_sequence(seq_len, n, order)
    if n <= 1 or order == "contiguous":
        return np.arange(seq_len)
    return zigzag_order(seq_len, n) if order == "zigzag" else striped_order(seq_len, n)


def order_batch(arrays: dict, n: int, order: str) -> dict:
    """A batch (``{name: [B, T, ...]}`` host arrays) in the token ``order`` for ``n`` context
    devices, every array reordered alike, with ``"token_index"`` (each token's index in its
    row: the order the masks and the ring follow) and ``"positions"`` (the rotary positions:
    the given ones, e.g. restarting at document starts, else the index): the model then
    computes the same function and a token-local loss the same sum."""
    t = next(iter(arrays.values())).shape[1]
    perm = token_order(t, n, order)
    b = next(iter(arrays.values())).shape[0]
    out = dict(arrays)
    out["token_index"] = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    if out.get("positions") is None:
        out["positions"] = out["token_index"]
    return {k: np.asarray(v)[:, perm] for k, v in out.items()}


def restore_order(x: np.ndarray, n: int, order: str) -> np.ndarray:
    """``x`` (``[B, T, ...]`` in ``order``) back in the data's order."""
    if n <= 1 or order == "contiguous":
        return x
    return np.asarray(x)[:, inverse_order(token_order(x.shape[1], n, order))]


# ---------------------------------------------------------------------------- masks
def position_mask(
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array | None:
    """Boolean ``[B or 1, Tq, Tk]`` mask (True = may attend) from the global positions
    ``q_pos`` ``[Tq]`` or ``[B, Tq]``, ``k_pos`` ``[Tk]`` or ``[B, Tk]`` (int) and the segment
    ids ``[B, Tq]`` / ``[B, Tk]`` (``kv_segment_ids`` None: the keys' are ``segment_ids``,
    which then needs ``Tk == Tq``). A key is visible iff ``k_pos <= q_pos`` (when ``causal``)
    and the segments match. None when nothing is masked."""
    mask = None
    if causal:
        mask = k_pos[..., None, :] <= q_pos[..., :, None]
        mask = mask if mask.ndim == 3 else mask[None]
    if segment_ids is not None:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        seg = segment_ids[:, :, None] == kv_seg[:, None, :]
        mask = seg if mask is None else jnp.logical_and(mask, seg)
    return mask


# ---------------------------------------------------------------------------- block math
# Grouped layout (see the reference): queries [B, G, R*Tq, D], keys [B, G, Tk, D], values
# [B, G, Tk, Dv], row statistics [B, G, R*Tq], masks [B or 1, 1, R*Tq, Tk] (G = Hkv).
def _kv_layout(x: jax.Array) -> jax.Array:
    """``[B, S, Hkv, D]`` -> ``[B, Hkv, S, D]``."""
    return x.transpose(0, 2, 1, 3)


def _from_kv_layout(x: jax.Array) -> jax.Array:
    return x.transpose(0, 2, 1, 3)


def _rows_to_heads(x: jax.Array, t: int) -> jax.Array:
    """Row statistics ``[B, G, R*T]`` -> ``[B, T, Hq]``."""
    return reference._ungroup_queries(x[..., None], t)[..., 0]


def _safe(lse: jax.Array) -> jax.Array:
    """``lse`` with -inf (a row that sees no key) replaced by 0, to subtract without NaNs."""
    return jnp.where(jnp.isneginf(lse), 0.0, lse)


def _grouped_block(qg, kg, vg, gmask, scale, row_max: bool = False):
    """One map on one block: ``(o [B,G,RT,Dv], lse [B,G,RT])`` float32, ``o`` normalised
    over the block's visible keys (0 for a row that sees none, whose ``lse`` is -inf).
    ``row_max``: ``(o, lse, row_max)``, ``row_max [B,G,RT]`` the block's largest visible
    logit per row (the softmax's max; -inf for a row that sees none)."""
    s = jnp.einsum("bgqd,bgsd->bgqs", qg, kg, preferred_element_type=jnp.float32)
    s = s * jnp.float32(scale)
    if gmask is not None:
        s = jnp.where(gmask, s, -jnp.inf)
    m = row_m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m[..., None])  # masked entries: exp(-inf) = 0
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bgqs,bgsd->bgqd", p.astype(vg.dtype), vg, preferred_element_type=jnp.float32)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = m + jnp.log(l)  # log(0) = -inf where the row sees no key
    return (o, lse, row_m) if row_max else (o, lse)


def _merge(o_a, lse_a, o_b, lse_b):
    """Two partials of one map (over disjoint key sets) merged by their log-sum-exps."""
    lse = jnp.logaddexp(lse_a, lse_b)  # -inf when both are
    ref = _safe(lse)
    w_a = jnp.exp(lse_a - ref)[..., None]  # 0 where lse_a is -inf
    w_b = jnp.exp(lse_b - ref)[..., None]
    return o_a * w_a + o_b * w_b, lse


def block_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One softmax map of one query block against one key block, in flash form.

    q ``[B, Tq, Hq, D]``, k ``[B, Tk, Hkv, D]``, v ``[B, Tk, Hkv, Dv]``; ``q_pos [Tq]`` and
    ``k_pos [Tk]`` the tokens' global positions (int); segment ids ``[B, Tq]`` / ``[B, Tk]``.
    Returns ``(o, lse)``: ``o [B, Tq, Hq, Dv]`` float32, the output normalised over this
    block's visible keys, and ``lse [B, Tq, Hq]`` float32, the log-sum-exp of the visible
    scaled logits. A query that sees no key of the block gets ``o = 0`` and ``lse = -inf``
    (no NaN). Partials over disjoint key blocks combine with :func:`merge_partials`.
    """
    b, tq, hq, _ = q.shape
    hkv = k.shape[2]
    scale = reference._default_scale(q, scale)
    mask = position_mask(
        q_pos, k_pos, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids
    )
    qg = reference._group_queries(q, hkv)
    o, lse = _grouped_block(
        qg, _kv_layout(k), _kv_layout(v), reference._group_mask(mask, hq // hkv), scale
    )
    return reference._ungroup_queries(o, tq), _rows_to_heads(lse, tq)


def merge_partials(
    o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge two partials of one map over disjoint key sets: ``o [B, T, H, Dv]`` normalised
    and ``lse [B, T, H]`` each (as :func:`block_attention` returns). Returns the ``(o, lse)``
    of the union; a query that sees no key in either keeps ``o = 0``, ``lse = -inf``."""
    return _merge(o_a, lse_a, o_b, lse_b)


def _block_grads(qg, kg, vg, gmask, scale, lse, do, delta):
    """Flash-attention backward of one map on one block, from the saved ``lse``:
    ``P = exp(s - lse)``, ``dS = P * (dO v^T - delta)``. Returns ``(p, dq, dk)`` float32
    (``dq [B,G,RT,D]``, ``dk [B,G,Tk,D]``, scale included); ``dv`` is the caller's."""
    s = jnp.einsum("bgqd,bgsd->bgqs", qg, kg, preferred_element_type=jnp.float32)
    s = s * jnp.float32(scale)
    if gmask is not None:
        s = jnp.where(gmask, s, -jnp.inf)
    p = jnp.exp(s - _safe(lse)[..., None])  # 0 where masked (and where the row sees nothing)
    dp = jnp.einsum("bgqd,bgsd->bgqs", do, vg.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * jnp.float32(scale)
    dq = jnp.einsum("bgqs,bgsd->bgqd", ds, kg.astype(jnp.float32))
    dk = jnp.einsum("bgqs,bgqd->bgsd", ds, qg.astype(jnp.float32))
    return p, dq, dk


# ---------------------------------------------------------------------------- ring
# The ring's key chunk: maps of [T/N, 512] per step. Its functions take their static settings
# as one tuple ``static = (axis_name, causal, scale, block_k, logit_max)``; ``logit_max`` (last
# here and in the kernel ring's, read as ``static[-1]``): also keep each map's running row max,
# merged over the chunks by max, and return it beside the output.
DEFAULT_BLOCK_K = 512


def _ring_perm(n: int) -> list[tuple[int, int]]:
    """Device ``i`` sends to ``i + 1``: after ``j`` steps device ``d`` holds ``d - j``'s block."""
    return [(i, (i + 1) % n) for i in range(n)]


def _chunk_size(tk: int, block_k: int | None) -> int:
    """The largest divisor of ``tk`` that is at most ``block_k`` (``tk`` for None)."""
    if block_k is None or block_k >= tk:
        return tk
    if block_k < 1:
        raise ValueError(f"ring attention: block_k must be at least 1, got {block_k}")
    return next(c for c in range(block_k, 0, -1) if tk % c == 0)


def _split(x, axis: int, c: int):
    """``x`` with ``axis`` cut into ``c`` chunks, the chunk index first (None stays None)."""
    if x is None:
        return None
    shape = x.shape[:axis] + (c, x.shape[axis] // c) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _join(x, axis: int):
    """The inverse of :func:`_split`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


# A K/V block in flight: (own keys [B,G,Tk,D] x 1 or 2, values [B,G,Tk,Dv], k_pos [Tk],
# kv_seg [B,Tk] or None). Its key axes, for cutting it into chunks of block_k keys:
def _split_kv(kv, c):
    keys, vg, k_pos, kv_seg = kv
    return (
        [_split(k, 2, c) for k in keys],
        _split(vg, 2, c),
        _split(k_pos, k_pos.ndim - 1, c),
        _split(kv_seg, 1, c),
    )


def _over_chunks(body, carry, kv, block_k):
    """``body(carry, chunk) -> (carry, out)`` over the K/V block's chunks of at most
    ``block_k`` keys (a ``lax.scan``; one call when the block is one chunk). Returns
    ``(carry, outs)``, ``outs`` stacked along the chunk index first."""
    tk = kv[1].shape[2]
    c = tk // _chunk_size(tk, block_k)
    if c == 1:
        carry, out = body(carry, kv)
        return carry, jax.tree.map(lambda x: x[None], out)
    return jax.lax.scan(body, carry, _split_kv(kv, c))


def _ring_forward(static, qs, shared, kv, q_pos, q_seg):
    """The ring's forward in grouped layout. ``qs``: the maps' grouped queries (1 or 2);
    ``kv`` the local K/V block (``shared``: both maps read its one key). Returns
    ``(os, lses)``, one ``o [B,G,RT,Dv]`` and ``lse [B,G,RT]`` per map; with ``logit_max``
    ``(os, lses, maxes)``, each map's largest visible logit per row ``[B,G,RT]`` (-inf where
    none)."""
    axis_name, causal, scale, block_k, row_max = static
    n = jax.lax.axis_size(axis_name)
    r = qs[0].shape[2] // q_pos.shape[-1]
    perm = _ring_perm(n)

    def absorb(acc, chunk):
        keys, vg, k_pos, kv_seg = chunk
        gmask = _local_mask(q_pos, k_pos, causal, q_seg, kv_seg, r)
        keys = keys * len(qs) if shared else keys

        def run(acc):
            merged = []
            for q, k, o, lse, *m in zip(qs, keys, *acc):
                po, plse, *pm = _grouped_block(q, k, vg, gmask, scale, row_max)
                maxes = tuple(jnp.maximum(a, b) for a, b in zip(m, pm))  # merged by max
                merged.append((*_merge(o, lse, po, plse), *maxes))
            return tuple(list(x) for x in zip(*merged))

        return _unless_masked(gmask, run, lambda acc: acc, acc), None

    rows = qs[0].shape[:3]
    acc = (
        [jnp.zeros(rows + kv[1].shape[3:], jnp.float32) for _ in qs],
        [jnp.full(rows, -jnp.inf, jnp.float32) for _ in qs],
    )
    if row_max:
        acc += ([jnp.full(rows, -jnp.inf, jnp.float32) for _ in qs],)

    # each step sends the block it holds on to the next device before computing on it, so the
    # transfer (an asynchronous collective-permute on GPU/TPU) overlaps the block's compute;
    # N - 1 hops, the last block arrived is computed after the loop
    def step(_, carry):
        kv, acc = carry
        arriving = jax.lax.ppermute(kv, axis_name, perm)
        acc, _ = _over_chunks(absorb, acc, kv, block_k)
        return arriving, acc

    kv, acc = jax.lax.fori_loop(0, n - 1, step, (kv, acc))
    acc, _ = _over_chunks(absorb, acc, kv, block_k)
    return acc


def _ring_backward(static, qs, shared, kv, q_pos, q_seg, lses, dos, deltas, dv_map):
    """The ring's backward: rotates the K/V block with its float32 gradient accumulators for
    a full cycle (``N`` hops of the accumulators, ``N - 1`` of K/V), recomputing each chunk's
    probabilities from the saved ``lses``. ``dos``/``deltas``: each map's output cotangent
    ``[B,G,RT,Dv]`` and ``rowsum(dO * O)``; ``dv_map(ps)`` the combined map whose transpose
    times ``dos[0]`` is dv's part. Returns ``(dqs, dks, dv)`` (``dks`` one per own key)."""
    axis_name, causal, scale, block_k, _ = static
    n = jax.lax.axis_size(axis_name)
    r = qs[0].shape[2] // q_pos.shape[-1]
    perm = _ring_perm(n)

    def chunk_grads(dqs, chunk):
        keys, vg, k_pos, kv_seg = chunk
        gmask = _local_mask(q_pos, k_pos, causal, q_seg, kv_seg, r)

        def zeros():
            return [jnp.zeros(k.shape, jnp.float32) for k in keys], jnp.zeros(vg.shape, jnp.float32)

        def run(dqs):
            ps, dqs, (dks, _) = [], list(dqs), zeros()
            for i, q in enumerate(qs):
                j = 0 if shared else i
                p, dq, dk = _block_grads(q, keys[j], vg, gmask, scale, lses[i], dos[i], deltas[i])
                ps.append(p)
                dqs[i] = dqs[i] + dq
                dks[j] = dks[j] + dk
            return dqs, (dks, jnp.einsum("bgqs,bgqd->bgsd", dv_map(ps), dos[0]))

        return _unless_masked(gmask, run, lambda dqs: (list(dqs), zeros()), dqs)

    def absorb(kv, dqs, dks, dv):
        dqs, (dk_chunks, dv_chunks) = _over_chunks(chunk_grads, dqs, kv, block_k)
        dks = [a + _join(b, 2) for a, b in zip(dks, dk_chunks)]
        return dqs, dks, dv + _join(dv_chunks, 2)

    def zeros(x):
        return jnp.zeros(x.shape, jnp.float32)

    grads = ([zeros(q) for q in qs], [zeros(k) for k in kv[0]], zeros(kv[1]))

    def step(_, carry):
        kv, (dqs, dks, dv) = carry
        arriving = jax.lax.ppermute(kv, axis_name, perm)  # K/V sent on while computing
        dqs, dks, dv = absorb(kv, dqs, dks, dv)
        dks, dv = jax.lax.ppermute((dks, dv), axis_name, perm)  # the gradients once computed
        return arriving, (dqs, dks, dv)

    kv, (dqs, dks, dv) = jax.lax.fori_loop(0, n - 1, step, (kv, grads))
    dqs, dks, dv = absorb(kv, dqs, dks, dv)
    dks, dv = jax.lax.ppermute((dks, dv), axis_name, perm)  # the last hop: home
    return dqs, dks, dv


def _unless_masked(gmask, run, skip, carry):
    """``run(carry)``, or ``skip(carry)`` when ``gmask`` hides every key of the chunk from
    every query (a ``lax.cond``: under a causal mask about half the chunks, the same number
    on every device in the zigzag order)."""
    if gmask is None:
        return run(carry)
    return jax.lax.cond(jnp.any(gmask), run, skip, carry)


def _local_mask(q_pos, k_pos, causal, q_seg, kv_seg, r):
    mask = position_mask(q_pos, k_pos, causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg)
    return reference._group_mask(mask, r)


def _float0_like(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _lam_rows(lam, hkv):
    """lam as ``[B, G, RT, 1]`` rows (V2) or a float32 scalar (V1)."""
    return lam if lam.ndim == 0 else reference._group_rows(lam, hkv)


def _unpack(maps):
    """The ring's arrays: one map's ``(q, k, v)`` or two maps' ``(q1, k1, q2, k2, v, lam)`` as
    ``(queries, keys, v, lam)``; ``keys`` holds one array when both maps read the first."""
    if len(maps) == 3:
        q, k, v = maps
        return [q], [k], v, None
    q1, k1, q2, k2, v, lam = maps
    return [q1, q2], [k1] + ([] if k2 is None else [k2]), v, lam


def _layout(maps, k_pos, kv_seg):
    """``(queries grouped by kv head, shared keys, (keys, v, k_pos, kv_seg))`` in the ring's
    layout."""
    queries, keys, v, _ = _unpack(maps)
    hkv = keys[0].shape[2]
    qs = [reference._group_queries(q, hkv) for q in queries]
    shared = len(queries) == 2 and len(keys) == 1
    return qs, shared, ([_kv_layout(k) for k in keys], _kv_layout(v), k_pos, kv_seg)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(static, maps, q_pos, k_pos, q_seg, kv_seg):
    return _ring_fwd(static, maps, q_pos, k_pos, q_seg, kv_seg)[0]


def _with_maxes(logit_max: bool, out, maxes, t: int):
    """The ring's primal output: ``out``, or ``(out, maxes)`` with the maps' row maxes
    ``[B, G, RT]`` as ``[n_maps, B, T, Hq]``."""
    if not logit_max:
        return out
    return out, jnp.stack([_rows_to_heads(m, t) for m in maxes])


def _ring_fwd(static, maps, q_pos, k_pos, q_seg, kv_seg):
    queries, keys, _, lam = _unpack(maps)
    t, hkv = queries[0].shape[1], keys[0].shape[2]
    qs, shared, kv = _layout(maps, k_pos, kv_seg)
    outs, lses, *maxes = _ring_forward(static, qs, shared, kv, q_pos, q_seg)
    out = outs[0] if lam is None else outs[0] - _lam_rows(lam.astype(jnp.float32), hkv) * outs[1]
    res = (maps, q_pos, k_pos, q_seg, kv_seg, outs, lses)
    out = reference._ungroup_queries(out, t).astype(queries[0].dtype)
    return _with_maxes(static[-1], out, maxes[0] if maxes else None, t), res


def _ring_bwd(static, res, dout):
    maps, q_pos, k_pos, q_seg, kv_seg, outs, lses = res
    if static[-1]:
        dout = dout[0]  # the row maxes carry no gradient
    queries, keys, v, lam = _unpack(maps)
    t, hkv = queries[0].shape[1], keys[0].shape[2]
    qs, shared, kv = _layout(maps, k_pos, kv_seg)
    do1 = reference._group_queries(dout.astype(jnp.float32), hkv)  # dO1 = dout
    if lam is None:
        douts, combine = (do1,), lambda ps: ps[0]
    else:
        lam_r = _lam_rows(lam.astype(jnp.float32), hkv)
        douts, combine = (do1, -lam_r * do1), lambda ps: ps[0] - lam_r * ps[1]  # dO2 = -lam dout
    deltas = tuple(jnp.sum(do * o, axis=-1) for do, o in zip(douts, outs))
    dqs, dks, dv = _ring_backward(
        static, qs, shared, kv, q_pos, q_seg, lses, douts, deltas, combine
    )
    dq = [reference._ungroup_queries(d, t).astype(q.dtype) for d, q in zip(dqs, queries)]
    dk = [_from_kv_layout(d).astype(k.dtype) for d, k in zip(dks, keys)]
    dv = _from_kv_layout(dv).astype(v.dtype)
    ints = tuple(_float0_like(x) for x in (q_pos, k_pos, q_seg, kv_seg))
    if lam is None:
        return ((dq[0], dk[0], dv),) + ints
    dlam_rows = -jnp.sum(do1 * outs[1], axis=-1)  # [B, G, RT]
    if lam.ndim == 0:
        dlam = jnp.sum(dlam_rows).astype(lam.dtype)
    else:
        dlam = _rows_to_heads(dlam_rows, t).astype(lam.dtype)
    return ((dq[0], dk[0], dq[1], None if shared else dk[1], dv, dlam),) + ints


_ring.defvjp(_ring_fwd, _ring_bwd)


def _kv_seg(segment_ids, kv_segment_ids):
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("context attention: kv_segment_ids given without segment_ids")
    return segment_ids if kv_segment_ids is None else kv_segment_ids


def _positions(q_pos, k_pos):
    return jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)


def ring_attention(
    q,
    k,
    v,
    *,
    second=None,
    axis_name,
    q_pos,
    k_pos,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    block_k: int | None = DEFAULT_BLOCK_K,
    logit_max: bool = False,
):
    """Attention over a sequence sharded along ``axis_name``, by ring attention, for one
    softmax map (``softmax(q k^T s) v``) or two (``second=(q2, k2, lam)``: ``softmax(q k^T s)
    v - lam * softmax(q2 k2^T s) v``). Call inside ``jax.shard_map``; every array is this
    device's block: q, q2 ``[B, Tq, Hq, D]``; k, k2 ``[B, Tk, Hkv, D]`` (``k2`` None: both
    maps read k, DIFF V2); v ``[B, Tk, Hkv, Dv]`` (V1: ``Dv = 2D``); ``lam`` a scalar (V1)
    or ``[B, Tq, Hq]`` (V2); ``q_pos`` ``[Tq]`` or ``[B, Tq]``, ``k_pos`` ``[Tk]`` or
    ``[B, Tk]`` the tokens' global positions (int);
    ``segment_ids [B, Tq]``, ``kv_segment_ids [B, Tk]`` (None: the keys' are segment_ids).

    K/V (with ``k_pos`` and ``kv_segment_ids``) go round the ring with ``jax.lax.ppermute``
    (a ``fori_loop`` over the ``N - 1`` hops); each arriving block is taken in chunks of
    ``block_k`` keys (a ``lax.scan``; the largest divisor of Tk not above it; None: whole
    blocks), so the maps in memory are ``[Tq, block_k]``; each map's partials merge by
    log-sum-exp. Returns ``[B, Tq, Hq, Dv]`` in ``q.dtype``.

    Differentiable in every array (q, k, v; q2, k2, lam) by a ``jax.custom_vjp`` that saves
    only the local blocks, each map's output and log-sum-exp (``O(T/N)`` per device) and
    rotates K/V again with their gradients. The lam gradient is this device's part
    (``jax.shard_map``'s transpose sums a replicated lam's over the devices).

    ``logit_max=True``: ``(out, maxes)``, ``maxes`` float32 ``[n_maps, B, Tq, Hq]`` each
    map's largest logit per local query row over every key it sees on the ring (each chunk's
    softmax max, merged by max; -inf where none), without gradient.
    """
    scale = reference._default_scale(q, scale)
    q_pos, k_pos = _positions(q_pos, k_pos)
    kv_seg = _kv_seg(segment_ids, kv_segment_ids)
    if second is None:
        maps = (q, k, v)
    else:
        q2, k2, lam = second
        maps = (q, k, q2, k2, v, jnp.asarray(lam, jnp.float32))
    static = (axis_name, causal, scale, block_k, bool(logit_max))
    return _ring(static, maps, q_pos, k_pos, segment_ids, kv_seg)


# ---------------------------------------------------------------------------- ring on the kernels
# The ring with the fused Pallas kernels as its blocks (``kernel=`` in the ring functions). The
# kernels mask by index (bottom-right causal, segment ids), not by position, so this ring takes
# the tokens' layout from a known order instead of their positions: in the zigzag order device
# ``i`` holds chunks ``i`` and ``2N-1-i``, and every pair of a query chunk and a key chunk is
# either fully visible, causal within one chunk, or hidden. Step 0 (the local block) is causal
# over the device's two chunks; a block from device ``j < i`` is seen whole by its first chunk
# (``[T/N, T/2N]``), one from ``j > i`` whole by the second query chunk (``[T/2N, T/N]``): the
# same work on every device and step. In the contiguous order a block from ``j < i`` is seen
# whole and one from ``j > i`` not at all: diffjax.config.KERNEL_ORDERS.


def _rows(x, rows):
    """``x[:, rows]`` for a ``[B, T, ...]`` array (None stays None; ``rows`` None: all)."""
    return x if x is None or rows is None or jnp.ndim(x) < 2 else x[:, rows]


def _kernel_partials(kern, scale, qs, q_seg, kv, causal, row_max=False):
    """Each map's ``(o, lse)`` of the queries ``qs`` (q1 or q1, q2) against ``kv`` =
    ``(k1, k2, v, kv_seg)`` by the kernels' :func:`~diffjax.kernels.gpu.flash_partials`
    (``row_max``: ``(o, lse, row_max)``, the kernel's running row max)."""
    module, interpret, extra = kern
    k1, k2, v, kv_seg = kv
    q2 = qs[1] if len(qs) > 1 else None
    return module.flash_partials(
        qs[0],
        k1,
        q2,
        k2 if q2 is not None else None,
        v,
        causal=causal,
        segment_ids=q_seg,
        kv_segment_ids=kv_seg if q_seg is not None else None,
        sm_scale=scale,
        interpret=interpret,
        return_row_max=row_max,
        **dict(extra),
    )


def _kernel_plan(order, causal, c):
    """The pairs of a step as ``(q rows, kv rows)`` slices, for ``lax.cond`` on ``src < me``:
    ``(when src < me, when src > me)``; None: nothing to compute. Not used for step 0."""
    whole = (slice(None), slice(None))
    if not causal:
        return whole, whole
    if order == "contiguous":
        return whole, None
    return (slice(None), slice(None, c)), (slice(c, None), slice(None))


def _kernel_ring_forward(static, me, qs, q_seg, kv):
    """The kernel ring's forward: per map ``(o [B,T,Hq,Dv], lse [B,T,Hq])`` float32 (with
    ``logit_max`` also ``row_max [B,T,Hq]``, the blocks' running maxes merged by max). ``me``:
    this device's index on the axis (an input, not ``lax.axis_index``: a value that depends on
    no operand would leave an operand-less manual computation when a scan over layers splits
    the shard_map for its backward, which Shardy refuses)."""
    axis, causal, scale, order, kern, row_max = static
    n = jax.lax.axis_size(axis)
    c = qs[0].shape[1] // 2
    perm = _ring_perm(n)

    def absorb(acc, kv, rows):
        q_rows, kv_rows = rows
        parts = _kernel_partials(
            kern,
            scale,
            [_rows(q, q_rows) for q in qs],
            _rows(q_seg, q_rows),
            tuple(_rows(x, kv_rows) for x in kv),
            False,
            row_max,
        )
        out = []
        for (o, lse, *m), (po, plse, *pm) in zip(acc, parts):
            mo, ml = _merge(_rows(o, q_rows), _rows(lse, q_rows), po, plse)
            maxes = (x.at[:, q_rows].set(jnp.maximum(_rows(x, q_rows), y)) for x, y in zip(m, pm))
            out.append((o.at[:, q_rows].set(mo), lse.at[:, q_rows].set(ml), *maxes))
        return out

    def remote(acc, kv, s):
        src = (me - s) % n
        first, second = _kernel_plan(order, causal, c)
        skip = lambda acc: acc  # noqa: E731
        return jax.lax.cond(
            src < me,
            lambda acc: absorb(acc, kv, first),
            (lambda acc: absorb(acc, kv, second)) if second is not None else skip,
            acc,
        )

    acc = list(_kernel_partials(kern, scale, qs, q_seg, kv, causal, row_max))  # the local block
    if n == 1:
        return acc

    def step(s, carry):
        kv, acc = carry
        arriving = jax.lax.ppermute(kv, axis, perm)  # sent on before it is computed on
        return arriving, remote(acc, kv, s)

    kv, acc = jax.lax.fori_loop(1, n - 1, step, (jax.lax.ppermute(kv, axis, perm), acc))
    return remote(acc, kv, n - 1)


def _kernel_ring_backward(static, me, qs, q_seg, kv, lam, dout, lses, deltas):
    """The kernel ring's backward: K/V go round again with their float32 gradient
    accumulators (home after ``N`` hops); each step's gradients come from the kernels'
    :func:`~diffjax.kernels.gpu.flash_partial_grads` with the merged ``lses`` and ``deltas``.
    Returns ``(dqs, (dk1, dk2, dv))`` float32 (``dk2`` None where there is no k2)."""
    axis, causal, scale, order, kern, _ = static
    module, interpret, extra = kern
    n = jax.lax.axis_size(axis)
    c = qs[0].shape[1] // 2
    perm = _ring_perm(n)
    diff = len(qs) > 1

    def grads(kv, rows, causal_block):
        q_rows, kv_rows = rows
        k1, k2, v, kv_seg = (_rows(x, kv_rows) for x in kv)
        g = module.flash_partial_grads(
            _rows(qs[0], q_rows),
            k1,
            _rows(qs[1], q_rows) if diff else None,
            k2 if diff else None,
            v,
            _rows(lam, q_rows) if diff else None,
            _rows(dout, q_rows),
            _rows(lses[0], q_rows),
            _rows(deltas[0], q_rows),
            _rows(lses[1], q_rows) if diff else None,
            _rows(deltas[1], q_rows) if diff else None,
            causal=causal_block,
            segment_ids=_rows(q_seg, q_rows),
            kv_segment_ids=kv_seg if q_seg is not None else None,
            sm_scale=scale,
            interpret=interpret,
            **dict(extra),
        )
        dq1, dk1, dq2, dk2, dv = (None if x is None else x.astype(jnp.float32) for x in g)
        return [dq1, dq2] if diff else [dq1], (dk1, dk2, dv)

    def absorb(dqs, dkv, kv, rows, causal_block=False):
        q_rows, kv_rows = rows
        gq, gkv = grads(kv, rows, causal_block)
        dqs = [a.at[:, q_rows].add(b) for a, b in zip(dqs, gq)]
        dkv = tuple(
            a if b is None else a.at[:, kv_rows].add(b) for a, b in zip(dkv, gkv, strict=True)
        )
        return dqs, dkv

    def remote(dqs, dkv, kv, s):
        src = (me - s) % n
        first, second = _kernel_plan(order, causal, c)
        return jax.lax.cond(
            src < me,
            lambda a: absorb(*a, kv, first),
            (lambda a: absorb(*a, kv, second)) if second is not None else (lambda a: a),
            (dqs, dkv),
        )

    whole = (slice(None), slice(None))
    dqs = [jnp.zeros(q.shape, jnp.float32) for q in qs]
    dkv = tuple(None if x is None else jnp.zeros(x.shape, jnp.float32) for x in kv[:3])
    if n == 1:
        return absorb(dqs, dkv, kv, whole, causal)
    arriving = jax.lax.ppermute(kv, axis, perm)
    dqs, dkv = absorb(dqs, dkv, kv, whole, causal)  # the local block
    dkv = jax.lax.ppermute(dkv, axis, perm)

    def step(s, carry):
        kv, dqs, dkv = carry
        nxt = jax.lax.ppermute(kv, axis, perm)
        dqs, dkv = remote(dqs, dkv, kv, s)
        return nxt, dqs, jax.lax.ppermute(dkv, axis, perm)

    kv, dqs, dkv = jax.lax.fori_loop(1, n - 1, step, (arriving, dqs, dkv))
    dqs, dkv = remote(dqs, dkv, kv, n - 1)
    return dqs, jax.lax.ppermute(dkv, axis, perm)  # the last hop: home


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_ring(static, me, maps, q_seg, kv_seg):
    """The ring on the kernels for one map's ``(q, k, v)`` or two maps' ``(q1, k1, q2, k2,
    v, lam)`` (see :func:`_unpack`)."""
    return _kernel_ring_fwd(static, me, maps, q_seg, kv_seg)[0]


def _lam_bth(lam):
    """lam for ``[B, T, H, Dv]`` outputs: a scalar, or ``[B, T, H, 1]``."""
    return lam if lam.ndim == 0 else lam[..., None]


def _kernel_kv(keys, v, kv_seg):
    return (keys[0], keys[1] if len(keys) > 1 else None, v, kv_seg)


def _kernel_ring_fwd(static, me, maps, q_seg, kv_seg):
    queries, keys, v, lam = _unpack(maps)
    parts = _kernel_ring_forward(static, me[0], queries, q_seg, _kernel_kv(keys, v, kv_seg))
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    out = outs[0] if lam is None else outs[0] - _lam_bth(lam) * outs[1]
    out = out.astype(queries[0].dtype)
    out = (out, jnp.stack([m for p in parts for m in p[2:]])) if static[-1] else out
    return out, (me, maps, q_seg, kv_seg, outs, lses)


def _kernel_ring_bwd(static, res, dout):
    me, maps, q_seg, kv_seg, outs, lses = res
    if static[-1]:
        dout = dout[0]  # the row maxes carry no gradient
    queries, keys, v, lam = _unpack(maps)
    g = dout.astype(jnp.float32)
    deltas = tuple(jnp.sum(g * o, axis=-1) for o in outs)
    kv = _kernel_kv(keys, v, kv_seg)
    dqs, (dk1, dk2, dv) = _kernel_ring_backward(
        static, me[0], queries, q_seg, kv, lam, dout, tuple(lses), deltas
    )
    dq = [d.astype(q.dtype) for d, q in zip(dqs, queries)]
    dk1, dv = dk1.astype(keys[0].dtype), dv.astype(v.dtype)
    if lam is None:
        dmaps = (dq[0], dk1, dv)
    else:
        dlam = -deltas[1]
        dlam = jnp.sum(dlam) if lam.ndim == 0 else dlam
        dk2 = None if kv[1] is None else dk2.astype(kv[1].dtype)
        dmaps = (dq[0], dk1, dq[1], dk2, dv, dlam.astype(lam.dtype))
    return (_float0_like(me), dmaps, _float0_like(q_seg), _float0_like(kv_seg))


_kernel_ring.defvjp(_kernel_ring_fwd, _kernel_ring_bwd)


def _kernel_ring_shard(static, me, *args):
    """:func:`_kernel_ring` on one device's flat inputs inside ``jax.shard_map``: the maps'
    arrays, then the query and key segment ids."""
    *maps, q_seg, kv_seg = args
    return _kernel_ring(static, me, tuple(maps), q_seg, kv_seg)


def _ring_index(mesh, axis):
    """``arange(N)`` split over ``axis``: each device's index on it, as an input (see
    :func:`_kernel_ring_forward`)."""
    return jnp.arange(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis], dtype=jnp.int32)


def _kernel_order(impl, order, positions):
    """The order the kernel ring lays the blocks out by; refuses what it cannot take."""
    if impl != "ring":
        raise ConfigError(
            f"context.kernel: the Pallas kernels run as the ring's blocks; impl={impl!r} "
            f"gathers K/V for the XLA math. Fix: impl='ring', or kernel=None"
        )
    if positions is not None:
        raise ConfigError(
            "context.kernel: the kernel ring masks by the order's layout, not by positions. "
            "Fix: pass the inputs in `order` without positions (rotary positions are applied "
            "before attention), or kernel=None to mask by position"
        )
    return order


def _kernel_static(
    axis_name, causal, scale, order, kernel, interpret, compute_capability=None, logit_max=False
):
    if order not in KERNEL_ORDERS:
        raise ConfigError(
            f"context.order: the ring on the Pallas kernels takes the tokens' layout from "
            f"their order, one of {', '.join(map(repr, KERNEL_ORDERS))}; got {order!r}. Fix: "
            f"use the zigzag order (mesh.context_order=zigzag), or the XLA blocks "
            f"(model.attention_impl=xla), which mask by position in any order"
        )
    module = kernels.kernel_module(kernel, interpret=interpret)
    if not hasattr(module, "flash_partials"):
        raise ConfigError(
            f"context.kernel: the {kernel!r} kernels do not return their partial results yet, "
            f"so they cannot be the ring's blocks. Fix: model.attention_impl=xla with a "
            f"context axis on this backend"
        )
    gpu = module.__name__.endswith(".gpu")  # the GPU kernel's tiles follow the target GPU
    extra = (
        (("compute_capability", tuple(compute_capability)),) if gpu and compute_capability else ()
    )
    return (axis_name, causal, scale, order, (module, bool(interpret), extra), bool(logit_max))


# ---------------------------------------------------------------------------- all-gather
def _gather(x, axis_name, axis):
    return None if x is None else jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def allgather_attention(
    q,
    k,
    v,
    *,
    second=None,
    axis_name,
    q_pos,
    k_pos,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    logit_max: bool = False,
):
    """:func:`ring_attention`'s result (same arguments, one map or two, inside
    ``jax.shard_map``) by gathering K/V, their positions and segment ids whole on every
    device (``jax.lax.all_gather(tiled=True)``), then the reference's math on the
    ``[Tq, N*Tk]`` maps of the local queries. Plain autodiff; ``O(T)`` memory per device.
    Returns ``[B, Tq, Hq, Dv]`` in ``q.dtype`` (``logit_max``: ``(out, maxes)``, each map's
    largest visible logit per row from those maps' logits, ``[n_maps, B, Tq, Hq]``)."""
    scale = reference._default_scale(q, scale)
    q_pos, k_pos = _positions(q_pos, k_pos)
    kv_seg = _kv_seg(segment_ids, kv_segment_ids)
    k2 = None if second is None else second[1]
    k, k2, v = (_gather(x, axis_name, 1) for x in (k, k2, v))
    k_pos, kv_seg = _gather(k_pos, axis_name, k_pos.ndim - 1), _gather(kv_seg, axis_name, 1)
    mask = position_mask(
        q_pos, k_pos, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_seg
    )
    second = None if second is None else (second[0], k2, second[2])
    return reference.masked_attention(
        q, k, v, mask, second=second, scale=scale, logit_max=logit_max
    )


# ---------------------------------------------------------------------------- wrappers
def _setup(mesh, axis, impl, order, q, k, positions):
    """Check the wrapper's options; the positions ``[T]`` or ``[B, T]`` (int32) of the
    tokens in the inputs' order."""
    if impl not in IMPLS:
        raise ConfigError(
            f"context.impl: unknown implementation {impl!r}. Fix: use one of "
            f"{', '.join(map(repr, IMPLS))}"
        )
    if order not in KERNEL_ORDERS:  # the orders whose layout follows from their name
        raise ConfigError(
            f"context.order: unknown token order {order!r}. Fix: use one of "
            f"{', '.join(map(repr, KERNEL_ORDERS))} (and put the inputs in that order)"
        )
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if axis not in sizes:
        raise ConfigError(
            f"context.axis: {axis!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)}). "
            f"Fix: pass axis= one of them, or build the mesh with a {axis!r} axis"
        )
    (b, seq_len), kv_len = q.shape[:2], k.shape[1]
    if kv_len != seq_len:
        raise ValueError(
            f"context attention: keys and queries must have the same length (self-attention), "
            f"got {kv_len} and {seq_len}"
        )
    n = sizes[axis]
    if positions is not None:
        positions = jnp.asarray(positions, jnp.int32)
        if positions.shape not in ((seq_len,), (b, seq_len)):
            raise ValueError(
                f"context attention: positions must be [seq] = [{seq_len}] or [batch, seq] = "
                f"[{b}, {seq_len}], got {positions.shape}"
            )
        _check_divisible(seq_len, n, f"blocks over the {n} devices of {axis!r}")
        return positions
    if order == "zigzag":
        return jnp.asarray(zigzag_order(seq_len, n), jnp.int32)
    _check_divisible(seq_len, n, f"contiguous blocks over the {n} devices of {axis!r}")
    return jnp.arange(seq_len, dtype=jnp.int32)


def _specs(axis, batch_axes, head_axes, positions):
    """``(heads [B,T,H,D], rows [B,T,H], tokens [B,T], positions)`` partition specs."""
    pos = P(axis) if positions.ndim == 1 else P(batch_axes, axis)
    return (
        P(batch_axes, axis, head_axes, None),
        P(batch_axes, axis, head_axes),
        P(batch_axes, axis),
        pos,
    )


def _out_spec(heads, rows, logit_max: bool):
    """The wrappers' out specs: ``out`` like the heads; with ``logit_max`` also the maxes
    ``[n_maps, B, T, Hq]``, each map split like the rows."""
    return (heads, P(None, *rows)) if logit_max else heads


def _run(fn, mesh, args, specs, out_spec):
    in_specs = tuple(None if a is None else s for a, s in zip(args, specs, strict=True))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
        *args
    )


def _checked_maps(q, k, v, second, segment_ids, kv_segment_ids) -> tuple:
    """:func:`context_attention`'s arrays, checked: one map's ``(q, k, v)`` or two maps'
    ``(q, k, q2, k2, v, lam)`` (lam float32)."""
    if second is None:
        reference.check_qkv(q, k, v, segment_ids, kv_segment_ids, what="context_attention")
        return (q, k, v)
    q2, k2, lam = second
    reference.check_differential(
        q, k, q2, k2, v, lam, segment_ids, kv_segment_ids, what="context_attention"
    )
    return (q, k, q2, k2, v, jnp.asarray(lam, jnp.float32))


def split_maps(maps: tuple):
    """``(q, k, v, second)`` from :func:`_checked_maps`'s arrays (``second`` None for one)."""
    if len(maps) == 3:
        return (*maps, None)
    q, k, q2, k2, v, lam = maps
    return q, k, v, (q2, k2, lam)


def context_attention(
    q,
    k,
    v,
    *,
    second=None,
    mesh,
    axis: str = "context",
    impl: str = "ring",
    order: str = RUN_TOKEN_ORDER,
    positions=None,
    batch_axes=None,
    head_axes=None,
    causal: bool = True,
    segment_ids=None,
    kv_segment_ids=None,
    scale: float | None = None,
    block_k: int | None = DEFAULT_BLOCK_K,
    kernel: str | None = None,
    interpret: bool = False,
    compute_capability: tuple[int, int] | None = None,
    logit_max: bool = False,
):
    """Attention with the sequence sharded over ``mesh``'s ``axis``, for one softmax map or
    two; call from outside ``jax.shard_map``.

    One map (``second`` None): standard attention ``softmax(q k^T s) v``. Two maps
    (``second=(q2, k2, lam)``): differential attention ``softmax(q k^T s) v - lam *
    softmax(q2 k2^T s) v`` (``k2`` None: both maps read ``k``; ``lam`` a scalar or
    ``[B, T, Hq]``).

    Inputs are whole arrays already in ``order`` along T: q, q2 ``[B, T, Hq, D]``; k, k2
    ``[B, T, Hkv, D]``; v ``[B, T, Hkv, Dv]``; segment ids ``[B, T]``. For ``order="zigzag"``
    the caller permuted them with ``x[:, zigzag_order(T, n)]`` (``n`` the axis size) and
    un-permutes the output with :func:`inverse_order`; ``"contiguous"`` is the natural order.
    ``positions`` ``[T]`` or ``[B, T]`` (int), when given, are the tokens' global positions in
    whatever order the inputs are in, and ``order`` is not used. ``impl``: ``"ring"`` or
    ``"allgather"``; ``block_k``: the ring's key chunk (see :func:`ring_attention`).

    ``batch_axes`` / ``head_axes``: mesh axes (a name, a tuple of names, or None) that split
    the batch and the heads (kv and query heads alike, so each query head keeps its kv group);
    other mesh axes replicate. Returns ``[B, T, Hq, Dv]`` in ``q.dtype``, in the inputs'
    token order.

    ``kernel`` (``"gpu"``, ``"tpu"``; None: the XLA math): the ring's blocks run the fused
    Pallas kernels (``interpret=True`` on CPU; ``compute_capability``: the GPU they are compiled
    for, default this one), which mask by index: the inputs in ``order``, ``positions`` None.

    ``logit_max=True``: ``(out, maxes)``, ``maxes`` float32 ``[n_maps, B, T, Hq]`` each map's
    largest logit per row over the keys it sees, in the inputs' token order and sharded like
    ``out``'s rows; without gradient.

    Raises :class:`ConfigError` for an unknown impl or order, an axis not in the mesh, or a
    T that the axis size (2x the axis size for zigzag) does not divide.
    """
    maps = _checked_maps(q, k, v, second, segment_ids, kv_segment_ids)
    pos = _setup(mesh, axis, impl, order, q, k, positions)
    heads, rows, tokens, pos_spec = _specs(axis, batch_axes, head_axes, pos)
    if len(maps) == 3:
        map_specs = (heads,) * 3
    else:  # lam: V1's scalar whole, V2's [B, T, Hq] split like the rows
        map_specs = (heads,) * 5 + (P() if maps[-1].ndim == 0 else rows,)
    scale = reference._default_scale(q, scale)
    kv_seg = _kv_seg(segment_ids, kv_segment_ids)
    out_spec = _out_spec(heads, rows, logit_max)
    if kernel is not None:
        kernel_order = _kernel_order(impl, order, positions)
        static = (axis, causal, scale, kernel_order, kernel, interpret, compute_capability)
        static = _kernel_static(*static, logit_max)
        args = (_ring_index(mesh, axis), *maps, segment_ids, kv_seg)
        return _run(
            partial(_kernel_ring_shard, static),
            mesh,
            args,
            (P(axis), *map_specs, tokens, tokens),
            out_spec,
        )
    fn = partial(ring_attention, block_k=block_k) if impl == "ring" else allgather_attention
    n = len(maps)

    def run(*args):
        pos, seg, kv_seg = args[n:]
        q, k, v, second = split_maps(args[:n])
        return fn(
            q,
            k,
            v,
            second=second,
            axis_name=axis,
            q_pos=pos,
            k_pos=pos,
            causal=causal,
            segment_ids=seg,
            kv_segment_ids=kv_seg,
            scale=scale,
            logit_max=logit_max,
        )

    specs = (*map_specs, pos_spec, tokens, tokens)
    return _run(run, mesh, (*maps, pos, segment_ids, kv_seg), specs, out_spec)
