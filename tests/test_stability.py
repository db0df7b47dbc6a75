"""Keeping a run alive: the spike test and the optimizer wrapper that skips a spiking step's
update (on made-up values), a planted spike skipped in training with the parameters unchanged by
its batch, an injected NaN rolled back to the last good checkpoint, and the settings refused."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from diffjax.train import loop

from diffjax.train import step as step_lib
from diffjax.train.metrics import read_metrics
from diffjax.train.optimizer import skip_spikes, spike_test

from test_train import run_main

NAN = float("nan")


# ---------------------------------------------------------------------------- the spike test
def test_a_spike_is_a_multiple_of_the_window_median_once_the_window_is_full():
    history = jnp.asarray([[2.0, 2.2, 1.8, 2.0], [1.0, 1.0, 1.0, 1.0]])
    assert not spike_test(history, jnp.asarray([5.9, 1.0]), 3.0)  # 2.0 * 3 = 6 not passed
    assert spike_test(history, jnp.asarray([6.1, 1.0]), 3.0)  # the loss
    assert spike_test(history, jnp.asarray([2.0, 3.1]), 3.0)  # the gradient norm
    assert spike_test(history, jnp.asarray([NAN, 1.0]), 3.0)  # never finite: always skipped
    assert spike_test(history, jnp.asarray([2.0, jnp.inf]), 3.0)
    filling = history.at[:, 0].set(NAN)
    assert not spike_test(filling, jnp.asarray([100.0, 100.0]), 3.0)  # not full yet
    assert spike_test(filling, jnp.asarray([NAN, 1.0]), 3.0)


def _steps(tx, params, values, grads):
    """Run ``tx`` over made-up (loss, gradient) pairs: each step's params and whether it
    skipped."""
    state = tx.init(params)
    out = []
    for value, g in zip(values, grads):
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params, value=jnp.float32(value))
        params = optax.apply_updates(params, updates)
        out.append((params, state))
    return out


def test_a_skipped_step_leaves_parameters_and_optimizer_state_as_they_were():
    inner = optax.adam(0.1)
    tx = skip_spikes(inner, factor=3.0, window=4)
    params = {"w": jnp.ones(3)}
    values = [2.0, 2.1, 1.9, 2.0, 50.0, 2.0, NAN, 2.0]
    grads = [np.full(3, 0.1)] * 4 + [np.full(3, 0.1)] + [np.full(3, 0.1)] + [np.full(3, NAN)]
    grads += [np.full(3, 0.1)]
    out = _steps(tx, params, values, grads)
    skipped = [bool(s.last_skipped) for _, s in out]
    assert skipped == [False, False, False, False, True, False, True, False]
    assert [int(s.skipped) for _, s in out] == [0, 0, 0, 0, 1, 1, 2, 2]
    for i in (4, 6):  # exactly the previous step's parameters and Adam state
        before, after = out[i - 1], out[i]
        np.testing.assert_array_equal(before[0]["w"], after[0]["w"])
        for a, b in zip(
            jax.tree.leaves(before[1].inner_state), jax.tree.leaves(after[1].inner_state)
        ):
            np.testing.assert_array_equal(a, b)
    # the steps not skipped are plain Adam's, on the same gradients in the same order
    plain = optax.adam(0.1)
    p, s = params, plain.init(params)
    for i, g in enumerate(grads):
        if not skipped[i]:
            u, s = plain.update({"w": jnp.asarray(g)}, s, p)
            p = optax.apply_updates(p, u)
    np.testing.assert_array_equal(p["w"], out[-1][0]["w"])
    # the NaN never entered the window; the 50 did (a median shrugs it off)
    np.testing.assert_array_equal(out[-1][1].history[0], [2.0, 50.0, 2.0, 2.0])


def test_a_lasting_change_of_level_stops_being_skipped_after_half_a_window():
    tx = skip_spikes(optax.sgd(0.1), factor=2.0, window=4)
    values = [1.0] * 4 + [5.0] * 6
    out = _steps(tx, {"w": jnp.zeros(1)}, values, [np.zeros(1)] * len(values))
    assert [bool(s.last_skipped) for _, s in out] == [False] * 4 + [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


# ---------------------------------------------------------------------------- in training
PLANTED = 6  # the batch (1-based, in reading order) planted with a spike or a NaN


@pytest.fixture
def planted(monkeypatch):
    """The training loss times ``factor`` on one planted batch: the loader doubles that
    batch's weights (which leaves the true loss as it is) and the patched loss multiplies the
    sum of any batch whose weights pass 1 by ``factor``. Yields a setter for the factor."""
    factor = {"value": 1e3}
    read = {"n": 0}
    original_batch, original_ce = loop._Steps.batch, step_lib.weighted_cross_entropy

    def batch(self):
        b, wait = original_batch(self)
        read["n"] += 1
        if read["n"] == PLANTED:
            b = {**b, "weights": b["weights"] * 2}
        return b, wait

    def ce(logits, targets, weights):
        total, weight = original_ce(logits, targets, weights)
        return total * jnp.where(jnp.max(weights) > 1.5, factor["value"], 1.0), weight

    monkeypatch.setattr(loop._Steps, "batch", batch)
    monkeypatch.setattr(step_lib, "weighted_cross_entropy", ce)
    return lambda value: factor.update(value=value)


def _state_at(ckpt_dir, step):
    with ocp.CheckpointManager(str(ckpt_dir)) as m:
        return m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


COMMON = ("compare.twins=", "train.steps=10", "train.tensorboard=false", "train.warmup_steps=0")


@pytest.mark.parametrize("accum", [1, 2])
def test_a_planted_spike_is_skipped_and_training_goes_on(tmp_path, planted, accum):
    args = (*COMMON, "train.skip_spikes=3", "train.spike_window=4", "train.checkpoint_every=1")
    # over the 8 devices' data shards (each splits its own rows into the microbatches)
    args += ("train.keep_checkpoints=10", f"train.grad_accum_steps={accum}")
    args += (f"train.batch_size={8 * accum}",)
    assert run_main(tmp_path, *args) == 0
    run = tmp_path / "run" / "diff" / "seed_0"
    records = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["skipped"] for r in records] == [i == PLANTED for i in range(1, 11)]
    assert records[PLANTED - 1]["loss"] > 100 and records[-1]["spikes_skipped"] == 1
    assert all(np.isfinite(r["loss"]) and r["loss"] < 10 for r in records if not r["skipped"])
    before, at, after = (_state_at(run / "checkpoints", s) for s in (PLANTED - 1, PLANTED, 10))
    same = jax.tree.map(np.array_equal, before["params"], at["params"])
    assert all(jax.tree.leaves(same))  # the planted batch changed nothing
    adam = [jax.tree.leaves(s["opt_state"]["inner_state"]) for s in (before, at)]
    assert all(np.array_equal(a, b) for a, b in zip(*adam))  # Adam's moments and count too
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, at["params"], after["params"])))
    result = __import__("json").loads((run / "result.json").read_text())
    assert result["spikes_skipped"] == 1


def test_an_injected_nan_rolls_back_to_the_last_good_checkpoint_and_goes_on(
    tmp_path, planted, capsys
):
    planted(float("nan"))
    args = (*COMMON, "train.on_nan=rollback", "train.checkpoint_every=4", "train.eval_every=4")
    assert run_main(tmp_path, *args) == 0
    out = capsys.readouterr().out
    assert f"the loss is nan at step {PLANTED}: rolled back to the checkpoint at step 4" in out
    run = tmp_path / "run" / "diff" / "seed_0"
    records = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 11))  # the lost steps trained again
    assert all(np.isfinite(r["loss"]) for r in records)
    assert [r.get("rollbacks", 0) for r in records] == [0] * 4 + [1] * 6
    result = __import__("json").loads((run / "result.json").read_text())
    assert result["rollbacks"] == 1 and result["steps"] == 10


def test_nan_retries_are_bounded(tmp_path, planted, capsys):
    planted(float("nan"))
    args = (*COMMON, "train.on_nan=rollback", "train.nan_retries=0", "train.checkpoint_every=4")
    assert run_main(tmp_path, *args) == 3
    assert f"the training loss is nan at step {PLANTED}" in capsys.readouterr().err


def test_turning_spike_skipping_on_at_a_resume_is_refused(tmp_path, capsys):
    assert run_main(tmp_path, "compare.twins=", "train.steps=2") == 0
    args = ("compare.twins=", "train.steps=4", "train.skip_spikes=3")
    assert run_main(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert "train.skip_spikes: the checkpoint" in err and "spike skipping off" in err
    assert sorted(os.listdir(tmp_path / "run" / "diff" / "seed_0" / "checkpoints")) == ["2"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ("train.skip_spikes=0.5", r"skip_spikes: must be 0 \(off\) or a multiple > 1"),
        ("train.spike_window=1", r"spike_window: must be >= 2"),
        ("train.on_nan=retry", r"on_nan: unknown setting 'retry'"),
        ("train.nan_retries=-1", r"nan_retries: must be >= 0"),
    ],
)
def test_bad_stability_settings_are_refused_before_training(tmp_path, capsys, extra, message):
    import re

    assert run_main(tmp_path, "train.steps=2", extra) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Fix:" in err, err
