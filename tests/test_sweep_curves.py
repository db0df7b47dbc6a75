"""Arms side by side (``Ladder(arms=...)`` with neither sizes nor a field): the ladder's checks,
the report (diffjax.sweep.curves_report: sweep.md and curves.png, DIFF − twin over training and
the crossover per DIFF model) on hand-made runs, a tiny ladder of DIFF V1 with its twin and DIFF
V2 sharing that twin trained and reported, and configs/crossover_cpu.py planned and trained a
few steps."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import textwrap

import numpy as np
import pytest

from diffjax.config import ConfigError, ModelConfig, twin
from diffjax.sweep import Ladder, plan_sweep
from diffjax.sweep.cli import main, summary_section
from diffjax.sweep.curves_report import time_cell, training_time, write_curves_report
from diffjax.sweep.report import write_sweep_report
from diffjax.train.config import apply_overrides, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CROSSOVER = os.path.join(ROOT, "configs", "crossover_cpu.py")
ARMS = {
    "v1": ["model.attention=diff_v1", "model.num_heads=1"],
    "v2": ["model.attention=diff_v2", "model.num_heads=2", "compare.twins="],
}


# ---------------------------------------------------------------------------- the ladder
def test_arms_alone_are_one_rung_at_the_base_config():
    ladder = Ladder(arms=ARMS, tokens=1024)
    assert ladder.arms_only and ladder.rungs == [("", None)]
    assert Ladder.of({"arms": ARMS}).arms_only
    assert not Ladder(sizes=[(64, 1)], arms=ARMS).arms_only
    assert not Ladder(field="train.lr", values=[1, 2], arms=ARMS).arms_only


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(budget="proportional", tokens_per_param=2.0), r"SWEEP.budget: arms without sizes"),
        (dict(tokens_per_param=2.0), r"SWEEP.budget: arms without sizes"),
        (dict(budget="chinchilla"), r"SWEEP.budget: arms without sizes"),
        (dict(tokens=0), r"SWEEP.tokens: got 0"),
        (dict(size_overrides={"64x1": ["a=1"]}), r"SWEEP.size_overrides: is a setting of a sweep"),
        (dict(curve_size=0), r"SWEEP.curve_size: is a setting of a sweep over sizes"),
        (dict(evals=0), r"SWEEP.evals: got 0"),
        (dict(min_steps=-1), r"SWEEP.min_steps: got -1"),
    ],
)
def test_bad_arms_only_ladders_are_refused_with_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message) as e:
        Ladder(arms=ARMS, **fields)
    assert "Fix:" in str(e.value)


def test_the_crossover_config_plans_three_models_of_three_seeds():
    """configs/crossover_cpu.py: DIFF V1 with its twin and DIFF V2 alone (V1's twin is V2's),
    3 seeds each: 9 runs of 3000 steps, 30 evaluations."""
    run_dir, ladder, runs = plan_sweep(CROSSOVER, ["run.dir=/r"])
    assert run_dir == "/r" and ladder.arms_only and ladder.evals == 30
    assert [(r.name, r.directory, r.arm) for r in runs] == [
        ("v1", "/r/v1", "v1"),
        ("v2", "/r/v2", "v2"),
    ]
    assert [r.steps for r in runs] == [3000, 3000] and runs[0].tokens == 3000 * 16 * 128
    assert runs[0].twin_params is not None and runs[1].twin_params is None
    assert "train.eval_every=100" in runs[0].overrides
    base = load_config(CROSSOVER)
    exps = [apply_overrides(base, list(r.overrides)) for r in runs]
    assert [sorted(e.models) for e in exps] == [["diff", "standard"], ["diff"]]
    assert {e.compare.seeds for e in exps} == {3}
    assert sum(len(e.models) * e.compare.seeds for e in exps) == 9
    v1, v2 = (e.models["diff"] for e in exps)
    assert (v1.attention, v2.attention) == ("diff_v1", "diff_v2")
    assert twin(v2) == twin(v1) == exps[0].models["standard"]  # one twin for both
    # the command line shrinks it: tokens, evaluations and seeds
    _, small, short = plan_sweep(
        CROSSOVER, ["run.dir=/r", "sweep.tokens=4096", "sweep.evals=2", "compare.seeds=2"]
    )
    assert small.tokens == 4096 and [r.steps for r in short] == [10, 10]  # min_steps
    assert "train.eval_every=5" in short[0].overrides and "compare.seeds=2" in short[0].overrides


# ---------------------------------------------------------------------------- hand-made runs
def _model_config(attention: str, heads: int) -> dict:
    cfg = ModelConfig(attention=attention, d_model=32, num_layers=1, num_heads=heads, vocab_size=64)
    return dataclasses.asdict(cfg)


def _write_seed(folder, losses, tokens_per_step=100, step_time=0.5, every=10):
    """A finished seed: metrics.jsonl with an evaluation every ``every`` steps of ``losses``
    (one per evaluation) and result.json with the last as the final validation loss."""
    os.makedirs(folder, exist_ok=True)
    steps = every * len(losses)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            r = {"step": s, "loss": 5.0, "tokens": s * tokens_per_step, "step_time": step_time}
            if s % every == 0:
                r["val_loss"] = losses[s // every - 1]
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump({"final_val_loss": losses[-1], "steps": steps}, f)


def _hand_made(run_dir, v1_ahead, v2_ahead, seeds=(0, 1, 2)):
    """An arms-only run: v1 (DIFF V1 and its twin), v2 (DIFF V2 alone, sharing the twin);
    each DIFF's loss is the twin's plus ``*_ahead`` per evaluation plus a little seed noise."""
    noise = [0.004, -0.006, 0.002]
    plan = {"config": "hand.py", "ladder": dict(sizes=None, field=None, evals=5, arms=ARMS)}
    plan["sizes"] = [
        {"name": arm, "arm": arm, "value": None, "steps": 50, "tokens": 5000}
        for arm in ("v1", "v2")
    ]
    with open(os.path.join(run_dir, "sweep_plan.json"), "w") as f:
        json.dump(plan, f)
    for arm, attention, heads in (("v1", "diff_v1", 1), ("v2", "diff_v2", 2)):
        os.makedirs(os.path.join(run_dir, arm))
        with open(os.path.join(run_dir, arm, "config.json"), "w") as f:
            json.dump({"model": _model_config(attention, heads)}, f)
    for s in seeds:
        base = 3.0 - 0.1 * np.arange(5) + 0.05 * s
        _write_seed(os.path.join(run_dir, "v1", "standard", f"seed_{s}"), list(base), step_time=0.3)
        for arm, ahead in (("v1", v1_ahead), ("v2", v2_ahead)):
            loss = base + np.asarray(ahead) + noise[s]
            _write_seed(os.path.join(run_dir, arm, "diff", f"seed_{s}"), list(loss))
    return plan


def test_twins_pair_a_parameter_matched_arm_with_another_arms_twin(tmp_path):
    """A DIFF V2 with a narrower FFN (parameter-matched to the twin) is not the twin's own V2:
    ``twins`` pairs it with that twin all the same; a bad ``twins`` is refused."""
    arms = {**ARMS, "v2m": [*ARMS["v2"], "model.ffn_dim=48"]}
    with pytest.raises(ConfigError, match=r"SWEEP.twins: 'v2m': 'nope' does not name"):
        Ladder(arms=arms, twins={"v2m": "nope"})
    with pytest.raises(ConfigError, match="train 'v1' alone"):
        Ladder(arms=arms, twins={"v1": "v2"})
    plan = _hand_made(str(tmp_path), [0.1] * 5, [0.2] * 5)
    matched = ModelConfig(
        attention="diff_v2", d_model=32, num_layers=1, num_heads=2, vocab_size=64, ffn_dim=48
    )
    os.makedirs(tmp_path / "v2m")
    (tmp_path / "v2m" / "config.json").write_text(
        json.dumps({"model": dataclasses.asdict(matched)})
    )
    for s in (0, 1, 2):
        base = 3.0 - 0.1 * np.arange(5) + 0.05 * s
        loss = base - 0.05 + [0.004, -0.006, 0.002][s]
        _write_seed(os.path.join(tmp_path, "v2m", "diff", f"seed_{s}"), list(loss))
    plan["ladder"]["arms"] = arms
    plan["sizes"].append({"name": "v2m", "arm": "v2m", "value": None, "steps": 50, "tokens": 5000})
    (tmp_path / "sweep_plan.json").write_text(json.dumps(plan))
    assert "**DIFF V2 (v2m) against twin**" not in write_sweep_report(str(tmp_path))
    plan["ladder"]["twins"] = {"v2m": "v1"}
    (tmp_path / "sweep_plan.json").write_text(json.dumps(plan))
    text = write_sweep_report(str(tmp_path))
    assert "- **DIFF V2 (v2m) against twin**: DIFF is ahead of the twin from the first" in text


def test_the_report_of_hand_made_arms(tmp_path):
    """V1 pulls ahead of the twin at the 4th evaluation, V2 never does: sweep.md's summary,
    table and per-pair tables say so, and curves.png has a panel per DIFF model and one of the
    validation curves."""
    _hand_made(str(tmp_path), [0.2, 0.1, 0.02, -0.1, -0.2], [0.2, 0.2, 0.2, 0.2, 0.2])
    text = write_sweep_report(str(tmp_path))  # dispatched: the ladder has arms only
    assert text == (tmp_path / "sweep.md").read_text()
    assert text.startswith("# DIFF and its twin over training, arms side by side\n")
    assert "50 steps and 5,000 tokens per run, 5 evaluations each" in text
    summary = summary_section(text)
    assert "- **DIFF V1 (v1) against twin**: Crossover at 4,000 tokens (step 40)" in summary
    assert "- **DIFF V2 (v2) against twin**: No crossover: at the last evaluation" in summary
    assert "over 3 paired seeds" in summary
    table = [x for x in text.splitlines() if x.startswith("| DIFF V") and " | twin | " in x]
    rows = {line.split(" | ")[0]: line for line in table}
    v1, v2 = rows["| DIFF V1 (v1)"], rows["| DIFF V2 (v2)"]
    assert "| twin | 3 |" in v1 and "| at 4,000 tokens (step 40) |" in v1 and "| none |" in v2
    # the final difference: mean of the per-seed differences at the last evaluation
    d = np.array([-0.2 + n for n in (0.004, -0.006, 0.002)])
    assert f"{d.mean():+.4f} [" in v1
    # 50 steps of 0.5 s (DIFF) and 0.3 s (the twin) per seed
    assert v1.endswith("| 25 s ± 0 s | 15 s ± 0 s |")
    assert "| twin | - | 0, 1, 2 | 2.6500 ± 0.0500 | 15 s ± 0 s | - | - | - |" in text
    assert "## DIFF V1 (v1) − twin over training" in text
    assert "## DIFF V2 (v2) − twin over training" in text
    assert "| 50 | 5,000 | -0.2000 | [" in text
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_the_report_with_one_seed_and_before_anything_finished(tmp_path):
    (tmp_path / "one").mkdir()
    _hand_made(str(tmp_path / "one"), [-0.1] * 5, [0.1] * 5, seeds=(0,))
    plan = json.loads((tmp_path / "one" / "sweep_plan.json").read_text())
    text = write_curves_report(str(tmp_path / "one"), plan)
    assert text.count("One seed: no crossover is claimed") == 2
    assert "| one seed: none claimed |" in text and "one seed: no band" in text
    # the twin not started yet: the DIFF models are listed, waiting for it
    shutil.rmtree(tmp_path / "one" / "v1" / "standard")
    summary = summary_section(write_curves_report(str(tmp_path / "one"), plan))
    assert summary == (
        "- **DIFF V1 (v1)**: its twin has no finished seed yet.\n"
        "- **DIFF V2 (v2)**: its twin has no finished seed yet."
    )
    # nothing finished: the title and the summary say so, and no figure
    (tmp_path / "none").mkdir()
    _hand_made(str(tmp_path / "none"), [0.0] * 5, [0.0] * 5, seeds=())
    text = write_curves_report(str(tmp_path / "none"), plan)
    assert text.startswith("# ") and summary_section(text) == "Nothing has finished yet."
    assert not (tmp_path / "none" / "curves.png").exists()


def test_training_time_is_the_sum_of_the_step_times():
    assert training_time([{"step_time": 0.5}, {"step_time": 1.5}, {"loss": 1.0}]) == 2.0
    assert training_time([{"loss": 1.0}]) is None


def test_time_cells():
    from types import SimpleNamespace

    m = SimpleNamespace(seeds=[0, 1], time_s={0: 3000.0, 1: 3600.0})
    assert time_cell(m) == "55.0 min ± 7.1 min"
    assert time_cell(m, [0]) == "50.0 min"
    assert time_cell(SimpleNamespace(seeds=[0], time_s={0: None})) == "n/a"
    assert time_cell(SimpleNamespace(seeds=[0], time_s={0: 9000.0})) == "2.50 h"


# ---------------------------------------------------------------------------- trained
TWO_ARMS = """
from diffjax.sweep import Ladder
from diffjax.compare import default_comparison
from diffjax.train import apply_overrides

