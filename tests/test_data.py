"""diffjax.data: tokenizer, corpora, token files, synthetic tasks, the grain pipeline, errors."""

from __future__ import annotations

import pathlib
import pickle
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffjax.config import ConfigError
from diffjax.data import (
    StdlibData,
    MqarData,
    NeedleData,
    SyntheticData,
    TokensData,
    BOS,
    EOS,
    PAD,
    ByteTokenizer,
    DataConfig,
    DataError,
    answer_accuracy,
    answer_correct,
    check_data,
    describe,
    is_validation_file,
    load_corpus,
    query_correct,
    make_dataset,
    make_source,
    num_examples,
    num_tokens,
    stdlib_files,
    stdlib_root,
    steps_per_epoch,
)
from diffjax.data.config import needle_len, query_len
from diffjax.data.sources import open_token_file
from diffjax.data.synthetic import place_needles

TOK = ByteTokenizer()
SMALL_STDLIB = DataConfig(source="stdlib", seq_len=64, max_files=40)


def take(ds, k: int) -> list[dict[str, np.ndarray]]:
    it = iter(ds)
    return [next(it) for _ in range(k)]


def batches_equal(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def rows(batches: list[dict], key: str = "inputs", weighted_only: bool = False) -> list[tuple]:
    out = []
    for b in batches:
        for r in range(b[key].shape[0]):
            if weighted_only and not b["weights"][r].any():
                continue
            out.append(tuple(b[key][r].tolist()))
    return out


@pytest.fixture()
def text_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """12 files of random letters (every window distinct), in a nested directory."""
    rng = np.random.default_rng(0)
    root = tmp_path / "corpus"
    for i in range(12):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        text = bytes(rng.integers(97, 123, size=int(rng.integers(200, 600))).astype(np.uint8))
        (sub / f"doc{i:02d}.txt").write_bytes(text)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_text("ignored")
    return root


# ============================================================================ tokenizer
@settings(max_examples=50, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert TOK.decode(ids) == text
    assert TOK.decode(TOK.encode(text, add_bos=True, add_eos=True)) == text


def test_tokenizer_specials_and_bytes():
    assert (BOS, EOS, PAD, TOK.vocab_size) == (256, 257, 258, 259)
    ids = TOK.encode("hé", add_bos=True, add_eos=True)
    assert ids.tolist() == [BOS, 104, 0xC3, 0xA9, EOS]
    assert TOK.encode(b"\x00\xff").tolist() == [0, 255]
    assert TOK.decode([BOS, 104, PAD, 105, EOS]) == "hi"
    assert TOK.decode(np.array([[104], [105]])) == "hi"  # any shape
    assert TOK.decode([0xC3]) == "\ufffd"  # invalid UTF-8 is replaced
    with pytest.raises(TypeError):
        TOK.encode(123)


# ============================================================================ stdlib corpus
def test_stdlib_files_deterministic_and_filtered():
    files = stdlib_files()
    assert files == stdlib_files() and len(files) > 100
    root = stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(set(rel)) == len(rel)
    assert all(r.endswith(".py") for r in rel)
    for part in ("site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"):
        assert not any(part in r.split("/")[:-1] for r in rel), part
    assert "os.py" in rel and "json/__init__.py" in rel
    with_tests = stdlib_files(include_tests=True)
    assert set(files) <= set(with_tests)
    assert stdlib_files(max_files=5) == files[:5]


def test_stdlib_split_by_file_disjoint_stable_and_exact():
    cfg = SMALL_STDLIB.replace(val_fraction=0.3)
    corpus = load_corpus(cfg)
    root = stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in stdlib_files(max_files=40)]
    val = [r for r in rel if is_validation_file(r, 0.3)]
    train = [r for r in rel if not is_validation_file(r, 0.3)]
    assert val and train and not set(val) & set(train)
    assert corpus.split_by == "file"
    assert (corpus.train_files, corpus.validation_files) == (len(train), len(val))

    def stream(names):
        parts = [TOK.encode((root / n).read_bytes(), add_bos=True, add_eos=True) for n in names]
        return np.concatenate(parts)

    np.testing.assert_array_equal(corpus.train.read(0, len(corpus.train)), stream(train))
    np.testing.assert_array_equal(corpus.validation.read(0, len(corpus.validation)), stream(val))
    # Stable: a file's split depends only on its own path, not on which other files exist.
    assert [is_validation_file(r, 0.3) for r in rel[:10]] == [r in val for r in rel[:10]]
    assert is_validation_file("a/b.py", 0.5) == is_validation_file("a/b.py", 0.5)
    assert not is_validation_file("a/b.py", 0.0)


def test_stdlib_full_corpus_summary():
    s = check_data(DataConfig())
    assert str(s) == s.description == describe(DataConfig())
    assert s.files == len(stdlib_files()) and s.split_by == "file"
    assert s.train_tokens > 1_000_000 and 0 < s.validation_tokens < s.train_tokens
    assert s.train_examples == (s.train_tokens - 1) // 256
    assert num_tokens(DataConfig(), "validation") == s.validation_tokens
    assert re.match(
        r"stdlib corpus \(.*\): [\d,]+ files, [\d.]+ M train tokens, [\d.]+ (M|k) "
        r"validation tokens$",
        describe(DataConfig()),
    ), describe(DataConfig())


# ============================================================================ windows, pipeline
def test_windows_shifted_by_one_and_contiguous():
    src = make_source(SMALL_STDLIB, "train")
    corpus = load_corpus(SMALL_STDLIB)
    T = SMALL_STDLIB.seq_len
    assert len(src) == (len(corpus.train) - 1) // T == num_examples(SMALL_STDLIB, "train")
    for i in (0, 1, len(src) - 1):
        ex = src[i]
        assert ex["inputs"].shape == ex["targets"].shape == ex["weights"].shape == (T,)
        assert ex["inputs"].dtype == ex["targets"].dtype == np.int32
        assert ex["weights"].dtype == np.float32 and (ex["weights"] == 1).all()
        np.testing.assert_array_equal(ex["inputs"][1:], ex["targets"][:-1])
        np.testing.assert_array_equal(ex["inputs"], corpus.train.read(i * T, i * T + T))
    np.testing.assert_array_equal(src[1]["inputs"][0], src[0]["targets"][-1])
    assert src[0]["inputs"][0] == BOS


def test_batches_shapes_and_determinism():
    ds = make_dataset(SMALL_STDLIB, "train", batch_size=4)
    a = take(ds, 3)
    assert {k: (v.shape, v.dtype) for k, v in a[0].items()} == {
        "inputs": ((4, 64), np.int32),
        "targets": ((4, 64), np.int32),
        "weights": ((4, 64), np.float32),
        "segment_ids": ((4, 64), np.int32),  # documents kept apart (tests/test_documents.py)
        "positions": ((4, 64), np.int32),
    }
    assert batches_equal(a, take(make_dataset(SMALL_STDLIB, "train", batch_size=4), 3))
    assert batches_equal(a, take(make_dataset(SMALL_STDLIB, "train", batch_size=4, seed=0), 3))
    assert not batches_equal(a, take(make_dataset(SMALL_STDLIB, "train", batch_size=4, seed=1), 3))
    assert not batches_equal(
        a, take(make_dataset(SMALL_STDLIB.replace(seed=1), "train", batch_size=4), 3)
    )
    unshuffled = take(make_dataset(SMALL_STDLIB.replace(shuffle=False), "train", batch_size=2), 1)
    src = make_source(SMALL_STDLIB, "train")
    np.testing.assert_array_equal(unshuffled[0]["inputs"][1], src[1]["inputs"])


def test_epochs_cover_data_and_reshuffle(text_dir):
    cfg = DataConfig(source="text", path=str(text_dir), seq_len=16, val_fraction=0.2)
    n = num_examples(cfg, "train")
    src = make_source(cfg, "train")
    everything = sorted(tuple(src[i]["inputs"].tolist()) for i in range(n))
    one = rows(take(make_dataset(cfg, "train", batch_size=1, num_epochs=1), n))
    assert sorted(one) == everything
    two = rows(take(make_dataset(cfg, "train", batch_size=1, num_epochs=2), 2 * n))
    assert sorted(two[n:]) == everything and two[n:] != two[:n]  # epoch 2: a new order
    ds = make_dataset(cfg, "train", batch_size=1, num_epochs=1)
    assert len(list(ds)) == n


@pytest.mark.parametrize("split", ["train", "validation"])
def test_process_sharding_disjoint_and_covering(text_dir, split):
    cfg = DataConfig(source="text", path=str(text_dir), seq_len=16, val_fraction=0.3)
    n = num_examples(cfg, split)
    src = make_source(cfg, split)
    everything = sorted(tuple(src[i]["inputs"].tolist()) for i in range(n))
    B, pc = 3, 2
    shards = []
    for pi in range(pc):
        ds = make_dataset(
            cfg, split, batch_size=B, process_index=pi, process_count=pc, num_epochs=1
        )
        shards.append(list(ds))
    assert len(shards[0]) == len(shards[1]) > 0  # same number of batches on every process
    got = [rows(s, weighted_only=(split == "validation")) for s in shards]
    assert not set(got[0]) & set(got[1])
    if split == "train":  # whole global batches of pc * B; process p reads rows [pB, (p+1)B)
        assert (
            len(shards[0])
            == n // (pc * B)
            == steps_per_epoch(cfg, split, batch_size=B, process_count=pc)
        )
        whole = rows(take(make_dataset(cfg, split, batch_size=1, num_epochs=1), n))
        assert set(got[0]) | set(got[1]) <= set(whole)
        # global batch j is the same examples in the same order as for one process
        one = rows(take(make_dataset(cfg, split, batch_size=pc * B, num_epochs=1), 2))
        for j in range(2):
            assert (
                got[0][j * B : (j + 1) * B] + got[1][j * B : (j + 1) * B]
                == one[j * pc * B : (j + 1) * pc * B]
            )
    else:  # validation: every example exactly once, padded with zero-weight PAD rows
        assert sorted(got[0] + got[1]) == everything
        assert len(shards[0]) == steps_per_epoch(cfg, split, batch_size=B, process_count=pc)
        pad_rows = [
            r for s in shards for b in s for r, w in zip(b["inputs"], b["weights"]) if not w.any()
        ]
        assert len(pad_rows) == len(shards[0]) * B * pc - n
        assert all((r == PAD).all() for r in pad_rows)


def test_validation_fixed_order_independent_of_seed():
    a = list(make_dataset(SMALL_STDLIB, "validation", batch_size=4))
    b = list(make_dataset(SMALL_STDLIB, "validation", batch_size=4, seed=7))
    assert batches_equal(a, b)
    n = num_examples(SMALL_STDLIB, "validation")
    assert len(a) == -(-n // 4)
    assert sum(int(x["weights"].any(axis=1).sum()) for x in a) == n


def test_iterator_state_resumes_exactly(text_dir):
    cfg = DataConfig(source="text", path=str(text_dir), seq_len=16, val_fraction=0.2)
    n = num_examples(cfg, "train")
    ds = make_dataset(cfg, "train", batch_size=4)
    it = iter(ds)
    k = n // 4 - 1  # resume just before the epoch boundary
    for _ in range(k):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(4)]
    fresh = iter(make_dataset(cfg, "train", batch_size=4))
    fresh.set_state(state)
    assert batches_equal(want, [next(fresh) for _ in range(4)])


def test_orbax_checkpoint_round_trip(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    ds = make_dataset(SMALL_STDLIB, "train", batch_size=4)
    it = iter(ds)
    for _ in range(5):
        next(it)
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(params), data=grain.checkpoint.CheckpointSave(it)
            ),
        )
        mngr.wait_until_finished()
    want = [next(it) for _ in range(3)]
    fresh = iter(make_dataset(SMALL_STDLIB, "train", batch_size=4))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.latest_step() == 5
        restored = mngr.restore(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(params),
                data=grain.checkpoint.CheckpointRestore(fresh),
            ),
        )
    np.testing.assert_array_equal(restored["state"]["w"], params["w"])
    assert batches_equal(want, [next(fresh) for _ in range(3)])


