"""DIFF's signals from the step (``train.diagnostics``): each one equals the same quantity
computed outside the step from the model's own pieces with numpy (the attention logits' maximum
through the XLA path and the interpreted kernels, unrolled and scanned layers, with gradient
accumulation); with diagnostics off the step is today's (bit-identical losses, no extra
outputs); the records, TensorBoard and the report carry them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax.infra import sharding
from diffjax.config import ModelConfig
from diffjax.nn.model import TransformerLM
from diffjax.infra.runtime import Runtime
from diffjax.infra.sharding import MeshConfig
from diffjax.train import TrainConfig
from diffjax.train.step import loss_fn, model_inputs, train_step
from diffjax.train.setup import model_setup
from diffjax.train.metrics import scalars

BATCH, SEQ, VOCAB = 4, 16, 64


def config(kind: str, **extra) -> ModelConfig:
    heads = {"standard": 4, "diff_v1": 2, "diff_v2": 2}[kind]
    return ModelConfig(
        attention=kind,
        vocab_size=VOCAB,
        d_model=32,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=heads // 2,  # GQA: the maps must read the right key heads
        max_seq_len=32,
        **extra,
    )


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    segments = np.ones((BATCH, SEQ), np.int32)
    segments[1, 9:] = 2  # two documents in one row: no logit across them
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((BATCH, SEQ), np.float32),
        "segment_ids": segments,
    }


def mesh():
    return sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])


@functools.cache
def step(cfg: ModelConfig, diagnostics: bool, accum: int = 1):
    """The fresh state and one jitted train step (AdamW) of ``cfg``; its model built with or
    without diagnostics."""
    tcfg = TrainConfig(
        batch_size=BATCH, lr=1e-2, warmup_steps=0, diagnostics=diagnostics, grad_accum_steps=accum
    )
    with jax.set_mesh(mesh()), nnx.logical_axis_rules(sharding.current_rules()):
        setup = model_setup(cfg, tcfg, Runtime(mesh()))
        state, rest = setup.fresh_state()
    fn = functools.partial(
        train_step,
        graphdef=setup.graphdef,
        rest=rest,
        tx=setup.tx,
        schedule=setup.schedule,
        accum_steps=accum,
    )
    return state, rest, setup, jax.jit(fn)


def run(cfg, diagnostics, accum=1):
    state, rest, setup, fn = step(cfg, diagnostics, accum)
    state = jax.tree.map(jnp.copy, state)
    with jax.set_mesh(mesh()), nnx.logical_axis_rules(sharding.current_rules()):
        new, metrics = fn(state, model_inputs(batch(), Runtime(mesh()), BATCH))
    run.last_params = jax.device_get(new["params"])
    return jax.device_get(metrics), state, rest, setup


# ---------------------------------------------------------------------------- outside the step
def visible_max(q, k, scale, segments) -> float:
    """numpy: the largest ``q . k * scale`` over every row's visible keys (causal, same
    segment), query head h reading key head h // (H / Hkv)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    t = np.arange(q.shape[1])
    visible = (t[None, :] <= t[:, None])[None] & (segments[:, :, None] == segments[:, None, :])
    return float(np.max(np.where(visible[:, None], s, -np.inf)))


def outside(cfg: ModelConfig, state, rest, tx) -> dict:
    """Every diagnostic of the step, from the model's pieces: each block's attention inputs
    (``project``) and output, the logits, and the AdamW update of the gradient."""
    model = nnx.merge(nnx.graphdef(TransformerLM(cfg, rngs=nnx.Rngs(0))), state["params"], rest)
    b = batch()
    x = model._embed(jnp.asarray(b["inputs"]))
    signals = {"logit_max": [], "activation_max": [], "lambda_std": []}
    for block in model.blocks():
        h = block.attn_norm(x)
        p = block.attn.project(h)
        maps = [(p.q, p.k)] + ([(p.q2, p.k if p.k2 is None else p.k2)] if p.q2 is not None else [])
        scale = block.attn.scale
        signals["logit_max"].append([visible_max(q, k, scale, b["segment_ids"]) for q, k in maps])
        if cfg.attention == "diff_v2":
            signals["lambda_std"].append(float(np.std(np.asarray(p.lam, np.float64))))
        x = block(x, segment_ids=jnp.asarray(b["segment_ids"]))
        signals["activation_max"].append(float(np.max(np.abs(np.asarray(x)))))
    logits = model(jnp.asarray(b["inputs"]), segment_ids=jnp.asarray(b["segment_ids"]))
    signals["output_logit_max"] = float(np.max(np.abs(np.asarray(logits))))
    graphdef = nnx.graphdef(TransformerLM(cfg, rngs=nnx.Rngs(0)))
    grads = jax.grad(lambda p: loss_fn(p, b, graphdef, rest)[0])(state["params"])
    updates, _ = tx.update(grads, state["opt_state"], state["params"], value=0.0)
    leaves = lambda t: np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(t)])  # noqa: E731
    signals["update_ratio"] = float(
        np.linalg.norm(leaves(updates)) / np.linalg.norm(leaves(state["params"]))
    )
    return {k: v for k, v in signals.items() if v != []}


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("diff_v1", {}),
        ("diff_v2", {}),
        ("standard", {}),
        ("diff_v2", {"scan_layers": True}),
        ("diff_v1", {"attention_impl": "pallas"}),  # the interpreted kernels' row maximum
        ("diff_v2", {"attention_impl": "pallas", "scan_layers": True, "remat": "full"}),
    ],
    ids=["v1", "v2", "standard", "v2-scan", "v1-kernels", "v2-kernels-scan-remat"],
)
def test_each_diagnostic_equals_the_quantity_computed_outside_the_step(kind, extra):
    cfg = config(kind, **extra)
    metrics, state, rest, setup = run(cfg, True)
    # outside, from the same parameters through the plain XLA path
    expected = outside(cfg.replace(attention_impl="xla", remat="none"), state, rest, setup.tx)
    maps = 1 if kind == "standard" else 2
    assert np.shape(metrics["logit_max"]) == (2, maps)
    assert np.shape(metrics["activation_max"]) == (2,)
    assert ("lambda_std" in metrics) == (kind == "diff_v2")
    for name, value in expected.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, err_msg=name)


