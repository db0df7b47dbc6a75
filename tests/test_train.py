"""Training: config keys and overrides, the optimizer's schedule and decay mask, the command line
(default comparison smoke test, report and plot), exact resume after a kill, and every bad-input
case stopping with its message before training."""

from __future__ import annotations

import dataclasses

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import diffjax
from diffjax.compare import Comparison, as_comparison, default_comparison, load_comparison
from diffjax.compare.cli import main
from diffjax.config import ConfigError
from diffjax.train import (
    ExperimentConfig,
    TrainConfig,
    apply_overrides,
    config_keys,
    decay_mask,
    default_config,
    learning_rate_schedule,
    load_config,
)
from diffjax.infra.runtime import Runtime
from diffjax.infra import machine
from diffjax.train.metrics import read_metrics
from tiny import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny experiment: seconds per model on CPU.
TINY = tiny_run("train.eval_batches=2", drop=("train.tensorboard",))


def run_main(tmp_path, *extra, name="run"):
    return main([f"run.dir={tmp_path / name}", *TINY, *extra])


def losses(path):
    return [r["loss"] for r in read_metrics(str(path / "metrics.jsonl"))]


# ---------------------------------------------------------------------------- config
def test_every_key_is_listed_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key, _, _ in config_keys(default_comparison()):
        assert key in out, key
    for key in (
        "run.dir",
        "data.path",
        "data.seq_len",
        "train.steps",
        "train.batch_size",
        "train.checkpoint_every",
        "train.eval_every",
        "model.attention",
        "model.num_layers",
        "model.d_model",
        "compare.twins",
        "compare.seeds",
    ):
        assert f"  {key} " in out


def test_help_describes_every_key_in_one_line_with_its_allowed_values(capsys):
    """Each key's line is followed by one line of description, the first sentence of its
    dataclass field's comment, and the allowed values where the key has a fixed set."""
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    described = {}
    for key, _, _ in config_keys(default_comparison()):
        i = next(n for n, line in enumerate(lines) if line.startswith(f"  {key} "))
        assert lines[i + 1].startswith("      ") and lines[i + 1].strip(), key
        assert not lines[i + 2].startswith("      "), key  # one line
        described[key] = lines[i + 1].strip()
    assert len(set(described.values())) == len(described)  # each its own
    assert described["model.attention"].endswith("one of 'standard', 'diff_v1', 'diff_v2'")
    assert "'cosine'" in described["train.schedule"] and "'mqar'" in described["data.source"]
    assert "'interpret'" in described["train.kernel_check"]
    assert described["train.batch_size"] == "global batch (sequences per step)"  # its comment
    assert described["compare.twins"].startswith("the twins trained beside the DIFF model")
    assert described["compare.twins"].endswith("one of 'standard', 'gated'")
    assert described["compare.seeds"].startswith("train each model from init seeds")
    assert all(len(d) <= 170 for d in described.values()), described


