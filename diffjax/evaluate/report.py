"""``eval.md``: one function per section, each returning its lines (tables of the measured
numbers, the paper's beside them from :mod:`.paper`, a caption and its figure from
:mod:`.plots`). What each analysis measures is in docs/evaluation.md, which the captions name."""

from __future__ import annotations

import dataclasses

import numpy as np

from diffjax import storage
from diffjax.data import DataConfig

from . import lm_tasks
from . import noise_floor as nf
from . import paper, plots
from .outliers import KS
from .results import (
    allocation_overall,
    get,
    model_name,
    retrieval_head_share,
    retrieval_overall,
)
from .settings import EvalSettings
from .stats import (
    describe_difference,
    fmt_mean_std,
    group_by_label,
    paired_by_seed,
    paired_difference,
    ratio_of_means,
)

DOC = "docs/evaluation.md"


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every section reads: the run, its settings and its results grouped by label."""

    run_dir: str
    data: DataConfig
    settings: EvalSettings
    results: list[dict]
    groups: dict[str, list[dict]]
    noise: dict

    @property
    def labels(self) -> list[str]:
        return list(self.groups)

    @property
    def zero_shot(self) -> bool:
        return self.data.source != "needle"

    def names(self) -> list[str]:
        return [model_name(lab, rs) for lab, rs in self.groups.items()]

    def cell(self, lab: str, getter, spec: str = "{:.3f}") -> str:
        return fmt_mean_std([getter(r) for r in self.groups[lab]], spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def _paired(groups, getter, what: str, unit: str = "") -> list[str]:
    """``- DIFF - twin ...`` over the seeds both have, with a 95% t-interval; no line without
    both models."""
    a, b = paired_by_seed(groups, getter)
    if not a:
        return []
    d = paired_difference(a, b)
    return [f"- {describe_difference(d, what + (f' ({unit})' if unit else ''))}"]


def _image(alt: str, name: str) -> list[str]:
    return [f"![{alt}]({name})", ""]


def best_checkpoints(rs: list[dict]) -> str:
    """Which checkpoint each seed was evaluated from, e.g. ``"best checkpoints: seed 0 step 200,
    seed 1 step 150"`` (``"best checkpoint: step 200"`` for one seed)."""
    if len(rs) == 1:
        return f"best checkpoint: step {rs[0]['step']}"
    return "best checkpoints: " + ", ".join(f"seed {r['seed']} step {r['step']}" for r in rs)


def _tokens(rs: list[dict]) -> str:
    """The training tokens up to each seed's checkpoint: one number when they agree."""
    tokens = [r["tokens"] for r in rs]
    if len(set(tokens)) == 1:
        return f"{tokens[0]:,}"
    return fmt_mean_std(tokens, "{:,.0f}")


# ---------------------------------------------------------------------------- sections
def header(run: _Run) -> list[str]:
    s, data = run.settings, run.data
    scale = "; ".join(
        f"{lab}: {rs[0]['attention']}, {rs[0]['params']:,} parameters, "
        f"{_tokens(rs)} training tokens ({best_checkpoints(rs)}), seeds {[r['seed'] for r in rs]}"
        for lab, rs in run.groups.items()
    )
    L = [
        f"# Evaluation of {storage.path(run.run_dir).name}" + (" (quick subset)" if s.quick else "")
    ]
    L += [
        "",
        f"**Our scale**: {scale}. Trained on `{data.source}` at context {data.seq_len}. "
        f"With several seeds a cell is mean ± standard deviation over seeds. "
        f"**Paper columns** are {paper.SCALE} (DIFF V1), quoted for the shape of the result, "
        f"not as a target at this scale. What each section measures: {DOC}.",
        "",
    ]
    if s.quick:
        L += [
            "Quick subset: one context length, few examples per cell "
            f"({s.retrieval_examples} retrieval, {s.allocation_examples} "
            f"allocation, {s.val_examples} validation, {s.outlier_examples} "
            f"outlier examples); run `python -m diffjax.evaluate {run.run_dir}` for the full set.",
            "",
        ]
    if run.zero_shot:
        L += [
            f"The models were trained on `{data.source}`, not on the needle task: the "
            f"retrieval, allocation and measured noise-floor numbers below are zero-shot on a "
            f"task they never saw, and say little about retrieval.",
            "",
        ]
    return L


