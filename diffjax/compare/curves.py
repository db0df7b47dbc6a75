"""DIFF − twin over training: the paired difference of validation curves and the crossover.

Pure functions of numbers (no plotting, no files): the comparison report
(:mod:`diffjax.compare.report`) and the sweep's report of arms trained side by side
(:mod:`diffjax.sweep.curves_report`) read the curves and draw them.

* :func:`paired_difference_curve`: given each seed's validation curve (tokens, loss) of DIFF and
  of its twin, paired by seed (the same init seed, the same batches), the per-seed difference
  DIFF − twin at every evaluation that every seed of both models has, its mean over seeds and a
  pointwise Student-t band (:func:`diffjax.evaluate.stats.t_interval`). With one seed: the
  difference only, no band.
* :func:`crossover`: the first evaluation after which the band's upper bound stays below 0
  (DIFF ahead) at every later evaluation, or why there is none; and the final difference with
  its interval (:class:`Crossover`).

Undefined bands: at an evaluation where some seed's loss (of either model) is not finite, the
mean difference and the band are NaN there (a diverged seed is no evidence that DIFF is ahead),
so the upper bound is not below 0 at that evaluation. The same holds where every seed has the
same difference (no spread, :attr:`diffjax.evaluate.stats.PairedDifference.no_spread`): a
zero-width band would claim a certainty that a few seeds cannot give.

A crossing and a re-crossing: the crossover is the start of the final run of evaluations whose
upper bound is below 0 (the band must stay below 0 to the last evaluation); when the band had
been below 0 earlier and gone back, :attr:`Crossover.earlier_tokens` says where it first was.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from diffjax.evaluate.stats import PairedDifference, describe_difference, paired_difference

# Crossover.kind
FROM_START = "from the start"  # the upper bound is below 0 at every evaluation
CROSSING = "crossing"  # below 0 from some evaluation (not the first) to the last
NONE = "none"  # the upper bound is not below 0 at the last evaluation
ONE_SEED = "one seed"  # no band over seeds: no crossover is claimed


class EvalCurve(NamedTuple):
    """One seed's validation curve: the tokens seen at each evaluation, the validation loss
    there, and the step (None where unknown)."""

    tokens: np.ndarray
    loss: np.ndarray
    steps: np.ndarray | None = None


def eval_curve(records: Sequence[Mapping[str, Any]]) -> EvalCurve:
    """The validation curve of a run's ``metrics.jsonl`` records (those with ``val_loss``;
    non-finite losses kept as they are)."""
    evals = [r for r in records if isinstance(r.get("val_loss"), (int, float))]
    return EvalCurve(
        np.array([r["tokens"] for r in evals], float),
        np.array([r["val_loss"] for r in evals], float),
        np.array([r.get("step", -1) for r in evals], int),
    )


def common_tokens(curves: Sequence[tuple[np.ndarray, ...]]) -> np.ndarray:
    """The x values (first element of each curve) that every curve has, sorted."""
    if not curves:
        return np.zeros(0)
    common = set(np.asarray(curves[0][0], float).tolist())
    for c in curves[1:]:
        common &= set(np.asarray(c[0], float).tolist())
    return np.array(sorted(common), float)


def values_at(curve: tuple[np.ndarray, ...], xs: np.ndarray, column: int = 1) -> np.ndarray:
    """``curve[column]`` at each of ``xs`` (x values the curve has; with an x listed twice, its
    last value)."""
    lookup = dict(zip(np.asarray(curve[0], float).tolist(), np.asarray(curve[column]).tolist()))
    return np.array([lookup[x] for x in xs.tolist()])


def mean_curve(curves: Sequence[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """``(xs, mean over curves)`` at the x values every curve has."""
    xs = common_tokens(curves)
    if xs.size == 0:
        return xs, xs
    return xs, np.mean([values_at(c, xs).astype(float) for c in curves], axis=0)


@dataclasses.dataclass(frozen=True)
class DifferenceCurve:
    """DIFF − twin at the evaluations every seed of both models has: per seed, the mean over
    seeds and the pointwise band (NaN where undefined: one seed, a non-finite loss, no spread)."""

    tokens: np.ndarray  # [E]
    steps: np.ndarray | None  # [E]; None where the curves carry no steps
    per_seed: np.ndarray  # [S, E]
    mean: np.ndarray  # [E]
    low: np.ndarray  # [E]
    high: np.ndarray  # [E]
    confidence: float

    @property
    def n_seeds(self) -> int:
        return int(self.per_seed.shape[0])

    def step(self, i: int) -> int | None:
        """The step of evaluation ``i`` (None where unknown)."""
        if self.steps is None or self.steps[i] < 0:
            return None
        return int(self.steps[i])

    def at(self, i: int) -> PairedDifference:
        """The paired difference at evaluation ``i`` (pairs with a non-finite loss dropped:
        ``n`` says how many seeds count)."""
        d = self.per_seed[:, i]
        return paired_difference(d.tolist(), [0.0] * d.size, self.confidence)


def paired_difference_curve(
    diff: Sequence[tuple[np.ndarray, ...]],
    twin: Sequence[tuple[np.ndarray, ...]],
    confidence: float = 0.95,
) -> DifferenceCurve:
    """The :class:`DifferenceCurve` of DIFF's and the twin's validation curves, ``diff[i]`` and
    ``twin[i]`` of one seed (:class:`EvalCurve` or ``(tokens, loss[, steps])``), at the tokens
    every curve of both has (none: an empty curve). The band is the Student-t interval of the
    mean of the per-seed differences at each evaluation."""
    if len(diff) != len(twin):
        raise ValueError(
            f"paired_difference_curve: {len(diff)} DIFF curves against {len(twin)} twin "
            f"curves; give one of each per seed, paired by seed"
        )
    if not diff:
        raise ValueError("paired_difference_curve: no seeds; give one curve of each per seed")
    xs = common_tokens([*diff, *twin])
    per_seed = np.array(
        [
            values_at(d, xs).astype(float) - values_at(t, xs).astype(float)
            for d, t in zip(diff, twin)
        ]
    ).reshape(len(diff), xs.size)
    with_steps = [c for c in (*diff, *twin) if len(c) > 2 and c[2] is not None]
    steps = values_at(with_steps[0], xs, column=2).astype(int) if with_steps else None
    mean, low, high = (np.full(xs.size, np.nan) for _ in range(3))
    for i in range(xs.size):
        d = per_seed[:, i]
        if not np.all(np.isfinite(d)):
            continue  # a seed's loss is not finite: no mean, no band here
        mean[i] = float(d.mean())
        p = paired_difference(d.tolist(), [0.0] * d.size, confidence)
        if p.low is not None:
            low[i], high[i] = p.low, p.high
    return DifferenceCurve(xs, steps, per_seed, mean, low, high, confidence)


def paired_curve(
    a: Mapping[int, Any], b: Mapping[int, Any], confidence: float = 0.95
) -> tuple[list[int], DifferenceCurve | None]:
    """``a`` − ``b`` over training, paired by seed (``{seed: curve}`` each, as
    :func:`paired_difference_curve` takes them): the seeds both have, and their
    :class:`DifferenceCurve` (None without a seed in common or an evaluation common to every
    curve). Every report's difference curve comes from here."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return seeds, None
    curve = paired_difference_curve([a[s] for s in seeds], [b[s] for s in seeds], confidence)
    return seeds, (curve if curve.tokens.size else None)


