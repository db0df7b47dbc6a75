"""The scaling sweep: the fits and the parameter and tokens ratios on synthetic curves with a
known answer, the bootstrap over hand-made seeds, the ladder's checks, and the command on a
two-size ladder of tiny models stopped in its second size and resumed."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import numpy as np
import pytest

from diffjax.config import ConfigError
from diffjax.sweep import Ladder, fit, load_ladder, main, plan_sweep, write_sweep_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO = 0.63


def twin_loss(n):
    """A twin's loss against parameters: ``E + A N^-alpha``."""
    return 1.5 + 40.0 * np.asarray(n, np.float64) ** -0.3


def diff_loss(n, ratio=RATIO):
    """DIFF with ``ratio`` times the twin's parameters has the twin's loss."""
    return twin_loss(np.asarray(n, np.float64) / ratio)


# ---------------------------------------------------------------------------- fits
def test_power_law_fit_gives_back_its_parameters():
    n = np.geomspace(1e5, 1e7, 5)
    f = fit.fit_scaling_law(n, twin_loss(n))
    assert f.form == fit.POWER_LAW
    assert f.E == pytest.approx(1.5, abs=1e-3) and f.alpha == pytest.approx(0.3, rel=1e-3)
    assert f.A == pytest.approx(40.0, rel=1e-2) and f.rms < 1e-6
    noisy = twin_loss(n) + np.array([0.002, -0.002, 0.001, -0.001, 0.0])
    assert fit.fit_scaling_law(n, noisy).alpha == pytest.approx(0.3, rel=0.3)


@pytest.mark.parametrize("count", [2, 3])
def test_fewer_than_four_sizes_fit_a_log_log_line(count):
    n = np.geomspace(1e5, 1e6, count)
    f = fit.fit_scaling_law(n, 7.0 * n**-0.1)
    assert f.form == fit.LOG_LOG_LINE and f.E == 0.0
    assert f.alpha == pytest.approx(0.1) and f.A == pytest.approx(7.0)
    assert f"{count} sizes: fewer than 4" in f.describe()
    assert fit.fit_scaling_law([1e5], [3.0]) is None
    per_seed = fit.fit_scaling_law(n, [[y - 0.01, y + 0.01] for y in 7.0 * n**-0.1])
    assert per_seed.alpha == pytest.approx(0.1)  # per-seed values are averaged


# ---------------------------------------------------------------------------- parameter ratio
def test_parameter_ratio_gives_back_the_known_ratio():
    n = np.geomspace(1e5, 1e7, 12)  # 1.5x steps
    ratios = fit.parameter_ratio(n, diff_loss(n), n, twin_loss(n))
    # DIFF would need 0.63 x the two smallest twin sizes, below its smallest: not measured
    assert ratios[:2] == [None, None]
    assert fit.unmatched_bound(n, diff_loss(n), n[0], float(twin_loss(n[0]))) == ("<", 1.0)
    assert all(r == pytest.approx(RATIO, rel=0.02) for r in ratios[2:])
    by_fit = fit.parameter_ratio(n, diff_loss(n), n, twin_loss(n), method="fit")
    assert by_fit[:2] == [None, None]
    assert all(r == pytest.approx(RATIO, rel=1e-3) for r in by_fit[2:])


def test_a_ratio_outside_the_measured_sizes_is_not_measured():
    """DIFF worse than the twin (ratio 1.6): the largest twin sizes' losses lie below DIFF's
    largest measured size's, so they are not measured, never extrapolated."""
    n = np.geomspace(1e5, 1e7, 5)
    ratios = fit.parameter_ratio(n, diff_loss(n, 1.6), n, twin_loss(n))
    assert ratios[-1] is None and ratios[0] is not None
    assert ratios[0] == pytest.approx(1.6, rel=0.08)
    bound = fit.unmatched_bound(n, diff_loss(n, 1.6), n[-1], float(twin_loss(n[-1])))
    assert bound == (">", 1.0)
    assert fit.parameter_ratio(n, diff_loss(n, 1.6), n, twin_loss(n), method="fit")[-1] is None


def _seeds(means, offsets):
    return [[m + o for o in offsets] for m in means]


