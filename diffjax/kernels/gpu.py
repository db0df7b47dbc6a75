"""Fused differential attention for GPUs: Pallas kernels on the Triton lowering.

``differential_flash_attention`` computes, in one pass over the keys,

    out = softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v

with each branch normalised by its own softmax denominator, and ``flash_attention`` is the
standard single-branch kernel built from the same code (a static ``differential`` flag in the
kernel bodies), so the two compare like for like. The semantics are those of
:func:`diffjax.kernels.reference.differential_attention` / ``dot_product_attention``:
layout ``[batch, seq, heads, dim]``, bottom-right aligned causal mask, segment ids, GQA by
index arithmetic, fully masked query rows give a zero output and zero gradients.

Design
------
Forward, grid ``(q_blocks, batch, q_heads)`` (programs that run together share K/V in L2;
causal grids run the query blocks in reverse, heaviest first): each program holds one query
block of both
branches and streams the key/value blocks of its kv group once (``h // (Hq // Hkv)`` in the
index map; K/V are never repeated), keeping two online-softmax states (running max and sum)
and two float32 accumulators. Causal programs stop at the last key block that any of their
queries can see. The epilogue normalises each branch, subtracts in float32 with a float32
lambda and writes ``out`` plus the residuals ``lse1``, ``lse2`` (float32 ``[B, Hq, T]``, in
base 2: the logits are scaled by ``sm_scale * log2(e)`` and exponentiated with ``exp2``) and
the normalised second-branch output ``O2`` (``[B, T, Hq, Dv]``, float32 unless ``o2_dtype``).

Backward (custom VJP), with ``dP = dO V^T`` shared by both branches because
``dO2 = -lam dO``:

* ``delta1 = rowsum(dO * O1)`` with ``O1 = out + lam * O2``, ``delta2 = rowsum(dO * O2)`` and
  ``d(lam) = -delta2`` are cheap row reductions in plain ``jnp``.
* ``dS1 = P1 (dP - delta1)``, ``dS2 = -lam P2 (dP - delta2)``, ``dV = (P1 - lam P2)^T dO``
  (one P·dO product for both branches), ``dK_i = s dS_i^T Q_i``, ``dQ_i = s dS_i K_i``.
* dK/dV kernel, grid ``(kv_blocks, batch, kv_heads)``: one program owns one key block of one
  kv head and loops over the ``Hq // Hkv`` query heads of its GQA group and over the query
  blocks (causal programs start at the first query block that sees the key block), so the
  GQA reduction happens in registers: no per-query-head partials, no atomics.
* dQ kernel, grid ``(q_blocks, batch, q_heads)``: like the forward pass.

Hopper (sm_90) layouts that keep every dot issued once (``BlockSizes.split_forward`` and
``dkv_key_major``; docs/kernels.md): where one warpgroup cannot hold the fused forward's two
float32 accumulators (V1 at Dv=256), the forward runs one program per branch on a
``(q_blocks, batch, 2 * q_heads)`` grid and ``O1 - lam * O2`` follows in XLA; the dK/dV kernel
computes its tiles key-major (``K Q^T``, ``V dO^T``: the owned 64-key block as every dot's rows,
so the warpgroup MMA serves them all) where its accumulators fit one warpgroup.

Diagnostics (``return_logit_max``, ``flash_partials(return_row_max=True)``): the forward also
writes each branch's running row max ``m`` (float32 ``[B, Hq, T]``, base 2; the wrapper divides
it back by ``log2(e)``), an output that exists only when asked for.

Each kernel takes its operands as named refs; those a configuration lacks (the second branch
of the standard kernel, ``k2`` when keys are shared, segment ids, the row maxes) are passed as
None.
Block sizes and warps per kernel and GPU: :func:`default_block_sizes` (chosen with
``benchmarks/compile_kernels.py``; docs/kernels.md).

Shared keys: with ``k2=None`` (DIFF V2: both maps read one key array) a kernel variant with
a single K input loads each key block once, and the backward accumulates ``dK1 + dK2`` into
one accumulator and returns it as the gradient of that one array.

Shapes: sequence lengths are padded inside the wrapper to the block multiple (padded keys are
masked, padded query rows sliced off); head dims are padded with zeros to a power of two
(>= 16), as the Triton lowering needs power-of-two block shapes. The padding sits outside the
custom VJP so autodiff slices the gradients back.

The kernel bodies use only ``jnp`` ops on ref slices (``ref[pl.ds(...), ...]``) and
``lax.dot_general`` with float32 accumulation, so a Mosaic GPU variant can reuse them.
On CPU, pass ``interpret=True``.

The public functions (their signatures, documentation, input checks, defaults and errors) are
the shared front end's (:mod:`diffjax.kernels._frontend`), built at the end of this module from
its functions on a checked call: the same bad input is refused alike on either backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import LOG2E, dot_nn as _dot_nn, dot_nt as _dot_nt, dot_tn as _dot_tn
from ._common import check_block_fields, next_pow2 as _next_pow2, round_up as _round_up
from ._frontend import Call, Frontend
from .reference import MASK_VALUE

_MIN_BLOCK = 16  # Triton: every block dim a power of two, and dots need >= 16
_SQ = getattr(pl, "squeezed", None)  # a squeezed block dimension (None on older jax)

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "differential_flash_attention",
    "flash_attention",
    "flash_partial_grads",
    "flash_partials",
    "shared_memory_bytes",
]


# ---------------------------------------------------------------------------- block sizes
def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels, and Triton launch parameters.

    ``block_q``/``block_k``: query/key block of the forward kernel. ``block_q_dkv``/
    ``block_k_dkv``: query block streamed / key block owned by the dK,dV kernel.
    ``block_q_dq``/``block_k_dq``: query block owned / key block streamed by the dQ kernel.
    Every block must be a power of two >= 16 (Triton's block shapes are powers of two, and its
    dots need at least 16 rows); each is clamped to the (padded) sequence length, so small
    inputs work with the defaults. The defaults keep the two branches' float32 accumulators
    in registers at head dim 64/128 (V twice as wide in DIFF V1) on H100/H200.

    ``num_warps``: the forward kernel's warps, and the backward kernels' unless
    ``num_warps_dkv``/``num_warps_dq`` say otherwise; None picks per kernel and GPU
    (:func:`default_block_sizes`). ``num_stages``: None picks 2. ``block_sizes=None`` in the
    wrappers means :func:`default_block_sizes` for the current GPU.

    ``split_forward`` (DIFF only): run the forward as one program per branch (each a single
    softmax over its own Q_i, K_i and the shared V, one float32 accumulator) and subtract the
    two normalised outputs afterwards, instead of one program holding both branches. True
    where the fused program's two accumulators do not fit one warpgroup (sm_90, V1 at
    Dv=256), which would otherwise issue the score tile in both warpgroups; None picks per GPU.

    ``dkv_key_major``: the dK/dV kernel's tiles as [keys, queries] (P^T, dP^T, dS^T), so that
    every dot has the owned key block as its rows and Hopper's warpgroup MMA (64 rows per
    warpgroup) serves them all, with one warpgroup; True on sm_90 where its accumulators fit
    one warpgroup, None picks per GPU.
    """

    block_q: int = 64
    block_k: int = 32
    block_q_dkv: int = 32
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 32
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_dkv: int | None = None
    num_warps_dq: int | None = None
    split_forward: bool | None = None
    dkv_key_major: bool | None = None

    def __post_init__(self):
        check_block_fields(
            self,
            ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"),
            lambda b: b >= _MIN_BLOCK and _is_pow2(b),
            f"a power of two >= {_MIN_BLOCK} (16, 32, 64, 128, ...): the Triton lowering needs "
            "power-of-two block shapes and dots of at least 16 rows",
        )
        for f in ("num_warps", "num_warps_dkv", "num_warps_dq"):
            w = getattr(self, f)
            if w is not None and (
                isinstance(w, bool) or not isinstance(w, int) or not _is_pow2(w) or w > 32
            ):
                raise ValueError(
                    f"BlockSizes.{f} must be None or one of 1, 2, 4, 8, 16, 32; got {w!r}"
                )
        s = self.num_stages
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"BlockSizes.num_stages must be None or an int >= 1; got {s!r}")
        for f in ("split_forward", "dkv_key_major"):
            if getattr(self, f) not in (None, True, False):
                raise ValueError(
                    f"BlockSizes.{f} must be None, True or False; got {getattr(self, f)!r}"
                )


