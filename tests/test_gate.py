"""Gated attention's output gate (``model.gate``, Qiu et al. 2025) on every attention kind: each
head's output times ``sigmoid(x W_gate)`` before ``out_proj``, against numpy; the same model
under the fused kernels (interpreted) and over a ``context`` axis (the ring); its parameters
named, counted and sharded; a Hugging Face export and a retrofit of a gated model refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import ModelConfig, TransformerLM
from diffjax.config import ConfigError
from diffjax.nn.attention import MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2

D, B, T = 32, 2, 8
LAYERS = {  # kind: (layer class, its constructor's head arguments, a head's output width)
    "standard": (MultiheadAttention, dict(num_heads=4, num_kv_heads=2), 8),
    "diff_v1": (MultiheadDiffAttn, dict(num_heads=2, num_kv_heads=1), 16),
    "diff_v2": (MultiheadDiffAttnV2, dict(num_heads=2), 16),
}


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_the_gate_scales_each_heads_output_by_a_sigmoid_of_the_layer_input(kind, gate):
    """With ``out_proj`` the identity, the ungated layer gives the heads' outputs (V1: after its
    per-head norm); the gated layer with the same weights gives them times ``sigmoid(x
    W_gate)``, one value per head or per channel, computed here in numpy."""
    cls, heads, width = LAYERS[kind]
    gated = cls(D, 1, **heads, gate=gate, attention_impl="xla", rngs=nnx.Rngs(0))
    plain = cls(D, 1, **heads, attention_impl="xla", rngs=nnx.Rngs(0))
    shared = nnx.to_pure_dict(nnx.state(gated))
    shared.pop("gate_proj")
    state = nnx.state(plain)
    nnx.replace_by_pure_dict(state, shared)
    nnx.update(plain, state)  # the same weights but the gate
    for layer in (gated, plain):
        layer.out_proj.kernel[...] = jnp.eye(D)  # the heads, concatenated
    x = np.asarray(jax.random.normal(jax.random.key(1), (B, T, D)), np.float32)
    heads_out = np.asarray(plain(jnp.asarray(x))).reshape(B, T, -1, width)
    h = heads_out.shape[2]
    assert gated.gate_proj.kernel.shape == (D, h if gate == "headwise" else h * width)
    g = _sigmoid(x @ np.asarray(gated.gate_proj.kernel[...], np.float32))
    g = g.reshape(B, T, h, 1 if gate == "headwise" else width)
    expected = (heads_out * g).reshape(B, T, D)
    np.testing.assert_allclose(np.asarray(gated(jnp.asarray(x))), expected, atol=2e-6, rtol=2e-5)
    assert plain.gate_proj is None


def test_the_gate_is_initialised_as_the_query_projection():
    """The released code computes the gate as extra columns of ``q_proj``: the same init."""
    cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=2, gate="elementwise")
    cfg = cfg.replace(init_std=0.05)
    kernel = np.asarray(TransformerLM(cfg, rngs=nnx.Rngs(0)).layers[0].attn.gate_proj.kernel[...])
    assert kernel.shape == (64, 64) and abs(kernel.std() - 0.05) < 0.005


CONFIG = dict(vocab_size=61, d_model=32, num_layers=2, max_seq_len=32)
GATED = {
    "standard": dict(attention="standard", num_heads=4, gate="headwise"),
    "diff_v1": dict(attention="diff_v1", num_heads=2, num_kv_heads=1, gate="elementwise"),
    "diff_v2": dict(attention="diff_v2", num_heads=2, gate="headwise"),
}


@pytest.mark.parametrize("kind", list(GATED))
def test_a_gated_model_runs_alike_on_the_fused_kernels_and_over_a_context_axis(kind):
    """The gate sits outside the attention call, so every implementation runs it: the Pallas
    kernels (interpreted) and the ring over 4 devices of a ``context`` axis give the XLA
    path's logits."""
    from diffjax.infra import sharding
    from diffjax.infra.runtime import Runtime
    from diffjax.nn.model import for_runtime

    cfg = ModelConfig(**CONFIG, **GATED[kind], attention_impl="xla")
    model = TransformerLM(cfg, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(4), (B, 16), 0, 61)
    ref = np.asarray(model(tokens))
    fused = TransformerLM(cfg.replace(attention_impl="pallas"), rngs=nnx.Rngs(3))
    np.testing.assert_allclose(np.asarray(fused(tokens)), ref, atol=1e-4, rtol=1e-4)
    mesh_cfg = sharding.MeshConfig(data=1, context=4, context_order="contiguous")
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:4])
    ring = for_runtime(model, Runtime.of(cfg, mesh_cfg, mesh))
    with jax.set_mesh(mesh):
        out = np.asarray(jax.jit(lambda t: ring(t))(tokens))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_the_gates_parameters_are_counted_and_sharded_by_head():
    cfg = ModelConfig(**CONFIG, **GATED["diff_v2"])
    counts = diffjax.count_params(cfg)
    assert counts.parts["attn.gate"] == 2 * 32 * 2  # layers x d_model x heads
    assert counts.total == diffjax.count_params(cfg.replace(gate="none")).total + 128
    table = diffjax.compare_params(cfg)
    assert "| attn.gate | 128 | 128 | +0 |" in table  # the standard twin keeps the gate
    model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
    from diffjax.infra.sharding import logical_axes

    assert logical_axes(model.layers[0].attn.gate_proj.kernel) == ("embed", "heads")