def test_bootstrap_interval_holds_the_ratio_and_shrinks_with_agreeing_seeds():
    n = np.geomspace(1e5, 1e7, 12)
    twin, diff = twin_loss(n), diff_loss(n)
    noisy = (-0.02, 0.03, -0.01, 0.0)
    close = (-0.002, 0.003, -0.001, 0.0)
    wide = fit.bootstrap_parameter_ratio(
        n, _seeds(diff, noisy), n, _seeds(twin, noisy[::-1]), resamples=200
    )
    tight = fit.bootstrap_parameter_ratio(
        n, _seeds(diff, close), n, _seeds(twin, close[::-1]), resamples=200
    )
    for i in (5, 8):
        for iv in (wide[i], tight[i]):
            assert iv.low <= RATIO <= iv.high * 1.02  # the interpolation leans high by <2%
        assert tight[i].high - tight[i].low < 0.3 * (wide[i].high - wide[i].low)
    # seeds that agree exactly, or one seed: no interval, and the reason
    same = fit.bootstrap_parameter_ratio(
        n, _seeds(diff, (0, 0)), n, _seeds(twin, (0, 0)), resamples=20
    )
    assert same[5].low is None and "agree exactly" in same[5].describe()
    one = fit.bootstrap_parameter_ratio(n, _seeds(diff, (0,)), n, _seeds(twin, (0,)), resamples=5)
    assert one[5].low is None and "one seed per size" in one[5].describe()
    with pytest.raises(ValueError, match="paired seeds"):
        fit.bootstrap_parameter_ratio(n[:1], [[3.0, 3.1]], n[:1], [[3.0]])


# ---------------------------------------------------------------------------- tokens ratio
def learning_curve(tokens, ratio=1.0):
    return 1.2 + 30.0 * (np.asarray(tokens, np.float64) / ratio) ** -0.25


def test_tokens_ratio_on_synthetic_learning_curves():
    tokens = np.geomspace(1e4, 1e7, 40)
    twin = learning_curve(tokens)
    diff = learning_curve(tokens, 0.64)  # DIFF at T tokens = the twin at T / 0.64
    assert fit.tokens_ratio(tokens, diff, tokens, twin) == pytest.approx(0.64, rel=0.01)
    # DIFF never reaches the twin's final loss within its curve: not measured
    assert fit.tokens_ratio(tokens, learning_curve(tokens, 1.5), tokens, twin) is None
    # already below it at its first evaluation: no earlier point, not measured
    assert fit.tokens_ratio(tokens, np.full_like(diff, 1.0), tokens, twin) is None
    seeds = [diff + 0.004, diff - 0.004, diff + 0.001]
    twins = [twin - 0.003, twin + 0.003, twin]
    iv = fit.bootstrap_tokens_ratio(tokens, seeds, tokens, twins, resamples=300)
    assert iv.low <= 0.64 <= iv.high and iv.high - iv.low < 0.1 and iv.defined == 1.0


# ---------------------------------------------------------------------------- the report
def write_run(run_dir, sizes, seeds=(0, 1)):
    """A finished sweep's files, written by hand: per size and seed, DIFF's and the twin's
    final validation loss from the synthetic laws (ratio 0.63; a seed offset each, not the same
    for the two) and learning curves that end there, and their result.json."""
    plan = {"config": "hand-made", "ladder": {"budget": "fixed", "curve_size": None}, "sizes": []}
    tokens = np.geomspace(1e4, 1e6, 12)
    for i, n in enumerate(sizes):
        directory = os.path.join(run_dir, f"size_{i}")
        size = {"name": f"s{i}", "directory": directory, "diff_params": int(n)}
        plan["sizes"].append({**size, "twin_params": int(n), "tokens": int(tokens[-1])})
        for seed in seeds:
            for label, final, offset in (
                ("diff", diff_loss(n), 0.01 * (seed - 0.5)),
                ("standard", twin_loss(n), -0.004 * (seed - 0.5)),
            ):
                curve = final + offset + learning_curve(tokens) - learning_curve(tokens[-1])
                d = os.path.join(directory, label, f"seed_{seed}")
                os.makedirs(d)
                with open(os.path.join(d, "metrics.jsonl"), "w") as f:
                    for t, y in zip(tokens, curve):
                        f.write(json.dumps({"step": 1, "tokens": float(t), "val_loss": y}) + "\n")
                with open(os.path.join(d, "result.json"), "w") as f:
                    json.dump({"final_val_loss": float(curve[-1]), "seed": seed}, f)
    with open(os.path.join(run_dir, "sweep_plan.json"), "w") as f:
        json.dump(plan, f)


def test_report_of_a_hand_made_sweep(tmp_path):
    write_run(str(tmp_path), np.geomspace(1e5, 1e7, 6))
    text = write_sweep_report(str(tmp_path), resamples=100)
    assert "- DIFF: power law L = E + A N^-alpha" in text and "- twin: power law" in text
    assert "2 paired seeds per size" in text and "paper, 830M-13B" in text
    assert "the interval lies below 100%: DIFF needs fewer parameters" in text
    assert "**Tokens** (size s5, 2 paired seeds)" in text and "fewer tokens" in text
    rows = [line for line in text.splitlines() if line.startswith("| s") and "size" not in line]
    assert len(rows) == 6 and "not measured (< 100%" in rows[0]
    assert all(row.endswith("| 63% |") for row in rows[2:])  # from DIFF's fit
    assert "95% t-interval [-" in text  # the per-size loss difference, paired by seed
    assert (tmp_path / "sweep_loss.png").stat().st_size > 10_000
    assert (tmp_path / "sweep_ratio.png").stat().st_size > 10_000


