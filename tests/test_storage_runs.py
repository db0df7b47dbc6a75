"""Runs that live in a bucket: ``train.py run.dir=gs://...`` against a real GCS API server
(fake-gcs-server on 127.0.0.1, started by the ``gcs_server`` fixture): every file of the run in
the bucket and none on local disk, TensorBoard reading the events from ``gs://``, a SIGKILL
during a save and a SIGTERM resumed from the bucket on a machine whose local disk holds nothing
of the run (bit for bit), two processes in one bucket, and every bad start refused before
compute with nothing in the bucket changed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from gcs_emulator import LocalPathGuard, StatusServer

from diffjax.infra import storage
from diffjax.compare.cli import main
from diffjax.train.checkpoint import Checkpointer, committed_steps, load_model
from diffjax.train.metrics import read_metrics
from tiny import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX_TEMPFAIL = 75

TINY = tiny_run("train.kernel_check=off", drop=("train.tensorboard", "compare.quick_eval"))
# the kill / SIGTERM runs: one model, 10 steps, a checkpoint every 4
SHORT = [
    *TINY,
    "compare.twins=",
    "compare.quick_eval=false",
    "train.tensorboard=false",
    "train.steps=10",
    "train.eval_every=4",
    "train.checkpoint_every=4",
]


def losses(model_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(storage.join(model_dir, "metrics.jsonl"))]


def child_env(**extra) -> dict[str, str]:
    """The environment of a ``train.py`` child: one CPU device, and a temp directory of its
    own (a fresh one stands for a machine whose local disk holds nothing of the run)."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    return {**env, **extra}


def fresh_machine(tmp_path, name: str) -> dict[str, str]:
    """A new, empty temp directory as TMPDIR: nothing local survives from an earlier start."""
    tmp = tmp_path / f"tmp-{name}"
    tmp.mkdir()
    return child_env(TMPDIR=str(tmp))


