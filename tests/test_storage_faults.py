"""A bucket that answers slowly, wrongly or not at all: diffjax.infra.storage's calls are bounded and
retried, and train.py needs nothing but ``STORAGE_EMULATOR_HOST`` to use an emulator.

The faults come from ``fault_proxy.FaultProxy`` on 127.0.0.1 in front of the real emulator
(fake-gcs-server): 503 and 429 answers, reset connections, stalls and a server that is gone.
Each child ``train.py`` runs in an environment holding only ``PATH``, ``HOME``, ``TMPDIR`` and
``STORAGE_EMULATOR_HOST`` (and, where a test says so, ``DIFFJAX_STORAGE_TIMEOUT_S``): none of
the variables the test session sets for its own clients (tests/gcs_emulator.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from diffjax.infra import storage
from diffjax.train.metrics import read_metrics
from fault_proxy import FaultProxy
from tiny import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = tiny_run(
    "compare.twins=",
    "train.kernel_check=off",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "run.sync_every_s=1",
    drop=("data.max_files",),
)


def only_emulator_env(host: str, tmp_path, **extra) -> dict[str, str]:
    """The whole environment of a child: no variable of the test session's emulator setup."""
    tmp = tmp_path / f"tmp-{len(os.listdir(tmp_path))}"
    tmp.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp)),
        "TMPDIR": str(tmp),
        "STORAGE_EMULATOR_HOST": host,
    }
    return {**env, **extra}