# Opt-in shared memory per block by compute capability (CUDA programming guide, table of
# technical specifications): what a kernel's pipelined tiles must fit in.
SHARED_MEMORY_BYTES = {
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
    (10, 0): 232448,
    (12, 0): 101376,
}


def device_capability() -> tuple[int, int]:
    """The current GPU's compute capability; (9, 0) when there is none (interpret mode). A
    compile for another GPU passes its own (``compute_capability=``) to the kernels."""
    try:
        dev = jax.devices()[0]
        major, minor = str(getattr(dev, "compute_capability", "9.0")).split(".")[:2]
        return int(major), int(minor)
    except (RuntimeError, ValueError):
        return 9, 0


def default_block_sizes(
    head_dim: int,
    v_head_dim: int | None = None,
    *,
    differential: bool = True,
    shared_keys: bool = False,
    compute_capability: tuple[int, int] | None = None,
    itemsize: int = 2,
) -> BlockSizes:
    """The block sizes the wrappers use when given none, for a target (default: this GPU).

    Chosen with ``benchmarks/compile_kernels.py`` so that every kernel compiles without register
    spills and within the target's shared memory, issuing the one-pass tensor-core work where
    it can (docs/kernels.md has the tables): 64-query forward and dQ tiles streaming 32 keys
    (16 in dQ at the widest heads, so that one warpgroup holds it), a 64-key dK/dV tile
    streaming 32 queries on sm_90; before sm_90 the forward streams 64 keys (32 queries at the
    wider heads) and so does dQ past the narrowest widths; on GPUs with 99 KiB of shared memory
    per block (sm_86/sm_89/sm_120) the dK/dV and dQ tiles are smaller at the widest heads. On
    sm_90 the dK/dV kernel runs key-major on one warpgroup where its accumulators fit (16
    queries per step at the widest heads), else query-major on two. ``head_dim``/
    ``v_head_dim``: q/k and v widths; ``shared_keys``: k2 None (DIFF V2), one dK accumulator;
    ``itemsize``: bytes per input element. float32 tiles take twice the shared memory, so they
    get the tiles of a GPU with half of it (at the widest heads on sm_90 the dK/dV kernel
    streams 16 queries; on 99 KiB GPUs every tile is 32 rows or fewer).
    """
    cc = tuple(compute_capability or device_capability())
    smem = SHARED_MEMORY_BYTES.get(cc, 101376) * 2 // max(itemsize, 2)  # in 2-byte terms
    dv = head_dim if v_head_dim is None else v_head_dim
    d_pad, dv_pad = max(_MIN_BLOCK, _next_pow2(head_dim)), max(_MIN_BLOCK, _next_pow2(dv))
    n_branch = 2 if differential else 1
    width = n_branch * d_pad + dv_pad
    bs = BlockSizes()
    if cc[0] < 9:  # mma.sync: 64 keys per step (32 duplicates the score tile at 8 warps), and
        # at the wider heads a 32-query tile (64 spills or, on 99 KiB GPUs, does not fit)
        bs = dataclasses.replace(bs, block_k=64, block_q=32 if width > 256 else 64)
    if cc[0] >= 9 and not _dq_fits_one_warpgroup(n_branch, d_pad, dv_pad):
        bs = dataclasses.replace(bs, block_k_dq=16)  # one warpgroup (8 warps duplicate dots)
    elif cc[0] < 9 and _dq_cols(n_branch, d_pad, dv_pad) > 192:  # 8 warps: 64 keys per step
        bs = dataclasses.replace(bs, block_k_dq=64)  # (32 duplicates the score tile)
    if smem < 128 * 1024 and width > 256:
        bs = dataclasses.replace(bs, block_q_dkv=16, block_q_dq=32, block_k_dq=32)
    key_major = _default_key_major(n_branch, shared_keys, d_pad, dv_pad, cc)
    if key_major and width > 256:
        bs = dataclasses.replace(bs, block_q_dkv=16)  # 32 spills
    if itemsize > 2 and width > 256:  # float32 V1 at d=128: 32 queries need 249 KiB on sm_90
        bs = dataclasses.replace(bs, block_q_dkv=16, block_k=min(bs.block_k, 32))
    if smem < 64 * 1024:  # float32 on a 99 KiB GPU: no 64-row tile fits
        narrow = 16 if width > 256 else 32
        bs = dataclasses.replace(
            bs,
            block_q=32,
            block_k=narrow,
            block_q_dkv=16,
            block_k_dkv=32,
            block_q_dq=32,
            block_k_dq=min(bs.block_k_dq, narrow),
        )
    split = _default_split(n_branch, d_pad, dv_pad, cc)
    return dataclasses.replace(
        bs,
        **_default_warps(
            n_branch, d_pad, dv_pad, cc, split, bs.block_q_dq, bs.block_k_dq, key_major
        ),
        split_forward=split,
        dkv_key_major=key_major,
    )


def shared_memory_bytes(
    kernel: str,
    block_q: int,
    block_k: int,
    head_dim: int,
    v_head_dim: int,
    *,
    n_branch: int = 2,
    n_keys: int = 2,
    itemsize: int = 2,
    num_stages: int = 2,
) -> int:
    """Shared memory Triton gives the forward or dQ kernel on sm_90: the streamed key/value
    tiles once per pipeline stage plus the resident query-side tiles. Matches what XLA reports
    for every case of ``benchmarks/compile_kernels.py`` (docs/kernels.md); ``n_keys`` is 1 for
    shared keys or the standard kernel. Head dims are the padded (power-of-two) ones."""
    streamed = num_stages * block_k * (n_keys * head_dim + v_head_dim) * itemsize
    if kernel == "fwd":
        return streamed + block_q * n_branch * head_dim * itemsize
    if kernel == "dq":
        return streamed + block_q * (n_branch * head_dim + v_head_dim) * itemsize
    raise ValueError(f"no shared-memory model for kernel {kernel!r} (have 'fwd' and 'dq')")


