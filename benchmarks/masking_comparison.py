"""The default comparison with documents kept apart and without, paired over the same seeds:
does keeping documents apart change DIFF − twin?

    python benchmarks/masking_comparison.py --out runs/masking            # 4 seeds (~13 min)
    python benchmarks/masking_comparison.py --out runs/masking --seeds 6 --markdown out.md
    python benchmarks/masking_comparison.py --out runs/masking512 data.seq_len=512 model.max_seq_len=512

Trains ``python train.py`` (the default DIFF V1 and its twin) twice in ``--out``: ``on/`` with
the default data (``data.document_mask`` unset: documents kept apart) and ``off/`` with
``data.document_mask=false`` (windows of the concatenated stream), each with init seeds 0 ..
N-1 (seed ``s`` of both arms starts from the same parameters and reads the same windows in the
same order); settings given as ``KEY=VALUE`` apply to both arms (longer windows, another corpus:
more of the windows cross a boundary). An interrupted run resumes where it stopped
(``train.py`` resumes its run folder).

Each arm's validation loss is measured on its own data: with masking the loss leaves out the
targets that cross a document boundary and each window's attention stops at them, so the
on − off rows compare two measurements as well as two trainings. DIFF − twin within an arm is
one measurement of two models; its change between the arms is the question.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from diffjax.infra import machine
from diffjax.compare import cli
from diffjax.evaluate.stats import difference_cell, fmt_mean_std, paired_difference
from diffjax.train import TrainResult

ARMS = {"on": [], "off": ["data.document_mask=false"]}
FAST = ["compare.quick_eval=false", "compare.throughput_rounds=0", "train.progress=false"]
MODELS = {"diff": "DIFF V1", "standard": "twin"}


def train_arm(out: str, arm: str, seeds: int, settings: list[str]) -> None:
    argv = [f"run.dir={os.path.join(out, arm)}", f"compare.seeds={seeds}", *FAST, *settings]
    argv += ARMS[arm]
    if cli.main(argv):  # a run folder with checkpoints resumes
        raise SystemExit(f"train.py {' '.join(argv)} failed")


def final_losses(out: str, arm: str, seeds: int) -> dict[str, list[float]]:
    got = {}
    for label in MODELS:
        got[label] = []
        for s in range(seeds):
            with open(os.path.join(out, arm, label, f"seed_{s}", "result.json")) as fh:
                got[label].append(TrainResult.from_dict(json.load(fh)).final_val_loss)
    return got


def table(values: dict[str, dict[str, list[float]]], seeds: int) -> list[str]:
    on, off = values["on"], values["off"]
    L = [
        f"| final validation loss | documents kept apart | concatenated stream | kept apart − "
        f"concatenated, 95% t-interval ({seeds} paired seeds) |",
        "|---|---:|---:|---:|",
    ]
    for label, name in MODELS.items():
        d = paired_difference(on[label], off[label])
        L.append(
            f"| {name} | {fmt_mean_std(on[label], '{:.4f}')} | {fmt_mean_std(off[label], '{:.4f}')} "
            f"| {difference_cell(d, '{:+.4f}')} |"
        )
    gap = {a: [x - y for x, y in zip(v["diff"], v["standard"])] for a, v in values.items()}
    cells = [
        difference_cell(paired_difference(v["diff"], v["standard"]), "{:+.4f}") for v in (on, off)
    ]
    change = difference_cell(paired_difference(gap["on"], gap["off"]), "{:+.4f}")
    L.append(f"| DIFF − twin (paired) | {cells[0]} | {cells[1]} | {change} |")
    per_seed = ", ".join(f"{a:+.4f} / {b:+.4f}" for a, b in zip(gap["on"], gap["off"]))
    L += ["", f"DIFF − twin per seed (kept apart / concatenated): {per_seed}."]
    return L


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the folder both arms train in (resumable)")
    p.add_argument("--seeds", type=int, default=4, help="paired init seeds 0 .. N-1")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("settings", nargs="*", help="KEY=VALUE settings of train.py for both arms")
    args = p.parse_args(argv)
    for arm in ARMS:
        print(f"training the arm '{arm}' ({args.seeds} seeds) in {args.out}/{arm}", file=sys.stderr)
        train_arm(args.out, arm, args.seeds, args.settings)
    values = {arm: final_losses(args.out, arm, args.seeds) for arm in ARMS}
    command = " ".join(
        ["python benchmarks/masking_comparison.py", f"--seeds {args.seeds}", *args.settings]
    )
    head = f"`{command}`, {datetime.date.today()}, {machine.summary()}"
    text = "\n".join([head, ""] + table(values, args.seeds))
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
