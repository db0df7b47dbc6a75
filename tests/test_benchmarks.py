"""The benchmark scripts run on CPU (tiny sizes) and print their tables."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_benchmark_runs_on_cpu(capsys, tmp_path):
    bench = _load("attention")
    md = tmp_path / "table.md"
    assert bench.main(["--seq-lens", "32", "--iters", "1", "--peak-n", "64", "--heads", "1",
                       "--head-dim", "16", "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "skipped: fused" in out  # says what it cannot run here
    for variant in ("xla", "two-call", "twin jax.nn"):
        assert f"    32 {variant}" in out
    assert "| 32 | xla |" in md.read_text()
    # the FLOP count is the reference page's: 6d MACs per visible pair per V1 head
    assert bench.visible_pairs(4, True) == 10 and bench.visible_pairs(4, False) == 16
