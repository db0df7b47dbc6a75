"""Attention benchmark: every kind (DIFF V1, DIFF V2, their standard references) on every
implementation this device has, through diffjax's one dispatch point (``diffjax.ops``).

    python benchmarks/attention.py                           # GPU/TPU: T = 2K..32K, bf16, d = 128
    python benchmarks/attention.py --segments 0 1024         # also with 1K-token documents apart
    python benchmarks/attention.py --table diffjax/ops/impl_table.json   # merge into auto's table
    python benchmarks/attention.py --json rows.json --markdown table.md
    python benchmarks/attention.py --seq-lens 128 --interpret        # CPU: a rehearsal, no timing

Kinds (``h`` DIFF heads of width ``d``; causal; batch ``--batch``):

  v1          DIFF V1: h heads, q/k width d, v width 2d, a scalar lambda
  standard    its twin: 2h heads of width d (MHA)
  v2          DIFF V2: h pairs, 2h query heads over h kv heads of width d, lambda per token
  std-2h      standard attention with V2's 2h query heads over h kv heads: what V2 should cost

Implementations: ``xla`` (the reference math; up to ``--xla-max`` tokens, it materialises T x T),
``pallas`` (diffjax's fused kernels), ``cudnn`` (GPU) and ``splash`` (TPU), and for V1 on a GPU
``cudnn-4`` (cuDNN's four-call composition, V in halves: the official code's way with stock
flash attention). Per row: forward and forward+backward time (median of ``--iters`` calls), TFLOP/s
and their share of the measured bf16 matmul peak, and XLA's memory estimate. TFLOPs count the
one-pass work: 6d multiply-adds per visible (query, key) pair per V1 head; 2d per standard head
(4d for the twin's two heads per DIFF head, as for V2's pair); forward+backward = 3.5 x forward.

It ends with the targets: V2 against std-2h on the same implementation (forward+backward; target
<= 1.05x), and V1's best path against ``cudnn-4`` at 8K-32K (target <= 1x). ``--table`` merges
each kind's forward+backward times into the table ``attention_impl="auto"`` reads
(``diffjax.ops.impl_table``), keyed by this device.

On CPU cuDNN's compositions run on XLA and the Pallas kernels and Splash only interpreted
(``--interpret``): a rehearsal of the script, not a measurement (the table refuses CPU rows).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from diffjax.ops import impl_table
from diffjax import ops
from diffjax.kernels import cudnn

BWD_FACTOR = 3.5
KINDS = ("v1", "standard", "v2", "std-2h")
TABLE_KIND = {"v1": "v1", "standard": "standard", "v2": "v2"}  # std-2h is a reference only


def _time(fn, *args, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _memory(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
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
    """Measured dense matmul TFLOP/s on this device (the 'peak' the kernels are compared with)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    dt = _time(f, a, a, iters=5, warmup=2)
    return 2 * n**3 / dt / 1e12