def _check_fits(
    bs: BlockSizes,
    d: int,
    dv: int,
    n_branch: int,
    n_keys: int,
    itemsize: int,
    cc: tuple[int, int],
    split_forward: bool = False,
):
    """Refuse given block sizes whose forward or dQ tiles exceed the GPU's shared memory
    (before compiling; sm_90 and newer, where :func:`shared_memory_bytes` is exact). A split
    forward holds one branch per program."""
    limit = SHARED_MEMORY_BYTES.get(tuple(cc))
    if limit is None or cc[0] < 9:
        return
    stages = bs.num_stages or 2
    for kernel, (fq, fk) in (("fwd", ("block_q", "block_k")), ("dq", ("block_q_dq", "block_k_dq"))):
        bq, bk = getattr(bs, fq), getattr(bs, fk)
        one = kernel == "fwd" and split_forward

        def need(k):
            return shared_memory_bytes(
                kernel,
                bq,
                k,
                d,
                dv,
                n_branch=1 if one else n_branch,
                n_keys=1 if one else n_keys,
                itemsize=itemsize,
                num_stages=stages,
            )

        if need(bk) > limit:
            fit = bk
            while fit > _MIN_BLOCK and need(fit) > limit:
                fit //= 2
            hint = f"{fk}={fit}" if need(fit) <= limit else f"a smaller {fq} (or num_stages=1)"
            raise ValueError(
                f"BlockSizes({fq}={bq}, {fk}={bk}) needs {need(bk)} bytes of shared memory in "
                f"the {kernel} kernel at head dims {d}/{dv}, more than this GPU's {limit} "
                f"(compute capability {cc[0]}.{cc[1]}). Fix: use {hint}, or block_sizes=None "
                f"for the defaults of this GPU."
            )


def _default_warps(
    n_branch: int,
    d: int,
    dv: int,
    cc: tuple[int, int],
    split_forward: bool,
    block_q_dq: int,
    block_k_dq: int,
    dkv_key_major: bool,
) -> dict[str, int]:
    """Warps per kernel. On sm_90: 4 (one warpgroup, so a 64-row tile's dots are issued once)
    where the float32 accumulators fit its registers (always, for a split forward's one
    branch, and for dQ streaming 16 keys), else 8 (two warpgroups; Triton then issues the
    64-row score tile in both, see docs/kernels.md). Before sm_90 (mma.sync, no duplication at 8
    warps when a warp's slice of the score tile is whole): 8 for the forward, and for dQ 4 at
    the narrowest widths or on 32-query tiles, else 8 (with 64 keys per step). dK/dV: 4 when
    key-major (its point), else 8. Calibrated on the compile check's registers and spills."""
    if cc[0] < 9:
        small = _dq_cols(n_branch, d, dv) <= 192 or block_q_dq <= 32
        return {"num_warps": 8, "num_warps_dq": 4 if small else 8, "num_warps_dkv": 8}
    one_warpgroup = split_forward or _fused_forward_fits_one_warpgroup(n_branch, d, dv)
    dq_one = _dq_fits_one_warpgroup(n_branch, d, dv) or block_k_dq <= 16
    return {
        "num_warps": 4 if one_warpgroup else 8,
        "num_warps_dq": 4 if dq_one else 8,
        "num_warps_dkv": 4 if dkv_key_major else 8,
    }


def _default_key_major(
    n_branch: int, shared_keys: bool, d: int, dv: int, cc: tuple[int, int]
) -> bool:
    """Key-major dK/dV on one warpgroup (sm_90) where its float32 dK and dV accumulators (64
    key rows) fit: at most 256 columns in all. V1 at d=128, Dv=256 (two dK and a wide dV)
    stays query-major on two warpgroups."""
    n_dk = 1 if n_branch == 1 or shared_keys else 2
    return cc[0] >= 9 and n_dk * d + dv <= 256


def _dq_cols(n_branch: int, d: int, dv: int) -> int:
    return n_branch * d + dv // 2


def _dq_fits_one_warpgroup(n_branch: int, d: int, dv: int) -> bool:
    """Whether one warpgroup holds the dQ kernel's 64x32 tiles without spilling (sm_90)."""
    return _dq_cols(n_branch, d, dv) <= 320 and n_branch * dv <= 256


def _fused_forward_fits_one_warpgroup(n_branch: int, d: int, dv: int) -> bool:
    """Whether one warpgroup holds the fused forward's float32 accumulators (and its score
    tiles) without spilling, by the compile check's registers on sm_90."""
    return n_branch * dv <= 256 and n_branch * d + dv <= 384


def _default_split(n_branch: int, d: int, dv: int, cc: tuple[int, int]) -> bool:
    """Split the DIFF forward into one program per branch on sm_90 where the fused program
    needs two warpgroups (which Triton makes compute the 64-row score tile twice): the split
    issues the one-pass work (docs/kernels.md). Before sm_90 mma.sync does not duplicate."""
    return n_branch == 2 and cc[0] >= 9 and not _fused_forward_fits_one_warpgroup(n_branch, d, dv)


# ---------------------------------------------------------------------------- static config
@dataclasses.dataclass(frozen=True)
class _Config:
    differential: bool
    shared_k: bool
    causal: bool
    segmented: bool
    q_len: int  # unpadded T
    kv_len: int  # unpadded S
    kv_padded: bool  # padded keys exist and must be masked
    scale: float  # the softmax scale (sm_scale of the public functions)
    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int
    num_warps: int  # forward
    num_stages: int
    interpret: bool
    o2_dtype: object = jnp.float32  # the saved second-branch output (a backward residual)
    num_warps_dkv: int = 8
    num_warps_dq: int = 8
    split_forward: bool = False  # DIFF forward as one program per branch (BlockSizes)
    dkv_key_major: bool = False  # dK/dV tiles [keys, queries] (BlockSizes)
    row_max: bool = False  # the forward also writes each branch's running row max (logit_max)

    @property
    def offset(self) -> int:  # query i sees key j iff j <= i + offset (bottom-right aligned)
        return self.kv_len - self.q_len

    def params(self, kernel: str = "fwd"):
        warps = {"fwd": self.num_warps, "dkv": self.num_warps_dkv, "dq": self.num_warps_dq}
        return plgpu.CompilerParams(num_warps=warps[kernel], num_stages=self.num_stages)


def _spec(block_shape, index_map):
    shape = tuple(_SQ if d is None else d for d in block_shape)
    return pl.BlockSpec(block_shape=shape, index_map=index_map)


# ---------------------------------------------------------------------------- kernel helpers
def _mask(cfg: _Config, q_idx, k_idx, q_seg, k_seg, keys_first: bool = False):
    """Boolean [bq, bk] ([bk, bq] when ``keys_first``; True = may attend) or None when nothing
    is masked."""
    mask = None
    q_, k_ = (q_idx[None, :], k_idx[:, None]) if keys_first else (q_idx[:, None], k_idx[None, :])
    shape = (k_idx.shape[0], q_idx.shape[0]) if keys_first else (q_idx.shape[0], k_idx.shape[0])

    def _and(m, x):
        return x if m is None else jnp.logical_and(m, x)

    if cfg.causal:
        mask = _and(mask, k_ <= q_ + cfg.offset)
    if cfg.kv_padded:
        mask = _and(mask, jnp.broadcast_to(k_ < cfg.kv_len, shape))
    if cfg.segmented:
        qs, ks = (
            (q_seg[None, :], k_seg[:, None]) if keys_first else (q_seg[:, None], k_seg[None, :])
        )
        mask = _and(mask, qs == ks)
    return mask


