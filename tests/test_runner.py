"""The one resumable runner (:mod:`diffjax.compare.runner`): a plan of runs, what finished
skipped by its marker (written with the same overrides), what a run returns recorded, a stop
said and raised, every run executed when the plan keeps no markers."""

from __future__ import annotations

import json

import pytest

from diffjax.compare.runner import Run, RunFailed, is_done, run_log, run_plan
from diffjax.train.preemption import Preempted


def _plan(tmp_path, overrides=("a=1",)):
    return [Run(f"r{i}", str(tmp_path / f"r{i}"), overrides, kind="size") for i in range(3)]


def test_a_plan_skips_what_finished_with_the_same_overrides_and_records_the_rest(tmp_path):
    said, ran = [], []

    def execute(run):
        ran.append(run.name)
        return {"value": len(ran)}

    runs = _plan(tmp_path)
    out = run_plan(runs, execute, run_dir=str(tmp_path), done_file="done.json", say=said.append)
    assert ran == ["r0", "r1", "r2"] and out == [{"value": 1}, {"value": 2}, {"value": 3}]
    marker = json.loads((tmp_path / "r1" / "done.json").read_text())
    assert marker["overrides"] == ["a=1"] and marker["value"] == 2 and "finished" in marker
    assert said[0].startswith("[size 1/3] r0: training; log: ") and said[1].startswith(
        "[size 1/3] r0: done in"
    )

    ran.clear()
    again = run_plan(runs, execute, run_dir=str(tmp_path), done_file="done.json", say=said.append)
    assert (
        ran == [] and again == [None] * 3 and said[-1] == "[size 3/3] r2: finished earlier, skipped"
    )
    changed = _plan(tmp_path, ("a=2",))  # other overrides: not the same run, trained again
    assert not is_done(changed[0], "done.json")
    run_plan(changed, execute, run_dir=str(tmp_path), done_file="done.json", say=said.append)
    assert ran == ["r0", "r1", "r2"]


def test_a_stop_is_said_and_raised_and_leaves_no_marker(tmp_path):
    said = []

    def execute(run):
        if run.name == "r1":
            raise Preempted(3, run.directory, "SIGTERM")
        return None

    with pytest.raises(Preempted):
        run_plan(
            _plan(tmp_path), execute, run_dir=str(tmp_path), done_file="done.json", say=said.append
        )
    assert said[-1].startswith("[size 2/3] r1: stopped and saved; re-run the same command")
    assert (tmp_path / "r0" / "done.json").exists() and not (tmp_path / "r1" / "done.json").exists()
    with pytest.raises(RunFailed, match=r"r2 failed \(exit 1\); see .*r2/train.log"):
        raise RunFailed(_plan(tmp_path)[2], 1)


def test_without_markers_every_run_is_executed_and_the_log_goes_to_its_folder(tmp_path, capsys):
    ran = []
    runs = _plan(tmp_path)
    for _ in range(2):
        run_plan(runs, lambda run: ran.append(run.name), run_dir=str(tmp_path), done_file=None)
    assert ran == ["r0", "r1", "r2"] * 2
    assert "log:" not in capsys.readouterr().out  # no train.log is named without markers
    steps = []
    with run_log(str(tmp_path / "r0"), lambda i, c: steps.append(i)) as step:
        print("inside")
        step(1, None)
    with run_log(str(tmp_path / "r0")):
        print("resumed")
    assert (tmp_path / "r0" / "train.log").read_text() == "inside\nresumed\n" and steps == [1]
