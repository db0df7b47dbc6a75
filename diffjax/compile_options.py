"""XLA compiler options for ``jax.jit``: the one public way to get diffjax's CPU training speed in
a training step of your own.

On the CPU backend, XLA (jax 0.10 and later) can hand dots and their neighbouring elementwise
ops to YNNPACK as "fusions". For a transformer's training step these fusions (a dot with softmax
pieces around it) run 2-4x slower than XLA's own loops, and the whole step about 14% slower
(``benchmarks/step_time.py``). :func:`cpu_compile_options` turns them off, per ``jax.jit``::

    step = jax.jit(train_step, donate_argnums=0, compiler_options=diffjax.cpu_compile_options())

It returns ``{}`` off the CPU backend and on a jax whose XLA does not know the option, so the
same line is right everywhere. (The process-wide alternative is the environment setting
``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`` before jax starts.)
"""

from __future__ import annotations

import functools

import jax

# XLA:CPU's list of op kinds that YNNPACK may fuse; empty = none (XLA's own dot emitter runs).
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"


@functools.cache
def _cpu_knows(option: str, value: str) -> bool:
    """Whether this jax's XLA:CPU accepts compiler option ``option`` (compiles a tiny probe once:
    an unknown option is an INVALID_ARGUMENT error at compile time, on every jax version)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options={option: value},
                backend="cpu").lower(jax.ShapeDtypeStruct((), "float32")).compile()
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" in str(e):
            return False
        raise
    return True


def cpu_compile_options(backend: str | None = None) -> dict[str, str]:
    """``compiler_options`` for ``jax.jit`` of a training, evaluation or decode step.

    ``backend``: the platform the function is compiled for (default: ``jax.default_backend()``).
    On ``"cpu"``: YNNPACK's dot fusions off (see the module docstring); ``{}`` on any other
    backend, and on a jax without that option. The numerics do not change (same float32 dots).
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu" or not _cpu_knows(YNN_FUSION_OPTION, ""):
        return {}
    return {YNN_FUSION_OPTION: ""}


__all__ = ["YNN_FUSION_OPTION", "cpu_compile_options"]
