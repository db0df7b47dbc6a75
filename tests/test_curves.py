"""DIFF − twin over training (diffjax.compare.curves) on made-up validation curves: the paired
difference and its pointwise Student-t band (checked against scipy by hand), the evaluations
common to every seed, and the crossover: none, a crossing, a crossing then a re-crossing, DIFF
ahead from the start, one seed, and non-finite losses."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from diffjax.compare.curves import (
    CROSSING,
    FROM_START,
    NONE,
    ONE_SEED,
    EvalCurve,
    crossover,
    crossover_cell,
    describe_crossover,
    describe_final,
    difference_table,
    eval_curve,
    mean_curve,
    paired_difference_curve,
    table_indices,
)

TOKENS = np.arange(1, 9) * 1000.0  # 8 evaluations
STEPS = np.arange(1, 9) * 10
NOISE = np.array([[0.01, -0.02, 0.015, 0.0, -0.01, 0.02, -0.015, 0.005],
                  [-0.01, 0.01, -0.005, 0.02, 0.0, -0.01, 0.01, -0.02],
                  [0.0, 0.01, -0.01, -0.02, 0.01, -0.01, 0.005, 0.015]])  # fmt: skip


def seeds_with(mean_diff, n_seeds=3, tokens=TOKENS, steps=STEPS):
    """DIFF and twin curves of ``n_seeds`` seeds whose per-seed difference is ``mean_diff`` plus
    a small noise (the twin's own curve varies by seed, which the pairing removes)."""
    twin_base = 5.0 - 0.3 * np.log(tokens)
    diff, twin = [], []
    for s in range(n_seeds):
        t = twin_base + 0.1 * s
        diff.append(EvalCurve(tokens, t + np.asarray(mean_diff) + NOISE[s, : tokens.size], steps))
        twin.append(EvalCurve(tokens, t, steps))
    return diff, twin


# ---------------------------------------------------------------------------- the band
def test_the_band_is_the_student_t_interval_of_the_per_seed_differences():
    diff, twin = seeds_with(np.linspace(0.1, -0.1, 8))
    curve = paired_difference_curve(diff, twin)
    d = np.array([a.loss - b.loss for a, b in zip(diff, twin)])  # [3, 8]
    np.testing.assert_allclose(curve.per_seed, d)
    np.testing.assert_allclose(curve.mean, d.mean(axis=0))
    half = stats.t.ppf(0.975, 2) * d.std(axis=0, ddof=1) / math.sqrt(3)
    np.testing.assert_allclose(curve.low, d.mean(axis=0) - half)
    np.testing.assert_allclose(curve.high, d.mean(axis=0) + half)
    np.testing.assert_array_equal(curve.tokens, TOKENS)
    assert [curve.step(i) for i in range(8)] == list(STEPS)
    assert curve.n_seeds == 3
    # a 90% band is narrower, by the ratio of the t quantiles
    narrow = paired_difference_curve(diff, twin, confidence=0.9)
    ratio = stats.t.ppf(0.95, 2) / stats.t.ppf(0.975, 2)
    np.testing.assert_allclose(narrow.high - narrow.mean, ratio * (curve.high - curve.mean))


def test_only_evaluations_every_seed_of_both_models_has_count():
    diff, twin = seeds_with(np.full(8, -0.2))
    # seed 1's DIFF missed the 3rd evaluation, the twin's seed 2 has an extra one at 8500
    d1 = diff[1]
    diff[1] = EvalCurve(np.delete(d1.tokens, 2), np.delete(d1.loss, 2), np.delete(d1.steps, 2))
    t2 = twin[2]
    twin[2] = EvalCurve(
        np.append(t2.tokens, 8500.0), np.append(t2.loss, 1.0), np.append(t2.steps, 85)
    )
    curve = paired_difference_curve(diff, twin)
    np.testing.assert_array_equal(curve.tokens, np.delete(TOKENS, 2))
    np.testing.assert_allclose(
        curve.per_seed[1], np.delete(diff[1].loss, []) - np.delete(twin[1].loss, 2)
    )
    # unsorted input and curves without steps: sorted by tokens, no steps
    shuffled = [(c.tokens[::-1], c.loss[::-1]) for c in diff]
    plain = paired_difference_curve(shuffled, [(c.tokens, c.loss) for c in twin])
    np.testing.assert_allclose(plain.mean, curve.mean)
    assert plain.steps is None and plain.step(0) is None
    # no evaluation in common: an empty curve, and no crossover to read
    far = [EvalCurve(c.tokens + 1, c.loss) for c in twin]
    empty = paired_difference_curve(diff, far)
    assert empty.tokens.size == 0 and empty.per_seed.shape == (3, 0)
    with pytest.raises(ValueError, match="no evaluation common"):
        crossover(empty)


def test_unpaired_input_is_refused():
    diff, twin = seeds_with(np.zeros(8))
    with pytest.raises(ValueError, match="3 DIFF curves against 2 twin curves"):
        paired_difference_curve(diff, twin[:2])
    with pytest.raises(ValueError, match="no seeds"):
        paired_difference_curve([], [])


def test_the_mean_curve_is_over_the_common_x_values():
    xs, mean = mean_curve([(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])),
                           (np.array([2.0, 3.0]), np.array([4.0, 5.0]))])  # fmt: skip
    np.testing.assert_array_equal(xs, [2.0, 3.0])
    np.testing.assert_allclose(mean, [3.0, 3.0])


