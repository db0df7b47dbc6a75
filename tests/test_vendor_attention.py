"""DIFF and its twin on the vendors' attention: cuDNN (:mod:`diffjax.kernels.cudnn`) and Splash
(:mod:`diffjax.kernels.splash`).

Each composition equals the reference math, values and gradients: the cuDNN one through jax's
XLA implementation of the same calls (what a CPU runs in their place: the packed layout as the
dense mask of the very offsets and lengths cuDNN would get), Splash through its own kernels,
interpreted. V2's head pairing is the official code's, and a pairing across kv groups is caught.
The packed layout is checked against numpy, its capacity refused loudly (NaN), and what cuDNN or
Splash cannot run is refused with the fix. The dispatch (``attention_impl``) routes layers, a
mesh, decoding and training through them; ``"auto"`` reads the measured table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kernel_cases import make_inputs, value_and_grads

import diffjax
from diffjax.ops import impl_table
from diffjax import ops
from diffjax.ops import dispatch
from diffjax.config import ConfigError, KernelTarget
from diffjax.kernels import _compose, cudnn, reference, splash
from diffjax.infra.sharding import MeshConfig, make_mesh
from tiny import tiny_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
T = 128  # Splash's smallest block
H100 = KernelTarget("gpu", (9, 0))
V5E = KernelTarget("tpu")


def _segments(b: int, t: int, cuts) -> jnp.ndarray:
    """Segment ids with a new document at each of ``cuts`` (one list per row)."""
    ids = np.zeros((b, t), np.int32)
    for row, row_cuts in enumerate(cuts):
        for c in row_cuts:
            ids[row, c:] += 1
    return jnp.asarray(ids)


def _case(kind: str, *, hq=4, hkv=2, d=16, seg=True, dtype="float32", seed=0):
    dv = 2 * d if kind == "v1" else d
    x = make_inputs(
        seed, b=2, t=T, s=T, hq=hq, hkv=hkv, d=d, dv=dv, dtype=dtype,
        lam="scalar" if kind == "v1" else "token",
    )  # fmt: skip
    x["segment_ids"] = _segments(2, T, [[40, 90], [7]]) if seg else None
    return x


def _fns(kind, impl_fn, x):
    """``(implementation, reference, args)`` as functions of the arrays only."""
    seg = dict(segment_ids=x["segment_ids"])
    if kind == "standard":
        args = (x["q1"], x["k1"], x["v"])
        return (
            lambda q, k, v: impl_fn[0](q, k, v, **seg),
            lambda q, k, v: reference.dot_product_attention(q, k, v, **seg),
            args,
        )
    k2 = kind == "v1"
    args = (x["q1"], x["k1"], x["q2"], x["k2"], x["v"], x["lam"])

    def impl(q1, k1, q2, kk2, v, lam):
        return impl_fn[1](q1, k1, q2, kk2 if k2 else None, v, lam, **seg)

    def ref(q1, k1, q2, kk2, v, lam):
        return reference.differential_attention(q1, k1, q2, kk2 if k2 else None, v, lam, **seg)

    return impl, ref, args


def _close(got, want, atol=2e-5, rtol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.abs(g - w) <= atol + rtol * np.max(np.abs(w))), np.max(np.abs(g - w))


CUDNN_XLA = (
    lambda *a, **k: cudnn.dot_product_attention(*a, implementation="xla", **k),
    lambda *a, **k: cudnn.differential_attention(*a, implementation="xla", **k),
)
CUDNN_FOUR = (  # V1's value in halves: the four calls of a cuDNN without wide values
    CUDNN_XLA[0],
    lambda *a, **k: cudnn.differential_attention(*a, implementation="xla", wide_value=False, **k),
)
SPLASH = (
    lambda *a, **k: splash.dot_product_attention(*a, interpret=True, **k),
    lambda *a, **k: splash.differential_attention(*a, interpret=True, **k),
)


# ---------------------------------------------------------------------------- the compositions
COMBOS = [
    (impl, kind, seg)
    for impl in ("cudnn", "cudnn-four-calls", "splash")
    for kind in (("v1",) if impl == "cudnn-four-calls" else ("v1", "v2", "standard"))
    for seg in (True, False)
]


@pytest.mark.parametrize(
    "impl,kind,seg", COMBOS, ids=[f"{i}-{k}-{'documents' if s else 'plain'}" for i, k, s in COMBOS]
)
def test_each_composition_equals_the_reference_values_and_gradients(impl, kind, seg):
    fns = {"cudnn": CUDNN_XLA, "cudnn-four-calls": CUDNN_FOUR, "splash": SPLASH}[impl]
    x = _case(kind, seg=seg)
    fn, ref, args = _fns(kind, fns, x)
    got = value_and_grads(fn, args, x["ct"])
    want = value_and_grads(ref, args, x["ct"])
    _close(got, want, atol=5e-5, rtol=5e-5)


def test_bfloat16_compositions_stay_within_rounding_of_the_reference():
    x = _case("v1", dtype="bfloat16")
    f32 = {k: (v.astype(jnp.float32) if v is not None else v) for k, v in x.items()}
    for fns in (CUDNN_XLA, SPLASH):
        fn, _, args = _fns("v1", fns, x)
        _, ref, args32 = _fns("v1", fns, f32)
        out = np.asarray(fn(*args), np.float32)
        want = np.asarray(ref(*args32))
        assert np.max(np.abs(out - want)) < 2e-2 * np.max(np.abs(want)) + 1e-3


def test_v2_pairs_heads_as_the_official_code_and_a_pairing_across_kv_groups_is_caught(
    monkeypatch,
):
    """The official V2: q_proj's 2h heads in one call over the kv heads, then
    ``attn[..., 0::2, :] - lam * attn[..., 1::2, :]``. Pair i (heads 2i, 2i + 1) reads kv group
    i // (h / h_kv). With 4 pairs over 2 kv groups, stacking Q1 heads before Q2 heads instead
    would give Q2 of pair 0 the keys of group 1: the test must see that."""
    x = _case("v2", hq=4, hkv=2, seg=False)
    q1, k, q2, v, lam = x["q1"], x["k1"], x["q2"], x["v"], x["lam"]
    b, t, h, d = q1.shape
    q_official = jnp.stack([q1, q2], axis=3).reshape(b, t, 2 * h, d)  # q_proj's view: 2i, 2i + 1
    attn = jax.nn.dot_product_attention(q_official, k, v, is_causal=True, implementation="xla")
    official = attn[:, :, 0::2] - lam[..., None] * attn[:, :, 1::2]
    ref = reference.differential_attention(q1, k, q2, None, v, lam)
    _close(official, ref)  # the official recipe is the reference math
    for fns in (CUDNN_XLA, SPLASH):
        _close(fns[1](q1, k, q2, None, v, lam), official)

    def stacked(a, b_):
        return jnp.concatenate([a, b_], axis=2)  # Q1 heads, then Q2 heads: pairs straddle groups

    def unstacked(o):
        return o[:, :, : o.shape[2] // 2], o[:, :, o.shape[2] // 2 :]

    monkeypatch.setattr(_compose, "pair_heads", stacked)
    monkeypatch.setattr(_compose, "unpair_heads", unstacked)
    wrong = CUDNN_XLA[1](q1, k, q2, None, v, lam)
    assert np.max(np.abs(np.asarray(wrong) - np.asarray(official))) > 1e-2


# ---------------------------------------------------------------------------- packed layout
def _numpy_layout(ids: np.ndarray, slots: int):
    """The runs of each row, filled into slots row by row (numpy, the reference)."""
    b, t = ids.shape
    runs = []
    for row in range(b):
        starts = [0] + [i for i in range(1, t) if ids[row, i] != ids[row, i - 1]]
        ends = starts[1:] + [t]
        runs += [(row, s, e - s) for s, e in zip(starts, ends)]
    offsets = -np.ones((b, slots + 1), np.int32)
    lengths = -np.ones((b, slots), np.int32)
    fits = len(runs) <= b * slots
    for k, (row, start, length) in enumerate(runs[: b * slots]):
        slot_row = k // slots
        fits &= slot_row <= row
        offsets[slot_row, k % slots] = start + (row - slot_row) * t
        lengths[slot_row, k % slots] = length
    return offsets, lengths, bool(fits)


@pytest.mark.parametrize("seed", range(6))
def test_the_packed_layout_matches_numpy_and_covers_each_token_once(seed):
    rng = np.random.default_rng(seed)
    b, t, slots = 3, 32, int(rng.integers(2, 5))
    ids = np.cumsum(rng.random((b, t)) < rng.uniform(0.03, 0.2), axis=1).astype(np.int32)
    offsets, lengths, fits = cudnn.segment_layout(jnp.asarray(ids), slots)
    want = _numpy_layout(ids, slots)
    np.testing.assert_array_equal(np.asarray(offsets), want[0])
    np.testing.assert_array_equal(np.asarray(lengths), want[1])
    assert bool(fits) == want[2]
    if want[2]:  # what cuDNN reads back: the same documents, every token in one
        got = np.asarray(cudnn.packed_segment_ids(offsets, lengths, t))
        same = got[:, :, None] == got[:, None, :]
        np.testing.assert_array_equal(same, ids[:, :, None] == ids[:, None, :])


def test_a_row_spills_into_earlier_rows_free_slots_and_too_many_documents_give_nan():
    ids = _segments(2, 32, [[8], [4, 8, 12]])  # 2 and 4 documents, 3 slots per row
    _, _, fits = cudnn.segment_layout(ids, 3)
    assert bool(fits)  # row 1's first document takes row 0's free slot
    ids = _segments(2, 32, [[4, 8, 12], [8]])  # 4 then 2: no run moves to a later row
    _, _, fits = cudnn.segment_layout(ids, 3)
    assert not bool(fits)
    x = _case("standard", seg=False)
    many = jnp.asarray(np.repeat(np.arange(T)[None], 2, 0) // 2)  # 64 two-token documents
    assert cudnn.segment_slots(T) * 2 < 128
    out = cudnn.dot_product_attention(
        x["q1"], x["k1"], x["v"], segment_ids=many, implementation="xla"
    )
    assert np.all(np.isnan(np.asarray(out)))


# ---------------------------------------------------------------------------- what is refused
def test_what_cudnn_or_splash_cannot_run_is_refused_with_the_fix(monkeypatch):
    x = _case("standard")
    with pytest.raises(ValueError, match="bfloat16 or float16.*Fix: model.dtype=bfloat16"):
        cudnn.dot_product_attention(x["q1"], x["k1"], x["v"])
    bf = {k: x[k].astype(jnp.bfloat16) for k in ("q1", "k1", "v")}
    with pytest.raises(ValueError, match="first query with the first key.*Fix"):
        cudnn.dot_product_attention(bf["q1"], bf["k1"][:, :64], bf["v"][:, :64])
    with pytest.raises(ValueError, match="one set of segment ids.*attention_impl=pallas"):
        cudnn.dot_product_attention(
            bf["q1"], bf["k1"], bf["v"], segment_ids=x["segment_ids"],
            kv_segment_ids=x["segment_ids"] + 1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="multiples of 128.*Fix: data.seq_len"):
        splash.dot_product_attention(x["q1"][:, :80], x["k1"][:, :80], x["v"][:, :80])
    reason = cudnn.unsupported(
        dtype="bfloat16", head_dim=192, v_head_dim=192, q_len=8, kv_len=8, causal=True,
        segments=False, compute_capability=(8, 0),
    )  # fmt: skip
    assert "up to 128" in reason
    cudnn.private_api.cache_clear()
    monkeypatch.setattr(cudnn, "PRIVATE_JAX", ((0, 1), (0, 2)))  # a jax outside the range
    try:
        assert cudnn.private_api() is None and not cudnn.wide_value_supported()
        with pytest.raises(ValueError, match="data.document_mask=false, or model.attention_impl"):
            cudnn.dot_product_attention(bf["q1"], bf["k1"], bf["v"], segment_ids=x["segment_ids"])
        assert cudnn.composition("v1", segments=False) == "four cuDNN calls (V in halves)"
    finally:
        cudnn.private_api.cache_clear()


def test_compile_only_tracing_reads_the_given_gpu_and_restores_jax():
    fa = cudnn.private_api()
    assert fa is not None  # jax 0.10.2 here: in the tested range
    saved = fa.check_cudnn_version
    with cudnn.compile_only(91200, (9, 0)):
        assert cudnn.wide_value_supported()
        assert cudnn.composition("v1", segments=False) == "two cuDNN calls (V 2d wide)"
    with cudnn.compile_only(90800, (9, 0)):
        assert not cudnn.wide_value_supported()  # cuDNN 9.8: no value wider than q/k
    assert fa.check_cudnn_version is saved


# ---------------------------------------------------------------------------- the dispatch
def _model(attention: str, impl: str, **kw) -> diffjax.TransformerLM:
    cfg = diffjax.ModelConfig(
        vocab_size=64, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1,
        attention=attention, max_seq_len=T, dtype="bfloat16", attention_impl=impl, **kw,
    )  # fmt: skip
    return diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("attention", ["diff_v1", "diff_v2", "standard"])
def test_models_on_cudnn_and_splash_match_the_xla_path_on_a_mesh(attention):
    """The layers route through ops to the compositions, per shard under a data x tensor mesh."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (4, T)), jnp.int32)
    seg = _segments(4, T, [[50], [], [9, 100], [64]])
    pos = jnp.asarray(np.arange(T)[None].repeat(4, 0), jnp.int32)
    want = np.asarray(_model(attention, "xla")(tokens, pos, seg), np.float32)
    mesh = make_mesh(MeshConfig(data=4, tensor=1, fsdp=2))
    for impl in ("cudnn", "splash"):
        with jax.set_mesh(mesh):
            got = np.asarray(jax.jit(lambda t: _model(attention, impl)(t, pos, seg))(tokens))
        assert np.max(np.abs(got.astype(np.float32) - want)) < 3e-2 * np.max(np.abs(want))