# ============================================================================ text and token files
def test_text_source_files_globs_and_stream_split(tmp_path, text_dir):
    cfg = DataConfig(source="text", path=str(text_dir), seq_len=16)
    s = check_data(cfg)
    assert s.files == 12  # __pycache__ skipped
    one = tmp_path / "one.txt"
    one.write_text("hello world " * 100)
    cfg1 = DataConfig(source="text", path=str(one), seq_len=16, val_fraction=0.25)
    c = load_corpus(cfg1)
    assert c.split_by == "stream"  # a single file cannot be split by file
    assert len(c.validation) == round(0.25 * (1200 + 2))
    assert "split by position" in describe(cfg1)
    glob_cfg = DataConfig(source="text", path=f"{text_dir}/a/*.txt,{one}", seq_len=16)
    assert check_data(glob_cfg).files == 7


@pytest.mark.parametrize("fmt", ["npy-uint16", "npy-int32", "bin-uint16", "bin-uint32"])
def test_token_files_memory_mapped(tmp_path, fmt):
    kind, dtype = fmt.split("-")
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 259, size=n).astype(dtype) for n in (500, 300, 700)]
    for i, a in enumerate(arrays):
        path = tmp_path / f"part{i}.{kind}"
        if kind == "npy":
            np.save(path, a)
        else:
            a.tofile(path)
    (tmp_path / "notes.txt").write_text("not a token file")  # ignored inside a directory
    cfg = DataConfig(
        source="tokens",
        path=str(tmp_path),
        seq_len=32,
        val_fraction=0.1,
        tokens=TokensData(dtype=dtype if kind == "bin" else "uint16"),
    )
    corpus = load_corpus(cfg)
    assert len(corpus.files) == 3
    for f in corpus.files:
        assert isinstance(open_token_file(f, cfg.tokens.dtype), np.memmap)
    whole = np.concatenate(arrays).astype(np.int32)
    cut = 1500 - 150
    np.testing.assert_array_equal(corpus.train.read(0, cut), whole[:cut])
    np.testing.assert_array_equal(corpus.validation.read(0, 150), whole[cut:])
    src = make_source(cfg, "train")
    assert len(src) == (cut - 1) // 32
    i = 500 // 32  # a window across the first file boundary
    np.testing.assert_array_equal(src[i]["inputs"], whole[i * 32 : i * 32 + 32])
    np.testing.assert_array_equal(src[i]["targets"], whole[i * 32 + 1 : i * 32 + 33])
    s = check_data(cfg, vocab_size=259)
    assert s.train_tokens == cut and s.validation_tokens == 150
    assert "token files" in describe(cfg)
    b = next(iter(make_dataset(cfg, "train", batch_size=2)))
    assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (2, 32)
    clone = pickle.loads(pickle.dumps(src))  # for multiprocess readers: paths, not the data
    assert len(pickle.dumps(src)) < 2000
    np.testing.assert_array_equal(clone[i]["inputs"], src[i]["inputs"])


