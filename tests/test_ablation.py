"""Contribution by ablation: a hand-built head whose contribution is known, DIFF's ablated output
through its per-head norm against numpy, the full-model change in log p(answer) against a
forward pass recomputed by hand with the modified map, and the report's table from
``evaluate_model`` on a tiny needle model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.nn.attention import Projection
from diffjax.data import DataConfig, NeedleData, SyntheticData
from diffjax.evaluate import (
    CATEGORIES,
    EvalSettings,
    attention_maps,
    best_ablation_head,
    contribution_by_ablation,
    evaluate_model,
    needle_task,
    noise_floor_closed_form,
    position_categories,
    task_examples,
)
from diffjax.evaluate import ablation as abl
from diffjax.evaluate import noise_floor as nf
from diffjax.evaluate.allocation import answer_rows
from diffjax.evaluate.report import render

# A needle task small enough for a 64-token context: 2 needles, 2 queries, short sentences.
DATA = DataConfig(
    source="needle",
    seq_len=64,
    needle=NeedleData(
        num_needles=2,
        num_queries=2,
        key_len=1,
        value_len=2,
        template="\n${key}{value}\n",
        query_template="\n${key}{value}",
    ),
)


def _batch(num=2):
    return task_examples(
        needle_task(DATA, seq_len=64, num_needles=2, num_queries=2, num_examples=num)
    )


def _model(attention, layers=2, heads=2, seed=1):
    cfg = diffjax.ModelConfig(
        vocab_size=259,
        d_model=32,
        num_layers=layers,
        num_heads=heads,
        attention=attention,
        max_seq_len=96,
    )
    return diffjax.TransformerLM(cfg, rngs=nnx.Rngs(seed))


# ---------------------------------------------------------------------------- one head by hand
def test_removing_the_only_attended_position_removes_exactly_its_value():
    """One head, every query e0: key 2 is e0 * 100 (the row's whole weight), keys 0 and 1 are
    e0 * -1000 (weight exactly 0), the rest 0 (weight e^-50). Removing key 2 from row 5 takes
    its value out of that row's output and leaves every other row alone; removing keys 0 and 1
    changes nothing at all."""
    t, d = 6, 4
    e0 = np.eye(d, dtype=np.float32)[0]
    q = np.tile(e0, (1, t, 1, 1))  # [1, T, 1, d]
    k = np.zeros((1, t, 1, d), np.float32)
    k[0, 2, 0], k[0, :2, 0] = 100 * e0, -1000 * e0
    v = np.random.default_rng(0).standard_normal((1, t, 1, 3)).astype(np.float32)
    rows = jnp.asarray([[[5]]])  # [B, R, V]
    cats = np.full((1, 1, t), 2)
    cats[0, 0, 2], cats[0, 0, :2] = 0, 1  # 0: the attended key, 1: the unattended ones
    onehot = jnp.asarray(np.eye(len(CATEGORIES), dtype=np.float32)[cats])

    @jax.jit
    def run(q, k, v):
        p = Projection(q, k, v)
        w = abl.head_maps(p, causal=True, scale=d**-0.5)
        vh = abl.head_values(p.v, 1)
        o = abl.head_outputs(w, vh)
        terms = abl.group_terms(w, vh, rows, onehot)  # [B, R, V, H, C, dv]
        return w, vh, o, abl.ablate(o, rows, terms, 0, 0, 0), abl.ablate(o, rows, terms, 0, 0, 1)

    w, vh, o, removed, unattended = run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert float(w[0, 0, 5, 2]) == 1.0 and float(w[0, 0, 5, :2].sum()) == 0.0
    np.testing.assert_allclose(o[0, 5, 0] - removed[0, 5, 0], v[0, 2, 0], rtol=1e-6)
    np.testing.assert_allclose(removed[0, 5, 0], 0.0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(removed[0, :5]), np.asarray(o[0, :5]))
    np.testing.assert_array_equal(np.asarray(unattended), np.asarray(o))
    # the same as zeroing those columns of the map and multiplying again
    zeroed = np.asarray(w).copy()
    zeroed[0, 0, 5, 2] = 0.0
    np.testing.assert_allclose(removed, np.einsum("bhts,bshd->bthd", zeroed, vh), atol=1e-6)


def _np_softmax(q, k, scale):
    """Causal softmax maps ``[B, H, T, S]`` (float64) for q ``[B, T, H, d]``, k ``[B, S, H, d]``."""
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    t = q.shape[1]
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@nnx.jit
def _ablated_layer_output(layer, x, rows, onehot, head, c):
    """The layer's output ``[B, T, D]`` with category ``c`` removed from ``head`` in query 0's
    rows, and its projection."""
    w, vh, o = abl.layer_heads(layer, x)
    terms = abl.group_terms(w, vh, rows, onehot)
    return layer.output(abl.ablate(o, rows, terms, 0, head, c), x), layer.project(x)


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_diff_ablation_matches_numpy_through_the_per_head_norm(kind):
    """Zero a category's columns of A1 - lambda A2 (V1: the layer's scalar; V2: per token) in
    the answer rows, multiply by V, apply the per-head RMSNorm times (1 - lambda_init) (V1) and
    out_proj: the layer's output at every row, in numpy, against the ablation's."""
    h, hkv, t = 2, 1, 8
    rngs = nnx.Rngs(4)
    if kind == "diff_v1":
        layer = diffjax.MultiheadDiffAttn(32, 1, h, hkv, rngs=rngs)
    else:
        layer = diffjax.MultiheadDiffAttnV2(32, 1, h, hkv, rngs=rngs)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, t, 32)).astype(np.float32))
    rows = np.asarray([[[5, 6]]])
    cats = rng.integers(0, len(CATEGORIES), (1, 1, t))
    onehot = np.eye(len(CATEGORIES), dtype=np.float32)[cats]
    _, p = _ablated_layer_output(layer, x, jnp.asarray(rows), jnp.asarray(onehot), 0, 0)
    q1, q2, k1, v = (np.asarray(a, np.float64) for a in (p.q, p.q2, p.k, p.v))
    k2 = k1 if p.k2 is None else np.asarray(p.k2, np.float64)
    rep = lambda a: np.repeat(a, h // hkv, axis=2)  # noqa: E731
    a1 = _np_softmax(q1, rep(k1), layer.scale)
    a2 = _np_softmax(q2, rep(k2), layer.scale)
    lam = np.asarray(p.lam, np.float64)
    lam_rows = lam if lam.ndim == 0 else lam.transpose(0, 2, 1)[..., None]
    assert kind == "diff_v1" or lam.shape == (1, t, h)
    for head, c in ((1, 0), (0, 3)):
        diff = a1 - lam_rows * a2
        for row in rows[0, 0]:
            diff[0, head, row, cats[0, 0] == c] = 0.0
        oh = np.einsum("bhts,bshd->bthd", diff, rep(v))
        if kind == "diff_v1":
            oh = oh / np.sqrt((oh**2).mean(-1, keepdims=True) + layer.subln.eps)
            oh = oh * np.asarray(layer.subln.scale[...]) * float(layer.output_scale[...])
        expect = oh.reshape(1, t, -1) @ np.asarray(layer.out_proj.kernel[...], np.float64)
        got, _ = _ablated_layer_output(layer, x, jnp.asarray(rows), jnp.asarray(onehot), head, c)
        np.testing.assert_allclose(np.asarray(got), expect, rtol=2e-4, atol=2e-5)
        intact, _ = _ablated_layer_output(
            layer, x, jnp.asarray(rows), jnp.asarray(0 * onehot), 0, 0
        )
        assert np.abs(np.asarray(got - intact)[0, 5:7]).max() > 1e-3  # the answer rows changed
        np.testing.assert_array_equal(np.asarray(got)[0, :5], np.asarray(intact)[0, :5])


# ---------------------------------------------------------------------------- the model
@nnx.jit
def _forward_with_maps_scaled(model, tokens, keep):
    """Logits ``[B, T, vocab]`` of the model run block by block (each block's own call but
    for the value product), every block's map (softmax, or A1 - lambda A2) multiplied by
    ``keep`` ``[L, B, H, T, S]`` before the value product: ones leave the model as it is,
    zeros drop those entries without renormalising."""
    x = model.embed(tokens)
    for i, block in enumerate(model.layers):
        h = block.attn_norm(x)
        maps = attention_maps(block.attn, h)
        w = (maps["diff"] if "diff" in maps else maps["a"]) * keep[i]  # [B, H, T, S]
        v = block.attn.project(h).v
        v = jnp.repeat(v, w.shape[1] // v.shape[2], axis=2)
        y = x + block.attn.output(jnp.einsum("bhts,bshd->bthd", w, v), h)
        x = y + block.ffn(block.ffn_norm(y))
    return model._logits(x)


def _brute_force_logp(model, tokens, rows, answer, keep):
    """``log p(answer)`` ``[B, R]`` (float64) from :func:`_forward_with_maps_scaled`."""
    logits = _forward_with_maps_scaled(model, jnp.asarray(tokens), jnp.asarray(keep))
    lp = np.asarray(jax.nn.log_softmax(logits), np.float64)
    return lp[np.arange(len(lp))[:, None, None], rows, answer].sum(-1)


@pytest.mark.parametrize("attention", ["standard", "diff_v1", "diff_v2"])
def test_model_delta_matches_a_forward_pass_with_the_map_modified_by_hand(attention):
    """Every (layer, head, category) and query of a 2-layer, 2-head random model: the change in
    log p(answer) against the model run by hand with that map's columns zeroed."""
    model = _model(attention)
    batch = _batch()
    ab = contribution_by_ablation(model, batch, batch_size=2)
    tokens = batch["inputs"]
    rows = answer_rows(batch)  # [B, R, V]
    answer = np.asarray(batch["targets"])[np.arange(len(rows))[:, None, None], rows]
    cats = position_categories(batch)  # [B, R, S]
    b, t = tokens.shape
    ones = np.ones((2, b, 2, t, t), np.float32)  # [L, B, H, T, S]
    base = _brute_force_logp(model, tokens, rows, answer, ones)
    np.testing.assert_allclose(ab.base_logp, base.mean(), rtol=1e-5)
    num_r = rows.shape[1]
    expect = np.zeros((2, b, 2, len(CATEGORIES)))  # [L, B, H, C]
    for layer in range(2):
        for head in range(2):
            for c in range(len(CATEGORIES)):
                for r in range(num_r):
                    keep = ones.copy()
                    for i in range(b):  # zero category c's columns in query r's rows
                        keep[layer, i, head, rows[i, r, :, None], cats[i, r] == c] = 0.0
                    lp = _brute_force_logp(model, tokens, rows, answer, keep)
                    expect[layer, :, head, c] += (lp[:, r] - base[:, r]) / num_r
    assert ab.per_example.shape == expect.shape and ab.delta.shape == (2, 2, len(CATEGORIES))
    np.testing.assert_allclose(ab.per_example, expect, atol=2e-5)
    assert np.abs(expect).max() > 1e-3  # the check is not of zeros
    np.testing.assert_allclose(ab.layer_sums(), expect[..., 0].mean(1).sum(-1), atol=4e-5)
    assert ab.map_kind == ("softmax" if attention == "standard" else "differential")


