r"""The noise floor: how much weight one signal key keeps among ``N`` distractors.

The seeds' argument (common-mode rejection): softmax never gives a key zero weight, so ``N``
irrelevant keys each get ``O(1/N)`` and together ``O(1)``; the mass they take grows with the
context and dilutes the signal. A differential map ``A1 - lambda * A2`` subtracts a second map
that spreads the same background mass over the same keys, so the shared (common-mode) part
cancels and the signal, which only ``A1`` singles out, stays.

Closed form (:func:`noise_floor_closed_form`). One signal key whose logit exceeds every
distractor's by ``m`` (all distractors equal: pure common mode). A softmax map gives

    signal      s(m, N) = e^m / (e^m + N) = sigmoid(m - ln N)
    distractors D(m, N) = N   / (e^m + N) = sigmoid(ln N - m)        (s + D = 1)

A differential map with ``A1`` of margin ``m1`` and ``A2`` of margin ``m2`` (default 0: the
second map does not single out the signal) gives

    signal      s1 - lambda * s2
    distractors D1 - lambda * D2 = sigmoid(ln N - m1) - lambda * sigmoid(ln N - m2)

(rows sum to ``1 - lambda``). With ``a = e^m1``, ``b = e^m2`` the ratio of the two
signal-to-distractor ratios (:func:`closed_form_gain`, the report's "gain") is exactly

    G(N) = (diff s / |diff D|) / (softmax s / D)
         = (N (a - lambda b) + (1 - lambda) a b) / (a |(1 - lambda) N + b - lambda a|)

- For large N it tends to ``(a - lambda b) / ((1 - lambda) a)`` (:func:`asymptotic_gain`), about
  ``1 / (1 - lambda)``: 4.97x for m = 5, lambda = 0.8, m2 = 0 (not quite 5, since ``A2`` keeps
  ``lambda b`` of signal out of ``a``).
- It is larger at smaller N, and unbounded at ``N* = (lambda a - b) / (1 - lambda)``
  (:func:`cancellation_point`; 589 for m = 5, lambda = 0.8): there the distractor total
  ``D1 - lambda D2`` passes through zero (``lambda = D1 / D2``, exact cancellation). Below
  ``N*`` the distractor total is negative (``A2`` takes away more background than ``A1`` put
  there). So G(1024) = 11.70x, G(4096) = 5.81x, G(262144) = 4.98x at m = 5, lambda = 0.8: the
  "1 / (1 - lambda)" figure holds only for ``N >> N*``.

For ``N >> e^m1`` the distractor total tends to ``1 - lambda`` while the signal tends to
``(a - lambda b) / N``. The floor still grows with N for a fixed lambda; what moves is the
context length at which the distractors outweigh the signal, from ``N = e^m`` (softmax) to about
``N = e^m (1 + lambda) / (1 - lambda)`` (m2 = 0).

:func:`noise_floor_streamed` drops the "equal distractors" assumption: distractor logits are
random (``N(0, sigma^2)`` in ``A1``, correlated ``rho`` with those of ``A2``), one row of
``N`` weights at a time (no ``N x N`` matrix). With ``sigma = 0`` it equals the closed form;
with ``rho < 1`` part of the noise is not common mode and does not cancel.

The analysis: the noise floor measured on a model's own maps (:class:`MeasuredNoise`, by
:func:`diffjax.evaluate.allocation.measured_noise_floor` at each context), and the section of
eval.md that sets it beside the closed form, with its plot.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.special import expit, logsumexp

from diffjax.infra import storage

from diffjax.evaluate import plots
from diffjax.evaluate.allocation import measured_noise_floor
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, model_name, table
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.stats import fmt_mean_std, ratio_of_means

DEFAULT_NS = tuple(2**k for k in range(10, 19))  # 1K .. 256K
# The closed form eval.md shows: the signal key's logit margin, and lambda (the depth schedule's
# deep-layer value).
REPORT_MARGIN = 5.0
REPORT_LAMBDA = 0.8


def _check(num_distractors, lam):
    n = np.asarray(num_distractors, np.float64)
    if np.any(n < 1):
        raise ValueError(f"noise floor: num_distractors must be >= 1, got {num_distractors}")
    if not np.isfinite(lam):
        raise ValueError(f"noise floor: lambda must be finite, got {lam}")
    return n


def noise_floor_closed_form(
    num_distractors, margin: float, lam: float = 0.8, margin2: float = 0.0
) -> dict[str, np.ndarray]:
    """Signal weight and total distractor weight of a softmax map and of a differential map
    (see the module docstring), for each ``N`` in ``num_distractors`` (float64 arrays).

    Returns ``softmax_signal``, ``softmax_distractors``, ``diff_signal``, ``diff_distractors``
    (raw, rows of the differential map sum to ``1 - lam``) and the ratios
    ``softmax_snr = s / D`` and ``diff_snr = s / |D|``."""
    n = _check(num_distractors, lam)
    log_n = np.log(n)
    s1, d1 = expit(margin - log_n), expit(log_n - margin)
    s2, d2 = expit(margin2 - log_n), expit(log_n - margin2)
    ds, dd = s1 - lam * s2, d1 - lam * d2
    with np.errstate(divide="ignore"):  # inf at the cancellation point, where dd = 0
        diff_snr = ds / np.abs(dd)
    return {
        "num_distractors": n,
        "softmax_signal": s1,
        "softmax_distractors": d1,
        "diff_signal": ds,
        "diff_distractors": dd,
        "softmax_snr": s1 / d1,
        "diff_snr": diff_snr,
    }


def closed_form_gain(
    num_distractors, margin: float, lam: float = 0.8, margin2: float = 0.0
) -> np.ndarray:
    """``G(N)``, the differential map's signal-to-|distractor| ratio over softmax's, from the
    formula of the module docstring (equal to ``diff_snr / softmax_snr`` of
    :func:`noise_floor_closed_form`; inf at :func:`cancellation_point`)."""
    n = _check(num_distractors, lam)
    a, b = np.exp(margin), np.exp(margin2)
    with np.errstate(divide="ignore"):
        return (n * (a - lam * b) + (1.0 - lam) * a * b) / (
            a * np.abs((1.0 - lam) * n + b - lam * a)
        )


def asymptotic_gain(margin: float, lam: float = 0.8, margin2: float = 0.0) -> float:
    """The limit of :func:`closed_form_gain` for ``N -> inf``: ``(e^m - lam e^m2) / ((1 - lam)
    e^m)``, about ``1 / (1 - lam)``."""
    if not lam < 1.0:
        raise ValueError(f"asymptotic_gain: lambda must be < 1, got {lam}")
    a, b = np.exp(margin), np.exp(margin2)
    return float((a - lam * b) / ((1.0 - lam) * a))


def cancellation_point(margin: float, lam: float = 0.8, margin2: float = 0.0) -> float | None:
    """The number of distractors ``N* = (lam e^m - e^m2) / (1 - lam)`` at which the
    differential map's distractor total ``D1 - lam D2`` is exactly zero (None when no ``N >= 1``
    gives zero, e.g. ``lam >= 1`` or a small margin)."""
    if not lam < 1.0:
        return None
    n = (lam * np.exp(margin) - np.exp(margin2)) / (1.0 - lam)
    return float(n) if n >= 1.0 else None


def noise_floor_streamed(
    num_distractors: int,
    margin: float,
    lam: float = 0.8,
    margin2: float = 0.0,
    sigma: float = 0.0,
    rho: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """One query row with random distractor logits: ``z1 ~ N(0, sigma^2)`` for ``A1``, ``z2 =
    rho z1 + sqrt(1 - rho^2) N(0, sigma^2)`` for ``A2``; signal logits ``margin`` and
    ``margin2``. Returns the signal weight, the signed total and the absolute total
    (``sum |w|``) of the distractor weights, for softmax (``A1``) and the differential map."""
    n = int(_check(num_distractors, lam))
    if not -1.0 <= rho <= 1.0:
        raise ValueError(f"noise_floor_streamed: rho must be in [-1, 1], got {rho}")
    rng = np.random.default_rng(seed)
    z1 = sigma * rng.standard_normal(n)
    z2 = rho * z1 + np.sqrt(max(1.0 - rho * rho, 0.0)) * sigma * rng.standard_normal(n)
    lz1 = logsumexp(np.append(z1, margin))
    lz2 = logsumexp(np.append(z2, margin2))
    w1, w2 = np.exp(z1 - lz1), np.exp(z2 - lz2)
    s1, s2 = float(np.exp(margin - lz1)), float(np.exp(margin2 - lz2))
    wd = w1 - lam * w2
    return {
        "softmax_signal": s1,
        "softmax_distractors": float(w1.sum()),
        "diff_signal": s1 - lam * s2,
        "diff_distractors": float(wd.sum()),
        "diff_distractors_abs": float(np.abs(wd).sum()),
    }


# ---------------------------------------------------------------------------- the analysis
@dataclasses.dataclass(frozen=True)
class NoisePoint:
    """The noise floor measured on a model's maps at context ``length``
    (:func:`diffjax.evaluate.allocation.measured_noise_floor`)."""

    length: int
    signal: float
    distractors: float
    signal_share: float
    distractor_share: float
    num_distractors: float
    snr: float | None


@dataclasses.dataclass(frozen=True)
class MeasuredNoise:
    """One point per context measured (eval.json: a list)."""

    points: list[NoisePoint]

    def to_dict(self) -> list[dict]:
        return [dataclasses.asdict(p) for p in self.points]

    @classmethod
    def from_dict(cls, d: list[dict]) -> "MeasuredNoise":
        return cls([NoisePoint(**p) for p in d])


def measure(inputs: ModelInputs) -> MeasuredNoise | None:
    """At the trained context (quick) or every retrieval length the needle setting fits, on
    the allocation examples; None where the trained context is too short for the task."""
    if inputs.needle_batch is None:
        return None
    n0, r0 = inputs.needle_setting
    seq_len, points = inputs.data.seq_len, []
    for x in [seq_len] if inputs.settings.quick else inputs.lengths:
        if inputs.fits(x, n0, r0):
            b = inputs.needle_batch if x == seq_len else inputs.needle_examples(x)
            m = measured_noise_floor(inputs.model, b, batch_size=inputs.settings.batch_size)
            points.append(NoisePoint(length=x, **m))
    return MeasuredNoise(points)


def _points(rs) -> list[NoisePoint]:
    return [p for r in rs for p in (r.get("noise_measured") or MeasuredNoise([])).points]


def section(run: Run) -> list[str]:
    noise, ns = run.noise, run.noise["num_distractors"]
    shown = [i for i, n in enumerate(ns) if int(n) in (1024, 4096, 16384, 65536, 262144)]
    rows = []
    for i in shown:
        total = abs(noise["diff_signal"][i]) + abs(noise["diff_distractors"][i])
        rows.append(
            [
                f"{int(ns[i]):,}",
                f"{noise['softmax_signal'][i]:.4f}",
                f"{noise['softmax_distractors'][i]:.4f}",
                f"{noise['diff_signal'][i] / total:.4f}",
                f"{noise['diff_distractors'][i] / total:.4f}",
                f"{noise['diff_snr'][i] / noise['softmax_snr'][i]:.2f}x",
            ]
        )
    L = ["## 5. The noise floor", ""]
    L += table(
        [
            "distractors N",
            "softmax: signal",
            "softmax: distractors",
            "diff: signal",
            "diff: distractors",
            "signal/distractor gain",
        ],
        rows,
    )
    m, lam = REPORT_MARGIN, REPORT_LAMBDA
    L += ["", caption(m, lam), ""]
    measured = {lab: [dataclasses.asdict(p) for p in _points(rs)] for lab, rs in run.groups.items()}
    name = "eval_noise_floor.png"
    plots.save(draw_noise_floor(measured, noise, m, lam), storage.join(run.run_dir, name))
    L += image("noise floor", name)
    return L + measured_section(run)


def caption(m: float, lam: float) -> str:
    """The closed-form table's caption: the setting, and what the gain column is (the exact
    formula's two regimes: near the cancellation point and for many distractors)."""
    text = (
        f"Closed form (diffjax.evaluate.noise_floor): one signal key {m:g} logits above N equal "
        f"distractors, λ = {lam}, the second map not singling out the signal; shares of the "
        f"row's absolute mass. The gain is the differential map's signal-to-|distractor| ratio "
        f"over softmax's, exactly (N(e^m − λ) + (1 − λ)e^m) / (e^m |(1 − λ)N + 1 − λe^m|): "
        f"for many distractors it tends to (e^m − λ)/((1 − λ)e^m) = "
        f"{asymptotic_gain(m, lam):.2f}x (about 1/(1 − λ))"
    )
    star = cancellation_point(m, lam)
    if star is not None:
        text += (
            f", and it is larger at fewer distractors because the differential distractor total "
            f"D1 − λD2 passes through zero at N* = (λe^m − 1)/(1 − λ) = {star:,.0f} (exact "
            f"cancellation; unbounded gain there, and a negative total below it)"
        )
    return text + f". What it measures: {DOC}, section 5."


