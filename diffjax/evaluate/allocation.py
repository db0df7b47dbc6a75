"""Attention allocation (the paper's Table 3) and the noise floor measured on a model's maps.

Rows: the answer-producing positions of each query (input positions ``answer_spans[r, 0] ..
answer_spans[r, 1] - 1``, whose outputs predict the answer digits). Columns (key positions) fall
in five categories for query r:

- ``answer``: the value digits of the needle that query r asks for (the answer span in the
  context);
- ``needle``: the rest of that needle's sentence (its key and template words);
- ``other needles``: the other needles (distractors of the same form);
- ``noise context``: the haystack text around the needles;
- ``rest``: BOS and the query text itself.

The map is the softmax map for standard attention and the differential map ``A1 - lambda A2``
for DIFF (per head, lambda the layer's scalar for V1, per token for V2). Normalisation of a row
(``normalize``): ``"abs"`` (default) divides by the row's absolute mass ``sum_j |w_ij|`` (1 for a
softmax row; for a differential row the shares are then signed fractions of its absolute mass,
and cancelled, near-zero weights give a near-zero share); ``"sum"`` divides by the row sum
(``1 - lambda`` for V1; unstable when lambda is near 1); ``"none"`` keeps raw weights. Shares are
averaged over rows, queries, examples, heads and layers. (The paper states its numbers are
averaged over heads and layers; its normalisation of the differential map is given only as an
image in microsoft/unilm issue 1654, so ``"abs"`` is our choice, stated in every report.)

The mean over heads and layers mixes the few heads that do the lookup with the rest (at 2
layers, previous-token and local heads), so :class:`Allocation` also keeps every head's shares
(``per_head``) and the **retrieval head** (:func:`best_head`): the (layer, head) with the largest
answer share, chosen on the even examples and measured on the odd ones, so that picking the
maximum of ``L x H`` noisy numbers does not inflate the figure it reports.

The analysis (:class:`Allocation` of the run's needle setting) has its section of eval.md
(with the retrieval head) and its plot here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.infra import storage

from diffjax.evaluate import paper, plots
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, model_name, paired, table
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.probe import attention_rows, capture_layers, for_analysis
from diffjax.evaluate.results import seed_mean
from diffjax.evaluate.retrieval import depth_bins, query_depths
from diffjax.evaluate.stats import fmt_mean_std

CATEGORIES = ("answer", "needle", "other needles", "noise context", "rest")
NORMALIZATIONS = ("abs", "sum", "none")


def position_categories(batch: dict) -> np.ndarray:
    """``[B, R, T]`` int: the category (index into :data:`CATEGORIES`) of each key position for
    each query of a needle batch (the needle source's fields; the queries start at
    ``query_spans[:, 0, 0]``)."""
    inputs = np.asarray(batch["inputs"])
    b, t = inputs.shape
    spans, values = np.asarray(batch["needle_spans"]), np.asarray(batch["needle_value_spans"])
    asked = np.asarray(batch["query_needle"])
    r = asked.shape[1]
    hay_end = np.asarray(batch["query_spans"])[:, 0, 0]  # [B] first query position
    cats = np.full((b, r, t), CATEGORIES.index("rest"), np.int32)
    for i in range(b):
        cats[i, :, 1 : hay_end[i]] = CATEGORIES.index("noise context")
        for j in range(r):
            for n, (s, e) in enumerate(spans[i]):
                cats[i, j, s:e] = CATEGORIES.index(
                    "needle" if n == asked[i, j] else "other needles"
                )
            vs, ve = values[i, asked[i, j]]
            cats[i, j, vs:ve] = CATEGORIES.index("answer")
    return cats


def answer_rows(batch: dict) -> np.ndarray:
    """``[B, R, V]`` int: the input positions that produce each query's answer tokens."""
    spans = np.asarray(batch["answer_spans"])
    width = int((spans[..., 1] - spans[..., 0]).max())
    if np.any(spans[..., 1] - spans[..., 0] != width):
        raise ValueError("answer_rows: answers of different lengths in one batch")
    return spans[..., :1] + np.arange(width)