# ============================================================================ needle task
NEEDLE = DataConfig(
    source="needle",
    seq_len=768,
    max_files=40,
    needle=NeedleData(num_needles=4, num_queries=2, depths=(0.0, 0.3, 0.6, 1.0)),
)


def test_needle_layout_answers_and_depths():
    src = make_source(NEEDLE, "train")
    T = NEEDLE.seq_len
    nl, ql = needle_len(5, 6), query_len(5, 6)
    H = T - 2 * ql
    for i in range(5):
        ex = src[i]
        assert ex["inputs"].shape == ex["targets"].shape == ex["weights"].shape == (T,)
        assert ex["inputs"][0] == BOS
        np.testing.assert_array_equal(ex["inputs"][1:], ex["targets"][:-1])
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        text = TOK.decode(w)
        # needles at the requested depths, each the expected sentence
        np.testing.assert_allclose(ex["needle_depths"], NEEDLE.needle.depths, atol=1 / (H - nl))
        facts = {}
        for (s, e), (vs, ve) in zip(ex["needle_spans"], ex["needle_value_spans"]):
            m = re.fullmatch(
                r"\nThe magic number for ([a-z]{5}) is ([1-9]\d{5})\.\n", TOK.decode(w[s:e])
            )
            assert m, TOK.decode(w[s:e])
            assert TOK.decode(w[vs:ve]) == m.group(2)
            facts[m.group(1)] = m.group(2)
            assert e <= 1 + H  # inside the haystack
        assert len(set(facts.values())) == 4
        starts = ex["needle_spans"][:, 0] - 1
        np.testing.assert_array_equal(starts, np.rint(np.array(NEEDLE.needle.depths) * (H - nl)))
        # queries at the end; weights exactly on the answer digits; answers appear in context
        queries = re.findall(
            r"\nWhat is the magic number for ([a-z]{5})\? (\d{6})\.?", text[-2 * ql :]
        )
        assert len(queries) == 2 and text.endswith(queries[-1][1] + ".")
        weighted = np.flatnonzero(ex["weights"])
        assert weighted.min() >= T - 2 * ql and set(ex["weights"].tolist()) == {0.0, 1.0}
        assert len(weighted) == 2 * 6
        for r, (key, value) in enumerate(queries):
            assert facts[key] == value
            s, e = ex["answer_spans"][r]
            assert TOK.decode(ex["targets"][s:e]) == value
            assert (ex["weights"][s:e] == 1).all()
            q = ex["query_needle"][r]
            vs, ve = ex["needle_value_spans"][q]
            np.testing.assert_array_equal(ex["inputs"][vs:ve], ex["targets"][s:e])
            assert text[: 1 + H].count(value) >= 1


