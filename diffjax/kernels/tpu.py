"""Fused differential (and standard) flash attention for TPU, in Pallas (Mosaic).

One kernel family serves both attention kinds; a static ``differential`` flag in every kernel
body switches between

- differential: ``out = softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v`` (each branch with its
  own online-softmax state and denominator, one pass over the keys, the value block loaded once
  for both branches), and
- standard: ``out = softmax(q k^T s) v`` (one branch, no lambda),

so that a differential model and its standard twin are measured with the same machinery.

Layout of the public API: ``[batch, seq, heads, dim]``. Internally the wrappers transpose to
``[batch, heads, seq, dim]`` (the sequence on sublanes, the head dim on lanes), pad the sequences
to a multiple of the block sizes (padded keys are masked in the kernels by an iota comparison
against the true length; padded queries are sliced off) and undo both afterwards.

Kernels (all ``pl.pallas_call`` with VMEM tiles):

- forward, grid ``(batch, q_heads, q_blocks, k_blocks)``, the key axis ``"arbitrary"``; VMEM
  scratch holds a running max ``m``, denominator ``l`` (lane-replicated ``[block_q, 128]``) and a
  float32 accumulator ``[block_q, Dv]`` per branch; the last key block normalises each branch and
  subtracts. Residuals for the backward pass: each branch's log-sum-exp (float32) and the
  normalised second-branch output ``O2`` (float32 unless ``o2_dtype``, as on the GPU). Asked
  for (``return_logit_max``, ``flash_partials(return_row_max=True)``), each branch's running
  max ``m`` is written too, lane-replicated like the log-sum-exps (diagnostics).
- dK/dV, grid ``(batch, kv_heads, k_blocks, group, q_blocks)``: a key block stays resident while
  the kernel walks over the query heads of its GQA group (an ``"arbitrary"`` axis) and their query
  blocks (``"arbitrary"``), accumulating dK1, dK2 (or their sum for a shared K) and dV in VMEM.
  dK/dV therefore come out per kv head directly: no per-query-head partials, no repeated K/V.
  It works on transposed tiles (keys on sublanes, queries on lanes) so the per-query statistics
  (log-sum-exp, delta, lambda) are lane-laid row vectors that broadcast without relayout.
- dQ, grid ``(batch, q_heads, q_blocks, k_blocks)``, the key axis ``"arbitrary"``, accumulating
  dQ1 and dQ2 in VMEM.

Backward maths with ``dO1 = dO`` and ``dO2 = -lam dO`` (rows): ``dP2 = -lam dP1`` with
``dP1 = dO V^T``, so one ``dO V^T`` product serves both branches; ``delta1 = rowsum(dO O1)``,
``delta2 = rowsum(dO O2) = -dlam``; ``dS1 = P1 (dP1 - delta1)``, ``dS2 = -lam P2 (dP1 - delta2)``;
``dV = (P1 - lam P2)^T dO`` (one product); ``dQi = s dSi Ki``, ``dKi = s dSi^T Qi``.

Causal masking is bottom-right aligned (query ``i`` sees key ``j <= i + S - T``). Key blocks that
no query of the current block may see (above the diagonal, or wholly padding) are skipped with
``pl.when``, and the index maps clamp their block index to the last block that is used, so the
pipeline issues no DMA for them (the same block index twice in a row is not fetched again).
Blocks wholly below the diagonal run a mask-free body. A query row that sees no key outputs
exactly 0 and gets zero gradients (log-sum-exp ``+inf`` there, so its probabilities are 0).

Each kernel takes its operands, outputs and VMEM scratch as named refs, with the GPU kernel's
names (``q1_ref, k1_ref, q2_ref, k2_ref, v_ref, lam_ref, qseg_ref, kseg_ref``, then ``do_ref``,
``lse1_ref``, ``delta1_ref``, ``lse2_ref``, ``delta2_ref`` in the backward); those a configuration
lacks (the second branch of the standard kernel, ``k2`` for shared keys, segment ids, the
residuals of a forward pass without backward) are passed as None and get no block spec.

With ``k2=None`` (DIFF V2: both maps read one key array) a shared-K variant loads each key block
once and returns ``dK = dK1 + dK2`` for it.

Everything accumulates in float32: logits and products use ``preferred_element_type=float32``;
probabilities are cast to V's dtype before ``P V`` (like the XLA reference); the subtraction runs
in float32 with a float32 lambda. float16 inputs run through the kernels in float32 (TPUs have no
float16 matrix unit), the output is cast back to float16.

Run on a CPU with ``interpret=True`` or ``interpret=pltpu.InterpretParams()``.

The public functions (their signatures, documentation, input checks, defaults and errors) are
the shared front end's (:mod:`diffjax.kernels._frontend`), built at the end of this module from
its functions on a checked call: the same bad input is refused alike on either backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import dot_nn as _dot_nn, dot_nt as _dot_nt
from ._common import check_block_fields, next_pow2 as _next_pow2, round_up as _round_up
from ._frontend import Call, Frontend
from .reference import MASK_VALUE

__all__ = [
    "BlockSizes",
    "VmemRequest",
    "differential_flash_attention",
    "flash_attention",
    "flash_partial_grads",
    "flash_partials",
    "vmem_requests",
]

NUM_LANES = 128
NUM_SUBLANES = 8
_F32 = jnp.float32


# ============================================================================ block sizes
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (in tokens) of the three kernels.

    ``block_q``/``block_k``: forward query/key tiles; ``*_dkv``: the dK/dV kernel's; ``*_dq``: the
    dQ kernel's. A size larger than the sequence is clamped to the power of two (at least 8) that
    covers it, and the sequences are padded to the least common multiple of their blocks. On TPU
    hardware every size must be a multiple of 128 (the key axis of a logits tile and the per-query
    statistics are laid along the 128 lanes; 128 is also a multiple of the 8 sublanes), unless it
    covers the whole padded sequence; interpret mode accepts any positive size. Checked at call
    time; construction only checks that each size is a positive int.
    """

    block_q: int = 128
    block_k: int = 512
    block_q_dkv: int = 128
    block_k_dkv: int = 512
    block_q_dq: int = 128
    block_k_dq: int = 512

    def __post_init__(self):
        check_block_fields(
            self, [f.name for f in dataclasses.fields(self)], lambda b: b >= 1, "a positive int"
        )

    @property
    def q_blocks(self) -> tuple[int, int, int]:
        return (self.block_q, self.block_q_dkv, self.block_q_dq)

    @property
    def k_blocks(self) -> tuple[int, int, int]:
        return (self.block_k, self.block_k_dkv, self.block_k_dq)


