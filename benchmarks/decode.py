"""Decoding benchmark: prefill and decode throughput with the KV cache, DIFF V1, DIFF V2 and the
standard twin side by side, against a naive loop of full forwards.

    python benchmarks/decode.py                         # GPU/TPU: d_model 1024, 12 layers, bf16
    python benchmarks/decode.py --d-model 128 --layers 2 --batch 2 --prompt-len 64 --new-tokens 32
    python benchmarks/decode.py --markdown out.md       # also write the table as markdown

The three models share d_model, depth and FFN. DIFF V1 has h heads (q/k halves of width
d = d_model / 2h, values 2d wide, 2h_kv raw key heads); DIFF V2 has 2h output heads of width d
(4h query heads in pairs) over 2h_kv kv heads; the twin (``twin()`` of either: both give the
same config) has 2h heads of width d over 2h_kv kv heads. Per model it prints:

  params        parameters (V2 adds the second query projection and lambda_proj)

  cache B/tok   KV cache bytes per token of one sequence, all layers (diffjax.nn.decode.
                cache_bytes_per_token)
  prefill       prompt tokens per second: the compiled prefill of a [batch, prompt] batch
  decode        generated tokens per second: the compiled greedy decode loop with the cache
                (batch x (new tokens - 1) decode steps; the first token comes from the prefill)
  naive         generated tokens per second re-running the full forward over a fixed
                [batch, prompt + new] buffer for each token (one compiled loop, no cache)
  same          whether the cached and the naive greedy tokens agree (low-precision dtypes may
                flip near-ties)

Times are medians over --iters runs after one warm-up (compilation excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import diffjax
from diffjax.nn import decode


def _median_time(fn, iters: int) -> float:
    jax.block_until_ready(fn())  # warm-up: compile
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def configs(args) -> dict[str, diffjax.ModelConfig]:
    common = dict(
        vocab_size=args.vocab,
        d_model=args.d_model,
        num_layers=args.layers,
        max_seq_len=args.prompt_len + args.new_tokens,
        dtype=args.dtype,
        attention_impl=args.impl,
    )
    v1 = diffjax.ModelConfig(
        attention="diff_v1", num_heads=args.heads, num_kv_heads=args.kv_heads, **common
    )
    d = v1.resolved_head_dim
    v2 = diffjax.ModelConfig(
        attention="diff_v2",
        num_heads=2 * args.heads,
        head_dim=d,
        num_kv_heads=2 * v1.kv_heads,
        **common,
    )
    assert diffjax.twin(v1) == diffjax.twin(v2)
    return {"diff_v1": v1, "diff_v2": v2, "twin": diffjax.twin(v1)}


def _naive_loop(graphdef, state, buf, prompt_len, num_new):
    """Greedy tokens by re-running the full forward over ``buf`` ``[B, L]`` for each token."""
    model = nnx.merge(graphdef, state)

    def body(i, buf):
        logits = model(buf)
        pos = prompt_len + i - 1
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, pos, axis=1, keepdims=False), -1)
        return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(buf.dtype), pos + 1, axis=1)

    return jax.lax.fori_loop(0, num_new, body, buf)


def bench_one(cfg, args) -> dict:
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    b, p, n = args.batch, args.prompt_len, args.new_tokens
    slots = p + n
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, p)), jnp.int32)
    start = jnp.zeros((b,), jnp.int32)

    def run_prefill():
        return decode._prefill_jit(graphdef, state, tokens, start, max_length=slots)

    def run_decode(prefilled):
        logits, cache = prefilled
        return decode._decode_jit(
            graphdef,
            state,
            cache,
            logits,
            jax.random.key(0),
            jnp.int32(n),
            jnp.float32(0.0),
            jnp.int32(-1),
            num_slots=n,
            greedy=True,
            top_k=None,
        )[0]

    t_prefill = _median_time(run_prefill, args.iters)
    # the decode loop donates its cache: a fresh prefill (not timed) before each run
    jax.block_until_ready(run_decode(run_prefill()))
    times = []
    for _ in range(args.iters):
        prefilled = jax.block_until_ready(run_prefill())
        t = time.perf_counter()
        cached = jax.block_until_ready(run_decode(prefilled))
        times.append(time.perf_counter() - t)
    t_decode = statistics.median(times)

    buf = jnp.zeros((b, slots), jnp.int32).at[:, :p].set(tokens)
    first = jnp.argmax(run_prefill()[0], -1).astype(jnp.int32)
    buf = buf.at[:, p].set(first)
    naive = jax.jit(_naive_loop, static_argnums=(0, 3, 4))
    t_naive = _median_time(lambda: naive(graphdef, state, buf, p + 1, n - 1), args.iters)
    naive_tokens = np.asarray(naive(graphdef, state, buf, p + 1, n - 1))[:, p:]
    steps = b * (n - 1)
    return dict(
        model=cfg.attention if cfg.is_diff else "twin",
        heads=f"{cfg.num_heads}x{cfg.resolved_head_dim}/{cfg.kv_heads}kv",
        params=diffjax.count_params(cfg).total,
        cache_bytes=decode.cache_bytes_per_token(cfg),
        prefill=b * p / t_prefill,
        decode=steps / t_decode,
        naive=steps / t_naive,
        same=bool(np.array_equal(np.asarray(cached), naive_tokens)),
    )


HEADER = (
    "model",
    "h x d, kv",
    "params",
    "cache B/tok",
    "prefill tok/s",
    "decode tok/s",
    "naive tok/s",
    "speedup",
    "same",
)


def _cells(r) -> tuple[str, ...]:
    return (
        r["model"],
        r["heads"],
        f"{r['params']:,}",
        f"{r['cache_bytes']:,}",
        f"{r['prefill']:,.0f}",
        f"{r['decode']:,.0f}",
        f"{r['naive']:,.0f}",
        f"{r['decode'] / r['naive']:.1f}x",
        "yes" if r["same"] else "no",
    )


def to_markdown(rows) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def run(args) -> list[dict]:
    print(
        f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {args.dtype}, "
        f"d_model {args.d_model}, {args.layers} layers, batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, attention_impl {args.impl}"
    )
    rows = []
    widths = (8, 14, 12, 12, 14, 13, 12, 8, 5)
    print("  ".join(h.rjust(w) for h, w in zip(HEADER, widths)))
    for cfg in configs(args).values():
        r = bench_one(cfg, args)
        rows.append(r)
        print("  ".join(c.rjust(w) for c, w in zip(_cells(r), widths)), flush=True)
    return rows


def main(argv=None) -> int:
    on_accel = jax.default_backend() in ("gpu", "tpu")
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=1024 if on_accel else 128)
    p.add_argument("--layers", type=int, default=12 if on_accel else 2)
    p.add_argument(
        "--heads",
        type=int,
        default=8 if on_accel else 2,
        help="DIFF V1 heads h (V2 and the twin: 2h query heads)",
    )
    p.add_argument("--kv-heads", type=int, default=None, help="DIFF V1 kv heads (default h)")
    p.add_argument("--vocab", type=int, default=50304 if on_accel else 259)
    p.add_argument("--batch", type=int, default=8 if on_accel else 2)
    p.add_argument("--prompt-len", type=int, default=512 if on_accel else 64)
    p.add_argument("--new-tokens", type=int, default=256 if on_accel else 32)
    p.add_argument("--dtype", default="bfloat16" if on_accel else "float32")
    p.add_argument("--impl", default="auto", help="attention_impl: auto, xla or pallas")
    p.add_argument("--iters", type=int, default=5 if on_accel else 2)
    p.add_argument("--markdown", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (one from the prefill, one decode step)")
    rows = run(args)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
