"""The sweep's report: ``sweep.md``, ``sweep_loss.png`` and ``sweep_ratio.png`` in the run
directory, from the files the sizes wrote (``sweep_plan.json``, each size's
``<label>/seed_<s>/result.json`` and ``metrics.jsonl``), so it can be rebuilt at any time.

* ``sweep_loss.png``: final validation loss against non-embedding parameters (log x), DIFF and
  the twin, every seed a point, the mean over seeds a line, the fitted scaling law dashed over
  the measured range.
* ``sweep_ratio.png``: left, the parameter ratio at each twin size with its bootstrap interval
  (:mod:`diffjax.sweep.fit`); right, the learning curves of one size (validation loss against
  tokens) and the tokens ratio read from them. The paper's 62-65% is drawn beside both, labelled
  :data:`PAPER_LABEL`.

Drawn on explicit :class:`matplotlib.figure.Figure` objects with the Agg canvas (no pyplot).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from diffjax.compare.curves import eval_curve
from diffjax.compare.plots import draw_points_and_mean
from diffjax.infra import storage
from diffjax.evaluate.stats import (
    describe_difference,
    difference_cell,
    fmt_mean_std,
    paired_difference,
)
from diffjax.train.metrics import read_metrics

from diffjax.sweep.curves_report import write_curves_report
from diffjax.sweep.field_report import write_field_report

from diffjax.sweep import fit

PLAN_FILE = "sweep_plan.json"
PAPER_RATIO = (0.62, 0.65)
PAPER_LABEL = "paper, 830M-13B"
PAPER_TEXT = f"{PAPER_RATIO[0] * 100:.0f}-{PAPER_RATIO[1] * 100:.0f}%"
LABELS = {"diff": "DIFF", "standard": "twin"}
COLORS = {"diff": "tab:red", "standard": "tab:blue"}


@dataclasses.dataclass(frozen=True)
class SizeResult:
    """One finished size: its non-embedding parameters per model, the tokens each model saw,
    the seeds both models finished, and the final validation loss of each (paired by seed)."""

    name: str
    directory: str
    diff_params: int
    twin_params: int
    tokens: int
    seeds: tuple[int, ...]
    diff_losses: tuple[float, ...]
    twin_losses: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Curves:
    """Learning curves of one size: the tokens of each evaluation and, per seed (paired), the
    validation losses of DIFF and the twin."""

    size: str
    tokens: np.ndarray
    diff: np.ndarray  # [seeds, evaluations]
    twin: np.ndarray


@dataclasses.dataclass(frozen=True)
class Analysis:
    """The fits, the parameter ratios (with the bound where unmatched, and bootstrap
    intervals) and the tokens ratio of a sweep."""

    fits: dict[str, fit.ScalingFit | None]
    ratios: list[float | None]
    fit_ratios: list[float | None]
    bounds: list[tuple[str, float] | None]
    intervals: list[fit.Interval]
    curves: Curves | None
    tokens_ratio: float | None
    tokens_interval: fit.Interval | None


# ---------------------------------------------------------------------------- reading
def read_plan(run_dir: str) -> dict:
    """``RUN_DIR/sweep_plan.json`` (written by the command line before training)."""
    return storage.read_json(storage.join(run_dir, PLAN_FILE))


def _final_losses(size_dir: str, label: str) -> dict[int, float]:
    """``{seed: final validation loss}`` of the finished seeds of one model of one size."""
    out = {}
    base = storage.join(size_dir, label)
    if not storage.isdir(base):
        return out
    for entry in sorted(p.name for p in storage.path(base).iterdir()):
        path = storage.join(base, entry, "result.json")
        if entry.startswith("seed_") and storage.exists(path):
            loss = storage.read_json(path).get("final_val_loss")
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                out[int(entry[len("seed_") :])] = float(loss)
    return out


def size_results(run_dir: str, plan: dict) -> list[SizeResult]:
    """The sizes of the plan with at least one seed finished by both models, in ladder order
    (each read from its folder inside ``run_dir``, wherever the run directory now is)."""
    out = []
    for size in plan["sizes"]:
        directory = storage.join(run_dir, storage.path(size["directory"]).name)
        d, t = (_final_losses(directory, label) for label in ("diff", "standard"))
        seeds = tuple(sorted(set(d) & set(t)))
        if seeds:
            out.append(
                SizeResult(
                    size["name"],
                    directory,
                    size["diff_params"],
                    size["twin_params"],
                    size["tokens"],
                    seeds,
                    tuple(d[s] for s in seeds),
                    tuple(t[s] for s in seeds),
                )
            )
    return out


def _curve(size_dir: str, label: str, seed: int) -> tuple[list[float], list[float]]:
    records = read_metrics(storage.join(size_dir, label, f"seed_{seed}", "metrics.jsonl"))
    curve = eval_curve(records)
    return curve.tokens.tolist(), curve.loss.tolist()


def learning_curves(result: SizeResult) -> Curves | None:
    """The validation curves of one size's paired seeds, cut to the evaluations all share."""
    tokens, diff, twin = None, [], []
    for seed in result.seeds:
        (td, ld), (tt, lt) = (_curve(result.directory, m, seed) for m in ("diff", "standard"))
        n = min(len(td), len(tt), *([len(tokens)] if tokens is not None else []))
        if n < 2 or td[:n] != tt[:n]:
            return None
        tokens = td[:n]
        diff, twin = [c[:n] for c in diff] + [ld[:n]], [c[:n] for c in twin] + [lt[:n]]
    if tokens is None:
        return None
    return Curves(result.name, np.asarray(tokens), np.asarray(diff), np.asarray(twin))