def _effective_blocks(
    length: int, blocks: tuple[int, ...], names: tuple[str, ...], hardware: bool
) -> tuple[int, tuple[int, ...]]:
    """Clamp ``blocks`` to the sequence and return ``(padded_length, clamped_blocks)``.

    A block larger than the sequence is clamped to the power of two (at least 8) that covers it,
    so clamped blocks of one kernel family stay compatible; the sequence is padded to the least
    common multiple of the blocks.
    """
    cover = max(NUM_SUBLANES, _next_pow2(length))
    eff = tuple(min(b, cover) for b in blocks)
    padded = _round_up(length, math.lcm(*eff))
    if hardware:
        for name, b in zip(names, eff):
            if b != padded and b % NUM_LANES:
                raise ValueError(
                    f"block size {name}={b} is not a multiple of {NUM_LANES}: on TPU hardware "
                    f"blocks must be multiples of {NUM_LANES} (lane width; hence also of the "
                    f"{NUM_SUBLANES} sublanes) unless one block covers the whole padded sequence "
                    f"(here {padded}). Fix: use multiples of {NUM_LANES}, or pass interpret=True "
                    "to run small blocks in interpret mode."
                )
    return padded, eff


# ============================================================================ static config
@dataclasses.dataclass(frozen=True)
class _Config:
    differential: bool
    shared_k: bool
    lam_mode: str | None  # "scalar" (SMEM), "row" ([B, Hq, 1, Tp]) or None (standard)
    segmented: bool
    causal: bool
    scale: float  # the softmax scale (sm_scale of the public functions)
    q_len: int  # true query length
    kv_len: int  # true key length
    t_pad: int  # padded lengths
    s_pad: int
    hq: int
    hkv: int
    dv: int
    blocks: BlockSizes  # effective (clamped) sizes
    compute_dtype: Any
    interpret: Any
    o2_dtype: Any = jnp.float32  # the saved second-branch output (a backward residual)
    row_max: bool = False  # the forward also writes each branch's running row max (logit_max)

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def offset(self) -> int:  # query i sees key j iff j <= i + offset (bottom-right aligned)
        return self.kv_len - self.q_len