def test_needle_deterministic_and_random_depths():
    src = make_source(NEEDLE, "train")
    assert all(np.array_equal(src[3][k], src[3][k]) for k in src[3])
    assert not np.array_equal(src[3]["inputs"], src[4]["inputs"])
    other = make_source(NEEDLE, "train", seed=1)
    assert not np.array_equal(src[3]["inputs"], other[3]["inputs"])
    val = make_source(NEEDLE, "validation")
    assert len(val) == NEEDLE.synthetic.num_val_examples
    assert not np.array_equal(src[3]["inputs"], val[3]["inputs"])
    rnd = make_source(NEEDLE.replace(needle=dict(depths=None)), "train")
    depths = np.stack([rnd[i]["needle_depths"] for i in range(20)])
    assert depths.min() >= 0 and depths.max() <= 1 and depths.std() > 0.1
    for i in range(20):  # needles never overlap
        spans = np.sort(rnd[i]["needle_spans"], axis=0)
        assert (spans[1:, 0] >= spans[:-1, 1]).all()
    a = take(make_dataset(NEEDLE, "train", batch_size=2), 2)
    assert batches_equal(a, take(make_dataset(NEEDLE, "train", batch_size=2), 2))
    assert a[0]["needle_spans"].shape == (2, 4, 2) and a[0]["answer_spans"].shape == (2, 2, 2)


def test_place_needles_resolves_overlaps():
    pos = place_needles(np.array([0.5, 0.5, 0.5]), 100, 10)
    assert sorted(pos.tolist()) == [45, 55, 65]
    pos = place_needles(np.array([1.0, 1.0]), 50, 10)
    assert sorted(pos.tolist()) == [30, 40]
    pos = place_needles(np.array([0.0, 1.0]), 20, 10)
    assert pos.tolist() == [0, 10]


def test_needle_minimal_seq_len_and_text_haystack(text_dir):
    cfg = DataConfig(
        source="needle", path=str(text_dir), needle=NeedleData(num_needles=2, num_queries=1)
    )
    need = cfg.needle.min_seq_len
    ex = make_source(cfg.replace(seq_len=need), "validation")[0]  # no haystack at all
    assert ex["inputs"].shape == (need,)
    ex = make_source(cfg.replace(seq_len=need + 40), "train")[0]
    hay = np.ones(need + 40, bool)
    hay[0] = False  # BOS
    hay[1 + 40 + 2 * needle_len(5, 6) :] = False  # the query
    for s, e in ex["needle_spans"]:
        hay[s:e] = False
    assert hay.sum() == 40
    assert set(TOK.decode(ex["inputs"][hay])) <= set("abcdefghijklmnopqrstuvwxyz\n")
    assert "text file" in describe(cfg.replace(seq_len=need + 40))


def test_needle_custom_templates_key_letters_and_query_spans():
    """Own needle/query sentences: the layout, weights and spans follow the templates; keys come
    from the first needle_num_key_letters letters; query_spans mark each query."""
    cfg = DataConfig(
        source="needle",
        seq_len=96,
        max_files=40,
        needle=NeedleData(
            num_needles=3,
            num_queries=4,
            query_replacement=True,
            key_len=1,
            value_len=2,
            template="\n${key}{value}\n",
            query_template="\n${key}{value}",
            num_key_letters=4,
        ),
    )
    assert (cfg.needle.needle_bytes, cfg.needle.query_bytes) == (
        6,
        5,
    ) and cfg.needle.min_seq_len == 38
    src = make_source(cfg, "train")
    for i in range(20):
        ex = src[i]
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        facts = {}
        for (s, e), (vs, ve) in zip(ex["needle_spans"], ex["needle_value_spans"]):
            m = re.fullmatch(r"\n\$([a-d])([1-9]\d)\n", TOK.decode(w[s:e]))
            assert m, TOK.decode(w[s:e])
            assert TOK.decode(w[vs:ve]) == m.group(2)
            facts[m.group(1)] = m.group(2)
        assert len(facts) == 3
        np.testing.assert_array_equal(ex["query_spans"][:, 0], 96 + 1 - 5 * np.arange(4, 0, -1))
        np.testing.assert_array_equal(ex["query_spans"][:, 1] - ex["query_spans"][:, 0], 5)
        for r, (s, e) in enumerate(ex["query_spans"]):
            key, value = re.fullmatch(r"\n\$([a-d])(\d\d)", TOK.decode(w[s:e])).groups()
            assert facts[key] == value == TOK.decode(w[slice(*ex["answer_spans"][r] + 1)])
        assert np.flatnonzero(ex["weights"]).tolist() == sorted(
            t for a, b in ex["answer_spans"] for t in range(a, b)
        )
    # keys from an own alphabet (characters rare in the haystack): every key is one of them
    rare = cfg.replace(needle=dict(key_letters="JQZXYKVW", num_key_letters=26))
    assert rare.needle.key_alphabet == "JQZXYKVW"
    seen = set()
    for i in range(20):
        ex = make_source(rare, "train")[i]
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        keys = [
            re.fullmatch(r"\n\$(.)\d\d\n", TOK.decode(w[s:e])).group(1)
            for s, e in ex["needle_spans"]
        ]
        assert len(set(keys)) == 3 and set(keys) <= set("JQZXYKVW")
        seen |= set(keys)
    assert len(seen) >= 6  # drawn from the whole alphabet, not its first letters
    assert cfg.replace(needle=dict(key_letters="JQZXYKVW")).needle.key_alphabet == "JQZX"
    # the default (the paper's sentences) is unchanged, and query_spans marks its queries too
    ex = make_source(NEEDLE, "train")[0]
    w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
    for s, e in ex["query_spans"]:
        assert re.fullmatch(
            r"\nWhat is the magic number for [a-z]{5}\? \d{6}\.", TOK.decode(w[s:e])
        )


def test_context_len_schedule():
    cfg = DataConfig(
        source="mqar",
        seq_len=128,
        mqar=MqarData(num_pairs=8, num_queries=16, query_replacement=True),
        synthetic=SyntheticData(curriculum_steps=100),
    )
    assert cfg.task_min_seq_len == 48
    lens = [cfg.context_len(s) for s in (0, 1, 50, 99, 100, 10**6)]
    assert lens == [48, 48, 88, 127, 128, 128]
    assert cfg.replace(synthetic=dict(curriculum_start_len=100)).context_len(50) == 114
    assert DataConfig(source="mqar", seq_len=128, mqar=MqarData(num_pairs=8)).context_len(0) == 128


