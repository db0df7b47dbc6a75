"""The report of a retrofit study (:mod:`diffjax.compare.retrofit_study`): ``RUN_DIR/retrofit.md``
and ``RUN_DIR/retrofit.png``, from the files the runs wrote (``retrofit_plan.json``, each run's
``metrics.jsonl``, ``config.json`` and ``study_done.json``); nothing is trained or loaded.

Per converted arm, against the unconverted continuation (the baseline) of the same seed:

- the paired validation-loss difference (converted − baseline) at every evaluation of the
  continuation, with a pointwise 95% Student-t band over the seeds, the crossover (from which
  evaluation the band stays below 0) and the final difference with its interval
  (:func:`difference_curve`, :mod:`diffjax.compare.curves`);
- the step-0 loss: the first record's training loss, the first batch before any update (the
  same batch for every arm of a seed);
- the recovery of the source's loss: the first evaluation where the arm's validation loss,
  mean over seeds, is at or below the sources' (mean over seeds, measured on the
  continuation's validation batches) (:func:`recovery_step`), and per seed;
- retrieval of each arm's final model and of the source (needle, MQAR; the probes'
  no-retrieval chance beside them).

A run not finished yet is left out (the report says how many seeds each number is over).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from diffjax.infra import storage
from diffjax.evaluate.stats import difference_cell, fmt_mean_std, mean_std, pair_seeds
from diffjax.train.metrics import read_metrics

from diffjax.compare.plots import draw_band, draw_seed_curves
from diffjax.compare.curves import (
    DifferenceCurve,
    EvalCurve,
    band_cell,
    crossover,
    describe_crossover,
    describe_final,
    eval_curve,
    mean_curve,
    paired_curve,
)

PLAN_FILE = "retrofit_plan.json"
DONE_FILE = "study_done.json"
# each run's experiment (not config.json: a folder holding one reads as a Hugging Face checkpoint)
RUN_CONFIG = "run_config.json"
KINDS = {"standard": "standard", "diff_v1": "DIFF V1", "diff_v2": "DIFF V2"}


@dataclasses.dataclass
class Run:
    """One finished run's records: its evaluations, its training loss and its first loss."""

    seed: int
    curve: EvalCurve  # the evaluations: tokens, validation loss, steps
    train_steps: np.ndarray
    train: np.ndarray  # training loss of every step
    first_loss: float | None  # the training loss of step 1 (the first batch, before an update)
    marker: dict[str, Any]
    config: dict[str, Any]

    @property
    def final(self) -> float | None:
        return float(self.curve.loss[-1]) if self.curve.loss.size else None


def read_run(run: dict[str, Any]) -> Run | None:
    """The :class:`Run` of a finished run (its ``study_done.json`` written), else None."""
    done = storage.join(run["directory"], DONE_FILE)
    if not storage.exists(done):
        return None
    marker = storage.read_json(done)
    cfg_path = storage.join(run["directory"], RUN_CONFIG)
    config = storage.read_json(cfg_path) if storage.exists(cfg_path) else {}
    records = read_metrics(storage.join(run["directory"], "metrics.jsonl"))
    trained = [r for r in records if not r.get("skipped")]
    first = records[0]["loss"] if records and records[0].get("step") == 1 else None
    return Run(
        run["seed"],
        eval_curve(records),
        np.array([r["step"] for r in trained], int),
        np.array([r["loss"] for r in trained], float),
        first,
        marker,
        config,
    )


# ---------------------------------------------------------------------------- statistics
def step_mean(runs: dict[int, Run]) -> tuple[np.ndarray, np.ndarray]:
    """The validation loss, mean over the seeds, at the steps every seed has
    (:func:`diffjax.compare.curves.mean_curve` over steps)."""
    xs, mean = mean_curve(
        [(r.curve.steps, r.curve.loss) for r in runs.values() if r.curve.loss.size]
    )
    return xs.astype(int), mean


def recovery_step(steps: Sequence[int], losses: Sequence[float], level: float) -> int | None:
    """The first evaluation step whose loss is at or below ``level`` (None: none is)."""
    for t, x in zip(steps, losses):
        if x <= level:
            return int(t)
    return None


