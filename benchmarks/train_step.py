"""The train step of a config's DIFF V1, DIFF V2 and their twin, per attention implementation:
step time, tokens/s, MFU, DIFF/twin ratio and memory, on this device.

    python benchmarks/train_step.py                                    # configs/diff_125m.py
    python benchmarks/train_step.py --impls pallas cudnn auto --batch 16 --steps 10
    python benchmarks/train_step.py --markdown out.md --json out.json
    python benchmarks/train_step.py --tiny --impls xla cudnn           # a CPU rehearsal

The models: the config's model (DIFF V1 in ``configs/diff_125m.py``: 6 heads of 2 x 64), DIFF V2
with twice its heads (12 output heads over 24 query heads of 64: the V2 shape of the same width)
and their twin (``diffjax.twin``: 12 heads of 64, the same for both). Each is compiled by the
training loop's own ``compile_steps`` (the loop's shardings, donation and compiler options) on
one device's mesh, then timed on the same batches: ``--batch`` sequences of the config's
``data.seq_len`` tokens holding documents of ``--doc-len`` tokens on average (lengths drawn
from a seeded geometric law), kept apart by segment ids as a run keeps them
(``--no-documents``: one stream). ``auto`` runs what ``attention_impl="auto"`` picks here (the
row says what). MFU is the model FLOPs (``diffjax.infra.flops``) over the device's bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import jax
import numpy as np

from diffjax import ModelConfig, twin
from diffjax.infra import sharding
from diffjax.infra import flops as flops_lib
from diffjax.data import DataConfig, carries_documents
from diffjax.infra.runtime import Runtime
from diffjax.train import recorder
from diffjax.train import setup as setup_lib
from diffjax.train import step as step_lib
from diffjax.train.config import load_config

TINY = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=2, max_seq_len=128)


def models(cfg: ModelConfig) -> dict[str, ModelConfig]:
    """DIFF V1 (the config's), DIFF V2 with twice its heads, and their twin."""
    v1 = dataclasses.replace(cfg, attention="diff_v1")
    v2 = dataclasses.replace(cfg, attention="diff_v2", num_heads=2 * cfg.num_heads)
    assert twin(v1) == twin(v2), (twin(v1), twin(v2))  # one twin for both
    return {"DIFF V1": v1, "DIFF V2": v2, "twin": twin(v1)}


def documents(rng, rows: int, seq: int, mean: int) -> tuple[np.ndarray, np.ndarray]:
    """``(segment_ids, positions)`` ``[rows, seq]``: documents of geometric lengths (mean
    ``mean`` tokens) packed into each row, positions restarting at each."""
    seg = np.zeros((rows, seq), np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        t, doc = 0, 0
        while t < seq:
            n = min(int(rng.geometric(1.0 / mean)), seq - t)
            seg[r, t : t + n], pos[r, t : t + n] = doc, np.arange(n)
            t, doc = t + n, doc + 1
    return seg, pos


def batch(rng, data: DataConfig, runtime: Runtime, rows: int, vocab: int, mean: int) -> dict:
    tokens = rng.integers(0, vocab, (rows, data.seq_len + 1)).astype(np.int32)
    host = dict(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:],
        weights=np.ones((rows, data.seq_len), np.float32),
    )
    names = step_lib.step_inputs(data, runtime)
    if "segment_ids" in names:
        host["segment_ids"], host["positions"] = documents(rng, rows, data.seq_len, mean)
    return step_lib.model_inputs(host, runtime, rows)


def time_model(exp, cfg: ModelConfig, impl: str, args, mesh) -> dict:
    cfg = dataclasses.replace(cfg, attention_impl=impl)
    runtime = setup_lib.run_runtime(exp, cfg, mesh)
    tcfg = dataclasses.replace(exp.train, batch_size=args.batch, grad_accum_steps=1)
    chosen, why = runtime.attention.describe()
    row = dict(impl=impl, ran=chosen, why=why)
    rng = np.random.default_rng(0)
    with runtime.activate():
        setup = setup_lib.model_setup(cfg, tcfg, runtime)
        state, rest = setup.fresh_state()
        batches = [
            batch(rng, exp.data, runtime, args.batch, cfg.vocab_size, args.doc_len)
            for _ in range(2)
        ]
        t0 = time.perf_counter()
        step, _ = setup_lib.compile_steps(setup, state, rest, batches[0])
        row["compile_s"] = time.perf_counter() - t0
        memory = recorder.memory_estimate(step)
        for i in range(2):  # warm-up
            state, m = step(state, batches[i % 2])
        jax.block_until_ready(m)
        times = []
        for i in range(args.steps):
            t = time.perf_counter()
            state, m = step(state, batches[i % 2])
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    tokens = args.batch * exp.data.seq_len
    tflops = flops_lib.train_flops_per_token(cfg, exp.data.seq_len) * tokens / step_s / 1e12
    peak = flops_lib.peak_tflops(jax.devices()[0].device_kind, exp.train.peak_tflops)
    row.update(
        step_ms=step_s * 1e3,
        tokens_per_s=tokens / step_s,
        tflops=tflops,
        mfu=None if not peak else tflops / peak,
        memory_gib=None if memory is None else memory / 2**30,
        loss=float(m["loss"]),
    )
    return row


def run(args) -> tuple[list[dict], dict]:
    exp = load_config(args.config)
    model = dataclasses.replace(exp.model, **TINY) if args.tiny else exp.model
    # the batches are made here; the data config says only whether they keep documents apart
    seq = args.seq or (128 if args.tiny else exp.data.seq_len)
    data = DataConfig(source="stdlib", seq_len=seq, document_mask=not args.no_documents)
    exp = dataclasses.replace(exp, model=model, data=data, mesh=sharding.MeshConfig(data=1))
    mesh = jax.make_mesh((1, 1, 1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)  # fmt: skip
    env = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        date=datetime.date.today().isoformat(),
        config=args.config,
        seq_len=data.seq_len,
        batch=args.batch,
        documents=args.doc_len if carries_documents(data) else None,
        dtype=model.dtype,
    )
    print(
        f"device: {env['device']}, JAX {env['jax']}; {args.config}: seq {data.seq_len}, batch "
        f"{args.batch}, {model.dtype}, documents "
        f"{'of ~%d tokens apart' % args.doc_len if carries_documents(data) else 'not kept apart'}"
    )
    rows = []
    for impl in args.impls:
        for label, cfg in models(model).items():
            try:
                row = dict(model=label, **time_model(exp, cfg, impl, args, mesh))
            except Exception as e:  # noqa: BLE001 - e.g. an implementation refused here
                row = dict(model=label, impl=impl, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows, env


def _format_row(r: dict) -> str:
    head = f"{r['model']:<8} {r['impl']:<7}"
    if "error" in r:
        return f"{head} {r['error']}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    mem = "-" if r["memory_gib"] is None else f"{r['memory_gib']:.2f} GiB"
    return (
        f"{head} ran {r['ran']:<7} step {r['step_ms']:9.2f} ms  {r['tokens_per_s']:>11,.0f} tok/s  "
        f"{r['tflops']:7.1f} TFLOP/s  MFU {mfu:>6}  memory {mem}  compile {r['compile_s']:.1f} s"
    )


def ratios(rows: list[dict]) -> list[str]:
    """DIFF / twin step-time ratios per implementation (target <= 1.06), and MFU (>= 40%)."""
    lines = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        got = {r["model"]: r for r in rows if r["impl"] == impl and "error" not in r}
        base = got.get("twin")
        for label in ("DIFF V1", "DIFF V2"):
            if base and label in got:
                ratio = got[label]["step_ms"] / base["step_ms"]
                verdict = "meets" if ratio <= 1.06 else "misses"
                lines.append(f"{impl}: {label} / twin step time {ratio:.3f}x ({verdict} <= 1.06)")
        for label, r in got.items():
            if r["mfu"] is not None:
                verdict = "meets" if r["mfu"] >= 0.40 else "misses"
                lines.append(f"{impl}: {label} MFU {100 * r['mfu']:.1f}% ({verdict} >= 40%)")
    return lines


def to_markdown(rows: list[dict], env: dict) -> str:
    lines = [
        f"{env['device']}, jax {env['jax']}, {env['date']}; {env['config']}: seq {env['seq_len']}, "
        f"batch {env['batch']}, {env['dtype']}, documents "
        f"{'of ~%s tokens apart' % env['documents'] if env['documents'] else 'not kept apart'}",
        "",
        "| model | impl | ran | step ms | tokens/s | TFLOP/s | MFU | memory GiB | compile s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['impl']} | {r['error']} | | | | | | |")
            continue
        mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "" if r["memory_gib"] is None else f"{r['memory_gib']:.2f}"
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['ran']} | {r['step_ms']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | {mem} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines + ["", *[f"- {x}" for x in ratios(rows)]])


def main(argv=None) -> int:
    on_accel = jax.default_backend() in ("gpu", "tpu")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/diff_125m.py")
    p.add_argument("--impls", nargs="+", default=["pallas", "cudnn"] if on_accel else ["xla"])
    p.add_argument("--batch", type=int, default=16 if on_accel else 2)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the config's)")
    p.add_argument("--steps", type=int, default=10 if on_accel else 2)
    p.add_argument("--doc-len", type=int, default=1024, help="mean document length, tokens")
    p.add_argument("--no-documents", action="store_true", help="one stream, no segment ids")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the config (rehearsal)")
    p.add_argument("--markdown", help="also write the table to this markdown file")
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    rows, env = run(args)
    for line in ratios(rows):
        print(line)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(rows, env) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