# ---------------------------------------------------------------------------- the calls
def inputs(kind: str, b: int, t: int, h: int, d: int, dtype, doc_len: int):
    """The arrays of one kind: ``(args, segment_ids)``."""
    keys = iter(jax.random.split(jax.random.key(t), 8))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, dtype)

    seg = None
    if doc_len:
        seg = jnp.broadcast_to((jnp.arange(t) // doc_len).astype(jnp.int32), (b, t))
    if kind == "v1":
        lam = jnp.float32(0.8)
        return (normal(b, t, h, d), normal(b, t, h, d), normal(b, t, h, d), normal(b, t, h, d),
                normal(b, t, h, 2 * d), lam), seg  # fmt: skip
    if kind == "v2":
        lam = jax.random.uniform(next(keys), (b, t, h), jnp.float32)
        return (normal(b, t, h, d), normal(b, t, h, d), normal(b, t, h, d), None,
                normal(b, t, h, d), lam), seg  # fmt: skip
    kv = 2 * h if kind == "standard" else h
    return (normal(b, t, 2 * h, d), normal(b, t, kv, d), normal(b, t, kv, d)), seg


def attention_fn(kind: str, impl: str, causal: bool, seg):
    """``fn(*args)`` of one kind on one implementation (the dispatch; ``cudnn-4``: the cuDNN
    composition with V in halves)."""
    target = ops.current_target()
    masks = dict(causal=causal, segment_ids=seg)
    if impl == "cudnn-4":
        run = "xla" if target.platform == "cpu" else "cudnn"
        return functools.partial(
            cudnn.differential_attention, **masks, implementation=run, wide_value=False
        )
    if kind in ("v1", "v2"):
        return functools.partial(ops.differential_attention, impl=impl, target=target, **masks)
    return functools.partial(ops.dot_product_attention, impl=impl, target=target, **masks)


def flops(kind: str, b: int, t: int, h: int, d: int, causal: bool) -> float:
    """Forward FLOPs of one call (one-pass work, module doc)."""
    macs = 6 * d if kind == "v1" else 4 * d  # per visible pair per DIFF head (or pair of heads)
    return 2 * macs * visible_pairs(t, causal) * b * h


def implementations(kind: str, platform: str, interpret: bool) -> list[str]:
    """What runs ``kind`` here. On CPU: the XLA path and cuDNN's compositions on XLA, and with
    ``interpret`` the interpreted kernels and Splash too."""
    impls = ["xla"]
    if platform != "tpu":
        impls += ["cudnn"] + (["cudnn-4"] if kind == "v1" else [])
    if platform != "cpu" or interpret:
        impls.insert(1, "pallas")
        if platform in ("tpu", "cpu"):
            impls.append("splash")
    return impls


def measure(kind, impl, args, seg, fl, *, causal, iters, peak) -> dict:
    """One row: the forward and forward+backward compiled once each, then timed; XLA's memory
    estimate of the forward+backward."""
    fn = attention_fn(kind, impl, causal, seg)
    grad_argnums = tuple(i for i, a in enumerate(args[:5]) if a is not None)
    out_shape = jax.eval_shape(fn, *args)
    ct = jnp.ones(out_shape.shape, out_shape.dtype)

    def loss(*a):
        return jnp.sum((fn(*a) * ct).astype(jnp.float32))

    row = {}
    try:
        fwd = jax.jit(fn).lower(*args).compile()
        fwd_bwd = jax.jit(jax.grad(loss, argnums=grad_argnums)).lower(*args).compile()
        row["fwd_ms"] = _time(fwd, *args, iters=iters) * 1e3
        row["fwd_bwd_ms"] = _time(fwd_bwd, *args, iters=iters) * 1e3
        row["fwd_tflops"] = fl / (row["fwd_ms"] / 1e3) / 1e12
        row["fwd_bwd_tflops"] = BWD_FACTOR * fl / (row["fwd_bwd_ms"] / 1e3) / 1e12
        row["pct_peak"] = 100 * row["fwd_tflops"] / peak
        row["pct_peak_fwd_bwd"] = 100 * row["fwd_bwd_tflops"] / peak
        row["mem_mib"] = (_memory(fwd_bwd) or 0) / 2**20
    except Exception as e:  # noqa: BLE001 - e.g. out of memory at long T for xla
        row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
    return row


def run(args) -> tuple[list[dict], dict]:
    platform = ops.current_target().platform
    dtype = jnp.dtype(args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    peak = matmul_peak(dtype, args.peak_n)
    device = jax.devices()[0].device_kind
    env = dict(
        device=device,
        platform=platform,
        jax=jax.__version__,
        date=datetime.date.today().isoformat(),
        peak_tflops=round(peak, 1),
        dtype=args.dtype,
        head_dim=d,
        heads=h,
        batch=b,
    )
    print(
        f"device: {device} ({platform}), JAX {jax.__version__}; measured {args.dtype} matmul "
        f"peak: {peak:.3g} TFLOP/s"
    )
    if platform == "cpu":
        print("CPU: a rehearsal (interpreted kernels, cuDNN's compositions on XLA): no timing")
    print(HEADER)
    rows = []
    for doc_len in args.segments:
        for t in args.seq_lens:
            for kind in KINDS:
                arrays, seg = inputs(kind, b, t, h, d, dtype, doc_len)
                fl = flops(kind, b, t, h, d, args.causal)
                for impl in implementations(kind, platform, args.interpret):
                    if impl == "xla" and t > args.xla_max:
                        continue
                    row = dict(T=t, kind=kind, impl=impl, documents=doc_len or None)
                    row.update(
                        measure(kind, impl, arrays, seg, fl, causal=args.causal,
                                iters=args.iters, peak=peak)
                    )  # fmt: skip
                    rows.append(row)
                    print(_format_row(row), flush=True)
    return rows, env


# ---------------------------------------------------------------------------- reporting
HEADER = (
    f"{'T':>6} {'docs':>5} {'kind':<9} {'impl':<8} {'fwd ms':>9} {'fwd TF/s':>9} {'%peak':>6} "
    f"{'fwd+bwd ms':>11} {'f+b TF/s':>9} {'%peak':>6} {'mem MiB':>9}"
)


def _docs(r) -> str:
    return str(r["documents"]) if r.get("documents") else "-"


def _format_row(r: dict) -> str:
    head = f"{r['T']:>6} {_docs(r):>5} {r['kind']:<9} {r['impl']:<8}"
    if "error" in r:
        return f"{head} {r['error']}"
    return (
        f"{head} {r['fwd_ms']:>9.3f} {r['fwd_tflops']:>9.2f} {r['pct_peak']:>6.1f} "
        f"{r['fwd_bwd_ms']:>11.3f} {r['fwd_bwd_tflops']:>9.2f} {r['pct_peak_fwd_bwd']:>6.1f} "
        f"{r['mem_mib']:>9.1f}"
    )


def _time_of(rows, t, docs, kind, impl):
    for r in rows:
        if (r["T"], r["documents"], r["kind"], r["impl"]) == (t, docs, kind, impl):
            return r.get("fwd_bwd_ms")
    return None


def targets(rows: list[dict]) -> list[str]:
    """The targets' lines: V2 / std-2h per implementation, V1's best / cudnn-4 at 8K+."""
    lines = []
    keys = sorted({(r["T"], r["documents"] or 0) for r in rows})
    for t, docs in keys:
        docs = docs or None
        for impl in ("xla", "pallas", "cudnn", "splash"):
            v2, ref = _time_of(rows, t, docs, "v2", impl), _time_of(rows, t, docs, "std-2h", impl)
            if v2 and ref:
                verdict = "meets" if v2 / ref <= 1.05 else "misses"
                lines.append(
                    f"T={t} docs={docs or '-'}: V2 / std-2h on {impl}: {v2 / ref:.3f}x "
                    f"({verdict} <= 1.05)"
                )
        four = _time_of(rows, t, docs, "v1", "cudnn-4")
        best = [
            (ms, i)
            for i in ("pallas", "cudnn", "splash")
            if (ms := _time_of(rows, t, docs, "v1", i))
        ]
        if four and best and t >= 8192:
            ms, impl = min(best)
            verdict = "meets" if ms <= four else "misses"
            lines.append(
                f"T={t} docs={docs or '-'}: V1 best ({impl}) / cudnn-4: {ms / four:.3f}x "
                f"({verdict} <= 1)"
            )
    return lines


def to_markdown(rows: list[dict], env: dict) -> str:
    lines = [
        f"{env['device']} ({env['platform']}), jax {env['jax']}, {env['date']}; {env['dtype']}, "
        f"d={env['head_dim']}, h={env['heads']} DIFF heads, batch {env['batch']}, causal; "
        f"measured matmul peak {env['peak_tflops']} TFLOP/s",
        "",
        "| T | documents | kind | impl | fwd ms | fwd TFLOP/s | % peak | fwd+bwd ms | "
        "fwd+bwd TFLOP/s | % peak | memory MiB |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['T']} | {_docs(r)} | {r['kind']} | {r['impl']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | |")
            continue
        lines.append(
            f"{head} {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | {r['pct_peak']:.1f} | "
            f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.1f} | {r['pct_peak_fwd_bwd']:.1f} | "
            f"{r['mem_mib']:.1f} |"
        )
    return "\n".join(lines + ["", *[f"- {t}" for t in targets(rows)]])


def table_entries(rows: list[dict], env: dict) -> list[dict]:
    """The rows as ``diffjax.ops.impl_table`` entries: per kind, length and documents, every
    implementation's forward+backward milliseconds (``cudnn-4`` is a reference, not an
    implementation auto can pick)."""
    cc = ops.current_target().compute_capability
    out: dict[tuple, dict] = {}
    for r in rows:
        kind = TABLE_KIND.get(r["kind"])
        if kind is None or "error" in r or r["impl"] == "cudnn-4":
            continue
        key = (kind, r["T"], bool(r["documents"]))
        entry = out.setdefault(key, dict(
            platform=env["platform"], device=env["device"], jax=env["jax"], date=env["date"],
            kind=kind, dtype=env["dtype"], head_dim=env["head_dim"], seq_len=r["T"],
            segments=bool(r["documents"]), documents=r["documents"], heads=env["heads"],
            batch=env["batch"], ms={}, source="benchmarks/attention.py --table",
        ))  # fmt: skip
        if env["platform"] == "gpu" and cc is not None:
            entry["compute_capability"] = list(cc)
        if kind == "v1" and r["impl"] == "cudnn":
            entry["note"] = cudnn.composition("v1", segments=bool(r["documents"]))
        entry["ms"][r["impl"]] = round(r["fwd_bwd_ms"], 4)
    return list(out.values())


def main(argv=None) -> int:
    on_accel = jax.default_backend() in ("gpu", "tpu")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=[2048, 4096, 8192, 16384, 32768] if on_accel else [128],
    )
    p.add_argument(
        "--segments", type=int, nargs="+", default=[0],
        help="document lengths to keep apart (0: no segments); e.g. --segments 0 1024",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8 if on_accel else 1, help="DIFF heads h")
    p.add_argument("--head-dim", type=int, default=128 if on_accel else 16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--iters", type=int, default=10 if on_accel else 1)
    p.add_argument("--peak-n", type=int, default=8192 if on_accel else 256)
    p.add_argument("--xla-max", type=int, default=8192, help="the XLA path up to this length")
    p.add_argument("--interpret", action="store_true", help="CPU: the kernels interpreted too")
    p.add_argument("--markdown", help="also write the table to this markdown file")
    p.add_argument("--json", help="also write the rows and the device to this JSON file")
    p.add_argument(
        "--table", help="merge the times into this impl table (diffjax/ops/impl_table.json)"
    )
    args = p.parse_args(argv)
    rows, env = run(args)
    for line in targets(rows):
        print(line)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(rows, env) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    if args.table:
        if env["platform"] == "cpu":
            print("--table: CPU rows are a rehearsal, not a measurement: the table is unchanged")
        else:
            impl_table.write(table_entries(rows, env), args.table)
            print(f"--table: merged {len(table_entries(rows, env))} entries into {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
