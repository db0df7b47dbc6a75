"""Weights & Biases with the real ``wandb`` package in offline mode: the run's file read back
holds, step by step, the scalars TensorBoard holds, and the whole config; bad settings are
refused before training with the fix."""

from __future__ import annotations

import glob
import json

import pytest

from test_train import TINY as TRAIN_TINY

from diffjax.compare.cli import main

# tests/test_train.py's tiny experiment, one model, 6 steps with an evaluation at 3 and 6
TINY = [*TRAIN_TINY, "model.num_layers=2", "train.eval_batches=1", "train.steps=6"]
TINY += ["train.eval_every=3", "train.checkpoint_every=6", "compare.twins="]


def wandb_records(path: str) -> list:
    """The records of a ``.wandb`` file (a LevelDB-style log of ``Record`` protobufs after a
    7-byte header; records split over 32 KiB blocks are joined)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, raws, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            raws.append(chunk)
        elif kind in (2, 3):  # first, middle
            part = chunk if kind == 2 else part + chunk
        elif kind == 4:  # last
            raws.append(part + chunk)
    records = []
    for raw in raws:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def test_offline_wandb_holds_what_tensorboard_holds(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing import event_accumulator

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    args = [f"run.dir={run}", *TINY, "run.wandb=offline", "run.wandb_tags=a,b"]
    args += ["train.diagnostics=true", "train.skip_spikes=3"]  # per-layer and per-map names
    assert main(args) == 0
    model = run / "diff" / "seed_0"
    (path,) = glob.glob(str(model / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            history[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert info.display_name == "default-diff-seed_0" and info.run_group == "default"  # run.name
    assert list(info.tags) == ["a", "b"]
    config = {i.key: json.loads(i.value_json) for i in info.config.update}
    assert config["train"]["steps"] == 6 and config["run"]["wandb"] == "offline"
    assert config["model"]["attention"] == "diff_v1"

    acc = event_accumulator.EventAccumulator(str(model / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "val_loss", "lambda/layer_0", "lambda/layer_1"} <= set(tags)
    assert {"logit_max/layer_1/map_1", "activation_max/layer_1", "output_logit_max"} <= set(tags)
    assert {"update_ratio", "spikes_skipped"} <= set(tags)
    for tag in tags:
        for event in acc.Scalars(tag):
            assert history[event.step][tag] == pytest.approx(event.value, rel=1e-6), tag
    tb_keys = {(e.step, tag) for tag in tags for e in acc.Scalars(tag)}
    wandb_keys = {(step, k) for step, row in history.items() for k in row}
    assert wandb_keys == tb_keys


@pytest.mark.parametrize(
    "extra, message",
    [
        (["run.wandb=yes"], r"RunConfig.wandb: unknown mode 'yes'.*Fix: use one of 'off'"),
        (["run.wandb=online"], r"run.wandb: 'online' needs a W&B login.*Fix: wandb login"),
    ],
)
def test_bad_tracker_settings_stop_before_training(tmp_path, capsys, monkeypatch, extra, message):
    import re

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main([f"run.dir={tmp_path / 'run'}", *TINY, *extra]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err, re.S), err
    assert not (tmp_path / "run" / "diff" / "seed_0" / "metrics.jsonl").exists()


def test_a_missing_wandb_package_is_refused_with_the_install_command(monkeypatch):
    from diffjax.config import ConfigError
    from diffjax.train import metrics

    real = metrics.importlib.util.find_spec
    monkeypatch.setattr(
        metrics.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    with pytest.raises(ConfigError, match=r"needs the wandb package.*pip install -e '\.\[wandb\]'"):
        metrics.check_wandb("offline")
    metrics.check_wandb("off")  # nothing needed