def validation(run: _Run) -> list[str]:
    rows = [
        ["validation loss (nats/token)"]
        + [run.cell(lab, lambda r: r["val_loss"], "{:.4f}") for lab in run.labels],
        ["validation perplexity"]
        + [run.cell(lab, lambda r: r["val_ppl"], "{:.3f}") for lab in run.labels],
    ]
    rows_by_key = (
        ("val_accuracy", "answer accuracy (validation)"),
        ("val_first_query_accuracy", "first query (only the needles or pairs hold its answer)"),
        ("val_repeat_query_accuracy", "repeated queries (copyable from an earlier one)"),
    )
    for key, name in rows_by_key:
        if any(key in r for r in run.results):
            rows.append([name] + [run.cell(lab, lambda r: r.get(key)) for lab in run.labels])
    L = ["## Validation loss and perplexity", ""]
    L += _table([""] + run.names(), rows) + [""]
    line = _paired(run.groups, lambda r: r["val_loss"], "validation loss", "nats")
    L += line + [""] if line else []
    L += [
        f"Over {run.settings.val_examples} validation examples of the run's data spread over the "
        f"split ({'answer tokens only' if run.data.is_synthetic else 'every token'}); not the "
        f"same batches as the training report's, so the numbers differ slightly.",
        "",
    ]
    return L


def _retrieval_accuracy(rs: list[dict], setting: str, length: int) -> str:
    vals = []
    for r in rs:
        g = r.get("retrieval", {}).get(setting)
        if g and length in g["lengths"]:
            i = g["lengths"].index(length)
            vals.append(sum(g["correct"][i]) / max(sum(g["total"][i]), 1))
    return fmt_mean_std(vals, "{:.2f}")


def retrieval(run: _Run) -> list[str]:
    L = ["## 1. Multi-needle retrieval (paper Table 2)", ""]
    settings_nr = sorted(
        {k for r in run.results for k in r.get("retrieval", {})},
        key=lambda s: tuple(map(int, s.split(","))),
    )
    if not settings_nr:
        return L + ["Not measured: the run's context is too short for a needle and a query.", ""]
    columns = (
        ["N needles, R queried", "context"]
        + run.names()
        + ["paper Transformer (3B, 4K)", "paper DIFF (3B, 4K)"]
    )
    rows = []
    for s in settings_nr:
        n, r_ = map(int, s.split(","))
        g0 = next(r["retrieval"][s] for r in run.results if s in r.get("retrieval", {}))
        p = paper.RETRIEVAL.get((n, r_))
        name = f"N={n}, R={r_}" + (" (with replacement)" if r_ > n else "")
        for li, length in enumerate(g0["lengths"]):
            cells = [_retrieval_accuracy(run.groups[lab], s, length) for lab in run.labels]
            last = p and li == len(g0["lengths"]) - 1
            rows.append(
                [name, str(length)] + cells + ([f"{p[0]:.2f}", f"{p[1]:.2f}"] if last else ["", ""])
            )
    L += _table(columns, rows)
    replacement = any(int(x.split(",")[1]) > int(x.split(",")[0]) for x in settings_nr)
    L += [
        "",
        f"Accuracy per query, {run.settings.retrieval_examples} examples per row, over the "
        f"needle depths (heatmaps below: by depth); paper values at 4K context, on the last row "
        f"of each setting"
        + (
            "; rows with replacement (R > N) count repeated queries too, the validation table "
            "above gives the first query alone"
            if replacement
            else ""
        )
        + f". What it measures: {DOC}, section 1.",
        "",
    ]
    figures = plots.retrieval_figures(run.run_dir, run.groups, settings_nr)
    for s, fname in figures.items():
        if s == settings_nr[0] or not run.settings.quick:
            L += _image(f"retrieval N,R={s}", fname)
    lines_ = [
        x
        for s in settings_nr
        for x in _paired(
            run.groups, lambda r, s=s: retrieval_overall(r, s), f"retrieval accuracy N,R={s}"
        )
    ]
    return L + lines_ + [""]