def test_needle_curriculum_short_examples_then_full():
    """Under a context-length curriculum, the train examples of step s hold the task at
    context_len(s) tokens (a shorter haystack, the same needles and queries), then PAD with no
    weight; from curriculum_steps on, and in validation, they are the curriculum-free examples."""
    base = DataConfig(
        source="needle",
        seq_len=96,
        max_files=40,
        needle=NeedleData(
            num_needles=3,
            num_queries=4,
            query_replacement=True,
            key_len=1,
            value_len=2,
            template="\n${key}{value}\n",
            query_template="\n${key}{value}",
        ),
    )
    cfg = base.replace(synthetic=dict(curriculum_steps=10))
    G = 4
    src, full = make_source(cfg, "train", global_batch=G), make_source(base, "train")
    for i in (0, 3, 4 * G + 1, 10 * G - 1):
        ex, L = src[i], cfg.context_len(i // G)
        assert L < 96
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        assert (w[L + 1 :] == PAD).all() and w[L] != PAD and not ex["weights"][L:].any()
        assert ex["query_spans"][-1, 1] == L + 1
        facts = {}
        for (s, e), (vs, ve) in zip(ex["needle_spans"], ex["needle_value_spans"]):
            m = re.fullmatch(r"\n\$([a-z])([1-9]\d)\n", TOK.decode(w[s:e]))
            facts[m.group(1)] = m.group(2)
            assert TOK.decode(w[vs:ve]) == m.group(2) and e <= L + 1 - 4 * 5
        for r, (s, e) in enumerate(ex["query_spans"]):
            key, value = re.fullmatch(r"\n\$([a-z])(\d\d)", TOK.decode(w[s:e])).groups()
            assert facts[key] == value == TOK.decode(w[slice(*ex["answer_spans"][r] + 1)])
        assert ex["weights"].sum() == 4 * 2
        assert 0.0 <= ex["needle_depths"].min() and ex["needle_depths"].max() <= 1.0
    assert cfg.context_len(0) == 38 and (src[0]["inputs"][39:] == PAD).all()  # no haystack
    for i in (10 * G, 10 * G + 3, 99 * G):  # after the curriculum: the full-length examples
        for k, v in full[i].items():
            np.testing.assert_array_equal(src[i][k], v, err_msg=k)
    val, val_full = make_source(cfg, "validation"), make_source(base, "validation")
    np.testing.assert_array_equal(val[0]["inputs"], val_full[0]["inputs"])
    with pytest.raises(DataError, match="global_batch"):
        make_source(cfg, "train")
    # make_dataset passes the global batch: batch j is step j
    it = iter(make_dataset(cfg, "train", batch_size=G))
    for step in range(3):
        b = next(it)
        L = cfg.context_len(step)
        assert (b["inputs"][:, L + 1 :] == PAD).all() and (b["inputs"][:, L] != PAD).all()
    assert "grow from 38 to 96 tokens over the first 10 steps" in describe(cfg)


def test_mqar_curriculum_layout():
    base = DataConfig(source="mqar", seq_len=64, mqar=MqarData(num_pairs=8, num_queries=3))
    cfg = base.replace(synthetic=dict(curriculum_steps=8, curriculum_start_len=30))
    src, full = make_source(cfg, "train", global_batch=2), make_source(base, "train")
    for i in range(0, 20, 3):
        ex, L = src[i], cfg.context_len(i // 2)
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        pairs = dict(zip(w[1:17:2].tolist(), w[2:17:2].tolist()))
        assert (w[17 : L + 1 - 6] == PAD).all() and (w[L + 1 :] == PAD).all()
        weighted = np.flatnonzero(ex["weights"])
        assert weighted.tolist() == [L - 5, L - 3, L - 1]
        for t in weighted:
            assert pairs[int(ex["inputs"][t])] == ex["targets"][t]
        np.testing.assert_array_equal(
            w[:17], np.concatenate([full[i]["inputs"], full[i]["targets"][-1:]])[:17]
        )
    assert cfg.context_len(0) == 30 and cfg.context_len(8) == 64


def test_needle_validation_padding_matches_train_batches():
    cfg = NEEDLE.replace(synthetic=dict(num_val_examples=5))
    val = list(make_dataset(cfg, "validation", batch_size=4))
    train = next(iter(make_dataset(cfg, "train", batch_size=4)))
    assert len(val) == 2 and val[1]["weights"].any(axis=1).tolist() == [True, False, False, False]
    for b in val:
        assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
            k: (v.shape, v.dtype) for k, v in train.items()
        }


# ============================================================================ MQAR
def test_mqar_layout_and_determinism():
    cfg = DataConfig(source="mqar", seq_len=64, mqar=MqarData(num_pairs=8, num_queries=3))
    src = make_source(cfg, "train")
    for i in range(5):
        ex = src[i]
        w = np.concatenate([ex["inputs"], ex["targets"][-1:]])
        assert w[0] == BOS
        keys, values = w[1:17:2], w[2:17:2]
        assert len(set(keys.tolist())) == 8 and keys.max() < 128 and values.min() >= 128
        pairs = dict(zip(keys.tolist(), values.tolist()))
        assert (w[17 : 65 - 6] == PAD).all()
        weighted = np.flatnonzero(ex["weights"])
        assert weighted.tolist() == [59, 61, 63]
        for r, t in enumerate(weighted):
            assert pairs[int(ex["inputs"][t])] == ex["targets"][t]  # key -> its value
            assert ex["answer_spans"][r].tolist() == [t, t + 1]
            s, e = ex["pair_spans"][ex["query_pair"][r]]
            assert ex["inputs"][s] == ex["inputs"][t]
    assert np.array_equal(src[2]["inputs"], make_source(cfg, "train")[2]["inputs"])
    assert not np.array_equal(src[2]["inputs"], make_source(cfg, "train", seed=5)[2]["inputs"])
    b = next(iter(make_dataset(cfg, "validation", batch_size=4)))
    assert b["inputs"].shape == (4, 64) and b["query_pair"].shape == (4, 3)
    assert "MQAR" in describe(cfg)


def test_mqar_key_and_value_vocabulary():
    """mqar_num_keys / mqar_num_values narrow the vocabularies; at their defaults (128 each)
    the stream is the one the generator wrote before they existed (the same draws)."""
    cfg = DataConfig(
        source="mqar",
        seq_len=64,
        mqar=MqarData(num_pairs=8, num_queries=3, num_keys=10, num_values=4),
    )
    src = make_source(cfg, "train")
    for i in range(20):
        w = np.concatenate([src[i]["inputs"], src[i]["targets"][-1:]])
        keys, values = w[1:17:2], w[2:17:2]
        assert len(set(keys.tolist())) == 8 and keys.max() < 10
        assert values.min() >= 128 and values.max() < 132
    default = DataConfig(source="mqar", seq_len=64, mqar=MqarData(num_pairs=8, num_queries=3))
    for i in range(3):  # the original draws: keys from 128, values from 128..255
        rng = np.random.default_rng([0, 0, i])
        keys = rng.choice(128, size=8, replace=False)
        values = rng.integers(128, 256, size=8)
        ex = make_source(default, "train")[i]
        assert ex["inputs"][1:17:2].tolist() == keys.tolist()
        assert ex["inputs"][2:17:2].tolist() == values.tolist()


def test_query_correct_scores_each_answer_span():
    cfg = DataConfig(source="mqar", seq_len=32, mqar=MqarData(num_pairs=4, num_queries=2))
    b = next(iter(make_dataset(cfg, "validation", batch_size=4)))
    ok, has = query_correct(b["targets"], b)
    assert ok.shape == has.shape == (4, 2) and ok.all() and has.all()
    wrong = b["targets"].copy()
    s = b["answer_spans"][1, 0, 0]
    wrong[1, s] = (wrong[1, s] + 1) % 259  # example 1, query 0 wrong
    ok, has = query_correct(np.eye(259, dtype=np.float32)[wrong], b)  # logits work too
    assert ok.tolist() == [[True, True], [False, True], [True, True], [True, True]]
    padded = dict(b, weights=b["weights"] * np.array([[1], [0], [1], [1]], np.float32))
    ok, has = query_correct(wrong, padded)
    assert has.tolist() == [[True, True], [False, False], [True, True], [True, True]]
    assert not ok[1].any()  # padding is neither right nor counted
    needle = next(iter(make_dataset(NEEDLE, "validation", batch_size=2)))
    wrong = needle["targets"].copy()
    s, e = needle["answer_spans"][0, 1]
    wrong[0, e - 1] = ord("x")  # the last digit of a multi-digit answer
    ok, _ = query_correct(wrong, needle)
    assert ok[0].tolist() == [True, False] and ok[1].all()
    with pytest.raises(ValueError, match="do not match"):
        query_correct(wrong[:, :5], needle)


# ============================================================================ answer_accuracy
def test_answer_accuracy_numpy_and_jax():
    cfg = DataConfig(source="mqar", seq_len=32, mqar=MqarData(num_pairs=4, num_queries=2))
    b = next(iter(make_dataset(cfg, "validation", batch_size=4)))
    assert answer_accuracy(b["targets"], b) == 1.0
    wrong = b["targets"].copy()
    t = np.flatnonzero(b["weights"][1])[0]
    wrong[1, t] = (wrong[1, t] + 1) % 259
    assert answer_accuracy(wrong, b) == 0.75
    unweighted = b["targets"].copy()
    unweighted[:, 0] = 0  # mistakes where weight == 0 do not count
    assert answer_accuracy(unweighted, b) == 1.0
    logits = np.eye(259, dtype=np.float32)[wrong]  # [B, T, V]
    assert answer_accuracy(logits, b) == 0.75
    correct, has = answer_correct(wrong, b)
    assert correct.tolist() == [True, False, True, True] and has.all()
    padded = dict(b, weights=b["weights"] * np.array([[1], [0], [1], [0]], np.float32))
    assert answer_accuracy(wrong, padded) == 1.0  # examples without answers are left out
    assert answer_accuracy(wrong, dict(b, weights=np.zeros_like(b["weights"]))) == 0.0

    import jax
    import jax.numpy as jnp

    jb = {k: jnp.asarray(v) for k, v in b.items()}
    acc = jax.jit(answer_accuracy)(jnp.asarray(logits), jb)
    assert float(acc) == 0.75
    with pytest.raises(ValueError, match="do not match"):
        answer_accuracy(wrong[:, :5], b)
    lm = next(iter(make_dataset(SMALL_STDLIB, "validation", batch_size=2)))
    assert answer_accuracy(lm["targets"], lm) is None  # a corpus has no answers
    assert answer_correct(lm["targets"], lm)[0].all()


# ============================================================================ errors
def assert_error(exc_type, fn, *contains):
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    assert "Fix:" in msg, msg
    for c in contains:
        assert c in msg, msg
    return msg


@pytest.mark.parametrize(
    "kwargs, field, contains",
    [
        (dict(source="wiki"), "source", "'stdlib', 'text', 'tokens', 'needle', 'mqar'"),
        (dict(seq_len=4), "seq_len", ">= 8"),
        (dict(val_fraction=1.0), "val_fraction", "[0, 1)"),
        (dict(val_fraction=-0.1), "val_fraction", "[0, 1)"),
        (dict(seed=-1), "seed", "2**32"),
        (dict(tokens=dict(dtype="int8")), "tokens.dtype", "uint16"),
        (dict(max_files=0), "max_files", ">= 1"),
        (dict(seq_len="256"), "seq_len", "expected int"),
        (dict(shuffle=1), "shuffle", "expected bool"),
        (dict(source="text"), "path", "None"),
        (dict(source="tokens"), "path", "None"),
        (dict(path="/tmp"), "path", "does not read files"),
        (dict(source="mqar", path="x.txt"), "path", "does not read files"),
        (
            dict(source="needle", seq_len=1024, needle=dict(num_needles=2, num_queries=3)),
            "needle.num_queries",
            "<= 2",
        ),
        (dict(source="needle", seq_len=100), "seq_len", "needs >= 244"),
        (
            dict(source="needle", seq_len=512, needle=dict(depths=(0.1, 0.2))),
            "needle.depths",
            "exactly 4",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(depths=(0.1, 0.2, 0.3, 1.5))),
            "needle.depths",
            "[0, 1]",
        ),
        (dict(needle=dict(depths=(0.5,) * 4)), "needle.depths", "is a needle setting"),
        (
            dict(source="needle", seq_len=512, needle=dict(depths="a,b")),
            "needle.depths",
            "expected",
        ),
        (dict(source="mqar", seq_len=1024, mqar=dict(num_pairs=200)), "mqar.num_pairs", "128"),
        (dict(source="mqar", mqar=dict(num_pairs=4, num_queries=5)), "mqar.num_queries", "<= 4"),
        (dict(source="mqar", seq_len=32, mqar=dict(num_pairs=16)), "seq_len", "needs >= 36"),
        (
            dict(source="mqar", seq_len=64, mqar=dict(num_pairs=16, num_keys=8)),
            "mqar.num_pairs",
            "num_keys=8",
        ),
        (dict(source="mqar", seq_len=64, mqar=dict(num_keys=129)), "mqar.num_keys", "[1, 128]"),
        (
            dict(source="mqar", seq_len=64, mqar=dict(num_values=0)),
            "mqar.num_values",
            "[1, 128]",
        ),
        (
            dict(synthetic=dict(curriculum_steps=100)),
            "synthetic.curriculum_steps",
            "is a synthetic setting but source='stdlib'",
        ),
        (
            dict(source="mqar", seq_len=64, synthetic=dict(curriculum_steps=-1)),
            "synthetic.curriculum_steps",
            ">= 0",
        ),
        (
            dict(source="mqar", seq_len=64, synthetic=dict(curriculum_start_len=40)),
            "synthetic.curriculum_start_len",
            "curriculum_steps=0",
        ),
        (
            dict(
                source="mqar",
                seq_len=64,
                mqar=dict(num_pairs=8, num_queries=4),
                synthetic=dict(curriculum_steps=10, curriculum_start_len=20),
            ),
            "synthetic.curriculum_start_len",
            "[24, seq_len=64]",
        ),
        (
            dict(
                source="mqar",
                seq_len=64,
                mqar=dict(num_pairs=8),
                synthetic=dict(curriculum_steps=10, curriculum_start_len=65),
            ),
            "synthetic.curriculum_start_len",
            "[20, seq_len=64]",
        ),
        (
            dict(
                source="needle",
                seq_len=1024,
                needle=dict(value_len=1, num_needles=10, num_queries=1),
            ),
            "needle.value_len",
            "distinct",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(template="{value} is {key}")),
            "needle.template",
            "before",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(query_template="What is {key}?")),
            "needle.query_template",
            "exactly once",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(template="{key} \u2192 {value}")),
            "needle.template",
            "ASCII",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(query_template="{key} {value} {x}")),
            "needle.query_template",
            "braces",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(num_key_letters=27)),
            "needle.num_key_letters",
            "[1, 26]",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(key_letters="JQJZ")),
            "needle.key_letters",
            "once",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(key_letters="AB1C")),
            "needle.key_letters",
            "no digits",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(key_letters="")),
            "needle.key_letters",
            "non-empty",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(key_len=1, key_letters="JQZ")),
            "needle.key_len",
            "fewer than 4 distinct keys",
        ),
        (
            dict(source="mqar", needle=dict(key_letters="JQZ")),
            "needle.key_letters",
            "is a needle setting but source='mqar'",
        ),
        (
            dict(source="needle", seq_len=512, needle=dict(key_len=1, num_key_letters=3)),
            "needle.key_len",
            "fewer than 4 distinct keys",
        ),
        (
            dict(source="mqar", needle=dict(query_template="{key}={value}")),
            "needle.query_template",
            "is a needle setting but source='mqar'",
        ),
    ],
)
def test_config_errors(kwargs, field, contains):
    """Each bad setting, a section's (given as a dict: its other fields at their defaults)
    included, is refused naming its key and the fix."""
    msg = assert_error(
        ConfigError, lambda: DataConfig().replace(**kwargs), f"DataConfig.{field}", contains
    )
    assert msg.startswith(f"DataConfig.{field}: ")