def test_the_ablation_head_is_chosen_by_magnitude_on_held_out_examples():
    """A large negative delta on the even examples wins over a smaller positive one; its
    reported delta is the odd examples' mean, signed."""
    pe = np.zeros((2, 4, 2, len(CATEGORIES)))
    pe[1, 0::2, 0, 0], pe[1, 1::2, 0, 0] = -2.0, -0.5
    pe[0, :, 1, 0] = 1.0
    rh = best_ablation_head(pe)
    assert (rh["layer"], rh["head"], rh["held_out"]) == (1, 0, True)
    assert rh["delta"] == pytest.approx(-0.5)
    assert best_ablation_head(pe[:, :1])["held_out"] is False
    with pytest.raises(ValueError, match="per-example deltas"):
        best_ablation_head(pe[0])


# ---------------------------------------------------------------------------- the report
def test_evaluate_model_writes_the_ablation_table(tmp_path):
    """``evaluate_model`` on a tiny needle model gives the ablation's numbers, and eval.md
    shows them beside the attention shares, for DIFF and its twin."""
    data = DataConfig(
        source="needle",
        seq_len=80,
        needle=NeedleData(num_needles=1, num_queries=1, key_len=2, value_len=2),
        synthetic=SyntheticData(num_val_examples=4),
    )
    settings = EvalSettings(
        True,
        retrieval_examples=2,
        allocation_examples=4,
        val_examples=2,
        outlier_examples=1,
        bits=(4,),
        batch_size=4,
    )
    model = _model("diff_v1", layers=1, heads=1)
    r = evaluate_model(model, data, settings, log=lambda *_: None)
    ab = r["ablation"]
    assert np.asarray(ab["delta"]).shape == (1, 1, len(CATEGORIES))
    assert ab["best_head"]["layer"] == 0 and ab["best_head"]["held_out"]
    results = []
    for label, shift in (("diff", 0.0), ("standard", 0.1)):
        for seed in (0, 1):
            x = dict(r, label=label, seed=seed, path=".", params=1, step=2, tokens=10)
            x["ablation"] = dict(ab, best_head=dict(ab["best_head"]))
            x["ablation"]["best_head"]["delta"] += shift * (seed + 1)
            results.append(x)
    noise = noise_floor_closed_form(nf.DEFAULT_NS, nf.REPORT_MARGIN, nf.REPORT_LAMBDA)
    text = render(str(tmp_path), data, settings, results, noise)
    assert "**Contribution by ablation.**" in text
    i = text.index("**Contribution by ablation.**")
    assert text.index("**The retrieval head.**") < i < text.index("## 3. Activation outliers")
    assert "| its Δ log p (held out) | its answer share | Σ heads Δ log p, layer 0 |" in text
    share = r["allocation"]["per_head"][0][0][0]
    delta, total = ab["best_head"]["delta"], ab["answer_layer_sums"][0]
    assert (
        f"| diff (diff_v1) | 1 x 1 | L0.H0, L0.H0 | {delta:.3f} ± 0.000 | {share:.3f} ± 0.000 | "
        f"{total:.3f} ± 0.000 |"
    ) in text
    assert "- ablation head's Δ log p (nats), DIFF minus the twin: -0.1500, 95% t-interval" in text
    assert "- layer 0's Δ log p summed over heads (nats), DIFF minus the twin: +0.0000" in text
