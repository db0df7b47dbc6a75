"""The lm-eval section of ``eval.md`` (``## LM Eval Harness tasks``) from ``RUN_DIR/lm_eval.json``:
per task and metric the seeds' mean ± sd of each model, the paired DIFF - twin difference with its
95% t-interval, and the paper's number where the paper gives one. Pure: reads JSON, imports no
lm-eval (:mod:`.lm_eval_run` runs the tasks and writes the JSON)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from diffjax.infra import storage

from diffjax.evaluate.results import model_name
from diffjax.evaluate.stats import (
    describe_difference,
    difference_cell,
    fmt_mean_std,
    group_by_label,
    minus,
    paired_by_seed,
    paired_difference,
    twin_name,
    twins_of,
)

__all__ = [
    "HEADING",
    "PAPER_SCALE",
    "PAPER_TASKS",
    "higher_is_better",
    "main_metrics",
    "read_results",
    "render_section",
    "replace_section",
]

HEADING = "## LM Eval Harness tasks"

# The paper's models behind PAPER_TASKS: DIFF V1 and its Transformer baseline at 3B parameters.
PAPER_SCALE = "3B"

# The paper's LM Eval Harness numbers (Ye et al., "Differential Transformer", Table 1 and its
# appendix: ARC-C, ARC-E, BoolQ, HellaSwag, OBQA, PIQA, WinoGrande, zero-shot accuracy of the
# 3B-size models): (lm-eval task, metric key) -> (Transformer, DIFF), fractions in [0, 1].
# Only numbers stated in shared/reference/diff-transformer.md (the summary of the paper this
# project builds on) belong here; that page gives none of these tasks' numbers, so the dict is
# empty and the table's paper columns stay blank. An entry, e.g.
# ("arc_easy", "acc,none"): (T, DIFF), shows on that task's row for that metric.
PAPER_TASKS: dict[tuple[str, str], tuple[float | None, float | None]] = {}


# ---------------------------------------------------------------------------- results
def main_metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric key: value}}`` of ``simple_evaluate``'s output: every numeric
    ``"metric,filter"`` entry (``acc,none``, ``acc_norm,none``, ``word_perplexity,none``,
    ``exact_match,strict-match``, ...) but the standard errors; groups and subtasks alike."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            if "," not in key or key.split(",")[0].endswith("_stderr"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = float(value)
        if row:
            out[task] = row
    return out


def higher_is_better(results: dict[str, Any]) -> dict[str, dict[str, bool]]:
    return {
        task: {k: bool(v) for k, v in hib.items() if v is not None}
        for task, hib in results.get("higher_is_better", {}).items()
    }


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}" if abs(x) < 1000 else f"{x:,.1f}"


def _spec(values: Sequence[float]) -> str:
    """Three decimals, or one for large values (perplexities)."""
    big = any(v is not None and math.isfinite(v) and abs(v) >= 1000 for v in values)
    return "{:,.1f}" if big else "{:.3f}"


def render_section(
    data: dict[str, Any], paper: dict[tuple[str, str], tuple] | None = None
) -> list[str]:
    """The lines of ``eval.md``'s lm-eval section from ``lm_eval.json``'s content."""
    paper = PAPER_TASKS if paper is None else paper
    models = data["models"]
    groups = group_by_label(models)
    labels, twins = list(groups), twins_of(groups)
    limit, shots = data.get("limit"), data.get("num_fewshot")
    L = [HEADING, ""]
    L += [
        f"lm-eval {data.get('lm_eval_version', '?')} (`python -m diffjax.evaluate lm_eval.tasks=...`) on "
        f"every model of the run, the best checkpoint of each; tasks: "
        f"{', '.join(f'`{t}`' for t in data['tasks'])}; "
        + (f"at most {limit} examples per task" if limit is not None else "every example")
        + "; "
        + (f"{shots}-shot" if shots is not None else "each task's own number of shots")
        + f". A cell is the mean ± sd over seeds (n: {', '.join(f'{lab} {len(groups[lab])}' for lab in labels)})"
        + (
            f"; {', '.join(minus(t) for t in twins)}: the mean of the per-seed differences "
            "(seed s of both models shares its init seed and data order) with its 95% t-interval."
            if twins
            else "."
        ),
        "",
        f"The paper's columns are its {PAPER_SCALE}-size Transformer and DIFF models, trained "
        f"on hundreds of billions of tokens: far beyond a small run, so they show the paper's "
        f"scale, not a target. They are filled only where the paper's numbers are recorded "
        f"(diffjax.evaluate.lm_tasks.PAPER_TASKS)"
        + ("; none is recorded for these tasks." if not paper else "."),
        "",
    ]
    keys = sorted({(t, m) for r in models for t, ms in r["metrics"].items() for m in ms})
    hib = data.get("higher_is_better", {})
    header = ["task", "metric"] + [model_name(lab, groups[lab]) for lab in labels]
    header += [f"{minus(t)} [95% t-interval]" for t in twins]
    header += [f"paper Transformer-{PAPER_SCALE}", f"paper DIFF-{PAPER_SCALE}"]
    rows, lines = [], []
    for task, metric in keys:
        values = {
            lab: [r["metrics"].get(task, {}).get(metric) for r in groups[lab]] for lab in labels
        }
        spec = _spec([v for vs in values.values() for v in vs if v is not None])
        name, _, filt = metric.partition(",")
        better = hib.get(task, {}).get(name)
        shown = name + ("" if filt in ("", "none") else f" ({filt})")
        shown += "" if better is None else (" ↑" if better else " ↓")
        row = [f"`{task}`", shown] + [fmt_mean_std(values[lab], spec) for lab in labels]
        sign = "{:+,.1f}" if spec == "{:,.1f}" else "{:+.3f}"
        for t in twins:
            a, b = paired_by_seed(groups, lambda r: r["metrics"].get(task, {}).get(metric), b=t)
            d = paired_difference(a, b)
            row.append(difference_cell(d, sign) if a else "")
            if a:
                what = f"{task} {shown}"
                lines.append(f"- {describe_difference(d, what, b=twin_name(t), spec=sign)}")
        t_paper, d_paper = paper.get((task, metric), (None, None))
        rows.append(row + [_fmt(t_paper), _fmt(d_paper)])
    L += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    L += ["| " + " | ".join(r) + " |" for r in rows]
    L += [""] + lines + ([""] if lines else [])
    L += [
        "Per model and seed: `lm_eval.json`. ↑ / ↓: lm-eval's higher-is-better for the metric.",
        "",
    ]
    return L


def replace_section(text: str, section: str) -> str:
    """``text`` (an ``eval.md``) with ``section`` in place of its earlier lm-eval section (from
    :data:`HEADING` to the next ``## `` heading or the end), or appended."""
    lines = text.splitlines()
    start = next((i for i, x in enumerate(lines) if x.strip() == HEADING), None)
    if start is None:
        body = text.rstrip("\n")
        return (body + "\n\n" if body else "") + section.rstrip("\n") + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    before = "\n".join(lines[:start]).rstrip("\n")
    after = "\n".join(lines[end:]).strip("\n")
    out = (before + "\n\n" if before else "") + section.rstrip("\n") + "\n"
    return out + ("\n" + after + "\n" if after else "")


def read_results(run_dir: str) -> dict[str, Any] | None:
    """``RUN_DIR/lm_eval.json`` (what :func:`.lm_eval_run.evaluate_run_tasks` wrote), or None;
    local or ``gs://``."""
    path = storage.join(run_dir, "lm_eval.json")
    return storage.read_json(path) if storage.exists(path) else None
