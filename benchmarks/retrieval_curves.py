"""Learning curves of a needle or MQAR run: validation query accuracy on all queries and on the
first query alone (the one only the needles or pairs can answer; a repeated query can be copied
from the earlier one, see :func:`diffjax.data.query_kinds`), and the answer loss, against steps
for every model and seed, with the task's chance levels; a markdown table on stdout.

    python benchmarks/retrieval_curves.py runs/needle --png docs/retrieval_needle.png
    python benchmarks/retrieval_curves.py runs/mqar --png docs/retrieval_mqar.png

Reads ``RUN_DIR/config.json`` (the task) and ``RUN_DIR/<label>/seed_<n>/metrics.jsonl`` (what
``train.py`` writes). Chance levels are :func:`diffjax.data.synthetic.query_chance`: "uniform"
(a random answer of the right form) and "no retrieval" (a value copied from a random needle or
pair not yet asked: the best a model does without the key-value link; for the first query
``no_retrieval_first``). "train s" is the sum of
the logged step times (evaluation, checkpointing and compilation excluded) on whatever machine
and load the run had.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffjax.data.synthetic import query_chance  # noqa: E402
from diffjax.evaluate.run import data_config, read_run_config  # noqa: E402
from diffjax.train.metrics import read_metrics  # noqa: E402


def load_curves(run_dir: str) -> dict[tuple[str, int], list[dict]]:
    """``{(label, seed): evaluation records}`` plus each model's ``train_s`` (summed step time)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "*", "seed_*", "metrics.jsonl"))):
        label = os.path.basename(os.path.dirname(os.path.dirname(path)))
        seed = int(os.path.basename(os.path.dirname(path)).split("_")[1])
        records = read_metrics(path)
        out[(label, seed)] = records
    return out


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def table(run_dir: str, curves, chance) -> str:
    lines = [
        "| model | seed | steps | train s | final val loss | final query acc | final first "
        "query | final repeats | best first query (step) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (label, seed), records in curves.items():
        evals = [r for r in records if "val_query_accuracy" in r]
        if not evals:
            continue
        last = evals[-1]
        firsts = [r for r in evals if "val_first_query_accuracy" in r]
        top = max(firsts, key=lambda r: r["val_first_query_accuracy"]) if firsts else None
        best = f"{top['val_first_query_accuracy']:.3f} ({top['step']})" if top else "n/a"
        train_s = sum(r.get("step_time") or 0.0 for r in records)
        lines.append(
            f"| {label} | {seed} | {last['step']} | {train_s:.0f} | "
            f"{last['val_loss']:.3f} | {last['val_query_accuracy']:.3f} | "
            f"{_fmt(last.get('val_first_query_accuracy'))} | "
            f"{_fmt(last.get('val_repeat_query_accuracy'))} | {best} |"
        )
    lines.append("")
    lines.append(
        f"Chance per query: uniform {chance['uniform']:.3f}, no retrieval "
        f"{chance['no_retrieval']:.3f} (first query: {chance['no_retrieval_first']:.3f})."
    )
    return "\n".join(lines)


_LINESTYLES = ("-", "--", "-.", ":")


def plot(run_dir: str, curves, chance, path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 5))
    FigureCanvasAgg(fig)
    ax_acc, ax_first, ax_loss = fig.subplots(1, 3)
    colors = {}
    for (label, seed), records in curves.items():
        evals = [r for r in records if "val_query_accuracy" in r]
        if not evals:
            continue
        color = colors.setdefault(label, f"C{len(colors)}")
        steps = [r["step"] for r in evals]
        name = f"{label} seed {seed}"
        style = dict(
            color=color, ls=_LINESTYLES[seed % len(_LINESTYLES)], marker="o", ms=3, label=name
        )  # one colour per model, one line style per seed
        ax_acc.plot(steps, [r["val_query_accuracy"] for r in evals], **style)
        firsts = [r for r in evals if "val_first_query_accuracy" in r]
        ax_first.plot(
            [r["step"] for r in firsts],
            [r["val_first_query_accuracy"] for r in firsts],
            **{**style, "label": None},
        )
        ax_loss.plot(steps, [r["val_loss"] for r in evals], **{**style, "label": None})
    for ax, level in ((ax_acc, chance["no_retrieval"]), (ax_first, chance["no_retrieval_first"])):
        ax.axhline(
            chance["uniform"],
            color="gray",
            ls=":",
            label="chance (uniform)" if ax is ax_acc else None,
        )
        ax.axhline(
            level,
            color="gray",
            ls="--",
            label="no retrieval (copy a random needle/pair)" if ax is ax_acc else None,
        )
        ax.set_ylim(0, 1)
    ax_acc.set_title("all queries (repeats can be copied from earlier queries)", fontsize=9)
    ax_first.set_title("first query (only the needles/pairs hold its answer)", fontsize=9)
    ax_acc.set_ylabel("validation query accuracy (exact answer)")
    ax_first.set_ylabel("validation first-query accuracy")
    ax_loss.set_ylabel("validation loss on the answers (nats/token)")
    for ax in (ax_acc, ax_first, ax_loss):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    # one legend under the panels, so it covers no curve
    handles, labels = ax_acc.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) - 1) // 5), 1, 1))
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--png", help="write the curves here")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    data = data_config(read_run_config(args.run_dir))
    chance = query_chance(data)
    curves = load_curves(args.run_dir)
    if not curves:
        print(f"{args.run_dir} holds no */seed_*/metrics.jsonl", file=sys.stderr)
        return 2
    print(table(args.run_dir, curves, chance))
    if args.png:
        title = args.title or f"{data.source}: {os.path.basename(os.path.abspath(args.run_dir))}"
        plot(args.run_dir, curves, chance, args.png, title)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