def _ceil_div(x, n: int):
    """ceil(max(x, 0) / n) for a traced int32 scalar."""
    return lax.div(jnp.maximum(x, 0) + (n - 1), jnp.int32(n))


def _kv_block_bound(cfg: _Config, q_block, block_q: int, block_k: int):
    """Number of key blocks a query block must visit: causal programs skip the blocks that lie
    entirely above the (bottom-right aligned) diagonal, every program skips padding blocks."""
    static = pl.cdiv(cfg.kv_len, block_k)
    if not cfg.causal:
        return static
    last_visible = (q_block + 1) * block_q + cfg.offset  # exclusive bound on visible keys
    return jnp.minimum(_ceil_div(last_visible, block_k), static)


def _unmasked_kv_blocks(cfg: _Config, q_block, block_q: int, block_k: int, hi):
    """How many leading key blocks (of the ``hi`` a query block visits) need no mask at all:
    inside the real keys and, when causal, entirely at or below the block's first query row.
    The key loop runs those without building a mask, and masks only the rest (the diagonal
    band and the padding). Packed segments can mask anywhere: then every block is masked."""
    if cfg.segmented:
        return 0
    full = cfg.kv_len // block_k
    if cfg.causal:
        last_full = q_block * block_q + cfg.offset + 1  # keys [0, last_full) seen by every row
        full = jnp.minimum(lax.div(jnp.maximum(last_full, 0), jnp.int32(block_k)), full)
    return jnp.minimum(full, hi)


def _q_block_unmasked_start(cfg: _Config, k_block, block_k: int, block_q: int, lo, hi):
    """The first query block (in ``[lo, hi]``) from which every row sees every key of
    ``k_block`` under the causal mask; the dK/dV loop needs no causal mask from there on.
    Packed segments can mask anywhere: then every block is masked (returns ``hi``)."""
    if cfg.segmented:
        return hi
    if not cfg.causal:
        return lo
    last_key = (k_block + 1) * block_k - 1  # row i sees it iff i >= last_key - offset
    return jnp.clip(_ceil_div(last_key - cfg.offset, block_q), lo, hi)


def _q_block_index(cfg: _Config, i, n_q: int):
    """The query block of grid step ``i`` on a (query block, batch, head) grid: causal grids
    run the blocks in reverse, so the blocks with the most keys start first and the light ones
    fill the tail. Used by the index maps and, through :func:`_q_block_id`, the kernels."""
    return n_q - 1 - i if cfg.causal else i


def _q_block_id(cfg: _Config, block_q: int):
    return _q_block_index(cfg, pl.program_id(0), pl.num_programs(0))


def _q_block_start(cfg: _Config, k_block, block_k: int, block_q: int):
    """First query block that sees any key of ``k_block`` (causal), else 0."""
    if not cfg.causal:
        return 0
    first_q = k_block * block_k - cfg.offset  # query i sees key j iff i >= j - offset
    return lax.div(jnp.maximum(first_q, 0), jnp.int32(block_q))


# ---------------------------------------------------------------------------- forward kernel
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
    *,
    cfg: _Config,
):
    """One query block of one head. Operands a configuration does not use are None: q2, k2,
    lam, lse2, o2 for the standard kernel, k2 for shared keys, the segment ids when unpacked,
    the row maxes (max1, max2: each branch's running max ``m``, base 2, ``MASK_VALUE`` where
    the row saw no key) unless ``cfg.row_max``."""
    bq, bk = cfg.block_q, cfg.block_k
    qi = _q_block_id(cfg, cfg.block_q)
    q_idx = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = None if qseg_ref is None else qseg_ref[...]
    dv = v_ref.shape[-1]
    scale = cfg.scale * LOG2E  # logits in base 2: exp2(x * LOG2E) = exp(x)

    q1 = q1_ref[...]
    q2 = None if q2_ref is None else q2_ref[...]

    def update(s, mask, m, l, acc, v):
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:  # masked keys weigh exactly 0, even in a row that sees none
            p = jnp.where(mask, p, 0.0)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)
        return m_new, l, acc

    def body(kj, carry, masked):
        start = kj * bk
        ks = pl.ds(start, bk)
        k_idx = start + jnp.arange(bk, dtype=jnp.int32)
        mask = (
            _mask(cfg, q_idx, k_idx, q_seg, None if kseg_ref is None else kseg_ref[ks])
            if masked
            else None
        )
        v = v_ref[ks, :]
        k1 = k1_ref[ks, :]
        new = [update(_dot_nt(q1, k1) * scale, mask, *carry[0], v)]
        if q2 is not None:
            k2 = k1 if k2_ref is None else k2_ref[ks, :]
            new.append(update(_dot_nt(q2, k2) * scale, mask, *carry[1], v))
        return tuple(new)

    init = tuple(
        (
            jnp.full((bq,), MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, dv), jnp.float32),
        )
        for _ in range(1 + (q2 is not None))
    )
    hi = _kv_block_bound(cfg, qi, bq, bk)
    lo = _unmasked_kv_blocks(cfg, qi, bq, bk, hi)
    states = lax.fori_loop(0, lo, functools.partial(body, masked=False), init)
    states = lax.fori_loop(lo, hi, functools.partial(body, masked=True), states)

    def finish(m, l, acc):
        seen = l > 0.0  # a row that sees no key: zero output (not NaN, not a uniform mean)
        l_safe = jnp.where(seen, l, 1.0)
        return acc / l_safe[:, None], m + jnp.log2(l_safe)  # lse in base 2

    o1, lse1_ref[...] = finish(*states[0])
    if max1_ref is not None:
        max1_ref[...] = states[0][0]
    if q2 is None:
        o_ref[...] = o1.astype(o_ref.dtype)
        return
    o2, lse2_ref[...] = finish(*states[1])
    if max2_ref is not None:
        max2_ref[...] = states[1][0]
    o_ref[...] = (o1 - lam_ref[...][:, None] * o2).astype(o_ref.dtype)
    o2_ref[...] = o2.astype(o2_ref.dtype)