def allocation(run: _Run) -> list[str]:
    L = ["## 2. Attention allocation (paper Table 3)", ""]
    if not any("allocation" in r for r in run.results):
        return L + ["Not measured: the run's context is too short for the needle task.", ""]
    a0 = next(r["allocation"] for r in run.results if "allocation" in r)
    cats = a0["categories"]
    ia, inoise = cats.index("answer"), cats.index("noise context")
    columns = ["depth"]
    for lab in run.labels:
        columns += [f"{lab}: answer", f"{lab}: noise"]
    columns += ["paper T: answer", "paper DIFF: answer", "paper T: noise", "paper DIFF: noise"]
    rows = []
    for di, d in enumerate(a0["depths"]):
        row = [f"{d:.0%}"]
        for lab in run.labels:
            for c in (ia, inoise):
                row.append(run.cell(lab, lambda r: get(r, "allocation", "shares", di, c)))
        p = paper.ALLOCATION.get(round(d, 2))
        row += [f"{x:.2f}" for x in p] if p else ["", "", "", ""]
        rows.append(row)
    L += _table(columns, rows)
    counts = ", ".join(f"{d:.0%}: {c}" for d, c in zip(a0["depths"], a0["count"]))
    L += [
        "",
        f"Share of the answer-producing positions' attention on the asked needle's value "
        f"(answer) and on the haystack (noise), over heads, layers, rows and examples; queries "
        f"per depth bin: {counts}. DIFF's differential map is normalised by each row's absolute "
        f"mass (our choice), so its shares are signed and sum to less than 1 (negative entries "
        f"of A1 − λA2 cancel part of the mass; the plot gives the total); the other categories are in eval.json and the plot. What it "
        f"measures: {DOC}, section 2.",
        "",
    ]
    L += _image(
        "attention allocation", plots.allocation_figure(run.run_dir, run.groups, a0["depths"], cats)
    )
    line = _paired(run.groups, lambda r: allocation_overall(r, ia), "answer share")
    L += line + [""] if line else []
    return L + retrieval_head(run, ia)


def retrieval_head(run: _Run, ia: int) -> list[str]:
    """Per model, the chosen (layer, head) of each seed, its held-out answer share, and the
    mean over every head for comparison."""
    found = {
        lab: [r for r in rs if retrieval_head_share(r) is not None]
        for lab, rs in run.groups.items()
    }
    if not any(found.values()):
        return []
    rows = []
    for rs in found.values():
        if not rs:
            continue
        heads = ", ".join(
            f"L{r['allocation']['retrieval_head']['layer']}."
            f"H{r['allocation']['retrieval_head']['head']}"
            for r in rs
        )
        nheads = np.asarray(rs[0]["allocation"]["per_head"], float).shape[:2]
        rows.append(
            [
                model_name(rs[0]["label"], rs),
                f"{nheads[0]} x {nheads[1]}",
                heads,
                fmt_mean_std([retrieval_head_share(r) for r in rs], "{:.3f}"),
                fmt_mean_std([allocation_overall(r, ia) for r in rs], "{:.3f}"),
            ]
        )
    held = all(r["allocation"]["retrieval_head"]["held_out"] for rs in found.values() for r in rs)
    L = [
        "**The retrieval head.** Per model, the (layer, head) with the largest answer share (per "
        "seed, LlayerHhead, from 0), "
        + (
            "chosen on the even examples and measured on the odd ones"
            if held
            else "chosen and measured on the same examples (too few to hold any out)"
        )
        + f"; same normalisation as above. What it measures: {DOC}, section 2.",
        "",
    ]
    L += _table(
        [
            "model",
            "layers x heads",
            "retrieval head per seed",
            "its answer share (held out)",
            "mean over every head",
        ],
        rows,
    )
    line = _paired(run.groups, retrieval_head_share, "retrieval head's answer share")
    caveat = (
        "A share of attention is not what a position contributes (docs/retrieval.md): read "
        "these shares beside the retrieval accuracy, and run `python "
        "benchmarks/lookup_attention.py RUN_DIR` for the causal check."
    )
    return L + ([""] + line if line else []) + ["", caveat, ""]


def _ablation_head(r: dict) -> dict | None:
    """The ablation's chosen head of one model's result, None when there is none."""
    h = get(r, "ablation", "best_head")
    return h if h and h.get("layer") is not None else None


