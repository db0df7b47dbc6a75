"""Reports, plots and JSON written into a ``gs://`` run directory, on a real GCS API server
(``conftest.gcs_server``): the comparison's ``report.md`` and ``loss.png``, the sweep's
``sweep.md`` and plots, and ``python -m diffjax.evaluate gs://...`` on a run copied into a
bucket, each inside :class:`gcs_emulator.LocalPathGuard` (no URL reaches ``open`` or ``os``)
and each the same as written into a local folder."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap

import numpy as np
import pytest
from gcs_emulator import LocalPathGuard

from diffjax.infra import storage

PNG = b"\x89PNG\r\n\x1a\n"


def upload_tree(local: str, url: str) -> None:
    """Every file under the folder ``local`` copied to ``url`` under the same relative name;
    each checkpoint step gets the commit marker Orbax writes in a bucket (a local checkpoint
    is committed by its rename instead)."""
    for root, _, files in os.walk(local):
        rel = os.path.relpath(root, local).split(os.sep)
        parts = [] if rel == ["."] else rel
        for name in files:
            storage.upload(os.path.join(root, name), storage.join(url, *parts, name))
        if len(parts) >= 2 and parts[-2] == "checkpoints" and parts[-1].isdigit():
            storage.write_bytes(storage.join(url, *parts, "commit_success.txt"), b"")


# ---------------------------------------------------------------------------- the comparison
def test_comparison_report_in_a_bucket(tmp_path, bucket, gcs_server):
    from test_report import _results

    from diffjax.compare.report import write_report
    from diffjax.compare import default_comparison

    exp = default_comparison()
    # metrics.jsonl of two seeds of each model (no query accuracy: the default data has none)
    local = [dataclasses.replace(r, metrics={}) for r in _results(tmp_path / "run")]
    expected = write_report(str(tmp_path / "run"), exp, local)
    run = f"{bucket}/run"
    upload_tree(str(tmp_path / "run"), run)
    remote = [
        dataclasses.replace(r, directory=storage.join(run, r.label, f"seed_{r.seed}"))
        for r in local
    ]
    with LocalPathGuard():
        text = write_report(run, exp, remote)
    assert text == expected
    objects = gcs_server.objects(run)
    assert objects["report.md"].decode() == expected and "## Setup" in expected
    assert objects["loss.png"].startswith(PNG) and len(objects["loss.png"]) > 10_000


# ---------------------------------------------------------------------------- the sweep
def test_sweep_report_plan_and_resume_check_in_a_bucket(tmp_path, bucket, gcs_server):
    from test_sweep import write_run

    from diffjax.sweep import Ladder, write_sweep_report
    from diffjax.compare.runner import Run, is_done
    from diffjax.sweep.cli import DONE_FILE, SizeRun, write_plan
    from diffjax.sweep.report import read_plan

    write_run(str(tmp_path), np.geomspace(1e5, 1e7, 4))
    expected = write_sweep_report(str(tmp_path), resamples=100)
    run = f"{bucket}/run"
    upload_tree(str(tmp_path), run)
    with LocalPathGuard():
        text = write_sweep_report(run, resamples=100)
    assert text == expected and "**Parameters**" in text
    objects = gcs_server.objects(run)
    assert objects["sweep.md"].decode() == expected
    for name in ("sweep_loss.png", "sweep_ratio.png"):
        assert objects[name].startswith(PNG) and len(objects[name]) > 10_000, name

    # the plan the command line writes first, and the check that skips a finished size
    other = f"{bucket}/other"
    size = SizeRun("16x1", (16, 1), storage.join(other, "size_16x1"), ("a=1",), 6, 768, 10, 9)
    with LocalPathGuard():
        write_plan(other, "tiny.py", Ladder(sizes=[(16, 1)], tokens=768), [size])
        assert read_plan(other)["sizes"][0]["directory"] == f"{other}/size_16x1"
        run_of = Run(size.name, size.directory, size.overrides)  # the one runner's
        assert not is_done(run_of, DONE_FILE)
        storage.write_json(storage.join(size.directory, DONE_FILE), {"overrides": ["a=1"]})
        assert is_done(run_of, DONE_FILE)
        assert not is_done(dataclasses.replace(run_of, overrides=("a=2",)), DONE_FILE)


def test_sweep_into_a_missing_bucket_is_refused_before_training(tmp_path, gcs_server, capsys):
    from diffjax.sweep import main

    config = tmp_path / "tiny_sweep.py"
    config.write_text(
        textwrap.dedent(
            """
            from diffjax.sweep import Ladder
            from diffjax.compare import default_comparison

            SWEEP = Ladder(sizes=[(16, 1, 1)], budget="fixed", tokens=768, min_steps=2)


            def get_config():
                return default_comparison()
            """
        )
    )
    assert main(["--config", str(config), "run.dir=gs://diffjax-no-such-bucket/run"]) == 2
    err = capsys.readouterr().err
    assert "run.dir='gs://diffjax-no-such-bucket/run'" in err and "does not exist" in err


# ---------------------------------------------------------------------------- the evaluation
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny needle run of one model (test_evaluate's settings), trained on local disk."""
    from test_evaluate import TINY_NEEDLE

    from diffjax.compare.cli import main as train_main

    run = tmp_path_factory.mktemp("storage_eval") / "tiny"
    assert train_main([f"run.dir={run}", "compare.twins=", *TINY_NEEDLE]) == 0
    return run


@pytest.mark.slow
def test_evaluate_a_run_in_a_bucket(tiny_run, bucket, gcs_server):
    """``python -m diffjax.evaluate gs://BUCKET/tiny --quick`` on a copy of a local run: the
    same eval.md and eval.json as evaluating the local folder, and the plots, in the bucket."""
    from diffjax.evaluate.__main__ import main as evaluate_main

    run = f"{bucket}/tiny"
    upload_tree(str(tiny_run), run)
    assert evaluate_main([str(tiny_run), "--quick"]) == 0
    with LocalPathGuard():
        assert evaluate_main([run, "--quick"]) == 0
    objects = gcs_server.objects(run)
    expected = (tiny_run / "eval.md").read_text().replace(str(tiny_run), run)
    assert objects["eval.md"].decode() == expected
    assert "# Evaluation of tiny (quick subset)" in expected
    assert json.loads(objects["eval.json"]) == json.loads((tiny_run / "eval.json").read_text())
    pngs = [name for name in objects if name.startswith("eval_") and name.endswith(".png")]
    assert sorted(pngs) == sorted(p.name for p in tiny_run.glob("eval_*.png")) and pngs
    assert all(objects[name].startswith(PNG) for name in pngs)


def test_evaluate_refuses_a_missing_bucket_before_any_compute(gcs_server, capsys):
    from diffjax.evaluate.__main__ import main as evaluate_main

    assert evaluate_main(["gs://diffjax-no-such-bucket/run", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "RUN='gs://diffjax-no-such-bucket/run'" in err and "does not exist" in err
