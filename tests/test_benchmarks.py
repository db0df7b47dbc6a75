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


def test_decode_benchmark_runs_on_cpu(capsys, tmp_path):
    bench = _load("decode")
    md = tmp_path / "table.md"
    assert bench.main(["--d-model", "32", "--layers", "1", "--heads", "1", "--batch", "2",
                       "--prompt-len", "8", "--new-tokens", "4", "--iters", "1",
                       "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for model in ("diff_v1", "diff_v2", "twin"):
        assert model in lines and lines[model].rstrip().endswith("yes")  # cached == naive tokens
    # d_model 32, h = 1: V1 caches K1, K2 (16 each) and V (32), the twin 2 heads x 16 x (K + V)
    assert " 256 " in lines["diff_v1"] and " 256 " in lines["twin"] and " 256 " in lines["diff_v2"]
    assert "| diff_v2 |" in md.read_text()
