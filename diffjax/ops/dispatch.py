"""The one dispatch point for attention: checks shapes once, then runs an implementation.

Layout everywhere: ``[batch, seq, heads, dim]``.

:func:`attention` computes softmax attention with one map (standard MHA/GQA/MQA) or two
(``second=(q2, k2, lam)``: ``softmax(q k^T s) v - lam * softmax(q2 k2^T s) v``, each branch
normalised by its own softmax denominator; ``k2=None``: both maps read ``k``).
:func:`dot_product_attention` and :func:`differential_attention` name the two cases.

``impl`` picks the implementation:

- ``"xla"``: the plain ``jax.numpy`` math of :mod:`diffjax.kernels.reference`;
- ``"pallas"``: the fused kernels of :mod:`diffjax.kernels` (interpreted on CPU), run per shard
  under ``jax.shard_map`` when a mesh is set with ``jax.set_mesh``;
- ``"cudnn"`` (NVIDIA GPUs): cuDNN's flash attention, DIFF composed of standard calls as the
  official code composes it (:mod:`diffjax.kernels.cudnn`); on a CPU the same composition on
  XLA. ``"splash"`` (TPUs): jax's Splash attention likewise (:mod:`diffjax.kernels.splash`),
  interpreted on a CPU. Both run per shard like the kernels; a decoded token (one query against
  the KV cache) takes the XLA math, and what they cannot run is refused with the reason;
- ``"auto"``: per call, the fastest of the implementations that can run it, from the table a
  benchmark measured (:mod:`diffjax.ops.impl_table`; :func:`choose`); where it measured nothing,
  ``"pallas"`` on GPU and TPU and ``"xla"`` elsewhere;
- any object with the function ``attention(q, k, v, *, second, causal, segment_ids,
  kv_segment_ids, scale)`` (called after the shape checks; a layer keeps it as a static
  attribute, so make it hashable, e.g. a frozen dataclass);
- or a :class:`Resolved`: the setting decided once for a run (:func:`resolve_model`; the run's
  ``Runtime`` holds it, and a layer holds it as its implementation), which runs each call the
  run declared with the implementation it holds for it.

Sequence parallelism is decided before the call, not read from the mesh: a :class:`Resolved`
whose ``context`` is set (a run whose mesh splits the sequence), or a direct call given
``context=``, runs self-attention over the mesh's ``context`` axis (:mod:`diffjax.ops.context`):
a ring that passes K/V around the devices (``ContextSpec.impl="ring"``) or an all-gather of K/V
(``"allgather"``), masked by the tokens' ``positions`` so that any token order (the balanced
zigzag) computes the same function. With the kernels as its blocks (:func:`ring_blocks`) the
ring masks by index: the tokens must then lie in ``ContextSpec.order`` ("zigzag" or
"contiguous"; the natural order when no positions are given).

``logit_max=True`` (training diagnostics) makes the call return ``(out, maxes)``:
``maxes`` float32 ``[n_maps, B, T, Hq]`` (1 map for standard attention, 2 for DIFF), each
query row's largest attention logit ``(q . k) * scale`` over the keys it may see (-inf for a
row that sees none), without gradient. It comes from what each path already computes: the XLA
path's logits, the Pallas kernels' running row max (one more output of the forward kernel),
the context ring's running max merged over the key blocks, the all-gather's logits; under a
context axis in the token layout and sharding of ``out``'s rows. The built-in
implementations only: a custom object is refused. ``logit_max=False`` (the default) runs
exactly the program it runs without the option.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from diffjax.ops import context as context_lib
from diffjax.ops import impl_table
from diffjax import kernels
from diffjax.infra import sharding
from diffjax.config import (
    ATTENTION_IMPLS,
    KERNEL_ORDERS,
    NATURAL_ORDER,
    VENDOR_IMPLS,
    ConfigError,
    ContextSpec,
    KernelTarget,
    ModelConfig,
)
from diffjax.kernels import check as kernel_check
from diffjax.kernels import cudnn, reference, splash


def current_target() -> KernelTarget:
    """The :class:`KernelTarget` of this process's default backend (a layer built by hand takes
    it when it is built; a run passes its own)."""
    platform = jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    cc = kernels.gpu_capability() if platform == "gpu" else None
    return KernelTarget(platform if platform in ("cpu", "gpu", "tpu") else "cpu", cc)


def check_impl(impl, target: KernelTarget | None = None):
    """The concrete implementation for ``impl``: ``"xla"``, ``"pallas"``, ``"cudnn"``,
    ``"splash"`` or the given object (``"auto"`` resolved for ``target``, default
    :func:`current_target`, where nothing was measured). A ValueError that names the fix for an
    unknown name, a vendor's attention on another platform, or an object without the
    ``attention`` function."""
    if isinstance(impl, str):
        if impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"unknown attention impl {impl!r}. Fix: use one of "
                f"{', '.join(map(repr, ATTENTION_IMPLS))}, or an object with the function "
                f"attention(q, k, v, *, second, causal, segment_ids, kv_segment_ids, scale)."
            )
        target = current_target() if target is None else target
        if impl in VENDOR_IMPLS and target.platform not in (VENDOR_IMPLS[impl], "cpu"):
            other = {v: k for k, v in VENDOR_IMPLS.items()}[target.platform]
            raise ValueError(
                f"attention impl {impl!r} runs on a {VENDOR_IMPLS[impl].upper()}, and this "
                f"target is a {target.platform.upper()}. Fix: use {other!r}, 'pallas' or 'auto'"
            )
        return target.resolve(impl)
    if not callable(getattr(impl, "attention", None)):
        old = all(callable(getattr(impl, f, None)) for f in _OLD_FUNCTIONS)
        raise ValueError(
            f"attention impl {impl!r} has no function attention. Fix: give it "
            f"attention(q, k, v, *, second, causal, segment_ids, kv_segment_ids, scale), one "
            f"softmax map when second is None and two when second=(q2, k2, lam)"
            + (" (it replaces dot_product_attention and differential_attention)" if old else "")
            + f", or pass one of {', '.join(map(repr, ATTENTION_IMPLS))}."
        )
    return impl


_OLD_FUNCTIONS = ("dot_product_attention", "differential_attention")


def ring_blocks(impl, spec: ContextSpec, target: KernelTarget) -> tuple[str, str | None]:
    """``(what computes the blocks of the sequence-parallel attention, note)`` for ``impl`` on
    ``target``: ``"pallas"`` (the fused kernels, masked by index: the ring in the zigzag or
    contiguous order) or ``"xla"`` (the XLA math masked by the tokens' positions, any order).
    ``"auto"`` takes the kernels where they can serve the layout and otherwise the XLA blocks,
    said in ``note``; an explicit ``"pallas"`` that cannot is refused when the ring runs
    (:mod:`diffjax.ops.context` names the fix; a run refuses it before compute), and the
    vendors' attention is refused here, as it returns no log-sum-exp to merge blocks by."""
    if impl in VENDOR_IMPLS:
        raise ValueError(
            f"attention impl {impl!r} cannot be the blocks of the sequence-parallel ring over a "
            f"context mesh axis (it returns no log-sum-exp to merge the blocks by). Fix: "
            f"model.attention_impl=pallas or auto (the fused kernels as the ring's blocks)"
        )
    if check_impl(impl, target) != "pallas":
        return "xla", None
    if impl == "pallas" or (spec.impl == "ring" and spec.order in KERNEL_ORDERS):
        return "pallas", None
    return "xla", (
        f"auto: the {spec.impl} over the {spec.axis!r} axis runs its blocks on the XLA math, "
        f"not the fused kernels (they serve the ring in the zigzag or contiguous order; this "
        f"run has context_attention={spec.impl}, order {spec.order})"
    )


def _context_layout(blocks: str, spec: ContextSpec, positions, target: KernelTarget) -> dict:
    """The layout keywords of the sequence-parallel call whose blocks are ``blocks``
    (:func:`ring_blocks`). The XLA blocks mask by ``positions`` (any order; None: the natural
    one); the kernels mask by index and take their layout from ``spec.order`` (the natural,
    contiguous one when no positions are given)."""
    if blocks != "pallas":
        return dict(order=NATURAL_ORDER, positions=positions)
    return dict(
        order=NATURAL_ORDER if positions is None else spec.order,
        positions=None,
        kernel=target.kernel,
        interpret=target.interpret,
        compute_capability=target.compute_capability,
    )


def _sequence_parallel(impl, context: ContextSpec | None, target: KernelTarget, t: int, s: int):
    """``(mesh, spec, blocks, target)`` when this self-attention runs over the context axis,
    else None. Whether it does is decided before: a :class:`Resolved` implementation carries
    its run's spec (None: whole sequences), and a direct call passes ``context=``. It then runs
    sequence-parallel under a mesh whose ``spec.axis`` has more than one device, with as many
    keys as queries (not a decoded token) and a length the axis divides (a prompt it does not
    divide takes the plain path, which GSPMD gathers; a run checks its sequence length before
    any compute)."""
    if isinstance(impl, Resolved):
        spec, blocks, target = impl.context, impl.blocks, impl.target
    elif context is not None and isinstance(impl, str):
        spec, blocks = context, ring_blocks(impl, context, target)[0]
    else:
        return None
    mesh = sharding.context_mesh()
    n = 1 if spec is None else context_lib.axis_size(mesh, spec.axis)
    if n == 1 or t != s or t % n:
        return None
    return mesh, spec, blocks, target


def _check_logit_max(impl, logit_max, what: str) -> bool:
    """``logit_max`` as a bool: a static python bool (it changes what the call returns), and
    only with a built-in implementation (the maxes come from its logits or running max)."""
    if not isinstance(logit_max, (bool, np.bool_)):
        raise TypeError(
            f"{what}: logit_max must be True or False (a static python bool: it changes what "
            f"the call returns), got {type(logit_max).__name__}. Fix: pass logit_max=True or "
            "logit_max=False"
        )
    if logit_max and not isinstance(impl, str):
        raise ValueError(
            f"{what}: logit_max=True needs a built-in implementation (the largest logits come "
            f"from the XLA path's logits or the kernels' running row max), and impl is the "
            f"object {impl!r}. Fix: use impl='xla' or impl='pallas' (or 'auto'), or turn the "
            "logit diagnostics off (logit_max=False)"
        )
    return bool(logit_max)


def _logit_max_option(logit_max: bool) -> dict:
    """The keyword that asks a built-in implementation for the maxes; none when they are not
    asked for, so the call is exactly the one without the option."""
    return {"logit_max": True} if logit_max else {}


def _returned(result, logit_max: bool):
    """The call's result: ``out``, or ``(out, maxes)`` with the maxes' gradient stopped."""
    if not logit_max:
        return result
    out, maxes = result
    return out, jax.lax.stop_gradient(maxes)


# ---------------------------------------------------------------------------- choosing
@dataclasses.dataclass(frozen=True)
class Call:
    """What an attention call is, as the choice of implementation sees it: the kind
    ("standard", "v1": DIFF with its own second key, "v2": the maps share one key), the compute
    dtype, the q/k and value widths, the query and key lengths, the masks and whether the
    diagnostics' row maxima are asked for."""

    kind: str
    dtype: str
    head_dim: int
    v_head_dim: int
    q_len: int
    kv_len: int
    causal: bool = True
    segments: bool = False
    kv_segments: bool = False  # kv_segment_ids other than the queries' (a KV cache's mask)
    logit_max: bool = False

    @classmethod
    def of(cls, q, k, v, *, kind, causal, segment_ids, kv_segment_ids, logit_max) -> Call:
        return cls(
            kind,
            jax.numpy.dtype(q.dtype).name,
            q.shape[-1],
            v.shape[-1],
            q.shape[1],
            k.shape[1],
            causal,
            segment_ids is not None,
            kv_segment_ids is not None and kv_segment_ids is not segment_ids,
            logit_max,
        )

    @property
    def decoding(self) -> bool:
        """One query token against a KV cache (its mask by kv_segment_ids)."""
        return self.q_len == 1


def unsupported(impl: str, target: KernelTarget, call: Call) -> str | None:
    """Why ``impl`` (a built-in name) cannot run ``call`` on ``target`` (the reason, with its
    fix), or None. A decoded token is no reason: the vendors' paths give it the XLA math."""
    if impl in ("xla", "pallas"):
        return None
    if target.platform not in (VENDOR_IMPLS[impl], "cpu"):
        return f"{impl} runs on a {VENDOR_IMPLS[impl].upper()} only"
    if call.logit_max:
        return (
            f"{impl} returns no row maxima for the logit diagnostics. Fix: "
            "model.attention_impl=pallas (or auto), or train.diagnostics=false"
        )
    if call.decoding:
        return None
    if impl == "splash":
        return splash.unsupported(
            q_len=call.q_len, kv_len=call.kv_len, kv_segments=call.kv_segments
        )
    return cudnn.unsupported(
        dtype=call.dtype,
        head_dim=call.head_dim,
        v_head_dim=call.v_head_dim,
        q_len=call.q_len,
        kv_len=call.kv_len,
        causal=call.causal,
        segments=call.segments and target.platform == "gpu",
        kv_segments=call.kv_segments,
        compute_capability=target.compute_capability,
    )


def choose(impl, target: KernelTarget, call: Call) -> tuple[Any, str]:
    """``(implementation, why)`` for ``call``: a name or object as given (checked: a built-in
    that cannot run the call raises a ValueError with the reason), or for ``"auto"`` the fastest
    that can run it in the measured table (:func:`diffjax.ops.impl_table.fastest`), else the
    target's default."""
    impl = check_impl(impl, target) if impl != "auto" else impl
    if impl != "auto":
        if isinstance(impl, str) and (reason := unsupported(impl, target, call)) is not None:
            raise ValueError(f"attention impl {impl!r}: {reason}")
        return impl, "set explicitly"
    default = target.resolve("auto")
    if target.platform == "cpu":
        return default, "the XLA math on a CPU"
    eligible = [i for i in ATTENTION_IMPLS[1:] if unsupported(i, target, call) is None]
    pick = impl_table.fastest(
        platform=target.platform,
        compute_capability=target.compute_capability,
        kind=call.kind,
        dtype=call.dtype,
        head_dim=call.head_dim,
        seq_len=call.q_len,
        segments=call.segments,
        eligible=eligible,
    )
    if pick is None:
        return default, "nothing measured for this target and shape: the default"
    return pick.impl, pick.describe()


def model_calls(
    config: ModelConfig, seq_len: int, segments: bool, logit_max: bool = False
) -> tuple[Call, ...]:
    """The attention calls a layer of ``config`` makes in a run on ``seq_len`` tokens
    (``segments``: documents kept apart; ``logit_max``: the training diagnostics): the training
    step's, the evaluation's (without the diagnostics) and a decoded token's against the KV
    cache."""
    kind = {"diff_v1": "v1", "diff_v2": "v2", "standard": "standard"}[config.attention]
    d = config.resolved_head_dim
    dv = 2 * d if kind == "v1" else d
    train = Call(kind, config.dtype, d, dv, seq_len, seq_len, True, segments, False, logit_max)
    evaluate = dataclasses.replace(train, logit_max=False)
    decode = Call(kind, config.dtype, d, dv, 1, 0, False, True, True, False)
    return tuple(dict.fromkeys((train, evaluate, decode)))


def _key(call: Call) -> Call:
    """``call`` as :class:`Resolved` holds it: a decoded token's whatever the cache's length."""
    return dataclasses.replace(call, kv_len=0) if call.decoding else call


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A model's attention on one machine, decided once (:func:`resolve`): what a run logs,
    reports and self-checks, and what its traced calls run. A layer holds it as its
    implementation (a static attribute: frozen, hashed by value).

    ``asked``: the setting (a name of ``ATTENTION_IMPLS`` or an implementation object);
    ``target``: the machine it is traced for; ``context``: the sequence-parallel spec when the
    run's mesh splits the sequence over ``context.axis`` (None: whole sequences, which GSPMD
    lays out under a mesh), with ``blocks``, what computes the ring's blocks
    (:func:`ring_blocks`); ``calls``: ``((call, implementation, why), ...)`` for the calls the
    run makes (:func:`model_calls`); ``notes``: what fell back, for the log."""

    asked: Any
    target: KernelTarget
    context: ContextSpec | None = None
    blocks: str | None = None
    calls: tuple[tuple[Call, Any, str], ...] = ()
    notes: tuple[str, ...] = ()

    def redecided(self, target: KernelTarget, context: ContextSpec | None) -> Resolved:
        """The same setting and calls decided again for ``target`` and ``context``."""
        calls = [call for call, _, _ in self.calls]
        return resolve(self.asked, target, context=context, calls=calls)

    def implementation(self, call: Call):
        """What runs ``call``: the implementation held for it, else (a shape the run did not
        declare: a model built by hand, a prompt of another length) :func:`choose`'s."""
        key = _key(call)
        for held, impl, _ in self.calls:
            if held == key:
                return impl
        return choose(self.asked, self.target, call)[0]

    @property
    def chosen(self) -> tuple[Any, str]:
        """``(implementation, why)`` of the run's first call (training)."""
        if not self.calls:
            return check_impl(self.asked, self.target), "set explicitly"
        return self.calls[0][1], self.calls[0][2]

    def implementations(self) -> tuple:
        """Every implementation the run's calls and ring blocks use, once each (the built-in
        names the kernel check covers)."""
        used = [impl for _, impl, _ in self.calls] or [check_impl(self.asked, self.target)]
        used.append(self.blocks)
        return tuple(dict.fromkeys(i for i in used if i is not None))

    def describe(self) -> tuple[str, str]:
        """``(name, why)`` for the run's log and result: what computes the training call, and
        why, with the sequence-parallel blocks and any fallback."""
        impl, why = self.chosen
        parts = [why]
        if self.context is not None:
            blocks = "the fused kernels" if self.blocks == "pallas" else "the XLA math"
            parts.append(
                f"over the {self.context.axis!r} mesh axis the {self.context.impl} with {blocks} "
                f"as its blocks"
            )
        return (impl if isinstance(impl, str) else repr(impl)), "; ".join([*parts, *self.notes])


