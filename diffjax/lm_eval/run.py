"""``python -m diffjax.lm_eval --run RUN_DIR --tasks t1,t2``: lm-eval tasks on every model of a
``train.py`` run (DIFF and its twin, each seed), the seeds' mean ± sd, the paired DIFF - twin
difference with its 95% t-interval, and the paper's number where the paper gives one.

:func:`evaluate_run_tasks` finds the models with :func:`diffjax.evaluate.run.discover_models`,
runs ``lm_eval.simple_evaluate`` on each (the best checkpoint, through :class:`DiffJaxLM`),
writes ``RUN_DIR/lm_eval.json`` and puts its section (``## LM Eval Harness tasks``) into
``RUN_DIR/eval.md``: appended, or in place of the section an earlier call wrote."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Sequence

import lm_eval
from lm_eval.tasks import TaskManager

from diffjax.config import ConfigError
from diffjax.evaluate.results import model_name
from diffjax.evaluate.run import ModelEntry, discover_models
from diffjax.evaluate.stats import (
    describe_difference,
    fmt_mean_std,
    group_by_label,
    paired_difference,
)

from .model import DEFAULT_BATCH_SIZE, DiffJaxLM

__all__ = [
    "HEADING",
    "PAPER_SCALE",
    "PAPER_TASKS",
    "check_tasks",
    "evaluate_run_tasks",
    "main_metrics",
    "render_section",
    "run_models",
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


# ---------------------------------------------------------------------------- input checks
def run_models(run_dir: str) -> list[ModelEntry]:
    """The models of ``run_dir`` (:func:`discover_models`, the default seed from its
    ``config.json``), or a :class:`ConfigError` when it holds none."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise ConfigError(
            f"run directory {run_dir} does not exist. Fix: pass the folder train.py wrote "
            f"(e.g. runs/default)"
        )
    seed = 0
    cfg_file = os.path.join(run_dir, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cfg = json.load(f)
        seed = int(cfg.get("train", {}).get("seed", 0)) if isinstance(cfg, dict) else 0
    entries = discover_models(run_dir, default_seed=seed)
    if not entries:
        raise ConfigError(
            f"{run_dir} holds no model with a committed checkpoint (looked for "
            f"*/checkpoints/<step>). Fix: train first (python train.py), or pass the run's "
            f"own folder"
        )
    return entries


def check_tasks(tasks: Sequence[str], manager: TaskManager) -> list[str]:
    """The task names (globs allowed, as lm-eval's command line takes them), or a
    :class:`ConfigError` naming those lm-eval does not know."""
    tasks = [t.strip() for t in tasks if t and t.strip()]
    if not tasks:
        raise ConfigError("no task given. Fix: --tasks t1,t2 (lm-eval task names)")
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise ConfigError(
            f"unknown lm-eval task(s): {', '.join(missing)}. Fix: check the names "
            f"(python -m diffjax.lm_eval ls tasks lists them), or pass --include_path with "
            f"the folder of your task YAML files"
        )
    return tasks


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


def _higher_is_better(results: dict[str, Any]) -> dict[str, dict[str, bool]]:
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
    labels = list(groups)
    paired = "diff" in groups and "standard" in groups
    limit, shots = data.get("limit"), data.get("num_fewshot")
    L = [HEADING, ""]
    L += [
        f"lm-eval {data.get('lm_eval_version', '?')} (`python -m diffjax.lm_eval --run`) on "
        f"every model of the run, the best checkpoint of each; tasks: "
        f"{', '.join(f'`{t}`' for t in data['tasks'])}; "
        + (f"at most {limit} examples per task" if limit is not None else "every example")
        + "; "
        + (f"{shots}-shot" if shots is not None else "each task's own number of shots")
        + f". A cell is the mean ± sd over seeds (n: {', '.join(f'{lab} {len(groups[lab])}' for lab in labels)})"
        + (
            "; DIFF − twin is the mean of the per-seed differences (seed s of both models "
            "shares its init seed and data order) with its 95% t-interval."
            if paired
            else "."
        ),
        "",
        f"The paper's columns are its {PAPER_SCALE}-size Transformer and DIFF models, trained "
        f"on hundreds of billions of tokens: far beyond a small run, so they show the paper's "
        f"scale, not a target. They are filled only where the paper's numbers are recorded "
        f"(diffjax.lm_eval.run.PAPER_TASKS)"
        + ("; none is recorded for these tasks." if not paper else "."),
        "",
    ]
    keys = sorted({(t, m) for r in models for t, ms in r["metrics"].items() for m in ms})
    hib = data.get("higher_is_better", {})
    header = ["task", "metric"] + [model_name(lab, groups[lab]) for lab in labels]
    if paired:
        header.append("DIFF − twin [95% t-interval]")
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
        if paired:
            a = {r["seed"]: r["metrics"].get(task, {}).get(metric) for r in groups["diff"]}
            b = {r["seed"]: r["metrics"].get(task, {}).get(metric) for r in groups["standard"]}
            seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
            if seeds:
                d = paired_difference([a[s] for s in seeds], [b[s] for s in seeds])
                sign = "{:+,.1f}" if spec == "{:,.1f}" else "{:+.3f}"
                cell = sign.format(d.mean)
                if d.low is not None:
                    cell += f" [{sign.format(d.low)}, {sign.format(d.high)}]"
                elif d.no_spread:
                    cell += " (no spread)"
                row.append(cell)
                lines.append(f"- {describe_difference(d, f'{task} {shown}', spec=sign)}")
            else:
                row.append("")
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


# ---------------------------------------------------------------------------- the run
def evaluate_run_tasks(
    run_dir: str,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    include_defaults: bool = True,
    limit: int | float | None = None,
    batch_size: int | str | None = DEFAULT_BATCH_SIZE,
    num_fewshot: int | None = None,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on every model of a ``train.py`` run; write
    ``RUN_DIR/lm_eval.json`` and the section ``## LM Eval Harness tasks`` of
    ``RUN_DIR/eval.md`` (appended, or in place of an earlier one); return the JSON's content.

    ``include_path``: a folder of task YAML files besides lm-eval's own (``include_defaults``
    False: only those, which skips indexing lm-eval's ~15,000 task files). ``limit``: at most
    that many examples per task (a float below 1: that fraction). Bad input (no model in the
    run, an unknown task) raises :class:`ConfigError` before any model is loaded."""
    run_dir = os.path.abspath(run_dir)
    entries = run_models(run_dir)
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    tasks = check_tasks(tasks, manager)
    models, hib = [], {}
    for e in entries:
        log(f"lm-eval {','.join(tasks)}: {e.label} (seed {e.seed}) from {e.path}")
        t0 = time.perf_counter()
        # the model's own folder: RUN/<label>/seed_<n>/, RUN/<label>/ or the run folder itself
        lm = DiffJaxLM(path=e.path, model=e.label, seed=e.seed, batch_size=batch_size)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
        )
        metrics = main_metrics(out)
        for task, h in _higher_is_better(out).items():
            hib.setdefault(task, {}).update(h)
        models.append(
            {
                "label": e.label,
                "seed": e.seed,
                "path": os.path.relpath(e.path, run_dir),
                "attention": lm.model.config.attention,
                "metrics": metrics,
                "n_samples": {
                    t: v.get("effective", v.get("original"))
                    for t, v in out.get("n-samples", {}).items()
                },
            }
        )
        log(
            f"    {'; '.join(f'{t} {k} {v:.4g}' for t, ms in metrics.items() for k, v in ms.items())}"
            f" ({time.perf_counter() - t0:.1f}s)"
        )
    data = {
        "lm_eval_version": getattr(lm_eval, "__version__", "?"),
        "tasks": list(tasks),
        "include_path": include_path,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "higher_is_better": hib,
        "models": models,
        "paper": {
            "scale": PAPER_SCALE,
            "tasks": [
                {"task": t, "metric": m, "transformer": v[0], "diff": v[1]}
                for (t, m), v in PAPER_TASKS.items()
            ],
        },
    }
    json_path = os.path.join(run_dir, "lm_eval.json")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    md_path = os.path.join(run_dir, "eval.md")
    old = ""
    if os.path.isfile(md_path):
        with open(md_path) as f:
            old = f.read()
    with open(md_path, "w") as f:
        f.write(replace_section(old, "\n".join(render_section(data))))
    log(f"lm-eval: {json_path}, section {HEADING!r} of {md_path}")
    return data