def ablation_head_delta(r: dict) -> float | None:
    """The ablation head's held-out answer-category Δ log p, None without one."""
    h = _ablation_head(r)
    return None if h is None or not np.isfinite(h["delta"]) else float(h["delta"])


def ablation_layer_sum(r: dict, layer: int) -> float | None:
    """The answer-category Δ log p of ``layer``, summed over its heads (each ablated alone)."""
    return get(r, "ablation", "answer_layer_sums", layer)


def ablation_head_share(r: dict) -> float | None:
    """The allocation's answer share (over every example) of the ablation's chosen head."""
    h = _ablation_head(r)
    if h is None:
        return None
    ia = r["ablation"]["categories"].index("answer")
    return get(r, "allocation", "per_head", h["layer"], h["head"], ia)


def ablation(run: _Run) -> list[str]:
    """Per model, the answer-category contribution by ablation: the chosen head's held-out
    Δ log p beside its answer share, and each layer's Δ log p summed over heads."""
    found = {lab: [r for r in rs if _ablation_head(r)] for lab, rs in run.groups.items()}
    if not any(found.values()):
        return []
    num_layers = max(len(r["ablation"]["delta"]) for rs in found.values() for r in rs)
    rows = []
    for rs in found.values():
        if not rs:
            continue
        heads = ", ".join(f"L{_ablation_head(r)['layer']}.H{_ablation_head(r)['head']}" for r in rs)
        nheads = np.asarray(rs[0]["ablation"]["delta"], float).shape[:2]
        rows.append(
            [
                model_name(rs[0]["label"], rs),
                f"{nheads[0]} x {nheads[1]}",
                heads,
                fmt_mean_std([ablation_head_delta(r) for r in rs], "{:.3f}"),
                fmt_mean_std([ablation_head_share(r) for r in rs], "{:.3f}"),
            ]
            + [
                fmt_mean_std([ablation_layer_sum(r, i) for r in rs], "{:.3f}")
                for i in range(num_layers)
            ]
        )
    held = all(_ablation_head(r)["held_out"] for rs in found.values() for r in rs)
    L = [
        "**Contribution by ablation.** The change in the answer's log-probability (nats, summed "
        "over its tokens, mean over queries and examples) when one head's attention to the "
        "asked needle's value is removed at the answer-producing positions: those columns of "
        "the head's map (softmax, or A1 − λA2 for DIFF) set to 0 without renormalising, the "
        "head's output then computed as the model computes it (DIFF V1: through its per-head "
        "norm), negative where the value supported the answer; per seed the head with the "
        "largest |Δ| "
        + (
            "chosen on the even examples and measured on the odd ones"
            if held
            else "chosen and measured on the same examples (too few to hold any out)"
        )
        + ", beside its answer share (section 2's normalisation, every example), and each "
        "layer's Δ summed over its heads (each ablated alone; every category per head is in "
        f"eval.json). What it measures: {DOC}, section 2.",
        "",
    ]
    L += _table(
        [
            "model",
            "layers x heads",
            "head per seed",
            "its Δ log p (held out)",
            "its answer share",
        ]
        + [f"Σ heads Δ log p, layer {i}" for i in range(num_layers)],
        rows,
    )
    lines_ = _paired(run.groups, ablation_head_delta, "ablation head's Δ log p", "nats")
    for i in range(num_layers):
        lines_ += _paired(
            run.groups,
            lambda r, i=i: ablation_layer_sum(r, i),
            f"layer {i}'s Δ log p summed over heads",
            "nats",
        )
    return L + ([""] + lines_ if lines_ else []) + [""]