def resolve(
    impl, target: KernelTarget | None = None, *, context: ContextSpec | None = None, calls=()
) -> Resolved:
    """``impl`` (a name or an object; a :class:`Resolved` as it is) decided for ``target``
    (default :func:`current_target`): each of ``calls`` by :func:`choose`, and with a
    ``context`` spec the sequence-parallel blocks (:func:`ring_blocks`). A ValueError with the
    reason and fix for what cannot run, before any compute. A :class:`Resolved` is decided
    again only for another ``target``."""
    if isinstance(impl, Resolved):
        same = target is None or target == impl.target
        return impl if same else impl.redecided(target, impl.context)
    target = current_target() if target is None else target
    check_impl(impl, target)
    held = tuple((_key(c), *choose(impl, target, c)) for c in calls)
    blocks, notes = None, ()
    if context is not None and not isinstance(impl, str):
        notes = (
            f"the implementation object {impl!r} runs whole sequences: over the "
            f"{context.axis!r} mesh axis GSPMD gathers them (only the built-in ones run the "
            f"{context.impl})",
        )
        context = None
    elif context is not None:
        blocks, note = ring_blocks(impl, context, target)
        notes = () if note is None else (note,)
    return Resolved(impl, target, context, blocks, held, notes)


def resolve_model(
    config: ModelConfig,
    target: KernelTarget,
    *,
    seq_len: int,
    segments: bool,
    logit_max: bool = False,
    context: ContextSpec | None = None,
) -> Resolved:
    """:func:`resolve` of ``config.attention_impl`` for the calls a run of ``config`` makes
    on ``seq_len`` tokens (:func:`model_calls`) on ``target``; ``context``: the run's spec
    when its mesh splits the sequence."""
    calls = model_calls(config, seq_len, segments, logit_max)
    return resolve(config.attention_impl, target, context=context, calls=calls)