def _forward(cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg):
    """``(out, lse1, lse2, o2, maxes)``: the output, the residuals (None where the
    configuration has none) and, with ``cfg.row_max``, a tuple of each branch's base-2 running
    row max ``[B, Hq, T]`` (else None)."""
    if cfg.differential and cfg.split_forward:
        return _forward_split(cfg, q1, k1, q2, k2, v, lam, qseg, kseg)
    b, t, hq, d = q1.shape
    s, hkv = k1.shape[1], k1.shape[2]
    dv = v.shape[-1]
    rep = hq // hkv
    bq = cfg.block_q
    n_q = t // bq

    # Grid (query block, batch, head): neighbouring programs share K/V in L2, and with the
    # blocks reversed in _q_block_id the heaviest causal blocks launch first.
    def q_map(i, bi, h):
        return (bi, _q_block_index(cfg, i, n_q), h, 0)

    def kv_map(i, bi, h):
        return (bi, 0, lax.div(h, rep), 0)

    def row_map(i, bi, h):
        return (bi, h, _q_block_index(cfg, i, n_q))

    q_spec = _spec((None, bq, None, d), q_map)
    k_spec = _spec((None, s, None, d), kv_map)
    row_spec = _spec((None, None, bq), row_map)
    diff = cfg.differential
    seg = cfg.segmented

    def opt(cond, x):
        return x if cond else None

    in_specs = [
        q_spec,
        k_spec,
        opt(diff, q_spec),
        opt(k2 is not None, k_spec),
        _spec((None, s, None, dv), kv_map),
        opt(diff, row_spec),
        opt(seg, _spec((None, bq), lambda i, bi, h: (bi, _q_block_index(cfg, i, n_q)))),
        opt(seg, _spec((None, s), lambda i, bi, h: (bi, 0))),
    ]
    out_spec = _spec((None, bq, None, dv), q_map)
    rows = jax.ShapeDtypeStruct((b, hq, t), jnp.float32)
    rm = cfg.row_max
    out_shape = [
        jax.ShapeDtypeStruct((b, t, hq, dv), q1.dtype),
        rows,
        opt(diff, rows),
        opt(diff, jax.ShapeDtypeStruct((b, t, hq, dv), cfg.o2_dtype)),
        opt(rm, rows),
        opt(rm and diff, rows),
    ]
    out_specs = [
        out_spec,
        row_spec,
        opt(diff, row_spec),
        opt(diff, out_spec),
        opt(rm, row_spec),
        opt(rm and diff, row_spec),
    ]
    out, lse1, lse2, o2, max1, max2 = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(n_q, b, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=cfg.params(),
        interpret=cfg.interpret,
        name="diff_flash_fwd" if diff else "flash_fwd",
    )(q1, k1, q2, k2, v, lam, qseg, kseg)
    maxes = None if not rm else (max1,) if max2 is None else (max1, max2)
    return out, lse1, lse2, o2, maxes


def _forward_split(cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg):
    """The DIFF forward as one program per branch (:func:`_branch_outputs`); ``O1 - lam * O2``
    follows in XLA. Same results and residuals (and row maxes) as the fused kernel; every dot
    is issued once per program."""
    (o1, lse1, *max1), (o2, lse2, *max2) = _branch_outputs(cfg, q1, k1, q2, k2, v, qseg, kseg)
    out = o1 - jnp.transpose(lam, (0, 2, 1))[..., None] * o2
    maxes = (*max1, *max2) if cfg.row_max else None
    return out.astype(q1.dtype), lse1, lse2, o2.astype(cfg.o2_dtype), maxes


def _branch_outputs(cfg: _Config, q1, k1, q2, k2, v, qseg, kseg):
    """Each branch's normalised float32 output ``[B, T, Hq, Dv]`` and base-2 log-sum-exp
    ``[B, Hq, T]``, from the single-branch kernel over the branches stacked as heads (DIFF:
    program ``z`` of a (query block, batch, 2*Hq) grid is branch ``z % 2`` of head ``z // 2``,
    so the two branches of a head run side by side and share its V in L2; standard: one
    branch, ``q2`` None). A list of ``(o, lse)``, one per branch; with ``cfg.row_max``
    ``(o, lse, m)``, ``m`` the branch's base-2 running row max ``[B, Hq, T]``."""
    b, t, hq, d = q1.shape
    s, hkv = k1.shape[1], k1.shape[2]
    dv = v.shape[-1]
    rep = hq // hkv
    bq = cfg.block_q
    n_q = t // bq
    nb = 1 if q2 is None else 2
    if q2 is None:
        q12, k12, k_head = q1, k1, lambda z: lax.div(z, rep)  # noqa: E731
    else:
        q12 = jnp.stack([q1, q2], axis=3).reshape(b, t, 2 * hq, d)  # head z = 2 h + branch
        if k2 is None:  # shared keys: both branches of head h read kv head h // rep
            k12, k_head = k1, lambda z: lax.div(lax.div(z, 2), rep)  # noqa: E731
        else:
            k12 = jnp.stack([k1, k2], axis=3).reshape(b, s, 2 * hkv, d)
            k_head = lambda z: 2 * lax.div(lax.div(z, 2), rep) + lax.rem(z, 2)  # noqa: E731

    def q_map(i, bi, z):
        return (bi, _q_block_index(cfg, i, n_q), z, 0)

    def row_map(i, bi, z):
        return (bi, z, _q_block_index(cfg, i, n_q))

    seg = cfg.segmented
    in_specs = [
        _spec((None, bq, None, d), q_map),
        _spec((None, s, None, d), lambda i, bi, z: (bi, 0, k_head(z), 0)),
        None,
        None,
        _spec((None, s, None, dv), lambda i, bi, z: (bi, 0, lax.div(lax.div(z, nb), rep), 0)),
        None,
        _spec((None, bq), lambda i, bi, z: (bi, _q_block_index(cfg, i, n_q))) if seg else None,
        _spec((None, s), lambda i, bi, z: (bi, 0)) if seg else None,
    ]
    rows = jax.ShapeDtypeStruct((b, nb * hq, t), jnp.float32)
    rm = cfg.row_max
    o12, lse12, _, _, max12, _ = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(n_q, b, nb * hq),
        in_specs=in_specs,
        out_specs=[
            _spec((None, bq, None, dv), q_map),
            _spec((None, None, bq), row_map),
            None,
            None,
            _spec((None, None, bq), row_map) if rm else None,
            None,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, nb * hq, dv), jnp.float32),
            rows,
            None,
            None,
            rows if rm else None,
            None,
        ],
        compiler_params=cfg.params(),
        interpret=cfg.interpret,
        name="diff_flash_fwd_split" if nb == 2 else "flash_fwd_f32",
    )(q12, k12, None, None, v, None, qseg, kseg)
    o12 = o12.reshape(b, t, hq, nb, dv)
    stats = [x.reshape(b, hq, nb, t) for x in (lse12, max12) if x is not None]
    return [(o12[:, :, :, i], *(x[:, :, i] for x in stats)) for i in range(nb)]


# ---------------------------------------------------------------------------- backward kernels
def _probs(cfg, q, k, lse, mask):
    """P = exp(q k^T s - lse) (in base 2, as the forward), exactly 0 on masked entries (and on
    rows that see no key)."""
    p = jnp.exp2(_dot_nt(q, k) * (cfg.scale * LOG2E) - lse[:, None])
    return p if mask is None else jnp.where(mask, p, 0.0)


