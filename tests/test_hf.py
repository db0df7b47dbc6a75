"""Hugging Face checkpoints in and out (diffjax.interop.hf), against transformers itself.

Tiny random ``DiffLlamaForCausalLM`` / ``LlamaForCausalLM`` models (float32, eager attention)
are written with ``save_pretrained`` and read with ``diffjax.from_pretrained``; diffjax models
trained for a few steps are written with ``diffjax.save_pretrained`` and read by
``transformers.AutoModelForCausalLM``. Tolerance: float32, max |logit difference| <= 2e-5 x the
largest |logit| (logits of magnitude 7-10; measured <= 6.2e-6 x, i.e. <= 5.8e-5 absolute). A
wrong head or channel permutation, a dropped weight or a missing rope scaling moves the logits
by O(1)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import diffjax
from diffjax.interop import hf
from diffjax.infra.sharding import MeshConfig, make_mesh

from tiny import MODEL_KEYS, tiny_run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REL_TOL = 2e-5
VOCAB = 61
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LINEAR = {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}


def hf_model(
    model_type: str,
    *,
    heads: int = 4,
    kv_heads: int = 4,
    tie: bool = False,
    rope: dict | None = None,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = VOCAB,
    seed: int = 0,
):
    """A random float32 transformers model whose every weight is far from its init (norm and
    lambda vectors included), so a wrong permutation or a dropped weight shows in the logits."""
    torch.manual_seed(seed)
    cls = transformers.DiffLlamaConfig if model_type == "diffllama" else transformers.LlamaConfig
    config = cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        max_position_embeddings=64,
        rope_parameters=rope,
        attn_implementation="eager",
    )
    model_cls = (
        transformers.DiffLlamaForCausalLM
        if model_type == "diffllama"
        else transformers.LlamaForCausalLM
    )
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "lambda" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return model


def tokens(batch: int = 2, seq: int = 24, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int64)


def torch_logits(model, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(toks)).logits.float().numpy()


def jax_logits(model, toks: np.ndarray) -> np.ndarray:
    return np.asarray(model(jnp.asarray(toks, jnp.int32)))


def assert_logits_close(out: np.ndarray, ref: np.ndarray) -> None:
    assert out.shape == ref.shape
    scale = float(np.abs(ref).max())
    err = float(np.abs(out - ref).max())
    assert scale > 1.0  # not trivially small logits
    assert err <= REL_TOL * scale, f"max |diff| {err:.3g} > {REL_TOL} x max |logit| {scale:.3g}"


def hf_load(path: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # transformers initialises missing weights at random: every weight must have been read
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


# ---------------------------------------------------------------------------- Hugging Face -> diffjax
CASES = {
    "mha-untied": dict(heads=4, kv_heads=4, tie=False, rope=None),
    "gqa2-tied-llama3": dict(heads=8, kv_heads=4, tie=True, rope=LLAMA3),
    "gqa2-untied-linear": dict(heads=8, kv_heads=4, tie=False, rope=LINEAR),
}


@pytest.mark.parametrize("model_type", ["diffllama", "llama"])
@pytest.mark.parametrize("case", list(CASES))
def test_from_pretrained_matches_transformers(tmp_path, model_type, case):
    ref_model = hf_model(model_type, **CASES[case])
    ref_model.save_pretrained(tmp_path)
    model = diffjax.from_pretrained(str(tmp_path))
    cfg = model.config
    kw = CASES[case]
    if model_type == "diffllama":
        assert (cfg.attention, cfg.num_heads, cfg.kv_heads) == (
            "diff_v1",
            kw["heads"] // 2,
            kw["kv_heads"] // 2,
        )
        assert cfg.diff_norm_eps == ref_model.config.rms_norm_eps
    else:
        assert (cfg.attention, cfg.num_heads, cfg.kv_heads) == (
            "standard",
            kw["heads"],
            kw["kv_heads"],
        )
    assert cfg.tie_embeddings == kw["tie"] and (model.lm_head is None) == kw["tie"]
    assert cfg.rope_scaling == (kw["rope"] or {}).get("rope_type", "none")
    toks = tokens()
    assert_logits_close(jax_logits(model, toks), torch_logits(ref_model, toks))


def test_rope_scaling_is_used(tmp_path):
    """Loading a llama3-scaled checkpoint without its scaling changes the logits: the test above
    would notice a scaling that is ignored."""
    ref_model = hf_model("diffllama", **CASES["gqa2-tied-llama3"])
    ref_model.save_pretrained(tmp_path)
    model = diffjax.from_pretrained(str(tmp_path))
    plain = diffjax.TransformerLM(
        model.config.replace(rope_scaling="none", rope_factor=1.0), rngs=nnx.Rngs(0)
    )
    nnx.update(plain, nnx.state(model, nnx.Param))
    toks = tokens()
    ref = torch_logits(ref_model, toks)
    assert np.abs(jax_logits(plain, toks) - ref).max() > 100 * REL_TOL * np.abs(ref).max()


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_scaled_frequencies_match_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(LINEAR if kind == "linear" else LLAMA3, rope_theta=500000.0)
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=64, rope_parameters=rope
    )
    ref, _ = ROPE_INIT_FUNCTIONS[kind](config)
    cfg = hf.config_from_hf(config.to_dict())
    base = 1.0 / (500000.0 ** (jnp.arange(0, 128, 2, dtype=jnp.float32) / 128))
    ours = diffjax.nn.layers.scale_inv_freq(base, cfg.rope_scaling_spec)
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)
    assert not np.allclose(np.asarray(base), ref.numpy())  # the scaling did something


def test_older_rope_layout_is_read():
    """``rope_theta`` + ``rope_scaling`` (transformers < 5, most hub checkpoints)."""
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=32,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    cfg = hf.config_from_hf(
        {
            **base,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == (
        500000.0,
        "llama3",
        32.0,
        8192,
    )
    cfg = hf.config_from_hf(
        {**base, "rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor) == (1000.0, "linear", 4.0)
    cfg = hf.config_from_hf({**base, "rope_theta": 1000.0, "rope_scaling": None})
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.num_kv_heads, cfg.norm_eps) == (
        1000.0,
        "none",
        4,
        1e-6,
    )


def test_permutations_are_the_documented_ones():
    # DiffLlama raw heads 0..3 of d=4: diffjax raw head 2i+s <- HF head i + 2s; channels
    # 2j+t <- j + 2t (half-split -> interleaved rotary)
    perm = hf.row_permutation(4, 4, pair_halves=True, rotary=True)
    heads, chans = perm // 4, perm % 4
    np.testing.assert_array_equal(heads, np.repeat([0, 2, 1, 3], 4))
    np.testing.assert_array_equal(chans, np.tile([0, 2, 1, 3], 4))
    np.testing.assert_array_equal(
        hf.row_permutation(3, 2, pair_halves=False, rotary=False), np.arange(6)
    )


# ---------------------------------------------------------------------------- diffjax -> Hugging Face
def train_a_few_steps(cfg: diffjax.ModelConfig, steps: int = 3) -> diffjax.TransformerLM:
    """A diffjax model after a few Adam steps at a large learning rate: every weight (subln,
    lambda and norms included) has moved from its initial value."""
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(1))
    opt = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
    toks = jnp.asarray(tokens(4, 16, cfg.vocab_size, seed=3), jnp.int32)

    def loss_fn(m):
        logits = m(toks[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        o.update(m, grads)
        return loss

    for _ in range(steps):
        step(model, opt)
    return model


EXPORT_CASES = {
    "diff-gqa2-untied-llama3": dict(
        attention="diff_v1",
        num_heads=4,
        num_kv_heads=2,
        tie_embeddings=False,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_original_max_len=16,
        rope_theta=500000.0,
    ),
    "diff-mha-tied": dict(attention="diff_v1", num_heads=2, tie_embeddings=True),
    "standard-gqa2-tied-linear": dict(
        attention="standard",
        num_heads=8,
        num_kv_heads=4,
        tie_embeddings=True,
        rope_scaling="linear",
        rope_factor=2.0,
    ),
    "standard-mha-untied": dict(attention="standard", num_heads=4, tie_embeddings=False),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_save_pretrained_loads_in_transformers(tmp_path, case):
    cfg = diffjax.ModelConfig(
        vocab_size=VOCAB, d_model=64, num_layers=2, ffn_dim=48, max_seq_len=64, **EXPORT_CASES[case]
    )
    model = train_a_few_steps(cfg)
    if cfg.attention == "diff_v1":
        subln = np.asarray(model.layers[0].attn.subln.scale[...])
        assert np.abs(subln - 1).max() > 1e-2  # the folded weight is not the identity
    out = tmp_path / "export"
    assert diffjax.save_pretrained(model, str(out)) == str(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == ("diffllama" if cfg.attention == "diff_v1" else "llama")
    ref_model = hf_load(str(out))
    assert type(ref_model).__name__ == saved["architectures"][0]
    toks = tokens()
    assert_logits_close(torch_logits(ref_model, toks), jax_logits(model, toks))
    # and back in: the same config, the same logits (subln now 1, folded into o_proj)
    again = diffjax.from_pretrained(str(out))
    assert again.config == cfg.replace(
        num_kv_heads=cfg.kv_heads,
        head_dim=None if cfg.attention == "diff_v1" else cfg.resolved_head_dim,
    )
    assert_logits_close(jax_logits(again, toks), jax_logits(model, toks))


# ---------------------------------------------------------------------------- DIFF V2 and the byte tokenizer
# Run in a subprocess in which diffjax cannot be imported: the export's own modeling code, its
# logits (eager, SDPA, and with documents kept apart by a 4-D mask and per-document
# positions), greedy generation with transformers' cache, and AutoTokenizer on texts.
PEER = r"""
import importlib.abc, json, sys

