"""Re-run the published per-seed numbers and say which differ.

``benchmarks/published.json`` holds, per experiment, the command, the date, the machine it was
measured on (:func:`diffjax.infra.machine.describe`: the CPU and its vector extensions, jax and
jaxlib), the metric and its per-seed values for each model, as docs/results.md shows them. This
script trains the chosen experiments and seeds again with the code it ships with (each seed
alone: seed ``s`` of a paired run starts from init seed ``s`` and sees the same batches, so it is
the same run) and prints, per model and seed, the published value, the value now and whether
they agree at the published precision. Runs repeat exactly on one machine but not across CPU
types, so where a value differs it says whether this machine differs from the publishing one
(then the CPU may be the cause, within the spread docs/results.md measures) or not (then the
code changed the number). Exit status 1 when one differs. ``--write`` records the new values,
date and machine in published.json (then regenerate the tables of docs/results.md from it).

    python benchmarks/reproduce.py                       # the default comparison, both seeds (~3 min)
    python benchmarks/reproduce.py needle --seeds 0      # one needle seed (~13 min on 2 cores)
    python benchmarks/reproduce.py default needle mqar   # everything published (~1.5 h)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile

from diffjax.infra import machine
from diffjax.compare import cli
from diffjax.train import TrainResult

PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published.json")
# what every re-run leaves out: the per-seed numbers do not depend on it
FAST = ["compare.quick_eval=false", "compare.throughput_rounds=0", "train.progress=false"]


def load(path: str | None = None) -> dict:
    with open(path or PUBLISHED) as f:
        return json.load(f)


def value(result: TrainResult, metric: str) -> float | None:
    return result.final_val_loss if metric == "val_loss" else result.metrics.get(metric)


def run_seed(entry: dict, seed: int, out: str) -> dict[str, float | None]:
    """Train one seed of ``entry``'s command (every model of it) in ``out``; ``{label: value}``."""
    argv = shlex.split(entry["command"])[2:]  # after "python train.py"
    argv = [a for a in argv if not a.startswith(("compare.seeds=", "train.seed="))]
    run_dir = os.path.join(out, f"seed_{seed}")
    code = cli.main(argv + [f"run.dir={run_dir}", f"train.seed={seed}", "compare.seeds=1"] + FAST)
    if code:
        raise SystemExit(f"{entry['command']} (seed {seed}) exited {code}")
    got = {}
    for label in entry["values"]:
        with open(os.path.join(run_dir, label, f"seed_{seed}", "result.json")) as f:
            got[label] = value(TrainResult.from_dict(json.load(f)), entry["metric"])
    return got


def agrees(published: float, now: float | None, digits: int) -> bool:
    return now is not None and abs(round(now, digits) - published) < 0.5 * 10**-digits


def compare(name: str, entry: dict, seeds: list[int], out: str) -> tuple[list[str], bool, dict]:
    """The table lines of one experiment, whether every value agrees, and the new values."""
    digits, ok, new = entry["digits"], True, {label: {} for label in entry["values"]}
    where = entry.get("machine")
    lines = [
        f"{name}: {entry['command']} ({entry['metric']}; published {entry['date']} on "
        f"{machine.summary(where) if where else 'a machine not recorded'})",
        "| model | seed | published | now | |",
        "|---|---:|---:|---:|---|",
    ]
    for seed in seeds:
        got = run_seed(entry, seed, os.path.join(out, name))
        for label, values in entry["values"].items():
            published, now = values.get(str(seed)), got[label]
            same = published is not None and agrees(published, now, digits)
            ok &= same
            new[label][str(seed)] = None if now is None else round(now, digits)
            shown = "-" if published is None else f"{published:.{digits}f}"
            now_s = "-" if now is None else f"{now:.{digits}f}"
            lines.append(
                f"| {label} | {seed} | {shown} | {now_s} | {'same' if same else 'DIFFERS'} |"
            )
    if not ok:
        lines.append(explain(where, machine.describe()))
    return lines, ok, new


def explain(published: dict | None, now: dict) -> str:
    """Why a value may differ: the machines' differences, or none (the code moved it)."""
    if published is None:
        return (
            "the publishing machine was not recorded: a different CPU type can move the last "
            "published digit (docs/results.md, across machines); on the same one, the code did"
        )
    diffs = machine.differences(published, now)
    if diffs:
        return (
            "this machine differs from the publishing one (" + "; ".join(diffs) + "): XLA:CPU "
            "rounds float32 differently on other vector instructions, which can move the last "
            "published digit (docs/results.md, across machines)"
        )
    return "the same machine as the publishing one: the code changed these numbers"


def main(argv: list[str] | None = None) -> int:
    published = load()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # (no ``choices``: argparse checks a list default against them as one value, and fails)
    p.add_argument("experiments", nargs="*", help=f"of {sorted(published)}; default: default")
    p.add_argument("--seeds", type=int, nargs="+", help="default: every published seed")
    p.add_argument("--out", help="where the runs go (default: a temporary folder)")
    p.add_argument("--write", action="store_true", help="record the new values in published.json")
    args = p.parse_args(argv)
    unknown = sorted(set(args.experiments) - set(published))
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; choose from {sorted(published)}")
    args.experiments = args.experiments or ["default"]
    out = args.out or tempfile.mkdtemp(prefix="reproduce_")
    print(f"this machine: {machine.summary()}\n", flush=True)
    all_ok = True
    for name in args.experiments:
        entry = published[name]
        seeds = args.seeds or sorted({int(s) for v in entry["values"].values() for s in v})
        lines, ok, new = compare(name, entry, seeds, out)
        print("\n".join(lines) + "\n", flush=True)
        all_ok &= ok
        if args.write:
            for label, values in new.items():
                entry["values"][label].update(values)
            entry["date"] = datetime.date.today().isoformat()
            entry["machine"] = machine.describe()
            entry.pop("jax", None)  # in the machine record
    if args.write:
        with open(PUBLISHED, "w") as f:
            json.dump(published, f, indent=2)
            f.write("\n")
    print("every value agrees" if all_ok else "some values DIFFER: regenerate their tables")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
