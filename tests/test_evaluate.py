"""The analyses of diffjax.evaluate: a layer's maps and logits against numpy, each metric on
hand-built inputs with a known answer, the quantized forward (tolerances, and no leak into later
jitted calls), the closed-form noise floor against a brute-force softmax, the seed statistics on
hand-made numbers, run discovery in both layouts, and ``python -m diffjax.evaluate`` on tiny
trained runs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import ops
from diffjax.compare.cli import main as train_main
from diffjax.config import ConfigError
from diffjax.data import ByteTokenizer, DataConfig, NeedleData
from diffjax.data.config import needle_len, query_len
from diffjax.evaluate import (
    CATEGORIES,
    QuantizedLogits,
    absmax_quantize,
    activation_outliers,
    attention_logits,
    attention_maps,
    discover_models,
    evaluate_run,
    layer_attention_maps,
    losses_and_predictions,
    needle_task,
    noise_floor_closed_form,
    noise_floor_streamed,
    position_categories,
    query_correct,
    task_examples,
    top_magnitudes,
    validation_loss,
    with_quantized_logits,
)
from diffjax.evaluate import allocation as alloc_lib
from diffjax.evaluate import inputs as inputs_lib
from diffjax.evaluate.__main__ import main as evaluate_main
from diffjax.evaluate.positions import loss_by_position
from diffjax.evaluate.retrieval import depth_bins
from diffjax.evaluate.run import EvalSettings
from diffjax.evaluate import noise_floor as nf
from diffjax.evaluate import plots
from diffjax.evaluate import report as report_lib
from diffjax.evaluate.stats import (
    clearly_positive,
    describe_difference,
    fmt_mean_std,
    mean_std,
    paired_difference,
    ratio_of_means,
)
from diffjax.kernels import reference
from oracle import (
    diff_v1_sd,
    diff_v2_sd,
    np_diff_v1_lambda,
    np_lambda_init,
    np_linear,
    np_mask,
    np_rotary,
    np_softmax_probs,
    standard_sd,
)
from tiny import tiny_run

TOK = ByteTokenizer()


# ---------------------------------------------------------------------------- maps and logits
# A layer's maps against the numpy oracle (tests/oracle.py): weights in torch layout loaded with
# load_unilm_state_dict, as tests/test_attention.py builds its modules.
def _assert_close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=tol, rtol=tol)


def _np_maps(q, k, n_rep, mask, d):
    """Softmax maps [B, Hq, T, S] for query heads q [B,T,Hq,d] over k [B,S,Hkv,d]."""
    return np.stack(
        [
            np_softmax_probs(q[:, :, i], k[:, :, i // n_rep], d**-0.5, mask)
            for i in range(q.shape[2])
        ],
        axis=1,
    )


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_attention_maps_match_numpy(kind):
    """``attention_maps``: a1 / a2 / diff in the module's own pairing, vs numpy."""
    rng = np.random.default_rng(8)
    b, t = 2, 10
    x = rng.standard_normal((b, t, 64)).astype(np.float32)
    xf = x.astype(np.float64)
    pos = np.broadcast_to(np.arange(t), (b, t))
    mask = np_mask(t, t, True)
    zeros = nnx.initializers.zeros_init()
    if kind == "standard":
        sd = standard_sd(rng, 64, 8, 2, 8)
        layer = diffjax.MultiheadAttention(64, 0, 8, 2, kernel_init=zeros, rngs=nnx.Rngs(0))
        m = diffjax.load_unilm_state_dict(layer, sd)
        q = np_rotary(np_linear(xf, sd["q_proj.weight"]).reshape(b, t, 8, 8), pos)
        k = np_rotary(np_linear(xf, sd["k_proj.weight"]).reshape(b, t, 2, 8), pos)
        maps = nnx.jit(attention_maps)(m, jnp.asarray(x))
        _assert_close(maps["a"], _np_maps(q, k, 4, mask, 8))
        return
    if kind == "v1":
        h, hkv, d = 4, 2, 8
        sd = diff_v1_sd(rng, 64, h, hkv)
        layer = diffjax.MultiheadDiffAttn(64, 2, h, hkv, kernel_init=zeros, rngs=nnx.Rngs(0))
        m = diffjax.load_unilm_state_dict(layer, sd)
        q = np_rotary(np_linear(xf, sd["q_proj.weight"]).reshape(b, t, 2 * h, d), pos)
        k = np_rotary(np_linear(xf, sd["k_proj.weight"]).reshape(b, t, 2 * hkv, d), pos)
        a1 = _np_maps(q[:, :, 0::2], k[:, :, 0::2], h // hkv, mask, d)
        a2 = _np_maps(q[:, :, 1::2], k[:, :, 1::2], h // hkv, mask, d)
        lam = np_diff_v1_lambda(sd, np_lambda_init(2))
        diff = a1 - lam * a2
    else:
        h, hkv, d = 4, 2, 16
        sd = diff_v2_sd(rng, 64, h, hkv, d)
        layer = diffjax.MultiheadDiffAttnV2(
            64, 0, h, hkv, head_dim=d, kernel_init=zeros, rngs=nnx.Rngs(0)
        )
        m = diffjax.load_unilm_state_dict(layer, sd)
        q = np_rotary(np_linear(xf, sd["q_proj.weight"]).reshape(b, t, 2 * h, d), pos)
        k = np_rotary(np_linear(xf, sd["k_proj.weight"]).reshape(b, t, hkv, d), pos)
        a_all = _np_maps(q, k, 2 * h // hkv, mask, d)  # one attention over all 2h q heads
        a1, a2 = a_all[:, 0::2], a_all[:, 1::2]
        lam = 1 / (1 + np.exp(-np_linear(xf, sd["lambda_proj.weight"])))  # [B, T, h]
        diff = a1 - lam.transpose(0, 2, 1)[..., None] * a2
    maps = nnx.jit(attention_maps)(m, jnp.asarray(x))
    chex.assert_shape([maps["a1"], maps["a2"], maps["diff"]], (b, h, t, t))
    _assert_close(maps["a1"], a1)
    _assert_close(maps["a2"], a2)
    _assert_close(maps["lam"], lam)
    _assert_close(maps["diff"], diff)
    # and the module output is (diff @ V) through the rest of the layer: rows of a1 sum to 1
    np.testing.assert_allclose(np.asarray(maps["a1"]).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "attention,kv_heads", [("diff_v1", 1), ("diff_v2", 2), ("standard", 2), ("standard", 4)]
)
def test_attention_rows_are_the_rows_of_the_maps(attention, kv_heads):
    """``attention_rows`` (the noise floor's maps at any length) gives exactly the chosen rows
    of ``attention_maps`` (tested against numpy above): V1, V2, the twin, GQA, with packed
    segments, for rows in any order and repeated."""
    from diffjax.evaluate.probe import attention_rows

    heads = 2 if attention == "diff_v1" else 4
    cfg = diffjax.ModelConfig(
        vocab_size=32,
        d_model=32,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads if attention != "diff_v1" else 1,
        max_seq_len=32,
        attention=attention,
    )
    attn = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(3)).layers[0].attn
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 12, 32)), jnp.float32)
    seg = jnp.asarray([[0] * 5 + [1] * 7, [0] * 12])
    rows = jnp.asarray([[11, 0, 4, 4], [7, 3, 11, 1]])
    full = attention_maps(attn, x, segment_ids=seg)
    got = nnx.jit(attention_rows)(attn, x, rows, seg)
    b = jnp.arange(2)[:, None]
    for key in ("a",) if attention == "standard" else ("a1", "a2", "diff"):
        want = jnp.transpose(full[key][b, :, rows], (0, 2, 1, 3))  # [B, H, N, S]
        np.testing.assert_allclose(got[key], want, rtol=1e-6, atol=1e-7, err_msg=key)
    if attention == "diff_v2":
        np.testing.assert_allclose(got["lam"], full["lam"][b, rows], rtol=1e-6)