def test_python_m_diffjax_compare_is_train_py():
    """``python -m diffjax.compare`` and ``python train.py`` are one command line."""
    outs = [
        subprocess.run(
            [sys.executable, *cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        for cmd in (["-m", "diffjax.compare"], ["train.py"])
    ]
    assert [p.returncode for p in outs] == [0, 0], [p.stderr[-2000:] for p in outs]
    assert outs[0].stdout == outs[1].stdout and "config keys" in outs[0].stdout


def test_overrides_are_parsed_by_type():
    cfg = apply_overrides(
        default_comparison(),
        [
            "train.steps=7",
            "train.lr=3e-4",
            "model.attention=diff_v2",
            "compare.twins=",
            "model.num_kv_heads=none",
            "data.seq_len=64",
            "run.dir=/tmp/x",
        ],
    )
    assert cfg.train.steps == 7 and cfg.train.lr == 3e-4 and cfg.compare.twins == ()
    assert cfg.model.attention == "diff_v2" and cfg.model.num_kv_heads is None
    assert cfg.data.seq_len == 64 and cfg.run.path == "/tmp/x"
    assert set(cfg.models) == {"diff"}
    default = default_comparison()
    assert set(default.models) == {"diff", "standard"}
    assert default.models["standard"] == diffjax.twin(default.model)
    assert default.experiment() == default_config() and default.compare.seeds == 2
    assert load_comparison(None) == default
    alone = as_comparison(default.experiment())  # a plain experiment: its model alone
    assert alone.compare.twins == () and set(alone.models) == {"diff"}


@pytest.mark.parametrize(
    "old, new",
    [
        ("compare=false", "compare.twins"),
        ("twin_init_std=0.05", "compare.twin_init_std"),
        ("train.num_seeds=2", "compare.seeds"),
        ("train.throughput_rounds=0", "compare.throughput_rounds"),
        ("train.quick_eval=false", "compare.quick_eval"),
    ],
)
def test_the_comparisons_old_keys_are_refused_with_the_new_ones(old, new):
    """The comparison's settings moved out of the library's train config into the ``compare``
    section: each old spelling is refused naming the new one, and the library's one-model
    config does not know the section at all."""
    key = old.split("=")[0]
    with pytest.raises(ConfigError, match=rf"the key '{key}' has moved\. Fix: write {new}\b"):
        apply_overrides(default_comparison(), [old])
    with pytest.raises(ConfigError, match="unknown config key 'compare.seeds'"):
        apply_overrides(default_config(), ["compare.seeds=2"])
    assert not hasattr(TrainConfig(), "num_seeds") and not hasattr(default_config(), "compare")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stpes=3", r"unknown config key 'train.stpes'.*did you mean train.steps"),
        ("nonsense=3", r"unknown config key 'nonsense'"),
        ("train.steps=many", r"train.steps: bad value 'many'.*Fix: give an integer\.$"),
        ("train.lr=fast", r"train.lr: bad value 'fast'.*Fix: give a number\.$"),
        ("model.num_kv_heads=x", r"Fix: give an integer or none\.$"),
        ("data.needle.depths=a,b", r"Fix: give a comma-separated list of numbers or none\.$"),
        ("compare.quick_eval=maybe", r"quick_eval: bad value 'maybe'.*Fix: give true or false\.$"),
        (
            "compare.twins=sparse",
            r"CompareConfig.twins: unknown twin 'sparse'.*'standard', 'gated'",
        ),
        ("compare.seeds=0", r"CompareConfig.seeds: must be >= 1"),
        ("train.steps=0", r"TrainConfig.steps: must be >= 1"),
        ("train.schedule=exp", r"TrainConfig.schedule: unknown schedule 'exp'"),
        ("train.lr=-1", r"TrainConfig.lr: must be > 0"),
        ("model.num_heads=3", r"ModelConfig"),
        ("data.seq_len=4096", r"data.seq_len: 4096 is longer than the model takes"),
        ("train.steps", r"not key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(default_comparison(), [override])


def test_twin_init_std_sets_only_the_twins_init_and_is_reported(tmp_path):
    cfg = apply_overrides(default_comparison(), ["compare.twin_init_std=0.05"])
    assert cfg.models["standard"] == diffjax.twin(cfg.model).replace(init_std=0.05)
    assert cfg.models["diff"] == cfg.model and cfg.model.init_std == 0.02
    with pytest.raises(ConfigError, match="twin_init_std: is 0.05 but compare.twins is empty"):
        apply_overrides(cfg, ["compare.twins=", "model.attention=standard"])
    with pytest.raises(ConfigError, match="twin_init_std: must be > 0"):
        apply_overrides(cfg, ["compare.twin_init_std=0"])
    assert run_main(tmp_path, "train.steps=2", "compare.seeds=1", "compare.twin_init_std=0.05") == 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "init std 0.02 (DIFF) and 0.05 (twin): **not one init scale**" in report
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["compare"]["twin_init_std"] == 0.05


def test_compare_needs_a_diff_model():
    with pytest.raises(ConfigError, match="compare.twins: trains twins.*model.attention=diff_v1"):
        apply_overrides(default_comparison(), ["model.attention=standard"])
    cfg = apply_overrides(default_comparison(), ["model.attention=standard", "compare.twins="])
    assert set(cfg.models) == {"standard"}


@pytest.mark.parametrize("name", ["default", "needle", "diff_125m", "diff_350m"])
def test_config_files_load(name):
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.py"))
    assert isinstance(cfg, Comparison) and cfg.compare.twins == ("standard",)
    if name == "default":
        assert cfg == default_comparison()
    if name.startswith("diff_"):
        n = diffjax.count_params(cfg.model).total
        low, high = (110e6, 140e6) if name == "diff_125m" else (320e6, 380e6)
        assert low < n < high and low < diffjax.count_params(diffjax.twin(cfg.model)).total < high
        assert (cfg.train.b1, cfg.train.b2, cfg.train.weight_decay, cfg.train.warmup_steps) == (
            0.9,
            0.98,
            0.05,
            375,
        )


def test_missing_config_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.py")


# ---------------------------------------------------------------------------- optimizer
def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, schedule="linear", min_lr_ratio=0.1)
    s = learning_rate_schedule(cfg)
    np.testing.assert_allclose(
        [s(0), s(5), s(10), s(55), s(100)],
        [0.0, 5e-4, 1e-3, 1e-3 - 0.5 * 0.9e-3, 1e-4],
        rtol=1e-5,
        atol=1e-9,
    )
    cos = learning_rate_schedule(
        TrainConfig(steps=100, lr=1e-3, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0)
    )
    np.testing.assert_allclose(float(cos(50)), 0.5e-3, rtol=1e-5)


def test_weight_decay_skips_norms_lambdas_and_vectors():
    for attention in ("diff_v1", "diff_v2"):
        model = diffjax.TransformerLM(
            diffjax.ModelConfig(d_model=32, num_layers=1, num_heads=1, attention=attention),
            rngs=nnx.Rngs(0),
        )
        params = nnx.state(model, nnx.Param)
        mask = decay_mask(params)
        flat = {
            "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]
        }
        assert flat["embed/embedding/value"] and flat["layers/0/attn/q_proj/kernel/value"]
        assert flat["layers/0/ffn/w1/kernel/value"]
        for name, decays in flat.items():
            if "lambda" in name or "norm" in name:
                assert not decays, name
    # and the mask really reaches AdamW: a lambda parameter with zero gradient does not move
    cfg = TrainConfig(steps=10, lr=1e-1, warmup_steps=0, weight_decay=0.5, grad_clip=0)
    tx = diffjax.train.make_optimizer(cfg)
    params = {"lambda_q1": jnp.ones((4,)), "w": jnp.ones((4, 4))}
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(new["lambda_q1"], params["lambda_q1"])
    assert float(new["w"][0, 0]) < 1.0


# ---------------------------------------------------------------------------- command line
def test_comparison_smoke(tmp_path, capsys):
    assert (
        run_main(
            tmp_path,
            "train.steps=4",
            "train.eval_every=2",
            "train.checkpoint_every=2",
            "compare.seeds=1",
        )
        == 0
    )
    out = capsys.readouterr().out
    run = tmp_path / "run"
    for label in ("diff", "standard"):
        records = read_metrics(str(run / label / "seed_0" / "metrics.jsonl"))
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
        # the wait for each batch is measured and is part of the step's time
        assert all(0 <= r["data_wait"] <= r["step_time"] for r in records)
        assert "val_loss" in records[1] and "val_loss" in records[3]
        assert (run / label / "seed_0" / "checkpoints" / "4").is_dir()
        assert any(f.startswith("events") for f in os.listdir(run / label / "seed_0" / "tb"))
    assert "lambda" in read_metrics(str(run / "diff" / "seed_0" / "metrics.jsonl"))[0]
    report = (run / "report.md").read_text()
    assert "| | diff (diff_v1) | standard (standard) | DIFF − twin [95% CI] |" in report
    assert "machine: " in report and machine.summary() in report  # the CPU: numbers move with it
    assert (
        "final validation loss" in report
        and "no confidence interval can be given from one seed" in report
    )
    assert "dtype float32, init std 0.02 (both models); the twin:" in report  # init decides MQAR
    assert (run / "loss.png").stat().st_size > 10_000
    assert "| parameters |" in out
    # same data, same order, same init seed: the two models saw the same tokens
    d, s = (read_metrics(str(run / x / "seed_0" / "metrics.jsonl")) for x in ("diff", "standard"))
    assert [r["tokens"] for r in d] == [r["tokens"] for r in s]


def test_finished_run_is_not_retrained(tmp_path, capsys):
    assert run_main(tmp_path, "train.steps=2", "compare.twins=") == 0
    before = (tmp_path / "run" / "diff" / "seed_0" / "metrics.jsonl").read_text()
    assert run_main(tmp_path, "train.steps=2", "compare.twins=") == 0
    assert "resuming from the checkpoint at step 2" in capsys.readouterr().out
    assert (tmp_path / "run" / "diff" / "seed_0" / "metrics.jsonl").read_text() == before


def test_resume_from_an_earlier_checkpoint_equals_uninterrupted(tmp_path, capsys):
    """Drop the later checkpoints of a finished run and rerun it: it resumes at step 3 and the
    losses of steps 4-8 equal, bit for bit, those of the first pass."""
    import shutil

    common = ("compare.twins=", "train.steps=8", "train.eval_every=3", "train.checkpoint_every=3")
    assert run_main(tmp_path, *common) == 0
    run = tmp_path / "run" / "diff" / "seed_0"
    first = losses(run)
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "6", "8"]
    for step in ("6", "8"):
        shutil.rmtree(run / "checkpoints" / step)
    assert run_main(tmp_path, *common) == 0
    assert "resuming from the checkpoint at step 3" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(str(run / "metrics.jsonl"))] == list(range(1, 9))
    assert losses(run) == first