class NoDiffjax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "diffjax" or name.startswith("diffjax."):
            raise ImportError("diffjax is not on this path")

sys.meta_path.insert(0, NoDiffjax())
import numpy as np, torch, transformers

path, toks_file, out_file = sys.argv[1:4]
toks = np.load(toks_file)
load = transformers.AutoModelForCausalLM.from_pretrained
out = {}
for impl in ("eager", "sdpa"):
    model = load(path, trust_remote_code=True, dtype=torch.float32, attn_implementation=impl)
    with torch.no_grad():
        out[impl] = model(torch.from_numpy(toks["tokens"])).logits.numpy()
        seg = torch.from_numpy(toks["segments"])
        allowed = (seg[:, :, None] == seg[:, None, :]) & torch.ones(seg.shape[1], seg.shape[1]).tril().bool()
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
        out[impl + "_docs"] = model(
            torch.from_numpy(toks["tokens"]),
            attention_mask=mask,
            position_ids=torch.from_numpy(toks["positions"]),
        ).logits.numpy()
out["generated"] = model.generate(
    torch.from_numpy(toks["prompt"]), max_new_tokens=8, do_sample=False, use_cache=True,
    pad_token_id=0,
).numpy()
out["model_class"] = np.array(type(model).__name__)
assert "diffjax" not in sys.modules
tok = transformers.AutoTokenizer.from_pretrained(path)
texts = json.loads(toks["texts"].item())
out["encoded"] = np.array(json.dumps([tok(t)["input_ids"] for t in texts]))
out["decoded"] = np.array(json.dumps([tok.decode(list(t.encode()) + [257], skip_special_tokens=True) for t in texts]))
out["specials"] = np.array([tok.bos_token_id, tok.eos_token_id, tok.pad_token_id])
np.savez(out_file, **out)
"""

TEXTS = ["héllo wörld\n\t ✓ 😀", "a <eos> b <bos><pad>", " don 't  ,  . ", ""]


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_diff_v2_export_is_exact_in_transformers_without_diffjax(tmp_path, kv_heads):
    """DIFF V2 (GQA and MHA) trained a few steps: its export loads through the modeling code
    written beside it in a process that cannot import diffjax; logits (eager and SDPA, with
    documents apart too), greedy generation with the cache and the byte tokenizer are
    diffjax's; and from_pretrained reads it back exactly."""
    import subprocess
    import sys

    cfg = diffjax.ModelConfig(
        vocab_size=259,
        d_model=64,
        num_layers=2,
        ffn_dim=48,
        max_seq_len=64,
        rope_theta=500.0,
        attention="diff_v2",
        num_heads=4,
        num_kv_heads=kv_heads,
    )
    model = train_a_few_steps(cfg)
    out = tmp_path / "export"
    diffjax.save_pretrained(model, str(out), tokenizer="byte")
    saved = json.loads((out / "config.json").read_text())
    assert (
        saved["model_type"] == "diff_transformer_v2" and "AutoModelForCausalLM" in saved["auto_map"]
    )
    for f in hf.REMOTE_FILES:  # its code (past the docstring) imports torch and transformers
        code = (out / f).read_text().split('"""', 2)[2]
        assert "diffjax" not in code and "import" in code
    rng = np.random.default_rng(4)
    toks = rng.integers(0, 256, (2, 24))
    segments = np.array([[0] * 8 + [1] * 9 + [2] * 7, [0] * 15 + [1] * 9])
    positions = np.concatenate(
        [
            np.concatenate([np.arange(n) for n in np.unique(row, return_counts=True)[1]])[None]
            for row in segments
        ]
    )
    prompt = rng.integers(0, 256, (2, 5))
    np.savez(
        tmp_path / "in.npz",
        tokens=toks,
        segments=segments,
        positions=positions,
        prompt=prompt,
        texts=np.array(json.dumps(TEXTS)),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-c", PEER, str(out), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        check=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    peer = np.load(tmp_path / "out.npz")
    assert str(peer["model_class"]) == "DiffTransformerV2ForCausalLM"
    ours = jax_logits(model, toks)
    assert_logits_close(peer["eager"], ours)
    assert_logits_close(peer["sdpa"], ours)
    docs = np.asarray(model(*(jnp.asarray(a, jnp.int32) for a in (toks, positions, segments))))
    assert np.abs(docs - ours).max() > 1e-2  # documents apart is another computation
    assert_logits_close(peer["eager_docs"], docs)
    assert_logits_close(peer["sdpa_docs"], docs)
    ref = np.asarray(diffjax.generate(model, jnp.asarray(prompt, jnp.int32), 8))
    np.testing.assert_array_equal(peer["generated"], ref)
    from diffjax.data.tokenizer import ByteTokenizer, HFTokenizer

    byte = ByteTokenizer()
    assert json.loads(str(peer["encoded"])) == [byte.encode(t).tolist() for t in TEXTS]
    assert json.loads(str(peer["decoded"])) == TEXTS
    assert peer["specials"].tolist() == [byte.bos_id, byte.eos_id, byte.pad_id]
    ours_hf = HFTokenizer(str(out))  # diffjax reads the export's tokenizer the same way
    assert [ours_hf.encode(t).tolist() for t in TEXTS] == [byte.encode(t).tolist() for t in TEXTS]
    assert (ours_hf.bos_id, ours_hf.eos_id, ours_hf.pad_id) == (256, 257, 258)
    # and back in: the same config and logits
    again = diffjax.from_pretrained(str(out))
    assert again.config == cfg.replace(num_kv_heads=cfg.kv_heads, head_dim=cfg.resolved_head_dim)
    np.testing.assert_array_equal(jax_logits(again, toks), ours)


def test_every_byte_sequence_round_trips_through_the_byte_tokenizer_json():
    """All 256 byte values, invalid UTF-8 included: the tokenizer.json's ids and decoding are
    the byte tokenizer's (tokenizers itself, no transformers)."""
    from tokenizers import Tokenizer

    from diffjax.data.tokenizer import ByteTokenizer

    files = hf.byte_tokenizer_files()
    tok = Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
    assert tok.get_vocab_size() == 259
    rng = np.random.default_rng(0)
    for n in (1, 7, 300):
        ids = rng.integers(0, 256, n).tolist()
        assert tok.decode(ids) == ByteTokenizer().decode(ids)
        text = bytes(ids).decode("utf-8", errors="replace")
        assert tok.encode(text).ids == ByteTokenizer().encode(text).tolist()
    assert [tok.id_to_token(i) for i in (256, 257, 258)] == ["<bos>", "<eos>", "<pad>"]


def test_bfloat16_parameters_are_written_as_bfloat16(tmp_path):
    from safetensors import safe_open

    cfg = diffjax.ModelConfig(
        vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=2, param_dtype="bfloat16", ffn_dim=32
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    diffjax.save_pretrained(model, str(tmp_path / "bf16"))
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "np") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.dtype == jnp.bfloat16
    back = diffjax.from_pretrained(str(tmp_path / "bf16"), param_dtype="bfloat16")
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))
    ):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ---------------------------------------------------------------------------- sharded files, mesh