def test_each_sources_settings_are_a_section_and_the_flat_spelling_is_refused():
    """The data settings of one source sit together under ``data.<section>.`` (``--help``
    lists them so), an earlier version's flat key is refused naming its new one, and a run
    folder's saved flat config loads into the sections (a task's query settings into its own)."""
    from diffjax.data.config import MOVED
    from diffjax.train import apply_overrides, config_keys, default_config

    keys = [k for k, _, _ in config_keys(default_config()) if k.startswith("data.")]
    for section in ("needle", "mqar", "synthetic", "stdlib", "tokens", "mixture"):
        at = [i for i, k in enumerate(keys) if k.startswith(f"data.{section}.")]
        assert at and at == list(range(at[0], at[-1] + 1)), section  # together
    for old, new in MOVED.items():
        with pytest.raises(ConfigError, match=rf"'data\.{old}' has moved\. Fix: write data\.{new}"):
            apply_overrides(default_config(), [f"data.{old}=1"])
    exp = apply_overrides(
        default_config(), ["data.source=mqar", "data.seq_len=64", "data.mqar.num_pairs=8"]
    )
    assert exp.data.mqar.num_pairs == 8 and exp.data.task is exp.data.mqar
    old_needle = dict(
        source="needle",
        seq_len=512,
        num_needles=3,
        num_queries=5,
        query_replacement=True,
        needle_key_letters="JQZ",
        curriculum_steps=4,
        stdlib_part="modules",
        document_mask=None,
    )
    loaded = DataConfig.from_saved(old_needle)
    assert loaded == DataConfig(
        source="needle",
        seq_len=512,
        needle=NeedleData(num_needles=3, num_queries=5, query_replacement=True, key_letters="JQZ"),
        synthetic=SyntheticData(curriculum_steps=4),
        stdlib=StdlibData(part="modules"),
    )
    old_mqar = dict(source="mqar", seq_len=64, num_pairs=8, num_queries=3, num_needles=4)
    assert DataConfig.from_saved(old_mqar).mqar == MqarData(num_pairs=8, num_queries=3)
    assert DataConfig.from_saved(old_mqar).needle == NeedleData()  # the default, not the source's
    assert DataConfig.from_saved(loaded.to_dict()) == loaded  # this version's own
    assert DataConfig.from_saved({"source": "stdlib"}).document_mask is False  # saved before it


