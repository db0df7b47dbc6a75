"""A sweep over any setting (``Ladder(field=..., values=...)``): the learning-rate sensitivity
and its paired bootstrap on made-up loss curves, the ladder's checks, and a two-rung ladder over
``train.lr`` with two arms (DIFF V1 with its standard and gated twins, DIFF V2 sharing both)
trained and reported."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest

from diffjax.config import ConfigError
from diffjax.sweep import Ladder
from diffjax.sweep.cli import main
from diffjax.sweep.sensitivity import bootstrap, lr_sensitivity

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------- the measure
def test_a_flat_curve_is_not_sensitive():
    assert lr_sensitivity([3.0, 3.0, 3.0, 3.0], initial=5.5) == 0.0


def test_rungs_above_the_initial_loss_and_diverged_ones_count_as_the_initial_loss():
    # best 2.0; the others: 0.5, 0 (best), 1.5, then 9.0 and NaN and inf capped at 5.5 -> 3.5 each
    final = [2.5, 2.0, 3.5, 9.0, NAN, INF]
    assert lr_sensitivity(final, initial=5.5) == pytest.approx((0.5 + 0 + 1.5 + 3.5 * 3) / 6)
    # a NaN rung counts exactly as a rung that ended at the initial loss
    assert lr_sensitivity([2.0, NAN], 5.5) == lr_sensitivity([2.0, 5.5], 5.5) == 1.75


def test_every_rung_diverged_is_zero_and_bad_input_is_refused():
    assert lr_sensitivity([NAN, NAN], 5.5) == 0.0  # all at the cap: no rung better than another
    with pytest.raises(ValueError, match="no rungs"):
        lr_sensitivity([], 5.5)
    with pytest.raises(ValueError, match="initialisation"):
        lr_sensitivity([1.0], NAN)


def test_the_paired_bootstrap_resamples_seeds_together():
    diff, twin = [1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5]
    est = bootstrap({"diff": diff, "twin": twin, "d": np.subtract(diff, twin)}, resamples=4000)
    assert est["diff"].mean == 2.5 and est["diff"].low < 2.5 < est["diff"].high
    # the per-seed differences are all -0.5: every paired resample gives exactly -0.5
    assert est["d"].mean == est["d"].low == est["d"].high == -0.5
    one = bootstrap({"diff": [1.0]})["diff"]
    assert one.low is None and "1 seed: no interval" in one.cell()
    with pytest.raises(ValueError, match="one value per seed"):
        bootstrap({"diff": [1.0, 2.0], "twin": [1.0]})


# ---------------------------------------------------------------------------- the ladder
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(field="train.lr", values=[1e-3]), r"SWEEP.values: .* at least two values"),
        (dict(field="lr", values=[1e-3, 1e-2]), r"SWEEP.field: .* train.py key"),
        (dict(field="train.lr", values=[1e-3, 1e-3]), r"listed twice"),
        (dict(field="train.lr", values=[1, 2], sizes=[(64, 1)]), r"either sizes or field"),
        (
            dict(field="train.lr", values=[1, 2], budget="proportional", tokens_per_param=2.0),
            r"same tokens",
        ),
        (
            dict(field="train.lr", values=[1, 2], curve_size=0),
            r"curve_size: is a setting of a sweep over sizes",
        ),
        (dict(field="train.lr", values=[1, 2], arms={"v 1": ["a=b"]}), r"SWEEP.arms: name 'v 1'"),
        (
            dict(field="train.lr", values=[1, 2], arms={"v1": "model.attention=diff_v1"}),
            r"not a list",
        ),
    ],
)
def test_bad_field_ladders_are_refused_with_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message) as e:
        Ladder(**fields)
    assert "Fix:" in str(e.value)


def test_a_field_ladder_names_its_rungs():
    ladder = Ladder(field="train.lr", values=[1e-4, 3e-3, 0.1], tokens=1024)
    assert [name for name, _ in ladder.rungs] == ["lr_0.0001", "lr_0.003", "lr_0.1"]


# ---------------------------------------------------------------------------- the command
TWO_RUNGS = """
from diffjax.sweep import Ladder
from diffjax.compare import default_comparison
from diffjax.train import apply_overrides

