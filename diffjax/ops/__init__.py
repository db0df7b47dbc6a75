"""The attention computation: what the attention layers call for one or two softmax maps.

- :mod:`.dispatch`: the one dispatch point, :func:`attention` for one softmax map or two
  (:func:`dot_product_attention` and :func:`differential_attention` call it; shape checks, the
  implementation: ``xla``, ``pallas``, ``cudnn``, ``splash`` or ``auto``, decided once for a
  run by :func:`resolve_model` and held as a :class:`Resolved`; the kernels' self-check);
- :mod:`.context`: attention over the ``context`` mesh axis (the ring, the all-gather, the
  kernel ring);
- :mod:`.impl_table`: the measured table behind ``attention_impl="auto"``
  (``impl_table.json``, beside it).

The kernels themselves (Pallas for GPU and TPU, their reference, the cuDNN and Splash
compositions, the self-check) are :mod:`diffjax.kernels`, which imports nothing else of
diffjax.
"""

from diffjax.ops.dispatch import (
    attention,
    check_impl,
    check_kernels,
    choose,
    current_target,
    differential_attention,
    dot_product_attention,
    kernel_cases,
    model_calls,
    resolve,
    resolve_model,
    ring_blocks,
    unsupported,
    Resolved,
)

__all__ = [
    "attention",
    "check_impl",
    "check_kernels",
    "choose",
    "current_target",
    "differential_attention",
    "dot_product_attention",
    "kernel_cases",
    "model_calls",
    "resolve",
    "resolve_model",
    "ring_blocks",
    "unsupported",
    "Resolved",
]
