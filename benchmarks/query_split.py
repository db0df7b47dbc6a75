"""Which queries a trained needle or MQAR model answers: all of them, the first query alone (only
the needles or pairs hold its answer), the later queries that ask a needle for the first time,
and the repeated queries (whose answer also follows an earlier query of the same key, so it can
be copied from there), plus the accuracy by query index, for every model and seed of a run.

    python benchmarks/query_split.py runs/needle            # the best checkpoint of each model
    python benchmarks/query_split.py runs/mqar --examples 1024

A model that copies earlier queries without reading the needles climbs from the no-retrieval
level at query 0 to near 1 at the last queries; a model that retrieves is flat across the
indices. Works on runs written before ``val_first_query_accuracy`` was logged. Reads
``RUN_DIR/config.json``; evaluates on validation examples spread over the split
(``diffjax.evaluate.validation_examples``); a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffjax.data import query_kinds  # noqa: E402
from diffjax.data.synthetic import query_chance  # noqa: E402
from diffjax.evaluate import (
    discover_models,
    losses_and_predictions,
    query_correct,  # noqa: E402
    validation_examples,
)
from diffjax.evaluate.run import data_config, read_run_config  # noqa: E402
from diffjax.train import load_model  # noqa: E402


def split_accuracy(correct: np.ndarray, batch: dict) -> dict[str, float | list[float]]:
    """``correct`` ``[B, R]`` per query -> accuracy on all, first, new (later queries of a needle
    not asked before) and repeated queries, and by query index. Pure numpy."""
    first, repeat = query_kinds(batch)
    new = ~first & ~repeat
    out: dict[str, float | list[float]] = {"all": float(correct.mean())}
    for name, sel in (("first", first), ("new", new), ("repeat", repeat)):
        out[name] = float(correct[sel].mean()) if sel.any() else float("nan")
    out["by_index"] = correct.mean(0).tolist()
    out["repeat_share"] = float(repeat.mean())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--examples", type=int, default=512, help="validation examples (default 512)")
    p.add_argument("--step", default="best", help="checkpoint: best, latest or a step number")
    args = p.parse_args(argv)
    data = data_config(read_run_config(args.run_dir))
    if data.source not in ("needle", "mqar"):
        print(
            f"{args.run_dir} trained on data.source={data.source!r}: this split is for the "
            f"needle and MQAR tasks",
            file=sys.stderr,
        )
        return 2
    val = validation_examples(data, args.examples)
    chance = query_chance(data)
    rows = []
    for entry in discover_models(args.run_dir):
        model = load_model(entry.path, args.step)
        _, preds = losses_and_predictions(model, val)
        rows.append((entry, split_accuracy(query_correct(preds, val), val)))
    print(
        f"{len(val['inputs'])} validation examples, {data.task.num_queries} queries each "
        f"({rows[0][1]['repeat_share']:.0%} of them repeats) | no retrieval: all "
        f"{chance['no_retrieval']:.3f}, first query {chance['no_retrieval_first']:.3f}\n"
    )
    print(
        "| model | seed | all queries | first query | new needle, later | repeats | "
        "by query index |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for entry, acc in rows:
        idx = " ".join(f"{x:.2f}" for x in acc["by_index"])
        print(
            f"| {entry.label} | {entry.seed} | {acc['all']:.3f} | {acc['first']:.3f} | "
            f"{acc['new']:.3f} | {acc['repeat']:.3f} | {idx} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