def test_eval_curve_reads_the_evaluation_records():
    records = [
        {"step": 1, "loss": 5.0, "tokens": 100},
        {"step": 2, "loss": 4.0, "tokens": 200, "val_loss": 4.5},
        {"step": 3, "loss": 3.0, "tokens": 300},
        {"step": 4, "loss": 2.0, "tokens": 400, "val_loss": float("nan")},
    ]
    c = eval_curve(records)
    np.testing.assert_array_equal(c.tokens, [200, 400])
    assert c.loss[0] == 4.5 and math.isnan(c.loss[1])
    np.testing.assert_array_equal(c.steps, [2, 4])


# ---------------------------------------------------------------------------- the crossover
def test_no_crossing():
    diff, twin = seeds_with(np.full(8, 0.1))  # DIFF behind all along
    c = crossover(paired_difference_curve(diff, twin))
    assert c.kind == NONE and c.tokens is None and c.earlier_tokens is None and not c.claimed
    assert c.final_tokens == 8000 and c.final.n == 3 and c.final.low > 0
    assert c.final_high == pytest.approx(c.final.high)
    text = describe_crossover(c)
    assert text.startswith("No crossover: at the last evaluation (8,000 tokens)")
    assert "not below 0" in text and "earlier" not in text
    assert crossover_cell(c) == "none"
    assert "95% t-interval" in describe_final(c) and "DIFF is higher" in describe_final(c)


def test_a_crossing():
    diff, twin = seeds_with(np.array([0.2, 0.1, 0.05, 0.0, -0.1, -0.15, -0.2, -0.25]))
    curve = paired_difference_curve(diff, twin)
    c = crossover(curve)
    first_below = int(np.flatnonzero(curve.high < 0)[0])
    assert np.all(curve.high[first_below:] < 0) and np.all(curve.high[:first_below] >= 0)
    assert c.kind == CROSSING and c.claimed
    assert c.tokens == TOKENS[first_below] and c.step == STEPS[first_below]
    assert c.earlier_tokens is None and c.final.high < 0
    assert describe_crossover(c).startswith(
        f"Crossover at {TOKENS[first_below]:,.0f} tokens (step {STEPS[first_below]})"
    )
    assert crossover_cell(c) == f"at {TOKENS[first_below]:,.0f} tokens (step {STEPS[first_below]})"


def test_a_crossing_then_a_recrossing_counts_from_the_final_run_below_zero():
    # below 0 at evaluations 2-3, back above at 4, below again from 5 to the end
    diff, twin = seeds_with(np.array([0.2, 0.1, -0.2, -0.2, 0.1, -0.2, -0.2, -0.2]))
    curve = paired_difference_curve(diff, twin)
    np.testing.assert_array_equal(curve.high < 0, [0, 0, 1, 1, 0, 1, 1, 1])
    c = crossover(curve)
    assert c.kind == CROSSING and c.tokens == 6000 and c.step == 60
    assert c.earlier_tokens == 3000
    assert "It had been below 0 earlier, first at 3,000 tokens, and went back above." in (
        describe_crossover(c)
    )
    assert crossover_cell(c) == (
        "at 6,000 tokens (step 60) (below 0 earlier from 3,000 tokens, then back)"
    )
    # below 0 in the middle only: no crossover, and the text says it had been below
    diff, twin = seeds_with(np.array([0.2, -0.2, -0.2, 0.1, 0.1, 0.1, 0.1, 0.1]))
    c = crossover(paired_difference_curve(diff, twin))
    assert c.kind == NONE and c.earlier_tokens == 2000
    assert "first at 2,000 tokens" in describe_crossover(c)


