"""Context-parallel attention memory: per-device temporaries of ring vs all-gather, from XLA.

    JAX_NUM_CPU_DEVICES=8 python benchmarks/context_memory.py
    python benchmarks/context_memory.py --lengths 8192,32768,131072 --sizes 1,2,4,8
    python benchmarks/context_memory.py --lengths 4096 --time-lengths 1024,2048 --dtype bfloat16

For one DIFF V1 attention layer's forward + backward (the gradient of ``sum(out**2)`` in q1, k1,
q2, k2, v and lambda; B=1, Hq=Hkv=4, D=64, v 2D wide) it compiles, for each sequence length T
and context size N, the program of :func:`diffjax.ops.context.context_attention` (two maps)
(zigzag order, inputs sharded over the ``context`` axis) with ``impl="ring"`` (key chunks of
``--block-k``) and ``impl="allgather"``, and for N=1 the plain reference
(:func:`diffjax.kernels.reference.differential_attention`) on one device. It prints a markdown
table of the per-device temporary memory (``compiled.memory_analysis().temp_size_in_bytes``):
nothing is run for it, so large T only costs compile time. For the lengths in
``--time-lengths`` it also runs each program and gives the median time per call (on CPU
devices that share the host's cores: a check that it runs, not a speed figure for
accelerators).

The ring's temporaries grow as ``T/N * block_k`` (its maps are ``[T/N, block_k]``), the
all-gather's as ``T/N * T`` (``[T/N, T]`` maps), the reference's as ``T^2``.

``JAX_NUM_CPU_DEVICES`` is set (to 8, or the largest size asked) before JAX is imported when
it is not set already.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192,32768,131072", help="sequence lengths to compile")
    p.add_argument("--sizes", default="1,2,4,8", help="context sizes (1: the reference)")
    p.add_argument("--time-lengths", default="2048", help="lengths also run and timed ('' none)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-k", type=int, default=512, help="the ring's key chunk")
    p.add_argument("--steps", type=int, default=3, help="timed calls per program")
    return p.parse_args(argv)


ARGS = _args()
if "jax" not in sys.modules:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(max(8, *_parse_ints(ARGS.sizes))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from diffjax.ops import context
from diffjax.kernels import reference  # noqa: E402

MIB = 1024**2


def _shapes(t: int, dtype):
    h, d = ARGS.heads, ARGS.head_dim
    qk = jax.ShapeDtypeStruct((1, t, h, d), dtype)
    v = jax.ShapeDtypeStruct((1, t, h, 2 * d), dtype)
    lam = jax.ShapeDtypeStruct((), jnp.float32)
    return (qk, qk, qk, qk, v, lam)


def _grad(attn):
    def loss(q1, k1, q2, k2, v, lam):
        return jnp.sum(attn(q1, k1, q2, k2, v, lam).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def _program(impl: str, n: int, t: int, dtype):
    """``(jitted fwd+bwd, abstract args with their shardings)``."""
    shapes = _shapes(t, dtype)
    if impl == "reference":
        fn = _grad(reference.differential_attention)
        dev = NamedSharding(jax.make_mesh((1,), ("context",), devices=jax.devices()[:1]), P())
        return fn, tuple(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev) for s in shapes)
    mesh = jax.make_mesh(
        (n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )

    def attn(q1, k1, q2, k2, v, lam):
        return context.context_attention(
            q1,
            k1,
            v,
            second=(q2, k2, lam),
            mesh=mesh,
            impl=impl,
            order="zigzag",
            block_k=ARGS.block_k,
        )

    seq = NamedSharding(mesh, P(None, "context"))
    rep = NamedSharding(mesh, P())
    args = tuple(
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=seq if s.ndim else rep) for s in shapes
    )
    return _grad(attn), args


def _concrete(args):
    rng = np.random.default_rng(0)
    return tuple(
        jax.device_put(rng.standard_normal(a.shape).astype(np.float32).astype(a.dtype), a.sharding)
        if a.ndim
        else jax.device_put(np.float32(0.5), a.sharding)
        for a in args
    )


def _measure(impl, n, t, dtype, timed):
    fn, args = _program(impl, n, t, dtype)
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    temp = None if mem is None else mem.temp_size_in_bytes
    step = None
    if timed:
        real = _concrete(args)
        jax.block_until_ready(compiled(*real))
        times = []
        for _ in range(ARGS.steps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*real))
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
    return temp, compile_s, step


def _mib(x):
    return "n/a" if x is None else f"{x / MIB:,.1f}"


def _ms(x):
    return "" if x is None else f"{x * 1e3:,.1f}"


def main() -> None:
    dtype = jnp.dtype(ARGS.dtype)
    lengths = _parse_ints(ARGS.lengths)
    timed = set(_parse_ints(ARGS.time_lengths))
    sizes = _parse_ints(ARGS.sizes)
    have = len(jax.devices())
    print(
        f"# Context-parallel DIFF V1 attention, fwd+bwd: B=1, Hq=Hkv={ARGS.heads}, "
        f"D={ARGS.head_dim}, Dv={2 * ARGS.head_dim}, {ARGS.dtype}, zigzag order, "
        f"ring key chunk {ARGS.block_k}, "
        f"{jax.default_backend()} x{have}, jax {jax.__version__}\n"
    )
    print(
        "Per-device temporary memory (MiB, XLA's memory analysis); time per call (ms) where run.\n"
    )
    print("| T | N | impl | temp MiB | temp x N / reference | compile s | ms/call |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for t in sorted(set(lengths) | timed):
        base = None
        for n in sizes:
            if n > have:
                print(f"| {t} | {n} | (only {have} devices) | | | | |")
                continue
            for impl in ("reference",) if n == 1 else ("ring", "allgather"):
                try:
                    temp, compile_s, step = _measure(impl, n, t, dtype, t in timed)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"| {t} | {n} | {impl} | failed: {type(e).__name__}: {e} | | | |")
                    continue
                if impl == "reference":
                    base = temp
                ratio = "" if not (base and temp is not None) else f"{temp * n / base:.2f}"
                print(
                    f"| {t} | {n} | {impl} | {_mib(temp)} | {ratio} | {compile_s:.1f} | "
                    f"{_ms(step)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