def test_accumulated_diagnostics_are_the_whole_batchs():
    """Over 2 microbatches the largest values are the whole batch's and the update the same."""
    cfg = config("diff_v2")
    whole, accumulated = run(cfg, True)[0], run(cfg, True, accum=2)[0]
    for name in ("logit_max", "activation_max", "output_logit_max", "update_ratio"):
        np.testing.assert_allclose(accumulated[name], whole[name], rtol=2e-5, err_msg=name)
    # the spread of sigmoid(lambda) is the microbatches' mean spread: close to the whole one's
    np.testing.assert_allclose(accumulated["lambda_std"], whole["lambda_std"], rtol=0.2)


@pytest.mark.parametrize("kind", ["diff_v1", "standard"])
def test_with_diagnostics_off_the_step_is_todays(kind):
    """Off: no extra output, and the compiled step is the one a model built without the flag
    gives (the same HLO); on: the same loss and parameters bit for bit (the signals only read)."""
    cfg = config(kind)
    off, state, _, _ = run(cfg, False)
    params_off = run.last_params
    assert set(off) == {"loss", "grad_norm", "lr", "lambda"}
    on = run(cfg, True)[0]
    assert float(on["loss"]) == float(off["loss"])
    assert float(on["grad_norm"]) == float(off["grad_norm"])
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, run.last_params, params_off)))
    state_off, rest, setup, fn = step(cfg, False)
    b = model_inputs(batch(), Runtime(mesh()), BATCH)
    plain = functools.partial(
        train_step,
        graphdef=nnx.graphdef(TransformerLM(cfg, rngs=nnx.Rngs(0))),
        rest=rest,
        tx=setup.tx,
        schedule=setup.schedule,
    )
    with jax.set_mesh(mesh()), nnx.logical_axis_rules(sharding.current_rules()):
        assert fn.lower(state_off, b).as_text() == jax.jit(plain).lower(state_off, b).as_text()


def test_per_layer_signals_reach_tensorboard_names():
    record = {
        "step": 3,
        "loss": 1.0,
        "logit_max": [[1.0, 2.0], [3.0, 4.0]],
        "activation_max": [5.0, 6.0],
    }
    out = scalars(record)
    assert out["logit_max/layer_1/map_0"] == 3.0 and out["activation_max/layer_1"] == 6.0


def test_the_comparison_report_plots_every_signal_for_both_models(tmp_path):
    from test_train import run_main

    args = ("train.steps=4", "train.eval_every=4", "train.checkpoint_every=4")
    assert run_main(tmp_path, *args, "train.diagnostics=true", "train.skip_spikes=3") == 0
    run = tmp_path / "run"
    report = (run / "report.md").read_text()
    assert (
        "![signals during training](signals.png)" in report and (run / "signals.png").stat().st_size
    )
    table = report.split("Signals during training")[1].split("![signals")[0]
    assert "| signal | diff: largest | diff: last | standard: largest | standard: last |" in table
    for title in ("largest attention logit", "largest hidden activation", "largest output logit"):
        assert title in table
    assert "update RMS / parameter RMS" in table and "gradient norm" in table
    assert (
        "| diff (diff_v1) | 0 | 0 | 0 |" in report
        and "| standard (standard) | 0 | 0 | 0 |" in report
    )
    from diffjax.train.metrics import read_metrics

    record = read_metrics(str(run / "diff" / "seed_0" / "metrics.jsonl"))[-1]
    assert np.shape(record["logit_max"]) == (1, 2) and record["spikes_skipped"] == 0
    twin = read_metrics(str(run / "standard" / "seed_0" / "metrics.jsonl"))[-1]
    assert np.shape(twin["logit_max"]) == (1, 1)
