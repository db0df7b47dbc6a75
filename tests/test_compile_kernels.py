"""The Pallas kernels compile for real GPUs and TPUs (deviceless AOT, no accelerator needed).

Runs ``benchmarks/compile_kernels.py`` on small shapes for every target and case: every
default configuration must compile, without register spills on GPUs, and the GPU kernels must
issue no more tensor-core work per visible pair than the one-pass count, except where a known
duplication is listed (``KNOWN_EXTRA``, explained in docs/kernels.md; a regression past it
fails, and so does an improvement, so that the list and the doc stay true).

Needs the ``compile`` extra (the CUDA PJRT plugin, ptxas, libdevice and libtpu), in this
interpreter or in the one ``$DIFFJAX_COMPILE_PYTHON`` names (``.ci/run`` makes that venv, so CI
runs every test here). Without it each backend's test is skipped, saying which compiler is
missing; with ``$DIFFJAX_COMPILE_PYTHON`` set, a missing compiler is a failure.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
compile_kernels = importlib.import_module("compile_kernels")

WHY = compile_kernels.available()
REQUIRED = bool(os.environ.get(compile_kernels.PYTHON_ENV))  # CI: must run, not skip
CASES = list(compile_kernels.CASES)

# (target, case, kernel role) -> MACs issued per visible pair and head where the compiled
# kernel issues more than the one-pass count (docs/kernels.md says why for each).
KNOWN_EXTRA = {
    ("h100", "v1_d128", "dq"): 1280,  # one-pass 768: 8 warps, the score tile in both
    ("h100", "v2_d128", "dkv"): 896,  # one-pass 768
    ("a100", "v1_d128", "dq"): 1280,  # one-pass 768
    ("a100", "v2_d128", "dq"): 1024,  # one-pass 640
    ("l4", "v1_d128", "dq"): 1280,  # one-pass 768
    ("l4", "v2_d128", "dq"): 1024,  # one-pass 640
}


def _skip_unless(backend: str):
    why = WHY[backend]
    if why is not None and REQUIRED:
        pytest.fail(f"{backend} compile check cannot run: {why}")
    if why is not None:
        pytest.skip(f"{backend} compile check: {why}")


def _compile(target: str, seq: int) -> list[dict]:
    rows = compile_kernels.run([target], CASES, seq=seq)
    assert {r["case"] for r in rows} == set(CASES), rows
    failed = [r for r in rows if r.get("error")]
    assert not failed, failed
    assert {(r["case"], r["role"]) for r in rows} == {
        (c, k) for c in CASES for k in ("fwd", "dkv", "dq")}, rows
    return rows


@pytest.mark.parametrize("target", list(compile_kernels.GPU_TARGETS))
def test_gpu_defaults_compile_without_spills_and_without_new_duplicated_work(target):
    _skip_unless("gpu")
    for r in _compile(target, seq=256):
        where = (target, r["case"], r["role"])
        assert r["regs"] is not None and r["spill"] == 0, r
        assert r["wgmma"] + r["mma_sync"] > 0, r  # the dots run on tensor cores
        if target == "h100" and r["role"] != "dkv":
            assert r["wgmma"] > 0, r  # Hopper's warpgroup MMA, not the older mma.sync
        ideal = compile_kernels.CASES[r["case"]].macs_per_pair()[r["role"]]
        assert r["macs_per_pair"] == KNOWN_EXTRA.get(where, ideal), (where, ideal, r)


@pytest.mark.parametrize("target", list(compile_kernels.TPU_TARGETS))
def test_tpu_defaults_compile(target):
    _skip_unless("tpu")
    for r in _compile(target, seq=512):
        assert r["vmem_estimate"] is not None, r
