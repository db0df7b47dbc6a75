"""The Pallas kernels compile for real GPUs and TPUs (deviceless AOT, no accelerator needed).

Runs ``benchmarks/compile_kernels.py`` on small shapes: every default configuration must
compile, without register spills on GPUs, and the one-warpgroup GPU kernels must issue the
one-pass tensor-core work. Needs the ``compile`` extra (the CUDA PJRT plugin and libtpu); each
backend's test is skipped, saying so, when its compiler is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
compile_kernels = importlib.import_module("compile_kernels")

WHY = compile_kernels.available()


def _check(rows, cases):
    assert {r["case"] for r in rows} == set(cases), rows
    failed = [r for r in rows if r.get("error")]
    assert not failed, failed
    return rows


@pytest.mark.skipif(WHY["gpu"] is not None, reason=f"GPU compile check: {WHY['gpu']}")
def test_gpu_defaults_compile_without_spills_and_issue_one_pass_work():
    cases = ["v1_d64", "v2_d128"]
    rows = _check(compile_kernels.run(["h100"], cases, seq=256), cases)
    assert len(rows) == 6, rows  # forward, dK/dV and dQ of each case
    for r in rows:
        assert r["regs"] is not None and r["spill"] == 0, r
        assert r["wgmma"] + r["mma_sync"] > 0, r  # the dots run on tensor cores
        ideal = compile_kernels.CASES[r["case"]].macs_per_pair()[r["role"]]
        if r["role"] in ("fwd", "dq"):  # one warpgroup at these widths: no duplicated dots
            assert r["threads"] == 128 and r["macs_per_pair"] == ideal, r


@pytest.mark.skipif(WHY["tpu"] is not None, reason=f"TPU compile check: {WHY['tpu']}")
def test_tpu_defaults_compile():
    cases = ["v1_d64", "v2_d128"]
    rows = _check(compile_kernels.run(["v5e"], cases, seq=512), cases)
    assert {r["role"] for r in rows} == {"fwd", "dkv", "dq"}, rows