def _implementation(impl, target: KernelTarget, call: Call):
    """The object whose ``attention`` runs ``call`` for ``impl`` (a name, an object or a
    :class:`Resolved`) on ``target``."""
    if isinstance(impl, Resolved):
        impl, target = impl.implementation(call), impl.target
    else:
        impl, _ = choose(impl, target, call)
    if impl == "xla" or (impl in VENDOR_IMPLS and call.decoding):
        return reference
    if impl == "pallas":
        return _pallas(target)
    if impl in VENDOR_IMPLS:
        return _vendor(impl, target)
    return impl


# ---------------------------------------------------------------------------- public API
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    second: tuple[jax.Array, jax.Array | None, jax.Array | float] | None = None,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
    impl="auto",
    positions: jax.Array | None = None,
    context: ContextSpec | None = None,
    target: KernelTarget | None = None,
    logit_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax attention with one map (``second`` None: :func:`dot_product_attention`) or two
    (``second=(q2, k2, lam)``: :func:`differential_attention` of ``q, k, q2, k2, v, lam``):
    the one path both take, checked once, then over the ``context`` mesh axis
    (:func:`diffjax.ops.context.context_attention`) or by the implementation ``impl`` picks for
    this call.

    ``scale`` defaults to ``D ** -0.5``. ``positions`` ``[B, T]`` (default ``arange(T)``) and
    ``context`` (default None: whole sequences; a ``ContextSpec``: over the mesh's context
    axis): see the module doc (sequence parallelism). ``target``: the machine it is traced for
    (default :func:`current_target`; a :class:`Resolved` ``impl`` carries its own).
    ``logit_max=True``: ``(out, maxes)``, ``maxes`` float32 ``[n_maps, B, T, Hq]`` each row's
    largest visible logit per map (module doc)."""
    what = "dot_product_attention" if second is None else "differential_attention"
    if second is None:
        reference.check_qkv(q, k, v, segment_ids, kv_segment_ids, what=what)
    else:
        q2, k2, lam = second
        reference.check_differential(q, k, q2, k2, v, lam, segment_ids, kv_segment_ids, what=what)
    asked = impl.asked if isinstance(impl, Resolved) else impl
    logit_max = _check_logit_max(asked, logit_max, what)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    target = current_target() if target is None else target
    masks = dict(causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    split = _sequence_parallel(impl, context, target, q.shape[1], k.shape[1])
    if split is not None:
        mesh, spec, blocks, target = split
        _, b, h = _mesh_axes(q.shape[0], k.shape[2])
        result = context_lib.context_attention(
            q,
            k,
            v,
            second=second,
            mesh=mesh,
            axis=spec.axis,
            impl=spec.impl,
            **_context_layout(blocks, spec, positions, target),
            batch_axes=b,
            head_axes=h,
            scale=scale,
            logit_max=logit_max,
            **masks,
        )
        return _returned(result, logit_max)
    kind = "standard" if second is None else ("v2" if second[1] is None else "v1")
    chosen = _implementation(
        impl, target, Call.of(q, k, v, kind=kind, logit_max=logit_max, **masks)
    )
    options = dict(scale=scale, **masks, **_logit_max_option(logit_max))
    return _returned(chosen.attention(q, k, v, second=second, **options), logit_max)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, **options):
    """Standard softmax attention: :func:`attention` with one map (the same keywords). q
    ``[B,T,Hq,D]``, k ``[B,S,Hkv,D]``, v ``[B,S,Hkv,Dv]``; returns ``[B, T, Hq, Dv]``
    (``logit_max=True``: ``(out, maxes)``, ``maxes`` float32 ``[1, B, T, Hq]``)."""
    return attention(q, k, v, **options)


def differential_attention(q1, k1, q2, k2, v, lam, **options):
    """``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``: :func:`attention` with two maps
    (the same keywords). q1, q2 ``[B,T,Hq,D]``; k1, k2 ``[B,S,Hkv,D]`` (``k2=None``: both maps
    read ``k1``, as DIFF V2's do; the kernels then load each key tile once); v
    ``[B,S,Hkv,Dv]``; ``lam`` a scalar (V1) or ``[B, T, Hq]`` (V2). Returns ``[B, T, Hq, Dv]``
    (``logit_max=True``: ``(out, maxes)``, ``maxes`` float32 ``[2, B, T, Hq]``: map 1's
    (q1 k1) and map 2's (q2 k2, or q2 k1 when ``k2`` is None) largest visible logit per
    row)."""
    return attention(q1, k1, v, second=(q2, k2, lam), **options)


# ---------------------------------------------------------------------------- kernel check
def kernel_cases(config: ModelConfig, impl: str = "pallas") -> list[kernel_check.Case]:
    """The kernel check's cases for a model run by ``impl`` ("pallas", "cudnn", "splash"): its
    attention kind, head and value widths, and its compute dtype (and float32)."""
    kind = {"diff_v1": "v1", "diff_v2": "v2", "standard": "standard"}[config.attention]
    d = config.resolved_head_dim
    return kernel_check.cases_for(kind, d, 2 * d if kind == "v1" else d, config.dtype, impl)


def check_kernels(
    config: ModelConfig,
    resolved: Resolved | None = None,
    *,
    interpret: bool = False,
    log: Callable[[str], None] | None = None,
) -> kernel_check.CheckReport | None:
    """Before a run: check what computes ``config``'s attention against the reference math for
    its shapes on this device (:func:`diffjax.kernels.check.ensure_checked`: once per device
    kind, jax version and shape, cached): the Pallas kernels, or the cuDNN or Splash
    compositions. ``resolved``: what the run decided (:func:`resolve_model`: every
    implementation its calls and ring blocks use); None (a model used outside a run): what
    ``config.attention_impl`` may run, for "auto" on a GPU or TPU both the kernels and the
    vendor's composition, either of which it may pick for a shape. Nothing is checked for the
    XLA path (None), unless ``interpret``: then the kernels (or the given composition) run
    through the interpreters or XLA, as on CPU the model runs them. A failure raises
    :class:`ConfigError` naming the failing cases and the fix; it never falls back
    silently."""
    if resolved is not None:
        impls = list(resolved.implementations())
    else:
        target = current_target()
        impls = [check_impl(config.attention_impl, target)]
        vendor = kernel_check.VENDOR.get(target.platform)
        if config.attention_impl == "auto" and vendor is not None:
            call = model_calls(config, config.max_seq_len, segments=False)[0]
            if unsupported(vendor, target, call) is None:  # what auto may pick at some shape
                impls.append(vendor)
    impls = [i for i in impls if i in kernel_check.IMPLS]
    if not impls:
        if not interpret:
            return None
        impls = ["pallas"]
    interpret = interpret or jax.default_backend() == "cpu"  # where the model interprets them
    cases = [c for i in impls for c in kernel_cases(config, i)]
    try:
        return kernel_check.ensure_checked(cases, interpret=interpret, log=log)
    except kernel_check.KernelCheckError as e:
        lines = "\n".join(e.report.lines())
        failed = {r.case.impl for r in e.report.results if not r.passed}
        fix = (
            "model.attention_impl=xla (the XLA path)"
            if "pallas" in failed
            else f"model.attention_impl=pallas (diffjax's kernels) instead of {', '.join(failed)}"
        )
        raise ConfigError(
            f"ModelConfig.attention_impl: {e}.\n{lines}\nFix: set {fix}, and please report "
            f"the lines above (python -m diffjax.kernels.check prints them) with your jax and "
            f"jaxlib versions."
        ) from e


# ---------------------------------------------------------------------------- Pallas
# A Pallas kernel is one opaque call that GSPMD cannot split, so under a mesh it runs inside
# jax.shard_map: batch rows over the batch axes, heads over `tensor` (kv heads and query heads
# alike, so every query head finds its kv group, and DIFF pairs, which share a head index, stay
# together), sequence and head width whole. On CPU the kernels run interpreted (tests).
def _mesh_axes(batch: int, kv_heads: int):
    """``(mesh, batch axes, head axes)`` under the context mesh, or ``(None, None, None)``."""
    mesh = sharding.context_mesh()
    if mesh is None or mesh.size == 1:
        return None, None, None
    bspec = sharding.logical_to_spec(("act_batch",), (batch,), mesh)
    hspec = sharding.logical_to_spec(("act_kv_heads",), (kv_heads,), mesh)
    return mesh, (bspec[0] if len(bspec) else None), (hspec[0] if len(hspec) else None)


def _per_shard(run, args, specs, batch: int, kv_heads: int, logit_max: bool = False):
    """``run(*args)``, under a mesh inside ``jax.shard_map`` with ``specs(b, h)`` (the in
    specs for batch axes ``b`` and head axes ``h``; a None argument gets a None spec).
    ``logit_max``: ``run`` returns ``(out, maxes)``, the maxes ``[n_maps, B, T, Hq]`` split
    like ``out``'s rows."""
    mesh, b, h = _mesh_axes(batch, kv_heads)
    if mesh is None:
        return run(*args)
    in_specs = tuple(None if a is None else s for a, s in zip(args, specs(b, h), strict=True))
    out = P(b, None, h, None)
    if logit_max:
        out = (out, P(None, b, None, h))
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=out, check_vma=False)(*args)


