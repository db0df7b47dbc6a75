"""What ``train.diagnostics`` costs the train step: the loop's own jitted step with the signals
on and off, side by side, for DIFF and its twin.

    python benchmarks/diagnostics_cost.py                      # the default config
    python benchmarks/diagnostics_cost.py --rounds 10 --markdown out.md
    python benchmarks/diagnostics_cost.py model.attention=diff_v2   # any train.py setting

Each model's step (``diffjax.train.setup.compile_steps``, the step ``train.py`` runs) is compiled
twice, with ``train.diagnostics`` off and on, and fed the same real batches. Each round times
``--steps`` steps of one then the other (the order reversed every other round), so whatever else
the machine runs lands on both; the table gives the median over rounds and the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import statistics
import sys
import time

import jax

from diffjax.infra import machine
from diffjax.data import make_dataset
from diffjax.infra.runtime import Runtime
from diffjax.train import setup as setup_lib
from diffjax.train import step as step_lib
from diffjax.compare import load_comparison
from diffjax.train.config import apply_overrides


def op_count(compiled) -> int:
    """The fusions, reductions and copies of a compiled step: on CPU each costs a fixed launch
    overhead, which at this size is what an added per-parameter reduction costs."""
    return len(re.findall(r"\b(?:fusion|reduce|copy)\(", compiled.as_text()))


def step_times(exp, label: str, rounds: int, steps: int) -> tuple[dict[str, list[float]], dict]:
    """Seconds per train step of model ``label`` with the diagnostics off and on, one figure per
    round each, and each compiled step's :func:`op_count`."""
    model_cfg = exp.models[label]
    runtime = Runtime.of(model_cfg, exp.mesh)
    rows = exp.train.batch_size
    it = iter(make_dataset(exp.data, "train", batch_size=rows))
    host = [next(it) for _ in range(steps)]
    fns, states, feeds = {}, {}, []
    with runtime.activate():
        feeds = [step_lib.model_inputs(b, runtime, rows) for b in host]
        for name, on in (("off", False), ("on", True)):
            tcfg = dataclasses.replace(exp.train, diagnostics=on)
            setup = setup_lib.model_setup(model_cfg, tcfg, runtime)
            state, rest = setup.init(jax.random.key(0))
            fns[name], _ = setup_lib.compile_steps(setup, state, rest, feeds[0])
            states[name] = state
        ops = {name: op_count(fn) for name, fn in fns.items()}
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds + 1):  # round 0 warms up
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                state = states[name]
                t0 = time.perf_counter()
                for batch in feeds:
                    state, metrics = fns[name](state, batch)
                jax.block_until_ready(metrics)
                states[name] = state
                if r:
                    times[name].append((time.perf_counter() - t0) / steps)
    return times, ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="side-by-side rounds")
    p.add_argument("--steps", type=int, default=8, help="train steps per round and setting")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("settings", nargs="*", help="KEY=VALUE settings of train.py (default: none)")
    args = p.parse_args(argv)
    exp = apply_overrides(load_comparison(None), args.settings)
    print(f"models: {', '.join(exp.models)}", file=sys.stderr)
    lines = [
        f"`python benchmarks/diagnostics_cost.py --rounds {args.rounds} --steps {args.steps}"
        f"{''.join(' ' + x for x in args.settings)}`, {datetime.date.today()}, "
        f"{machine.summary()}",
        "",
        "| model | step, diagnostics off (ms) | on (ms) | on / off (median of rounds, min .. max) "
        "| XLA ops (fusions, reductions, copies), off -> on |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, model_cfg in exp.models.items():
        t, ops = step_times(exp, label, args.rounds, args.steps)
        ratios = [a / b for a, b in zip(t["on"], t["off"])]
        lines.append(
            f"| {label} ({model_cfg.attention}) | {1e3 * statistics.median(t['off']):.1f} "
            f"| {1e3 * statistics.median(t['on']):.1f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f} .. {max(ratios):.3f}) | {ops['off']} -> {ops['on']} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