# train.py whose process SIGKILLs itself right after step KILL_AT (argv[1]): at a checkpoint
# step the kill lands while that step's asynchronous save may still be in flight; at any other
# step it lands after the earlier saves have committed.
KILLED_TRAIN_PY = """
import os, signal, sys
from diffjax.compare.cli import main

kill_at, checkpoint_every = int(sys.argv[1]), int(sys.argv[2])

def kill(step, checkpointer):
    if step == kill_at:
        if step % checkpoint_every:
            checkpointer.wait()  # earlier saves committed; the kill lands between checkpoints
        os.kill(os.getpid(), signal.SIGKILL)

sys.exit(main(sys.argv[3:], after_step=kill))
"""


KILLED_CONFIG = [
    *TINY,
    "compare.twins=",
    "train.tensorboard=false",  # tensorboardX imports torch: seconds per process
    "train.steps=10",
    "train.eval_every=4",
    "train.checkpoint_every=4",
    "train.skip_spikes=3",  # its running window is part of the state a resume restores
    "train.spike_window=3",
]


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
    """The losses of the uninterrupted ``train.py`` run of :data:`KILLED_CONFIG`."""
    run = tmp_path_factory.mktemp("straight")
    args = [sys.executable, os.path.join(ROOT, "train.py"), *KILLED_CONFIG, f"run.dir={run}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(args, check=True, env=env, capture_output=True)
    return losses(run / "diff" / "seed_0")


@pytest.mark.slow
@pytest.mark.xdist_group("killed")  # one worker: the uninterrupted run is made once
@pytest.mark.parametrize("kill_at", [6, 8])
def test_killed_and_resumed_run_equals_uninterrupted_bit_for_bit(
    tmp_path, kill_at, straight_losses
):
    """SIGKILL a run right after step 6 (the step-4 checkpoint committed) or right after step 8
    (its checkpoint save issued, maybe not committed), rerun it with --resume: the losses of all
    10 steps equal those of an uninterrupted run exactly."""
    config = KILLED_CONFIG
    args = [sys.executable, os.path.join(ROOT, "train.py"), *config]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    killed = tmp_path / "killed"
    out = subprocess.run(
        [sys.executable, "-c", KILLED_TRAIN_PY, str(kill_at), "4", *config, f"run.dir={killed}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert len(losses(killed / "diff" / "seed_0")) < 10  # it really was interrupted
    out = subprocess.run(
        args + [f"run.dir={killed}", "--resume"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "resuming from the checkpoint at step" in out.stdout
    a, b = straight_losses, losses(killed / "diff" / "seed_0")
    assert len(a) == len(b) == 10
    assert a == b  # bit for bit (JSON floats round-trip exactly)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.path=/no/such/dir/*.txt", "data.source=text"], r"/no/such/dir"),
        (["data.source=nope"], r"DataConfig.source"),
        (["data.seq_len=64"], r"data.seq_len: 64 is longer than the model takes"),
        (["train.batchsize=2"], r"unknown config key 'train.batchsize'"),
        (["train.steps=-1"], r"TrainConfig.steps"),
        (["model.num_layers=two"], r"model.num_layers: bad value"),
        (["train.profile_steps=2:5"], r"profile_steps: the window 2:5 is not inside .* 1:2"),
        (["train.profile_steps=1-2"], r"profile_steps: '1-2' is not START:END"),
    ],
)
def test_bad_input_stops_before_training(tmp_path, capsys, extra, message):
    import re

    assert run_main(tmp_path, "train.steps=2", *extra) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.startswith("error: ") and "Fix:" in err
    assert not (tmp_path / "run" / "diff" / "seed_0" / "metrics.jsonl").exists()


def test_empty_text_data_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert run_main(tmp_path, "data.source=text", f"data.path={tmp_path / 'empty.txt'}") == 2
    assert "empty.txt" in capsys.readouterr().err


def test_checkpoint_of_another_model_config_is_refused(tmp_path, capsys):
    assert run_main(tmp_path, "train.steps=2", "compare.twins=") == 0
    saved = sorted(os.listdir(tmp_path / "run" / "diff" / "seed_0" / "checkpoints"))
    assert run_main(tmp_path, "train.steps=4", "compare.twins=", "model.d_model=64") == 2
    err = capsys.readouterr().err
    assert "different model config" in err and "d_model: checkpoint has 32, config has 64" in err
    # nothing lost
    assert sorted(os.listdir(tmp_path / "run" / "diff" / "seed_0" / "checkpoints")) == saved


def test_resume_flag_without_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["--resume", f"run.dir={tmp_path / 'fresh'}", *TINY]) == 4
    assert "holds no checkpoint" in capsys.readouterr().err


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    # an absurd learning rate blows the weights up within a few steps
    code = run_main(
        tmp_path,
        "compare.twins=",
        "train.steps=30",
        "train.lr=1e12",
        "train.warmup_steps=0",
        "train.grad_clip=0",
        "train.checkpoint_every=1",
        "train.eval_every=1",
    )
    err = capsys.readouterr().err
    assert code == 3, err
    assert "the training loss is nan at step" in err or "the training loss is inf at step" in err
    step = int(err.split(" at step ")[1].split(";")[0])
    ckpts = sorted(
        int(x)
        for x in os.listdir(tmp_path / "run" / "diff" / "seed_0" / "checkpoints")
        if x.isdigit()
    )
    assert ckpts and max(ckpts) == step - 1
    assert f"last good checkpoint (step {step - 1})" in err


def test_corrupt_checkpoint_is_a_clear_error_and_nothing_is_deleted(tmp_path, capsys):
    assert run_main(tmp_path, "train.steps=2", "compare.twins=") == 0
    ckdir = tmp_path / "run" / "diff" / "seed_0" / "checkpoints" / "2" / "state"
    for root, _, files in os.walk(ckdir):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "r+b") as fh:
                fh.write(b"\x00garbage\x00" * 4)
    listing = sorted(os.walk(tmp_path / "run"))
    assert run_main(tmp_path, "train.steps=4", "compare.twins=") == 4
    err = capsys.readouterr().err
    assert "checkpoint at step 2" in err and "cannot be read" in err and "Fix:" in err
    assert sorted(os.walk(tmp_path / "run")) == listing


def test_half_written_checkpoint_is_ignored(tmp_path):
    """A temporary (uncommitted) checkpoint directory, as a kill mid-save leaves, is not loaded."""
    assert run_main(tmp_path, "train.steps=2", "compare.twins=") == 0
    ck = tmp_path / "run" / "diff" / "seed_0" / "checkpoints"
    (ck / "3.orbax-checkpoint-tmp-123").mkdir()
    (ck / "3.orbax-checkpoint-tmp-123" / "junk").write_text("half")
    from diffjax.train.checkpoint import committed_steps

    assert committed_steps(str(ck)) == [2]
    assert run_main(tmp_path, "train.steps=4", "compare.twins=") == 0
    records = read_metrics(str(tmp_path / "run" / "diff" / "seed_0" / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]


def test_diff_v2_single_model_records_mean_lambda(tmp_path):
    assert (
        run_main(
            tmp_path,
            "model.attention=diff_v2",
            "model.num_layers=2",
            "compare.twins=",
            "train.steps=2",
        )
        == 0
    )
    records = read_metrics(str(tmp_path / "run" / "diff" / "seed_0" / "metrics.jsonl"))
    assert all(len(r["lambda"]) == 2 and all(0.0 < x < 1.0 for x in r["lambda"]) for r in records)
    assert not (tmp_path / "run" / "standard").exists()
    assert "| | diff (diff_v2) |" in (tmp_path / "run" / "report.md").read_text()


def test_checkpointer_keeps_the_last_k_and_the_best(tmp_path):
    from diffjax.train.checkpoint import Checkpointer

    class It:  # a stand-in data iterator state
        pass

    ck = Checkpointer(str(tmp_path / "ck"), keep=1, async_save=False)
    for step, val in zip(range(1, 6), [3.0, 1.0, 2.0, 4.0, 5.0]):
        ck.save(step, {"w": jnp.full((2,), float(step))}, {"pos": step}, {"model": {}}, val)
    ck.wait()
    assert ck.all_steps() == [2, 5]  # the best (val 1.0) and the latest
    assert ck.read_meta(5) == {"model": {}}
    ck.close()


def test_data_change_on_resume_is_reported(tmp_path, capsys):
    assert run_main(tmp_path, "train.steps=2", "compare.twins=") == 0
    assert run_main(tmp_path, "train.steps=3", "compare.twins=", "data.seed=5") == 0
    out = capsys.readouterr().out
    assert "data config differs from the checkpoint's (seed)" in out


def test_the_best_checkpoint_survives_a_resume(tmp_path):
    """Orbax keeps metrics only in memory unless told to write them: a reopened manager then
    saw no validation loss and deleted the best checkpoint at its next save."""
    from diffjax.train.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path / "ck"), keep=1, async_save=False)
    for step, val in [(1, 3.0), (2, 1.0), (3, 2.0)]:
        ck.save(step, {"w": jnp.full((2,), float(step))}, {"pos": step}, {"model": {}}, val)
    ck.close()
    ck = Checkpointer(str(tmp_path / "ck"), keep=1, async_save=False)  # a resumed run
    assert ck.best_step() == 2
    for step, val in [(4, 5.0), (5, 6.0)]:
        ck.save(step, {"w": jnp.full((2,), float(step))}, {"pos": step}, {"model": {}}, val)
    assert ck.all_steps() == [2, 5]
    assert ck.best_step() == 2
    ck.close()


