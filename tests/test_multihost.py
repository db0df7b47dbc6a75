"""Several processes and restoring onto another mesh, end to end through ``train.py``.

- two processes with 2 CPU devices each (``jax.distributed.initialize`` on 127.0.0.1, gloo
  collectives) train the same losses as one process with 4 devices, then do the default
  comparison's work after training (side-by-side timing, report, quick evaluation: its
  checkpoint reads are collective) and both exit 0;
- that run, resumed by one process on a different mesh, continues with the losses of the
  uninterrupted run;
- in one process on 8 devices: saved with fsdp=8, resumed with data=2 x tensor=4.

Tolerance: the meshes differ only in how float32 sums are split across devices and
processes, so losses agree to ~1e-7 relative; the tests allow 1e-5.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from diffjax.compare.cli import main
from tiny import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_RTOL = 1e-5
# the single-process reference runs: one model, nothing after training
ONE_MODEL = ["compare.twins=", "compare.quick_eval=false"]

TINY = tiny_run(
    "model.d_model=64",
    "model.num_heads=4",
    "train.eval_batches=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "compare.throughput_rounds=1",  # the post-training work stays on (compare, quick_eval), small
    # a constant lr after warmup: a run of 4 steps continued to 6 then follows the same
    # schedule as a run of 6 (a decaying schedule depends on train.steps)
    "train.schedule=constant",
    # spike skipping on (nothing spikes here): its window lives in the optimizer state, saved
    # by two processes and restored by one on another mesh
    "train.skip_spikes=3",
    "train.spike_window=2",
    drop=("compare.quick_eval",),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir, devices: int, *args, process: tuple[int, int, int] | None = None):
    """Start ``train.py`` with ``devices`` CPU devices; ``process`` = (port, n, id)."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), PYTHONUNBUFFERED="1")
    # the suite's compiler flags, without a device count that would override the one above
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    cmd = [sys.executable, "train.py", f"run.dir={run_dir}", *TINY, *args]
    if process is not None:
        port, n, i = process
        cmd += [
            "--coordinator_address",
            f"127.0.0.1:{port}",
            "--num_processes",
            str(n),
            "--process_id",
            str(i),
        ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(*procs, timeout=420) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "diff", "seed_0", "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_two_processes_equal_one_and_resume_on_another_mesh_and_process_count(tmp_path):
    # the reference: one process, 4 devices (data=2 x fsdp=2), 6 steps uninterrupted
    ref_dir = tmp_path / "one"
    finish(launch(ref_dir, 4, *ONE_MODEL, "train.steps=6", "mesh.fsdp=2"))
    ref = losses(ref_dir)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]

    # two processes x 2 devices, the same mesh shape, 4 steps (checkpoints at 2 and 4), DIFF
    # and its twin, then the side-by-side timing, the report and the quick evaluation, as the
    # default comparison does them (process 0 alone in a collective checkpoint read used to
    # hang there while process 1 waited at JAX's shutdown barrier: both aborted)
    two_dir = tmp_path / "two"
    port = free_port()
    outs = finish(
        *[
            launch(two_dir, 2, "train.steps=4", "mesh.fsdp=2", process=(port, 2, i))
            for i in range(2)
        ]
    )
    assert "distributed: process 0 of 2" in outs[0] and "distributed: process 1 of 2" in outs[1]
    assert "(4 devices, 2 processes)" in outs[0]
    two = losses(two_dir)
    assert sorted(two) == [1, 2, 3, 4]  # one writer: process 0, each step once
    np.testing.assert_allclose(
        [two[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)], rtol=LOSS_RTOL
    )
    assert (two_dir / "report.md").exists() and (two_dir / "loss.png").exists()
    assert "diff throughput is" in outs[0]  # the side-by-side timing ran on both processes
    evaluated = json.loads((two_dir / "eval.json").read_text())["models"]
    assert [(m["label"], m["seed"]) for m in evaluated] == [("diff", 0), ("standard", 0)]
    eval_md, report = (two_dir / "eval.md").read_text(), (two_dir / "report.md").read_text()
    assert "## Quick evaluation" in report and eval_md.split("\n", 1)[1] in report
    assert outs[0].count("evaluating ") == 2 and "evaluating " not in outs[1]  # process 0 logs
    assert outs[0].count("eval.md") == 1  # its path printed once

    # resume the two-process run in one process, on another mesh (data=2 x tensor=2)
    (out,) = finish(
        launch(two_dir, 4, *ONE_MODEL, "train.steps=6", "mesh.data=2", "mesh.tensor=2", "--resume")
    )
    assert "resuming from the checkpoint at step 4" in out
    assert "data=2 fsdp=1 context=1 tensor=2 (4 devices, 1 process)" in out
    resumed = losses(two_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [resumed[s] for s in (5, 6)], [ref[s] for s in (5, 6)], rtol=LOSS_RTOL
    )