# ---------------------------------------------------------------------------- the ladder
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"sizes": []}, r"SWEEP.sizes: got \[\]"),
        ({"sizes": [(64,)]}, r"SWEEP.sizes: entry 0 is \(64,\).*\(d_model, num_layers\)"),
        ({"sizes": [(64, 0)]}, r"entry 0 is \(64, 0\). Fix: use positive integers"),
        ({"sizes": [(64, 1), (64, 1, 2)]}, r"\(d_model, num_layers\) is listed twice"),
        ({"sizes": [(64, 1)], "budget": "chinchilla"}, r"SWEEP.budget: unknown budget"),
        ({"sizes": [(64, 1)], "budget": "proportional"}, r"needs a positive tokens_per_param"),
        ({"sizes": [(64, 1)], "tokens_per_param": 20}, r"budget 'fixed' trains every size"),
        ({"sizes": [(64, 1)], "tokens": -5}, r"SWEEP.tokens: got -5"),
        ({"sizes": [(64, 1)], "curve_size": 3}, r"index 3 is not one of the 1 sizes"),
        ({"sizes": [(64, 1)], "size_overrides": {"32x1": ["a=1"]}}, r"'32x1' is not a size"),
        ({"sizes": [(64, 1)], "size_overrides": {"64x1": ["steps"]}}, r"not a list of key="),
        ({"sizes": [(64, 1)], "sises": 1}, r"SWEEP.sises: unknown field"),
        ({"budget": "fixed"}, r"SWEEP.sizes: missing"),
    ],
)
def test_bad_ladders_are_refused_with_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        Ladder.of(fields)


def test_bad_sweep_config_files_are_refused(tmp_path, capsys):
    plain = os.path.join(ROOT, "configs", "default.py")
    with pytest.raises(ConfigError, match="declares no SWEEP"):
        load_ladder(plain)
    assert main(["--config", plain]) == 2
    assert "declares no SWEEP" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("SWEEP = [(64, 1)]\n")
    with pytest.raises(ConfigError, match="SWEEP is a list"):
        load_ladder(str(bad))
    shape = tmp_path / "shape.py"  # 3 DIFF heads do not divide d_model 64
    shape.write_text(
        "from diffjax.compare import default_comparison\n"
        "SWEEP = {'sizes': [(64, 1, 3)], 'tokens': 1000}\n"
        "def get_config():\n    return default_comparison()\n"
    )
    with pytest.raises(ConfigError, match="size 64x1: .*ModelConfig"):
        plan_sweep(str(shape), [f"run.dir={tmp_path / 'x'}"])


def test_the_ladders_of_the_config_files():
    _, _, cpu = plan_sweep(os.path.join(ROOT, "configs", "scaling_cpu.py"), ["run.dir=/r"])
    assert [r.directory for r in cpu][0] == "/r/size_64x1"
    assert 40_000 < cpu[0].diff_params < 60_000 and 2.5e6 < cpu[-1].diff_params < 3.5e6
    assert len({r.tokens for r in cpu}) == 1
    _, _, paper = plan_sweep(os.path.join(ROOT, "configs", "scaling_paper.py"), [])
    assert [r.name for r in paper] == ["1536x24", "2048x24", "2560x32", "4096x32", "5120x40"]
    assert {r.tokens for r in paper} == {40_000 * 128 * 2048}
    _, ladder, short = plan_sweep(
        os.path.join(ROOT, "configs", "scaling_cpu.py"), ["sweep.tokens=4096", "sweep.evals=2"]
    )
    assert ladder.tokens == 4096 and [r.steps for r in short] == [10] * 4  # min_steps
    assert "train.eval_every=5" in short[0].overrides
    assert not any(o.startswith("sweep.") for o in short[0].overrides)
    with pytest.raises(ConfigError, match="sweep.tokens: bad value 'many'"):
        plan_sweep(os.path.join(ROOT, "configs", "scaling_cpu.py"), ["sweep.tokens=many"])
    with pytest.raises(ConfigError, match="not a sweep setting"):
        plan_sweep(os.path.join(ROOT, "configs", "scaling_cpu.py"), ["sweep.sizes=1"])
    lr_config = os.path.join(ROOT, "configs", "lr_sensitivity_cpu.py")
    _, lr, runs = plan_sweep(lr_config, ["run.dir=/r"], "SENSITIVITY")
    assert lr.field == "train.lr" and len(lr.values) >= 7 and min(lr.values) < 2e-3 / 10
    assert [r.name for r in runs][:3] == ["lr_0.0001/v1", "lr_0.0001/v2", "lr_0.0003/v1"]
    assert runs[0].directory == "/r/lr_0.0001/v1" and "train.lr=0.0001" in runs[0].overrides
    assert runs[1].twin_params is None  # V2 shares V1's twin: the same config
    proportional = Ladder(sizes=[(64, 1)], budget="proportional", tokens_per_param=20)
    assert proportional.steps(2048, 50_000, base_steps=7) == 489  # ceil(1e6 / 2048)
    assert Ladder(sizes=[(64, 1)]).steps(2048, 50_000, base_steps=7) == 10  # min_steps


