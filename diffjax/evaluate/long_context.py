"""Multi-needle retrieval at lengths one device cannot hold: ``python -m diffjax.evaluate RUN_DIR
long_context.lengths=8192,32768 mesh.context=8``.

Every model of the run (its best checkpoint) is replicated over a mesh whose ``context`` axis
splits the sequence (:class:`diffjax.infra.sharding.MeshConfig`), and the multi-needle grid of the
run's needle setting (:func:`.retrieval.multi_needle_retrieval`) runs at each length: the tokens
in the balanced (zigzag) order, attention as a ring over the ``context`` devices
(:mod:`diffjax.ops.context`), the predictions returned to the data's order. Writes
``RUN_DIR/long_context.json`` and ``RUN_DIR/long_context.md`` (accuracy per length, each model's
mean ± sd over seeds, the paired DIFF - twin difference with its 95% t-interval), and the
measured noise floor at each length (the share of the answer rows' absolute attention mass on
the answer and on the distractors: other needles and haystack; the maps of those rows only, so
``O(rows x T)`` per head at any length)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diffjax.ops import context
from diffjax.infra import sharding, storage
from diffjax.infra.runtime import Runtime
from diffjax.config import ConfigError, check_fields, fail
from diffjax.train.checkpoint import load_model

from diffjax.evaluate import allocation as alloc
from diffjax.evaluate import retrieval as ret
from diffjax.evaluate.results import kind_entry, model_name
from diffjax.evaluate.inputs import fits, keeps_replacement, run_needle_setting, run_needle_task
from diffjax.evaluate.run import data_config, discover_models, read_run_config
from diffjax.evaluate.stats import (
    describe_difference,
    difference_cell,
    fmt_mean_std,
    group_by_label,
    minus,
    paired_by_seed,
    paired_difference,
    twin_name,
    twins_of,
)

__all__ = ["LongContextSettings", "evaluate_long_context", "render"]


@dataclasses.dataclass(frozen=True)
class LongContextSettings:
    """The needle grid at long context (``long_context.*``); checked at construction."""

    # only the multi-needle grid at these lengths (tokens, comma-separated), on a mesh whose
    # context axis splits the sequence (mesh.*): RUN_DIR/long_context.md. Empty: the analyses
    lengths: tuple[int, ...] = ()
    examples: int = 8  # examples per length

    def __post_init__(self):
        check_fields(self)
        if self.examples < 1:
            fail(
                "LongContextSettings",
                "examples",
                f"must be >= 1, got {self.examples}",
                "set long_context.examples to a positive integer, e.g. 8",
            )


def replicate(model, mesh):
    """``model`` with every array replicated over ``mesh`` (a copy; the parameters unchanged)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, P())))


def _check_lengths(lengths: Sequence[int], n: int, order: str) -> list[int]:
    lengths = sorted({int(x) for x in lengths})
    if not lengths or lengths[0] < 2:
        raise ConfigError(
            f"long_context.lengths: give sequence lengths of at least 2 tokens, got {lengths}. "
            f"Fix: e.g. long_context.lengths=8192,32768"
        )
    for length in lengths:
        context.check_sequence(length, n, order, what=f"long_context.lengths: {length}")
    return lengths


