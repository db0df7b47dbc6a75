"""Documents kept apart: segment ids, positions and weights from document boundaries (an index
or BOS/EOS ids) against a corpus of known document lengths; a packed row computes what each of
its documents computes alone (every attention kind, the XLA path, the interpreted kernels, the
context ring); prepared folders carry an index that is checked; masking off is today's data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffjax.data import DataConfig, DataError, make_dataset, make_source
from diffjax.data import prepare as prep
from diffjax.data.documents import DocumentIndex, SpecialTokens, mark_documents
from diffjax.data.sources import TokenStream, WindowSource, _ArrayPiece
from diffjax.data.tokenizer import BOS, EOS


# ---------------------------------------------------------------------------- the reference
def reference_marks(doc_of: np.ndarray, start: int, t: int) -> dict[str, np.ndarray]:
    """From each stream token's document number: the window at ``start``'s segment ids (the
    documents in order of appearance, from 1), positions (tokens since the document's first
    token in the window) and weights (the target is in the input's document)."""
    docs = doc_of[start : start + t + 1]
    seg = np.unique(docs[:t], return_inverse=True)[1] + 1
    pos = np.array([np.sum(docs[:i] == docs[i]) for i in range(t)])
    return {"segment_ids": seg, "positions": pos, "weights": (docs[1:] == docs[:-1]) * 1.0}


def check_window(src: WindowSource, doc_of: np.ndarray, i: int):
    T = src.seq_len
    got, want = src[i], reference_marks(doc_of, i * T, T)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=f"window {i}: {k}")
    assert got["segment_ids"].dtype == got["positions"].dtype == np.int32
    assert got["positions"].max() < T


LENGTHS = [5, 0, 3, 40, 1, 9, 0, 0, 2, 17, 11]  # an empty document, one longer than a window


def test_index_windows_match_known_document_lengths():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 50, sum(LENGTHS)).astype(np.int32)
    doc_of = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    index = DocumentIndex.from_lengths(LENGTHS)
    src = WindowSource(TokenStream([_ArrayPiece(stream)]), 8, index)
    for i in range(len(src)):
        check_window(src, doc_of, i)
    # a window that starts inside a document counts its positions from the window's start
    assert src[3]["positions"][0] == 0 and doc_of[24] == doc_of[23]
    # a document longer than a window: one segment, no zero weight
    inside = src[2]
    assert set(inside["segment_ids"]) == {1} and inside["weights"].all()


