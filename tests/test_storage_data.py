"""Training data in a bucket, against a real GCS API server (fake-gcs-server on 127.0.0.1, the
``gcs_server`` fixture): ``prepare`` reading ``gs://`` inputs and writing ``gs://`` shards (the
same bytes as a local preparation, the manifest last, an interrupted upload resumed), the
``tokens`` source reading a prepared prefix by ranged reads (batches and iterator states equal
to the local copy's bit for bit, each process reading only its own windows), a training run
killed and resumed from bucket data, and every bad prefix refused before training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from gcs_emulator import LocalPathGuard, StatusServer
from test_prepare import write_corpus
from test_storage_runs import ROOT, SHORT, fresh_machine, losses

from diffjax.infra import storage
from diffjax.compare.cli import main as train_main
from diffjax.config import ConfigError
from diffjax.data import DataConfig, DataError, check_data, make_dataset, make_source
from diffjax.data import prepare as prep
from diffjax.data.sources import load_corpus
from tiny import tiny_run


def prepare(inputs, out, **kw) -> prep.PrepareResult:
    kw.setdefault("shard_tokens", 700)
    kw.setdefault("val_fraction", 0.2)
    kw.setdefault("progress", False)
    options = prep.PrepareOptions(tuple(map(str, inputs)), "byte", str(out), **kw)
    return prep.prepare(options)


def upload_tree(local, url: str) -> None:
    for root, _, files in os.walk(local):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local)
            storage.upload(os.path.join(root, name), f"{url}/{rel}")


def prepared_bytes(objects: dict[str, bytes]) -> dict[str, bytes]:
    return {n: b for n, b in objects.items() if n.endswith(".bin")}


@pytest.fixture(scope="module")
def corpus(gcs_server, tmp_path_factory):
    """One corpus prepared twice: locally, and from its inputs in a bucket into the bucket;
    ``(local folder, gs:// prefix, inputs folder)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("data")
    write_corpus(tmp / "in", docs=120)
    pq.write_table(
        pa.table({"text": [f"parquet row {i} " * 9 for i in range(30)]}), tmp / "in/d.parquet"
    )
    bucket = gcs_server.new_bucket()
    upload_tree(tmp / "in", f"{bucket}/raw")
    local = tmp / "prepared"
    prepare([tmp / "in"], local)
    with LocalPathGuard():  # no gs:// URL reaches open() or os.*
        result = prepare([f"{bucket}/raw"], f"{bucket}/prepared", workers=2)
    assert result.shards_written > 3
    return str(local), f"{bucket}/prepared", tmp / "in"


# ---------------------------------------------------------------------------- prepare
def test_prepare_from_and_into_a_bucket_writes_the_local_bytes(gcs_server, corpus):
    """Inputs (.txt, .jsonl, .jsonl.gz, .parquet) read from gs://, shards uploaded to gs://:
    the shards are the local preparation's bytes, the manifest the same one; a rerun finds it
    finished and writes nothing."""
    local, remote, _ = corpus
    objects = gcs_server.objects(remote)
    local_files = {n: open(os.path.join(local, n), "rb").read() for n in os.listdir(local)}
    assert prepared_bytes(objects) == prepared_bytes(local_files)
    mine, theirs = json.loads(objects["manifest.json"]), json.loads(local_files["manifest.json"])
    for key in ("shards", "totals", "fingerprint", "dtype", "vocab_size", "tokenizer"):
        assert mine[key] == theirs[key], key
    assert {i["kind"] for i in mine["inputs"]} == {"txt", "jsonl", "jsonl.gz", "parquet"}
    assert all(i["path"].startswith("gs://") for i in mine["inputs"])
    bucket = remote.rsplit("/", 1)[0]
    assert prepare([f"{bucket}/raw"], remote).shards_written == 0


def test_an_interrupted_upload_keeps_the_finished_shards(gcs_server, bucket, corpus, monkeypatch):
    """Killed after two shards: no manifest (a prefix with a manifest is complete), the two
    shards whole; the rerun uploads only the others and ends with the same bytes."""
    local, remote, inputs = corpus
    out = f"{bucket}/prepared"
    real, uploads = prep.write_shard, []

    def dies_after_two(path, tokens):
        if path.endswith(".idx"):  # each shard's document index follows it
            return real(path, tokens)
        if len(uploads) == 2:
            raise KeyboardInterrupt  # the process stopped here
        uploads.append(path)
        return real(path, tokens)

    monkeypatch.setattr(prep, "write_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare([inputs], out)
    monkeypatch.setattr(prep, "write_shard", real)
    partial = gcs_server.objects(out)
    assert "manifest.json" not in partial
    assert len(prepared_bytes(partial)) == 2
    with pytest.raises(DataError, match=r"holds no manifest.json.*Fix: prepare the corpus"):
        load_corpus(DataConfig(source="tokens", path=out))
    total = len(prepared_bytes(gcs_server.objects(remote)))
    assert prepare([inputs], out).shards_written == total - 2
    assert gcs_server.objects(out).keys() == gcs_server.objects(remote).keys()
    assert prepared_bytes(gcs_server.objects(out)) == prepared_bytes(gcs_server.objects(remote))


# ---------------------------------------------------------------------------- reading
@pytest.mark.parametrize("split", ["train", "validation"])
def test_batches_from_the_bucket_equal_the_local_ones_bit_for_bit(corpus, split):
    """Each of two processes' batches (and the iterator's state after each) from the bucket are
    those of the local copy; a state set mid-way continues with the same batches."""
    local, remote, _ = corpus
    epochs = 2 if split == "train" else None
    for index in range(2):
        kw = dict(batch_size=2, process_index=index, process_count=2, num_epochs=epochs)
        mine = iter(make_dataset(DataConfig(source="tokens", path=remote, seq_len=16), split, **kw))
        theirs = iter(
            make_dataset(DataConfig(source="tokens", path=local, seq_len=16), split, **kw)
        )
        n, states = 0, []
        for a, b in zip(mine, theirs, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
            assert mine.get_state() == theirs.get_state()
            states.append((mine.get_state(), a))
            n += 1
        assert n > 10
        state, _ = states[n // 2]
        again = iter(
            make_dataset(DataConfig(source="tokens", path=remote, seq_len=16), split, **kw)
        )
        again.set_state(state)
        assert np.array_equal(next(again)["inputs"], states[n // 2 + 1][1]["inputs"])


def test_each_process_reads_only_the_windows_of_its_rows(corpus, monkeypatch):
    """The byte ranges each process asks the bucket for are exactly its own rows' windows, a
    batch in one round of concurrent reads; two processes together read every window of the
    global batches once."""
    _, remote, _ = corpus
    T, B = 16, 3
    reads: list[list[tuple[str, int, int]]] = []
    real = storage.read_ranges

    def recorded(urls, starts, stops):
        if all(u.endswith(".bin") for u in urls):  # not the document index (read once, whole)
            reads.append(list(zip(urls, starts, stops)))
        return real(urls, starts, stops)

    monkeypatch.setattr(storage, "read_ranges", recorded)
    config = DataConfig(source="tokens", path=remote, seq_len=T, prefetch=0)
    corpus_ = load_corpus(config)
    offsets = np.cumsum([0] + [p.length for p in corpus_.train._pieces])
    urls = [p.url for p in corpus_.train._pieces]

    def window_starts(rounds) -> list[int]:
        """Token offsets of the windows read (a window across two shards counts once)."""
        out = []
        for r in rounds:
            for url, start, stop in r:
                at = offsets[urls.index(url)] + start // 2
                if out and out[-1][1] == at:  # the second half of a window split by shards
                    out[-1] = (out[-1][0], at + (stop - start) // 2)
                else:
                    out.append((at, at + (stop - start) // 2))
        assert all(b - a == T + 1 for a, b in out)
        return [a for a, _ in out]

    got = []
    for index in range(2):
        reads.clear()
        it = iter(make_dataset(config, "train", batch_size=B, process_index=index, process_count=2))
        for _ in range(4):
            next(it)
        assert len(reads) == 4  # one round of concurrent ranged reads per batch
        got.append(window_starts(reads))
    every = DataConfig(source="tokens", path=remote, seq_len=T, prefetch=0)
    reads.clear()
    whole = iter(make_dataset(every, "train", batch_size=2 * B))
    for _ in range(4):
        next(whole)
    both = window_starts(reads)
    for j in range(4):  # global batch j: process 0's rows, then process 1's
        rows = both[j * 2 * B : (j + 1) * 2 * B]
        assert got[0][j * B : (j + 1) * B] == rows[:B]
        assert got[1][j * B : (j + 1) * B] == rows[B:]
    assert not set(got[0]) & set(got[1])


# ---------------------------------------------------------------------------- training
KILLED = """
import os, signal, sys
from diffjax.compare.cli import main

def kill(step, checkpointer):
    if step == 8:
        os.kill(os.getpid(), signal.SIGKILL)

sys.exit(main(sys.argv[1:], after_step=kill))
"""


@pytest.mark.xdist_group("gcs-resume")
def test_training_from_the_bucket_is_killed_resumed_and_equals_local_data(tmp_path, bucket, corpus):
    """train.py with data.path in a bucket: SIGKILL after step 8, resumed on an empty disk; its
    10 losses are, bit for bit, those of the same run trained from the local copy."""
    local, remote, _ = corpus
    data = ["data.source=tokens"]
    run_local = tmp_path / "local"
    out = subprocess.run(
        [sys.executable, "train.py", f"run.dir={run_local}", *SHORT, *data, f"data.path={local}"],
        cwd=ROOT,
        env=fresh_machine(tmp_path, "a"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = f"{bucket}/run"
    args = [f"run.dir={run}", *SHORT, *data, f"data.path={remote}"]
    out = subprocess.run(
        [sys.executable, "-c", KILLED, *args],
        cwd=ROOT,
        env=fresh_machine(tmp_path, "b"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    out = subprocess.run(
        [sys.executable, "train.py", *args, "--resume"],
        cwd=ROOT,
        env=fresh_machine(tmp_path, "c"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step" in out.stdout
    assert "data config differs" not in out.stdout
    assert losses(f"{run}/diff/seed_0") == losses(run_local / "diff" / "seed_0")


# ---------------------------------------------------------------------------- bad input
TINY_TOKENS = tiny_run(
    "compare.twins=",
    "train.steps=2",
    "data.source=tokens",
    "train.batch_size=4",
    "train.kernel_check=off",
)


def refused(capsys, tmp_path, *args) -> str:
    with LocalPathGuard():
        rc = train_main([f"run.dir={tmp_path / 'run'}", *TINY_TOKENS, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "Fix:" in err
    assert not (tmp_path / "run" / "diff").exists()  # refused before training
    return err


def copy_prefix(gcs_server, src: str, dst: str) -> None:
    for name, data in gcs_server.objects(src).items():
        storage.write_bytes(f"{dst}/{name}", data)


def test_a_prefix_without_a_manifest_is_refused(gcs_server, bucket, corpus, capsys, tmp_path):
    _, remote, _ = corpus
    copy_prefix(gcs_server, remote, f"{bucket}/nomanifest")
    storage.remove(f"{bucket}/nomanifest/manifest.json")
    err = refused(capsys, tmp_path, f"data.path={bucket}/nomanifest")
    assert f"{bucket}/nomanifest" in err and "holds no manifest.json" in err
    assert "python -m diffjax.data.prepare" in err


def test_a_shard_of_another_size_is_refused(gcs_server, bucket, corpus, capsys, tmp_path):
    _, remote, _ = corpus
    copy_prefix(gcs_server, remote, f"{bucket}/cut")
    storage.write_bytes(f"{bucket}/cut/train_00001.bin", b"\0\0")
    err = refused(capsys, tmp_path, f"data.path={bucket}/cut")
    assert "train_00001.bin" in err and "but the object is 2 bytes" in err


def test_a_tokenizer_other_than_the_manifests_is_refused(corpus, capsys, tmp_path):
    from tokenizers import Tokenizer, models

    _, remote, _ = corpus
    tok = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tok))
    err = refused(capsys, tmp_path, f"data.path={remote}", f"data.tokenizer={tok}")
    assert "was prepared with 'byte'" in err and "data.tokenizer" in err


def test_a_bucket_that_cannot_be_read_is_refused(gcs_server, capsys, tmp_path, monkeypatch):
    err = refused(capsys, tmp_path, "data.path=gs://no-such-bucket-diffjax/prepared")
    assert "gs://no-such-bucket-diffjax does not exist" in err and "data.path" in err
    with StatusServer(403) as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        err = refused(capsys, tmp_path, "data.path=gs://some-bucket/prepared")
    assert "may not read gs://some-bucket" in err and "roles/storage.objectViewer" in err


def test_urls_the_data_cannot_take_are_refused_at_construction(tmp_path):
    with pytest.raises(ConfigError, match=r"DataConfig.path.*one prepared prefix.*Fix: prepare"):
        DataConfig(source="text", path="gs://b/texts")
    with pytest.raises(ConfigError, match=r"several paths"):
        DataConfig(source="tokens", path="gs://b/a,gs://b/b")
    with pytest.raises(ConfigError, match=r"s3:// is not one diffjax reads"):
        DataConfig(source="tokens", path="s3://b/prepared")
    with pytest.raises(ConfigError, match=r"DataConfig.prefetch: must be >= 0, got -1"):
        DataConfig(prefetch=-1)
    with pytest.raises(ConfigError, match=r"prepare.out.*s3:// is not one"):
        prepare([tmp_path], "s3://b/prepared")


def test_prepare_refuses_a_missing_bucket_and_input_before_any_work(
    gcs_server, bucket, tmp_path, monkeypatch, capsys
):
    """Refused with the fix, nothing created: not the bucket, and never a local folder named
    ``gs:`` (what a URL taken for a local path would make)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text\n")
    with pytest.raises(
        ConfigError, match=r"prepare.out.*gs://no-such-bucket-diffjax does not exist"
    ):
        prepare([tmp_path / "a.txt"], "gs://no-such-bucket-diffjax/prepared")
    cmd = ["a.txt", "prepare.tokenizer=byte", "prepare.out=gs://no-such-bucket-diffjax/p"]
    cmd += ["prepare.progress=false"]
    assert prep.main(cmd) == 2
    assert "Fix: create it" in capsys.readouterr().err
    assert "no-such-bucket-diffjax" not in [b.name for b in gcs_server.client().list_buckets()]
    with pytest.raises(prep.PrepareError, match=r"INPUT: .*does not exist.*Fix"):
        prepare([f"{bucket}/missing.txt"], tmp_path / "out")
    with pytest.raises(prep.PrepareError, match=r"the glob .* matches nothing"):
        prepare([f"{bucket}/raw/*.jsonl"], tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_check_data_describes_the_bucket_without_reading_every_token(corpus, monkeypatch):
    """The summary of a prepared prefix comes from its manifest and one listing: not a byte
    of a shard is downloaded to check the ids (the manifest's vocab_size is checked)."""
    _, remote, _ = corpus
    monkeypatch.setattr(storage, "read_ranges", lambda *a: pytest.fail("read a shard"))
    summary = check_data(DataConfig(source="tokens", path=remote, seq_len=16), 259)
    assert summary.train_tokens > 0 and remote in summary.description
    with pytest.raises(
        DataError, match=r"model.vocab_size: 100 is smaller than the vocab_size 259"
    ):
        check_data(DataConfig(source="tokens", path=remote, seq_len=16), 100)


def test_a_prefix_in_a_bucket_keeps_documents_apart_as_the_local_folder(corpus):
    """The document index is read from the bucket (each shard's .idx, fetched once): every
    window's segment ids, positions and weights are the local folder's."""
    local, remote, _ = corpus
    here = make_source(DataConfig(source="tokens", path=local, seq_len=16), "train")
    there = make_source(DataConfig(source="tokens", path=remote, seq_len=16), "train")
    assert len(here) == len(there) and there.documents is not None
    batch = there._getitems(list(range(len(there))))
    assert any(ex["segment_ids"].max() > 1 for ex in batch)
    for i, ex in enumerate(batch):
        for k, v in here[i].items():
            np.testing.assert_array_equal(ex[k], v, err_msg=f"window {i}: {k}")