# ---------------------------------------------------------------------------- the whole run
def test_default_run_lives_in_the_bucket_and_nothing_local(
    tmp_path, monkeypatch, gcs_server, bucket, capsys
):
    """The default comparison (DIFF and twin, report, plot, quick evaluation) with run.dir in a
    bucket: every file is an object there, no user path reached ``open``/``os`` (the guard), the
    working directory holds nothing, TensorBoard reads the losses from ``gs://``, and the model
    loads back from the bucket."""
    run = f"{bucket}/runs/default"
    monkeypatch.chdir(tmp_path)
    args = [f"run.dir={run}", *TINY, "train.steps=4", "train.eval_every=2"]
    with LocalPathGuard() as guard:
        rc = main([*args, "train.checkpoint_every=2", "run.sync_every_s=1"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert guard.violations == []
    assert os.listdir(tmp_path) == []  # no "gs:" folder, nothing else

    objects = gcs_server.objects(run)
    for name in ("config.json", "report.md", "loss.png", "eval.md"):
        assert name in objects, sorted(objects)
    assert objects["loss.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Quick evaluation" in objects["report.md"].decode()
    assert json.loads(objects["config.json"])["run"]["dir"] == run
    for label in ("diff", "standard"):
        model = f"{label}/seed_0"
        records = [json.loads(line) for line in objects[f"{model}/metrics.jsonl"].splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert json.loads(objects[f"{model}/result.json"])["steps"] == 4
        assert committed_steps(f"{run}/{model}/checkpoints") == [2, 4]
        assert any(n.startswith(f"{model}/tb/events.out.tfevents") for n in objects)
        # TensorBoard's own reader, from the bucket (gcsfs through fsspec)
        from tensorboard.backend.event_processing import event_accumulator

        acc = event_accumulator.EventAccumulator(f"{run}/{model}/tb")
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
        assert [e.value for e in acc.Scalars("loss")] == pytest.approx(
            [r["loss"] for r in records], rel=1e-6
        )
    with LocalPathGuard():
        model = load_model(f"{run}/diff/seed_0")
        ckpt = Checkpointer(f"{run}/diff/seed_0/checkpoints")
        try:  # the validation losses Orbax recorded in the bucket rank the checkpoints
            losses_at = {
                r["step"]: r["val_loss"]
                for r in read_metrics(f"{run}/diff/seed_0/metrics.jsonl")
                if "val_loss" in r
            }
            assert ckpt.best_step() == min(losses_at, key=losses_at.get)
        finally:
            ckpt.close()
    assert model.config.d_model == 32


# ---------------------------------------------------------------------------- kill and resume
KILLED_TRAIN_PY = """
import os, signal, sys
from diffjax.compare.cli import main

kill_at = int(sys.argv[1])

def kill(step, checkpointer):
    if step == kill_at:  # a checkpoint step: its save was issued, maybe not committed
        os.kill(os.getpid(), signal.SIGKILL)

sys.exit(main(sys.argv[2:], after_step=kill))
"""


@pytest.fixture(scope="module")
def straight_in_bucket(gcs_server, tmp_path_factory):
    """The losses of the uninterrupted run of :data:`SHORT` in a bucket."""
    run = f"{gcs_server.new_bucket()}/straight"
    env = fresh_machine(tmp_path_factory.mktemp("straight"), "a")
    out = subprocess.run(
        [sys.executable, "train.py", f"run.dir={run}", *SHORT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return losses(f"{run}/diff/seed_0")


@pytest.mark.xdist_group("gcs-resume")  # one worker: the uninterrupted run is made once
def test_killed_during_a_save_resumes_from_the_bucket_on_an_empty_disk(
    tmp_path, bucket, straight_in_bucket
):
    """SIGKILL right after step 8 (its save in flight), then the same command on a "new
    machine" (an empty temp directory, another working directory): it resumes from the last
    committed step in the bucket and the 10 losses equal the uninterrupted run's bit for bit."""
    run = f"{bucket}/killed"
    out = subprocess.run(
        [sys.executable, "-c", KILLED_TRAIN_PY, "8", f"run.dir={run}", *SHORT],
        cwd=ROOT,
        env=fresh_machine(tmp_path, "a"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert committed_steps(f"{run}/diff/seed_0/checkpoints")[0] == 4  # 8 maybe, 4 surely
    assert len(losses(f"{run}/diff/seed_0")) < 10

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), f"run.dir={run}", *SHORT, "--resume"],
        cwd=elsewhere,
        env=fresh_machine(tmp_path, "b"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step" in out.stdout
    assert os.listdir(elsewhere) == []
    assert losses(f"{run}/diff/seed_0") == straight_in_bucket  # bit for bit


@pytest.mark.xdist_group("gcs-resume")
def test_sigterm_saves_to_the_bucket_exits_75_and_resumes(tmp_path, bucket, straight_in_bucket):
    run = f"{bucket}/stopped"
    cmd = [sys.executable, "train.py", f"run.dir={run}", *SHORT[:-3]]
    cmd += ["train.steps=400", "train.eval_every=40", "train.checkpoint_every=40"]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=fresh_machine(tmp_path, "a"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = f"{run}/diff/seed_0/metrics.jsonl"
    deadline = time.time() + 240
    while not storage.exists(metrics):  # uploaded with the first checkpoint (step 40)
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == EX_TEMPFAIL, err[-3000:]
    assert "Traceback" not in err
    step = int(err.split("stopped by SIGTERM at step ")[1].split()[0])
    assert step in committed_steps(f"{run}/diff/seed_0/checkpoints")
    # every step up to the stop reached the bucket (the metrics are uploaded at the close)
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, step + 1))

    out = subprocess.run(
        cmd, cwd=ROOT, env=fresh_machine(tmp_path, "b"), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from the checkpoint at step {step}" in out.stdout
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 401))


# ---------------------------------------------------------------------------- two processes
@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume_into_one_bucket(tmp_path, gcs_server, bucket):
    """Two processes (gloo) run the default comparison's whole course (both models, report,
    quick evaluation) into one gs:// run directory, each reading its own rows of the training
    data from a corpus prepared into the same bucket, then a longer run resumes both models from
    the bucket; process 0 alone writes the files one process writes."""
    import socket

    from diffjax.data import prepare as prep

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "some words of text " * 30)
    options = prep.PrepareOptions((str(corpus),), "byte", f"{bucket}/data", val_fraction=0.2)
    prep.prepare(dataclasses.replace(options, progress=False))
    run = f"{bucket}/pod"
    args = [f"run.dir={run}", *TINY, "train.eval_every=4", "train.checkpoint_every=4"]
    args += ["data.source=tokens", f"data.path={bucket}/data"]

    def pair(steps: int, name: str, *extra: str) -> list[tuple[int, str, str]]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for i in range(2):
            cmd = [sys.executable, "train.py", *args, f"train.steps={steps}", *extra]
            cmd += ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2"]
            cmd += ["--process_id", str(i)]
            env = fresh_machine(tmp_path, f"{name}{i}")
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        out = []
        for p in procs:
            o, e = p.communicate(timeout=420)
            out.append((p.returncode, o, e))
        return out

    for rc, _, err in pair(4, "a"):
        assert rc == 0, err[-3000:]
    first = gcs_server.objects(run)
    assert "report.md" in first and "eval.md" in first
    assert not any(".diffjax-write-check" in n for n in first)  # the access probes removed
    # process 0 alone writes a model's files: one TensorBoard file per model and start
    assert len([n for n in first if n.startswith("diff/seed_0/tb/events")]) == 1

    results = pair(8, "b", "compare.quick_eval=false")  # the after-training work: done above
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
        assert "resuming from the checkpoint at step 4" in out
    for label in ("diff", "standard"):
        records = read_metrics(f"{run}/{label}/seed_0/metrics.jsonl")
        assert [r["step"] for r in records] == list(range(1, 9))
        assert committed_steps(f"{run}/{label}/seed_0/checkpoints") == [4, 8]
    assert "## Quick evaluation" not in storage.read_text(f"{run}/report.md")  # rewritten whole


# ---------------------------------------------------------------------------- bad starts
def _refused(capsys, *args) -> str:
    with LocalPathGuard():
        rc = main([*TINY, "train.steps=2", "compare.twins=", "compare.quick_eval=false", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    return err


def test_a_missing_bucket_is_refused_and_not_created(gcs_server, capsys):
    err = _refused(capsys, "run.dir=gs://no-such-bucket-diffjax/run")
    assert "gs://no-such-bucket-diffjax does not exist" in err and "Fix:" in err
    names = [b.name for b in gcs_server.client().list_buckets()]
    assert "no-such-bucket-diffjax" not in names


def test_an_unknown_scheme_is_refused(capsys):
    err = _refused(capsys, "run.dir=s3://bucket/run")
    assert "s3:// is not one diffjax reads or writes" in err


@pytest.mark.parametrize("status, message", [(401, "refused the credentials"), (403, "may not")])
def test_refused_credentials_and_permissions_are_named(monkeypatch, capsys, status, message):
    with StatusServer(status) as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        err = _refused(capsys, "run.dir=gs://some-bucket/run")
    assert message in err and "gs://some-bucket/run" in err and "Fix:" in err


def test_no_credentials_is_refused_with_the_fix(gcs_server, monkeypatch, capsys):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")  # a real GCS, and no credentials here
    err = _refused(capsys, "run.dir=gs://some-bucket/run")
    assert "no Google Cloud credentials were found" in err
    assert "gcloud auth application-default login" in err


def test_a_failed_start_changes_nothing_in_the_bucket(gcs_server, bucket, capsys):
    """A run directory that already holds a run: a start refused for its config leaves every
    object as it was."""
    run = f"{bucket}/run"
    storage.write_text(f"{run}/config.json", '{"old": true}')
    storage.write_text(f"{run}/report.md", "# the old report\n")
    before = gcs_server.objects(run)
    _refused(capsys, f"run.dir={run}", "model.num_heads=3")  # d_model 32 does not divide
    assert gcs_server.objects(run) == before


def test_synced_dir_uploads_whole_files_and_pulls_them_back(bucket, tmp_path):
    """The files that grow: written locally, uploaded whole on sync; a reader of the bucket
    sees the last upload; a new SyncedDir (another machine) pulls the file back to append."""
    remote = f"{bucket}/m"
    first = storage.SyncedDir(remote, every_s=3600)
    with open(first.local_path("metrics.jsonl"), "a") as f:
        f.write('{"step": 1}\n')
    assert not first.due()
    first.sync()
    with open(first.local_path("metrics.jsonl"), "a") as f:
        f.write('{"step": 2}\n')
    assert storage.read_text(f"{remote}/metrics.jsonl") == '{"step": 1}\n'  # as of the upload
    local = first.local
    first.close()
    assert not os.path.exists(local)
    assert storage.read_text(f"{remote}/metrics.jsonl") == '{"step": 1}\n{"step": 2}\n'
    second = storage.SyncedDir(remote)
    second.pull("metrics.jsonl")
    with open(second.local_path("metrics.jsonl")) as f:
        assert f.read() == '{"step": 1}\n{"step": 2}\n'
    second.close()