# ---------------------------------------------------------------------------- numbers
def analyse(
    results: Sequence[SizeResult], curve_index: int | None = None, resamples: int = 2000
) -> Analysis:
    """Fits, parameter ratios with bootstrap intervals, and the tokens ratio of the size
    ``curve_index`` (None: the largest finished)."""
    d_n = [r.diff_params for r in results]
    t_n = [r.twin_params for r in results]
    d_l = [list(r.diff_losses) for r in results]
    t_l = [list(r.twin_losses) for r in results]
    fits = {
        "diff": fit.fit_scaling_law(d_n, d_l) if results else None,
        "standard": fit.fit_scaling_law(t_n, t_l) if results else None,
    }
    ratios = fit.parameter_ratio(d_n, d_l, t_n, t_l) if results else []
    fit_ratios = fit.parameter_ratio(d_n, d_l, t_n, t_l, method="fit") if results else []
    bounds = [
        fit.unmatched_bound(d_n, d_l, n, float(np.mean(losses))) for n, losses in zip(t_n, t_l)
    ]
    intervals = (
        fit.bootstrap_parameter_ratio(d_n, d_l, t_n, t_l, resamples=resamples) if results else []
    )
    curves, t_ratio, t_interval = None, None, None
    if results:
        i = len(results) - 1 if curve_index is None else min(curve_index, len(results) - 1)
        curves = learning_curves(results[i])
    if curves is not None:
        t_ratio = fit.tokens_ratio(
            curves.tokens, curves.diff.mean(0), curves.tokens, curves.twin.mean(0)
        )
        t_interval = fit.bootstrap_tokens_ratio(
            curves.tokens, curves.diff, curves.tokens, curves.twin, resamples=resamples
        )
    return Analysis(fits, ratios, fit_ratios, bounds, intervals, curves, t_ratio, t_interval)


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _direction(low: float | None, high: float | None, what: str) -> str:
    """Which way an interval of a ratio points, in words (empty without an interval)."""
    if low is None:
        return ""
    if high < 1.0:
        return f"the interval lies below 100%: DIFF needs fewer {what} than the twin"
    if low > 1.0:
        return f"the interval lies above 100%: DIFF needs more {what} than the twin"
    return "the interval includes 100%: these seeds cannot tell the two apart"