def test_special_token_boundaries_equal_the_index():
    """A stream framed BOS d EOS: the BOS/EOS ids find the boundaries the index records."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 200, n) for n in (3, 30, 1, 12, 7)]
    stream = np.concatenate([np.concatenate([[BOS], d, [EOS]]) for d in docs]).astype(np.int32)
    lengths = [len(d) + 2 for d in docs]
    ts = TokenStream([_ArrayPiece(stream)])
    by_index = WindowSource(ts, 8, DocumentIndex.from_lengths(lengths))
    by_ids = WindowSource(ts, 8, SpecialTokens(BOS, EOS))
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    for i in range(len(by_index)):
        check_window(by_ids, doc_of, i)
        for k, v in by_index[i].items():
            np.testing.assert_array_equal(by_ids[i][k], v)
    # only an EOS, or only a BOS, finds the same starts
    for marks in (SpecialTokens(None, EOS), SpecialTokens(BOS, None)):
        for i in range(len(by_index)):
            np.testing.assert_array_equal(
                WindowSource(ts, 8, marks)[i]["segment_ids"], by_index[i]["segment_ids"]
            )


def test_mark_documents_by_hand():
    got = mark_documents(6, np.array([3, 3, 6]))  # an empty document at 3; a target starts one
    np.testing.assert_array_equal(got["segment_ids"], [1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(got["positions"], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(got["weights"], [1, 1, 0, 1, 1, 0])


def test_text_corpus_index_and_the_split_by_stream(tmp_path):
    """A text corpus of files of known lengths (each file a document: BOS bytes EOS), split by
    file and, with one file, by stream (a validation stream that starts inside a document)."""
    sizes = [30, 5, 70, 12, 44, 9]
    for i, n in enumerate(sizes):
        (tmp_path / f"f{i}.txt").write_bytes(b"x" * n)
    for path, val in ((str(tmp_path), 0.3), (str(tmp_path / "f2.txt"), 0.4)):
        cfg = DataConfig(source="text", path=path, seq_len=8, val_fraction=val)
        for split in ("train", "validation"):
            src = make_source(cfg, split)
            stream = src.stream.read(0, len(src.stream))
            # documents from the framing: a new one at each BOS
            doc_of = np.cumsum(stream == BOS)
            for i in range(len(src)):
                check_window(src, doc_of, i)


# ---------------------------------------------------------------------------- the pipeline
SMALL = DataConfig(source="stdlib", seq_len=64, max_files=6)


def test_masking_off_is_todays_batches_and_on_only_adds():
    off = SMALL.replace(document_mask=False)
    a = next(iter(make_dataset(off, "train", batch_size=8)))
    b = next(iter(make_dataset(SMALL, "train", batch_size=8)))
    assert set(a) == {"inputs", "targets", "weights"} and a["weights"].all()
    assert set(b) == {"inputs", "targets", "weights", "segment_ids", "positions"}
    for k in ("inputs", "targets"):
        np.testing.assert_array_equal(a[k], b[k])
    # today's windows: stream[i*T : i*T + T + 1], in the shuffled order
    src = make_source(off, "train")
    assert src.documents is None
    stream = src.stream.read(0, len(src.stream))
    first = int(
        np.flatnonzero(
            [np.array_equal(stream[j * 64 : j * 64 + 64], a["inputs"][0]) for j in range(len(src))]
        )[0]
    )
    np.testing.assert_array_equal(a["targets"][0], stream[first * 64 + 1 : first * 64 + 65])


def test_iterator_state_does_not_change_with_masking():
    states = []
    for cfg in (SMALL, SMALL.replace(document_mask=False)):
        it = iter(make_dataset(cfg, "train", batch_size=4))
        next(it)
        states.append(it.get_state())
    assert states[0] == states[1]
    it = iter(make_dataset(SMALL, "train", batch_size=4))
    for _ in range(3):
        next(it)
    want = next(it)
    fresh = iter(make_dataset(SMALL, "train", batch_size=4))
    it2 = iter(make_dataset(SMALL, "train", batch_size=4))
    for _ in range(3):
        next(it2)
    fresh.set_state(it2.get_state())
    got = next(fresh)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_synthetic_tasks_refuse_document_mask_and_keep_their_batches():
    with pytest.raises(Exception, match=r"document_mask.*Fix"):
        DataConfig(source="mqar", seq_len=64, document_mask=True)
    batch = next(iter(make_dataset(DataConfig(source="mqar", seq_len=64), "train", batch_size=2)))
    assert "segment_ids" not in batch


def test_validation_padding_is_segment_zero():
    cfg = SMALL.replace(seq_len=256)
    batches = list(make_dataset(cfg, "validation", batch_size=64))
    last = batches[-1]
    pad = last["weights"].sum(1) == 0
    assert pad.any() and (last["segment_ids"][pad] == 0).all()
    assert (last["segment_ids"][~pad] >= 1).all()


# ---------------------------------------------------------------------------- token files
def _prepare(tmp_path, lengths, tokenizer="byte", shard_tokens=50):
    src = tmp_path / "in"
    src.mkdir()
    with open(src / "docs.jsonl", "w") as fh:
        for i, n in enumerate(lengths):
            fh.write(json.dumps({"text": "".join(chr(97 + (i + j) % 26) for j in range(n))}) + "\n")
    out = tmp_path / "out"
    prep.main([str(src), f"prepare.tokenizer={tokenizer}", f"prepare.out={out}",
               f"prepare.shard_tokens={shard_tokens}", "prepare.val_fraction=0",
               "prepare.workers=1"])  # fmt: skip
    return out


DOC_LENGTHS = [3, 60, 1, 7, 25, 2, 90, 4]


def test_prepared_index_gives_exact_boundaries(tmp_path):
    out = _prepare(tmp_path, DOC_LENGTHS)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 2
    starts = []
    offset = 0
    for shard in manifest["shards"]["train"]:
        idx = np.fromfile(out / shard["index"], dtype="<i8")
        assert len(idx) == shard["documents"]
        starts += list(idx + offset)
        offset += shard["tokens"]
    framed = [n + 2 for n in DOC_LENGTHS]  # BOS text EOS
    assert starts == list(np.concatenate([[0], np.cumsum(framed)[:-1]]))
    cfg = DataConfig(source="tokens", path=str(out), seq_len=16, val_fraction=0)
    src = make_source(cfg, "train")
    assert isinstance(src.documents, DocumentIndex)
    doc_of = np.repeat(np.arange(len(framed)), framed)
    for i in range(len(src)):
        check_window(src, doc_of, i)


def test_an_index_that_does_not_match_its_shard_is_refused(tmp_path):
    out = _prepare(tmp_path, DOC_LENGTHS)
    cfg = DataConfig(source="tokens", path=str(out), seq_len=16, val_fraction=0)
    idx = out / "train_00001.idx"
    good = idx.read_bytes()
    for bad, problem in (
        (good[:-8], "holds 0 starts|bytes for"),
        (
            np.array([49, 3], "<i8").tobytes()[: len(good)] if len(good) == 16 else None,
            "not sorted",
        ),
        (np.full(len(good) // 8, 10**6, "<i8").tobytes(), "outside the shard"),
    ):
        if bad is None:
            continue
        idx.write_bytes(bad)
        with pytest.raises(DataError, match=rf"(?s)train_00001.idx.*({problem}).*Fix: prepare"):
            make_source(cfg, "train")
    idx.unlink()
    with pytest.raises(DataError, match=r"train_00001.idx.*missing.*Fix"):
        make_source(cfg, "train")
    # without masking the index is not read
    assert len(make_source(cfg.replace(document_mask=False), "train")) > 0


def _as_version_1(out):
    """The folder as a preparation before the index existed wrote it."""
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["version"] = 1
    for shards in manifest["shards"].values():
        for s in shards:
            (out / s.pop("index")).unlink()
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_a_folder_prepared_before_the_index_loads_and_is_completed(tmp_path, capsys):
    out = _prepare(tmp_path, DOC_LENGTHS)
    cfg = DataConfig(source="tokens", path=str(out), seq_len=16, val_fraction=0)
    want = [make_source(cfg, "train")[i] for i in range(4)]
    _as_version_1(out)
    src = make_source(cfg, "train")  # boundaries from the manifest's BOS/EOS ids
    assert isinstance(src.documents, SpecialTokens)
    for i in range(4):
        for k, v in want[i].items():
            np.testing.assert_array_equal(src[i][k], v)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    prep.main([str(tmp_path / "in"), "prepare.tokenizer=byte", f"prepare.out={out}",
               "prepare.shard_tokens=50", "prepare.val_fraction=0", "prepare.workers=1"])  # fmt: skip
    assert json.loads((out / "manifest.json").read_text())["version"] == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")} == mtimes  # shards kept
    assert isinstance(make_source(cfg, "train").documents, DocumentIndex)


def test_raw_token_files_mask_by_the_tokenizer_or_say_why_not(tmp_path, capsys):
    docs = [np.concatenate([[BOS], np.full(n, 65), [EOS]]) for n in (5, 30, 12)]
    np.save(tmp_path / "t.npy", np.concatenate(docs).astype(np.uint16))
    cfg = DataConfig(source="tokens", path=str(tmp_path / "t.npy"), seq_len=8, val_fraction=0)
    src = make_source(cfg, "train")
    assert src.documents is None and "segment_ids" not in src[0]
    err = capsys.readouterr().err
    assert "data.document_mask: documents are not kept apart" in err and "data.tokenizer" in err
    make_source(cfg, "train")
    assert "document_mask" not in capsys.readouterr().err  # said once
    with pytest.raises(DataError, match=r"document_mask: is true.*Fix: prepare"):
        make_source(cfg.replace(document_mask=True), "train")
    byte = make_source(cfg.replace(tokenizer="byte"), "train")
    assert isinstance(byte.documents, SpecialTokens) and byte[0]["segment_ids"].max() == 2


# ---------------------------------------------------------------------------- the model
def _packed_and_alone(vocab=64, t=32, lengths=(9, 15, 8), seed=0):
    """One packed row of documents (the first a partial one) and each document alone at the
    start of a row (the rest of the row is other tokens: causal attention never reads them)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (t + 1,))
    starts = np.cumsum((0,) + lengths[:-1])
    marks = mark_documents(t, starts[1:])
    alone = rng.integers(0, vocab, (len(lengths), t + 1))
    for i, (a, n) in enumerate(zip(starts, lengths)):
        alone[i, :n] = tokens[a : a + n]
        alone[i, n] = tokens[a + n]  # the target after the document's last token
    return tokens, marks, alone, starts, lengths