def test_prefill_and_decoding_on_cudnn_equal_the_xla_path():
    """Prefill of left-padded prompts (padding and prompt: two runs of the packed layout), then
    decoded tokens (one query against the cache: the XLA math on either vendor)."""
    prompt = jnp.asarray(np.arange(20).reshape(2, 10) % 64, jnp.int32)
    start = jnp.asarray([0, 4], jnp.int32)  # row 1's prompt is its last 6 tokens
    logits = {}
    for impl in ("xla", "cudnn"):
        model = _model("diff_v2", impl)

        @jax.jit
        def run(prompt, start, model=model):
            out, cache = diffjax.nn.decode.prefill(model, prompt, 16, start)
            steps = [out[:, -1]]
            for token in (3, 5, 7):
                step, cache = diffjax.nn.decode.decode_step(model, jnp.full((2,), token), cache)
                steps.append(step)
            return out, jnp.stack(steps)

        logits[impl] = [np.asarray(a, np.float32) for a in run(prompt, start)]
    (pre, steps), (pre_c, steps_c) = logits["xla"], logits["cudnn"]
    real = np.arange(10)[None, :] >= np.asarray(start)[:, None]  # padded slots: meaningless
    scale = np.max(np.abs(steps))
    assert np.max(np.abs(pre_c - pre)[real]) < 3e-2 * scale
    assert np.max(np.abs(steps_c - steps)) < 3e-2 * scale