# ============================================================================ kernel helpers
def _lanes(x, n: int):
    """A lane-replicated ``[rows, 128]`` array as ``[rows, n]`` (tile or slice, no relayout)."""
    if n == NUM_LANES:
        return x
    if n % NUM_LANES == 0:
        return jnp.tile(x, (1, n // NUM_LANES))
    if n < NUM_LANES:
        return x[:, :n]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def _col(row_ref):
    """A ``[1, n]`` row block as an ``[n, 1]`` column."""
    return jnp.expand_dims(row_ref[0], -1)


def _and(a, b):
    if a is True:
        return b
    if b is True:
        return a
    return jnp.logical_and(a, b)


def _or(a, b):
    if a is False:
        return b
    if b is False:
        return a
    return jnp.logical_or(a, b)


def _block_conditions(cfg: _Config, qi, kj, bq: int, bk: int):
    """``(run, masked)`` for query block ``qi`` against key block ``kj``.

    ``run``: some (query, key) pair of the tile is visible (else the tile is skipped).
    ``masked``: the tile straddles the causal diagonal or the end of the keys, so the causal /
    padding mask must be applied. Both are Python bools when static.
    """
    run, masked = True, False
    off = cfg.offset
    if cfg.causal:
        run = _and(run, kj * bk <= qi * bq + (bq - 1 + off))
        masked = _or(masked, kj * bk + (bk - 1) > qi * bq + off)
    if cfg.s_pad != cfg.kv_len:
        if pl.cdiv(cfg.kv_len, bk) < cfg.s_pad // bk:  # wholly padded key blocks exist
            run = _and(run, kj * bk < cfg.kv_len)
        masked = _or(masked, kj * bk + bk > cfg.kv_len)
    if pl.cdiv(cfg.q_len, bq) < cfg.t_pad // bq:  # wholly padded query blocks exist
        run = _and(run, qi * bq < cfg.q_len)
    return run, masked


def _run_tile(run, masked, body):
    """Call ``body(use_mask)`` under ``pl.when``; a mask-free body for interior tiles."""
    if run is False:
        return
    if masked is True or masked is False:
        if run is True:
            body(masked)
        else:
            pl.when(run)(lambda: body(masked))
        return
    pl.when(_and(run, masked))(lambda: body(True))
    pl.when(_and(run, jnp.logical_not(masked)))(lambda: body(False))


def _tile_mask(
    cfg: _Config, q_start, k_start, nq: int, nk: int, *, transposed: bool, use_mask: bool, seg
):
    """Boolean visibility of a tile, ``[nq, nk]`` (``[nk, nq]`` if transposed), or None.

    ``seg``: ``(q_ids, k_ids)`` already shaped to broadcast against the tile, or None.
    """
    shape, qdim, kdim = ((nk, nq), 1, 0) if transposed else ((nq, nk), 0, 1)
    mask = None
    if use_mask:
        kidx = lax.broadcasted_iota(jnp.int32, shape, kdim) + k_start
        if cfg.causal:
            qidx = lax.broadcasted_iota(jnp.int32, shape, qdim) + q_start
            mask = kidx <= qidx + cfg.offset
        if cfg.s_pad != cfg.kv_len:
            pad_ok = kidx < cfg.kv_len
            mask = pad_ok if mask is None else jnp.logical_and(mask, pad_ok)
    if seg is not None:
        same = seg[0] == seg[1]
        mask = same if mask is None else jnp.logical_and(mask, same)
    return mask


def _lam_value(cfg: _Config, lam_ref, orient: str):
    """Lambda as a scalar (SMEM) or per-query ``[bq, 1]`` column / ``[1, bq]`` row (float32)."""
    if cfg.lam_mode == "scalar":
        return lam_ref[0]
    return _col(lam_ref) if orient == "col" else lam_ref[...]


# ---------------------------------------------------------------------------- index maps
def _last_kv_block(cfg: _Config, qi, bq: int, bk: int):
    """Last key block any query of block ``qi`` may see (for clamping skipped tiles' DMAs)."""
    last = (cfg.kv_len - 1) // bk
    if cfg.causal:
        reach = jnp.maximum(qi * bq + (bq - 1 + cfg.offset), 0)
        last = jnp.minimum(lax.div(reach, jnp.int32(bk)), last)
    return last


def _kv_index(cfg: _Config, qi, kj, bq: int, bk: int):
    return jnp.minimum(kj, _last_kv_block(cfg, qi, bq, bk))


def _q_index_dkv(cfg: _Config, kj, qi, bq: int, bk: int):
    """Clamp query block ``qi`` into the range key block ``kj`` needs."""
    last = (cfg.q_len - 1) // bq
    if cfg.causal:
        first = lax.div(jnp.maximum(kj * bk - cfg.offset, 0), jnp.int32(bq))
        qi = jnp.maximum(qi, first)
    return jnp.minimum(qi, last)


# ============================================================================ forward kernel
def _fwd_kernel(
    q1_ref,
    k1_ref,
    q2_ref,
    k2_ref,
    v_ref,
    lam_ref,
    qseg_ref,
    kseg_ref,
    o_ref,
    lse1_ref,
    lse2_ref,
    o2_ref,
    max1_ref,
    max2_ref,
    m1_ref,
    l1_ref,
    acc1_ref,
    m2_ref,
    l2_ref,
    acc2_ref,
    *,
    cfg: _Config,
):
    """One query block of one head against key block ``kj``. Operands a configuration does not
    use are None: q2, k2, lam, lse2, o2 and the second branch's scratch (m2, l2, acc2) for the
    standard kernel, k2 for shared keys, the segment ids when unpacked, the residuals (lse1,
    lse2, o2) when no backward pass needs them, the row maxes (max1, max2: each branch's
    running max ``m``, lane-replicated; -inf or ``MASK_VALUE`` where the row saw no key) unless
    ``cfg.row_max``."""
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    states = [(m1_ref, l1_ref, acc1_ref)]
    if cfg.differential:
        states.append((m2_ref, l2_ref, acc2_ref))
    qi, kj = pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init():
        for m_ref, l_ref, acc_ref in states:
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
            l_ref[...] = jnp.zeros(l_ref.shape, _F32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    def body(use_mask: bool):
        seg = None if qseg_ref is None else (_col(qseg_ref), kseg_ref[...])
        mask = _tile_mask(
            cfg, qi * bq, kj * bk, bq, bk, transposed=False, use_mask=use_mask, seg=seg
        )
        v = v_ref[...]
        k1 = k1_ref[...]
        pairs = [(q1_ref[...], k1)]
        if cfg.differential:
            pairs.append((q2_ref[...], k1 if k2_ref is None else k2_ref[...]))
        for (q, k), (m_ref, l_ref, acc_ref) in zip(pairs, states):
            s = _dot_nt(q, k) * cfg.scale
            if mask is not None:
                s = jnp.where(mask, s, MASK_VALUE)
            m_prev, l_prev = m_ref[...], l_ref[...]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
            p = jnp.exp(s - _lanes(m_next, bk))
            if mask is not None:
                p = jnp.where(mask, p, 0.0)  # a row with no visible key keeps l == 0
            alpha = jnp.exp(m_prev - m_next)
            l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[...] = m_next
            acc_ref[...] = acc_ref[...] * _lanes(alpha, cfg.dv) + _dot_nn(p.astype(v.dtype), v)

    _run_tile(*_block_conditions(cfg, qi, kj, bq, bk), body)

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        outs, lses = [], []
        for m_ref, l_ref, acc_ref in states:
            l, m = l_ref[...], m_ref[...]
            empty = l == 0.0
            inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
            outs.append(acc_ref[...] * _lanes(inv, cfg.dv))
            lses.append(jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l))))
        if cfg.differential:
            out = outs[0] - _lam_value(cfg, lam_ref, "col") * outs[1]
        else:
            out = outs[0]
        o_ref[...] = out.astype(o_ref.dtype)
        for (m_ref, _, _), max_ref in zip(states, (max1_ref, max2_ref)):
            if max_ref is not None:
                max_ref[...] = m_ref[...]
        if lse1_ref is not None:
            lse1_ref[...] = lses[0]
            if cfg.differential:
                lse2_ref[...] = lses[1]
                o2_ref[...] = outs[1].astype(o2_ref.dtype)