KINDS = {
    "diff_v1": dict(attention="diff_v1", num_heads=2),
    "diff_v2": dict(attention="diff_v2", num_heads=4),
    "standard": dict(attention="standard", num_heads=4),
}


def _model(kind, impl="xla"):
    from flax import nnx

    from diffjax import ModelConfig, TransformerLM

    cfg = ModelConfig(
        vocab_size=64, d_model=32, num_layers=2, max_seq_len=32, attention_impl=impl, **KINDS[kind]
    )
    return TransformerLM(cfg, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_packed_row_computes_each_document_alone(kind, impl):
    import jax.numpy as jnp

    model = _model(kind, impl)
    tokens, marks, alone, starts, lengths = _packed_and_alone()
    packed = model(
        jnp.asarray(tokens[None, :-1]),
        positions=jnp.asarray(marks["positions"][None]),
        segment_ids=jnp.asarray(marks["segment_ids"][None]),
    )
    each = model(jnp.asarray(alone[:, :-1]))
    for i, (a, n) in enumerate(zip(starts, lengths)):
        np.testing.assert_allclose(packed[0, a : a + n], each[i, :n], atol=1e-5, rtol=1e-5)
    # without the masks the later documents read the earlier ones
    unmasked = model(jnp.asarray(tokens[None, :-1]))
    assert (
        np.abs(np.asarray(unmasked[0, starts[1] :]) - np.asarray(packed[0, starts[1] :])).max()
        > 1e-3
    )


@pytest.mark.parametrize(
    "kind,impl,order",
    [
        ("diff_v1", "xla", "zigzag"),
        ("diff_v2", "xla", "striped"),
        ("standard", "xla", "contiguous"),
        ("diff_v2", "pallas", "zigzag"),
    ],
)
def test_a_packed_row_on_the_context_ring_computes_each_document_alone(kind, impl, order):
    """Over mesh.context=4 (every order; the kernel ring interpreted): a document split over
    devices is still one segment, and restarting positions never loosen causality."""
    from diffjax.infra import sharding
    from diffjax.evaluate.long_context import replicate
    from diffjax.evaluate.probe import losses_and_predictions
    from diffjax.infra.runtime import Runtime

    model = _model(kind, impl)
    tokens, marks, alone, starts, lengths = _packed_and_alone()
    packed = {
        "inputs": tokens[None, :-1],
        "targets": tokens[None, 1:],
        **{k: marks[k][None] for k in ("segment_ids", "positions")},
    }
    single = {"inputs": alone[:, :-1], "targets": alone[:, 1:]}
    want, _ = losses_and_predictions(model, single, batch_size=4)
    runtime = Runtime.of(model.config, sharding.MeshConfig(context=4, context_order=order))
    got, _ = losses_and_predictions(replicate(model, runtime.mesh), packed, 2, runtime)
    for i, (a, n) in enumerate(zip(starts, lengths)):
        np.testing.assert_allclose(got[0, a : a + n], want[i, :n], atol=1e-5, rtol=1e-5)


def test_loss_by_position_counts_from_each_document_start():
    from diffjax.evaluate.positions import loss_by_position

    losses = np.arange(8, dtype=float)[None].repeat(2, 0)
    weights = np.ones((2, 8))
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5]])
    ends, by_pos = loss_by_position(losses, weights, 4, positions)
    np.testing.assert_array_equal(ends, [2, 4, 6, 8])
    # bucket 0 (positions 0-1): columns 0, 1, 4, 5 of row 0 and 0, 1, 2, 3 of row 1
    assert by_pos[0] == pytest.approx(np.mean([0, 1, 4, 5, 0, 1, 2, 3]))
    assert by_pos[2] == pytest.approx(6.5) and np.isnan(by_pos[3])  # no position past 5
    assert np.allclose(loss_by_position(losses, weights, 4)[1], [0.5, 2.5, 4.5, 6.5])


def test_a_plan_knows_which_batches_carry_documents_without_reading_them(tmp_path):
    from diffjax.data import carries_documents

    out = _prepare(tmp_path, DOC_LENGTHS)
    assert carries_documents(SMALL) and not carries_documents(SMALL.replace(document_mask=False))
    assert carries_documents(DataConfig(source="tokens", path=str(out)))
    assert not carries_documents(DataConfig(source="tokens", path="nowhere/*.bin"))  # raw files
    assert carries_documents(DataConfig(source="tokens", path="x.bin", tokenizer="byte"))
    assert not carries_documents(DataConfig(source="needle", seq_len=256))
