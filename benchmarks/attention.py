"""Attention benchmark: the fused differential kernel against the other ways to compute it.

    python benchmarks/attention.py                       # GPU/TPU: T = 1K..32K, bf16, d = 128, causal
    python benchmarks/attention.py --seq-lens 256 512    # any lengths; on CPU small ones
    python benchmarks/attention.py --markdown out.md     # also write the table as markdown

Per sequence length it prints forward and forward+backward time, TFLOP/s and XLA's memory
estimate (arguments + outputs + temporaries of the compiled function) for:

  fused      diffjax.kernels.differential_flash_attention: both softmax maps in one pass (V1 layout:
             h heads, q/k width d, v width 2d)
  xla        diffjax.kernels.reference.differential_attention (the XLA path), the plain reference (materialises T x S)
  two-call   the official code's strategy: two standard attention calls (jax.nn.
             dot_product_attention, cuDNN where available; four calls when the backend cannot
             take a v twice as wide as q/k) and the subtraction
  twin       the standard twin's attention (2h heads of width d): diffjax.kernels.flash_attention,
             and jax.nn.dot_product_attention for reference

FLOPs count the one-pass work of the reference page: 6d multiply-adds per visible (query, key)
pair per DIFF V1 head forward, 2d per standard head (so 4d for the two twin heads a DIFF head
replaces), and forward+backward = 3.5x forward (the backward's five matmuls to the forward's two). On CPU the
Pallas kernels do not compile (interpret mode is for tests, not timing): they are skipped unless
--interpret is given, and the table says so.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from diffjax import kernels

BWD_FACTOR = 3.5


def _time(fn, *args, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _memory(fn, *args) -> int | None:
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return int(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
    except Exception:  # noqa: BLE001
        return None


def visible_pairs(t: int, causal: bool) -> int:
    return t * (t + 1) // 2 if causal else t * t


def matmul_peak(dtype, n: int) -> float:
    """Measured dense matmul TFLOP/s on this device (the 'peak' the kernel is compared with)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    dt = _time(f, a, a, iters=5, warmup=2)
    return 2 * n**3 / dt / 1e12


def two_call(q1, k1, q2, k2, v, lam, *, causal, impl):
    """The official code's strategy with a stock attention: per branch one call with the 2d-wide
    v if the implementation takes it, else two calls on its halves."""

    def attend(q, k):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
        except Exception:  # noqa: BLE001 - e.g. cuDNN wants v's width equal to q's
            d = q.shape[-1]
            halves = [
                jax.nn.dot_product_attention(
                    q, k, v[..., i * d : (i + 1) * d], is_causal=causal, implementation=impl
                )
                for i in range(v.shape[-1] // d)
            ]
            return jnp.concatenate(halves, axis=-1)

    o1, o2 = attend(q1, k1), attend(q2, k2)
    return (o1.astype(jnp.float32) - lam * o2.astype(jnp.float32)).astype(q1.dtype)


def variants(backend: str, interpret: bool, causal: bool):
    """name -> (kind, fn) with fn(q1, k1, q2, k2, v, lam) for diff and fn(q, k, v) for std."""
    on_accel = backend in ("gpu", "tpu")
    stock = "cudnn" if backend == "gpu" else None
    out = {}
    if on_accel or interpret:
        out["fused"] = (
            "diff",
            functools.partial(
                kernels.differential_flash_attention,
                causal=causal,
                interpret=interpret and not on_accel,
            ),
        )
    out["xla"] = (
        "diff",
        functools.partial(kernels.reference.differential_attention, causal=causal),
    )
    out["two-call"] = ("diff", functools.partial(two_call, causal=causal, impl=stock))
    if on_accel or interpret:
        out["twin fused"] = (
            "std",
            functools.partial(
                kernels.flash_attention, causal=causal, interpret=interpret and not on_accel
            ),
        )
    out["twin jax.nn"] = (
        "std",
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=stock
        ),
    )
    return out


