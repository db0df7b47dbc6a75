"""``eval.md``: the header, each analysis's section in the registry's order
(:data:`diffjax.evaluate.analyses.ANALYSES`: each section, its table, caption and figure, lives
in its analysis's module; the paper's numbers beside ours from :mod:`.paper`), the footer and the
lm-eval section. What each analysis measures is in docs/evaluation.md, which the captions
name."""

from __future__ import annotations

from typing import Callable, Sequence

from diffjax.infra import storage
from diffjax.data import DataConfig

from diffjax.evaluate import lm_tasks, paper
from diffjax.evaluate import analyses as registry
from diffjax.evaluate.analysis import DOC, Analysis, ModelResult, Run
from diffjax.evaluate.settings import EvalSettings
from diffjax.evaluate.stats import fmt_mean_std, group_by_label


def best_checkpoints(rs: Sequence[ModelResult | dict]) -> str:
    """Which checkpoint each seed was evaluated from, e.g. ``"best checkpoints: seed 0 step 200,
    seed 1 step 150"`` (``"best checkpoint: step 200"`` for one seed)."""
    rs = [_entry(r) for r in rs]
    if len(rs) == 1:
        return f"best checkpoint: step {rs[0]['step']}"
    return "best checkpoints: " + ", ".join(f"seed {r['seed']} step {r['step']}" for r in rs)


def _entry(r: ModelResult | dict) -> dict:
    return r.entry if isinstance(r, ModelResult) else r


def _tokens(rs: Sequence[ModelResult | dict]) -> str:
    """The training tokens up to each seed's checkpoint: one number when they agree."""
    tokens = [_entry(r)["tokens"] for r in rs]
    if len(set(tokens)) == 1:
        return f"{tokens[0]:,}"
    return fmt_mean_std(tokens, "{:,.0f}")


# ---------------------------------------------------------------------------- sections
def header(run: Run) -> list[str]:
    s, data = run.settings, run.data
    scale = "; ".join(
        f"{lab}: {rs[0].attention}, {rs[0].entry['params']:,} parameters, "
        f"{_tokens(rs)} training tokens ({best_checkpoints(rs)}), seeds {[r.seed for r in rs]}"
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


def footer(run: Run) -> list[str]:
    L = []
    lam = [(r.label, r.seed, r.entry["lambda"]) for r in run.models if r.entry.get("lambda")]
    if lam:
        L += [
            "DIFF V1 λ per layer: "
            + "; ".join(f"{lab} seed {s}: " + ", ".join(f"{x:.3f}" for x in v) for lab, s, v in lam)
            + ".",
            "",
        ]
    seeds = sorted({r.seed for r in run.models})
    L += [
        f"Seeds: {seeds}. Numbers: eval.json. Written by `python -m diffjax.evaluate"
        f"{' --quick' if run.settings.quick else ''}`.",
        "",
    ]
    return L


def lm_eval_tasks(run: Run) -> list[str]:
    """The lm-eval section from ``lm_eval.json``, where an earlier
    ``python -m diffjax.evaluate RUN_DIR lm_eval.tasks=...`` wrote one (kept when the analyses rerun)."""
    data = lm_tasks.read_results(run.run_dir)
    return [] if data is None else lm_tasks.render_section(data)


def sections(analyses: Sequence[Analysis]) -> list[Callable[[Run], list[str]]]:
    """eval.md's sections: the header, each analysis's in the registry's order, the footer and
    the lm-eval section."""
    return [header, *(a.section for a in analyses), footer, lm_eval_tasks]


def render(
    run_dir: str,
    data: DataConfig,
    settings: EvalSettings,
    results: list[dict],
    noise: dict,
    analyses: Sequence[Analysis] | None = None,
) -> str:
    """``eval.md`` for the results of every model of a run (their entries of eval.json, each
    analysis's typed result read back by the analysis; its figures are written into
    ``run_dir``). ``analyses``: the registry's (:data:`diffjax.evaluate.analyses.ANALYSES`) by
    default."""
    analyses = registry.ANALYSES if analyses is None else analyses
    models = [ModelResult.load(r, analyses) for r in results]
    run = Run(run_dir, data, settings, models, group_by_label(models), noise)
    return "\n".join(line for section in sections(analyses) for line in section(run))