# ---------------------------------------------------------------------------- the report
def _fmt(x, spec="{:.4f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else spec.format(x)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _seeds(n: int) -> str:
    return "1 seed" if n == 1 else f"{n} seeds"


def _model(cfg: dict[str, Any]) -> str:
    m = cfg.get("model", {})
    kind = KINDS.get(m.get("attention"), m.get("attention", "?"))
    heads, d = m.get("num_heads"), m.get("d_model")
    width = m.get("head_dim") or (d // heads if heads else None)
    name = "head" if heads == 1 else "heads"
    if m.get("attention") == "diff_v1":
        return f"{kind}, {heads} {name} x (2 x {d // (2 * heads) if heads else '?'})"
    if m.get("attention") == "diff_v2":
        return f"{kind}, {heads} {name} x {width} (2 query maps each)"
    return f"{kind}, {heads} {name} x {width}"


@dataclasses.dataclass
class StudyData:
    """Everything the report reads: the plan and each arm's finished runs by seed."""

    run_dir: str
    plan: dict[str, Any]
    arms: dict[str, dict[int, Run]]  # "source", the baseline and the converted arms

    @property
    def baseline(self) -> str:
        return self.plan["study"]["baseline"]

    @property
    def converted(self) -> list[str]:
        return list(self.plan["study"]["arms"])

    @property
    def continuations(self) -> list[str]:
        return [self.baseline, *self.converted]


def read_study(run_dir: str) -> StudyData:
    plan = storage.read_json(storage.join(run_dir, PLAN_FILE))
    arms: dict[str, dict[int, Run]] = {}
    for run in plan["runs"]:
        finished = read_run(run)
        arms.setdefault(run["arm"], {})
        if finished is not None:
            arms[run["arm"]][run["seed"]] = finished
    return StudyData(run_dir, plan, arms)


def difference_curve(data: StudyData, arm: str) -> DifferenceCurve | None:
    """``arm`` − the unconverted continuation over the seeds both finished, paired by seed, at
    the evaluations every one of those runs has
    (:func:`diffjax.compare.curves.paired_difference_curve`); None without such an evaluation."""
    runs, base = (
        {s: r.curve for s, r in data.arms.get(name, {}).items() if r.curve.loss.size}
        for name in (arm, data.baseline)
    )
    return paired_curve(runs, base)[1]


def source_levels(data: StudyData) -> dict[int, float]:
    """Per seed: the source's validation loss on the continuation's validation batches."""
    return {
        s: c.marker["probes"]["val_loss"]
        for s, c in data.arms.get("source", {}).items()
        if c.marker.get("probes", {}).get("val_loss") is not None
    }


def _name(data: StudyData, arm: str) -> str:
    runs = data.arms.get(arm, {})
    cfg = next(iter(runs.values())).config if runs else {}
    kind = KINDS.get(cfg.get("model", {}).get("attention"), "?")
    if arm == data.baseline:
        return f"{arm} (unconverted)"
    return f"{arm} ({kind})"


def _setup(data: StudyData) -> list[str]:
    study = data.plan["study"]
    src = data.arms.get("source", {})
    src_run = next(iter(src.values()), None)
    base = next(iter(data.arms.get(data.baseline, {}).values()), None)
    lines = ["## Setup", ""]
    external = any(r["external"] for r in data.plan["runs"] if r["role"] == "source")
    if src_run is not None:
        cfg = src_run.config
        t, d = cfg.get("train", {}), cfg.get("data", {})
        if external:
            lines.append(
                f"- **Source**: `{src_run.config.get('train', {}).get('init_from')}` "
                f"({_model(cfg)}), not trained here."
            )
        else:
            tokens = study["source_steps"] * t.get("batch_size", 0) * d.get("seq_len", 0)
            lines.append(
                f"- **Source** (`source/seed_<s>`): {_model(cfg)}, d_model "
                f"{cfg['model']['d_model']}, {cfg['model']['num_layers']} layers, trained "
                f"{study['source_steps']} steps ({tokens:,} tokens) from init seed s on "
                f"`{d.get('source')}` data (data.seed {d.get('seed')}); lr {t.get('lr'):g}, "
                f"warmup {t.get('warmup_steps')}, {t.get('schedule')} to "
                f"{t.get('min_lr_ratio'):g} x lr. The continuations start from its best "
                f"checkpoint (step {src_run.marker['probes'].get('start_step')} of seed "
                f"{src_run.seed})."
            )
    if base is not None:
        t, d = base.config.get("train", {}), base.config.get("data", {})
        tokens = study["continue_steps"] * t.get("batch_size", 0) * d.get("seq_len", 0)
        runs = data.arms.get(data.baseline, {})
        seeds = sorted({c.config.get("data", {}).get("seed") for c in runs.values()})
        order = "the same for every seed" if len(seeds) == 1 else "one per seed"
        lines.append(
            f"- **Continuation** (every arm): {study['continue_steps']} steps ({tokens:,} "
            f"tokens), data.seed {', '.join(map(str, seeds))} ({order}: batches in another "
            f"order than the source's, the same for every arm of a seed); lr {t.get('lr'):g}, warmup "
            f"{t.get('warmup_steps')}, {t.get('schedule')} to {t.get('min_lr_ratio'):g} x lr; "
            f"an evaluation every {t.get('eval_every')} steps on {t.get('eval_batches')} "
            f"validation batches of {t.get('batch_size')} x {d.get('seq_len')}."
        )
    lines += ["", "| arm | model | parameters | start | the negative map's weight w |"]
    lines.append("|---|---|---|---|---|")
    for arm in data.continuations:
        runs = data.arms.get(arm, {})
        if not runs:
            lines.append(f"| {arm} | (no finished run) | | | |")
            continue
        c = next(iter(runs.values()))
        r = c.config.get("retrofit", {})
        if arm == data.baseline:
            start, ramp = "the source's weights", "–"
        else:
            start = f"the source converted (negative queries: {r.get('second')})"
            ramp = f"0 → 1 over {r.get('warmup_steps')} steps ({r.get('ramp')})"
        params = c.marker.get("params")
        lines.append(f"| {arm} | {_model(c.config)} | {_fmt(params, '{:,}')} | {start} | {ramp} |")
    seeds = sorted({s for runs in data.arms.values() for s in runs})
    lines += ["", f"Seeds finished: {len(seeds)} of {study['seeds']} ({seeds})."]
    return lines


def _step0(data: StudyData) -> list[str]:
    lines = [
        "## Step 0",
        "",
        "The first record's training loss: the first batch of the continuation, before any "
        "update (the same batch and the same source weights for every arm of a seed).",
        "",
        "| arm | loss at step 0 (mean ± sd) | − unconverted, per seed | largest abs. difference |",
        "|---|---|---|---|",
    ]
    for arm in data.continuations:
        runs = data.arms.get(arm, {})
        firsts = [c.first_loss for c in runs.values()]
        if arm == data.baseline:
            lines.append(f"| {_name(data, arm)} | {fmt_mean_std(firsts, '{:.5f}')} | – | – |")
            continue
        diffs = _first_loss_differences(data, arm)
        per = ", ".join(f"{x:+.2e}" for x in diffs) or "n/a"
        big = _fmt(max(map(abs, diffs)) if diffs else None, "{:.2e}")
        lines.append(f"| {_name(data, arm)} | {fmt_mean_std(firsts, '{:.5f}')} | {per} | {big} |")
    return lines


def _first_loss_differences(data: StudyData, arm: str) -> list[float]:
    """Per seed (in seed order): ``arm``'s first training loss minus the unconverted
    continuation's, over the seeds both have."""
    firsts = (
        {s: c.first_loss for s, c in data.arms.get(name, {}).items()}
        for name in (arm, data.baseline)
    )
    _, a, b = pair_seeds(*firsts)
    return [x - y for x, y in zip(a, b)]


def _recovery(data: StudyData) -> tuple[list[str], dict[str, str]]:
    levels = source_levels(data)
    steps_total = data.plan["study"]["continue_steps"]
    lines = ["## Recovery of the source's loss", ""]
    if not levels:
        return lines + ["No source measured yet."], {}
    level = float(np.mean(list(levels.values())))
    own = [c.marker["probes"].get("own_val_loss") for c in data.arms.get("source", {}).values()]
    own_txt = (
        f" (its own evaluation at that checkpoint: {fmt_mean_std(own, '{:.4f}')})"
        if any(x is not None for x in own)
        else ""
    )
    lines += [
        f"The sources' validation loss, measured on the continuation's validation batches: "
        f"{fmt_mean_std(list(levels.values()), '{:.4f}')} over {len(levels)} seeds{own_txt}. An arm has "
        f"recovered at the first evaluation where its validation loss, mean over the seeds, is "
        f"at or below {level:.4f} (per seed: its own seed's source).",
        "",
        "| arm | recovered at (mean over seeds) | per seed | lowest mean validation loss |",
        "|---|---|---|---|",
    ]
    found = {}
    for arm in data.continuations:
        runs = data.arms.get(arm, {})
        steps, mean = step_mean(runs)
        at = recovery_step(steps, mean, level) if steps.size else None
        cell = f"step {at}" if at is not None else f"not within {steps_total} steps"
        found[arm] = cell
        per = []
        for s, c in sorted(runs.items()):
            if s in levels:
                r = recovery_step(c.curve.steps, c.curve.loss, levels[s])
                per.append(f"seed {s}: {r if r is not None else '—'}")
        low = _fmt(float(mean.min()) if mean.size else None)
        lines.append(f"| {_name(data, arm)} | {cell} | {', '.join(per) or 'n/a'} | {low} |")
    lines += ["", "(— : not at or below its source's loss at any evaluation.)"]
    return lines, found


def _final(
    data: StudyData, curves: dict[str, DifferenceCurve | None]
) -> tuple[list[str], dict[str, str]]:
    lines = [
        "## Final validation loss",
        "",
        "| arm | final validation loss (mean ± sd) | − unconverted (95% t-interval) | seeds |",
        "|---|---|---|---|",
    ]
    sentences = {}
    for arm in data.continuations:
        runs = data.arms.get(arm, {})
        finals = [c.final for c in runs.values()]
        if arm == data.baseline:
            lines.append(
                f"| {_name(data, arm)} | {fmt_mean_std(finals, '{:.4f}')} | – | {len(runs)} |"
            )
            continue
        curve = curves[arm]
        cross = crossover(curve) if curve is not None else None
        cell, n = (difference_cell(cross.final), cross.final.n) if cross else ("n/a", 0)
        lines.append(f"| {_name(data, arm)} | {fmt_mean_std(finals, '{:.4f}')} | {cell} | {n} |")
        if cross is not None:
            a, b = _name(data, arm), "the unconverted continuation"
            text = f"{describe_final(cross, a, b)} {describe_crossover(cross, a, b)}"
            sentences[arm] = text.replace("compare.seeds=2", "study.seeds=2")
    return lines, sentences


def _curve_table(data: StudyData, curves: dict[str, DifferenceCurve | None]) -> list[str]:
    arms = data.continuations
    means = {a: dict(zip(*[x.tolist() for x in step_mean(data.arms.get(a, {}))])) for a in arms}
    steps = sorted(set().union(*[set(m) for m in means.values()]))
    head = [
        "step",
        *[f"{a}" for a in arms],
        *[f"{a} − {data.baseline} [95%]" for a in data.converted],
    ]
    lines = [
        "## Validation loss over the continuation",
        "",
        "![retrofit](retrofit.png)",
        "",
        "Mean over seeds; the paired difference with its pointwise 95% Student-t band over the "
        "seeds (no band with one seed).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for t in steps:
        cells = [str(t), *[_fmt(means[a].get(t)) for a in arms]]
        for a in data.converted:
            c = curves[a]
            hit = np.flatnonzero(c.steps == t) if c is not None else []
            if not len(hit):
                cells.append("")
                continue
            i = int(hit[0])
            band = f" {band_cell(c, i)}" if c.n_seeds > 1 else ""
            cells.append(f"{_fmt(float(c.mean[i]), '{:+.4f}')}{band}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _retrieval(data: StudyData) -> list[str]:
    arms = ["source", *data.continuations]
    probes = {
        a: [c.marker.get("probes", {}).get("retrieval") for c in data.arms.get(a, {}).values()]
        for a in arms
    }
    sample = next((p for ps in probes.values() for p in ps if p), None)
    lines = ["## Retrieval", ""]
    if sample is None:
        return lines + ["Not probed (RETROFIT.retrieval=False, or no run finished)."]
    if "skipped" in sample:
        return lines + [f"Not probed: {sample['skipped']}."]
    needle, mqar = sample.get("needle"), sample.get("mqar")
    desc = []
    if needle:
        desc.append(
            f"needle: {needle['needles']} needles in corpus text, 1 query, {needle['seq_len']} "
            f"tokens, {needle['queries']} queries per model (no-retrieval chance "
            f"{_pct(needle['chance'])})"
        )
    elif sample.get("needle_skipped"):
        desc.append(f"needle: not probed ({sample['needle_skipped']})")
    if mqar:
        desc.append(
            f"MQAR: {mqar['pairs']} pairs, {mqar['asked']} queries, {mqar['seq_len']} tokens, "
            f"{mqar['queries']} queries per model (no-retrieval chance {_pct(mqar['chance'])}, "
            f"first query {_pct(mqar['chance_first'])})"
        )
    lines += [
        "Probes of each final model (the source: the checkpoint its continuations start from); "
        "a query is right when its whole answer is the greedy prediction. The models were "
        "trained on the corpus, never on these tasks: " + "; ".join(desc) + ".",
        "",
        "| model | needle accuracy | MQAR accuracy | MQAR first query |",
        "|---|---|---|---|",
    ]
    for a in arms:
        ps = [p for p in probes[a] if p]
        if not ps:
            continue
        nd = [p["needle"]["accuracy"] for p in ps if p.get("needle")]
        mq = [p["mqar"]["accuracy"] for p in ps if p.get("mqar")]
        mf = [p["mqar"]["first_accuracy"] for p in ps if p.get("mqar")]
        name = "source" if a == "source" else _name(data, a)
        lines.append(f"| {name} | {fmt_mean_std(nd)} | {fmt_mean_std(mq)} | {fmt_mean_std(mf)} |")
    lines += ["", "Mean ± sd over the seeds."]
    return lines


def _runs(data: StudyData) -> list[str]:
    lines = [
        "## Runs",
        "",
        "| run | steps | training (s) | probes (s) | resumed from |",
        "|---|---|---|---|---|",
    ]
    total = 0.0
    for run in data.plan["runs"]:
        c = data.arms.get(run["arm"], {}).get(run["seed"])
        if c is None:
            lines.append(f"| {run['name']} | (not finished) | | | |")
            continue
        m = c.marker
        total += m.get("train_s", 0.0) + m.get("probe_s", 0.0)
        steps = int(c.train_steps[-1]) if c.train_steps.size else 0
        lines.append(
            f"| {run['name']} | {steps} | {m.get('train_s', 0):.0f} | {m.get('probe_s', 0):.0f} "
            f"| {_fmt(m.get('resumed_from'), '{}')} |"
        )
    lines += [
        "",
        f"Wall time of the runs: {total:.0f} s ({total / 60:.1f} min; a resumed run counts its "
        f"last sitting only).",
    ]
    return lines


def render(data: StudyData) -> str:
    curves = {a: difference_curve(data, a) for a in data.converted}
    recovery, found = _recovery(data)
    final, sentences = _final(data, curves)
    summary = []
    for arm in data.converted:
        m, _, n = mean_std(_first_loss_differences(data, arm))
        step0 = (
            f"step-0 loss {m:+.2e} against the unconverted continuation "
            f"({'one seed' if n == 1 else f'mean of {n} seeds'})"
            if n
            else "no step-0 loss yet"
        )
        summary.append(
            f"- **{_name(data, arm)}**: {step0}; recovered the source's loss: "
            f"{found.get(arm, 'n/a')}. {sentences.get(arm, '')}"
        )
    if data.baseline in found:
        summary.append(
            f"- **{_name(data, data.baseline)}** recovered the source's loss: "
            f"{found[data.baseline]}."
        )
    title = storage.absolute(data.run_dir).name
    lines = [
        f"# Retrofit study: {title}",
        "",
        "A standard model, trained, then continued three ways on the same tokens in the same "
        "order from the same weights: unconverted, and converted to each DIFF kind "
        "(`train.retrofit=true`). Every number below is as measured.",
        "",
        "## Summary",
        "",
        *summary,
        "",
        *_setup(data),
        "",
        *_step0(data),
        "",
        *recovery,
        "",
        *final,
        "",
        *_curve_table(data, curves),
        "",
        *_retrieval(data),
        "",
        *_runs(data),
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the plot
def figure(data: StudyData) -> Figure:
    """``retrofit.png``: the validation loss of every arm (mean over seeds, thin: each seed)
    with the sources' level; the smoothed training loss; and the paired differences with their
    bands."""
    fig = Figure(figsize=(15, 4.2))
    FigureCanvasAgg(fig)
    ax_val, ax_train, ax_diff = fig.subplots(1, 3)
    levels = source_levels(data)
    colors = {a: f"C{i}" for i, a in enumerate(data.continuations)}
    for arm in data.continuations:
        runs = data.arms.get(arm, {})
        color, name = colors[arm], _name(data, arm)
        curves = [(c.curve.steps, c.curve.loss) for c in runs.values() if c.curve.loss.size]
        draw_seed_curves(ax_val, curves, color, name, marker="o")
        trains = [c for c in runs.values() if c.train.size]
        if trains:
            n = min(c.train.size for c in trains)
            loss = np.mean([c.train[:n] for c in trains], axis=0)
            k = max(1, n // 50)
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax_train.plot(trains[0].train_steps[k - 1 : n], smooth, color=color, lw=1.6, label=name)
    if levels:
        level = float(np.mean(list(levels.values())))
        for ax in (ax_val, ax_train):
            ax.axhline(level, color="k", ls="--", lw=1, label="the sources' validation loss")
    for arm in data.converted:
        b = difference_curve(data, arm)
        if b is None:
            continue
        label = f"{_name(data, arm)} − unconverted ({_seeds(b.n_seeds)})"
        draw_band(ax_diff, b.steps, b, colors[arm], label)
    ax_diff.axhline(0.0, color="k", lw=0.8)
    ramps = {
        c.config.get("retrofit", {}).get("warmup_steps")
        for arm in data.converted
        for c in data.arms.get(arm, {}).values()
    }
    for w in sorted(r for r in ramps if r and r < data.plan["study"]["continue_steps"]):
        for ax in (ax_train, ax_diff):
            ax.axvline(w, color="0.5", ls=":", lw=1)
        ax_diff.annotate(
            "w = 1",
            (w, 1),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            ha="left",
            va="top",
            color="0.4",
        )
    titles = (
        (ax_val, "validation loss (mean over seeds; thin: each seed)", "loss (nats/token)"),
        (ax_train, "training loss (mean over seeds, smoothed)", "loss (nats/token)"),
        (ax_diff, "paired difference, 95% band over seeds", "Δ validation loss"),
    )
    for ax, title, ylabel in titles:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("continuation step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"retrofit study: {storage.absolute(data.run_dir).name}")
    fig.tight_layout()
    return fig


def write_study_report(run_dir: str) -> str:
    """Write ``retrofit.md`` and ``retrofit.png`` in ``run_dir``; returns the markdown."""
    data = read_study(run_dir)
    text = render(data)
    storage.write_text(storage.join(run_dir, "retrofit.md"), text)
    storage.save_figure(figure(data), storage.join(run_dir, "retrofit.png"), dpi=110)
    return text
