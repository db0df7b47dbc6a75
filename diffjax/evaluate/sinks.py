"""Attention sinks and massive activations, per layer, for every model of a run.

Both DIFF and gated attention claim to remove them (the DIFF paper's Section 3.5; Qiu et al.
2025, "Gated Attention for Large Language Models": "attention-sink-free"); this measures both
on every model the run trained, over the same validation text as the activation outliers:

- **the first token's mass**: per layer, the attention weight the queries put on the window's
  first token, averaged over heads and over every query after it (the first query sees only
  itself). For DIFF the map is the differential one, ``A1 - lambda A2`` (what multiplies V),
  so a sink that the second map cancels does not count.
- **the document start's mass**: where the data keeps documents apart (positions restarting at
  each document start), the weight each query puts on its own document's first token, over the
  queries whose document starts inside the window, the start itself left out; None otherwise.
- **massive activations**: per layer, the largest magnitude of the block's output hidden state
  over its median magnitude (Sun et al. 2024's measure, the one the gated-attention paper uses).

The analysis (:class:`Sinks`) has its section of eval.md and its plot here too."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.infra import storage

from diffjax.evaluate import plots
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, paired, table
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.outliers import activation_text
from diffjax.evaluate.probe import attention_maps, capture_layers, check_tokens, for_analysis


@nnx.jit
def _layer_stats(model, tokens, masks):
    """Per layer: the first token's mass (mean over batch, heads and queries 1..T-1), the sum
    and count of the document starts' mass, and the largest and median |hidden state|."""
    _, attn_in, outs = capture_layers(model, tokens, **masks)
    positions, segments = masks.get("positions"), masks.get("segment_ids")
    t = tokens.shape[1]
    first, doc_sum, doc_n, top, median = [], [], [], [], []
    for block, h, out in zip(model.layers, attn_in, outs):
        maps = attention_maps(block.attn, h, positions, segments)
        w = maps["diff"] if "diff" in maps else maps["a"]  # [B, H, T, S]
        first.append(jnp.mean(w[:, :, 1:, 0]))
        if positions is not None:
            start = jnp.arange(t)[None, :] - positions  # each query's document start [B, T]
            keep = (start >= 0) & (positions > 0)
            mass = jnp.take_along_axis(w, jnp.clip(start, 0, t - 1)[:, None, :, None], axis=-1)
            doc_sum.append(jnp.sum(jnp.where(keep[:, None, :], mass[..., 0], 0.0)))
            doc_n.append(jnp.sum(keep) * w.shape[1])
        mag = jnp.abs(out.astype(jnp.float32))
        top.append(jnp.max(mag))
        median.append(jnp.median(mag))
    doc = (jnp.stack(doc_sum), jnp.stack(doc_n)) if doc_sum else None
    return jnp.stack(first), doc, jnp.stack(top), jnp.stack(median)


@dataclasses.dataclass(frozen=True)
class Sinks:
    """Per layer: ``first_token`` mass, ``document_start`` mass (None without documents kept
    apart), the largest (``top``) and ``median`` |hidden state| of the block's output; over
    ``tokens`` tokens."""

    first_token: tuple[float, ...]
    document_start: tuple[float, ...] | None
    top: tuple[float, ...]
    median: tuple[float, ...]
    tokens: int

    @property
    def massive(self) -> tuple[float, ...]:
        """The largest |hidden state| over the median, per layer."""
        return tuple(t / m if m > 0 else float("nan") for t, m in zip(self.top, self.median))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sinks":
        doc = d.get("document_start")
        return cls(
            tuple(d["first_token"]),
            None if doc is None else tuple(doc),
            tuple(d["top"]),
            tuple(d["median"]),
            d["tokens"],
        )