def test_attention_maps_need_an_attention_layer():
    with pytest.raises(TypeError, match="expected a diffjax attention layer"):
        attention_maps(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.zeros((1, 2, 4)))


# ---------------------------------------------------------------------------- allocation
def _needle_batch(n=2, r=1, seq_len=160, num=4):
    return task_examples(
        needle_task(None, seq_len=seq_len, num_needles=n, num_queries=r, num_examples=num)
    )


def test_position_categories_mark_the_needles_answer_and_haystack():
    batch = _needle_batch(n=3, r=2, seq_len=256)
    cats = position_categories(batch)
    b, r, t = cats.shape
    assert (b, r, t) == (4, 2, 256)
    ans = CATEGORIES.index("answer")
    for i in range(b):
        for j in range(r):
            s, e = batch["answer_spans"][i, j]
            # the answer span in the context holds exactly the digits the query must produce
            np.testing.assert_array_equal(
                batch["inputs"][i][cats[i, j] == ans], batch["targets"][i, s:e]
            )
            assert cats[i, j, 0] == CATEGORIES.index("rest")  # BOS
            q0 = t + 1 - r * query_len(5, 6)
            assert np.all(cats[i, j, q0:] == CATEGORIES.index("rest"))  # the queries
            counts = np.bincount(cats[i, j], minlength=len(CATEGORIES))
            assert counts[ans] == 6
            assert counts[CATEGORIES.index("needle")] == needle_len(5, 6) - 6
            assert counts[CATEGORIES.index("other needles")] == 2 * needle_len(5, 6)


def test_position_categories_follow_custom_templates():
    """Own needle/query sentences: the categories come from the batch's spans, not the default
    sentence lengths."""
    data = DataConfig(
        source="needle",
        seq_len=64,
        needle=NeedleData(
            num_needles=3,
            num_queries=2,
            key_len=1,
            value_len=2,
            template="\n${key}{value}\n",
            query_template="\n${key}{value}",
        ),
    )
    batch = task_examples(
        needle_task(data, seq_len=64, num_needles=3, num_queries=2, num_examples=4)
    )
    assert TOK.decode(batch["inputs"][0][batch["query_spans"][0, 0, 0] :]).startswith("\n$")
    cats = position_categories(batch)
    for i in range(4):
        counts = np.bincount(cats[i, 0], minlength=len(CATEGORIES))
        assert counts[CATEGORIES.index("answer")] == 2
        assert counts[CATEGORIES.index("needle")] == 6 - 2
        assert counts[CATEGORIES.index("other needles")] == 2 * 6
        assert counts[CATEGORIES.index("noise context")] == 64 + 1 - 2 * 5 - 1 - 3 * 6


def test_the_runs_own_setting_keeps_its_query_replacement():
    """A run trained with more queries than needles (drawn with replacement) is evaluated on its
    own setting; the paper's settings still ask R distinct needles."""
    data = DataConfig(
        source="needle",
        seq_len=64,
        needle=NeedleData(
            num_needles=2,
            num_queries=4,
            query_replacement=True,
            key_len=1,
            value_len=1,
            template="\n${key}{value}\n",
            query_template="\n${key}{value}",
        ),
    )
    assert (
        inputs_lib.fits(data, 64, 2, 4)
        and inputs_lib.run_needle_task(data, 64, 2, 4).needle.query_replacement
    )
    assert not inputs_lib.run_needle_task(data, 64, 2, 2).needle.query_replacement
    batch = task_examples(inputs_lib.run_needle_task(data, 64, 2, 4, num_examples=8))
    assert batch["query_needle"].shape == (8, 4)
    with pytest.raises(ConfigError, match="num_queries"):
        needle_task(data, seq_len=64, num_needles=2, num_queries=4)


def _onehot(batch):
    return np.eye(len(CATEGORIES), dtype=np.float32)[position_categories(batch)]


def test_all_attention_on_the_answer_span_gives_share_one():
    batch = _needle_batch()
    rows = alloc_lib.answer_rows(batch)
    cats = position_categories(batch)
    b, t = batch["inputs"].shape
    w = np.zeros((b, 2, t, t), np.float32)
    for i in range(b):
        ans = np.flatnonzero(cats[i, 0] == CATEGORIES.index("answer"))
        for row in rows[i, 0]:
            w[i, :, row, ans] = 1.0 / len(ans)
    raw, absm, tot = map(
        np.asarray,
        alloc_lib.row_category_mass(jnp.asarray(w), jnp.asarray(rows), jnp.asarray(_onehot(batch))),
    )
    shares = alloc_lib.normalize_shares(raw, absm, tot, "abs")
    np.testing.assert_allclose(shares[..., CATEGORIES.index("answer")], 1.0, rtol=1e-6)
    np.testing.assert_allclose(shares.sum(-1), 1.0, rtol=1e-6)


