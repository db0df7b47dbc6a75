"""The retrofit study (``python -m diffjax.retrofit_study --config FILE``, a module-level
``RETROFIT``): the
declaration's checks, and a tiny study (d_model 32, 2 layers, 2 seeds) that trains its sources
and their three continuations, is stopped in its last run and resumed, skips what finished, and
writes retrofit.md with every arm: DIFF V2 starts at the unconverted model's loss, V1 does not."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import numpy as np
import pytest

from diffjax.compare import RetrofitStudy
from diffjax.compare.curves import EvalCurve
from diffjax.compare.retrofit_report import (
    Run,
    StudyData,
    _final,
    difference_curve,
    recovery_step,
    step_mean,
)
from diffjax.compare.retrofit_study import apply_study_overrides, load_study, plan_study
from diffjax.retrofit_study import main
from diffjax.config import ConfigError
from diffjax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V2, V1 = ["model.attention=diff_v2"], ["model.attention=diff_v1"]


# ---------------------------------------------------------------------------- the declaration
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(source_steps=0), "RETROFIT.source_steps: got 0"),
        (dict(seeds=True), "RETROFIT.seeds: got True"),
        (dict(arms={}), "give at least one converted arm"),
        (dict(arms={"v2": ["train.lr=1e-3"]}), "'v2' names no DIFF kind"),
        (dict(arms={"v2": ["model.attention=standard"]}), "model.attention=standard"),
        (dict(arms={"v2": "model.attention=diff_v2"}), "is not a list of key=value strings"),
        (dict(arms={"source": V2}), "is the source's or the baseline's folder"),
        (dict(arms={"v-2": V2}), "use a plain name"),
        (dict(arms={"v2": [*V2, "train.steps=5"]}), "train.steps is set by the study"),
        (dict(continuation=["data.seed=3"]), "set RetrofitStudy.continue_data_seed"),
        (dict(source=["train.init_from=/x"]), "train.init_from is set by the study"),
        (dict(baseline="source"), "RETROFIT.baseline"),
        (dict(continue_data_seed=-1), "RETROFIT.continue_data_seed"),
    ],
)
def test_bad_declarations_are_refused_with_the_fix(fields, message):
    with pytest.raises(ConfigError, match="Fix:") as e:
        RetrofitStudy(**{"source_steps": 10, "continue_steps": 10, **fields})
    assert message in str(e.value)


def test_the_declaration_from_a_dict_and_the_command_line():
    study = RetrofitStudy.of({"source_steps": 5, "continue_steps": 3, "arms": {"v1": V1}})
    assert study.arms == {"v1": tuple(V1)} and study.seeds == 3 and study.baseline == "standard"
    assert RetrofitStudy(source_steps=1, continue_steps=1).arms.keys() == {"v2", "v1"}
    with pytest.raises(ConfigError, match="RETROFIT.continue_steps: missing"):
        RetrofitStudy.of({"source_steps": 5})
    with pytest.raises(ConfigError, match="RETROFIT.seed: unknown field"):
        RetrofitStudy.of({"source_steps": 5, "continue_steps": 3, "seed": 1})
    with pytest.raises(ConfigError, match="RETROFIT is a int"):
        RetrofitStudy.of(3)
    changed = apply_study_overrides(study, ["study.seeds=2", "study.continue_steps=7"])
    assert (changed.seeds, changed.continue_steps, changed.arms) == (2, 7, study.arms)
    with pytest.raises(ConfigError, match="not a study setting"):
        apply_study_overrides(study, ["study.arms=v2"])
    with pytest.raises(ConfigError, match="study.seeds: bad value 'two'"):
        apply_study_overrides(study, ["study.seeds=two"])
    with pytest.raises(ConfigError, match="RETROFIT.seeds"):
        apply_study_overrides(study, ["study.seeds=0"])


def test_the_cpu_config_plans_its_runs_seed_by_seed():
    path = os.path.join(ROOT, "configs", "retrofit_cpu.py")
    study = load_study(path)
    assert study is not None and study.seeds == 3 and set(study.arms) == {"v2", "v1"}
    assert load_study(os.path.join(ROOT, "configs", "default.py")) is None
    plan = plan_study(path, study, ["run.dir=/r"])
    names = [r.name for r in plan.runs]
    assert names[:5] == [
        "source/seed_0",
        "standard/seed_0",
        "v2/seed_0",
        "v1/seed_0",
        "source/seed_1",
    ]
    assert len(names) == 12
    source, standard, v2 = plan.runs[:3]
    assert source.directory == "/r/source/seed_0" and "train.steps=600" in source.overrides
    assert not any(o.startswith(("data.seed", "train.init_from")) for o in source.overrides)
    assert "train.init_from=/r/source/seed_0" in standard.overrides
    assert "data.seed=1" in standard.overrides and "train.steps=400" in standard.overrides
    assert not any(o.startswith("train.retrofit") for o in standard.overrides)
    assert v2.overrides[-2:] == ("model.attention=diff_v2", "train.retrofit=true")
    assert set(v2.overrides) - set(standard.overrides) == set(v2.overrides[-2:])


def test_a_source_that_cannot_become_an_arm_is_refused_before_training():
    path = os.path.join(ROOT, "configs", "retrofit_cpu.py")
    study = load_study(path)
    with pytest.raises(ConfigError, match="v1/seed_0: retrofit: DIFF V1 pairs the source's heads"):
        plan_study(path, study, ["run.dir=/r", "model.num_heads=1"])
    with pytest.raises(ConfigError, match="trains a standard source"):
        plan_study(path, study, ["run.dir=/r", "model.attention=diff_v2"])
    with pytest.raises(ConfigError, match="train.steps is set by the retrofit study"):
        plan_study(path, study, ["run.dir=/r", "train.steps=5"])
    same = RetrofitStudy(source_steps=5, continue_steps=5, continue_data_seed=0)
    with pytest.raises(ConfigError, match="read the source's batches again"):
        plan_study(path, same, ["run.dir=/r"])


def _run(seed, steps, val):
    empty = np.zeros(0)
    curve = EvalCurve(256.0 * np.array(steps), np.array(val, float), np.array(steps))
    return Run(seed, curve, empty, empty, None, {}, {})


def _study(v2, base):
    plan = {"study": {"baseline": "standard", "arms": ["v2"]}}
    return StudyData("/r", plan, {"standard": base, "v2": v2})


def test_the_paired_difference_and_the_recovery():
    a = {0: _run(0, [10, 20], [3.0, 2.0]), 1: _run(1, [10, 20], [3.2, 2.4])}
    b = {0: _run(0, [10, 20], [3.1, 2.1]), 1: _run(1, [10, 20, 30], [3.0, 2.0, 1.9])}
    curve = difference_curve(_study(a, b), "v2")
    assert curve.steps.tolist() == [10, 20] and curve.n_seeds == 2
    np.testing.assert_allclose(curve.mean, [0.05, 0.15])
    # two seeds: t_{0.975, 1} = 12.706 times sd / sqrt(2)
    half = [12.7062 * np.std(d, ddof=1) / np.sqrt(2) for d in ([-0.1, 0.2], [-0.1, 0.4])]
    np.testing.assert_allclose(curve.high - curve.mean, half, rtol=1e-4)
    np.testing.assert_allclose(curve.mean - curve.low, half, rtol=1e-4)
    steps, mean = step_mean(b)
    assert steps.tolist() == [10, 20] and mean.tolist() == pytest.approx([3.05, 2.05])
    assert recovery_step([10, 20, 30], [3.0, 2.5, 2.0], 2.5) == 20
    assert recovery_step([10, 20], [3.0, 2.6], 2.5) is None
    one = difference_curve(_study({0: a[0]}, b), "v2")
    assert np.isnan(one.low).all() and one.mean.tolist() == pytest.approx([-0.1, -0.1])
    assert difference_curve(_study({}, b), "v2") is None


def test_the_crossover_of_a_converted_arm():
    base = {s: _run(s, [10, 20, 30], [3.0, 2.0, 1.9]) for s in range(3)}
    # below the unconverted from step 20 on in every seed; at step 10 the seeds disagree
    v2 = {
        s: _run(s, [10, 20, 30], [3.0 + d, 1.5 + d / 10, 1.4]) for s, d in enumerate([-0.1, 0, 0.1])
    }
    data = _study(v2, base)
    lines, sentences = _final(data, {"v2": difference_curve(data, "v2")})
    assert "| -0.5000 (equal in all 3 seeds: no interval) | 3 |" in lines[-1]
    text = sentences["v2"]
    assert "minus the unconverted continuation" in text
    assert "No crossover" in text  # no spread at the last evaluation: no band there
    v2[2] = _run(2, [10, 20, 30], [3.1, 1.51, 1.41])
    lines, sentences = _final(data, {"v2": difference_curve(data, "v2")})
    assert "Crossover at 5,120 tokens (step 20)" in sentences["v2"]
    one = _study({0: v2[0]}, base)
    _, sentences = _final(one, {"v2": difference_curve(one, "v2")})
    assert "study.seeds=2" in sentences["v2"] and "compare.seeds" not in sentences["v2"]


# ---------------------------------------------------------------------------- the command
TINY = """
from diffjax.compare import RetrofitStudy
from diffjax.train import apply_overrides, default_config