def test_the_dispatch_refuses_a_vendor_where_it_cannot_run():
    x = _case("v1", dtype="bfloat16")
    args = (x["q1"], x["k1"], x["q2"], x["k2"], x["v"], x["lam"])
    with pytest.raises(ValueError, match="'cudnn' runs on a GPU.*this target is a TPU"):
        ops.differential_attention(*args, impl="cudnn", target=V5E)
    with pytest.raises(ValueError, match="'splash' runs on a TPU.*Fix: use 'cudnn'"):
        ops.check_impl("splash", H100)
    with pytest.raises(ValueError, match="no row maxima.*train.diagnostics=false"):
        ops.differential_attention(*args, impl="cudnn", logit_max=True)
    with pytest.raises(ConfigError, match="bfloat16 or float16 activations.*model.dtype=bfloat16"):
        diffjax.ModelConfig(attention_impl="cudnn")
    cfg = diffjax.ModelConfig(attention_impl="splash", max_seq_len=256)
    with pytest.raises(ConfigError, match="log-sum-exp.*attention_impl=pallas or auto"):
        diffjax.infra.sharding.check_model_mesh(cfg, make_mesh(MeshConfig(context=2, fsdp=-1)), 8)


# ---------------------------------------------------------------------------- auto
def _entry(kind, seq_len, ms, segments=False, **kw):
    e = dict(
        platform="gpu", compute_capability=[9, 0], kind=kind, dtype="bfloat16", head_dim=128,
        seq_len=seq_len, segments=segments, ms=ms, device="NVIDIA H200", date="2026-12-04",
    )  # fmt: skip
    return {**e, **kw}