def test_differential_map_common_mode_noise_cancels():
    """A1: half on the answer, half spread over the haystack; A2: the same spread over the
    haystack only; lambda = 0.5 cancels the haystack exactly: answer share 1, noise 0, under
    both normalisations; the raw row sums to 1 - lambda."""
    batch = _needle_batch()
    rows = alloc_lib.answer_rows(batch)
    cats = position_categories(batch)
    b, t = batch["inputs"].shape
    a1 = np.zeros((b, 1, t, t), np.float32)
    a2 = np.zeros_like(a1)
    for i in range(b):
        ans = np.flatnonzero(cats[i, 0] == CATEGORIES.index("answer"))
        hay = np.flatnonzero(cats[i, 0] == CATEGORIES.index("noise context"))
        for row in rows[i, 0]:
            a1[i, 0, row, ans] = 0.5 / len(ans)
            a1[i, 0, row, hay] = 0.5 / len(hay)
            a2[i, 0, row, hay] = 1.0 / len(hay)
    diff = a1 - 0.5 * a2
    raw, absm, tot = map(
        np.asarray,
        alloc_lib.row_category_mass(
            jnp.asarray(diff), jnp.asarray(rows), jnp.asarray(_onehot(batch))
        ),
    )
    np.testing.assert_allclose(tot, 0.5, rtol=1e-5)
    for norm in ("abs", "sum"):
        sh = alloc_lib.normalize_shares(raw, absm, tot, norm)
        np.testing.assert_allclose(sh[..., CATEGORIES.index("answer")], 1.0, rtol=1e-5)
        np.testing.assert_allclose(sh[..., CATEGORIES.index("noise context")], 0.0, atol=1e-6)
    raw_a1 = np.asarray(
        alloc_lib.row_category_mass(
            jnp.asarray(a1), jnp.asarray(rows), jnp.asarray(_onehot(batch))
        )[0]
    )
    np.testing.assert_allclose(raw_a1[..., CATEGORIES.index("noise context")], 0.5, rtol=1e-5)
    with pytest.raises(ValueError, match="normalize must be one of"):
        alloc_lib.normalize_shares(raw, absm, tot, "softmax")


def test_attention_allocation_on_a_model_matches_its_own_maps():
    """The model-level function against attention_maps read directly (one layer, numpy)."""
    cfg = diffjax.ModelConfig(
        vocab_size=259, d_model=32, num_layers=1, num_heads=1, attention="diff_v1", max_seq_len=160
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(1))
    batch = _needle_batch()
    a = alloc_lib.attention_allocation(model, batch, batch_size=4)
    x = model.layers[0].attn_norm(model.embed(jnp.asarray(batch["inputs"])))
    diff = np.asarray(attention_maps(model.layers[0].attn, x)["diff"])  # [B, H, T, S]
    cats = position_categories(batch)
    rows = alloc_lib.answer_rows(batch)
    expect = []
    for i in range(len(diff)):
        for row in rows[i, 0]:
            w = diff[i, 0, row]
            expect.append(w[cats[i, 0] == 0].sum() / np.abs(w).sum())
    np.testing.assert_allclose(a.overall()[0], np.mean(expect), rtol=1e-4)
    assert a.map_kind == "differential" and a.count.sum() == len(diff)


