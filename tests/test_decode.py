"""Generation with a KV cache (diffjax.nn.decode): the cache against the full forward at every step,
for every attention kind and head layout, with left-padded prompts of mixed, odd lengths;
generate() against argmax of repeated full forwards; the sampling contracts; one compilation
per bucket; sharded decoding on an 8-device mesh; the fused kernels (interpreted) against XLA;
refusals before any compute; the cache's size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.nn import decode
from diffjax.infra import sharding
from diffjax.infra.sharding import MeshConfig, make_mesh
from tiny import tiny_run

VOCAB = 61
KINDS = {  # name: (attention, num_heads, num_kv_heads)
    "v1": ("diff_v1", 2, None),
    "v1_gqa": ("diff_v1", 4, 2),
    "v1_mqa": ("diff_v1", 2, 1),
    "v2": ("diff_v2", 2, None),
    "v2_gqa": ("diff_v2", 4, 2),
    "v2_mqa": ("diff_v2", 2, 1),
    "standard": ("standard", 4, None),
    "standard_gqa": ("standard", 4, 2),
    "standard_mqa": ("standard", 4, 1),
}
_MODELS: dict = {}


def make_model(kind, impl="xla", seed=0, layers=2, **over):
    attention, h, hkv = KINDS[kind]
    cfg = diffjax.ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        num_layers=layers,
        num_heads=h,
        num_kv_heads=hkv,
        attention=attention,
        max_seq_len=40,
        attention_impl=impl,
        **over,
    )
    key = (cfg, seed)
    if key not in _MODELS:
        _MODELS[key] = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(seed))
    return _MODELS[key]


def rows(seed=0, lengths=(5, 3, 7)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n) for n in lengths]


_prefill = nnx.jit(decode.prefill, static_argnums=2)
_step = nnx.jit(decode.decode_step)
_forward = nnx.jit(lambda m, t: m(t))


def full_logits(model, seqs, width=24):
    """The full forward of each unpadded sequence (the reference): right-padded to ``width`` in
    one batch (causal: what follows a token never changes its logits), so one compilation per
    model serves every length. ``[len(seqs), width, vocab]``."""
    buf = np.zeros((len(seqs), width), np.int32)
    for row, seq in zip(buf, seqs):
        row[: len(seq)] = seq
    return np.asarray(_forward(model, jnp.asarray(buf)))


# ---------------------------------------------------------------------------- cache == forward
@pytest.mark.parametrize(
    "kind, gate",
    [
        *[(k, "none") for k in ("v1", "v1_mqa", "v2", "v2_gqa", "standard_gqa", "standard_mqa")],
        ("v1", "elementwise"),  # gated attention's output gate
        ("v2_gqa", "headwise"),
    ],
)
def test_cache_equals_full_forward_at_every_step(kind, gate):
    """Prompts of lengths 5, 3, 7 left-padded in one batch (plus 2 slots of extra padding): the
    prefill's logits at each row's real tokens and every decode step's logits equal the full
    forward of that row alone, unpadded (positions from 0 at its first token)."""
    model = make_model(kind, gate=gate)
    prompts = rows()
    tokens, lengths = decode.pad_prompts(prompts, pad_id=VOCAB - 1)
    tokens = np.concatenate([np.full((3, 2), 7, np.int32), tokens], axis=1)  # more padding
    start = tokens.shape[1] - lengths
    logits, cache = _prefill(model, jnp.asarray(tokens), 16, jnp.asarray(start))
    logits = np.asarray(logits)
    feed = np.random.default_rng(1).integers(0, VOCAB, (6, 3))  # teacher-forced tokens
    ref = full_logits(model, [np.concatenate([p, feed[:, b]]) for b, p in enumerate(prompts)])
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(logits[b, start[b] :], ref[b, : len(p)], atol=2e-5, rtol=2e-5)
    for step in range(6):
        logits, cache = _step(model, jnp.asarray(feed[step], jnp.int32), cache)
        for b, p in enumerate(prompts):
            np.testing.assert_allclose(
                np.asarray(logits)[b],
                ref[b, len(p) + step],
                atol=2e-5,
                rtol=2e-5,
                err_msg=f"step {step} row {b}",
            )
    assert int(cache.index) == tokens.shape[1] + 6


def test_cache_layout_is_what_each_kind_caches():
    """V1: raw key heads K1, K2 of width d per kv group and a 2d-wide value; V2 and the twin: one
    key and one value per kv head."""
    v1 = make_model("v1_gqa")  # 4 DIFF heads, 2 kv heads, d = 32 / 8 = 4
    assert decode.cache_layout(v1)[0] == {"k": (2, 4), "k2": (2, 4), "v": (2, 8)}
    v2 = make_model("v2_gqa")  # 4 heads, 2 kv heads, d = 8
    assert decode.cache_layout(v2)[0] == {"k": (2, 8), "v": (2, 8)}
    cache = decode.init_cache(v1, 2, 8)
    assert cache.layers[0]["v"].shape == (2, 8, 2, 8) and len(cache.layers) == 2
    assert decode.cache_layout(v1.config) == decode.cache_layout(v1)
    assert cache.nbytes == 2 * 8 * decode.cache_bytes_per_token(v1)


def test_cache_bytes_per_token_diff_and_twin():
    """The figures docs/generation.md states. 125M (bf16, 12 layers, DIFF V1 6 heads of 2x64):
    per layer K1+K2 = 2*6*64 and V = 6*128 values, the twin's 12 kv heads of 64 twice: equal."""
    cfg = diffjax.ModelConfig(
        vocab_size=50304,
        d_model=768,
        num_layers=12,
        num_heads=6,
        attention="diff_v1",
        max_seq_len=2048,
        dtype="bfloat16",
        tie_embeddings=True,
    )
    assert decode.cache_bytes_per_token(cfg) == 12 * (2 * 6 * 64 + 6 * 128) * 2 == 36864
    assert decode.cache_bytes_per_token(diffjax.twin(cfg)) == 12 * 2 * 12 * 64 * 2 == 36864
    v2 = cfg.replace(attention="diff_v2", num_heads=12, num_kv_heads=4)  # 24 query heads of 64
    assert decode.cache_bytes_per_token(v2) == 12 * 2 * 4 * 64 * 2 == 12288
    assert decode.cache_bytes_per_token(diffjax.twin(v2)) == 12288
    assert decode.cache_bytes_per_token(cfg, jnp.float32) == 2 * 36864