def test_load_model_reads_the_saved_parameters(tmp_path):
    from diffjax.train import Checkpointer, load_model

    assert (
        run_main(
            tmp_path,
            "train.steps=4",
            "train.checkpoint_every=2",
            "train.eval_every=2",
            "compare.twins=",
        )
        == 0
    )
    run = tmp_path / "run" / "diff" / "seed_0"
    vals = {
        r["step"]: r["val_loss"]
        for r in read_metrics(str(run / "metrics.jsonl"))
        if "val_loss" in r
    }
    best = min(vals, key=vals.get)
    ck = Checkpointer(str(run / "checkpoints"), async_save=False)
    raw = ck.manager.restore(best)  # the whole state as Orbax saved it, no target
    ck.close()
    model = load_model(str(run))  # "best"
    assert model.config == diffjax.ModelConfig(
        **json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    )
    _, params, _ = nnx.split(model, nnx.Param, ...)

    def flat(tree):  # path of plain names -> array (Orbax writes layer indices as strings)
        return {
            tuple(
                str(getattr(k, "key", k)) for k in path if getattr(k, "key", k) != "value"
            ): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(tree)
        }

    loaded, saved = flat(nnx.to_pure_dict(params)), flat(raw["state"]["params"])
    assert loaded.keys() == saved.keys() and len(loaded) > 5
    for k in loaded:
        np.testing.assert_array_equal(loaded[k], saved[k])
    latest = load_model(str(run / "checkpoints"), step="latest")
    assert int(raw["state"]["step"]) == best and latest is not None
    tokens = jnp.zeros((1, 8), jnp.int32)
    assert model(tokens).shape == (1, 8, model.config.vocab_size)
    with pytest.raises(diffjax.train.CheckpointError, match="no checkpoint at step 3"):
        load_model(str(run), step=3)
    with pytest.raises(diffjax.train.CheckpointError, match="holds no committed checkpoint"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------------------- seeds and report
def test_paired_t_interval_on_hand_made_numbers():
    from diffjax.evaluate.stats import describe_difference, mean_std, paired_difference, t_interval

    mean, half = t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302652729911275 * 1.0 / np.sqrt(3), rel=1e-9)
    d = paired_difference([3.0, 4.0, 6.0], [2.0, 2.0, 3.0])  # differences 1, 2, 3
    assert (d.mean, d.n) == (2.0, 3) and d.half_width == pytest.approx(half)
    assert (d.low, d.high) == (pytest.approx(2 - half), pytest.approx(2 + half))
    assert not d.excludes_zero and "includes zero" in describe_difference(d, "Loss")  # 2 +/- 2.48
    up = paired_difference([2.0, 3.0, 4.0], [0.0, 0.0, 0.0])  # 3 +/- 2.48
    assert up.excludes_zero and "excludes zero" in describe_difference(up, "Loss")
    assert "DIFF is higher" in describe_difference(up, "Loss")
    down = paired_difference([0.0, 0.0, 0.0], [2.0, 3.0, 4.0])
    assert down.excludes_zero and "DIFF is lower" in describe_difference(down, "Loss")
    wide = paired_difference([1.0, -1.0], [0.0, 0.0])  # mean 0, t_{0.975, 1} = 12.706
    assert wide.low == pytest.approx(-12.706204736, rel=1e-6) and not wide.excludes_zero
    one = paired_difference([2.5], [2.0])
    assert one.mean == 0.5 and one.low is None and one.excludes_zero is None
    assert "no confidence interval can be given from one seed" in describe_difference(one, "Loss")
    assert mean_std([1.0, 2.0, 3.0, None, float("nan")]) == (2.0, 1.0, 3)
    assert mean_std([4.0]) == (4.0, None, 1)
    assert paired_difference([1.0, None, 3.0], [0.0, 1.0, 1.0]).n == 2  # incomplete pairs dropped
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_difference([1.0], [1.0, 2.0])