def _probs_t(cfg, k, q, lse, mask):
    """P^T = exp(k q^T s - lse) (key-major, for the dK/dV kernel), exactly 0 where masked."""
    p = jnp.exp2(_dot_nt(k, q) * (cfg.scale * LOG2E) - lse[None, :])
    return p if mask is None else jnp.where(mask, p, 0.0)


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
    *,
    cfg: _Config,
    rep: int,
):
    """dK (dK1, dK2, or their sum for shared keys) and dV of one key block of one kv head,
    looping over the query heads of its GQA group and their query blocks. The q/dO/row refs
    hold the whole sequence of the group's ``rep`` heads."""
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    kj = pl.program_id(0)  # heaviest causal blocks (the first keys) first
    k_idx = kj * bk + jnp.arange(bk, dtype=jnp.int32)
    k_seg = None if kseg_ref is None else kseg_ref[...]
    k1 = k1_ref[...]
    k2 = k1 if k2_ref is None else k2_ref[...]
    v = v_ref[...]
    differential = q2_ref is not None

    # Tiles are query-major ([bq, bk]: P, dP, dS) or, with ``dkv_key_major``, key-major
    # ([bk, bq]: their transposes), so that every dot has the owned key block's rows (64) as
    # its M dimension: Hopper's warpgroup MMA needs M >= 64 per warpgroup, which the streamed
    # query block (16 or 32) cannot give, and falls back to mma.sync.
    km = cfg.dkv_key_major
    tile = (bk, bq) if km else (bq, bk)
    # Below the diagonal band only the key padding needs a mask (padded keys' rows are sliced
    # off, but masking keeps them finite).
    pad_mask = (
        jnp.broadcast_to(
            (k_idx < cfg.kv_len)[:, None] if km else (k_idx < cfg.kv_len)[None, :], tile
        )
        if cfg.kv_padded
        else None
    )

    def per_query(x):  # a per-query-row vector, broadcast over the tile's key axis
        return x[None, :] if km else x[:, None]

    def probs(q, k, lse, mask):
        return _probs_t(cfg, k, q, lse, mask) if km else _probs(cfg, q, k, lse, mask)

    def key_grad(ds, x):  # ds^T x: [bk, width]
        return _dot_nn(ds, x) if km else _dot_tn(ds, x)

    def q_body(qi, carry, h, masked):
        dk1, dk2, dv = carry
        start = qi * bq
        qs = pl.ds(start, bq)
        q_idx = start + jnp.arange(bq, dtype=jnp.int32)
        mask = (
            _mask(
                cfg, q_idx, k_idx, None if qseg_ref is None else qseg_ref[qs], k_seg, keys_first=km
            )
            if masked
            else pad_mask
        )
        q1 = q1_ref[qs, h, :]
        do = do_ref[qs, h, :]
        p1 = probs(q1, k1, lse1_ref[h, qs], mask)
        # dO V^T (or its transpose), shared by both branches (dO2 = -lam dO)
        dp = _dot_nt(v, do) if km else _dot_nt(do, v)
        ds1 = p1 * (dp - per_query(delta1_ref[h, qs]))
        dk1 = dk1 + key_grad(ds1.astype(q1.dtype), q1)
        if differential:
            lam = per_query(lam_ref[h, qs])
            q2 = q2_ref[qs, h, :]
            p2 = probs(q2, k2, lse2_ref[h, qs], mask)
            ds2 = -lam * p2 * (dp - per_query(delta2_ref[h, qs]))
            dk2_new = key_grad(ds2.astype(q2.dtype), q2)
            if dk2_ref is not None:
                dk2 = dk2 + dk2_new
            else:  # shared keys: dK = dK1 + dK2 in one accumulator
                dk1 = dk1 + dk2_new
            pc = p1 - lam * p2  # dV = P1^T dO1 + P2^T dO2 = (P1 - lam P2)^T dO
        else:
            pc = p1
        dv = dv + key_grad(pc.astype(do.dtype), do)
        return dk1, dk2, dv

    lo = _q_block_start(cfg, kj, bk, bq)
    hi = pl.cdiv(cfg.q_len, bq)  # query blocks made only of padding have dO = 0: skip them

    mid = _q_block_unmasked_start(cfg, kj, bk, bq, lo, hi)

    def head_body(h, carry):  # the query heads of this kv head's GQA group
        carry = lax.fori_loop(lo, mid, functools.partial(q_body, h=h, masked=True), carry)
        return lax.fori_loop(mid, hi, functools.partial(q_body, h=h, masked=False), carry)

    d, dvw = k1.shape[-1], v.shape[-1]
    zeros_k = jnp.zeros((bk, d), jnp.float32)
    init = (
        zeros_k,
        zeros_k if dk2_ref is not None else jnp.zeros((), jnp.float32),
        jnp.zeros((bk, dvw), jnp.float32),
    )
    dk1, dk2, dv = lax.fori_loop(0, rep, head_body, init)
    dk1_ref[...] = (dk1 * cfg.scale).astype(dk1_ref.dtype)
    if dk2_ref is not None:
        dk2_ref[...] = (dk2 * cfg.scale).astype(dk2_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


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
    *,
    cfg: _Config,
):
    """dQ1 (and dQ2) of one query block of one head, streaming its kv head's keys."""
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    qi = _q_block_id(cfg, bq)
    q_idx = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = None if qseg_ref is None else qseg_ref[...]
    q1, do = q1_ref[...], do_ref[...]
    lse1, delta1 = lse1_ref[...], delta1_ref[...]
    differential = q2_ref is not None
    if differential:
        q2, lse2, delta2 = q2_ref[...], lse2_ref[...], delta2_ref[...]
        lam = lam_ref[...][:, None]

    def body(kj, carry, masked):
        dq1, dq2 = carry
        start = kj * bk
        ks = pl.ds(start, bk)
        k_idx = start + jnp.arange(bk, dtype=jnp.int32)
        mask = (
            _mask(cfg, q_idx, k_idx, q_seg, None if kseg_ref is None else kseg_ref[ks])
            if masked
            else None
        )
        k1 = k1_ref[ks, :]
        v = v_ref[ks, :]
        p1 = _probs(cfg, q1, k1, lse1, mask)
        dp = _dot_nt(do, v)
        ds1 = p1 * (dp - delta1[:, None])
        dq1 = dq1 + _dot_nn(ds1.astype(k1.dtype), k1)
        if differential:
            k2 = k1 if k2_ref is None else k2_ref[ks, :]
            p2 = _probs(cfg, q2, k2, lse2, mask)
            ds2 = -lam * p2 * (dp - delta2[:, None])
            dq2 = dq2 + _dot_nn(ds2.astype(k2.dtype), k2)
        return dq1, dq2

    d = q1.shape[-1]
    init = (
        jnp.zeros((bq, d), jnp.float32),
        jnp.zeros((bq, d) if differential else (), jnp.float32),
    )
    hi = _kv_block_bound(cfg, qi, bq, bk)
    lo = _unmasked_kv_blocks(cfg, qi, bq, bk, hi)
    carry = lax.fori_loop(0, lo, functools.partial(body, masked=False), init)
    dq1, dq2 = lax.fori_loop(lo, hi, functools.partial(body, masked=True), carry)
    dq1_ref[...] = (dq1 * cfg.scale).astype(dq1_ref.dtype)
    if differential:
        dq2_ref[...] = (dq2 * cfg.scale).astype(dq2_ref.dtype)


