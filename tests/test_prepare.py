"""``python -m diffjax.data.prepare``: text corpora to token shards and a manifest, read back by
``data.source=tokens``: round trips, determinism across worker counts and interruptions, the
checks on inputs and on the folder a run trains on, and one tiny training run."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from diffjax.compare.cli import main as train_main
from diffjax.data import DataConfig, DataError, check_data, load_corpus, TokensData
from diffjax.data import prepare as prep
from diffjax.data.sources import (
    _concat_documents,
    check_manifest_tokenizer,
    is_validation_file,
    read_manifest,
)
from diffjax.data.tokenizer import ByteTokenizer, HFTokenizer
from diffjax.train.metrics import read_metrics
from tiny import tiny_run

WORDS = "alpha beta gamma delta épsilon zeta eta theta iota kappa lambda mu".split()


def _text(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)) + f" {i}."


def write_corpus(root, *, docs: int = 40) -> list[tuple[str, str]]:
    """.txt, .jsonl and .jsonl.gz inputs under ``root``; returns ``[(split key, text)]`` in
    the order prepare reads them."""
    root.mkdir(parents=True, exist_ok=True)
    expected = []
    with open(root / "a.jsonl", "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": _text(i), "id": i}) + "\n")
            expected.append((f"a.jsonl:{i}", _text(i)))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        for i in range(docs // 2):
            f.write(json.dumps({"text": _text(100 + i)}) + "\n")
            expected.append((f"b.jsonl.gz:{i}", _text(100 + i)))
    for i in range(3):
        (root / f"c{i}.txt").write_text(_text(200 + i, 40) + "\n")
        expected.append((f"c{i}.txt", _text(200 + i, 40) + "\n"))
    return expected


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    """A tiny byte-level BPE tokenizer.json (exact round trips) with <s>/</s> as bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_text(i) for i in range(200)], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return str(folder / "tokenizer.json")


def run(inputs, out, tokenizer="byte", **kw) -> prep.PrepareResult:
    kw.setdefault("shard_tokens", 700)
    kw.setdefault("val_fraction", 0.2)
    kw.setdefault("progress", False)
    return prep.prepare(
        prep.PrepareOptions(inputs=tuple(map(str, inputs)), tokenizer=tokenizer, out=str(out), **kw)
    )


def read_split(out, split: str) -> np.ndarray:
    manifest = json.loads((out / "manifest.json").read_text())
    dtype = manifest["dtype"]
    parts = [np.fromfile(out / s["file"], dtype=dtype) for s in manifest["shards"][split]]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def folder_bytes(out) -> dict[str, bytes]:
    return {
        n: (out / n).read_bytes()
        for n in sorted(os.listdir(out))
        if n.endswith(".bin") or n == "manifest.json"
    }


