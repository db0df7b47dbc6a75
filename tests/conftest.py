"""The whole suite runs on 8 CPU devices (``JAX_NUM_CPU_DEVICES=8``, set before JAX starts),
so the sharded paths (meshes, global batches, Pallas under ``shard_map``) are the ones tested.
Set ``JAX_NUM_CPU_DEVICES`` yourself to run it on another count."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