def run(args, env, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def write_corpus(folder) -> None:
    os.makedirs(folder, exist_ok=True)
    for i in range(6):
        text = "".join(f"def f{i}_{j}(x):\n    return x * {i + j}\n" for j in range(150))
        (folder / f"d{i}.txt").write_text(text)


def losses(model_dir: str) -> list[float]:
    return [r["loss"] for r in read_metrics(storage.join(model_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def clean_run(gcs_server, tmp_path_factory):
    """A corpus prepared into a bucket and 4 steps trained from it into the bucket, by children
    whose environment holds only STORAGE_EMULATOR_HOST, then resumed to 6 steps."""
    tmp = tmp_path_factory.mktemp("clean")
    bucket = gcs_server.new_bucket()
    write_corpus(tmp / "corpus")
    env = only_emulator_env(gcs_server.url, tmp)
    out = run(
        [
            "-m",
            "diffjax.data.prepare",
            str(tmp / "corpus"),
            "prepare.tokenizer=byte",
            f"prepare.out={bucket}/prep",
            "prepare.val_fraction=0.2",
            "prepare.progress=false",
        ],
        env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = ["data.source=tokens", f"data.path={bucket}/prep"]
    args = ["train.py", f"run.dir={bucket}/run", *TINY, *data]
    out = run([*args, "train.steps=4"], env)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run([*args, "train.steps=6", "--resume"], env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step 4" in out.stdout
    return bucket, data


@pytest.mark.xdist_group("storage-faults")
def test_train_py_needs_only_the_emulator_variable(clean_run):
    bucket, _ = clean_run
    assert len(losses(f"{bucket}/run/diff/seed_0")) == 6
    assert storage.exists(f"{bucket}/run/report.md")


@pytest.mark.xdist_group("storage-faults")
@pytest.mark.parametrize("kind", ["503", "reset"])
def test_a_run_through_transient_faults_equals_the_clean_run(kind, clean_run, gcs_server, tmp_path):
    """One request in twenty answered 503 or its connection reset: the data read, the
    checkpoints, metrics and report written and a resume all through the proxy; the losses
    equal the clean run's bit for bit. (Each fault at a fifth of the requests, 429 too, with
    its time cost: benchmarks/storage_faults.py.)"""
    bucket, data = clean_run
    with FaultProxy(gcs_server.url, seed=1) as proxy:
        proxy.set(kind, rate=0.05)
        env = only_emulator_env(proxy.url, tmp_path)
        args = ["train.py", f"run.dir={bucket}/{kind}", *TINY, *data]
        out = run([*args, "train.steps=4"], env)
        assert out.returncode == 0, out.stderr[-3000:]
        out = run([*args, "train.steps=6", "--resume"], env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert proxy.injected > 0
    assert losses(f"{bucket}/{kind}/diff/seed_0") == losses(f"{bucket}/run/diff/seed_0")


@pytest.mark.xdist_group("storage-faults")
def test_a_bucket_that_is_gone_is_refused_within_the_budget(clean_run, gcs_server, tmp_path):
    """The server gone before the run: train.py stops before training (exit 2) within the
    budget, naming the path and the fix; nothing is written. Back again: the same command runs."""
    bucket, data = clean_run
    with FaultProxy(gcs_server.url) as proxy:
        proxy.set("down")
        env = only_emulator_env(proxy.url, tmp_path, DIFFJAX_STORAGE_TIMEOUT_S="4")
        args = ["train.py", f"run.dir={bucket}/gone", *TINY, *data, "train.steps=2"]
        t0 = time.monotonic()
        out = run(args, env, timeout=120)
        took = time.monotonic() - t0
        assert out.returncode == 2, out.stderr[-3000:]
        assert f"{bucket}/prep" in out.stderr and "Fix:" in out.stderr
        assert "DIFFJAX_STORAGE_TIMEOUT_S" in out.stderr
        assert took < 60
        assert not storage.exists(f"{bucket}/gone/config.json")
        proxy.set(None)
        out = run(args, env, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.xdist_group("storage-faults")
def test_a_bucket_gone_mid_run_stops_it_and_the_rerun_resumes_exactly(
    clean_run, gcs_server, tmp_path
):
    """The server goes away right after the first checkpoint's commit marker is written: the
    run stops (exit 75, as on SIGTERM) with one message naming the path, the cause and the fix,
    without waiting for Orbax's threads of the save it gave up; the rerun with the server back
    resumes from that checkpoint, and the losses equal the clean run's bit for bit.
    (The same 400 steps into a run, and its time cost: benchmarks/storage_faults.py.)"""
    bucket, data = clean_run
    with FaultProxy(gcs_server.url) as proxy:
        proxy.down_after("checkpoints/2/commit_success.txt")
        env = only_emulator_env(proxy.url, tmp_path, DIFFJAX_STORAGE_TIMEOUT_S="4")
        args = ["train.py", f"run.dir={bucket}/mid", *TINY, *data, "train.steps=4"]
        out = run(args, env, timeout=200)
        assert proxy.triggered.is_set()
        assert out.returncode == 75, out.stderr[-3000:]
        assert "Training stopped; the last committed checkpoint" in out.stderr
        assert f"{bucket}/mid" in out.stderr and "Fix:" in out.stderr
        assert "Traceback" not in out.stderr
        proxy.set(None)
        out = run([*args, "--resume"], env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "resuming from the checkpoint at step 2" in out.stdout
    # the clean run's first 4 steps were trained with train.steps=4 too (its schedule)
    assert losses(f"{bucket}/mid/diff/seed_0") == losses(f"{bucket}/run/diff/seed_0")[:4]


@pytest.mark.xdist_group("storage-faults")
def test_a_stalled_server_fails_a_call_within_its_budget(gcs_server, bucket, monkeypatch):
    """Every request stalls for longer than the budget: the read fails in about the budget with
    the path, the cause and the fix, never blocks; with the stall under the read timeout the
    same read returns the bytes."""
    storage.write_bytes(f"{bucket}/x.bin", b"diffjax" * 100)
    with FaultProxy(gcs_server.url) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        storage.set_timeout(3)
        try:
            proxy.set("stall", rate=1.0, stall_s=20)
            t0 = time.monotonic()
            with pytest.raises(storage.StorageError) as e:
                storage.read_bytes(f"{bucket}/x.bin")
            assert time.monotonic() - t0 < 8
            text = str(e.value)
            assert f"reading {bucket}/x.bin" in text and "no answer within 3 s" in text
            assert "DIFFJAX_STORAGE_TIMEOUT_S" in text and "run.storage_timeout_s" in text
            proxy.set("stall", rate=1.0, stall_s=0.5)
            assert storage.read_bytes(f"{bucket}/x.bin") == b"diffjax" * 100
        finally:
            storage.set_timeout(None)


@pytest.mark.xdist_group("storage-faults")
@pytest.mark.parametrize("kind", ["503", "429", "reset"])
def test_each_storage_call_survives_transient_faults(kind, gcs_server, bucket, monkeypatch):
    """Writes, reads, ranged reads, listings and deletes through a third of the requests
    failing: the same answers as without the proxy."""
    data = bytes(range(256)) * 64
    with FaultProxy(gcs_server.url, seed=2) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        proxy.set(kind, rate=0.3)
        storage.write_bytes(f"{bucket}/d/a.bin", data)
        storage.write_text(f"{bucket}/d/b.txt", "b")
        assert storage.read_bytes(f"{bucket}/d/a.bin") == data
        assert storage.read_ranges([f"{bucket}/d/a.bin"] * 2, [0, 100], [10, 300]) == [
            data[:10],
            data[100:300],
        ]
        assert storage.object_sizes(f"{bucket}/d") == {"a.bin": len(data), "b.txt": 1}
        assert storage.same_bytes(f"{bucket}/d/a.bin", data)
        storage.remove(f"{bucket}/d/b.txt")
        assert not storage.exists(f"{bucket}/d/b.txt")
        assert proxy.injected > 0


def test_the_timeout_setting_is_checked():
    with pytest.raises(storage.StorageError, match="must be > 0"):
        storage.set_timeout(0)
    from diffjax.config import ConfigError
    from diffjax.train.config import RunConfig

    with pytest.raises(ConfigError, match="run.storage_timeout_s"):
        RunConfig(storage_timeout_s=-1)


def test_a_sync_interval_under_a_second_is_refused_for_a_bucket_only():
    """Cloud Storage allows about one write a second to one object, and each sync rewrites
    metrics.jsonl: under 1 s on gs:// is refused with the reason; a local run may sync faster."""
    from diffjax.config import ConfigError
    from diffjax.train.config import RunConfig

    with pytest.raises(ConfigError, match=r"RunConfig.sync_every_s: 0.5 s .*one write per second"):
        RunConfig(dir="gs://b/run", sync_every_s=0.5)
    assert RunConfig(dir="gs://b/run", sync_every_s=1).sync_every_s == 1
    assert RunConfig(dir="/tmp/run", sync_every_s=0.5).sync_every_s == 0.5


def test_guarded_turns_a_remote_transport_error_into_a_storage_error():
    """Orbax's calls into a bucket (storage.guarded): a connection error or tensorstore's
    UNAVAILABLE past its retries names the operation, the path and the fix; a local path's
    errors and any other error pass through as they are."""
    with pytest.raises(storage.StorageError) as e:
        with storage.guarded("saving the checkpoint at step 4 in", "gs://b/run/checkpoints"):
            raise ConnectionResetError(104, "Connection reset by peer")
    text = str(e.value)
    assert text.startswith("saving the checkpoint at step 4 in gs://b/run/checkpoints: ")
    assert "ConnectionResetError" in text and "Fix:" in text
    with pytest.raises(storage.StorageError, match="UNAVAILABLE"):
        with storage.guarded("saving", "gs://b/c"):
            raise ValueError("UNAVAILABLE: CURL error [7] Couldn't connect to server")
    with pytest.raises(ValueError, match="shape"):
        with storage.guarded("saving", "gs://b/c"):
            raise ValueError("shape mismatch")
    with pytest.raises(ConnectionResetError):
        with storage.guarded("saving", "/tmp/run"):
            raise ConnectionResetError(104, "reset")


def test_exit_process_is_sys_exit_without_an_abandoned_save():
    from diffjax.compare import exit_process

    with pytest.raises(SystemExit) as e:
        exit_process(75)
    assert e.value.code == 75
