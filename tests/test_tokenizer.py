"""A Hugging Face tokenizer.json (diffjax.data.HFTokenizer) in the data pipeline: local files,
built here with the `tokenizers` package (nothing downloaded)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffjax.config import ConfigError
from diffjax.data import DataConfig, DataError, HFTokenizer, check_data, load_corpus, load_tokenizer
from diffjax.data import ByteTokenizer

tokenizers = pytest.importorskip("tokenizers")

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    x: int = 0\n    y: int = 0\n",
    "for i in range(10):\n    print(i * i)\n",
    "héllo wörld, naïve café\n",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json with <s>/</s> (named in tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    )
    return path


def test_encode_decode_round_trip(tok_dir):
    tok = HFTokenizer(str(tok_dir))  # a directory holding tokenizer.json
    same = HFTokenizer(str(tok_dir / "tokenizer.json"))  # or the file itself
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.vocab_size == same.vocab_size <= 300
    for text in DOCS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and len(ids) < len(text.encode())  # merges happened
        np.testing.assert_array_equal(ids, same.encode(text))
        assert tok.decode(ids) == text
    framed = tok.encode(DOCS[0], add_bos=True, add_eos=True)
    assert framed[0] == 0 and framed[-1] == 1
    assert tok.decode(framed) == DOCS[0]  # special tokens skipped
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(tok_dir)), HFTokenizer)


def test_missing_or_bad_tokenizer_file(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer\.json' does not exist"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"is not a tokenizer\.json"):
        HFTokenizer(str(tmp_path))


def test_text_corpus_is_tokenized_with_it(tmp_path, tok_dir):
    for i, doc in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(doc * 3)
    cfg = DataConfig(
        source="text",
        path=str(tmp_path / "*.txt"),
        seq_len=8,
        val_fraction=0.0,
        tokenizer=str(tok_dir),
    )
    tok = HFTokenizer(str(tok_dir))
    expected = np.concatenate([tok.encode(d * 3, add_bos=True, add_eos=True) for d in DOCS])
    stream = load_corpus(cfg).train
    np.testing.assert_array_equal(stream.read(0, len(stream)), expected)
    assert check_data(cfg, vocab_size=tok.vocab_size).train_examples == (len(expected) - 1) // 8
    with pytest.raises(
        DataError,
        match=rf"has {tok.vocab_size} ids but the model's vocab_size is "
        r"259.*model\.vocab_size >=",
    ):
        check_data(cfg, vocab_size=259)


def test_tokenizer_only_for_text_and_token_sources(tok_dir):
    with pytest.raises(
        ConfigError, match=r"DataConfig\.tokenizer: source='mqar' does not tokenize"
    ):
        DataConfig(source="mqar", tokenizer=str(tok_dir))
    # token files: the tokenizer their ids came from (checked against a prepared manifest)
    assert DataConfig(source="tokens", path="x.bin", tokenizer=str(tok_dir)).tokenizer


def test_init_from_uses_the_checkpoints_tokenizer(tmp_path, tok_dir):
    """train.init_from=DIR with text data and no data.tokenizer reads DIR/tokenizer.json."""
    import shutil

    from diffjax.compare import default_comparison
    from diffjax.train.checkpoint import resolve_init_from
    from diffjax.train.config import apply_overrides

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tok_dir, ckpt)
    (ckpt / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                vocab_size=300,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
            )
        )
    )
    exp = resolve_init_from(
        apply_overrides(
            default_comparison(),
            [
                f"train.init_from={ckpt}",
                "compare.twins=",
                "compare.seeds=1",
                "model.dtype=bfloat16",
            ],
        )
    )
    assert exp.data.tokenizer == str(ckpt)
    assert (exp.model.attention, exp.model.d_model, exp.model.vocab_size, exp.model.dtype) == (
        "standard",
        32,
        300,
        "bfloat16",
    )
    kept = resolve_init_from(
        apply_overrides(
            default_comparison(),
            [
                f"train.init_from={ckpt}",
                "compare.twins=",
                "compare.seeds=1",
                "data.tokenizer=byte",
            ],
        )
    )
    assert kept.data.tokenizer == "byte"


def test_sample_reads_a_hugging_face_directory_with_its_tokenizer(tmp_path, tok_dir, capsys):
    """`python -m diffjax.sample HF_DIR` loads the checkpoint and its own tokenizer.json, and
    prints the prompt followed by the greedy continuation that generate() gives."""
    from flax import nnx

    import diffjax
    from diffjax import sample

    cfg = diffjax.ModelConfig(
        vocab_size=300, d_model=32, num_layers=1, num_heads=2, max_seq_len=64, norm_eps=1e-5
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(3))
    out = tmp_path / "hf"
    diffjax.save_pretrained(model, str(out), tokenizer_from=str(tok_dir))
    assert sample.is_hf_checkpoint(str(out)) and not sample.is_hf_checkpoint(str(tok_dir))
    assert sample.main([str(out), "def add", "sample.max_new_tokens=6"]) == 0
    captured = capsys.readouterr()
    assert "HFTokenizer" in captured.err and "Hugging Face checkpoint" in captured.err
    tok = HFTokenizer(str(tok_dir))
    ids = np.asarray(tok.encode("def add"))[None]
    expect = np.asarray(
        diffjax.generate(diffjax.from_pretrained(str(out)), ids, 6, eos_id=tok.eos_id)
    )[0, ids.shape[1] :]
    if (hits := np.flatnonzero(expect == tok.eos_id)).size:
        expect = expect[: hits[0]]
    assert captured.out.strip("\n") == ("def add" + tok.decode(expect)).strip("\n")
    assert sample.main([str(out), "x", f"sample.tokenizer={tmp_path / 'nope'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
