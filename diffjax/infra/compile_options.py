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
    """Whether this jax's XLA accepts compiler option ``option`` (compiles a tiny probe once: an
    unknown option is an INVALID_ARGUMENT error at compile time, on every jax version; the
    options are one list shared by all backends, so the probe runs on the default one)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options={option: value}).lower(
            jax.ShapeDtypeStruct((), "float32")
        ).compile()
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


class lazy_jit:  # lower case: a decorator, like jax.jit
    """``jax.jit(fun, compiler_options=cpu_compile_options(), **jit_kwargs)``, built at the first
    call (or ``.lower``/``.trace``), for module-level decorators: choosing the options at import
    would start the jax backend at ``import diffjax`` (too early for ``jax.distributed``).
    Use as ``@functools.partial(lazy_jit, static_argnames=...)``."""

    def __init__(self, fun, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self._fun, self._kwargs, self._jitted = fun, jit_kwargs, None

    def _get(self):
        if self._jitted is None:
            self._jitted = jax.jit(
                self._fun, compiler_options=cpu_compile_options(), **self._kwargs
            )
        return self._jitted

    def __call__(self, *args, **kwargs):
        return self._get()(*args, **kwargs)

    def __getattr__(self, name):  # lower, trace, eval_shape, clear_cache, ...
        if name.startswith("__") or name in ("_fun", "_kwargs", "_jitted"):
            raise AttributeError(name)
        return getattr(self._get(), name)


__all__ = ["YNN_FUSION_OPTION", "cpu_compile_options", "lazy_jit"]
