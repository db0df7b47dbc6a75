"""Gradient accumulation (``train.grad_accum_steps``): the step over k microbatches, scanned
inside the one compiled train step, equals the step over the whole batch (float32, 1e-6
relative) for DIFF V1, V2 and standard attention, with uneven (answer-only style) weights, on
one device and sharded; a run with it resumes exactly; bad values are refused before any
compute."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from diffjax.infra import sharding
from diffjax.compare.cli import main
from diffjax.config import ConfigError, ModelConfig
from diffjax.infra.sharding import MeshConfig
from diffjax.train import TrainConfig
from diffjax.infra.runtime import Runtime
from diffjax.train.step import accumulated_loss_and_grads, loss_fn, model_inputs, train_step
from diffjax.train.setup import check_grad_accum, compile_steps, model_setup
from diffjax.train.metrics import read_metrics
from tiny import tiny_run

BATCH, SEQ = 8, 16
RTOL = 1e-6

MODELS = {
    "diff_v1": ModelConfig(
        attention="diff_v1", vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=32
    ),
    "diff_v2": ModelConfig(
        attention="diff_v2", vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=32
    ),
    "standard": ModelConfig(
        attention="standard", vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_seq_len=32
    ),
}


def make_batch(weights: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (BATCH, SEQ + 1)).astype(np.int32)
    if weights == "documents":  # documents kept apart: segments, restarting positions
        from diffjax.data.documents import mark_documents

        rows = [mark_documents(SEQ, rng.choice(np.arange(1, SEQ + 1), 3)) for _ in range(BATCH)]
        marks = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], **marks}
    if weights == "uniform":
        w = np.ones((BATCH, SEQ), np.float32)
    else:  # answer-only style: a few weighted tokens, unevenly spread, some rows none at all
        w = np.zeros((BATCH, SEQ), np.float32)
        w[0, 3:12] = 1.0
        w[1, -2:] = 1.0
        w[5, 7] = 1.0
        w[6, 1:4] = 1.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": w}


def tcfg(k: int) -> TrainConfig:
    return TrainConfig(
        batch_size=BATCH, grad_accum_steps=k, lr=1e-2, warmup_steps=0, schedule="constant"
    )


def assert_close(a, b, rtol=RTOL):
    """Leaf by leaf: ``|a - b| <= rtol * max |b|`` (relative to the leaf's scale, so entries
    that are zero up to rounding do not count as large relative errors)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.max(np.abs(y))), 1e-30) if y.size else 1.0
        np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale)


def assert_grads_close(a, b, rtol=RTOL):
    """The gradient trees agree to ``rtol`` relative to the whole gradient: in norm, and every
    entry within ``rtol`` times the largest entry. (Leaf by leaf, a DIFF lambda's gradient is a
    sum of terms that nearly cancel: merely reordering the batch rows moves it by ~1e-5 of
    itself in float32, with or without accumulation.)"""
    x = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(a)])
    y = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(b)])
    assert np.linalg.norm(x - y) <= rtol * np.linalg.norm(y)
    np.testing.assert_allclose(x, y, rtol=0, atol=rtol * np.max(np.abs(y)))


@functools.cache
def compiled_step(model: str, k: int):
    """The state, and one jitted function of ``(state, batch)`` returning the loss, aux and
    gradients with ``k`` microbatches, and the state after one :func:`train_step` with them
    (SGD, lr 1), on one device."""
    cfg = MODELS[model]
    mesh = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        setup = model_setup(cfg, tcfg(k), Runtime(mesh))
        state, rest = setup.fresh_state()
    tx = optax.sgd(1.0)
    state = {**state, "opt_state": tx.init(state["params"])}
    model = dict(graphdef=setup.graphdef, rest=rest)

    def fn(state, batch):
        if k == 1:
            grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, **model)
        else:
            grads = accumulated_loss_and_grads(state["params"], batch, accum_steps=k, **model)
        new = train_step(state, batch, tx=tx, schedule=lambda s: 1.0, accum_steps=k, **model)
        return grads, new

    return state, jax.jit(fn), mesh


