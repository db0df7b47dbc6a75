"""The kernels' one front end: the public functions of :mod:`.gpu` and :mod:`.tpu` and their
input checks, defaults and errors, written once.

Each backend module builds a :class:`Frontend` from three functions of its own (the forward
with its custom VJP, the partials, the partial gradients), its ``BlockSizes`` type and whether
it compiles for a chosen GPU, and exports the frontend's methods as its public functions. So the
same bad input raises the same exception with the same message (``what is wrong. Fix: ...``) on
both backends, before any kernel runs, and a backend receives a checked :class:`Call`: the
softmax scale resolved, the block sizes of its own type (or None for its defaults), the O2
residual's dtype. What stays in a backend is what differs: its layout and padding, its block
sizes and their hardware limits (the GPU's shared memory, the TPU's lanes and VMEM), and how
its kernels take lambda (the GPU kernel as float32 rows, the TPU kernel as a scalar in SMEM or
rows).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .reference import check_differential, check_qkv

# The dtypes the saved second-branch output (a backward residual, B*T*Hq*Dv elements per layer)
# may take: float32, or bfloat16 to halve it (docs/kernels.md gives the cost in d(lam)).
O2_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


# ---------------------------------------------------------------------------- checks
def check_lengths(what: str, q, k) -> None:
    """Refuse an empty query or key sequence (the kernels' grids need at least one block)."""
    t, s = q.shape[1], k.shape[1]
    if t < 1 or s < 1:
        raise ValueError(
            f"{what}: empty sequence (q length {t}, kv length {s}). Fix: pass at least one "
            "query and one key (skip the call for an empty batch)"
        )


def static_scale(what: str, sm_scale, head_dim: int) -> float:
    """``sm_scale`` as a python float (default ``head_dim ** -0.5``): it is compiled into the
    kernels, so a traced value or a non-number is a TypeError."""
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    try:
        return float(sm_scale)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(
            f"{what}: sm_scale must be a static python number (it is compiled into the "
            f"kernels), got {_describe(sm_scale)}. Fix: pass a float such as "
            f"{head_dim**-0.5:.6g} (None: head_dim ** -0.5), not an array or a traced value"
        ) from e


def check_block_sizes(what: str, block_sizes, sizes_type: type, backend: str):
    """``block_sizes`` if it is ``sizes_type`` (the backend's ``BlockSizes``) or None, else a
    TypeError naming the type that was expected."""
    if block_sizes is None or isinstance(block_sizes, sizes_type):
        return block_sizes
    expected = f"diffjax.kernels.{backend}.BlockSizes"
    raise TypeError(
        f"{what}: block_sizes must be a {expected} or None, got {_describe(block_sizes)} (each "
        f"kernel backend has its own tiles). Fix: pass {backend}.BlockSizes(...), or "
        "block_sizes=None for the defaults"
    )


def check_o2_dtype(what: str, o2_dtype) -> np.dtype:
    """``o2_dtype`` as a numpy dtype (``jnp.dtype``'s reading), float32 or bfloat16, else a
    ValueError."""
    try:
        dtype = jnp.dtype(o2_dtype)
    except TypeError:
        dtype = None
    if dtype not in O2_DTYPES:
        got = repr(o2_dtype) if dtype is None else dtype.name
        raise ValueError(
            f"{what}: o2_dtype (the dtype of the saved second-branch output, a backward "
            f"residual) must be float32 or bfloat16, got {got}. Fix: "
            "o2_dtype=jnp.float32 (the default), or jnp.bfloat16 to halve the residual"
        )
    return dtype


def static_flag(what: str, name: str, value) -> bool:
    """``value`` of the option ``name`` as a python bool: it changes the kernels' outputs, so
    it must be static (True or False), else a TypeError naming the fix."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(
        f"{what}: {name} must be True or False (a static python bool: it adds outputs to the "
        f"kernels), got {_describe(value)}. Fix: pass {name}=True or {name}=False"
    )


def check_compute_capability(what: str, compute_capability, takes_it: bool, backend: str):
    """The target GPU as a ``(major, minor)`` tuple (None: this process's GPU); a ValueError
    when a backend that compiles for no GPU is given one."""
    if compute_capability is None:
        return None
    if not takes_it:
        raise ValueError(
            f"{what}: compute_capability={compute_capability!r} names a GPU, and these are the "
            f"{backend.upper()} kernels. Fix: leave compute_capability None (it picks the GPU "
            "kernels' block sizes), or run the GPU kernels"
        )
    try:
        cc = tuple(operator.index(x) for x in compute_capability)
    except TypeError:
        cc = ()
    if len(cc) != 2:
        raise ValueError(
            f"{what}: compute_capability must be a (major, minor) pair of ints, got "
            f"{compute_capability!r}. Fix: e.g. (9, 0) for H100, or None for this GPU"
        )
    return cc


def check_partial_stats(
    what: str, q1, v, differential: bool, dout, lse1, delta1, lse2, delta2
) -> None:
    """The statistics :meth:`Frontend.flash_partial_grads` takes, against the queries' shape:
    ``dout`` ``[B, T, Hq, Dv]``, the log-sum-exps and deltas ``[B, T, Hq]`` (the second
    map's exactly when there is one)."""
    b, t, hq, _ = q1.shape
    want = (b, t, hq, v.shape[-1])
    if jnp.shape(dout) != want:
        raise ValueError(
            f"{what}: dout must be [batch, seq, heads, v_dim] = {list(want)}, got shape "
            f"{jnp.shape(dout)}. Fix: pass the cotangent of the attention's output"
        )
    stats = {"lse1": lse1, "delta1": delta1}
    second = {"lse2": lse2, "delta2": delta2}
    if differential:
        stats.update(second)
    for name, x in second.items():
        if not differential and x is not None:
            raise ValueError(
                f"{what}: {name} given for standard attention (q2 is None). Fix: pass "
                f"{name}=None, or q2 and lam for differential attention"
            )
    for name, x in stats.items():
        if x is None or jnp.shape(x) != (b, t, hq):
            got = "None" if x is None else f"shape {jnp.shape(x)}"
            raise ValueError(
                f"{what}: {name} must be [batch, seq, heads] = [{b}, {t}, {hq}], got {got}. "
                "Fix: pass the whole attention's statistics (log-sum-exps in natural log, "
                "deltas = rowsum(dout * O)), one per query and head"
            )


def _describe(x) -> str:
    """A refused value, for a message: a python scalar's repr, else its (traced) type."""
    if isinstance(x, jax.core.Tracer):
        return f"a traced {type(x).__name__}"
    if isinstance(x, (int, float, str, type(None))):
        return repr(x)
    return type(x).__module__ + "." + type(x).__qualname__


# ---------------------------------------------------------------------------- the call
@dataclasses.dataclass(frozen=True)
class Call:
    """One checked call of a public kernel function: the static choices a backend builds its
    configuration from (the arrays travel beside it, unchanged but for lambda, as float32)."""

    what: str  # the public function's name, for messages
    differential: bool  # two softmax maps (q2 given)
    shared_k: bool  # DIFF with k2 None: both maps read k1
    causal: bool
    scale: float  # the softmax scale: sm_scale, or Dqk ** -0.5
    block_sizes: Any  # the backend's BlockSizes, or None for its defaults
    interpret: Any  # as given (the TPU kernels take a pltpu.InterpretParams)
    o2_dtype: np.dtype  # the saved second-branch output (a backward residual)
    compute_capability: tuple[int, int] | None  # the target GPU (None: this one; TPU: None)
    logit_max: bool = False  # also return each map's largest logit per row (diagnostics)


@dataclasses.dataclass(frozen=True)
class Frontend:
    """The public functions of one kernel backend, from its functions on checked calls.

    ``attention(call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids)``: the
    differentiable output ``[B, T, Hq, Dv]`` in q1's dtype (``q2``, ``k2``, ``lam`` None for
    standard attention); with ``call.logit_max``, ``(out, maxes)``: ``maxes`` float32
    ``[n_maps, B, T, Hq]``, each map's running row max in natural-scale logits (-inf for a row
    that sees no key), whose cotangent the backward ignores. ``partials(call, q1, k1, q2, k2,
    v, segment_ids, kv_segment_ids)`` and ``partial_grads(call, q1, k1, q2, k2, v, lam, dout,
    lse1, delta1, lse2, delta2, segment_ids, kv_segment_ids)``: the ring's interface
    (:meth:`flash_partials`, :meth:`flash_partial_grads`; with ``call.logit_max`` each map's
    partial is ``(o, lse, row_max)``). ``lam`` reaches them as a float32 array.
    """

    backend: str  # "gpu" or "tpu", for messages
    block_sizes_type: type
    attention: Callable
    partials: Callable
    partial_grads: Callable
    takes_compute_capability: bool = False

    def check(
        self,
        what,
        q1,
        k1,
        q2,
        k2,
        v,
        lam,
        segment_ids,
        kv_segment_ids,
        *,
        causal,
        sm_scale,
        block_sizes,
        interpret,
        compute_capability,
        o2_dtype=jnp.float32,
        logit_max=False,
        logit_max_option="return_logit_max",
    ) -> Call:
        """Every check of a call (shapes, lambda, segment ids, lengths, then the options), in
        one order for every backend; the :class:`Call` the backend's functions take.
        ``q2`` None: standard attention (``k2`` and ``lam`` unused). ``logit_max``: the value
        of the public option named ``logit_max_option`` (a static bool)."""
        differential = q2 is not None
        if differential:
            check_differential(q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids, what=what)
        else:
            check_qkv(q1, k1, v, segment_ids, kv_segment_ids, what=what)
        check_lengths(what, q1, k1)
        return Call(
            what=what,
            differential=differential,
            shared_k=differential and k2 is None,
            causal=bool(causal),
            scale=static_scale(what, sm_scale, q1.shape[-1]),
            block_sizes=check_block_sizes(what, block_sizes, self.block_sizes_type, self.backend),
            interpret=interpret,
            o2_dtype=check_o2_dtype(what, o2_dtype),
            compute_capability=check_compute_capability(
                what, compute_capability, self.takes_compute_capability, self.backend
            ),
            logit_max=static_flag(what, logit_max_option, logit_max),
        )

    def differential_flash_attention(
        self,
        q1,
        k1,
        q2,
        k2,
        v,
        lam,
        *,
        causal=True,
        segment_ids=None,
        kv_segment_ids=None,
        sm_scale=None,
        block_sizes=None,
        interpret=False,
        compute_capability=None,
        o2_dtype=jnp.float32,
        return_logit_max=False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Fused ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``, ``[B, T, Hq, Dv]`` in
        q1's dtype.

        q1, q2 ``[B, T, Hq, D]``; k1, k2 ``[B, S, Hkv, D]``; v ``[B, S, Hkv, Dv]``; ``lam`` a
        scalar (V1) or ``[B, T, Hq]`` (V2); query head ``h`` reads kv head ``h // (Hq //
        Hkv)``. ``k2=None`` (both maps read ``k1``, DIFF V2) selects the shared-key kernels
        (each key block loaded once). Causal masking is bottom-right aligned;
        ``segment_ids`` ``[B, T]`` separate packed sequences (keys use ``kv_segment_ids``
        ``[B, S]`` when given). ``sm_scale`` (a python number) defaults to ``D ** -0.5``.
        Differentiable in q1, k1, q2, k2 (when given), v and lam. ``block_sizes``: this
        backend's ``BlockSizes`` (None: its defaults). ``interpret``: True (on the TPU also a
        ``pltpu.InterpretParams``) runs the kernels interpreted, e.g. on CPU.
        ``compute_capability``: the GPU the GPU kernels compile for (default: this one; the TPU
        kernels take None). ``o2_dtype``: the dtype of the saved second-branch output (a
        backward residual, ``B*T*Hq*Dv`` elements per layer), float32 or bfloat16 (half of it,
        at the cost in d(lam) stated in docs/kernels.md); the output does not depend on it.

        ``return_logit_max`` (a static bool, default False): also return each map's largest
        logit per query row, ``(out, maxes)`` with ``maxes`` float32 ``[2, B, T, Hq]`` (map 1:
        q1 k1, map 2: q2 k2, or q2 k1 with shared keys): the forward kernel's running row max
        of ``(q k^T) * sm_scale`` over the keys the row sees, in natural scale, written as one
        more output per branch; -inf for a row that sees no key. It carries no gradient (the
        backward ignores its cotangent); ``out`` and the gradients are those of the call
        without it. False: the kernels are exactly those of a call without the option.
        """
        if q2 is None:
            raise ValueError(
                "differential_flash_attention: q2 is None. Fix: pass the second map's queries, "
                "or call flash_attention for one softmax map"
            )
        call = self.check(
            "differential_flash_attention",
            q1,
            k1,
            q2,
            k2,
            v,
            lam,
            segment_ids,
            kv_segment_ids,
            causal=causal,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
            compute_capability=compute_capability,
            o2_dtype=o2_dtype,
            logit_max=return_logit_max,
        )
        lam = jnp.asarray(lam, jnp.float32)
        return self.attention(call, q1, k1, q2, k2, v, lam, segment_ids, kv_segment_ids)

    def flash_attention(
        self,
        q,
        k,
        v,
        *,
        causal=True,
        segment_ids=None,
        kv_segment_ids=None,
        sm_scale=None,
        block_sizes=None,
        interpret=False,
        compute_capability=None,
        return_logit_max=False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Standard fused softmax attention ``softmax(q k^T s) v`` with the same kernels (one
        branch): q ``[B, T, Hq, D]``, k ``[B, S, Hkv, D]``, v ``[B, S, Hkv, Dv]``; returns
        ``[B, T, Hq, Dv]`` in q's dtype. Options as :meth:`differential_flash_attention`
        (``return_logit_max``: ``(out, maxes)``, ``maxes`` float32 ``[1, B, T, Hq]``)."""
        call = self.check(
            "flash_attention",
            q,
            k,
            None,
            None,
            v,
            None,
            segment_ids,
            kv_segment_ids,
            causal=causal,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
            compute_capability=compute_capability,
            logit_max=return_logit_max,
        )
        return self.attention(call, q, k, None, None, v, None, segment_ids, kv_segment_ids)

    # Ring (sequence-parallel) attention computes each device's queries against one key block
    # at a time and merges the blocks' results by log-sum-exp; its backward needs each block's
    # share of the gradient from the merged statistics. These two methods are that interface.
    def flash_partials(
        self,
        q1,
        k1,
        q2,
        k2,
        v,
        *,
        causal=True,
        segment_ids=None,
        kv_segment_ids=None,
        sm_scale=None,
        block_sizes=None,
        interpret=False,
        compute_capability=None,
        return_row_max=False,
    ):
        """Each softmax map of ``q`` against this key block, normalised over its visible keys,
        and its log-sum-exp: ``((o1, lse1), (o2, lse2))`` for DIFF, ``((o, lse),)`` for
        standard attention (``q2`` None; ``k2`` None with ``q2``: both maps read ``k1``). ``o``
        ``[B, T, Hq, Dv]`` and ``lse`` ``[B, T, Hq]`` (natural log) float32; a row that sees no
        key gets ``o = 0``, ``lse = -inf``. Arguments as :meth:`differential_flash_attention`.
        ``return_row_max`` (a static bool): each map's triple ``(o, lse, row_max)`` instead,
        ``row_max`` ``[B, T, Hq]`` float32 the largest logit ``(q k^T) * sm_scale`` of the row
        over this block's visible keys (-inf where none): the kernel's running max, which the
        ring merges over blocks by max. Not differentiable: ring attention's backward calls
        :meth:`flash_partial_grads`."""
        call = self.check(
            "flash_partials",
            q1,
            k1,
            q2,
            k2,
            v,
            0.0 if q2 is not None else None,  # out = O1 - 0 * O2 = O1, exactly
            segment_ids,
            kv_segment_ids,
            causal=causal,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
            compute_capability=compute_capability,
            logit_max=return_row_max,
            logit_max_option="return_row_max",
        )
        return self.partials(call, q1, k1, q2, k2, v, segment_ids, kv_segment_ids)

    def flash_partial_grads(
        self,
        q1,
        k1,
        q2,
        k2,
        v,
        lam,
        dout,
        lse1,
        delta1,
        lse2=None,
        delta2=None,
        *,
        causal=True,
        segment_ids=None,
        kv_segment_ids=None,
        sm_scale=None,
        block_sizes=None,
        interpret=False,
        compute_capability=None,
    ):
        """This key block's share of the gradients of ``out = O1 - lam * O2`` (standard:
        ``O``), where ``O1``, ``O2`` are the maps' outputs over *all* keys: ``lse1``/``lse2``
        ``[B, T, Hq]`` their log-sum-exps over all keys (natural log, -inf for a row that sees
        none), ``delta1 = rowsum(dout * O1)``, ``delta2 = rowsum(dout * O2)``, ``dout`` the
        cotangent of ``out`` ``[B, T, Hq, Dv]``, ``lam`` a scalar or ``[B, T, Hq]`` (None for
        standard). Returns ``(dq1, dk1, dq2, dk2, dv)`` in the inputs' dtypes (``dq2``/``dk2``
        None where there is no such input); summed over the key blocks they are the whole
        attention's gradients (lam's is ``-sum(delta2)``, the caller's)."""
        what = "flash_partial_grads"
        differential = q2 is not None
        if differential and lam is None:
            raise ValueError(
                f"{what}: lam is None with q2 given. Fix: pass the differential attention's "
                "lam (a scalar or [batch, seq, heads]), or q2=None for standard attention"
            )
        call = self.check(
            what,
            q1,
            k1,
            q2,
            k2,
            v,
            lam if differential else None,
            segment_ids,
            kv_segment_ids,
            causal=causal,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
            compute_capability=compute_capability,
        )
        check_partial_stats(what, q1, v, differential, dout, lse1, delta1, lse2, delta2)
        lam = jnp.asarray(lam, jnp.float32) if differential else None
        return self.partial_grads(
            call,
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
        )