def measured_section(run: Run) -> list[str]:
    if not any(r.points for r in run.measured("noise_measured")):
        return []
    rows = []
    for lab, rs in run.groups.items():
        points = _points(rs)
        for x in sorted({m.length for m in points}):
            ms = [m for m in points if m.length == x]
            rows.append(
                [
                    model_name(lab, rs),
                    str(x),
                    f"{np.mean([m.num_distractors for m in ms]):.0f}",
                    fmt_mean_std([m.signal for m in ms], "{:.4f}"),
                    fmt_mean_std([m.distractors for m in ms], "{:.4f}"),
                    fmt_mean_std([m.signal_share for m in ms], "{:.4f}"),
                    fmt_mean_std([m.distractor_share for m in ms], "{:.4f}"),
                    measured_ratio(ms),
                ]
            )
    L = [
        "Measured on the models' own maps (needle examples, answer-producing rows; signal = the "
        "answer span, distractors = the other needles and the haystack):",
        "",
    ]
    L += table(
        [
            "model",
            "context",
            "distractor positions",
            "signal (raw)",
            "distractors (raw)",
            "signal share",
            "distractor share",
            "signal share / distractor share (ratio of the means)",
        ],
        rows,
    )
    L += [
        "",
        "The ratio is the mean signal share over the mean distractor share (over seeds), not a "
        "mean of per-seed ratios; it is left out (—) where the distractor share is not clearly "
        "positive (a seed at or below zero, or a mean within one standard deviation of zero): "
        "a differential map can cancel its distractors to about zero, and a ratio over that "
        "says nothing. Compare the two share columns there.",
    ]
    return L + [""]


