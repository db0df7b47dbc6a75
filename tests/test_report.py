"""The comparison report (diffjax.compare.report: report.md and loss.png) on hand-made results:
the paired-difference cell and sentence when the seeds give no spread, and the loss plot's
tick labels."""

from __future__ import annotations

import json
import os

import jax

from diffjax.compare.plots import compact_count
from diffjax.compare.report import (
    comparison_sentences,
    loss_figure,
    plot_losses,
    results_table,
)
from diffjax.train.recorder import TrainResult


def _result(directory, label, seed, val_loss, accuracy, records):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return TrainResult(
        label=label,
        attention="diff_v1" if label == "diff" else "standard",
        directory=str(directory),
        params=1000,
        steps=len(records),
        tokens_seen=records[-1]["tokens"],
        final_train_loss=records[-1]["loss"],
        final_val_loss=val_loss,
        tokens_per_s=1.0,
        step_time_s=1.0,
        peak_memory_bytes=None,
        memory_source="test",
        seed=seed,
        metrics={"val_query_accuracy": accuracy},
    )


def _records(steps=40, tokens_per_step=65_536, offset=0.0):
    """Token counts in the millions (the tick labels that ran together), an evaluation every
    10 steps."""
    out = []
    for s in range(1, steps + 1):
        r = {"step": s, "loss": 5.0 - 0.05 * s + offset, "tokens": s * tokens_per_step}
        if s % 10 == 0:
            r["val_loss"] = 5.1 - 0.05 * s + offset
        out.append(r)
    return out


def _results(tmp_path, accuracy=(0.0, 0.0, 0.0, 0.0)):
    """Two seeds per model; ``accuracy``: diff seed 0, diff seed 1, standard seed 0, 1."""
    out = []
    for i, (label, seed) in enumerate((("diff", 0), ("diff", 1), ("standard", 0), ("standard", 1))):
        out.append(
            _result(
                tmp_path / label / f"seed_{seed}",
                label,
                seed,
                (3.0, 3.05, 3.2, 3.3)[i],
                accuracy[i],
                _records(offset=0.01 * i),
            )
        )
    return out


def test_compact_count_labels():
    assert compact_count(0) == "0"
    assert compact_count(950) == "950"
    assert compact_count(100_000) == "100k"
    assert compact_count(1_500_000) == "1.5M"
    assert compact_count(2_000_000_000) == "2B"