# ============================================================================ dK/dV kernel
def _dkv_kernel(
    q1_ref,
    k1_ref,
    q2_ref,
    k2_ref,
    v_ref,
    lam_ref,
    qseg_ref,
    kseg_ref,
    do_ref,
    lse1_ref,
    delta1_ref,
    lse2_ref,
    delta2_ref,
    dk1_ref,
    dk2_ref,
    dv_ref,
    dk1_acc,
    dk2_acc,
    dv_acc,
    *,
    cfg: _Config,
):
    """dK (dK1, dK2, or their sum for shared keys: dk2_ref and dk2_acc None) and dV of one key
    block of one kv head, accumulated over the query heads of its group and their query blocks.
    Transposed tiles: keys on sublanes, queries on lanes."""
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    kj, rep, qi = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    dk_accs = [acc for acc in (dk1_acc, dk2_acc) if acc is not None]

    @pl.when(jnp.logical_and(rep == 0, qi == 0))
    def _init():
        for acc in (*dk_accs, dv_acc):
            acc[...] = jnp.zeros(acc.shape, _F32)

    def body(use_mask: bool):
        seg = None if qseg_ref is None else (qseg_ref[...], _col(kseg_ref))  # [1, bq] vs [bk, 1]
        mask = _tile_mask(
            cfg, qi * bq, kj * bk, bq, bk, transposed=True, use_mask=use_mask, seg=seg
        )
        v, do = v_ref[...], do_ref[...]
        k1, q1 = k1_ref[...], q1_ref[...]
        dp_t = _dot_nt(v, do)  # [bk, bq] = (dO V^T)^T

        def probs(k, q, lse_ref):
            p = jnp.exp(_dot_nt(k, q) * cfg.scale - lse_ref[...])  # lse: [1, bq] row
            return p if mask is None else jnp.where(mask, p, 0.0)

        p1 = probs(k1, q1, lse1_ref)
        ds1 = p1 * (dp_t - delta1_ref[...])
        if not cfg.differential:
            dv_acc[...] += _dot_nn(p1.astype(do.dtype), do)
            dk1_acc[...] += _dot_nn(ds1.astype(q1.dtype), q1)
            return
        q2 = q2_ref[...]
        k2 = k1 if k2_ref is None else k2_ref[...]
        lam = _lam_value(cfg, lam_ref, "row")
        p2 = probs(k2, q2, lse2_ref)
        ds2 = (-lam) * p2 * (dp_t - delta2_ref[...])
        dv_acc[...] += _dot_nn((p1 - lam * p2).astype(do.dtype), do)
        dk1 = _dot_nn(ds1.astype(q1.dtype), q1)
        dk2 = _dot_nn(ds2.astype(q2.dtype), q2)
        if dk2_acc is None:  # shared keys: dK = dK1 + dK2 in one accumulator
            dk1_acc[...] += dk1 + dk2
        else:
            dk1_acc[...] += dk1
            dk2_acc[...] += dk2

    _run_tile(*_block_conditions(cfg, qi, kj, bq, bk), body)

    @pl.when(jnp.logical_and(rep == pl.num_programs(3) - 1, qi == pl.num_programs(4) - 1))
    def _finish():
        for dk_ref, acc in ((dk1_ref, dk1_acc), (dk2_ref, dk2_acc)):
            if acc is not None:
                dk_ref[...] = (acc[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


# ============================================================================ dQ kernel
def _dq_kernel(
    q1_ref,
    k1_ref,
    q2_ref,
    k2_ref,
    v_ref,
    lam_ref,
    qseg_ref,
    kseg_ref,
    do_ref,
    lse1_ref,
    delta1_ref,
    lse2_ref,
    delta2_ref,
    dq1_ref,
    dq2_ref,
    dq1_acc,
    dq2_acc,
    *,
    cfg: _Config,
):
    """dQ1 (and dQ2) of one query block of one head, accumulated over the key blocks."""
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    qi, kj = pl.program_id(2), pl.program_id(3)
    accs = [acc for acc in (dq1_acc, dq2_acc) if acc is not None]

    @pl.when(kj == 0)
    def _init():
        for acc in accs:
            acc[...] = jnp.zeros(acc.shape, _F32)

    def body(use_mask: bool):
        seg = None if qseg_ref is None else (_col(qseg_ref), kseg_ref[...])
        mask = _tile_mask(
            cfg, qi * bq, kj * bk, bq, bk, transposed=False, use_mask=use_mask, seg=seg
        )
        v, do = v_ref[...], do_ref[...]
        k1, q1 = k1_ref[...], q1_ref[...]
        dp = _dot_nt(do, v)  # [bq, bk]

        def probs(q, k, lse_ref):
            p = jnp.exp(_dot_nt(q, k) * cfg.scale - _col(lse_ref))
            return p if mask is None else jnp.where(mask, p, 0.0)

        ds1 = probs(q1, k1, lse1_ref) * (dp - _col(delta1_ref))
        dq1_acc[...] += _dot_nn(ds1.astype(k1.dtype), k1)
        if cfg.differential:
            k2 = k1 if k2_ref is None else k2_ref[...]
            lam = _lam_value(cfg, lam_ref, "col")
            ds2 = (-lam) * probs(q2_ref[...], k2, lse2_ref) * (dp - _col(delta2_ref))
            dq2_acc[...] += _dot_nn(ds2.astype(k2.dtype), k2)

    _run_tile(*_block_conditions(cfg, qi, kj, bq, bk), body)

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        for dq_ref, acc in ((dq1_ref, dq1_acc), (dq2_ref, dq2_acc)):
            if acc is not None:
                dq_ref[...] = (acc[...] * cfg.scale).astype(dq_ref.dtype)


# ============================================================================ pallas calls
_DEFAULT_SCOPED_VMEM = 16 * 2**20  # the smallest default scoped VMEM limit (v5e)
_MAX_VMEM_LIMIT = 48 * 2**20  # below every current chip's physical VMEM per core


def _tile_bytes(shape, itemsize: int) -> int:
    """VMEM bytes of an array tile, its last two dims padded to (8, 128)."""
    shape = (1, 1, *shape)
    lead = math.prod(shape[:-2])
    return lead * _round_up(shape[-2], NUM_SUBLANES) * _round_up(shape[-1], NUM_LANES) * itemsize


def _vmem_estimate(specs, arrays, scratch, tile_shape, n_tiles: int) -> int:
    """Rough VMEM need: double-buffered blocks, scratch, and ``n_tiles`` float32 tiles of
    ``tile_shape`` for the logits / probabilities / their gradients. None arrays and scratch
    (absent in this configuration) count nothing."""
    total = 0
    for spec, x in zip(specs, arrays):
        if x is None or spec.block_shape is None:  # absent, or the whole array in SMEM
            continue
        shape = [b for b in spec.block_shape if b is not None]
        total += 2 * _tile_bytes(shape, jnp.dtype(x.dtype).itemsize)
    total += sum(
        _tile_bytes(sc.shape, jnp.dtype(sc.dtype).itemsize) for sc in scratch if sc is not None
    )
    return total + n_tiles * _tile_bytes(tile_shape, 4)


@dataclasses.dataclass(frozen=True)
class VmemRequest:
    """One kernel call's VMEM: the estimate of what its tiles need (double-buffered blocks,
    scratch, float32 tiles) and the scoped limit it asks the compiler for (None: the
    default)."""

    kernel: str
    estimate: int
    limit: int | None


_REQUESTS: list[VmemRequest] | None = None  # collecting, inside vmem_requests()


@contextlib.contextmanager
def vmem_requests():
    """A list of the :class:`VmemRequest` of every kernel call traced inside the block (what
    the compile check reports beside the compiler's own figures)::

        with vmem_requests() as calls:
            jax.jit(f).lower(*args)
    """
    global _REQUESTS
    saved, _REQUESTS = _REQUESTS, []
    try:
        yield _REQUESTS
    finally:
        _REQUESTS = saved


def _compiler_params(n_parallel: int, n_arbitrary: int, vmem_bytes: int):
    """Grid semantics; raise the scoped VMEM limit when the tiles need more than the default."""
    limit = None
    if vmem_bytes > _DEFAULT_SCOPED_VMEM * 3 // 4:
        limit = min(max(int(vmem_bytes * 1.5), _DEFAULT_SCOPED_VMEM), _MAX_VMEM_LIMIT)
    return pltpu.CompilerParams(
        dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary,
        vmem_limit_bytes=limit,
    )


def _kernel_name(cfg: _Config, what: str) -> str:
    kind = "diff_flash" if cfg.differential else "flash"
    return f"{kind}_{what}" + ("_shared_k" if cfg.shared_k else "")


def _lam_spec(cfg: _Config, row_spec):
    """Lambda's block spec: a scalar in SMEM, or per-query rows tiled like the other rows."""
    if cfg.lam_mode == "scalar":
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return row_spec


def _opt(cond: bool, x):
    return x if cond else None


def _nbytes(arrays) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays if x is not None)


def _call(
    cfg: _Config,
    kernel,
    what: str,
    *,
    grid,
    operands,
    in_specs,
    out_shape,
    out_specs,
    scratch,
    n_arbitrary: int,
    tile,
    n_tiles: int,
    cost=None,
):
    """One ``pl.pallas_call``; the kernel takes operands, outputs and scratch as named refs, in
    that order. A None operand, output shape or scratch shape (one the configuration lacks)
    reaches the kernel as None and gets no block spec and no buffer."""
    in_specs = [None if x is None else s for x, s in zip(operands, in_specs)]
    out_specs = [None if x is None else s for x, s in zip(out_shape, out_specs)]
    vmem = _vmem_estimate(in_specs + out_specs, [*operands, *out_shape], scratch, tile, n_tiles)
    params, name = (
        _compiler_params(len(grid) - n_arbitrary, n_arbitrary, vmem),
        _kernel_name(cfg, what),
    )
    if _REQUESTS is not None:
        _REQUESTS.append(VmemRequest(name, vmem, params.vmem_limit_bytes))
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        interpret=cfg.interpret,
        cost_estimate=cost,
        name=name,
        compiler_params=params,
    )(*operands)


