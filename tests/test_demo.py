"""The entry point `python train.py` (the demo) run as a user would, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffjax import ModelConfig, count_params, twin

REPO = Path(__file__).resolve().parents[1]


def run_train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    # Faster XLA:CPU compiles (LLVM -O0); the tiny demo's run time is negligible either way.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# One run (about 8 s: imports, two models, two compiles). train.py's code path does not depend
# on the attention kind; V2's validation is covered by the bad-config test below, and
# ("diff_v2", 1, 8, ["--num-heads", "4", "--num-kv-heads", "2"], (4, 2, 16), (4, 2, 16)) can be
# added here when time allows.
@pytest.mark.parametrize("attention, layers, seq, extra, heads, twin_heads", [
    ("diff_v1", 2, 32, [], (4, 4, 8), (8, 8, 8)),
])
def test_demo_runs(attention, layers, seq, extra, heads, twin_heads):
    proc = run_train("--attention", attention, "--d-model", "64", "--num-layers", str(layers),
                     "--seq-len", str(seq), *extra)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr

    config = ModelConfig(attention=attention, d_model=64, num_layers=layers, max_seq_len=seq,
                         num_heads=heads[0], num_kv_heads=heads[1] if extra else None)
    assert config.resolved_head_dim == heads[2]
    # Both configs are described.
    h, hkv, d = heads
    th, thkv, td = twin_heads
    assert re.search(rf"DIFF: {attention}, d_model=64, layers={layers}, heads={h}, "
                     rf"kv_heads={hkv}, head_dim={d}", out), out
    assert re.search(rf"twin: standard, d_model=64, layers={layers}, heads={th}, "
                     rf"kv_heads={thkv}, head_dim={td}", out), out

    # Both parameter counts, as count_params computes them, in the table's total row.
    a, b = count_params(config).total, count_params(twin(config)).total
    assert a > b
    assert f"| **total** | **{a:,}** | **{b:,}** | **{a - b:+,}** |" in out, out
    assert "| part |" in out and "attn.lambda" in out

    # Both forward passes, with logits [2, seq, vocab] float32 and a finite loss near ln V.
    lines = [l for l in out.splitlines() if "logits (" in l]
    assert len(lines) == 2, out
    assert lines[0].strip().startswith("DIFF:") and lines[1].strip().startswith("twin:")
    for line in lines:
        assert f"logits (2, {seq}, {config.vocab_size}) float32" in line, line
        loss = float(re.search(r"loss at init ([0-9.]+)", line).group(1))
        assert abs(loss - 5.5568) < 0.5, line  # ln 259
    if attention == "diff_v1":
        lam = re.search(r"lambda per layer: (.*)$", lines[0]).group(1).split()
        assert len(lam) == layers  # one per layer


@pytest.mark.parametrize("args, field, words", [
    (["--d-model", "64", "--num-heads", "3"], "ModelConfig.d_model", ["2*num_heads"]),
    (["--attention", "diff_v2", "--d-model", "96", "--num-heads", "3", "--num-kv-heads", "2"],
     "ModelConfig.num_kv_heads", ["straddle"]),
])
def test_demo_bad_config_exits_nonzero(args, field, words):
    proc = run_train(*args, "--num-layers", "1", "--seq-len", "8")
    assert proc.returncode != 0
    err = proc.stderr
    assert field in err, err
    assert "Fix:" in err, err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err, err  # a clean message, not a crash
    assert "logits" not in proc.stdout