def test_loss_plot_ticks_are_few_and_compact(tmp_path):
    results = _results(tmp_path)
    fig = loss_figure(str(tmp_path), results)
    fig.canvas.draw()
    ax_val, ax_train = fig.axes[:2]
    for ax in (ax_val, ax_train):
        lo, hi = ax.get_xlim()
        labels = [
            t.get_text()
            for t, x in zip(ax.get_xticklabels(), ax.get_xticks())
            if lo <= x <= hi and t.get_text()
        ]
        assert 2 <= len(labels) <= 7, labels
        # short labels with a unit suffix, never a run of digits such as "1000000"
        assert all(len(x) <= 5 for x in labels), labels
        assert any(x.endswith("M") for x in labels), labels
        # and no two labels overlap on the rendered figure
        boxes = sorted(
            (t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()),
            key=lambda b: b.x0,
        )
        boxes = [b for b in boxes if ax.bbox.x0 - 5 <= b.x0 <= ax.bbox.x1 + 5]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))
    plot_losses(str(tmp_path), results, str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_equal_paired_differences_give_no_interval(tmp_path):
    """Accuracy 0 for both models in both seeds: the differences have no spread, so neither the
    table nor the sentence may print a "[+0.000, +0.000]" interval."""
    results = _results(tmp_path, accuracy=(0.0, 0.0, 0.0, 0.0))
    table = results_table(results)
    row = next(x for x in table.splitlines() if x.startswith("| answer accuracy (validation, q"))
    assert "(equal in all 2 seeds: no interval)" in row and "[" not in row
    sentence = next(x for x in comparison_sentences(results) if "Answer accuracy" in x)
    assert "t-interval" not in sentence and "includes zero" not in sentence
    assert "+0.000 in each of 2 paired seeds" in sentence
    assert "no confidence interval can be given" in sentence
    # the validation losses differ by -0.2 and -0.25: a real interval
    loss = next(x for x in comparison_sentences(results) if "Final validation loss" in x)
    assert "95% t-interval [" in loss


def test_spread_differences_keep_their_interval(tmp_path):
    results = _results(tmp_path, accuracy=(0.5, 0.7, 0.1, 0.2))  # differences 0.4, 0.5
    row = next(
        x
        for x in results_table(results).splitlines()
        if x.startswith("| answer accuracy (validation, q")
    )
    assert "+0.450 [" in row and "no interval" not in row
    sentence = next(x for x in comparison_sentences(results) if "Answer accuracy" in x)
    assert "95% t-interval [" in sentence and "over 2 paired seeds" in sentence


def test_tflops_and_mfu_where_throughput_is_shown(tmp_path):
    """The results table and the side-by-side throughput give model TFLOP/s per device (the
    formula of diffjax.infra.flops) and, with a peak, MFU; without one (a CPU), the report says so."""
    import dataclasses

    import pytest

    from diffjax.infra import flops
    from diffjax.compare.report import Flops, write_report
    from diffjax.compare.throughput import SideBySide
    from diffjax.compare import default_comparison
    from diffjax.train.config import apply_overrides

    mesh = "data=8 fsdp=1 context=1 tensor=1 (8 devices, 1 process)"
    results = [  # (no query accuracy: the default data has no queries)
        dataclasses.replace(
            r, tokens_per_s=2e6 if r.label == "diff" else 3e6, mesh=mesh, metrics={}
        )
        for r in _results(tmp_path)
    ]
    exp = default_comparison()
    seq = exp.data.seq_len
    per_token = {k: flops.train_flops_per_token(m, seq) for k, m in exp.models.items()}
    tflops = {"diff": per_token["diff"] * 2e6 / 8 / 1e12}
    tflops["standard"] = per_token["standard"] * 3e6 / 8 / 1e12

    def row(table, name):
        return next(x for x in table.splitlines() if x.startswith(f"| {name}"))

    # a known peak (the override): TFLOP/s and MFU rows, timing rows (no paired interval)
    with_peak = Flops.of(apply_overrides(exp, ["train.peak_tflops=0.5"]))
    assert with_peak.peak == 0.5
    table = results_table(results, with_peak)
    cells = row(table, "TFLOP/s per device").split("|")
    assert f"{tflops['diff']:.3g}" in cells[2] and f"{tflops['standard']:.3g}" in cells[3]
    assert "see the side-by-side throughput" in cells[4]
    mfu = row(table, "MFU (during training)")
    assert f"{tflops['diff'] / 0.5:.1%}" in mfu and f"{tflops['standard'] / 0.5:.1%}" in mfu
    assert f"| {per_token['diff'] / 1e6:.4g} MFLOP |" in row(table, "model FLOPs per trained token")
    assert "MFU against 0.5 TFLOP/s per device" in with_peak.note()
    assert "TFLOP/s" not in results_table(results)  # without the flops context: as before

    # no peak for this device kind: no MFU row, and the note says how to get one
    cpu = Flops.of(exp)
    assert cpu.peak is None and cpu.device_kind == jax.devices()[0].device_kind
    assert "MFU" not in results_table(results, cpu)
    assert f"no peak for {cpu.device_kind}; set train.peak_tflops" in cpu.note()
    h100 = Flops.of(exp, device_kind="NVIDIA H100 80GB HBM3")
    assert h100.peak == 989.0 and "MFU (during training)" in results_table(results, h100)

    # report.md: the side-by-side table (its device count), and the note
    side = SideBySide(
        ("diff", "standard"),
        {"diff": [4e6] * 3, "standard": [5e6] * 3},
        [0.8] * 3,
        3,
        4,
        16 * seq,
        devices=4,
    )
    text = write_report(str(tmp_path), exp, results, throughput=[side])
    assert "| model | tokens/s (side by side, median) | TFLOP/s per device | MFU |" in text
    side_row = row(text, "diff (diff_v1) | 4,000,000")
    assert f"| {per_token['diff'] * 4e6 / 4 / 1e12:.3g} | n/a |" in side_row
    assert f"{per_token['standard'] * 5e6 / 4 / 1e12:.3g}" in row(text, "standard (standard) |")
    assert f"no peak for {cpu.device_kind}; set train.peak_tflops" in text
    assert "TFLOP/s per device (during training)" in text
    assert per_token["diff"] == pytest.approx(per_token["standard"])  # V1 costs its twin's


def _crossing_results(tmp_path, seeds=(0, 1, 2)):
    """DIFF behind its twin early and ahead from step 30 on, in every seed (the twin's loss
    varies by seed, the pairing removes it); an evaluation every 10 steps."""
    noise = (0.004, -0.006, 0.002)
    ahead = {10: 0.1, 20: 0.02, 30: -0.1, 40: -0.15}
    out = []
    for seed in seeds:
        for label in ("diff", "standard"):
            records = _records(offset=0.05 * seed)
            for r in records:
                if "val_loss" in r and label == "diff":
                    r["val_loss"] += ahead[r["step"]] + noise[seed]
            out.append(
                _result(
                    tmp_path / label / f"seed_{seed}",
                    label,
                    seed,
                    records[-1]["val_loss"],
                    0.0,
                    records,
                )
            )
    return out


def test_the_report_gives_diff_minus_twin_over_training_and_its_crossover(tmp_path):
    """report.md's DIFF − twin over training: the crossover at the evaluation from which the
    band stays below 0, the final difference with its interval and the difference table; and
    loss.png's third panel with the band, the zero line and the crossover."""
    from diffjax.compare.report import difference_curve, over_training

    results = _crossing_results(tmp_path)
    curve = difference_curve(results)
    assert curve.n_seeds == 3 and list(curve.tokens) == [s * 65_536 for s in (10, 20, 30, 40)]
    lines = over_training(curve)
    text = "\n".join(lines)
    assert lines[0].startswith("**DIFF − twin over training** (validation loss, seed by seed")
    assert "pointwise 95% Student-t interval over the 3 paired seeds" in text
    assert "- Crossover at 1,966,080 tokens (step 30): from that evaluation on" in text
    assert "- Validation loss at the last evaluation (2,621,440 tokens), DIFF minus the twin: " in (
        text
    )
    assert "| step | tokens | DIFF − twin | 95% band |" in text
    assert "| 40 | 2,621,440 | -0.1500 | [" in text
    fig = loss_figure(str(tmp_path), results)
    assert len(fig.axes) == 3
    ax = fig.axes[2]
    assert "crossover at 1.97M tokens" in ax.get_title()
    assert len(ax.collections) == 1  # the band
    labels = ax.get_legend_handles_labels()[1]
    assert "95% t-band over seeds (pointwise)" in labels and "crossover" in labels
    assert any(list(line.get_xdata()) == [30 * 65_536] * 2 for line in ax.get_lines())


def test_one_seed_gives_the_curve_and_claims_no_crossover(tmp_path):
    from diffjax.compare.report import difference_curve, over_training

    results = _crossing_results(tmp_path, seeds=(0,))
    text = "\n".join(over_training(difference_curve(results)))
    assert "one seed: no band" in text
    assert "One seed: no crossover is claimed" in text and "Crossover at" not in text
    assert "from one seed; no confidence interval" in text
    ax = loss_figure(str(tmp_path), results).axes[2]
    assert "one seed: no crossover claimed" in ax.get_title() and not ax.collections
    # DIFF alone (compare.twins=): no difference, two panels
    alone = [r for r in results if r.label == "diff"]
    assert difference_curve(alone) is None and over_training(None) == []
    assert len(loss_figure(str(tmp_path), alone).axes) == 2