def run_step(model: str, k: int, weights: str):
    state, fn, mesh = compiled_step(model, k)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        ((loss, aux), grads), (new, metrics) = fn(
            state, model_inputs(make_batch(weights), Runtime(mesh), BATCH)
        )
    assert float(metrics["loss"]) == float(loss)
    return jax.device_get((loss, aux["lambda"], grads, new["params"], metrics))


def _accum_cases():
    """k = 2 for every model with uniform weights, answer-only weights and k = 4 on V1; the
    other combinations with -m exhaustive."""
    for k in (2, 4):
        for model in MODELS:
            for weights in ("uniform", "answer_only", "documents"):
                default = (k == 2 and weights == "uniform") or model == "diff_v1"
                marks = () if default else (pytest.mark.exhaustive,)
                yield pytest.param(k, model, weights, marks=marks, id=f"{k}-{model}-{weights}")


@pytest.mark.parametrize("k, model, weights", list(_accum_cases()))
def test_accumulated_step_equals_the_whole_batch_step(model, k, weights):
    loss1, lam1, grads1, params1, metrics1 = run_step(model, 1, weights)
    loss, lam, grads, params, metrics = run_step(model, k, weights)
    np.testing.assert_allclose(loss, loss1, rtol=RTOL)
    np.testing.assert_allclose(metrics["grad_norm"], metrics1["grad_norm"], rtol=RTOL)
    np.testing.assert_allclose(lam, lam1, rtol=RTOL)
    np.testing.assert_allclose(metrics["lambda"], metrics1["lambda"], rtol=RTOL)
    assert lam1.shape == ((0,) if model == "standard" else (1,))
    assert_grads_close(grads, grads1)
    assert_close(params, params1)  # SGD with lr 1: params - gradient


def adamw_step(model: str, k: int, mesh):
    """The loop's compiled AdamW step (compile_steps) on ``mesh``: loss, grad norm and the
    parameter update. Adam's eps is 1 and weight decay 0, so the first update is ~``-lr * g``
    (with the default eps it is ~``-lr * sign(g)``, which turns rounding in a near-zero
    gradient into a whole ``lr``)."""
    cfg = MODELS[model]
    t = dataclasses.replace(tcfg(k), eps=1.0, weight_decay=0.0)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        setup = model_setup(cfg, t, Runtime(mesh))
        state, rest = setup.fresh_state()
        before = jax.tree.map(np.asarray, state["params"])
        batch = model_inputs(make_batch("answer_only"), Runtime(mesh), BATCH)
        train_fn, _ = compile_steps(setup, state, rest, batch)
        new, metrics = train_fn(state, batch)  # the state is donated
        # the step's output is placed like its input: the microbatches never gathered the state
        assert (
            jax.tree.leaves(new["params"])[0].sharding
            == jax.tree.leaves(setup.state_sh["params"])[0]
        )
        return (
            float(metrics["loss"]),
            float(metrics["grad_norm"]),
            jax.tree.map(lambda p, q: np.asarray(p, np.float64) - q, new["params"], before),
        )


@pytest.mark.parametrize("model", ["diff_v1", "standard"])
def test_accumulated_step_sharded_equals_unsharded_whole_batch(model):
    """data=2 x fsdp=2 x tensor=2 (each data shard holds 2 rows: 2 microbatches of one row
    each) equals the single-device step without accumulation. (The meshes split float32 sums
    differently: 1e-5.)"""
    one = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    loss1, norm1, update1 = adamw_step(model, 1, one)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    loss, norm, update = adamw_step(model, 2, mesh)
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    np.testing.assert_allclose(norm, norm1, rtol=1e-5)
    assert_grads_close(update, update1, rtol=1e-5)