def _q_major_specs(cfg: _Config, bq: int, bk: int, d: int, dv: int):
    """Block specs of a grid ``(batch, q_head, q_block, k_block)`` (the forward and dQ kernels):
    query tiles, key/value tiles of the head's kv group (skipped causal tiles clamped to one
    already loaded, so no DMA is issued), per-query rows and the segment-id rows."""
    grp = cfg.group

    def q_map(bi, h, qi, kj):
        return (bi, h, qi, 0)

    def kv_map(bi, h, qi, kj):
        return (bi, lax.div(h, jnp.int32(grp)), _kv_index(cfg, qi, kj, bq, bk), 0)

    def row_map(bi, h, qi, kj):
        return (bi, h, 0, qi)

    return dict(
        q_map=q_map,
        q=pl.BlockSpec((None, None, bq, d), q_map),
        k=pl.BlockSpec((None, None, bk, d), kv_map),
        v=pl.BlockSpec((None, None, bk, dv), kv_map),
        row=pl.BlockSpec((None, None, 1, bq), row_map),
        qseg=pl.BlockSpec((None, 1, bq), lambda bi, h, qi, kj: (bi, 0, qi)),
        kseg=pl.BlockSpec(
            (None, 1, bk), lambda bi, h, qi, kj: (bi, 0, _kv_index(cfg, qi, kj, bq, bk))
        ),
    )


