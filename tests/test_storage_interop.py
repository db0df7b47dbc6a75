"""Hugging Face exports, ``python -m diffjax.sample`` and the lm-eval model with their paths in a
bucket (``gs://``), against a real GCS API server (``conftest.gcs_server``: fake-gcs-server on
127.0.0.1). Every check that reads or writes the bucket runs inside :class:`LocalPathGuard`, so
a URL that reaches ``open`` / ``os`` / ``os.path`` in diffjax's own code fails the test.

The models are tiny (one or two layers, d_model 32): each test takes a few seconds."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.interop import hf
from diffjax import sample
from diffjax.infra import storage
from gcs_emulator import LocalPathGuard

DOCS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with <s>/</s> (named in tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 10, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return path


def _model(**kw) -> diffjax.TransformerLM:
    base = dict(vocab_size=300, d_model=32, num_layers=2, num_heads=2, ffn_dim=32, max_seq_len=32)
    cfg = diffjax.ModelConfig(init_std=0.2, **{**base, **kw})
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    if cfg.attention == "diff_v1":  # a learned-looking subln weight (folded into o_proj on export)
        for layer in model.layers:
            layer.attn.subln.scale[...] = 1 + 0.1 * jnp.arange(layer.attn.subln.scale.shape[0])
    return model


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


TOKENS = jnp.asarray([[5, 17, 200, 3, 42, 99, 7, 1]], jnp.int32)


# ---------------------------------------------------------------------------- exports
@pytest.mark.parametrize("attention,shard", [("diff_v1", "5GB"), ("standard", "20KB")])
def test_an_export_in_a_bucket_is_the_local_export(
    bucket, gcs_server, tmp_path, tok_dir, attention, shard
):
    """save_pretrained to gs:// writes the objects a local export holds, byte for byte, and
    from_pretrained of it gives the local round trip's parameters and logits (one file, and
    shards with their index)."""
    model = _model(attention=attention)
    local = str(tmp_path / "export")
    diffjax.save_pretrained(model, local, max_shard_size=shard, tokenizer_from=str(tok_dir))
    url = f"{bucket}/export"
    with LocalPathGuard():
        assert (
            diffjax.save_pretrained(model, url, max_shard_size=shard, tokenizer_from=str(tok_dir))
            == url
        )
        back = diffjax.from_pretrained(url)
        assert hf.config_from_pretrained(url) == back.config
    objects = gcs_server.objects(url)
    assert set(objects) == set(os.listdir(local))
    assert ("model.safetensors.index.json" in objects) == (shard == "20KB")
    for name, data in objects.items():
        assert data == (tmp_path / "export" / name).read_bytes(), name
    ref = diffjax.from_pretrained(local)
    assert back.config == ref.config
    for a, b in zip(_params(back), _params(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(back(TOKENS)), np.asarray(ref(TOKENS)))


def test_an_export_is_copied_from_one_bucket_prefix_to_another(bucket, tok_dir):
    """tokenizer_from in a bucket; an existing export is never overwritten."""
    model = _model(attention="standard")
    with LocalPathGuard():
        diffjax.save_pretrained(model, f"{bucket}/a", tokenizer_from=str(tok_dir))
        diffjax.save_pretrained(model, f"{bucket}/b", tokenizer_from=f"{bucket}/a")
        assert storage.read_bytes(f"{bucket}/b/tokenizer.json") == (
            (tok_dir / "tokenizer.json").read_bytes()
        )
        with pytest.raises(diffjax.PretrainedError, match=r"already holds a checkpoint"):
            diffjax.save_pretrained(model, f"{bucket}/b")


def test_a_prefix_without_an_export_is_refused_by_name(bucket, gcs_server):
    with LocalPathGuard():
        with pytest.raises(diffjax.PretrainedError) as e:
            diffjax.from_pretrained(f"{bucket}/nothing")
    assert str(e.value).startswith(f"{bucket}/nothing: is not a directory") and "Fix:" in str(
        e.value
    )
    assert "Traceback" not in str(e.value)
    storage.write_json(f"{bucket}/weightless/config.json", hf.hf_config(_model().config))
    storage.write_bytes(f"{bucket}/configless/model.safetensors", b"x")
    with LocalPathGuard():
        with pytest.raises(diffjax.PretrainedError, match=r"/configless/config\.json: does not"):
            diffjax.from_pretrained(f"{bucket}/configless")
        with pytest.raises(
            diffjax.PretrainedError, match=rf"^{bucket}/weightless: holds no model\.safetensors"
        ):
            diffjax.from_pretrained(f"{bucket}/weightless")


def test_a_missing_bucket_is_refused_before_any_work(gcs_server, monkeypatch):
    missing = "gs://diffjax-test-no-such-bucket/export"

    def no_work(*a, **k):
        raise AssertionError("work started before the bucket was checked")

    monkeypatch.setattr(hf, "hf_config", no_work)
    monkeypatch.setattr(hf, "config_from_hf", no_work)
    with LocalPathGuard():
        with pytest.raises(
            storage.StorageError, match=r"gs://diffjax-test-no-such-bucket does not"
        ):
            diffjax.save_pretrained(_model(), missing)
        with pytest.raises(storage.StorageError, match=r"does not exist"):
            diffjax.from_pretrained(missing)
    assert not gcs_server.client().lookup_bucket("diffjax-test-no-such-bucket")  # not created


# ---------------------------------------------------------------------------- readers of exports
def test_sample_and_lm_eval_read_an_export_in_a_bucket(
    bucket, tmp_path, tok_dir, capsys, monkeypatch
):
    """``python -m diffjax.sample gs://...`` prints what it prints for the local export (the
    tokenizer.json read from the bucket), and the lm-eval model loads the same parameters."""
    model = _model(attention="diff_v1")
    local, url = str(tmp_path / "export"), f"{bucket}/export"
    diffjax.save_pretrained(model, local, tokenizer_from=str(tok_dir))
    diffjax.save_pretrained(model, url, tokenizer_from=str(tok_dir))
    args = ["def add", "sample.max_new_tokens=6"]
    assert sample.main([local, *args]) == 0
    expected = capsys.readouterr().out
    with LocalPathGuard():
        assert sample.main([url, *args]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected and f"Hugging Face checkpoint: {url}" in captured.err
    assert "HFTokenizer" in captured.err

    pytest.importorskip("lm_eval")
    from diffjax.lm_eval import DiffJaxLM

    with LocalPathGuard():
        lm = DiffJaxLM(path=url, batch_size=8)
    ref = DiffJaxLM(path=local)
    assert repr(lm._tok).startswith(f"HFTokenizer({url + '/tokenizer.json'!r}")  # named by its URL
    assert lm.tok_encode("def add") == ref.tok_encode("def add")
    for a, b in zip(_params(lm.model), _params(ref.model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_init_from_an_export_in_a_bucket(bucket, tok_dir):
    """train.init_from=gs://...: the export's model config (resolve_init_from)."""
    from diffjax.compare import default_comparison
    from diffjax.train.checkpoint import resolve_init_from
    from diffjax.train.config import apply_overrides

    model = _model(attention="standard")
    diffjax.save_pretrained(model, f"{bucket}/export", tokenizer_from=str(tok_dir))
    with LocalPathGuard():
        exp = resolve_init_from(
            apply_overrides(
                default_comparison(),
                [
                    f"train.init_from={bucket}/export",
                    "compare.twins=",
                    "compare.seeds=1",
                    "data.seq_len=16",
                ],
            )
        )
    assert exp.model == model.config.replace(num_kv_heads=2, head_dim=16)
    assert exp.data.tokenizer == f"{bucket}/export"