def test_diff_ahead_from_the_start():
    diff, twin = seeds_with(np.full(8, -0.2))
    c = crossover(paired_difference_curve(diff, twin))
    assert c.kind == FROM_START and c.claimed and c.tokens == 1000 and c.step == 10
    assert "from the first evaluation on" in describe_crossover(c)
    assert crossover_cell(c) == "from the start"


def test_one_seed_gives_the_difference_without_a_band_and_claims_no_crossover():
    diff, twin = seeds_with(np.full(8, -0.2), n_seeds=1)
    curve = paired_difference_curve(diff, twin)
    np.testing.assert_allclose(curve.mean, diff[0].loss - twin[0].loss)
    assert np.all(np.isnan(curve.low)) and np.all(np.isnan(curve.high))
    c = crossover(curve)
    assert c.kind == ONE_SEED and not c.claimed and c.tokens is None
    assert c.final.n == 1 and c.final.low is None
    assert describe_crossover(c).startswith("One seed: no crossover is claimed")
    assert "from one seed" in describe_final(c)
    assert crossover_cell(c) == "one seed: none claimed"
    assert "one seed: no band" in difference_table(curve)


def test_a_non_finite_loss_leaves_the_band_undefined_there():
    diff, twin = seeds_with(np.full(8, -0.2))
    loss = diff[2].loss.copy()
    loss[3] = np.nan  # seed 2's DIFF loss at evaluation 3
    diff[2] = EvalCurve(TOKENS, loss, STEPS)
    curve = paired_difference_curve(diff, twin)
    assert math.isnan(curve.mean[3]) and math.isnan(curve.high[3]) and math.isnan(curve.low[3])
    assert np.all(curve.high[np.arange(8) != 3] < 0)
    c = crossover(curve)  # the undefined point is not below 0: the crossover comes after it
    assert c.kind == CROSSING and c.tokens == 5000 and c.earlier_tokens == 1000
    assert "undefined: a loss is not finite" in difference_table(curve, count=8)
    # at the last evaluation: no crossover, and the final difference counts the finite seeds
    twin_loss = twin[0].loss.copy()
    twin_loss[-1] = np.inf
    twin[0] = EvalCurve(TOKENS, twin_loss, STEPS)
    c = crossover(paired_difference_curve(diff, twin))
    assert c.kind == NONE and math.isnan(c.final_high) and c.final.n == 2
    assert "is undefined (a seed's loss is not finite" in describe_crossover(c)


def test_equal_differences_in_every_seed_give_no_band():
    tokens = np.array([1.0, 2.0])
    diff = [EvalCurve(tokens, np.array([3.0, 2.0])) for _ in range(2)]
    twin = [EvalCurve(tokens, np.array([3.5, 2.5])) for _ in range(2)]
    curve = paired_difference_curve(diff, twin)
    np.testing.assert_allclose(curve.mean, [-0.5, -0.5])
    assert np.all(np.isnan(curve.high))
    assert crossover(curve).kind == NONE
    assert "undefined: no spread" in difference_table(curve)


# ---------------------------------------------------------------------------- the table
def test_the_table_shows_a_handful_of_evaluations_and_the_last():
    assert table_indices(30, 6) == [0, 6, 12, 17, 23, 29]
    assert table_indices(3, 6) == [0, 1, 2]
    assert table_indices(1) == [0] and table_indices(0) == []
    diff, twin = seeds_with(np.full(8, -0.2))
    curve = paired_difference_curve(diff, twin)
    table = difference_table(curve, count=3).splitlines()
    assert table[0] == "| step | tokens | DIFF − twin | 95% band |"
    assert len(table) == 2 + 3 and table[-1].startswith("| 80 | 8,000 | ")
    lo, hi = curve.low[-1], curve.high[-1]
    assert table[-1].endswith(f"| [{lo:+.4f}, {hi:+.4f}] |")