def _logit_max_kernel_option(logit_max: bool) -> dict:
    """The kernels' keyword for the maxes (their forward's running row max); none when not
    asked for, so the call is exactly the one without the option."""
    return {"return_logit_max": True} if logit_max else {}


def _kernel_options(target: KernelTarget) -> dict:
    return dict(
        interpret=target.interpret,
        backend=target.kernel,
        compute_capability=target.compute_capability,
    )


def _sharded(attend, maps: tuple, segment_ids, kv_segment_ids, logit_max=False):
    """``attend(*maps, segment_ids, kv_segment_ids)`` per shard: batch rows and heads.
    ``maps``: one softmax map's ``(q, k, v)`` or two maps' ``(q1, k1, q2, k2, v, lam)``
    (lambda: V1's scalar whole, V2's ``[B, T, Hq]`` split like the queries)."""

    def specs(b, h):
        heads = P(b, None, h, None)
        if len(maps) == 3:
            return (heads,) * 3 + (P(b, None),) * 2
        lam_spec = P() if jax.numpy.ndim(maps[5]) == 0 else P(b, None, h)
        return (heads,) * 5 + (lam_spec, P(b, None), P(b, None))

    args = (*maps, segment_ids, kv_segment_ids)
    return _per_shard(attend, args, specs, maps[0].shape[0], maps[1].shape[2], logit_max)


