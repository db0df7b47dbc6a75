"""The comparison report: ``report.md`` (a table and notes) and ``loss.png`` (validation curves
against tokens, training curves beside them) in the run directory."""

from __future__ import annotations

import math
import os
import platform
from typing import Sequence

import jax
import numpy as np

from .config import ExperimentConfig
from .loop import TrainResult
from .metrics import read_metrics


def _fmt(x, spec="{:.4f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return spec.format(x)


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:,.1f} MiB"


ROWS = (
    ("attention", lambda r: r.attention),
    ("parameters", lambda r: f"{r.params:,}"),
    ("tokens seen", lambda r: f"{r.tokens_seen:,}"),
    ("steps", lambda r: f"{r.steps:,}"),
    ("final train loss", lambda r: _fmt(r.final_train_loss)),
    ("final validation loss", lambda r: _fmt(r.final_val_loss)),
    ("tokens/s", lambda r: _fmt(r.tokens_per_s, "{:,.0f}")),
    ("step time", lambda r: _fmt(r.step_time_s * 1e3 if r.step_time_s == r.step_time_s else None,
                                 "{:.1f} ms")),
    ("peak memory", lambda r: _mib(r.peak_memory_bytes)),
)


def results_table(results: Sequence[TrainResult]) -> str:
    """A markdown table, one column per model."""
    rows = list(ROWS)
    if any(r.val_accuracy is not None for r in results):
        rows.insert(6, ("answer accuracy (validation)", lambda r: _fmt(r.val_accuracy, "{:.3f}")))
    lines = ["| | " + " | ".join(r.label for r in results) + " |",
             "|---|" + "---:|" * len(results)]
    for name, get in rows:
        lines.append(f"| {name} | " + " | ".join(get(r) for r in results) + " |")
    return "\n".join(lines)


def plot_losses(run_dir: str, results: Sequence[TrainResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        records = read_metrics(os.path.join(r.directory, "metrics.jsonl"))
        evals = [x for x in records if "val_loss" in x]
        ax_val.plot([x["tokens"] for x in evals], [x["val_loss"] for x in evals], marker="o",
                    ms=3, label=f"{r.label} ({r.attention})")
        tokens = np.array([x["tokens"] for x in records], float)
        loss = np.array([x["loss"] for x in records], float)
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid") if len(loss) >= k else loss
        ax_train.plot(tokens[k - 1:], smooth, label=f"{r.label} ({r.attention})")
    for ax, title in ((ax_val, "validation loss"), (ax_train, "training loss (smoothed)")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dir: str, exp: ExperimentConfig, results: Sequence[TrainResult],
                 data_description: str = "") -> str:
    """Write ``report.md`` and ``loss.png``; return the markdown."""
    plot_losses(run_dir, results, os.path.join(run_dir, "loss.png"))
    m, t, d = exp.model, exp.train, exp.data
    lines = [
        f"# {exp.run.name}: " + (" vs ".join(f"{r.label} ({r.attention})" for r in results)),
        "",
        results_table(results),
        "",
    ]
    by = {r.label: r for r in results}
    if "diff" in by and "standard" in by and by["diff"].final_val_loss is not None \
            and by["standard"].final_val_loss is not None:
        delta = by["diff"].final_val_loss - by["standard"].final_val_loss
        speed = by["diff"].tokens_per_s / by["standard"].tokens_per_s \
            if by["standard"].tokens_per_s else float("nan")
        lines += [f"Validation loss, DIFF minus standard: **{delta:+.4f}** nats/token "
                  f"({'DIFF lower' if delta < 0 else 'standard lower or equal'}). "
                  f"DIFF throughput is {speed:.2f}x the twin's.", ""]
    if by.get("diff") and by["diff"].lambdas:
        lam = ", ".join(f"{x:.3f}" for x in by["diff"].lambdas)
        lines += [f"DIFF lambda per layer at the end: {lam}.", ""]
    lines += [
        "![validation and training loss](loss.png)",
        "",
        "## Setup",
        "",
        f"- model: `{m.attention}`, d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} "
        f"heads ({m.kv_heads} kv), head dim {m.resolved_head_dim}, dtype {m.dtype}; the twin: "
        f"standard attention with the matching heads (`diffjax.twin`).",
        f"- data: {data_description or d.source}; sequence length {d.seq_len}; the same batches "
        f"in the same order for every model (data seed {d.seed}).",
        f"- training: {t.steps} steps x {t.batch_size} sequences, AdamW lr {t.lr:g} "
        f"({t.schedule} decay, {t.warmup_steps} warmup, betas ({t.b1}, {t.b2}), weight decay "
        f"{t.weight_decay}, clip {t.grad_clip}); init seed {t.seed}.",
        f"- final validation loss: over {t.eval_batches} fixed validation batches; final train "
        f"loss: mean of the last 5% of steps; tokens/s and step time: median over steps, "
        f"excluding the first step after a (re)start and evaluation/checkpoint time.",
        f"- peak memory: {results[0].memory_source if results else ''}."
        + ("".join(f" Device allocator peak after {r.label}: {_mib(r.device_peak_bytes)} "
                   f"(cumulative over the process)." for r in results if r.device_peak_bytes)),
        f"- machine: {platform.node() or 'unknown'}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), JAX {jax.__version__}."
        + (f"\n- mesh: {results[0].mesh}; parameters and optimizer state placed by the logical "
           f"axis rules of diffjax.sharding." if results and results[0].mesh else ""),
        "",
    ]
    text = "\n".join(lines)
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write(text)
    return text