def outliers(run: _Run) -> list[str]:
    L = ["## 3. Activation outliers (paper Table 5)", ""]
    columns = ["activation", "statistic"] + run.names()
    columns += ["paper Transformer (3B)", "paper DIFF (3B)"]
    rows = []
    for kind in ("attention logits", "hidden states"):
        for stat in [f"top-{k}" for k in KS] + ["median"]:
            p = paper.OUTLIERS[kind].get(stat)
            rows.append(
                [kind, stat]
                + [run.cell(lab, lambda r: get(r, "outliers", kind, stat)) for lab in run.labels]
                + ([f"{p[0]}", f"{p[1]}"] if p else ["", ""])
            )
    L += _table(columns, rows)
    tokens = run.results[0]["outliers"]["tokens"]
    L += [
        "",
        f"Magnitudes over {tokens:,} tokens of validation text: the logits of every head, map "
        f"and layer (causally visible entries), the hidden states at each block's output. What "
        f"it measures: {DOC}, section 3.",
        "",
    ]
    line = _paired(
        run.groups,
        lambda r: get(r, "outliers", "attention logits", "top-1"),
        "top-1 attention logit",
    )
    L += line + [""] if line else []
    return L + _image("activation outliers", plots.outliers_figure(run.run_dir, run.groups))


def quantization(run: _Run) -> list[str]:
    L = ["## 4. Quantization of the attention logits (paper Fig. 8)", ""]
    has_acc = any("accuracy" in q for r in run.results for q in r["quantization"])
    columns = ["logit bits"]
    for lab in run.labels:
        columns += [f"{lab}: val loss"] + ([f"{lab}: accuracy"] if has_acc else [])
    widths = [q["bits"] for q in run.results[0]["quantization"]]
    rows = []
    for i, b in enumerate(widths):
        row = ["float32" if b is None else str(b)]
        for lab in run.labels:
            row.append(run.cell(lab, lambda r: get(r, "quantization", i, "val_loss"), "{:.4f}"))
            if has_acc:
                row.append(run.cell(lab, lambda r: get(r, "quantization", i, "accuracy")))
        rows.append(row)
    L += _table(columns, rows)
    task = (
        "zero-shot needle retrieval (the models were not trained on it)"
        if run.zero_shot
        else "retrieval on the run's task"
    )
    L += [
        "",
        f"Logits absmax-quantized (simulated) per example and head before the softmax. Paper "
        f"(Fig. 8, 3B): {paper.QUANTIZATION_FINDING}. Accuracy: {task}. What it measures: "
        f"{DOC}, section 4.",
        "",
    ]
    return L + _image("quantization", plots.quantization_figure(run.run_dir, run.groups, widths))