def test_sharded_safetensors_both_ways(tmp_path):
    ref_model = hf_model("diffllama", heads=8, kv_heads=4)
    ref_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    model = diffjax.from_pretrained(str(tmp_path / "hf"))
    toks = tokens()
    assert_logits_close(jax_logits(model, toks), torch_logits(ref_model, toks))

    out = tmp_path / "out"
    diffjax.save_pretrained(model, str(out), max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    assert not (out / "model.safetensors").exists()
    assert_logits_close(torch_logits(hf_load(str(out)), toks), torch_logits(ref_model, toks))


def test_loads_onto_a_mesh(tmp_path):
    """Each parameter is placed on the fsdp x tensor mesh by its logical axes as it is read."""
    ref_model = hf_model("diffllama", heads=8, kv_heads=4)
    ref_model.save_pretrained(tmp_path)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    model = diffjax.from_pretrained(str(tmp_path), mesh=mesh)
    q = model.layers[0].attn.q_proj.kernel[...]
    assert q.sharding.mesh.shape == mesh.shape
    assert tuple(q.sharding.spec) == ("fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (64 // 4, 64 // 2)
    emb = model.embed.embedding[...]
    assert emb.addressable_shards[0].data.shape == (VOCAB, 64 // 4)  # 61 rows: not split
    toks = tokens()
    with jax.set_mesh(mesh):
        out = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(toks, jnp.int32)))
    assert_logits_close(out, torch_logits(ref_model, toks))


# ---------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    hf_model("llama", heads=4, kv_heads=2, hidden=32, layers=1).save_pretrained(path)
    return path


def _copy(src, dst, config_changes=None, drop=()):
    import shutil

    shutil.copytree(src, dst)
    for name in drop:
        os.remove(os.path.join(dst, name))
    if config_changes is not None:
        file = os.path.join(dst, "config.json")
        cfg = json.load(open(file))
        cfg.update(config_changes)
        json.dump(cfg, open(file, "w"))
    return str(dst)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"model_type": "mistral"}, r"model_type 'mistral' is not supported.*'diffllama'.*'llama'"),
        ({"attention_bias": True}, r"attention_bias=true.*no bias"),
        ({"mlp_bias": True}, r"mlp_bias=true"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"attention_dropout": 0.1}, r"attention_dropout=0.1"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            r"rope_type 'yarn' is not supported.*'default', 'linear' and 'llama3'",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            r"partial_rotary_factor=0.5",
        ),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3 does not divide"),
        ({"hidden_size": None}, r"hidden_size is missing"),
    ],
)
def test_refuses_configs_it_cannot_express(tmp_path, good_dir, changes, match):
    path = _copy(good_dir, tmp_path / "c", changes)
    with pytest.raises(diffjax.PretrainedError, match=match):
        diffjax.from_pretrained(path)