def ratio_cell(ratio: float | None, bound, interval: fit.Interval | None) -> str:
    """The parameter ratio of one twin size as a table cell."""
    if ratio is None:
        if bound is None:
            return "not measured"
        return f"not measured ({bound[0]} {_pct(bound[1])}: outside DIFF's measured losses)"
    text = _pct(ratio)
    if interval is not None and interval.low is not None:
        text += f" [{_pct(interval.low)}, {_pct(interval.high)}]"
        if interval.defined < 1.0:
            text += f" ({interval.defined:.0%} of resamples matched)"
    elif interval is not None:
        text += " (no interval)" if interval.reason != fit.ONE_SEED else " (one seed)"
    return text


def headline(results: Sequence[SizeResult], a: Analysis) -> list[str]:
    """The sentences of the summary: the parameter and tokens ratios, how sure, which way."""
    lines = []
    seeds = sorted({len(r.seeds) for r in results})
    seed_text = "/".join(map(str, seeds)) + (" paired seed" if seeds == [1] else " paired seeds")
    measured = [(r, x, iv) for r, x, iv in zip(results, a.ratios, a.intervals) if x is not None]
    paper = f"the paper reports {PAPER_TEXT} ({PAPER_LABEL})"
    if not results:
        return ["No size has finished yet: nothing to report."]
    if measured:
        values = "; ".join(
            f"{_pct(x)} at size {r.name} (twin {_fmt_params(r.twin_params)})"
            for r, x, _ in measured
        )
        lines.append(
            f"- **Parameters**: DIFF reaches the twin's validation loss with this share of the "
            f"twin's non-embedding parameters: {values} ({len(measured)} of {len(results)} "
            f"twin sizes inside DIFF's measured range; {seed_text} per size); {paper}."
        )
        for r, _, iv in measured:
            if iv.low is not None:
                lines.append(
                    f"  - {r.name}: {iv.describe()}; {_direction(iv.low, iv.high, 'parameters')}."
                )
            else:
                lines.append(f"  - {r.name}: {iv.describe()}.")
    else:
        lines.append(
            f"- **Parameters**: no twin loss lies inside DIFF's measured losses, so no ratio is "
            f"measured (a wider ladder is needed); {paper}."
        )
    for r, x, b in zip(results, a.ratios, a.bounds):
        if x is None and b is not None:
            side = (
                "DIFF's smallest size already reaches it"
                if b[0] == "<"
                else "not even DIFF's largest size reaches it"
            )
            lines.append(
                f"  - {r.name}: not measured: {side} (ratio {b[0]} {_pct(b[1])}, not extrapolated)."
            )
    if a.curves is not None:
        n = a.curves.diff.shape[0]
        if a.tokens_ratio is not None:
            iv = a.tokens_interval
            sure = iv.describe() if iv is not None else "no interval"
            which = _direction(iv.low, iv.high, "tokens") if iv is not None else ""
            lines.append(
                f"- **Tokens** (size {a.curves.size}, {n} paired seed{'s' * (n != 1)}): DIFF "
                f"reaches the twin's "
                f"final validation loss after {_pct(a.tokens_ratio)} of the twin's tokens; "
                f"{sure}" + (f"; {which}" if which else "") + f"; {paper}."
            )
        else:
            first_below = a.curves.diff.mean(0)[0] <= a.curves.twin.mean(0)[-1]
            why = (
                "DIFF's first evaluation is already at or below it"
                if first_below
                else "DIFF does not reach it within the same tokens (ratio above 100%)"
            )
            lines.append(
                f"- **Tokens** (size {a.curves.size}, {n} paired seed{'s' * (n != 1)}): not "
                f"measured: the "
                f"twin's final validation loss is outside DIFF's curve: {why}; {paper}."
            )
    return lines