def run(args) -> list[dict]:
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    rows = []
    skipped = []
    if backend not in ("gpu", "tpu") and not args.interpret:
        skipped.append(
            "fused, twin fused (Pallas kernels compile only for GPU/TPU; "
            "--interpret runs them interpreted, which measures nothing useful)"
        )
    peak = matmul_peak(dtype, args.peak_n)
    print(
        f"device: {jax.devices()[0].device_kind} ({backend}), JAX {jax.__version__}; "
        f"measured {args.dtype} matmul peak: {peak:.3g} TFLOP/s"
    )
    if skipped:
        print("skipped: " + "; ".join(skipped))
    print(HEADER)
    for t in args.seq_lens:
        key = jax.random.split(jax.random.key(t), 6)
        q1, q2, k1, k2 = (jax.random.normal(k, (b, t, h, d), dtype) for k in key[:4])
        v = jax.random.normal(key[4], (b, t, h, 2 * d), dtype)
        lam = jnp.float32(0.8)
        qs, ks = jnp.concatenate([q1, q2], 2), jnp.concatenate([k1, k2], 2)  # twin: 2h heads
        vs = jnp.concatenate([v[..., :d], v[..., d:]], 2)
        diff_flops = 2 * 6 * d * visible_pairs(t, args.causal) * b * h
        std_flops = 2 * 2 * 2 * d * visible_pairs(t, args.causal) * b * h  # 2h heads, 4d MACs/pair
        for name, (kind, fn) in variants(backend, args.interpret, args.causal).items():
            if kind == "diff":
                inputs = (q1, k1, q2, k2, v, lam)
                flops = diff_flops
            else:
                inputs = (qs, ks, vs)
                flops = std_flops
            ct = jnp.ones(
                (b, t, inputs[0].shape[2], inputs[-1 if kind == "std" else 4].shape[-1]), dtype
            )
            fwd = jax.jit(fn)
            grad_argnums = tuple(range(len(inputs) - (1 if kind == "diff" else 0)))
            fwd_bwd = jax.jit(
                jax.grad(
                    lambda *a: jnp.sum((fn(*a) * ct).astype(jnp.float32)), argnums=grad_argnums
                )
            )
            row = {"T": t, "variant": name}
            try:
                row["fwd_ms"] = _time(fwd, *inputs, iters=args.iters) * 1e3
                row["fwd_tflops"] = flops / (row["fwd_ms"] / 1e3) / 1e12
                row["fwd_bwd_ms"] = _time(fwd_bwd, *inputs, iters=args.iters) * 1e3
                row["fwd_bwd_tflops"] = BWD_FACTOR * flops / (row["fwd_bwd_ms"] / 1e3) / 1e12
                row["mem_mib"] = (_memory(fwd_bwd, *inputs) or 0) / 2**20
                row["pct_peak"] = 100 * row["fwd_tflops"] / peak
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at long T for xla
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows


HEADER = (
    f"{'T':>6} {'variant':<12} {'fwd ms':>9} {'fwd TF/s':>9} {'%peak':>6} "
    f"{'fwd+bwd ms':>11} {'f+b TF/s':>9} {'mem MiB':>9}"
)


def _format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['T']:>6} {r['variant']:<12} {r['error']}"
    return (
        f"{r['T']:>6} {r['variant']:<12} {r['fwd_ms']:>9.3f} {r['fwd_tflops']:>9.2f} "
        f"{r['pct_peak']:>6.1f} {r['fwd_bwd_ms']:>11.3f} {r['fwd_bwd_tflops']:>9.2f} "
        f"{r['mem_mib']:>9.1f}"
    )


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| T | variant | fwd ms | fwd TFLOP/s | % of matmul peak | fwd+bwd ms | "
        "fwd+bwd TFLOP/s | memory MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['variant']} | {r['error']} | | | | | |")
        else:
            lines.append(
                f"| {r['T']} | {r['variant']} | {r['fwd_ms']:.3f} | "
                f"{r['fwd_tflops']:.2f} | {r['pct_peak']:.1f} | {r['fwd_bwd_ms']:.3f} | "
                f"{r['fwd_bwd_tflops']:.2f} | {r['mem_mib']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    on_accel = jax.default_backend() in ("gpu", "tpu")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096, 8192, 16384, 32768] if on_accel else [128, 256],
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8 if on_accel else 2, help="DIFF V1 heads h")
    p.add_argument("--head-dim", type=int, default=128 if on_accel else 64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--iters", type=int, default=10 if on_accel else 2)
    p.add_argument("--peak-n", type=int, default=8192 if on_accel else 512)
    p.add_argument("--interpret", action="store_true", help="run the Pallas kernels interpreted")
    p.add_argument("--markdown", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    rows = run(args)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