def test_auto_takes_the_fastest_eligible_implementation_of_the_nearest_measurement():
    table = [
        _entry("v1", 1024, {"pallas": 1.0, "cudnn": 2.0}),
        _entry("v1", 8192, {"pallas": 9.0, "cudnn": 5.0, "xla": 30.0}),
        _entry("v1", 8192, {"pallas": 9.0, "cudnn": 5.0}, head_dim=64),
    ]
    pick = _fastest_in(table)
    assert pick(seq_len=2048).impl == "pallas"  # nearer 1K than 8K on a log scale
    assert pick(seq_len=16384).impl == "cudnn"
    assert pick(seq_len=16384, eligible={"pallas", "xla"}).impl == "pallas"
    assert pick(seq_len=8192, head_dim=64).entry["head_dim"] == 64
    assert pick(seq_len=8192, segments=True) is None  # nothing measured with documents apart
    assert pick(seq_len=8192, compute_capability=(8, 0)) is None  # an A100: not measured
    assert "NVIDIA H200, 2026-12-04" in pick(seq_len=8192).describe()


def _fastest_in(table):
    def pick(**kw):
        args = dict(
            platform="gpu", compute_capability=(9, 0), kind="v1", dtype="bfloat16",
            head_dim=128, seq_len=1024, segments=False, eligible={"pallas", "cudnn", "xla"},
        )  # fmt: skip
        return impl_table.fastest(**{**args, **kw}, table=table)

    return pick


