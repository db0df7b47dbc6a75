"""benchmarks/sharding_memory.py: its per-device bytes against counts computed here from the
config (parameter counts, Adam's state, the parameters no mesh axis splits)."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffjax.nn.param_count import count_params
from diffjax.train.config import load_config
from diffjax.train.optimizer import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_125M = os.path.join(ROOT, "configs", "diff_125m.py")
CONFIG_DEFAULT = os.path.join(ROOT, "configs", "default.py")
MESHES = ("data=8", "fsdp=8", "fsdp=4 x tensor=2", "fsdp=2 x tensor=4")


def _load():
    path = os.path.join(ROOT, "benchmarks", "sharding_memory.py")
    spec = importlib.util.spec_from_file_location("sharding_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load()


@pytest.fixture(scope="module")
def rows_125m(bench):
    assert jax.device_count() == 8  # tests/conftest.py
    return bench.report(CONFIG_125M, 8)


def _row(rows, model, mesh):
    (row,) = [r for r in rows if r["model"] == model and r["mesh"] == mesh]
    return row


def _optimizer_scalar_bytes(train_cfg) -> int:
    """Bytes of the optimizer state's scalars (step counts), from the optimizer itself: its
    state for a one-vector model is mu, nu (the vector's shape) and scalars."""
    state = make_optimizer(train_cfg).init({"w": jnp.zeros((3,), jnp.float32)})
    leaves = jax.tree.leaves(state)
    vectors = [x for x in leaves if x.ndim]
    assert len(vectors) == 2 and all(x.shape == (3,) for x in vectors)  # Adam's mu and nu only
    return sum(np.dtype(x.dtype).itemsize for x in leaves if not x.ndim)


def _replicated_values(model_cfg) -> int:
    """Values no mesh axis splits: the RMSNorm scales (two per block and the final one) and,
    for DIFF V1, the four lambda vectors (head width d) and the sub-layer norm (2d) per layer."""
    n = (2 * model_cfg.num_layers + 1) * model_cfg.d_model
    if model_cfg.attention == "diff_v1":
        d = model_cfg.d_model // (2 * model_cfg.num_heads)
        n += model_cfg.num_layers * (4 * d + 2 * d)
    return n


def test_unsharded_bytes_are_count_params_times_dtype(rows_125m):
    exp = load_config(CONFIG_125M)
    scalars = _optimizer_scalar_bytes(exp.train)
    assert scalars == 8  # two int32 counts: Adam's and the learning-rate schedule's
    for label, model_cfg in exp.models.items():
        count = count_params(model_cfg).total
        params = count * np.dtype(model_cfg.param_dtype).itemsize
        assert params == count * 4  # float32 parameters
        for mesh in MESHES:
            r = _row(rows_125m, label, mesh)
            assert r["params"] == count
            assert r["unsharded_params_bytes"] == params
            assert r["unsharded_opt_state_bytes"] == 2 * params + scalars
            assert r["unsharded_total_bytes"] == 3 * params + scalars


def test_pure_data_parallelism_replicates_everything(rows_125m):
    for label in ("diff", "standard"):
        r = _row(rows_125m, label, "data=8")
        assert r["params_bytes"] == r["unsharded_params_bytes"]
        assert r["opt_state_bytes"] == r["unsharded_opt_state_bytes"]
        assert r["ratio"] == 1.0


@pytest.mark.parametrize("mesh", ["fsdp=8", "fsdp=4 x tensor=2", "fsdp=2 x tensor=4"])
def test_sharded_bytes_are_one_eighth_plus_the_replicated(rows_125m, mesh):
    exp = load_config(CONFIG_125M)
    for label, model_cfg in exp.models.items():
        r = _row(rows_125m, label, mesh)
        if mesh == "fsdp=2 x tensor=4" and label == "diff":
            continue  # refused (6 DIFF heads), see the next test
        assert r["skipped"] is None
        total = r["unsharded_params_bytes"]
        replicated = _replicated_values(model_cfg) * 4
        assert r["replicated_bytes"] == replicated
        assert r["params_bytes"] <= total / 8 + replicated
        # every other parameter divides 8 ways here (vocab 50304, d_model 768, heads, 2048 MLP
        # units), so the bound is exact
        assert r["params_bytes"] == (total - replicated) // 8 + replicated
        # Adam's mu and nu are sharded like the parameters; the two int32 counts are replicated
        assert r["opt_state_bytes"] == 2 * r["params_bytes"] + 8
        assert r["total_bytes"] == r["params_bytes"] + r["opt_state_bytes"]
        assert r["ratio"] == pytest.approx(r["total_bytes"] / r["unsharded_total_bytes"])
        assert 1 / 8 < r["ratio"] < 1 / 8 * 1.01


def test_tensor_that_splits_diff_pairs_is_skipped_with_the_reason(rows_125m):
    diff = _row(rows_125m, "diff", "fsdp=2 x tensor=4")
    assert diff["skipped"] and "mesh.tensor=4" in diff["skipped"] and "DIFF pair" in diff["skipped"]
    assert diff["params_bytes"] is None and diff["ratio"] is None
    assert _row(rows_125m, "standard", "fsdp=2 x tensor=4")["skipped"] is None  # 12 heads


def test_replicated_list_names_norms_and_lambdas(rows_125m):
    diff = {g["name"]: g for g in _row(rows_125m, "diff", "fsdp=4 x tensor=2")["replicated"]}
    # configs/diff_125m.py scans its layers: one stacked array per name ("layers.<name>")
    assert set(diff) == {
        "layers.attn_norm.scale",
        "layers.ffn_norm.scale",
        "norm.scale",
        "layers.attn.subln.scale",
        "layers.attn.lambda_q1",
        "layers.attn.lambda_k1",
        "layers.attn.lambda_q2",
        "layers.attn.lambda_k2",
    }
    assert all(g["copies"] == 8 for g in diff.values())
    assert diff["layers.attn.lambda_q1"]["leaves"] == 1
    twin = {g["name"] for g in _row(rows_125m, "standard", "fsdp=8")["replicated"]}
    assert twin == {"layers.attn_norm.scale", "layers.ffn_norm.scale", "norm.scale"}


def test_other_device_count_uses_abstract_meshes_and_says_so(bench):
    """JAX runs with 8 devices here; asking for 4 cannot change that, so the meshes are abstract,
    the rows carry a note, and the numbers are those of 4 devices. The default config's 259-entry
    vocabulary does not divide over tensor: split over fsdp only, 2 copies."""
    rows = bench.report(CONFIG_DEFAULT, 4)
    assert rows[0]["note"] and "JAX_NUM_CPU_DEVICES=4" in rows[0]["note"]
    assert [r["mesh"] for r in rows if r["model"] == "diff"] == [
        "data=4",
        "fsdp=4",
        "fsdp=2 x tensor=2",
    ]
    exp = load_config(CONFIG_DEFAULT)
    cfg = exp.model
    r = _row(rows, "diff", "fsdp=4")
    replicated = _replicated_values(cfg) * 4
    assert r["params_bytes"] == (r["unsharded_params_bytes"] - replicated) // 4 + replicated
    groups = {g["name"]: g for g in _row(rows, "diff", "fsdp=2 x tensor=2")["replicated"]}
    emb = groups["embed.embedding"]
    assert emb["copies"] == 2 and emb["bytes"] == cfg.vocab_size * cfg.d_model * 4


def test_main_prints_the_table(bench, capsys):
    # the default config (small, fast): 2 DIFF heads, so tensor=4 is skipped as for the 125M
    assert bench.main(["--config", CONFIG_DEFAULT]) == 0
    out = capsys.readouterr().out
    for mesh in ("none (1 device)",) + MESHES:
        assert mesh in out
    assert "params MiB" in out and "ratio" in out
    assert "skipped: mesh.tensor=4" in out
    assert "lambda_q1" in out and "replicated on every device" in out
    assert "note:" not in out  # 8 devices asked, 8 there


def test_script_sets_the_device_count_before_jax_starts():
    """Run as a script, it sets JAX_NUM_CPU_DEVICES itself: real meshes of 2 devices, no note."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "sharding_memory.py"),
            "--config",
            CONFIG_DEFAULT,
            "--devices",
            "2",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "2 devices" in out.stdout and "fsdp=2 " in out.stdout
    assert "note:" not in out.stdout