def _backward_kernels(
    cfg: _Config, q1, k1, q2, k2, v, lam, qseg, kseg, do, lse1, delta1, lse2, delta2
):
    b, t, hq, d = q1.shape
    s, hkv = k1.shape[1], k1.shape[2]
    dvw = v.shape[-1]
    rep = hq // hkv
    diff, seg, sep_k2 = cfg.differential, cfg.segmented, k2 is not None
    operands = (q1, k1, q2, k2, v, lam, qseg, kseg, do, lse1, delta1, lse2, delta2)

    def opt(cond, x):
        return x if cond else None

    def in_specs(q_spec, k_spec, v_spec, do_spec, row_spec, qseg_spec, kseg_spec):
        """In the kernels' operand order; None where the configuration has no such operand."""
        return [
            q_spec,
            k_spec,
            opt(diff, q_spec),
            opt(sep_k2, k_spec),
            v_spec,
            opt(diff, row_spec),
            opt(seg, qseg_spec),
            opt(seg, kseg_spec),
            do_spec,
            row_spec,
            row_spec,
            opt(diff, row_spec),
            opt(diff, row_spec),
        ]

    # dK, dV: grid (key block, batch, kv head); the program loops over its group's q heads.
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    group = lambda j, bi, g: (bi, 0, g, 0)  # noqa: E731  (the rep heads g*rep .. g*rep+rep-1)
    kblk = lambda j, bi, g: (bi, j, g, 0)  # noqa: E731
    specs = in_specs(
        _spec((None, t, rep, d), group),
        _spec((None, bk, None, d), kblk),
        _spec((None, bk, None, dvw), kblk),
        _spec((None, t, rep, dvw), group),
        _spec((None, rep, t), lambda j, bi, g: (bi, g, 0)),
        _spec((None, t), lambda j, bi, g: (bi, 0)),
        _spec((None, bk), lambda j, bi, g: (bi, j)),
    )
    k_out = _spec((None, bk, None, d), kblk)
    dk1, dk2, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, rep=rep),
        grid=(s // bk, b, hkv),
        in_specs=specs,
        out_specs=[k_out, opt(sep_k2, k_out), _spec((None, bk, None, dvw), kblk)],
        out_shape=[
            jax.ShapeDtypeStruct(k1.shape, k1.dtype),
            opt(sep_k2, jax.ShapeDtypeStruct(k1.shape, k1.dtype)),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=cfg.params("dkv"),
        interpret=cfg.interpret,
        name="diff_flash_bwd_dkv" if diff else "flash_bwd_dkv",
    )(*operands)

    # dQ: grid (query block, batch, q head), streaming the key blocks like the forward pass.
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    n_q = t // bq
    qb = lambda i: _q_block_index(cfg, i, n_q)  # noqa: E731
    qblk = lambda i, bi, h: (bi, qb(i), h, 0)  # noqa: E731
    kvh = lambda i, bi, h: (bi, 0, lax.div(h, rep), 0)  # noqa: E731
    specs = in_specs(
        _spec((None, bq, None, d), qblk),
        _spec((None, s, None, d), kvh),
        _spec((None, s, None, dvw), kvh),
        _spec((None, bq, None, dvw), qblk),
        _spec((None, None, bq), lambda i, bi, h: (bi, h, qb(i))),
        _spec((None, bq), lambda i, bi, h: (bi, qb(i))),
        _spec((None, s), lambda i, bi, h: (bi, 0)),
    )
    q_out = _spec((None, bq, None, d), qblk)
    dq1, dq2 = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(t // bq, b, hq),
        in_specs=specs,
        out_specs=[q_out, opt(diff, q_out)],
        out_shape=[
            jax.ShapeDtypeStruct(q1.shape, q1.dtype),
            opt(diff, jax.ShapeDtypeStruct(q1.shape, q1.dtype)),
        ],
        compiler_params=cfg.params("dq"),
        interpret=cfg.interpret,
        name="diff_flash_bwd_dq" if diff else "flash_bwd_dq",
    )(*operands)
    return dq1, dk1, dq2, dk2, dv


# ---------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q1, k1, q2, k2, v, lam, qseg, kseg):
    """Padded inputs. ``k2`` is None for shared keys; ``q2``/``k2``/``lam`` None when standard.
    ``lam`` is float32 ``[B, Hq, T]``. The output; with ``cfg.row_max`` ``(out, maxes)``, the
    branches' base-2 row maxes (no gradient: the backward ignores their cotangent)."""
    out, _, _, _, maxes = _forward(cfg, q1, k1, q2, k2, v, lam, qseg, kseg)
    return (out, maxes) if cfg.row_max else out


def _attention_fwd(cfg, q1, k1, q2, k2, v, lam, qseg, kseg):
    out, lse1, lse2, o2, maxes = _forward(cfg, q1, k1, q2, k2, v, lam, qseg, kseg)
    primal = (out, maxes) if cfg.row_max else out
    return primal, (q1, k1, q2, k2, v, lam, qseg, kseg, out, lse1, lse2, o2)


def _attention_bwd(cfg, res, g):
    q1, k1, q2, k2, v, lam, qseg, kseg, out, lse1, lse2, o2 = res
    if cfg.row_max:
        g = g[0]  # the row maxes carry no gradient
    g32 = g.astype(jnp.float32)
    out32 = out.astype(jnp.float32)
    to_rows = lambda x: jnp.transpose(x, (0, 2, 1))  # noqa: E731  [B,T,H] -> [B,H,T]
    if cfg.differential:
        lam_bth = jnp.transpose(lam, (0, 2, 1))[..., None]
        o1 = out32 + lam_bth * o2  # the first branch's output, rebuilt in float32
        delta1 = to_rows(jnp.sum(g32 * o1, axis=-1))
        delta2 = to_rows(jnp.sum(g32 * o2, axis=-1))  # rowsum(dO * O2)
        dlam = -delta2
    else:
        delta1 = to_rows(jnp.sum(g32 * out32, axis=-1))
        delta2 = dlam = None
    do = g.astype(q1.dtype)
    dq1, dk1, dq2, dk2, dv = _backward_kernels(
        cfg, q1, k1, q2, k2, v, lam, qseg, kseg, do, lse1, delta1, lse2, delta2
    )
    return dq1, dk1, dq2, dk2, dv, dlam, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------- wrappers
def _pad_axis(x, axis: int, size: int, value=0):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _prepare(call: Call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids):
    """The kernels' configuration and padded operands ``(q1, k1, q2, k2, v, lam_rows, qseg,
    kseg)`` (``k2`` None for shared keys; ``lam_rows`` float32 ``[B, Hq, T]`` or None), and
    the padded ``(T, Dv)``, for a checked call (:class:`~._frontend.Call`)."""
    differential, shared_k = call.differential, call.shared_k
    b, t, hq, d = q1.shape
    s = k1.shape[1]
    dv = v.shape[-1]
    cc = call.compute_capability or device_capability()
    bs = call.block_sizes
    if bs is None:
        bs = default_block_sizes(
            d,
            dv,
            differential=differential,
            shared_keys=shared_k,
            compute_capability=cc,
            itemsize=jnp.dtype(q1.dtype).itemsize,
        )
    n_branch = 2 if differential else 1
    d_pad, dv_pad = max(_MIN_BLOCK, _next_pow2(d)), max(_MIN_BLOCK, _next_pow2(dv))
    split = differential and (
        bs.split_forward
        if bs.split_forward is not None
        else _default_split(n_branch, d_pad, dv_pad, cc)
    )
    key_major = (
        bs.dkv_key_major
        if bs.dkv_key_major is not None
        else _default_key_major(n_branch, shared_k, d_pad, dv_pad, cc)
    )
    on_gpu = call.compute_capability is not None or jax.default_backend() == "gpu"
    if call.block_sizes is not None and not call.interpret and on_gpu:
        n_keys = 2 if differential and k2 is not None else 1
        _check_fits(bs, d_pad, dv_pad, n_branch, n_keys, jnp.dtype(q1.dtype).itemsize, cc, split)

    # Effective blocks: clamped to the sequence (rounded to a power of two >= 16).
    t_cap, s_cap = max(_MIN_BLOCK, _next_pow2(t)), max(_MIN_BLOCK, _next_pow2(s))
    bq, bk = min(bs.block_q, t_cap), min(bs.block_k, s_cap)
    bq_dkv, bk_dkv = min(bs.block_q_dkv, t_cap), min(bs.block_k_dkv, s_cap)
    bq_dq, bk_dq = min(bs.block_q_dq, t_cap), min(bs.block_k_dq, s_cap)
    t_pad = _round_up(t, max(bq, bq_dkv, bq_dq))  # powers of two: the max is the lcm
    s_pad = _round_up(s, max(bk, bk_dkv, bk_dq))

    warps = _default_warps(
        n_branch, d_pad, dv_pad, cc, split, bs.block_q_dq, bs.block_k_dq, key_major
    )
    for f in warps:  # given warps win; num_warps also sets the backward's unless they are given
        warps[f] = getattr(bs, f) or bs.num_warps or warps[f]
    # Triton dots need matching operand types: compute in the inputs' common type (a no-op for
    # the usual single-dtype call); the output keeps q1's dtype, as in the reference.
    common = jnp.result_type(*(x for x in (q1, k1, q2, k2, v) if x is not None))
    q1, k1, v = (x.astype(common) for x in (q1, k1, v))
    if differential:
        q2 = q2.astype(common)
        k2 = k1 if shared_k else k2.astype(common)
    segmented = segment_ids is not None
    cfg = _Config(
        differential=differential,
        shared_k=shared_k,
        causal=call.causal,
        segmented=segmented,
        q_len=t,
        kv_len=s,
        kv_padded=s_pad != s,
        scale=call.scale,
        block_q=bq,
        block_k=bk,
        block_q_dkv=bq_dkv,
        block_k_dkv=bk_dkv,
        block_q_dq=bq_dq,
        block_k_dq=bk_dq,
        num_stages=bs.num_stages or 2,
        interpret=bool(call.interpret),
        o2_dtype=call.o2_dtype,
        num_warps=warps["num_warps"],
        num_warps_dkv=warps["num_warps_dkv"],
        num_warps_dq=warps["num_warps_dq"],
        split_forward=split,
        dkv_key_major=key_major,
        row_max=call.logit_max,
    )

    def pad_q(x):
        return None if x is None else _pad_axis(_pad_axis(x, 3, d_pad), 1, t_pad)

    def pad_k(x):
        return None if x is None else _pad_axis(_pad_axis(x, 3, d_pad), 1, s_pad)

    q1p, q2p, k1p = pad_q(q1), pad_q(q2), pad_k(k1)
    k2p = None if (shared_k or not differential) else pad_k(k2)
    vp = _pad_axis(_pad_axis(v, 3, dv_pad), 1, s_pad)
    lam_rows = None
    if differential:  # the kernels read lambda per query row
        lam_rows = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (b, t, hq))
        lam_rows = _pad_axis(jnp.transpose(lam_rows, (0, 2, 1)), 2, t_pad)
    qseg = kseg = None
    if segmented:
        qseg = jnp.asarray(segment_ids, jnp.int32)
        kseg = qseg if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
        qseg, kseg = _pad_axis(qseg, 1, t_pad), _pad_axis(kseg, 1, s_pad)

    return cfg, (q1p, k1p, q2p, k2p, vp, lam_rows, qseg, kseg), (t_pad, dv_pad)