def test_the_shipped_table_drives_auto_per_call_and_falls_back_where_nothing_was_measured():
    for e in impl_table.entries():
        impl_table.check_entry(e)
    cfg = diffjax.ModelConfig(
        d_model=1024, num_heads=4, num_layers=1, dtype="bfloat16", max_seq_len=32768
    )  # DIFF V1, d = 128: what the H200 measured

    def chosen(cfg, target, **kw):
        return ops.resolve_model(cfg, target, seq_len=16384, **kw).chosen

    impl, why = chosen(cfg, H100, segments=False)
    assert impl == "cudnn" and "measured fastest (NVIDIA H200" in why
    assert chosen(cfg, H100, segments=True)[0] == "pallas"  # not measured
    f32 = dataclasses.replace(cfg, dtype="float32")
    assert chosen(f32, H100, segments=False)[0] == "pallas"  # cuDNN: no float32
    diag = ops.resolve_model(cfg, H100, seq_len=16384, segments=False, logit_max=True)
    assert diag.chosen[0] == "pallas"  # the diagnostics need the kernels' row maxima
    # held per call: the evaluation (no diagnostics) may take cuDNN, a decoded token the XLA math
    assert diag.implementations() == ("pallas", "cudnn")
    assert chosen(cfg, V5E, segments=False)[0] == "pallas"  # no TPU measurement
    assert chosen(cfg, KernelTarget("cpu"), segments=False)[0] == "xla"


