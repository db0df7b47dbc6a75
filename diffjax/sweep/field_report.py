"""The report of a sweep over one setting (``Ladder(field=..., values=...)``): ``sweep.md`` and
``sweep_field.png`` in the run directory, rebuilt at any time from what the rungs wrote (each
comparison's ``config.json``, ``<label>/seed_<s>/result.json`` and ``metrics.jsonl``).

Every model of every arm is one family of runs over the rungs. A DIFF model is paired with its
arm's twin, or with another arm's twin when that is its twin (the same config), so DIFF V1 and
DIFF V2 can share one twin. Per rung: the final validation loss (every seed; a rung whose final
loss is not finite or not below the loss at initialisation counts as diverged), the largest
attention logit and output logit over the run (``train.diagnostics``) and the updates skipped
as spikes (``train.skip_spikes``). For ``train.lr``, each family's learning-rate sensitivity
(:mod:`diffjax.sweep.sensitivity`) with a paired bootstrap interval over seeds, and DIFF − twin.

Drawn on explicit :class:`matplotlib.figure.Figure` objects with the Agg canvas (no pyplot).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from diffjax.infra import storage
from diffjax.config import ModelConfig
from diffjax.compare.config import TWINS, saved_models, twin_models
from diffjax.compare.plots import draw_points_and_mean
from diffjax.evaluate.stats import fmt_mean_std, twin_name
from diffjax.train.metrics import read_metrics

from diffjax.sweep.ladder import rung_name
from diffjax.sweep.sensitivity import Estimate, bootstrap, lr_sensitivity

FIGURE = "sweep_field.png"
NAN = float("nan")


@dataclasses.dataclass
class Family:
    """One model over the rungs: ``{value: {seed: x}}`` per measure, and ``{seed: loss}`` at
    initialisation (the first step's training loss, before any update)."""

    key: str  # "<arm>/<label>"
    name: str
    config: ModelConfig
    final: dict = dataclasses.field(default_factory=dict)
    initial: dict = dataclasses.field(default_factory=dict)
    logit_max: dict = dataclasses.field(default_factory=dict)
    output_max: dict = dataclasses.field(default_factory=dict)
    skipped: dict = dataclasses.field(default_factory=dict)
    folders: dict = dataclasses.field(default_factory=dict)  # {value: the model's folder}
    # a DIFF model's twins, trained or not: {twin name: config} (diffjax.compare.twin_models)
    twins: dict = dataclasses.field(default_factory=dict)

    @property
    def is_diff(self) -> bool:
        return self.config.attention != "standard"

    def seeds(self, values) -> list[int]:
        """The seeds finished at every one of ``values``."""
        sets = [set(self.final.get(v, {})) for v in values]
        return sorted(set.intersection(*sets)) if sets else []

    def diverged(self, value, seed) -> bool:
        loss, start = self.final.get(value, {}).get(seed, NAN), self.initial.get(seed, NAN)
        return not math.isfinite(loss) or (math.isfinite(start) and loss >= start)


def _largest(x) -> float:
    try:
        return float(np.max(np.asarray(x, float)))
    except (TypeError, ValueError):
        return NAN


def _read_seed(family: Family, value, seed: int, folder: str) -> None:
    result = storage.read_json(storage.join(folder, "result.json"))
    loss = result.get("final_val_loss")
    family.final.setdefault(value, {})[seed] = float(loss) if loss is not None else NAN
    family.skipped.setdefault(value, {})[seed] = result.get("spikes_skipped")
    records = read_metrics(storage.join(folder, "metrics.jsonl"))
    if records and records[0].get("step") == 1:
        family.initial.setdefault(seed, float(records[0]["loss"]))
    logits = [_largest(r["logit_max"]) for r in records if "logit_max" in r]
    outputs = [float(r["output_logit_max"]) for r in records if "output_logit_max" in r]
    family.logit_max.setdefault(value, {})[seed] = max(logits, default=NAN)
    family.output_max.setdefault(value, {})[seed] = max(outputs, default=NAN)


def _name(config: ModelConfig, label: str, arm: str) -> str:
    kind = {"diff_v1": "DIFF V1", "diff_v2": "DIFF V2"}.get(config.attention)
    kind = kind or twin_name(label).removeprefix("the ")
    return f"{kind} ({arm})" if arm else kind


def run_folder(run_dir: str, plan: dict, run: dict) -> str:
    """The folder of one comparison of the plan (an entry of ``plan["sizes"]``) inside
    ``run_dir``, wherever the run directory now is: ``<rung>/<arm>/`` in a sweep over a field,
    ``<arm>/`` when the ladder has arms only (no field: one rung, the base config)."""
    field = plan["ladder"].get("field")
    rung = [rung_name(field, run["value"])] if field is not None else []
    return storage.join(run_dir, *rung, *([run["arm"]] if run["arm"] else []))


def families(run_dir: str, plan: dict) -> list[Family]:
    """Every model of the plan's comparisons over the rungs (a sweep over a field, or arms
    only: one rung, value None); a twin that another arm already trained with the same config
    is that arm's family (its runs are the same runs)."""
    out: dict[str, Family] = {}
    for run in plan["sizes"]:
        folder = run_folder(run_dir, plan, run)
        path = storage.join(folder, "config.json")
        if not storage.exists(path):
            continue
        model, compare = saved_models(storage.read_json(path))
        twins = twin_models(model, compare)
        for label, config in {"diff": model, **twins}.items():
            key = f"{run['arm']}/{label}"
            base = storage.join(folder, label)
            if not storage.isdir(base):
                continue
            family = out.get(key)
            if family is None:
                same = [f for f in out.values() if label != "diff" and f.config == config]
                if same:  # another arm's twin: the same model, already read
                    continue
                family = out[key] = Family(key, _name(config, label, run["arm"]), config)
                family.twins = twins if label == "diff" else {}
            family.folders[run["value"]] = base
            for entry in sorted(p.name for p in storage.path(base).iterdir()):
                seed_dir = storage.join(base, entry)
                if entry.startswith("seed_") and storage.exists(
                    storage.join(seed_dir, "result.json")
                ):
                    _read_seed(family, run["value"], int(entry[len("seed_") :]), seed_dir)
    # a twin read from one arm only: name it plainly when every DIFF model shares it
    for label in TWINS:
        read = [f for f in out.values() if f.key.endswith(f"/{label}")]
        if len(read) == 1:
            read[0].name = _name(read[0].config, label, "")
    return list(out.values())


def pairs(
    fams: list[Family], twins: Mapping[str, str] | None = None
) -> list[tuple[Family, Family]]:
    """Each DIFF family with each of its twins (``compare.twins`` and every other twin the
    runs trained): its arm's, else the arm ``twins`` names for it (the ladder's), else another
    arm's of the same config."""
    out = []
    for f in (f for f in fams if f.is_diff):
        arm = f.key.split("/")[0]
        for label, want in f.twins.items():
            keys = (f"{arm}/{label}", f"{(twins or {}).get(arm)}/{label}")
            found = [t for k in keys for t in fams if not t.is_diff and t.key == k]
            found += [t for t in fams if not t.is_diff and t.config == want]
            if found:
                out.append((f, found[0]))
    return out


def sensitivity(
    pair: tuple[Family, Family], values, resamples: int = 10_000
) -> tuple[dict[str, Estimate], list[int]]:
    """The pair's learning-rate sensitivities and DIFF − twin, each with its paired bootstrap
    interval over the seeds both finished at every rung."""
    diff, tw = pair
    seeds = sorted(set(diff.seeds(values)) & set(tw.seeds(values)))
    per = {}
    for f, name in ((diff, "diff"), (tw, "twin")):
        per[name] = [lr_sensitivity([f.final[v][s] for v in values], f.initial[s]) for s in seeds]
    per["diff - twin"] = [a - b for a, b in zip(per["diff"], per["twin"])]
    return (bootstrap(per, resamples) if seeds else {}), seeds


def _best(f: Family, values) -> Any:
    """The rung with the lowest mean final loss over its finite seeds."""

    def mean(v):
        xs = [x for x in f.final.get(v, {}).values() if math.isfinite(x)]
        return float(np.mean(xs)) if xs else math.inf

    return min(values, key=mean)


def _cell(xs: list[float], spec: str = "{:.4f}") -> str:
    return fmt_mean_std(xs, spec, none_finite="not finite", note_missing=True)


def _value_text(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _summary(sens_rows, done: list[Family], values: list) -> list[str]:
    """The summary: each pair's learning-rate sensitivity with its verdict, the best rung per model."""
    lines: list[str] = []
    lines += ["## Summary", ""]
    for (diff, tw), est, seeds in sens_rows:
        d = est["diff - twin"]
        verdict = (
            "no difference this sweep can resolve"
            if d.low is None or d.low <= 0 <= d.high
            else ("DIFF less sensitive" if d.high < 0 else "DIFF more sensitive")
        )
        lines.append(
            f"- {diff.name} against {tw.name}: learning-rate sensitivity {est['diff'].cell()} "
            f"against {est['twin'].cell()}; DIFF − {tw.name} {d.cell('{:+.4f}')} over {len(seeds)} "
            f"paired seeds ({verdict})."
        )
    lines.append(
        "- best rung per model: "
        + ", ".join(f"{f.name} {_value_text(_best(f, values))}" for f in done)
        + "."
    )
    return lines


def _final_losses(field: str, values: list, done: list[Family]) -> list[str]:
    """The final validation loss per rung and model (mean ± sd over seeds, divergences) and the figure."""
    lines: list[str] = []
    lines += ["", f"## Final validation loss against `{field}`", ""]
    lines += ["| " + field + " | " + " | ".join(f.name for f in done) + " |"]
    lines += ["|---:|" + "---:|" * len(done)]
    for v in values:
        cells = []
        for f in done:
            xs = list(f.final.get(v, {}).values())
            div = sum(f.diverged(v, s) for s in f.final.get(v, {}))
            cells.append(_cell(xs) + (f" ({div} of {len(xs)} diverged)" if div else ""))
        lines.append(f"| {_value_text(v)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mean ± sd over seeds. Diverged: the final loss is not finite or not below the loss at "
        "initialisation.",
        "",
        f"![final loss, attention and output logits, spikes against {field}]({FIGURE})",
        "",
    ]
    return lines


def _sensitivity(sens_rows) -> list[str]:
    """The learning-rate sensitivity table (empty unless the ladder is over train.lr)."""
    lines: list[str] = []
    if sens_rows:
        lines += [
            "## Learning-rate sensitivity",
            "",
            "Wortsman et al. 2023: the mean over rungs of min(final loss, loss at "
            "initialisation) minus the best rung's (lower: more robust), per seed, then the "
            "mean over seeds with a paired percentile bootstrap interval (95%, seeds resampled "
            "together for both models; with 2 seeds it takes only 3 values).",
            "",
            "| DIFF | twin | seeds | DIFF | twin | DIFF − twin |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for (diff, tw), est, seeds in sens_rows:
            lines.append(
                f"| {diff.name} | {tw.name} | {len(seeds)} | {est['diff'].cell()} | "
                f"{est['twin'].cell()} | {est['diff - twin'].cell('{:+.4f}')} |"
            )
        lines.append("")
    return lines


def _inside_the_runs(field: str, values: list, done: list[Family]) -> list[str]:
    """Per rung and model: the largest attention and output logits, spikes skipped, divergences."""
    lines: list[str] = []
    lines += [
        "## Inside the runs",
        "",
        "Per rung and model: the largest attention logit and the largest output logit "
        "magnitude over the whole run (mean over seeds; `train.diagnostics`), the updates "
        "skipped as spikes (summed over seeds; `train.skip_spikes`) and the seeds that diverged.",
        "",
        "| "
        + field
        + " | model | largest attention logit | largest output logit | spikes skipped | diverged |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for v in values:
        for f in done:
            seeds = sorted(f.final.get(v, {}))
            if not seeds:
                continue
            skipped = [f.skipped[v][s] for s in seeds]
            skip = "off" if all(x is None for x in skipped) else str(sum(x or 0 for x in skipped))
            lines.append(
                f"| {_value_text(v)} | {f.name} | {_cell([f.logit_max[v][s] for s in seeds], '{:.3g}')} | "
                f"{_cell([f.output_max[v][s] for s in seeds], '{:.3g}')} | {skip} | "
                f"{sum(f.diverged(v, s) for s in seeds)} of {len(seeds)} |"
            )
    return lines


def sweep_field_markdown(plan: dict, fams: list[Family], resamples: int = 10_000) -> str:
    ladder = plan["ladder"]
    field, values = ladder["field"], list(ladder["values"])
    steps = {r["steps"] for r in plan["sizes"]}
    tokens = {r["tokens"] for r in plan["sizes"]}
    lines = [
        f"# Sweep over `{field}`",
        "",
        f"Config `{plan['config']}`: {len(values)} rungs ({', '.join(map(_value_text, values))}), "
        f"{', '.join(map(str, sorted(steps)))} steps and {', '.join(f'{t:,}' for t in sorted(tokens))} "
        f"tokens per run; arms: {', '.join(ladder.get('arms') or ['one comparison'])}.",
        "",
    ]
    done = [f for f in fams if f.final]
    if not done:
        return "\n".join(lines + ["Nothing has finished yet."]) + "\n"
    sens_rows = []
    if field == "train.lr":
        for pair in pairs(done):
            est, seeds = sensitivity(pair, values, resamples)
            if est:
                sens_rows.append((pair, est, seeds))
    lines += _summary(sens_rows, done, values)
    lines += _final_losses(field, values, done)
    lines += _sensitivity(sens_rows)
    lines += _inside_the_runs(field, values, done)
    return "\n".join(lines) + "\n"


def field_figure(plan: dict, fams: list[Family]) -> Figure:
    """Final loss, the largest attention logit, the largest output logit and the spikes skipped
    against the field's value: every seed a point, the mean over seeds a line."""
    field, values = plan["ladder"]["field"], list(plan["ladder"]["values"])
    numeric = all(isinstance(v, (int, float)) for v in values)
    xs = np.asarray(values, float) if numeric else np.arange(len(values), dtype=float)
    fig = Figure(figsize=(11, 7.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    panels = [
        ("final", "final validation loss"),
        ("logit_max", "largest attention logit over the run"),
        ("output_max", "largest output logit |z| over the run"),
        ("skipped", "updates skipped as spikes"),
    ]
    for ax, (attr, title) in zip(axes, panels):
        for i, f in enumerate(f for f in fams if f.final):
            per_value = getattr(f, attr)
            ys = [
                [np.nan if y is None else float(y) for y in per_value.get(v, {}).values()]
                for v in values
            ]
            draw_points_and_mean(ax, xs, ys, f"C{i}", f.name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(field)
        if numeric and np.all(xs > 0) and xs.max() / xs.min() > 20:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(xs, [str(v) for v in values])
        finite = [
            y for line in ax.get_lines() for y in line.get_ydata() if np.isfinite(y) and y > 0
        ]
        if attr == "logit_max" and finite and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # logits grow by orders of magnitude with the learning rate
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_field_report(run_dir: str, plan: dict, resamples: int = 10_000) -> str:
    """Write ``sweep.md`` and ``sweep_field.png`` into ``run_dir``; return the markdown."""
    fams = families(run_dir, plan)
    text = sweep_field_markdown(plan, fams, resamples)
    if any(f.final for f in fams):
        storage.save_figure(field_figure(plan, fams), storage.join(run_dir, FIGURE), dpi=100)
    storage.write_text(storage.join(run_dir, "sweep.md"), text)
    return text
