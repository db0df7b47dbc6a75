"""What keeping documents apart costs: the input pipeline and the train step, masking on and off,
side by side.

    python benchmarks/document_mask.py                    # the default data and DIFF model
    python benchmarks/document_mask.py --rounds 10 --markdown out.md
    python benchmarks/document_mask.py data.seq_len=512 model.max_seq_len=512   # any train.py setting

Pipeline: tokens/s of ``make_dataset`` on the default data (the stdlib corpus, ``seq_len``
and batch of the default ``train.py``), read on this thread (``data.prefetch=0``: the cost of
cutting the windows and marking their documents, not hidden behind the step).

Step: the loop's own jitted train step (``diffjax.train.setup.jit_steps``) of the default DIFF
model, on real batches with ``segment_ids`` and ``positions`` against the same batches without
them. Each round times ``--steps`` steps of one then the other (the order reversed every other
round), so whatever else the machine runs lands on both; the table gives the median over rounds
and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import numpy as np

from diffjax.infra import machine
from diffjax.compare import load_comparison
from diffjax.train.config import apply_overrides
from diffjax.data import make_dataset
from diffjax.infra.runtime import Runtime
from diffjax.train import setup as setup_lib
from diffjax.train import step as step_lib


def _batches(data, batch_size: int, n: int) -> list[dict[str, np.ndarray]]:
    it = iter(make_dataset(data, "train", batch_size=batch_size))
    return [next(it) for _ in range(n)]


def pipeline_rates(exp, rounds: int, batches: int) -> dict[str, list[float]]:
    """tokens/s of each setting, one figure per round."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    configs = {
        "on": exp.data.replace(prefetch=0, document_mask=None),
        "off": exp.data.replace(prefetch=0, document_mask=False),
    }
    for r in range(rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            it = iter(make_dataset(configs[name], "train", batch_size=exp.train.batch_size))
            first = next(it)
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            rates[name].append(batches * first["inputs"].size / (time.perf_counter() - t0))
    return rates


def step_times(exp, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per train step of each setting, one figure per round."""
    model_cfg = exp.models["diff"]
    runtime = Runtime.of(model_cfg, exp.mesh)
    setup = setup_lib.model_setup(model_cfg, exp.train, runtime)
    rows = exp.train.batch_size
    host = {
        "on": _batches(exp.data.replace(document_mask=None), rows, steps),
        "off": _batches(exp.data.replace(document_mask=False), rows, steps),
    }
    feeds, steps_fn, states = {}, {}, {}
    with runtime.activate():
        for name, batches in host.items():
            feeds[name] = [step_lib.model_inputs(b, runtime, rows) for b in batches]
            state, rest = setup.init(jax.random.key(0))
            steps_fn[name], _ = setup_lib.compile_steps(setup, state, rest, feeds[name][0])
            states[name] = state
        times: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(rounds + 1):  # round 0 warms up
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                state = states[name]
                t0 = time.perf_counter()
                for batch in feeds[name]:
                    state, metrics = steps_fn[name](state, batch)
                jax.block_until_ready(metrics)
                states[name] = state
                if r:
                    times[name].append((time.perf_counter() - t0) / steps)
    return times


def _ratios(a: list[float], b: list[float]) -> tuple[float, float, float]:
    r = [x / y for x, y in zip(a, b)]
    return statistics.median(r), min(r), max(r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="side-by-side rounds")
    p.add_argument("--steps", type=int, default=8, help="train steps per round and setting")
    p.add_argument("--batches", type=int, default=40, help="pipeline batches per round")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("settings", nargs="*", help="KEY=VALUE settings of train.py (default: none)")
    args = p.parse_args(argv)
    exp = apply_overrides(load_comparison(None), args.settings)
    tokens = exp.train.batch_size * exp.data.seq_len
    print(
        f"default data: {exp.data.source}, seq_len {exp.data.seq_len}, batch {exp.train.batch_size}",
        file=sys.stderr,
    )
    pipe = pipeline_rates(exp, args.rounds, args.batches)
    step = step_times(exp, args.rounds, args.steps)
    pr, sr = _ratios(pipe["on"], pipe["off"]), _ratios(step["on"], step["off"])
    lines = [
        f"`python benchmarks/document_mask.py --rounds {args.rounds} --steps {args.steps} "
        f"--batches {args.batches}{''.join(' ' + x for x in args.settings)}`, "
        f"{datetime.date.today()}, {machine.summary()}",
        "",
        "| | masking off | masking on | on / off (median of rounds, min .. max) |",
        "|---|---:|---:|---:|",
        f"| input pipeline, tokens/s (one thread, no prefetch) | {statistics.median(pipe['off']):,.0f} "
        f"| {statistics.median(pipe['on']):,.0f} | {pr[0]:.3f} ({pr[1]:.3f} .. {pr[2]:.3f}) |",
        f"| train step, ms (default DIFF model) | {1e3 * statistics.median(step['off']):.1f} "
        f"| {1e3 * statistics.median(step['on']):.1f} | {sr[0]:.3f} ({sr[1]:.3f} .. {sr[2]:.3f}) |",
        f"| train step, tokens/s | {tokens / statistics.median(step['off']):,.0f} "
        f"| {tokens / statistics.median(step['on']):,.0f} | |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