def test_per_head_shares_and_the_retrieval_head_on_a_model():
    """A 2-layer, 2-head standard model: per_head is each head's answer share computed from its
    own maps in numpy, and the retrieval head is the argmax on the even examples, measured on the
    odd ones."""
    cfg = diffjax.ModelConfig(
        vocab_size=259, d_model=32, num_layers=2, num_heads=2, attention="standard", max_seq_len=160
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(3))
    batch = _needle_batch(num=6)
    a = alloc_lib.attention_allocation(model, batch, batch_size=4)
    cats, rows = position_categories(batch), alloc_lib.answer_rows(batch)
    per_ex = np.zeros((2, 6, 2))  # [L, B, H] answer share
    for layer in range(2):
        w = layer_attention_maps(model, batch["inputs"], layer)["a"]  # [B, H, T, S]
        for i in range(6):
            for h in range(2):
                per_ex[layer, i, h] = np.mean(
                    [w[i, h, row][cats[i, 0] == 0].sum() for row in rows[i, 0]]
                )
    np.testing.assert_allclose(a.per_head[..., 0], per_ex.mean(1), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(a.per_head.mean(1), a.per_layer, rtol=1e-4, atol=1e-7)
    layer, head = np.unravel_index(np.argmax(per_ex[:, 0::2].mean(1)), (2, 2))
    rh = a.retrieval_head
    assert (rh["layer"], rh["head"], rh["held_out"]) == (layer, head, True)
    np.testing.assert_allclose(rh["share"], per_ex[layer, 1::2, head].mean(), rtol=1e-4)


def test_the_retrieval_head_is_chosen_on_held_out_examples():
    """Head (0, 1) looks best on the even examples only (a fluke): it is chosen, and its
    held-out share shows the fluke; a head that is good everywhere keeps its share."""
    pe = np.zeros((2, 8, 3, len(CATEGORIES)))
    pe[0, 0::2, 1, 0] = 0.9  # good on the even examples, 0 on the odd ones
    pe[1, :, 2, 0] = 0.6  # good everywhere
    rh = alloc_lib.best_head(pe)
    assert (rh["layer"], rh["head"], rh["held_out"]) == (0, 1, True) and rh["share"] == 0.0
    pe[1, :, 2, 0] = 0.95
    rh = alloc_lib.best_head(pe)
    assert (rh["layer"], rh["head"]) == (1, 2) and rh["share"] == pytest.approx(0.95)
    one = alloc_lib.best_head(pe[:, 1:2])  # an odd example alone: chosen and measured on it
    assert one["held_out"] is False and (one["layer"], one["head"]) == (1, 2)
    nan = alloc_lib.best_head(np.full((1, 4, 2, len(CATEGORIES)), np.nan))
    assert nan["layer"] is None and math.isnan(nan["share"])
    with pytest.raises(ValueError, match="per-example shares"):
        alloc_lib.best_head(pe[0])


# ---------------------------------------------------------------------------- outliers
def test_top_magnitudes_of_a_known_tensor():
    rng = np.random.default_rng(0)
    values = rng.permutation(np.arange(1, 201, dtype=np.float32)) * rng.choice([-1, 1], 200)
    got = top_magnitudes(values.reshape(4, 50))
    assert got == {
        "top-1": 200.0,
        "top-2": 199.0,
        "top-3": 198.0,
        "top-10": 191.0,
        "top-100": 101.0,
        "median": 100.5,
    }
    masked = top_magnitudes(np.array([[5.0, -9.0], [1.0, 3.0]]), mask=[[True, False], [True, True]])
    assert masked["top-1"] == 5.0 and masked["median"] == 3.0 and math.isnan(masked["top-10"])


def test_activation_outliers_read_the_logits_the_model_uses():
    """The attention-logit statistics equal those of q.k/sqrt(d) recomputed in numpy from the
    layer's projections (standard attention, one layer, causal entries only)."""
    cfg = diffjax.ModelConfig(
        vocab_size=259,
        d_model=32,
        num_layers=1,
        num_heads=2,
        attention="standard",
        max_seq_len=32,
        init_std=0.2,
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 259, (2, 16))
    got = activation_outliers(model, tokens, batch_size=2)
    attn = model.layers[0].attn
    x = model.layers[0].attn_norm(model.embed(jnp.asarray(tokens)))
    q = np.asarray(attn.q_proj(x)).reshape(2, 16, 2, 16)
    k = np.asarray(attn.k_proj(x)).reshape(2, 16, 2, 16)
    cos, sin = diffjax.rotary_angles(jnp.arange(16)[None], 16, cfg.rope_theta)
    q, k = (np.asarray(diffjax.apply_rotary(jnp.asarray(a), cos, sin)) for a in (q, k))
    logits = np.einsum("bthd,bshd->bhts", q, k) / 4.0
    causal = np.tril(np.ones((16, 16), bool))
    ref = top_magnitudes(logits, mask=np.broadcast_to(causal, logits.shape))
    for key, value in ref.items():
        np.testing.assert_allclose(got["attention logits"][key], value, rtol=1e-4)
    hidden = np.asarray(model.layers[0](model.embed(jnp.asarray(tokens))))
    np.testing.assert_allclose(got["hidden states"]["top-1"], np.abs(hidden).max(), rtol=1e-5)


@pytest.mark.parametrize("attention", ["standard", "diff_v1", "diff_v2"])
def test_attention_logits_are_the_maps_before_the_softmax(attention):
    """``attention_logits``: the masked softmax of each logit block is the layer's own map
    (``attention_maps``), in the module's head pairing (GQA: 2 kv groups)."""
    cfg = diffjax.ModelConfig(
        vocab_size=259,
        d_model=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        attention=attention,
        max_seq_len=16,
        init_std=0.2,
    )
    attn = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0)).layers[0].attn
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 64)), jnp.float32)
    logits, maps = attention_logits(attn, x), attention_maps(attn, x)
    mask = np.asarray(logits["mask"])[:, None]
    pairs = [("logits", "a")] if attention == "standard" else [("logits1", "a1"), ("logits2", "a2")]
    for lk, mk in pairs:
        z = np.where(mask, np.asarray(logits[lk]), -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        np.testing.assert_allclose(
            p / p.sum(-1, keepdims=True), np.asarray(maps[mk]), rtol=1e-5, atol=1e-6
        )


# ---------------------------------------------------------------------------- quantization
def test_absmax_quantize_matches_numpy_and_respects_the_mask():
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32) * 4
    mask = np.tril(np.ones((8, 8), bool))[None, None]
    x_masked_big = np.where(mask, x, 1e4)  # a huge masked entry must not set the scale
    for bits in (4, 6, 8, 16):
        got = np.asarray(absmax_quantize(x_masked_big, bits, mask=mask))
        absmax = np.abs(np.where(mask, x, 0)).max(axis=(-2, -1), keepdims=True)
        step = absmax / (2 ** (bits - 1) - 1)
        np.testing.assert_allclose(
            got[np.broadcast_to(mask, x.shape)],
            (np.round(x / step) * step)[np.broadcast_to(mask, x.shape)],
            rtol=1e-6,
            atol=1e-6,
        )
        within = np.abs(got - x) <= step / 2 + 1e-6  # round to nearest: half a step at most
        assert np.all(within[np.broadcast_to(mask, x.shape)])
    with pytest.raises(ValueError, match="bits must be an integer"):
        absmax_quantize(x, 1)


def test_quantized_logits_change_the_loss_as_stated_and_do_not_leak():
    """16-bit logits change the loss by < 1e-4 nats; 4-bit by more than 1e-3 (on a model whose
    logits are O(1)); the original model, called again after the quantized copies through the
    same jitted function, gives its original numbers (the implementation is a static attribute
    of the copy, so no jit cache entry is shared)."""
    cfg = diffjax.ModelConfig(
        vocab_size=259,
        d_model=32,
        num_layers=1,
        num_heads=1,
        attention="diff_v1",
        max_seq_len=64,
        init_std=0.5,
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 259, (4, 33))
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((4, 32), np.float32),
    }
    base = validation_loss(losses_and_predictions(model, batch, 4)[0], batch["weights"])[0]
    loss = {}
    for bits in (16, 4):
        q = with_quantized_logits(model, bits)
        loss[bits] = validation_loss(losses_and_predictions(q, batch, 4)[0], batch["weights"])[0]
    assert abs(loss[16] - base) < 1e-4, (loss, base)
    assert abs(loss[4] - base) > 1e-3, (loss, base)
    again = validation_loss(losses_and_predictions(model, batch, 4)[0], batch["weights"])[0]
    assert again == base
    assert model.layers[0].attn.attention_impl.asked == "auto"
    assert with_quantized_logits(model, 4).layers[0].attn.attention_impl.asked == QuantizedLogits(4)
    assert with_quantized_logits(model, None).layers[0].attn.attention_impl.asked == "xla"


