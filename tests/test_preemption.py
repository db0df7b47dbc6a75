"""Preemption: SIGTERM or SIGINT to ``train.py`` stops it at the next step boundary (the same
step on every process), saves that step (model, optimizer, data position), waits for the save
and exits with status 75 (EX_TEMPFAIL) and one message, no traceback; nothing saved before is
removed; re-running the same command resumes, and the losses equal those of a run never
interrupted, bit for bit. One process, and two (``jax.distributed.initialize`` on 127.0.0.1,
gloo collectives), each sent SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from diffjax.train.checkpoint import Checkpointer, committed_steps
from tiny import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX_TEMPFAIL = 75

TINY = tiny_run(
    "model.num_heads=2",
    "train.kernel_check=off",
    "compare.twins=",
    "train.keep_checkpoints=1",  # one regular checkpoint kept (and the best)
)
# (steps, checkpoint and evaluation interval, signal once this step is logged: after the first
# checkpoint). Many short steps: the signal lands mid-run.
ONE_PROCESS = (300, 40, 45)
TWO_PROCESSES = (80, 20, 25)  # a step takes ~5x longer (gloo)


def schedule(steps: int, every: int, _: int) -> list[str]:
    return [f"train.steps={steps}", f"train.eval_every={every}", f"train.checkpoint_every={every}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir, plan=ONE_PROCESS, *, process: tuple[int, int, int] | None = None):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", PYTHONUNBUFFERED="1")
    # the suite's compiler flags, without a device count that would override the one above
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    cmd = [sys.executable, "train.py", f"run.dir={run_dir}", *TINY, *schedule(*plan)]
    if process is not None:
        port, n, i = process
        cmd += ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(n)]
        cmd += ["--process_id", str(i)]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(*procs, timeout: float = 300) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, o, e))
    return out


def model_dir(run_dir):
    return run_dir / "diff" / "seed_0"


def records(run_dir) -> list[dict]:
    path = model_dir(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def signal_after(procs, run_dir, step: int, sig, timeout: float = 240) -> None:
    """Send ``sig`` to every process once ``step`` is in metrics.jsonl."""
    deadline = time.time() + timeout
    while not any(r["step"] >= step for r in records(run_dir)):
        for p in procs:
            assert p.poll() is None, finish(p)
        assert time.time() < deadline, "the run logged no step in time"
        time.sleep(0.02)
    for p in procs:
        p.send_signal(sig)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses and the kept checkpoints of the uninterrupted single-process run."""
    run = tmp_path_factory.mktemp("straight")
    ((rc, out, err),) = finish(launch(run))
    assert rc == 0, err[-3000:]
    assert len(losses(run)) == ONE_PROCESS[0]
    return losses(run), committed_steps(str(model_dir(run) / "checkpoints"))


def check_stopped(run, rc: int, err: str, sig_name: str, plan=ONE_PROCESS) -> int:
    """The run exited 75 with the message and no traceback; returns the stop step, which is
    saved, with the checkpoints saved before it."""
    assert rc == EX_TEMPFAIL, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    m = re.search(
        rf"stopped by {sig_name} at step (\d+) of diff \(seed 0\); saved a checkpoint", err
    )
    assert m, err[-3000:]
    assert "Re-running the same command resumes" in err
    step = int(m.group(1))
    steps, every, after = plan
    assert after <= step < steps
    assert [r["step"] for r in records(run)] == list(range(1, step + 1))  # every step logged
    ckpts = committed_steps(str(model_dir(run) / "checkpoints"))
    assert step in ckpts
    if step % every:  # a preemption checkpoint: no validation loss, never the best
        # the last periodic checkpoint before it is kept (keep_checkpoints=1: the preemption
        # checkpoint removed nothing); a stop on a periodic step is that step's own checkpoint
        assert step // every * every in ckpts
        ckpt = Checkpointer(str(model_dir(run) / "checkpoints"))
        try:
            assert ckpt.best_step() != step and ckpt.latest_step() == step
        finally:
            ckpt.close()
    return step


@pytest.mark.xdist_group("preemption")  # one worker: the uninterrupted run is made once
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_saves_and_resumes_bit_for_bit(tmp_path, straight, sig):
    ref, ref_ckpts = straight
    run = tmp_path / "run"
    proc = launch(run)
    signal_after([proc], run, ONE_PROCESS[2], sig)
    ((rc, out, err),) = finish(proc)
    step = check_stopped(run, rc, err, signal.Signals(sig).name)

    ((rc, out, err),) = finish(launch(run))  # the same command again
    assert rc == 0, err[-3000:]
    assert f"resuming from the checkpoint at step {step}" in out
    assert [r["step"] for r in records(run)] == list(range(1, ONE_PROCESS[0] + 1))
    assert losses(run) == ref  # bit for bit (JSON floats round-trip exactly)
    # the preemption checkpoint went once a later one was saved: the same set as never stopped
    assert committed_steps(str(model_dir(run) / "checkpoints")) == ref_ckpts


def test_two_processes_stop_at_one_step_and_resume_bit_for_bit(tmp_path):
    """Two processes x 1 CPU device (data=2), both sent SIGTERM: JAX's preemption service
    picks one step, both save it and exit 75; rerun, they finish with the losses of an
    uninterrupted two-process run."""
    ref_dir, run = tmp_path / "straight", tmp_path / "run"

    def pair(run_dir):
        port = free_port()
        return [launch(run_dir, TWO_PROCESSES, process=(port, 2, i)) for i in range(2)]

    for rc, _, err in finish(*pair(ref_dir)):
        assert rc == 0, err[-3000:]
    ref = losses(ref_dir)
    assert len(ref) == TWO_PROCESSES[0]

    procs = pair(run)
    signal_after(procs, run, TWO_PROCESSES[2], signal.SIGTERM)
    results = finish(*procs)
    steps = {check_stopped(run, rc, err, "SIGTERM", TWO_PROCESSES) for rc, _, err in results}
    assert len(steps) == 1  # one step, agreed by both

    for rc, _, err in finish(*pair(run)):
        assert rc == 0, err[-3000:]
    assert losses(run) == ref