# ---------------------------------------------------------------------------- the command
TINY = """
import dataclasses
from diffjax.sweep import Ladder
from diffjax.compare import default_comparison
from diffjax.train import apply_overrides

SWEEP = Ladder(
    sizes=[(16, 1, 1), (32, 1, 1)], budget="fixed", tokens=6 * 8 * 16, evals=3, min_steps=2
)


def get_config():
    return apply_overrides(default_comparison(), [
        "model.max_seq_len=32", "data.seq_len=16", "data.max_files=12", "train.batch_size=8",
        "train.eval_batches=2", "train.warmup_steps=2", "compare.seeds=1",
        "compare.quick_eval=false", "compare.throughput_rounds=0", "train.tensorboard=false",
        "train.checkpoint_every=2",
    ])
"""


@pytest.mark.slow
def test_sweep_stopped_in_its_second_size_resumes_and_reports(tmp_path, capsys):
    """Two sizes of tiny models, one seed: SIGINT in the second size's DIFF run stops the sweep
    (status 75) with the first size finished; the same command skips the first, resumes the
    second from the step the stop saved, and writes sweep.md and its plots."""
    config = tmp_path / "tiny_sweep.py"
    config.write_text(textwrap.dedent(TINY))
    run = tmp_path / "run"
    argv = ["--config", str(config), f"run.dir={run}"]

    def stop_in_second_size(step, checkpointer):
        if "size_32x1" in checkpointer.directory and step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    assert main(argv, after_step=stop_in_second_size) == 75
    out = capsys.readouterr().out
    assert "[size 1/2] 16x1: training" in out and "[size 1/2] 16x1: done" in out
    assert "[size 2/2] 32x1: stopped and saved; re-run the same command" in out
    assert (run / "size_16x1" / "sweep_done.json").is_file()
    assert not (run / "size_32x1" / "sweep_done.json").exists()
    assert not (run / "sweep.md").exists()

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[size 1/2] 16x1: finished earlier, skipped" in out
    assert "[size 2/2] 32x1: done" in out and "**Parameters**" in out
    log = (run / "size_32x1" / "train.log").read_text()
    assert "resuming from the checkpoint at step 3" in log  # the stop saved step 3
    for size in ("16x1", "32x1"):
        for label in ("diff", "standard"):
            result = json.loads(
                (run / f"size_{size}" / label / "seed_0" / "result.json").read_text()
            )
            assert result["steps"] == 6
    report = (run / "sweep.md").read_text()
    assert "| 16x1 |" in report and "| 32x1 |" in report and "paper, 830M-13B" in report
    assert fit.LOG_LOG_LINE.split(",")[0] in report  # two sizes: the log-log line
    for name in ("sweep_loss.png", "sweep_ratio.png"):
        assert (run / name).stat().st_size > 10_000
    plan = json.loads((run / "sweep_plan.json").read_text())
    assert [s["steps"] for s in plan["sizes"]] == [6, 6]
    assert main([*argv, "--report-only"]) == 0  # rebuilt from the files, nothing trained
    assert "training" not in capsys.readouterr().out


def test_the_fit_reads_no_ratio_outside_diffs_measured_losses():
    """A smooth fit can pass below DIFF's measured points; a twin loss that no measured DIFF
    size reaches gets no ratio from the fit either (measured CPU-ladder numbers)."""
    sizes = [53_632, 213_568, 886_272, 3_215_104]
    diff = [2.7753, 2.5849, 2.4004, 2.3936]
    assert fit.parameter_ratio(sizes, diff, [3_213_568], [2.3933], method="fit") == [None]
    assert fit.parameter_ratio(sizes, diff, [3_213_568], [2.3933]) == [None]
    (inside,) = fit.parameter_ratio(sizes, diff, [213_376], [2.4561], method="fit")
    assert inside is not None and 1.0 < inside < 5.0