def measured_ratio(points: list[NoisePoint]) -> str:
    """The measured noise floor's signal-to-distractor cell for the points (seeds) of one
    model and context: the ratio of the mean shares where the distractor share is clearly
    positive, else ``—`` (:func:`diffjax.evaluate.stats.ratio_of_means`)."""
    r = ratio_of_means([m.signal_share for m in points], [m.distractor_share for m in points])
    return "—" if r is None else f"{r:.3f}"


def diff_shares(noise: dict) -> tuple[np.ndarray, np.ndarray]:
    """The closed-form differential map's signal and distractor weights as shares of the row's
    absolute mass."""
    s, d = np.asarray(noise["diff_signal"]), np.asarray(noise["diff_distractors"])
    mass = np.abs(s) + np.abs(d)
    return s / mass, d / mass


def draw_noise_floor(measured: dict[str, list[dict]], noise: dict, margin: float, lam: float):
    """Left: the closed form (softmax solid, differential dashed; signal and distractors in
    two colours) on a log axis with headroom above 1, so the distractor lines near 1 stay in
    view. Right, when the models were measured: each seed's signal and distractor shares (and
    their mean over seeds, joined across contexts) against the distractor positions, on their
    own axes; a log axis, or a symmetric log one bounded by the data when a share is negative."""
    measured = {k: v for k, v in measured.items() if v}  # label -> measured points (dicts)
    fig, axes = plots.figure(11.5 if measured else 6.5, 4.2, 2 if measured else 1)
    ax = axes[0]
    ns = np.asarray(noise["num_distractors"], float)
    diff_signal, diff_distractors = diff_shares(noise)
    for y, style, color, label in (
        (noise["softmax_signal"], "-", "C0", "softmax: signal"),
        (noise["softmax_distractors"], "-", "C1", "softmax: distractors"),
        (diff_signal, "--", "C0", "differential: signal"),
        (diff_distractors, "--", "C1", "differential: distractors"),
    ):
        ax.plot(ns, np.asarray(y, float), style, color=color, lw=1.8, label=label)
    ax.set_xscale("log", base=2)
    curves = np.concatenate([noise["softmax_signal"], diff_signal, diff_distractors])
    if np.all(np.asarray(curves) > 0):
        ax.set_yscale("log")
        ax.set_ylim(float(np.min(curves)) / 2, 2.0)
    else:
        ax.set_yscale("symlog", linthresh=1e-3)
        plots.symlog_limits(ax, [curves, noise["softmax_distractors"]], 1e-3)
    ax.set_xlabel("distractors N")
    ax.set_ylabel("share of the row's absolute attention")
    ax.set_title(f"closed form: margin {margin:g}, λ = {lam}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    if measured:
        _measured_noise_panel(axes[1], measured)
    return fig


def _measured_noise_panel(ax, measured: dict[str, list[dict]]) -> None:
    from matplotlib.ticker import NullLocator

    values, counts = [], set()
    for i, (lab, pts) in enumerate(measured.items()):
        x = np.asarray([m["num_distractors"] for m in pts], float)
        counts |= set(x.tolist())
        shift = 1.06**i  # the models side by side at each context, not on top of each other
        for key, marker, what in (
            ("signal_share", "x", "signal"),
            ("distractor_share", "+", "distractors"),
        ):
            y = np.asarray([m[key] for m in pts], float)
            values.append(y)
            ax.plot(x * shift, y, marker, color=f"C{i + 2}", ms=6, alpha=0.6)
            xs = np.array(sorted(set(x.tolist())))
            mean = np.array([np.nanmean(y[x == v]) for v in xs])
            ax.plot(
                xs * shift,
                mean,
                "-" if what == "signal" else ":",
                marker=marker,
                color=f"C{i + 2}",
                label=f"{lab}: {what} (line: mean over seeds)",
            )
    ax.set_xscale("log", base=2)
    ticks = sorted(counts)
    ax.set_xticks(ticks, [f"{v:.0f}" for v in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    lo, hi = min(ticks), max(ticks) * 1.06 ** (len(measured) - 1)
    ax.set_xlim(lo / 1.5, hi * 1.5)
    y = np.concatenate(values)
    y = y[np.isfinite(y)]
    if y.size and np.all(y > 0):
        ax.set_yscale("log")
        plots.plain_log_y(ax)
        ax.set_ylim(float(y.min()) / 2, min(2.0, float(y.max()) * 2))
    elif y.size:
        small = np.abs(y[y != 0])
        thresh = float(10 ** np.floor(np.log10(small.min()))) if small.size else 1e-3
        ax.set_yscale("symlog", linthresh=thresh)
        plots.symlog_limits(ax, [y], thresh)
        ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("distractor positions (other needles + haystack; models side by side)")
    ax.set_ylabel("share of the row's absolute attention")
    ax.set_title("measured on the models' maps (each seed; x: signal, +: distractors)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


ANALYSIS = Analysis("noise_measured", MeasuredNoise, measure, section)