# ---------------------------------------------------------------------------- markdown
def _fmt_params(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def sweep_markdown(plan: dict, results: Sequence[SizeResult], a: Analysis) -> str:
    """The text of ``sweep.md``."""
    ladder = plan["ladder"]
    finished = {r.name for r in results}
    pending = [s["name"] for s in plan["sizes"] if s["name"] not in finished]
    lines = [
        "# Scaling sweep: DIFF and its twin",
        "",
        f"Config `{plan['config']}`; {len(plan['sizes'])} sizes, budget "
        f"{ladder['budget']!r}"
        + (
            f" ({ladder['tokens_per_param']:g} tokens per non-embedding parameter)"
            if ladder["budget"] == "proportional"
            else ""
        )
        + f". Finished: {len(results)}"
        + (f"; not finished: {', '.join(pending)}" if pending else "")
        + ".",
        "",
        "## Summary",
        "",
        *headline(results, a),
        "",
        "A ratio below 100% means DIFF reaches the twin's loss with fewer parameters (tokens). "
        "The parameter ratio is read between measured DIFF sizes (piecewise linear in log N on "
        "the seed means), never extrapolated; its interval is a percentile bootstrap over seeds "
        "(each size's seeds resampled with replacement, DIFF's and the twin's seed s together). "
        "With few seeds per size the bootstrap sees few distinct resamples (3 per size with 2 "
        "seeds), so read the interval as rough.",
        "",
        "## Sizes",
        "",
        "| size | non-embedding params DIFF / twin | tokens each | seeds | val loss DIFF | "
        "val loss twin | DIFF − twin [95% t-interval] | parameter ratio [95% bootstrap] | "
        "ratio from DIFF's fit |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    differences = [paired_difference(list(r.diff_losses), list(r.twin_losses)) for r in results]
    rows = zip(results, differences, a.ratios, a.bounds, a.intervals, a.fit_ratios)
    for r, d, x, b, iv, xf in rows:
        diff_cell = difference_cell(d, why=False)
        lines.append(
            f"| {r.name} | {r.diff_params:,} / {r.twin_params:,} | {r.tokens:,} | "
            f"{', '.join(map(str, r.seeds))} | {fmt_mean_std(r.diff_losses, '{:.4f}')} | "
            f"{fmt_mean_std(r.twin_losses, '{:.4f}')} | {diff_cell} | {ratio_cell(x, b, iv)} | "
            f"{'not measured' if xf is None else _pct(xf)} |"
        )
    lines += ["", "Final validation loss, DIFF minus the twin, per size:", ""]
    for r, d in zip(results, differences):
        lines.append("- " + describe_difference(d, f"{r.name}"))
    lines += ["", "## Fits", ""]
    for label, f in a.fits.items():
        text = f.describe() if f is not None else "no fit (fewer than two finished sizes)"
        lines.append(f"- {LABELS[label]}: {text}")
    lines += [
        "",
        "The ratio column is read between the measured DIFF points; the last column reads the "
        "same from DIFF's fit inside its measured sizes (where a straight line between sizes "
        "far apart runs above a convex curve, the first leans high by a few percent).",
        "",
        "![loss against parameters](sweep_loss.png)",
        "",
        "![ratios](sweep_ratio.png)",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plots
def loss_figure(results: Sequence[SizeResult], a: Analysis) -> Figure:
    """Validation loss against non-embedding parameters: seeds as points, means as lines,
    fits dashed over the measured range."""
    fig = Figure(figsize=(6.4, 4.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label in ("diff", "standard"):
        n = np.array([r.diff_params if label == "diff" else r.twin_params for r in results])
        losses = [r.diff_losses if label == "diff" else r.twin_losses for r in results]
        name = f"{LABELS[label]} (mean over seeds)"
        draw_points_and_mean(ax, n, losses, COLORS[label], name, marker="o")
        f = a.fits.get(label)
        if f is not None:
            grid = np.geomspace(f.sizes[0], f.sizes[1], 100)
            kind = "power law" if f.form == fit.POWER_LAW else "log-log line"
            ax.plot(
                grid,
                f.predict(grid),
                "--",
                color=COLORS[label],
                alpha=0.7,
                label=f"{LABELS[label]} fit ({kind}, alpha {f.alpha:.2f})",
            )
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("final validation loss")
    ax.set_title("Validation loss against parameters")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _paper_band(ax) -> None:
    ax.axhspan(*PAPER_RATIO, color="tab:green", alpha=0.25, label=f"{PAPER_LABEL}: {PAPER_TEXT}")
    ax.axhline(1.0, color="gray", lw=1, ls=":", label="equal (100%)")


def ratio_figure(results: Sequence[SizeResult], a: Analysis) -> Figure:
    """Left: the parameter ratio per twin size with its bootstrap interval (bounds as open
    triangles where not measured); right: one size's learning curves and the tokens ratio."""
    fig = Figure(figsize=(11, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    _paper_band(ax)
    for r, x, b, iv in zip(results, a.ratios, a.bounds, a.intervals):
        if x is not None:
            err = None
            if iv.low is not None:
                err = [[max(x - iv.low, 0.0)], [max(iv.high - x, 0.0)]]
            ax.errorbar([r.twin_params], [x], yerr=err, fmt="o", color="black", capsize=4)
        elif b is not None:
            marker = "v" if b[0] == "<" else "^"
            ax.plot([r.twin_params], [b[1]], marker, mfc="none", color="gray")
            ax.annotate(
                "not measured",
                (r.twin_params, b[1]),
                fontsize=7,
                ha="center",
                xytext=(0, -12 if b[0] == "<" else 6),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.set_xlabel("twin's non-embedding parameters")
    ax.set_ylabel("DIFF parameters for the twin's loss / twin's")
    ax.set_title("Parameter ratio (95% bootstrap over seeds)")
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")

    ax = fig.add_subplot(1, 2, 2)
    c = a.curves
    if c is None:
        ax.text(0.5, 0.5, "no learning curves", ha="center", va="center", transform=ax.transAxes)
    else:
        for label, ys in (("diff", c.diff), ("standard", c.twin)):
            for y in ys:
                ax.plot(c.tokens, y, color=COLORS[label], lw=0.7, alpha=0.4)
            ax.plot(c.tokens, ys.mean(0), color=COLORS[label], lw=2, label=LABELS[label])
        target = float(c.twin.mean(0)[-1])
        ax.axhline(target, color=COLORS["standard"], ls=":", lw=1, label="twin's final loss")
        title = f"Tokens, size {c.size}: "
        if a.tokens_ratio is not None:
            reached = a.tokens_ratio * float(c.tokens[-1])
            ax.axvline(reached, color=COLORS["diff"], ls=":", lw=1)
            title += f"ratio {_pct(a.tokens_ratio)}"
            iv = a.tokens_interval
            if iv is not None and iv.low is not None:
                title += f" [{_pct(iv.low)}, {_pct(iv.high)}]"
        else:
            title += "ratio not measured"
        title += f"\n({PAPER_LABEL}: {PAPER_TEXT})"
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("validation loss")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def is_arms_only(plan: dict) -> bool:
    """Whether the plan's ladder has arms only (neither sizes nor a field: one rung, a
    comparison per arm in ``RUN_DIR/<arm>/``; :attr:`diffjax.sweep.Ladder.arms_only`)."""
    ladder = plan["ladder"]
    return ladder.get("field") is None and ladder.get("sizes") is None and bool(ladder.get("arms"))


def write_sweep_report(run_dir: str, resamples: int = 2000) -> str:
    """Write ``sweep.md``, ``sweep_loss.png`` and ``sweep_ratio.png`` in ``run_dir`` (local or
    ``gs://``) from what the sizes wrote there; returns the markdown. A sweep over a field gets
    the field's report (:mod:`diffjax.sweep.field_report`), a ladder of arms only their
    learning curves and crossovers (:mod:`diffjax.sweep.curves_report`)."""
    plan = read_plan(run_dir)
    if plan["ladder"].get("field") is not None:  # a sweep over one setting: its own report
        return write_field_report(run_dir, plan)
    if is_arms_only(plan):  # arms only: their learning curves side by side
        return write_curves_report(run_dir, plan)
    results = size_results(run_dir, plan)
    curve_index = plan["ladder"].get("curve_size")
    if curve_index is not None:  # an index into the ladder: its position among finished sizes
        name = plan["sizes"][curve_index]["name"]
        names = [r.name for r in results]
        curve_index = names.index(name) if name in names else None
    a = analyse(results, curve_index, resamples)
    text = sweep_markdown(plan, results, a)
    storage.write_text(storage.join(run_dir, "sweep.md"), text)
    if results:
        for name, figure in (("sweep_loss.png", loss_figure), ("sweep_ratio.png", ratio_figure)):
            storage.save_figure(figure(results, a), storage.join(run_dir, name), dpi=110)
    return text