def _one_model(e, model, mesh, runtime, data, lengths, examples, batch_size, noise_floor, log):
    """One model's record of ``long_context.json``: its multi-needle grid at ``lengths`` and,
    with ``noise_floor``, the measured noise floor at each length that fits (only the answer
    rows' maps, keys gathered); its line said with ``log``."""
    needles, queries = run_needle_setting(data)
    t0 = time.perf_counter()
    rep = replicate(model, mesh)
    grid = ret.multi_needle_retrieval(
        rep,
        lengths=lengths,
        num_needles=needles,
        num_queries=queries,
        data=data,
        num_examples=examples,
        num_depth_bins=1,
        batch_size=batch_size,
        query_replacement=keeps_replacement(data, needles, queries),
        runtime=runtime,
    )
    acc = [float(a) for a in grid.length_accuracy()]
    noise = []
    for x in lengths:
        if noise_floor and fits(data, x, needles, queries):
            b = ret.task_examples(
                run_needle_task(data, x, needles, queries, num_examples=examples, seed=1)
            )
            m = alloc.measured_noise_floor(rep, b, batch_size=batch_size)
            noise.append({"length": x, **m})
    log(
        f"    {e.label} (seed {e.seed}): "
        + ", ".join(f"{x}: {a:.3f}" for x, a in zip(lengths, acc))
        + "".join(
            f"; noise floor at {m['length']}: signal {m['signal_share']:.3f}, "
            f"distractors {m['distractor_share']:.3f}"
            for m in noise
        )
        + f" ({time.perf_counter() - t0:.1f}s)"
    )
    return {
        "label": e.label,
        "seed": e.seed,
        **kind_entry(model.config),
        "accuracy": acc,
        "grid": grid.to_dict(),
        "noise_measured": noise,
    }


def evaluate_long_context(
    run_dir: str,
    lengths: Sequence[int],
    *,
    mesh_config: sharding.MeshConfig,
    examples: int = 8,
    batch_size: int = 1,
    log: Callable[[str], Any] = print,
    write: bool = True,
    noise_floor: bool = True,
) -> dict[str, Any]:
    """The multi-needle grid of every model of ``run_dir`` at ``lengths`` on the mesh of
    ``mesh_config`` (``examples`` examples per length) and, with ``noise_floor``, the measured
    noise floor on the same number of needle examples at each length
    (:func:`.allocation.measured_noise_floor`: the answer rows of each map only); returns what
    ``long_context.json`` holds. Bad input (no model, a length the ring cannot split or a model cannot take, a mesh
    the devices do not fill) raises :class:`ConfigError` before any forward pass. ``run_dir``:
    a local folder or a ``gs://`` URL."""
    run_dir = str(storage.absolute(run_dir))
    if not storage.isdir(run_dir):
        raise ConfigError(
            f"run directory {run_dir} does not exist. Fix: pass the folder train.py wrote"
        )
    cfg = read_run_config(run_dir)
    data = data_config(cfg)
    entries = discover_models(run_dir, default_seed=int(cfg.get("train", {}).get("seed", 0)))
    if not entries:
        raise ConfigError(f"{run_dir} holds no model with a committed checkpoint. Fix: train first")
    mesh = sharding.make_mesh(mesh_config)
    n = context.axis_size(mesh)
    lengths = _check_lengths(lengths, n, mesh_config.context_order)
    needles, queries = run_needle_setting(data)
    models = [(e, load_model(e.path, "best")) for e in entries]
    for e, model in models:
        if lengths[-1] > model.config.max_seq_len:
            raise ConfigError(
                f"{e.label} (seed {e.seed}) takes at most model.max_seq_len="
                f"{model.config.max_seq_len} tokens; long_context.lengths asks {lengths[-1]}. Fix: "
                f"shorter lengths, or train with a larger model.max_seq_len"
            )
    log(
        f"long context: {needles} needles, {queries} queries, lengths {lengths} on mesh "
        f"{' '.join(f'{a}={s}' for a, s in zip(mesh.axis_names, mesh.devices.shape))} "
        f"({mesh.devices.size} devices; order {mesh_config.context_order}, "
        f"attention {sorted({m.config.context_attention for _, m in models})})"
    )
    results = []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.current_rules()):
        for e, model in models:
            runtime = Runtime.of(model.config, mesh_config, mesh)
            results.append(
                _one_model(
                    e, model, mesh, runtime, data, lengths, examples, batch_size, noise_floor, log
                )
            )
    out = {
        "lengths": lengths,
        "num_needles": needles,
        "num_queries": queries,
        "examples": examples,
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))),
        "context_order": mesh_config.context_order,
        "models": results,
    }
    if write and jax.process_index() == 0:
        storage.write_json(storage.join(run_dir, "long_context.json"), out)
        storage.write_text(storage.join(run_dir, "long_context.md"), "\n".join(render(out)))
        log(f"long context: {storage.join(run_dir, 'long_context.md')}")
    return out


