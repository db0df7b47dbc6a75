"""The Pallas kernels compile for real GPUs and TPUs (deviceless AOT, no accelerator needed).

Runs ``benchmarks/compile_kernels.py`` on small shapes for every target and case: every
default configuration must compile, without register spills on GPUs; every GPU kernel must
issue exactly the one-pass tensor-core work per visible pair (no dot computed twice), and on
Hopper with its warpgroup MMA, except the one kernel docs/kernels.md explains.

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

# the compilers' own optimisation levels; one xdist worker runs every test that starts the
# compile venv's jax (libtpu lets one process at a time hold its lock file)
pytestmark = [pytest.mark.usefixtures("optimizing_compiler"), pytest.mark.xdist_group("compile")]
WHY = compile_kernels.available()
REQUIRED = bool(os.environ.get(compile_kernels.PYTHON_ENV))  # CI: must run, not skip
CASES = list(compile_kernels.CASES)

# Hopper kernels that still issue some mma.sync (the older, synchronous MMA): V1's dK/dV at
# d=128, Dv=256, whose accumulators need two warpgroups, so it stays query-major and its dots
# with the 32-query block as rows cannot use wgmma (docs/kernels.md).
MMA_SYNC_ON_HOPPER = {("v1_d128", "dkv")}


def _skip_unless(backend: str):
    why = WHY[backend]
    if why is not None and REQUIRED:
        pytest.fail(f"{backend} compile check cannot run: {why}")
    if why is not None:
        pytest.skip(f"{backend} compile check: {why}")


def _compile(target: str, seq: int, dtype: str = "bfloat16") -> list[dict]:
    rows = compile_kernels.run([target], CASES, seq=seq, dtype=dtype)
    assert {r["case"] for r in rows} == set(CASES), rows
    failed = [r for r in rows if r.get("error")]
    assert not failed, failed
    assert {(r["case"], r["role"]) for r in rows} == {
        (c, k) for c in CASES for k in ("fwd", "dkv", "dq")
    }, rows
    return rows


@pytest.mark.parametrize("target", list(compile_kernels.GPU_TARGETS))
def test_gpu_defaults_compile_without_spills_and_issue_one_pass_work(target):
    _skip_unless("gpu")
    for r in _compile(target, seq=256):
        assert r["regs"] is not None and r["spill"] == 0, r
        assert r["wgmma"] + r["mma_sync"] > 0, r  # the dots run on tensor cores
        if target == "h100":  # Hopper's warpgroup MMA, not the older mma.sync
            assert r["wgmma"] > 0, r
            assert (r["mma_sync"] > 0) == ((r["case"], r["role"]) in MMA_SYNC_ON_HOPPER), r
        ideal = compile_kernels.CASES[r["case"]].macs_per_pair()[r["role"]]
        assert r["macs_per_pair"] == ideal, (ideal, r)


@pytest.mark.parametrize("target", list(compile_kernels.GPU_TARGETS))
def test_gpu_float32_defaults_fit_in_shared_memory(target):
    """float32 inputs take twice the shared memory of bf16: the default tiles for them still fit
    every target (an H200 refused V1's float32 dK/dV at d=128 with the bf16 tiles)."""
    _skip_unless("gpu")
    for r in _compile(target, seq=128, dtype="float32"):
        assert r["smem"] is not None, r


@pytest.mark.parametrize("target", list(compile_kernels.TPU_TARGETS))
def test_tpu_defaults_compile(target):
    _skip_unless("tpu")
    for r in _compile(target, seq=512):
        assert r["vmem_estimate"] is not None, r