def test_refuses_diffllama_layouts_it_cannot_express():
    base = dict(
        model_type="diffllama",
        vocab_size=10,
        hidden_size=32,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(diffjax.PretrainedError, match=r"must be even"):
        hf.config_from_hf({**base, "num_key_value_heads": 1})
    with pytest.raises(diffjax.PretrainedError, match=r"head_dim=16 with 4 heads"):
        hf.config_from_hf({**base, "head_dim": 16})


def test_refuses_missing_files(tmp_path, good_dir):
    with pytest.raises(diffjax.PretrainedError, match=r"is not a directory"):
        diffjax.from_pretrained(str(tmp_path / "nowhere"))
    path = _copy(good_dir, tmp_path / "noconfig", drop=["config.json"])
    with pytest.raises(diffjax.PretrainedError, match=r"config\.json: does not exist"):
        diffjax.from_pretrained(path)
    path = _copy(good_dir, tmp_path / "noweights", drop=["model.safetensors"])
    with pytest.raises(diffjax.PretrainedError, match=r"holds no model\.safetensors"):
        diffjax.from_pretrained(path)


def test_refuses_a_missing_shard(tmp_path):
    hf_model("llama", hidden=32, layers=1).save_pretrained(tmp_path / "s", max_shard_size="10KB")
    shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(diffjax.PretrainedError, match=f"lists {shard.name}, which is missing"):
        diffjax.from_pretrained(str(tmp_path / "s"))


def test_refuses_weights_that_do_not_match_the_config(tmp_path, good_dir):
    from safetensors.numpy import load_file, save_file

    path = _copy(good_dir, tmp_path / "w")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    save_file(weights, file)
    with pytest.raises(
        diffjax.PretrainedError,
        match=r"k_proj\.weight has shape \(32, 32\), the config needs \(16, 32\)",
    ):
        diffjax.from_pretrained(path)
    del weights["model.layers.0.self_attn.k_proj.weight"]
    weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(weights, file)
    with pytest.raises(
        diffjax.PretrainedError,
        match=r"missing model\.layers\.0\.self_attn\.k_proj"
        r"\.weight; unexpected .*q_proj\.bias",
    ):
        diffjax.from_pretrained(path)


def test_overrides(good_dir):
    model = diffjax.from_pretrained(str(good_dir), param_dtype="bfloat16", max_seq_len=32)
    assert model.config.param_dtype == "bfloat16" and model.config.max_seq_len == 32
    assert model.layers[0].attn.q_proj.kernel[...].dtype == jnp.bfloat16
    with pytest.raises(diffjax.PretrainedError, match=r"d_model cannot be overridden"):
        diffjax.from_pretrained(str(good_dir), d_model=64)


def _tiny(**kw):
    return diffjax.TransformerLM(
        diffjax.ModelConfig(
            vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=2, ffn_dim=32, **kw
        ),
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(attention="diff_v2", gate="headwise"), r"gate='headwise'"),
        (dict(attention="diff_v1", lambda_init=0.5), r"lambda_init=0\.5"),
        (dict(attention="diff_v1", diff_norm=False), r"diff_norm=False"),
        (
            dict(attention="diff_v1", norm_eps=1e-6),
            r"diff_norm_eps=1e-05 differs from norm_eps=1e-06",
        ),
    ],
)
def test_export_refusals(tmp_path, kw, match):
    with pytest.raises(diffjax.PretrainedError, match=match):
        diffjax.save_pretrained(_tiny(**kw), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_export_never_overwrites(tmp_path):
    model = _tiny(attention="diff_v1")
    diffjax.save_pretrained(model, str(tmp_path / "x"))
    before = (tmp_path / "x" / "model.safetensors").read_bytes()
    with pytest.raises(diffjax.PretrainedError, match=r"already holds a checkpoint"):
        diffjax.save_pretrained(_tiny(attention="standard"), str(tmp_path / "x"))
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == before


def test_export_copies_tokenizer_files(tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    diffjax.save_pretrained(
        _tiny(attention="standard"), str(tmp_path / "x"), tokenizer_from=str(src)
    )
    assert (tmp_path / "x" / "tokenizer.json").read_text() == "{}"
    with pytest.raises(diffjax.PretrainedError, match=r"holds none of tokenizer\.json"):
        diffjax.save_pretrained(
            _tiny(attention="standard"), str(tmp_path / "y"), tokenizer_from=str(tmp_path)
        )


# ---------------------------------------------------------------------------- train.py
def test_train_py_starts_from_a_checkpoint(tmp_path):
    """``train.init_from``: the model config and the parameters come from the checkpoint (with a
    learning rate of 1e-9 the trained model still gives transformers' logits)."""
    from diffjax.train.checkpoint import load_model
    from diffjax.compare.cli import main

    ref_model = hf_model("diffllama", heads=4, kv_heads=2, hidden=32, layers=1, vocab=259)
    ref_model.save_pretrained(tmp_path / "hf")
    args = [
        f"run.dir={tmp_path / 'run'}",
        f"train.init_from={tmp_path / 'hf'}",
        *tiny_run(
            "train.steps=2",
            "train.lr=1e-9",
            "train.warmup_steps=0",
            "train.eval_every=2",
            "train.checkpoint_every=2",
            drop=(*MODEL_KEYS, "compare.throughput_rounds"),  # the model: the export's
        ),
    ]
    assert main(args) == 2  # compare.twins=standard would train the twin from random weights
    assert main(args + ["compare.twins="]) == 0
    model = load_model(str(tmp_path / "run" / "diff" / "seed_0"), "latest")
    assert model.config == hf.config_from_pretrained(str(tmp_path / "hf"))
    toks = tokens(vocab=259)
    assert_logits_close(jax_logits(model, toks), torch_logits(ref_model, toks))
    # and out again from the run's folder, with the run's tokenizer (bytes: a tokenizer.json)
    from diffjax.train import export_model

    folder, out = str(tmp_path / "run" / "diff" / "seed_0"), str(tmp_path / "out")
    assert export_model(folder, out, "latest") == out
    assert_logits_close(torch_logits(hf_load(out), toks), jax_logits(model, toks))
    text = "héllo <eos>\n"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(text)["input_ids"] == list(text.encode()) and tok.eos_token_id == 257
    with pytest.raises(diffjax.PretrainedError, match="already holds a checkpoint"):
        export_model(folder, out, "latest")