def test_config_coercions_and_roundtrip():
    c = DataConfig(
        source="needle",
        seq_len=np.int64(512),
        val_fraction=0,
        shuffle=np.bool_(False),
        needle=NeedleData(depths="0, 0.5,1,0.25"),
    )
    assert c.needle.depths == (0.0, 0.5, 1.0, 0.25) and type(c.seq_len) is int
    assert isinstance(c.val_fraction, float) and c.shuffle is False
    assert DataConfig(
        source="needle", seq_len=512, needle=NeedleData(depths=[0, 1, 1, 0])
    ).needle.depths == (
        0.0,
        1.0,
        1.0,
        0.0,
    )
    assert c.replace(seed=3).seed == 3 and c.to_dict()["seq_len"] == 512
    assert issubclass(DataError, ConfigError) and issubclass(DataError, ValueError)


def test_data_errors_paths_and_text(tmp_path):
    missing = tmp_path / "nope.txt"
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="text", path=str(missing))),
        "DataConfig.path",
        "does not exist",
        str(missing),
    )
    assert_error(
        DataError,
        lambda: make_dataset(DataConfig(source="text", path=str(missing)), "train", batch_size=2),
        "does not exist",
    )
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="text", path=str(tmp_path / "*.md"))),
        "matches nothing",
        "*.md",
    )
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01\x02" * 100)
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="text", path=str(tmp_path))),
        "hold no text",
        str(tmp_path),
        "source='tokens'",
    )
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="text", path=str(empty_dir))),
        "no usable files",
    )
    (tmp_path / "short.txt").write_text("tiny")
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="text", seq_len=64, path=str(tmp_path / "short.txt"))),
        "DataConfig.seq_len",
        "fewer than seq_len + 1",
    )
    assert_error(
        DataError,
        lambda: make_dataset(
            DataConfig(source="text", seq_len=64, path=str(tmp_path / "short.txt")),
            "train",
            batch_size=2,
        ),
        "seq_len + 1",
    )
    assert_error(DataError, lambda: check_data(DataConfig(), vocab_size=100), "vocab_size=259")