def _run(call: Call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids):
    """The differentiable attention of a checked call, ``[B, T, Hq, Dv]`` in q1's dtype; with
    ``call.logit_max`` ``(out, maxes)``, ``maxes`` float32 ``[n_maps, B, T, Hq]``."""
    b, t, hq, _ = q1.shape
    dv, out_dtype = v.shape[-1], q1.dtype
    cfg, operands, _ = _prepare(call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids)
    out = _attention(cfg, *operands)
    if cfg.row_max:
        out, maxes = out
    if out.shape != (b, t, hq, dv):
        out = out[:, :t, :, :dv]
    out = out.astype(out_dtype)
    if not cfg.row_max:
        return out
    return out, jnp.stack([_natural_lse(m[..., :t]) for m in maxes])


# ---------------------------------------------------------------------------- partials
def _natural_lse(lse2):
    """Base-2 row statistics ``[B, H, T]`` (log-sum-exps, running maxes) -> natural scale
    ``[B, T, H]``, -inf where the row saw no key (the kernel's running max never left
    MASK_VALUE)."""
    lse = jnp.transpose(lse2, (0, 2, 1))
    return jnp.where(lse <= 0.5 * MASK_VALUE, -jnp.inf, lse * (1.0 / LOG2E))


def _partials(call: Call, q1, k1, q2, k2, v, segment_ids, kv_segment_ids):
    """:meth:`~._frontend.Frontend.flash_partials` of a checked call."""
    t, dv = q1.shape[1], v.shape[-1]
    lam = 0.0 if call.differential else None
    cfg, (q1p, k1p, q2p, k2p, vp, _, qseg, kseg), _ = _prepare(
        call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids
    )
    outs = _branch_outputs(cfg, q1p, k1p, q2p, k2p, vp, qseg, kseg)
    return tuple(
        (o[:, :t, :, :dv], *(_natural_lse(x[..., :t]) for x in stats)) for o, *stats in outs
    )


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
    differential = call.differential
    b, t, hq, d = q1.shape
    s, dvw = k1.shape[1], v.shape[-1]
    cfg, (q1p, k1p, q2p, k2p, vp, lam_rows, qseg, kseg), (t_pad, dv_pad) = _prepare(
        call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids
    )

    def rows(x):  # [B, T, H] -> float32 [B, H, T_pad] (padded rows: 0)
        return _pad_axis(jnp.transpose(x.astype(jnp.float32), (0, 2, 1)), 2, t_pad)

    def lse_rows(x):  # natural log -> base 2; a row that sees no key: 0 (its P is masked)
        return rows(jnp.where(jnp.isneginf(x), 0.0, x * LOG2E))

    do = _pad_axis(_pad_axis(dout.astype(q1p.dtype), 3, dv_pad), 1, t_pad)
    dq1, dk1, dq2, dk2, dv = _backward_kernels(
        cfg,
        q1p,
        k1p,
        q2p,
        k2p,
        vp,
        lam_rows,
        qseg,
        kseg,
        do,
        lse_rows(lse1),
        rows(delta1),
        lse_rows(lse2) if differential else None,
        rows(delta2) if differential else None,
    )

    def crop(x, n, w):
        return None if x is None else x[:, :n, :, :w]

    return crop(dq1, t, d), crop(dk1, s, d), crop(dq2, t, d), crop(dk2, s, d), crop(dv, s, dvw)


# ---------------------------------------------------------------------------- public functions
# Written once for both backends (diffjax.kernels._frontend): the input checks, defaults and
# errors, and the signatures and documentation of the public functions.
_FRONTEND = Frontend(
    backend="gpu",
    block_sizes_type=BlockSizes,
    attention=_run,
    partials=_partials,
    partial_grads=_partial_grads,
    takes_compute_capability=True,
)
differential_flash_attention = _FRONTEND.differential_flash_attention
flash_attention = _FRONTEND.flash_attention
flash_partials = _FRONTEND.flash_partials
flash_partial_grads = _FRONTEND.flash_partial_grads
