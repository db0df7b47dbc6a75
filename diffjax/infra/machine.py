"""What a number was measured on: the CPU (model and vector extensions), the cap XLA:CPU was given
on them, the accelerator, and the jax/jaxlib versions.

Runs are deterministic on one machine, but XLA:CPU compiles for the vector instructions of the
CPU it runs on (AVX-512, AVX2, FMA or not), and a different instruction set rounds the same
float32 math differently in the last bits, which a few hundred steps of training amplify into
the fourth decimal of a loss. So every published number records its machine
(``benchmarks/published.json``, ``report.md``), and ``benchmarks/reproduce.py`` says whether a
differing value comes from a different machine. ``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` (or
``AVX``, ``SSE4_2``) makes this machine compile as an older one would: that is how
docs/results.md measures the spread across machines.
"""

from __future__ import annotations

import os
import platform
import re

# the extensions XLA:CPU's code generation picks between, oldest first (as /proc/cpuinfo names
# them); an ARM CPU lists none of these and says so by its model
VECTOR_EXTENSIONS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "neon",
    "asimd",
    "sve",
)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what :mod:`platform` says)."""
    for line in _cpuinfo().splitlines():
        if line.lower().startswith(("model name", "hardware", "cpu model")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def vector_extensions() -> tuple[str, ...]:
    """The vector extensions of :data:`VECTOR_EXTENSIONS` this CPU has (``/proc/cpuinfo``'s
    flags; empty where the system does not list them)."""
    for line in _cpuinfo().splitlines():
        if line.lower().startswith(("flags", "features")):
            have = set(line.split(":", 1)[1].split())
            return tuple(x for x in VECTOR_EXTENSIONS if x in have)
    return ()


def xla_cpu_isa_cap() -> str | None:
    """The instruction-set cap given to XLA:CPU (``--xla_cpu_max_isa`` in ``XLA_FLAGS``), or
    None: it compiles for every extension the CPU has."""
    m = re.search(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return m.group(1) if m else None


def describe() -> dict[str, str | list[str] | None]:
    """This machine as a record: ``cpu``, ``vector_extensions``, ``xla_cpu_max_isa``,
    ``device`` (the first device's kind and platform), ``jax``, ``jaxlib``."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "cpu": cpu_model(),
        "vector_extensions": list(vector_extensions()),
        "xla_cpu_max_isa": xla_cpu_isa_cap(),
        "device": f"{jax.device_count()} x {device.device_kind} ({device.platform})",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }


def summary(record: dict | None = None) -> str:
    """One line: ``AMD EPYC (sse4_2 avx avx2 fma avx512f ...), 1 x cpu (cpu), jax 0.10.2,
    jaxlib 0.10.2`` (with the XLA:CPU cap where one is set)."""
    r = describe() if record is None else record
    ext = " ".join(r.get("vector_extensions") or []) or "extensions not listed"
    cap = f", XLA:CPU capped at {r['xla_cpu_max_isa']}" if r.get("xla_cpu_max_isa") else ""
    return f"{r['cpu']} ({ext}){cap}, {r['device']}, jax {r['jax']}, jaxlib {r['jaxlib']}"


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two :func:`describe` records that can move a number (the CPU, its
    extensions, the XLA:CPU cap, the device, jax, jaxlib), as ``"key: a -> b"``."""
    keys = ("cpu", "vector_extensions", "xla_cpu_max_isa", "device", "jax", "jaxlib")
    return [f"{k}: {a.get(k)} -> {b.get(k)}" for k in keys if a.get(k) != b.get(k)]


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read(1 << 16)  # the first CPU's block is enough
    except OSError:
        return ""