def row_category_mass(w: jax.Array, rows: jax.Array, onehot: jax.Array):
    """For maps ``w`` ``[B, H, T, S]``, rows ``[B, R, V]`` and category one-hots ``[B, R, S, C]``:
    the raw weight per category ``[B, H, R, V, C]``, the absolute row mass and the row sum
    ``[B, H, R, V]``. Pure; traceable."""
    b = w.shape[0]
    sel = w[jnp.arange(b)[:, None, None], :, rows]  # [B, R, V, H, S]
    return selected_category_mass(jnp.transpose(sel, (0, 3, 1, 2, 4)), onehot)


def selected_category_mass(sel: jax.Array, onehot: jax.Array):
    """:func:`row_category_mass` from the rows' maps alone: ``sel`` ``[B, H, R, V, S]`` (row
    ``(r, v)`` the map row of query r's v-th answer-producing position), one-hots
    ``[B, R, S, C]``. Pure; traceable."""
    raw = jnp.einsum("bhrvs,brsc->bhrvc", sel, onehot)
    return raw, jnp.abs(sel).sum(-1), sel.sum(-1)


def normalize_shares(raw, abs_mass, row_sum, normalize: str):
    """``raw`` ``[..., C]`` divided as ``normalize`` says (see the module docstring)."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if normalize == "none":
        return raw
    den = abs_mass if normalize == "abs" else row_sum
    den = np.where(np.abs(den) > 1e-12, den, np.nan)
    return raw / den[..., None]


@nnx.jit
def _category_mass(model, tokens, rows, onehot):
    _, attn_in, _ = capture_layers(model, tokens)
    b, r, v = rows.shape
    out = []
    for block, h in zip(model.layers, attn_in):  # only the answer rows' maps: [B, H, R*V, S]
        maps = attention_rows(block.attn, h, rows.reshape(b, r * v))
        sel = maps["diff"] if "diff" in maps else maps["a"]
        out.append(selected_category_mass(sel.reshape(sel.shape[:2] + (r, v, -1)), onehot))
    return [jnp.stack(x) for x in zip(*out)]  # each [L, ...]


def category_mass(model, batch: dict):
    """Raw per-category weights ``[L, B, H, R, V, C]``, absolute row mass and row sum
    ``[L, B, H, R, V]`` of ``model``'s maps (softmax, or the differential map for DIFF) on a
    needle batch, for the answer-producing rows."""
    model = for_analysis(model)
    cats = position_categories(batch)
    onehot = np.eye(len(CATEGORIES), dtype=np.float32)[cats]
    raw, absm, tot = _category_mass(
        model,
        jnp.asarray(batch["inputs"], jnp.int32),
        jnp.asarray(answer_rows(batch)),
        jnp.asarray(onehot),
    )
    return np.asarray(raw), np.asarray(absm), np.asarray(tot)


def best_head(per_example: np.ndarray, category: int = 0) -> dict:
    """The retrieval head from per-example shares ``[L, B, H, C]``: the (layer, head) whose mean
    share of ``category`` (default: the answer) over the even examples is largest, and its mean
    share over the odd examples (held out from the choice). With a single example it is chosen
    and measured on that one (``held_out`` False). NaN shares (rows with no mass) are skipped."""
    pe = np.asarray(per_example, np.float64)
    if pe.ndim != 4 or pe.shape[1] == 0:
        raise ValueError(
            f"best_head: expected per-example shares [layers, examples, heads, "
            f"categories] with at least one example, got shape {pe.shape}"
        )
    held_out = pe.shape[1] >= 2
    pick, measure = (pe[:, 0::2], pe[:, 1::2]) if held_out else (pe, pe)
    with _quiet_nanmean():
        chosen = np.nanmean(pick[..., category], axis=1)  # [L, H]
        measured = np.nanmean(measure[..., category], axis=1)
    if not np.isfinite(chosen).any():
        return {"layer": None, "head": None, "share": float("nan"), "held_out": held_out}
    layer, head = np.unravel_index(int(np.nanargmax(chosen)), chosen.shape)
    return {
        "layer": int(layer),
        "head": int(head),
        "share": float(measured[layer, head]),
        "held_out": held_out,
    }


@contextlib.contextmanager
def _quiet_nanmean():
    """Silences numpy's "mean of empty slice" warning (an all-NaN slice gives NaN, as meant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@dataclasses.dataclass