def test_clopper_pearson_and_the_seed_count_of_a_retrieval_run():
    from math import comb

    from diffjax.compare.report import learned_counts
    from diffjax.evaluate.stats import clopper_pearson

    # the edges in closed form: 0 of n -> [0, 1 - (a/2)^(1/n)], n of n -> [(a/2)^(1/n), 1]
    assert clopper_pearson(0, 2) == (0.0, pytest.approx(1 - 0.025**0.5))
    assert clopper_pearson(4, 4) == (pytest.approx(0.025**0.25), 1.0)
    # inside: the bounds are where the binomial tails equal 2.5%
    low, high = clopper_pearson(2, 4)
    tail = lambda p, ks: sum(comb(4, k) * p**k * (1 - p) ** (4 - k) for k in ks)  # noqa: E731
    assert tail(low, (2, 3, 4)) == pytest.approx(0.025) and tail(high, (0, 1, 2)) == pytest.approx(
        0.025
    )
    assert (round(low, 3), round(high, 3)) == (0.068, 0.932)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        clopper_pearson(3, 2)

    def result(label, seed, acc):
        return diffjax.train.TrainResult(
            label,
            label,
            "",
            1,
            1,
            1,
            1.0,
            1.0,
            1.0,
            1.0,
            None,
            "",
            seed=seed,
            metrics={} if acc is None else {"val_query_accuracy": acc},
        )

    rs = [
        result("diff", 0, 0.85),
        result("diff", 1, 0.70),
        result("standard", 0, 0.26),
        result("standard", 1, 0.63),
    ]
    text = " ".join(learned_counts(rs, 0.25))
    assert "above 0.625, halfway from the no-retrieval level 0.250 to 1" in text
    assert "diff 2 of 2 seeds (95% Clopper-Pearson interval for the rate: 16%-100%)" in text
    assert "standard 1 of 2 seeds (95% Clopper-Pearson interval for the rate: 1%-99%)" in text
    assert learned_counts([result("diff", 0, None)], 0.25) == []
    # the per-seed table shows the query accuracy (not the near-0 example accuracy) of a query task
    from diffjax.compare.report import per_seed_table

    rs[0] = dataclasses.replace(rs[0], metrics={**rs[0].metrics, "val_answer_accuracy": 0.01})
    table = per_seed_table(rs)
    assert (
        "| seed | diff val loss | standard val loss | diff query accuracy | standard query "
        "accuracy |" in table
    )
    assert "| 0 | 1.0000 | 1.0000 | 0.850 | 0.260 |" in table and "0.010" not in table
    plain = per_seed_table(
        [dataclasses.replace(r, metrics={"val_answer_accuracy": 0.5}) for r in rs]
    )
    assert "diff accuracy" in plain and "| 1 | 1.0000 | 1.0000 | 0.500 | 0.500 |" in plain
    # with the first query's accuracy the count uses it and its own level: the diff seeds above
    # copy earlier queries (0.85 and 0.70 on all queries) but stay at 0.26-0.30 on the first
    first = [
        dataclasses.replace(r, metrics={**r.metrics, "val_first_query_accuracy": f})
        for r, f in zip(rs, (0.30, 0.26, 0.95, 0.27))
    ]
    text = " ".join(learned_counts(first, 0.25, 0.25))
    assert "final first-query accuracy" in text and "above 0.625" in text
    assert "diff 0 of 2 seeds" in text and "standard 1 of 2 seeds" in text
    assert "diff 2 of 2" in " ".join(learned_counts(rs, 0.25, 0.25))  # no first-query numbers
    assert "| diff first query | standard first query |" in per_seed_table(first)
    assert "| 0 | 1.0000 | 1.0000 | 0.850 | 0.260 | 0.300 | 0.950 |" in per_seed_table(first)