def _per_shard_implementation(fn: Callable):
    """An implementation whose ``attention`` runs ``fn(q, k, v, *, second, ...)`` per shard
    (:func:`_sharded`): the fused kernels and the vendors' attention, opaque calls that GSPMD
    cannot split."""

    def attention(q, k, v, *, second=None, segment_ids, kv_segment_ids, logit_max=False, **call):
        def run(*args):
            *maps, segment_ids, kv_segment_ids = args
            q, k, v, second = context_lib.split_maps(tuple(maps))
            return fn(
                q,
                k,
                v,
                second=second,
                segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids,
                **call,
                **_logit_max_option(logit_max),
            )

        maps = (q, k, v) if second is None else (q, k, *second[:2], v, second[2])
        return _sharded(run, maps, segment_ids, kv_segment_ids, logit_max)

    return types.SimpleNamespace(attention=attention)


def _pallas(target: KernelTarget):
    """The "pallas" implementation for ``target``: the fused kernels
    (:func:`diffjax.kernels.attention`), per shard."""

    def fn(q, k, v, *, scale, logit_max=False, **call):
        return kernels.attention(
            q,
            k,
            v,
            sm_scale=scale,
            **call,
            **_kernel_options(target),
            **_logit_max_kernel_option(logit_max),
        )

    return _per_shard_implementation(fn)


# ---------------------------------------------------------------------------- cuDNN, Splash
# Run per shard like the kernels (Splash is a Pallas call GSPMD cannot split; cuDNN's calls
# alike, so both take the heads and batch rows a device holds). A CPU target runs the cuDNN
# composition on XLA and Splash interpreted.
def _vendor(impl: str, target: KernelTarget):
    """The "cudnn" or "splash" implementation for ``target`` (the diagnostics' ``logit_max`` is
    refused before: :func:`unsupported`)."""
    if impl == "cudnn":
        implementation = "xla" if target.platform == "cpu" else "cudnn"
        return _per_shard_implementation(
            functools.partial(cudnn.attention, implementation=implementation)
        )
    return _per_shard_implementation(
        functools.partial(splash.attention, interpret=target.interpret)
    )