RETROFIT = RetrofitStudy(
    source_steps=4,
    continue_steps=4,
    continuation=["train.eval_every=2", "retrofit.warmup_steps=2"],
    seeds=2,
    probe_examples=8,
)


def get_config():
    return apply_overrides(default_config(), [
        "model.attention=standard", "model.num_heads=2",
        "model.d_model=32", "model.num_layers=2", "model.max_seq_len=32", "data.seq_len=32",
        "data.max_files=12", "train.batch_size=8", "train.eval_batches=1",
        "train.warmup_steps=1", "train.eval_every=2", "train.checkpoint_every=100",
        "train.tensorboard=false",
    ])
"""


@pytest.mark.slow
def test_the_study_trains_stops_resumes_and_reports(tmp_path, capsys):
    """Two seeds of tiny models: SIGINT in the last run (v1, seed 1) stops the study (status
    75) with the seven runs before it finished; the same command skips them, resumes that run
    from the step the stop saved and writes retrofit.md; a third time trains nothing."""
    config = tmp_path / "tiny_retrofit.py"
    config.write_text(textwrap.dedent(TINY))
    run = tmp_path / "run"
    argv = ["--config", str(config), f"run.dir={run}"]

    def stop_in_the_last_run(step, checkpointer):
        if f"v1{os.sep}seed_1" in checkpointer.directory and step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    assert main(argv, after_step=stop_in_the_last_run) == 75
    out = capsys.readouterr().out
    assert "[1/8] source/seed_0: done" in out and "[7/8] v2/seed_1: done" in out
    assert "[8/8] v1/seed_1: stopped and saved" in out
    assert not (run / "v1" / "seed_1" / "study_done.json").exists()
    assert not (run / "retrofit.md").exists()

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("finished earlier, skipped") == 7 and "[8/8] v1/seed_1: done" in out
    assert (
        "resuming from the checkpoint at step 2"
        in (run / "v1" / "seed_1" / "train.log").read_text()
    )

    def records(arm, seed):
        return read_metrics(str(run / arm / f"seed_{seed}" / "metrics.jsonl"))

    for seed in (0, 1):
        first = {arm: records(arm, seed)[0] for arm in ("standard", "v2", "v1")}
        assert all(r["step"] == 1 for r in first.values())
        # the same first batch from the same weights: V2 exactly at the source, V1 not
        assert first["v2"]["loss"] == pytest.approx(first["standard"]["loss"], abs=1e-6)
        assert abs(first["v1"]["loss"] - first["standard"]["loss"]) > 1e-5
        assert first["v2"]["ramp"] == 0.0 and records("v2", seed)[-1]["ramp"] == 1.0
        cont = json.loads((run / "v2" / f"seed_{seed}" / "run_config.json").read_text())
        src = json.loads((run / "source" / f"seed_{seed}" / "run_config.json").read_text())
        assert cont["data"]["seed"] == src["data"]["seed"] + 1  # fresh batches
        assert cont["train"]["init_from"] == str(run / "source" / f"seed_{seed}")
        assert [r["step"] for r in records("v1", seed)] == [1, 2, 3, 4]

    report = (run / "retrofit.md").read_text()
    for row in ("| standard (unconverted) |", "| v2 (DIFF V2) |", "| v1 (DIFF V1) |", "| source |"):
        assert row in report
    assert "needle: not probed (no needle fits a 32-token context)" in report
    for section in ("## Step 0", "## Recovery of the source's loss", "## Retrieval"):
        assert section in report
    assert "| v2 | DIFF V2, 2 heads x 16 (2 query maps each) |" in report
    assert "| v1 | DIFF V1, 1 head x (2 x 16) |" in report
    assert "MQAR: 8 pairs, 4 queries, 32 tokens, 32 queries per model" in report
    # the crossover of each converted arm, whichever it is
    band = "the upper bound of the 95% band of {} minus the unconverted continuation over 2"
    assert band.format("v2 (DIFF V2)") in report and band.format("v1 (DIFF V1)") in report
    # the report's final difference is the runs' own
    finals = {arm: [records(arm, s)[-1]["val_loss"] for s in (0, 1)] for arm in ("standard", "v2")}
    diff = np.mean(np.subtract(finals["v2"], finals["standard"]))
    assert f"{diff:+.4f} [" in report
    assert (run / "retrofit.png").stat().st_size > 10_000
    done = {p: p.stat().st_mtime_ns for p in run.glob("*/seed_*/study_done.json")}
    assert len(done) == 8

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("finished earlier, skipped") == 8 and "training" not in out
    assert {p: p.stat().st_mtime_ns for p in done} == done


def test_the_command_line_reads_the_files_declaration(tmp_path):
    """``python -m diffjax.retrofit_study`` as a user runs it: the file's RetrofitStudy is the
    class the command checks it against (the command is a module of its own, so the study's
    classes are defined once), and the plan's own checks run: here a DIFF source is refused."""
    import subprocess
    import sys

    config = tmp_path / "diff_source.py"
    config.write_text(
        textwrap.dedent(
            """
            from diffjax.compare import RetrofitStudy
            from diffjax.train import default_config

            RETROFIT = RetrofitStudy(source_steps=2, continue_steps=2)


            def get_config():
                return default_config()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "diffjax.retrofit_study", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "trains a standard source" in proc.stderr and "RETROFIT is a" not in proc.stderr