def test_a_gated_model_is_refused_where_it_has_no_exact_form(tmp_path):
    """No Hugging Face format has an attention output gate, and a retrofit does not carry one
    over: both refuse before writing anything, naming model.gate."""
    from diffjax.interop.conversion import retrofit_config

    cfg = ModelConfig(**CONFIG, **GATED["diff_v1"])
    with pytest.raises(Exception, match=r"ModelConfig.gate='elementwise'.*Fix:.*model.gate=none"):
        diffjax.save_pretrained(TransformerLM(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError, match=r"model.gate='headwise'.*Fix: retrofit a model"):
        retrofit_config(ModelConfig(**CONFIG, **GATED["standard"]), "diff_v2")
    with pytest.raises(ConfigError, match=r"ModelConfig.gate: unknown gate 'sparse'"):
        ModelConfig(**CONFIG, attention="standard", num_heads=4, gate="sparse")


def test_a_gated_comparison_trains_checkpoints_and_loads(tmp_path):
    """``model.gate=elementwise`` through ``train.py``: DIFF and its standard twin both gated,
    trained, checkpointed and loaded back with their gates."""
    from diffjax.compare.cli import main
    from diffjax.train import load_model
    from tiny import tiny_run

    run = tmp_path / "run"
    assert main([f"run.dir={run}", *tiny_run("train.steps=3", "model.gate=elementwise")]) == 0
    for label in ("diff", "standard"):
        model = load_model(str(run / label / "seed_0"))
        assert model.config.gate == "elementwise", label
        kernel = np.asarray(model.layers[0].attn.gate_proj.kernel[...])
        assert kernel.shape == (32, 32) and np.isfinite(kernel).all()


def test_the_comparison_takes_a_list_of_twins():
    """``compare.twins=standard,gated``: DIFF, its standard twin and that twin with the gate
    (``compare.twin_gate``), in that order; a twin named twice, or a gated twin that the
    model's own gate already makes the standard one, is refused."""
    from diffjax.compare import default_comparison
    from diffjax.train import apply_overrides

    exp = apply_overrides(default_comparison(), ["compare.twins=standard,gated"])
    models = exp.models
    assert list(models) == ["diff", "standard", "gated"]
    assert models["gated"] == models["standard"].replace(gate="elementwise")
    alone = apply_overrides(exp, ["compare.twins=gated", "compare.twin_gate=headwise"]).models
    assert list(alone) == ["diff", "gated"] and alone["gated"].gate == "headwise"
    with pytest.raises(ConfigError, match=r"compare.twins: names a twin twice"):
        apply_overrides(exp, ["compare.twins=gated,gated"])
    with pytest.raises(ConfigError, match=r"already gives the standard twin that gate"):
        apply_overrides(exp, ["model.gate=elementwise"])


def test_diff_against_two_twins_trains_three_models_and_reports_each_pair(tmp_path):
    """Three models on the same batches from the same init seeds; report.md gives every model's
    column, DIFF minus each twin with its interval, a sentence block and a curve per twin, the
    side-by-side timing per pair and how the gated twin is matched (its extra parameters); the
    quick evaluation's sections give DIFF minus each twin, its sinks and massive activations
    cover all three."""
    from diffjax.compare.cli import main
    from diffjax.train.metrics import read_metrics
    from tiny import tiny_run

    run = tmp_path / "run"
    argv = tiny_run(
        "train.steps=4",
        "train.eval_every=2",
        "compare.twins=standard,gated",
        "compare.seeds=2",
        "compare.throughput_rounds=1",
        "compare.quick_eval=true",
    )
    assert main([f"run.dir={run}", *argv]) == 0
    tokens = {
        label: [r["tokens"] for r in read_metrics(str(run / label / "seed_1" / "metrics.jsonl"))]
        for label in ("diff", "standard", "gated")
    }
    assert tokens["diff"] == tokens["standard"] == tokens["gated"]
    report = (run / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| | diff"))
    assert header.endswith(
        "| gated (standard, elementwise gate) | DIFF − twin [95% CI] | DIFF − gated [95% CI] |"
    ), header
    assert "**DIFF against its twin:**" in report and "**DIFF against the gated twin:**" in report
    assert "**DIFF − twin over training**" in report and "**DIFF − gated over training**" in report
    assert report.count("**Throughput, measured side by side:** diff throughput is") == 2
    extra = 32 * 32  # one layer: D -> 1 head x 32 channels
    assert f"{extra:,} parameters more than the twin" in report
    assert (run / "loss.png").exists()
    # the evaluation measures sinks and massive activations of every model, DIFF beside each twin
    evaluation = (run / "eval.md").read_text()
    sinks = evaluation[evaluation.index("## 7. Attention sinks and massive activations") :]
    header = sinks.splitlines()[2]
    for name in ("diff (diff_v1)", "standard (standard)", "gated (standard, elementwise gate)"):
        assert f"{name}: first token" in header and f"{name}: max / median" in header, header
    assert "the gated twin" in sinks and (run / "eval_sinks.png").exists()
    # every section's DIFF-minus-twin line comes for each twin
    assert "validation loss (nats), DIFF minus the twin:" in evaluation
    assert "validation loss (nats), DIFF minus the gated twin:" in evaluation