def split_documents(stream: np.ndarray, bos: int, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert (stream[starts] == bos).all() and ends[-1] == len(stream) - 1
    return [stream[s + 1 : e] for s, e in zip(starts, ends)]


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_shards_decode_to_the_documents_split_by_key(tmp_path, bpe, kind):
    expected = write_corpus(tmp_path / "in")
    spec = "byte" if kind == "byte" else bpe
    tok = ByteTokenizer() if kind == "byte" else HFTokenizer(bpe)
    result = run([tmp_path / "in"], tmp_path / "out", tokenizer=spec, shard_tokens=300)
    m = result.manifest
    assert m["vocab_size"] == tok.vocab_size and m["dtype"] == "uint16"
    assert (m["bos_id"], m["eos_id"]) == (tok.bos_id, tok.eos_id)
    assert m["tokenizer"]["sha256"] == (None if kind == "byte" else prep.file_sha256(bpe))
    for split in ("train", "val"):
        shards = m["shards"][split]
        assert all(s["tokens"] == 300 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 300
        stream = read_split(tmp_path / "out", split)
        docs = [tok.decode(d) for d in split_documents(stream, tok.bos_id, tok.eos_id)]
        want = [t for k, t in expected if is_validation_file(k, 0.2) == (split == "val")]
        assert docs == want and docs
        assert sum(s["documents"] for s in shards) == len(want)
        assert m["totals"][split] == {"tokens": len(stream), "documents": len(want)}
    if kind == "byte":  # the text source's stream of the same documents, token for token
        want = [t.encode() for k, t in expected if not is_validation_file(k, 0.2)]
        assert read_split(tmp_path / "out", "train").tobytes() == _concat_documents(want).tobytes()


def test_parquet_input_and_a_missing_datasets_package(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": [_text(i) for i in range(30)]}), tmp_path / "d.parquet")
    m = run([tmp_path / "d.parquet"], tmp_path / "out", text_field="body").manifest
    assert m["totals"]["train"]["documents"] + m["totals"]["val"]["documents"] == 30
    with pytest.raises(prep.PrepareError, match="prepare.text_field.*'text'.*'body'"):
        run([tmp_path / "d.parquet"], tmp_path / "out2")
    if prep.importlib.util.find_spec("datasets") is None:
        with pytest.raises(prep.PrepareError, match=r"pip install 'diffjax\[readers\]'"):
            run(["someone/some-dataset"], tmp_path / "out3")


# ---------------------------------------------------------------------------- determinism
def test_worker_count_does_not_change_a_byte(tmp_path, bpe, monkeypatch):
    write_corpus(tmp_path / "in", docs=120)
    monkeypatch.setattr(prep, "CHUNK_BYTES", 256)  # many chunks per file
    run([tmp_path / "in"], tmp_path / "one", tokenizer=bpe, workers=1)
    run([tmp_path / "in"], tmp_path / "two", tokenizer=bpe, workers=2)
    one, two = folder_bytes(tmp_path / "one"), folder_bytes(tmp_path / "two")
    assert len(one) > 4 and one == two


def test_rerun_after_an_interruption_gives_the_same_bytes(tmp_path):
    write_corpus(tmp_path / "in", docs=80)
    out = tmp_path / "out"
    run([tmp_path / "in"], out, shard_tokens=500)
    before = folder_bytes(out)
    assert run([tmp_path / "in"], out, shard_tokens=500).shards_written == 0  # nothing to do
    # as if killed: no manifest, a shard cut short, another missing, a temporary file left
    (out / "manifest.json").unlink()
    (out / "train_00001.bin").write_bytes(before["train_00001.bin"][:100])
    (out / "train_00002.bin").unlink()
    (out / "train_00003.bin.tmp-12345").write_bytes(b"partial")
    result = run([tmp_path / "in"], out, shard_tokens=500)
    assert result.shards_written == 2  # the others were kept
    assert folder_bytes(out) == before
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    # a damaged shard under a finished manifest is made again too
    (out / "val_00000.bin").write_bytes(b"\0\0")
    assert run([tmp_path / "in"], out, shard_tokens=500).shards_written == 1
    assert folder_bytes(out) == before


def test_another_preparation_in_out_is_refused_and_kept(tmp_path):
    write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    run([tmp_path / "in"], out)
    before = folder_bytes(out)
    with pytest.raises(
        prep.PrepareError, match=r"prepare.out: .*another val_fraction.*Fix: choose"
    ):
        run([tmp_path / "in"], out, val_fraction=0.5)
    (out / "manifest.json").unlink()  # unfinished: the fingerprint file still guards it
    with pytest.raises(prep.PrepareError, match=r"unfinished preparation with another shard"):
        run([tmp_path / "in"], out, shard_tokens=999)
    assert folder_bytes(out) == {k: v for k, v in before.items() if k != "manifest.json"}
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "train_00000.bin").write_bytes(b"\0\0")
    with pytest.raises(prep.PrepareError, match="unknown preparation"):
        run([tmp_path / "in"], stranger)


# ---------------------------------------------------------------------------- bad input
def test_bad_inputs_are_refused_before_any_work(tmp_path):
    (tmp_path / "fields.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(
        prep.PrepareError,
        match=r"prepare.text_field: 'text' is not a field .*'content'.*Fix: .*content",
    ):
        run([tmp_path / "fields.jsonl"], tmp_path / "out")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(prep.PrepareError, match=r"INPUT: .*empty.txt.* is empty.*Fix: remove"):
        run([tmp_path / "empty.txt"], tmp_path / "out")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(prep.PrepareError, match=r"holds no documents.*Fix"):
        run([tmp_path / "blank.jsonl"], tmp_path / "out")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(prep.PrepareError, match=r"unknown extension.*Fix: give .txt"):
        run([tmp_path / "x.csv"], tmp_path / "out")
    with pytest.raises(prep.PrepareError, match=r"glob .* matches nothing"):
        run([tmp_path / "nothing*.txt"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before writing anything


def test_uint16_with_a_large_vocab_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "d.txt").write_text("w1 w69999 w7")
    with pytest.raises(
        prep.PrepareError, match=r"prepare.dtype: uint16 .*70,000.*prepare.dtype=uint32"
    ):
        run(
            [tmp_path / "d.txt"],
            tmp_path / "out",
            tokenizer=str(tmp_path / "big.json"),
            dtype="uint16",
            val_fraction=0.0,
        )
    m = run(
        [tmp_path / "d.txt"],
        tmp_path / "out",
        tokenizer=str(tmp_path / "big.json"),
        val_fraction=0.0,
    ).manifest
    assert m["dtype"] == "uint32"
    assert read_split(tmp_path / "out", "train").tolist() == [1, 69999, 7]
    # the reader takes the dtype from the manifest, not data.tokens.dtype
    corpus = load_corpus(
        DataConfig(
            source="tokens",
            path=str(tmp_path / "out"),
            val_fraction=0.0,
            seq_len=8,
            tokens=TokensData(dtype="uint16"),
        )
    )
    assert corpus.train.read(0, 3).tolist() == [1, 69999, 7]


# ---------------------------------------------------------------------------- the reader
def test_a_prepared_folder_is_read_and_checked(tmp_path, bpe):
    write_corpus(tmp_path / "in", docs=80)
    out = tmp_path / "out"
    m = run([tmp_path / "in"], out, tokenizer=bpe).manifest
    cfg = DataConfig(source="tokens", path=str(out), seq_len=8)
    summary = check_data(cfg, vocab_size=m["vocab_size"])
    assert summary.split_by == "document"
    assert summary.train_tokens == m["totals"]["train"]["tokens"]
    assert summary.validation_tokens == m["totals"]["val"]["tokens"]
    assert summary.train_files == len(m["shards"]["train"])
    with pytest.raises(
        DataError,
        match=r"model.vocab_size: 259 is smaller than the vocab_size"
        r" 400 .*Fix: set model.vocab_size >= 400",
    ):
        check_data(cfg, vocab_size=259)
    with pytest.raises(DataError, match=r"DataConfig.tokenizer: the run names 'byte'.*Fix"):
        load_corpus(cfg.replace(tokenizer="byte"))
    manifest = read_manifest(str(out))
    check_manifest_tokenizer(str(out), manifest, bpe)  # the same tokenizer.json: accepted
    byte_out = tmp_path / "byte_out"
    run([tmp_path / "in"], byte_out)
    with pytest.raises(DataError, match=r"DataConfig.tokenizer: .*prepared with 'byte'"):
        check_manifest_tokenizer(str(byte_out), read_manifest(str(byte_out)), bpe)


def test_plain_token_files_keep_their_behaviour(tmp_path, bpe):
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "manifest.json").write_text('{"another": "tool"}')  # not a prepared folder
    cfg = DataConfig(source="tokens", path=str(tmp_path), seq_len=8, val_fraction=0.1)
    corpus = load_corpus(cfg)
    assert (len(corpus.train), len(corpus.validation), corpus.split_by) == (180, 20, "stream")
    assert check_data(cfg, vocab_size=200).train_tokens == 180
    write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    m = run([tmp_path / "in"], out, tokenizer=bpe).manifest
    (out / m["shards"]["val"][0]["file"]).unlink()
    with pytest.raises(DataError, match=r"lists val_00000.bin .* missing. Fix: prepare"):
        load_corpus(cfg.replace(path=str(out)))
    with pytest.raises(DataError, match=r"prepared folder .* given with other paths"):
        load_corpus(cfg.replace(path=f"{out},{tmp_path / 't.bin'}"))


def test_train_py_trains_on_a_prepared_folder(tmp_path, capsys):
    write_corpus(tmp_path / "in", docs=200)
    out = tmp_path / "out"
    argv = [
        str(tmp_path / "in"),
        "prepare.tokenizer=byte",
        f"prepare.out={out}",
        "prepare.workers=1",
    ]
    assert prep.main([*argv, "prepare.shard_tokens=4000", "prepare.val_fraction=0.1"]) == 0
    assert "tokens/s" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    assert (
        train_main(
            [f"run.dir={run_dir}", *tiny_run(
                "data.source=tokens", f"data.path={out}", "data.tokenizer=byte", "compare.twins=",
                "train.steps=2", "train.eval_every=2", "train.warmup_steps=1",
                drop=("data.max_files", "train.tensorboard"))]
        )
        == 0
    )  # fmt: skip
    rows = read_metrics(str(run_dir / "diff" / "seed_0" / "metrics.jsonl"))
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