SWEEP = Ladder(
    field="train.lr",
    values=[1e-3, 3.0],
    tokens=6 * 8 * 16,
    evals=2,
    min_steps=2,
    arms={
        "v1": ["model.attention=diff_v1", "model.num_heads=1", "compare.twins=standard,gated"],
        "v2": ["model.attention=diff_v2", "model.num_heads=2", "compare.twins="],
    },
)


def get_config():
    return apply_overrides(default_comparison(), [
        "model.d_model=32", "model.num_layers=1", "model.max_seq_len=32", "data.seq_len=16",
        "data.max_files=12", "train.batch_size=8", "train.eval_batches=1", "train.warmup_steps=0",
        "compare.seeds=2", "compare.quick_eval=false", "compare.throughput_rounds=0",
        "train.tensorboard=false", "train.checkpoint_every=100", "train.diagnostics=true",
        "train.skip_spikes=3", "train.spike_window=2",
    ])
"""


@pytest.mark.slow
def test_a_two_rung_ladder_over_the_learning_rate_trains_and_reports(tmp_path, capsys):
    config = tmp_path / "lr_sweep.py"
    config.write_text(textwrap.dedent(TWO_RUNGS))
    run = tmp_path / "run"
    assert main(["--config", str(config), f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "sweep: 4 comparisons over train.lr" in out
    assert "[rung 1/4] lr_0.001/v1: training DIFF" in out and "and the gated twin (" in out
    assert "[rung 2/4] lr_0.001/v2: training DIFF" in out
    for rung in ("lr_0.001", "lr_3"):
        assert (run / rung / "v1" / "standard" / "seed_1" / "result.json").is_file()
        assert (run / rung / "v1" / "gated" / "seed_1" / "result.json").is_file()
        assert not (run / rung / "v2" / "standard").exists()  # V2 shares V1's twins
        cfg = json.loads((run / rung / "v2" / "config.json").read_text())
        assert cfg["train"]["lr"] == (1e-3 if rung == "lr_0.001" else 3.0)
        assert cfg["model"]["attention"] == "diff_v2"
    report = (run / "sweep.md").read_text()
    assert "# Sweep over `train.lr`" in report
    assert "| train.lr | DIFF V1 (v1) | twin | gated twin | DIFF V2 (v2) |" in report
    assert "## Learning-rate sensitivity" in report
    for pair in ("| DIFF V1 (v1) | twin | 2 |", "| DIFF V2 (v2) | twin | 2 |"):
        assert pair in report
    for pair in ("| DIFF V1 (v1) | gated twin | 2 |", "| DIFF V2 (v2) | gated twin | 2 |"):
        assert pair in report
    assert "- DIFF V2 (v2) against gated twin: learning-rate sensitivity" in report
    assert "- DIFF V1 (v1) against twin: learning-rate sensitivity" in report
    assert "| 3 | DIFF V2 (v2) |" in report and "largest attention logit" in report
    assert (run / "sweep_field.png").stat().st_size > 10_000
    # the report's numbers are the runs': rebuild one sensitivity by hand
    from diffjax.sweep.sensitivity import lr_sensitivity as s
    from diffjax.train.metrics import read_metrics

    def family(arm, label, seed):
        finals = []
        for rung in ("lr_0.001", "lr_3"):
            folder = run / rung / arm / label / f"seed_{seed}"
            finals.append(json.loads((folder / "result.json").read_text())["final_val_loss"])
        first = read_metrics(
            str(run / "lr_0.001" / arm / label / f"seed_{seed}" / "metrics.jsonl")
        )[0]
        return s(finals, first["loss"])

    diff = np.mean([family("v1", "diff", seed) for seed in (0, 1)])
    assert f"{diff:.4f}" in report.split("## Learning-rate sensitivity")[1].split("\n| DIFF V1")[1]
    assert math.isfinite(diff)
    # DIFF V2 against the gated twin V1's arm trained: the sensitivities' paired difference
    v2 = [family("v2", "diff", seed) for seed in (0, 1)]
    gated = [family("v1", "gated", seed) for seed in (0, 1)]
    row = report.split("| DIFF V2 (v2) | gated twin | 2 |")[1].split("\n")[0]
    assert f"{np.mean(v2) - np.mean(gated):+.4f}" in row