# ---------------------------------------------------------------------------- generate
def greedy_reference(model, prompts, n):
    """Each prompt continued by ``n`` argmax tokens of repeated full forwards."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        logits = full_logits(model, seqs)
        for b, seq in enumerate(seqs):
            seq.append(int(np.argmax(logits[b, len(seq) - 1])))
    return seqs


@pytest.mark.parametrize("kind", ["v1", "v2_gqa", "standard_mqa"])
def test_greedy_generate_equals_argmax_of_full_forwards(kind):
    model = make_model(kind, seed=3)
    prompts = rows(seed=2, lengths=(4, 9, 1))
    tokens, lengths = decode.pad_prompts(prompts, pad_id=0)
    out = np.asarray(diffjax.generate(model, tokens, 7, prompt_lengths=lengths, length_bucket=8))
    assert out.shape == (3, 9 + 7) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :9], tokens)  # the prompt as given
    for b, ref in enumerate(greedy_reference(model, prompts, 7)):
        assert out[b, 9 + 7 - len(ref) :].tolist() == ref, f"row {b}"


def test_sampling_contracts():
    model = make_model("v2", seed=1)
    prompt = np.stack(rows(seed=4, lengths=(6, 6)))
    greedy = diffjax.generate(model, prompt, 8)
    top1 = diffjax.generate(model, prompt, 8, temperature=1.5, top_k=1, rng=jax.random.key(5))
    np.testing.assert_array_equal(top1, greedy)
    a = diffjax.generate(model, prompt, 8, temperature=2.0, rng=jax.random.key(7))
    b = diffjax.generate(model, prompt, 8, temperature=2.0, rng=jax.random.key(7))
    c = diffjax.generate(model, prompt, 8, temperature=2.0, rng=7)  # an int seed is key(7)
    d = diffjax.generate(model, prompt, 8, temperature=2.0, rng=jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert not np.array_equal(a, d)  # 16 draws at T=2 over 61 tokens: not all the same
    assert diffjax.generate(model, prompt, 0).shape == prompt.shape


def test_eos_id_ends_each_row():
    """A row that produced eos_id continues with eos_id; the other rows as without it."""
    model = make_model("v2", seed=1)
    prompt = np.stack(rows(seed=4, lengths=(6, 6)))
    greedy = np.asarray(diffjax.generate(model, prompt, 8))[:, 6:]
    eos = int(greedy[0, 2])  # row 0's third new token
    out = np.asarray(diffjax.generate(model, prompt, 8, eos_id=eos))[:, 6:]
    for b in range(2):
        hits = np.flatnonzero(greedy[b] == eos)
        k = int(hits[0]) + 1 if hits.size else 8
        assert out[b].tolist() == greedy[b, :k].tolist() + [eos] * (8 - k), f"row {b}"
    with pytest.raises(ValueError, match="eos_id"):
        diffjax.generate(model, prompt, 8, eos_id=VOCAB)


def test_sample_logits_top_k_and_temperature():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 20)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2000)
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    s = np.asarray(
        jax.vmap(lambda k: decode.sample_logits(logits, k, temperature=1.0, top_k=3)[0])(keys)
    )
    assert set(s.tolist()) <= top3 and len(set(s.tolist())) == 3
    # at T=1 without top_k the frequencies follow softmax(logits)
    s = np.asarray(jax.vmap(lambda k: decode.sample_logits(logits, k, temperature=1.0)[0])(keys))
    freq = np.bincount(s, minlength=20) / s.size
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[0])), atol=0.04)


def test_decode_compiles_once_per_bucket():
    """Prompts of different lengths, contents and batch contents within one bucket, and different
    numbers of new tokens, reuse one prefill and one decode loop; a new bucket traces again."""
    model = make_model("v1")
    before = decode.TRACE_COUNTS.copy()
    for n, lengths, seed in ((5, (5, 3, 7), 0), (3, (2, 8, 1), 1), (9, (6, 6, 6), 2)):
        tokens, lens = decode.pad_prompts(rows(seed, lengths))
        diffjax.generate(model, tokens, n, prompt_lengths=lens, length_bucket=16)
    assert decode.TRACE_COUNTS["prefill"] - before["prefill"] == 1
    assert decode.TRACE_COUNTS["decode"] - before["decode"] == 1
    tokens, lens = decode.pad_prompts(rows(0, (20, 3, 7)))  # a longer prompt: the next bucket
    diffjax.generate(model, tokens, 3, prompt_lengths=lens, length_bucket=16)
    assert decode.TRACE_COUNTS["prefill"] - before["prefill"] == 2


# ---------------------------------------------------------------------------- refusals
def test_bad_requests_are_refused_before_any_compute():
    model = make_model("v1")  # max_seq_len 40
    prompt = np.zeros((2, 30), np.int32)
    before = decode.TRACE_COUNTS.copy()
    cases = [
        (
            dict(prompt=prompt, max_new_tokens=11),
            "30 tokens.*plus max_new_tokens=11.*max_seq_len=40.*at most 10 new tokens",
        ),
        (dict(prompt=prompt[0], max_new_tokens=2), "prompt must be \\[batch, prompt length\\]"),
        (dict(prompt=prompt.astype(np.float32), max_new_tokens=2), "integer tokens"),
        (dict(prompt=prompt + VOCAB, max_new_tokens=2), "outside the vocabulary"),
        (dict(prompt=prompt, max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
        (dict(prompt=prompt, max_new_tokens=2, temperature=-1.0), "temperature"),
        (dict(prompt=prompt, max_new_tokens=2, temperature=1.0), "needs rng"),
        (dict(prompt=prompt, max_new_tokens=2, temperature=1.0, rng=0, top_k=0), "top_k"),
        (dict(prompt=prompt, max_new_tokens=2, prompt_lengths=[3]), "prompt_lengths must be 2"),
        (dict(prompt=prompt, max_new_tokens=2, prompt_lengths=[0, 3]), "prompt_lengths must be in"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            diffjax.generate(model, **kw)
    # the limit is on real tokens: 30 padded columns holding 10-token prompts may ask for 30
    out = diffjax.generate(model, prompt, 30, prompt_lengths=[10, 10])
    assert out.shape == (2, 60)
    assert decode.TRACE_COUNTS["prefill"] - before["prefill"] <= 1
    with pytest.raises(TypeError, match="TransformerLM"):
        diffjax.generate(object(), prompt, 1)


# ---------------------------------------------------------------------------- mesh and kernels
def _place(model, mesh):
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        state = jax.device_put(state, sharding.tree_shardings(state, mesh))
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("kind", ["v1_gqa", "v2_gqa"])
def test_sharded_decoding_equals_single_device(kind):
    """data=2, fsdp=2, tensor=2: the cache is split by batch rows over data x fsdp and by kv
    heads over tensor, and greedy generation gives the single-device tokens."""
    model = make_model(kind, seed=5, layers=1)
    prompts = rows(seed=6, lengths=(5, 3, 7, 2))
    tokens, lengths = decode.pad_prompts(prompts)
    expected = np.asarray(diffjax.generate(model, tokens, 4, prompt_lengths=lengths))
    ref_logits, _ = _prefill(model, jnp.asarray(tokens), 16, jnp.asarray(7 - lengths))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = _place(model, mesh)
    with jax.set_mesh(mesh):
        out = np.asarray(diffjax.generate(sharded, tokens, 4, prompt_lengths=lengths))
        logits, cache = _prefill(sharded, jnp.asarray(tokens), 16, jnp.asarray(7 - lengths))
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=1e-5)
    for arr in cache.layers[0].values():
        assert arr.sharding.spec[:3] == (("data", "fsdp"), None, "tensor"), arr.sharding
        assert (
            arr.addressable_shards[0].data.shape[0] == 1
            and arr.addressable_shards[0].data.shape[2] == 1
        )


@pytest.mark.parametrize(
    "kind, gate",
    [("v1_gqa", "none"), ("v2", "none"), ("standard_mqa", "none"), ("v2", "elementwise")],
)
def test_fused_kernels_decode_like_xla(kind, gate):
    """attention_impl='pallas' (the Pallas GPU kernel, interpreted on CPU) for the prefill and
    for one query against the cache with the filled slots as kv segment ids: the XLA path's
    logits."""
    xla = make_model(kind, seed=2, layers=1, gate=gate)
    fused = make_model(kind, impl="pallas", seed=2, layers=1, gate=gate)  # the same weights
    tokens, lengths = decode.pad_prompts(rows(seed=3, lengths=(4, 2)))
    start = jnp.asarray(4 - lengths)
    results = []
    for model in (xla, fused):
        logits, cache = decode.prefill(model, jnp.asarray(tokens), 8, start)
        step, cache = decode.decode_step(model, jnp.asarray([3, 5], jnp.int32), cache)
        results.append([np.asarray(logits)[0], np.asarray(logits)[1, 2:], np.asarray(step)])
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- the sample command
TINY_RUN = tiny_run(
    "train.eval_batches=2",
    "train.steps=4",
    "compare.twins=",
    drop=("train.tensorboard", "compare.throughput_rounds"),
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from diffjax.compare.cli import main as train_main

    run_dir = tmp_path_factory.mktemp("sample") / "run"
    assert train_main([f"run.dir={run_dir}", *TINY_RUN]) == 0
    return run_dir


def test_sample_prints_text_from_a_trained_run(tiny_run, capsys):
    from diffjax import sample
    from diffjax.train import load_model

    capsys.readouterr()
    assert sample.main([str(tiny_run), "def main(", "x", "sample.max_new_tokens=12"]) == 0
    captured = capsys.readouterr()
    assert f"model: {tiny_run / 'diff' / 'seed_0'}" in captured.err and "diff_v1" in captured.err
    first, second = captured.out.split("-" * 40 + "\n")
    assert first.startswith("def main(") and second.startswith("x")
    # the text is the greedy continuation of the best checkpoint, through the byte tokenizer
    model = load_model(str(tiny_run / "diff" / "seed_0"))
    expected = sample.sample(model, ["def main("], 12)[0]
    assert first == "def main(" + expected + "\n"
    # sampled, by label, from the latest checkpoint
    assert (
        sample.main(
            [
                str(tiny_run),
                "a",
                "sample.model=diff",
                "sample.temperature=1.0",
                "sample.top_k=5",
                "sample.max_new_tokens=4",
                "sample.step=latest",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "checkpoint latest" in captured.err and captured.out.startswith("a")
    # too long for max_seq_len=32: refused with the fix, exit status 2
    assert sample.main([str(tiny_run), "abc", "sample.max_new_tokens=40"]) == 2
    assert "at most 29 new tokens" in capsys.readouterr().err


def test_sample_finds_models_in_both_run_layouts(tmp_path, capsys):
    from diffjax import sample

    for rel in ("diff/seed_1", "diff/seed_0", "standard/seed_0", "standard/seed_1"):
        (tmp_path / "multi" / rel / "checkpoints").mkdir(parents=True)
    (tmp_path / "multi" / "diff" / "seed_0" / "tb").mkdir()
    path, note = sample.choose_model(str(tmp_path / "multi"))
    assert path == str(tmp_path / "multi" / "diff" / "seed_0") and "sample.train_seed" in note
    path, _ = sample.choose_model(str(tmp_path / "multi"), "standard", 1)
    assert path == str(tmp_path / "multi" / "standard" / "seed_1")
    with pytest.raises(
        sample.ModelChoiceError,
        match=r"sample.model in \['diff', 'standard'\] and "
        r"sample.train_seed in \[0, 1\]",
    ):
        sample.choose_model(str(tmp_path / "multi"), "diff", 7)
    (tmp_path / "one" / "checkpoints").mkdir(parents=True)
    assert sample.choose_model(str(tmp_path / "one"))[0] == str(tmp_path / "one")
    assert sample.choose_model(str(tmp_path / "one" / "checkpoints"))[0] == str(tmp_path / "one")
    with pytest.raises(sample.ModelChoiceError, match="no model under"):
        sample.choose_model(str(tmp_path / "multi" / "diff" / "seed_0" / "tb"))
    assert sample.main([str(tmp_path / "empty"), "x"]) == 2
    assert "no model under" in capsys.readouterr().err