def test_side_by_side_summary():
    from diffjax.compare.throughput import SideBySide

    s = SideBySide(
        ("diff", "standard"),
        {"diff": [90.0, 80.0, 100.0], "standard": [100.0] * 3},
        [0.9, 0.8, 1.0],
        3,
        4,
        128,
    )
    assert s.median_ratio == pytest.approx(0.9) and s.spread == (0.8, 1.0)
    assert "0.90x standard's" in s.describe() and "0.80 .. 1.00" in s.describe()
    assert not s.resolved() and "the rounds disagree on which model is faster" in s.describe()
    faster = dataclasses.replace(s, ratios=[1.1, 1.2, 1.05])
    assert faster.resolved() and "every round has diff faster" in faster.describe()
    slower = dataclasses.replace(s, ratios=[0.9, 0.8, 0.95])
    assert slower.resolved() and "every round has standard faster" in slower.describe()


def test_seeds_are_paired_and_resumed(tmp_path, capsys):
    """num_seeds=2: one folder per model and seed; seed 1 of the multi-seed run equals a run
    with train.seed=1 alone (so the seeds share the data order and differ only in init); the
    report gives an interval; a resume continues only the unfinished seed."""
    import shutil

    common = (
        "train.steps=4",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "train.tensorboard=false",
        "compare.throughput_rounds=1",
    )
    assert run_main(tmp_path, *common, "compare.seeds=2") == 0
    run = tmp_path / "run"
    for label in ("diff", "standard"):
        for seed in (0, 1):
            assert (
                json.loads((run / label / f"seed_{seed}" / "result.json").read_text())["seed"]
                == seed
            )
    assert losses(run / "diff" / "seed_0") != losses(run / "diff" / "seed_1")
    assert run_main(tmp_path, *common, "train.seed=1", "compare.twins=", name="alone") == 0
    assert losses(tmp_path / "alone" / "diff" / "seed_1") == losses(run / "diff" / "seed_1")
    report = (run / "report.md").read_text()
    assert "95% t-interval" in report and "over 2 paired seeds" in report
    assert "| seeds | 0, 1 | 0, 1 |" in report and "Per seed:" in report
    assert "measured side by side" in report and "1 rounds of 4 steps" in report

    first = {(m, s): losses(run / m / f"seed_{s}") for m in ("diff", "standard") for s in (0, 1)}
    shutil.rmtree(run / "standard" / "seed_1" / "checkpoints" / "4")
    capsys.readouterr()
    assert main(["--resume", f"run.dir={run}", *TINY, *common, "compare.seeds=2"]) == 0
    out = capsys.readouterr().out
    assert "resuming from the checkpoint at step 2" in out
    assert {
        (m, s): losses(run / m / f"seed_{s}") for m in ("diff", "standard") for s in (0, 1)
    } == first