def test_data_errors_token_files(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="tokens", path=str(tmp_path / "empty.bin"))),
        "empty",
        "empty.bin",
    )
    np.save(tmp_path / "empty.npy", np.zeros((0,), np.uint16))
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="tokens", path=str(tmp_path / "empty.npy"))),
        "empty",
        "empty.npy",
    )
    np.save(tmp_path / "big.npy", np.array([1, 2, 3, 500, 4] * 20, np.uint16))
    cfg = DataConfig(source="tokens", path=str(tmp_path / "big.npy"), seq_len=8, val_fraction=0.2)
    assert_error(
        DataError,
        lambda: check_data(cfg, vocab_size=259),
        "id 500",
        "position 3",
        "big.npy",
        "vocab_size >= 501",
    )
    assert_error(
        DataError, lambda: make_dataset(cfg, "train", batch_size=2, vocab_size=259), "id 500"
    )
    assert check_data(cfg, vocab_size=501).train_tokens == 80
    np.save(tmp_path / "neg.npy", np.array([1, -2] * 50, np.int32))
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="tokens", seq_len=8, path=str(tmp_path / "neg.npy"))),
        "negative",
    )
    np.save(tmp_path / "float.npy", np.ones(100, np.float32))
    assert_error(
        DataError,
        lambda: check_data(
            DataConfig(source="tokens", seq_len=8, path=str(tmp_path / "float.npy"))
        ),
        "float32",
    )
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="tokens", seq_len=8, path=str(tmp_path / "odd.bin"))),
        "DataConfig.tokens.dtype",
        "not a multiple of 2",
    )
    (tmp_path / "x.txt").write_text("text")
    assert_error(
        DataError,
        lambda: check_data(DataConfig(source="tokens", seq_len=8, path=str(tmp_path / "x.txt"))),
        "not a token file",
    )


def test_pipeline_argument_errors():
    for split in ("val", "test", "TRAIN"):
        assert_error(
            DataError,
            lambda: make_dataset(SMALL_STDLIB, split, batch_size=2),
            "unknown split",
            "'train' or 'validation'",
        )
    assert_error(DataError, lambda: make_source(SMALL_STDLIB, "valid"), "unknown split")
    assert_error(DataError, lambda: make_dataset(SMALL_STDLIB, "train", batch_size=0), "batch_size")
    assert_error(
        DataError,
        lambda: make_dataset(SMALL_STDLIB, "train", batch_size=2, process_index=2, process_count=2),
        "process_index",
    )
    assert_error(
        DataError,
        lambda: make_dataset(SMALL_STDLIB, "train", batch_size=2, num_epochs=0),
        "num_epochs",
    )
    assert_error(
        DataError,
        lambda: make_dataset(SMALL_STDLIB.replace(val_fraction=0.0), "validation", batch_size=2),
        "DataConfig.val_fraction",
    )
    assert_error(
        DataError,
        lambda: make_dataset(SMALL_STDLIB, "train", batch_size=10**7, num_epochs=1),
        "fewer than one global batch",
    )
