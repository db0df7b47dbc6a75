"""Contribution by ablation: how much the answer's log-probability changes when one head's
attention to one group of positions is removed at the answer-producing positions.

Rows and groups are those of :mod:`.allocation`: the answer-producing positions of each query
(``answer_rows``) and the five key categories (:data:`~.allocation.CATEGORIES`: answer, needle,
other needles, noise context, rest). For one (layer, head, category) and one query:

- standard attention: the category's columns of the head's softmax map are set to 0 in the
  query's answer-producing rows (no renormalisation), and the head's output of those rows is
  that row of the map times V;
- DIFF: the category's columns of the differential map ``A1 - lambda A2`` are set to 0 (both
  maps' columns), and the head's output goes through the layer's own output step (V1: the
  per-head RMSNorm times ``1 - lambda_init``), so the ablation is after the per-head norm, as
  the model computes it.

Every other row and head keeps its output; the model then runs on from that layer and the
change in ``log p(answer)`` (summed over the answer's tokens) is the ablation's ``delta``:
negative when the removed positions supported the answer. The whole forward pass is computed
with the reference math (:mod:`diffjax.kernels.reference`), never the Pallas kernels.

A share of attention (:mod:`.allocation`) weighs each position by its weight alone; the head's
output is the weights times the values, and DIFF then normalises it per head, so a small weight
on a large value, or a small difference amplified by the norm, can carry the answer. The
ablation measures that contribution directly.

Each query is ablated on its own (its rows only; the other queries' rows keep their outputs),
one (layer, head, category) at a time; the ablations of all queries are batched with
``jax.lax.map`` over (query, head, category), so a tiny model's evaluation takes seconds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.nn.attention import Projection, attend
from diffjax.kernels import reference

from diffjax.evaluate.allocation import CATEGORIES, answer_rows, position_categories
from diffjax.evaluate.analysis import DOC, Analysis, Run, model_name, paired, table
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.probe import for_analysis
from diffjax.evaluate.stats import fmt_mean_std

# the ablations of one layer run on from it in chunks of this many (query, head, category)
_CHUNK = 16


# ---------------------------------------------------------------------------- one layer, pure
def head_maps(p: Projection, *, causal: bool, scale: float) -> jax.Array:
    """``[B, H, T, S]`` float32: each head's map, the softmax map for standard attention and
    ``A1 - lambda A2`` for DIFF (lambda V1's scalar or V2's per-token ``[B, T, H]``). Masked
    entries are 0."""
    kw = dict(causal=causal, scale=scale)
    a1 = reference.attention_weights(p.q, p.k, **kw)
    if p.q2 is None:
        return a1
    a2 = reference.attention_weights(p.q2, p.k if p.k2 is None else p.k2, **kw)
    lam = jnp.asarray(p.lam, jnp.float32)
    row_lam = lam if lam.ndim == 0 else jnp.transpose(lam, (0, 2, 1))[..., None]  # [B, H, T, 1]
    return a1 - row_lam * a2


def head_values(v: jax.Array, num_heads: int) -> jax.Array:
    """``[B, S, H, dv]`` float32: the value each query head reads (kv head ``i // (H / H_kv)``)
    from ``v`` ``[B, S, H_kv, dv]``."""
    return jnp.repeat(v.astype(jnp.float32), num_heads // v.shape[2], axis=2)


def head_outputs(w: jax.Array, vh: jax.Array) -> jax.Array:
    """``[B, T, H, dv]`` float32: each head's output, its map ``w`` ``[B, H, T, S]`` times its
    values ``vh`` ``[B, S, H, dv]``."""
    return jnp.einsum("bhts,bshd->bthd", w, vh)


def group_terms(w: jax.Array, vh: jax.Array, rows: jax.Array, onehot: jax.Array) -> jax.Array:
    """``[B, R, V, H, C, dv]``: what each category's positions add to each head's output at
    each answer-producing row, ``sum_{s in c} w[b, h, row, s] v[b, s, h]``, for maps ``w``
    ``[B, H, T, S]``, values ``vh`` ``[B, S, H, dv]``, rows ``[B, R, V]`` and the category
    one-hots of each query's keys ``[B, R, S, C]``."""
    sel = w[jnp.arange(w.shape[0])[:, None, None], :, rows]  # [B, R, V, H, S]
    return jnp.einsum("brvhs,brsc,bshd->brvhcd", sel, onehot, vh)


def ablate(o: jax.Array, rows: jax.Array, terms: jax.Array, r, h, c) -> jax.Array:
    """The heads' outputs ``o`` ``[B, T, H, dv]`` with category ``c``'s term removed from head
    ``h`` at query ``r``'s rows (``rows`` ``[B, R, V]``, ``terms`` from :func:`group_terms`):
    the output of the map whose columns of ``c`` are zeroed in those rows. Other rows and
    heads are unchanged."""
    b = jnp.arange(o.shape[0])[:, None]
    return o.at[b, rows[:, r], h].add(-terms[:, r, :, h, c])


# ---------------------------------------------------------------------------- the model
def layer_heads(layer, x: jax.Array):
    """``(maps [B, H, T, S], values [B, S, H, dv], outputs [B, T, H, dv])`` of an attention
    ``layer`` on its input ``x`` ``[B, T, D]`` (default positions, no segments)."""
    p = layer.project(x)
    w = head_maps(p, causal=layer.causal, scale=layer.scale)
    vh = head_values(p.v, p.q.shape[2])
    return w, vh, head_outputs(w, vh)


def finish_block(block, x: jax.Array, o: jax.Array) -> jax.Array:
    """The rest of a block from its heads' outputs ``o`` ``[B, T, H, dv]``: the attention
    layer's output step (V1: per-head norm and scale; the gate, from the layer's input; out_proj),
    the residual and the FFN."""
    y = x + block.attn.output(o, block.attn_norm(x)).astype(x.dtype)
    return y + block.ffn(block.ffn_norm(y))


def reference_block(block, x: jax.Array) -> jax.Array:
    """``block(x)`` with its attention computed by the reference math."""
    layer = block.attn
    p = layer.project(block.attn_norm(x))
    o = attend(p, scale=layer.scale, impl="xla", causal=layer.causal)
    return finish_block(block, x, o)


def answer_logp(model, x: jax.Array, rows: jax.Array, answer: jax.Array) -> jax.Array:
    """``[B, R]``: ``log p`` of each query's answer (summed over its tokens ``answer``
    ``[B, R, V]``) from the last block's output ``x`` ``[B, T, D]`` at its rows ``[B, R, V]``."""
    b, r, v = rows.shape
    xr = x[jnp.arange(b)[:, None], rows.reshape(b, r * v)]  # [B, R V, D]
    lp = jax.nn.log_softmax(model._logits(xr), axis=-1)  # [B, R V, vocab]
    tok = jnp.take_along_axis(lp, answer.reshape(b, r * v)[..., None], axis=-1)[..., 0]
    return tok.reshape(b, r, v).sum(-1)


def _run_on(model, layer: int, x, o, rows, answer):
    """``log p(answer)`` ``[B, R]`` with block ``layer``'s heads' outputs ``o`` (``x``: its
    input) and the later blocks computed as usual."""
    x = finish_block(model.layers[layer], x, o)
    for block in model.layers[layer + 1 :]:
        x = reference_block(block, x)
    return answer_logp(model, x, rows, answer)


def _chunk(n: int) -> int:
    """The largest divisor of ``n`` up to ``_CHUNK``: ``lax.map``'s batch, with no remainder
    to compile apart."""
    return max(k for k in range(1, min(n, _CHUNK) + 1) if n % k == 0)


def _variants(num_r: int, num_h: int, num_c: int) -> jax.Array:
    """``[R H C, 3]``: every (query, head, category), in that order."""
    grid = jnp.meshgrid(jnp.arange(num_r), jnp.arange(num_h), jnp.arange(num_c), indexing="ij")
    return jnp.stack(grid, -1).reshape(-1, 3)


@nnx.jit
def _deltas(model, tokens, rows, onehot, answer):
    """``(delta [L, B, R, H, C], base log p [B, R])`` (see :func:`contribution_by_ablation`)."""
    x = model.embed(tokens)
    num_r, num_c = rows.shape[1], onehot.shape[-1]
    ablated = []
    for i, block in enumerate(model.layers):
        w, vh, o = layer_heads(block.attn, block.attn_norm(x))
        terms = group_terms(w, vh, rows, onehot)  # [B, R, V, H, C, dv]
        num_h = w.shape[1]

        def one(idx, i=i, x=x, o=o, terms=terms):
            r, h, c = idx[0], idx[1], idx[2]
            lp = _run_on(model, i, x, ablate(o, rows, terms, r, h, c), rows, answer)
            return lp[:, r]  # [B]

        variants = _variants(num_r, num_h, num_c)
        lp = jax.lax.map(one, variants, batch_size=_chunk(variants.shape[0]))  # [R H C, B]
        ablated.append(lp.reshape(num_r, num_h, num_c, -1).transpose(3, 0, 1, 2))  # [B, R, H, C]
        x = finish_block(block, x, o)
    base = answer_logp(model, x, rows, answer)  # [B, R] the intact model
    return jnp.stack(ablated) - base[None, :, :, None, None], base


def best_ablation_head(per_example: np.ndarray, category: int = 0) -> dict:
    """The (layer, head) whose ablation of ``category`` (default: the answer) changes the
    answer's log-probability most, by ``|mean delta|`` over the even examples of
    ``per_example`` ``[L, B, H, C]``, and its mean delta over the odd examples (held out from
    the choice). With a single example it is chosen and measured on that one (``held_out``
    False)."""
    pe = np.asarray(per_example, np.float64)
    if pe.ndim != 4 or pe.shape[1] == 0:
        raise ValueError(
            f"best_ablation_head: expected per-example deltas [layers, examples, heads, "
            f"categories] with at least one example, got shape {pe.shape}"
        )
    held_out = pe.shape[1] >= 2
    pick, measure = (pe[:, 0::2], pe[:, 1::2]) if held_out else (pe, pe)
    chosen = np.abs(pick[..., category].mean(1))  # [L, H]
    measured = measure[..., category].mean(1)
    if not np.isfinite(chosen).any():
        return {"layer": None, "head": None, "delta": float("nan"), "held_out": held_out}
    layer, head = np.unravel_index(int(np.nanargmax(chosen)), chosen.shape)
    return {
        "layer": int(layer),
        "head": int(head),
        "delta": float(measured[layer, head]),
        "held_out": held_out,
    }


@dataclasses.dataclass
class Ablation:
    """``delta[layer, head, category]``: the mean over queries and examples of the change in
    ``log p(answer)`` (nats, summed over the answer's tokens) when that head's attention to
    that category is removed at the answer-producing rows (negative: the positions supported
    the answer); ``per_example`` ``[L, B, H, C]`` (mean over queries); ``base_logp``: the
    mean ``log p(answer)`` of the intact model; ``best_head``: :func:`best_ablation_head` of
    the answer category."""

    delta: np.ndarray  # [L, H, C]
    per_example: np.ndarray | None  # [L, B, H, C] (not in eval.json: None when read back)
    base_logp: float
    best_head: dict
    map_kind: str  # "softmax" or "differential"

    def layer_sums(self, category: str = "answer") -> np.ndarray:
        """``[L]``: the deltas of ``category`` summed over each layer's heads (each head
        ablated alone)."""
        return self.delta[..., CATEGORIES.index(category)].sum(-1)

    def to_dict(self) -> dict:
        return {
            "categories": list(CATEGORIES),
            "delta": self.delta.tolist(),
            "answer_layer_sums": self.layer_sums().tolist(),
            "base_logp": self.base_logp,
            "best_head": self.best_head,
            "map": self.map_kind,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Ablation":
        return cls(np.asarray(d["delta"], float), None, d["base_logp"], d["best_head"], d["map"])

    def head(self) -> dict | None:
        """The chosen head (``best_head``), None when there is none."""
        h = self.best_head
        return h if h and h.get("layer") is not None else None

    def head_delta(self) -> float | None:
        """The chosen head's held-out answer-category Δ log p, None without one."""
        h = self.head()
        return None if h is None or not np.isfinite(h["delta"]) else float(h["delta"])


def contribution_by_ablation(model, batch: dict, *, batch_size: int = 8) -> Ablation:
    """The change in ``log p(answer)`` when one head's attention to one category of positions
    is removed at a needle batch's answer-producing rows, for every (layer, head, category)
    (see the module docstring)."""
    model = for_analysis(model)
    n = len(batch["inputs"])
    per_example, base = [], []
    for i in range(0, n, batch_size):
        chunk = {k: v[i : i + batch_size] for k, v in batch.items()}
        rows = answer_rows(chunk)  # [B, R, V]
        b = np.arange(len(rows))[:, None, None]
        onehot = np.eye(len(CATEGORIES), dtype=np.float32)[position_categories(chunk)]
        delta, lp = _deltas(
            model,
            jnp.asarray(chunk["inputs"], jnp.int32),
            jnp.asarray(rows),
            jnp.asarray(onehot),
            jnp.asarray(np.asarray(chunk["targets"])[b, rows], jnp.int32),
        )
        per_example.append(np.asarray(delta, np.float64).mean(2))  # [L, B, H, C]
        base.append(np.asarray(lp, np.float64).mean(1))
    per_example = np.concatenate(per_example, axis=1)
    return Ablation(
        per_example.mean(1),
        per_example,
        float(np.concatenate(base).mean()),
        best_ablation_head(per_example, CATEGORIES.index("answer")),
        "differential" if model.config.is_diff else "softmax",
    )


# ---------------------------------------------------------------------------- the analysis
def measure(inputs: ModelInputs) -> Ablation | None:
    """On the allocation's examples, for a run trained on the needle task (None otherwise)."""
    if inputs.needle_batch is None or inputs.data.source != "needle":
        return None
    return contribution_by_ablation(
        inputs.model, inputs.needle_batch, batch_size=inputs.settings.batch_size
    )


def _get(r) -> Ablation | None:
    got = r.get("ablation")
    return got if got is not None and got.head() is not None else None


def head_delta(r) -> float | None:
    """A model's ablation head's held-out answer-category Δ log p, None without one."""
    a = _get(r)
    return None if a is None else a.head_delta()


def layer_sum(r, layer: int) -> float | None:
    """The answer-category Δ log p of ``layer``, summed over its heads (each ablated alone)."""
    a = r.get("ablation")
    if a is None or layer >= len(a.delta):
        return None
    return float(a.layer_sums()[layer])


def head_share(r) -> float | None:
    """The allocation's answer share (over every example) of the ablation's chosen head."""
    a, alloc = _get(r), r.get("allocation")
    if a is None or alloc is None or alloc.per_head is None:
        return None
    h = a.head()
    return float(alloc.per_head[h["layer"], h["head"], CATEGORIES.index("answer")])


def section(run: Run) -> list[str]:
    """Per model, the answer-category contribution by ablation: the chosen head's held-out
    Δ log p beside its answer share, and each layer's Δ log p summed over heads."""
    found = {lab: [r for r in rs if _get(r)] for lab, rs in run.groups.items()}
    if not any(found.values()):
        return []
    num_layers = max(len(_get(r).delta) for rs in found.values() for r in rs)
    rows = []
    for rs in found.values():
        if not rs:
            continue
        heads = ", ".join(f"L{_get(r).head()['layer']}.H{_get(r).head()['head']}" for r in rs)
        nheads = _get(rs[0]).delta.shape[:2]
        rows.append(
            [
                model_name(rs[0].label, rs),
                f"{nheads[0]} x {nheads[1]}",
                heads,
                fmt_mean_std([head_delta(r) for r in rs], "{:.3f}"),
                fmt_mean_std([head_share(r) for r in rs], "{:.3f}"),
            ]
            + [fmt_mean_std([layer_sum(r, i) for r in rs], "{:.3f}") for i in range(num_layers)]
        )
    held = all(_get(r).head()["held_out"] for rs in found.values() for r in rs)
    L = [
        "**Contribution by ablation.** The change in the answer's log-probability (nats, summed "
        "over its tokens, mean over queries and examples) when one head's attention to the "
        "asked needle's value is removed at the answer-producing positions: those columns of "
        "the head's map (softmax, or A1 − λA2 for DIFF) set to 0 without renormalising, the "
        "head's output then computed as the model computes it (DIFF V1: through its per-head "
        "norm), negative where the value supported the answer; per seed the head with the "
        "largest |Δ| "
        + (
            "chosen on the even examples and measured on the odd ones"
            if held
            else "chosen and measured on the same examples (too few to hold any out)"
        )
        + ", beside its answer share (section 2's normalisation, every example), and each "
        "layer's Δ summed over its heads (each ablated alone; every category per head is in "
        f"eval.json). What it measures: {DOC}, section 2.",
        "",
    ]
    L += table(
        [
            "model",
            "layers x heads",
            "head per seed",
            "its Δ log p (held out)",
            "its answer share",
        ]
        + [f"Σ heads Δ log p, layer {i}" for i in range(num_layers)],
        rows,
    )
    lines_ = paired(run.groups, head_delta, "ablation head's Δ log p", "nats")
    for i in range(num_layers):
        lines_ += paired(
            run.groups,
            lambda r, i=i: layer_sum(r, i),
            f"layer {i}'s Δ log p summed over heads",
            "nats",
        )
    return L + ([""] + lines_ if lines_ else []) + [""]


ANALYSIS = Analysis("ablation", Ablation, measure, section)