@dataclasses.dataclass(frozen=True)
class Crossover:
    """Where DIFF pulls ahead of its twin for good (:func:`crossover`): ``kind`` is
    :data:`FROM_START`, :data:`CROSSING` (at ``tokens`` and ``step``), :data:`NONE` or
    :data:`ONE_SEED`; ``earlier_tokens``: where the band's upper bound was first below 0 when
    it later went back above (None otherwise); ``final``: DIFF − twin at the last common
    evaluation (``final_tokens``) with its interval."""

    kind: str
    tokens: float | None
    step: int | None
    earlier_tokens: float | None
    final: PairedDifference
    final_tokens: float
    final_high: float  # the band's upper bound at the last evaluation (NaN: undefined)
    n_seeds: int

    @property
    def claimed(self) -> bool:
        """True when DIFF is ahead for good: from the start, or from a crossing."""
        return self.kind in (FROM_START, CROSSING)


def crossover(curve: DifferenceCurve) -> Crossover:
    """The :class:`Crossover` of ``curve``: the first evaluation from which the band's upper
    bound is below 0 at every later evaluation (an undefined band is not below 0)."""
    n = curve.tokens.size
    if n == 0:
        raise ValueError("crossover: the curve has no evaluation common to every seed")
    final = curve.at(n - 1)
    common = dict(final=final, final_tokens=float(curve.tokens[-1]), n_seeds=curve.n_seeds)
    common["final_high"] = float(curve.high[-1])
    if curve.n_seeds < 2:
        return Crossover(ONE_SEED, None, None, None, **common)
    below = np.nan_to_num(curve.high, nan=np.inf) < 0
    if not below[-1]:
        earlier = float(curve.tokens[np.argmax(below)]) if below.any() else None
        return Crossover(NONE, None, None, earlier, **common)
    above = np.flatnonzero(~below)
    if above.size == 0:
        return Crossover(FROM_START, float(curve.tokens[0]), curve.step(0), None, **common)
    k = int(above[-1]) + 1  # the start of the final run below 0
    earlier = float(curve.tokens[np.argmax(below)]) if below[:k].any() else None
    return Crossover(CROSSING, float(curve.tokens[k]), curve.step(k), earlier, **common)