def test_compiled_step_keeps_microbatches_on_their_shards():
    """On data=8 with 2 microbatches the compiled step moves no batch rows between devices:
    no all-to-all or all-gather of the inputs, only the gradient all-reduce."""
    mesh = sharding.make_mesh(MeshConfig(data=8))
    cfg = dataclasses.replace(MODELS["standard"])
    t = dataclasses.replace(tcfg(2), batch_size=16)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        setup = model_setup(cfg, t, Runtime(mesh))
        state, rest = setup.fresh_state()
        rows = {k: np.concatenate([v, v]) for k, v in make_batch("uniform").items()}
        batch = model_inputs(rows, Runtime(mesh), 16)
        train_fn, _ = compile_steps(setup, state, rest, batch)
    text = train_fn.as_text()
    assert "all-to-all" not in text
    assert "all-gather" not in text  # data parallelism: parameters replicated, rows local


# ---------------------------------------------------------------------------- the loop
TINY = tiny_run(
    "model.num_heads=2",
    "train.eval_batches=2",
    "compare.twins=",
    "train.grad_accum_steps=2",
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "train.peak_tflops=1.5",
)


def test_accumulating_run_resumes_exactly(tmp_path, capsys):
    """A run with 2 microbatches a step, sharded over 8 devices: 6 steps straight equal 3 steps
    then 3 more resumed from the step-3 checkpoint, bit for bit."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([f"run.dir={straight}", *TINY, "train.steps=6", "train.schedule=constant"]) == 0
    assert main([f"run.dir={split}", *TINY, "train.steps=3", "train.schedule=constant"]) == 0
    assert main([f"run.dir={split}", *TINY, "train.steps=6", "train.schedule=constant"]) == 0
    assert "resuming from the checkpoint at step 3" in capsys.readouterr().out
    a = read_metrics(str(straight / "diff" / "seed_0" / "metrics.jsonl"))
    b = read_metrics(str(split / "diff" / "seed_0" / "metrics.jsonl"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # the model FLOPs of each step per device, and the MFU against train.peak_tflops
    assert all(r["tflops_per_device"] > 0 and r["mfu"] > 0 for r in a)
    result = json.loads((straight / "diff" / "seed_0" / "result.json").read_text())
    assert result["tflops_per_device"] > 0
    assert result["mfu"] == pytest.approx(result["tflops_per_device"] / 1.5)


# ---------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "k, message",
    [
        (0, r"TrainConfig.grad_accum_steps: must be >= 1"),
        (3, r"grad_accum_steps: 3 microbatches cannot split train.batch_size=8.*\[1, 2, 4, 8\]"),
    ],
)
def test_bad_grad_accum_steps_are_refused_by_the_config(k, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(batch_size=8, grad_accum_steps=k)


def test_grad_accum_steps_must_divide_each_data_shards_rows(tmp_path, capsys):
    """batch 8 on data=4 is 2 rows per shard: 4 microbatches cannot split them; refused with
    the valid values, before config.json is written or anything is compiled."""
    mesh = sharding.make_mesh(MeshConfig(data=4, tensor=2))
    with pytest.raises(ConfigError, match=r"train.grad_accum_steps=4 .* Fix: .*\[1, 2\]"):
        check_grad_accum(tcfg(4), mesh)
    check_grad_accum(tcfg(2), mesh)
    run = tmp_path / "run"
    args = [a for a in TINY if not a.startswith("mesh.")] + ["mesh.data=4", "mesh.tensor=2"]
    assert main([f"run.dir={run}", *args, "train.grad_accum_steps=4", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "train.grad_accum_steps=4" in err and "[1, 2]" in err
    assert not (run / "config.json").exists()


def test_peak_tflops_must_be_positive():
    with pytest.raises(ConfigError, match=r"TrainConfig.peak_tflops: must be > 0"):
        TrainConfig(peak_tflops=0.0)
    assert TrainConfig(peak_tflops=989.0).peak_tflops == 989.0