def test_the_table_merges_a_new_measurement_over_the_old_one(tmp_path):
    path = tmp_path / "table.json"
    impl_table.write([_entry("v2", 2048, {"pallas": 2.0})], path)
    impl_table.write(
        [_entry("v2", 2048, {"pallas": 2.0, "cudnn": 1.0}), _entry("v2", 4096, {"cudnn": 3.0})],
        path,
    )
    entries = json.loads(path.read_text())["entries"]
    assert [(e["seq_len"], e["ms"]) for e in entries] == [
        (2048, {"pallas": 2.0, "cudnn": 1.0}),
        (4096, {"cudnn": 3.0}),
    ]
    with pytest.raises(ValueError, match="lacks seq_len"):
        impl_table.check_entry(
            {k: v for k, v in _entry("v1", 1, {"x": 1}).items() if k != "seq_len"}
        )


def test_a_run_records_and_reports_the_implementation_each_model_ran(tmp_path):
    """train.py with model.attention_impl=cudnn on CPU (its composition on XLA): both models
    train, result.json says what ran, report.md says it per model."""
    run = tmp_path / "run"
    args = tiny_run(
        "train.steps=2",
        "train.eval_every=2",
        "train.warmup_steps=1",
        "model.dtype=bfloat16",
        "model.attention_impl=cudnn",
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"run.dir={run}"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "attention: cudnn (set explicitly)" in proc.stdout
    result = json.loads((run / "diff" / "seed_0" / "result.json").read_text())
    assert result["attention_impl"] == "cudnn"
    report = (run / "report.md").read_text()
    assert "- attention: diff ran cudnn (set explicitly)" in report
    assert math.isfinite(result["final_train_loss"])


def test_the_run_check_covers_what_auto_may_pick_and_a_failing_composition_names_the_fix(
    monkeypatch,
):
    """Without a shape (generation, evaluation), "auto" on a GPU may pick the kernels or cuDNN:
    both are checked. A planted error in the cuDNN composition (lambda dropped) fails its
    cases, and the fix names the kernels."""
    from diffjax.kernels import check

    monkeypatch.setattr(dispatch, "current_target", lambda: H100)
    monkeypatch.setattr(check, "_PASSED", set())
    monkeypatch.setattr(check, "cache_path", lambda: "/nonexistent/diffjax-kernel-check.json")
    monkeypatch.setattr(check, "_record", lambda path, passed: None)
    seen = []
    real = check.run_check
    monkeypatch.setattr(
        check,
        "run_check",
        lambda cases, **kw: seen.extend(cases) or check.CheckReport("x", "y", ()),
    )
    cfg = diffjax.ModelConfig(d_model=128, num_heads=1, num_layers=1, dtype="bfloat16")
    ops.check_kernels(cfg, interpret=True)
    assert {c.impl for c in seen} == {"pallas", "cudnn"}
    seen.clear()
    ops.check_kernels(dataclasses.replace(cfg, dtype="float32"), interpret=True)
    assert {c.impl for c in seen} == {"pallas"}  # cuDNN takes no float32: auto never picks it
    monkeypatch.setattr(check, "run_check", real)
    combine = _compose.combine
    monkeypatch.setattr(
        _compose, "combine", lambda o1, o2, lam, dtype: combine(o1, o2, 0 * lam, dtype)
    )
    with pytest.raises(ConfigError) as e:
        ops.check_kernels(cfg, ops.resolve("cudnn", H100), interpret=True)
    assert "FAIL cudnn v1 d=64" in str(e.value)
    assert "Fix: set model.attention_impl=pallas (diffjax's kernels) instead of cudnn" in str(
        e.value
    )
