"""Pallas kernels for differential attention: both softmax maps in one fused flash-style pass.

:func:`differential_flash_attention` computes ``softmax(q1 k1^T s) v - lam * softmax(q2 k2^T s) v``
streaming each key/value tile once, with two online-softmax states and two accumulators, and a
Pallas backward (``jax.custom_vjp``) from the two saved log-sum-exps. :func:`flash_attention` is
the standard attention of the twin through the same machinery, so comparisons are like for like.

Two kernels, one API:

- ``gpu``: Pallas on the Triton lowering (:mod:`diffjax.kernels.gpu`).
- ``tpu``: Pallas Mosaic with VMEM scratch (:mod:`diffjax.kernels.tpu`).

``backend=None`` picks by ``jax.default_backend()``. On CPU the kernels only run interpreted
(``interpret=True``; the GPU kernel unless ``backend="tpu"``), for tests. Each kernel is tested
against :mod:`diffjax.kernels.reference`, the plain ``jax.numpy`` math it computes (the only
other diffjax module the kernels import).
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp

from . import reference

KERNEL_BACKENDS = ("gpu", "tpu")
_ALIASES = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}


def kernel_module(backend: str | None = None, *, interpret: Any = False):
    """The kernel module (:mod:`.gpu` or :mod:`.tpu`) for ``backend`` (default: the current one).

    Raises a ValueError that says what to do when no kernel can run: an unknown backend, or CPU
    without ``interpret``.
    """
    if backend is None:
        platform = jax.default_backend()
        if platform == "cpu":
            if not interpret:
                raise ValueError(
                    "the Pallas kernels compile only for GPU and TPU, and this process runs on CPU. "
                    "Fix: pass interpret=True to run them interpreted (slow; for tests), or use "
                    "the XLA path (attention_impl='xla' / impl='xla')."
                )
            platform = "gpu"
        backend = platform
    name = _ALIASES.get(backend)
    if name is None:
        raise ValueError(
            f"no Pallas kernel for backend {backend!r}. Fix: use one of "
            f"{', '.join(map(repr, KERNEL_BACKENDS))}, or None for the current one."
        )
    return importlib.import_module(f"{__name__}.{name}")


def gpu_capability() -> tuple[int, int]:
    """This process's GPU's compute capability ((9, 0) when there is none)."""
    return importlib.import_module(f"{__name__}.gpu").device_capability()


def _gpu_only(module, compute_capability) -> dict:
    """``compute_capability=`` for the GPU kernel (the TPU kernel has no use for it)."""
    gpu = module.__name__.endswith(".gpu")
    return {"compute_capability": compute_capability} if gpu and compute_capability else {}


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    second: tuple[jax.Array, jax.Array | None, jax.Array | float] | None = None,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    block_sizes: Any = None,
    interpret: Any = False,
    backend: str | None = None,
    compute_capability: tuple[int, int] | None = None,
    o2_dtype: Any = jnp.float32,
    return_logit_max: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Fused flash attention with one softmax map (``second`` None: standard MHA/GQA/MQA) or
    two (``second=(q2, k2, lam)``: ``softmax(q k^T s) v - lam * softmax(q2 k2^T s) v``),
    ``[B, T, Hq, Dv]`` in ``q.dtype``; the kernel module of ``backend`` (:func:`kernel_module`)
    runs it, each case with its own kernel body.

    q (and q2) ``[B,T,Hq,Dqk]``; k (and k2) ``[B,S,Hkv,Dqk]`` (``k2=None``: both maps read
    ``k``, as in V2, and each key tile is loaded once); v ``[B,S,Hkv,Dv]``, with two maps
    ``Dv`` = ``Dqk`` or ``2*Dqk``; ``lam`` a scalar (V1) or ``[B,T,Hq]`` (V2). Query head ``i``
    reads kv head ``i // (Hq // Hkv)``. Causal masking is bottom-right aligned;
    ``segment_ids`` ``[B,T]`` separate packed sequences (keys use ``kv_segment_ids`` ``[B,S]``
    when given). ``sm_scale`` defaults to ``Dqk**-0.5``. ``block_sizes``: the chosen kernel's
    ``BlockSizes``. ``compute_capability``: the GPU the GPU kernel is compiled for (default:
    this one), which its default block sizes follow. ``o2_dtype`` (two maps): the saved
    second-branch output's dtype (a backward residual), float32 or bfloat16 (half the memory;
    docs/kernels.md gives the cost in d(lam)). ``return_logit_max``: also return each map's
    largest logit per row, ``(out, maxes)`` with ``maxes`` float32 ``[n_maps, B, T, Hq]`` (the
    kernels' running row max; -inf for a row that sees no key; no gradient); False leaves the
    kernels as they are without it. Both kernel modules check their inputs alike
    (:mod:`diffjax.kernels._frontend`): the same bad input raises the same error on either.
    """
    module = kernel_module(backend, interpret=interpret)
    options = dict(
        causal=causal,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        return_logit_max=return_logit_max,
        **_gpu_only(module, compute_capability),
    )
    if second is None:
        return module.flash_attention(q, k, v, **options)
    # The kernel modules' public functions check the shapes (once); this only adds the
    # model's rule for V's width (against k's: q/k mismatches are the modules' to name).
    dqk, dv = k.shape[-1], v.shape[-1]
    if dv not in (dqk, 2 * dqk):
        raise ValueError(
            f"differential_flash_attention: v's head dim must equal q/k's ({dqk}) "
            f"or be twice it ({2 * dqk}), got {dv}. Fix: give v the width of q/k (V2) or "
            "twice it (V1)"
        )
    q2, k2, lam = second
    return module.differential_flash_attention(q, k, q2, k2, v, lam, o2_dtype=o2_dtype, **options)


def differential_flash_attention(q1, k1, q2, k2, v, lam, **options):
    """Fused differential attention: :func:`attention` with two maps (the same keywords)."""
    return attention(q1, k1, v, second=(q2, k2, lam), **options)


def flash_attention(q, k, v, **options):
    """Standard (MHA/GQA/MQA) flash attention: :func:`attention` with one map (the same
    keywords but ``o2_dtype``)."""
    return attention(q, k, v, **options)


__all__ = [
    "KERNEL_BACKENDS",
    "attention",
    "differential_flash_attention",
    "flash_attention",
    "gpu_capability",
    "kernel_module",
    "reference",
]