def render(out: dict[str, Any]) -> list[str]:
    """``long_context.md``: accuracy per length, per model over seeds, and DIFF - each twin."""
    groups = group_by_label(out["models"])
    labels, twins = list(groups), twins_of(groups)
    mesh = " ".join(f"{k}={v}" for k, v in out["mesh"].items())
    L = [
        "# Multi-needle retrieval at long context",
        "",
        f"{out['num_needles']} needles, {out['num_queries']} queries per example, "
        f"{out['examples']} examples per length; the sequence split over the `context` axis of "
        f"the mesh {mesh} ({out['context_order']} order). A cell: the fraction of queries "
        f"answered exactly, mean ± sd over seeds. Written by `python -m diffjax.evaluate "
        f"long_context.lengths=...`.",
        "",
    ]
    header = ["length"] + [model_name(lab, groups[lab]) for lab in labels]
    header += [f"{minus(t)} [95% t-interval]" for t in twins]
    L += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for i, length in enumerate(out["lengths"]):
        row = [f"{length:,}"] + [
            fmt_mean_std([r["accuracy"][i] for r in groups[lab]]) for lab in labels
        ]
        for t in twins:
            d, cell = _paired(groups, lambda r: r["accuracy"][i], t)
            row.append(cell)
            what = f"accuracy at {length:,} tokens"
            notes.append(f"- {describe_difference(d, what, b=twin_name(t), spec='{:+.3f}')}")
        L.append("| " + " | ".join(row) + " |")
    return L + [""] + notes + ([""] if notes else []) + _render_noise(out, groups, labels)


def _paired(groups: dict, get: Callable[[Any], float], twin: str):
    """``(difference, cell)``: DIFF - ``twin`` of ``get(result)``, paired by seed, and its
    table cell (:func:`difference_cell`: the mean with its 95% t-interval, or why none)."""
    d = paired_difference(*paired_by_seed(groups, get, b=twin))
    return d, difference_cell(d, "{:+.3f}")


def _render_noise(out: dict[str, Any], groups: dict, labels: list[str]) -> list[str]:
    """The measured noise floor per length: signal and distractor shares per model (mean ± sd
    over seeds) and the paired DIFF - twin difference of the distractor share."""
    by = {
        lab: [{m["length"]: m for m in r.get("noise_measured") or []} for r in groups[lab]]
        for lab in labels
    }
    lengths = [x for x in out["lengths"] if all(x in d for lab in labels for d in by[lab])]
    if not lengths:
        return []
    twins = twins_of(groups)
    L = [
        "## The noise floor at each length",
        "",
        "The answer-producing rows of every map (the differential map for DIFF), averaged over "
        "layers, heads, rows and examples: the share of each row's absolute attention mass on "
        "the answer (signal) and on the other needles and the haystack (distractors). "
        "Mean ± sd over seeds.",
        "",
    ]
    header = ["length", "distractor keys"]
    for lab in labels:
        name = model_name(lab, groups[lab])
        header += [f"{name} signal", f"{name} distractors"]
    header += [f"distractors {minus(t)} [95% t-interval]" for t in twins]
    L += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for x in lengths:
        first = by[labels[0]][0][x]
        row = [f"{x:,}", f"{first['num_distractors']:,.0f}"]
        for lab in labels:
            row += [
                fmt_mean_std([d[x]["signal_share"] for d in by[lab]]),
                fmt_mean_std([d[x]["distractor_share"] for d in by[lab]]),
            ]
        share = {
            (lab, r["seed"]): d[x]["distractor_share"]
            for lab in labels
            for r, d in zip(groups[lab], by[lab])
        }
        for t in twins:
            row.append(_paired(groups, lambda r: share[r["label"], r["seed"]], t)[1])
        L.append("| " + " | ".join(row) + " |")
    return L + [""]