def test_every_seed_reuses_one_compiled_init_and_gets_the_constant_seed_state():
    """The init seed reaches the jitted init as an argument (its key), so the seeds of a
    multi-seed run share one compile; each seed's state is bit for bit the one a constant seed
    gives (jit of make_state_init, the path before the seed became an argument)."""
    import dataclasses

    from diffjax.infra import sharding
    from diffjax.train.setup import make_state_init, model_setup

    exp = apply_overrides(
        ExperimentConfig(),
        [
            "model.d_model=32",
            "model.num_layers=1",
            "model.num_heads=1",
            "model.max_seq_len=32",
            "data.seq_len=16",
        ],
    )
    mesh = sharding.make_mesh(exp.mesh)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        setups = [
            model_setup(exp.model, dataclasses.replace(exp.train, seed=s), Runtime(mesh))
            for s in (0, 1)
        ]
        assert setups[0].jitted_init is setups[1].jitted_init
        states = [s.fresh_state()[0] for s in setups]
        assert setups[0].jitted_init._cache_size() == 1  # one compile for both seeds
        for seed, state in zip((0, 1), states):
            want = jax.jit(make_state_init(exp.model, dataclasses.replace(exp.train, seed=seed)))()[
                0
            ]
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(states[0]["params"]), jax.tree.leaves(states[1]["params"]))
    )