def _tokens(x: float) -> str:
    return f"{x:,.0f} tokens"


def _at(tokens: float | None, step: int | None) -> str:
    return _tokens(tokens) + (f" (step {step})" if step is not None else "")


def describe_crossover(c: Crossover, a: str = "DIFF", b: str = "the twin") -> str:
    """One or two sentences: where ``a`` pulls ahead of ``b`` for good, or why no crossover is
    claimed."""
    pct = f"{c.final.confidence:.0%}"
    if c.kind == ONE_SEED:
        return (
            "One seed: no crossover is claimed (a band over seeds needs two or more; set "
            "compare.seeds=2 or more)."
        )
    band = f"the upper bound of the {pct} band of {a} minus {b} over {c.n_seeds} paired seeds"
    back = (
        f" It had been below 0 earlier, first at {_tokens(c.earlier_tokens)}, and went back above."
        if c.earlier_tokens is not None
        else ""
    )
    if c.kind == FROM_START:
        return f"{a} is ahead of {b} from the first evaluation on: {band} is below 0 at every evaluation."
    if c.kind == CROSSING:
        return (
            f"Crossover at {_at(c.tokens, c.step)}: from that evaluation on, {band} stays below "
            f"0 to the last evaluation ({_tokens(c.final_tokens)}).{back}"
        )
    where = (
        f"is {c.final_high:+.4f}, not below 0"
        if math.isfinite(c.final_high)
        else "is undefined (a seed's loss is not finite, or the seeds agree exactly)"
    )
    return (
        f"No crossover: at the last evaluation ({_tokens(c.final_tokens)}) {band} {where}." + back
    )


def describe_final(c: Crossover, a: str = "DIFF", b: str = "the twin") -> str:
    """One sentence: the difference at the last common evaluation with its interval."""
    return describe_difference(
        c.final, f"Validation loss at the last evaluation ({_tokens(c.final_tokens)})", a, b
    )


def crossover_cell(c: Crossover) -> str:
    """A table cell: ``from the start``, ``at 1,228,800 tokens (step 600)``, ``none`` or
    ``one seed: none claimed``; with ``(below 0 earlier from N tokens, then back)`` when the
    band had been below 0 before and went back."""
    short = {FROM_START: "from the start", NONE: "none", ONE_SEED: "one seed: none claimed"}
    text = f"at {_at(c.tokens, c.step)}" if c.kind == CROSSING else short[c.kind]
    if c.earlier_tokens is not None:
        text += f" (below 0 earlier from {_tokens(c.earlier_tokens)}, then back)"
    return text


def table_indices(n: int, count: int = 6) -> list[int]:
    """About ``count`` evaluation indices evenly spaced over ``n`` evaluations, the last one
    always among them, in order."""
    if n <= 0:
        return []
    picks = {int(round(x)) for x in np.linspace(0, n - 1, min(count, n))}
    return sorted(picks | {n - 1})


def band_cell(curve: DifferenceCurve, i: int, spec: str = "{:+.4f}") -> str:
    """The band at evaluation ``i`` as a table cell: ``[low, high]`` or why there is none."""
    if math.isfinite(curve.low[i]):
        return f"[{spec.format(curve.low[i])}, {spec.format(curve.high[i])}]"
    if curve.n_seeds < 2:
        return "one seed: no band"
    if not math.isfinite(curve.mean[i]):
        return "undefined: a loss is not finite"
    return "undefined: no spread"


def difference_table(curve: DifferenceCurve, count: int = 6, what: str = "DIFF − twin") -> str:
    """A markdown table of ``what`` (the difference, DIFF − twin by default) at about ``count``
    evaluations evenly spaced and the last: step, tokens, the mean difference and its band."""
    pct = f"{curve.confidence:.0%}"
    lines = [
        f"| step | tokens | {what} | {pct} band |",
        "|---:|---:|---:|---:|",
    ]
    for i in table_indices(curve.tokens.size, count):
        step = curve.step(i)
        mean = curve.mean[i]
        lines.append(
            f"| {step if step is not None else 'n/a'} | {curve.tokens[i]:,.0f} | "
            f"{f'{mean:+.4f}' if math.isfinite(mean) else 'n/a'} | {band_cell(curve, i)} |"
        )
    return "\n".join(lines)
