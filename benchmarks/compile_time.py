"""Compile time against depth: the train step of 4, 8, 16 and 32 layers, scanned and unrolled.

    python benchmarks/compile_time.py                       # DIFF V1, d_model 256, CPU
    python benchmarks/compile_time.py --layers 4,8 --attention diff_v2 --remat full

For each depth it builds the abstract train state of the model (nothing is allocated), then
lowers and compiles the real train step (:func:`diffjax.train.step.train_step`: forward,
backward, AdamW update) once with ``model.scan_layers=false`` (a Python loop over the blocks:
XLA sees L copies) and once with ``scan_layers=true`` (one block inside a scan), and prints the
seconds of each (tracing plus lowering, and XLA's compile). The scanned column should stay
nearly flat with depth; the unrolled one grows about linearly.

Compile time is a property of the compiler on this machine, not of the accelerator: the
figures come from the backend JAX runs on (CPU here), with the XLA path for attention.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from diffjax import ModelConfig
from diffjax.nn.model import initial_rest
from diffjax.infra.runtime import Runtime
from diffjax.infra.sharding import MeshConfig, make_mesh
from diffjax.train import TrainConfig
from diffjax.train.setup import model_setup
from diffjax.train.step import train_step


def compile_seconds(cfg: ModelConfig, batch: int, seq: int) -> tuple[float, float]:
    """``(trace + lower seconds, compile seconds)`` of the train step of ``cfg``."""
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    setup = model_setup(cfg, TrainConfig(), Runtime(mesh))
    rest = initial_rest(cfg)
    step = functools.partial(
        train_step, graphdef=setup.graphdef, rest=rest, tx=setup.tx, schedule=setup.schedule
    )
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    inputs = {
        "inputs": tokens,
        "targets": tokens,
        "weights": jax.ShapeDtypeStruct(tokens.shape, jnp.float32),
    }
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(setup.abstract, inputs)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,8,16,32", help="comma-separated depths")
    ap.add_argument("--attention", default="diff_v1", choices=("diff_v1", "diff_v2", "standard"))
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--remat", default="none", help="model.remat for both layouts")
    args = ap.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",")]
    print(
        f"train step compile time, {args.attention}, d_model {args.d_model}, {args.heads} heads, "
        f"batch {args.batch} x {args.seq}, remat {args.remat}, jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}",
        flush=True,
    )
    print(f"{'layers':>6}  {'unrolled s (trace+lower / compile)':>36}  {'scanned s':>24}")
    for n in depths:
        row = []
        for scan in (False, True):
            cfg = ModelConfig(
                attention=args.attention,
                d_model=args.d_model,
                num_heads=args.heads,
                num_layers=n,
                max_seq_len=args.seq,
                attention_impl="xla",
                scan_layers=scan,
                remat=args.remat,
            )
            lower, comp = compile_seconds(cfg, args.batch, args.seq)
            row.append(f"{lower + comp:7.1f} ({lower:5.1f} / {comp:5.1f})")
        print(f"{n:>6}  {row[0]:>36}  {row[1]:>24}", flush=True)


if __name__ == "__main__":
    main()