def sinks(model, tokens, *, batch_size: int = 4, masks: dict | None = None) -> Sinks:
    """:class:`Sinks` of ``model`` over ``tokens`` ``[B, T]``; ``masks``: their ``positions``
    and ``segment_ids`` ``[B, T]`` (documents kept apart), if any. Means over every batch, the
    largest magnitude the largest of all, the median the mean of the batches' medians."""
    model = for_analysis(model)
    tokens = np.asarray(check_tokens(model, tokens))
    masks = {k: np.asarray(v, np.int32) for k, v in (masks or {}).items() if v is not None}
    firsts, docs, tops, medians, weights = [], [], [], [], []
    for i in range(0, len(tokens), batch_size):
        part = {k: jnp.asarray(v[i : i + batch_size]) for k, v in masks.items()}
        first, doc, top, median = _layer_stats(
            model, jnp.asarray(tokens[i : i + batch_size], jnp.int32), part
        )
        weights.append(len(tokens[i : i + batch_size]))
        firsts.append(np.asarray(first, np.float64))
        tops.append(np.asarray(top, np.float64))
        medians.append(np.asarray(median, np.float64))
        if doc is not None:
            docs.append((np.asarray(doc[0], np.float64), np.asarray(doc[1], np.float64)))
    w = np.asarray(weights, np.float64)[:, None]
    doc_mass = None
    if docs and sum(n.sum() for _, n in docs) > 0:
        total, count = sum(s for s, _ in docs), sum(n for _, n in docs)
        doc_mass = tuple(float(x) for x in total / np.maximum(count, 1))
    return Sinks(
        tuple(float(x) for x in (np.stack(firsts) * w).sum(0) / w.sum()),
        doc_mass,
        tuple(float(x) for x in np.max(np.stack(tops), axis=0)),
        tuple(float(x) for x in (np.stack(medians) * w).sum(0) / w.sum()),
        int(tokens.size),
    )


def measure(inputs: ModelInputs) -> Sinks:
    """Over ``outlier_examples`` sequences of the run's validation text at the trained context
    (the activation outliers' text: a needle run's haystack, MQAR's own examples)."""
    tokens, masks = activation_text(inputs)
    return sinks(inputs.model, tokens, batch_size=min(inputs.settings.batch_size, 4), masks=masks)


# ---------------------------------------------------------------------------- the section
def _mean_over_seeds(rs, get) -> np.ndarray:
    return np.mean([np.asarray(get(r.get("sinks")), float) for r in rs], axis=0)


def figure(run: Run) -> str:
    """The first token's mass and the massive-activation ratio against depth, one line per
    model (mean over seeds)."""
    name = "eval_sinks.png"
    measured = {lab: rs for lab, rs in run.groups.items() if rs[0].get("sinks") is not None}
    series = {}
    for lab, rs in measured.items():
        first = _mean_over_seeds(rs, lambda s: s.first_token)
        massive = _mean_over_seeds(rs, lambda s: s.massive)
        layers = np.arange(1, first.size + 1, dtype=float)
        series[f"{lab}: first token's mass"] = (layers, first)
        series[f"{lab}: max / median |hidden|"] = (layers, massive)
    plots.lines(
        series,
        xlabel="layer",
        ylabel="first token's attention mass; max / median |hidden state|",
        symlog_threshold=0.01,  # DIFF's differential mass may be negative
        title="attention sinks and massive activations (mean over seeds)",
        path=storage.join(run.run_dir, name),
    )
    return name


def section(run: Run) -> list[str]:
    measured = {lab: rs for lab, rs in run.groups.items() if rs[0].get("sinks") is not None}
    if not measured:
        return []
    names = [n for lab, n in zip(run.labels, run.names()) if lab in measured]
    depth = len(next(iter(measured.values()))[0].get("sinks").first_token)
    has_doc = all(r.get("sinks").document_start is not None for rs in measured.values() for r in rs)
    L = ["## 7. Attention sinks and massive activations", ""]
    columns = ["layer"] + [f"{n}: first token" for n in names]
    columns += [f"{n}: document start" for n in names] if has_doc else []
    columns += [f"{n}: max / median" for n in names]
    rows = []
    for i in range(depth):

        def cell(lab, field, spec):
            return run.cell(lab, lambda r: getattr(r.get("sinks"), field)[i], spec)

        row = [str(i + 1)] + [cell(lab, "first_token", "{:.3f}") for lab in measured]
        row += [cell(lab, "document_start", "{:.3f}") for lab in measured] if has_doc else []
        row += [cell(lab, "massive", "{:.1f}") for lab in measured]
        rows.append(row)
    L += table(columns, rows)
    tokens = next(iter(measured.values()))[0].get("sinks").tokens
    L += [
        "",
        f"Over {tokens:,} tokens of validation text: the attention weight on the window's first "
        f"token (mean over heads and the queries after it; DIFF: of A1 - lambda A2)"
        + (", on each query's own document start" if has_doc else "")
        + ", and the largest |hidden state| of each block's output over its median (mean over "
        f"seeds). What it measures: {DOC}, section 7.",
        "",
    ]
    L += paired(
        run.groups,
        lambda r: float(np.mean(r.get("sinks").first_token)),
        "first token's mass, mean over layers",
    )
    L += paired(
        run.groups,
        lambda r: float(np.max(r.get("sinks").massive)),
        "largest max / median |hidden state| over layers",
        spec="{:+.1f}",
    )
    L += [""]
    return L + image("attention sinks and massive activations", figure(run))


ANALYSIS = Analysis("sinks", Sinks, measure, section)