def test_report_leaves_the_matplotlib_backend_alone(tmp_path):
    """Library code must not call matplotlib.use: a notebook's inline backend would be lost."""
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("pdf")  # stands in for a notebook's backend
    try:
        assert run_main(tmp_path, "train.steps=2", "compare.twins=", "train.tensorboard=false") == 0
        assert matplotlib.get_backend() == "pdf"
        assert (tmp_path / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        matplotlib.use(before)


def test_validation_splits_first_and_repeated_queries():
    """diffjax.train.step.evaluate on a needle batch with queries drawn with replacement, with predictions
    that are right on every repeated query and wrong on every other: the query accuracy is the
    share of repeats, the first-query accuracy 0 and the repeat accuracy 1."""
    import jax.numpy as jnp

    from diffjax.infra import sharding
    from diffjax.data import (
        DataConfig,
        NeedleData,
        SyntheticData,
        make_source,
        query_kinds,
        validation_metrics,
    )
    from diffjax.train import step as step_lib

    d = DataConfig(
        source="needle",
        seq_len=128,
        needle=NeedleData(
            num_needles=4,
            num_queries=16,
            query_replacement=True,
            key_len=1,
            value_len=1,
            template="{key}{value}",
            query_template="{key}{value}",
        ),
        synthetic=SyntheticData(num_val_examples=8),
    )
    src = make_source(d, "validation")
    batch = {k: np.stack([src[i][k] for i in range(8)]) for k in src[0]}
    first, repeat = query_kinds(batch)
    preds = batch["targets"].copy()
    for b, r in zip(*np.nonzero(~repeat)):
        s, e = batch["answer_spans"][b, r]
        preds[b, s:e] = (preds[b, s:e] + 1) % 256  # wrong

    def eval_fn(params, inputs):
        return jnp.float32(1.0), jnp.float32(1.0), inputs["inputs"] * 0 + jnp.asarray(preds)

    mesh = sharding.make_mesh()
    out = step_lib.evaluate(eval_fn, None, [batch], Runtime(mesh), 8, validation_metrics(d))
    assert out["val_first_query_accuracy"] == 0.0 and out["val_repeat_query_accuracy"] == 1.0
    assert out["val_query_accuracy"] == pytest.approx(repeat.mean())
    assert repeat.mean() > 0.6 and not repeat[:, 0].any() and first[:, 0].all()


def test_a_corpus_declares_no_validation_metric_and_the_loop_computes_none():
    """The loop sums only what the data declares: a corpus has loss and perplexity alone."""
    import jax.numpy as jnp

    from diffjax.data import (
        RETRIEVAL_METRICS,
        DataConfig,
        make_source,
        validation_metrics,
    )
    from diffjax.infra import sharding
    from diffjax.train import step as step_lib

    assert validation_metrics(DataConfig(max_files=4)) == {}
    assert validation_metrics(DataConfig(source="mqar", seq_len=64)) == dict(RETRIEVAL_METRICS)
    src = make_source(DataConfig(max_files=4, seq_len=16), "validation")
    batch = {k: np.stack([src[i][k] for i in range(8)]) for k in src[0]}

    def eval_fn(params, inputs):
        return jnp.float32(2.0), jnp.float32(1.0), inputs["inputs"]

    out = step_lib.evaluate(eval_fn, None, [batch], Runtime(sharding.make_mesh()), 8)
    assert set(out) == {"val_loss", "val_ppl"} and out["val_loss"] == 2.0
    counted = {"twos": lambda preds, b: (int((preds == 2).sum()), 0)}  # nothing counted: left out
    assert set(
        step_lib.evaluate(eval_fn, None, [batch], Runtime(sharding.make_mesh()), 8, counted)
    ) == {
        "val_loss",
        "val_ppl",
    }


def test_result_json_of_before_the_metrics_mapping_still_loads():
    """A result.json with the validation metrics as fields of their own (before
    TrainResult.metrics) loads with them in the mapping; a new one round-trips."""
    from diffjax.train import TrainResult

    old = {
        "label": "diff",
        "attention": "diff_v1",
        "directory": "runs/x/diff/seed_0",
        "params": 10,
        "steps": 2,
        "tokens_seen": 64,
        "final_train_loss": 1.5,
        "final_val_loss": 1.25,
        "tokens_per_s": 100.0,
        "step_time_s": 0.1,
        "peak_memory_bytes": None,
        "memory_source": "",
        "lambdas": [0.2],
        "val_accuracy": 0.125,
        "seed": 1,
        "val_query_accuracy": 0.5,
        "val_first_query_accuracy": 0.25,
        "val_repeat_query_accuracy": None,
    }
    r = TrainResult.from_dict(old)
    assert r.metrics == {
        "val_answer_accuracy": 0.125,
        "val_query_accuracy": 0.5,
        "val_first_query_accuracy": 0.25,
    }
    assert (r.seed, r.final_val_loss, r.lambdas) == (1, 1.25, [0.2])
    assert TrainResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_report_rows_follow_the_metrics_the_run_produced():
    """The results table has a row per metric some result has (a metric without a display name
    under its key), none for the others; group_by_label takes results or dicts."""
    from diffjax.compare.report import results_table
    from diffjax.evaluate.stats import group_by_label
    from diffjax.train import TrainResult

    def result(label, seed, metrics):
        return TrainResult(
            label, label, "", 1, 1, 1, 1.0, 1.0, 1.0, 1.0, None, "", seed=seed, metrics=metrics
        )

    rs = [result("standard", 1, {"val_custom": 0.5}), result("diff", 0, {}), result("diff", 1, {})]
    table = results_table(rs)
    assert "| val_custom | 0.500 | n/a | n/a |" in table  # standard first: it came first
    assert "accuracy" not in table and "final validation loss" in table
    assert [r.seed for r in group_by_label(rs)["diff"]] == [0, 1]
    assert list(group_by_label(rs)) == ["standard", "diff"]
    dicts = [{"label": "a", "seed": 2}, {"label": "b", "seed": 0}, {"label": "a", "seed": 1}]
    assert group_by_label(dicts) == {"a": [dicts[2], dicts[0]], "b": [dicts[1]]}


def test_a_profile_window_writes_a_trace_of_those_steps(tmp_path):
    """train.profile_steps=2:3: a jax.profiler trace in each model's folder (the XPlane file
    TensorBoard's profile plugin and XProf read, and a Perfetto trace), non-empty."""
    import glob

    args = ["train.steps=4", "train.profile_steps=2:3", "compare.twins=", "train.tensorboard=false"]
    assert run_main(tmp_path, *args) == 0
    profile = tmp_path / "run" / "diff" / "seed_0" / "profile"
    xplanes = glob.glob(str(profile / "plugins" / "profile" / "*" / "*.xplane.pb"))
    perfetto = glob.glob(str(profile / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    assert xplanes and all(os.path.getsize(f) > 0 for f in xplanes + perfetto), xplanes
    assert perfetto