def _forward(
    cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg, *, save_residuals: bool, out_dtype=None
):
    """Internal layout ``[B, H, T, D]``; returns ``(out, lse1, lse2, o2, maxes)`` (Nones if
    unsaved); ``out`` in ``out_dtype`` (default q1's); ``maxes`` with ``cfg.row_max`` a tuple
    of each branch's running row max ``[B, H, Tp]`` (natural scale; -inf or ``MASK_VALUE``
    where the row saw no key), else None."""
    b, hq, tp, d = q1.shape
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    dv, diff = cfg.dv, cfg.differential
    sp = _q_major_specs(cfg, bq, bk, d, dv)
    operands = (q1, k1, q2, k2, v, lam, qseg, kseg)
    in_specs = [
        sp["q"],
        sp["k"],
        sp["q"],
        sp["k"],
        sp["v"],
        _lam_spec(cfg, sp["row"]),
        sp["qseg"],
        sp["kseg"],
    ]
    lse = jax.ShapeDtypeStruct((b, hq, tp, NUM_LANES), _F32)  # lane-replicated
    lse_spec = pl.BlockSpec((None, None, bq, NUM_LANES), sp["q_map"])
    o_spec = pl.BlockSpec((None, None, bq, dv), sp["q_map"])
    saved, saved2 = save_residuals, save_residuals and diff
    rm = cfg.row_max
    out_shape = [
        jax.ShapeDtypeStruct((b, hq, tp, dv), out_dtype or q1.dtype),
        _opt(saved, lse),
        _opt(saved2, lse),
        _opt(saved2, jax.ShapeDtypeStruct((b, hq, tp, dv), cfg.o2_dtype)),
        _opt(rm, lse),
        _opt(rm and diff, lse),
    ]
    row, acc = pltpu.VMEM((bq, NUM_LANES), _F32), pltpu.VMEM((bq, dv), _F32)
    scratch = [row, row, acc, _opt(diff, row), _opt(diff, row), _opt(diff, acc)]  # m, l, acc

    nbr = 2 if diff else 1
    pairs = b * hq * cfg.q_len * cfg.kv_len * (0.5 if cfg.causal else 1.0)
    cost = pl.CostEstimate(
        flops=int(2 * nbr * (d + dv) * pairs),
        transcendentals=int(nbr * pairs),
        bytes_accessed=_nbytes([*operands, *out_shape]),
    )

    out, lse1, lse2, o2, max1, max2 = _call(
        cfg,
        _fwd_kernel,
        "fwd",
        grid=(b, hq, tp // bq, cfg.s_pad // bk),
        operands=operands,
        in_specs=in_specs,
        out_shape=out_shape,
        out_specs=[o_spec, lse_spec, lse_spec, o_spec, lse_spec, lse_spec],
        scratch=scratch,
        n_arbitrary=1,
        tile=(bq, bk),
        n_tiles=4 * nbr,
        cost=cost,
    )

    def first_lane(x):  # keep one lane, as a [B, H, 1, Tp] row for the backward pass
        return None if x is None else x[..., 0][:, :, None, :]

    maxes = tuple(x[..., 0] for x in (max1, max2) if x is not None) if rm else None
    return out, first_lane(lse1), first_lane(lse2), o2, maxes


def _backward(cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg, do, lse1, delta1, lse2, delta2):
    """``(dq1, dk1, dq2, dk2, dv)``: the dK/dV kernel, then the dQ kernel. The per-query rows
    (lse, delta) are ``[B, H, 1, Tp]``; dq2 is None for the standard kernel and dk2 None when
    there is no separate k2 (standard kernel, shared keys)."""
    b, hq, tp, d = q1.shape
    dv, grp = cfg.dv, cfg.group
    operands = (q1, k1, q2, k2, v, lam, qseg, kseg, do, lse1, delta1, lse2, delta2)

    def in_specs(q, k, v, row, qseg, kseg):
        """In the kernels' operand order; dO is tiled like the queries."""
        do = pl.BlockSpec(q.block_shape[:-1] + (dv,), q.index_map)
        return [q, k, q, k, v, _lam_spec(cfg, row), qseg, kseg, do, row, row, row, row]

    # dK, dV: grid (batch, kv head, key block, query head of the group, query block).
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv

    def q_index(kj, qi):
        return _q_index_dkv(cfg, kj, qi, bq, bk)

    def kv_index(kj):  # inputs: wholly padded key blocks reuse the last real one
        return jnp.minimum(kj, (cfg.kv_len - 1) // bk)

    def q_map(bi, g, kj, rep, qi):
        return (bi, g * grp + rep, q_index(kj, qi), 0)

    def kv_map(bi, g, kj, rep, qi):
        return (bi, g, kv_index(kj), 0)

    def out_map(bi, g, kj, rep, qi):
        return (bi, g, kj, 0)

    specs = in_specs(
        pl.BlockSpec((None, None, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv), kv_map),
        pl.BlockSpec(
            (None, None, 1, bq), lambda bi, g, kj, rep, qi: (bi, g * grp + rep, 0, q_index(kj, qi))
        ),
        pl.BlockSpec((None, 1, bq), lambda bi, g, kj, rep, qi: (bi, 0, q_index(kj, qi))),
        pl.BlockSpec((None, 1, bk), lambda bi, g, kj, rep, qi: (bi, 0, kv_index(kj))),
    )
    dk_shape = jax.ShapeDtypeStruct(k1.shape, k1.dtype)
    dk_spec = pl.BlockSpec((None, None, bk, d), out_map)
    dk_acc = pltpu.VMEM((bk, d), _F32)
    dk1, dk2, dv_ = _call(
        cfg,
        _dkv_kernel,
        "dkv",
        grid=(b, cfg.hkv, cfg.s_pad // bk, grp, tp // bq),
        operands=operands,
        in_specs=specs,
        out_shape=[
            dk_shape,
            _opt(k2 is not None, dk_shape),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        out_specs=[dk_spec, dk_spec, pl.BlockSpec((None, None, bk, dv), out_map)],
        scratch=[dk_acc, _opt(k2 is not None, dk_acc), pltpu.VMEM((bk, dv), _F32)],
        n_arbitrary=2,
        tile=(bk, bq),
        n_tiles=10,
    )

    # dQ: grid (batch, q head, query block, key block), streaming keys like the forward pass.
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    sp = _q_major_specs(cfg, bq, bk, d, dv)
    dq_shape = jax.ShapeDtypeStruct(q1.shape, q1.dtype)
    dq_acc = pltpu.VMEM((bq, d), _F32)
    dq1, dq2 = _call(
        cfg,
        _dq_kernel,
        "dq",
        grid=(b, hq, tp // bq, cfg.s_pad // bk),
        operands=operands,
        in_specs=in_specs(sp["q"], sp["k"], sp["v"], sp["row"], sp["qseg"], sp["kseg"]),
        out_shape=[dq_shape, _opt(cfg.differential, dq_shape)],
        out_specs=[sp["q"], sp["q"]],
        scratch=[dq_acc, _opt(cfg.differential, dq_acc)],
        n_arbitrary=1,
        tile=(bq, bk),
        n_tiles=8,
    )
    return dq1, dk1, dq2, dk2, dv_


# ============================================================================ custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg):
    """Internal layout, padded. ``k2`` is None for shared keys; ``q2``/``k2``/``lam`` None for
    the standard kernel; the segment ids None when unpacked. The output; with ``cfg.row_max``
    ``(out, maxes)``, the branches' row maxes (no gradient: the backward ignores their
    cotangent)."""
    out, _, _, _, maxes = _forward(cfg, q1, k1, q2, k2, v, lam, qseg, kseg, save_residuals=False)
    return (out, maxes) if cfg.row_max else out


def _attention_fwd(cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg):
    out, lse1, lse2, o2, maxes = _forward(
        cfg, q1, k1, q2, k2, v, lam, qseg, kseg, save_residuals=True
    )
    primal = (out, maxes) if cfg.row_max else out
    return primal, (q1, k1, q2, k2, v, lam, qseg, kseg, out, lse1, lse2, o2)


def _attention_bwd(cfg: _Config, res, dout):
    q1, k1, q2, k2, v, lam, qseg, kseg, out, lse1, lse2, o2 = res
    if cfg.row_max:
        dout = dout[0]  # the row maxes carry no gradient
    do32 = dout.astype(_F32)
    # Padded query rows have dout == 0 (the output is sliced), so they contribute nothing.
    delta1 = jnp.sum(do32 * out.astype(_F32), axis=-1)  # rowsum(dO * out), [B, H, Tp]
    delta2 = dlam = None
    if cfg.differential:
        d2 = jnp.sum(do32 * o2, axis=-1)  # rowsum(dO * O2) = -dlam per row
        lam_rows = lam[0] if cfg.lam_mode == "scalar" else lam[:, :, 0, :]
        # O1 = out + lam * O2, so rowsum(dO * O1) = rowsum(dO * out) + lam * rowsum(dO * O2).
        delta1 = delta1 + lam_rows * d2
        delta2 = d2[:, :, None, :]
        dlam = (-jnp.sum(d2)).reshape(1) if cfg.lam_mode == "scalar" else -delta2
    do = dout.astype(cfg.compute_dtype)
    dq1, dk1, dq2, dk2, dv = _backward(
        cfg, q1, k1, q2, k2, v, lam, qseg, kseg, do, lse1, delta1[:, :, None, :], lse2, delta2
    )
    return dq1, dk1, dq2, dk2, dv, dlam, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ============================================================================ wrappers
def _to_internal(x, length):
    """``[B, T, H, D]`` -> ``[B, H, length, D]`` (zero padded)."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))


def _compute_dtype(*xs):
    dt = jnp.result_type(*xs)
    if dt == jnp.float16 or not jnp.issubdtype(dt, jnp.floating):
        return jnp.dtype(_F32)
    return jnp.dtype(dt)


def _prepare(call: Call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids):
    """The kernels' configuration and operands in the internal layout, padded: ``(q1, k1, q2,
    k2, v, lam, qseg, kseg)`` (``k2`` None for shared keys), for a checked call
    (:class:`~._frontend.Call`)."""
    differential, shared_k = call.differential, call.shared_k
    _, t, hq, _ = q1.shape
    s, hkv, dv = k1.shape[1], k1.shape[2], v.shape[3]
    block_sizes = BlockSizes() if call.block_sizes is None else call.block_sizes
    hardware = call.interpret is False or call.interpret is None
    tp, (bq, bq_dkv, bq_dq) = _effective_blocks(
        t, block_sizes.q_blocks, ("block_q", "block_q_dkv", "block_q_dq"), hardware
    )
    sp, (bk, bk_dkv, bk_dq) = _effective_blocks(
        s, block_sizes.k_blocks, ("block_k", "block_k_dkv", "block_k_dq"), hardware
    )
    eff = BlockSizes(bq, bk, bq_dkv, bk_dkv, bq_dq, bk_dq)

    arrays = (
        [q1, k1, v]
        + ([q2] if differential else [])
        + ([k2] if differential and not shared_k else [])
    )
    cdt = _compute_dtype(*arrays)

    lam_mode, lam_in = None, None
    if differential:  # a scalar lambda goes to SMEM, per-query lambdas as rows
        lam_arr = jnp.asarray(lam, _F32)
        if lam_arr.shape == ():
            lam_mode, lam_in = "scalar", lam_arr.reshape(1)
        else:  # [B, T, Hq] (checked)
            lam_mode = "row"
            lam_in = jnp.pad(jnp.swapaxes(lam_arr, 1, 2), ((0, 0), (0, 0), (0, tp - t)))[
                :, :, None, :
            ]

    qseg = kseg = None
    if segment_ids is not None:
        kv = segment_ids if kv_segment_ids is None else kv_segment_ids
        qseg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)))[:, None, :]
        kseg = jnp.pad(kv.astype(jnp.int32), ((0, 0), (0, sp - s)))[:, None, :]

    cfg = _Config(
        differential=differential,
        shared_k=shared_k,
        lam_mode=lam_mode,
        segmented=segment_ids is not None,
        causal=call.causal,
        scale=call.scale,
        q_len=t,
        kv_len=s,
        t_pad=tp,
        s_pad=sp,
        hq=hq,
        hkv=hkv,
        dv=dv,
        blocks=eff,
        compute_dtype=cdt,
        interpret=call.interpret,
        o2_dtype=call.o2_dtype,
        row_max=call.logit_max,
    )

    def prep(x, length):
        return None if x is None else _to_internal(x.astype(cdt), length)

    operands = (
        prep(q1, tp),
        prep(k1, sp),
        prep(q2, tp),
        None if shared_k else prep(k2, sp),
        prep(v, sp),
        lam_in,
        qseg,
        kseg,
    )
    return cfg, operands


def _natural_rows(m, t: int):
    """A running row max ``[B, H, Tp]`` -> ``[B, T, H]``, -inf where the row saw no key (the
    max stayed at its -inf start or at ``MASK_VALUE``, a masked tile's logit)."""
    m = jnp.swapaxes(m[:, :, :t], 1, 2)
    return jnp.where(m <= 0.5 * MASK_VALUE, -jnp.inf, m)


def _run(call: Call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids):
    """The differentiable attention of a checked call, ``[B, T, Hq, Dv]`` in q1's dtype; with
    ``call.logit_max`` ``(out, maxes)``, ``maxes`` float32 ``[n_maps, B, T, Hq]``."""
    t = q1.shape[1]
    cfg, operands = _prepare(call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids)
    out = _attention(cfg, *operands)
    if cfg.row_max:
        out, maxes = out
    out = jnp.swapaxes(out[:, :, :t], 1, 2).astype(q1.dtype)
    if not cfg.row_max:
        return out
    return out, jnp.stack([_natural_rows(m, t) for m in maxes])


# ============================================================================ partials
def _partials(call: Call, q1, k1, q2, k2, v, segment_ids, kv_segment_ids):
    """:meth:`~._frontend.Frontend.flash_partials` of a checked call."""
    t = q1.shape[1]
    lam = 0.0 if call.differential else None  # out = O1 - 0 * O2 = O1, exactly
    cfg, operands = _prepare(call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids)
    o1, lse1, lse2, o2, maxes = _forward(cfg, *operands, save_residuals=True, out_dtype=_F32)

    def back(o, lse, *m):  # internal [B, H, Tp, Dv] / [B, H, 1, Tp] -> [B, T, H, Dv] / [B, T, H]
        lse = jnp.swapaxes(lse[:, :, 0, :t], 1, 2)
        o, lse = jnp.swapaxes(o[:, :, :t], 1, 2), jnp.where(jnp.isinf(lse), -jnp.inf, lse)
        return (o, lse, *(_natural_rows(x, t) for x in m))

    maxes = [(m,) for m in maxes] if cfg.row_max else [(), ()]
    if call.differential:
        return back(o1, lse1, *maxes[0]), back(o2, lse2, *maxes[1])
    return (back(o1, lse1, *maxes[0]),)


def _partial_grads(
    call: Call,
    q1,
    k1,
    q2,
    k2,
    v,
    lam,
    dout,
    lse1,
    delta1,
    lse2,
    delta2,
    segment_ids,
    kv_segment_ids,
):
    """:meth:`~._frontend.Frontend.flash_partial_grads` of a checked call."""
    diff = call.differential
    t, s = q1.shape[1], k1.shape[1]
    cfg, (q1p, k1p, q2p, k2p, vp, lam_in, qseg, kseg) = _prepare(
        call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids
    )
    tp = cfg.t_pad

    def rows(x):  # [B, T, H] -> float32 [B, H, 1, Tp] (padded rows: 0)
        x = jnp.swapaxes(x.astype(_F32), 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, tp - t)))[:, :, None, :]

    def lse_rows(x):  # a row that sees no key: +inf (the kernels' "empty" row: P = 0)
        return rows(jnp.where(jnp.isneginf(x), jnp.inf, x))

    do = _to_internal(dout.astype(cfg.compute_dtype), tp)
    dq1, dk1, dq2, dk2, dv = _backward(
        cfg,
        q1p,
        k1p,
        q2p,
        k2p,
        vp,
        lam_in,
        qseg,
        kseg,
        do,
        lse_rows(lse1),
        rows(delta1),
        lse_rows(lse2) if diff else None,
        rows(delta2) if diff else None,
    )

    def back(x, n, like):
        return None if x is None else jnp.swapaxes(x[:, :, :n], 1, 2).astype(like.dtype)

    return (
        back(dq1, t, q1),
        back(dk1, s, k1),
        back(dq2, t, q1),
        back(dk2, s, k1),
        back(dv, s, v),
    )


# ============================================================================ public functions
# Written once for both backends (diffjax.kernels._frontend): the input checks, defaults and
# errors, and the signatures and documentation of the public functions.
_FRONTEND = Frontend(
    backend="tpu",
    block_sizes_type=BlockSizes,
    attention=_run,
    partials=_partials,
    partial_grads=_partial_grads,
)
differential_flash_attention = _FRONTEND.differential_flash_attention
flash_attention = _FRONTEND.flash_attention
flash_partials = _FRONTEND.flash_partials
flash_partial_grads = _FRONTEND.flash_partial_grads