def test_quantized_standard_attention_against_numpy():
    """The standard path of the quantized implementation (GQA, causal) against numpy: quantize
    the visible logits per example and head, softmax, times v. Run through ops with the
    implementation object, as a layer does, and through the reference math directly."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 6, h, 8)).astype(np.float32) * 2 for h in (4, 2, 2))
    qkv = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    got = np.asarray(ops.dot_product_attention(*qkv, impl=QuantizedLogits(4)))
    np.testing.assert_array_equal(
        got, np.asarray(reference.dot_product_attention(*qkv, logit_bits=4))
    )
    kr, vr = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # query head i reads kv head i//2
    logits = np.einsum("bthd,bshd->bhts", q, kr) / np.sqrt(8)
    mask = np.tril(np.ones((6, 6), bool))
    step = np.abs(np.where(mask, logits, 0)).max(axis=(-2, -1), keepdims=True) / 7
    z = np.where(mask, np.round(logits / step) * step, -np.inf)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("bhts,bshd->bthd", p, vr), rtol=1e-4, atol=1e-5)


def test_quantized_differential_attention_with_a_shared_key():
    """DIFF V2 passes one key for both maps (``k2=None``): the same as passing it twice; and a
    width outside [2, 24] fails when the implementation is built."""
    rng = np.random.default_rng(1)
    q1, q2 = (jnp.asarray(rng.normal(size=(2, 6, 4, 8)).astype(np.float32) * 2) for _ in "ab")
    k, v = (jnp.asarray(rng.normal(size=(2, 6, 2, 8)).astype(np.float32)) for _ in "ab")
    lam = jnp.asarray(rng.uniform(size=(2, 6, 4)).astype(np.float32))
    impl = QuantizedLogits(4)
    kw = dict(causal=True, segment_ids=None, kv_segment_ids=None, scale=8**-0.5)
    shared = impl.attention(q1, k, v, second=(q2, None, lam), **kw)
    np.testing.assert_array_equal(
        np.asarray(shared), np.asarray(impl.attention(q1, k, v, second=(q2, k, lam), **kw))
    )
    np.testing.assert_array_equal(
        np.asarray(shared),
        np.asarray(reference.differential_attention(q1, k, q2, k, v, lam, logit_bits=4)),
    )
    assert hash(QuantizedLogits(4)) == hash(QuantizedLogits(4))
    with pytest.raises(ValueError, match="bits must be an integer"):
        QuantizedLogits(1)


# ---------------------------------------------------------------------------- noise floor
def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize("n", [1, 7, 100, 3000])
def test_closed_form_noise_floor_matches_a_brute_force_softmax(n):
    m, m2, lam = 3.0, 0.5, 0.7
    a1 = _softmax(np.concatenate([[m], np.zeros(n)]))
    a2 = _softmax(np.concatenate([[m2], np.zeros(n)]))
    d = a1 - lam * a2
    got = noise_floor_closed_form([n], m, lam, m2)
    np.testing.assert_allclose(got["softmax_signal"][0], a1[0], rtol=1e-12)
    np.testing.assert_allclose(got["softmax_distractors"][0], a1[1:].sum(), rtol=1e-12)
    np.testing.assert_allclose(got["diff_signal"][0], d[0], rtol=1e-12)
    np.testing.assert_allclose(got["diff_distractors"][0], d[1:].sum(), rtol=1e-10)
    streamed = noise_floor_streamed(n, m, lam, m2, sigma=0.0)
    np.testing.assert_allclose(streamed["diff_distractors"], d[1:].sum(), rtol=1e-10)
    np.testing.assert_allclose(streamed["diff_distractors_abs"], np.abs(d[1:]).sum(), rtol=1e-10)


def test_noise_floor_gain_tends_to_one_over_one_minus_lambda():
    got = noise_floor_closed_form([2**18], 5.0, 0.8)
    gain = got["diff_snr"][0] / got["softmax_snr"][0]
    assert abs(gain - (math.exp(5) - 0.8) / (math.exp(5) * 0.2)) / gain < 0.01
    # random logits that are only partly common mode (rho < 1) cancel less
    full = noise_floor_streamed(4096, 5.0, 0.8, sigma=1.0, rho=1.0)
    part = noise_floor_streamed(4096, 5.0, 0.8, sigma=1.0, rho=0.5)
    assert part["diff_distractors_abs"] > full["diff_distractors_abs"]
    with pytest.raises(ValueError, match="num_distractors must be >= 1"):
        noise_floor_closed_form([0], 1.0)


def test_closed_form_gain_formula_and_its_two_regimes():
    """The report's gain column: the exact formula against the computed ratios, its limit
    (about 1/(1 - lambda)) for many distractors, and the cancellation point N* where the
    differential distractor total is zero and the gain unbounded (why 1,024 reads 11.70x)."""
    ns = np.array([100, 588, 590, 1024, 4096, 2**18, 2**30], float)
    for m, lam, m2 in ((5.0, 0.8, 0.0), (3.0, 0.7, 0.5), (4.0, 0.3, 1.0)):
        got = noise_floor_closed_form(ns, m, lam, m2)
        np.testing.assert_allclose(
            nf.closed_form_gain(ns, m, lam, m2), got["diff_snr"] / got["softmax_snr"], rtol=1e-9
        )
        assert nf.closed_form_gain([2**40], m, lam, m2)[0] == pytest.approx(
            nf.asymptotic_gain(m, lam, m2), rel=1e-6
        )
    assert nf.asymptotic_gain(5.0, 0.8) == pytest.approx((math.exp(5) - 0.8) / (0.2 * math.exp(5)))
    star = nf.cancellation_point(5.0, 0.8)
    assert star == pytest.approx((0.8 * math.exp(5) - 1) / 0.2)  # 588.65
    at = noise_floor_closed_form([star], 5.0, 0.8)
    assert abs(at["diff_distractors"][0]) < 1e-12  # exact cancellation
    below = noise_floor_closed_form([star / 2], 5.0, 0.8)
    assert below["diff_distractors"][0] < 0  # below N* the distractor total is negative
    # the first table row: 11.70x, well above 1/(1 - lambda) = 5, and above the limit 4.97x
    g1024 = nf.closed_form_gain([1024], 5.0, 0.8)[0]
    assert g1024 == pytest.approx(11.70, abs=0.005) and g1024 > 2 * nf.asymptotic_gain(5.0, 0.8)
    assert nf.cancellation_point(1.0, 0.2) is None  # lambda e^m < e^m2 + (1 - lambda)
    caption = nf.caption(5.0, 0.8)
    assert "4.97x" in caption and "N* = (λe^m − 1)/(1 − λ) = 589" in caption


def _point(signal_share: float, distractor_share: float) -> nf.NoisePoint:
    """A measured noise-floor point with only its shares set."""
    return nf.NoisePoint(128, 0.0, 0.0, signal_share, distractor_share, 100.0, None)


def test_measured_ratio_is_a_ratio_of_means_and_needs_a_positive_denominator():
    # the case of the report: mean shares 0.0105 / 0.0529 = 0.198, but one seed's distractor
    # share is negative, so a mean of per-seed ratios (0.08 and -20) would say nothing
    sig, dis = [0.0084, 0.0126], [0.106425, -0.000625]
    assert ratio_of_means(sig, dis) is None and not clearly_positive(dis)
    pts = [_point(a, b) for a, b in zip(sig, dis)]
    assert nf.measured_ratio(pts) == "—"
    # a near-zero mean within its spread: no ratio either
    assert ratio_of_means([0.01, 0.01, 0.01], [0.02, 1e-4, 0.001]) is None
    assert ratio_of_means([0.1], [0.0]) is None and ratio_of_means([0.1], [-0.2]) is None
    # clearly positive: the ratio of the means, not the mean of the ratios (0.25 vs 0.2625)
    assert ratio_of_means([0.1, 0.3], [0.5, 1.1]) == pytest.approx(0.25)
    pts = [_point(0.1, 0.5), _point(0.3, 1.1)]
    assert nf.measured_ratio(pts) == "0.250"
    assert ratio_of_means([0.2, None], [0.4, 0.1]) == pytest.approx(0.5)  # pairs with a gap drop
    with pytest.raises(ValueError, match="denominators"):
        ratio_of_means([1.0], [1.0, 2.0])


# ---------------------------------------------------------------------------- report text, plots
def _visible_texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.findobj(match=lambda a: hasattr(a, "get_text")))


def test_header_names_the_seed_of_each_best_checkpoint():
    rs = [
        {"seed": 0, "step": 200, "tokens": 1000},
        {"seed": 1, "step": 150, "tokens": 750},
    ]
    assert report_lib.best_checkpoints(rs) == "best checkpoints: seed 0 step 200, seed 1 step 150"
    assert report_lib.best_checkpoints(rs[:1]) == "best checkpoint: step 200"
    assert report_lib._tokens([dict(r, tokens=5) for r in rs]) == "5"  # equal: no "± 0"
    assert report_lib._tokens(rs) == "875 ± 177"


def test_allocation_plot_shares_its_scale_and_says_why_diff_sums_below_one():
    cats = list(CATEGORIES)
    diff = np.array([[0.2, 0.1, 0.0, 0.15, 0.03], [np.nan] * 5, [0.25, -0.05, 0.0, 0.1, 0.1]])
    std = np.array([[0.1, 0.2, 0.05, 0.45, 0.2], [np.nan] * 5, [0.1, 0.2, 0.05, 0.45, 0.2]])
    fig = plots.draw_allocation_bars(
        {"diff (diff_v1)": ([0.0, 0.5, 1.0], diff), "standard (standard)": ([0.0, 0.5, 1.0], std)},
        cats,
        "allocation",
    )
    ax_d, ax_s = fig.axes[:2]
    assert ax_d.get_ylim() == ax_s.get_ylim()  # one scale for both models
    lo, hi = ax_d.get_ylim()
    assert lo < -0.05 and hi >= 1.0  # the negative bar and the twin's full bar both fit
    # one legend for the figure, naming every category, and none inside a panel
    assert len(fig.legends) == 1 and ax_d.get_legend() is None and ax_s.get_legend() is None
    assert [t.get_text() for t in fig.legends[0].get_texts()] == cats
    text = _visible_texts(fig)
    assert "diff (diff_v1): the bars sum to 0.44, not 1" in text  # (0.48 + 0.40) / 2
    assert "negative entries" in text and "drawn below 0" in text
    assert "standard (standard): the bars sum" not in text  # softmax rows sum to 1
    # the empty depth bin is labelled, in each panel, and explained
    assert [t.get_text() for t in ax_d.texts] == ["no queries"]
    assert "no asked needle fell in that depth bin" in text


def test_retrieval_heatmap_drops_an_empty_depth_and_says_so():
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    acc = np.array([[0.1, 0.5, 0.9, np.nan, np.nan], [0.2, 0.4, 0.7, 0.3, np.nan]])
    fig = plots.draw_retrieval_heatmaps(
        {"diff": ([128, 256], depths, acc), "standard": ([128, 256], depths, acc / 2)}, "t"
    )
    for ax in fig.axes[:2]:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0%", "25%", "50%", "75%"]
        assert ax.images[0].get_array().shape == (2, 4)
        assert sum(t.get_text() == "–" for t in ax.texts) == 1  # the one empty cell drawn
    text = _visible_texts(fig)
    assert "not drawn: depth 100%" in text and "–: no query's needle fell" in text
    full = plots.draw_retrieval_heatmaps({"diff": ([128], depths[:2], np.array([[0.5, 1.0]]))}, "t")
    assert "not drawn" not in _visible_texts(full) and "–:" not in _visible_texts(full)


def test_noise_floor_plot_shows_its_data():
    noise = noise_floor_closed_form(np.array(nf.DEFAULT_NS, float), 5.0, 0.8)
    measured = [
        {"num_distractors": 45.0, "signal_share": 0.04, "distractor_share": 0.35},
        {"num_distractors": 173.0, "signal_share": 0.02, "distractor_share": 0.6},
    ]
    fig = nf.draw_noise_floor({"diff": measured, "standard": []}, noise, 5.0, 0.8)
    closed, meas = fig.axes[:2]
    # closed form: a log axis (no empty negative half) with room above the lines near 1
    assert closed.get_yscale() == "log" and closed.get_ylim()[1] >= 1.5
    lo, hi = closed.get_ylim()
    assert lo <= noise["softmax_signal"].min()
    # the measured points have their own axes, spanning their own x range
    xlo, xhi = meas.get_xlim()
    assert xlo < 45 and 173 < xhi < 1024
    assert meas.get_yscale() == "log" and meas.get_ylim()[0] < 0.02
    # a negative measured share: a symlog axis that stops near the data, not a mirrored half
    neg = [dict(measured[0], distractor_share=-0.000625), measured[1]]
    fig = nf.draw_noise_floor({"diff": neg}, noise, 5.0, 0.8)
    meas = fig.axes[1]
    assert meas.get_yscale() == "symlog"
    assert -0.01 < meas.get_ylim()[0] < -0.000625 and meas.get_ylim()[1] < 2.0
    # without measured points: the closed form alone
    assert len(nf.draw_noise_floor({"diff": []}, noise, 5.0, 0.8).axes) == 1


def test_line_plot_ticks_name_the_measured_values():
    fig = plots.draw_lines(
        {"a": (np.array([4.0, 6.0, 8.0, 16.0, 32.0]), np.array([3.0, 2.9, 2.8, 2.8, 2.8]))},
        xlabel="bits",
        ylabel="loss",
        title="t",
        logx=True,
        xticks=([4, 6, 8, 16, 32], ["4", "6", "8", "16", "float32"]),
    )
    fig.canvas.draw()
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "6", "8", "16", "float32"]
    assert ax.get_legend() is None and len(fig.legends) == 1  # outside the axes


# ---------------------------------------------------------------------------- retrieval, loss
def test_query_correct_and_depth_bins():
    batch = {
        "targets": np.array([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]),
        "answer_spans": np.array([[[1, 3], [4, 6]], [[1, 3], [4, 6]]]),
    }
    preds = np.array([[0, 2, 3, 0, 5, 6], [0, 2, 9, 0, 5, 6]])
    np.testing.assert_array_equal(query_correct(preds, batch), [[True, True], [False, True]])
    np.testing.assert_array_equal(
        depth_bins(np.array([0.0, 0.1, 0.13, 0.5, 0.9, 1.0]), 5), [0, 0, 1, 2, 4, 4]
    )


def test_loss_by_position_and_validation_loss():
    losses = np.array([[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0]])
    weights = np.array([[1, 1, 0, 1], [1, 1, 0, 1]], float)
    ends, by = loss_by_position(losses, weights, 2)
    np.testing.assert_array_equal(ends, [2, 4])
    np.testing.assert_allclose(by, [2.5, 5.0])
    loss, ppl = validation_loss(losses, weights)
    assert loss == pytest.approx(20 / 6) and ppl == pytest.approx(math.exp(20 / 6))


# ---------------------------------------------------------------------------- seeds
def test_seed_statistics_of_the_evaluation_tables_on_hand_made_numbers():
    """The evaluation report uses diffjax.evaluate.stats (shared with the training report)."""
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)
    m, s, n = mean_std([4.0])
    assert m == 4.0 and s is None and n == 1
    assert fmt_mean_std([1.0, 2.0, 3.0], "{:.1f}") == "2.0 ± 1.0"
    assert fmt_mean_std([4.0, None, float("nan")]) == "4.000" and fmt_mean_std([]) == "n/a"
    # differences 1, 2, 3: mean 2, std 1, t_{0.975, 2} = 4.302653
    iv = paired_difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    half = 4.302653 / math.sqrt(3)
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.low == pytest.approx(2 - half, abs=1e-5) and iv.high == pytest.approx(
        2 + half, abs=1e-5
    )
    assert iv.excludes_zero is False and "includes zero" in describe_difference(iv, "loss")
    tight = paired_difference([3.1, 3.0, 3.2, 3.1], [3.0, 2.9, 3.0, 3.0])
    assert tight.excludes_zero is True and tight.low > 0
    assert "excludes zero" in describe_difference(tight, "loss")
    one = paired_difference([1.0], [0.5])
    assert one.low is None and "no confidence interval can be given" in describe_difference(
        one, "x"
    )
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_difference([1.0, 2.0], [1.0])


def test_equal_paired_differences_have_no_interval():
    """Accuracy 0.00 for both models in every seed: the differences have no spread, so there is
    no "[+0.0000, +0.0000]" interval and no claim that it includes zero."""
    zero = paired_difference([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert zero.no_spread and zero.n == 3 and zero.mean == 0.0
    assert zero.low is None and zero.high is None and zero.excludes_zero is None
    text = describe_difference(zero, "retrieval accuracy")
    assert "t-interval" not in text and "includes zero" not in text and "[" not in text
    assert "+0.0000 in each of 3 paired seeds" in text
    assert "no confidence interval can be given" in text
    # equal up to float rounding (0.3 - 0.2 != 0.1 in binary): still no spread
    assert paired_difference([0.3, 0.1], [0.2, 0.0]).no_spread
    # a constant non-zero difference: no interval either (not "excludes zero")
    const = paired_difference([0.5, 0.7], [0.4, 0.6])
    assert const.no_spread and const.excludes_zero is None
    # one seed is not "no spread", and real spread keeps its interval
    assert not paired_difference([1.0], [0.0]).no_spread
    spread = paired_difference([0.1, 0.0], [0.0, 0.0])
    assert not spread.no_spread and spread.low < 0 < spread.high


# ---------------------------------------------------------------------------- runs
def _fake_model(path):
    os.makedirs(os.path.join(path, "checkpoints", "3"))


def test_discover_models_in_both_layouts(tmp_path):
    old = tmp_path / "old"
    _fake_model(old / "diff")
    _fake_model(old / "standard")
    os.makedirs(old / "empty" / "checkpoints")  # no committed step: not a model
    got = discover_models(str(old), default_seed=7)
    assert [(e.label, e.seed) for e in got] == [("diff", 7), ("standard", 7)]
    new = tmp_path / "new"
    for label in ("standard", "diff"):
        for seed in (1, 0):
            _fake_model(new / label / f"seed_{seed}")
    got = discover_models(str(new))
    assert [(e.label, e.seed) for e in got] == [
        ("diff", 0),
        ("diff", 1),
        ("standard", 0),
        ("standard", 1),
    ]
    single = tmp_path / "only"
    _fake_model(single)
    assert [(e.label, e.seed) for e in discover_models(str(single))] == [("only", 0)]


# A tiny needle run: seconds per model.
TINY_NEEDLE = tiny_run(
    "model.max_seq_len=96",
    "data.source=needle",
    "data.seq_len=80",
    "data.needle.num_needles=1",
    "data.needle.num_queries=1",
    "data.needle.key_len=2",
    "data.needle.value_len=2",
    "data.synthetic.num_val_examples=16",
    "train.warmup_steps=1",
    "train.steps=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    drop=("data.max_files", "compare.throughput_rounds"),
)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalruns")
    # train.py ends with the quick evaluation when compare.quick_eval is on (the default run's)
    assert (
        train_main(
            [f"run.dir={root / 's0'}", "compare.twins=", *TINY_NEEDLE, "compare.quick_eval=true"]
        )
        == 0
    )
    # The per-seed layout RUN/<label>/seed_<n>/checkpoints, built from copies of that one model
    # (to keep this file fast): the aggregation and the paired-difference rendering are what is
    # tested with it; the interval's numbers are tested on hand-made values above, and the
    # standard-attention paths of each analysis in the unit tests.
    multi = root / "multi"
    os.makedirs(multi)
    shutil.copy(root / "s0" / "config.json", multi / "config.json")
    for seed in (0, 1):
        for label in ("diff", "standard"):
            shutil.copytree(root / "s0" / "diff" / "seed_0", multi / label / f"seed_{seed}")
    return root


def test_evaluate_command_on_a_tiny_run(tiny_runs, capsys):
    import matplotlib

    backend = matplotlib.get_backend()
    run = tiny_runs / "s0"
    report = (run / "report.md").read_text()  # train.py appended the quick evaluation
    assert "## Quick evaluation" in report and "Activation outliers" in report
    assert (
        "**Seeds that learned the lookup** (final first-query accuracy (the query only the"
        in report
    )
    assert evaluate_main([str(run), "--quick"]) == 0
    assert matplotlib.get_backend() == backend  # the caller's backend is left alone
    text = (run / "eval.md").read_text()
    for heading in (
        "Multi-needle retrieval",
        "Attention allocation",
        "Activation outliers",
        "Quantization",
        "noise floor",
        "Loss by position",
        "paper DIFF (3B, 4K)",
        "33,",
    ):  # the parameter count of the scale line
        assert heading in text, heading
    assert "interval can be given" not in text  # one model, no twin: no paired difference
    assert "**The retrieval head.**" in text and "chosen on the even examples" in text
    assert "A share of attention is not what a position contributes" in text
    assert "not a language-modelling measure" in text  # a needle run: answer-only loss
    assert "| first query (only the needles or pairs hold its answer) |" in text  # no repeats
    assert "repeated queries (copyable" not in text
    record = [
        json.loads(x)
        for x in (run / "diff" / "seed_0" / "metrics.jsonl").read_text().splitlines()
        if "val_loss" in x
    ][-1]
    assert record["val_first_query_accuracy"] == record["val_query_accuracy"]
    assert "val_repeat_query_accuracy" not in record
    assert "| first query (needs retrieval) |" in report
    for png in (
        "eval_retrieval_N1_R1.png",
        "eval_allocation.png",
        "eval_quantization.png",
        "eval_noise_floor.png",
        "eval_loss_by_position.png",
        "eval_outliers.png",
    ):
        assert (run / png).stat().st_size > 1000, png
    data = json.loads((run / "eval.json").read_text())
    assert [m["label"] for m in data["models"]] == ["diff"]  # a run without a twin
    assert [q["bits"] for q in data["models"][0]["quantization"]] == [None, 16, 8, 6, 4]
    assert evaluate_main([str(tiny_runs / "nothing-here")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_evaluate_run_aggregates_seeds(tiny_runs):
    settings = dataclasses.replace(
        EvalSettings.for_run(True), bits=(4,), retrieval_examples=8, val_examples=8
    )
    text = evaluate_run(str(tiny_runs / "multi"), settings=settings, log=lambda *_: None)
    assert "seeds [0, 1]" in text and " ± " in text
    # DIFF - twin: both labels are copies of one model here, so every paired difference is 0
    # and there is no interval to give (a spread's interval: test_report.py and the unit tests)
    assert "in each of 2 paired seeds" in text and "no confidence interval can be given" in text
    assert "t-interval [+0.0000, +0.0000]" not in text
    assert "best checkpoints: seed 0 step " in text and ", seed 1 step " in text
    assert "retrieval head's answer share" in text  # its paired difference
    data = json.loads((tiny_runs / "multi" / "eval.json").read_text())
    assert sorted((m["label"], m["seed"]) for m in data["models"]) == [
        ("diff", 0),
        ("diff", 1),
        ("standard", 0),
        ("standard", 1),
    ]


def test_evaluate_run_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        evaluate_run(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"data": {"source": "stdlib"}}))
    with pytest.raises(ConfigError, match="holds no model with a committed checkpoint"):
        evaluate_run(str(tmp_path))


@pytest.mark.parametrize("attention", ["diff_v1", "diff_v2"])
def test_layer_attention_maps_are_the_maps_of_the_blocks_own_input(attention):
    """Block l's maps inside the model against the model run block by block by hand."""
    cfg = diffjax.ModelConfig(
        vocab_size=259, d_model=32, num_layers=2, num_heads=2, attention=attention, max_seq_len=16
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(3))
    tokens = np.random.default_rng(0).integers(0, 259, (2, 12))
    x = model.embed(jnp.asarray(tokens))
    x = model.layers[0](x)
    expect = attention_maps(model.layers[1].attn, model.layers[1].attn_norm(x))
    got = layer_attention_maps(model, tokens, layer=-1)
    assert set(got) == set(expect)
    for k in expect:
        np.testing.assert_allclose(got[k], np.asarray(expect[k]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(
        got["a1"],
        np.asarray(
            attention_maps(
                model.layers[0].attn, model.layers[0].attn_norm(model.embed(jnp.asarray(tokens)))
            )["a1"]
        ),
    )  # not layer 0's
    with pytest.raises(ValueError, match="layer must be an int in"):
        layer_attention_maps(model, tokens, layer=2)