def test_task_metrics_are_summed_over_processes(tmp_path):
    """The validation metrics a task declares (here the needle task's answer and query
    accuracies) count each process's rows and sum the counts over processes: two processes of
    one device give the numbers of one process with two."""
    needle = [
        "data.source=needle",
        "data.seq_len=32",
        "data.needle.num_needles=2",
        "data.needle.num_queries=4",
        "data.needle.query_replacement=true",
        "data.needle.key_len=1",
        "data.needle.value_len=1",
        "data.needle.template={key}{value}",
        "data.needle.query_template={key}{value}",
        "data.synthetic.num_val_examples=12",  # padded to 16: the last batch's rows differ per process
        "train.steps=2",
        "train.eval_batches=2",
    ]
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    finish(launch(one_dir, 2, *ONE_MODEL, *needle))
    port = free_port()
    # one model; the quick evaluation after training on, on the needle task
    finish(*[launch(two_dir, 1, "compare.twins=", *needle, process=(port, 2, i)) for i in range(2)])
    assert "val_first_query_accuracy" in (two_dir / "eval.json").read_text()

    def final_eval(run_dir):
        with open(os.path.join(run_dir, "diff", "seed_0", "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "val_loss" in r][-1]

    one, two = final_eval(one_dir), final_eval(two_dir)
    keys = {"val_answer_accuracy", "val_query_accuracy", "val_first_query_accuracy"}
    assert keys <= set(one) and set(k for k in one if k.endswith("accuracy")) == set(
        k for k in two if k.endswith("accuracy")
    )
    for k in keys | {"val_loss"}:
        assert two[k] == pytest.approx(one[k], rel=LOSS_RTOL), k
    result = json.loads((two_dir / "diff" / "seed_0" / "result.json").read_text())
    assert result["metrics"]["val_query_accuracy"] == two["val_query_accuracy"]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_saved_with_fsdp8_continues_with_data2_tensor4(tmp_path, capsys):
    whole, split = tmp_path / "whole", tmp_path / "split"
    one = [*TINY, *ONE_MODEL]
    assert main([f"run.dir={whole}", *one, "train.steps=6", "mesh.fsdp=-1"]) == 0
    assert main([f"run.dir={split}", *one, "train.steps=4", "mesh.fsdp=-1"]) == 0
    capsys.readouterr()
    assert main([f"run.dir={split}", *one, "train.steps=6", "mesh.data=2", "mesh.tensor=4"]) == 0
    out = capsys.readouterr().out
    assert (
        "resuming from the checkpoint at step 4" in out
        and "data=2 fsdp=1 context=1 tensor=4" in out
    )
    a, b = losses(whole), losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [b[s] for s in range(1, 7)], [a[s] for s in range(1, 7)], rtol=LOSS_RTOL
    )


# ---------------------------------------------------------------------------- launching
def parse(*argv):
    from diffjax.compare.cli import build_parser

    return build_parser().parse_args(list(argv))


@pytest.fixture
def fake_initialize(monkeypatch):
    """Record jax.distributed.initialize calls instead of starting a runtime."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    for var in (
        "SLURM_STEP_NUM_TASKS",
        "OMPI_COMM_WORLD_SIZE",
        "TPU_WORKER_HOSTNAMES",
        "JAX_COORDINATOR_ADDRESS",
    ):
        monkeypatch.delenv(var, raising=False)
    return calls


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--num_processes", "2", "--process_id", "0"), "go together"),
        (
            ("--coordinator_address", "h:1", "--num_processes", "2", "--process_id", "2"),
            "is not in",
        ),
        (("--coordinator_address", "h", "--num_processes", "2", "--process_id", "0"), "no port"),
    ],
)
def test_bad_distributed_flags_are_refused_before_starting(fake_initialize, argv, message):
    from diffjax.config import ConfigError
    from diffjax.compare.cli import init_distributed

    with pytest.raises(ConfigError, match=message):
        init_distributed(parse(*argv))
    assert fake_initialize == []


def test_distributed_start_from_flags_or_a_detected_cluster(fake_initialize, monkeypatch):
    from diffjax.compare.cli import init_distributed

    assert init_distributed(parse()) is None  # a single process: nothing started
    assert (
        init_distributed(
            parse("--coordinator_address", "h:1", "--num_processes", "1", "--process_id", "0")
        )
        is None
    )
    assert fake_initialize == []
    how = init_distributed(
        parse("--coordinator_address", "10.0.0.1:1234", "--num_processes", "4", "--process_id", "3")
    )
    assert fake_initialize[-1][0] == ("10.0.0.1:1234", 4, 3) and "process 3 of 4" in how
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host TPU VM
    assert init_distributed(parse()) is None
    for var, value, name in (
        ("TPU_WORKER_HOSTNAMES", "w0,w1", "TPU pod"),
        ("SLURM_STEP_NUM_TASKS", "8", "SLURM"),
    ):
        monkeypatch.setenv(var, value)
        assert name in init_distributed(parse())
        assert fake_initialize[-1] == ((), {})  # JAX reads the cluster itself
        monkeypatch.delenv(var)


def test_cli_reports_bad_distributed_flags(capsys):
    from diffjax.compare.cli import EXIT_BAD_INPUT

    assert main(["--num_processes", "2"]) == EXIT_BAD_INPUT
    assert "go together" in capsys.readouterr().err