# ---------------------------------------------------------------------------- a run in a bucket
def test_sample_and_lm_eval_read_a_run_in_a_bucket(bucket, capsys):
    """A run folder written as train.py writes it (RUN/config.json, RUN/<label>/seed_<n>/
    checkpoints/, by the Checkpointer) in a bucket: sample picks its DIFF model and prints
    the greedy text, lm-eval's model loads the parameters."""
    from diffjax.train.checkpoint import Checkpointer

    run = f"{bucket}/run"
    saved = {}
    for label, attention in (("diff", "diff_v1"), ("standard", "standard")):
        m = _model(attention=attention, vocab_size=259)
        ckpt = Checkpointer(storage.join(run, label, "seed_0", "checkpoints"), async_save=False)
        ckpt.save(1, {"params": nnx.state(m, nnx.Param)}, {}, {"model": m.config.to_dict()}, 1.0)
        ckpt.wait()
        ckpt.close()
        saved[label] = m
    storage.write_json(
        storage.join(run, "config.json"),
        {"model": {}, "data": {"tokenizer": "byte"}, "train": {"seed": 0}},
    )
    with LocalPathGuard():
        assert sample.main([run, "def", "sample.max_new_tokens=4"]) == 0
    captured = capsys.readouterr()
    assert f"model: {run}/diff/seed_0 (also here: standard/seed_0" in captured.err
    assert captured.out == "def" + sample.sample(saved["diff"], ["def"], 4)[0] + "\n"

    pytest.importorskip("lm_eval")
    from diffjax.lm_eval import DiffJaxLM

    with LocalPathGuard():
        lm = DiffJaxLM(path=run, model="standard", batch_size=8)
    for a, b in zip(_params(lm.model), _params(saved["standard"]), strict=True):
        np.testing.assert_array_equal(a, b)
