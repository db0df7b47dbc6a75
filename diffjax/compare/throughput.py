"""Side-by-side throughput of two models: their compiled train steps alternated on the same
batches, so whatever else the machine does at the time lands on both.

Measured one after the other (each model's median step time during its own training), a
background job that runs while one model trains and not while the other does moves the ratio
by any amount. Here each round times ``steps`` steps of model A then ``steps`` steps of model B
(the order flips every round), on the same global batches; the ratio of the round's tokens/s is
one sample, and the report gives the median over rounds and their spread (min .. max).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import numpy as np
from flax import nnx

from diffjax.infra import sharding
from diffjax.config import ModelConfig
from diffjax.train.config import ExperimentConfig
from diffjax.train.setup import compile_steps, model_setup, process_stream, run_runtime
from diffjax.train.step import model_inputs


@dataclasses.dataclass
class SideBySide:
    """Tokens/s of each model per round and the ratio ``a / b`` per round."""

    labels: tuple[str, str]
    tokens_per_s: dict[str, list[float]]
    ratios: list[float]
    rounds: int
    steps_per_round: int
    tokens_per_step: int
    devices: int | None = None  # the mesh's device count (tokens/s is over all of them)

    @property
    def median_ratio(self) -> float:
        return float(np.median(self.ratios))

    @property
    def spread(self) -> tuple[float, float]:
        return float(np.min(self.ratios)), float(np.max(self.ratios))

    def median_tokens_per_s(self, label: str) -> float:
        return float(np.median(self.tokens_per_s[label]))

    def resolved(self) -> bool:
        """Every round has the same model faster (the per-round ratios all on one side of 1)."""
        lo, hi = self.spread
        return hi < 1 or lo > 1

    def describe(self) -> str:
        a, b = self.labels
        lo, hi = self.spread
        verdict = (
            f"every round has {a if lo > 1 else b} faster"
            if self.resolved()
            else "the rounds disagree on which model is faster, so these rounds resolve no "
            "difference (compare.throughput_rounds sets how many)"
        )
        return (
            f"{a} throughput is {self.median_ratio:.2f}x {b}'s (median over {self.rounds} "
            f"rounds of {self.steps_per_round} steps each, the two compiled train steps "
            f"alternated on the same batches; per-round ratios {lo:.2f} .. {hi:.2f}: {verdict}; "
            f"each model's median over its rounds: {a} {self.median_tokens_per_s(a):,.0f} "
            f"tokens/s, {b} {self.median_tokens_per_s(b):,.0f} tokens/s)"
        )

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "median_ratio": self.median_ratio,
            "spread": self.spread,
        }


def side_by_side_throughput(
    exp: ExperimentConfig,
    models: dict[str, ModelConfig],
    mesh=None,
    *,
    rounds: int = 5,
    steps: int = 4,
) -> SideBySide:
    """Alternate the compiled train steps of the two ``models`` (``{label: config}``, the first
    is the numerator) for ``rounds`` rounds of ``steps`` steps each on the same ``steps`` batches
    of ``exp.data``'s training stream; one warm-up step each first. The states are fresh
    initialisations (a step's time does not depend on the parameter values)."""
    if len(models) != 2:
        raise ValueError(f"side_by_side_throughput compares two models, got {list(models)}")
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be >= 1, got {rounds} and {steps}")
    mesh = sharding.make_mesh(exp.mesh) if mesh is None else mesh
    tcfg = exp.train
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        runtimes = {label: run_runtime(exp, cfg, mesh) for label, cfg in models.items()}
        stream = list(itertools.islice(process_stream(exp, "train", mesh), steps))
        compiled = {}
        for label, cfg in models.items():
            # the train step compiled as the loop compiles it, on a fresh state
            batches = [model_inputs(b, runtimes[label], tcfg.batch_size) for b in stream]
            setup = model_setup(cfg, tcfg, runtimes[label])
            state, rest = setup.fresh_state()
            fn, _ = compile_steps(setup, state, rest, batches[0])
            state, m = fn(state, batches[0])  # warm-up
            jax.block_until_ready(m)
            compiled[label] = [fn, state, batches]
        labels = tuple(models)
        tokens = tcfg.batch_size * exp.data.seq_len
        tps: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                fn, state, batches = compiled[label]
                t0 = time.perf_counter()
                for b in batches:
                    state, m = fn(state, b)
                jax.block_until_ready((state, m))
                tps[label].append(tokens * len(batches) / (time.perf_counter() - t0))
                compiled[label][1] = state
    ratios = [x / y for x, y in zip(tps[labels[0]], tps[labels[1]])]
    return SideBySide(labels, tps, ratios, rounds, len(batches), tokens, mesh.devices.size)