def noise_floor(run: _Run) -> list[str]:
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
    L += _table(
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
    m, lam = nf.REPORT_MARGIN, nf.REPORT_LAMBDA
    L += ["", noise_floor_caption(m, lam), ""]
    L += _image("noise floor", plots.noise_floor_figure(run.run_dir, run.groups, noise, m, lam))
    return L + _measured_noise_floor(run)


def noise_floor_caption(m: float, lam: float) -> str:
    """The closed-form table's caption: the setting, and what the gain column is (the exact
    formula's two regimes: near the cancellation point and for many distractors)."""
    text = (
        f"Closed form (diffjax.evaluate.noise_floor): one signal key {m:g} logits above N equal "
        f"distractors, λ = {lam}, the second map not singling out the signal; shares of the "
        f"row's absolute mass. The gain is the differential map's signal-to-|distractor| ratio "
        f"over softmax's, exactly (N(e^m − λ) + (1 − λ)e^m) / (e^m |(1 − λ)N + 1 − λe^m|): "
        f"for many distractors it tends to (e^m − λ)/((1 − λ)e^m) = "
        f"{nf.asymptotic_gain(m, lam):.2f}x (about 1/(1 − λ))"
    )
    star = nf.cancellation_point(m, lam)
    if star is not None:
        text += (
            f", and it is larger at fewer distractors because the differential distractor total "
            f"D1 − λD2 passes through zero at N* = (λe^m − 1)/(1 − λ) = {star:,.0f} (exact "
            f"cancellation; unbounded gain there, and a negative total below it)"
        )
    return text + f". What it measures: {DOC}, section 5."


def _measured_noise_floor(run: _Run) -> list[str]:
    if not any(r.get("noise_measured") for r in run.results):
        return []
    rows = []
    for lab, rs in run.groups.items():
        points = [m for r in rs for m in r.get("noise_measured", [])]
        for x in sorted({m["length"] for m in points}):
            ms = [m for m in points if m["length"] == x]
            rows.append(
                [
                    model_name(lab, rs),
                    str(x),
                    f"{np.mean([m['num_distractors'] for m in ms]):.0f}",
                    fmt_mean_std([m["signal"] for m in ms], "{:.4f}"),
                    fmt_mean_std([m["distractors"] for m in ms], "{:.4f}"),
                    fmt_mean_std([m["signal_share"] for m in ms], "{:.4f}"),
                    fmt_mean_std([m["distractor_share"] for m in ms], "{:.4f}"),
                    measured_ratio(ms),
                ]
            )
    L = [
        "Measured on the models' own maps (needle examples, answer-producing rows; signal = the "
        "answer span, distractors = the other needles and the haystack):",
        "",
    ]
    L += _table(
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


def measured_ratio(points: list[dict]) -> str:
    """The measured noise floor's signal-to-distractor cell for the points (seeds) of one
    model and context: the ratio of the mean shares where the distractor share is clearly
    positive, else ``—`` (:func:`diffjax.evaluate.stats.ratio_of_means`)."""
    r = ratio_of_means([m["signal_share"] for m in points], [m["distractor_share"] for m in points])
    return "—" if r is None else f"{r:.3f}"


def loss_by_position(run: _Run) -> list[str]:
    L = ["## 6. Loss by position", ""]
    if not any("positions" in r for r in run.results):
        return L + ["Not measured: the run's task (MQAR) has no running text.", ""]
    p0 = next(r["positions"] for r in run.results if "positions" in r)
    ends = p0["ends"]
    idx = sorted({0, len(ends) // 2, len(ends) - 1})
    rows = [
        [model_name(lab, rs)]
        + [
            fmt_mean_std([r["positions"]["loss"][i] for r in rs if "positions" in r], "{:.4f}")
            for i in idx
        ]
        for lab, rs in run.groups.items()
    ]
    starts = [0] + ends[:-1]
    L += _table(["model"] + [f"positions {starts[i]}–{ends[i] - 1}" for i in idx], rows)
    figure = plots.loss_by_position_figure(run.run_dir, run.groups, p0)
    beyond = p0["length"] > p0["trained_length"]
    L += [
        "",
        f"Per-token loss on validation text at context {p0['length']} (the models were trained "
        f"at {p0['trained_length']}"
        + ("; positions beyond it test length extrapolation" if beyond else "")
        + f"), in equal position buckets. What it measures: {DOC}, section 6.",
        "",
    ]
    if run.data.source == "needle":
        L += [
            "**Read with care:** the needle task trains on the answer digits only, so this "
            "curve is not a language-modelling measure; this run's far-context measure is the "
            "retrieval grid of section 1.",
            "",
        ]
    return L + _image("loss by position", figure)


def footer(run: _Run) -> list[str]:
    L = []
    lam = [(r["label"], r["seed"], r["lambda"]) for r in run.results if r.get("lambda")]
    if lam:
        L += [
            "DIFF V1 λ per layer: "
            + "; ".join(f"{lab} seed {s}: " + ", ".join(f"{x:.3f}" for x in v) for lab, s, v in lam)
            + ".",
            "",
        ]
    seeds = sorted({r["seed"] for r in run.results})
    L += [
        f"Seeds: {seeds}. Numbers: eval.json. Written by `python -m diffjax.evaluate"
        f"{' --quick' if run.settings.quick else ''}`.",
        "",
    ]
    return L


def lm_eval_tasks(run: _Run) -> list[str]:
    """The lm-eval section from ``lm_eval.json``, where an earlier
    ``python -m diffjax.evaluate --lm-eval-tasks`` wrote one (kept when the analyses rerun)."""
    data = lm_tasks.read_results(run.run_dir)
    return [] if data is None else lm_tasks.render_section(data)


SECTIONS = (
    header,
    validation,
    retrieval,
    allocation,
    ablation,
    outliers,
    quantization,
    noise_floor,
    loss_by_position,
    footer,
    lm_eval_tasks,
)


def render(
    run_dir: str,
    data: DataConfig,
    settings: EvalSettings,
    results: list[dict],
    noise: dict,
) -> str:
    """``eval.md`` for the results of every model of a run (its figures are written into
    ``run_dir``)."""
    run = _Run(run_dir, data, settings, results, group_by_label(results), noise)
    return "\n".join(line for section in SECTIONS for line in section(run))