class Allocation:
    """Mean share per (depth bin, category), averaged over layers, heads, rows, queries and
    examples; ``count`` queries per bin; ``per_layer`` ``[L, C]`` over every depth;
    ``per_head`` ``[L, H, C]`` over every depth; ``retrieval_head``: :func:`best_head` of the
    answer share."""

    depths: list[float]
    shares: np.ndarray  # [D, C]
    count: np.ndarray  # [D]
    per_layer: np.ndarray  # [L, C]
    normalize: str
    map_kind: str  # "softmax" or "differential"
    per_head: np.ndarray | None = None  # [L, H, C]
    retrieval_head: dict | None = None

    def overall(self) -> np.ndarray:
        w = self.count / max(self.count.sum(), 1)
        return np.nansum(self.shares * w[:, None], 0)

    def to_dict(self) -> dict:
        return {
            "depths": self.depths,
            "categories": list(CATEGORIES),
            "shares": self.shares.tolist(),
            "count": self.count.tolist(),
            "per_layer": self.per_layer.tolist(),
            "normalize": self.normalize,
            "map": self.map_kind,
            "per_head": None if self.per_head is None else self.per_head.tolist(),
            "retrieval_head": self.retrieval_head,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Allocation":
        per_head = d.get("per_head")  # older files: neither per_head nor the retrieval head
        return cls(
            d["depths"],
            np.asarray(d["shares"], float),
            np.asarray(d["count"]),
            np.asarray(d.get("per_layer", []), float),
            d.get("normalize", "abs"),
            d.get("map", ""),
            None if per_head is None else np.asarray(per_head, float),
            d.get("retrieval_head"),
        )

    def answer_overall(self) -> float:
        """The answer's share over every depth bin, weighted by the bin's queries."""
        w = np.asarray(self.count, float)
        sh = np.nan_to_num(self.shares[:, CATEGORIES.index("answer")])
        return float((sh * w).sum() / max(w.sum(), 1))

    def retrieval_head_share(self) -> float | None:
        """The retrieval head's (held-out) answer share, None when none was found."""
        h = self.retrieval_head
        if not h or h.get("layer") is None or not np.isfinite(h["share"]):
            return None
        return float(h["share"])


def attention_allocation(
    model, batch: dict, *, normalize: str = "abs", num_depth_bins: int = 5, batch_size: int = 8
) -> Allocation:
    """The share of attention the answer-producing positions put on each category
    (:data:`CATEGORIES`), by depth of the asked needle (see the module docstring)."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    n = len(batch["inputs"])
    per_query, per_example = [], []  # [L, B, R, C] mean over heads and rows; [L, B, H, C]
    for i in range(0, n, batch_size):
        chunk = {k: v[i : i + batch_size] for k, v in batch.items()}
        raw, absm, tot = category_mass(model, chunk)
        shares = normalize_shares(raw, absm, tot, normalize)  # [L, B, H, R, V, C]
        with _quiet_nanmean():
            per_query.append(np.nanmean(shares, axis=(2, 4)))
            per_example.append(np.nanmean(shares, axis=(3, 4)))
    per_query = np.concatenate(per_query, axis=1)  # [L, B, R, C]
    per_example = np.concatenate(per_example, axis=1)  # [L, B, H, C]
    bins = depth_bins(query_depths(batch), num_depth_bins)  # [B, R]
    mean_lq = per_query.mean(0)  # [B, R, C] over layers
    shares = np.full((num_depth_bins, len(CATEGORIES)), np.nan)
    count = np.zeros(num_depth_bins, int)
    for d in range(num_depth_bins):
        sel = bins == d
        count[d] = int(sel.sum())
        if count[d]:
            shares[d] = mean_lq[sel].mean(0)
    centres = list(np.linspace(0, 1, num_depth_bins)) if num_depth_bins > 1 else [0.5]
    kind = "differential" if model.config.is_diff else "softmax"
    with _quiet_nanmean():
        per_head = np.nanmean(per_example, axis=1)  # [L, H, C]
    return Allocation(
        [float(c) for c in centres],
        shares,
        count,
        per_query.mean(axis=(1, 2)),
        normalize,
        kind,
        per_head,
        best_head(per_example, CATEGORIES.index("answer")),
    )


def _num_distractors(batch) -> float:
    cats = position_categories(batch)
    dis = (cats == CATEGORIES.index("other needles")) | (cats == CATEGORIES.index("noise context"))
    return float(dis.sum(-1).mean())


def measured_noise_floor(model, batch: dict, *, batch_size: int = 8) -> dict[str, float]:
    """The noise floor on the model's own maps: per answer-producing row, the weight on the
    answer span (signal) and the total weight on the needles' distractors and the haystack
    (``other needles`` + ``noise context``), raw (a differential row sums to ``1 - lambda``)
    and as a share of the row's absolute mass; averaged over rows, heads, layers and examples.
    ``snr``: mean signal / mean distractors, None when the distractor total is not positive
    (a differential map's can be zero or negative: no ratio means anything there)."""
    n = len(batch["inputs"])
    raws, norms = [], []
    a, o, nc = (CATEGORIES.index(c) for c in ("answer", "other needles", "noise context"))
    for i in range(0, n, batch_size):
        chunk = {k: v[i : i + batch_size] for k, v in batch.items()}
        raw, absm, tot = category_mass(model, chunk)
        raws.append(raw.reshape(-1, raw.shape[-1]))
        norms.append(normalize_shares(raw, absm, tot, "abs").reshape(-1, raw.shape[-1]))
    raw, norm = np.concatenate(raws), np.concatenate(norms)
    out = {
        "signal": float(raw[:, a].mean()),
        "distractors": float((raw[:, o] + raw[:, nc]).mean()),
        "signal_share": float(np.nanmean(norm[:, a])),
        "distractor_share": float(np.nanmean(norm[:, o] + norm[:, nc])),
        "num_distractors": _num_distractors(batch),
    }
    out["snr"] = out["signal"] / out["distractors"] if out["distractors"] > 0 else None
    return out


# ---------------------------------------------------------------------------- the analysis
def measure(inputs: ModelInputs) -> Allocation | None:
    """On the allocation examples of the run's needle setting at the trained context; None
    where the context is too short for the needle task."""
    batch = inputs.needle_batch
    if batch is None:
        return None
    s = inputs.settings
    return attention_allocation(
        inputs.model, batch, num_depth_bins=s.depth_bins, batch_size=s.batch_size
    )


def figure(run: Run, depths) -> str:
    """Stacked shares of each category by depth, mean over seeds, one panel per model."""
    bars = {}
    for lab, rs in run.groups.items():
        sh = [r.get("allocation").shares for r in rs if r.get("allocation")]
        if sh:
            bars[model_name(lab, rs)] = (depths, seed_mean(sh))
    name = "eval_allocation.png"
    plots.allocation_bars(
        bars,
        list(CATEGORIES),
        storage.join(run.run_dir, name),
        "attention allocation of the answer-producing positions",
    )
    return name


def _get(r) -> Allocation | None:
    return r.get("allocation")


def _share(r, depth: int, c: int) -> float | None:
    a = _get(r)
    return None if a is None else a.shares[depth, c]


def section(run: Run) -> list[str]:
    L = ["## 2. Attention allocation (paper Table 3)", ""]
    measured = run.measured("allocation")
    if not measured:
        return L + ["Not measured: the run's context is too short for the needle task.", ""]
    a0 = measured[0]
    ia, inoise = CATEGORIES.index("answer"), CATEGORIES.index("noise context")
    columns = ["depth"]
    for lab in run.labels:
        columns += [f"{lab}: answer", f"{lab}: noise"]
    columns += ["paper T: answer", "paper DIFF: answer", "paper T: noise", "paper DIFF: noise"]
    rows = []
    for di, d in enumerate(a0.depths):
        row = [f"{d:.0%}"]
        for lab in run.labels:
            for c in (ia, inoise):
                row.append(run.cell(lab, lambda r: _share(r, di, c)))
        p = paper.ALLOCATION.get(round(d, 2))
        row += [f"{x:.2f}" for x in p] if p else ["", "", "", ""]
        rows.append(row)
    L += table(columns, rows)
    counts = ", ".join(f"{d:.0%}: {c}" for d, c in zip(a0.depths, a0.count))
    L += [
        "",
        f"Share of the answer-producing positions' attention on the asked needle's value "
        f"(answer) and on the haystack (noise), over heads, layers, rows and examples; queries "
        f"per depth bin: {counts}. DIFF's differential map is normalised by each row's absolute "
        f"mass (our choice), so its shares are signed and sum to less than 1 (negative entries "
        f"of A1 − λA2 cancel part of the mass; the plot gives the total); the other categories are in eval.json and the plot. What it "
        f"measures: {DOC}, section 2.",
        "",
    ]
    L += image("attention allocation", figure(run, a0.depths))
    line = paired(run.groups, _answer_overall, "answer share")
    L += line + [""] if line else []
    return L + retrieval_head_section(run)


def _answer_overall(r) -> float | None:
    a = _get(r)
    return None if a is None else a.answer_overall()


def _head_share(r) -> float | None:
    a = _get(r)
    return None if a is None else a.retrieval_head_share()


def retrieval_head_section(run: Run) -> list[str]:
    """Per model, the chosen (layer, head) of each seed, its held-out answer share, and the
    mean over every head for comparison."""
    found = {lab: [r for r in rs if _head_share(r) is not None] for lab, rs in run.groups.items()}
    if not any(found.values()):
        return []
    rows = []
    for rs in found.values():
        if not rs:
            continue
        heads = ", ".join(
            f"L{_get(r).retrieval_head['layer']}.H{_get(r).retrieval_head['head']}" for r in rs
        )
        nheads = _get(rs[0]).per_head.shape[:2]
        rows.append(
            [
                model_name(rs[0].label, rs),
                f"{nheads[0]} x {nheads[1]}",
                heads,
                fmt_mean_std([_head_share(r) for r in rs], "{:.3f}"),
                fmt_mean_std([_answer_overall(r) for r in rs], "{:.3f}"),
            ]
        )
    held = all(_get(r).retrieval_head["held_out"] for rs in found.values() for r in rs)
    L = [
        "**The retrieval head.** Per model, the (layer, head) with the largest answer share (per "
        "seed, LlayerHhead, from 0), "
        + (
            "chosen on the even examples and measured on the odd ones"
            if held
            else "chosen and measured on the same examples (too few to hold any out)"
        )
        + f"; same normalisation as above. What it measures: {DOC}, section 2.",
        "",
    ]
    L += table(
        [
            "model",
            "layers x heads",
            "retrieval head per seed",
            "its answer share (held out)",
            "mean over every head",
        ],
        rows,
    )
    line = paired(run.groups, _head_share, "retrieval head's answer share")
    caveat = (
        "A share of attention is not what a position contributes (docs/retrieval.md): read "
        "these shares beside the retrieval accuracy, and run `python "
        "benchmarks/lookup_attention.py RUN_DIR` for the causal check."
    )
    return L + ([""] + line if line else []) + ["", caveat, ""]


ANALYSIS = Analysis("allocation", Allocation, measure, section)