SWEEP = Ladder(
    tokens=6 * 8 * 16,
    evals=3,
    min_steps=2,
    arms={
        "v1": ["model.attention=diff_v1", "model.num_heads=1"],
        "v2": ["model.attention=diff_v2", "model.num_heads=2", "compare.twins="],
    },
)


def get_config():
    return apply_overrides(default_comparison(), [
        "model.d_model=32", "model.num_layers=1", "model.max_seq_len=32", "data.seq_len=16",
        "data.max_files=12", "train.batch_size=8", "train.eval_batches=1", "train.warmup_steps=0",
        "compare.seeds=2", "compare.quick_eval=false", "compare.throughput_rounds=0",
        "train.tensorboard=false", "train.checkpoint_every=100",
    ])
"""


@pytest.mark.slow
def test_a_tiny_ladder_of_arms_trains_and_reports(tmp_path, capsys):
    """DIFF V1 with its twin and DIFF V2 sharing that twin, 6 steps, 2 seeds: sweep.md has a
    row per DIFF model against the one twin, the crossover and the times; --report-only
    rebuilds it without training."""
    config = tmp_path / "arms.py"
    config.write_text(textwrap.dedent(TWO_ARMS))
    run = tmp_path / "run"
    argv = ["--config", str(config), f"run.dir={run}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"sweep: 2 arms into {run}" in out
    assert "[rung 1/2] v1: training DIFF" in out and "and the twin" in out
    assert "[rung 2/2] v2: training DIFF" in out
    assert "**DIFF V1 (v1) against twin**" in out  # the summary, printed
    for label in ("diff", "standard"):
        for seed in (0, 1):
            assert (run / "v1" / label / f"seed_{seed}" / "result.json").is_file()
    assert (run / "v2" / "diff" / "seed_1" / "result.json").is_file()
    assert not (run / "v2" / "standard").exists()  # V2 shares V1's twin
    report = (run / "sweep.md").read_text()
    assert report.startswith("# DIFF and its twin over training")
    rows = [x for x in report.splitlines() if x.startswith("| DIFF V") and " | twin | " in x]
    assert [x.split(" | ")[:3] for x in rows] == [
        ["| DIFF V1 (v1)", "twin", "2"],
        ["| DIFF V2 (v2)", "twin", "2"],
    ]
    assert all(" s |" in x for x in rows)  # the training times
    (twin_row,) = [x for x in report.splitlines() if x.startswith("| twin | ")]
    assert "| 0, 1 |" in twin_row and "xla" in twin_row  # seeds; and what computed attention
    assert float(twin_row.split(" | ")[1].replace(",", "")) > 0  # its parameters
    assert (run / "curves.png").stat().st_size > 10_000
    # each comparison's own report has DIFF − twin over training (V2's has no twin)
    assert "**DIFF − twin over training**" in (run / "v1" / "report.md").read_text()
    assert "DIFF − twin over training" not in (run / "v2" / "report.md").read_text()

    # the final difference is the runs' own: rebuild it by hand
    def final(arm, label, seed):
        return json.loads((run / arm / label / f"seed_{seed}" / "result.json").read_text())[
            "final_val_loss"
        ]

    d = np.mean([final("v2", "diff", s) - final("v1", "standard", s) for s in (0, 1)])
    assert f"{d:+.4f}" in rows[1].split(" | ")[5]
    (run / "sweep.md").unlink()
    assert main([*argv, "--report-only"]) == 0
    assert "training" not in capsys.readouterr().out
    assert (run / "sweep.md").read_text() == report


@pytest.mark.slow
def test_the_crossover_config_trains_a_few_steps(tmp_path, capsys):
    """configs/crossover_cpu.py itself, shrunk from the command line (a small model, few tokens,
    2 seeds, 2 evaluations): both arms train and sweep.md pairs DIFF V1 and DIFF V2 with the
    one twin."""
    run = tmp_path / "run"
    small = [
        f"run.dir={run}",
        "sweep.tokens=512",
        "sweep.evals=2",
        "sweep.min_steps=4",
        "compare.seeds=2",
        "train.eval_batches=1",
        "train.batch_size=8",
        "train.checkpoint_every=100",
        "model.d_model=32",
        "model.num_layers=1",
        "model.max_seq_len=32",
        "data.seq_len=16",
        "data.max_files=12",
    ]
    assert main(["--config", CROSSOVER, *small]) == 0
    assert "sweep: 2 arms into" in capsys.readouterr().out
    steps = {json.loads((run / "v1" / "diff" / "seed_1" / "result.json").read_text())["steps"]}
    assert steps == {4}
    report = (run / "sweep.md").read_text()
    assert "Config `" + CROSSOVER + "`" in report
    assert "| DIFF V1 (v1) | twin | 2 |" in report and "| DIFF V2 (v2) | twin | 2 |" in report
